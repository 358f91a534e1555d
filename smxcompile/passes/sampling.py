"""Find the sampling step of a language model in a torch-level FX graph and rewrite it into one ``smx::sample``.

The site is ``multinomial(softmax(y, -1), 1)`` (the probabilities possibly reshaped with each row kept a row,
``(B, 1, V)`` to ``(B, V)``) where ``y`` comes from logits ``x`` through, in order:

* an optional temperature: ``x / T`` or ``x * c`` with a positive number (before the top-p / min-p filters:
  they depend on it; a top-k commutes with it);
* filters that set entries to ``-inf`` (:mod:`.patterns.filters`: top-k, top-p, min-p, each at most once, in
  that order, as transformers' ``generate(do_sample=True)`` applies them), out of place or in place.

The rewrite reads ``x`` once and draws the token (:func:`smxcompile.kernels.sampling.sample`): the same
distribution as eager; the draws themselves differ (another use of the random numbers, as Inductor's RNG).
Where an intermediate is used elsewhere (the filtered probabilities returned, say), only the draw is replaced
and the rest stays for its other users; a chain writing in place into a tensor it did not create keeps that
write.

Not matched (reported as ``skipped``, with the reason): a multinomial with a ``generator`` (Dynamo breaks the
graph there first) or more than one sample, a filter value other than ``-inf``, a filter it does not recognize, filters out of that order, a
temperature after a top-p or min-p filter, another write into the logits between the filters and the draw.
Source: FlashInfer's sampling kernels (top-k / top-p / min-p from logits without sorting).
"""

from __future__ import annotations

import dataclasses
import math
import operator

import torch
from torch.fx import Graph, Node

from ..kernels.sampling.api import check_sampling
from .patterns.filters import Filter, filled, filled_in_place, min_p, top_k, top_p, writes_into
from .patterns.graph import canon, erase_unused_pure, val, is_mutation, is_number, op_label, replace_anchor, tensor_val
from .patterns.softmax_call import input_problem, softmax_call
from .patterns.writes import mutation_inside, writes_of
from .policy import Ladder, find_sites
from .protocol import Match, PassContext, RewritePass

__all__ = ["SampleMatch", "SamplePass", "graph_sample"]

_ORDER = ("top_k", "top_p", "min_p")
#: Reshapes that keep each row of the probabilities a row, in order, when they keep the last dim and the count.
_ROW_VIEWS = frozenset({"view", "reshape", "squeeze", "unsqueeze", "flatten"})


@dataclasses.dataclass
class SampleMatch(Match):
    kind = "sample"
    anchor: Node                    # the multinomial
    base: Node | None = None        # the logits the op reads
    temperature: float = 1.0
    filters: list[Filter] = dataclasses.field(default_factory=list)
    dead: list[Node] = dataclasses.field(default_factory=list)
    private: bool = False           # every node of the chain is used only inside it: all of it goes
    flat: bool = False              # the draw's input is one row (V,): multinomial returns (1,)

    def params(self) -> dict:
        got = {f.kind: f for f in self.filters}
        keep = max([f.min_keep for f in self.filters], default=1)
        return dict(temperature=self.temperature, top_k=int(got["top_k"].param) if "top_k" in got else 0,
                    top_p=got["top_p"].param if "top_p" in got else 1.0,
                    min_p=got["min_p"].param if "min_p" in got else 0.0, min_tokens_to_keep=keep)

    def detail(self) -> str:
        p = self.params()
        parts = [f"temperature {p['temperature']:g}"] if p["temperature"] != 1.0 else []
        parts += [f"{f.kind.replace('_', '-')} {f.param:g}" for f in self.filters]
        if p["min_tokens_to_keep"] > 1:
            parts.append(f"keeping at least {p['min_tokens_to_keep']}")
        return ", ".join(parts) or "plain softmax"

    def op_name(self) -> str:
        return "smx sample"


def _temperature(n: Node) -> tuple[Node, float] | None:
    """``x / T`` or ``x * c`` (a positive finite number) -> ``(x, T)``."""
    c = canon(n)
    if c is None or c[0] not in ("div", "mul"):
        return None
    a, b = c[1].get("input"), c[1].get("other")
    if c[0] == "mul" and isinstance(b, Node):
        a, b = b, a
    if not isinstance(a, Node) or not is_number(b) or not (math.isfinite(float(b)) and float(b) > 0):
        return None
    if c[0] == "mul" and math.frexp(float(b))[0] != 0.5:
        return None   # x * c and x / (1 / c) round alike only for a power of two
    return a, float(b) if c[0] == "div" else 1.0 / float(b)


def _classify(mask: Node, x: Node) -> Filter | None:
    for recognize in (top_k, top_p, min_p):
        f = recognize(mask, x)
        if f is not None:
            return f
    return None


def _writes_before(x: Node, at: Node, order: dict) -> list[Node]:
    return [u for u in writes_into(x) if order[u] < order[at]]


