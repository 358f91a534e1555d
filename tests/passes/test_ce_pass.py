"""The cross-entropy pass (smxcompile.passes.cross_entropy): expected graphs, near-misses, numerics.

* Expected graphs: each spelling of ``linear -> ... -> cross_entropy`` is traced with Dynamo (the graph
  the backend and Inductor's ``pre_grad_custom_pass`` see), :class:`SmxPass` runs on it and the result is
  compared with an inline expectation (``expecttest``; regenerate with ``EXPECTTEST_ACCEPT=1 pytest
  <this file>`` and read the diff before committing it). Every rewritten graph is also run against
  the original function, so an expectation can never bless a wrong rewrite.
* Near-misses: what must not become cut cross-entropy, with the report's reason.
* Numerics: every positive case compiled with ``backend="smx"`` (CPU rewrite forced) matches eager
  fp32 in the loss, the returned logits and the gradients of every input and parameter, and the smx
  cross-entropy kernels really ran (their CPU entry points are counted).
"""

from __future__ import annotations

import contextlib
import inspect
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from expecttest import TestCase

import smxcompile
from smxcompile.backends import smx as smx_backend_mod
from smxcompile.kernels.cross_entropy import ops as ce_kernels  # where the op bodies look them up
from smxcompile.options import SmxOptions
from smxcompile.passes import SmxPass, analyze
from smxcompile.passes.policy import cpu_threshold
from smxcompile.report import Report

import pass_helpers
from pass_helpers import REWRITE, Rewrite, dynamo_graph

CPU_MIN_VOCAB = cpu_threshold("linear_cross_entropy_min_vocab")
HERE = os.path.abspath(__file__)

B, T, D, V = 2, 5, 8, 11
N = B * T


# --------------------------------------------------------------------------- helpers


def rewrite(fn, *args, options=REWRITE, check_values: bool = True) -> Rewrite:
    """:func:`pass_helpers.rewrite` with the loss sites located in ``fn`` (torch's own F.linear_cross_entropy /
    nn.CrossEntropyLoss are inlined: the site is the user's line) and values within 1e-5."""
    return pass_helpers.rewrite(fn, *args, options=options, check_values=check_values, atol=1e-5, rtol=1e-5,
                                located=("cross_entropy", "linear_cross_entropy"))


_FLOAT_INPUTS = ("h", "h2", "hT", "W", "M", "b", "x")


def data(seed: int = 0, requires_grad: bool = False) -> dict[str, torch.Tensor]:
    """Inputs by name: hidden states ``h`` (B, T, D) / ``h2`` (N, D) / ``hT`` (D, N), classifier ``W`` (V, D) /
    ``M`` (D, V),
    bias ``b``, targets ``y`` (B, T) / ``y2`` (N,) with two ignored tokens, class weights ``cw``,
    probability targets ``p`` (N, V), plain logits ``x`` (N, V) and a token count ``n``."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, T, D, generator=g)
    W = torch.randn(V, D, generator=g) * 0.5
    y = torch.randint(0, V, (B, T), generator=g)
    y[0, 1] = y[1, 3] = -100
    d = dict(h=h, h2=h.reshape(N, D).clone(), hT=h.reshape(N, D).t().contiguous(), W=W, M=W.t().contiguous(),
             b=torch.randn(V, generator=g) * 0.1, y=y, y2=y.reshape(N).clone(), cw=torch.rand(V, generator=g) + 0.5,
             p=torch.softmax(torch.randn(N, V, generator=g), -1), x=torch.randn(N, V, generator=g) * 2,
             n=torch.tensor(7.0))
    if requires_grad:
        for k in _FLOAT_INPUTS:
            d[k].requires_grad_()
    return d


def args_of(fn, d: dict) -> tuple:
    target = fn.forward if isinstance(fn, nn.Module) else fn
    return tuple(d[p] for p in inspect.signature(target).parameters)


@contextlib.contextmanager
def kernel_spy():
    """Count runtime calls of the CPU cross-entropy kernels: ``fused_forward`` (linear CE, scalar
    reduction, gradients computed in the forward) and ``torch_forward`` (the row-statistics path:
    reduction none, probability targets, the plain CE op). The compiled code reaches them through
    the smx custom ops' bodies, which look them up in the module at call time."""
    calls = {"fused": 0, "stats": 0}
    fused, stats = ce_kernels.fused_forward, ce_kernels.torch_forward

    def f(*a, **k):
        calls["fused"] += 1
        return fused(*a, **k)

    def s(*a, **k):
        calls["stats"] += 1
        return stats(*a, **k)

    ce_kernels.fused_forward, ce_kernels.torch_forward = f, s
    try:
        yield calls
    finally:
        ce_kernels.fused_forward, ce_kernels.torch_forward = fused, stats


def _outputs(out) -> tuple[torch.Tensor, ...]:
    return out if isinstance(out, tuple) else (out,)


def _objective(outs, seed: int = 3):
    """loss (summed when unreduced) + <G, logits> for every returned logits tensor, G fixed random:
    the returned logits get a nonzero gradient too."""
    total = outs[0].float().sum()
    g = torch.Generator().manual_seed(seed)
    for o in outs[1:]:
        total = total + (o.float() * torch.randn(o.shape, generator=g) * 0.05).sum()
    return total


def step(fn, d: dict):
    """Outputs and gradients (inputs, then the module's parameters) of one forward + backward."""
    if isinstance(fn, nn.Module):
        fn.zero_grad(set_to_none=True)
    inputs = args_of(fn, d)
    outs = _outputs(fn(*inputs))
    leaves = [a for a in inputs if isinstance(a, torch.Tensor) and a.requires_grad]
    params = list(fn.parameters()) if isinstance(fn, nn.Module) else []
    grads = torch.autograd.grad(_objective(outs), leaves + params)
    return tuple(o.detach() for o in outs), grads


def assert_matches(got, ref, rtol=1e-5, atol=1e-6):
    (go, gg), (ro, rg) = got, ref
    assert len(go) == len(ro) and len(gg) == len(rg)
    for a, b in zip(go + gg, ro + rg):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol, equal_nan=True)


def compile_report(fn, options=REWRITE, **kw):
    """``torch.compile(fn, backend="smx")`` and a function returning the reports of the graphs compiled since."""
    torch._dynamo.reset()
    n0 = len(smx_backend_mod.compiled_reports)
    compiled = torch.compile(fn, backend="smx", options=options, **kw)

    def reports() -> Report:
        rep = Report()
        for r in smx_backend_mod.compiled_reports[n0:]:
            rep.extend(r)
        return rep

    return compiled, reports


# --------------------------------------------------------------------------- the positive cases


def linear_ce(h2, W, y2):
    return F.cross_entropy(F.linear(h2, W), y2)


