"""Triton kernels for softmax / log-softmax with a fused prologue (scale, soft-cap, additive mask), forward and
backward, in fp32 with int64 offsets.

A row that fits one block is loaded once and reduced in registers; a longer one takes the online (max, sum)
recurrence of "Online normalizer calculation for softmax" (Milakov & Gimelshein, 2018) and a second, writing
pass, keeping its last columns in registers in between. Any dim and any strides, without a copy (the row
layouts of :mod:`smxcompile.kernels.triton_helpers`). Special values follow torch. Design and measurements:
docs/DESIGN.md, "Softmax kernels (Triton)"; docs/PERFORMANCE.md, "Softmax kernels: register budgets".
"""

from __future__ import annotations

import torch

from ..common import FLOAT_DTYPES, HALF_DTYPES
from ..triton_helpers import (MODE_STRIDE, check_runtime, on_device, row_layout, row_plan, tl,
                              triton)  # triton, tl: None without it

__all__ = ["softmax_forward", "softmax_backward"]

#: Largest row (elements, a power of two) reduced in registers in one pass; longer rows loop over LOOP_BLOCK.
MAX_FUSED_BLOCK = 16384
#: The forward's one-pass limit for an aligned 16-bit ``x`` without a mask (:func:`_aligned`), at 32 warps.
MAX_FUSED_BLOCK_16 = 32768
#: Block (columns per step) of the multi-block path.
LOOP_BLOCK = 4096
#: Columns of a row the forward's multi-block path keeps in registers (at TAIL_WARPS): ``TAIL_BLOCK_WIDE`` (from
#: that many columns, else ``TAIL_BLOCK``) for an aligned ``x`` without a mask or soft-cap, else ``TAIL_BLOCK_ANY``.
TAIL_BLOCK = 16384
TAIL_BLOCK_WIDE = 32768
TAIL_BLOCK_ANY = 8192
#: Warps of a forward program with a tail.
TAIL_WARPS = 16
#: Bytes of g and y per row the backward's multi-block path keeps in registers (at most TAIL_BLOCK_ANY columns
#: unless g, y and dz are aligned).
BWD_TAIL_BYTES = 65536


# ---- Triton kernels ----

