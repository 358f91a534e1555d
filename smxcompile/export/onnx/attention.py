"""ONNX translations of attention: ``aten.scaled_dot_product_attention`` (what softmax-normalizer sites become)
and ``smx::attention`` (every other normalizer, and soft-capping), per :attr:`OnnxTarget.attention`.

Each translation module of :mod:`smxcompile.export.onnx` has ``translations(target) -> {OpOverload: onnxscript
function}`` and ``refuse(name, args, node) -> str | None`` (see :mod:`.softmax`).

SDPA keeps torch's semantics: q (..., Hq, L, E), k (..., Hkv, S, E), v (..., Hkv, S, Ev) -> (..., Hq, L, Ev) in
q's dtype; a bool mask and ``is_causal`` (top-left) *select* keys, a float mask is *added*; a row with no key is
``0 @ V``. Its forms, by ``target.attention``:

- ``"Attention"``: the ONNX ``Attention`` op (opset 23); ``finfo.min`` mask entries moved one float up and masks
  expanded to (..., L, S), where onnxruntime differs from torch.
- ``"MultiHeadAttention"``: onnxruntime's com.microsoft op; ``unidirectional`` only without a mask and with
  L == S, fully masked rows set to ``0 @ V``.
- ``"decompose"``: ``MatMul`` / ``Softmax`` / ``MatMul``, standard ops at any opset, fp16 computed in fp32.

The fused ops add every mask to the scores, so they are exact while q and k are finite; an ``If`` on
``isnan(sum(q * 0) + sum(k * 0))`` runs the decomposition otherwise. A call a fused op cannot take (not 4-D,
fp64, a broadcast batch, scale <= 0, a symbolic head count for MultiHeadAttention) is decomposed.

``smx::attention``: q (B, Hq, L, E), k / v (B, Hkv, S, E / Ev), decomposed op for op from the reference functions
of :data:`smxcompile.kernels.attention.NORMALIZERS` (:mod:`.attention_normalizers`), math in fp32 (fp64 for
fp64), ``stats`` zeros. Under ``"Attention"`` a soft-capped softmax site is the op with ``softcap``, behind the
same ``If``. ``dropout_p > 0`` raises :class:`OnnxAttentionError`; :func:`refuse` also turns down
``skip_threshold``.

The semantics kept, and each onnxruntime difference with its fix-up: docs/DESIGN.md, 'ONNX attention: the
semantics kept and onnxruntime's differences'.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .attention_builder import AttentionBuilder, dims, dtype_name, mha_schema, numpy_dtype, rank, same_dim, static_dim
from ...kernels.attention.reference import NORMALIZERS
from .attention_normalizers import NEG_INF, normalizer_forms


class OnnxAttentionError(RuntimeError):
    """An attention call that has no exact ONNX form (raised while translating)."""


def math_builder(builder: AttentionBuilder, acc: int) -> AttentionBuilder:
    """``builder`` with the numpy math dtype of TensorProto code ``acc`` (fp64 or fp32)."""
    import onnx

    return builder.with_math(np.float64 if acc == onnx.TensorProto.DOUBLE else np.float32)


def sdpa_decomposition(base: AttentionBuilder, query, key, value, attn_mask, is_causal, scale, enable_gqa):
    """The exact form: ``z = s + mask`` (float mask), ``z = where(keep, s, -inf)`` (bool mask, causal triangle),
    ``softmax(z) @ v``; a row with no key ``0 @ V``, NaN for a float mask where ``z`` holds NaN there."""
    tensor_rank = rank(query)
    if tensor_rank is None:
        raise OnnxAttentionError("scaled_dot_product_attention: the query's rank is unknown")
    q, acc = base.acc_of(query)
    builder = math_builder(base, acc)
    op = builder.op
    k, v = op.Cast(key, to=acc), op.Cast(value, to=acc)
    grouped = bool(enable_gqa) and not same_dim(dims(query)[-3], dims(key)[-3])
    if grouped and tensor_rank != 4:
        raise OnnxAttentionError("scaled_dot_product_attention with enable_gqa on a non-4-D query has no ONNX "
                                 "translation")
    scaled_q = op.Mul(q, builder.scale_value(query, scale))   # scale folded into q: (..., L, E), not (..., L, S)
    scores, times_v = builder.qk_matmul(scaled_q, k, v, grouped, tensor_rank)
    keep = seen = None                  # keys selected; keys a row has (selected, and not a -inf mask entry)
    additive = attn_mask is not None and dtype_name(attn_mask) != "BOOL"
    if additive:
        mask = op.CastLike(attn_mask, scores)
        scores = op.Add(scores, mask)
        seen = op.Not(op.Equal(mask, builder.const(NEG_INF, scores)))
    elif attn_mask is not None:
        keep = attn_mask
    if is_causal:
        triangle = builder.causal_keep(builder.dim(q, -2), builder.dim(k, -2))
        keep = triangle if keep is None else op.And(keep, triangle)
        seen = None if seen is None else op.And(seen, triangle)
    z = scores if keep is None else op.Where(keep, scores, builder.const(NEG_INF, scores))
    out = times_v(op.Softmax(z, axis=-1))
    if attn_mask is not None:
        # Softmax gives NaN on a row with no key (exp(-inf - -inf)), torch 0 @ V: decided on the mask
        flag = builder.no_key(seen if additive else keep)
        out = builder.zero_rows(out, flag, v=v, q=q, grouped_v=grouped)
        if additive:                    # s + (-inf) is NaN where s is NaN / +inf: so is torch's row
            nan_row = op.IsNaN(op.ReduceSum(z, builder.axes_last(), keepdims=1))
            out = op.Where(op.And(flag, nan_row), builder.const(float("nan"), out), out)
    return op.CastLike(out, query)


def attention_23(base: AttentionBuilder, q, k, v, attn_mask, is_causal, scale, softcap=None):
    """The ONNX ``Attention`` op (opset 23), 4-D fp32 / fp16 inputs; exact while q and k are finite."""
    from onnxscript import opset23

    builder = base.with_math(numpy_dtype(q))
    mask = None
    if attn_mask is not None:
        if dtype_name(attn_mask) == "BOOL":
            mask = attn_mask
        else:
            mask = attn_mask if dtype_name(attn_mask) == dtype_name(q) else builder.op.CastLike(attn_mask, q)
            mask = builder.lowest_to_next(mask)
        mask = builder.mask_ls(mask, attn_mask, q, k)
    attributes: dict[str, Any] = {"is_causal": int(bool(is_causal))}
    if scale is not None:
        attributes["scale"] = float(scale)
    if softcap is not None:
        attributes["softcap"] = float(softcap)
    out, _, _, _ = opset23.Attention(q, k, v, mask, **attributes)
    return out


def multi_head_attention(base: AttentionBuilder, mha, q, k, v, attn_mask, is_causal, scale):
    """com.microsoft ``MultiHeadAttention`` (``mha``, the op) of 4-D fp32 / fp16 inputs with a static head count;
    exact while q and k are finite."""
    builder = base.with_math(numpy_dtype(q))
    op, dim = builder.op, builder.dim
    query_dims, key_dims, value_dims = dims(q), dims(k), dims(v)
    heads = static_dim(query_dims[1])
    grouped = not same_dim(query_dims[1], key_dims[1])
    key_heads, value_heads = (builder.repeat_heads(k, q), builder.repeat_heads(v, q)) if grouped else (k, v)
    query_in = op.Reshape(op.Transpose(q, perm=[0, 2, 1, 3]), builder.ints(0, 0, -1))
    if same_dim(key_dims[3], value_dims[3]):
        key_in, value_in = key_heads, value_heads       # BNSH: (B, Hq, S, E), no transpose
    else:
        key_in = op.Reshape(op.Transpose(key_heads, perm=[0, 2, 1, 3]), builder.ints(0, 0, -1))
        value_in = op.Reshape(op.Transpose(value_heads, perm=[0, 2, 1, 3]), builder.ints(0, 0, -1))
    unidirectional = 0
    bias = None
    if attn_mask is not None or is_causal:
        if attn_mask is None and same_dim(query_dims[2], key_dims[2]):
            unidirectional = 1                          # bottom-right aligned: exact without a bias and L == S only
        else:
            bias = builder.sdpa_bias(attn_mask, like=q, query_len=dim(q, 2), key_len=dim(k, 2), is_causal=is_causal)
            if not is_causal:                           # (the causal triangle made it (..., L, S) already)
                bias = builder.mask_ls(bias, attn_mask, q, k)
            mask_rank = max(2, rank(attn_mask) or 2)
            if mask_rank < 4:
                bias = op.Unsqueeze(bias, builder.ints(*range(4 - mask_rank)))
    attributes: dict[str, Any] = {"num_heads": heads, "unidirectional": unidirectional}
    if scale is not None:
        attributes["scale"] = float(scale)
    out = mha(query_in, key_in, value_in, None, None, bias, **attributes)
    out = op.Transpose(op.Reshape(out, op.Concat(dim(q, 0), dim(q, 2), builder.ints(heads, -1), axis=0)),
                       perm=[0, 2, 1, 3])
    if attn_mask is not None:
        # MultiHeadAttention gives NaN on a row whose bias is all -inf, torch 0 @ V
        flag = op.Equal(op.ReduceMax(bias, builder.axes_last(), keepdims=1), builder.const(NEG_INF, bias))
        out = builder.zero_rows(out, flag, v=v, q=q, grouped_v=grouped)
    return out


def fused_ok(query, key, value, scale=None) -> bool:
    """Whether the fused ops take the call: 4-D fp32 / fp16, one batch size (none broadcast), a positive scale
    (onnxruntime refuses others; MultiHeadAttention reads 0 as "the default")."""
    if {rank(query), rank(key), rank(value)} != {4} or dtype_name(query) not in ("FLOAT", "FLOAT16"):
        return False
    query_dims, key_dims, value_dims = dims(query), dims(key), dims(value)
    if not (same_dim(query_dims[0], key_dims[0]) and same_dim(key_dims[0], value_dims[0])
            and same_dim(key_dims[1], value_dims[1]) and same_dim(key_dims[2], value_dims[2])):
        return False
    return scale is None or scale > 0


def key_counts(builder: AttentionBuilder, scores, n_keys, is_causal, query_len, key_len):
    """Keys per row, as the normalizers' ``n``: ``n_keys`` (B, Hq, L, 1), else ``min(i + 1, S)`` (L, 1) under
    ``is_causal``, else S (1, 1)."""
    op = builder.op
    if n_keys is not None:
        return op.Max(op.Unsqueeze(op.CastLike(n_keys, scores), builder.ints(-1)), builder.const(1.0, scores))
    key_count = op.CastLike(key_len, scores)
    if not is_causal:
        return op.Unsqueeze(key_count, builder.ints(-1))
    one = builder.scalar(builder.ints(1))
    rows = op.CastLike(op.Range(one, op.Add(builder.scalar(query_len), one), one), scores)
    return op.Unsqueeze(op.Min(rows, key_count), builder.ints(-1))


def smx_decomposition(base: AttentionBuilder, q_in, k_in, v_in, attn_mask, is_causal, scale, softcap, normalizer,
                      norm_param, n_keys):
    """``smx::attention``'s output op for op: scaled, soft-capped (before the mask) scores, masked keys selected
    out, the normalizer's weights times v; in q's dtype."""
    q, acc = base.acc_of(q_in)
    builder = math_builder(base, acc)
    op = builder.op
    k, v = op.Cast(k_in, to=acc), op.Cast(v_in, to=acc)
    grouped = not same_dim(dims(q_in)[1], dims(k_in)[1])
    scores, times_v = builder.qk_matmul(q, k, v, grouped, 4)
    scores = op.Mul(scores, builder.const(float(scale), scores))
    if softcap is not None:
        cap = builder.const(float(softcap), scores)
        scores = op.Mul(op.Tanh(op.Div(scores, cap)), cap)
    keep = None
    if attn_mask is not None:
        if dtype_name(attn_mask) == "BOOL":
            keep = attn_mask
        else:
            mask = op.CastLike(attn_mask, scores)
            scores = op.Add(scores, mask)
            keep = op.Not(op.Equal(mask, builder.const(NEG_INF, scores)))
    query_len, key_len = builder.dim(q, 2), builder.dim(k, 2)
    if is_causal:
        triangle = builder.causal_keep(query_len, key_len)
        keep = triangle if keep is None else op.And(keep, triangle)
    n = key_counts(builder, scores, n_keys=n_keys, is_causal=is_causal, query_len=query_len, key_len=key_len)
    param = None
    if norm_param is not None:
        param = op.Unsqueeze(op.CastLike(norm_param, scores), builder.ints(-1, -2))        # (B, Hq, 1, 1)
    forms = normalizer_forms(op, builder.const, builder.ints, builder.axes_last, builder.scalar)
    return op.CastLike(times_v(forms[normalizer](scores, keep, n, param)), q_in)


def translations(target) -> dict[Any, Any]:
    """``{OpOverload: onnxscript function}`` for SDPA and ``smx::attention`` in ``target``'s form of attention
    (None: the decomposition).

    Raises:
        ImportError: onnx / onnxscript not installed.
    """
    import onnx_ir as ir
    from onnxscript.values import Op, Opset

    form = "decompose" if target is None else target.attention
    mha = Op(Opset("com.microsoft", 1), "MultiHeadAttention", mha_schema())
    builder = AttentionBuilder()
    op = builder.op

    def sdpa(query, key, value, attn_mask=None, dropout_p: float = 0.0, is_causal: bool = False, scale=None,
             enable_gqa: bool = False):
        """``aten::scaled_dot_product_attention``: q (..., Hq, L, E), k (..., Hkv, S, E), v (..., Hkv, S, Ev),
        attn_mask bool / float broadcastable to (..., Hq, L, S) -> (..., Hq, L, Ev) in q's dtype."""
        if dropout_p:
            raise OnnxAttentionError(f"scaled_dot_product_attention with dropout_p={dropout_p} has no exact ONNX "
                                     "form (the dropout mask is random); export the model in eval mode")

        def exact():
            return sdpa_decomposition(builder, query, key, value, attn_mask=attn_mask, is_causal=is_causal,
                                      scale=scale, enable_gqa=enable_gqa)

        masked = attn_mask is not None or is_causal
        if form == "Attention" and fused_ok(query, key, value, scale):
            out = attention_23(builder, query, key, value, attn_mask=attn_mask, is_causal=is_causal, scale=scale)
            return builder.exact_if_nonfinite(out, query, key, exact) if masked else out
        if form == "MultiHeadAttention" and fused_ok(query, key, value, scale) and static_dim(dims(query)[1]):
            out = multi_head_attention(builder, mha, query, key, value, attn_mask=attn_mask, is_causal=is_causal,
                                       scale=scale)
            return builder.exact_if_nonfinite(out, query, key, exact) if masked else out
        return exact()

    def smx_attention(q, k, v, attn_mask=None, is_causal: bool = False, scale: float = 1.0, softcap=None,
                      normalizer: str = "softmax", norm_param=None, dropout_p: float = 0.0, seed=None,
                      skip_threshold=None, n_keys=None):
        """``smx::attention``: q (B, Hq, L, E), k (B, Hkv, S, E), v (B, Hkv, S, Ev), attn_mask None or bool /
        float broadcastable to (B, Hq, L, S), norm_param None or (B, Hq), n_keys None or (B, Hq, L) ->
        (out (B, Hq, L, Ev) in q's dtype, stats (B, Hq, L, 2) fp32 zeros)."""
        if dropout_p:
            raise OnnxAttentionError(f"smx::attention with dropout_p={dropout_p} has no exact ONNX form")

        def exact():
            return smx_decomposition(builder, q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                                     softcap=softcap, normalizer=normalizer, norm_param=norm_param, n_keys=n_keys)

        if (normalizer == "softmax" and softcap is not None and form == "Attention" and fused_ok(q, k, v, scale)
                and dtype_name(attn_mask) in (None, "BOOL", dtype_name(q))):
            # the op adds the mask, smx::attention selects keys out: NaN / inf in q or k take the decomposition
            fused = attention_23(builder, q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                                 softcap=softcap)
            out = builder.exact_if_nonfinite(fused, q, k, exact)
        else:
            out = exact()
        stats = op.Expand(op.Constant(value=ir.tensor(np.zeros((), dtype=np.float32))),
                          op.Concat(builder.dim(q, 0), builder.dim(q, 1), builder.dim(q, 2), builder.ints(2), axis=0))
        return out, stats

    return {torch.ops.aten.scaled_dot_product_attention.default: sdpa,
            torch.ops.smx.attention.default: smx_attention}


def refuse(name: str, args: dict, node: torch.fx.Node) -> str | None:
    """Why one ``smx::attention`` call has no ONNX translation (None when it has one); the export's one check of
    the normalizer's name (the translation trusts it)."""
    if name != "attention":
        return None
    if args.get("dropout_p"):
        return (f"with dropout_p={args['dropout_p']} has no exact ONNX form (the dropout mask is random); export "
                "the model in eval mode (dropout_p=0)")
    if args.get("skip_threshold") is not None:
        return ("with skip_threshold (BLASST tile skipping, an approximation of the CUDA kernel) has no ONNX "
                "translation; pass skip_threshold=None")
    if args.get("normalizer", "softmax") not in NORMALIZERS:
        return f"with the unknown normalizer {args.get('normalizer')!r} has no ONNX translation"
    return None


__all__ = ["OnnxAttentionError", "translations", "refuse", "sdpa_decomposition", "attention_23",
           "multi_head_attention", "smx_decomposition", "fused_ok"]
