"""Triton kernel for softmax quantized in its epilogue (``smx::quant_softmax``), forward only, in fp32.

A row that fits one block is loaded once; a longer one takes the online (max, sum) recurrence ("Online
normalizer calculation for softmax", Milakov & Gimelshein, 2018) and a second sweep that writes the one-byte
codes. Rounding is half to even, exact in the interpreter too; no fma contraction (``enable_fp_fusion=False``),
so products round as ATen's. Any dim and strides, without a copy. Design: docs/DESIGN.md, "Quantized softmax
kernel (Triton)".
"""

from __future__ import annotations

import math

import torch

from ..triton_helpers import check_runtime, on_device, row_layout, row_plan, tl, triton  # triton, tl: None without it
from .decomposed import FP32_MAX, QUANT_RANGES

__all__ = ["quant_softmax_forward", "MAX_FUSED_BLOCK", "LOOP_BLOCK"]

#: Largest row (in elements, a power of two) reduced in registers in one pass.
MAX_FUSED_BLOCK = 8192
#: Columns per tile of the two-sweep path (rows longer than MAX_FUSED_BLOCK).
LOOP_BLOCK = 4096
_IN_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: prob_dtype -> the kernel's PROB constexpr (0: no rounding: fp32 probabilities, or fp64 which holds them exactly).
_PROB_CODES = {None: 0, torch.float32: 0, torch.float64: 0, torch.float16: 1, torch.bfloat16: 2}


# ---- Triton kernel ----

