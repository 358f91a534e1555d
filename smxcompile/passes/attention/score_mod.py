"""Any other pointwise change of the attention scores, read as FlexAttention's ``score_mod``: the nodes between
the score contraction and the softmax, each computing an entry of the scores from the same entry of its inputs
(ATen's ``pointwise`` tag) or casting it, with side inputs that do not depend on the scores. The run-time side is
:func:`.replacement.graph_flex_attention` (FlexAttention: Dong et al., 2024, torch.nn.attention)."""

from __future__ import annotations

import importlib
from typing import Any

import torch
from torch.fx import Node

from ..patterns.constants import depends_on
from ..patterns.contraction import contraction
from ..patterns.casts import exact_cast
from ..patterns.graph import broadcasts_to, is_mutation, pointwise, same_shape, tensor_val


def score_chain(x: Node) -> tuple[Node, list[Node], list[Node]] | str:
    """From the softmax input ``x`` up: ``(score contraction, the changes in graph order, their side inputs)``, or
    why the scores are not changed entry by entry (a reduction or a view of the scores, several contractions)."""
    inner, stack, found = set(), [x], set()
    while stack:
        n = stack.pop()
        if n in inner or not isinstance(n, Node):
            continue
        if contraction(n) is not None:
            found.add(n)
            continue
        if not (pointwise(n) or exact_cast(n) is not None):
            continue
        inner.add(n)
        stack += n.all_input_nodes
    if len(found) != 1:
        return "the changes do not lead back to one contraction through pointwise ops and casts (views not followed)"
    qk = found.pop()
    path = [n for n in x.graph.nodes if n in inner and depends_on(n, qk)]
    if any(is_mutation(u) for n in (qk, *path) for u in n.users):
        return "the changed scores are written in place"
    shape = tuple(tensor_val(qk).shape)
    sides: list[Node] = []
    for n in path:
        if n.op == "call_function" and _import_path(n.target) is None:
            return f"'{n.name}' calls a function outside torch and operator"
        if not same_shape(tuple(tensor_val(n).shape), shape):
            return f"'{n.name}' changes the scores' shape"
        if not tensor_val(n).dtype.is_floating_point:
            return f"'{n.name}' is a mask computed from the scores"
        if tensor_val(n).dtype == torch.float64:
            return f"'{n.name}' computes the scores in float64: FlexAttention's score_mod runs in float32"
        for a in n.all_input_nodes:
            if a is qk or a in path or a in sides:
                continue
            if depends_on(a, qk):
                return f"'{a.name}' is computed from the scores, not entry by entry"
            if tensor_val(a) is None or not broadcasts_to(tuple(tensor_val(a).shape), shape):
                return f"'{a.name}' does not broadcast to the scores"
            sides.append(a)
    return qk, path, sides


def score_mod_recipe(qk: Node, path: list[Node], sides: list[Node]) -> tuple:
    """The changes as data the graph can hold: per node ``(op, target, args, kwargs)``, a function target by its
    import path, an argument ``("@path", i)`` for the i-th change's value (-1: the scores), ``("@side", i)`` for
    the i-th side input's entry."""
    where = {qk: ("@path", -1), **{n: ("@path", i) for i, n in enumerate(path)},
             **{n: ("@side", i) for i, n in enumerate(sides)}}
    enc = lambda a: torch.fx.node.map_arg(a, lambda n: where[n])  # noqa: E731
    return tuple((n.op, n.target if n.op == "call_method" else _import_path(n.target), enc(n.args), enc(n.kwargs))
                 for n in path)


def _import_path(fn: Any) -> str | None:
    name = getattr(fn, "__name__", "")
    for mod in ("operator", "torch", "torch.nn.functional", "torch.special"):
        if getattr(importlib.import_module(mod), name, None) is fn:
            return f"{mod}.{name}"
    return None


__all__ = ["score_chain", "score_mod_recipe"]
