"""The fused CPU path of linear cross-entropy (``smx::linear_ce_loss``): scalar reductions, gradients computed
in the forward pass.

For reduction mean/sum the per-row backward coefficients are known in the forward up to
the scalar grad_output (they depend only on the targets, the weights and the row's own
lse), so the forward computes the gradients while each logits chunk is hot in cache:
3 matmuls (as eager) instead of 4 (stats, then recompute in backward). The same idea as
PyTorch's chunked F.linear_cross_entropy and Liger-Kernel's fused linear CE.
"""

from __future__ import annotations

import torch

from ..common import acc_dtype, autocast_off
from .chunked import rows_per_chunk, transform_logits_
from .loss import check_range, compose_loss

__all__ = ["MIN_CHUNK_ROWS", "scalar_coefs", "saved_grad_dtype", "fused_forward", "add_logits_grad"]

#: Fewest rows per chunk on the fused CPU path: below ~256 rows the three matmuls per chunk run
#: well under the machine's matmul throughput (the weight is re-read once per chunk).
MIN_CHUNK_ROWS = 256


def scalar_coefs(target, v, class_weight, token_weight, ignore_index, reduction, eps, z_scale, acc):
    """Per-row coefficients (a0, b0, c0, zc) of d(loss)/d(lse, -target_logit, -weighted_sum) for grad_output 1.

    ``a_i = a0_i + zc_i * lse_i`` (the z-loss term depends on the row's lse). Each is (N,) in ``acc`` (a
    Python float where constant); ``c0`` is None without label smoothing (``eps``), ``zc`` without z-loss."""
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


def saved_grad_dtype(dtype: torch.dtype) -> torch.dtype:
    """dtype of the gradients the fused forward computes for grad_output = 1, for inputs of ``dtype``.

    fp16 keeps them in fp32: they are scaled by the real grad_output only in the backward, and
    an unscaled fp16 gradient (``p / N`` of a mean, before a loss scaler's 2^16) underflows
    where torch's scaled one does not. bf16 has fp32's range: it keeps its own dtype."""
    return torch.float32 if dtype == torch.float16 else dtype


