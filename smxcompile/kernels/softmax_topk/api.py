"""The public :func:`softmax_topk`: argument checks, then ``smx::softmax_topk``."""

from __future__ import annotations

import torch

from ..common import FLOAT_DTYPES, acc_dtype
from ..config import eager_aten
from .ops import softmax_topk_op

__all__ = ["softmax_topk"]

#: From this many columns a renormalized eager call takes the softmax of the k largest logits only (docs/
#: PERFORMANCE.md, "Softmax + top-k called eagerly").
TOPK_FIRST_MIN_COLUMNS = 64


def _aten_path(x, k, dim, scale, renormalize, dtype):
    """The eager path (no custom op; torch's autograd), the ATen composition measured fastest: the logits' top-k,
    then the softmax of those k (renormalized, from :data:`TOPK_FIRST_MIN_COLUMNS` columns) or torch's softmax
    gathered at them."""
    acc = acc_dtype(x)
    z = x if scale == 1.0 else x.to(acc) * scale
    if renormalize and x.shape[dim] >= TOPK_FIRST_MIN_COLUMNS:
        v, i = z.topk(k, dim)
        v = torch.softmax(v, dim, dtype=acc)
        v = v / v.sum(dim, keepdim=True)  # torch.sum's cascade: as accurate as torch's own renormalization
    else:
        i = z.topk(k, dim).indices
        v = torch.softmax(z, dim, dtype=acc).gather(dim, i)
        if renormalize:
            v = v / v.sum(dim, keepdim=True)
    return torch.return_types.topk((v.to(dtype or x.dtype), i))


def softmax_topk(x: torch.Tensor, k: int, dim: int = -1, *, renormalize: bool = False, temperature: float = 1.0,
                 dtype: torch.dtype | None = None):
    """The k largest probabilities of ``softmax(x / temperature, dim)`` and their indices, in one pass.

    Equals ``torch.topk(torch.softmax(x / temperature, dim), k, dim)`` (divided by the values' sum when
    ``renormalize``), without writing the probabilities of the whole row.

    Args:
        x: scores (logits), at least one dim, fp16/bf16/fp32/fp64, any strides.
        k: how many to keep, ``0 <= k <= x.shape[dim]``. dim: the normalized dim (negative counts from the end).
        renormalize: divide the k probabilities by their sum (MoE routers with ``norm_topk_prob``).
        temperature: the logits are divided by it first; a finite number > 0.
        dtype: dtype of the values (default ``x.dtype``); fp32 math (fp64 for fp64 input).

    Returns:
        ``torch.return_types.topk(values, indices)`` of ``x.shape`` with ``dim`` of size k, largest first.
        Gradients reach every logit, or with ``renormalize`` the k selected. Rows with NaN or ``+inf``, or only
        ``-inf``, give NaN values, as in torch.

    Raises:
        TypeError: ``x`` not a float tensor, ``k`` not an int, a non-float ``dtype``.
        ValueError: ``k`` out of range, ``temperature`` not finite and > 0, a 0-d ``x``.
        IndexError: ``dim`` out of range.

    Source: "Online normalizer calculation for softmax" (Milakov & Gimelshein, 2018), fused softmax + top-k.
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
    if eager_aten(x):
        return _aten_path(x, k, dim % x.dim(), 1.0 / float(temperature), bool(renormalize), dtype)
    values, indices, _ = softmax_topk_op(x, k, dim % x.dim(), 1.0 / float(temperature), bool(renormalize), dtype)
    return torch.return_types.topk((values, indices))
