"""What rewritten attention sites call at run time (traced by AOTAutograd, so torch's and smx's ops end up in
the graph): ``F.scaled_dot_product_attention`` (torch's fused flash kernels, CPU and CUDA; FlashAttention: Dao et
al., 2022) for softmax, :func:`smxcompile.attention` (the ``smx::attention`` op) for the other normalizers and
soft-capping, with eager's values restored on fully masked rows and for NaN inputs."""

from __future__ import annotations

import importlib
import math

import torch
import torch.nn.functional as F

from ..patterns.contraction import apply_perm
from ..patterns.masks import ABSORBING, MASK_VALUE, is_masking_value


def graph_attention(q, k, v, masks, scale_tensors, *, mask_kinds, scale: float, softcap, is_causal: bool,
                    dropout_p: float, n_rep: int, fixup: str, normalizer: str, norm_param, export: bool = False,
                    lead: tuple | None = None, safe_softmax: bool = False, layout: dict | None = None,
                    mask_floor: float | None = None):
    """A rewritten attention site (docs/DESIGN.md, "Attention"): q (..., L, E), k, v (..., S, E) after ``layout``
    (role -> permutation; ``"scores"``: masks laid out (..., S, L)), regrouped to ``lead`` first.
    ``masks`` in graph order, each with ``(how, value, shape)`` in ``mask_kinds``: added (``"add"``), subtracted
    (``"sub"``), or a bool whose True (``"fill"``) or False (``"keep"``) entries hold ``value``; applied to the
    scores viewed as ``shape`` (None: as q is grouped). ``mask_floor``: the masks clamped below there.
    ``scale_tensors``: ``[(tensor, "mul" | "div")]`` folded into q. ``fixup="auto"``: eager's values on fully
    masked rows (0 after ``_safe_softmax``); ``export``: MatMul / Softmax / MatMul semantics, no NaN fix-up."""
    layout = layout or {}
    q, k, v = (apply_perm(t, layout.get(r)) for t, r in ((q, "q"), (k, "k"), (v, "v")))
    if "scores" in layout:     # masks of scores laid out (keys, queries)
        masks = [keys_last(t) for t in masks]
    out = _attention(q, k, v, masks, mask_kinds, scale_tensors, scale=scale, softcap=softcap, is_causal=is_causal,
                     dropout_p=dropout_p, n_rep=n_rep, fixup=fixup, normalizer=normalizer, norm_param=norm_param,
                     export=export, lead=lead, safe_softmax=safe_softmax, mask_floor=mask_floor)
    return apply_perm(out, layout.get("out"))


