"""``smx::softmax`` and ``smx::log_softmax``: ``z = softcap * tanh(x * scale / softcap) + mask``, then
``softmax(z, dim)`` or ``log_softmax(z, dim)`` in ``dtype`` and optionally ``lse = logsumexp(z, dim)`` (fp32),
with fp32 math (fp64 for fp64). CUDA: the Triton kernels (online softmax, Milakov & Gimelshein, 2018); CPU:
ATen's softmax kernels, measured faster than Inductor's code (docs/PERFORMANCE.md)."""

from __future__ import annotations

import torch

from .. import config
from ..common import acc_dtype

__all__ = ["softmax_op", "log_softmax_op", "prologue", "softmax_torch"]


def _lse_shape(x: torch.Tensor, dim: int) -> list:
    d = dim % x.dim() if x.dim() else 0
    return [s for i, s in enumerate(x.shape) if i != d]


def prologue(x: torch.Tensor, scale: float, softcap: float | None, mask: torch.Tensor | None) -> torch.Tensor:
    """The fused prologue ``z = softcap * tanh(x * scale / softcap) + mask`` in plain torch (softcap None: no
    capping; mask additive, broadcastable to ``x``): fp32 for half ``x`` (fp64 for fp64), ``x`` itself when
    there is nothing to apply."""
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
    # dtype=float64 asks for fp64 math, as torch's dtype= does (it casts the input first): the torch path
    if config.use_triton(x) and out_dtype != torch.float64:
        from .triton_kernels import softmax_forward

        return softmax_forward(
            x, dim, scale=scale, softcap=softcap, mask=mask, log=log, out_dtype=out_dtype, return_lse=return_lse
        )
    return softmax_torch(x, dim, scale, softcap, mask, dtype, return_lse, log)


def softmax_torch(x: torch.Tensor, dim: int, scale: float, softcap: float | None, mask: torch.Tensor | None,
                  dtype: torch.dtype | None, return_lse: bool, log: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The op's torch path (its CPU kernel, and :func:`smxcompile.softmax` called eagerly on CPU): ATen's softmax /
    log-softmax after :func:`prologue`, under torch's autograd. Args and returns those of ``smx::softmax``."""
    out_dtype = dtype or x.dtype
    plain = scale == 1.0 and softcap is None and mask is None
    z = x if plain else prologue(x, scale, softcap, mask)
    fn = torch.log_softmax if log else torch.softmax
    if out_dtype == torch.float64:
        y = fn(z.double(), dim)
    elif z.dtype in (torch.float16, torch.bfloat16) and (log or out_dtype != z.dtype):
        # fp32 math, one rounding at the end (ATen's half kernels round log-probs less accurately)
        y = fn(z, dim, dtype=torch.float32).to(out_dtype)
    else:
        # (a half softmax: ATen's kernel accumulates in fp32 and rounds once, 1.5x faster than an fp32 copy)
        y = fn(z, dim).to(out_dtype)
    y = y.contiguous()
    if return_lse:
        lse = torch.logsumexp(z.to(acc_dtype(x)), dim)
    else:
        lse = x.new_empty(0, dtype=acc_dtype(x))
    return y, lse


def _backward_impl(grad_y, y, dim, log, grad_lse, dtype):
    out_dtype = dtype or y.dtype
    if config.use_triton(y):
        from .triton_kernels import softmax_backward

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
        lse = x.new_empty(_lse_shape(x, dim) if return_lse else (0,), dtype=acc_dtype(x))
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


#: ``torch.ops.smx.softmax``: (x, dim, scale, softcap, mask, dtype, return_lse) -> (y, lse); differentiable.
softmax_op = _define("softmax", log=False)
#: ``torch.ops.smx.log_softmax``: as :data:`softmax_op`, with log-softmax.
log_softmax_op = _define("log_softmax", log=True)
