"""``smxcompile.attention`` / ``smx::attention``: every normalizer, forward and backward, on the CPU path.

Accuracy rule (forward and every gradient, elementwise): against a float64 materialized gold
(:func:`attention_reference` in fp64), ``|ours - gold| <= |naive - gold| + tol`` where ``naive`` is
the same materialized reference run in fp32 (the plain-torch way). Independent oracles: the
normalizers' textbook formulas written out here, ``F.scaled_dot_product_attention`` for softmax,
and the ``entmax`` package for sparsemax / 1.5-entmax.
"""

from __future__ import annotations

import math

import entmax
import pytest
import torch
import torch.nn.functional as F

import smxcompile
from smxcompile.kernels import config
from smxcompile.kernels.attention import NORMALIZERS, attention, attention_reference
from smxcompile.kernels.attention import torch_path as A  # the blocked torch path

NAMES = list(NORMALIZERS)
PARAM_NAMES = [n for n, z in NORMALIZERS.items() if z.takes_param]
NAME_PARAM = [(n, False) for n in NAMES] + [(n, True) for n in PARAM_NAMES]
INF = float("-inf")


# --------------------------------------------------------------------------- helpers


@pytest.fixture(autouse=True)
def _through_the_op(monkeypatch):
    """These tests hold the op (its recomputing backward included): an eager call with gradients would otherwise
    run the torch path under torch's autograd (``test_eager_autograd_path_matches_the_op`` compares the two)."""
    from smxcompile.kernels.attention import api

    monkeypatch.setattr(api, "EAGER_AUTOGRAD_MAX_SCORE_BYTES", 0)


@pytest.mark.parametrize("normalizer,softcap,dropout_p", [("softmax", 30.0, 0.0), ("sparsemax", None, 0.0),
                                                          ("ssmax", None, 0.2), ("softpick", 5.0, 0.0)])
def test_eager_autograd_path_matches_the_op(monkeypatch, normalizer, softcap, dropout_p):
    """The eager path (torch's autograd through the blocked forward, small calls) gives the op's values and
    gradients, dropout masks included (same seed)."""
    from smxcompile.kernels.attention import api

    q, k, v = make(B=2, Hq=4, Hkv=2, L=13, S=11)
    mask = padding_mask(2, 13, 11)
    runs = []
    for budget in (0, 2**30):
        monkeypatch.setattr(api, "EAGER_AUTOGRAD_MAX_SCORE_BYTES", budget)
        ins = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
        torch.manual_seed(5)
        out = attention(*ins, attn_mask=mask, enable_gqa=True, normalizer=normalizer, softcap=softcap,
                        dropout_p=dropout_p)
        g = torch.randn(out.shape, generator=torch.Generator().manual_seed(6))
        runs.append((out, torch.autograd.grad(out, ins, g)))
    (o0, g0), (o1, g1) = runs
    assert o1.grad_fn is not None and "Attention" not in type(o1.grad_fn).__name__
    torch.testing.assert_close(o1, o0, rtol=1e-6, atol=1e-7)
    for a, b in zip(g1, g0):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def make(B=2, Hq=4, Hkv=2, L=13, S=11, E=8, Ev=6, dtype=torch.float32, seed=0, spread=1.5):
    g = torch.Generator().manual_seed(seed)
    lead = () if B is None else (B,)
    q = (torch.randn(*lead, Hq, L, E, generator=g) * spread).to(dtype)
    k = (torch.randn(*lead, Hkv, S, E, generator=g) * spread).to(dtype)
    v = torch.randn(*lead, Hkv, S, Ev, generator=g).to(dtype)
    return q, k, v


def param_for(name, Hq=4, seed=1, dtype=torch.float32):
    """A per-head parameter in a sensible range for each normalizer."""
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(Hq, generator=g, dtype=torch.float64)
    val = {"sigmoid": -3.0 + 2.0 * u, "relu": 0.1 + 0.4 * u, "softpick": 1e-3 + 1e-2 * u,
           "ssmax": 0.5 + u, "softplus": 1.0 + u}[name]
    return val.to(dtype)


def padding_mask(B, L, S, seed=3):
    """bool (B, 1, L, S): random keys masked, row 2 of batch 0 masked entirely."""
    g = torch.Generator().manual_seed(seed)
    m = torch.rand(B, 1, L, S, generator=g) > 0.3
    m[0, 0, 2] = False
    return m


def float_mask(L, S, seed=4):
    """float (L, S): finite biases, some -inf, row 1 all -inf."""
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(L, S, generator=g)
    m[torch.rand(L, S, generator=g) < 0.25] = INF
    m[1] = INF
    return m


CONFIGS = {
    "plain": dict(),
    "causal": dict(is_causal=True),
    "bool_mask": dict(mask="bool"),
    "float_mask_softcap": dict(mask="float", softcap=4.0),
}


def config_kwargs(cfg, B, L, S):
    kw = dict(CONFIGS[cfg])
    m = kw.pop("mask", None)
    if m == "bool":
        kw["attn_mask"] = padding_mask(B, L, S)
    elif m == "float":
        kw["attn_mask"] = float_mask(L, S)
    return kw


def leaves(*ts, dtype=None):
    return [(t.to(dtype) if dtype else t).detach().clone().requires_grad_() for t in ts]


