"""The baseline of ``export_onnx(..., compare=True)``: the plain ``torch.onnx.export``, timed against the file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from ..capture import logging_functions
from ..inputs import forward_arguments, input_leaves, named_dims
from .result import OnnxBaseline, OnnxExport, count_op_types
from .runtime import ort_feeds, ort_session, time_sessions
from .target import OnnxTarget


def plain_export(model: nn.Module, args: tuple, kwargs: dict, path: Path, opset: int | None = None,
                 dynamic_shapes: Any = None) -> None:
    """``torch.onnx.export(model, dynamo=True, optimize=True)`` of the model as written to ``path``, with
    ``dynamic_shapes`` as :func:`smxcompile.export_onnx` takes it; raises what torch.onnx raises."""
    if dynamic_shapes is not None:
        frame = forward_arguments(model, args, kwargs)
        named = named_dims(model, args, kwargs, dynamic_shapes)
        dynamic_shapes = {k: named.get(k) for k in frame if isinstance(frame[k], torch.Tensor) or k in named}
    with torch.no_grad(), torch._dynamo.config.patch(ignore_logging_functions=logging_functions()):
        torch.onnx.export(model, args, kwargs=kwargs, dynamo=True, opset_version=opset, optimize=True,
                          dynamic_shapes=dynamic_shapes, verbose=False).save(str(path))


def compare_with_plain(out: OnnxExport, model: nn.Module, args: tuple, kwargs: dict, tgt: OnnxTarget, threads: int,
                       dynamic_shapes: Any = None) -> None:
    """Fill ``out.baseline`` and ``out.latency_ms``: the plain export (same opset and dynamic dims, else static)
    and the file timed in turn; a failing plain export is recorded in ``out.baseline.error``, not raised."""
    import tempfile

    import onnx

    leaves, names = input_leaves(model, args, kwargs)
    with tempfile.TemporaryDirectory() as tmp:
        plain = Path(tmp) / "plain.onnx"
        try:
            dynamic = dynamic_shapes is not None
            try:
                plain_export(model, args, kwargs, plain, tgt.opset, dynamic_shapes)
            except Exception:  # noqa: BLE001 - e.g. a raw model whose export wants use_cache handled; try static
                if not dynamic:
                    raise
                dynamic = False
                plain_export(model, args, kwargs, plain, tgt.opset)
            base = OnnxBaseline(op_types=count_op_types(onnx.load(str(plain), load_external_data=False)),
                                dynamic=dynamic)
            plain_sess = ort_session(plain, threads)
            plain_feeds = ort_feeds(plain_sess, leaves, names)
        except Exception as e:  # noqa: BLE001 - a model torch cannot export plainly is a finding, not a crash
            out.baseline = OnnxBaseline(op_types={}, error=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
            sess = ort_session(out.path, threads)
            out.latency_ms = time_sessions({"smx": (sess, ort_feeds(sess, leaves, names))})["smx"]
            return
        sess = ort_session(out.path, threads)
        ms = time_sessions({"plain": (plain_sess, plain_feeds), "smx": (sess, ort_feeds(sess, leaves, names))})
    base.latency_ms = ms["plain"]
    out.baseline, out.latency_ms = base, ms["smx"]


__all__ = ["plain_export", "compare_with_plain"]
