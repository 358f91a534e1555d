"""The operands of an attention block, read from the Dynamo graph: the two matmuls (``@``, ``bmm``, ``einsum``),
K^T (a transpose of the last two dims, through copies and its own scale), K / V repeated per query head (GQA),
views that regroup only the leading dims, copies, dropout, the softmax call, and in-place adds on the scores.
Used by :mod:`.matcher`, which assembles them into a site."""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.nn.functional as F
from torch.fx import Node

from ..patterns.arith import scale_stage
from ..patterns.graph import canon, same_shape, same_size, static_shape, tensor_val

_MATMUL_FNS = {operator.matmul, torch.matmul, torch.bmm}
_MATMUL_METHODS = {"matmul", "bmm", "__matmul__"}
_DROPOUT_FNS = {F.dropout, torch.dropout, torch.nn.functional.dropout}
_VIEWISH = {"view", "reshape"}


def is_matmul(n: Any) -> bool:
    """A matmul (``@``, ``matmul``, ``bmm``) or an einsum with the score or value-matmul shape."""
    if not isinstance(n, Node):
        return False
    if n.op == "call_function":
        if n.target is torch.einsum:
            return einsum_kind(n) is not None
        return n.target in _MATMUL_FNS and len(n.args) == 2 and not n.kwargs
    return n.op == "call_method" and n.target in _MATMUL_METHODS and len(n.args) == 2 and not n.kwargs


def einsum_kind(n: Node) -> tuple[str, Node, Node] | None:
    """``einsum("...qd,...kd->...qk", q, k)`` -> ("qk", q, k); ``einsum("...qk,...kd->...qd", p, v)`` -> ("pv", p, v).

    The batch letters (or ``...``) must be the same, in the same order, in both inputs and the output."""
    if n.op != "call_function" or n.target is not torch.einsum or n.kwargs or len(n.args) < 2:
        return None
    eq, ops = n.args[0], list(n.args[1:])
    if len(ops) == 1 and isinstance(ops[0], (list, tuple)):
        ops = list(ops[0])
    if not isinstance(eq, str) or len(ops) != 2 or not all(isinstance(o, Node) for o in ops) or "->" not in eq:
        return None
    lhs, out = eq.replace(" ", "").replace("...", "#").split("->")
    ins = lhs.split(",")
    if len(ins) != 2:
        return None
    a, b = ins
    if not (len(a) == len(b) == len(out) >= 2) or not (a[:-2] == b[:-2] == out[:-2]):
        return None
    batch = set(a[:-2])
    if len(batch) != len(a[:-2]):
        return None
    if a[-1] == b[-1] and out[-2:] == a[-2] + b[-2] and len({a[-2], b[-2], a[-1]}) == 3 \
            and not {a[-2], b[-2], a[-1]} & batch:
        return "qk", ops[0], ops[1]
    if a[-1] == b[-2] and out[-2:] == a[-2] + b[-1] and len({a[-2], a[-1], b[-1]}) == 3 \
            and not {a[-2], a[-1], b[-1]} & batch:
        return "pv", ops[0], ops[1]
    return None


def shape_of(n: Any) -> tuple | None:
    v = tensor_val(n)
    return None if v is None else tuple(v.shape)


def transposed_last2(kt: Node) -> tuple[Node | None, str]:
    """``kt`` = K with its last two dims swapped -> (K, ""); otherwise (None, why)."""
    v = tensor_val(kt)
    if v is None:
        return None, "no shape information on K^T"
    nd = v.dim()
    if kt.op == "call_method" and kt.target == "mT" or (kt.op == "call_function" and kt.target is getattr and kt.args[1] == "mT"):
        return kt.args[0], ""
    if (kt.op == "call_method" and kt.target in ("transpose", "swapaxes", "swapdims")) or (
            kt.op == "call_function" and kt.target in (torch.transpose, torch.swapaxes, torch.swapdims)):
        a = list(kt.args[1:]) + [kt.kwargs.get(k) for k in ("dim0", "dim1") if k in kt.kwargs]
        if len(a) == 2 and all(isinstance(d, int) for d in a):
            d = sorted(x % nd for x in a)
            if d == [nd - 2, nd - 1]:
                return kt.args[0], ""
            return None, f"K^T swaps dims {tuple(a)}, not the last two"
    if kt.op == "call_method" and kt.target == "t" and nd == 2:
        return kt.args[0], ""
    if (kt.op == "call_method" and kt.target == "permute") or (kt.op == "call_function" and kt.target is torch.permute):
        perm = kt.args[1:] if kt.op == "call_method" else kt.args[1:]
        if len(perm) == 1 and isinstance(perm[0], (list, tuple)):
            perm = tuple(perm[0])
        perm = tuple(p % nd for p in perm) if all(isinstance(p, int) for p in perm) else None
        if perm is not None and perm == tuple(range(nd - 2)) + (nd - 1, nd - 2):
            return kt.args[0], ""
        return None, f"K is permuted {perm}, not transposed in its last two dims"
    return None, "the score matmul's second operand is not K transposed"


