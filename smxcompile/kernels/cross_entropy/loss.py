"""Cross-entropy from its row statistics: :func:`compose_loss` (every variant of torch's cross_entropy as a few
ops on N-vectors), the result's form (:class:`CrossEntropyOutput`, :func:`finish_output`) and the argument
checks the single-device and vocabulary-parallel functions share."""

from __future__ import annotations

import numbers
import operator
from typing import NamedTuple

import torch

from ..common import FLOAT_DTYPES, HALF_DTYPES, autocast_on, autocast_operands

__all__ = ["CrossEntropyOutput", "compose_loss", "check_options", "split_targets", "check_range", "finish_output",
           "loss_dtype", "linear_loss_dtype", "check_linear", "is_dtensor", "needs_grad", "shift_targets",
           "unshift_output", "prediction_outputs", "fp32_logit_operands", "resolve_filter_eps", "row_count"]


_REDUCTIONS = {"none": 0, "mean": 1, "sum": 2}


class CrossEntropyOutput(NamedTuple):
    """What the cross-entropy functions return when a ``return_*`` flag is set (None in the fields not asked for):
    ``loss`` (z-loss included), ``lse`` (per token, fp32, differentiable), ``z_loss`` (the z-loss term alone,
    reduced like ``loss``, detached), ``token_accuracy`` (fp32, detached; per token for ``reduction="none"``,
    0.0 on ignored tokens) and ``predicted_tokens`` (int64, -1 on ignored tokens), as Liger-Kernel's."""

    loss: torch.Tensor
    lse: torch.Tensor | None
    z_loss: torch.Tensor | None
    token_accuracy: torch.Tensor | None = None
    predicted_tokens: torch.Tensor | None = None


def compose_loss(lse, tl, ws, target, probs, v, class_weight, token_weight, ignore_index, reduction, label_smoothing,
                 lse_square_scale):
    """The loss (and z-loss) from the row statistics, with torch's cross_entropy semantics: -> ``(loss, z_loss or
    None)``, scalars (or (N,) rows for ``reduction="none"``) in ``lse``'s dtype. ``lse``, ``tl`` (target logit),
    ``ws`` (weighted sum or None): (N,); ``target`` (N,) or ``probs`` (N, V) (the other None).

    Class-index targets, row i valid when ``target_i != ignore_index``:
        nll_i    = w_{y_i} (lse_i - z_{i,y_i})
        smooth_i = (sum_j w_j lse_i - sum_j w_j z_ij) / V
        loss_i   = tw_i ((1 - eps) nll_i + eps smooth_i)         (0 for ignored rows)
        mean     = sum_i loss_i / sum_{valid i} tw_i w_{y_i}      (torch: NaN when nothing is valid)
    Soft targets q (no ignore_index): loss_i = tw_i sum_j w_j q'_j (lse_i - z_ij), q' = (1-eps) q + eps/V,
        mean = sum_i loss_i / sum_i tw_i (torch: / N).
    z-loss: zl_i = lse_square_scale * tw_i * lse_i^2 on valid rows; mean over sum_{valid} tw_i.
    """
    acc = lse.dtype
    eps = label_smoothing
    tw = None if token_weight is None else token_weight.to(acc)
    if probs is None:
        valid = target != ignore_index
        if class_weight is not None:
            cw = class_weight.to(acc)
            wy = cw[torch.where(valid & (target >= 0) & (target < v), target, 0)]
            wsum = cw.sum()
        else:
            wy, wsum = None, float(v)
        nll = lse - tl
        if wy is not None:
            nll = nll * wy
        row = nll
        if eps:
            smooth = (lse * wsum - ws) / v
            row = (1.0 - eps) * nll + eps * smooth
        if tw is not None:
            row = row * tw
        row = torch.where(valid, row, 0.0)
        denom_w = torch.where(valid, 1.0, 0.0).to(acc)
        if wy is not None:
            denom_w = denom_w * wy
        if tw is not None:
            denom_w = denom_w * tw
        zvalid = valid
    else:
        # ``probs`` are the (already smoothed) q'; ws = sum_j w_j q'_j z_ij
        qw = (probs.to(acc) if class_weight is None else probs.to(acc) * class_weight.to(acc)).sum(1)
        row = lse * qw - ws
        if tw is not None:
            row = row * tw
        denom_w = tw if tw is not None else torch.ones_like(lse)
        zvalid = torch.ones_like(lse, dtype=torch.bool)
    zl_rows = None
    if lse_square_scale:
        zl_rows = lse_square_scale * lse * lse
        if tw is not None:
            zl_rows = zl_rows * tw
        zl_rows = torch.where(zvalid, zl_rows, 0.0)
    if reduction == "none":
        return row, zl_rows
    if reduction == "sum":
        return row.sum(), (zl_rows.sum() if zl_rows is not None else None)
    loss = row.sum() / denom_w.sum()
    zl = None
    if zl_rows is not None:
        zcount = torch.where(zvalid, tw if tw is not None else torch.ones_like(lse), 0.0).sum()
        zl = zl_rows.sum() / zcount
    return loss, zl


