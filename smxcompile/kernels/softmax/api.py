"""The public softmax / log-softmax functions: argument checks, then ``smx::softmax`` / ``smx::log_softmax``
(:mod:`smxcompile.kernels.softmax.ops`)."""

from __future__ import annotations

import torch

from ..common import FLOAT_DTYPES
from ..config import eager_aten
from .ops import log_softmax_op, softmax_op, softmax_torch

__all__ = ["softmax", "log_softmax"]


def _check_args(x, dim, dtype, mask, scale, softcap):
    """Validate the public functions' arguments; returns ``x`` (cast to ``dtype`` for int inputs, as torch does)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a Tensor, got {type(x).__name__}")
    if dtype is not None and dtype not in FLOAT_DTYPES:
        raise TypeError(f"dtype must be a floating-point dtype, got {dtype}")
    if x.dtype not in FLOAT_DTYPES:
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
    args = (x, dim, float(scale), None if softcap is None else float(softcap), mask, dtype, return_lse)
    y, lse = softmax_torch(*args, log=op is log_softmax_op) if eager_aten(x) else op(*args)
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
        dtype: output dtype (default ``x.dtype``); fp32 math for half inputs, ``x`` not rounded to ``dtype``.
        return_lse: also return ``logsumexp(z, dim)`` (fp32, ``dim`` removed).

    Returns:
        ``y`` (contiguous, ``x.shape``), or ``(y, lse)`` when ``return_lse``. An all ``-inf`` row gives NaN.

    Raises:
        TypeError: non-float ``x`` without ``dtype``, a non-float ``dtype``, a non-int ``dim``, a non-number
            ``scale``/``softcap``, a mask that is not a float tensor.
        IndexError: ``dim`` out of range.
        ValueError: a mask that does not broadcast to ``x``, ``softcap <= 0``.

    Source: online softmax (Milakov & Gimelshein, 2018) on CUDA; ATen's kernels on CPU.
    """
    return _call(softmax_op, x, dim, scale, softcap, mask, dtype, return_lse)


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
    """Log-softmax ``z - logsumexp(z, dim)`` of ``softcap*tanh(x*scale/softcap) + mask``: arguments, shapes,
    errors and source as :func:`softmax`."""
    return _call(log_softmax_op, x, dim, scale, softcap, mask, dtype, return_lse)
