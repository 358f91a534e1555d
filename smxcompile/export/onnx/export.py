"""ONNX export of the *rewritten* model: ``smxcompile.export_onnx``.

How. The model is captured by Dynamo as one graph (``fullgraph=True``; static, or with the requested
dims dynamic), smxcompile's passes rewrite it exactly as the ``smx`` backend does (so the deployed
graph keeps the fusions), and the rewritten ``GraphModule`` -- wrapped so that the model's parameters
and buffers are attributes again, not graph inputs -- goes through ``torch.export`` to
``torch.onnx.export(..., dynamo=True)`` with a ``custom_translation_table`` mapping each
smxcompile op to ONNX (onnxscript). Then the file is checked: ``onnx.checker``, loaded by the installed
onnxruntime, and run on the example inputs (and more shapes) against eager PyTorch.

The translations live in one module per op family (:data:`TRANSLATION_MODULES`), each written for an
:class:`~smxcompile.backends.onnx_target.OnnxTarget` (``target="onnxruntime"`` or ``"portable"``, the
opset and the form of attention):

- :mod:`.onnx_softmax`: ``smx::softmax`` / ``log_softmax`` (with their fused prologue),
  ``smx::softmax_topk``, ``smx::quant_softmax``.
- :mod:`.onnx_attention`: ``aten.scaled_dot_product_attention`` (softmax attention sites) as the ONNX
  ``Attention`` op, com.microsoft ``MultiHeadAttention`` or MatMul / Softmax / MatMul with torch's
  semantics, and ``smx::attention`` with every normalizer.
- :mod:`.onnx_ce`: ``smx::ce_stats`` and ``smx::linear_ce_stats`` (cut cross-entropy's statistics).

Variants swapped in by :func:`smxcompile.swap` export as their torch code. An smxcompile op no module
translates raises :class:`OnnxExportError` naming it and the option that exports the site unrewritten.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
import re
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from ..options import SmxOptions
from ..report import Report
from .onnx_target import OnnxTarget, OnnxTargetError
from .onnx_target import resolve as resolve_target


#: Backend options of an export unless given: every fusion kept, whatever Inductor's CPU policy is.
DEFAULT_OPTIONS = {"cpu": "rewrite"}


class OnnxExportError(RuntimeError):
    """An export that cannot be done or that failed its check; the message names the op and the reason."""


@dataclasses.dataclass
class OnnxBaseline:
    """The plain ``torch.onnx.export`` of the same model (``export_onnx(..., compare=True)``).

    Attributes:
        op_types: ``{ONNX op type: count}`` of the plain file (empty when it failed).
        latency_ms: its onnxruntime CPU latency (ms per call, median of rounds; None when it failed).
        error: why the plain export or its run failed (None when it worked).
        dynamic: whether it has the same dynamic dims as the smxcompile file (False: static, torch.onnx could not
            export the model with them; a static file has fewer shape ops, so the comparison favours it).
    """

    op_types: dict[str, int]
    latency_ms: float | None = None
    error: str | None = None
    dynamic: bool = False


@dataclasses.dataclass
class OnnxExport:
    """What :func:`export_onnx` wrote and checked; ``print()`` it for the report.

    Attributes:
        path: the ``.onnx`` file. report: the rewrite report of the exported graph.
        op_types: ``{ONNX op type: count}`` of the exported graph.
        max_abs_diff: largest ``|onnxruntime - eager|`` over the outputs on the example inputs
            (NaN when ``check=False``).
        opset: the ONNX opset of the file. target: what the file was written for (runtime, attention form).
        exported: how each smxcompile op (and ``aten::scaled_dot_product_attention``, the form of fused
            softmax attention) reached the file: ``{"smx::softmax_topk": {"calls": 1, "onnx": {"TopK": 1, ...}}}``,
            read from the exporter's node metadata after onnxscript's optimizer.
        latency_ms: onnxruntime CPU latency of the file on the example inputs (ms per call; ``compare=True``).
        baseline: the plain ``torch.onnx.export`` of the model, its op types and latency (``compare=True``).
        checked_shapes: the input shapes the check ran onnxruntime against eager on (the example, ``check_inputs``
            and, with ``dynamic_shapes``, the example narrowed by one along every dynamic dim).
        dynamic: whether the file has dynamic dims (``dynamic_shapes`` given).
    """

    path: Path
    report: Report
    op_types: dict[str, int]
    max_abs_diff: float
    opset: int
    target: OnnxTarget | None = None
    exported: dict[str, dict] = dataclasses.field(default_factory=dict)
    latency_ms: float | None = None
    baseline: OnnxBaseline | None = None
    checked_shapes: list = dataclasses.field(default_factory=list)
    dynamic: bool = False

    def summary(self) -> str:
        """The report as text: rewrites, how each smxcompile op was exported, op types (before/after with
        ``compare=True``) and the latency side by side."""
        t = self.target
        lines = [str(self.report), "",
                 f"wrote {self.path} (opset {self.opset}" + (f", target {t.name}" if t else "")
                 + (f", attention as {t.attention}" if t and any("attention" in k for k in self.exported) else "")
                 + ")" + ("" if math.isnan(self.max_abs_diff) else f"; onnxruntime vs eager max |diff| {self.max_abs_diff:.3g} "
                         f"on input shapes {', '.join(str(list(s)) for s in self.checked_shapes)}")]
        if self.exported:
            lines.append("exported as:")
            for name, e in self.exported.items():
                ops = ", ".join(f"{k} {v}" for k, v in sorted(e["onnx"].items()))
                what = " (what fused softmax attention sites call)" if name.startswith("aten::") else ""
                lines.append(f"  {name}{what} x{e['calls']} -> {ops}")
        b = self.baseline
        if b is None:
            lines.append("ONNX op types: " + ", ".join(f"{k} {v}" for k, v in sorted(self.op_types.items())))
        else:
            lines.append("ONNX op types (plain torch.onnx.export" + (", static shapes (it could not export the dynamic "
                         "dims)" if self.dynamic and not b.dynamic else "") + " -> smxcompile export):")
            for k in sorted(set(b.op_types) | set(self.op_types)):
                before, after = b.op_types.get(k, 0), self.op_types.get(k, 0)
                if b.error or before != after:
                    lines.append(f"  {k:<24} {before if not b.error else '-':>5} -> {after}")
            lines.append(f"  {'nodes':<24} {sum(b.op_types.values()) if not b.error else '-':>5} -> "
                         f"{sum(self.op_types.values())} (op types with equal counts not listed)")
            if b.error:
                lines.append(f"plain export failed: {b.error}")
            elif b.latency_ms is not None and self.latency_ms is not None:
                lines.append(f"onnxruntime CPU latency: plain {b.latency_ms:.3f} ms, smxcompile {self.latency_ms:.3f} ms "
                             f"({self.latency_ms / b.latency_ms:.2f}x)")
        return "\n".join(lines)

    __str__ = summary

    def to_dict(self) -> dict:
        """The export as JSON-ready data."""
        return {"path": str(self.path), "opset": self.opset, "target": dataclasses.asdict(self.target) if self.target else None,
                "max_abs_diff": None if math.isnan(self.max_abs_diff) else self.max_abs_diff, "op_types": self.op_types,
                "exported": self.exported, "latency_ms": self.latency_ms,
                "baseline": dataclasses.asdict(self.baseline) if self.baseline else None,
                "checked_shapes": [[list(t) for t in s] for s in self.checked_shapes],
                "report": self.report.to_dict()}


# --------------------------------------------------------------------------- translations

#: The modules whose ``translations(target)`` make up the ``custom_translation_table`` and whose
#: ``refuse(name, args, node)`` says why a call cannot be translated (see :mod:`.onnx_softmax`).
TRANSLATION_MODULES = ("onnx_softmax", "onnx_ce", "onnx_attention")


def _modules() -> list:
    import importlib

    return [importlib.import_module(f"{__package__}.{m}") for m in TRANSLATION_MODULES]


def _translations(target=None) -> dict[Any, Any]:
    table: dict[Any, Any] = {}
    for m in _modules():
        table.update(m.translations(target))
    return table


def _check_graph(gm: torch.fx.GraphModule, table: dict) -> None:
    """Refuse smxcompile ops (or options of them) that ``table`` (the translations) does not cover."""
    translated = {op._opname for op in table}
    modules = _modules()
    for n in gm.graph.nodes:
        if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload):
            continue
        sdpa = n.target is torch.ops.aten.scaled_dot_product_attention.default
        if not sdpa and n.target.namespace != "smx":
            continue
        args = dict(zip([a.name for a in n.target._schema.arguments], n.args)) | dict(n.kwargs)
        if (sdpa or n.target._opname == "attention") and args.get("dropout_p", 0.0):
            raise OnnxExportError(f"{n.target._opname} (node {n.name}) with dropout_p={args['dropout_p']}: attention "
                                  "dropout (training mode) has no exact ONNX form; export the model in eval mode "
                                  "(model.eval())")
        if sdpa:
            continue
        name = n.target._opname
        if name not in translated:
            raise OnnxExportError(f"smx::{name} (node {n.name}) has no ONNX translation yet; pass "
                                  f"options={{'cpu': 'rewrite', 'disable': ['{_kind_of(name)}']}} to export that site "
                                  "unrewritten")
        for m in modules:
            why = m.refuse(name, args, n)
            if why:
                raise OnnxExportError(f"smx::{name} (node {n.name}) {why}")


def _kind_of(opname: str) -> str:
    """The rewrite kind (``options={"disable": [...]}``) that emits op ``smx::<opname>``."""
    from ..options import REWRITE_KINDS

    if opname in REWRITE_KINDS:
        return opname
    if opname.startswith("linear_"):    # linear_ce_stats / linear_ce_loss / ...: emitted by cut CE sites
        return "linear_cross_entropy"
    base = opname.removesuffix("_backward")
    return base if base in REWRITE_KINDS else "cross_entropy"


# --------------------------------------------------------------------------- capture


@contextlib.contextmanager
def _export_ops() -> Iterator[None]:
    """Rewritten sites call the smx ops (not their CPU decompositions) while the block runs."""
    from ..kernels import config

    old = config.export_ops
    config.export_ops = True
    try:
        yield
    finally:
        config.export_ops = old


class _Rewritten(nn.Module):
    """The rewritten Dynamo graph with the model's parameters and buffers as attributes again.

    ``slots[i]`` says where the graph's i-th input comes from: ``("state", name)`` a parameter or
    buffer of ``model``, ``("input", leaf)`` the ``leaf``-th tensor of the flattened ``(args, kwargs)``,
    ``("size", leaf, dim)`` a dynamic size of that tensor."""

    def __init__(self, model: nn.Module, gm: torch.fx.GraphModule, slots: list[tuple]):
        super().__init__()
        self.model, self.gm, self.slots = model, gm, slots

    def forward(self, *leaves):
        state = dict(self.model.named_parameters()) | dict(self.model.named_buffers())
        vals = [state[s[1]] if s[0] == "state" else leaves[s[1]] if s[0] == "input" else leaves[s[1]].shape[s[2]]
                for s in self.slots]
        out = self.gm(*vals)
        return out[0] if isinstance(out, (tuple, list)) and len(out) == 1 else tuple(out)


def _bind(model: nn.Module, args: tuple, kwargs: dict) -> dict[str, Any]:
    """``model.forward``'s locals for a call: its arguments by name, defaults included."""
    bound = inspect.signature(model.forward).bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def _mark_dynamic(model: nn.Module, args: tuple, kwargs: dict, dynamic_shapes: Any,
                  marked: list[tuple[str, torch.Tensor, int, Any]]) -> list[tuple[str, torch.Tensor, int, Any]]:
    """Mark the dims ``dynamic_shapes`` (torch.export's format: per ``forward`` argument name, a dict
    ``{dim: Dim}`` or a per-dim tuple/list with None for static dims) dynamic for Dynamo; returns
    ``(name, tensor, dim, spec value)`` of each marked dim."""
    # ``marked`` is the caller's list, filled as dims are marked: a bad spec raising half-way still leaves the
    # caller able to unmark what was marked
    frame = _bind(model, args, kwargs)
    if isinstance(dynamic_shapes, (tuple, list)):
        names = list(frame)[:len(dynamic_shapes)]
        dynamic_shapes = dict(zip(names, dynamic_shapes))
    if not isinstance(dynamic_shapes, dict):
        raise OnnxExportError("dynamic_shapes must be a dict keyed by forward argument names (or a tuple in their "
                              "order), as torch.export takes it")
    for name, spec in dynamic_shapes.items():
        if name not in frame:
            raise OnnxExportError(f"dynamic_shapes names {name!r}, not an argument of {type(model).__name__}.forward "
                                  f"({', '.join(frame)})")
        t = frame[name]
        if spec is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise OnnxExportError(f"dynamic_shapes[{name!r}]: the argument is not a tensor")
        dims = (list(spec) if isinstance(spec, dict)
                else [i for i, d in enumerate(spec) if d is not None] if isinstance(spec, (tuple, list)) else None)
        if dims is None:
            raise OnnxExportError(f"dynamic_shapes[{name!r}] must be a dict {{dim: Dim}} or a tuple per dim")
        for d in dims:
            if not isinstance(d, int) or not -t.dim() <= d < t.dim():
                raise OnnxExportError(f"dynamic_shapes[{name!r}]: dim {d!r} does not exist in a {t.dim()}-D input")
            d = d % t.dim()
            if t.shape[d] < 2:
                raise OnnxExportError(f"dynamic_shapes[{name!r}]: dim {d} has size {t.shape[d]} in the example; give "
                                      "an example of size >= 2 there (sizes 0 and 1 are specialized)")
            torch._dynamo.mark_dynamic(t, d)
            marked.append((name, t, d, spec[d] if isinstance(spec, dict) else spec[d]))
    return marked


