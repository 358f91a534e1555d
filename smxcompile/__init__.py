"""smxcompile: a torch.compile backend that rewrites softmax-shaped subgraphs into fused kernels.

Use it as ``torch.compile(model, backend="smx")``; see what it does with
``print(smxcompile.explain(model, *example_inputs))``.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

from .kernels.softmax import log_softmax, softmax  # noqa: E402  (registers the smx:: ops)
from .kernels.cross_entropy import CrossEntropyOutput, cross_entropy, linear_cross_entropy  # noqa: E402
from .kernels.attention import NORMALIZERS, attention  # noqa: E402
from .kernels.softmax_topk import softmax_topk  # noqa: E402
from .kernels.sampling import sample  # noqa: E402
from .kernels.quant_softmax import quant_softmax  # noqa: E402
from .options import REWRITE_KINDS, SmxOptions  # noqa: E402
from .report import Report, Site  # noqa: E402
from .explain import explain  # noqa: E402  (eager: the name is also its module's, which an import would rebind)
from .edit import variants  # noqa: E402  (the registry of normalization variants: smxcompile.variants.names())

#: Names imported on first use (PEP 562): the backend pulls in Inductor and Dynamo, ``distributed`` DTensor,
#: the export and edit entry points their own stacks; ``import smxcompile`` stays within ~0.5 s of ``import torch``.
_LAZY = {
    "smx_backend": ".backends.smx",
    "quantize_softmax": ".edit.quantize",
    "swap": ".edit.swap",
    "from_pretrained": ".edit.swap_io",
    "load": ".edit.swap_io",
    "save": ".edit.swap_io",
    "export_onnx": ".export.onnx.export",
    "OnnxExportError": ".export.onnx.result",
    "export_mlir": ".export.mlir.export",
    "MlirExportError": ".export.mlir.result",
}


def __getattr__(name: str):
    if name == "distributed":  # vocabulary-parallel cut cross-entropy, CollectiveCounter
        return importlib.import_module(".distributed", __name__)
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'smxcompile' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY) | {"distributed"})


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
        from .backends.smx import smx_backend

        register_backend(compiler_fn=smx_backend, name="smx")


_register_backend_if_needed()

__all__ = ["softmax", "log_softmax", "distributed", "softmax_topk", "sample", "quant_softmax", "quantize_softmax", "variants", "swap", "save", "load", "from_pretrained", "export_onnx", "OnnxExportError", "export_mlir", "MlirExportError", "attention", "NORMALIZERS", "cross_entropy", "linear_cross_entropy", "CrossEntropyOutput", "explain", "Report", "Site", "SmxOptions", "REWRITE_KINDS",
           "smx_backend", "last_report", "__version__"]
