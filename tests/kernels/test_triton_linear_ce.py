"""Tests of the fused linear + cross-entropy Triton kernels (smxcompile.kernels.cross_entropy.triton_*).

On a machine without a GPU they run through Triton's interpreter (TRITON_INTERPRET=1, set
by tests/conftest.py before triton is imported) on CPU tensors. On a CUDA machine (TRITON_INTERPRET unset)
the same tests run the compiled kernels on the GPU.

Reference: a naive fp64 implementation of the contract (full logits, autograd of
``L = sum_i a_i lse_i - b_i z_{i,y_i} - c_i sum_j w_j z_ij + sum grad_logits * z``).
Accuracy criterion, elementwise: ``|ours - gold| <= |torch - gold| + tol`` where ``torch``
is the same computation in the input dtype, and ``tol`` a few ulps of fp32 accumulation
(and of the matmul operand dtype for gradients) times the magnitude of the summed terms.
"""

import inspect
import math

import pytest
import torch
from kernels_testing import DEVICE, TRITON_MARKS, compile_for_sm90, require_triton

require_triton()

from smxcompile.kernels.cross_entropy import triton_backward, triton_common, triton_forward  # noqa: E402
from smxcompile.kernels.cross_entropy.triton_backward import ce_backward, lce_backward  # noqa: E402
from smxcompile.kernels.cross_entropy.triton_forward import ce_forward, lce_forward  # noqa: E402

pytestmark = TRITON_MARKS

NAN = float("nan")
INF = float("inf")
EPS32 = torch.finfo(torch.float32).eps
#: small blocks keep the interpreter fast and exercise partial / multiple blocks
SMALL = dict(block_n=16, block_v=64, block_d=32)


# ----------------------------------------------------------------------------- data


def _problem(N, V, D, dtype, *, bias=True, seed=0, ignore_index=-100, frac_ignored=0.2, wscale=1.0):
    g = torch.Generator().manual_seed(seed)
    inp = torch.randn(N, D, generator=g).to(dtype)
    weight = (torch.randn(V, D, generator=g) * (wscale / math.sqrt(D))).to(dtype)
    b = torch.randn(V, generator=g).to(dtype) if bias else None
    target = torch.randint(0, V, (N,), generator=g)
    target[torch.rand(N, generator=g) < frac_ignored] = ignore_index
    return inp, weight, b, target


def _coefs(N, target, ignore_index, seed=1, with_c=True):
    g = torch.Generator().manual_seed(seed)
    a, b, c = (torch.randn(N, generator=g) for _ in range(3))
    ign = target == ignore_index
    a, b, c = (t.masked_fill(ign, 0.0) for t in (a, b, c))
    return a, b, (c if with_c else None)


def _dev(*ts):
    return [None if t is None else t.to(DEVICE) for t in ts]


# ----------------------------------------------------------------------------- reference


def _transform(x, scale, softcap):
    z = x * scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return z


def _ref_from_z(z, target, *, ignore_index, cw, a=None, b=None, c=None, grad_logits=None, wrt=()):
    """Stats (and, with a, b, autograd grads w.r.t. the leaves in `wrt`) from logits z."""
    dtype = z.dtype
    N, V = z.shape
    target = target.cpu().long()
    ign = target == ignore_index
    valid = ~ign & (target >= 0) & (target < V)
    yy = torch.where(valid, target, torch.zeros_like(target))
    onehot = torch.zeros(N, V, dtype=torch.bool)
    onehot[valid.nonzero()[:, 0], yy[valid]] = True
    w = torch.ones(V, dtype=dtype) if cw is None else cw.cpu().to(dtype)
    lse = torch.logsumexp(z, -1)
    zt = z.gather(1, yy[:, None])[:, 0]
    tgt = torch.where(ign, torch.zeros_like(zt), torch.where(valid, zt, torch.full_like(zt, NAN)))
    p = torch.softmax(z, -1)
    om = torch.where(ign, torch.zeros_like(lse), p.masked_fill(onehot, 0.0).sum(-1))
    ws = (z * w).sum(-1)
    out = dict(lse=lse, tgt=tgt, om=om, ws=ws, p=p, onehot=onehot, w=w)
    if a is not None:
        L = (a.to(dtype) * lse).sum() - (b.to(dtype) * torch.where(valid, zt, torch.zeros_like(zt))).sum()
        if c is not None:
            L = L - (c.to(dtype) * ws).sum()
        if grad_logits is not None:
            L = L + (grad_logits.cpu().to(dtype) * z).sum()
        out["grads"] = torch.autograd.grad(L, wrt, allow_unused=True)
    return out


def _ref_linear(inp, weight, bias, target, dtype, *, scale=1.0, softcap=None, ignore_index, cw=None,
                a=None, b=None, c=None, grad_logits=None):
    """The contract computed by torch in `dtype` (float64: the gold)."""
    leaves = [t.detach().cpu().to(dtype).requires_grad_(True) if t is not None else None for t in (inp, weight, bias)]
    x = leaves[0] @ leaves[1].T
    if leaves[2] is not None:
        x = x + leaves[2]
    z = _transform(x, scale, softcap)
    out = _ref_from_z(z, target, ignore_index=ignore_index, cw=cw, a=a, b=b, c=c, grad_logits=grad_logits,
                      wrt=[t for t in leaves if t is not None])
    out["z"] = z.detach()
    if "grads" in out:
        g = list(out["grads"])
        out["gi"], out["gw"] = g[0], g[1]
        out["gb"] = g[2] if leaves[2] is not None else None
    return out


def _magnitudes(inp, weight, bias, scale):
    """|s| * (|input| @ |weight|.T + |bias|) in fp64: the size of each logit's fp32 sum."""
    zm = inp.cpu().double().abs() @ weight.cpu().double().abs().T
    if bias is not None:
        zm = zm + bias.cpu().double().abs()
    return abs(scale) * zm


