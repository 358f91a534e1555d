"""Expected-graph and numerical tests of the softmax + top-k / argmax pass (smxcompile.passes.softmax_topk).

Each form is traced with Dynamo, rewritten by :class:`SmxPass` and compared with an inline expected
graph (``EXPECTTEST_ACCEPT=1 pytest tests/passes/test_softmax_topk_pass.py`` regenerates them; read the diff).
Every rewritten graph is also run against the original function (:func:`assert_matches_eager`): its
floating-point outputs must be as close to an fp64 gold as torch's own (``|ours - gold| <= |torch - gold|
+ tol``), its integer outputs (indices, samples) equal to torch's on tie-free inputs, and the gradients
w.r.t. the logits obey the same bound. Near-misses check that this pass leaves the graph alone (the
softmax, if anything, is the softmax pass's) and what the report says. The CPU decomposition's selection
strategies and special values run through ``torch.compile(backend="smx")``.
"""

from __future__ import annotations

import copy
from unittest import mock

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from expecttest import TestCase
from hypothesis import HealthCheck, given, settings, strategies as st

import smxcompile
from smxcompile.kernels.softmax_topk import decomposed as K
from smxcompile.options import SmxOptions
from smxcompile.passes import SmxPass
from pass_helpers import Rewrite, dynamo_graph, graph_text, rewrite

REWRITE = {"cpu": "rewrite"}


# --------------------------------------------------------------------------- helpers


def run_pass(fn, *args, options=REWRITE, own_source: bool = True) -> Rewrite:
    """Trace ``fn`` with Dynamo and run SmxPass on its graph (no value check: see assert_matches_eager).

    ``own_source``: the sites must point at ``fn``'s lines in this file (False for library code)."""
    if own_source:
        return rewrite(fn, *args, options=options, check_values=False)
    gm, inputs = dynamo_graph(fn, *args, with_inputs=True)
    before = graph_text(gm)
    p = SmxPass(SmxOptions.from_mapping(options))
    p(gm.graph)
    gm.recompile()
    return Rewrite(before, graph_text(gm), p.report, gm, inputs)


def topk_site(r: Rewrite):
    s = [s for s in r.report if s.kind == "softmax_topk"]
    assert len(s) == 1, str(r.report)
    return s[0]


def site_tuple(r: Rewrite):
    s = topk_site(r)
    return s.kind, s.action, s.op, s.detail


def site_repr(r: Rewrite) -> str:
    """The softmax_topk site as ``kind | action | op | detail``."""
    return " | ".join(site_tuple(r))


def assert_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and torch.equal(a, b), (a, b)


def _tuple(out):
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def _gold_args(args):
    return [a.detach().double().requires_grad_(a.requires_grad) if a.is_floating_point() else a for a in args]


def _tol(dtype: torch.dtype, gold: torch.Tensor, magnitude: float) -> torch.Tensor:
    eps = torch.finfo(dtype).eps
    return 4 * eps * gold.abs() + 8 * eps * magnitude


def assert_near_gold(ours: torch.Tensor, eager: torch.Tensor, gold: torch.Tensor, what: str = "",
                     grad: bool = False) -> None:
    """``|ours - gold| <= |eager - gold| + tol`` elementwise (NaN where eager is NaN).

    tol is a few ulps of the output dtype, relative to each value and (for gradients, which are sums over
    the row) to the largest magnitude of the tensor; probabilities are at most 1."""
    assert ours.dtype == eager.dtype and ours.shape == eager.shape, (what, ours.dtype, eager.dtype, ours.shape, eager.shape)
    g = gold.double()
    nan = eager.isnan()
    assert torch.equal(ours.isnan(), nan), (what, ours, eager)
    o, e, g = ours.double()[~nan], eager.double()[~nan], g[~nan]
    err, ref_err = (o - g).abs(), (e - g).abs()
    magnitude = float(g.abs().max()) if grad and g.numel() else (1e-2 if ours.dtype in (torch.float32, torch.float64) else 1.0)
    bad = err > ref_err + _tol(ours.dtype, g, magnitude)
    assert not bad.any(), f"{what}: ours {o[bad][:5]} eager {e[bad][:5]} gold {g[bad][:5]}"


def assert_matches_eager(r: Rewrite, fn, *args, gold_fn=None, grad_pairs=None, seed: int = 0) -> None:
    """Run the rewritten graph module on the example inputs and compare with ``fn`` (and an fp64 gold).

    ``gold_fn`` defaults to ``fn`` on fp64 copies of ``args``. Gradients of a weighted sum of the float
    outputs are compared w.r.t. ``grad_pairs``, ``[(leaf, its fp64 counterpart in gold_fn)]`` (default:
    the ``args`` that require grad)."""
    gold_args = _gold_args(args)
    torch.manual_seed(seed)
    want = _tuple(fn(*args))
    torch.manual_seed(seed)
    got = _tuple(r.gm(*r.inputs))
    torch.manual_seed(seed)
    gold = _tuple((gold_fn or fn)(*gold_args))
    assert len(got) == len(want) == len(gold)
    for n, (o, e, g) in enumerate(zip(got, want, gold)):
        if o.is_floating_point():
            assert_near_gold(o, e, g, f"output {n}")
        else:
            assert_equal(o, e)
    if grad_pairs is None:
        grad_pairs = [(a, ga) for a, ga in zip(args, gold_args) if a.requires_grad]
    if not grad_pairs or not any(o.is_floating_point() for o in got):
        return
    leaves, gold_leaves = zip(*grad_pairs)
    gen = torch.Generator().manual_seed(1)
    # random weights: a renormalized output sums to 1, a plain sum would have a zero gradient
    weights = [torch.randn(o.shape, generator=gen, dtype=torch.float64) for o in got if o.is_floating_point()]

    def loss(outs):
        return sum((o.double() * w).sum() for o, w in zip([o for o in outs if o.is_floating_point()], weights))

    g_ours = torch.autograd.grad(loss(got), leaves)
    g_eager = torch.autograd.grad(loss(want), leaves)
    g_gold = torch.autograd.grad(loss(gold), gold_leaves)
    for n, (o, e, g) in enumerate(zip(g_ours, g_eager, g_gold)):
        assert_near_gold(o, e, g, f"grad {n}", grad=True)


