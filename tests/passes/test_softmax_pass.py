"""Expected-graph tests of the softmax matcher/rewrite (smxcompile.passes.softmax).

Each test traces a small function with Dynamo (the torch-level graph the backend and Inductor's
``pre_grad_custom_pass`` see), runs :class:`SmxPass` on it and compares the resulting graph with
an inline expectation (``expecttest``; regenerate with ``EXPECTTEST_ACCEPT=1 pytest <this file>``
and read the diff before committing it).

Every rewritten graph is also run against the original function, so an expectation can never
bless a wrong rewrite. Near-misses check both that the graph is left unchanged and what the
report says about the site.
"""

from __future__ import annotations

import inspect
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from expecttest import TestCase

import smxcompile  # noqa: F401  (registers the smx:: ops)
from smxcompile.options import SmxOptions
from smxcompile.passes import SmxPass, analyze
from pass_helpers import REWRITE, Rewrite, dynamo_graph, graph_text, rewrite

HERE = os.path.abspath(__file__)


def x3(dtype=torch.float32, *shape):
    torch.manual_seed(0)
    return torch.randn(*(shape or (2, 3, 4))).to(dtype)


# --------------------------------------------------------------------------- spellings


class TestSpellings(TestCase):
    def test_F_softmax_dim_kw(self):
        r = rewrite(lambda x: F.softmax(x, dim=-1), x3())
        self.assertExpectedInline(r.before, """\
def forward(self, L_x_ : torch.Tensor):
l_x_ = L_x_
softmax = torch.nn.functional.softmax(l_x_, dim = -1)
return (softmax,)""")
        self.assertExpectedInline(r.after, """\
def forward(self, L_x_ : torch.Tensor):
l_x_ = L_x_
softmax_default = torch.ops.smx.softmax.default(l_x_, 2, 1.0, None, None, None, False)
getitem = softmax_default[0]
return (getitem,)""")
        s = r.site
        self.assertEqual((s.kind, s.action, s.op, s.detail), ("softmax", "rewritten", "smx::softmax", "F.softmax, dim=2"))

    def test_torch_softmax_positional_dim(self):
        r = rewrite(lambda x: torch.softmax(x, 1), x3())
        self.assertExpectedInline(r.after, """\
def forward(self, L_x_ : torch.Tensor):
l_x_ = L_x_
softmax_default = torch.ops.smx.softmax.default(l_x_, 1, 1.0, None, None, None, False)
getitem = softmax_default[0]
return (getitem,)""")
        self.assertEqual(r.site.detail, "torch.softmax, dim=1")

    def test_tensor_softmax(self):
        r = rewrite(lambda x: x.softmax(-1), x3())
        self.assertExpectedInline(r.after, """\
def forward(self, L_x_ : torch.Tensor):
l_x_ = L_x_
softmax_default = torch.ops.smx.softmax.default(l_x_, 2, 1.0, None, None, None, False)
getitem = softmax_default[0]
return (getitem,)""")
        self.assertEqual(r.site.detail, "Tensor.softmax, dim=2")

    def test_nn_softmax_module(self):
        mod = nn.Softmax(dim=0)
        r = rewrite(lambda x: mod(x), x3())
        self.assertExpectedInline(r.before, """\
def forward(self, L_x_ : torch.Tensor):
l_x_ = L_x_
softmax = torch.nn.functional.softmax(l_x_, 0, _stacklevel = 5)
return (softmax,)""")
        self.assertExpectedInline(r.after, """\
def forward(self, L_x_ : torch.Tensor):
l_x_ = L_x_
softmax_default = torch.ops.smx.softmax.default(l_x_, 0, 1.0, None, None, None, False)
getitem = softmax_default[0]
return (getitem,)""")

    def test_torch_special_softmax(self):
        r = rewrite(lambda x: torch.special.softmax(x, 1), x3())
        self.assertExpectedInline(r.after, """\
def forward(self, L_x_ : torch.Tensor):
l_x_ = L_x_
softmax_default = torch.ops.smx.softmax.default(l_x_, 1, 1.0, None, None, None, False)
getitem = softmax_default[0]
return (getitem,)""")
        self.assertEqual(r.site.action, "rewritten")

    def test_dtype_widening_fp16_to_fp32(self):
        r = rewrite(lambda x: F.softmax(x, -1, dtype=torch.float32), x3(torch.float16))
        self.assertExpectedInline(r.after, """\
def forward(self, L_x_ : torch.Tensor):
l_x_ = L_x_
softmax_default = torch.ops.smx.softmax.default(l_x_, 2, 1.0, None, None, torch.float32, False)
getitem = softmax_default[0]
return (getitem,)""")
        self.assertEqual(r.site.detail, "F.softmax, dim=2, dtype=float32")

    def test_dtype_narrowing_fp32_to_fp16_keeps_the_cast_before(self):
        # torch rounds the input to fp16 first; the rewrite must keep that rounding
        r = rewrite(lambda x: F.softmax(x, -1, dtype=torch.float16), x3() * 3, atol=1e-3)
        self.assertExpectedInline(r.after, """\
def forward(self, L_x_ : torch.Tensor):
l_x_ = L_x_
to = l_x_.to(torch.float16)
softmax_default = torch.ops.smx.softmax.default(to, 2, 1.0, None, None, torch.float16, False)
getitem = softmax_default[0]
return (getitem,)""")

    def test_dtype_fp64_on_fp32_computes_in_fp64(self):
        # the op computes in fp32 unless its input is fp64: keep the user's fp64 math
        r = rewrite(lambda x: torch.softmax(x, 1, dtype=torch.float64), x3() * 10, atol=1e-12)
        self.assertExpectedInline(r.after, """\
def forward(self, L_x_ : torch.Tensor):
l_x_ = L_x_
to = l_x_.to(torch.float64)
softmax_default = torch.ops.smx.softmax.default(to, 1, 1.0, None, None, torch.float64, False)
getitem = softmax_default[0]
return (getitem,)""")
        x = x3() * 10
        torch.testing.assert_close(r.gm(x)[0], torch.softmax(x.double(), 1), atol=1e-15, rtol=1e-14)

    def test_dtype_bf16_on_fp16_rounds_first(self):
        # fp16 -> bf16 narrows the mantissa: torch rounds the input to bf16 first
        r = rewrite(lambda x: F.softmax(x, -1, dtype=torch.bfloat16), x3(torch.float16) * 3)
        self.assertIn("to = l_x_.to(torch.bfloat16)", r.after)
        r = rewrite(lambda x: F.softmax(x, -1, dtype=torch.float16), x3(torch.bfloat16) * 3, atol=1e-3)
        self.assertIn("to = l_x_.to(torch.float16)", r.after)

    # ---- log_softmax in the same forms

    def test_F_log_softmax(self):
        r = rewrite(lambda x: F.log_softmax(x, dim=-1), x3())
        self.assertExpectedInline(r.after, """\
def forward(self, L_x_ : torch.Tensor):
l_x_ = L_x_
log_softmax_default = torch.ops.smx.log_softmax.default(l_x_, 2, 1.0, None, None, None, False)
getitem = log_softmax_default[0]
return (getitem,)""")
        s = r.site
        self.assertEqual((s.kind, s.op, s.detail), ("log_softmax", "smx::log_softmax", "F.log_softmax, dim=2"))

    def test_torch_log_softmax_positional(self):
        r = rewrite(lambda x: torch.log_softmax(x, 1), x3())
        self.assertExpectedInline(r.after, """\
def forward(self, L_x_ : torch.Tensor):
l_x_ = L_x_
log_softmax_default = torch.ops.smx.log_softmax.default(l_x_, 1, 1.0, None, None, None, False)
getitem = log_softmax_default[0]
return (getitem,)""")

    def test_tensor_log_softmax(self):
        r = rewrite(lambda x: x.log_softmax(0), x3())
        self.assertExpectedInline(r.after, """\
def forward(self, L_x_ : torch.Tensor):
l_x_ = L_x_
log_softmax_default = torch.ops.smx.log_softmax.default(l_x_, 0, 1.0, None, None, None, False)
getitem = log_softmax_default[0]
return (getitem,)""")

    def test_nn_log_softmax_module(self):
        mod = nn.LogSoftmax(dim=1)
        r = rewrite(lambda x: mod(x), x3())
        self.assertExpectedInline(r.after, """\
def forward(self, L_x_ : torch.Tensor):
l_x_ = L_x_
log_softmax_default = torch.ops.smx.log_softmax.default(l_x_, 1, 1.0, None, None, None, False)
getitem = log_softmax_default[0]
return (getitem,)""")

    def test_torch_special_log_softmax(self):
        r = rewrite(lambda x: torch.special.log_softmax(x, -1), x3())
        self.assertExpectedInline(r.after, """\
def forward(self, L_x_ : torch.Tensor):
l_x_ = L_x_
log_softmax_default = torch.ops.smx.log_softmax.default(l_x_, 2, 1.0, None, None, None, False)
getitem = log_softmax_default[0]
return (getitem,)""")

    def test_log_softmax_dtype_widening(self):
        r = rewrite(lambda x: F.log_softmax(x, -1, dtype=torch.float32), x3(torch.bfloat16))
        self.assertExpectedInline(r.after, """\
def forward(self, L_x_ : torch.Tensor):
l_x_ = L_x_
log_softmax_default = torch.ops.smx.log_softmax.default(l_x_, 2, 1.0, None, None, torch.float32, False)
getitem = log_softmax_default[0]
return (getitem,)""")

    def test_log_softmax_dtype_narrowing(self):
        r = rewrite(lambda x: F.log_softmax(x, -1, dtype=torch.float16), x3() * 3, atol=1e-2)
        self.assertExpectedInline(r.after, """\
def forward(self, L_x_ : torch.Tensor):
l_x_ = L_x_
to = l_x_.to(torch.float16)
log_softmax_default = torch.ops.smx.log_softmax.default(to, 2, 1.0, None, None, torch.float16, False)
getitem = log_softmax_default[0]
return (getitem,)""")