def _assert_gold(ours, ref, gold, tol, what=""):
    """|ours - gold| <= |ref - gold| + tol elementwise (ref may be None); NaN patterns equal gold's."""
    ours = ours.detach().double().cpu()
    gold = gold.detach().double().cpu()
    assert ours.shape == gold.shape, (what, ours.shape, gold.shape)
    assert torch.equal(torch.isnan(ours), torch.isnan(gold)), f"{what}: NaN pattern differs from the gold"
    fin = torch.isfinite(gold)
    assert torch.equal(ours[~fin & ~torch.isnan(gold)], gold[~fin & ~torch.isnan(gold)]), f"{what}: infinities"
    err = (ours - gold).abs()
    allowed = torch.as_tensor(tol, dtype=torch.float64).expand_as(gold).clone()
    if ref is not None:
        ref_err = (ref.detach().double().cpu() - gold).abs()
        allowed = allowed + ref_err.nan_to_num(nan=0.0, posinf=0.0)
    excess = (err - allowed)[fin]
    assert excess.numel() == 0 or (excess <= 0).all(), (
        f"{what}: max excess {excess.max().item():.3e} (max err {err[fin].max().item():.3e})"
    )


def _check_stats(got, gold, ref, zmag, *, need_ws=True, K=8.0):
    lse, tgt, om, ws = got
    for t in (lse, tgt, om):
        assert t.dtype == torch.float32 and t.shape == gold["lse"].shape
    zmax = zmag.max(1).values
    _assert_gold(lse, ref and ref["lse"], gold["lse"], K * EPS32 * (zmax + gold["lse"].abs()), "lse")
    gz = gold["z"]
    zt_mag = (zmag + gz.abs()).gather(1, gold["onehot"].float().argmax(1, keepdim=True))[:, 0]
    _assert_gold(tgt, ref and ref["tgt"], gold["tgt"], K * EPS32 * zt_mag, "target_logit")
    _assert_gold(om, ref and ref["om"], gold["om"], K * EPS32 * (1 + zmax) * gold["om"] + 1e-30, "other_mass")
    if need_ws:
        w = gold["w"].abs()
        _assert_gold(ws, ref and ref["ws"], gold["ws"], K * EPS32 * ((zmag + gz.abs()) * w).sum(1), "weighted_sum")
    else:
        assert ws is None


def _grad_mag(gold, a, b, c, zmag, scale, grad_logits=None):
    """Magnitude of the terms of G * dz/dx (fp64, N x V), inflated by the logit error (1 + |z|max)."""
    p = gold["p"]
    a, b = a.double().abs()[:, None], b.double().abs()[:, None]
    m = a * p + gold["onehot"] * (b + a * gold["om"][:, None])
    if c is not None:
        m = m + c.double().abs()[:, None] * gold["w"].abs()[None, :]
    if grad_logits is not None:
        m = m + grad_logits.cpu().double().abs()
    return abs(scale) * (1 + zmag.max(1, keepdim=True).values) * m


def _check_grads(got, gold, ref, gmag, inp, weight, *, op_eps, K=8.0):
    """grad_input / grad_weight / grad_bias: fp32 accumulation + Gx rounded to the operand dtype
    (op_eps; also covers a z read back rounded)."""
    gi, gw, gb = got
    e = K * (EPS32 + op_eps)
    X, W = inp.cpu().double().abs(), weight.cpu().double().abs()
    if gold.get("gi") is not None and gi is not None:
        out_eps = torch.finfo(gi.dtype).eps
        _assert_gold(gi, ref and ref["gi"], gold["gi"], e * (gmag @ W) + out_eps * gold["gi"].abs(), "grad_input")
    if gold.get("gw") is not None and gw is not None:
        out_eps = torch.finfo(gw.dtype).eps
        _assert_gold(gw, ref and ref["gw"], gold["gw"], e * (gmag.T @ X) + out_eps * gold["gw"].abs(), "grad_weight")
    if gold.get("gb") is not None and gb is not None:
        out_eps = torch.finfo(gb.dtype).eps
        _assert_gold(gb, ref and ref["gb"], gold["gb"], e * gmag.sum(0) + out_eps * gold["gb"].abs(),
                     "grad_bias")


# ----------------------------------------------------------------------------- linear + CE


CONFIGS = [
    # dtype, bias, class_weight, softcap, scale, ignore_index
    (torch.float32, True, False, None, 1.0, -100),
    (torch.float32, False, True, None, 0.5, 3),
    (torch.float32, True, True, 5.0, 1.7, -100),
    (torch.bfloat16, True, True, None, 1.0, -100),
    (torch.float16, False, False, 10.0, 2.0, -1),
    (torch.bfloat16, True, False, 3.0, 1.0, 3),
]


@pytest.mark.parametrize("dtype,has_bias,has_cw,softcap,scale,ignore_index", CONFIGS,
                         ids=lambda v: str(v).replace("torch.", ""))