class LinearAndLoss(nn.Module):
    """``nn.Linear`` + ``nn.CrossEntropyLoss``."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.head = nn.Linear(D, V)
        self.loss = nn.CrossEntropyLoss()

    def forward(self, h, y):
        return self.loss(self.head(h).view(-1, V), y.view(-1))


def nll_log_softmax(h2, W, y2):
    return F.nll_loss(F.log_softmax(h2 @ W.T, -1), y2)


def nll_log_softmax_view(h, W, y):
    # fairseq style: the log-probabilities are flattened between the log-softmax and the NLL
    lprobs = F.log_softmax(h @ W.T, dim=-1)
    return F.nll_loss(lprobs.view(-1, lprobs.size(-1)), y.view(-1))


def torch_linear_cross_entropy(h2, W, y2):
    return F.linear_cross_entropy(h2, W, y2)


def hf_causal_loss(h, W, y, n):
    # transformers' ForCausalLMLoss (labels shifted by padding) with num_items_in_batch
    logits = F.linear(h, W)   # lm_head: the model returns these
    upcast = logits.float()
    labels = F.pad(y, (0, 1), value=-100)[..., 1:].contiguous()
    loss = F.cross_entropy(upcast.view(-1, V), labels.view(-1), ignore_index=-100, reduction="sum") / n
    return loss, logits


def explicit_shift(h, W, y):
    logits = h @ W.t()
    shift_logits = logits[..., :-1, :].contiguous()
    shift_labels = y[..., 1:].contiguous()
    return F.cross_entropy(shift_logits.view(-1, V), shift_labels.view(-1))


def explicit_shift_returning_logits(h, W, y):
    # transformers < 4.46, nanoGPT-style loops: the loss reads rows 0..T-2, the caller gets all T rows
    logits = F.linear(h, W)
    shift_logits = logits[..., :-1, :].contiguous()
    shift_labels = y[..., 1:].contiguous()
    return F.cross_entropy(shift_logits.view(-1, V), shift_labels.view(-1)), logits


def shift_returning_logits_reduction_none(h, W, b, y):
    logits = F.linear(h, W, b)
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, V), y[:, 1:].reshape(-1), reduction="none")
    return loss, logits


def slice_of_flattened_rows(h, W, y):
    # the slice is over the flattened rows, not h's first dim
    return F.cross_entropy(F.linear(h, W).view(-1, V)[:-3], y.view(-1)[:-3])


def softcap(h, W, y):
    # Gemma 2: the capped logits are returned
    logits = F.linear(h, W)
    logits = 3.0 * torch.tanh(logits / 3.0)
    return F.cross_entropy(logits.view(-1, V), y.view(-1)), logits


def temperature(h, W, y):
    return F.cross_entropy((F.linear(h, W) / 0.7).view(-1, V), y.view(-1))


def conv1d_addmm(h, M, b, y):
    # GPT-2's Conv1D: weight (D, V), torch.addmm(bias, x.view(-1, D), weight)
    size_out = h.size()[:-1] + (V,)
    logits = torch.addmm(b, h.view(-1, h.size(-1)), M).view(size_out)
    return F.cross_entropy(logits.view(-1, V), y.view(-1))


def matmul_transposed(h, W, y):
    return F.cross_entropy((h @ W.t()).view(-1, V), y.view(-1))


def matmul_d_by_v(h, M, y):
    return F.cross_entropy(torch.matmul(h, M).view(-1, V), y.view(-1))


def with_bias(h, W, b, y):
    return F.cross_entropy(F.linear(h, W, b).view(-1, V), y.view(-1))


def class_weights(h, W, y, cw):
    return F.cross_entropy(F.linear(h, W).view(-1, V), y.view(-1), weight=cw)


def label_smoothing(h, W, b, y):
    return F.cross_entropy(F.linear(h, W, b).view(-1, V), y.view(-1), label_smoothing=0.1)


def reduction_none(h, W, y):
    return F.cross_entropy(F.linear(h, W).view(-1, V), y.view(-1), reduction="none")


def reduction_sum(h, W, b, y):
    return F.cross_entropy(F.linear(h, W, b).view(-1, V), y.view(-1), reduction="sum")


def probability_targets(h, W, p):
    return F.cross_entropy(F.linear(h, W).view(-1, V), p)


def classes_on_dim1(h, W, y):
    # (B, T, V) logits moved to (B, V, T): F.cross_entropy's class dim is 1, targets (B, T)
    return F.cross_entropy(F.linear(h, W).transpose(1, 2), y, reduction="none")


def non_contiguous_operands(hT, M, y2):
    # F.linear on transposed views: h (N, D) and the weight (V, D) are both column-major
    return F.cross_entropy(F.linear(hT.t(), M.t()), y2)


def plain_ce(x, y2):
    return F.cross_entropy(x, y2)


CASES = {
    "linear_ce": linear_ce,
    "nn_modules": LinearAndLoss,
    "nll_log_softmax": nll_log_softmax,
    "nll_log_softmax_view": nll_log_softmax_view,
    "torch_linear_cross_entropy": torch_linear_cross_entropy,
    "hf_causal_loss": hf_causal_loss,
    "explicit_shift": explicit_shift,
    "explicit_shift_returning_logits": explicit_shift_returning_logits,
    "shift_returning_logits_reduction_none": shift_returning_logits_reduction_none,
    "slice_of_flattened_rows": slice_of_flattened_rows,
    "softcap": softcap,
    "temperature": temperature,
    "conv1d_addmm": conv1d_addmm,
    "matmul_transposed": matmul_transposed,
    "matmul_d_by_v": matmul_d_by_v,
    "with_bias": with_bias,
    "class_weights": class_weights,
    "label_smoothing": label_smoothing,
    "reduction_none": reduction_none,
    "reduction_sum": reduction_sum,
    "probability_targets": probability_targets,
    "classes_on_dim1": classes_on_dim1,
    "non_contiguous_operands": non_contiguous_operands,
    "plain_ce": plain_ce,
}


def make(name):
    fn = CASES[name]
    return fn() if isinstance(fn, type) else fn


# --------------------------------------------------------------------------- expected graphs


class TestExpectedGraphs(TestCase):
    def run_case(self, name, kind="linear_cross_entropy"):
        fn = make(name)
        r = rewrite(fn, *args_of(fn, data()))
        self.assertEqual((r.site.kind, r.site.action, r.site.reason), (kind, "rewritten", ""))
        self.assertEqual(r.site.op, "smx::" + kind)
        return r

    def test_F_cross_entropy_of_F_linear(self):
        r = self.run_case("linear_ce")
        self.assertExpectedInline(r.before, """\
def forward(self, L_h2_ : torch.Tensor, L_W_ : torch.Tensor, L_y2_ : torch.Tensor):
l_h2_ = L_h2_
l_w_ = L_W_
l_y2_ = L_y2_
linear = torch._C._nn.linear(l_h2_, l_w_)
cross_entropy = torch.nn.functional.cross_entropy(linear, l_y2_)
return (cross_entropy,)""")
        self.assertExpectedInline(r.after, """\
