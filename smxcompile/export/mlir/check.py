"""The check of an MLIR export: the module verified, its op counts, and a ``linalg-on-tensors`` module run on MLIR's
JIT (:mod:`.run`) against PyTorch, every input matched against the program first (compiled code trusts it)."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from ..compare import compare_arrays
from ..inputs import input_leaves, range_bound
from .result import MlirExportError, one_line


def _walk(op, fn) -> None:
    fn(op)
    for region in op.regions:
        for block in region.blocks:
            for child in block.operations:
                _walk(child.operation, fn)


def op_counts(module) -> dict[str, int]:
    """``{operation name: count}`` over a parsed ``torch_mlir.ir.Module`` (itself not counted); a
    ``torch.operator`` as ``torch.operator "<its name>"``."""
    counts: dict[str, int] = {}

    def add(op):
        name = op.name
        if name == "builtin.module":
            return
        if name == "torch.operator":
            name = f'torch.operator "{op.attributes["name"].value}"'
        counts[name] = counts.get(name, 0) + 1

    _walk(module.operation, add)
    return dict(sorted(counts.items()))


def reparse(text: str) -> dict[str, int]:
    """The op counts of ``text`` parsed and verified in a fresh context; MlirExportError with MLIR's diagnostics."""
    from torch_mlir import ir

    from .run import new_context

    ctx = new_context()
    diags: list[str] = []
    handler = ctx.attach_diagnostic_handler(lambda d: diags.append(str(d.message)) or True)
    try:
        with ctx:
            module = ir.Module.parse(text)
            if not module.operation.verify():
                raise MlirExportError("the exported module does not verify: " + "; ".join(diags[:3]))
            return op_counts(module)
    except MlirExportError:
        raise
    except Exception as e:
        raise MlirExportError("the exported module does not parse back: " + ("; ".join(diags[:3]) or str(e))) from e
    finally:
        handler.detach()


@dataclasses.dataclass
class _InputSpec:
    """What the exported program takes at one input: ``name`` (the forward argument), ``shape`` (ints,
    sympy expressions of the program's symbols for dynamic dims), ``dtype``."""

    name: str
    shape: tuple
    dtype: torch.dtype


def input_specs(ep, leaves: list[torch.Tensor], names: list[str]) -> tuple[list[_InputSpec], dict]:
    """The user inputs of ``ep`` (shapes as traced: ints, or sympy expressions of its symbols), named by
    ``names`` and typed by ``leaves`` (the example's tensors), and the symbols' ranges
    ``{symbol: (lo or None, hi or None)}``. Raises nothing."""
    user = set(ep.graph_signature.user_inputs)
    placeholders = [n for n in ep.graph.nodes if n.op == "placeholder" and n.name in user]
    specs = []
    for t, name, n in zip(leaves, names, placeholders):
        val = n.meta.get("val")
        shape = tuple(t.shape) if val is None else tuple(
            d.node.expr if isinstance(d, torch.SymInt) else int(d) for d in val.shape)
        specs.append(_InputSpec(name, shape, t.dtype))
    ranges = {}
    for sym, r in ep.range_constraints.items():
        try:
            ranges[sym] = (range_bound(r.lower), range_bound(r.upper))
        except (TypeError, ValueError):
            ranges[sym] = (None, None)
    return specs, ranges


def check_leaves(which: str, leaves: list, specs: list[_InputSpec], ranges: dict) -> None:
    """Refuse ``leaves`` (the input ``which``, e.g. ``"check_inputs[0]"``) unless they fit ``specs`` and ``ranges``
    (:func:`input_specs`): a size the compiled code does not expect aborts the process.

    Raises:
        MlirExportError: another number of tensors, dtype or rank; a static dim of another size; a dynamic dim
            outside its range (or below 2); tied dims of different sizes.
    """
    if len(leaves) != len(specs):
        raise MlirExportError(f"{which} has {len(leaves)} tensors; the module takes {len(specs)} "
                              f"({', '.join(s.name for s in specs)}): give the same arguments as the example")
    bound: dict = {}
    for t, spec in zip(leaves, specs):
        if not isinstance(t, torch.Tensor):
            raise MlirExportError(f"{which}: {spec.name} is a {type(t).__name__}, not a tensor")
        if t.dtype != spec.dtype:
            raise MlirExportError(f"{which}: {spec.name} is {t.dtype}; the module takes {spec.dtype} (the example's "
                                  f"dtype): convert it (e.g. .to({spec.dtype})) or export with an example of that "
                                  "dtype")
        want = "(" + ", ".join(str(d) if isinstance(d, int) else "?" for d in spec.shape) + ")"
        if t.dim() != len(spec.shape):
            raise MlirExportError(f"{which}: {spec.name} has shape {tuple(t.shape)}; the module takes {want}")
        for d, (size, dim) in enumerate(zip(t.shape, spec.shape)):
            if isinstance(dim, int):
                if size != dim:
                    raise MlirExportError(
                        f"{which}: {spec.name} has shape {tuple(t.shape)}; the module takes {want}, dim {d} static: "
                        f"export with dynamic_shapes={{{spec.name!r}: {{{d}: ...}}}} to run other sizes there")
                continue
            if getattr(dim, "is_Symbol", False):
                lo, hi = ranges.get(dim, (None, None))
                lo = 2 if lo is None else max(lo, 2)         # torch-mlir assumes a dynamic dim is not 1
                if size < lo or (hi is not None and size > hi):
                    raise MlirExportError(
                        f"{which}: {spec.name} dim {d} has size {size}; the module was exported for sizes "
                        + (f"{lo} and up" if hi is None else f"{lo} to {hi}")
                        + " there (a dynamic dim never takes sizes 0 or 1)")
                if bound.setdefault(dim, size) != size:
                    raise MlirExportError(f"{which}: {spec.name} dim {d} has size {size}, another input's dim "
                                          f"of the same dynamic size has {bound[dim]} (the module ties them)")
    for t, spec in zip(leaves, specs):                   # dims derived from the symbols (e.g. 2*s0)
        for d, (size, dim) in enumerate(zip(t.shape, spec.shape)):
            if isinstance(dim, int) or getattr(dim, "is_Symbol", False):
                continue
            if dim.free_symbols <= set(bound):
                want = int(dim.subs(bound))
                if size != want:
                    raise MlirExportError(f"{which}: {spec.name} dim {d} has size {size}; the module expects "
                                          f"{dim} = {want} there")


