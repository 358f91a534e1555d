"""The public :func:`softmax_topk`: argument checks, then ``smx::softmax_topk``."""

from __future__ import annotations

import torch

from ..common import FLOAT_DTYPES
from .ops import softmax_topk_op

__all__ = ["softmax_topk"]


def softmax_topk(x: torch.Tensor, k: int, dim: int = -1, *, renormalize: bool = False, temperature: float = 1.0,
                 dtype: torch.dtype | None = None):
    """The k largest probabilities of ``softmax(x / temperature, dim)`` and their indices, in one pass.

    Equals ``torch.topk(torch.softmax(x / temperature, dim), k, dim)`` (divided by the values' sum when
    ``renormalize``; then it also equals ``torch.softmax(torch.topk(x / temperature, k, dim).values, dim)``),
    without writing the probabilities of the whole row.

    Args:
        x: scores (logits), any shape with at least one dim, fp16/bf16/fp32/fp64, any strides.
        k: how many to keep, ``0 <= k <= x.shape[dim]``.
        dim: the normalized dim (negative counts from the end).
        renormalize: divide the k probabilities by their sum (MoE routers with ``norm_topk_prob``,
            top-k samplers).
        temperature: the logits are divided by it first; a finite number > 0.
        dtype: dtype of the values (default ``x.dtype``); the math is fp32 (fp64 for fp64 input).

    Returns:
        ``torch.return_types.topk(values, indices)``: values (``dtype``) and indices (int64), both of
        ``x.shape`` with ``dim`` of size k, largest first. The gradient reaches every logit (through the
        normalizer) when ``renormalize=False``, the k selected logits when ``renormalize=True``.
        Rows that contain NaN or ``+inf``, or only ``-inf``, give NaN values, as in torch.

    Raises:
        TypeError: ``x`` not a float tensor, ``k`` not an int, a non-float ``dtype``.
        ValueError: ``k`` out of range, ``temperature`` not finite and > 0, a 0-d ``x``.
        IndexError: ``dim`` out of range.

    Source: "Online normalizer calculation for softmax" (Milakov & Gimelshein, 2018), fused softmax + top-k;
    Triton kernels on CUDA, two passes per row without the full probability tensor on CPU.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"softmax_topk needs floating-point scores, got {x.dtype}")
    if dtype is not None and dtype not in FLOAT_DTYPES:
        raise TypeError(f"dtype must be a floating-point dtype, got {dtype}")
    if x.dim() == 0:
        raise ValueError("softmax_topk needs a tensor with at least one dim, got a 0-d tensor")
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"dim must be an int, got {dim!r}")
    if not -x.dim() <= dim < x.dim():
        raise IndexError(f"Dimension out of range (expected to be in range of [{-x.dim()}, {x.dim() - 1}], but got {dim})")
    if isinstance(k, bool) or not isinstance(k, int):
        raise TypeError(f"k must be an int, got {k!r}")
    n = x.shape[dim]
    if not 0 <= k <= n:
        raise ValueError(f"k={k} out of range: dim {dim} has {n} entries (0 <= k <= {n})")
    if (isinstance(temperature, bool) or not isinstance(temperature, (int, float))
        or not temperature == temperature or temperature <= 0 or temperature == float("inf")):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    values, indices, _ = softmax_topk_op(x, k, dim % x.dim(), 1.0 / float(temperature), bool(renormalize), dtype)
    return torch.return_types.topk((values, indices))
