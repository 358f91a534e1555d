"""Whether an in-place write between a site's nodes can change what the fused op reads.

A fused op replacing a pattern sits where its anchor was and reads the pattern's inputs there; the original read
them where its nodes consume them. A write in between matters unless the tensor it writes is provably private: a
fresh result of an allocating op (arithmetic, a factory, ``clone``), with every alias of it (its views, anything
not known to allocate) read by the pattern only after the write. DeBERTa builds its relative-position bias as
``score = c2p / s; score += p2c / s`` before adding it to the scores; Data2Vec-Vision its bias index with ``+=``;
Swin-v2 its bias MLP with ``nn.ReLU(inplace=True)`` on a fresh ``linear``; Funnel multiplies a view of its
positional scores in place.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import Node

from .contraction import contraction
from .graph import INPLACE_OPERATORS, canon, inplace_flag, is_mutation

# canonical ops (graph.canon) whose result is always new memory
_ALLOCATING_OPS = {"add", "sub", "mul", "div", "exp", "log", "tanh", "softmax", "log_softmax", "matmul", "sum",
                   "amax", "logsumexp"}
_FACTORIES = {torch.arange, torch.zeros, torch.ones, torch.full, torch.empty, torch.tensor, torch.zeros_like,
              torch.ones_like, torch.full_like, torch.empty_like, torch.rand, torch.randn, torch.cat, torch.stack,
              torch.clone, torch.where, torch.nn.functional.linear, torch._C._nn.linear}


def mutation_inside(anchor: Node, pattern) -> Node | None:
    """The first in-place op not part of ``pattern`` that runs between the pattern's first node and ``anchor``
    and may change what the pattern reads (see the module docstring), or None."""
    pattern = set(pattern)
    n = next((x for x in anchor.graph.nodes if x in pattern or x is anchor), None)
    order = {x: i for i, x in enumerate(anchor.graph.nodes)}
    while n is not None and n is not anchor:
        if n not in pattern and is_mutation(n) and not _private_write(n, pattern, order):
            return n
        n = n.next
    return None


def _allocates(n: Node) -> bool:
    if "out" in n.kwargs:   # out= returns its argument
        return False
    if n.target is torch.einsum:   # a one-operand einsum ("ij->ji") may be a view
        return len(n.all_input_nodes) >= 2
    c = canon(n)
    return (c is not None and c[0] in _ALLOCATING_OPS) or (n.op == "call_function" and n.target in _FACTORIES) or (
        n.op == "call_method" and n.target == "clone")


def _written(n: Node) -> Node | None:
    """The tensor an in-place op writes, when it is its first argument and the op writes nothing else
    (``set_`` makes its argument share another tensor's storage: not one of them)."""
    if not n.args or not isinstance(n.args[0], Node) or "out" in n.kwargs:
        return None
    if (n.op == "call_method" and n.target != "set_") or (n.op == "call_function" and n.target in INPLACE_OPERATORS):
        return n.args[0]
    if n.op == "call_function" and inplace_flag(n):    # F.relu(x, inplace=True) writes its input
        return n.args[0]
    return None


def _base(n: Node | None) -> Node | None:
    """The allocating node ``n`` views (back through single-input ops and earlier writes), or None."""
    while n is not None and not _allocates(n):
        if is_mutation(n):
            n = _written(n)
        elif n.op in ("call_function", "call_method") and n.args and n.all_input_nodes == [n.args[0]]:
            n = n.args[0]
        else:
            return None
    return n


def _aliases(base: Node) -> set | None:
    """``base`` and everything computed from it by an op not known to allocate (it may be a view of it); None when
    one of them may come to share another tensor's storage (``set_``)."""
    aliases, stack = {base}, [base]
    while stack:
        for u in stack.pop().users:
            if u.op == "call_method" and u.target == "set_":
                return None
            if u not in aliases and not _allocates(u):
                aliases.add(u)
                stack.append(u)
    return aliases


def may_be_written(n: Node) -> bool:
    """Whether some node of the graph may write ``n`` or a tensor sharing its memory in place."""
    base = _base(n) or n
    aliases = _aliases(base)
    return aliases is None or any(is_mutation(a) for a in aliases)


def writes_of(n: Node) -> list[Node] | None:
    """The in-place ops that may write ``n`` or a view of it (None: its aliases are not known)."""
    aliases = _aliases(_base(n) or n)
    return None if aliases is None else [a for a in aliases if is_mutation(a)]


def _private_write(write: Node, pattern: set, order: dict) -> bool:
    """``write`` changes a fresh tensor whose every alias the pattern reads only after ``write``."""
    base = _base(_written(write))
    aliases = _aliases(base) if base is not None else None
    if aliases is None:
        return False
    return all(order[p] > order[write] for p in pattern if any(a in aliases for a in p.all_input_nodes))


def fresh_tensor(n: Any) -> bool:
    """``n`` is new memory (a contraction, arithmetic, a factory, ``clone``), not a view or an alias of another:
    an in-place op on it changes nothing else."""
    return isinstance(n, Node) and (contraction(n) is not None or _allocates(n))


__all__ = ["mutation_inside", "may_be_written", "fresh_tensor", "writes_of"]
