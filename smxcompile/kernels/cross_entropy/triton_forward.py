"""The statistics kernel of the fused linear + cross-entropy (:func:`lce_forward`: logits from a matmul;
:func:`ce_forward`: logits given) and its launcher: see :mod:`smxcompile.kernels.cross_entropy.triton_common`
for the method."""

from __future__ import annotations

import torch

from ..common import FLOAT_DTYPES
from ..triton_helpers import (cdiv, check_runtime, dot_f32, dot_precision, interpreted, launch_opts, on_device,
                              planned_sms, pow2_block, tl, triton)  # triton, tl: None without it
from .triton_common import (CE_BLOCKS, CE_WARPS, check_class_weight, check_linear, check_scalars, check_target,
                            float_tensor, tensor_arg)

__all__ = ["lce_forward", "ce_forward", "chunk_statistics"]

# Default block sizes (BLOCK_N, BLOCK_V, BLOCK_D), num_warps, num_stages: <= 96 KiB of shared memory in every
# variant (compiled for sm_90), so they also fit sm_80 / sm_86 / sm_89; not tuned on a GPU.
_FWD_BLOCKS_16 = (128, 128, 64)
_FWD_BLOCKS_32 = (128, 128, 32)
_FWD_WARPS, _FWD_STAGES = 8, 3


if triton is not None:
    from ..triton_helpers import cast_like, safe_max
    from .triton_common import transform_logits, x_tile

    @triton.jit
    def _fwd_kernel(
        src_ptr, src_s0, src_s1, w_ptr, w_s0, w_s1, bias_ptr,
        tgt_ptr, tgt_s, cw_ptr, cw_s,
        out_ptr, out_s0, out_s1, part_ptr, am_ptr,
        N, V, D, v_per_split, scale, softcap,
        FROM_MATMUL: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_CW: tl.constexpr,
        NEED_WS: tl.constexpr, WRITE_LOGITS: tl.constexpr, NEED_ARGMAX: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, PREC: tl.constexpr,
        DOT_F32: tl.constexpr, FIX_BF16: tl.constexpr,
    ):
        """One program: BLOCK_N rows x the vocabulary slice [pid_s * v_per_split, +v_per_split).

        Writes partial states to ``part`` (fp32, [4 or 5, S, N]): running max ``m``, ``d`` and
        ``d_other`` (relative to ``safe_max(m)``), the target logit if it lies in the slice
        (else 0), and the slice's ``sum_j w_j z_ij``; with NEED_ARGMAX, ``am`` (int64, [S, N]) the column
        of the slice's first maximum (the slice's first column when all are -inf)."""
        pid_n = tl.program_id(0)
        pid_s = tl.program_id(1)
        n_split = tl.num_programs(1)
        rows = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
        row_ok = rows < N
        y = tl.load(tgt_ptr + rows * tgt_s, mask=row_ok, other=-1).to(tl.int64)
        m = tl.full([BLOCK_N], float("-inf"), tl.float32)
        d = tl.zeros([BLOCK_N], tl.float32)
        d_other = tl.zeros([BLOCK_N], tl.float32)
        t = tl.zeros([BLOCK_N], tl.float32)
        ws = tl.zeros([BLOCK_N], tl.float32)
        v_begin = pid_s.to(tl.int64) * v_per_split
        v_end = tl.minimum(v_begin + v_per_split, V)
        am = tl.zeros([BLOCK_N], tl.int64) + v_begin
        for start in range(v_begin, v_end, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V).to(tl.int64)
            col_ok = cols < V
            x = x_tile(src_ptr, src_s0, src_s1, w_ptr, w_s0, w_s1, bias_ptr, rows, cols, row_ok, col_ok, D,
                       FROM_MATMUL, HAS_BIAS, BLOCK_N, BLOCK_V, BLOCK_D, PREC, DOT_F32)
            z = transform_logits(x, scale, softcap, HAS_SOFTCAP)
            if WRITE_LOGITS:
                tl.store(out_ptr + (rows[:, None] * out_s0 + cols[None, :] * out_s1),
                         cast_like(z, out_ptr, FIX_BF16), mask=row_ok[:, None] & col_ok[None, :])
            zm = tl.where(col_ok[None, :], z, float("-inf"))
            z_max = tl.max(zm, axis=1)
            if NEED_ARGMAX:
                # strictly greater: on a tie the earlier column stays (torch.argmax: the first maximum); the
                # masked columns (-inf) come after every real one, so tie_break_left never picks them first
                z_arg = tl.argmax(zm, axis=1, tie_break_left=True).to(tl.int64)
                am = tl.where(z_max > m, start + z_arg, am)
            m_new = tl.maximum(m, z_max)
            ms_new = safe_max(m_new)
            # min(., 0) guards -inf - (-inf) (an all -inf prefix, d == 0) and +inf (d is +inf anyway).
            alpha = tl.exp(tl.minimum(safe_max(m) - ms_new, 0.0))
            e = tl.exp(zm - ms_new[:, None])
            is_t = (cols[None, :] == y[:, None]) & col_ok[None, :]
            d = d * alpha + tl.sum(e, axis=1)
            d_other = d_other * alpha + tl.sum(tl.where(is_t, 0.0, e), axis=1)
            t += tl.sum(tl.where(is_t, z, 0.0), axis=1)
            if NEED_WS:
                if HAS_CW:
                    wv = tl.load(cw_ptr + cols * cw_s, mask=col_ok, other=0.0).to(tl.float32)
                    ws += tl.sum(tl.where(col_ok[None, :], wv[None, :] * z, 0.0), axis=1)
                else:
                    ws += tl.sum(tl.where(col_ok[None, :], z, 0.0), axis=1)
            m = m_new
        plane = n_split.to(tl.int64) * N
        base = part_ptr + pid_s.to(tl.int64) * N + rows
        tl.store(base, m, mask=row_ok)
        tl.store(base + plane, d, mask=row_ok)
        tl.store(base + 2 * plane, d_other, mask=row_ok)
        tl.store(base + 3 * plane, t, mask=row_ok)
        if NEED_WS:
            tl.store(base + 4 * plane, ws, mask=row_ok)
        if NEED_ARGMAX:
            tl.store(am_ptr + pid_s.to(tl.int64) * N + rows, am, mask=row_ok)


