"""Cross-entropy without the N x V logits: ``smx::linear_ce_stats`` / ``smx::ce_stats`` and their backward.

Method: "Cut Your Losses in Large-Vocabulary Language Models" (Wijmans et al., 2024) —
cut cross-entropy (CCE). For embeddings ``e`` (N x D) and a classifier ``c`` (V x D)

    loss_i = lse_j(z_ij) - z_{i,y_i},   z_ij = e_i . c_j (+ bias_j)

needs only two numbers per row: the log-sum-exp of the row and the target logit. Both
are reduced block by block with the online (max, sum) recurrence ("Online normalizer
calculation for softmax", Milakov & Gimelshein, 2018), so the N x V matrix never exists.
The backward recomputes the logits block by block; the target entry of the gradient is
computed from the mass of the *other* classes (``-sum_{j != y} p_j``) so that it does not
round to zero when the target dominates ("softmax collapse", see ALGORITHMS.md 1.4).

Design: one differentiable *statistics* op per row,

    lse_i = log sum_j exp(z_ij)            target_logit_i = z_{i,y_i}
    weighted_sum_i = sum_j w_ij z_ij       (w = class weight, times soft-target probs)
    other_mass_i = sum_{j != y_i} p_ij     (auxiliary, not differentiable)

where ``z = softcap * tanh(scale * x / softcap)`` (or ``scale * x``) and ``x`` are the raw
logits (``input @ weight.T + bias`` for the linear op, a tensor for the plain op). Every
cross-entropy variant (class weights, ignore_index, label smoothing, soft targets, z-loss,
per-token weights, every reduction, a returned lse with gradient) is a few torch ops on
these N-vectors (:func:`_compose`), and autograd turns their gradients into the per-row
coefficients of the backward:

    G_ij = a_i p_ij - b_i [j == y_i] - c_i w_ij (+ grad of the returned logits)
    a = grad(lse), b = -grad(target_logit), c = -grad(weighted_sum).

CUDA: Triton kernels (:mod:`smxcompile.kernels.triton_linear_ce`). CPU (and soft targets
on any device): row chunks with ATen matmuls, each chunk's logits living only in a
buffer of at most ``chunk_bytes``.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from . import config

__all__ = ["linear_cross_entropy", "cross_entropy", "CrossEntropyOutput", "DEFAULT_CHUNK_BYTES"]

#: Default size of one chunk of logits (fp32) on the torch path, in bytes.
DEFAULT_CHUNK_BYTES = 32 * 2**20

_FLOAT = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_REDUCTIONS = {"none": 0, "mean": 1, "sum": 2}


class CrossEntropyOutput(NamedTuple):
    """What the cross-entropy functions return when ``return_lse`` or ``return_z_loss`` is set.

    ``loss``: as ``F.cross_entropy`` (z-loss included when ``lse_square_scale > 0``);
    ``lse``: per-token log-sum-exp (fp32, shape of ``target``; differentiable), or None;
    ``z_loss``: the z-loss term alone, reduced like ``loss`` and detached (it is already
    part of ``loss``; for logging), or None.
    """

    loss: torch.Tensor
    lse: torch.Tensor | None
    z_loss: torch.Tensor | None


# --------------------------------------------------------------------------------------
# torch path (CPU, and soft targets anywhere): row chunks
# --------------------------------------------------------------------------------------


def _autocast_on(device: torch.device) -> bool:
    return device.type in ("cuda", "cpu", "xpu") and torch.is_autocast_enabled(device.type)


def _autocast_off(fn):
    """Run ``fn`` (a torch-path kernel) with autocast disabled.

    A custom op's implementation runs with the caller's autocast state, so without this its
    fp32 matmuls (and a backward called inside an autocast region) would be cast to the
    autocast dtype. The op's inputs were already cast by the public functions."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        dev = next(a.device for a in args if isinstance(a, torch.Tensor))
        if _autocast_on(dev):
            with torch.autocast(dev.type, enabled=False):
                return fn(*args, **kwargs)
        return fn(*args, **kwargs)

    return run