# --------------------------------------------------------------------------- hand-written


class TestHandWritten(TestCase):
    def test_exp_minus_max_getitem(self):
        def fn(x):
            e = torch.exp(x - x.max(-1, keepdim=True)[0])
            return e / e.sum(-1, keepdim=True)

        r = rewrite(fn, x3())
        self.assertExpectedInline(r.before, """\
def forward(self, L_x_ : torch.Tensor):
l_x_ = L_x_
max_1 = l_x_.max(-1, keepdim = True)
getitem = max_1[0]
sub = l_x_ - getitem
e = torch.exp(sub)
sum_1 = e.sum(-1, keepdim = True)
truediv = e / sum_1
return (truediv,)""")
        self.assertExpectedInline(r.after, """\
def forward(self, L_x_ : torch.Tensor):
l_x_ = L_x_
softmax_default = torch.ops.smx.softmax.default(l_x_, 2, 1.0, None, None, None, False)
getitem_2 = softmax_default[0]
return (getitem_2,)""")
        self.assertEqual(r.site.detail, "exp(x - max)/sum, dim=2")

    def test_exp_recomputed_in_the_sum(self):
        # the exp written twice (CSE-free): both copies are the same expression
        def fn(x):
            return torch.exp(x - x.max(-1, keepdim=True)[0]) / torch.exp(x - x.max(-1, keepdim=True)[0]).sum(-1, keepdim=True)

        r = rewrite(fn, x3())
        self.assertExpectedInline(r.after, """\
def forward(self, L_x_ : torch.Tensor):
l_x_ = L_x_
softmax_default = torch.ops.smx.softmax.default(l_x_, 2, 1.0, None, None, None, False)
getitem_4 = softmax_default[0]
return (getitem_4,)""")

    def test_exp_minus_amax(self):
        def fn(x):
            e = (x - torch.amax(x, dim=1, keepdim=True)).exp()
            return e / torch.sum(e, dim=1, keepdim=True)

        r = rewrite(fn, x3())
        self.assertExpectedInline(r.after, """\
def forward(self, L_x_ : torch.Tensor):
l_x_ = L_x_
softmax_default = torch.ops.smx.softmax.default(l_x_, 1, 1.0, None, None, None, False)
getitem = softmax_default[0]
return (getitem,)""")

    def test_exp_minus_torch_max_values(self):
        def fn(x):
            e = torch.exp(x - torch.max(x, -1, keepdim=True).values)
            return e / e.sum(-1, keepdim=True)

        r = rewrite(fn, x3())
        self.assertExpectedInline(r.after, """\
def forward(self, L_x_ : torch.Tensor):
l_x_ = L_x_
softmax_default = torch.ops.smx.softmax.default(l_x_, 2, 1.0, None, None, None, False)
getitem_2 = softmax_default[0]
return (getitem_2,)""")

    def test_exp_minus_detached_max(self):
        def fn(x):
            e = torch.exp(x - x.amax(-1, keepdim=True).detach())
            return e / e.sum(-1, keepdim=True)

        r = rewrite(fn, x3())
        self.assertExpectedInline(r.after, """\
def forward(self, L_x_ : torch.Tensor):
l_x_ = L_x_
softmax_default = torch.ops.smx.softmax.default(l_x_, 2, 1.0, None, None, None, False)
getitem = softmax_default[0]
return (getitem,)""")

    def test_exp_without_max(self):
        def fn(x):
            e = x.exp()
            return e / e.sum(0, keepdim=True)

        r = rewrite(fn, x3())
        self.assertExpectedInline(r.after, """\
def forward(self, L_x_ : torch.Tensor):
l_x_ = L_x_
softmax_default = torch.ops.smx.softmax.default(l_x_, 0, 1.0, None, None, None, False)
getitem = softmax_default[0]
return (getitem,)""")
        self.assertEqual(r.site.detail, "exp(x)/sum, dim=0")

    def test_exp_without_max_overflow_is_fixed(self):
        # the naive form overflows to NaN; the rewrite is the stable softmax
        def fn(x):
            e = torch.exp(x)
            return e / e.sum(-1, keepdim=True)

        x = torch.tensor([[1000.0, 0.0], [1.0, 2.0]])
        r = rewrite(fn, x, check_values=False)
        self.assertTrue(r.changed)
        self.assertTrue(fn(x).isnan().any())
        torch.testing.assert_close(r.gm(x)[0], torch.softmax(x, -1))

    def test_x_minus_logsumexp(self):
        r = rewrite(lambda x: x - x.logsumexp(-1, keepdim=True), x3())
        self.assertExpectedInline(r.after, """\
def forward(self, L_x_ : torch.Tensor):
l_x_ = L_x_
log_softmax_default = torch.ops.smx.log_softmax.default(l_x_, 2, 1.0, None, None, None, False)
getitem = log_softmax_default[0]
return (getitem,)""")
        self.assertEqual((r.site.kind, r.site.detail), ("log_softmax", "x - logsumexp(x), dim=2"))

    def test_torch_logsumexp_function(self):
        r = rewrite(lambda x: x - torch.logsumexp(x, 1, keepdim=True), x3())
        self.assertExpectedInline(r.after, """\
def forward(self, L_x_ : torch.Tensor):
l_x_ = L_x_
log_softmax_default = torch.ops.smx.log_softmax.default(l_x_, 1, 1.0, None, None, None, False)
getitem = log_softmax_default[0]
return (getitem,)""")

    def test_shifted_minus_log_sum_exp(self):
        def fn(x):
            m = x.amax(-1, keepdim=True)
            return (x - m) - torch.log(torch.sum(torch.exp(x - m), -1, keepdim=True))

        r = rewrite(fn, x3())
        self.assertExpectedInline(r.before, """\
def forward(self, L_x_ : torch.Tensor):
l_x_ = L_x_
m = l_x_.amax(-1, keepdim = True)
sub = l_x_ - m
sub_1 = l_x_ - m
exp = torch.exp(sub_1)
sum_1 = torch.sum(exp, -1, keepdim = True)
log = torch.log(sum_1)
sub_2 = sub - log
return (sub_2,)""")
        self.assertExpectedInline(r.after, """\
def forward(self, L_x_ : torch.Tensor):
l_x_ = L_x_
log_softmax_default = torch.ops.smx.log_softmax.default(l_x_, 2, 1.0, None, None, None, False)
getitem = log_softmax_default[0]
return (getitem,)""")
        self.assertEqual(r.site.detail, "(x - max) - log(sum(exp)), dim=2")

    def test_shifted_shared_minus_log_sum_exp(self):
        def fn(x):
            u = x - x.amax(-1, keepdim=True)
            return u - u.exp().sum(-1, keepdim=True).log()

        r = rewrite(fn, x3())
        self.assertExpectedInline(r.after, """\
def forward(self, L_x_ : torch.Tensor):
l_x_ = L_x_
log_softmax_default = torch.ops.smx.log_softmax.default(l_x_, 2, 1.0, None, None, None, False)
getitem = log_softmax_default[0]
return (getitem,)""")

    def test_log_of_softmax(self):
        r = rewrite(lambda x: torch.log(torch.softmax(x, -1)), x3())
        self.assertExpectedInline(r.after, """\
def forward(self, L_x_ : torch.Tensor):
l_x_ = L_x_
log_softmax_default = torch.ops.smx.log_softmax.default(l_x_, 2, 1.0, None, None, None, False)
getitem = log_softmax_default[0]
return (getitem,)""")
        self.assertEqual((r.site.kind, r.site.detail), ("log_softmax", "log(torch.softmax), dim=2"))

    def test_log_of_softmax_used_twice_is_two_sites(self):
        # the softmax is also returned: log(softmax) cannot swallow it
        def fn(x):
            p = torch.softmax(x, -1)
            return p, torch.log(p)

        r = rewrite(fn, x3())
        self.assertExpectedInline(r.after, """\
def forward(self, L_x_ : torch.Tensor):
l_x_ = L_x_
softmax_default = torch.ops.smx.softmax.default(l_x_, 2, 1.0, None, None, None, False)
getitem = softmax_default[0]
log = torch.log(getitem)
return (getitem, log)""")


