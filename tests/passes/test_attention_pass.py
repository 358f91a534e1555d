"""Expected-graph tests of the attention matcher/rewrite (smxcompile.passes.attention).

Each spelling of attention from issue 4 is traced with Dynamo, rewritten by :class:`SmxPass` and
compared with an inline expected graph (``EXPECTTEST_ACCEPT=1 pytest tests/passes/test_attention_pass.py``
regenerates them; read the diff). Every rewritten graph is also run against the original function
(``rewrite`` in pass_helpers.py), forward here and forward + backward in ``TestGradients``, so an
expectation can never bless a wrong rewrite. Each spelling has a near-miss that must not match.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from expecttest import TestCase

import smxcompile  # noqa: F401
import smxcompile.backends.smx  # noqa: F401  (compiled_reports)
from smxcompile.options import SmxOptions
from smxcompile.passes import SmxPass
from smxcompile.passes.attention import graph_attention
from smxcompile.passes.policy import cpu_threshold
from pass_helpers import dynamo_graph, rewrite

# These inputs are short (8 keys): on CPU the default policy keeps such sites (see TestCpuPolicy),
# so the spelling tests force the rewrite.
DEFAULT = {"cpu": "rewrite"}


def qkv(b=2, h=4, L=8, S=8, e=16, dtype=torch.float32, hkv=None, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, L, e, generator=g).to(dtype)
    k = torch.randn(b, hkv or h, S, e, generator=g).to(dtype)
    v = torch.randn(b, hkv or h, S, e, generator=g).to(dtype)
    if grad:
        for t in (q, k, v):
            t.requires_grad_(True)
    return q, k, v


def sites(r):
    return [(s.kind, s.action) for s in r.report]


def attn_site(r):
    s = [s for s in r.report if s.kind == "attention"]
    assert len(s) == 1, str(r.report)
    return s[0]


# --------------------------------------------------------------------------- spellings


def plain(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1) * 0.25, dim=-1) @ v


def sqrt_div(q, k, v):
    s = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(q.size(-1))
    return torch.matmul(F.softmax(s, dim=-1), v)


def full_tensor_scale(q, k, v):
    s = q @ k.transpose(-1, -2)
    s = s / torch.full([], q.size(-1) ** 0.5, dtype=s.dtype, device=s.device)
    return s.softmax(-1) @ v


def prescaled_q(q, k, v):
    q = q * q.shape[-1] ** -0.5
    return (q @ k.mT).softmax(dim=-1) @ v


def additive_mask(q, k, v, mask):
    s = q @ k.transpose(-2, -1) * 0.25 + mask
    return torch.softmax(s, -1) @ v


def masked_fill_neg_inf(q, k, v, pad):
    s = (q @ k.transpose(-2, -1)) * 0.25
    s = s.masked_fill(pad[:, None, None, :], float("-inf"))
    return torch.softmax(s, -1) @ v


def masked_fill_finfo_min(q, k, v, pad):
    s = (q @ k.transpose(-2, -1)) * 0.25
    s = s.masked_fill(pad[:, None, None, :], torch.finfo(s.dtype).min)
    return torch.softmax(s, -1) @ v


def gpt2_where_causal(q, k, v):
    L, S = q.size(-2), k.size(-2)
    causal = torch.tril(torch.ones(L, S, dtype=torch.bool, device=q.device))
    s = q @ k.transpose(-1, -2) / (v.size(-1) ** 0.5)
    mask_value = torch.full([], torch.finfo(s.dtype).min, dtype=s.dtype, device=s.device)
    s = torch.where(causal, s, mask_value)
    return torch.softmax(s, -1) @ v


def t5_upcast(q, k, v, bias):
    s = torch.matmul(q, k.transpose(3, 2))
    s = s + bias
    w = F.softmax(s.float(), dim=-1).type_as(s)
    return torch.matmul(w, v)


def dropout_training(q, k, v):
    w = torch.softmax(q @ k.transpose(-2, -1) * 0.25, -1)
    w = F.dropout(w, p=0.1, training=True)
    return w @ v


def dropout_eval(q, k, v):
    w = torch.softmax(q @ k.transpose(-2, -1) * 0.25, -1)
    return F.dropout(w, p=0.1, training=False) @ v


def bmm_3d(q, k, v):
    return torch.bmm(torch.softmax(torch.bmm(q, k.transpose(1, 2)) * 0.25, -1), v)


def bshd_permuted(x_q, x_k, x_v):
    q, k, v = (t.permute(0, 2, 1, 3) for t in (x_q, x_k, x_v))
    out = torch.softmax(q @ k.transpose(-2, -1) * 0.25, -1) @ v
    return out.permute(0, 2, 1, 3)


def repeat_kv(x, n):
    b, h, s, d = x.shape
    return x[:, :, None, :, :].expand(b, h, n, s, d).reshape(b, h * n, s, d)


def gqa_repeat_kv(q, k, v):
    n = q.shape[1] // k.shape[1]
    k, v = repeat_kv(k, n), repeat_kv(v, n)
    return torch.softmax(q @ k.transpose(2, 3) * 0.25, -1) @ v


def gqa_repeat_interleave(q, k, v):
    n = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(n, dim=1), v.repeat_interleave(n, dim=1)
    return torch.softmax(q @ k.transpose(-2, -1) * 0.25, -1) @ v


def softcapped(q, k, v):
    s = q @ k.transpose(-2, -1) * 0.25
    s = 2.0 * torch.tanh(s / 2.0)
    return torch.softmax(s, -1) @ v


def tensor_scale(q, k, v, t):
    return torch.softmax((q @ k.transpose(-2, -1)) * t, -1) @ v


def sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class TestSpellings(TestCase):
    def test_plain_float_scale(self):
        r = rewrite(plain, *qkv(), options=DEFAULT)
        self.assertExpectedInline(r.after, """\
