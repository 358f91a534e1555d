"""ONNX translations of attention: ``aten.scaled_dot_product_attention`` (what softmax-normalizer sites become)
and ``smx::attention`` (every other normalizer, and soft-capping), per :attr:`OnnxTarget.attention`.

Each translation module of :mod:`smxcompile.export.onnx` has the same two functions (see
:mod:`.softmax`): ``translations(target) -> {OpOverload: onnxscript function}`` and
``refuse(name, args, node) -> str | None``.

The semantics kept, for ``F.scaled_dot_product_attention``'s query (..., Hq, L, E), key (..., Hkv, S, E), value
(..., Hkv, S, Ev): ``s = q k^T * scale`` (default ``1/sqrt(E)``); a bool mask and the causal triangle
(``is_causal``: keys above the top-left diagonal; mask and ``is_causal`` together both apply) *select* keys,
``z = where(keep, s, -inf)``: a masked key's score is never read, so a NaN / inf there changes nothing; a
float mask is *added*, ``z = s + mask``, so NaN + mask is NaN and +inf + (-inf) NaN; ``out = softmax(z) @ v``
-> (..., Hq, L, Ev) in q's dtype, so NaN / inf in ``v_j[e]`` makes column e NaN (``0 * inf`` too), masked key or
not. A row with no key (bool all False, float all ``-inf``) is ``0 @ V`` (0, or NaN per column where V holds
NaN / inf), NaN for a float mask where ``s + (-inf)`` is (``s`` NaN or +inf there); any other row whose ``z`` is
all ``-inf`` (every visible score ``-inf``: an inf in q or k) is softmax's NaN. ``smx::attention`` keeps the
op's own definition (:func:`smxcompile.kernels.attention.attention_reference`; below).

Why these, and what the SDPA node cannot tell. The gold is the model as written (eager), and the attention
pass (:func:`smxcompile.passes.attention.graph_attention`) turns every eager spelling into one SDPA call whose
mask says which spelling it was: ``scores.masked_fill(~keep, v)`` / ``torch.where(keep, scores, v)`` (``v``
``-inf`` or ``finfo.min``...; several of them combined) become a *bool* mask (eager replaces the masked score:
selection), ``scores + mask`` a *float* mask (eager adds: NaN from any key propagates), a constant causal mask
``is_causal``; rows with no key get eager's values back after the call (NaN for ``-inf`` fills, the mean of V
for finite ones: not a function of q or k, whatever the call gives there). So every masked_fill / where
spelling (``-inf`` or ``finfo.min``, padding, causal, causal + padding, grouped-query heads) and every additive
one (``-inf``, ``finfo.min``, ``-1e9``) is exact, NaN and inf included, except what the node does not carry:

* ``scores + causal`` with a *constant* causal mask (transformers' eager mask when no padding mask is given)
  becomes ``is_causal``, selected: a NaN / +inf score at a future key makes eager's row NaN, not the file's;
* ``(scores + mask).masked_fill(~keep, v)``: the pass folds both into one float mask (``-inf`` where ``keep``
  is False), added: a NaN / +inf score at such a key gives NaN where eager drops it;
* ``masked_fill(~keep, finfo.min)`` on a row whose every visible score is ``-inf``: eager averages the masked
  keys' values, the file gives NaN (the call only sees a bool mask);
* scores that overflow from finite q and k (fp16 ``|q k| > 65504``) are not detected (below).

``F.scaled_dot_product_attention`` in the model itself (not rewritten): NaN handling depends on torch's
backend (probed, torch 2.13 CPU): float masks and ``is_causal`` as its default CPU kernel (flash: future keys
skipped; the MATH backend adds ``-inf`` above the diagonal instead, so there a NaN at a future key is NaN
everywhere); a bool mask both CPU kernels add as ``-inf`` (a NaN / +inf score at a masked key: NaN row, also
on a row with no key), where the file selects; a row whose every visible score is ``-inf``: torch 0, the file
NaN.

``aten.scaled_dot_product_attention.default`` by ``target.attention`` (onnxruntime 1.32's CPU kernels
probed against torch for bool / float masks, ``finfo.min`` and ``-inf``, causal with and without padding,
L < S and L > S, grouped-query heads, fully masked rows, NaN / inf in q, k, v;
tests/export/test_onnx_attention.py pins the differences found). What the fused ops have in common: they *add*
every mask to the scores (a bool mask as 0 / ``finfo.min``, ``is_causal`` / ``unidirectional`` as ``finfo.min`` /
``-inf``), so a NaN or +inf score at a masked key makes the row NaN. Whether a score is NaN, +inf or -inf depends
on ``q_i`` and ``k_j`` together (an inf times the sign of the other's entry), so no fix-up on a fused op's output
recovers the selection without the score matrix. The fused forms are exact while q and k are finite (every score
finite: adding ``finfo.min`` / ``-inf`` to it is selecting it out), and an ``If`` on
``isnan(sum(q * 0) + sum(k * 0))`` runs the decomposition (exact by construction) when they are not: one ``Mul`` +
``ReduceSum`` over q and over k on the usual path (a call with neither mask nor ``is_causal`` has nothing to select and no ``If``):

- ``"Attention"``: the ONNX ``Attention`` op (opset 23, https://onnx.ai/onnx/operators/onnx__Attention.html),
  4-D inputs, grouped-query heads as the op's own (Hq a multiple of Hkv), the mask as ``attn_mask`` and
  ``is_causal`` as the attribute (top-left without a KV cache, as torch). onnxruntime's differences, and the
  fix-ups:

  * a float mask entry equal to the dtype's lowest finite value (``torch.finfo(dtype).min``, what
    transformers masks with) is taken for a masked key, so a row whose keys are all at ``finfo.min`` (left
    padding under a causal mask) gives 0 where torch averages V. Fix: those entries become the next float up,
    ``nextafter(finfo.min, 0)``, which onnxruntime treats as a score: ``s + m`` rounds to ``m`` for any
    ``|s| < 1e31``, so the weights are torch's exactly (only a mask holding both ``finfo.min`` and that
    neighbour changes meaning). One ``Equal`` + ``Where`` on the mask, shared by the layers.
  * the mask needs the query length at dim -2 and the key length at dim -1 (no broadcasting there: a
    (B, 1, 1, S) padding mask fails at run time): such masks are ``Expand``-ed to (..., L, S).
  * a row with no key (bool all False, all ``-inf``) gives ``0 @ V`` already (weights 0 times V).
- ``"MultiHeadAttention"``: onnxruntime's com.microsoft ``MultiHeadAttention`` (docs/ContribOperators.md of
  onnxruntime, https://github.com/microsoft/onnxruntime/blob/main/docs/ContribOperators.md): query as
  (B, L, Hq*E) (``Transpose`` + ``Reshape``, which onnxruntime cancels against the model's own), key / value
  as (B, Hq, S, E) ("BNSH", no transpose) when Ev == E, else (B, S, Hq*E); grouped-query K/V expanded to Hq
  heads; the mask as ``attention_bias`` (B or 1, Hq or 1, L, S) (bool -> 0 / ``-inf``); ``scale``. It has
  no soft-capping: soft-capped sites (``smx::attention``) decompose. Its differences, and the fix-ups:

  * ``unidirectional`` is bottom-right aligned (for L < S torch is top-left), and together with an
    ``attention_bias`` it gets rows whose visible keys are all masked wrong: it is used only without a mask
    and with L == S (the same static or symbolic size); otherwise the causal triangle is folded into
    ``attention_bias`` as ``-inf``.
  * a fully masked row (``attention_bias`` all ``-inf``) gives NaN (torch: 0). Fix: those rows, read off
    the bias (not the output), become ``sum_j v_j * 0`` (``0 @ V``).
- ``"decompose"``: ``MatMul`` / ``Softmax`` / ``MatMul``, standard ops only, at any opset (overriding torch's
  opset-23 translation, which emits ``Attention``): the scale folded into q, grouped-query heads as a 5-D
  ``MatMul`` broadcast (K and V never repeated), fp16 computed in fp32, the bool mask and the causal triangle by
  ``Where``, the float mask by ``Add``, rows with no key (read off the mask; ``Softmax`` gives NaN there) set
  as above. This is the fused forms' ``If`` branch too.

A call a fused op cannot take exactly uses the decomposition whatever the form: not 4-D, fp64 (no fused
kernel), a broadcast batch dim, a scale <= 0 (onnxruntime refuses it; MultiHeadAttention reads 0 as "the
default"), a symbolic head count (MultiHeadAttention's ``num_heads``). ``dropout_p > 0`` has no exact form
(the mask is random) and raises.

``smx::attention`` (``normalizer != "softmax"``, or soft-capping): q (B, Hq, L, E), k / v (B, Hkv, S, E / Ev),
the op's arguments as :func:`smxcompile.kernels.attention.ops.attention_op` takes them, decomposed op for op from
the reference functions of :data:`smxcompile.kernels.attention.NORMALIZERS`: masks bool (``keep``) or float
(added; ``-inf`` masks), masked keys exactly 0 and not counted in n (``n`` from the op's ``n_keys`` input,
else S or ``min(i + 1, S)`` under ``is_causal``), ``norm_param`` per (B, Hq), soft-capping
``cap * tanh(s / cap)`` before the mask, grouped-query heads by 5-D broadcast, math in fp32 (fp64 for fp64).
The normalizers are :mod:`.attention_normalizers`' forms (their sources there). The second output (``stats``) is
zeros, as on the op's CPU path (only the CUDA backward reads it). With ``target.attention == "Attention"`` a
softmax site with soft-capping is the ``Attention`` op with its ``softcap`` attribute (onnxruntime caps before the
mask, as the op; the mask fix-ups above apply), exact while q and k are finite; ``smx::attention`` selects masked
keys out, which the op (adding the mask) cannot when a score is NaN / inf, so NaN / inf in q or k take the
decomposition above through the same ``If``. With ``"MultiHeadAttention"`` (no soft-capping) and ``"decompose"``
soft-capped sites are the decomposition.
Refused (:func:`refuse`): ``dropout_p > 0``, ``skip_threshold`` (the CUDA kernel's approximation).
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np
import torch

from .attention_normalizers import NEG_INF, normalizer_forms


class OnnxAttentionError(RuntimeError):
    """An attention call that has no exact ONNX form (raised while translating)."""


# --------------------------------------------------------------------------- shape / dtype helpers


def _dims(x) -> list | None:
    shape = getattr(x, "shape", None)
    if shape is None:
        return None
    try:
        return list(shape)
    except TypeError:
        return None


def _rank(x) -> int | None:
    d = _dims(x)
    return None if d is None else len(d)


def _static(d) -> int | None:
    return d if isinstance(d, int) else None


def _same_dim(a, b) -> bool:
    """Whether two dims are known equal: the same int, or the same named symbol."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    va, vb = getattr(a, "value", None), getattr(b, "value", None)
    return va is not None and va == vb and not isinstance(a, int) and not isinstance(b, int)


