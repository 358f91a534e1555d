"""The shared sub-patterns (smxcompile.passes.patterns) and the policy table, on their own: every pass uses the
same rule, so one near-miss here is a near-miss for all of them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import smxcompile  # noqa: F401  (registers the smx:: ops)
from smxcompile.passes.patterns.arith import scalar_factor, softcap
from smxcompile.passes.patterns.casts import widening_cast
from smxcompile.passes.patterns.constants import ConstEvaluator, is_causal_keep
from smxcompile.passes.policy import CPU_RULES
from pass_helpers import dynamo_graph, rewrite

REPO = Path(__file__).resolve().parents[2]


def _last_call(fn, *args):
    """The node computing ``fn``'s output in its Dynamo graph."""
    gm = dynamo_graph(fn, *args)
    out = next(n for n in gm.graph.nodes if n.op == "output")
    return out.args[0][0]


@pytest.mark.parametrize("src,dst,absorbed", [
    (torch.float16, torch.float32, True),
    (torch.bfloat16, torch.float32, True),
    (torch.float32, torch.float32, True),     # a no-op cast
    (torch.bfloat16, torch.float16, False),   # ranges differ: the cast rounds (overflows)
    (torch.float16, torch.bfloat16, False),   # fewer mantissa bits: the cast rounds
    (torch.float32, torch.float16, False),
    (torch.float32, torch.float64, False),    # asks for fp64 math, which the op would do in fp32
])
def test_widening_cast_is_exact_only(src, dst, absorbed):
    node = _last_call(lambda x: x.to(dst), torch.randn(4).to(src))
    assert (widening_cast(node) is not None) == absorbed


def test_softmax_of_an_fp64_upcast_keeps_fp64_math():
    x = torch.randn(3, 50) * 20
    r = rewrite(lambda t: torch.softmax(t.double(), -1), x, atol=1e-15, rtol=1e-13)
    assert "double" in r.after or "float64" in r.after
    assert "cast" not in r.site.detail, r.site.detail


@pytest.mark.parametrize("fn,cap", [
    (lambda x: 30.0 * torch.tanh(x / 30.0), 30.0),
    (lambda x: torch.tanh(x * (1 / 50.0)) * 50.0, 50.0),
    (lambda x: 30.0 * torch.tanh(x / 29.0), None),     # not the same constant
    (lambda x: -30.0 * torch.tanh(x / -30.0), None),   # a negative cap is not a soft-cap
])
def test_one_softcap_rule(fn, cap):
    m = softcap(_last_call(fn, torch.randn(4)))
    assert (m[1] if m else None) == cap


def test_scalar_factor_spellings():
    assert scalar_factor(_last_call(lambda x: x / 4.0, torch.randn(4)))[1] == 0.25
    assert scalar_factor(_last_call(lambda x: 2.0 * x, torch.randn(4)))[1] == 2.0
    assert scalar_factor(_last_call(lambda x: x / 0.0, torch.randn(4))) is None


def test_causal_mask_from_aranges_is_recognised_by_a_fresh_evaluator():
    def causal(x):
        i = torch.arange(6)
        return x.masked_fill(i[None, :] > i[:, None], float("-inf"))

    gm = dynamo_graph(causal, torch.randn(6, 6))
    fill = next(n for n in gm.graph.nodes if n.op == "call_method" and n.target == "masked_fill")
    consts = ConstEvaluator()
    masked = consts.value(fill.args[1])
    assert is_causal_keep(~masked, 6, 6)
    assert ConstEvaluator().known(fill.args[1]) is None   # nothing shared between analyses


def test_every_cpu_rule_names_the_benchmark_that_set_it():
    for name, rule in CPU_RULES.items():
        scripts = [w for w in rule.benchmark.split() if w.startswith("benchmarks/") and w.endswith(".py")]
        assert scripts and all((REPO / s).is_file() for s in scripts), (name, rule.benchmark)
        assert rule.measured and rule.rule
        assert rule.threshold is None or (isinstance(rule.threshold, int) and rule.threshold > 0)


def test_cross_entropy_keeps_a_float64_cast_of_the_logits():
    # eager computes that loss in fp64; the cut CE op would in fp32: the site is not cut (plain CE on fp64 logits)
    h, w, y = torch.randn(6, 8), torch.randn(11, 8), torch.randint(0, 11, (6,))
    rep = smxcompile.explain(lambda h, w, y: torch.nn.functional.cross_entropy(torch.nn.functional.linear(h, w).double(), y),
                             h, w, y, options={"cpu": "rewrite"})
    (site,) = rep.sites
    assert site.kind == "cross_entropy" and "casts the logits to float64" in site.detail, str(rep)


def test_attention_scores_rounded_by_a_cast_are_not_fused():
    q, k, v = (torch.randn(1, 2, 8, 16).half() for _ in range(3))
    rep = smxcompile.explain(
        lambda q, k, v: torch.softmax((q @ k.transpose(-2, -1)).bfloat16(), -1).half() @ v, q, k, v,
        options={"cpu": "rewrite"})
    (att,) = rep.filter(kind="attention")
    assert att.action == "skipped" and "rounded by a cast to torch.bfloat16" in att.reason, str(rep)
