"""Find every spelling of softmax / log-softmax in a torch-level FX graph and rewrite it to ``smx::softmax``.

Matched spellings (Dynamo graph, i.e. Inductor's pre-grad slot):

* ``F.softmax``, ``torch.softmax``, ``torch.special.softmax``, ``Tensor.softmax``, ``nn.Softmax``
  (Dynamo inlines modules), with ``dim=`` and ``dtype=``; the same for ``log_softmax``.
* hand-written: ``exp(x - x.max(d, keepdim=True)[0]) / sum(..., d, keepdim=True)``, with ``amax``,
  ``torch.max(...).values``, or without the max subtraction (the rewrite is the stable form, so a row
  that overflowed to NaN in the naive form now gives the right answer);
  ``x - x.logsumexp(d, keepdim=True)``, ``(x - m) - log(sum(exp(x - m)))`` and ``log(softmax(x))``
  as log-softmax.
* neighbours taken into the op: dtype up-casts and a multiply/divide by a Python number (scale,
  temperature) and logit soft-capping ``c * tanh(x / c)`` and an additive float mask before it;
  a floating-point cast after it.

Not matched (each a tested near-miss): a sum without ``keepdim`` (different broadcasting),
``exp(x) / exp(y).sum()`` with ``x`` and ``y`` different, an intermediate used elsewhere, a softmax whose input is
built from random numbers (Gumbel-softmax), a softmax over several dims.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import torch
from torch.fx import Graph, Node

from .patterns.arith import scalar_factor, softcap
from .patterns.casts import widening_cast
from .patterns.graph import (FLOAT_DTYPES, canon, cast_dtype, dedupe, dtype_name, replace_anchor,
                             single_user, tensor_val)
from .patterns.masks import static_additive_mask
from .patterns.softmax_call import input_problem, softmax_call
from .patterns.written_softmax import exp_base, keepdim_reduction, max_shifted, same_expr, written_softmax
from .patterns.writes import mutation_inside
from .policy import FORCE_HINT, Ladder, cpu_threshold, decide
from .protocol import Match, PassContext, RewritePass

_POINTWISE_NAMES = {"exp", "log", "tanh", "sub", "add", "mul", "div"}


@dataclasses.dataclass
class SoftmaxMatch(Match):
    kind: str                      # "softmax" | "log_softmax"
    anchor: Node                   # the node whose value the op replaces
    x: Node                        # op input (after absorbed casts)
    dim: int
    scale: float = 1.0
    softcap: float | None = None
    mask: Node | None = None
    out_dtype: torch.dtype | None = None
    pre_cast: torch.dtype | None = None   # torch's dtype= that rounds the input down first
    spelling: str = ""
    absorbed: list[str] = dataclasses.field(default_factory=list)
    dead: list[Node] = dataclasses.field(default_factory=list)   # nodes that become unused

    def detail(self) -> str:
        parts = [self.spelling, f"dim={self.dim}"]
        parts += self.absorbed
        return ", ".join(p for p in parts if p)

    def op_name(self) -> str:
        return f"smx::{self.kind}"


# --------------------------------------------------------------------------- matching


def _call_softmax(node: Node) -> SoftmaxMatch | None:
    call = softmax_call(node)
    if call is None:
        return None
    m = SoftmaxMatch(kind=call.kind, anchor=node, x=call.x, dim=call.dim, out_dtype=call.out_dtype,
                     pre_cast=call.pre_cast, spelling=call.spelling, absorbed=list(call.absorbed))
    if call.problem:
        m.skip(call.problem)
    return m


def _handwritten_softmax(node: Node) -> SoftmaxMatch | None:
    """``e / e.sum(dim, keepdim=True)`` with ``e = exp(x [- max(x)])``."""
    found = written_softmax(node)
    if found is None:
        return None
    x, dim, interior, shifted = found
    m = SoftmaxMatch(kind="softmax", anchor=node, x=x, dim=dim,
                     spelling="exp(x - max)/sum" if shifted else "exp(x)/sum")
    m.dead = interior
    return m


def _handwritten_log_softmax(node: Node) -> SoftmaxMatch | None:
    """``x - logsumexp(x)``, ``u - log(sum(exp(u)))`` with ``u = x - max(x)``, or ``log(softmax(x))``."""
    c = canon(node)
    if c is None:
        return None
    if c[0] == "log":
        inner = c[1].get("input")
        if isinstance(inner, Node) and single_user(inner):
            sm = _call_softmax(inner) or _handwritten_softmax(inner)
            if sm is not None and sm.kind == "softmax" and sm.action == "rewritten":
                sm.kind, sm.anchor = "log_softmax", node
                sm.spelling = f"log({sm.spelling})"
                sm.dead = dedupe(sm.dead + [inner])
                return sm
        return None
    if c[0] != "sub":
        return None
    a, b = c[1].get("input"), c[1].get("other")
    if not isinstance(a, Node) or not isinstance(b, Node):
        return None
    red = keepdim_reduction(b, "logsumexp")
    if red is not None:
        y, dim = red
        if y is a:
            xv = tensor_val(a)
            if xv is None or xv.dtype not in FLOAT_DTYPES:
                return None
            m = SoftmaxMatch(kind="log_softmax", anchor=node, x=a, dim=dim, spelling="x - logsumexp(x)")
            m.dead = [b]
            return m
        return None
    cl = canon(b)
    if cl is None or cl[0] != "log":
        return None
    s = cl[1].get("input")
    red = keepdim_reduction(s, "sum")
    if red is None:
        return None
    e, dim = red
    base = exp_base(e, dim) if isinstance(e, Node) else None
    if base is None:
        return None
    x, interior, shifted = base
    # a must be the exp's argument: x - max(x) when shifted, else x
    exp_arg = canon(e)[1]["input"]
    if not same_expr(a, exp_arg):
        return None
    xv = tensor_val(x)
    if xv is None or xv.dtype not in FLOAT_DTYPES:
        return None
    dead = interior + [b, s]
    if a is not exp_arg:
        dead += [a] + (max_shifted(a, dim) or (None, []))[1]
    m = SoftmaxMatch(kind="log_softmax", anchor=node, x=x, dim=dim,
                     spelling="(x - max) - log(sum(exp))" if shifted else "x - log(sum(exp(x)))")
    m.dead = dedupe(dead)
    return m


# --------------------------------------------------------------------------- neighbours


def _absorb_neighbours(m: SoftmaxMatch) -> None:
    """Take the prologue (mask add, soft-cap, scale, up-casts) and the epilogue cast into the op."""
    if m.pre_cast is not None:
        return  # torch rounds the input to a narrower dtype: leave the chain alone
    x = m.x
    # additive mask: x = scores + mask (only with static shapes: no guards on symbolic sizes here)
    split = static_additive_mask(x)
    if split is not None:
        scores, mask = split
        m.mask, m.x = mask, scores
        m.dead.append(x)
        m.absorbed.append("mask")
        x = scores
    # soft-cap: c * tanh(y / c)
    capped = softcap(x) if single_user(x) else None
    if capped is not None:
        y, cap, nodes = capped
        m.softcap, m.x = cap, y
        m.dead.extend(nodes)
        m.absorbed.append(f"softcap={cap:g}")
        x = y
    # scale / temperature: y * s, s * y, y / s (up to two levels)
    for _ in range(2):
        s = scalar_factor(x) if single_user(x) else None
        if s is None or s[1] == 0:
            break
        a, factor = s
        if tensor_val(a) is None or tensor_val(a).dtype not in FLOAT_DTYPES:
            break
        m.scale = m.scale * factor
        m.dead.append(x)
        m.x = x = a
    if m.scale != 1.0:
        m.absorbed.append(f"scale={m.scale:.6g}")
    # up-cast of the input: y.float() / y.to(torch.float32)
    up = widening_cast(x) if single_user(x) else None
    if up is not None:
        src, src_dtype, dt = up
        m.dead.append(x)
        m.x = src
        if src_dtype != dt:  # a no-op cast (.float() on fp32) is dropped without a mention
            m.absorbed.append(f"cast {dtype_name(src_dtype)}->{dtype_name(dt)}")
        if m.out_dtype is None:
            m.out_dtype = dt
    # the cast after: softmax(x).to(dtype)
    anchor = m.anchor
    if single_user(anchor):
        user = next(iter(anchor.users))
        dt = cast_dtype(user)
        if dt is not None and dt in FLOAT_DTYPES and user.args[0] is anchor:
            before = tensor_val(anchor).dtype
            m.dead.append(anchor)
            m.anchor = user
            m.out_dtype = dt
            if dt != before:
                m.absorbed.append(f"cast out->{dtype_name(dt)}")


# --------------------------------------------------------------------------- policy


def _is_attention(m: SoftmaxMatch) -> bool:
    """Scores from a matmul (through pointwise ops) and probabilities into a matmul."""

    def upstream_matmul(n: Any, depth: int) -> bool:
        if not isinstance(n, Node) or depth < 0:
            return False
        c = canon(n)
        if c is not None and c[0] == "matmul":
            return True
        if c is None and cast_dtype(n) is None and n.target not in _ATTN_PASSTHROUGH:
            return False
        return any(upstream_matmul(a, depth - 1) for a in n.all_input_nodes)

    def downstream_matmul(n: Node, depth: int) -> bool:
        for u in n.users:
            c = canon(u)
            if c is not None and c[0] == "matmul":
                return True
            if depth > 0 and (cast_dtype(u) is not None or u.target in _ATTN_PASSTHROUGH) and downstream_matmul(u, depth - 1):
                return True
        return False

    return upstream_matmul(m.x, 4) and downstream_matmul(m.anchor, 3)


_ATTN_PASSTHROUGH = {
    torch.where, torch.masked_fill, "masked_fill", "masked_fill_", torch.nn.functional.dropout, "to", "float",
    "type_as", "contiguous", operator.add, operator.mul, operator.truediv, operator.sub, torch.add, torch.mul,
    torch.div, torch.tanh, "tanh",
}


def _is_plain(m: SoftmaxMatch) -> bool:
    """Nothing absorbed and the input not made by a pointwise op Inductor would fuse into its softmax loop."""
    if m.scale != 1.0 or m.softcap is not None or m.mask is not None or m.pre_cast is not None:
        return False
    if any(a.startswith("cast") for a in m.absorbed):
        return False
    c = canon(m.x)
    return c is None or c[0] not in _POINTWISE_NAMES


def _checks(m: SoftmaxMatch, ctx: PassContext) -> str:
    m.device = tensor_val(m.x).device.type
    why = input_problem(m.x)
    if why:
        return why
    # every interior node must be used only inside the pattern
    interior = set(m.dead)
    for n in m.dead:
        if n is m.anchor:
            continue
        if any(u not in interior and u is not m.anchor for u in n.users):
            return "a value computed inside the written-out softmax (its max, exponentials or sum) is also read outside it"
    _absorb_neighbours(m)
    mutated = mutation_inside(m.anchor, m.dead)
    if mutated is not None:
        return (f"in-place op '{mutated.name}' runs between the softmax's first input read and its output; "
                "the fused op reads its inputs once, later")
    return ""


def _keep(m: SoftmaxMatch, ctx: PassContext) -> str:
    if _is_attention(m) and not ctx.options.attention_softmax:
        return ("attention softmax (QK^T -> softmax -> V) that the attention rewrite did not take; "
                "Inductor compiles it (options attention_softmax=True forces a standalone smx::softmax)")
    return ""


def _never_left_to_inductor(m: SoftmaxMatch) -> bool:
    """fp16 ``exp(x) / sum``: exp overflows fp16 above 11.1, where eager gives NaN (inf / inf) and Inductor's
    fused code 0 for the row; rewritten on every device and policy: smx::softmax gives the softmax."""
    if m.spelling == "exp(x)/sum" and tensor_val(m.x).dtype == torch.float16:
        m.absorbed.append("fp16 exp(x)/sum not left to Inductor (0 on overflow; eager NaN)")
        return True
    return False


def _cpu_keep(m: SoftmaxMatch, ctx: PassContext) -> str:
    """Why a CPU site is kept under ``cpu="auto"`` (empty: rewrite it); rules ``softmax_*`` of ``CPU_RULES``."""
    if not _is_plain(m):
        return ("CPU: Inductor fuses the neighbouring ops into its C++ softmax loop, faster than an "
                f"unfused call (benchmarks/bench_softmax.py; {FORCE_HINT})")
    xv = tensor_val(m.x)
    cols = xv.shape[m.dim] if xv.dim() else 1
    if not isinstance(cols, int):
        return f"CPU: row length is symbolic (dynamic shapes); Inductor's C++ softmax is kept ({FORCE_HINT})"
    inference = m.kind == "softmax" and not xv.requires_grad
    need = cpu_threshold("softmax_min_columns_inference" if inference else "softmax_min_columns")
    if cols >= need:
        return ""
    return (
        f"CPU: rows of {cols} columns; Inductor's C++ {m.kind} was measured as fast as smx's CPU path below "
        f"{need} columns{' in inference' if inference else ' (training or log-softmax)'} "
        f"(docs/PERFORMANCE.md; {FORCE_HINT})"
    )


_LADDER = Ladder(checks=_checks, keep=_keep, device_free=_never_left_to_inductor, cpu_keep=_cpu_keep)


# --------------------------------------------------------------------------- the pass


class SoftmaxPass(RewritePass):
    """Softmax / log-softmax -> ``smx::softmax`` / ``smx::log_softmax`` (online softmax: Milakov &
    Gimelshein, "Online normalizer calculation for softmax", 2018), with scale, soft-cap, mask and casts
    taken in. Nested sites are rewritten inside out (:attr:`repeat`)."""

    name = "softmax"
    repeat = True

    def find(self, graph: Graph, ctx: PassContext, exclude: set) -> list[SoftmaxMatch]:
        matches: list[SoftmaxMatch] = []
        claimed: set[Node] = set()
        for node in reversed(list(graph.nodes)):  # outermost patterns first (log(softmax) before softmax)
            if node in claimed or node in exclude or node.op not in ("call_function", "call_method"):
                continue
            m = _handwritten_log_softmax(node) or _call_softmax(node) or _handwritten_softmax(node)
            if m is None:
                continue
            claimed.update(m.dead)
            claimed.add(m.anchor)
            m.prefix = ctx.prefix
            decide(m, ctx, _LADDER)
            matches.append(m)
        matches.reverse()
        return matches

    def touched(self, m: SoftmaxMatch) -> set[Node]:
        # the input and the mask too: an outer site's input is an inner site's output
        return {m.anchor, m.x, m.mask, *m.dead} - {None}

    def rewrite(self, graph: Graph, m: SoftmaxMatch, ctx: PassContext) -> None:
        """Replace ``m.anchor`` by ``smx::softmax`` / ``smx::log_softmax`` and delete the dead interior."""
        with graph.inserting_before(m.anchor):
            x = m.x
            if m.pre_cast is not None:
                x = graph.call_method("to", (x, m.pre_cast))
                x.meta.update(m.anchor.meta)
            call = graph.call_function(_op(m), (x, m.dim, float(m.scale), m.softcap, m.mask, m.out_dtype, False))
            out = graph.call_function(operator.getitem, (call, 0))
        replace_anchor(graph, m.anchor, call, out, m.dead)

    def check_inputs(self, m: SoftmaxMatch) -> list[Node]:
        return [m.x] + ([m.mask] if m.mask is not None else [])

    def run_site(self, m: SoftmaxMatch, values: dict[str, Any]) -> torch.Tensor:
        x = values[m.x.name]
        if m.pre_cast is not None:
            x = x.to(m.pre_cast)
        mask = values[m.mask.name] if m.mask is not None else None
        return _op(m)(x, m.dim, float(m.scale), m.softcap, mask, m.out_dtype, False)[0]


def _op(m: SoftmaxMatch):
    return torch.ops.smx.softmax.default if m.kind == "softmax" else torch.ops.smx.log_softmax.default


__all__ = ["SoftmaxMatch", "SoftmaxPass"]
