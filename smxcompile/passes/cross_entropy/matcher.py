"""Matching cross-entropy sites: ``linear -> ... -> cross_entropy`` becomes cut cross-entropy.

Matched in the Dynamo (pre-grad) graph, where the loss is still one call:

* ``F.cross_entropy`` (and ``nn.CrossEntropyLoss``, inlined to it), ``F.nll_loss(F.log_softmax(x))``
  (also with the log-probabilities flattened in between: ``nll_loss(lprobs.view(-1, V), y.view(-1))``)
  and ``F.linear_cross_entropy``; 3-D logits whose classes were moved to dim 1 for the loss
  (``F.cross_entropy(logits.transpose(1, 2), y)``) count as classes-last logits;
* whose logits come from ``F.linear`` / ``nn.Linear``, ``x @ W.T``, ``matmul(x, M)`` with a 2-D
  ``M``, or ``addmm`` (GPT-2's Conv1D), through the ops real code puts in between: up-casts
  (``.float()``), ``view``/``reshape``/``flatten`` of the token dims, next-token shifting by
  slicing (``logits[..., :-1, :]``, also of flattened rows: ``logits.view(-1, V)[:-1]``), temperature
  (``x / T``, ``x * s``) and soft-capping (``cap * tanh(x / cap)``).

Such a site (kind ``linear_cross_entropy``) is replaced by
:func:`smxcompile.kernels.cross_entropy` 's cut cross-entropy (Wijmans et al., "Cut Your
Losses in Large-Vocabulary Language Models", 2024): the N x V logits, their fp32 copy, the
log-softmax and the logits gradient are never materialized. When the logits are also
returned by the graph (Hugging Face models return them), the op writes them once, in their
own dtype, and computes the loss from the same chunks; only that returned tensor remains. When the
loss reads only some rows of the returned logits (the next-token shift), every row is computed and the
dropped ones get ``ignore_index`` targets. Under autocast the layer's dtype is applied explicitly, so a
loss outside the autocast region still sees the logits the layer computed.

Cross-entropy on logits that do not come from a linear layer (kind ``cross_entropy``)
becomes the online CE op ``smx::ce_stats`` (no log-softmax, no fp32 copy).
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import torch
import torch.nn.functional as F
from torch.fx import Node

from ..patterns.arith import scalar_factor, softcap
from ..patterns.casts import widening_cast
from ..patterns.graph import canon, cast_dtype, dtype_of, is_mutation, op_label, same_shape, same_size, tensor_val
from ..protocol import Match

_CE_PARAMS = ("input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction", "label_smoothing")
_NLL_PARAMS = ("input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction")
_LCE_PARAMS = ("input", "linear_weight", "target")
_VIEW_METHODS = {"view", "reshape", "flatten", "contiguous", "clone"}
_VIEW_FNS = {torch.reshape, torch.flatten}


@dataclasses.dataclass
class CEMatch(Match):
    kind: str                           # "linear_cross_entropy" | "cross_entropy"
    anchor: Node                        # the loss call
    logits: Node                        # the CE's input
    target: Node
    class_weight: Any = None            # Node or None
    ignore_index: int = -100
    reduction: str = "mean"
    label_smoothing: float = 0.0
    spelling: str = ""
    # linear part
    linear: Node | None = None
    h: Node | None = None
    weight: Node | None = None
    weight_t: bool = False               # the matched weight is (D, V) and must be transposed
    bias: Any = None
    scale: float = 1.0
    softcap: float | None = None
    # what the logits chain does to the rows, top-down, to replay on h:
    # ("reshape", lead shape) / ("flatten", None) / ("slice", index)
    row_ops: list = dataclasses.field(default_factory=list)
    escape: Node | None = None          # chain node whose value is also a graph output
    pad_rows: bool = False              # the escape is above a row slice: all rows computed, the dropped ones ignored
    compute_dtype: Any = None           # the linear layer's dtype when it differs from h's (autocast)
    classes_last: bool = False          # ``logits`` has the classes on its last dim, whatever its rank
    dead: list[Node] = dataclasses.field(default_factory=list)
    loss_nodes: list[Node] = dataclasses.field(default_factory=list)   # the loss call (+ its log_softmax)
    absorbed: list[str] = dataclasses.field(default_factory=list)
    note: str = ""

    def op_name(self) -> str:
        return "smx::linear_cross_entropy" if self.kind == "linear_cross_entropy" else "smx::cross_entropy"

    def detail(self) -> str:
        parts = [self.spelling, f"reduction={self.reduction}", f"ignore_index={self.ignore_index}"]
        if self.label_smoothing:
            parts.append(f"label_smoothing={self.label_smoothing}")
        if self.class_weight is not None:
            parts.append("class weights")
        parts += self.absorbed
        if self.note and (self.action == "rewritten" or self.note.startswith("not cut")):
            parts.append(self.note)  # the returned-logits note describes the rewrite: only when it happened
        return ", ".join(p for p in parts if p)


def _bind(node: Node, params: tuple[str, ...]) -> dict[str, Any] | None:
    if len(node.args) > len(params):
        return None
    b = dict(zip(params, node.args))
    for k, v in node.kwargs.items():
        if k in b:
            return None
        b[k] = v
    return b


def loss_call(node: Node) -> CEMatch | None:
    """A cross-entropy call (any spelling) -> a match with the loss arguments filled in, else None."""
    if node.op != "call_function":
        return None
    extra_nodes: list[Node] = []
    if node.target is F.cross_entropy:
        b = _bind(node, _CE_PARAMS)
        spelling = "F.cross_entropy"
    elif node.target is F.nll_loss:
        b = _bind(node, _NLL_PARAMS)
        if b is None:
            return None
        ls = b.get("input")
        # fairseq style: nll_loss(log_softmax(x, -1).view(-1, V), y.view(-1)): views that keep the classes last
        views: list[Node] = []
        nv = tensor_val(ls)
        while isinstance(ls, Node) and _keeps_last_dim(ls) and len(ls.users) == 1:
            views.append(ls)
            ls = ls.args[0]
        c = canon(ls) if isinstance(ls, Node) else None
        if c is None or c[0] != "log_softmax" or len(ls.users) != 1:
            return None
        lv, x = tensor_val(ls), c[1].get("input")
        dim = c[1].get("dim")
        if lv is None or not isinstance(x, Node) or not isinstance(dim, int) or c[1].get("dtype") is not None:
            return None
        nd = max(lv.dim(), 1)
        if views:
            # nll_loss's class dim is the last one only for (N, C) / (C,) inputs
            if nv is None or nv.dim() > 2 or dim % nd != nd - 1:
                return None
        elif dim % nd != (1 if lv.dim() >= 2 else 0):
            return None  # log-softmax over another dim: not a cross-entropy
        b = dict(b)
        b["input"] = x
        extra_nodes = views + [ls]
        classes_last = bool(views)
        spelling = "nll_loss(log_softmax)"
    elif getattr(F, "linear_cross_entropy", None) is not None and node.target is F.linear_cross_entropy:
        b = _bind(node, _LCE_PARAMS)
        if b is None:
            return None
        ii = b.get("ignore_index")
        # F.linear_cross_entropy maps ignore_index=None to -100 (F.cross_entropy's default)
        m = CEMatch("linear_cross_entropy", node, node, b.get("target"), b.get("weight"),
                    -100 if ii is None else ii, b.get("reduction", "mean"), b.get("label_smoothing", 0.0),
                    "F.linear_cross_entropy")
        m.h, m.weight, m.bias = b.get("input"), b.get("linear_weight"), b.get("linear_bias")
        m.linear = node
        m.dead = [node]
        m.loss_nodes = [node]
        return m
    else:
        return None
    if b is None:
        return None
    if b.get("size_average") is not None or b.get("reduce") is not None:
        legacy = {k: b[k] for k in ("size_average", "reduce") if b.get(k) is not None}
        reduction = "?"
        if all(isinstance(v, bool) for v in legacy.values()):
            reduction = torch.nn._reduction.legacy_get_string(legacy.get("size_average"), legacy.get("reduce"),
                                                              emit_warning=False)
        return CEMatch("cross_entropy", node, b.get("input"), b.get("target"), reduction=reduction, action="skipped",
                       reason="legacy size_average/reduce arguments", spelling=spelling,
                       note=", ".join(f"{k}={v}" for k, v in legacy.items()))
    m = CEMatch("cross_entropy", node, b.get("input"), b.get("target"), b.get("weight"), b.get("ignore_index", -100),
                b.get("reduction", "mean"), b.get("label_smoothing", 0.0), spelling)
    m.dead = [node] + extra_nodes
    if node.target is F.nll_loss:
        m.classes_last = classes_last
    else:
        # F.cross_entropy(logits.transpose(1, 2), y): (B, T, V) logits with the classes moved to dim 1
        src = _classes_moved_to_dim1(m.logits)
        tv = tensor_val(m.target)
        if src is not None and tv is not None and not tv.dtype.is_floating_point and len(m.logits.users) == 1:
            m.dead.append(m.logits)
            m.absorbed.append(f"classes moved to dim 1 by '{m.logits.name}'")
            m.logits, m.classes_last = src, True
    m.loss_nodes = list(m.dead)
    return m


def _keeps_last_dim(n: Node) -> bool:
    """A view/reshape/flatten/contiguous whose input and output have the same (known) last dim."""
    if not (n.op == "call_method" and n.target in _VIEW_METHODS or n.op == "call_function" and n.target in _VIEW_FNS):
        return False
    if not n.args or not isinstance(n.args[0], Node) or (n.target in ("contiguous", "clone") and n.kwargs):
        return False
    sv, nv = tensor_val(n.args[0]), tensor_val(n)
    return sv is not None and nv is not None and sv.dim() >= 1 and nv.dim() >= 1 and same_size(sv.shape[-1], nv.shape[-1])


def _classes_moved_to_dim1(n: Any) -> Node | None:
    """``x`` when ``n`` is a 3-D ``x.transpose(1, 2)`` (``permute(0, 2, 1)``, ``movedim(-1, 1)``, ``swapaxes``...)."""
    if not isinstance(n, Node) or n.op not in ("call_method", "call_function"):
        return None
    nv = tensor_val(n)
    if nv is None or nv.dim() != 3 or not n.args or not isinstance(n.args[0], Node) or n.kwargs:
        return None
    name = n.target if n.op == "call_method" else getattr(n.target, "__name__", "")
    if n.op == "call_function" and n.target not in (torch.transpose, torch.swapaxes, torch.swapdims, torch.permute,
                                                    torch.movedim, torch.moveaxis):
        return None
    rest = n.args[1:]
    if name in ("transpose", "swapaxes", "swapdims"):
        ok = len(rest) == 2 and all(isinstance(d, int) for d in rest) and {d % 3 for d in rest} == {1, 2}
    elif name == "permute":
        dims = rest[0] if len(rest) == 1 and isinstance(rest[0], (tuple, list)) else rest
        ok = all(isinstance(d, int) for d in dims) and tuple(d % 3 for d in dims) == (0, 2, 1)
    elif name in ("movedim", "moveaxis"):
        ok = len(rest) == 2 and all(isinstance(d, int) for d in rest) and (rest[0] % 3, rest[1] % 3) in ((2, 1), (1, 2))
    else:
        return None
    return n.args[0] if ok else None


def _linear(n: Node) -> tuple[Node, Node, bool, Any] | None:
    """``(h, weight, weight_is_DxV, bias)`` when ``n`` is a linear layer's output, else None."""
    if n.op != "call_function":
        return None
    if n.target in (F.linear, torch._C._nn.linear):
        b = _bind(n, ("input", "weight", "bias"))
        if b is None or not isinstance(b.get("input"), Node) or not isinstance(b.get("weight"), Node):
            return None
        wv = tensor_val(b["weight"])
        if wv is None or wv.dim() != 2:
            return None
        return b["input"], b["weight"], False, b.get("bias")
    if n.target is torch.addmm:
        b = _bind(n, ("input", "mat1", "mat2"))
        if b is None or set(b) - {"input", "mat1", "mat2"}:
            return None
        bias, h, w = b.get("input"), b.get("mat1"), b.get("mat2")
        bv, wv = tensor_val(bias), tensor_val(w)
        if bv is None or wv is None or bv.dim() != 1 or wv.dim() != 2 or not isinstance(h, Node):
            return None
        return h, w, True, bias
    c = canon(n)
    if c is not None and c[0] == "matmul" and n.target not in (torch.einsum, torch.baddbmm, torch.bmm):
        h, m = c[1].get("input"), c[1].get("other")
        hv, mv = tensor_val(h), tensor_val(m)
        if hv is None or mv is None or mv.dim() != 2 or hv.dim() < 1:
            return None
        # x @ W.T / W.t() / W.transpose(0, 1): use W directly
        if m.op == "call_method" and m.target in ("t", "T") or (
            m.op == "call_function" and m.target in (torch.t,)
        ) or (m.op == "call_method" and m.target == "transpose" and set(m.args[1:]) in ({0, 1}, {-1, -2}, {0, -1}, {-2, 1})):
            return h, m.args[0], False, None
        if m.op == "call_function" and m.target is getattr and m.args[1] in ("T", "mT"):
            return h, m.args[0], False, None
        return h, m, True, None
    return None


