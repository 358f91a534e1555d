"""Batched contractions with roles: every ``matmul`` / ``@`` / ``bmm`` / ``baddbmm`` / two-operand ``einsum``, in
any operand layout, read as one product ``A @ B`` of canonical operands ``A (..., M, C)`` and ``B (..., C, N)``.

Views that only reorder dims (``transpose``, ``permute``, ``mT``, ``.T``, ``swapaxes``) are index maps on the
tensor they view: an :class:`Operand` is a node plus the permutation that gives its canonical layout (and
:func:`lead_view` reads a view that regroups only the leading dims), so the
same contraction is found whatever the layout of its inputs (K transposed, K permuted (0, 2, 3, 1), Q or V
in a (B, H, d, N) layout, an einsum writing its output as (B, L, H, d)). Nothing in the graph changes:
a rewrite materializes the permutations it keeps (:func:`apply_perm`)."""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import torch
from torch.fx import Node

from .graph import same_shape, static_shape, tensor_val

_MATMUL_FNS = {operator.matmul, torch.matmul, torch.bmm}
_MATMUL_METHODS = {"matmul", "bmm", "__matmul__"}
_REGROUPS = {"view", "reshape"}


@dataclasses.dataclass(frozen=True)
class Operand:
    """``node.permute(perm)`` (``perm`` None: the node as it is; a None entry: a unit dim the operand broadcasts
    along, as an einsum batch index it lacks)."""

    node: Node
    perm: tuple[int | None, ...] | None = None

    def val(self):
        """The fake tensor of the canonical layout, or None without shape information."""
        v = tensor_val(self.node)
        if v is None or self.perm is None:
            return v
        return apply_perm(v, self.perm) if v.dim() == sum(p is not None for p in self.perm) else None

    @property
    def mT(self) -> "Operand":
        """The operand with its last two dims swapped."""
        v = tensor_val(self.node)
        nd = len(self.perm) if self.perm is not None else (v.dim() if v is not None else 0)
        base = self.perm or tuple(range(nd))
        return _operand(self.node, base[:-2] + (base[-1], base[-2]))


def _operand(node: Node, perm: tuple[int, ...] | None) -> Operand:
    return Operand(node, None if perm is None or perm == tuple(range(len(perm))) else tuple(perm))


def reorder_of(n: Any) -> tuple[Node, tuple[int, ...]] | None:
    """``x.transpose(a, b)`` / ``x.permute(...)`` / ``x.mT`` / ``x.T`` / ``swapaxes`` -> ``(x, perm)`` such that
    ``n == x.permute(perm)``; None for anything else."""
    if not isinstance(n, Node) or not n.args or not isinstance(n.args[0], Node):
        return None
    v = tensor_val(n.args[0])
    if v is None:
        return None
    nd, x = v.dim(), n.args[0]
    name = n.target if n.op == "call_method" else getattr(n.target, "__name__", None) \
        if n.op == "call_function" and n.target in (torch.transpose, torch.swapaxes, torch.swapdims, torch.permute,
                                                    torch.t) else None
    if n.op == "call_function" and n.target is getattr and n.args[1] in ("mT", "T"):
        name = n.args[1]
    if name in ("transpose", "swapaxes", "swapdims"):
        dims = list(n.args[1:]) + [n.kwargs[k] for k in ("dim0", "dim1") if k in n.kwargs]
        if len(dims) != 2 or not all(isinstance(d, int) for d in dims) or nd == 0:
            return None
        perm = list(range(nd))
        a, b = dims[0] % nd, dims[1] % nd
        perm[a], perm[b] = perm[b], perm[a]
        return x, tuple(perm)
    if name == "permute":
        dims = n.args[1:] if n.op == "call_method" else n.args[1:] or (n.kwargs.get("dims"),)
        if len(dims) == 1 and isinstance(dims[0], (list, tuple)):
            dims = tuple(dims[0])
        if len(dims) != nd or not all(isinstance(d, int) for d in dims):
            return None
        return x, tuple(d % nd for d in dims)
    if name == "mT" and nd >= 2:
        return x, tuple(range(nd - 2)) + (nd - 1, nd - 2)
    if name in ("T", "t") and nd == 2:
        return x, (1, 0)
    return None


def peel(op: Operand, views: list | None = None) -> Operand:
    """Follow reordering views up to the tensor they view, composing their permutations (the views passed are
    appended to ``views``)."""
    node, perm = op.node, op.perm
    for _ in range(8):
        r = reorder_of(node)
        if r is None:
            break
        if views is not None:
            views.append(node)
        x, p = r
        perm = p if perm is None else tuple(None if i is None else p[i] for i in perm)
        node = x
    return _operand(node, perm)


def settle(op: Operand) -> Operand:
    """``op`` with its reordering views peeled off when they cancel out (the tensor they view is the operand in
    canonical layout), else ``op`` as it is: a permutation is kept only where the layout needs one."""
    p = peel(op)
    return p if p.perm is None else op


