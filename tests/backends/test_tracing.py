"""Logging calls do not split an smx trace (smxcompile.backends.tracing), and nothing leaks to other backends.

The case that matters: a stock transformers ``GPT2LMHeadModel`` (``loss_type`` unset, so its forward calls
``logger.warning_once``) trained with ``labels`` gets cut cross-entropy, with and without
``num_items_in_batch`` (what ``Trainer`` passes)."""

from __future__ import annotations

import logging

import pytest
import torch

import smxcompile
from smxcompile.backends import tracing
from smxcompile.backends.smx import compiled_reports

log = logging.getLogger("smx-test-tracing")


def _logs_between(x):
    y = torch.softmax(x, -1) * 2
    log.warning("between two halves of the graph")
    return torch.log_softmax(y, -1).sum()


def _graph_count(backend_name: str, fn, *args) -> int:
    """Graphs Dynamo hands a backend for ``fn``: counted by wrapping the named backend."""
    from torch._dynamo.backends.registry import lookup_backend

    inner = lookup_backend(backend_name)
    graphs = []

    def counting(gm, example_inputs, **kw):
        graphs.append(gm)
        return inner(gm, example_inputs, **kw)

    torch._dynamo.reset()
    torch.compile(fn, backend=counting)(*args)
    return len(graphs)


def test_logging_is_no_graph_break_for_smx_only():
    x = torch.randn(4, 8)
    torch._dynamo.reset()
    n0 = len(compiled_reports)
    out = torch.compile(_logs_between, backend="smx")(x)
    torch.testing.assert_close(out, _logs_between(x))
    assert len(compiled_reports) - n0 == 1          # one graph: the warning did not split it
    # any other backend still sees the logging call as a graph break (the setting did not leak)
    assert _graph_count("eager", _logs_between, x) == 2


def test_ignore_set_is_restored_and_user_entries_kept():
    def mine(*a, **k):
        pass

    ignore = torch._dynamo.config.ignore_logging_functions
    ignore.add(mine)
    try:
        before = set(ignore)
        with tracing.ignore_logging():
            with tracing.ignore_logging():            # re-entrant (a compiled function calling another)
                assert logging.Logger.warning in torch._dynamo.config.ignore_logging_functions
            assert logging.Logger.warning in torch._dynamo.config.ignore_logging_functions
        assert set(torch._dynamo.config.ignore_logging_functions) == before
        torch._dynamo.reset()
        torch.compile(_logs_between, backend="smx")(torch.randn(2, 3))
        assert set(torch._dynamo.config.ignore_logging_functions) == before
    finally:
        ignore.discard(mine)


@pytest.mark.parametrize("num_items", [None, 50], ids=["mean", "num_items_in_batch"])
def test_stock_gpt2_with_labels_gets_cut_cross_entropy(num_items):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=8192, n_positions=32, n_embd=32, n_layer=1, n_head=4, use_cache=False,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).train()
    assert getattr(model, "loss_type", None) is None     # stock: transformers warns inside forward
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    kw = {} if num_items is None else {"num_items_in_batch": torch.tensor(num_items)}

    torch._dynamo.reset()
    n0 = len(compiled_reports)
    out = torch.compile(model, backend="smx")(input_ids=ids, labels=ids, **kw)
    out.loss.backward()
    got_grad = model.lm_head.weight.grad.clone()
    model.zero_grad()
    ref = model(input_ids=ids, labels=ids, **kw)
    ref.loss.backward()

    sites = [s for r in compiled_reports[n0:] for s in r]
    assert [(s.kind, s.action) for s in sites if s.kind.endswith("cross_entropy")] == \
        [("linear_cross_entropy", "rewritten")], smxcompile.last_report()
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_grad, model.lm_head.weight.grad, rtol=1e-4, atol=1e-6)


def test_explain_traces_like_the_backend():
    """``smxcompile.explain`` sees the stock model's loss in the LM head's graph, as the backend does."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=8192, n_positions=32, n_embd=32, n_layer=1, n_head=4, use_cache=False,
                                  bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    report = smxcompile.explain(model, input_ids=ids, labels=ids)
    assert [s.action for s in report if s.kind == "linear_cross_entropy"] == ["rewritten"], report
    assert not any("graphs" in n for n in report.notes), report.notes
