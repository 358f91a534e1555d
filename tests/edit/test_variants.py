"""smxcompile.variants: each variant against its formula written out here (fp64), the entmax package
as oracle, gradcheck, masks, fully masked rows, half precision, pretrained starts, the registry."""

from __future__ import annotations

import math

import pytest
import torch
from entmax import entmax15 as ent_entmax15
from entmax import entmax_bisect as ent_bisect
from entmax import sparsemax as ent_sparsemax

from smxcompile import variants as V

ALL = [
    "sparsemax", "entmax15", "entmax_bisect", "softpick", "ssmax", "multimax", "sa_softmax",
    "softmax1", "sigmoid", "relu", "softplus", "stablemax", "adaptive_temperature", "temperature",
]


def _x(*shape, seed=0, scale=2.0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)


# ---------------- independent formulas (fp64, no mask, last dim) ----------------

def f_softmax(x):
    e = torch.exp(x - x.max(-1, keepdim=True).values)
    return e / e.sum(-1, keepdim=True)


def f_softpick(x, eps=1e-6):
    u = torch.exp(x) - 1
    return torch.relu(u) / (u.abs().sum(-1, keepdim=True) + eps)


def f_ssmax(x, s=1.0):
    return f_softmax(s * math.log(x.shape[-1]) * x)


def f_multimax(x, r, t):
    sig = (x + t[0] * torch.relu(r[0] - x) + t[1] * torch.relu(x - r[1])
           + t[2] * torch.relu(r[2] - x) ** 2 + t[3] * torch.relu(x - r[3]) ** 2)
    return f_softmax(sig)


def f_sa(x):
    lo = torch.clamp(x.min(-1, keepdim=True).values, max=0)
    hi = torch.clamp(x.max(-1, keepdim=True).values, min=0)
    return (x - lo) / (hi - lo) * f_softmax(x)


def f_softmax1(x):
    e = torch.exp(x)
    return e / (1 + e.sum(-1, keepdim=True))


def f_sigmoid(x, b=None):
    return torch.sigmoid(x + (-math.log(x.shape[-1]) if b is None else b))


def f_relu(x, c=None):
    return torch.relu(x) * (1 / x.shape[-1] if c is None else c)


def f_softplus(x, c=None):
    c = math.log(max(x.shape[-1], 2)) if c is None else c
    e = torch.nn.functional.softplus(c * x)
    return e / e.sum(-1, keepdim=True)


def f_stablemax(x):
    s = torch.tensor([[v + 1 if v >= 0 else 1 / (1 - v) for v in row] for row in x.tolist()], dtype=x.dtype)
    return s / s.sum(-1, keepdim=True)


def f_adaptive(x):
    out = []
    for row in x:
        p = f_softmax(row)
        h = float(-(p * torch.log(p)).sum())
        poly = -0.037 * h**4 + 0.481 * h**3 - 2.3 * h**2 + 4.917 * h - 1.791
        beta = max(poly, 1.0) if h > 0.5 else 1.0
        out.append(f_softmax(row * beta))
    return torch.stack(out)


def f_temperature(x, T=1.0):
    return f_softmax(x / T)


FORMULAS = {
    "sparsemax": (lambda x: ent_sparsemax(x, dim=-1), {}),
    "entmax15": (lambda x: ent_entmax15(x, dim=-1), {}),
    "entmax_bisect": (lambda x: ent_bisect(x, alpha=1.3, dim=-1, n_iter=100), {"alpha": 1.3}),
    "softpick": (lambda x: f_softpick(x, 1e-3), {"eps": 1e-3}),
    "ssmax": (lambda x: f_ssmax(x, 0.7), {"s": 0.7}),
    "multimax": (lambda x: f_multimax(x, [-0.5, 0.3, -1.0, 1.2], [0.2, 0.4, 0.1, 0.3]),
                 {"r0": -0.5, "r1": 0.3, "r2": -1.0, "r3": 1.2, "t0": 0.2, "t1": 0.4, "t2": 0.1, "t3": 0.3}),
    "sa_softmax": (f_sa, {}),
    "softmax1": (f_softmax1, {}),
    "sigmoid": (f_sigmoid, {}),
    "relu": (f_relu, {}),
    "softplus": (f_softplus, {}),
    "stablemax": (f_stablemax, {}),
    "adaptive_temperature": (f_adaptive, {}),
    "temperature": (lambda x: f_temperature(x, 0.6), {"T": 0.6}),
}


