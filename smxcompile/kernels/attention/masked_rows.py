"""Eager's values on the rows a mask empties, around torch's fused attention kernels (docs/DESIGN.md,
"Attention"): masks merged in graph order, rows that read only the masks, non-finite queries and keys."""

from __future__ import annotations

import functools
import math
import operator

import torch
import torch.nn.functional as F

#: A ``masked_fill`` / ``where`` value at or below this masks a score: exp(value - row max) underflows
#: to exactly 0 in fp32 for any row max above ``MASK_VALUE + 104``.
MASK_VALUE = -1e4


def is_masking_value(v):
    """Whether a fill value masks a score (``-inf`` or any number <= :data:`MASK_VALUE`, e.g. ``finfo.min``);
    elementwise (a bool tensor) for a tensor."""
    return v <= MASK_VALUE


def merged_mask(add_masks, masked, mask_order: str, *, dtype, device):
    """The masks merged in graph order into one additive mask: ``(mask, filled)``, ``filled`` the entries a fill
    replaced."""
    # eager's order: a fill replaces the masks added before it, a later additive mask adds on top
    adds, fills = iter(add_masks), iter(masked)
    mask = filled = None
    for stage in mask_order:
        if stage == "a":
            mk = next(adds)
            mk = mk if mk.is_floating_point() else mk.to(dtype)
            mask = mk if mask is None else mask + mk
        else:
            c, true_masks, val = next(fills)
            mc = c if true_masks else ~c
            filled = mc if filled is None else filled | mc
            mask = torch.where(mc, torch.full((), val, dtype=dtype, device=device), 0.0 if mask is None else mask)
    return mask, filled


def score_bound(q, k, *, scale, n_rep: int, like):
    """An upper bound of ``|s_ij|``, ``scale * |q_i| * max_j |k_j|`` (fp32, no gradient), per query row, reduced
    (max) over the dims where the mask ``like`` broadcasts. ``scale``: a number (None resolved by the caller)."""
    # non-finite rows are NaN anyway: they must not lift the bound of the rows they share a mask with
    qd, kd = (torch.nan_to_num(t.detach().float(), nan=0.0, posinf=0.0, neginf=0.0) for t in (q, k))
    kmax = kd.norm(dim=-1).amax(-1, keepdim=True)[..., None]                  # (..., Hkv, 1, 1)
    kmax = kmax.repeat_interleave(n_rep, dim=-3) if n_rep > 1 else kmax
    bound = scale * qd.norm(dim=-1, keepdim=True) * kmax                       # (..., H, L, 1)
    if bound.dim() > like.dim():
        bound = bound.amax(tuple(range(bound.dim() - like.dim())))
    dims = tuple(-i for i in range(2, bound.dim() + 1) if like.shape[-i] == 1 and bound.shape[-i] > 1)
    return bound.amax(dims, keepdim=True) if dims else bound


def dead_rows(q, k, mask, filled, *, scale, n_rep: int, margin: float, keep_grad: bool):
    """Rows that read only the masks in eager (every entry filled, absorbing the row's scores, or ``margin``
    below the row's fills): ``(q, mask, uniform)`` with their mask, and that of any row masked whole, shifted to
    a max of 0 and their query's value zeroed; with ``keep_grad`` eager's gradient still reaches q and, for
    ``uniform`` rows, k (:func:`absorbed_key_term`). docs/DESIGN.md, "Attention: rows the masks empty"."""
    m32 = mask.detach().float()
    bound = score_bound(q, k, scale=scale, n_rep=n_rep, like=mask)
    absorbs = (m32 - torch.nextafter(m32, torch.zeros_like(m32))).abs() > 2 * bound
    if filled is None:
        dead = absorbs.all(-1, keepdim=True)
    else:
        top = torch.where(filled, mask, float("-inf")).amax(-1, keepdim=True)
        dead = (filled | absorbs | (mask <= top + margin)).all(-1, keepdim=True)
    peak = mask.amax(-1, keepdim=True).detach()
    weighted = mask == peak
    graded = dead if filled is None else dead & ~(weighted & filled).any(-1, keepdim=True)
    graded = graded & keep_grad
    # a row masked whole whose scores still count (-1e9 against scores of 100) is shifted too, its q kept
    shift = dead | (peak <= margin)
    peak = peak.masked_fill(peak == float("-inf"), 0.0)          # a row of -inf stays one (NaN later)
    q = torch.where(dead, torch.where(graded, q - q.detach(), 0.0), q)
    return q, torch.where(shift, mask - peak, mask), graded & weighted.all(-1, keepdim=True)