def forward(self, L_h2_ : torch.Tensor, L_W_ : torch.Tensor, L_y2_ : torch.Tensor):
l_h2_ = L_h2_
l_w_ = L_W_
l_y2_ = L_y2_
graph_linear_cross_entropy = smxcompile_passes_cross_entropy_replacement_graph_linear_cross_entropy(l_h2_, l_w_, None, l_y2_, None, -100, 'mean', 0.0, 1.0, None, torch.float32, False, None, False)
getitem = graph_linear_cross_entropy[0]
return (getitem,)""")
        self.assertEqual(r.site.detail, "F.cross_entropy, reduction=mean, ignore_index=-100")

    def test_nn_linear_and_nn_cross_entropy_loss(self):
        r = self.run_case("nn_modules")
        self.assertExpectedInline(r.after, """\
def forward(self, L_self_modules_head_parameters_weight_ : torch.nn.parameter.Parameter, L_self_modules_head_parameters_bias_ : torch.nn.parameter.Parameter, L_h_ : torch.Tensor, L_y_ : torch.Tensor):
l_self_modules_head_parameters_weight_ = L_self_modules_head_parameters_weight_
l_self_modules_head_parameters_bias_ = L_self_modules_head_parameters_bias_
l_h_ = L_h_
l_y_ = L_y_
view_1 = l_y_.view(-1)
graph_linear_cross_entropy = smxcompile_passes_cross_entropy_replacement_graph_linear_cross_entropy(l_h_, l_self_modules_head_parameters_weight_, l_self_modules_head_parameters_bias_, view_1, None, -100, 'mean', 0.0, 1.0, None, torch.float32, False, None, False)
getitem = graph_linear_cross_entropy[0]
return (getitem,)""")

    def test_nll_loss_of_log_softmax(self):
        r = self.run_case("nll_log_softmax")
        self.assertExpectedInline(r.after, """\
def forward(self, L_W_ : torch.Tensor, L_h2_ : torch.Tensor, L_y2_ : torch.Tensor):
l_w_ = L_W_
l_h2_ = L_h2_
l_y2_ = L_y2_
graph_linear_cross_entropy = smxcompile_passes_cross_entropy_replacement_graph_linear_cross_entropy(l_h2_, l_w_, None, l_y2_, None, -100, 'mean', 0.0, 1.0, None, torch.float32, False, None, False)
getitem = graph_linear_cross_entropy[0]
return (getitem,)""")
        self.assertIn("nll_loss(log_softmax)", r.site.detail)

    def test_nll_loss_of_flattened_log_softmax(self):
        r = self.run_case("nll_log_softmax_view")
        self.assertExpectedInline(r.after, """\
def forward(self, L_W_ : torch.Tensor, L_h_ : torch.Tensor, L_y_ : torch.Tensor):
l_w_ = L_W_
l_h_ = L_h_
l_y_ = L_y_
view_1 = l_y_.view(-1)
graph_linear_cross_entropy = smxcompile_passes_cross_entropy_replacement_graph_linear_cross_entropy(l_h_, l_w_, None, view_1, None, -100, 'mean', 0.0, 1.0, None, torch.float32, False, None, False)
getitem = graph_linear_cross_entropy[0]
return (getitem,)""")

    def test_torch_linear_cross_entropy(self):
        # Dynamo inlines F.linear_cross_entropy into linear + cross_entropy: the same site
        r = self.run_case("torch_linear_cross_entropy")
        self.assertExpectedInline(r.after, """\
def forward(self, L_h2_ : torch.Tensor, L_W_ : torch.Tensor, L_y2_ : torch.Tensor):
l_h2_ = L_h2_
l_w_ = L_W_
l_y2_ = L_y2_
graph_linear_cross_entropy = smxcompile_passes_cross_entropy_replacement_graph_linear_cross_entropy(l_h2_, l_w_, None, l_y2_, None, -100, 'mean', 0.0, 1.0, None, torch.float32, False, None, False)
getitem = graph_linear_cross_entropy[0]
return (getitem,)""")

    def test_hf_causal_lm_loss_returns_the_ops_logits(self):
        r = self.run_case("hf_causal_loss")
        self.assertExpectedInline(r.before, """\
def forward(self, L_h_ : torch.Tensor, L_W_ : torch.Tensor, L_y_ : torch.Tensor, L_n_ : torch.Tensor):
l_h_ = L_h_
l_w_ = L_W_
l_y_ = L_y_
l_n_ = L_n_
logits = torch._C._nn.linear(l_h_, l_w_)
upcast = logits.float()
pad = torch._C._nn.pad(l_y_, (0, 1), 'constant', -100)
getitem = pad[(Ellipsis, slice(1, None, None))]
labels = getitem.contiguous()
view = upcast.view(-1, 11)
view_1 = labels.view(-1)
cross_entropy = torch.nn.functional.cross_entropy(view, view_1, ignore_index = -100, reduction = 'sum')
loss = cross_entropy / l_n_
return (loss, logits)""")
        self.assertExpectedInline(r.after, """\
def forward(self, L_h_ : torch.Tensor, L_W_ : torch.Tensor, L_y_ : torch.Tensor, L_n_ : torch.Tensor):
l_h_ = L_h_
l_w_ = L_W_
l_y_ = L_y_
l_n_ = L_n_
pad = torch._C._nn.pad(l_y_, (0, 1), 'constant', -100)
getitem = pad[(Ellipsis, slice(1, None, None))]
labels = getitem.contiguous()
view_1 = labels.view(-1)
graph_linear_cross_entropy = smxcompile_passes_cross_entropy_replacement_graph_linear_cross_entropy(l_h_, l_w_, None, view_1, None, -100, 'sum', 0.0, 1.0, None, torch.float32, True, torch.float32, False)
getitem_1 = graph_linear_cross_entropy[0]
getitem_2 = graph_linear_cross_entropy[1]
loss = getitem_1 / l_n_
return (loss, getitem_2)""")
        # the graph returns the op's logits (item 1 of its result); no linear is left
        self.assertIn("return (loss, getitem_2)", r.after)
        self.assertIn("getitem_2 = graph_linear_cross_entropy[1]", r.after)
        self.assertNotIn("linear(", r.after)
        self.assertIn("float32 cast", r.site.detail)
        self.assertIn("logits 2x5x11 float32 are also a graph output", r.site.detail)

    def test_explicit_shift(self):
        r = self.run_case("explicit_shift")
        self.assertExpectedInline(r.after, """\
