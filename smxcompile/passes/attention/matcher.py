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
from torch.fx import Node

from ..patterns.arith import scale_stage, softcap
from ..patterns.casts import exact_cast, holds
from ..patterns.constants import ConstEvaluator, depends_on
from ..patterns.graph import FLOAT_DTYPES, broadcasts_to, canon, cast_dtype, is_mutation, norm_dim, same_size, tensor_val
from ..patterns.masks import MASK_VALUE, add_operands, fill_mask, is_masking_value
from ..protocol import Match

_MATMUL_FNS = {operator.matmul, torch.matmul, torch.bmm}
_MATMUL_METHODS = {"matmul", "bmm", "__matmul__"}
_DROPOUT_FNS = {F.dropout, torch.dropout, torch.nn.functional.dropout}
_VIEWISH = {"view", "reshape"}


@dataclasses.dataclass
class AttentionMatch(Match):
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
    normalizer: str = "softmax"
    norm_param: float | None = None
    kind: str = "attention"
    dropped: list = dataclasses.field(default_factory=list)   # mask / value nodes the op no longer reads

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

    def op_name(self) -> str:
        return "smx::attention"


# --------------------------------------------------------------------------- small readers


def is_matmul(n: Any) -> bool:
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


def match_from_pv(anchor: Node, consts: ConstEvaluator) -> AttentionMatch | None:
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
    xd = tensor_val(x).dtype
    if sm_dtype is not None and (sm_dtype not in FLOAT_DTYPES or xd not in FLOAT_DTYPES or not holds(sm_dtype, xd)):
        return _skip(m, f"softmax dtype={sm_dtype} rounds its input")
    # walk up the score chain: casts, masks, softcap, scale, until the score matmul
    n = x
    stages: list[tuple[str, Any]] = []
    for _ in range(16):
        if not isinstance(n, Node) or n.op in ("placeholder", "get_attr"):
            return None   # the scores come from outside the graph: nothing says this is attention
        if is_matmul(n):
            break
        dt = cast_dtype(n)
        if dt is not None:
            if exact_cast(n) is None:
                return _skip(m, f"the scores are rounded by a cast to {dt} before the softmax")
            stages.append(("cast", n))
            n = n.args[0]
            continue
        step = None if is_mutation(n) else (_mask_stage(n) or _softcap_stage(n) or scale_stage(n))
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
        return _assemble(m, stages, qk, consts)
    q, kt = qk.args
    k, why = _transposed_last2(kt) if isinstance(kt, Node) else (None, "K^T is not a tensor")
    if k is None:
        return _skip(m, why)
    m.q, m.k = q, k
    m.dead += [qk, kt]
    m.spelling = "bmm(q, k^T)" if qk.target in (torch.bmm, "bmm") else "matmul(q, k^T)"
    return _assemble(m, stages, qk, consts)


def _matmul_upstream(n: Any, depth: int) -> bool:
    if not isinstance(n, Node) or depth < 0:
        return False
    return is_matmul(n) or any(_matmul_upstream(a, depth - 1) for a in n.all_input_nodes)


def _skip(m: AttentionMatch, why: str) -> AttentionMatch:
    m.skip(why)
    return m


def _mask_stage(n: Node):
    """``s + mask`` -> ("add", (a, b), s); a fill (see :func:`fill_mask`) -> ("fill", (cond, True if True masks,
    value), s). The scores side of an addition is the operand computed from the score matmul."""
    pair = add_operands(n)
    if pair is not None:
        a, b = pair
        ra, rb = _reaches_matmul(a), _reaches_matmul(b)
        if ra == rb:
            return None    # two score tensors, or no scores at all
        return ("add", (a, b), a if ra else b)
    if canon(n) is not None and canon(n)[0] == "add":
        return None
    fill = fill_mask(n)
    return None if fill is None else ("fill", fill[0], fill[1])


def _reaches_matmul(n: Any, depth: int = 12) -> bool:
    """``n`` is computed from a matmul through the ops a score chain may hold (casts, scale, mask, soft-cap)."""
    if not isinstance(n, Node) or depth < 0:
        return False
    if is_matmul(n):
        return True
    if cast_dtype(n) is not None:
        return _reaches_matmul(n.args[0], depth - 1)
    c = canon(n)
    if c is not None and c[0] in ("add", "mul", "div", "tanh", "sub"):
        return any(_reaches_matmul(a, depth - 1) for a in (c[1].get("input"), c[1].get("other")))
    fill = fill_mask(n)
    if fill is not None:
        return _reaches_matmul(fill[1], depth - 1)
    return False


def _softcap_stage(n: Node):
    r = softcap(n)
    if r is None:
        return None
    y, cap, nodes = r
    return ("softcap", (cap, nodes[1:]), y)


def _assemble(m: AttentionMatch, stages: list, qk: Node, consts: ConstEvaluator) -> AttentionMatch:
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
                if depends_on(t, qk):
                    return _skip(m, "the scale depends on the scores")
                c = consts.number(t)
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
            if depends_on(mask, qk):
                return _skip(m, "the mask depends on the scores")
            if not broadcasts_to(tuple(mv.shape), tuple(sv.shape)):
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
            if depends_on(cond, qk):
                return _skip(m, "the mask depends on the scores")
            if not broadcasts_to(tuple(cv.shape), _shape(node)):
                return _skip(m, "the mask does not broadcast to the scores")
            val = consts.number(value)
            if val is None:
                return _skip(m, "the masked_fill / where value is not a constant")
            if not is_masking_value(val):
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


def match_sdpa(n: Node) -> AttentionMatch | None:
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



__all__ = ["AttentionMatch", "is_matmul", "match_from_pv", "match_sdpa", "ungqa"]