def test_forward_backward(dtype, has_bias, has_cw, softcap, scale, ignore_index):
    """Stats and all three gradients (random a, b, c and the CE coefficients a = b = g, c = 0),
    N / V / D not multiples of the blocks, ~20% ignored rows, vocabulary split across programs."""
    N, V, D = 37, 1000, 48
    inp, weight, bias, target = _problem(N, V, D, dtype, bias=has_bias, ignore_index=ignore_index, wscale=2.0)
    if ignore_index >= 0:
        target[:3] = ignore_index  # make sure some rows are ignored
    cw = torch.rand(V, generator=torch.Generator().manual_seed(5)) + 0.5 if has_cw else None
    kw = dict(ignore_index=ignore_index, scale=scale, softcap=softcap)
    d_inp, d_w, d_b, d_t, d_cw = _dev(inp, weight, bias, target, cw)
    got = lce_forward(d_inp, d_w, d_b, d_t, class_weight=d_cw, need_weighted_sum=True, num_splits=3, **kw, **SMALL)
    gold = _ref_linear(inp, weight, bias, target, torch.float64, cw=cw, **kw)
    ref = _ref_linear(inp, weight, bias, target, dtype, cw=cw, **kw)
    zmag = _magnitudes(inp, weight, bias, scale)
    _check_stats(got, gold, ref, zmag)
    lse, _, om, _ = got
    op_eps = torch.finfo(dtype).eps if dtype != torch.float32 else 0.0

    # random coefficients (0 on ignored rows, as the callers pass them), both backward modes
    a, b, c = _coefs(N, target, ignore_index)
    d_a, d_b2, d_c = _dev(a, b, c)
    gold = _ref_linear(inp, weight, bias, target, torch.float64, cw=cw, a=a, b=b, c=c, **kw)
    ref = _ref_linear(inp, weight, bias, target, dtype, cw=cw, a=a, b=b, c=c, **kw)
    for mode in triton_backward.MODES:
        grads = lce_backward(d_inp, d_w, d_b, d_t, lse, om, d_a, d_b2, d_c, class_weight=d_cw, mode=mode, **kw,
                             **SMALL)
        assert grads[0].dtype == dtype and grads[1].dtype == dtype and grads[0].shape == (N, D)
        assert (grads[2] is None) == (bias is None)
        _check_grads(grads, gold, ref, _grad_mag(gold, a, b, c, zmag, scale), inp, weight, op_eps=op_eps)

    # cross-entropy: a = b = g (mean reduction over valid rows), c = 0; default block sizes, fp32 grads
    valid = (target != ignore_index).float()
    g = valid / valid.sum().clamp(min=1)
    d_g = g.to(DEVICE)
    grads = lce_backward(d_inp, d_w, d_b, d_t, lse, om, d_g, d_g, None, **kw,
                         input_grad_dtype=torch.float32, weight_grad_dtype=torch.float32)
    assert grads[0].dtype == torch.float32 and grads[1].dtype == torch.float32
    gold = _ref_linear(inp, weight, bias, target, torch.float64, a=g, b=g, **kw)
    ref = _ref_linear(inp, weight, bias, target, dtype, a=g, b=g, **kw)
    _check_grads(grads, gold, ref, _grad_mag(gold, g, g, None, zmag, scale), inp, weight, op_eps=op_eps)


def test_defaults_and_need_flags():
    """Default block sizes and splits; need_* flags; int32 targets give the same results."""
    N, V, D = 20, 300, 40
    inp, weight, bias, target = _dev(*_problem(N, V, D, torch.bfloat16, seed=3))
    got = lce_forward(inp, weight, bias, target, ignore_index=-100)
    assert got[3] is None
    got32 = lce_forward(inp, weight, bias, target.int(), ignore_index=-100)
    for x, y in zip(got[:3], got32[:3]):
        assert torch.equal(x, y)
    gold = _ref_linear(inp, weight, bias, target, torch.float64, ignore_index=-100)
    _check_stats(got, gold, None, _magnitudes(inp, weight, bias, 1.0), need_ws=False)
    lse, _, om, _ = got
    a, b, c = _dev(*_coefs(N, target.cpu(), -100))
    full = lce_backward(inp, weight, bias, target, lse, om, a, b, c, ignore_index=-100)
    full32 = lce_backward(inp, weight, bias, target.int(), lse, om, a, b, c, ignore_index=-100)
    for x, y in zip(full, full32):
        assert torch.equal(x, y)
    gi, gw, gb = lce_backward(inp, weight, bias, target, lse, om, a, b, c, ignore_index=-100,
                              need_input_grad=False, need_bias_grad=False)
    assert gi is None and gb is None and torch.allclose(gw.float(), full[1].float(), atol=1e-6)
    gi, gw, gb = lce_backward(inp, weight, bias, target, lse, om, a, b, c, ignore_index=-100,
                              need_input_grad=False, need_weight_grad=False)
    assert gi is None and gw is None and torch.allclose(gb.float(), full[2].float(), atol=1e-6)
    # no bias, but its gradient asked for: the gradient of a zero bias (in weight's dtype)
    no_bias = lce_forward(inp, weight, None, target, ignore_index=-100)
    gi, gw, gb = lce_backward(inp, weight, None, target, no_bias[0], no_bias[2], a, b, c, ignore_index=-100,
                              need_weight_grad=False, need_bias_grad=True)
    assert gw is None and gb.dtype == weight.dtype and gb.shape == (V,) and gi.shape == (N, D)
    zero_bias = torch.zeros(V, dtype=weight.dtype)
    gold = _ref_linear(inp, weight, zero_bias, target, torch.float64, ignore_index=-100, a=a, b=b, c=c)
    gmag = _grad_mag(gold, a.cpu(), b.cpu(), c.cpu(), _magnitudes(inp, weight, None, 1.0), 1.0)
    _check_grads((gi, None, gb), gold, None, gmag, inp, weight, op_eps=torch.finfo(weight.dtype).eps)


def test_all_rows_ignored():
    N, V, D = 19, 130, 24
    inp, weight, bias, target = _problem(N, V, D, torch.float32, frac_ignored=1.0, ignore_index=-100)
    assert (target == -100).all()
    inp, weight, bias, target = _dev(inp, weight, bias, target)
    lse, tgt, om, ws = lce_forward(inp, weight, bias, target, ignore_index=-100, need_weighted_sum=True, **SMALL)
    gold = _ref_linear(inp, weight, bias, target, torch.float64, ignore_index=-100)
    assert torch.isfinite(lse).all() and (tgt == 0).all() and (om == 0).all()
    _check_stats((lse, tgt, om, ws), gold, None, _magnitudes(inp, weight, bias, 1.0))
    zero = torch.zeros(N, device=DEVICE)
    gi, gw, gb = lce_backward(inp, weight, bias, target, lse, om, zero, zero, zero, ignore_index=-100, **SMALL)
    assert (gi == 0).all() and (gw == 0).all() and (gb == 0).all()
    # filtering skips every tile (all G == 0, no targets): same zeros
    gi, gw, gb = lce_backward(inp, weight, bias, target, lse, om, zero, zero, None, ignore_index=-100,
                              filter_eps=1e-30, **SMALL)
    assert (gi == 0).all() and (gw == 0).all() and (gb == 0).all()


