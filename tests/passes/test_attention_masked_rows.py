"""Query rows whose every key is masked, by fills (``masked_fill`` / ``where``) and additive masks together, in
any order and with any masking values: the rewritten graph gives eager's forward values, and eager's gradients
(where fills and additive masks both mask such a row, only where the loss reads no such row:
docs/attention.md, "Limits"). Also a scale after a soft-cap (folded into the cap) and the cases that stay skipped.
"""

from __future__ import annotations

import math

import pytest
import torch

from pass_helpers import rewrite

B, H, L, E = 2, 2, 5, 8
MIN = torch.finfo(torch.float32).min
CAUSAL = torch.ones(L, L, dtype=torch.bool).tril()
PAD = torch.ones(B, L, dtype=torch.bool)
PAD[0, :2] = False                       # left padding: batch 0's first two keys


def _pad(value):
    return torch.where(PAD, 0.0, value)[:, None, None, :]


def where_min_then_pad(q, k, v, m):
    s = torch.where(CAUSAL, q @ k.transpose(-1, -2) / math.sqrt(E), MIN)
    return (s + m).softmax(-1) @ v


def pad_then_where_min(q, k, v, m):
    s = q @ k.transpose(-1, -2) / math.sqrt(E) + m
    return torch.where(CAUSAL, s, MIN).softmax(-1) @ v


def fill_1e4_then_pad(q, k, v, m):
    s = (q @ k.transpose(-1, -2) / math.sqrt(E)).masked_fill(~CAUSAL, -1e4)
    return (s + m).softmax(-1) @ v


def pad_then_fill_1e4(q, k, v, m):
    s = (q @ k.transpose(-1, -2) / math.sqrt(E) + m).masked_fill(~CAUSAL, -1e4)
    return s.softmax(-1) @ v


def known(fn, value):
    """``fn`` with its padding mask built in the graph from a bool ``keep`` (its values known when compiling)."""
    def padded(q, k, v, keep):
        return fn(q, k, v, torch.where(keep, 0.0, value)[:, None, None, :])
    padded.__name__ = f"{fn.__name__}_at_{value:g}"
    return padded


def fill_inf_then_fill_min(q, k, v, m):
    s = (q @ k.transpose(-1, -2) / math.sqrt(E)).masked_fill(~PAD[:, None, None, :], float("-inf"))
    return s.masked_fill(~CAUSAL, MIN).softmax(-1) @ v


CASES = [(where_min_then_pad, MIN), (pad_then_where_min, MIN), (known(fill_1e4_then_pad, float("-inf")), PAD),
         (known(pad_then_fill_1e4, -1e9), PAD), (known(pad_then_fill_1e4, MIN), PAD), (fill_inf_then_fill_min, 0.0)]


def _qkv():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(B, H, L, E, generator=g) * 2 for _ in range(3)]


@pytest.mark.parametrize("fn,pad_value", CASES, ids=lambda x: x.__name__ if callable(x) else
                         "keep" if isinstance(x, torch.Tensor) else f"{x:g}")
def test_fully_masked_rows_forward_and_gradients(fn, pad_value):
    q, k, v = _qkv()
    m = pad_value if isinstance(pad_value, torch.Tensor) else _pad(pad_value)
    r = rewrite(fn, q, k, v, m, check_values=False, located=() if m is PAD else None)   # known(): fn's line
    assert [s.action for s in r.report if s.kind == "attention"] == ["rewritten"], str(r.report)
    ins = [[t.clone().requires_grad_() for t in (q, k, v)] for _ in range(2)]
    mine = {id(a): b for a, b in zip((q, k, v), ins[0])}      # the graph also lifts the global masks
    got = r.gm(*[mine.get(id(a), a) for a in r.inputs])[0]
    want = fn(*ins[1], m)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    w = torch.randn(want.shape, generator=torch.Generator().manual_seed(1))
    w[0, :, :2] = 0                      # batch 0's padded query rows carry no loss
    for a, b in zip(torch.autograd.grad((got * w).sum(), ins[0]), torch.autograd.grad((want * w).sum(), ins[1])):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_finite_fill_beside_a_mask_of_unknown_values_is_not_merged():
    """``where(causal, s, -1e4) + m`` with ``m`` a graph input that masks at -1e4 too: in a left-padded query row
    eager weighs the scores at the padded past keys and not at the filled future ones, which one merged mask
    cannot say; the site is skipped (its values unknown when compiling) and the graph gives eager's values."""
    q, k, v = _qkv()
    r = rewrite(fill_1e4_then_pad, q, k, v, _pad(-1e4))
    att = [s for s in r.report if s.kind == "attention"]
    assert [s.action for s in att] == ["skipped"] and "may mask too" in att[0].reason, str(r.report)


