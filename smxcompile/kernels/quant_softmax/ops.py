"""``smx::quant_softmax``: the custom op (no autograd: the output is an integer tensor) and its fake kernel.
CUDA: :mod:`smxcompile.kernels.quant_softmax.triton_kernels` (imported on first use); CPU:
:func:`~smxcompile.kernels.quant_softmax.decomposed.quant_softmax_decomposed`'s math, in place."""

from __future__ import annotations

import torch

from .. import config
from .decomposed import probabilities

__all__ = ["quant_softmax_op"]


def _forward_impl(x, dim, logit_scale, scale, zero_point, quant_min, quant_max, dtype, prob_dtype):
    if config.use_triton(x):
        from .triton_kernels import quant_softmax_forward

        return quant_softmax_forward(x, dim, logit_scale=logit_scale, scale=scale, zero_point=zero_point,
                                     quant_min=quant_min, quant_max=quant_max, dtype=dtype, prob_dtype=prob_dtype)
    with torch.no_grad():
        # quant_softmax_decomposed's math with in-place steps on the one fp32 buffer softmax returns
        # (eager CPU: one probability tensor and the codes, instead of a temporary per step)
        t = probabilities(x, dim, logit_scale, prob_dtype)
        if t.data_ptr() == x.data_ptr():   # never write into the caller's tensor
            t = t.clone()
        t.mul_(1.0 / scale).round_().add_(zero_point).clamp_(quant_min, quant_max)
        t.nan_to_num_(nan=float(zero_point))
        q = torch.empty(t.shape, dtype=dtype, device=t.device)   # the fake kernel's contiguous layout
        q.copy_(t)
    return q


@torch.library.custom_op("smx::quant_softmax", mutates_args=())
def quant_softmax_op(x: torch.Tensor, dim: int, logit_scale: float, scale: float, zero_point: int,
                     quant_min: int, quant_max: int, dtype: torch.dtype,
                     prob_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``torch.ops.smx.quant_softmax``: x (any shape, float), the normalized ``dim`` (>= 0), ``logit_scale``,
    the quantization ``scale``, ``zero_point``, ``quant_min``, ``quant_max`` and ``dtype`` (uint8 / int8),
    ``prob_dtype`` -> the codes, a contiguous ``dtype`` tensor of x.shape. Validated by
    :func:`smxcompile.kernels.quant_softmax.quant_softmax`."""
    return _forward_impl(x, dim, logit_scale, scale, zero_point, quant_min, quant_max, dtype, prob_dtype)


@quant_softmax_op.register_fake
def _(x, dim, logit_scale, scale, zero_point, quant_min, quant_max, dtype, prob_dtype=None):
    return x.new_empty(x.shape, dtype=dtype)
