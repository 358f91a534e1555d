"""Expected-graph and numerical tests of the quantized-softmax pass (smxcompile.passes.quant_softmax).

softmax -> quantize (PyTorch 2 export QDQ ops, ``fake_quantize_per_tensor_affine``,
``torch.quantize_per_tensor`` + ``.dequantize()``) is traced with Dynamo, rewritten by
:class:`SmxPass` with ``cpu="rewrite"`` and compared with an inline expected graph
(``EXPECTTEST_ACCEPT=1 pytest tests/passes/test_quant_softmax_pass.py`` regenerates them; read the diff).
Every rewritten graph is run against the original function: the codes must be equal bit for bit
(the op's CPU path is torch's softmax and the quantizer's formula). Near-misses must be left alone.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from expecttest import TestCase

import smxcompile
from smxcompile.options import SmxOptions
from pass_helpers import rewrite

QD = torch.ops.quantized_decomposed
REWRITE = {"cpu": "rewrite"}
S = 1 / 255


def x4(dtype=torch.float32, shape=(2, 3, 5, 7), seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * 3).to(dtype)


def qsite(r):
    s = [s for s in r.report if s.kind == "quant_softmax"]
    assert len(s) == 1, str(r.report)
    return s[0]


def qdq(x):
    q = QD.quantize_per_tensor(F.softmax(x, dim=-1), S, 0, 0, 255, torch.uint8)
    return QD.dequantize_per_tensor(q, S, 0, 0, 255, torch.uint8)


class TestSpellings(TestCase):
    def test_quantized_decomposed_qdq(self):
        r = rewrite(qdq, x4(), atol=0)
        self.assertExpectedInline(r.after, """\
def forward(self, L_x_ : torch.Tensor):
l_x_ = L_x_
quant_softmax_default = torch.ops.smx.quant_softmax.default(l_x_, 3, 1.0, 0.00392156862745098, 0, 0, 255, torch.uint8, None)
dequantize_per_tensor = torch.ops.quantized_decomposed.dequantize_per_tensor(quant_softmax_default, 0.00392156862745098, 0, 0, 255, torch.uint8)
return (dequantize_per_tensor,)""")
        s = qsite(r)
        assert (s.action, s.op) == ("rewritten", "smx::quant_softmax")

    def test_codes_returned(self):
        def f(x):
            return QD.quantize_per_tensor(x.softmax(-1), 0.01, 3, 0, 127, torch.uint8)

        r = rewrite(f, x4(), atol=0)
        self.assertExpectedInline(r.after, """\
def forward(self, L_x_ : torch.Tensor):
l_x_ = L_x_
quant_softmax_default = torch.ops.smx.quant_softmax.default(l_x_, 3, 1.0, 0.01, 3, 0, 127, torch.uint8, None)
return (quant_softmax_default,)""")
        self.assertExpectedInline(qsite(r).detail, """quantized_decomposed.quantize_per_tensor, dim=3, scale=0.01, zero_point=3, [0, 127] uint8""")

    def test_int8_dim1_nn_softmax(self):
        sm = nn.Softmax(dim=1)

        def f(x):
            q = QD.quantize_per_tensor(sm(x), 1 / 255, -128, -128, 127, torch.int8)
            return QD.dequantize_per_tensor(q, 1 / 255, -128, -128, 127, torch.int8)

        r = rewrite(f, x4(), atol=0)
        assert qsite(r).action == "rewritten" and "dim=1" in qsite(r).detail

    def test_fake_quantize(self):
        def f(x):
            return torch.fake_quantize_per_tensor_affine(torch.softmax(x, -1), 1 / 15, 0, 0, 15)

        r = rewrite(f, x4(), atol=0)
        self.assertExpectedInline(r.after, """\
def forward(self, L_x_ : torch.Tensor):
l_x_ = L_x_
quant_softmax_default = torch.ops.smx.quant_softmax.default(l_x_, 3, 1.0, 0.06666666666666667, 0, 0, 15, torch.uint8, None)
dequantize_per_tensor_default = torch.ops.quantized_decomposed.dequantize_per_tensor.default(quant_softmax_default, 0.06666666666666667, 0, 0, 15, torch.uint8)
return (dequantize_per_tensor_default,)""")

    def test_torch_quantize_per_tensor_dequantize(self):
        def f(x):
            return torch.quantize_per_tensor(F.softmax(x, -1), 1 / 255, 0, torch.quint8).dequantize()

        r = rewrite(f, x4(), atol=0)
        self.assertExpectedInline(r.after, """\
