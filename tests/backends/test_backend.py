"""The ``smx`` backend end to end: registration, training, options, ``check``, dynamic shapes,
the FX graph cache, ``explain`` and the ``smx`` command line.

Subprocess tests (a fresh interpreter is the only way to test registration and the cache) are
marked ``slow``; they still run in CI.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import smxcompile
from smxcompile.options import REWRITE_KINDS, SmxOptions
from smxcompile.passes import SmxPass

REWRITE = {"cpu": "rewrite"}
REPO = Path(__file__).resolve().parents[2]


def _python(code: str, *, env: dict | None = None, cwd: str | None = None, timeout: int = 240):
    """Run ``code`` in a fresh interpreter (this venv); return the CompletedProcess."""
    full_env = dict(os.environ)
    full_env.pop("PYTEST_CURRENT_TEST", None)
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=full_env, cwd=cwd, timeout=timeout)


def _last_json_line(stdout: str):
    lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
    assert lines, stdout
    return json.loads(lines[-1])


def _new_reports(before: int):
    from smxcompile.backends.smx import compiled_reports

    return compiled_reports[before:]


def _n_reports() -> int:
    from smxcompile.backends.smx import compiled_reports

    return len(compiled_reports)


# --------------------------------------------------------------------------- registration


@pytest.mark.slow
def test_entry_point_without_importing_smxcompile_first():
    r = _python("""
        import json, sys
        import torch
        assert "smxcompile" not in sys.modules
        fn = torch.compile(lambda x: torch.softmax(x, -1), backend="smx", options={"cpu": "rewrite"})
        x = torch.randn(3, 5)
        y = fn(x)
        torch.testing.assert_close(y, torch.softmax(x, -1))
        loaded = "smxcompile" in sys.modules
        import smxcompile  # must not fail with a duplicate registration
        rep = smxcompile.last_report()
        # a second compile after the explicit import still finds the backend
        fn2 = torch.compile(lambda x: torch.log_softmax(x, 0), backend="smx", options={"cpu": "rewrite"})
        torch.testing.assert_close(fn2(x), torch.log_softmax(x, 0))
        from torch._dynamo import list_backends
        print(json.dumps({"loaded": loaded, "rewritten": rep.count(action="rewritten"),
                          "listed": "smx" in list_backends(exclude_tags=()),
                          "last": smxcompile.last_report().count(action="rewritten")}))
    """)
    assert r.returncode == 0, r.stderr[-4000:]
    out = _last_json_line(r.stdout)
    assert out == {"loaded": True, "rewritten": 1, "listed": True, "last": 1}


def test_import_twice_does_not_reregister():
    import importlib

    importlib.reload(smxcompile)  # runs _register_backend_if_needed again
    from torch._dynamo.backends.registry import lookup_backend

    assert lookup_backend("smx") is not None


# --------------------------------------------------------------------------- training


class TinyClassifier(nn.Module):
    """Token mixer with a softmax over positions, then a log-softmax head and NLL."""

    def __init__(self, d=8, n_classes=5):
        super().__init__()
        self.score = nn.Linear(d, d)
        self.value = nn.Linear(d, d)
        self.head = nn.Linear(d, n_classes)

    def forward(self, x, y):
        w = F.softmax(self.score(x) / 2.0, dim=1)  # weights over positions (not attention-shaped)
        h = (w * self.value(x)).sum(1)
        logp = torch.log_softmax(self.head(h), dim=-1)
        return F.nll_loss(logp, y)


def _train(model, steps, x, y):
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses, grads = [], None
    for _ in range(steps):
        opt.zero_grad()
        loss = model(x, y)
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        opt.step()
        losses.append(loss.detach())
    return torch.stack(losses), grads


def _train_compiled_and_eager(seed, steps, options):
    """Train two identical TinyClassifiers, one compiled with smx; assert they agree; return the reports."""
    torch.manual_seed(seed)
    eager = TinyClassifier()
    model = TinyClassifier()
    model.load_state_dict(eager.state_dict())
    x, y = torch.randn(4, 6, 8), torch.randint(0, 5, (4,))
    torch._dynamo.reset()
    before = _n_reports()
    l_c, g_c = _train(torch.compile(model, backend="smx", options=options), steps, x, y)
    l_e, g_e = _train(eager, steps, x, y)
    torch.testing.assert_close(l_c, l_e, rtol=1e-5, atol=1e-6)
    for a, b in zip(g_c, g_e):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    return _new_reports(before)


def test_training_matches_eager():
    reps = _train_compiled_and_eager(0, 3, REWRITE)
    assert len(reps) == 1  # one graph, compiled once (forward + backward through AOTAutograd)
    # nll_loss(log_softmax(head(h))) is a linear -> cross-entropy: cut CE owns the log-softmax
    assert [(s.kind, s.action) for s in reps[0]] == [("linear_cross_entropy", "rewritten"), ("softmax", "rewritten")]
    assert "nll_loss(log_softmax)" in reps[0].sites[0].detail
    assert "scale=0.5" in reps[0].sites[1].detail


def test_training_matches_eager_without_ce_rewrite():
    reps = _train_compiled_and_eager(0, 3, {**REWRITE, "linear_cross_entropy": False})
    assert [(s.kind, s.action) for s in reps[0]] == [
        ("linear_cross_entropy", "kept"), ("softmax", "rewritten"), ("log_softmax", "rewritten")]


def test_training_default_cpu_policy_matches_eager():
    # cpu="auto" on short rows: both sites are kept for Inductor, which still trains like eager
    (rep,) = _train_compiled_and_eager(1, 2, None)
    assert [(s.kind, s.action) for s in rep] == [("linear_cross_entropy", "kept"), ("softmax", "kept"),
                                                 ("log_softmax", "kept")]
    assert rep.sites[0].reason.startswith("CPU: 5 classes; below 4096")
    assert rep.sites[1].reason.startswith("CPU: Inductor fuses")
    assert rep.sites[2].reason.startswith("CPU: rows of 5 columns")


@pytest.mark.parametrize("requires_grad,cols,action", [
    (False, 16384, "rewritten"),   # inference softmax: ATen wins from 16K columns
    (False, 8192, "kept"),
    (True, 16384, "kept"),         # training: only from 128K columns
    (True, 131072, "rewritten"),
])
def test_default_cpu_policy_row_length_thresholds(requires_grad, cols, action):
    from smxcompile.passes.policy import cpu_threshold

    assert (cpu_threshold("softmax_min_columns_inference"), cpu_threshold("softmax_min_columns")) == (16384, 131072)
    x = torch.randn(2, cols, requires_grad=requires_grad)
    rep = smxcompile.explain(lambda t: torch.softmax(t, -1), x)
    assert [(s.kind, s.action) for s in rep] == [("softmax", action)], rep
    if action == "kept":
        assert f"rows of {cols} columns" in rep.sites[0].reason


# --------------------------------------------------------------------------- options


def _two_sites(x):
    return torch.softmax(x, -1), F.log_softmax(x, dim=0)


def test_unknown_option_is_a_value_error():
    with pytest.raises(ValueError, match="known options") as ei:
        SmxOptions.from_mapping({"sofmax": False})
    assert "'softmax'" in str(ei.value) and "'check'" in str(ei.value)
    # through torch.compile the ValueError reaches the user (Dynamo may wrap it)
    torch._dynamo.reset()
    fn = torch.compile(_two_sites, backend="smx", options={"bogus": 1})
    with pytest.raises(Exception) as ei:
        fn(torch.randn(2, 3))
    chain, e = [], ei.value
    while e is not None:
        chain.append(e)
        e = e.__cause__ or getattr(e, "inner_exception", None)
    assert any(isinstance(c, ValueError) and "known options" in str(c) for c in chain), repr(ei.value)


@pytest.mark.parametrize("bad", [
    {"disable": ["softmx"]},
    {"softmax": "no"},
    {"cpu": "fast"},
    {"inductor": 3},
])
def test_bad_option_values(bad):
    with pytest.raises(ValueError):
        SmxOptions.from_mapping(bad)
    with pytest.raises(ValueError):
        SmxOptions.from_mapping([("cpu", "keep")])


def test_every_kind_can_be_switched_off_by_name():
    for kind in REWRITE_KINDS:
        assert not SmxOptions.from_mapping({kind: False}).enabled(kind)
        assert not SmxOptions.from_mapping({"disable": [kind]}).enabled(kind)
        assert SmxOptions.from_mapping({kind: True}).enabled(kind)


@pytest.mark.parametrize("options,want", [
    ({"disable": ["softmax"], "cpu": "rewrite"}, [("softmax", "kept"), ("log_softmax", "rewritten")]),
    ({"log_softmax": False, "cpu": "rewrite"}, [("softmax", "rewritten"), ("log_softmax", "kept")]),
    ({"disable": ["softmax", "log_softmax"], "cpu": "rewrite"}, [("softmax", "kept"), ("log_softmax", "kept")]),
    ({"cpu": "keep"}, [("softmax", "kept"), ("log_softmax", "kept")]),
])
def test_switch_off_in_explain(options, want):
    rep = smxcompile.explain(_two_sites, torch.randn(3, 4), options=options)
    assert [(s.kind, s.action) for s in rep] == want
    for s in rep:
        if s.action == "kept" and options.get("cpu") != "keep":
            assert s.reason == f"rewrite kind '{s.kind}' disabled by options"


def test_disable_in_compile_keeps_the_site_and_matches_eager():
    torch._dynamo.reset()
    before = _n_reports()
    fn = torch.compile(_two_sites, backend="smx", options={"disable": ["softmax"], "cpu": "rewrite"})
    x = torch.randn(3, 4)
    for a, b in zip(fn(x), _two_sites(x)):
        torch.testing.assert_close(a, b)
    (rep,) = _new_reports(before)
    assert [(s.kind, s.action) for s in rep] == [("softmax", "kept"), ("log_softmax", "rewritten")]
    assert rep.sites[0].reason == "rewrite kind 'softmax' disabled by options"


# --------------------------------------------------------------------------- check


def test_check_keeps_a_site_that_disagrees(monkeypatch):
    from smxcompile.kernels.softmax import ops as kernels

    real = kernels._forward_impl
    calls = {"n": 0, "wrong": 0}

    def flaky(x, dim, scale, softcap, mask, dtype, return_lse, log):
        calls["n"] += 1
        y, lse = real(x, dim, scale, softcap, mask, dtype, return_lse, log)
        if calls["wrong"] == 0 and not log:  # the first softmax call answers wrongly, once
            calls["wrong"] += 1
            return y + 0.25, lse
        return y, lse

    monkeypatch.setattr(kernels, "_forward_impl", flaky)

    def fn(x):
        return torch.softmax(x * 2.0, -1), torch.softmax(x, 0), torch.log_softmax(x, 1)

    torch._dynamo.reset()
    before = _n_reports()
    compiled = torch.compile(fn, backend="smx", options={"check": True, "cpu": "rewrite"})
    x = torch.randn(3, 5)
    got = compiled(x)
    assert calls["wrong"] == 1
    (rep,) = _new_reports(before)
    acts = [(s.kind, s.action) for s in rep]
    assert acts == [("softmax", "kept"), ("softmax", "rewritten"), ("log_softmax", "rewritten")], str(rep)
    assert rep.sites[0].reason.startswith("check failed")
    for a, b in zip(got, fn(x)):
        torch.testing.assert_close(a, b)
    # the kept site is Inductor's code: the op is not called for it at run time
    n = calls["n"]
    compiled(x)
    assert calls["n"] == n + 2


def test_check_passes_when_the_op_agrees():
    torch._dynamo.reset()
    before = _n_reports()
    mask = torch.zeros(4, 6)
    mask[:, -1] = float("-inf")
    fn = torch.compile(lambda x, m: (torch.softmax(x / 3.0 + m, -1), x - x.logsumexp(-1, keepdim=True)),
                       backend="smx", options={"check": True, "cpu": "rewrite"})
    x = torch.randn(2, 4, 6)
    got = fn(x, mask)
    (rep,) = _new_reports(before)
    assert rep.count(action="rewritten") == 2, str(rep)
    torch.testing.assert_close(got[0], torch.softmax(x / 3.0 + mask, -1))


# --------------------------------------------------------------------------- dynamic shapes


def _dyn_fn(x, m):
    return torch.softmax(x, -1), F.log_softmax(x * 0.5, dim=1), torch.softmax(x + m, -1)


def _check_dyn(fn, shapes):
    for b, n in shapes:
        x, m = torch.randn(b, n, 7), torch.zeros(n, 7)
        for a, e in zip(fn(x, m), _dyn_fn(x, m)):
            assert a.shape == e.shape
            torch.testing.assert_close(a, e)


def test_dynamic_true():
    torch._dynamo.reset()
    before = _n_reports()
    fn = torch.compile(_dyn_fn, backend="smx", options=REWRITE, dynamic=True)
    _check_dyn(fn, [(2, 3), (5, 4), (3, 6)])
    reps = _new_reports(before)
    assert len(reps) == 1, [str(r) for r in reps]  # one symbolic graph serves every shape
    rep = reps[0]
    assert any("dynamic shapes" in n for n in rep.notes)
    assert [s.kind for s in rep] == ["softmax", "log_softmax", "softmax"]
    # every site either fires or says why not
    for s in rep:
        assert s.action == "rewritten" or s.reason, str(rep)
    assert rep.sites[0].action == "rewritten"
    assert rep.sites[1].action == "rewritten" and "scale=0.5" in rep.sites[1].detail
    # the masked softmax still fires; the mask is absorbed only when its broadcast is static
    assert rep.sites[2].action == "rewritten"


def test_mark_dynamic():
    torch._dynamo.reset()
    before = _n_reports()
    fn = torch.compile(_dyn_fn, backend="smx", options=REWRITE)
    x, m = torch.randn(4, 3, 7), torch.zeros(3, 7)
    torch._dynamo.mark_dynamic(x, 0)
    for a, e in zip(fn(x, m), _dyn_fn(x, m)):
        torch.testing.assert_close(a, e)
    x2 = torch.randn(6, 3, 7)
    torch._dynamo.mark_dynamic(x2, 0)
    for a, e in zip(fn(x2, m), _dyn_fn(x2, m)):
        torch.testing.assert_close(a, e)
    reps = _new_reports(before)
    assert len(reps) == 1, [str(r) for r in reps]
    assert reps[0].count(action="rewritten") >= 2, str(reps[0])
    assert any("dynamic shapes" in n for n in reps[0].notes)


# --------------------------------------------------------------------------- the pass uuid and the FX graph cache


def test_uuid_stable_and_option_dependent():
    a = SmxPass(SmxOptions.from_mapping({"cpu": "rewrite"}))
    b = SmxPass(SmxOptions.from_mapping({"cpu": "rewrite"}))
    assert a.uuid() == b.uuid()
    assert SmxPass(SmxOptions.from_mapping({"cpu": "rewrite"}), graph_tag="g7").uuid() == a.uuid()
    others = [
        SmxPass(SmxOptions()),
        SmxPass(SmxOptions.from_mapping({"cpu": "keep"})),
        SmxPass(SmxOptions.from_mapping({"cpu": "rewrite", "softmax": False})),
        SmxPass(SmxOptions.from_mapping({"cpu": "rewrite", "attention_softmax": True})),
        SmxPass(SmxOptions.from_mapping({"cpu": "rewrite", "attention": False})),
        SmxPass(SmxOptions.from_mapping({"cpu": "rewrite", "attention_normalizer": "sigmoid"})),
        SmxPass(SmxOptions.from_mapping({"cpu": "rewrite", "check": True})),
        SmxPass(SmxOptions.from_mapping({"cpu": "rewrite", "inductor": {"max_autotune": False}})),
        SmxPass(SmxOptions.from_mapping({"cpu": "rewrite"}), skip=frozenset({"softmax"})),
    ]
    uuids = [p.uuid() for p in others]
    assert a.uuid() not in uuids
    assert len(set(uuids)) == len(uuids)
    # equivalent spellings of the same options give the same uuid
    assert SmxPass(SmxOptions.from_mapping({"softmax": False})).uuid() == \
        SmxPass(SmxOptions.from_mapping({"disable": ["softmax"]})).uuid()


def test_uuid_follows_the_source(monkeypatch):
    from smxcompile.passes import manager

    base = SmxPass(SmxOptions()).uuid()
    monkeypatch.setattr(manager, "source_hash", lambda: "0" * 64)
    assert SmxPass(SmxOptions()).uuid() != base


_CACHE_SCRIPT = """
    import json, sys
    import torch
    from torch._dynamo.utils import counters
    options = json.loads(sys.argv[1])
    def fn(x):
        return torch.softmax(x, -1) * 2.0 + 1.0
    x = torch.randn(4, 16384)  # long enough rows: the default CPU policy rewrites this softmax
    y = torch.compile(fn, backend="smx", options=options)(x)
    torch.testing.assert_close(y, fn(x))
    import smxcompile
    print(json.dumps({"hit": counters["inductor"]["fxgraph_cache_hit"],
                      "miss": counters["inductor"]["fxgraph_cache_miss"],
                      "aot_hit": counters["aot_autograd"]["autograd_cache_hit"],
                      "rewritten": smxcompile.last_report().count(action="rewritten")}))
