"""Find softmax followed by top-k / argmax in a torch-level FX graph and rewrite it without the full probabilities.

Matched forms (Dynamo graph, Inductor's pre-grad slot), each over the same dim:

* ``topk(softmax(x), k)`` with its values and indices, optionally renormalized by ``v / v.sum(dim, keepdim=True)``
  (also in place, ``v /= ...``): MoE routers (Mixtral, Qwen2/3-MoE in ``transformers``) and top-k samplers
  (``softmax(logits / T) -> topk -> renormalize -> multinomial``; the multinomial stays). A temperature
  (multiply / divide by a positive number) and a floating-point up-cast before the softmax (``.float()``,
  ``dtype=torch.float32``) are taken into the op.
* ``softmax(topk(x, k).values)`` with the indices: the renormalized form.
* ``topk(softmax(x), k).indices`` alone, ``argmax(softmax(x), dim)`` and ``softmax(x).max(dim).indices``: the
  softmax is deleted (it is monotone: ``argmax(softmax(x)) == argmax(x)``).
  For argmax, rows that contain NaN or ``+inf`` or only ``-inf`` still give index 0, as eager (their softmax
  is all NaN).
* a softmax read only at a few entries per row (:func:`..patterns.selections.top1_readers`: its maximum, a
  ``gather``, a product with a one-hot mask summed over the row): :func:`graph_top1`, :func:`graph_argmax`,
  :func:`graph_softmax_entry`.

Rewritten to :func:`graph_softmax_topk` (traced by AOTAutograd): ``smx::softmax_topk`` on CUDA (the Triton
kernel), and on CPU the op's two-pass decomposition, which Inductor compiles into loops that never write
the probabilities (:func:`smxcompile.kernels.softmax_topk.softmax_topk_decomposed`).

Not matched (each a tested near-miss, reported as ``skipped`` with the reason; the softmax pass then sees
the softmax as usual): the softmax output also used elsewhere, ``largest=False``, top-k or argmax over a
different dim than the softmax, ``argmax`` without a dim (over the flattened tensor), a softmax that
casts its input first (``dtype=`` below the input's, or fp64), top-k values used raw besides
the softmax, a softmax of random noise (Gumbel).

Source: "Online normalizer calculation for softmax" (Milakov & Gimelshein, 2018), fused softmax + top-k.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from typing import Any

import torch
from torch.fx import Graph, Node

from .patterns.arith import scalar_factor
from .patterns.casts import widening_cast
from .patterns.graph import (FLOAT_DTYPES, canon, dtype_name, erase_dead,
                             norm_dim, replace_anchor, tensor_val)
from .patterns.selections import no_op_copy, reads_top1, top1_readers
from .patterns.softmax_call import SoftmaxCall, input_problem, softmax_call
from .patterns.writes import mutation_inside
from .policy import FORCE_HINT, Ladder, cpu_threshold, decide
from .protocol import Match, PassContext, RewritePass


@dataclasses.dataclass
class TopkMatch(Match):
    kind = "softmax_topk"
    form: str                       # "topk(softmax)" | "softmax(topk)" | "topk(softmax).indices" | "argmax(softmax)"
    anchor: Node                    # the topk / argmax / max node (the report's node)
    x: Node                         # the op's input (after absorbed scale and casts)
    dim: int
    k: int = 1
    scale: float = 1.0
    renormalize: bool = False
    out_dtype: torch.dtype | None = None
    values_out: Node | None = None  # the node the values replace (getitem, renormalizing div, or softmax)
    indices_out: list[Node] = dataclasses.field(default_factory=list)   # nodes the indices replace
    reads: list = dataclasses.field(default_factory=list)   # max / argmax forms: the Top1Read uses of the softmax
    softmax: Node | None = None     # the softmax node of the pattern
    topk: Node | None = None        # the topk node (the fused call is inserted before it)
    dead: list[Node] = dataclasses.field(default_factory=list)
    absorbed: list[str] = dataclasses.field(default_factory=list)
    export: bool = False            # captured for an export: the op itself on every device

    @property
    def deletes_softmax(self) -> bool:
        """Only indices are used: the rewrite deletes the softmax (no op)."""
        return self.form in ("topk(softmax).indices", "argmax(softmax)")

    @property
    def top1(self) -> bool:
        """The row maximum alone is read (argmax, max, a gather at the argmax), or entries at given indices."""
        return self.form in ("argmax(softmax)", "max(softmax)", "entries(softmax)")

    def detail(self) -> str:
        parts = [self.form, f"dim={self.dim}"]
        if not self.top1:
            parts.append(f"k={self.k}")
        if self.renormalize and self.form == "topk(softmax)":
            parts.append("renormalized")
        return ", ".join(parts + self.absorbed)

    def op_name(self) -> str:
        if self.form == "topk(softmax).indices":
            return "softmax deleted"
        if self.top1:
            return f"smx {'entries' if self.form == 'entries(softmax)' else 'top-1'} (probabilities never written)"
        return "smx::softmax_topk" if self.device == "cuda" or self.export else "smx softmax_topk (CPU two-pass)"


# --------------------------------------------------------------------------- matching


def _getitem_users(node: Node) -> dict[int, Node] | None:
    """``{index: getitem node}`` when every user of ``node`` is ``node[0]`` or ``node[1]`` (else None)."""
    out: dict[int, Node] = {}
    for u in node.users:
        if u.op != "call_function" or u.target is not operator.getitem or u.args[0] is not node \
                or u.args[1] not in (0, 1) or u.args[1] in out:
            return None
        out[u.args[1]] = u
    return out


def _topk_args(node: Node) -> tuple[Node, Any, Any, bool] | None:
    """``(input, k, dim, largest)`` of a ``topk`` call; None when it is not one."""
    c = canon(node)
    if c is None or c[0] != "topk":
        return None
    a = c[1]
    return a.get("input"), a.get("k"), a.get("dim", -1), a.get("largest", True)


def _renormalizer(v: Node, dim: int) -> tuple[Node, list[Node]] | None:
    """``v / v.sum(dim, keepdim=True)`` (``/`` or ``/=``) as ``(div node, [sum, div])``."""
    if len(v.users) != 2:
        return None
    users = list(v.users)
    for s, d in (users, users[::-1]):
        cs = canon(s)
        if cs is None or cs[0] != "sum" or cs[1].get("input") is not v or cs[1].get("keepdim") is not True:
            continue
        vv = tensor_val(v)
        if vv is None or norm_dim(cs[1].get("dim"), vv.dim()) != dim or cs[1].get("dtype") is not None:
            continue
        if len(s.users) != 1 or next(iter(s.users)) is not d:
            continue
        if d.op == "call_function" and d.target is operator.itruediv and d.args == (v, s):
            return d, [s, d]
        cd = canon(d)
        if cd is not None and cd[0] == "div" and cd[1].get("input") is v and cd[1].get("other") is s:
            return d, [s, d]
    return None


def _absorb_input(m: TopkMatch) -> None:
    """Take a positive scale (temperature) and float up-casts in front of the softmax into the op."""
    widened = False
    for _ in range(4):
        x = m.x
        if len(x.users) != 1:
            return
        s = scalar_factor(x)
        if s is not None:
            if widened:
                return   # the scale ran in the narrow dtype before the up-cast: keep its rounding (as the softmax pass)
            a, factor = s
            if not factor > 0 or not math.isfinite(factor):
                return
            av = tensor_val(a)
            if av is None or av.dtype not in FLOAT_DTYPES or av.dtype != tensor_val(x).dtype:
                return
            m.scale = m.scale * factor
            m.dead.append(x)
            m.x = a
            continue
        up = widening_cast(x)
        if up is not None:
            src, src_dtype, dt = up
            if m.scale != 1.0 and dt != src_dtype:
                return   # the scale ran in the wide dtype: computing it on the narrow input would round differently
            if m.out_dtype is None:
                m.out_dtype = dt
            if src_dtype != dt:
                widened = True
                m.absorbed.append(f"cast {dtype_name(src_dtype)}->{dtype_name(dt)}")
            m.dead.append(x)
            m.x = src
            continue
        return   # a narrowing cast rounds the logits (it stays in the graph), or nothing to take in


def _softmax_of(node: Any) -> SoftmaxCall | None:
    """``node`` as a softmax call (not log-softmax), else None."""
    if not isinstance(node, Node):
        return None
    sm = softmax_call(node)
    if sm is None or sm.kind != "softmax":
        return None
    return sm


def _skip(m: TopkMatch, reason: str) -> TopkMatch:
    m.skip(reason)
    return m


def _topk_softmax_mismatch(m: TopkMatch, sm, k: Any, dim: Any, largest: Any, ndim: int) -> str:
    """Why a top-k and a softmax cannot be fused (empty: they can); sets ``m.k`` (the report shows the
    user's k on skipped sites too)."""
    if isinstance(k, int) and not isinstance(k, bool):
        m.k = k
    if sm.problem:
        return f"softmax: {sm.problem}"
    if norm_dim(dim, ndim) != sm.dim:
        return f"top-k over dim {dim!r}, softmax over dim {sm.dim}: not the same row"
    if largest is not True:
        return "largest=False (the smallest probabilities) is not fused"
    if isinstance(k, bool) or not isinstance(k, int):
        return f"k={k!r} is not a constant int"
    if sm.pre_cast is not None:
        return (f"softmax dtype={dtype_name(sm.pre_cast)} casts its input first (rounding it to a narrower dtype, "
                "or fp64 math)")
    return ""


def _match_topk_of_softmax(node: Node) -> TopkMatch | None:
    t = _topk_args(node)
    if t is None:
        return None
    inp, k, dim, largest = t
    sm = _softmax_of(inp)
    if sm is None:
        return None
    sv = tensor_val(inp)
    m = TopkMatch(form="topk(softmax)", anchor=node, x=sm.x, dim=sm.dim, softmax=inp, topk=node)
    why = _topk_softmax_mismatch(m, sm, k, dim, largest, sv.dim())
    if why:
        return _skip(m, why)
    if len(inp.users) != 1:
        return _skip(m, "the softmax output is also used elsewhere: it is computed anyway")
    items = _getitem_users(node)
    if items is None:
        return _skip(m, "the top-k result is used as a whole (not as values / indices)")
    m.out_dtype = sm.out_dtype
    m.dead = [inp, node]
    v, i = items.get(0), items.get(1)
    if i is not None:
        m.indices_out = [i]
    if v is None or not v.users:
        m.form = "topk(softmax).indices"
        if v is not None:
            m.dead.append(v)
        return m
    m.dead.append(v)
    ren = _renormalizer(v, sm.dim)
    if ren is not None:
        m.values_out, more = ren
        m.renormalize = True
        m.dead += more
    else:
        m.values_out = v
    return m


def _match_softmax_of_topk(node: Node) -> TopkMatch | None:
    sm = _softmax_of(node)
    if sm is None:
        return None
    g = sm.x
    if g.op != "call_function" or g.target is not operator.getitem or g.args[1] != 0:
        return None
    tk = g.args[0]
    t = _topk_args(tk) if isinstance(tk, Node) else None
    if t is None:
        return None
    inp, k, dim, largest = t
    tv = tensor_val(tk.args[0]) if tk.args else None
    m = TopkMatch(form="softmax(topk)", anchor=node, x=inp, dim=sm.dim, renormalize=True, values_out=node,
                  softmax=node, topk=tk)
    if tv is None:
        return _skip(m, "softmax: no value recorded")
    why = _topk_softmax_mismatch(m, sm, k, dim, largest, tensor_val(inp).dim())
    if why:
        return _skip(m, why)
    if len(g.users) != 1:
        return _skip(m, "the raw top-k values are also used besides the softmax")
    items = _getitem_users(tk)
    if items is None:
        return _skip(m, "the top-k result is used as a whole (not as values / indices)")
    m.out_dtype = sm.out_dtype
    if 1 in items:
        m.indices_out = [items[1]]
    m.dead = [node, g, tk]
    return m


def _match_top1(node: Node) -> TopkMatch | None:
    """A softmax whose every use reads only its row maximum (:func:`top1_readers`: argmax, max, amax, a gather
    at the argmax, behind no-op copies): the probabilities are never written."""
    sm = _softmax_of(node)
    if sm is None:
        return None
    nd = tensor_val(node).dim()
    firsts = [u for t in (node, *[u for u in node.users if no_op_copy(u) is node]) for u in t.users if reads_top1(u)]
    found = top1_readers(node, sm.dim, {sm.x})
    found = found if found and found[0] else None
    if not firsts and found is None:
        return None
    reads = found[0] if found else []
    values = any(r.what == "values" or (r.what == "max" and 0 in r.items) for r in reads)
    entries = any(r.what == "entry" for r in reads)
    form = "max(softmax)" if values else "entries(softmax)" if entries else "argmax(softmax)"
    m = TopkMatch(form=form, anchor=reads[0].node if reads else firsts[0],
                  x=sm.x, dim=sm.dim, softmax=node, reads=reads)
    if found is None:
        c = canon(firsts[0])
        d = c[1].get("dim") if c is not None else sm.dim
        if d is None:
            return _skip(m, "argmax without dim runs over the flattened tensor, not over the softmax rows")
        if norm_dim(d if not isinstance(d, (list, tuple)) else d[0], nd) != sm.dim:
            return _skip(m, f"argmax over dim {d!r}, softmax over dim {sm.dim}: not the same row")
        return _skip(m, "the probabilities are also read beyond a few entries per row (their maximum, a gather, a "
                        "product with a one-hot mask summed over the row): computed anyway")
    if entries and values and tensor_val(node).requires_grad:
        # measured: Inductor's CPU code for both reads' gradients together is wrong (up to 0.94), each alone right
        return _skip(m, "entries and the row maximum's values of one softmax, with gradients: kept")
    if sm.problem:
        return _skip(m, f"softmax: {sm.problem}")
    if sm.pre_cast is not None:
        return _skip(m, f"softmax dtype={dtype_name(sm.pre_cast)} casts its input first (rounding it to a narrower "
                        "dtype, or fp64 math)")
    m.out_dtype = sm.out_dtype
    m.indices_out = [r.node for r in reads if r.what == "indices"] + [r.items[1] for r in reads if 1 in r.items]
    m.dead = [node, *found[1], *[r.node for r in reads], *[g for r in reads for g in r.items.values()]]
    if entries:
        m.absorbed.append("entries at given indices")
    return m


def _checks(m: TopkMatch, ctx: PassContext) -> str:
    m.device = tensor_val(m.x).device.type
    why = input_problem(m.x)
    if why:
        return why
    if not m.deletes_softmax and not m.top1:
        _absorb_input(m)
        if m.scale != 1.0:
            m.absorbed.append(f"scale={m.scale:.6g}")
    # a top-1 site's reads all become values computed at the first: a write up to the last read counts, and
    # from a gather index's own argmax on (it may read the logits before the softmax does)
    last = max(m.dead, key=_graph_order(m.anchor)) if m.top1 else m.anchor
    mutated = mutation_inside(last, [*m.dead, *(_index_nodes(r.index) for r in m.reads if r.index is not None),
                                     *(r.mask for r in m.reads if r.mask is not None)])
    if mutated is not None:
        return f"in-place op '{mutated.name}' runs inside the pattern; the fused op reads its input once"
    return ""


def _graph_order(n: Node):
    order = {x: i for i, x in enumerate(n.graph.nodes)}
    return order.__getitem__


def _index_nodes(index: Node) -> Node:
    """The argmax / max call behind a gather's index (its ``getitem`` for ``max``)."""
    return index.args[0] if index.op == "call_function" and index.target is operator.getitem else index


def _cpu_keep(m: TopkMatch, ctx: PassContext) -> str:
    """Why the CPU policy keeps a site (empty: rewrite); rule ``softmax_topk`` of ``CPU_RULES``."""
    n = tensor_val(m.x).shape[m.dim]
    if not isinstance(n, int):
        return f"CPU: row length is symbolic (dynamic shapes); Inductor's softmax + top-k is kept ({FORCE_HINT})"
    need = cpu_threshold("softmax_topk_entries_min_columns")
    if any(r.what == "entry" for r in m.reads) and not tensor_val(m.x).requires_grad and n < need:
        return (f"CPU: probabilities read at given entries of {n}-column rows without a gradient; below {need} columns "
                f"Inductor's fused softmax was measured as fast ({FORCE_HINT})")
    half = (m.out_dtype or tensor_val(m.x).dtype) in (torch.float16, torch.bfloat16)
    if m.top1 and half and n >= cpu_threshold("softmax_topk_top1_half_max_columns"):
        return (f"CPU: top-1 read of {n} fp16 / bf16 probabilities; from "
                f"{cpu_threshold('softmax_topk_top1_half_max_columns')} columns Inductor's softmax + max is as fast")
    return ""   # every other static shape measured faster: 8-128 experts and 32K-256K vocab (docs/PERFORMANCE.md)


# deleting the softmax is faster everywhere; a site kept by the CPU policy keeps its softmax too
_LADDER = Ladder(checks=_checks, device_free=lambda m: m.deletes_softmax, cpu_keep=_cpu_keep,
                 keep_whole=frozenset({"cpu"}))


# --------------------------------------------------------------------------- rewriting


def graph_softmax_topk(x: torch.Tensor, k: int, dim: int, scale: float, renormalize: bool,
                       dtype: torch.dtype | None, export: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """What a rewritten site calls (traced by AOTAutograd): ``(values, indices)`` of the top ``k`` probabilities.

    The op ``smx::softmax_topk`` on CUDA, under the Triton interpreter (tests) and in an export (``export``: the
    exporters translate the op); elsewhere its two-pass decomposition, which Inductor compiles into loops that
    never write the probabilities."""
    from ..kernels import config
    from ..kernels.softmax_topk import softmax_topk_decomposed

    if x.is_cuda or config.use_triton(x) or export:
        v, i, _ = torch.ops.smx.softmax_topk.default(x, k, dim, scale, renormalize, dtype)
    else:
        v, i, _ = softmax_topk_decomposed(x, k, dim, scale, renormalize, dtype)
    return v, i


def graph_argmax(x: torch.Tensor, dim: int, keepdim: bool, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``argmax(softmax(x, dim, dtype=dtype), dim)`` without writing the probabilities; see :func:`graph_top1`."""
    i = _softmax_top1(x, dim, dtype)[1]
    return i if keepdim else i.squeeze(dim)


def _softmax_top1(x: torch.Tensor, dim: int, dtype: torch.dtype | None):
    """``(p_i, i)``, keepdim: ``i`` the first maximal logit of ``x`` cast to ``dtype`` (0 where the softmax row is
    all NaN), ``p_i = 1 / sum(exp(x - x_i))`` its probability, with its gradient.

    ``i`` is fp64's answer, and Inductor's. Eager's argmax of fp16 / bf16 probabilities takes the first of those
    that round to the same value, so it may pick a smaller logit a rounding below (docs/DESIGN.md, "Top-1")."""
    xf = x.to(dtype) if dtype is not None else x
    wide = xf.float() if xf.dtype in (torch.float16, torch.bfloat16) else xf
    i = torch.argmax(wide, dim, keepdim=True)
    top = torch.gather(wide, dim, i)
    p_i = torch.exp(wide - top.detach()).sum(dim, keepdim=True).reciprocal()   # NaN where top is not finite
    # d p_i / d x = p_i (onehot_i - p): the exp term above gives -p_i p, this one p_i at i (one reduction less)
    p_i = p_i + (top - top.detach()) * p_i.detach()
    return p_i, torch.where(torch.isfinite(top), i, torch.zeros_like(i))


def graph_softmax_entry(x: torch.Tensor, dim: int, dtype: torch.dtype | None, index: torch.Tensor,
                        mask: torch.Tensor | None = None, keepdim: bool = True) -> torch.Tensor:
    """``softmax(x, dim, dtype=dtype).gather(dim, index)`` as ``exp(x_index - max) / sum(exp(x - max))``, without
    writing the probabilities (NaN on rows whose softmax is all NaN). With ``mask`` (zero off ``one_hot(index)``):
    ``(softmax(x) * mask).sum(dim, keepdim)``, the entry times the mask there."""
    xf = x.to(dtype) if dtype is not None else x
    wide = xf.float() if xf.dtype in (torch.float16, torch.bfloat16) else xf
    at = index.unsqueeze(dim) if mask is not None else index
    top = wide.amax(dim, keepdim=True).detach()      # softmax is shift-invariant: no gradient through the shift
    out = (torch.exp(wide.gather(dim, at) - top) / torch.exp(wide - top).sum(dim, keepdim=True)).to(xf.dtype)
    if mask is not None:
        out = out * mask.gather(dim, at)
        out = out if keepdim else out.squeeze(dim)
    return out


def _top1_uses(m: TopkMatch) -> list[tuple[Node, str, bool]]:
    """``(node, "values" | "indices" | "entry", keepdim)`` for every node a top-1 site's rewrite replaces."""
    uses = [(r.node, r.what, r.keepdim) for r in m.reads if r.what != "max"]
    return uses + [(g, "values" if i == 0 else "indices", r.keepdim) for r in m.reads if r.what == "max"
                   for i, g in r.items.items()]


def graph_top1(x: torch.Tensor, dim: int, dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, indices)`` of the row maximum of ``softmax(x, dim, dtype=dtype)``, keepdim, without writing
    the probabilities: the index as :func:`_softmax_top1` picks it (the first maximal logit), the probability
    there with its gradient; NaN and index 0 on rows whose softmax is all NaN (a NaN or ``+inf``, or only ``-inf``)."""
    p_i, i = _softmax_top1(x, dim, dtype)
    return p_i.to(x.dtype if dtype is None else dtype), i


def _take_meta(out: Node, node: Node) -> None:
    for k in ("example_value", "val"):
        if k in node.meta:
            out.meta[k] = node.meta[k]


class SoftmaxTopkPass(RewritePass):
    """Softmax followed by top-k / argmax -> the fused ``smx::softmax_topk`` (or no softmax at all), see the
    module docstring."""

    name = "softmax_topk"

    def find(self, graph: Graph, ctx: PassContext, exclude: set) -> list[TopkMatch]:
        matches: list[TopkMatch] = []
        claimed: set[Node] = set()
        for node in graph.nodes:
            if node in claimed or node in exclude or node.op not in ("call_function", "call_method"):
                continue
            m = _match_topk_of_softmax(node) or _match_softmax_of_topk(node) or _match_top1(node)
            if m is None or any(n in claimed or n in exclude for n in (*m.dead, m.softmax)):
                continue
            m.prefix, m.export = ctx.prefix, ctx.export
            if m.action == "rewritten":
                claimed.update(m.dead)
                decide(m, ctx, _LADDER)
            matches.append(m)
        return matches

    def rewrite(self, graph: Graph, m: TopkMatch, ctx: PassContext) -> None:
        """Replace the site's values / indices by the fused op's (or delete the softmax) and erase the pattern."""
        if m.top1:
            self._rewrite_top1(graph, m, ctx)
            return
        if m.form == "topk(softmax).indices":
            # top-k of the logits: same indices (softmax is monotone), no probabilities
            m.anchor.replace_input_with(m.softmax, m.x)
            erase_dead(graph, [m.softmax])
            return
        with graph.inserting_before(m.topk):
            call = graph.call_function(graph_softmax_topk, (m.x, m.k, m.dim, float(m.scale), m.renormalize,
                                                            m.out_dtype), {"export": True} if ctx.export else {})
            vals = graph.call_function(operator.getitem, (call, 0))
            idx = graph.call_function(operator.getitem, (call, 1))
        for i in m.indices_out:
            for key in ("example_value", "val", "stack_trace"):
                if key in i.meta:
                    idx.meta[key] = i.meta[key]
            i.replace_all_uses_with(idx)
        replace_anchor(graph, m.values_out, call, vals, [*m.dead, *m.indices_out])
        if not idx.users:
            graph.erase_node(idx)

    def _rewrite_top1(self, graph: Graph, m: TopkMatch, ctx: PassContext) -> None:
        """Each read of the row maximum takes the fused values (``smx::softmax_topk`` with k = 1) or the logits'
        argmax (the first index of the maximum, as ``argmax`` and ``max`` give it); each entry read its entry."""
        x, reads = m.x, [u for u in _top1_uses(m) if u[1] != "entry"]
        for r in m.reads:       # an entry at its own place: its index may be computed after the first read
            if r.what == "entry":
                with graph.inserting_before(r.node):
                    out = graph.call_function(graph_softmax_entry, (x, m.dim, m.out_dtype, r.index, r.mask,
                                                                    r.keepdim))
                _take_meta(out, r.node)
                r.node.replace_all_uses_with(out)
        if reads:
            self._replace_top1_reads(graph, m, reads)
        erase_dead(graph, m.dead)

    @staticmethod
    def _replace_top1_reads(graph: Graph, m: TopkMatch, reads: list) -> None:
        order = {n: j for j, n in enumerate(graph.nodes)}
        with graph.inserting_before(min((n for n, _, _ in reads), key=order.__getitem__)):
            if len(reads) == 1 and reads[0][1] == "indices":
                outs = {"indices": graph.call_function(graph_argmax, (m.x, m.dim, reads[0][2], m.out_dtype))}
                keep = reads[0][2]
            else:
                call = graph.call_function(graph_top1, (m.x, m.dim, m.out_dtype))
                outs = {w: graph.call_function(operator.getitem, (call, j)) for j, w in enumerate(("values", "indices"))}
                keep = True
            for node, what, keepdim in reads:
                out = outs[what] if keepdim == keep else graph.call_method("squeeze", (outs[what], m.dim))
                _take_meta(out, node)
                node.replace_all_uses_with(out)

    def check_inputs(self, m: TopkMatch) -> list[Node]:
        return [m.x, *(n for r in m.reads if r.what == "entry" for n in (r.index, r.mask) if n is not None)]

    def check_nodes(self, m: TopkMatch) -> list[Node]:
        if m.top1:
            return [n for n, _, _ in _top1_uses(m)]
        return [n for n in (m.values_out, *m.indices_out) if n is not None]

    def run_site(self, m: TopkMatch, values: dict[str, Any]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The rewritten site's (values, indices) on captured input values."""
        x = values[m.x.name]
        if m.top1:
            entries = {r.node: graph_softmax_entry(x, m.dim, m.out_dtype, values[r.index.name],
                                                   None if r.mask is None else values[r.mask.name], r.keepdim)
                       for r in m.reads if r.what == "entry"}
            return (*graph_top1(x, m.dim, m.out_dtype), entries)
        if m.form == "topk(softmax).indices":
            return None, torch.topk(x, m.k, m.dim).indices
        return graph_softmax_topk(x, m.k, m.dim, float(m.scale), m.renormalize, m.out_dtype)

    def agrees(self, m: TopkMatch, ours, values: dict[str, Any], close) -> bool:
        if m.top1:
            got = dict(zip(("values", "indices"), ours))
            return all(close(ours[2][n] if what == "entry" else got[what] if keepdim else got[what].squeeze(m.dim),
                             values[n.name]) for n, what, keepdim in _top1_uses(m))
        vals, idx = ours
        ok = True
        if m.values_out is not None and vals is not None:
            ok = close(vals, values[m.values_out.name])
        if ok and m.indices_out:
            # ties may pick other columns: compare the logits the indices point at
            p = values[m.x.name]
            ref_idx = values[m.indices_out[0].name]
            ok = idx.shape == ref_idx.shape and close(p.gather(m.dim, idx), p.gather(m.dim, ref_idx))
        return ok


__all__ = ["TopkMatch", "SoftmaxTopkPass", "graph_softmax_topk", "graph_argmax", "graph_top1", "graph_softmax_entry"]