def logits(*shape, dtype=torch.float32, seed=0, scale=2.0, grad=False):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(*shape, generator=g) * scale).to(dtype)
    return x.requires_grad_(grad)


def compiled_report(fn, options=REWRITE, dynamic=False):
    """``torch.compile(fn, backend="smx")`` and a function that returns the report of its (first) graph."""
    torch._dynamo.reset()
    n0 = len(smxcompile.backends.smx.compiled_reports)
    f = torch.compile(fn, backend="smx", options=options, dynamic=dynamic)
    return f, lambda: smxcompile.backends.smx.compiled_reports[n0]


# --------------------------------------------------------------------------- the forms


def topk_of_softmax(x):
    v, i = torch.topk(torch.softmax(x, dim=-1), 3, dim=-1)
    return v, i


def renormalized(x):
    v, i = torch.softmax(x, -1).topk(4)
    return v / v.sum(-1, keepdim=True), i


def renormalized_in_place(x):
    v, i = torch.softmax(x, -1).topk(4)
    v /= v.sum(-1, keepdim=True)
    return v, i


class MixtralTopKRouter(nn.Module):
    """transformers' ``MixtralTopKRouter.forward``, with the scores cast back to the hidden dtype."""

    def __init__(self, hidden_dim=16, num_experts=8, top_k=2, dtype=torch.bfloat16, seed=0):
        super().__init__()
        self.top_k = top_k
        self.num_experts = num_experts
        self.hidden_dim = hidden_dim
        g = torch.Generator().manual_seed(seed)
        self.weight = nn.Parameter((torch.randn(num_experts, hidden_dim, generator=g) * 0.5).to(dtype))

    def forward(self, hidden_states):
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        router_logits = F.linear(hidden_states, self.weight)  # (seq_len, num_experts)
        router_probs = torch.nn.functional.softmax(router_logits.float(), dim=-1)
        router_top_value, router_indices = torch.topk(router_probs, self.top_k, dim=-1)  # (seq_len, top_k)
        router_top_value /= router_top_value.sum(dim=-1, keepdim=True)
        router_scores = router_top_value.to(hidden_states.dtype)
        return router_logits, router_scores, router_indices


def qwen2_moe_router(hidden_states, gate_weight):
    router_logits = F.linear(hidden_states, gate_weight)
    routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
    routing_weights, selected_experts = torch.topk(routing_weights, 4, dim=-1)
    routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
    routing_weights = routing_weights.to(hidden_states.dtype)
    return routing_weights, selected_experts


def sampler(logits):
    probs = torch.softmax(logits / 0.7, dim=-1)
    top = probs.topk(5)
    values, indices = top.values, top.indices
    values = values / values.sum(-1, keepdim=True)
    choice = torch.multinomial(values, 1)
    return torch.gather(indices, -1, choice)


def softmax_of_topk(x):
    t = torch.topk(x, 4, dim=-1)
    return torch.softmax(t.values, dim=-1), t.indices


def indices_only(x):
    return torch.topk(torch.softmax(x, -1), 3).indices


def argmax_of_softmax(x):
    return torch.argmax(torch.softmax(x, -1), -1)


def argmax_keepdim(x):
    return torch.softmax(x, dim=-1).argmax(dim=-1, keepdim=True)


def max_indices(x):
    return torch.softmax(x, -1).max(-1).indices


def over_dim_1(x):
    v, i = torch.topk(F.softmax(x, dim=1), 2, dim=1)
    return v, i


def bf16_upcast(x):
    v, i = torch.softmax(x.float(), dim=-1).topk(3)
    return v, i


def temperature_div(x):
    v, i = torch.softmax(x / 0.5, -1).topk(3)
    return v, i


def temperature_mul(x):
    v, i = torch.softmax(x * 1.5, -1).topk(3)
    return v, i