def run_with_grads(fn, inputs, grad_out_seed=7, round_to=None):
    """``fn(*inputs)`` and the gradients for a fixed random upstream gradient (rounded to ``round_to``
    first, so that runs in different output dtypes see the same one)."""
    out = fn(*inputs)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(grad_out_seed), dtype=torch.float64)
    if round_to is not None:
        g = g.to(round_to)
    grads = torch.autograd.grad(out, inputs, g.to(out.dtype), allow_unused=True)
    return out, grads


def assert_gold(ours, naive, gold, atol, rtol=0.0, what=""):
    ours, naive, gold = ours.double(), naive.double(), gold.double()
    assert torch.isfinite(ours).all(), f"{what}: non-finite"
    err = (ours - gold).abs()
    bound = (naive - gold).abs() + atol + rtol * gold.abs()
    bad = err > bound
    assert not bad.any(), f"{what}: max excess {(err - bound).max().item():.3g}, max err {err.max().item():.3g}"


def attn_fn(name, param=None, **kw):
    def fn(q, k, v, p=None):
        return attention(q, k, v, enable_gqa=q.shape[-3] != k.shape[-3], normalizer=name,
                         norm_param=p if p is not None else param, **kw)
    return fn


def ref_fn(name, dtype, param=None, **kw):
    def fn(q, k, v, p=None):
        return attention_reference(q, k, v, normalizer=name, norm_param=p if p is not None else param,
                                   dtype=dtype, **kw)
    return fn


# These tests drive the torch (CPU) path, whatever SMX_FORCE_TRITON says; the Triton kernels have their own tests.
pytestmark = pytest.mark.usefixtures("torch_path")


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of a few rows, so the block loop runs many times."""
    monkeypatch.setattr(A, "BLOCK_BYTES", 2 * 4 * 11 * 3)  # 3 rows of a 2-head group at S = 11, fp32


# --------------------------------------------------------------------------- every normalizer vs the fp64 gold


@pytest.mark.parametrize("cfg", list(CONFIGS))
@pytest.mark.parametrize("name", NAMES)
def test_normalizer_forward_backward_gold(name, cfg, small_blocks):
    B, L, S = 2, 13, 11
    q, k, v = make(B=B, L=L, S=S)
    kw = config_kwargs(cfg, B, L, S)
    if name == "softmax" and "softcap" not in kw:
        kw["softcap"] = 5.0  # plain softmax routes to SDPA; softcap forces the op
    base = [q, k, v]
    if name in PARAM_NAMES:
        base.append(param_for(name))
    ours, g_ours = run_with_grads(attn_fn(name, **kw), leaves(*base))
    naive, g_naive = run_with_grads(ref_fn(name, torch.float32, **kw), leaves(*base))
    gold, g_gold = run_with_grads(ref_fn(name, torch.float64, **kw), leaves(*base, dtype=torch.float64))
    assert ours.dtype == torch.float32 and ours.shape == (B, 4, L, 6)
    assert_gold(ours, naive, gold, atol=2e-6, rtol=1e-6, what="out")
    for what, a, b, c in zip(["dq", "dk", "dv", "dparam"], g_ours, g_naive, g_gold):
        assert a.shape == c.shape
        assert_gold(a, b, c, atol=1e-5, rtol=1e-5, what=what)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", NAMES)
def test_normalizer_half_gold(name, dtype):
    q, k, v = make(dtype=dtype, L=9, S=10)
    kw = dict(is_causal=True, softcap=20.0 if name == "softmax" else None)
    base = [q, k, v] + ([param_for(name, dtype=dtype)] if name in PARAM_NAMES else [])
    bf = dtype
    ours, g_ours = run_with_grads(attn_fn(name, **kw), leaves(*base), round_to=bf)
    naive, g_naive = run_with_grads(ref_fn(name, torch.float32, **kw), leaves(*base), round_to=bf)
    gold, g_gold = run_with_grads(ref_fn(name, torch.float64, **kw), leaves(*base, dtype=torch.float64), round_to=bf)
    assert ours.dtype == dtype
    tol = torch.finfo(dtype).eps
    # naive is fp32 math; both it and ours round the result to the input dtype once
    assert_gold(ours, naive.to(dtype), gold, atol=1e-6, rtol=tol, what="out")
    for what, a, b, c in zip(["dq", "dk", "dv", "dparam"], g_ours, g_naive, g_gold):
        assert a.dtype == dtype
        assert_gold(a, b, c, atol=1e-4, rtol=tol, what=what)


@pytest.mark.parametrize("name", ["softpick", "entmax15", "sigmoid"])
def test_fp64_inputs(name):
    q, k, v = make(dtype=torch.float64, L=6, S=7)
    ins = leaves(q, k, v)
    out, g = run_with_grads(attn_fn(name, is_causal=True), ins)
    ref, gr = run_with_grads(ref_fn(name, torch.float64, is_causal=True), leaves(q, k, v))
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    for a, b in zip(g, gr):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


# --------------------------------------------------------------------------- independent oracles


def textbook(name, s, keep, n, param):
    """Each normalizer's formula as the paper writes it, unstabilized, fp64, masked keys dropped."""
    keepf = keep.to(s.dtype)
    z = torch.where(keep, s, 0.0)
    if name == "softmax":
        e = torch.exp(z) * keepf
        return e / e.sum(-1, keepdim=True)
    if name == "softmax1":
        e = torch.exp(z) * keepf
        return e / (1.0 + e.sum(-1, keepdim=True))
    if name == "sigmoid":
        b = -torch.log(n) if param is None else param
        return torch.sigmoid(z + b) * keepf
    if name == "relu":
        c = 1.0 / n if param is None else param
        return torch.relu(z) * c * keepf
    if name == "softpick":
        eps = 1e-6 if param is None else param
        u = (torch.exp(z) - 1.0) * keepf
        return torch.relu(u) / (u.abs().sum(-1, keepdim=True) + eps)
    if name == "ssmax":
        p = 1.0 if param is None else param
        e = torch.exp(p * torch.log(n) * z) * keepf
        return e / e.sum(-1, keepdim=True)
    if name == "softplus":
        c = torch.log(n.clamp(min=2)) if param is None else param
        e = torch.log1p(torch.exp(c * z)) * keepf
        return e / e.sum(-1, keepdim=True)
    if name == "sparsemax":
        return entmax.sparsemax(torch.where(keep, s, -1e30), dim=-1) * keepf
    if name == "entmax15":
        return entmax.entmax15(torch.where(keep, s, -1e30), dim=-1) * keepf
    raise AssertionError(name)