def check_options(target, n, v, class_weight, token_weight, ignore_index, reduction, label_smoothing, softcap,
                  scale, lse_square_scale, what, device, dtype):
    """Check the options the cross-entropy functions share (``n`` rows, ``v`` classes; ``what`` names the
    tensor on ``device`` whose device the others must share). Raises TypeError, ValueError, NotImplementedError
    or RuntimeError, as :func:`~smxcompile.kernels.cross_entropy.linear_cross_entropy` documents them."""
    if dtype is not None and (not isinstance(dtype, torch.dtype) or dtype not in FLOAT_DTYPES):
        raise TypeError(f"dtype must be a floating point dtype (the loss's dtype) or None, got {dtype!r}")
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be 'none', 'mean' or 'sum', got {reduction!r}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {ignore_index!r}")
    if not isinstance(label_smoothing, (int, float)) or not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing!r}")
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float))
                                or not 0 < softcap < float("inf")):
        raise ValueError(f"softcap must be a finite number > 0 or None, got {softcap!r}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or scale != scale:
        raise TypeError(f"scale must be a real number, got {scale!r}")
    if not isinstance(lse_square_scale, (int, float)) or lse_square_scale < 0:
        raise ValueError(f"lse_square_scale must be a number >= 0, got {lse_square_scale!r}")
    if class_weight is not None:
        if not isinstance(class_weight, torch.Tensor) or class_weight.shape != (v,):
            shape = getattr(class_weight, "shape", None)
            raise ValueError(f"class_weight must be a tensor of shape ({v},) (one weight per class), got {shape}")
        if not class_weight.dtype.is_floating_point:
            raise TypeError(f"class_weight must be floating point, got {class_weight.dtype}")
        if class_weight.requires_grad and torch.is_grad_enabled():
            # as F.cross_entropy (which raises a RuntimeError; NotImplementedError is one)
            raise NotImplementedError("gradients w.r.t. class_weight are not supported (neither are they by "
                                      "F.cross_entropy); pass class_weight.detach()")
    if token_weight is not None:
        if not isinstance(token_weight, torch.Tensor) or token_weight.numel() != n:
            raise ValueError(f"token_weight must have one weight per target ({n}), got shape "
                             f"{getattr(token_weight, 'shape', None)}")
    for name, t in (("target", target), ("class_weight", class_weight), ("token_weight", token_weight)):
        if t is not None and t.device != device:
            raise RuntimeError(f"Expected all tensors to be on the same device: {what} is on {device}, "
                               f"{name} is on {t.device}")


def split_targets(target, lead_shape, v, what):
    """``(index_target (N,) int64, None)`` or ``(None, probs (N, V))`` for rows of shape ``lead_shape`` (named
    ``what`` in errors). Raises TypeError (not a tensor, neither integer nor float), ValueError (a shape that does
    not match the rows), NotImplementedError (probability targets that require grad)."""
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"target must be a Tensor, got {type(target).__name__}")
    if target.dtype.is_floating_point:
        if target.requires_grad and torch.is_grad_enabled():
            raise NotImplementedError("gradients w.r.t. probability targets are not supported; pass target.detach() "
                                      "or use F.cross_entropy")
        if tuple(target.shape) != (*lead_shape, v):
            raise ValueError(f"probability targets must have shape {(*lead_shape, v)} (one distribution per "
                             f"{what} row), got {tuple(target.shape)}")
        return None, target.reshape(-1, v)
    if target.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
        raise TypeError(f"target must hold class indices (integer) or probabilities (float), got {target.dtype}")
    if tuple(target.shape) != tuple(lead_shape):
        raise ValueError(f"target of shape {tuple(target.shape)} does not match the {what} rows {tuple(lead_shape)}")
    return target.reshape(-1).long(), None


