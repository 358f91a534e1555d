"""Cut cross-entropy on CPU: ``smxcompile.linear_cross_entropy``, ``smxcompile.cross_entropy``, the ``smx::*ce*`` ops.

Accuracy criterion (the project's, forward AND gradients of input, weight and bias): against an fp64
gold, our error may not exceed torch's own error (torch run in the input dtype:
``F.cross_entropy(F.linear(...))``) by more than a few ulps, elementwise:
``|ours - gold| <= |torch - gold| + tol``; NaN/inf positions must equal torch's. ``tol`` is a few ulps of
the result plus a few ulps of the magnitude of the terms the result is computed from (a dot product's
``|a|.|b|``, a log-sum-exp's row max), as in ``tests/kernels/test_softmax_numerics.py``.

CPU has two paths, and every option is run through both where it applies:
* the fused path (``smx::linear_ce_loss``: gradients computed in the forward) — class-index targets,
  reduction mean/sum, a gradient needed;
* the statistics path (``smx::linear_ce_stats`` + ``smx::linear_ce_backward``) — reduction none,
  return_lse, no gradient, soft targets, a token_weight that needs a gradient.
Which one ran is asserted by counting calls to the ops (``paths`` fixture).

Everything runs on the torch path (Triton is not used on CPU tensors unless forced; the Triton kernels
have their own tests).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import smxcompile
from smxcompile.kernels import cross_entropy as ce_mod
from smxcompile.kernels.cross_entropy import api as ce_api
from smxcompile.kernels.cross_entropy import chunked as ce_chunked
from smxcompile.kernels.cross_entropy import fused as ce_fused
from smxcompile.kernels.cross_entropy import ops as ce_ops

LCE = smxcompile.linear_cross_entropy
CE = smxcompile.cross_entropy
N, D, V = 37, 19, 101  # multiples of nothing
SMALL_CHUNK = 4 * V * 3  # 3 rows of fp32 logits a chunk: 13 chunks for N=37, the last one partial
HALF = [torch.bfloat16, torch.float16]


# the CPU (torch) path even when a session forces Triton on CPU tensors
pytestmark = pytest.mark.usefixtures("torch_path")


# --------------------------------------------------------------------------- helpers


def eps(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps


def assert_bound(ours, ref, gold, *, precision, scale=None, ulps=4.0, scale_ulps=8.0, what=""):
    """``|ours - gold| <= |ref - gold| + eps * (ulps * |gold| + scale_ulps * scale)`` elementwise;
    NaN/inf positions as in ``ref``."""
    ours, ref, gold = (torch.as_tensor(t).detach().double() for t in (ours, ref, gold))
    assert ours.shape == ref.shape == gold.shape, (what, ours.shape, ref.shape, gold.shape)
    assert torch.equal(ours.isnan(), ref.isnan()), f"{what}: NaN positions differ: {ours} vs {ref}"
    assert torch.equal(ours.isposinf(), ref.isposinf()) and torch.equal(ours.isneginf(), ref.isneginf()), what
    fin = ours.isfinite() & ref.isfinite() & gold.isfinite()
    o, r, g = ours[fin], ref[fin], gold[fin]
    tol = ulps * g.abs()
    if scale is not None:
        tol = tol + scale_ulps * torch.as_tensor(scale).double().expand(fin.shape)[fin]
    tol = eps(precision) * tol + torch.finfo(precision).smallest_normal * eps(precision)
    err_o, err_r = (o - g).abs(), (r - g).abs()
    bad = err_o > err_r + tol
    if bad.any():
        i = bad.nonzero()[0].item()
        raise AssertionError(
            f"{what}: {int(bad.sum())}/{bad.numel()} element(s) worse than torch: ours={o[i].item()!r} "
            f"torch={r[i].item()!r} gold={g[i].item()!r} (|ours-gold|={err_o[i].item():.3g} > "
            f"|torch-gold|={err_r[i].item():.3g} + tol={tol[i].item():.3g})")


def make_problem(shape=(N,), d=D, v=V, dtype=torch.float32, *, bias=True, ignore_index=-100, ignore_frac=0.2,
                 seed=0, soft=False, wscale=None):
    """x (*shape, d), w (v, d), b (v,) or None, target (*shape) with ~ignore_frac ignored (or probabilities)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, d, generator=gen)
    w = torch.randn(v, d, generator=gen) * (wscale if wscale is not None else 2.0 / math.sqrt(d))
    b = torch.randn(v, generator=gen) if bias else None
    if soft:
        target = torch.softmax(torch.randn(*shape, v, generator=gen) * 2, -1)
    else:
        target = torch.randint(0, v, shape, generator=gen)
        ign = torch.rand(shape, generator=gen) < ignore_frac
        target = torch.where(ign, torch.full_like(target, ignore_index), target)
    cast = (lambda t: None if t is None else t.to(dtype))
    return cast(x), cast(w), cast(b), target


def transform(raw, scale=1.0, softcap=None):
    z = raw * scale if scale != 1.0 else raw
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return z


def term_scale(raw64, target, upstream, zrow, *, class_weight=None, token_weight=None, ignore_index=-100,
               reduction="mean", label_smoothing=0.0, scale=1.0, softcap=None, lse_square_scale=0.0):
    """Magnitude of the terms of the gradient w.r.t. the raw logits (N x V, fp64), for the tolerance.

    Row i's gradient is ``dz/dx * (a_i p_ij - b_i [j == y_i] - c_i q_ij w_j)``, ``q`` the (smoothed) target
    distribution; ``a, b, c <= A_i = |upstream_i| tw_i (max w + 2 s |lse_i|) / denominator``. The p term
    carries the rounding of the logits and of the lse (``zrow``: the row's |logit| bound); the tanh of a
    soft-cap the absolute rounding of ``1 - t^2`` (so ``scale`` alone, not ``scale (1 - t^2)``)."""
    z = transform(raw64, scale, softcap)
    v = z.shape[-1]
    z2 = z.reshape(-1, v)
    p = torch.softmax(z2, -1)
    lse = torch.logsumexp(z2, -1)
    soft = target.is_floating_point()
    n = z2.shape[0]
    wmax = class_weight.double().abs().max().item() if class_weight is not None else 1.0
    tw = token_weight.double().abs().reshape(-1) if token_weight is not None else torch.ones(n, dtype=torch.float64)
    if soft:
        valid = torch.ones(n, dtype=torch.bool)
        q = (1 - label_smoothing) * target.reshape(-1, v).double() + label_smoothing / v
    else:
        t = target.reshape(-1)
        valid = t != ignore_index
        q = F.one_hot(torch.where(valid, t, 0), v).double() + label_smoothing / v
    den = 1.0
    if reduction == "mean":
        den = (tw * valid).sum().item()
        if class_weight is not None and not soft:
            den = min(den, (tw * class_weight.double().abs()[torch.where(valid, t, 0)] * valid).sum().item())
        den = den if den > 0 else 1.0
    u = upstream.double().abs().reshape(-1) if upstream.dim() else upstream.double().abs()
    a = u * tw * valid * (wmax + 2 * lse_square_scale * lse.abs()) / den
    return (a[:, None] * (p * (1 + zrow.reshape(-1, 1)) + q) * abs(scale)).reshape(raw64.shape)


def reference(x, w, b, target, *, class_weight=None, token_weight=None, ignore_index=-100, reduction="mean",
              label_smoothing=0.0, scale=1.0, softcap=None, lse_square_scale=0.0, keep=None):
    """Plain torch, in the tensors' dtype: ``F.cross_entropy(F.linear(...))`` plus the documented formulas
    for the options torch lacks (token_weight, z-loss)."""
    raw = F.linear(x, w, b)
    if keep is not None and raw.requires_grad:
        raw.retain_grad()
        keep["raw"] = raw
    return ce_reference(raw, target, class_weight=class_weight, token_weight=token_weight,
                        ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing,
                        scale=scale, softcap=softcap, lse_square_scale=lse_square_scale)


def ce_reference(raw, target, *, class_weight=None, token_weight=None, ignore_index=-100, reduction="mean",
                 label_smoothing=0.0, scale=1.0, softcap=None, lse_square_scale=0.0):
    """The documented semantics on logits ``raw`` (classes last):

    loss_i = tw_i * torch's unreduced cross-entropy of row i (0 on ignored rows);
    mean = sum_i loss_i / sum_{valid i} tw_i * w_{y_i} (soft targets: / sum_i tw_i);
    z-loss: lse_square_scale * tw_i * lse_i^2 on valid rows, summed, or divided by sum_{valid} tw_i; added.
    """
    z = transform(raw, scale, softcap)
    v = z.shape[-1]
    soft = target.is_floating_point()
    lead = tuple(z.shape[:-1])
    z2 = z.reshape(-1, v)
    t2 = target.reshape(-1, v).to(z.dtype) if soft else target.reshape(-1)
    cw = None if class_weight is None else class_weight.to(z.dtype)
    kw = dict(weight=cw, ignore_index=ignore_index, label_smoothing=label_smoothing)
    if token_weight is None and not lse_square_scale:
        out = F.cross_entropy(z2, t2, reduction=reduction, **kw)
        return out.reshape(lead) if reduction == "none" else out
    rows = F.cross_entropy(z2, t2, reduction="none", **kw)
    valid = torch.ones(z2.shape[0], dtype=torch.bool) if soft else t2 != ignore_index
    tw = torch.ones_like(rows) if token_weight is None else token_weight.reshape(-1).to(rows.dtype)
    rows = rows * tw
    if soft or cw is None:
        den = (tw * valid).sum()
    else:
        den = (tw * cw[torch.where(valid, t2, 0)] * valid).sum()
    zrows = None
    if lse_square_scale:
        lse = torch.logsumexp(z2, -1)
        zrows = torch.where(valid, lse_square_scale * lse * lse * tw, 0.0)
    if reduction == "none":
        return (rows if zrows is None else rows + zrows).reshape(lead)
    if reduction == "sum":
        return rows.sum() + (zrows.sum() if zrows is not None else 0.0)
    loss = rows.sum() / den
    if zrows is not None:
        loss = loss + zrows.sum() / (tw * valid).sum()
    return loss


