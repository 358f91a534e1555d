"""Attention by meaning: ``softmax(f(Q K^T)) V``, matched in the Dynamo (pre-grad) graph from the value contraction
(the anchor) upwards: a contraction of Q and K over the head dim (:mod:`..patterns.contraction`, any spelling and
layout); pointwise changes of the scores with side inputs that do not depend on them (scales, a soft-cap, masks
and biases by add, sub, fill or floor, in place or not, on any view that keeps each entry's indices); a softmax
over the index the value contraction sums over (the key index); casts, copies, dropout. What is refused, and the
spellings covered: docs/DESIGN.md, "Attention". FlashAttention: Dao et al. (2022).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch.fx import Node

from ..patterns.casts import holds
from ..patterns.constants import ConstEvaluator, depends_on
from ..patterns.graph import FLOAT_DTYPES, broadcasts_to, canon, cast_dtype, is_safe_softmax, norm_dim, \
    op_label, same_shape, same_size, static_shape, tensor_val
from ..patterns.masks import ABSORBING, MASK_VALUE, is_masking_value
from ..protocol import Match
from ..patterns.contraction import Contraction, Operand, contraction, lead_view, peel, settle, split_view, \
    value_features, view_lead
from ..patterns.selections import no_op_copy
from ..patterns.sinks import dropped_column, drops_sink
from ..patterns.written_softmax import row_statistic
from .scores import flex_sides, score_graph, score_mod_recipe, score_step, score_steps
from .operands import dropout_call, key_side, softmax_input, softmax_interior


class Mask(NamedTuple):
    """One mask of the scores: ``node`` added (``how="add"``; to a region of them only when ``value`` is
    ``(pads, region shape, shape added at)``) or subtracted (``"sub"``), or a bool whose True (``"fill"``) or False
    (``"keep"``) entries are filled with ``value``; applied to the scores viewed as ``level``."""
    node: Node
    how: str
    value: float | tuple | None
    level: Node


@dataclasses.dataclass
class AttentionMatch(Match):
    anchor: Node                          # the P @ V matmul (or the SDPA call)
    softmax: Node | None = None
    q: Node | None = None
    k: Node | None = None                 # (..., Hkv, S, E): un-transposed, un-repeated
    v: Node | None = None
    n_rep: int = 1                        # query heads per kv head (GQA), when K/V were taken un-repeated
    scale: float = 1.0
    scale_tensors: list = dataclasses.field(default_factory=list)   # [(node, "mul" | "div")]
    softcap: float | None = None
    masks: list[Mask] = dataclasses.field(default_factory=list)     # in graph order
    is_causal: bool = False
    dropout_p: float = 0.0
    fixup: str = ""                       # "" | "auto": restore eager's values on fully masked rows
    sdpa_kwargs: dict = dataclasses.field(default_factory=dict)     # for an F.scaled_dot_product_attention site
    spelling: str = ""
    absorbed: list[str] = dataclasses.field(default_factory=list)
    dead: list[Node] = dataclasses.field(default_factory=list)
    normalizer: str = "softmax"
    norm_param: float | None = None
    kind: str = "attention"
    dropped: list = dataclasses.field(default_factory=list)   # mask / value nodes the op no longer reads
    safe_softmax: bool = False            # aten._safe_softmax: a row of -inf gives 0, not NaN
    lead: tuple | None = None             # leading dims q, k, v are regrouped to (views between the matmuls)
    shape_refs: list = dataclasses.field(default_factory=list)  # mask ops reading only a score node's shape
    scale_levels: list = dataclasses.field(default_factory=list)  # [(scale tensor, score node it applies at)]
    mask_floor: float | None = None       # max(s, floor) after the masks: masking values clamped there
    mask_shapes: list = dataclasses.field(default_factory=list)   # per mask: the shape of its view of the scores
    dead_ends: list = dataclasses.field(default_factory=list)     # users of inner values that reach no output
    layout: dict = dataclasses.field(default_factory=dict)  # "q".."scores" -> permutation; "v_split": value_features
    sink: tuple | None = None             # (column node, first) a logit column the softmax normalizes with the scores
    recipe: tuple = ()                    # other pointwise changes of the scores, replayed as a score_mod
    sides: list = dataclasses.field(default_factory=list)   # their side inputs

    def val(self, role: str):
        """The fake tensor of q, k or v in the op's layout (..., L or S, E)."""
        t, fold = Operand(getattr(self, role), self.layout.get(role)).val(), self.layout.get("v_split")
        return t.flatten(-1 - fold) if role == "v" and fold and t is not None else t

    @property
    def layouts(self) -> dict:
        """The permutations the op applies (``graph_attention``'s ``layout``), identities left out."""
        return {r: p for r, p in self.layout.items() if p is not None}

    @property
    def add_masks(self) -> list[Node]:
        return [k.node for k in self.masks if k.how in ("add", "sub")]

    @property
    def masked(self) -> list[tuple]:
        """The fills as ``(bool node, True if True masks, value)``."""
        return [(k.node, k.how == "fill", k.value) for k in self.masks if k.how in ("fill", "keep")]

    @property
    def is_sdpa(self) -> bool:
        """The site is an ``F.scaled_dot_product_attention`` call (not an eager spelling)."""
        return self.anchor.target is F.scaled_dot_product_attention

    def detail(self) -> str:
        parts = [self.spelling, "causal" if self.is_causal else "", *self.absorbed,
                 f"scale={self.scale:.6g}" if self.scale != 1.0 else "",
                 "runtime scale folded into q" if self.scale_tensors else "",
                 f"softcap={self.softcap:g}" if self.softcap is not None else "",
                 ("masks" if len(self.masks) > 1 else "mask") if self.masks else "",
                 f"GQA {self.n_rep} q heads per kv head" if self.n_rep > 1 else "",
                 f"normalizer={self.normalizer}" if self.normalizer != "softmax" else ""]
        return ", ".join(p for p in parts if p)

    def op_name(self) -> str:
        plain = self.normalizer == "softmax" and self.softcap is None     # graph_attention calls torch's SDPA
        return "flex_attention" if self.recipe else "scaled_dot_product_attention" if plain else "smx::attention"