def forward(self, L_k_ : torch.Tensor, L_q_ : torch.Tensor, L_v_ : torch.Tensor):
l_k_ = L_k_
l_q_ = L_q_
l_v_ = L_v_
graph_attention = smxcompile_passes_attention_replacement_graph_attention(l_q_, l_k_, l_v_, [], [], mask_kinds = [], scale = 0.25, softcap = None, is_causal = False, dropout_p = 0.0, n_rep = 1, fixup = '', normalizer = 'softmax', norm_param = None)
return (graph_attention,)""")
        self.assertEqual(sites(r), [("attention", "rewritten")])
        self.assertEqual(attn_site(r).detail, "matmul(q, k^T), scale=0.25")

    def test_sqrt_div(self):
        r = rewrite(sqrt_div, *qkv(), options=DEFAULT)
        self.assertEqual(sites(r), [("attention", "rewritten")])
        self.assertIn("scale=0.25", attn_site(r).detail)

    def test_full_tensor_scale_folded(self):
        r = rewrite(full_tensor_scale, *qkv(), options=DEFAULT)
        self.assertExpectedInline(r.after, """\
def forward(self, L_k_ : torch.Tensor, L_q_ : torch.Tensor, L_v_ : torch.Tensor):
l_k_ = L_k_
l_q_ = L_q_
l_v_ = L_v_
full = torch.full([], 4.0, dtype = torch.float32, device = device(type='cpu'))
graph_attention = smxcompile_passes_attention_replacement_graph_attention(l_q_, l_k_, l_v_, [], [], mask_kinds = [], scale = 0.25, softcap = None, is_causal = False, dropout_p = 0.0, n_rep = 1, fixup = '', normalizer = 'softmax', norm_param = None)
return (graph_attention,)""")

    def test_runtime_tensor_scale_folded_into_q(self):
        r = rewrite(tensor_scale, *qkv(), torch.tensor(0.3), options=DEFAULT)
        self.assertExpectedInline(r.after, """\
def forward(self, L_k_ : torch.Tensor, L_q_ : torch.Tensor, L_t_ : torch.Tensor, L_v_ : torch.Tensor):
l_k_ = L_k_
l_q_ = L_q_
l_t_ = L_t_
l_v_ = L_v_
graph_attention = smxcompile_passes_attention_replacement_graph_attention(l_q_, l_k_, l_v_, [], [(l_t_, 'mul')], mask_kinds = [], scale = 1.0, softcap = None, is_causal = False, dropout_p = 0.0, n_rep = 1, fixup = '', normalizer = 'softmax', norm_param = None)
return (graph_attention,)""")

    def test_prescaled_q(self):
        r = rewrite(prescaled_q, *qkv(), options=DEFAULT)
        self.assertExpectedInline(r.after, """\
def forward(self, L_q_ : torch.Tensor, L_k_ : torch.Tensor, L_v_ : torch.Tensor):
l_q_ = L_q_
l_k_ = L_k_
l_v_ = L_v_
q = l_q_ * 0.25
graph_attention = smxcompile_passes_attention_replacement_graph_attention(q, l_k_, l_v_, [], [], mask_kinds = [], scale = 1.0, softcap = None, is_causal = False, dropout_p = 0.0, n_rep = 1, fixup = '', normalizer = 'softmax', norm_param = None)
return (graph_attention,)""")

    def test_additive_mask(self):
        mask = torch.randn(2, 1, 8, 8)
        r = rewrite(additive_mask, *qkv(), mask, options=DEFAULT, atol=1e-5)
        self.assertExpectedInline(r.after, """\
def forward(self, L_k_ : torch.Tensor, L_q_ : torch.Tensor, L_mask_ : torch.Tensor, L_v_ : torch.Tensor):
l_k_ = L_k_
l_q_ = L_q_
l_mask_ = L_mask_
l_v_ = L_v_
graph_attention = smxcompile_passes_attention_replacement_graph_attention(l_q_, l_k_, l_v_, [l_mask_], [], mask_kinds = [('add', None, None)], scale = 0.25, softcap = None, is_causal = False, dropout_p = 0.0, n_rep = 1, fixup = 'auto', normalizer = 'softmax', norm_param = None)
return (graph_attention,)""")

    def test_masked_fill_neg_inf_keeps_nan_rows(self):
        pad = torch.zeros(2, 8, dtype=torch.bool)
        pad[0, 2:] = True
        pad[1, :] = True   # every key masked: eager gives NaN rows, so must the rewrite
        r = rewrite(masked_fill_neg_inf, *qkv(), pad, options=DEFAULT, check_values=False)
        self.assertExpectedInline(r.after, """\
