"""Compile-time constants: subgraphs computed from constants only, evaluated while a pass analyses a graph.

transformers builds its causal mask from ``arange`` comparisons when no padding mask is given; evaluated here
(with torch itself, on the real device) the attention pass can tell that the mask is exactly the causal lower
triangle and call the fused kernel with ``is_causal=True``, which skips the masked tiles. A
:class:`ConstEvaluator` lives for one analysis: no evaluated tensor outlives it or rides along in the graph's
metadata.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import Node

from .graph import is_mutation, is_number, is_random, static_shape, tensor_val
from .masks import MASK_VALUE
from .writes import may_be_written

#: Largest constant tensor (elements) evaluated at compile time (a causal mask of 8192 x 8192 tokens).
MAX_CONST_ELEMENTS = 1 << 26
#: Most nodes one evaluation may visit.
MAX_CONST_NODES = 256

_MISSING = object()


def evaluable(node: Node) -> bool:
    """A pure torch / operator call that may be run at compile time (no mutation, no randomness, no I/O), whose
    result no later write changes."""
    if is_random(node) or is_mutation(node) or may_be_written(node):
        return False
    if node.op == "call_method":
        return isinstance(node.target, str) and not node.target.startswith("_") or node.target in (
            "__getitem__", "__and__", "__or__", "__invert__", "__xor__")
    mod = getattr(node.target, "__module__", "") or ""
    name = getattr(node.target, "__name__", "")
    if node.target in (torch.finfo, torch.iinfo) or name in ("item", "tolist", "manual_seed"):
        return node.target in (torch.finfo, torch.iinfo)
    return mod in ("_operator", "operator") or mod == "torch" or mod.startswith(("torch._C._VariableFunctions",
                                                                                 "torch.functional", "torch._refs",
                                                                                 "torch.nn.functional"))


class ConstEvaluator:
    """Evaluates constant subgraphs, each node once (one instance per analysis of a graph)."""

    def __init__(self) -> None:
        self._cache: dict[Node, Any] = {}

    def value(self, node: Node, budget: list | None = None) -> Any:
        """The value of ``node`` when it is computed from constants only (no graph input, no random), else None.

        Tensors larger than :data:`MAX_CONST_ELEMENTS` or with symbolic sizes are not evaluated."""
        if node in self._cache:
            return self._cache[node]
        budget = budget if budget is not None else [MAX_CONST_NODES]
        out = self._evaluate(node, budget)
        self._cache[node] = out
        return out

    def known(self, node: Node) -> Any:
        """The value already evaluated for ``node`` (None when it was not, or is not constant)."""
        return self._cache.get(node)

    def number(self, x: Any) -> float | None:
        """A Python number, or a 0-d constant tensor node (``torch.full([], v)``, ``torch.tensor(v)``), as a float."""
        if is_number(x):
            return float(x)
        if isinstance(x, Node):
            v = tensor_val(x)
            if v is not None and v.dim() == 0:
                c = self.value(x)
                if c is not None:
                    return float(c)
        return None

    def _evaluate(self, node: Node, budget: list) -> Any:
        budget[0] -= 1
        if budget[0] < 0 or node.op not in ("call_function", "call_method"):
            return None
        v = tensor_val(node)
        if v is not None and (static_shape(v) is None or v.numel() > MAX_CONST_ELEMENTS):
            return None
        if not evaluable(node):
            return None

        def ev(a):
            if isinstance(a, Node):
                r = self.value(a, budget)
                return _MISSING if r is None else r
            if isinstance(a, (list, tuple)):
                items = [ev(x) for x in a]
                return _MISSING if any(x is _MISSING for x in items) else type(a)(items)
            if isinstance(a, slice):
                parts = [ev(a.start), ev(a.stop), ev(a.step)]
                return _MISSING if any(x is _MISSING for x in parts) else slice(*parts)
            if isinstance(a, dict):
                items = {k: ev(x) for k, x in a.items()}
                return _MISSING if any(x is _MISSING for x in items.values()) else items
            return a

        args, kwargs = ev(tuple(node.args)), ev(dict(node.kwargs))
        if args is _MISSING or kwargs is _MISSING:
            return None
        try:
            with torch.no_grad():
                if node.op == "call_method":
                    return getattr(args[0], node.target)(*args[1:], **kwargs)
                return node.target(*args, **kwargs)
        except Exception:
            return None


#: Methods whose second operand contributes only its shape / dtype (``x.expand_as(scores)``).
SHAPE_ONLY_METHODS = frozenset({"expand_as", "view_as", "reshape_as", "type_as"})


def depends_on(node: Any, target: Node, limit: int = 4096, *, shape_refs: list | None = None) -> bool:
    """``target`` is an ancestor of (or is) ``node``; True when the walk gives up (unknown counts as yes).

    With ``shape_refs`` (a list), an edge that carries only a shape (the second operand of ``expand_as``,
    ``view_as``, ``reshape_as``, ``type_as``) is not a dependence on the values: the nodes reading ``target``'s
    side that way are appended to it instead."""
    if not isinstance(node, Node):
        return False
    seen, stack = set(), [node]
    while stack and limit > 0:
        n = stack.pop()
        if n is target:
            return True
        if n in seen:
            continue
        seen.add(n)
        limit -= 1
        if shape_refs is not None and n.op == "call_method" and n.target in SHAPE_ONLY_METHODS \
                and len(n.args) == 2 and not n.kwargs:
            if depends_on(n.args[1], target):
                shape_refs.append(n)
            stack.append(n.args[0])
            continue
        stack.extend(n.all_input_nodes)
    return limit <= 0


def additive_keep(c: torch.Tensor) -> torch.Tensor | None:
    """The kept positions of a constant additive mask whose entries are all 0 (kept) or masking
    (<= :data:`MASK_VALUE`, ``-inf`` included); None for any other mask (a bias, +inf, NaN)."""
    if not bool(torch.isfinite(c).all()) and not bool((c == float("-inf")).logical_or(torch.isfinite(c)).all()):
        return None
    if not bool(((c == 0) | (c <= MASK_VALUE)).all()):
        return None
    return c == 0


def is_causal_keep(keep: torch.Tensor, L: int, S: int) -> bool:
    """``keep`` (bool, broadcasting to ``(..., L, S)``) is exactly the causal lower triangle
    ``tril(ones(L, S))`` (top-left aligned, as ``F.scaled_dot_product_attention(is_causal=True)``) everywhere."""
    if keep.dim() < 2 or keep.shape[-2:] != (L, S) and not (keep.shape[-2] in (1, L) and keep.shape[-1] in (1, S)):
        return False
    keep = keep.expand(*keep.shape[:-2], L, S).reshape(-1, L, S)
    tril = torch.ones(L, S, dtype=torch.bool, device=keep.device).tril()
    return bool((keep == tril).all())


__all__ = ["MAX_CONST_ELEMENTS", "MAX_CONST_NODES", "SHAPE_ONLY_METHODS", "ConstEvaluator", "evaluable", "depends_on",
           "additive_keep",
           "is_causal_keep"]
