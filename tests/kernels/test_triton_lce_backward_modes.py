"""The two modes of lce_backward ("fused": per-tile atomics; "gemm": row chunks, the logit gradient written by the
Triton kernel, the products by matmuls) against an fp64 gold and torch's own backward.

Through Triton's interpreter on CPU tensors (tests/conftest.py), small shapes. Accuracy rule, elementwise:
``|ours - gold| <= |torch - gold| + tol``, ``torch`` being autograd of ``F.cross_entropy(F.linear(...))`` in the
input dtype and ``tol`` a few ulps of fp32 accumulation and of the operand dtype times the size of the summed terms.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from kernels_testing import CCE_TOL, DEVICE, TRITON_MARKS, require_triton

require_triton()

from smxcompile.kernels.cross_entropy import triton_backward  # noqa: E402
from smxcompile.kernels.cross_entropy.triton_backward import MODES, backward_mode, lce_backward  # noqa: E402
from smxcompile.kernels.cross_entropy.triton_backward_gemm import (ROW_ALIGN, addmm_into,  # noqa: E402
                                                                   chunked_gemm_backward, gemm_rows, mm_into)
from smxcompile.kernels.cross_entropy.triton_forward import lce_forward  # noqa: E402

pytestmark = TRITON_MARKS

EPS32 = torch.finfo(torch.float32).eps
#: small blocks: several row and vocabulary blocks per kernel launch
SMALL = dict(block_n=16, block_v=64)


def _chunk(V, dtype, rows):
    """chunk_bytes giving ``rows`` rows per gemm-mode chunk (fp32 logits + G, as hi + lo for 16-bit inputs)."""
    return rows * V * (4 + dtype.itemsize * (1 if dtype == torch.float32 else 2))


def _problem(N, V, D, dtype, *, bias, ignore_index, seed=0, wscale=2.0):
    g = torch.Generator().manual_seed(seed)
    inp = torch.randn(N, D, generator=g).to(dtype)
    weight = (torch.randn(V, D, generator=g) * (wscale / math.sqrt(D))).to(dtype)
    b = torch.randn(V, generator=g).to(dtype) if bias else None
    target = torch.randint(0, V, (N,), generator=g)
    target[torch.rand(N, generator=g) < 0.25] = ignore_index
    target[:2] = ignore_index
    return inp, weight, b, target


def _logits(leaves, scale, softcap):
    z = F.linear(*leaves) * scale
    return softcap * torch.tanh(z / softcap) if softcap is not None else z


def _torch_ce(inp, weight, bias, target, dtype, *, scale, softcap, ignore_index, cw, smoothing):
    """Autograd of the mean cross-entropy in ``dtype``: ``(grads, z)``."""
    leaves = [t.detach().cpu().to(dtype).requires_grad_(True) for t in (inp, weight, bias) if t is not None]
    z = _logits(leaves + [None] * (3 - len(leaves)), scale, softcap)
    loss = F.cross_entropy(z, target.cpu(), weight=None if cw is None else cw.to(dtype), ignore_index=ignore_index,
                           label_smoothing=smoothing)
    grads = list(torch.autograd.grad(loss, leaves)) + [None] * (3 - len(leaves))
    return grads, z.detach()


def _ce_coefs(target, cw, V, ignore_index, smoothing):
    """lce_backward's a, b, c of the mean (weighted, label-smoothed) cross-entropy: per valid row,
    ``((1 - eps) w_y (lse - z_y) + eps / V (lse sum(w) - sum_j w_j z_j)) / sum_valid w_y``."""
    valid = target != ignore_index
    w = torch.ones(V, dtype=torch.float64) if cw is None else cw.double()
    wy = torch.where(valid, w[target.clamp(0, V - 1)], 0.0)
    den = wy.sum()
    b = (1 - smoothing) * wy / den
    a = b + valid * (smoothing * w.sum() / V) / den
    c = (valid * (smoothing / V) / den) if smoothing else None
    return a.float(), b.float(), (c.float() if c is not None else None)


def _tolerances(z64, target, ignore_index, cw, a, b, c, inp, weight, scale, op_eps, extra=None, K=8.0):
    """Per-element tolerances of grad_input / grad_weight / grad_bias: K ulps (fp32 + the operand dtype) of the
    summed terms, each term of G (``extra``: more of them, N x V) inflated by (1 + max|z|) for the logits' own
    rounding."""
    N, V = z64.shape
    p = torch.softmax(z64, -1)
    valid = (target != ignore_index) & (target >= 0) & (target < V)
    onehot = torch.zeros(N, V, dtype=torch.bool)
    onehot[valid.nonzero()[:, 0], target[valid]] = True
    om = p.masked_fill(onehot, 0.0).sum(-1, keepdim=True)
    a, b = a.double().abs()[:, None], b.double().abs()[:, None]
    m = a * p + onehot * (b + a * om)
    if c is not None:
        w = torch.ones(V, dtype=torch.float64) if cw is None else cw.double()
        m = m + c.double().abs()[:, None] * w[None, :]
    if extra is not None:
        m = m + extra
    m = abs(scale) * (1 + z64.abs().amax(1, keepdim=True)) * m
    e = K * (EPS32 + op_eps)
    return e * (m @ weight.double().abs()), e * (m.T @ inp.double().abs()), e * m.sum(0)


def _assert_gold(ours, ref, gold, tol, what):
    """|ours - gold| <= |ref - gold| + tol (+ one rounding of the result's dtype), elementwise."""
    ours, gold = ours.detach().cpu().double(), gold.detach().double()
    assert ours.shape == gold.shape, what
    allowed = tol + torch.finfo(ours.dtype if ours.dtype != torch.float64 else torch.float32).eps * gold.abs()
    if ref is not None:
        allowed = allowed + (ref.detach().double() - gold).abs()
    excess = (ours - gold).abs() - allowed
    assert torch.isfinite(ours).all() and (excess <= 0).all(), f"{what}: max excess {excess.max().item():.3e}"


CONFIGS = [
    # dtype, bias, class_weight, label smoothing, softcap, scale, ignore_index
    (torch.float32, True, False, 0.0, None, 1.0, -100),
    (torch.float32, False, True, 0.1, 4.0, 1.3, 3),
    (torch.bfloat16, True, True, 0.1, None, 1.0, -100),
    (torch.bfloat16, True, False, 0.0, 6.0, 0.8, 5),
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype,has_bias,has_cw,smoothing,softcap,scale,ignore_index", CONFIGS,
                         ids=lambda v: str(v).replace("torch.", ""))
def test_cross_entropy_grads(mode, dtype, has_bias, has_cw, smoothing, softcap, scale, ignore_index):
    """Both modes against the fp64 gold and torch's backward: ignored rows, class weights with label smoothing
    (the c term), softcap, scale; the gemm mode over several row chunks (the last one partial)."""
    N, V, D = 37, 260, 40
    inp, weight, bias, target = _problem(N, V, D, dtype, bias=has_bias, ignore_index=ignore_index)
    cw = torch.rand(V, generator=torch.Generator().manual_seed(3)) + 0.5 if has_cw else None
    kw = dict(ignore_index=ignore_index, scale=scale, softcap=softcap)
    d_inp, d_w, d_b, d_t = (None if t is None else t.to(DEVICE) for t in (inp, weight, bias, target))
    lse, _, om, _ = lce_forward(d_inp, d_w, d_b, d_t, **kw)
    a, b, c = _ce_coefs(target, cw, V, ignore_index, smoothing)
    got = lce_backward(d_inp, d_w, d_b, d_t, lse, om, a.to(DEVICE), b.to(DEVICE), None if c is None else c.to(DEVICE),
                       class_weight=None if cw is None else cw.to(DEVICE), mode=mode,
                       chunk_bytes=_chunk(V, dtype, 8), **kw, **SMALL)
    assert [None if g is None else g.dtype for g in got] == [dtype, dtype, dtype if has_bias else None]
    ce = dict(kw, cw=cw, smoothing=smoothing)
    gold, z64 = _torch_ce(inp, weight, bias, target, torch.float64, **ce)
    ref, _ = _torch_ce(inp, weight, bias, target, dtype, **ce)
    op_eps = torch.finfo(dtype).eps if dtype != torch.float32 else 0.0
    tols = _tolerances(z64, target, ignore_index, cw, a, b, c, inp, weight, scale, op_eps)
    for name, ours, r, g, tol in zip(("grad_input", "grad_weight", "grad_bias"), got, ref, gold, tols):
        if g is not None:
            _assert_gold(ours, r, g, tol, f"{mode} {name}")


def test_modes_agree_fp32():
    """fp32: the two modes compute the same gradients up to fp32 summation order."""
    N, V, D = 29, 200, 24
    inp, weight, bias, target = _problem(N, V, D, torch.float32, bias=True, ignore_index=-100, seed=4)
    lse, _, om, _ = lce_forward(inp, weight, bias, target, ignore_index=-100, softcap=5.0)
    g = torch.rand(N, generator=torch.Generator().manual_seed(5))
    args = (inp, weight, bias, target, lse, om, g, g, 0.01 * g)
    fused = lce_backward(*args, ignore_index=-100, softcap=5.0, mode="fused", **SMALL)
    gemm = lce_backward(*args, ignore_index=-100, softcap=5.0, mode="gemm", chunk_bytes=_chunk(V, torch.float32, 5))
    for x, y in zip(fused, gemm):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


def test_gemm_need_flags_and_result_dtypes():
    """need_* flags and result dtypes in the gemm mode: the same numbers, computed once in fp32 and rounded."""
    N, V, D = 21, 150, 32
    inp, weight, bias, target = _problem(N, V, D, torch.bfloat16, bias=True, ignore_index=-100, seed=6)
    lse, _, om, _ = lce_forward(inp, weight, bias, target, ignore_index=-100)
    a = torch.rand(N, generator=torch.Generator().manual_seed(7))
    args = (inp, weight, bias, target, lse, om, a, a, None)
    kw = dict(ignore_index=-100, mode="gemm", chunk_bytes=_chunk(V, torch.bfloat16, 6))
    full = lce_backward(*args, **kw)
    f32 = lce_backward(*args, input_grad_dtype=torch.float32, weight_grad_dtype=torch.float32, **kw)
    assert f32[0].dtype == f32[1].dtype == torch.float32 and f32[2].dtype == torch.bfloat16
    assert torch.equal(f32[0].to(torch.bfloat16), full[0]) and torch.equal(f32[1].to(torch.bfloat16), full[1])
    fp16 = lce_backward(*args, input_grad_dtype=torch.float16, weight_grad_dtype=torch.float16, **kw)
    assert torch.equal(fp16[0], f32[0].half()) and torch.equal(fp16[1], f32[1].half())
    gi, gw, gb = lce_backward(*args, need_input_grad=False, need_bias_grad=False, **kw)
    assert gi is None and gb is None and torch.equal(gw, full[1])
    gi, gw, gb = lce_backward(*args, need_input_grad=False, need_weight_grad=False, **kw)
    assert gi is None and gw is None and torch.equal(gb, full[2])
    gi, gw, gb = lce_backward(*args, need_weight_grad=False, need_bias_grad=False, **kw)
    assert gw is None and gb is None and torch.equal(gi, full[0])
    # one chunk (the default budget) gives grad_weight without the cross-chunk accumulator: same within rounding
    one = lce_backward(*args, ignore_index=-100, mode="gemm")
    for x, y in zip(one, full):
        torch.testing.assert_close(x.float(), y.float(), rtol=2**-7, atol=1e-5)


def test_gemm_saved_logits_grad_logits_strided():
    """Saved logits (column-major fp32), an extra gradient w.r.t. z (strided bf16), non-contiguous input and
    weight, in the gemm mode: against the fp64 gold of the generic contract and against the fused mode."""
    N, V, D = 19, 140, 24
    scale, softcap = 1.2, 5.0
    inp, weight, bias, target = _problem(N, V, D, torch.float32, bias=True, ignore_index=-100, seed=8)
    inp_t = inp.t().contiguous().t()  # column-major
    weight_s = torch.stack([weight, weight], 2).flatten(1)[:, ::2]  # stride(1) == 2
    assert torch.equal(weight_s, weight) and not inp_t.is_contiguous() and not weight_s.is_contiguous()
    kw = dict(ignore_index=-100, scale=scale, softcap=softcap)
    z32 = torch.empty(V, N).t()
    lse, _, om, _ = lce_forward(inp_t, weight_s, bias, target, logits_out=z32, **kw)
    g = torch.Generator().manual_seed(9)
    a, b, c = (torch.randn(N, generator=g).masked_fill(target == -100, 0.0) for _ in range(3))
    gl = (torch.randn(N, 2 * V, generator=g) * 0.1)[:, ::2].to(torch.bfloat16)

    leaves = [t.double().requires_grad_(True) for t in (inp, weight, bias)]
    z = _logits(leaves, scale, softcap)
    valid = target != -100
    zt = z.gather(1, target.clamp(min=0)[:, None])[:, 0]
    loss = (a.double() * torch.logsumexp(z, -1)).sum() - (b.double() * torch.where(valid, zt, 0.0)).sum()
    loss = loss - (c.double() * z.sum(-1)).sum() + (gl.double() * z).sum()
    gold = torch.autograd.grad(loss, leaves)
    tols = _tolerances(z.detach(), target, -100, None, a, b, c, inp, weight, scale, 0.0, extra=gl.double().abs())
    runs = {
        "gemm": lce_backward(inp_t, weight_s, bias, target, lse, om, a, b, c, grad_logits=gl, mode="gemm",
                             chunk_bytes=_chunk(V, torch.float32, 4), **kw, **SMALL),
        "gemm saved": lce_backward(inp_t, weight_s, bias, target, lse, om, a, b, c, grad_logits=gl, logits=z32,
                                   mode="gemm", chunk_bytes=_chunk(V, torch.float32, 4), **kw),
        "fused saved": lce_backward(inp_t, weight_s, bias, target, lse, om, a, b, c, grad_logits=gl, logits=z32,
                                    mode="fused", **kw, **SMALL),
    }
    for what, got in runs.items():
        for name, ours, gd, tol in zip(("grad_input", "grad_weight", "grad_bias"), got, gold, tols):
            _assert_gold(ours, None, gd, tol, f"{what} {name}")


@pytest.mark.parametrize("mode", MODES)
def test_empty(mode):
    """N == 0, V == 0, D == 0 in both modes: zeros of the right shapes and dtypes."""
    kw = dict(ignore_index=-100, mode=mode)
    w = torch.randn(5, 8)
    e = torch.empty(0)
    gi, gw, gb = lce_backward(torch.empty(0, 8), w, None, torch.empty(0, dtype=torch.int64), e, e, e, e, None,
                              need_bias_grad=True, **kw)
    assert gi.shape == (0, 8) and gw.shape == (5, 8) and (gw == 0).all() and gb.shape == (5,) and (gb == 0).all()
    v = torch.zeros(3)
    t = torch.tensor([0, -100, 2])
    gi, gw, gb = lce_backward(torch.randn(3, 8), torch.empty(0, 8), torch.empty(0), t, v, v, v, v, None, **kw)
    assert gi.shape == (3, 8) and (gi == 0).all() and gw.shape == (0, 8) and gb.shape == (0,)
    x, w0, b0 = torch.empty(3, 0), torch.empty(4, 0), torch.randn(4)
    lse, _, om, _ = lce_forward(x, w0, b0, t, ignore_index=-100)
    one = torch.ones(3)
    gi, gw, gb = lce_backward(x, w0, b0, t, lse, om, one, one, None, **kw)
    assert gi.shape == (3, 0) and gw.shape == (4, 0)
    p = torch.softmax(b0.double(), 0)
    want = 3 * p - torch.bincount(t[t >= 0], minlength=4).double()  # the ignored row (a = 1): p, no target
    torch.testing.assert_close(gb.double(), want, rtol=1e-5, atol=1e-6)


def test_automatic_mode():
    """None picks "gemm" (which filters too); an explicit mode is honoured, a bad one refused."""
    assert backward_mode(None) == "gemm"
    assert backward_mode("fused") == "fused" and backward_mode("gemm") == "gemm"
    with pytest.raises(ValueError, match="mode"):
        backward_mode("atomic")


def test_lce_backward_routes_by_mode(monkeypatch):
    """lce_backward runs the chunked matmul backward unless the fused kernel is asked for."""
    calls = []
    real = triton_backward.chunked_gemm_backward
    monkeypatch.setattr(triton_backward, "chunked_gemm_backward", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    N, V, D = 6, 40, 16
    inp, weight, bias, target = _problem(N, V, D, torch.float32, bias=False, ignore_index=-100, seed=10)
    lse, _, om, _ = lce_forward(inp, weight, None, target, ignore_index=-100)
    one = torch.ones(N)
    args = (inp, weight, None, target, lse, om, one, one, None)
    lce_backward(*args, ignore_index=-100)
    assert len(calls) == 1
    lce_backward(*args, ignore_index=-100, logits=torch.zeros(N, V))
    lce_backward(*args, ignore_index=-100, filter_eps=1e-9)
    assert len(calls) == 3
    lce_backward(*args, ignore_index=-100, mode="fused")
    lce_backward(*args, ignore_index=-100, filter_eps=1e-9, mode="fused")
    assert len(calls) == 3
    with pytest.raises(ValueError, match="mode"):
        lce_backward(*args, ignore_index=-100, mode="GEMM")
    with pytest.raises(ValueError, match="chunk_bytes"):
        lce_backward(*args, ignore_index=-100, chunk_bytes=0)


@pytest.mark.parametrize("precise", [False, True], ids=["fp32", "bf16-precise"])
def test_gemm_filtering_drops_columns(precise):
    """The gemm mode's filter, per row chunk: a column whose probabilities are all below filter_eps and that
    holds no target leaves the products (the kept columns are gathered); a chunk keeping more than
    COMPACT_KEPT_SHARE of the columns runs whole. Checked against the unfiltered result minus the dropped
    columns' fp64 contribution."""
    g = torch.Generator().manual_seed(21)
    N, V, D = 32, 96, 16
    dt = torch.bfloat16 if precise else torch.float32
    inp = (torch.randn(N, D, generator=g) * 0.3).to(dt)
    weight = (torch.randn(V, D, generator=g) * 0.3).to(dt)
    bias = (torch.randn(V, generator=g) * 0.1).to(dt)
    target = torch.randint(0, V, (N,), generator=g)
    target[20:24] = -100
    lse, _, om, _ = lce_forward(inp, weight, bias, target, ignore_index=-100)
    lse[16:] += 3.0  # rows 16..31 (the second chunk): every probability below eps, only targets kept
    a = torch.rand(N, generator=g) + 0.5
    a[20:24] = 0.0
    eps = 0.25 / V
    f32 = dict(input_grad_dtype=torch.float32, weight_grad_dtype=torch.float32)
    kw = dict(ignore_index=-100, mode="gemm", precise_grad=precise, chunk_bytes=16 * V * 8, **f32, **SMALL)
    args = (inp, weight, bias, target, lse, om, a, a, None)
    exact = lce_backward(*args, **kw)
    got = lce_backward(*args, filter_eps=eps, **kw)

    z = inp.double() @ weight.double().T + bias.double()
    p = torch.exp(z - lse.double()[:, None])
    onehot = torch.zeros(N, V, dtype=torch.bool)
    onehot[target >= 0, target[target >= 0]] = True
    big = (p >= eps) | onehot
    assert big[:16].any(0).float().mean() > 0.75 and big[16:].any(0).float().mean() < 0.75
    dropped = torch.zeros(N, V, dtype=torch.bool)
    dropped[16:] = ~big[16:].any(0)
    g_drop = a.double()[:, None] * p * dropped
    want = (exact[0].double() - g_drop @ weight.double(), exact[1].double() - g_drop.T @ inp.double(),
            exact[2].double() - g_drop.sum(0))
    for name, ours, w, drop in zip(("input", "weight", "bias"), got, want, (g_drop @ weight.double(),
                                                                           g_drop.T @ inp.double(), g_drop.sum(0))):
        tol = 2e-5 * (1 + w.abs().max().item())
        if name == "bias":  # returned in bias's dtype
            tol += torch.finfo(dt).eps * w.abs().max().item()
        assert name == "bias" or drop.abs().max() > 20 * tol, name  # the filter is visible
        torch.testing.assert_close(ours.double(), w, rtol=0, atol=tol, msg=name)


def test_gemm_rows_and_matmul_helpers():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert gemm_rows(10**6, 1000, 6, 6 * 1000 * 300, cpu) == 256  # 300 rows fit: rounded to whole tiles
    assert gemm_rows(10**6, 1000, 6, 6 * 1000 * 200, cpu) == 200  # < 2 * ROW_ALIGN: kept
    assert gemm_rows(10, 1000, 6, 6 * 1000 * 300, cpu) == 10 and gemm_rows(10, 10**9, 6, 1, cpu) == 1
    assert gemm_rows(10**6, 128256, 8, None, cuda) == 1024 and ROW_ALIGN == 128  # the default on a GPU, bf16
    assert gemm_rows(0, 5, 6, None, cpu) == 1
    g = torch.Generator().manual_seed(11)
    a, b = torch.randn(7, 9, generator=g).bfloat16(), torch.randn(9, 5, generator=g).bfloat16()
    want = a.double() @ b.double()
    out = mm_into(torch.empty(7, 5), a, b)
    torch.testing.assert_close(out.double(), want, rtol=1e-6, atol=1e-6)
    assert torch.equal(mm_into(torch.empty(7, 5, dtype=torch.bfloat16), a, b), out.bfloat16())
    acc = out.clone()
    addmm_into(acc, a, b)
    torch.testing.assert_close(acc.double(), 2 * want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("split", [True, False])
def test_chunked_gemm_backward_split(split):
    """The chunk driver alone (a torch write_grad: softmax - onehot), several chunks, the last one partial:
    split=True rounds the results once (CCE's rule against the correctly rounded fp64 gold holds everywhere);
    split=False rounds G to bf16 first, as torch's backward (equal to that computation up to fp32 summation order,
    and the rule fails somewhere)."""
    g = torch.Generator().manual_seed(12)
    N, V, D = 23, 90, 16
    inp = torch.randn(N, D, generator=g).bfloat16()
    weight = (torch.randn(V, D, generator=g) / 2).bfloat16()
    target = torch.randint(0, V, (N,), generator=g)

    def write_grad(r0, r1, src, hi, lo):
        gx = (torch.softmax(src.double(), -1) - F.one_hot(target[r0:r1], V).double()).float()
        hi.copy_(gx)
        if lo is not None:
            lo.copy_(gx - hi.float())

    kw = dict(need_input_grad=True, need_weight_grad=True, need_bias_grad=True, input_grad_dtype=torch.bfloat16,
              weight_grad_dtype=torch.bfloat16, bias_grad_dtype=torch.bfloat16)
    gi, gw, gb = chunked_gemm_backward(inp, weight, None, write_grad, split=split,
                                       chunk_bytes=5 * V * (4 + 2 * (2 if split else 1)), **kw)
    x64 = inp.double() @ weight.double().T
    G = torch.softmax(x64, -1) - F.one_hot(target, V).double()
    gold = (G @ weight.double(), G.T @ inp.double(), G.sum(0))
    for ours, gd in zip((gi, gw, gb), gold):  # CCE's rule against the correctly rounded gold
        ok = (ours.double() - gd).abs() <= (gd.bfloat16().double() - gd).abs() + 1e-5
        assert ok.all() if split else not ok.all()
    if not split:
        Gb = G.float().bfloat16().double()
        torch_like = (Gb @ weight.double(), Gb.T @ inp.double(), Gb.sum(0))
        for ours, t in zip((gi, gw, gb), torch_like):
            torch.testing.assert_close(ours.double(), t.bfloat16().double(), rtol=2**-7, atol=1e-6)
        assert not torch.equal(gi, gold[0].bfloat16())  # G's rounding is visible




def _cce_problem(inp, weight, target):
    """CCE's backward test setup: ``(lce_backward's positional args, kw, fp64 gold grads, torch's grads)`` of the
    mean cross-entropy of ``inp @ weight.T`` (no bias) in the inputs' dtype."""
    kw = dict(ignore_index=-100, scale=1.0, softcap=None)
    d_inp, d_w, d_t = inp.to(DEVICE), weight.to(DEVICE), target.to(DEVICE)
    lse, _, om, _ = lce_forward(d_inp, d_w, None, d_t, **kw)
    a, b, _ = _ce_coefs(target, None, weight.shape[0], -100, 0.0)
    ce = dict(kw, cw=None, smoothing=0.0)
    gold, _ = _torch_ce(inp, weight, None, target, torch.float64, **ce)
    ref, _ = _torch_ce(inp, weight, None, target, inp.dtype, **ce)
    return (d_inp, d_w, None, d_t, lse, om, a.to(DEVICE), b.to(DEVICE), None), kw, gold, ref


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=lambda d: str(d).replace("torch.", ""))
def test_half_gradients_meet_cces_rule(mode, dtype):
    """CCE's backward test, our fp64 gold: half of the classifier's rows copy embeddings (confident rows). By
    default ``G`` is rounded once to the input dtype: ``|ours - gold| <= |torch - gold| + tol`` with CCE's
    tolerance; ``precise_grad=True`` (``G`` as hi + lo) meets it with none beyond fp32 noise and the result's
    own rounding, which the bf16 default does not everywhere."""
    g = torch.Generator().manual_seed(21)
    N, V, D = 48, 200, 40
    inp = (torch.randn(N, D, generator=g) / math.sqrt(D)).to(dtype)
    weight = torch.randn(V, D, generator=g).to(dtype)
    weight[: N // 2] = inp[: N // 2]
    target = torch.randint(0, V, (N,), generator=g)
    args, kw, gold, ref = _cce_problem(inp, weight, target)
    strict = []
    for precise in (False, True):
        got = lce_backward(*args, mode=mode, precise_grad=precise, chunk_bytes=_chunk(V, dtype, 16), **kw, **SMALL)
        for ours, r, gd in zip(got[:2], ref[:2], gold[:2]):
            excess = (ours.double() - gd).abs() - (r.double() - gd).abs()
            rounding = torch.finfo(dtype).eps / 2 * gd.abs() + 1e-5
            assert bool((excess <= (rounding if precise else CCE_TOL[dtype])).all()), (precise, excess.max())
            strict.append(bool((excess <= rounding).all()))
    assert strict[2:] == [True, True] and (dtype == torch.float16 or not all(strict[:2])), strict


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=lambda d: str(d).replace("torch.", ""))
def test_auto_filtering_meets_cces_rule(mode, dtype):
    """``filter_eps="auto"`` (CCE's default, ``finfo(dtype).eps / 32``) on peaked rows, where it drops most of
    the vocabulary: still ``|ours - gold| <= |torch - gold| + tol`` per element with CCE's tolerance."""
    g = torch.Generator().manual_seed(22)
    N, V, D = 32, 256, 32
    inp = torch.randn(N, D, generator=g).to(dtype)
    weight = (torch.randn(V, D, generator=g) * (30 / math.sqrt(D))).to(dtype)  # logits ~ N(0, 30^2)
    target = torch.randint(0, 64, (N,), generator=g)  # vocabulary blocks past the first hold no target
    args, kw, gold, ref = _cce_problem(inp, weight, target)
    run = dict(mode=mode, chunk_bytes=_chunk(V, dtype, 16), block_n=16, block_v=16, **kw)
    exact = lce_backward(*args, **run)
    got = lce_backward(*args, filter_eps="auto", **run)
    assert not torch.equal(got[1], exact[1])  # something was dropped
    for ours, r, gd in zip(got[:2], ref[:2], gold[:2]):
        excess = (ours.double() - gd).abs() - (r.double() - gd).abs()
        assert bool((excess <= CCE_TOL[dtype]).all()), excess.max()


def test_filtering_reads_probabilities_not_the_scaled_gradient():
    """CCE filters a tile on its probabilities, before the rows' coefficients: with a mean over many rows (a
    tiny ``a``) and every tile holding a probability above ``filter_eps``, nothing is skipped; a filter on the
    scaled gradient would skip every tile without a target."""
    g = torch.Generator().manual_seed(5)
    N, V, D = 32, 128, 16
    inp = (torch.randn(N, D, generator=g) * 0.1).bfloat16()
    weight = (torch.randn(V, D, generator=g) * 0.1).bfloat16()       # near-uniform rows: p ~ 1 / V
    target = torch.randint(0, V, (N,), generator=g)
    d = [t.to(DEVICE) for t in (inp, weight)]
    lse, _, om, _ = lce_forward(d[0], d[1], None, target.to(DEVICE), ignore_index=-100)
    a = torch.full((N,), 1e-6).to(DEVICE)
    args = (d[0], d[1], None, target.to(DEVICE), lse, om, a, a, None)
    exact = lce_backward(*args, ignore_index=-100, mode="fused", **SMALL)
    filtered = lce_backward(*args, ignore_index=-100, filter_eps=0.5 / V, mode="fused", **SMALL)
    for x, y in zip(exact[:2], filtered[:2]):
        torch.testing.assert_close(x.float(), y.float(), rtol=0, atol=0)
    exact, filtered = (lce_backward(*args, ignore_index=-100, filter_eps=f, mode="gemm", **SMALL)
                       for f in (None, 0.5 / V))
    for x, y in zip(exact[:2], filtered[:2]):
        torch.testing.assert_close(x.float(), y.float(), rtol=0, atol=0)