def _bound(v) -> int | None:
    """A sympy range bound as an int (None when infinite)."""
    from torch.utils._sympy.numbers import int_oo

    if v in (int_oo, -int_oo) or str(v) in ("oo", "-oo", "int_oo", "-int_oo"):
        return None
    return int(v)


def _dynamo_reason(e: BaseException) -> str:
    """Dynamo's message in one line: its headline, the exception it observed (``Developer debug context``) or
    its explanation, and the user's line it stopped at."""
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


def _check_ranges(marked: list, ranges: dict) -> None:
    """A dynamic dim whose valid sizes the capture narrowed (a Python branch on the size, or a limit such
    as learned position embeddings) exports a graph that is wrong or fails outside that range: refuse
    unless the user declared a range inside it (``Dim(name, min=, max=)``)."""
    for name, t, d, spec in marked:
        lo, hi = ranges.get((id(t), d), (2, None))
        lo = 2 if lo is None else lo
        umin = getattr(spec, "min", None) if not isinstance(spec, str) else None
        umax = getattr(spec, "max", None) if not isinstance(spec, str) else None
        # sizes 0 and 1 are never traced (Dynamo specializes them): a declared min below 2 means "from 2"
        umin = 2 if umin is None else max(2, int(umin))
        try:
            umax = None if umax is None or not math.isfinite(float(umax)) or float(umax) >= 2 ** 62 else int(umax)
        except (TypeError, ValueError, OverflowError):
            umax = None
        if lo > umin or (hi is not None and (umax is None or umax > hi)):
            rng = f"[{lo}, {hi if hi is not None else 'inf'}]"
            raise OnnxExportError(
                f"input {name!r}, dim {d}: the model's code only holds for sizes in {rng} (a Python branch on the "
                "size, or a limit such as learned position embeddings); the exported graph would be wrong or fail "
                f"outside it. Declare the range: dynamic_shapes={{{name!r}: {{{d}: torch.export.Dim({name + '_' + str(d)!r}, "
                f"min={lo}{'' if hi is None else f', max={hi}'})}}}}, or keep the dim static")


