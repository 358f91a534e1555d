"""What the flash-style attention kernels share: score-tile helpers, argument checks, launch configuration.

In fp32: ``s = q k^T * scale``, soft-cap, mask, a normalizer fixed at compile time (``NORM``: :data:`NORM_CODES`),
dropout, ``out = w v`` ("FlashAttention", Dao et al., 2022; online softmax, Milakov & Gimelshein, 2018); ``stats``
(B, Hq, L, 2) hold what the backward needs per row. Recurrences, the sparse normalizers' search for tau, the
backward's formulas: docs/DESIGN.md, "Attention kernels (Triton)".
"""

from __future__ import annotations

import torch

from ..triton_helpers import (dot_f32, dot_precision, launch_opts, next_pow2, pow2_block, tl,
                              triton)  # triton, tl: None without it
from .reference import NORMALIZERS

__all__ = ["NORM_CODES", "SPARSE_ITERS", "BLOCKS_16", "BLOCKS_32", "PRE_BLOCKS_16", "PRE_BLOCKS_32", "BWD_BLOCKS_16",
           "BWD_BLOCKS_32", "check_args", "launch_config", "tensor4", "stages"]

#: Normalizer name -> the kernels' NORM constexpr (each entry's ``code`` in :data:`.reference.NORMALIZERS`).
NORM_CODES = {name: entry.code for name, entry in NORMALIZERS.items()}
#: Bracketing passes on tau for sparsemax / entmax15 (each halves the bracket at least).
SPARSE_ITERS = 10

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MASK_NONE, _MASK_BOOL, _MASK_FLOAT = 0, 1, 2


# ---- Triton helpers of the kernels: scores of a tile, normalizer parameters, dropout ----

