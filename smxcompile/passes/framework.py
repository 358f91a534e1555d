"""The pass framework: smxcompile's rewrites as one Inductor ``CustomGraphPass``.

The backend installs :class:`SmxPass` in Inductor's ``pre_grad_custom_pass`` slot, where the
graph is still torch-level (``torch.softmax``, ``matmul`` ... with the user's stack traces), before
AOTAutograd decomposes softmax and before Inductor's joint-graph patterns fuse attention
(see shared/reference/TORCH-FACTS.md). ``uuid()`` hashes the source of every module of the
package that decides what a pass emits, plus the options, so Inductor's FX graph cache keeps
working and never serves a stale rewrite.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import re
from pathlib import Path

import torch
import torch.fx
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.fx import Graph, Node

from ..options import SmxOptions
from ..report import Report, Site, user_location
from .attention import claimed_nodes as attention_claimed, find_attention_sites, rewrite_attention
from .cross_entropy import claimed_nodes, find_ce_sites, rewrite_ce
from .quant_softmax import claimed_nodes as quant_claimed, find_quant_softmax_sites, rewrite_quant_softmax
from .softmax import find_softmax_sites, rewrite_softmax
from .softmax_topk import claimed_nodes as topk_claimed, find_softmax_topk_sites, rewrite_softmax_topk

log = logging.getLogger("smxcompile")

_PKG = Path(__file__).resolve().parent.parent


@functools.lru_cache(maxsize=1)
def source_hash() -> str:
    """sha256 over the source of smxcompile's passes and kernels (the code that shapes the output graph)."""
    h = hashlib.sha256()
    files = sorted(
        p for sub in ("passes", "kernels") for p in (_PKG / sub).rglob("*.py")
    ) + [_PKG / "options.py", _PKG / "report.py"]
    for p in files:
        h.update(p.relative_to(_PKG).as_posix().encode())
        h.update(p.read_bytes())
    return h.hexdigest()


def subgraphs(graph: Graph) -> list[tuple[str, Graph, torch.fx.GraphModule | None]]:
    """``graph`` and the graphs of its higher-order-op bodies (``torch.utils.checkpoint``, ``cond``...),
    as ``(prefix, graph, owning GraphModule)``; prefix is ``""`` for ``graph`` itself."""
    out: list[tuple[str, Graph, torch.fx.GraphModule | None]] = [("", graph, None)]
    owner = graph.owning_module
    if owner is None:
        return out
    for name, mod in owner.named_modules():
        if name and isinstance(mod, torch.fx.GraphModule):
            out.append((name + "/", mod.graph, mod))
    return out


def analyze(graph: Graph, options: SmxOptions, graph_tag: str = "g0", skip: frozenset[str] = frozenset()) -> Report:
    """Every candidate site of ``graph`` (and its subgraphs) and what the passes would do; does not change it."""
    sites = []
    swaps_seen: set = set()
    for prefix, g, _ in subgraphs(graph):
        ce = find_ce_sites(g, options, skip, prefix)
        swapped, swap_sites = swapped_regions(g, graph_tag, swaps_seen)
        sites.extend(swap_sites)
        taken = claimed_nodes(ce) | swapped
        qs = find_quant_softmax_sites(g, options, skip, prefix, exclude=taken)
        taken = taken | quant_claimed(qs)
        at = find_attention_sites(g, options, skip, prefix, exclude=taken)
        taken = taken | attention_claimed(at)
        tk = find_softmax_topk_sites(g, options, skip, prefix, exclude=taken)
        sm = find_softmax_sites(g, options, skip, prefix, exclude=taken | topk_claimed(tk, kept=True))
        calls = softmax_calls(g)
        for m in (*ce, *qs, *at, *tk, *sm):
            site = m.to_site(graph_tag)
            _name_site(site, m, calls)
            sites.append(site)
    return Report(sites)


_SOFTMAX_FNS = (torch.nn.functional.softmax, torch.softmax, torch.special.softmax)


def module_path(node: Node) -> tuple[str, str]:
    """``(key, path)`` of the innermost ``nn.Module`` call that produced ``node`` (``("", "")`` at the root).

    ``key`` is Dynamo's ``nn_module_stack`` key (one per module *call*: a module called twice gets
    ``id`` and ``id@1``); ``path`` is the qualified name as ``named_modules()`` spells it.
    """
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return "", ""
    key, (path, _) = list(stack.items())[-1]
    return str(key), normalize_module_path(str(path))


def normalize_module_path(path: str) -> str:
    """Dynamo's ``L['self'].layers[0]._modules['attn']`` / ``L['args'][0].h.0.attn`` -> ``layers.0.attn``."""
    p = re.sub(r"^L\['[^']*'\](\[[^\]]*\])*", "", path)   # L['self'], L['args'][0] (a wrapped forward)
    p = re.sub(r"\._modules\['([^']*)'\]", r".\1", p)
    p = re.sub(r"\['([^']*)'\]", r".\1", p)
    p = re.sub(r"\[(\d+)\]", r".\1", p)
    return p.lstrip(".")