def input_leaves(model: nn.Module, args: tuple, kwargs: dict) -> tuple[list[torch.Tensor], list[str]]:
    """The tensors of ``(args, kwargs)`` in pytree order, and a name for each: the ``forward`` argument
    it is (``input_ids``), else ``input_<i>``."""
    leaves = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    try:
        frame = _bind(model, args, kwargs)
    except TypeError:
        frame = {}
    by_id = {id(v): k for k, v in frame.items() if isinstance(v, torch.Tensor)}
    names: list[str] = []
    for i, t in enumerate(leaves):
        name = by_id.get(id(t), f"input_{i}")
        names.append(name if name not in names else f"{name}_{i}")    # the same tensor passed twice
    return leaves, names


def _named_dims(model: nn.Module, args: tuple, kwargs: dict, dynamic_shapes: Any) -> dict[str, Any]:
    """``dynamic_shapes`` keyed by ``forward`` argument name, with each dim name turned into a ``Dim`` (one per
    name: the same name is the same size); ``Dim`` s and None kept as given."""
    from torch.export import Dim

    frame = _bind(model, args, kwargs)
    if isinstance(dynamic_shapes, (tuple, list)):
        dynamic_shapes = dict(zip(list(frame), dynamic_shapes))
    dims: dict[str, Any] = {}
    conv = lambda v: dims.setdefault(v, Dim(v)) if isinstance(v, str) else v  # noqa: E731
    return {k: (None if v is None else {d: conv(x) for d, x in v.items()} if isinstance(v, dict)
                else tuple(conv(x) for x in v))
            for k, v in dynamic_shapes.items()}


def _leaf_shapes(model: nn.Module, args: tuple, kwargs: dict, dynamic_shapes: Any) -> tuple | None:
    """``dynamic_shapes`` per flattened input tensor (the wrapper's arguments), for torch.export."""
    if dynamic_shapes is None:
        return None
    from torch.export import Dim

    frame = _bind(model, args, kwargs)
    by_id = {id(frame[k]): v for k, v in _named_dims(model, args, kwargs, dynamic_shapes).items()
             if isinstance(frame.get(k), torch.Tensor)}
    leaves, _ = input_leaves(model, args, kwargs)

    def per_leaf(t):
        spec = by_id.get(id(t))
        if spec is None or not isinstance(spec, dict):
            return spec
        return {d: Dim.AUTO if v is None else v for d, v in spec.items()}

    return tuple(per_leaf(t) for t in leaves)


