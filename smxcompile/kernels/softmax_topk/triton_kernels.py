"""Triton kernels for fused softmax + top-k along the last dimension, forward and backward, in fp32.

One pass over each row keeps the online ``(max, sum)`` normalizer ("Online normalizer calculation for
softmax", Milakov & Gimelshein, 2018, "softmax + top-k") and a running top-k of unique int64 keys (value bits,
then column) merged by a bitonic network; long rows with few programs are split across programs and merged
by a second kernel. Only the k probabilities are written; the backward recomputes them from ``x``. Special
rows follow torch. Design: docs/DESIGN.md, "Softmax + top-k kernels (Triton)".
"""

from __future__ import annotations

import operator

import torch

from ..triton_helpers import cdiv, check_runtime, next_pow2, on_device, planned_sms, tl, triton  # tl, triton: None w/o it

__all__ = ["softmax_topk_forward", "softmax_topk_backward", "MAX_K"]

#: Largest supported k (the running buffer is a power of two >= k, kept in registers).
MAX_K = 256
#: Largest row length (columns) the keys can encode: the column takes 32 bits of a key.
MAX_COLUMNS = 2**31 - 1
#: Rows up to this many columns (a power of two) are one tile, several rows per program.
_SINGLE_TILE_MAX = 4096
#: Columns per tile for longer rows (one row per program, a loop over tiles).
_LOOP_BLOCK = 2048
#: Target elements per program when several short rows share one program.
_ROWS_TILE_ELEMS = 4096
#: Least columns per split: rows shorter than twice this are never split.
_MIN_SPLIT_COLS = 4096
#: Most splits per row.
_MAX_SPLITS = 1024
#: Keys per step of the merge kernel (a multiple of K_PAD).
_MERGE_ELEMS = 4096
#: Stand-in for the SM count in interpreter mode (decides splitting there).
_INTERPRETER_SMS = 4

_IN_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

_INT64_MIN = -(2**63)


# ---- Triton kernels ----

