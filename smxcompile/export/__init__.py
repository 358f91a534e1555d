"""Export of the *rewritten* model: ``smxcompile.export_onnx`` and ``smxcompile.export_mlir``.

Both start from the same capture (:mod:`.capture`: Dynamo traces the model as one graph, smxcompile's passes
rewrite it as the ``smx`` backend does, and the parameters become attributes again), with the inputs
flattened and their dynamic dims resolved by :mod:`.inputs` and outputs compared by :mod:`.compare`; then
:mod:`.onnx` (``torch.onnx.export`` with a translation per smx op, checked in onnxruntime) and :mod:`.mlir`
(torch-mlir, checked on MLIR's JIT). Nothing here is imported by the compiler (backends, passes, kernels).
"""

from __future__ import annotations


class ExportError(RuntimeError):
    """An export that cannot be done or that failed its check; the message names the op or input and the reason.

    Raised by the shared capture (a graph break, a bad ``dynamic_shapes``, a graph input from outside the
    model's arguments, an unknown rewrite kind); :class:`smxcompile.OnnxExportError` and
    :class:`smxcompile.MlirExportError` subclass it, and each export re-raises the capture's errors as its own.
    """


__all__ = ["ExportError"]