def _logging_functions() -> set:
    """Logger methods Dynamo may skip while capturing (a log call is a graph break otherwise, e.g. the
    ``logger.warning_once`` in transformers' ``loss_function``); an export has no use for the messages."""
    import logging

    fns = {logging.Logger.debug, logging.Logger.info, logging.Logger.warning, logging.Logger.error}
    fns.update(f for f in (getattr(logging.Logger, "warning_once", None), getattr(logging.Logger, "info_once", None))
               if f is not None)
    return fns


def capture(model: nn.Module, args: tuple, kwargs: dict | None = None, options: dict | None = None,
            dynamic_shapes: Any = None) -> tuple[nn.Module, Report]:
    """The model rewritten by smxcompile's passes as an ``nn.Module`` that ``torch.export`` can take.

    Args:
        model: the model (eval mode is the caller's business). args, kwargs: one call's inputs.
        options: the ``smx`` backend options; default :data:`DEFAULT_OPTIONS` (the deployed graph keeps
            every fusion whatever CPU policy Inductor needs).
        dynamic_shapes: dims captured as symbolic sizes (see :func:`export_onnx`).

    Returns:
        ``(module, report)``: ``module(*args, **kwargs)`` computes the rewritten graph.

    Raises:
        OnnxExportError: Dynamo splits the model at a graph break (the message gives Dynamo's reason),
            a graph input Dynamo took from outside the model's arguments (a global tensor), or a bad
            ``dynamic_shapes``.
    """
    from ..passes import SmxPass

    kwargs = kwargs or {}
    opts = SmxOptions.from_mapping(DEFAULT_OPTIONS if options is None else options)
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
                                ranges[(id(ex), d)] = (_bound(r.lower), _bound(r.upper))
        smx_pass = SmxPass(opts, "g0")
        smx_pass(gm.graph)
        gm.recompile()
        store.update(gm=gm, report=smx_pass.report, sources=sources, ranges=ranges)
        return gm.forward

    torch._dynamo.reset()
    marked: list = []
    try:
        if dynamic_shapes is not None:
            _mark_dynamic(model, args, kwargs, dynamic_shapes, marked)
        with torch.no_grad(), _export_ops(), torch._dynamo.config.patch(ignore_logging_functions=_logging_functions()):
            torch.compile(model, backend=backend, fullgraph=True,
                          dynamic=None if dynamic_shapes is not None else False)(*args, **kwargs)
    except torch.fx.experimental.symbolic_shapes.ConstraintViolationError as e:
        raise OnnxExportError("a dim asked to be dynamic cannot be (the model fixes or constrains its size): "
                              f"{str(e).splitlines()[0][:400]}") from e
    except (torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError) as e:
        raise OnnxExportError(f"the model does not trace as one graph (a graph break): {_dynamo_reason(e)}") from e
    except OnnxExportError:
        raise
    except Exception as e:  # noqa: BLE001 - the model itself failing on the example (empty batch, wrong dtype...)
        raise OnnxExportError(f"the model fails on the example inputs while Dynamo traces it: {type(e).__name__}: "
                              f"{_dynamo_reason(e)}") from e
    finally:
        torch._dynamo.reset()
        for _, t, _, _ in marked:           # leave the caller's tensors as they were (every mark_dynamic attribute)
            for attr in ("_dynamo_dynamic_indices", "_dynamo_dynamic_range", "_has_dynamo_dim_marking",
                         "_specialize_on", "_dynamo_hint_overrides"):
                if attr in vars(t):
                    delattr(t, attr)
    if "gm" in store:
        _check_ranges(marked, store.get("ranges", {}))
    if "gm" not in store:
        raise OnnxExportError("Dynamo produced no graph for the model (nothing to export)")
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
                raise OnnxExportError(f"graph input {name} ({src}) is neither a parameter/buffer of the model, nor one "
                                      "of the example inputs, nor a size of one (a tensor created outside forward?)")
    return _Rewritten(model, store["gm"], slots), store["report"]


# --------------------------------------------------------------------------- export