def _dtype_name(x) -> str | None:
    dt = getattr(x, "dtype", None)
    return None if dt is None else getattr(dt, "name", str(dt))


def _np_dtype(x):
    return {"FLOAT": np.float32, "FLOAT16": np.float16, "DOUBLE": np.float64}.get(_dtype_name(x))


def _mha_schema():
    """The schema of com.microsoft ``MultiHeadAttention`` (version 1, inputs 0-5 and output 0 of
    onnxruntime's ContribOperators.md), for onnxscript, which only knows the ai.onnx schemas."""
    from onnx.defs import OpSchema

    opt = OpSchema.FormalParameterOption.Optional
    P = OpSchema.FormalParameter
    return OpSchema(
        "MultiHeadAttention", "com.microsoft", 1,
        inputs=[P("query", "T"), P("key", "T", param_option=opt), P("value", "T", param_option=opt),
                P("bias", "T", param_option=opt), P("key_padding_mask", "M", param_option=opt),
                P("attention_bias", "T", param_option=opt)],
        outputs=[P("output", "T")],
        type_constraints=[("T", ["tensor(float)", "tensor(float16)"], ""), ("M", ["tensor(int32)"], "")],
        attributes=[OpSchema.Attribute("num_heads", OpSchema.AttrType.INT, ""),
                    OpSchema.Attribute("unidirectional", OpSchema.AttrType.INT, "", required=False),
                    OpSchema.Attribute("scale", OpSchema.AttrType.FLOAT, "", required=False),
                    OpSchema.Attribute("mask_filter_value", OpSchema.AttrType.FLOAT, "", required=False)])