def forward(self, L_W_ : torch.Tensor, L_h_ : torch.Tensor, L_y_ : torch.Tensor):
l_w_ = L_W_
l_h_ = L_h_
l_y_ = L_y_
getitem_1 = l_y_[(Ellipsis, slice(1, None, None))]
shift_labels = getitem_1.contiguous()
view_1 = shift_labels.view(-1)
getitem_2 = l_h_[(Ellipsis, slice(None, -1, None), slice(None, None, None))]
graph_linear_cross_entropy = smxcompile_passes_cross_entropy_replacement_graph_linear_cross_entropy(getitem_2, l_w_, None, view_1, None, -100, 'mean', 0.0, 1.0, None, torch.float32, False, None, False)
getitem_3 = graph_linear_cross_entropy[0]
return (getitem_3,)""")
        self.assertIn("row slice [..., :-1, :]", r.site.detail)

    def test_explicit_shift_returning_logits_computes_every_row(self):
        # the returned logits have all T rows: the op gets the unsliced h, the dropped rows are ignored
        r = self.run_case("explicit_shift_returning_logits")
        self.assertIn("every row is computed (returned), the rows the loss slices off get ignore_index", r.site.detail)
        self.assertExpectedInline(r.after, """\
def forward(self, L_h_ : torch.Tensor, L_W_ : torch.Tensor, L_y_ : torch.Tensor):
l_h_ = L_h_
l_w_ = L_W_
l_y_ = L_y_
getitem_1 = l_y_[(Ellipsis, slice(1, None, None))]
shift_labels = getitem_1.contiguous()
view_1 = shift_labels.view(-1)
graph_linear_cross_entropy = smxcompile_passes_cross_entropy_replacement_graph_linear_cross_entropy(l_h_, l_w_, None, view_1, None, -100, 'mean', 0.0, 1.0, None, torch.float32, True, torch.float32, False, row_ops = (('slice', (Ellipsis, slice(None, -1, None), slice(None, None, None))),))
getitem_2 = graph_linear_cross_entropy[0]
getitem_3 = graph_linear_cross_entropy[1]
return (getitem_2, getitem_3)""")

    def test_slice_of_flattened_rows(self):
        r = self.run_case("slice_of_flattened_rows")
        self.assertExpectedInline(r.after, """\
def forward(self, L_h_ : torch.Tensor, L_W_ : torch.Tensor, L_y_ : torch.Tensor):
l_h_ = L_h_
l_w_ = L_W_
l_y_ = L_y_
view_1 = l_y_.view(-1)
getitem_1 = view_1[slice(None, -3, None)]
flatten = l_h_.flatten(0, -2)
getitem_2 = flatten[(slice(None, -3, None),)]
graph_linear_cross_entropy = smxcompile_passes_cross_entropy_replacement_graph_linear_cross_entropy(getitem_2, l_w_, None, getitem_1, None, -100, 'mean', 0.0, 1.0, None, torch.float32, False, None, False)
getitem_3 = graph_linear_cross_entropy[0]
return (getitem_3,)""")

    def test_softcap_returned_after_the_cap(self):
        r = self.run_case("softcap")
        self.assertExpectedInline(r.after, """\
def forward(self, L_h_ : torch.Tensor, L_W_ : torch.Tensor, L_y_ : torch.Tensor):
l_h_ = L_h_
l_w_ = L_W_
l_y_ = L_y_
view_1 = l_y_.view(-1)
graph_linear_cross_entropy = smxcompile_passes_cross_entropy_replacement_graph_linear_cross_entropy(l_h_, l_w_, None, view_1, None, -100, 'mean', 0.0, 1.0, 3.0, torch.float32, True, torch.float32, False)
getitem = graph_linear_cross_entropy[0]
getitem_1 = graph_linear_cross_entropy[1]
return (getitem, getitem_1)""")
        self.assertIn("softcap=3", r.site.detail)

    def test_temperature(self):
        r = self.run_case("temperature")
        self.assertExpectedInline(r.after, """\
def forward(self, L_h_ : torch.Tensor, L_W_ : torch.Tensor, L_y_ : torch.Tensor):
l_h_ = L_h_
l_w_ = L_W_
l_y_ = L_y_
view_1 = l_y_.view(-1)
graph_linear_cross_entropy = smxcompile_passes_cross_entropy_replacement_graph_linear_cross_entropy(l_h_, l_w_, None, view_1, None, -100, 'mean', 0.0, 1.4285714285714286, None, torch.float32, False, None, False)
getitem = graph_linear_cross_entropy[0]
return (getitem,)""")
        self.assertIn("scale=1.42857", r.site.detail)

    def test_gpt2_conv1d_addmm(self):
        r = self.run_case("conv1d_addmm")
        self.assertExpectedInline(r.after, """\
def forward(self, L_h_ : torch.Tensor, L_b_ : torch.Tensor, L_M_ : torch.Tensor, L_y_ : torch.Tensor):
l_h_ = L_h_
l_b_ = L_b_
l_m_ = L_M_
l_y_ = L_y_
view = l_h_.view(-1, 8)
view_3 = l_y_.view(-1)
graph_linear_cross_entropy = smxcompile_passes_cross_entropy_replacement_graph_linear_cross_entropy(view, l_m_, l_b_, view_3, None, -100, 'mean', 0.0, 1.0, None, torch.float32, False, None, True)
getitem = graph_linear_cross_entropy[0]
return (getitem,)""")

    def test_matmul_with_transposed_weight(self):
        r = self.run_case("matmul_transposed")
        self.assertExpectedInline(r.after, """\
def forward(self, L_W_ : torch.Tensor, L_h_ : torch.Tensor, L_y_ : torch.Tensor):
l_w_ = L_W_
l_h_ = L_h_
l_y_ = L_y_
view_1 = l_y_.view(-1)
graph_linear_cross_entropy = smxcompile_passes_cross_entropy_replacement_graph_linear_cross_entropy(l_h_, l_w_, None, view_1, None, -100, 'mean', 0.0, 1.0, None, torch.float32, False, None, False)
getitem = graph_linear_cross_entropy[0]
return (getitem,)""")

    def test_matmul_with_d_by_v_matrix(self):
        r = self.run_case("matmul_d_by_v")
        self.assertExpectedInline(r.after, """\
def forward(self, L_h_ : torch.Tensor, L_M_ : torch.Tensor, L_y_ : torch.Tensor):
l_h_ = L_h_
l_m_ = L_M_
l_y_ = L_y_
view_1 = l_y_.view(-1)
graph_linear_cross_entropy = smxcompile_passes_cross_entropy_replacement_graph_linear_cross_entropy(l_h_, l_m_, None, view_1, None, -100, 'mean', 0.0, 1.0, None, torch.float32, False, None, True)
getitem = graph_linear_cross_entropy[0]
return (getitem,)""")

    def test_bias(self):
        r = self.run_case("with_bias")
        self.assertExpectedInline(r.after, """\
