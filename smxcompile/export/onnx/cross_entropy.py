"""ONNX translations of smxcompile's cross-entropy ops: ``smx::ce_stats`` and ``smx::linear_ce_stats``.

What reaches an exported graph. :func:`smxcompile.export_onnx` captures and exports under
``torch.no_grad()``, so every cross-entropy site -- a rewritten one (``F.cross_entropy`` with any of its
options, ``nn.CrossEntropyLoss``, ``nll_loss(log_softmax)``, ``F.linear_cross_entropy``, the transformers
LM losses with their label shift and ``num_items_in_batch``, linear -> CE with temperature / soft-cap /
row slices) or a direct call of ``smxcompile.cross_entropy`` / ``smxcompile.linear_cross_entropy`` (which
add z-loss, per-token weights, ``return_lse``, ``return_z_loss``) -- is one *statistics* op followed by
ordinary ATen ops on N-vectors (:func:`smxcompile.kernels.cross_entropy.loss.compose_loss`: the ignore mask, class
weight of the target, label smoothing, the reduction and its ``mean`` normalisation, the z-loss
``scale * lse^2``), which torch.onnx translates itself. The fused op ``smx::linear_ce_loss`` (gradients in
the forward) and the backward ops need gradients and never reach an export.

The statistics, per row i of the N x V logits (method: Wijmans et al. 2024, "Cut Your Losses in
Large-Vocabulary Language Models", 2024):

    z_ij = softcap * tanh(scale * x_ij / softcap)   (or scale * x_ij)
    x    = input @ weight.T + bias                  (linear_ce_stats; ce_stats takes x itself)
    lse_i  = log sum_j exp(z_ij) = m_i - log max_j softmax(z)_ij   -> ReduceMax, Softmax, ReduceMax, Log
             (m_i the row max; or one ReduceLogSumExp, see LSE_FORM)
    tl_i   = z_{i,y_i}; 0 where y_i == ignore_index; NaN where y_i is outside [0, V)
                                                                  -> GatherElements(z, y) + Where
    om_i   = sum_{j != y_i} exp(z_ij - lse_i)  (auxiliary of the backward; unused in an inference graph,
             where the exporter's optimizer drops it)             -> ScatterElements(-inf) + Exp + ReduceSum
    ws_i   = sum_j w_ij z_ij, w = class weight (V,) times the probability targets (N, V), either or
             none (label smoothing / soft targets)                -> ReduceSum(z * w) / ReduceSum(z)

No N x V *log-probability* tensor is built (the plain ``torch.onnx.export`` writes
``SoftmaxCrossEntropyLoss``, which onnxruntime runs with three N x V temporaries, and drops
``label_smoothing`` on the way); the one N x V temporary is the softmax whose row max gives the lse (see
:data:`LSE_FORM` for the measurements). The logits of linear -> CE are one ``Gemm`` (the cut-CE chunking of
the torch path is an execution strategy the file does not need). ``SoftmaxCrossEntropyLoss`` cannot
translate the op: its outputs are the lse and the target logit separately (the lse is also returned and
feeds the z-loss) and the loss around them is ATen.

Dtypes: fp32 logits stay fp32; fp16 logits are read in fp32 (the torch path's accumulation dtype); fp64
stays fp64. The returned logits (``return_logits``) are ``z`` rounded to ``logits_dtype`` and the loss
reads that rounded tensor, as eager does. The matmul runs in the input's dtype, as ``F.linear``.

Refused (:func:`refuse`): ``linear_ce_stats`` on bf16 operands (onnxruntime's CPU provider has no bf16
Gemm / MatMul; an fp32 Gemm rounded to bf16 is not torch's bf16 matmul). bf16 logits of ``ce_stats`` are
read in fp32 exactly as the torch path does (a ``Cast``).
"""

from __future__ import annotations

from typing import Any

import torch

#: How the row log-sum-exp is written:
#:
#: - ``"softmax"`` (default): ``lse = m - log(max_j softmax(z)_j)`` with ``m`` the row max (the max
#:   probability is ``1 / sum_j exp(z_ij - m)``; the identity torch's fused CPU path uses), i.e. ``ReduceMax``,
#:   ``Softmax``, ``ReduceMax``, ``Log``: one N x V temporary (probabilities, not log-probabilities).
#: - ``"reduce"``: one ``ReduceLogSumExp``: no N x V temporary at all.
#:
#: Measured with onnxruntime 1.32, CPU, 1 thread, 512 x 32768 fp32 logits (lse minus the gathered target
#: logit; one N x V temporary = 64 MB at this size, 256 MB at 2048 rows):
#: ``"softmax"`` 27 ms, 1 temporary, 4.6e-6 max error against an fp64 gold (lse ~ 12);
#: ``ReduceMax/Sub/Exp/ReduceSum/Log`` 29 ms, 2 temporaries, 8.3e-6; ``SoftmaxCrossEntropyLoss`` (what the plain
#: export writes) 46 ms, 3 temporaries, 4.6e-6; ``"reduce"`` 135 ms, none, 6.6e-5 (onnxruntime sums the
#: exponentials naively); LogSoftmax + GatherElements 20 ms, 1 temporary of log-probabilities (not used: the
#: file would keep the N x V log-probability tensor the fused op exists to avoid).
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
        # the logits of a bf16 linear layer are rounded to bf16 by torch's matmul; onnxruntime's CPU provider
        # has no bf16 Gemm / MatMul (the plain export of the same layer cannot run there either), and an fp32
        # Gemm rounded to bf16 can land one bf16 step (0.4%) away from torch's result
        return ("computes its logits with a bf16 matmul (bf16 model or a bf16 autocast region): onnxruntime's CPU "
                "provider has no bf16 Gemm / MatMul, and emulating it in fp32 does not round like torch; compute the "
                "classifier in fp32 or fp16 for the export (options={'cpu': 'rewrite', 'disable': "
                f"['{_kind(name)}']}} exports the loss unrewritten, but onnxruntime cannot run that bf16 matmul "
                "either)")
    return None
