"""The smx ops driven through their Triton path (Triton's interpreter on CPU), eagerly and compiled.

tests/kernels/test_triton_softmax.py tests the kernels' launchers in depth; this file checks the op layer
routes to them (forward and backward) and that a compiled graph runs them.
"""

import pytest
import torch
from kernels_testing import require_triton

require_triton()

import smxcompile  # noqa: E402
from smxcompile.kernels import config  # noqa: E402
from smxcompile.kernels.attention import triton_backward as attention_bwd, triton_forward as attention_fwd  # noqa: E402
from smxcompile.kernels.softmax import triton_kernels as softmax_kernels  # noqa: E402
from smxcompile.kernels.softmax_topk import triton_kernels as topk_kernels  # noqa: E402

pytestmark = pytest.mark.triton
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def triton_calls(triton_spy):
    """Force the Triton path on CPU and count softmax launcher calls."""
    return triton_spy(softmax_kernels, "softmax_forward", "softmax_backward")


def _gold_bound(ours, ref, gold, atol, rtol, scale=None):
    """|ours - gold| <= |torch - gold| + atol + rtol * scale, scale = |gold| unless given
    (rtol: one rounding step of the dtype; scale: the size of the terms that were summed)."""
    err_ours = (ours.double() - gold).abs()
    err_ref = (ref.double() - gold).abs()
    scale = gold.abs() if scale is None else scale
    assert torch.all(err_ours <= err_ref + atol + rtol * scale), (err_ours - err_ref).max()


@pytest.mark.parametrize("log", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_op_routes_to_triton_forward_and_backward(triton_calls, log, dtype):
    torch.manual_seed(0)
    x = torch.randn(4, 6, 33, device=DEVICE).to(dtype).permute(0, 2, 1).requires_grad_()  # non-contiguous
    mask = torch.randn(1, 33, 1, device=DEVICE)
    fn = smxcompile.log_softmax if log else smxcompile.softmax
    tfn = torch.log_softmax if log else torch.softmax
    y = fn(x, 1, scale=0.7, mask=mask)
    g = torch.randn_like(y)
    (gx,) = torch.autograd.grad(y, x, g)
    x64 = x.detach().double().requires_grad_()
    y64 = tfn(x64 * 0.7 + mask.double(), 1)
    (gx64,) = torch.autograd.grad(y64, x64, g.double())
    xr = x.detach().requires_grad_()
    yr = tfn(xr * 0.7 + mask.to(dtype), 1)
    (gxr,) = torch.autograd.grad(yr, xr, g)
    atol, rtol = (1e-6, 1e-6) if dtype == torch.float32 else (1e-3, 2.0**-7)
    _gold_bound(y, yr, y64, atol, rtol)
    # backward: g - p * sum(g) (log) or p * (g - sum(g p)) cancels; bound by the terms' size
    p64 = y64.detach().exp() if log else y64.detach()
    terms = (g.double().abs() + g.double().abs().sum(1, keepdim=True)) * (1.0 if log else p64) * 0.7
    _gold_bound(gx, gxr, gx64, atol, rtol, scale=terms)
    assert triton_calls == {"softmax_forward": 1, "softmax_backward": 1}


def test_lse_sum_gradient_through_triton(triton_calls):
    """lse.sum() in a loss hands the backward a stride-0 grad_lse (autograd's expand): its gradient is p per row."""
    x = torch.randn(8, 1000, generator=torch.Generator().manual_seed(0)).to(DEVICE).requires_grad_()
    w = torch.randn(8, 1000, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    y, lse = smxcompile.log_softmax(x, -1, return_lse=True)
    (gx,) = torch.autograd.grad((y * w).sum() + lse.sum(), x)
    xr = x.detach().double().requires_grad_()
    (gr,) = torch.autograd.grad((torch.log_softmax(xr, -1) * w).sum() + torch.logsumexp(xr, -1).sum(), xr)
    assert triton_calls == {"softmax_forward": 1, "softmax_backward": 1}
    assert (gx.double() - gr).abs().max() < 1e-5


def test_compiled_graph_runs_triton_kernels(triton_calls):
    torch.manual_seed(0)

    def f(x):
        return torch.softmax(x, dim=-1) @ torch.ones(x.shape[-1], 3, device=x.device)

    x = torch.randn(16, 70, device=DEVICE, requires_grad=True)
    cf = torch.compile(f, backend="smx", options={"cpu": "rewrite", "cuda": "rewrite"})
    y = cf(x)
    y.sum().backward()
    gx = x.grad.clone()
    x.grad = None
    f(x).sum().backward()
    torch.testing.assert_close(y, f(x), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gx, x.grad, rtol=1e-5, atol=1e-6)
    assert smxcompile.last_report().count(kind="softmax", action="rewritten") == 1
    assert triton_calls["softmax_forward"] >= 1 and triton_calls["softmax_backward"] >= 1


# --------------------------------------------------------------------------- attention


@pytest.fixture
def attention_calls(triton_spy):
    """Force the Triton path on CPU and count the attention launcher calls."""
    triton_spy(attention_fwd, "attention_forward")
    return triton_spy(attention_bwd, "attention_backward")


def _qkv_attn(seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 4, 9, 8, generator=g).to(DEVICE).requires_grad_()
    k = torch.randn(1, 2, 9, 8, generator=g).to(DEVICE).requires_grad_()
    v = torch.randn(1, 2, 9, 8, generator=g).to(DEVICE).requires_grad_()
    return q, k, v


@pytest.mark.parametrize("normalizer", ["softmax", "sigmoid", "ssmax", "sparsemax"])
def test_attention_op_routes_to_triton(attention_calls, normalizer):
    from smxcompile.kernels.attention import attention_reference

    q, k, v = _qkv_attn()
    p = torch.full((4,), 0.7, device=DEVICE, requires_grad=True) if normalizer == "ssmax" else None
    # softmax is only the op's route with soft-capping (otherwise it is torch's SDPA)
    softcap = 3.0 if normalizer == "softmax" else None
    out = smxcompile.attention(q, k, v, is_causal=True, enable_gqa=True, softcap=softcap, normalizer=normalizer,
                               norm_param=p)
    args = [q, k, v] + ([p] if p is not None else [])
    grads = torch.autograd.grad(out.square().sum(), args)
    assert attention_calls == {"attention_forward": 1, "attention_backward": 1}
    d = [t.detach().double().requires_grad_() for t in args]
    ref = attention_reference(d[0], d[1].repeat_interleave(2, 1), d[2].repeat_interleave(2, 1), is_causal=True,
                              softcap=softcap, normalizer=normalizer, norm_param=d[3] if p is not None else None)
    ref_grads = torch.autograd.grad(ref.square().sum(), d)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-4)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a.double(), b, atol=1e-4, rtol=1e-4)