def forward(self, L_h_ : torch.Tensor, L_W_ : torch.Tensor, L_b_ : torch.Tensor, L_y_ : torch.Tensor):
l_h_ = L_h_
l_w_ = L_W_
l_b_ = L_b_
l_y_ = L_y_
view_1 = l_y_.view(-1)
graph_linear_cross_entropy = smxcompile_passes_cross_entropy_replacement_graph_linear_cross_entropy(l_h_, l_w_, l_b_, view_1, None, -100, 'mean', 0.0, 1.0, None, torch.float32, False, None, False)
getitem = graph_linear_cross_entropy[0]
return (getitem,)""")

    def test_class_weights(self):
        r = self.run_case("class_weights")
        self.assertExpectedInline(r.after, """\
def forward(self, L_h_ : torch.Tensor, L_W_ : torch.Tensor, L_y_ : torch.Tensor, L_cw_ : torch.Tensor):
l_h_ = L_h_
l_w_ = L_W_
l_y_ = L_y_
l_cw_ = L_cw_
view_1 = l_y_.view(-1)
graph_linear_cross_entropy = smxcompile_passes_cross_entropy_replacement_graph_linear_cross_entropy(l_h_, l_w_, None, view_1, l_cw_, -100, 'mean', 0.0, 1.0, None, torch.float32, False, None, False)
getitem = graph_linear_cross_entropy[0]
return (getitem,)""")
        self.assertIn("class weights", r.site.detail)

    def test_label_smoothing(self):
        r = self.run_case("label_smoothing")
        self.assertExpectedInline(r.after, """\
def forward(self, L_h_ : torch.Tensor, L_W_ : torch.Tensor, L_b_ : torch.Tensor, L_y_ : torch.Tensor):
l_h_ = L_h_
l_w_ = L_W_
l_b_ = L_b_
l_y_ = L_y_
view_1 = l_y_.view(-1)
graph_linear_cross_entropy = smxcompile_passes_cross_entropy_replacement_graph_linear_cross_entropy(l_h_, l_w_, l_b_, view_1, None, -100, 'mean', 0.1, 1.0, None, torch.float32, False, None, False)
getitem = graph_linear_cross_entropy[0]
return (getitem,)""")

    def test_reduction_none(self):
        r = self.run_case("reduction_none")
        self.assertExpectedInline(r.after, """\
def forward(self, L_h_ : torch.Tensor, L_W_ : torch.Tensor, L_y_ : torch.Tensor):
l_h_ = L_h_
l_w_ = L_W_
l_y_ = L_y_
view_1 = l_y_.view(-1)
graph_linear_cross_entropy = smxcompile_passes_cross_entropy_replacement_graph_linear_cross_entropy(l_h_, l_w_, None, view_1, None, -100, 'none', 0.0, 1.0, None, torch.float32, False, None, False)
getitem = graph_linear_cross_entropy[0]
return (getitem,)""")

    def test_probability_targets(self):
        r = self.run_case("probability_targets")
        self.assertExpectedInline(r.after, """\
def forward(self, L_h_ : torch.Tensor, L_W_ : torch.Tensor, L_p_ : torch.Tensor):
l_h_ = L_h_
l_w_ = L_W_
l_p_ = L_p_
graph_linear_cross_entropy = smxcompile_passes_cross_entropy_replacement_graph_linear_cross_entropy(l_h_, l_w_, None, l_p_, None, -100, 'mean', 0.0, 1.0, None, torch.float32, False, None, False)
getitem = graph_linear_cross_entropy[0]
return (getitem,)""")

    def test_classes_on_dim_1(self):
        r = self.run_case("classes_on_dim1")
        self.assertExpectedInline(r.after, """\
def forward(self, L_h_ : torch.Tensor, L_W_ : torch.Tensor, L_y_ : torch.Tensor):
l_h_ = L_h_
l_w_ = L_W_
l_y_ = L_y_
graph_linear_cross_entropy = smxcompile_passes_cross_entropy_replacement_graph_linear_cross_entropy(l_h_, l_w_, None, l_y_, None, -100, 'none', 0.0, 1.0, None, torch.float32, False, None, False)
getitem = graph_linear_cross_entropy[0]
return (getitem,)""")
        self.assertIn("classes moved to dim 1 by 'transpose'", r.site.detail)

    def test_classes_on_dim_1_spellings(self):
        d = data()
        for move in (lambda t: t.permute(0, 2, 1), lambda t: t.movedim(-1, 1), lambda t: torch.transpose(t, 2, 1),
                     lambda t: t.swapaxes(-1, -2)):
            r = rewrite(lambda h, W, y: F.cross_entropy(move(F.linear(h, W)), y), d["h"], d["W"], d["y"])
            self.assertEqual((r.site.kind, r.site.action), ("linear_cross_entropy", "rewritten"))
            self.assertIn("classes moved to dim 1", r.site.detail)
        # not from a linear layer: the plain CE with the classes last, no copy
        r = rewrite(lambda x, y: F.cross_entropy(x.transpose(1, 2), y, reduction="none"), d["x"].view(B, T, V), d["y"])
        self.assertEqual((r.site.kind, r.site.action), ("cross_entropy", "rewritten"))
        self.assertIn("graph_cross_entropy(l_x_, l_y_, None, -100, 'none', 0.0, torch.float32, classes_last = True)",
                      r.after)

    def test_plain_cross_entropy_on_logits_not_from_a_linear_layer(self):
        r = self.run_case("plain_ce", kind="cross_entropy")
        self.assertExpectedInline(r.after, """\
def forward(self, L_x_ : torch.Tensor, L_y2_ : torch.Tensor):
l_x_ = L_x_
l_y2_ = L_y2_
graph_cross_entropy = smxcompile_passes_cross_entropy_replacement_graph_cross_entropy(l_x_, l_y2_, None, -100, 'mean', 0.0, torch.float32)
return (graph_cross_entropy,)""")
        # the logits are a graph input (a loss compiled alone, or a graph break before the loss)
        self.assertIn("not cut: logits come from 'l_x_' (placeholder), not a linear layer", r.site.detail)


# --------------------------------------------------------------------------- near-misses


class TestNearMisses(TestCase):
    def assertNotCut(self, r: Rewrite, why: str):
        self.assertEqual(r.site.kind, "cross_entropy", str(r.report))
        self.assertIn("not cut: " + why, r.site.detail)

    def test_logits_feeding_another_loss_get_the_plain_ce(self):
        def fn(h, W, y):
            logits = F.linear(h, W)
            return F.cross_entropy(logits.view(-1, V), y.view(-1)) + logits.square().mean()

        d = data()
        r = rewrite(fn, d["h"], d["W"], d["y"])
        self.assertNotCut(r, "the logits ('logits') also feed other computation ('square'): cut CE would compute "
                             "them twice")
        self.assertEqual(r.site.action, "rewritten")
        self.assertExpectedInline(r.after, """\
