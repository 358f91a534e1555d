"""The operands of an attention block, read from the Dynamo graph: K^T's copies and own scale, K / V repeated per
query head (GQA), views that regroup only the leading dims, copies, dropout, the softmax call, and in-place adds
and fills on the scores. Used by :mod:`.matcher`, which assembles them into a site."""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.nn.functional as F
from torch.fx import Node

from ..patterns.arith import scale_stage
from ..patterns.contraction import contraction
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


def inplace_add_operands(n: Any) -> tuple[Node, Node] | None:
    """``operator.iadd(s, m)`` (``s += m``) or ``s.add_(m)`` with a tensor ``m`` -> (s, m)."""
    if not isinstance(n, Node) or len(n.args) != 2 or n.kwargs or not isinstance(n.args[1], Node):
        return None
    if (n.op == "call_function" and n.target is operator.iadd) or (n.op == "call_method" and n.target == "add_"):
        return n.args[0], n.args[1]
    return None


def fresh_tensor(n: Any) -> bool:
    """``n`` is a new tensor (a matmul or an out-of-place arithmetic result), not a view or an alias of another:
    an in-place add on it changes nothing else."""
    if not isinstance(n, Node):
        return False
    c = canon(n)
    return contraction(n) is not None or (c is not None and c[0] in ("add", "sub", "mul", "div", "tanh"))


def inplace_fill(n: Any) -> tuple[Node, bool, Any] | None:
    """``s.masked_fill_(mask, value)`` -> ``(mask, True, value)``."""
    if isinstance(n, Node) and n.op == "call_method" and n.target == "masked_fill_" and len(n.args) == 3 \
            and not n.kwargs and isinstance(n.args[1], Node):
        return n.args[1], True, n.args[2]
    return None


def inplace_add_before(n: Node, consumer: Node) -> Node | None:
    """The in-place add or fill ``u = n.add_(mask)`` / ``n.masked_fill_(mask, value)`` that runs before
    ``consumer`` reads ``n``, when ``n`` is a fresh tensor used only by ``u`` and ``consumer`` (so ``consumer``
    reads ``n + mask``, or ``n`` filled), else None."""
    users = set(n.users)
    us = [u for u in users if u is not consumer and u.args and u.args[0] is n
          and (inplace_add_operands(u) is not None or inplace_fill(u) is not None)]
    if len(us) != 1 or users != {us[0], consumer} or not fresh_tensor(n) or us[0].args[1] is n:
        return None
    u = us[0]
    x = u.next
    while x is not None and x is not consumer:   # u must run before consumer
        x = x.next
    return u if x is consumer else None


__all__ = ["shape_of", "key_side", "ungqa",
           "dropout_call", "softmax_input", "inplace_add_operands", "inplace_fill", "fresh_tensor", "inplace_add_before"]
