"""Cross-entropy sites: ``linear -> ... -> cross_entropy`` becomes cut cross-entropy.

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
from torch.fx import Graph, Node
from torch.fx.experimental.symbolic_shapes import optimization_hint, statically_known_true

from ..options import SmxOptions
from ..report import Site, user_location
from .graph_utils import (canon, cast_dtype, is_mutation, is_number, mutation_inside, replace_anchor, stack_trace,
                          tensor_val)

_FLOAT = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

#: Smallest vocabulary from which a CPU linear -> cross-entropy is rewritten by default: below it the
#: logits are small and Inductor's fused code is as fast (benchmarks/bench_linear_ce.py).
CPU_MIN_VOCAB = 4096

_CE_PARAMS = ("input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction", "label_smoothing")
_NLL_PARAMS = ("input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction")
_LCE_PARAMS = ("input", "linear_weight", "target")
_VIEW_METHODS = {"view", "reshape", "flatten", "contiguous", "clone"}
_VIEW_FNS = {torch.reshape, torch.flatten}


@dataclasses.dataclass
class CEMatch:
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
    action: str = "rewritten"
    reason: str = ""
    device: str = "?"
    prefix: str = ""
    note: str = ""

    @property
    def key(self) -> str:
        return self.prefix + self.anchor.name

    @property
    def op(self) -> str:
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

    def to_site(self, graph_tag: str) -> Site:
        return Site(kind=self.kind, action=self.action, reason=self.reason,
                    location=user_location(stack_trace(self.anchor)),
                    op=self.op if self.action == "rewritten" else "", detail=self.detail(), graph=graph_tag,
                    node=self.key)


def _bind(node: Node, params: tuple[str, ...]) -> dict[str, Any] | None:
    if len(node.args) > len(params):
        return None
    b = dict(zip(params, node.args))
    for k, v in node.kwargs.items():
        if k in b:
            return None
        b[k] = v
    return b


def _dtype(n: Any) -> torch.dtype | None:
    v = tensor_val(n)
    return v.dtype if v is not None else None


def _loss_call(node: Node) -> CEMatch | None:
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
    return sv is not None and nv is not None and sv.dim() >= 1 and nv.dim() >= 1 and _same(sv.shape[-1], nv.shape[-1])


def _same(a: Any, b: Any) -> bool:
    """Sizes (ints or SymInts) known to be equal, without adding a guard."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return statically_known_true(a == b)


def _same_shape(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))


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


def _scalar_of(n: Node) -> tuple[Node, float] | None:
    """``x * s``, ``s * x``, ``x / s`` with a python number -> (x, factor)."""
    c = canon(n)
    if c is None or c[0] not in ("mul", "div"):
        return None
    a, b = c[1].get("input"), c[1].get("other")
    if c[0] == "div":
        if isinstance(a, Node) and is_number(b) and b != 0:
            return a, 1.0 / float(b)
        return None
    if isinstance(a, Node) and is_number(b):
        return a, float(b)
    if isinstance(b, Node) and is_number(a):
        return b, float(a)
    return None


def _softcap_at(n: Node) -> tuple[Node, float, list[Node]] | None:
    """``c * tanh(y / c)`` ending at ``n`` -> (y, c, interior nodes [tanh, div]); ``n`` may have several users."""
    s = _scalar_of(n)
    if s is None:
        return None
    t, cap = s
    if cap <= 0 or len(t.users) != 1:
        return None
    ct = canon(t)
    if ct is None or ct[0] != "tanh" or not isinstance(ct[1].get("input"), Node):
        return None
    d = ct[1]["input"]
    inner = _scalar_of(d)
    if inner is None or len(d.users) != 1:
        return None
    y, k = inner
    if abs(k * cap - 1.0) > 1e-6:
        return None
    return y, cap, [t, d]