def forward(self, L_h_ : torch.Tensor, L_W_ : torch.Tensor, L_y_ : torch.Tensor):
l_h_ = L_h_
l_w_ = L_W_
l_y_ = L_y_
logits = torch._C._nn.linear(l_h_, l_w_)
view = logits.view(-1, 11)
view_1 = l_y_.view(-1)
graph_cross_entropy = smxcompile_passes_cross_entropy_replacement_graph_cross_entropy(view, view_1, None, -100, 'mean', 0.0, torch.float32)
square = logits.square()
mean = square.mean()
add = graph_cross_entropy + mean
return (add,)""")
        # the default CPU policy keeps the plain CE for Inductor
        r = rewrite(fn, d["h"], d["W"], d["y"], options=None)
        self.assertEqual(r.before, r.after)
        self.assertEqual((r.site.kind, r.site.action), ("cross_entropy", "kept"))
        self.assertIn("Inductor's fused C++ cross-entropy", r.site.reason)

    def test_log_softmax_over_a_non_class_dim_is_not_a_cross_entropy(self):
        def fn(h2, W, y2):
            return F.nll_loss(F.log_softmax(F.linear(h2, W), 0), y2)

        d = data()
        r = rewrite(fn, d["h2"], d["W"], d["y2"])
        self.assertEqual([s.kind for s in r.report], ["log_softmax"])   # only the log-softmax rewrite
        self.assertIn("nll_loss = torch.nn.functional.nll_loss(getitem", r.after)

    def test_flattened_log_softmax_over_a_non_class_dim(self):
        def fn(h, W, y):
            return F.nll_loss(F.log_softmax(F.linear(h, W), 1).view(-1, V), y.view(-1))

        d = data()
        r = rewrite(fn, d["h"], d["W"], d["y"])
        self.assertNotIn("cross_entropy", [s.kind for s in r.report])

    def test_legacy_reduce_arguments(self):
        d = data()
        for kw, reduction in (({"reduce": False}, "none"), ({"size_average": False}, "sum")):
            with self.subTest(kw=kw), pytest.warns(UserWarning, match="size_average and reduce"):
                r = rewrite(lambda h, W, y: F.cross_entropy(F.linear(h, W).view(-1, V), y.view(-1), **kw),
                            d["h"], d["W"], d["y"])
            self.assertEqual(r.before, r.after)
            self.assertEqual((r.site.kind, r.site.action, r.site.reason),
                             ("cross_entropy", "skipped", "legacy size_average/reduce arguments"))
            self.assertIn(f"reduction={reduction}", r.site.detail)

    def test_down_cast_before_the_loss(self):
        d = data()
        r = rewrite(lambda h, W, y: F.cross_entropy(F.linear(h, W).half().view(-1, V), y.view(-1)),
                    d["h"], d["W"], d["y"], check_values=False)
        self.assertNotCut(r, "'half' casts the logits down (torch.float32 -> torch.float16)")

    def test_reshape_mixing_the_class_dim(self):
        def fn(h, W, y):
            return F.cross_entropy(F.linear(h, W).reshape(-1, 6), y.view(-1))

        d = data()
        r = rewrite(fn, d["h"], torch.randn(12, D), torch.randint(0, 6, (B, 2 * T)))
        self.assertNotCut(r, "'reshape' reshapes across the class dim")
        self.assertIn("graph_cross_entropy(reshape, view", r.after)

    def test_logits_returned_before_a_temperature_only_the_loss_applies(self):
        def fn(h, W, y):
            logits = F.linear(h, W)
            return F.cross_entropy((logits / 0.7).view(-1, V), y.view(-1)), logits

        d = data()
        r = rewrite(fn, d["h"], d["W"], d["y"])
        self.assertNotCut(r, "the returned logits are taken before the temperature/soft-cap that the loss applies")
        self.assertExpectedInline(r.after, """\