def _grads(fn, tensors, upstream):
    """Run ``fn(*tensors)`` (fresh leaves), backward with ``upstream(loss)``; -> (loss, grads, keep)."""
    leaves = [None if t is None else t.detach().clone().requires_grad_(t.is_floating_point()) for t in tensors]
    keep = {}
    out = fn(*leaves, keep)
    loss = out[0] if isinstance(out, tuple) else out
    want = [t for t in leaves if t is not None and t.requires_grad]
    gs = torch.autograd.grad(loss, want, upstream(loss), allow_unused=True) if want else []
    it = iter(gs)
    grads = [None if (t is None or not t.requires_grad) else next(it) for t in leaves]
    return loss.detach(), grads, keep


def upstream_for(seed=7):
    def up(loss):
        if loss.dim() == 0:
            return torch.tensor(1.375, dtype=loss.dtype)
        g = torch.Generator().manual_seed(seed)
        return torch.randn(loss.shape, generator=g).to(loss.dtype)
    return up


def check_linear(x, w, b, target, *, dtype=None, chunk_bytes=None, loss_ulps=4.0, grad_ulps=4.0, result=None,
                 **opts):
    """Ours vs torch (input dtype) vs gold (fp64): loss and the gradients of x, w, b.

    ``result``: ours computed elsewhere, ``(loss, [grad_input, grad_weight, grad_bias])`` for the upstream
    gradient of :func:`upstream_for` (the vocabulary-parallel tests run ours in other processes)."""
    precision = x.dtype
    cw, tw = opts.get("class_weight"), opts.get("token_weight")
    red = opts.get("reduction", "mean")
    up = upstream_for()

    def ours(x_, w_, b_, keep):
        return LCE(x_, w_, target, bias=b_, dtype=dtype, chunk_bytes=chunk_bytes, **opts)

    def theirs(x_, w_, b_, keep):
        out = reference(x_, w_, b_, target, keep=keep, **opts)
        return out.to(dtype) if dtype is not None else out

    def gold(x_, w_, b_, keep):
        o = dict(opts)
        for k in ("class_weight", "token_weight"):
            if o.get(k) is not None:
                o[k] = o[k].double()
        return reference(x_, w_, b_, target.double() if target.is_floating_point() else target, keep=keep, **o)

    lo, go, _ = _grads(ours, (x, w, b), up) if result is None else (result[0], list(result[1]), None)
    lt, gt, _ = _grads(theirs, (x, w, b), up)
    lg, gg, keep = _grads(gold, tuple(None if t is None else t.double() for t in (x, w, b)), up)
    # half inputs: our loss is fp32 by default (CCE's, Liger's), sharded or not; an explicit dtype's is torch's
    want = lt.dtype if (dtype is not None or precision not in HALF) else torch.float32
    assert lo.dtype == want and lo.shape == lt.shape, (lo.dtype, lt.dtype, lo.shape, lt.shape)
    # magnitudes: |logits| bound (dot product |x|.|w| + |b|), the row's log-sum-exp, the gradient of the logits
    x64, w64 = x.double().reshape(-1, x.shape[-1]), w.double()
    zabs = x64.abs() @ w64.abs().t() + (b.double().abs() if b is not None else 0.0)
    zrow = zabs.amax(1, keepdim=True) * abs(opts.get("scale", 1.0)) if zabs.numel() else zabs
    raw64 = F.linear(x64, w64, None if b is None else b.double())
    lse = torch.logsumexp(transform(raw64, opts.get("scale", 1.0), opts.get("softcap")), -1)
    wmax = cw.abs().max().item() if cw is not None else 1.0
    twa = tw.double().abs().reshape(-1) if tw is not None else torch.ones(lse.shape, dtype=torch.float64)
    zs = opts.get("lse_square_scale", 0.0)
    m = (lse.abs() + zrow.squeeze(1)) * (wmax + 2 * zs * lse.abs()) * twa
    if red == "none":
        lscale = m.reshape(lo.shape)
    elif red == "sum":
        lscale = m.sum()
    else:  # a weighted average of the rows (m carries the largest weight)
        lscale = m.max() if m.numel() else m.sum()
    assert_bound(lo, lt, lg, precision=coarsest(precision, lo.dtype), scale=lscale, ulps=loss_ulps, what="loss")
    sg = term_scale(raw64, target, up(lg), zrow, reduction=red,
                    **{k: a for k, a in opts.items() if k != "reduction" and k != "return_lse"})
    sg = torch.maximum(sg, keep["raw"].grad.reshape(-1, w.shape[0]).abs())
    scales = [(sg @ w64.abs()).reshape(x.shape), sg.t() @ x64.abs(), sg.sum(0)]
    for name, a, r, g, s in zip(("grad_input", "grad_weight", "grad_bias"), go, gt, gg, scales):
        if g is None:
            continue
        assert a.dtype == r.dtype, (name, a.dtype, r.dtype)
        assert_bound(a, r, g, precision=precision, scale=s, ulps=grad_ulps, what=name)
    return lo, go


def coarsest(*dtypes):
    return max(dtypes, key=eps)


class _Counter:
    def __init__(self):
        self.calls = {}


@pytest.fixture
def paths(monkeypatch):
    """Counts the calls to the torch-path ops: ``paths.calls['linear_ce_loss']`` etc. (where they are called:
    the public functions in ``api``, the backward ops in ``ops``' autograd)."""
    c = _Counter()
    for module, name in ((ce_api, "linear_ce_loss"), (ce_api, "linear_ce_stats"), (ce_ops, "linear_ce_backward"),
                         (ce_ops, "linear_add_logits_grad_"), (ce_api, "ce_stats"), (ce_ops, "ce_backward")):
        op = getattr(module, name)

        def wrapped(*a, __op=op, __name=name, **k):
            c.calls[__name] = c.calls.get(__name, 0) + 1
            return __op(*a, **k)

        monkeypatch.setattr(module, name, wrapped)
    return c


# --------------------------------------------------------------------------- every option, both paths

OPTIONS = {
    "plain": dict(),
    "no_bias": dict(_bias=False),
    "class_weight": dict(class_weight=True),
    "ignore_0": dict(ignore_index=0),
    "ignore_5": dict(ignore_index=5),
    "ignore_-1": dict(ignore_index=-1),
    "ignore_V+3": dict(ignore_index=V + 3),
    "smoothing": dict(label_smoothing=0.1),
    "smoothing_1": dict(label_smoothing=1.0),
    "smoothing_class_weight": dict(label_smoothing=0.25, class_weight=True),
    "softcap": dict(softcap=3.0),
    "scale": dict(scale=0.5),
    "scale_softcap_all": dict(scale=1.7, softcap=4.0, class_weight=True, label_smoothing=0.1),
    "token_weight": dict(token_weight=True),
    "token_weight_class_weight_smoothing": dict(token_weight=True, class_weight=True, label_smoothing=0.2),
    "z_loss": dict(lse_square_scale=1e-2),
    "z_loss_all": dict(lse_square_scale=0.1, token_weight=True, class_weight=True, label_smoothing=0.1,
                       softcap=5.0),
}


def _options(name, v=V, n=N, seed=3):
    o = dict(OPTIONS[name])
    gen = torch.Generator().manual_seed(seed)
    bias = o.pop("_bias", True)
    if o.get("class_weight"):
        o["class_weight"] = torch.rand(v, generator=gen) + 0.1
    if o.get("token_weight"):
        o["token_weight"] = torch.rand(n, generator=gen) * 2
    return o, bias


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("name", list(OPTIONS))
def test_options_fp32_against_gold(name, reduction, paths):
    o, bias = _options(name)
    x, w, b, t = make_problem(bias=bias, ignore_index=o.get("ignore_index", -100), seed=1)
    check_linear(x, w, b, t, reduction=reduction, chunk_bytes=SMALL_CHUNK, **o)
    if reduction == "none":
        assert paths.calls.get("linear_ce_stats") == 1 and paths.calls.get("linear_ce_backward") == 1
        assert "linear_ce_loss" not in paths.calls
    else:
        # the fused path's backward only scales the gradients the forward computed (no op call)
        assert paths.calls.get("linear_ce_loss") == 1 and "linear_ce_backward" not in paths.calls
        assert "linear_ce_stats" not in paths.calls


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("name", ["plain", "smoothing", "class_weight", "smoothing_class_weight", "token_weight",
                                  "z_loss", "scale_softcap_all"])
def test_soft_targets_against_gold(name, reduction, paths):
    o, bias = _options(name)
    x, w, b, q = make_problem(bias=bias, soft=True, seed=2)
    check_linear(x, w, b, q, reduction=reduction, chunk_bytes=SMALL_CHUNK, **o)
    # soft targets always take the statistics op (also when a gradient is needed)
    assert paths.calls.get("linear_ce_stats") == 1 and "linear_ce_loss" not in paths.calls


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("name", ["plain", "smoothing_class_weight", "scale_softcap_all", "z_loss_all"])
def test_half_inputs_against_gold(name, dtype, reduction):
    o, bias = _options(name)
    x, w, b, t = make_problem(dtype=dtype, bias=bias, seed=4)
    lo, go = check_linear(x, w, b, t, reduction=reduction, chunk_bytes=SMALL_CHUNK, **o)
    assert lo.dtype == torch.float32 and all(g.dtype == dtype for g in go)  # the loss: fp32 by default
    # fp32 math inside, from fp32 logits of the half operands (CCE's numerics, not F.linear's half logits): the
    # loss is torch's fp32 cross-entropy of F.linear on the upcast operands, rounded once
    with torch.no_grad():
        ours = LCE(x, w, t, bias=b, reduction=reduction, **o).double()
        ref32 = ce_reference(F.linear(x.float(), w.float(), None if b is None else b.float()), t,
                             reduction=reduction, **o).double()
    assert ((ours - ref32).abs() <= 8 * eps(torch.float32) * (1 + ref32.abs())).all(), (ours, ref32)


