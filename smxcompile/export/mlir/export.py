"""MLIR export of the *rewritten* model through torch-mlir: ``smxcompile.export_mlir``.

The shared capture, ``torch.export``, the smx ops' reference forms, then torch-mlir (:mod:`.lower`); the module
verified and, for ``linalg-on-tensors``, run on the LLVM JIT (:mod:`.check`). Design: docs/DESIGN.md, 'MLIR
export: lowering and checks'.
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
    """torch-mlir, once the modules the export uses import; ImportError naming the extra otherwise."""
    import importlib

    try:
        for name in ("torch_mlir", "torch_mlir.fx", "torch_mlir.ir", "torch_mlir.compiler_utils"):
            importlib.import_module(name)
    except ImportError as e:
        raise ImportError(f"smxcompile.export_mlir needs torch-mlir: {_INSTALL} ({e})") from e
    return importlib.import_module("torch_mlir")


def export_mlir(model: nn.Module, args: tuple, *, kwargs: dict | None = None, output_type: str = "torch",
                dynamic_shapes: Any = None, options: dict | None = None, decompose: bool = True,
                path: str | Path | None = None, check: bool = True, check_inputs: list | tuple = (),
                rtol: float = 1e-4, atol: float = 1e-5) -> MlirExport:
    """Export ``model`` as rewritten by smxcompile to MLIR through torch-mlir, and check the module.

    ``model`` (Dynamo-traceable as one graph, in eval mode), ``args`` / ``kwargs`` and ``dynamic_shapes`` (example
    sizes >= 2 there) as :func:`smxcompile.export_onnx` takes them. ``output_type``: ``"torch"``,
    ``"linalg-on-tensors"`` or ``"stablehlo"``. ``decompose=False`` keeps the smx ops as ``torch.operator``
    (``"torch"`` only). ``path``: also write the text there. ``check``: verify the module, and run a
    ``linalg-on-tensors`` one (not bfloat16) on the JIT on the example and ``check_inputs`` against eager PyTorch,
    ``|mlir - eager| <= atol + rtol * |eager|``.

    Returns :class:`MlirExport`; its ``@main`` takes the flattened ``(args, kwargs)`` tensors and returns the
    outputs, both in pytree order.

    Raises:
        ImportError: torch-mlir is not installed (``pip install smxcompile[mlir]``).
        ValueError: an unknown ``output_type``, ``decompose=False`` with another, a bad ``check_inputs`` entry.
        MlirExportError: a graph break or bad ``dynamic_shapes``; torch.export, a decomposition or torch-mlir
            failing (the op named); a module that does not verify; a check input that does not fit; outputs
            that differ from eager.
    """
    if output_type not in OUTPUT_TYPES:
        raise ValueError(f"output_type must be one of {', '.join(OUTPUT_TYPES)}, got {output_type!r}")
    if not decompose and output_type != "torch":
        raise ValueError(f"decompose=False keeps smxcompile's ops as torch.operator, which torch-mlir cannot lower to "
                         f"{output_type}; use output_type='torch' with decompose=False, or decompose=True")
    _import_torch_mlir()
    args, kwargs = detached_aliases(args if isinstance(args, tuple) else (args,), kwargs or {})
    run_check = check and output_type == "linalg-on-tensors"
    more_inputs = [(f"check_inputs[{j}]", more) for j, more in
                   enumerate(check_input_leaves(model, check_inputs) if run_check else [])]
    try:
        module, report = capture(model, args, kwargs, options, dynamic_shapes)
    except ExportError as e:                          # the shared capture's errors, as this export's
        raise MlirExportError(str(e)) from e
    leaves, names = input_leaves(model, args, kwargs)
    program = export_program(module, leaves, leaf_shapes(model, args, kwargs, dynamic_shapes))
    runs = (reference_runs(model, module, program, leaves=leaves, names=names, more_inputs=more_inputs)
            if run_check else [])
    kept = sorted({name for name, _ in smx_ops(program.graph_module)})
    if decompose:
        check_reference_forms(program)
    program = decompose_program(program, decompose, output_type)
    mlir_module = lower_program(program, output_type, [] if decompose else kept)
    text = str(mlir_module)
    out = MlirExport(text=text, report=report, output_type=output_type, decomposed=decompose,
                     ops=op_counts(mlir_module))
    if check:
        check_module(out, runs, rtol=rtol, atol=atol)
    if path is not None:
        out.path = Path(path)
        out.path.parent.mkdir(parents=True, exist_ok=True)
        out.path.write_text(text)
    return out


def detached_aliases(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``(args, kwargs)`` with each tensor replaced by one detached alias, which keeps the capture's dynamic-dim
    marks off the caller's tensors."""
    aliases: dict[int, torch.Tensor] = {}
    return pytree.tree_map_only(torch.Tensor, lambda t: aliases.setdefault(id(t), t.detach()), (args, kwargs))


