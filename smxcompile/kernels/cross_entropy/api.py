"""The public cross-entropy functions: :func:`linear_cross_entropy` (cut cross-entropy of ``input @ weight.T +
bias``), :func:`cross_entropy` (``F.cross_entropy`` online) and :func:`linear_ce_core`, the shared core that
graph passes also call."""

from __future__ import annotations

from typing import NamedTuple

import torch

from .. import config
from ..common import FLOAT_DTYPES
from .loss import (check_linear, check_options, compose_loss, finish_output, fp32_logit_operands, is_dtensor,
                   linear_loss_dtype, loss_dtype, needs_grad, prediction_outputs, resolve_filter_eps, row_count,
                   shift_targets, split_targets, unshift_output)
from .ops import ce_stats, linear_ce_loss, linear_ce_loss_argmax, linear_ce_stats, linear_ce_stats_argmax
from .vocab_parallel import vocab_parallel_linear_cross_entropy

__all__ = ["linear_cross_entropy", "cross_entropy", "linear_ce_core"]

def linear_cross_entropy(
    input: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    class_weight: torch.Tensor | None = None,
    token_weight: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    scale: float = 1.0,
    softcap: float | None = None,
    lse_square_scale: float = 0.0,
    return_lse: bool = False,
    return_z_loss: bool = False,
    shift: bool | int = False,
    return_token_accuracy: bool = False,
    return_predicted_tokens: bool = False,
    dtype: torch.dtype | None = None,
    filter_eps: float | str | None = "auto",
    precise_grad: bool = False,
    chunk_bytes: int | None = None,
    process_group=None,
):
    """Cross-entropy of ``input @ weight.T + bias`` without materializing the N x V logits (cut cross-entropy).

    Equals ``F.cross_entropy(z, target, weight=class_weight, ...)`` with ``z = softcap * tanh(scale * (input @
    weight.T + bias) / softcap)`` (``scale * (...)`` without softcap), forward and backward. fp16 / bf16: logits,
    loss, lse and softmax stay fp32, only the final gradients are rounded to the input dtype (Apple CCE's numerics).

    Args:
        input: embeddings ``(*, D)``, fp16 / bf16 / fp32 / fp64. weight: the classifier ``(V, D)``, same dtype.
        target: class indices ``(*)`` (integer) or class probabilities ``(*, V)`` (float, soft targets).
        bias: ``(V,)`` or None. class_weight: ``(V,)`` per-class weights (``F.cross_entropy``'s ``weight``).
        token_weight: ``(*)`` per-token loss factors; ``mean`` divides by the sum over non-ignored tokens of
            token weight times the target's class weight.
        ignore_index, reduction, label_smoothing: as ``F.cross_entropy`` (a mean over zero targets is NaN).
        scale: multiplies the logits (``1 / temperature``). softcap: Gemma 2's logit soft-cap, or None.
        lse_square_scale: z-loss coefficient (PaLM: 1e-4): adds ``lse_square_scale * lse^2`` per valid token
            (times its token weight); ``mean`` divides this term by the token-weight sum, not the class-weighted one.
        return_lse, return_z_loss: also return the per-token lse (fp32; fp64 for fp64 input; differentiable) / the
            z-loss (detached).
        shift: Apple CCE's ``shift``, ``True`` or an int ``k`` in ``[0, T)``: with ``input`` (*, T, D) and
            ``target`` (*, T), the loss of ``input[..., :-k, :]`` against ``target[..., k:]`` without copying
            ``input``; per-token outputs have shape (*, T - k), ``token_weight`` the target's. Class indices only.
        return_token_accuracy: also return the share of non-ignored tokens whose argmax of ``z`` is the target
            (Liger-Kernel's): an unweighted, detached fp32 scalar (per token for ``none``; NaN with no valid token).
        return_predicted_tokens: also return each token's argmax of ``z`` (int64, -1 on ignored tokens; the first
            maximum of the fp32 logits). Both prediction outputs: class-index targets, no ``process_group``.
        dtype: the loss's dtype; default fp32 for fp16 / bf16 inputs (as CCE and Liger), else ``input.dtype``.
        filter_eps: CCE's gradient filtering on CUDA: ``"auto"`` (``finfo(input.dtype).eps / 32``), a float, or
            None (exact). Off with label smoothing or returned logits.
        precise_grad: fp16 / bf16 on CUDA: the logits' gradient enters the products as ``hi + lo`` (about 16
            significant bits, twice the FLOPs) instead of rounded once to the input dtype.
        chunk_bytes: bytes of one logits chunk on the torch path (default 32 MiB).
        process_group: vocabulary parallelism: ``weight`` and ``bias`` are this rank's rows (or ``weight`` is a
            DTensor sharded on dim 0); see :func:`.vocab_parallel.vocab_parallel_linear_cross_entropy`.

    Returns:
        ``loss``, or ``CrossEntropyOutput(loss, lse, z_loss, token_accuracy, predicted_tokens)`` when a
        ``return_*`` flag is set (None for the fields not asked for). Gradients reach input, weight, bias, lse.

    Raises:
        TypeError: non-tensor or non-float input / weight, mismatched dtypes (as ``F.linear``), targets neither
            integer nor float, a non-int ``ignore_index``, a ``shift`` neither bool nor int, a non-float ``dtype``.
        ValueError: mismatched shapes, an unknown ``reduction``, ``label_smoothing`` outside [0, 1], ``softcap``
            not finite and > 0, ``lse_square_scale < 0``, ``shift`` outside ``[0, T)``.
        NotImplementedError: probability targets or class weights that require grad; probability targets with
            ``shift`` or the prediction outputs; the prediction outputs with vocabulary parallelism.
        RuntimeError: double backward through the mean / sum path; tensors on different devices.
        IndexError: a non-ignored target outside ``[0, V)`` (CPU; on CUDA that token's loss is NaN).

    Source: Wijmans et al., "Cut Your Losses in Large-Vocabulary Language Models" (2024); Milakov & Gimelshein
    (2018); Prieto et al. (2025). Peers: ``F.linear_cross_entropy``, Apple's CCE, Liger-Kernel's fused linear CE.
    """
    target, token_weight, shift_by = shift_targets(target, token_weight, shift, ignore_index)
    if process_group is not None or is_dtensor(weight):
        if return_token_accuracy or return_predicted_tokens:
            raise NotImplementedError("return_token_accuracy / return_predicted_tokens are not supported with "
                                      "vocabulary parallelism (process_group or a DTensor weight)")
        out = vocab_parallel_linear_cross_entropy(
            input, weight, target, process_group=process_group, bias=bias, class_weight=class_weight,
            token_weight=token_weight, ignore_index=ignore_index, reduction=reduction,
            label_smoothing=label_smoothing, scale=scale, softcap=softcap, lse_square_scale=lse_square_scale,
            return_lse=return_lse, return_z_loss=return_z_loss, dtype=dtype, filter_eps=filter_eps,
            precise_grad=precise_grad, chunk_bytes=chunk_bytes)
        return unshift_output(out, shift_by, reduction)
    operands = _linear_operands(
        input, weight, target, bias=bias, class_weight=class_weight, token_weight=token_weight,
        ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing, scale=scale, softcap=softcap,
        lse_square_scale=lse_square_scale, dtype=dtype, filter_eps=filter_eps,
        need_prediction=bool(return_token_accuracy or return_predicted_tokens))
    out = _linear_loss(
        operands, class_weight=class_weight, ignore_index=int(ignore_index), reduction=reduction,
        label_smoothing=float(label_smoothing), scale=float(scale), softcap=None if softcap is None else float(softcap),
        lse_square_scale=float(lse_square_scale), return_lse=return_lse, return_z_loss=return_z_loss,
        return_token_accuracy=return_token_accuracy, return_predicted_tokens=return_predicted_tokens,
        chunk_bytes=int(chunk_bytes or 0), precise_grad=bool(precise_grad))
    return unshift_output(out, shift_by, reduction)