def _walk(m: SampleMatch, y: Node, probs: Node) -> str:
    """Fill ``m`` from the softmax's input ``y`` up to the logits; returns why the chain cannot be fused."""
    order = {n: i for i, n in enumerate(probs.graph.nodes)}
    cur, at, stages = y, probs, []
    while True:
        writes = _writes_before(cur, at, order)
        if len(writes) > 1:
            return f"the logits are written in place {len(writes)} times before the softmax"
        if writes:
            got = filled_in_place(writes[0])
            if got is None:
                return f"the logits are written in place by {op_label(writes[0])} before the softmax"
            stage, at = (writes[0], got[1], cur), writes[0]
        elif (got := filled(cur)) is not None:
            stage, at, cur = (cur, got[1], got[0]), cur, got[0]
        elif (t := _temperature(cur)) is not None:
            stages.append(("temperature", t[1], cur))
            m.dead.append(cur)
            at, cur = cur, t[0]
            continue
        else:
            break
        node, mask, src = stage
        f = _classify(mask, src)
        if f is None and _symbolic(mask):
            return ("a filter whose k or p is symbolic (dynamic shapes, e.g. min(k, V) of a dynamic vocabulary): "
                    "the op takes them as constants")
        if f is None:
            return f"an entry filter ({op_label(mask)} of the logits) that is not a top-k, top-p or min-p"
        earlier = _writes_before(src, node, order)
        if earlier and min(order[n] for n in f.nodes) < max(order[w] for w in earlier):
            return "a filter's mask was computed before an in-place filter of the same logits"
        if any(is_mutation(n) and order[n] > order[node] for n in f.nodes):
            return "a filter's mask is edited in place after the filter used it"
        stages.append(("filter", f, node))
        m.dead += [node, *f.nodes]
    m.base = cur
    stages.reverse()   # from the logits to the softmax
    return _order_problem(m, stages)


def _order_problem(m: SampleMatch, stages: list) -> str:
    """Fill ``m``'s temperature and filters from ``stages`` (logits first); why they are not one op's, or ""."""
    kinds = [s[1].kind for s in stages if s[0] == "filter"]
    temps = [i for i, s in enumerate(stages) if s[0] == "temperature"]
    if len(temps) > 1:
        return "more than one temperature"
    if temps and any(s[0] == "filter" and s[1].kind != "top_k" for s in stages[: temps[0]]):
        return "a temperature after a top-p or min-p filter: the filter saw other probabilities"
    if kinds != sorted(kinds, key=_ORDER.index) or len(set(kinds)) != len(kinds):
        return f"filters in the order {', '.join(kinds)}: the op applies top-k, top-p, min-p, each once"
    m.temperature = stages[temps[0]][1] if temps else 1.0
    m.filters = [s[1] for s in stages if s[0] == "filter"]
    try:
        check_sampling(**m.params())
    except ValueError as err:   # eager removes every entry, or nothing, where the op refuses the value
        return f"a filter value outside the op's range: {err}"
    keeps = {f.min_keep for f in m.filters if f.kind != "top_k"}
    if len(keeps) > 1:
        return "filters keeping different numbers of tokens (min_tokens_to_keep)"
    top = [f.param for f in m.filters if f.kind == "top_k"]
    if top and keeps and top[0] < max(keeps):
        return "a top-k smaller than what a later filter keeps (min_tokens_to_keep)"
    bv = tensor_val(m.base)
    if bv is not None and bv.dtype in (torch.float16, torch.bfloat16) and (
            set(kinds) - {"top_k"} or (temps and temps[0] > 0)):
        return ("fp16 / bf16 logits with a top-p, min-p or a temperature after the top-k: eager computes those "
                "in the logits' dtype, the op in fp32")
    return ""


def _row_view(n: Node) -> Node | None:
    """``p`` for a view of ``p`` holding the same rows in the same order (a reshape keeping the last dim, a
    squeeze / unsqueeze, or basic indexing that selects every element: ``p[:, -1]`` of a ``(B, 1, V)``)."""
    if n.op == "call_function" and n.target is operator.getitem:
        index = n.args[1] if isinstance(n.args[1], tuple) else (n.args[1],)
        if not all(i is None or i is Ellipsis or isinstance(i, (int, slice)) for i in index):
            return None
    elif not (n.op == "call_method" and n.target in _ROW_VIEWS
              or n.op == "call_function" and getattr(n.target, "__name__", "") in _ROW_VIEWS):
        return None
    src = n.args[0] if n.args and isinstance(n.args[0], Node) else None
    sv, nv = tensor_val(src), tensor_val(n)
    if sv is None or nv is None or sv.dim() == 0 or nv.dim() == 0 or sv.numel() != nv.numel() \
            or sv.shape[-1] != nv.shape[-1]:
        return None
    return src


def _symbolic(mask: Node, depth: int = 6) -> bool:
    """Whether a symbolic size or number (a SymInt / SymFloat of dynamic shapes) feeds ``mask``."""
    seen, frontier = set(), [mask]
    for _ in range(depth):
        nxt = []
        for n in frontier:
            for a in n.all_input_nodes:
                if a in seen:
                    continue
                seen.add(a)
                if isinstance(val(a), (torch.SymInt, torch.SymFloat)):
                    return True
                nxt.append(a)
        frontier = nxt
    return False


