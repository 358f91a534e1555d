"""The filters of a sampler, by what they keep of a row of logits ``x`` (the last dim):

* **top-k**: the entries below the row's k-th largest go: ``x < kth`` where ``kth`` is the last column of
  ``topk(x, k).values`` (``[..., -1, None]``, ``[:, [-1]]``, ``[..., -1:]``, ``[..., -1].unsqueeze(-1)``);
* **top-p**: the smallest entries whose cumulative probability is at most ``1 - p`` go: the mask
  ``cumsum(softmax(sort(x).values)) <= 1 - p`` over the ascending sort, scattered back to the columns by the
  sort's indices, the last ``m`` sorted entries kept (transformers' ``TopPLogitsWarper``);
* **min-p**: the entries whose probability is below ``p`` times the row's largest go:
  ``softmax(x) < p * softmax(x).amax(-1, keepdim=True)``, the top ``m`` by probability kept
  (``MinPLogitsWarper``).

Each recognizer takes the mask of the entries removed and the tensor it filters, and returns a :class:`Filter`
or None. A filter writes ``-inf`` (:func:`filled`): ``masked_fill(x, mask, -inf)``, ``where(mask, -inf, x)``, or
in place, ``x[mask] = -inf`` / ``x.masked_fill_(mask, -inf)``.
"""

from __future__ import annotations

import dataclasses
import math
import operator

import torch
from torch.fx import Node

from .graph import canon, is_mutation, is_number, norm_dim, tensor_val

__all__ = ["Filter", "filled", "filled_in_place", "top_k", "top_p", "min_p", "writes_into"]


@dataclasses.dataclass
class Filter:
    """One filter: ``kind`` ("top_k", "top_p", "min_p"), its parameter (k, or p), the fewest entries it keeps
    (``min_keep``; top-k: 1) and its nodes (the mask's computation, in-place edits of the mask included)."""

    kind: str
    param: float
    min_keep: int = 1
    nodes: list[Node] = dataclasses.field(default_factory=list)


def _is_neg_inf(v) -> bool:
    return is_number(v) and float(v) == -math.inf


def _is_zero(v) -> bool:
    """``0`` or ``False`` (what a boolean mask is set to where an entry must stay)."""
    return v is False or (is_number(v) and float(v) == 0)


def filled(n: Node) -> tuple[Node, Node] | None:
    """``masked_fill(x, mask, -inf)`` / ``where(mask, -inf, x)`` -> ``(x, mask)``."""
    c = canon(n)
    if c is None:
        return None
    name, a = c
    if name == "masked_fill":   # (masked_fill_ is not this canonical name: in place, see filled_in_place)
        x, mask = a.get("input"), a.get("mask")
        if isinstance(x, Node) and isinstance(mask, Node) and _is_neg_inf(a.get("value")):
            return x, mask
    if name == "where":
        mask, fill, x = a.get("condition"), a.get("input"), a.get("other")
        if isinstance(x, Node) and isinstance(mask, Node) and _is_neg_inf(fill):
            return x, mask
    return None


def filled_in_place(w: Node) -> tuple[Node, Node] | None:
    """``x[mask] = -inf`` (``operator.setitem``) / ``x.masked_fill_(mask, -inf)`` -> ``(x, mask)``; the mask a
    boolean tensor of x's shape."""
    if w.op == "call_function" and w.target is operator.setitem and len(w.args) == 3:
        x, mask, v = w.args
    elif w.op == "call_method" and w.target == "masked_fill_" and len(w.args) == 3 and not w.kwargs:
        x, mask, v = w.args
    else:
        return None
    mv, xv = tensor_val(mask), tensor_val(x)
    if not (isinstance(x, Node) and isinstance(mask, Node) and _is_neg_inf(v)) or mv is None or xv is None:
        return None
    return (x, mask) if mv.dtype == torch.bool and tuple(mv.shape) == tuple(xv.shape) else None


def _last_dim(v, ndim: int) -> bool:
    return norm_dim(v, ndim) == ndim - 1


