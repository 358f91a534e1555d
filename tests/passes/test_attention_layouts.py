"""Attention read by meaning: a contraction of q and k over the head dim, a softmax over the key index, a
contraction of the weights with v over the key index, whatever the layout of q, k, v and of the output and
whichever op spells the contraction (``@``, ``bmm``, ``baddbmm``, ``einsum``).

The layouts are those of libraries' own code, written here in our own words: diffusers' classic attention
processor (``baddbmm`` on (B*H, L, E) with ``beta=0`` or an additive mask), LeViT (K permuted (0, 2, 3, 1)),
CoAtNet-style (B, H, E, N) tensors (``(q * s).transpose(-2, -1) @ k`` then ``v @ attn.transpose(-2, -1)``), einsums
that read or write (B, L, H, E); a padding bias or a learned bias subtracted from the scores (Funnel); masked scores clamped at
``finfo.min`` (XGLM), fully masked rows included; decomposed relative positions on a view splitting the query and key
indices (VitDet); scores laid out (keys, queries). Each is rewritten, gives eager's forward, and its gradients pass
``|ours - gold| <= |torch - gold| + tol`` against an fp64 gold. Other pointwise changes (``bias - s``, ``max(s, 0)``,
a floor that may cut through the scores) go to FlexAttention. The near-misses (weights mixed across heads after the
softmax, weights contracted over the query index, views mixing the two indices) are not rewritten."""

from __future__ import annotations

import pytest
import torch

from pass_helpers import check_against_gold, first_output, rewrite

B, H, L, S, E = 2, 3, 5, 7, 4


def _randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def diffusers_baddbmm(q, k, v):                 # (B*H, L, E), no mask: beta=0 ignores the empty input
    empty = torch.empty(q.shape[0], q.shape[1], k.shape[1], dtype=q.dtype)
    s = torch.baddbmm(empty, q, k.transpose(-1, -2), beta=0, alpha=E ** -0.5)
    return torch.bmm(s.softmax(dim=-1), v)


def diffusers_baddbmm_mask(q, k, v, mask):      # the padding mask is baddbmm's input, beta=1
    s = torch.baddbmm(mask, q, k.transpose(-1, -2), beta=1, alpha=E ** -0.5)
    return torch.bmm(s.softmax(dim=-1), v)


def levit_permuted_k(q, k, v):                  # k (B, S, H, E) permuted to K^T (B, H, E, S)
    s = q @ k.permute(0, 2, 3, 1) * E ** -0.5
    return s.softmax(-1) @ v


def channels_first(q, k, v):                    # q, k, v (B, H, E, N): the output comes back (B, H, E, L)
    s = (q * E ** -0.5).transpose(-2, -1) @ k
    return v @ s.softmax(-1).transpose(-2, -1)


def einsum_blhe(q, k, v):                       # q, k, v and the output as (B, L, H, E)
    s = torch.einsum("bihd,bjhd->bhij", q, k) * E ** -0.5
    return torch.einsum("bhij,bjhd->bihd", s.softmax(-1), v)


def k_other_dims(q, k, v):                      # k (B, E, S, H): swapping dims 1 and 3 gives K^T
    return torch.softmax(q @ k.transpose(1, 3) * E ** -0.5, -1) @ v


def value_features(q, k, v):                    # SepViT: each key's value is a (w, d) feature map
    a = torch.einsum("bhid,bhjd->bhij", q * E ** -0.5, k).softmax(-1)
    return torch.einsum("bhij,bhjwd->bhiwd", a, v)


def value_features_reordered(q, k, v, mask):    # V first, the features' dims apart, the output laid out otherwise
    a = (torch.einsum("bhid,bhjd->bhij", q, k) + mask).softmax(-1)
    return torch.einsum("bwhjd,bhij->bhwid", v, a)


def intermediates_kept(q, k, v):               # copies kept for optional intermediates, never returned
    s = q @ k.transpose(-2, -1) * E ** -0.5
    kept = {"sim": s.clone()}
    p = s.softmax(-1)
    kept["post_softmax"] = p.clone()
    return p @ v


def inplace_fill(q, k, v, pad):                # masked_fill_ on the fresh scores
    s = q @ k.transpose(-2, -1) * E ** -0.5
    s.masked_fill_(pad, float("-inf"))
    return s.softmax(-1) @ v