@pytest.mark.parametrize("name,with_param", NAME_PARAM)
def test_refs_match_textbook_formulas(name, with_param):
    g = torch.Generator().manual_seed(5)
    H, L, S = 3, 6, 9
    s = torch.randn(2, H, L, S, generator=g, dtype=torch.float64) * 2
    keep = torch.rand(2, 1, L, S, generator=g) > 0.3
    keep[..., 0] = True  # no empty rows here (the textbook softmax would divide by 0)
    n = torch.arange(1, L + 1, dtype=torch.float64).unsqueeze(-1) + 3
    param = param_for(name, Hq=H, dtype=torch.float64).view(H, 1, 1) if with_param else None
    ours = NORMALIZERS[name].ref(s, keep, n, param)
    torch.testing.assert_close(ours, textbook(name, s, keep, n, param), rtol=1e-10, atol=1e-12)
    assert (ours[~keep.expand_as(ours)] == 0).all()


@pytest.mark.parametrize("name,with_param", NAME_PARAM)
def test_vjps_match_autograd_through_refs(name, with_param):
    """Each hand-written ``Normalizer.vjp`` (the torch path's backward) against autograd through its ``ref``:
    float and bool-style masks, -inf scores at masked keys, rows with every key masked, n from causality."""
    g = torch.Generator().manual_seed(8)
    H, L, S = 3, 7, 10
    s0 = torch.randn(2, H, L, S, generator=g, dtype=torch.float64) * 2.5
    keep = torch.rand(2, 1, L, S, generator=g) > 0.35
    keep[1, 0, 4] = False
    s0 = torch.where(keep | (torch.rand(s0.shape, generator=g) > 0.5), s0, INF)  # some masked scores are -inf
    n = torch.arange(1, L + 1, dtype=torch.float64).clamp(max=S).unsqueeze(-1)
    s = s0.clone().requires_grad_()
    param = param_for(name, Hq=H, dtype=torch.float64).view(H, 1, 1).requires_grad_() if with_param else None
    spec = NORMALIZERS[name]
    w = spec.ref(s, keep, n, param)
    dw = torch.randn(w.shape, generator=g, dtype=torch.float64)
    want = torch.autograd.grad(w, [s] + ([param] if with_param else []), dw)
    ds, dpe = spec.vjp(s0, keep, n, None if param is None else param.detach(), w.detach(), dw)
    assert torch.isfinite(ds).all() and (ds[~keep.expand_as(ds)] == 0).all()
    torch.testing.assert_close(ds, want[0], rtol=1e-10, atol=1e-12)
    if with_param:
        torch.testing.assert_close(dpe.sum((-2, -1)).sum(0).view(H, 1, 1), want[1], rtol=1e-10, atol=1e-12)
    else:
        assert (dpe is None) == (not spec.takes_param)


@pytest.mark.parametrize("name", ["sparsemax", "entmax15"])
def test_sparse_maps_vs_entmax_package(name):
    oracle = entmax.sparsemax if name == "sparsemax" else entmax.entmax15
    g = torch.Generator().manual_seed(6)
    x = (torch.randn(40, 17, generator=g, dtype=torch.float64) * 3).requires_grad_()
    x2 = x.detach().clone().requires_grad_()
    ours = NORMALIZERS[name].ref(x, None, None, None)
    theirs = oracle(x2, dim=-1)
    torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-12)
    assert (ours == 0).any() and (ours > 0).sum(-1).min() >= 1  # sparse rows, non-empty supports
    gy = torch.randn(40, 17, generator=g, dtype=torch.float64)
    torch.testing.assert_close(torch.autograd.grad(ours, x, gy)[0], torch.autograd.grad(theirs, x2, gy)[0],
                               rtol=1e-9, atol=1e-12)
    # through the whole op (fp32, the torch path), against the package on materialized scores
    q, k, v = make(B=1, Hq=2, Hkv=2, L=8, S=12)
    ins = leaves(q, k, v)
    out, go = run_with_grads(attn_fn(name), ins)
    qd, kd, vd = leaves(q, k, v, dtype=torch.float64)
    ref = oracle(qd @ kd.transpose(-1, -2) / math.sqrt(8), dim=-1) @ vd
    gref = torch.autograd.grad(ref, [qd, kd, vd], torch.randn(ref.shape, generator=torch.Generator().manual_seed(7),
                                                              dtype=torch.float64))
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    for a, b in zip(go, gref):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-5)


CASES_SDPA = {
    "plain": lambda B, L, S: dict(),
    "causal": lambda B, L, S: dict(is_causal=True),
    "bool": lambda B, L, S: dict(attn_mask=padding_mask(B, L, S)),
    "float": lambda B, L, S: dict(attn_mask=float_mask(L, S)),
}


