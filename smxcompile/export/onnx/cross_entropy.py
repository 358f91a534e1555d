"""ONNX translations of smxcompile's cross-entropy ops: ``smx::ce_stats`` and ``smx::linear_ce_stats``.

Under ``torch.no_grad()`` every cross-entropy site is one *statistics* op followed by ATen ops on N-vectors
(:func:`smxcompile.kernels.cross_entropy.loss.compose_loss`), which torch.onnx translates itself. Per row of the
N x V logits ``z`` (Wijmans et al. 2024, "Cut Your Losses in Large-Vocabulary Language Models"): ``lse``
(:data:`LSE_FORM`), the target logit (0 where ignored, NaN out of range), the other classes' mass and the
weighted sum over classes; linear -> CE's logits are one ``Gemm``. No N x V log-probability tensor is written.
fp16 / bf16 logits are read in fp32, fp64 stays fp64; :func:`refuse` turns down bf16 ``linear_ce_stats``.

Derivation and measurements: docs/DESIGN.md, 'ONNX cross-entropy statistics'.
"""

from __future__ import annotations

from typing import Any

import torch

#: How the row log-sum-exp is written: ``"softmax"`` (``m - log(max_j softmax(z)_j)``, one N x V temporary, the
#: fastest in onnxruntime) or ``"reduce"`` (one ``ReduceLogSumExp``, no temporary, 5x slower). Measured:
#: docs/PERFORMANCE.md, 'ONNX cross-entropy: the row lse forms'.
LSE_FORM = "softmax"

#: The smxcompile ops this module translates.
OPS = ("ce_stats", "linear_ce_stats")


def _kind(name: str) -> str:
    return "linear_cross_entropy" if name.startswith("linear_") else "cross_entropy"