if triton is not None:
    from ..triton_helpers import row_offset, safe_max

    @triton.jit
    def _load_z(x_ptr, x_off, x_cs, cols, ok, logit_scale, HAS_SCALE: tl.constexpr):
        """fp32 logits of a [ROWS, BLOCK] tile; out-of-range lanes are -inf."""
        z = tl.load(x_ptr + (x_off[:, None] + cols[None, :] * x_cs), mask=ok, other=0.0).to(tl.float32)
        if HAS_SCALE:
            z = z * logit_scale
        return tl.where(ok, z, float("-inf"))

    @triton.jit
    def _round_bf16(y):
        """fp32 ``y`` rounded to the nearest bf16 (ties to even) by bit arithmetic, as the interpreter's cast
        truncates; NaN and +-inf stay."""
        b = y.to(tl.uint32, bitcast=True)
        b = (b + (0x7FFF + ((b >> 16) & 1))) & 0xFFFF0000
        return tl.where(y != y, y, b.to(tl.float32, bitcast=True))

    @triton.jit
    def _quantize(y, inv_scale, zero_point, quant_min, quant_max, PROB: tl.constexpr):
        """Codes (fp32, integral) of the fp32 probabilities ``y``: rounded through ``PROB``, half to even."""
        if PROB == 1:
            y = y.to(tl.float16).to(tl.float32)
        elif PROB == 2:
            y = _round_bf16(y)
        t = y * inv_scale
        # round half to even (no libdevice in the interpreter): exact, NaN h for t = +-inf (r = f = t)
        f = tl.floor(t)
        h = t - f
        odd = (f - 2.0 * tl.floor(f * 0.5)) == 1.0
        r = tl.where((h > 0.5) | ((h == 0.5) & odd), f + 1.0, f)
        q = tl.minimum(tl.maximum(r + zero_point, quant_min), quant_max)
        return tl.where(t != t, zero_point, q)

    @triton.jit
    def _store_q(q_ptr, q_off, q_cs, cols, ok, y, inv_scale, zero_point, quant_min, quant_max,
                 PROB: tl.constexpr):
        q = _quantize(y, inv_scale, zero_point, quant_min, quant_max, PROB)
        tl.store(q_ptr + (q_off[:, None] + cols[None, :] * q_cs), q.to(tl.int32).to(q_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _quant_softmax_kernel(
        x_ptr, x_rows, x_s0, x_n1, x_s1, x_cs,
        q_ptr, q_rows, q_s0, q_n1, q_s1, q_cs,
        R, C, logit_scale, inv_scale, zero_point, quant_min, quant_max,
        X_MODE: tl.constexpr, Q_MODE: tl.constexpr, HAS_SCALE: tl.constexpr, PROB: tl.constexpr,
        ROWS: tl.constexpr, BLOCK: tl.constexpr, SINGLE: tl.constexpr,
    ):
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)
        row_ok = rows < R
        x_off = row_offset(rows, row_ok, x_rows, x_s0, x_n1, x_s1, X_MODE)
        q_off = row_offset(rows, row_ok, q_rows, q_s0, q_n1, q_s1, Q_MODE)
        if SINGLE:
            cols = tl.arange(0, BLOCK).to(tl.int64)
            ok = row_ok[:, None] & (cols < C)[None, :]
            z = _load_z(x_ptr, x_off, x_cs, cols, ok, logit_scale, HAS_SCALE)
            m = tl.max(z, axis=1)
            e = tl.exp(z - safe_max(m)[:, None])
            d = tl.sum(e, axis=1)
            finite = tl.abs(m) < float("inf")  # False for +-inf and NaN: the row's probabilities are NaN
            y = tl.where(finite[:, None], e / d[:, None], float("nan"))
            _store_q(q_ptr, q_off, q_cs, cols, ok, y, inv_scale, zero_point, quant_min, quant_max, PROB)
        else:
            # sweep 1: the online (max, sum) recurrence
            m = tl.full([ROWS], float("-inf"), tl.float32)
            d = tl.zeros([ROWS], tl.float32)
            for start in range(0, C, BLOCK):
                cols = start + tl.arange(0, BLOCK).to(tl.int64)
                ok = row_ok[:, None] & (cols < C)[None, :]
                z = _load_z(x_ptr, x_off, x_cs, cols, ok, logit_scale, HAS_SCALE)
                m_new = tl.maximum(m, tl.max(z, axis=1))
                ms_new = safe_max(m_new)
                # min(., 0) guards -inf - (-inf) (an all -inf prefix) and a finite prefix before a +inf
                alpha = tl.exp(tl.minimum(safe_max(m) - ms_new, 0.0))
                d = d * alpha + tl.sum(tl.exp(z - ms_new[:, None]), axis=1)
                m = m_new
            ms = safe_max(m)
            finite = tl.abs(m) < float("inf")
            # sweep 2: probabilities, quantized in the epilogue
            for start in range(0, C, BLOCK):
                cols = start + tl.arange(0, BLOCK).to(tl.int64)
                ok = row_ok[:, None] & (cols < C)[None, :]
                z = _load_z(x_ptr, x_off, x_cs, cols, ok, logit_scale, HAS_SCALE)
                y = tl.where(finite[:, None], tl.exp(z - ms[:, None]) / d[:, None], float("nan"))
                _store_q(q_ptr, q_off, q_cs, cols, ok, y, inv_scale, zero_point, quant_min, quant_max, PROB)


# ---- Launch helpers ----


def _fp32(v: float) -> float:
    """``v`` rounded to fp32, as ATen rounds a Python scalar operand of an fp32 op."""
    return float(torch.tensor(v, dtype=torch.float32))


def _check_args(x, dim, logit_scale, scale, zero_point, quant_min, quant_max, dtype, prob_dtype):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a Tensor, got {type(x).__name__}")
    if x.dtype not in _IN_DTYPES:
        raise TypeError(f"x must be float16, bfloat16 or float32, got {x.dtype} (fp64 takes the torch path)")
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"dim must be an int, got {dim!r}")
    nd = max(x.dim(), 1)
    if not -nd <= dim < nd:
        raise IndexError(f"Dimension out of range (expected to be in range of [{-nd}, {nd - 1}], but got {dim})")
    if dtype not in QUANT_RANGES:
        raise TypeError(f"dtype must be torch.uint8 or torch.int8, got {dtype}")
    if prob_dtype not in _PROB_CODES:
        raise TypeError(f"prob_dtype must be a floating-point dtype or None, got {prob_dtype}")
    lo, hi = QUANT_RANGES[dtype]
    quant_min = lo if quant_min is None else quant_min
    quant_max = hi if quant_max is None else quant_max
    for name, v in (("zero_point", zero_point), ("quant_min", quant_min), ("quant_max", quant_max)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name} must be an int, got {v!r}")
    if not lo <= quant_min < quant_max <= hi:
        raise ValueError(f"quant range [{quant_min}, {quant_max}] must lie inside {dtype}'s [{lo}, {hi}], "
                         "quant_min < quant_max")
    if not quant_min <= zero_point <= quant_max:
        raise ValueError(f"zero_point {zero_point} outside [{quant_min}, {quant_max}]")
    scale, logit_scale = float(scale), float(logit_scale)
    if not (math.isfinite(scale) and scale > 0 and 1.0 / scale <= FP32_MAX):
        raise ValueError(f"scale must be finite, > 0 and 1 / scale finite in fp32, got {scale}")
    if not (logit_scale > 0 and logit_scale <= FP32_MAX):
        raise ValueError(f"logit_scale must be > 0 and finite in fp32, got {logit_scale}")
    return dim % nd, logit_scale, scale, quant_min, quant_max