def export_program(module: nn.Module, leaves: list, shapes: tuple | None):
    """``torch.export`` of the captured module, every buffer persistent meanwhile; MlirExportError if it fails."""
    try:
        with torch.no_grad(), persistent_buffers(module):
            return torch.export.export(module, tuple(leaves), strict=False,
                                       dynamic_shapes=None if shapes is None else (shapes,))
    except torch.fx.experimental.symbolic_shapes.ConstraintViolationError as e:
        raise MlirExportError(f"torch.export refuses dynamic_shapes for this example: {one_line(e)}; give an "
                              "example whose sizes lie in the declared Dim(min=, max=) range, or keep the dim "
                              "static") from e
    except Exception as e:  # noqa: BLE001 - what Dynamo captured, torch.export should take: name the cause
        raise MlirExportError(f"torch.export failed on the rewritten graph: {one_line(e)} (check that the model "
                              "exports with torch.export.export(model, args, kwargs, strict=False); with "
                              "dynamic_shapes, try the dims static)") from e


def reference_runs(model: nn.Module, module: nn.Module, program, leaves: list, names: list,
                   more_inputs: list) -> list[tuple[str, list, list]]:
    """``(which, input leaves, PyTorch's outputs)`` of the example and each check input matched against
    ``program`` ([] for bfloat16); MlirExportError for an input that does not fit or that the model rejects."""
    if not runnable(leaves, model):
        return []
    specs, ranges = input_specs(program, leaves, names)
    for which, more in more_inputs:
        check_leaves(which, more, specs, ranges)
    return [(which, run_leaves, reference_outputs(module, run_leaves, which))
            for which, run_leaves in [("the example", leaves), *more_inputs]]


def check_reference_forms(program) -> None:
    """MlirExportError naming the first smx op of ``program`` without a reference ATen form, if any."""
    from ...kernels.decompositions import decomposition_table

    known = {f"smx::{op._opname}" for op in decomposition_table()}
    missing = [(name, node) for name, node in smx_ops(program.graph_module) if name not in known]
    if missing:
        name, node = missing[0]
        kind = rewrite_kind(name.split("::")[1])
        raise MlirExportError(f"{name} (node {node}) has no reference ATen form to decompose it into; pass "
                              f"options={{'cpu': 'rewrite', 'disable': ['{kind}']}} to export that site "
                              "unrewritten")


def decompose_program(program, decompose: bool, output_type: str):
    """``program`` through :func:`.lower.decomposition_table_for`; MlirExportError if it fails or leaves an smx
    op."""
    try:
        with torch.no_grad():
            program = program.run_decompositions(decomposition_table_for(decompose, output_type))
    except NotImplementedError as e:
        raise MlirExportError(str(e)) from e
    except Exception as e:  # noqa: BLE001
        raise MlirExportError(f"decomposing the exported graph for {output_type} failed: {one_line(e)}; with "
                              "decompose=False (output_type='torch') the smx ops are kept whole") from e
    left = smx_ops(program.graph_module) if decompose else []
    if left:
        raise MlirExportError(f"{left[0][0]} (node {left[0][1]}) is still in the graph after decomposition")
    return program


def check_module(out: MlirExport, runs: list, *, rtol: float, atol: float) -> None:
    """Verify ``out.text`` and run ``runs`` on the JIT, setting ``out.checked`` and ``out.max_abs_diff``;
    MlirExportError for an op left where it may not be, a module that fails, or outputs that differ."""
    ops = reparse(out.text)
    operators = [k for k in ops if k.startswith("torch.operator")]
    if out.decomposed and operators:
        raise MlirExportError(f"{operators[0]} is left in the decomposed module")
    if out.output_type != "torch":
        torch_ops = [k for k in ops if k.startswith("torch.")]
        if torch_ops:
            raise MlirExportError(f"{torch_ops[0]} (torch dialect) is left in the {out.output_type} module")
    out.checked = "verified"
    if not runs:
        return
    from .run import LinalgModule, RunError

    try:
        compiled = LinalgModule(out.text)
    except RunError as e:
        raise MlirExportError(f"the linalg-on-tensors module did not compile for the JIT: {e}") from e
    out.max_abs_diff = max(run_and_compare(compiled, run_leaves, reference, rtol, atol, which)
                           for which, run_leaves, reference in runs)
    out.checked = "run"
