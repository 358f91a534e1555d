"""``smxcompile.softmax_topk`` and the ``smx::softmax_topk`` op on CPU (the torch path; the Triton
kernels have their own test file).

Accuracy criterion (forward and backward), against an fp64 gold: our error may not exceed torch's
own error by more than a tolerance, elementwise: ``|ours - gold| <= |torch - gold| + tol``, where
torch is ``torch.topk(torch.softmax(x / T, dim), k, dim)`` (divided by its sum when renormalized)
run in the input dtype (in the output dtype when ``dtype=`` widens it, as a model's ``.float()``
would), and the gold is the same formula in fp64 at the same selected columns (each
implementation is compared with the gold of its own indices, after checking that they are a valid
top-k of the logits). The backward is the gradient of ``sum(values * g)`` w.r.t. ``x`` for a random
``g``, the gold by autograd through the fp64 formula.

Tolerances, in units of ``eps`` of the dtype compared (values: the output dtype, gradients: ``x``'s):

* values: ``4 eps |gold| (2 + |ln gold|) + eps * smallest_normal`` -- a probability
  ``exp(z - lse)`` carries the rounding of its argument, about ``|ln p|`` ulps (torch's and ours
  come from different exp implementations, so they differ by that much), and a few ulps of
  rounding besides; the last term is one subnormal ulp (probabilities that underflow).
* gradients: ``16 eps sum_j |g_j v_j|`` per row -- the gradient is a difference of terms of that
  size (``g_j v_j`` and ``p_i sum_j g_j v_j``), so it is the scale of its rounding error; measured
  worst excess 6 (fp64, 70000 columns) over torch on logits ``3 * randn``.

Indices may differ from ``torch.topk`` only among equal logits: the selected logits (as a multiset)
equal the k largest logits, and they come largest first.

Shapes cover the op's selection strategies (``_select``): ``k == 1`` (a max), short rows with k
rounds of an int64-key max (<= 1024 columns, k <= 8, not fp64), chunked long rows (>= 4096
columns and ``k * CHUNK * 4 <= n``) and a plain top-k of the logits (everything else).
"""

from __future__ import annotations

import pytest
import torch

import smxcompile
from smxcompile.kernels.softmax_topk import decomposed as sk

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
COLUMNS = [8, 64, 1000, 5000, 70000]
KS = [0, 1, 2, 8, 50, "n"]
INF = float("inf")
NAN = float("nan")


# the CPU (torch) path, whatever another test module left in the kernel switches
pytestmark = pytest.mark.usefixtures("torch_path")


# --------------------------------------------------------------------------- implementations under test


def run_public(x, k, dim=-1, renormalize=False, temperature=1.0, dtype=None):
    r = smxcompile.softmax_topk(x, k, dim, renormalize=renormalize, temperature=temperature, dtype=dtype)
    assert isinstance(r, torch.return_types.topk)
    return r.values, r.indices


def run_op(x, k, dim=-1, renormalize=False, temperature=1.0, dtype=None):
    v, i, lse = torch.ops.smx.softmax_topk(x, k, dim % x.dim(), 1.0 / temperature, renormalize, dtype)
    return v, i


def run_decomposed(x, k, dim=-1, renormalize=False, temperature=1.0, dtype=None):
    """The decomposition (what the smx backend emits on CPU), differentiated by autograd."""
    v, i, lse = sk.softmax_topk_decomposed(x, k, dim, 1.0 / temperature, renormalize, dtype)
    return v, i


IMPLS = {"public": run_public, "op": run_op, "decomposed": run_decomposed}


# --------------------------------------------------------------------------- references and checks


def math_dtype(x_dtype, out):
    """The dtype torch's softmax runs in: the input's, widened to ``dtype`` when that is wider (a
    model's ``.float()``), but not beyond the op's own math (fp32; fp64 only for fp64 input)."""
    wide = torch.promote_types(x_dtype, out)
    return torch.float32 if wide == torch.float64 and x_dtype != torch.float64 else wide


