"""Find softmax followed by top-k / argmax in a torch-level FX graph and rewrite it without the full probabilities.

Matched forms (Dynamo graph, Inductor's pre-grad slot), each over the same dim:

* ``topk(softmax(x), k)`` with its values and indices, optionally renormalized by ``v / v.sum(dim, keepdim=True)``
  (also in place, ``v /= ...``): MoE routers (Mixtral, Qwen2/3-MoE in ``transformers``) and top-k samplers
  (``softmax(logits / T) -> topk -> renormalize -> multinomial``; the multinomial stays). A temperature
  (multiply / divide by a positive number) and a floating-point up-cast before the softmax (``.float()``,
  ``dtype=torch.float32``) are taken into the op.
* ``softmax(topk(x, k).values)`` with the indices: the renormalized form.
* ``topk(softmax(x), k).indices`` alone, ``argmax(softmax(x), dim)`` and ``softmax(x).max(dim).indices``: the
  softmax is deleted (it is monotone: ``argmax(softmax(x)) == argmax(x)``, ALGORITHMS.md section 2 "Facts").
  For argmax, rows that contain NaN or ``+inf`` or only ``-inf`` still give index 0, as eager (their softmax
  is all NaN).

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
import operator
from typing import Any

import torch
from torch.fx import Graph, Node

from ..options import SmxOptions
from ..report import Site, user_location
from .graph_utils import (
    canon,
    cast_dtype,
    depends_on_random,
    is_number,
    mutation_inside,
    norm_dim,
    replace_anchor,
    stack_trace,
    tensor_val,
)
from .softmax import _call_softmax, _functorch_op, _holds

_FLOAT = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

@dataclasses.dataclass
class TopkMatch:
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
    keepdim: bool = False           # argmax
    softmax: Node | None = None     # the softmax node of the pattern
    topk: Node | None = None        # the topk node (the fused call is inserted before it)
    dead: list[Node] = dataclasses.field(default_factory=list)
    absorbed: list[str] = dataclasses.field(default_factory=list)
    action: str = "rewritten"
    reason: str = ""
    device: str = "?"
    prefix: str = ""
    keep_whole: bool = False        # kept by the CPU policy: its softmax is not offered to the softmax pass

    @property
    def key(self) -> str:
        return self.prefix + self.anchor.name

    @property
    def deletes_softmax(self) -> bool:
        """Only indices are used: the rewrite deletes the softmax (no op)."""
        return self.form in ("topk(softmax).indices", "argmax(softmax)")

    def detail(self) -> str:
        parts = [self.form, f"dim={self.dim}"]
        if self.form != "argmax(softmax)":
            parts.append(f"k={self.k}")
        if self.renormalize and self.form == "topk(softmax)":
            parts.append("renormalized")
        return ", ".join(parts + self.absorbed)

    def to_site(self, graph_tag: str) -> Site:
        op = ""
        if self.action == "rewritten":
            op = "softmax deleted" if self.deletes_softmax else (
                "smx::softmax_topk" if self.device == "cuda" else "smx softmax_topk (CPU two-pass)")
        return Site(kind="softmax_topk", action=self.action, reason=self.reason,
                    location=user_location(stack_trace(self.anchor)), op=op, detail=self.detail(),
                    graph=graph_tag, node=self.key)


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
        c = canon(x)
        if c is not None and c[0] in ("mul", "div"):
            if widened:
                return   # the scale ran in the narrow dtype before the up-cast: keep its rounding (as the softmax pass)
            a, b = c[1].get("input"), c[1].get("other")
            if c[0] == "mul" and is_number(a) and isinstance(b, Node):
                a, b = b, a
            if not isinstance(a, Node) or not is_number(b) or not b > 0 or b == float("inf"):
                return
            av = tensor_val(a)
            if av is None or av.dtype not in _FLOAT or av.dtype != tensor_val(x).dtype:
                return
            m.scale = m.scale * float(b) if c[0] == "mul" else m.scale / float(b)
            m.dead.append(x)
            m.x = a
            continue
        dt = cast_dtype(x)
        if dt is not None:
            src = tensor_val(x.args[0])
            if src is None or src.dtype not in _FLOAT or dt not in _FLOAT or not _holds(dt, src.dtype):
                return   # a narrowing cast rounds the logits: leave it in the graph
            if dt == torch.float64 and src.dtype != torch.float64:
                return   # eager computes in fp64; the op computes in fp32 unless its input is fp64: keep the cast
            if m.scale != 1.0 and dt != src.dtype:
                return   # the scale ran in the wide dtype: computing it on the narrow input would round differently
            if m.out_dtype is None:
                m.out_dtype = dt
            if src.dtype != dt:
                widened = True
                m.absorbed.append(f"cast {_dt(src.dtype)}->{_dt(dt)}")
            m.dead.append(x)
            m.x = x.args[0]
            continue
        return


def _dt(d: torch.dtype) -> str:
    return str(d).replace("torch.", "")


def _softmax_of(node: Any, dim_expected: int | None = None):
    """The softmax match (from the softmax pass) of ``node`` if it is a softmax call, else None."""
    if not isinstance(node, Node):
        return None
    sm = _call_softmax(node)
    if sm is None or sm.kind != "softmax":
        return None
    return sm


def _skip(m: TopkMatch, reason: str) -> TopkMatch:
    m.action, m.reason = "skipped", reason
    return m


def _topk_softmax_mismatch(m: TopkMatch, sm, k: Any, dim: Any, largest: Any, ndim: int) -> str:
    """Why a top-k and a softmax cannot be fused (empty: they can); sets ``m.k`` (the report shows the
    user's k on skipped sites too)."""
    if isinstance(k, int) and not isinstance(k, bool):
        m.k = k
    if sm.action != "rewritten":
        return f"softmax: {sm.reason}"
    if norm_dim(dim, ndim) != sm.dim:
        return f"top-k over dim {dim!r}, softmax over dim {sm.dim}: not the same row"
    if largest is not True:
        return "largest=False (the smallest probabilities) is not fused"
    if isinstance(k, bool) or not isinstance(k, int):
        return f"k={k!r} is not a constant int"
    if sm.pre_cast is not None:
        return (f"softmax dtype={_dt(sm.pre_cast)} casts its input first (rounding it to a narrower dtype, "
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


def _match_argmax_of_softmax(node: Node) -> TopkMatch | None:
    c = canon(node)
    if c is None or c[0] not in ("argmax", "max"):
        return None
    a = c[1]
    inp = a.get("input")
    sm = _softmax_of(inp)
    if sm is None:
        return None
    if c[0] == "max":
        if "dim" not in a:
            return None
        items = _getitem_users(node)
        if items is None or 0 in items or 1 not in items:
            return None   # max values are used (or nothing is): not an argmax
        indices_out = [items[1]]
        form_dead = [node]
    else:
        indices_out, form_dead = [node], []
    m = TopkMatch(form="argmax(softmax)", anchor=node, x=sm.x, dim=sm.dim, softmax=inp,
                  keepdim=bool(a.get("keepdim", False)), indices_out=indices_out)
    if sm.action != "rewritten":
        return _skip(m, f"softmax: {sm.reason}")
    if a.get("dim") is None:
        return _skip(m, "argmax without dim runs over the flattened tensor, not over the softmax rows")
    if norm_dim(a.get("dim"), tensor_val(inp).dim()) != sm.dim:
        return _skip(m, f"argmax over dim {a.get('dim')!r}, softmax over dim {sm.dim}: not the same row")
    if sm.pre_cast is not None:
        return _skip(m, f"softmax dtype={_dt(sm.pre_cast)} casts its input first (rounding it to a narrower dtype, or fp64 math)")
    if len(inp.users) != 1:
        return _skip(m, "the softmax output is also used elsewhere: it is computed anyway")
    m.dead = [inp, node, *form_dead]
    return m


def find_softmax_topk_sites(graph: Graph, options: SmxOptions, skip: frozenset[str] = frozenset(), prefix: str = "",
                            exclude: set | frozenset = frozenset()) -> list[TopkMatch]:
    """Every softmax + top-k / argmax site of ``graph``, each with the action the backend will take (pure analysis)."""
    functorch = _functorch_op(graph)
    matches: list[TopkMatch] = []
    claimed: set[Node] = set()
    for node in graph.nodes:
        if node in claimed or node in exclude or node.op not in ("call_function", "call_method"):
            continue
        m = _match_topk_of_softmax(node) or _match_softmax_of_topk(node) or _match_argmax_of_softmax(node)
        if m is None or any(n in claimed or n in exclude for n in (*m.dead, m.softmax)):
            continue
        m.prefix = prefix
        if m.action == "rewritten":
            claimed.update(m.dead)
            if functorch is not None:
                _skip(m, f"the graph runs a torch.func transform ('{functorch}'); smx ops have no functorch rules yet")
            else:
                _decide(m, options, skip)
        matches.append(m)
    return matches


def claimed_nodes(matches: list[TopkMatch], kept: bool = False) -> set[Node]:
    """Nodes owned by rewritten sites (and, with ``kept``, by sites the CPU policy keeps whole): the
    softmax pass leaves them alone. A site kept because the kind is disabled leaves its softmax to it."""
    out: set[Node] = set()
    for m in matches:
        if m.action == "rewritten" or (kept and m.keep_whole):
            out.update(m.dead)
            out.add(m.anchor)
    return out


def _decide(m: TopkMatch, options: SmxOptions, skip: frozenset[str]) -> None:
    xv = tensor_val(m.x)
    m.device = xv.device.type
    if xv.dtype not in _FLOAT:
        return _set(m, "skipped", f"input dtype {xv.dtype} is not floating point")
    if depends_on_random(m.x):
        return _set(m, "skipped", "input is built from random noise (Gumbel): not a deterministic softmax")
    if not m.deletes_softmax:
        _absorb_input(m)
        if m.scale != 1.0:
            m.absorbed.append(f"scale={m.scale:.6g}")
    mutated = mutation_inside(m.anchor, m.dead)
    if mutated is not None:
        return _set(m, "skipped", f"in-place op '{mutated.name}' runs inside the pattern; the fused op reads its "
                                  "input once")
    if not options.enabled("softmax_topk"):
        return _set(m, "kept", "rewrite kind 'softmax_topk' disabled by options")
    if m.key in skip:
        return _set(m, "kept", "check failed: the rewrite disagreed with eager on the example inputs, or they "
                               "could not be run (the log says which)")
    if m.deletes_softmax:
        return   # deleting work is faster everywhere
    if m.device == "cpu":
        if options.cpu == "keep":
            m.keep_whole = True
            return _set(m, "kept", "options cpu='keep'")
        if options.cpu == "auto":
            why = _cpu_keep_reason(m, xv)
            if why:
                m.keep_whole = True
                return _set(m, "kept", why)
        return
    if m.device != "cuda":
        return _set(m, "kept", f"device '{m.device}' has no smx kernel")


def _set(m: TopkMatch, action: str, reason: str) -> None:
    m.action, m.reason = action, reason


def _cpu_keep_reason(m: TopkMatch, xv: torch.Tensor) -> str:
    """Why the CPU policy keeps a site (empty: rewrite). Measured in benchmarks/bench_softmax_topk.py."""
    n = xv.shape[m.dim]
    if not isinstance(n, int):
        return ("CPU: row length is symbolic (dynamic shapes); Inductor's softmax + top-k is kept "
                "(options cpu='rewrite' forces it)")
    return ""   # every static shape measured faster: 8-128 experts and 32K-256K vocab (docs/PERFORMANCE.md)


# --------------------------------------------------------------------------- rewriting


def graph_softmax_topk(x: torch.Tensor, k: int, dim: int, scale: float, renormalize: bool,
                       dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor]:
    """What a rewritten site calls (traced by AOTAutograd): the op on CUDA, its decomposition elsewhere."""
    from ..kernels import config
    from ..kernels.softmax_topk import softmax_topk_decomposed, softmax_topk_op

    if x.is_cuda or config.use_triton(x) or config.export_ops:   # CUDA, the Triton interpreter in tests, an export
        v, i, _ = softmax_topk_op(x, k, dim, scale, renormalize, dtype)
    else:
        v, i, _ = softmax_topk_decomposed(x, k, dim, scale, renormalize, dtype)
    return v, i


def graph_argmax(x: torch.Tensor, dim: int, keepdim: bool) -> torch.Tensor:
    """``argmax(softmax(x, dim), dim)`` without the softmax: 0 where the softmax row is all NaN (a NaN or
    ``+inf`` entry, or only ``-inf``), as eager."""
    i = torch.argmax(x, dim, keepdim=True)
    top = torch.gather(x, dim, i)
    i = torch.where(torch.isfinite(top), i, torch.zeros_like(i))
    return i if keepdim else i.squeeze(dim)


def rewrite_softmax_topk(graph: Graph, m: TopkMatch) -> None:
    """Replace the site's values / indices by the fused op's (or delete the softmax) and erase the pattern."""
    if m.form == "argmax(softmax)":
        with graph.inserting_before(m.anchor):
            call = graph.call_function(graph_argmax, (m.x, m.dim, m.keepdim))
        replace_anchor(graph, m.indices_out[0], call, call, m.dead)
        return
    if m.form == "topk(softmax).indices":
        # top-k of the logits: same indices (softmax is monotone), no probabilities
        m.anchor.replace_input_with(m.softmax, m.x)
        from .graph_utils import erase_dead

        erase_dead(graph, [m.softmax])
        return
    with graph.inserting_before(m.topk):
        call = graph.call_function(graph_softmax_topk, (m.x, m.k, m.dim, float(m.scale), m.renormalize, m.out_dtype))
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


def run_site(m: TopkMatch, values: dict[str, Any]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The rewritten site's (values, indices) on captured input values (``check``)."""
    x = values[m.x.name]
    if m.form == "argmax(softmax)":
        return None, graph_argmax(x, m.dim, m.keepdim)
    if m.form == "topk(softmax).indices":
        return None, torch.topk(x, m.k, m.dim).indices
    return graph_softmax_topk(x, m.k, m.dim, float(m.scale), m.renormalize, m.out_dtype)


__all__ = ["TopkMatch", "find_softmax_topk_sites", "rewrite_softmax_topk", "claimed_nodes", "graph_softmax_topk",
           "graph_argmax", "run_site"]
