"""The policy ladder (``policy.decide``) and the pass manager's loop over ``PASSES``, tested on their own.

The ladder is driven with a bare :class:`Match` and hand-made :class:`Ladder` hooks, so each rung is checked
with the exact decision and reason it gives and with the near-miss inputs that must fall through to the next
rung. The CPU thresholds are checked through the softmax pass at their boundary. The manager's loop runs fake
passes (``manager.PASSES`` patched) over small hand-built FX graphs: what each pass may match, what it claims,
the rounds of overlapping and nested sites, guards, the report order and the cache key.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from pass_helpers import dynamo_graph
from torch.fx import Graph, GraphModule, Node

from smxcompile.options import SmxOptions
from smxcompile.passes import manager
from smxcompile.passes.manager import SmxPass, analyze, claimed, find_all, subgraphs
from smxcompile.passes.policy import CHECK_FAILED_REASON, CPU_KEEP_REASON, CPU_RULES, CUDA_KEEP_REASON, \
    CUDA_RULE_REASON, CUDA_RULES, DEVICE_REASON, DISABLED_REASON, FUNCTORCH_REASON, Ladder, cpu_threshold, decide, \
    find_sites, policy_size
from smxcompile.passes.protocol import Match, PassContext, RewritePass


@dataclasses.dataclass(kw_only=True)
class FakeMatch(Match):
    """A site anchored on one node; ``extra`` are further pattern nodes (its ``dead`` besides the anchor)."""

    node: Node
    kind: str = "softmax"
    extra: tuple = ()

    @property
    def anchor(self) -> Node:
        return self.node

    @property
    def dead(self) -> tuple:
        return (self.node, *self.extra)


def _node(name: str = "site") -> Node:
    graph = Graph()
    x = graph.placeholder("x")
    node = graph.call_function(torch.relu, (x,), name=name)
    graph.output(node)
    return node


def _match(kind: str = "softmax", device: str = "cpu", **fields) -> FakeMatch:
    return FakeMatch(node=_node(), kind=kind, device=device, **fields)


def _ctx(**options) -> PassContext:
    return PassContext(SmxOptions.from_mapping(options))


def _decided(match: FakeMatch, ctx: PassContext, ladder: Ladder | None = None) -> FakeMatch:
    decide(match, ctx, ladder or Ladder())
    return match


def _never(*_):
    raise AssertionError("this hook must not be reached")


# --------------------------------------------------------------------------- the ladder, rung by rung


def test_functorch_skips_before_any_hook_or_option():
    ctx = PassContext(SmxOptions.from_mapping({"disable": ["softmax"]}), functorch="vmap")
    m = _decided(_match(), ctx, Ladder(checks=_never, keep=_never, cpu_keep=_never, last_checks=_never))
    assert (m.action, m.reason) == ("skipped", FUNCTORCH_REASON.format(op="vmap"))


def test_a_site_the_matcher_skipped_is_left_as_it_is():
    m = _match()
    m.skip("matcher's reason")
    _decided(m, _ctx(cpu="keep"), Ladder(checks=_never))
    assert (m.action, m.reason) == ("skipped", "matcher's reason")


def test_the_pass_checks_skip_before_the_options_are_read():
    m = _decided(_match(), _ctx(softmax=False), Ladder(checks=lambda m, ctx: "an interior node is used elsewhere"))
    assert (m.action, m.reason) == ("skipped", "an interior node is used elsewhere")


def test_a_disabled_kind_is_kept_and_claims_its_nodes_only_when_the_ladder_says_so():
    m = _decided(_match(), _ctx(softmax=False), Ladder(cpu_keep=_never))
    assert (m.action, m.reason, m.keep_whole) == ("kept", DISABLED_REASON.format(kind="softmax"), False)
    m = _decided(_match(), _ctx(softmax=False), Ladder(keep_whole=frozenset({"disabled"})))
    assert (m.action, m.keep_whole) == ("kept", True)
    assert m.claims()


def test_the_ladder_kind_decides_which_option_disables_the_site():
    # the match calls itself log_softmax, the ladder rules it as softmax: only disabling softmax keeps it
    m = _decided(_match(kind="log_softmax"), _ctx(softmax=False), Ladder(kind="softmax"))
    assert (m.action, m.reason) == ("kept", DISABLED_REASON.format(kind="softmax"))
    near = _decided(_match(kind="softmax"), _ctx(log_softmax=False, cpu="rewrite"), Ladder(kind="softmax"))
    assert (near.action, near.reason) == ("rewritten", "")


def test_a_failed_check_keeps_the_site_by_its_full_key():
    ctx = PassContext(SmxOptions.from_mapping({"cpu": "rewrite"}), skip=frozenset({"body/site"}), prefix="body/")
    m = _decided(_match(prefix="body/"), ctx, Ladder(keep_whole=frozenset({"check"})))
    assert (m.action, m.reason, m.keep_whole) == ("kept", CHECK_FAILED_REASON, True)
    # the same node name in the top graph is another site
    near = _decided(_match(prefix=""), ctx)
    assert near.action == "rewritten"


def test_the_pass_keep_reason_applies_on_every_device_and_policy():
    for device, options in (("cpu", {"cpu": "rewrite"}), ("cuda", {"cuda": "rewrite"})):
        m = _decided(_match(device=device), _ctx(**options), Ladder(keep=lambda m, ctx: "already fused SDPA",
                                                                    cpu_keep=_never))
        assert (m.action, m.reason, m.keep_whole) == ("kept", "already fused SDPA", False)


@pytest.mark.parametrize("cpu,reason,action", [
    ("keep", CPU_KEEP_REASON, "kept"),
    ("auto", "CPU: measured slower", "kept"),
    ("rewrite", "", "rewritten"),
])
def test_cpu_policy(cpu, reason, action):
    m = _decided(_match(), _ctx(cpu=cpu), Ladder(cpu_keep=lambda m, ctx: "CPU: measured slower",
                                                 keep_whole=frozenset({"cpu"})))
    assert (m.action, m.reason, m.keep_whole) == (action, reason, action == "kept")


def test_cpu_auto_rewrites_when_the_cpu_rule_has_no_reason_or_the_pass_none():
    assert _decided(_match(), _ctx(cpu="auto"), Ladder(cpu_keep=lambda m, ctx: "")).action == "rewritten"
    assert _decided(_match(), _ctx(cpu="auto"), Ladder()).action == "rewritten"


def test_cpu_options_do_not_reach_cuda_sites_nor_cuda_options_cpu_sites():
    assert _decided(_match(device="cuda", kind="attention"), _ctx(cpu="keep"), Ladder(cpu_keep=_never)).action \
        == "rewritten"
    assert _decided(_match(device="cpu"), _ctx(cuda="keep", cpu="rewrite")).action == "rewritten"


def test_cuda_keep_claims_the_site():
    m = _decided(_match(device="cuda", kind="attention"), _ctx(cuda="keep"))
    assert (m.action, m.reason, m.keep_whole) == ("kept", CUDA_KEEP_REASON, True)


def test_cuda_auto_keeps_the_kinds_with_a_rule_and_rewrites_the_others():
    rule = CUDA_RULES["softmax"]
    m = _decided(_match(device="cuda", kind="softmax"), _ctx(cuda="auto"))
    assert m.action == "kept" and m.keep_whole
    assert m.reason == CUDA_RULE_REASON.format(rule=rule.rule, measured=rule.measured, benchmark=rule.benchmark)
    assert "attention" not in CUDA_RULES
    assert _decided(_match(device="cuda", kind="attention"), _ctx(cuda="auto")).action == "rewritten"
    assert _decided(_match(device="cuda", kind="softmax"), _ctx(cuda="rewrite")).action == "rewritten"


def test_cuda_auto_rules_a_route_apart_from_its_kind():
    m = _decided(_match(device="cuda", kind="attention", route="attention_score_mod"), _ctx(cuda="auto"))
    assert m.action == "kept"
    assert CUDA_RULES["attention_score_mod"].rule in m.reason


def test_cuda_auto_reads_the_ladder_kind_not_the_match_kind():
    m = _decided(_match(device="cuda", kind="attention"), _ctx(cuda="auto"), Ladder(kind="quant_softmax"))
    assert m.action == "kept" and CUDA_RULES["quant_softmax"].rule in m.reason


def test_a_device_without_smx_kernels_keeps_the_site():
    m = _decided(_match(device="mps"), _ctx(cpu="rewrite", cuda="rewrite"))
    assert (m.action, m.reason, m.keep_whole) == ("kept", DEVICE_REASON.format(device="mps"), False)


def test_a_device_free_site_skips_every_device_rule():
    ladder = Ladder(device_free=lambda m: True, cpu_keep=_never)
    for device, options in (("cpu", {"cpu": "keep"}), ("cuda", {"cuda": "keep"}), ("mps", {})):
        assert _decided(_match(device=device), _ctx(**options), ladder).action == "rewritten"
    # device_free says no: the device rules apply again
    assert _decided(_match(), _ctx(cpu="keep"), Ladder(device_free=lambda m: False)).action == "kept"


def test_last_checks_run_only_for_a_site_that_would_be_rewritten():
    calls = []

    def last(m, ctx):
        calls.append(m.key)
        return "unsupported stride"

    kept = _decided(_match(), _ctx(cpu="keep"), Ladder(last_checks=last))
    assert kept.action == "kept" and calls == []
    m = _decided(_match(), _ctx(cpu="rewrite"), Ladder(last_checks=last))
    assert (m.action, m.reason) == ("skipped", "unsupported stride") and calls == ["site"]
    assert _decided(_match(), _ctx(cpu="rewrite"), Ladder(last_checks=lambda m, ctx: "")).action == "rewritten"


def test_find_sites_leaves_out_matches_touching_excluded_nodes():
    graph = Graph()
    x = graph.placeholder("x")
    a = graph.call_function(torch.relu, (x,))
    b = graph.call_function(torch.sigmoid, (a,))
    c = graph.call_function(torch.tanh, (b,))
    graph.output(c)
    spans = {a: (b,), c: ()}
    ctx = PassContext(SmxOptions.from_mapping({"cpu": "rewrite"}), prefix="p/")
    def match(node):
        return FakeMatch(node=node, device="cpu", extra=spans[node]) if node in spans else None

    found = find_sites(graph, ctx, {b}, match, Ladder())
    assert [m.anchor for m in found] == [c]
    assert found[0].key == "p/" + c.name and found[0].action == "rewritten"
    assert [m.anchor for m in find_sites(graph, ctx, set(), match, Ladder())] == [a, c]


def test_policy_size_and_thresholds():
    assert policy_size(77, fallback=5) == 77
    assert cpu_threshold("softmax_min_columns_inference") == CPU_RULES["softmax_min_columns_inference"].threshold
    with pytest.raises(AssertionError):
        cpu_threshold("cross_entropy")   # a keep rule, no threshold


# --------------------------------------------------------------------------- thresholds through a real pass


def _softmax_site(shape, requires_grad=False, scale=None):
    fn = (lambda x: torch.softmax(x, -1)) if scale is None else (lambda x: torch.softmax(x * scale, -1))
    x = torch.randn(*shape, requires_grad=requires_grad)
    (site,) = analyze(dynamo_graph(fn, x).graph, SmxOptions()).sites
    return site


def test_inference_softmax_threshold_boundary():
    need = cpu_threshold("softmax_min_columns_inference")
    at = _softmax_site((1, need))
    assert (at.kind, at.action) == ("softmax", "rewritten")
    below = _softmax_site((1, need - 1))
    assert below.action == "kept"
    assert f"rows of {need - 1} columns" in below.reason and f"below {need} columns in inference" in below.reason


def test_training_softmax_uses_the_training_threshold():
    need = cpu_threshold("softmax_min_columns")
    site = _softmax_site((1, cpu_threshold("softmax_min_columns_inference")), requires_grad=True)
    assert site.action == "kept" and f"below {need} columns (training or log-softmax)" in site.reason


def test_an_absorbed_neighbour_keeps_even_a_long_row():
    site = _softmax_site((1, cpu_threshold("softmax_min_columns_inference")), scale=0.5)
    assert site.action == "kept" and "Inductor fuses the neighbouring ops" in site.reason


# --------------------------------------------------------------------------- the pass manager's loop


class FakePass(RewritePass):
    """Matches every ``call_function`` node whose target is in ``targets``. Its decision comes from ``ladder``
    through the policy (:func:`find_sites`), or else from ``decide(node) -> (action, reason, keep_whole, guarded)``
    (default: rewritten). A rewrite replaces the node's target by ``torch.neg``. ``span(node)``: further pattern
    nodes; ``touch(node)``: the nodes a rewrite changes (default: the pattern's)."""

    def __init__(self, name, *targets, decide=None, ladder=None, span=None, touch=None, repeat=False):
        self.name, self.targets, self.repeat = name, targets, repeat
        self._decide, self._ladder, self._span, self._touch = decide, ladder, span, touch
        self.excludes: list[set[Node]] = []
        self.rewritten: list[str] = []
        self.guarded: list[str] = []

    def _match(self, node):
        if node.op != "call_function" or node.target not in self.targets:
            return None
        return FakeMatch(node=node, kind=self.name, device="cpu",
                         extra=tuple(self._span(node)) if self._span else ())

    def find(self, graph, ctx, exclude):
        self.excludes.append(set(exclude))
        if self._ladder is not None:
            return find_sites(graph, ctx, exclude, self._match, self._ladder)
        out = []
        for node in graph.nodes:
            m = self._match(node) if node not in exclude else None
            if m is None:
                continue
            m.prefix = ctx.prefix
            action, reason, whole, guarded = self._decide(node) if self._decide else ("rewritten", "", False, False)
            m.action, m.reason, m.keep_whole, m.guarded = action, reason, whole, guarded
            out.append(m)
        return out

    def rewrite(self, graph, match, ctx):
        self.rewritten.append(match.anchor.name)
        match.anchor.target = torch.neg

    def guard(self, graph, match, ctx):
        self.guarded.append(match.key)

    def touched(self, match):
        return set(self._touch(match.anchor)) if self._touch else match.nodes()


def _chain(*targets) -> tuple[GraphModule, list[Node]]:
    graph = Graph()
    node = graph.placeholder("x")
    nodes = []
    for target in targets:
        node = graph.call_function(target, (node,))
        nodes.append(node)
    graph.output(node)
    return GraphModule(torch.nn.Module(), graph), nodes


@pytest.fixture
def passes(monkeypatch):
    def install(*fake):
        monkeypatch.setattr(manager, "PASSES", tuple(fake))
        return fake
    return install


def _run(gm: GraphModule, **options) -> list:
    smx = SmxPass(SmxOptions.from_mapping({"cpu": "rewrite", **options}))
    smx(gm.graph)
    return smx.report.sites


def test_a_later_pass_does_not_see_the_nodes_an_earlier_one_rewrote(passes):
    gm, (relu, sigmoid) = _chain(torch.relu, torch.sigmoid)
    first, second = passes(FakePass("first", torch.relu, span=lambda n: [sigmoid]), FakePass("second", torch.sigmoid))
    sites = _run(gm)
    assert [(s.kind, s.action) for s in sites] == [("first", "rewritten")]
    assert second.excludes == [{relu, sigmoid}] and second.rewritten == []


def test_a_kept_site_leaves_its_nodes_to_later_passes_unless_kept_whole(passes):
    gm, (relu, sigmoid) = _chain(torch.relu, torch.sigmoid)
    kept = ("kept", "not worth it", False, False)
    _, second = passes(FakePass("first", torch.relu, span=lambda n: [sigmoid], decide=lambda n: kept),
                       FakePass("second", torch.sigmoid))
    assert [(s.kind, s.action, s.reason) for s in _run(gm)] == [("first", "kept", "not worth it"),
                                                                ("second", "rewritten", "")]
    assert second.rewritten == [sigmoid.name]

    gm, (relu, sigmoid) = _chain(torch.relu, torch.sigmoid)
    whole = ("kept", "left to Inductor as written", True, False)
    _, second = passes(FakePass("first", torch.relu, span=lambda n: [sigmoid], decide=lambda n: whole),
                       FakePass("second", torch.sigmoid))
    assert [(s.kind, s.action) for s in _run(gm)] == [("first", "kept")]
    assert second.rewritten == [] and gm.graph.find_nodes(op="call_function", target=torch.sigmoid)


def test_claimed_takes_rewritten_whole_kept_and_guarded_sites_only():
    def site(action, whole=False, guarded=False):
        m = FakeMatch(node=_node(action), keep_whole=whole, guarded=guarded)
        m.action = action
        return m

    rewritten, kept, whole, guarded, skipped = (site("rewritten"), site("kept"), site("kept", whole=True),
                                                site("kept", guarded=True), site("skipped"))
    assert claimed([rewritten, kept, whole, guarded, skipped]) == {rewritten.anchor, whole.anchor, guarded.anchor}


def test_find_all_yields_every_site_pass_by_pass_without_changing_the_graph(passes):
    gm, (relu, sigmoid, relu2) = _chain(torch.relu, torch.sigmoid, torch.relu)
    first, second = passes(FakePass("first", torch.sigmoid), FakePass("second", torch.relu))
    before = str(gm.graph)
    found = [(p.name, m.anchor) for p, m in find_all(gm.graph, PassContext(SmxOptions()), {relu2})]
    assert found == [("first", sigmoid), ("second", relu)]
    assert str(gm.graph) == before and first.rewritten == second.rewritten == []
    assert second.excludes == [{relu2, sigmoid}]


def test_overlapping_sites_are_rewritten_one_per_round_without_repeat(passes):
    gm, nodes = _chain(torch.relu, torch.relu, torch.relu)
    # a rewrite of a node touches it and its input: neighbours overlap
    (fake,) = passes(FakePass("fake", torch.relu, touch=lambda n: {n, n.args[0]}))
    _run(gm)
    assert fake.rewritten == [nodes[0].name, nodes[2].name]
    assert len(fake.excludes) == 1     # found once: no second round
    assert [n.target for n in nodes] == [torch.neg, torch.relu, torch.neg]


def test_repeat_finds_again_after_each_round_until_nothing_is_left(passes):
    gm, nodes = _chain(torch.relu, torch.relu, torch.relu)
    (fake,) = passes(FakePass("fake", torch.relu, touch=lambda n: {n, n.args[0]}, repeat=True))
    sites = _run(gm)
    assert fake.rewritten == [nodes[0].name, nodes[2].name, nodes[1].name]
    assert len(fake.excludes) == 3     # the first find, one after each of the two rounds
    assert [n.target for n in nodes] == [torch.neg] * 3
    # the report lists the first find's sites in graph order, each once
    assert [s.node for s in sites] == [n.name for n in nodes]
    assert all(s.action == "rewritten" for s in sites)


def test_guard_runs_for_guarded_sites_not_rewritten(passes):
    gm, (relu, sigmoid) = _chain(torch.relu, torch.sigmoid)
    decisions = {relu: ("kept", "Inductor would mis-compile it; guarded", False, True),
                 sigmoid: ("rewritten", "", False, True)}
    (fake,) = passes(FakePass("fake", torch.relu, torch.sigmoid, decide=decisions.get))
    sites = _run(gm)
    assert fake.guarded == [relu.name] and fake.rewritten == [sigmoid.name]
    assert [(s.action, s.reason) for s in sites] == [("kept", "Inductor would mis-compile it; guarded"),
                                                     ("rewritten", "")]


def test_nothing_rewritten_leaves_the_graph_alone(passes):
    gm, (relu,) = _chain(torch.relu)
    passes(FakePass("fake", torch.relu, decide=lambda n: ("kept", "policy", False, False)))
    before = str(gm.graph)
    assert [(s.action, s.reason) for s in _run(gm)] == [("kept", "policy")]
    assert str(gm.graph) == before


def test_analyze_reports_what_the_pass_would_do_without_doing_it(passes):
    gm, (relu, sigmoid) = _chain(torch.relu, torch.sigmoid)
    passes(FakePass("first", torch.relu, decide=lambda n: ("kept", "policy", False, False)),
           FakePass("second", torch.sigmoid))
    before = str(gm.graph)
    planned = analyze(gm.graph, SmxOptions(), graph_tag="g3")
    assert str(gm.graph) == before
    assert [(s.kind, s.action, s.graph, s.node) for s in planned] == [("first", "kept", "g3", relu.name),
                                                                     ("second", "rewritten", "g3", sigmoid.name)]
    done = _run(gm)
    assert [(s.kind, s.action) for s in done] == [(s.kind, s.action) for s in planned]


def _with_body() -> tuple[GraphModule, GraphModule]:
    """A graph whose ``body`` submodule is a GraphModule of its own (as a higher-order op's body is)."""
    inner_graph = Graph()
    x = inner_graph.placeholder("x")
    inner_graph.output(inner_graph.call_function(torch.relu, (x,), name="inner"))
    root = torch.nn.Module()
    root.body = GraphModule(torch.nn.Module(), inner_graph)
    outer = Graph()
    x = outer.placeholder("x")
    body = outer.get_attr("body")
    outer.output((outer.call_function(torch.relu, (x,), name="top"), body))
    gm = GraphModule(root, outer)
    return gm, gm.body


def test_subgraphs_are_rewritten_with_their_prefix_and_recompiled(passes):
    gm, body = _with_body()
    assert [(prefix, owner) for prefix, _, owner in subgraphs(gm.graph)] == [("", None), ("body/", body)]
    (fake,) = passes(FakePass("fake", torch.relu))
    sites = _run(gm)
    assert sorted(s.node for s in sites) == ["body/inner", "top"]
    assert "torch.neg" in body.code   # the body's GraphModule was recompiled


def test_a_failed_check_is_kept_in_its_own_subgraph_only(passes):
    gm, body = _with_body()
    passes(FakePass("softmax", torch.relu, ladder=Ladder()))
    smx = SmxPass(SmxOptions.from_mapping({"cpu": "rewrite"}), skip=frozenset({"body/inner"}))
    smx(gm.graph)
    assert {s.node: (s.action, s.reason) for s in smx.report.sites} == {
        "top": ("rewritten", ""), "body/inner": ("kept", CHECK_FAILED_REASON)}
    assert "torch.neg" not in body.code
    assert [n.target for n in gm.graph.nodes if n.name == "top"] == [torch.neg]


def test_uuid_tracks_options_skip_and_export():
    base = SmxPass(SmxOptions()).uuid()
    assert SmxPass(SmxOptions()).uuid() == base
    assert SmxPass(SmxOptions.from_mapping({"cpu": "rewrite"})).uuid() != base
    assert SmxPass(SmxOptions(), skip=frozenset({"softmax"})).uuid() != base
    assert SmxPass(SmxOptions(), export=True).uuid() != base
    # the graph tag names report entries only: it does not change what the pass emits
    assert SmxPass(SmxOptions(), graph_tag="g7").uuid() == base