"""


@pytest.mark.slow
def test_fx_graph_cache_hits_in_a_fresh_process_and_misses_on_new_options(tmp_path):
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor-cache"), "TORCHINDUCTOR_FX_GRAPH_CACHE": "1"}
    code = textwrap.dedent(_CACHE_SCRIPT)

    def run(options):
        r = subprocess.run([sys.executable, "-c", code, json.dumps(options)], capture_output=True, text=True,
                           env={**os.environ, **env}, timeout=240)
        assert r.returncode == 0, r.stderr[-4000:]
        return _last_json_line(r.stdout)

    first = run({})
    assert first["miss"] >= 1 and first["hit"] == 0, first
    assert first["rewritten"] == 1
    second = run({})
    assert second["hit"] >= 1 and second["miss"] == 0, second
    # cpu="rewrite" rewrites this plain softmax exactly like cpu="auto": the graph is the same, only
    # the pass uuid (which hashes the options) differs -- and that alone must miss the cache
    third = run({"cpu": "rewrite"})
    assert third["rewritten"] == 1
    assert third["hit"] == 0 and third["aot_hit"] == 0 and third["miss"] >= 1, third


# --------------------------------------------------------------------------- explain


def _with_break(x):
    a = torch.softmax(x, -1)
    torch._dynamo.graph_break()
    return a, torch.log_softmax(x * 2.0, 0)


class _BreakModule(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        h = F.softmax(self.lin(x), dim=-1)
        print("graph break")  # noqa: T201
        return F.log_softmax(h * 3.0, dim=-1)


def test_explain_function():
    rep = smxcompile.explain(_two_sites, torch.randn(3, 4), options=REWRITE)
    assert isinstance(rep, smxcompile.Report)
    assert [(s.kind, s.action, s.op) for s in rep] == [("softmax", "rewritten", "smx::softmax"),
                                                       ("log_softmax", "rewritten", "smx::log_softmax")]
    d = rep.to_dict()
    json.dumps(d)
    assert d["summary"] == {"softmax": {"rewritten": 1}, "log_softmax": {"rewritten": 1}}
    assert all(s["location"].startswith(__file__) for s in d["sites"])
    text = str(rep)
    assert "smx::softmax" in text and "backends/test_backend.py:" in text


def test_explain_default_options():
    rep = smxcompile.explain(lambda x: (torch.softmax(x, -1), torch.softmax(x / 2.0, -1)), torch.randn(3, 16384))
    assert [s.action for s in rep] == ["rewritten", "kept"]
    assert "cpu='rewrite' forces it" in rep.sites[1].reason
    with pytest.raises(ValueError, match="known options"):
        smxcompile.explain(_two_sites, torch.randn(3, 4), options={"nope": 1})


def test_explain_graph_break_function():
    torch._dynamo.reset()
    rep = smxcompile.explain(_with_break, torch.randn(3, 4), options=REWRITE)
    assert [(s.graph, s.kind) for s in rep] == [("g0", "softmax"), ("g1", "log_softmax")]
    assert any("graph breaks" in n for n in rep.notes)


def test_explain_graph_break_module(capsys):
    torch._dynamo.reset()
    rep = smxcompile.explain(_BreakModule(), torch.randn(2, 4), options=REWRITE)
    assert [(s.graph, s.kind, s.action) for s in rep] == [("g0", "softmax", "rewritten"),
                                                          ("g1", "log_softmax", "rewritten")]
    assert "scale=3" in rep.sites[1].detail
    assert any("2 graphs" in n for n in rep.notes)
    assert "graph break" in capsys.readouterr().out


def test_explain_nothing_found():
    rep = smxcompile.explain(lambda x: x.relu() + 1, torch.randn(3))
    assert len(rep) == 0
    assert "no softmax-shaped sites" in str(rep)


# --------------------------------------------------------------------------- the command line


def _smx_cmd() -> list[str]:
    exe = Path(sys.executable).parent / "smx"
    if exe.exists():
        return [str(exe)]
    found = shutil.which("smx")
    return [found] if found else [sys.executable, "-m", "smx_app.cli"]


@pytest.mark.slow
def test_cli_help():
    r = subprocess.run(_smx_cmd() + ["--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "explain" in r.stdout and "demo" in r.stdout


def test_cli_in_process(tmp_path, monkeypatch, capsys):
    from smx_app import cli

    with pytest.raises(SystemExit) as ei:
        cli.main(["explain", "--help"])
    assert ei.value.code == 0 and "module:factory" in capsys.readouterr().out
    assert cli.main([]) == 0  # no command: help
    (tmp_path / "my_bad_models.py").write_text("def build_bad():\n    return 3\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    capsys.readouterr()
    assert cli.main(["explain", "my_bad_models:nope"]) == 2
    assert "cannot load" in capsys.readouterr().err
    assert cli.main(["explain", "my_bad_models:build_bad"]) == 2
    assert "must return" in capsys.readouterr().err
    assert cli.main(["explain", "no_colon_here"]) == 2
    assert "module:factory" in capsys.readouterr().err


@pytest.mark.slow
def test_cli_explain_json_factory(tmp_path):
    (tmp_path / "my_models.py").write_text(textwrap.dedent("""
        import torch
        import torch.nn as nn
        import torch.nn.functional as F


        class Net(nn.Module):
            def forward(self, x, mask=None):
                p = F.softmax(x / 4.0 + mask, dim=-1)
                return torch.log_softmax(p @ x.transpose(-1, -2), -1)


        def build():
            return Net(), (torch.randn(2, 5, 5),), {"mask": torch.zeros(5, 5)}
    """))
    r = subprocess.run(_smx_cmd() + ["explain", "my_models:build", "--json", "--options", '{"cpu": "rewrite"}'],
                       capture_output=True, text=True, cwd=tmp_path, timeout=180)
    assert r.returncode == 0, r.stderr[-4000:]
    d = json.loads(r.stdout[r.stdout.index("{"):])
    kinds = [(s["kind"], s["action"]) for s in d["sites"]]
    assert kinds == [("softmax", "rewritten"), ("log_softmax", "rewritten")], d
    assert d["sites"][0]["location"].endswith("my_models.py:9")
    assert "mask" in d["sites"][0]["detail"]
    assert d["summary"] == {"softmax": {"rewritten": 1}, "log_softmax": {"rewritten": 1}}


# --------------------------------------------------------------------------- found by a new user's trial


class _BNSoftmax(nn.Module):
    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(8)

    def forward(self, x):
        return torch.softmax(self.bn(F.dropout(x, 0.5, training=True)), -1)  # dropout draws random numbers


def test_explain_leaves_buffers_and_rng_alone_and_survives_many_calls():
    model = _BNSoftmax()
    x = torch.randn(4, 8)
    torch.manual_seed(123)
    want_rng = torch.rand(3)
    torch.manual_seed(123)
    for _ in range(10):  # more than Dynamo's recompile limit (8): explain must not run out of it
        rep = smxcompile.explain(_BNSoftmax(), x, options=REWRITE)
        assert rep.summary() == {"softmax": {"rewritten": 1}}, str(rep)
    rep = smxcompile.explain(model, x, options=REWRITE)
    assert rep.count(action="rewritten") == 1
    assert model.bn.num_batches_tracked.item() == 0
    assert model.bn.running_mean.abs().sum().item() == 0.0
    assert torch.equal(torch.rand(3), want_rng)  # the global RNG did not advance


class _ScaledSoftmax(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.register_buffer("scale", torch.full((8,), 2.0))

    def forward(self, x):
        return torch.softmax(self.proj(x) * self.scale, -1)     # autograd saves ``scale`` for the backward


def test_explain_between_a_forward_and_its_backward():
    """Buffers explain's run does not write keep their version counters: a pending backward still runs."""
    model, x = _ScaledSoftmax(), torch.randn(4, 8)
    loss = model(x).pow(2).sum()
    assert smxcompile.explain(model, x, options=REWRITE).count(action="rewritten") == 1
    loss.backward()
    assert model.proj.weight.grad is not None


