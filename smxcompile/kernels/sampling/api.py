"""The public :func:`sample`: the sampling step of ``generate(do_sample=True)`` in one op."""

from __future__ import annotations

import math
import numbers

import torch

from ..common import FLOAT_DTYPES
from .ops import sample_op

__all__ = ["sample", "check_sampling"]


def check_sampling(temperature, top_k, top_p, min_p, min_tokens_to_keep) -> tuple[float, int, float, float, int]:
    """The options as the op takes them (``top_k`` 0, ``top_p`` 1.0, ``min_p`` 0.0: off).

    Raises:
        ValueError: ``temperature`` not a positive finite number, ``top_k`` not None / an int >= 0, ``top_p``
            not None / in [0, 1] (0 keeps the ``min_tokens_to_keep`` largest), ``min_p`` not None / in [0, 1], ``min_tokens_to_keep`` not an int >= 1
            (transformers' warpers refuse the same values).
    """
    def real(v):
        return isinstance(v, numbers.Real) and not isinstance(v, bool)

    def integer(v):
        return isinstance(v, numbers.Integral) and not isinstance(v, bool)

    if not real(temperature) or not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a positive finite number, got {temperature!r}")
    if top_k is not None and (not integer(top_k) or top_k < 0):
        raise ValueError(f"top_k must be None or an int >= 0, got {top_k!r}")
    if top_p is not None and (not real(top_p) or not 0.0 <= top_p <= 1.0):
        raise ValueError(f"top_p must be None or a float in [0, 1], got {top_p!r}")
    if min_p is not None and (not real(min_p) or not 0.0 <= min_p <= 1.0):
        raise ValueError(f"min_p must be None or a float in [0, 1], got {min_p!r}")
    if not integer(min_tokens_to_keep) or min_tokens_to_keep < 1:
        raise ValueError(f"min_tokens_to_keep must be an int >= 1, got {min_tokens_to_keep!r}")
    return (float(temperature), int(top_k or 0), 1.0 if top_p is None else float(top_p),
            0.0 if min_p is None else float(min_p), int(min_tokens_to_keep))


def sample(logits: torch.Tensor, *, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
           min_p: float | None = None, min_tokens_to_keep: int = 1,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row, as ``torch.multinomial(softmax(filters(logits / temperature)), 1)`` with the filters of
    transformers' ``generate(do_sample=True)`` in its order (top-k, top-p, min-p), without writing the rows'
    probabilities (FlashInfer's sampling kernels do the same on a GPU).

    Args:
        logits: ``(B, V)`` or ``(V,)`` floating point, ``V >= 1``.
        temperature, top_k, top_p, min_p, min_tokens_to_keep: transformers' ``TemperatureLogitsWarper``,
            ``TopKLogitsWarper`` (ties at the k-th value kept), ``TopPLogitsWarper``, ``MinPLogitsWarper``; None
            (and ``top_k=0``, ``top_p=1``) turn a filter off.
        generator: the ``torch.Generator`` of the uniform draws, as ``torch.multinomial``'s.

    Returns:
        ``(B, 1)`` int64 (``(1,)`` for 1-D logits), as ``torch.multinomial(probs, 1)``. The tokens follow
        eager's distribution exactly; draw by draw they differ from eager's (another use of the random numbers).

    Raises:
        ValueError / TypeError: bad options, non-float logits, ``V == 0``, more than 2 dims.
        RuntimeError: a row with NaN, ``+inf`` or only ``-inf`` logits (its softmax is NaN), as
            ``torch.multinomial``.
    """
    opts = check_sampling(temperature, top_k, top_p, min_p, min_tokens_to_keep)
    if not isinstance(logits, torch.Tensor) or logits.dtype not in FLOAT_DTYPES:
        raise TypeError(f"logits must be a floating-point Tensor, got {getattr(logits, 'dtype', type(logits))}")
    if logits.dim() not in (1, 2) or logits.shape[-1] == 0:
        raise ValueError(f"logits must be (V,) or (B, V) with V >= 1, got shape {tuple(logits.shape)}")
    rows = logits.reshape(-1, logits.shape[-1])
    uniform = torch.rand(rows.shape[0], generator=generator, device=logits.device)
    tokens = sample_op(rows, uniform, *opts)
    return tokens.reshape(1) if logits.dim() == 1 else tokens