def test_compiled_attention_variant_runs_triton(attention_calls):
    def attn(q, k, v):
        return torch.softmax(q @ k.transpose(-2, -1) * 0.3, -1) @ v

    q, k, v = (t.detach()[:, :2].contiguous().requires_grad_() for t in _qkv_attn(1))
    k, v = (t.detach()[:, :2].contiguous().requires_grad_() for t in (k, v))
    torch._dynamo.reset()
    f = torch.compile(attn, backend="smx", options={"attention_normalizer": "softpick"})
    out = f(q, k, v)
    out.sum().backward()
    assert attention_calls == {"attention_forward": 1, "attention_backward": 1}
    assert smxcompile.last_report().count(kind="attention", action="rewritten") == 1


def test_attention_skip_threshold_routes_to_triton(attention_calls):
    import torch.nn.functional as F

    q, k, v = (t.detach() for t in _qkv_attn(2))
    k, v = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    # a tiny lambda skips nothing that matters: equal to exact attention
    out = smxcompile.attention(q, k, v, is_causal=True, skip_threshold=1e-30)
    assert attention_calls["attention_forward"] == 1
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True), atol=1e-5, rtol=1e-5)


def test_attention_skip_threshold_errors(monkeypatch):
    from smxcompile.kernels.attention import AttentionError

    monkeypatch.setattr(config, "force_triton", False)
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(AttentionError, match="CUDA Triton kernel only"):
        smxcompile.attention(q, q, q, skip_threshold=0.01)
    with pytest.raises(AttentionError, match="softmax normalizer only"):
        smxcompile.attention(q, q, q, skip_threshold=0.01, normalizer="sigmoid")
    with pytest.raises(AttentionError, match=r"in \(0, 1\)"):
        smxcompile.attention(q, q, q, skip_threshold=2.0)


