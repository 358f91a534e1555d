"""Masks in front of a softmax: an additive float mask ``scores + mask`` and a boolean mask applied with
``scores.masked_fill(mask, value)`` / ``torch.where(keep, scores, value)``; and a floor ``max(scores, c)``
with ``c`` a masking value (older BART-family code clamps masked scores at ``finfo.min``).

Which operand of an addition is the mask is the caller's rule (a standalone softmax: the operand with the
output's full shape is the scores; attention: the operand computed from the score matmul).
"""

from __future__ import annotations

import math
import operator
from typing import Any, NamedTuple

import torch
from torch.fx import Node

from ...kernels.attention.masked_rows import MASK_VALUE, is_masking_value
from .contraction import reshape_input
from .graph import broadcasts_to, canon, is_mutation, same_shape, single_user, static_shape, tensor_val

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


def mild_mask(mask: Node, consts: Any, dtype: torch.dtype) -> bool:
    """The additive mask provably holds nothing at or below ``MASK_VALUE`` in the scores' ``dtype`` (-inf
    included): no entry can round a score away (the fix-up decides that per row at run time otherwise). ``consts``
    a :class:`.constants.ConstEvaluator`."""
    tv = tensor_val(mask)
    if tv is not None and not tv.dtype.is_floating_point:   # an int32 / int64 mask can overflow fp16
        return tv.dtype in (torch.bool, torch.uint8, torch.int8, torch.int16) or dtype != torch.float16
    c = consts.known(mask)
    if isinstance(c, torch.Tensor):
        return bool((c.to(dtype) > MASK_VALUE).all())
    vals = _where_numbers(mask, consts)
    return vals is not None and all(v is not None and MASK_VALUE < v < math.inf for v in vals)


def fill_meets_mask(masked: list, add_masks: list, consts: Any, dtype: torch.dtype) -> bool:
    """A finite fill that does not absorb the scores (above :data:`ABSORBING`) merged with an additive mask that
    may mask at a value near it (``where(causal, s, -1e4) + pad * -1e4``, older GPT-2): in a row masked whole,
    eager weighs the scores at the added entries and not at the filled ones, a merged additive mask at both.
    Values :data:`MASK_VALUE` apart or more leave one side's weights at 0 (the run-time fix-up's rows).
    ``masked`` as ``(cond, True if True masks, value)``; a mask whose values are unknown (a graph input) may."""
    # finfo(float16).min is the lowest a half mask holds: taken as absorbing, as -1e30 is in fp32
    floor = max(ABSORBING, torch.finfo(dtype).min)
    fills = [v for *_, v in masked if v is not None and math.isfinite(v) and floor < v <= MASK_VALUE]
    if not fills:
        return False
    for a in add_masks:
        vals = _mask_values(a, consts)
        if not vals and not mild_mask(a, consts, dtype) or any(   # only a masking value can empty a row too
                math.isfinite(v) and v <= MASK_VALUE and abs(v - f) < -MASK_VALUE for v in vals for f in fills):
            return True
    return False


def _mask_values(mask: Node, consts: Any) -> list:
    """Numbers an additive mask is known to hold: a constant's, ``where``'s numbers, ``x * c``'s 0 and ``c`` for a
    bool ``x`` (through views and casts); [] where unknown."""
    c = consts.known(mask)
    if isinstance(c, torch.Tensor):
        return c.unique().tolist() if c.numel() <= 1 << 20 else []
    vals = _where_numbers(mask, consts)
    if vals is not None:
        return [] if None in vals else vals
    n = _through_views(mask)
    k = canon(n) if isinstance(n, Node) else None
    other = k[1].get("other") if k is not None and k[0] == "mul" else None
    x = tensor_val(_through_views(k[1].get("input"))) if other is not None else None
    # x * c holds 0 and c only for a bool x (a float x may hold anything: x * -1e9 can be -1e4)
    return [0.0, float(other)] if isinstance(other, (int, float)) and x is not None and x.dtype == torch.bool else []


def _where_numbers(mask: Node, consts: Any) -> list | None:
    """The numbers (None for a tensor) of ``where(c, a, b)``'s branches, through views and casts; None for another
    op."""
    n = _through_views(mask)
    if not (isinstance(n, Node) and n.op == "call_function" and n.target is torch.where and len(n.args) == 3):
        return None
    return [consts.number(a) if not isinstance(a, Node) or tensor_val(a) is None or tensor_val(a).dim() == 0
            else None for a in n.args[1:]]


