"""The attention pass: what a matched block needs before it can be fused (shapes, GQA, a causal or constant mask,
eager's values on fully masked rows), its policy, and its rewrite. Matching is in :mod:`.matcher`, the run-time
code in :mod:`.replacement`."""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
from typing import Any

import torch
from torch.fx import Graph, Node

from ..patterns.constants import ConstEvaluator, additive_keep, is_causal_keep
from ..patterns.masks import ABSORBING, fill_meets_mask, mild_mask
from ..patterns.graph import FLOAT_DTYPES, broadcasts_to, erase_dead_ends, erase_unused_pure, is_mutation, live_nodes, \
    op_label, replace_anchor, same_shape, same_size, static_shape, tensor_val
from ..patterns.writes import mutation_inside
from ..policy import CPU_RULES, FORCE_HINT, Ladder, cpu_threshold, decide, policy_size
from ..protocol import PassContext, RewritePass
from .matcher import AttentionMatch, match_from_pv, match_sdpa
from ..patterns.contraction import contraction
from .operands import softmax_input, ungqa
from ...kernels.attention.masked_rows import keys_last
from .replacement import graph_attention, graph_flex_attention, graph_sdpa


def _differ(a, b) -> bool:
    return isinstance(a, int) and isinstance(b, int) and a != b


def _check_shapes(m: AttentionMatch) -> str:
    qv, kv, vv = m.val("q"), m.val("k"), m.val("v")
    if qv is None or kv is None or vv is None:
        return "q, k or v has no shape information"
    out = tensor_val(m.anchor)
    if min(qv.dim(), kv.dim(), vv.dim()) < 2 or len({qv.dim(), kv.dim(), vv.dim()}) > 1 and (
            m.layouts or m.lead is not None or out is None or not all(     # matmul aligns them from the right
                broadcasts_to(tuple(x.shape[:-2]), tuple(out.shape[:-2])) for x in (qv, kv, vv))):
        return f"q, k, v ranks {qv.dim()}, {kv.dim()}, {vv.dim()} differ (and are regrouped or do not broadcast)"
    if not (qv.dtype == kv.dtype == vv.dtype) or qv.dtype not in FLOAT_DTYPES:
        return f"mixed or non-float q/k/v dtypes ({qv.dtype}, {kv.dtype}, {vv.dtype})"
    if out is None or out.dtype != qv.dtype:
        return f"the attention output dtype {getattr(out, 'dtype', None)} differs from q's {qv.dtype}"
    # the traced graph requires these to agree: symbolic sizes (a KV cache's length) agree at run time
    if _differ(kv.shape[-2], vv.shape[-2]) or _differ(qv.shape[-1], kv.shape[-1]):
        return "q/k/v sizes do not line up"
    if kv.shape[-2] == 0 or qv.shape[-2] == 0:
        return "no keys or no queries: nothing to fuse"
    return ""


def _gqa(m: AttentionMatch, export: bool) -> None:
    """K and V taken un-repeated when both were repeated alike to q's heads, their batch dims q's (the kernels
    broadcast neither), in 4-D for ONNX's Attention."""
    if m.lead is not None or m.layouts:
        return   # regrouped by views or read in another layout: K and V stay as the graph repeats them
    gk, gv = ungqa(m.k), ungqa(m.v)
    if gk is None or gv is None or gk[1] != gv[1]:
        return
    qv = tensor_val(m.q)
    if qv.dim() < 3 or (export and qv.dim() != 4) or not same_size(qv.shape[-3], tensor_val(m.k).shape[-3]) or \
            not all(same_shape(tuple(qv.shape[:-3]), tuple(tensor_val(g[0]).shape[:-3])) for g in (gk, gv)):
        return
    m.dead += gk[2] + gv[2]
    m.k, m.v, m.n_rep = gk[0], gv[0], gk[1]


def _causal_or_const(m: AttentionMatch, consts: ConstEvaluator) -> None:
    """A constant mask that is exactly the causal lower triangle becomes ``is_causal``; an all-zero one goes."""
    if len(m.masks) != 1 or any(m.mask_shapes) or m.masks[0].how == "add" and m.masks[0].value is not None:
        return      # a mask on a view or on a region of the scores: not in (L, S) form
    qv, kv = m.val("q"), m.val("k")
    L, S = qv.shape[-2], kv.shape[-2]
    node, how = m.masks[0].node, m.masks[0].how
    c = consts.value(node)
    if not isinstance(L, int) or not isinstance(S, int) or not isinstance(c, torch.Tensor):
        return
    zero = how in ("add", "sub") and bool((c == 0).all())
    keep = None if zero else additive_keep(-c if how == "sub" else c) if how in ("add", "sub") else \
        ~c if how == "fill" else c
    m.is_causal = keep is not None and is_causal_keep(keys_last(keep) if "scores" in m.layout else keep, L, S)
    if zero or m.is_causal:
        m.dropped.append(node)
        m.masks = []
        m.absorbed += ["zero mask dropped"] if zero else []


