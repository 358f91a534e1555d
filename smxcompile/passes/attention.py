"""Attention sites: every spelling of ``softmax(q @ k^T * scale + mask) @ v`` becomes one fused attention call.

Matched in the Dynamo (pre-grad) graph, from the value matmul ``P @ V`` (the anchor) upwards:

* the value matmul: ``torch.matmul`` / ``@`` / ``torch.bmm`` / ``Tensor.matmul``, with the weights first;
* between softmax and it: dtype casts (``.to``, ``.type``, ``.type_as``, ``.float()``) and dropout
  (``F.dropout`` / ``nn.Dropout``; ``p`` taken into the op when training, dropped otherwise);
* the softmax over the last (key) dim, any spelling ``F.softmax`` / ``torch.softmax`` / ``Tensor.softmax``,
  with ``dtype=`` (Llama: ``softmax(x, dim=-1, dtype=torch.float32)``) or an up-cast around it (T5);
* masks: an additive float mask ``scores + mask`` (also a learned bias such as T5's position bias, which
  keeps its gradient), ``scores.masked_fill(mask, value)`` and ``torch.where(keep, scores, value)`` with
  a masking value (``-inf`` or any number <= -1e4, e.g. ``torch.finfo(dtype).min``);
* logit soft-capping ``c * tanh(s / c)``; the scale as a Python number (``* 0.125``, ``/ 8``,
  ``/ math.sqrt(d)``) or a 0-d tensor (``/ torch.full([], d ** 0.5)``), or already folded into q;
* the score matmul ``q @ k.transpose(-2, -1)`` (also ``k.transpose(2, 3)`` on 4-D, ``k.mT``, a permute
  that swaps only the last two dims, ``torch.bmm(q, k.transpose(1, 2))`` on 3-D), or
  ``einsum("...qd,...kd->...qk", q, k)`` with ``einsum("...qk,...kd->...qd", p, v)``;
* grouped-query attention: K and V repeated per query head by ``kv[:, :, None].expand(...).reshape(...)``
  (transformers' ``repeat_kv``) or ``repeat_interleave(n, dim=1)`` are taken un-repeated (``enable_gqa``);
* ``F.scaled_dot_product_attention`` itself (kept as it is unless a normalizer is requested).

A constant mask (built from ``arange`` comparisons only, as transformers builds its causal mask when no
padding mask is given) is evaluated at compile time; when it is exactly the causal lower triangle the
site becomes ``is_causal=True`` and the mask disappears, so the fused kernel skips the masked tiles.

Not matched (tested near-misses): K permuted (e.g. ``k.permute(0, 2, 3, 1)``) rather than transposed
in its last two dims, a softmax over any dim but the key dim, a mask computed from the scores, the
weights also used elsewhere (``output_attentions``), a ``masked_fill`` value that does not mask (> -1e4),
mixed q/k/v dtypes.

Fully masked rows keep the original graph's values: eager softmax gives NaN on a row of ``-inf`` and a
uniform average on a row of finite masking values, where fused attention (SDPA) gives 0; the rewrite
adds the fix-up for such rows unless the mask provably has none (a causal mask, a finite ``where`` mask).

The rewritten site calls :func:`graph_attention`, which calls :func:`smxcompile.attention`:
``F.scaled_dot_product_attention`` (torch's fused flash kernels, CPU and CUDA) for softmax, the
``smx::attention`` op (Triton on CUDA, a query-chunked CPU path) for the other normalizers and softcap.
FlashAttention: Dao et al., "FlashAttention: Fast and Memory-Efficient Exact Attention with IO-Awareness"
(2022); online softmax: Milakov & Gimelshein (2018).
"""

from __future__ import annotations

import dataclasses
import math
import operator
from typing import Any

import torch
import torch.nn.functional as F
from torch.fx import Graph, Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..options import SmxOptions
from ..report import Site, user_location
from .graph_utils import (canon, cast_dtype, is_mutation, is_number, is_random, mutation_inside, norm_dim, replace_anchor,
                          stack_trace, tensor_val, val)

_FLOAT = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

#: A ``masked_fill`` / ``where`` value at or below this masks a score: exp(value - row max) underflows
#: to exactly 0 in fp32 for any row max above ``MASK_VALUE + 104``.
MASK_VALUE = -1e4
#: Fewest keys from which a CPU softmax attention is rewritten by default (options cpu="auto"): with
#: shorter rows torch's fused CPU kernel measured no faster than Inductor's unfused code (GPT-2 / Llama,
#: batch 8: 0.99-1.07x Inductor at 128 and 256 tokens, 0.90-0.99x at 512, 0.46-0.80x at 1024-4096;
#: benchmarks/bench_attention.py, docs/PERFORMANCE.md).
CPU_MIN_KEYS = 512

#: Largest constant mask (elements) evaluated at compile time to look for a causal pattern.
MAX_CONST_MASK = 1 << 26

_MATMUL_FNS = {operator.matmul, torch.matmul, torch.bmm}
_MATMUL_METHODS = {"matmul", "bmm", "__matmul__"}
_DROPOUT_FNS = {F.dropout, torch.dropout, torch.nn.functional.dropout}
_VIEWISH = {"view", "reshape"}


