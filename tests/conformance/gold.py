"""The tolerance rule of every conformance test: per element, ``|ours - gold| <= |torch - gold| + tol``, against
an fp64 gold computed from the same (already rounded) inputs; NaN exactly where torch has NaN."""

from __future__ import annotations

import torch

# the tol term per dtype: an ulp-scale slack on top of torch's own error
TOL = {torch.float64: 1e-12, torch.float32: 1e-6, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def assert_gold(ours: torch.Tensor, ref: torch.Tensor, gold: torch.Tensor, tol: float, what: str = "") -> None:
    """``ours`` no further from ``gold`` than ``ref`` (torch) is, plus ``tol`` relative to ``|gold|`` (+1)."""
    assert ours.shape == ref.shape, (what, ours.shape, ref.shape)
    assert torch.equal(ours.isnan(), ref.isnan()), (what, "NaN pattern", ours.isnan().sum(), ref.isnan().sum())
    o, r, g = (t.detach().double().nan_to_num(0.0, 0.0, 0.0) for t in (ours, ref, gold))
    inf = ours.isinf() | ref.isinf()
    assert torch.equal(ours[inf], ref[inf]), (what, "inf entries")
    excess = ((o - g).abs() - (r - g).abs() - tol * (1 + g.abs()))[~inf]
    assert excess.numel() == 0 or float(excess.max()) <= 0, (what, float(excess.max()))