def export_onnx(model: nn.Module, args: tuple, path: str | Path, *, kwargs: dict | None = None,
                dynamic_shapes: Any = None, opset: int | None = None, target: str = "onnxruntime",
                attention_op: str | None = None, rewrites: str | Iterable[str] = "all", options: dict | None = None,
                check: bool = True, check_inputs: list | tuple = (), rtol: float = 1e-4, atol: float = 1e-5,
                compare: bool = False, threads: int = 1) -> OnnxExport:
    """Export ``model`` as rewritten by smxcompile to ONNX and check the file in onnxruntime.

    Args:
        model: an ``nn.Module`` that Dynamo traces as one graph (no graph break). Exported in its
            current mode (call ``model.eval()`` first for inference).
        args: positional example inputs (a tuple). kwargs: keyword example inputs.
        path: the ``.onnx`` file to write.
        dynamic_shapes: dims that stay symbolic in the ONNX graph, in torch.export's format keyed by
            ``forward`` argument names: ``{"input_ids": {0: Dim("batch"), 1: Dim("seq")}}`` (or a dict
            ``{dim: name}``, or a per-dim tuple with None for static dims). Example sizes must be >= 2
            there. Default: every shape static.
        opset: ONNX (ai.onnx) opset, at least 18 (default: the target's; 23 for onnxruntime when it
            loads it, for the ``Attention`` op).
        target: ``"onnxruntime"`` (default: the installed onnxruntime's best ops, com.microsoft ones
            included) or ``"portable"`` (standard ONNX ops only, attention as MatMul / Softmax / MatMul);
            see :mod:`smxcompile.backends.onnx_target`.
        attention_op: force the form of fused attention: ``"Attention"`` (ONNX, opset >= 23),
            ``"MultiHeadAttention"`` (com.microsoft) or ``"decompose"``; None: the target's choice.
        rewrites: the rewrite kinds to apply (names of ``smxcompile.REWRITE_KINDS``), or ``"all"``
            (default); the others are exported as written. ``()`` exports the graph unrewritten.
        options: further ``smx`` backend options; ``cpu`` defaults to ``"rewrite"`` here (the deployed
            graph keeps every fusion, whatever Inductor's CPU policy is).
        check: run ``onnx.checker`` and onnxruntime on the example inputs and compare every output
            with eager PyTorch: ``|ort - eager| <= atol + rtol * |eager|`` (with an ``attention_normalizer``
            option, which changes the model, with the rewritten graph run in PyTorch instead).
        check_inputs: more ``(args, kwargs)`` to compare on, e.g. other shapes of the dynamic dims. With
            ``dynamic_shapes``, the check also runs the example narrowed by one along every dynamic dim (a
            prefix of each tensor; skipped when the model itself fails on it or a dim cannot shrink).
        compare: also export the model plainly (``torch.onnx.export(model, dynamo=True)`` at the same
            opset, without smxcompile) and time both files in onnxruntime on the example inputs, in turn:
            the op types before/after and the latencies land in the result (``print()`` it).
        threads: onnxruntime intra-op threads of that timing (default 1).

    Returns:
        :class:`OnnxExport` (path, rewrite report, op types, how each smxcompile op was exported, largest
        difference, opset and target; with ``compare=True`` the plain export's op types and both latencies).

    Raises:
        OnnxExportError: a graph break; an smxcompile op without an ONNX translation yet (named, with
            the option that exports the site unrewritten); a dynamic dim that came out fixed or that the
            model's code constrains (a branch on the size, a maximum length) beyond the declared ``Dim``
            range; a bf16 model; a bad ``target`` / ``opset`` / ``attention_op`` / ``rewrites``; a file the
            installed onnxruntime cannot load (its IR version and opset named); outputs the graph does not
            compute; the check failing (which output, by how much).
        ImportError: onnx / onnxscript / onnxruntime not installed (``pip install smxcompile[onnx]``).

    Non-tensor arguments (a float temperature, a bool flag) and Python branches on values are fixed in
    the file as they were for the example call; a branch on a dynamic size is refused (see above). The
    file's outputs are the returned tensors in pytree order (a dict's keys are not output names).
    onnxscript's optimizer (constant folding, dead code, common subexpressions) runs on the file, not its
    opset-23 fusions (see :func:`_optimize`).
    """
    import onnx

    path = Path(path)
    kwargs = kwargs or {}
    if not isinstance(args, tuple):
        args = (args,)
    _check_arguments(path, check_inputs, rtol, atol, rewrites, threads)
    tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    if any(t.dtype == torch.bfloat16 for t in (*tensors, *model.parameters(), *model.buffers())):
        raise OnnxExportError("bf16 models: onnxruntime's CPU kernels lack bf16 for Softmax / ReduceMax / TopK; "
                              "export in fp32 (model.float()) or fp16 (then loosen rtol/atol: one fp16 step is ~1e-3)")
    try:
        tgt = resolve_target(target, opset, attention_op)
    except OnnxTargetError as e:
        raise OnnxExportError(str(e)) from e
    opts = _export_options(options, rewrites)
    module, report = capture(model, args, kwargs, opts, dynamic_shapes)
    if SmxOptions.from_mapping(opts).attention_normalizer != "softmax":
        # the options change the model's math (another attention normalizer): the file is checked against the
        # rewritten graph run in PyTorch (the smx ops' reference paths), not against the model as written
        reference = _RewrittenCall(module, model)
    else:
        reference = model
    shapes = None
    with torch.no_grad(), _export_ops():
        # torch.export first: the rewritten graph calls the smx ops through Python helpers; the exported
        # program holds the ops themselves, which is what the translation table and the check see
        leaves, names = input_leaves(model, args, kwargs)
        shapes = _leaf_shapes(model, args, kwargs, dynamic_shapes)
        ep = torch.export.export(module, tuple(leaves), strict=False,
                                 dynamic_shapes=None if shapes is None else (shapes,))   # the varargs tuple
        table = _translations(tgt)
        _check_graph(ep.graph_module, table)
        try:
            program = torch.onnx.export(ep, tuple(leaves), dynamo=True, opset_version=tgt.opset, input_names=names,
                                        custom_translation_table=table, optimize=False, verbose=False)
        except Exception as e:  # noqa: BLE001 - torch.onnx's ConversionError buries the translation's message
            raise OnnxExportError(f"torch.onnx could not translate the rewritten graph: {_innermost(e)}") from e
    _optimize(program)
    _rename_dims(program.model, shapes)
    program.save(str(path))
    proto = onnx.load(str(path))
    op_types = _op_types(proto)
    opset_used = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), -1)
    if opset_used != tgt.opset:
        raise OnnxExportError(f"asked for opset {tgt.opset}, the exporter wrote opset {opset_used} (its version "
                              "converter failed); ask for another opset")
    if shapes is not None:
        # dynamic dims must come out symbolic (a dim_param), not baked to the example's size
        for spec, inp in zip(shapes, proto.graph.input):
            dims = inp.type.tensor_type.shape.dim
            wanted = (list(spec) if isinstance(spec, dict)
                      else [i for i, v in enumerate(spec) if v is not None] if spec is not None else [])
            fixed = [d for d in wanted if d < len(dims) and not dims[d].dim_param]
            if fixed:
                raise OnnxExportError(f"input {inp.name}: dim(s) {fixed} came out fixed in the ONNX graph although "
                                      "dynamic_shapes asks for them to be dynamic")
    diff = math.nan
    checked: list[tuple] = []
    if check:
        onnx.checker.check_model(proto)
        sess = _session(path)
        runs = [(args, kwargs)] + [(tuple(a), dict(k)) for a, k in check_inputs]
        narrowed = _narrowed_inputs(args, kwargs, leaves, shapes)
        if narrowed is not None:
            runs.append(narrowed)                     # the dynamic dims really dynamic: one more shape
        for i, (a, k) in enumerate(runs):
            try:
                d = _run_and_compare(sess, model, a, k, rtol, atol, reference)
            except _EagerFailed:
                if i < len(runs) - 1 or narrowed is None:
                    raise
                continue                              # the model itself does not take the narrowed shape
            diff = d if math.isnan(diff) else max(diff, d)
            checked.append(tuple(tuple(t.shape) for t in input_leaves(model, a, k)[0]))
    out = OnnxExport(path=path, report=report, op_types=op_types, max_abs_diff=diff, opset=opset_used, target=tgt,
                     exported=_exported_ops(proto), checked_shapes=checked, dynamic=shapes is not None)
    if compare:
        _compare(out, model, args, kwargs, tgt, threads, dynamic_shapes)
    return out


