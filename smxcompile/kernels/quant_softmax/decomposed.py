"""The quantized softmax in plain torch: :func:`quant_softmax_decomposed` (the op's CPU path and what a graph
pass emits on CPU), :func:`quant_softmax_reference` (tests' oracle) and the integer dtypes' ranges."""

from __future__ import annotations

import torch

from ..common import acc_dtype

__all__ = ["QUANT_RANGES", "FP32_MAX", "probabilities", "quant_softmax_decomposed", "quant_softmax_reference"]

#: The integer dtypes the op writes and their full ranges.
QUANT_RANGES = {torch.uint8: (0, 255), torch.int8: (-128, 127)}
#: The largest finite fp32 (``torch.finfo(torch.float32).max``): ``1 / scale`` must stay below it.
FP32_MAX = 3.4028234663852886e38


def probabilities(x: torch.Tensor, dim: int, logit_scale: float, prob_dtype: torch.dtype | None) -> torch.Tensor:
    """Softmax of ``x * logit_scale`` along ``dim`` in fp32 (fp64 for fp64 ``x``), rounded through ``prob_dtype``
    when given, returned as fp32 (fp64). Not validated."""
    acc = acc_dtype(x)
    if prob_dtype is not None and prob_dtype == x.dtype and x.dtype != acc and logit_scale == 1.0:
        # ATen's softmax in x's half dtype: bit for bit what the model's graph computed
        return torch.softmax(x, dim).to(torch.float32)
    z = x if x.dtype == acc else x.to(acc)
    if logit_scale != 1.0:
        z = z * logit_scale
    y = torch.softmax(z, dim)
    if prob_dtype is not None:
        y = y.to(prob_dtype).to(torch.float32)
    return y


def quant_softmax_decomposed(x: torch.Tensor, dim: int, logit_scale: float, scale: float, zero_point: int,
                             quant_min: int, quant_max: int, dtype: torch.dtype,
                             prob_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The op's math in torch ops: its CPU path, and what a graph pass emits on CPU (Inductor fuses it). Not
    validated (the public :func:`quant_softmax` checks the arguments).

    Args:
        x: scores, any shape (0-d and empty included), fp16/bf16/fp32/fp64, any strides. dim: the normalized dim.
        logit_scale: multiplies ``x`` (upcast to fp32 / fp64) first; ``1.0`` skips the multiply.
        scale, zero_point, quant_min, quant_max, dtype: as ``quantize_per_tensor``; ``dtype`` uint8 or int8.
        prob_dtype: round the probabilities to this dtype first, or None.

    Returns:
        ``q``: ``dtype``, ``x.shape``, the layout torch's elementwise ops give; NaN probabilities give
        ``zero_point``.
    """
    y = probabilities(x, dim, logit_scale, prob_dtype)
    t = y * (1.0 / scale)
    q = torch.clamp(torch.round(t) + zero_point, quant_min, quant_max)
    q = torch.where(torch.isnan(t), zero_point, q)
    return q.to(dtype)


def quant_softmax_reference(x: torch.Tensor, dim: int, logit_scale: float, scale: float, zero_point: int,
                            quant_min: int, quant_max: int, dtype: torch.dtype,
                            prob_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The spelling the op replaces, literally (tests' oracle): ``quantize_per_tensor(torch.softmax(x, dim), scale,
    zero_point, quant_min, quant_max, dtype)`` with ``x`` upcast and scaled first and the probabilities cast to
    ``prob_dtype``; fp64 probabilities use its formula written out in fp64. NaN gives platform-dependent codes.
    """
    qpt = torch.ops.quantized_decomposed.quantize_per_tensor
    if prob_dtype is not None and prob_dtype == x.dtype and x.dtype in (torch.float16, torch.bfloat16) \
            and logit_scale == 1.0:
        return qpt(torch.softmax(x, dim), scale, zero_point, quant_min, quant_max, dtype)
    z = x.to(acc_dtype(x))
    if logit_scale != 1.0:
        z = z * logit_scale
    y = torch.softmax(z, dim)
    if prob_dtype is not None:
        y = y.to(prob_dtype)
    if y.dtype == torch.float64:
        return torch.clamp(torch.round(y * (1.0 / scale)) + zero_point, quant_min, quant_max).to(dtype)
    return qpt(y, scale, zero_point, quant_min, quant_max, dtype)