def subtracted_padding(q, k, v, keep):         # Funnel: s - big * (1 - keep), the padding bias subtracted
    s = torch.einsum("bhid,bhjd->bhij", q * E ** -0.5, k)
    s = s - 1e6 * (1 - keep[:, None, None].float())
    return torch.einsum("bhij,bhjd->bhid", s.softmax(-1), v)


def subtracted_bias(q, k, v, bias):             # a learned bias subtracted: its gradient is negated too
    return (q @ k.transpose(-2, -1) - bias).softmax(-1) @ v


def floored_padding(q, k, v, mask):            # XGLM / older BART code: masked scores clamped at finfo.min
    s = q @ k.transpose(-2, -1) * E ** -0.5 + mask
    s = torch.max(s, torch.full((), torch.finfo(s.dtype).min, dtype=s.dtype))
    return s.softmax(-1) @ v


def floored_by_clamp(q, k, v, mask):
    s = (q @ k.transpose(-2, -1) + mask).clamp(min=torch.finfo(q.dtype).min)
    return s.softmax(-1) @ v


def decomposed_rel_pos(q, k, v, table_h, table_w):   # MViT-v2 / SAM / VitDet: a bias per grid axis, from q
    s = (q * E ** -0.5) @ k.transpose(-2, -1)        # (B*H, 6, 6): a 2 x 3 grid of queries and of keys
    grid = q.reshape(-1, 2, 3, E)
    bias_h = torch.einsum("bhwc,hkc->bhwk", grid, table_h)
    bias_w = torch.einsum("bhwc,wkc->bhwk", grid, table_w)
    s = (s.view(-1, 2, 3, 2, 3) + bias_h[..., None] + bias_w[..., None, :]).view(-1, 6, 6)
    return s.softmax(-1) @ v


def region_rel_pos(q, k, v, table_h, table_w):   # MViT-v2: the grid's bias added after a class token, in place
    s = (q * E ** -0.5) @ k.transpose(-2, -1)          # (B*H, 7, 7): a class token, then a 2 x 3 grid
    grid = q[:, 1:].reshape(-1, 2, 3, E)
    bias_h = torch.einsum("bhwc,hkc->bhwk", grid, table_h)
    bias_w = torch.einsum("bhwc,wkc->bhwk", grid, table_w)
    s[:, 1:, 1:] = (s[:, 1:, 1:].view(-1, 2, 3, 2, 3) + bias_h[..., None] + bias_w[..., None, :]).view(-1, 6, 6)
    return s.softmax(-1) @ v


def whole_region_rel_pos(q, k, v, table_h, table_w):   # MViT-v2 without a class token: s[:, 0:, 0:] = ...
    s = (q * E ** -0.5) @ k.transpose(-2, -1)
    grid = q.reshape(-1, 2, 3, E)
    bias_h = torch.einsum("bhwc,hkc->bhwk", grid, table_h)
    s[:, 0:, 0:] = (s[:, 0:, 0:].view(-1, 2, 3, 2, 3) + bias_h[..., None]).view(-1, 6, 6)
    return s.softmax(-1) @ v


def shared_queries(q, k, v):                    # learned queries (L, E) attending over each batch's tokens
    return torch.matmul((torch.matmul(q, k.transpose(-1, -2)) * E ** -0.5).softmax(-1), v)


def multi_query_einsum(q, k, v):                # one K and V for every head: einsum broadcasts them over h
    s = torch.einsum("bhid,bjd->bhij", q, k) * E ** -0.5
    return torch.einsum("bhij,bjd->bhid", s.softmax(-1), v)


def multi_query_tokens_first(q, k, v):          # the value einsum writes (B, L, H, E); V has no head dim
    s = torch.einsum("bhnd,bmd->bhnm", q, k) * E ** -0.5
    return torch.einsum("bhnm,bmd->bnhd", s.softmax(-1), v)


def region_iadd(q, k, v, b):                    # s[:, 1:, 1:] += b: a bias after a class token, in place
    s = q @ k.transpose(-2, -1) * E ** -0.5
    s[:, 1:, 1:] += b
    return s.softmax(-1) @ v


def inplace_scales(q, k, v, t):                  # s /= sqrt(d) and a learned factor, both in place
    s = q @ k.transpose(-2, -1)
    s /= E ** 0.5
    s.mul_(t)
    return s.softmax(-1) @ v