def test_out_of_range_target_and_int32():
    """A non-ignored target outside [0, V) gives a NaN target logit, is never indexed, and the
    backward treats that row as having no target; int32 targets are read correctly."""
    N, V, D = 9, 100, 16
    inp, weight, bias, target = _problem(N, V, D, torch.float32, frac_ignored=0.0, seed=4)
    target[1], target[4], target[6] = V, -5, 2**31 - 1
    target[7] = 5  # ignored (ignore_index=5)
    for tt in (target, target.int()):
        d = _dev(inp, weight, bias, tt)
        lse, tgt, om, ws = lce_forward(*d, ignore_index=5, **SMALL)
        gold = _ref_linear(inp, weight, bias, target, torch.float64, ignore_index=5)
        assert torch.isnan(tgt[[1, 4, 6]]).all() and tgt[7] == 0 and not torch.isnan(tgt[[0, 2, 3, 5, 8]]).any()
        _check_stats((lse, tgt, om, ws), gold, None, _magnitudes(inp, weight, bias, 1.0), need_ws=False)
        a, b, c = _coefs(N, target, 5)
        grads = lce_backward(*d, lse, om, *_dev(a, b, c), ignore_index=5, **SMALL)
        gold = _ref_linear(inp, weight, bias, target, torch.float64, ignore_index=5, a=a, b=b, c=c)
        _check_grads(grads, gold, None, _grad_mag(gold, a, b, c, _magnitudes(inp, weight, bias, 1.0), 1.0),
                     inp, weight, op_eps=0.0)


def test_long_vocab():
    """V > 65536 (no limit on the vocabulary), split across programs."""
    N, V, D = 4, 70_000, 16
    inp, weight, bias, target = _problem(N, V, D, torch.float32, frac_ignored=0.0, seed=6, wscale=3.0)
    target[0] = V - 1
    d = _dev(inp, weight, bias, target)
    blocks = dict(block_n=16, block_v=4096, block_d=16)
    got = lce_forward(*d, ignore_index=-100, need_weighted_sum=True, num_splits=2, **blocks)
    gold = _ref_linear(inp, weight, bias, target, torch.float64, ignore_index=-100)
    zmag = _magnitudes(inp, weight, bias, 1.0)
    _check_stats(got, gold, None, zmag)
    g = torch.full((N,), 0.25)
    grads = lce_backward(*d, got[0], got[2], *_dev(g, g), None, ignore_index=-100, **blocks)
    gold = _ref_linear(inp, weight, bias, target, torch.float64, ignore_index=-100, a=g, b=g)
    _check_grads(grads, gold, None, _grad_mag(gold, g, g, None, zmag, 1.0), inp, weight, op_eps=0.0)


def _collapse_problem(N=16, V=64, D=64):
    """bf16, logits ~1e3 with the target ahead of the rest by >~ 20: p_target rounds to 1 in fp32."""
    g = torch.Generator().manual_seed(7)
    c = torch.randn(V, D, generator=g) * 0.5
    c[:, 0] = 1000.0
    target = torch.randint(0, V, (N,), generator=g)
    e = 2.5 * c[target]
    e[:, 0] = 1.0
    return e.to(torch.bfloat16), c.to(torch.bfloat16), target


def test_softmax_collapse_bf16():
    inp, weight, target = _collapse_problem()
    N, V = target.numel(), weight.shape[0]
    d_inp, d_w, d_t = _dev(inp, weight, target)
    z32 = torch.empty(N, V, device=DEVICE)
    lse, tgt, om, _ = lce_forward(d_inp, d_w, None, d_t, ignore_index=-100, logits_out=z32, **SMALL)
    gold = _ref_linear(inp, weight, None, target, torch.float64, ignore_index=-100)
    assert (gold["z"].amax(1) > 900).all()
    assert (gold["om"] < 2**-25).all() and (gold["om"] > 0).all()  # 1 - p_t rounds to 0 in fp32 ...
    assert (om > 0).all()  # ... but other_mass does not
    _check_stats((lse, tgt, om, None), gold, None, _magnitudes(inp, weight, None, 1.0), need_ws=False)
    torch.testing.assert_close(om.cpu().double(), gold["om"], rtol=1e-2, atol=0)
    # G per row: sums to ~0, the target entry is non-zero (= -other_mass)
    ones = torch.ones(N, device=DEVICE)
    G = ce_backward(z32, d_t, lse, om, ones, ones, None, ignore_index=-100, block_n=4, block_v=32).cpu().double()
    gt = G.gather(1, target[:, None])[:, 0]
    assert (gt < 0).all()
    torch.testing.assert_close(-gt, gold["om"], rtol=1e-2, atol=0)
    assert (G.sum(1).abs() <= 1e-3 * G.abs().sum(1)).all()
    # through the matmul: weight[:, 0] = 1000 for every class, so grad_input[:, 0] = 1000 * sum_j G_ij ~ 0 (both
    # modes: the gemm mode's logits chunk is fp32, as the forward's)
    om_gold = gold["om"]
    gold = _ref_linear(inp, weight, None, target, torch.float64, ignore_index=-100, a=ones.cpu(), b=ones.cpu())
    one = torch.ones(N)
    for mode in triton_backward.MODES:
        gi, gw, _ = lce_backward(d_inp, d_w, None, d_t, lse, om, ones, ones, None, ignore_index=-100,
                                 input_grad_dtype=torch.float32, mode=mode, **SMALL)
        assert (gi[:, 0].abs().cpu().double() <= 0.02 * 1000 * om_gold).all(), mode
        assert gw.abs().amax() > 0
        _check_grads((gi, gw, None), gold, None,
                     _grad_mag(gold, one, one, None, _magnitudes(inp, weight, None, 1.0), 1.0),
                     inp, weight, op_eps=torch.finfo(torch.bfloat16).eps)