def _attention(q, k, v, masks, mask_kinds, scale_tensors, *, scale, softcap, is_causal, dropout_p, n_rep, fixup,
               normalizer, norm_param, export, lead, safe_softmax, mask_floor):
    v_lead = None
    if lead is not None:
        v_lead = v.shape[:-2]
        q, k, v = (t.reshape(*lead, *t.shape[-2:]) for t in (q, k, v))
    add_masks, masked, mask_order = _split_masks(masks, mask_kinds, (*(lead or ()), q.shape[-2], k.shape[-2]),
                                                 dtype=q.dtype)
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
    if mask_floor is not None and add_masks:
        q, add_masks = _floored(q, add_masks, mask_floor)
    bq = torch.broadcast_shapes(q.shape[:-3], k.shape[:-3], v.shape[:-3])
    if tuple(q.shape[:-3]) != tuple(bq):
        q = q.expand(*bq, *q.shape[-3:])
    if n_rep == 1 and (k.shape[-3] != q.shape[-3] or tuple(k.shape[:-3]) != tuple(bq)):
        k = k.expand(*bq, q.shape[-3], *k.shape[-2:])
        v = v.expand(*bq, q.shape[-3], *v.shape[-2:])
    elif tuple(k.shape[:-3]) != tuple(bq):
        k = k.expand(*bq, *k.shape[-3:])
        v = v.expand(*bq, *v.shape[-3:])
    mask = hidden = None     # hidden: the entries a masked_fill / where selects away (True = not seen)
    if mask_order:
        q, mask, filled = _merged_mask(q, add_masks, masked, mask_order,
                                       zero_dead_rows=bool(fixup) and normalizer == "softmax" and not export)
        masked, hidden = [], filled
    else:
        for mk in add_masks:
            mk = mk if mk.is_floating_point() else mk.to(q.dtype)
            mask = mk if mask is None else mask + mk
    all_masked = None
    if masked:
        m_any = None
        for c, true_masks, _ in masked:
            mc = c if true_masks else ~c
            m_any = mc if m_any is None else (m_any | mc)
        hidden = m_any
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
        mask = mask.masked_fill(is_masking_value(mask), float("-inf"))
    if not export:
        q_bad, k, k_bad = _nonfinite_rows(q, k, hidden, is_causal, n_rep)
    if normalizer == "softmax" and softcap is None:
        # torch's fused flash kernels (CPU and CUDA); Inductor lowers the call to them
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal,
                                             scale=scale, enable_gqa=n_rep > 1)
    else:
        from ...kernels.attention import attention

        out = attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                        enable_gqa=n_rep > 1, softcap=softcap, normalizer=normalizer, norm_param=norm_param)
    if not export:
        out = out.masked_fill(q_bad | k_bad, float("nan"))
    if fixup and normalizer == "softmax":
        empty_row = 0.0 if safe_softmax else float("nan")    # a row of -inf
        if all_masked is not None:
            values = [val for _, _, val in masked]
            if all(math.isinf(val) for val in values):
                fill = torch.full((), empty_row, dtype=out.dtype, device=out.device)
            else:
                vv = v.repeat_interleave(n_rep, dim=-3) if n_rep > 1 else v
                fill = vv.mean(-2, keepdim=True).to(out.dtype)
            out = torch.where(all_masked, fill, out)
        if mask_order:
            out = out.masked_fill((mask == float("-inf")).all(-1, keepdim=True), empty_row)
        elif add_masks and not masked:      # the masks' sum in q's dtype, as eager adds them
            out = out.masked_fill((mask == float("-inf")).all(-1, keepdim=True), empty_row)
    for _ in range(squeeze):
        out = out.squeeze(0)
    return out if v_lead is None else out.reshape(*v_lead, *out.shape[-2:])


def _split_masks(masks, mask_kinds, shape: tuple, *, dtype):
    """``(additive masks, fills as (bool, True if True masks, value), mask_order)``; ``mask_order`` (``"a"`` an
    add, ``"f"`` a fill, in graph order) only where fills meet additive masks or fills differ in value: then all
    merge into one additive mask. A mask on a view of the scores is regrouped to ``shape``."""
    add_masks, masked, order = [], [], ""
    for t, (how, value, view) in zip(masks, mask_kinds, strict=True):
        t = t if view is None else t.expand(view).reshape(shape)
        if how in ("add", "sub"):
            add_masks.append(t if how == "add" else -(t if t.is_floating_point() else t.to(dtype)))
        else:
            masked.append((t, how == "fill", value))
        order += "a" if how in ("add", "sub") else "f"
    merged = bool(add_masks and masked) or len({val for *_, val in masked}) > 1
    return add_masks, masked, order if merged else ""


def _merged_mask(q, add_masks, masked, mask_order: str, *, zero_dead_rows: bool):
    """The masks merged in graph order into one additive mask: ``(q, mask, filled)``, ``filled`` the entries a
    fill replaced. With ``zero_dead_rows``, rows that read only the masks in eager get a zero query."""
    # eager's order: a fill replaces what the scores hold so far (the masks added before it included), a
    # later additive mask adds on top; so every filled entry holds eager's value, ``s`` aside
    adds, fills = iter(add_masks), iter(masked)
    mask = filled = None
    for stage in mask_order:
        if stage == "a":
            mk = next(adds)
            mk = mk if mk.is_floating_point() else mk.to(q.dtype)
            mask = mk if mask is None else mask + mk
        else:
            c, true_masks, val = next(fills)
            mc = c if true_masks else ~c
            filled = mc if filled is None else filled | mc
            mask = torch.where(mc, torch.full((), val, dtype=q.dtype, device=q.device),
                               0.0 if mask is None else mask)
    if zero_dead_rows:     # (not in an export: 0 * inf in a zeroed row would be NaN there, with no guard)
        # a row whose every entry is filled, or absorbs any score, or lies a masking margin below the row's
        # fills, reads only the masks in eager (where() drops the scores and their gradient): a zero query
        # gives exactly that, s = 0
        top = torch.where(filled, mask, float("-inf")).amax(-1, keepdim=True)
        dead = (filled | (mask <= ABSORBING) | (mask <= top + MASK_VALUE)).all(-1, keepdim=True)
        q = torch.where(dead, 0.0, q)
        # and such a row's mask shifted to a max of 0 (softmax is shift-invariant): the fused CPU backward
        # recomputes exp(s - lse), and lse = min + log(n) rounds back to min, giving weights of 1
        peak = mask.amax(-1, keepdim=True).detach()
        peak = peak.masked_fill(peak == float("-inf"), 0.0)          # a row of -inf stays one (NaN below)
        mask = torch.where(dead, mask - peak, mask)
    return q, mask, filled