def _walk_to_linear(m: CEMatch) -> str:
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
    scale, softcap = 1.0, None
    seen_softcap = False
    absorbed: list[str] = []
    for _ in range(64):
        lin = _linear(n)
        if lin is not None:
            hv = tensor_val(lin[0])
            ov = tensor_val(n)
            if hv is None or ov is None or not _same(ov.shape[-1], v):
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
            return f"logits come from '{n.name}' ({n.target}), not a linear layer"
        nv = tensor_val(n)
        if nv is None:
            return f"'{n.name}' has no recorded value"
        nxt = None
        if cast_dtype(n) is not None:
            src = _dtype(n.args[0])
            if src is not None and torch.finfo(cast_dtype(n)).bits < torch.finfo(src).bits:
                return f"'{n.name}' casts the logits down ({src} -> {cast_dtype(n)})"
            nxt = n.args[0]
            absorbed.append(f"{str(cast_dtype(n)).replace('torch.', '')} cast")
        elif (n.op == "call_method" and n.target in _VIEW_METHODS) or (n.op == "call_function" and n.target in _VIEW_FNS):
            src = n.args[0]
            sv = tensor_val(src)
            if sv is None or sv.dim() == 0 or nv.dim() == 0 or not _same(sv.shape[-1], v) or not _same(nv.shape[-1], v):
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
        elif (sc := _softcap_at(n)) is not None:
            if seen_softcap:
                return "two soft-caps"
            if scale != 1.0:
                return "a scale after the soft-cap (the op scales before capping)"
            seen_softcap = True
            softcap = sc[1]
            chain.extend(sc[2])
            nxt = sc[0]
            absorbed.append(f"softcap={sc[1]:g}")
        elif (s := _scalar_of(n)) is not None:
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
        if not _same_shape(lead_in, cur):
            if len(lead_in) == 1:
                row_ops.append(("flatten", None))   # the usual case: ``.view(-1, V)`` then slice; any shapes
            elif all(isinstance(d, int) for d in lead_in):
                row_ops.append(("reshape", lead_in))
            else:
                return "a row slice of reshaped logits with symbolic shapes"
        row_ops.append(("slice", idx))
        cur = lead_out
    m.scale, m.softcap = scale, softcap
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


def _check_escapes(m: CEMatch) -> str:
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
    if any(_scalar_of(k) is not None or (canon(k) is not None and canon(k)[0] == "tanh") for k in below):
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


