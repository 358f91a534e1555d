"""The translation table of an ONNX export, gathered from the modules of :data:`TRANSLATION_MODULES` (each with
``translations(target)`` and ``refuse(name, args, node)``, see :mod:`.softmax`), and the refusals."""

from __future__ import annotations

from typing import Any

import torch

from ..capture import rewrite_kind
from .result import OnnxExportError


#: The per-op-family translation modules.
TRANSLATION_MODULES = ("softmax", "cross_entropy", "attention")


def _modules() -> list:
    import importlib

    return [importlib.import_module(f"{__package__}.{m}") for m in TRANSLATION_MODULES]


def translation_table(target=None) -> dict[Any, Any]:
    """``torch.onnx.export``'s ``custom_translation_table`` for ``target`` (an ``OnnxTarget``; None: portable
    forms); ImportError without onnx / onnxscript."""
    table: dict[Any, Any] = {}
    for m in _modules():
        table.update(m.translations(target))
    return table


def check_graph(gm: torch.fx.GraphModule, table: dict) -> None:
    """OnnxExportError for a call in ``gm`` (the exported program's) that ``table`` cannot translate: attention
    with ``dropout_p > 0``, an smx op without translation (naming the option that exports it unrewritten), or
    a call a module's ``refuse`` turns down."""
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
                                  f"options={{'cpu': 'rewrite', 'disable': ['{rewrite_kind(name)}']}} to export that "
                                  "site unrewritten")
        for m in modules:
            why = m.refuse(name, args, n)
            if why:
                raise OnnxExportError(f"smx::{name} (node {n.name}) {why}")


__all__ = ["TRANSLATION_MODULES", "translation_table", "check_graph"]
