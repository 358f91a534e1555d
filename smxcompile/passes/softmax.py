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

from ..options import SmxOptions
from ..report import Site, user_location
from .graph_utils import (
    replace_anchor,
    canon,
    cast_dtype,
    depends_on_random,
    is_number,
    mutation_inside,
    norm_dim,
    single_user,
    stack_trace,
    tensor_val,
)

_FLOAT = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_POINTWISE_NAMES = {"exp", "log", "tanh", "sub", "add", "mul", "div"}


@dataclasses.dataclass
class SoftmaxMatch:
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
    action: str = "rewritten"
    reason: str = ""
    device: str = "?"
    prefix: str = ""                      # "wrap_body_0/" for a site inside a subgraph

    @property
    def key(self) -> str:
        """Unique name of the site across a graph and its subgraphs (``check`` and ``skip`` use it)."""
        return self.prefix + self.anchor.name

    def detail(self) -> str:
        parts = [self.spelling, f"dim={self.dim}"]
        parts += self.absorbed
        return ", ".join(p for p in parts if p)

    def to_site(self, graph_tag: str) -> Site:
        return Site(
            kind=self.kind,
            action=self.action,
            reason=self.reason,
            location=user_location(stack_trace(self.anchor)),
            op=f"smx::{self.kind}" if self.action == "rewritten" else "",
            detail=self.detail(),
            graph=graph_tag,
            node=self.key,
        )


# --------------------------------------------------------------------------- matching


def _call_softmax(node: Node) -> SoftmaxMatch | None:
    c = canon(node)
    if c is None or c[0] not in ("softmax", "log_softmax"):
        return None
    name, a = c
    x = a.get("input")
    xv = tensor_val(x)
    if xv is None:
        return None
    m = SoftmaxMatch(kind=name, anchor=node, x=x, dim=-1, spelling=_spelling(node))
    dim = norm_dim(a.get("dim"), xv.dim())
    if dim is None:
        m.action, m.reason = "skipped", f"dim={a.get('dim')!r} is not a single int dim (implicit-dim softmax is deprecated)"
        return m
    m.dim = dim
    dtype = a.get("dtype")
    if dtype is not None:
        if not isinstance(dtype, torch.dtype) or dtype not in _FLOAT:
            m.action, m.reason = "skipped", f"dtype={dtype!r} unsupported"
            return m
        if dtype != xv.dtype and (dtype == torch.float64 or not xv.dtype.is_floating_point
                                  or not _holds(dtype, xv.dtype)):
            # torch casts the input to dtype first: keep that rounding (fp32 -> fp16, fp16 -> bf16,
            # bf16 -> fp16 overflow), and the fp64 math the user asked for (the op computes in fp32
            # unless its input is fp64)
            m.pre_cast = dtype
        m.out_dtype = dtype
        m.absorbed.append(f"dtype={str(dtype).replace('torch.', '')}")
    return m


def _holds(wide: torch.dtype, narrow: torch.dtype) -> bool:
    """Every value of ``narrow`` is exactly representable in ``wide``."""
    w, n = torch.finfo(wide), torch.finfo(narrow)
    return w.eps <= n.eps and w.max >= n.max and w.smallest_normal <= n.smallest_normal


def _same_dim_reduction(node: Any, name: str, x: Node, dim: int) -> bool:
    """``node`` is ``name(x, dim, keepdim=True)`` (``max`` through ``[0]`` / ``.values``)."""
    if not isinstance(node, Node):
        return False
    if name == "max":
        if node.op != "call_function" or node.target is not operator.getitem or node.args[1] != 0:
            return False
        node = node.args[0]
    c = canon(node)
    if c is None:
        return False
    cname, a = c
    if name == "max" and cname not in ("max",):
        return False
    if name != "max" and cname != name:
        return False
    xv = tensor_val(x)
    return a.get("input") is x and a.get("keepdim") is True and xv is not None and norm_dim(a.get("dim"), xv.dim()) == dim


def _reduction(node: Any, name: str) -> tuple[Node, int] | None:
    """If ``node`` is ``name(y, dim, keepdim=True)`` return ``(y, dim)``."""
    c = canon(node) if isinstance(node, Node) else None
    if c is None or c[0] != name:
        return None
    a = c[1]
    y = a.get("input")
    yv = tensor_val(y)
    if yv is None or a.get("keepdim") is not True or a.get("dtype") is not None:
        return None
    d = norm_dim(a.get("dim"), yv.dim())
    return None if d is None else (y, d)