# --------------------------------------------------------------------------- matching


def _weights(a: Operand) -> tuple[Node, list[Node], tuple | None] | None:
    """The softmax whose output ``a`` is (as it is, or with its last two dims swapped: scores laid out (keys,
    queries)), through casts, copies, one dropout, views of the leading dims and a slice of the key index (a
    sink's column dropped): ``(softmax, nodes between, dropout call)``, or None."""
    if a.perm is not None and a.perm != (*range(len(a.perm) - 2), len(a.perm) - 1, len(a.perm) - 2):
        return None
    chain: list[Node] = []
    dropout, n = None, a.node
    while isinstance(n, Node) and len(chain) <= 6:
        if softmax_input(n) is not None:
            return n, chain, dropout
        d = dropout_call(n)
        if (d is None or dropout is not None) and cast_dtype(n) is None and no_op_copy(n) is None \
                and lead_view(n) is None and (a.perm is not None or dropped_column(n) is None):
            return None
        dropout = dropout or d
        chain.append(n)
        n = d[0] if d is not None and dropout is d else n.args[0]
    return None


def match_from_pv(anchor: Node, consts: ConstEvaluator, *, score_mod: bool = False) -> AttentionMatch | None:
    """Walk up from the contraction of the weights with V (either operand order, any layout of V or of the
    output); None when neither operand is a softmax's output. With ``score_mod``, every change of the scores is
    read as a FlexAttention ``score_mod`` (for a chain the other forms do not take)."""
    c = contraction(anchor)
    if c is None or c.bias is not None or c.alpha != 1.0:
        return None
    for pv in (c, c.transposed()):
        views: list[Node] = []
        pv, weights, v_split = value_features(pv, peel(pv.a, views))
        found = _weights(weights)
        if found is not None:
            break
    else:
        return _changed_weights(anchor, c)
    sm, chain, dropout = found
    keys_first = weights.perm is not None      # the weights are read transposed: the key index is dim -2
    chain = views + chain
    v = settle(pv.b)
    x, dim, sm_dtype = softmax_input(sm)
    m = AttentionMatch(anchor=anchor, softmax=sm, v=v.node, safe_softmax=is_safe_softmax(sm))
    m.layout.update(v=v.perm, out=pv.out_perm, v_split=v_split or None)
    m.dead = [anchor, *chain, sm, *softmax_interior(sm)]
    m.dropped += [pv.a.node, pv.b.node]     # reordering views of the operands, erased once unused
    if dropout is not None and dropout[2] and dropout[1] > 0:    # F.dropout(p, training=True)
        m.dropout_p = dropout[1]
        m.absorbed.append(f"dropout p={m.dropout_p:g}")
        if m.dropout_p >= 1.0:
            return _skip(m, "dropout p=1 zeroes every weight: left to Inductor")
    if not isinstance(x, Node) or tensor_val(x) is None:
        return _skip(m, "the softmax input has no shape information")
    nd = tensor_val(x).dim()
    d = norm_dim(dim, nd)
    if keys_first:
        if d != nd - 2:
            return _skip(m, "the weights are contracted over the query index, not the key index the softmax "
                            "normalizes: not attention") if isinstance(score_graph(x, sm), tuple) else None
        m.layout["scores"] = (*range(nd - 2), nd - 1, nd - 2)
    elif d is None or d != nd - 1:
        # Inductor's fuse_attention would take this block for attention over the last dim (pytorch#196468)
        m.guarded = d is not None and not m.safe_softmax   # smx::softmax would give NaN where it gives 0
        return _skip(m, "the softmax runs over the query index (or another index), not the key index" + (
            "; its softmax is handed to Inductor as smx::softmax, which Inductor's attention fusion cannot "
            "take for attention over the last dim (pytorch#196468)" if m.guarded else ""))
    xd = tensor_val(x).dtype
    if sm_dtype is not None and (sm_dtype not in FLOAT_DTYPES or xd not in FLOAT_DTYPES or not holds(sm_dtype, xd)):
        return _skip(m, f"softmax dtype={sm_dtype} rounds its input")
    found = score_graph(x, sm)
    if not isinstance(found, tuple):
        return None if found is None else _skip(m, found)
    qk, path = found
    steps = None if score_mod else score_steps(qk, path, x)
    m = _score_mod(m, qk, path, consts) if steps is None else _scores(m, contraction(qk), steps, consts)
    slices = [c for c in map(dropped_column, chain) if c is not None]
    cols = (static_shape(tensor_val(sm)) or (None,))[-1]
    if (slices or m.sink) and m.action != "skipped" and not (m.sink and len(slices) == 1 and
                                                             drops_sink(*slices[0][1:], cols, m.sink[1])):
        return _skip(m, "the weights are sliced along the key index other than by dropping a sink's column")
    return m


