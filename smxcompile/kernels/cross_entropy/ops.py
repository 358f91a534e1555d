"""The cross-entropy custom ops, their fake kernels and autograd:

* ``smx::linear_ce_stats`` / ``smx::linear_ce_backward``: the row statistics of ``input @ weight.T + bias``
  and their gradients; ``smx::ce_stats`` / ``smx::ce_backward``: the same for given logits. CUDA: the Triton
  kernels (:mod:`.triton_forward`, :mod:`.triton_backward`, imported on first use); otherwise the chunked
  torch path (:mod:`.chunked`).
* ``smx::linear_ce_loss``: the CPU training path, loss and gradients in one pass (:mod:`.fused`), and
  ``smx::linear_add_logits_grad_``, its backward's extra term when the returned logits are used.
* ``smx::linear_ce_stats_argmax`` / ``smx::linear_ce_loss_argmax``: ``linear_ce_stats`` / ``linear_ce_loss``
  (class-index targets, no returned logits) plus each row's argmax, taken from the same logit chunks / tiles
  (``return_token_accuracy`` / ``return_predicted_tokens`` of the public function). Separate ops so that the
  others keep the schema the exporters and decompositions know.
"""

from __future__ import annotations

import torch

from .. import config
from ..common import acc_dtype
from .chunked import empty_contiguous, torch_backward, torch_forward
from .fused import add_logits_grad, fused_forward, saved_grad_dtype

__all__ = ["linear_ce_stats", "linear_ce_backward", "ce_stats", "ce_backward", "linear_ce_loss",
           "linear_add_logits_grad_", "coefs", "linear_ce_stats_argmax", "linear_ce_loss_argmax"]


def _use_triton(t: torch.Tensor, probs) -> bool:
    """The Triton kernels take class-index targets on CUDA (or under ``config.force_triton``)."""
    return probs is None and config.use_triton(t)