def absorbed_key_term(q, k, v, uniform, *, scale, n_rep: int):
    """Zero in value; its gradient w.r.t. ``k`` is what eager's ``uniform`` rows (weights 1/S, scores absorbed
    by the mask) send to K, ``dk_j = scale / S * sum_i q_i (g_i . (v_j - mean(v)))``; O((L + S) * E * Ev).
    Non-finite entries of q, k, v contribute nothing (their rows are NaN in eager and here)."""
    S, E = k.shape[-2], q.shape[-1]
    vd = torch.nan_to_num(v.detach(), nan=0.0, posinf=0.0, neginf=0.0)
    dk = torch.where(torch.isfinite(k.detach()), k - k.detach(), 0.0)
    kv = dk.mT @ (vd - vd.mean(-2, keepdim=True))                      # (..., Hkv, E, Ev), zero in value
    qd = torch.where(uniform & torch.isfinite(q.detach()), q.detach(), 0.0)
    if n_rep > 1:       # q's heads grouped by the kv head they read
        lead = qd.shape[:-3]
        x = qd.reshape(*lead, -1, n_rep * qd.shape[-2], E) @ kv
        return x.reshape(*lead, -1, qd.shape[-2], x.shape[-1]) * (scale / S)
    return (qd @ kv) * (scale / S)


def floored(q, add_masks, floor: float):
    """``max(s + masks, floor)`` as ``s + max(sum of masks, floor)`` (equal wherever ``|s|`` is below
    ``ulp(floor) / 2``, about 1e31 for ``finfo.min``); a row whose every entry the floor lifts reads no score in
    eager (uniform weights): its query and its mask are zeroed."""
    total = sum(mk if mk.is_floating_point() else mk.to(q.dtype) for mk in add_masks)
    lifted = (total < floor).all(-1, keepdim=True)
    # and a mask of 0 there: the fused CPU backward recomputes exp(s - lse), lse = floor + log(n) rounding to floor
    return torch.where(lifted, 0.0, q), [torch.where(lifted, 0.0, total.clamp(min=floor))]


def nonfinite_rows(q, k, hidden, is_causal: bool, n_rep: int):
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


def split_masks(masks, mask_kinds, shape: tuple, *, dtype):
    """``(additive masks, fills as (bool, True if True masks, value), mask_order)``; ``mask_order`` (``"a"`` an
    add, ``"f"`` a fill, in graph order) only where fills meet additive masks or fills differ in value: then all
    merge into one additive mask. A mask on a view of the scores is regrouped to ``shape``."""
    add_masks, masked, order = [], [], ""
    for t, (how, value, view) in zip(masks, mask_kinds, strict=True):
        if how == "add" and value is not None:      # added to a region: (pads, region shape, shape added at)
            t = t.expand(value[2]).reshape(value[1])
            t = F.pad(t, value[0]) if value[0] else t
        t = t if view is None else t.expand(view).reshape(shape)
        if how in ("add", "sub"):
            add_masks.append(t if how == "add" else -(t if t.is_floating_point() else t.to(dtype)))
        else:
            masked.append((t, how == "fill", value))
        order += "a" if how in ("add", "sub") else "f"
    merged = bool(add_masks and masked) or len({val for *_, val in masked}) > 1
    return add_masks, masked, order if merged else ""