def _changed_weights(anchor: Node, c: Contraction) -> AttentionMatch | None:
    """A skipped site (for the report) where an operand of the contraction is a softmax of scores changed by
    other ops (a mask or gate applied after the normalization): not one attention call. Else None."""
    for side, op in enumerate((c.a, c.b)):
        n, nd = op.node, tensor_val(op.node).dim() if tensor_val(op.node) is not None else 0
        found = _weights(Operand(n))
        summed = (op.perm or tuple(range(nd)))[-1 - side] if nd >= 2 else None   # the index the contraction sums
        if found is not None and isinstance(score_graph(softmax_input(found[0])[0], found[0]), tuple):
            return _skip(AttentionMatch(anchor=anchor, softmax=found[0]), "the weights are contracted with V in a "
                         "layout the fused op does not take (V's head dim split, or the scores' dims reordered)"
                         if summed == norm_dim(softmax_input(found[0])[1], nd) else "the weights are mixed over "
                         "another index after the softmax (heads, as talking heads do), not one attention call")
        for _ in range(4):
            inner = contraction(n) if isinstance(n, Node) else None
            if inner is not None and any(_weights(peel(o, [])) for o in (inner.a, inner.b)):
                break       # another attention's output, not its weights
            ins = [a for a in n.all_input_nodes if tensor_val(a) is not None] if isinstance(n, Node) else []
            sm = next((a for a in ins if softmax_input(a) is not None), None)
            if sm is not None and isinstance(score_graph(softmax_input(sm)[0], sm), tuple):
                if inner is not None:
                    return None     # that contraction reads the weights: its own row says how
                return _skip(AttentionMatch(anchor=anchor, softmax=sm), f"the weights are changed after the softmax "
                             f"({op_label(n)}): their rows no longer sum to 1, not one attention call")
            if len(ins) != 1:
                break
            n = ins[0]
    return None