def negated_scores(q, k, v):                     # -(q k^T) * c: a negative scale
    return torch.softmax(-(q @ k.transpose(-2, -1)) * E ** -0.5, -1) @ v


def bool_setitem_fill(q, k, v, pad):            # s[mask] = -inf on the fresh scores
    s = q @ k.transpose(-2, -1) * E ** -0.5
    s[pad.expand_as(s)] = float("-inf")
    return s.softmax(-1) @ v


def inplace_dropout(q, k, v):                   # TNT: nn.Dropout(inplace=True) on the weights, eval mode
    p = torch.nn.functional.dropout((q @ k.transpose(-2, -1)).softmax(-1), 0.1, training=False, inplace=True)
    return p @ v


def keys_first_padding(q, k, v, pad):           # scores laid out (keys, queries): the softmax over dim -2
    s = (k @ q.transpose(-2, -1) * E ** -0.5).masked_fill(pad, -1e9)
    return s.softmax(-2).transpose(-2, -1) @ v


def keys_first_einsum(q, k, v, mask):          # the same in einsum, a float mask with a row per key
    s = torch.einsum("bhjd,bhid->bhji", k, q) + mask
    return torch.einsum("bhji,bhjd->bhid", s.softmax(-2), v)


def keys_first_causal(q, k, v):                 # a causal mask written for (keys, queries) scores
    keep = torch.arange(L)[None, :] >= torch.arange(L)[:, None]   # keep[j, i]: key j at or before query i
    s = torch.where(keep, k @ q.mT, float("-inf"))
    return s.softmax(-2).mT @ v


def keys_first_blind_query(q, k, v):            # a constant mask that hides every key from query 0
    blind = (torch.arange(L) == 0).expand(S, L)
    return (k @ q.mT).masked_fill(blind, -1e9).softmax(-2).mT @ v


def _grid_case(seed=0):
    q, k, v = (_randn(B * H, 6, E, seed=seed + i) for i in range(3))
    return q, k, v, _randn(2, 2, E, seed=seed + 3), _randn(3, 3, E, seed=seed + 4)


def _region_case(seed=0):
    q, k, v = (_randn(B * H, 7, E, seed=seed + i) for i in range(3))
    return q, k, v, _randn(2, 2, E, seed=seed + 3), _randn(3, 3, E, seed=seed + 4)


def _padding(value):                            # batch 1 has every key masked: eager's rows are uniform
    keep = torch.arange(S).expand(B, S) < torch.tensor([[S - 2], [0]])
    return torch.zeros(B, 1, 1, S).masked_fill(~keep[:, None, None], value)


def bhle(seed=0, lk=S):
    return _randn(B, H, L, E, seed=seed), _randn(B, H, lk, E, seed=seed + 1), _randn(B, H, lk, E, seed=seed + 2)


