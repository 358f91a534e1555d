"""The peers' loss test grids, in our words, on ``smxcompile.linear_cross_entropy`` and through ``backend="smx"``.

- Liger-Kernel ``test/transformers/test_fused_linear_cross_entropy.py`` and ``test_cross_entropy.py``: an LM head
  (``nn.Linear``, with and without bias) then cross-entropy, over the options Liger's grid crosses —
  reduction, ignore_index, label smoothing, z-loss (``lse_square_scale``), soft-capping, class weights —
  fp32 and bf16, a ragged shape (odd N, D, V). Forward, input / weight / bias gradients.
- Apple cut-cross-entropy ``tests/``: the per-row lse rule ``|ours - gold| <= |torch - gold| + 1e-5`` in
  bf16 / fp16 (the logits kept in fp32), with some targets invalid (ignored), soft-capping and ``shift``.
Every comparison uses the gold rule of :mod:`gold` against an fp64 gold built from the same rounded inputs.
Through the backend, the report must show the LM head's cross-entropy rewritten.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import smxcompile
from gold import TOL, assert_gold

N, D, V = 47, 31, 123          # Liger's ragged shape (B*T = 47, H = 31, V = 123)


def _reference(x, w, b, t, *, reduction="mean", ignore_index=-100, label_smoothing=0.0, lse_square_scale=0.0,
               softcap=None, class_weight=None):
    """What the op must equal: the logits materialized, torch's cross-entropy, plus Liger's z-loss."""
    z = F.linear(x, w, b).float() if x.dtype != torch.float64 else F.linear(x, w, b)
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    loss = F.cross_entropy(z, t, weight=None if class_weight is None else class_weight.to(z.dtype),
                           ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing)
    if lse_square_scale:
        keep = (t != ignore_index).to(z.dtype)
        zl = lse_square_scale * torch.logsumexp(z, -1).square() * keep
        zl = zl.sum() / keep.sum() if reduction == "mean" else zl.sum() if reduction == "sum" else zl
        loss = loss + zl
    return loss


LIGER_OPTIONS = {
    "plain": {},
    "sum": dict(reduction="sum"),
    "none": dict(reduction="none"),
    "ignore_42_smooth": dict(ignore_index=42, label_smoothing=0.1),
    "z_loss_softcap": dict(lse_square_scale=1e-4, softcap=30.0),
    "class_weight": dict(class_weight=True),
    "everything": dict(ignore_index=42, label_smoothing=0.1, lse_square_scale=1e-4, softcap=30.0,
                       class_weight=True, reduction="sum"),
}


def _liger_inputs(dtype, bias, ignore_index=-100, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, D, generator=g).to(dtype)
    w = (torch.rand(V, D, generator=g) / D ** 0.5).to(dtype)            # Liger draws the head with rand
    b = torch.rand(V, generator=g).to(dtype) if bias else None
    t = torch.randint(0, V, (N,), generator=g)
    t[torch.rand(N, generator=g) < 0.2] = ignore_index
    cw = torch.rand(V, generator=g) + 0.5
    return x, w, b, t, cw


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(LIGER_OPTIONS))
def test_liger_grid_on_linear_cross_entropy(name, dtype, bias):
    opts = dict(LIGER_OPTIONS[name])
    x, w, b, t, cw = _liger_inputs(dtype, bias, opts.get("ignore_index", -100))
    if opts.pop("class_weight", False):
        opts["class_weight"] = cw

    def run(fn, xx, ww, bb):
        leaves = [a.detach().clone().requires_grad_() for a in (xx, ww) + ((bb,) if bb is not None else ())]
        out = fn(*leaves[:2], leaves[2] if bb is not None else None)
        out = out.loss if isinstance(out, tuple) else out
        wgt = torch.randn(out.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
        grads = torch.autograd.grad((out.double() * wgt).sum(), leaves)
        return out, grads

    ours = run(lambda xx, ww, bb: smxcompile.linear_cross_entropy(xx, ww, t, bias=bb, **opts), x, w, b)
    ref = run(lambda xx, ww, bb: _reference(xx, ww, bb, t, **opts), x, w, b)
    gold = run(lambda xx, ww, bb: _reference(xx, ww, bb, t, **opts), x.double(), w.double(),
               b.double() if b is not None else None)
    tol = TOL[dtype]
    assert_gold(ours[0].float(), ref[0].float(), gold[0], tol, f"{name} loss")
    for i, (go, gr, gg) in enumerate(zip(ours[1], ref[1], gold[1])):
        assert_gold(go, gr, gg, tol, f"{name} grad {['input', 'weight', 'bias'][i]}")


class LMHead(nn.Module):
    def __init__(self, bias, label_smoothing=0.0, ignore_index=-100):
        super().__init__()
        self.lin = nn.Linear(D, V, bias=bias)
        self.ce = nn.CrossEntropyLoss(ignore_index=ignore_index, label_smoothing=label_smoothing)

    def forward(self, x, t):
        return self.ce(self.lin(x), t)


@pytest.mark.parametrize("bias,label_smoothing,ignore_index", [(True, 0.0, -100), (False, 0.1, 42)],
                         ids=["bias", "smooth_ignore42"])
def test_liger_lm_head_through_the_backend(bias, label_smoothing, ignore_index):
    """Liger's ``TorchLMHeadCE`` module, unchanged, compiled with ``backend="smx"``: cut cross-entropy fires and
    the loss and every gradient are eager's."""
    torch.manual_seed(0)
    model = LMHead(bias, label_smoothing, ignore_index)
    x, _, _, t, _ = _liger_inputs(torch.float32, bias, ignore_index)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="smx", options={"cpu": "rewrite"})
    xs = [x.clone().requires_grad_() for _ in range(2)]
    got = compiled(xs[0], t)
    got.backward()
    grads_got = [xs[0].grad] + [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    want = model(xs[1], t)
    want.backward()
    report = smxcompile.last_report()
    assert [s.action for s in report if s.kind == "linear_cross_entropy"] == ["rewritten"], str(report)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads_got, [xs[1].grad] + [p.grad for p in model.parameters()]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("softcap", [None, 20.0], ids=["no_softcap", "softcap20"])
@pytest.mark.parametrize("invalids", [False, True], ids=["all_valid", "invalids"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_cce_lse_rule_in_half_precision(dtype, invalids, softcap):
    """CCE's rule on the per-row lse (and the loss rows): no worse than torch in fp32 on the same inputs, +1e-5."""
    g = torch.Generator().manual_seed(1)
    e = (torch.randn(256, 128, generator=g) / 128 ** 0.5).to(dtype)
    c = torch.randn(512, 128, generator=g).to(dtype)
    t = torch.randint(0, 512, (256,), generator=g)
    if invalids:
        t[torch.rand(256, generator=g) < 0.25] = -100
    out = smxcompile.linear_cross_entropy(e, c, t, softcap=softcap, reduction="none", return_lse=True)

    def logits(ee, cc, dtype):
        z = ee.to(dtype) @ cc.to(dtype).T
        return z if softcap is None else softcap * torch.tanh(z / softcap)

    # CCE's reference: torch in fp32 on the same rounded inputs (half logits would be ~1e-3 off)
    z_torch, z_gold = logits(e, c, torch.float32), logits(e, c, torch.float64)
    assert_gold(out.lse.double(), torch.logsumexp(z_torch, -1).double(), torch.logsumexp(z_gold, -1), 1e-5, "lse")
    assert_gold(out.loss.double(), F.cross_entropy(z_torch, t, reduction="none").double(),
                F.cross_entropy(z_gold, t, reduction="none"), 1e-5, "loss rows")


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_cce_shift(reduction):
    """CCE's ``shift``: position i's hidden state predicts token i + 1 — the loss of ``logits[:, :-1]`` against
    ``target[:, 1:]`` — with its gradients (the last position's hidden state gets none)."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 9, D, generator=g, dtype=torch.float64).requires_grad_()
    w = torch.randn(V, D, generator=g, dtype=torch.float64).requires_grad_()
    t = torch.randint(0, V, (3, 9), generator=g)
    t[0, 4] = -100
    got = smxcompile.linear_cross_entropy(x, w, t, shift=True, reduction=reduction)
    want = F.cross_entropy((x @ w.T)[:, :-1].flatten(0, 1), t[:, 1:].flatten(), reduction=reduction)
    if reduction == "none":
        assert got.shape in {(3, 8), (3, 9)}, got.shape
        got = got[:, :8] if got.shape == (3, 9) else got
        want = want.view(3, 8)
    torch.testing.assert_close(got, want)
    gw = torch.randn(want.shape, generator=g, dtype=torch.float64)
    a = torch.autograd.grad((got * gw).sum(), (x, w))
    b = torch.autograd.grad((want * gw).sum(), (x, w))
    for u, v_ in zip(a, b):
        torch.testing.assert_close(u, v_)
    assert bool((a[0][:, -1] == 0).all())
