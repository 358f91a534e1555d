"""The public :func:`quant_softmax`: argument checks, then ``smx::quant_softmax``."""

from __future__ import annotations

import math

import torch

from ..common import FLOAT_DTYPES
from .decomposed import FP32_MAX, QUANT_RANGES
from .ops import quant_softmax_op

__all__ = ["quant_softmax"]


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def quant_softmax(x: torch.Tensor, dim: int = -1, *, scale: float, zero_point: int = 0,
                  dtype: torch.dtype = torch.uint8, bits: int | None = None, quant_min: int | None = None,
                  quant_max: int | None = None, temperature: float = 1.0,
                  prob_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``softmax(x / temperature, dim)`` quantized to ``dtype`` in the same pass, without the fp32 probabilities.

    Equals ``quantize_per_tensor(torch.softmax(x.float() * (1 / temperature), dim), scale, zero_point,
    quant_min, quant_max, dtype)`` bit for bit on CPU (on the Triton path, up to one level where the scaled
    probability lies within a few ulps of a ``k + 0.5`` boundary), except that NaN probabilities give
    ``zero_point``.

    Args:
        x: scores (logits), any shape (0-d and empty too), fp16/bf16/fp32/fp64, any strides; fp32 math (fp64
            for fp64 ``x`` without ``prob_dtype``).
        dim: the normalized dim (negative counts from the end).
        scale: quantization step, finite, > 0, ``1 / scale`` finite in fp32 (``1 / 255`` for uint8, ``1 / 256``
            for int8 with ``zero_point = -128``).
        zero_point: the code of probability 0, in ``[quant_min, quant_max]``. dtype: uint8 or int8.
        bits: 2..8: ``quant_min`` / ``quant_max`` default to ``[0, 2**bits - 1]`` (uint8) or ``[-2**(bits-1),
            2**(bits-1) - 1]`` (int8); without it, to ``dtype``'s full range.
        quant_min, quant_max: the clamp range, inside ``dtype``'s range, ``quant_min < quant_max``.
        temperature: the logits are multiplied by ``1 / temperature`` first; finite, > 0.
        prob_dtype: round the probabilities to this float dtype (the dtype the model's softmax ran in) first.

    Returns:
        ``q``: a new contiguous ``dtype`` tensor of ``x.shape``; dequantize with ``(q.float() - zero_point) *
        scale``.

    Raises:
        ValueError: a bad ``dtype``, ``bits``, quant range, ``zero_point``, ``scale``, ``temperature``, ``dim``,
            or a non-floating ``x`` or ``prob_dtype``.
        TypeError: ``x`` not a tensor; non-int ``bits`` / ``zero_point`` / ``quant_min`` / ``quant_max`` /
            ``dim``; non-real ``scale`` or ``temperature``.

    Source: "Softmax Bias Correction for Quantized Generative Models" (Pandey et al., 2023); the recurrence of
    "Online normalizer calculation for softmax" (Milakov & Gimelshein, 2018).
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"quant_softmax needs floating-point scores (fp16/bf16/fp32/fp64), got {x.dtype}")
    if dtype not in QUANT_RANGES:
        raise ValueError(f"dtype must be torch.uint8 or torch.int8, got {dtype}")
    if prob_dtype is not None and prob_dtype not in FLOAT_DTYPES:
        raise ValueError(f"prob_dtype must be a floating-point dtype or None, got {prob_dtype}")
    if not _is_int(dim):
        raise TypeError(f"dim must be an int, got {dim!r}")
    nd = max(x.dim(), 1)
    if not -nd <= dim < nd:
        raise ValueError(f"dim {dim} out of range for a tensor of {x.dim()} dims (expected in [{-nd}, {nd - 1}])")
    lo, hi = QUANT_RANGES[dtype]
    if bits is not None:
        if not _is_int(bits):
            raise TypeError(f"bits must be an int, got {bits!r}")
        if not 2 <= bits <= 8:
            raise ValueError(f"bits must be in 2..8, got {bits}")
        blo, bhi = (0, 2**bits - 1) if dtype == torch.uint8 else (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
    else:
        blo, bhi = lo, hi
    quant_min = blo if quant_min is None else quant_min
    quant_max = bhi if quant_max is None else quant_max
    for name, v in (("zero_point", zero_point), ("quant_min", quant_min), ("quant_max", quant_max)):
        if not _is_int(v):
            raise TypeError(f"{name} must be an int, got {v!r}")
    if not lo <= quant_min < quant_max <= hi:
        raise ValueError(f"quant range [{quant_min}, {quant_max}] must lie inside {dtype}'s range [{lo}, {hi}] "
                         "with quant_min < quant_max")
    if not quant_min <= zero_point <= quant_max:
        raise ValueError(f"zero_point {zero_point} outside the quant range [{quant_min}, {quant_max}]")
    for name, v in (("scale", scale), ("temperature", temperature)):
        if not _is_real(v):
            raise TypeError(f"{name} must be a real number, got {v!r}")
        if not (math.isfinite(v) and v > 0):
            raise ValueError(f"{name} must be finite and > 0, got {v!r}")
    scale, temperature = float(scale), float(temperature)
    if not 1.0 / scale <= FP32_MAX:
        raise ValueError(f"scale {scale!r} is too small: 1 / scale overflows float32")
    logit_scale = 1.0 / temperature
    if not logit_scale <= FP32_MAX:
        raise ValueError(f"temperature {temperature!r} is too small: 1 / temperature overflows float32")
    return quant_softmax_op(x, dim % nd, logit_scale, scale, int(zero_point), int(quant_min), int(quant_max),
                            dtype, prob_dtype)