def check_input_leaves(model: nn.Module, check_inputs) -> list[list[torch.Tensor]]:
    """``check_inputs`` (a list of ``(args, kwargs)``, or one bare pair) as flattened tensor lists; ValueError
    for an entry that is not a pair."""
    check_inputs = check_inputs or ()
    if isinstance(check_inputs, tuple) and len(check_inputs) == 2 and isinstance(check_inputs[1], dict):
        check_inputs = [check_inputs]                          # one (args, kwargs) given bare
    out = []
    for j, item in enumerate(check_inputs):
        if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[1], dict)):
            raise ValueError(f"check_inputs[{j}] must be an (args, kwargs) pair, e.g. ((), {{'input_ids': ids}}); "
                             f"got {type(item).__name__}")
        more_args, more_kwargs = item
        more_args = tuple(more_args) if isinstance(more_args, (tuple, list)) else (more_args,)
        out.append(input_leaves(model, more_args, dict(more_kwargs))[0])
    return out


def runnable(leaves: list[torch.Tensor], model: nn.Module) -> bool:
    """Whether the JIT can run the module: no bfloat16 tensor (its descriptors go through numpy, which lacks it)."""
    return not any(t.dtype == torch.bfloat16 for t in (*leaves, *model.parameters(), *model.buffers()))


def reference_outputs(module: nn.Module, leaves: list[torch.Tensor], which: str) -> list[torch.Tensor]:
    """The output tensors of ``module`` (the rewritten graph) run in eager PyTorch on ``leaves``; MlirExportError
    when the model rejects them, so that they never reach the compiled code."""
    try:
        with torch.no_grad():
            ref = module(*leaves)
    except Exception as e:  # noqa: BLE001 - the model's own error on these inputs
        raise MlirExportError(f"{which}: the model itself fails on it in PyTorch ({one_line(e)}), so the module "
                              "is not run on it (an out-of-range index aborts compiled code)") from e
    return [t.detach().cpu() for t in pytree.tree_leaves(ref) if isinstance(t, torch.Tensor)]


def run_and_compare(compiled, leaves: list[torch.Tensor], ref_leaves: list[torch.Tensor], rtol: float,
                    atol: float, which: str = "the example") -> float:
    """Largest ``|module - eager|`` (in fp64) of ``compiled`` (a ``LinalgModule``) run on ``leaves`` against
    ``ref_leaves``; MlirExportError when the run fails or outputs differ in number, shape, dtype or value."""
    import numpy as np

    from .run import RunError

    try:
        got = compiled.run(*[t.detach().cpu().numpy() for t in leaves])
    except RunError as e:
        raise MlirExportError(f"{which}: the linalg-on-tensors module did not run: {e}") from e
    if len(got) != len(ref_leaves):
        raise MlirExportError(f"the MLIR module returns {len(got)} tensors, the model {len(ref_leaves)} (outputs the "
                              "graph does not compute, such as an input returned as it is, are not part of an export)")
    worst = 0.0
    for i, (g, r) in enumerate(zip(got, ref_leaves)):
        r = r.detach().cpu()
        g = torch.from_numpy(np.asarray(g))
        if g.dtype != r.dtype and g.element_size() == r.element_size() and not r.dtype.is_floating_point:
            g = g.view(r.dtype)                           # e.g. ui8 results read back as i8
        if tuple(g.shape) != tuple(r.shape):
            raise MlirExportError(f"{which}, output {i}: the module gives shape {tuple(g.shape)}, eager "
                                  f"{tuple(r.shape)}")
        if g.dtype != r.dtype:
            raise MlirExportError(f"{which}, output {i}: the module gives {g.dtype}, eager {r.dtype}")
        d, why = compare_arrays(g.double().numpy(), r.double().numpy(), rtol, atol, "the module")
        if why:
            raise MlirExportError(f"{which}, output {i}: the linalg-on-tensors module {why}")
        worst = max(worst, d)
    return worst


__all__ = ["op_counts", "reparse", "input_specs", "check_leaves", "check_input_leaves", "runnable", "reference_outputs", "run_and_compare"]