def test_grad_weight_fp32_accumulation_bf16():
    """grad_weight sums N rank-1 terms: fp32 accumulation must be no worse than torch's bf16 (normwise)."""
    x, w, b, t = make_problem((512,), d=16, v=64, dtype=torch.bfloat16, seed=5)
    errs = {}
    for who in ("ours", "torch", "gold"):
        dt = torch.float64 if who == "gold" else torch.bfloat16
        xx, ww, bb = (u.to(dt).requires_grad_() for u in (x, w, b))
        f = LCE(xx, ww, t, bias=bb, reduction="sum") if who == "ours" else \
            F.cross_entropy(F.linear(xx, ww, bb), t, reduction="sum")
        errs[who] = torch.autograd.grad(f, (ww, bb))
    for i, name in enumerate(("grad_weight", "grad_bias")):
        gold = errs["gold"][i]
        e_ours = (errs["ours"][i].double() - gold).norm().item()
        e_torch = (errs["torch"][i].double() - gold).norm().item()
        assert e_ours <= e_torch, (name, e_ours, e_torch)


@pytest.mark.parametrize("dtype,factor,loss_dtype", [
    (torch.float16, 2.0**14, None), (torch.bfloat16, 2.0**14, None),
    (torch.bfloat16, 1 / 3, torch.float32), (torch.float16, 1 / 3, torch.float32),
], ids=["fp16-scaler", "bf16-scaler", "bf16-third-fp32loss", "fp16-third-fp32loss"])
def test_scaled_upstream_gradient_half(dtype, factor, loss_dtype):
    """The fused path computes its gradients for grad_output 1 and scales them in the backward: under a loss
    scaler's 2^14 they must not have underflowed (fp16), and an fp32 grad_output (1/3, from an fp32 loss) must
    not be rounded to the half dtype first. Normwise error no worse than torch's (logits cast to the loss
    dtype: F.cross_entropy(F.linear(...).to(loss_dtype)))."""
    x, w, b, t = make_problem((512,), d=32, v=256, dtype=dtype, ignore_frac=0.0, seed=6)
    res = {}
    for who in ("ours", "torch", "gold"):
        dt = torch.float64 if who == "gold" else dtype
        xx, ww, bb = (u.to(dt).requires_grad_() for u in (x, w, b))
        if who == "ours":
            f = LCE(xx, ww, t, bias=bb, dtype=loss_dtype)
        else:
            f = F.cross_entropy(F.linear(xx, ww, bb).to(loss_dtype or dt), t)
        res[who] = torch.autograd.grad(f, (xx, ww, bb), torch.full_like(f, factor))
    for i, name in enumerate(("grad_input", "grad_weight", "grad_bias")):
        gold = res["gold"][i]
        e_ours = (res["ours"][i].double() - gold).norm() / gold.norm()
        e_torch = (res["torch"][i].double() - gold).norm() / gold.norm()
        assert e_ours <= 1.05 * e_torch, (name, e_ours.item(), e_torch.item())
        # no more flushed to zero than torch's (fp16 subnormals: a 1/3 of p / N may legitimately be 0)
        assert (res["ours"][i] == 0).sum() <= (res["torch"][i] == 0).sum(), name


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_batched_input_bt(reduction, paths):
    """(B, T, D) input with (B, T) targets: reduction none keeps (B, T); lse has (B, T)."""
    x, w, b, t = make_problem((3, 7), seed=8)
    o, _ = _options("token_weight", n=21)
    o["token_weight"] = o["token_weight"].reshape(3, 7)
    lo, _ = check_linear(x, w, b, t, reduction=reduction, **o)
    assert lo.shape == ((3, 7) if reduction == "none" else ())
    with torch.no_grad():
        out = LCE(x, w, t, bias=b, reduction=reduction, return_lse=True)
    assert out.lse.shape == (3, 7)
    torch.testing.assert_close(out.lse, torch.logsumexp(F.linear(x, w, b), -1), rtol=1e-6, atol=1e-5)


def test_three_dim_soft_targets():
    x, w, b, q = make_problem((2, 5), soft=True, seed=9)
    check_linear(x, w, b, q, reduction="none", label_smoothing=0.1)


# --------------------------------------------------------------------------- which path runs


@pytest.mark.parametrize("case,expect", [
    (dict(reduction="mean"), "fused"),
    (dict(reduction="sum", label_smoothing=0.1, lse_square_scale=1e-3), "fused"),
    (dict(reduction="none"), "stats"),
    (dict(reduction="mean", return_lse=True), "stats"),
    (dict(reduction="mean", grad=False), "stats"),
    (dict(reduction="mean", soft=True), "stats"),
    (dict(reduction="mean", token_weight_grad=True), "stats"),
])
def test_path_selection(case, expect, paths):
    case = dict(case)
    x, w, b, t = make_problem(soft=case.pop("soft", False), seed=10)
    grad = case.pop("grad", True)
    if case.pop("token_weight_grad", False):
        case["token_weight"] = torch.rand(N, requires_grad=True)
    x.requires_grad_(grad)
    out = LCE(x, w, t, bias=b, **case)
    loss = out[0] if isinstance(out, tuple) else out
    if expect == "fused":
        assert paths.calls == {"linear_ce_loss": 1}
    else:
        assert paths.calls == {"linear_ce_stats": 1}
    if grad:
        loss.sum().backward()
        if expect == "fused":
            assert "linear_ce_backward" not in paths.calls  # gradients came from the forward
        else:
            assert paths.calls.get("linear_ce_backward") == 1