def reshape_input(n: Any) -> Node | None:
    """``x`` for ``x.view(shape)``, ``x.reshape(shape)``, ``torch.reshape(x, shape)``."""
    if not isinstance(n, Node) or not ((n.op == "call_method" and n.target in _REGROUPS) or (
            n.op == "call_function" and n.target is torch.reshape)):
        return None
    return n.args[0] if isinstance(n.args[0], Node) else None


def split_view(n: Any, rows: int, cols: int) -> Node | None:
    """``x.view(shape)`` / ``x.reshape(shape)`` of (..., rows, cols) entries, static sizes, that keeps each entry's
    (leading, row, column) indices: ``shape`` is (leading dims, dims splitting ``rows``, dims splitting ``cols``),
    e.g. (B, L, S) -> (B, Lh, Lw, Sh, Sw) -> x. Row-major index maps: both shapes flatten alike."""
    x = reshape_input(n)
    if x is None:
        return None
    for shape in (static_shape(tensor_val(x)), static_shape(tensor_val(n))):
        if shape is None:
            return None
        dims = list(shape)
        for size in (cols, rows):
            prod = 1
            while prod < size and dims:
                prod *= dims.pop()
            if prod != size:
                return None
    return x


def lead_view(n: Any) -> Node | None:
    """``x.view(shape)`` / ``x.reshape(shape)`` that only regroups the leading (batch, head) dims of ``x``
    (the last two dims kept, provably also for symbolic sizes) -> x."""
    x = reshape_input(n)
    if x is None:
        return None
    xv, nv = tensor_val(x), tensor_val(n)
    if xv is None or nv is None or xv.dim() < 3 and nv.dim() < 3:
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


def apply_perm(t: torch.Tensor, perm: tuple[int | None, ...] | None) -> torch.Tensor:
    """``t.permute(perm)``, a unit dim inserted at each None entry."""
    if perm is None:
        return t
    t = t.permute([p for p in perm if p is not None])
    for i, p in enumerate(perm):
        t = t.unsqueeze(i) if p is None else t
    return t


def op_layout(q, k, v, layout: dict | None):
    """q, k, v permuted as ``layout`` says (``"q"``, ``"k"``, ``"v"``; ``"v_split"``: V's last dims flattened
    into the features of each key), and the function that lays the op's output out as the graph's (``"out"``)."""
    layout = layout or {}
    q, k, v = (apply_perm(t, layout.get(r)) for t, r in ((q, "q"), (k, "k"), (v, "v")))
    n = layout.get("v_split")
    features = tuple(v.shape[-1 - n:]) if n else None
    v = v.flatten(-1 - n) if n else v
    return q, k, v, lambda out: apply_perm(out.unflatten(-1, features) if n else out, layout.get("out"))


def inverse_perm(perm: tuple[int, ...] | None) -> tuple[int, ...] | None:
    if perm is None:
        return None
    inv = [0] * len(perm)
    for i, p in enumerate(perm):
        inv[p] = i
    return tuple(inv)


@dataclasses.dataclass(frozen=True)
class Contraction:
    """``node = (alpha * (A @ B) + beta * bias).permute(out_perm)`` with ``A (..., M, C)``, ``B (..., C, N)``.

    ``out_perm`` None: the node holds ``A @ B`` in canonical layout (..., M, N); ``bias`` is ``baddbmm``'s input
    (None when ``beta`` is 0: torch then ignores it, NaN included)."""

    node: Node
    a: Operand
    b: Operand
    out_perm: tuple[int, ...] | None = None
    alpha: float = 1.0
    bias: Node | None = None
    beta: float = 0.0

    def transposed(self) -> "Contraction":
        """The same node read as ``(B^T @ A^T)^T``: the roles of the two operands swap."""
        nd = len(self.a.perm) if self.a.perm else tensor_val(self.node).dim()
        swap = tuple(range(nd - 2)) + (nd - 1, nd - 2)
        out = swap if self.out_perm is None else tuple(swap[i] for i in self.out_perm)
        return dataclasses.replace(self, a=self.b.mT, b=self.a.mT,
                                   out_perm=None if out == tuple(range(nd)) else out)


def value_features(pv: Contraction, weights: Operand) -> tuple[Contraction, Operand, int]:
    """Batch indices only V has (``einsum("bhij,bhjwd->bhiwd")``, SepViT): V's (w, d) are w * d features of each
    key. They move next to V's last dim (the op reads them flattened, ``layout["v_split"]``): the contraction
    so read, the weights without them, their count (0: none)."""
    perm = weights.perm
    base = pv.b.perm or tuple(range(len(perm or ())))
    if perm is None or None not in perm[:-2] or None in perm[-2:]:
        return pv, weights, 0
    nd = len(perm)
    split = [p for p in range(nd - 2) if perm[p] is None]
    keep = [p for p in range(nd - 2) if perm[p] is not None]
    if any(base[p] is None for p in split):
        return pv, weights, 0
    to_op = {p: i for i, p in enumerate((*keep, nd - 2, *split, nd - 1))}    # canonical dim -> the op's out dim
    out = tuple(to_op[o] for o in (pv.out_perm or range(nd)))
    v = Operand(pv.b.node, tuple(base[p] for p in (*keep, nd - 2, *split, nd - 1)))
    w = Operand(weights.node, tuple(perm[p] for p in (*keep, nd - 2, nd - 1)))
    w = w if w.perm != tuple(range(nd - len(split))) else Operand(weights.node)
    return dataclasses.replace(pv, b=v, out_perm=None if out == tuple(range(nd)) else out), w, len(split)


