"""Scales and soft-caps: the arithmetic real code puts between logits and their softmax.

* a scale (temperature, ``1 / sqrt(d)``): ``x * s``, ``s * x``, ``x / s`` with ``s`` a Python number, a 0-d
  tensor or a symbolic number (dynamic shapes);
* logit soft-capping ``c * tanh(x / c)`` (Gemma 2; "Gemma 2: Improving Open Language Models at a Practical
  Size", 2024), also written ``tanh(x / c) * c`` or ``c * tanh(x * (1 / c))``.
"""

from __future__ import annotations

import math
import operator
from typing import Any

import torch
from torch.fx import Node

from .graph import canon, is_number, tensor_val, val

#: How close ``k * c`` must be to 1 in ``c * tanh(x * k)`` (or ``c * tanh(x / (1 / k))``) for it to be a
#: soft-cap with cap ``c``: ``1 / c`` written out by hand, or computed in another precision.
SOFTCAP_RTOL = 1e-6


def scalar_factor(n: Node) -> tuple[Node, float] | None:
    """``x * s``, ``s * x``, ``x / s`` with ``s`` a Python number -> ``(x, factor)``; ``x / 0`` is not one."""
    c = canon(n)
    if c is None or c[0] not in ("mul", "div"):
        return None
    a, b = c[1].get("input"), c[1].get("other")
    if c[0] == "div":
        if isinstance(a, Node) and is_number(b) and b != 0:
            return a, 1.0 / float(b)
        return None
    if isinstance(a, Node) and is_number(b):
        return a, float(b)
    if isinstance(b, Node) and is_number(a):
        return b, float(a)
    return None


def softcap(n: Node) -> tuple[Node, float, list[Node]] | None:
    """``c * tanh(y / c)`` ending at ``n`` -> ``(y, c, [n, tanh, inner])`` with ``c > 0``, else None.

    The ``tanh`` and the inner scale must be used only by the pattern; whether ``n`` itself may have other
    users is the caller's rule (a loss may return its soft-capped logits, a softmax absorbs only a
    single-use chain)."""
    s = scalar_factor(n)
    if s is None:
        return None
    t, cap = s
    if not cap > 0 or not math.isfinite(cap) or len(t.users) != 1:
        return None
    ct = canon(t)
    if ct is None or ct[0] != "tanh" or not isinstance(ct[1].get("input"), Node):
        return None
    d = ct[1]["input"]
    inner = scalar_factor(d)
    if inner is None or len(d.users) != 1:
        return None
    y, k = inner
    if abs(k * cap - 1.0) > SOFTCAP_RTOL:
        return None
    return y, cap, [n, t, d]


def scale_stage(n: Node) -> tuple[str, Any, Node] | None:
    """One scale of a score chain: ``("scale", factor, x)`` for a Python number (-1 for ``-x``),
    ``("scale_t", (t, "mul" | "div"), x)`` for a 0-d tensor or symbolic number ``t``; else None.

    ``x`` is the scaled operand (the scores side). A division by zero or by a non-finite number is not a
    scale."""
    if isinstance(n, Node) and (n.target in (operator.neg, torch.neg) or n.op == "call_method" and n.target == "neg") \
            and len(n.args) == 1 and isinstance(n.args[0], Node):
        return "scale", -1.0, n.args[0]       # -s
    c = canon(n)
    if c is None or c[0] not in ("mul", "div"):
        return None
    return _scale_of(c[0], c[1].get("input"), c[1].get("other"))


def inplace_scale(n: Any) -> tuple[str, Any, Node] | None:
    """``s *= f`` / ``s /= f`` / ``s.mul_(f)`` / ``s.div_(f)`` as :func:`scale_stage` reads ``s * f`` / ``s / f``."""
    op = {operator.imul: "mul", operator.itruediv: "div", "mul_": "mul", "div_": "div"}.get(
        n.target if isinstance(n, Node) and n.op in ("call_function", "call_method") else None)
    if op is None or len(n.args) != 2 or n.kwargs or not isinstance(n.args[0], Node):
        return None
    found = _scale_of(op, *n.args)
    return found if found is not None and found[2] is n.args[0] else None


def _scale_of(op: str, a: Any, b: Any) -> tuple[str, Any, Node] | None:
    if op == "mul" and not isinstance(a, Node) and isinstance(b, Node):
        a, b = b, a
    if not isinstance(a, Node):
        return None
    if is_number(b):
        if b == 0 or not math.isfinite(b):
            return None
        return ("scale", float(b) if op == "mul" else 1.0 / float(b), a)
    bv = tensor_val(b)
    if isinstance(b, Node) and bv is not None and bv.dim() == 0:
        if op == "mul":
            # a 0-d tensor times the scores: either operand can be the 0-d one
            av = tensor_val(a)
            if av is not None and av.dim() == 0:
                a, b = b, a
        return ("scale_t", (b, op), a)
    if op == "mul":
        av = tensor_val(a)
        if av is not None and av.dim() == 0 and isinstance(b, Node):
            return ("scale_t", (a, "mul"), b)
    # a symbolic Python number (dynamic shapes: ``head_dim ** -0.5`` turned into a graph input)
    if isinstance(b, Node) and isinstance(val(b), (torch.SymFloat, torch.SymInt)):
        return ("scale_t", (b, op), a)
    if op == "mul" and isinstance(val(a), (torch.SymFloat, torch.SymInt)) and isinstance(b, Node):
        return ("scale_t", (a, "mul"), b)
    return None


__all__ = ["SOFTCAP_RTOL", "scalar_factor", "softcap", "scale_stage", "inplace_scale"]
