"""The backward kernels of the flash-style attention (the row pre-pass and the per-key-block pass), with their
launcher: see :mod:`smxcompile.kernels.attention.triton_common` for the method and the formulas."""

from __future__ import annotations

import torch

from ..triton_helpers import cdiv, check_runtime, interpreted, on_device, tl, triton  # triton, tl: None without it
from .triton_common import check_args, launch_config, tensor4

__all__ = ["attention_backward"]

_SOFTMAX_LIKE = (0, 1, 2, 5, 6)  # backward uses delta = rowsum(dO * O)
#: CUDA's grid axis 1 holds at most 65535 programs: past that, the backward puts (batch, kv head) on axis 0
MAX_GRID_Y = 65535


if triton is not None:
    from ..triton_helpers import cast_like, dot
    from .triton_common import keep_mask, row_coef, scores, scores_at, sigmoid_pair, softplus

    @triton.jit
    def _bwd_pre_kernel(
        q_ptr, k_ptr, v_ptr, mask_ptr, par_ptr, o_ptr, do_ptr, st_ptr, delta_ptr, dpar_ptr,
        q_sb, q_sh, q_sl, q_se, k_sb, k_sh, k_ss, k_se, v_sb, v_sh, v_ss, v_se,
        mk_sb, mk_sh, mk_sl, mk_ss, o_sb, o_sh, o_sl, o_se, do_sb, do_sh, do_sl, do_se,
        H, G, L, S, E, EV, scale, softcap, seed, dropout_p,
        NORM: tl.constexpr, HAS_PARAM: tl.constexpr, HAS_N: tl.constexpr, MASK_KIND: tl.constexpr, IS_CAUSAL: tl.constexpr,
        HAS_SOFTCAP: tl.constexpr, DROPOUT: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_EV: tl.constexpr,
        PREC: tl.constexpr, DOT_F32: tl.constexpr,
    ):
        """Per query row: ``delta`` (softmax-like: ``rowsum(dO * O)``; sparsemax:
        ``mean_supp dP``; entmax15: ``sum(g dP) / sum g``) and softpick's ``deps``."""
        bh = tl.program_id(0).to(tl.int64)
        pid_m = tl.program_id(1).to(tl.int64)
        b = bh // H
        h = bh % H
        hk = h // G
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
        row_ok = rows < L
        offs_v = tl.arange(0, BLOCK_EV).to(tl.int64)
        v_ok = offs_v < EV
        rv_ok = row_ok[:, None] & v_ok[None, :]
        do = tl.load(do_ptr + (b * do_sb + h * do_sh + rows[:, None] * do_sl + offs_v[None, :] * do_se),
                     mask=rv_ok, other=0.0)
        if NORM >= 7:
            offs_e = tl.arange(0, BLOCK_E).to(tl.int64)
            e_ok = offs_e < E
            q = tl.load(q_ptr + (b * q_sb + h * q_sh + rows[:, None] * q_sl + offs_e[None, :] * q_se),
                        mask=row_ok[:, None] & e_ok[None, :], other=0.0)
            k_base = b * k_sb + hk * k_sh
            v_base = b * v_sb + hk * v_sh
            mk_base = b * mk_sb + h * mk_sh
            tau = tl.load(st_ptr + (bh * L + rows) * 2, mask=row_ok, other=0.0)
            hi = S
            if IS_CAUSAL:
                hi = tl.minimum(S, (pid_m + 1) * BLOCK_M)
            inv_keep = 1.0 / (1.0 - dropout_p)
            num = tl.zeros([BLOCK_M], tl.float32)
            den = tl.zeros([BLOCK_M], tl.float32)
            for start in range(0, hi, BLOCK_N):
                s, sc, vis, cols, col_ok = scores_at(start, q, k_ptr, k_base, k_ss, k_se, offs_e, e_ok, rows,
                                                     row_ok, S, mask_ptr, mk_base, mk_sl, mk_ss, scale, softcap,
                                                     MASK_KIND, IS_CAUSAL, HAS_SOFTCAP, BLOCK_M, BLOCK_N, PREC,
                                                     DOT_F32)
                vt = tl.load(v_ptr + (v_base + cols[None, :] * v_ss + offs_v[:, None] * v_se),
                             mask=v_ok[:, None] & col_ok[None, :], other=0.0)
                dp = dot(do, vt, tl.zeros([BLOCK_M, BLOCK_N], tl.float32), PREC, DOT_F32)
                if DROPOUT:
                    dp = tl.where(keep_mask(seed, bh, L, S, rows, cols, dropout_p), dp * inv_keep, 0.0)
                if NORM == 8:
                    g = tl.where(vis, tl.maximum(s * 0.5 - tau[:, None], 0.0), 0.0)
                else:
                    g = tl.where(vis & (s > tau[:, None]), 1.0, 0.0)
                num += tl.sum(g * dp, axis=1)
                den += tl.sum(g, axis=1)
            delta = tl.where(den > 0.0, num / tl.maximum(den, 1e-30), 0.0)
        else:
            o = tl.load(o_ptr + (b * o_sb + h * o_sh + rows[:, None] * o_sl + offs_v[None, :] * o_se),
                        mask=rv_ok, other=0.0)
            delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), axis=1)
            if NORM == 5:
                if HAS_PARAM:
                    # deps = -sum_i delta_i / Z_i,  1 / Z = e^{-m} / den
                    so = (bh * L + rows) * 2
                    m = tl.load(st_ptr + so, mask=row_ok, other=0.0)
                    dn = tl.load(st_ptr + (so + 1), mask=row_ok, other=0.0)
                    contrib = tl.where(row_ok & (dn > 0.0), -delta * tl.exp(-m) / tl.where(dn > 0.0, dn, 1.0), 0.0)
                    tl.atomic_add(dpar_ptr + bh, tl.sum(contrib, axis=0), sem="relaxed")
        tl.store(delta_ptr + bh * L + rows, delta, mask=row_ok)

    @triton.jit
    def _bwd_kernel(
        q_ptr, k_ptr, v_ptr, mask_ptr, par_ptr, n_ptr, do_ptr, st_ptr, delta_ptr, dq_ptr, dk_ptr, dv_ptr, dpar_ptr,
        q_sb, q_sh, q_sl, q_se, k_sb, k_sh, k_ss, k_se, v_sb, v_sh, v_ss, v_se,
        mk_sb, mk_sh, mk_sl, mk_ss, do_sb, do_sh, do_sl, do_se,
        H, HKV, G, L, S, E, EV, scale, softcap, seed, dropout_p,
        NORM: tl.constexpr, HAS_PARAM: tl.constexpr, HAS_N: tl.constexpr, MASK_KIND: tl.constexpr, IS_CAUSAL: tl.constexpr,
        HAS_SOFTCAP: tl.constexpr, DROPOUT: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_EV: tl.constexpr,
        PREC: tl.constexpr, DOT_F32: tl.constexpr, FIX_BF16: tl.constexpr, KEYS_FIRST: tl.constexpr,
    ):
        """One program: BLOCK_N keys of one (batch, kv head), over every query head of its group
        and every query block. dK, dV in registers; dQ (fp32, (B, H, L, E)) by atomics. ``KEYS_FIRST``: the
        key blocks on grid axis 0, so one head's programs run together and share its Q, dO, dQ in L2."""
        if KEYS_FIRST:
            bhk = tl.program_id(1).to(tl.int64)
            pid_n = tl.program_id(0).to(tl.int64)
        else:
            bhk = tl.program_id(0).to(tl.int64)
            pid_n = tl.program_id(1).to(tl.int64)
        b = bhk // HKV
        hk = bhk % HKV
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
        col_ok = cols < S
        offs_e = tl.arange(0, BLOCK_E).to(tl.int64)
        e_ok = offs_e < E
        offs_v = tl.arange(0, BLOCK_EV).to(tl.int64)
        v_ok = offs_v < EV
        kk = tl.load(k_ptr + (b * k_sb + hk * k_sh + cols[:, None] * k_ss + offs_e[None, :] * k_se),
                     mask=col_ok[:, None] & e_ok[None, :], other=0.0)
        vv = tl.load(v_ptr + (b * v_sb + hk * v_sh + cols[:, None] * v_ss + offs_v[None, :] * v_se),
                     mask=col_ok[:, None] & v_ok[None, :], other=0.0)
        kt = tl.trans(kk)
        vt = tl.trans(vv)
        dk = tl.zeros([BLOCK_N, BLOCK_E], tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_EV], tl.float32)
        m_lo = 0
        if IS_CAUSAL:
            m_lo = ((pid_n * BLOCK_N) // BLOCK_M) * BLOCK_M
        inv_keep = 1.0 / (1.0 - dropout_p)
        for g in range(0, G):
            h = hk * G + g
            bh = b * H + h
            mk_base = b * mk_sb + h * mk_sh
            if HAS_PARAM:
                param = tl.load(par_ptr + bh)
            else:
                param = 0.0
            dpar = tl.zeros([BLOCK_M], tl.float32)
            for start_m in range(m_lo, L, BLOCK_M):
                rows = start_m + tl.arange(0, BLOCK_M).to(tl.int64)
                row_ok = rows < L
                q = tl.load(q_ptr + (b * q_sb + h * q_sh + rows[:, None] * q_sl + offs_e[None, :] * q_se),
                            mask=row_ok[:, None] & e_ok[None, :], other=0.0)
                do = tl.load(do_ptr + (b * do_sb + h * do_sh + rows[:, None] * do_sl + offs_v[None, :] * do_se),
                             mask=row_ok[:, None] & v_ok[None, :], other=0.0)
                so = (bh * L + rows) * 2
                st0 = tl.load(st_ptr + so, mask=row_ok, other=0.0)
                st1 = tl.load(st_ptr + (so + 1), mask=row_ok, other=0.0)
                coef, lg = row_coef(rows, row_ok, S, param, n_ptr, bh * L, NORM, HAS_PARAM, IS_CAUSAL, HAS_N)
                s, sc, vis = scores(q, kt, rows, row_ok, cols, col_ok, mask_ptr, mk_base, mk_sl, mk_ss, scale,
                                    softcap, MASK_KIND, IS_CAUSAL, HAS_SOFTCAP, BLOCK_M, BLOCK_N, PREC, DOT_F32)
                s = tl.where(vis, s, 0.0)  # finite everywhere below; masked entries are dropped by `vis`
                # the weights w
                if NORM <= 2:
                    z = s
                    if NORM == 2:
                        z = s * coef[:, None]
                    w = tl.exp(z - st0[:, None]) * tl.where(st1 > 0.0, 1.0 / st1, 0.0)[:, None]
                elif NORM == 3:
                    w, w1 = sigmoid_pair(s + coef[:, None])
                elif NORM == 4:
                    w = tl.maximum(s, 0.0) * coef[:, None]
                elif NORM == 5:
                    invz = tl.where(st1 > 0.0, 1.0 / st1, 0.0)
                    u = tl.exp(s - st0[:, None]) * invz[:, None]  # e^s / Z
                    w = tl.maximum(u - (tl.exp(-st0) * invz)[:, None], 0.0)
                elif NORM == 6:
                    x = s * coef[:, None]
                    invf = tl.where(st1 > 0.0, 1.0 / st1, 0.0)
                    w = softplus(x) * invf[:, None]
                elif NORM == 7:
                    w = tl.maximum(s - st0[:, None], 0.0)
                else:
                    gg = tl.maximum(s * 0.5 - st0[:, None], 0.0)
                    w = gg * gg
                w = tl.where(vis, w, 0.0)
                if DROPOUT:
                    keep = keep_mask(seed, bh, L, S, rows, cols, dropout_p)
                    wd = tl.where(keep, w * inv_keep, 0.0)
                else:
                    wd = w
                dv = dot(tl.trans(cast_like(wd, v_ptr, FIX_BF16)), do, dv, PREC, DOT_F32)
                dp = dot(do, vt, tl.zeros([BLOCK_M, BLOCK_N], tl.float32), PREC, DOT_F32)
                if DROPOUT:
                    dp = tl.where(keep, dp * inv_keep, 0.0)
                if NORM == 3 or NORM == 4:
                    if NORM == 3:
                        ds = dp * w * w1
                        dpar_e = ds
                    else:
                        ds = tl.where(s > 0.0, dp * coef[:, None], 0.0)
                        dpar_e = dp * tl.maximum(s, 0.0)
                else:
                    delta = tl.load(delta_ptr + bh * L + rows, mask=row_ok, other=0.0)
                    if NORM <= 2:
                        ds = w * (dp - delta[:, None])
                        if NORM == 2:
                            dpar_e = ds * s * lg[:, None]
                            ds = ds * coef[:, None]
                    elif NORM == 5:
                        sgn = tl.where(s > 0.0, 1.0, tl.where(s < 0.0, -1.0, 0.0))
                        ds = u * (tl.where(s > 0.0, dp, 0.0) - sgn * delta[:, None])
                    elif NORM == 6:
                        sg, _ = sigmoid_pair(x)
                        dx = sg * (dp - delta[:, None]) * invf[:, None]
                        dpar_e = dx * s
                        ds = dx * coef[:, None]
                    elif NORM == 7:
                        ds = tl.where(s > st0[:, None], dp - delta[:, None], 0.0)
                    else:
                        ds = gg * (dp - delta[:, None])
                ds = tl.where(vis, ds, 0.0)
                if HAS_PARAM:
                    if NORM == 2 or NORM == 3 or NORM == 4 or NORM == 6:
                        dpar += tl.sum(tl.where(vis, dpar_e, 0.0), axis=1)
                if HAS_SOFTCAP:
                    r = sc / softcap
                    ds = ds * (scale * (1.0 - r * r))
                else:
                    ds = ds * scale
                dsc = cast_like(ds, q_ptr, FIX_BF16)
                dk = dot(tl.trans(dsc), q, dk, PREC, DOT_F32)
                dq = dot(dsc, kk, tl.zeros([BLOCK_M, BLOCK_E], tl.float32), PREC, DOT_F32)
                tl.atomic_add(dq_ptr + ((bh * L + rows[:, None]) * E + offs_e[None, :]), dq,
                              mask=row_ok[:, None] & e_ok[None, :], sem="relaxed")
            if HAS_PARAM:
                if NORM == 2 or NORM == 3 or NORM == 4 or NORM == 6:
                    tl.atomic_add(dpar_ptr + bh, tl.sum(dpar, axis=0), sem="relaxed")
        tl.store(dk_ptr + ((bhk * S + cols[:, None]) * E + offs_e[None, :]), cast_like(dk, dk_ptr, FIX_BF16),
                 mask=col_ok[:, None] & e_ok[None, :])
        tl.store(dv_ptr + ((bhk * S + cols[:, None]) * EV + offs_v[None, :]), cast_like(dv, dv_ptr, FIX_BF16),
                 mask=col_ok[:, None] & v_ok[None, :])


def attention_backward(grad_out, q, k, v, out, stats, attn_mask, is_causal, scale, softcap, normalizer, norm_param,
                       dropout_p, seed, *, n_keys: torch.Tensor | None = None,
                       block_m: int | None = None, block_n: int | None = None,
                       num_warps: int | None = None, num_stages: int | None = None):
    """Gradients of :func:`attention_forward` (same arguments; ``out``, ``stats`` from it),
    recomputing the score tiles. ``block_m`` / ``block_n`` override the blocks of both kernels (defaults:
    :data:`~.triton_common.PRE_BLOCKS_16` for the row pre-pass, :data:`~.triton_common.BWD_BLOCKS_16` for
    the key-block kernel, ``*_32`` for fp32).

    Returns:
        ``(dq, dk, dv, dnorm_param)``: ``dq`` like q, ``dk`` / ``dv`` ``(B, Hkv, S, *)`` summed
        over the query heads of each group (dtypes of k / v), ``dnorm_param`` fp32 ``(B, Hq)``
        when ``norm_param`` is given (zeros for normalizers without a parameter), else None.
    """
    B, Hq, Hkv, L, S, E, Ev, mask, kind, scale, softcap, code = check_args(
        q, k, v, attn_mask, is_causal, scale, softcap, normalizer, norm_param, dropout_p, seed)
    for name, t, shape in (("grad_out", grad_out, (B, Hq, L, Ev)), ("out", out, (B, Hq, L, Ev)),
                           ("stats", stats, (B, Hq, L, 2))):
        tensor4(name, t)
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
        if t.device != q.device:
            raise ValueError(f"{name} must be on q's device")
    if stats.dtype != torch.float32 or not stats.is_contiguous():
        raise TypeError("stats must be the contiguous fp32 tensor attention_forward returned")
    cs, opts, a = launch_config(q, k, v, mask, kind, is_causal, scale, softcap, code, norm_param, dropout_p, seed, E, Ev,
                                L, S, block_m, block_n, num_warps, num_stages, n_keys, kernel="backward")
    pre_cs, pre_opts, _ = launch_config(q, k, v, mask, kind, is_causal, scale, softcap, code, norm_param, dropout_p,
                                        seed, E, Ev, L, S, block_m, block_n, num_warps, num_stages, n_keys,
                                        kernel="pre")
    check_runtime(q, "attention")
    dev = q.device
    f32 = dict(dtype=torch.float32, device=dev)
    dq = torch.zeros((B, Hq, L, E), **f32)  # accumulated by atomics
    dpar = torch.zeros((B, Hq), **f32) if norm_param is not None else None
    if B * Hq * L * S == 0:
        return (dq.to(q.dtype), torch.zeros((B, Hkv, S, E), dtype=k.dtype, device=dev),
                torch.zeros((B, Hkv, S, Ev), dtype=v.dtype, device=dev), dpar)
    # every key's dK / dV is written once by the program of its key block (no zero fill to launch)
    dk = torch.empty((B, Hkv, S, E), dtype=k.dtype, device=dev)
    dv = torch.empty((B, Hkv, S, Ev), dtype=v.dtype, device=dev)
    if grad_out.dtype != v.dtype:
        grad_out = grad_out.to(v.dtype)  # tl.dot operands share a dtype
    pre = code in _SOFTMAX_LIKE or code >= 7
    # the pre-pass writes every row's delta; the other normalizers read it as zeros
    delta = (torch.empty if pre else torch.zeros)((B, Hq, L), **f32)
    G = Hq // Hkv
    dpar_t = dpar if dpar is not None else delta
    with on_device(q):
        if pre:
            _bwd_pre_kernel[(B * Hq, cdiv(L, pre_cs["BLOCK_M"]))](
                q, k, v, a["mask_t"], a["par"], out, grad_out, stats, delta, dpar_t,
                *q.stride(), *k.stride(), *v.stride(), *a["mk"], *out.stride(), *grad_out.stride(),
                Hq, G, L, S, E, Ev, scale, a["softcap"], a["seed"], a["dropout_p"], **pre_cs, **pre_opts,
            )
        keys_first = B * Hkv <= MAX_GRID_Y
        grid = (cdiv(S, cs["BLOCK_N"]), B * Hkv) if keys_first else (B * Hkv, cdiv(S, cs["BLOCK_N"]))
        _bwd_kernel[grid](
            q, k, v, a["mask_t"], a["par"], a["n"], grad_out, stats, delta, dq, dk, dv, dpar_t,
            *q.stride(), *k.stride(), *v.stride(), *a["mk"], *grad_out.stride(),
            Hq, Hkv, G, L, S, E, Ev, scale, a["softcap"], a["seed"], a["dropout_p"],
            FIX_BF16=interpreted(), KEYS_FIRST=keys_first, **cs, **opts,
        )
    return dq.to(q.dtype), dk, dv, dpar