@dataclasses.dataclass
class AttentionMatch:
    anchor: Node                          # the P @ V matmul (or the SDPA call)
    softmax: Node | None = None
    q: Node | None = None
    k: Node | None = None                 # (..., Hkv, S, E): un-transposed, un-repeated
    v: Node | None = None
    n_rep: int = 1                        # query heads per kv head (GQA), when K/V were taken un-repeated
    scale: float = 1.0
    scale_tensors: list = dataclasses.field(default_factory=list)   # [(node, "mul" | "div")]
    softcap: float | None = None
    add_masks: list = dataclasses.field(default_factory=list)       # additive float masks (Nodes)
    masked: list = dataclasses.field(default_factory=list)          # [(bool node, True if True means masked, value)]
    is_causal: bool = False
    dropout_p: float = 0.0
    fixup: str = ""                       # "" | "auto": restore eager's values on fully masked rows
    sdpa_kwargs: dict = dataclasses.field(default_factory=dict)     # for an F.scaled_dot_product_attention site
    spelling: str = ""
    absorbed: list[str] = dataclasses.field(default_factory=list)
    dead: list[Node] = dataclasses.field(default_factory=list)
    action: str = "rewritten"
    reason: str = ""
    device: str = "?"
    prefix: str = ""
    normalizer: str = "softmax"
    norm_param: float | None = None
    kind: str = "attention"
    dropped: list = dataclasses.field(default_factory=list)   # mask / value nodes the op no longer reads
    owned: bool = False                   # kept by the CPU policy: the block (softmax included) is left whole

    @property
    def key(self) -> str:
        return self.prefix + self.anchor.name

    @property
    def is_sdpa(self) -> bool:
        """The site is an ``F.scaled_dot_product_attention`` call (not an eager spelling)."""
        return self.anchor.target is F.scaled_dot_product_attention

    def detail(self) -> str:
        parts = [self.spelling]
        if self.is_causal:
            parts.append("causal")
        parts += self.absorbed
        if self.n_rep > 1:
            parts.append(f"GQA {self.n_rep} q heads per kv head")
        if self.normalizer != "softmax":
            parts.append(f"normalizer={self.normalizer}")
        return ", ".join(p for p in parts if p)

    def to_site(self, graph_tag: str) -> Site:
        return Site(kind=self.kind, action=self.action, reason=self.reason,
                    location=user_location(stack_trace(self.anchor)),
                    op="smx::attention" if self.action == "rewritten" else "", detail=self.detail(),
                    graph=graph_tag, node=self.key)


# --------------------------------------------------------------------------- small readers


def _is_matmul(n: Any) -> bool:
    """A matmul (``@``, ``matmul``, ``bmm``) or an einsum with the score or value-matmul shape."""
    if not isinstance(n, Node):
        return False
    if n.op == "call_function":
        if n.target is torch.einsum:
            return _einsum_kind(n) is not None
        return n.target in _MATMUL_FNS and len(n.args) == 2 and not n.kwargs
    return n.op == "call_method" and n.target in _MATMUL_METHODS and len(n.args) == 2 and not n.kwargs


def _einsum_kind(n: Node) -> tuple[str, Node, Node] | None:
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


def _shape(n: Any) -> tuple | None:
    v = tensor_val(n)
    return None if v is None else tuple(v.shape)


def _eq(a: Any, b: Any) -> bool:
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    try:
        return bool(statically_known_true(a == b))
    except Exception:
        return False


def _same_shape(a: tuple | None, b: tuple | None) -> bool:
    return a is not None and b is not None and len(a) == len(b) and all(_eq(x, y) for x, y in zip(a, b))


def _static(shape: tuple | None) -> bool:
    return shape is not None and all(isinstance(s, int) for s in shape)


def _broadcasts_to(small: tuple | None, big: tuple | None) -> bool:
    if small is None or big is None or len(small) > len(big):
        return False
    for s, b in zip(reversed(small), reversed(big)):
        if not (_eq(s, 1) or _eq(s, b)):
            return False
    return True


def _transposed_last2(kt: Node) -> tuple[Node | None, str]:
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


def _number_or_const(x: Any) -> float | None:
    """A Python number, or a 0-d constant tensor node (``torch.full([], v)``, ``torch.tensor(v)``)."""
    if is_number(x):
        return float(x)
    if isinstance(x, Node):
        v = tensor_val(x)
        if v is not None and v.dim() == 0:
            c = _const_eval(x)
            if c is not None:
                return float(c)
    return None


#: Values of constant nodes evaluated during one ``find_attention_sites`` call (cleared at its end, so
#: no evaluated mask outlives the analysis or rides along in the graph's metadata).
_CONST_CACHE: dict = {}


def _evaluable(node: Node) -> bool:
    """A pure torch / operator call that may be run at compile time (no mutation, no randomness, no I/O)."""
    if is_random(node) or is_mutation(node):
        return False
    if node.op == "call_method":
        return isinstance(node.target, str) and not node.target.startswith("_") or node.target in (
            "__getitem__", "__and__", "__or__", "__invert__", "__xor__")
    mod = getattr(node.target, "__module__", "") or ""
    name = getattr(node.target, "__name__", "")
    if node.target in (torch.finfo, torch.iinfo) or name in ("item", "tolist", "manual_seed"):
        return node.target in (torch.finfo, torch.iinfo)
    return mod in ("_operator", "operator") or mod == "torch" or mod.startswith(("torch._C._VariableFunctions",
                                                                                 "torch.functional", "torch._refs",
                                                                                 "torch.nn.functional"))


def _const_eval(node: Node, budget: list | None = None) -> Any:
    """The value of ``node`` when it is computed from constants only (no graph input, no random), else None.

    Evaluated once per node on the real device with torch itself; tensors larger than
    :data:`MAX_CONST_MASK` elements are not evaluated."""
    if node in _CONST_CACHE:
        return _CONST_CACHE[node]
    budget = budget if budget is not None else [256]
    out = _const_eval_uncached(node, budget)
    _CONST_CACHE[node] = out
    return out