@pytest.mark.parametrize("normalizer", ["ssmax", "sigmoid"])
def test_attention_mask_counts_n_on_triton(attention_calls, normalizer):
    """With a mask, n (ssmax's log n, sigmoid's default bias) is the keys each row keeps: Triton = reference."""
    from smxcompile.kernels.attention import attention_reference

    q, k, v = _qkv_attn(3)
    keep = torch.ones(1, 1, 9, 9, dtype=torch.bool, device=DEVICE).tril()
    keep[..., :2] = False          # left padding: the first two keys, and rows 0-1 fully masked
    out = smxcompile.attention(q, k, v, attn_mask=keep, enable_gqa=True, normalizer=normalizer)
    (dq,) = torch.autograd.grad(out.square().sum(), [q])
    assert attention_calls == {"attention_forward": 1, "attention_backward": 1}
    d = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = attention_reference(d[0], d[1].repeat_interleave(2, 1), d[2].repeat_interleave(2, 1), attn_mask=keep,
                              normalizer=normalizer)
    (rdq,) = torch.autograd.grad(ref.square().sum(), [d[0]])
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(dq.double(), rdq, atol=1e-4, rtol=1e-4)


# --------------------------------------------------------------------------- softmax + top-k


@pytest.fixture
def topk_calls(triton_spy):
    """Force the Triton path on CPU and count softmax + top-k launcher calls."""
    return triton_spy(topk_kernels, "softmax_topk_forward", "softmax_topk_backward")


@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softmax_topk_op_routes_to_triton(topk_calls, renormalize, dtype):
    torch.manual_seed(0)
    x = (torch.randn(3, 5, 300, device=DEVICE) * 3).to(dtype).permute(0, 2, 1).requires_grad_()  # dim 1, strided
    values, indices = smxcompile.softmax_topk(x, 4, 1, renormalize=renormalize, temperature=0.8)
    g = torch.randn_like(values)
    (gx,) = torch.autograd.grad(values, x, g)
    x64 = x.detach().double().requires_grad_()
    p64 = torch.softmax(x64 / 0.8, 1)
    v64, i64 = torch.topk(p64, 4, 1)
    if renormalize:
        v64 = v64 / v64.sum(1, keepdim=True)
    (gx64,) = torch.autograd.grad(v64, x64, g.double())
    xr = x.detach().requires_grad_()
    vr, _ = torch.topk(torch.softmax(xr / 0.8, 1), 4, 1)
    if renormalize:
        vr = vr / vr.sum(1, keepdim=True)
    (gxr,) = torch.autograd.grad(vr, xr, g)
    if dtype == torch.float32:
        assert torch.equal(indices, i64)
    else:   # bf16 logits tie often: the picked logits must be torch's
        assert torch.equal(x.detach().gather(1, indices).sort(1).values, x.detach().gather(1, i64).sort(1).values)
    atol, rtol = (1e-6, 1e-6) if dtype == torch.float32 else (1e-3, 2.0**-7)
    _gold_bound(values, vr, v64, atol, rtol)
    if dtype == torch.float32:
        _gold_bound(gx, gxr, gx64, atol, rtol, scale=g.double().abs().sum(1, keepdim=True).expand_as(gx64))
    assert topk_calls == {"softmax_topk_forward": 1, "softmax_topk_backward": 1}


def test_compiled_router_runs_triton_softmax_topk(topk_calls):
    torch.manual_seed(0)

    def router(h, w):
        probs = torch.softmax(torch.nn.functional.linear(h, w).float(), -1)
        v, i = torch.topk(probs, 2, -1)
        v /= v.sum(-1, keepdim=True)
        return v, i

    h = torch.randn(32, 16, device=DEVICE)
    w = torch.randn(64, 16, device=DEVICE, requires_grad=True)
    torch._dynamo.reset()
    compiled = torch.compile(router, backend="smx", options={"cpu": "rewrite", "cuda": "rewrite"})
    v, i = compiled(h, w)
    vr, ir = router(h, w)
    assert torch.equal(i, ir)
    torch.testing.assert_close(v, vr, atol=1e-6, rtol=1e-5)
    (gw,) = torch.autograd.grad((v * torch.arange(2.0, device=DEVICE)).sum(), w)
    (gwr,) = torch.autograd.grad((vr * torch.arange(2.0, device=DEVICE)).sum(), w)
    torch.testing.assert_close(gw, gwr, atol=1e-5, rtol=1e-4)
    rep = smxcompile.last_report()
    assert rep.count(kind="softmax_topk", action="rewritten") == 1
    assert topk_calls["softmax_topk_forward"] >= 1 and topk_calls["softmax_topk_backward"] >= 1
