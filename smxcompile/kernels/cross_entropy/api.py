"""The public cross-entropy functions: :func:`linear_cross_entropy` (cut cross-entropy of ``input @ weight.T +
bias``), :func:`cross_entropy` (``F.cross_entropy`` online) and :func:`linear_ce_core`, the shared core that
graph passes also call."""

from __future__ import annotations

import torch

from .. import config
from ..common import FLOAT_DTYPES, HALF_DTYPES
from .loss import (check_linear, check_options, compose_loss, finish_output, fp32_logit_operands,
                   is_dtensor, loss_dtype, needs_grad, prediction_outputs, resolve_filter_eps, shift_targets,
                   split_targets, unshift_output)
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
    """Cross-entropy of ``input @ weight.T + bias`` without materializing the logits (cut cross-entropy).

    Equals ``F.cross_entropy(z, target, weight=class_weight, ignore_index=..., reduction=...,
    label_smoothing=...)`` with ``z = softcap * tanh(scale * (input @ weight.T + bias) / softcap)``
    (or ``scale * (...)`` without softcap; ``scale = 1 / temperature``), forward and backward,
    but the N x V logits never exist: only chunks of them (CPU) or tiles in on-chip memory
    (CUDA, Triton).

    Numerics (fp16 / bf16): the logits are fp32 from the matmul's accumulator on (never rounded to the
    input dtype, unlike ``F.linear``'s), and so are the loss, the lse and the softmax - one-hot of the
    backward; only the final ``grad_input`` / ``grad_weight`` / ``grad_bias`` are rounded to the input
    dtype. This is Apple CCE's criterion (Wijmans et al., 2024): per element ``|ours - gold| <= |torch -
    gold|`` (plus fp32 noise), gold in fp64 from the same inputs, torch = the bf16-logits path. On the
    torch path (CPU; soft targets anywhere) the half operands are upcast to fp32 once per call (measured
    faster on CPU than half matmuls, which also round the logits): an fp32 copy of ``input`` and ``weight``
    lives until the backward (a shard's, on the vocabulary-parallel path).

    Args:
        input: embeddings (hidden states), shape ``(*, D)``, fp32/bf16/fp16/fp64.
        weight: the classifier (LM head), shape ``(V, D)``, same dtype as ``input``
            (this is ``F.linear``'s weight; ``F.linear_cross_entropy`` calls it ``linear_weight``).
        target: class indices of shape ``(*)`` (int64/int32) or class probabilities of shape
            ``(*, V)`` (float, "soft targets").
        bias: ``(V,)`` or None (``F.linear_cross_entropy``'s ``linear_bias``).
        class_weight: per-class rescaling weight ``(V,)`` — ``F.cross_entropy``'s ``weight``.
        token_weight: per-token weights of shape ``(*)``; the loss of token i is multiplied by
            ``token_weight[i]`` and ``mean`` divides by the sum of the effective weights
            (token weight times class weight of the target) over non-ignored tokens.
        ignore_index: target value (any sign) whose tokens contribute nothing.
        reduction: ``"none"`` (shape ``(*)``), ``"mean"`` (a mean over zero valid targets is NaN
            with zero gradients, as in torch; on purpose unlike Liger-Kernel, which gives 0) or ``"sum"``.
        label_smoothing: in ``[0, 1]``, torch's definition.
        scale: multiplies the logits (``1 / temperature``).
        softcap: logit soft-capping ``softcap * tanh(z / softcap)`` (Gemma 2), or None.
        lse_square_scale: z-loss coefficient (PaLM: ``1e-4``): adds ``lse_square_scale * lse^2``
            per valid token (times its ``token_weight``). ``mean`` divides the z-term by the
            number (token-weight sum) of valid tokens — not by the class-weighted sum the CE term
            uses — so with ``class_weight`` it is not ``sum(none) / sum(class weights)``.
            0 (default) adds nothing.
        return_lse: also return the per-token log-sum-exp (fp32, differentiable).
        return_z_loss: also return the z-loss term alone (detached; it is already in ``loss``).
        shift: Apple CCE's ``shift`` (``cut_cross_entropy.linear_cross_entropy``): ``True`` (= 1) or an int
            ``k`` in ``[0, T)``: with ``input`` (*, T, D) and ``target`` (*, T), position ``i``'s hidden state
            predicts ``target[..., i + k]`` -- the loss of ``input[..., :-k, :]`` with ``target[..., k:]``
            (``F.cross_entropy(logits[:, :-1].flatten(0, 1), target[:, 1:].flatten())`` for ``k = 1``,
            with the same reduction), computed without copying the hidden states: the targets move left
            and the last ``k`` positions are ignored. Per-token outputs (``reduction="none"``, ``lse``,
            ``predicted_tokens``, per-token accuracy) have shape (*, T - k); ``token_weight`` has the
            target's shape (*, T) and moves with it. Class-index targets only.
        return_token_accuracy: also return the fraction of non-ignored tokens whose argmax over ``z`` (the
            scaled / soft-capped logits) is the target (Liger-Kernel's ``return_token_accuracy``): an fp32
            scalar for ``mean`` / ``sum`` (unweighted: neither ``class_weight`` nor ``token_weight``
            enter it), per-token 1.0 / 0.0 (0.0 on ignored tokens) for ``none``; detached. Zero non-ignored
            tokens give NaN, on purpose, as a torch mean over nothing (a 0 would read as 0% accuracy).
            Class-index targets only.
        return_predicted_tokens: also return each token's argmax over ``z`` (Liger-Kernel's
            ``return_predicted_tokens``): int64, the target's shape, -1 on ignored tokens (as Liger's
            kernels write). Ties give the first maximal class, as ``torch.argmax``; the argmax is taken in
            fp32 from the same logit chunks / tiles as the loss (a running max per row, no second matmul),
            so it can differ from ``torch.argmax`` of bf16-rounded logits where those round to a tie. A row
            with NaN logits: torch's answer (the first NaN) on CPU, unspecified on CUDA. Not with
            ``process_group`` (NotImplementedError).
        dtype: dtype of the loss (and ``z_loss``); default fp32 for fp16 / bf16 inputs -- the fp32 loss of the
            fp32 logits, as Apple CCE and Liger-Kernel return it (deliberately not ``F.cross_entropy``'s
            half-dtype result on half logits; pass ``dtype=input.dtype`` for that) -- else ``input.dtype``.
            With ``process_group``: ``input.dtype`` (fp32 under autocast). The math is fp32 for half inputs
            (fp64 for fp64).
        filter_eps: CCE's gradient filtering (CUDA): entries of the logits' gradient whose probabilities are
            all below it, over a column of a row chunk, and that hold no target may leave the products.
            ``"auto"`` (default, as CCE): ``finfo(input.dtype).eps / 32``; None: exact. Off with label
            smoothing or returned logits.
        precise_grad: fp16 / bf16 on CUDA: the logits' gradient enters the products as ``hi + lo`` (~16
            significant bits; results rounded once) at twice their FLOPs, instead of rounded once to the input
            dtype as torch and CCE do (their rule: per element within ``|torch - gold| + 1e-2`` for bf16,
            ``1e-3`` for fp16, against an fp64 gold).
        chunk_bytes: size of one logits chunk on the torch path (default 32 MiB).
        process_group: vocabulary parallelism. A ``torch.distributed`` group whose ranks each hold a
            slice of the classifier's rows (``weight`` is then this rank's ``(V_r, D)`` rows, ``bias``
            its ``(V_r,)`` slice; ``input`` and ``target`` are the same on every rank); or pass
            ``weight`` as a DTensor sharded on dim 0. See
            :func:`smxcompile.kernels.cross_entropy.vocab_parallel.vocab_parallel_linear_cross_entropy`
            (the loss equals the unsharded one; O(N) communication in the forward). None (default)
            is one device — note that ``torch.distributed.group.WORLD`` is None until
            ``init_process_group`` has run.

    Returns:
        ``loss``; or ``CrossEntropyOutput(loss, lse, z_loss, token_accuracy, predicted_tokens)`` when
        ``return_lse``, ``return_z_loss``, ``return_token_accuracy`` or ``return_predicted_tokens`` (the
        fields not asked for are None). Gradients flow to ``input``, ``weight`` and ``bias`` (fp32
        accumulation), and to ``lse`` when it is used.

    Raises:
        TypeError: non-tensor or non-float ``input``/``weight``, ``input``/``weight``/``bias`` of
            different dtypes (as ``F.linear``), targets neither integer nor float, a non-int
            ``ignore_index``, a non-float ``dtype``.
        ValueError: mismatched shapes (``D``, rows of ``target``, ``(V,)`` of bias/class_weight,
            ``token_weight``), an unknown ``reduction``, ``label_smoothing`` outside ``[0, 1]``,
            ``softcap`` not finite and > 0, ``lse_square_scale < 0``, ``shift`` outside ``[0, T)`` or a
            ``token_weight`` not of the target's shape with ``shift``.
        TypeError: a ``shift`` neither bool nor int.
        NotImplementedError: ``target`` (probabilities) or ``class_weight`` that require grad —
            gradients *with respect to* them are not supported (training *with* soft targets is);
            torch raises a RuntimeError for the latter (NotImplementedError is one). Probability targets
            with ``shift``, ``return_token_accuracy`` or ``return_predicted_tokens``; the latter two with
            ``process_group`` / a DTensor weight.
        RuntimeError: double backward (``create_graph=True``) through the CPU mean/sum path.
        RuntimeError: tensors on different devices.
        IndexError: a (non-ignored) target outside ``[0, V)`` (CPU; on CUDA that token's loss is NaN).

    Source: Wijmans et al., "Cut Your Losses in Large-Vocabulary Language Models" (2024) and Apple's
    ``cut_cross_entropy`` (its numerics and ``shift``); online log-sum-exp: Milakov & Gimelshein (2018);
    the collapse-safe target gradient: Prieto et al., "Grokking at the Edge of Numerical Stability", 2025;
    token accuracy / predicted tokens: Liger-Kernel's ``liger_fused_linear_cross_entropy``. Peers: ``F.linear_cross_entropy``, Apple's
    ``cut_cross_entropy``, Liger-Kernel's fused linear cross-entropy.
    """
    target, token_weight, k = shift_targets(target, token_weight, shift, ignore_index)
    need_pred = bool(return_token_accuracy or return_predicted_tokens)
    if process_group is not None or is_dtensor(weight):
        if need_pred:
            raise NotImplementedError("return_token_accuracy / return_predicted_tokens are not supported with "
                                      "vocabulary parallelism (process_group or a DTensor weight)")
        out = vocab_parallel_linear_cross_entropy(
            input, weight, target, process_group=process_group, bias=bias, class_weight=class_weight,
            token_weight=token_weight, ignore_index=ignore_index, reduction=reduction,
            label_smoothing=label_smoothing, scale=scale, softcap=softcap, lse_square_scale=lse_square_scale,
            return_lse=return_lse, return_z_loss=return_z_loss, dtype=dtype, filter_eps=filter_eps,
            precise_grad=precise_grad, chunk_bytes=chunk_bytes)
        return unshift_output(out, k, reduction)
    for name, t in (("input", input), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a Tensor, got {type(t).__name__}")
    input, weight, bias = check_linear(input, weight, bias)
    filter_eps = resolve_filter_eps(filter_eps, input.dtype)    # the operands' dtype (after autocast)
    v = weight.shape[0]
    lead = tuple(input.shape[:-1])
    tgt, probs = split_targets(target, lead, v, "input")
    n = 1
    for s in lead:
        n *= s
    check_options(target, n, v, class_weight, token_weight, ignore_index, reduction, label_smoothing, softcap,
                  scale, lse_square_scale, "input", input.device, dtype)
    if need_pred and probs is not None:
        raise NotImplementedError("return_token_accuracy / return_predicted_tokens need class-index targets, "
                                  "not probabilities")
    x2 = input.reshape(n, input.shape[-1])
    # half inputs: the fp32 loss (CCE's, Liger's), not rounded back to the half dtype
    out_dtype = dtype if dtype is not None else torch.float32 if input.dtype in HALF_DTYPES else input.dtype
    if probs is not None or not config.use_triton(x2):
        x2, weight, bias = fp32_logit_operands(x2, weight, bias)     # fp32 logits (CCE's numerics, see above)
    loss, zl, lse, _, pred = _core(
        x2, weight, bias, tgt, probs, class_weight, None if token_weight is None else token_weight.reshape(-1),
        int(ignore_index), reduction, float(label_smoothing), float(lse_square_scale), float(scale),
        None if softcap is None else float(softcap), False, None, int(chunk_bytes or 0),
        return_lse, filter_eps, need_pred, bool(precise_grad))
    acc, tokens = (prediction_outputs(pred, tgt, int(ignore_index), reduction, lead, return_token_accuracy,
                                      return_predicted_tokens) if need_pred else (None, None))
    out = finish_output(loss, zl, lse, lead, reduction, out_dtype, return_lse, return_z_loss, acc, tokens)
    return unshift_output(out, k, reduction)


def linear_ce_core(x2, weight, bias, tgt, probs, class_weight, token_weight, ignore_index, reduction, eps, z_scale,
                   scale, softcap, return_logits, logits_dtype, chunk_bytes, need_lse=False, filter_eps=None):
    """Validated, flattened arguments -> (loss or rows (fp32/fp64), z_loss or None, lse (N,) or None, logits or None).

    ``x2`` (N, D), ``weight`` (V, D), ``bias`` (V,) or None, one float dtype; ``tgt`` (N,) int64 or ``probs``
    (N, V) (the other None); ``class_weight`` (V,), ``token_weight`` (N,) or None; ``eps`` the label
    smoothing, ``z_scale`` the z-loss coefficient; ``chunk_bytes`` 0 for the default; the other options as
    :func:`linear_cross_entropy`'s (checked by it, or by a graph pass that already knows them valid).

    Picks the CPU fused path (gradients in the forward, 3 matmuls) for scalar reductions of
    class-index targets when a gradient is needed, else the statistics op (any device). The ops' torch path
    forms the logits in the operands' dtype, as ``F.linear`` (graph passes match eager with it).

    Raises:
        IndexError: a target outside [0, V) that is not ``ignore_index`` (CPU).
    """
    return _core(x2, weight, bias, tgt, probs, class_weight, token_weight, ignore_index, reduction, eps, z_scale,
                 scale, softcap, return_logits, logits_dtype, chunk_bytes, need_lse, filter_eps, False)[:4]


def _core(x2, weight, bias, tgt, probs, class_weight, token_weight, ignore_index, reduction, eps, z_scale, scale,
          softcap, return_logits, logits_dtype, chunk_bytes, need_lse, filter_eps, need_pred, precise_grad=False):
    """:func:`linear_ce_core`, plus each row's argmax (N,) int64 as a fifth result when ``need_pred`` (class-index
    targets, no returned logits; None otherwise), from the ``*_argmax`` ops."""
    n, v = x2.shape[0], weight.shape[0]
    # token_weight needing a gradient: the statistics op (the fused op has no gradient for it;
    # in compose_loss it is a plain differentiable factor)
    # CUDA: the fused path's matmul chunks neither return logits nor take the argmax
    fused = (probs is None and reduction != "none" and not need_lse and needs_grad(x2, weight, bias)
             and not needs_grad(token_weight)
             and (not config.use_triton(x2) or (not return_logits and not need_pred)))
    if fused and need_pred:
        loss, zl, pred, _, _, _ = linear_ce_loss_argmax(x2, weight, bias, tgt, class_weight, token_weight,
                                                        ignore_index, reduction, eps, z_scale, scale, softcap,
                                                        chunk_bytes)
        return loss, (zl if z_scale else None), None, None, pred
    if fused:
        loss, zl, logits, _, _, _ = linear_ce_loss(x2, weight, bias, tgt, class_weight, token_weight, ignore_index,
                                                   reduction, eps, z_scale, scale, softcap, return_logits,
                                                   logits_dtype, chunk_bytes, filter_eps, precise_grad)
        return loss, (zl if z_scale else None), None, (logits if return_logits else None), None
    out = {}

    def stats(need_ws, t, p):
        if need_pred:
            lse, tl, om, ws, out["pred"] = linear_ce_stats_argmax(x2, weight, bias, t, class_weight, ignore_index,
                                                                  scale, softcap, need_ws, chunk_bytes, filter_eps,
                                                                  precise_grad)
            return lse, tl, om, ws
        lse, tl, om, ws, logits = linear_ce_stats(x2, weight, bias, t, p, class_weight, ignore_index, scale, softcap,
                                                  need_ws, return_logits, logits_dtype, chunk_bytes, filter_eps,
                                                  precise_grad)
        out["logits"] = logits if return_logits else None
        return lse, tl, om, ws

    loss, zl, lse = _run_stats(stats, tgt, probs, n, v, class_weight, token_weight, ignore_index, reduction, eps,
                               z_scale)
    return loss, zl, lse, out.get("logits"), out.get("pred")


def _run_stats(stats, tgt, probs, n, v, class_weight, token_weight, ignore_index, reduction, eps, z_scale):
    """Run a statistics op and compose the loss: -> (loss or rows, z_loss or None, lse)."""
    if probs is not None:
        # soft targets: weighted_sum = sum_j w_j q'_j z_ij with the smoothed q'
        q = probs if not eps else probs * (1.0 - eps) + eps / v
        dummy = torch.zeros(n, dtype=torch.long, device=probs.device)
        lse, tl, om, ws = stats(True, dummy, q)
        loss, zl = compose_loss(lse, tl, ws, None, q, v, class_weight, token_weight, ignore_index, reduction, 0.0,
                                z_scale)
    else:
        lse, tl, om, ws = stats(bool(eps), tgt, None)
        loss, zl = compose_loss(lse, tl, ws, tgt, None, v, class_weight, token_weight, ignore_index, reduction, eps,
                                z_scale)
    return loss, zl, lse


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

    Same arguments and results as ``F.cross_entropy`` (``weight`` is the per-class weight;
    class-index or probability targets), plus the options of :func:`linear_cross_entropy`
    (``token_weight``, ``scale``, ``softcap``, ``lse_square_scale``, ``return_lse``,
    ``return_z_loss``, ``dtype``). The forward keeps two fp32 numbers per row (lse and the
    target logit); the backward writes ``softmax - onehot`` straight into a gradient of the
    logits' dtype.

    Args:
        input: logits, shape ``(N, C)``, ``(C,)`` or ``(N, C, d1, ...)`` with the classes on
            ``dim``; fp16/bf16/fp32/fp64, any strides.
        target: class indices of the other dims' shape, or probabilities of ``input``'s shape.
        dim: the classes' dim. None (default): torch's — dim 1 (dim 0 for a 1-d input), so
            ``(N, C, d1, ...)`` logits work as in ``F.cross_entropy``. Pass ``dim=-1`` for
            ``(B, T, V)`` language-model logits with ``(B, T)`` targets.

    Returns / Raises: as :func:`linear_cross_entropy`.

    Source: online log-sum-exp (Milakov & Gimelshein, 2018); the collapse-safe target gradient
    (Prieto et al., "Grokking at the Edge of Numerical Stability", 2025); Liger-Kernel's cross-entropy is the
    peer.
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
    d = dim % input.dim()
    x = input.movedim(d, -1) if d != input.dim() - 1 else input
    v = x.shape[-1]
    lead = tuple(x.shape[:-1])
    if target.dtype.is_floating_point and d != input.dim() - 1:
        target = target.movedim(d, -1)
    tgt, probs = split_targets(target, lead, v, "logits")
    n = 1
    for s in lead:
        n *= s
    check_options(target, n, v, weight, token_weight, ignore_index, reduction, label_smoothing, softcap, scale,
                  lse_square_scale, "logits", input.device, dtype)
    if (config.eager_aten(input) and not needs_grad(input, weight) and not chunk_bytes
            and input.dtype in (torch.float32, torch.float64) and dtype in (None, input.dtype)
            and target.dtype in (torch.int64, input.dtype) and (weight is None or weight.dtype == input.dtype)
            and token_weight is None and scale == 1.0 and softcap is None and lse_square_scale == 0.0
            and not (return_lse or return_z_loss) and d == (1 if input.dim() >= 2 else 0)):
        # Inference on CPU with nothing F.cross_entropy lacks: its fused ATen kernel is faster there (and with
        # nothing to differentiate, the online path saves no gradient buffer): bench_eager_ops.py
        return torch.nn.functional.cross_entropy(input, target, weight, ignore_index=ignore_index,
                                                 reduction=reduction, label_smoothing=label_smoothing)
    x2 = x.reshape(n, v)
    out_dtype = loss_dtype(dtype, input)
    cb = int(chunk_bytes or 0)
    sc, cap = float(scale), None if softcap is None else float(softcap)
    loss, zl, lse = _run_stats(
        lambda need_ws, t, p: ce_stats(x2, t, p, weight, int(ignore_index), sc, cap, need_ws, cb), tgt, probs, n, v,
        weight, None if token_weight is None else token_weight.reshape(-1), int(ignore_index), reduction,
        float(label_smoothing), float(lse_square_scale))
    return finish_output(loss, zl, lse, lead, reduction, out_dtype, return_lse, return_z_loss)