def _compare(mask: Node, small: str) -> tuple[Node, Node] | None:
    """``a < b`` / ``b > a`` (``small="lt"``) or ``a <= b`` / ``b >= a`` (``"le"``) -> ``(a, b)``."""
    c = canon(mask)
    if c is None:
        return None
    flip = {"lt": "gt", "le": "ge"}[small]
    if c[0] == small:
        return c[1].get("input"), c[1].get("other")
    if c[0] == flip:
        return c[1].get("other"), c[1].get("input")
    return None


def _kth_column(t: Node, x: Node) -> tuple[int, list[Node]] | None:
    """``t`` = the last column of ``topk(x, k).values`` (kept as a column) -> ``(k, nodes)``."""
    nodes = [t]
    tv, xv = tensor_val(t), tensor_val(x)
    if tv is None or xv is None or tv.dim() != xv.dim() or tv.shape[-1] != 1:
        return None
    src = None
    if t.op == "call_function" and t.target is operator.getitem and isinstance(t.args[0], Node):
        idx = t.args[1] if isinstance(t.args[1], tuple) else (t.args[1],)
        last = idx[-1]
        lead = idx[:-2] if last is None else idx[:-1]
        if any(i is not Ellipsis and i != slice(None) for i in lead):
            return None   # [:1, -1:] and the like pick another row's value
        if last is None and len(idx) >= 2 and idx[-2] == -1:   # [..., -1, None]
            src = t.args[0]
        elif last == [-1] or last == slice(-1, None, None):     # [:, [-1]], [..., -1:]
            src = t.args[0]
    elif t.op == "call_method" and t.target == "unsqueeze" and t.args[1:] in ((-1,), (xv.dim() - 1,)):
        inner = t.args[0]
        if (inner.op == "call_function" and inner.target is operator.getitem and isinstance(inner.args[0], Node)
                and (inner.args[1] == -1 or inner.args[1] == (Ellipsis, -1))):
            nodes.append(inner)
            src = inner.args[0]
    if src is None or not (src.op == "call_function" and src.target is operator.getitem and src.args[1] == 0):
        return None
    top = src.args[0]
    c = canon(top) if isinstance(top, Node) else None
    if c is None or c[0] != "topk" or c[1].get("input") is not x or not isinstance(c[1].get("k"), int):
        return None
    if not _last_dim(c[1].get("dim", -1), xv.dim()) or c[1].get("largest", True) is not True \
            or c[1].get("sorted", True) is not True:
        return None
    return c[1]["k"], nodes + [src, top]


def top_k(mask: Node, x: Node) -> Filter | None:
    """``x < kth(x)`` (see the module docstring)."""
    ab = _compare(mask, "lt")
    if ab is None or ab[0] is not x or not isinstance(ab[1], Node):
        return None
    got = _kth_column(ab[1], x)
    if got is None:
        return None
    k, nodes = got
    return Filter("top_k", k, 1, [mask, *nodes])


def _keep_last(w: Node, target: Node, last: bool) -> int | None:
    """An in-place write of False / 0 to the last (``last``) or first ``m`` columns of ``target``:
    ``t[..., -m:] = 0`` / ``t[..., :m] = False`` -> m."""
    if not (w.op == "call_function" and w.target is operator.setitem and w.args[0] is target):
        return None
    idx, v = w.args[1], w.args[2]
    if not _is_zero(v):
        return None
    idx = idx if isinstance(idx, tuple) else (idx,)
    sl = idx[-1]
    if not isinstance(sl, slice) or sl.step is not None or any(i not in (Ellipsis, slice(None)) for i in idx[:-1]):
        return None
    if last and sl.stop is None and isinstance(sl.start, int) and sl.start < 0:
        return -sl.start
    if not last and sl.start in (None, 0) and isinstance(sl.stop, int) and sl.stop > 0:
        return sl.stop
    return None


def writes_into(t: Node) -> list[Node]:
    """The users of ``t`` that write it in place (``t[i] = v``, ``t.scatter_(...)``...)."""
    return [u for u in t.users if is_mutation(u) and u.args and u.args[0] is t]


