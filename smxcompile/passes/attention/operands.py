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
from ..patterns.graph import canon, same_size, tensor_val

_DROPOUT_FNS = {F.dropout, torch.dropout, torch.nn.functional.dropout}
_VIEWISH = {"view", "reshape"}


def shape_of(n: Any) -> tuple | None:
    v = tensor_val(n)
    return None if v is None else tuple(v.shape)


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


def ungqa(n: Node) -> tuple[Node, int] | None:
    """K or V repeated per query head (``repeat_kv`` or ``repeat_interleave`` on the head dim) -> (kv, n_rep)."""
    v = tensor_val(n)
    if v is None or v.dim() < 3:
        return None
    # repeat_interleave(kv, n, dim=head dim)
    if (n.op == "call_method" and n.target == "repeat_interleave") or (
            n.op == "call_function" and n.target is torch.repeat_interleave):
        kv = n.args[0]
        reps = n.args[1] if len(n.args) > 1 else n.kwargs.get("repeats")
        dim = n.args[2] if len(n.args) > 2 else n.kwargs.get("dim")
        kvv = tensor_val(kv)
        if (isinstance(reps, int) and reps >= 1 and isinstance(dim, int) and kvv is not None
                and kvv.dim() == v.dim() and dim % v.dim() == v.dim() - 3 and not n.kwargs.get("output_size")):
            return kv, reps
        return None
    # reshape(expand(kv[:, :, None], (B, Hkv, n, S, D)), (B, Hkv * n, S, D))
    if not ((n.op == "call_method" and n.target in _VIEWISH) or (n.op == "call_function" and n.target is torch.reshape)):
        return None
    e = n.args[0]
    ev = tensor_val(e)
    if not isinstance(e, Node) or ev is None or ev.dim() != v.dim() + 1 or len(e.users) != 1:
        return None
    if not (e.op == "call_method" and e.target == "expand"):
        return None
    u = e.args[0]
    uv = tensor_val(u)
    if not isinstance(u, Node) or uv is None or uv.dim() != ev.dim() or len(u.users) != 1:
        return None
    h = v.dim() - 3        # head dim of K; the inserted dim sits right after it
    if not same_size(uv.shape[h + 1], 1):
        return None
    kv = None
    if u.op == "call_method" and u.target == "unsqueeze" and len(u.args) == 2 and isinstance(u.args[1], int) \
            and u.args[1] % uv.dim() == h + 1:
        kv = u.args[0]
    elif u.op == "call_function" and u.target is operator.getitem and isinstance(u.args[1], tuple):
        idx = u.args[1]
        full = slice(None, None, None)
        if len(idx) >= h + 2 and all(i == full for i in idx[:h + 1]) and idx[h + 1] is None \
                and all(i == full or i is Ellipsis for i in idx[h + 2:]):
            kv = u.args[0]
    kvv = tensor_val(kv)
    if kv is None or kvv is None or kvv.dim() != v.dim():
        return None
    reps = ev.shape[h + 1]
    if not isinstance(reps, int) or not same_size(kvv.shape[h] * reps, v.shape[h]):
        return None
    for i in range(v.dim()):
        if i != h and not same_size(kvv.shape[i], v.shape[i]):
            return None
    return kv, reps


def dropout_call(n: Node) -> tuple[Node, float, bool] | None:
    """``F.dropout(x, p, training)`` -> (x, p, training)."""
    if n.op != "call_function" or n.target not in _DROPOUT_FNS:
        return None
    names = ("input", "p", "training", "inplace") if n.target is not torch.dropout else ("input", "p", "train")
    a = dict(zip(names, n.args))
    a.update(n.kwargs)
    p = a.get("p", 0.5)
    training = a.get("training", a.get("train", True))
    if not isinstance(p, (int, float)) or not isinstance(training, bool) or a.get("inplace"):
        return None
    return a["input"], float(p), training


def softmax_input(n: Node) -> tuple[Node, Any, Any] | None:
    c = canon(n)
    if c is None or c[0] != "softmax":
        return None
    return c[1].get("input"), c[1].get("dim"), c[1].get("dtype")


__all__ = ["shape_of", "key_side", "ungqa", "dropout_call", "softmax_input"]