if triton is not None:

    @triton.jit
    def _merge_kernel(part_ptr, am_ptr, tgt_ptr, tgt_s, lse_ptr, tlog_ptr, om_ptr, ws_ptr, amx_ptr,
                      N, S, V, ignore_index,
                      NEED_WS: tl.constexpr, NEED_ARGMAX: tl.constexpr, BLOCK: tl.constexpr):
        """Merge the S vocabulary splits' partial states of BLOCK rows (the online-softmax rule) into ``lse``,
        the target logit (0 for ignored rows, NaN for an out-of-range target), the other classes' mass, the
        weighted sum and the first argmax: one launch instead of a dozen small torch ops."""
        rows = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
        ok = rows < N
        plane = (tl.zeros([], tl.int64) + S) * N  # S == 1 arrives as a constexpr int (Triton's specialization)
        big_m = tl.full([BLOCK], float("-inf"), tl.float32)
        for sp in range(0, S):
            off = (tl.zeros([BLOCK], tl.int64) + sp) * N + rows  # int64: S * N may pass 2**31
            m = tl.load(part_ptr + off, mask=ok, other=float("-inf"))
            big_m = tl.maximum(big_m, m, propagate_nan=tl.PropagateNan.ALL)
        ms = safe_max(big_m)
        d = tl.zeros([BLOCK], tl.float32)
        d_other = tl.zeros([BLOCK], tl.float32)
        t = tl.zeros([BLOCK], tl.float32)
        ws = tl.zeros([BLOCK], tl.float32)
        am = tl.zeros([BLOCK], tl.int64)
        if NEED_ARGMAX:
            am = tl.load(am_ptr + rows, mask=ok, other=0)  # split 0's when no split holds the max (NaN)
        found = tl.zeros([BLOCK], tl.int1)
        for sp in range(0, S):
            off = (tl.zeros([BLOCK], tl.int64) + sp) * N + rows
            base = part_ptr + off
            m = tl.load(base, mask=ok, other=float("-inf"))
            f = tl.exp(m - ms)
            d += tl.load(base + plane, mask=ok, other=0.0) * f
            d_other += tl.load(base + 2 * plane, mask=ok, other=0.0) * f
            t += tl.load(base + 3 * plane, mask=ok, other=0.0)
            if NEED_WS:
                ws += tl.load(base + 4 * plane, mask=ok, other=0.0)
            if NEED_ARGMAX:
                hit = (m == big_m) & ~found
                am = tl.where(hit, tl.load(am_ptr + off, mask=ok & hit, other=0), am)
                found = found | hit
        y = tl.load(tgt_ptr + rows * tgt_s, mask=ok, other=0).to(tl.int64)
        ign = y == ignore_index
        bad = (~ign) & ((y < 0) | (y >= V))
        tl.store(lse_ptr + rows, ms + tl.log(tl.where(ok, d, 1.0)), mask=ok)
        tl.store(tlog_ptr + rows, tl.where(ign, 0.0, tl.where(bad, float("nan"), t)), mask=ok)
        tl.store(om_ptr + rows, tl.where(ign, 0.0, d_other / tl.where(ok, d, 1.0)), mask=ok)
        if NEED_WS:
            tl.store(ws_ptr + rows, ws, mask=ok)
        if NEED_ARGMAX:
            tl.store(amx_ptr + rows, am, mask=ok)