def _score_mod(m: AttentionMatch, qk: Node, path: list[Node], consts: ConstEvaluator) -> AttentionMatch:
    sides = flex_sides(qk, path)
    if isinstance(sides, str):
        return _skip(m, sides)
    m.recipe, m.sides = score_mod_recipe(qk, path, sides), sides
    m.dead += path
    m = _scores(m, contraction(qk), [], consts)
    if m.masks or m.lead is not None:
        return _skip(m, "a score_mod with a baddbmm input or views between the matmuls")
    m.absorbed.append(f"score_mod of {len(path)} ops")
    m.route = "attention_score_mod"
    return m


def _scores(m: AttentionMatch, qk: Contraction, steps: list, consts: ConstEvaluator) -> AttentionMatch:
    """Q and K from the score contraction (Q (..., L, E) @ K^T (..., E, S), any layout), then the score chain."""
    want = m.layout.get("scores")      # the softmax says which index is the key: the roles of q and k may swap
    if qk.out_perm != want:
        qk = qk.transposed()
    if qk.out_perm != want:
        return _skip(m, "the scores' last two dims are not the query and key indices")
    q = settle(qk.a)
    kt, key_scales = key_side(qk.b.node) if qk.b.perm is None else (qk.b.node, [])
    k = settle(Operand(kt, qk.b.perm).mT)
    m.q, m.k = q.node, k.node
    m.layout.update(q=q.perm, k=k.perm)
    m.dropped += [qk.a.node, kt]
    m.dead.append(qk.node)
    for node, kind, data in key_scales:   # (q @ (k^T * b)) = (q @ k^T) * b
        m.dead.append(node)
        why = _take_scale(m, kind, data, consts, capped=False, qk=qk.node, level=qk.node) if kind != "copy" else ""
        if why:
            return _skip(m, why)
    m.scale *= qk.alpha     # baddbmm's alpha (1.0 otherwise: exact)
    if qk.bias is not None:      # baddbmm(bias, q, k^T, beta=1): the bias is an additive mask
        if qk.beta != 1.0:
            return _skip(m, f"the scores add the mask times beta={qk.beta:g}")
        why = _take_mask(m, "add", qk.bias, qk.node, qk.node, level=qk.node)
        if why:
            return _skip(m, why)
    m.spelling = f"{op_label(qk.node)}(q, k^T)"
    return _assemble(m, steps, qk.node, consts)


def _skip(m: AttentionMatch, why: str) -> AttentionMatch:
    m.skip(why)
    return m


