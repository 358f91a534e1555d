"""ONNX export of the *rewritten* model: ``smxcompile.export_onnx``.

The shared capture (:mod:`smxcompile.export.capture`), ``torch.export``, then ``torch.onnx.export(dynamo=True)``
with a translation per smxcompile op (:mod:`.translate`); the file checked in onnxruntime against eager PyTorch.
Design: docs/DESIGN.md, 'Deployment export (ONNX, MLIR)'.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Iterable

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from ...options import SmxOptions
from .. import ExportError
from ..capture import capture, export_options
from ..inputs import input_leaves, leaf_shapes
from .baseline import compare_with_plain
from .result import OnnxExport, OnnxExportError, count_op_types, exported_ops
from .runtime import EagerFailed, RewrittenCall, narrowed_inputs, ort_session, run_and_compare
from .target import OnnxTargetError
from .target import resolve as resolve_target
from .translate import check_graph, translation_table


def export_onnx(model: nn.Module, args: tuple, path: str | Path, *, kwargs: dict | None = None,
                dynamic_shapes: Any = None, opset: int | None = None, target: str = "onnxruntime",
                attention_op: str | None = None, rewrites: str | Iterable[str] = "all", options: dict | None = None,
                check: bool = True, check_inputs: list | tuple = (), rtol: float = 1e-4, atol: float = 1e-5,
                compare: bool = False, threads: int = 1) -> OnnxExport:
    """Export ``model`` as rewritten by smxcompile to ONNX and check the file in onnxruntime.

    Args:
        model: an ``nn.Module`` that Dynamo traces as one graph, in its current mode (``model.eval()`` first).
        args, kwargs: the example call; non-tensor values and branches on them are fixed as they were.
        dynamic_shapes: symbolic dims in torch.export's format keyed by ``forward`` argument names
            (``{"input_ids": {0: Dim("batch")}}``, ``{dim: name}`` or a per-dim tuple); example sizes >= 2.
        opset: ai.onnx opset >= 18; target: ``"onnxruntime"`` or ``"portable"``; attention_op: ``"Attention"``,
            ``"MultiHeadAttention"`` or ``"decompose"`` (:mod:`smxcompile.export.onnx.target`; None: the target's).
        rewrites: the rewrite kinds to apply, or ``"all"``. options: ``smx`` backend options (``cpu="rewrite"``).
        check: ``onnx.checker`` and onnxruntime on the example, ``check_inputs`` and (with ``dynamic_shapes``) the
            example narrowed by one, against eager PyTorch: ``|ort - eager| <= atol + rtol * |eager|``.
        compare: also time the plain ``torch.onnx.export`` of the model against the file (``threads`` threads).

    Returns:
        :class:`OnnxExport`; the file's outputs are the returned tensors in pytree order.

    Raises:
        OnnxExportError: a graph break; an op without a translation (and the option that exports it
            unrewritten); a dynamic dim fixed or constrained by the model; bf16; a bad argument; a file
            onnxruntime cannot load; the check failing (which output, by how much).
        ImportError: onnx / onnxscript / onnxruntime not installed (``pip install smxcompile[onnx]``).
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
    try:
        opts = export_options(options, rewrites)
        module, report = capture(model, args, kwargs, opts, dynamic_shapes)
    except ExportError as e:                          # the shared capture's errors, as this export's
        raise OnnxExportError(str(e)) from e
    if SmxOptions.from_mapping(opts).attention_normalizer != "softmax":
        reference = RewrittenCall(module, model)      # another normalizer changes the math: check the graph
    else:
        reference = model
    leaves, names = input_leaves(model, args, kwargs)
    shapes = leaf_shapes(model, args, kwargs, dynamic_shapes)
    program = export_program(module, leaves=leaves, names=names, shapes=shapes, tgt=tgt)
    _optimize(program)
    _rename_dims(program.model, shapes)
    program.save(str(path))
    proto = onnx.load(str(path))
    opset_used = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), -1)
    if opset_used != tgt.opset:
        raise OnnxExportError(f"asked for opset {tgt.opset}, the exporter wrote opset {opset_used} (its version "
                              "converter failed); ask for another opset")
    check_dims_dynamic(proto, shapes)
    diff, checked = math.nan, []
    if check:
        onnx.checker.check_model(proto)
        runs = [(args, kwargs)] + [(tuple(a), dict(k)) for a, k in check_inputs]
        narrowed = narrowed_inputs(args, kwargs, leaves, shapes)
        diff, checked = check_runs(path, model, reference=reference, runs=runs, narrowed=narrowed, rtol=rtol,
                                   atol=atol)
    out = OnnxExport(path=path, report=report, op_types=count_op_types(proto), max_abs_diff=diff, opset=opset_used,
                     target=tgt, exported=exported_ops(proto), checked_shapes=checked, dynamic=shapes is not None)
    if compare:
        compare_with_plain(out, model, args, kwargs, tgt, threads, dynamic_shapes)
    return out