def _const_eval_uncached(node: Node, budget: list) -> Any:
    budget[0] -= 1
    if budget[0] < 0 or node.op not in ("call_function", "call_method"):
        return None
    v = tensor_val(node)
    if v is not None and (not _static(tuple(v.shape)) or v.numel() > MAX_CONST_MASK):
        return None
    if not _evaluable(node):
        return None
    missing = object()

    def ev(a):
        if isinstance(a, Node):
            r = _const_eval(a, budget)
            return missing if r is None else r
        if isinstance(a, (list, tuple)):
            items = [ev(x) for x in a]
            return missing if any(x is missing for x in items) else type(a)(items)
        if isinstance(a, slice):
            parts = [ev(a.start), ev(a.stop), ev(a.step)]
            return missing if any(x is missing for x in parts) else slice(*parts)
        if isinstance(a, dict):
            items = {k: ev(x) for k, x in a.items()}
            return missing if any(x is missing for x in items.values()) else items
        return a

    args, kwargs = ev(tuple(node.args)), ev(dict(node.kwargs))
    if args is missing or kwargs is missing:
        return None
    try:
        with torch.no_grad():
            if node.op == "call_method":
                return getattr(args[0], node.target)(*args[1:], **kwargs)
            return node.target(*args, **kwargs)
    except Exception:
        return None


def _depends_on(node: Any, target: Node, limit: int = 4096) -> bool:
    """``target`` is an ancestor of (or is) ``node``."""
    if not isinstance(node, Node):
        return False
    seen, stack = set(), [node]
    while stack and limit > 0:
        n = stack.pop()
        if n is target:
            return True
        if n in seen:
            continue
        seen.add(n)
        limit -= 1
        stack.extend(n.all_input_nodes)
    return limit <= 0   # unknown: say yes


def _ungqa(n: Node) -> tuple[Node, int] | None:
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
    if not _eq(uv.shape[h + 1], 1):
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
    if not isinstance(reps, int) or not _eq(kvv.shape[h] * reps, v.shape[h]):
        return None
    for i in range(v.dim()):
        if i != h and not _eq(kvv.shape[i], v.shape[i]):
            return None
    return kv, reps


# --------------------------------------------------------------------------- matching


def _dropout(n: Node) -> tuple[Node, float, bool] | None:
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


def _softmax_call(n: Node) -> tuple[Node, Any, Any] | None:
    c = canon(n)
    if c is None or c[0] != "softmax":
        return None
    return c[1].get("input"), c[1].get("dim"), c[1].get("dtype")


def _match_from_pv(anchor: Node) -> AttentionMatch | None:
    """Walk up from a ``P @ V`` matmul; None when P does not come from a softmax."""
    if anchor.target is torch.einsum:
        kind = _einsum_kind(anchor)
        if kind is None or kind[0] != "pv":
            return None
        p, v = kind[1], kind[2]
    else:
        p, v = anchor.args
    dead: list[Node] = [anchor]
    chain: list[Node] = []
    dropout = None
    n = p
    for _ in range(6):   # casts and dropout between softmax and the value matmul
        if not isinstance(n, Node):
            return None
        if _softmax_call(n) is not None:
            break
        d = _dropout(n)
        if d is not None and dropout is None:
            chain.append(n)
            dropout = d
            n = d[0]
            continue
        if cast_dtype(n) is not None:
            chain.append(n)
            n = n.args[0]
            continue
        return None
    else:
        return None
    sm = n
    x, dim, sm_dtype = _softmax_call(sm)
    m = AttentionMatch(anchor=anchor, softmax=sm, v=v)
    m.dead = dead + chain + [sm]
    if dropout is not None:
        _, pdrop, training = dropout
        if training and pdrop > 0:
            m.dropout_p = pdrop
            m.absorbed.append(f"dropout p={pdrop:g}")
            if pdrop >= 1.0:
                return _skip(m, "dropout p=1 zeroes every weight: left to Inductor")
    if not isinstance(x, Node) or tensor_val(x) is None:
        return _skip(m, "the softmax input has no shape information")
    nd = tensor_val(x).dim()
    d = norm_dim(dim, nd)
    if d is None or d != nd - 1:
        return _skip(m, f"softmax over dim={dim!r}, not the key (last) dim")
    if sm_dtype is not None and (sm_dtype not in _FLOAT or tensor_val(x).dtype.itemsize > sm_dtype.itemsize):
        return _skip(m, f"softmax dtype={sm_dtype} narrows its input")
    # walk up the score chain: casts, masks, softcap, scale, until the score matmul
    n = x
    stages: list[tuple[str, Any]] = []
    for _ in range(16):
        if not isinstance(n, Node) or n.op in ("placeholder", "get_attr"):
            return None   # the scores come from outside the graph: nothing says this is attention
        if _is_matmul(n):
            break
        dt = cast_dtype(n)
        if dt is not None:
            src = tensor_val(n.args[0])
            if src is None or dt not in _FLOAT or src.dtype.itemsize > dt.itemsize:
                return _skip(m, f"the scores are cast down to {dt} before the softmax")
            stages.append(("cast", n))
            n = n.args[0]
            continue
        step = None if is_mutation(n) else (_mask_stage(n) or _softcap_stage(n) or _scale_stage(n))
        if step is None and is_mutation(n):
            return _skip(m, f"in-place op '{n.name}' ({n.target}) on the scores: not matched "
                            "(write it out of place, e.g. s = s + mask)")
        if step is None:
            if not _matmul_upstream(n, 4):
                return None   # softmax(...) @ W without a score matmul: not attention
            c = canon(n)
            return _skip(m, f"'{n.name}' ({c[0] if c else n.target}) between the scores and the softmax is not "
                            "a scale, soft-cap, mask or cast")
        kind, payload, nxt = step
        stages.append((kind, (n, payload)))
        n = nxt
    else:
        return _skip(m, "too many ops between the scores and the softmax")
    qk = n
    if qk.target is torch.einsum:
        kind = _einsum_kind(qk)
        if kind is None or kind[0] != "qk":
            return _skip(m, "the scores come from an einsum that is not q k^T")
        m.q, m.k = kind[1], kind[2]
        m.dead += [qk]
        m.spelling = "einsum(q, k)"
        return _assemble(m, stages, qk)
    q, kt = qk.args
    k, why = _transposed_last2(kt) if isinstance(kt, Node) else (None, "K^T is not a tensor")
    if k is None:
        return _skip(m, why)
    m.q, m.k = q, k
    m.dead += [qk, kt]
    m.spelling = "bmm(q, k^T)" if qk.target in (torch.bmm, "bmm") else "matmul(q, k^T)"
    return _assemble(m, stages, qk)


