"""What :func:`smxcompile.export_onnx` returns and raises, and the op counts read back from the written file."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from ...report import Report
from .. import ExportError
from .target import OnnxTarget


class OnnxExportError(ExportError):
    """An export that cannot be done or that failed its check (the capture's errors too); the message says why."""


@dataclasses.dataclass
class OnnxBaseline:
    """The plain ``torch.onnx.export`` of the same model (``compare=True``): its ``op_types``, ``latency_ms``
    (onnxruntime CPU, ms per call), why it failed (``error``), and whether it kept the dynamic dims (``dynamic``;
    False: static, which favours it)."""

    op_types: dict[str, int]
    latency_ms: float | None = None
    error: str | None = None
    dynamic: bool = False


@dataclasses.dataclass
class OnnxExport:
    """What :func:`smxcompile.export_onnx` wrote and checked; ``print()`` it for the report.

    ``max_abs_diff``: largest ``|onnxruntime - eager|`` (NaN without a check), over ``checked_shapes``.
    ``exported``: how each smx op and SDPA reached the file, ``{"smx::softmax_topk": {"calls": 1, "onnx": {...}}}``.
    ``latency_ms`` and ``baseline`` come with ``compare=True``.
    """

    path: Path
    report: Report
    op_types: dict[str, int]
    max_abs_diff: float
    opset: int
    target: OnnxTarget | None = None
    exported: dict[str, dict] = dataclasses.field(default_factory=dict)
    latency_ms: float | None = None
    baseline: OnnxBaseline | None = None
    checked_shapes: list = dataclasses.field(default_factory=list)
    dynamic: bool = False

    def summary(self) -> str:
        """The report as text: rewrites, how each op was exported, op types and latencies (before / after)."""
        t = self.target
        lines = [str(self.report), "",
                 f"wrote {self.path} (opset {self.opset}" + (f", target {t.name}" if t else "")
                 + (f", attention as {t.attention}" if t and any("attention" in k for k in self.exported) else "")
                 + ")" + ("" if math.isnan(self.max_abs_diff) else f"; onnxruntime vs eager max |diff| {self.max_abs_diff:.3g} "
                         f"on input shapes {', '.join(str(list(s)) for s in self.checked_shapes)}")]
        if self.exported:
            lines.append("exported as:")
            for name, e in self.exported.items():
                ops = ", ".join(f"{k} {v}" for k, v in sorted(e["onnx"].items()))
                what = " (what fused softmax attention sites call)" if name.startswith("aten::") else ""
                lines.append(f"  {name}{what} x{e['calls']} -> {ops}")
        b = self.baseline
        if b is None:
            lines.append("ONNX op types: " + ", ".join(f"{k} {v}" for k, v in sorted(self.op_types.items())))
        else:
            lines.append("ONNX op types (plain torch.onnx.export" + (", static shapes (it could not export the dynamic "
                         "dims)" if self.dynamic and not b.dynamic else "") + " -> smxcompile export):")
            for k in sorted(set(b.op_types) | set(self.op_types)):
                before, after = b.op_types.get(k, 0), self.op_types.get(k, 0)
                if b.error or before != after:
                    lines.append(f"  {k:<24} {before if not b.error else '-':>5} -> {after}")
            lines.append(f"  {'nodes':<24} {sum(b.op_types.values()) if not b.error else '-':>5} -> "
                         f"{sum(self.op_types.values())} (op types with equal counts not listed)")
            if b.error:
                lines.append(f"plain export failed: {b.error}")
            elif b.latency_ms is not None and self.latency_ms is not None:
                lines.append(f"onnxruntime CPU latency: plain {b.latency_ms:.3f} ms, smxcompile {self.latency_ms:.3f} ms "
                             f"({self.latency_ms / b.latency_ms:.2f}x)")
        return "\n".join(lines)

    __str__ = summary

    def to_dict(self) -> dict:
        """The export as JSON-ready data."""
        return {"path": str(self.path), "opset": self.opset, "target": dataclasses.asdict(self.target) if self.target else None,
                "max_abs_diff": None if math.isnan(self.max_abs_diff) else self.max_abs_diff, "op_types": self.op_types,
                "exported": self.exported, "latency_ms": self.latency_ms,
                "baseline": dataclasses.asdict(self.baseline) if self.baseline else None,
                "checked_shapes": [[list(t) for t in s] for s in self.checked_shapes],
                "report": self.report.to_dict()}


def count_op_types(proto) -> dict[str, int]:
    """``{ONNX op type: count}`` over the top-level graph of ``proto`` (an ``onnx.ModelProto``)."""
    out: dict[str, int] = {}
    for node in proto.graph.node:
        out[node.op_type] = out.get(node.op_type, 0) + 1
    return out


def exported_ops(proto) -> dict[str, dict]:
    """``{"smx::<op>": {"calls": n, "onnx": {op_type: count}}}`` (SDPA too) from the exporter's node metadata
    in ``proto``, nodes without it skipped."""
    import ast

    found: dict[str, dict] = {}
    calls: dict[str, set] = {}
    for node in proto.graph.node:
        props = {p.key: p.value for p in node.metadata_props}
        try:
            source = ast.literal_eval(props.get("pkg.torch.onnx.class_hierarchy", "[]"))[-1]
        except (ValueError, SyntaxError, IndexError):
            continue
        ns, _, rest = str(source).partition(".")
        opname = rest.split(".")[0]
        if not (ns == "smx" or (ns == "aten" and opname == "scaled_dot_product_attention")):
            continue
        name = f"{ns}::{opname}"
        entry = found.setdefault(name, {"calls": 0, "onnx": {}})
        entry["onnx"][node.op_type] = entry["onnx"].get(node.op_type, 0) + 1
        calls.setdefault(name, set()).add(props.get("pkg.torch.onnx.fx_node", "").split(" ", 1)[0])
    for name, entry in found.items():
        entry["calls"] = len(calls[name])
    return dict(sorted(found.items()))


__all__ = ["OnnxExportError", "OnnxBaseline", "OnnxExport", "count_op_types", "exported_ops"]