def test_a_scaled_mask_of_unknown_values_beside_a_finite_fill_is_not_merged():
    """``m * 0.5`` holds whatever ``m`` does, halved: a float ``m`` of -2e4 masks at -1e4 too."""
    q, k, v = _qkv()
    r = rewrite(lambda q, k, v, m: fill_1e4_then_pad(q, k, v, m * 0.5), q, k, v, _pad(-2e4), located=())
    assert [s.action for s in r.report if s.kind == "attention"] == ["skipped"], str(r.report)


def test_bool_mask_added_beside_a_finite_fill_still_merges():
    """An added bool / int mask holds 0 and 1 only, never a masking value: the merge is eager's."""
    q, k, v = _qkv()
    r = rewrite(fill_1e4_then_pad, q, k, v, PAD[:, None, None, :])
    assert [s.action for s in r.report if s.kind == "attention"] == ["rewritten"], str(r.report)


def hf_mask_gqa(q, k, v, m):                            # transformers' eager attention: one 0 / min mask
    k, v = (t.repeat_interleave(H // k.shape[1], dim=1) for t in (k, v))
    return ((q @ k.mT) / math.sqrt(E) + m).softmax(-1) @ v


def hf_mask_softcap(q, k, v, m):                         # Gemma 2: the mask after a soft-cap of the scores
    return (5.0 * torch.tanh((q @ k.mT) / math.sqrt(E) / 5.0) + m).softmax(-1) @ v


@pytest.mark.parametrize("fn,kv_heads,value,scale", [(hf_mask_gqa, H, MIN, 1.0), (hf_mask_gqa, 1, MIN, 1.0),
                                                     (hf_mask_gqa, H, -1e9, 0.5), (hf_mask_softcap, H, MIN, 1.0)])
def test_padded_rows_under_one_additive_mask_keep_eagers_gradients(fn, kv_heads, value, scale):
    """Left padding under a causal mask, as one 0 / finfo.min mask (transformers' eager attention): the padded
    query rows' scores round away in eager but still get a gradient; the loss reads those rows too. -1e9
    rounds away scores below 32, here all of them."""
    q, k, v = _qkv()
    q, k, v = q * scale, k[:, :kv_heads] * scale, v[:, :kv_heads]
    m = torch.where(CAUSAL & PAD[:, None, None, :], 0.0, value)
    r = rewrite(fn, q, k, v, m, check_values=False)
    assert [s.action for s in r.report if s.kind == "attention"] == ["rewritten"], str(r.report)
    ins = [[t.clone().requires_grad_() for t in (q, k, v)] for _ in range(2)]
    mine = {id(a): b for a, b in zip((q, k, v), ins[0])}
    got = r.gm(*[mine.get(id(a), a) for a in r.inputs])[0]
    want = fn(*ins[1], m)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    w = torch.randn(want.shape, generator=torch.Generator().manual_seed(1))
    for a, b in zip(torch.autograd.grad((got * w).sum(), ins[0]), torch.autograd.grad((want * w).sum(), ins[1])):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def softcap_then_scale(q, k, v):
    s = 5.0 * torch.tanh((q @ k.transpose(-2, -1)) / 5.0)
    return (s * 0.25).softmax(-1) @ v           # a temperature after the cap: (0.25 * 5) * tanh(0.25 s / 1.25)


def softcap_then_tensor_scale(q, k, v, t):
    s = 5.0 * torch.tanh((q @ k.transpose(-2, -1)) / 5.0)
    return (s / t).softmax(-1) @ v


def test_scale_after_softcap_is_folded_into_the_cap():
    q, k, v = _qkv()
    r = rewrite(softcap_then_scale, q, k, v)
    assert r.site.action == "rewritten" and "softcap=1.25" in r.site.detail, str(r.report)


def test_runtime_scale_after_softcap_goes_to_flex_attention():
    """A scale known only at run time after the soft-cap is no cap of the op's: FlexAttention replays both."""
    q, k, v = _qkv()
    r = rewrite(softcap_then_tensor_scale, q, k, v, torch.tensor(1.7))
    att = [s for s in r.report if s.kind == "attention"]
    assert [(s.action, s.op) for s in att] == [("rewritten", "flex_attention")], str(r.report)


def sdpa_size_scale(q, k, v):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=1 / math.sqrt(q.size(-1)))


def test_sdpa_symbolic_scale_with_a_normalizer_under_dynamic_shapes():
    """A size-dependent SDPA ``scale`` is symbolic under ``dynamic=True``: folded into q, not an error."""
    import smxcompile

    q, k, v = _qkv()
    torch._dynamo.reset()
    f = torch.compile(sdpa_size_scale, backend="smx", dynamic=True,
                      options={"attention_normalizer": "softmax1", "cpu": "rewrite"})
    got = f(q, k, v)
    assert [s.action for s in smxcompile.last_report() if s.kind == "attention"] == ["rewritten"]
    want = smxcompile.attention(q, k, v, scale=1 / math.sqrt(E), normalizer="softmax1")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def masked_fill_inplace(q, k, v, m):
    s = q @ k.transpose(-2, -1)
    s.masked_fill_(m, float("-inf"))
    return s.softmax(-1) @ v


def masked_fill_inplace_observed(q, k, v, m):
    s = q @ k.transpose(-2, -1)
    raw = s.sum()                       # reads the scores before the fill: the fill must stay where it is
    s.masked_fill_(m, float("-inf"))
    return s.softmax(-1) @ v, raw


def test_inplace_fill_on_fresh_scores_is_rewritten():
    q, k, v = _qkv()
    r = rewrite(masked_fill_inplace, q, k, v, ~CAUSAL)
    att = [s for s in r.report if s.kind == "attention"]
    assert [s.action for s in att] == ["rewritten"], str(r.report)
    r = rewrite(masked_fill_inplace_observed, q, k, v, ~CAUSAL)
    att = [s for s in r.report if s.kind == "attention"]
    assert [s.action for s in att] == ["skipped"] and "read outside" in att[0].reason, str(r.report)


def _additive(q, k, v, mask):
    return torch.softmax(q @ k.transpose(-2, -1) + mask, -1) @ v


@pytest.mark.parametrize("value", [-1e9, torch.finfo(torch.float32).min])
def test_additive_mask_row_wholly_absorbing_gradients(value):
    """A row whose additive mask absorbs the scores: eager's fp32 weights are uniform where fp64's are not, and
    torch's fused CPU backward recomputes exp(s - lse) with lse rounded to the mask value; the gradients of q, k
    and v must still be no further from fp64 than eager's."""
    from pass_helpers import check_against_gold

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 6, 8, generator=gen) for _ in range(3))
    mask = torch.zeros(6, 6)
    mask[2] = value
    r = rewrite(_additive, q, k, v, mask)
    assert [s.action for s in r.report if s.kind == "attention"] == ["rewritten"]
    check_against_gold(r, _additive, (q, k, v, mask), torch.randn(2, 3, 6, 8, generator=gen).double(), tol=1e-5)


