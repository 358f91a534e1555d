"""Numerics of ``smx::softmax`` / ``smx::log_softmax`` and of the compiled rewrite.

Accuracy criterion (forward and backward): against an fp64 gold, our error may not exceed torch's
own error (torch run in the input dtype) by more than a few ulps of the output dtype,
elementwise: ``|ours - gold| <= |torch - gold| + tol``. NaN (and inf) positions must equal
torch's. Backward uses a random upstream gradient.

The first part calls the ops (through the public ``smxcompile.softmax`` / ``log_softmax``) on
CPU tensors: the CPU path. The second part compiles functions with ``backend="smx"`` (CPU policy
``rewrite``, so every site is rewritten) and checks the rewrite fired and matches eager.
"""

from __future__ import annotations


import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import smxcompile
import smxcompile.backends.smx  # noqa: F401  (compiled_reports; the backend is imported lazily)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
KINDS = ["softmax", "log_softmax"]
REWRITE = {"cpu": "rewrite", "cuda": "rewrite"}


# --------------------------------------------------------------------------- helpers


def eps(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps


def ours_fn(kind):
    return smxcompile.softmax if kind == "softmax" else smxcompile.log_softmax


def torch_fn(kind):
    return torch.softmax if kind == "softmax" else torch.log_softmax


def prologue(x, scale=1.0, softcap=None, mask=None):
    """The op's prologue written in plain torch, in ``x``'s dtype (torch's way, and fp64 for the gold)."""
    z = x * scale if scale != 1.0 else x
    if softcap is not None:
        z = torch.tanh(z / softcap) * softcap
    if mask is not None:
        z = z + mask.to(z.dtype)
    return z


def _row_max(t: torch.Tensor, dim: int) -> torch.Tensor:
    if t.numel() == 0:
        return t
    a = t.abs().nan_to_num(0.0, 0.0, 0.0)
    return a.amax(dim=dim, keepdim=True).expand_as(t)


def coarsest(*dtypes: torch.dtype) -> torch.dtype:
    """The dtype with the largest eps: the precision a result computed through all of them has."""
    return max(dtypes, key=lambda d: torch.finfo(d).eps)


def assert_gold_bound(ours, ref, gold, dim, *, ulps=2.0, row_ulps=0.0, scale=None, scale_ulps=4.0,
                      precision: torch.dtype | None = None, what=""):
    """``|ours - gold| <= |ref - gold| + tol`` elementwise; NaN/inf positions as in ``ref``.

    ``tol = eps * (ulps * |gold| + row_ulps * max_row|gold| + scale_ulps * scale) + subnormal step``, with ``eps``
    of ``precision`` (default: ``ours.dtype``). ``scale`` is the magnitude of the terms the value is
    computed from (see :func:`fwd_scale`, :func:`grad_scale`): a cancellation may cost as many
    ulps of those terms as the rounding of its operands does, in our code as in torch's.
    """
    assert ours.shape == ref.shape == gold.shape, (what, ours.shape, ref.shape, gold.shape)
    assert ours.dtype == ref.dtype, (what, ours.dtype, ref.dtype)
    assert torch.equal(ours.isnan(), ref.isnan()), f"{what}: NaN positions differ"
    assert torch.equal(ours.isposinf(), ref.isposinf()) and torch.equal(ours.isneginf(), ref.isneginf()), (
        f"{what}: inf positions differ"
    )
    fin = ours.isfinite() & ref.isfinite() & gold.isfinite()
    o, r, g = ours.double()[fin], ref.double()[fin], gold.double()[fin]
    e = eps(precision or ours.dtype)
    tol = ulps * g.abs() + row_ulps * _row_max(gold.double(), dim)[fin]
    if scale is not None:
        tol = tol + scale_ulps * scale.double().nan_to_num(0.0, 0.0, 0.0)[fin]
    # plus one step of the dtype's subnormal grid: below smallest_normal the spacing stops shrinking
    dt = precision or ours.dtype
    tol = e * tol + torch.finfo(dt).smallest_normal * torch.finfo(dt).eps
    err_ours, err_ref = (o - g).abs(), (r - g).abs()
    bad = err_ours > err_ref + tol
    if bad.any():
        i = bad.nonzero()[0].item()
        raise AssertionError(
            f"{what}: {int(bad.sum())} element(s) worse than torch: ours={o[i].item()!r} torch={r[i].item()!r} "
            f"gold={g[i].item()!r} (|ours-gold|={err_ours[i].item():.3g} > |torch-gold|={err_ref[i].item():.3g} "
            f"+ tol={tol[i].item():.3g})"
        )


def _finite_abs(t):
    return t.double().abs().nan_to_num(0.0, 0.0, 0.0)


def fwd_scale(kind, z_gold, y_gold, dim, prologue: bool):
    """Magnitude of the forward's terms. log-softmax is ``z - (max + log(sum))``: its rounding is
    relative to ``|z|`` and the row max, not to the (possibly tiny) result. A softmax whose input
    went through a prologue inherits the prologue's rounding ``~|z|`` as a relative error."""
    if z_gold.numel() == 0:
        return None
    za = _finite_abs(z_gold)
    if kind == "log_softmax":
        return za + _row_max(za, dim) + _finite_abs(y_gold)
    if prologue:
        return _finite_abs(y_gold) * (za + _row_max(za, dim))
    return None


def grad_scale(kind, y_gold, g, dim, prologue_scale=1.0, softcap_t=None):
    """Magnitude of the terms of the backward: ``p * (|g| + |sum(g * p)|)`` (softmax) or
    ``|g| + p * |sum(g)|`` (log-softmax) with ``p`` the probabilities, times the prologue's scale; with a soft-cap, the cancellation in ``1 - tanh^2`` (``softcap_t`` = the tanh, gold)."""
    p = (y_gold if kind == "softmax" else y_gold.exp()).double().nan_to_num(0.0)
    g = g.double()
    if p.numel() == 0:
        return p
    if kind == "softmax":  # dz = p * (g - sum(g * p))
        out = p * (g.abs() + (g * p).sum(dim, keepdim=True).abs())
    else:  # dz = g - p * sum(g)
        out = g.abs() + p * g.sum(dim, keepdim=True).abs()
    out = out * abs(prologue_scale)
    if softcap_t is not None:
        t2 = softcap_t.double() ** 2
        out = out * (1.0 + t2)
    return out


def fwd_bwd(fn, x, g, *extra):
    """``y = fn(x)``; ``dx`` from ``y.backward(g)``. Returns ``(y, dx)`` detached."""
    x = x.detach().clone().requires_grad_(True)
    y = fn(x, *extra)
    (dx,) = torch.autograd.grad(y, x, g.to(y.dtype)) if y.numel() else (torch.zeros_like(x),)
    return y.detach(), dx


def check_against_gold(kind, x, dim, *, scale=1.0, softcap=None, mask=None, dtype=None, seed=0):
    """Forward and backward of ``smxcompile.<kind>`` vs torch (input dtype) vs an fp64 gold."""
    torch.manual_seed(seed)
    out_dtype = dtype or x.dtype
    g = torch.randn(x.shape, dtype=torch.float64)

    def ours(t):
        return ours_fn(kind)(t, dim, scale=scale, softcap=softcap, mask=mask, dtype=dtype)

    def theirs(t):
        z = prologue(t, scale, softcap, mask)
        return torch_fn(kind)(z, dim, dtype=dtype) if dtype is not None else torch_fn(kind)(z, dim)

    m64 = None if mask is None else mask.double()

    def gold(t):
        return torch_fn(kind)(prologue(t, scale, softcap, m64), dim)

    y_o, dx_o = fwd_bwd(ours, x, g)
    y_t, dx_t = fwd_bwd(theirs, x, g)
    y_g, dx_g = fwd_bwd(gold, x.double(), g)
    assert y_o.dtype == out_dtype and y_o.shape == x.shape
    assert y_o.is_contiguous()
    assert dx_o.dtype == x.dtype and dx_o.shape == x.shape
    # the op computes in fp32 (fp64 for fp64 input) and rounds to dtype: its precision is the
    # coarsest of the input, the output and fp32
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    z64 = prologue(x.double(), scale, softcap, m64)
    has_pro = scale != 1.0 or softcap is not None or mask is not None
    assert_gold_bound(y_o, y_t, y_g, dim, ulps=2.0, row_ulps=0.01, what=f"{kind} forward",
                      scale=fwd_scale(kind, z64, y_g, dim, has_pro),
                      precision=coarsest(out_dtype, x.dtype, compute))
    t = None if softcap is None else torch.tanh(x.double() * scale / softcap)
    assert_gold_bound(dx_o, dx_t, dx_g, dim, ulps=2.0, scale=grad_scale(kind, y_g, g, dim, scale, t),
                      precision=coarsest(out_dtype, x.dtype, compute), what=f"{kind} backward")


# --------------------------------------------------------------------------- the ops, eager


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dim", [0, 1, -1])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dtypes_and_dims(kind, dim, dtype):
    torch.manual_seed(1)
    x = (torch.randn(4, 6, 9) * 3).to(dtype)
    check_against_gold(kind, x, dim)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_non_contiguous_and_permuted(kind, dtype):
    torch.manual_seed(2)
    big = (torch.randn(6, 10, 12) * 4).to(dtype)
    sliced = big[::2, 1::3, ::2]
    assert not sliced.is_contiguous()
    for dim in (0, 1, 2):
        check_against_gold(kind, sliced, dim)
    perm = big.permute(2, 0, 1)
    assert not perm.is_contiguous()
    for dim in (0, -1):
        check_against_gold(kind, perm, dim)
    check_against_gold(kind, big.transpose(0, 2)[:, :, 1:], 1)


def test_large_logits_long_row():
    torch.manual_seed(3)
    x = torch.randn(3, 5000) * 30
    for kind in KINDS:
        check_against_gold(kind, x, -1)
        check_against_gold(kind, x.bfloat16(), -1)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rows_of_all_neg_inf_are_nan_like_torch(kind, dtype):
    x = torch.randn(4, 5).to(dtype)
    x[1] = float("-inf")
    y = ours_fn(kind)(x, -1)
    ref = torch_fn(kind)(x, -1)
    assert y[1].isnan().all()
    assert torch.equal(y.isnan(), ref.isnan())
    check_against_gold(kind, x, -1)
    # along dim 0 only column-wise: a -inf column is fine as long as another row is finite
    check_against_gold(kind, x, 0)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_nan_and_inf_entries(kind, dtype):
    x = torch.randn(6, 7).to(dtype)
    x[0, 3] = float("nan")
    x[1, 2] = float("inf")
    x[2, 0] = float("-inf")
    x[3, 1] = float("inf")
    x[3, 4] = float("-inf")
    x[4, :3] = float("inf")
    for dim in (0, 1):
        y = ours_fn(kind)(x, dim)
        ref = torch_fn(kind)(x, dim)
        assert torch.equal(y.isnan(), ref.isnan()), (dim, y, ref)
        check_against_gold(kind, x, dim)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape,dim", [((0, 5), -1), ((0, 5), 0), ((3, 0), -1), ((3, 0), 0), ((2, 0, 4), 1)])
def test_empty(kind, shape, dim):
    x = torch.randn(shape)
    y, lse = ours_fn(kind)(x, dim, return_lse=True)
    assert y.shape == x.shape and y.dtype == x.dtype
    ref_lse = torch.logsumexp(x, dim)
    assert lse.shape == ref_lse.shape and lse.dtype == torch.float32
    assert torch.equal(lse, ref_lse)  # -inf over a zero-length dim, empty otherwise
    check_against_gold(kind, x, dim)
    xr = x.clone().requires_grad_()
    ours_fn(kind)(xr, dim, scale=2.0).sum().backward()
    assert xr.grad.shape == x.shape


def test_zero_dim_tensor():
    x = torch.tensor(3.0)
    for kind in KINDS:
        torch.testing.assert_close(ours_fn(kind)(x, 0), torch_fn(kind)(x, 0))
        torch.testing.assert_close(ours_fn(kind)(x, -1), torch_fn(kind)(x, -1))


# ---- the fused prologue and the side output


PROLOGUES = [
    dict(scale=0.125),
    dict(scale=1 / 0.7),
    dict(softcap=30.0),
    dict(scale=0.5, softcap=20.0),
    dict(mask="row"),
    dict(mask="full"),
    dict(scale=0.25, softcap=50.0, mask="row"),
]


def _mask(kind, shape, dtype):
    torch.manual_seed(5)
    if kind == "row":  # (1, n, m) causal-like additive mask with -inf
        m = torch.zeros(1, shape[1], shape[2])
        m.masked_fill_(torch.ones(shape[1], shape[2]).triu(1).bool(), float("-inf"))
    else:  # full-shape float mask, finite
        m = torch.randn(shape) * 2
    return m.to(dtype)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("pro", PROLOGUES, ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()))
