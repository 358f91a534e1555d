"""The "gemm" mode of :func:`~.triton_backward.lce_backward`: the gradients of the fused linear + cross-entropy by
row chunks, the products done by matmuls (cuBLAS on a GPU) instead of per-tile atomics.

Per chunk of rows (as Liger-Kernel's ``fused_linear_cross_entropy``): the fp32 logits ``input[r0:r1] @ weight.T``,
their gradient ``G`` written once by the caller's Triton kernel, then ``grad_input[r0:r1] = G @ weight``,
``grad_weight += G.T @ input[r0:r1]`` and ``grad_bias += G.sum(0)``, accumulated in fp32. The logits stay fp32
(what the forward's statistics came from, so ``G`` keeps Cut Cross-Entropy's collapse-safe target entry); with
fp16 / bf16 inputs ``G`` is rounded to the input dtype once, or split into ``hi + lo`` (``split=True``). On CPU
(Triton's interpreter) the 16-bit operands are upcast. See docs/DESIGN.md, "Cross-entropy: the gemm backward".
"""

from __future__ import annotations

import torch

from ..common import HALF_DTYPES, autocast_off
from ..triton_helpers import planned_sms
from .chunked import DEFAULT_CHUNK_BYTES

__all__ = ["GEMM_CHUNK_BYTES", "ROW_ALIGN", "COMPACT_KEPT_SHARE", "gemm_rows", "kept_columns", "mm_into",
           "addmm_into", "chunked_gemm_backward"]

#: Default bytes of one chunk's temporaries (fp32 logits + ``G``) on a GPU (CPU: :data:`~.chunked.DEFAULT_CHUNK_BYTES`):
#: large chunks amortize re-reading ``weight`` and the fp32 ``grad_weight`` accumulator once per chunk.
GEMM_CHUNK_BYTES = 2**30
#: Chunks of at least two of these many rows are rounded down to a multiple of it (whole GEMM tiles).
ROW_ALIGN = 128

#: Gradient filtering in the gemm mode: a chunk's kept columns are gathered when at most this share of the
#: vocabulary is kept, else the products run over every column (docs/DESIGN.md, "Cross-entropy": the cost model).
COMPACT_KEPT_SHARE = 0.75

#: Whether ``torch.addmm(..., out_dtype=torch.float32)`` (an fp32 accumulator with 16-bit operands) worked on
#: CUDA; set to False after its first failure (an older torch), which falls back to upcast operands.
_ADDMM_OUT_DTYPE = {"ok": True}


def _gpu(device: torch.device) -> bool:
    """A CUDA device, or launches planned as on one (:func:`~..triton_helpers.plan_for_sms`, for byte counts)."""
    return device.type == "cuda" or planned_sms(device) is not None