def forward(self, L_k_ : torch.Tensor, L_q_ : torch.Tensor, L_pad_ : torch.Tensor, L_v_ : torch.Tensor):
l_k_ = L_k_
l_q_ = L_q_
l_pad_ = L_pad_
l_v_ = L_v_
getitem = l_pad_[(slice(None, None, None), None, None, slice(None, None, None))]
graph_attention = smxcompile_passes_attention_replacement_graph_attention(l_q_, l_k_, l_v_, [getitem], [], mask_kinds = [('fill', -inf, None)], scale = 0.25, softcap = None, is_causal = False, dropout_p = 0.0, n_rep = 1, fixup = 'auto', normalizer = 'softmax', norm_param = None)
return (graph_attention,)""")
        out = r.gm(*r.inputs)[0]
        torch.testing.assert_close(out, masked_fill_neg_inf(*qkv(), pad), atol=1e-5, rtol=1e-5, equal_nan=True)
        assert torch.isnan(out[1]).all() and torch.isfinite(out[0]).all()

    def test_masked_fill_finfo_min_keeps_uniform_rows(self):
        pad = torch.zeros(2, 8, dtype=torch.bool)
        pad[1, :] = True   # eager: a uniform average over every key
        r = rewrite(masked_fill_finfo_min, *qkv(), pad, options=DEFAULT, atol=1e-5)
        self.assertEqual(sites(r), [("attention", "rewritten")])

    def test_gpt2_where_causal_becomes_is_causal(self):
        r = rewrite(gpt2_where_causal, *qkv(), options=DEFAULT, atol=1e-5)
        self.assertExpectedInline(r.after, """\
def forward(self, L_q_ : torch.Tensor, L_k_ : torch.Tensor, L_v_ : torch.Tensor):
l_q_ = L_q_
l_k_ = L_k_
l_v_ = L_v_
graph_attention = smxcompile_passes_attention_replacement_graph_attention(l_q_, l_k_, l_v_, [], [], mask_kinds = [], scale = 0.25, softcap = None, is_causal = True, dropout_p = 0.0, n_rep = 1, fixup = '', normalizer = 'softmax', norm_param = None)
return (graph_attention,)""")
        self.assertEqual(attn_site(r).detail, "matmul(q, k^T), causal, scale=0.25")

    def test_t5_unscaled_fp32_upcast_bf16(self):
        q, k, v = qkv(dtype=torch.bfloat16)
        bias = torch.randn(1, 4, 8, 8).to(torch.bfloat16)
        r = rewrite(t5_upcast, q, k, v, bias, options=DEFAULT, check_values=False)
        self.assertExpectedInline(r.after, """\
def forward(self, L_k_ : torch.Tensor, L_q_ : torch.Tensor, L_bias_ : torch.Tensor, L_v_ : torch.Tensor):
l_k_ = L_k_
l_q_ = L_q_
l_bias_ = L_bias_
l_v_ = L_v_
graph_attention = smxcompile_passes_attention_replacement_graph_attention(l_q_, l_k_, l_v_, [l_bias_], [], mask_kinds = [('add', None, None)], scale = 1.0, softcap = None, is_causal = False, dropout_p = 0.0, n_rep = 1, fixup = 'auto', normalizer = 'softmax', norm_param = None)
return (graph_attention,)""")
        # bf16: the fused kernel keeps the scores in fp32, eager rounds them to bf16 first
        gold = t5_upcast(*(t.double() for t in (q, k, v, bias)))
        ours, eager = r.gm(*r.inputs)[0].double(), t5_upcast(q, k, v, bias).double()
        assert ((ours - gold).abs() <= (eager - gold).abs() + 1e-2).all()

    def test_dropout_training_taken_into_the_op(self):
        r = rewrite(dropout_training, *qkv(), options=DEFAULT, check_values=False)
        self.assertIn("dropout_p = 0.1", r.after)
        self.assertIn("dropout p=0.1", attn_site(r).detail)

    def test_dropout_eval_dropped(self):
        r = rewrite(dropout_eval, *qkv(), options=DEFAULT)
        self.assertIn("dropout_p = 0.0", r.after)

    def test_bmm_3d(self):
        q, k, v = (t.reshape(8, 8, 16) for t in qkv())
        r = rewrite(bmm_3d, q, k, v, options=DEFAULT)
        self.assertExpectedInline(r.after, """\