def _leading_slice(n: Node, ndim: int) -> tuple | None:
    """The index of ``x[idx]`` when it only slices leading dims (``[..., :-1, :]``, ``[:, 1:]``), else None."""
    if n.op != "call_function" or n.target is not operator.getitem or len(n.args) != 2:
        return None
    idx = n.args[1]
    if not isinstance(idx, tuple):
        idx = (idx,)
    if not all(isinstance(i, slice) or i is Ellipsis for i in idx):
        return None
    if any(isinstance(s, slice) and not all(v is None or isinstance(v, int) for v in (s.start, s.stop, s.step))
           for s in idx):
        return None
    # where does the last dim land?
    if Ellipsis in idx:
        k = idx.index(Ellipsis)
        if idx.count(Ellipsis) > 1:
            return None
        after = idx[k + 1:]
        if after:
            last = after[-1]
            if last != slice(None):
                return None
            idx = idx[:-1]  # drop the explicit full slice of the last dim
    else:
        if len(idx) > ndim:
            return None
        if len(idx) == ndim:
            if idx[-1] != slice(None):
                return None
            idx = idx[:-1]
    # now idx indexes only dims < ndim - 1 (Ellipsis covers the rest up to but excluding the last dim)
    if Ellipsis in idx:
        # "..., a" with a for the second-to-last: rewrite on h as (..., a, :)
        return tuple(idx) + (slice(None),)
    return tuple(idx)