class TestForms(TestCase):
    def test_topk_of_softmax(self):
        x = logits(6, 64, grad=True)
        r = run_pass(topk_of_softmax, x)
        self.assertExpectedInline(r.before, """\
def forward(self, L_x_ : torch.Tensor):
l_x_ = L_x_
softmax = torch.softmax(l_x_, dim = -1)
topk = torch.topk(softmax, 3, dim = -1)
v = topk[0]
i = topk[1]
return (v, i)""")
        self.assertExpectedInline(r.after, """\
def forward(self, L_x_ : torch.Tensor):
l_x_ = L_x_
graph_softmax_topk = smxcompile_passes_softmax_topk_graph_softmax_topk(l_x_, 3, 1, 1.0, False, None)
getitem_2 = graph_softmax_topk[0]
getitem_3 = graph_softmax_topk[1]
return (getitem_2, getitem_3)""")
        self.assertExpectedInline(site_repr(r), """softmax_topk | rewritten | smx softmax_topk (CPU two-pass) | topk(softmax), dim=1, k=3""")
        assert_matches_eager(r, topk_of_softmax, x)

    def test_renormalized(self):
        x = logits(6, 64, grad=True)
        r = run_pass(renormalized, x)
        self.assertExpectedInline(r.after, """\
def forward(self, L_x_ : torch.Tensor):
l_x_ = L_x_
graph_softmax_topk = smxcompile_passes_softmax_topk_graph_softmax_topk(l_x_, 4, 1, 1.0, True, None)
getitem_2 = graph_softmax_topk[0]
getitem_3 = graph_softmax_topk[1]
return (getitem_2, getitem_3)""")
        self.assertExpectedInline(site_repr(r), """softmax_topk | rewritten | smx softmax_topk (CPU two-pass) | topk(softmax), dim=1, k=4, renormalized""")
        assert_matches_eager(r, renormalized, x)

    def test_renormalized_in_place(self):
        x = logits(6, 64, grad=True)
        r = run_pass(renormalized_in_place, x)
        self.assertExpectedInline(r.before, """\
def forward(self, L_x_ : torch.Tensor):
l_x_ = L_x_
softmax = torch.softmax(l_x_, -1)
topk = softmax.topk(4)
v = topk[0]
i = topk[1]
sum_1 = v.sum(-1, keepdim = True)
v /= sum_1
return (v_1, i)""")
        self.assertExpectedInline(r.after, """\
def forward(self, L_x_ : torch.Tensor):
l_x_ = L_x_
graph_softmax_topk = smxcompile_passes_softmax_topk_graph_softmax_topk(l_x_, 4, 1, 1.0, True, None)
getitem_2 = graph_softmax_topk[0]
getitem_3 = graph_softmax_topk[1]
return (getitem_2, getitem_3)""")
        self.assertExpectedInline(site_repr(r), """softmax_topk | rewritten | smx softmax_topk (CPU two-pass) | topk(softmax), dim=1, k=4, renormalized""")
        assert_matches_eager(r, renormalized_in_place, x)

    def test_mixtral_router(self):
        router = MixtralTopKRouter()
        h = logits(2, 5, 16, dtype=torch.bfloat16, scale=1.0)
        r = run_pass(router, h)
        self.assertExpectedInline(r.after, """\
def forward(self, L_hidden_states_ : torch.Tensor, L_self_parameters_weight_ : torch.nn.parameter.Parameter):
l_hidden_states_ = L_hidden_states_
l_self_parameters_weight_ = L_self_parameters_weight_
hidden_states = l_hidden_states_.reshape(-1, 16)
router_logits = torch._C._nn.linear(hidden_states, l_self_parameters_weight_)
graph_softmax_topk = smxcompile_passes_softmax_topk_graph_softmax_topk(router_logits, 2, 1, 1.0, True, torch.float32)
getitem_2 = graph_softmax_topk[0]
getitem_3 = graph_softmax_topk[1]
router_scores = getitem_2.to(torch.bfloat16)
return (router_logits, router_scores, getitem_3)""")
        self.assertExpectedInline(site_repr(r), """softmax_topk | rewritten | smx softmax_topk (CPU two-pass) | topk(softmax), dim=1, k=2, renormalized, cast bfloat16->float32""")
        gold = copy.deepcopy(router).double()
        assert_matches_eager(r, router, h, gold_fn=gold, grad_pairs=[(router.weight, gold.weight)])

    def test_transformers_mixtral_router_class(self):
        mixtral = pytest.importorskip("transformers.models.mixtral.modeling_mixtral")
        if not hasattr(mixtral, "MixtralTopKRouter"):
            pytest.skip("this transformers has no MixtralTopKRouter")
        from transformers import MixtralConfig

        cfg = MixtralConfig(hidden_size=16, num_local_experts=8, num_experts_per_tok=2)
        router = mixtral.MixtralTopKRouter(cfg)
        with torch.no_grad():
            router.weight.copy_(logits(8, 16, scale=0.5, seed=3))
        h = logits(2, 5, 16, scale=1.0)
        r = run_pass(router, h, own_source=False)
        self.assertEqual(site_tuple(r), ("softmax_topk", "rewritten", "smx softmax_topk (CPU two-pass)",
                                         "topk(softmax), dim=1, k=2, renormalized"))
        assert "graph_softmax_topk" in r.after and "softmax(" not in r.after, r.after
        gold = copy.deepcopy(router).double()
        assert_matches_eager(r, router, h, gold_fn=gold, grad_pairs=[(router.weight, gold.weight)])
        # the default CPU policy rewrites 8-expert routers too (measured faster)
        self.assertEqual(topk_site(run_pass(router, h, options={}, own_source=False)).action, "rewritten")

    def test_qwen2_moe_router_softmax_dtype_float(self):
        h = logits(7, 16, dtype=torch.bfloat16, scale=1.0)
        w = logits(40, 16, dtype=torch.bfloat16, scale=0.5, seed=1, grad=True)
        r = run_pass(qwen2_moe_router, h, w)
        self.assertExpectedInline(r.after, """\
def forward(self, L_hidden_states_ : torch.Tensor, L_gate_weight_ : torch.Tensor):
l_hidden_states_ = L_hidden_states_
l_gate_weight_ = L_gate_weight_
router_logits = torch._C._nn.linear(l_hidden_states_, l_gate_weight_)
graph_softmax_topk = smxcompile_passes_softmax_topk_graph_softmax_topk(router_logits, 4, 1, 1.0, True, torch.float32)
getitem_2 = graph_softmax_topk[0]
getitem_3 = graph_softmax_topk[1]
routing_weights_3 = getitem_2.to(torch.bfloat16)
return (routing_weights_3, getitem_3)""")
        self.assertExpectedInline(site_repr(r), """softmax_topk | rewritten | smx softmax_topk (CPU two-pass) | topk(softmax), dim=1, k=4, renormalized""")
        assert_matches_eager(r, qwen2_moe_router, h, w)

    def test_sampler_multinomial_stays(self):
        x = logits(8, 100)
        r = run_pass(sampler, x)
        self.assertExpectedInline(r.after, """\
def forward(self, L_logits_ : torch.Tensor):
l_logits_ = L_logits_
graph_softmax_topk = smxcompile_passes_softmax_topk_graph_softmax_topk(l_logits_, 5, 1, 1.4285714285714286, True, None)
getitem_2 = graph_softmax_topk[0]
getitem_3 = graph_softmax_topk[1]
choice = torch.multinomial(getitem_2, 1)
gather = torch.gather(getitem_3, -1, choice)
return (gather,)""")
        self.assertExpectedInline(site_repr(r), """softmax_topk | rewritten | smx softmax_topk (CPU two-pass) | topk(softmax), dim=1, k=5, renormalized, scale=1.42857""")
        # the same seed draws the same sample as eager
        for seed in range(3):
            assert_matches_eager(r, sampler, x, seed=seed)

    def test_softmax_of_topk_values(self):
        x = logits(6, 64, grad=True)
        r = run_pass(softmax_of_topk, x)
        self.assertExpectedInline(r.before, """\
def forward(self, L_x_ : torch.Tensor):
l_x_ = L_x_
topk = torch.topk(l_x_, 4, dim = -1)
getitem = topk[0]
getitem_1 = topk[1]
softmax = torch.softmax(getitem, dim = -1)
return (softmax, getitem_1)""")
        self.assertExpectedInline(r.after, """\
def forward(self, L_x_ : torch.Tensor):
l_x_ = L_x_
graph_softmax_topk = smxcompile_passes_softmax_topk_graph_softmax_topk(l_x_, 4, 1, 1.0, True, None)
getitem_2 = graph_softmax_topk[0]
getitem_3 = graph_softmax_topk[1]
return (getitem_2, getitem_3)""")
        self.assertExpectedInline(site_repr(r), """softmax_topk | rewritten | smx softmax_topk (CPU two-pass) | softmax(topk), dim=1, k=4""")
        assert_matches_eager(r, softmax_of_topk, x)

    def test_indices_only_deletes_the_softmax(self):
        x = logits(6, 64)
        r = run_pass(indices_only, x)
        self.assertExpectedInline(r.after, """\
def forward(self, L_x_ : torch.Tensor):
l_x_ = L_x_
topk = torch.topk(l_x_, 3)
getitem_1 = topk[1]
return (getitem_1,)""")
        self.assertExpectedInline(site_repr(r), """softmax_topk | rewritten | softmax deleted | topk(softmax).indices, dim=1, k=3""")
        assert_matches_eager(r, indices_only, x)

    def test_argmax_deletes_the_softmax(self):
        x = logits(6, 64)
        r = run_pass(argmax_of_softmax, x)
        self.assertExpectedInline(r.after, """\
def forward(self, L_x_ : torch.Tensor):
l_x_ = L_x_
graph_argmax = smxcompile_passes_softmax_topk_graph_argmax(l_x_, 1, False, None)
return (graph_argmax,)""")
        self.assertExpectedInline(site_repr(r), """softmax_topk | rewritten | smx top-1 (probabilities never written) | argmax(softmax), dim=1""")
        assert_matches_eager(r, argmax_of_softmax, x)

    def test_argmax_keepdim(self):
        x = logits(6, 64)
        r = run_pass(argmax_keepdim, x)
        self.assertExpectedInline(r.after, """\
def forward(self, L_x_ : torch.Tensor):
l_x_ = L_x_
graph_argmax = smxcompile_passes_softmax_topk_graph_argmax(l_x_, 1, True, None)
return (graph_argmax,)""")
        self.assertExpectedInline(site_repr(r), """softmax_topk | rewritten | smx top-1 (probabilities never written) | argmax(softmax), dim=1""")
        assert_matches_eager(r, argmax_keepdim, x)

    def test_max_indices(self):
        x = logits(6, 64)
        r = run_pass(max_indices, x)
        self.assertExpectedInline(r.before, """\
def forward(self, L_x_ : torch.Tensor):
l_x_ = L_x_
softmax = torch.softmax(l_x_, -1)
max_1 = softmax.max(-1)
getitem_1 = max_1[1]
return (getitem_1,)""")
        self.assertExpectedInline(r.after, """\
def forward(self, L_x_ : torch.Tensor):
l_x_ = L_x_
graph_argmax = smxcompile_passes_softmax_topk_graph_argmax(l_x_, 1, False, None)
return (graph_argmax,)""")
        self.assertExpectedInline(site_repr(r), """softmax_topk | rewritten | smx top-1 (probabilities never written) | argmax(softmax), dim=1""")
        assert_matches_eager(r, max_indices, x)

    def test_argmax_special_rows_give_index_0_like_eager(self):
        x = logits(6, 64)
        x[0, 5] = float("nan")
        x[1, 9] = float("inf")
        x[2] = float("-inf")
        x[3, :60] = float("-inf")      # finite entries only at the end
        x[4, 7] = float("-inf")
        for fn in (argmax_of_softmax, argmax_keepdim, max_indices):
            r = run_pass(fn, x)
            self.assertEqual(topk_site(r).action, "rewritten")
            got, want = r.gm(*r.inputs)[0], fn(x)
            self.assertEqual(got.flatten()[:3].tolist(), [0, 0, 0])
            assert_equal(got, want)

    def test_dim_1_of_a_3d_tensor(self):
        x = logits(3, 40, 5, grad=True)
        r = run_pass(over_dim_1, x)
        self.assertExpectedInline(r.after, """\
def forward(self, L_x_ : torch.Tensor):
l_x_ = L_x_
graph_softmax_topk = smxcompile_passes_softmax_topk_graph_softmax_topk(l_x_, 2, 1, 1.0, False, None)
getitem_2 = graph_softmax_topk[0]
getitem_3 = graph_softmax_topk[1]
return (getitem_2, getitem_3)""")
        self.assertExpectedInline(site_repr(r), """softmax_topk | rewritten | smx softmax_topk (CPU two-pass) | topk(softmax), dim=1, k=2""")
        assert_matches_eager(r, over_dim_1, x)

    def test_bf16_logits_float_upcast(self):
        x = logits(6, 64, dtype=torch.bfloat16, grad=True)
        r = run_pass(bf16_upcast, x)
        self.assertExpectedInline(r.after, """\
def forward(self, L_x_ : torch.Tensor):
l_x_ = L_x_
graph_softmax_topk = smxcompile_passes_softmax_topk_graph_softmax_topk(l_x_, 3, 1, 1.0, False, torch.float32)
getitem_2 = graph_softmax_topk[0]
getitem_3 = graph_softmax_topk[1]
return (getitem_2, getitem_3)""")
        self.assertExpectedInline(site_repr(r), """softmax_topk | rewritten | smx softmax_topk (CPU two-pass) | topk(softmax), dim=1, k=3, cast bfloat16->float32""")
        assert_matches_eager(r, bf16_upcast, x)

    def test_temperature_divide(self):
        x = logits(6, 64, grad=True)
        r = run_pass(temperature_div, x)
        self.assertExpectedInline(r.after, """\
def forward(self, L_x_ : torch.Tensor):
l_x_ = L_x_
graph_softmax_topk = smxcompile_passes_softmax_topk_graph_softmax_topk(l_x_, 3, 1, 2.0, False, None)
getitem_2 = graph_softmax_topk[0]
getitem_3 = graph_softmax_topk[1]
return (getitem_2, getitem_3)""")
        self.assertExpectedInline(site_repr(r), """softmax_topk | rewritten | smx softmax_topk (CPU two-pass) | topk(softmax), dim=1, k=3, scale=2""")
        assert_matches_eager(r, temperature_div, x)

    def test_temperature_multiply(self):
        x = logits(6, 64, grad=True)
        r = run_pass(temperature_mul, x)
        self.assertExpectedInline(r.after, """\
def forward(self, L_x_ : torch.Tensor):
l_x_ = L_x_
graph_softmax_topk = smxcompile_passes_softmax_topk_graph_softmax_topk(l_x_, 3, 1, 1.5, False, None)
getitem_2 = graph_softmax_topk[0]
getitem_3 = graph_softmax_topk[1]
return (getitem_2, getitem_3)""")
        self.assertExpectedInline(site_repr(r), """softmax_topk | rewritten | smx softmax_topk (CPU two-pass) | topk(softmax), dim=1, k=3, scale=1.5""")
        assert_matches_eager(r, temperature_mul, x)

    def test_scale_before_the_upcast_keeps_its_rounding(self):
        # eager divides in bf16, then computes in fp32: the division stays in the graph (as the softmax pass)
        def fn(x):
            v, i = torch.softmax((x / 0.7).float(), -1).topk(3)
            return v, i

        x = logits(6, 64, dtype=torch.bfloat16, grad=True)
        r = run_pass(fn, x)
        self.assertExpectedInline(r.after, """\
def forward(self, L_x_ : torch.Tensor):
l_x_ = L_x_
truediv = l_x_ / 0.7
graph_softmax_topk = smxcompile_passes_softmax_topk_graph_softmax_topk(truediv, 3, 1, 1.0, False, torch.float32)
getitem_2 = graph_softmax_topk[0]
getitem_3 = graph_softmax_topk[1]
return (getitem_2, getitem_3)""")
        self.assertExpectedInline(site_repr(r), """softmax_topk | rewritten | smx softmax_topk (CPU two-pass) | topk(softmax), dim=1, k=3, cast bfloat16->float32""")
        assert_matches_eager(r, fn, x)
        torch.testing.assert_close(r.gm(*r.inputs)[0], fn(x)[0], atol=1e-6, rtol=1e-5)

    def test_fp64_upcast_keeps_fp64_math(self):
        # softmax(x.double()) computes in fp64 in eager: the rewrite must not round to fp32
        def fn(x):
            v, i = torch.softmax(x.double(), -1).topk(3)
            return v, i

        x = logits(6, 64, grad=True)
        r = run_pass(fn, x)
        self.assertExpectedInline(r.after, """\
def forward(self, L_x_ : torch.Tensor):
l_x_ = L_x_
double = l_x_.double()
graph_softmax_topk = smxcompile_passes_softmax_topk_graph_softmax_topk(double, 3, 1, 1.0, False, None)
getitem_2 = graph_softmax_topk[0]
getitem_3 = graph_softmax_topk[1]
return (getitem_2, getitem_3)""")
        self.assertExpectedInline(site_repr(r), """softmax_topk | rewritten | smx softmax_topk (CPU two-pass) | topk(softmax), dim=1, k=3""")
        want, got = fn(x), r.gm(*r.inputs)
        torch.testing.assert_close(got[0], want[0], atol=1e-12, rtol=1e-12)
        assert_equal(got[1], want[1])


