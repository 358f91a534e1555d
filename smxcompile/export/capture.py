"""The capture shared by ONNX and MLIR export: the model traced by Dynamo as one graph, rewritten by smxcompile's
passes in export mode (the sites call the smx ops themselves), and wrapped so that its parameters and buffers
are attributes again: an ``nn.Module`` for ``torch.export``. Design: docs/DESIGN.md, 'Deployment export (ONNX,
MLIR)'."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any, Iterable

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from ..options import SmxOptions
from ..report import Report
from . import ExportError
from .inputs import check_ranges, mark_dynamic, range_bound


#: Backend options of an export unless given: every fusion kept, whatever the CPU / CUDA speed policy is.
DEFAULT_OPTIONS = {"cpu": "rewrite", "cuda": "rewrite"}


def export_options(options: dict | None, rewrites: str | Iterable[str]) -> dict:
    """A dict for ``SmxOptions.from_mapping``: ``options`` (mapping, ``SmxOptions`` or None) over
    :data:`DEFAULT_OPTIONS`, the kinds outside ``rewrites`` (``"all"``, a kind or several) disabled.
    Raises ExportError for an unknown rewrite kind."""
    from ..options import REWRITE_KINDS

    if isinstance(options, SmxOptions):
        given = dataclasses.asdict(options) | {"disable": sorted(options.disable), "inductor": dict(options.inductor)}
    else:
        given = dict(options or {})
    opts = {**DEFAULT_OPTIONS, **given}
    if isinstance(rewrites, str) and rewrites == "all":
        return opts
    if isinstance(rewrites, str):
        rewrites = [rewrites]
    rewrites = list(rewrites)
    bad = sorted(k for k in rewrites if k not in REWRITE_KINDS)
    if bad:
        raise ExportError(f"rewrites: unknown rewrite kind(s) {bad}; known: {list(REWRITE_KINDS)} (or 'all')")
    opts["disable"] = sorted(set(opts.get("disable", ())) | (set(REWRITE_KINDS) - set(rewrites)))
    return opts


def rewrite_kind(opname: str) -> str:
    """The rewrite kind that emits op ``smx::<opname>`` (``linear_ce_stats`` -> ``"linear_cross_entropy"``): what
    an export's error names to disable."""
    from ..options import REWRITE_KINDS

    if opname in REWRITE_KINDS:
        return opname
    if opname.startswith("linear_"):    # linear_ce_stats / linear_ce_loss / ...: emitted by cut CE sites
        return "linear_cross_entropy"
    base = opname.removesuffix("_backward")
    return base if base in REWRITE_KINDS else "cross_entropy"


class _Rewritten(nn.Module):
    """The rewritten Dynamo graph with the model's parameters and buffers as attributes again. ``slots[i]``: the
    graph's i-th input, ``("state", name)``, ``("input", leaf index)`` or ``("size", leaf index, dim)``."""

    def __init__(self, model: nn.Module, gm: torch.fx.GraphModule, slots: list[tuple]):
        super().__init__()
        self.model, self.gm, self.slots = model, gm, slots

    def forward(self, *leaves):
        state = dict(self.model.named_parameters()) | dict(self.model.named_buffers())
        vals = [state[s[1]] if s[0] == "state" else leaves[s[1]] if s[0] == "input" else leaves[s[1]].shape[s[2]]
                for s in self.slots]
        out = self.gm(*vals)
        return out[0] if isinstance(out, (tuple, list)) and len(out) == 1 else tuple(out)


