"""The ``check`` option covers every rewrite kind of the pass list: a correct rewrite passes its check, and a
wrong replacement (injected through the pass protocol's ``run_site``) is caught and the original kept."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import smxcompile
from smxcompile.passes import PASSES

QD = torch.ops.quantized_decomposed
CHECK = {"check": True, "cpu": "rewrite"}


def _softmax(x):
    return torch.softmax(x * 0.5, -1)


def _topk(x):
    v, i = torch.topk(torch.softmax(x, -1), 3)
    return v / v.sum(-1, keepdim=True), i


def _quant(x):
    q = QD.quantize_per_tensor(torch.softmax(x, -1), 1 / 255, 0, 0, 255, torch.uint8)
    return QD.dequantize_per_tensor(q, 1 / 255, 0, 0, 255, torch.uint8)


def _attention(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1) * 0.25, -1) @ v


def _linear_ce(h, w, y):
    return F.cross_entropy(F.linear(h, w), y)


def _inputs(kind):
    g = torch.Generator().manual_seed(0)
    if kind == "attention":
        return tuple(torch.randn(2, 2, 8, 16, generator=g) for _ in range(3))
    if kind == "cross_entropy":
        return torch.randn(6, 8, generator=g), torch.randn(40, 8, generator=g), torch.randint(0, 40, (6,), generator=g)
    return (torch.randn(4, 32, generator=g) * 3,)


CASES = {"softmax": _softmax, "softmax_topk": _topk, "quant_softmax": _quant, "attention": _attention,
         "cross_entropy": _linear_ce}


def _wrong(out):
    """A visibly wrong version of a replacement's result."""
    if isinstance(out, tuple):
        return (_wrong(out[0]),) + tuple(out[1:])
    if out.dtype == torch.uint8:
        return (out.int() + 3).clamp(0, 255).to(torch.uint8)
    return out + 0.25


def _sample(x):
    return torch.multinomial(torch.softmax(x.masked_fill(x < torch.topk(x, 3)[0][..., -1:], -float("inf")), -1), 1)


#: passes whose sites check cannot compare with eager value by value (random draws)
UNCHECKABLE = {"sample": _sample}


def test_every_pass_is_covered():
    assert sorted(p.name for p in PASSES) == sorted([*CASES, *UNCHECKABLE])


def test_an_uncheckable_site_stays_rewritten_under_check():
    rep = smxcompile.explain(_sample, torch.randn(2, 30), options=CHECK)
    (site,) = rep.filter(kind="sample")
    assert site.action == "rewritten", str(rep)


@pytest.mark.parametrize("kind", sorted(CASES))
@pytest.mark.parametrize("inject", [False, True], ids=["honest", "wrong"])
def test_check_passes_a_correct_rewrite_and_catches_a_wrong_one(kind, inject, monkeypatch):
    p = next(p for p in PASSES if p.name == kind)
    if inject:
        real = type(p).run_site
        monkeypatch.setattr(type(p), "run_site", lambda self, m, values: _wrong(real(self, m, values)))
    rep = smxcompile.explain(CASES[kind], *_inputs(kind), options=CHECK)
    (site,) = rep.filter(kind="linear_cross_entropy" if kind == "cross_entropy" else kind)
    if inject:
        # a kept top-k site leaves its softmax to the softmax pass, which checks it on its own
        assert site.action == "kept" and site.reason.startswith("check failed"), str(rep)
    else:
        assert site.action == "rewritten", str(rep)


def test_a_rejected_quant_softmax_site_computes_what_eager_computes(monkeypatch):
    # quant_softmax had no check before the pass protocol: the kept site must be the original graph
    p = next(p for p in PASSES if p.name == "quant_softmax")
    real = type(p).run_site
    monkeypatch.setattr(type(p), "run_site", lambda self, m, values: _wrong(real(self, m, values)))
    torch._dynamo.reset()
    from smxcompile.backends.smx import compiled_reports

    n0 = len(compiled_reports)
    (x,) = _inputs("quant_softmax")
    got = torch.compile(_quant, backend="smx", options=CHECK)(x)
    assert torch.equal(got, _quant(x))
    (rep,) = compiled_reports[n0:]
    assert [(s.kind, s.action) for s in rep] == [("quant_softmax", "kept")], str(rep)


def test_what_a_failed_site_leaves_to_a_later_pass_is_checked_too(monkeypatch):
    # a softmax + top-k site that fails its check leaves its softmax to the softmax pass: that site is checked
    # in a second round, not rewritten unchecked
    for kind in ("softmax_topk", "softmax"):
        p = next(p for p in PASSES if p.name == kind)
        monkeypatch.setattr(type(p), "run_site", (lambda real: lambda self, m, values: _wrong(real(self, m, values)))(
            type(p).run_site))
    rep = smxcompile.explain(_topk, *_inputs("softmax_topk"), options=CHECK)
    assert [(s.kind, s.action, s.reason[:12]) for s in rep] == [("softmax_topk", "kept", "check failed"),
                                                                ("softmax", "kept", "check failed")], str(rep)


def test_a_bf16_site_is_checked_at_bf16_precision():
    # softmax(x).double() of bf16 x: eager rounds the probabilities to bf16 before the cast, the op writes them
    # in fp64 (closer to the gold); a tolerance below bf16's would reject the rewrite
    x = (torch.randn(8, 256, generator=torch.Generator().manual_seed(0)) * 2).to(torch.bfloat16)
    rep = smxcompile.explain(lambda t: torch.softmax(t, -1).double(), x, options=CHECK)
    assert [(s.kind, s.action) for s in rep] == [("softmax", "rewritten")], str(rep)
