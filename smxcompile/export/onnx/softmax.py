"""ONNX translations of the softmax family (onnxscript functions for ``torch.onnx.export``'s
``custom_translation_table``). Each translation module has ``translations(target) -> {OpOverload: function}`` and
``refuse(name, args, node) -> str | None``: why one call of ``smx::<name>`` cannot be translated (``args`` by the
op's schema names).

``smx::softmax`` / ``log_softmax``: the fused prologue (scale, soft-cap, mask) in fp32 (fp64 for fp64), then
``Softmax`` / ``LogSoftmax``. ``smx::softmax_topk``: ``TopK`` of the logits, then ``Softmax`` over the k values
(renormalized) or ``Exp(values - m) / ReduceSum(Exp(x - m))`` (portable); ``Softmax`` then ``TopK`` for
onnxruntime, the fastest there (docs/PERFORMANCE.md, 'ONNX softmax + top-k forms').
``smx::quant_softmax``: ``Softmax`` + ``QuantizeLinear`` (+ ``Clip`` below 8 bits; Pandey et al. 2023).
"""

from __future__ import annotations

from typing import Any

import torch


def scaled(op, x, scale: float):
    """``x * scale`` (nothing when scale is 1)."""
    return x if scale == 1.0 else op.Mul(x, op.CastLike(op.Constant(value_float=scale), x))


def _float_type(v) -> int:
    """The ONNX type the op computes in for input ``v``: fp64 for fp64, else fp32 (as its CPU and Triton paths)."""
    import onnx

    return onnx.TensorProto.DOUBLE if _dtype_of(v) == onnx.TensorProto.DOUBLE else onnx.TensorProto.FLOAT


def _dtype_of(v) -> int | None:
    dt = getattr(v, "dtype", None)
    return None if dt is None else int(dt)


def prologue(op, x, scale: float, softcap, mask):
    """``z = softcap * tanh(x * scale / softcap) + mask`` in fp32 (fp64 for fp64): the ops' fused prologue
    (:func:`smxcompile.kernels.softmax.ops.prologue`)."""
    acc = _float_type(x)
    z = x if _dtype_of(x) == acc else op.Cast(x, to=acc)
    z = scaled(op, z, scale)
    if softcap is not None:
        cap = op.CastLike(op.Constant(value_float=float(softcap)), z)
        z = op.Mul(op.Tanh(op.Div(z, cap)), cap)
    if mask is not None:
        z = op.Add(z, mask if _dtype_of(mask) == acc else op.Cast(mask, to=acc))
    return z


def translations(target) -> dict[Any, Any]:
    from onnxscript import opset18 as op

    def _softmax_family(x, dim, scale, softcap, mask, dtype, log: bool):
        z = prologue(op, x, scale, softcap, mask)
        y = op.LogSoftmax(z, axis=dim) if log else op.Softmax(z, axis=dim)
        out = dtype if dtype is not None else _dtype_of(x)
        if out is not None and out != _float_type(x):
            y = op.Cast(y, to=out)
        # the lse output (fp32; fp64 for fp64): pruned from the file unless the graph uses it
        return y, op.ReduceLogSumExp(z, op.Constant(value_ints=[dim]), keepdims=0)

    def smx_softmax(x, dim: int, scale: float = 1.0, softcap=None, mask=None, dtype=None, return_lse: bool = False):
        return _softmax_family(x, dim, scale, softcap, mask, dtype, log=False)

    def smx_log_softmax(x, dim: int, scale: float = 1.0, softcap=None, mask=None, dtype=None,
                        return_lse: bool = False):
        return _softmax_family(x, dim, scale, softcap, mask, dtype, log=True)

    fused_softmax = getattr(target, "name", None) == "onnxruntime"

    def smx_softmax_topk(x, k: int, dim: int, scale: float = 1.0, renormalize: bool = False, dtype=None):
        z = prologue(op, x, scale, None, None)            # fp32 (fp64 for fp64), as the op computes
        axes = op.Constant(value_ints=[dim])
        if renormalize:
            # softmax(topk(x)): the k values only, never the whole row
            values, indices = op.TopK(z, op.Constant(value_ints=[k]), axis=dim, largest=1, sorted=1)
            probs = op.Softmax(values, axis=dim)
        elif fused_softmax:
            # measured faster in onnxruntime than every form that avoids the full Softmax
            probs, indices = op.TopK(op.Softmax(z, axis=dim), op.Constant(value_ints=[k]), axis=dim, largest=1,
                                     sorted=1)
        else:
            # softmax(z)[topk] = exp(topk(z) - m) / sum(exp(z - m)), m the top value: no full Softmax written
            values, indices = op.TopK(z, op.Constant(value_ints=[k]), axis=dim, largest=1, sorted=1)
            m = op.Slice(values, op.Constant(value_ints=[0]), op.Constant(value_ints=[1]), axes)
            d = op.ReduceSum(op.Exp(op.Sub(z, m)), axes, keepdims=1)
            probs = op.Div(op.Exp(op.Sub(values, m)), d)
        out = dtype if dtype is not None else _dtype_of(x)
        if out is not None and out != _float_type(x):
            probs = op.Cast(probs, to=out)
        logd = op.Sub(op.ReduceLogSumExp(z, axes, keepdims=0), op.ReduceMax(z, axes, keepdims=0))
        return probs, indices, logd

    def smx_quant_softmax(x, dim: int, logit_scale: float, scale: float, zero_point: int, quant_min: int,
                          quant_max: int, dtype, prob_dtype=None):
        # QuantizeLinear saturates to the full uint8 / int8 range; a narrower one (bits < 8) is a Clip
        import onnx

        onnx_type = onnx.TensorProto.UINT8 if quant_min >= 0 else onnx.TensorProto.INT8
        y = op.Softmax(scaled(op, op.Cast(x, to=onnx.TensorProto.FLOAT), logit_scale), axis=dim)
        zp = op.Cast(op.Constant(value_int=zero_point), to=onnx_type)
        q = op.QuantizeLinear(y, op.Constant(value_float=scale), zp)
        full = (0, 255) if quant_min >= 0 else (-128, 127)
        if (quant_min, quant_max) != full:
            q = op.Clip(q, op.Cast(op.Constant(value_int=quant_min), to=onnx_type),
                        op.Cast(op.Constant(value_int=quant_max), to=onnx_type))
        return q

    return {torch.ops.smx.softmax.default: smx_softmax, torch.ops.smx.log_softmax.default: smx_log_softmax,
            torch.ops.smx.softmax_topk.default: smx_softmax_topk, torch.ops.smx.quant_softmax.default: smx_quant_softmax}


def refuse(name: str, args: dict, node: torch.fx.Node) -> str | None:
    if name == "quant_softmax" and args.get("prob_dtype") not in (None, torch.float32):
        return (f"rounds its probabilities to {args['prob_dtype']} before quantizing; not translated yet: pass "
                "options={'cpu': 'rewrite', 'disable': ['quant_softmax']}")
    return None