def lead_view(n: Any) -> Node | None:
    """``x.view(shape)`` / ``x.reshape(shape)`` that only regroups the leading (batch, head) dims of ``x``
    (the last two dims kept, provably also for symbolic sizes) -> x."""
    if not isinstance(n, Node) or not ((n.op == "call_method" and n.target in _VIEWISH) or (
            n.op == "call_function" and n.target is torch.reshape)):
        return None
    x = n.args[0]
    xv, nv = tensor_val(x), tensor_val(n)
    if not isinstance(x, Node) or xv is None or nv is None or xv.dim() < 3 and nv.dim() < 3:
        return None
    if xv.dim() < 2 or nv.dim() < 2 or not same_shape(tuple(xv.shape[-2:]), tuple(nv.shape[-2:])):
        return None
    return x


def view_lead(n: Node) -> tuple | None:
    """The leading dims a :func:`lead_view` node regroups to, as its arguments give them (ints, or size nodes
    under dynamic shapes): what the op's inputs can be reshaped to at run time."""
    v = tensor_val(n)
    if static_shape(v) is not None:
        return tuple(v.shape[:-2])
    shape = n.args[1:]
    if len(shape) == 1 and isinstance(shape[0], (list, tuple)):
        shape = tuple(shape[0])
    if len(shape) != v.dim() or not all(isinstance(d, (int, Node)) for d in shape):
        return None
    return tuple(shape[:-2])


def copy_of(n: Any) -> Node | None:
    """``x.clone()`` / ``x.contiguous()`` / ``torch.clone(x)`` -> x (the same values, a fresh layout)."""
    if not isinstance(n, Node) or not n.args or not isinstance(n.args[0], Node):
        return None
    if (n.op == "call_method" and n.target in ("clone", "contiguous")) or (
            n.op == "call_function" and n.target is torch.clone):
        return n.args[0]
    return None


def key_side(kt: Any) -> tuple[Any, list]:
    """Peel copies and scalar scales off the score matmul's second operand (``k.transpose(-2, -1).contiguous()``,
    ``k.transpose(-2, -1) * b``) -> (what is left, [(node, "copy" | "scale" | "scale_t", payload)])."""
    scales: list = []
    for _ in range(6):
        if not isinstance(kt, Node) or len(kt.users) != 1:
            break
        inner = copy_of(kt)
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
    return is_matmul(n) or (c is not None and c[0] in ("add", "sub", "mul", "div", "tanh"))


def inplace_add_before(n: Node, consumer: Node) -> Node | None:
    """The in-place add ``u = n.add_(mask)`` that runs before ``consumer`` reads ``n``, when ``n`` is a fresh
    tensor used only by ``u`` and ``consumer`` (so ``consumer`` reads ``n + mask``), else None."""
    users = set(n.users)
    us = [u for u in users if u is not consumer and inplace_add_operands(u) is not None and u.args[0] is n]
    if len(us) != 1 or users != {us[0], consumer} or not fresh_tensor(n) or us[0].args[1] is n:
        return None
    u = us[0]
    x = u.next
    while x is not None and x is not consumer:   # u must run before consumer
        x = x.next
    return u if x is consumer else None


__all__ = ["is_matmul", "einsum_kind", "shape_of", "transposed_last2", "lead_view", "view_lead", "copy_of", "key_side", "ungqa",
           "dropout_call", "softmax_input", "inplace_add_operands", "fresh_tensor", "inplace_add_before"]