def _needs_fixup(m: AttentionMatch, consts: ConstEvaluator) -> bool:
    """Some row may be masked whole (unknown at compile time counts as yes)."""
    if m.is_causal:
        return False
    if m.masked and not m.add_masks:    # constant fills (a sliding window from aranges): is a row masked whole?
        conds = [consts.value(cond) for cond, _, _ in m.masked]
        if not all(isinstance(c, torch.Tensor) for c in conds):
            return True
        hidden = functools.reduce(operator.or_, (c if fill[1] else ~c for c, fill in zip(conds, m.masked)))
        return bool((keys_last(hidden) if "scores" in m.layout else hidden).all(-1).any())
    # two finite masks may still sum to -inf (finfo.min + finfo.min)
    return bool(m.masked) or len(m.add_masks) > 1 or any(not mild_mask(a, consts, m.val("q").dtype)
                                                         for a in m.add_masks)


def _static_shape_ref(r: Node) -> None:
    """``x.expand_as(s)`` -> ``x`` (the op broadcasts masks), ``view_as`` / ``reshape_as`` -> ``s``'s static shape,
    ``type_as`` -> ``to(dtype)``: a mask that reads no score node, so the site's score nodes can go."""
    x, ref = r.args[0], tensor_val(r.args[1])
    # changed in place: the node stays the one the match holds as (part of) a mask
    if r.target == "type_as":
        r.target, r.args = "to", (x, ref.dtype)
    elif r.target == "expand_as":
        r.args = (x, x)
    else:
        r.target, r.args = r.target[:-3], (x, tuple(int(d) for d in ref.shape))


def _interior_escapes(m: AttentionMatch, live: set) -> str:
    """Why an inner value of the site is needed outside it, or "" (users reaching no output: ``m.dead_ends``)."""
    interior = set(m.dead) | set(m.shape_refs)
    for n in m.dead:
        if n is m.anchor:
            continue
        m.dead_ends += [u for u in n.users if u not in interior and u not in live]
        out = [u for u in n.users if u not in interior and u in live]
        if out:
            writes = next((u for u in out if is_mutation(u)), None)
            if writes is not None:
                return (f"the scores are written in place ({op_label(writes)}) where the attention reads them: "
                        "not matched (an out-of-place masked_fill / where / add would be)")
            weights = n is m.softmax or (m.softmax is not None and m.softmax in n.all_input_nodes)
            what = "the attention weights" if weights else "the scores"
            return f"{what} are also read outside the attention (by other ops, or returned as output_attentions): kept"
    return ""


# --------------------------------------------------------------------------- policy


def _checks(m: AttentionMatch, ctx: PassContext, consts: ConstEvaluator, live: set) -> str:
    if why := _check_shapes(m):
        return why
    m.device = tensor_val(m.q).device.type
    if not m.is_sdpa:
        if why := _interior_escapes(m, live):
            return why
        _gqa(m, ctx.export)   # first: the op then reads K and V un-repeated, and the repeats join the pattern
        if (mut := mutation_inside(m.anchor, m.dead)) is not None:
            return f"an in-place {op_label(mut)} runs between the attention's reads of its inputs"
        _causal_or_const(m, consts)
        if fill_meets_mask(m.masked, m.add_masks, consts, m.val("q").dtype):
            return "a finite fill meets an additive mask that may mask too: rows masked whole would weigh differently"
        if _needs_fixup(m, consts) and m.sink is None:   # a finite sink keeps every row's weights
            m.fixup = "auto"
    m.normalizer, m.norm_param = ctx.options.attention_normalizer, ctx.options.attention_norm_param
    if m.sink is not None and (why := _sink_checks(m)):
        return why
    if m.normalizer != "softmax" and "row shift dropped" in m.absorbed:
        return f"the scores are shifted per row, which softmax ignores but {m.normalizer} does not"
    return ""


