"""``smx::softmax`` and ``smx::log_softmax``: softmax with its elementwise neighbours fused.

The op computes, in fp32,

    z = x * scale;  z = softcap * tanh(z / softcap)   (if softcap);  z = z + mask   (if mask)
    y = softmax(z, dim)   or   log_softmax(z, dim)

and writes ``y`` in ``dtype`` (default ``x.dtype``), plus optionally the row's
log-sum-exp ``lse = logsumexp(z, dim)`` (fp32) as a free side output.

CUDA path: Triton kernels with the online (max, sum) recurrence — "Online
normalizer calculation for softmax" (Milakov & Gimelshein, 2018) — see
:mod:`smxcompile.kernels.triton_softmax`. CPU path: ATen's vectorized softmax
kernels (measured faster than Inductor's generated C++ for a plain softmax; see
docs/PERFORMANCE.md).
"""

from __future__ import annotations

import torch

from . import config

__all__ = ["softmax", "log_softmax"]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _lse_shape(x: torch.Tensor, dim: int) -> list:
    d = dim % x.dim() if x.dim() else 0
    return [s for i, s in enumerate(x.shape) if i != d]


def _lse_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _prologue(x: torch.Tensor, scale: float, softcap: float | None, mask: torch.Tensor | None) -> torch.Tensor:
    """The fused prologue in plain torch (CPU path and reference), fp32 for half inputs."""
    z = x if x.dtype in (torch.float32, torch.float64) else x.float()
    if scale != 1.0:
        z = z * scale
    if softcap is not None:
        z = torch.tanh(z / softcap) * softcap
    if mask is not None:
        z = z + (mask if mask.dtype == z.dtype else mask.to(z.dtype))
    return z


def _forward_impl(x, dim, scale, softcap, mask, dtype, return_lse, log):
    out_dtype = dtype or x.dtype
    if config.use_triton(x):
        from .triton_softmax import softmax_forward

        return softmax_forward(
            x, dim, scale=scale, softcap=softcap, mask=mask, log=log, out_dtype=out_dtype, return_lse=return_lse
        )
    plain = scale == 1.0 and softcap is None and mask is None
    z = x if plain else _prologue(x, scale, softcap, mask)
    fn = torch.log_softmax if log else torch.softmax
    if z.dtype in (torch.float16, torch.bfloat16):
        # fp32 math, one rounding at the end (ATen's half kernels round log-probs less accurately)
        y = fn(z, dim, dtype=torch.float32).to(out_dtype)
    else:
        y = fn(z, dim).to(out_dtype)
    y = y.contiguous()
    if return_lse:
        lse = torch.logsumexp(z.to(_lse_dtype(x)), dim)
    else:
        lse = x.new_empty(0, dtype=_lse_dtype(x))
    return y, lse


def _backward_impl(grad_y, y, dim, log, grad_lse, dtype):
    out_dtype = dtype or y.dtype
    if config.use_triton(y):
        from .triton_softmax import softmax_backward

        return softmax_backward(grad_y, y, dim, log=log, grad_lse=grad_lse, out_dtype=out_dtype)
    g = grad_y if grad_y.dtype == y.dtype else grad_y.to(y.dtype)
    if log:
        dz = torch._log_softmax_backward_data(g, y, dim, y.dtype)
    else:
        dz = torch._softmax_backward_data(g, y, dim, y.dtype)
    if grad_lse is not None and grad_lse.numel():
        acc = grad_lse.dtype
        p = y.to(acc).exp() if log else y.to(acc)
        dz = dz.to(acc) + grad_lse.unsqueeze(dim) * p
    return dz.to(out_dtype).contiguous()


