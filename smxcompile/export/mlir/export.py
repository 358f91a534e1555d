"""MLIR export of the *rewritten* model through torch-mlir: ``smxcompile.export_mlir``.

How. The model is captured and rewritten exactly as :func:`smxcompile.export_onnx` does it
(:func:`smxcompile.backends.onnx.capture`: one Dynamo graph, smxcompile's passes, the parameters as
attributes again), exported with ``torch.export``, and handed to ``torch_mlir.fx.export_and_import``:

* ``decompose=True`` (default): each ``torch.ops.smx.*`` call is first replaced by its reference ATen
  form (:mod:`smxcompile.kernels.decompositions`, through ``ExportedProgram.run_decompositions``
  together with torch-mlir's own decomposition table), so the module holds only ops torch-mlir lowers;
  any output type works. Two changes to torch-mlir's table: ``aten.scaled_dot_product_attention`` (what
  softmax attention sites become) is not decomposed through the math kernel, whose output strides break
  the model's later ``.view``; it stays one op in ``torch``, and is materialized as torch defines it, in
  the fused kernel's layout (:func:`_sdpa`), for ``stablehlo`` (no lowering of the op there) and for
  ``linalg-on-tensors`` whenever torch-mlir's own lowering (``tm_tensor.attention``) would be wrong: with
  any mask (it gives fully masked rows -- left padding -- other values than torch), a non-default scale
  (it scales by ``1/sqrt(E)`` whatever ``scale`` says), or a dtype other than fp32
  (:func:`_sdpa_linalg`); ``aten.isfinite`` (row maxima of the attention variants)
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
(:mod:`.mlir_run`) on the example inputs and compared with the rewritten graph run in eager PyTorch
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

import contextlib
import dataclasses
import math
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from ..report import Report
# The capture is export_onnx's (imported where used, so that ``import smxcompile`` never depends on it):
# ``capture`` (Dynamo + smx passes -> an nn.Module for torch.export), ``input_leaves`` / ``_leaf_shapes``
# (the flattened inputs and their dynamic dims), ``_export_ops`` (rewritten sites call the smx ops).

__all__ = ["export_mlir", "MlirExport", "MlirExportError", "OUTPUT_TYPES"]

#: The output types :func:`export_mlir` writes (torch-mlir's names).
OUTPUT_TYPES = ("torch", "linalg-on-tensors", "stablehlo")

_INSTALL = "pip install smxcompile[mlir]"


class MlirExportError(RuntimeError):
    """An export that cannot be done, failed to lower, or failed its check; the message names the op."""


@dataclasses.dataclass
class MlirExport:
    """What :func:`export_mlir` produced and checked.

    Attributes:
        text: the MLIR module (textual form). report: the rewrite report of the exported graph.
        output_type: ``torch``, ``linalg-on-tensors`` or ``stablehlo``. decomposed: whether the smx ops
            were replaced by their reference forms.
        ops: ``{operation name: count}`` over the whole module (``func.func`` included); a
            ``torch.operator`` is counted under ``torch.operator "<its name>"``, e.g.
            ``torch.operator "torch.smx.softmax"``.
        path: the file written, or None.
        checked: ``"run"`` (JIT-run and compared with eager), ``"verified"`` (parsed and verified
            only), or ``"none"`` (``check=False``).
        max_abs_diff: largest ``|module - eager|`` over the outputs when run, else NaN.
    """

    text: str
    report: Report
    output_type: str
    decomposed: bool
    ops: dict[str, int]
    path: Path | None = None
    checked: str = "none"
    max_abs_diff: float = math.nan

    @property
    def custom_ops(self) -> dict[str, int]:
        """``{name: count}`` of the ``torch.operator`` ops left in the module (e.g. ``torch.smx.softmax``)."""
        out = {}
        for k, n in self.ops.items():
            m = re.fullmatch(r'torch\.operator "(.*)"', k)
            if m:
                out[m.group(1)] = n
        return out

    def __str__(self) -> str:
        return self.text

    def __repr__(self) -> str:
        return (f"MlirExport(output_type={self.output_type!r}, decomposed={self.decomposed}, checked={self.checked!r}, "
                f"max_abs_diff={self.max_abs_diff:.3g}, {sum(self.ops.values())} ops, custom_ops={self.custom_ops}, "
                f"{len(self.text)} chars{'' if self.path is None else f', path={str(self.path)!r}'})")


def _import_torch_mlir():
    try:
        from torch_mlir import fx, ir  # noqa: F401
        from torch_mlir.compiler_utils import OutputType, TorchMlirCompilerError  # noqa: F401
    except ImportError as e:
        raise ImportError(f"smxcompile.export_mlir needs torch-mlir: {_INSTALL} ({e})") from e
    import torch_mlir

    return torch_mlir


# --------------------------------------------------------------------------- counting and checking


def _walk(op, fn) -> None:
    fn(op)
    for region in op.regions:
        for block in region.blocks:
            for child in block.operations:
                _walk(child.operation, fn)


def _op_counts(module) -> dict[str, int]:
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


def _context():
    from .mlir_run import new_context

    return new_context()


def _reparse(text: str) -> dict[str, int]:
    """Parse ``text`` in a fresh context and verify it; its op counts."""
    from torch_mlir import ir

    ctx = _context()
    diags: list[str] = []
    handler = ctx.attach_diagnostic_handler(lambda d: diags.append(str(d.message)) or True)
    try:
        with ctx:
            module = ir.Module.parse(text)
            if not module.operation.verify():
                raise MlirExportError("the exported module does not verify: " + "; ".join(diags[:3]))
            return _op_counts(module)
    except MlirExportError:
        raise
    except Exception as e:
        raise MlirExportError("the exported module does not parse back: " + ("; ".join(diags[:3]) or str(e))) from e
    finally:
        handler.detach()


# --------------------------------------------------------------------------- lowering


def _smx_ops(gm: torch.fx.GraphModule) -> list[tuple[str, str]]:
    """``(op name, node name)`` of every smx op call in the graph."""
    return [(f"smx::{n.target._opname}", n.name) for n in gm.graph.nodes
            if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
            and n.target.namespace == "smx"]


def _isfinite(x):
    """``aten.isfinite`` for ``linalg-on-tensors``, where torch-mlir has no lowering of it (and keeps it out
    of its decomposition table for StableHLO's sake): ``|x| < inf`` is False for NaN and +-inf."""
    if not x.dtype.is_floating_point:
        return torch.ones_like(x, dtype=torch.bool)
    return torch.abs(x) < float("inf")


def _sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """``aten.scaled_dot_product_attention`` materialized, as torch defines it (its math, fully masked rows
    giving 0 as the op does in torch 2.13; a row whose mask entries are all ``finfo.min`` averages V, as
    torch does), returned in the fused CPU kernel's layout ((B, L, H, E) in memory) so the model's later
    ``.view`` of the output traces as it did against the fused op. For StableHLO (torch-mlir lowers the
    op itself only to ``linalg-on-tensors``) and, through :func:`_sdpa_linalg`, for every call
    ``tm_tensor.attention`` would get wrong."""
    if dropout_p > 0:
        raise NotImplementedError("aten.scaled_dot_product_attention with dropout_p > 0 (a training graph) has no "
                                  "reference form; export the model in eval mode")
    acc = torch.float64 if query.dtype == torch.float64 else torch.float32
    q, k, v = query.to(acc), key.to(acc), value.to(acc)
    L, S, E = q.shape[-2], k.shape[-2], q.shape[-1]
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
    s = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(E) if scale is None else scale)
    if is_causal:
        keep = torch.ones(L, S, dtype=torch.bool, device=q.device).tril()
        s = s.masked_fill(~keep, float("-inf"))
    if attn_mask is not None:
        s = s.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else s + attn_mask.to(acc)
    m = s.amax(-1, keepdim=True)
    # (|m| < inf: aten.isfinite has no linalg lowering)
    e = torch.exp(s - torch.where(torch.abs(m) < float("inf"), m, 0.0))
    d = e.sum(-1, keepdim=True)
    out = torch.matmul(e / torch.where(d == 0, 1.0, d), v).to(query.dtype)
    if out.dim() == 4:
        out = out.transpose(1, 2).contiguous().transpose(1, 2)
    return out