def translations(target) -> dict[Any, Any]:
    import numpy as np
    import onnx
    from onnx import TensorProto
    from onnxscript import ir
    from onnxscript import opset18 as op

    def acc_type(x) -> int:
        """The accumulation dtype of the torch path: fp64 for fp64, else fp32."""
        return TensorProto.DOUBLE if x.dtype == ir.DataType.DOUBLE else TensorProto.FLOAT

    def to(x, dtype: int):
        return x if x.dtype is not None and int(x.dtype) == int(dtype) else op.Cast(x, to=dtype)

    def const(value: float, dtype: int):
        """A scalar constant of ``dtype`` (typed here: a CastLike of a value whose type the tracer does not
        know yet can fold to the wrong type)."""
        return op.Constant(value=ir.tensor(np.array(value, dtype=onnx.helper.tensor_dtype_to_np_dtype(dtype))))

    def empty(dtype: int):
        np_dtype = onnx.helper.tensor_dtype_to_np_dtype(dtype)
        return op.Constant(value=ir.tensor(np.zeros((0,), dtype=np_dtype)))

    def transform(x, acc: int, scale: float, softcap):
        """z = softcap * tanh(scale * x / softcap), or scale * x (the order of the torch path's in-place ops)."""
        if softcap is not None:
            return op.Mul(op.Tanh(op.Mul(x, const(scale / softcap, acc))), const(float(softcap), acc))
        if scale != 1.0:
            return op.Mul(x, const(scale, acc))
        return x

    def logsumexp(z, acc: int, axes):
        """log sum_j exp(z_ij) (N,), as torch: -inf for a row of -inf, +inf for a row with +inf."""
        if LSE_FORM == "reduce":
            return op.ReduceLogSumExp(z, axes, keepdims=0)
        m = op.ReduceMax(z, axes, keepdims=0)
        lse = op.Sub(m, op.Log(op.ReduceMax(op.Softmax(z, axis=1), axes, keepdims=0)))
        return op.Where(op.IsInf(m), m, lse)

    def stats(z, acc: int, target, probs, class_weight, ignore_index: int, need_weighted_sum: bool):
        """(lse, target_logit, other_mass, weighted_sum) of logits ``z`` (N, V) of the accumulation dtype ``acc``."""
        axes = op.Constant(value_ints=[1])
        lse = logsumexp(z, acc, axes)
        if probs is None:
            target = to(target, TensorProto.INT64)
            valid = op.Not(op.Equal(target, op.Constant(value_int=ignore_index)))
            v = op.Shape(z, start=1, end=2)
            inrange = op.And(op.GreaterOrEqual(target, op.Constant(value_int=0)), op.Less(target, v))
            idx = op.Unsqueeze(op.Where(inrange, target, op.Constant(value_int=0)), axes)
            gathered = op.Squeeze(op.GatherElements(z, idx, axis=1), axes)
            tl = op.Where(valid, op.Where(inrange, gathered, const(float("nan"), acc)), const(0.0, acc))
            # the mass of the other classes (the backward's collapse-safe 1 - p_y): knock the target out
            knocked = op.ScatterElements(z, idx, op.Expand(const(float("-inf"), acc), op.Shape(idx)), axis=1)
            om = op.ReduceSum(op.Exp(op.Sub(knocked, op.Unsqueeze(lse, axes))), axes, keepdims=0)
            om = op.Where(op.And(valid, inrange), om, const(0.0, acc))
        else:
            tl = op.Mul(lse, const(0.0, acc))   # zeros (N,): soft targets have no target logit
            om = tl
        if need_weighted_sum:
            w = None
            if probs is not None:
                w = to(probs, acc)
                if class_weight is not None:
                    w = op.Mul(w, to(class_weight, acc))
            elif class_weight is not None:
                w = to(class_weight, acc)
            ws = op.ReduceSum(z if w is None else op.Mul(z, w), axes, keepdims=0)
        else:
            ws = empty(acc)
        return lse, tl, om, ws

    def smx_ce_stats(logits, target, probs=None, class_weight=None, ignore_index: int = -100, scale: float = 1.0,
                     softcap=None, need_weighted_sum: bool = False, chunk_bytes: int = 0):
        acc = acc_type(logits)
        z = transform(to(logits, acc), acc, scale, softcap)
        return stats(z, acc, target, probs, class_weight, ignore_index, need_weighted_sum)

    def smx_linear_ce_stats(input, weight, bias=None, target=None, probs=None, class_weight=None,
                            ignore_index: int = -100, scale: float = 1.0, softcap=None,
                            need_weighted_sum: bool = False, return_logits: bool = False, logits_dtype=None,
                            chunk_bytes: int = 0, filter_eps=None, precise_grad: bool = False):
        acc = acc_type(input)
        # F.linear in the input dtype; the statistics in the accumulation dtype
        # (N, D) x (V, D)^T (+ bias): one Gemm, no transposed copy of the classifier
        x = op.Gemm(input, weight, bias, transB=1) if bias is not None else op.Gemm(input, weight, transB=1)
        z = transform(to(x, acc), acc, scale, softcap)
        if return_logits:
            ld = int(input.dtype) if logits_dtype is None or int(logits_dtype) < 0 else int(logits_dtype)
            logits = to(z, ld)
            if ld != acc:
                z = to(logits, acc)   # the loss reads the logits the caller gets (rounded), as in eager
        else:
            logits = empty(int(input.dtype))
        lse, tl, om, ws = stats(z, acc, target, probs, class_weight, ignore_index, need_weighted_sum)
        return lse, tl, om, ws, logits

    return {torch.ops.smx.ce_stats.default: smx_ce_stats,
            torch.ops.smx.linear_ce_stats.default: smx_linear_ce_stats}


def _val(a):
    return a.meta.get("val") if isinstance(a, torch.fx.Node) else None


def refuse(name: str, args: dict, node: torch.fx.Node) -> str | None:
    """Why one call of a cross-entropy op cannot be translated (None when it can)."""
    if name not in OPS:
        return None
    x = _val(args.get("input")) if name == "linear_ce_stats" else None
    if x is not None and x.dtype == torch.bfloat16:
        # no bf16 Gemm in onnxruntime's CPU provider; fp32 rounded to bf16 can be one bf16 step off torch's
        return ("computes its logits with a bf16 matmul (bf16 model or a bf16 autocast region): onnxruntime's CPU "
                "provider has no bf16 Gemm / MatMul, and emulating it in fp32 does not round like torch; compute the "
                "classifier in fp32 or fp16 for the export (options={'cpu': 'rewrite', 'disable': "
                f"['{_kind(name)}']}} exports the loss unrewritten, but onnxruntime cannot run that bf16 matmul "
                "either)")
    return None