@pytest.mark.parametrize("name", ALL)
def test_against_formula(name):
    x = _x(4, 9, seed=1)
    ref, params = FORMULAS[name]
    torch.testing.assert_close(V.get(name).apply(x, **params), ref(x), rtol=1e-9, atol=1e-12)


def test_defaults_against_formula():
    x = _x(3, 6, seed=2)
    torch.testing.assert_close(V.get("softpick").apply(x), f_softpick(x))
    torch.testing.assert_close(V.get("ssmax").apply(x), f_ssmax(x))
    torch.testing.assert_close(V.get("sigmoid").apply(x, b=0.25), f_sigmoid(x, 0.25))
    torch.testing.assert_close(V.get("relu").apply(x, c=0.5), f_relu(x, 0.5))
    torch.testing.assert_close(V.get("softplus").apply(x, c=2.0), f_softplus(x, 2.0))
    torch.testing.assert_close(V.get("entmax_bisect").apply(x), ent_bisect(x, alpha=1.5, n_iter=100))
    torch.testing.assert_close(V.get("temperature").apply(x), f_softmax(x))


def test_adaptive_temperature_both_regimes():
    flat = _x(2, 16, seed=3, scale=0.3)  # high entropy: beta > 1
    peaked = torch.tensor([[9.0, 0.0, 0.1, -0.2], [0.0, 8.0, 0.5, 0.0]], dtype=torch.float64)  # H < 0.5
    for x in (flat, peaked):
        torch.testing.assert_close(V.get("adaptive_temperature").apply(x), f_adaptive(x))
    torch.testing.assert_close(V.get("adaptive_temperature").apply(peaked), f_softmax(peaked))
    assert not torch.allclose(V.get("adaptive_temperature").apply(flat), f_softmax(flat))


@pytest.mark.parametrize("alpha", [1.1, 1.5, 2.0, 2.5])
def test_entmax_bisect_oracle(alpha):
    x = _x(5, 11, seed=4)
    torch.testing.assert_close(V.get("entmax_bisect").apply(x, alpha=alpha),
                               ent_bisect(x, alpha=alpha, n_iter=100), rtol=1e-9, atol=1e-12)
    if alpha == 2.0:
        torch.testing.assert_close(V.get("entmax_bisect").apply(x, alpha=2.0), ent_sparsemax(x))


def test_other_dim():
    x = _x(4, 6, 3, seed=5)
    for name in ALL:
        v = V.get(name)
        torch.testing.assert_close(v.apply(x, dim=1), v.apply(x.transpose(1, 2)).transpose(1, 2))


# ---------------- gradients ----------------

GRAD_PARAMS = {
    "entmax_bisect": {"alpha": 1.4},
    "softpick": {"eps": 1e-2},
    "ssmax": {"s": 0.8},
    "multimax": {"r0": -0.5, "r1": 0.3, "r2": -1.0, "r3": 1.2, "t0": 0.2, "t1": 0.4, "t2": 0.1, "t3": 0.3},
    "sigmoid": {"b": -1.0},
    "relu": {"c": 0.3},
    "softplus": {"c": 1.5},
    "temperature": {"T": 0.7},
}


@pytest.mark.parametrize("name", ALL)
def test_gradcheck(name):
    v = V.get(name)
    x = _x(3, 6, seed=6).requires_grad_()
    pnames = list(GRAD_PARAMS.get(name, {}))
    # per-row parameters, slightly different per row, all with gradients
    ps = [torch.full((3, 1), GRAD_PARAMS[name][k], dtype=torch.float64).add_(
        torch.tensor([[0.0], [0.01], [0.02]], dtype=torch.float64)).requires_grad_() for k in pnames]
    mask = torch.tensor([[True] * 6, [True, False, True, True, False, True], [True] * 5 + [False]])

    def f(x, *ps):
        return v.apply(x, mask=mask, **dict(zip(pnames, ps)))

    assert torch.autograd.gradcheck(f, (x, *ps), eps=1e-6, atol=1e-5, rtol=1e-4)