def check_range(target, ignore_index, v):
    """torch's IndexError for a target (not ``ignore_index``) outside ``[0, v)``, on CPU (nothing is checked on
    CUDA); it runs inside the ops, so also under torch.compile."""
    if target is None or target.numel() == 0 or target.is_cuda:
        return  # on CUDA the kernels give NaN for an out-of-range target instead of a host sync
    bad = (target != ignore_index) & ((target < 0) | (target >= v))
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise IndexError(f"Target {int(target[i])} is out of bounds (number of classes {v}, "
                         f"ignore_index {ignore_index})")


def finish_output(loss, zl, lse_rows, lead_shape, reduction, out_dtype, return_lse, return_z_loss,
                  token_accuracy=None, predicted_tokens=None):
    """The functions' result from :func:`compose_loss`'s: the z-loss added, rows reshaped to ``lead_shape``
    (``reduction="none"``), cast to ``out_dtype``; ``loss``, or :class:`CrossEntropyOutput` when ``return_lse``
    or ``return_z_loss``, or ``token_accuracy`` / ``predicted_tokens`` (from :func:`prediction_outputs`) are
    given."""
    if reduction == "none":
        loss = loss.reshape(lead_shape)
        if zl is not None:
            loss = loss + zl.reshape(lead_shape)
            zl = zl.reshape(lead_shape)
    elif zl is not None:
        loss = loss + zl
    loss = loss.to(out_dtype)
    if not (return_lse or return_z_loss or token_accuracy is not None or predicted_tokens is not None):
        return loss
    return CrossEntropyOutput(
        loss,
        lse_rows.reshape(lead_shape) if return_lse else None,
        (zl.detach().to(out_dtype) if zl is not None else torch.zeros_like(loss).detach()) if return_z_loss else None,
        token_accuracy,
        predicted_tokens,
    )


def prediction_outputs(pred, target, ignore_index, reduction, lead_shape, want_accuracy, want_tokens):
    """``(token_accuracy or None, predicted_tokens or None)`` from the (N,) int64 row argmax ``pred`` and the
    (N,) class-index ``target``; ignored rows get -1 (as Liger-Kernel's kernels write), and count neither as
    hits nor in the denominator. The accuracy: ``hits / valid`` (fp32 scalar; NaN when no target is valid,
    as torch's mean over zero elements), or per token (``reduction="none"``, ``lead_shape``)."""
    valid = target != ignore_index
    pred = torch.where(valid, pred, -1)
    acc = None
    if want_accuracy:
        hit = ((pred == target) & valid).to(torch.float32)
        acc = hit.reshape(lead_shape) if reduction == "none" else hit.sum() / valid.sum()
    return acc, (pred.reshape(lead_shape) if want_tokens else None)