def _half_qkv():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, 1, 4, 8, generator=g).half() for _ in range(3)]


DEAD = torch.zeros(4, 4, dtype=torch.bool)
DEAD[1] = True                                         # query 1 sees no key


def upcast_fill_then_add(q, k, v, pad):               # the mask lands on scores cast up from fp16
    return ((q @ k.mT).float().masked_fill(DEAD, -1e9) + pad).softmax(-1).to(q.dtype) @ v


def upcast_fill(q, k, v):                              # a fill beyond fp16's range: masks at its min
    return (q @ k.mT).float().masked_fill(DEAD, -1e9).softmax(-1).to(q.dtype) @ v


def int_mask_fp16(q, k, v, m):                         # int64 + fp16 scores: -70000 is -inf in eager
    return (q @ k.mT + m).softmax(-1) @ v


def two_min_masks(q, k, v, c):                         # min + min overflows to -inf: eager's row is NaN
    s = q @ k.mT + torch.where(c, 0.0, MIN) + torch.where(c, 0.0, MIN)
    return s.softmax(-1) @ v


@pytest.mark.parametrize("fn,extra,op", [
    (upcast_fill_then_add, lambda: [torch.zeros(4)], "flex_attention"),
    (upcast_fill, lambda: [], "scaled_dot_product_attention"),
    (int_mask_fp16, lambda: [torch.where(DEAD, -70000, 0)], "scaled_dot_product_attention"),
    (two_min_masks, lambda: [~DEAD], "scaled_dot_product_attention")])