def torch_topk(x, k, dim=-1, renormalize=False, temperature=1.0, dtype=None):
    """Torch's own ``topk(softmax(x / T))`` in :func:`math_dtype`, cast to ``dtype``."""
    out = dtype or x.dtype
    wide = math_dtype(x.dtype, out)
    z = x.to(wide)
    if temperature != 1.0:
        z = z / temperature
    v, i = torch.topk(torch.softmax(z, dim), k, dim)
    if renormalize:
        v = v / v.sum(dim, keepdim=True)
    return v.to(out), i


def gold(x, idx, dim=-1, renormalize=False, temperature=1.0, g=None):
    """fp64 values at the columns ``idx``, and (with ``g``) the fp64 gradient of ``sum(values * g)``."""
    x64 = x.detach().to(torch.float64).requires_grad_(g is not None)
    z = x64 / temperature
    # not torch.softmax: its fp64 CPU kernel sums a long row with errors of ~1e-14 relative (70000
    # columns), more than ours; torch.sum's cascade summation is accurate to a few ulps
    e = torch.exp(z - z.amax(dim, keepdim=True).detach())
    v = (e / e.sum(dim, keepdim=True)).gather(dim, idx)
    if renormalize:
        v = v / v.sum(dim, keepdim=True)
    if g is None:
        return v.detach(), None
    (v * g).sum().backward()
    return v.detach(), x64.grad


def check_indices(x, idx, k, dim=-1):
    """``idx`` is a top-k of the logits: int64, in range, distinct per row, largest first, and its
    logits are the k largest (as a multiset; among equal logits any column may be chosen)."""
    assert idx.dtype == torch.int64
    n = x.shape[dim]
    xl = x.detach().movedim(dim, -1).reshape(-1, n).double()
    il = idx.movedim(dim, -1).reshape(xl.shape[0], k)
    assert ((il >= 0) & (il < n)).all(), "index out of range"
    if k == 0:
        return
    s = il.sort(-1).values
    assert (s[:, 1:] != s[:, :-1]).all(), "a column selected twice"
    finite_rows = ~torch.isnan(xl).any(-1)   # NaN rows: any distinct columns (values are NaN)
    picked = xl.gather(-1, il)[finite_rows]
    want = torch.topk(xl[finite_rows], k, -1).values
    assert torch.equal(picked.sort(-1, descending=True).values, want), "not the k largest logits"
    assert (picked[:, 1:] <= picked[:, :-1]).all(), "not largest first"


def value_tol(gold_v, dtype):
    e = torch.finfo(dtype).eps
    a = gold_v.abs()
    ln = torch.where(a > 0, a.log().abs(), torch.zeros_like(a))
    return 4 * e * a * (2 + ln) + e * torch.finfo(dtype).smallest_normal


def grad_tol(g, gold_v, dim, dtype):
    scale = (g.abs() * gold_v.abs()).sum(dim, keepdim=True)
    return 16 * torch.finfo(dtype).eps * scale


def assert_not_worse(ours, ours_gold, ref, ref_gold, tol, what):
    err = (ours.double() - ours_gold).abs()
    ref_err = (ref.double() - ref_gold).abs()
    bad = ~(err <= ref_err + tol)          # also catches NaN
    if bad.any():
        j = bad.nonzero()[0].tolist()
        raise AssertionError(
            f"{what}: {int(bad.sum())} entries beyond torch's error + tol; first at {j}: ours "
            f"{ours.flatten()[bad.flatten()][0].item()!r}, gold {ours_gold.flatten()[bad.flatten()][0].item()!r}, "
            f"|ours-gold|={err[bad].max().item():.3g} vs |torch-gold|+tol="
            f"{(ref_err + tol)[bad].min().item():.3g}")