def _strip_detach(node: Any) -> Any:
    c = canon(node) if isinstance(node, Node) else None
    return c[1]["input"] if c and c[0] == "detach" else node


def _max_shifted(u: Node, dim: int) -> tuple[Node, list[Node]] | None:
    """``u == x - max(x, dim, keepdim)`` -> ``(x, [sub, max nodes])``; else None."""
    c = canon(u)
    if c is None or c[0] != "sub":
        return None
    x, m = c[1].get("input"), _strip_detach(c[1].get("other"))
    if not isinstance(x, Node):
        return None
    for red in ("amax", "max"):
        if _same_dim_reduction(m, red, x, dim):
            nodes = [u, c[1].get("other")]
            if c[1].get("other") is not m:
                nodes.append(m)
            if red == "max":
                nodes.append(m.args[0])
            return x, nodes
    return None


def _exp_base(e: Node, dim: int) -> tuple[Node, list[Node], bool] | None:
    """``e == exp(x - max)`` or ``exp(x)`` -> ``(x, interior nodes, shifted)``."""
    c = canon(e)
    if c is None or c[0] != "exp":
        return None
    u = c[1].get("input")
    if not isinstance(u, Node):
        return None
    shifted = _max_shifted(u, dim)
    if shifted is not None:
        return shifted[0], [e] + shifted[1], True
    return u, [e], False


def _same_expr(a: Node, b: Node) -> bool:
    """Two nodes that compute the same thing (same target and args, no side effects)."""
    if a is b:
        return True
    if a.op != b.op or a.target != b.target or a.kwargs != b.kwargs or len(a.args) != len(b.args):
        return False
    for x, y in zip(a.args, b.args):
        if isinstance(x, Node) and isinstance(y, Node):
            if not _same_expr(x, y):
                return False
        elif x != y:
            return False
    return True


def _handwritten_softmax(node: Node) -> SoftmaxMatch | None:
    """``e / e.sum(dim, keepdim=True)`` with ``e = exp(x [- max(x)])``."""
    c = canon(node)
    if c is None or c[0] != "div":
        return None
    e, s = c[1].get("input"), c[1].get("other")
    if not isinstance(e, Node) or not isinstance(s, Node):
        return None
    red = _reduction(s, "sum")
    if red is None:
        return None
    e2, dim = red
    if not isinstance(e2, Node) or not _same_expr(e, e2):
        return None
    base = _exp_base(e, dim)
    if base is None:
        return None
    x, interior, shifted = base
    xv = tensor_val(x)
    if xv is None or xv.dtype not in _FLOAT:
        return None
    interior = interior + [s] + ([] if e2 is e else _exp_base(e2, dim)[1])
    m = SoftmaxMatch(kind="softmax", anchor=node, x=x, dim=dim,
                     spelling="exp(x - max)/sum" if shifted else "exp(x)/sum")
    m.dead = _dedupe(interior)
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
                sm.dead = _dedupe(sm.dead + [inner])
                return sm
        return None
    if c[0] != "sub":
        return None
    a, b = c[1].get("input"), c[1].get("other")
    if not isinstance(a, Node) or not isinstance(b, Node):
        return None
    red = _reduction(b, "logsumexp")
    if red is not None:
        y, dim = red
        if y is a:
            xv = tensor_val(a)
            if xv is None or xv.dtype not in _FLOAT:
                return None
            m = SoftmaxMatch(kind="log_softmax", anchor=node, x=a, dim=dim, spelling="x - logsumexp(x)")
            m.dead = [b]
            return m
        return None
    cl = canon(b)
    if cl is None or cl[0] != "log":
        return None
    s = cl[1].get("input")
    red = _reduction(s, "sum")
    if red is None:
        return None
    e, dim = red
    base = _exp_base(e, dim) if isinstance(e, Node) else None
    if base is None:
        return None
    x, interior, shifted = base
    # a must be the exp's argument: x - max(x) when shifted, else x
    exp_arg = canon(e)[1]["input"]
    if not _same_expr(a, exp_arg):
        return None
    xv = tensor_val(x)
    if xv is None or xv.dtype not in _FLOAT:
        return None
    dead = interior + [b, s]
    if a is not exp_arg:
        dead += [a] + (_max_shifted(a, dim) or (None, []))[1]
    m = SoftmaxMatch(kind="log_softmax", anchor=node, x=x, dim=dim,
                     spelling="(x - max) - log(sum(exp))" if shifted else "x - log(sum(exp(x)))")
    m.dead = _dedupe(dead)
    return m