# ---- Public launcher ----


def quant_softmax_forward(
    x: torch.Tensor,
    dim: int = -1,
    *,
    scale: float,
    zero_point: int = 0,
    quant_min: int | None = None,
    quant_max: int | None = None,
    dtype: torch.dtype = torch.uint8,
    logit_scale: float = 1.0,
    prob_dtype: torch.dtype | None = None,
    block_size: int | None = None,
) -> torch.Tensor:
    """``quantize_per_tensor(softmax(x * logit_scale, dim))`` in one kernel, with Triton (fp32 math; the online
    softmax of Milakov & Gimelshein, 2018, with the quantization of Pandey et al., 2023, as its epilogue).

    Args:
        x: scores, any shape (0-d and empty too), fp16 / bf16 / fp32, any strides (never copied). CUDA, or CPU
            under ``TRITON_INTERPRET=1``.
        dim: the normalized dim (negative counts from the end).
        scale: quantization step: finite, > 0, ``1 / scale`` finite in fp32. ``t = y * fp32(1 / scale)``.
        zero_point: code of probability 0 (and of NaN probabilities), in ``[quant_min, quant_max]``.
        quant_min, quant_max: clamp range inside ``dtype``'s (default: all of it), ``quant_min < quant_max``.
        dtype: ``torch.uint8`` or ``torch.int8``.
        logit_scale: multiplies ``x.float()`` first (rounded to fp32); finite, > 0.
        prob_dtype: round the probabilities to fp16 / bf16 (nearest even) first; None, fp32, fp64: as they are.
        block_size: a power of two: rows longer than it take the two-sweep path with tiles of this many columns.

    Returns:
        ``q``: a new contiguous ``dtype`` tensor of ``x.shape``; empty inputs give empty outputs, no launch.

    Raises:
        RuntimeError: triton missing, or ``x`` neither on CUDA nor under ``TRITON_INTERPRET=1``.
        TypeError: wrong dtypes, non-int ``dim`` / ``zero_point`` / ``quant_min`` / ``quant_max``.
        IndexError: ``dim`` out of range. ValueError: other arguments out of range.
    """
    d, logit_scale, scale, quant_min, quant_max = _check_args(
        x, dim, logit_scale, scale, zero_point, quant_min, quant_max, dtype, prob_dtype)
    check_runtime(x, "quantized softmax")

    shape = x.shape
    if x.dim() == 0:  # softmax of a scalar: one row of one element
        x = x.reshape(1)
    q = torch.empty(x.shape, dtype=dtype, device=x.device)
    if x.numel() == 0:
        return q.reshape(shape)
    C = x.shape[d]
    R = x.numel() // C
    rows_n, block, single, num_warps = row_plan(R, C, x.device, block_size, MAX_FUSED_BLOCK, LOOP_BLOCK)
    xl = row_layout(x, d)
    ql = row_layout(q, d)
    with on_device(x):
        _quant_softmax_kernel[(triton.cdiv(R, rows_n),)](
            x, *xl[:5],
            q, *ql[:5],
            R, C, _fp32(logit_scale), _fp32(1.0 / scale), float(zero_point), float(quant_min), float(quant_max),
            X_MODE=xl[5], Q_MODE=ql[5], HAS_SCALE=logit_scale != 1.0, PROB=_PROB_CODES[prob_dtype],
            ROWS=rows_n, BLOCK=block, SINGLE=single,
            num_warps=num_warps, enable_fp_fusion=False,
        )
    return q.reshape(shape)
