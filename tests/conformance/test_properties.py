"""Property tests (hypothesis) per public op: random shapes, strides, dims and dtypes, with the inputs that break
fused kernels — -inf / ``finfo.min`` / NaN entries, rows masked whole, empty dims, every target ignored — each
against torch on the same inputs with the gold rule of :mod:`gold` (or bit-exact where the op promises it).

Example counts are small (the suite runs in CI on 2 cores); hypothesis keeps the failing examples it finds in
its database, and ``derandomize`` makes a run reproducible.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import smxcompile
from gold import TOL, assert_gold

SETTINGS = settings(max_examples=40, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
DTYPES = st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.float16])


@st.composite
def logits(draw, min_dims=1, max_dims=4, specials=True):
    """A float tensor of a random shape and dtype, maybe non-contiguous (transposed or strided), with some
    entries -inf / finfo.min / NaN / +inf and maybe a row of -inf along the last dim."""
    dtype = draw(DTYPES)
    shape = draw(st.lists(st.integers(0, 7), min_size=min_dims, max_size=max_dims))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    layout = draw(st.sampled_from(["contiguous", "transposed", "strided"]))
    if layout == "strided" and shape:
        base = torch.randn(*shape[:-1], 2 * shape[-1], generator=g) * 3
        x = base[..., ::2]
    elif layout == "transposed" and len(shape) >= 2:
        x = (torch.randn(*shape[:-2], shape[-1], shape[-2], generator=g) * 3).transpose(-1, -2)
    else:
        x = torch.randn(*shape, generator=g) * 3
    x = x.to(dtype)
    if specials and x.numel():
        for value in draw(st.lists(st.sampled_from(["-inf", "min", "nan", "inf"]), max_size=3)):
            i = int(torch.randint(0, x.numel(), (1,), generator=g))
            v = torch.finfo(dtype).min if value == "min" else float(value)
            idx = torch.unravel_index(torch.tensor(i), x.shape)
            x[tuple(int(t) for t in idx)] = v
        if x.dim() >= 2 and draw(st.booleans()):
            x[(0,) * (x.dim() - 1)] = float("-inf")          # a row masked whole
    return x


def _dim(draw_dim, x):
    return draw_dim if x.dim() else 0


def _check_fwd_bwd(ours_fn, torch_fn, x, what):
    """Forward, and backward where the input has elements and torch's output is finite."""
    xs = [x.detach().clone().requires_grad_() for _ in range(2)] + [x.detach().double().requires_grad_()]
    outs = [ours_fn(xs[0]), torch_fn(xs[1]), torch_fn(xs[2])]
    tol = TOL[x.dtype]
    assert outs[0].dtype == outs[1].dtype, what
    assert_gold(outs[0], outs[1], outs[2], tol, what)
    if x.numel() == 0:
        return
    w = torch.randn(outs[1].shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    w = w.masked_fill(~torch.isfinite(outs[1]), 0)                 # no loss on torch's NaN / inf outputs
    grads = [torch.autograd.grad((o.double().nan_to_num(0, 0, 0) * w).sum(), xi)[0] for o, xi in zip(outs, xs)]
    assert_gold(grads[0], grads[1], grads[2], tol, what + " grad")


@SETTINGS
@given(x=logits(), dim=st.integers(-4, 3), kind=st.sampled_from(["softmax", "log_softmax"]))
def test_softmax_matches_torch(x, dim, kind):
    if x.dim() and not -x.dim() <= dim < x.dim():
        dim = -1
    dim = _dim(dim, x)
    ours, ref = getattr(smxcompile, kind), getattr(torch, kind)
    _check_fwd_bwd(lambda t: ours(t, dim), lambda t: ref(t, dim), x, f"{kind} {tuple(x.shape)} {x.dtype} dim={dim}")


@SETTINGS
@given(x=logits(min_dims=1, max_dims=3), k_frac=st.floats(0, 1), renormalize=st.booleans())
def test_softmax_topk_invariants(x, k_frac, renormalize):
    """FlashInfer's sampling tests' top-k invariants: the k values are softmax's k largest, sorted, their
    indices in range and pointing at them; renormalized, each row sums to 1 (torch's NaN rows aside)."""
    x = x.nan_to_num(nan=0.0)                     # topk's order of NaN is torch-specific: covered elsewhere
    n = x.shape[-1]
    k = int(round(k_frac * n))
    got = smxcompile.softmax_topk(x, k, renormalize=renormalize)
    p = torch.softmax(x.double(), -1)
    want = p.topk(k, -1)
    assert got.values.shape == want.values.shape and got.indices.dtype == torch.int64
    if k == 0 or x.numel() == 0:
        return
    assert bool(((got.indices >= 0) & (got.indices < n)).all())
    gv = got.values.double()
    finite = torch.isfinite(gv).all(-1)
    assert bool((gv[finite][..., :-1] >= gv[finite][..., 1:]).all())              # largest first
    at = p.gather(-1, got.indices)                                                 # the values are theirs
    ref = at / at.sum(-1, keepdim=True) if renormalize else at
    tol = TOL[x.dtype] * 10 + (1e-2 if x.dtype in (torch.float16, torch.bfloat16) else 1e-6)
    assert bool(((gv - ref).abs()[finite] <= tol).all())
    # the chosen probabilities are the k largest (ties may pick either index)
    assert bool(((at.sort(-1, descending=True).values - want.values).abs()[finite] <= 1e-6 + tol).all())
    if renormalize:
        assert bool(((gv.sum(-1) - 1).abs()[finite] <= 1e-2).all())


@st.composite
def ce_case(draw):
    dtype = draw(DTYPES)
    n = draw(st.integers(0, 9))
    v = draw(st.integers(1, 7))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    x = (torch.randn(n, v, generator=g) * 3).to(dtype)
    t = torch.randint(0, v, (n,), generator=g)
    ignore_index = draw(st.sampled_from([-100, 0, v - 1]))
    mode = draw(st.sampled_from(["some", "none ignored", "all ignored"]))
    if mode == "all ignored":
        t.fill_(ignore_index if ignore_index >= 0 else -100)
        ignore_index = int(t[0]) if n else ignore_index
    elif mode == "some" and n:
        t[torch.rand(n, generator=g) < 0.3] = -100 if ignore_index == -100 else ignore_index
    if n and draw(st.booleans()):
        x[0, 0] = float("-inf") if draw(st.booleans()) else torch.finfo(dtype).min
    kw = dict(ignore_index=ignore_index, reduction=draw(st.sampled_from(["mean", "sum", "none"])),
              label_smoothing=draw(st.sampled_from([0.0, 0.1])))
    weight = (torch.rand(v, generator=g) + 0.5).to(dtype) if draw(st.booleans()) else None
    return x, t, weight, kw


@SETTINGS
@given(case=ce_case())
def test_cross_entropy_matches_torch(case):
    """Every reduction, ignore_index (also every target ignored: mean is NaN, as torch's), class weights,
    label smoothing, -inf / finfo.min logits."""
    x, t, weight, kw = case
    _check_fwd_bwd(lambda z: smxcompile.cross_entropy(z, t, weight, **kw),
                   lambda z: F.cross_entropy(z, t, None if weight is None else weight.to(z.dtype), **kw),
                   x, f"cross_entropy {tuple(x.shape)} {x.dtype} {kw} weight={weight is not None}")


@st.composite
def attention_case(draw):
    dtype = draw(st.sampled_from([torch.float32, torch.float64, torch.bfloat16]))
    b, h, length, s, e = (draw(st.integers(1, 3)), draw(st.integers(1, 2)), draw(st.integers(1, 6)),
                          draw(st.integers(1, 6)), draw(st.integers(1, 8)))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    q, k, v = (torch.randn(b, h, n, e, generator=g).to(dtype) for n in (length, s, s))
    kind = draw(st.sampled_from(["none", "bool", "float -inf", "float min", "causal"]))
    mask, causal = None, kind == "causal"
    if kind != "none" and not causal:
        keep = torch.rand(b, 1, length, s, generator=g) > 0.4
        if draw(st.booleans()):
            keep[0, 0, 0] = False                                      # a query row with no key
        if kind == "bool":
            mask = keep
        else:
            fill = float("-inf") if kind == "float -inf" else torch.finfo(dtype).min
            mask = torch.zeros(keep.shape, dtype=dtype).masked_fill(~keep, fill)
    return q, k, v, mask, causal


@SETTINGS
@given(case=attention_case())
def test_attention_matches_sdpa(case):
    """``smxcompile.attention`` against ``F.scaled_dot_product_attention`` with the same mask and causal flag."""
    q, k, v, mask, causal = case

    def ours(qq):
        kk, vv, mm = _like(qq, k, v, mask)
        return smxcompile.attention(qq, kk, vv, attn_mask=mm, is_causal=causal)

    def ref(qq):
        kk, vv, mm = _like(qq, k, v, mask)
        return F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mm, is_causal=causal)

    _check_fwd_bwd(ours, ref, q, f"attention {tuple(q.shape)} {tuple(k.shape)} {q.dtype} "
                   f"mask={None if mask is None else mask.dtype} causal={causal}")


def _like(q, k, v, mask):
    """k, v (and a float mask) in q's dtype: the fp64 gold runs on the same values."""
    if mask is not None and mask.is_floating_point():
        mask = mask.to(q.dtype)
    return k.to(q.dtype), v.to(q.dtype), mask