@pytest.mark.parametrize("case", list(CASES_SDPA))
@pytest.mark.parametrize("gqa", [False, True])
def test_op_softmax_vs_sdpa(case, gqa, small_blocks):
    """The op itself (a huge softcap is the identity to fp32 precision) against torch's SDPA."""
    B, L, S = 2, 13, 11
    q, k, v = make(B=B, Hkv=2 if gqa else 4, L=L, S=S, spread=1.0)
    kw = CASES_SDPA[case](B, L, S)
    ours, g_ours = run_with_grads(lambda q, k, v: attention(q, k, v, enable_gqa=gqa, softcap=1e7, **kw),
                                  leaves(q, k, v))
    ref, g_ref = run_with_grads(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa, **kw),
                                leaves(q, k, v))
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    for a, b in zip(g_ours, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_softmax_routes_to_sdpa(monkeypatch):
    q, k, v = make()
    calls = []
    real = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    out = attention(q, k, v, is_causal=True, enable_gqa=True)
    assert calls
    torch.testing.assert_close(out, real(q, k, v, is_causal=True, enable_gqa=True), rtol=0, atol=0)


def test_softcap_vs_naive():
    q, k, v = make(spread=3.0)
    c = 2.5
    out = attention(q, k, v, enable_gqa=True, softcap=c, is_causal=True)
    kr, vr = k.double().repeat_interleave(2, 1), v.double().repeat_interleave(2, 1)
    s = q.double() @ kr.transpose(-1, -2) / math.sqrt(8)
    s = c * torch.tanh(s / c)
    s = s.masked_fill(~torch.ones(13, 11, dtype=torch.bool).tril(), INF)
    torch.testing.assert_close(out.double(), torch.softmax(s, -1) @ vr, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", PARAM_NAMES)
def test_default_params(name):
    """Explicit parameters equal to the documented defaults give the same result (non-causal: n = S)."""
    S = 11
    default = {"sigmoid": -math.log(S), "relu": 1.0 / S, "softpick": 1e-6, "ssmax": 1.0, "softplus": math.log(S)}[name]
    q, k, v = make(S=S)
    a = attention(q, k, v, enable_gqa=True, normalizer=name)
    b = attention(q, k, v, enable_gqa=True, normalizer=name, norm_param=default)
    c = attention(q, k, v, enable_gqa=True, normalizer=name, norm_param=torch.full((4,), default))
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(a, c, rtol=1e-6, atol=1e-7)


# --------------------------------------------------------------------------- masking semantics


@pytest.mark.parametrize("name", NAMES)
def test_fully_masked_rows_give_zero(name):
    B, L, S = 2, 5, 6
    q, k, v = make(B=B, L=L, S=S)
    bmask = torch.ones(B, 1, L, S, dtype=torch.bool)
    bmask[1, 0, 3] = False
    fmask = torch.zeros(L, S)
    fmask[2] = INF
    for mask, rows in ((bmask, (1, slice(None), 3)), (fmask, (slice(None), slice(None), 2))):
        ins = leaves(q, k, v)
        softcap = 30.0 if name == "softmax" else None
        out, (dq, dk, dv) = run_with_grads(attn_fn(name, attn_mask=mask, softcap=softcap), ins)
        assert torch.isfinite(out).all() and all(torch.isfinite(t).all() for t in (dq, dk, dv))
        assert (out[rows] == 0).all()
        assert (dq[rows] == 0).all()
    # SDPA (torch 2.13) does the same for softmax
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=bmask, enable_gqa=True)
    assert (ref[1, :, 3] == 0).all()


@pytest.mark.parametrize("name", NAMES)
def test_masked_keys_get_exactly_zero_weight(name):
    """Huge values at masked keys change nothing (weight exactly 0), for masks and causality."""
    B, L, S = 1, 6, 8
    q, k, v = make(B=B, L=L, S=S)
    mask = torch.ones(L, S, dtype=torch.bool)
    mask[:, 5] = False
    softcap = 30.0 if name == "softmax" else None
    base = attention(q, k, v, attn_mask=mask, enable_gqa=True, normalizer=name, softcap=softcap)
    v2 = v.clone()
    v2[..., 5, :] = 1e30
    assert torch.equal(attention(q, k, v2, attn_mask=mask, enable_gqa=True, normalizer=name, softcap=softcap), base)
    fm = torch.where(mask, 0.0, INF)
    assert torch.equal(attention(q, k, v2, attn_mask=fm, enable_gqa=True, normalizer=name, softcap=softcap), base)
    causal = attention(q, k, v, is_causal=True, enable_gqa=True, normalizer=name, softcap=softcap)
    v3 = v.clone()
    v3[..., 3:, :] = 1e30
    out3 = attention(q, k, v3, is_causal=True, enable_gqa=True, normalizer=name, softcap=softcap)
    assert torch.equal(out3[..., :3, :], causal[..., :3, :])


@pytest.mark.parametrize("name", NAMES)
def test_extreme_scores_finite(name):
    """Scores in the thousands (fp16 inputs; the math is fp32) and finfo.min float masks: no inf/NaN in the
    output or the gradients; the output matches the fp64 gold."""
    q, k, v = make(B=1, L=6, S=7, dtype=torch.float16, spread=1.0)
    q = (q.float() * 60).half()
    mask = torch.zeros(6, 7)
    mask[:, 2] = torch.finfo(torch.float32).min
    mask[3] = torch.finfo(torch.float32).min
    ins = leaves(q, k, v)
    softcap = 1e4 if name == "softmax" else None
    out, grads = run_with_grads(attn_fn(name, attn_mask=mask, softcap=softcap), ins, round_to=torch.float16)
    assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads)
    gold = attention_reference(q, k, v, attn_mask=mask, normalizer=name, softcap=softcap, dtype=torch.float64)
    torch.testing.assert_close(out.double(), gold, rtol=2e-3, atol=2e-3)