def softmax_calls(graph: Graph) -> dict[Node, tuple[str, int]]:
    """Every ``softmax`` call of ``graph`` -> ``(module path, index of the call in that module call)``.

    The index counts calls of ``F.softmax`` / ``torch.softmax`` / ``torch.special.softmax`` /
    ``Tensor.softmax`` (``nn.Softmax`` is a module of its own) in graph order, restarting at
    every call of the module, so it equals the order in which the eager ``forward`` makes them.
    """
    counts: dict[str, int] = {}
    out: dict[Node, tuple[str, int]] = {}
    for n in graph.nodes:
        if not ((n.op == "call_function" and n.target in _SOFTMAX_FNS)
                or (n.op == "call_method" and n.target == "softmax")):
            continue
        key, path = module_path(n)
        i = counts.get(key, 0)
        counts[key] = i + 1
        out[n] = (path, i)
    return out


def _name_site(site: Site, match, calls: dict[Node, tuple[str, int]]) -> None:
    """Fill ``site.module`` / ``site.index`` from the match's softmax call (or its anchor)."""
    sm = getattr(match, "softmax", None)
    node = sm if isinstance(sm, Node) else match.anchor
    if node in calls:
        site.module, site.index = calls[node]
    else:
        site.module = module_path(node)[1]


def swapped_regions(graph: Graph, graph_tag: str, seen: set | None = None) -> tuple[set[Node], list[Site]]:
    """The nodes of the sites :func:`smxcompile.swap` replaced (they carry ``node.meta["custom"]["smx_swap"]``,
    set by ``torch.fx.traceback.annotate``) and one ``swapped`` :class:`Site` per swapped call. ``seen``:
    the calls already reported from another part of the same graph (a subgraph of a higher-order op
    holds part of a variant's ops, e.g. its ``torch.no_grad()`` block)."""
    nodes: set[Node] = set()
    first: dict[tuple, Node] = {}
    for n in graph.nodes:
        ann = n.meta.get("custom") or {}
        key = ann.get("smx_swap")
        if key is None:
            continue
        nodes.add(n)
        # one site per call of the swapped module (the variant's own SwapSite module is not part of the name)
        stack = [k for k, (path, _) in (n.meta.get("nn_module_stack") or {}).items()
                 if not normalize_module_path(str(path)).startswith("smx_")]
        first.setdefault((key, stack[-1] if stack else None, ann.get("smx_variant"), ann.get("smx_kind")), n)
    sites = []
    seen = set() if seen is None else seen
    named = {ident[0] for ident in first if ident[1] is not None} | {ident[0] for ident in seen}
    for ident, n in first.items():
        # nodes without a module stack (a no_grad block's ops) belong to a call reported from its other nodes
        if ident in seen or (ident[1] is None and ident[0] in named):
            continue
        seen.add(ident)
        key, _, variant, kind = ident
        module, _, index = str(key).rpartition("#")
        sites.append(Site(kind=kind if kind in ("attention", "softmax") else "softmax", action="swapped",
                          op=f"variant:{variant}", detail=f"variant={variant}", graph=graph_tag, node=n.name,
                          location=user_location(n.meta.get("stack_trace")), module=module,
                          index=int(index) if index.isdigit() else -1))
    return nodes, sites