def _dynamo_reason(e: BaseException) -> str:
    """Dynamo's message in one line: headline, the exception it observed or its explanation, the user's line."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    if not lines:
        return type(e).__name__
    parts = [lines[0][:300]]
    detail = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("Developer debug context:")), None) \
        or next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("Explanation:")), None)
    if detail and detail not in parts[0]:
        parts.append(detail[:300])
    files = [re.search(r'File "([^"]+)", line (\d+)', ln) for ln in lines]
    files = [m for m in files if m]
    if files:
        parts.append(f"at {Path(files[-1].group(1)).name}:{files[-1].group(2)}")
    return "; ".join(parts)


def logging_functions() -> set:
    """Logger methods Dynamo may skip while capturing (a log call, e.g. transformers' ``warning_once``, is a graph
    break otherwise), for ``torch._dynamo.config.patch(ignore_logging_functions=...)``."""
    import logging

    fns = {logging.Logger.debug, logging.Logger.info, logging.Logger.warning, logging.Logger.error}
    fns.update(f for f in (getattr(logging.Logger, "warning_once", None), getattr(logging.Logger, "info_once", None))
               if f is not None)
    return fns


def capture(model: nn.Module, args: tuple, kwargs: dict | None = None, options: dict | None = None,
            dynamic_shapes: Any = None) -> tuple[nn.Module, Report]:
    """``(module, report)``: ``module(*leaves)`` (the tensors of ``(args, kwargs)`` in pytree order) computes the
    model rewritten by smxcompile's passes with ``options`` (over :data:`DEFAULT_OPTIONS`; an ``SmxOptions`` as
    it is); ``report`` is the rewrite report. Non-tensor arguments are fixed as they were for this call.

    Raises:
        ExportError: a graph break (Dynamo's reason), a graph input from outside the model's arguments, a bad
            ``dynamic_shapes``, or the model failing on the example.
    """
    from ..passes import SmxPass

    kwargs = kwargs or {}
    opts = SmxOptions.from_mapping(options if isinstance(options, SmxOptions) else {**DEFAULT_OPTIONS, **(options or {})})
    store: dict[str, Any] = {}

    def backend(gm: torch.fx.GraphModule, example_inputs):
        # the inputs' sources first: Dynamo drops the placeholders' "grapharg" once the backend returns
        sources = []
        for n, ex in zip([n for n in gm.graph.nodes if n.op == "placeholder"], example_inputs):
            src = getattr(n.meta.get("grapharg"), "source", None)
            sources.append((n.name, src.name if src is not None else None, ex))
        ranges = {}
        ctx = torch._guards.TracingContext.try_get()
        shape_env = getattr(getattr(ctx, "fake_mode", None), "shape_env", None)
        if shape_env is not None:
            for n, ex in zip([n for n in gm.graph.nodes if n.op == "placeholder"], example_inputs):
                fake = n.meta.get("example_value")
                if isinstance(ex, torch.Tensor) and isinstance(fake, torch.Tensor):
                    for d, size in enumerate(fake.shape):
                        if isinstance(size, torch.SymInt) and size.node.expr.is_symbol:
                            r = shape_env.var_to_range.get(size.node.expr)
                            if r is not None:
                                ranges[(id(ex), d)] = (range_bound(r.lower), range_bound(r.upper))
        smx_pass = SmxPass(opts, "g0", export=True)
        smx_pass(gm.graph)
        gm.recompile()
        store.update(gm=gm, report=smx_pass.report, sources=sources, ranges=ranges)
        return gm.forward

    torch._dynamo.reset()
    marked: list = []
    try:
        if dynamic_shapes is not None:
            mark_dynamic(model, args, kwargs, dynamic_shapes, marked)
        with torch.no_grad(), torch._dynamo.config.patch(ignore_logging_functions=logging_functions()):
            torch.compile(model, backend=backend, fullgraph=True,
                          dynamic=None if dynamic_shapes is not None else False)(*args, **kwargs)
    except torch.fx.experimental.symbolic_shapes.ConstraintViolationError as e:
        raise ExportError("a dim asked to be dynamic cannot be (the model fixes or constrains its size): "
                          f"{str(e).splitlines()[0][:400]}") from e
    except (torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError) as e:
        raise ExportError(f"the model does not trace as one graph (a graph break): {_dynamo_reason(e)}") from e
    except ExportError:
        raise
    except Exception as e:  # noqa: BLE001 - the model itself failing on the example (empty batch, wrong dtype...)
        raise ExportError(f"the model fails on the example inputs while Dynamo traces it: {type(e).__name__}: "
                          f"{_dynamo_reason(e)}") from e
    finally:
        torch._dynamo.reset()
        for _, t, _, _ in marked:           # leave the caller's tensors as they were (every mark_dynamic attribute)
            for attr in ("_dynamo_dynamic_indices", "_dynamo_dynamic_range", "_has_dynamo_dim_marking",
                         "_specialize_on", "_dynamo_hint_overrides"):
                if attr in vars(t):
                    delattr(t, attr)
    if "gm" in store:
        check_ranges(marked, store.get("ranges", {}))
    if "gm" not in store:
        raise ExportError("Dynamo produced no graph for the model (nothing to export)")
    names = {id(t): n for n, t in model.named_parameters()} | {id(t): n for n, t in model.named_buffers()}
    leaves = {id(t): i for i, t in enumerate(pytree.tree_leaves((args, kwargs))) if isinstance(t, torch.Tensor)}
    by_source = {str(src): leaves[id(ex)] for _, src, ex in store["sources"]
                 if isinstance(ex, torch.Tensor) and id(ex) in leaves}
    slots: list[tuple] = []
    for name, src, ex in store["sources"]:
        if isinstance(ex, torch.Tensor) and id(ex) in names:
            slots.append(("state", names[id(ex)]))
        elif isinstance(ex, torch.Tensor) and id(ex) in leaves:
            slots.append(("input", leaves[id(ex)]))
        else:
            m = re.fullmatch(r"(.*)\.size\(\)\[(\d+)\]", str(src))
            if m and m.group(1) in by_source:
                slots.append(("size", by_source[m.group(1)], int(m.group(2))))
            else:
                raise ExportError(f"graph input {name} ({src}) is neither a parameter/buffer of the model, nor one "
                                  "of the example inputs, nor a size of one (a tensor created outside forward?)")
    return _Rewritten(model, store["gm"], slots), store["report"]


__all__ = ["DEFAULT_OPTIONS", "capture", "export_options", "logging_functions", "rewrite_kind"]