#: rows per program of the split merge
_MERGE_BLOCK = 1024


def _splits(n_row_blocks: int, n_v_blocks: int, device: torch.device, num_splits: int | None) -> int:
    """How many programs share a row block's vocabulary (enough programs for the GPU)."""
    if num_splits is not None:
        if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1:
            raise ValueError(f"num_splits must be a positive int, got {num_splits!r}")
        return max(1, min(num_splits, n_v_blocks))
    sms = planned_sms(device)
    if sms is None:
        return 1  # the interpreter runs programs one by one: fewer is faster
    target = 2 * sms
    return max(1, min(n_v_blocks, cdiv(target, max(n_row_blocks, 1))))


def _forward(src, w, bias, target, *, from_matmul, N, V, D, ignore_index, scale, softcap, class_weight,
             need_weighted_sum, logits_out, blocks, num_splits, opts, prec, need_argmax=False):
    """Launch the forward kernel and merge the vocabulary splits (see ``_fwd_kernel``): ``(lse, target_logit,
    other_mass, weighted_sum or None)``, and the (N,) int64 argmax when ``need_argmax``."""
    dev = src.device
    f32 = dict(dtype=torch.float32, device=dev)
    if N == 0 or V == 0:
        lse = torch.full((N,), float("-inf"), **f32)
        ign = target == ignore_index
        tl_ = torch.where(ign, 0.0, float("nan")).to(torch.float32) if N else torch.empty(0, **f32)
        ws = torch.zeros(N, **f32) if need_weighted_sum else None
        stats = (lse, tl_, torch.zeros(N, **f32), ws)
        return stats + (torch.zeros(N, dtype=torch.int64, device=dev),) if need_argmax else stats
    bn, bv, bd = blocks
    nb_n, nb_v = cdiv(N, bn), cdiv(V, bv)
    S = _splits(nb_n, nb_v, dev, num_splits)
    v_per_split = cdiv(nb_v, S) * bv
    S = cdiv(V, v_per_split)  # no empty split
    part = torch.empty((5 if need_weighted_sum else 4, S, N), **f32)
    cw = class_weight if class_weight is not None else part
    out = logits_out if logits_out is not None else part
    out_s = (logits_out.stride(0), logits_out.stride(1)) if logits_out is not None else (0, 0)
    am_p = torch.empty((S, N), dtype=torch.int64, device=dev) if need_argmax else part
    with on_device(src):
        _fwd_kernel[(nb_n, S)](
            src_ptr=src, src_s0=src.stride(0), src_s1=src.stride(1),
            w_ptr=w, w_s0=w.stride(0), w_s1=w.stride(1), bias_ptr=bias if bias is not None else part,
            tgt_ptr=target, tgt_s=target.stride(0), cw_ptr=cw, cw_s=cw.stride(0) if class_weight is not None else 0,
            out_ptr=out, out_s0=out_s[0], out_s1=out_s[1], part_ptr=part, am_ptr=am_p,
            N=N, V=V, D=D, v_per_split=v_per_split, scale=scale, softcap=1.0 if softcap is None else softcap,
            FROM_MATMUL=from_matmul, HAS_BIAS=bias is not None, HAS_SOFTCAP=softcap is not None,
            HAS_CW=class_weight is not None, NEED_WS=bool(need_weighted_sum), WRITE_LOGITS=logits_out is not None,
            NEED_ARGMAX=bool(need_argmax),
            BLOCK_N=bn, BLOCK_V=bv, BLOCK_D=bd, PREC=prec, DOT_F32=dot_f32(w.dtype if from_matmul else None),
            FIX_BF16=interpreted(), **opts,
        )
    # merge the partial online-softmax states: m = max m_s, d = sum_s d_s exp(m_s - m)
    lse, target_logit, other_mass = (torch.empty(N, **f32) for _ in range(3))
    ws = torch.empty(N, **f32) if need_weighted_sum else None
    amx = torch.empty(N, dtype=torch.int64, device=dev) if need_argmax else None
    with on_device(src):
        _merge_kernel[(cdiv(N, _MERGE_BLOCK),)](
            part_ptr=part, am_ptr=am_p, tgt_ptr=target, tgt_s=target.stride(0), lse_ptr=lse, tlog_ptr=target_logit,
            om_ptr=other_mass, ws_ptr=ws if ws is not None else lse, amx_ptr=amx if amx is not None else am_p, N=N,
            S=S, V=V, ignore_index=ignore_index,
            NEED_WS=bool(need_weighted_sum), NEED_ARGMAX=bool(need_argmax), BLOCK=_MERGE_BLOCK, num_warps=4,
        )
    if not need_argmax:
        return lse, target_logit, other_mass, ws
    return lse, target_logit, other_mass, ws, amx