def _decide(m: CEMatch, options: SmxOptions, skip: frozenset[str]) -> None:
    if m.action != "rewritten":
        return
    if not isinstance(m.reduction, str) or m.reduction not in ("none", "mean", "sum"):
        m.action, m.reason = "skipped", f"reduction {m.reduction!r} is not a constant none/mean/sum"
        return
    if not isinstance(m.ignore_index, int) or isinstance(m.ignore_index, bool):
        m.action, m.reason = "skipped", "ignore_index is not a constant int"
        return
    if not is_number(m.label_smoothing):
        m.action, m.reason = "skipped", "label_smoothing is not a constant"
        return
    if m.class_weight is not None and not isinstance(m.class_weight, Node):
        m.action, m.reason = "skipped", "class weight is not a tensor"
        return
    tv = tensor_val(m.target)
    if tv is None:
        m.action, m.reason = "skipped", "target has no recorded value"
        return
    if m.kind == "cross_entropy" and m.linear is None:
        absorbed = list(m.absorbed)
        why = _walk_to_linear(m) or _check_escapes(m)
        if why:
            # not cut: the plain CE on the same logits (the walk's partial results are dropped)
            m.note = f"not cut: {why}"
            m.linear = m.h = m.weight = m.bias = m.escape = m.compute_dtype = None
            m.weight_t, m.pad_rows = False, False
            m.dead = list(m.loss_nodes)
            m.absorbed = absorbed
            m.scale, m.softcap, m.row_ops = 1.0, None, []
        else:
            m.kind = "linear_cross_entropy"
    if m.kind == "linear_cross_entropy" and m.linear is not None and m.linear is not m.anchor:
        m.dead = _dedupe(m.dead)
    lv = tensor_val(m.h if m.kind == "linear_cross_entropy" else m.logits)
    if lv is None:
        m.action, m.reason = "skipped", "input has no recorded value"
        return
    m.device = lv.device.type
    if lv.dtype not in _FLOAT:
        m.action, m.reason = "skipped", f"dtype {lv.dtype} is not floating point"
        return
    if m.kind == "cross_entropy":
        xv = tensor_val(m.logits)
        if xv is None or xv.dim() == 0:
            m.action, m.reason = "skipped", "logits have no class dim"
            return
        if xv.dim() > 2 and not m.classes_last:
            m.action, m.reason = "skipped", (f"logits of rank {xv.dim()} (classes on dim 1): the fused CE "
                                             "would copy them to put the classes last")
            return
    if m.kind == "linear_cross_entropy":
        wv = tensor_val(m.weight)
        hv = tensor_val(m.h)
        if wv is None or hv is None or wv.dtype != hv.dtype and not _autocast_in(m):
            m.action, m.reason = "skipped", "input and weight dtypes differ"
            return
    if tv.dtype.is_floating_point and tv.requires_grad:
        m.action, m.reason = "skipped", "probability targets that require grad (distillation): not supported"
        return
    # a mutation between the first pattern node and the loss could change what the op reads
    mut = mutation_inside(m.anchor, m.dead)
    if mut is not None:
        m.action, m.reason = "skipped", f"in-place op '{mut.name}' runs inside the pattern"
        return
    if not options.enabled(m.kind):
        m.action, m.reason = "kept", f"rewrite kind '{m.kind}' disabled by options"
        return
    if m.key in skip:
        m.action, m.reason = "kept", (
            "check failed: the rewrite disagreed with eager on the example inputs, or they could not be run "
            "(symbolic shapes after a recompile for a new shape, checkpoint regions; the log says which)")
        return
    if m.device == "cpu":
        if options.cpu == "keep":
            m.action, m.reason = "kept", "options cpu='keep'"
        elif options.cpu == "auto":
            if m.kind == "cross_entropy":
                m.action, m.reason = "kept", (
                    "CPU: Inductor's fused C++ cross-entropy is faster on given logits (the online CE op "
                    "measured 2.4-3x slower, docs/PERFORMANCE.md; options cpu='rewrite' forces it)")
            else:
                v = tensor_val(m.weight).shape[1 if m.weight_t else 0]
                if not isinstance(v, int):
                    # symbolic vocabulary (dynamic=True): decide on the example's size (a speed choice only)
                    v = optimization_hint(v, fallback=0)
                if v < CPU_MIN_VOCAB:
                    m.action, m.reason = "kept", (
                        f"CPU: {v} classes; below {CPU_MIN_VOCAB} the logits are small and Inductor's fused code "
                        "is as fast (options cpu='rewrite' forces it)")
        return
    if m.device != "cuda":
        m.action, m.reason = "kept", f"device '{m.device}' has no smx kernel"


def _autocast_in(m: CEMatch) -> bool:
    lv = tensor_val(m.linear)
    hv = tensor_val(m.h)
    return lv is not None and hv is not None and lv.dtype != hv.dtype


def _dedupe(nodes: list[Node]) -> list[Node]:
    seen, out = set(), []
    for n in nodes:
        if n not in seen:
            seen.add(n)
            out.append(n)
    return out


def find_ce_sites(graph: Graph, options: SmxOptions, skip: frozenset[str] = frozenset(),
                  prefix: str = "") -> list[CEMatch]:
    """Every cross-entropy site of ``graph`` with the action the backend will take (pure analysis)."""
    from .softmax import _functorch_op

    functorch = _functorch_op(graph)
    out = []
    for node in graph.nodes:
        m = _loss_call(node)
        if m is None:
            continue
        m.prefix = prefix
        if m.action == "rewritten" and functorch is not None:
            m.action, m.reason = "skipped", f"the graph runs a torch.func transform ('{functorch}')"
        _decide(m, options, skip)
        out.append(m)
    return out