def _matmul_upstream(n: Any, depth: int) -> bool:
    if not isinstance(n, Node) or depth < 0:
        return False
    return _is_matmul(n) or any(_matmul_upstream(a, depth - 1) for a in n.all_input_nodes)


def _skip(m: AttentionMatch, why: str) -> AttentionMatch:
    m.action, m.reason = "skipped", why
    return m


def _mask_stage(n: Node):
    """``s + mask`` -> ("add", mask, s); ``s.masked_fill(b, v)`` -> ("fill", (b, True, v), s);
    ``where(keep, s, v)`` -> ("fill", (keep, False, v), s); ``where(b, v, s)`` -> ("fill", (b, True, v), s)."""
    c = canon(n)
    if c is not None and c[0] == "add":
        a, b = c[1].get("input"), c[1].get("other")
        if isinstance(a, Node) and isinstance(b, Node):
            ra, rb = _reaches_matmul(a), _reaches_matmul(b)
            if ra == rb:
                return None    # two score tensors, or no scores at all
            return ("add", (a, b), a if ra else b)
        return None
    return _mask_stage_fill(n)


def _mask_stage_fill(n: Node):
    if (n.op == "call_method" and n.target == "masked_fill") or (n.op == "call_function" and n.target is torch.masked_fill):
        if len(n.args) == 3 and not n.kwargs:
            return ("fill", (n.args[1], True, n.args[2]), n.args[0])
        return None
    if n.op == "call_function" and n.target is torch.where and len(n.args) == 3 and not n.kwargs:
        cond, a, b = n.args
        av, bv = tensor_val(a), tensor_val(b)
        a_full = av is not None and av.dim() > 0 and _same_shape(tuple(av.shape), _shape(n))
        b_full = bv is not None and bv.dim() > 0 and _same_shape(tuple(bv.shape), _shape(n))
        if a_full and not b_full:
            return ("fill", (cond, False, b), a)
        if b_full and not a_full:
            return ("fill", (cond, True, a), b)
    return None


def _reaches_matmul(n: Any, depth: int = 12) -> bool:
    """``n`` is computed from a matmul through the ops a score chain may hold (casts, scale, mask, soft-cap)."""
    if not isinstance(n, Node) or depth < 0:
        return False
    if _is_matmul(n):
        return True
    if cast_dtype(n) is not None:
        return _reaches_matmul(n.args[0], depth - 1)
    c = canon(n)
    if c is not None and c[0] in ("add", "mul", "div", "tanh", "sub"):
        return any(_reaches_matmul(a, depth - 1) for a in (c[1].get("input"), c[1].get("other")))
    st = _mask_stage_fill(n)
    if st is not None:
        return _reaches_matmul(st[2], depth - 1)
    return False


def _scale_stage(n: Node):
    c = canon(n)
    if c is None or c[0] not in ("mul", "div"):
        return None
    a, b = c[1].get("input"), c[1].get("other")
    if c[0] == "mul" and not isinstance(a, Node) and isinstance(b, Node):
        a, b = b, a
    if not isinstance(a, Node):
        return None
    if is_number(b):
        if b == 0 or not math.isfinite(b):
            return None
        return ("scale", float(b) if c[0] == "mul" else 1.0 / float(b), a)
    bv = tensor_val(b)
    if isinstance(b, Node) and bv is not None and bv.dim() == 0:
        if c[0] == "mul":
            # a 0-d tensor times the scores: either operand can be the 0-d one
            av = tensor_val(a)
            if av is not None and av.dim() == 0:
                a, b = b, a
        return ("scale_t", (b, c[0]), a)
    if c[0] == "mul":
        av = tensor_val(a)
        if av is not None and av.dim() == 0 and isinstance(b, Node):
            return ("scale_t", (a, "mul"), b)
    # a symbolic Python number (dynamic shapes: ``head_dim ** -0.5`` turned into a graph input)
    if isinstance(b, Node) and isinstance(val(b), (torch.SymFloat, torch.SymInt)):
        return ("scale_t", (b, c[0]), a)
    if c[0] == "mul" and isinstance(val(a), (torch.SymFloat, torch.SymInt)) and isinstance(b, Node):
        return ("scale_t", (a, "mul"), b)
    return None


def _softcap_stage(n: Node):
    from .cross_entropy import _softcap_at

    r = _softcap_at(n)
    if r is None:
        return None
    y, cap, inner = r
    return ("softcap", (cap, inner), y)


