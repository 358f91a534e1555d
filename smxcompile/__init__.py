"""smxcompile: a torch.compile backend that rewrites softmax-shaped subgraphs into fused kernels.

Use it as ``torch.compile(model, backend="smx")``; see what it does with
``print(smxcompile.explain(model, *example_inputs))``.
"""

from __future__ import annotations

__version__ = "0.1.0"

from .kernels.softmax import log_softmax, softmax  # noqa: E402  (registers the smx:: ops)
from .kernels.cross_entropy import CrossEntropyOutput, cross_entropy, linear_cross_entropy  # noqa: E402
from .kernels.attention import NORMALIZERS, attention  # noqa: E402
from .kernels.softmax_topk import softmax_topk  # noqa: E402
from .kernels.quant_softmax import quant_softmax  # noqa: E402
from .options import REWRITE_KINDS, SmxOptions  # noqa: E402
from .report import Report, Site  # noqa: E402
from .explain import explain  # noqa: E402
from .edit.quantize import quantize_softmax  # noqa: E402
from . import distributed  # noqa: E402  (vocabulary-parallel cut cross-entropy, CollectiveCounter)
from .edit import variants  # noqa: E402  (the registry of normalization variants: smxcompile.variants.names())
from .edit.swap import swap  # noqa: E402
from .edit.swap_io import from_pretrained, load, save  # noqa: E402
from .backends.smx import smx_backend  # noqa: E402
from .export.onnx.export import export_onnx  # noqa: E402  (onnx itself is imported on use)
from .export.onnx.result import OnnxExportError  # noqa: E402
from .export.mlir.export import export_mlir  # noqa: E402  (torch-mlir itself is imported on use)
from .export.mlir.result import MlirExportError  # noqa: E402


def last_report() -> Report | None:
    """The report of the most recent graph the ``smx`` backend compiled in this process (or None)."""
    from .backends.smx import compiled_reports

    return compiled_reports[-1] if compiled_reports else None


def _register_backend_if_needed() -> None:
    """Register ``backend="smx"`` when smxcompile is imported without being installed.

    Installed, the ``torch_dynamo_backends`` entry point registers it lazily; registering it
    a second time here would fail with torch's ``duplicate name`` error, so we only register
    when no entry point named ``smx`` exists.
    """
    from importlib.metadata import entry_points

    if any(ep.name == "smx" for ep in entry_points(group="torch_dynamo_backends")):
        return
    from torch._dynamo.backends.registry import _COMPILER_FNS, register_backend

    if "smx" not in _COMPILER_FNS:
        register_backend(compiler_fn=smx_backend, name="smx")


_register_backend_if_needed()

__all__ = ["softmax", "log_softmax", "distributed", "softmax_topk", "quant_softmax", "quantize_softmax", "variants", "swap", "save", "load", "from_pretrained", "export_onnx", "OnnxExportError", "export_mlir", "MlirExportError", "attention", "NORMALIZERS", "cross_entropy", "linear_cross_entropy", "CrossEntropyOutput", "explain", "Report", "Site", "SmxOptions", "REWRITE_KINDS",
           "smx_backend", "last_report", "__version__"]
