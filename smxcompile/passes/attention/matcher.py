"""Attention sites: every spelling of ``softmax(q @ k^T * scale + mask) @ v`` becomes one fused attention call.

Matched in the Dynamo (pre-grad) graph, from the value matmul ``P @ V`` (the anchor) upwards:

* the value matmul: ``torch.matmul`` / ``@`` / ``torch.bmm`` / ``Tensor.matmul``, with the weights first;
* between softmax and it: dtype casts (``.to``, ``.type``, ``.type_as``, ``.float()``), copies (``.clone()``,
  ``.contiguous()``) and dropout (``F.dropout`` / ``nn.Dropout``; ``p`` taken into the op when training,
  dropped otherwise);
* the softmax over the last (key) dim, any spelling ``F.softmax`` / ``torch.softmax`` / ``Tensor.softmax``,
  with ``dtype=`` (Llama: ``softmax(x, dim=-1, dtype=torch.float32)``) or an up-cast around it (T5);
* masks: an additive mask ``scores + mask`` (also a learned bias such as T5's position bias, which keeps its
  gradient; in place as ``scores += bias`` or ``scores.add_(mask)`` on a fresh score tensor nothing else reads;
  a bool or integer mask takes the scores' dtype, as eager promotes it), ``scores.masked_fill(mask, value)``
  and ``torch.where(keep, scores, value)`` with a masking value (``-inf`` or any number <= -1e4, e.g.
  ``torch.finfo(dtype).min``), also followed by an additive mask (GPT-2 with a padding mask: merged into one
  additive mask); a mask may take the scores' shape (``pad.expand_as(scores)``, DistilBERT);
* logit soft-capping ``c * tanh(s / c)``; the scale as a Python number (``* 0.125``, ``/ 8``,
  ``/ math.sqrt(d)``) or a 0-d tensor (``/ torch.full([], d ** 0.5)``), or already folded into q;
* the score matmul ``q @ k.transpose(-2, -1)`` (also ``k.transpose(2, 3)`` on 4-D, ``k.mT``, a permute
  that swaps only the last two dims, ``torch.bmm(q, k.transpose(1, 2))`` on 3-D; K^T through ``.contiguous()``
  and with a scale of its own, ``(q * a) @ (k.transpose(-2, -1) * b)``), or
  ``einsum("...qd,...kd->...qk", q, k)`` with ``einsum("...qk,...kd->...qd", p, v)``;
* grouped-query attention: K and V repeated per query head by ``kv[:, :, None].expand(...).reshape(...)``
  (transformers' ``repeat_kv``) or ``repeat_interleave(n, dim=1)`` are taken un-repeated (``enable_gqa``);
* 3-D ``bmm`` attention whose scores are viewed ``(B*H, L, S) <-> (B, H, L, S)`` around the mask (MBart,
  Marian, older BART): views that regroup only the leading dims (static shapes), anywhere between the matmuls;
* ``F.scaled_dot_product_attention`` itself (kept as it is unless a normalizer is requested).

These are the spellings of PyTorch's own fused-attention patterns (torch/_inductor/fx_passes/fuse_attention.py,
``_sfdp_pattern_1`` to ``_28``) and of the transformers models that motivated them.

A constant mask (built from ``arange`` comparisons only, as transformers builds its causal mask when no
padding mask is given) is evaluated at compile time; when it is exactly the causal lower triangle the
site becomes ``is_causal=True`` and the mask disappears, so the fused kernel skips the masked tiles.

Not matched (tested near-misses): K permuted (e.g. ``k.permute(0, 2, 3, 1)``) rather than transposed
in its last two dims, a softmax over any dim but the key dim, a mask computed from the scores, the
weights also used elsewhere (``output_attentions``), a ``masked_fill`` value that does not mask (> -1e4),
mixed q/k/v dtypes, an in-place add on scores something else reads or on a view, a view that regroups the
key dim.

Fully masked rows keep the original graph's values: eager softmax gives NaN on a row of ``-inf`` and a
uniform average on a row of finite masking values, where fused attention (SDPA) gives 0; the rewrite
adds the fix-up for such rows unless the mask provably has none (a causal mask, a finite ``where`` mask).
Masks mixing fills and later additive masks (``where(causal, s, min) + mask``) merge, in graph order, into
one additive mask; a row the fills mask whole reads only the masks in eager, so its query is zeroed.

The rewritten site calls :func:`graph_attention`, which calls :func:`smxcompile.attention`:
``F.scaled_dot_product_attention`` (torch's fused flash kernels, CPU and CUDA) for softmax, the
``smx::attention`` op (Triton on CUDA, a query-chunked CPU path) for the other normalizers and softcap.
FlashAttention: Dao et al., "FlashAttention: Fast and Memory-Efficient Exact Attention with IO-Awareness"
(2022); online softmax: Milakov & Gimelshein (2018).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch.fx import Node

from ..patterns.arith import scale_stage, softcap
from ..patterns.casts import exact_cast, holds
from ..patterns.constants import ConstEvaluator, depends_on
from ..patterns.graph import FLOAT_DTYPES, broadcasts_to, canon, cast_dtype, is_mutation, is_safe_softmax, norm_dim, \
    same_shape, static_shape, tensor_val
from ..patterns.masks import MASK_VALUE, add_operands, fill_mask, is_masking_value
from ..protocol import Match
from .operands import copy_of, dropout_call, einsum_kind, fresh_tensor, inplace_add_before, inplace_add_operands, \
    is_matmul, key_side, lead_view, shape_of, softmax_input, transposed_last2, view_lead



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
    mask_order: str = ""                  # the mask stages in graph order: "a" an additive mask, "f" a fill
    safe_softmax: bool = False            # aten._safe_softmax: a row of -inf gives 0, not NaN
    lead: tuple | None = None             # leading dims q, k, v are regrouped to (views between the matmuls)
    shape_refs: list = dataclasses.field(default_factory=list)  # mask ops reading only a score node's shape

    @property
    def merged_masks(self) -> bool:
        """Fills together with additive masks, or fills with different values: the op gets one additive mask
        built in graph order with the fills' own values (a single kind of fill stays a bool mask)."""
        return bool(self.add_masks and self.masked) or len({val for _, _, val in self.masked}) > 1

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


