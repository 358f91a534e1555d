"""The fused CPU path of linear cross-entropy (``smx::linear_ce_loss``): for reduction mean / sum the gradients
are computed in the forward, while each logits chunk is in cache (3 matmuls, as eager, instead of 4); see
docs/DESIGN.md, "Cross-entropy". The same idea as PyTorch's chunked F.linear_cross_entropy and Liger-Kernel's."""

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
    """dtype of the gradients the fused forward computes for grad_output = 1, for inputs of ``dtype``: fp32 for
    fp16, whose unscaled gradient (``p / N`` of a mean, before a loss scaler's 2^16) would underflow; else ``dtype``."""
    return torch.float32 if dtype == torch.float16 else dtype


class _FusedChunks:
    """The buffers and gradient accumulators of one :func:`fused_forward` call, and its per-chunk steps."""

    def __init__(self, input, weight, bias, target, *, class_weight, ignore_index, eps, scale, softcap, logits_out,
                 chunk_bytes):
        rows, vocab, dim = target.shape[0], weight.shape[0], input.shape[1]
        acc = self.acc = acc_dtype(input)
        self.input, self.weight, self.bias, self.logits_out = input, weight, bias, logits_out
        self.scale, self.softcap = scale, softcap
        self.lse = torch.zeros(rows, dtype=acc, device=input.device)
        self.target_logit = torch.zeros(rows, dtype=acc, device=input.device)
        self.weighted_sum = torch.zeros(rows, dtype=acc, device=input.device) if eps else None
        # the class weights of label smoothing's weighted sum (None: ones)
        self.smoothing_weight = class_weight.to(acc) if (eps and class_weight is not None) else None
        self.grad_dtype = saved_grad_dtype(input.dtype)
        # the matmul for grad_input runs in the gradient's dtype (fp16: on an fp32 copy of the weight)
        self.weight_gi = weight if weight.dtype == self.grad_dtype else weight.to(self.grad_dtype)
        self.grad_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device)
        self.grad_bias = torch.zeros(vocab, dtype=acc, device=weight.device) if bias is not None else None
        self.valid = target != ignore_index
        self.rows = None
        if logits_out is None or not vocab:
            self.rows = self.valid.nonzero().squeeze(1)  # only the rows that contribute (data-dependent)
            self.grad_input = torch.zeros(input.shape, dtype=self.grad_dtype, device=input.device)
            self.count = self.rows.numel()
        else:
            self.grad_input = torch.empty(input.shape, dtype=self.grad_dtype, device=input.device)
            self.count = rows
        count = self.count
        self.step = max(rows_per_chunk(vocab, chunk_bytes, acc), min(MIN_CHUNK_ROWS, count) if not chunk_bytes else 1)
        height = min(self.step, count)
        self.logits_buf = torch.empty((height, vocab), dtype=acc, device=input.device) if count else None
        self.dzdx_buf = (torch.empty((height, vocab), dtype=acc, device=input.device)
                         if count and softcap is not None else None)
        self.grad_buf = torch.empty((height, dim), dtype=acc, device=input.device) if count else None
        self.same = input.dtype == acc and weight.dtype == acc
        # smoothing without soft-cap: the -c w^T term of the gradient is rank one, so its products are taken apart:
        # grad_input -= c (w @ W) per chunk; grad_weight -= w (c @ E) and grad_bias -= w sum(c) once, at the end
        self.rank_one = bool(eps) and softcap is None and count > 0
        if self.rank_one:
            self.c_sum = torch.zeros((), dtype=acc, device=input.device)
            self.c_e = torch.zeros(dim, dtype=acc, device=input.device)
            self.w_w = torch.zeros(dim, dtype=acc, device=input.device)
            for j0 in range(0, vocab, self.step):  # w @ W in acc, a chunk of rows at a time (no copy of W)
                rows_w = self.weight_gi[j0:j0 + self.step]
                rows_w = rows_w if rows_w.dtype == acc else rows_w.to(acc)
                weights = self.smoothing_weight
                self.w_w += rows_w.sum(0) if weights is None else weights[j0:j0 + self.step] @ rows_w

    def logits(self, sel, height):
        """The chunk's transformed logits: ``(embeddings, z, zsrc)``, ``zsrc`` being ``z`` or, when the returned
        logits are fp32 (fp64) rows, their slice that the matmul wrote in place."""
        acc, weight, bias, logits_out = self.acc, self.weight, self.bias, self.logits_out
        embeddings = self.input[sel]
        z = self.logits_buf[:height]
        direct = self.same and logits_out is not None and logits_out.dtype == acc and isinstance(sel, slice)
        zsrc = logits_out[sel] if direct else z
        if self.same:
            if bias is not None:
                torch.addmm(bias, embeddings, weight.t(), out=zsrc)
            else:
                torch.mm(embeddings, weight.t(), out=zsrc)
        else:
            z.copy_(torch.addmm(bias, embeddings, weight.t()) if bias is not None else embeddings @ weight.t())
        transform_logits_(zsrc, self.scale, self.softcap)
        if logits_out is not None and not direct:
            logits_out[sel].copy_(z)
            if logits_out.dtype != acc:
                z.copy_(logits_out[sel])  # the loss sees the logits the caller sees, as in eager
        return embeddings, z, zsrc

    def softmax(self, sel, z, zsrc, target, argmax_out):
        """The chunk's statistics, and ``z`` overwritten by ``P'`` (the softmax with the collapse-safe target
        entry ``-(mass of the other classes)``): -> ``(valid, target index (r, 1), lse, dz/dx or None)``."""
        scale, softcap = self.scale, self.softcap
        valid = self.valid[sel]
        idx = torch.where(valid, target[sel], 0).unsqueeze(1)
        self.target_logit[sel] = torch.where(valid, zsrc.gather(1, idx).squeeze(1), 0.0)
        if self.weighted_sum is not None:
            self.weighted_sum[sel] = zsrc @ self.smoothing_weight if self.smoothing_weight is not None else zsrc.sum(1)
        dzdx = None
        if softcap is not None:
            # dz/dx = scale * (1 - (z / softcap)^2), from z before the softmax overwrites it
            dzdx = self.dzdx_buf[:z.shape[0]]
            torch.mul(zsrc, zsrc, out=dzdx).mul_(-scale / (softcap * softcap)).add_(scale)
        row_max, arg = zsrc.max(1)  # torch.max's index is the first maximum, as torch.argmax's
        if argmax_out is not None:
            argmax_out[sel] = arg
        torch.ops.aten._softmax.out(zsrc, 1, False, out=z)  # out of place from the returned logits
        # lse = m + log(sum exp(z - m)) = m - log(p_max): the row max's probability is 1 / sum
        lse = row_max - torch.log(z.gather(1, arg.unsqueeze(1)).squeeze(1))
        self.lse[sel] = lse
        z.scatter_(1, idx, 0.0)
        other_mass = z.sum(1)  # the collapse-safe 1 - p_target
        z.scatter_(1, idx, (-other_mass).unsqueeze(1))
        return valid, idx, lse, dzdx

    def row_factors(self, sel, z, valid, idx, lse, dzdx, coefs):
        """The rows' gradient factors from :func:`scalar_coefs`' ``coefs``; what cannot pass through the matmuls
        (the smoothing term under a soft-cap, dz/dx) is applied to ``z`` here. -> ``(row factor or None, target
        entry factor, smoothing factor or None)``."""
        a0, b0, c0, zc = coefs
        a = a0[sel] if zc is None else a0[sel] + zc[sel] * lse
        a = torch.where(valid, a, 0.0)
        ab = torch.where(valid, a - b0[sel], 0.0)
        k = self.scale if dzdx is None else 1.0  # the scalar part of dz/dx
        a_s, ab_s = a * k, ab * k
        if dzdx is not None:
            ab_s = ab_s * dzdx.gather(1, idx).squeeze(1)  # the target entry's dz/dx
        row, c_s = a_s, None
        if c0 is not None:
            c_s = c0[sel] * k
            if not self.rank_one:
                # times the soft-cap's dz/dx the -c w^T term is elementwise: the row factor goes in first
                z.mul_(a_s.unsqueeze(1))
                if self.smoothing_weight is not None:
                    z.addcmul_(c_s.unsqueeze(1), self.smoothing_weight, value=-1.0)
                else:
                    z.sub_(c_s.unsqueeze(1))
                row = None
        if dzdx is not None:
            z.mul_(dzdx)
        return row, ab_s, c_s

    def products(self, sel, embeddings, z, idx, row, ab_s, c_s):
        """Add the chunk's products with W and E to the gradients (``grad_input = row * (G @ W) + ab * W[y]``,
        ``grad_weight += G^T @ (row * E) + index_add_y(ab * E)``)."""
        acc, weight_gi, grad_bias = self.acc, self.weight_gi, self.grad_bias
        has_ab = bool((ab_s != 0).any())
        ef = embeddings if embeddings.dtype == acc else embeddings.to(acc)
        g = self.grad_buf[:z.shape[0]]
        if weight_gi.dtype == acc:
            torch.mm(z, weight_gi, out=g)
        else:
            g.copy_(z.to(weight_gi.dtype) @ weight_gi)
        if row is not None:
            g.mul_(row.unsqueeze(1))
        if has_ab:
            g.add_(weight_gi.index_select(0, idx.squeeze(1)).to(acc) * ab_s.unsqueeze(1))
        if self.rank_one:
            g.addr_(c_s, self.w_w, alpha=-1.0)
            self.c_sum += c_s.sum()
            self.c_e += c_s @ ef
        self.grad_input[sel] = g.to(self.grad_dtype)
        self.grad_weight.addmm_(z.t(), ef * row.unsqueeze(1) if row is not None else ef)
        if has_ab:
            self.grad_weight.index_add_(0, idx.squeeze(1), ef * ab_s.unsqueeze(1))
        if grad_bias is not None:
            grad_bias.add_(z.t() @ row if row is not None else z.sum(0))
            if has_ab:
                grad_bias.index_add_(0, idx.squeeze(1), ab_s)

    def finish_rank_one(self):
        """The smoothing term's rank-one products: grad_weight -= w (c @ E), grad_bias -= w sum(c)."""
        if not self.rank_one:
            return
        if self.smoothing_weight is not None:
            self.grad_weight.addr_(self.smoothing_weight, self.c_e, alpha=-1.0)
        else:
            self.grad_weight.sub_(self.c_e)
        if self.grad_bias is not None:
            self.grad_bias.sub_(self.smoothing_weight * self.c_sum if self.smoothing_weight is not None else self.c_sum)