def compare(impl, x, k, dim=-1, renormalize=False, temperature=1.0, dtype=None, backward=True, seed=0):
    """Run ``impl`` and torch on ``x`` (forward and, with ``backward``, backward) and apply the criterion."""
    out = dtype or x.dtype
    xo = x.detach().clone().requires_grad_(backward)
    v, i = IMPLS[impl](xo, k, dim, renormalize, temperature, dtype)
    shape = list(x.shape)
    shape[dim] = k
    assert v.shape == tuple(shape) and i.shape == tuple(shape), (v.shape, i.shape, shape)
    assert v.dtype == out and i.dtype == torch.int64
    check_indices(x, i, k, dim)

    xt = x.detach().clone().requires_grad_(backward)
    tv, ti = torch_topk(xt, k, dim, renormalize, temperature, dtype)
    g = torch.randn(v.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)) if backward else None
    gv, gx = gold(x, i, dim, renormalize, temperature, g)
    tgv, tgx = (gv, gx) if torch.equal(i, ti) else gold(x, ti, dim, renormalize, temperature, g)
    coarse = out if torch.finfo(out).eps >= torch.finfo(math_dtype(x.dtype, out)).eps else math_dtype(x.dtype, out)
    assert_not_worse(v, gv, tv, tgv, value_tol(gv, coarse), f"{impl} values")
    if backward:
        (v.double() * g).sum().backward()
        (tv.double() * g).sum().backward()
        assert xo.grad is not None and xo.grad.dtype == x.dtype and xo.grad.shape == x.shape
        assert_not_worse(xo.grad, gx, xt.grad, tgx, grad_tol(g, gv, dim, x.dtype), f"{impl} grad")
    return v, i, xo.grad


def logits(shape, dtype, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, dtype=torch.float64, generator=g) * scale).to(dtype)


# --------------------------------------------------------------------------- accuracy


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", COLUMNS)
def test_accuracy_grid(dtype, n):
    """Every k (0, 1, 2, 8, 50, n) x renormalize, forward and backward, for the public function and
    the decomposition (autograd through it: the smx backend's CPU graph); rows of 8 ... 70000 columns
    (all four selection strategies)."""
    rows = {5000: 2, 70000: 1}.get(n, 5)
    for kk in KS:
        k = n if kk == "n" else kk
        if k > n or (n == 70000 and kk in (0, 8)):   # (the longest rows: the k of each strategy only)
            continue
        for renormalize in (False, True):
            # (the decomposition's autograd backward on the longest rows: once per dtype, to keep the time down)
            for impl in ("public", "decomposed") if n < 70000 or k == 50 else ("public",):
                x = logits((rows, n), dtype, seed=n + k)
                compare(impl, x, k, renormalize=renormalize, seed=k)


def test_grid_covers_every_selection_strategy():
    """The shapes above reach the four branches of ``_select`` (guards against a change of the constants)."""
    def strategy(n, k, dtype):
        if k == 1:
            return "max"
        if dtype != torch.float64 and n <= sk.KEY_ROUNDS_MAX_COLUMNS and k <= sk.KEY_ROUNDS_MAX_K:
            return "key rounds"
        if n >= sk.CHUNKED_MIN_COLUMNS and k * sk.CHUNK * 4 <= n:
            return "chunked"
        return "topk"

    seen = {strategy(n, n if k == "n" else k, d) for n in COLUMNS for k in KS[1:] for d in DTYPES
            if (n if k == "n" else k) <= n}
    assert seen == {"max", "key rounds", "chunked", "topk"}


@pytest.mark.parametrize("impl", ["public", "op", "decomposed"])
@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("temperature", [0.5, 2.0, 7])
def test_temperature(impl, renormalize, temperature):
    for n, k in ((64, 2), (1000, 50), (5000, 8)):
        compare(impl, logits((3, n), torch.float32, seed=n), k, renormalize=renormalize, temperature=temperature)


@pytest.mark.parametrize("x_dtype,dtype", [(torch.float16, torch.float32), (torch.bfloat16, torch.float32),
                                           (torch.float32, torch.float64), (torch.float32, torch.bfloat16),
                                           (torch.float64, torch.float16), (torch.float16, torch.float16)])
