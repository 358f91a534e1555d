"""onnxscript building blocks of the attention translations (:mod:`.attention`): shape and dtype queries of
traced values, constants of a translation's math dtype, masks, grouped-query matmuls, and the ``If`` that
takes the exact decomposition when q or k holds a NaN / inf."""

from __future__ import annotations

import itertools
import math

import numpy as np

from .attention_normalizers import NEG_INF


def dims(x) -> list | None:
    """A traced value's shape as a list of dims (int or symbolic), None when unknown."""
    shape = getattr(x, "shape", None)
    if shape is None:
        return None
    try:
        return list(shape)
    except TypeError:
        return None


def rank(x) -> int | None:
    shape = dims(x)
    return None if shape is None else len(shape)


def static_dim(d) -> int | None:
    return d if isinstance(d, int) else None


def same_dim(a, b) -> bool:
    """Whether two dims are known equal: the same int, or the same named symbol."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    name_a, name_b = getattr(a, "value", None), getattr(b, "value", None)
    return name_a is not None and name_a == name_b and not isinstance(a, int) and not isinstance(b, int)


def dtype_name(x) -> str | None:
    """The ONNX dtype name of a traced value (``"FLOAT"``, ``"BOOL"``...), None when unknown."""
    dtype = getattr(x, "dtype", None)
    return None if dtype is None else getattr(dtype, "name", str(dtype))


def numpy_dtype(x):
    """The numpy dtype of a float traced value (fp16 / fp32 / fp64), None for any other."""
    return {"FLOAT": np.float32, "FLOAT16": np.float16, "DOUBLE": np.float64}.get(dtype_name(x))


def mha_schema():
    """The schema of com.microsoft ``MultiHeadAttention`` (version 1, inputs 0-5, output 0; onnxruntime's
    ContribOperators.md), which onnxscript does not know."""
    from onnx.defs import OpSchema

    optional = OpSchema.FormalParameterOption.Optional
    Param = OpSchema.FormalParameter
    return OpSchema(
        "MultiHeadAttention", "com.microsoft", 1,
        inputs=[Param("query", "T"), Param("key", "T", param_option=optional),
                Param("value", "T", param_option=optional), Param("bias", "T", param_option=optional),
                Param("key_padding_mask", "M", param_option=optional),
                Param("attention_bias", "T", param_option=optional)],
        outputs=[Param("output", "T")],
        type_constraints=[("T", ["tensor(float)", "tensor(float16)"], ""), ("M", ["tensor(int32)"], "")],
        attributes=[OpSchema.Attribute("num_heads", OpSchema.AttrType.INT, ""),
                    OpSchema.Attribute("unidirectional", OpSchema.AttrType.INT, "", required=False),
                    OpSchema.Attribute("scale", OpSchema.AttrType.FLOAT, "", required=False),
                    OpSchema.Attribute("mask_filter_value", OpSchema.AttrType.FLOAT, "", required=False)])


class AttentionBuilder:
    """The onnxscript ops of one translation call, with its math dtype.

    ``math`` (a numpy dtype or None) types the constants made for intermediate values, whose dtype the tracer
    does not know; ``branches`` numbers the ``If`` subgraphs of one export, so their value names stay unique.
    """

    def __init__(self, branches=None, math_dtype=None):
        from onnxscript import opset18

        self.op = opset18
        self.branches = itertools.count() if branches is None else branches
        self.math = math_dtype

    def with_math(self, math_dtype) -> AttentionBuilder:
        """A builder of the same export whose constants take ``math_dtype``."""
        return AttentionBuilder(self.branches, math_dtype)

    def const(self, value: float, like):
        """A 0-d constant of ``like``'s dtype (the math dtype when the tracer does not know it; exact in fp64)."""
        import onnx_ir as ir

        dtype = numpy_dtype(like) or self.math
        if dtype is None:
            return self.op.CastLike(self.op.Constant(value_float=value), like)
        return self.op.Constant(value=ir.tensor(np.array(value, dtype=dtype)))

    def ints(self, *values: int):
        return self.op.Constant(value_ints=list(values))

    def axes_last(self):
        return self.ints(-1)

    def dim(self, x, i: int):
        """``x.shape[i]`` as a 1-D int64 tensor of one element."""
        return self.op.Shape(x, start=i, end=i + 1 if i != -1 else None)

    def scalar(self, one_element):
        return self.op.Squeeze(one_element, self.ints(0))

    def acc_of(self, x):
        """(x cast to its math dtype, that dtype's TensorProto code): fp32 for fp16, else x's own."""
        import onnx

        name = dtype_name(x)
        if name == "DOUBLE":
            return x, onnx.TensorProto.DOUBLE
        if name == "FLOAT":
            return x, onnx.TensorProto.FLOAT
        return self.op.Cast(x, to=onnx.TensorProto.FLOAT), onnx.TensorProto.FLOAT

    def causal_keep(self, query_len, key_len):
        """Top-left causal mask (L, S) bool, key j allowed iff j <= i; lengths as 1-D tensors."""
        op = self.op
        zero, one = self.ints(0), self.ints(1)
        rows = op.Range(self.scalar(zero), self.scalar(query_len), self.scalar(one))
        cols = op.Range(self.scalar(zero), self.scalar(key_len), self.scalar(one))
        return op.LessOrEqual(op.Unsqueeze(cols, self.ints(0)), op.Unsqueeze(rows, self.ints(1)))

    def zero_poison(self, x, axes: list[int]):
        """``sum(x * 0)`` over ``axes`` (keepdims): 0 where x is finite, NaN where it holds NaN or inf."""
        return self.op.ReduceSum(self.op.Mul(x, self.const(0.0, x)), self.ints(*axes), keepdims=1)

    def qk_matmul(self, q, k, v, grouped: bool, tensor_rank: int):
        """``(q @ k^T`` as (..., Hq, L, S), ``w -> w @ v``); grouped-query heads as a 5-D broadcast (K and V
        never repeated)."""
        op, dim = self.op, self.dim
        if not grouped:
            perm = list(range(tensor_rank - 2)) + [tensor_rank - 1, tensor_rank - 2]
            return op.MatMul(q, op.Transpose(k, perm=perm)), (lambda w: op.MatMul(w, v))
        shape5 = op.Concat(dim(q, 0), dim(k, 1), op.Div(dim(q, 1), dim(k, 1)), dim(q, 2), dim(q, 3), axis=0)
        q5, k5, v5 = op.Reshape(q, shape5), op.Unsqueeze(k, self.ints(2)), op.Unsqueeze(v, self.ints(2))
        scores5 = op.MatMul(q5, op.Transpose(k5, perm=[0, 1, 2, 4, 3]))
        scores = op.Reshape(scores5, op.Concat(dim(q, 0), dim(q, 1), dim(q, 2), dim(k, 2), axis=0))

        def times_v(w):
            w5 = op.Reshape(w, op.Concat(dim(q, 0), dim(k, 1), self.ints(-1), dim(q, 2), dim(k, 2), axis=0))
            return op.Reshape(op.MatMul(w5, v5), op.Concat(dim(q, 0), dim(q, 1), dim(q, 2), dim(v, 3), axis=0))

        return scores, times_v

    def scale_value(self, query, scale):
        """The scale (None: ``1/sqrt(E)``) as a 0-d tensor of the math dtype; ``query`` the translation's input."""
        import onnx
        import onnx_ir as ir

        if scale is None:
            head_dim = static_dim(dims(query)[-1])
            if head_dim is not None:
                scale = 1.0 / math.sqrt(head_dim) if head_dim else 1.0
        if scale is not None:
            return self.op.Constant(value=ir.tensor(np.array(float(scale), dtype=self.math)))
        to = onnx.TensorProto.DOUBLE if self.math is np.float64 else onnx.TensorProto.FLOAT
        return self.op.Reciprocal(self.op.Sqrt(self.op.Cast(self.dim(query, -1), to=to)))

    def repeat_heads(self, x, q):
        """Grouped-query K or V (B, Hkv, S, E) repeated to q's Hq heads."""
        op, dim = self.op, self.dim
        group = op.Div(dim(q, 1), dim(x, 1))
        repeats = op.Concat(self.ints(1, 1), group, self.ints(1, 1), axis=0)
        return op.Reshape(op.Expand(op.Unsqueeze(x, self.ints(2)), repeats),
                          op.Concat(dim(x, 0), self.ints(-1), dim(x, 2), dim(x, 3), axis=0))

    def zero_rows(self, out, flag, v, q, grouped_v: bool):
        """Rows with ``flag`` (..., L, 1) set to ``0 @ V``: 0, or NaN per column where V holds NaN / inf."""
        values = self.repeat_heads(v, q) if grouped_v else v
        return self.op.Where(flag, self.zero_poison(values, [-2]), out)

    def no_key(self, seen):
        """Per row (..., L, 1): whether the bool ``seen`` (..., L, S) has no key at all."""
        import onnx
        import onnx_ir as ir

        op = self.op
        zero = op.Constant(value=ir.tensor(np.array(0.0, dtype=np.float32)))
        return op.Equal(op.ReduceMax(op.Cast(seen, to=onnx.TensorProto.FLOAT), self.axes_last(), keepdims=1), zero)

    def nonfinite(self, *xs):
        """A 0-d bool: whether any of ``xs`` holds a NaN or an inf (``sum(x * 0)`` is NaN exactly then)."""
        total = None
        for x in xs:
            part = self.op.ReduceSum(self.op.Mul(x, self.const(0.0, x)), keepdims=0)
            total = part if total is None else self.op.Add(total, part)
        return self.op.IsNaN(total)

    def branch(self, build, name: str):
        """What ``build()`` records, moved into a graph of its own (an ``If`` branch reading the values around
        it); None when torch.onnx's tracer is not recording."""
        import onnx_ir as ir
        import onnxscript.evaluator

        tracer = onnxscript.evaluator.default()
        nodes = getattr(tracer, "nodes", None)
        if not isinstance(nodes, list):
            return None
        farm = getattr(tracer, "constant_farm", None)
        farm_before = dict(farm) if isinstance(farm, dict) else None
        first = len(nodes)
        try:
            out = build()
        finally:
            body = nodes[first:]
            del nodes[first:]
            if farm_before is not None:     # constants made for the branch live in it, not shared with the graph
                farm.clear()
                farm.update(farm_before)
        number = next(self.branches)
        for i, value in enumerate(v for node in body for v in node.outputs):
            value.name = f"smx_{name}{number}_{i}"   # ONNX wants one name per value, subgraphs included
        return ir.Graph((), [out], nodes=body, name=f"{name}{number}")

    def exact_if_nonfinite(self, fast, q, k, slow):
        """``fast`` (a fused op, exact while every score is finite), or ``slow()`` (the decomposition) through
        an ``If`` when q or k holds a NaN / inf."""
        then_graph = self.branch(slow, "nonfinite_qk")
        if then_graph is None:
            return self.op.Where(self.nonfinite(q, k), slow(), fast)
        else_graph = self.branch(lambda: self.op.Identity(fast), "finite_qk")
        return self.op.If(self.nonfinite(q, k), then_branch=then_graph, else_branch=else_graph)

    def mask_ls(self, mask, shape_of, q, k):
        """The mask with dims -2, -1 exactly (L, S) (onnxruntime broadcasts neither); ``shape_of``: a value of
        the mask's shape whose static shape is known, or None."""
        shape = dims(shape_of) if shape_of is not None else None
        if (shape is not None and len(shape) >= 2 and same_dim(shape[-2], dims(q)[-2])
                and same_dim(shape[-1], dims(k)[-2])):
            return mask
        return self.op.Expand(mask, self.op.Concat(self.dim(q, -2), self.dim(k, -2), axis=0))

    def lowest_to_next(self, mask):
        """Float mask entries equal to the dtype's lowest finite value -> the next float up (onnxruntime reads
        ``finfo.min`` as a masked key)."""
        lowest = np.finfo(self.math).min
        above = np.nextafter(lowest, self.math(0))
        return self.op.Where(self.op.Equal(mask, self.const(float(lowest), mask)), self.const(float(above), mask),
                             mask)

    def sdpa_bias(self, mask, like, query_len, key_len, is_causal: bool):
        """The additive bias (bool -> 0 / -inf) with the causal triangle folded in, or None."""
        op = self.op
        bias = None
        if mask is not None:
            if dtype_name(mask) == "BOOL":
                bias = op.Where(mask, self.const(0.0, like), self.const(NEG_INF, like))
            else:
                bias = op.CastLike(mask, like)
        if is_causal:
            triangle = op.Where(self.causal_keep(query_len, key_len), self.const(0.0, like),
                                self.const(NEG_INF, like))
            bias = triangle if bias is None else op.Add(bias, triangle)
        return bias

__all__ = ["AttentionBuilder", "dims", "rank", "static_dim", "same_dim", "dtype_name", "numpy_dtype",
           "mha_schema"]