@autocast_off
def fused_forward(input, weight, bias, target, class_weight, token_weight, ignore_index, reduction, eps, z_scale,
                  scale, softcap, logits_out, chunk_bytes, argmax_out=None):
    """Loss and gradients for grad_output = 1 in one pass over the logits chunks (the body of
    ``smx::linear_ce_loss``): every option of the scalar reductions (class / token weights, ignore_index,
    label smoothing ``eps``, z-loss ``z_scale``, ``scale``, ``softcap``, returned logits).

    With ``P'`` = softmax with its target entry replaced by ``-(sum of the other classes)`` (the
    collapse-safe ``p_y - 1``; Prieto et al., 2025), the gradient w.r.t. the transformed logits is
    ``diag(a) P' + diag(a - b) Y - diag(c) 1 w^T`` (``Y`` one-hot, ``w`` the class weights or ones;
    ``a == b`` and ``c == 0`` for plain CE), times ``dz/dx`` (``scale``, or ``scale * (1 - (z / softcap)^2)``
    elementwise with a soft-cap). The row factors pass through the matmuls, so per chunk

        grad_input  = a * (P' @ W) + (a - b) * W[y]
        grad_weight += P'^T @ (a * E) + index_add_y((a - b) * E)

    and without smoothing or soft-cap the only passes over the chunk's logits are the matmul that writes
    them, a row max, ATen's in-place softmax and one sum. Label smoothing adds one pass (the weighted sum):
    its ``c w^T`` term is rank one, so its products with W and E are taken apart (``c (w @ W)``,
    ``w (c @ E)``). A soft-cap multiplies by ``dz/dx`` (one pass); the smoothing term is then elementwise:
    the chunk is scaled by ``a`` first (one pass) and the term subtracted (one pass). Ignored rows are
    skipped entirely (unless the logits are returned); chunks reuse one buffer, of at least
    :data:`MIN_CHUNK_ROWS` rows unless ``chunk_bytes`` is given.

    Args:
        input (N, D), weight (V, D), bias (V,) or None: one float dtype (the matmul runs in it, as F.linear).
        target: (N,) int64 class indices. class_weight (V,), token_weight (N,): or None.
        ignore_index, reduction ("mean" / "sum"), eps, z_scale, scale, softcap: the loss's options.
        logits_out: an (N, V) tensor that receives the transformed logits, or None. chunk_bytes: 0 for the
            default (:func:`~.chunked.rows_per_chunk`).
        argmax_out: an (N,) int64 tensor that receives each computed row's ``torch.argmax`` of the transformed
            logits (the row max the softmax takes anyway), or None; skipped (ignored) rows are left as they are.

    Returns:
        ``(loss, z_loss or None, lse (N,), grad_input, grad_weight, grad_bias or None)``: loss in fp32 (fp64);
        the gradients of input / weight in :func:`saved_grad_dtype`, of bias in fp32 (fp64). ``lse`` is 0 on the
        skipped (ignored) rows.

    Raises:
        IndexError: a target outside [0, V) that is not ``ignore_index`` (CPU).

    Source: the same idea as PyTorch's chunked ``F.linear_cross_entropy`` and Liger-Kernel's fused linear CE;
    the statistics of cut cross-entropy (Wijmans et al., 2024).
    """
    n, v = target.shape[0], weight.shape[0]
    acc = acc_dtype(input)
    check_range(target, ignore_index, v)
    a0, b0, c0, zc = scalar_coefs(target, v, class_weight, token_weight, ignore_index, reduction, eps, z_scale, acc)
    lse = torch.zeros(n, dtype=acc, device=input.device)
    tl = torch.zeros(n, dtype=acc, device=input.device)
    ws = torch.zeros(n, dtype=acc, device=input.device) if eps else None
    w_full = class_weight.to(acc) if (eps and class_weight is not None) else None
    gdt = saved_grad_dtype(input.dtype)
    # the matmul for grad_input runs in gi's dtype (fp16: on an fp32 copy of the weight)
    w_gi = weight if weight.dtype == gdt else weight.to(gdt)
    gw = torch.zeros(weight.shape, dtype=acc, device=weight.device)
    gb = torch.zeros(v, dtype=acc, device=weight.device) if bias is not None else None
    valid_all = target != ignore_index
    rows = None
    if logits_out is None or not v:
        rows = valid_all.nonzero().squeeze(1)  # only the rows that contribute (data-dependent: inside the op)
        gi = torch.zeros(input.shape, dtype=gdt, device=input.device)
        count = rows.numel()
    else:
        gi = torch.empty(input.shape, dtype=gdt, device=input.device)
        count = n
    step = max(rows_per_chunk(v, chunk_bytes, acc), min(MIN_CHUNK_ROWS, count) if not chunk_bytes else 1)
    buf = torch.empty((min(step, count), v), dtype=acc, device=input.device) if count else None
    dbuf = torch.empty((min(step, count), v), dtype=acc, device=input.device) if count and softcap is not None \
        else None
    gbuf = torch.empty((min(step, count), input.shape[1]), dtype=acc, device=input.device) if count else None
    same = input.dtype == acc and weight.dtype == acc
    # smoothing without soft-cap: the -c w^T term of the gradient is rank one, so its products are taken apart:
    # grad_input -= c (w @ W) per chunk; grad_weight -= w (c @ E) and grad_bias -= w sum(c) once, at the end
    rank_one = bool(eps) and softcap is None and count > 0
    if rank_one:
        c_sum = torch.zeros((), dtype=acc, device=input.device)
        c_e = torch.zeros(input.shape[1], dtype=acc, device=input.device)
        w_w = torch.zeros(input.shape[1], dtype=acc, device=input.device)
        for j0 in range(0, v, step):  # w @ W in acc, a chunk of rows at a time (no copy of W)
            wj = w_gi[j0:j0 + step] if w_gi.dtype == acc else w_gi[j0:j0 + step].to(acc)
            w_w += w_full[j0:j0 + step] @ wj if w_full is not None else wj.sum(0)
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
        transform_logits_(zsrc, scale, softcap)
        if logits_out is not None and not direct:
            logits_out[sel].copy_(z)
            if logits_out.dtype != acc:
                z.copy_(logits_out[sel])  # the loss sees the logits the caller sees, as in eager
        tgt = target[sel]
        valid = valid_all[sel]
        idx = torch.where(valid, tgt, 0).unsqueeze(1)
        tl[sel] = torch.where(valid, zsrc.gather(1, idx).squeeze(1), 0.0)
        if ws is not None:
            ws[sel] = zsrc @ w_full if w_full is not None else zsrc.sum(1)
        dzdx = None
        if softcap is not None:
            # dz/dx = scale * (1 - (z / softcap)^2), from z before the softmax overwrites it
            dzdx = dbuf[:r]
            torch.mul(zsrc, zsrc, out=dzdx).mul_(-scale / (softcap * softcap)).add_(scale)
        m, am = zsrc.max(1)  # torch.max's index is the first maximum, as torch.argmax's
        if argmax_out is not None:
            argmax_out[sel] = am
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
        k = scale if dzdx is None else 1.0  # the scalar part of dz/dx
        a_s, ab_s = a * k, ab * k
        if dzdx is not None:
            ab_s = ab_s * dzdx.gather(1, idx).squeeze(1)  # the target entry's dz/dx
        row = a_s  # the row factor applied after the matmuls
        if c0 is not None:
            c_s = c0[sel] * k
            if not rank_one:
                # times the soft-cap's dz/dx the -c w^T term is elementwise: the row factor goes in first
                z.mul_(a_s.unsqueeze(1))
                if w_full is not None:
                    z.addcmul_(c_s.unsqueeze(1), w_full, value=-1.0)
                else:
                    z.sub_(c_s.unsqueeze(1))
                row = None
        if dzdx is not None:
            z.mul_(dzdx)
        has_ab = bool((ab_s != 0).any())
        ef = e if e.dtype == acc else e.to(acc)
        g = gbuf[:r]
        if w_gi.dtype == acc:
            torch.mm(z, w_gi, out=g)
        else:
            g.copy_(z.to(w_gi.dtype) @ w_gi)
        if row is not None:
            g.mul_(row.unsqueeze(1))
        if has_ab:
            g.add_(w_gi.index_select(0, idx.squeeze(1)).to(acc) * ab_s.unsqueeze(1))
        if rank_one:
            g.addr_(c_s, w_w, alpha=-1.0)
            c_sum += c_s.sum()
            c_e += c_s @ ef
        gi[sel] = g.to(gdt)
        gw.addmm_(z.t(), ef * row.unsqueeze(1) if row is not None else ef)
        if has_ab:
            gw.index_add_(0, idx.squeeze(1), ef * ab_s.unsqueeze(1))
        if gb is not None:
            gb.add_(z.t() @ row if row is not None else z.sum(0))
            if has_ab:
                gb.index_add_(0, idx.squeeze(1), ab_s)
    if rank_one:  # grad_weight -= w (c @ E), grad_bias -= w sum(c)
        if w_full is not None:
            gw.addr_(w_full, c_e, alpha=-1.0)
        else:
            gw.sub_(c_e)
        if gb is not None:
            gb.sub_(w_full * c_sum if w_full is not None else c_sum)
    loss, zl = compose_loss(lse, tl, ws, target, None, v, class_weight, token_weight, ignore_index, reduction, eps,
                            z_scale)
    return loss, zl, lse, gi, gw.to(gdt), gb  # gb: V numbers, kept in fp32 (fp64): rounded once, in the backward


@autocast_off
def add_logits_grad(grad_logits, logits, input, weight, grad_loss, saved_gi, saved_gw, saved_gb, grad_input,
                    grad_weight, grad_bias, scale, softcap, chunk_bytes):
    """The body of ``smx::linear_add_logits_grad_`` (see :func:`.ops.linear_add_logits_grad_`)."""
    if grad_logits.numel() == 0 or not bool(grad_logits.any()):
        return
    acc = acc_dtype(input)
    gl = grad_loss.reshape(()).to(acc)
    n, v = logits.shape
    gi = saved_gi.to(acc) * gl
    gw = saved_gw.to(acc) * gl
    gb = saved_gb.to(acc) * gl if (grad_bias is not None and saved_gb is not None) else None
    step = rows_per_chunk(v, chunk_bytes, acc)
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