def test_logits_out_saved_logits_and_grad_logits():
    """logits_out (strided rows, bf16 and fp32), backward from the saved z, and an extra
    gradient w.r.t. z (strided bf16)."""
    N, V, D = 21, 150, 24
    scale, softcap = 1.3, 4.0
    inp, weight, bias, target = _problem(N, V, D, torch.float32, seed=8, wscale=2.0)
    d = _dev(inp, weight, bias, target)
    kw = dict(ignore_index=-100, scale=scale, softcap=softcap)
    buf = torch.full((N, 2 * V), 7.0, dtype=torch.bfloat16, device=DEVICE)
    out16 = buf[:, 1 : V + 1]
    got16 = lce_forward(*d, logits_out=out16, **kw, **SMALL)
    out32 = torch.empty(V, N, device=DEVICE).t()  # column-major: stride(1) != 1
    got32 = lce_forward(*d, logits_out=out32, **kw, **SMALL)
    for x, y in zip(got16[:3], got32[:3]):
        assert torch.equal(x, y)
    gold = _ref_linear(inp, weight, bias, target, torch.float64, **kw)
    zmag = _magnitudes(inp, weight, bias, scale)
    _assert_gold(out32, None, gold["z"], 8 * EPS32 * (zmag + gold["z"].abs()), "logits_out fp32")
    _assert_gold(out16, gold["z"].to(torch.bfloat16), gold["z"], 8 * EPS32 * zmag, "logits_out bf16")
    assert (buf[:, 0] == 7).all() and (buf[:, V + 1 :] == 7).all()

    lse, _, om, _ = got32
    a, b, c = _coefs(N, target, -100)
    gl = (torch.randn(N, 2 * V, generator=torch.Generator().manual_seed(9)) * 0.1)[:, ::2].to(torch.bfloat16)
    da, db, dc, dgl = _dev(a, b, c, gl)
    gold = _ref_linear(inp, weight, bias, target, torch.float64, a=a, b=b, c=c, grad_logits=gl, **kw)
    gmag = _grad_mag(gold, a, b, c, zmag, scale, grad_logits=gl)
    recomputed = lce_backward(*d, lse, om, da, db, dc, grad_logits=dgl, **kw, **SMALL)
    _check_grads(recomputed, gold, None, gmag, inp, weight, op_eps=0.0)
    saved = lce_backward(*d, lse, om, da, db, dc, logits=out32, grad_logits=dgl, **kw, **SMALL)
    _check_grads(saved, gold, None, gmag, inp, weight, op_eps=0.0)
    # from the bf16-rounded saved z: within bf16 rounding of z
    saved16 = lce_backward(*d, lse, om, da, db, dc, logits=out16, grad_logits=dgl, **kw, **SMALL)
    _check_grads(saved16, gold, None, gmag, inp, weight, op_eps=2 * torch.finfo(torch.bfloat16).eps)
    # grad_logits disables filtering (its term is never skipped)
    filt = lce_backward(*d, lse, om, da, db, dc, grad_logits=dgl, filter_eps=1e9, **kw, **SMALL)
    for x, y in zip(filt, recomputed):
        assert torch.equal(x, y)


def test_gradient_filtering():
    """filter_eps=None is exact; a huge filter_eps keeps exactly the tiles holding a target
    (checked against the gold with those tiles zeroed); a tiny one changes nothing measurable."""
    N, V, D = 40, 256, 16
    inp, weight, bias, target = _problem(N, V, D, torch.float32, seed=10, frac_ignored=0.0, wscale=6.0)
    target[:16] = -100  # a whole row block ignored: its tiles have G == 0 and no target
    target[16:] = target[16:] % 100  # no target in vocab blocks 2 and 3 (block_v=64)
    d = _dev(inp, weight, bias, target)
    lse, _, om, _ = lce_forward(*d, ignore_index=-100, **SMALL)
    a, b, c = _coefs(N, target, -100, with_c=False)
    da, db = _dev(a, b)
    # tiles are the fused kernel's filter (the gemm mode's, by columns: test_triton_lce_backward_modes.py)
    exact = lce_backward(*d, lse, om, da, db, None, ignore_index=-100, mode="fused", **SMALL)
    gold = _ref_linear(inp, weight, bias, target, torch.float64, ignore_index=-100, a=a, b=b)
    zmag = _magnitudes(inp, weight, bias, 1.0)
    gmag = _grad_mag(gold, a, b, None, zmag, 1.0)
    _check_grads(exact, gold, None, gmag, inp, weight, op_eps=0.0)

    tiny = lce_backward(*d, lse, om, da, db, None, ignore_index=-100, filter_eps=1e-30, mode="fused", **SMALL)
    for x, y in zip(tiny, exact):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7)
    small = lce_backward(*d, lse, om, da, db, None, ignore_index=-100, filter_eps=1e-9, mode="fused", **SMALL)
    _check_grads(small, gold, None, gmag, inp, weight, op_eps=0.0)

    # huge eps: only tiles with a target entry survive
    bn, bv = SMALL["block_n"], SMALL["block_v"]
    keep = torch.zeros(N, V, dtype=torch.bool)
    for i in range(0, N, bn):
        for j in range(0, V, bv):
            keep[i : i + bn, j : j + bv] = gold["onehot"][i : i + bn, j : j + bv].any()
    assert 0 < keep.float().mean() < 1
    G = a.double()[:, None] * gold["p"] - b.double()[:, None] * gold["onehot"]
    G = G * keep
    gx_gold = (G @ weight.double(), G.T @ inp.double(), G.sum(0))
    huge = lce_backward(*d, lse, om, da, db, None, ignore_index=-100, filter_eps=1e9, mode="fused", **SMALL)
    assert (huge[1][128:] == 0).all() and (huge[2][128:] == 0).all()
    gm = gmag * keep
    _assert_gold(huge[0], None, gx_gold[0], 8 * EPS32 * (gm @ weight.double().abs()), "filtered grad_input")
    _assert_gold(huge[1], None, gx_gold[1], 8 * EPS32 * (gm.T @ inp.double().abs()), "filtered grad_weight")
    _assert_gold(huge[2], None, gx_gold[2], 8 * EPS32 * gm.sum(0), "filtered grad_bias")
    assert not torch.allclose(huge[0], exact[0])