def keys_last(t: torch.Tensor) -> torch.Tensor:
    """A mask of (..., S, L) scores, as a mask of (..., L, S) scores (broadcast dims kept)."""
    return t.reshape((1,) * (2 - t.dim()) + tuple(t.shape)).mT


def _floored(q, add_masks, floor: float):
    """``max(s + masks, floor)`` as ``s + max(sum of masks, floor)`` (equal wherever ``|s|`` is below
    ``ulp(floor) / 2``, about 1e31 for ``finfo.min``); a row whose every entry the floor lifts reads no score in
    eager (uniform weights): its query and its mask are zeroed."""
    total = sum(mk if mk.is_floating_point() else mk.to(q.dtype) for mk in add_masks)
    lifted = (total < floor).all(-1, keepdim=True)
    # and a mask of 0 there: the fused CPU backward recomputes exp(s - lse), lse = floor + log(n) rounding to floor
    return torch.where(lifted, 0.0, q), [torch.where(lifted, 0.0, total.clamp(min=floor))]


def _nonfinite_rows(q, k, hidden, is_causal: bool, n_rep: int):
    """Eager's NaN rows for non-finite q or k (docs/DESIGN.md, "Attention"): ``(q_bad, k, k_bad)``, the rows a
    non-finite query makes NaN, ``k`` with the non-finite keys a selection mask may hide zeroed, and the rows
    that see such a key. O(L*E + S*E), and one pass over the selection mask when it has a row per query."""
    q_bad = ~torch.isfinite(q).all(-1, keepdim=True)
    if is_causal:
        return q_bad, k, torch.zeros((), dtype=torch.bool, device=q.device)
    if hidden is None:
        k_nan = k.isnan().any(-1).any(-1)[..., None, None]
        return q_bad, k, (k_nan.repeat_interleave(n_rep, dim=-3) if n_rep > 1 else k_nan)
    k_nf = ~torch.isfinite(k).all(-1)                                  # (..., Hkv, S)
    k = torch.where(k_nf[..., None], 0.0, k)
    k_nf = k_nf.repeat_interleave(n_rep, dim=-2) if n_rep > 1 else k_nf   # (..., H, S)
    seen = ~hidden                                                     # broadcasts to (..., H, L, S)
    if seen.dim() < 2 or seen.shape[-2] == 1:                          # one key row for every query (padding)
        return q_bad, k, (seen & k_nf[..., None, :]).any(-1, keepdim=True)
    # rows x keys as a matmul, so the (..., H, L, S) product is never formed: a count > 0 is a seen bad key
    if seen.dim() < 3 or seen.shape[-3] == 1:
        rows = seen.squeeze(-3) if seen.dim() >= 3 else seen
        n = rows.to(q.dtype) @ k_nf.transpose(-1, -2).to(q.dtype)      # (..., L, H)
        return q_bad, k, (n > 0).transpose(-1, -2)[..., None]
    return q_bad, k, (seen.to(q.dtype) @ k_nf[..., None].to(q.dtype)) > 0


