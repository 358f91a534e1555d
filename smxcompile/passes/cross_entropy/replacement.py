"""What rewritten cross-entropy sites call at run time (traced by AOTAutograd, so the kernels' ops end up in the
graph): cut cross-entropy (Wijmans et al., "Cut Your Losses in Large-Vocabulary Language Models", 2024) for
``linear -> cross_entropy``, the online cross-entropy for a loss on given logits."""

from __future__ import annotations

import torch


def graph_linear_cross_entropy(h, weight, bias, target, class_weight, ignore_index: int, reduction: str,
                               label_smoothing: float, scale: float, softcap, loss_dtype, return_logits: bool,
                               logits_dtype, weight_t: bool, compute_dtype=None, row_ops=None):
    """What a rewritten ``linear -> cross_entropy`` site calls: -> (loss, logits or None).

    ``compute_dtype``: the dtype the linear layer ran in (autocast), applied explicitly so the result does
    not depend on whether the loss itself sits inside the autocast region. ``row_ops``: the row slices
    (and reshapes) the loss applied to the returned logits; every row of ``h`` is computed (the logits are
    returned whole) and the rows the loss dropped get ``ignore_index`` targets.
    """
    from ...kernels.common import autocast_operands
    from ...kernels.cross_entropy import linear_ce_core

    if weight_t:
        weight = weight.t()   # a (D, V) classifier (Conv1D / ``x @ M``): made row-major (V, D) below
    if compute_dtype is not None:
        h, weight, bias = (None if t is None else t.to(compute_dtype) for t in (h, weight, bias))
    else:
        h, weight, bias = autocast_operands(h, weight, bias)
    d = h.shape[-1]
    lead = tuple(h.shape[:-1])
    # row-major operands: the ops' fake implementations give the gradients the strides of input / weight,
    # the real ones contiguous tensors (``F.linear(x.t(), W)``, ``F.linear(h, M.t())``); no copy otherwise
    x2 = h.reshape(-1, d).contiguous()
    weight = weight.contiguous()
    sel = None
    if target.dtype.is_floating_point:
        tgt, probs = None, target.reshape(-1, weight.shape[0])
    else:
        tgt, probs = target.reshape(-1).long(), None
        if row_ops:
            sel = apply_row_ops(torch.arange(x2.shape[0], device=target.device).reshape(*lead, 1), row_ops).reshape(-1)
            tgt = torch.full((x2.shape[0],), ignore_index, dtype=torch.long, device=target.device).index_put(
                (sel,), tgt)
    if bias is not None and bias.dtype != x2.dtype:
        bias = bias.to(x2.dtype)
    loss, _, _, logits = linear_ce_core(
        x2, weight, bias, tgt, probs, class_weight=class_weight, token_weight=None, ignore_index=ignore_index,
        reduction=reduction, eps=float(label_smoothing), z_scale=0.0, scale=scale, softcap=softcap,
        return_logits=return_logits, logits_dtype=logits_dtype, chunk_bytes=0)  # 0: the default chunk policy
    if reduction == "none":
        if sel is not None:
            loss = loss[sel]
        loss = loss.reshape(tuple(target.shape) if probs is None else tuple(target.shape[:-1]))
    loss = loss.to(loss_dtype)
    if return_logits:
        logits = logits.reshape(*lead, weight.shape[0])
    return loss, logits


def apply_row_ops(x, row_ops):
    """Apply the logits chain's row reshapes / slices to ``x`` (``h``, or a row-index tensor with a trailing dim)."""
    for op, a in row_ops:
        if op == "flatten":
            x = x.flatten(0, -2)
        elif op == "reshape":
            x = x.reshape(*a, x.shape[-1])
        else:
            x = x[a]
    return x


def graph_cross_entropy(logits, target, class_weight, ignore_index: int, reduction: str, label_smoothing: float,
                        loss_dtype, classes_last: bool = False):
    """What a rewritten plain cross-entropy site calls (``F.cross_entropy`` semantics, online).

    ``classes_last``: ``logits`` (any rank) have the classes on their last dim and ``target`` holds class
    indices for its rows in order (``nll_loss(log_softmax(x, -1).view(-1, V), y)``,
    ``cross_entropy(x.transpose(1, 2), y)``); the loss has ``target``'s shape."""
    from ...kernels.cross_entropy import cross_entropy

    if classes_last:
        loss = cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), class_weight, ignore_index,
                             reduction, label_smoothing, dim=1, dtype=loss_dtype)
        return loss.reshape(target.shape) if reduction == "none" else loss
    return cross_entropy(logits, target, class_weight, ignore_index, reduction, label_smoothing,
                         dim=1 if logits.dim() >= 2 else 0, dtype=loss_dtype)



__all__ = ["graph_linear_cross_entropy", "graph_cross_entropy", "apply_row_ops"]