def forward(self, L_k_ : torch.Tensor, L_q_ : torch.Tensor, L_v_ : torch.Tensor):
l_k_ = L_k_
l_q_ = L_q_
l_v_ = L_v_
graph_attention = smxcompile_passes_attention_replacement_graph_attention(l_q_, l_k_, l_v_, [], [], mask_kinds = [], scale = 0.25, softcap = None, is_causal = False, dropout_p = 0.0, n_rep = 1, fixup = '', normalizer = 'softmax', norm_param = None)
return (graph_attention,)""")

    def test_bshd_permuted(self):
        q, k, v = (t.transpose(1, 2).contiguous() for t in qkv())
        r = rewrite(bshd_permuted, q, k, v, options=DEFAULT)
        self.assertEqual(sites(r), [("attention", "rewritten")])

    def test_gqa_repeat_kv(self):
        r = rewrite(gqa_repeat_kv, *qkv(hkv=2), options=DEFAULT)
        self.assertExpectedInline(r.after, """\
def forward(self, L_q_ : torch.Tensor, L_k_ : torch.Tensor, L_v_ : torch.Tensor):
l_q_ = L_q_
l_k_ = L_k_
l_v_ = L_v_
graph_attention = smxcompile_passes_attention_replacement_graph_attention(l_q_, l_k_, l_v_, [], [], mask_kinds = [], scale = 0.25, softcap = None, is_causal = False, dropout_p = 0.0, n_rep = 2, fixup = '', normalizer = 'softmax', norm_param = None)
return (graph_attention,)""")
        self.assertIn("GQA 2 q heads per kv head", attn_site(r).detail)

    def test_gqa_repeat_interleave(self):
        r = rewrite(gqa_repeat_interleave, *qkv(hkv=1), options=DEFAULT)
        self.assertIn("GQA 4 q heads per kv head", attn_site(r).detail)
        self.assertNotIn("repeat_interleave", r.after)

    def test_softcap(self):
        # softcap has no SDPA equivalent: the op's own path (smx::attention)
        r = rewrite(softcapped, *qkv(), options=DEFAULT, atol=1e-5)
        self.assertIn("softcap = 2.0", r.after)
        self.assertIn("softcap=2", attn_site(r).detail)

    def test_sdpa_kept_without_a_normalizer(self):
        r = rewrite(sdpa, *qkv(), options=DEFAULT)
        self.assertFalse(r.changed)
        self.assertEqual(sites(r), [("attention", "kept")])
        self.assertIn("already torch's fused", attn_site(r).reason)


# --------------------------------------------------------------------------- near-misses


def softmax_query_dim(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1) * 0.25, dim=-2) @ v


def mask_from_scores(q, k, v):
    s = q @ k.transpose(-2, -1) * 0.25
    s = s.masked_fill(s < -1.0, float("-inf"))
    return torch.softmax(s, -1) @ v


def additive_from_scores(q, k, v):
    s = q @ k.transpose(-2, -1) * 0.25
    return torch.softmax(s + s.detach().relu(), -1) @ v


def weights_returned(q, k, v):
    w = torch.softmax(q @ k.transpose(-2, -1) * 0.25, -1)
    return w @ v, w


def fill_zero(q, k, v, pad):
    s = (q @ k.transpose(-2, -1)).masked_fill(pad, 0.0)
    return torch.softmax(s, -1) @ v


def tiled_repeat(q, k, v):
    k, v = k.repeat(1, 2, 1, 1), v.repeat(1, 2, 1, 1)
    return torch.softmax(q @ k.transpose(-2, -1) * 0.25, -1) @ v


def softmax_then_weight(x, w):
    return torch.softmax(x * 2.0, -1) @ w


def sliding_window(q, k, v):
    i = torch.arange(q.size(-2))
    keep = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < 3)   # sliding window of 3
    s = (q @ k.transpose(-2, -1) * 0.25).masked_fill(~keep, float("-inf"))
    return torch.softmax(s, -1) @ v


class TestNearMisses(TestCase):
    def test_softmax_over_query_dim(self):
        r = rewrite(softmax_query_dim, *qkv(), options=DEFAULT)
        self.assertEqual(attn_site(r).action, "skipped")
        self.assertIn("not the key index", attn_site(r).reason)
        # guarded: the softmax goes to Inductor as smx::softmax, the rest of the block as written
        self.assertIn("torch.ops.smx.softmax.default", r.after)
        self.assertNotIn("graph_attention", r.after)

    def test_mask_from_the_scores(self):
        r = rewrite(mask_from_scores, *qkv(), options=DEFAULT)
        self.assertFalse(r.changed)
        self.assertEqual(attn_site(r).reason, "the mask depends on the scores")

    def test_additive_mask_from_the_scores(self):
        r = rewrite(additive_from_scores, *qkv(), options=DEFAULT)
        self.assertFalse(r.changed)
        self.assertEqual(attn_site(r).action, "skipped")

    def test_weights_also_returned(self):
        r = rewrite(weights_returned, *qkv(), options=DEFAULT)
        self.assertFalse(r.changed)
        self.assertIn("also read outside the attention", attn_site(r).reason)

    def test_masked_fill_value_that_does_not_mask(self):
        # a fill with 0 changes the scores without masking: FlexAttention replays it
        pad = torch.rand(8, 8) > 0.5
        r = rewrite(fill_zero, *qkv(), pad, options=DEFAULT)
        self.assertEqual((attn_site(r).action, attn_site(r).op), ("rewritten", "flex_attention"))

    def test_gqa_other_spellings(self):
        # the same repeat per kv head: a unit dim inserted after the head dim, broadcast, merged into it
        spellings = (lambda x, n: x.unsqueeze(2).expand(-1, -1, n, -1, -1).flatten(1, 2),
                     lambda x, n: torch.reshape(x.view(*x.shape[:2], 1, *x.shape[2:]).repeat(1, 1, n, 1, 1),
                                                (x.shape[0], -1, *x.shape[2:])))
        for spell in spellings:
            def gqa(q, k, v):
                n = q.shape[1] // k.shape[1]
                return torch.softmax(q @ spell(k, n).mT * 0.25, -1) @ spell(v, n)
            self.assertIn("GQA 2 q heads per kv head", attn_site(rewrite(gqa, *qkv(hkv=2), options=DEFAULT)).detail)

    def test_gqa_only_where_the_kernels_need_no_broadcast(self):
        # V shared across the batch, or one query head over the repeated keys: K and V stay as the graph repeats them
        rep = lambda x: x[:, :, None].expand(-1, -1, 2, -1, -1).flatten(1, 2)  # noqa: E731

        def gqa(q, k, v):
            return torch.softmax(q @ rep(k).mT * 0.25, -1) @ rep(v)
        q, k, v = qkv(hkv=2)
        for args in ((q, k, v[:1]), (q[:, :1], k, v)):
            site = attn_site(rewrite(gqa, *args, options=DEFAULT))
            self.assertEqual(site.action, "rewritten")
            self.assertNotIn("GQA", site.detail)

    def test_unit_dim_elsewhere_is_not_gqa(self):
        # a unit dim inserted after the key index, broadcast and merged into the keys: K and V stay repeated
        def keys_repeated(q, k, v):
            rep = lambda x: x[:, :, :, None].expand(-1, -1, -1, 2, -1).flatten(2, 3)  # noqa: E731
            return torch.softmax(q @ rep(k).mT * 0.25, -1) @ rep(v)
        r = rewrite(keys_repeated, *qkv(), options=DEFAULT)
        self.assertEqual(sites(r), [("attention", "rewritten")])
        self.assertNotIn("GQA", attn_site(r).detail)

    def test_tiled_repeat_is_not_gqa(self):
        # .repeat tiles heads (h -> h % Hkv), unlike repeat_kv (h -> h // n): K/V are passed repeated
        r = rewrite(tiled_repeat, *qkv(hkv=2), options=DEFAULT)
        self.assertEqual(sites(r), [("attention", "rewritten")])
        self.assertNotIn("GQA", attn_site(r).detail)

    def test_a_second_contraction_beside_the_scores_is_a_bias(self):
        # q @ k^T + q @ r^T (a relative-position term computed from q): one attention with an additive bias
        def rel(q, k, v, r):
            return torch.softmax(q @ k.transpose(-2, -1) * 0.25 + q @ r.transpose(-2, -1), -1) @ v
        r = rewrite(rel, *qkv(), torch.randn(2, 4, 8, 16), options=DEFAULT)
        self.assertEqual((attn_site(r).action, attn_site(r).detail), ("rewritten", "matmul(q, k^T), scale=0.25, mask"))

    def test_scores_contracted_again_are_not_attention(self):
        def mixed(q, k, v, m):
            s = q @ k.transpose(-2, -1)
            return torch.softmax(s + s @ m, -1) @ v
        r = rewrite(mixed, *qkv(), torch.randn(8, 8), options=DEFAULT)
        self.assertEqual(attn_site(r).action, "skipped")
        self.assertIn("contracted again", attn_site(r).reason)

    def test_softmax_then_weight_matrix_is_not_attention(self):
        r = rewrite(softmax_then_weight, torch.randn(4, 8), torch.randn(8, 3), options=DEFAULT)
        self.assertNotIn("attention", [s.kind for s in r.report])

    def test_disabled_by_option(self):
        r = rewrite(plain, *qkv(), options={"attention": False})
        self.assertFalse(r.changed)
        self.assertEqual(attn_site(r).reason, "rewrite kind 'attention' disabled by options")

    def test_non_constant_causal_like_mask_stays_a_mask(self):
        # a causal mask passed in as an input is not known at compile time: it stays a mask
        mask = torch.full((8, 8), float("-inf")).triu(1)
        r = rewrite(additive_mask, *qkv(), mask, options=DEFAULT, atol=1e-5)
        self.assertNotIn("causal", attn_site(r).detail)
        self.assertIn("is_causal = False", r.after)

    def test_constant_non_causal_band_stays_a_mask(self):
        r = rewrite(sliding_window, *qkv(), options=DEFAULT, atol=1e-5)
        self.assertEqual(sites(r), [("attention", "rewritten")])
        self.assertIn("is_causal = False", r.after)


# --------------------------------------------------------------------------- gradients through the rewrite


GRAD_CASES = {
    "plain": (plain, lambda: ()),
    "additive_mask": (additive_mask, lambda: (torch.randn(2, 1, 8, 8),)),
    "gpt2_where_causal": (gpt2_where_causal, lambda: ()),
    "gqa_repeat_kv": (gqa_repeat_kv, None),
    "softcap": (softcapped, lambda: ()),
    "bias_with_grad": (t5_upcast, lambda: (torch.randn(1, 4, 8, 8, requires_grad=True),)),
}


@pytest.mark.parametrize("name", list(GRAD_CASES))
def test_compiled_gradients_match_eager(name):
    fn, extra = GRAD_CASES[name]
    q, k, v = qkv(hkv=2 if extra is None else None, grad=True)
    extra = () if extra is None else extra()
    torch._dynamo.reset()
    ref = fn(q, k, v, *extra)
    g_ref = torch.autograd.grad(ref.square().sum(), [q, k, v, *[e for e in extra if e.requires_grad]])
    n0 = len(smxcompile.backends.smx.compiled_reports)
    out = torch.compile(fn, backend="smx", options=DEFAULT)(q, k, v, *extra)
    g = torch.autograd.grad(out.square().sum(), [q, k, v, *[e for e in extra if e.requires_grad]])
    report = smxcompile.backends.smx.compiled_reports[n0]
    assert report.count(kind="attention", action="rewritten") == 1, str(report)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_graph_attention_fixup_rows_match_eager_softmax():
    """The fully-masked-row fix-up alone: NaN for -inf fills, the uniform mean for finite ones."""
    q, k, v = qkv()
    pad = torch.zeros(2, 1, 1, 8, dtype=torch.bool)
    pad[1] = True
    for value in (float("-inf"), -1e9):
        s = (q @ k.transpose(-2, -1) * 0.25).masked_fill(pad, value)
        ref = torch.softmax(s, -1) @ v
        got = graph_attention(q, k, v, [pad], [], mask_kinds=[("fill", value, None)], scale=0.25, softcap=None,
                              is_causal=False, dropout_p=0.0, n_rep=1, fixup="auto", normalizer="softmax", norm_param=None)
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5, equal_nan=True)


def test_pass_is_idempotent():
    gm = dynamo_graph(plain, *qkv())
    p = SmxPass(SmxOptions())
    p(gm.graph)
    once = gm.graph.python_code("self").src
    p(gm.graph)
    assert gm.graph.python_code("self").src == once


# --------------------------------------------------------------------------- normalizer option


def test_normalizer_option_rewrites_sdpa_and_eager_spellings():
    for fn in (plain, sdpa):
        r = rewrite(fn, *qkv(), options={"attention_normalizer": "sigmoid"}, check_values=False)
        s = attn_site(r)
        assert s.action == "rewritten" and "normalizer=sigmoid" in s.detail, s
        q, k, v = qkv()
        got = r.gm(*r.inputs)[0]
        from smxcompile.kernels.attention import attention_reference

        want = attention_reference(q.double(), k.double(), v.double(), is_causal=fn is sdpa,
                                   scale=0.25 if fn is plain else None, normalizer="sigmoid")
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_normalizer_with_learned_bias_is_skipped():
    q, k, v = qkv()
    bias = torch.randn(1, 4, 8, 8, requires_grad=True)
    r = rewrite(t5_upcast, q, k, v, bias, options={"attention_normalizer": "ssmax"}, check_values=False)
    assert attn_site(r).action == "skipped" and "needs a gradient" in attn_site(r).reason


def test_compiled_dropout_draws_a_fresh_seed_each_call():
    # the op route (a normalizer) with dropout: the seed must be a graph op, not a constant of the trace
    q, k, v = qkv()
    f = torch.compile(dropout_training, backend="smx", options={"attention_normalizer": "softmax1"})
    torch.manual_seed(0)
    a = f(q, k, v)
    b = f(q, k, v)
    assert not torch.equal(a, b)
    torch.manual_seed(0)
    assert torch.equal(f(q, k, v), a)


# --------------------------------------------------------------------------- the check option


def _compile_report(fn, options):
    n0 = len(smxcompile.backends.smx.compiled_reports)
    f = torch.compile(fn, backend="smx", options=options)
    return f, lambda: smxcompile.backends.smx.compiled_reports[n0]


def test_check_option_passes_on_an_attention_site():
    torch._dynamo.reset()
    mask = torch.randn(2, 1, 8, 8)
    f, report = _compile_report(additive_mask, {"check": True, **DEFAULT})
    torch.testing.assert_close(f(*qkv(), mask), additive_mask(*qkv(), mask), atol=1e-5, rtol=1e-5)
    assert [(s.kind, s.action) for s in report()] == [("attention", "rewritten")]


def test_check_option_rejects_a_wrong_attention_rewrite(monkeypatch):
    # a rewrite that ignores the mask is caught on the example inputs and the site is put back
    import smxcompile.passes.attention.rewrite as A

    real = A.graph_attention

    def no_mask(q, k, v, masks, *a, mask_kinds, **kw):
        return real(q, k, v, [], *a, mask_kinds=[], **kw)

    monkeypatch.setattr(A, "graph_attention", no_mask)
    torch._dynamo.reset()
    mask = torch.randn(2, 1, 8, 8) * 4
    f, report = _compile_report(additive_mask, {"check": True, **DEFAULT})
    torch.testing.assert_close(f(*qkv(), mask), additive_mask(*qkv(), mask), atol=1e-5, rtol=1e-5)
    site = report().sites[0]
    assert (site.kind, site.action) == ("attention", "kept") and site.reason.startswith("check failed"), site
    assert [(s.kind, s.action) for s in report()] == [("attention", "kept"), ("softmax", "kept")]


class ScaledAttention(torch.nn.Module):
    """Like transformers' attention: the scale is a Python float attribute (a graph input under dynamic=True)."""

    def __init__(self, head_dim):
        super().__init__()
        self.scaling = head_dim ** -0.5

    def forward(self, q, k, v, mask):
        s = torch.matmul(q, k.transpose(2, 3)) * self.scaling + mask
        return torch.matmul(F.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype), v)


