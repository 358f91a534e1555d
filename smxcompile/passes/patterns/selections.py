"""Readers of a few entries of a tensor's rows, whatever the spelling: its largest entry (``argmax``, ``max(dim)``:
values, indices or both; a ``gather`` at the argmax of the same row), entries at given indices (any other
``gather``; a product with a one-hot mask summed over the row, as MoE routers read their gate), and the uses
behind no-op copies (``.to(same dtype)``, ``.contiguous()``, ``.clone()``). :func:`top1_readers` says whether every
use of a tensor is one of them: then the whole row is never read."""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import torch
from torch.fx import Node

from .graph import canon, cast_dtype, norm_dim, same_size, tensor_val


@dataclasses.dataclass
class Top1Read:
    """One read of a row: ``node`` gives the maximum's ``"values"``, ``"indices"`` or both (``"max"``: a ``max(dim)``
    pair whose ``getitem`` users are ``items``), or the entries at ``index`` (``"entry"``: a gather; with
    ``mask``, ``(x * mask).sum(dim)`` where ``mask`` is zero off ``one_hot(index)``); ``keepdim`` as the call has it."""

    node: Node
    what: str                       # "values" | "indices" | "max" | "entry"
    keepdim: bool
    items: dict = dataclasses.field(default_factory=dict)   # max(dim): {0: values getitem, 1: indices getitem}
    index: Node | None = None       # a gather's index (an argmax, possibly of the logits), a one-hot's index
    mask: Node | None = None        # the one-hot mask of a product read


def no_op_copy(n: Node) -> Node | None:
    """``x.to(x.dtype)`` / ``x.float()`` of fp32 / ``.contiguous()`` / ``.clone()`` -> x (the same values)."""
    if not n.args or not isinstance(n.args[0], Node):
        return None
    x = n.args[0]
    if (n.op == "call_method" and n.target in ("clone", "contiguous")) or (
            n.op == "call_function" and n.target is torch.clone):
        return x
    dt, xv = cast_dtype(n), tensor_val(x)
    return x if dt is not None and xv is not None and dt == xv.dtype else None


def _argument(n: Node, names: tuple, name: str, default: Any = None) -> Any:
    a = dict(zip(names, n.args))
    a.update(n.kwargs)
    return a.get(name, default)


def _gather_index(n: Node, x: Node, dim: int) -> Node | None:
    """``x.gather(dim, index)`` / ``torch.gather(x, dim, index)`` -> index; None otherwise."""
    is_gather = (n.op == "call_method" and n.target == "gather") or (
        n.op == "call_function" and n.target is torch.gather)
    names = ("input", "dim", "index")
    if not is_gather or _argument(n, names, "input") is not x or _argument(n, names, "sparse_grad", False):
        return None
    d, index = _argument(n, names, "dim"), _argument(n, names, "index")
    xv, iv = tensor_val(x), tensor_val(index)
    if not isinstance(index, Node) or xv is None or iv is None or iv.dim() != xv.dim() or norm_dim(d, xv.dim()) != dim:
        return None
    # an index covering fewer rows than x reads a part of x: not taken
    return index if all(same_size(a, b) for j, (a, b) in enumerate(zip(iv.shape, xv.shape)) if j != dim) else None


def _read(n: Node, x: Node, dim: int, sources: set) -> Top1Read | None:
    """``n`` (a user of ``x``) as a read of the row maximum over ``dim``; indices must come from an argmax of one
    of ``sources`` (``x`` and the tensors it equals up to a monotone map)."""
    c = canon(n)
    nd = tensor_val(x).dim()
    # (not amax: its gradient is split between tied maxima, where max(dim)'s goes to the index it returns)
    if c is not None and c[0] in ("argmax", "max") and c[1].get("input") is x:
        d = c[1].get("dim")
        if isinstance(d, (list, tuple)):
            d = d[0] if len(d) == 1 else None
        if d is None or norm_dim(d, nd) != dim:
            return None
        keepdim = bool(c[1].get("keepdim", False))
        if c[0] == "argmax":
            return Top1Read(n, "indices", keepdim)
        items = {}
        for u in n.users:
            if u.op != "call_function" or u.target is not operator.getitem or u.args[1] not in (0, 1) \
                    or u.args[1] in items:
                return None
            items[u.args[1]] = u
        return Top1Read(n, "max", keepdim, items)
    index = _gather_index(n, x, dim)
    if index is not None:
        return Top1Read(n, "values" if _argmax_of(index, dim, sources) else "entry", True, index=index)
    return _one_hot_read(n, x, dim)