def _dedupe(nodes: list[Node]) -> list[Node]:
    out, seen = [], set()
    for n in nodes:
        if isinstance(n, Node) and n not in seen:
            seen.add(n)
            out.append(n)
    return out


def _spelling(node: Node) -> str:
    if node.op == "call_method":
        return f"Tensor.{node.target}"
    mod = getattr(node.target, "__module__", "") or ""
    name = getattr(node.target, "__name__", str(node.target))
    if "functional" in mod:
        return f"F.{name}"
    if name.startswith("special_"):
        return f"torch.special.{name[len('special_'):]}"
    return f"torch.{name}"


# --------------------------------------------------------------------------- neighbours


def _absorb_neighbours(m: SoftmaxMatch) -> None:
    """Take the prologue (mask add, soft-cap, scale, up-casts) and the epilogue cast into the op."""
    if m.pre_cast is not None:
        return  # torch rounds the input to a narrower dtype: leave the chain alone
    x = m.x
    out_shape = _static_shape(tensor_val(x))
    # additive mask: x = scores + mask (only with static shapes: no guards on symbolic sizes here)
    c = canon(x)
    if c is not None and c[0] == "add" and single_user(x) and out_shape is not None:
        a, b = c[1].get("input"), c[1].get("other")
        av, bv = tensor_val(a), tensor_val(b)
        if (av is not None and bv is not None and av.dtype.is_floating_point and bv.dtype.is_floating_point
                and _static_shape(av) is not None and _static_shape(bv) is not None):
            scores, mask = (a, b) if _static_shape(av) == out_shape else (b, a)
            sv, mv = tensor_val(scores), tensor_val(mask)
            # the mask must not promote the scores' dtype (bf16 scores + fp32 mask is an fp32 softmax)
            if (_static_shape(sv) == out_shape and _broadcasts_into(_static_shape(mv), out_shape)
                    and not mv.requires_grad and sv.dtype == tensor_val(x).dtype):
                m.mask, m.x = mask, scores
                m.dead.append(x)
                m.absorbed.append("mask")
                x = scores
    # soft-cap: c * tanh(y / c)
    capped = _softcap(x)
    if capped is not None:
        y, cap, nodes = capped
        m.softcap, m.x = cap, y
        m.dead.extend(nodes)
        m.absorbed.append(f"softcap={cap:g}")
        x = y
    # scale / temperature: y * s, s * y, y / s (up to two levels)
    for _ in range(2):
        c = canon(x)
        if c is None or c[0] not in ("mul", "div") or not single_user(x):
            break
        a, b = c[1].get("input"), c[1].get("other")
        if c[0] == "mul" and is_number(a) and isinstance(b, Node):
            a, b = b, a
        if not isinstance(a, Node) or not is_number(b) or b == 0:
            break
        if tensor_val(a) is None or tensor_val(a).dtype not in _FLOAT:
            break
        m.scale = m.scale * float(b) if c[0] == "mul" else m.scale / float(b)
        m.dead.append(x)
        m.x = x = a
    if m.scale != 1.0:
        m.absorbed.append(f"scale={m.scale:.6g}")
    # up-cast of the input: y.float() / y.to(torch.float32)
    dt = cast_dtype(x)
    if dt is not None and single_user(x):
        src = tensor_val(x.args[0])
        if src is not None and src.dtype in _FLOAT and src.dtype.itemsize <= dt.itemsize and dt in _FLOAT:
            m.dead.append(x)
            m.x = x.args[0]
            if src.dtype != dt:  # a no-op cast (.float() on fp32) is dropped without a mention
                m.absorbed.append(f"cast {_dt(src.dtype)}->{_dt(dt)}")
            if m.out_dtype is None:
                m.out_dtype = dt
    # the cast after: softmax(x).to(dtype)
    anchor = m.anchor
    if single_user(anchor):
        user = next(iter(anchor.users))
        dt = cast_dtype(user)
        if dt is not None and dt in _FLOAT and user.args[0] is anchor:
            before = tensor_val(anchor).dtype
            m.dead.append(anchor)
            m.anchor = user
            m.out_dtype = dt
            if dt != before:
                m.absorbed.append(f"cast out->{_dt(dt)}")


