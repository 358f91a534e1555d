"""The torch path of the cross-entropy statistics ops (CPU, and soft targets on any device): row chunks with
ATen matmuls, each chunk's logits living only in a buffer of at most ``chunk_bytes``."""

from __future__ import annotations

import torch

from ..common import acc_dtype, autocast_off
from .loss import check_range

__all__ = ["DEFAULT_CHUNK_BYTES", "empty_contiguous", "rows_per_chunk", "transform_logits_", "chunk_logits",
           "weights_rows", "torch_forward", "torch_backward"]

#: Default size of one chunk of logits (fp32) on the torch path, in bytes.
DEFAULT_CHUNK_BYTES = 32 * 2**20


def empty_contiguous(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A contiguous empty tensor like ``t`` (the ops' outputs are contiguous, whatever ``t``'s strides)."""
    return torch.empty(t.shape, dtype=dtype or t.dtype, device=t.device)


def rows_per_chunk(v: int, chunk_bytes: int | None, dtype: torch.dtype = torch.float32) -> int:
    """Rows of one logits chunk of ``v`` classes: ``chunk_bytes`` (0 / None: :data:`DEFAULT_CHUNK_BYTES`) of
    ``dtype`` (the accumulation dtype) entries, at least 1."""
    budget = DEFAULT_CHUNK_BYTES if not chunk_bytes else chunk_bytes
    itemsize = torch.finfo(dtype).bits // 8
    return max(1, budget // max(1, v * itemsize))


def transform_logits_(x: torch.Tensor, scale: float, softcap: float | None) -> torch.Tensor:
    """z = softcap * tanh(scale * x / softcap) (or scale * x), in place on an fp32/fp64 chunk; returns ``x``."""
    if softcap is not None:
        x.mul_(scale / softcap).tanh_().mul_(softcap)
    elif scale != 1.0:
        x.mul_(scale)
    return x


def chunk_logits(input, weight, bias, r0, r1, out_dtype, buf=None):
    """Raw logits of rows r0:r1 (``input`` (N, D), ``weight`` (V, D), ``bias`` (V,) or None; the matmul in the
    input dtype, as F.linear), as an (r1 - r0, V) ``out_dtype`` tensor."""
    e = input[r0:r1]
    if bias is not None:
        x = torch.addmm(bias, e, weight.t())
    else:
        x = e @ weight.t()
    if x.dtype != out_dtype:
        x = x.to(out_dtype)
    return x


def weights_rows(class_weight, probs, r0, r1, acc):
    """The (rows x V) or (V,) weights of ``weighted_sum`` for rows r0:r1 (``class_weight`` (V,) times the
    probability targets ``probs`` (N, V), either None), in ``acc``; None when both are None (all ones)."""
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


@autocast_off
def torch_forward(input, weight, bias, target, probs, class_weight, ignore_index, scale, softcap,
                  need_ws, logits_out, chunk_bytes, logits=None, argmax_out=None):
    """Statistics by row chunks: ``(lse, target_logit, other_mass, weighted_sum or None)``, each (N,) fp32
    (fp64 for fp64 inputs), as ``smx::linear_ce_stats`` / ``smx::ce_stats`` define them. ``logits`` (raw,
    N x V) replaces the matmul for the plain op; ``logits_out`` (N, V) receives the transformed logits;
    ``argmax_out`` ((N,) int64, or None) receives each row's ``torch.argmax`` of the transformed logits (the
    first maximum; 0 when ``V == 0``), taken from the same chunks.

    Raises:
        IndexError: a class-index target outside [0, V) that is not ``ignore_index`` (CPU).
    """
    n = target.shape[0]
    v = weight.shape[0] if logits is None else logits.shape[1]
    acc = acc_dtype(input if logits is None else logits)
    dev = target.device
    lse = torch.empty(n, dtype=acc, device=dev)
    tl = torch.empty(n, dtype=acc, device=dev)
    om = torch.empty(n, dtype=acc, device=dev)
    ws = torch.empty(n, dtype=acc, device=dev) if need_ws else None
    step = rows_per_chunk(v, chunk_bytes, acc)
    has_target = probs is None
    if has_target:
        check_range(target, ignore_index, v)
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        if logits is None:
            z = chunk_logits(input, weight, bias, r0, r1, acc)
        else:
            z = logits[r0:r1].to(acc, copy=True)
        transform_logits_(z, scale, softcap)
        if logits_out is not None:
            logits_out[r0:r1].copy_(z)
            if logits_out.dtype != acc:
                # the loss sees the logits the caller sees (rounded to their dtype), as in eager
                z = logits_out[r0:r1].to(acc)
        if argmax_out is not None:
            argmax_out[r0:r1] = z.argmax(1) if v else 0
        w = weights_rows(class_weight, probs, r0, r1, acc)
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
    return _finish_grad(g, tgt, om, a, b, c, w=w, ignore_index=ignore_index, glog=glog, has_target=has_target,
                        dzdx=dzdx)


@autocast_off
def torch_backward(input, weight, bias, target, probs, class_weight, lse, om, a, b, c, ignore_index, scale,
                   softcap, logits, grad_logits, needs, chunk_bytes, raw_logits=None):
    """Gradients by row chunks of ``sum_i a_i lse_i - b_i z_{i,y_i} - c_i weighted_sum_i`` (docs/DESIGN.md,
    "Cross-entropy: the statistics and the backward's coefficients"): (grad_input, grad_weight, grad_bias), the
    ``needs`` of them, or the gradient of ``raw_logits`` for the plain op."""
    n = target.shape[0]
    base = input if raw_logits is None else raw_logits
    acc = acc_dtype(base)
    v = weight.shape[0] if raw_logits is None else raw_logits.shape[1]
    need_in, need_w, need_b = needs
    gi = empty_contiguous(input) if (raw_logits is None and need_in) else None
    gw = torch.zeros(weight.shape, dtype=acc, device=weight.device) if (raw_logits is None and need_w) else None
    gb = torch.zeros(v, dtype=acc, device=weight.device) if (raw_logits is None and need_b) else None
    graw = None if raw_logits is None else torch.empty(raw_logits.shape, dtype=raw_logits.dtype,
                                                       device=raw_logits.device)
    step = rows_per_chunk(v, chunk_bytes, acc)
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
            x = chunk_logits(input, weight, bias, r0, r1, acc)
        w = weights_rows(class_weight, probs, r0, r1, acc)
        glog = None if grad_logits is None else grad_logits[r0:r1].to(acc)
        tgt = target[r0:r1] if has_target else None
        cc = None if c is None else c[r0:r1]
        if x is not None:
            g = _grad_chunk(x, tgt, lse[r0:r1], om[r0:r1], a[r0:r1], b[r0:r1], cc, w=w, ignore_index=ignore_index,
                            scale=scale, softcap=softcap, glog=glog, has_target=has_target)
        else:
            # softcap with saved logits: same steps as _grad_chunk on z
            g = _finish_grad(g, tgt, om[r0:r1], a[r0:r1], b[r0:r1], cc, w=w, ignore_index=ignore_index, glog=glog,
                             has_target=has_target, dzdx=dzdx)
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
