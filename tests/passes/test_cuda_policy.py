"""The CUDA policy (``cuda=`` option, ``CUDA_RULES``) on graphs whose values are CUDA tensors.

No GPU needed: the Dynamo graph is captured on CPU, then every value is replaced by a fake CUDA tensor of the same
shape, strides and dtype (the passes read only the values' metadata).
"""

import math

import pytest
import torch
import torch.nn.functional as F
from pass_helpers import dynamo_graph
from torch._subclasses.fake_tensor import FakeTensorMode

from smxcompile.options import SmxOptions
from smxcompile.passes import analyze
from smxcompile.passes.policy import CUDA_RULES


def _on_cuda(gm):
    """``gm``'s graph with every tensor value moved to a fake CUDA device."""
    with FakeTensorMode():
        for n in gm.graph.nodes:
            t = n.meta.get("example_value")
            if isinstance(t, torch.Tensor):
                n.meta["example_value"] = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cuda",
                                                              requires_grad=t.requires_grad)
    return gm.graph


def _attention(q, k, v):
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    return torch.softmax(s, -1) @ v


def _softmax(x):
    return torch.softmax(x * 0.5, -1)


def _linear_ce(h, w, y):
    return F.cross_entropy(F.linear(h, w), y)


def _sites(fn, args, options):
    report = analyze(_on_cuda(dynamo_graph(fn, *args)), SmxOptions.from_mapping(options))
    return {s.kind: s for s in report.sites}


_ARGS = {
    _attention: lambda: [torch.randn(1, 2, 16, 8) for _ in range(3)],
    _softmax: lambda: [torch.randn(4, 32)],
    _linear_ce: lambda: [torch.randn(6, 8, requires_grad=True), torch.randn(40, 8, requires_grad=True),
                         torch.randint(0, 40, (6,))],
}


@pytest.mark.parametrize("fn,kind,auto", [(_attention, "attention", "rewritten"), (_softmax, "softmax", "kept"),
                                          (_linear_ce, "linear_cross_entropy", "kept")],
                         ids=["attention", "softmax", "linear_ce"])
def test_cuda_auto_follows_the_rules_and_options_override(fn, kind, auto):
    site = _sites(fn, _ARGS[fn](), {})[kind]
    assert site.action == auto, site
    if auto == "kept":
        assert kind in CUDA_RULES and site.reason.startswith("CUDA: ") and "cuda='rewrite'" in site.reason
    assert _sites(fn, _ARGS[fn](), {"cuda": "rewrite"})[kind].action == "rewritten"
    kept = _sites(fn, _ARGS[fn](), {"cuda": "keep"})[kind]
    assert kept.action == "kept" and kept.reason == "options cuda='keep'"
    # the CPU option never decides a CUDA site
    assert _sites(fn, _ARGS[fn](), {"cpu": "rewrite"})[kind].action == auto


def test_every_cuda_rule_names_a_rewrite_kind_and_a_benchmark_that_exists():
    from pathlib import Path

    from smxcompile.options import REWRITE_KINDS

    repo = Path(__file__).resolve().parents[2]
    from smxcompile.passes.policy import ROUTES

    assert set(CUDA_RULES) <= set(REWRITE_KINDS) | set(ROUTES) and "attention" not in CUDA_RULES
    assert set(ROUTES.values()) <= set(REWRITE_KINDS)
    for kind, rule in CUDA_RULES.items():
        scripts = [w.strip(",") for w in rule.benchmark.split() if w.startswith("benchmarks/")]
        assert scripts and all((repo / s.rstrip(":")).is_file() for s in scripts), (kind, rule.benchmark)
        assert rule.rule.startswith("kept") and rule.measured


def test_fp16_naive_softmax_is_rewritten_on_cuda_under_every_policy():
    # exp overflows fp16 above 11.1: Inductor's fused code gives 0 there, eager NaN; smx::softmax the softmax
    def naive(x):
        e = x.exp()
        return e / e.sum(-1, keepdim=True)

    for cuda in ("auto", "keep"):
        site = _sites(naive, [torch.randn(4, 32, dtype=torch.float16)], {"cuda": cuda})["softmax"]
        assert site.action == "rewritten" and "not left to Inductor" in site.detail, (cuda, site)


def test_plain_cross_entropy_kept_on_cuda_with_the_rule_first():
    site = _sites(lambda z, y: F.cross_entropy(z, y), [torch.randn(6, 40), torch.randint(0, 40, (6,))],
                  {})["cross_entropy"]
    assert site.action == "kept" and site.reason.startswith("CUDA: kept, not yet timed against Inductor"), site


def test_export_options_rewrite_on_cuda_unless_told_otherwise():
    from smxcompile.export.capture import export_options

    assert SmxOptions.from_mapping(export_options({"check": True}, "all")).cuda == "rewrite"
    assert SmxOptions.from_mapping(export_options({"cuda": "auto"}, "all")).cuda == "auto"


@pytest.mark.parametrize("bad", ["fast", "Auto", None, ["auto"], 1])
def test_cuda_option_is_validated(bad):
    with pytest.raises(ValueError, match="'cuda' must be one of"):
        SmxOptions.from_mapping({"cuda": bad})