def shift_targets(target, token_weight, shift, ignore_index):
    """Apple CCE's ``shift``: position ``i``'s hidden state predicts ``target[..., i + k]`` (``k = int(shift)``).

    The targets (and ``token_weight``, of their shape) move left by ``k`` along the last dim, the last ``k``
    positions ignored (weight 0): the loss and gradients of ``input[..., :-k, :]`` with ``target[..., k:]``
    without copying the hidden states. Returns ``(target, token_weight, k)`` (unchanged for ``k == 0``).

    Raises:
        TypeError: ``shift`` not a bool / int, ``target`` not a tensor, a non-int ``ignore_index``.
        ValueError: a 0-d ``target``, ``k`` outside ``[0, T)`` (CCE's range), ``token_weight`` not of the
            target's shape.
        NotImplementedError: probability (float) targets with ``k > 0``.
    """
    try:
        k = operator.index(shift)          # bool, int, numpy / config integers
    except TypeError:
        raise TypeError(f"shift must be a bool or an int, got {type(shift).__name__}") from None
    if k == 0:
        return target, token_weight, 0
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"target must be a Tensor, got {type(target).__name__}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {ignore_index!r}")
    if target.dtype.is_floating_point:
        raise NotImplementedError("shift needs class-index targets; with probability targets pass "
                                  "input[..., :-k, :] and target[..., k:, :] instead")
    if target.dim() == 0:
        raise ValueError("shift needs a sequence dim: target of shape (*, T) and input of shape (*, T, D), "
                         "got a 0-d target")
    if not 0 <= k < target.shape[-1]:
        raise ValueError(f"shift must be in [0, {target.shape[-1]}) (the target's last dim, the sequence), "
                         f"got {shift!r}")
    lead = tuple(target.shape[:-1])
    # int64 first: ignore_index (e.g. -100) need not fit a uint8 / int16 target
    tgt = torch.cat([target.long()[..., k:], target.new_full((*lead, k), ignore_index, dtype=torch.long)], -1)
    if token_weight is not None:
        if not isinstance(token_weight, torch.Tensor) or tuple(token_weight.shape) != tuple(target.shape):
            raise ValueError(f"with shift, token_weight must have the target's shape {tuple(target.shape)} (the "
                             f"weight of each target token), got {tuple(getattr(token_weight, 'shape', ()))}")
        token_weight = torch.cat([token_weight[..., k:], token_weight.new_zeros((*lead, k))], -1)
    return tgt, token_weight, k


def unshift_output(out, k, reduction):
    """:func:`finish_output`'s result for targets shifted by :func:`shift_targets`: the per-token outputs lose
    their last ``k`` (padded) positions, as CCE's ``loss[..., :-shift]``-shaped ``reduction="none"``."""
    if not k:
        return out

    def cut(t):
        return None if t is None else t[..., :t.shape[-1] - k]

    rows = reduction == "none"
    if not isinstance(out, CrossEntropyOutput):
        return cut(out) if rows else out
    return out._replace(loss=cut(out.loss) if rows else out.loss, lse=cut(out.lse),
                        z_loss=cut(out.z_loss) if rows else out.z_loss,
                        token_accuracy=cut(out.token_accuracy) if rows else out.token_accuracy,
                        predicted_tokens=cut(out.predicted_tokens))


def linear_loss_dtype(dtype, input):
    """:func:`linear_cross_entropy`'s loss dtype: ``dtype``, else fp32 for fp16 / bf16 ``input`` (CCE's and
    Liger's rule), else ``input.dtype``."""
    return dtype if dtype is not None else torch.float32 if input.dtype in HALF_DTYPES else input.dtype


def loss_dtype(dtype, input):
    """The loss's dtype: ``dtype``, else as ``F.cross_entropy`` on logits of ``input``'s dtype —
    which autocast runs in fp32 (cross-entropy is on autocast's fp32 list)."""
    if dtype is not None:
        return dtype
    if input.dtype in HALF_DTYPES and autocast_on(input.device):
        return torch.float32
    return input.dtype


