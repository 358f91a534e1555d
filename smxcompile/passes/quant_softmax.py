"""Find softmax -> quantize in a torch-level FX graph and lower it to ``smx::quant_softmax``.

A softmax whose output is quantized ("softmax feeding a quantizer") is computed and quantized in
one pass by ``smx::quant_softmax``: the online softmax recurrence with the quantization in the
epilogue, writing the uint8/int8 codes and never the fp32 probabilities. Quantization is the
subject of "Softmax Bias Correction for Quantized Generative Models" (Pandey et al., 2023);
:func:`smxcompile.quantize_softmax` produces such graphs (with the bias correction folded into the
dequantization scales), and so do PyTorch 2 export quantization flows.

Matched spellings (Dynamo graph), each after a ``softmax`` call (``F.softmax``, ``torch.softmax``,
``Tensor.softmax``, ``nn.Softmax``; ``dtype=`` honoured) through floating-point casts:

* ``torch.ops.quantized_decomposed.quantize_per_tensor(p, scale, zero_point, quant_min, quant_max, dtype)``
  (the QDQ ops of PyTorch 2 export quantization; the ``dequantize_*`` after it stays as it is);
* ``torch.fake_quantize_per_tensor_affine(p, scale, zero_point, quant_min, quant_max)`` -> the op +
  ``dequantize_per_tensor`` (same values: ``(q - zero_point) * scale``);
* ``torch.quantize_per_tensor(p, scale, zero_point, torch.quint8 | torch.qint8)`` used only through
  ``.dequantize()`` -> the op + ``dequantize_per_tensor``.

Not matched (reported): a tensor scale or zero point, a softmax used elsewhere too, quantization
ranges that do not fit uint8/int8, fake quantization of a tensor that requires grad (QAT has a
straight-through gradient; the op is inference-only), both fp16 and bf16 roundings on the way,
fp64 probabilities.

Placement: kept by default on CUDA too (the Triton op measured slower than Inductor's fused code:
``CUDA_RULES``; ``cuda="rewrite"`` lowers it). On CPU (``cpu="auto"``) the site is kept: Inductor already fuses
softmax, quantize and dequantize into one C++ loop, and the op's CPU path is the same math as an
opaque call (``cpu="rewrite"`` lowers it anyway).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.fx import Graph, Node

import torch.ao.quantization.fx._decomposed  # noqa: F401  (registers torch.ops.quantized_decomposed)

from ..kernels.quant_softmax import QUANT_RANGES
from .patterns.graph import cast_dtype, dtype_name, erase_dead, replace_anchor, tensor_val
from .patterns.softmax_call import softmax_call
from .policy import Ladder, find_sites
from .protocol import Match, PassContext, RewritePass

_QD = torch.ops.quantized_decomposed
_QUANTIZE = {_QD.quantize_per_tensor, _QD.quantize_per_tensor.default}
_FAKE = {torch.fake_quantize_per_tensor_affine}
_TORCH_Q = {torch.quantize_per_tensor}
_INT_DTYPES = QUANT_RANGES
_QTENSOR = {torch.quint8: torch.uint8, torch.qint8: torch.int8}
_NARROW = (torch.float16, torch.bfloat16)


@dataclasses.dataclass
class QuantMatch(Match):
    kind = "quant_softmax"
    anchor: Node                      # the quantize / fake_quantize node (the report's node)
    softmax: Node | None = None
    x: Node | None = None             # the softmax input
    dim: int = -1
    scale: float = 1.0
    zero_point: int = 0
    quant_min: int = 0
    quant_max: int = 255
    dtype: torch.dtype = torch.uint8
    prob_dtype: torch.dtype | None = None
    pre_cast: torch.dtype | None = None
    spelling: str = ""
    dequant_users: list[Node] = dataclasses.field(default_factory=list)   # torch.quantize_per_tensor's .dequantize()
    dead: list[Node] = dataclasses.field(default_factory=list)

    def detail(self) -> str:
        parts = [self.spelling, f"dim={self.dim}", f"scale={self.scale:.6g}", f"zero_point={self.zero_point}",
                 f"[{self.quant_min}, {self.quant_max}] {dtype_name(self.dtype)}"]
        if self.prob_dtype is not None:
            parts.append(f"probabilities rounded to {dtype_name(self.prob_dtype)}")
        if self.spelling == "torch.quantize_per_tensor" and self.action == "rewritten":
            # ATen casts NaN to an integer there (x86: the top code); the op writes zero_point
            parts.append("NaN probabilities (all -inf or NaN rows) -> zero_point, where eager gives a platform-dependent code")
        return ", ".join(parts)

    def op_name(self) -> str:
        return "smx::quant_softmax"

    def site_node(self) -> Node:
        return self.softmax or self.anchor


def _set(m: QuantMatch, action: str, reason: str) -> None:
    m.action, m.reason = action, reason


def _arg(node: Node, i: int, name: str, default: Any = None) -> Any:
    if name in node.kwargs:
        return node.kwargs[name]
    return node.args[i] if len(node.args) > i else default


def _match(node: Node) -> QuantMatch | None:
    """A quantizer node whose input is a softmax (through casts), or None."""
    if node.op != "call_function":
        return None
    t = node.target
    if t in _QUANTIZE:
        m = QuantMatch(anchor=node, spelling="quantized_decomposed.quantize_per_tensor")
        m.scale, m.zero_point = _arg(node, 1, "scale"), _arg(node, 2, "zero_point")
        m.quant_min, m.quant_max, m.dtype = _arg(node, 3, "quant_min"), _arg(node, 4, "quant_max"), _arg(node, 5, "dtype")
    elif t in _FAKE:
        m = QuantMatch(anchor=node, spelling="fake_quantize_per_tensor_affine")
        m.scale, m.zero_point = _arg(node, 1, "scale"), _arg(node, 2, "zero_point")
        m.quant_min, m.quant_max = _arg(node, 3, "quant_min"), _arg(node, 4, "quant_max")
        m.dtype = torch.uint8 if isinstance(m.quant_min, int) and m.quant_min >= 0 else torch.int8
    elif t in _TORCH_Q:
        m = QuantMatch(anchor=node, spelling="torch.quantize_per_tensor")
        m.scale, m.zero_point = _arg(node, 1, "scale"), _arg(node, 2, "zero_point")
        qd = _arg(node, 3, "dtype")
        if qd not in _QTENSOR:
            return None
        m.dtype = _QTENSOR[qd]
        m.quant_min, m.quant_max = _INT_DTYPES[m.dtype]
    else:
        return None
    src = node.args[0] if node.args else node.kwargs.get("input")
    if not isinstance(src, Node):
        return None
    # walk up through floating-point casts to the softmax
    chain: list[torch.dtype] = []
    cur = src
    while isinstance(cur, Node) and cast_dtype(cur) is not None:
        chain.append(cast_dtype(cur))
        m.dead.append(cur)
        cur = cur.args[0]
    if not isinstance(cur, Node):
        return None
    sm = softmax_call(cur)
    if sm is None or sm.kind != "softmax":
        return None
    m.softmax, m.x = cur, sm.x
    m.dead.append(cur)
    if sm.problem:
        _set(m, "skipped", sm.problem)
        return m
    m.dim, m.pre_cast = sm.dim, sm.pre_cast
    yv = tensor_val(cur)
    dtypes = [yv.dtype if yv is not None else torch.float32, *reversed(chain)]
    narrow = {d for d in dtypes if d in _NARROW}
    if torch.float64 in dtypes:
        _set(m, "skipped", "fp64 probabilities (the quantizer takes fp32)")
    elif len(narrow) > 1:
        _set(m, "skipped", "the probabilities are rounded to both fp16 and bf16 on the way to the quantizer")
    else:
        m.prob_dtype = next(iter(narrow)) if narrow else None
    return m


def _validate(m: QuantMatch) -> None:
    if m.action != "rewritten":
        return
    for name in ("scale", "zero_point", "quant_min", "quant_max"):
        v = getattr(m, name)
        if isinstance(v, Node) or isinstance(v, torch.Tensor):
            return _set(m, "skipped", f"{name} is a tensor (only Python numbers are lowered)")
    if not isinstance(m.scale, (int, float)) or isinstance(m.scale, bool) or not (m.scale > 0) or m.scale == float("inf"):
        return _set(m, "skipped", f"scale={m.scale!r} is not a finite number > 0")
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (m.zero_point, m.quant_min, m.quant_max)):
        return _set(m, "skipped", "zero_point / quant_min / quant_max are not ints")
    if m.dtype not in _INT_DTYPES:
        return _set(m, "skipped", f"dtype {m.dtype} is not uint8/int8")
    lo, hi = _INT_DTYPES[m.dtype]
    if not lo <= m.quant_min < m.quant_max <= hi:
        return _set(m, "skipped", f"quant range [{m.quant_min}, {m.quant_max}] does not fit {m.dtype}")
    if not m.quant_min <= m.zero_point <= m.quant_max:
        return _set(m, "skipped", f"zero_point {m.zero_point} outside [{m.quant_min}, {m.quant_max}]")


def _checks(m: QuantMatch, ctx: PassContext) -> str:
    xv = tensor_val(m.x)
    if xv is None:
        return "the softmax input has no recorded value"
    m.device = xv.device.type
    # every intermediate must feed only the next step: the op replaces the whole chain
    for n in m.dead:
        if len(n.users) != 1:
            return "the probabilities or a step of the quantizer are also used elsewhere; the fused op writes neither"
    if m.spelling == "torch.quantize_per_tensor":
        users = list(m.anchor.users)
        if not users or not all(_is_dequantize(u) for u in users):
            return "the quantized tensor is used other than by .dequantize()"
        m.dequant_users = users
    if m.spelling == "fake_quantize_per_tensor_affine" and xv.requires_grad:
        return ("fake quantization with a gradient (QAT, straight-through estimator); "
                "smx::quant_softmax is inference-only")
    return ""


def _cpu_keep(m: QuantMatch, ctx: PassContext) -> str:
    """Rule ``quant_softmax`` of ``CPU_RULES``: always kept under ``cpu="auto"``."""
    return ("CPU: Inductor fuses softmax, quantize and dequantize into one C++ loop; smx::quant_softmax's CPU path "
            "is the same math as an opaque call (options cpu='rewrite' lowers it anyway)")


# a kept site stays whole: a softmax rewritten by the softmax pass could flip a probability at a rounding tie
# of the quantizer
_LADDER = Ladder(checks=_checks, cpu_keep=_cpu_keep, keep_whole=frozenset({"disabled", "check", "cpu"}))


def _is_dequantize(n: Node) -> bool:
    return (n.op == "call_method" and n.target == "dequantize" and len(n.args) == 1 and not n.kwargs) or (
        n.op == "call_function" and n.target is torch.dequantize and len(n.args) == 1 and not n.kwargs)


def _out_dtype(m: QuantMatch) -> torch.dtype | None:
    ov = tensor_val(m.dequant_users[0] if m.dequant_users else m.anchor)
    return ov.dtype if ov is not None and ov.dtype != torch.float32 else None


class QuantSoftmaxPass(RewritePass):
    """Softmax -> (casts) -> quantize -> one ``smx::quant_softmax`` call (see the module docstring)."""

    name = "quant_softmax"

    def find(self, graph: Graph, ctx: PassContext, exclude: set) -> list[QuantMatch]:
        def match(node):
            m = _match(node)
            if m is not None:
                _validate(m)
            return m
        return find_sites(graph, ctx, exclude, match, _LADDER)

    def rewrite(self, graph: Graph, m: QuantMatch, ctx: PassContext) -> None:
        """Replace softmax -> (casts) -> quantize by one ``smx::quant_softmax`` call."""
        op = torch.ops.smx.quant_softmax.default
        with graph.inserting_before(m.anchor):
            x = m.x
            if m.pre_cast is not None:
                x = graph.call_method("to", (x, m.pre_cast))
            call = graph.call_function(op, (x, m.dim, 1.0, float(m.scale), int(m.zero_point), int(m.quant_min),
                                            int(m.quant_max), m.dtype, m.prob_dtype))
            out = call
            if m.spelling != "quantized_decomposed.quantize_per_tensor":
                out_dtype = _out_dtype(m)
                kw = {"out_dtype": out_dtype} if out_dtype is not None else {}
                out = graph.call_function(_QD.dequantize_per_tensor.default,
                                          (call, float(m.scale), int(m.zero_point), int(m.quant_min),
                                           int(m.quant_max), m.dtype), kw)
        xv = tensor_val(m.x)
        if xv is not None and out is not call:   # replace_anchor records the value of ``out`` only
            call.meta["example_value"] = torch.empty_like(xv, dtype=m.dtype, memory_format=torch.contiguous_format)
        for target in m.dequant_users or [m.anchor]:   # torch.quantize_per_tensor: its .dequantize() calls
            replace_anchor(graph, target, call, out, [])
        erase_dead(graph, [m.anchor, *m.dead])

    def check_inputs(self, m: QuantMatch) -> list[Node]:
        return [m.x]

    def check_nodes(self, m: QuantMatch) -> list[Node]:
        return [m.dequant_users[0] if m.dequant_users else m.anchor]

    def run_site(self, m: QuantMatch, values: dict[str, Any]) -> torch.Tensor:
        """The codes (``quantized_decomposed`` spelling) or the dequantized values the rewrite computes."""
        x = values[m.x.name]
        if m.pre_cast is not None:
            x = x.to(m.pre_cast)
        q = torch.ops.smx.quant_softmax.default(x, m.dim, 1.0, float(m.scale), int(m.zero_point), int(m.quant_min),
                                                int(m.quant_max), m.dtype, m.prob_dtype)
        if m.spelling == "quantized_decomposed.quantize_per_tensor":
            return q
        out_dtype = _out_dtype(m)
        return _QD.dequantize_per_tensor.default(q, float(m.scale), int(m.zero_point), int(m.quant_min),
                                                 int(m.quant_max), m.dtype,
                                                 **({"out_dtype": out_dtype} if out_dtype is not None else {}))

    def agrees(self, m: QuantMatch, ours, values: dict[str, Any], close) -> bool:
        # one quantization level apart at a rounding tie is the op's documented tie behaviour, not a disagreement
        ref = values[self.check_nodes(m)[0].name]
        if ours.shape != ref.shape:
            return False
        if m.spelling == "quantized_decomposed.quantize_per_tensor":
            return bool(((ours.int() - ref.int()).abs() <= 1).all())
        diff = (ours.float() - ref.float()).abs().nan_to_num(0.0)
        return bool(torch.equal(ours.isnan(), ref.isnan())) and bool((diff <= float(m.scale) * 1.0001).all())


__all__ = ["QuantMatch", "QuantSoftmaxPass"]