@torch.library.custom_op("smx::linear_ce_stats", mutates_args=())
def linear_ce_stats(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    probs: torch.Tensor | None,
    class_weight: torch.Tensor | None,
    ignore_index: int,
    scale: float,
    softcap: float | None,
    need_weighted_sum: bool,
    return_logits: bool,
    logits_dtype: torch.dtype | None,
    chunk_bytes: int,
    filter_eps: float | None = None,
    precise_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``torch.ops.smx.linear_ce_stats``: the row statistics of ``z = transform(input @ weight.T + bias)``
    (input (N, D), weight (V, D), bias (V,) or None; target (N,) int64 or probs (N, V)) -> ``(lse,
    target_logit, other_mass, weighted_sum or empty, logits or empty)``, (N,) fp32 (fp64) each, the logits
    (N, V) in ``logits_dtype`` when ``return_logits``. Differentiable w.r.t. input, weight, bias (and the
    returned logits); ``filter_eps`` and ``precise_grad`` are the backward's (:func:`linear_ce_backward`)."""
    n, v = input.shape[0], weight.shape[0]
    logits_out = None
    if return_logits:
        logits_out = torch.empty((n, v), dtype=logits_dtype or input.dtype, device=input.device)
    if _use_triton(input, probs):
        from .triton_forward import lce_forward

        lse, tl, om, ws = lce_forward(input, weight, bias, target, ignore_index=ignore_index, scale=scale,
                                      softcap=softcap, class_weight=class_weight,
                                      need_weighted_sum=need_weighted_sum, logits_out=logits_out)
    else:
        lse, tl, om, ws = torch_forward(input, weight, bias, target, probs, class_weight=class_weight,
                                        ignore_index=ignore_index, scale=scale, softcap=softcap,
                                        need_ws=need_weighted_sum, logits_out=logits_out, chunk_bytes=chunk_bytes)
    if ws is None:
        ws = lse.new_empty(0)
    return lse, tl, om, ws, (logits_out if logits_out is not None else input.new_empty(0))


@linear_ce_stats.register_fake
def _(input, weight, bias, target, probs, class_weight, ignore_index, scale, softcap, need_weighted_sum,
      return_logits, logits_dtype, chunk_bytes, filter_eps=None, precise_grad=False):
    n, v = input.shape[0], weight.shape[0]
    acc = acc_dtype(input)
    vec = input.new_empty(n, dtype=acc)
    ws = input.new_empty(n if need_weighted_sum else 0, dtype=acc)
    shape, dtype = ((n, v), logits_dtype or input.dtype) if return_logits else ((0,), input.dtype)
    logits = input.new_empty(shape, dtype=dtype)
    return vec, input.new_empty(n, dtype=acc), input.new_empty(n, dtype=acc), ws, logits


@torch.library.custom_op("smx::linear_ce_backward", mutates_args=())
def linear_ce_backward(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    probs: torch.Tensor | None,
    class_weight: torch.Tensor | None,
    lse: torch.Tensor,
    other_mass: torch.Tensor,
    coef_a: torch.Tensor,
    coef_b: torch.Tensor,
    coef_c: torch.Tensor | None,
    ignore_index: int,
    scale: float,
    softcap: float | None,
    logits: torch.Tensor | None,
    grad_logits: torch.Tensor | None,
    filter_eps: float | None,
    need_input_grad: bool,
    need_weight_grad: bool,
    need_bias_grad: bool,
    chunk_bytes: int,
    precise_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``torch.ops.smx.linear_ce_backward``: the gradients ``(grad_input, grad_weight, grad_bias)`` of
    ``sum_i a_i lse_i - b_i z_{i,y_i} - c_i weighted_sum_i`` (``coef_a``, ``coef_b``, ``coef_c``: (N,)), plus
    ``grad_logits`` (N, V) w.r.t. the returned logits, recomputing the logits; empty tensors for the
    gradients not asked for."""
    if _use_triton(input, probs):
        from .triton_backward import lce_backward

        gi, gw, gb = lce_backward(input, weight, bias, target, lse, other_mass, coef_a, coef_b, coef_c,
                                  ignore_index=ignore_index, scale=scale, softcap=softcap,
                                  class_weight=class_weight,
                                  # saved logits rounded below fp32 would disagree with the fp32 lse: recompute
                                  logits=logits if logits is not None and logits.dtype == torch.float32 else None,
                                  grad_logits=grad_logits,
                                  filter_eps=filter_eps, precise_grad=precise_grad, need_input_grad=need_input_grad,
                                  need_weight_grad=need_weight_grad, need_bias_grad=need_bias_grad)
    else:
        gi, gw, gb = torch_backward(input, weight, bias, target, probs, class_weight=class_weight, lse=lse,
                                    om=other_mass, a=coef_a, b=coef_b, c=coef_c, ignore_index=ignore_index,
                                    scale=scale, softcap=softcap, logits=logits, grad_logits=grad_logits,
                                    needs=(need_input_grad, need_weight_grad, need_bias_grad),
                                    chunk_bytes=chunk_bytes)
    gi = gi.contiguous() if gi is not None else input.new_empty(0)
    gw = gw.to(weight.dtype) if gw is not None else weight.new_empty(0)
    gb = gb.to(bias.dtype) if (gb is not None and bias is not None) else weight.new_empty(0)
    return gi, gw, gb


@linear_ce_backward.register_fake
def _(input, weight, bias, target, probs, class_weight, lse, other_mass, coef_a, coef_b, coef_c, ignore_index,
      scale, softcap, logits, grad_logits, filter_eps, need_input_grad, need_weight_grad, need_bias_grad,
      chunk_bytes, precise_grad=False):
    gi = empty_contiguous(input) if need_input_grad else input.new_empty(0)
    gw = empty_contiguous(weight) if need_weight_grad else weight.new_empty(0)
    gb = empty_contiguous(bias) if (need_bias_grad and bias is not None) else weight.new_empty(0)
    return gi, gw, gb


def _lce_setup(ctx, inputs, output):
    (input, weight, bias, target, probs, class_weight, ignore_index, scale, softcap, need_ws, return_logits,
     logits_dtype, chunk_bytes, filter_eps, precise_grad) = inputs
    lse, tl, om, ws, logits = output
    ctx.args = (ignore_index, scale, softcap, chunk_bytes, filter_eps, precise_grad)
    ctx.has_bias = bias is not None
    ctx.return_logits = return_logits
    ctx.save_for_backward(input, weight, bias, target, probs, class_weight, lse, om,
                          logits if return_logits else None)


def coefs(lse, grad_lse, grad_tl, grad_ws):
    """The backward's per-row coefficients ``(a, b, c or None)`` (in ``lse``'s dtype) from the gradients of the
    statistics (lse, target logit, weighted sum; None for an unused output): ``a = grad_lse``, ``b = -grad_tl``,
    ``c = -grad_ws`` (docs/DESIGN.md, "Cross-entropy: the statistics and the backward's coefficients")."""
    a = grad_lse if grad_lse is not None else torch.zeros_like(lse)
    b = -grad_tl if grad_tl is not None else torch.zeros_like(lse)
    c = -grad_ws if (grad_ws is not None and grad_ws.numel()) else None
    return a.to(lse.dtype), b.to(lse.dtype), (c.to(lse.dtype) if c is not None else None)


def _lce_backward(ctx, grad_lse, grad_tl, grad_om, grad_ws, grad_logits):
    input, weight, bias, target, probs, class_weight, lse, om, logits = ctx.saved_tensors
    ignore_index, scale, softcap, chunk_bytes, filter_eps, precise_grad = ctx.args
    a, b, c = coefs(lse, grad_lse, grad_tl, grad_ws)
    if grad_logits is not None and (not ctx.return_logits or grad_logits.numel() == 0):
        grad_logits = None
    need_in, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    need_b = ctx.has_bias and ctx.needs_input_grad[2]
    gi, gw, gb = linear_ce_backward(
        input, weight, bias, target, probs, class_weight=class_weight, lse=lse, other_mass=om, coef_a=a, coef_b=b,
        coef_c=c, ignore_index=ignore_index, scale=scale, softcap=softcap, logits=logits, grad_logits=grad_logits,
        filter_eps=filter_eps, need_input_grad=need_in, need_weight_grad=need_w, need_bias_grad=need_b,
        chunk_bytes=chunk_bytes, precise_grad=precise_grad)
    return (gi if need_in else None, gw if need_w else None, gb if need_b else None, *[None] * 12)


linear_ce_stats.register_autograd(_lce_backward, setup_context=_lce_setup)


@torch.library.custom_op("smx::linear_ce_stats_argmax", mutates_args=())
def linear_ce_stats_argmax(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    class_weight: torch.Tensor | None,
    ignore_index: int,
    scale: float,
    softcap: float | None,
    need_weighted_sum: bool,
    chunk_bytes: int,
    filter_eps: float | None = None,
    precise_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``torch.ops.smx.linear_ce_stats_argmax``: :func:`linear_ce_stats` (class-index ``target``, no returned
    logits) -> ``(lse, target_logit, other_mass, weighted_sum or empty, argmax)``, ``argmax`` (N,) int64: the
    first maximum of each row of ``z`` (every row, ignored ones too), from the same pass. Differentiable
    w.r.t. input, weight, bias (not through ``argmax``)."""
    n = input.shape[0]
    am = torch.zeros(n, dtype=torch.int64, device=input.device)
    if _use_triton(input, None):
        from .triton_forward import lce_forward

        lse, tl, om, ws, am = lce_forward(input, weight, bias, target, ignore_index=ignore_index, scale=scale,
                                          softcap=softcap, class_weight=class_weight,
                                          need_weighted_sum=need_weighted_sum, return_argmax=True)
    else:
        lse, tl, om, ws = torch_forward(input, weight, bias, target, None, class_weight=class_weight,
                                        ignore_index=ignore_index, scale=scale, softcap=softcap,
                                        need_ws=need_weighted_sum, logits_out=None, chunk_bytes=chunk_bytes,
                                        argmax_out=am)
    return lse, tl, om, (ws if ws is not None else lse.new_empty(0)), am


@linear_ce_stats_argmax.register_fake
def _(input, weight, bias, target, class_weight, ignore_index, scale, softcap, need_weighted_sum, chunk_bytes,
      filter_eps=None, precise_grad=False):
    n = input.shape[0]
    acc = acc_dtype(input)
    return (input.new_empty(n, dtype=acc), input.new_empty(n, dtype=acc), input.new_empty(n, dtype=acc),
            input.new_empty(n if need_weighted_sum else 0, dtype=acc), input.new_empty(n, dtype=torch.int64))


def _lcea_setup(ctx, inputs, output):
    (input, weight, bias, target, class_weight, ignore_index, scale, softcap, need_ws, chunk_bytes, filter_eps,
     precise_grad) = inputs
    lse, tl, om, ws, am = output
    ctx.args = (ignore_index, scale, softcap, chunk_bytes, filter_eps, precise_grad)
    ctx.has_bias = bias is not None
    ctx.return_logits = False
    ctx.mark_non_differentiable(am)
    ctx.save_for_backward(input, weight, bias, target, None, class_weight, lse, om, None)


def _lcea_backward(ctx, grad_lse, grad_tl, grad_om, grad_ws, _grad_am):
    # the saved tensors and ctx fields are linear_ce_stats' (no probs, no logits): its backward, 12 inputs
    return _lce_backward(ctx, grad_lse, grad_tl, grad_om, grad_ws, None)[:12]


linear_ce_stats_argmax.register_autograd(_lcea_backward, setup_context=_lcea_setup)


@torch.library.custom_op("smx::ce_stats", mutates_args=())
def ce_stats(
    logits: torch.Tensor,
    target: torch.Tensor,
    probs: torch.Tensor | None,
    class_weight: torch.Tensor | None,
    ignore_index: int,
    scale: float,
    softcap: float | None,
    need_weighted_sum: bool,
    chunk_bytes: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``torch.ops.smx.ce_stats``: the row statistics of the given (N, V) logits (any float dtype and strides),
    as :func:`linear_ce_stats` without the matmul and the returned logits. Differentiable w.r.t. logits."""
    if _use_triton(logits, probs):
        from .triton_forward import ce_forward

        lse, tl, om, ws = ce_forward(logits, target, ignore_index=ignore_index, scale=scale, softcap=softcap,
                                     class_weight=class_weight, need_weighted_sum=need_weighted_sum)
    else:
        lse, tl, om, ws = torch_forward(logits, None, None, target, probs, class_weight=class_weight,
                                        ignore_index=ignore_index, scale=scale, softcap=softcap,
                                        need_ws=need_weighted_sum, logits_out=None, chunk_bytes=chunk_bytes,
                                        logits=logits)
    return lse, tl, om, (ws if ws is not None else lse.new_empty(0))


@ce_stats.register_fake
def _(logits, target, probs, class_weight, ignore_index, scale, softcap, need_weighted_sum, chunk_bytes):
    n = logits.shape[0]
    acc = acc_dtype(logits)
    return (logits.new_empty(n, dtype=acc), logits.new_empty(n, dtype=acc), logits.new_empty(n, dtype=acc),
            logits.new_empty(n if need_weighted_sum else 0, dtype=acc))


@torch.library.custom_op("smx::ce_backward", mutates_args=())
def ce_backward(
    logits: torch.Tensor,
    target: torch.Tensor,
    probs: torch.Tensor | None,
    class_weight: torch.Tensor | None,
    lse: torch.Tensor,
    other_mass: torch.Tensor,
    coef_a: torch.Tensor,
    coef_b: torch.Tensor,
    coef_c: torch.Tensor | None,
    ignore_index: int,
    scale: float,
    softcap: float | None,
    chunk_bytes: int,
) -> torch.Tensor:
    """``torch.ops.smx.ce_backward``: the gradient w.r.t. the (N, V) logits of :func:`ce_stats`' statistics
    (coefficients as :func:`linear_ce_backward`), in the logits' dtype."""
    if _use_triton(logits, probs):
        from .triton_backward import ce_backward as triton_ce_backward

        return triton_ce_backward(logits, target, lse, other_mass, coef_a, coef_b, coef_c, ignore_index=ignore_index,
                                  scale=scale, softcap=softcap, class_weight=class_weight, out_dtype=logits.dtype)
    return torch_backward(logits, logits, None, target, probs, class_weight=class_weight, lse=lse, om=other_mass,
                          a=coef_a, b=coef_b, c=coef_c, ignore_index=ignore_index, scale=scale, softcap=softcap,
                          logits=None, grad_logits=None, needs=(False, False, False), chunk_bytes=chunk_bytes,
                          raw_logits=logits)


@ce_backward.register_fake
def _(logits, target, probs, class_weight, lse, other_mass, coef_a, coef_b, coef_c, ignore_index, scale, softcap,
      chunk_bytes):
    return torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)


def _ce_setup(ctx, inputs, output):
    logits, target, probs, class_weight, ignore_index, scale, softcap, need_ws, chunk_bytes = inputs
    lse, tl, om, ws = output
    ctx.args = (ignore_index, scale, softcap, chunk_bytes)
    ctx.save_for_backward(logits, target, probs, class_weight, lse, om)


def _ce_backward_autograd(ctx, grad_lse, grad_tl, grad_om, grad_ws):
    logits, target, probs, class_weight, lse, om = ctx.saved_tensors
    ignore_index, scale, softcap, chunk_bytes = ctx.args
    a, b, c = coefs(lse, grad_lse, grad_tl, grad_ws)
    g = ce_backward(logits, target, probs, class_weight, lse=lse, other_mass=om, coef_a=a, coef_b=b, coef_c=c,
                    ignore_index=ignore_index, scale=scale, softcap=softcap, chunk_bytes=chunk_bytes)
    return g, None, None, None, None, None, None, None, None


ce_stats.register_autograd(_ce_backward_autograd, setup_context=_ce_setup)


@torch.library.custom_op("smx::linear_ce_loss", mutates_args=())
def linear_ce_loss(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    class_weight: torch.Tensor | None,
    token_weight: torch.Tensor | None,
    ignore_index: int,
    reduction: str,
    label_smoothing: float,
    lse_square_scale: float,
    scale: float,
    softcap: float | None,
    return_logits: bool,
    logits_dtype: torch.dtype | None,
    chunk_bytes: int,
    filter_eps: float | None = None,
    precise_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``torch.ops.smx.linear_ce_loss``: (loss, z_loss, logits, grad_input, grad_weight, grad_bias) for
    grad_output = 1 (:func:`~.fused.fused_forward`; CUDA, without returned logits:
    :func:`~.triton_fused.fused_forward_gemm`, which takes ``filter_eps`` and ``precise_grad``); fp32 loss,
    differentiable w.r.t. input, weight, bias; gradients in :func:`~.fused.saved_grad_dtype`, the bias's in fp32
    (fp64 for fp64)."""
    n, v = input.shape[0], weight.shape[0]
    if config.use_triton(input) and not return_logits and input.shape[1] > 0:   # (D = 0: no chunk to run)
        from .triton_fused import fused_forward_gemm

        loss, zl, _, gi, gw, gb = fused_forward_gemm(
            input, weight, bias, target, class_weight=class_weight, token_weight=token_weight,
            ignore_index=ignore_index, reduction=reduction, eps=label_smoothing, z_scale=lse_square_scale,
            scale=scale, softcap=softcap, chunk_bytes=chunk_bytes, filter_eps=filter_eps, precise_grad=precise_grad)
        return (loss.float(), (zl if zl is not None else loss.new_zeros(())).float(), input.new_empty(0), gi, gw,
                gb if gb is not None else weight.new_empty(0))
    logits_out = None
    if return_logits:
        logits_out = torch.empty((n, v), dtype=logits_dtype or input.dtype, device=input.device)
    loss, zl, _, gi, gw, gb = fused_forward(input, weight, bias, target, class_weight=class_weight,
                                            token_weight=token_weight, ignore_index=ignore_index,
                                            reduction=reduction, eps=label_smoothing, z_scale=lse_square_scale,
                                            scale=scale, softcap=softcap, logits_out=logits_out,
                                            chunk_bytes=chunk_bytes)
    acc = acc_dtype(input)
    return (loss.to(acc), (zl if zl is not None else loss.new_zeros(())).to(acc),
            logits_out if logits_out is not None else input.new_empty(0), gi, gw,
            gb if gb is not None else weight.new_empty(0))


@linear_ce_loss.register_fake
def _(input, weight, bias, target, class_weight, token_weight, ignore_index, reduction, label_smoothing,
      lse_square_scale, scale, softcap, return_logits, logits_dtype, chunk_bytes, filter_eps=None,
      precise_grad=False):
    acc = acc_dtype(input)
    n, v = input.shape[0], weight.shape[0]
    logits = input.new_empty((n, v), dtype=logits_dtype or input.dtype) if return_logits else input.new_empty(0)
    return (input.new_empty((), dtype=acc), input.new_empty((), dtype=acc), logits,
            empty_contiguous(input, saved_grad_dtype(input.dtype)),
            empty_contiguous(weight, saved_grad_dtype(weight.dtype)),
            empty_contiguous(bias, acc) if bias is not None else weight.new_empty(0))


@torch.library.custom_op("smx::linear_add_logits_grad_", mutates_args=("grad_input", "grad_weight", "grad_bias"))
def linear_add_logits_grad_(
    grad_logits: torch.Tensor,
    logits: torch.Tensor,
    input: torch.Tensor,
    weight: torch.Tensor,
    grad_loss: torch.Tensor,
    saved_input_grad: torch.Tensor,
    saved_weight_grad: torch.Tensor,
    saved_bias_grad: torch.Tensor | None,
    grad_input: torch.Tensor,
    grad_weight: torch.Tensor,
    grad_bias: torch.Tensor | None,
    scale: float,
    softcap: float | None,
    chunk_bytes: int,
) -> None:
    """Add the gradient ``grad_logits`` of the (N, V) logits the fused op returned to the linear layer's
    gradients, in place: nothing when it is zero (the usual case: nothing used them); else ``G @ weight``,
    ``G^T @ input`` and ``G.sum(0)`` added chunk by chunk, in fp32, to ``saved * grad_loss``, overwriting them."""
    add_logits_grad(grad_logits, logits, input, weight, grad_loss, saved_gi=saved_input_grad,
                    saved_gw=saved_weight_grad, saved_gb=saved_bias_grad, grad_input=grad_input,
                    grad_weight=grad_weight, grad_bias=grad_bias, scale=scale, softcap=softcap,
                    chunk_bytes=chunk_bytes)


def _fused_setup(ctx, inputs, output):
    (input, weight, bias, target, class_weight, token_weight, ignore_index, reduction, label_smoothing,
     lse_square_scale, scale, softcap, return_logits, logits_dtype, chunk_bytes, *_) = inputs
    loss, zl, logits, gi, gw, gb = output
    ctx.has_bias = bias is not None
    ctx.return_logits = return_logits
    ctx.args = (scale, softcap, chunk_bytes)
    ctx.save_for_backward(gi, gw, gb if bias is not None else None, logits if return_logits else None,
                          input, weight)


def _fused_backward(ctx, grad_loss, grad_zl, grad_logits, _gi, _gw, _gb):
    saved_gi, saved_gw, saved_gb, logits, input, weight = ctx.saved_tensors
    scale, softcap, chunk_bytes = ctx.args
    # Scale the gradients the forward computed by grad_loss: plain pointwise torch ops (fp32 math, one
    # rounding), so that under torch.compile Inductor can write the result into the saved buffer.
    acc = acc_dtype(input)
    if torch.is_grad_enabled():
        # backward(create_graph=True): the gradients were computed in the forward and are constants here;
        # scaling them would silently give zero second-order gradients
        raise RuntimeError(
            "double backward (create_graph=True) through smxcompile.linear_cross_entropy is not supported "
            "with reduction='mean'/'sum'; use F.cross_entropy(F.linear(...)) for higher-order gradients")
    gl = grad_loss.reshape(()).to(acc)
    gi = (saved_gi.to(acc) * gl).to(input.dtype)
    gw = (saved_gw.to(acc) * gl).to(weight.dtype)
    gb = (saved_gb.to(acc) * gl).to(weight.dtype) if saved_gb is not None else None
    if ctx.return_logits and grad_logits is not None and grad_logits.numel():
        # a returned logits tensor that something used: its gradient is added (nothing when it is zero)
        linear_add_logits_grad_(grad_logits, logits, input, weight, grad_loss, saved_input_grad=saved_gi,
                                saved_weight_grad=saved_gw, saved_bias_grad=saved_gb, grad_input=gi, grad_weight=gw,
                                grad_bias=gb, scale=scale, softcap=softcap, chunk_bytes=chunk_bytes)
    return ((gi if ctx.needs_input_grad[0] else None, gw if ctx.needs_input_grad[1] else None,
             gb if (ctx.has_bias and ctx.needs_input_grad[2]) else None) + (None,) * (len(ctx.needs_input_grad) - 3))


linear_ce_loss.register_autograd(_fused_backward, setup_context=_fused_setup)


@torch.library.custom_op("smx::linear_ce_loss_argmax", mutates_args=())
def linear_ce_loss_argmax(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    class_weight: torch.Tensor | None,
    token_weight: torch.Tensor | None,
    ignore_index: int,
    reduction: str,
    label_smoothing: float,
    lse_square_scale: float,
    scale: float,
    softcap: float | None,
    chunk_bytes: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``torch.ops.smx.linear_ce_loss_argmax``: :func:`linear_ce_loss` without returned logits, plus each row's
    first maximum of ``z``: ``(loss, z_loss, argmax, grad_input, grad_weight, grad_bias)``, ``argmax`` (N,)
    int64, -1 on the ignored rows (the fused path skips them)."""
    am = torch.full((input.shape[0],), -1, dtype=torch.int64, device=input.device)
    loss, zl, _, gi, gw, gb = fused_forward(input, weight, bias, target, class_weight=class_weight,
                                            token_weight=token_weight, ignore_index=ignore_index,
                                            reduction=reduction, eps=label_smoothing, z_scale=lse_square_scale,
                                            scale=scale, softcap=softcap, logits_out=None, chunk_bytes=chunk_bytes,
                                            argmax_out=am)
    acc = acc_dtype(input)
    return (loss.to(acc), (zl if zl is not None else loss.new_zeros(())).to(acc), am, gi, gw,
            gb if gb is not None else weight.new_empty(0))


@linear_ce_loss_argmax.register_fake
def _(input, weight, bias, target, class_weight, token_weight, ignore_index, reduction, label_smoothing,
      lse_square_scale, scale, softcap, chunk_bytes):
    acc = acc_dtype(input)
    return (input.new_empty((), dtype=acc), input.new_empty((), dtype=acc),
            input.new_empty(input.shape[0], dtype=torch.int64),
            empty_contiguous(input, saved_grad_dtype(input.dtype)),
            empty_contiguous(weight, saved_grad_dtype(weight.dtype)),
            empty_contiguous(bias, acc) if bias is not None else weight.new_empty(0))


def _fused_argmax_setup(ctx, inputs, output):
    (input, weight, bias, target, class_weight, token_weight, ignore_index, reduction, label_smoothing,
     lse_square_scale, scale, softcap, chunk_bytes) = inputs
    loss, zl, am, gi, gw, gb = output
    ctx.has_bias = bias is not None
    ctx.return_logits = False
    ctx.args = (scale, softcap, chunk_bytes)
    ctx.mark_non_differentiable(am)
    ctx.save_for_backward(gi, gw, gb if bias is not None else None, None, input, weight)


def _fused_argmax_backward(ctx, grad_loss, grad_zl, _grad_am, _gi, _gw, _gb):
    # linear_ce_loss' backward (the same saved tensors, no logits), for 13 inputs
    return _fused_backward(ctx, grad_loss, grad_zl, None, _gi, _gw, _gb)[:13]


linear_ce_loss_argmax.register_autograd(_fused_argmax_backward, setup_context=_fused_argmax_setup)