def _innermost(e: BaseException) -> str:
    """The message of the deepest exception in ``e``'s cause chain (a translation's own error), one line."""
    while e.__cause__ is not None:
        e = e.__cause__
    first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), "")
    return f"{type(e).__name__}: {first[:400]}"


def _check_arguments(path: Path, check_inputs, rtol, atol, rewrites, threads) -> None:
    """Bad arguments fail before the (long) export, with a message that says what is expected."""
    if path.is_dir():
        raise OnnxExportError(f"path {str(path)!r} is a directory; give the .onnx file to write")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OnnxExportError(f"cannot create the folder of {str(path)!r}: {e}") from e
    if not isinstance(check_inputs, (list, tuple)) or not all(
            isinstance(c, (list, tuple)) and len(c) == 2 and isinstance(c[0], (list, tuple)) and isinstance(c[1], dict)
            for c in check_inputs):
        raise OnnxExportError("check_inputs must be a list of (args, kwargs) pairs, e.g. [((), {'input_ids': ids2})] "
                              "or [((x2,), {})]")
    for name, v in (("rtol", rtol), ("atol", atol)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
            raise OnnxExportError(f"{name} must be a number >= 0, not {v!r}")
    if not (isinstance(rewrites, str) or (isinstance(rewrites, (list, tuple, set, frozenset))
                                          and all(isinstance(k, str) for k in rewrites))):
        raise OnnxExportError(f"rewrites must be 'all' or a list of rewrite kinds (smxcompile.REWRITE_KINDS), "
                              f"not {rewrites!r}")
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise OnnxExportError(f"threads must be an int >= 1, not {threads!r}")


def _rename_dims(model, shapes: tuple | None) -> None:
    """Name the file's symbolic dims as ``dynamic_shapes`` did (``batch``, ``seq``) instead of the exporter's
    symbols (``s28``), everywhere they appear (inputs, outputs, intermediate shapes, expressions)."""
    if shapes is None:
        return
    import onnx_ir as ir

    names: dict[str, str] = {}
    for inp, spec in zip(model.graph.inputs, shapes):
        if inp.shape is None:
            continue
        for d, dim in (spec.items() if isinstance(spec, dict) else enumerate(spec or ())):
            user = getattr(dim, "__name__", None)
            if user is None or d >= len(inp.shape):
                continue
            sym = inp.shape[d]
            if isinstance(sym, ir.SymbolicDim) and sym.value and sym.value not in names \
                    and user not in names.values():
                names[sym.value] = user
    if not names:
        return
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, sorted(names, key=len, reverse=True))) + r")\b")

    def fix(value) -> None:
        if value is None or value.shape is None:
            return
        dims = [ir.SymbolicDim(pattern.sub(lambda m: names[m.group(1)], d.value))
                if isinstance(d, ir.SymbolicDim) and d.value and pattern.search(d.value) else d for d in value.shape]
        if any(a is not b for a, b in zip(dims, value.shape)):
            value.shape = ir.Shape(dims)

    for v in (*model.graph.inputs, *model.graph.outputs):
        fix(v)
    for node in model.graph.all_nodes() if hasattr(model.graph, "all_nodes") else model.graph:
        for v in node.outputs:
            fix(v)


def _optimize(program) -> None:
    """onnxscript's optimizer on the exported model: constant folding, dead code, common subexpressions.

    Not the opset-23 fusions ``torch.onnx.export(optimize=True)`` adds after it (onnxscript's
    ``onnx_fusions``: RMSNormalization, RotaryEmbedding, GQA): the fused RotaryEmbedding keeps a batch-1
    cos/sin cache that onnxruntime 1.32 refuses for any batch > 1 once the batch dim is dynamic (a Llama file
    that fails on its own example), and the fusions were measured to change nothing else in onnxruntime's
    latency (Llama, 4 x 128 tokens: 72.8 vs 73.5 ms)."""
    import logging

    import onnxscript.optimizer

    # its constant folder logs a warning for every node it cannot evaluate ("Evaluation failed: cannot reshape
    # ..."), which is not a problem of the file
    folding = logging.getLogger("onnxscript.optimizer._constant_folding")
    level = folding.level
    folding.setLevel(logging.ERROR)
    try:
        onnxscript.optimizer.optimize_ir(program.model)
    finally:
        folding.setLevel(level)


def _export_options(options: dict | None, rewrites: str | Iterable[str]) -> dict:
    """The backend options of an export: ``cpu="rewrite"`` unless given, the kinds outside ``rewrites`` disabled."""
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
        raise OnnxExportError(f"rewrites: unknown rewrite kind(s) {bad}; known: {list(REWRITE_KINDS)} (or 'all')")
    opts["disable"] = sorted(set(opts.get("disable", ())) | (set(REWRITE_KINDS) - set(rewrites)))
    return opts


def _op_types(proto) -> dict[str, int]:
    out: dict[str, int] = {}
    for node in proto.graph.node:
        out[node.op_type] = out.get(node.op_type, 0) + 1
    return out


