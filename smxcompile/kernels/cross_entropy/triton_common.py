"""Fused linear + cross-entropy statistics, forward and backward, in Triton: what the kernels share.

The logits ``x = input @ weight.T + bias`` are computed tile by tile and reduced on chip in fp32. Per row ``i``:
``z = scale * x`` (then ``softcap * tanh(z / softcap)``), ``lse_i``, the target logit ``z_{i,y_i}``, the other
classes' mass ``sum_{j != y_i} p_ij`` (the collapse-safe ``1 - p_target``) and optionally ``sum_j w_j z_ij``. The
backward forms ``G = a p - b onehot(y) - c w`` tile by tile, its target entry ``-a other_mass + (a - b) - c w_y``,
and ``Gx = G * dz/dx``; then ``grad_input = Gx @ weight``, ``grad_weight = Gx.T @ input``, ``grad_bias =
Gx.sum(0)``, accumulated in fp32. Pointer offsets are int64; special values (NaN, infinite logits) follow torch.
Without a GPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``; see
:mod:`smxcompile.kernels.triton_helpers`). See docs/DESIGN.md, "Cross-entropy: the Triton kernels".

Method: cut cross-entropy (Wijmans et al., 2024: logit tiles reduced on chip, a recomputing backward, gradient
filtering); the online softmax (Milakov & Gimelshein, 2018: a running ``(m, d)`` pair across vocabulary blocks,
also split across programs and merged, so ``V`` has no limit); the collapse-safe target entry (Prieto et al.,
"Grokking at the Edge of Numerical Stability", 2025).

Modules: :mod:`.triton_common` (the logit tile, argument checks), :mod:`.triton_forward` (:func:`lce_forward`,
:func:`ce_forward`), :mod:`.triton_backward` (:func:`lce_backward`, :func:`ce_backward`; its default ``"gemm"``
mode is :mod:`.triton_backward_gemm`).
"""

from __future__ import annotations

import torch

from ..common import FLOAT_DTYPES
from ..triton_helpers import tl, triton  # None without triton

__all__ = ["CE_BLOCKS", "CE_WARPS", "tensor_arg", "float_tensor", "check_target", "check_scalars",
           "check_linear", "check_class_weight"]

# Logits-given paths (no tl.dot: any block sizes).
CE_BLOCKS = (8, 1024)
CE_WARPS = 8

_MATMUL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INDEX_DTYPES = (torch.int64, torch.int32)


# --------------------------------------------------------------------------------------
# Triton helpers of both kernels
# --------------------------------------------------------------------------------------

