"""Softmax written out by hand: ``exp(x - max(x, d, keepdim=True)) / sum(..., d, keepdim=True)`` (``amax``,
``max(...).values`` or no shift), read as the softmax it computes."""

from __future__ import annotations

import operator
from typing import Any

from torch.fx import Node

from .graph import FLOAT_DTYPES, canon, dedupe, norm_dim, tensor_val


def same_dim_reduction(node: Any, name: str, x: Node, dim: int, *, keepdim: bool = True) -> bool:
    """``node`` is ``name(x, dim, keepdim=keepdim)`` (``max`` through ``[0]`` / ``.values``)."""
    if not isinstance(node, Node):
        return False
    if name == "max":
        if node.op != "call_function" or node.target is not operator.getitem or node.args[1] != 0:
            return False
        node = node.args[0]
    c = canon(node)
    if c is None:
        return False
    cname, a = c
    if name == "max" and cname not in ("max",):
        return False
    if name != "max" and cname != name:
        return False
    xv = tensor_val(x)
    return a.get("input") is x and bool(a.get("keepdim")) is keepdim and xv is not None and \
        norm_dim(a.get("dim"), xv.dim()) == dim


def keepdim_reduction(node: Any, name: str, *, keepdim: bool = True) -> tuple[Node, int] | None:
    """If ``node`` is ``name(y, dim, keepdim=keepdim)`` return ``(y, dim)``."""
    c = canon(node) if isinstance(node, Node) else None
    if c is None or c[0] != name:
        return None
    a = c[1]
    y = a.get("input")
    yv = tensor_val(y)
    if yv is None or bool(a.get("keepdim")) is not keepdim or a.get("dtype") is not None:
        return None
    d = norm_dim(a.get("dim"), yv.dim())
    return None if d is None else (y, d)


def unsqueezed(node: Any, dim: int, nd: int) -> Node | None:
    """``r`` for ``r.unsqueeze(dim)`` / ``torch.unsqueeze(r, dim)`` / ``r[..., None]`` (a new dim ``dim`` of
    ``nd``): a reduction without ``keepdim`` given its dim back."""
    if not isinstance(node, Node) or not node.args or not isinstance(node.args[0], Node):
        return None
    if node.op == "call_function" and node.target is operator.getitem:
        return node.args[0] if node.args[1] == (Ellipsis, None) and dim == nd - 1 else None
    is_unsqueeze = (node.op == "call_method" and node.target == "unsqueeze") or (
        node.op == "call_function" and getattr(node.target, "__name__", "") == "unsqueeze")
    d = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    return node.args[0] if is_unsqueeze and isinstance(d, int) and norm_dim(d, nd) == dim else None


def row_statistic(term: Any, x: Node, dim: int) -> bool:
    """``term`` is ``x``'s own max or logsumexp over ``dim`` (kept, or given back its dim), detached or not."""
    t = strip_detach(term)
    kept = unsqueezed(t, dim, tensor_val(x).dim()) if tensor_val(x) is not None else None
    t, keep = (strip_detach(kept), False) if kept is not None else (t, True)
    lse = keepdim_reduction(t, "logsumexp", keepdim=keep)
    return bool(lse and lse[0] is x and lse[1] == dim) or any(
        same_dim_reduction(t, r, x, dim, keepdim=keep) for r in ("amax", "max"))


def strip_detach(node: Any) -> Any:
    c = canon(node) if isinstance(node, Node) else None
    return c[1]["input"] if c and c[0] == "detach" else node


def max_shifted(u: Node, dim: int) -> tuple[Node, list[Node]] | None:
    """``u == x - max(x, dim, keepdim)`` -> ``(x, [sub, max nodes])``; else None."""
    c = canon(u)
    if c is None or c[0] != "sub":
        return None
    x, m = c[1].get("input"), strip_detach(c[1].get("other"))
    if not isinstance(x, Node):
        return None
    for red in ("amax", "max"):
        if same_dim_reduction(m, red, x, dim):
            nodes = [u, c[1].get("other")]
            if c[1].get("other") is not m:
                nodes.append(m)
            if red == "max":
                nodes.append(m.args[0])
            return x, nodes
    return None


def exp_base(e: Node, dim: int) -> tuple[Node, list[Node], bool] | None:
    """``e == exp(x - max)`` or ``exp(x)`` -> ``(x, interior nodes, shifted)``."""
    c = canon(e)
    if c is None or c[0] != "exp":
        return None
    u = c[1].get("input")
    if not isinstance(u, Node):
        return None
    shifted = max_shifted(u, dim)
    if shifted is not None:
        return shifted[0], [e] + shifted[1], True
    return u, [e], False


def same_expr(a: Node, b: Node) -> bool:
    """Two nodes that compute the same thing (same target and args, no side effects)."""
    if a is b:
        return True
    if a.op != b.op or a.target != b.target or a.kwargs != b.kwargs or len(a.args) != len(b.args):
        return False
    for x, y in zip(a.args, b.args):
        if isinstance(x, Node) and isinstance(y, Node):
            if not same_expr(x, y):
                return False
        elif x != y:
            return False
    return True


def written_softmax(node: Node) -> tuple[Node, int, list[Node], bool] | None:
    """``node`` is ``e / e.sum(dim, keepdim=True)`` with ``e = exp(x [- max(x)])``: ``(x, dim, the nodes between
    x and node, shifted)``, else None."""
    c = canon(node)
    if c is None or c[0] != "div":
        return None
    e, s = c[1].get("input"), c[1].get("other")
    if not isinstance(e, Node) or not isinstance(s, Node):
        return None
    red = keepdim_reduction(s, "sum")
    if red is None:
        return None
    e2, dim = red
    if not isinstance(e2, Node) or not same_expr(e, e2):
        return None
    base = exp_base(e, dim)
    if base is None:
        return None
    x, interior, shifted = base
    xv = tensor_val(x)
    if xv is None or xv.dtype not in FLOAT_DTYPES:
        return None
    return x, dim, dedupe(interior + [s] + ([] if e2 is e else exp_base(e2, dim)[1])), shifted


__all__ = ["same_dim_reduction", "keepdim_reduction", "unsqueezed", "row_statistic", "strip_detach", "max_shifted",
           "exp_base", "same_expr", "written_softmax"]