def gemm_rows(n: int, v: int, bytes_per_entry: int, chunk_bytes: int | None, device: torch.device) -> int:
    """Rows per chunk: ``chunk_bytes`` (None / 0: :data:`GEMM_CHUNK_BYTES` on a GPU, else
    :data:`~.chunked.DEFAULT_CHUNK_BYTES`) over ``v * bytes_per_entry`` (the chunk's temporaries per logit), at
    least 1 and at most ``max(n, 1)``; rounded down to a multiple of :data:`ROW_ALIGN` when that many fit twice."""
    budget = chunk_bytes or (GEMM_CHUNK_BYTES if _gpu(device) else DEFAULT_CHUNK_BYTES)
    rows = max(1, budget // max(1, v * bytes_per_entry))
    if rows >= 2 * ROW_ALIGN:
        rows -= rows % ROW_ALIGN
    return min(rows, max(n, 1))


def kept_columns(kept: torch.Tensor | None, V: int) -> torch.Tensor | None:
    """The indices (int64) of the columns flagged in ``kept`` (``(V,)`` int8, 1 = kept), or None for all of them
    (``kept`` None, or more than :data:`COMPACT_KEPT_SHARE` of ``V`` kept). Synchronizes with the device."""
    if kept is None:
        return None
    cols = kept.nonzero().squeeze(1)
    return None if cols.numel() > COMPACT_KEPT_SHARE * V else cols


def mm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``out = a @ b`` with fp32 accumulation; ``a``, ``b`` (any strides) share a dtype, ``out`` is fp32 or that
    dtype. On CUDA one cuBLAS call (``out_dtype=torch.float32`` for 16-bit operands into fp32); on CPU the
    operands are upcast. Returns ``out``."""
    if _gpu(a.device):
        if out.dtype == a.dtype:
            return torch.mm(a, b, out=out)
        try:
            return torch.mm(a, b, out_dtype=out.dtype, out=out)
        except (RuntimeError, NotImplementedError):  # planned as a GPU but run on CPU: upcast below
            if a.is_cuda:
                raise
    if out.dtype == torch.float32:
        return torch.mm(a.float(), b.float(), out=out)
    return out.copy_(torch.mm(a.float(), b.float()))


def addmm_into(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``acc += a @ b`` for an fp32 ``acc``: cuBLAS with 16-bit operands and the fp32 accumulator as C on CUDA
    (``torch.addmm(..., out_dtype=torch.float32)``; upcast operands on a torch without it); upcast on CPU."""
    if a.dtype in HALF_DTYPES and _gpu(a.device) and _ADDMM_OUT_DTYPE["ok"]:
        try:
            return torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
        except (RuntimeError, TypeError, NotImplementedError):  # pragma: no cover - torch without the overload
            if a.is_cuda:  # (on CPU planned as a GPU, only this call falls back)
                _ADDMM_OUT_DTYPE["ok"] = False
    return acc.addmm_(a.float(), b.float())


@autocast_off
def chunked_gemm_backward(input, weight, saved_logits, write_grad, *, need_input_grad: bool, need_weight_grad: bool,
                          need_bias_grad: bool, input_grad_dtype: torch.dtype, weight_grad_dtype: torch.dtype,
                          bias_grad_dtype: torch.dtype, split: bool = False, chunk_bytes: int | None = None,
                          filtering: bool = False):
    """Gradients w.r.t. ``input``, ``weight`` and the bias of a linear layer followed by a loss whose gradient
    w.r.t. the logits ``write_grad`` computes, chunk by chunk (see the module docstring).

    Args:
        input: ``(N, D)`` fp16 / bf16 / fp32, any strides. weight: ``(V, D)``, same dtype, any strides.
        saved_logits: None (each chunk's raw logits ``input[r0:r1] @ weight.T`` are computed in fp32, without
            the bias), or an ``(N, V)`` tensor whose row slices are handed to ``write_grad`` instead.
        write_grad: ``write_grad(r0, r1, src, hi, lo)`` writes ``dLoss/dx`` of rows ``r0:r1`` into ``hi``
            (``(r1 - r0, V)`` contiguous, input dtype) from ``src`` (the logits chunk or saved slice), and the
            remainder ``x - hi`` into ``lo`` when it is not None; returns None, or (``filtering``) the ``(V,)`` int8
            flags of the columns kept (:func:`kept_columns`).
        need_input_grad, need_weight_grad, need_bias_grad: which results to compute.
        input_grad_dtype, weight_grad_dtype, bias_grad_dtype: their (floating-point) dtypes.
        split: multiply ``hi`` and ``lo`` (~16 significant bits, twice the FLOPs) instead of ``G`` rounded to
            the input dtype; fp16 / bf16 inputs only.
        chunk_bytes: bytes of one chunk's temporaries (:func:`gemm_rows`), None for the default.
        filtering: ``write_grad`` returns the kept columns (gradient filtering, Wijmans et al., 2024).

    Returns:
        ``(grad_input (N, D) or None, grad_weight (V, D) or None, grad_bias (V,) or None)``, contiguous; zeros
        where nothing contributes (``N == 0``, ``V == 0``). Nothing is checked here (the caller validates).
    """
    N, D = input.shape
    V = weight.shape[0]
    dev, dt = input.device, input.dtype
    planes = 2 if split and dt in HALF_DTYPES else 1
    need_gi, need_gw = need_input_grad and D > 0, need_weight_grad and D > 0
    run = N > 0 and V > 0 and (need_gi or need_gw or need_bias_grad)
    step = gemm_rows(N, V, planes * dt.itemsize + (4 if saved_logits is None else 0), chunk_bytes, dev)
    # one product per result: written directly when its dtype allows (a compacted chunk accumulates in fp32)
    one = N <= step and planes == 1 and not filtering
    f32 = torch.float32

    def result(shape, want, direct):
        if not run:
            return torch.zeros(shape, dtype=want, device=dev)
        return torch.empty(shape, dtype=want if direct and want in (dt, f32) else f32, device=dev)

    gi = result((N, D), input_grad_dtype, planes == 1) if need_input_grad else None
    gw = result((V, D), weight_grad_dtype, one) if need_weight_grad else None
    gb = torch.zeros(V, dtype=f32 if run else bias_grad_dtype, device=dev) if need_bias_grad else None
    if run:
        rows = min(step, N)
        xbuf = torch.empty((rows, V), dtype=f32, device=dev) if saved_logits is None else None
        gbuf = torch.empty(planes * rows * V, dtype=dt, device=dev)
        for r0 in range(0, N, step):
            r1 = min(N, r0 + step)
            n = r1 - r0
            e = input[r0:r1]
            src = mm_into(xbuf[:n], e, weight.t()) if saved_logits is None else saved_logits[r0:r1]
            g = gbuf[: planes * n * V].view(planes * n, V)  # [hi; lo]: one matmul over both for grad_weight
            kept = write_grad(r0, r1, src, g[:n], g[n:] if planes == 2 else None)
            cols = kept_columns(kept, V)
            if cols is not None and gw is not None and r0 == 0:
                gw.zero_()
            g_c = g if cols is None else g.index_select(1, cols)
            if need_gi:
                w_c = weight if cols is None else weight.index_select(0, cols)
                mm_into(gi[r0:r1], g_c[:n], w_c)
                if planes == 2:
                    addmm_into(gi[r0:r1], g_c[n:], w_c)
            if need_gw:
                e2 = e if planes == 1 else torch.cat([e, e])
                if cols is not None:
                    gw.index_add_(0, cols, mm_into(torch.empty((cols.numel(), D), dtype=f32, device=dev),
                                                   g_c.t(), e2))
                else:
                    (mm_into if r0 == 0 else addmm_into)(gw, g.t(), e2)
            if need_bias_grad:
                if cols is None:
                    gb.add_(g.sum(0, dtype=f32))
                else:
                    gb.index_add_(0, cols, g_c.sum(0, dtype=f32))
    return (
        None if gi is None else gi.to(input_grad_dtype),
        None if gw is None else gw.to(weight_grad_dtype),
        None if gb is None else gb.to(bias_grad_dtype),
    )