if triton is not None:
    from ..triton_helpers import dot, tanh

    @triton.jit
    def x_tile(src_ptr, src_s0, src_s1, w_ptr, w_s0, w_s1, bias_ptr, rows, cols, row_ok, col_ok, D,
               FROM_MATMUL: tl.constexpr, HAS_BIAS: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, PREC: tl.constexpr,
               DOT_F32: tl.constexpr):
        """Raw logits ``x`` of a [BLOCK_N, BLOCK_V] tile in fp32 (0 outside the problem).

        FROM_MATMUL: ``input[rows] @ weight[cols].T (+ bias)``, ``src`` being the input (N, D);
        else ``src`` is the (N, V) logits tensor (``+ bias`` too with HAS_BIAS). ``rows``/``cols`` are int64."""
        if FROM_MATMUL:
            acc = tl.zeros([BLOCK_N, BLOCK_V], tl.float32)
            for k in range(0, D, BLOCK_D):
                ks = k + tl.arange(0, BLOCK_D).to(tl.int64)
                k_ok = ks < D
                e = tl.load(src_ptr + (rows[:, None] * src_s0 + ks[None, :] * src_s1),
                            mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                w = tl.load(w_ptr + (cols[:, None] * w_s0 + ks[None, :] * w_s1),
                            mask=col_ok[:, None] & k_ok[None, :], other=0.0)
                acc = dot(e, tl.trans(w), acc, PREC, DOT_F32)
            if HAS_BIAS:
                bv = tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
                acc = acc + bv[None, :]
        else:
            acc = tl.load(src_ptr + (rows[:, None] * src_s0 + cols[None, :] * src_s1),
                          mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
            if HAS_BIAS:  # raw logits without the bias (a matmul's chunk)
                acc = acc + tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        return acc

    @triton.jit
    def transform_logits(x, scale, softcap, HAS_SOFTCAP: tl.constexpr):
        """``z = scale * x``, soft-capped to ``softcap * tanh(z / softcap)`` when HAS_SOFTCAP (fp32)."""
        z = x * scale
        if HAS_SOFTCAP:
            z = softcap * tanh(z / softcap)
        return z


# --------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------


def tensor_arg(name: str, t, ndim: int | None = None) -> torch.Tensor:
    """``t``, checked to be a tensor (of ``ndim`` dims when given). Raises TypeError / ValueError."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    return t


def float_tensor(name: str, t, shape: tuple, device: torch.device, dtypes=FLOAT_DTYPES) -> torch.Tensor:
    """``t``, checked: a tensor of ``shape`` with a dtype in ``dtypes`` on ``device``. Raises TypeError /
    ValueError."""
    tensor_arg(name, t, len(shape))
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must have a dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")
    return t


def check_target(target, N: int, device: torch.device) -> torch.Tensor:
    """``target``, checked: int64 / int32 of shape (N,) on ``device``. Raises TypeError / ValueError."""
    tensor_arg("target", target, 1)
    if target.dtype not in _INDEX_DTYPES:
        raise TypeError(f"target must be int64 or int32, got {target.dtype}")
    if target.shape[0] != N:
        raise ValueError(f"target must have shape ({N},), got {tuple(target.shape)}")
    if target.device != device:
        raise ValueError(f"target is on {target.device}, expected {device}")
    return target


def check_scalars(ignore_index, scale, softcap) -> tuple[int, float, float | None]:
    """``(ignore_index, float(scale), softcap as float or None)``, checked: an int64 ``ignore_index``, a real
    ``scale``, a finite ``softcap > 0`` or None. Raises TypeError / ValueError."""
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
    if not -(2**63) <= ignore_index < 2**63:
        raise ValueError(f"ignore_index must fit int64, got {ignore_index}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float, got {type(scale).__name__}")
    if softcap is not None:
        if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
            raise TypeError(f"softcap must be a float or None, got {type(softcap).__name__}")
        if not softcap > 0 or softcap == float("inf"):
            raise ValueError(f"softcap must be a finite float > 0 or None, got {softcap}")
        softcap = float(softcap)
    return ignore_index, float(scale), softcap


def check_linear(input, weight, bias) -> tuple[int, int, int]:
    """``(N, V, D)`` of the matmul operands, checked: input (N, D) and weight (V, D) of one fp16 / bf16 / fp32
    dtype on one device, bias (V,) float or None. Raises TypeError / ValueError."""
    tensor_arg("input", input, 2)
    tensor_arg("weight", weight, 2)
    if input.dtype not in _MATMUL_DTYPES:
        raise TypeError(f"input must be float16, bfloat16 or float32, got {input.dtype}")
    if weight.dtype != input.dtype:
        raise TypeError(f"input ({input.dtype}) and weight ({weight.dtype}) must share a dtype")
    if weight.shape[1] != input.shape[1]:
        raise ValueError(
            f"input {tuple(input.shape)} and weight {tuple(weight.shape)} must share D (input: (N, D), weight: (V, D))"
        )
    if weight.device != input.device:
        raise ValueError(f"weight is on {weight.device} but input is on {input.device}")
    N, D = input.shape
    V = weight.shape[0]
    if bias is not None:
        float_tensor("bias", bias, (V,), input.device)
    return N, V, D


def check_class_weight(class_weight, V: int, device: torch.device):
    """``class_weight``, checked: None or a float (V,) tensor on ``device``. Raises TypeError / ValueError."""
    if class_weight is not None:
        float_tensor("class_weight", class_weight, (V,), device)
    return class_weight