def test_empty():
    inp = torch.empty(0, 8, device=DEVICE)
    w = torch.randn(5, 8, device=DEVICE)
    t = torch.empty(0, dtype=torch.int64, device=DEVICE)
    lse, tgt, om, ws = lce_forward(inp, w, None, t, ignore_index=-100, need_weighted_sum=True)
    assert lse.shape == tgt.shape == om.shape == ws.shape == (0,)
    e = torch.empty(0, device=DEVICE)
    gi, gw, gb = lce_backward(inp, w, None, t, e, e, e, e, None, ignore_index=-100)
    assert gi.shape == (0, 8) and (gw == 0).all() and gb is None
    # V == 0: lse = -inf, the (non-ignored) targets are out of range
    t = torch.tensor([0, -100], device=DEVICE)
    lse, tgt, om, _ = ce_forward(torch.empty(2, 0, device=DEVICE), t, ignore_index=-100)
    assert (lse == -INF).all() and torch.isnan(tgt[0]) and tgt[1] == 0 and (om == 0).all()


# ----------------------------------------------------------------------------- logits given


def _ce_gold_grad(x, target, a, b, c, *, ignore_index, scale, softcap, cw, dtype):
    xx = x.detach().cpu().to(dtype).requires_grad_(True)
    z = _transform(xx, scale, softcap)
    out = _ref_from_z(z, target, ignore_index=ignore_index, cw=cw, a=a, b=b, c=c, wrt=[xx])
    return out["grads"][0], out


@pytest.mark.parametrize("layout", ["transposed", "sliced", "expanded"])
def test_ce_forward_backward_strided(layout):
    """ce_forward / ce_backward on non-contiguous logits (stride(1) != 1 included)."""
    N, V = 23, 300
    g = torch.Generator().manual_seed(11)
    kw = dict(ignore_index=-1, scale=0.8, softcap=6.0)
    if layout == "transposed":
        x = (torch.randn(V, N, generator=g) * 3).to(torch.bfloat16).t()
    elif layout == "sliced":
        x = (torch.randn(N + 3, 2 * V, generator=g) * 3)[2:-1, ::2]
    else:
        x = (torch.randn(1, V, generator=g) * 3).expand(N, V)
    assert not x.is_contiguous()
    target = torch.randint(0, V, (N,), generator=g)
    target[::4] = -1
    cw = torch.rand(V, generator=g) + 0.5
    dx, dt, dcw = _dev(x, target, cw)
    got = ce_forward(dx, dt, class_weight=dcw, need_weighted_sum=True, block_n=4, block_v=64, num_splits=2, **kw)
    a, b, c = _coefs(N, target, -1)
    gold_g, gold = _ce_gold_grad(x, target, a, b, c, cw=cw, dtype=torch.float64, **kw)
    ref_g, ref = _ce_gold_grad(x, target, a, b, c, cw=cw, dtype=x.dtype, **kw)
    gold["z"] = _transform(x.double(), kw["scale"], kw["softcap"])
    for r in (gold, ref):
        r["lse"], r["tgt"], r["om"], r["ws"] = (r[k].detach() for k in ("lse", "tgt", "om", "ws"))
    zmag = abs(kw["scale"]) * x.double().abs()
    _check_stats(got, gold, ref, zmag)
    lse, _, om, _ = got
    for out_dtype in (None, torch.float32):
        gx = ce_backward(dx, dt, lse, om, *_dev(a, b, c), class_weight=dcw, out_dtype=out_dtype, block_n=4,
                         block_v=64, **kw)
        assert gx.is_contiguous() and gx.shape == (N, V) and gx.dtype == (out_dtype or x.dtype)
        gmag = _grad_mag(gold, a, b, c, zmag, kw["scale"])
        out_eps = torch.finfo(gx.dtype).eps
        _assert_gold(gx, ref_g if out_dtype is None else None, gold_g, 8 * EPS32 * gmag + out_eps * gold_g.abs(),
                     "ce grad")


def test_ce_special_values():
    """Rows of all -inf, with NaN, with +inf: lse follows torch.logsumexp; nothing hangs."""
    x = torch.randn(6, 40, generator=torch.Generator().manual_seed(12))
    x[0] = -INF
    x[1, 3] = NAN
    x[2, 5] = INF
    x[3, :20] = -INF  # -inf blocks before finite ones (block_v=8)
    x[4, 8:16] = -INF
    x[5] = -INF
    x[5, 39] = -1e4
    target = torch.tensor([1, 2, 3, 30, 0, 39])
    dx, dt = _dev(x, target)
    for splits in (1, 3):
        lse, tgt, om, _ = ce_forward(dx, dt, ignore_index=-100, block_n=2, block_v=8, num_splits=splits)
        ref = torch.logsumexp(x.double(), -1)
        assert torch.equal(torch.isnan(lse.cpu()), torch.isnan(ref))
        fin = torch.isfinite(ref)
        assert torch.equal(lse.cpu()[~fin & ~torch.isnan(ref)].double(), ref[~fin & ~torch.isnan(ref)])
        torch.testing.assert_close(lse.cpu().double()[fin], ref[fin], rtol=1e-6, atol=1e-5)
        assert torch.isfinite(om[3:]).all() and tgt[5] == -1e4
        torch.testing.assert_close(om.cpu()[5], torch.tensor(0.0))


# ----------------------------------------------------------------------------- errors, import, GPU compile


