"""``smx::sample``: the custom op of the fused sampling step (no autograd: tokens are integers).

CUDA: :mod:`smxcompile.kernels.sampling.triton_kernels` (imported on first use); CPU and fp64:
:func:`~smxcompile.kernels.sampling.candidates.sample_candidates`. The uniform numbers are an input, so the op
is a pure function (the graph draws them with ``torch.rand``, Inductor's RNG under ``torch.compile``)."""

from __future__ import annotations

import torch

from .. import config
from .candidates import sample_candidates

__all__ = ["sample_op"]


@torch.library.custom_op("smx::sample", mutates_args=())
def sample_op(logits: torch.Tensor, uniform: torch.Tensor, temperature: float, top_k: int, top_p: float,
              min_p: float, min_tokens_to_keep: int) -> torch.Tensor:
    """``(B, 1)`` int64 tokens of ``logits`` ``(B, V)`` drawn at ``uniform`` ``(B,)`` (arguments checked by the
    caller: :func:`~smxcompile.kernels.sampling.api.sample` or the graph pass)."""
    kw = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, min_tokens_to_keep=min_tokens_to_keep)
    if logits.shape[0] == 0:
        return torch.empty((0, 1), dtype=torch.int64, device=logits.device)
    if config.use_triton(logits):
        from .triton_kernels import sample_triton

        return sample_triton(logits, uniform, **kw)
    return sample_candidates(logits, uniform=uniform, **kw)


@sample_op.register_fake
def _(logits, uniform, temperature, top_k, top_p, min_p, min_tokens_to_keep):
    return logits.new_empty((logits.shape[0], 1), dtype=torch.int64)