def _through_views(n: Node) -> Any:
    """The tensor ``n`` views, copies or casts (up to 8 steps), or a non-node argument."""
    for _ in range(8):
        if not (isinstance(n, Node) and (n.op == "call_method" and n.target in (
                "expand", "view", "reshape", "contiguous", "to", "float", "__getitem__")
                or n.op == "call_function" and n.target is operator.getitem)):
            break
        n = n.args[0]
    return n


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
    """``s.masked_fill_(mask, value)``, or ``s[mask] = value`` with a bool ``mask`` of ``s``'s shape and a number
    -> ``(mask, True, value)``."""
    if isinstance(n, Node) and n.op == "call_method" and n.target == "masked_fill_" and len(n.args) == 3 \
            and not n.kwargs and isinstance(n.args[1], Node):
        return n.args[1], True, n.args[2]
    if isinstance(n, Node) and n.op == "call_function" and n.target is operator.setitem and len(n.args) == 3:
        s, cond, value = (tensor_val(a) if isinstance(a, Node) else a for a in n.args)
        if isinstance(cond, torch.Tensor) and cond.dtype == torch.bool and isinstance(s, torch.Tensor) \
                and same_shape(tuple(cond.shape), tuple(s.shape)) and (
                isinstance(value, (int, float)) or isinstance(value, torch.Tensor) and value.dim() == 0):
            return n.args[1], True, n.args[2]
    return None


class RegionAdd(NamedTuple):
    """``s[idx] = s[idx] + b1 + b2 ...``: ``pads`` as ``F.pad`` takes them, ``shape`` the region's, ``biases`` as
    ``(b, the add reading it)``, ``nodes`` the value's."""
    scores: Node
    pads: tuple
    shape: tuple
    biases: list
    nodes: list


def region_add(n: Any) -> RegionAdd | None:
    """``s[idx] = s[idx] + b1 + b2 ...`` (or ``s[idx] += b``) through reshapes back to the region's shape (MViT-v2
    adds its decomposed relative positions to the scores after the class token), ``idx`` basic slices of step 1
    with static bounds, no other write between the read of ``s[idx]`` and this one. Whether the biases depend on
    ``s`` is the caller's rule."""
    if not (isinstance(n, Node) and n.op == "call_function" and n.target is operator.setitem and len(n.args) == 3
            and isinstance(n.args[0], Node) and isinstance(n.args[2], Node)):
        return None
    s, idx, val = n.args
    shape, region = static_shape(tensor_val(s)), static_shape(tensor_val(val))
    pads = _slice_pads(idx, shape) if shape is not None else None
    biases, chain, x = [], [], val
    while pads is not None and region is not None and isinstance(x, Node) and len(chain) < 16:
        chain.append(x)
        if len(x.users) != 1:
            return None
        if x.op == "call_function" and x.target is operator.getitem and x.args[0] is s and x.args[1] == idx:
            between = x.next     # the value reads s as this write finds it (``s[idx] += b`` writes it itself)
            while between is not n and (between in chain or not is_mutation(between)):
                between = between.next
            return RegionAdd(s, pads, region, biases, chain) if between is n else None
        pair = add_operands(x) or inplace_add_operands(x)
        on = reshape_input(x) if pair is None else next((a for a in pair if _reaches(a, s, idx)), None)
        if pair is not None and on is not None:
            biases.append((pair[1] if pair[0] is on else pair[0], x))
        x = on
    return None


def _reaches(x: Any, s: Node, idx: Any, depth: int = 16) -> bool:
    """``x`` is ``s[idx]`` after adds and reshapes."""
    if not isinstance(x, Node) or depth == 0:
        return False
    if x.op == "call_function" and x.target is operator.getitem and x.args[0] is s and x.args[1] == idx:
        return True
    pair = add_operands(x) or inplace_add_operands(x)
    return any(_reaches(a, s, idx, depth - 1) for a in (pair or (reshape_input(x),)))


def _slice_pads(idx: Any, shape: tuple) -> tuple | None:
    """``F.pad``'s pads (last dim first) that put ``t[idx]`` back in ``t``'s shape, or None (not basic slices of
    step 1 with static bounds)."""
    items = idx if isinstance(idx, tuple) else (idx,)
    if not all(isinstance(i, slice) or i is Ellipsis for i in items) or items.count(Ellipsis) > 1:
        return None
    if Ellipsis in items:
        k = items.index(Ellipsis)
        items = items[:k] + (slice(None),) * (len(shape) - len(items) + 1) + items[k + 1:]
    items += (slice(None),) * (len(shape) - len(items))
    pads: list[int] = []
    for sl, size in zip(reversed(items), reversed(shape)):
        if len(items) != len(shape) or not all(v is None or type(v) is int for v in (sl.start, sl.stop, sl.step)):
            return None
        start, stop, step = sl.indices(size)
        if step != 1 or stop <= start:
            return None
        pads += [start, size - stop]
    while pads[-2:] == [0, 0]:
        pads = pads[:-2]
    return tuple(pads)


__all__ = ["MASK_VALUE", "ABSORBING", "add_operands", "inplace_add_operands", "inplace_sub_operands", "inplace_fill",
           "RegionAdd", "region_add", "mild_mask", "fill_meets_mask", "static_additive_mask", "fill_mask",
           "is_masking_value", "mask_floor"]