CASES = {
    "diffusers_baddbmm": (diffusers_baddbmm, lambda: tuple(t.reshape(B * H, -1, E) for t in bhle())),
    "diffusers_baddbmm_mask": (diffusers_baddbmm_mask, lambda: (
        *(t.reshape(B * H, -1, E) for t in bhle()),
        torch.zeros(B * H, 1, S).masked_fill(torch.arange(S) >= S - 2, -10000.0))),
    "levit_permuted_k": (levit_permuted_k, lambda: (bhle()[0], bhle()[1].permute(0, 2, 1, 3), bhle()[2])),
    "channels_first": (channels_first, lambda: tuple(t.transpose(-2, -1) for t in bhle())),
    "einsum_blhe": (einsum_blhe, lambda: tuple(t.transpose(1, 2) for t in bhle())),
    "intermediates_kept": (intermediates_kept, bhle),
    "inplace_fill": (inplace_fill, lambda: (*bhle(), torch.arange(S).view(1, 1, 1, S) >= S - 2)),
    "subtracted_padding": (subtracted_padding, lambda: (*bhle(), (torch.arange(S) < S - 2).float().expand(B, S))),
    "subtracted_bias": (subtracted_bias, lambda: (*bhle(), _randn(H, L, S, seed=7))),
    "floored_padding": (floored_padding, lambda: (*bhle(), _padding(torch.finfo(torch.float32).min))),
    "floored_inf_padding": (floored_by_clamp, lambda: (*bhle(), _padding(float("-inf")))),
    "decomposed_rel_pos": (decomposed_rel_pos, _grid_case),
    "region_rel_pos": (region_rel_pos, _region_case),
    "whole_region_rel_pos": (whole_region_rel_pos, _grid_case),
    "negated_scores": (negated_scores, bhle),
    "inplace_scales": (inplace_scales, lambda: (*bhle(), torch.tensor(1.3))),
    "region_iadd": (region_iadd, lambda: (*_region_case()[:3], _randn(6, 6, seed=5))),
    "bool_setitem_fill": (bool_setitem_fill, lambda: (*bhle(), torch.arange(S).view(1, 1, 1, S) >= S - 2)),
    "inplace_dropout": (inplace_dropout, bhle),
    "multi_query_einsum": (multi_query_einsum, lambda: (bhle()[0], _randn(B, S, E, seed=1), _randn(B, S, E, seed=2))),
    "multi_query_tokens_first": (multi_query_tokens_first, lambda: (bhle()[0], _randn(B, S, E, seed=1),
                                                                    _randn(B, S, E, seed=2))),
    "shared_queries": (shared_queries, lambda: (_randn(L, E, seed=0), _randn(B, S, E, seed=1), _randn(B, S, E, seed=2))),
    "keys_first_padding": (keys_first_padding, lambda: (*bhle(), torch.stack(   # batch 1: every key masked
        [torch.arange(S) >= S - 2, torch.ones(S, dtype=torch.bool)]).view(B, 1, S, 1))),
    "keys_first_einsum": (keys_first_einsum, lambda: (*bhle(), _randn(B, 1, S, L, seed=9))),
    "keys_first_causal": (keys_first_causal, lambda: bhle(lk=L)),
    "keys_first_blind_query": (keys_first_blind_query, bhle),
    "value_features": (value_features, lambda: (*bhle()[:2], _randn(B, H, S, 3, E, seed=2))),
    "value_features_reordered": (value_features_reordered, lambda: (
        *bhle()[:2], _randn(B, 3, H, S, E, seed=2), _randn(B, 1, L, S, seed=9))),
    "k_other_dims": (k_other_dims, lambda: (_randn(B, H, L, E, seed=0), _randn(B, E, E, H, seed=1),
                                            _randn(B, H, E, E, seed=2))),
}


@pytest.mark.parametrize("name", list(CASES))
def test_layout_is_rewritten_and_exact(name):
    fn, make = CASES[name]
    args = make()
    r = rewrite(fn, *args)
    assert [(s.kind, s.action) for s in r.report if s.kind == "attention"] == [("attention", "rewritten")], \
        str(r.report)
    assert "graph_attention" in r.after
    w = _randn(*first_output(fn(*args)).shape, seed=11).double()
    check_against_gold(r, fn, args, w, tol=1e-5)


def talking_heads(q, k, v, mix):                # weights mixed across heads after the softmax: not one attention
    p = torch.einsum("bhij,hg->bgij", (q @ k.transpose(-2, -1)).softmax(-1), mix)
    return p @ v


def weights_over_queries(q, k, v):              # the weights contracted over the query index, not the key index
    p = (q @ k.transpose(-2, -1)).softmax(-1)
    return p.transpose(-2, -1) @ v


def intermediates_returned(q, k, v):           # the same copies returned to the caller
    s = q @ k.transpose(-2, -1) * E ** -0.5
    p = s.softmax(-1)
    return p @ v, p.clone()


def scores_subtracted(q, k, v, bias):           # bias - s: the scores negated, not masked
    return (bias - q @ k.transpose(-2, -1)).softmax(-1) @ v


def clamped_at_zero(q, k, v):                    # max(s, 0) changes the scores: not a floor of masked entries
    s = q @ k.transpose(-2, -1)
    return torch.max(s, torch.zeros(())).softmax(-1) @ v


def multi_query_clamped(q, k, v):              # a score_mod on multi-query scores
    s = torch.einsum("bhid,bjd->bhij", q, k)
    return torch.einsum("bhij,bjd->bhid", torch.max(s, torch.zeros(())).softmax(-1), v)


def mask_after_floor(q, k, v, mask):            # the floor would have to apply before this mask only
    s = torch.max(q @ k.transpose(-2, -1), torch.full((), -1e30)) + mask
    return s.softmax(-1) @ v


def floor_cutting_through(q, k, v, mask):       # a floor of -1e4 may clamp scores, not only masked entries
    return (q @ k.transpose(-2, -1) + mask).clamp(min=-1e4).softmax(-1) @ v