def test_scale_softcap_mask(kind, dtype, pro):
    torch.manual_seed(4)
    x = (torch.randn(2, 5, 5) * 40).to(dtype)
    pro = dict(pro)
    if "mask" in pro:
        pro["mask"] = _mask(pro["mask"], x.shape, dtype)
    check_against_gold(kind, x, -1, **pro)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("in_dtype,out_dtype", [
    (torch.float16, torch.float32), (torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16),
    (torch.float32, torch.float16), (torch.float32, torch.float64), (torch.float64, torch.float32),
], ids=str)
def test_dtype_argument(kind, in_dtype, out_dtype):
    torch.manual_seed(6)
    x = (torch.randn(3, 4, 11) * 3).to(in_dtype)
    for dim in (1, -1):
        check_against_gold(kind, x, dim, dtype=out_dtype)
        check_against_gold(kind, x, dim, dtype=out_dtype, scale=0.5)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_return_lse(kind, dtype):
    torch.manual_seed(7)
    x = (torch.randn(3, 4, 9) * 5).to(dtype)
    mask = _mask("row", (1, 4, 9), torch.float32)
    for dim, kw in [(-1, {}), (1, dict(scale=0.5)), (-1, dict(softcap=10.0, mask=mask))]:
        y, lse = ours_fn(kind)(x, dim, return_lse=True, **kw)
        y_only = ours_fn(kind)(x, dim, **kw)
        assert torch.equal(y, y_only)
        assert lse.dtype == torch.float32
        z64 = prologue(x.double(), kw.get("scale", 1.0), kw.get("softcap"),
                       None if "mask" not in kw else kw["mask"].double())
        gold = torch.logsumexp(z64, dim)
        ref = torch.logsumexp(prologue(x, kw.get("scale", 1.0), kw.get("softcap"), kw.get("mask")), dim).float()
        assert lse.shape == gold.shape
        assert_gold_bound(lse, ref, gold.float(), 0, ulps=4.0, what="lse")


