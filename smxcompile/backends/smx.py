"""The ``smx`` torch.compile backend.

``torch.compile(model, backend="smx", options={...})`` hands each Dynamo graph to Inductor's
``compile_fx`` with :class:`~smxcompile.passes.SmxPass` installed in the ``pre_grad_custom_pass``
slot, so everything the passes do not rewrite is compiled by Inductor exactly as with
``backend="inductor"``. The backend is registered through the ``torch_dynamo_backends``
entry point (see pyproject.toml).
"""

from __future__ import annotations

import itertools
import logging
from typing import Any, Sequence

import torch

from ..options import SmxOptions
from ..passes import SmxPass, analyze
from ..report import Report
from . import tracing

log = logging.getLogger("smxcompile")

_graph_ids = itertools.count()

#: Reports of the graphs compiled in this process, newest last (``smxcompile.last_report()``).
compiled_reports: list[Report] = []


def smx_backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], options: dict | None = None, **kwargs):
    """Compile one Dynamo graph: smxcompile's passes, then Inductor.

    Args:
        gm: the Dynamo FX graph (torch-level ops).
        example_inputs: the graph's example inputs (real tensors from Dynamo, or fakes).
        options: the dict given to ``torch.compile(..., options=...)``; see
            :class:`smxcompile.options.SmxOptions`. Unknown keys raise ``ValueError``.

    Returns:
        The compiled callable from ``torch._inductor.compile_fx.compile_fx``.
    """
    if kwargs.get("mode") not in (None, "default"):
        log.warning("smx: mode=%r is ignored; pass Inductor settings through options={'inductor': {...}}",
                    kwargs["mode"])
    opts = SmxOptions.from_mapping(options)
    tag = f"g{next(_graph_ids)}"
    planned, skip = plan(gm, example_inputs, opts, tag)
    compiled_reports.append(planned)
    _log_report(planned)
    smx_pass = SmxPass(opts, tag, skip)
    patches = dict(opts.inductor)
    patches["pre_grad_custom_pass"] = smx_pass
    from torch._inductor.compile_fx import compile_fx  # on use: Inductor's import costs ~1 s

    return compile_fx(gm, example_inputs, config_patches=patches)


# Logging calls in the compiled code are no-ops while an smx-compiled function runs, so a
# ``logger.warning_once`` between the LM head and the loss (transformers) does not split the graph.
smx_backend.backend_ctx_ctor = tracing.ignore_logging
tracing.install(smx_backend)


def plan(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], opts: SmxOptions, tag: str) -> tuple[Report, frozenset[str]]:
    """What the passes will do to ``gm``: the report, and the keys of sites the ``check`` option rejected."""
    skip: frozenset[str] = frozenset()
    planned = analyze(gm.graph, opts, tag)
    if opts.check and planned.count(action="rewritten"):
        from ..passes.check import check_sites

        # a site kept because its check failed can leave part of itself to a later pass (a softmax + top-k its
        # softmax, a cross-entropy its log-softmax): check again until no new site fails
        checked: frozenset[str] = frozenset()
        while True:
            bad = check_sites(gm, example_inputs, opts, skip, checked)
            checked = checked | frozenset(s.node for s in planned if s.action == "rewritten")
            if not bad - skip:
                break
            skip = skip | bad
            planned = analyze(gm.graph, opts, tag, skip)
    dyn = _dynamic_note(example_inputs)
    if dyn:
        planned.notes.append(dyn)
    return planned, skip


def _dynamic_note(example_inputs: Sequence[Any]) -> str:
    for x in example_inputs:
        if isinstance(x, torch.SymInt) or (
            isinstance(x, torch.Tensor) and any(isinstance(s, torch.SymInt) for s in x.shape)
        ):
            return "dynamic shapes: sites are matched on symbolic shapes; masks are only absorbed when their broadcast is static"
    return ""


def _log_report(report: Report) -> None:
    if not log.isEnabledFor(logging.INFO):
        return
    for s in report:
        log.info("smx %s %s %s at %s%s", s.graph, s.kind, s.action, s.location,
                 f" ({s.reason})" if s.reason else f" -> {s.op} [{s.detail}]")