if triton is not None:
    from ..triton_helpers import safe_max
    from .triton_select import decode_keys, encode_keys, merge_keys, topk_keys

    @triton.jit
    def _finish(buf, m, d, rows, row_ok, k, vals_ptr, idx_ptr, logd_ptr,
                K_PAD: tl.constexpr, RENORM: tl.constexpr):
        """Decode the sorted buffer [ROWS, K_PAD] and write values [R, k], indices [R, k], logd [R]."""
        z, col = decode_keys(buf)
        ztop, _ = decode_keys(tl.max(buf, axis=1))  # NaN / +inf / -inf exactly for the special rows
        special = ~(tl.abs(ztop) < float("inf"))
        j = tl.arange(0, K_PAD).to(tl.int64)
        sel = row_ok[:, None] & (j < k)[None, :]
        if RENORM:
            zt = tl.where(special, 0.0, ztop)
            e = tl.where(sel, tl.exp(z - zt[:, None]), 0.0)
            v = e / tl.sum(e, axis=1)[:, None]
        else:
            ms = tl.where(special, 0.0, m)
            v = tl.exp(z - ms[:, None]) / d[:, None]
        # relative to the row max, so the backward's exp((z - max) - logd) keeps fp32 accuracy; NaN: special rows
        logd = tl.where(special, float("nan"), tl.log(d))
        v = tl.where(special[:, None], float("nan"), v)
        out = rows[:, None] * k + j[None, :]
        tl.store(vals_ptr + out, v.to(vals_ptr.dtype.element_ty), mask=sel)
        tl.store(idx_ptr + out, col, mask=sel)
        tl.store(logd_ptr + rows, logd, mask=row_ok)

    @triton.jit
    def _tile(x_ptr, x_off, cols, row_ok, n, scale):
        """z (-inf on padding lanes) and keys (INT64_MIN on padding lanes) of one tile."""
        ok = row_ok[:, None] & (cols < n)[None, :]
        z = tl.load(x_ptr + (x_off[:, None] + cols[None, :]), mask=ok, other=0.0).to(tl.float32) * scale
        keys = tl.where(ok, encode_keys(z, cols[None, :]), -9223372036854775808)
        z = tl.where(ok, z, float("-inf"))
        return z, keys

    @triton.jit
    def _softmax_topk_fwd_kernel(
        x_ptr, x_rs, vals_ptr, idx_ptr, logd_ptr, wsk_ptr, wsm_ptr, wsd_ptr,
        R, n, k, chunk, splits, scale,
        K_PAD: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
        SINGLE_TILE: tl.constexpr, FINAL: tl.constexpr, RENORM: tl.constexpr,
    ):
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)
        split = tl.program_id(1).to(tl.int64)
        row_ok = rows < R
        x_off = rows * x_rs
        c0 = split * chunk
        c1 = tl.minimum(c0 + chunk, n)
        # the first tile (every chunk has one) starts the buffer and the normalizer
        cols = c0 + tl.arange(0, BLOCK).to(tl.int64)
        z, keys = _tile(x_ptr, x_off, cols, row_ok, c1, scale)
        buf = topk_keys(keys, K_PAD, 1)
        m = tl.max(z, axis=1)
        d = tl.sum(tl.exp(z - safe_max(m)[:, None]), axis=1)
        if not SINGLE_TILE:
            for start in range(c0 + BLOCK, c1, BLOCK):
                cols = start + tl.arange(0, BLOCK).to(tl.int64)
                z, keys = _tile(x_ptr, x_off, cols, row_ok, c1, scale)
                # min(., 0) guards an all -inf prefix (d == 0) and a finite prefix before +inf
                m_new = tl.maximum(m, tl.max(z, axis=1))
                ms_new = safe_max(m_new)
                alpha = tl.exp(tl.minimum(safe_max(m) - ms_new, 0.0))
                d = d * alpha + tl.sum(tl.exp(z - ms_new[:, None]), axis=1)
                m = m_new
                # skip the network when no key of the tile can enter the buffer
                enter = tl.max(keys, axis=1) > tl.min(buf, axis=1)
                if tl.max(enter.to(tl.int32), axis=0) > 0:
                    buf = merge_keys(buf, topk_keys(keys, K_PAD, 0), K_PAD)
        if FINAL:
            _finish(buf, m, d, rows, row_ok, k, vals_ptr, idx_ptr, logd_ptr, K_PAD, RENORM)
        else:
            ws = rows * splits + split
            j = tl.arange(0, K_PAD).to(tl.int64)
            tl.store(wsk_ptr + (ws[:, None] * K_PAD + j[None, :]), buf, mask=row_ok[:, None])
            tl.store(wsm_ptr + ws, m, mask=row_ok)
            tl.store(wsd_ptr + ws, d, mask=row_ok)

    @triton.jit
    def _softmax_topk_merge_kernel(
        wsk_ptr, wsm_ptr, wsd_ptr, vals_ptr, idx_ptr, logd_ptr, R, splits, k,
        K_PAD: tl.constexpr, G: tl.constexpr, RENORM: tl.constexpr,
    ):
        """Merge the SPLITS partials of one row: G splits (G * K_PAD keys) per step."""
        rows = tl.program_id(0).to(tl.int64) + tl.arange(0, 1).to(tl.int64)
        row_ok = rows < R
        e = tl.arange(0, G * K_PAD).to(tl.int64)
        s = tl.arange(0, G).to(tl.int64)
        buf = tl.full([1, K_PAD], -9223372036854775808, tl.int64)
        m = tl.full([1], float("-inf"), tl.float32)
        d = tl.zeros([1], tl.float32)
        for s0 in range(0, splits, G):
            ok = row_ok[:, None] & ((s0 + e // K_PAD) < splits)[None, :]
            keys = tl.load(wsk_ptr + (rows[:, None] * (splits * K_PAD) + s0 * K_PAD + e[None, :]),
                           mask=ok, other=-9223372036854775808)
            buf = merge_keys(buf, topk_keys(keys, K_PAD, 0), K_PAD)
            sok = row_ok[:, None] & ((s0 + s) < splits)[None, :]
            sm = tl.load(wsm_ptr + (rows[:, None] * splits + s0 + s[None, :]), mask=sok, other=float("-inf"))
            sd = tl.load(wsd_ptr + (rows[:, None] * splits + s0 + s[None, :]), mask=sok, other=0.0)
            m_new = tl.maximum(m, tl.max(sm, axis=1))
            ms_new = safe_max(m_new)
            alpha = tl.exp(tl.minimum(safe_max(m) - ms_new, 0.0))
            beta = tl.exp(tl.minimum(safe_max(sm) - ms_new[:, None], 0.0))
            d = d * alpha + tl.sum(sd * beta, axis=1)
            m = m_new
        _finish(buf, m, d, rows, row_ok, k, vals_ptr, idx_ptr, logd_ptr, K_PAD, RENORM)

    @triton.jit
    def _bwd_selected(x_ptr, x_rs, g_ptr, g_rs, g_cs, i_ptr, i_rs, i_cs, logd_ptr, logd_s,
                      rows, row_ok, k, scale, K_PAD: tl.constexpr, RENORM: tl.constexpr):
        """(g, idx, v, gv, z0) of the k selected entries of ROWS rows ([ROWS, K_PAD]; 0 on padding): ``v``
        recomputed from x, ``exp((z - z0) - logd)`` or ``softmax(z[idx])`` with ``RENORM``, ``z0 = z[idx[:, 0]]``
        the row max; ``gv = sum_i g_i v_i``."""
        j = tl.arange(0, K_PAD).to(tl.int64)
        sel = row_ok[:, None] & (j < k)[None, :]
        g = tl.load(g_ptr + (rows[:, None] * g_rs + j[None, :] * g_cs), mask=sel, other=0.0).to(tl.float32)
        idx = tl.load(i_ptr + (rows[:, None] * i_rs + j[None, :] * i_cs), mask=sel, other=0).to(tl.int64)
        zs = tl.load(x_ptr + (rows[:, None] * x_rs + idx), mask=sel, other=0.0).to(tl.float32) * scale
        # the first index's z; other lanes add exact zeros (NaN / inf stay)
        z0 = tl.sum(tl.where((j == 0)[None, :], zs, 0.0), axis=1)
        if RENORM:
            e = tl.where(sel, tl.exp(zs - z0[:, None]), 0.0)
            v = e / tl.where(row_ok, tl.sum(e, axis=1), 1.0)[:, None]
        else:
            logd = tl.load(logd_ptr + rows * logd_s, mask=row_ok, other=0.0).to(tl.float32)
            v = tl.where(sel, tl.exp((zs - z0[:, None]) - logd[:, None]), 0.0)
        gv = tl.sum(g * v, axis=1)
        return g, idx, v, gv, z0

    @triton.jit
    def _softmax_topk_bwd_dense_kernel(
        x_ptr, x_rs, g_ptr, g_rs, g_cs, i_ptr, i_rs, i_cs, logd_ptr, logd_s, dx_ptr,
        R, n, k, n_col_blocks, scale,
        K_PAD: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
    ):
        """dx = -scale * p * sum_i g_i v_i, p = exp((z - z0) - logd), over a ROWS x BLOCK tile (1-D grid)."""
        pid = tl.program_id(0).to(tl.int64)
        rows = (pid // n_col_blocks) * ROWS + tl.arange(0, ROWS).to(tl.int64)
        cols = (pid % n_col_blocks) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
        row_ok = rows < R
        _, _, _, gv, z0 = _bwd_selected(x_ptr, x_rs, g_ptr, g_rs, g_cs, i_ptr, i_rs, i_cs, logd_ptr, logd_s,
                                        rows, row_ok, k, scale, K_PAD, False)
        logd = tl.load(logd_ptr + rows * logd_s, mask=row_ok, other=0.0).to(tl.float32)
        ok = row_ok[:, None] & (cols < n)[None, :]
        z = tl.load(x_ptr + (rows[:, None] * x_rs + cols[None, :]), mask=ok, other=0.0).to(tl.float32) * scale
        p = tl.exp((z - z0[:, None]) - logd[:, None])
        dx = (-scale) * (p * gv[:, None])
        tl.store(dx_ptr + (rows[:, None] * n + cols[None, :]), dx.to(dx_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _softmax_topk_bwd_sparse_kernel(
        x_ptr, x_rs, g_ptr, g_rs, g_cs, i_ptr, i_rs, i_cs, logd_ptr, logd_s, dx_ptr,
        R, n, k, scale,
        K_PAD: tl.constexpr, ROWS: tl.constexpr, RENORM: tl.constexpr,
    ):
        """The k selected entries of dx, ``scale * v_i * (g_i - gv)``, written once."""
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)
        row_ok = rows < R
        j = tl.arange(0, K_PAD).to(tl.int64)
        sel = row_ok[:, None] & (j < k)[None, :]
        g, idx, v, gv, _ = _bwd_selected(x_ptr, x_rs, g_ptr, g_rs, g_cs, i_ptr, i_rs, i_cs, logd_ptr, logd_s,
                                         rows, row_ok, k, scale, K_PAD, RENORM)
        dx = scale * (v * (g - gv[:, None]))
        tl.store(dx_ptr + (rows[:, None] * n + idx), dx.to(dx_ptr.dtype.element_ty), mask=sel)


# ---- Launch helpers ----


def _sm_count(device: torch.device) -> int:
    """SMs of a CUDA device (or the GPU the interpreter plans for); else :data:`_INTERPRETER_SMS` (it decides
    splitting there)."""
    sms = planned_sms(device)
    return _INTERPRETER_SMS if sms is None else sms


def _num_warps(elems: int) -> int:
    return 8 if elems >= 4096 else 4 if elems >= 1024 else 2 if elems >= 256 else 1


def _plan(R: int, n: int, k_pad: int, device: torch.device) -> dict:
    """The forward's launch for R rows of n columns and k_pad keys: ``ROWS`` (per program), ``BLOCK`` (columns
    per tile), ``SINGLE_TILE``, ``splits``, ``chunk`` (columns per split, a multiple of BLOCK), ``num_warps``."""
    full = next_pow2(n)
    if full <= _SINGLE_TILE_MAX:
        block = max(full, k_pad)
        rows = max(1, min(_ROWS_TILE_ELEMS // block, next_pow2(R)))
        if device.type == "cuda" or planned_sms(device) is not None:  # a GPU: ~2 programs per SM
            per = max(1, R // (2 * _sm_count(device)))
            rows = min(rows, 1 << (per.bit_length() - 1))
        return dict(ROWS=rows, BLOCK=block, SINGLE_TILE=True, splits=1, chunk=block,
                    num_warps=_num_warps(rows * block))
    block = max(_LOOP_BLOCK, k_pad)
    target = 2 * _sm_count(device)
    splits = 1
    if R < target and n >= 2 * _MIN_SPLIT_COLS:
        splits = max(1, min(cdiv(n, _MIN_SPLIT_COLS), cdiv(target, R), _MAX_SPLITS))
    chunk = cdiv(cdiv(n, splits), block) * block
    splits = cdiv(n, chunk)
    return dict(ROWS=1, BLOCK=block, SINGLE_TILE=chunk == block, splits=splits, chunk=chunk,
                num_warps=_num_warps(block))


def _check_x(x: torch.Tensor, name: str = "x") -> tuple[int, int]:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a Tensor, got {type(x).__name__}")
    if x.dtype not in _IN_DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16 or float32, got {x.dtype}")
    if x.dim() != 2:
        raise ValueError(f"{name} must be 2-D (R, n), got shape {tuple(x.shape)}")
    R, n = x.shape
    if n > 1 and R > 0 and x.stride(1) != 1:
        raise ValueError(f"{name} must have stride 1 along its last dim (got strides {tuple(x.stride())}); "
                         "make it so with .contiguous()")
    if n > MAX_COLUMNS:
        raise ValueError(f"rows of {n} columns are too long: at most {MAX_COLUMNS} (2**31 - 1) are supported")
    return R, n


def _check_scale(scale: float) -> float:
    scale = float(scale)
    if not (scale > 0.0 and scale < float("inf")):
        raise ValueError(f"scale must be finite and > 0, got {scale}")
    return scale


def _check_out_dtype(out_dtype: torch.dtype | None, default: torch.dtype) -> torch.dtype:
    out_dtype = default if out_dtype is None else out_dtype
    if out_dtype not in _OUT_DTYPES:
        raise TypeError(f"out_dtype must be a floating-point dtype, got {out_dtype}")
    return out_dtype


# ---- Public launchers ----


def softmax_topk_forward(
    x: torch.Tensor,
    k: int,
    *,
    scale: float = 1.0,
    renormalize: bool = False,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused ``topk(softmax(x * scale), k)`` along the last dim, with Triton (fp32 math; "Online normalizer
    calculation for softmax", Milakov & Gimelshein, 2018, softmax + top-k).

    Values sorted descending: ``softmax(z)[indices]``, or with ``renormalize`` ``softmax(z[indices])`` over the
    k selected. Indices: the k largest ``z``, exact ties lowest index first, NaN above everything, ``-inf``
    below every finite value. A row with NaN or ``+inf``, or all ``-inf``, gives NaN values with valid distinct
    indices and a NaN ``logd``.

    Args:
        x: (R, n) fp16 / bf16 / fp32 scores, stride 1 along the last dim. CUDA, or CPU under
            ``TRITON_INTERPRET=1``.
        k: ``0 <= k <= min(n, MAX_K)``. scale: multiplies ``x`` first; finite and > 0.
        renormalize: normalize the ``k`` values to sum to 1. out_dtype: of ``values`` (default ``x.dtype``).

    Returns:
        ``(values, indices, logd)``, new contiguous tensors: values (R, k) ``out_dtype``, indices (R, k) int64,
        logd (R,) fp32 ``= log(sum(exp(z - m)))``, ``m = z[indices[:, 0]]`` the row max. ``k == 0``, ``R == 0``
        or ``n == 0`` give empty values / indices and zeros for ``logd``, without a launch.

    Raises:
        RuntimeError: triton missing, or ``x`` neither on CUDA nor under ``TRITON_INTERPRET=1``.
        TypeError: ``x`` not a fp16/bf16/fp32 tensor; a non-floating ``out_dtype``; k not an int.
        ValueError: a bad ``x`` layout or length; ``k`` outside ``[0, min(n, MAX_K)]``; a bad ``scale``.
    """
    R, n = _check_x(x)
    if isinstance(k, bool):
        raise TypeError("k must be an int, got bool")
    try:
        k = operator.index(k)
    except TypeError:
        raise TypeError(f"k must be an int, got {type(k).__name__}") from None
    if k < 0 or k > n:
        raise ValueError(f"k must be in [0, n] = [0, {n}], got {k}")
    if k > MAX_K:
        raise ValueError(f"k = {k} is above the limit of the Triton softmax top-k kernels (MAX_K = {MAX_K})")
    scale = _check_scale(scale)
    out_dtype = _check_out_dtype(out_dtype, x.dtype)
    check_runtime(x, "softmax top-k")

    values = torch.empty((R, k), dtype=out_dtype, device=x.device)
    indices = torch.empty((R, k), dtype=torch.int64, device=x.device)
    if R == 0 or k == 0:
        return values, indices, torch.zeros((R,), dtype=torch.float32, device=x.device)
    logd = torch.empty((R,), dtype=torch.float32, device=x.device)

    k_pad = next_pow2(k)
    plan = _plan(R, n, k_pad, x.device)
    splits, rows_n = plan["splits"], plan["ROWS"]
    final = splits == 1
    if final:
        wsk, wsm, wsd = indices, logd, logd  # unused
    else:
        wsk = torch.empty((R, splits, k_pad), dtype=torch.int64, device=x.device)
        wsm = torch.empty((R, splits), dtype=torch.float32, device=x.device)
        wsd = torch.empty((R, splits), dtype=torch.float32, device=x.device)
    grid = (cdiv(R, rows_n), splits)
    with on_device(x):
        _softmax_topk_fwd_kernel[grid](
            x, x.stride(0), values, indices, logd, wsk, wsm, wsd,
            R, n, k, plan["chunk"], splits, scale,
            K_PAD=k_pad, ROWS=rows_n, BLOCK=plan["BLOCK"], SINGLE_TILE=plan["SINGLE_TILE"],
            FINAL=final, RENORM=bool(renormalize), num_warps=plan["num_warps"],
        )
        if not final:
            g = max(1, min(next_pow2(splits), _MERGE_ELEMS // k_pad))
            _softmax_topk_merge_kernel[(R,)](
                wsk, wsm, wsd, values, indices, logd, R, splits, k,
                K_PAD=k_pad, G=g, RENORM=bool(renormalize), num_warps=_num_warps(g * k_pad),
            )
    return values, indices, logd


def softmax_topk_backward(
    grad_values: torch.Tensor,
    values: torch.Tensor,
    indices: torch.Tensor,
    x: torch.Tensor,
    logd: torch.Tensor,
    *,
    scale: float = 1.0,
    renormalize: bool = False,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Gradient w.r.t. ``x`` of :func:`softmax_topk_forward`'s values, with Triton, recomputed in fp32 from ``x``.

    With ``z = x.float() * scale``, ``z0 = z[indices[:, 0]]``, ``v_i = exp((z[idx_i] - z0) - logd)`` (with
    ``renormalize``: ``softmax(z[indices])``) and ``gv = sum_i g_i v_i``: ``dx = scale * (scatter(g * v at
    indices) - p * gv)``, ``p = exp((z - z0) - logd)``; with ``renormalize`` ``dx[idx_i] = scale * v_i * (g_i -
    gv)``, zero elsewhere. ``values`` gives only the shape (it may be rounded to a narrower dtype).

    Args:
        grad_values: (R, k), any float dtype and strides. values: (R, k) the forward's values.
        indices: (R, k) int64 (or int32), the forward's: distinct per row, the first at the row max.
        x: (R, n) the forward's input, fp16 / bf16 / fp32, stride 1 along the last dim.
        logd: (R,) the forward's logd (any float dtype and stride); unused, and may be empty, with
            ``renormalize``.
        scale, renormalize: as in the forward. out_dtype: of the result (default ``x.dtype``).

    Returns:
        ``dx``: a new contiguous (R, n) tensor in ``out_dtype`` (zeros when ``k == 0``).

    Raises:
        RuntimeError: as the forward. TypeError: wrong dtypes. ValueError: mismatched shapes or devices, a bad
        ``x`` layout, ``k > MAX_K``, a bad ``scale``.
    """
    R, n = _check_x(x)
    for name, t in (("grad_values", grad_values), ("values", values), ("indices", indices), ("logd", logd)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a Tensor, got {type(t).__name__}")
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}")
    for name, t in (("grad_values", grad_values), ("values", values), ("logd", logd)):
        if not t.is_floating_point():
            raise TypeError(f"{name} must be floating-point, got {t.dtype}")
    if indices.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"indices must be int64 or int32, got {indices.dtype}")
    if values.dim() != 2 or values.shape[0] != R:
        raise ValueError(f"values must be (R, k) with R = {R}, got {tuple(values.shape)}")
    k = values.shape[1]
    for name, t in (("grad_values", grad_values), ("indices", indices)):
        if t.shape != values.shape:
            raise ValueError(f"{name} {tuple(t.shape)} and values {tuple(values.shape)} differ in shape")
    if logd.shape != (R,) and not (renormalize and logd.numel() == 0):
        raise ValueError(f"logd must be ({R},) (or empty, with renormalize), got {tuple(logd.shape)}")
    if k > n or k > MAX_K:
        raise ValueError(f"k = {k} must be <= n = {n} and <= MAX_K = {MAX_K}")
    scale = _check_scale(scale)
    out_dtype = _check_out_dtype(out_dtype, x.dtype)
    check_runtime(x, "softmax top-k")

    if renormalize or k == 0 or R == 0:
        dx = torch.zeros((R, n), dtype=out_dtype, device=x.device)
        if k == 0 or R == 0:
            return dx
    else:
        dx = torch.empty((R, n), dtype=out_dtype, device=x.device)
    k_pad = next_pow2(k)
    if renormalize:  # logd is never loaded (and may be empty): a placeholder without a fill launch
        logd = torch.empty((1,), dtype=torch.float32, device=x.device).expand(R)
    sel_args = (grad_values, *grad_values.stride(), indices, *indices.stride(), logd, logd.stride(0), dx)
    with on_device(x):
        if not renormalize:
            block = min(next_pow2(n), _SINGLE_TILE_MAX)
            rows_n = max(1, min(_ROWS_TILE_ELEMS // block, next_pow2(R)))
            ncb = cdiv(n, block)
            _softmax_topk_bwd_dense_kernel[(cdiv(R, rows_n) * ncb,)](
                x, x.stride(0), *sel_args, R, n, k, ncb, scale,
                K_PAD=k_pad, ROWS=rows_n, BLOCK=block, num_warps=_num_warps(rows_n * block),
            )
        rows_n = max(1, min(_ROWS_TILE_ELEMS // k_pad, next_pow2(R)))
        _softmax_topk_bwd_sparse_kernel[(cdiv(R, rows_n),)](
            x, x.stride(0), *sel_args, R, n, k, scale,
            K_PAD=k_pad, ROWS=rows_n, RENORM=bool(renormalize), num_warps=_num_warps(rows_n * k_pad),
        )
    return dx