# --------------------------------------------------------------------------- neighbours


class TestNeighbours(TestCase):
    def test_upcast_scale_softmax_downcast(self):
        r = rewrite(lambda x: (x.float() * 0.5).softmax(-1).half(), x3(torch.float16))
        self.assertExpectedInline(r.before, """\
def forward(self, L_x_ : torch.Tensor):
l_x_ = L_x_
float_1 = l_x_.float()
mul = float_1 * 0.5
softmax = mul.softmax(-1)
half = softmax.half()
return (half,)""")
        self.assertExpectedInline(r.after, """\
def forward(self, L_x_ : torch.Tensor):
l_x_ = L_x_
softmax_default = torch.ops.smx.softmax.default(l_x_, 2, 0.5, None, None, torch.float16, False)
getitem = softmax_default[0]
return (getitem,)""")
        self.assertExpectedInline(r.site.detail, """Tensor.softmax, dim=2, scale=0.5, cast float16->float32, cast out->float16""")

    def test_temperature_divide(self):
        r = rewrite(lambda x: torch.softmax(x / 2.0, -1), x3())
        self.assertExpectedInline(r.after, """\
def forward(self, L_x_ : torch.Tensor):
l_x_ = L_x_
softmax_default = torch.ops.smx.softmax.default(l_x_, 2, 0.5, None, None, None, False)
getitem = softmax_default[0]
return (getitem,)""")

    def test_two_scales_multiply(self):
        r = rewrite(lambda x: F.softmax(0.5 * (x * 4.0), dim=-1), x3())
        self.assertExpectedInline(r.after, """\
def forward(self, L_x_ : torch.Tensor):
l_x_ = L_x_
softmax_default = torch.ops.smx.softmax.default(l_x_, 2, 2.0, None, None, None, False)
getitem = softmax_default[0]
return (getitem,)""")

    def test_broadcast_additive_mask(self):
        mask = torch.zeros(3, 4)
        mask[:, 2:] = float("-inf")
        r = rewrite(lambda x, m: torch.softmax(x + m, -1), x3(), mask)
        self.assertExpectedInline(r.after, """\
def forward(self, L_x_ : torch.Tensor, L_m_ : torch.Tensor):
l_x_ = L_x_
l_m_ = L_m_
softmax_default = torch.ops.smx.softmax.default(l_x_, 2, 1.0, None, l_m_, None, False)
getitem = softmax_default[0]
return (getitem,)""")
        self.assertEqual(r.site.detail, "torch.softmax, dim=2, mask")

    def test_mask_first_operand(self):
        mask = torch.zeros(2, 1, 4)
        r = rewrite(lambda x, m: torch.softmax(m + x * 0.125, -1), x3(), mask)
        self.assertExpectedInline(r.after, """\
def forward(self, L_x_ : torch.Tensor, L_m_ : torch.Tensor):
l_x_ = L_x_
l_m_ = L_m_
softmax_default = torch.ops.smx.softmax.default(l_x_, 2, 0.125, None, l_m_, None, False)
getitem = softmax_default[0]
return (getitem,)""")

    def test_softcap(self):
        r = rewrite(lambda x: torch.softmax(30.0 * torch.tanh(x / 30.0), -1), x3() * 50)
        self.assertExpectedInline(r.before, """\
def forward(self, L_x_ : torch.Tensor):
l_x_ = L_x_
truediv = l_x_ / 30.0
tanh = torch.tanh(truediv)
mul = 30.0 * tanh
softmax = torch.softmax(mul, -1)
return (softmax,)""")
        self.assertExpectedInline(r.after, """\
def forward(self, L_x_ : torch.Tensor):
l_x_ = L_x_
softmax_default = torch.ops.smx.softmax.default(l_x_, 2, 1.0, 30.0, None, None, False)
getitem = softmax_default[0]
return (getitem,)""")
        self.assertEqual(r.site.detail, "torch.softmax, dim=2, softcap=30")

    def test_softcap_scale_and_mask(self):
        def fn(x, m):
            s = x * 0.25
            s = torch.tanh(s / 50.0) * 50.0
            return F.softmax(s + m, dim=-1)

        r = rewrite(fn, x3() * 100, torch.zeros(1, 3, 4))
        self.assertExpectedInline(r.after, """\
def forward(self, L_x_ : torch.Tensor, L_m_ : torch.Tensor):
l_x_ = L_x_
l_m_ = L_m_
softmax_default = torch.ops.smx.softmax.default(l_x_, 2, 0.25, 50.0, l_m_, None, False)
getitem = softmax_default[0]
return (getitem,)""")

    def test_t5_upcast_then_type_as(self):
        r = rewrite(lambda scores: F.softmax(scores.float(), dim=-1).type_as(scores), x3(torch.float16))
        self.assertExpectedInline(r.before, """\
def forward(self, L_scores_ : torch.Tensor):
l_scores_ = L_scores_
float_1 = l_scores_.float()
softmax = torch.nn.functional.softmax(float_1, dim = -1)
type_as = softmax.type_as(l_scores_)
return (type_as,)""")
        self.assertExpectedInline(r.after, """\
def forward(self, L_scores_ : torch.Tensor):
l_scores_ = L_scores_
softmax_default = torch.ops.smx.softmax.default(l_scores_, 2, 1.0, None, None, torch.float16, False)
getitem = softmax_default[0]
return (getitem,)""")

    def test_log_softmax_absorbs_scale_and_casts(self):
        r = rewrite(lambda x: F.log_softmax(x.to(torch.float32) / 4.0, dim=-1).to(torch.bfloat16), x3(torch.bfloat16))
        self.assertExpectedInline(r.after, """\
def forward(self, L_x_ : torch.Tensor):
l_x_ = L_x_
log_softmax_default = torch.ops.smx.log_softmax.default(l_x_, 2, 0.25, None, None, torch.bfloat16, False)
getitem = log_softmax_default[0]
return (getitem,)""")

    def test_scale_used_elsewhere_is_not_absorbed(self):
        def fn(x):
            s = x * 2.0
            return torch.softmax(s, -1), s

        r = rewrite(fn, x3())
        self.assertExpectedInline(r.after, """\
def forward(self, L_x_ : torch.Tensor):
l_x_ = L_x_
s = l_x_ * 2.0
softmax_default = torch.ops.smx.softmax.default(s, 2, 1.0, None, None, None, False)
getitem = softmax_default[0]
return (getitem, s)""")


