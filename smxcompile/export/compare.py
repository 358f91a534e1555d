"""How an export's check compares outputs: the exported file's (onnxruntime, MLIR's JIT) against PyTorch's."""

from __future__ import annotations

import math


def compare_arrays(got, ref, rtol: float, atol: float, name: str) -> tuple[float, str | None]:
    """``(largest |got - ref|, None)``, or ``(NaN, why)`` when an entry is off by more than ``atol + rtol * |ref|``;
    NaN matches NaN, inf the same inf. ``got``, ``ref``: numpy arrays of one shape; ``name`` names ``got``."""
    import numpy as np

    same = (np.isnan(got) & np.isnan(ref)) | (got == ref)
    with np.errstate(invalid="ignore"):
        d = np.where(same, 0.0, np.abs(got - ref))          # NaN where only one of them is NaN
    bad = ~(d <= atol + rtol * np.where(np.isnan(ref), 0.0, np.abs(ref)))
    if not bad.any():
        return (float(d.max()) if d.size else 0.0), None
    only_ref, only_got = int((np.isnan(ref) & ~np.isnan(got)).sum()), int((np.isnan(got) & ~np.isnan(ref)).sum())
    nans = f"; NaN in eager only at {only_ref}, in {name} only at {only_got}" if only_ref or only_got else ""
    worst = float(np.nanmax(d)) if (~np.isnan(d)).any() else float("nan")
    return math.nan, (f"differs from eager PyTorch by up to {worst:.3g} (rtol {rtol}, atol {atol}) at "
                      f"{int(bad.sum())} of {bad.size} entries{nans}")


__all__ = ["compare_arrays"]