def fp32_logit_operands(x2, weight, bias):
    """``(x2, weight, bias)`` as fp32 when ``x2`` is fp16 / bf16, else unchanged: Apple CCE's numerics (fp32
    logits) on the torch path, whose ops form the logits in their operands' dtype (as ``F.linear``, which the
    graph passes rely on); autograd rounds the gradients back once."""
    if x2.dtype not in HALF_DTYPES:
        return x2, weight, bias
    return x2.float(), weight.float(), (bias.float() if bias is not None else None)


def check_linear(input, weight, bias, rows: str = "V"):
    """``F.linear``'s operands, cast as autocast would, checked: -> (input, weight, bias). ``rows`` names the
    classifier's rows in the messages ("V", or "V_r": one rank's shard). Raises TypeError (non-float or mismatched
    dtypes), ValueError (shapes: input (*, D), weight (V, D), bias (V,)), RuntimeError (different devices)."""
    input, weight, bias = autocast_operands(input, weight, bias)
    if input.dtype not in FLOAT_DTYPES or weight.dtype not in FLOAT_DTYPES:
        raise TypeError(f"input and weight must be floating point, got {input.dtype} and {weight.dtype}")
    if weight.dim() != 2:
        raise ValueError(f"weight must be ({rows}, D), got shape {tuple(weight.shape)}")
    if input.dim() < 1 or input.shape[-1] != weight.shape[1]:
        raise ValueError(f"input (*, D) and weight ({rows}, D) disagree on D: {tuple(input.shape)} vs "
                         f"{tuple(weight.shape)}")
    if weight.dtype != input.dtype:
        raise TypeError(f"input and weight must have the same dtype (as for F.linear), got {input.dtype} and "
                        f"{weight.dtype}")
    v = weight.shape[0]
    if bias is not None and (not isinstance(bias, torch.Tensor) or bias.shape != (v,)):
        raise ValueError(f"bias must be a tensor of shape ({v},), got {getattr(bias, 'shape', None)}")
    if bias is not None and bias.dtype != input.dtype:
        raise TypeError(f"bias must have the dtype of input and weight (as for F.linear), got {bias.dtype} and "
                        f"{input.dtype}")
    if weight.device != input.device or (bias is not None and bias.device != input.device):
        raise RuntimeError(f"Expected all tensors to be on the same device: input is on {input.device}, weight on "
                           f"{weight.device}" + (f", bias on {bias.device}" if bias is not None else ""))
    return input, weight, bias


def is_dtensor(t) -> bool:
    """A DTensor (without importing torch.distributed when nothing distributed is in use)."""
    if type(t) is torch.Tensor or type(t) is torch.nn.Parameter or not isinstance(t, torch.Tensor):
        return False
    import torch.distributed as dist

    if not dist.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def row_count(lead_shape) -> int:
    """The number of rows, the product of ``lead_shape`` (1 for ``()``)."""
    rows = 1
    for size in lead_shape:
        rows *= size
    return rows


def needs_grad(*ts) -> bool:
    """Whether grad mode is on and one of ``ts`` (tensors or None) requires grad."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in ts)


def resolve_filter_eps(filter_eps, dtype: torch.dtype) -> float | None:
    """``filter_eps`` as a number: ``"auto"`` is CCE's ``finfo(dtype).eps / 32`` (cut_cross_entropy/utils.py).
    Raises ValueError for anything but None, ``"auto"`` or a float >= 0."""
    if isinstance(filter_eps, str) and filter_eps == "auto":
        return torch.finfo(dtype).eps / 32
    if filter_eps is not None and (isinstance(filter_eps, bool) or not isinstance(filter_eps, numbers.Real)
                                   or not filter_eps >= 0):
        raise ValueError(f"filter_eps must be None, 'auto' or a float >= 0, got {filter_eps!r}")
    return None if filter_eps is None else float(filter_eps)