@autocast_off
def fused_forward(input, weight, bias, target, class_weight, token_weight, ignore_index, reduction, eps, z_scale,
                  scale, softcap, logits_out, chunk_bytes, argmax_out=None):
    """Loss and gradients for grad_output = 1 in one pass over the logits chunks (the body of
    ``smx::linear_ce_loss``): every option of the scalar reductions (class / token weights, ignore_index,
    label smoothing ``eps``, z-loss ``z_scale``, ``scale``, ``softcap``, returned logits).

    The row factors pass through the matmuls (docs/DESIGN.md, "Cross-entropy: the CPU fused path, pass by
    pass"); ignored rows are skipped unless the logits are returned; chunks of at least :data:`MIN_CHUNK_ROWS`
    rows (unless ``chunk_bytes`` is given) reuse one buffer.

    Args:
        input (N, D), weight (V, D), bias (V,) or None: one float dtype (the matmul runs in it, as F.linear).
        target: (N,) int64 class indices. class_weight (V,), token_weight (N,): or None.
        ignore_index, reduction ("mean" / "sum"), eps, z_scale, scale, softcap: the loss's options.
        logits_out: an (N, V) tensor that receives the transformed logits, or None. chunk_bytes: 0 for the
            default (:func:`~.chunked.rows_per_chunk`).
        argmax_out: an (N,) int64 tensor that receives each computed row's first argmax of the transformed
            logits, or None; skipped (ignored) rows are left as they are.

    Returns:
        ``(loss, z_loss or None, lse (N,), grad_input, grad_weight, grad_bias or None)``: loss in fp32 (fp64);
        the gradients of input / weight in :func:`saved_grad_dtype`, of bias in fp32 (fp64). ``lse`` is 0 on the
        skipped (ignored) rows.

    Raises IndexError for a target outside [0, V) that is not ``ignore_index`` (CPU).

    Source: the same idea as PyTorch's chunked ``F.linear_cross_entropy`` and Liger-Kernel's fused linear CE;
    the statistics of cut cross-entropy (Wijmans et al., 2024); the target entry: Prieto et al., 2025.
    """
    vocab = weight.shape[0]
    check_range(target, ignore_index, vocab)
    chunks = _FusedChunks(input, weight, bias, target, class_weight=class_weight, ignore_index=ignore_index, eps=eps,
                          scale=scale, softcap=softcap, logits_out=logits_out, chunk_bytes=chunk_bytes)
    coefs = scalar_coefs(target, vocab, class_weight, token_weight, ignore_index, reduction, eps, z_scale,
                         chunks.acc)
    for r0 in range(0, chunks.count, chunks.step):
        r1 = min(chunks.count, r0 + chunks.step)
        sel = slice(r0, r1) if chunks.rows is None else chunks.rows[r0:r1]
        embeddings, z, zsrc = chunks.logits(sel, r1 - r0)
        valid, idx, lse, dzdx = chunks.softmax(sel, z, zsrc, target, argmax_out)
        row, ab_s, c_s = chunks.row_factors(sel, z, valid, idx, lse, dzdx, coefs)
        chunks.products(sel, embeddings, z, idx, row, ab_s, c_s)
    chunks.finish_rank_one()
    loss, z_loss = compose_loss(chunks.lse, chunks.target_logit, chunks.weighted_sum, target=target, probs=None,
                                v=vocab, class_weight=class_weight, token_weight=token_weight,
                                ignore_index=ignore_index, reduction=reduction, label_smoothing=eps,
                                lse_square_scale=z_scale)
    # grad_bias: V numbers, kept in fp32 (fp64): rounded once, in the backward
    return loss, z_loss, chunks.lse, chunks.grad_input, chunks.grad_weight.to(chunks.grad_dtype), chunks.grad_bias


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