def keys_last(t: torch.Tensor) -> torch.Tensor:
    """A mask of (..., S, L) scores, as a mask of (..., L, S) scores (broadcast dims kept)."""
    return t.reshape((1,) * (2 - t.dim()) + tuple(t.shape)).mT


def with_sink(q, k, v, mask, sink, *, scale: float):
    """Attention with a sink column (a logit ``sink`` per row, broadcast to (..., L, 1), normalized with the
    scores, its weight dropped; gpt-oss) as attention over one more key of zero value: ``q' = [q * scale, sink]``,
    ``k' = [[k, 0], [0, 1]]``, ``v' = [[v, 0], [0, 0]]`` (one width, a multiple of 8 on CUDA). Returns ``(q', k',
    v', mask', scale' = 1)``; the caller reads the first ``v.shape[-1]`` features. A -inf sink is clamped to the
    dtype's lowest (0 times it must not be NaN)."""
    S, E, Ev = k.shape[-2], q.shape[-1], v.shape[-1]
    width = max(E, Ev) + 1
    width += -width % 8 if q.is_cuda else 0
    c = torch.broadcast_to(sink.to(q.dtype).clamp(min=torch.finfo(q.dtype).min), (*q.shape[:-1], 1))
    q = torch.cat([F.pad(q * scale, (0, width - E - 1)), c], -1)
    k = torch.cat([F.pad(k, (0, width - E)), F.pad(k.new_ones(*k.shape[:-2], 1, 1), (width - 1, 0))], -2)
    v = F.pad(v, (0, width - Ev, 0, 1))
    if mask is not None:
        mask = F.pad(mask.expand(*mask.shape[:-1], S), (0, 1), value=True if mask.dtype == torch.bool else 0.0)
    return q, k, v, mask, 1.0


def masked_attention(q, k, v, masks, mask_kinds, scale_tensors, *, scale, softcap, is_causal, dropout_p, n_rep,
                     fixup, normalizer, norm_param, export, lead, safe_softmax, mask_floor, sink):
    """Attention with the masks of :func:`split_masks` on torch's fused kernel (or ``smx::attention``), eager's
    values kept on rows the masks empty and for non-finite q or k: q (..., L, E), k, v (..., S, E) broadcasting as
    matmul's; the arguments of :func:`smxcompile.passes.attention.replacement.graph_attention`."""
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
        # masking values (finfo.min...) as -inf for a variant: out of softpick's denominator and of n
        mask = mask.masked_fill(is_masking_value(mask), float("-inf"))
    q_eager, sdpa_scale = q, q.shape[-1] ** -0.5 if scale is None else scale
    # not in an export (0 * inf in a zeroed row, unguarded); with a soft-cap only fills count (tanh' needs eager's s)
    if fixup and normalizer == "softmax" and not export and mask is not None and mask.dtype.is_floating_point \
            and (softcap is None or mask_order):
        q, mask, uniform = dead_rows(q, k, mask, hidden, scale=sdpa_scale, n_rep=n_rep, margin=MASK_VALUE,
                                     keep_grad=softcap is None)
    if sink is not None and is_causal:    # the sink's extra key breaks is_causal's alignment: an explicit mask
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        hidden, is_causal = ~mask, False
    if not export:
        q_bad, k, k_bad = nonfinite_rows(q, k, hidden, is_causal, n_rep)
    features = v.shape[-1]
    if sink is not None:
        assert not fixup, "a sink leaves no row masked whole: no fix-up reads the padded k, v"
        q, k, v, mask, scale = with_sink(q, k, v, mask, sink, scale=sdpa_scale)
    if normalizer == "softmax" and softcap is None:
        # torch's fused flash kernels (CPU and CUDA); Inductor lowers the call to them
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal,
                                             scale=scale, enable_gqa=n_rep > 1)
    else:
        from . import attention

        out = attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                        enable_gqa=n_rep > 1, softcap=softcap, normalizer=normalizer, norm_param=norm_param)
    out = out[..., :features] if sink is not None else out
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