# --------------------------------------------------------------------------- near-misses


class TestNearMisses(TestCase):
    def assertUnchanged(self, r: Rewrite):
        self.assertEqual(r.before, r.after)
        self.assertEqual(r.report.count(action="rewritten"), 0, str(r.report))

    def test_sum_over_another_dim_than_the_max(self):
        # exp(x - amax(x, -1)) / sum(.., dim=1) is NOT softmax(x, -1) nor softmax(x, 1). It is exactly
        # softmax(u, 1) with u = x - amax(x, -1): the matcher may only claim it in that form, with the
        # max subtraction left in the graph as the op's input.
        def fn(x):
            e = torch.exp(x - x.amax(-1, keepdim=True))
            return e / e.sum(1, keepdim=True)

        x = x3()
        r = rewrite(fn, x)
        self.assertExpectedInline(r.after, """\
def forward(self, L_x_ : torch.Tensor):
l_x_ = L_x_
amax = l_x_.amax(-1, keepdim = True)
sub = l_x_ - amax
softmax_default = torch.ops.smx.softmax.default(sub, 1, 1.0, None, None, None, False)
getitem = softmax_default[0]
return (getitem,)""")
        self.assertEqual(r.site.detail, "exp(x)/sum, dim=1")
        self.assertFalse(torch.allclose(fn(x), torch.softmax(x, 1)))
        self.assertFalse(torch.allclose(fn(x), torch.softmax(x, -1)))

    def test_sum_over_another_dim_than_the_max_via_getitem(self):
        def fn(x):
            e = torch.exp(x - x.max(1, keepdim=True)[0])
            return e / e.sum(-1, keepdim=True)

        r = rewrite(fn, x3())
        self.assertIn("max_1 = l_x_.max(1, keepdim = True)", r.after)
        self.assertIn("torch.ops.smx.softmax.default(sub, 2,", r.after)

    def test_sum_without_keepdim(self):
        def fn(x):
            e = torch.exp(x)
            return e / e.sum(-1)  # broadcasts the row sums along the wrong axis

        r = rewrite(fn, torch.randn(4, 4))
        self.assertUnchanged(r)
        self.assertEqual(len(r.report), 0)

    def test_max_without_keepdim(self):
        def fn(x):
            e = torch.exp(x - x.amax(-1))
            return e / e.sum(-1, keepdim=True)

        r = rewrite(fn, torch.randn(4, 4))
        # amax without keepdim subtracts the row max along the wrong axis: the exp is exp(u) of
        # that u, never a shifted softmax of x
        self.assertNotIn("softmax.default(l_x_", r.after)

    def test_exp_of_x_over_sum_of_exp_of_y(self):
        r = rewrite(lambda x, y: torch.exp(x) / torch.exp(y).sum(-1, keepdim=True), x3(), x3() + 1)
        self.assertUnchanged(r)
        self.assertEqual(len(r.report), 0)

    def test_exp_used_elsewhere(self):
        def fn(x):
            e = torch.exp(x - x.amax(-1, keepdim=True))
            return e / e.sum(-1, keepdim=True), e

        r = rewrite(fn, x3())
        self.assertUnchanged(r)
        self.assertEqual(r.site.action, "skipped")
        self.assertIn("also read outside it", r.site.reason)

    def test_in_place_op_on_the_input_inside_the_pattern(self):
        # the op would sit at the softmax and read x after mul_: it must not be rewritten
        def fn(x):
            z = x * 2.0
            x.mul_(3.0)
            return torch.softmax(z, -1)

        r = rewrite(fn, x3(), check_values=False)
        self.assertUnchanged(r)
        self.assertEqual(r.site.action, "skipped")
        self.assertIn("in-place op 'mul_'", r.site.reason)
        x = x3()
        got = torch.compile(fn, backend="smx", options=REWRITE)(x.clone())
        torch.testing.assert_close(got, fn(x.clone()))

    def test_in_place_op_inside_hand_written_softmax(self):
        def fn(x):
            e = torch.exp(x - x.amax(-1, keepdim=True))
            x.add_(1.0)
            return e / e.sum(-1, keepdim=True)

        r = rewrite(fn, x3(), check_values=False)
        self.assertUnchanged(r)
        self.assertIn("in-place op 'add_'", r.site.reason)

    def test_in_place_op_outside_the_pattern_is_fine(self):
        def fn(x):
            x = x.clone()
            x.add_(1.0)
            y = torch.softmax(x * 2.0, -1)
            y.mul_(2.0)
            return y

        r = rewrite(fn, x3())
        self.assertEqual(r.site.action, "rewritten")

    def test_sum_used_elsewhere(self):
        def fn(x):
            e = torch.exp(x)
            s = e.sum(-1, keepdim=True)
            return e / s, s

        r = rewrite(fn, x3())
        self.assertUnchanged(r)
        self.assertEqual(r.site.action, "skipped")
        self.assertIn("also read outside it", r.site.reason)

    def test_max_used_elsewhere(self):
        def fn(x):
            m = x.amax(-1, keepdim=True)
            e = torch.exp(x - m)
            return e / e.sum(-1, keepdim=True), m

        r = rewrite(fn, x3())
        self.assertUnchanged(r)
        self.assertEqual(r.site.action, "skipped")
        self.assertIn("also read outside it", r.site.reason)

    def test_F_gumbel_softmax_is_not_a_site(self):
        torch.manual_seed(0)
        r = rewrite(lambda logits: F.gumbel_softmax(logits, tau=0.5), x3(), check_values=False)
        self.assertUnchanged(r)
        self.assertEqual(len(r.report), 0)
        self.assertIn("gumbel_softmax", r.before)

    def test_gumbel_softmax_hard_compiles_and_runs_under_smx(self):
        torch._dynamo.reset()
        fn = torch.compile(lambda l: F.gumbel_softmax(l, tau=0.5, hard=True, dim=-1), backend="smx",
                           options=REWRITE)
        logits = x3().requires_grad_()
        y = fn(logits)
        self.assertEqual(y.shape, logits.shape)
        self.assertTrue(torch.equal(y.detach().sum(-1), torch.ones(2, 3)))
        self.assertTrue(bool(((y == 0) | (y == 1)).all()))
        y.backward(torch.randn_like(y))  # straight-through estimator: gradients flow to the logits
        self.assertEqual(logits.grad.shape, logits.shape)
        self.assertTrue(bool(logits.grad.isfinite().all()))
        self.assertEqual(smxcompile.last_report().count(action="rewritten"), 0)

    def test_handwritten_gumbel_softmax(self):
        def fn(logits):
            gumbel_noise = -torch.empty_like(logits).exponential_().log()
            return torch.softmax((logits + gumbel_noise) / 0.5, -1)

        r = rewrite(fn, x3(), check_values=False)
        self.assertUnchanged(r)
        self.assertEqual(r.site.action, "skipped")
        self.assertIn("random noise (Gumbel-softmax)", r.site.reason)

    def test_gumbel_noise_from_rand(self):
        def fn(logits):
            u = torch.rand_like(logits)
            return F.softmax(logits - torch.log(-torch.log(u + 1e-9) + 1e-9), dim=-1)

        r = rewrite(fn, x3(), check_values=False)
        self.assertUnchanged(r)
        self.assertEqual(r.site.action, "skipped")

    def test_gumbel_noise_filled_in_place(self):
        def fn(logits):
            g = torch.empty_like(logits)
            g.exponential_()
            return F.softmax((logits - g.log()) * 2.0, dim=-1)

        r = rewrite(fn, x3(), check_values=False)
        self.assertUnchanged(r)
        self.assertEqual(r.site.action, "skipped")
        self.assertIn("Gumbel", r.site.reason)

    def test_noise_far_upstream_of_a_matmul_is_not_gumbel(self):
        # noise added to the input of a layer (diffusion, data augmentation) does not make the
        # softmax over that layer's output a Gumbel-softmax
        def fn(x, w):
            noisy = x + 0.1 * torch.randn_like(x)
            return torch.softmax(noisy @ w, dim=-1)

        r = rewrite(fn, x3(), torch.randn(4, 4), check_values=False)
        self.assertEqual(r.site.action, "rewritten", str(r.report))

    def test_softmax_with_dropout_upstream_is_not_random(self):
        # dropout masks activations; it is not Gumbel noise
        def fn(x):
            return torch.softmax(F.dropout(x, 0.1, training=False), -1)

        r = rewrite(fn, x3())
        self.assertEqual(r.report.count(action="rewritten"), 1)

    def test_mask_that_broadcasts_x_to_a_larger_shape(self):
        # neither operand has the output's shape: the add must stay, the softmax runs on its result
        r = rewrite(lambda a, m: torch.softmax(a + m, -1), torch.randn(2, 1, 4), torch.randn(1, 3, 4))
        self.assertExpectedInline(r.after, """\
def forward(self, L_a_ : torch.Tensor, L_m_ : torch.Tensor):
l_a_ = L_a_
l_m_ = L_m_
add = l_a_ + l_m_
softmax_default = torch.ops.smx.softmax.default(add, 2, 1.0, None, None, None, False)
getitem = softmax_default[0]
return (getitem,)""")
        self.assertNotIn("mask", r.site.detail)

    def test_mask_larger_than_scores_swaps_roles(self):
        # a (3, 4) "scores" plus a (2, 3, 4) "mask": the addition is symmetric, so the full-shape
        # operand is the op's input and the smaller one the mask; the values must be unchanged
        r = rewrite(lambda a, m: torch.softmax(a + m, -1), torch.randn(3, 4), torch.randn(2, 3, 4))
        self.assertExpectedInline(r.after, """\
def forward(self, L_a_ : torch.Tensor, L_m_ : torch.Tensor):
l_a_ = L_a_
l_m_ = L_m_
softmax_default = torch.ops.smx.softmax.default(l_m_, 2, 1.0, None, l_a_, None, False)
getitem = softmax_default[0]
return (getitem,)""")

    def test_mask_that_requires_grad_is_not_absorbed(self):
        mask = torch.zeros(3, 4, requires_grad=True)
        r = rewrite(lambda x, m: torch.softmax(x + m, -1), x3(), mask)
        self.assertExpectedInline(r.after, """\
def forward(self, L_x_ : torch.Tensor, L_m_ : torch.Tensor):
l_x_ = L_x_
l_m_ = L_m_
add = l_x_ + l_m_
softmax_default = torch.ops.smx.softmax.default(add, 2, 1.0, None, None, None, False)
getitem = softmax_default[0]
return (getitem,)""")
        self.assertNotIn("mask", r.site.detail)

    def test_mask_that_promotes_the_dtype_is_not_absorbed(self):
        # bf16 scores + fp32 mask is an fp32 tensor: absorbing the mask would return bf16
        r = rewrite(lambda x, m: torch.softmax(x + m, -1), x3(torch.bfloat16), torch.zeros(3, 4))
        self.assertNotIn("mask", r.site.detail)
        self.assertIn("add = l_x_ + l_m_", r.after)
        # the same mask in the scores' dtype is absorbed
        r = rewrite(lambda x, m: torch.softmax(x + m, -1), x3(torch.bfloat16), torch.zeros(3, 4, dtype=torch.bfloat16))
        self.assertIn("mask", r.site.detail)
        # an fp16 mask on fp32 scores does not promote: absorbed
        r = rewrite(lambda x, m: torch.softmax(x + m, -1), x3(), torch.zeros(3, 4, dtype=torch.float16))
        self.assertIn("mask", r.site.detail)

    def test_integer_mask_is_not_absorbed(self):
        r = rewrite(lambda x, m: torch.softmax(x + m, -1), x3(), torch.ones(3, 4, dtype=torch.int64))
        self.assertNotIn("mask", r.site.detail)
        self.assertIn("add = l_x_ + l_m_", r.after)

    def test_softcap_with_different_constants_is_not_absorbed(self):
        r = rewrite(lambda x: torch.softmax(30.0 * torch.tanh(x / 20.0), -1), x3())
        self.assertNotIn("softcap", r.site.detail)
        self.assertIn("tanh", r.after)

    def test_integer_softmax_input_with_dtype(self):
        # softmax of an int tensor needs dtype=; the matched x is not floating point -> skipped, untouched
        r = rewrite(lambda x: torch.softmax(x, -1, dtype=torch.float32), torch.arange(12).reshape(3, 4))
        self.assertUnchanged(r)
        self.assertEqual(r.site.action, "skipped")

    def test_softmax_disabled_by_option(self):
        r = rewrite(lambda x: torch.softmax(x, -1), x3(), options={"softmax": False, "cpu": "rewrite"})
        self.assertUnchanged(r)
        self.assertEqual(r.site.action, "kept")
        self.assertEqual(r.site.reason, "rewrite kind 'softmax' disabled by options")

    def test_log_softmax_disabled_leaves_softmax(self):
        def fn(x):
            return torch.softmax(x, -1), F.log_softmax(x, -1)

        r = rewrite(fn, x3(), options={"disable": ["log_softmax"], "cpu": "rewrite"})
        self.assertEqual([(s.kind, s.action) for s in r.report], [("softmax", "rewritten"), ("log_softmax", "kept")])
        self.assertIn("F.log_softmax", r.after.replace("torch.nn.functional.log_softmax", "F.log_softmax"))


