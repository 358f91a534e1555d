"""``smxcompile.explain``: what the ``smx`` backend would do to a model, without compiling it."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from .options import SmxOptions
from .report import Report


def explain(model: Any, *args: Any, options: dict | None = None, **kwargs: Any) -> Report:
    """Trace ``model(*args, **kwargs)`` the way the ``smx`` backend does and list every candidate site.

    The model runs once through Dynamo, as ``torch.compile`` would run it — with gradients for a module in
    training mode or a function (the CPU policy decides some sites differently in training and in inference),
    under ``torch.no_grad`` for a module in eval mode or when the caller is in ``no_grad`` — but nothing is
    compiled, and the model's buffers (e.g. BatchNorm statistics) and the
    random-number generators are restored afterwards, so calling ``explain`` before training
    changes nothing. Like ``torch._dynamo.explain`` it resets Dynamo first: functions compiled
    earlier recompile on their next call.

    Args:
        model: an ``nn.Module`` or a function.
        *args, **kwargs: example inputs for one forward call (tensors of the real shapes,
            dtypes and device: the decisions depend on them).
        options: the backend options (same dict as ``torch.compile(..., options=...)``), including
            ``check``. Keyword-only: a model argument named ``options`` cannot be passed through.

    Returns:
        A :class:`smxcompile.Report`: one :class:`smxcompile.report.Site` per candidate with
        ``kind``, ``action`` (rewritten / kept / skipped), ``reason``, ``location`` and ``op``.
        Graph breaks give several graphs (``g0``, ``g1``... in the report).

    Raises:
        ValueError: unknown options. Errors raised by the model itself propagate.
    """
    from .backends.smx import plan
    from .backends.tracing import ignore_logging

    opts = SmxOptions.from_mapping(options)
    report = Report()
    count = [0]

    def collect(gm: torch.fx.GraphModule, example_inputs):
        sub, _ = plan(gm, example_inputs, opts, f"g{count[0]}")
        count[0] += 1
        report.extend(sub)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=collect, dynamic=False)
    try:
        # traced as the backend traces: logging calls are no graph breaks (smxcompile.backends.tracing)
        grad = torch.is_grad_enabled() and (model.training if isinstance(model, torch.nn.Module) else True)
        with torch.set_grad_enabled(grad), restore_state(model), ignore_logging():
            compiled(*args, **kwargs)
    finally:
        torch._dynamo.reset()  # explain's own cache entries must not count against the user's recompile limit
    if count[0] == 0:
        report.notes.append("Dynamo produced no graph (nothing to compile, or the call was skipped)")
    elif count[0] > 1:
        report.notes.append(f"{count[0]} graphs: Dynamo split the model at graph breaks")
    return report


@contextlib.contextmanager
def restore_state(model: Any) -> Iterator[None]:
    """A context in which ``model`` may run once without leaving a trace: on exit its buffers (BatchNorm
    statistics...) hold their values from before, and the CPU and CUDA random-number generators their states.
    Buffers the run left unchanged are not touched (a pending backward still finds them unchanged); buffers
    whose shape changed are left as they are. Raises nothing of its own."""
    buffers = []
    if isinstance(model, torch.nn.Module):
        buffers = [(b, b.detach().clone()) for b in model.buffers()]
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            with torch.no_grad():
                for b, saved in buffers:
                    # only buffers the run changed (compiled code writes without bumping the version): a
                    # copy bumps the version counter a pending backward checks
                    if b.shape == saved.shape and not _same(b, saved):
                        b.copy_(saved)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN equal to NaN (a NaN buffer is not changed by reading it)."""
    return torch.equal(a, b) or (a.is_floating_point() and bool(((a == b) | (a.isnan() & b.isnan())).all()))