class _LinearOperands(NamedTuple):
    """:func:`linear_cross_entropy`'s checked single-device operands, rows flattened to N."""

    x2: torch.Tensor                    # (N, D)
    weight: torch.Tensor                # (V, D)
    bias: torch.Tensor | None           # (V,)
    tgt: torch.Tensor | None            # (N,) int64, or None with probabilities
    probs: torch.Tensor | None          # (N, V), or None with class indices
    token_weight: torch.Tensor | None   # (N,)
    lead: tuple                         # the rows' shape
    out_dtype: torch.dtype              # the loss's dtype
    filter_eps: float | None


def _linear_operands(input, weight, target, *, bias, class_weight, token_weight, ignore_index, reduction,
                     label_smoothing, scale, softcap, lse_square_scale, dtype, filter_eps,
                     need_prediction) -> _LinearOperands:
    """Check :func:`linear_cross_entropy`'s single-device arguments (raising as it documents) and flatten the
    rows; fp16 / bf16 operands become fp32 on the torch path (fp32 logits, CCE's numerics)."""
    for name, t in (("input", input), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a Tensor, got {type(t).__name__}")
    input, weight, bias = check_linear(input, weight, bias)
    filter_eps = resolve_filter_eps(filter_eps, input.dtype)    # the operands' dtype (after autocast)
    vocab = weight.shape[0]
    lead = tuple(input.shape[:-1])
    tgt, probs = split_targets(target, lead, vocab, "input")
    rows = row_count(lead)
    check_options(target, rows, vocab, class_weight=class_weight, token_weight=token_weight,
                  ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing, softcap=softcap,
                  scale=scale, lse_square_scale=lse_square_scale, what="input", device=input.device, dtype=dtype)
    if need_prediction and probs is not None:
        raise NotImplementedError("return_token_accuracy / return_predicted_tokens need class-index targets, "
                                  "not probabilities")
    x2 = input.reshape(rows, input.shape[-1])
    out_dtype = linear_loss_dtype(dtype, input)
    if probs is not None or not config.use_triton(x2):
        x2, weight, bias = fp32_logit_operands(x2, weight, bias)
    return _LinearOperands(x2, weight, bias, tgt, probs, None if token_weight is None else token_weight.reshape(-1),
                          lead, out_dtype, filter_eps)


def _linear_loss(operands: _LinearOperands, *, class_weight, ignore_index, reduction, label_smoothing, scale, softcap,
                 lse_square_scale, return_lse, return_z_loss, return_token_accuracy, return_predicted_tokens,
                 chunk_bytes, precise_grad):
    """Run the op :func:`linear_ce_core` picks on checked operands and shape the result as
    :func:`linear_cross_entropy` returns it (before the shift is undone)."""
    need_prediction = bool(return_token_accuracy or return_predicted_tokens)
    loss, z_loss, lse, _, predicted = _core(
        operands.x2, operands.weight, operands.bias, tgt=operands.tgt, probs=operands.probs,
        class_weight=class_weight, token_weight=operands.token_weight, ignore_index=ignore_index,
        reduction=reduction, eps=label_smoothing, z_scale=lse_square_scale, scale=scale, softcap=softcap,
        return_logits=False, logits_dtype=None, chunk_bytes=chunk_bytes, need_lse=return_lse,
        filter_eps=operands.filter_eps, need_pred=need_prediction, precise_grad=precise_grad)
    accuracy, tokens = None, None
    if need_prediction:
        accuracy, tokens = prediction_outputs(predicted, operands.tgt, ignore_index, reduction, operands.lead,
                                              return_token_accuracy, return_predicted_tokens)
    return finish_output(loss, z_loss, lse, lead_shape=operands.lead, reduction=reduction,
                         out_dtype=operands.out_dtype, return_lse=return_lse, return_z_loss=return_z_loss,
                         token_accuracy=accuracy, predicted_tokens=tokens)


def linear_ce_core(x2, weight, bias, tgt, probs, class_weight, token_weight, ignore_index, reduction, eps, z_scale,
                   scale, softcap, return_logits, logits_dtype, chunk_bytes, need_lse=False, filter_eps=None):
    """Validated, flattened arguments -> (loss or rows (fp32/fp64), z_loss or None, lse (N,) or None, logits or None).

    ``x2`` (N, D), ``weight`` (V, D), ``bias`` (V,) or None, one float dtype; ``tgt`` (N,) int64 or ``probs``
    (N, V) (the other None); ``class_weight`` (V,), ``token_weight`` (N,) or None; ``eps`` the label smoothing,
    ``z_scale`` the z-loss coefficient; ``chunk_bytes`` 0 for the default; the rest as :func:`linear_cross_entropy`.
    The torch path forms the logits in the operands' dtype, as ``F.linear``. Raises IndexError for a target
    outside [0, V) that is not ``ignore_index`` (CPU).
    """
    return _core(x2, weight, bias, tgt=tgt, probs=probs, class_weight=class_weight, token_weight=token_weight,
                 ignore_index=ignore_index, reduction=reduction, eps=eps, z_scale=z_scale, scale=scale,
                 softcap=softcap, return_logits=return_logits, logits_dtype=logits_dtype, chunk_bytes=chunk_bytes,
                 need_lse=need_lse, filter_eps=filter_eps, need_pred=False)[:4]


def _core(x2, weight, bias, *, tgt, probs, class_weight, token_weight, ignore_index, reduction, eps, z_scale, scale,
          softcap, return_logits, logits_dtype, chunk_bytes, need_lse, filter_eps, need_pred, precise_grad=False):
    """:func:`linear_ce_core`, plus each row's argmax (N,) int64 as a fifth result when ``need_pred`` (class-index
    targets, no returned logits; None otherwise), from the ``*_argmax`` ops."""
    vocab = weight.shape[0]
    # the fused op has no gradient for token_weight (compose_loss treats it as a differentiable factor);
    # on CUDA its matmul chunks neither return logits nor take the argmax
    fused = (probs is None and reduction != "none" and not need_lse and needs_grad(x2, weight, bias)
             and not needs_grad(token_weight)
             and (not config.use_triton(x2) or (not return_logits and not need_pred)))
    loss_options = dict(class_weight=class_weight, token_weight=token_weight, ignore_index=ignore_index,
                        reduction=reduction, label_smoothing=eps, lse_square_scale=z_scale, scale=scale,
                        softcap=softcap)
    if fused and need_pred:
        loss, z_loss, predicted, _, _, _ = linear_ce_loss_argmax(x2, weight, bias, tgt, **loss_options,
                                                                 chunk_bytes=chunk_bytes)
        return loss, (z_loss if z_scale else None), None, None, predicted
    if fused:
        loss, z_loss, logits, _, _, _ = linear_ce_loss(
            x2, weight, bias, tgt, **loss_options, return_logits=return_logits, logits_dtype=logits_dtype,
            chunk_bytes=chunk_bytes, filter_eps=filter_eps, precise_grad=precise_grad)
        return loss, (z_loss if z_scale else None), None, (logits if return_logits else None), None
    extra = {}
    stat_options = dict(class_weight=class_weight, ignore_index=ignore_index, scale=scale, softcap=softcap)

    def stats(need_weighted_sum, target, target_probs):
        if need_pred:
            lse, target_logit, other_mass, weighted_sum, extra["predicted"] = linear_ce_stats_argmax(
                x2, weight, bias, target, **stat_options, need_weighted_sum=need_weighted_sum,
                chunk_bytes=chunk_bytes, filter_eps=filter_eps, precise_grad=precise_grad)
            return lse, target_logit, other_mass, weighted_sum
        lse, target_logit, other_mass, weighted_sum, logits = linear_ce_stats(
            x2, weight, bias, target, target_probs, **stat_options, need_weighted_sum=need_weighted_sum,
            return_logits=return_logits, logits_dtype=logits_dtype, chunk_bytes=chunk_bytes, filter_eps=filter_eps,
            precise_grad=precise_grad)
        extra["logits"] = logits if return_logits else None
        return lse, target_logit, other_mass, weighted_sum

    loss, z_loss, lse = _run_stats(stats, tgt, probs, rows=x2.shape[0], vocab=vocab, class_weight=class_weight,
                                   token_weight=token_weight, ignore_index=ignore_index, reduction=reduction,
                                   eps=eps, z_scale=z_scale)
    return loss, z_loss, lse, extra.get("logits"), extra.get("predicted")


def _run_stats(stats, tgt, probs, *, rows, vocab, class_weight, token_weight, ignore_index, reduction, eps, z_scale):
    """Run a statistics op and compose the loss: -> (loss or rows, z_loss or None, lse)."""
    loss_options = dict(v=vocab, class_weight=class_weight, token_weight=token_weight, ignore_index=ignore_index,
                        reduction=reduction, lse_square_scale=z_scale)
    if probs is not None:
        # soft targets: weighted_sum = sum_j w_j q'_j z_ij with the smoothed q'
        smoothed = probs if not eps else probs * (1.0 - eps) + eps / vocab
        dummy = torch.zeros(rows, dtype=torch.long, device=probs.device)
        lse, target_logit, _, weighted_sum = stats(True, dummy, smoothed)
        loss, z_loss = compose_loss(lse, target_logit, weighted_sum, target=None, probs=smoothed, **loss_options,
                                    label_smoothing=0.0)
    else:
        lse, target_logit, _, weighted_sum = stats(bool(eps), tgt, None)
        loss, z_loss = compose_loss(lse, target_logit, weighted_sum, target=tgt, probs=None, **loss_options,
                                    label_smoothing=eps)
    return loss, z_loss, lse


def cross_entropy(
    input: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    *,
    dim: int | None = None,
    token_weight: torch.Tensor | None = None,
    scale: float = 1.0,
    softcap: float | None = None,
    lse_square_scale: float = 0.0,
    return_lse: bool = False,
    return_z_loss: bool = False,
    dtype: torch.dtype | None = None,
    chunk_bytes: int | None = None,
):
    """``F.cross_entropy`` computed online: no log-softmax, no fp32 copy of the logits, one gradient buffer.

    Same arguments and results as ``F.cross_entropy`` (``weight``: per-class weights; class-index or probability
    targets), plus :func:`linear_cross_entropy`'s ``token_weight``, ``scale``, ``softcap``, ``lse_square_scale``,
    ``return_lse``, ``return_z_loss`` and ``dtype``; returns and raises as it does. ``input``: logits ``(N, C)``,
    ``(C,)`` or ``(N, C, d1, ...)``, fp16 / bf16 / fp32 / fp64, any strides, the classes on ``dim`` (None:
    torch's, dim 1, or 0 for a 1-d input; ``dim=-1`` takes ``(B, T, V)`` logits with ``(B, T)`` targets).

    Source: online log-sum-exp (Milakov & Gimelshein, 2018); the collapse-safe target gradient (Prieto et al.,
    2025). Peer: Liger-Kernel's cross-entropy.
    """
    if not isinstance(input, torch.Tensor):
        raise TypeError(f"input must be a Tensor, got {type(input).__name__}")
    if input.dtype not in FLOAT_DTYPES:
        raise TypeError(f"input must be floating point, got {input.dtype}")
    if input.dim() == 0:
        raise ValueError("input must have at least one dimension (the classes)")
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"target must be a Tensor, got {type(target).__name__}")
    if dim is None:
        dim = 1 if input.dim() >= 2 else 0  # F.cross_entropy's class dim
    if isinstance(dim, bool) or not isinstance(dim, int) or not -input.dim() <= dim < input.dim():
        raise IndexError(f"Dimension out of range (expected to be in range of [{-input.dim()}, "
                         f"{input.dim() - 1}], but got {dim})")
    class_dim = dim % input.dim()
    logits = input.movedim(class_dim, -1) if class_dim != input.dim() - 1 else input
    vocab = logits.shape[-1]
    lead = tuple(logits.shape[:-1])
    if target.dtype.is_floating_point and class_dim != input.dim() - 1:
        target = target.movedim(class_dim, -1)
    tgt, probs = split_targets(target, lead, vocab, "logits")
    rows = row_count(lead)
    check_options(target, rows, vocab, class_weight=weight, token_weight=token_weight, ignore_index=ignore_index,
                  reduction=reduction, label_smoothing=label_smoothing, softcap=softcap, scale=scale,
                  lse_square_scale=lse_square_scale, what="logits", device=input.device, dtype=dtype)
    if (config.eager_aten(input) and not needs_grad(input, weight) and not chunk_bytes
            and input.dtype in (torch.float32, torch.float64) and dtype in (None, input.dtype)
            and target.dtype in (torch.int64, input.dtype) and (weight is None or weight.dtype == input.dtype)
            and token_weight is None and scale == 1.0 and softcap is None and lse_square_scale == 0.0
            and not (return_lse or return_z_loss) and class_dim == (1 if input.dim() >= 2 else 0)):
        # CPU inference with nothing F.cross_entropy lacks: its fused ATen kernel is faster (bench_eager_ops.py)
        return torch.nn.functional.cross_entropy(input, target, weight, ignore_index=ignore_index,
                                                 reduction=reduction, label_smoothing=label_smoothing)
    logits2 = logits.reshape(rows, vocab)
    stat_options = dict(class_weight=weight, ignore_index=int(ignore_index), scale=float(scale),
                        softcap=None if softcap is None else float(softcap), chunk_bytes=int(chunk_bytes or 0))

    def stats(need_weighted_sum, target_rows, target_probs):
        return ce_stats(logits2, target_rows, target_probs, **stat_options, need_weighted_sum=need_weighted_sum)

    loss, z_loss, lse = _run_stats(
        stats, tgt, probs, rows=rows, vocab=vocab, class_weight=weight,
        token_weight=None if token_weight is None else token_weight.reshape(-1), ignore_index=int(ignore_index),
        reduction=reduction, eps=float(label_smoothing), z_scale=float(lse_square_scale))
    return finish_output(loss, z_loss, lse, lead_shape=lead, reduction=reduction, out_dtype=loss_dtype(dtype, input),
                         return_lse=return_lse, return_z_loss=return_z_loss)