class SmxPass(CustomGraphPass):
    """All smxcompile rewrites, as one pre-grad custom pass for Inductor.

    Args:
        options: validated backend options.
        graph_tag: name of the graph in the report (``g0``, ``g1``...).
        skip: names of anchor nodes that must be kept (sites whose ``check`` failed).
        report: a :class:`Report` the pass appends its sites to (the backend reads it).
    """

    def __init__(self, options: SmxOptions, graph_tag: str = "g0", skip: frozenset[str] = frozenset(),
                 report: Report | None = None):
        self.options = options
        self.graph_tag = graph_tag
        self.skip = frozenset(skip)
        self.report = report if report is not None else Report()

    def __call__(self, graph: Graph) -> None:
        self._swaps_seen: set = set()
        for prefix, g, owner in subgraphs(graph):
            if self._rewrite(g, prefix) and owner is not None:
                owner.recompile()

    def _rewrite(self, graph: Graph, prefix: str) -> bool:
        """Rewrite every site of one graph; True if anything changed."""
        # sites the user swapped for a variant (smxcompile.swap) are theirs: no pass touches their ops
        swapped, swap_sites = swapped_regions(graph, self.graph_tag, getattr(self, "_swaps_seen", None))
        self.report.sites.extend(swap_sites)
        # cross-entropy first: it owns the log_softmax of nll_loss(log_softmax(x))
        ce = find_ce_sites(graph, self.options, self.skip, prefix)
        ce_sites = [m.to_site(self.graph_tag) for m in ce]
        changed = False
        taken_ce: set = set()
        for m in ce:
            if m.action != "rewritten":
                continue
            touched = set(m.dead)
            if touched & taken_ce:
                continue
            taken_ce |= touched
            rewrite_ce(graph, m)
            changed = True
        if changed:
            graph.lint()
        self.report.sites.extend(ce_sites)
        q_changed, q_taken = self._rewrite_quant_softmax(graph, prefix, taken_ce | swapped)
        q_taken = q_taken | swapped
        changed = q_changed or changed
        at_changed, kept_whole = self._rewrite_attention(graph, prefix, q_taken)
        kept_whole = kept_whole | q_taken
        changed = at_changed or changed
        tk_changed, tk_kept = self._rewrite_softmax_topk(graph, prefix, kept_whole)
        changed = tk_changed or changed
        return self._rewrite_softmax(graph, prefix, kept_whole | tk_kept) or changed

    def _rewrite_softmax_topk(self, graph: Graph, prefix: str, exclude: set) -> tuple[bool, set]:
        """Rewrite the softmax + top-k / argmax sites; returns (changed, nodes of the sites kept on purpose)."""
        found = find_softmax_topk_sites(graph, self.options, self.skip, prefix, exclude=exclude)
        kept = topk_claimed([m for m in found if m.action == "kept"], kept=True)   # CPU-policy keeps
        changed = False
        for m in found:
            if m.action == "rewritten":
                rewrite_softmax_topk(graph, m)
                changed = True
        if changed:
            graph.lint()
        self.report.sites.extend(m.to_site(self.graph_tag) for m in found)
        return changed, kept

    def _rewrite_sites(self, graph: Graph, found: list, rewrite, claimed) -> tuple[bool, set]:
        """Rewrite every ``rewritten`` match of ``found``; returns (changed, ``claimed`` nodes of the others)."""
        kept = claimed([m for m in found if m.action != "rewritten"])
        changed = False
        for m in found:
            if m.action == "rewritten":
                rewrite(graph, m)
                changed = True
        if changed:
            graph.lint()
        self.report.sites.extend(m.to_site(self.graph_tag) for m in found)
        return changed, kept

    def _rewrite_quant_softmax(self, graph: Graph, prefix: str, exclude: set) -> tuple[bool, set]:
        """Lower softmax -> quantize sites; returns (changed, nodes of the sites kept whole)."""
        found = find_quant_softmax_sites(graph, self.options, self.skip, prefix, exclude=exclude)
        return self._rewrite_sites(graph, found, rewrite_quant_softmax, quant_claimed)

    def _rewrite_attention(self, graph: Graph, prefix: str, exclude: set = frozenset()) -> tuple[bool, set]:
        """Rewrite the attention sites; returns (changed, nodes of the blocks the CPU policy keeps whole)."""
        found = find_attention_sites(graph, self.options, self.skip, prefix, exclude=exclude)
        return self._rewrite_sites(graph, found, rewrite_attention, attention_claimed)

    def _rewrite_softmax(self, graph: Graph, prefix: str, exclude: set = frozenset()) -> bool:
        first = find_softmax_sites(graph, self.options, self.skip, prefix, exclude=exclude)
        outcome: dict[str, Site] = {}
        matches = first
        # Rewrite every match whose nodes no other chosen match touches, then look again: nested
        # sites (softmax(softmax(x).float())) share nodes and are rewritten one after the other.
        for _ in range(len(first) + 1):
            todo = [m for m in matches if m.action == "rewritten"]
            if not todo:
                break
            taken: set = set()
            for m in todo:
                touched = {m.anchor, m.x, m.mask, *m.dead} - {None}
                if touched & taken:
                    continue
                taken |= touched
                outcome[m.key] = m.to_site(self.graph_tag)
                rewrite_softmax(graph, m)
            graph.lint()
            matches = find_softmax_sites(graph, self.options, self.skip, prefix, exclude=exclude)
        for m in matches:
            outcome.setdefault(m.key, m.to_site(self.graph_tag))
        first_keys = [m.key for m in first]
        order = first_keys + [k for k in outcome if k not in set(first_keys)]
        self.report.sites.extend(outcome[k] for k in order if k in outcome)
        return any(s.action == "rewritten" for s in outcome.values())

    def uuid(self) -> str:
        h = hashlib.sha256()
        h.update(source_hash().encode())
        h.update(self.options.key().encode())
        h.update(",".join(sorted(self.skip)).encode())
        return h.hexdigest()


__all__ = ["SmxPass", "analyze", "source_hash", "subgraphs", "Site"]