def _define(name: str, log: bool):
    qual = f"smx::{name}"

    @torch.library.custom_op(qual, mutates_args=())
    def op(
        x: torch.Tensor,
        dim: int,
        scale: float = 1.0,
        softcap: float | None = None,
        mask: torch.Tensor | None = None,
        dtype: torch.dtype | None = None,
        return_lse: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return _forward_impl(x, dim, scale, softcap, mask, dtype, return_lse, log)

    @op.register_fake
    def _(x, dim, scale=1.0, softcap=None, mask=None, dtype=None, return_lse=False):
        y = x.new_empty(x.shape, dtype=dtype or x.dtype)
        lse = x.new_empty(_lse_shape(x, dim) if return_lse else (0,), dtype=_lse_dtype(x))
        return y, lse

    bwd_qual = f"smx::{name}_backward"

    @torch.library.custom_op(bwd_qual, mutates_args=())
    def bwd_op(
        grad_y: torch.Tensor, y: torch.Tensor, dim: int, grad_lse: torch.Tensor | None, dtype: torch.dtype
    ) -> torch.Tensor:
        return _backward_impl(grad_y, y, dim, log, grad_lse, dtype)

    @bwd_op.register_fake
    def _(grad_y, y, dim, grad_lse, dtype):
        return y.new_empty(y.shape, dtype=dtype)

    def setup_context(ctx, inputs, output):
        x, dim, scale, softcap, mask, dtype, return_lse = inputs
        y, _ = output
        ctx.dim = dim % x.dim() if x.dim() else 0
        ctx.scale, ctx.softcap = scale, softcap
        ctx.x_dtype = x.dtype
        ctx.mask_shape = None if mask is None else mask.shape
        ctx.mask_dtype = None if mask is None else mask.dtype
        ctx.return_lse = return_lse
        ctx.save_for_backward(y, x if softcap is not None else None)

    def backward(ctx, grad_y, grad_lse):
        y, x = ctx.saved_tensors
        if grad_y is None:
            grad_y = torch.zeros_like(y)
        prologue = ctx.scale != 1.0 or ctx.softcap is not None or ctx.mask_shape is not None
        # The gradient w.r.t. z (the softmax input after the prologue), fp32 when a prologue follows.
        gz_dtype = torch.float32 if prologue and ctx.x_dtype != torch.float64 else ctx.x_dtype
        if not ctx.return_lse:
            grad_lse = None
        gz = bwd_op(grad_y, y, ctx.dim, grad_lse, gz_dtype)
        grad_mask = None
        if ctx.mask_shape is not None and ctx.needs_input_grad[4]:
            grad_mask = gz.sum_to_size(ctx.mask_shape).to(ctx.mask_dtype)
        grad_x = None
        if ctx.needs_input_grad[0]:
            g = gz
            if ctx.softcap is not None:
                t = torch.tanh(x.float() * ctx.scale / ctx.softcap)
                g = g * (1.0 - t * t)
            if ctx.scale != 1.0:
                g = g * ctx.scale
            grad_x = g.to(ctx.x_dtype)
        return grad_x, None, None, None, grad_mask, None, None

    op.register_autograd(backward, setup_context=setup_context)
    return op


_softmax_op = _define("softmax", log=False)
_log_softmax_op = _define("log_softmax", log=True)


def _check_args(x, dim, dtype, mask, scale, softcap):
    """Validate the public functions' arguments; returns ``x`` (cast to ``dtype`` for int inputs, as torch does)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a Tensor, got {type(x).__name__}")
    if dtype is not None and dtype not in _FLOAT_DTYPES:
        raise TypeError(f"dtype must be a floating-point dtype, got {dtype}")
    if x.dtype not in _FLOAT_DTYPES:
        if dtype is None:
            raise TypeError(f"softmax needs a floating-point tensor (or dtype=...), got {x.dtype}")
        x = x.to(dtype)  # torch.softmax(int_tensor, dim, dtype=float) casts first
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"dim must be an int, got {dim!r}")
    nd = max(x.dim(), 1)
    if not -nd <= dim < nd:
        raise IndexError(f"Dimension out of range (expected to be in range of [{-nd}, {nd - 1}], but got {dim})")
    for name, v in (("scale", scale), ("softcap", softcap)):
        if v is None and name == "softcap":
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
            raise TypeError(f"{name} must be a real number, got {v!r}")
    if softcap is not None and softcap <= 0:
        raise ValueError(f"softcap must be > 0, got {softcap!r}")
    if mask is not None:
        if not isinstance(mask, torch.Tensor):
            raise TypeError(f"mask must be a Tensor or None, got {type(mask).__name__}")
        try:
            shape = torch.broadcast_shapes(mask.shape, x.shape)
        except RuntimeError as e:
            raise ValueError(f"mask of shape {tuple(mask.shape)} does not broadcast to x {tuple(x.shape)}") from e
        if shape != x.shape:
            raise ValueError(f"mask of shape {tuple(mask.shape)} would broadcast x {tuple(x.shape)} to a larger shape")
        if mask.dtype == torch.bool:
            raise TypeError("mask must be additive (float, -inf where masked), not bool; use torch.where first")
        if not mask.dtype.is_floating_point:
            raise TypeError(f"mask must be a floating-point tensor, got {mask.dtype}")
    return x


def _call(op, x, dim, scale, softcap, mask, dtype, return_lse):
    """Validate the public arguments, run ``op``, drop ``lse`` unless asked for."""
    x = _check_args(x, dim, dtype, mask, scale, softcap)
    y, lse = op(x, dim, float(scale), None if softcap is None else float(softcap), mask, dtype, return_lse)
    return (y, lse) if return_lse else y


def softmax(
    x: torch.Tensor,
    dim: int = -1,
    *,
    scale: float = 1.0,
    softcap: float | None = None,
    mask: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
    return_lse: bool = False,
):
    """Softmax of ``softcap*tanh(x*scale/softcap) + mask`` along ``dim``, in one pass.

    Args:
        x: scores (logits), any shape, fp16/bf16/fp32/fp64, any strides.
        dim: the normalized dimension (negative counts from the end).
        scale: multiplies ``x`` first (e.g. ``1/temperature`` or ``1/sqrt(d)``).
        softcap: logit soft-capping ``c * tanh(z / c)`` (Gemma 2), or None.
        mask: additive mask broadcastable to ``x`` (``-inf`` where masked), or None.
        dtype: output dtype (default ``x.dtype``); the math is fp32 for half inputs.
            Unlike ``torch.softmax(dtype=...)`` the input is not rounded to ``dtype`` first.
        return_lse: also return ``logsumexp(z, dim)`` (fp32, ``dim`` removed).

    Returns:
        ``y`` (contiguous, ``x.shape``), or ``(y, lse)`` when ``return_lse``.
        A row whose entries are all ``-inf`` gives NaN, as in torch.

    Raises:
        TypeError: non-float ``x`` without ``dtype``, a non-float ``dtype``, a non-int ``dim``,
            a non-number ``scale``/``softcap``, a mask that is not a float tensor.
        IndexError: ``dim`` out of range.
        ValueError: a mask that does not broadcast to ``x``, ``softcap <= 0``.

    Source: online softmax, Milakov & Gimelshein, "Online normalizer calculation
    for softmax" (2018), on CUDA; ATen's kernels on CPU.
    """
    return _call(_softmax_op, x, dim, scale, softcap, mask, dtype, return_lse)


def log_softmax(
    x: torch.Tensor,
    dim: int = -1,
    *,
    scale: float = 1.0,
    softcap: float | None = None,
    mask: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
    return_lse: bool = False,
):
    """Log-softmax of ``softcap*tanh(x*scale/softcap) + mask`` along ``dim``; see :func:`softmax`.

    Returns ``z - logsumexp(z, dim)`` with the same shapes, dtypes, errors and
    source as :func:`softmax`.
    """
    return _call(_log_softmax_op, x, dim, scale, softcap, mask, dtype, return_lse)
