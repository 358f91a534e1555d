"""ONNX translations of the softmax family: ``smx::softmax``, ``smx::log_softmax``, ``smx::softmax_topk``,
``smx::quant_softmax`` (onnxscript functions for ``torch.onnx.export``'s ``custom_translation_table``).

Each translation module of :mod:`smxcompile.backends.onnx` has the same two functions:
``translations(target) -> {OpOverload: onnxscript function}`` and ``refuse(name, args, node) -> str | None``
(why one call of ``smx::<name>`` cannot be translated, None when it can; ``args`` maps the op's schema
argument names to the node's arguments).

- ``smx::softmax`` -> ``Softmax`` (scale folded in front), ``smx::log_softmax`` -> ``LogSoftmax``.
- ``smx::softmax_topk`` -> ``TopK`` of the logits and ``Exp(values - ReduceLogSumExp)``, never a full
  ``Softmax`` (``softmax(x)[topk] = exp(topk(x) - lse(x))``, ALGORITHMS.md section 2); ``Softmax`` over
  the k values when renormalized.
- ``smx::quant_softmax`` -> ``Softmax`` + ``QuantizeLinear`` (+ ``Clip`` for a code range narrower than
  the 8-bit type); the graph's own dequantization and bias correction (Pandey et al. 2023, "Softmax Bias
  Correction for Quantized Generative Models") follow as standard ops.
"""

from __future__ import annotations

from typing import Any

import torch


def scaled(op, x, scale: float):
    """``x * scale`` (nothing when scale is 1)."""
    return x if scale == 1.0 else op.Mul(x, op.CastLike(op.Constant(value_float=scale), x))


def translations(target) -> dict[Any, Any]:
    from onnxscript import opset18 as op

    def smx_softmax(x, dim: int, scale: float = 1.0, softcap=None, mask=None, dtype=None, return_lse: bool = False):
        z = scaled(op, x, scale)
        return op.Softmax(z, axis=dim), op.ReduceLogSumExp(z, op.Constant(value_ints=[dim]), keepdims=0)

    def smx_log_softmax(x, dim: int, scale: float = 1.0, softcap=None, mask=None, dtype=None,
                        return_lse: bool = False):
        z = scaled(op, x, scale)
        return op.LogSoftmax(z, axis=dim), op.ReduceLogSumExp(z, op.Constant(value_ints=[dim]), keepdims=0)

    def smx_softmax_topk(x, k: int, dim: int, scale: float = 1.0, renormalize: bool = False, dtype=None):
        z = scaled(op, x, scale)
        axes = op.Constant(value_ints=[dim])
        values, indices = op.TopK(z, op.Constant(value_ints=[k]), axis=dim, largest=1, sorted=1)
        if renormalize:
            probs = op.Softmax(values, axis=dim)
        else:
            probs = op.Exp(op.Sub(values, op.ReduceLogSumExp(z, axes, keepdims=1)))
        logd = op.Sub(op.ReduceLogSumExp(z, axes, keepdims=0), op.ReduceMax(z, axes, keepdims=0))
        return probs, indices, logd

    def smx_quant_softmax(x, dim: int, logit_scale: float, scale: float, zero_point: int, quant_min: int,
                          quant_max: int, dtype, prob_dtype=None):
        # QuantizeLinear saturates to the full uint8 / int8 range; a narrower code range (bits < 8) is a Clip
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
    if name not in ("softmax", "log_softmax", "softmax_topk", "quant_softmax"):
        return None
    what = [k for k in ("softcap", "mask", "return_lse") if args.get(k) not in (None, False)]
    if what:
        return (f"with {' and '.join(what)} (an added score / mask folded into the op) has no ONNX translation yet; "
                f"pass options={{'cpu': 'rewrite', 'disable': ['{name}']}} to export the softmax as written")
    if name == "quant_softmax":
        if args.get("prob_dtype") not in (None, torch.float32):
            return (f"rounds its probabilities to {args['prob_dtype']} before quantizing; not translated yet: pass "
                    "options={'cpu': 'rewrite', 'disable': ['quant_softmax']}")
        return None
    x = node.args[0].meta.get("val") if isinstance(node.args[0], torch.fx.Node) else None
    if args.get("dtype") is not None and (x is None or args["dtype"] != x.dtype):
        return (f"with dtype= other than its input's has no ONNX translation yet; pass "
                f"options={{'cpu': 'rewrite', 'disable': ['{name}']}}")
    return None
