"""What rewritten attention sites call at run time (traced by AOTAutograd, so torch's and smx's ops end up in
the graph): ``F.scaled_dot_product_attention`` (torch's fused flash kernels, CPU and CUDA; FlashAttention: Dao et
al., 2022) for softmax, :func:`smxcompile.attention` (the ``smx::attention`` op) for the other normalizers and
soft-capping, with eager's values restored on fully masked rows and for NaN inputs."""

from __future__ import annotations

import functools
import math
import operator

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
    # masks as (..., rows, keys) with both dims present (a 0-d or (S,) mask broadcasts as eager's does)
    masks = [keys_last(t) if "scores" in layout else t.reshape((1,) * (2 - t.dim()) + tuple(t.shape)) for t in masks]
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
    keep = 3 if n_rep > 1 else 2        # GQA's K and V keep their kv heads; otherwise heads broadcast too
    lead_dims = torch.broadcast_shapes(q.shape[:-keep], k.shape[:-keep], v.shape[:-keep])
    q, k, v = (t.expand(*lead_dims, *t.shape[-keep:]) for t in (q, k, v))
    mask = hidden = all_masked = None     # hidden: the entries a fill selects away (True = not seen)
    if mask_order:
        q, mask, hidden = _merged_mask(q, add_masks, masked, mask_order,
                                       zero_dead_rows=bool(fixup) and normalizer == "softmax" and not export)
    elif masked:     # fills alone, of one value: a bool mask
        hidden = functools.reduce(operator.or_, (c if true_masks else ~c for c, true_masks, _ in masked))
        mask, all_masked = ~hidden, hidden.all(-1, keepdim=True) if fixup else None
    elif add_masks:
        mask = functools.reduce(operator.add, (mk if mk.is_floating_point() else mk.to(q.dtype) for mk in add_masks))
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
        if all_masked is None:      # the masks' sum in q's dtype, as eager adds them
            out = out.masked_fill((mask == float("-inf")).all(-1, keepdim=True), empty_row)
        elif all(math.isinf(val) for *_, val in masked):
            out = torch.where(all_masked, torch.full((), empty_row, dtype=out.dtype, device=out.device), out)
        else:       # a row filled whole with a finite value: uniform weights
            vv = v.repeat_interleave(n_rep, dim=-3) if n_rep > 1 else v
            out = torch.where(all_masked, vv.mean(-2, keepdim=True).to(out.dtype), out)
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
    seen = seen.expand(*seen.shape[:-1], k_nf.shape[-1])               # a mask broadcast over the keys
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
    """A site whose scores go through other pointwise changes (:func:`.scores.score_mod_recipe`): q, k, v after
    ``layout``, ``scale_tensors`` folded into q, then :func:`smxcompile.kernels.attention.score_mod_attention`."""
    from ...kernels.attention.flex import score_mod_attention

    layout = layout or {}
    q, k, v = (apply_perm(t, layout.get(r)) for t, r in ((q, "q"), (k, "k"), (v, "v")))
    for t, op in scale_tensors:
        q = q * t.to(q.dtype) if op == "mul" else q / t.to(q.dtype)
    out = score_mod_attention(q, k, v, sides, recipe=recipe, scale=scale, enable_gqa=n_rep > 1,
                              safe_softmax=safe_softmax)
    return apply_perm(out, layout.get("out"))


def graph_sdpa(q, k, v, sdpa_kwargs: dict, *, normalizer: str, norm_param):
    """A rewritten ``F.scaled_dot_product_attention`` site with a requested normalizer."""
    from ...kernels.attention import attention

    kw = dict(sdpa_kwargs)
    scale = kw.get("scale")
    if scale is not None and not isinstance(scale, (int, float)):
        # a symbolic scale (1 / sqrt(q.size(-1)) under dynamic shapes) folded into q: the op's scale is a number
        q, kw["scale"] = q * scale, 1.0
    return attention(q, k, v, **kw, normalizer=normalizer, norm_param=norm_param)


__all__ = ["graph_attention", "graph_flex_attention", "graph_sdpa", "keys_last"]