def _default_scale(scale, E) -> bool:
    """``scale`` is SDPA's default ``1/sqrt(E)`` (None, or that value as the attention pass writes it)."""
    if scale is None:
        return True
    if not isinstance(E, int):
        return False
    return abs(float(scale) * math.sqrt(E) - 1.0) < 1e-6


def _sdpa_linalg(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """SDPA for ``linalg-on-tensors``: kept whole (``NotImplemented``: torch.export's marker for "preserve
    this op") only where torch-mlir's lowering was found exact -- no mask, the default scale, fp32 (causal
    or not, grouped-query heads or not; tests/test_mlir_export.py pins these) -- and :func:`_sdpa` for
    everything else: ``tm_tensor.attention`` (torch-mlir 20261001) scales by ``1/sqrt(E)`` whatever
    ``scale`` says, and with a mask gives rows whose entries are all ``finfo.min`` (left padding) other
    values than torch, and wrong ones under a bool mask with a fully masked row."""
    if (attn_mask is None and dropout_p == 0 and query.dtype == torch.float32
            and _default_scale(scale, query.shape[-1])):
        return NotImplemented
    return _sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def _decomposition_table(decompose: bool, output_type: str = "torch") -> dict:
    from torch_mlir.extras.fx_decomp_util import get_decomposition_table

    table = dict(get_decomposition_table())       # a copy: torch-mlir caches (and shares) its table
    # SDPA (what the attention pass emits for softmax attention): torch-mlir's table entry decomposes it
    # through the math kernel, whose output strides differ from the fused kernel's, and the model's
    # ``.view`` of the output (exported where the fused layout allowed it) then fails to trace. It stays one
    # op in ``torch``; ``stablehlo`` has no lowering of it; ``linalg-on-tensors`` keeps it (tm_tensor.attention)
    # only where that lowering is exact (see _sdpa_linalg)
    sdpa = torch.ops.aten.scaled_dot_product_attention.default
    table.pop(sdpa, None)
    if output_type == "stablehlo":
        table[sdpa] = _sdpa
    elif output_type == "linalg-on-tensors":
        table[sdpa] = _sdpa_linalg
    if output_type == "linalg-on-tensors":
        table[torch.ops.aten.isfinite.default] = _isfinite
    if decompose:
        from ..kernels.decompositions import decomposition_table

        table.update(decomposition_table())
    return table


def _value_semantics_library(op_names: list[str]) -> str:
    """An extra library for torch-mlir's ``ReduceOpVariants`` that declares the given ``torch.operator``
    names (``torch.smx.softmax``) value-semantic, so the backend-contract pipeline keeps them."""
    funcs = "".join(f'  func.func @"__torch_mlir_has_value_semantics_fn.{n}"() {{\n    return\n  }}\n'
                    for n in sorted(set(op_names)))
    return "module {\n" + funcs + "}\n"


_DIAG_OP = (re.compile(r"Unimplemented operator '([^']+)'"),
            re.compile(r"failed to legalize operation '([^']+)'"),
            re.compile(r"'([a-z_]+\.[\w.]+)' op"))


def _failing_op(diags: list[str]) -> str | None:
    """The op a torch-mlir diagnostic is about; a ``torch.operator`` is named by its ``name``
    (``torch.operator "torch.aten.cummax"``: an ATen op the importer did not know)."""
    for d in diags:
        for pat in _DIAG_OP:
            m = pat.search(d)
            if m:
                op = m.group(1)
                if op == "torch.operator" or op.startswith("torch.smx."):
                    name = re.search(r'name = "([^"]+)"', d)
                    return f'torch.operator "{name.group(1)}"' if name else op
                return op
    return None


def _lower(ep, output_type: str, custom: list[str]):
    """torch-mlir: import ``ep`` (already decomposed) and lower it to ``output_type``; ``custom``: the smx ops
    kept as ``torch.operator``. Returns the module."""
    from torch_mlir import fx
    from torch_mlir.compiler_utils import TorchMlirCompilerError
    from torch_mlir.extras.fx_importer import FxImporter

    ctx = _context()
    diags: list[str] = []

    def collect(d):
        diags.append(f"{d.message}" + "".join(f" [{n.message}]" for n in d.notes))
        return True

    handler = ctx.attach_diagnostic_handler(collect)
    lib_path = None
    try:
        importer = FxImporter(context=ctx)
        # ({}: no second run of the decompositions, which would meet the prims ops of the first)
        if not custom:
            return fx.export_and_import(ep, output_type=output_type, fx_importer=importer, decomposition_table={})
        # smx ops kept: import, then the backend-contract pipeline with an extra library naming them
        module = fx.export_and_import(ep, output_type="raw", fx_importer=importer, decomposition_table={})
        fd, lib_path = tempfile.mkstemp(suffix=".mlir", prefix="smx_value_semantics_")
        with os.fdopen(fd, "w") as f:
            f.write(_value_semantics_library([f"torch.smx.{c.split('::', 1)[1]}" for c in custom]))
        return fx._module_lowering(False, False, fx.OutputType.get(output_type), module,
                                   fx.FxImportOptions(extra_library_file_name=lib_path))
    except TorchMlirCompilerError as e:
        op = _failing_op(diags)
        first = next((d for d in diags), str(e).strip().splitlines()[0])
        raise MlirExportError(f"torch-mlir could not lower {op or 'the module'} to {output_type}: {first[:500]}") from e
    except Exception as e:  # noqa: BLE001 - the FX importer asserts on what it does not handle
        raise MlirExportError(f"torch-mlir's FX importer failed on the exported program: {_one_line(e)}"
                              + (f" ({diags[0][:300]})" if diags else "")
                              + "; export the site unrewritten (options={'cpu': 'rewrite', 'disable': [...]}) "
                              "or the model with plain torch_mlir.fx.export_and_import to tell whether "
                              "smxcompile's graph is the cause") from e
    finally:
        handler.detach()
        if lib_path is not None:
            os.unlink(lib_path)


def _one_line(e: BaseException) -> str:
    """``Type: first line`` of an exception's message."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[0][:400]}" if lines else type(e).__name__


@contextlib.contextmanager
def _persistent_buffers(module: nn.Module):
    """Every buffer of ``module`` persistent while the block runs, and as it was afterwards: torch.export
    puts a non-persistent buffer (``rotary_emb.inv_freq`` of Llama-style models, BERT's ``position_ids`` /
    ``token_type_ids``) among the program's constants, where torch-mlir's FX importer does not look for it
    ("Could not find state mapping for buffer"); as a persistent one it is in the state dict and becomes a
    constant of the module like any other buffer. Only the modules' ``_non_persistent_buffers_set`` is
    touched (what ``state_dict`` reads); the tensors are not."""
    saved = [(m, set(m._non_persistent_buffers_set)) for m in module.modules() if m._non_persistent_buffers_set]
    try:
        for m, _ in saved:
            m._non_persistent_buffers_set.clear()
        yield
    finally:
        for m, names in saved:
            m._non_persistent_buffers_set.clear()
            m._non_persistent_buffers_set.update(names)


@dataclasses.dataclass
class _InputSpec:
    """What the exported program takes at one input: ``name`` (the forward argument), ``shape`` (ints,
    sympy expressions of the program's symbols for dynamic dims), ``dtype``."""

    name: str
    shape: tuple
    dtype: torch.dtype


def _input_specs(ep, leaves: list[torch.Tensor], names: list[str]) -> tuple[list[_InputSpec], dict]:
    """The user inputs of ``ep`` (shapes as traced: ints, or sympy expressions of its symbols) and the
    symbols' ranges ``{symbol: (lo, hi or None)}``."""
    from .onnx import _bound

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
            ranges[sym] = (_bound(r.lower), _bound(r.upper))
        except (TypeError, ValueError):
            ranges[sym] = (None, None)
    return specs, ranges


def _check_leaves(which: str, leaves: list, specs: list[_InputSpec], ranges: dict) -> None:
    """Refuse inputs the module was not exported for, before anything runs them: the compiled code trusts
    them, and a size it does not expect fails an assertion in it that aborts the process."""
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


def _check_input_leaves(model: nn.Module, check_inputs) -> list[list[torch.Tensor]]:
    """``check_inputs`` as flattened tensors, one list per ``(args, kwargs)``."""
    from . import onnx as _onnx

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
        out.append(_onnx.input_leaves(model, more_args, dict(more_kwargs))[0])
    return out


# --------------------------------------------------------------------------- export


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
        options: the ``smx`` backend options (default ``{"cpu": "rewrite"}``: every fusion kept).
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
    (:mod:`smxcompile.backends.mlir_run`) with the example inputs (and ``check_inputs``) and compared with
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
    from . import onnx as _onnx

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
                   enumerate(_check_input_leaves(model, check_inputs) if run_check else [])]
    try:
        module, report = _onnx.capture(model, args, kwargs, options, dynamic_shapes)
    except _onnx.OnnxExportError as e:
        raise MlirExportError(str(e)) from e
    leaves, names = _onnx.input_leaves(model, args, kwargs)
    shapes = _onnx._leaf_shapes(model, args, kwargs, dynamic_shapes)
    try:
        with torch.no_grad(), _onnx._export_ops(), _persistent_buffers(module):
            ep = torch.export.export(module, tuple(leaves), strict=False,
                                     dynamic_shapes=None if shapes is None else (shapes,))
    except torch.fx.experimental.symbolic_shapes.ConstraintViolationError as e:
        raise MlirExportError(f"torch.export refuses dynamic_shapes for this example: {_one_line(e)}; give an "
                              "example whose sizes lie in the declared Dim(min=, max=) range, or keep the dim "
                              "static") from e
    except Exception as e:  # noqa: BLE001 - what Dynamo captured, torch.export should take: name the cause
        raise MlirExportError(f"torch.export failed on the rewritten graph: {_one_line(e)} (check that the model "
                              "exports with torch.export.export(model, args, kwargs, strict=False); with "
                              "dynamic_shapes, try the dims static)") from e
    # the run's inputs and PyTorch's outputs on them, before the lowering: an input the module was not
    # exported for (shape, dtype) or that the model itself rejects is refused here, never run compiled
    runs: list[tuple[str, list, list]] = []
    if run_check and _runnable(leaves, model):
        specs, ranges = _input_specs(ep, leaves, names)
        for which, more in more_inputs:
            _check_leaves(which, more, specs, ranges)
        for which, ls in [("the example", leaves), *more_inputs]:
            runs.append((which, ls, _reference(module, ls, which)))
    kept = sorted({name for name, _ in _smx_ops(ep.graph_module)})
    if decompose:
        from ..kernels.decompositions import decomposition_table

        known = {f"smx::{op._opname}" for op in decomposition_table()}
        missing = [(name, node) for name, node in _smx_ops(ep.graph_module) if name not in known]
        if missing:
            name, node = missing[0]
            kind = _onnx._kind_of(name.split("::")[1])
            raise MlirExportError(f"{name} (node {node}) has no reference ATen form to decompose it into; pass "
                                  f"options={{'cpu': 'rewrite', 'disable': ['{kind}']}} to export that site "
                                  "unrewritten")
    try:
        # torch-mlir's own table (what export_and_import would apply), plus the smx ops' reference forms
        with torch.no_grad():
            ep = ep.run_decompositions(_decomposition_table(decompose, output_type))
    except NotImplementedError as e:
        raise MlirExportError(str(e)) from e
    except Exception as e:  # noqa: BLE001
        raise MlirExportError(f"decomposing the exported graph for {output_type} failed: {_one_line(e)}; with "
                              "decompose=False (output_type='torch') the smx ops are kept whole") from e
    if decompose:
        left = _smx_ops(ep.graph_module)
        if left:
            raise MlirExportError(f"{left[0][0]} (node {left[0][1]}) is still in the graph after decomposition")
        kept = []
    mod = _lower(ep, output_type, kept)
    text = str(mod)
    ops = _op_counts(mod)
    out = MlirExport(text=text, report=report, output_type=output_type, decomposed=decompose, ops=ops)
    if check:
        ops = _reparse(text)
        operators = [k for k in ops if k.startswith("torch.operator")]
        if decompose and operators:
            raise MlirExportError(f"{operators[0]} is left in the decomposed module")
        if output_type != "torch":
            torch_ops = [k for k in ops if k.startswith("torch.")]
            if torch_ops:
                raise MlirExportError(f"{torch_ops[0]} (torch dialect) is left in the {output_type} module")
        out.checked = "verified"
        if runs:
            from .mlir_run import LinalgModule, RunError

            try:
                compiled = LinalgModule(text)
            except RunError as e:
                raise MlirExportError(f"the linalg-on-tensors module did not compile for the JIT: {e}") from e
            out.max_abs_diff = max(_run_and_compare(compiled, ls, ref, rtol, atol, which) for which, ls, ref in runs)
            out.checked = "run"
    if path is not None:
        out.path = Path(path)
        out.path.parent.mkdir(parents=True, exist_ok=True)
        out.path.write_text(text)
    return out


def _runnable(leaves: list[torch.Tensor], model: nn.Module) -> bool:
    return not any(t.dtype == torch.bfloat16 for t in (*leaves, *model.parameters(), *model.buffers()))


def _reference(module: nn.Module, leaves: list[torch.Tensor], which: str) -> list[torch.Tensor]:
    """``module`` (the rewritten graph) run in eager PyTorch with smxcompile's own kernels -- the model
    itself unless ``options`` change its math (a requested attention normalizer) -- its output tensors. Run
    before the JIT: an input the model rejects (an id past the vocabulary, a sequence past the position
    table) is the model's error, raised here, and never reaches the compiled code, whose bounds assertions
    abort the process."""
    from .onnx import _export_ops

    try:
        with torch.no_grad(), _export_ops():
            ref = module(*leaves)
    except Exception as e:  # noqa: BLE001 - the model's own error on these inputs
        raise MlirExportError(f"{which}: the model itself fails on it in PyTorch ({_one_line(e)}), so the module "
                              "is not run on it (an out-of-range index aborts compiled code)") from e
    return [t.detach().cpu() for t in pytree.tree_leaves(ref) if isinstance(t, torch.Tensor)]


def _run_and_compare(compiled, leaves: list[torch.Tensor], ref_leaves: list[torch.Tensor], rtol: float,
                     atol: float, which: str = "the example") -> float:
    """Run the linalg module on the JIT on ``leaves`` and compare it with ``ref_leaves`` (:func:`_reference`)."""
    import numpy as np

    from .mlir_run import RunError
    from .onnx import compare_arrays

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