if triton is not None:
    from ..triton_helpers import row_offset, safe_max, tanh

    @triton.jit
    def _load_z(x_ptr, x_off, x_cs, mask_ptr, mask_off, mask_cs, cols, ok, scale, softcap,
                HAS_MASK: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
        """The prologue on a [ROWS, BLOCK] tile, fp32; out-of-range lanes are -inf."""
        z = tl.load(x_ptr + (x_off[:, None] + cols[None, :] * x_cs), mask=ok, other=0.0).to(tl.float32)
        z = z * scale
        if HAS_SOFTCAP:
            z = softcap * tanh(z / softcap)
        if HAS_MASK:
            mv = tl.load(mask_ptr + (mask_off[:, None] + cols[None, :] * mask_cs), mask=ok, other=0.0)
            z = z + mv.to(tl.float32)
        return tl.where(ok, z, float("-inf"))

    @triton.jit
    def _softmax_fwd_kernel(
        x_ptr, x_rows, x_s0, x_n1, x_s1, x_cs,
        mask_ptr, mask_rows, mask_s0, mask_n1, mask_s1, mask_cs,
        y_ptr, y_rows, y_s0, y_n1, y_s1, y_cs,
        lse_ptr, R, C, scale, softcap,
        X_MODE: tl.constexpr, MASK_MODE: tl.constexpr, Y_MODE: tl.constexpr,
        HAS_MASK: tl.constexpr, HAS_SOFTCAP: tl.constexpr, LOG: tl.constexpr,
        WRITE_LSE: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr, SINGLE: tl.constexpr,
        TAIL: tl.constexpr = 0,
    ):
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)
        row_ok = rows < R
        x_off = row_offset(rows, row_ok, x_rows, x_s0, x_n1, x_s1, X_MODE)
        y_off = row_offset(rows, row_ok, y_rows, y_s0, y_n1, y_s1, Y_MODE)
        if HAS_MASK:
            mask_off = row_offset(rows, row_ok, mask_rows, mask_s0, mask_n1, mask_s1, MASK_MODE)
        else:
            mask_off = x_off
        y_ty = y_ptr.dtype.element_ty
        if SINGLE:
            cols = tl.arange(0, BLOCK).to(tl.int64)
            ok = row_ok[:, None] & (cols < C)[None, :]
            z = _load_z(x_ptr, x_off, x_cs, mask_ptr, mask_off, mask_cs, cols, ok, scale, softcap,
                        HAS_MASK, HAS_SOFTCAP)
            m = tl.max(z, axis=1)
            ms = safe_max(m)
            e = tl.exp(z - ms[:, None])
            d = tl.sum(e, axis=1)
            log_d = tl.log(d)
            lse = ms + log_d
            finite = tl.abs(m) < float("inf")  # False for +-inf and NaN: the row is NaN (torch)
            if LOG:
                y = (z - ms[:, None]) - log_d[:, None]  # not z - lse: exact z - m, like ATen
            else:
                y = e / d[:, None]
            y = tl.where(finite[:, None], y, float("nan"))
            tl.store(y_ptr + (y_off[:, None] + cols[None, :] * y_cs), y.to(y_ty), mask=ok)
        else:
            # pass 1: the online (max, sum) recurrence
            m = tl.full([ROWS], float("-inf"), tl.float32)
            d = tl.zeros([ROWS], tl.float32)
            head = C
            if TAIL > 0:
                # the row's last columns stay in registers: only the head [0, head) is read twice
                head = tl.multiple_of((C - TAIL + BLOCK - 1) // BLOCK * BLOCK, BLOCK)
                t_cols = head + tl.arange(0, TAIL).to(tl.int64)
                t_ok = row_ok[:, None] & (t_cols < C)[None, :]
                z_tail = _load_z(x_ptr, x_off, x_cs, mask_ptr, mask_off, mask_cs, t_cols, t_ok, scale, softcap,
                                 HAS_MASK, HAS_SOFTCAP)
                m = tl.max(z_tail, axis=1)
                d = tl.sum(tl.exp(z_tail - safe_max(m)[:, None]), axis=1)
            for start in range(0, head, BLOCK):
                cols = start + tl.arange(0, BLOCK).to(tl.int64)
                ok = row_ok[:, None] & (cols < C)[None, :]
                z = _load_z(x_ptr, x_off, x_cs, mask_ptr, mask_off, mask_cs, cols, ok, scale, softcap,
                            HAS_MASK, HAS_SOFTCAP)
                m_new = tl.maximum(m, tl.max(z, axis=1))
                ms_new = safe_max(m_new)
                # min(., 0) guards -inf - (-inf) (an all -inf prefix) and a finite prefix before a +inf
                alpha = tl.exp(tl.minimum(safe_max(m) - ms_new, 0.0))
                d = d * alpha + tl.sum(tl.exp(z - ms_new[:, None]), axis=1)
                m = m_new
            ms = safe_max(m)
            log_d = tl.log(d)
            lse = ms + log_d
            finite = tl.abs(m) < float("inf")
            # pass 2: normalize and write
            for start in range(0, head, BLOCK):
                cols = start + tl.arange(0, BLOCK).to(tl.int64)
                ok = row_ok[:, None] & (cols < C)[None, :]
                z = _load_z(x_ptr, x_off, x_cs, mask_ptr, mask_off, mask_cs, cols, ok, scale, softcap,
                            HAS_MASK, HAS_SOFTCAP)
                if LOG:
                    y = (z - ms[:, None]) - log_d[:, None]
                else:
                    y = tl.exp(z - ms[:, None]) / d[:, None]
                y = tl.where(finite[:, None], y, float("nan"))
                tl.store(y_ptr + (y_off[:, None] + cols[None, :] * y_cs), y.to(y_ty), mask=ok)
            if TAIL > 0:
                if LOG:
                    y = (z_tail - ms[:, None]) - log_d[:, None]
                else:
                    y = tl.exp(z_tail - ms[:, None]) / d[:, None]
                y = tl.where(finite[:, None], y, float("nan"))
                tl.store(y_ptr + (y_off[:, None] + t_cols[None, :] * y_cs), y.to(y_ty), mask=t_ok)
        if WRITE_LSE:
            tl.store(lse_ptr + rows, lse, mask=row_ok)

    @triton.jit
    def _softmax_bwd_kernel(
        g_ptr, g_rows, g_s0, g_n1, g_s1, g_cs,
        y_ptr, y_rows, y_s0, y_n1, y_s1, y_cs,
        dz_ptr, dz_rows, dz_s0, dz_n1, dz_s1, dz_cs,
        glse_ptr, R, C,
        G_MODE: tl.constexpr, Y_MODE: tl.constexpr, DZ_MODE: tl.constexpr,
        LOG: tl.constexpr, HAS_GLSE: tl.constexpr,
        ROWS: tl.constexpr, BLOCK: tl.constexpr, SINGLE: tl.constexpr,
        TAIL: tl.constexpr = 0,
    ):
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)
        row_ok = rows < R
        g_off = row_offset(rows, row_ok, g_rows, g_s0, g_n1, g_s1, G_MODE)
        y_off = row_offset(rows, row_ok, y_rows, y_s0, y_n1, y_s1, Y_MODE)
        dz_off = row_offset(rows, row_ok, dz_rows, dz_s0, dz_n1, dz_s1, DZ_MODE)
        if HAS_GLSE:
            gl = tl.load(glse_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
        else:
            gl = tl.zeros([ROWS], tl.float32)
        dz_ty = dz_ptr.dtype.element_ty
        if SINGLE:
            cols = tl.arange(0, BLOCK).to(tl.int64)
            ok = row_ok[:, None] & (cols < C)[None, :]
            g = tl.load(g_ptr + (g_off[:, None] + cols[None, :] * g_cs), mask=ok, other=0.0).to(tl.float32)
            y = tl.load(y_ptr + (y_off[:, None] + cols[None, :] * y_cs), mask=ok, other=0.0).to(tl.float32)
            if LOG:
                # dz = g - p * (sum(g) - grad_lse),  p = exp(y)
                s = tl.sum(g, axis=1) - gl
                dz = g - tl.exp(y) * s[:, None]
            else:
                # dz = y * (g - sum(g * y) + grad_lse)
                s = tl.sum(g * y, axis=1) - gl
                dz = y * (g - s[:, None])
            tl.store(dz_ptr + (dz_off[:, None] + cols[None, :] * dz_cs), dz.to(dz_ty), mask=ok)
        else:
            acc = tl.zeros([ROWS, BLOCK], tl.float32)
            head = C
            if TAIL > 0:
                # as in the forward: the row's last columns stay in registers
                head = tl.multiple_of((C - TAIL + BLOCK - 1) // BLOCK * BLOCK, BLOCK)
                t_cols = head + tl.arange(0, TAIL).to(tl.int64)
                t_ok = row_ok[:, None] & (t_cols < C)[None, :]
                g_tail = tl.load(g_ptr + (g_off[:, None] + t_cols[None, :] * g_cs), mask=t_ok, other=0.0)
                if LOG:  # (y's tail is needed only at the end: loaded there, once)
                    s_tail = tl.sum(g_tail.to(tl.float32), axis=1)
                else:
                    y_tail = tl.load(y_ptr + (y_off[:, None] + t_cols[None, :] * y_cs), mask=t_ok, other=0.0)
                    s_tail = tl.sum(g_tail.to(tl.float32) * y_tail.to(tl.float32), axis=1)
            for start in range(0, head, BLOCK):
                cols = start + tl.arange(0, BLOCK).to(tl.int64)
                ok = row_ok[:, None] & (cols < C)[None, :]
                g = tl.load(g_ptr + (g_off[:, None] + cols[None, :] * g_cs), mask=ok, other=0.0).to(tl.float32)
                if LOG:
                    acc += g
                else:
                    y = tl.load(y_ptr + (y_off[:, None] + cols[None, :] * y_cs), mask=ok, other=0.0)
                    acc += g * y.to(tl.float32)
            s = tl.sum(acc, axis=1)
            if TAIL > 0:
                s += s_tail
            s -= gl
            for start in range(0, head, BLOCK):
                cols = start + tl.arange(0, BLOCK).to(tl.int64)
                ok = row_ok[:, None] & (cols < C)[None, :]
                g = tl.load(g_ptr + (g_off[:, None] + cols[None, :] * g_cs), mask=ok, other=0.0).to(tl.float32)
                y = tl.load(y_ptr + (y_off[:, None] + cols[None, :] * y_cs), mask=ok, other=0.0).to(tl.float32)
                if LOG:
                    dz = g - tl.exp(y) * s[:, None]
                else:
                    dz = y * (g - s[:, None])
                tl.store(dz_ptr + (dz_off[:, None] + cols[None, :] * dz_cs), dz.to(dz_ty), mask=ok)
            if TAIL > 0:
                g = g_tail.to(tl.float32)
                if LOG:
                    y = tl.load(y_ptr + (y_off[:, None] + t_cols[None, :] * y_cs), mask=t_ok, other=0.0)
                    dz = g - tl.exp(y.to(tl.float32)) * s[:, None]
                else:
                    dz = y_tail.to(tl.float32) * (g - s[:, None])
                tl.store(dz_ptr + (dz_off[:, None] + t_cols[None, :] * dz_cs), dz.to(dz_ty), mask=t_ok)


# ---- Launch helpers ----


def _norm_dim(dim: int, ndim: int) -> int:
    nd = max(ndim, 1)
    if not isinstance(dim, int) or isinstance(dim, bool):
        raise TypeError(f"dim must be an int, got {type(dim).__name__}")
    if not -nd <= dim < nd:
        raise IndexError(f"Dimension out of range (expected to be in range of [{-nd}, {nd - 1}], but got {dim})")
    return dim % nd


def _aligned(C: int, *tensors) -> bool:
    """Whether every ``(tensor, row_layout)`` is launched as the kernels' ptxas checks compile the large-register
    paths (tests/kernels/test_triton_softmax.py): rows in the strided layout with unit column stride, C, the row
    strides and the data pointers multiples of 16 (what Triton specializes: vectorized accesses)."""
    return C % 16 == 0 and all(lay[5] == MODE_STRIDE and lay[4] == 1 and lay[1] % 16 == 0 and t.data_ptr() % 16 == 0
                               for t, lay in tensors)


def _lse_shape(shape: torch.Size, dim: int) -> list[int]:
    return [s for i, s in enumerate(shape) if i != dim]


# ---- Public launchers ----


def softmax_forward(
    x: torch.Tensor,
    dim: int,
    *,
    scale: float = 1.0,
    softcap: float | None = None,
    mask: torch.Tensor | None = None,
    log: bool = False,
    out_dtype: torch.dtype | None = None,
    return_lse: bool = False,
    block_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax (or log-softmax) of ``z = softcap * tanh(x * scale / softcap) + mask`` along ``dim``, in fp32, with
    Triton ("Online normalizer calculation for softmax", Milakov & Gimelshein, 2018).

    Args:
        x: scores, any shape, fp16 / bf16 / fp32 (fp64 computed in fp32), any strides: never copied. CUDA, or
            CPU under ``TRITON_INTERPRET=1``.
        dim: reduced dimension, negative counts from the end.
        scale: multiplies ``x`` first. softcap: ``> 0``, or None.
        mask: additive mask broadcastable to ``x`` (any float dtype and strides), on ``x``'s device.
        log: log-softmax instead. out_dtype: dtype of ``y`` (default ``x.dtype``).
        return_lse: also write ``lse = logsumexp(z, dim)``.
        block_size: a power of two: rows longer than it take the multi-block path with blocks of this size.

    Returns:
        ``(y, lse)``: ``y`` contiguous of ``x.shape``; ``lse`` fp32 of ``x.shape`` without ``dim`` when
        ``return_lse``, else empty. A row with NaN or ``+inf``, or all ``-inf``, is all NaN; ``lse`` matches
        ``torch.logsumexp``. Empty inputs give empty outputs (``lse = -inf``) without a launch.

    Raises:
        RuntimeError: triton missing, or ``x`` neither on CUDA nor under ``TRITON_INTERPRET=1``.
        TypeError: non-floating ``x`` / ``out_dtype``, a bool or non-tensor mask. IndexError: ``dim``.
        ValueError: a mask not broadcasting to ``x`` or on another device; ``softcap <= 0``; a bad ``block_size``.
    """
    d, mask, out_dtype = _check_forward_args(x, dim, softcap, mask, out_dtype)
    check_runtime(x, "softmax")
    shape = x.shape
    if x.dim() == 0:  # softmax of a scalar: one row of one element
        x = x.reshape(1)
        mask = None if mask is None else mask.reshape(1)
    C = x.shape[d]
    R = x.numel() // C if C else 0
    y = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    if return_lse:
        lse = torch.empty(_lse_shape(x.shape, d), dtype=torch.float32, device=x.device)
    else:
        lse = x.new_empty(0, dtype=torch.float32)
    if x.numel() == 0:
        if return_lse:
            lse.fill_(float("-inf"))  # logsumexp over an empty dim
        return y.reshape(shape), lse.reshape(_lse_shape(shape, d)) if return_lse else lse
    _launch_forward(x, d, y, lse, R=R, C=C, scale=scale, softcap=softcap, mask=mask, log=log, return_lse=return_lse,
                    block_size=block_size)
    if return_lse:
        lse = lse.reshape(_lse_shape(shape, d))
    return y.reshape(shape), lse


def _check_forward_args(x, dim, softcap, mask, out_dtype):
    """Validate :func:`softmax_forward`'s arguments; return ``(dim >= 0, mask expanded to x, out_dtype)``."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"softmax_forward needs a floating-point x, got {x.dtype}")
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if out_dtype not in FLOAT_DTYPES:
        raise TypeError(f"out_dtype must be a floating-point dtype, got {out_dtype}")
    d = _norm_dim(dim, x.dim())
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be > 0 or None, got {softcap}")
    if mask is not None:
        if not isinstance(mask, torch.Tensor):
            raise TypeError(f"mask must be a Tensor or None, got {type(mask).__name__}")
        if mask.dtype == torch.bool:
            raise TypeError("mask must be additive (float, -inf where masked), not bool")
        if mask.device != x.device:
            raise ValueError(f"mask is on {mask.device} but x is on {x.device}")
        try:
            mask = mask.expand(x.shape)
        except RuntimeError as e:
            raise ValueError(f"mask of shape {tuple(mask.shape)} does not broadcast to x {tuple(x.shape)}") from e
    return d, mask, out_dtype


def _launch_forward(x, d, y, lse, *, R, C, scale, softcap, mask, log, return_lse, block_size):
    """Plan (one pass, or blocks with a tail in registers) and launch the forward kernel on a non-empty ``x``."""
    xl = row_layout(x, d)
    aligned = mask is None and _aligned(C, (x, xl))
    wide = aligned and x.dtype in HALF_DTYPES
    rows_n, block, single, num_warps = row_plan(R, C, x.device, block_size,
                                                MAX_FUSED_BLOCK_16 if wide else MAX_FUSED_BLOCK, LOOP_BLOCK)
    tail = 0
    if not single and block_size is None:  # block_size: the plain two-pass path (tests)
        tail = TAIL_BLOCK_ANY
        if aligned and softcap is None:
            tail = TAIL_BLOCK_WIDE if C >= TAIL_BLOCK_WIDE else TAIL_BLOCK
        tail = min(tail, 1 << (C.bit_length() - 1))  # the tail starts at or after column 0
        num_warps = TAIL_WARPS
    yl = row_layout(y, d)
    ml = row_layout(mask, d) if mask is not None else xl
    mask_t = mask if mask is not None else x
    grid = (triton.cdiv(R, rows_n),)
    with on_device(x):
        _softmax_fwd_kernel[grid](
            x, *xl[:5],
            mask_t, *ml[:5],
            y, *yl[:5],
            lse if return_lse else y, R, C, float(scale), 1.0 if softcap is None else float(softcap),
            X_MODE=xl[5], MASK_MODE=ml[5], Y_MODE=yl[5],
            HAS_MASK=mask is not None, HAS_SOFTCAP=softcap is not None, LOG=bool(log),
            WRITE_LSE=bool(return_lse), ROWS=rows_n, BLOCK=block, SINGLE=single, TAIL=tail,
            num_warps=num_warps,
        )


def softmax_backward(
    grad_y: torch.Tensor,
    y: torch.Tensor,
    dim: int,
    *,
    log: bool = False,
    grad_lse: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    block_size: int | None = None,
) -> torch.Tensor:
    """Gradient of softmax / log-softmax w.r.t. its input ``z``, with Triton (fp32 math).

    softmax: ``dz = y * (g - sum(g * y, dim))``; log-softmax: ``dz = g - exp(y) * sum(g, dim)``; with
    ``grad_lse`` it adds ``grad_lse.unsqueeze(dim) * p``, ``p = y`` (softmax) or ``exp(y)`` (log-softmax).

    Args:
        grad_y: gradient of ``y``, same shape, any float dtype and strides. y: the forward output, any strides.
        dim: the reduced dimension (negative counts from the end). log: ``y`` is a log-softmax.
        grad_lse: gradient of ``lse``, broadcastable to ``y.shape`` without ``dim``, or None.
        out_dtype: dtype of the result (default ``y.dtype``). block_size: as in :func:`softmax_forward`.

    Returns:
        ``dz``: a new contiguous tensor of ``y.shape`` in ``out_dtype``.

    Raises:
        RuntimeError: as :func:`softmax_forward`. TypeError: non-floating inputs or ``out_dtype``.
        IndexError: ``dim`` out of range. ValueError: mismatched shapes or devices; a bad ``block_size``.
    """
    for name, t in (("grad_y", grad_y), ("y", y)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a Tensor, got {type(t).__name__}")
        if t.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name} must be floating-point, got {t.dtype}")
    out_dtype = y.dtype if out_dtype is None else out_dtype
    if out_dtype not in FLOAT_DTYPES:
        raise TypeError(f"out_dtype must be a floating-point dtype, got {out_dtype}")
    if grad_y.shape != y.shape:
        raise ValueError(f"grad_y {tuple(grad_y.shape)} and y {tuple(y.shape)} differ in shape")
    if grad_y.device != y.device:
        raise ValueError(f"grad_y is on {grad_y.device} but y is on {y.device}")
    d = _norm_dim(dim, y.dim())
    shape = y.shape
    if y.dim() == 0:
        y, grad_y = y.reshape(1), grad_y.reshape(1)
    lse_shape = _lse_shape(y.shape, d)
    if grad_lse is not None:
        if not isinstance(grad_lse, torch.Tensor) or grad_lse.dtype not in FLOAT_DTYPES:
            raise TypeError("grad_lse must be a floating-point Tensor or None")
        if grad_lse.device != y.device:
            raise ValueError(f"grad_lse is on {grad_lse.device} but y is on {y.device}")
        try:
            grad_lse = grad_lse.expand(lse_shape)
        except RuntimeError as e:
            raise ValueError(f"grad_lse of shape {tuple(grad_lse.shape)} does not match lse {tuple(lse_shape)}") from e
    check_runtime(y, "softmax")

    dz = torch.empty(y.shape, dtype=out_dtype, device=y.device)
    if y.numel() == 0:
        return dz.reshape(shape)
    C = y.shape[d]
    R = y.numel() // C
    # [R] contiguous (the kernel reads glse_ptr + row): a 1-D expanded or sliced grad_lse (lse.sum()'s gradient
    # is stride 0) reshapes to a view, so it is copied (R elements)
    glse = grad_lse.reshape(-1).contiguous() if grad_lse is not None else dz
    rows_n, block, single, num_warps = row_plan(R, C, y.device, block_size, MAX_FUSED_BLOCK, LOOP_BLOCK)
    gl_ = row_layout(grad_y, d)
    yl = row_layout(y, d)
    dl = row_layout(dz, d)
    tail = 0
    if not single and block_size is None:  # block_size: the plain two-pass path (tests)
        # the tail starts at or after column 0: at most C (C > MAX_FUSED_BLOCK here)
        tail = min(BWD_TAIL_BYTES // (grad_y.element_size() + y.element_size()), C)
        if not _aligned(C, (grad_y, gl_), (y, yl), (dz, dl)):
            tail = min(tail, TAIL_BLOCK_ANY)
        tail = 1 << (tail.bit_length() - 1)
        num_warps = TAIL_WARPS
    grid = (triton.cdiv(R, rows_n),)
    with on_device(y):
        _softmax_bwd_kernel[grid](
            grad_y, *gl_[:5],
            y, *yl[:5],
            dz, *dl[:5],
            glse, R, C,
            G_MODE=gl_[5], Y_MODE=yl[5], DZ_MODE=dl[5],
            LOG=bool(log), HAS_GLSE=grad_lse is not None,
            ROWS=rows_n, BLOCK=block, SINGLE=single, TAIL=tail, num_warps=num_warps,
        )
    return dz.reshape(shape)