def zero_dim_subtracted(q, k, v):                # a 0-d tensor shifts every score alike: left as it is
    return (q @ k.transpose(-2, -1) - torch.tensor(2.0)).softmax(-1) @ v


def view_mixing_indices(q, k, v, bias):        # (B*H, 6, 6) viewed as (B*H, 4, 9): rows mix queries and keys
    s = ((q @ k.transpose(-2, -1)).view(-1, 4, 9) + bias).view(-1, 6, 6)
    return s.softmax(-1) @ v


def softmax_over_split_keys(q, k, v):            # the softmax runs over 3 of each query's 6 keys
    s = (q @ k.transpose(-2, -1)).view(-1, 6, 2, 3).softmax(-1)
    return s.view(-1, 6, 6) @ v


def factor_on_split_view(q, k, v, t):            # a factor constant along 3 keys only: not a factor of q's rows
    s = ((q @ k.transpose(-2, -1)).view(-1, 6, 2, 3) * t).view(-1, 6, 6)
    return s.softmax(-1) @ v


def region_scaled(q, k, v):                      # a region of the scores scaled: not a bias added to it
    s = q @ k.transpose(-2, -1)
    s[:, 1:, 1:] = s[:, 1:, 1:] * 2.0
    return s.softmax(-1) @ v


def region_bias_from_scores(q, k, v):            # the bias added to the region is computed from the scores
    s = q @ k.transpose(-2, -1)
    s[:, 1:, 1:] = s[:, 1:, 1:] + s[:, 1:, 1:].amax(-2, keepdim=True)
    return s.softmax(-1) @ v


def region_strided(q, k, v, b):                  # every other key: a step other than 1
    s = q @ k.transpose(-2, -1)
    s[:, :, ::2] = s[:, :, ::2] + b
    return s.softmax(-1) @ v


def region_keys_first(q, k, v, b):              # a region of scores laid out (keys, queries): not taken
    s = k @ q.transpose(-2, -1)
    s[:, 2:, :5] = s[:, 2:, :5] + b
    return s.softmax(-2).transpose(-2, -1) @ v


def region_value_read_before_a_write(q, k, v, b):   # the value read s before s += 1: eager's region lacks the 1
    s = q @ k.transpose(-2, -1)
    value = s[:, 1:, 1:] + b
    s.add_(torch.ones(()))
    s[:, 1:, 1:] = value
    return s.softmax(-1) @ v


def fill_and_padding_at_minus_1e4(q, k, v, pad):   # old GPT-2: a left-padded query row is masked whole, and eager
    causal = torch.ones(L, L, dtype=torch.bool).tril()  # weighs its scores at the padded keys, not at the filled ones
    return (torch.where(causal, q @ k.mT, -1e4) + pad[:, None, None, :] * -1e4).softmax(-1) @ v


# other pointwise changes than a scale, soft-cap or mask: FlexAttention replays them (a score_mod)
SCORE_MODS = {
    "zero_dim_subtracted": (zero_dim_subtracted, lambda: bhle()),
    "floor_cutting_through": (floor_cutting_through, lambda: (*bhle(), _padding(-1e4 - 2))),
    "clamped_at_zero": (clamped_at_zero, lambda: bhle()),
    "multi_query_clamped": (multi_query_clamped, lambda: (bhle()[0], _randn(B, S, E, seed=1), _randn(B, S, E, seed=2))),
    "mask_after_floor": (mask_after_floor, lambda: (*bhle(), _padding(float("-inf")))),
    "scores_subtracted": (scores_subtracted, lambda: (*bhle(), _randn(H, L, S, seed=7))),
}


@pytest.mark.parametrize("name", list(SCORE_MODS))
def test_other_changes_go_to_flex_attention(name):
    fn, make = SCORE_MODS[name]
    r = rewrite(fn, *make())     # eager's values, rows of NaN included
    assert [(s.action, s.op) for s in r.report if s.kind == "attention"] == [("rewritten", "flex_attention")], \
        str(r.report)


