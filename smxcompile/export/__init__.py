"""Export of the *rewritten* model: ``smxcompile.export_onnx`` (:mod:`.onnx`) and ``smxcompile.export_mlir``
(:mod:`.mlir`), from one capture (:mod:`.capture`, :mod:`.inputs`). The compiler never imports this package."""

from __future__ import annotations


class ExportError(RuntimeError):
    """An export that cannot be done or failed its check (the message says why); each export re-raises the
    shared capture's as its own subclass, :class:`smxcompile.OnnxExportError` or :class:`smxcompile.MlirExportError`."""


__all__ = ["ExportError"]