def test_dynamic_shapes_two_lengths():
    torch._dynamo.reset()
    mod = ScaledAttention(16)
    f = torch.compile(mod, backend="smx", dynamic=True, options=DEFAULT)
    n0 = len(smxcompile.backends.smx.compiled_reports)
    for L in (8, 11):
        q, k, v = qkv(L=L, S=L)
        mask = torch.randn(2, 1, L, L)
        torch.testing.assert_close(f(q, k, v, mask), mod(q, k, v, mask), atol=1e-5, rtol=1e-5)
    rep = smxcompile.backends.smx.compiled_reports[n0]
    assert [(s.kind, s.action) for s in rep] == [("attention", "rewritten")], str(rep)


def test_nan_in_q_or_k_stays_nan_like_eager():
    # torch's fused CPU kernel returns 0 for a NaN query row; eager attention gives NaN, so must the rewrite
    q, k, v = qkv()
    q[0, 1, 3, 2] = float("nan")
    k[1, 2, 5, 0] = float("nan")
    r = rewrite(plain, q, k, v, options=DEFAULT, check_values=False)
    got, want = r.gm(*r.inputs)[0], plain(q, k, v)
    assert torch.equal(got.isnan(), want.isnan())
    torch.testing.assert_close(got.nan_to_num(), want.nan_to_num(), atol=1e-5, rtol=1e-5)