def test_errors(monkeypatch):
    inp, w, b, t = _dev(*_problem(4, 32, 16, torch.float32))
    kw = dict(ignore_index=-100)
    with pytest.raises(TypeError, match="share a dtype"):
        lce_forward(inp, w.half(), b, t, **kw)
    with pytest.raises(ValueError, match="share D"):
        lce_forward(inp, w[:, :8], b, t, **kw)
    with pytest.raises(TypeError, match="int64 or int32"):
        lce_forward(inp, w, b, t.float(), **kw)
    with pytest.raises(ValueError, match="target"):
        lce_forward(inp, w, b, t[:3], **kw)
    with pytest.raises(ValueError, match="bias"):
        lce_forward(inp, w, b[:5], t, **kw)
    with pytest.raises(TypeError, match="float16, bfloat16 or float32"):
        lce_forward(inp.double(), w.double(), None, t, **kw)
    with pytest.raises(ValueError, match="2-D"):
        lce_forward(inp[0], w, b, t, **kw)
    with pytest.raises(ValueError, match="softcap"):
        lce_forward(inp, w, b, t, softcap=0.0, **kw)
    with pytest.raises(ValueError, match="class_weight"):
        lce_forward(inp, w, b, t, class_weight=torch.ones(3, device=DEVICE), **kw)
    with pytest.raises(ValueError, match="logits_out"):
        lce_forward(inp, w, b, t, logits_out=torch.empty(4, 31, device=DEVICE), **kw)
    with pytest.raises(ValueError, match="block_v"):
        lce_forward(inp, w, b, t, block_v=8, **kw)
    with pytest.raises(ValueError, match="block_n"):
        ce_forward(torch.zeros(4, 32, device=DEVICE), t, block_n=3, **kw)
    with pytest.raises(TypeError, match="ignore_index"):
        lce_forward(inp, w, b, t, ignore_index=None)
    v = torch.zeros(4, device=DEVICE)
    with pytest.raises(ValueError, match="coef_a"):
        lce_backward(inp, w, b, t, v, v, v[:2], v, None, **kw)
    with pytest.raises(ValueError, match="filter_eps"):
        lce_backward(inp, w, b, t, v, v, v, v, None, filter_eps=-1.0, **kw)
    with pytest.raises(ValueError, match="grad_logits"):
        lce_backward(inp, w, b, t, v, v, v, v, None, grad_logits=torch.zeros(4, 3, device=DEVICE), **kw)
    with pytest.raises(TypeError, match="logits"):
        ce_forward(torch.zeros(4, 32, dtype=torch.int64, device=DEVICE), t, **kw)
    if DEVICE == "cpu":
        monkeypatch.delenv("TRITON_INTERPRET")
        with pytest.raises(RuntimeError, match="CUDA or TRITON_INTERPRET=1"):
            lce_forward(inp, w, b, t, **kw)
        with pytest.raises(RuntimeError, match="CUDA or TRITON_INTERPRET=1"):
            ce_backward(torch.zeros(4, 32), t, v, v, v, v, None, **kw)


def test_module_imports_without_triton(import_without_triton):
    """Loading the module with triton unavailable works; the launchers then raise clearly."""
    mod = import_without_triton("smxcompile.kernels.cross_entropy.triton_common",
                                "smxcompile.kernels.cross_entropy.triton_forward")
    assert mod.triton is None
    inp, w, t = torch.zeros(2, 16), torch.zeros(4, 16), torch.zeros(2, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="need triton"):
        mod.lce_forward(inp, w, None, t, ignore_index=-100)
    with pytest.raises(RuntimeError, match="need triton"):
        mod.ce_forward(torch.zeros(2, 4), t, ignore_index=-100)


def test_offsets_are_int64_in_source():
    """Every row / column / k index that multiplies a stride starts as an int64 arange or
    program id (the compiled-IR check below verifies the result for the GPU)."""
    src = "".join(inspect.getsource(m) for m in (triton_common, triton_forward, triton_backward))
    assert src.count("tl.arange(0, BLOCK_N).to(tl.int64)") >= 2
    assert src.count("tl.arange(0, BLOCK_V).to(tl.int64)") >= 2
    assert src.count("tl.arange(0, BLOCK_D).to(tl.int64)") >= 2
    assert "pid_n.to(tl.int64) * BLOCK_N" in src and "pid_v.to(tl.int64) * BLOCK_V" in src