def _part_of_softmax(n: Node) -> bool:
    """``n`` selects part of a softmax's output (``p[:, -1]`` of a ``(B, 2, V)``): fewer entries than it has."""
    if not (n.op == "call_function" and n.target is operator.getitem or n.op == "call_method"
            and n.target in ("select", "narrow")) or not n.args or not isinstance(n.args[0], Node):
        return False
    call = softmax_call(n.args[0])
    return call is not None and call.kind == "softmax"


def _match(node: Node) -> SampleMatch | None:
    c = canon(node)
    if c is None or c[0] != "multinomial" or not isinstance(c[1].get("input"), Node):
        return None
    drawn, views = c[1]["input"], []
    while (src := _row_view(drawn)) is not None and len(views) < 4:
        views.append(drawn)
        drawn = src
    call = softmax_call(drawn)
    if call is None and _part_of_softmax(drawn):
        return SampleMatch(anchor=node).skip("the draw reads some of the softmax's rows (a selection): not fused")
    if call is None or call.kind != "softmax":
        return None
    m = SampleMatch(anchor=node, dead=list(views))
    dv = tensor_val(c[1]["input"])
    m.flat = dv is not None and dv.dim() == 1
    probs = call.node
    pv = tensor_val(probs)
    if pv is not None:
        m.device = pv.device.type
    m.dead.append(probs)
    if node.kwargs.get("generator") is not None:
        return m.skip("the draw uses a given torch.Generator, which the graph cannot hand to the op")
    if c[1].get("num_samples") != 1:
        return m.skip(f"num_samples={c[1].get('num_samples')!r}: the op draws one token per row")
    if call.problem or input_problem(call.x):
        return m.skip(call.problem or input_problem(call.x))
    if pv is None or call.dim != pv.dim() - 1 or call.pre_cast is not None:
        return m.skip("a softmax that is not over the last dim of the logits in their own dtype")
    why = _walk(m, call.x, probs)
    if why:
        return m.skip(why)
    pattern = set(m.dead) | {node}
    for n in m.dead:
        writes = writes_of(n)
        if writes is None or any(w not in pattern for w in writes):
            return m.skip(f"{op_label(n)} of the chain is written in place (or through a view) before the draw")
    if pv.dtype == torch.float64 and m.device == "cuda":
        return m.skip("float64 probabilities on CUDA: the kernel computes in fp32")
    m.private = all(u in pattern for n in m.dead for u in n.users) and all(
        n.args[0] in pattern for n in m.dead if is_mutation(n))
    return m


def _checks(m: SampleMatch, ctx: PassContext) -> str:
    if ctx.export:
        return "no ONNX / MLIR translation of smx::sample: the draw stays as written"
    w = mutation_inside(m.anchor, set(m.dead) | {m.base})
    return f"the logits may be written in place ({op_label(w)}) before the draw" if w is not None else ""


_LADDER = Ladder(checks=_checks)


def graph_sample(x: torch.Tensor, *, temperature: float, top_k: int, top_p: float, min_p: float,
                 min_tokens_to_keep: int, flat: bool) -> torch.Tensor:
    """What a rewritten site calls (traced by AOTAutograd): ``multinomial``'s result for the rows of ``x``
    (any leading dims): ``(rows, 1)``, or ``(1,)`` when the draw's input was one row (``flat``)."""
    rows = x.reshape(-1, x.shape[-1])
    uniform = torch.rand(rows.shape[0], device=x.device)
    tokens = torch.ops.smx.sample.default(rows, uniform, temperature, top_k, top_p, min_p, min_tokens_to_keep)
    return tokens.reshape(1) if flat else tokens


class SamplePass(RewritePass):
    """``multinomial(softmax(filters(x / T)))`` -> one ``smx::sample`` call (see the module docstring)."""

    name = "sample"

    def find(self, graph: Graph, ctx: PassContext, exclude: set) -> list[SampleMatch]:
        return find_sites(graph, ctx, exclude, _match, _LADDER)

    def rewrite(self, graph: Graph, m: SampleMatch, ctx: PassContext) -> None:
        """Insert the op before the chain's first node (the logits are read before any in-place filter)."""
        order = {n: i for i, n in enumerate(graph.nodes)}
        first = min(m.dead, key=order.__getitem__)
        with graph.inserting_before(first):
            call = graph.call_function(graph_sample, (m.base,), {**m.params(), "flat": m.flat})
        inputs = m.anchor.all_input_nodes
        replace_anchor(graph, m.anchor, call, call, m.dead if m.private else [])
        if not m.private:   # the chain stays for its other users; what nobody reads any more goes
            erase_unused_pure(graph, inputs)

    def touched(self, m: SampleMatch) -> set[Node]:
        # a chain shared with another draw stays (only the draw is replaced): both can be rewritten in one round
        return m.nodes() if m.private else {m.anchor}

    def checkable(self, m: Match) -> bool:
        return False   # random draws: nothing to compare value by value