def claimed_nodes(matches: list[CEMatch]) -> set[Node]:
    """Nodes that rewritten CE sites own (the softmax pass must leave them alone)."""
    return {n for m in matches if m.action == "rewritten" for n in m.dead}


# --------------------------------------------------------------------------- rewriting


def graph_linear_cross_entropy(h, weight, bias, target, class_weight, ignore_index: int, reduction: str,
                               label_smoothing: float, scale: float, softcap, loss_dtype, return_logits: bool,
                               logits_dtype, weight_t: bool, compute_dtype=None, row_ops=None):
    """What a rewritten ``linear -> cross_entropy`` site calls: -> (loss, logits or None).

    ``compute_dtype``: the dtype the linear layer ran in (autocast), applied explicitly so the result does
    not depend on whether the loss itself sits inside the autocast region. ``row_ops``: the row slices
    (and reshapes) the loss applied to the returned logits; every row of ``h`` is computed (the logits are
    returned whole) and the rows the loss dropped get ``ignore_index`` targets.
    """
    from ..kernels.common import autocast_operands
    from ..kernels.cross_entropy import linear_ce_core

    if weight_t:
        weight = weight.t()   # a (D, V) classifier (Conv1D / ``x @ M``): made row-major (V, D) below
    if compute_dtype is not None:
        h, weight, bias = (None if t is None else t.to(compute_dtype) for t in (h, weight, bias))
    else:
        h, weight, bias = autocast_operands(h, weight, bias)
    d = h.shape[-1]
    lead = tuple(h.shape[:-1])
    # row-major operands: the ops' fake implementations give the gradients the strides of input / weight,
    # the real ones contiguous tensors (``F.linear(x.t(), W)``, ``F.linear(h, M.t())``); no copy otherwise
    x2 = h.reshape(-1, d).contiguous()
    weight = weight.contiguous()
    sel = None
    if target.dtype.is_floating_point:
        tgt, probs = None, target.reshape(-1, weight.shape[0])
    else:
        tgt, probs = target.reshape(-1).long(), None
        if row_ops:
            sel = _row_ops(torch.arange(x2.shape[0], device=target.device).reshape(*lead, 1), row_ops).reshape(-1)
            tgt = torch.full((x2.shape[0],), ignore_index, dtype=torch.long, device=target.device).index_put(
                (sel,), tgt)
    if bias is not None and bias.dtype != x2.dtype:
        bias = bias.to(x2.dtype)
    loss, zl, lse, logits = linear_ce_core(x2, weight, bias, tgt, probs, class_weight, None, ignore_index, reduction,
                                           float(label_smoothing), 0.0, scale, softcap, return_logits, logits_dtype,
                                           0)  # 0: the default chunk policy
    if reduction == "none":
        if sel is not None:
            loss = loss[sel]
        loss = loss.reshape(tuple(target.shape) if probs is None else tuple(target.shape[:-1]))
    loss = loss.to(loss_dtype)
    if return_logits:
        logits = logits.reshape(*lead, weight.shape[0])
    return loss, logits


def _row_ops(x, row_ops):
    """Apply the logits chain's row reshapes / slices to ``x`` (``h``, or a row-index tensor with a trailing dim)."""
    for op, a in row_ops:
        if op == "flatten":
            x = x.flatten(0, -2)
        elif op == "reshape":
            x = x.reshape(*a, x.shape[-1])
        else:
            x = x[a]
    return x