def test_kernels_compile_for_cuda():
    """Compile the kernels for sm_90 (no GPU needed): the interpreter is lax about types. Also
    check in the TTIR that every pointer offset is int64 and no int32 tensor multiply exists,
    and that the default tiles fit in 96 KiB of shared memory."""
    compile_for_sm90(
        """
        from smxcompile.kernels.cross_entropy import triton_backward as b, triton_common as c, triton_forward as f
        FLOATS = {"scale", "softcap", "filter_eps"}
        def sig(fn, types, cs):
            return {n: "constexpr" if n in cs else types.get(n, "fp32" if n in FLOATS else
                    "*fp32" if n.endswith("_ptr") else "i32") for n in fn.arg_names}
        n = 0
        def comp(fn, types, cs, **opts):
            global n
            cs = dict(cs, DOT_F32=False, FIX_BF16=False)  # interpreter-only workarounds
            k = triton.compile(triton.compiler.ASTSource(fn, sig(fn, types, cs), constexprs=cs), target=target,
                               options=opts)
            ttir = k.asm["ttir"]
            for line in ttir.splitlines():
                mt = re.search(r"tt\\.addptr %[^,]+, %[^ ]+ : [^,]+, ([^ ]+?)(?: loc|$)", line.strip())
                if mt:
                    assert mt.group(1).endswith("i64>") or mt.group(1) == "i64", line
                assert not ("arith.muli" in line and "xi32>" in line), line
            assert k.metadata.shared <= 96 * 1024, (fn.__name__, cs, k.metadata.shared)
            n += 1
        fwd, bwd = f._fwd_kernel, b._bwd_kernel
        for dt, prec in [("bf16", "ieee"), ("fp32", "tf32x3"), ("fp16", "ieee")]:
            bn, bv, bd = f._FWD_BLOCKS_32 if dt == "fp32" else f._FWD_BLOCKS_16
            cs = dict(FROM_MATMUL=True, HAS_BIAS=True, HAS_SOFTCAP=dt != "fp16", HAS_CW=True, NEED_WS=dt == "bf16",
                      WRITE_LOGITS=dt != "fp16", NEED_ARGMAX=dt != "fp32", BLOCK_N=bn, BLOCK_V=bv, BLOCK_D=bd,
                      PREC=prec)
            comp(fwd, {"src_ptr": "*" + dt, "w_ptr": "*" + dt, "bias_ptr": "*" + dt, "tgt_ptr": "*i64",
                       "out_ptr": "*bf16", "am_ptr": "*i64", "N": "i64" if dt == "fp32" else "i32"}, cs,
                 num_warps=f._FWD_WARPS, num_stages=f._FWD_STAGES)
        cs = dict(FROM_MATMUL=False, HAS_BIAS=False, HAS_SOFTCAP=True, HAS_CW=False, NEED_WS=False,
                  WRITE_LOGITS=False, NEED_ARGMAX=False, BLOCK_N=c.CE_BLOCKS[0], BLOCK_V=c.CE_BLOCKS[1], BLOCK_D=1, PREC="ieee")
        comp(fwd, {"src_ptr": "*bf16", "tgt_ptr": "*i32"}, cs, num_warps=c.CE_WARPS)
        for dt, zf, filt, prec in [("bf16", 0, True, "ieee"), ("fp32", 2, False, "tf32x3"),
                                   ("fp16", 2, True, "ieee"), ("fp32", 0, True, "ieee")]:
            bn, bv, bd = (b._BWD_BLOCKS_32 if dt == "fp32" else b._BWD_BLOCKS_16 if zf != 2
                          else b._BWD_BLOCKS_16_SAVED)
            cs = dict(Z_FROM=zf, HAS_BIAS=True, HAS_SOFTCAP=True, HAS_CW=True, HAS_C=True, HAS_GL=zf == 2,
                      FILTER=filt, NEED_GI=True, NEED_GW=True, NEED_GB=True, WRITE_GX=False, GROUP_N=b._GROUP_N,
                      SPLIT_GX=dt != "fp32", BLOCK_N=bn, BLOCK_V=bv, BLOCK_D=bd, PREC=prec)
            comp(bwd, {"src_ptr": "*bf16", "e_ptr": "*" + dt, "w_ptr": "*" + dt, "bias_ptr": "*" + dt,
                       "tgt_ptr": "*i64", "ignore_index": "i64", "D": "i64" if zf else "i32"}, cs,
                 num_warps=b._BWD_WARPS, num_stages=b._BWD_STAGES)
        cs = dict(Z_FROM=1, HAS_BIAS=False, HAS_SOFTCAP=True, HAS_CW=True, HAS_C=True, HAS_GL=False, FILTER=False,
                  NEED_GI=False, NEED_GW=False, NEED_GB=False, WRITE_GX=True, GROUP_N=b._GROUP_N, SPLIT_GX=False,
                  BLOCK_N=c.CE_BLOCKS[0], BLOCK_V=c.CE_BLOCKS[1], BLOCK_D=1, PREC="ieee")
        comp(bwd, {"src_ptr": "*fp16", "gx_ptr": "*bf16", "tgt_ptr": "*i32"}, cs, num_warps=c.CE_WARPS)
        # lce_backward's gemm mode: the fp32 logits chunk plus the bias, or the saved z, with grad_logits; G as
        # hi + lo (bf16)
        for zf in (1, 2):
            cs = dict(cs, Z_FROM=zf, HAS_BIAS=zf == 1, HAS_GL=True, SPLIT_GX=True)
            comp(bwd, {"src_ptr": "*fp32", "bias_ptr": "*bf16", "gl_ptr": "*bf16", "gx_ptr": "*bf16",
                       "gxl_ptr": "*bf16", "tgt_ptr": "*i64"}, cs, num_warps=c.CE_WARPS)
        # the split merge with S splits, and with one split: a launch passes S == 1 as a constexpr (Triton
        # specializes integer arguments equal to 1), which ce_forward on 8192 x 128256 did on an H200
        for S in (1, None):
            cs = dict(NEED_WS=True, NEED_ARGMAX=True, BLOCK=f._MERGE_BLOCK) | ({"S": S} if S else {})
            types = {"am_ptr": "*i64", "tgt_ptr": "*i64", "amx_ptr": "*i64", "ignore_index": "i64"}
            triton.compile(triton.compiler.ASTSource(f._merge_kernel, sig(f._merge_kernel, types, cs), constexprs=cs),
                           target=target)
            n += 1
        print("compiled", n)
        """,
        compiled=13,
    )


@pytest.mark.parametrize("softcap,label_smoothing,return_logits", [(None, 0.0, False), (5.0, 0.1, True)])
def test_public_functions_route_to_triton(monkeypatch, softcap, label_smoothing, return_logits):
    """smxcompile.linear_cross_entropy / cross_entropy with the Triton path forced give the torch path's results."""
    from smxcompile.kernels import config
    from smxcompile.kernels import cross_entropy as ce

    torch.manual_seed(0)
    n, d, v = 19, 24, 300
    x = torch.randn(n, d, device=DEVICE, requires_grad=True)
    w = (torch.randn(v, d, device=DEVICE) * 0.3).requires_grad_()
    b = torch.randn(v, device=DEVICE, requires_grad=True)
    y = torch.randint(0, v, (n,), device=DEVICE)
    y[::4] = -100

    def run(force):
        monkeypatch.setattr(config, "force_triton", force)
        calls = []
        for mod, name in ((triton_forward, "lce_forward"), (triton_backward, "lce_backward")):
            real = getattr(mod, name)
            monkeypatch.setattr(mod, name, lambda *a, _r=real, _n=name, **k: (calls.append(_n), _r(*a, **k))[1])
        loss, zl, _, logits = ce.linear_ce_core(
            x, w, b, y, None, None, None, -100, "mean", label_smoothing, 1e-3, 1.0, softcap, return_logits,
            None, ce.DEFAULT_CHUNK_BYTES, need_lse=force)  # need_lse: the stats path (the one CUDA takes)
        loss = loss + zl  # the fused path's gradient covers loss + z-loss (public callers always add them)
        total = loss + (logits.float().square().mean() * 1e-3 if return_logits else 0.0)
        grads = torch.autograd.grad(total, (x, w, b))
        return loss.detach(), grads, calls

    l_t, g_t, calls = run(True)
    assert "lce_forward" in calls and "lce_backward" in calls
    l_c, g_c, calls_c = run(False)
    if DEVICE == "cpu":
        assert not calls_c  # the torch (fused CPU) path
    torch.testing.assert_close(l_t, l_c, rtol=1e-5, atol=1e-5)
    for a, c in zip(g_t, g_c):
        torch.testing.assert_close(a, c, rtol=1e-4, atol=1e-5)