# --------------------------------------------------------------------------- policy


def _attention(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1) * 0.125, dim=-1) @ v


def _qkv():
    torch.manual_seed(0)
    return tuple(torch.randn(1, 2, 5, 8) for _ in range(3))


class TestPolicy(TestCase):
    def test_attention_softmax_belongs_to_the_attention_rewrite(self):
        r = rewrite(_attention, *_qkv(), options={"cpu": "rewrite"})
        self.assertEqual([(s.kind, s.action) for s in r.report], [("attention", "rewritten")])

    def test_attention_softmax_kept_when_attention_disabled(self):
        r = rewrite(_attention, *_qkv(), options={"attention": False})
        self.assertEqual(r.before, r.after)
        self.assertEqual([(s.kind, s.action) for s in r.report], [("attention", "kept"), ("softmax", "kept")])
        self.assertIn("attention softmax", r.report.sites[1].reason)

    def test_attention_rewritten_when_asked(self):
        r = rewrite(_attention, *_qkv(), options={"attention": False, "attention_softmax": True, "cpu": "rewrite"}, atol=1e-5)
        self.assertExpectedInline(r.after, """\
def forward(self, L_k_ : torch.Tensor, L_q_ : torch.Tensor, L_v_ : torch.Tensor):
l_k_ = L_k_
l_q_ = L_q_
l_v_ = L_v_
transpose = l_k_.transpose(-2, -1)
matmul = l_q_ @ transpose
softmax_default = torch.ops.smx.softmax.default(matmul, 3, 0.125, None, None, None, False)
getitem = softmax_default[0]
matmul_1 = getitem @ l_v_
return (matmul_1,)""")

    def test_cpu_auto_rewrites_plain_and_keeps_fused(self):
        def fn(x):
            return torch.softmax(x, -1), torch.softmax(x * 2.0, 1)

        long_rows = torch.randn(2, 16384)  # inference rows long enough for ATen to beat Inductor
        r = rewrite(fn, long_rows, options=None)
        plain, scaled = r.report.sites
        self.assertEqual(plain.action, "rewritten")
        self.assertEqual(scaled.action, "kept")
        self.assertIn("CPU: Inductor fuses", scaled.reason)
        short = rewrite(fn, x3(), options=None).report.sites[0]
        self.assertEqual(short.action, "kept")
        self.assertIn("columns; Inductor's C++ softmax was measured as fast", short.reason)

    def test_cpu_keep(self):
        r = rewrite(lambda x: torch.softmax(x, -1), x3(), options={"cpu": "keep"})
        self.assertEqual(r.before, r.after)
        self.assertEqual((r.site.action, r.site.reason), ("kept", "options cpu='keep'"))

    def test_analyze_does_not_change_the_graph(self):
        gm = dynamo_graph(lambda x: torch.softmax(x * 2.0, -1), x3())
        before = graph_text(gm)
        rep = analyze(gm.graph, SmxOptions.from_mapping(REWRITE))
        self.assertEqual(rep.count(action="rewritten"), 1)
        self.assertEqual(graph_text(gm), before)

    def test_pass_is_idempotent(self):
        gm = dynamo_graph(lambda x: torch.softmax(x / 3.0, -1).log(), x3())
        p = SmxPass(SmxOptions.from_mapping(REWRITE))
        p(gm.graph)
        once = str(gm.graph)
        p(gm.graph)
        self.assertEqual(str(gm.graph), once)


