"""One change of the attention scores at a time, read walking up from the softmax: each recognizer takes a node
and returns ``(kind, payload, the node the scores come from)``, or None. The scores side of an operation is the
operand computed from a contraction through such changes (:func:`reaches_matmul`)."""

from __future__ import annotations

from typing import Any

from torch.fx import Node

from ..patterns.arith import softcap
from ..patterns.contraction import contraction, reshape_input
from ..patterns.graph import canon, cast_dtype, same_shape, static_shape, tensor_val
from ..patterns.masks import add_operands, fill_mask, inplace_add_operands, mask_floor


def matmul_upstream(n: Any, depth: int) -> bool:
    if not isinstance(n, Node) or depth < 0:
        return False
    return contraction(n) is not None or any(matmul_upstream(a, depth - 1) for a in n.all_input_nodes)


def mask_stage(n: Node):
    """``s + mask`` (also ``s += mask``) -> ("add", (a, b), s); ``s - mask`` -> ("sub", (s, mask), s); a fill
    (see :func:`fill_mask`) -> ("fill", (cond, True if True masks, value), s); ``max(s, c)`` -> ("floor", c, s).
    The scores side is the operand computed from the score matmul."""
    pair = add_operands(n) or inplace_add_operands(n)
    if pair is not None:
        a, b = pair
        ra, rb = reaches_matmul(a), reaches_matmul(b)
        if ra == rb:
            return None    # two score tensors, or no scores at all
        return ("add", (a, b), a if ra else b)
    c = canon(n)
    if c is not None and c[0] == "sub":
        a, b = c[1].get("input"), c[1].get("other")
        if isinstance(b, Node) and reaches_matmul(a) and not reaches_matmul(b):
            return ("sub", (a, b), a)      # s - bias: the bias negated is an additive mask
        return None
    if c is not None and c[0] == "add":
        return None
    fill = fill_mask(n)
    if fill is not None:
        return ("fill", fill[0], fill[1])
    floor = mask_floor(n)
    if floor is not None and reaches_matmul(floor[0]) and not reaches_matmul(floor[1]):
        return ("floor", floor[1], floor[0])     # max(s, finfo.min): masked scores clamped
    return None


def reaches_matmul(n: Any, depth: int = 12) -> bool:
    """``n`` is computed from a matmul through the ops a score chain may hold (casts, scale, mask, soft-cap)."""
    if not isinstance(n, Node) or depth < 0:
        return False
    if contraction(n) is not None:
        return True
    if cast_dtype(n) is not None or reshape_input(n) is not None:
        return reaches_matmul(n.args[0], depth - 1)
    ip = inplace_add_operands(n)
    if ip is not None:
        return any(reaches_matmul(a, depth - 1) for a in ip)
    c = canon(n)
    if c is not None and c[0] in ("add", "mul", "div", "tanh", "sub"):
        return any(reaches_matmul(a, depth - 1) for a in (c[1].get("input"), c[1].get("other")))
    fill = fill_mask(n)
    if fill is not None:
        return reaches_matmul(fill[1], depth - 1)
    floor = mask_floor(n)
    return floor is not None and reaches_matmul(floor[0], depth - 1)


def static_view(n: Node) -> bool:
    x = reshape_input(n)
    return x is not None and static_shape(tensor_val(x)) is not None and static_shape(tensor_val(n)) is not None


def row_scale_stage(n: Node):
    """``s * t`` / ``s / t`` with ``t`` a tensor constant along the key index (last dim 1) that does not widen the
    scores, e.g. a learned per-head temperature (H, 1, 1): a factor of q's rows, folded into q ->
    ``("scale_t", (t, op), s)``."""
    c = canon(n)
    if c is None or c[0] not in ("mul", "div"):
        return None
    a, b = c[1].get("input"), c[1].get("other")
    if c[0] == "mul" and reaches_matmul(b) and not reaches_matmul(a):
        a, b = b, a
    av, bv, nv = tensor_val(a), tensor_val(b), tensor_val(n)
    if not isinstance(b, Node) or av is None or bv is None or nv is None or not reaches_matmul(a):
        return None
    if bv.dim() == 0 or bv.dim() > av.dim() or bv.shape[-1] != 1 or not bv.dtype.is_floating_point \
            or not same_shape(tuple(nv.shape), tuple(av.shape)):
        return None
    return ("scale_t", (b, c[0]), a)


def softcap_stage(n: Node):
    r = softcap(n)
    if r is None:
        return None
    y, cap, nodes = r
    return ("softcap", (cap, nodes[1:]), y)


__all__ = ["matmul_upstream", "mask_stage", "reaches_matmul", "static_view", "row_scale_stage", "softcap_stage"]
