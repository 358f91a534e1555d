"""``smxcompile.explain``: what the ``smx`` backend would do to a model, without compiling it."""

from __future__ import annotations

from typing import Any

import torch

from .options import SmxOptions
from .passes import analyze
from .report import Report


def explain(model: Any, *args: Any, options: dict | None = None, **kwargs: Any) -> Report:
    """Trace ``model(*args, **kwargs)`` the way the ``smx`` backend does and list every candidate site.

    Args:
        model: an ``nn.Module`` or a function.
        *args, **kwargs: example inputs for one forward call (tensors of the real shapes,
            dtypes and device: the decisions depend on them).
        options: the backend options (same dict as ``torch.compile(..., options=...)``).

    Returns:
        A :class:`smxcompile.Report`: one :class:`smxcompile.report.Site` per candidate with
        ``kind``, ``action`` (rewritten / kept / skipped), ``reason``, ``location`` and ``op``.
        Graph breaks give several graphs (``g0``, ``g1``... in the report).

    Raises:
        ValueError: unknown options. Errors raised by the model itself propagate.
    """
    opts = SmxOptions.from_mapping(options)
    report = Report()
    count = [0]

    def collect(gm: torch.fx.GraphModule, example_inputs):
        sub = analyze(gm.graph, opts, f"g{count[0]}")
        count[0] += 1
        report.extend(sub)
        return gm.forward

    compiled = torch.compile(model, backend=collect, dynamic=False)
    with torch.no_grad():
        compiled(*args, **kwargs)
    if count[0] == 0:
        report.notes.append("Dynamo produced no graph (nothing to compile, or the call was skipped)")
    elif count[0] > 1:
        report.notes.append(f"{count[0]} graphs: Dynamo split the model at graph breaks")
    return report