def test_causal_L_ne_S():
    for L, S in ((5, 9), (9, 5)):
        q, k, v = make(B=1, Hq=2, Hkv=2, L=L, S=S)
        for name in ("softmax", "sigmoid", "ssmax"):
            softcap = 1e7 if name == "softmax" else None
            ours = attention(q, k, v, is_causal=True, normalizer=name, softcap=softcap)
            ref = attention_reference(q, k, v, is_causal=True, normalizer=name, dtype=torch.float64)
            torch.testing.assert_close(ours.double(), ref, rtol=1e-5, atol=1e-6)
        sd = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.testing.assert_close(attention(q, k, v, is_causal=True, softcap=1e7), sd, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- layouts and shapes


def test_gqa_matches_repeated_kv():
    q, k, v = make(Hq=4, Hkv=2)
    p = param_for("ssmax")
    a = attention(q, k, v, enable_gqa=True, normalizer="ssmax", norm_param=p)
    b = attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), normalizer="ssmax", norm_param=p)
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_noncontiguous_inputs():
    q, k, v = make(B=2, Hq=4, Hkv=2, L=7, S=9, E=8, Ev=8)
    qp = q.transpose(1, 2).contiguous().transpose(1, 2)          # (B, L, H, E) memory
    kp = k.permute(0, 1, 3, 2).contiguous().permute(0, 1, 3, 2)  # K stored transposed
    vp = v[..., ::1].transpose(-1, -2).contiguous().transpose(-1, -2)
    assert not qp.is_contiguous() and not kp.is_contiguous() and not vp.is_contiguous()
    for name in ("softpick", "sparsemax"):
        ins = leaves(q, k, v)
        insp = [t.detach().clone().requires_grad_() for t in (qp, kp, vp)]
        a, ga = run_with_grads(attn_fn(name, is_causal=True), ins)
        b, gb = run_with_grads(attn_fn(name, is_causal=True), insp)
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        for x, y in zip(ga, gb):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


