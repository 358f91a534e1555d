"""The CUDA body of ``smx::linear_ce_loss``: the loss of a linear layer + cross-entropy and its gradients for
``grad_output = 1``, in one pass over row chunks (Liger-Kernel's ``fused_linear_cross_entropy``; the CPU body
is :func:`~.fused.fused_forward`).

Per chunk of rows: the fp32 logits by one cuBLAS matmul, the chunk's statistics (lse, target logit, other
mass: :mod:`.triton_forward`'s kernel on the chunk), ``G`` written once in the input dtype
(:func:`~.triton_backward.write_chunk_grad`), and the products ``G @ W``, ``G^T @ E``
(:func:`~.triton_backward_gemm.chunked_gemm_backward`): ``6 N V D`` FLOPs, as torch's forward + backward,
where statistics then a recomputing backward take ``8 N V D``. The gradients wait for ``grad_output`` (a
scalar) in the backward, which only scales them.
"""

from __future__ import annotations

import torch

from ..common import autocast_off
from ..triton_helpers import launch_opts, pow2_block
from .fused import saved_grad_dtype, scalar_coefs
from .loss import check_range, compose_loss
from .triton_backward import write_chunk_grad
from .triton_backward_gemm import chunked_gemm_backward
from .triton_common import CE_BLOCKS, CE_WARPS
from .triton_forward import chunk_statistics

__all__ = ["fused_forward_gemm"]


@autocast_off
def fused_forward_gemm(input, weight, bias, target, class_weight, token_weight, ignore_index, reduction, eps,
                       z_scale, scale, softcap, *, chunk_bytes=None, filter_eps=None, precise_grad=False):
    """:func:`~.fused.fused_forward`'s contract on CUDA (no returned logits, no argmax): ``(loss, z_loss or
    None, lse (N,), grad_input, grad_weight, grad_bias or None)``, the gradients for ``grad_output = 1``.

    ``filter_eps`` (a float or None) and ``precise_grad`` are :func:`~.triton_backward.lce_backward`'s;
    ``chunk_bytes`` None or 0 for the default chunking (:func:`~.triton_backward_gemm.gemm_rows`).
    """
    n, v = target.shape[0], weight.shape[0]
    f32 = dict(dtype=torch.float32, device=input.device)
    check_range(target, ignore_index, v)
    a0, b0, c0, zc = scalar_coefs(target, v, class_weight, token_weight, ignore_index, reduction, eps, z_scale,
                                  torch.float32)
    stats = [torch.zeros(n, **f32) for _ in range(3)] + [torch.zeros(n, **f32) if eps else None]
    lse, tl, om, ws = stats

    def write_grad(r0, r1, src, hi, lo):
        rows = slice(r0, r1)
        blocks = (pow2_block("block_n", None, CE_BLOCKS[0], r1 - r0, 1),
                  pow2_block("block_v", None, CE_BLOCKS[1], v, 1), 1)
        got = chunk_statistics(src, bias, target[rows], ignore_index=ignore_index, scale=scale, softcap=softcap,
                               class_weight=class_weight, need_weighted_sum=bool(eps), blocks=blocks,
                               opts=launch_opts(None, None, CE_WARPS, None))
        for dst, val in zip(stats, got):
            if dst is not None:
                dst[rows] = val
        a = a0[rows] if zc is None else a0[rows] + zc[rows] * got[0]
        return write_chunk_grad(src, hi, lo, bias=bias, target=target[rows], class_weight=class_weight,
                                lse=got[0], om=got[2], a=a, b=b0[rows], c=None if c0 is None else c0[rows],
                                grad_logits=None, ignore_index=ignore_index, scale=scale, softcap=softcap,
                                filter_eps=None if c0 is not None else filter_eps, saved=False)

    gdt = saved_grad_dtype(input.dtype)
    gi, gw, gb = chunked_gemm_backward(
        input, weight, None, write_grad, need_input_grad=True, need_weight_grad=True,
        need_bias_grad=bias is not None, input_grad_dtype=gdt, weight_grad_dtype=saved_grad_dtype(weight.dtype),
        bias_grad_dtype=torch.float32, split=precise_grad, chunk_bytes=chunk_bytes or None,
        filtering=filter_eps is not None and c0 is None)
    loss, zl = compose_loss(lse, tl, ws, target=target, probs=None, v=v, class_weight=class_weight,
                            token_weight=token_weight, ignore_index=ignore_index, reduction=reduction,
                            label_smoothing=eps, lse_square_scale=z_scale)
    return loss, zl, lse, gi, gw, gb
