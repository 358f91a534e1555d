"""What the pass tests share: the Dynamo graph of a function (what the ``smx`` backend receives), its code as
text for expected-graph tests (``expecttest``), and running :class:`smxcompile.passes.SmxPass` on it with the
rewritten graph checked against the original function."""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass

import torch
import torch.nn as nn

from smxcompile.options import SmxOptions
from smxcompile.passes import SmxPass
from smxcompile.report import Report

REWRITE = {"cpu": "rewrite"}


def dynamo_graph(fn, *args, with_inputs: bool = False):
    """The Dynamo (torch-level) FX graph of ``fn(*args)``: what the ``smx`` backend receives.

    With ``with_inputs``, also the graph's example inputs (lifted parameters included)."""
    captured: list = []

    def capture(gm, example_inputs):
        captured.append((gm, list(example_inputs)))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=capture, fullgraph=True, dynamic=False)(*args)
    assert len(captured) == 1
    return captured[0] if with_inputs else captured[0][0]


def graph_text(gm: torch.fx.GraphModule) -> str:
    """``gm.code`` without blank lines and without the ``; x = None`` liveness clean-ups."""
    lines = []
    for line in gm.code.splitlines():
        line = line.split(";  ")[0].rstrip()
        if line.strip():
            lines.append(line.strip())
    return "\n".join(lines)


@dataclass
class Rewrite:
    before: str
    after: str
    report: Report
    gm: torch.fx.GraphModule
    inputs: list | None = None     # the graph's example inputs, in its placeholder order

    @property
    def changed(self) -> bool:
        return self.before != self.after

    @property
    def site(self):
        assert len(self.report) == 1, str(self.report)
        return self.report.sites[0]


def _source(fn):
    return type(fn) if isinstance(fn, nn.Module) else fn


def source_lines(fn) -> range:
    """The lines of ``fn``'s source (its class for a module)."""
    lines, first = inspect.getsourcelines(_source(fn))
    return range(first, first + len(lines))


def rewrite(fn, *args, options=REWRITE, check_values: bool = True, atol: float = 1e-6, rtol: float | None = None,
            located=None) -> Rewrite:
    """Trace ``fn``, run SmxPass with ``options`` on its graph, check the result still computes ``fn``.

    Every site (of the kinds in ``located``, default all) must point at the user's line inside ``fn``. Values
    are compared with ``assert_close(atol, rtol)`` (``rtol`` default: 1e-3 for half types, 1e-5 otherwise)."""
    gm, example_inputs = dynamo_graph(fn, *args, with_inputs=True)
    before = graph_text(gm)
    smx_pass = SmxPass(SmxOptions.from_mapping(options))
    smx_pass(gm.graph)
    gm.recompile()
    after = graph_text(gm)
    for s in smx_pass.report:
        if located is not None and s.kind not in located:
            continue
        path, _, line = s.location.rpartition(":")
        assert os.path.abspath(path) == os.path.abspath(inspect.getsourcefile(_source(fn))), s.location
        assert int(line) in source_lines(fn), (s.location, source_lines(fn))
    if check_values:
        torch.manual_seed(0)
        with torch.no_grad():
            want = fn(*args)
            got = gm(*example_inputs)
        want = want if isinstance(want, tuple) else (want,)
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert g.dtype == w.dtype and g.shape == w.shape, (g.shape, w.shape)
            tol = rtol if rtol is not None else 1e-3 if w.dtype in (torch.float16, torch.bfloat16) else 1e-5
            torch.testing.assert_close(g, w, atol=atol, rtol=tol, equal_nan=True)
    return Rewrite(before, after, smx_pass.report, gm, example_inputs)


def first_output(out):
    return out[0] if isinstance(out, tuple) else out


def _grads(fn, args, weight):
    """Output and input gradients; float inputs that are finite (q, k, v, masks, biases) get gradients."""
    ins = [a.detach().clone().requires_grad_(a.is_floating_point() and bool(a.isfinite().all())) for a in args]
    out = first_output(fn(*ins))
    (out.double() * weight).sum().backward()
    return out.detach(), [i.grad if i.grad is not None else torch.zeros_like(i) for i in ins if i.requires_grad]


def check_against_gold(r: Rewrite, fn, args, weight, *, tol: float) -> None:
    """The rewritten graph's forward and input gradients (of ``sum(out * weight)``) satisfy
    ``|ours - gold| <= |torch - gold| + tol * (1 + |gold|)`` per element, gold being ``fn`` in fp64."""
    # the graph's placeholders are in Dynamo's order (first use), not the function's
    order = [next(i for i, a in enumerate(args) if a is x) for x in r.inputs]
    got, g_got = _grads(lambda *a: r.gm(*[a[i] for i in order]), args, weight)
    ref, g_ref = _grads(fn, args, weight)
    gold, g_gold = _grads(fn, [a.double() if a.is_floating_point() else a for a in args], weight)
    for ours, torch_, gold_ in zip([got, *g_got], [ref, *g_ref], [gold, *g_gold]):
        err_ours = (ours.double() - gold_).abs()
        err_torch = (torch_.double() - gold_).abs()
        assert bool((err_ours <= err_torch + tol * (1 + gold_.abs())).all()), (err_ours - err_torch).max()