def _exported_ops(proto) -> dict[str, dict]:
    """``{"smx::<op>": {"calls": n, "onnx": {op_type: count}}}`` from the exporter's node metadata (the
    torch op each ONNX node was translated from); ``aten::scaled_dot_product_attention`` too."""
    import ast

    found: dict[str, dict] = {}
    calls: dict[str, set] = {}
    for node in proto.graph.node:
        props = {p.key: p.value for p in node.metadata_props}
        try:
            source = ast.literal_eval(props.get("pkg.torch.onnx.class_hierarchy", "[]"))[-1]
        except (ValueError, SyntaxError, IndexError):
            continue
        ns, _, rest = str(source).partition(".")
        opname = rest.split(".")[0]
        if not (ns == "smx" or (ns == "aten" and opname == "scaled_dot_product_attention")):
            continue
        name = f"{ns}::{opname}"
        entry = found.setdefault(name, {"calls": 0, "onnx": {}})
        entry["onnx"][node.op_type] = entry["onnx"].get(node.op_type, 0) + 1
        calls.setdefault(name, set()).add(props.get("pkg.torch.onnx.fx_node", "").split(" ", 1)[0])
    for name, entry in found.items():
        entry["calls"] = len(calls[name])
    return dict(sorted(found.items()))


def _session(path: Path, threads: int | None = None):
    """An onnxruntime CPU session of ``path``; a file it cannot load is an :class:`OnnxExportError` that names
    the file's IR version and opsets against the installed onnxruntime."""
    import onnx
    import onnxruntime as ort

    so = ort.SessionOptions()
    if threads is not None:
        so.intra_op_num_threads, so.inter_op_num_threads = threads, 1
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    try:
        return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    except Exception as e:  # noqa: BLE001 - onnxruntime raises several types for the same thing
        proto = onnx.load(str(path), load_external_data=False)
        opsets = ", ".join(f"{o.domain or 'ai.onnx'} {o.version}" for o in proto.opset_import)
        raise OnnxExportError(f"onnxruntime {ort.__version__} cannot load {path.name} (IR version {proto.ir_version}, "
                              f"opsets {opsets}): {str(e).splitlines()[0][:300]}; export with a lower opset= or "
                              "upgrade onnxruntime") from e


def _feeds(sess, leaves: list[torch.Tensor], names: list[str]) -> dict:
    """Session inputs by name when the file kept the argument names, else in order."""
    ins = [i.name for i in sess.get_inputs()]
    by_name = dict(zip(names, leaves))
    if all(n in by_name for n in ins):
        return {n: by_name[n].detach().cpu().numpy() for n in ins}
    if len(ins) != len(leaves):
        raise OnnxExportError(f"the file has {len(ins)} inputs ({', '.join(ins)}), the call {len(leaves)} tensors")
    return {n: t.detach().cpu().numpy() for n, t in zip(ins, leaves)}