# --------------------------------------------------------------------------- matching


def match_from_pv(anchor: Node, consts: ConstEvaluator) -> AttentionMatch | None:
    """Walk up from a ``P @ V`` matmul; None when P does not come from a softmax."""
    if anchor.target is torch.einsum:
        kind = einsum_kind(anchor)
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
        if softmax_input(n) is not None:
            break
        d = dropout_call(n)
        if d is not None and dropout is None:
            chain.append(n)
            dropout = d
            n = d[0]
            continue
        if cast_dtype(n) is not None or copy_of(n) is not None or lead_view(n) is not None:
            chain.append(n)
            n = n.args[0]
            continue
        return None
    else:
        return None
    sm = n
    x, dim, sm_dtype = softmax_input(sm)
    m = AttentionMatch(anchor=anchor, softmax=sm, v=v, safe_softmax=is_safe_softmax(sm))
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
        # Inductor's fuse_attention would take this block for attention over the last dim (pytorch#196468)
        m.guarded = d is not None and not m.safe_softmax   # smx::softmax would give NaN where it gives 0
        return _skip(m, f"softmax over dim={dim!r}, not the key (last) dim" + (
            "; its softmax is handed to Inductor as smx::softmax, which Inductor's attention fusion cannot "
            "take for attention over the last dim (pytorch#196468)" if m.guarded else ""))
    xd = tensor_val(x).dtype
    if sm_dtype is not None and (sm_dtype not in FLOAT_DTYPES or xd not in FLOAT_DTYPES or not holds(sm_dtype, xd)):
        return _skip(m, f"softmax dtype={sm_dtype} rounds its input")
    # walk up the score chain: casts, masks, softcap, scale, until the score matmul
    n = x
    stages: list[tuple[str, Any]] = []
    consumer, consumed = sm, set()
    for _ in range(16):
        if not isinstance(n, Node) or n.op in ("placeholder", "get_attr"):
            return None   # the scores come from outside the graph: nothing says this is attention
        u = None if n in consumed else inplace_add_before(n, consumer)
        if u is not None:   # ``s.add_(mask)`` as a statement: what ``consumer`` reads is s + mask
            consumed.add(n)
            stages.append(("add", (u, tuple(inplace_add_operands(u)))))
            continue
        if is_matmul(n):
            break
        consumer = n
        dt = cast_dtype(n)
        if dt is not None:
            if exact_cast(n) is None:
                return _skip(m, f"the scores are rounded by a cast to {dt} before the softmax")
            stages.append(("cast", n))
            n = n.args[0]
            continue
        if lead_view(n) is not None:   # (B*H, L, S) <-> (B, H, L, S), as 3-D bmm attention writes it
            stages.append(("view", (n, n)))
            n = n.args[0]
            continue
        if inplace_add_operands(n) is not None:
            # ``s += mask`` (T5): taken when the old s is a fresh tensor nothing else reads
            step = _mask_stage(n) if fresh_tensor(n.args[0]) and len(n.args[0].users) == 1 else None
        else:
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
        kind = einsum_kind(qk)
        if kind is None or kind[0] != "qk":
            return _skip(m, "the scores come from an einsum that is not q k^T")
        m.q, m.k = kind[1], kind[2]
        m.dead += [qk]
        m.spelling = "einsum(q, k)"
        return _assemble(m, stages, qk, consts)
    q, kt = qk.args
    kt, key_scales = key_side(kt)
    k, why = transposed_last2(kt) if isinstance(kt, Node) else (None, "K^T is not a tensor")
    if k is None:
        return _skip(m, why)
    m.q, m.k = q, k
    m.dead += [qk, kt]
    for node, kind, data in key_scales:   # (q @ (k^T * b)) = (q @ k^T) * b
        m.dead.append(node)
        if kind != "copy":
            _take_scale(m, kind, data, consts)
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
    """``s + mask`` (also ``s += mask``) -> ("add", (a, b), s); a fill (see :func:`fill_mask`) -> ("fill", (cond,
    True if True masks, value), s). The scores side of an addition is the operand computed from the score matmul."""
    pair = add_operands(n) or inplace_add_operands(n)
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
    if cast_dtype(n) is not None or lead_view(n) is not None:
        return _reaches_matmul(n.args[0], depth - 1)
    ip = inplace_add_operands(n)
    if ip is not None:
        return any(_reaches_matmul(a, depth - 1) for a in ip)
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
    level = qk                  # the node whose shape the scores have where each stage applies (views regroup)
    mask_levels: set = set()
    for kind, payload in order:
        if kind == "cast":
            node = payload
            m.dead.append(node)
            continue
        node, data = payload
        m.dead.append(node)
        if kind == "view":
            level = data
            continue
        if kind in ("add", "fill"):
            mask_levels.add(level)
        if kind in ("scale", "scale_t"):
            if phase >= 2:
                return _skip(m, "the scores are scaled after the mask is applied")
            if kind == "scale_t" and depends_on(data[0], qk):
                return _skip(m, "the scale depends on the scores")
            if seen_cap:
                # a scale after the soft-cap scales the cap: a * c * tanh(s / c) = (a c) * tanh(a s / (a c))
                a = data if kind == "scale" else consts.number(data[0])
                if kind == "scale_t" and data[1] == "div" and a:
                    a = 1.0 / a
                if a is None or not math.isfinite(a) or a <= 0:
                    return _skip(m, "a scale after the soft-cap that is not a positive number known at compile time")
                m.softcap *= a
                m.scale *= a
                continue
            _take_scale(m, kind, data, consts)
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
            if mv is None or mv.is_complex():
                return _skip(m, "the additive mask is not a real tensor")
            # a bool (0 / 1) or integer mask takes the scores' dtype, as in eager's type promotion
            if not (sv is not None and sv.dtype.is_floating_point):
                return _skip(m, "the masked scores are not floating-point")
            why = _mask_depends(m, mask, qk)
            if why:
                return _skip(m, why)
            if not broadcasts_to(tuple(mv.shape), tuple(sv.shape)):
                return _skip(m, "the mask does not broadcast to the scores")
            if mv.dtype.is_floating_point and mv.dtype != sv.dtype and mv.dtype.itemsize > tensor_val(qk).dtype.itemsize:
                return _skip(m, f"the {mv.dtype} mask promotes the {tensor_val(qk).dtype} scores")
            m.add_masks.append(mask)
            m.mask_order += "a"
            phase = 2
            seen_mask = True
            continue
        if kind == "fill":
            cond, true_masks, value = data
            cv = tensor_val(cond)
            if cv is None or cv.dtype != torch.bool:
                return _skip(m, "the masked_fill / where condition is not a bool tensor")
            why = _mask_depends(m, cond, qk)
            if why:
                return _skip(m, why)
            if not broadcasts_to(tuple(cv.shape), shape_of(node)):
                return _skip(m, "the mask does not broadcast to the scores")
            val = consts.number(value)
            if val is None:
                return _skip(m, "the masked_fill / where value is not a constant")
            if not is_masking_value(val):
                return _skip(m, f"the masked_fill / where value {val:g} does not mask (needs -inf or <= {MASK_VALUE:g})")
            m.masked.append((cond, true_masks, val))
            m.mask_order += "f"
            if isinstance(value, Node):
                m.dropped.append(value)
            phase = 2
            seen_mask = True
            continue
    if any(k == "view" for k, _ in stages) or any(lead_view(n) is not None for n in m.dead):
        why = _regroup(m, qk, mask_levels)
        if why:
            return _skip(m, why)
    if m.scale != 1.0:
        m.absorbed.append(f"scale={m.scale:.6g}")
    if m.scale_tensors:
        m.absorbed.append("runtime scale folded into q")
    if m.softcap is not None:
        m.absorbed.append(f"softcap={m.softcap:g}")
    if seen_mask:
        m.absorbed.append("mask" if len(m.add_masks) + len(m.masked) == 1 else "masks")
    return m