def _assemble(m: AttentionMatch, stages: list, qk: Node) -> AttentionMatch:
    """Turn the score chain (softmax-side first) into the op's scale / softcap / masks, or skip."""
    seen_mask = seen_cap = False
    # walk from the matmul downwards: scale* softcap? scale* mask* cast*  (scale after a mask scales the mask)
    order = list(reversed(stages))
    phase = 0   # 0: scale/cast before softcap, 1: after softcap, 2: masks, 3: trailing casts
    for kind, payload in order:
        if kind == "cast":
            node = payload
            m.dead.append(node)
            continue
        node, data = payload
        m.dead.append(node)
        if kind in ("scale", "scale_t"):
            if phase >= 2:
                return _skip(m, "the scores are scaled after the mask is applied")
            if kind == "scale":
                m.scale *= data
            else:
                t, op = data
                if _depends_on(t, qk):
                    return _skip(m, "the scale depends on the scores")
                c = _number_or_const(t)
                if c is not None and c != 0 and math.isfinite(c):
                    m.scale = m.scale * c if op == "mul" else m.scale / c
                else:
                    m.scale_tensors.append((t, op))
            continue
        if kind == "softcap":
            if phase >= 1 or seen_cap:
                return _skip(m, "soft-capping after another soft-cap or a mask")
            cap, inner = data
            m.softcap = cap
            m.dead += inner
            seen_cap = True
            phase = 1
            continue
        if kind == "add":
            a, b = data
            # the scores side is the one the chain came through: the previous stage's node
            prev = _prev_node(order, node, qk)
            mask = b if a is prev else a if b is prev else None
            if mask is None:
                return _skip(m, f"cannot tell the scores from the mask in '{node.name}'")
            mv, sv = tensor_val(mask), tensor_val(node)
            if mv is None or not mv.dtype.is_floating_point:
                return _skip(m, "the additive mask is not a floating-point tensor")
            if _depends_on(mask, qk):
                return _skip(m, "the mask depends on the scores")
            if not _broadcasts_to(tuple(mv.shape), tuple(sv.shape)):
                return _skip(m, "the mask does not broadcast to the scores")
            if mv.dtype != sv.dtype and mv.dtype.itemsize > tensor_val(qk).dtype.itemsize:
                return _skip(m, f"the {mv.dtype} mask promotes the {tensor_val(qk).dtype} scores")
            if m.masked:
                return _skip(m, "an additive mask after a masked_fill")
            m.add_masks.append(mask)
            phase = 2
            seen_mask = True
            continue
        if kind == "fill":
            cond, true_masks, value = data
            cv = tensor_val(cond)
            if cv is None or cv.dtype != torch.bool:
                return _skip(m, "the masked_fill / where condition is not a bool tensor")
            if _depends_on(cond, qk):
                return _skip(m, "the mask depends on the scores")
            if not _broadcasts_to(tuple(cv.shape), _shape(node)):
                return _skip(m, "the mask does not broadcast to the scores")
            val = _number_or_const(value)
            if val is None:
                return _skip(m, "the masked_fill / where value is not a constant")
            if not (val <= MASK_VALUE):
                return _skip(m, f"the masked_fill / where value {val:g} does not mask (needs -inf or <= {MASK_VALUE:g})")
            m.masked.append((cond, true_masks, val))
            if isinstance(value, Node):
                m.dropped.append(value)
            phase = 2
            seen_mask = True
            continue
    if m.scale != 1.0:
        m.absorbed.append(f"scale={m.scale:.6g}")
    if m.scale_tensors:
        m.absorbed.append("runtime scale folded into q")
    if m.softcap is not None:
        m.absorbed.append(f"softcap={m.softcap:g}")
    if seen_mask:
        m.absorbed.append("mask" if len(m.add_masks) + len(m.masked) == 1 else "masks")
    return m


def _prev_node(order: list, node: Node, qk: Node) -> Node:
    """The chain node just above ``node`` (towards the score matmul)."""
    prev = qk
    for kind, payload in order:
        cur = payload if kind == "cast" else payload[0]
        if cur is node:
            return prev
        prev = cur
    return prev


def _match_sdpa(n: Node) -> AttentionMatch | None:
    if n.op != "call_function" or n.target is not F.scaled_dot_product_attention:
        return None
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    a = dict(zip(names, n.args))
    a.update(n.kwargs)
    m = AttentionMatch(anchor=n, q=a.get("query"), k=a.get("key"), v=a.get("value"),
                       spelling="F.scaled_dot_product_attention")
    m.sdpa_kwargs = {k: a[k] for k in names[3:] if k in a}
    if a.get("is_causal"):
        m.is_causal = True
    return m


# --------------------------------------------------------------------------- checks and policy


def _check_shapes(m: AttentionMatch) -> str:
    qv, kv, vv = tensor_val(m.q), tensor_val(m.k), tensor_val(m.v)
    if qv is None or kv is None or vv is None:
        return "q, k or v has no shape information"
    if qv.dim() < 2 or kv.dim() != qv.dim() or vv.dim() != qv.dim():
        return f"q, k, v ranks {qv.dim()}, {kv.dim()}, {vv.dim()} differ"
    if not (qv.dtype == kv.dtype == vv.dtype) or qv.dtype not in _FLOAT:
        return f"mixed or non-float q/k/v dtypes ({qv.dtype}, {kv.dtype}, {vv.dtype})"
    out = tensor_val(m.anchor)
    if out is None or out.dtype != qv.dtype:
        return f"the attention output dtype {getattr(out, 'dtype', None)} differs from q's {qv.dtype}"
    if not _eq(kv.shape[-2], vv.shape[-2]) or not _eq(qv.shape[-1], kv.shape[-1]):
        return "q/k/v sizes do not line up"
    return ""