def _assemble(m: AttentionMatch, steps: list, qk: Node, consts: ConstEvaluator) -> AttentionMatch:
    """Turn the chain of score steps (:func:`.scores.score_steps`) into the op's scale, soft-cap and masks, or skip:
    scales, then ``tanh`` (a soft-cap; scales after it scale the cap), then masks."""
    phase = 0                   # 0: before a soft-cap, 1: after it, 2: after a mask
    level = qk                  # the node whose shape the scores have where each step applies (views regroup)
    split: set = set()          # views splitting the query and key indices (B, Lh, Lw, Sh, Sw)
    shifted = False             # a row shift was dropped: scales and masks may follow, not a soft-cap or floor
    for node, s in steps:
        m.dead.append(node)
        step = score_step(node, s)
        if step is None:
            c = canon(node)
            return _skip(m, f"{c[0] if c else op_label(node)} between the scores and the softmax is "
                            "not a scale, soft-cap, mask, cast or view")
        kind, data = step
        if phase == 3 and kind not in ("cast", "copy", "add", "sub"):
            return _skip(m, "the scores are changed after a sink column is appended")
        if kind == "cast" and not data:
            return _skip(m, f"the scores are rounded by a cast to {cast_dtype(node)} before the softmax")
        if kind == "view":
            level = node
            if lead_view(node) is None:     # it must split the query and key indices, not mix them
                rows, cols = (static_shape(tensor_val(qk)) or (None, None))[-2:]
                if rows is None or split_view(node, rows, cols) is None:
                    return _skip(m, "the scores are viewed in a shape that mixes the query and key indices")
                split.add(level)
            continue
        if kind in ("add", "sub", "fill", "region") and m.mask_floor is not None:
            return _skip(m, "a mask is applied after the scores are clamped below")
        why = ""
        if kind in ("scale", "scale_t"):
            why = "the scores are scaled after the mask is applied" if phase == 2 else \
                _take_scale(m, kind, data, consts, capped=phase == 1, qk=qk, level=level, split=level in split)
        elif kind == "tanh":
            why = "soft-capping after another soft-cap, a mask or a row shift" if phase or shifted else ""
            m.softcap, phase = 1.0, 1
        elif kind in ("add", "sub"):
            before = len(m.masks)
            why = _take_mask(m, kind, data, node, qk, level=level)
            if not why and len(m.masks) == before:
                shifted = True
                continue
            why = why or ("a mask is applied to the sink column too" if phase == 3 else "")
        elif kind == "region":      # s[idx] = s[idx] + b: b padded with zeros to the scores' shape
            m.dead += data.nodes
            why = "a region of scores laid out (keys, queries) is written" if "scores" in m.layout else ""
            for b, at in data.biases:
                why = why or _take_mask(m, "add", b, at, qk, level=level, region=(data.pads, data.shape, tuple(
                    tensor_val(at).shape)))
        elif kind == "fill":
            why = _take_fill(m, data, node if tensor_val(node) is not None else s, qk, consts, level=level)
        elif kind == "sink":
            if m.sink or depends_on(data[0], qk) or tensor_val(data[0]).dtype != tensor_val(s).dtype:
                return _skip(m, "a second column appended to the scores, one computed from them, or of another dtype")
            m.sink, phase = data, 3
            m.absorbed.append("sink column")
            continue
        elif kind == "floor":
            why = _take_floor(m, data, consts) if not shifted else "the scores are clamped below after a row shift"
        if why:
            return _skip(m, why)
        phase = 2 if kind in ("add", "sub", "fill", "floor", "region") else phase
    if split and not same_shape(tuple(tensor_val(softmax_input(m.softmax)[0]).shape[-2:]),
                                tuple(tensor_val(qk).shape[-2:])):
        return _skip(m, "the softmax runs over a part of the key index (the scores viewed with it split)")
    why = _regroup(m, qk, split) if split or any(lead_view(n) is not None for n in m.dead) else ""
    return _skip(m, why) if why else m


def _take_mask(m: AttentionMatch, how: str, mask: Node, node: Node, qk: Node, *, level: Node, fill=None,
               region: tuple | None = None) -> str:
    """Take ``mask`` into the site, applied to the scores at ``node`` (viewed as ``level`` is): added (``how``
    ``"add"``; to a ``region = (pads, region shape, shape at node)`` of them only), subtracted (``"sub"``), or a
    bool whose True (``"fill"``) or False (``"keep"``) entries hold ``fill``, a number. Why not, or ""."""
    mv, sv, dtype = tensor_val(mask), tensor_val(node), tensor_val(qk).dtype
    if fill is None and (mv is None or mv.is_complex() or mv.dim() == 0):
        return "the additive mask is not a real tensor of scores (a 0-d one shifts every score alike)"
    if fill is not None and (mv is None or mv.dtype != torch.bool):
        return "the masked_fill / where condition is not a bool tensor"
    shift = _row_shift(m, mask, node) if fill is None else None
    if shift is not None and depends_on(mask, qk):
        if how != "sub" or not shift:
            return "the scores are shifted per row by a term other than their own row max or logsumexp"
        m.absorbed.append("row shift dropped")   # s - s.amax(-1): softmax is invariant to a shift of each row
        seen, stack = set(m.dead) | {qk}, [mask]     # the statistic's own nodes join the site
        while stack:
            n = stack.pop()
            if isinstance(n, Node) and n not in seen and depends_on(n, qk):
                seen.add(n)
                m.dead.append(n)
                stack += n.all_input_nodes
        return ""
    why = _mask_depends(m, mask, qk) or ("" if sv is not None and broadcasts_to(tuple(mv.shape), tuple(sv.shape))
                                         else "the mask does not broadcast to the scores")
    # a bool (0 / 1) or integer mask takes the scores' dtype, as in eager's type promotion
    if not why and fill is None and not (sv is not None and sv.dtype.is_floating_point):
        why = "the masked scores are not floating-point"
    elif not why and fill is None and mv.dtype.is_floating_point and mv.dtype != sv.dtype \
            and mv.dtype.itemsize > dtype.itemsize:
        why = f"the {mv.dtype} mask promotes the {dtype} scores"
    elif not why and fill is None and sv.dtype.itemsize > dtype.itemsize:
        why = (f"the mask is added to scores cast up from {dtype}: the fused kernel adds it in {dtype}, where its "
               "large values would overflow")
    if not why:
        m.masks.append(Mask(mask, how, fill if region is None else region, level))
    return why