@pytest.mark.parametrize("renormalize", [False, True])
def test_dtype_argument(x_dtype, dtype, renormalize):
    """``dtype=`` sets the values' dtype (the math stays fp32 / fp64); torch is run in the wider dtype."""
    for n, k in ((8, 2), (64, 8), (5000, 8), (1000, 50)):
        compare("public", logits((3, n), x_dtype, seed=n), k, renormalize=renormalize, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_dims_and_strides(dtype):
    """dim != -1 (positive and negative), permuted and sliced (non-contiguous) inputs: accurate, and
    the same as the contiguous row-major equivalent."""
    base = logits((6, 70, 5), dtype, seed=3)
    cases = [
        (base, 1, 8), (base, -2, 2), (base, 0, 3), (base, 2, 5),
        (base.permute(2, 0, 1), -1, 8),                 # rows along a strided dim
        (base.permute(1, 2, 0), 0, 4),
        (base[:, ::3, :], 1, 2),                        # a step
        (base.transpose(0, 2)[1:, :, ::2], 1, 7),
        (logits((5, 6000), dtype, seed=4).t(), 0, 8),   # chunked path on a transposed tensor
        (logits((5, 6000), dtype, seed=4)[:, ::2], 1, 1),
    ]
    for x, dim, k in cases:
        for renormalize in (False, True):
            assert not x.is_contiguous() or x is base
            v, i, gx = compare("public", x, k, dim, renormalize)
            xc = x.movedim(dim, -1).contiguous().requires_grad_()
            rc = smxcompile.softmax_topk(xc, k, renormalize=renormalize)
            # (a strided row may be reduced in another order: equal up to rounding)
            torch.testing.assert_close(v, rc.values.movedim(-1, dim))
            assert torch.equal(i, rc.indices.movedim(-1, dim))
            gsum = torch.randn(v.shape, generator=torch.Generator().manual_seed(k)).to(dtype)
            xo = x.detach().clone().requires_grad_()
            (smxcompile.softmax_topk(xo, k, dim, renormalize=renormalize).values * gsum).sum().backward()
            (rc.values * gsum.movedim(dim, -1)).sum().backward()
            torch.testing.assert_close(xo.grad, xc.grad.movedim(-1, dim))


@pytest.mark.parametrize("impl", ["public", "op", "decomposed"])
def test_one_dim_input_and_empty_shapes(impl):
    for n, k in ((8, 2), (1000, 1), (5000, 8), (64, 64), (64, 0)):
        for renormalize in (False, True):
            compare(impl, logits((n,), torch.float32, seed=n), k, -1, renormalize)
    # no rows, and rows of no columns
    for shape, k in (((0, 8), 2), ((3, 0), 0), ((2, 0, 4), 3)):
        x = torch.randn(shape, requires_grad=True)
        v, i = IMPLS[impl](x, k, -1)
        assert v.shape == i.shape == (*shape[:-1], k)
        assert v.requires_grad   # as torch.topk's empty values: backward through them works
        v.sum().backward()
        assert x.grad.shape == x.shape and not x.grad.any()


@pytest.mark.parametrize("renormalize", [False, True])
def test_k_zero_gradient_is_zero(renormalize):
    x = torch.randn(4, 50, requires_grad=True)
    r = smxcompile.softmax_topk(x, 0, renormalize=renormalize)
    assert r.values.shape == (4, 0) and r.indices.shape == (4, 0)
    (r.values * 3).sum().backward()
    assert torch.equal(x.grad, torch.zeros_like(x))


@pytest.mark.parametrize("renormalize", [False, True])
def test_shifted_logits_backward(renormalize):
    """Softmax is shift-invariant: large logits (an offset of 1000) must not cost gradient accuracy.
    (A backward that recomputes ``p = exp(z - lse)`` from an fp32 ``lse`` of ~1000 loses ~|lse| ulps.)"""
    for n, k in ((64, 2), (1000, 8), (5000, 50)):
        x = logits((16, n), torch.float32, seed=n) + 1000
        for impl in ("public", "decomposed"):
            compare(impl, x, k, renormalize=renormalize)


def test_only_indices_used_backward():
    """A loss through the indices only (no values): no gradient reaches x, and nothing fails."""
    x = torch.randn(3, 64, requires_grad=True)
    r = smxcompile.softmax_topk(x, 4)
    (x.gather(-1, r.indices) * 2).sum().backward()
    expect = torch.zeros(3, 64).scatter_(-1, r.indices, 2.0)
    torch.testing.assert_close(x.grad, expect)


# --------------------------------------------------------------------------- ties


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n,k", [(8, 3), (64, 8), (64, 50), (1000, 1), (5000, 8), (30000, 50), (1000, 1000)])
def test_ties(dtype, n, k):
    """Many equal logits: indices are a valid top-k (equal to torch's as a multiset of logits), the
    values equal torch's, also for a row that is all one value."""
    g = torch.Generator().manual_seed(n)
    x = torch.randint(-3, 3, (4, n), generator=g).to(dtype)
    x[1] = 0.0
    x[2, ::2] = 5.0
    compare("public", x, k)
    compare("public", x, k, renormalize=True)
    v = smxcompile.softmax_topk(x[1:2], k).values
    torch.testing.assert_close(v, torch.full_like(v, 1.0 / n))


def test_short_rows_pick_the_lowest_column_among_ties():
    """The documented tie order of the short-row path (k rounds of a key max): lowest column first (the op's CPU
    path and the backend's graph; an eager call runs torch.topk, whose tie order torch leaves open)."""
    x = torch.zeros(2, 64)
    x[1, 40:] = 1.0
    i = run_op(x, 8, -1, False, 1.0, None)[1]
    assert i[0].tolist() == list(range(8))
    assert i[1].tolist() == list(range(40, 48))


@pytest.mark.parametrize("n,k", [(5000, 8), (70000, 50), (70000, 2)])
def test_chunked_adversarial_layouts(n, k):
    """The chunked path keeps only the k chunks with the largest maxima (plus the tail chunk): top-k
    all in one chunk, in the tail chunk, spread over chunks, a chunk with many large values but a
    smaller maximum than others, and a NaN inside a chunk."""
    assert n >= sk.CHUNKED_MIN_COLUMNS and k * sk.CHUNK * 4 <= n and n % sk.CHUNK   # really chunked, with a tail
    g = torch.Generator().manual_seed(k)
    rows = torch.randn(6, n, generator=g)
    rows[0, 1000:1000 + k] = 10 + torch.arange(k, dtype=torch.float32)     # all in one (or two) chunk(s)
    rows[1, n - min(k, n % sk.CHUNK):] = 20.0                              # in the tail chunk
    rows[1, 7] = 19.0
    rows[2, ::sk.CHUNK * 3] = 8 + torch.rand(rows[2, ::sk.CHUNK * 3].shape, generator=g)   # one per chunk
    rows[3, :sk.CHUNK] = 9 + torch.arange(sk.CHUNK, dtype=torch.float32) / 1000   # many large values in chunk 0
    rows[3, sk.CHUNK * 5] = 9.5                                              # larger max elsewhere
    rows[4].fill_(-INF)                                                       # finite only in a few places
    rows[4, 3 * sk.CHUNK + 1] = 0.0
    rows[4, n - 1] = 1.0
    rows[5, 2 * sk.CHUNK + 3] = NAN
    for renormalize in (False, True):
        compare("public", rows[:4], k, renormalize=renormalize)
        v, i = run_public(rows, k, renormalize=renormalize)
        check_indices(rows[:5], i[:5], k)
        assert torch.isnan(v[5]).all() and (i[5] >= 0).all() and (i[5] < n).all() and len(set(i[5].tolist())) == k
        tv, _ = torch_topk(rows[4:5], k, renormalize=renormalize)   # two finite entries, then zeros
        torch.testing.assert_close(v[4:5], tv)
        assert (v[4, 2:] == 0).all()


# --------------------------------------------------------------------------- special values


def _special_rows(n: int, dtype) -> torch.Tensor:
    """Row 0: three finite entries, the rest -inf; row 1: all -inf; row 2: a NaN; row 3: a +inf;
    row 4: +inf and -inf and NaN; row 5: ordinary (must not be disturbed by its neighbours)."""
    x = logits((6, n), dtype, seed=n)
    x[0] = -INF
    x[0, [1, n // 2, n - 1]] = torch.tensor([0.5, 2.0, -1.0], dtype=dtype)
    x[1] = -INF
    x[2, n // 3] = NAN
    x[3, n - 2] = INF
    x[4, 0], x[4, 1], x[4, 2] = INF, -INF, NAN
    return x


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n,k", [(8, 1), (8, 5), (8, 8), (64, 8), (64, 50), (5000, 1), (5000, 8), (30000, 50),
                                 (1000, 1000)])
@pytest.mark.parametrize("renormalize", [False, True])
def test_special_values(dtype, n, k, renormalize):
    """-inf entries have probability 0 and are picked last (values 0 when k > the finite count); rows
    with NaN or +inf or only -inf give NaN values (as torch), with valid distinct indices."""
    x = _special_rows(n, dtype)
    for impl in ("public", "op", "decomposed"):
        v, i = IMPLS[impl](x, k, -1, renormalize)
        tv, ti = torch_topk(x, k, renormalize=renormalize)
        assert v.dtype == dtype and v.shape == i.shape == (6, k)
        assert ((i >= 0) & (i < n)).all()
        for r in range(6):
            assert len(set(i[r].tolist())) == k, (impl, r, i[r])
        # row 0: the finite entries first, then -inf columns with value 0
        check_indices(x[:1], i[:1], k)
        want0 = torch.topk(torch.softmax(x[0].double(), -1), k).values
        if renormalize:
            want0 = want0 / want0.sum()
        torch.testing.assert_close(v[0].double(), want0, rtol=2 * torch.finfo(dtype).eps, atol=0)
        if k > 3:
            assert (v[0, 3:] == 0).all() and torch.isneginf(x[0, i[0, 3:]]).all()
        # rows 1-4: NaN values, as torch
        assert torch.isnan(v[1:5]).all(), (impl, v[1:5])
        assert torch.isnan(tv[1:5]).all()
        # row 5: ordinary
        check_indices(x[5:], i[5:], k)
        assert torch.equal(v[5], IMPLS[impl](x[5:], k, -1, renormalize)[0][0])   # not disturbed by its neighbours
    compare("public", x[5:], k, renormalize=renormalize)


@pytest.mark.parametrize("n,k", [(8, 5), (64, 8), (5000, 8), (64, 50)])
@pytest.mark.parametrize("renormalize", [False, True])
def test_neg_inf_entries_backward(n, k, renormalize):
    """Rows with -inf entries (k beyond the finite count included) have finite gradients equal to torch's."""
    x = logits((3, n), torch.float32, seed=n)
    x[0] = -INF
    x[0, [1, n // 2, n - 1]] = torch.tensor([0.5, 2.0, -1.0])
    x[1, ::2] = -INF
    v, i, gx = compare("public", x, k, renormalize=renormalize)
    assert torch.isfinite(gx).all()
    assert (gx[torch.isneginf(x)] == 0).all()


# --------------------------------------------------------------------------- argument errors


def test_errors():
    x = torch.randn(4, 10)
    f = smxcompile.softmax_topk
    cases = [
        (TypeError, r"floating-point", lambda: f(torch.arange(10), 2)),
        (TypeError, r"floating-point", lambda: f(torch.ones(3, 4, dtype=torch.bool), 1)),
        (TypeError, r"Tensor", lambda: f([1.0, 2.0], 1)),
        (ValueError, r"k=11 out of range", lambda: f(x, 11)),
        (ValueError, r"k=-1 out of range", lambda: f(x, -1)),
        (ValueError, r"k=5 out of range: dim 0 has 4", lambda: f(x, 5, 0)),
        (TypeError, r"k must be an int", lambda: f(x, 2.0)),
        (TypeError, r"k must be an int", lambda: f(x, True)),
        (TypeError, r"k must be an int", lambda: f(x, torch.tensor(2))),
        (TypeError, r"k must be an int", lambda: f(x, None)),
        (ValueError, r"temperature", lambda: f(x, 2, temperature=0)),
        (ValueError, r"temperature", lambda: f(x, 2, temperature=0.0)),
        (ValueError, r"temperature", lambda: f(x, 2, temperature=-1.0)),
        (ValueError, r"temperature", lambda: f(x, 2, temperature=INF)),
        (ValueError, r"temperature", lambda: f(x, 2, temperature=NAN)),
        (ValueError, r"temperature", lambda: f(x, 2, temperature=True)),
        (ValueError, r"temperature", lambda: f(x, 2, temperature="1")),
        (IndexError, r"Dimension out of range", lambda: f(x, 2, 2)),
        (IndexError, r"Dimension out of range", lambda: f(x, 2, -3)),
        (IndexError, r"Dimension out of range", lambda: f(torch.randn(5), 2, 1)),
        (TypeError, r"dim must be an int", lambda: f(x, 2, 1.0)),
        (TypeError, r"dim must be an int", lambda: f(x, 2, True)),
        (ValueError, r"0-d", lambda: f(torch.tensor(1.0), 1)),
        (ValueError, r"0-d", lambda: f(torch.tensor(1.0), 0)),
        (TypeError, r"dtype must be a floating-point dtype", lambda: f(x, 2, dtype=torch.int32)),
        (TypeError, r"dtype must be a floating-point dtype", lambda: f(x, 2, dtype=torch.complex64)),
        (TypeError, r"dtype must be a floating-point dtype", lambda: f(x, 2, dtype="float32")),
        (TypeError, r"floating-point", lambda: f(torch.randn(3, 4, dtype=torch.complex64), 1)),
    ]
    for exc, msg, call in cases:
        with pytest.raises(exc, match=msg):
            call()


def test_temperature_int_and_one():
    x = torch.randn(3, 40)
    a = smxcompile.softmax_topk(x, 3, temperature=2)
    b = smxcompile.softmax_topk(x / 2, 3)
    torch.testing.assert_close(a.values, b.values)
    assert torch.equal(a.indices, b.indices)


# --------------------------------------------------------------------------- op registration


def _opcheck_cases():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 64, generator=g)
    return {
        "k2": (x.clone().requires_grad_(), 2, 1, 1.0, False, None),
        "k2_renorm": (x.clone().requires_grad_(), 2, 1, 0.5, True, None),
        "k1": (x.clone().requires_grad_(), 1, 1, 1.0, False, None),
        "k0": (x.clone().requires_grad_(), 0, 1, 1.0, False, None),
        "dim0_bf16_to_fp32": (x[:, :6].to(torch.bfloat16).requires_grad_(), 3, 0, 2.0, False, torch.float32),
        "3d_dim1_renorm": (torch.randn(2, 50, 3, generator=g, requires_grad=True), 50, 1, 1.0, True, None),
        "chunked": (torch.randn(2, 4500, generator=g, requires_grad=True), 8, 1, 1.0, False, None),
        "fp64": (torch.randn(3, 9, dtype=torch.float64, generator=g, requires_grad=True), 4, 1, 1.0, False,
                 torch.float16),
        "no_grad": (x.clone(), 3, 1, 1.0, True, None),
    }


@pytest.mark.parametrize("case", list(_opcheck_cases()))
def test_opcheck(case):
    torch.library.opcheck(torch.ops.smx.softmax_topk.default, _opcheck_cases()[case])


@pytest.mark.parametrize("renormalize", [False, True])
def test_opcheck_backward(renormalize):
    x = torch.randn(3, 40, dtype=torch.float32)
    v, i, lse = torch.ops.smx.softmax_topk(x, 5, 1, 0.7, renormalize, None)
    gv = torch.randn_like(v)
    torch.library.opcheck(torch.ops.smx.softmax_topk_backward.default, (gv, v, i, x, lse, 1, 0.7, renormalize))
    xh = torch.randn(40, 3, dtype=torch.float16)
    v, i, lse = torch.ops.smx.softmax_topk(xh, 2, 0, 1.0, renormalize, torch.float32)
    torch.library.opcheck(torch.ops.smx.softmax_topk_backward.default,
                          (torch.randn_like(v), v, i, xh, lse, 0, 1.0, renormalize))


def test_op_outputs():
    """``(values, indices, logd)``: logd = log(sum(exp(z - max z))), fp32 (fp64 for fp64 input) over the
    other dims, empty when renormalized; values equal ``exp(z[indices] - z[indices[0]] - logd)``."""
    x = torch.randn(3, 50, 4, dtype=torch.bfloat16)
    v, i, logd = torch.ops.smx.softmax_topk(x, 6, 1, 0.5, False, None)
    assert v.shape == i.shape == (3, 6, 4) and v.dtype == torch.bfloat16
    assert logd.shape == (3, 4) and logd.dtype == torch.float32
    z = x.float() * 0.5
    torch.testing.assert_close(logd, torch.logsumexp(z, 1) - z.amax(1))
    top = z.gather(1, i[:, :1])
    torch.testing.assert_close(v.float(), torch.exp(z.gather(1, i) - top - logd[:, None]), rtol=8e-3, atol=0)
    _, _, logd = torch.ops.smx.softmax_topk(x, 6, 1, 0.5, True, None)
    assert logd.numel() == 0
    _, _, logd = torch.ops.smx.softmax_topk(x.double(), 6, 1, 0.5, False, None)
    assert logd.dtype == torch.float64


@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("k,dim", [(1, -1), (3, -1), (4, 0), (10, 1)])
def test_gradcheck(renormalize, k, dim):
    x = torch.randn(5, 10, dtype=torch.float64, requires_grad=True)

    def fn(t):
        return smxcompile.softmax_topk(t, k, dim, renormalize=renormalize, temperature=0.7).values

    assert torch.autograd.gradcheck(fn, (x,))


def test_reference_matches_torch():
    x = logits((4, 300), torch.float16, seed=9)
    v, i = sk.softmax_topk_reference(x, 5, -1, 0.5, True, torch.float32)
    tv, ti = torch_topk(x, 5, renormalize=True, temperature=2.0, dtype=torch.float32)
    torch.testing.assert_close(v, tv)
    assert torch.equal(i, ti)


# --------------------------------------------------------------------------- torch.compile (default Inductor)


@pytest.fixture
def _fresh_dynamo():
    with torch._inductor.config.patch(compile_threads=1):
        torch._dynamo.reset()
        yield
        torch._dynamo.reset()


@pytest.mark.slow
@pytest.mark.parametrize("dynamic", [False, True])
def test_compiled_with_inductor(_fresh_dynamo, dynamic):
    """The public function under ``torch.compile(fullgraph=True)`` (default backend): the op stays one
    opaque call, forward and backward match eager."""
    def fn(x, w):
        r = smxcompile.softmax_topk(x @ w, 3, renormalize=True, temperature=0.5)
        s = smxcompile.softmax_topk(x.t(), 2, dim=0, dtype=torch.float64)
        return (r.values * 2).sum(-1) + r.indices.sum(-1), s.values, s.indices

    compiled = torch.compile(fn, fullgraph=True, dynamic=dynamic)
    for rows in (6, 9):
        x = torch.randn(rows, 32)
        w = torch.randn(32, 64)
        xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
        xb, wb = x.clone().requires_grad_(), w.clone().requires_grad_()
        want = fn(xa, wa)
        got = compiled(xb, wb)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b)
        (want[0].sum() + want[1].sum()).backward()
        (got[0].sum() + got[1].sum()).backward()
        torch.testing.assert_close(xb.grad, xa.grad)
        torch.testing.assert_close(wb.grad, wa.grad)


@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("n", [8, 100])
def test_eager_orders_probability_ties_by_the_logits(n, renormalize):
    """Two different logits whose probabilities round to the same fp32 number: the larger logit comes first in an
    eager call too (torch's softmax-then-topk orders such ties arbitrarily), as in the op."""
    x = torch.zeros(3, n)
    x[:, 1] = 1e-9
    x[1, n - 1] = 2e-9
    i = smxcompile.softmax_topk(x, 1, renormalize=renormalize).indices
    assert i[:, 0].tolist() == [1, n - 1, 1]
    assert torch.equal(i, run_op(x, 1, -1, renormalize)[1])
