"""The CUDA body of ``smx::linear_ce_loss`` (``triton_fused.fused_forward_gemm``: loss and gradients in one pass
over row chunks) through the public ``linear_cross_entropy``, on Triton's interpreter: the call takes that path,
and its loss and gradients meet CCE's rule against an fp64 gold (``|ours - gold| <= |torch - gold| + tol``)."""

import math

import pytest
import torch
import torch.nn.functional as F
from kernels_testing import CCE_TOL, TRITON_MARKS, require_triton

require_triton()

import smxcompile  # noqa: E402
from smxcompile.kernels import config  # noqa: E402
from smxcompile.kernels.cross_entropy import triton_fused  # noqa: E402

pytestmark = TRITON_MARKS

CASES = {
    "plain": dict(),
    "sum+bias": dict(reduction="sum", bias=True),
    "smoothing+weights": dict(label_smoothing=0.1, class_weight=True),
    "softcap+zloss": dict(softcap=20.0, lse_square_scale=0.1, scale=0.5),
}


def _problem(dtype, bias):
    g = torch.Generator().manual_seed(3)
    N, V, D = 40, 300, 32
    x = (torch.randn(N, D, generator=g) / math.sqrt(D)).to(dtype)
    w = (torch.randn(V, D, generator=g) * 2).to(dtype)
    w[: N // 2] = x[: N // 2] * 4  # confident rows
    b = (torch.randn(V, generator=g) * 0.1).to(dtype) if bias else None
    y = torch.randint(0, V, (N,), generator=g)
    y[::7] = -100
    cw = torch.rand(V, generator=g) + 0.5
    return x, w, b, y, cw


def _torch_loss(x, w, b, y, cw, o):
    z = F.linear(x, w, b) * o.get("scale", 1.0)
    if o.get("softcap"):
        z = o["softcap"] * torch.tanh(z / o["softcap"])
    z = z.float() if z.dtype != torch.float64 else z
    loss = F.cross_entropy(z, y, weight=cw, reduction=o.get("reduction", "mean"), ignore_index=-100,
                           label_smoothing=o.get("label_smoothing", 0.0))
    if o.get("lse_square_scale"):
        valid = y != -100
        loss = loss + o["lse_square_scale"] * (torch.logsumexp(z, -1)[valid] ** 2).mean()
    return loss


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=lambda d: str(d).replace("torch.", ""))
def test_fused_path_meets_cces_rule(case, dtype, monkeypatch):
    monkeypatch.setattr(config, "force_triton", True)
    calls = []
    real = triton_fused.fused_forward_gemm
    monkeypatch.setattr(triton_fused, "fused_forward_gemm", lambda *a, **k: (calls.append(k), real(*a, **k))[1])
    o = dict(CASES[case])
    has_bias, use_cw = o.pop("bias", False), o.pop("class_weight", False)
    x, w, b, y, cw = _problem(dtype, has_bias)
    cw = cw if use_cw else None
    leaves = [t for t in (x, w, b) if t is not None]

    def grads(fn, ts):
        ts = [t.detach().clone().requires_grad_() for t in ts]
        loss = fn(*ts)
        return loss.detach(), torch.autograd.grad(loss * 3.0, ts)  # a grad_output other than 1

    def eager(weights):
        return lambda x_, w_, b_=None: _torch_loss(x_, w_, b_, y, weights, o)

    def ours(x_, w_, b_=None):
        return smxcompile.linear_cross_entropy(x_, w_, y, bias=b_, ignore_index=-100, class_weight=cw,
                                               chunk_bytes=16 * 300 * 8, **o)

    loss, got = grads(ours, leaves)
    assert len(calls) == 1 and calls[0]["filter_eps"] is not None  # the fused path, "auto" filtering
    _, ref = grads(eager(cw), leaves)
    gold_loss, gold = grads(eager(None if cw is None else cw.double()), [t.double() for t in leaves])
    torch.testing.assert_close(loss.double(), gold_loss, rtol=2e-5, atol=2e-5)
    for a, r, g in zip(got, ref, gold):
        assert a.dtype == r.dtype and a.shape == r.shape
        excess = (a.double() - g).abs() - (r.double() - g).abs()
        tol = CCE_TOL[dtype] + torch.finfo(dtype).eps * g.abs()  # (upstream 3: one rounding of larger values)
        assert bool((excess <= tol).all()), excess.max()
