"""ONNX export of the *rewritten* model: ``smxcompile.export_onnx``.

How. The model is captured by Dynamo as one graph (``fullgraph=True``; static, or with the requested dims dynamic;
:func:`smxcompile.export.capture.capture`, shared with the MLIR export), smxcompile's passes rewrite it exactly as
the ``smx`` backend does (so the deployed graph keeps the fusions), and the rewritten ``GraphModule`` -- wrapped so
that the model's parameters and buffers are attributes again, not graph inputs -- goes through ``torch.export`` to
``torch.onnx.export(..., dynamo=True)`` with a ``custom_translation_table`` mapping each smxcompile op to ONNX
(onnxscript). Then the file is checked: ``onnx.checker``, loaded by the installed onnxruntime, and run on the
example inputs (and more shapes) against eager PyTorch.

The translations live in one module per op family
(:data:`~smxcompile.export.onnx.translate.TRANSLATION_MODULES`), each written for an
:class:`~smxcompile.export.onnx.target.OnnxTarget` (``target="onnxruntime"`` or ``"portable"``, the
opset and the form of attention):

- :mod:`.softmax`: ``smx::softmax`` / ``log_softmax`` (with their fused prologue),
  ``smx::softmax_topk``, ``smx::quant_softmax``.
- :mod:`.attention`: ``aten.scaled_dot_product_attention`` (softmax attention sites) as the ONNX
  ``Attention`` op, com.microsoft ``MultiHeadAttention`` or MatMul / Softmax / MatMul with torch's
  semantics, and ``smx::attention`` with every normalizer.
- :mod:`.cross_entropy`: ``smx::ce_stats`` and ``smx::linear_ce_stats`` (cut cross-entropy's statistics).

Variants swapped in by :func:`smxcompile.swap` export as their torch code. An smxcompile op no module
translates raises :class:`OnnxExportError` naming it and the option that exports the site unrewritten.
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
            see :mod:`smxcompile.export.onnx.target`.
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
    try:
        opts = export_options(options, rewrites)
        module, report = capture(model, args, kwargs, opts, dynamic_shapes)
    except ExportError as e:                          # the shared capture's errors, as this export's
        raise OnnxExportError(str(e)) from e
    if SmxOptions.from_mapping(opts).attention_normalizer != "softmax":
        # the options change the model's math (another attention normalizer): the file is checked against the
        # rewritten graph run in PyTorch (the smx ops' reference paths), not against the model as written
        reference = RewrittenCall(module, model)
    else:
        reference = model
    shapes = None
    with torch.no_grad():
        # torch.export first: the rewritten graph calls the smx ops through Python helpers; the exported
        # program holds the ops themselves, which is what the translation table and the check see
        leaves, names = input_leaves(model, args, kwargs)
        shapes = leaf_shapes(model, args, kwargs, dynamic_shapes)
        ep = torch.export.export(module, tuple(leaves), strict=False,
                                 dynamic_shapes=None if shapes is None else (shapes,))   # the varargs tuple
        table = translation_table(tgt)
        check_graph(ep.graph_module, table)
        try:
            program = torch.onnx.export(ep, tuple(leaves), dynamo=True, opset_version=tgt.opset, input_names=names,
                                        custom_translation_table=table, optimize=False, verbose=False)
        except Exception as e:  # noqa: BLE001 - torch.onnx's ConversionError buries the translation's message
            raise OnnxExportError(f"torch.onnx could not translate the rewritten graph: {_innermost(e)}") from e
    _optimize(program)
    _rename_dims(program.model, shapes)
    program.save(str(path))
    proto = onnx.load(str(path))
    op_types = count_op_types(proto)
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
        sess = ort_session(path)
        runs = [(args, kwargs)] + [(tuple(a), dict(k)) for a, k in check_inputs]
        narrowed = narrowed_inputs(args, kwargs, leaves, shapes)
        if narrowed is not None:
            runs.append(narrowed)                     # the dynamic dims really dynamic: one more shape
        for i, (a, k) in enumerate(runs):
            try:
                d = run_and_compare(sess, model, a, k, rtol, atol, reference)
            except EagerFailed:
                if i < len(runs) - 1 or narrowed is None:
                    raise
                continue                              # the model itself does not take the narrowed shape
            diff = d if math.isnan(diff) else max(diff, d)
            checked.append(tuple(tuple(t.shape) for t in input_leaves(model, a, k)[0]))
    out = OnnxExport(path=path, report=report, op_types=op_types, max_abs_diff=diff, opset=opset_used, target=tgt,
                     exported=exported_ops(proto), checked_shapes=checked, dynamic=shapes is not None)
    if compare:
        compare_with_plain(out, model, args, kwargs, tgt, threads, dynamic_shapes)
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


__all__ = ["export_onnx"]