if triton is not None:
    from ..triton_helpers import dot, tanh

    @triton.jit
    def sigmoid_pair(x):
        """``(sigmoid(x), sigmoid(-x))`` without overflow or cancellation."""
        e = tl.exp(-tl.abs(x))
        r = 1.0 / (1.0 + e)
        pos = x >= 0.0
        return tl.where(pos, r, e * r), tl.where(pos, e * r, r)

    @triton.jit
    def softplus(x):
        """``log(1 + e^x)`` = ``max(x, 0) + log1p(e^{-|x|})`` with an accurate log1p (Goldberg)."""
        e = tl.exp(-tl.abs(x))
        u = 1.0 + e
        l1p = tl.where(u == 1.0, e, tl.log(u) * (e / (u - 1.0)))
        return tl.maximum(x, 0.0) + l1p

    @triton.jit
    def keep_mask(seed, bh, L, S, rows, cols, dropout_p):
        """Dropout keep-mask of a [rows, cols] tile: Philox ``tl.rand(seed, ((bh*L + i)*S + j))
        >= p`` (int64 offsets; forward, backward and :func:`dropout_keep_mask` share it)."""
        off = (bh * L + rows)[:, None] * S + cols[None, :]
        return tl.rand(seed, off) >= dropout_p

    @triton.jit
    def row_coef(rows, row_ok, S, param, n_ptr, n_base, NORM: tl.constexpr, HAS_PARAM: tl.constexpr,
                 IS_CAUSAL: tl.constexpr, HAS_N: tl.constexpr):
        """Per-row ``(coef, log n)``: the normalizer's parameter (ssmax: ``p log n``, sigmoid: ``b``,
        relu / softplus: ``c``, softpick: ``eps``); ``n`` = keys visible by position, or the per-row
        count given in ``n_ptr`` (``HAS_N``: the keys a mask leaves, at least 1)."""
        if HAS_N:
            n = tl.maximum(tl.load(n_ptr + (n_base + rows), mask=row_ok, other=1.0).to(tl.float32), 1.0)
        elif IS_CAUSAL:
            n = tl.minimum(rows + 1, S).to(tl.float32)
        else:
            n = tl.zeros(rows.shape, tl.float32) + S
        lg = tl.log(n)
        if HAS_PARAM:
            par = tl.zeros(rows.shape, tl.float32) + param
        else:
            if NORM == 2:
                par = tl.zeros(rows.shape, tl.float32) + 1.0
            elif NORM == 3:
                par = -lg
            elif NORM == 4:
                par = 1.0 / n
            elif NORM == 5:
                par = tl.zeros(rows.shape, tl.float32) + 1e-6  # softpick's default eps
            else:
                par = tl.log(tl.maximum(n, 2.0))
        if NORM == 2:
            coef = par * lg
        else:
            coef = par
        return coef, lg

    @triton.jit
    def scores(q, kt, rows, row_ok, cols, col_ok, mask_ptr, mk_base, mk_sl, mk_ss, scale, softcap,
               MASK_KIND: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr, DOT_F32: tl.constexpr):
        """Scores of a [BLOCK_M, BLOCK_N] tile (``kt``: [BLOCK_E, BLOCK_N]) in fp32.

        Returns ``(s, sc, vis)``: ``s`` (mask added), ``sc`` (the soft-capped score before the
        mask, for the tanh derivative) and the visibility."""
        s = dot(q, kt, tl.zeros([BLOCK_M, BLOCK_N], tl.float32), PREC, DOT_F32) * scale
        if HAS_SOFTCAP:
            s = softcap * tanh(s / softcap)
        sc = s
        vis = row_ok[:, None] & col_ok[None, :]
        if IS_CAUSAL:
            vis = vis & (cols[None, :] <= rows[:, None])
        if MASK_KIND == 1:
            mv = tl.load(mask_ptr + (mk_base + rows[:, None] * mk_sl + cols[None, :] * mk_ss), mask=vis, other=0)
            vis = vis & (mv != 0)
        elif MASK_KIND == 2:
            mv = tl.load(mask_ptr + (mk_base + rows[:, None] * mk_sl + cols[None, :] * mk_ss), mask=vis,
                         other=0.0).to(tl.float32)
            vis = vis & (mv != float("-inf"))
            s = s + mv
        return s, sc, vis

    @triton.jit
    def scores_at(start, q, k_ptr, k_base, k_ss, k_se, offs_e, e_ok, rows, row_ok, S,
                  mask_ptr, mk_base, mk_sl, mk_ss, scale, softcap,
                  MASK_KIND: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr, DOT_F32: tl.constexpr):
        """Load the K tile at key ``start`` and score it: ``(s, sc, vis, cols, col_ok)``."""
        cols = start + tl.arange(0, BLOCK_N).to(tl.int64)
        col_ok = cols < S
        kt = tl.load(k_ptr + (k_base + cols[None, :] * k_ss + offs_e[:, None] * k_se),
                     mask=e_ok[:, None] & col_ok[None, :], other=0.0)
        s, sc, vis = scores(q, kt, rows, row_ok, cols, col_ok, mask_ptr, mk_base, mk_sl, mk_ss, scale, softcap,
                            MASK_KIND, IS_CAUSAL, HAS_SOFTCAP, BLOCK_M, BLOCK_N, PREC, DOT_F32)
        return s, sc, vis, cols, col_ok

    @triton.jit
    def sparse_sums(t, mxs, hi, q, k_ptr, k_base, k_ss, k_se, offs_e, e_ok, rows, row_ok, S,
                    mask_ptr, mk_base, mk_sl, mk_ss, scale, softcap,
                    NORM: tl.constexpr, MASK_KIND: tl.constexpr, IS_CAUSAL: tl.constexpr,
                    HAS_SOFTCAP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    PREC: tl.constexpr, DOT_F32: tl.constexpr):
        """One pass over the K tiles: over ``A = {y > t}`` (``y = z - max``, ``z = s`` or ``s/2``)
        return ``(|A|, sum_A y, sum_A y^2, sum_A (y - t), sum_A (y - t)^2)``."""
        cnt = tl.zeros([BLOCK_M], tl.float32)
        s1 = tl.zeros([BLOCK_M], tl.float32)
        s2 = tl.zeros([BLOCK_M], tl.float32)
        f1 = tl.zeros([BLOCK_M], tl.float32)
        f2 = tl.zeros([BLOCK_M], tl.float32)
        for start in range(0, hi, BLOCK_N):
            s, sc, vis, cols, col_ok = scores_at(start, q, k_ptr, k_base, k_ss, k_se, offs_e, e_ok, rows, row_ok,
                                                 S, mask_ptr, mk_base, mk_sl, mk_ss, scale, softcap, MASK_KIND,
                                                 IS_CAUSAL, HAS_SOFTCAP, BLOCK_M, BLOCK_N, PREC, DOT_F32)
            if NORM == 8:
                s = s * 0.5
            y = s - mxs[:, None]
            a = vis & (y > t[:, None])
            ya = tl.where(a, y, 0.0)
            r = tl.where(a, y - t[:, None], 0.0)
            cnt += tl.sum(a.to(tl.float32), axis=1)
            s1 += tl.sum(ya, axis=1)
            s2 += tl.sum(ya * ya, axis=1)
            f1 += tl.sum(r, axis=1)
            f2 += tl.sum(r * r, axis=1)
        return cnt, s1, s2, f1, f2

    @triton.jit
    def closed_tau(cnt, s1, s2, NORM: tl.constexpr):
        """tau of the support seen (``(ok, tau)``): sparsemax ``(sum y - 1) / k``; entmax15 the
        smaller root of ``sum (y - tau)^2 = 1``: ``mean - sqrt((1 - ss) / k)``."""
        k = tl.maximum(cnt, 1.0)
        mu = s1 / k
        if NORM == 8:
            ss = s2 - s1 * mu
            delta = (1.0 - ss) / k
            ok = (cnt > 0.0) & (delta >= 0.0)
            tau = mu - tl.sqrt(tl.maximum(delta, 0.0))
        else:
            ok = cnt > 0.0
            tau = (s1 - 1.0) / k
        return ok, tau