def causal_inside(q, k, v):
    L = q.shape[-2]
    keep = torch.ones(L, L, dtype=torch.bool).tril()
    s = (q @ k.transpose(-2, -1) * 0.25).masked_fill(~keep, torch.finfo(q.dtype).min)
    return torch.softmax(s, -1) @ v


def causal_given(q, k, v, mask):
    s = q @ k.transpose(-2, -1) * 0.25 + mask
    return torch.softmax(s, -1) @ v


@pytest.mark.parametrize("normalizer", ["ssmax", "sigmoid", "relu", "softplus", "softpick"])
def test_variant_same_math_whatever_the_causal_mask_spelling(normalizer):
    """A causal mask built in the graph (becomes is_causal) and the same mask passed in as a finfo.min
    tensor give the same variant: n counts the keys a row may see, masking values are masked keys."""
    q, k, v = qkv()
    mask = torch.zeros(8, 8).masked_fill(~torch.ones(8, 8, dtype=torch.bool).tril(), torch.finfo(torch.float32).min)
    opts = {"attention_normalizer": normalizer}
    a = rewrite(causal_inside, q, k, v, options=opts, check_values=False)
    b = rewrite(causal_given, q, k, v, mask, options=opts, check_values=False)
    assert "causal" in attn_site(a).detail and "mask" in attn_site(b).detail
    torch.testing.assert_close(a.gm(*a.inputs)[0], b.gm(*b.inputs)[0], atol=1e-5, rtol=1e-5)


