"""``smx::softmax_topk`` and ``smx::softmax_topk_backward``: the custom ops, fake kernels and autograd.
CUDA: :mod:`smxcompile.kernels.softmax_topk.triton_kernels` (imported on first use); CPU and fp64:
:func:`~smxcompile.kernels.softmax_topk.decomposed.softmax_topk_decomposed` and the backward below."""

from __future__ import annotations

import torch

from .. import config
from ..common import acc_dtype
from .decomposed import softmax_topk_decomposed

__all__ = ["softmax_topk_op", "TRITON_MAX_K"]


#: Largest k of the Triton kernels (``triton_kernels.MAX_K``); a larger k runs the torch path.
TRITON_MAX_K = 256


def _forward_impl(x, k, dim, scale, renormalize, dtype):
    if config.use_triton(x) and x.dim() > 0 and k <= TRITON_MAX_K:
        from .triton_kernels import softmax_topk_forward

        xl = x.movedim(dim, -1)
        batch, n = xl.shape[:-1], xl.shape[-1]
        x2 = xl.reshape(batch.numel(), n)   # (not -1: ambiguous for rows of no columns)
        if x2.shape[-1] > 1 and x2.stride(-1) != 1:
            x2 = x2.contiguous()
        v, i, logd = softmax_topk_forward(x2, k, scale=scale, renormalize=renormalize, out_dtype=dtype or x.dtype)
        v = v.reshape(*batch, k).movedim(-1, dim).contiguous()
        i = i.reshape(*batch, k).movedim(-1, dim).contiguous()
        logd = logd.reshape(batch) if not renormalize else logd.new_empty(0)
        return v, i, logd
    with torch.no_grad():
        v, i, logd = softmax_topk_decomposed(x, k, dim, scale, renormalize, dtype)
    return v.contiguous(), i.contiguous(), logd.contiguous()


def _backward_impl(grad_values, values, indices, x, logd, dim, scale, renormalize):
    """Gradient w.r.t. ``x`` (x.dtype): see :func:`softmax_topk` for the formula."""
    if config.use_triton(x) and x.dim() > 0 and values.shape[dim] <= TRITON_MAX_K:
        from .triton_kernels import softmax_topk_backward

        xl = x.movedim(dim, -1)
        batch, n = xl.shape[:-1], xl.shape[-1]
        x2 = xl.reshape(batch.numel(), n)   # (not -1: ambiguous for rows of no columns, or k == 0)
        if x2.shape[-1] > 1 and x2.stride(-1) != 1:
            x2 = x2.contiguous()
        kk = values.shape[dim]

        def rows(t):
            return t.movedim(dim, -1).reshape(batch.numel(), kk).contiguous()

        g = softmax_topk_backward(rows(grad_values), rows(values), rows(indices), x2, logd.reshape(-1),
                                  scale=scale, renormalize=renormalize, out_dtype=x.dtype)
        return g.reshape(*batch, n).movedim(-1, dim).contiguous()
    # The probabilities are recomputed from x in the accumulation dtype, relative to the row max: the
    # saved values may be rounded to a narrower ``dtype=`` (bf16 / fp16), and ``exp(z - lse)`` with an
    # fp32 lse loses about |lse| ulps (logits of ~1000: 1e-4 relative); torch's softmax backward has neither.
    acc = acc_dtype(x)
    g = grad_values.to(acc)
    z = x.to(acc) * scale
    if x.shape[dim] == 0:
        return torch.zeros_like(x)
    if renormalize:
        v = torch.softmax(z.gather(dim, indices), dim)
        gv = g * v
        dz = torch.zeros_like(z).scatter_(dim, indices, gv - v * gv.sum(dim, keepdim=True))
    else:
        e = torch.exp(z - z.amax(dim, keepdim=True))
        p = e / e.sum(dim, keepdim=True)
        gv = g * p.gather(dim, indices)
        dz = (-p * gv.sum(dim, keepdim=True)).scatter_add_(dim, indices, gv)
    return (dz * scale).to(x.dtype).contiguous()


@torch.library.custom_op("smx::softmax_topk", mutates_args=())
def softmax_topk_op(x: torch.Tensor, k: int, dim: int, scale: float, renormalize: bool,
                    dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``torch.ops.smx.softmax_topk``: x (any shape with a dim, float), ``k``, the normalized ``dim`` (>= 0),
    ``scale`` (> 0), ``renormalize``, the values' ``dtype`` -> ``(values, indices, logd)`` as
    :func:`~smxcompile.kernels.softmax_topk.decomposed.softmax_topk_decomposed` returns them (contiguous);
    differentiable w.r.t. x. Validated by :func:`smxcompile.kernels.softmax_topk.softmax_topk`."""
    return _forward_impl(x, k, dim, scale, renormalize, dtype)


@softmax_topk_op.register_fake
def _(x, k, dim, scale, renormalize, dtype):
    shape = list(x.shape)
    d = dim % x.dim()
    shape[d] = k
    lse_shape = [s for i, s in enumerate(x.shape) if i != d] if not renormalize else [0]
    return (x.new_empty(shape, dtype=dtype or x.dtype), x.new_empty(shape, dtype=torch.int64),
            x.new_empty(lse_shape, dtype=acc_dtype(x)))


@torch.library.custom_op("smx::softmax_topk_backward", mutates_args=())
def _softmax_topk_backward_op(grad_values: torch.Tensor, values: torch.Tensor, indices: torch.Tensor, x: torch.Tensor,
                              logd: torch.Tensor, dim: int, scale: float, renormalize: bool) -> torch.Tensor:
    return _backward_impl(grad_values, values, indices, x, logd, dim, scale, renormalize)


@_softmax_topk_backward_op.register_fake
def _(grad_values, values, indices, x, logd, dim, scale, renormalize):
    return x.new_empty(x.shape)


def _setup_context(ctx, inputs, output):
    x, k, dim, scale, renormalize, dtype = inputs
    values, indices, logd = output
    ctx.dim = dim % x.dim()
    ctx.scale, ctx.renormalize = scale, renormalize
    ctx.save_for_backward(values, indices, x, logd)


def _backward(ctx, grad_values, grad_indices, grad_lse):
    values, indices, x, logd = ctx.saved_tensors
    if grad_values is None:
        return None, None, None, None, None, None
    gx = _softmax_topk_backward_op(grad_values, values, indices, x, logd, ctx.dim, ctx.scale, ctx.renormalize)
    return gx, None, None, None, None, None


softmax_topk_op.register_autograd(_backward, setup_context=_setup_context)