# --------------------------------------------------------------------------- near-misses


def softmax_also_returned(x):
    p = torch.softmax(x, -1)
    v, i = p.topk(3)
    return p, v, i


def smallest(x):
    v, i = torch.softmax(x, -1).topk(3, largest=False)
    return v, i


def topk_other_dim(x):
    v, i = torch.softmax(x, -1).topk(2, dim=1)
    return v, i


def argmax_without_dim(x):
    return torch.argmax(torch.softmax(x, -1))


def narrowing_dtype(x):
    v, i = torch.softmax(x, -1, dtype=torch.float16).topk(3)
    return v, i


def raw_values_used(x):
    t = torch.topk(x, 4)
    return torch.softmax(t.values, -1), t.indices, t.values * 2


def gumbel_topk(logits):
    noisy = logits - torch.log(-torch.log(torch.rand_like(logits)))
    v, i = torch.softmax(noisy, -1).topk(3)
    return v, i


def negative_temperature(x):
    v, i = torch.softmax(x / -2.0, -1).topk(3)
    return v, i


class TestNearMisses(TestCase):
    def assertNotRewrittenHere(self, r: Rewrite):
        assert "graph_softmax_topk" not in r.after and "graph_argmax" not in r.after, r.after

    def skipped(self, r: Rewrite) -> str:
        s = topk_site(r)
        self.assertEqual((s.kind, s.action, s.op), ("softmax_topk", "skipped", ""))
        return s.reason

    def test_softmax_also_returned_is_left_to_the_softmax_pass(self):
        x = logits(6, 64, grad=True)
        r = run_pass(softmax_also_returned, x)
        self.assertNotRewrittenHere(r)
        self.assertExpectedInline(r.after, """\
def forward(self, L_x_ : torch.Tensor):
l_x_ = L_x_
softmax_default = torch.ops.smx.softmax.default(l_x_, 1, 1.0, None, None, None, False)
getitem_2 = softmax_default[0]
topk = getitem_2.topk(3)
v = topk[0]
i = topk[1]
return (getitem_2, v, i)""")
        self.assertEqual(self.skipped(r), "the softmax output is also used elsewhere: it is computed anyway")
        self.assertEqual([(s.kind, s.action) for s in r.report], [("softmax_topk", "skipped"), ("softmax", "rewritten")])
        assert_matches_eager(r, softmax_also_returned, x)

    def test_largest_false(self):
        x = logits(6, 64)
        r = run_pass(smallest, x)
        self.assertNotRewrittenHere(r)
        self.assertExpectedInline(r.after, """\
def forward(self, L_x_ : torch.Tensor):
l_x_ = L_x_
softmax_default = torch.ops.smx.softmax.default(l_x_, 1, 1.0, None, None, None, False)
getitem_2 = softmax_default[0]
topk = getitem_2.topk(3, largest = False)
v = topk[0]
i = topk[1]
return (v, i)""")
        self.assertEqual(self.skipped(r), "largest=False (the smallest probabilities) is not fused")
        self.assertEqual(topk_site(r).detail, "topk(softmax), dim=1, k=3")
        assert_matches_eager(r, smallest, x)

    def test_topk_over_another_dim(self):
        x = logits(2, 5, 40)
        r = run_pass(topk_other_dim, x)
        self.assertNotRewrittenHere(r)
        self.assertExpectedInline(r.after, """\
def forward(self, L_x_ : torch.Tensor):
l_x_ = L_x_
softmax_default = torch.ops.smx.softmax.default(l_x_, 2, 1.0, None, None, None, False)
getitem_2 = softmax_default[0]
topk = getitem_2.topk(2, dim = 1)
v = topk[0]
i = topk[1]
return (v, i)""")
        self.assertEqual(self.skipped(r), "top-k over dim 1, softmax over dim 2: not the same row")
        self.assertEqual(topk_site(r).detail, "topk(softmax), dim=2, k=2")
        assert_matches_eager(r, topk_other_dim, x)

    def test_argmax_without_dim(self):
        x = logits(6, 64)
        r = run_pass(argmax_without_dim, x)
        self.assertNotRewrittenHere(r)
        self.assertExpectedInline(r.after, """\
def forward(self, L_x_ : torch.Tensor):
l_x_ = L_x_
softmax_default = torch.ops.smx.softmax.default(l_x_, 1, 1.0, None, None, None, False)
getitem = softmax_default[0]
argmax = torch.argmax(getitem)
return (argmax,)""")
        self.assertIn("argmax without dim", self.skipped(r))
        assert_matches_eager(r, argmax_without_dim, x)

    def test_narrowing_softmax_dtype(self):
        x = logits(6, 64)
        r = run_pass(narrowing_dtype, x)
        self.assertNotRewrittenHere(r)
        self.assertExpectedInline(r.after, """\
def forward(self, L_x_ : torch.Tensor):
l_x_ = L_x_
to = l_x_.to(torch.float16)
softmax_default = torch.ops.smx.softmax.default(to, 1, 1.0, None, None, torch.float16, False)
getitem_2 = softmax_default[0]
topk = getitem_2.topk(3)
v = topk[0]
i = topk[1]
return (v, i)""")
        self.assertEqual(self.skipped(r), "softmax dtype=float16 casts its input first (rounding it to a narrower dtype, or fp64 math)")
        assert_matches_eager(r, narrowing_dtype, x)

    def test_raw_topk_values_used_besides_the_softmax(self):
        x = logits(6, 64, grad=True)
        r = run_pass(raw_values_used, x)
        self.assertNotRewrittenHere(r)
        self.assertExpectedInline(r.after, """\
def forward(self, L_x_ : torch.Tensor):
l_x_ = L_x_
topk = torch.topk(l_x_, 4)
getitem = topk[0]
getitem_1 = topk[1]
softmax_default = torch.ops.smx.softmax.default(getitem, 1, 1.0, None, None, None, False)
getitem_2 = softmax_default[0]
mul = getitem * 2
return (getitem_2, getitem_1, mul)""")
        self.assertEqual(self.skipped(r), "the raw top-k values are also used besides the softmax")
        assert_matches_eager(r, raw_values_used, x)

    def test_gumbel_noise(self):
        x = logits(6, 64)
        r = run_pass(gumbel_topk, x)
        self.assertFalse(r.changed)
        self.assertIn("random noise (Gumbel-softmax)", self.skipped(r))
        self.assertEqual(r.report.count(kind="softmax", action="rewritten"), 0)
        assert_matches_eager(r, gumbel_topk, x)

    def test_negative_temperature_is_not_absorbed(self):
        x = logits(6, 64, grad=True)
        r = run_pass(negative_temperature, x)
        self.assertExpectedInline(r.after, """\
def forward(self, L_x_ : torch.Tensor):
l_x_ = L_x_
truediv = l_x_ / -2.0
graph_softmax_topk = smxcompile_passes_softmax_topk_graph_softmax_topk(truediv, 3, 1, 1.0, False, None)
getitem_2 = graph_softmax_topk[0]
getitem_3 = graph_softmax_topk[1]
return (getitem_2, getitem_3)""")
        self.assertExpectedInline(site_repr(r), """softmax_topk | rewritten | smx softmax_topk (CPU two-pass) | topk(softmax), dim=1, k=3""")
        assert_matches_eager(r, negative_temperature, x)