def translations(target) -> dict[Any, Any]:
    import onnx
    import onnx_ir as ir
    from onnxscript import opset18 as op
    from onnxscript.values import Op, Opset

    form = "decompose" if target is None else target.attention
    mha = Op(Opset("com.microsoft", 1), "MultiHeadAttention", _mha_schema())
    FLOAT, DOUBLE = onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE

    # ---------------------------------------------------------------- small builders

    # the math dtype of the translation being built (numpy), for constants whose ``like`` is an intermediate
    # value (the tracer knows the dtypes of a translation's inputs, not of the values it builds)
    cur = {"np": None}

    def const(value: float, like):
        """A 0-d constant of ``like``'s dtype (exact in fp64)."""
        npd = _np_dtype(like) or cur["np"]
        if npd is None:
            return op.CastLike(op.Constant(value_float=value), like)
        return op.Constant(value=ir.tensor(np.array(value, dtype=npd)))

    def ints(*v: int):
        return op.Constant(value_ints=list(v))

    def axes_last():
        return ints(-1)

    def dim(x, i: int):
        """``x.shape[i]`` as a 1-D int64 tensor of one element."""
        return op.Shape(x, start=i, end=i + 1 if i != -1 else None)

    def scalar(v1d):
        return op.Squeeze(v1d, ints(0))

    def acc_of(x):
        """(cast to the math dtype, the math dtype's TensorProto code): fp32 for fp16, else the input's."""
        name = _dtype_name(x)
        if name == "DOUBLE":
            return x, DOUBLE
        if name == "FLOAT":
            return x, FLOAT
        return op.Cast(x, to=FLOAT), FLOAT

    def causal_keep(L1d, S1d):
        """Top-left causal mask (L, S) bool: key j allowed iff j <= i."""
        zero, one = ints(0), ints(1)
        i = op.Range(scalar(zero), scalar(L1d), scalar(one))
        j = op.Range(scalar(zero), scalar(S1d), scalar(one))
        return op.LessOrEqual(op.Unsqueeze(j, ints(0)), op.Unsqueeze(i, ints(1)))

    def zero_poison(x, axes: list[int]):
        """``sum(x * 0)`` over ``axes`` (keepdims): 0 where x is finite, NaN where it holds NaN or inf."""
        return op.ReduceSum(op.Mul(x, const(0.0, x)), ints(*axes), keepdims=1)

    def scores_5d(q, k, v):
        """Grouped-query views: q (B, Hkv, g, L, E), k (B, Hkv, 1, S, E), v (B, Hkv, 1, S, Ev)."""
        shape5 = op.Concat(dim(q, 0), dim(k, 1), op.Div(dim(q, 1), dim(k, 1)), dim(q, 2), dim(q, 3), axis=0)
        return op.Reshape(q, shape5), op.Unsqueeze(k, ints(2)), op.Unsqueeze(v, ints(2))

    def qk_matmul(q, k, v, grouped: bool, rank: int):
        """``q @ k^T`` in the layout of q's heads: (..., Hq, L, S); and how to apply ``w @ v``."""
        if grouped:
            q5, k5, v5 = scores_5d(q, k, v)
            s5 = op.MatMul(q5, op.Transpose(k5, perm=[0, 1, 2, 4, 3]))
            s = op.Reshape(s5, op.Concat(dim(q, 0), dim(q, 1), dim(q, 2), dim(k, 2), axis=0))

            def pv(w):
                w5 = op.Reshape(w, op.Concat(dim(q, 0), dim(k, 1), ints(-1), dim(q, 2), dim(k, 2), axis=0))
                o5 = op.MatMul(w5, v5)
                return op.Reshape(o5, op.Concat(dim(q, 0), dim(q, 1), dim(q, 2), dim(v, 3), axis=0))

            return s, pv
        perm = list(range(rank - 2)) + [rank - 1, rank - 2]
        s = op.MatMul(q, op.Transpose(k, perm=perm))
        return s, (lambda w: op.MatMul(w, v))

    def default_scale(q) -> Any:
        E = _static(_dims(q)[-1])
        if E is not None:
            return 1.0 / math.sqrt(E) if E else 1.0
        return None

    def scale_value(query, scale):
        """The scale as a 0-d tensor of the math dtype (``cur``); ``query`` the translation's input."""
        if scale is None:
            scale = default_scale(query)
        if scale is not None:
            return op.Constant(value=ir.tensor(np.array(float(scale), dtype=cur["np"])))
        e = op.Cast(dim(query, -1), to=DOUBLE if cur["np"] is np.float64 else FLOAT)
        return op.Reciprocal(op.Sqrt(e))

    def zero_rows(out, flag, v, q, grouped_v: bool):
        """Rows with ``flag`` (..., L, 1) set to ``0 @ V``: 0, or NaN per column where V holds NaN / inf."""
        vv = v
        if grouped_v:
            g = op.Div(dim(q, 1), dim(v, 1))
            vv = op.Reshape(op.Expand(op.Unsqueeze(v, ints(2)),
                                      op.Concat(ints(1, 1), g, ints(1, 1), axis=0)),
                            op.Concat(dim(v, 0), ints(-1), dim(v, 2), dim(v, 3), axis=0))
        return op.Where(flag, zero_poison(vv, [-2]), out)

    def no_key(seen):
        """Per row (..., L, 1): whether the bool ``seen`` (..., L, S) has no key at all."""
        zero = op.Constant(value=ir.tensor(np.array(0.0, dtype=np.float32)))
        return op.Equal(op.ReduceMax(op.Cast(seen, to=FLOAT), axes_last(), keepdims=1), zero)

    # ---------------------------------------------------------------- exact path for non-finite q / k

    def nonfinite(*xs):
        """A 0-d bool: whether any of ``xs`` holds a NaN or an inf (``sum(x * 0)`` is NaN exactly then)."""
        total = None
        for x in xs:
            t = op.ReduceSum(op.Mul(x, const(0.0, x)), keepdims=0)
            total = t if total is None else op.Add(total, t)
        return op.IsNaN(total)

    branches = itertools.count()

    def branch(build, name: str):
        """What ``build()`` records, moved into a graph of its own (an ``If`` branch, reading the values around
        it), or None when the translation is not being recorded by torch.onnx's tracer."""
        import onnxscript.evaluator

        tracer = onnxscript.evaluator.default()
        nodes = getattr(tracer, "nodes", None)
        if not isinstance(nodes, list):
            return None
        farm = getattr(tracer, "constant_farm", None)
        farm0 = dict(farm) if isinstance(farm, dict) else None
        n0, saved = len(nodes), dict(cur)
        try:
            out = build()
        finally:
            body = nodes[n0:]
            del nodes[n0:]
            if farm0 is not None:       # constants made for the branch live in it: not shared with the graph
                farm.clear()
                farm.update(farm0)
            cur.update(saved)
        n = next(branches)
        for i, value in enumerate(v for node in body for v in node.outputs):
            value.name = f"smx_{name}{n}_{i}"     # unique in the model (ONNX wants one name per value, subgraphs too)
        return ir.Graph((), [out], nodes=body, name=f"{name}{n}")

    def exact_if_nonfinite(fast, q, k, slow):
        """``fast`` (a fused op: exact while every score is finite) unless q or k holds a NaN / inf, where the
        scores' NaN / inf pattern needs the score matrix: then the decomposition ``slow()``. An ``If``, so only
        that case runs it (one ``Mul`` + ``ReduceSum`` over q and k decide)."""
        then_g = branch(slow, "nonfinite_qk")
        if then_g is None:
            return op.Where(nonfinite(q, k), slow(), fast)
        else_g = branch(lambda: op.Identity(fast), "finite_qk")
        return op.If(nonfinite(q, k), then_branch=then_g, else_branch=else_g)

    # ---------------------------------------------------------------- SDPA: the three forms

    def sdpa_decompose(query, key, value, attn_mask, is_causal, scale, enable_gqa):
        """The exact form: ``z = s + mask`` (float mask), ``z = where(keep, s, -inf)`` (bool mask, and the causal
        triangle), ``softmax(z) @ v``; a row with no key (mask all False / -inf) ``0 @ V``, NaN for a float mask
        where ``z`` holds NaN there (torch's ``s + (-inf)``)."""
        rank = _rank(query)
        if rank is None:
            raise OnnxAttentionError("scaled_dot_product_attention: the query's rank is unknown")
        q, acc = acc_of(query)
        cur["np"] = np.float64 if acc == DOUBLE else np.float32
        k, v = op.Cast(key, to=acc), op.Cast(value, to=acc)
        grouped = bool(enable_gqa) and not _same_dim(_dims(query)[-3], _dims(key)[-3])
        if grouped and rank != 4:
            raise OnnxAttentionError("scaled_dot_product_attention with enable_gqa on a non-4-D query has no ONNX "
                                     "translation")
        qs = op.Mul(q, scale_value(query, scale))   # scale folded into q: (..., L, E), not (..., L, S)
        s, pv = qk_matmul(qs, k, v, grouped, rank)
        keep = seen = None                  # keys selected; keys a row has (selected, and not a -inf mask entry)
        additive = attn_mask is not None and _dtype_name(attn_mask) != "BOOL"
        if additive:
            m = op.CastLike(attn_mask, s)
            s = op.Add(s, m)
            seen = op.Not(op.Equal(m, const(NEG_INF, s)))
        elif attn_mask is not None:
            keep = attn_mask
        if is_causal:
            tri = causal_keep(dim(q, -2), dim(k, -2))
            keep = tri if keep is None else op.And(keep, tri)
            seen = None if seen is None else op.And(seen, tri)
        z = s if keep is None else op.Where(keep, s, const(NEG_INF, s))
        out = pv(op.Softmax(z, axis=-1))
        if attn_mask is not None:
            # a row with no key: Softmax gives NaN (exp(-inf - -inf)), torch 0 @ V; decided on the mask
            flag = no_key(seen if additive else keep)
            out = zero_rows(out, flag, v, q, grouped)
            if additive:                    # s + (-inf) is NaN where s is NaN / +inf: so is torch's row
                nan_row = op.IsNaN(op.ReduceSum(z, axes_last(), keepdims=1))
                out = op.Where(op.And(flag, nan_row), const(math.nan, out), out)
        return op.CastLike(out, query)

    def mask_ls(mask, shape_of, q, k):
        """The mask with dims -2, -1 exactly (L, S) (onnxruntime broadcasts neither); ``shape_of``: a value of
        the mask's shape whose static shape is known (the translation's input), or None."""
        d = _dims(shape_of) if shape_of is not None else None
        if d is not None and len(d) >= 2 and _same_dim(d[-2], _dims(q)[-2]) and _same_dim(d[-1], _dims(k)[-2]):
            return mask
        return op.Expand(mask, op.Concat(dim(q, -2), dim(k, -2), axis=0))

    def lowest_to_next(mask):
        """Float mask entries equal to the dtype's lowest finite value -> the next float up (see module doc)."""
        npd = cur["np"]
        lo = np.finfo(npd).min
        up = np.nextafter(lo, npd(0))
        return op.Where(op.Equal(mask, const(float(lo), mask)), const(float(up), mask), mask)

    def attention_op(q, k, v, attn_mask, is_causal, scale, softcap=None):
        from onnxscript import opset23 as op23

        cur["np"] = _np_dtype(q)
        m = None
        if attn_mask is not None:
            if _dtype_name(attn_mask) == "BOOL":
                m = attn_mask
            else:
                m = attn_mask if _dtype_name(attn_mask) == _dtype_name(q) else op.CastLike(attn_mask, q)
                m = lowest_to_next(m)
            m = mask_ls(m, attn_mask, q, k)
        kw: dict[str, Any] = {"is_causal": int(bool(is_causal))}
        if scale is not None:
            kw["scale"] = float(scale)
        if softcap is not None:
            kw["softcap"] = float(softcap)
        y, _, _, _ = op23.Attention(q, k, v, m, **kw)
        return y

    def sdpa_bias(mask, like, L1d, S1d, is_causal: bool):
        """The additive bias (bool -> 0 / -inf) with the causal triangle folded in, or None."""
        bias = None
        if mask is not None:
            if _dtype_name(mask) == "BOOL":
                bias = op.Where(mask, const(0.0, like), const(NEG_INF, like))
            else:
                bias = op.CastLike(mask, like)
        if is_causal:
            tri = op.Where(causal_keep(L1d, S1d), const(0.0, like), const(NEG_INF, like))
            bias = tri if bias is None else op.Add(bias, tri)
        return bias

    def mha_op(q, k, v, attn_mask, is_causal, scale):
        dq, dk, dv = _dims(q), _dims(k), _dims(v)
        cur["np"] = _np_dtype(q)
        H = _static(dq[1])
        grouped = not _same_dim(dq[1], dk[1])
        kk, vv = k, v
        if grouped:
            g = op.Div(dim(q, 1), dim(k, 1))
            rep = op.Concat(ints(1, 1), g, ints(1, 1), axis=0)
            kk = op.Reshape(op.Expand(op.Unsqueeze(k, ints(2)), rep),
                            op.Concat(dim(k, 0), ints(-1), dim(k, 2), dim(k, 3), axis=0))
            vv = op.Reshape(op.Expand(op.Unsqueeze(v, ints(2)), rep),
                            op.Concat(dim(v, 0), ints(-1), dim(v, 2), dim(v, 3), axis=0))
        q3 = op.Reshape(op.Transpose(q, perm=[0, 2, 1, 3]), ints(0, 0, -1))
        if _same_dim(dk[3], dv[3]):
            key_in, value_in = kk, vv               # BNSH: (B, Hq, S, E), no transpose
        else:
            key_in = op.Reshape(op.Transpose(kk, perm=[0, 2, 1, 3]), ints(0, 0, -1))
            value_in = op.Reshape(op.Transpose(vv, perm=[0, 2, 1, 3]), ints(0, 0, -1))
        unidirectional = 0
        bias = None
        if attn_mask is not None or is_causal:
            if attn_mask is None and _same_dim(dq[2], dk[2]):
                unidirectional = 1                  # exact without a bias and with L == S only
            else:
                bias = sdpa_bias(attn_mask, q, dim(q, 2), dim(k, 2), is_causal)
                if not is_causal:                   # (the causal triangle made it (..., L, S) already)
                    bias = mask_ls(bias, attn_mask, q, k)
                r = max(2, _rank(attn_mask) or 2)
                if r < 4:
                    bias = op.Unsqueeze(bias, ints(*range(4 - r)))
        kw: dict[str, Any] = {"num_heads": H, "unidirectional": unidirectional}
        if scale is not None:
            kw["scale"] = float(scale)
        y = mha(q3, key_in, value_in, None, None, bias, **kw)
        y = op.Transpose(op.Reshape(y, op.Concat(dim(q, 0), dim(q, 2), ints(H, -1), axis=0)), perm=[0, 2, 1, 3])
        if attn_mask is not None:
            # a row whose bias is all -inf: MultiHeadAttention gives NaN, torch 0 @ V
            flag = op.Equal(op.ReduceMax(bias, axes_last(), keepdims=1), const(NEG_INF, bias))
            y = zero_rows(y, flag, v, q, grouped)
        return y

    def fused_ok(query, key, value, scale=None) -> bool:
        """Whether the fused ops take the call as it is: 4-D fp32 / fp16, one batch size (no broadcast batch),
        a positive scale (onnxruntime refuses others; MultiHeadAttention reads 0 as "the default")."""
        if {_rank(query), _rank(key), _rank(value)} != {4} or _dtype_name(query) not in ("FLOAT", "FLOAT16"):
            return False
        dq, dk, dv = _dims(query), _dims(key), _dims(value)
        if not (_same_dim(dq[0], dk[0]) and _same_dim(dk[0], dv[0]) and _same_dim(dk[1], dv[1])
                and _same_dim(dk[2], dv[2])):
            return False
        return scale is None or scale > 0

    def sdpa(query, key, value, attn_mask=None, dropout_p: float = 0.0, is_causal: bool = False, scale=None,
             enable_gqa: bool = False):
        """``aten::scaled_dot_product_attention``: q (..., Hq, L, E), k (..., Hkv, S, E), v (..., Hkv, S, Ev),
        attn_mask bool / float broadcastable to (..., Hq, L, S) -> (..., Hq, L, Ev) in q's dtype."""
        if dropout_p:
            raise OnnxAttentionError(f"scaled_dot_product_attention with dropout_p={dropout_p} has no exact ONNX "
                                     "form (the dropout mask is random); export the model in eval mode")

        def exact():
            return sdpa_decompose(query, key, value, attn_mask, is_causal, scale, enable_gqa)

        masked = attn_mask is not None or is_causal
        if form == "Attention" and fused_ok(query, key, value, scale):
            y = attention_op(query, key, value, attn_mask, is_causal, scale)
            return exact_if_nonfinite(y, query, key, exact) if masked else y
        if form == "MultiHeadAttention" and fused_ok(query, key, value, scale) and _static(_dims(query)[1]):
            y = mha_op(query, key, value, attn_mask, is_causal, scale)
            return exact_if_nonfinite(y, query, key, exact) if masked else y
        return exact()

    # ---------------------------------------------------------------- smx::attention: the normalizers

    normalizers = normalizer_forms(op, const, ints, axes_last, scalar)

    def smx_decompose(q_in, k_in, v_in, attn_mask, is_causal, scale, softcap, normalizer, norm_param, n_keys):
        q, acc = acc_of(q_in)
        cur["np"] = np.float64 if acc == DOUBLE else np.float32
        k, v = op.Cast(k_in, to=acc), op.Cast(v_in, to=acc)
        grouped = not _same_dim(_dims(q_in)[1], _dims(k_in)[1])
        s, pv = qk_matmul(q, k, v, grouped, 4)
        s = op.Mul(s, const(float(scale), s))
        if softcap is not None:
            cap = const(float(softcap), s)
            s = op.Mul(op.Tanh(op.Div(s, cap)), cap)
        keep = None
        if attn_mask is not None:
            if _dtype_name(attn_mask) == "BOOL":
                keep = attn_mask
            else:
                madd = op.CastLike(attn_mask, s)
                s = op.Add(s, madd)
                keep = op.Not(op.Equal(madd, const(NEG_INF, s)))
        L1d, S1d = dim(q, 2), dim(k, 2)
        if is_causal:
            tri = causal_keep(L1d, S1d)
            keep = tri if keep is None else op.And(keep, tri)
        if n_keys is not None:
            n = op.Max(op.Unsqueeze(op.CastLike(n_keys, s), ints(-1)), const(1.0, s))    # (B, Hq, L, 1)
        else:
            Sf = op.CastLike(S1d, s)
            if is_causal:
                one = scalar(ints(1))
                rows = op.CastLike(op.Range(one, op.Add(scalar(L1d), one), one), s)
                n = op.Unsqueeze(op.Min(rows, Sf), ints(-1))                               # (L, 1)
            else:
                n = op.Unsqueeze(Sf, ints(-1))                                             # (1, 1)
        param = None
        if norm_param is not None:
            param = op.Unsqueeze(op.CastLike(norm_param, s), ints(-1, -2))                 # (B, Hq, 1, 1)
        w = normalizers[normalizer](s, keep, n, param)
        return op.CastLike(pv(w), q_in)

    def smx_attention(q, k, v, attn_mask=None, is_causal: bool = False, scale: float = 1.0, softcap=None,
                      normalizer: str = "softmax", norm_param=None, dropout_p: float = 0.0, seed=None,
                      skip_threshold=None, n_keys=None):
        """``smx::attention``: q (B, Hq, L, E), k (B, Hkv, S, E), v (B, Hkv, S, Ev), attn_mask None or bool /
        float broadcastable to (B, Hq, L, S), norm_param None or (B, Hq), n_keys None or (B, Hq, L) ->
        (out (B, Hq, L, Ev) in q's dtype, stats (B, Hq, L, 2) fp32 zeros)."""
        if dropout_p:
            raise OnnxAttentionError(f"smx::attention with dropout_p={dropout_p} has no exact ONNX form")
        if normalizer not in normalizers:
            raise OnnxAttentionError(f"smx::attention: unknown normalizer {normalizer!r}")
        if (normalizer == "softmax" and softcap is not None and form == "Attention" and fused_ok(q, k, v, scale)
                and _dtype_name(attn_mask) in (None, "BOOL", _dtype_name(q))):
            # exact while the scores are finite; smx::attention selects masked keys out (a NaN score there is
            # dropped), which the op cannot: NaN / inf in q or k take the decomposition
            out = exact_if_nonfinite(attention_op(q, k, v, attn_mask, is_causal, scale, softcap=softcap), q, k,
                                     lambda: smx_decompose(q, k, v, attn_mask, is_causal, scale, softcap, normalizer,
                                                           norm_param, n_keys))
        else:
            out = smx_decompose(q, k, v, attn_mask, is_causal, scale, softcap, normalizer, norm_param, n_keys)
        stats = op.Expand(op.Constant(value=ir.tensor(np.zeros((), dtype=np.float32))),
                          op.Concat(dim(q, 0), dim(q, 1), dim(q, 2), ints(2), axis=0))
        return out, stats

    return {torch.ops.aten.scaled_dot_product_attention.default: sdpa,
            torch.ops.smx.attention.default: smx_attention}


def refuse(name: str, args: dict, node: torch.fx.Node) -> str | None:
    if name != "attention":
        return None
    from ...kernels.attention import NORMALIZERS

    if args.get("dropout_p"):
        return (f"with dropout_p={args['dropout_p']} has no exact ONNX form (the dropout mask is random); export "
                "the model in eval mode (dropout_p=0)")
    if args.get("skip_threshold") is not None:
        return ("with skip_threshold (BLASST tile skipping, an approximation of the CUDA kernel) has no ONNX "
                "translation; pass skip_threshold=None")
    if args.get("normalizer", "softmax") not in NORMALIZERS:
        return f"with the unknown normalizer {args.get('normalizer')!r} has no ONNX translation"
    return None