def forward(self, L_h_ : torch.Tensor, L_W_ : torch.Tensor, L_y_ : torch.Tensor):
l_h_ = L_h_
l_w_ = L_W_
l_y_ = L_y_
logits = torch._C._nn.linear(l_h_, l_w_)
truediv = logits / 0.7
view = truediv.view(-1, 11)
view_1 = l_y_.view(-1)
graph_cross_entropy = smxcompile_passes_cross_entropy_replacement_graph_cross_entropy(view, view_1, None, -100, 'mean', 0.0, torch.float32)
return (graph_cross_entropy, logits)""")

    def test_logits_returned_before_a_row_slice_with_probability_targets(self):
        # the op would have to ignore the dropped rows; probability targets have no ignore_index
        def fn(h, W, p):
            logits = F.linear(h, W)
            return F.cross_entropy(logits[:, :-1].reshape(-1, V), p[: B * (T - 1)]), logits

        d = data()
        r = rewrite(fn, d["h"], d["W"], d["p"])
        self.assertNotCut(r, "the returned logits are taken before a row slice and the targets are probabilities")

    def test_logits_returned_as_a_view(self):
        def fn(h, W, y):
            flat = F.linear(h, W).view(-1, V)
            return F.cross_entropy(flat, y.view(-1)), flat

        d = data()
        r = rewrite(fn, d["h"], d["W"], d["y"])
        self.assertNotCut(r, "the returned logits ('flat') are a reshaped/sliced view")

    def test_in_place_op_on_the_logits(self):
        def fn(h, W, y):
            logits = F.linear(h, W)
            logits.mul_(2.0)
            return F.cross_entropy(logits.view(-1, V), y.view(-1))

        d = data()
        r = rewrite(fn, d["h"], d["W"], d["y"])
        self.assertNotCut(r, "the logits ('logits') are modified in place by 'mul_'")
        self.assertIn("mul_ = logits.mul_(2.0)", r.after)

    def test_in_place_op_on_the_upcast_logits(self):
        def fn(h, W, y):
            logits = F.linear(h, W).float()
            logits.div_(2.0)
            return F.cross_entropy(logits.view(-1, V), y.view(-1)), logits

        d = data()
        r = rewrite(fn, d["h"], d["W"], d["y"])
        self.assertNotCut(r, "the logits ('logits') are modified in place by 'div_'")

    def test_in_place_op_on_h_between_the_linear_and_the_loss(self):
        # the op sits at the loss and would read h after add_: the site must be left alone
        def fn(h, W, y):
            h = h * 1.0
            logits = F.linear(h, W)
            h.add_(1.0)
            return F.cross_entropy(logits.view(-1, V), y.view(-1))

        d = data()
        r = rewrite(fn, d["h"], d["W"], d["y"])
        self.assertEqual(r.before, r.after)
        self.assertEqual((r.site.kind, r.site.action), ("linear_cross_entropy", "skipped"))
        self.assertEqual(r.site.reason, "in-place op 'add_' runs inside the pattern")

    def test_two_losses_on_the_same_logits(self):
        def fn(h, W, y):
            logits = F.linear(h, W).view(-1, V)
            return F.cross_entropy(logits, y.view(-1)) + F.cross_entropy(logits, y.view(-1).flip(0))

        d = data()
        r = rewrite(fn, d["h"], d["W"], d["y"])
        self.assertEqual([(s.kind, s.action) for s in r.report], [("cross_entropy", "rewritten")] * 2)

    def test_probability_targets_that_require_grad(self):
        def fn(h, W, x):
            return F.cross_entropy(F.linear(h, W).view(-1, V), torch.softmax(x, -1))

        d = data()
        r = rewrite(fn, d["h"], d["W"], d["x"].requires_grad_())
        (site,) = [s for s in r.report if s.kind != "softmax"]
        self.assertEqual((site.kind, site.action), ("linear_cross_entropy", "skipped"))
        self.assertIn("probability targets that require grad", site.reason)

    def test_classes_on_dim_1_with_probability_targets_is_left_alone(self):
        def fn(h, W, p):
            return F.cross_entropy(F.linear(h, W).transpose(1, 2), p)

        d = data()
        r = rewrite(fn, d["h"], d["W"], d["p"].reshape(B, T, V).transpose(1, 2))
        self.assertEqual(r.before, r.after)
        self.assertEqual((r.site.kind, r.site.action), ("cross_entropy", "skipped"))
        self.assertIn("logits of rank 3 (classes on dim 1)", r.site.reason)

    def test_disabled_by_option(self):
        d = data()
        r = rewrite(linear_ce, d["h2"], d["W"], d["y2"], options={**REWRITE, "linear_cross_entropy": False})
        self.assertEqual(r.before, r.after)
        self.assertEqual((r.site.action, r.site.reason),
                         ("kept", "rewrite kind 'linear_cross_entropy' disabled by options"))


# --------------------------------------------------------------------------- CPU policy


class TestPolicy(TestCase):
    def test_default_cpu_policy_keeps_small_vocabularies(self):
        d = data(requires_grad=True)
        r = rewrite(linear_ce, d["h2"], d["W"], d["y2"], options=None)
        self.assertEqual(r.before, r.after)
        self.assertEqual((r.site.kind, r.site.action), ("linear_cross_entropy", "kept"))
        self.assertTrue(r.site.reason.startswith(f"CPU: {V} classes; below {CPU_MIN_VOCAB}"), r.site.reason)
        r = rewrite(plain_ce, d["x"], d["y2"], options=None)
        self.assertEqual((r.site.kind, r.site.action), ("cross_entropy", "kept"))

    def test_default_cpu_policy_rewrites_large_vocabularies(self):
        h, W = torch.randn(4, 8, requires_grad=True), torch.randn(CPU_MIN_VOCAB, 8)
        r = rewrite(linear_ce, h, W, torch.tensor([0, 5, -100, CPU_MIN_VOCAB - 1]), options=None)
        self.assertEqual((r.site.kind, r.site.action), ("linear_cross_entropy", "rewritten"))
        # the same site without a gradient (evaluation) is kept: Inductor's code is faster there
        r = rewrite(linear_ce, h.detach(), W, torch.tensor([0, 5, -100, CPU_MIN_VOCAB - 1]), options=None)
        self.assertEqual((r.site.action, r.site.reason[:26]), ("kept", "CPU: no gradient (evaluati"))
        gm = dynamo_graph(linear_ce, torch.randn(4, 8), torch.randn(CPU_MIN_VOCAB - 1, 8), torch.tensor([0, 1, 2, 3]))
        (site,) = analyze(gm.graph, SmxOptions()).sites
        self.assertEqual(site.action, "kept")

    def test_default_cpu_policy_keeps_bf16_training(self):
        W, y = torch.randn(CPU_MIN_VOCAB, 8), torch.tensor([0, 5, -100, CPU_MIN_VOCAB - 1])
        h = torch.randn(4, 8, dtype=torch.bfloat16, requires_grad=True)
        r = rewrite(linear_ce, h, W.bfloat16(), y, options=None)
        self.assertEqual((r.site.action, r.site.reason[:9]), ("kept", "CPU: bf16"))
        h = torch.randn(4, 8, dtype=torch.float16, requires_grad=True)
        r = rewrite(linear_ce, h, W.half(), y, options=None, check_values=False)
        self.assertEqual((r.site.kind, r.site.action), ("linear_cross_entropy", "rewritten"))

    def test_cpu_keep(self):
        d = data()
        r = rewrite(linear_ce, d["h2"], d["W"], d["y2"], options={"cpu": "keep"})
        self.assertEqual((r.site.action, r.site.reason), ("kept", "options cpu='keep'"))

    def test_pass_is_idempotent(self):
        d = data()
        gm = dynamo_graph(hf_causal_loss, d["h"], d["W"], d["y"], d["n"])
        p = SmxPass(SmxOptions.from_mapping(REWRITE))
        p(gm.graph)
        once = str(gm.graph)
        p(gm.graph)
        self.assertEqual(str(gm.graph), once)


# --------------------------------------------------------------------------- numerics (compiled)


POSITIVE = list(CASES)


@pytest.mark.parametrize("name", POSITIVE)
def test_compiled_matches_eager(name):
    fn = make(name)
    kind = "cross_entropy" if name == "plain_ce" else "linear_cross_entropy"
    ref = step(fn, data(requires_grad=True))
    compiled, reports = compile_report(fn)
    with kernel_spy() as calls:
        got = step(compiled, data(requires_grad=True)) if not isinstance(fn, nn.Module) else _module_step(fn, compiled)
    assert [(s.kind, s.action) for s in reports()] == [(kind, "rewritten")], str(reports())
    assert calls["fused"] + calls["stats"] >= 1, calls   # the smx kernels ran
    if kind == "linear_cross_entropy" and name not in ("reduction_none", "probability_targets", "classes_on_dim1",
                                                       "shift_returning_logits_reduction_none"):
        assert calls["fused"] == 1, calls                 # scalar loss: the gradients come from the fused forward
    assert_matches(got, ref)
    if name in ("with_bias", "reduction_sum", "hf_causal_loss"):
        # every target ignored: mean -> NaN (as eager), sum -> 0; zero gradients from the loss
        d = data(requires_grad=True)
        d["y"] = torch.full_like(d["y"], -100)
        ref = step(fn, d)
        d = data(requires_grad=True)
        d["y"] = torch.full_like(d["y"], -100)
        got = step(compiled, d)
        assert_matches(got, ref)
        assert got[0][0].isnan().item() == (name == "with_bias")
        if name == "reduction_sum":
            assert got[0][0].item() == 0.0 and all(g.abs().max().item() == 0 for g in got[1])


def _module_step(module, compiled):
    """step() on a compiled module: its parameters are the module's."""
    module.zero_grad(set_to_none=True)
    d = data(requires_grad=True)
    inputs = args_of(module, d)
    outs = _outputs(compiled(*inputs))
    leaves = [a for a in inputs if isinstance(a, torch.Tensor) and a.requires_grad]
    grads = torch.autograd.grad(_objective(outs), leaves + list(module.parameters()))
    return tuple(o.detach() for o in outs), grads


