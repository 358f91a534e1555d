"""The forward kernel of the flash-style attention (and the dropout keep-mask), with its launcher: see
:mod:`smxcompile.kernels.attention.triton_common` for the method and the semantics."""

from __future__ import annotations

import math

import torch

from ..triton_helpers import (cdiv, check_runtime, interpret_env, interpreted, on_device, tl,
                              triton)  # triton, tl: None without it
from .triton_common import SPARSE_ITERS, check_args, launch_config

__all__ = ["attention_forward", "dropout_keep_mask"]


if triton is not None:
    from ..triton_helpers import cast_like, dot, safe_max
    from .triton_common import closed_tau, keep_mask, row_coef, scores_at, sigmoid_pair, softplus, sparse_sums

    @triton.jit
    def _fwd_kernel(
        q_ptr, k_ptr, v_ptr, mask_ptr, par_ptr, n_ptr, o_ptr, st_ptr,
        q_sb, q_sh, q_sl, q_se, k_sb, k_sh, k_ss, k_se, v_sb, v_sh, v_ss, v_se,
        mk_sb, mk_sh, mk_sl, mk_ss, o_sb, o_sh, o_sl, o_se,
        H, G, L, S, E, EV, scale, softcap, seed, dropout_p, log_skip, n_iter,
        NORM: tl.constexpr, HAS_PARAM: tl.constexpr, HAS_N: tl.constexpr, MASK_KIND: tl.constexpr, IS_CAUSAL: tl.constexpr,
        HAS_SOFTCAP: tl.constexpr, DROPOUT: tl.constexpr, SKIP: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_EV: tl.constexpr,
        PREC: tl.constexpr, DOT_F32: tl.constexpr, FIX_BF16: tl.constexpr,
    ):
        """One program: BLOCK_M query rows of one (batch, query head)."""
        bh = tl.program_id(0).to(tl.int64)
        pid_m = tl.program_id(1).to(tl.int64)
        b = bh // H
        h = bh % H
        hk = h // G
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
        row_ok = rows < L
        offs_e = tl.arange(0, BLOCK_E).to(tl.int64)
        e_ok = offs_e < E
        offs_v = tl.arange(0, BLOCK_EV).to(tl.int64)
        v_ok = offs_v < EV
        q = tl.load(q_ptr + (b * q_sb + h * q_sh + rows[:, None] * q_sl + offs_e[None, :] * q_se),
                    mask=row_ok[:, None] & e_ok[None, :], other=0.0)
        k_base = b * k_sb + hk * k_sh
        v_base = b * v_sb + hk * v_sh
        mk_base = b * mk_sb + h * mk_sh
        if HAS_PARAM:
            param = tl.load(par_ptr + bh)
        else:
            param = 0.0
        coef, lg = row_coef(rows, row_ok, S, param, n_ptr, bh * L, NORM, HAS_PARAM, IS_CAUSAL, HAS_N)
        hi = S
        if IS_CAUSAL:
            hi = tl.minimum(S, (pid_m + 1) * BLOCK_M)
        inv_keep = 1.0 / (1.0 - dropout_p)

        acc = tl.zeros([BLOCK_M, BLOCK_EV], tl.float32)
        st0 = tl.zeros([BLOCK_M], tl.float32)
        st1 = tl.zeros([BLOCK_M], tl.float32)
        if NORM <= 2 or NORM == 5:
            # online (m, d, acc): softmax / ssmax from (-inf, 0); softmax1 (the sink) from (0, 1); softpick (0, 0)
            if NORM == 0 or NORM == 2:
                m = tl.full([BLOCK_M], float("-inf"), tl.float32)
            else:
                m = tl.zeros([BLOCK_M], tl.float32)
            if NORM == 1:
                d = tl.zeros([BLOCK_M], tl.float32) + 1.0
            else:
                d = tl.zeros([BLOCK_M], tl.float32)
            for start in range(0, hi, BLOCK_N):
                s, sc, vis, cols, col_ok = scores_at(start, q, k_ptr, k_base, k_ss, k_se, offs_e, e_ok, rows,
                                                     row_ok, S, mask_ptr, mk_base, mk_sl, mk_ss, scale, softcap,
                                                     MASK_KIND, IS_CAUSAL, HAS_SOFTCAP, BLOCK_M, BLOCK_N, PREC,
                                                     DOT_F32)
                if NORM == 2:
                    s = s * coef[:, None]
                z = tl.where(vis, s, float("-inf"))
                tmax = tl.max(z, axis=1)
                if SKIP:
                    # BLASST: skip the tile when every row's tile max is ln(lambda) below its running max
                    live = row_ok & (tmax > float("-inf")) & ((tmax - m) >= log_skip)
                    go = tl.sum(live.to(tl.int32), axis=0) > 0
                else:
                    go = True
                if go:
                    m_new = tl.maximum(m, tmax)
                    ms_new = safe_max(m_new)
                    # min(., 0) guards -inf - (-inf) (a prefix without visible keys, d == 0)
                    alpha = tl.exp(tl.minimum(safe_max(m) - ms_new, 0.0))
                    if NORM == 5:
                        a = tl.where(vis, tl.exp(z - ms_new[:, None]) - tl.exp(-ms_new)[:, None], 0.0)
                        p = tl.maximum(a, 0.0)
                        d = d * alpha + tl.sum(tl.abs(a), axis=1)
                    else:
                        p = tl.exp(z - ms_new[:, None])
                        d = d * alpha + tl.sum(p, axis=1)
                    if DROPOUT:
                        p = tl.where(keep_mask(seed, bh, L, S, rows, cols, dropout_p), p * inv_keep, 0.0)
                    vt = tl.load(v_ptr + (v_base + cols[:, None] * v_ss + offs_v[None, :] * v_se),
                                 mask=col_ok[:, None] & v_ok[None, :], other=0.0)
                    acc = dot(cast_like(p, v_ptr, FIX_BF16), vt, acc * alpha[:, None], PREC, DOT_F32)
                    m = m_new
            st0 = safe_max(m)
            if NORM == 5:
                d = d + coef * tl.exp(-st0)
            st1 = d
            acc = acc * tl.where(d > 0.0, 1.0 / d, 0.0)[:, None]
        elif NORM <= 6:
            # sigmoid / relu (no row reduction), softplus (a plain row sum: no max needed)
            fsum = tl.zeros([BLOCK_M], tl.float32)
            for start in range(0, hi, BLOCK_N):
                s, sc, vis, cols, col_ok = scores_at(start, q, k_ptr, k_base, k_ss, k_se, offs_e, e_ok, rows,
                                                     row_ok, S, mask_ptr, mk_base, mk_sl, mk_ss, scale, softcap,
                                                     MASK_KIND, IS_CAUSAL, HAS_SOFTCAP, BLOCK_M, BLOCK_N, PREC,
                                                     DOT_F32)
                if NORM == 3:
                    sg, _ = sigmoid_pair(s + coef[:, None])
                    p = tl.where(vis, sg, 0.0)
                elif NORM == 4:
                    p = tl.where(vis, tl.maximum(s, 0.0) * coef[:, None], 0.0)
                else:
                    p = tl.where(vis, softplus(s * coef[:, None]), 0.0)
                    fsum += tl.sum(p, axis=1)
                if DROPOUT:
                    p = tl.where(keep_mask(seed, bh, L, S, rows, cols, dropout_p), p * inv_keep, 0.0)
                vt = tl.load(v_ptr + (v_base + cols[:, None] * v_ss + offs_v[None, :] * v_se),
                             mask=col_ok[:, None] & v_ok[None, :], other=0.0)
                acc = dot(cast_like(p, v_ptr, FIX_BF16), vt, acc, PREC, DOT_F32)
            if NORM == 6:
                st1 = fsum
                acc = acc * tl.where(fsum > 0.0, 1.0 / fsum, 0.0)[:, None]
        else:
            # sparsemax / entmax15: the row max, bracketing passes on tau, the exact finish.
            mx = tl.full([BLOCK_M], float("-inf"), tl.float32)
            for start in range(0, hi, BLOCK_N):
                s, sc, vis, cols, col_ok = scores_at(start, q, k_ptr, k_base, k_ss, k_se, offs_e, e_ok, rows,
                                                     row_ok, S, mask_ptr, mk_base, mk_sl, mk_ss, scale, softcap,
                                                     MASK_KIND, IS_CAUSAL, HAS_SOFTCAP, BLOCK_M, BLOCK_N, PREC,
                                                     DOT_F32)
                if NORM == 8:
                    s = s * 0.5
                mx = tl.maximum(mx, tl.max(tl.where(vis, s, float("-inf")), axis=1))
            mxs = safe_max(mx)
            lo = tl.zeros([BLOCK_M], tl.float32) - 1.0  # in y = z - max units: tau in [-1, 0]
            up = tl.zeros([BLOCK_M], tl.float32)
            for _it in range(n_iter):
                t = (lo + up) * 0.5
                cnt, s1, s2, f1, f2 = sparse_sums(t, mxs, hi, q, k_ptr, k_base, k_ss, k_se, offs_e, e_ok, rows,
                                                  row_ok, S, mask_ptr, mk_base, mk_sl, mk_ss, scale, softcap, NORM,
                                                  MASK_KIND, IS_CAUSAL, HAS_SOFTCAP, BLOCK_M, BLOCK_N, PREC, DOT_F32)
                ok, tc = closed_tau(cnt, s1, s2, NORM)
                if NORM == 8:
                    f = f2
                else:
                    f = f1
                below = f >= 1.0  # t <= tau: {y > t} contains the support
                lo = tl.where(below, tl.maximum(lo, t), lo)
                up = tl.where(below, up, tl.minimum(up, t))
                if NORM == 8:
                    # closed forms of a superset / subset of the support bound tau above / below; Newton below
                    up = tl.where(below & ok, tl.minimum(up, tc), up)
                    lo = tl.where(~below & ok, tl.maximum(lo, tc), lo)
                    newton = t + (f2 - 1.0) / tl.maximum(2.0 * f1, 1e-30)
                    lo = tl.where(below & (cnt > 0.0), tl.maximum(lo, newton), lo)
                else:
                    # sparsemax: the closed form of any {y > t} is a lower bound (a Newton step when t <= tau)
                    lo = tl.where(ok, tl.maximum(lo, tc), lo)
                lo = tl.minimum(lo, up)
            cnt, s1, s2, f1, f2 = sparse_sums(lo, mxs, hi, q, k_ptr, k_base, k_ss, k_se, offs_e, e_ok, rows, row_ok,
                                              S, mask_ptr, mk_base, mk_sl, mk_ss, scale, softcap, NORM, MASK_KIND,
                                              IS_CAUSAL, HAS_SOFTCAP, BLOCK_M, BLOCK_N, PREC, DOT_F32)
            ok, tc = closed_tau(cnt, s1, s2, NORM)
            tau = tl.where(ok, tc, lo)
            for start in range(0, hi, BLOCK_N):
                s, sc, vis, cols, col_ok = scores_at(start, q, k_ptr, k_base, k_ss, k_se, offs_e, e_ok, rows,
                                                     row_ok, S, mask_ptr, mk_base, mk_sl, mk_ss, scale, softcap,
                                                     MASK_KIND, IS_CAUSAL, HAS_SOFTCAP, BLOCK_M, BLOCK_N, PREC,
                                                     DOT_F32)
                if NORM == 8:
                    s = s * 0.5
                g = tl.where(vis, tl.maximum((s - mxs[:, None]) - tau[:, None], 0.0), 0.0)
                if NORM == 8:
                    p = g * g
                else:
                    p = g
                if DROPOUT:
                    p = tl.where(keep_mask(seed, bh, L, S, rows, cols, dropout_p), p * inv_keep, 0.0)
                vt = tl.load(v_ptr + (v_base + cols[:, None] * v_ss + offs_v[None, :] * v_se),
                             mask=col_ok[:, None] & v_ok[None, :], other=0.0)
                acc = dot(cast_like(p, v_ptr, FIX_BF16), vt, acc, PREC, DOT_F32)
            st0 = tau + mxs

        tl.store(o_ptr + (b * o_sb + h * o_sh + rows[:, None] * o_sl + offs_v[None, :] * o_se),
                 cast_like(acc, o_ptr, FIX_BF16), mask=row_ok[:, None] & v_ok[None, :])
        so = (bh * L + rows) * 2
        tl.store(st_ptr + so, st0, mask=row_ok)
        tl.store(st_ptr + (so + 1), st1, mask=row_ok)

    @triton.jit
    def _keep_kernel(out_ptr, L, S, seed, dropout_p, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """The dropout keep-mask the attention kernels use, as uint8 (B*H, L, S)."""
        bh = tl.program_id(0).to(tl.int64)
        rows = tl.program_id(1).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
        row_ok = rows < L
        for start in range(0, S, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N).to(tl.int64)
            keep = keep_mask(seed, bh, L, S, rows, cols, dropout_p)
            tl.store(out_ptr + ((bh * L + rows[:, None]) * S + cols[None, :]), keep.to(tl.uint8),
                     mask=row_ok[:, None] & (cols < S)[None, :])


def attention_forward(q, k, v, attn_mask, is_causal: bool, scale: float, softcap: float | None, normalizer: str,
                      norm_param: torch.Tensor | None, dropout_p: float, seed: int, *,
                      n_keys: torch.Tensor | None = None,
                      skip_threshold: float | None = None, sparse_iters: int | None = None,
                      block_m: int | None = None, block_n: int | None = None,
                      num_warps: int | None = None, num_stages: int | None = None):
    """Attention ``out = normalizer(transform(q k^T)) v`` in one streaming pass over K/V tiles (several for
    sparsemax / entmax15); semantics in :mod:`.triton_common`.

    Args:
        q: ``(B, Hq, L, E)``; k: ``(B, Hkv, S, E)``; v: ``(B, Hkv, S, Ev)``: fp16 / bf16 / fp32, one dtype, any
            strides, ``Hq % Hkv == 0``. CUDA, or CPU under ``TRITON_INTERPRET=1``.
        attn_mask: None, or ``(B, Hq, L, S)`` bool (True = may attend) or float (added; -inf = masked), any strides.
        is_causal: key ``j`` visible to query ``i`` iff ``j <= i``. scale: multiplies ``q k^T``. softcap: or None.
        normalizer: one of :data:`NORM_CODES`. norm_param: None or fp32 contiguous ``(B, Hq)``.
        dropout_p, seed: dropout on the weights (Philox ``tl.rand(seed, offset)``; off at 0).
        skip_threshold: BLASST ``lambda`` in (0, 1), softmax only; None: exact.
        sparse_iters: bracketing passes for sparsemax / entmax15 (default :data:`SPARSE_ITERS`).
        block_m, block_n, num_warps, num_stages: launch overrides (blocks: powers of two >= 16).

    Returns:
        ``(out, stats)``: ``out`` ``(B, Hq, L, Ev)`` in q's dtype, contiguous; ``stats`` fp32 ``(B, Hq, L, 2)``.
    """
    B, Hq, Hkv, L, S, E, Ev, mask, kind, scale, softcap, code = check_args(
        q, k, v, attn_mask, is_causal, scale, softcap, normalizer, norm_param, dropout_p, seed)
    if skip_threshold is not None:
        if code != 0:
            raise ValueError("skip_threshold is supported for the softmax normalizer only")
        if isinstance(skip_threshold, bool) or not isinstance(skip_threshold, (int, float)) or \
                not 0.0 < skip_threshold < 1.0:
            raise ValueError(f"skip_threshold must be None or a float in (0, 1), got {skip_threshold!r}")
    n_iter = SPARSE_ITERS if sparse_iters is None else sparse_iters
    if isinstance(n_iter, bool) or not isinstance(n_iter, int) or n_iter < 0:
        raise ValueError(f"sparse_iters must be an int >= 0, got {sparse_iters!r}")
    cs, opts, a = launch_config(q, k, v, mask, kind, is_causal, scale, softcap, code, norm_param, dropout_p, seed, E, Ev,
                                L, S, block_m, block_n, num_warps, num_stages, n_keys)
    check_runtime(q, "attention")
    out = torch.empty((B, Hq, L, Ev), dtype=q.dtype, device=q.device)
    if B * Hq * L == 0 or S == 0:
        stats = torch.zeros((B, Hq, L, 2), dtype=torch.float32, device=q.device)
        return (out.zero_() if S == 0 else out), stats
    stats = torch.empty((B, Hq, L, 2), dtype=torch.float32, device=q.device)  # the kernel writes every row's
    with on_device(q):
        _fwd_kernel[(B * Hq, cdiv(L, cs["BLOCK_M"]))](
            q, k, v, a["mask_t"], a["par"], a["n"], out, stats,
            *q.stride(), *k.stride(), *v.stride(), *a["mk"], *out.stride(),
            Hq, Hq // Hkv, L, S, E, Ev, scale, a["softcap"], a["seed"], a["dropout_p"],
            math.log(skip_threshold) if skip_threshold is not None else 0.0, n_iter,
            SKIP=skip_threshold is not None, FIX_BF16=interpreted(), **cs, **opts,
        )
    return out, stats


def dropout_keep_mask(B: int, H: int, L: int, S: int, dropout_p: float, seed: int, device="cpu") -> torch.Tensor:
    """The dropout keep-mask (bool ``(B, H, L, S)``) that the attention kernels draw for these
    arguments (same Philox offsets); a debugging / testing helper."""
    if triton is None or not (torch.device(device).type == "cuda" or interpret_env()):
        check_runtime(torch.empty(0, device=device), "attention")
    out = torch.zeros((B, H, L, S), dtype=torch.uint8, device=device)
    if B * H * L * S:
        with on_device(out):
            _keep_kernel[(B * H, cdiv(L, 16))](out, L, S, int(seed), float(dropout_p), BLOCK_M=16, BLOCK_N=64)
    return out.bool()