def _take_scale(m: AttentionMatch, kind: str, data: Any, consts: ConstEvaluator) -> None:
    """Fold one scale stage (see :func:`scale_stage`) into the site: a number, or a 0-d tensor constant at compile
    time, into ``m.scale``; any other 0-d tensor into ``m.scale_tensors`` (applied to q at run time)."""
    if kind == "scale":
        m.scale *= data
        return
    t, op = data
    c = consts.number(t)
    if c is not None and c != 0 and math.isfinite(c):
        m.scale = m.scale * c if op == "mul" else m.scale / c
    else:
        m.scale_tensors.append((t, op))


def _regroup(m: AttentionMatch, qk: Node, mask_levels: set) -> str:
    """Views regroup the leading dims between the score matmul, the masks and the value matmul: the op runs
    with q, k, v regrouped as the masks see the scores (else as V is), and returns its output grouped as V.
    Why this cannot be done, or ""."""
    vals = [tensor_val(x) for x in (m.q, m.k, m.v, qk, m.anchor)]
    if any(v is None for v in vals):
        return "views between the attention matmuls without shape information"
    qs, ks, vs, qks, outs = (tuple(v.shape[:-2]) for v in vals)
    if len(mask_levels) > 1:
        return "masks applied to the scores viewed in different shapes"
    # the views are valid in the graph and keep the last two dims, so every level holds as many (L, S)
    # slices as q; the op needs q, k and the scores grouped alike, and returns in V's grouping
    if not (same_shape(qs, ks) and same_shape(qs, qks) and same_shape(vs, outs)):
        return "q, k and v are not regrouped alike by the views between the attention matmuls"
    if not mask_levels:
        lead = vs
    else:
        level = next(iter(mask_levels))
        lead = qs if level is qk else view_lead(level)
    if lead is None:
        return "the view before the mask gives its shape in a form that cannot be replayed"
    m.lead = tuple(lead)
    m.absorbed.append("views")
    return ""


