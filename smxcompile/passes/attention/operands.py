"""The operands of an attention block, read from the Dynamo graph: K^T's copies and own scale, K / V repeated per
query head (GQA), copies, dropout and the softmax call. Used by :mod:`.matcher`, which assembles them into a site."""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.nn.functional as F
from torch.fx import Node

from ..patterns.arith import scale_stage
from ..patterns.selections import no_op_copy
from ..patterns.graph import canon, same_shape, same_size, tensor_val
from ..patterns.written_softmax import written_softmax

_DROPOUT_FNS = {F.dropout, torch.dropout, torch.nn.functional.dropout}


def key_side(kt: Any) -> tuple[Any, list]:
    """Peel copies and scalar scales off the score matmul's second operand (``k.transpose(-2, -1).contiguous()``,
    ``k.transpose(-2, -1) * b``) -> (what is left, [(node, "copy" | "scale" | "scale_t", payload)])."""
    scales: list = []
    for _ in range(6):
        if not isinstance(kt, Node) or len(kt.users) != 1:
            break
        inner = no_op_copy(kt)
        if inner is not None:
            scales.append((kt, "copy", None))
            kt = inner
            continue
        st = scale_stage(kt)
        if st is None:
            break
        kind, data, nxt = st
        scales.append((kt, kind, data))
        kt = nxt
    return kt, scales


def ungqa(n: Node) -> tuple[Node, int, list[Node]] | None:
    """K or V repeated per query head -> ``(kv, n_rep, the nodes repeating it)``: head ``h`` of ``n`` reads head
    ``h // n_rep`` of ``kv``. Either ``repeat_interleave`` over the head dim, or a unit dim inserted after it,
    broadcast to ``n_rep`` and merged into it (``repeat_kv``), each step known by its shapes in any spelling."""
    v = tensor_val(n)
    if v is None or v.dim() < 3:
        return None
    h = v.dim() - 3
    if _called(n) == "repeat_interleave":
        kv, reps = n.args[0], n.args[1] if len(n.args) > 1 else n.kwargs.get("repeats")
        dim = n.args[2] if len(n.args) > 2 else n.kwargs.get("dim")
        ok = isinstance(dim, int) and dim % v.dim() == h and not n.kwargs.get("output_size")
        return (kv, reps, [n]) if ok and isinstance(reps, int) and _repeated(kv, reps, v, h) else None
    e = n.args[0] if _called(n) in _ROW_MAJOR else None        # (..., Hkv, n_rep, S, E), merged row-major
    u = e.args[0] if isinstance(e, Node) and _called(e) in _BROADCASTS and len(e.users) == 1 else None
    if not isinstance(u, Node) or len(u.users) != 1 or not (_called(u) in _ROW_MAJOR or _inserts_dims(u)):
        return None
    kv, ev, uv = u.args[0], tensor_val(e), tensor_val(u)
    reps = ev.shape[h + 1] if ev is not None and ev.dim() == v.dim() + 1 else None
    if not isinstance(reps, int) or not _repeated(kv, reps, v, h):
        return None
    kvs = tuple(tensor_val(kv).shape)
    with_dim = lambda size: kvs[:h + 1] + (size,) + kvs[h + 1:]  # noqa: E731
    if uv is None or not same_shape(tuple(uv.shape), with_dim(1)) or not same_shape(tuple(ev.shape), with_dim(reps)):
        return None
    return kv, reps, [n, e, u]


_ROW_MAJOR = {"view", "reshape", "flatten", "unflatten", "unsqueeze"}   # keep every entry's row-major position
_BROADCASTS = {"expand", "expand_as", "broadcast_to", "repeat"}


def _called(n: Any) -> str | None:
    """The method, or torch function, ``n`` calls."""
    if not isinstance(n, Node) or not n.args or not isinstance(n.args[0], Node):
        return None
    if n.op == "call_method":
        return n.target
    name = getattr(n.target, "__name__", "")
    return name if n.op == "call_function" and getattr(torch, name, None) is n.target else None


def _inserts_dims(n: Node) -> bool:
    """``x[..., None, :]``: indexing with None, ``...`` and slices only."""
    idx = n.args[1] if n.target is operator.getitem and len(n.args) == 2 else 0
    idx = idx if isinstance(idx, tuple) else (idx,)
    return all(i is None or i is Ellipsis or isinstance(i, slice) for i in idx)


def _repeated(kv: Any, reps: int, v, h: int) -> bool:
    """``v`` has ``kv``'s shape with dim ``h`` ``reps`` times as long (``reps`` at least 2)."""
    kvv = tensor_val(kv)
    return isinstance(kv, Node) and kvv is not None and kvv.dim() == v.dim() and reps >= 2 and all(
        same_size(kvv.shape[i] * (reps if i == h else 1), v.shape[i]) for i in range(v.dim()))


def dropout_call(n: Node) -> tuple[Node, float, bool] | None:
    """``F.dropout(x, p, training)`` -> (x, p, training); in place only on a tensor nothing else reads."""
    if n.op != "call_function" or n.target not in _DROPOUT_FNS:
        return None
    names = ("input", "p", "training", "inplace") if n.target is not torch.dropout else ("input", "p", "train")
    a = dict(zip(names, n.args))
    a.update(n.kwargs)
    p = a.get("p", 0.5)
    training = a.get("training", a.get("train", True))
    if not isinstance(p, (int, float)) or not isinstance(training, bool) or a.get("inplace") and not (
            isinstance(a["input"], Node) and len(a["input"].users) == 1):
        return None
    return a["input"], float(p), training


def softmax_input(n: Node) -> tuple[Node, Any, Any] | None:
    """``(x, dim, dtype)`` of a softmax call or of one written out (:func:`.written_softmax`), else None."""
    c = canon(n)
    if c is not None and c[0] == "softmax":
        return c[1].get("input"), c[1].get("dim"), c[1].get("dtype")
    found = written_softmax(n)
    return None if found is None else (found[0], found[1], None)


def softmax_interior(n: Node) -> list[Node]:
    """The nodes between a softmax written out and its input (none for a call)."""
    found = written_softmax(n) if softmax_input(n) is not None else None
    return [] if found is None else found[2]


__all__ = ["key_side", "ungqa", "dropout_call", "softmax_input", "softmax_interior"]