def test_return_lse_gradient_matches_torch():
    torch.manual_seed(8)
    x = torch.randn(3, 7, dtype=torch.float64, requires_grad=True)
    gy, gl = torch.randn(3, 7, dtype=torch.float64), torch.randn(3, dtype=torch.float64)
    for kind in KINDS:
        y, lse = ours_fn(kind)(x, -1, scale=0.5, return_lse=True)
        (dx,) = torch.autograd.grad((y * gy).sum() + (lse * gl).sum(), x)
        z = x * 0.5
        y2, lse2 = torch_fn(kind)(z, -1), torch.logsumexp(z, -1)
        (dx2,) = torch.autograd.grad((y2 * gy).sum() + (lse2 * gl).sum(), x)
        torch.testing.assert_close(y, y2)
        torch.testing.assert_close(lse, lse2)
        torch.testing.assert_close(dx, dx2)


@pytest.mark.parametrize("kind", KINDS)
def test_mask_gradient(kind):
    torch.manual_seed(9)
    x = torch.randn(2, 3, 6, requires_grad=True)
    m = torch.randn(3, 6, requires_grad=True)
    g = torch.randn(2, 3, 6)
    y = ours_fn(kind)(x, -1, mask=m, scale=0.5)
    dx, dm = torch.autograd.grad(y, (x, m), g)
    x64, m64 = x.detach().double().requires_grad_(), m.detach().double().requires_grad_()
    y64 = torch_fn(kind)(x64 * 0.5 + m64, -1)
    dx64, dm64 = torch.autograd.grad(y64, (x64, m64), g.double())
    torch.testing.assert_close(y, y64.float(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dx, dx64.float(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dm, dm64.float(), rtol=1e-5, atol=1e-6)
    assert dm.shape == m.shape


# ---- op registration


def _opcheck_cases():
    torch.manual_seed(10)
    x = torch.randn(3, 5, 7)
    mask = torch.randn(5, 7)
    return [
        (x, -1, 1.0, None, None, None, False),
        (x, 0, 0.5, None, None, None, True),
        (x.bfloat16(), 1, 1.0, 30.0, None, torch.float32, True),
        (x.clone().requires_grad_(), -1, 0.25, 10.0, mask, None, True),
        (x.clone().requires_grad_(), 2, 1.0, None, mask.clone().requires_grad_(), None, False),
        (x.transpose(0, 2), 1, 2.0, None, None, None, False),
        (x.half().requires_grad_(), -1, 1.0, None, None, torch.float32, False),
        (torch.randn(0, 4), -1, 1.0, None, None, None, True),
    ]


@pytest.mark.parametrize("op_name", ["softmax", "log_softmax"])
@pytest.mark.parametrize("case", range(8))
def test_opcheck(op_name, case):
    op = getattr(torch.ops.smx, op_name).default
    torch.library.opcheck(op, _opcheck_cases()[case])


@pytest.mark.parametrize("op_name", ["softmax_backward", "log_softmax_backward"])
def test_opcheck_backward_ops(op_name):
    op = getattr(torch.ops.smx, op_name).default
    y = torch.softmax(torch.randn(3, 6), -1)
    if op_name.startswith("log"):
        y = y.log()
    g = torch.randn(3, 6)
    torch.library.opcheck(op, (g, y, 1, None, torch.float32))
    torch.library.opcheck(op, (g, y, 1, torch.randn(3), torch.float32))
    torch.library.opcheck(op, (g.bfloat16(), y.bfloat16(), 0, None, torch.float32))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("kw", [
    dict(),
    dict(scale=0.3),
    dict(softcap=2.0),
    dict(scale=1.7, softcap=3.0, mask=True),
    dict(mask=True, return_lse=True),
    dict(scale=0.5, softcap=4.0, mask=True, return_lse=True),
], ids=lambda kw: ",".join(kw) or "plain")
def test_gradcheck_fp64(kind, kw):
    torch.manual_seed(11)
    x = torch.randn(2, 3, 5, dtype=torch.float64, requires_grad=True)
    kw = dict(kw)
    inputs = [x]
    if kw.pop("mask", False):
        inputs.append(torch.randn(3, 5, dtype=torch.float64, requires_grad=True))

    def f(x, m=None):
        return ours_fn(kind)(x, 1, mask=m, **kw)

    assert torch.autograd.gradcheck(f, tuple(inputs))


# ---- bad input


def test_errors():
    x = torch.randn(3, 4)
    with pytest.raises(TypeError, match="floating-point"):
        smxcompile.softmax(torch.arange(6).reshape(2, 3))
    with pytest.raises(TypeError, match="floating-point"):
        smxcompile.log_softmax(torch.ones(2, 3, dtype=torch.int32))
    with pytest.raises(TypeError, match="dtype must be a floating-point dtype"):
        smxcompile.softmax(x, dtype=torch.int64)
    with pytest.raises(TypeError, match="must be a Tensor"):
        smxcompile.softmax([1.0, 2.0])
    for dim in (2, -3, 5):
        with pytest.raises(IndexError, match="Dimension out of range"):
            smxcompile.softmax(x, dim)
        with pytest.raises(IndexError, match="Dimension out of range"):
            smxcompile.log_softmax(x, dim)
    with pytest.raises(TypeError, match="not bool"):
        smxcompile.softmax(x, mask=torch.ones(3, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="does not broadcast"):
        smxcompile.softmax(x, mask=torch.zeros(5, 4))
    with pytest.raises(ValueError, match="larger shape"):
        smxcompile.log_softmax(x, mask=torch.zeros(2, 3, 4))


# --------------------------------------------------------------------------- compiled


def _handwritten(x):
    e = torch.exp(x - x.max(-1, keepdim=True)[0])
    return e / e.sum(-1, keepdim=True)


def _handwritten_amax(x):
    e = (x - torch.amax(x, 1, keepdim=True)).exp()
    return e / torch.sum(e, 1, keepdim=True)


def _handwritten_values(x):
    e = torch.exp(x - torch.max(x, 0, keepdim=True).values)
    return e / e.sum(0, keepdim=True)


def _naive(x):
    e = torch.exp(x)
    return e / e.sum(-1, keepdim=True)


def _shifted_log(x):
    m = x.amax(-1, keepdim=True)
    return (x - m) - torch.log(torch.sum(torch.exp(x - m), -1, keepdim=True))


_SM = nn.Softmax(dim=1)
_LSM = nn.LogSoftmax(dim=-1)

#: (name, kind, fn) -- each spelling the matcher claims, with the neighbours it absorbs
SPELLINGS = [
    ("F.softmax", "softmax", -1, lambda x: F.softmax(x, dim=-1)),
    ("torch.softmax", "softmax", 1, lambda x: torch.softmax(x, 1)),
    ("Tensor.softmax", "softmax", 0, lambda x: x.softmax(0)),
    ("nn.Softmax", "softmax", 1, lambda x: _SM(x)),
    ("special.softmax", "softmax", -1, lambda x: torch.special.softmax(x, -1)),
    ("softmax dtype=fp32", "softmax", -1, lambda x: F.softmax(x, -1, dtype=torch.float32)),
    ("exp(x-max)/sum", "softmax", -1, _handwritten),
    ("exp(x-amax)/sum", "softmax", 1, _handwritten_amax),
    ("exp(x-max.values)/sum", "softmax", 0, _handwritten_values),
    ("exp(x)/sum", "softmax", -1, _naive),
    ("F.log_softmax", "log_softmax", -1, lambda x: F.log_softmax(x, dim=-1)),
    ("Tensor.log_softmax", "log_softmax", 1, lambda x: x.log_softmax(1)),
    ("nn.LogSoftmax", "log_softmax", -1, lambda x: _LSM(x)),
    ("log_softmax dtype=fp32", "log_softmax", 0, lambda x: torch.log_softmax(x, 0, dtype=torch.float32)),
    ("x-logsumexp", "log_softmax", -1, lambda x: x - x.logsumexp(-1, keepdim=True)),
    ("(x-m)-log(sum(exp))", "log_softmax", -1, _shifted_log),
    ("log(softmax)", "log_softmax", -1, lambda x: torch.log(torch.softmax(x, -1))),
    ("scale", "softmax", -1, lambda x: torch.softmax(x / 2.0, -1)),
    ("softcap", "softmax", -1, lambda x: torch.softmax(30.0 * torch.tanh(x / 30.0), -1)),
    ("upcast*scale softmax downcast", "softmax", -1, lambda x: (x.float() * 0.5).softmax(-1).to(x.dtype)),
    ("T5 float().type_as", "softmax", -1, lambda x: F.softmax(x.float(), dim=-1).type_as(x)),
    ("log_softmax scale", "log_softmax", -1, lambda x: F.log_softmax(x * 0.25, dim=-1)),
    # two extra sites with an additive broadcast mask (see all_spellings)
    ("softmax(x+mask)", "softmax", -1, None),
    ("log_softmax(x*s+mask)", "log_softmax", -1, None),
]
_WITH_PROLOGUE = {"scale", "softcap", "upcast*scale softmax downcast", "log_softmax scale", "softmax(x+mask)",
                  "log_softmax(x*s+mask)"}
_FNS = tuple(fn for _, _, _, fn in SPELLINGS if fn is not None)


def all_spellings(mask, *xs):
    outs = tuple(fn(x) for fn, x in zip(_FNS, xs))
    a, b = xs[len(_FNS):]
    return outs + (torch.softmax(a + mask, -1), F.log_softmax(b * 0.5 + mask, dim=-1))


_COMPILED = {}


def _compiled_run(dtype):
    """Compile ``all_spellings`` once per dtype (forward + backward) and run it; cache the result."""
    if dtype in _COMPILED:
        return _COMPILED[dtype]
    torch.manual_seed(12)
    n = len(SPELLINGS)
    xs = [(torch.randn(3, 4, 6) * 3).to(dtype) for _ in range(n)]
    mask = torch.zeros(4, 6)
    mask[:, 4:] = float("-inf")
    mask[0, 1] = -2.0
    mask = mask.to(dtype)  # a mask in the scores' dtype (one that promotes them is not absorbed)
    gs = [torch.randn(3, 4, 6, dtype=torch.float64) for _ in range(n)]

    def run(fn, inputs, m):
        inputs = [x.detach().clone().requires_grad_() for x in inputs]
        outs = fn(m, *inputs)
        grads = torch.autograd.grad(outs, inputs, [g.to(o.dtype) for g, o in zip(gs, outs)])
        return [o.detach() for o in outs], list(grads)

    torch._dynamo.reset()
    before = len(smxcompile.backends.smx.compiled_reports)
    compiled = torch.compile(all_spellings, backend="smx", options=REWRITE, fullgraph=True, dynamic=False)
    got = run(compiled, xs, mask)
    reports = smxcompile.backends.smx.compiled_reports[before:]
    eager = run(all_spellings, xs, mask)
    gold = run(all_spellings, [x.double() for x in xs], mask.double())
    _COMPILED[dtype] = (got, eager, gold, reports, (xs, gs, mask))
    return _COMPILED[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_compiled_rewrite_fired(dtype):
    reports = _compiled_run(dtype)[3]
    assert len(reports) == 1
    rep = reports[0]
    n = len(SPELLINGS)
    assert rep.count(action="rewritten") == n, str(rep)
    assert len(rep) == n, str(rep)
    kinds = [s.kind for s in rep]
    want = [k for _, k, _, _ in SPELLINGS]
    assert kinds == want
    masked = rep.sites[-2:]
    assert all("mask" in s.detail for s in masked), str(rep)
    assert smxcompile.last_report() is reports[-1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("i", range(len(SPELLINGS)), ids=[name for name, _, _, _ in SPELLINGS])
def test_compiled_matches_eager(dtype, i):
    (y_c, g_c), (y_e, g_e), (y_g, g_g), _, (xs, gs, mask) = _compiled_run(dtype)
    name, kind, dim, _ = SPELLINGS[i]
    has_pro = name in _WITH_PROLOGUE
    z = xs[i].double() + (mask.double() if "mask" in name else 0.0)
    precision = coarsest(y_c[i].dtype, dtype, torch.float32)
    assert y_c[i].dtype == y_e[i].dtype
    assert_gold_bound(y_c[i], y_e[i], y_g[i].double(), dim, ulps=2.0, row_ulps=0.01, what=f"{name} forward",
                      scale=fwd_scale(kind, z, y_g[i].double(), dim, has_pro), precision=precision)
    assert g_c[i].dtype == g_e[i].dtype == dtype
    assert_gold_bound(g_c[i], g_e[i], g_g[i], dim, ulps=2.0, what=f"{name} backward",
                      scale=grad_scale(kind, y_g[i].double(), gs[i], dim), precision=precision)


def test_compiled_handwritten_naive_overflow_is_stable():
    # the naive exp(x)/sum overflows in eager; the rewrite computes the stable softmax
    torch._dynamo.reset()
    compiled = torch.compile(_naive, backend="smx", options=REWRITE)
    x = torch.tensor([[100.0, 0.0, -100.0], [1000.0, 999.0, 0.0]])
    y = compiled(x)
    assert smxcompile.last_report().count(action="rewritten") == 1
    assert _naive(x).isnan().any()
    torch.testing.assert_close(y, torch.softmax(x, -1))