def graph_cross_entropy(logits, target, class_weight, ignore_index: int, reduction: str, label_smoothing: float,
                        loss_dtype, classes_last: bool = False):
    """What a rewritten plain cross-entropy site calls (``F.cross_entropy`` semantics, online).

    ``classes_last``: ``logits`` (any rank) have the classes on their last dim and ``target`` holds class
    indices for its rows in order (``nll_loss(log_softmax(x, -1).view(-1, V), y)``,
    ``cross_entropy(x.transpose(1, 2), y)``); the loss has ``target``'s shape."""
    from ..kernels.cross_entropy import cross_entropy

    if classes_last:
        loss = cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), class_weight, ignore_index,
                             reduction, label_smoothing, dim=1, dtype=loss_dtype)
        return loss.reshape(target.shape) if reduction == "none" else loss
    return cross_entropy(logits, target, class_weight, ignore_index, reduction, label_smoothing,
                         dim=1 if logits.dim() >= 2 else 0, dtype=loss_dtype)


def rewrite_ce(graph: Graph, m: CEMatch) -> None:
    """Replace the loss call (and the logits chain) by the cut / online cross-entropy."""
    loss_dtype = _dtype(m.anchor)
    with graph.inserting_before(m.anchor):
        if m.kind == "linear_cross_entropy":
            h = m.h
            kwargs: dict[str, Any] = {}
            if m.compute_dtype is not None:
                kwargs["compute_dtype"] = m.compute_dtype
            if m.pad_rows:
                kwargs["row_ops"] = tuple(m.row_ops)
            else:
                for op, a in m.row_ops:
                    if op == "flatten":
                        h = graph.call_method("flatten", (h, 0, -2))
                    elif op == "reshape":
                        h = graph.call_method("reshape", (h, (*a, -1)))
                    else:
                        h = graph.call_function(operator.getitem, (h, a))
            logits_dtype = _dtype(m.escape) if m.escape is not None else None
            call = graph.call_function(graph_linear_cross_entropy, (
                h, m.weight, m.bias, m.target, m.class_weight, int(m.ignore_index), m.reduction,
                float(m.label_smoothing), float(m.scale), m.softcap, loss_dtype, m.escape is not None, logits_dtype,
                m.weight_t), kwargs)
            out = graph.call_function(operator.getitem, (call, 0))
            if m.escape is not None:
                lg = graph.call_function(operator.getitem, (call, 1))
                for k in ("example_value", "val"):
                    if k in m.escape.meta:
                        lg.meta[k] = m.escape.meta[k]
                interior = set(m.dead)
                for u in list(m.escape.users):
                    if u not in interior:
                        u.replace_input_with(m.escape, lg)
        else:
            out = graph.call_function(graph_cross_entropy, (
                m.logits, m.target, m.class_weight, int(m.ignore_index), m.reduction, float(m.label_smoothing),
                loss_dtype), {"classes_last": True} if m.classes_last else {})
            call = out
    replace_anchor(graph, m.anchor, call, out, m.dead)


def run_site(m: CEMatch, values: dict[str, Any]):
    """The rewritten site's loss on captured values (for the ``check`` option)."""
    def get(a):
        return values[a.name] if isinstance(a, Node) else a

    loss_dtype = _dtype(m.anchor)
    if m.kind == "linear_cross_entropy":
        return graph_linear_cross_entropy(_row_ops(get(m.h), m.row_ops), get(m.weight), get(m.bias), get(m.target),
                                          get(m.class_weight), int(m.ignore_index), m.reduction,
                                          float(m.label_smoothing), float(m.scale), m.softcap, loss_dtype, False, None,
                                          m.weight_t, compute_dtype=m.compute_dtype)[0]
    return graph_cross_entropy(get(m.logits), get(m.target), get(m.class_weight), int(m.ignore_index), m.reduction,
                               float(m.label_smoothing), loss_dtype, classes_last=m.classes_last)


def input_nodes(m: CEMatch) -> list[Node]:
    """Nodes whose values :func:`run_site` reads."""
    ns = [m.h, m.weight, m.bias, m.target, m.class_weight] if m.kind == "linear_cross_entropy" else [
        m.logits, m.target, m.class_weight]
    return [n for n in ns if isinstance(n, Node)]