def contraction(n: Any) -> Contraction | None:
    """``n`` as a batched contraction (operands of rank >= 2, one contracted index), else None."""
    if not isinstance(n, Node) or n.op not in ("call_function", "call_method"):
        return None
    if n.op == "call_function" and n.target is torch.einsum:
        return _einsum(n)
    if n.op == "call_function" and n.target is torch.baddbmm or n.op == "call_method" and n.target == "baddbmm":
        names = ("input", "batch1", "batch2")
        a = dict(zip(names, n.args))
        a.update(n.kwargs)
        beta, alpha = a.get("beta", 1), a.get("alpha", 1)
        if set(a) - set(names) - {"beta", "alpha"} or not isinstance(beta, (int, float)) \
                or not isinstance(alpha, (int, float)) or not all(isinstance(a.get(k), Node) for k in names[1:]):
            return None
        bias = a.get("input") if beta != 0 and isinstance(a.get("input"), Node) else None
        return Contraction(n, Operand(a["batch1"]), Operand(a["batch2"]), alpha=float(alpha), bias=bias,
                           beta=float(beta) if bias is not None else 0.0)
    matmul = (n.op == "call_function" and n.target in _MATMUL_FNS) or (
        n.op == "call_method" and n.target in _MATMUL_METHODS)
    if not matmul or len(n.args) != 2 or n.kwargs or not all(isinstance(x, Node) for x in n.args):
        return None
    va, vb = tensor_val(n.args[0]), tensor_val(n.args[1])
    if va is None or vb is None or va.dim() < 2 or vb.dim() < 2:
        return None
    return Contraction(n, Operand(n.args[0]), Operand(n.args[1]))


def _einsum(n: Node) -> Contraction | None:
    """A two-operand einsum with batch indices (in both operands and the output), one contracted index, and one
    free index per operand; ``...`` is a run of batch indices at the front of all three."""
    if n.kwargs or len(n.args) < 2 or not isinstance(n.args[0], str):
        return None
    ops = list(n.args[1:])
    if len(ops) == 1 and isinstance(ops[0], (list, tuple)):
        ops = list(ops[0])
    vals = [tensor_val(o) for o in ops]
    eq = n.args[0].replace(" ", "")
    if len(ops) != 2 or any(v is None for v in vals) or "->" not in eq:
        return None
    lhs, out = eq.split("->")
    ins = lhs.split(",")
    if len(ins) != 2:
        return None
    n_ell = {len(v.shape) - len(s.replace("...", "")) for s, v in zip(ins, vals) if "..." in s}
    if len(n_ell) > 1 or any("..." in s and not s.startswith("...") for s in ins + [out]):
        return None
    ell = "".join(chr(0x3B1 + i) for i in range(n_ell.pop() if n_ell else 0))   # fresh letters for ``...``
    a, b, o = (s.replace("...", ell) for s in (ins[0], ins[1], out))
    if any(len(set(s)) != len(s) for s in (a, b, o)) or len(a) != vals[0].dim() or len(b) != vals[1].dim():
        return None
    con = [c for c in a if c in b and c not in o]
    # each operand's free index is the last of its own output indices in its layout; its other own output indices
    # are batch indices the other operand broadcasts along (multi-query attention: "bhid,bjd->bhij")
    fa, fb = [[c for c in x if c in o and c not in y][-1:] for x, y in ((a, b), (b, a))]
    batch = [c for c in o if c not in fa + fb]
    if len(con) != 1 or len(fa) != 1 or len(fb) != 1 or not set(a + b) <= set(o) | set(con):
        return None     # no free index, or an index summed within one operand
    canon_out = batch + fa + fb
    pa = tuple(a.index(c) if c in a else None for c in batch + fa + con)
    pb = tuple(b.index(c) if c in b else None for c in batch + con + fb)
    po = tuple(canon_out.index(c) for c in o)
    return Contraction(n, _operand(ops[0], pa), _operand(ops[1], pb),
                       out_perm=None if po == tuple(range(len(po))) else po)


__all__ = ["Operand", "Contraction", "contraction", "value_features", "op_layout", "peel", "settle", "lead_view",
           "split_view", "reshape_input", "view_lead", "reorder_of", "apply_perm", "inverse_perm"]
