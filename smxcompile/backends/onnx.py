"""ONNX export of the *rewritten* model: ``smxcompile.export_onnx`` (issue 8, first part).

How. The model is captured by Dynamo as one graph (``fullgraph=True``, static shapes), smxcompile's
passes rewrite it exactly as the ``smx`` backend does (so the deployed graph keeps the fusions), and
the rewritten ``GraphModule`` -- wrapped so that the model's parameters and buffers are attributes
again, not graph inputs -- goes to ``torch.onnx.export(..., dynamo=True)`` with a
``custom_translation_table`` mapping each smxcompile op to ONNX (onnxscript). Then the file is
checked: ``onnx.checker``, a run in onnxruntime on the example inputs compared with eager PyTorch.

Exported so far: ``smx::softmax`` -> ``Softmax`` (scale folded in front), ``smx::log_softmax`` ->
``LogSoftmax``, ``smx::softmax_topk`` -> ``TopK`` of the logits and ``Exp(values - ReduceLogSumExp)``
(never a full ``Softmax``; ``Softmax`` over the k values when renormalized), ``smx::quant_softmax`` ->
``Softmax`` + ``QuantizeLinear`` (+ ``Clip`` for a code range narrower than the 8-bit type; the
graph's own dequantization and bias correction follow as standard ops); graphs whose attention the
passes hand to ``F.scaled_dot_product_attention`` export through torch's own translation, and
variants swapped in by :func:`smxcompile.swap` as their torch code. Any other smxcompile op in the
rewritten graph raises :class:`OnnxExportError` naming it (attention with a variant normalizer is
the next step of issue 8), as do masks, soft-capping, ``dtype=`` and ``return_lse`` on the softmax
ops.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
import re
from pathlib import Path
from typing import Any, Iterator

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
class OnnxExport:
    """What :func:`export_onnx` wrote and checked.

    Attributes:
        path: the ``.onnx`` file. report: the rewrite report of the exported graph.
        op_types: ``{ONNX op type: count}`` of the exported graph.
        max_abs_diff: largest ``|onnxruntime - eager|`` over the outputs on the example inputs
            (NaN when ``check=False``).
        opset: the ONNX opset of the file. target: what the file was written for (runtime, attention form).
    """

    path: Path
    report: Report
    op_types: dict[str, int]
    max_abs_diff: float
    opset: int
    target: OnnxTarget | None = None


# --------------------------------------------------------------------------- translations

#: The modules whose ``translations(target)`` make up the ``custom_translation_table`` and whose
#: ``refuse(name, args, node)`` says why a call cannot be translated (see :mod:`.onnx_softmax`).
TRANSLATION_MODULES = ("onnx_softmax",)


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
        if n.target.namespace != "smx":
            continue
        name = n.target._opname
        if name not in translated:
            raise OnnxExportError(f"smx::{name} (node {n.name}) has no ONNX translation yet; pass "
                                  f"options={{'cpu': 'rewrite', 'disable': ['{_kind_of(name)}']}} to export that site "
                                  "unrewritten")
        args = dict(zip([a.name for a in n.target._schema.arguments], n.args)) | dict(n.kwargs)
        for m in modules:
            why = m.refuse(name, args, n)
            if why:
                raise OnnxExportError(f"smx::{name} (node {n.name}) {why}")


def _kind_of(opname: str) -> str:
    """The rewrite kind (``options={"disable": [...]}``) that emits op ``smx::<opname>``."""
    from ..options import REWRITE_KINDS

    return opname if opname in REWRITE_KINDS else "cross_entropy"


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


def _mark_dynamic(model: nn.Module, args: tuple, kwargs: dict, dynamic_shapes: Any) -> list[tuple[str, torch.Tensor, int, Any]]:
    """Mark the dims ``dynamic_shapes`` (torch.export's format: per ``forward`` argument name, a dict
    ``{dim: Dim}`` or a per-dim tuple/list with None for static dims) dynamic for Dynamo; returns
    ``(name, tensor, dim, spec value)`` of each marked dim."""
    marked: list[tuple[str, torch.Tensor, int, Any]] = []
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


def _check_ranges(marked: list, ranges: dict) -> None:
    """A dynamic dim whose valid sizes the capture narrowed (a Python branch on the size, or a limit such
    as learned position embeddings) exports a graph that is wrong or fails outside that range: refuse
    unless the user declared a range inside it (``Dim(name, min=, max=)``)."""
    for name, t, d, spec in marked:
        lo, hi = ranges.get((id(t), d), (2, None))
        lo = 2 if lo is None else lo
        umin = getattr(spec, "min", None) if not isinstance(spec, str) else None
        umax = getattr(spec, "max", None) if not isinstance(spec, str) else None
        umin = 2 if umin is None else int(umin)
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


def _leaf_shapes(model: nn.Module, args: tuple, kwargs: dict, dynamic_shapes: Any) -> tuple | None:
    """``dynamic_shapes`` per flattened input tensor (the wrapper's arguments), for torch.export."""
    if dynamic_shapes is None:
        return None
    from torch.export import Dim

    frame = _bind(model, args, kwargs)
    if isinstance(dynamic_shapes, (tuple, list)):
        dynamic_shapes = dict(zip(list(frame), dynamic_shapes))
    by_id = {id(frame[k]): v for k, v in dynamic_shapes.items() if isinstance(frame.get(k), torch.Tensor)}
    leaves, _ = input_leaves(model, args, kwargs)
    dims: dict[str, Any] = {}

    def conv(v):
        if isinstance(v, str):            # one Dim per name: the same name is the same size
            return dims.setdefault(v, Dim(v))
        return Dim.AUTO if v is None else v

    def per_leaf(t):
        spec = by_id.get(id(t))
        if spec is None:
            return None
        if isinstance(spec, dict):
            return {d: conv(v) for d, v in spec.items()}
        return tuple(None if v is None else conv(v) for v in spec)

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
            marked = _mark_dynamic(model, args, kwargs, dynamic_shapes)
        with torch.no_grad(), _export_ops(), torch._dynamo.config.patch(ignore_logging_functions=_logging_functions()):
            torch.compile(model, backend=backend, fullgraph=True,
                          dynamic=None if dynamic_shapes is not None else False)(*args, **kwargs)
    except torch.fx.experimental.symbolic_shapes.ConstraintViolationError as e:
        raise OnnxExportError("a dim asked to be dynamic cannot be (the model fixes or constrains its size): "
                              f"{str(e).splitlines()[0][:400]}") from e
    except (torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError) as e:
        raise OnnxExportError(f"the model does not trace as one graph (a graph break): {str(e).splitlines()[0]}") from e
    finally:
        torch._dynamo.reset()
        for _, t, _, _ in marked:           # leave the caller's tensors as they were
            if hasattr(t, "_dynamo_dynamic_indices"):
                del t._dynamo_dynamic_indices
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
                attention_op: str | None = None, options: dict | None = None,
                check: bool = True, check_inputs: list | tuple = (), rtol: float = 1e-4,
                atol: float = 1e-5) -> OnnxExport:
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
        opset: ONNX opset (default: torch.onnx's, 18 or later).
        options: the ``smx`` backend options (default :data:`DEFAULT_OPTIONS`: every fusion is kept,
            softmax + top-k exported as written).
        check: run ``onnx.checker`` and onnxruntime on the example inputs and compare every output
            with eager PyTorch: ``|ort - eager| <= atol + rtol * |eager|``.
        check_inputs: more ``(args, kwargs)`` to compare on, e.g. other shapes of the dynamic dims.

    Returns:
        :class:`OnnxExport` (path, rewrite report, op types, largest difference, opset).

    Raises:
        OnnxExportError: a graph break; an smxcompile op without an ONNX translation yet (named, with
            the option that exports the site unrewritten); a dynamic dim that came out fixed or that the
            model's code constrains (a branch on the size, a maximum length) beyond the declared ``Dim``
            range; a bf16 model; outputs the graph does not compute; the check failing (which output,
            by how much).
        ImportError: onnx / onnxscript / onnxruntime not installed (``pip install smxcompile[onnx]``).

    Non-tensor arguments (a float temperature, a bool flag) and Python branches on values are fixed in
    the file as they were for the example call; a branch on a dynamic size is refused (see above). The
    file's outputs are the returned tensors in pytree order (a dict's keys are not output names).

    """
    import onnx

    path = Path(path)
    kwargs = kwargs or {}
    if not isinstance(args, tuple):
        args = (args,)
    tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    if any(t.dtype == torch.bfloat16 for t in (*tensors, *model.parameters(), *model.buffers())):
        raise OnnxExportError("bf16 models: onnxruntime's CPU kernels lack bf16 for Softmax / ReduceMax / TopK; "
                              "export in fp32 (model.float()) or fp16 (then loosen rtol/atol: one fp16 step is ~1e-3)")
    try:
        tgt = resolve_target(target, opset, attention_op)
    except OnnxTargetError as e:
        raise OnnxExportError(str(e)) from e
    module, report = capture(model, args, kwargs, options, dynamic_shapes)
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
        program = torch.onnx.export(ep, tuple(leaves), dynamo=True, opset_version=tgt.opset, input_names=names,
                                    custom_translation_table=table, verbose=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    program.save(str(path))
    proto = onnx.load(str(path))
    op_types: dict[str, int] = {}
    for node in proto.graph.node:
        op_types[node.op_type] = op_types.get(node.op_type, 0) + 1
    opset_used = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), -1)
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
    if check:
        onnx.checker.check_model(proto)
        diff = _run_and_compare(path, model, args, kwargs, rtol, atol)
        for more_args, more_kwargs in check_inputs:
            diff = max(diff, _run_and_compare(path, model, tuple(more_args), dict(more_kwargs), rtol, atol))
    return OnnxExport(path=path, report=report, op_types=op_types, max_abs_diff=diff, opset=opset_used, target=tgt)


def _run_and_compare(path: Path, model: nn.Module, args: tuple, kwargs: dict, rtol: float, atol: float) -> float:
    import numpy as np
    import onnxruntime as ort

    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    leaves, _ = input_leaves(model, args, kwargs)
    feeds = {i.name: t.detach().cpu().numpy() for i, t in zip(sess.get_inputs(), leaves)}
    got = sess.run(None, feeds)
    with torch.no_grad():
        ref = model(*args, **kwargs)
    ref_leaves = [t for t in pytree.tree_leaves(ref) if isinstance(t, torch.Tensor)]
    if len(ref_leaves) != len(got):
        raise OnnxExportError(f"the ONNX model has {len(got)} outputs, the model returns {len(ref_leaves)} tensors: "
                              "outputs the graph does not compute (an input returned as it is, or the same tensor "
                              "returned twice) are not part of an exported graph; return only computed tensors")
    worst = 0.0
    for i, (g, r) in enumerate(zip(got, ref_leaves)):
        r = r.detach().float().cpu().numpy()
        g = g.astype(np.float32) if g.dtype != r.dtype else g
        if g.shape != r.shape:
            raise OnnxExportError(f"output {i}: onnxruntime shape {g.shape}, eager {r.shape}")
        both_nan = np.isnan(g) & np.isnan(r)
        d = np.where(both_nan, 0.0, np.abs(g - r))
        bad = ~(d <= atol + rtol * np.abs(r))
        if bad.any():
            raise OnnxExportError(f"output {i}: onnxruntime differs from eager PyTorch by up to {float(np.nanmax(d)):.3g} "
                                  f"(rtol {rtol}, atol {atol}) at {int(bad.sum())} of {bad.size} entries")
        worst = max(worst, float(d.max()) if d.size else 0.0)
    return worst


__all__ = ["export_onnx", "capture", "OnnxExport", "OnnxExportError"]