def _gqa(m: AttentionMatch) -> None:
    """Take K and V un-repeated when both were repeated per query head the same way."""
    gk, gv = _ungqa(m.k), _ungqa(m.v)
    if gk is None or gv is None or gk[1] != gv[1] or gk[1] < 2:
        return
    qv, kvv = tensor_val(m.q), tensor_val(gk[0])
    if qv.dim() < 3 or not _same_shape(tuple(qv.shape[:-3]), tuple(kvv.shape[:-3])):
        return
    m.dead += _repeat_nodes(m.k) + _repeat_nodes(m.v)
    m.k, m.v, m.n_rep = gk[0], gv[0], gk[1]


def _repeat_nodes(n: Node) -> list[Node]:
    if n.op == "call_method" and n.target == "repeat_interleave" or n.target is torch.repeat_interleave:
        return [n]
    e = n.args[0]
    return [n, e, e.args[0]]


def _causal_or_const(m: AttentionMatch) -> None:
    """A constant mask that is exactly the causal lower triangle becomes ``is_causal``."""
    if len(m.add_masks) + len(m.masked) != 1:
        return
    qv, kv = tensor_val(m.q), tensor_val(m.k)
    L, S = qv.shape[-2], kv.shape[-2]
    if not isinstance(L, int) or not isinstance(S, int):
        return
    if m.add_masks:
        c = _const_eval(m.add_masks[0])
        if not isinstance(c, torch.Tensor):
            return
        if not bool(torch.isfinite(c).all()) and not bool((c == float("-inf")).logical_or(torch.isfinite(c)).all()):
            return
        if bool((c == 0).all()):
            m.dropped += m.add_masks
            m.add_masks = []
            m.absorbed = [a for a in m.absorbed if a != "mask"] + ["zero mask dropped"]
            return
        keep = c == 0
        masked_ok = bool(((c == 0) | (c <= MASK_VALUE)).all())
        if not masked_ok:
            return
    else:
        cond, true_masks, _ = m.masked[0]
        c = _const_eval(cond)
        if not isinstance(c, torch.Tensor):
            return
        keep = ~c if true_masks else c
    if keep.dim() < 2 or keep.shape[-2:] != (L, S) and not (keep.shape[-2] in (1, L) and keep.shape[-1] in (1, S)):
        return
    keep = keep.expand(*keep.shape[:-2], L, S).reshape(-1, L, S)
    tril = torch.ones(L, S, dtype=torch.bool, device=keep.device).tril()
    if bool((keep == tril).all()):
        m.is_causal = True
        m.dropped += list(m.add_masks) + [c for c, _, _ in m.masked]
        m.add_masks, m.masked = [], []
        m.absorbed = [a for a in m.absorbed if a not in ("mask", "masks")]


def _finite_mask(mask: Node) -> bool:
    """The additive mask provably holds no -inf (so no row can be fully -inf)."""
    c = _CONST_CACHE.get(mask)
    if isinstance(c, torch.Tensor):
        return bool(torch.isfinite(c).all())
    n = mask
    for _ in range(8):
        if n.op == "call_method" and n.target in ("expand", "view", "reshape", "contiguous", "to", "__getitem__") \
                or n.op == "call_function" and n.target is operator.getitem:
            n = n.args[0]
            if not isinstance(n, Node):
                return False
            continue
        break
    if n.op == "call_function" and n.target is torch.where and len(n.args) == 3:
        vals = [_number_or_const(a) if not isinstance(a, Node) or tensor_val(a) is None or tensor_val(a).dim() == 0
                else None for a in n.args[1:]]
        return all(v is not None and math.isfinite(v) for v in vals)
    return False


def _needs_fixup(m: AttentionMatch) -> bool:
    if m.is_causal:
        return False
    if m.masked:
        if m.add_masks:
            return True
        # constant conditions (a sliding window built from aranges): a fix-up only if some row is fully masked
        masked_any = None
        for cond, true_masks, _ in m.masked:
            c = _const_eval(cond)
            if not isinstance(c, torch.Tensor):
                return True
            c = c if true_masks else ~c
            masked_any = c if masked_any is None else masked_any | c
        return bool(masked_any.all(-1).any())
    return any(not _finite_mask(a) for a in m.add_masks)


def _functorch(graph: Graph) -> str | None:
    from .softmax import _functorch_op

    return _functorch_op(graph)


def _interior_escapes(m: AttentionMatch) -> str:
    interior = set(m.dead)
    for n in m.dead:
        if n is m.anchor:
            continue
        out = [u for u in n.users if u not in interior]
        if out:
            what = "the attention weights" if n is m.softmax or _downstream_of(n, m.softmax) else f"'{n.name}'"
            return f"{what} are also used outside the attention (e.g. output_attentions): kept"
    return ""


def _downstream_of(n: Node, sm: Node | None) -> bool:
    return sm is not None and sm in n.all_input_nodes