def _sink_checks(m: AttentionMatch) -> str:
    """Why a site with a sink column cannot be one fused call with an extra key, or ""."""
    if m.normalizer != "softmax" or m.softcap is not None or m.recipe or m.lead is not None \
            or "scores" in m.layout or m.mask_floor is not None:
        return "a sink column with a normalizer, soft-cap, score_mod, floor, views or scores laid out (keys, queries)"
    if not isinstance(m.val("q").shape[-1], int):
        return "a sink column with a symbolic head dim (Inductor cannot lower the fused call on head dim + 1)"
    if any(v is not None and math.isfinite(v) and v > ABSORBING for *_, v in m.masked):
        # a row the fill masks whole weighs the filled entries against the sink in eager, -inf ones here
        return "a sink column beside a finite fill above -1e30: rows masked whole would weigh differently"
    return ""


def _keep(m: AttentionMatch, ctx: PassContext) -> str:
    sdpa = m.is_sdpa and m.normalizer == "softmax"
    return "already torch's fused scaled_dot_product_attention (no normalizer requested)" if sdpa else ""


def _cpu_keep(m: AttentionMatch, ctx: PassContext) -> str:
    """Rules ``attention_min_keys`` (softmax without soft-cap; ``attention_bf16_min_keys`` in bf16),
    ``attention_score_mod_sides`` and ``attention_score_mod_min_keys`` of ``CPU_RULES``."""
    if (m.normalizer != "softmax" or m.softcap is not None) and not m.recipe:
        return ""
    if m.sides:
        rule = CPU_RULES["attention_score_mod_sides"]
        return f"CPU: {rule.rule}: {rule.measured} ({rule.benchmark}; {FORCE_HINT})"
    name = "attention_score_mod_min_keys" if m.recipe else "attention_min_keys"
    if not m.recipe and m.val("q").dtype == torch.bfloat16:
        name = "attention_bf16_min_keys"
    need = cpu_threshold(name)
    S = policy_size(m.val("k").shape[-2], fallback=need)
    if S < need:
        kernel = "FlexAttention" if m.recipe else "torch's fused attention kernel"
        return (f"CPU: {S} keys; below {need} {kernel} was measured no faster than Inductor's code "
                f"({CPU_RULES[name].benchmark.split(';')[0]}; {FORCE_HINT})")
    return ""


def _flex_checks(m: AttentionMatch, ctx: PassContext) -> str:
    """Why a site with a score_mod cannot go to FlexAttention, or ""."""
    if m.normalizer != "softmax" or m.dropout_p or "scores" in m.layout or ctx.export:
        return "a score_mod with a normalizer, dropout, scores laid out (keys, queries), or in an export"
    if m.val("q").dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"FlexAttention on {m.val('q').dtype}"
    vals = [m.val("q"), m.val("k"), m.val("v"), *map(tensor_val, m.sides)]
    if any(static_shape(x) is None for x in vals) or tensor_val(m.anchor).dim() > 4:
        return "a score_mod under symbolic shapes or with more than 4 dims: FlexAttention's (B, H, L, E) not taken"
    if m.device == "cpu" and tensor_val(m.anchor).requires_grad:
        return "FlexAttention has no CPU backward (torch 2.13): a score_mod site that needs gradients is kept"
    return ""


def _last_checks(m: AttentionMatch, ctx: PassContext) -> str:
    if m.recipe:
        return _flex_checks(m, ctx)
    op_route = m.normalizer != "softmax" or m.softcap is not None
    masks = list(m.add_masks) + ([m.sdpa_kwargs.get("attn_mask")] if m.sdpa_kwargs else [])
    if op_route and any(tensor_val(a) is not None and tensor_val(a).requires_grad for a in masks):
        return ("the additive mask (e.g. a learned position bias) needs a gradient, which smx::attention "
                "(normalizer or softcap) does not compute yet")
    return ""


# a block the CPU policy keeps is left to Inductor whole: the softmax pass does not take its softmax
_LADDER = Ladder(keep=_keep, cpu_keep=_cpu_keep, last_checks=_last_checks, keep_whole=frozenset({"cpu"}))


# --------------------------------------------------------------------------- the pass


