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

from ..patterns.contraction import op_layout
from ..patterns.masks import MASK_VALUE, is_masking_value
from ...kernels.attention.masked_rows import absorbed_key_term, dead_rows, floored, keys_last, merged_mask, \
    nonfinite_rows, split_masks


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
    q, k, v, laid_out = op_layout(q, k, v, layout)
    # masks as (..., rows, keys) with both dims present (a 0-d or (S,) mask broadcasts as eager's does)
    masks = [keys_last(t) if "scores" in (layout or {}) else t.reshape((1,) * (2 - t.dim()) + tuple(t.shape)) for t in masks]
    out = _attention(q, k, v, masks, mask_kinds, scale_tensors, scale=scale, softcap=softcap, is_causal=is_causal,
                     dropout_p=dropout_p, n_rep=n_rep, fixup=fixup, normalizer=normalizer, norm_param=norm_param,
                     export=export, lead=lead, safe_softmax=safe_softmax, mask_floor=mask_floor)
    return laid_out(out)


def _attention(q, k, v, masks, mask_kinds, scale_tensors, *, scale, softcap, is_causal, dropout_p, n_rep, fixup,
               normalizer, norm_param, export, lead, safe_softmax, mask_floor):
    v_lead, nd = None, max(q.dim(), k.dim(), v.dim())     # matmul's leading dims, aligned from the right
    q, k, v = (t if t.dim() == nd else t.reshape((1,) * (nd - t.dim()) + tuple(t.shape)) for t in (q, k, v))
    if lead is not None:
        v_lead = v.shape[:-2]
        q, k, v = (t.reshape(*lead, *t.shape[-2:]) for t in (q, k, v))
    add_masks, masked, mask_order = split_masks(masks, mask_kinds, (*(lead or ()), q.shape[-2], k.shape[-2]),
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
        q, add_masks = floored(q, add_masks, mask_floor)
    keep = 3 if n_rep > 1 else 2        # GQA's K and V keep their kv heads; otherwise heads broadcast too
    lead_dims = torch.broadcast_shapes(q.shape[:-keep], k.shape[:-keep], v.shape[:-keep])
    q, k, v = (t.expand(*lead_dims, *t.shape[-keep:]) for t in (q, k, v))
    mask = hidden = all_masked = uniform = None     # hidden: the entries a fill selects away (True = not seen)
    if mask_order:
        mask, hidden = merged_mask(add_masks, masked, mask_order, dtype=q.dtype, device=q.device)
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
    q_eager, sdpa_scale = q, q.shape[-1] ** -0.5 if scale is None else scale
    # (not in an export: 0 * inf in a zeroed row would be NaN there, with no guard); soft-capped scores: the op's
    # own backward takes absorbed rows as they are, and tanh's derivative needs eager's s, so only fills count
    if fixup and normalizer == "softmax" and not export and mask is not None and mask.dtype.is_floating_point \
            and (softcap is None or mask_order):
        q, mask, uniform = dead_rows(q, k, mask, hidden, scale=sdpa_scale, n_rep=n_rep, margin=MASK_VALUE,
                                     keep_grad=softcap is None)
    if not export:
        q_bad, k, k_bad = nonfinite_rows(q, k, hidden, is_causal, n_rep)
    if normalizer == "softmax" and softcap is None:
        # torch's fused flash kernels (CPU and CUDA); Inductor lowers the call to them
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal,
                                             scale=scale, enable_gqa=n_rep > 1)
    else:
        from ...kernels.attention import attention

        out = attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                        enable_gqa=n_rep > 1, softcap=softcap, normalizer=normalizer, norm_param=norm_param)
    if uniform is not None and dropout_p == 0 and torch.is_grad_enabled() and k.requires_grad:
        out = out + absorbed_key_term(q_eager, k, v, uniform, scale=sdpa_scale, n_rep=n_rep)
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


def graph_flex_attention(q, k, v, sides, scale_tensors, *, recipe: tuple, scale: float, n_rep: int,
                         safe_softmax: bool = False, layout: dict | None = None):
    """A site whose scores go through other pointwise changes (:func:`.scores.score_mod_recipe`): q, k, v after
    ``layout``, ``scale_tensors`` folded into q, then :func:`smxcompile.kernels.attention.score_mod_attention`."""
    from ...kernels.attention.flex import score_mod_attention

    q, k, v, laid_out = op_layout(q, k, v, layout)
    if n_rep == 1:      # operands broadcast along a batch index they lack (multi-query K and V)
        lead = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
        q, k, v = (t.expand(*lead, *t.shape[-2:]) for t in (q, k, v))
    for t, op in scale_tensors:
        q = q * t.to(q.dtype) if op == "mul" else q / t.to(q.dtype)
    out = score_mod_attention(q, k, v, sides, recipe=recipe, scale=scale, enable_gqa=n_rep > 1,
                              safe_softmax=safe_softmax)
    return laid_out(out)


def graph_sdpa(q, k, v, sdpa_kwargs: dict, *, normalizer: str, norm_param):
    """A rewritten ``F.scaled_dot_product_attention`` site with a requested normalizer."""
    from ...kernels.attention import attention

    kw = dict(sdpa_kwargs)
    scale = kw.get("scale")
    if scale is not None and not isinstance(scale, (int, float)):
        # a symbolic scale (1 / sqrt(q.size(-1)) under dynamic shapes) folded into q: the op's scale is a number
        q, kw["scale"] = q * scale, 1.0
    return attention(q, k, v, **kw, normalizer=normalizer, norm_param=norm_param)


__all__ = ["graph_attention", "graph_flex_attention", "graph_sdpa"]