# --------------------------------------------------------------------------- CPU policy and options


def top2(x):
    v, i = torch.softmax(x, -1).topk(2)
    return v, i


class TestPolicy(TestCase):
    def test_default_rewrites_short_rows(self):
        # 8 experts, top-2 (Mixtral): the compare-exchange network beats ATen's per-row top-k
        x = logits(4, 8)
        r = run_pass(top2, x, options={})
        self.assertEqual(topk_site(r).action, "rewritten")
        assert_matches_eager(r, top2, x)

    def test_dynamic_rows_are_kept_whole(self):
        f, report = compiled_report(top2, {}, dynamic=True)
        x = logits(4, 40)
        (v, i), (tv, ti) = f(x), top2(x)
        torch.testing.assert_close(v, tv)
        assert torch.equal(i, ti)
        sites = list(report())
        self.assertEqual([(s.kind, s.action) for s in sites], [("softmax_topk", "kept")])
        self.assertIn("symbolic", sites[0].reason)

    def test_default_rewrites_long_rows(self):
        x = logits(4, 64)
        r = run_pass(top2, x, options={})
        self.assertEqual(topk_site(r).action, "rewritten")
        assert_matches_eager(r, top2, x)

    def test_default_rewrites_argmax_and_indices_on_short_rows(self):
        x = logits(4, 8)
        for fn in (argmax_of_softmax, indices_only, max_indices):
            r = run_pass(fn, x, options={})
            self.assertEqual(topk_site(r).action, "rewritten")
            self.assertIn(topk_site(r).op, ("softmax deleted", "smx top-1 (probabilities never written)"))
            assert_matches_eager(r, fn, x)

    def test_half_top1_reads_kept_from_the_policy_threshold(self):
        """fp16 / bf16 top-1 reads of 16+ columns measured as fast under Inductor: kept, with the reason."""
        from smxcompile.passes.policy import cpu_threshold

        def router(x):
            p = torch.softmax(x, -1)
            return p.max(-1).values, p.argmax(-1)

        n = cpu_threshold("softmax_topk_top1_half_max_columns")
        for dtype in (torch.bfloat16, torch.float16):
            self.assertEqual(topk_site(run_pass(router, logits(4, 8, dtype=dtype), options={})).action, "rewritten")
            s = topk_site(run_pass(router, logits(4, n, dtype=dtype), options={}))
            self.assertEqual(s.action, "kept")
            self.assertIn(f"top-1 read of {n} fp16 / bf16 probabilities", s.reason)
            # the indices alone need no probabilities at all: rewritten whatever the length
            self.assertEqual(topk_site(run_pass(argmax_of_softmax, logits(4, n, dtype=dtype), options={})).action,
                             "rewritten")
        self.assertEqual(topk_site(run_pass(router, logits(4, n), options={})).action, "rewritten")

    def test_disabled_by_option(self):
        for fn in (top2, argmax_of_softmax):
            r = run_pass(fn, logits(4, 64), options={"cpu": "rewrite", "softmax_topk": False})
            s = topk_site(r)
            self.assertEqual((s.action, s.reason), ("kept", "rewrite kind 'softmax_topk' disabled by options"))
            # the softmax is then the softmax pass's, as if the fused rewrite did not exist
            self.assertEqual([(x.kind, x.action) for x in r.report if x.kind == "softmax"], [("softmax", "rewritten")])
            assert_matches_eager(r, fn, logits(4, 64))

    def test_cpu_keep(self):
        r = run_pass(top2, logits(4, 64), options={"cpu": "keep"})
        self.assertFalse(r.changed)
        self.assertEqual(topk_site(r).reason, "options cpu='keep'")

    def test_check_option_still_rewrites(self):
        x = logits(6, 64)
        f, report = compiled_report(renormalized_in_place, {"cpu": "rewrite", "check": True})
        got, want = f(x.clone()), renormalized_in_place(x.clone())
        self.assertEqual([(s.kind, s.action) for s in report()], [("softmax_topk", "rewritten")])
        torch.testing.assert_close(got, want)
        for fn in (argmax_keepdim, max_indices, indices_only):
            f, report = compiled_report(fn, {"cpu": "rewrite", "check": True})
            assert_equal(f(x), fn(x))
            self.assertEqual([(s.kind, s.action) for s in report()], [("softmax_topk", "rewritten")])

    def test_check_option_rejects_a_wrong_rewrite(self):
        import smxcompile.passes.softmax_topk as P

        real = P.graph_softmax_topk

        def wrong(x, k, dim, scale, renormalize, dtype):
            v, i = real(x, k, dim, scale, renormalize, dtype)
            return v * 1.01, i

        x = logits(6, 64)
        with mock.patch.object(P, "graph_softmax_topk", wrong):
            f, report = compiled_report(topk_of_softmax, {"cpu": "rewrite", "check": True})
            got = f(x)
        s = report().filter(kind="softmax_topk")[0]
        self.assertEqual(s.action, "kept")
        self.assertIn("check failed", s.reason)
        torch.testing.assert_close(got, topk_of_softmax(x))