class AttentionPass(RewritePass):
    """``softmax(q @ k^T * scale + mask) @ v`` in every spelling (see :mod:`.matcher`) -> one fused attention call."""

    name = "attention"

    def find(self, graph: Graph, ctx: PassContext, exclude: set) -> list[AttentionMatch]:
        consts = ConstEvaluator()   # dropped with this analysis: no evaluated mask outlives it
        live = live_nodes(graph)
        ladder = dataclasses.replace(_LADDER, checks=lambda m, c: _checks(m, c, consts, live))
        out: list[AttentionMatch] = []
        claimed: set[Node] = set()
        for n in graph.nodes:
            if n in exclude or n in claimed:
                continue
            m = None
            if contraction(n) is not None:
                m = match_from_pv(n, consts)
                if m is not None and m.action == "skipped":   # a score chain of other pointwise changes
                    alt = match_from_pv(n, consts, score_mod=True)
                    m = alt if alt is not None and alt.action == "rewritten" else m
            elif n.op == "call_function" and n.target is torch.nn.functional.scaled_dot_product_attention:
                m = match_sdpa(n)
            if m is None or any(d in exclude for d in m.dead):
                continue
            m.prefix = ctx.prefix
            decide(m, ctx, ladder)
            if m.claims():
                claimed.update(m.dead)
            out.append(m)
        return out

    def rewrite(self, graph: Graph, m: AttentionMatch, ctx: PassContext) -> None:
        """Replace the site by a :func:`graph_attention` / :func:`graph_sdpa` call and delete the dead pattern."""
        erase_dead_ends(graph, m.dead_ends)
        dead = set(m.dead)
        for r in m.shape_refs:
            if r.args[1] in dead:
                _static_shape_ref(r)
        fn, args, kwargs = _call(m, lambda n: n, dropout_p=m.dropout_p, export=ctx.export)
        with graph.inserting_before(m.anchor):
            call = graph.call_function(fn, args, kwargs)
        replace_anchor(graph, m.anchor, call, call, [n for n in m.dead if n is not m.anchor])
        erase_unused_pure(graph, m.dropped)

    def guard(self, graph: Graph, m: AttentionMatch, ctx: PassContext) -> None:
        """The block's softmax (over a dim that is not the key dim) becomes ``smx::softmax``: an opaque op to
        Inductor's pattern matcher, so its attention fusion cannot take the block (pytorch#196468)."""
        sm = m.softmax
        x, dim, dtype = softmax_input(sm)
        with graph.inserting_before(sm):
            call = graph.call_function(torch.ops.smx.softmax.default, (x, dim, 1.0, None, None, dtype, False))
            out = graph.call_function(operator.getitem, (call, 0))
        replace_anchor(graph, sm, call, out, [])

    def checkable(self, m: AttentionMatch) -> bool:
        # a requested normalizer changes the math on purpose: only softmax sites can be checked against eager
        return m.action == "rewritten" and m.normalizer == "softmax"

    def check_inputs(self, m: AttentionMatch) -> list[Node]:
        ins = [m.q, m.k, m.v, *(k.node for k in m.masks), *m.sides, *(t for t, _ in m.scale_tensors)]
        if m.is_sdpa:
            ins += [a for a in m.sdpa_kwargs.values() if isinstance(a, Node)]
        return [n for n in ins if isinstance(n, Node)]

    def run_site(self, m: AttentionMatch, values: dict[str, Any]):
        """The rewritten site's output on captured values."""
        fn, args, kwargs = _call(m, lambda n: values[n.name] if isinstance(n, Node) else n, dropout_p=0.0)
        return fn(*args, **kwargs)


def _call(m: AttentionMatch, g, *, dropout_p: float, export: bool = False):
    """``(function, args, kwargs)`` of the site's run-time call, each input mapped by ``g`` (to itself for the
    graph, to its captured value for a check)."""
    if m.is_sdpa:
        return graph_sdpa, (g(m.q), g(m.k), g(m.v), {k: g(v) for k, v in m.sdpa_kwargs.items()}), {
            "normalizer": m.normalizer, "norm_param": m.norm_param}
    q, k, v, scales = g(m.q), g(m.k), g(m.v), [(g(t), op) for t, op in m.scale_tensors]
    extras = {key: val for key, val in {"lead": m.lead, "mask_floor": m.mask_floor, "safe_softmax": m.safe_softmax,
              "layout": m.layouts, "export": export}.items() if val}      # kept out of the other sites' graphs
    if m.sink:
        extras["sink"] = g(m.sink[0])
    if m.recipe:
        flex = {key: extras[key] for key in ("safe_softmax", "layout") if key in extras}
        return graph_flex_attention, (q, k, v, [g(x) for x in m.sides], scales), {
            "recipe": m.recipe, "scale": float(m.scale), "n_rep": m.n_rep, **flex}
    kinds = [(mk.how, mk.value, shape) for mk, shape in zip(m.masks, m.mask_shapes or [None] * len(m.masks))]
    return graph_attention, (q, k, v, [g(mk.node) for mk in m.masks], scales), {"mask_kinds": kinds,
        "scale": float(m.scale), "softcap": m.softcap, "is_causal": m.is_causal, "dropout_p": dropout_p,
        "n_rep": m.n_rep, "fixup": m.fixup, "normalizer": m.normalizer, "norm_param": m.norm_param, **extras}

__all__ = ["AttentionPass"]