def walk_to_linear(m: CEMatch) -> str:
    """Fill the linear part of ``m`` by walking up from the CE input; returns why it is not cut CE ('' if it is)."""
    n = m.logits
    lv = tensor_val(n)
    if lv is None:
        return "logits have no recorded shape"
    if lv.dim() == 0 or (lv.dim() >= 3 and not m.classes_last):
        return f"logits of rank {lv.dim()}: cut CE needs (N, V) logits with the classes last"
    v = lv.shape[-1]
    chain: list[Node] = []
    slices: list = []   # (index, lead shape of the sliced tensor, lead shape of the result), bottom-up
    scale, cap = 1.0, None
    seen_softcap = False
    absorbed: list[str] = []
    for _ in range(64):
        lin = _linear(n)
        if lin is not None:
            hv = tensor_val(lin[0])
            ov = tensor_val(n)
            if hv is None or ov is None or not same_size(ov.shape[-1], v):
                return "the linear layer's output does not keep the class dim last"
            m.linear, (m.h, m.weight, m.weight_t, m.bias) = n, lin
            # ``x @ W.T``: the transpose of W goes with the matmul (unless something else reads it)
            other = n.args[1] if n.op == "call_function" and len(n.args) == 2 else None
            if isinstance(other, Node) and other is not m.weight and other.args and other.args[0] is m.weight \
                    and len(other.users) == 1:
                chain.append(other)
            break
        if n.op not in ("call_function", "call_method"):
            # a graph input (the model and the loss in different graphs, or a loss function compiled alone)
            return f"logits come from '{n.name}' ({n.op}), not a linear layer"
        if not n.args:
            return f"logits come from '{n.name}' ({op_label(n)}), not a linear layer"
        nv = tensor_val(n)
        if nv is None:
            return f"'{n.name}' has no recorded value"
        nxt = None
        if cast_dtype(n) is not None:
            src, dst = dtype_of(n.args[0]), cast_dtype(n)
            if widening_cast(n) is None:
                if src is not None and src.is_floating_point and torch.finfo(dst).bits < torch.finfo(src).bits:
                    return f"'{n.name}' casts the logits down ({src} -> {dst})"
                if dst == torch.float64:
                    return f"'{n.name}' casts the logits to float64: fp64 math, which the op would do in fp32"
                return f"'{n.name}' casts the logits {src} -> {dst}, which rounds them"
            nxt = n.args[0]
            absorbed.append(f"{str(cast_dtype(n)).replace('torch.', '')} cast")
        elif (n.op == "call_method" and n.target in _VIEW_METHODS) or (n.op == "call_function" and n.target in _VIEW_FNS):
            src = n.args[0]
            sv = tensor_val(src)
            if sv is None or sv.dim() == 0 or nv.dim() == 0 or not same_size(sv.shape[-1], v) or not same_size(nv.shape[-1], v):
                return f"'{n.name}' reshapes across the class dim"
            if n.target == "contiguous" or n.target == "clone":
                if n.kwargs:
                    return f"'{n.name}' has unsupported arguments"
            nxt = src
        elif (sl := _leading_slice(n, (tensor_val(n.args[0]).dim() if isinstance(n.args[0], Node)
                                       and tensor_val(n.args[0]) is not None else 0))) is not None:
            slices.append((sl, tuple(tensor_val(n.args[0]).shape[:-1]), tuple(nv.shape[:-1])))
            nxt = n.args[0]
            absorbed.append("row slice " + _fmt_index(n.args[1]))
        elif (sc := softcap(n)) is not None:
            if seen_softcap:
                return "two soft-caps"
            if scale != 1.0:
                return "a scale after the soft-cap (the op scales before capping)"
            seen_softcap = True
            cap = sc[1]
            chain.extend(sc[2][1:])   # n itself joins the chain below
            nxt = sc[0]
            absorbed.append(f"softcap={sc[1]:g}")
        elif (s := scalar_factor(n)) is not None:
            scale *= s[1]
            nxt = s[0]
            absorbed.append(f"scale={s[1]:g}")
        else:
            return f"logits come from '{n.name}' ({n.target if n.op != 'call_method' else '.' + str(n.target)}), " \
                   "not a linear layer"
        chain.append(n)
        n = nxt
        if not isinstance(n, Node):
            return "logits are not a tensor node"
    else:
        return "chain too long"
    # replay the slices on h's rows top-down; a reshape of the rows before a slice is replayed too
    # (``logits.view(-1, V)[:-1]`` slices the flattened rows, not h's first dim)
    cur = tuple(tensor_val(m.linear).shape[:-1])
    row_ops: list = []
    for idx, lead_in, lead_out in reversed(slices):
        if not same_shape(lead_in, cur):
            if len(lead_in) == 1:
                row_ops.append(("flatten", None))   # the usual case: ``.view(-1, V)`` then slice; any shapes
            elif all(isinstance(d, int) for d in lead_in):
                row_ops.append(("reshape", lead_in))
            else:
                return "a row slice of reshaped logits with symbolic shapes"
        row_ops.append(("slice", idx))
        cur = lead_out
    m.scale, m.softcap = scale, cap
    m.row_ops = row_ops
    m.absorbed = m.absorbed + absorbed
    lin_v, h_v = tensor_val(m.linear), tensor_val(m.h)
    if lin_v is not None and h_v is not None and lin_v.dtype != h_v.dtype:
        m.compute_dtype = lin_v.dtype   # autocast: the layer ran in its dtype, wherever the loss runs
    m.dead = [m.anchor] + [d for d in m.dead if d is not m.anchor] + chain + [m.linear]
    return ""