# --------------------------------------------------------------------------- special values (compiled)


def _assert_valid_indices(idx: torch.Tensor, n: int):
    assert ((idx >= 0) & (idx < n)).all(), idx
    s = idx.sort(-1).values
    assert (s[..., 1:] != s[..., :-1]).all(), f"repeated index: {idx}"


def topk5(x):
    v, i = torch.softmax(x, -1).topk(5)
    return v, i


def topk5_renorm(x):
    v, i = torch.softmax(x, -1).topk(5)
    v /= v.sum(-1, keepdim=True)
    return v, i


class TestSpecialValuesCompiled(TestCase):
    def test_inf_nan_rows(self):
        x = logits(6, 40)
        x[0, 3:] = float("-inf")          # 3 finite entries, k = 5
        x[1] = float("-inf")              # all -inf
        x[2, 7] = float("nan")
        x[3, 11] = float("inf")
        x[4, ::2] = float("-inf")         # some -inf, more than k finite
        for fn in (topk5, topk5_renorm):
            f, report = compiled_report(fn)
            v, i = f(x)
            self.assertEqual(report().count(kind="softmax_topk", action="rewritten"), 1)
            ve, ie = fn(x)
            torch.testing.assert_close(v, ve, equal_nan=True)
            self.assertEqual(v[0, 3:].tolist(), [0.0, 0.0])
            self.assertTrue(v[1:4].isnan().all())
            assert_equal(i[0, :3], ie[0, :3])
            self.assertTrue(torch.isinf(x[0].gather(0, i[0, 3:])).all())
            assert_equal(i[4:], ie[4:])
            _assert_valid_indices(i, 40)

    def test_argmax_special_rows_compiled(self):
        x = logits(5, 64)
        x[0, 5] = float("nan")
        x[1, 9] = float("inf")
        x[2] = float("-inf")
        x[3, :60] = float("-inf")
        f, report = compiled_report(argmax_of_softmax)
        got = f(x)
        self.assertEqual(report().count(kind="softmax_topk", action="rewritten"), 1)
        assert_equal(got, argmax_of_softmax(x))
        self.assertEqual(got[:3].tolist(), [0, 0, 0])

    def test_k_equals_row_length(self):
        for n in (8, 40):       # key rounds (k == n == 8) and a plain top-k (k == n == 40)
            def fn(x):
                v, i = torch.softmax(x, -1).topk(n)
                return v, i

            x = logits(3, n)
            f, report = compiled_report(fn)
            v, i = f(x)
            self.assertEqual(report().count(kind="softmax_topk", action="rewritten"), 1)
            ve, ie = fn(x)
            torch.testing.assert_close(v, ve)
            assert_equal(i, ie)

    def test_empty_batch(self):
        f, report = compiled_report(topk5_renorm)
        v, i = f(torch.randn(0, 40))
        self.assertEqual(report().count(kind="softmax_topk", action="rewritten"), 1)
        self.assertEqual((v.shape, i.shape, v.dtype, i.dtype), ((0, 5), (0, 5), torch.float32, torch.int64))