def forward(self, L_x_ : torch.Tensor):
l_x_ = L_x_
quant_softmax_default = torch.ops.smx.quant_softmax.default(l_x_, 3, 1.0, 0.00392156862745098, 0, 0, 255, torch.uint8, None)
dequantize_per_tensor_default = torch.ops.quantized_decomposed.dequantize_per_tensor.default(quant_softmax_default, 0.00392156862745098, 0, 0, 255, torch.uint8)
return (dequantize_per_tensor_default,)""")

    def test_fp16_softmax_rounds_before_quantizing(self):
        r = rewrite(qdq, x4(torch.float16), atol=0)
        assert "probabilities rounded to float16" in qsite(r).detail
        assert "torch.float16" in r.after

    def test_softmax_dtype_and_cast(self):
        def f(x):
            p = F.softmax(x, dim=-1, dtype=torch.float32).to(torch.bfloat16)
            return QD.quantize_per_tensor(p, S, 0, 0, 255, torch.uint8)

        r = rewrite(f, x4(torch.bfloat16), atol=0)
        assert qsite(r).action == "rewritten"
        assert "probabilities rounded to bfloat16" in qsite(r).detail

    def test_masked_rows(self):
        x = x4()
        x[..., 3:] = float("-inf")
        x[0, 0, 0] = float("-inf")     # a fully masked row: NaN probabilities
        r = rewrite(qdq, x, check_values=False)
        assert qsite(r).action == "rewritten"
        want, got = qdq(x), r.gm(*r.inputs)[0]
        ok = ~torch.isnan(F.softmax(x, -1))
        assert torch.equal(got[ok], want[ok])
        assert (got[0, 0, 0] == 0).all()     # NaN probabilities -> zero_point (dequantize to 0)

    def test_site_named_by_module(self):
        class A(nn.Module):
            def forward(self, x):
                return qdq(x)

        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.a = A()

            def forward(self, x):
                return self.a(x)

        from smxcompile.passes import analyze
        from pass_helpers import dynamo_graph

        gm = dynamo_graph(M(), x4())
        (s,) = [s for s in analyze(gm.graph, SmxOptions.from_mapping(REWRITE)) if s.kind == "quant_softmax"]
        assert (s.module, s.index, s.key) == ("a", 0, "a#0"), s


class TestNearMisses(TestCase):
    def test_softmax_used_elsewhere(self):
        def f(x):
            p = F.softmax(x, -1)
            return QD.quantize_per_tensor(p, S, 0, 0, 255, torch.uint8), p.sum()

        r = rewrite(f, x4(), atol=0)
        s = qsite(r)
        assert s.action == "skipped" and "also used elsewhere" in s.reason
        assert "smx.quant_softmax" not in r.after

    def test_tensor_scale(self):
        def f(x, s):
            return QD.quantize_per_tensor.tensor(F.softmax(x, -1), s, torch.tensor(0), 0, 255, torch.uint8)

        r = rewrite(f, x4(), torch.tensor(S), atol=0)
        assert not [s for s in r.report if s.kind == "quant_softmax" and s.action == "rewritten"]

    def test_log_softmax_is_not_matched(self):
        def f(x):
            return QD.quantize_per_tensor(F.log_softmax(x, -1).exp(), S, 0, 0, 255, torch.uint8)

        r = rewrite(f, x4(), atol=0)
        assert not [s for s in r.report if s.kind == "quant_softmax"]

    def test_wide_quant_range(self):
        def f(x):
            return torch.fake_quantize_per_tensor_affine(F.softmax(x, -1), 1 / 1000, 0, 0, 1000)

        r = rewrite(f, x4(), atol=0)
        s = qsite(r)
        assert s.action == "skipped" and "does not fit" in s.reason

    def test_fake_quantize_with_grad_is_qat(self):
        def f(x):
            return torch.fake_quantize_per_tensor_affine(F.softmax(x, -1), S, 0, 0, 255)

        r = rewrite(f, x4().requires_grad_(), check_values=False)
        s = qsite(r)
        assert s.action == "skipped" and "QAT" in s.reason

    def test_cpu_auto_keeps_and_softmax_pass_leaves_it(self):
        r = rewrite(qdq, x4(), options=None, atol=0)
        s = qsite(r)
        assert s.action == "kept" and "Inductor fuses" in s.reason
        assert not r.changed

    def test_disabled(self):
        r = rewrite(qdq, x4(), options={"cpu": "rewrite", "quant_softmax": False}, atol=0)
        s = qsite(r)
        assert s.action == "kept" and "disabled" in s.reason
        assert "smx.softmax" not in r.after    # the softmax pass does not take its softmax either

    def test_attention_with_qdq_is_not_fused_as_plain_attention(self):
        def f(q, k, v):
            p = QD.quantize_per_tensor(F.softmax(q @ k.transpose(-1, -2) * 0.125, -1), S, 0, 0, 255, torch.uint8)
            return QD.dequantize_per_tensor(p, S, 0, 0, 255, torch.uint8) @ v

        q, k, v = x4(shape=(1, 2, 6, 8)), x4(shape=(1, 2, 6, 8), seed=1), x4(shape=(1, 2, 6, 8), seed=2)
        r = rewrite(f, q, k, v, atol=1e-5)
        kinds = {s.kind: s.action for s in r.report}
        assert kinds == {"quant_softmax": "rewritten"}, str(r.report)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_compiled_equals_eager(bits, dtype):
    hi = 2 ** bits - 1

    def f(x):
        q = QD.quantize_per_tensor(F.softmax(x, -1), 1 / hi, 0, 0, hi, torch.uint8)
        return q, QD.dequantize_per_tensor(q, 1.05 / hi, 0, 0, hi, torch.uint8, out_dtype=dtype)

    x = x4(dtype, shape=(4, 33))
    want = f(x)
    torch._dynamo.reset()
    got = torch.compile(f, backend="smx", options=REWRITE)(x)
    assert smxcompile.last_report().count(kind="quant_softmax", action="rewritten") == 1
    diff = (got[0].int() - want[0].int()).abs()
    # an Inductor-compiled softmax may differ from eager's in the last ulp: a code can move by one
    # level where the probability sits on a rounding boundary; never more, and rarely
    assert diff.max() <= 1 and diff.float().mean() < 0.01
    torch._dynamo.reset()


def test_fake_quantize_fp16_keeps_its_dtype():
    def f(x):
        return torch.fake_quantize_per_tensor_affine(torch.softmax(x, -1), 1 / 255, 0, 0, 255)

    x = x4(torch.float16)
    try:
        want = f(x)
    except RuntimeError:
        pytest.skip("fake_quantize_per_tensor_affine has no fp16 kernel on this build")
    r = rewrite(f, x, atol=0)
    assert qsite(r).action == "rewritten"
    got = r.gm(*r.inputs)[0]
    assert got.dtype == want.dtype and torch.equal(got, want)