def _fmt_index(idx: Any) -> str:
    if not isinstance(idx, tuple):
        idx = (idx,)

    def one(i):
        if i is Ellipsis:
            return "..."
        if isinstance(i, slice):
            return f"{'' if i.start is None else i.start}:{'' if i.stop is None else i.stop}" + (
                f":{i.step}" if i.step is not None else "")
        return str(i)

    return "[" + ", ".join(one(i) for i in idx) + "]"


def _is_reshape(k: Node) -> bool:
    return (k.op == "call_method" and k.target in _VIEW_METHODS) or (
        k.op == "call_function" and k.target in (_VIEW_FNS | {operator.getitem}))


def check_escapes(m: CEMatch) -> str:
    """Interior nodes used outside the pattern: allowed once, as a graph output after all transforms."""
    interior = set(m.dead)
    escapes = []
    for n in m.dead:
        if n is m.anchor:
            continue
        outside = [u for u in n.users if u not in interior]
        if outside:
            escapes.append((n, outside))
    if not escapes:
        return ""
    if len(escapes) > 1:
        return "several intermediate logits tensors are used outside the loss"
    n, outside = escapes[0]
    if n in m.loss_nodes:
        return f"the loss's log-softmax ('{n.name}') is used outside the loss"
    mut = next((u for u in outside if is_mutation(u)), None)
    if mut is not None:
        return f"the logits ('{n.name}') are modified in place by '{mut.name}'"
    if any(u.op != "output" for u in outside):
        other = next(u for u in outside if u.op != "output")
        return (f"the logits ('{n.name}') also feed other computation ('{other.name}'): cut CE would "
                "compute them twice; treated as a plain cross_entropy site instead")
    # nodes from the linear layer down to the escaping node: transforms and casts only (no view/slice)
    between, stack = set(), [n]
    while stack:
        k = stack.pop()
        if k in between or k not in interior:
            continue
        between.add(k)
        stack.extend(k.all_input_nodes)
    if any(_is_reshape(k) for k in between if k is not m.linear):
        return (f"the returned logits ('{n.name}') are a reshaped/sliced view; cut CE can only return "
                "the linear layer's (transformed) output")
    below = interior - between - set(m.loss_nodes)
    if any(scalar_factor(k) is not None or (canon(k) is not None and canon(k)[0] == "tanh") for k in below):
        return "the returned logits are taken before the temperature/soft-cap that the loss applies"
    if any(op == "slice" for op, _ in m.row_ops):
        # the loss reads fewer rows than are returned (``logits[..., :-1, :]`` for the next-token shift):
        # the op computes every row and the dropped ones get ignore_index targets
        tv = tensor_val(m.target)
        if tv is None or tv.dtype.is_floating_point:
            return ("the returned logits are taken before a row slice and the targets are probabilities "
                    "(rows cannot be ignored)")
        m.pad_rows = True
    m.escape = n
    ev = tensor_val(n)
    shape = "x".join(str(d) for d in ev.shape) if ev is not None else "?"
    m.note = (f"logits {shape} {str(ev.dtype).replace('torch.', '') if ev is not None else ''} are also a graph "
              "output: written once by the op and kept (they are returned); no fp32 copy, log-softmax or "
              "logits-gradient buffer")
    if m.pad_rows:
        m.note += "; every row is computed (returned), the rows the loss slices off get ignore_index"
    return ""




__all__ = ["CEMatch", "loss_call", "walk_to_linear", "check_escapes"]
