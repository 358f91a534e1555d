"""What :func:`smxcompile.export_mlir` returns and raises."""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

from ...report import Report
from .. import ExportError


class MlirExportError(ExportError):
    """An export that cannot be done, failed to lower or failed its check (the capture's errors too)."""


@dataclasses.dataclass
class MlirExport:
    """What :func:`smxcompile.export_mlir` produced and checked: the module's ``text``; ``ops``, ``{operation
    name: count}`` (a ``torch.operator`` as ``torch.operator "torch.smx.softmax"``); ``checked``, ``"run"``
    (JIT-run against eager, ``max_abs_diff``), ``"verified"`` or ``"none"``."""

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


def one_line(e: BaseException) -> str:
    """``Type: first line`` of an exception's message (at most 400 characters of it)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[0][:400]}" if lines else type(e).__name__


__all__ = ["MlirExportError", "MlirExport", "one_line"]
