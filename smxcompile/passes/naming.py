"""Names of sites in the eager model (``module#index``) and the regions :func:`smxcompile.swap` replaced.

A site's ``module`` is the innermost ``nn.Module`` call that made it, ``index`` which ``softmax`` call of that
call's ``forward`` it is: :func:`smxcompile.quantize_softmax` and :func:`smxcompile.swap` find the call at run
time by that name.
"""

from __future__ import annotations

import re

import torch
from torch.fx import Graph, Node

from ..report import Site, user_location

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


def name_site(site: Site, match, calls: dict[Node, tuple[str, int]]) -> None:
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


__all__ = ["module_path", "normalize_module_path", "softmax_calls", "name_site", "swapped_regions"]
