"""MLIR export of the *rewritten* model through torch-mlir: ``smxcompile.export_mlir``.

How. The model is captured and rewritten exactly as :func:`smxcompile.export_onnx` does it
(:func:`smxcompile.export.capture.capture`: one Dynamo graph, smxcompile's passes, the parameters as
attributes again), exported with ``torch.export``, and handed to ``torch_mlir.fx.export_and_import``:

* ``decompose=True`` (default): each ``torch.ops.smx.*`` call is first replaced by its reference ATen
  form (:mod:`smxcompile.kernels.decompositions`, through ``ExportedProgram.run_decompositions``
  together with torch-mlir's own decomposition table), so the module holds only ops torch-mlir lowers;
  any output type works. Two changes to torch-mlir's table: ``aten.scaled_dot_product_attention`` (what
  softmax attention sites become) is not decomposed through the math kernel, whose output strides break
  the model's later ``.view``; it stays one op in ``torch``, and is materialized as torch defines it, in
  the fused kernel's layout (:func:`.lower._sdpa`), for ``stablehlo`` (no lowering of the op there) and for
  ``linalg-on-tensors`` whenever torch-mlir's own lowering (``tm_tensor.attention``) would be wrong: with
  any mask (it gives fully masked rows -- left padding -- other values than torch), a non-default scale
  (it scales by ``1/sqrt(E)`` whatever ``scale`` says), or a dtype other than fp32
  (:func:`.lower._sdpa_linalg`); ``aten.isfinite`` (row maxima of the attention variants)
  is written ``|x| < inf`` for ``linalg-on-tensors``, which has no lowering of it.
* ``decompose=False``: the smx ops stay one op each, ``torch.operator "torch.smx.softmax"(...)`` in the
  ``torch`` dialect, for a compiler that brings its own lowering of them. torch-mlir's backend-contract
  pipeline refuses every ``torch.operator`` unless an "extra library" declares it value-semantic; this
  module writes one (a ``__torch_mlir_has_value_semantics_fn.torch.smx.<op>`` marker per op) so the rest
  of the graph is still lowered to the backend-contract ``torch`` form. Nothing can lower those ops
  further, so other output types are refused up front.

Non-persistent buffers (``rotary_emb.inv_freq``, BERT's ``position_ids``) are made persistent while
``torch.export`` runs, so that torch-mlir's importer finds them (it reads the state dict only), and
restored afterwards: the user's model is left as it was.

Then the module is checked: it is parsed back and verified in a fresh context; no ``torch.operator``
may remain when decomposed, and no ``torch`` dialect op in ``linalg-on-tensors`` / ``stablehlo``; a
``linalg-on-tensors`` module is compiled with the wheel's passes and run on the LLVM JIT
(:mod:`.run`) on the example inputs and compared with the rewritten graph run in eager PyTorch
(smxcompile's own kernels). Check inputs are first matched against the exported signature (count,
dtypes, static dims, dynamic dims' ranges) and run in PyTorch, before anything is lowered: the compiled
code trusts its inputs, and an out-of-range size or index fails an assertion in it that aborts the
process. ``torch`` and ``stablehlo``
modules are verified but not run (the wheel has no runner for them that is safe in-process: its
StableHLO interpreter aborts the process on ops it does not know).

Source: torch-mlir's FX importer and pipelines (``torch_mlir.fx``, ``torch_mlir.compiler_utils``); the
``has_value_semantics`` library hook of its ``ReduceOpVariants`` pass.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from .. import ExportError
from ..capture import capture, rewrite_kind
from ..inputs import input_leaves, leaf_shapes
from .check import (check_input_leaves, check_leaves, input_specs, op_counts, reference_outputs, reparse,
                    run_and_compare, runnable)
from .lower import decomposition_table_for, lower_program, persistent_buffers, smx_ops
from .result import MlirExport, MlirExportError, one_line

__all__ = ["export_mlir", "OUTPUT_TYPES"]


#: The output types :func:`export_mlir` writes (torch-mlir's names).
OUTPUT_TYPES = ("torch", "linalg-on-tensors", "stablehlo")


_INSTALL = "pip install smxcompile[mlir]"


def _import_torch_mlir():
    try:
        from torch_mlir import fx, ir  # noqa: F401
        from torch_mlir.compiler_utils import OutputType, TorchMlirCompilerError  # noqa: F401
    except ImportError as e:
        raise ImportError(f"smxcompile.export_mlir needs torch-mlir: {_INSTALL} ({e})") from e
    import torch_mlir

    return torch_mlir


def export_mlir(model: nn.Module, args: tuple, *, kwargs: dict | None = None, output_type: str = "torch",
                dynamic_shapes: Any = None, options: dict | None = None, decompose: bool = True,
                path: str | Path | None = None, check: bool = True, check_inputs: list | tuple = (),
                rtol: float = 1e-4, atol: float = 1e-5) -> MlirExport:
    """Export ``model`` as rewritten by smxcompile to MLIR through torch-mlir, and check the module.

    Args:
        model: an ``nn.Module`` that Dynamo traces as one graph (no graph break), exported in its current
            mode (``model.eval()`` first; attention dropout in training has no reference form).
        args: positional example inputs (a tuple; a single tensor is taken as ``(tensor,)``).
        kwargs: keyword example inputs (e.g. ``{"input_ids": ids}`` for a ``transformers`` model with
            ``use_cache=False``).
        output_type: ``"torch"`` (torch-mlir's backend-contract torch dialect), ``"linalg-on-tensors"``
            or ``"stablehlo"``.
        dynamic_shapes: dims kept symbolic (``?`` in the module's tensor types), in torch.export's format
            keyed by ``forward`` argument names, as :func:`smxcompile.export_onnx` takes it:
            ``{"input_ids": {0: "batch", 1: "seq"}}``. Example sizes must be >= 2 there. Default: static.
        options: the ``smx`` backend options (over ``{"cpu": "rewrite", "cuda": "rewrite"}``: every fusion kept).
        decompose: replace each smx op by its reference ATen form before lowering (required for
            ``linalg-on-tensors`` and ``stablehlo``). False keeps them as ``torch.operator
            "torch.smx.<op>"`` in the ``torch`` dialect.
        path: also write the module's text there (once the check has passed).
        check: verify (and for ``linalg-on-tensors`` run) the module; see below.
        check_inputs: more ``(args, kwargs)`` to run the ``linalg-on-tensors`` module on and compare, e.g.
            other sizes of the dynamic dims.
        rtol, atol: the run's tolerance against eager: ``|mlir - eager| <= atol + rtol * |eager|``.

    Returns:
        :class:`MlirExport`: ``text``, ``report`` (the rewrite report), ``output_type``, ``ops``
        (``{op name: count}`` in the module), ``path``, ``checked`` and ``max_abs_diff``.

    The module's function ``@main`` takes the example's tensors (the flattened ``(args, kwargs)``, in
    pytree order) with their shapes and dtypes (``?`` for dynamic dims) and returns the model's output
    tensors in pytree order; parameters and buffers are constants of the module. Non-tensor arguments and
    Python branches are fixed as they were for the example call.

    Check (``check=True``): the text is parsed back and verified in a fresh context; when decomposed, no
    ``torch.operator`` may be left, and in ``linalg-on-tensors`` / ``stablehlo`` no ``torch`` dialect op;
    a ``linalg-on-tensors`` module is lowered to LLVM with the wheel's passes, run on the LLVM JIT
    (:mod:`smxcompile.export.mlir.run`) with the example inputs (and ``check_inputs``) and compared with
    the rewritten graph run in eager PyTorch on smxcompile's own kernels -- the model itself, unless
    ``options`` change its math (``attention_normalizer``) -- (``checked="run"``), unless a tensor is
    bfloat16, which the JIT's descriptors cannot carry (``checked="verified"``, as for ``torch`` and
    ``stablehlo``, which are parsed and verified only). Every check input is first matched against the
    exported program (number of tensors, dtypes, static dims, the dynamic dims' ranges, sizes >= 2) and run
    in PyTorch, before the lowering: what does not fit, or what the model itself rejects (an id past the
    vocabulary, a sequence past the position table), is an :class:`MlirExportError`, never a run of the
    compiled code (whose bounds assertions abort the process).

    Raises:
        ImportError: torch-mlir is not installed (``pip install smxcompile[mlir]``).
        ValueError: an unknown ``output_type``; ``decompose=False`` with an output type other than
            ``"torch"`` (kept smx ops cannot be lowered further); a ``check_inputs`` entry that is not an
            ``(args, kwargs)`` pair.
        MlirExportError: a graph break or a bad ``dynamic_shapes`` (from the capture); torch.export failing
            on the rewritten graph; an smx op with no reference form (named, e.g. a training-only op, or
            attention with dropout); an op torch-mlir fails to lower (named from its diagnostics, with the
            output type) or its importer failing; a ``torch.operator`` left after decomposition; a module
            that does not verify; a check input that does not fit the module or that the model rejects;
            outputs that differ from eager (which input, which output, by how much).

    What lowers (torch-mlir 20261001): every smx op's reference form, to all three output types. Softmax
    attention is torch's SDPA op, kept whole in ``torch``; in ``linalg-on-tensors`` it stays one op
    (``tm_tensor.attention``, or torch-mlir's matmul + softmax) only without a mask, with the default scale,
    in fp32, and is materialized otherwise (torch-mlir's lowering ignores ``scale`` and differs from torch
    on fully masked rows); materialized for ``stablehlo`` (no SDPA lowering there). Softmax + top-k
    becomes a full sort of the row and a slice (torch-mlir decomposes ``aten.topk`` so; the probabilities
    are still never materialized). Limits met: a GPT-2 with batch *and* sequence dynamic lowers to
    ``linalg-on-tensors`` with NaN rows (the run refuses it; either dim alone is fine) and its ``aten.cumsum``
    does not lower to ``stablehlo``.

    Sources: torch-mlir's FX importer (``torch_mlir.fx.export_and_import``) and lowering pipelines;
    the reference forms in :mod:`smxcompile.kernels.decompositions`.
    """
    if output_type not in OUTPUT_TYPES:
        raise ValueError(f"output_type must be one of {', '.join(OUTPUT_TYPES)}, got {output_type!r}")
    if not decompose and output_type != "torch":
        raise ValueError(f"decompose=False keeps smxcompile's ops as torch.operator, which torch-mlir cannot lower to "
                         f"{output_type}; use output_type='torch' with decompose=False, or decompose=True")
    _import_torch_mlir()
    kwargs = kwargs or {}
    if not isinstance(args, tuple):
        args = (args,)
    # the capture marks the dims of dynamic_shapes on the tensors it is given, and the marks stay: a later
    # static export of the same tensors then fails in Dynamo ("Guard failed on the same frame it was
    # created"). It gets aliases (same storage, no attributes; one per tensor, so aliasing is kept)
    aliases: dict[int, torch.Tensor] = {}
    args, kwargs = pytree.tree_map_only(torch.Tensor, lambda t: aliases.setdefault(id(t), t.detach()), (args, kwargs))
    run_check = check and output_type == "linalg-on-tensors"
    more_inputs = [(f"check_inputs[{j}]", more) for j, more in
                   enumerate(check_input_leaves(model, check_inputs) if run_check else [])]
    try:
        module, report = capture(model, args, kwargs, options, dynamic_shapes)
    except ExportError as e:                          # the shared capture's errors, as this export's
        raise MlirExportError(str(e)) from e
    leaves, names = input_leaves(model, args, kwargs)
    shapes = leaf_shapes(model, args, kwargs, dynamic_shapes)
    try:
        with torch.no_grad(), persistent_buffers(module):
            ep = torch.export.export(module, tuple(leaves), strict=False,
                                     dynamic_shapes=None if shapes is None else (shapes,))
    except torch.fx.experimental.symbolic_shapes.ConstraintViolationError as e:
        raise MlirExportError(f"torch.export refuses dynamic_shapes for this example: {one_line(e)}; give an "
                              "example whose sizes lie in the declared Dim(min=, max=) range, or keep the dim "
                              "static") from e
    except Exception as e:  # noqa: BLE001 - what Dynamo captured, torch.export should take: name the cause
        raise MlirExportError(f"torch.export failed on the rewritten graph: {one_line(e)} (check that the model "
                              "exports with torch.export.export(model, args, kwargs, strict=False); with "
                              "dynamic_shapes, try the dims static)") from e
    # the run's inputs and PyTorch's outputs on them, before the lowering: an input the module was not
    # exported for (shape, dtype) or that the model itself rejects is refused here, never run compiled
    runs: list[tuple[str, list, list]] = []
    if run_check and runnable(leaves, model):
        specs, ranges = input_specs(ep, leaves, names)
        for which, more in more_inputs:
            check_leaves(which, more, specs, ranges)
        for which, ls in [("the example", leaves), *more_inputs]:
            runs.append((which, ls, reference_outputs(module, ls, which)))
    kept = sorted({name for name, _ in smx_ops(ep.graph_module)})
    if decompose:
        from ...kernels.decompositions import decomposition_table

        known = {f"smx::{op._opname}" for op in decomposition_table()}
        missing = [(name, node) for name, node in smx_ops(ep.graph_module) if name not in known]
        if missing:
            name, node = missing[0]
            kind = rewrite_kind(name.split("::")[1])
            raise MlirExportError(f"{name} (node {node}) has no reference ATen form to decompose it into; pass "
                                  f"options={{'cpu': 'rewrite', 'disable': ['{kind}']}} to export that site "
                                  "unrewritten")
    try:
        # torch-mlir's own table (what export_and_import would apply), plus the smx ops' reference forms
        with torch.no_grad():
            ep = ep.run_decompositions(decomposition_table_for(decompose, output_type))
    except NotImplementedError as e:
        raise MlirExportError(str(e)) from e
    except Exception as e:  # noqa: BLE001
        raise MlirExportError(f"decomposing the exported graph for {output_type} failed: {one_line(e)}; with "
                              "decompose=False (output_type='torch') the smx ops are kept whole") from e
    if decompose:
        left = smx_ops(ep.graph_module)
        if left:
            raise MlirExportError(f"{left[0][0]} (node {left[0][1]}) is still in the graph after decomposition")
        kept = []
    mod = lower_program(ep, output_type, kept)
    text = str(mod)
    ops = op_counts(mod)
    out = MlirExport(text=text, report=report, output_type=output_type, decomposed=decompose, ops=ops)
    if check:
        ops = reparse(text)
        operators = [k for k in ops if k.startswith("torch.operator")]
        if decompose and operators:
            raise MlirExportError(f"{operators[0]} is left in the decomposed module")
        if output_type != "torch":
            torch_ops = [k for k in ops if k.startswith("torch.")]
            if torch_ops:
                raise MlirExportError(f"{torch_ops[0]} (torch dialect) is left in the {output_type} module")
        out.checked = "verified"
        if runs:
            from .run import LinalgModule, RunError

            try:
                compiled = LinalgModule(text)
            except RunError as e:
                raise MlirExportError(f"the linalg-on-tensors module did not compile for the JIT: {e}") from e
            out.max_abs_diff = max(run_and_compare(compiled, ls, ref, rtol, atol, which) for which, ls, ref in runs)
            out.checked = "run"
    if path is not None:
        out.path = Path(path)
        out.path.parent.mkdir(parents=True, exist_ok=True)
        out.path.write_text(text)
    return out
