"""The lowering of an MLIR export: the decomposition table, torch-mlir's import and pipelines (``torch_mlir.fx``;
the ``has_value_semantics`` hook of its ``ReduceOpVariants`` pass), and buffers made persistent for its importer.
Why each change to torch-mlir's table: docs/DESIGN.md, 'MLIR export: lowering and checks'."""

from __future__ import annotations

import contextlib
import math
import os
import re
import tempfile

import torch
import torch.nn as nn

from .result import MlirExportError, one_line


def smx_ops(gm: torch.fx.GraphModule) -> list[tuple[str, str]]:
    """``(op name, node name)`` of every smx op call in the graph (``("smx::softmax", "softmax_1")``)."""
    return [(f"smx::{n.target._opname}", n.name) for n in gm.graph.nodes
            if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
            and n.target.namespace == "smx"]


def _isfinite(x):
    """``aten.isfinite`` as ``|x| < inf`` (False for NaN and +-inf), for ``linalg-on-tensors``, which lacks it."""
    if not x.dtype.is_floating_point:
        return torch.ones_like(x, dtype=torch.bool)
    return torch.abs(x) < float("inf")


def _sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """``aten.scaled_dot_product_attention`` materialized as torch 2.13 computes it (fully masked rows 0), in the
    fused CPU kernel's memory layout (B, L, H, E) so the model's later ``.view`` still traces."""
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
    """SDPA for ``linalg-on-tensors``: kept whole (``NotImplemented``, torch.export's "preserve this op") where
    torch-mlir's ``tm_tensor.attention`` is exact (no mask, the default scale, fp32), else :func:`_sdpa`."""
    if (attn_mask is None and dropout_p == 0 and query.dtype == torch.float32
            and _default_scale(scale, query.shape[-1])):
        return NotImplemented
    return _sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def decomposition_table_for(decompose: bool, output_type: str = "torch") -> dict:
    """The table for ``ExportedProgram.run_decompositions``: a copy of torch-mlir's, SDPA kept whole or
    materialized per ``output_type``, ``aten.isfinite`` for ``linalg-on-tensors``, and with ``decompose`` every
    smx op's reference form. ImportError without torch-mlir."""
    from torch_mlir.extras.fx_decomp_util import get_decomposition_table

    table = dict(get_decomposition_table())       # a copy: torch-mlir caches (and shares) its table
    # torch-mlir's math-kernel decomposition of SDPA breaks the model's later .view (other output strides)
    sdpa = torch.ops.aten.scaled_dot_product_attention.default
    table.pop(sdpa, None)
    if output_type == "stablehlo":
        table[sdpa] = _sdpa
    elif output_type == "linalg-on-tensors":
        table[sdpa] = _sdpa_linalg
    if output_type == "linalg-on-tensors":
        table[torch.ops.aten.isfinite.default] = _isfinite
    if decompose:
        from ...kernels.decompositions import decomposition_table

        table.update(decomposition_table())
    return table


def _value_semantics_library(op_names: list[str]) -> str:
    """An extra library declaring ``torch.operator`` names (``torch.smx.softmax``) value-semantic, so torch-mlir's
    backend-contract pipeline keeps them."""
    funcs = "".join(f'  func.func @"__torch_mlir_has_value_semantics_fn.{n}"() {{\n    return\n  }}\n'
                    for n in sorted(set(op_names)))
    return "module {\n" + funcs + "}\n"


_DIAG_OP = (re.compile(r"Unimplemented operator '([^']+)'"),
            re.compile(r"failed to legalize operation '([^']+)'"),
            re.compile(r"'([a-z_]+\.[\w.]+)' op"))


def _failing_op(diags: list[str]) -> str | None:
    """The op a torch-mlir diagnostic is about; a ``torch.operator`` by its ``name`` (``torch.operator
    "torch.aten.cummax"``)."""
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


def lower_program(ep, output_type: str, custom: list[str]):
    """The ``torch_mlir.ir.Module`` of ``ep`` (decomposed) lowered to ``output_type``, the smx ops of ``custom``
    (``"smx::softmax"``) kept as ``torch.operator``; MlirExportError naming the op torch-mlir fails on."""
    from torch_mlir import fx
    from torch_mlir.compiler_utils import TorchMlirCompilerError
    from torch_mlir.extras.fx_importer import FxImporter

    from .run import new_context

    ctx = new_context()
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
        raise MlirExportError(f"torch-mlir's FX importer failed on the exported program: {one_line(e)}"
                              + (f" ({diags[0][:300]})" if diags else "")
                              + "; export the site unrewritten (options={'cpu': 'rewrite', 'disable': [...]}) "
                              "or the model with plain torch_mlir.fx.export_and_import to tell whether "
                              "smxcompile's graph is the cause") from e
    finally:
        handler.detach()
        if lib_path is not None:
            os.unlink(lib_path)


@contextlib.contextmanager
def persistent_buffers(module: nn.Module):
    """Every buffer of ``module`` persistent while the block runs (torch-mlir's importer reads the state dict
    only), as it was afterwards; only ``_non_persistent_buffers_set`` is touched."""
    saved = [(m, set(m._non_persistent_buffers_set)) for m in module.modules() if m._non_persistent_buffers_set]
    try:
        for m, _ in saved:
            m._non_persistent_buffers_set.clear()
        yield
    finally:
        for m, names in saved:
            m._non_persistent_buffers_set.clear()
            m._non_persistent_buffers_set.update(names)


__all__ = ["smx_ops", "decomposition_table_for", "lower_program", "persistent_buffers"]