def test_bf16_autocast_matches_eager():
    # the lm_head runs in bf16 (its logits are returned in bf16), the loss in fp32 on the up-cast logits
    ref_fp32 = step(hf_causal_loss, data(requires_grad=True))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = step(hf_causal_loss, data(requires_grad=True))
        compiled, reports = compile_report(hf_causal_loss)
        with kernel_spy() as calls:
            got = step(compiled, data(requires_grad=True))
    (site,) = reports().sites
    assert (site.kind, site.action) == ("linear_cross_entropy", "rewritten")
    assert "logits 2x5x11 bfloat16 are also a graph output" in site.detail
    assert calls["fused"] == 1
    (loss, logits), grads = got
    assert (loss.dtype, logits.dtype) == (torch.float32, torch.bfloat16)
    # the op rounds the logits to bf16 as the layer does and takes the loss from the rounded ones
    torch.testing.assert_close(logits, ref[0][1], rtol=0, atol=0)
    torch.testing.assert_close(loss, ref[0][0], rtol=1e-5, atol=1e-6)
    for a, b, c in zip(grads, ref[1], ref_fp32[1]):
        assert a.dtype == b.dtype and a.shape == b.shape
        # gradients: bf16 matmuls with fp32 accumulation, as close to eager bf16 as eager bf16 is to fp32
        assert (a - b).abs().max() <= 2 * (b - c).abs().max() + 1e-6


def test_autocast_region_ending_before_the_loss():
    # the linear ran in bf16 inside the region, the loss outside it: the op must still compute the
    # logits in bf16 (an fp32 rewrite would be "more exact" than eager and disagree with it)
    def fn(h, W, y):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = F.linear(h, W)
        return F.cross_entropy(logits.float().view(-1, V), y.view(-1))

    d = data()
    ref = fn(d["h"], d["W"], d["y"])
    fp32 = F.cross_entropy(F.linear(d["h"], d["W"]).view(-1, V), d["y"].view(-1))
    assert (ref - fp32).abs().item() > 1e-4  # bf16 rounding is visible at this tolerance
    compiled, reports = compile_report(fn)
    got = compiled(d["h"], d["W"], d["y"])
    assert [(s.kind, s.action) for s in reports()] == [("linear_cross_entropy", "rewritten")]
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


def test_dynamic_shapes():
    compiled, reports = compile_report(explicit_shift_returning_logits, dynamic=True)
    for seed, (b, t) in enumerate(((2, 5), (3, 7))):
        g = torch.Generator().manual_seed(seed)
        d = {"h": torch.randn(b, t, D, generator=g).requires_grad_(), "W": data()["W"].requires_grad_(),
             "y": torch.randint(0, V, (b, t), generator=g)}
        d["y"][0, 2] = -100
        with kernel_spy() as calls:
            got = step(compiled, d)
        assert calls["fused"] == 1
        assert_matches(got, step(explicit_shift_returning_logits, d))
    (site,) = reports().sites   # compiled once, for symbolic shapes
    assert (site.kind, site.action) == ("linear_cross_entropy", "rewritten")
    assert "dynamic shapes" in " ".join(reports().notes)


def test_dynamic_shapes_default_policy_decides_on_the_example_vocabulary():
    # with dynamic=True the vocabulary of a function argument is symbolic; the CPU policy uses its size
    # on the example (a speed choice: the rewrite is exact for any size)
    compiled, reports = compile_report(linear_ce, options=None, dynamic=True)
    h, W, y = torch.randn(6, 8, requires_grad=True), torch.randn(CPU_MIN_VOCAB, 8), torch.randint(0, CPU_MIN_VOCAB, (6,))
    torch.testing.assert_close(compiled(h, W, y), linear_ce(h, W, y))
    (site,) = reports().sites
    assert (site.kind, site.action) == ("linear_cross_entropy", "rewritten"), str(reports())


def test_check_option_passes_on_a_ce_site():
    compiled, reports = compile_report(hf_causal_loss, options={"check": True, "cpu": "rewrite"})
    ref = step(hf_causal_loss, data(requires_grad=True))
    assert_matches(step(compiled, data(requires_grad=True)), ref)
    (site,) = reports().sites
    assert (site.kind, site.action) == ("linear_cross_entropy", "rewritten")


def test_check_option_rejects_a_wrong_ce_kernel(monkeypatch):
    # the check runs the site through the kernel on the example inputs: a kernel that gets the target
    # logit wrong is caught, and the site is put back
    stats = ce_kernels.torch_forward

    def wrong(*a, **k):
        lse, tl, om, ws = stats(*a, **k)
        return lse, tl * 0.5, om, ws

    monkeypatch.setattr(ce_kernels, "torch_forward", wrong)
    compiled, reports = compile_report(with_bias, options={"check": True, "cpu": "rewrite"})
    d = data()
    torch.testing.assert_close(compiled(d["h"], d["W"], d["b"], d["y"]), with_bias(d["h"], d["W"], d["b"], d["y"]))
    (site,) = reports().sites
    assert (site.kind, site.action) == ("linear_cross_entropy", "kept")
    assert site.reason.startswith("check failed")


def test_explain_shows_the_linear_cross_entropy_site():
    class LM(nn.Module):
        def __init__(self, vocab):
            super().__init__()
            self.emb = nn.Embedding(vocab, 8)
            self.lm_head = nn.Linear(8, vocab, bias=False)

        def forward(self, ids, labels):
            logits = self.lm_head(torch.tanh(self.emb(ids)))
            return F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1)), logits

    torch.manual_seed(0)
    ids = torch.randint(0, CPU_MIN_VOCAB, (2, 3))
    rep = smxcompile.explain(LM(CPU_MIN_VOCAB), ids, ids)
    (site,) = rep.sites
    assert (site.kind, site.action, site.op) == ("linear_cross_entropy", "rewritten", "smx::linear_cross_entropy")
    line = inspect.getsourcelines(LM.forward)[1] + 2
    assert site.location == f"{HERE}:{line}"
    assert "logits 2x3x4096 float32 are also a graph output" in site.detail
    assert "linear_cross_entropy" in str(rep)
    small = smxcompile.explain(LM(V), torch.randint(0, V, (2, 3)), torch.randint(0, V, (2, 3)))
    assert [(s.kind, s.action) for s in small] == [("linear_cross_entropy", "kept")]
    assert small.sites[0].reason.startswith(f"CPU: {V} classes")


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