NEAR_MISSES = {
    "view_mixing_indices": (view_mixing_indices, lambda: (*_grid_case()[:3], _randn(4, 9, seed=5))),
    "softmax_over_split_keys": (softmax_over_split_keys, lambda: _grid_case()[:3]),
    "factor_on_split_view": (factor_on_split_view, lambda: (*_grid_case()[:3], _randn(6, 2, 1, seed=5))),
    "intermediates_returned": (intermediates_returned, lambda: bhle()),
    "talking_heads": (talking_heads, lambda: (*bhle(lk=L), _randn(H, H, seed=5))),
    "weights_over_queries": (weights_over_queries, lambda: bhle(lk=L)),
    "region_scaled": (region_scaled, lambda: _region_case()[:3]),
    "region_bias_from_scores": (region_bias_from_scores, lambda: _region_case()[:3]),
    "region_strided": (region_strided, lambda: (*_region_case()[:3], _randn(7, 4, seed=5))),
    "fill_and_padding_at_minus_1e4": (fill_and_padding_at_minus_1e4, lambda: (
        *bhle(lk=L), torch.arange(L).expand(B, L) < torch.tensor([[0], [3]]))),
    "region_keys_first": (region_keys_first, lambda: (_randn(B * H, 6, E, seed=0), _randn(B * H, 7, E, seed=1),
                                                      _randn(B * H, 7, E, seed=2), _randn(5, 5, seed=3))),
    "region_value_read_before_a_write": (region_value_read_before_a_write, lambda: (*_region_case()[:3],
                                                                                    _randn(6, 6, seed=5))),
}


@pytest.mark.parametrize("name", list(NEAR_MISSES))
def test_near_miss_is_not_rewritten(name):
    fn, make = NEAR_MISSES[name]
    r = rewrite(fn, *make())
    assert not any(s.kind == "attention" and s.action == "rewritten" for s in r.report), str(r.report)


def test_floor_with_gradients_is_not_rewritten():
    """Rows the floor lifts whole give eager no gradient through the tie at the floor: not reproduced, so a
    floored site that needs gradients is left to Inductor."""
    args = [t.requires_grad_() for t in bhle()] + [_padding(float("-inf"))]
    r = rewrite(floored_by_clamp, *args, check_values=False)
    assert [s.action for s in r.report if s.kind == "attention"] == ["skipped"], str(r.report)


def shifted_by_row_max(q, k, v, m):
    s = q @ k.mT * 0.3 + m
    return (s - s.amax(-1, keepdim=True)).softmax(-1) @ v


def shifted_by_logsumexp(q, k, v, m):
    s = q @ k.mT * 0.3 + m
    return (s - torch.logsumexp(s, -1, keepdim=True)).softmax(-1) @ v


def shifted_then_scaled(q, k, v, m):               # (s - max) * c: the shift scaled is still one per row
    s = q @ k.mT
    return ((s - s.max(-1).values.unsqueeze(-1)) * 0.3 + m).softmax(-1) @ v


def shifted_by_unsqueezed_max(q, k, v, m):        # amax without keepdim, its dim given back by indexing
    s = q @ k.mT * 0.3 + m
    return (s - s.amax(-1)[..., None]).softmax(-1) @ v


def softcapped_after_shift(q, k, v, m):            # tanh((s - max) / c): the cap sees the shift
    s = q @ k.mT + m
    return (torch.tanh((s - s.amax(-1, keepdim=True)) / 5.0) * 5.0).softmax(-1) @ v


def shifted_by_another_rows_statistic(q, k, v, m):    # finfo.min rows in m: s - lse(s + m) rounds s away
    s = q @ k.mT * 0.3
    return (s - torch.logsumexp(s + m, -1, keepdim=True)).softmax(-1) @ v


def shifted_by_column_max(q, k, v, m):         # a statistic over the query index varies along the keys
    s = q @ k.mT * 0.3
    return (s - s.amax(-2, keepdim=True)).softmax(-1) @ v


@pytest.mark.parametrize("fn", [shifted_by_row_max, shifted_by_logsumexp, shifted_then_scaled,
                                shifted_by_unsqueezed_max])
