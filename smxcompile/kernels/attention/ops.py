"""``smx::attention`` and ``smx::attention_backward``: the custom ops, fake kernels and autograd; CUDA runs the
Triton kernels (imported on first use), CPU and fp64 the torch path (:mod:`.torch_path`)."""

from __future__ import annotations

import torch

from .. import config
from .torch_path import torch_backward, torch_forward

__all__ = ["attention_op", "AttentionError"]


class AttentionError(ValueError, RuntimeError):
    """Bad arguments to :func:`attention`: a ``ValueError`` that is also a ``RuntimeError`` (what
    ``F.scaled_dot_product_attention`` raises for the same mistakes)."""


def _seed_int(seed: torch.Tensor | None) -> int:
    return 0 if seed is None else int(seed.item())


def _stats_like(q: torch.Tensor) -> torch.Tensor:
    B, Hq, L, _ = q.shape
    return torch.zeros((B, Hq, L, 2), dtype=torch.float32, device=q.device)


@torch.library.custom_op("smx::attention", mutates_args=())
def attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    scale: float,
    softcap: float | None,
    normalizer: str,
    norm_param: torch.Tensor | None,
    dropout_p: float,
    seed: torch.Tensor | None,
    skip_threshold: float | None = None,
    n_keys: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B, Hq, L, E), k (B, Hkv, S, E), v (B, Hkv, S, Ev), attn_mask None or broadcastable to
    (B, Hq, L, S) (bool or float), norm_param None or (B, Hq) in the accumulation dtype, seed None or an
    int64 0-d tensor (the dropout seed: a tensor, so a compiled graph draws a fresh one every call).
    Returns out (B, Hq, L, Ev) in q.dtype, contiguous, and stats (B, Hq, L, 2) fp32 (zeros on the torch path)."""
    seed = _seed_int(seed)
    if config.use_triton(q) and q.numel() and k.shape[2]:
        from .triton_forward import attention_forward

        mask = None if attn_mask is None else attn_mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        out, stats = attention_forward(q.contiguous(), k.contiguous(), v.contiguous(), mask, is_causal, scale,
                                       softcap, normalizer,
                                       None if norm_param is None else norm_param.float().contiguous(),
                                       dropout_p, seed, skip_threshold=skip_threshold, n_keys=n_keys)
        return out.contiguous(), stats.contiguous()
    if skip_threshold is not None:
        raise AttentionError("skip_threshold (BLASST tile skipping) runs in the CUDA Triton kernel only; "
                             "this call is on the CPU / fp64 path")
    out = torch_forward(q, k, v, attn_mask, is_causal, scale, softcap, normalizer, norm_param, dropout_p, seed,
                        n_keys)
    return out, _stats_like(q)


@attention_op.register_fake
def _(q, k, v, attn_mask, is_causal, scale, softcap, normalizer, norm_param, dropout_p, seed, skip_threshold=None,
      n_keys=None):
    B, Hq, L, _ = q.shape
    out = q.new_empty((B, Hq, L, v.shape[3]))
    return out, q.new_empty((B, Hq, L, 2), dtype=torch.float32)


@torch.library.custom_op("smx::attention_backward", mutates_args=())
def _attention_backward_op(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    stats: torch.Tensor,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    scale: float,
    softcap: float | None,
    normalizer: str,
    norm_param: torch.Tensor | None,
    dropout_p: float,
    seed: torch.Tensor | None,
    n_keys: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of ``smx::attention``: dq, dk, dv (dtypes and shapes of q, k, v, contiguous) and
    dnorm_param (shape and dtype of norm_param; an empty fp32 tensor when norm_param is None)."""
    seed = _seed_int(seed)
    if config.use_triton(q) and q.numel() and k.shape[2]:
        from .triton_backward import attention_backward

        mask = None if attn_mask is None else attn_mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        dq, dk, dv, dp = attention_backward(grad_out.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(),
                                            out, stats, mask, is_causal, scale, softcap, normalizer,
                                            None if norm_param is None else norm_param.float().contiguous(),
                                            dropout_p, seed, n_keys=n_keys)
    else:
        dq, dk, dv, dp = torch_backward(grad_out, q, k, v, attn_mask, is_causal, scale, softcap, normalizer,
                                        norm_param, dropout_p, seed, n_keys)
    if norm_param is None:
        dp = q.new_empty(0, dtype=torch.float32)
    elif dp is None:
        dp = torch.zeros_like(norm_param, memory_format=torch.contiguous_format)
    else:
        dp = dp.to(norm_param.dtype).reshape(norm_param.shape).contiguous()
    return (dq.to(q.dtype).contiguous(), dk.to(k.dtype).contiguous(), dv.to(v.dtype).contiguous(), dp)


@_attention_backward_op.register_fake
def _(grad_out, q, k, v, out, stats, attn_mask, is_causal, scale, softcap, normalizer, norm_param, dropout_p, seed,
      n_keys=None):
    dp = q.new_empty(0, dtype=torch.float32) if norm_param is None else norm_param.new_empty(norm_param.shape)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dp


def _setup_context(ctx, inputs, output):
    q, k, v, attn_mask, is_causal, scale, softcap, normalizer, norm_param, dropout_p, seed, _skip, n_keys = inputs
    out, stats = output
    ctx.mark_non_differentiable(stats)
    ctx.args = (is_causal, scale, softcap, normalizer, dropout_p)
    ctx.save_for_backward(q, k, v, out, stats, attn_mask, norm_param, seed, n_keys)


def _backward(ctx, grad_out, _grad_stats):
    q, k, v, out, stats, attn_mask, norm_param, seed, n_keys = ctx.saved_tensors
    is_causal, scale, softcap, normalizer, dropout_p = ctx.args
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    dq, dk, dv, dp = _attention_backward_op(grad_out, q, k, v, out, stats, attn_mask, is_causal, scale, softcap,
                                            normalizer, norm_param, dropout_p, seed, n_keys)
    need = ctx.needs_input_grad
    return (dq if need[0] else None, dk if need[1] else None, dv if need[2] else None, None, None, None, None, None,
            dp if (norm_param is not None and need[8]) else None, None, None, None, None)


attention_op.register_autograd(_backward, setup_context=_setup_context)