def _mask_depends(m: AttentionMatch, mask: Node, qk: Node) -> str:
    """Why ``mask`` cannot be taken into the op, or "". A mask built from the scores' shape only
    (``pad.expand_as(scores)``, DistilBERT) is not computed from the scores: such shape reads are recorded in
    ``m.shape_refs`` and rewritten without the scores when the site is (an ``expand_as`` is dropped, the mask
    broadcasting as it is; ``view_as`` / ``reshape_as`` take the static shape, ``type_as`` the dtype)."""
    refs: list[Node] = []
    if depends_on(mask, qk, shape_refs=refs):
        return "the mask depends on the scores"
    for r in refs:
        xv, tv = tensor_val(r.args[0]), tensor_val(r.args[1])
        if tv is None or xv is None:
            return "the mask takes the scores' shape, which has no shape information"
        if r.target == "expand_as" and not broadcasts_to(tuple(xv.shape), tuple(tv.shape)):
            return "the mask is expanded to the scores' shape from one that does not broadcast to it"
        if r.target in ("view_as", "reshape_as") and static_shape(tv) is None:
            return "the mask takes the scores' shape, which is symbolic (dynamic shapes)"
    m.shape_refs += [r for r in refs if r not in m.shape_refs]
    return ""


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



__all__ = ["AttentionMatch", "match_from_pv", "match_sdpa"]