def test_a_shift_of_each_row_is_dropped(fn):
    """Softmax is invariant to a per-row shift (a statistic of the row, as a stable softmax subtracts)."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 8, generator=gen) for _ in range(3))
    m = torch.zeros(2, 1, 5, 5)
    m[0, ..., :2] = torch.finfo(torch.float32).min
    r = rewrite(fn, q, k, v, m)
    site = next(s for s in r.report if s.kind == "attention")
    assert site.action == "rewritten" and "row shift dropped" in site.detail, str(r.report)
    check_against_gold(r, fn, (q, k, v, m), torch.randn(2, 3, 5, 8, generator=gen).double(), tol=1e-5)
    swapped = rewrite(fn, q, k, v, m, options={"attention_normalizer": "softpick", "cpu": "rewrite"},
                      check_values=False)
    assert "shifted per row" in next(s for s in swapped.report if s.kind == "attention").reason


@pytest.mark.parametrize("fn,why", [(shifted_by_column_max, "varying along the keys"),
                                    (shifted_by_another_rows_statistic, "other than their own row max"),
                                    (softcapped_after_shift, "")])
def test_other_statistics_are_no_row_shift(fn, why):
    q, k, v = (torch.randn(2, 3, 5, 8) for _ in range(3))
    r = rewrite(fn, q, k, v, torch.zeros(5, 5))
    site = next(s for s in r.report if s.kind == "attention")
    assert site.action == "skipped" and why in site.reason, str(r.report)


def written_out_softmax(q, k, v, m):              # the stable softmax by hand, as nanoGPT-era code writes it
    s = (q @ k.mT * 0.35).masked_fill(~m.bool(), -1e9)
    e = torch.exp(s - s.max(-1, keepdim=True)[0])
    return (e / e.sum(-1, keepdim=True)) @ v


def weights_masked_after_softmax(q, k, v, m):     # not renormalized: rows no longer sum to 1
    return ((q @ k.mT * 0.35).softmax(-1) * m) @ v


def weights_over_the_queries(q, k, v, m):
    return (q @ k.mT).softmax(-1).mT @ v


def test_a_softmax_written_out_is_attention():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 8, generator=gen) for _ in range(3))
    m = torch.ones(2, 1, 1, 5)
    m[0, ..., :2] = 0
    r = rewrite(written_out_softmax, q, k, v, m)
    assert [s.action for s in r.report if s.kind == "attention"] == ["rewritten"], str(r.report)
    check_against_gold(r, written_out_softmax, (q, k, v, m), torch.randn(2, 3, 5, 8, generator=gen).double(),
                       tol=1e-5)


def weights_mixed_over_heads(q, k, v, m):        # talking heads after the softmax
    return torch.einsum("bhij,bhjd->bhid", torch.einsum("bhij,hg->bgij", (q @ k.mT).softmax(-1), m[0, 0]), v)


def weights_heads_before_batch(q, k, v, m):     # the contraction reads the weights' batch dims swapped
    return torch.einsum("bhij,hbjd->hbid", (q @ k.mT).softmax(-1), v.transpose(0, 1))


@pytest.mark.parametrize("fn,why", [(weights_masked_after_softmax, "changed after the softmax"),
                                    (weights_over_the_queries, "contracted over the query index"),
                                    (weights_mixed_over_heads, "mixed over another index"),
                                    (weights_heads_before_batch, "in a layout the fused op does not take")])
def test_weights_read_otherwise_are_reported_not_rewritten(fn, why):
    q, k, v = (torch.randn(2, 3, 5, 8) for _ in range(3))
    r = rewrite(fn, q, k, v, torch.ones(2, 1, 3, 3) if fn is weights_mixed_over_heads else torch.ones(2, 1, 1, 5))
    att = [s for s in r.report if s.kind == "attention"]
    assert [s.action for s in att] == ["skipped"] and why in att[0].reason, str(r.report)


def residual_scores(x, wq, wk, v):              # residual attention: layer 2 adds layer 1's scores before its softmax
    s1 = (x @ wq) @ (x @ wk).mT * 0.3
    h = s1.softmax(-1) @ v
    s2 = (h @ wq) @ (h @ wk).mT * 0.3 + s1
    return s2.softmax(-1) @ v, s1


def test_a_previous_layers_scores_are_a_bias():
    """Layer 1's scores are returned (read outside its attention: kept); to layer 2 they are an additive bias that
    does not depend on layer 2's scores, so layer 2 is one attention call."""
    args = (_randn(B, H, L, E, seed=0), _randn(E, E, seed=1), _randn(E, E, seed=2), _randn(B, H, L, E, seed=3))
    r = rewrite(residual_scores, *args)
    assert [s.action for s in r.report if s.kind == "attention"] == ["skipped", "rewritten"], str(r.report)
    check_against_gold(r, residual_scores, args, _randn(B, H, L, E, seed=4).double(), tol=1e-5)