def test_3d_and_5d_inputs_and_batch_broadcast():
    q, k, v = make(B=None, Hq=2, Hkv=2, L=5, S=6)
    out3 = attention(q, k, v, normalizer="relu")
    assert out3.shape == (2, 5, 6)
    torch.testing.assert_close(out3, attention(q[None], k[None], v[None], normalizer="relu")[0])
    q5 = torch.randn(2, 3, 2, 5, 8)
    k5, v5 = torch.randn(2, 3, 1, 6, 8), torch.randn(2, 3, 1, 6, 4)
    p = torch.rand(3, 2, requires_grad=True)  # broadcast over the first batch dim
    mask = torch.rand(2, 1, 1, 1, 6) > 0.3     # padding mask over the first batch dim
    out5 = attention(q5, k5, v5, attn_mask=mask, enable_gqa=True, normalizer="sigmoid", norm_param=p)
    ref = attention_reference(q5, k5, v5, attn_mask=mask, normalizer="sigmoid",
                              norm_param=p.expand(2, 3, 2), dtype=torch.float64)
    assert out5.shape == (2, 3, 2, 5, 4)
    torch.testing.assert_close(out5.double(), ref, rtol=1e-5, atol=1e-6)
    out5.sum().backward()
    assert p.grad is not None and p.grad.shape == (3, 2) and (p.grad != 0).all()
    # key/value batch dims broadcast against the query's
    kb, vb = torch.randn(1, 3, 1, 6, 8), torch.randn(1, 3, 1, 6, 4)
    out_b = attention(q5, kb, vb, enable_gqa=True, normalizer="softplus")
    ref_b = attention_reference(q5, kb.expand(2, 3, 1, 6, 8), vb.expand(2, 3, 1, 6, 4), normalizer="softplus")
    torch.testing.assert_close(out_b, ref_b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape", [(0, 4, 2, 5, 6), (2, 4, 2, 0, 6), (2, 4, 2, 5, 0), (2, 0, 0, 5, 6)])
def test_empty(shape):
    B, Hq, Hkv, L, S = shape
    q, k, v = make(B=B, Hq=Hq, Hkv=Hkv, L=L, S=S)
    ins = leaves(q, k, v)
    out = attention(*ins, enable_gqa=Hq != Hkv, normalizer="sigmoid")
    assert out.shape == (B, Hq, L, 6)
    assert (out == 0).all()
    ref = F.scaled_dot_product_attention(q, k, v, enable_gqa=Hq != Hkv)  # S = 0 gives zeros in SDPA too
    assert ref.shape == out.shape and (ref == 0).all()
    out.sum().backward()
    assert all(t.grad is not None and t.grad.shape == t.shape and (t.grad == 0).all() for t in ins)


def test_zero_head_dim():
    q, k, v = make(E=0)
    out = attention(q, k, v, enable_gqa=True, normalizer="softpick")
    ref = attention_reference(q, k, v, normalizer="softpick")
    torch.testing.assert_close(out, ref)


# --------------------------------------------------------------------------- blocks


def test_plan_blocks_cover_and_bound():
    cases = [(6, 2, 13, 11, 2 * 4 * 11 * 3), (6, 2, 13, 11, 10**6), (3, 4, 100, 7, 4 * 4 * 7 * 16),
             (1, 8, 5, 1000, 16), (5, 1, 1, 3, 4 * 3 * 2)]
    for pairs, group, L, S, budget in cases:
        blocks = A._plan_blocks(pairs, group, L, S, 4, budget)
        seen = torch.zeros(pairs, L, dtype=torch.int64)
        for p0, p1, l0, l1 in blocks:
            seen[p0:p1, l0:l1] += 1
            if (p1 - p0, l1 - l0) != (1, 1):
                assert (p1 - p0) * group * (l1 - l0) * S * 4 <= budget
        assert (seen == 1).all()
    assert len(A._plan_blocks(6, 2, 13, 11, 4, 2 * 4 * 11 * 3)) == 6 * 5
    assert len(A._plan_blocks(6, 2, 13, 11, 4, 10**6)) == 1


def test_block_scores_bounded_and_loop_runs(monkeypatch):
    """Spy on the normalizer: every score block it sees (forward and backward) is within the budget."""
    budget = 2 * 4 * 11 * 3
    monkeypatch.setattr(A, "BLOCK_BYTES", budget)
    shapes = []
    spec = NORMALIZERS["sigmoid"]

    def spy(s, keep, n, param):
        shapes.append(tuple(s.shape))
        return spec.ref(s, keep, n, param)

    monkeypatch.setitem(A.NORMALIZERS, "sigmoid", spec._replace(ref=spy))
    q, k, v = make(B=2, Hq=4, Hkv=2, L=13, S=11)
    ins = leaves(q, k, v)
    out, grads = run_with_grads(attn_fn("sigmoid"), ins)
    assert len(shapes) == 2 * 2 * 5 * 2  # (batch x kv heads) x row blocks, forward + backward
    assert max(math.prod(s) for s in shapes) * 4 <= budget
    monkeypatch.setitem(A.NORMALIZERS, "sigmoid", spec)
    ref, g_ref = run_with_grads(attn_fn("sigmoid"), leaves(q, k, v))  # default blocks: one block
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-7)
    for a, b in zip(grads, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_padding_mask_not_mergeable_is_indexed(small_blocks):
    """A (B, 1, 1, S) mask over a GQA batch cannot be viewed as (B*Hkv, g, L, S): indexed per block."""
    q, k, v = make(B=3, Hq=4, Hkv=2, L=13, S=11)
    mask = torch.rand(3, 1, 1, 11, generator=torch.Generator().manual_seed(2)) > 0.4
    out = attention(q, k, v, attn_mask=mask, enable_gqa=True, normalizer="softmax1")
    ref = attention_reference(q, k, v, attn_mask=mask, normalizer="softmax1", dtype=torch.float64)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- norm_param


@pytest.mark.parametrize("name", PARAM_NAMES)
def test_norm_param_shapes_and_grads(name):
    q, k, v = make(B=2, Hq=4, Hkv=2)
    for p in (param_for(name), param_for(name).expand(2, 4).clone(), param_for(name)[:1].clone()):
        p = p.requires_grad_()
        out = attention(q, k, v, enable_gqa=True, normalizer=name, norm_param=p)
        ref = attention_reference(q, k, v, normalizer=name, norm_param=p.expand(2, 4), dtype=torch.float64)
        torch.testing.assert_close(out.double(), ref.detach(), rtol=1e-5, atol=1e-6)
        (gp,) = torch.autograd.grad(out.square().sum(), p)
        (gr,) = torch.autograd.grad(ref.square().sum(), p)
        assert gp.shape == p.shape and (gp != 0).all()
        torch.testing.assert_close(gp.double(), gr.double(), rtol=1e-4, atol=1e-6)


# --------------------------------------------------------------------------- dropout


def test_dropout_reproducible_and_unbiased():
    q, k, v = make(B=1, Hq=2, Hkv=2, L=4, S=6)
    kw = dict(dropout_p=0.3, normalizer="sigmoid")
    torch.manual_seed(123)
    a = attention(q, k, v, **kw)
    torch.manual_seed(123)
    b = attention(q, k, v, **kw)
    c = attention(q, k, v, **kw)
    assert torch.equal(a, b) and not torch.equal(a, c)
    # mean over many independent masks: a large batch of copies, one mask draw
    n = 3000
    qb, kb, vb = (t.expand(n, *t.shape[1:]) for t in (q, k, v))
    torch.manual_seed(0)
    mean = attention(qb, kb, vb, **kw).mean(0)
    exact = attention(q, k, v, normalizer="sigmoid")[0]
    torch.testing.assert_close(mean, exact, rtol=0, atol=0.05)


@pytest.mark.parametrize("name", ["sigmoid", "softmax1"])
def test_dropout_gradient_uses_forward_mask(name, small_blocks):
    """With v = I the output is the dropped weights: read the mask off the forward, then compare forward
    and gradients with the reference given that mask."""
    B, H, L, S = 2, 2, 13, 11
    q, k, _ = make(B=B, Hq=H, Hkv=H, L=L, S=S)
    v = torch.eye(S).expand(B, H, S, S).contiguous()
    p = 0.4
    torch.manual_seed(7)
    seed_state = torch.get_rng_state()
    ins = leaves(q, k, v)
    out, grads = run_with_grads(attn_fn(name, dropout_p=p, is_causal=True), ins)
    nodrop = attention(q, k, v, normalizer=name, is_causal=True)
    keep = out != 0
    visible = torch.ones(L, S, dtype=torch.bool).tril()
    assert keep[..., ~visible].sum() == 0 and 0.4 < keep[..., visible].float().mean() < 0.8
    torch.testing.assert_close(out[keep], nodrop[keep] / (1 - p), rtol=1e-5, atol=1e-6)
    ref, g_ref = run_with_grads(
        lambda q, k, v: attention_reference(q, k, v, normalizer=name, is_causal=True, dropout_mask=keep,
                                            dropout_p=p), leaves(q, k, v))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    torch.set_rng_state(seed_state)


def test_dropout_gradcheck_fixed_seed():
    q, k, v = make(B=1, Hq=2, Hkv=1, L=3, S=4, E=3, Ev=2, dtype=torch.float64)
    p = torch.tensor([[0.7, 1.2]], dtype=torch.float64)
    args = [t.requires_grad_() for t in (q, k, v, p)]

    def fn(q, k, v, p):
        return torch.ops.smx.attention(q, k, v, None, True, 0.5, 3.0, "ssmax", p, 0.3, torch.tensor(1234))[0]

    assert torch.autograd.gradcheck(fn, args)


# --------------------------------------------------------------------------- registration, compile, autocast


def _opcheck_cases():
    q, k, v = make(B=2, Hq=4, Hkv=2, L=5, S=6, E=4, Ev=3)
    mask = float_mask(5, 6).expand(2, 4, 5, 6)
    p = param_for("sigmoid").expand(2, 4).contiguous()
    return [
        (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), mask, False, 0.5, None, "sigmoid",
         p.requires_grad_(), 0.0, None),
        (q.detach().bfloat16().requires_grad_(), k.detach().bfloat16(), v.detach().bfloat16().requires_grad_(), None,
         True, 0.3, 5.0, "entmax15", None, 0.25, torch.tensor(99)),
    ]