def top_p(mask: Node, x: Node) -> Filter | None:
    """The scattered ascending-cumulative mask of transformers' ``TopPLogitsWarper`` (module docstring)."""
    c = canon(mask)
    xv = tensor_val(x)
    if c is None or c[0] != "scatter" or xv is None or "reduce" in mask.kwargs or "value" in mask.kwargs:
        return None
    a = c[1]
    sorted_mask, index = a.get("input"), a.get("index")
    if a.get("src") is not sorted_mask or not _last_dim(a.get("dim"), xv.dim()) or not isinstance(index, Node):
        return None
    cmp = _compare(sorted_mask, "le")
    if cmp is None or not is_number(cmp[1]) or not isinstance(cmp[0], Node):
        return None
    cum = canon(cmp[0])
    if cum is None or cum[0] != "cumsum" or not _last_dim(cum[1].get("dim"), xv.dim()) or cum[1].get("dtype"):
        return None
    sm = cum[1].get("input")
    s = canon(sm) if isinstance(sm, Node) else None
    if s is None or s[0] != "softmax" or not _last_dim(s[1].get("dim"), xv.dim()) or s[1].get("dtype"):
        return None
    vals = s[1].get("input")
    if not (isinstance(vals, Node) and vals.target is operator.getitem and vals.args[1] == 0
            and index.target is operator.getitem and index.args[1] == 1 and index.args[0] is vals.args[0]):
        return None
    srt = canon(vals.args[0])
    if srt is None or srt[0] != "sort" or srt[1].get("input") is not x or srt[1].get("descending", False) \
            or not _last_dim(srt[1].get("dim", -1), xv.dim()):
        return None
    writes = writes_into(sorted_mask)
    keep = [_keep_last(w, sorted_mask, last=True) for w in writes]
    if len(writes) > 1 or None in keep:
        return None
    return Filter("top_p", 1.0 - float(cmp[1]), keep[0] if keep else 1,
                  [mask, sorted_mask, cmp[0], sm, vals, index, vals.args[0], *writes])


def min_p(mask: Node, x: Node) -> Filter | None:
    """``softmax(x) < p * softmax(x).amax(-1, keepdim=True)`` with the top ``m`` kept (module docstring)."""
    cmp = _compare(mask, "lt")
    xv = tensor_val(x)
    if cmp is None or xv is None or not isinstance(cmp[0], Node) or not isinstance(cmp[1], Node):
        return None
    probs, bound = cmp
    s = canon(probs)
    if s is None or s[0] != "softmax" or s[1].get("input") is not x or not _last_dim(s[1].get("dim"), xv.dim()) \
            or s[1].get("dtype"):
        return None
    b = canon(bound)
    if b is None or b[0] != "mul":
        return None
    factor, top = b[1].get("input"), b[1].get("other")
    if isinstance(factor, Node):
        factor, top = top, factor
    t = canon(top) if isinstance(top, Node) else None
    if not is_number(factor) or t is None or t[0] != "amax" or t[1].get("input") is not probs \
            or not _last_dim(t[1].get("dim"), xv.dim()) or t[1].get("keepdim") is not True:
        return None
    writes = writes_into(mask)
    keep = [_keep_top(w, mask, probs) for w in writes]
    if len(writes) > 1 or None in keep:
        return None
    return Filter("min_p", float(factor), keep[0][0] if keep else 1,
                  [mask, probs, bound, top, *writes, *(keep[0][1] if keep else [])])


def _keep_top(w: Node, mask: Node, probs: Node) -> tuple[int, list[Node]] | None:
    """``mask.scatter_(-1, topk(probs, m).indices, False)`` -> ``(m, nodes)``."""
    if not (w.op == "call_method" and w.target == "scatter_" and len(w.args) == 4 and not w.kwargs):
        return None
    _, dim, index, v = w.args
    mv = tensor_val(mask)
    if not _is_zero(v) or mv is None or not _last_dim(dim, mv.dim()):
        return None
    if not (isinstance(index, Node) and index.target is operator.getitem and index.args[1] == 1):
        return None
    top = index.args[0]
    c = canon(top)
    if c is None or c[0] != "topk" or c[1].get("input") is not probs or not isinstance(c[1].get("k"), int):
        return None
    return c[1]["k"], [index, top]