def _empty(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A contiguous empty tensor like ``t`` (the ops' outputs are contiguous, whatever ``t``'s strides)."""
    return torch.empty(t.shape, dtype=dtype or t.dtype, device=t.device)


def _acc_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _rows_per_chunk(v: int, chunk_bytes: int | None, dtype: torch.dtype = torch.float32) -> int:
    """Rows of one logits chunk: ``chunk_bytes`` of ``dtype`` (the accumulation dtype) entries."""
    budget = DEFAULT_CHUNK_BYTES if not chunk_bytes else chunk_bytes
    itemsize = torch.finfo(dtype).bits // 8
    return max(1, budget // max(1, v * itemsize))


def _transform(x: torch.Tensor, scale: float, softcap: float | None) -> torch.Tensor:
    """z = softcap * tanh(scale * x / softcap) (or scale * x), in place on an fp32/fp64 chunk."""
    if softcap is not None:
        x.mul_(scale / softcap).tanh_().mul_(softcap)
    elif scale != 1.0:
        x.mul_(scale)
    return x


def _chunk_logits(input, weight, bias, r0, r1, out_dtype, buf=None):
    """Raw logits of rows r0:r1 (matmul in the input dtype, as F.linear), as ``out_dtype``."""
    e = input[r0:r1]
    if bias is not None:
        x = torch.addmm(bias, e, weight.t())
    else:
        x = e @ weight.t()
    if x.dtype != out_dtype:
        x = x.to(out_dtype)
    return x


def _weights_rows(class_weight, probs, r0, r1, acc):
    """The (rows x V) or (V,) weights of ``weighted_sum`` for rows r0:r1, or None (all ones)."""
    w = None
    if probs is not None:
        w = probs[r0:r1].to(acc)
        if class_weight is not None:
            w = w * class_weight.to(acc)
    elif class_weight is not None:
        w = class_weight.to(acc)
    return w


def _stats_chunk(z, tgt, ignore_index, w, need_ws, has_target):
    """Per-row statistics of a chunk ``z`` (rows x V, fp32; destroyed)."""
    rows, v = z.shape
    lse = torch.logsumexp(z, 1) if v else z.new_full((rows,), float("-inf"))
    if need_ws:
        ws = (z * w).sum(1) if w is not None else z.sum(1)
    else:
        ws = None
    if has_target:
        valid = tgt != ignore_index
        inrange = (tgt >= 0) & (tgt < v)
        idx = torch.where(inrange, tgt, 0).unsqueeze(1)
        tl = z.gather(1, idx).squeeze(1) if v else z.new_zeros(rows)
        tl = torch.where(valid, torch.where(inrange, tl, float("nan")), 0.0)
        # other_mass = sum over j != y of exp(z - lse): knock the target out, then sum.
        z.scatter_(1, idx, float("-inf")) if v else None
        z.sub_(lse.unsqueeze(1)).exp_()
        om = z.sum(1)
        om = torch.where(valid & inrange, om, 0.0)
    else:
        tl = z.new_zeros(rows)
        om = z.new_zeros(rows)
    return lse, tl, om, ws


@_autocast_off
def _torch_forward(input, weight, bias, target, probs, class_weight, ignore_index, scale, softcap,
                   need_ws, logits_out, chunk_bytes, logits=None):
    """Statistics by row chunks. ``logits`` (raw, N x V) replaces the matmul for the plain op."""
    n = target.shape[0]
    v = weight.shape[0] if logits is None else logits.shape[1]
    acc = _acc_dtype(input if logits is None else logits)
    dev = target.device
    lse = torch.empty(n, dtype=acc, device=dev)
    tl = torch.empty(n, dtype=acc, device=dev)
    om = torch.empty(n, dtype=acc, device=dev)
    ws = torch.empty(n, dtype=acc, device=dev) if need_ws else None
    step = _rows_per_chunk(v, chunk_bytes, acc)
    has_target = probs is None
    if has_target:
        _check_range(target, ignore_index, v)
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        if logits is None:
            z = _chunk_logits(input, weight, bias, r0, r1, acc)
        else:
            z = logits[r0:r1].to(acc, copy=True)
        _transform(z, scale, softcap)
        if logits_out is not None:
            logits_out[r0:r1].copy_(z)
            if logits_out.dtype != acc:
                # the loss sees the logits the caller sees (rounded to their dtype), as in eager
                z = logits_out[r0:r1].to(acc)
        w = _weights_rows(class_weight, probs, r0, r1, acc)
        s = _stats_chunk(z, target[r0:r1] if has_target else None, ignore_index, w, need_ws, has_target)
        lse[r0:r1], tl[r0:r1], om[r0:r1] = s[0], s[1], s[2]
        if need_ws:
            ws[r0:r1] = s[3]
    return lse, tl, om, ws


def _grad_chunk(z_raw, tgt, lse, om, a, b, c, w, ignore_index, scale, softcap, glog, has_target):
    """G (w.r.t. the raw logits x) for one chunk; ``z_raw`` is the fp32 chunk of raw logits (destroyed)."""
    rows, v = z_raw.shape
    if softcap is not None:
        t = torch.tanh(z_raw * (scale / softcap))
        dzdx = (1.0 - t * t).mul_(scale)
        z = t.mul_(softcap)
    else:
        dzdx = scale
        z = z_raw.mul_(scale) if scale != 1.0 else z_raw
    # p * a, then the c-term, the collapse-safe target entry, grad_logits and dz/dx
    g = z.sub_(lse.unsqueeze(1)).exp_().mul_(a.unsqueeze(1))
    return _finish_grad(g, tgt, om, a, b, c, w, ignore_index, glog, has_target, dzdx)


@_autocast_off
def _torch_backward(input, weight, bias, target, probs, class_weight, lse, om, a, b, c, ignore_index, scale,
                    softcap, logits, grad_logits, needs, chunk_bytes, raw_logits=None):
    """Gradients by row chunks; returns (grad_input, grad_weight, grad_bias) — or grad_raw for the plain op."""
    n = target.shape[0]
    base = input if raw_logits is None else raw_logits
    acc = _acc_dtype(base)
    v = weight.shape[0] if raw_logits is None else raw_logits.shape[1]
    need_in, need_w, need_b = needs
    gi = _empty(input) if (raw_logits is None and need_in) else None
    gw = torch.zeros(weight.shape, dtype=acc, device=weight.device) if (raw_logits is None and need_w) else None
    gb = torch.zeros(v, dtype=acc, device=weight.device) if (raw_logits is None and need_b) else None
    graw = torch.empty(raw_logits.shape, dtype=raw_logits.dtype, device=raw_logits.device) if raw_logits is not None else None
    step = _rows_per_chunk(v, chunk_bytes, acc)
    has_target = probs is None
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        if raw_logits is not None:
            x = raw_logits[r0:r1].to(acc, copy=True)
        elif logits is not None and softcap is None:
            # saved z = scale * x: undo the scale instead of recomputing the matmul
            x = logits[r0:r1].to(acc, copy=True)
            if scale != 1.0:
                x.div_(scale)
        elif logits is not None:
            # saved z = softcap * tanh(scale * x / softcap): dz/dx from z directly
            zc = logits[r0:r1].to(acc, copy=True)
            t = zc / softcap
            dzdx = (1.0 - t * t).mul_(scale)
            g = zc.sub_(lse[r0:r1].unsqueeze(1)).exp_().mul_(a[r0:r1].unsqueeze(1))
            x = None
        else:
            x = _chunk_logits(input, weight, bias, r0, r1, acc)
        w = _weights_rows(class_weight, probs, r0, r1, acc)
        glog = None if grad_logits is None else grad_logits[r0:r1].to(acc)
        tgt = target[r0:r1] if has_target else None
        cc = None if c is None else c[r0:r1]
        if x is not None:
            g = _grad_chunk(x, tgt, lse[r0:r1], om[r0:r1], a[r0:r1], b[r0:r1], cc, w, ignore_index, scale,
                            softcap, glog, has_target)
        else:
            # softcap with saved logits: same steps as _grad_chunk on z
            g = _finish_grad(g, tgt, om[r0:r1], a[r0:r1], b[r0:r1], cc, w, ignore_index, glog, has_target, dzdx)
        if graw is not None:
            graw[r0:r1] = g
            continue
        if need_in:
            gi[r0:r1] = (g.to(weight.dtype) @ weight).to(input.dtype) if weight.dtype != acc else g @ weight
        if need_w:
            e = input[r0:r1]
            gw.addmm_(g.t(), e if e.dtype == acc else e.to(acc))
        if need_b:
            gb.add_(g.sum(0))
    if graw is not None:
        return graw
    return gi, gw, gb


def _finish_grad(g, tgt, om, a, b, c, w, ignore_index, glog, has_target, dzdx):
    """From ``g = a * p``: subtract ``c * w``, set the target entry to ``a p_y - b - c w_y`` computed as
    ``-a * other_mass + (a - b) - c w_y`` (collapse-safe), add ``glog``, multiply by ``dz/dx``."""
    rows, v = g.shape
    if c is not None:
        g.sub_(c.unsqueeze(1) if w is None else c.unsqueeze(1) * w)
    if has_target and v:
        valid = tgt != ignore_index
        inrange = (tgt >= 0) & (tgt < v)
        idx = torch.where(inrange, tgt, 0).unsqueeze(1)
        ty = -a * om + (a - b)
        if c is not None:
            wy = 1.0 if w is None else (w.gather(1, idx).squeeze(1) if w.dim() == 2 else w[idx.squeeze(1)])
            ty = ty - c * wy
        cur = g.gather(1, idx).squeeze(1)
        g.scatter_(1, idx, torch.where(valid & inrange, ty, cur).unsqueeze(1))
    if glog is not None:
        g.add_(glog)
    if not isinstance(dzdx, float) or dzdx != 1.0:
        g.mul_(dzdx)
    return g


# --------------------------------------------------------------------------------------
# ops
# --------------------------------------------------------------------------------------


def _use_triton(t: torch.Tensor, probs) -> bool:
    return probs is None and config.use_triton(t)


@torch.library.custom_op("smx::linear_ce_stats", mutates_args=())
def _linear_ce_stats(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    probs: torch.Tensor | None,
    class_weight: torch.Tensor | None,
    ignore_index: int,
    scale: float,
    softcap: float | None,
    need_weighted_sum: bool,
    return_logits: bool,
    logits_dtype: torch.dtype | None,
    chunk_bytes: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    n, v = input.shape[0], weight.shape[0]
    logits_out = None
    if return_logits:
        logits_out = torch.empty((n, v), dtype=logits_dtype or input.dtype, device=input.device)
    if _use_triton(input, probs):
        from .triton_linear_ce import lce_forward

        lse, tl, om, ws = lce_forward(input, weight, bias, target, ignore_index=ignore_index, scale=scale,
                                      softcap=softcap, class_weight=class_weight,
                                      need_weighted_sum=need_weighted_sum, logits_out=logits_out)
    else:
        lse, tl, om, ws = _torch_forward(input, weight, bias, target, probs, class_weight, ignore_index, scale,
                                         softcap, need_weighted_sum, logits_out, chunk_bytes)
    if ws is None:
        ws = lse.new_empty(0)
    return lse, tl, om, ws, (logits_out if logits_out is not None else input.new_empty(0))


@_linear_ce_stats.register_fake
def _(input, weight, bias, target, probs, class_weight, ignore_index, scale, softcap, need_weighted_sum,
      return_logits, logits_dtype, chunk_bytes):
    n, v = input.shape[0], weight.shape[0]
    acc = _acc_dtype(input)
    vec = input.new_empty(n, dtype=acc)
    ws = input.new_empty(n if need_weighted_sum else 0, dtype=acc)
    logits = input.new_empty((n, v) if return_logits else (0,), dtype=(logits_dtype or input.dtype) if return_logits else input.dtype)
    return vec, input.new_empty(n, dtype=acc), input.new_empty(n, dtype=acc), ws, logits


@torch.library.custom_op("smx::linear_ce_backward", mutates_args=())
def _linear_ce_backward(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    probs: torch.Tensor | None,
    class_weight: torch.Tensor | None,
    lse: torch.Tensor,
    other_mass: torch.Tensor,
    coef_a: torch.Tensor,
    coef_b: torch.Tensor,
    coef_c: torch.Tensor | None,
    ignore_index: int,
    scale: float,
    softcap: float | None,
    logits: torch.Tensor | None,
    grad_logits: torch.Tensor | None,
    filter_eps: float | None,
    need_input_grad: bool,
    need_weight_grad: bool,
    need_bias_grad: bool,
    chunk_bytes: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if _use_triton(input, probs):
        from .triton_linear_ce import lce_backward

        gi, gw, gb = lce_backward(input, weight, bias, target, lse, other_mass, coef_a, coef_b, coef_c,
                                  ignore_index=ignore_index, scale=scale, softcap=softcap,
                                  class_weight=class_weight,
                                  # saved logits rounded below fp32 would disagree with the fp32 lse: recompute
                                  logits=logits if logits is not None and logits.dtype == torch.float32 else None,
                                  grad_logits=grad_logits,
                                  filter_eps=filter_eps, need_input_grad=need_input_grad,
                                  need_weight_grad=need_weight_grad, need_bias_grad=need_bias_grad)
    else:
        gi, gw, gb = _torch_backward(input, weight, bias, target, probs, class_weight, lse, other_mass, coef_a,
                                     coef_b, coef_c, ignore_index, scale, softcap, logits, grad_logits,
                                     (need_input_grad, need_weight_grad, need_bias_grad), chunk_bytes)
    gi = gi.contiguous() if gi is not None else input.new_empty(0)
    gw = gw.to(weight.dtype) if gw is not None else weight.new_empty(0)
    gb = gb.to(bias.dtype) if (gb is not None and bias is not None) else weight.new_empty(0)
    return gi, gw, gb


@_linear_ce_backward.register_fake
def _(input, weight, bias, target, probs, class_weight, lse, other_mass, coef_a, coef_b, coef_c, ignore_index,
      scale, softcap, logits, grad_logits, filter_eps, need_input_grad, need_weight_grad, need_bias_grad,
      chunk_bytes):
    gi = _empty(input) if need_input_grad else input.new_empty(0)
    gw = _empty(weight) if need_weight_grad else weight.new_empty(0)
    gb = _empty(bias) if (need_bias_grad and bias is not None) else weight.new_empty(0)
    return gi, gw, gb


def _lce_setup(ctx, inputs, output):
    (input, weight, bias, target, probs, class_weight, ignore_index, scale, softcap, need_ws, return_logits,
     logits_dtype, chunk_bytes) = inputs
    lse, tl, om, ws, logits = output
    ctx.args = (ignore_index, scale, softcap, chunk_bytes)
    ctx.has_bias = bias is not None
    ctx.return_logits = return_logits
    ctx.save_for_backward(input, weight, bias, target, probs, class_weight, lse, om,
                          logits if return_logits else None)


def _coefs(lse, grad_lse, grad_tl, grad_ws):
    a = grad_lse if grad_lse is not None else torch.zeros_like(lse)
    b = -grad_tl if grad_tl is not None else torch.zeros_like(lse)
    c = -grad_ws if (grad_ws is not None and grad_ws.numel()) else None
    return a.to(lse.dtype), b.to(lse.dtype), (c.to(lse.dtype) if c is not None else None)


def _lce_backward(ctx, grad_lse, grad_tl, grad_om, grad_ws, grad_logits):
    input, weight, bias, target, probs, class_weight, lse, om, logits = ctx.saved_tensors
    ignore_index, scale, softcap, chunk_bytes = ctx.args
    a, b, c = _coefs(lse, grad_lse, grad_tl, grad_ws)
    if grad_logits is not None and (not ctx.return_logits or grad_logits.numel() == 0):
        grad_logits = None
    need_in, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    need_b = ctx.has_bias and ctx.needs_input_grad[2]
    gi, gw, gb = _linear_ce_backward(input, weight, bias, target, probs, class_weight, lse, om, a, b, c,
                                     ignore_index, scale, softcap, logits, grad_logits, None, need_in, need_w,
                                     need_b, chunk_bytes)
    return (gi if need_in else None, gw if need_w else None, gb if need_b else None,
            None, None, None, None, None, None, None, None, None, None)


_linear_ce_stats.register_autograd(_lce_backward, setup_context=_lce_setup)


@torch.library.custom_op("smx::ce_stats", mutates_args=())
def _ce_stats(
    logits: torch.Tensor,
    target: torch.Tensor,
    probs: torch.Tensor | None,
    class_weight: torch.Tensor | None,
    ignore_index: int,
    scale: float,
    softcap: float | None,
    need_weighted_sum: bool,
    chunk_bytes: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    if _use_triton(logits, probs):
        from .triton_linear_ce import ce_forward

        lse, tl, om, ws = ce_forward(logits, target, ignore_index=ignore_index, scale=scale, softcap=softcap,
                                     class_weight=class_weight, need_weighted_sum=need_weighted_sum)
    else:
        lse, tl, om, ws = _torch_forward(logits, None, None, target, probs, class_weight, ignore_index, scale,
                                         softcap, need_weighted_sum, None, chunk_bytes, logits=logits)
    return lse, tl, om, (ws if ws is not None else lse.new_empty(0))


@_ce_stats.register_fake
def _(logits, target, probs, class_weight, ignore_index, scale, softcap, need_weighted_sum, chunk_bytes):
    n = logits.shape[0]
    acc = _acc_dtype(logits)
    return (logits.new_empty(n, dtype=acc), logits.new_empty(n, dtype=acc), logits.new_empty(n, dtype=acc),
            logits.new_empty(n if need_weighted_sum else 0, dtype=acc))


@torch.library.custom_op("smx::ce_backward", mutates_args=())
def _ce_backward(
    logits: torch.Tensor,
    target: torch.Tensor,
    probs: torch.Tensor | None,
    class_weight: torch.Tensor | None,
    lse: torch.Tensor,
    other_mass: torch.Tensor,
    coef_a: torch.Tensor,
    coef_b: torch.Tensor,
    coef_c: torch.Tensor | None,
    ignore_index: int,
    scale: float,
    softcap: float | None,
    chunk_bytes: int,
) -> torch.Tensor:
    if _use_triton(logits, probs):
        from .triton_linear_ce import ce_backward

        return ce_backward(logits, target, lse, other_mass, coef_a, coef_b, coef_c, ignore_index=ignore_index,
                           scale=scale, softcap=softcap, class_weight=class_weight, out_dtype=logits.dtype)
    return _torch_backward(logits, logits, None, target, probs, class_weight, lse, other_mass, coef_a, coef_b,
                           coef_c, ignore_index, scale, softcap, None, None, (False, False, False), chunk_bytes,
                           raw_logits=logits)


@_ce_backward.register_fake
def _(logits, target, probs, class_weight, lse, other_mass, coef_a, coef_b, coef_c, ignore_index, scale, softcap,
      chunk_bytes):
    return torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)


def _ce_setup(ctx, inputs, output):
    logits, target, probs, class_weight, ignore_index, scale, softcap, need_ws, chunk_bytes = inputs
    lse, tl, om, ws = output
    ctx.args = (ignore_index, scale, softcap, chunk_bytes)
    ctx.save_for_backward(logits, target, probs, class_weight, lse, om)


def _ce_backward_autograd(ctx, grad_lse, grad_tl, grad_om, grad_ws):
    logits, target, probs, class_weight, lse, om = ctx.saved_tensors
    ignore_index, scale, softcap, chunk_bytes = ctx.args
    a, b, c = _coefs(lse, grad_lse, grad_tl, grad_ws)
    g = _ce_backward(logits, target, probs, class_weight, lse, om, a, b, c, ignore_index, scale, softcap,
                     chunk_bytes)
    return g, None, None, None, None, None, None, None, None


_ce_stats.register_autograd(_ce_backward_autograd, setup_context=_ce_setup)


# --------------------------------------------------------------------------------------
# CPU fast path: scalar reductions, gradients computed in the forward pass
# --------------------------------------------------------------------------------------
#
# For reduction mean/sum the per-row backward coefficients are known in the forward up to
# the scalar grad_output (they depend only on the targets, the weights and the row's own
# lse), so the forward computes the gradients while each logits chunk is hot in cache:
# 3 matmuls (as eager) instead of 4 (stats, then recompute in backward). The same idea as
# PyTorch's chunked F.linear_cross_entropy and Liger-Kernel's fused linear CE.


def _scalar_coefs(target, v, class_weight, token_weight, ignore_index, reduction, eps, z_scale, acc):
    """Per-row coefficients (a0, b0, c0, zc) of d(loss)/d(lse, -target_logit, -weighted_sum) for grad_output 1.

    ``a_i = a0_i + zc_i * lse_i`` (the z-loss term depends on the row's lse)."""
    valid = target != ignore_index
    r = valid.to(acc)
    if token_weight is not None:
        r = r * token_weight.to(acc)
    if class_weight is not None:
        cw = class_weight.to(acc)
        wy = cw[torch.where(valid & (target >= 0) & (target < v), target, 0)]
        wsum = cw.sum()
    else:
        wy, wsum = None, float(v)
    if reduction == "mean":
        den = (r * wy).sum() if wy is not None else r.sum()
        den_z = r.sum()
        f = torch.where(den != 0, 1.0 / den, 0.0)
        fz = torch.where(den_z != 0, 1.0 / den_z, 0.0)
    else:
        f = fz = 1.0
    rw = r * f
    base = rw * wy if wy is not None else rw
    b0 = (1.0 - eps) * base
    a0 = b0 + (eps / v) * rw * wsum if eps else b0
    c0 = rw * (eps / v) if eps else None
    zc = 2.0 * z_scale * r * fz if z_scale else None
    return a0, b0, c0, zc


def _saved_grad_dtype(dtype: torch.dtype) -> torch.dtype:
    """dtype of the gradients the fused forward computes for grad_output = 1.

    fp16 keeps them in fp32: they are scaled by the real grad_output only in the backward, and
    an unscaled fp16 gradient (``p / N`` of a mean, before a loss scaler's 2^16) underflows
    where torch's scaled one does not. bf16 has fp32's range: it keeps its own dtype."""
    return torch.float32 if dtype == torch.float16 else dtype


#: Use :func:`_fused_forward_fast` where it applies (tests switch it off to compare both paths).
FAST_FUSED = True

#: Fewest rows per chunk on the fused CPU path: below ~256 rows the three matmuls per chunk run
#: well under the machine's matmul throughput (the weight is re-read once per chunk).
MIN_CHUNK_ROWS = 256


@_autocast_off
def _fused_forward_fast(input, weight, bias, target, class_weight, token_weight, ignore_index, reduction, z_scale,
                        scale, logits_out, chunk_bytes):
    """The fused forward without soft-cap or label smoothing: the gradient factors through the matmuls.

    With ``P'`` = softmax with its target entry replaced by ``-(sum of the other classes)`` (the
    collapse-safe ``p_y - 1``), the gradient w.r.t. the logits is ``diag(a) P' + diag(a - b) Y``
    (``Y`` one-hot; ``a == b`` for plain CE), so per chunk

        grad_input  = a * (P' @ W) + (a - b) * W[y]
        grad_weight += P'^T @ (a * E) + index_add_y((a - b) * E)

    and the only passes over the chunk's logits are the matmul that writes them, a row max,
    ATen's in-place softmax and one sum. Ignored rows are skipped entirely (unless the logits
    are returned); chunks reuse one buffer.
    """
    n, v = target.shape[0], weight.shape[0]
    acc = _acc_dtype(input)
    a0, b0, _, zc = _scalar_coefs(target, v, class_weight, token_weight, ignore_index, reduction, 0.0, z_scale, acc)
    lse = torch.zeros(n, dtype=acc, device=input.device)
    tl = torch.zeros(n, dtype=acc, device=input.device)
    gdt = _saved_grad_dtype(input.dtype)
    w_gi = weight if weight.dtype == gdt else weight.to(gdt)
    gw = torch.zeros(weight.shape, dtype=acc, device=weight.device)
    gb = torch.zeros(v, dtype=acc, device=weight.device) if bias is not None else None
    valid_all = target != ignore_index
    rows = None
    if logits_out is None:
        rows = valid_all.nonzero().squeeze(1)  # only the rows that contribute (data-dependent: inside the op)
        gi = torch.zeros(input.shape, dtype=gdt, device=input.device)
        count = rows.numel()
    else:
        gi = torch.empty(input.shape, dtype=gdt, device=input.device)
        count = n
    step = max(_rows_per_chunk(v, chunk_bytes, acc), min(MIN_CHUNK_ROWS, count) if not chunk_bytes else 1)
    buf = torch.empty((min(step, count), v), dtype=acc, device=input.device) if count else None
    gbuf = torch.empty((min(step, count), input.shape[1]), dtype=acc, device=input.device) if count else None
    same = input.dtype == acc and weight.dtype == acc
    for r0 in range(0, count, step):
        r1 = min(count, r0 + step)
        r = r1 - r0
        sel = slice(r0, r1) if rows is None else rows[r0:r1]
        e = input[sel]
        z = buf[:r]
        # the returned logits, when they are fp32 (fp64) rows: the matmul writes them in place
        direct = same and logits_out is not None and logits_out.dtype == acc and isinstance(sel, slice)
        zsrc = logits_out[sel] if direct else z
        if same:
            if bias is not None:
                torch.addmm(bias, e, weight.t(), out=zsrc)
            else:
                torch.mm(e, weight.t(), out=zsrc)
        else:
            z.copy_(torch.addmm(bias, e, weight.t()) if bias is not None else e @ weight.t())
        if scale != 1.0:
            zsrc.mul_(scale)
        if logits_out is not None and not direct:
            logits_out[sel].copy_(z)
            if logits_out.dtype != acc:
                z.copy_(logits_out[sel])  # the loss sees the logits the caller sees, as in eager
        tgt = target[sel]
        valid = valid_all[sel]
        idx = torch.where(valid, tgt, 0).unsqueeze(1)
        tl[sel] = torch.where(valid, zsrc.gather(1, idx).squeeze(1), 0.0)
        m, am = zsrc.max(1)
        torch.ops.aten._softmax.out(zsrc, 1, False, out=z)  # out of place from the returned logits
        # lse = m + log(sum exp(z - m)) = m - log(p_max): the row max's probability is 1 / sum
        l = m - torch.log(z.gather(1, am.unsqueeze(1)).squeeze(1))
        lse[sel] = l
        z.scatter_(1, idx, 0.0)
        om = z.sum(1)  # mass of the other classes: the collapse-safe 1 - p_target
        z.scatter_(1, idx, (-om).unsqueeze(1))
        a = a0[sel] if zc is None else a0[sel] + zc[sel] * l
        a = torch.where(valid, a, 0.0)
        ab = torch.where(valid, a - b0[sel], 0.0)
        a_s, ab_s = a * scale, ab * scale
        has_ab = bool((ab_s != 0).any())
        ef = e if e.dtype == acc else e.to(acc)
        g = gbuf[:r]
        if w_gi.dtype == acc:
            torch.mm(z, w_gi, out=g)
        else:
            g.copy_(z.to(w_gi.dtype) @ w_gi)
        g.mul_(a_s.unsqueeze(1))
        if has_ab:
            g.add_(w_gi.index_select(0, idx.squeeze(1)).to(acc) * ab_s.unsqueeze(1))
        gi[sel] = g.to(gdt)
        gw.addmm_(z.t(), ef * a_s.unsqueeze(1))
        if has_ab:
            gw.index_add_(0, idx.squeeze(1), ef * ab_s.unsqueeze(1))
        if gb is not None:
            gb.add_(z.t() @ a_s)
            if has_ab:
                gb.index_add_(0, idx.squeeze(1), ab_s)
    loss, zl = _compose(lse, tl, None, target, None, v, class_weight, token_weight, ignore_index, reduction, 0.0,
                        z_scale)
    return loss, zl, lse, gi, gw.to(gdt), gb


@_autocast_off
def _fused_forward(input, weight, bias, target, class_weight, token_weight, ignore_index, reduction, eps, z_scale,
                   scale, softcap, logits_out, chunk_bytes):
    if FAST_FUSED and softcap is None and not eps and weight.shape[0]:
        _check_range(target, ignore_index, weight.shape[0])
        return _fused_forward_fast(input, weight, bias, target, class_weight, token_weight, ignore_index, reduction,
                                   z_scale, scale, logits_out, chunk_bytes)
    n, v = target.shape[0], weight.shape[0]
    acc = _acc_dtype(input)
    _check_range(target, ignore_index, v)
    a0, b0, c0, zc = _scalar_coefs(target, v, class_weight, token_weight, ignore_index, reduction, eps, z_scale, acc)
    lse = input.new_empty(n, dtype=acc)
    tl = input.new_empty(n, dtype=acc)
    ws = input.new_empty(n, dtype=acc) if eps else None
    gdt = _saved_grad_dtype(input.dtype)
    gi = torch.empty(input.shape, dtype=gdt, device=input.device)
    # the matmul for grad_input runs in gi's dtype (fp16: on an fp32 copy of the weight)
    w_gi = weight if weight.dtype == gdt else weight.to(gdt)
    gw = torch.zeros(weight.shape, dtype=acc, device=weight.device)
    gb = torch.zeros(v, dtype=acc, device=weight.device) if bias is not None else None
    w_full = class_weight.to(acc) if class_weight is not None else None
    step = _rows_per_chunk(v, chunk_bytes, acc)
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        z = _chunk_logits(input, weight, bias, r0, r1, acc)
        _transform(z, scale, softcap)
        if logits_out is not None:
            logits_out[r0:r1].copy_(z)
            if logits_out.dtype != acc:
                z = logits_out[r0:r1].to(acc)
        dzdx = None
        if softcap is not None:
            t = z / softcap
            dzdx = (1.0 - t * t).mul_(scale)
        elif scale != 1.0:
            dzdx = scale
        tgt = target[r0:r1]
        valid = tgt != ignore_index
        idx = torch.where(valid, tgt, 0).unsqueeze(1)
        l = torch.logsumexp(z, 1) if v else z.new_full((r1 - r0,), float("-inf"))
        lse[r0:r1] = l
        tl[r0:r1] = torch.where(valid, z.gather(1, idx).squeeze(1), 0.0)
        if ws is not None:
            ws[r0:r1] = (z * w_full).sum(1) if w_full is not None else z.sum(1)
        p = z.sub_(l.unsqueeze(1)).exp_()
        p.scatter_(1, idx, 0.0)
        om = p.sum(1)  # mass of the other classes: the collapse-safe 1 - p_target
        a = a0[r0:r1] if zc is None else a0[r0:r1] + zc[r0:r1] * l
        b = b0[r0:r1]
        g = p.mul_(a.unsqueeze(1))
        ty = -a * om + (a - b)
        if c0 is not None:
            c = c0[r0:r1]
            g.sub_(c.unsqueeze(1) * w_full if w_full is not None else c.unsqueeze(1))
            ty = ty - c * (w_full[idx.squeeze(1)] if w_full is not None else 1.0)
        g.scatter_(1, idx, torch.where(valid, ty, 0.0).unsqueeze(1)) if v else None
        if dzdx is not None:
            g.mul_(dzdx)
        gi[r0:r1] = (g.to(w_gi.dtype) @ w_gi) if w_gi.dtype != acc else g @ w_gi
        e = input[r0:r1]
        gw.addmm_(g.t(), e if e.dtype == acc else e.to(acc))
        if gb is not None:
            gb.add_(g.sum(0))
    loss, zl = _compose(lse, tl, ws, target, None, v, class_weight, token_weight, ignore_index, reduction, eps,
                        z_scale)
    return loss, zl, lse, gi, gw.to(gdt), gb  # gb: V numbers, kept in fp32 (fp64): rounded once, in the backward


@torch.library.custom_op("smx::linear_ce_loss", mutates_args=())
def _linear_ce_loss(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    class_weight: torch.Tensor | None,
    token_weight: torch.Tensor | None,
    ignore_index: int,
    reduction: str,
    label_smoothing: float,
    lse_square_scale: float,
    scale: float,
    softcap: float | None,
    return_logits: bool,
    logits_dtype: torch.dtype | None,
    chunk_bytes: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, z_loss, logits, grad_input, grad_weight, grad_bias) for grad_output = 1; fp32 loss.

    The gradients of input / weight have their dtype, except fp16: fp32 (see
    :func:`_saved_grad_dtype`); the bias's is fp32 (fp64 for fp64)."""
    n, v = input.shape[0], weight.shape[0]
    logits_out = None
    if return_logits:
        logits_out = torch.empty((n, v), dtype=logits_dtype or input.dtype, device=input.device)
    loss, zl, _, gi, gw, gb = _fused_forward(input, weight, bias, target, class_weight, token_weight, ignore_index,
                                             reduction, label_smoothing, lse_square_scale, scale, softcap,
                                             logits_out, chunk_bytes)
    acc = _acc_dtype(input)
    return (loss.to(acc), (zl if zl is not None else loss.new_zeros(())).to(acc),
            logits_out if logits_out is not None else input.new_empty(0), gi, gw,
            gb if gb is not None else weight.new_empty(0))


@_linear_ce_loss.register_fake
def _(input, weight, bias, target, class_weight, token_weight, ignore_index, reduction, label_smoothing,
      lse_square_scale, scale, softcap, return_logits, logits_dtype, chunk_bytes):
    acc = _acc_dtype(input)
    n, v = input.shape[0], weight.shape[0]
    logits = input.new_empty((n, v), dtype=logits_dtype or input.dtype) if return_logits else input.new_empty(0)
    return (input.new_empty((), dtype=acc), input.new_empty((), dtype=acc), logits,
            _empty(input, _saved_grad_dtype(input.dtype)),
            _empty(weight, _saved_grad_dtype(weight.dtype)),
            _empty(bias, acc) if bias is not None else weight.new_empty(0))


@torch.library.custom_op("smx::linear_add_logits_grad_", mutates_args=("grad_input", "grad_weight", "grad_bias"))
def _linear_add_logits_grad_(
    grad_logits: torch.Tensor,
    logits: torch.Tensor,
    input: torch.Tensor,
    weight: torch.Tensor,
    grad_loss: torch.Tensor,
    saved_input_grad: torch.Tensor,
    saved_weight_grad: torch.Tensor,
    saved_bias_grad: torch.Tensor | None,
    grad_input: torch.Tensor,
    grad_weight: torch.Tensor,
    grad_bias: torch.Tensor | None,
    scale: float,
    softcap: float | None,
    chunk_bytes: int,
) -> None:
    """Add the gradient that a *returned* logits tensor receives to the linear layer's gradients, in place.

    ``logits = transform(input @ weight.T + bias)`` (N x V) was returned by the fused op;
    ``grad_logits`` is its incoming gradient. Usually nothing used the returned logits and
    autograd hands a zero gradient: then this does nothing (one read of ``grad_logits``).
    Otherwise it adds ``G @ weight``, ``G^T @ input`` and ``G.sum(0)`` chunk by chunk, in fp32, to
    ``saved * grad_loss`` (recomputed from the forward's gradients, so the sum is rounded once) and
    overwrites the three gradients with the result."""
    _add_logits_grad(grad_logits, logits, input, weight, grad_loss, saved_input_grad, saved_weight_grad,
                     saved_bias_grad, grad_input, grad_weight, grad_bias, scale, softcap, chunk_bytes)


@_autocast_off
def _add_logits_grad(grad_logits, logits, input, weight, grad_loss, saved_gi, saved_gw, saved_gb, grad_input,
                     grad_weight, grad_bias, scale, softcap, chunk_bytes):
    if grad_logits.numel() == 0 or not bool(grad_logits.any()):
        return
    acc = _acc_dtype(input)
    gl = grad_loss.reshape(()).to(acc)
    n, v = logits.shape
    gi = saved_gi.to(acc) * gl
    gw = saved_gw.to(acc) * gl
    gb = saved_gb.to(acc) * gl if (grad_bias is not None and saved_gb is not None) else None
    step = _rows_per_chunk(v, chunk_bytes, acc)
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        g = grad_logits[r0:r1].to(acc, copy=True)
        if softcap is not None:
            t = logits[r0:r1].to(acc) / softcap
            g.mul_((1.0 - t * t).mul_(scale))
        elif scale != 1.0:
            g.mul_(scale)
        gi[r0:r1] += (g.to(weight.dtype) @ weight).to(acc) if weight.dtype != acc else g @ weight
        e = input[r0:r1]
        gw.addmm_(g.t(), e if e.dtype == acc else e.to(acc))
        if gb is not None:
            gb.add_(g.sum(0))
    grad_input.copy_(gi)
    grad_weight.copy_(gw)
    if gb is not None:
        grad_bias.copy_(gb)


def _fused_setup(ctx, inputs, output):
    (input, weight, bias, target, class_weight, token_weight, ignore_index, reduction, label_smoothing,
     lse_square_scale, scale, softcap, return_logits, logits_dtype, chunk_bytes) = inputs
    loss, zl, logits, gi, gw, gb = output
    ctx.has_bias = bias is not None
    ctx.return_logits = return_logits
    ctx.args = (scale, softcap, chunk_bytes)
    ctx.save_for_backward(gi, gw, gb if bias is not None else None, logits if return_logits else None,
                          input, weight)


def _fused_backward(ctx, grad_loss, grad_zl, grad_logits, _gi, _gw, _gb):
    saved_gi, saved_gw, saved_gb, logits, input, weight = ctx.saved_tensors
    scale, softcap, chunk_bytes = ctx.args
    # Scale the gradients the forward computed by grad_loss: plain pointwise torch ops (fp32 math, one
    # rounding), so that under torch.compile Inductor can write the result into the saved buffer.
    acc = _acc_dtype(input)
    if torch.is_grad_enabled():
        # backward(create_graph=True): the gradients were computed in the forward and are constants here;
        # scaling them would silently give zero second-order gradients
        raise RuntimeError(
            "double backward (create_graph=True) through smxcompile.linear_cross_entropy is not supported "
            "with reduction='mean'/'sum' on CPU; use F.cross_entropy(F.linear(...)) for higher-order gradients")
    gl = grad_loss.reshape(()).to(acc)
    gi = (saved_gi.to(acc) * gl).to(input.dtype)
    gw = (saved_gw.to(acc) * gl).to(weight.dtype)
    gb = (saved_gb.to(acc) * gl).to(weight.dtype) if saved_gb is not None else None
    if ctx.return_logits and grad_logits is not None and grad_logits.numel():
        # a returned logits tensor that something used: its gradient is added (nothing when it is zero)
        _linear_add_logits_grad_(grad_logits, logits, input, weight, grad_loss, saved_gi, saved_gw, saved_gb, gi,
                                 gw, gb, scale, softcap, chunk_bytes)
    return ((gi if ctx.needs_input_grad[0] else None, gw if ctx.needs_input_grad[1] else None,
             gb if (ctx.has_bias and ctx.needs_input_grad[2]) else None) + (None,) * 12)


_linear_ce_loss.register_autograd(_fused_backward, setup_context=_fused_setup)


# --------------------------------------------------------------------------------------
# composing the loss from the row statistics
# --------------------------------------------------------------------------------------


def _compose(lse, tl, ws, target, probs, v, class_weight, token_weight, ignore_index, reduction, label_smoothing,
             lse_square_scale):
    """The loss (and z-loss) from the row statistics, with torch's cross_entropy semantics.

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
        # ws = sum_j w_j q_j z_ij ; sum_j w_j q'_j computed from probs
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


def _check_common(target, n, v, class_weight, token_weight, ignore_index, reduction, label_smoothing, softcap,
                  scale, lse_square_scale, what, device, dtype):
    if dtype is not None and (not isinstance(dtype, torch.dtype) or dtype not in _FLOAT):
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


def _targets(target, lead_shape, v, what):
    """Split class-index and probability targets; returns (index_target (N,) int64, probs (N, V) or None)."""
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


def _check_range(target, ignore_index, v):
    """torch's error for a target outside [0, V) (runs inside the op, so also under torch.compile)."""
    if target is None or target.numel() == 0 or target.is_cuda:
        return  # on CUDA the kernels give NaN for an out-of-range target instead of a host sync
    bad = (target != ignore_index) & ((target < 0) | (target >= v))
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise IndexError(f"Target {int(target[i])} is out of bounds (number of classes {v}, "
                         f"ignore_index {ignore_index})")


def _finish(loss, zl, lse_rows, lead_shape, reduction, out_dtype, return_lse, return_z_loss):
    if reduction == "none":
        loss = loss.reshape(lead_shape)
        if zl is not None:
            loss = loss + zl.reshape(lead_shape)
            zl = zl.reshape(lead_shape)
    elif zl is not None:
        loss = loss + zl
    loss = loss.to(out_dtype)
    if not (return_lse or return_z_loss):
        return loss
    return CrossEntropyOutput(
        loss,
        lse_rows.reshape(lead_shape) if return_lse else None,
        (zl.detach().to(out_dtype) if zl is not None else torch.zeros_like(loss).detach()) if return_z_loss else None,
    )


def _autocast(*ts):
    """Emulate F.linear under autocast: cast the floating tensors to the autocast dtype.

    As autocast does, fp64 tensors are left alone (they are not "eligible")."""
    dev = next((t.device for t in ts if t is not None), torch.device("cpu"))
    if _autocast_on(dev):
        dt = torch.get_autocast_dtype(dev.type)
        return tuple(t.to(dt) if (t is not None and t.is_floating_point() and t.dtype != torch.float64) else t
                     for t in ts)
    return ts


def _loss_dtype(dtype, input):
    """The loss's dtype: ``dtype``, else as ``F.cross_entropy`` on logits of ``input``'s dtype —
    which autocast runs in fp32 (cross-entropy is on autocast's fp32 list)."""
    if dtype is not None:
        return dtype
    if input.dtype in (torch.float16, torch.bfloat16) and _autocast_on(input.device):
        return torch.float32
    return input.dtype


def _check_linear(input, weight, bias, rows: str = "V"):
    """``F.linear``'s operands, cast as autocast would, checked: -> (input, weight, bias).

    ``rows`` names the classifier's rows in the messages ("V", or "V_r": one rank's shard)."""
    input, weight, bias = _autocast(input, weight, bias)
    if input.dtype not in _FLOAT or weight.dtype not in _FLOAT:
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
    dtype: torch.dtype | None = None,
    filter_eps: float | None = None,
    chunk_bytes: int | None = None,
    process_group=None,
):
    """Cross-entropy of ``input @ weight.T + bias`` without materializing the logits (cut cross-entropy).

    Equals ``F.cross_entropy(z, target, weight=class_weight, ignore_index=..., reduction=...,
    label_smoothing=...)`` with ``z = softcap * tanh(scale * (input @ weight.T + bias) / softcap)``
    (or ``scale * (...)`` without softcap; ``scale = 1 / temperature``), forward and backward,
    but the N x V logits never exist: only chunks of them (CPU) or tiles in on-chip memory
    (CUDA, Triton).

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
            with zero gradients, as in torch) or ``"sum"``.
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
        dtype: dtype of the loss; default ``input.dtype`` (as ``F.cross_entropy`` on logits of
            that dtype; under autocast fp32, as torch's autocast runs cross-entropy in fp32).
            The math is fp32 for half inputs (fp64 for fp64).
        filter_eps: gradient filtering threshold of CCE (CUDA only; skips gradient tiles whose
            entries are all below it). None (default) is exact.
        chunk_bytes: size of one logits chunk on the torch path (default 32 MiB).
        process_group: vocabulary parallelism. A ``torch.distributed`` group whose ranks each hold a
            slice of the classifier's rows (``weight`` is then this rank's ``(V_r, D)`` rows, ``bias``
            its ``(V_r,)`` slice; ``input`` and ``target`` are the same on every rank); or pass
            ``weight`` as a DTensor sharded on dim 0. See
            :func:`smxcompile.kernels.vocab_parallel_ce.vocab_parallel_linear_cross_entropy`
            (the loss equals the unsharded one; O(N) communication in the forward). None (default)
            is one device — note that ``torch.distributed.group.WORLD`` is None until
            ``init_process_group`` has run.

    Returns:
        ``loss``; or ``CrossEntropyOutput(loss, lse, z_loss)`` when ``return_lse`` or
        ``return_z_loss``. Gradients flow to ``input``, ``weight`` and ``bias`` (fp32
        accumulation), and to ``lse`` when it is used.

    Raises:
        TypeError: non-tensor or non-float ``input``/``weight``, ``input``/``weight``/``bias`` of
            different dtypes (as ``F.linear``), targets neither integer nor float, a non-int
            ``ignore_index``, a non-float ``dtype``.
        ValueError: mismatched shapes (``D``, rows of ``target``, ``(V,)`` of bias/class_weight,
            ``token_weight``), an unknown ``reduction``, ``label_smoothing`` outside ``[0, 1]``,
            ``softcap`` not finite and > 0, ``lse_square_scale < 0``.
        NotImplementedError: ``target`` (probabilities) or ``class_weight`` that require grad —
            gradients *with respect to* them are not supported (training *with* soft targets is);
            torch raises a RuntimeError for the latter (NotImplementedError is one).
        RuntimeError: double backward (``create_graph=True``) through the CPU mean/sum path.
        RuntimeError: tensors on different devices.
        IndexError: a (non-ignored) target outside ``[0, V)`` (CPU; on CUDA that token's loss is NaN).

    Source: Wijmans et al., "Cut Your Losses in Large-Vocabulary Language Models" (2024);
    online log-sum-exp: Milakov & Gimelshein (2018); the collapse-safe target gradient:
    ALGORITHMS.md 1.4. Peers: ``F.linear_cross_entropy``, Apple's ``cut_cross_entropy``,
    Liger-Kernel's fused linear cross-entropy.
    """
    if process_group is not None or _is_dtensor(weight):
        from .vocab_parallel_ce import vocab_parallel_linear_cross_entropy

        return vocab_parallel_linear_cross_entropy(
            input, weight, target, process_group=process_group, bias=bias, class_weight=class_weight,
            token_weight=token_weight, ignore_index=ignore_index, reduction=reduction,
            label_smoothing=label_smoothing, scale=scale, softcap=softcap, lse_square_scale=lse_square_scale,
            return_lse=return_lse, return_z_loss=return_z_loss, dtype=dtype, filter_eps=filter_eps,
            chunk_bytes=chunk_bytes)
    for name, t in (("input", input), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a Tensor, got {type(t).__name__}")
    input, weight, bias = _check_linear(input, weight, bias)
    v = weight.shape[0]
    lead = tuple(input.shape[:-1])
    tgt, probs = _targets(target, lead, v, "input")
    n = 1
    for s in lead:
        n *= s
    _check_common(target, n, v, class_weight, token_weight, ignore_index, reduction, label_smoothing, softcap,
                  scale, lse_square_scale, "input", input.device, dtype)
    x2 = input.reshape(n, input.shape[-1])
    out_dtype = _loss_dtype(dtype, input)
    loss, zl, lse, _ = _linear_ce_core(
        x2, weight, bias, tgt, probs, class_weight, None if token_weight is None else token_weight.reshape(-1),
        int(ignore_index), reduction, float(label_smoothing), float(lse_square_scale), float(scale),
        None if softcap is None else float(softcap), False, None, int(chunk_bytes or 0),
        return_lse, filter_eps)
    return _finish(loss, zl, lse, lead, reduction, out_dtype, return_lse, return_z_loss)


def _is_dtensor(t) -> bool:
    """A DTensor (without importing torch.distributed when nothing distributed is in use)."""
    if type(t) is torch.Tensor or type(t) is torch.nn.Parameter or not isinstance(t, torch.Tensor):
        return False
    import torch.distributed as dist

    if not dist.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _needs_grad(*ts) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in ts)


def _linear_ce_core(x2, weight, bias, tgt, probs, class_weight, token_weight, ignore_index, reduction, eps, z_scale,
                    scale, softcap, return_logits, logits_dtype, chunk_bytes, need_lse=False, filter_eps=None):
    """Validated, flattened arguments -> (loss or rows (fp32/fp64), z_loss or None, lse (N,) or None, logits or None).

    Picks the CPU fused path (gradients in the forward, 3 matmuls) for scalar reductions of
    class-index targets when a gradient is needed, else the statistics op (any device)."""
    n, v = x2.shape[0], weight.shape[0]
    # token_weight needing a gradient: the statistics op (the fused op has no gradient for it;
    # in _compose it is a plain differentiable factor)
    fused = (probs is None and reduction != "none" and not need_lse and not config.use_triton(x2)
             and _needs_grad(x2, weight, bias) and not _needs_grad(token_weight))
    if fused:
        loss, zl, logits, _, _, _ = _linear_ce_loss(x2, weight, bias, tgt, class_weight, token_weight, ignore_index,
                                                    reduction, eps, z_scale, scale, softcap, return_logits,
                                                    logits_dtype, chunk_bytes)
        return loss, (zl if z_scale else None), None, (logits if return_logits else None)
    out = {}

    def stats(need_ws, t, p):
        lse, tl, om, ws, logits = _linear_ce_stats(x2, weight, bias, t, p, class_weight, ignore_index, scale, softcap,
                                                   need_ws, return_logits, logits_dtype, chunk_bytes)
        out["logits"] = logits if return_logits else None
        return lse, tl, om, ws

    loss, zl, lse = _run_stats(stats, tgt, probs, n, v, class_weight, token_weight, ignore_index, reduction, eps,
                               z_scale)
    return loss, zl, lse, out["logits"]


def _run_stats(stats, tgt, probs, n, v, class_weight, token_weight, ignore_index, reduction, eps, z_scale):
    """Run a statistics op and compose the loss: -> (loss or rows, z_loss or None, lse)."""
    if probs is not None:
        # soft targets: weighted_sum = sum_j w_j q'_j z_ij with the smoothed q'
        q = probs if not eps else probs * (1.0 - eps) + eps / v
        dummy = torch.zeros(n, dtype=torch.long, device=probs.device)
        lse, tl, om, ws = stats(True, dummy, q)
        loss, zl = _compose(lse, tl, ws, None, q, v, class_weight, token_weight, ignore_index, reduction, 0.0, z_scale)
    else:
        lse, tl, om, ws = stats(bool(eps), tgt, None)
        loss, zl = _compose(lse, tl, ws, tgt, None, v, class_weight, token_weight, ignore_index, reduction, eps,
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
    (ALGORITHMS.md 1.4); Liger-Kernel's cross-entropy is the peer.
    """
    if not isinstance(input, torch.Tensor):
        raise TypeError(f"input must be a Tensor, got {type(input).__name__}")
    if input.dtype not in _FLOAT:
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
    tgt, probs = _targets(target, lead, v, "logits")
    n = 1
    for s in lead:
        n *= s
    _check_common(target, n, v, weight, token_weight, ignore_index, reduction, label_smoothing, softcap, scale,
                  lse_square_scale, "logits", input.device, dtype)
    x2 = x.reshape(n, v)
    out_dtype = _loss_dtype(dtype, input)
    cb = int(chunk_bytes or 0)
    sc, cap = float(scale), None if softcap is None else float(softcap)
    loss, zl, lse = _run_stats(
        lambda need_ws, t, p: _ce_stats(x2, t, p, weight, int(ignore_index), sc, cap, need_ws, cb), tgt, probs, n, v,
        weight, None if token_weight is None else token_weight.reshape(-1), int(ignore_index), reduction,
        float(label_smoothing), float(lse_square_scale))
    return _finish(loss, zl, lse, lead, reduction, out_dtype, return_lse, return_z_loss)