def test_gradcheck_adaptive_high_entropy():
    x = _x(2, 8, seed=7, scale=0.3).requires_grad_()
    assert torch.autograd.gradcheck(lambda x: V.get("adaptive_temperature").apply(x), (x,))


def test_entmax_bisect_grad_matches_oracle():
    x = _x(4, 8, seed=8).requires_grad_()
    g = _x(4, 8, seed=9)
    (V.get("entmax_bisect").apply(x, alpha=1.5) * g).sum().backward()
    x2 = x.detach().clone().requires_grad_()
    (ent_bisect(x2, alpha=1.5, n_iter=100) * g).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-7, atol=1e-9)


# ---------------- masks ----------------

@pytest.mark.parametrize("name", ALL)
def test_mask_equals_removal(name):
    v = V.get(name)
    x = _x(4, 8, seed=10)
    g = torch.Generator().manual_seed(11)
    mask = torch.rand(4, 8, generator=g) > 0.35
    mask[:, 0] = True
    x_garbage = x.clone()
    x_garbage[~mask] = float("nan")  # masked values are never read
    params = GRAD_PARAMS.get(name, {})
    w = v.apply(x_garbage, mask=mask, **params)
    assert (w[~mask] == 0).all()
    for r in range(4):
        torch.testing.assert_close(w[r][mask[r]], v.apply(x[r][mask[r]], **params), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("name", ALL)
def test_fully_masked_row(name):
    v = V.get(name)
    x = _x(3, 5, seed=12).requires_grad_()
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[1] = False
    w = v.apply(x, mask=mask, **GRAD_PARAMS.get(name, {}))
    assert torch.isfinite(w).all()
    assert (w[1] == 0).all()
    w.sum().backward()
    assert torch.isfinite(x.grad).all() and (x.grad[1] == 0).all()
    # a broadcast mask (one per column) works too
    assert (v.apply(x.detach(), mask=torch.zeros(5, dtype=torch.bool)) == 0).all()


def test_nan_propagates():
    x = torch.tensor([[0.0, float("nan"), 1.0], [0.0, 1.0, 2.0]])
    for name in ("ssmax", "temperature", "stablemax", "softmax1"):
        w = V.get(name).apply(x)
        assert torch.isnan(w[0]).any() and torch.isfinite(w[1]).all()


# ---------------- half precision ----------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ALL)
def test_half(name, dtype):
    v = V.get(name)
    x = _x(3, 10, seed=13, dtype=dtype)
    mask = torch.ones(3, 10, dtype=torch.bool)
    mask[2, 3:] = False
    params = GRAD_PARAMS.get(name, {})
    w = v.apply(x, mask=mask, **params)
    assert w.dtype == dtype and w.shape == x.shape
    ref = v.apply(x.float(), mask=mask, **params)
    torch.testing.assert_close(w.float(), ref, rtol=1e-2, atol=1e-2)
    assert torch.isfinite(w).all()


def test_half_very_negative_entmax():
    x = torch.tensor([[-60000.0, 0.0, 1.0, -60000.0]], dtype=torch.float16)
    for name in ("sparsemax", "entmax15", "entmax_bisect"):
        w = V.get(name).apply(x)
        assert torch.isfinite(w).all() and abs(float(w.float().sum()) - 1) < 1e-2


# ---------------- pretrained starts ----------------

def test_entmax_bisect_alpha_one_is_softmax():
    x = _x(3, 7, seed=14)
    torch.testing.assert_close(V.get("entmax_bisect").apply(x, alpha=1.0), torch.softmax(x, -1))
    alpha = torch.tensor([[1.0], [1.5], [1.0]], dtype=torch.float64)
    w = V.get("entmax_bisect").apply(x, alpha=alpha)
    torch.testing.assert_close(w[[0, 2]], torch.softmax(x[[0, 2]], -1))
    torch.testing.assert_close(w[1], ent_bisect(x[1], alpha=1.5, n_iter=100))
    with pytest.raises(ValueError):
        V.get("entmax_bisect").apply(x, alpha=0.5)


def test_inits_start_at_softmax():
    x = _x(2, 12, seed=15)
    sm = torch.softmax(x, -1)
    torch.testing.assert_close(V.get("temperature").apply(x, T=1.0), sm)
    torch.testing.assert_close(V.get("temperature").apply(x, **V.get("temperature").init_params()), sm)
    mm = V.get("multimax").init_params(shape=(2, 1))
    assert set(mm) == {"r0", "r1", "r2", "r3", "t0", "t1", "t2", "t3"}
    torch.testing.assert_close(V.get("multimax").apply(x, **mm), sm)
    torch.testing.assert_close(V.get("ssmax").apply(x, s=1 / math.log(12)), sm)
    s = V.get("ssmax").init_params(n_train=12)["s"]
    torch.testing.assert_close(V.get("ssmax").apply(x, s=s), sm)


def test_init_params_values_and_errors():
    assert V.get("sigmoid").init_params(64)["b"].item() == pytest.approx(-math.log(64))
    assert V.get("relu").init_params(64)["c"].item() == pytest.approx(1 / 64)
    assert V.get("softplus").init_params(64)["c"].item() == pytest.approx(math.log(64))
    assert V.get("entmax_bisect").init_params()["alpha"].item() == 1.5
    t = V.get("ssmax").init_params(128, shape=(4, 1, 1))["s"]
    assert t.shape == (4, 1, 1) and t.dtype == torch.float32
    assert torch.nn.Parameter(t).requires_grad
    for name in ("sparsemax", "entmax15", "softpick", "sa_softmax", "softmax1", "stablemax",
                 "adaptive_temperature"):
        assert V.get(name).init_params(10) == {}
    for name in ("ssmax", "sigmoid", "relu", "softplus"):
        with pytest.raises(ValueError):
            V.get(name).init_params()
    # every variant documents its params
    for name in ALL:
        v = V.get(name)
        assert v.formula and v.paper
        assert set(v.init_params(16)) == {k for k, p in v.params.items() if p.learnable}


def test_param_errors():
    x = _x(2, 5)
    with pytest.raises(TypeError):
        V.get("temperature").apply(x, tau=2.0)
    with pytest.raises(ValueError):
        V.get("temperature").apply(x, T=torch.ones(2, 5))  # not per row
    with pytest.raises(TypeError):
        V.get("softmax1").apply(x, mask=torch.ones(2, 5))
    with pytest.raises(TypeError):
        V.get("softmax1").apply(x.long())


# ---------------- registry ----------------

def test_names_order():
    assert V.names()[: len(ALL)] == ALL


def test_get_unknown():
    with pytest.raises(KeyError) as e:
        V.get("softmaxx")
    assert isinstance(e.value, V.UnknownVariantError)
    assert "sparsemax" in str(e.value) and "temperature" in str(e.value)


def test_register_user_variant():
    def cube(x, keep, n, k=None):
        k = 1.0 if k is None else k
        e = torch.where(keep, x.abs() ** 3 * k, 0.0) if keep is not None else x.abs() ** 3 * k
        return e / e.sum(-1, keepdim=True).clamp(min=1e-30)

    v = V.Variant("cube", "|x|^3 / sum |x|^3", "test", {"k": V.ParamSpec("scale", "1")}, cube,
                  lambda n: {"k": 1.0})
    try:
        assert V.register(v) is v
        assert V.get("cube") is v and V.names()[-1] == "cube"
        x = _x(2, 4, dtype=torch.bfloat16)
        w = V.get("cube").apply(x, mask=torch.tensor([True, True, False, True]))
        assert w.dtype == torch.bfloat16 and (w[:, 2] == 0).all()
        with pytest.raises(ValueError):
            V.register(v)
        v2 = V.Variant("cube", "x", "test2", {}, lambda x, keep, n: torch.softmax(x, -1))
        V.register(v2, overwrite=True)
        assert V.get("cube").paper == "test2"
        with pytest.raises(TypeError):
            V.register("cube")
    finally:
        V.unregister("cube")
    assert "cube" not in V.names()
    with pytest.raises(KeyError):
        V.unregister("cube")


def test_overwrite_builtin_keeps_position():
    orig = V.get("temperature")
    try:
        V.register(V.Variant("temperature", "x", "y", {}, lambda x, keep, n: x), overwrite=True)
        assert V.names()[: len(ALL)] == ALL and V.get("temperature").paper == "y"
    finally:
        V.register(orig, overwrite=True)
    assert V.get("temperature") is orig


@pytest.mark.parametrize("T", [0, -1.0, float("inf"), float("nan")])
def test_temperature_must_be_positive(T):
    with pytest.raises(ValueError, match="must be a finite number > 0"):
        V.get("temperature").apply(torch.randn(2, 5), T=T)


# ---------------- sparse maps: the gradient's support is {p > 0} ----------------

def _gold_sparse_grad(p, g, alpha):
    """fp64 vector-Jacobian product of alpha-entmax (Peters, Niculae & Martins 2019, sec. 3.3) on the
    support p > 0: s = p^(2 - alpha) there (sparsemax: the indicator), dx = s g - s (sum s g) / sum s."""
    s = torch.where(p > 0, p.clamp(min=0) ** (2 - alpha), 0.0)
    return s * g - s * (s * g).sum(-1, keepdim=True) / s.sum(-1, keepdim=True)


def test_sparsemax_tie_gradient():
    # tau = 2.25 exactly: the last entry sits at the threshold, p = 0 there, and sum(p) = 1 identically
    x = torch.tensor([[3.0, 2.5, 2.25]], requires_grad=True)
    p = V.get("sparsemax").apply(x, -1)
    assert p.tolist() == [[0.75, 0.25, 0.0]]
    p.sum().backward()
    assert (x.grad == 0).all()
    x.grad = None
    g = torch.tensor([[1.0, 2.0, 4.0]])
    (V.get("sparsemax").apply(x, -1) * g).sum().backward()
    assert x.grad.tolist() == [[-0.5, 0.5, 0.0]]
    # 1.5-entmax: x/2 = [0, 0, 0, 0, -1/2, -3/2] has tau = -1/2 exactly, the fifth entry at it
    x = torch.tensor([[0.0, 0.0, 0.0, 0.0, -1.0, -3.0]], dtype=torch.float64, requires_grad=True)
    g = torch.arange(6, dtype=torch.float64).unsqueeze(0)
    p = V.get("entmax15").apply(x)
    assert p.tolist() == [[0.25] * 4 + [0.0, 0.0]]
    (p * g).sum().backward()
    torch.testing.assert_close(x.grad, _gold_sparse_grad(p.detach(), g, 1.5), rtol=0, atol=1e-15)


@pytest.mark.parametrize("name,alpha", [("sparsemax", 2.0), ("entmax15", 1.5), ("entmax_bisect", 1.5)])
def test_sparse_grad_bf16_ties(name, alpha):
    """bf16 scores on a grid of 1/4 put entries exactly at tau; the gradient matches the fp64 gold on
    p > 0: |ours - gold| <= |gold in bf16 - gold| + one bf16 ulp."""
    g = torch.Generator().manual_seed(30)
    x = (torch.randint(-10, 10, (256, 8), generator=g) / 4.0).to(torch.bfloat16).requires_grad_()
    dw = torch.randn(256, 8, generator=g, dtype=torch.float64).to(torch.bfloat16)
    params = {"alpha": alpha} if name == "entmax_bisect" else {}
    (V.get(name).apply(x, **params) * dw).sum().backward()
    x64 = x.detach().double()
    p64 = {"sparsemax": ent_sparsemax, "entmax15": ent_entmax15}.get(
        name, lambda t, dim: ent_bisect(t, alpha=alpha, dim=dim, n_iter=100))(x64, dim=-1)
    if name == "sparsemax":
        tau = (x64 - p64).amax(-1, keepdim=True)  # x - p = tau on the support
        assert ((p64 == 0) & (x64 == tau)).sum() > 10  # ties are present
    gold = _gold_sparse_grad(p64, dw.double(), alpha)
    err = (x.grad.double() - gold).abs()
    bound = (gold.to(torch.bfloat16).double() - gold).abs() + torch.finfo(torch.bfloat16).eps * gold.abs() + 1e-6
    assert (err <= bound).all(), f"max excess {(err - bound).max().item():.3g}"


@pytest.mark.parametrize("name", ["sparsemax", "entmax15", "entmax_bisect"])
def test_sparse_gradcheck_no_mask(name):
    x = _x(4, 7, seed=31).requires_grad_()
    assert torch.autograd.gradcheck(lambda x: V.get(name).apply(x), (x,), eps=1e-6, atol=1e-5, rtol=1e-4)


# ---------------- -inf entries: masked, with or without a mask ----------------

def _with_neg_inf(dtype=torch.float64):
    x = _x(4, 7, seed=32, dtype=dtype)
    x[0, 3] = x[1, 0] = x[1, 6] = x[2, 2] = float("-inf")  # row 3 has none
    return x


@pytest.mark.parametrize("use_mask", [False, True])
@pytest.mark.parametrize("name", ALL)
def test_neg_inf_entries(name, use_mask):
    v = V.get(name)
    params = GRAD_PARAMS.get(name, {})
    x = _with_neg_inf().requires_grad_()
    fin = torch.isfinite(x.detach())
    mask = torch.ones(4, 7, dtype=torch.bool)
    mask[:, 5] = False
    keep = fin & mask if use_mask else fin
    gw = _x(4, 7, seed=33)
    w = v.apply(x, mask=mask if use_mask else None, **params)
    (w * gw).sum().backward()
    assert (w[~fin] == 0).all() and torch.isfinite(w).all()
    assert torch.isfinite(x.grad).all() and (x.grad[~fin] == 0).all()
    # the same as the row with those entries removed, forward and backward
    for r in range(4):
        xr = x.detach()[r][keep[r]].clone().requires_grad_()
        wr = v.apply(xr, **params)
        (wr * gw[r][keep[r]]).sum().backward()
        torch.testing.assert_close(w[r][keep[r]], wr, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(x.grad[r][keep[r]], xr.grad, rtol=1e-9, atol=1e-12)
    # and as masking them
    torch.testing.assert_close(w, v.apply(x.detach(), mask=keep, **params), rtol=0, atol=0)


def test_neg_inf_examples():
    x = torch.tensor([[0.5, -1.0, 2.0, float("-inf"), 1.0]])
    for name in ("sa_softmax", "multimax"):
        w = V.get(name).apply(x)
        assert torch.isfinite(w).all() and (w >= 0).all() and w[0, 3] == 0
        torch.testing.assert_close(w[:, [0, 1, 2, 4]], V.get(name).apply(x[:, [0, 1, 2, 4]]))


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("name", ALL)
def test_all_neg_inf_row(name, dtype):
    """A row entirely -inf gives zeros and zero gradients (torch.softmax would give NaN)."""
    x = _with_neg_inf(dtype)
    x[3] = float("-inf")
    x.requires_grad_()
    for mask in (None, torch.tensor([True] * 6 + [False])):
        w = V.get(name).apply(x, mask=mask, **GRAD_PARAMS.get(name, {}))
        assert (w[3] == 0).all() and torch.isfinite(w).all()
        x.grad = None
        w.float().sum().backward()
        assert (x.grad[3] == 0).all() and torch.isfinite(x.grad).all()


# ---------------- entmax_bisect: alpha's gradient at 1 ----------------

def _tsallis_entmax(x, alpha, n_iter=200):
    """fp64 alpha-entmax for alpha near 1 on either side (alpha < 1 too, where it is dense), written as
    p_i = (1 + e (x_i - c))^(1/e), e = alpha - 1, with c found by bisection so the row sums to 1."""
    e = alpha - 1.0
    lse = torch.logsumexp(x, -1, keepdim=True)
    lo, hi = lse - 1.0, lse + 1.0  # sum p is decreasing in c; at e = 0, c = logsumexp(x)
    for _ in range(n_iter):
        c = (lo + hi) / 2
        big = ((1 + e * (x - c)).clamp(min=0) ** (1 / e)).sum(-1, keepdim=True) > 1
        lo, hi = torch.where(big, c, lo), torch.where(big, hi, c)
    return (1 + e * (x - (lo + hi) / 2)).clamp(min=0) ** (1 / e)


@pytest.mark.parametrize("shape", [(3, 1), ()])
def test_entmax_bisect_alpha_grad_at_one(shape):
    x, g = _x(3, 9, seed=34), _x(3, 9, seed=35)
    mask = torch.ones(3, 9, dtype=torch.bool)
    mask[1, 4:] = False
    alpha = torch.ones(shape, dtype=torch.float64, requires_grad=True)
    w = V.get("entmax_bisect").apply(x, mask=mask, alpha=alpha)
    torch.testing.assert_close(w, torch.softmax(x.masked_fill(~mask, float("-inf")), -1))
    (w * g).sum().backward()
    h = 1e-3
    xs = [x[r][mask[r]] for r in range(3)]
    fd = torch.stack([((_tsallis_entmax(xr, 1 + h) - _tsallis_entmax(xr, 1 - h)) * g[r][mask[r]]).sum() / (2 * h)
                      for r, xr in enumerate(xs)])
    # the local oracle agrees with ours at 1 + h
    for r, xr in enumerate(xs):
        torch.testing.assert_close(_tsallis_entmax(xr, 1 + h), V.get("entmax_bisect").apply(xr, alpha=1 + h))
    fd = fd.sum().reshape(()) if shape == () else fd.reshape(3, 1)
    assert (alpha.grad.abs() > 1e-3).all()
    torch.testing.assert_close(alpha.grad, fd, rtol=1e-5, atol=1e-7)


def test_entmax_bisect_alpha_grad_rows_mixed():
    """Rows at alpha = 1 and rows above it in one call: each row's gradient is its own."""
    x, g = _x(3, 6, seed=36), _x(3, 6, seed=37)
    alpha = torch.tensor([[1.0], [1.5], [1.0]], dtype=torch.float64, requires_grad=True)
    (V.get("entmax_bisect").apply(x, alpha=alpha) * g).sum().backward()
    for r in range(3):
        a = alpha.detach()[r].clone().requires_grad_()
        (V.get("entmax_bisect").apply(x[r], alpha=a) * g[r]).sum().backward()
        torch.testing.assert_close(alpha.grad[r], a.grad, rtol=1e-9, atol=1e-12)
    # one-sided second-order difference with our own alpha >= 1
    f = lambda a: float((V.get("entmax_bisect").apply(x[0], alpha=a) * g[0]).sum())
    h = 1e-3
    assert alpha.grad[0, 0].item() == pytest.approx((-3 * f(1.0) + 4 * f(1 + h) - f(1 + 2 * h)) / (2 * h), rel=1e-4)


@pytest.mark.parametrize("e", [1e-6, 1e-4, 1e-2])
def test_entmax_bisect_fp32_near_one(e):
    """A learnable alpha leaves 1 by small steps: just above 1, fp32 stays accurate (value and alpha's
    gradient) against the fp64 oracle and its central difference."""
    x, g = _x(3, 9, seed=38), _x(3, 9, seed=39)
    alpha = torch.full((3, 1), 1 + e, dtype=torch.float32, requires_grad=True)
    a = float(alpha.detach()[0, 0])  # the fp32 value
    w = V.get("entmax_bisect").apply(x.float(), alpha=alpha)
    (w * g.float()).sum().backward()
    torch.testing.assert_close(w.double(), _tsallis_entmax(x, a), rtol=0, atol=1e-6)
    h = 1e-3
    fd = ((_tsallis_entmax(x, a + h) - _tsallis_entmax(x, a - h)) * g).sum(-1, keepdim=True) / (2 * h)
    torch.testing.assert_close(alpha.grad.double(), fd, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", V.names())
@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_nan_or_pos_inf_makes_the_row_nan(name, value):
    """A kept NaN or +inf: the row is NaN, as softmax gives (not a silently renormalized row); other rows and a
    masked-out NaN are untouched."""
    x = torch.tensor([[1.0, value, 0.0, -0.5], [0.3, -1.0, 2.0, 0.1]])
    want_ok = V.get(name).apply(x[1:], -1)
    got = V.get(name).apply(x, -1)
    assert bool(got[0].isnan().all()) and torch.equal(got[1:], want_ok)
    keep = torch.tensor([[True, False, True, True], [True, True, True, True]])
    masked = V.get(name).apply(x, -1, mask=keep)
    assert not bool(masked.isnan().any())
    torch.testing.assert_close(masked[0], V.get(name).apply(x[:1, [0, 2, 3]], -1)[0].new_zeros(4).index_put_(
        (torch.tensor([0, 2, 3]),), V.get(name).apply(x[:1, [0, 2, 3]], -1)[0]))
