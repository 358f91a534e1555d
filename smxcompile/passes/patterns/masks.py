"""Masks in front of a softmax: an additive float mask ``scores + mask`` and a boolean mask applied with
``scores.masked_fill(mask, value)`` / ``torch.where(keep, scores, value)``; and a floor ``max(scores, c)``
with ``c`` a masking value (older BART-family code clamps masked scores at ``finfo.min``).

Which operand of an addition is the mask is the caller's rule (a standalone softmax: the operand with the
output's full shape is the scores; attention: the operand computed from the score matmul).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch.fx import Node

from .graph import broadcasts_to, canon, same_shape, single_user, static_shape, tensor_val

#: A ``masked_fill`` / ``where`` value at or below this masks a score: exp(value - row max) underflows
#: to exactly 0 in fp32 for any row max above ``MASK_VALUE + 104``.
MASK_VALUE = -1e4
#: An additive mask value at or below this absorbs any finite fp32 score (ulp(1e30) / 2 ~ 4e22).
ABSORBING = -1e30


def add_operands(n: Node) -> tuple[Node, Node] | None:
    """``(a, b)`` of ``a + b`` with both operands tensors (nodes), else None."""
    c = canon(n)
    if c is None or c[0] != "add":
        return None
    a, b = c[1].get("input"), c[1].get("other")
    if isinstance(a, Node) and isinstance(b, Node):
        return a, b
    return None


def static_additive_mask(x: Node) -> tuple[Node, Node] | None:
    """``(scores, mask)`` when ``x = scores + mask`` can be taken into a fused softmax: static shapes, the
    scores with ``x``'s full shape and dtype, a floating mask that broadcasts to them, needs no gradient
    and does not promote the scores' dtype (bf16 scores + an fp32 mask is an fp32 softmax); ``x`` used once."""
    pair = add_operands(x)
    out_shape = static_shape(tensor_val(x))
    if pair is None or not single_user(x) or out_shape is None:
        return None
    a, b = pair
    av, bv = tensor_val(a), tensor_val(b)
    if (av is None or bv is None or not av.dtype.is_floating_point or not bv.dtype.is_floating_point
            or static_shape(av) is None or static_shape(bv) is None):
        return None
    scores, mask = (a, b) if static_shape(av) == out_shape else (b, a)
    sv, mv = tensor_val(scores), tensor_val(mask)
    if (static_shape(sv) == out_shape and broadcasts_to(static_shape(mv), out_shape)
            and not mv.requires_grad and sv.dtype == tensor_val(x).dtype):
        return scores, mask
    return None


def fill_mask(n: Node) -> tuple[tuple[Any, bool, Any], Node] | None:
    """A boolean mask applied by filling: ``((cond, True if True means masked, value), scores)``, else None.

    ``s.masked_fill(b, v)`` -> ``((b, True, v), s)``; ``where(keep, s, v)`` -> ``((keep, False, v), s)``;
    ``where(b, v, s)`` -> ``((b, True, v), s)`` (the scores are the operand with the result's full shape)."""
    if (n.op == "call_method" and n.target == "masked_fill") or (n.op == "call_function" and n.target is torch.masked_fill):
        if len(n.args) == 3 and not n.kwargs:
            return (n.args[1], True, n.args[2]), n.args[0]
        return None
    if n.op == "call_function" and n.target is torch.where and len(n.args) == 3 and not n.kwargs:
        cond, a, b = n.args
        av, bv = tensor_val(a), tensor_val(b)
        shape = tensor_val(n)
        shape = None if shape is None else tuple(shape.shape)
        a_full = av is not None and av.dim() > 0 and same_shape(tuple(av.shape), shape)
        b_full = bv is not None and bv.dim() > 0 and same_shape(tuple(bv.shape), shape)
        if a_full and not b_full:
            return (cond, False, b), a
        if b_full and not a_full:
            return (cond, True, a), b
    return None


def is_masking_value(v):
    """Whether a fill value masks a score (``-inf`` or any number <= :data:`MASK_VALUE`, e.g. ``finfo.min``);
    elementwise (a bool tensor) for a tensor."""
    return v <= MASK_VALUE


def mask_floor(n: Node) -> tuple[Node, Any] | None:
    """``max(x, c)`` / ``maximum(x, c)`` with ``c`` a 0-d tensor, ``clamp(x, min=c)`` / ``clamp_min(x, c)`` with
    ``c`` a number or a 0-d tensor -> ``(x, c)``; whether ``x`` is the scores is the caller's rule."""
    if n.op not in ("call_function", "call_method"):
        return None
    fn = n.target if n.op == "call_function" else getattr(torch, str(n.target), None)
    if fn in (torch.max, torch.maximum):     # torch.max(x, 1) is a reduction: the bound must be a tensor
        if len(n.args) != 2 or n.kwargs or not isinstance(n.args[1], Node):
            return None
        x, c = n.args
    elif fn in (torch.clamp, torch.clamp_min):
        bound = dict(zip(("input", "min", "max"), n.args))
        bound.update(n.kwargs)
        if bound.get("max") is not None or set(bound) - {"input", "min", "max"}:
            return None
        x, c = bound.get("input"), bound.get("min")
    else:
        return None
    cv = tensor_val(c) if isinstance(c, Node) else None
    if not isinstance(x, Node) or not (isinstance(c, (int, float)) or (cv is not None and cv.dim() == 0)):
        return None
    return x, c


def _inplace_operands(n: Any, fn, method: str) -> tuple[Node, Node] | None:
    if not isinstance(n, Node) or len(n.args) != 2 or n.kwargs or not isinstance(n.args[1], Node):
        return None
    if (n.op == "call_function" and n.target is fn) or (n.op == "call_method" and n.target == method):
        return n.args[0], n.args[1]
    return None


def inplace_add_operands(n: Any) -> tuple[Node, Node] | None:
    """``operator.iadd(s, m)`` (``s += m``) or ``s.add_(m)`` with a tensor ``m`` -> (s, m)."""
    return _inplace_operands(n, operator.iadd, "add_")


def inplace_sub_operands(n: Any) -> tuple[Node, Node] | None:
    """``operator.isub(s, m)`` (``s -= m``) or ``s.sub_(m)`` with a tensor ``m`` -> (s, m)."""
    return _inplace_operands(n, operator.isub, "sub_")


def inplace_fill(n: Any) -> tuple[Node, bool, Any] | None:
    """``s.masked_fill_(mask, value)`` -> ``(mask, True, value)``."""
    if isinstance(n, Node) and n.op == "call_method" and n.target == "masked_fill_" and len(n.args) == 3 \
            and not n.kwargs and isinstance(n.args[1], Node):
        return n.args[1], True, n.args[2]
    return None


__all__ = ["MASK_VALUE", "ABSORBING", "add_operands", "inplace_add_operands", "inplace_sub_operands", "inplace_fill", "static_additive_mask", "fill_mask", "is_masking_value",
           "mask_floor"]