@pytest.mark.parametrize("case", [0, 1])
def test_opcheck(case):
    torch.library.opcheck(torch.ops.smx.attention.default, _opcheck_cases()[case])


def test_opcheck_backward():
    q, k, v = make(B=1, Hq=2, Hkv=1, L=4, S=5, E=4, Ev=3)
    p = torch.rand(1, 2)
    out, stats = torch.ops.smx.attention(q, k, v, None, True, 0.5, None, "ssmax", p, 0.0, None)
    g = torch.randn_like(out)
    torch.library.opcheck(torch.ops.smx.attention_backward.default,
                          (g, q, k, v, out, stats, None, True, 0.5, None, "ssmax", p, 0.0, None))
    torch.library.opcheck(torch.ops.smx.attention_backward.default,
                          (g, q, k, v, out, stats, None, False, 0.5, None, "relu", None, 0.0, None))


def test_triton_route_plumbing(monkeypatch):
    """Where ``config.use_triton`` says so, the op hands the Triton functions the documented arguments:
    contiguous 4-D q/k/v with kv heads un-repeated, the mask expanded to (B, Hq, L, S), norm_param fp32
    (B, Hq), the seed; their results come back as the op's outputs and gradients."""
    from smxcompile.kernels.attention import triton_backward, triton_forward

    seen = {}

    def fwd(q, k, v, attn_mask, is_causal, scale, softcap, normalizer, norm_param, dropout_p, seed, skip_threshold=None,
            n_keys=None):
        assert skip_threshold is None
        seen["n_keys"] = None if n_keys is None else tuple(n_keys.shape)
        seen["fwd"] = (q.shape, k.shape, v.shape, attn_mask.shape, attn_mask.dtype, norm_param.dtype,
                       norm_param.shape, norm_param.is_contiguous(), dropout_p, seed, normalizer, softcap)
        out = A.torch_forward(q, k, v, attn_mask, is_causal, scale, softcap, normalizer, norm_param, dropout_p, seed,
                              n_keys)
        return out, torch.zeros(*out.shape[:3], 2)

    def bwd(grad_out, q, k, v, out, stats, attn_mask, is_causal, scale, softcap, normalizer, norm_param, dropout_p,
            seed, n_keys=None):
        seen["bwd"] = (stats.shape, seed)
        return A.torch_backward(grad_out, q, k, v, attn_mask, is_causal, scale, softcap, normalizer, norm_param,
                                dropout_p, seed, n_keys)

    monkeypatch.setattr(triton_forward, "attention_forward", fwd)
    monkeypatch.setattr(triton_backward, "attention_backward", bwd)
    monkeypatch.setattr(config, "use_triton", lambda t: True)
    q, k, v = make(B=2, Hq=4, Hkv=2, L=5, S=6)
    mask = torch.rand(2, 1, 1, 6) > 0.3
    p = torch.rand(4, dtype=torch.float64, requires_grad=True)
    ins = leaves(q, k, v)
    torch.manual_seed(3)
    out = attention(*ins, attn_mask=mask, dropout_p=0.1, enable_gqa=True, normalizer="ssmax", norm_param=p,
                    softcap=7.0)
    out.sum().backward()
    assert seen["fwd"][:8] == ((2, 4, 5, 8), (2, 2, 6, 8), (2, 2, 6, 6), (2, 4, 5, 6), torch.bool, torch.float32,
                               (2, 4), True)
    assert seen["fwd"][8:] == (0.1, seen["bwd"][1], "ssmax", 7.0) and seen["bwd"][0] == (2, 4, 5, 2)
    assert all(t.grad is not None for t in ins) and p.grad is not None and p.grad.dtype == torch.float64
    assert seen["n_keys"] == (2, 4, 5)   # ssmax with a mask: n counted from the mask, per row