def test_explain_honours_check(monkeypatch):
    from smxcompile.kernels.softmax import ops as kernels

    real = kernels._forward_impl

    def wrong(x, dim, scale, softcap, mask, dtype, return_lse, log):
        y, lse = real(x, dim, scale, softcap, mask, dtype, return_lse, log)
        return y + 0.25, lse

    monkeypatch.setattr(kernels, "_forward_impl", wrong)
    rep = smxcompile.explain(lambda x: torch.softmax(x, -1), torch.randn(3, 5), options={"check": True, **REWRITE})
    assert [(s.action, s.reason[:12]) for s in rep] == [("kept", "check failed")]


def test_softmax_inside_activation_checkpoint_is_listed_and_rewritten():
    import torch.utils.checkpoint as cp

    def f(x):
        return cp.checkpoint(lambda t: torch.softmax(t * 2.0, -1).sum(), x, use_reentrant=False)

    x = torch.randn(3, 40, requires_grad=True)
    rep = smxcompile.explain(f, x, options=REWRITE)
    assert [(s.kind, s.action) for s in rep] == [("softmax", "rewritten")]
    assert rep.sites[0].node.endswith("/softmax")  # keyed by its subgraph
    torch._dynamo.reset()
    before = _n_reports()
    y = torch.compile(f, backend="smx", options=REWRITE)(x)
    (g,) = torch.autograd.grad(y, x)
    (rep,) = _new_reports(before)
    assert rep.count(action="rewritten") == 1
    x2 = x.detach().requires_grad_()
    (g_ref,) = torch.autograd.grad(f(x2), x2)
    torch.testing.assert_close(g, g_ref)