def _dt(d: torch.dtype) -> str:
    return str(d).replace("torch.", "")


def _static_shape(v: torch.Tensor | None) -> tuple[int, ...] | None:
    """The shape as plain ints, or None when any size is symbolic (dynamic shapes)."""
    if v is None or any(not isinstance(s, int) for s in v.shape):
        return None
    return tuple(v.shape)


def _broadcasts_into(small: tuple, big: tuple) -> bool:
    try:
        return tuple(torch.broadcast_shapes(small, big)) == big
    except Exception:
        return False


def _softcap(x: Node) -> tuple[Node, float, list[Node]] | None:
    """``c * tanh(y / c)`` (or ``tanh(y / c) * c``, ``tanh(y * (1/c)) * c``) -> ``(y, c, nodes)``."""
    c = canon(x)
    if c is None or c[0] != "mul" or not single_user(x):
        return None
    a, b = c[1].get("input"), c[1].get("other")
    t, cap = (a, b) if isinstance(a, Node) else (b, a)
    if not is_number(cap) or not isinstance(t, Node) or not single_user(t) or cap <= 0:
        return None
    ct = canon(t)
    if ct is None or ct[0] != "tanh":
        return None
    d = ct[1].get("input")
    cd = canon(d) if isinstance(d, Node) else None
    if cd is None or not single_user(d):
        return None
    y, k = cd[1].get("input"), cd[1].get("other")
    if cd[0] == "div" and is_number(k) and abs(float(k) - float(cap)) <= 1e-12 * abs(float(cap)):
        return y, float(cap), [x, t, d]
    if cd[0] == "mul" and is_number(k) and abs(float(k) * float(cap) - 1.0) <= 1e-6:
        return y, float(cap), [x, t, d]
    return None


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


def find_softmax_sites(graph: Graph, options: SmxOptions, skip: frozenset[str] = frozenset(),
                       prefix: str = "", exclude: set | frozenset = frozenset()) -> list[SoftmaxMatch]:
    """Every softmax / log-softmax site of ``graph``, each with the action the backend will take.

    Pure analysis: the graph is not changed. ``prefix`` names the subgraph (``"wrap_body_0/"``)
    in each match's ``key``; ``skip`` holds keys of sites to keep.
    """
    functorch = _functorch_op(graph)
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
        m.prefix = prefix
        if m.action == "rewritten" and functorch is not None:
            m.action, m.reason = "skipped", (
                f"the graph runs a torch.func transform ('{functorch}'); smx ops have no functorch rules yet"
            )
        elif m.action == "rewritten":
            _decide(m, options, skip)
        matches.append(m)
    matches.reverse()
    return matches


#: Shortest row (columns) from which ATen's CPU softmax, called through the op, beat Inductor's
#: generated C++ (2 cores, docs/PERFORMANCE.md): an inference softmax wins from 16K-column rows
#: (0.78x at 256x16384, 0.87x at 64x32000); a training step (forward + backward) and log-softmax
#: only from 128K columns (0.58-0.88x at 16x131072 and 8x262144); below that the op's fixed
#: dispatch cost (~10 us) and the unfused backward make it as slow or slower.
CPU_MIN_COLUMNS_INFERENCE = 16384
CPU_MIN_COLUMNS = 131072


def _cpu_row_too_short(m: SoftmaxMatch) -> str:
    """Why a plain CPU site is kept (empty: rewrite it)."""
    xv = tensor_val(m.x)
    cols = xv.shape[m.dim] if xv.dim() else 1
    if not isinstance(cols, int):
        return "CPU: row length is symbolic (dynamic shapes); Inductor's C++ softmax is kept (options cpu='rewrite' forces it)"
    inference = m.kind == "softmax" and not xv.requires_grad
    need = CPU_MIN_COLUMNS_INFERENCE if inference else CPU_MIN_COLUMNS
    if cols >= need:
        return ""
    return (
        f"CPU: rows of {cols} columns; Inductor's C++ {m.kind} was measured as fast as smx's CPU path below "
        f"{need} columns{' in inference' if inference else ' (training or log-softmax)'} "
        "(docs/PERFORMANCE.md; options cpu='rewrite' forces it)"
    )