def _decide(m: AttentionMatch, options: SmxOptions, skip: frozenset[str], functorch: str | None) -> None:
    if m.action != "rewritten":
        return
    why = _check_shapes(m)
    if why:
        _skip(m, why)
        return
    m.device = tensor_val(m.q).device.type
    if functorch is not None:
        _skip(m, f"the graph runs a torch.func transform ('{functorch}'); smx ops have no functorch rules yet")
        return
    if not m.is_sdpa:
        why = _interior_escapes(m)
        if why:
            _skip(m, why)
            return
        mut = mutation_inside(m.anchor, m.dead)
        if mut is not None:
            _skip(m, f"in-place op '{mut.name}' runs inside the attention pattern")
            return
        _gqa(m)
        _causal_or_const(m)
        if _needs_fixup(m):
            m.fixup = "auto"
    m.normalizer, m.norm_param = options.attention_normalizer, options.attention_norm_param
    if not options.enabled("attention"):
        m.action, m.reason = "kept", "rewrite kind 'attention' disabled by options"
        return
    if m.key in skip:
        m.action, m.reason = "kept", "check failed: the rewrite disagreed with eager on the example inputs"
        return
    if m.is_sdpa and m.normalizer == "softmax":
        m.action, m.reason = "kept", "already torch's fused scaled_dot_product_attention (no normalizer requested)"
        return
    if m.device not in ("cpu", "cuda"):
        m.action, m.reason = "kept", f"device '{m.device}' has no smx kernel"
        return
    if m.device == "cpu" and options.cpu == "keep":
        m.action, m.reason, m.owned = "kept", "options cpu='keep'", True
        return
    if m.device == "cpu" and options.cpu == "auto" and m.normalizer == "softmax" and m.softcap is None:
        S = tensor_val(m.k).shape[-2]
        if not isinstance(S, int):
            from torch.fx.experimental.symbolic_shapes import optimization_hint

            S = optimization_hint(S, fallback=CPU_MIN_KEYS)
        if S < CPU_MIN_KEYS:
            m.owned = True
            m.action, m.reason = "kept", (
                f"CPU: {S} keys; below {CPU_MIN_KEYS} torch's fused attention kernel was measured no faster than "
                "Inductor's code (benchmarks/bench_attention.py; options cpu='rewrite' forces it)")
            return
    op_route = m.normalizer != "softmax" or m.softcap is not None
    masks = list(m.add_masks) + ([m.sdpa_kwargs.get("attn_mask")] if m.sdpa_kwargs else [])
    if op_route and any(tensor_val(a) is not None and tensor_val(a).requires_grad for a in masks):
        _skip(m, "the additive mask (e.g. a learned position bias) needs a gradient, which smx::attention "
                 "(normalizer or softcap) does not compute yet")


def find_attention_sites(graph: Graph, options: SmxOptions, skip: frozenset[str] = frozenset(),
                         prefix: str = "", exclude: set | frozenset = frozenset()) -> list[AttentionMatch]:
    """Every attention site of ``graph`` with the action the backend will take (pure analysis)."""
    try:
        return _find(graph, options, skip, prefix, exclude)
    finally:
        _CONST_CACHE.clear()


def _find(graph, options, skip, prefix, exclude) -> list[AttentionMatch]:
    functorch = _functorch(graph)
    out: list[AttentionMatch] = []
    claimed: set[Node] = set()
    for n in graph.nodes:
        if n in exclude or n in claimed:
            continue
        m = None
        if _is_matmul(n):
            m = _match_from_pv(n)
        elif n.op == "call_function" and n.target is F.scaled_dot_product_attention:
            m = _match_sdpa(n)
        if m is None or any(d in exclude for d in m.dead):
            continue
        m.prefix = prefix
        _decide(m, options, skip, functorch)
        if m.action == "rewritten":
            claimed.update(m.dead)
        out.append(m)
    return out


def claimed_nodes(matches: list[AttentionMatch]) -> set[Node]:
    """Nodes owned by rewritten attention sites, and by sites the CPU policy keeps whole (the softmax pass must
    leave them alone: the block is either fused or left to Inductor as written)."""
    out: set[Node] = set()
    for m in matches:
        if m.action == "rewritten" or m.owned:
            out.update(m.dead)
            out.add(m.anchor)
    return out


# --------------------------------------------------------------------------- rewriting


def graph_attention(q, k, v, add_masks, masked, scale_tensors, *, scale: float, softcap, is_causal: bool,
                    dropout_p: float, n_rep: int, fixup: str, normalizer: str, norm_param, sdpa_scale_default: bool = False):
    """What a rewritten attention site calls (traced by AOTAutograd, so torch ops end up in the graph).

    ``add_masks``: additive float masks (summed); ``masked``: ``[(bool, True-means-masked, value)]`` from
    ``masked_fill`` / ``where``; ``scale_tensors``: ``[(0-d tensor, "mul" | "div")]`` applied to the
    scores (folded into q). ``fixup="auto"`` restores the original graph's values on fully masked rows
    (NaN for -inf, the uniform average for finite masking values)."""
    for t, op in scale_tensors:
        if isinstance(t, torch.Tensor):
            t = t.to(q.dtype)
        q = q * t if op == "mul" else q / t
    squeeze = 0
    while q.dim() < 4:   # fused kernels want (B, H, L, E)
        q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
        add_masks = [mk.unsqueeze(0) if mk.dim() >= q.dim() else mk for mk in add_masks]
        masked = [(c.unsqueeze(0) if c.dim() >= q.dim() else c, t, val) for c, t, val in masked]
        squeeze += 1
    bq = torch.broadcast_shapes(q.shape[:-3], k.shape[:-3], v.shape[:-3])
    if tuple(q.shape[:-3]) != tuple(bq):
        q = q.expand(*bq, *q.shape[-3:])
    if n_rep == 1 and (k.shape[-3] != q.shape[-3] or tuple(k.shape[:-3]) != tuple(bq)):
        k = k.expand(*bq, q.shape[-3], *k.shape[-2:])
        v = v.expand(*bq, q.shape[-3], *v.shape[-2:])
    elif tuple(k.shape[:-3]) != tuple(bq):
        k = k.expand(*bq, *k.shape[-3:])
        v = v.expand(*bq, *v.shape[-3:])
    mask = None
    for mk in add_masks:
        mask = mk if mask is None else mask + mk
    all_masked = None
    if masked:
        m_any = None
        for c, true_masks, _ in masked:
            mc = c if true_masks else ~c
            m_any = mc if m_any is None else (m_any | mc)
        if mask is None:
            mask = ~m_any
        else:
            mask = mask.to(q.dtype if q.dtype != torch.float64 else mask.dtype).masked_fill(m_any, float("-inf"))
        if fixup:
            all_masked = m_any.all(-1, keepdim=True)
    if mask is not None and mask.dtype.is_floating_point and mask.dtype != q.dtype:
        mask = mask.to(q.dtype)
    if mask is not None and mask.dtype.is_floating_point and normalizer != "softmax":
        # a variant sees masking values (finfo.min...) as masked keys (-inf), as a bool mask would be:
        # softpick leaves them out of its denominator, n counts only the keys left
        mask = mask.masked_fill(mask <= MASK_VALUE, float("-inf"))
    if normalizer == "softmax" and softcap is None:
        # torch's fused flash kernels (CPU and CUDA); Inductor lowers the call to them
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal,
                                             scale=scale, enable_gqa=n_rep > 1)
    else:
        from ..kernels.attention import attention

        out = attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                        enable_gqa=n_rep > 1, softcap=softcap, normalizer=normalizer, norm_param=norm_param)
    # NaN in q or k: eager attention gives NaN rows (every row, for k); fused kernels can return 0
    # for a NaN query row. Two cheap reductions (O(L*E) and O(S*E)) keep eager's NaNs. Not in an ONNX
    # export: there attention is MatMul / Softmax / MatMul, which propagates NaN as eager does.
    from ..kernels import config

    if not config.export_ops:
        bad = q.isnan().any(-1, keepdim=True)
        kbad = k.isnan().any(-1).any(-1)
        if n_rep > 1:
            kbad = kbad.repeat_interleave(n_rep, dim=-1)
        bad = bad | kbad[..., None, None]
        out = out.masked_fill(bad, float("nan"))
    if fixup and normalizer == "softmax":
        if all_masked is not None:
            values = [val for _, _, val in masked]
            if all(math.isinf(val) for val in values):
                fill = torch.full((), float("nan"), dtype=out.dtype, device=out.device)
            else:
                vv = v.repeat_interleave(n_rep, dim=-3) if n_rep > 1 else v
                fill = vv.mean(-2, keepdim=True).to(out.dtype)
            out = torch.where(all_masked, fill, out)
        if add_masks and not masked:
            neg = None
            for mk in add_masks:
                r = (mk == float("-inf")).all(-1, keepdim=True)
                neg = r if neg is None else neg | r
            out = out.masked_fill(neg, float("nan"))
    for _ in range(squeeze):
        out = out.squeeze(0)
    return out


