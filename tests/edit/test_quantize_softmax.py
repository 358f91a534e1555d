"""Tests of ``smxcompile.quantize_softmax``: calibration, the bias correction, site selection, errors,
and real transformers models under eager, Inductor and the ``smx`` backend.

Method: "Softmax Bias Correction for Quantized Generative Models" (Pandey et al., 2023).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import smxcompile
from smxcompile.edit.quant_site import quant_range
from smxcompile.edit.quantize import SoftmaxQuantizer, quantize_softmax

QD = torch.ops.quantized_decomposed


# --------------------------------------------------------------------------- toy models


class Probe(nn.Module):
    """Returns the softmax of its input: the probabilities are known exactly."""

    def forward(self, x):
        return F.softmax(x, dim=-1)


class Attn(nn.Module):
    def __init__(self, d=16, heads=4, causal=True):
        super().__init__()
        self.h, self.d, self.causal = heads, d, causal
        self.qkv = nn.Linear(d, 3 * d)
        self.o = nn.Linear(d, d)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.h, self.d // self.h).permute(2, 0, 3, 1, 4)
        s = q @ k.transpose(-1, -2) / math.sqrt(self.d // self.h)
        if self.causal:
            s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        p = F.softmax(s, dim=-1)
        return self.o((p @ v).transpose(1, 2).reshape(b, t, -1))


class Net(nn.Module):
    """Two attention layers and a softmax classifier head (not attention)."""

    def __init__(self, d=16, heads=4, classes=5):
        super().__init__()
        self.layers = nn.ModuleList([Attn(d, heads), Attn(d, heads)])
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x).softmax(-1)


def batches(n=3, b=2, t=12, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(b, t, d, generator=g) * 2,) for _ in range(n)]


def net(seed=0):
    torch.manual_seed(seed)
    return Net().eval()


# --------------------------------------------------------------------------- calibration


class TestCalibration:
    @pytest.mark.parametrize("granularity", ["head", "tensor"])
    @pytest.mark.parametrize("method", ["scale", "offset"])
    def test_statistics_equal_a_direct_computation(self, granularity, method):
        g = torch.Generator().manual_seed(1)
        calib = [(torch.randn(2, 3, 5, 40, generator=g) * 3,) for _ in range(3)]
        qm = quantize_softmax(Probe(), calib, where="all", bits=8, correction=method, granularity=granularity,
                              observer="minmax", progress=False)
        (site,) = qm.smx_softmax_quant.sites.values()
        p = torch.cat([F.softmax(c[0], -1) for c in calib], 0).double()
        scale = float(p.max()) / 255
        assert site.scale.item() == pytest.approx(scale, rel=1e-6)
        assert int(site.zero_point) == 0
        q = QD.quantize_per_tensor(p.float(), site._scale_f, 0, 0, 255, torch.uint8)
        pq = (q.double() * site._scale_f)
        dims = (0, 2, 3) if granularity == "head" else (0, 1, 2, 3)
        if method == "scale":
            want = p.sum(dims) / pq.sum(dims)
        else:
            want = ((p - pq).sum(dims) / (p > 0).double().sum(dims)).clamp_min(0)
        assert site.granularity == granularity
        torch.testing.assert_close(site.correction.double(), want.reshape(-1), rtol=1e-5, atol=1e-9)

    def test_unit_observer_never_clips_minmax_does(self):
        # calibrated on long flat rows (largest probability ~0.1), run on short peaked ones
        calib = [(torch.randn(4, 3, 2, 64) * 0.3,)]
        x = torch.randn(4, 3, 2, 4) * 3
        rows = {}
        for observer in ("unit", "minmax"):
            qm = quantize_softmax(Probe(), calib, where="all", bits=8, correction=False, observer=observer,
                                  progress=False)
            site = next(iter(qm.smx_softmax_quant.sites.values()))
            rows[observer] = (site.scale.item(), qm(x).sum(-1))
        assert rows["unit"][0] == pytest.approx(1 / 255)
        assert (rows["unit"][1] - 1).abs().max() < 4 * (1 / 255)
        assert rows["minmax"][0] < 1 / 1000 and rows["minmax"][1].max() < 0.5     # clipped, as documented

    @pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 7, 8])
    @pytest.mark.parametrize("dtype", [torch.uint8, torch.int8])
    def test_corrected_rows_sum_to_one_within_a_step_on_average(self, bits, dtype):
        calib = batches(4)
        qm = quantize_softmax(net(), calib, bits=bits, dtype=dtype, progress=False)
        q = qm.smx_softmax_quant
        assert len(q.sites) == 2 and all(s.kind == "attention" for s in q.sites.values())
        with torch.no_grad(), q.collecting():
            for b in calib:
                qm(*b)
        st = q.stats()
        for key, site in q.sites.items():
            assert abs(st[key]["mean_rowsum"] - 1) <= site.scale.item(), (key, st[key])
        # without correction the rows are biased low at few bits (many probabilities -> 0)
        if bits <= 4:
            raw = quantize_softmax(net(), calib, bits=bits, dtype=dtype, correction=False, progress=False)
            with torch.no_grad(), raw.smx_softmax_quant.collecting():
                for b in calib:
                    raw(*b)
            assert raw.smx_softmax_quant.stats()["all"]["mean_rowsum"] < 1 - 0.01

    @pytest.mark.parametrize("bits", [2, 4, 8])
    def test_codes_and_range(self, bits):
        lo, hi = quant_range(bits, torch.int8)
        assert (lo, hi) == (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
        calib = batches(2)
        qm = quantize_softmax(net(), calib, bits=bits, dtype=torch.int8, progress=False)
        site = next(iter(qm.smx_softmax_quant.sites.values()))
        assert int(site.zero_point) == lo
        x = torch.rand(2, 4, 12, 12)
        y = F.softmax(x, -1)
        codes = site.quantize(y)
        assert codes.dtype == torch.int8 and int(codes.min()) >= lo and int(codes.max()) <= hi
        # every code dequantizes within half a step of the probability (before the correction)
        deq = site.dequantize(codes, torch.float32, corrected=False)
        assert (deq - y).abs().max() <= site.scale.item() / 2 + 1e-6

    def test_masked_positions_stay_exactly_zero(self):
        calib = batches(3)
        for method in ("scale", "offset"):
            qm = quantize_softmax(net(), calib, bits=4, correction=method, progress=False)
            seen = []

            def grab(mod, args, out):
                seen.append(out)

            site = next(iter(qm.smx_softmax_quant.sites.values()))
            h = site.register_forward_hook(grab)
            with torch.no_grad():
                qm(*calib[0])
            h.remove()
            p = seen[0]
            t = p.shape[-1]
            future = torch.ones(t, t, dtype=torch.bool).triu(1)
            assert (p[..., future] == 0).all(), method
            assert (p[..., ~future] >= 0).all()

    @pytest.mark.parametrize("fill", [-1e4, -1e9, float("-inf")])
    def test_masks_of_any_large_value_get_no_offset(self, fill):
        class Masked(nn.Module):
            def forward(self, s):
                t = s.shape[-1]
                return F.softmax(s + torch.ones(t, t).triu(1) * fill if fill != float("-inf")
                                 else s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), fill), dim=-1)

        g = torch.Generator().manual_seed(0)
        calib = [(torch.randn(2, 4, 8, 8, generator=g) * 2,) for _ in range(2)]
        qm = quantize_softmax(Masked(), calib, where="all", bits=4, progress=False)
        site = next(iter(qm.smx_softmax_quant.sites.values()))
        assert site.correction.max() > 0
        out = qm(calib[0][0])
        assert (out[..., torch.ones(8, 8, dtype=torch.bool).triu(1)] == 0).all()

    def test_finfo_min_masks_get_no_offset(self):
        class MinMask(Attn):
            def forward(self, x):
                b, t, _ = x.shape
                q, k, v = self.qkv(x).view(b, t, 3, self.h, self.d // self.h).permute(2, 0, 3, 1, 4)
                s = q @ k.transpose(-1, -2)
                s = s + torch.ones(t, t).triu(1) * torch.finfo(s.dtype).min     # transformers' additive mask
                p = F.softmax(s, dim=-1)
                return self.o((p @ v).transpose(1, 2).reshape(b, t, -1))

        torch.manual_seed(0)
        m = MinMask().eval()
        calib = batches(2)
        qm = quantize_softmax(m, calib, bits=4, correction="offset", where="all", progress=False)
        site = next(iter(qm.smx_softmax_quant.sites.values()))
        assert site.correction.min() > 0
        seen = []
        h = site.register_forward_hook(lambda mod, args, out: seen.append(out))
        with torch.no_grad():
            qm(*calib[0])
        h.remove()
        t = seen[0].shape[-1]
        assert (seen[0][..., torch.ones(t, t, dtype=torch.bool).triu(1)] == 0).all()

    def test_position_granularity(self):
        calib = batches(3, t=10)
        qm = quantize_softmax(net(), calib, bits=4, granularity="position", progress=False)
        site = qm.smx_softmax_quant.sites["layers.0#0"]
        assert site.granularity == "position" and site.correction.shape == (4 * 10,)
        # direct computation for layer 0 (its inputs do not depend on the quantization)
        probs = []
        m = net()
        with torch.no_grad():
            for (x,) in calib:
                a = m.layers[0]
                b_, t_, _ = x.shape
                q, k, v = a.qkv(x).view(b_, t_, 3, a.h, a.d // a.h).permute(2, 0, 3, 1, 4)
                s = (q @ k.transpose(-1, -2) / math.sqrt(a.d // a.h)).masked_fill(
                    torch.ones(t_, t_, dtype=torch.bool).triu(1), float("-inf"))
                probs.append(F.softmax(s, -1))
        p = torch.cat(probs).double()
        pq = QD.quantize_per_tensor(p.float(), site._scale_f, 0, 0, 15, torch.uint8).double() * site._scale_f
        valid = torch.ones(10, 10, dtype=torch.bool).tril().expand_as(p)
        want = ((p - pq).sum((0, 3)) / valid.double().sum((0, 3))).clamp_min(0)   # (heads, positions)
        torch.testing.assert_close(site.correction.double().view(4, 10), want, rtol=1e-5, atol=1e-9)
        # a decode step (1 query over 10 keys) uses position 9's entry; a longer sequence clamps
        y = F.softmax(torch.randn(1, 4, 1, 10), -1)
        assert torch.equal(site._view(site.correction, y).reshape(4), site.correction.view(4, 10)[:, 9])
        y = F.softmax(torch.randn(1, 4, 12, 12), -1)
        v = site._view(site.correction, y).reshape(4, 12)
        assert torch.equal(v[:, 9:], site.correction.view(4, 10)[:, 9:10].expand(4, 3))

    def test_offset_never_makes_a_probability_negative(self):
        # rows (0.75, 0.083, 0.083, 0.083) at 3 bits: step 0.107, the small ones round up -> rounding
        # adds mass (beta < 0 before the clamp); head 1 has rows that lose mass instead
        g = torch.Generator().manual_seed(3)
        up = torch.tensor([0.75, 0.25 / 3, 0.25 / 3, 0.25 / 3]).log()
        calib = []
        for _ in range(3):
            x = up.expand(2, 2, 5, 4).clone() + torch.randn(2, 2, 5, 4, generator=g) * 0.02
            x[:, 1] = torch.randn(2, 5, 4, generator=g) * 3
            calib.append((x,))
        qm = quantize_softmax(Probe(), calib, where="all", bits=3, progress=False)
        site = next(iter(qm.smx_softmax_quant.sites.values()))
        p = torch.cat([F.softmax(c[0], -1) for c in calib]).double()
        pq = QD.quantize_per_tensor(p.float(), site._scale_f, 0, 0, 7, torch.uint8).double() * site._scale_f
        raw = (p - pq).sum((0, 2, 3)) / (p.numel() / 2)
        assert raw[0] < 0 < raw[1], raw                  # the case this test is about
        assert site.correction[0] == 0 and site.correction[1] > 0
        with torch.no_grad():
            assert (qm(calib[0][0]) >= 0).all()

    def test_correction_reduces_the_row_sum_bias(self):
        calib = batches(4)
        out = {}
        for corr in (False, True):
            qm = quantize_softmax(net(), calib, bits=4, correction=corr, progress=False)
            with torch.no_grad(), qm.smx_softmax_quant.collecting():
                for b in calib:
                    qm(*b)
            out[corr] = qm.smx_softmax_quant.stats()
        assert abs(out[True]["all"]["mean_rowsum"] - 1) < abs(out[False]["all"]["mean_rowsum"] - 1) / 5
        # the first layer sees the same inputs either way: same codes (the second sees corrected outputs)
        assert out[True]["layers.0#0"]["zero_fraction"] == out[False]["layers.0#0"]["zero_fraction"]

    def test_disabled_is_the_original_model_and_outputs_change_when_enabled(self):
        m = net()
        calib = batches(2)
        qm = quantize_softmax(m, calib, bits=4, progress=False)
        x = calib[0][0]
        with torch.no_grad():
            ref = m(x)
            with qm.smx_softmax_quant.disabled():
                torch.testing.assert_close(qm(x), ref, rtol=0, atol=0)
            assert (qm(x) - ref).abs().max() > 1e-4
        # not in place: the original model has no quantizer and no hooks
        assert not hasattr(m, "smx_softmax_quant")
        assert not any(mod._forward_pre_hooks for mod in m.modules())

    def test_inplace(self):
        m = net()
        out = quantize_softmax(m, batches(1), inplace=True, progress=False)
        assert out is m and isinstance(m.smx_softmax_quant, SoftmaxQuantizer)

    def test_state_dict_round_trip(self):
        calib = batches(2)
        a = quantize_softmax(net(), calib, bits=6, progress=False)
        b = quantize_softmax(net(), batches(2, seed=5), bits=6, progress=False)
        b.load_state_dict(a.state_dict())
        x = calib[0][0]
        with torch.no_grad():
            torch.testing.assert_close(b(x), a(x), rtol=0, atol=0)

    def test_deepcopy_is_independent(self):
        import copy

        calib = batches(2)
        a = quantize_softmax(net(), calib, bits=4, progress=False)
        b = copy.deepcopy(a)
        x = calib[0][0]
        with torch.no_grad():
            torch.testing.assert_close(b(x), a(x), rtol=0, atol=0)
            with b.smx_softmax_quant.disabled():     # the copy's switch acts on the copy only
                assert (b(x) - a(x)).abs().max() > 1e-4
            with b.smx_softmax_quant.collecting():
                b(x)
        assert b.smx_softmax_quant.stats()["all"]["rows"] > 0
        assert a.smx_softmax_quant.stats()["all"]["rows"] == 0

    def test_pickle_round_trip(self, tmp_path):
        calib = batches(2)
        a = quantize_softmax(net(), calib, bits=6, progress=False)
        torch.save(a, tmp_path / "q.pt")
        b = torch.load(tmp_path / "q.pt", weights_only=False)
        x = calib[0][0]
        with torch.no_grad():
            torch.testing.assert_close(b(x), a(x), rtol=0, atol=0)

    def test_state_dict_of_other_bits_is_refused(self):
        a = quantize_softmax(net(), batches(1), bits=8, progress=False)
        b = quantize_softmax(net(), batches(1), bits=4, progress=False)
        with pytest.raises(RuntimeError, match=r"saved for codes \[0, 255\].*\[0, 15\]"):
            b.load_state_dict(a.state_dict())

    @pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
    def test_half_model_compiles(self, dtype):
        calib = [(b[0].to(dtype),) for b in batches(2)]
        m = net().to(dtype)
        qm = quantize_softmax(m, calib, bits=8, progress=False)
        x = calib[0][0]
        with torch.no_grad():
            ref = qm(x)
            for backend in ("inductor", "smx"):
                torch._dynamo.reset()
                got = torch.compile(qm, backend=backend)(x)
                assert got.dtype == dtype
                torch.testing.assert_close(got.float(), ref.float(), rtol=2e-2, atol=2e-2)
        torch._dynamo.reset()

    def test_calibration_batch_formats(self):
        class KW(nn.Module):
            def forward(self, x, scale=1.0):
                return F.softmax(x * scale, -1)

        x = torch.randn(2, 8)
        for data in ([x], [(x,)], [{"x": x, "scale": 2.0}], iter([x, x])):
            qm = quantize_softmax(KW(), data, where="all", progress=False)
            assert len(qm.smx_softmax_quant.sites) == 1


class UserQDQ(nn.Module):
    """Attention whose probabilities the model quantizes itself (as a PT2E flow or hand-written QAT code would)."""

    def __init__(self, spelling, d=16, heads=4):
        super().__init__()
        self.spelling, self.h, self.d = spelling, heads, d
        self.qkv = nn.Linear(d, 3 * d)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.h, self.d // self.h).permute(2, 0, 3, 1, 4)
        s = (q @ k.transpose(-1, -2)).masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        p = F.softmax(s, dim=-1)
        if self.spelling == "qd":
            p = QD.dequantize_per_tensor(QD.quantize_per_tensor(p, 1 / 15, 0, 0, 15, torch.uint8), 1 / 15, 0, 0, 15,
                                         torch.uint8)
        elif self.spelling == "fake":
            p = torch.fake_quantize_per_tensor_affine(p, 1 / 15, 0, 0, 15)
        else:
            p = torch.quantize_per_tensor(p, 1 / 15, 0, torch.quint8).dequantize()
        return (p @ v).transpose(1, 2).reshape(b, t, -1)


class TestModelsOwnQuantizer:
    @pytest.mark.parametrize("spelling", ["qd", "fake", "qtensor"])
    def test_correction_of_the_models_own_qdq(self, spelling):
        torch.manual_seed(0)
        m = UserQDQ(spelling).eval()
        calib = batches(3)
        with pytest.raises(ValueError, match="already quantizes it"):
            quantize_softmax(m, calib, progress=False)
        qm = quantize_softmax(m, calib, where="all", progress=False)
        (site,) = qm.smx_softmax_quant.sites.values()
        assert site.user is not None and site._scale_f == 1 / 15
        assert (site.quant_min, site.quant_max) == ((0, 255) if spelling == "qtensor" else (0, 15))
        # beta against a direct computation on the calibration probabilities
        probs = []
        with torch.no_grad():
            for (x,) in calib:
                b_, t_, _ = x.shape
                q, k, v = m.qkv(x).view(b_, t_, 3, 4, 4).permute(2, 0, 3, 1, 4)
                s = (q @ k.transpose(-1, -2)).masked_fill(torch.ones(t_, t_, dtype=torch.bool).triu(1), float("-inf"))
                probs.append(F.softmax(s, -1))
        p = torch.cat(probs).double()
        pq = torch.clamp(torch.round(p.float() * 15), 0, 15).double() / 15
        valid = torch.ones(12, 12, dtype=torch.bool).tril().expand_as(p)
        want = ((p - pq).sum((0, 2, 3)) / valid.double().sum((0, 2, 3))).clamp_min(0)
        torch.testing.assert_close(site.correction.double(), want, rtol=1e-5, atol=1e-9)
        assert (want > 0).all()
        # the model's dequantized probabilities + beta on unmasked entries; one quantization only
        x = calib[0][0]
        with torch.no_grad():
            ref = m(x)
            out = qm(x)
            assert (out - ref).abs().max() > 1e-4
            with qm.smx_softmax_quant.collecting():
                qm(x)
            st = qm.smx_softmax_quant.stats()["all"]
            assert abs(st["mean_rowsum"] - 1) < abs(st["mean_abs_rowsum_err_uncorrected"])
            torch._dynamo.reset()
            got = torch.compile(qm, backend="smx", options={"cpu": "rewrite"})(x)
            torch.testing.assert_close(got, out, rtol=1e-5, atol=1e-5)
            rep = smxcompile.last_report()
            assert rep.count(kind="quant_softmax", action="rewritten") == 1, str(rep)
        torch._dynamo.reset()


# --------------------------------------------------------------------------- site selection


class TestSelection:
    def test_attention_only_by_default(self):
        qm = quantize_softmax(net(), batches(1), progress=False)
        q = qm.smx_softmax_quant
        assert sorted(q.sites) == ["layers.0#0", "layers.1#0"]
        assert q.skipped == {"#0": "not attention (kind softmax)"}
        s = q.summary()
        assert "layers.0#0" in s and "skipped" in s

    def test_all_predicate_and_keys(self):
        assert len(quantize_softmax(net(), batches(1), where="all", progress=False).smx_softmax_quant.sites) == 3
        qm = quantize_softmax(net(), batches(1), where=lambda s: s.module == "layers.1", progress=False)
        assert sorted(qm.smx_softmax_quant.sites) == ["layers.1#0"]
        qm = quantize_softmax(net(), batches(1), where=["#0"], progress=False)
        assert sorted(qm.smx_softmax_quant.sites) == ["#0"]

    def test_shared_module_called_twice_uses_one_site(self):
        class Twice(nn.Module):
            def __init__(self):
                super().__init__()
                self.p = Probe()

            def forward(self, x):
                return self.p(x) + self.p(x * 2)

        qm = quantize_softmax(Twice(), [torch.randn(3, 6)], where="all", progress=False)
        assert sorted(qm.smx_softmax_quant.sites) == ["p#0"]

    def test_nn_softmax_and_method_spellings_are_named_by_module(self):
        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.sm = nn.Softmax(dim=-1)

            def forward(self, x):
                return self.sm(x) + torch.softmax(x, 0) + x.softmax(dim=1) + torch.special.softmax(x, -1)

        qm = quantize_softmax(M(), [torch.randn(4, 4)], where="all", progress=False)
        assert sorted(qm.smx_softmax_quant.sites) == ["#0", "#1", "#2", "sm#0"]


# --------------------------------------------------------------------------- errors


class TestErrors:
    def test_empty_calibration(self):
        with pytest.raises(ValueError, match="calibration_data is empty"):
            quantize_softmax(net(), [], progress=False)

    @pytest.mark.parametrize("kw, msg", [
        ({"bits": 1}, "bits must be"), ({"bits": 9}, "bits must be"), ({"dtype": torch.float16}, "dtype must be"),
        ({"correction": "bogus"}, "correction must be"), ({"granularity": "row"}, "granularity must be"),
        ({"where": "everything"}, "where must be"), ({"where": ["nope#0"]}, "unknown softmax site"),
    ])
    def test_bad_arguments(self, kw, msg):
        with pytest.raises(ValueError, match=msg):
            quantize_softmax(net(), batches(1), progress=False, **kw)

    def test_single_batch_instead_of_a_list(self):
        with pytest.raises(ValueError, match="wrap it in a list"):
            quantize_softmax(net(), batches(1)[0][0], progress=False)
        with pytest.raises(ValueError, match="wrap it in a list"):
            quantize_softmax(net(), {"x": batches(1)[0][0]}, progress=False)

    def test_where_of_a_wrong_type(self):
        with pytest.raises(ValueError, match="where must be"):
            quantize_softmax(net(), batches(1), where=3, progress=False)

    def test_graph_break_names_the_way_out(self):
        class Talk(Attn):
            def forward(self, x):
                print("", end="")      # a graph break inside the attention module
                return super().forward(x)

        class Two(nn.Module):
            def __init__(self):
                super().__init__()
                torch.manual_seed(0)
                self.a, self.b = Talk(), Attn()

            def forward(self, x):
                return self.b(self.a(x))

        calib = batches(1)
        try:
            qm = quantize_softmax(Two(), calib, progress=False)
        except ValueError as e:
            assert "where='all'" in str(e) and "graph break" in str(e)
        else:   # Dynamo kept the module names: then both sites must be the attention ones
            assert sorted(qm.smx_softmax_quant.sites) == ["a#0", "b#0"]
        qm = quantize_softmax(Two(), calib, where="all", progress=False)
        assert sorted(qm.smx_softmax_quant.sites) == ["a#0", "b#0"]
        assert all(s.kind == "unclassified" for s in qm.smx_softmax_quant.sites.values())

    def test_already_quantized(self):
        qm = quantize_softmax(net(), batches(1), progress=False)
        with pytest.raises(ValueError, match="already quantized"):
            quantize_softmax(qm, batches(1), progress=False)

    def test_no_softmax_call(self):
        class Sdpa(nn.Module):
            def forward(self, x):
                return F.scaled_dot_product_attention(x, x, x)

        with pytest.raises(ValueError, match="attn_implementation='eager'"):
            quantize_softmax(Sdpa(), [torch.randn(1, 2, 4, 8)], progress=False)

    def test_nothing_selected_lists_the_sites(self):
        with pytest.raises(ValueError, match="not attention"):
            quantize_softmax(Probe(), [torch.randn(2, 5)], progress=False)

    def test_site_without_finite_rows(self):
        x = torch.full((2, 5), float("-inf"))
        with pytest.raises(ValueError, match="saw no row of finite probabilities"):
            quantize_softmax(Probe(), [x], where="all", progress=False)

    def test_layout_not_calibrated(self):
        qm = quantize_softmax(net(), batches(1), progress=False)
        attn = qm.layers[0]
        attn.h = 2   # the same module now produces 2 heads
        with pytest.raises(RuntimeError, match="calibrated on 4-D probabilities with 4 heads"):
            qm(batches(1)[0][0])


# --------------------------------------------------------------------------- compiled


class TestCompiled:
    def test_inductor_and_smx_match_the_eager_quantized_model(self):
        calib = batches(2)
        qm = quantize_softmax(net(), calib, bits=8, progress=False)
        x = calib[1][0]
        with torch.no_grad():
            ref = qm(x)
            for backend, options in (("inductor", None), ("smx", None), ("smx", {"cpu": "rewrite"})):
                torch._dynamo.reset()
                got = torch.compile(qm, backend=backend, options=options)(x)
                torch.testing.assert_close(got, ref, rtol=1e-4, atol=2e-5)
                if backend == "smx":
                    rep = smxcompile.last_report()
                    sites = rep.filter(kind="quant_softmax")
                    assert len(sites) == 2, str(rep)
                    want = "rewritten" if options else "kept"
                    assert all(s.action == want for s in sites), str(rep)
                    assert sorted(s.key for s in sites) == ["layers.0#0", "layers.1#0"]
                    assert all("test_quantize_softmax.py" in s.location for s in sites), str(rep)
        torch._dynamo.reset()


def test_torch_export_carries_the_corrected_qdq_pairs():
    calib = batches(2)
    x = calib[0][0]
    for corr, dq in (("scale", QD.dequantize_per_channel.default), ("offset", QD.dequantize_per_tensor.default)):
        qm = quantize_softmax(net(), calib, bits=8, correction=corr, progress=False)
        ep = torch.export.export(qm, (x,), strict=False)
        targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
        assert targets.count(QD.quantize_per_tensor.default) == 2
        assert targets.count(dq) == 2    # scale: per-head corrected scales; offset: + beta on unmasked entries
        with torch.no_grad():
            torch.testing.assert_close(ep.module()(x), qm(x), rtol=0, atol=0)


# --------------------------------------------------------------------------- real models


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=128, n_positions=64, n_embd=32, n_layer=2, n_head=4, attn_pdrop=0.0,
                     resid_pdrop=0.0, embd_pdrop=0.0)
    return GPT2LMHeadModel(cfg).eval()


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).eval()


@pytest.mark.slow
@pytest.mark.parametrize("build", [_gpt2, _llama], ids=["gpt2", "llama"])
def test_transformers_models(build):
    model = build()
    model.config._attn_implementation = "eager"
    for mod in model.modules():
        if hasattr(mod, "config"):
            mod.config._attn_implementation = "eager"
    g = torch.Generator().manual_seed(0)
    calib = [{"input_ids": torch.randint(0, 128, (2, 16), generator=g)} for _ in range(2)]
    qm = quantize_softmax(model, calib, bits=8, progress=False)
    q = qm.smx_softmax_quant
    assert len(q.sites) == 2 and all(s.kind == "attention" and s.granularity == "head" for s in q.sites.values())
    ids = torch.randint(0, 128, (2, 16), generator=g)
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        out = qm(input_ids=ids).logits
        assert 0 < (out - ref).abs().max() < 0.05
        torch._dynamo.reset()
        got = torch.compile(qm, backend="smx", options={"cpu": "rewrite"})(input_ids=ids).logits
        torch.testing.assert_close(got, out, rtol=1e-4, atol=1e-4)
        rep = smxcompile.last_report()
        assert rep.count(kind="quant_softmax", action="rewritten") == 2, str(rep)
    torch._dynamo.reset()