def test_torch_func_transforms_are_skipped_not_crashed():
    def loss(x):
        return torch.log_softmax(x, -1).sum()

    x = torch.randn(2, 3, 20)
    torch._dynamo.reset()
    before = _n_reports()
    got = torch.compile(torch.vmap(torch.func.grad(loss)), backend="smx", options=REWRITE)(x)
    torch.testing.assert_close(got, torch.vmap(torch.func.grad(loss))(x))
    reps = _new_reports(before)
    sites = [s for r in reps for s in r]
    assert sites and all(s.action == "skipped" and "torch.func transform" in s.reason for s in sites)


@pytest.mark.parametrize("options,match", [
    ({"attention": "false"}, "'attention' must be True or False"),
    ({"check": 1}, "'check' must be True or False"),
    ({"check_rtol": -1}, "'check_rtol' must be a finite number"),
    ({"check_atol": float("nan")}, "'check_atol' must be a finite number"),
    ({"disable": "softmax"}, "'disable' must be a list"),
])
def test_option_values_are_validated(options, match):
    with pytest.raises(ValueError, match=match):
        SmxOptions.from_mapping(options)


@pytest.mark.parametrize("kwargs,exc,match", [
    ({"dim": None}, TypeError, "dim must be an int"),
    ({"dim": (0, 1)}, TypeError, "dim must be an int"),
    ({"mask": [[0.0]]}, TypeError, "mask must be a Tensor"),
    ({"mask": torch.zeros(5, dtype=torch.int64)}, TypeError, "mask must be a floating-point"),
    ({"scale": "2"}, TypeError, "scale must be a real number"),
    ({"softcap": 0.0}, ValueError, "softcap must be > 0"),
])
def test_public_op_argument_errors(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        smxcompile.softmax(torch.randn(3, 5), **{"dim": -1, **kwargs})


def test_public_op_int_input_with_dtype_follows_torch():
    x = torch.arange(6).reshape(2, 3)
    torch.testing.assert_close(smxcompile.softmax(x, -1, dtype=torch.float32), torch.softmax(x, -1, dtype=torch.float32))
    with pytest.raises(TypeError, match="floating-point tensor"):
        smxcompile.softmax(x, -1)


@pytest.mark.parametrize("argv,msg", [
    (["explain", ":build"], "expected 'module:factory'"),
    (["explain", "os:sep"], "is not callable"),
    (["explain", "json:dumps"], "the factory must take no arguments"),
    (["explain", "--options", "notjson", "json:loads"], "failed"),
])
def test_cli_errors_are_messages_not_tracebacks(argv, msg, capsys):
    from smx_app import cli

    assert cli.main(argv) == 2
    assert msg in capsys.readouterr().err


def test_location_is_the_users_line_not_a_forwarding_library():
    """``einops.einsum`` calls torch for the user: the site is where the user called it."""
    from smxcompile.report import user_location

    trace = ('  File "/home/u/model.py", line 12, in forward\n    x = einsum(q, k, "b i d, b j d -> b i j")\n'
             '  File "/venv/lib/site-packages/einops/_backends.py", line 291, in einsum\n    return torch.einsum(*a)\n')
    assert user_location(trace) == "/home/u/model.py:12"