# --------------------------------------------------------------------------- the decomposition's strategies


def _strategy(n: int, k: int, dtype=torch.float32) -> str:
    """Which selection strategy softmax_topk_decomposed takes for rows of ``n`` (observed, not recomputed)."""
    x = torch.randn(2, n, dtype=dtype)
    with mock.patch.object(K, "_sortable_keys", wraps=K._sortable_keys) as keys, \
            mock.patch.object(torch, "topk", wraps=torch.topk) as topk:
        K.softmax_topk_decomposed(x, k)
    if keys.called:
        return "key rounds"
    if topk.call_count == 0:
        return "max"
    return "chunked" if topk.call_count == 2 else "topk"


def _sorted_selected(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return x.gather(-1, idx).sort(-1, descending=True).values


STRATEGY_CASES = {
    # name: (n, k, integer-valued data (ties))
    "max_k1": (64, 1, False),
    "key_rounds_ties": (200, 8, True),
    "chunked_ragged_ties": (4096 + 37, 4, True),
    "chunked": (8192, 8, False),
    "plain_topk": (2000, 50, False),
}


@pytest.mark.parametrize("name", list(STRATEGY_CASES))
def test_selection_strategy_compiled(name):
    n, k, ties = STRATEGY_CASES[name]
    expected = {"max": "max", "key": "key rounds", "chunked": "chunked", "plain": "topk"}[name.split("_")[0]]
    assert _strategy(n, k) == expected

    def fn(x):
        v, i = torch.softmax(x, -1).topk(k)
        return v, i

    g = torch.Generator().manual_seed(n + k)
    if ties:
        x = torch.randint(-40, 8, (5, n), generator=g).float()
    else:
        x = torch.randn(5, n, generator=g) * 3
    x.requires_grad_(True)
    f, report = compiled_report(fn)
    v, i = f(x)
    assert report().count(kind="softmax_topk", action="rewritten") == 1, str(report())
    ve, ie = fn(x)
    xd = x.detach().double().requires_grad_(True)
    gold_v, _ = fn(xd)
    assert_near_gold(v, ve, gold_v, name)
    w = torch.randn(v.shape, generator=g, dtype=torch.float64)
    grads = [torch.autograd.grad((out.double() * w).sum(), leaf)[0] for out, leaf in ((v, x), (ve, x), (gold_v, xd))]
    if not ties:      # with ties eager and ours may select different (equal) logits: other gradients
        assert_near_gold(*grads, f"{name} grad", grad=True)
    x = x.detach()
    # the selected logits are torch.topk's (as a multiset); without ties the same columns
    torch.testing.assert_close(_sorted_selected(x, i), torch.topk(x, k).values, atol=0, rtol=0)
    _assert_valid_indices(i, n)
    if not ties:
        assert torch.equal(i, ie)
    if expected == "key rounds":
        # exact ties: the lowest column first
        want = torch.sort(x, dim=-1, descending=True, stable=True).indices[:, :k]
        assert torch.equal(i, want)


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    rows=st.integers(0, 4),
    n=st.sampled_from([1, 2, 3, 8, 31, 64, 129, 1024, 1025, 4096 + 100]),
    k_frac=st.floats(0.0, 1.0),
    small_k=st.booleans(),
    ties=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float64]),
    renormalize=st.booleans(),
    scale=st.sampled_from([1.0, 0.5, 2.5]),
    lead=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_decomposed_matches_reference(rows, n, k_frac, small_k, ties, dtype, renormalize, scale, lead, seed):
    k = min(n, 1 + int(k_frac * 8)) if small_k else int(round(k_frac * n))
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-6, 6, (rows, n), generator=g).float() if ties else torch.randn(rows, n, generator=g) * 3
    x = x.to(dtype)
    dim = -1
    if lead:                       # the row along dim 0 of a (n, rows) tensor
        x, dim = x.t().contiguous(), 0
    v, i, _ = K.softmax_topk_decomposed(x, k, dim, scale, renormalize)
    rv, ri = K.softmax_topk_reference(x, k, dim, scale, renormalize)
    assert v.shape == rv.shape and i.shape == ri.shape and v.dtype == rv.dtype
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-6
    torch.testing.assert_close(v, rv, atol=tol, rtol=tol)
    xl, il = x.movedim(dim, -1), i.movedim(dim, -1)
    if k and xl.numel():
        _assert_valid_indices(il, n)
    torch.testing.assert_close(_sorted_selected(xl, il), torch.topk(xl, k, -1).values, atol=0, rtol=0)


# --------------------------------------------------------------------------- training


def test_router_training_gradients_match_eager():
    router = MixtralTopKRouter(hidden_dim=32, num_experts=64, top_k=4, dtype=torch.float32, seed=2)
    ref = copy.deepcopy(router)
    h = logits(3, 7, 32, scale=1.0, seed=5)
    target = logits(21, 4, seed=6)

    def step(mod):
        _, scores, idx = mod(h)
        return ((scores - target) ** 2).sum() + scores[:, 0].sum()

    f, report = compiled_report(lambda: step(router))
    loss = f()
    assert report().count(kind="softmax_topk", action="rewritten") == 1, str(report())
    loss.backward()
    ref_loss = step(ref)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(router.weight.grad, ref.weight.grad, atol=1e-5, rtol=1e-4)