def export_program(module: nn.Module, leaves: list, names: list, shapes: tuple | None, tgt):
    """``torch.export`` of the captured module (its nodes the smx ops themselves), checked against the
    translation table, then ``torch.onnx.export``; OnnxExportError naming what has no translation."""
    with torch.no_grad():
        program = torch.export.export(module, tuple(leaves), strict=False,
                                      dynamic_shapes=None if shapes is None else (shapes,))
        table = translation_table(tgt)
        check_graph(program.graph_module, table)
        try:
            return torch.onnx.export(program, tuple(leaves), dynamo=True, opset_version=tgt.opset, input_names=names,
                                     custom_translation_table=table, optimize=False, verbose=False)
        except Exception as e:  # noqa: BLE001 - torch.onnx's ConversionError buries the translation's message
            raise OnnxExportError(f"torch.onnx could not translate the rewritten graph: {_innermost(e)}") from e


def check_dims_dynamic(proto, shapes: tuple | None) -> None:
    """OnnxExportError if a dim ``shapes`` asks to be dynamic is not symbolic in the file's inputs."""
    for spec, inp in zip(shapes or (), proto.graph.input):
        dims = inp.type.tensor_type.shape.dim
        wanted = (list(spec) if isinstance(spec, dict)
                  else [i for i, v in enumerate(spec) if v is not None] if spec is not None else [])
        fixed = [d for d in wanted if d < len(dims) and not dims[d].dim_param]
        if fixed:
            raise OnnxExportError(f"input {inp.name}: dim(s) {fixed} came out fixed in the ONNX graph although "
                                  "dynamic_shapes asks for them to be dynamic")


def check_runs(path: Path, model: nn.Module, reference, runs: list, narrowed, *, rtol: float,
               atol: float) -> tuple[float, list[tuple]]:
    """(largest difference, input shapes checked) of the file against ``reference`` on ``runs`` and ``narrowed``
    (skipped if the model fails on it); OnnxExportError for a file onnxruntime cannot load or outputs that differ."""
    sess = ort_session(path)
    if narrowed is not None:
        runs = [*runs, narrowed]
    diff, checked = math.nan, []
    for i, (run_args, run_kwargs) in enumerate(runs):
        try:
            d = run_and_compare(sess, model, run_args, run_kwargs, rtol, atol, reference)
        except EagerFailed:
            if i < len(runs) - 1 or narrowed is None:
                raise
            continue                                  # the model itself does not take the narrowed shape
        diff = d if math.isnan(diff) else max(diff, d)
        checked.append(tuple(tuple(t.shape) for t in input_leaves(model, run_args, run_kwargs)[0]))
    return diff, checked


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
    """Name the file's symbolic dims as ``dynamic_shapes`` did (``batch``, not the exporter's ``s28``), everywhere."""
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
    """onnxscript's optimizer on the exported model (constant folding, dead code, common subexpressions), without
    the opset-23 fusions of ``torch.onnx.export(optimize=True)``: docs/DESIGN.md, 'Deployment export (ONNX,
    MLIR)'."""
    import logging

    import onnxscript.optimizer

    # its constant folder warns about every node it cannot evaluate, which is not a problem of the file
    folding = logging.getLogger("onnxscript.optimizer._constant_folding")
    level = folding.level
    folding.setLevel(logging.ERROR)
    try:
        onnxscript.optimizer.optimize_ir(program.model)
    finally:
        folding.setLevel(level)


__all__ = ["export_onnx"]