def graph_flex_attention(q, k, v, sides, scale_tensors, *, recipe: tuple, scale: float, n_rep: int,
                         safe_softmax: bool = False, layout: dict | None = None):
    """A site whose scores go through other pointwise changes: FlexAttention with ``score_mod`` replaying
    ``recipe`` (:func:`..score_mod.score_mod_recipe`) on each score, ``sides`` indexed at its entry. Eager's
    NaN (0 after ``_safe_softmax``) on rows whose every changed score is -inf, where FlexAttention gives 0: V
    gets a column of ones, whose output is each row's sum of weights (1, or 0 on such a row)."""
    from torch.nn.attention.flex_attention import flex_attention

    layout = layout or {}
    q, k, v = (apply_perm(t, layout.get(r)) for t, r in ((q, "q"), (k, "k"), (v, "v")))
    for t, op in scale_tensors:
        q = q * t.to(q.dtype) if op == "mul" else q / t.to(q.dtype)
    # one (B, H) grid for all three (FlexAttention does not broadcast); GQA's K and V keep their kv heads
    lead = tuple(q.shape[:-2]) if n_rep > 1 else torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    shape = (*lead, q.shape[-2], k.shape[-2])
    q = q.expand(*lead, *q.shape[-2:])
    if n_rep == 1:
        k, v = k.expand(*lead, *k.shape[-2:]), v.expand(*lead, *v.shape[-2:])
    pad = (1,) * (4 - len(shape))
    q, k, v = (t.reshape(*pad, *t.shape) for t in (q, k, v))
    # each side as (B or 1, H or 1, L or 1, S or 1), read at index 0 along its broadcast dims; realized in
    # memory: Inductor's CPU template (torch 2.13) builds the score_mod before it realizes computed sides
    sides = [sd.reshape((1,) * (4 - sd.dim()) + tuple(sd.shape)) for sd in sides]
    sides = [torch.ops.prims.inductor_force_stride_order(sd, sd.stride()) for sd in sides]
    spans = [tuple(n > 1 for n in sd.shape) for sd in sides]

    steps = [(op, target if op == "call_method" else _resolve(target), args, kwargs)
             for op, target, args, kwargs in recipe]

    def score_mod(score, b, h, i, j):
        values: list = []
        at = (b, h, i, j)
        take = lambda a: score if a == ("@path", -1) else values[a[1]] if a[0] == "@path" else sides[a[1]][  # noqa: E731
            tuple(x if wide else 0 for x, wide in zip(at, spans[a[1]]))]
        for op, fn, args, kwargs in steps:
            args, kwargs = _replay_args(args, take), _replay_args(kwargs, take)
            values.append(getattr(args[0], fn)(*args[1:], **kwargs) if op == "call_method" else fn(*args, **kwargs))
        return values[-1]

    ones = torch.ones((*v.shape[:-1], 1), dtype=v.dtype, device=v.device)
    out = flex_attention(q, k, torch.cat([v, ones], -1), score_mod=score_mod, scale=scale, enable_gqa=n_rep > 1)
    dead = out[..., -1:] < 0.5
    out = out[..., :-1].masked_fill(dead, 0.0 if safe_softmax else float("nan"))
    return apply_perm(out.reshape(*shape[:-1], out.shape[-1]), layout.get("out"))


def _replay_args(a, take):
    if isinstance(a, tuple) and len(a) == 2 and a[0] in ("@path", "@side"):
        return take(a)
    if isinstance(a, (tuple, list)):
        return type(a)(_replay_args(x, take) for x in a)
    if isinstance(a, dict):
        return {key: _replay_args(x, take) for key, x in a.items()}
    return a


def _resolve(path: str):
    module, name = path.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)


def graph_sdpa(q, k, v, sdpa_kwargs: dict, *, normalizer: str, norm_param):
    """A rewritten ``F.scaled_dot_product_attention`` site with a requested normalizer."""
    from ...kernels.attention import attention

    kw = dict(sdpa_kwargs)
    scale = kw.get("scale")
    if scale is not None and not isinstance(scale, (int, float)):
        # a size-dependent scale under dynamic shapes (1 / sqrt(q.size(-1))) is symbolic: folded into q, as the op's
        # scale must be a number
        q, kw["scale"] = q * scale, 1.0
    return attention(q, k, v, **kw, normalizer=normalizer, norm_param=norm_param)


__all__ = ["graph_attention", "graph_flex_attention", "graph_sdpa", "keys_last"]
