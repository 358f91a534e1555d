"""A softmax whose every use reads only its row maximum is a softmax + top-1 selection, whatever the spelling:
``argmax``, ``max(dim)`` (values, indices or both), a ``gather`` at the argmax, behind no-op casts and
copies (Switch Transformers' and NLLB-MoE's routers write ``softmax(x, dtype=fp32).to(fp32)`` then ``argmax`` and
``max(...).values``; PhiMoE gathers the probabilities at the argmax).

Each form: the site is rewritten (the probabilities are never written), values and gradients pass
``|ours - gold| <= |torch - gold| + tol`` against fp64, indices equal eager's (the first maximum, NaN / inf / -inf
rows included). Near-misses (a one-hot product reading every entry, a gather at another index, a max over
another dim) are not rewritten."""

from __future__ import annotations

import pytest
import torch

from pass_helpers import check_against_gold, rewrite


def _logits(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 3


def switch_router(x):                       # argmax and max values of one softmax behind a no-op cast
    p = torch.softmax(x, dim=-1, dtype=torch.float32).to(x.dtype)
    return torch.max(p, dim=-1).values.unsqueeze(-1), torch.argmax(p, dim=-1)


def gather_at_argmax(x):                    # PhiMoE's multiplier: the probability at the chosen expert
    idx = x.max(dim=-1, keepdim=True)[1]
    return torch.softmax(x, dim=-1).gather(dim=-1, index=idx), idx


def copies_and_keepdim(x):
    p = torch.softmax(x.contiguous(), -1).clone()
    m = p.max(-1, keepdim=True)
    return m.values, m.indices, p.argmax(-1)


def max_of_dim_0(x):
    m = torch.softmax(x, 0).max(0)
    return m.values, m.indices


CASES = {"switch_router": switch_router, "gather_at_argmax": gather_at_argmax, "copies_and_keepdim": copies_and_keepdim,
         "max_of_dim_0": max_of_dim_0}


@pytest.mark.parametrize("name", list(CASES))
def test_top1_selection_is_rewritten_and_exact(name):
    fn = CASES[name]
    x = _logits(6, 9)
    x[1, 2] = x[1, 5] = x[1].max() + 1                  # a tie: eager's index is the first
    r = rewrite(fn, x)
    assert [(s.kind, s.action) for s in r.report] == [("softmax_topk", "rewritten")], str(r.report)
    assert "softmax" not in r.after.replace("softmax_topk", ""), r.after
    got, want = r.gm(*r.inputs), fn(x)
    for g, w in zip(got, want if isinstance(want, tuple) else (want,)):
        if not g.is_floating_point():
            assert torch.equal(g, w)
    w = _logits(*(want[0] if isinstance(want, tuple) else want).shape, seed=3).double()
    check_against_gold(r, fn, (x,), w, tol=1e-6)


def test_special_rows_match_eager():
    x = _logits(5, 8)
    x[0, 3] = float("nan")
    x[1, 4] = float("inf")
    x[2] = float("-inf")
    x[3, :6] = float("-inf")
    r = rewrite(switch_router, x)
    assert r.report.count(kind="softmax_topk", action="rewritten") == 1
    (v, i), (rv, ri) = r.gm(*r.inputs), switch_router(x)
    torch.testing.assert_close(v, rv, equal_nan=True)
    assert torch.equal(i, ri)


def argmax_only(x):
    return torch.softmax(x, -1).argmax(-1)


def half_router(x):                         # the probabilities in the logits' dtype, read twice
    p = torch.softmax(x, dim=-1)
    return torch.max(p, dim=-1).values, torch.argmax(p, dim=-1)


def _near_ties(dtype, gap):
    """Rows whose logit 6 is above logit 5 by less than ``gap``, both well above the rest."""
    x = _logits(64, 8)
    x = x - x.amax(-1, keepdim=True) - 1
    x[:, 5] = 0.0
    x[:, 6] = gap * torch.rand(64, generator=torch.Generator().manual_seed(1))
    return x.to(dtype)


@pytest.mark.parametrize("fn", [half_router, argmax_only])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_near_ties_take_the_larger_logit(dtype, fn):
    """Logits a rounding apart may give equal probabilities, and eager's argmax then takes the first, the smaller
    logit (in fp32 only within about 1e-7). The rewrite answers as fp64 does, and as Inductor does in fp16 / bf16;
    the value is the same rounded probability either way."""
    x = _near_ties(dtype, {torch.float32: 3e-8, torch.float16: 3e-4, torch.bfloat16: 3e-3}[dtype])
    want = fn(x)
    gold = torch.softmax(x.double(), -1).argmax(-1)
    assert not torch.equal(gold, want[1] if isinstance(want, tuple) else want), "no rounding tie"
    r = rewrite(fn, x, check_values=False)
    assert r.report.count(kind="softmax_topk", action="rewritten") == 1, str(r.report)
    got = r.gm(*r.inputs)
    assert torch.equal(got[-1], gold)
    if isinstance(want, tuple):
        torch.testing.assert_close(got[0], want[0], atol=0, rtol=1e-6)


def one_hot_product(x):                     # NLLB-MoE's normalization reads p * one_hot(argmax): every entry
    p = torch.softmax(x, -1)
    i = p.argmax(-1)
    return (p * torch.nn.functional.one_hot(i, x.shape[-1])).sum(-1), i


def gather_elsewhere(x, idx):
    p = torch.softmax(x, -1)
    return p.gather(-1, idx), p.argmax(-1)


def max_over_other_dim(x):
    p = torch.softmax(x, -1)
    return p.max(0).values, p.argmax(-1)


NEAR_MISSES = {"one_hot_product": (one_hot_product, lambda: (_logits(6, 9),)),
               "gather_elsewhere": (gather_elsewhere, lambda: (_logits(6, 9), torch.zeros(6, 1, dtype=torch.long))),
               "max_over_other_dim": (max_over_other_dim, lambda: (_logits(6, 9),))}


@pytest.mark.parametrize("name", list(NEAR_MISSES))
def test_near_miss_is_not_rewritten(name):
    fn, make = NEAR_MISSES[name]
    r = rewrite(fn, *make())
    assert not r.report.count(kind="softmax_topk", action="rewritten"), str(r.report)


def test_switch_transformers_router_is_rewritten_in_training():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.SwitchTransformersConfig(vocab_size=64, d_model=32, d_ff=64, d_kv=8, num_heads=4, num_layers=2,
                                                num_experts=4, encoder_sparse_step=1,
                                                dropout_rate=0.0, router_jitter_noise=0.0)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.SwitchTransformersEncoderModel(cfg).train()
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    import smxcompile

    report = smxcompile.explain(model, input_ids=ids, options={"cpu": "rewrite"})
    routers = [s for s in report if s.kind == "softmax_topk"]
    assert routers and all(s.action == "rewritten" for s in routers), str(report)

    def step(fn):
        torch.manual_seed(1)
        out = fn(input_ids=ids).last_hidden_state
        grads = torch.autograd.grad(out.square().sum(), list(model.parameters()), allow_unused=True)
        return out, grads

    torch._dynamo.reset()
    ref, g_ref = step(model)
    got, g_got = step(torch.compile(model, backend="smx", options={"cpu": "rewrite"}))
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    for a, b in zip(g_got, g_ref):
        if b is not None:
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