def inplace_scores(q, k, v, mask):
    s = q @ k.transpose(-2, -1)
    s += mask
    return torch.softmax(s, -1) @ v


def test_inplace_score_update_is_rewritten():
    # ``s += mask`` on a fresh score tensor nothing else reads (T5); the near-misses are in test_sdpa_spellings.py
    r = rewrite(inplace_scores, *qkv(), torch.randn(8, 8), options=DEFAULT)
    assert attn_site(r).action == "rewritten", attn_site(r)


def test_norm_param_without_a_parameter_is_an_option_error():
    with pytest.raises(ValueError, match="has no parameter"):
        SmxOptions.from_mapping({"attention_normalizer": "sparsemax", "attention_norm_param": 0.5})
    with pytest.raises(ValueError, match="has no parameter"):
        SmxOptions.from_mapping({"attention_norm_param": 0.5})



class TestCpuPolicy(TestCase):
    def test_short_cpu_attention_kept_with_its_reason(self):
        r = rewrite(plain, *qkv(), options={})
        self.assertFalse(r.changed)
        s = attn_site(r)
        self.assertEqual(s.action, "kept")
        self.assertIn(f"CPU: 8 keys; below {cpu_threshold('attention_min_keys')}", s.reason)

    def test_long_cpu_attention_rewritten_by_default(self):
        r = rewrite(plain, *qkv(b=1, h=1, L=4, S=cpu_threshold("attention_min_keys"), e=8), options={})
        self.assertEqual(sites(r), [("attention", "rewritten")])

    def test_bf16_cpu_attention_rewritten_from_its_own_threshold(self):
        need = cpu_threshold("attention_bf16_min_keys")
        r = rewrite(plain, *qkv(b=1, h=1, L=4, S=need // 2, e=8, dtype=torch.bfloat16), options={})
        self.assertIn(f"CPU: {need // 2} keys; below {need}", attn_site(r).reason)
        r = rewrite(plain, *qkv(b=1, h=1, L=4, S=need, e=8, dtype=torch.bfloat16), options={}, check_values=False)
        self.assertEqual(sites(r), [("attention", "rewritten")])
        # fp16 keeps the fp32 threshold (Inductor's fp16 matmuls are slow on CPU)
        r = rewrite(plain, *qkv(b=1, h=1, L=4, S=need // 2, e=8, dtype=torch.float16), options={}, check_values=False)
        self.assertEqual(sites(r), [("attention", "rewritten")])

    def test_variant_rewritten_whatever_the_length(self):
        r = rewrite(plain, *qkv(), options={"attention_normalizer": "sigmoid"}, check_values=False)
        self.assertEqual(sites(r), [("attention", "rewritten")])

    def test_cpu_keep(self):
        r = rewrite(plain, *qkv(b=1, h=1, L=4, S=512, e=8), options={"cpu": "keep"})
        self.assertEqual(attn_site(r).reason, "options cpu='keep'")


def test_options_instance_is_validated_too():
    with pytest.raises(ValueError, match="attention_normalizer"):
        SmxOptions.from_mapping(SmxOptions(attention_normalizer="bogus"))
    opts = SmxOptions.from_mapping({"cpu": "rewrite", "disable": ["softmax"], "inductor": {"max_autotune": False}})
    assert SmxOptions.from_mapping(opts) == opts


def einsum_attention(q, k, v):
    s = torch.einsum("bhqd,bhkd->bhqk", q, k) * 0.25
    return torch.einsum("bhqk,bhkd->bhqd", torch.softmax(s, dim=-1), v)


def einsum_ellipsis(q, k, v):
    s = torch.einsum("...id,...jd->...ij", q, k) / 4.0
    return torch.einsum("...ij,...jd->...id", s.softmax(-1), v)


def einsum_scores_transposed(q, k, v):
    # scores laid out (keys, queries): the softmax over the last dim normalizes over queries
    s = torch.einsum("bhqd,bhkd->bhkq", q, k) * 0.25
    return torch.einsum("bhkq,bhqd->bhkd", torch.softmax(s, dim=-1), v)


class TestEinsum(TestCase):
    def test_einsum_spelling(self):
        r = rewrite(einsum_attention, *qkv(), options=DEFAULT)
        self.assertEqual(sites(r), [("attention", "rewritten")])
        self.assertEqual(attn_site(r).detail, "einsum(q, k^T), scale=0.25")
        self.assertNotIn("einsum", r.after)

    def test_einsum_ellipsis(self):
        r = rewrite(einsum_ellipsis, *qkv(), options=DEFAULT)
        self.assertEqual(sites(r), [("attention", "rewritten")])

    def test_einsum_transposed_scores_are_attention_of_k_over_q(self):
        # the softmax runs over the q index: k and q swap roles (k queries the q's), and the rewrite is exact
        r = rewrite(einsum_scores_transposed, *qkv(), options=DEFAULT)
        self.assertEqual(sites(r), [("attention", "rewritten")])


def test_einsum_gradients_match_eager():
    q, k, v = qkv(grad=True)
    torch._dynamo.reset()
    ref = einsum_attention(q, k, v)
    g_ref = torch.autograd.grad(ref.square().sum(), [q, k, v])
    out = torch.compile(einsum_attention, backend="smx", options=DEFAULT)(q, k, v)
    g = torch.autograd.grad(out.square().sum(), [q, k, v])
    assert smxcompile.last_report().count(kind="attention", action="rewritten") == 1
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def sdpa_repeated_kv(q, k, v):
    return F.scaled_dot_product_attention(q, repeat_kv(k, 2), repeat_kv(v, 2))


def test_sdpa_call_with_repeated_kv_keeps_its_operands():
    # an SDPA call is taken as written: its repeated K/V are not un-repeated (the call has no enable_gqa)
    r = rewrite(sdpa_repeated_kv, *qkv(hkv=2), options={"attention_normalizer": "sigmoid"}, check_values=False)
    assert attn_site(r).action == "rewritten" and "GQA" not in attn_site(r).detail
    from smxcompile.kernels.attention import attention_reference

    q, k, v = qkv(hkv=2)
    want = attention_reference(q.double(), repeat_kv(k, 2).double(), repeat_kv(v, 2).double(), normalizer="sigmoid")
    torch.testing.assert_close(r.gm(*r.inputs)[0].double(), want, atol=1e-5, rtol=1e-5)