def test_compile_fullgraph():
    q, k, v = make(B=1, Hq=4, Hkv=2, L=6, S=7)
    p = param_for("ssmax").requires_grad_()

    def f(q, k, v, p):
        return attention(q, k, v, is_causal=True, enable_gqa=True, normalizer="ssmax", norm_param=p)

    torch._dynamo.reset()
    cf = torch.compile(f, backend="aot_eager", fullgraph=True)
    a, ga = run_with_grads(cf, leaves(q, k, v) + [p.detach().clone().requires_grad_()])
    b, gb = run_with_grads(f, leaves(q, k, v) + [p.detach().clone().requires_grad_()])
    torch.testing.assert_close(a, b)
    for x, y in zip(ga, gb):
        torch.testing.assert_close(x, y)


def test_autocast_casts_like_sdpa():
    q, k, v = make()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = attention(q, k, v, enable_gqa=True, normalizer="relu")
        sdpa = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    assert ours.dtype == sdpa.dtype == torch.bfloat16
    ref = attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), enable_gqa=True, normalizer="relu")
    assert torch.equal(ours, ref)


def test_public_exports():
    assert smxcompile.attention is attention and smxcompile.NORMALIZERS is NORMALIZERS
    assert "attention" in smxcompile.__all__ and "NORMALIZERS" in smxcompile.__all__
    for nz in NORMALIZERS.values():
        assert nz.formula and nz.paper and (nz.default_param is not None) == nz.takes_param
    assert NORMALIZERS["sparsemax"].whole_row and NORMALIZERS["entmax15"].whole_row
    assert not NORMALIZERS["softmax"].whole_row


# --------------------------------------------------------------------------- errors


def _errors():
    q, k, v = make()
    q4, k4, v4 = make(Hkv=4)
    return [
        (dict(query=q[0, 0], key=k[0, 0], value=v[0, 0]), "at least 3 dims"),
        (dict(key=k.double()), "same dtype"),
        (dict(query=q.int(), key=k.int(), value=v.int()), "fp16, bf16, fp32 or fp64"),
        (dict(enable_gqa=False), "enable_gqa=True"),
        (dict(query=torch.randn(2, 3, 13, 8)), "multiple"),
        (dict(key=k[..., :4]), "key's last dim"),
        (dict(value=v[..., :5, :]), "value"),
        (dict(attn_mask=torch.ones(13, 11, dtype=torch.int32)), "attn_mask must be bool"),
        (dict(attn_mask=torch.ones(12, 11, dtype=torch.bool)), "attn_mask of shape"),
        (dict(attn_mask=torch.zeros(3, 2, 4, 13, 11)), "larger shape"),
        (dict(dropout_p=1.0), "dropout_p"),
        (dict(dropout_p=-0.1), "dropout_p"),
        (dict(softcap=0.0, normalizer="relu"), "softcap"),
        (dict(scale=float("nan")), "scale"),
        (dict(normalizer="nope"), "softmax, softmax1, sigmoid"),
        (dict(norm_param=1.0), "takes no norm_param"),
        (dict(normalizer="sparsemax", norm_param=torch.ones(4)), "takes no norm_param"),
        (dict(normalizer="ssmax", norm_param=torch.ones(3)), "norm_param of shape"),
        (dict(normalizer="ssmax", norm_param=torch.ones(4, 1, 1)), "norm_param of shape"),
        (dict(normalizer="ssmax", norm_param=torch.ones(4, dtype=torch.int64)), "floating-point"),
        (dict(normalizer="ssmax", attn_mask=torch.zeros(13, 11, requires_grad=True)), "requires grad"),
        (dict(query=torch.randn(3, 4, 13, 8)), "batch dims"),
    ]


@pytest.mark.parametrize("case", range(22))
def test_errors(case):
    kw, msg = _errors()[case]
    q, k, v = make()
    args = dict(query=q, key=k, value=v, enable_gqa=True)
    args.update(kw)
    with pytest.raises(ValueError, match=msg):
        attention(**args)
    with pytest.raises(RuntimeError):  # catchable as SDPA's error type too
        attention(**args)


def test_type_errors():
    q, k, v = make()
    with pytest.raises(TypeError, match="query"):
        attention(q.tolist(), k, v)
    with pytest.raises(TypeError, match="is_causal"):
        attention(q, k, v, is_causal=1, enable_gqa=True)


@pytest.mark.parametrize("normalizer", ["softmax", "sigmoid"])
def test_mask_with_is_causal_combines_like_sdpa(normalizer):
    """torch 2.13's SDPA accepts attn_mask together with is_causal and applies both; so does the op route."""
    q, k, v = make(B=1, Hq=2, Hkv=2, L=6, S=6)
    keep = torch.rand(1, 1, 6, 6, generator=torch.Generator().manual_seed(0)) > 0.3
    keep[..., 0] = True
    tri = torch.ones(6, 6, dtype=torch.bool).tril()
    softcap = 5.0 if normalizer == "softmax" else None   # softmax on the op's route needs a softcap
    got = attention(q, k, v, attn_mask=keep, is_causal=True, normalizer=normalizer, softcap=softcap)
    want = attention(q, k, v, attn_mask=keep & tri, normalizer=normalizer, softcap=softcap)
    torch.testing.assert_close(got, want)
