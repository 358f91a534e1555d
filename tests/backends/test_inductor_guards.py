"""Sites smx recognises and does not rewrite still come out right: where Inductor is known to mis-compile a
site as written, the backend hands it over in a form Inductor cannot.

* softmax over the query dim (-2) between two matmuls: Inductor's ``fuse_attention`` takes it for attention over
  the last dim (pytorch#196468; relative error ~0.35 in inference, and a crash while building guards in
  training, with torch 2.13). The attention pass skips it and hands its softmax over as ``smx::softmax``.
* fp16 ``x.exp() / x.exp().sum(-1, keepdim=True)`` where ``exp`` overflows: eager gives NaN, Inductor 0 for the
  row. The softmax pass never leaves the unshifted fp16 spelling to Inductor: ``smx::softmax`` gives the softmax.
"""

from __future__ import annotations

import torch

import smxcompile


def over_queries(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1) / 4, dim=-2) @ v


def test_softmax_over_queries_is_guarded_and_exact():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 16, 16, generator=g, requires_grad=True) for _ in range(3))
    torch._dynamo.reset()
    out = torch.compile(over_queries, backend="smx", options={"cpu": "rewrite"})(q, k, v)
    site = [s for s in smxcompile.last_report() if s.kind == "attention"]
    assert [s.action for s in site] == ["skipped"] and "smx::softmax" in site[0].reason, site
    ref = over_queries(q, k, v)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    w = torch.randn(ref.shape, generator=g)
    got = torch.autograd.grad((out * w).sum(), (q, k, v))
    want = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_softmax_over_queries_is_guarded_in_analysis_too():
    q, k, v = (torch.randn(1, 2, 8, 8) for _ in range(3))
    rep = smxcompile.explain(over_queries, q, k, v, options={"cpu": "rewrite"})
    site = [s for s in rep if s.kind == "attention"]
    assert [s.action for s in site] == ["skipped"] and "pytorch#196468" in site[0].reason
    assert not [s for s in rep if s.kind == "softmax"]      # the guarded softmax is the attention site's


def handwritten(x):
    return x.exp() / x.exp().sum(-1, keepdim=True)


def test_fp16_handwritten_softmax_overflow_is_the_softmax():
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(0)).half()
    x[0, 3] = 20.0                       # exp(20) > 65504
    torch._dynamo.reset()
    out = torch.compile(handwritten, backend="smx")(x)
    site = [s for s in smxcompile.last_report() if s.kind == "softmax"]
    assert [s.action for s in site] == ["rewritten"], site
    torch.testing.assert_close(out, torch.softmax(x.float(), -1).half(), rtol=1e-3, atol=1e-4)
    # rows without overflow are eager's
    torch.testing.assert_close(out[1:], handwritten(x)[1:], rtol=1e-3, atol=1e-4)