def test_masks_beyond_the_kernels_range_keep_eagers_rows(fn, extra, op):
    """Masking values that overflow where the fused kernel runs, or sum to -inf: eager's fully masked row
    (uniform, or NaN) either way; a mask added to scores cast up from fp16 is not added in fp16 by the SDPA
    form (FlexAttention's score_mod replays it in fp32)."""
    q, k, v = _half_qkv()
    args = [q, k, v, *extra()]
    if fn is two_min_masks:
        args[:3] = [t.float() for t in args[:3]]
    r = rewrite(fn, *args, check_values=False)
    assert [(s.action, s.op) for s in r.report if s.kind == "attention"] == [("rewritten", op)], str(r.report)
    torch.testing.assert_close(r.gm(*r.inputs)[0], fn(*args), atol=2e-3, rtol=2e-3, equal_nan=True)


def isub_bias(q, k, v, b):
    s = q @ k.mT
    s -= b
    return s.softmax(-1) @ v


def sub_inplace_bias(q, k, v, b):
    s = q @ k.mT
    s.sub_(b)
    return s.softmax(-1) @ v


@pytest.mark.parametrize("fn", [isub_bias, sub_inplace_bias])
def test_inplace_subtraction_on_fresh_scores_is_a_negated_mask(fn):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, L, E, generator=g) for _ in range(3))
    bias = torch.randn(B, 1, L, L, generator=g)
    r = rewrite(fn, q, k, v, bias)
    assert [s.action for s in r.report if s.kind == "attention"] == ["rewritten"], str(r.report)


def fill(q, k, v, m):
    return torch.softmax((q @ k.mT * 0.25).masked_fill(m, float("-inf")), -1) @ v


def bias(q, k, v, m):
    return torch.softmax(q @ k.mT * 0.25 + m, -1) @ v


@pytest.mark.parametrize("fn,mask", [(fill, torch.rand(L) > 0.3), (fill, torch.tensor(False)),
                                     (fill, torch.rand(L, 1) > 0.3), (bias, torch.randn(L))],
                         ids=["keys", "0-d", "rows", "1-d bias"])
def test_masks_of_low_rank_broadcast_as_in_eager(fn, mask):
    """A 0-d, (S,) or (L, 1) mask broadcasts over the scores as eager's does."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, L, E, generator=g) for _ in range(3))
    r = rewrite(fn, q, k, v, mask)
    assert [s.action for s in r.report if s.kind == "attention"] == ["rewritten"], str(r.report)


def test_one_query_head_broadcast_over_the_key_heads():
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(B, 1, L, E, generator=g), torch.randn(B, H, L, E, generator=g), \
        torch.randn(B, H, L, E, generator=g)
    r = rewrite(bias, q, k, v, torch.zeros(L, L))
    assert [s.action for s in r.report if s.kind == "attention"] == ["rewritten"], str(r.report)


def test_padded_rows_cost_nothing_without_gradients_and_a_bad_key_stays_in_its_rows(monkeypatch):
    """No key-gradient term is built under no_grad; an inf key gives NaN only in the rows eager gives it."""
    from smxcompile.kernels.attention import masked_rows
    calls = []
    monkeypatch.setattr(masked_rows, "absorbed_key_term", lambda *a, **kw: calls.append(1) or 0.0)
    q, k, v = _qkv()
    m = torch.where(CAUSAL & PAD[:, None, None, :], 0.0, MIN)
    r = rewrite(hf_mask_gqa, q, k, v, m, check_values=False)
    with torch.no_grad():
        r.gm(*r.inputs)
    assert calls == []
    monkeypatch.undo()
    k[1, 0, 3, 0] = float("inf")                      # batch 1 has no padded row
    got = r.gm(*[t.requires_grad_() if t.is_floating_point() and t.dim() == 4 and t.shape[1] == H else t
                 for t in r.inputs])[0].detach()
    torch.testing.assert_close(got, hf_mask_gqa(q, k, v, m), equal_nan=True)
