"""The scores of an attention site, read as a graph from the softmax's input up to the contraction of Q and K.
Every node between computes each entry from the same entry of its inputs (ATen's ``pointwise`` tag), casts,
copies or views the scores, or adds to / fills a fresh tensor of them in place. Read as one chain
(:func:`score_steps`), the fused op takes its scales, soft-cap, masks and views; any other pointwise change is
FlexAttention's ``score_mod`` (:func:`flex_sides`, :func:`score_mod_recipe`; Dong et al., 2024)."""

from __future__ import annotations

import importlib
from typing import Any

import torch
from torch.fx import Node

from ..patterns.arith import inplace_scale, scale_stage
from ..patterns.casts import exact_cast
from ..patterns.constants import depends_on
from ..patterns.contraction import contraction, reshape_input
from ..patterns.graph import broadcasts_to, canon, cast_dtype, is_mutation, op_label, pointwise, same_shape, \
    same_size, tensor_val
from ..patterns.masks import add_operands, fill_mask, inplace_add_operands, inplace_fill, inplace_sub_operands, \
    mask_floor, region_add
from ..patterns.selections import no_op_copy
from ..patterns.sinks import key_concat, sink_column
from ..patterns.writes import fresh_tensor

_MAX_NODES = 512


def _written(n: Node) -> Node | None:
    """The tensor ``s += m``, ``s -= m``, ``s *= f``, ``s /= f`` (or ``add_``...), ``s.masked_fill_(c, v)`` or
    ``s[idx] = s[idx] + b`` writes, else None."""
    written = inplace_add_operands(n) or inplace_sub_operands(n) or inplace_fill(n) or region_add(n) or \
        inplace_scale(n)
    return n.args[0] if written is not None else None


def _in_chain(n: Node) -> bool:
    return (pointwise(n) or cast_dtype(n) is not None or no_op_copy(n) is not None or reshape_input(n) is not None
            or _written(n) is not None or key_concat(n) is not None)


def score_graph(x: Node, softmax: Node) -> tuple[Node, list[Node]] | str | None:
    """From the softmax input ``x`` up: ``(the contraction of Q and K, the nodes computed from it that run before
    the softmax, in graph order)``. None when no contraction of the scores' size feeds ``x`` (``softmax(x) @ W``
    is not attention); why, when the scores are read otherwise."""
    inner, seen = set(), set()
    stack, found, writes = [x], set(), []
    while stack:
        n = stack.pop()
        if not isinstance(n, Node) or n in seen:
            continue
        seen.add(n)
        stack += [u for u in n.users if _written(u) is n]   # s.add_(m) as a statement: the chain reads s after it
        if contraction(n) is not None:
            found.add(n)
            continue
        if is_mutation(n) and _written(n) is None:
            writes.append(n)        # read through, so that a write to the scores is reported as one
            stack += n.all_input_nodes
            continue
        if not _in_chain(n):
            continue
        inner.add(n)
        if len(inner) > _MAX_NODES:
            return "too many ops between the scores and the softmax"
        region = region_add(n)      # the value's own read of the scores is part of the write
        stack += [region.scores, *(b for b, _ in region.biases)] if region else n.all_input_nodes
    xv, sinks = tensor_val(x), sum(key_concat(n) is not None for n in inner)
    # a column appended along the keys (a sink) is no entry of the scores
    size = xv.numel() // xv.shape[-1] * (xv.shape[-1] - sinks) if sinks else xv.numel()
    qks = [n for n in x.graph.nodes if n in found and tensor_val(n) is not None
           and same_size(tensor_val(n).numel(), size)]
    if not qks:
        return None
    if any(_reads(a, b) for a in qks for b in qks if a is not b):
        return "the scores are contracted again before the softmax (not one attention)"
    # of contractions added side by side (q @ k^T + q @ r^T), the first that no other is computed from is the
    # scores, the others additive biases (a previous layer's scores, as residual attention adds them)
    qk = next(a for a in qks if not any(depends_on(b, a) for b in qks if b is not a))
    on, path = {qk}, []
    for n in x.graph.nodes:
        if n is softmax:
            break
        if n in inner and any(a in on for a in n.all_input_nodes):
            on.add(n)
            path.append(n)
    write = next((w for w in writes if w.args and w.args[0] in on), None)
    if write is not None:
        return f"the scores are written in place ({op_label(write)}): not matched (an out-of-place write would be)"
    return qk, path


def _reads(a: Node, b: Node) -> bool:
    """Contraction ``a`` reads ``b`` through pointwise ops, casts and views only (``s + s @ m``)."""
    stack, seen = list(a.all_input_nodes), set()
    while stack and len(seen) <= _MAX_NODES:
        n = stack.pop()
        if n is b:
            return True
        if n not in seen and _in_chain(n):
            seen.add(n)
            stack += n.all_input_nodes
    return False