def graph_sdpa(q, k, v, sdpa_kwargs: dict, *, normalizer: str, norm_param):
    """A rewritten ``F.scaled_dot_product_attention`` site with a requested normalizer."""
    from ..kernels.attention import attention

    return attention(q, k, v, **sdpa_kwargs, normalizer=normalizer, norm_param=norm_param)


def rewrite_attention(graph: Graph, m: AttentionMatch) -> None:
    """Replace the site by a :func:`graph_attention` call and delete the dead pattern nodes."""
    with graph.inserting_before(m.anchor):
        if m.is_sdpa:
            call = graph.call_function(graph_sdpa, (m.q, m.k, m.v, dict(m.sdpa_kwargs)),
                                       {"normalizer": m.normalizer, "norm_param": m.norm_param})
        else:
            call = graph.call_function(graph_attention, (
                m.q, m.k, m.v, list(m.add_masks), [tuple(t) for t in m.masked], [tuple(t) for t in m.scale_tensors]), {
                "scale": float(m.scale), "softcap": m.softcap, "is_causal": m.is_causal, "dropout_p": m.dropout_p,
                "n_rep": m.n_rep, "fixup": m.fixup, "normalizer": m.normalizer, "norm_param": m.norm_param})
    replace_anchor(graph, m.anchor, call, call, [n for n in m.dead if n is not m.anchor])
    _erase_unused_pure(graph, m.dropped)


def _erase_unused_pure(graph: Graph, nodes: list) -> None:
    """Erase ``nodes`` and their ancestors once nothing uses them (pure ops only: no placeholder, no mutation)."""
    stack = [n for n in nodes if isinstance(n, Node)]
    while stack:
        n = stack.pop()
        # a node reached twice (an input of two erased nodes) is erased only once
        if getattr(n, "_erased", False) or n.graph is not graph or n.users \
                or n.op not in ("call_function", "call_method") or is_mutation(n) or is_random(n):
            continue
        ins = n.all_input_nodes
        graph.erase_node(n)
        stack.extend(ins)


def input_nodes(m: AttentionMatch) -> list[Node]:
    """Nodes whose values :func:`run_site` needs."""
    ins = [m.q, m.k, m.v, *m.add_masks, *(c for c, _, _ in m.masked), *(t for t, _ in m.scale_tensors)]
    return [n for n in ins if isinstance(n, Node)]


def run_site(m: AttentionMatch, values: dict[str, Any]):
    """Run the rewritten site on captured values (the ``check`` option)."""
    g = lambda n: values[n.name] if isinstance(n, Node) else n  # noqa: E731
    if m.is_sdpa:
        kw = {k: g(v) for k, v in m.sdpa_kwargs.items()}
        return graph_sdpa(g(m.q), g(m.k), g(m.v), kw, normalizer=m.normalizer, norm_param=m.norm_param)
    return graph_attention(g(m.q), g(m.k), g(m.v), [g(a) for a in m.add_masks],
                           [(g(c), t, val) for c, t, val in m.masked], [(g(t), op) for t, op in m.scale_tensors],
                           scale=float(m.scale), softcap=m.softcap, is_causal=m.is_causal, dropout_p=0.0,
                           n_rep=m.n_rep, fixup=m.fixup, normalizer=m.normalizer, norm_param=m.norm_param)