def _row_shift(m: AttentionMatch, term: Node, node: Node) -> bool | None:
    """None: ``term`` is not one value per softmax row; True: the row's own max or logsumexp over the softmax dim
    (``x - x.amax(-1, keepdim=True)``, detached or not: ``x - term`` is finite wherever ``x``'s row is)."""
    x = next((a for a in node.all_input_nodes if a is not term), None)
    xv, tv = tensor_val(x), tensor_val(term)
    dim = norm_dim(softmax_input(m.softmax)[1], xv.dim()) if m.softmax is not None and xv is not None else None
    if dim is None or tv is None or tv.dim() != xv.dim() or not same_size(tv.shape[dim], 1) or \
            tensor_val(softmax_input(m.softmax)[0]).shape != xv.shape:
        return None
    return row_statistic(term, x, dim)


def _take_fill(m: AttentionMatch, fill: tuple, node: Node, qk: Node, consts: ConstEvaluator, *, level: Node) -> str:
    """Take ``fill = (cond, True if True masks, value)`` (see :func:`_take_mask`)."""
    cond, true_masks, value = fill
    val = consts.number(value)
    if val is None:
        return "the masked_fill / where value is not a constant"
    if not is_masking_value(val):
        return f"the masked_fill / where value {val:g} does not mask (needs -inf or <= {MASK_VALUE:g})"
    low = torch.finfo(tensor_val(qk).dtype).min
    if math.isfinite(val) and val < low:     # scores cast up from fp16: the op fills at fp16's min, still masking
        if m.masks:
            return f"a fill of {val:g} with other masks, beyond {tensor_val(qk).dtype}, where the fused kernel runs"
        val = low
    m.dropped += [value] if isinstance(value, Node) else []
    return _take_mask(m, "fill" if true_masks else "keep", cond, node, qk, level=level, fill=val)


def _take_scale(m: AttentionMatch, kind: str, data: Any, consts: ConstEvaluator, *, capped: bool, qk: Node,
                level: Node, split: bool = False) -> str:
    """Fold a scale step (:func:`.scores.score_step`) into the site: a number, or a tensor known at compile time,
    into ``m.scale`` (after a soft-cap into the cap too: ``a c tanh(s / c) = (a c) tanh(a s / (a c))``); any other
    tensor into ``m.scale_tensors``, applied to q at run time. Why it cannot be, or ""."""
    a = data if kind == "scale" else consts.number(data[0])
    if kind == "scale_t" and data[1] == "div" and a:
        a = 1.0 / a
    if capped:
        if a is None or not math.isfinite(a) or a <= 0:
            return "a scale after the soft-cap that is not a positive number known at compile time"
        m.softcap *= a
    elif kind == "scale_t" and (a is None or a == 0 or not math.isfinite(a)):
        t, tv = data[0], tensor_val(data[0])
        if depends_on(t, qk):
            return "the scale depends on the scores"
        if tv is not None and tv.dim() > 0 and (split or "scores" in m.layout):
            return "a factor of the scores viewed with the key index split or first is not a factor of q's rows"
        m.scale_levels.append((t, level))
        m.scale_tensors.append(data)
        return ""
    m.scale *= a
    return ""


def _take_floor(m: AttentionMatch, data: Any, consts: ConstEvaluator) -> str:
    """``max(s, floor)`` after the masks, ``floor`` at or below ``ABSORBING``: the masks are clamped there. Not with
    gradients (rows lifted whole: eager's gradient through the tie differs) or after a fill."""
    floor = consts.number(data)
    grads = any(x is not None and x.requires_grad for x in map(tensor_val, (m.q, m.k, m.v, *m.add_masks)))
    if floor is None or floor > ABSORBING or m.masked or grads:
        return f"the scores are clamped below at a value above {ABSORBING:g}, after a fill, or with gradients"
    m.mask_floor = floor if m.mask_floor is None else max(m.mask_floor, floor)
    m.dropped += [data] if isinstance(data, Node) else []
    return ""