def score_steps(qk: Node, path: list[Node], x: Node) -> list[tuple[Node, Node]] | None:
    """The path as one chain from the contraction down, ``[(node, the scores it reads)]``: each node reads the
    scores once, as the node before left them (an in-place add or fill of a fresh tensor stands for that tensor
    to the nodes after it); None when the scores branch (``s * sigmoid(s)``)."""
    holds, last, steps = {qk: qk}, qk, []
    for n in path:
        reads = {a for a in n.all_input_nodes if a in holds}
        if len(reads) != 1:
            return None
        s = reads.pop()
        if holds[s] is not last:
            return None
        if _written(n) is not None:
            if _written(n) is not s or not (fresh_tensor(s) or _written(s) is not None):   # s: checked at its write
                return None
            holds[s] = n
        holds[n] = last = n
        steps.append((n, s))
    return steps if holds.get(x) is last else None


def score_step(n: Node, s: Node) -> tuple[str, Any] | None:
    """What chain node ``n`` does to the scores ``s`` it reads, in the fused op's terms: ``("cast", exact)``,
    ``("copy" | "view" | "tanh", None)``, ``("region", region_add(n))``, ``("scale", number)``, ``("scale_t", (t,
    "mul" | "div"))`` (``t`` 0-d, symbolic, or constant along the key index: a factor of q's rows), ``("add" |
    "sub", mask)``, ``("fill", (cond, True if True masks, value))``, ``("floor", value)``, ``("sink", (column,
    first))``; None otherwise."""
    if cast_dtype(n) is not None:
        return "cast", exact_cast(n) is not None
    if no_op_copy(n) is not None or reshape_input(n) is not None:
        return ("copy" if no_op_copy(n) is not None else "view"), None
    if key_concat(n) is not None:
        column = sink_column(n, s)
        return ("sink", column) if column is not None else None
    if (region := region_add(n)) is not None or (scale := inplace_scale(n)) is not None:
        return ("region", region) if region is not None else scale[:2]
    pair = add_operands(n) or inplace_add_operands(n)
    if pair is not None:
        return "add", pair[1] if pair[0] is s else pair[0]
    if inplace_sub_operands(n) is not None:
        return ("sub", n.args[1]) if n.args[0] is s else None
    fill = (inplace_fill(n), s) if inplace_fill(n) is not None else fill_mask(n)
    floor = mask_floor(n)
    if fill is not None or floor is not None:
        return ("fill", fill[0]) if fill is not None and fill[1] is s else \
            ("floor", floor[1]) if floor is not None and floor[0] is s else None
    c = canon(n)
    a, b = (c[1].get("input"), c[1].get("other")) if c is not None else (None, None)
    if c is not None and c[0] in ("sub", "tanh"):
        return ("tanh", None) if c[0] == "tanh" else ("sub", b) if a is s and isinstance(b, Node) else None
    scale = scale_stage(n)
    if scale is not None and scale[2] is s:
        return scale[0], scale[1]
    if c is None or c[0] not in ("mul", "div"):
        return None
    t = b if a is s else a if c[0] == "mul" else None
    tv, sv = tensor_val(t), tensor_val(s)
    if isinstance(t, Node) and tv is not None and sv is not None and 0 < tv.dim() <= sv.dim() \
            and same_size(tv.shape[-1], 1) and tv.dtype.is_floating_point \
            and same_shape(tuple(tensor_val(n).shape), tuple(sv.shape)):
        return "scale_t", (t, c[0])
    return None


def flex_sides(qk: Node, path: list[Node]) -> list[Node] | str:
    """The side inputs of a path FlexAttention's ``score_mod`` replays (pointwise nodes or exact casts), or why not."""
    if any(is_mutation(u) for n in (qk, *path) for u in n.users):
        return "the changed scores are written in place"
    shape = tuple(tensor_val(qk).shape)
    sides: list[Node] = []
    for n in path:
        if not (pointwise(n) or exact_cast(n) is not None):
            return f"{op_label(n)} is not a pointwise change of the scores (views are not followed)"
        if n.op == "call_function" and _import_path(n.target) is None:
            return f"{op_label(n)}, a function outside torch and operator, changes the scores"
        if not same_shape(tuple(tensor_val(n).shape), shape):
            return f"{op_label(n)} changes the scores' shape"
        if not tensor_val(n).dtype.is_floating_point:
            return "the mask depends on the scores"
        if tensor_val(n).dtype == torch.float64:
            return "the scores are changed in float64: FlexAttention's score_mod runs in float32"
        for a in n.all_input_nodes:
            if a is qk or a in path or a in sides:
                continue
            if depends_on(a, qk):
                return f"a term computed from the scores ({op_label(a)}), not entry by entry, changes them"
            if tensor_val(a) is None or not broadcasts_to(tuple(tensor_val(a).shape), shape):
                return f"a term of the changes ({op_label(a)}) does not broadcast to the scores"
            sides.append(a)
    return sides


def score_mod_recipe(qk: Node, path: list[Node], sides: list[Node]) -> tuple:
    """The changes as the recipe :func:`smxcompile.kernels.attention.flex.score_mod_attention` replays."""
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


__all__ = ["score_graph", "score_steps", "score_step", "flex_sides", "score_mod_recipe"]