def lce_forward(input, weight, bias, target, *, ignore_index: int, scale: float = 1.0, softcap: float | None = None,
                class_weight=None, need_weighted_sum: bool = False, logits_out=None, return_argmax: bool = False,
                block_n: int | None = None, block_v: int | None = None, block_d: int | None = None,
                num_splits: int | None = None, num_warps: int | None = None, num_stages: int | None = None):
    """Per-row cross-entropy statistics of ``z = transform(input @ weight.T + bias)`` without materializing the
    logits (Cut Cross-Entropy, Wijmans et al., 2024; online softmax, Milakov & Gimelshein, 2018). ``z = scale *
    x``, then ``softcap * tanh(z / softcap)`` if ``softcap`` is given, in fp32 (the matmul accumulates in fp32).

    Args:
        input: ``(N, D)`` fp16 / bf16 / fp32, any strides; CUDA, or CPU under ``TRITON_INTERPRET=1``.
        weight: ``(V, D)``, same dtype and device as ``input``, any strides. bias: ``(V,)`` any float, or None.
        target: ``(N,)`` int64 / int32 class indices; rows with ``ignore_index`` (any sign) are ignored, another
            target outside ``[0, V)`` is never read out of bounds and gives a NaN ``target_logit``.
        scale: multiplies the raw logits first. softcap: ``> 0`` to soft-cap the scaled logits, or None.
        class_weight: ``(V,)`` float weights ``w`` of ``weighted_sum`` (ones if None).
        need_weighted_sum: also return ``sum_j w_j z_ij`` (for label smoothing).
        logits_out: an ``(N, V)`` float tensor (any dtype and strides) to receive ``z``, or None.
        return_argmax: also return each row's first argmax of ``z`` (int64 ``(N,)``, as ``torch.argmax``; 0 when
            ``V == 0``, unspecified for a row with NaN), from the same tiles.
        block_n, block_v, block_d: power-of-two block overrides (>= 16: ``tl.dot``); defaults 128 x 128 x 64
            (fp16 / bf16) or x 32 (fp32), shrunk to small problems.
        num_splits: programs per row block along the vocabulary (default: ~2 per SM on a GPU; 1 in the
            interpreter). num_warps, num_stages: launch overrides (defaults 8 and 3).

    Returns:
        ``(lse, target_logit, other_mass, weighted_sum)``, each fp32 ``(N,)``: ``lse`` for every row (``-inf``
        when ``V == 0``); ``target_logit = z[i, y_i]`` (0 for ignored rows, NaN for an out-of-range target);
        ``other_mass = sum_{j != y_i} softmax(z_i)_j`` (0 for ignored rows, 1 for an out-of-range target);
        ``weighted_sum`` or None unless ``need_weighted_sum``; then the argmax when ``return_argmax``.

    Raises:
        TypeError: non-tensor arguments, input not fp16/bf16/fp32, input/weight dtypes differ,
            non-integer target (int64/int32 only), non-float bias / class_weight / logits_out.
        ValueError: shape mismatches (input (N, D), weight (V, D), bias/class_weight (V,),
            target (N,), logits_out (N, V)), mixed devices, ``softcap <= 0``, bad block sizes.
        RuntimeError: triton missing, or not CUDA and not ``TRITON_INTERPRET=1``.
    """
    N, V, D = check_linear(input, weight, bias)
    check_target(target, N, input.device)
    ignore_index, scale, softcap = check_scalars(ignore_index, scale, softcap)
    check_class_weight(class_weight, V, input.device)
    if logits_out is not None:
        float_tensor("logits_out", logits_out, (N, V), input.device)
    d16 = input.dtype != torch.float32
    dn, dv, dd = _FWD_BLOCKS_16 if d16 else _FWD_BLOCKS_32
    blocks = (pow2_block("block_n", block_n, dn, N, 16), pow2_block("block_v", block_v, dv, V, 16),
              pow2_block("block_d", block_d, dd, D, 16))
    opts = launch_opts(num_warps, num_stages, _FWD_WARPS, _FWD_STAGES)
    check_runtime(input, "linear-cross-entropy")
    return _forward(input, weight, bias, target, from_matmul=True, N=N, V=V, D=D, ignore_index=ignore_index,
                    scale=scale, softcap=softcap, class_weight=class_weight, need_weighted_sum=need_weighted_sum,
                    logits_out=logits_out, blocks=blocks, num_splits=num_splits, opts=opts,
                    prec=dot_precision(input.dtype), need_argmax=return_argmax)