# --------------------------------------------------------------------------- report locations


def _many_sites(x, m):
    a = torch.softmax(x, -1)  # SITE
    b = F.log_softmax(x * 2.0, dim=1)  # SITE
    e = torch.exp(x)
    c = e / e.sum(0, keepdim=True)  # SITE
    d = x - x.logsumexp(-1, keepdim=True)  # SITE
    f = torch.softmax(x + m, -1).half()  # SITE
    return a, b, c, d, f


class TestLocations(TestCase):
    def test_each_site_points_at_its_line(self):
        lines, first = inspect.getsourcelines(_many_sites)
        want = [first + i for i, line in enumerate(lines) if line.rstrip().endswith("# SITE")]
        r = rewrite(_many_sites, x3(), torch.zeros(3, 4), atol=1e-3)
        self.assertEqual(len(r.report), 5)
        self.assertEqual(r.report.count(action="rewritten"), 5, str(r.report))
        got = [s.location for s in r.report]
        self.assertEqual(got, [f"{HERE}:{n}" for n in want])
        # the table shortens the path to its last two parts
        self.assertIn(f"passes/test_softmax_pass.py:{want[0]}", str(r.report))

    def test_location_through_a_module(self):
        class Block(nn.Module):
            def __init__(self):
                super().__init__()
                self.proj = nn.Linear(4, 4)

            def forward(self, x):
                return F.softmax(self.proj(x), dim=-1)

        block = Block()
        r = rewrite(block, x3(), atol=1e-5)
        line = inspect.getsourcelines(Block.forward)[1] + 1
        self.assertEqual(r.site.location, f"{HERE}:{line}")
        self.assertEqual(r.site.action, "rewritten")


if __name__ == "__main__":
    pytest.main([__file__, "-q"])


def test_aten_safe_softmax_is_not_fused_and_keeps_its_zero_rows():
    """``aten._safe_softmax`` (SDPA's math decomposition) gives 0 on a row of -inf, where softmax and the fused op
    give NaN: reported skipped with that reason, and the graph still gives its zeros."""
    x = torch.randn(4, 64)
    x[1] = float("-inf")
    r = rewrite(lambda t: torch.ops.aten._safe_softmax(t * 2.0, -1), x)
    sm = [s for s in r.report if s.kind == "softmax"]
    assert [s.action for s in sm] == ["skipped"] and "_safe_softmax" in sm[0].reason, str(r.report)
    assert bool((r.gm(*r.inputs)[0][1] == 0).all())
