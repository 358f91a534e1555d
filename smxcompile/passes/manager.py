"""The pass manager: the one ordered list of rewrite kinds, and the loops over it — analysis (:func:`analyze`),
rewriting (:class:`SmxPass`, Inductor's ``pre_grad_custom_pass``) and ``check`` (:mod:`.check`).

The backend installs :class:`SmxPass` in Inductor's ``pre_grad_custom_pass`` slot, where the graph is still
torch-level (``torch.softmax``, ``matmul`` ... with the user's stack traces), before AOTAutograd decomposes
softmax and before Inductor's joint-graph patterns fuse attention (torch/_inductor/fx_passes/pre_grad.py).
``uuid()`` hashes the source of every module that decides what a pass emits, plus the options, so Inductor's
FX graph cache keeps working and never serves a stale rewrite (torch/_inductor/custom_graph_pass.py).
"""

from __future__ import annotations

import functools
import hashlib
import logging
from pathlib import Path
from typing import Iterator

import torch
import torch.fx
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.fx import Graph, Node

from ..options import SmxOptions
from ..report import Report, Site
from .attention import AttentionPass
from .cross_entropy import CrossEntropyPass
from .naming import name_site, softmax_calls, swapped_regions
from .patterns.graph import functorch_op
from .protocol import Match, PassContext, RewritePass
from .quant_softmax import QuantSoftmaxPass
from .sampling import SamplePass
from .softmax import SoftmaxPass
from .softmax_topk import SoftmaxTopkPass

log = logging.getLogger("smxcompile")

#: Every rewrite kind, in the order they run. Each pass leaves alone the nodes of the sites earlier passes
#: claimed: cross-entropy owns the log-softmax of ``nll_loss(log_softmax(x))``; a softmax feeding a quantizer is
#: one site; an attention block is one site; softmax + top-k owns its softmax; the plain softmax pass comes last.
PASSES: tuple[RewritePass, ...] = (CrossEntropyPass(), QuantSoftmaxPass(), AttentionPass(), SamplePass(),
                                   SoftmaxTopkPass(), SoftmaxPass())

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


def find_all(graph: Graph, ctx: PassContext, exclude: set[Node] = frozenset()) -> Iterator[tuple[RewritePass, Match]]:
    """Every site of ``graph`` (not its subgraphs), pass by pass, each pass excluding what earlier ones claimed;
    the graph is not changed."""
    taken = set(exclude)
    for p in PASSES:
        matches = p.find(graph, ctx, taken)
        taken |= claimed(matches)
        for m in matches:
            yield p, m


def claimed(matches: list[Match]) -> set[Node]:
    """The nodes later passes must leave alone: those of rewritten sites and of sites kept whole."""
    return {n for m in matches if m.claims() for n in m.nodes()}


def analyze(graph: Graph, options: SmxOptions, graph_tag: str = "g0", skip: frozenset[str] = frozenset(),
            export: bool = False) -> Report:
    """Every candidate site of ``graph`` (and its subgraphs) and what the passes would do; does not change it."""
    sites = []
    swaps_seen: set = set()
    for prefix, g, _ in subgraphs(graph):
        swapped, swap_sites = swapped_regions(g, graph_tag, swaps_seen)
        sites.extend(swap_sites)
        ctx = PassContext(options, frozenset(skip), prefix, export, functorch_op(g))
        calls = softmax_calls(g)
        for _, m in find_all(g, ctx, swapped):
            site = m.to_site(graph_tag)
            name_site(site, m, calls)
            sites.append(site)
    return Report(sites)


class SmxPass(CustomGraphPass):
    """All smxcompile rewrites, as one pre-grad custom pass for Inductor.

    Args:
        options: validated backend options.
        graph_tag: name of the graph in the report (``g0``, ``g1``...).
        skip: keys of sites that must be kept (sites whose ``check`` failed).
        report: a :class:`Report` the pass appends its sites to.
        export: the graph is captured for an export (ONNX, MLIR): rewritten sites call the smx ops on every
            device and carry no eager-only fix-ups (see :class:`smxcompile.passes.protocol.PassContext`).
    """

    def __init__(self, options: SmxOptions, graph_tag: str = "g0", skip: frozenset[str] = frozenset(),
                 report: Report | None = None, *, export: bool = False):
        self.options = options
        self.graph_tag = graph_tag
        self.skip = frozenset(skip)
        self.report = report if report is not None else Report()
        self.export = export

    def __call__(self, graph: Graph) -> None:
        swaps_seen: set = set()
        for prefix, g, owner in subgraphs(graph):
            if self._rewrite(g, prefix, swaps_seen) and owner is not None:
                owner.recompile()

    def _rewrite(self, graph: Graph, prefix: str, swaps_seen: set) -> bool:
        """Rewrite every site of one graph; True if anything changed."""
        # sites the user swapped for a variant (smxcompile.swap) are theirs: no pass touches their ops
        swapped, swap_sites = swapped_regions(graph, self.graph_tag, swaps_seen)
        self.report.sites.extend(swap_sites)
        ctx = PassContext(self.options, self.skip, prefix, self.export, functorch_op(graph))
        calls = softmax_calls(graph)
        taken = set(swapped)
        changed = False
        for p in PASSES:
            matches, sites, did = self._apply(p, graph, ctx, taken, calls)
            self.report.sites.extend(sites)
            changed = changed or did
            taken |= claimed(matches)
        return changed

    def _apply(self, p: RewritePass, graph: Graph, ctx: PassContext, exclude: set,
               calls: dict[Node, tuple[str, int]]) -> tuple[list, list[Site], bool]:
        """Rewrite ``p``'s sites: -> (the last matches, their report entries named as in :func:`analyze`, changed).

        Sites touching the same node are rewritten one after the other: with ``p.repeat`` the pass looks
        again after each round (nested sites), otherwise a later overlapping site is left as it is."""
        first = matches = p.find(graph, ctx, exclude)
        outcome: dict[str, Site] = {}
        changed_by_guard = False

        def site(m: Match) -> Site:
            s = m.to_site(self.graph_tag)
            name_site(s, m, calls)
            return s

        for _ in range(len(first) + 1 if p.repeat else 1):
            todo = [m for m in matches if m.action == "rewritten"]
            if not todo:
                break
            done: set[Node] = set()
            for m in todo:
                touched = p.touched(m)
                if touched & done:
                    continue
                done |= touched
                outcome[m.key] = site(m)
                p.rewrite(graph, m, ctx)
            graph.lint()
            if p.repeat:
                matches = p.find(graph, ctx, exclude)
        for m in matches:
            outcome.setdefault(m.key, site(m))
            if m.guarded and m.action != "rewritten":
                p.guard(graph, m, ctx)
                changed_by_guard = True
        first_keys = [m.key for m in first]
        order = first_keys + [k for k in outcome if k not in set(first_keys)]
        sites = [outcome[k] for k in dict.fromkeys(order) if k in outcome]
        changed = changed_by_guard or any(s.action == "rewritten" for s in outcome.values())
        return matches, sites, changed

    def uuid(self) -> str:
        h = hashlib.sha256()
        h.update(source_hash().encode())
        h.update(self.options.key().encode())
        h.update(",".join(sorted(self.skip)).encode())
        h.update(b"export" if self.export else b"")
        return h.hexdigest()


__all__ = ["PASSES", "SmxPass", "analyze", "find_all", "claimed", "source_hash", "subgraphs"]