def chunk_statistics(chunk, bias, target, *, ignore_index: int, scale: float, softcap: float | None, class_weight,
                     need_weighted_sum: bool, blocks: tuple, opts: dict):
    """:func:`ce_forward`'s statistics of a chunk of raw logits ``chunk`` (``(n, V)`` fp32, without the bias:
    ``bias`` (V,) or None is added in the kernel), for callers that validated their arguments."""
    N, V = chunk.shape
    return _forward(chunk, chunk, bias, target, from_matmul=False, N=N, V=V, D=0, ignore_index=ignore_index,
                    scale=scale, softcap=softcap, class_weight=class_weight, need_weighted_sum=need_weighted_sum,
                    logits_out=None, blocks=blocks, num_splits=None, opts=opts, prec="ieee")


def ce_forward(logits, target, *, ignore_index: int, scale=1.0, softcap=None, class_weight=None,
               need_weighted_sum=False, block_n: int | None = None, block_v: int | None = None,
               num_splits: int | None = None, num_warps: int | None = None):
    """:func:`lce_forward`'s statistics ``(lse, target_logit, other_mass, weighted_sum or None)`` of the raw
    logits given as an ``(N, V)`` tensor: fp16 / bf16 / fp32 / fp64 (computed in fp32), any 2-D strides
    (transposed, sliced, expanded), never copied. The other arguments are :func:`lce_forward`'s; block_n,
    block_v: power-of-two overrides (defaults 8 x 1024, shrunk to the problem).

    Raises:
        TypeError / ValueError / RuntimeError: as in :func:`lce_forward`.
    """
    tensor_arg("logits", logits, 2)
    if logits.dtype not in FLOAT_DTYPES:
        raise TypeError(f"logits must be floating-point, got {logits.dtype}")
    N, V = logits.shape
    check_target(target, N, logits.device)
    ignore_index, scale, softcap = check_scalars(ignore_index, scale, softcap)
    check_class_weight(class_weight, V, logits.device)
    blocks = (pow2_block("block_n", block_n, CE_BLOCKS[0], N, 1),
              pow2_block("block_v", block_v, CE_BLOCKS[1], V, 1), 1)
    opts = launch_opts(num_warps, None, CE_WARPS, None)
    check_runtime(logits, "linear-cross-entropy")
    return _forward(logits, logits, None, target, from_matmul=False, N=N, V=V, D=0, ignore_index=ignore_index,
                    scale=scale, softcap=softcap, class_weight=class_weight, need_weighted_sum=need_weighted_sum,
                    logits_out=None, blocks=blocks, num_splits=num_splits, opts=opts, prec="ieee")
