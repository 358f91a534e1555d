"""Matching cross-entropy sites in the Dynamo (pre-grad) graph, where the loss is still one call.

A loss call (``F.cross_entropy``, ``nn.CrossEntropyLoss``, ``F.nll_loss(F.log_softmax(x))`` also with flattened
log-probabilities, ``F.linear_cross_entropy``) whose logits come from a linear layer (``F.linear``, ``x @ W.T``,
``matmul(x, M)``, ``addmm``) through up-casts, views of the token dims, row slices (the next-token shift),
temperature and soft-capping is a ``linear_cross_entropy`` site, replaced by cut cross-entropy (Wijmans et al.,
2024); any other cross-entropy call is a ``cross_entropy`` site, replaced by the online CE op ``smx::ce_stats``.
See docs/DESIGN.md, "Cross-entropy".
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


@dataclasses.dataclass
class _Walk:
    """What walking up the logits chain towards the linear layer has collected."""

    vocab: Any                                                  # the class dim's size
    chain: list[Node] = dataclasses.field(default_factory=list)
    slices: list = dataclasses.field(default_factory=list)     # (index, lead shape in, lead shape out), bottom-up
    scale: float = 1.0
    softcap: float | None = None
    seen_softcap: bool = False
    absorbed: list[str] = dataclasses.field(default_factory=list)


def walk_to_linear(match: CEMatch) -> str:
    """Fill the linear part of ``match`` by walking up from the CE input; returns why it is not cut CE ('' if it is)."""
    node = match.logits
    logits_val = tensor_val(node)
    if logits_val is None:
        return "logits have no recorded shape"
    if logits_val.dim() == 0 or (logits_val.dim() >= 3 and not match.classes_last):
        return f"logits of rank {logits_val.dim()}: cut CE needs (N, V) logits with the classes last"
    walk = _Walk(vocab=logits_val.shape[-1])
    for _ in range(64):
        linear = _linear(node)
        if linear is not None:
            hidden_val, out_val = tensor_val(linear[0]), tensor_val(node)
            if hidden_val is None or out_val is None or not same_size(out_val.shape[-1], walk.vocab):
                return "the linear layer's output does not keep the class dim last"
            match.linear, (match.h, match.weight, match.weight_t, match.bias) = node, linear
            # ``x @ W.T``: the transpose of W goes with the matmul (unless something else reads it)
            other = node.args[1] if node.op == "call_function" and len(node.args) == 2 else None
            if isinstance(other, Node) and other is not match.weight and other.args \
                    and other.args[0] is match.weight and len(other.users) == 1:
                walk.chain.append(other)
            break
        source, why = _step_up(node, walk)
        if why:
            return why
        walk.chain.append(node)
        node = source
        if not isinstance(node, Node):
            return "logits are not a tensor node"
    else:
        return "chain too long"
    row_ops, why = _replay_slices(tuple(tensor_val(match.linear).shape[:-1]), walk.slices)
    if why:
        return why
    match.scale, match.softcap = walk.scale, walk.softcap
    match.row_ops = row_ops
    match.absorbed = match.absorbed + walk.absorbed
    linear_val, hidden_val = tensor_val(match.linear), tensor_val(match.h)
    if linear_val is not None and hidden_val is not None and linear_val.dtype != hidden_val.dtype:
        match.compute_dtype = linear_val.dtype   # autocast: the layer ran in its dtype, wherever the loss runs
    match.dead = [match.anchor] + [d for d in match.dead if d is not match.anchor] + walk.chain + [match.linear]
    return ""


def _step_up(node: Node, walk: _Walk) -> tuple[Any, str]:
    """One node up the logits chain: ``(its input, '')`` when ``node`` is a widening cast, a view keeping the class
    dim, a row slice, a soft-cap or a scale (recorded in ``walk``); else ``(None, why it is not cut CE)``."""
    if node.op not in ("call_function", "call_method"):
        # a graph input (the model and the loss in different graphs, or a loss function compiled alone)
        return None, f"logits come from '{node.name}' ({node.op}), not a linear layer"
    if not node.args:
        return None, f"logits come from '{node.name}' ({op_label(node)}), not a linear layer"
    node_val = tensor_val(node)
    if node_val is None:
        return None, f"'{node.name}' has no recorded value"
    source = node.args[0]
    if cast_dtype(node) is not None:
        why = _cast_refusal(node)
        if why:
            return None, why
        walk.absorbed.append(f"{str(cast_dtype(node)).replace('torch.', '')} cast")
        return source, ""
    if (node.op == "call_method" and node.target in _VIEW_METHODS) or (
            node.op == "call_function" and node.target in _VIEW_FNS):
        source_val = tensor_val(source)
        if (source_val is None or source_val.dim() == 0 or node_val.dim() == 0
                or not same_size(source_val.shape[-1], walk.vocab) or not same_size(node_val.shape[-1], walk.vocab)):
            return None, f"'{node.name}' reshapes across the class dim"
        if node.target in ("contiguous", "clone") and node.kwargs:
            return None, f"'{node.name}' has unsupported arguments"
        return source, ""
    source_val = tensor_val(source) if isinstance(source, Node) else None
    index = _leading_slice(node, source_val.dim() if source_val is not None else 0)
    if index is not None:
        walk.slices.append((index, tuple(source_val.shape[:-1]), tuple(node_val.shape[:-1])))
        walk.absorbed.append("row slice " + _fmt_index(node.args[1]))
        return source, ""
    if (capped := softcap(node)) is not None:
        if walk.seen_softcap:
            return None, "two soft-caps"
        if walk.scale != 1.0:
            return None, "a scale after the soft-cap (the op scales before capping)"
        walk.seen_softcap, walk.softcap = True, capped[1]
        walk.chain.extend(capped[2][1:])   # node itself joins the chain in walk_to_linear
        walk.absorbed.append(f"softcap={capped[1]:g}")
        return capped[0], ""
    if (factor := scalar_factor(node)) is not None:
        walk.scale *= factor[1]
        walk.absorbed.append(f"scale={factor[1]:g}")
        return factor[0], ""
    label = node.target if node.op != "call_method" else "." + str(node.target)
    return None, f"logits come from '{node.name}' ({label}), not a linear layer"


def _cast_refusal(node: Node) -> str:
    """Why a dtype cast of the logits cannot be absorbed ('' for a widening float cast, which can)."""
    if widening_cast(node) is not None:
        return ""
    source, target = dtype_of(node.args[0]), cast_dtype(node)
    if source is not None and source.is_floating_point and torch.finfo(target).bits < torch.finfo(source).bits:
        return f"'{node.name}' casts the logits down ({source} -> {target})"
    if target == torch.float64:
        return f"'{node.name}' casts the logits to float64: fp64 math, which the op would do in fp32"
    return f"'{node.name}' casts the logits {source} -> {target}, which rounds them"


def _replay_slices(linear_lead: tuple, slices: list) -> tuple[list, str]:
    """The row ops that replay ``slices`` (bottom-up) on h's rows, top-down, from the linear layer's leading
    shape; a reshape of the rows before a slice is replayed too (``logits.view(-1, V)[:-1]`` slices the flattened
    rows, not h's first dim). -> ``(row_ops, '')``, or ``([], why not)``."""
    current = linear_lead
    row_ops: list = []
    for index, lead_in, lead_out in reversed(slices):
        if not same_shape(lead_in, current):
            if len(lead_in) == 1:
                row_ops.append(("flatten", None))   # the usual case: ``.view(-1, V)`` then slice; any shapes
            elif all(isinstance(d, int) for d in lead_in):
                row_ops.append(("reshape", lead_in))
            else:
                return [], "a row slice of reshaped logits with symbolic shapes"
        row_ops.append(("slice", index))
        current = lead_out
    return row_ops, ""


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