# ---- Launch helpers ----

# (BLOCK_M, BLOCK_N) by the padded head dim, per kernel and input width: sized to fit 96 KiB of shared memory
# and, for 16-bit head dims 64 / 128, to spill no registers (docs/PERFORMANCE.md, "Attention kernels: block sizes").
BLOCKS_16 = {64: (128, 32), 128: (128, 32), 256: (32, 32)}
BLOCKS_32 = {64: (32, 32), 128: (32, 32), 256: (16, 16)}
PRE_BLOCKS_16 = {64: (128, 32), 128: (128, 16), 256: (32, 32)}
PRE_BLOCKS_32 = BLOCKS_32
BWD_BLOCKS_16 = {64: (16, 128), 128: (16, 64), 256: (16, 32)}
BWD_BLOCKS_32 = {64: (32, 32), 128: (16, 16), 256: (16, 16)}
_TABLES = {"forward": (BLOCKS_16, BLOCKS_32), "pre": (PRE_BLOCKS_16, PRE_BLOCKS_32),
           "backward": (BWD_BLOCKS_16, BWD_BLOCKS_32)}
STAGES = 2


def stages(block_e: int, fp32: bool) -> int:
    """Software-pipelining depth: 2, or 1 for fp32 with head dims > 128 (shared memory)."""
    return 1 if fp32 and block_e > 128 else STAGES


def _strides4(t: torch.Tensor | None) -> tuple[int, int, int, int]:
    return tuple(t.stride()) if t is not None else (0, 0, 0, 0)