# --------------------------------------------------------------------------- options, one by one


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("fn", ["linear", "plain"])
def test_z_loss_value_and_return(fn, reduction):
    """z-loss = s * lse^2 per valid token, reduced like the loss (mean over valid tokens, not weighted by the
    class weight); loss = ce + z; return_z_loss gives it detached; s = 0 adds nothing."""
    x, w, b, t = make_problem(seed=11)
    cw = torch.rand(V) + 0.5
    s = 0.05
    x.requires_grad_()

    def call(**kw):
        if fn == "linear":
            return LCE(x, w, t, bias=b, class_weight=cw, reduction=reduction, **kw)
        return CE(F.linear(x, w, b), t, cw, reduction=reduction, **kw)

    out = call(lse_square_scale=s, return_z_loss=True)
    plain = call()
    plain0 = call(lse_square_scale=0.0)
    valid = t != -100
    lse = torch.logsumexp(F.linear(x, w, b).double(), -1)
    rows = torch.where(valid, s * lse * lse, 0.0)
    want = {"none": rows, "sum": rows.sum(), "mean": rows.sum() / valid.sum()}[reduction]
    torch.testing.assert_close(out.z_loss.double(), want, rtol=2e-6, atol=1e-6)
    assert not out.z_loss.requires_grad and out.lse is None
    torch.testing.assert_close(out.loss, plain + out.z_loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(plain0, plain, rtol=0, atol=0)  # not added when lse_square_scale == 0
    ce_only = F.cross_entropy(F.linear(x, w, b).double(), t, cw.double(), reduction=reduction)
    torch.testing.assert_close(plain.double(), ce_only, rtol=2e-6, atol=1e-6)
    z0 = call(return_z_loss=True)
    assert torch.equal(z0.z_loss, torch.zeros_like(z0.loss)) and torch.equal(z0.loss, plain)
    # gradient of the z-loss part: d/dx of s*lse^2
    g = torch.autograd.grad(out.loss.sum(), x)[0]
    x64 = x.detach().double().requires_grad_()
    ref = reference(x64, w.double(), b.double(), t, class_weight=cw.double(), reduction=reduction,
                    lse_square_scale=s)
    torch.testing.assert_close(g.double(), torch.autograd.grad(ref.sum(), x64)[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_token_weight_formula(reduction):
    """loss_i = tw_i * w_{y_i} * nll_i; mean divides by sum over valid tokens of tw_i * w_{y_i}."""
    x, w, b, t = make_problem((6,), d=4, v=5, seed=12)
    t = torch.tensor([0, 3, -100, 4, 4, 1])
    tw = torch.tensor([0.5, 2.0, 7.0, 1.0, 0.0, 3.0])
    cw = torch.tensor([1.0, 2.0, 0.5, 3.0, 0.25])
    z = F.linear(x, w, b).double()
    nll = torch.logsumexp(z, 1) - z.gather(1, t.clamp(min=0)[:, None]).squeeze(1)
    valid = t != -100
    rows = torch.where(valid, tw.double() * cw.double()[t.clamp(min=0)] * nll, 0.0)
    den = torch.where(valid, tw.double() * cw.double()[t.clamp(min=0)], 0.0).sum()
    want = {"none": rows, "sum": rows.sum(), "mean": rows.sum() / den}[reduction]
    for grad in (False, True):
        got = LCE(x.requires_grad_(grad), w, t, bias=b, token_weight=tw, class_weight=cw, reduction=reduction)
        torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)
        got = CE(z.float(), t, cw, token_weight=tw, reduction=reduction)
        torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("fn", ["linear", "plain"])
def test_token_weight_gradient(fn, reduction):
    """A token_weight that requires grad gets its gradient, also where the fused op would run (it has none
    for token_weight: the stats path runs)."""
    x, w, b, t = make_problem(seed=13)
    x.requires_grad_()
    tw = (torch.rand(N) + 0.5).requires_grad_()
    if fn == "linear":
        out = LCE(x, w, t, bias=b, token_weight=tw, reduction=reduction, lse_square_scale=0.01)
    else:
        out = CE(F.linear(x, w, b), t, token_weight=tw, reduction=reduction, lse_square_scale=0.01)
    g = torch.autograd.grad(out.sum(), (tw, x))
    tw64, x64 = tw.detach().double().requires_grad_(), x.detach().double().requires_grad_()
    ref = reference(x64, w.double(), b.double(), t, token_weight=tw64, reduction=reduction, lse_square_scale=0.01)
    for a, c in zip(g, torch.autograd.grad(ref.sum(), (tw64, x64))):
        torch.testing.assert_close(a.double(), c, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fn", ["linear", "plain"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("opts", [dict(), dict(scale=0.8, softcap=4.0)], ids=["plain", "softcap"])
def test_return_lse_values_and_gradient(fn, reduction, opts):
    """lse equals torch.logsumexp of the (transformed) logits, for every row (ignored ones too), in fp32;
    a loss that uses it gets the right gradients."""
    x, w, b, t = make_problem(seed=14)

    def ours(x_, w_, b_, keep):
        if fn == "linear":
            out = LCE(x_, w_, t, bias=b_, reduction=reduction, return_lse=True, **opts)
        else:
            out = CE(F.linear(x_, w_, b_), t, reduction=reduction, return_lse=True, **opts)
        return out.loss.sum() + 0.1 * out.lse.square().sum(), out.lse

    def ref(x_, w_, b_, keep):
        raw = F.linear(x_, w_, b_)
        if raw.requires_grad:
            raw.retain_grad()
            keep["raw"] = raw
        lse = torch.logsumexp(transform(raw, **opts), -1)
        return ce_reference(raw, t, reduction=reduction, **opts).sum() + 0.1 * lse.square().sum(), lse

    up = upstream_for()
    lo, go, _ = _grads(ours, (x, w, b), up)
    lt, gt, _ = _grads(ref, (x, w, b), up)
    lg, gg, keep = _grads(ref, (x.double(), w.double(), b.double()), up)
    with torch.no_grad():
        lse_o = ours(x, w, b, {})[1]
        lse_t, lse_g = ref(x, w, b, {})[1], ref(x.double(), w.double(), b.double(), {})[1]
    assert lse_o.dtype == torch.float32 and lse_o.shape == (N,)
    zrow = (x.double().abs() @ w.double().abs().t() + b.double().abs()).amax(1)
    assert_bound(lse_o, lse_t, lse_g, precision=torch.float32, scale=zrow, what="lse")
    assert_bound(lo, lt, lg, precision=torch.float32, scale=(lse_g.abs() + zrow).square().sum(), what="loss")
    G = keep["raw"].grad.abs() * (1 + zrow[:, None])
    for name, a, r, g, s in zip(("grad_input", "grad_weight", "grad_bias"), go, gt, gg,
                                (G @ w.double().abs(), G.t() @ x.double().abs(), G.sum(0))):
        assert_bound(a, r, g, precision=torch.float32, scale=s, what=name)


@pytest.mark.parametrize("in_dtype,out_dtype", [(torch.bfloat16, torch.float32), (torch.float16, torch.float32),
                                                (torch.float32, torch.float64), (torch.float32, torch.bfloat16)],
                         ids=str)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_dtype_argument(in_dtype, out_dtype, reduction):
    """``dtype=`` sets the loss's dtype; torch's equivalent is the cross-entropy of the logits cast to it."""
    x, w, b, t = make_problem(dtype=in_dtype, seed=15)
    lo, go = check_linear(x, w, b, t, dtype=out_dtype, reduction=reduction, label_smoothing=0.1)
    assert lo.dtype == out_dtype and go[0].dtype == in_dtype


# --------------------------------------------------------------------------- edge cases


@pytest.mark.parametrize("opts", [dict(), dict(label_smoothing=0.1), dict(class_weight=True),
                                  dict(lse_square_scale=0.01), dict(token_weight=True)],
                         ids=["plain", "smoothing", "class_weight", "z_loss", "token_weight"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("fn", ["linear", "plain"])
def test_all_targets_ignored(fn, reduction, opts):
    """mean over zero valid targets: NaN with zero gradients (as torch); sum: 0; none: zeros."""
    x, w, b, _ = make_problem(seed=16)
    t = torch.full((N,), -100)
    o = dict(opts)
    if o.get("class_weight"):
        o["class_weight"] = torch.rand(V)
    if o.get("token_weight"):
        o["token_weight"] = torch.rand(N)
    xx, ww, bb = (u.clone().requires_grad_() for u in (x, w, b))
    if fn == "linear":
        loss = LCE(xx, ww, t, bias=bb, reduction=reduction, **o)
    else:
        loss = CE(F.linear(xx, ww, bb), t, o.get("class_weight"), reduction=reduction,
                  **{k: v for k, v in o.items() if k != "class_weight"})
    tl = F.cross_entropy(F.linear(x, w, b), t, o.get("class_weight"), reduction=reduction,
                         label_smoothing=o.get("label_smoothing", 0.0))
    if reduction == "mean":
        assert loss.isnan()
    else:
        assert torch.equal(loss.detach(), torch.zeros_like(tl)), loss
    torch.testing.assert_close(loss.detach(), tl, equal_nan=True)
    for g in torch.autograd.grad(loss.sum(), (xx, ww, bb)):
        assert torch.equal(g, torch.zeros_like(g))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("soft", [False, True])
def test_empty_input(reduction, soft):
    w = torch.randn(V, D, requires_grad=True)
    b = torch.randn(V, requires_grad=True)
    x = torch.randn(0, D, requires_grad=True)
    t = torch.rand(0, V) if soft else torch.zeros(0, dtype=torch.long)
    for fn in ("linear", "plain"):
        loss = LCE(x, w, t, bias=b, reduction=reduction) if fn == "linear" else \
            CE(F.linear(x, w, b), t, reduction=reduction)
        ref = F.cross_entropy(F.linear(x, w, b), t, reduction=reduction)
        assert loss.shape == ref.shape and loss.dtype == ref.dtype
        torch.testing.assert_close(loss.detach(), ref.detach(), equal_nan=True)
        gx, gw, gb = torch.autograd.grad(loss.sum(), (x, w, b))
        assert gx.shape == (0, D) and torch.equal(gw, torch.zeros_like(w)) and torch.equal(gb, torch.zeros_like(b))
        with torch.no_grad():
            torch.testing.assert_close(LCE(x, w, t, bias=b, reduction=reduction), ref.detach(), equal_nan=True)


def _collapse_logits(n, v, dtype, seed):
    """Logits ~1e3 whose target exceeds the others by 20..40 (fp32) / 8..12 (bf16): p_target rounds to 1."""
    gen = torch.Generator().manual_seed(seed)
    t = torch.randint(0, v, (n,), generator=gen)
    lo, hi = (20.0, 40.0) if dtype == torch.float32 else (8.0, 12.0)
    z = 1000.0 - lo - (hi - lo) * torch.rand(n, v, generator=gen)
    z[torch.arange(n), t] = 1000.0
    return z.to(dtype), t


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("reduction", ["sum", "none"])
def test_softmax_collapse_cross_entropy(dtype, reduction):
    """Target dominates: torch's ``p_y - 1`` rounds to 0; ours is ``-sum_{j != y} p_j``: non-zero, matches the
    gold to a few ulps, and each row's gradient sums to ~0."""
    z, t = _collapse_logits(16, 64, dtype, seed=17)
    zz = z.clone().requires_grad_()
    g = torch.autograd.grad(CE(zz, t, reduction=reduction).sum(), zz)[0]
    z64 = z.double().requires_grad_()
    g64 = torch.autograd.grad(F.cross_entropy(z64, t, reduction=reduction).sum(), z64)[0]
    gt = torch.autograd.grad(F.cross_entropy(zz, t, reduction=reduction).sum(), zz)[0]
    rows = torch.arange(16)
    gy, gy64 = g[rows, t].double(), g64[rows, t]
    assert (gy < 0).all() and (gy64 < 0).all()
    torch.testing.assert_close(gy, gy64, rtol=4 * eps(dtype), atol=0)
    rowsum = g.double().sum(1)
    assert (rowsum.abs() <= 4 * eps(dtype) * g.double().abs().sum(1)).all(), rowsum
    assert_bound(g, gt, g64, precision=dtype, what="grad_logits")
    if dtype == torch.float32:
        assert (gt[rows, t] == 0).all()  # torch fails here: the case is real


def test_softmax_collapse_linear():
    """Same through the linear op: x one-hot, so grad_weight[y_i, i] is row i's target gradient."""
    n, v = 16, 50
    zc, t = _collapse_logits(n, v, torch.float32, seed=18)
    x = torch.eye(n)
    w = zc.t().contiguous()  # (v, n): logits = x @ w.T = zc
    for reduction in ("sum", "mean"):
        for soft_path in (False, True):  # fused, and stats (reduction none summed)
            xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
            loss = LCE(xx, ww, t, reduction="none").sum() if soft_path else LCE(xx, ww, t, reduction=reduction)
            gw = torch.autograd.grad(loss, ww)[0]
            x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
            gw64 = torch.autograd.grad(F.cross_entropy(F.linear(x64, w64), t, reduction="sum" if soft_path
                                                       else reduction), w64)[0]
            rows = torch.arange(n)
            torch.testing.assert_close(gw[t, rows].double(), gw64[t, rows], rtol=1e-5, atol=0)
            assert (gw[t, rows] < 0).all()
            colsum = gw.double().sum(0)  # column i = row i's logits gradient: sums to ~0
            assert (colsum.abs() <= 1e-5 * gw.double().abs().sum(0)).all()


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_neg_inf_logits_like_torch(reduction, dtype):
    """Rows of -inf (NaN loss), partly -inf rows, a -inf target logit (inf loss), an ignored -inf row."""
    gen = torch.Generator().manual_seed(19)
    z = torch.randn(6, 9, generator=gen)
    z[1] = float("-inf")
    z[2, :4] = float("-inf")
    z[3, 5] = float("-inf")
    z[4] = float("-inf")
    z = z.to(dtype)
    t = torch.tensor([0, 1, 6, 5, -100, 2])
    zz = z.clone().requires_grad_()
    ours = CE(zz, t, reduction=reduction)
    g = torch.autograd.grad(ours.sum(), zz)[0]
    ref = F.cross_entropy(zz, t, reduction=reduction)
    gt = torch.autograd.grad(ref.sum(), zz)[0]
    torch.testing.assert_close(ours, ref, equal_nan=True)
    torch.testing.assert_close(g, gt, equal_nan=True)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_masked_vocabulary_bias_neg_inf(reduction):
    """-inf bias entries (a masked vocabulary): zero probability, zero gradient there; both paths."""
    x, w, b, t = make_problem(seed=20)
    b[::7] = float("-inf")
    t = torch.where(t % 7 == 0, 1, t)  # no target on a masked class
    out = check_linear(x, w, b, t, reduction=reduction)
    assert torch.isfinite(out[0]).all()


def test_nan_propagates():
    x, w, b, t = make_problem(seed=21, ignore_frac=0.0)
    x[3, 2] = float("nan")
    for reduction in ("none", "mean"):
        for grad in (False, True):
            loss = LCE(x.clone().requires_grad_(grad), w, t, bias=b, reduction=reduction)
            ref = F.cross_entropy(F.linear(x, w, b), t, reduction=reduction)
            assert torch.equal(loss.isnan(), ref.isnan()) and loss.isnan().any()
    zz = F.linear(x, w, b).detach().requires_grad_()
    g = torch.autograd.grad(CE(zz, t, reduction="sum"), zz)[0]
    gt = torch.autograd.grad(F.cross_entropy(zz, t, reduction="sum"), zz)[0]
    assert torch.equal(g.isnan(), gt.isnan()) and g[3].isnan().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_chunking(dtype, reduction, monkeypatch):
    """chunk_bytes of 3 rows of the accumulation dtype: 13 chunks of N=37 rows (the last one partial; the fused
    path of reduction mean chunks the non-ignored rows only); results equal the one-chunk run to rounding."""
    x, w, b, t = make_problem(dtype=dtype, seed=22)
    calls = []

    def spy(module, name):
        real = getattr(module, name)

        def counting(*a, **k):
            out = real(*a, **k)
            calls.append(out.shape[0])
            return out

        monkeypatch.setattr(module, name, counting)

    spy(ce_chunked, "chunk_logits")  # the statistics path (reduction none): forward and backward
    spy(ce_fused, "transform_logits_")  # the fused path (mean): once per chunk of the non-ignored rows
    rows = N if reduction == "none" else int((t != -100).sum())
    res = []
    for cb in (torch.finfo(dtype).bits // 8 * V * 3, None):
        calls.clear()
        xx, ww, bb = (u.clone().requires_grad_() for u in (x, w, b))
        loss = LCE(xx, ww, t, bias=bb, reduction=reduction, label_smoothing=0.1, chunk_bytes=cb)
        fwd = list(calls)
        res.append((loss.detach(), *torch.autograd.grad(loss.sum(), (xx, ww, bb))))
        if cb is not None:
            assert fwd == [3] * (rows // 3) + [rows % 3] * (rows % 3 > 0), fwd
            if reduction == "none":  # the backward recomputes the logits chunk by chunk
                assert calls[len(fwd):] == fwd
        else:
            assert fwd == [rows]
    tol = dict(rtol=8 * eps(dtype), atol=8 * eps(dtype))
    for a, c in zip(res[0], res[1]):
        torch.testing.assert_close(a, c, **tol)


# --------------------------------------------------------------------------- errors


def test_out_of_range_target_raises():
    x, w, b, _ = make_problem((4,), seed=23)
    for bad in (V, -1, 10**6):
        t = torch.tensor([0, 1, bad, 2])
        with pytest.raises(IndexError):
            F.cross_entropy(F.linear(x, w, b), t)  # torch on CPU
        for grad, reduction in ((True, "mean"), (True, "sum"), (True, "none"), (False, "mean")):
            with pytest.raises(IndexError, match="out of bounds"):
                LCE(x.clone().requires_grad_(grad), w, t, bias=b, reduction=reduction)
        with pytest.raises(IndexError, match="out of bounds"):
            CE(F.linear(x, w, b), t)
    # the ignored value itself is fine whatever its sign or range
    for ii in (-1, V, 10**6):
        t = torch.tensor([0, 1, ii, 2])
        torch.testing.assert_close(LCE(x, w, t, bias=b, ignore_index=ii),
                                   F.cross_entropy(F.linear(x, w, b), t, ignore_index=ii))


def test_out_of_range_target_raises_under_compile():
    x, w, b, t = make_problem((8,), d=4, v=11, seed=24)

    def f(x, w, b, t):
        return LCE(x, w, t, bias=b, label_smoothing=0.1)

    cf = torch.compile(f, fullgraph=True, backend="inductor")
    xx = x.clone().requires_grad_()
    cf(xx, w, b, t).backward()  # compiles; fine
    t_bad = t.clone()
    t_bad[3] = 11
    with pytest.raises(IndexError, match="out of bounds"):
        cf(xx, w, b, t_bad)


def test_argument_errors():
    x, w, b, t = make_problem((4,), d=3, v=5, seed=25)
    with pytest.raises(ValueError, match="disagree on D"):
        LCE(x, torch.randn(5, 4), t)
    with pytest.raises(TypeError, match="same dtype"):
        LCE(x, w.double(), t)
    with pytest.raises(TypeError, match="dtype of input"):
        LCE(x, w, t, bias=b.double())
    with pytest.raises(TypeError, match="floating point"):
        LCE(x.long(), w, t)
    with pytest.raises(ValueError, match=r"shape \(5,\)"):
        LCE(x, w, t, bias=torch.randn(4))
    with pytest.raises(ValueError, match=r"weight must be \(V, D\)"):
        LCE(x, torch.randn(3), t)
    for fn in (lambda **k: LCE(x, w, t, **k), lambda **k: CE(F.linear(x, w), t, **k)):
        with pytest.raises(ValueError, match="reduction must be"):
            fn(reduction="avg")
        for ls in (-0.1, 1.5, float("nan")):
            with pytest.raises(ValueError, match=r"label_smoothing must be in \[0, 1\]"):
                fn(label_smoothing=ls)
        for cap in (0.0, -1.0, float("inf")):
            with pytest.raises(ValueError, match="softcap must be"):
                fn(softcap=cap)
        with pytest.raises(ValueError, match="lse_square_scale"):
            fn(lse_square_scale=-1.0)
        with pytest.raises(TypeError, match="ignore_index must be an int"):
            fn(ignore_index=1.5)
        with pytest.raises(TypeError, match="dtype must be a floating point dtype"):
            fn(dtype=torch.int64)
        with pytest.raises(ValueError, match="token_weight must have one weight per target"):
            fn(token_weight=torch.ones(3))
    for cw in (torch.ones(4), torch.ones(5, 1)):
        with pytest.raises(ValueError, match=r"class_weight must be a tensor of shape \(5,\)"):
            LCE(x, w, t, class_weight=cw)
        with pytest.raises(ValueError, match=r"class_weight must be a tensor of shape \(5,\)"):
            CE(F.linear(x, w), t, cw)
    with pytest.raises(TypeError, match="class_weight must be floating point"):
        LCE(x, w, t, class_weight=torch.ones(5, dtype=torch.long))
    with pytest.raises(NotImplementedError, match="probability targets"):
        LCE(x, w, torch.rand(4, 5, requires_grad=True))
    with pytest.raises(NotImplementedError, match="probability targets"):
        CE(torch.randn(4, 5), torch.rand(4, 5, requires_grad=True))
    # as F.cross_entropy: class weights are not differentiable (torch raises a RuntimeError)
    with pytest.raises(RuntimeError):
        F.cross_entropy(torch.randn(4, 5), t, torch.rand(5, requires_grad=True))
    with pytest.raises(RuntimeError, match="class_weight"):
        LCE(x, w, t, class_weight=torch.rand(5, requires_grad=True))
    with pytest.raises(RuntimeError, match="class_weight"):
        CE(torch.randn(4, 5), t, torch.rand(5, requires_grad=True))
    with torch.no_grad():  # fine without a gradient
        LCE(x, w, t, class_weight=torch.rand(5, requires_grad=True))
    with pytest.raises(ValueError, match="does not match"):
        LCE(x, w, t[:3])
    with pytest.raises(ValueError, match="probability targets must have shape"):
        LCE(x, w, torch.rand(4, 4))
    with pytest.raises(TypeError, match="class indices"):
        LCE(x, w, t > 0)
    with pytest.raises(TypeError, match="target must be a Tensor"):
        CE(torch.randn(4, 5), [0, 1, 2, 3])
    with pytest.raises(TypeError, match="input must be a Tensor"):
        LCE([1.0], w, t)
    with pytest.raises(RuntimeError, match="same device"):
        LCE(x, w, t.to("meta"))
    with pytest.raises(IndexError, match="Dimension out of range"):
        CE(torch.randn(4, 5), t, dim=2)


# --------------------------------------------------------------------------- cross_entropy (logits given)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("name", ["plain", "smoothing_class_weight", "scale_softcap_all", "ignore_5", "soft"])
def test_cross_entropy_against_gold(name, reduction, dtype):
    soft = name == "soft"
    o, _ = _options("smoothing_class_weight" if soft else name)
    gen = torch.Generator().manual_seed(26)
    z = (torch.randn(N, V, generator=gen) * 3).to(dtype)
    if soft:
        t = torch.softmax(torch.randn(N, V, generator=gen), -1)
    else:
        t = torch.randint(0, V, (N,), generator=gen)
        t[torch.rand(N, generator=gen) < 0.2] = o.get("ignore_index", -100)
    cw = o.pop("class_weight", None)
    up = upstream_for()

    def ours(z_, keep):
        return CE(z_, t, cw, reduction=reduction, chunk_bytes=SMALL_CHUNK, **o)

    def ref(z_, keep):
        c = None if cw is None else cw.to(z_.dtype)
        return ce_reference(z_, t.to(z_.dtype) if soft else t, class_weight=c, reduction=reduction, **o)

    lo, (go,), _ = _grads(ours, (z,), up)
    lt, (gt,), _ = _grads(ref, (z,), up)
    lg, (gg,), _ = _grads(ref, (z.double(),), up)
    zrow = z.double().abs().amax(1) * o.get("scale", 1.0)
    m = 2 * zrow * (cw.max().item() if cw is not None else 1.0)
    lscale = {"none": m, "sum": m.sum(), "mean": m.max()}[reduction]
    assert lo.dtype == lt.dtype == dtype and go.dtype == dtype
    assert_bound(lo, lt, lg, precision=dtype, scale=lscale, what="loss")
    sg = term_scale(z.double(), t, up(lg), zrow, class_weight=cw, reduction=reduction, **o)
    assert_bound(go, gt, gg, precision=dtype, scale=torch.maximum(sg, gg.abs()), what="grad_logits")


def test_cross_entropy_dims_like_torch():
    """(N, C, d1, d2) logits: classes on dim 1 by default, as F.cross_entropy; dim=-1 for (B, T, V)."""
    gen = torch.Generator().manual_seed(27)
    z = torch.randn(2, 5, 5, 3, generator=gen, requires_grad=True)  # C == d1: a wrong dim would not raise
    t = torch.randint(0, 5, (2, 5, 3), generator=gen)
    q = torch.softmax(torch.randn(2, 5, 5, 3, generator=gen), 1)
    for target in (t, q):
        for reduction in ("mean", "none"):
            ours, ref = CE(z, target, reduction=reduction), F.cross_entropy(z, target, reduction=reduction)
            torch.testing.assert_close(ours, ref)
            torch.testing.assert_close(torch.autograd.grad(ours.sum(), z)[0], torch.autograd.grad(ref.sum(), z)[0])
    zl = torch.randn(2, 4, 7, generator=gen)  # (B, T, V)
    tl = torch.randint(0, 7, (2, 4), generator=gen)
    torch.testing.assert_close(CE(zl, tl, dim=-1, reduction="none"),
                               F.cross_entropy(zl.transpose(1, 2), tl, reduction="none"))
    # 1-d logits, a permuted (non-contiguous) input
    torch.testing.assert_close(CE(zl[0, 0], tl[0, 0]), F.cross_entropy(zl[0, 0], tl[0, 0]))
    zp = torch.randn(7, 6, generator=gen).t()
    tp = torch.randint(0, 7, (6,), generator=gen)
    torch.testing.assert_close(CE(zp, tp, label_smoothing=0.1), F.cross_entropy(zp, tp, label_smoothing=0.1))
    # int32 / int16 class indices
    for dt in (torch.int32, torch.int16):
        torch.testing.assert_close(CE(zp, tp.to(dt)), F.cross_entropy(zp, tp))
        torch.testing.assert_close(LCE(zp, torch.eye(7), tp.to(dt)), F.cross_entropy(zp, tp))


# --------------------------------------------------------------------------- autocast


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("fn", ["linear", "plain"])
def test_autocast_bf16_like_torch(fn, reduction):
    """Under CPU autocast (bf16) with fp32 parameters: same dtypes as torch (fp32 loss and gradients) and
    no worse than torch against the gold of the bf16-cast operands."""
    x, w, b, t = make_problem(seed=28)
    up = upstream_for()

    def ours(x_, w_, b_, keep):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if fn == "linear":
                return LCE(x_, w_, t, bias=b_, reduction=reduction, label_smoothing=0.1)
            return CE(F.linear(x_, w_, b_), t, reduction=reduction, label_smoothing=0.1)

    def theirs(x_, w_, b_, keep):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return F.cross_entropy(F.linear(x_, w_, b_), t, reduction=reduction, label_smoothing=0.1)

    def gold(x_, w_, b_, keep):
        raw = F.linear(x_, w_, b_)
        raw.retain_grad()
        keep["raw"] = raw
        return F.cross_entropy(raw, t, reduction=reduction, label_smoothing=0.1)

    lo, go, _ = _grads(ours, (x, w, b), up)
    lt, gt, _ = _grads(theirs, (x, w, b), up)
    bf = [u.bfloat16().double() for u in (x, w, b)]
    lg, gg, keep = _grads(gold, bf, up)
    assert lo.dtype == lt.dtype == torch.float32 and all(g.dtype == torch.float32 for g in go)
    zabs = bf[0].abs() @ bf[1].abs().t() + bf[2].abs()
    zrow = zabs.amax(1)
    m = 2 * zrow
    assert_bound(lo, lt, lg, precision=torch.bfloat16, scale=m if reduction == "none" else m.mean(), what="loss")
    G = keep["raw"].grad.abs() * (1 + zrow[:, None])
    for name, a, r, g, s in zip(("grad_input", "grad_weight", "grad_bias"), go, gt, gg,
                                (G @ bf[1].abs(), G.t() @ bf[0].abs(), G.sum(0))):
        assert_bound(a, r, g, precision=torch.bfloat16, scale=s, what=name)


def test_autocast_fp16_scaled_gradient():
    """fp16 autocast with a loss scaler's factor: the fused gradients must not underflow (ours is computed
    at grad_output 1 and scaled in the backward, and the op's fp32 matmuls must not be autocast to fp16)."""
    x, w, _, t = make_problem((1024,), d=16, v=512, bias=False, ignore_frac=0.0, seed=29)
    res = {}
    for who in ("ours", "torch"):
        xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.float16):
            f = LCE(xx, ww, t) if who == "ours" else F.cross_entropy(F.linear(xx, ww), t)
        res[who] = torch.autograd.grad(f * 2.0**14, (xx, ww))
    x64, w64 = x.half().double().requires_grad_(), w.half().double().requires_grad_()
    gold = torch.autograd.grad(F.cross_entropy(F.linear(x64, w64), t) * 2.0**14, (x64, w64))
    for i in range(2):
        e_ours = (res["ours"][i].double() - gold[i]).norm() / gold[i].norm()
        e_torch = (res["torch"][i].double() - gold[i]).norm() / gold[i].norm()
        assert e_ours <= 1.1 * e_torch, (i, e_ours.item(), e_torch.item())


# --------------------------------------------------------------------------- op registration


def _opcheck_cases():
    gen = torch.Generator().manual_seed(30)
    n, d, v = 5, 4, 7
    x = torch.randn(n, d, generator=gen, requires_grad=True)
    w = torch.randn(v, d, generator=gen, requires_grad=True)
    b = torch.randn(v, generator=gen, requires_grad=True)
    t = torch.randint(0, v, (n,), generator=gen)
    t[2] = -100
    cw = torch.rand(v, generator=gen)
    q = torch.softmax(torch.randn(n, v, generator=gen), -1)
    zero_t = torch.zeros(n, dtype=torch.long)
    vec = [torch.randn(n, generator=gen) for _ in range(5)]
    lse, om, a, bb, c = vec[0], vec[1].abs(), vec[2], vec[3], vec[4]
    z = torch.randn(n, v, generator=gen, requires_grad=True)
    xd, wd, bd = x.detach(), w.detach(), b.detach()
    ops = torch.ops.smx
    return [
        # smx::linear_ce_stats(input, weight, bias, target, probs, class_weight, ignore_index, scale, softcap,
        #                      need_weighted_sum, return_logits, logits_dtype, chunk_bytes)
        (ops.linear_ce_stats, (x, w, b, t, None, cw, -100, 1.0, None, True, False, None, 64)),
        (ops.linear_ce_stats, (x, w, None, t, None, None, -100, 0.5, 3.0, False, True, torch.float32, 64)),
        (ops.linear_ce_stats, (x.bfloat16(), w.bfloat16(), None, t, None, None, -100, 1.0, None, True, True, None,
                               1 << 20)),
        (ops.linear_ce_stats, (x, w, b, zero_t, q, cw, -100, 1.0, None, True, False, None, 64)),
        # smx::linear_ce_backward(..., lse, other_mass, a, b, c, ignore_index, scale, softcap, logits,
        #                         grad_logits, filter_eps, need_input/weight/bias_grad, chunk_bytes)
        (ops.linear_ce_backward, (xd, wd, bd, t, None, cw, lse, om, a, bb, c, -100, 1.0, None, None, None, None,
                                  True, True, True, 64)),
        (ops.linear_ce_backward, (xd, wd, None, zero_t, q, None, lse, om, a, bb, c, -100, 0.5, 2.0, None, None,
                                  None, True, False, False, 64)),
        (ops.linear_ce_backward, (xd, wd, bd, t, None, None, lse, om, a, bb, None, -100, 1.0, None,
                                  torch.randn(n, v, generator=gen), torch.randn(n, v, generator=gen), None,
                                  False, True, True, 64)),
        # smx::linear_ce_loss(input, weight, bias, target, class_weight, token_weight, ignore_index, reduction,
        #                     label_smoothing, lse_square_scale, scale, softcap, return_logits, logits_dtype,
        #                     chunk_bytes)
        (ops.linear_ce_loss, (x, w, b, t, cw, None, -100, "mean", 0.1, 1e-3, 1.0, None, False, None, 64)),
        (ops.linear_ce_loss, (x, w, b, t, None, torch.rand(n, generator=gen), -100, "sum", 0.0, 0.0, 0.5, 2.0,
                              True, None, 64)),
        (ops.linear_ce_loss, (x.half(), w.half(), None, t, None, None, -100, "mean", 0.0, 0.0, 1.0, None, False,
                              None, 64)),
        # smx::linear_add_logits_grad_(grad_logits, logits, input, weight, grad_loss, saved_input_grad,
        #     saved_weight_grad, saved_bias_grad, grad_input!, grad_weight!, grad_bias!, scale, softcap, chunk_bytes)
        (ops.linear_add_logits_grad_, (torch.randn(n, v), torch.randn(n, v), xd, wd, torch.tensor(2.0),
                                       torch.randn(n, d), torch.randn(v, d), torch.randn(v), torch.randn(n, d),
                                       torch.randn(v, d), torch.randn(v), 1.0, None, 64)),
        (ops.linear_add_logits_grad_, (torch.randn(n, v), torch.randn(n, v), xd, wd, torch.tensor(0.5),
                                       torch.randn(n, d), torch.randn(v, d), None, torch.randn(n, d),
                                       torch.randn(v, d), None, 2.0, 3.0, 64)),
        (ops.linear_add_logits_grad_, (torch.zeros(n, v), torch.randn(n, v), xd, wd, torch.tensor(1.0),
                                       torch.randn(n, d), torch.randn(v, d), None, torch.randn(n, d),
                                       torch.randn(v, d), None, 1.0, None, 64)),
        # smx::ce_stats(logits, target, probs, class_weight, ignore_index, scale, softcap, need_weighted_sum,
        #               chunk_bytes)
        (ops.ce_stats, (z, t, None, cw, -100, 1.0, None, True, 64)),
        (ops.ce_stats, (z, zero_t, q, None, -100, 2.0, 5.0, True, 64)),
        (ops.ce_stats, (z.detach().bfloat16().requires_grad_(), t, None, None, -100, 1.0, None, False, 1 << 20)),
        # smx::ce_backward(logits, target, probs, class_weight, lse, other_mass, a, b, c, ignore_index, scale,
        #                  softcap, chunk_bytes)
        (ops.ce_backward, (z.detach(), t, None, cw, lse, om, a, bb, c, -100, 1.0, None, 64)),
        (ops.ce_backward, (z.detach(), zero_t, q, None, lse, om, a, bb, None, -100, 0.5, 2.0, 64)),
    ]


@pytest.mark.parametrize("case", range(18))
def test_opcheck(case):
    # all of opcheck's default checks apply: schema (no mutation/aliasing), autograd registration, the fake
    # kernel under fake tensors, and AOT dispatch with static and dynamic shapes
    op, args = _opcheck_cases()[case]
    torch.library.opcheck(op.default, args)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("kw", [
    dict(),
    dict(class_weight=True, label_smoothing=0.2, lse_square_scale=0.1),
    dict(scale=0.7, softcap=2.0, token_weight=True),
    dict(return_lse=True),
    dict(soft=True, label_smoothing=0.1, class_weight=True),
], ids=["plain", "cw_ls_z", "scale_softcap_tw", "lse", "soft"])
@pytest.mark.parametrize("fn", ["linear", "plain"])
def test_gradcheck_fp64(fn, kw, reduction):
    gen = torch.Generator().manual_seed(31)
    n, d, v = 4, 3, 6
    kw = dict(kw)
    soft = kw.pop("soft", False)
    if soft:
        t = torch.softmax(torch.randn(n, v, generator=gen, dtype=torch.float64), -1)
    else:
        t = torch.tensor([0, 5, -100, 2])
    if kw.get("class_weight"):
        kw["class_weight"] = torch.rand(v, generator=gen, dtype=torch.float64) + 0.5
    if kw.get("token_weight"):
        kw["token_weight"] = torch.rand(n, generator=gen, dtype=torch.float64) + 0.5
    lse = kw.pop("return_lse", False)
    x = torch.randn(n, d, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(v, d, generator=gen, dtype=torch.float64, requires_grad=True)
    b = torch.randn(v, generator=gen, dtype=torch.float64, requires_grad=True)

    def f(x, w, b):
        if fn == "linear":
            out = LCE(x, w, t, bias=b, reduction=reduction, return_lse=lse, **kw)
        else:
            cw = kw.get("class_weight")
            out = CE(F.linear(x, w, b), t, cw, reduction=reduction, return_lse=lse,
                     **{k: a for k, a in kw.items() if k != "class_weight"})
        return (out.loss, out.lse) if lse else out

    assert torch.autograd.gradcheck(f, (x, w, b))


# --------------------------------------------------------------------------- torch.compile


@pytest.mark.parametrize("fn,reduction", [("linear", "mean"), ("linear", "none"), ("plain", "mean")])
def test_compile_fullgraph_inductor(fn, reduction, paths):
    x, w, b, t = make_problem((3, 5), seed=32)
    cw = torch.rand(V) + 0.5

    def f(x, w, b, t):
        kw = dict(reduction=reduction, label_smoothing=0.1, lse_square_scale=1e-3, softcap=20.0,
                  chunk_bytes=SMALL_CHUNK)
        if fn == "plain":
            return CE(F.linear(x, w, b), t, cw, dim=-1, **kw).sum()
        return LCE(x, w, t, bias=b, class_weight=cw, **kw).sum()

    cf = torch.compile(f, fullgraph=True, backend="inductor")
    res = []
    for fun in (cf, f):
        xx, ww, bb = (u.clone().requires_grad_() for u in (x, w, b))
        loss = fun(xx, ww, bb, t)
        res.append((loss.detach(), *torch.autograd.grad(loss, (xx, ww, bb))))
    for a, c in zip(*res):
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)
    op = "ce_stats" if fn == "plain" else "linear_ce_loss" if reduction == "mean" else "linear_ce_stats"
    assert paths.calls.get(op, 0) >= 2  # the compiled function called our op (and so did eager)


def _core(x, w, b, t, reduction, *, scale=1.0, softcap=None, logits_dtype=None):
    """The internal entry with a returned logits output: (loss, z_loss, lse, logits)."""
    return ce_mod.linear_ce_core(x, w, b, t, None, None, None, -100, reduction, 0.0, 0.0, scale, softcap, True,
                                 logits_dtype, SMALL_CHUNK)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("opts", [dict(), dict(scale=0.5, softcap=3.0)], ids=["plain", "scale_softcap"])
def test_returned_logits(reduction, opts, paths):
    """``linear_ce_core(return_logits=True)``: the logits equal F.linear's (transformed); a loss using both
    the CE loss and the logits gets the right gradients (the grad_logits branch of
    smx::linear_add_logits_grad_ / linear_ce_backward); an unused logits output changes nothing."""
    x, w, b, t = make_problem(seed=33)
    red_sum = (lambda l: l.sum()) if reduction == "none" else (lambda l: l)

    def ours(x_, w_, b_, keep):
        loss, _, _, logits = _core(x_, w_, b_, t, reduction, **opts)
        return red_sum(loss) + logits.square().mean()

    def ref(x_, w_, b_, keep):
        raw = F.linear(x_, w_, b_)
        if raw.requires_grad:
            raw.retain_grad()
            keep["raw"] = raw
        z = transform(raw, **opts)
        return red_sum(F.cross_entropy(z, t, reduction=reduction)) + z.square().mean()

    for grad in (False, True):  # stats op / fused op (mean, sum)
        xx = x.clone().requires_grad_(grad)
        logits = _core(xx, w, b, t, reduction, **opts)[3].detach()
        zabs = x.abs() @ w.abs().t() + b.abs()  # chunked addmm vs one addmm: a few ulps of |x|.|w|
        assert ((logits - transform(F.linear(x, w, b), **opts)).abs() <= 4 * eps(torch.float32) * zabs).all()
        if not opts:  # one chunk: the very addmm of F.linear
            one = ce_mod.linear_ce_core(xx, w, b, t, None, None, None, -100, reduction, 0.0, 0.0, 1.0, None, True,
                                         None, 1 << 20)[3]
            assert torch.equal(one, F.linear(x, w, b))
    up = upstream_for()
    paths.calls.clear()
    lo, go, _ = _grads(ours, (x, w, b), up)
    assert paths.calls.get("linear_ce_loss" if reduction != "none" else "linear_ce_stats") == 1
    lt, gt, _ = _grads(ref, (x, w, b), up)
    lg, gg, keep = _grads(ref, (x.double(), w.double(), b.double()), up)
    zrow = (x.double().abs() @ w.double().abs().t() + b.double().abs()).amax(1)
    assert_bound(lo, lt, lg, precision=torch.float32, scale=zrow.square().sum(), what="loss")
    G = keep["raw"].grad.abs() * (1 + zrow[:, None])
    for name, a, r, g, s in zip(("grad_input", "grad_weight", "grad_bias"), go, gt, gg,
                                (G @ w.double().abs(), G.t() @ x.double().abs(), G.sum(0))):
        assert_bound(a, r, g, precision=torch.float32, scale=s, what=name)
    # logits returned but unused: the same gradients as without them
    xx, ww, bb = (u.clone().requires_grad_() for u in (x, w, b))
    with_logits = torch.autograd.grad(red_sum(_core(xx, ww, bb, t, reduction, **opts)[0]), (xx, ww, bb))
    xx, ww, bb = (u.clone().requires_grad_() for u in (x, w, b))
    plain = LCE(xx, ww, t, bias=bb, reduction=reduction, chunk_bytes=SMALL_CHUNK, **opts)
    without = torch.autograd.grad(red_sum(plain), (xx, ww, bb))
    for a, c in zip(with_logits, without):  # (chunking may differ: fp32 accumulation order)
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)
    # logits only (the CE loss unused)
    xx, ww, bb = (u.clone().requires_grad_() for u in (x, w, b))
    g_only = torch.autograd.grad(_core(xx, ww, bb, t, reduction, **opts)[3].square().mean(), (xx, ww, bb))
    xx, ww, bb = (u.clone().requires_grad_() for u in (x, w, b))
    g_ref = torch.autograd.grad(transform(F.linear(xx, ww, bb), **opts).square().mean(), (xx, ww, bb))
    for a, c in zip(g_only, g_ref):
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-7)


# --------------------------------------------------------------------------- memory


def _largest_allocation(fn) -> int:
    """Bytes of the largest single CPU allocation while ``fn`` runs (profiler memory events)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    sizes = [e.cpu_memory_usage for e in prof.events()]
    raw = getattr(getattr(prof, "profiler", None), "kineto_results", None)
    if raw is not None:  # the raw allocator records, independent of op attribution
        sizes += [e.nbytes() for e in raw.events() if e.name() == "[memory]"]
    return max(sizes, default=0)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_largest_temporary_is_a_chunk(reduction):
    """N x V fp32 logits never exist: no single allocation reaches a quarter of them during fwd + bwd
    (chunk_bytes = 512 KiB: 8 rows; grad_weight is V x D = 512 KiB).
    Control: torch's F.linear + F.cross_entropy does."""
    n, d, v = 128, 8, 16384
    x, w, _, t = make_problem((n,), d=d, v=v, bias=False, seed=34)
    x.requires_grad_()
    w.requires_grad_()
    limit = n * v * 4 // 4

    def ours():
        LCE(x, w, t, reduction=reduction, chunk_bytes=1 << 19).sum().backward()

    def theirs():
        F.cross_entropy(F.linear(x, w), t, reduction=reduction).sum().backward()

    assert _largest_allocation(theirs) >= n * v * 4  # the measurement sees the logits
    assert _largest_allocation(ours) < limit


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_compiled_with_transposed_weight(reduction):
    """A non-row-major weight (``M.t()``): the ops' fake outputs are contiguous like the real ones."""
    torch.manual_seed(0)
    h = torch.randn(6, 8, requires_grad=True)
    m = torch.randn(8, 300, requires_grad=True)
    y = torch.randint(0, 300, (6,))

    def f(h, m, y):
        return smxcompile.linear_cross_entropy(h, m.t(), y, reduction=reduction).sum()

    torch._dynamo.reset()
    got = torch.compile(f, backend="inductor", fullgraph=True)(h, m, y)
    g_got = torch.autograd.grad(got, (h, m))
    want = f(h, m, y)
    g_want = torch.autograd.grad(want, (h, m))
    torch.testing.assert_close(got, want)
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("opts", [
    dict(), dict(class_weight=True), dict(lse_square_scale=1e-2), dict(token_weight=True), dict(scale=0.7),
    dict(class_weight=True, lse_square_scale=1e-3, token_weight=True, scale=1.3), dict(bias=False),
    dict(return_logits=True), dict(return_logits=True, logits_dtype=torch.bfloat16),
    dict(softcap=4.0), dict(label_smoothing=0.1), dict(label_smoothing=0.2, class_weight=True, scale=0.8),
    dict(softcap=3.0, label_smoothing=0.1, class_weight=True, lse_square_scale=1e-3, token_weight=True, scale=1.3),
    dict(softcap=5.0, label_smoothing=0.1, return_logits=True),
])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_fused_path_matches_the_statistics_path(opts, reduction, paths):
    """The fused CPU path (gradients in the forward, factored through the matmuls; soft-cap and smoothing
    elementwise) equals the statistics path (the row statistics, then their backward), incl. ignored rows,
    z-loss and weights."""
    opts = dict(opts)
    torch.manual_seed(3)
    n, d, v = 53, 17, 211
    x = torch.randn(n, d, requires_grad=True)
    w = (torch.randn(v, d) * 0.5).requires_grad_()
    b = torch.randn(v, requires_grad=True) if opts.pop("bias", True) else None
    t = torch.randint(0, v, (n,))
    t[::5] = -100
    cw = torch.rand(v) + 0.5 if opts.pop("class_weight", False) else None
    tw = torch.rand(n) if opts.pop("token_weight", False) else None
    ret = opts.pop("return_logits", False)
    ldt = opts.pop("logits_dtype", None)
    z_scale = opts.pop("lse_square_scale", 0.0)
    scale = opts.pop("scale", 1.0)
    softcap = opts.pop("softcap", None)
    eps = opts.pop("label_smoothing", 0.0)

    def run(fused):
        paths.calls.clear()
        loss, zl, _, logits = ce_mod.linear_ce_core(x, w, b, t, None, cw, tw, -100, reduction, eps, z_scale, scale,
                                                    softcap, ret, ldt, 4 * v * 7,  # 7-row chunks: the last partial
                                                    need_lse=not fused)  # need_lse: the statistics path
        assert ("linear_ce_loss" in paths.calls) == fused
        total = loss + (zl if zl is not None else 0.0)
        ins = (x, w) + ((b,) if b is not None else ())
        return total.detach(), torch.autograd.grad(total, ins), (logits.detach() if ret else None)

    l_fused, g_fused, lg_fused = run(True)
    l_stats, g_stats, lg_stats = run(False)
    torch.testing.assert_close(l_fused, l_stats, rtol=1e-6, atol=1e-6)
    for a, c in zip(g_fused, g_stats):
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)
    if ret:
        torch.testing.assert_close(lg_fused, lg_stats, rtol=0, atol=0)


def test_fused_backward_twice_with_retain_graph():
    """The eager backward hands the forward's gradients over without a copy; a second backward
    (retain_graph=True) must still see them unchanged."""
    torch.manual_seed(0)
    x = torch.randn(20, 8, requires_grad=True)
    w = torch.randn(50, 8, requires_grad=True)
    y = torch.randint(0, 50, (20,))
    loss = smxcompile.linear_cross_entropy(x, w, y)
    loss.backward(retain_graph=True)
    g1 = (x.grad.clone(), w.grad.clone())
    loss.backward()
    torch.testing.assert_close(x.grad, 2 * g1[0])
    torch.testing.assert_close(w.grad, 2 * g1[1])
    ref = torch.nn.functional.cross_entropy(x @ w.t(), y)
    gx, gw = torch.autograd.grad(ref, (x, w))
    torch.testing.assert_close(g1[0], gx, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g1[1], gw, rtol=1e-5, atol=1e-6)
    # an upstream gradient other than 1 is applied
    x.grad = w.grad = None
    (smxcompile.linear_cross_entropy(x, w, y) * 3.0).backward()
    torch.testing.assert_close(x.grad, 3 * gx, rtol=1e-5, atol=1e-6)


def test_double_backward_is_an_error_not_zero():
    """create_graph=True through the fused path would give zero second-order gradients: it raises."""
    torch.manual_seed(0)
    h = torch.randn(8, 16, requires_grad=True)
    w = (torch.randn(300, 16) * 0.3).requires_grad_()
    y = torch.randint(0, 300, (8,))
    for reduction in ("mean", "sum"):
        loss = smxcompile.linear_cross_entropy(h, w, y, reduction=reduction)
        with pytest.raises(RuntimeError, match="double backward"):
            torch.autograd.grad(loss, h, create_graph=True)


def test_returned_gradients_are_independent_tensors():
    """Gradients from the fused path can be modified in place, also between two retained backwards."""
    torch.manual_seed(0)
    h = torch.randn(8, 16, requires_grad=True)
    w = torch.randn(300, 16, requires_grad=True)
    y = torch.randint(0, 300, (8,))
    loss = smxcompile.linear_cross_entropy(h, w, y)
    (g1,) = torch.autograd.grad(loss, h, retain_graph=True)
    keep = g1.clone()
    with torch.no_grad():
        g1.mul_(2)
    (g2,) = torch.autograd.grad(loss, h)
    torch.testing.assert_close(g2, keep)


def test_eager_inference_matches_the_op_path_with_mixed_dtypes():
    """Without a gradient an eager call may run F.cross_entropy; a class weight or targets of another dtype (numpy's
    fp64 weights, int32 targets) must give what the op path gives, not F.cross_entropy's dtype errors."""
    x = torch.randn(6, 5, dtype=torch.float64)
    for t, w in ((torch.tensor([0, 1, 2, 3, 4, -100]), torch.rand(5) + 0.5),
                 (torch.tensor([0, 1, 2, 3, 4, 1], dtype=torch.int32), torch.rand(5, dtype=torch.float64) + 0.5)):
        with torch.no_grad():
            fast = smxcompile.cross_entropy(x, t, w)
        ref = smxcompile.cross_entropy(x.clone().requires_grad_(), t, w).detach()
        torch.testing.assert_close(fast, ref)