def _one_hot_read(n: Node, x: Node, dim: int) -> Top1Read | None:
    """``(x * mask).sum(dim)`` (the product used by the sum only; no dtype) with ``mask`` an integer or bool tensor of
    ``x``'s shape that is zero off ``one_hot(index)`` over the last dim, which ``dim`` is: one entry per row."""
    c = canon(n)
    xv = tensor_val(x)
    if c is None or c[0] != "mul" or len(n.users) != 1 or dim != xv.dim() - 1:
        return None
    a, b = c[1].get("input"), c[1].get("other")
    mask = b if a is x else a
    mv, total = tensor_val(mask), next(iter(n.users))
    if mv is None or mv.dtype.is_floating_point or mv.dtype.is_complex or tuple(mv.shape) != tuple(xv.shape):
        return None
    index, ct = _one_hot_index(mask, tuple(xv.shape)), canon(total)
    if index is None or ct is None or ct[0] != "sum" or ct[1].get("input") is not n or ct[1].get("dtype") is not None:
        return None
    d = ct[1].get("dim")
    d = d[0] if isinstance(d, (list, tuple)) and len(d) == 1 else d
    if not isinstance(d, int) or norm_dim(d, xv.dim()) != dim:
        return None
    return Top1Read(total, "entry", bool(ct[1].get("keepdim", False)), items={"product": n}, index=index, mask=mask)


def _one_hot_index(t: Any, shape: tuple, depth: int = 8) -> Node | None:
    """``i`` when ``t`` is zero off ``one_hot(i)`` of ``shape``: that one-hot, its integer or bool casts, its products
    with integer or bool tensors (so every factor is finite)."""
    tv = tensor_val(t) if isinstance(t, Node) else None
    if tv is None or depth < 0 or tv.dtype.is_floating_point or tv.dtype.is_complex:
        return None
    if t.op == "call_function" and t.target is torch.nn.functional.one_hot and isinstance(t.args[0], Node):
        return t.args[0] if tuple(tv.shape) == shape else None     # not broadcast up to x's shape
    if cast_dtype(t) is not None or (t.op == "call_method" and t.target in ("bool", "long", "int")):
        return _one_hot_index(t.args[0], shape, depth - 1)
    c = canon(t)
    if c is not None and c[0] == "mul":
        other = {"input": "other", "other": "input"}
        for side in ("input", "other"):
            o = c[1].get(other[side])
            ov = tensor_val(o) if isinstance(o, Node) else None
            index = _one_hot_index(c[1].get(side), shape, depth - 1) if isinstance(o, (int, bool)) or (
                ov is not None and not ov.dtype.is_floating_point) else None
            if index is not None:
                return index
    return None


def _argmax_of(index: Node, dim: int, sources: set) -> bool:
    """``index`` is ``argmax(s, dim, keepdim=True)`` or ``max(s, dim, keepdim=True).indices`` of some ``s`` in
    ``sources``."""
    if index.op == "call_function" and index.target is operator.getitem and index.args[1] == 1:
        index = index.args[0]
    c = canon(index)
    if c is None or c[0] not in ("argmax", "max") or c[1].get("input") not in sources:
        return False
    d = c[1].get("dim")
    v = tensor_val(c[1]["input"])
    return d is not None and v is not None and norm_dim(d, v.dim()) == dim and bool(c[1].get("keepdim", False))


def reads_top1(n: Node) -> bool:
    """``n`` is an ``argmax`` / ``max`` / ``gather`` call: a use that may read a row maximum."""
    c = canon(n)
    return (c is not None and c[0] in ("argmax", "max")) or (n.op == "call_method" and n.target == "gather") or (
        n.op == "call_function" and n.target is torch.gather)


def top1_readers(x: Node, dim: int, sources: set) -> tuple[list[Top1Read], list[Node]] | None:
    """``(reads, copies)`` when every use of ``x`` (through no-op copies, listed in ``copies``) reads only its
    maximum over ``dim``; an argmax of an element of ``sources`` (and of ``x`` and its copies) may index a gather.
    None when some use reads more."""
    seen = {x} | set(sources)
    stack, reads, copies = [x], [], []
    while stack:
        t = stack.pop()
        for u in list(t.users):
            if no_op_copy(u) is t:
                copies.append(u)
                seen.add(u)
                stack.append(u)
    for t in [x, *copies]:
        for u in t.users:
            if u in copies:
                continue
            r = _read(u, t, dim, seen)
            if r is None:
                return None
            reads.append(r)
    return reads, copies


__all__ = ["Top1Read", "no_op_copy", "reads_top1", "top1_readers"]