def time_sessions(runs: dict[str, tuple[Any, dict]], rounds: int = 5, seconds: float = 0.2) -> dict[str, float]:
    """onnxruntime latency of several sessions timed in turn: ``{name: ms per call}``, the median over
    ``rounds`` rounds (the order alternating), each round as many calls as take about ``seconds``.

    Args:
        runs: ``{name: (InferenceSession, feeds)}``.
    """
    import statistics
    import time

    iters: dict[str, int] = {}
    for name, (sess, feed) in runs.items():
        sess.run(None, feed)                                   # warm-up
        t0 = time.perf_counter()
        sess.run(None, feed)
        iters[name] = max(1, int(seconds / max(time.perf_counter() - t0, 1e-6)))
    times: dict[str, list[float]] = {k: [] for k in runs}
    for r in range(rounds):
        for name in (list(runs) if r % 2 == 0 else list(reversed(list(runs)))):
            sess, feed = runs[name]
            t0 = time.perf_counter()
            for _ in range(iters[name]):
                sess.run(None, feed)
            times[name].append((time.perf_counter() - t0) / iters[name] * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


def plain_export(model: nn.Module, args: tuple, kwargs: dict, path: Path, opset: int | None = None,
                 dynamic_shapes: Any = None) -> None:
    """``torch.onnx.export(model, dynamo=True)`` of the model as written (the baseline of ``compare``), with
    ``dynamic_shapes`` in :func:`export_onnx`'s format (names become shared ``Dim`` s)."""
    if dynamic_shapes is not None:
        frame = _bind(model, args, kwargs)
        named = _named_dims(model, args, kwargs, dynamic_shapes)
        dynamic_shapes = {k: named.get(k) for k in frame if isinstance(frame[k], torch.Tensor) or k in named}
    with torch.no_grad(), torch._dynamo.config.patch(ignore_logging_functions=_logging_functions()):
        torch.onnx.export(model, args, kwargs=kwargs, dynamo=True, opset_version=opset, optimize=True,
                          dynamic_shapes=dynamic_shapes, verbose=False).save(str(path))


def _compare(out: OnnxExport, model: nn.Module, args: tuple, kwargs: dict, tgt: OnnxTarget, threads: int,
             dynamic_shapes: Any = None) -> None:
    """Fill ``out.baseline`` and ``out.latency_ms``: the plain export at the same opset and with the same dynamic
    dims (static when torch.onnx cannot export it so: ``baseline.dynamic``), both timed in turn."""
    import tempfile

    import onnx

    leaves, names = input_leaves(model, args, kwargs)
    with tempfile.TemporaryDirectory() as tmp:
        plain = Path(tmp) / "plain.onnx"
        try:
            dynamic = dynamic_shapes is not None
            try:
                plain_export(model, args, kwargs, plain, tgt.opset, dynamic_shapes)
            except Exception:  # noqa: BLE001 - e.g. a raw model whose export wants use_cache handled; try static
                if not dynamic:
                    raise
                dynamic = False
                plain_export(model, args, kwargs, plain, tgt.opset)
            base = OnnxBaseline(op_types=_op_types(onnx.load(str(plain), load_external_data=False)), dynamic=dynamic)
            plain_sess = _session(plain, threads)
            plain_feeds = _feeds(plain_sess, leaves, names)
        except Exception as e:  # noqa: BLE001 - a model torch cannot export plainly is a finding, not a crash
            out.baseline = OnnxBaseline(op_types={}, error=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
            sess = _session(out.path, threads)
            out.latency_ms = time_sessions({"smx": (sess, _feeds(sess, leaves, names))})["smx"]
            return
        sess = _session(out.path, threads)
        ms = time_sessions({"plain": (plain_sess, plain_feeds), "smx": (sess, _feeds(sess, leaves, names))})
    base.latency_ms = ms["plain"]
    out.baseline, out.latency_ms = base, ms["smx"]


class _EagerFailed(OnnxExportError):
    """Eager PyTorch itself fails on a check input."""


def _narrowed_inputs(args: tuple, kwargs: dict, leaves: list, shapes: tuple | None) -> tuple | None:
    """``(args, kwargs)`` with every dynamic dim one smaller (prefixes of the example tensors; dims that share a
    ``Dim`` stay equal), or None when no dim can shrink (size - 1 below 2 or below the Dim's min)."""
    if shapes is None:
        return None
    sizes: dict[str, int] = {}
    frozen: set[str] = set()
    plan: dict[int, list[tuple[int, str]]] = {}
    for t, spec in zip(leaves, shapes):
        for d, dim in (spec.items() if isinstance(spec, dict) else enumerate(spec or ())):
            name = getattr(dim, "__name__", None)
            if name is None:                          # None / Dim.AUTO / Dim.STATIC: not a declared dynamic dim
                continue
            lo = max(2, int(getattr(dim, "min", 2) or 2))
            if t.shape[d] - 1 < lo:
                frozen.add(name)                      # this dim (and every dim of its name) keeps its size
            sizes[name] = min(sizes.get(name, t.shape[d] - 1), t.shape[d] - 1)
            plan.setdefault(id(t), []).append((d, name))
    if not set(sizes) - frozen:
        return None

    def narrow(x):
        if isinstance(x, torch.Tensor) and id(x) in plan:
            for d, name in plan[id(x)]:
                if name not in frozen:
                    x = x.narrow(d, 0, sizes[name])
        return x

    a, k = pytree.tree_map(narrow, (args, kwargs))
    return tuple(a), dict(k)


class _RewrittenCall:
    """Calls the captured, rewritten graph with a model's ``(args, kwargs)`` (the check's reference when the
    options change the model's math)."""

    def __init__(self, module: nn.Module, model: nn.Module):
        self.module, self.model = module, model

    def __call__(self, *args, **kwargs):
        with _export_ops():
            return self.module(*input_leaves(self.model, args, kwargs)[0])


def _run_and_compare(sess, model: nn.Module, args: tuple, kwargs: dict, rtol: float, atol: float,
                     reference=None) -> float:
    """Largest ``|onnxruntime - reference|`` on one input (reference: ``model`` itself by default)."""
    import numpy as np

    leaves, names = input_leaves(model, args, kwargs)
    try:
        with torch.no_grad():
            ref = (reference or model)(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - any failure of the model itself
        raise _EagerFailed(f"eager PyTorch fails on the check input of shapes "
                           f"{[tuple(t.shape) for t in leaves]}: {type(e).__name__}: {e}") from e
    try:
        got = sess.run(None, _feeds(sess, leaves, names))
    except Exception as e:  # noqa: BLE001 - onnxruntime's run errors name the node
        raise OnnxExportError(f"onnxruntime fails on input shapes {[tuple(t.shape) for t in leaves]}: "
                              f"{str(e).splitlines()[0][:400]}") from e
    ref_leaves = [t for t in pytree.tree_leaves(ref) if isinstance(t, torch.Tensor)]
    if len(ref_leaves) != len(got):
        raise OnnxExportError(f"the ONNX model has {len(got)} outputs, the model returns {len(ref_leaves)} tensors: "
                              "outputs the graph does not compute (an input returned as it is, or the same tensor "
                              "returned twice) are not part of an exported graph, nor objects that are not tensors "
                              "(a transformers model returning its KV cache: pass use_cache=False); return only "
                              "computed tensors")
    worst = 0.0
    for i, (g, r) in enumerate(zip(got, ref_leaves)):
        r = r.detach().cpu()
        r = (r if r.dtype == torch.float64 else r.float()).numpy()      # fp64 outputs compared in fp64
        g = g.astype(r.dtype) if g.dtype != r.dtype else g
        if g.shape != r.shape:
            raise OnnxExportError(f"output {i}: onnxruntime shape {g.shape}, eager {r.shape}")
        d, why = compare_arrays(g, r, rtol, atol, "onnxruntime")
        if why:
            raise OnnxExportError(f"output {i}: onnxruntime {why}")
        worst = max(worst, d)
    return worst


def compare_arrays(got, ref, rtol: float, atol: float, name: str) -> tuple[float, str | None]:
    """``(largest |got - ref|, None)``, or ``(NaN, why)`` when some entry is off by more than ``atol + rtol * |ref|``.

    NaN matches NaN and inf matches inf (of the same sign); a NaN on one side only is a mismatch. ``got`` and
    ``ref`` are numpy arrays of one shape and dtype (the exports' checks: ONNX in onnxruntime, MLIR on the JIT);
    ``name`` names ``got`` in the message."""
    import numpy as np

    same = (np.isnan(got) & np.isnan(ref)) | (got == ref)
    with np.errstate(invalid="ignore"):
        d = np.where(same, 0.0, np.abs(got - ref))          # NaN where only one of them is NaN
    bad = ~(d <= atol + rtol * np.where(np.isnan(ref), 0.0, np.abs(ref)))
    if not bad.any():
        return (float(d.max()) if d.size else 0.0), None
    only_ref, only_got = int((np.isnan(ref) & ~np.isnan(got)).sum()), int((np.isnan(got) & ~np.isnan(ref)).sum())
    nans = f"; NaN in eager only at {only_ref}, in {name} only at {only_got}" if only_ref or only_got else ""
    worst = float(np.nanmax(d)) if (~np.isnan(d)).any() else float("nan")
    return math.nan, (f"differs from eager PyTorch by up to {worst:.3g} (rtol {rtol}, atol {atol}) at "
                      f"{int(bad.sum())} of {bad.size} entries{nans}")


__all__ = ["export_onnx", "capture", "plain_export", "time_sessions", "compare_arrays", "OnnxExport", "OnnxBaseline", "OnnxExportError"]
