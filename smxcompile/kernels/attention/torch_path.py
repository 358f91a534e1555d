"""The torch path of ``smx::attention`` (CPU, and fp64 everywhere): blocks of query rows, each block's scores
materialized at most :data:`BLOCK_BYTES` at a time, the backward recomputing each block (docs/DESIGN.md,
"Attention op: paths")."""

from __future__ import annotations

import torch

from ..common import acc_dtype, autocast_off
from .reference import NORMALIZERS, causal_keep, visible_keys

__all__ = ["torch_forward", "torch_backward", "BLOCK_BYTES"]

#: Bytes of one block's scores (fp32, or fp64 for fp64 inputs); the block's working set is a small multiple.
BLOCK_BYTES = 4 * 2**20

_MASK64 = (1 << 64) - 1


def _plan_blocks(pairs: int, group: int, L: int, S: int, itemsize: int, budget: int | None = None):
    """Blocks ``(p0, p1, l0, l1)`` of kv pairs (one batch entry's kv head with its ``group`` query heads) and query
    rows, whose scores take at most ``budget`` (default :data:`BLOCK_BYTES`) unless one row of one pair is larger:
    one pair split into row ranges, or whole pairs grouped."""
    budget = BLOCK_BYTES if budget is None else budget
    row_bytes = max(1, group * max(S, 1) * itemsize)
    rows = max(1, budget // row_bytes)
    if rows >= L:
        rows = max(L, 1)
        per = max(1, min(pairs, budget // (row_bytes * max(L, 1))))
    else:
        per = 1
    return [(p0, min(p0 + per, pairs), l0, min(l0 + rows, L))
            for p0 in range(0, pairs, per) for l0 in range(0, L, rows)]


def _mix_seed(seed: int, index: int) -> int:
    """A generator seed for block ``index`` of a run seeded ``seed`` (splitmix64 finalizer)."""
    x = (seed + (index + 1) * 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) & ((1 << 63) - 1)


class _Problem:
    """The torch path's view of one call: 4-D contiguous q, k, v regrouped by kv head."""

    def __init__(self, q, k, v, attn_mask, is_causal, scale, softcap, normalizer, norm_param, dropout_p, seed,
                 n_keys=None):
        self.B, self.Hq, self.L, self.E = q.shape
        self.Hkv, self.S = k.shape[1], k.shape[2]
        self.Ev = v.shape[3]
        self.g = self.Hq // self.Hkv if self.Hkv else 1
        self.P = self.B * self.Hkv
        self.acc = acc_dtype(q)
        self.device = q.device
        self.q5 = q.contiguous().view(self.P, self.g, self.L, self.E)
        self.k3 = k.reshape(self.P, self.S, self.E).to(self.acc)
        self.v3 = v.reshape(self.P, self.S, self.Ev).to(self.acc)
        self.mask = attn_mask
        self.mask4 = None
        if attn_mask is not None:
            m5 = attn_mask.expand(self.B, self.Hq, self.L, self.S).unflatten(1, (self.Hkv, self.g))
            self.mask5 = m5
            try:
                self.mask4 = m5.view(self.P, self.g, self.L, self.S)
            except RuntimeError:
                self.mask4 = None  # indexed per block
        self.param = None if norm_param is None else norm_param.reshape(self.P, self.g).to(self.acc)
        self.is_causal, self.scale, self.softcap = is_causal, scale, softcap
        self.spec = NORMALIZERS[normalizer]
        self.dropout_p, self.seed = dropout_p, seed
        # per-row key counts (B, Hq, L) regrouped like q, or None (n by position)
        self.n5 = None if n_keys is None else n_keys.to(self.acc).reshape(self.P, self.g, self.L, 1)
        itemsize = torch.finfo(self.acc).bits // 8
        self.blocks = _plan_blocks(self.P, self.g, self.L, self.S, itemsize)

    def keys(self, l1: int) -> int:
        """Keys a block of rows ending at ``l1`` needs: all, or under ``is_causal`` the first ``l1``."""
        return min(self.S, l1) if self.is_causal else self.S

    def mask_block(self, p0, p1, l0, l1, se):
        if self.mask4 is not None:
            return self.mask4[p0:p1, :, l0:l1, :se]
        p = torch.arange(p0, p1, device=self.device)
        return self.mask5[p // self.Hkv, p % self.Hkv, :, l0:l1, :se]

    def consts(self, index, p0, p1, l0, l1, se):
        """The block's non-differentiable inputs (over its first ``se`` keys): keep, additive mask,
        n, dropout multiplier."""
        keep = madd = None
        if self.mask is not None:
            m = self.mask_block(p0, p1, l0, l1, se)
            if m.dtype == torch.bool:
                keep = m
            else:
                madd = m.to(self.acc)
                keep = madd != float("-inf")
        if self.is_causal:
            c = causal_keep(l0, l1, se, self.device)
            keep = c if keep is None else keep & c
        if self.n5 is not None:
            n = self.n5[p0:p1, :, l0:l1].clamp(min=1.0)
        else:
            n = visible_keys(l0, l1, self.S, self.is_causal, self.acc, self.device)
        drop = None
        if self.dropout_p > 0:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(_mix_seed(self.seed, index))
            u = torch.rand((p1 - p0, self.g, l1 - l0, se), generator=gen, dtype=self.acc, device=self.device)
            drop = (u >= self.dropout_p).to(self.acc) * (1.0 / (1.0 - self.dropout_p))
        return keep, madd, n, drop

    def block(self, index, p0, p1, l0, l1):
        """One block's forward pieces over its ``se = keys(l1)`` keys: (q block (P, g, Lb, E), k, v, param or None,
        scores s (P, g, Lb, se), tanh of the soft-cap or None, weights w before dropout, keep, n, dropout or None)."""
        se = self.keys(l1)
        keep, madd, n, drop = self.consts(index, p0, p1, l0, l1, se)
        qb = self.q5[p0:p1, :, l0:l1].to(self.acc)
        kb, vb = self.k3[p0:p1, :se], self.v3[p0:p1, :se]
        P, g, Lb, E = qb.shape
        pb = None if self.param is None else self.param[p0:p1].view(P, g, 1, 1)
        s = torch.matmul(qb.reshape(P, g * Lb, E), kb.transpose(1, 2)).view(P, g, Lb, se)
        s.mul_(self.scale)
        t = None
        if self.softcap is not None:
            t = torch.tanh(s.div_(self.softcap))
            s = t * self.softcap
        if madd is not None:
            s.add_(madd)
        w = self.spec.ref(s, keep, n, pb)
        return qb, kb, vb, pb, s, t, w, keep, n, drop


@autocast_off
def torch_forward(q, k, v, attn_mask, is_causal, scale, softcap, normalizer, norm_param, dropout_p, seed,
                  n_keys=None):
    """``smx::attention``'s output on the torch path (arguments of :func:`~.ops.attention_op`): (B, Hq, L, Ev) in
    q's dtype, by blocks of query rows in fp32 (fp64 for fp64), as "FlashAttention" (Dao et al., 2022) tiles."""
    B, Hq, L, _ = q.shape
    S, Ev = k.shape[2], v.shape[3]
    out = torch.empty((B, Hq, L, Ev), dtype=q.dtype, device=q.device)
    if out.numel() == 0:
        return out
    if S == 0:
        return out.zero_()
    pr = _Problem(q, k, v, attn_mask, is_causal, scale, softcap, normalizer, norm_param, dropout_p, seed, n_keys)
    out5 = out.view(pr.P, pr.g, L, Ev)
    for index, (p0, p1, l0, l1) in enumerate(pr.blocks):
        qb, kb, vb, pb, s, t, w, keep, n, drop = pr.block(index, p0, p1, l0, l1)
        if drop is not None:
            w = w * drop
        P, g, Lb, _ = qb.shape
        out5[p0:p1, :, l0:l1] = torch.matmul(w.view(P, g * Lb, -1), vb).view(P, g, Lb, Ev)
    return out


@autocast_off
def torch_backward(grad_out, q, k, v, attn_mask, is_causal, scale, softcap, normalizer, norm_param, dropout_p,
                   seed, n_keys=None):
    """Recompute each block's scores and weights, then (FlashAttention's backward, per block)
    dv += w'^T dO, dw = (dO v^T) * dropout, ds = normalizer.vjp(dw), through the soft-cap and the
    scale, dq = ds k, dk += ds^T q."""
    acc = acc_dtype(q)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc, device=v.device)
    dp = None if norm_param is None else torch.zeros(norm_param.shape, dtype=norm_param.dtype, device=q.device)
    B, Hq, L = q.shape[:3]
    S, Ev = k.shape[2], v.shape[3]
    if B * Hq * L and S and Ev:  # otherwise every gradient is 0 (E = 0 still has a dv)
        pr = _Problem(q, k, v, attn_mask, is_causal, scale, softcap, normalizer, norm_param, dropout_p, seed,
                      n_keys)
        g5 = grad_out.reshape(pr.P, pr.g, L, Ev)
        dq5, dk3 = dq.view(pr.P, pr.g, L, pr.E), dk.view(pr.P, S, pr.E)
        dv3 = dv.view(pr.P, S, Ev)
        dp2 = None if dp is None else dp.view(pr.P, pr.g)
        for index, (p0, p1, l0, l1) in enumerate(pr.blocks):
            qb, kb, vb, pb, s, t, w, keep, n, drop = pr.block(index, p0, p1, l0, l1)
            P, g, Lb, E = qb.shape
            se = kb.shape[1]
            go = g5[p0:p1, :, l0:l1].to(acc).reshape(P, g * Lb, Ev)
            wd = w if drop is None else w * drop
            dv3[p0:p1, :se] += torch.matmul(wd.view(P, g * Lb, se).transpose(1, 2), go)
            dw = torch.matmul(go, vb.transpose(1, 2)).view(P, g, Lb, se)
            if drop is not None:
                dw = dw * drop
            ds, dpe = pr.spec.vjp(s, keep, n, pb, w, dw)
            if t is not None:
                ds = ds * (1.0 - t * t)
            ds = (ds * scale).view(P, g * Lb, se)
            dq5[p0:p1, :, l0:l1] = torch.matmul(ds, kb).view(P, g, Lb, E)
            dk3[p0:p1, :se] += torch.matmul(ds.transpose(1, 2), qb.reshape(P, g * Lb, E))
            if dp2 is not None:
                dp2[p0:p1] += dpe.sum((-2, -1)).to(dp2.dtype)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dp


