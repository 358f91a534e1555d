"""Eager's values on the rows a mask empties, around torch's fused attention kernels (docs/DESIGN.md,
"Attention"): masks merged in graph order, rows that read only the masks, non-finite queries and keys."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def merged_mask(add_masks, masked, mask_order: str, *, dtype, device):
    """The masks merged in graph order into one additive mask: ``(mask, filled)``, ``filled`` the entries a fill
    replaced."""
    # eager's order: a fill replaces what the scores hold so far (the masks added before it included), a
    # later additive mask adds on top; so every filled entry holds eager's value, ``s`` aside
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
    """Rows that read only the masks in eager: every entry filled (``filled``), absorbing the row's scores (half
    an fp32 ulp of the entry above :func:`score_bound`: ``s + m`` rounds to ``m``) or ``margin`` below the row's
    fills: ``(q, mask, uniform)``. Their mask, and that of any row masked whole (max <= ``margin``), is shifted
    to a max of 0 (softmax is shift-invariant; the fused
    backward recomputes exp(s - lse), and lse = m + log(n) rounds back to m, giving weights of 1) and their
    query's value zeroed (s = 0, as eager's rounding gives). With ``keep_grad``, where the weighted entries are
    additive, eager's gradient still reaches q (kept) and k (:func:`absorbed_key_term`, for ``uniform`` rows:
    weights uniform over every key)."""
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
    # a row masked whole whose scores still count (-1e9 against scores of 100) is shifted too, its q kept: its
    # weights and gradients then follow s exactly, as the fp64 gold's do, where the kernel's lse would round
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
