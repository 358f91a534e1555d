"""PyTorch's own OpInfo sample inputs (``torch.testing._internal.common_methods_invocations.op_db``, shipped in
the torch wheel) for softmax, log_softmax, cross_entropy and nll_loss, on our eager ops and through the pass.

Every sample torch's own op tests use — 1-D, 0-d, empty, dims other than -1, ``dtype=`` up-casts, soft targets,
K-dimensional targets, class weights, ``ignore_index``, every reduction — in fp32, fp64, bf16 and fp16:
  - ``smxcompile.softmax`` / ``log_softmax`` / ``cross_entropy`` called eagerly give torch's values (the gold
    rule of :mod:`gold`, forward and backward);
  - the same calls written with torch's functions, run through :class:`smxcompile.passes.SmxPass` (what
    ``backend="smx"`` runs) are rewritten where the pass claims the site (asserted from the report), and the
    rewritten graph gives torch's values; a site not rewritten says why.
A few samples run through ``torch.compile(backend="smx")`` end to end.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.testing._internal.common_methods_invocations import op_db

import smxcompile
from gold import TOL, assert_gold
from pass_helpers import rewrite

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


def _samples(name: str, variant: str = ""):
    op = next(o for o in op_db if o.name == name and o.variant_test_name == variant)
    out = []
    for dtype in DTYPES:
        for i, s in enumerate(op.sample_inputs("cpu", dtype, requires_grad=False)):
            out.append(pytest.param(s, dtype, id=f"{str(dtype)[6:]}-{i}"))
    return out


def _grad_inputs(*ts):
    """Copies; only the first (the logits) requires grad: torch has no gradient for a class weight, and ours
    raises a clear NotImplementedError for one w.r.t. probability targets."""
    return [t.detach().clone().requires_grad_(i == 0 and t.is_floating_point()) for i, t in enumerate(ts)]


def _compare(fn_ours, fn_torch, tensors, what):
    """Forward and (for floating inputs with elements) backward of ``fn_ours`` against ``fn_torch`` and fp64."""
    ours_in, torch_in = _grad_inputs(*tensors), _grad_inputs(*tensors)
    gold_in = _grad_inputs(*[t.double() if t.is_floating_point() else t for t in tensors])
    outs = [fn_ours(*ours_in), fn_torch(*torch_in), fn_torch(*gold_in)]
    tol = TOL[tensors[0].dtype] if tensors[0].is_floating_point() else TOL[torch.float64]
    assert outs[0].dtype == outs[1].dtype, (what, outs[0].dtype, outs[1].dtype)
    assert_gold(outs[0], outs[1], outs[2], tol, what)
    if not outs[1].requires_grad or outs[1].numel() == 0:
        return
    w = torch.randn(outs[1].shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    grads = [torch.autograd.grad((o.double() * w).sum(), ins[0]) for o, ins in zip(outs, (ours_in, torch_in, gold_in))]
    assert_gold(grads[0][0], grads[1][0], grads[2][0], tol, what + " grad")


def _graph_matches(r, fn, args, dtype):
    """The rewritten graph's output against torch's and the fp64 gold (forward)."""
    got = r.gm(*r.inputs)[0]
    gold = fn(*[a.double() if a.is_floating_point() else a for a in args])
    assert_gold(got, fn(*args), gold, TOL[dtype], str(r.report))


# --------------------------------------------------------------------------- softmax / log_softmax


@pytest.mark.parametrize("kind", ["softmax", "log_softmax"])
@pytest.mark.parametrize("sample,dtype", _samples("softmax"))
def test_softmax_samples_on_our_op(kind, sample, dtype):
    dim = sample.args[0]
    ours, ref = getattr(smxcompile, kind), getattr(torch, kind)
    _compare(lambda x: ours(x, dim), lambda x: ref(x, dim), [sample.input], f"{kind} {tuple(sample.input.shape)} dim={dim}")


@pytest.mark.parametrize("sample,dtype", _samples("softmax", "with_dtype"))
def test_softmax_dtype_samples_on_our_op(sample, dtype):
    dim, out = sample.args[0], sample.kwargs["dtype"]
    _compare(lambda x: smxcompile.softmax(x, dim, dtype=out), lambda x: torch.softmax(x, dim, dtype=out),
             [sample.input], f"softmax {tuple(sample.input.shape)} dim={dim} dtype={out}")


@pytest.mark.parametrize("kind", ["softmax", "log_softmax"])
@pytest.mark.parametrize("sample,dtype", [p for p in _samples("softmax") if p.values[1] in (torch.float32, torch.bfloat16)])
def test_softmax_samples_through_the_pass(kind, sample, dtype):
    dim = sample.args[0]
    ref = getattr(torch, kind)
    fn = lambda x: ref(x * 2.0, dim)  # noqa: E731
    r = rewrite(fn, sample.input, check_values=False)
    _graph_matches(r, fn, [sample.input], dtype)
    site = r.site
    if sample.input.dim() == 0 or sample.input.numel() == 0:
        assert site.action != "rewritten" or r.gm(*r.inputs)[0].shape == sample.input.shape
    else:
        assert site.action == "rewritten", str(r.report)
    assert site.action == "rewritten" or site.reason, str(r.report)


# --------------------------------------------------------------------------- cross_entropy / nll_loss


@pytest.mark.parametrize("sample,dtype", _samples("nn.functional.cross_entropy"))
def test_cross_entropy_samples_on_our_op(sample, dtype):
    target, kw = sample.args[0], dict(sample.kwargs)
    weight = kw.pop("weight", None)
    tensors = [sample.input, target] + ([weight] if weight is not None else [])

    def ours(x, t, *w):
        return smxcompile.cross_entropy(x, t, *w, **kw)

    def ref(x, t, *w):
        return F.cross_entropy(x, t, *w, **kw)

    _compare(ours, ref, tensors, f"cross_entropy {tuple(sample.input.shape)} {kw} weight={weight is not None}")


@pytest.mark.parametrize("sample,dtype", [p for p in _samples("nn.functional.nll_loss") if p.values[1] == torch.float32])
def test_nll_of_log_softmax_samples_through_the_pass(sample, dtype):
    """``nll_loss(log_softmax(x, 1), t)``: the spelling the cross-entropy pass fuses, with torch's samples."""
    target, kw = sample.args[0], dict(sample.kwargs)
    weight = kw.pop("weight", None)
    args = [sample.input, target] + ([weight] if weight is not None else [])

    def fn(x, t, *w):
        return F.nll_loss(F.log_softmax(x, 1 if x.dim() > 1 else 0), t, *w, **kw)

    r = rewrite(fn, *args, check_values=False)
    _graph_matches(r, fn, args, dtype)
    ce = [s for s in r.report if s.kind == "cross_entropy"]
    assert ce, str(r.report)
    assert all(s.action == "rewritten" or s.reason for s in ce), str(r.report)
    if sample.input.dim() == 2 and target.dim() == 1:
        assert [s.action for s in ce] == ["rewritten"], str(r.report)


@pytest.mark.parametrize("name,build", [
    ("softmax dim=0", lambda: (lambda x: torch.softmax(x * 2.0, 0), [torch.randn(5, 10, 5)])),
    ("log_softmax bf16", lambda: (lambda x: torch.log_softmax(x * 2.0, -1), [torch.randn(5, 5).bfloat16()])),
    ("cross_entropy weight + ignore_index", lambda: (
        lambda x, t, w: F.cross_entropy(x * 2.0, t, w, ignore_index=1),
        [torch.randn(6, 3), torch.tensor([0, 1, 2, 1, 0, 2]), torch.rand(3) + 0.5])),
], ids=lambda v: v if isinstance(v, str) else "")
def test_samples_through_the_backend(name, build):
    fn, args = build()
    torch._dynamo.reset()
    got = torch.compile(fn, backend="smx", options={"cpu": "rewrite"})(*args)
    report = smxcompile.last_report()
    assert any(s.action == "rewritten" for s in report), str(report)
    assert_gold(got, fn(*args), fn(*[a.double() if a.is_floating_point() else a for a in args]), TOL[args[0].dtype])