def _regroup(m: AttentionMatch, qk: Node, split: set) -> str:
    """Views regroup the leading dims between the matmuls (or split the query and key indices: ``split``): the
    op runs on q, k, v grouped as the masks see the scores (else as V is), its output grouped as V. Why not, or ""."""
    if m.layouts:
        return "views regroup the leading dims of operands read in another layout"
    vals = [tensor_val(x) for x in (m.q, m.k, m.v, qk, m.anchor)]
    if any(v is None for v in vals):
        return "views between the attention matmuls without shape information"
    qs, ks, vs, qks, outs = (tuple(v.shape[:-2]) for v in vals)
    # the views are valid in the graph and keep the last two dims, so every level holds as many (L, S)
    # slices as q; the op needs q, k and the scores grouped alike, and returns in V's grouping
    if not (same_shape(qs, ks) and same_shape(qs, qks) and same_shape(vs, outs)):
        return "q, k and v are not regrouped alike by the views between the attention matmuls"
    mask_levels = {k.level for k in m.masks}   # a baddbmm bias applies at the contraction
    if not mask_levels:
        lead = vs
    elif len(mask_levels) > 1 or mask_levels & split:   # each mask expanded to its view, regrouped as q is
        lead = qs
        for level in (k.level for k in m.masks):
            shape = None if level is qk else static_shape(tensor_val(level))
            if level is not qk and shape is None:
                return "masks applied to the scores viewed in different shapes, with symbolic sizes"
            m.mask_shapes.append(None if shape is None else tuple(shape))
    else:
        level = next(iter(mask_levels))
        lead = qs if level is qk else view_lead(level)
    if lead is None:
        return "the view before the mask gives its shape in a form that cannot be replayed"
    for t, level in m.scale_levels:     # a per-row factor keeps its place in the dims the regrouping keeps
        tv = tensor_val(t)
        at = tuple(tensor_val(level).shape[:-2])
        if tv is not None and tv.dim() > 2 and not all(
                same_size(d, 1) or (len(g) >= i and same_size(d, g[-i]))
                for g in (at, tuple(lead)) for i, d in enumerate(reversed(tuple(tv.shape[:-2])), 1)):
            return "views regroup the head dims that a per-row factor of the scores reads"
    m.lead = tuple(lead)
    m.absorbed.append("views")
    return ""


def _mask_depends(m: AttentionMatch, mask: Node, qk: Node) -> str:
    """Why ``mask`` cannot be taken into the op, or "". A mask that reads only the scores' shape
    (``pad.expand_as(scores)``, DistilBERT) is taken: those reads go to ``m.shape_refs``, rewritten without them."""
    refs: list[Node] = []
    if depends_on(mask, qk, shape_refs=refs):
        return "a mask or term computed from the scores changes them, varying along the keys (not a row shift)"
    for r in refs:
        xv, tv = tensor_val(r.args[0]), tensor_val(r.args[1])
        if tv is None or xv is None:
            return "the mask takes the scores' shape, which has no shape information"
        if r.target == "expand_as" and not broadcasts_to(tuple(xv.shape), tuple(tv.shape)):
            return "the mask is expanded to the scores' shape from one that does not broadcast to it"
        if r.target in ("view_as", "reshape_as") and static_shape(tv) is None:
            return "the mask takes the scores' shape, which is symbolic (dynamic shapes)"
    m.shape_refs += [r for r in refs if r not in m.shape_refs]
    return ""


def match_sdpa(n: Node) -> AttentionMatch:
    """An ``F.scaled_dot_product_attention`` call ``n``, taken as written."""
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    a = {**dict(zip(names, n.args)), **n.kwargs}
    return AttentionMatch(anchor=n, q=a.get("query"), k=a.get("key"), v=a.get("value"),
                          is_causal=bool(a.get("is_causal")), sdpa_kwargs={k: a[k] for k in names[3:] if k in a},
                          spelling="F.scaled_dot_product_attention")


__all__ = ["Mask", "AttentionMatch", "match_from_pv", "match_sdpa"]