def tensor4(name: str, t) -> torch.Tensor:
    """``t``, checked to be a 4-D tensor (TypeError, ValueError name ``name``)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a Tensor, got {type(t).__name__}")
    if t.dim() != 4:
        raise ValueError(f"{name} must be 4-D, got shape {tuple(t.shape)}")
    return t


def check_args(q, k, v, attn_mask, is_causal, scale, softcap, normalizer, norm_param, dropout_p, seed):
    """Validate the launchers' common arguments (:func:`.triton_forward.attention_forward`); return ``(B, Hq, Hkv,
    L, S, E, Ev, mask, mask_kind, scale, softcap, norm_code)``, a bool mask viewed as uint8. Raises TypeError for
    wrong types or dtypes, ValueError for shapes, devices, values out of range or a ``normalizer`` not in
    :data:`.reference.NORMALIZERS` (the launchers are entry points too: benchmarks and tests call them directly)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        tensor4(name, t)
    if q.dtype not in _DTYPES:
        raise TypeError(f"q must be float16, bfloat16 or float32, got {q.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError("q, k, v must be on one device")
    B, Hq, L, E = q.shape
    Bk, Hkv, S, Ek = k.shape
    if Bk != B or Ek != E or tuple(v.shape[:3]) != (B, Hkv, S):
        raise ValueError(f"shape mismatch: q (B, Hq, L, E) {tuple(q.shape)}, k (B, Hkv, S, E) {tuple(k.shape)}, "
                         f"v (B, Hkv, S, Ev) {tuple(v.shape)}")
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"the query heads ({Hq}) must be a multiple of the kv heads ({Hkv})")
    Ev = v.shape[3]
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float, got {type(scale).__name__}")
    if softcap is not None:
        if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
            raise TypeError(f"softcap must be a float or None, got {type(softcap).__name__}")
        if not (0 < softcap < float("inf")):
            raise ValueError(f"softcap must be a finite float > 0 or None, got {softcap}")
        softcap = float(softcap)
    if normalizer not in NORMALIZERS:
        raise ValueError(f"normalizer must be one of {sorted(NORMALIZERS)}, got {normalizer!r}")
    if norm_param is not None:
        if not isinstance(norm_param, torch.Tensor) or norm_param.dtype != torch.float32:
            raise TypeError("norm_param must be None or an fp32 tensor")
        if tuple(norm_param.shape) != (B, Hq) or not norm_param.is_contiguous():
            raise ValueError(f"norm_param must be a contiguous ({B}, {Hq}) tensor, got {tuple(norm_param.shape)}")
        if norm_param.device != q.device:
            raise ValueError("norm_param must be on q's device")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be a float in [0, 1), got {dropout_p!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise ValueError(f"seed must be an int in [0, 2**63), got {seed!r}")
    mask, kind = None, _MASK_NONE
    if attn_mask is not None:
        tensor4("attn_mask", attn_mask)
        if tuple(attn_mask.shape) != (B, Hq, L, S):
            raise ValueError(f"attn_mask must have shape {(B, Hq, L, S)} (expand it), got {tuple(attn_mask.shape)}")
        if attn_mask.device != q.device:
            raise ValueError("attn_mask must be on q's device")
        if attn_mask.dtype == torch.bool:
            mask, kind = attn_mask.view(torch.uint8), _MASK_BOOL  # same strides, no copy
        elif attn_mask.dtype in (torch.float16, torch.bfloat16, torch.float32):
            mask, kind = attn_mask, _MASK_FLOAT
        else:
            raise TypeError(f"attn_mask must be bool or float16/bfloat16/float32, got {attn_mask.dtype}")
    return B, Hq, Hkv, L, S, E, Ev, mask, kind, float(scale), softcap, NORMALIZERS[normalizer].code


def launch_config(q, k, v, mask, kind, is_causal, scale, softcap, code, norm_param, dropout_p, seed, E, Ev, L, S,
                  block_m, block_n, num_warps, num_stages, n_keys=None, kernel="forward"):
    """``(constexprs, launch options, arguments)`` of one call of the ``kernel`` ("forward", "pre", "backward"), from
    :func:`check_args`' results; blocks from the kernel's table unless overridden. Raises ValueError for a bad
    block size, ``num_warps`` / ``num_stages``, or ``n_keys`` not (B, Hq, L) on q's device."""
    be, bev = max(16, next_pow2(E)), max(16, next_pow2(Ev))
    fp32 = q.dtype == torch.float32
    table = _TABLES[kernel][1 if fp32 else 0]
    dm, dn = table[64 if max(be, bev) <= 64 else 128 if max(be, bev) <= 128 else 256]
    bm, bn = pow2_block("block_m", block_m, dm, L, 16), pow2_block("block_n", block_n, dn, S, 16)
    e_pad = max(be, bev)
    opts = launch_opts(num_warps, num_stages, 4 if fp32 and e_pad <= 64 else 8, stages(e_pad, fp32))
    cs = dict(NORM=code, HAS_PARAM=norm_param is not None, HAS_N=n_keys is not None, MASK_KIND=kind, IS_CAUSAL=is_causal,
              HAS_SOFTCAP=softcap is not None, DROPOUT=dropout_p > 0.0, BLOCK_M=bm, BLOCK_N=bn, BLOCK_E=be,
              BLOCK_EV=bev, PREC=dot_precision(q.dtype), DOT_F32=dot_f32(q.dtype))
    mask_t = mask if mask is not None else q
    if n_keys is not None:
        B, Hq = q.shape[0], q.shape[1]
        if tuple(n_keys.shape) != (B, Hq, L) or n_keys.device != q.device:
            raise ValueError(f"n_keys must be a ({B}, {Hq}, {L}) tensor on q's device, got {tuple(n_keys.shape)}")
        n_keys = n_keys.float().contiguous()
    args = dict(mask_t=mask_t, mk=_strides4(mask), par=norm_param if norm_param is not None else q,
                n=n_keys if n_keys is not None else q,
                softcap=1.0 if softcap is None else softcap, dropout_p=float(dropout_p),
                seed=int(seed))
    return cs, opts, args