def _functorch_op(graph: Graph) -> str | None:
    """The first torch.func (functorch) transform op of ``graph`` (grad / vmap / jvp nesting), if any."""
    for n in graph.nodes:
        if n.op == "call_function":
            mod = getattr(n.target, "__module__", "") or ""
            name = getattr(n.target, "__name__", "")
            if "functorch" in mod or name.endswith("_increment_nesting") or name in ("_wrap_for_grad", "_add_batch_dim"):
                return name or str(n.target)
    return None


def _decide(m: SoftmaxMatch, options: SmxOptions, skip: frozenset[str]) -> None:
    xv = tensor_val(m.x)
    m.device = xv.device.type
    if xv.dtype not in _FLOAT:
        m.action, m.reason = "skipped", f"input dtype {xv.dtype} is not floating point"
        return
    if depends_on_random(m.x):
        m.action, m.reason = "skipped", "input is built from random noise (Gumbel-softmax): not a deterministic softmax"
        return
    # every interior node must be used only inside the pattern
    interior = set(m.dead)
    for n in m.dead:
        if n is m.anchor:
            continue
        outside = [u for u in n.users if u not in interior and u is not m.anchor]
        if outside:
            m.action, m.reason = "skipped", f"intermediate '{n.name}' is also used outside the softmax"
            return
    _absorb_neighbours(m)
    mutated = mutation_inside(m.anchor, m.dead)
    if mutated is not None:
        m.action, m.reason = "skipped", (
            f"in-place op '{mutated.name}' runs between the softmax's first input read and its output; "
            "the fused op reads its inputs once, later"
        )
        return
    if not options.enabled(m.kind):
        m.action, m.reason = "kept", f"rewrite kind '{m.kind}' disabled by options"
        return
    if m.key in skip:
        m.action, m.reason = "kept", (
            "check failed: the rewrite disagreed with eager on the example inputs, or they could not be run "
            "(symbolic shapes after a recompile for a new shape, checkpoint regions; the log says which)"
        )
        return
    if _is_attention(m) and not options.attention_softmax:
        m.action, m.reason = "kept", (
            "attention softmax (QK^T -> softmax -> V) that the attention rewrite did not take; "
            "Inductor compiles it (options attention_softmax=True forces a standalone smx::softmax)"
        )
        return
    if m.device == "cpu":
        if options.cpu == "keep":
            m.action, m.reason = "kept", "options cpu='keep'"
        elif options.cpu == "auto":
            if not _is_plain(m):
                m.action, m.reason = "kept", (
                    "CPU: Inductor fuses the neighbouring ops into its C++ softmax loop, faster than an "
                    "unfused call (benchmarks/bench_softmax.py; options cpu='rewrite' forces it)"
                )
            else:
                why = _cpu_row_too_short(m)
                if why:
                    m.action, m.reason = "kept", why
        return
    if m.device != "cuda":
        m.action, m.reason = "kept", f"device '{m.device}' has no smx kernel"


# --------------------------------------------------------------------------- rewriting


def rewrite_softmax(graph: Graph, m: SoftmaxMatch) -> None:
    """Replace ``m.anchor`` by ``smx::softmax`` / ``smx::log_softmax`` and delete the dead interior."""
    op = torch.ops.smx.softmax.default if m.kind == "softmax" else torch.ops.smx.log_softmax.default
    with graph.inserting_before(m.anchor):
        x = m.x
        if m.pre_cast is not None:
            x = graph.call_method("to", (x, m.pre_cast))
            x.meta.update(m.anchor.meta)
        call = graph.call_function(op, (x, m.dim, float(m.scale), m.softcap, m.mask, m.out_dtype, False))
        out = graph.call_function(operator.getitem, (call, 0))
    replace_anchor(graph, m.anchor, call, out, m.dead)
