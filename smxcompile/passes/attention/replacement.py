"""What rewritten attention sites call at run time (traced by AOTAutograd, so torch's and smx's ops end up in
the graph): ``F.scaled_dot_product_attention`` (torch's fused flash kernels, CPU and CUDA; FlashAttention: Dao et
al., 2022) for softmax, :func:`smxcompile.attention` (the ``smx::attention`` op) for the other normalizers and
soft-capping, with eager's values restored on fully masked rows and for NaN inputs."""

from __future__ import annotations

import torch

from ..patterns.contraction import op_layout
from ...kernels.attention.masked_rows import keys_last, masked_attention


def graph_attention(q, k, v, masks, scale_tensors, *, mask_kinds, scale: float, softcap, is_causal: bool,
                    dropout_p: float, n_rep: int, fixup: str, normalizer: str, norm_param, export: bool = False,
                    lead: tuple | None = None, safe_softmax: bool = False, layout: dict | None = None,
                    mask_floor: float | None = None, sink: torch.Tensor | None = None):
    """A rewritten attention site (docs/DESIGN.md, "Attention"): q (..., L, E), k, v (..., S, E) after ``layout``
    (role -> permutation; ``"scores"``: masks laid out (..., S, L)), regrouped to ``lead`` first.
    ``masks`` in graph order, each with ``(how, value, shape)`` in ``mask_kinds``: added (``"add"``), subtracted
    (``"sub"``), or a bool whose True (``"fill"``) or False (``"keep"``) entries hold ``value``; applied to the
    scores viewed as ``shape`` (None: as q is grouped). ``mask_floor``: the masks clamped below there.
    ``scale_tensors``: ``[(tensor, "mul" | "div")]`` folded into q; ``sink``: a logit column (see
    :func:`~smxcompile.kernels.attention.masked_rows.with_sink`). ``fixup="auto"``: eager's values on fully
    masked rows (0 after ``_safe_softmax``); ``export``: MatMul / Softmax / MatMul semantics, no NaN fix-up."""
    q, k, v, laid_out = op_layout(q, k, v, layout)
    # masks as (..., rows, keys) with both dims present (a 0-d or (S,) mask broadcasts as eager's does)
    masks = [keys_last(t) if "scores" in (layout or {}) else t.reshape((1,) * (2 - t.dim()) + tuple(t.shape))
             for t in masks]
    out = masked_attention(q, k, v, masks, mask_kinds, scale_tensors, scale=scale, softcap=softcap,
                           is_causal=is_causal, dropout_p=dropout_p, n_rep=n_rep, fixup=fixup, normalizer=normalizer,
                           norm_param=norm_param, export=export, lead=lead, safe_softmax=safe_softmax,
                           mask_floor=mask_floor, sink=sink)
    return laid_out(out)


def graph_flex_attention(q, k, v, sides, scale_tensors, *, recipe: tuple, scale: float, n_rep: int,
                         safe_softmax: bool = False, layout: dict | None = None):
    """A site whose scores go through other pointwise changes (:func:`.scores.score_mod_recipe`): q, k, v after
    ``layout``, ``scale_tensors`` folded into q, then :func:`smxcompile.kernels.attention.score_mod_attention`."""
    from ...kernels.attention.flex import score_mod_attention

    q, k, v, laid_out = op_layout(q, k, v, layout)
    if n_rep == 1:      # operands broadcast along a batch index they lack (multi-query K and V)
        lead = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
        q, k, v = (t.expand(*lead, *t.shape[-2:]) for t in (q, k, v))
    for t, op in scale_tensors:
        q = q * t.to(q.dtype) if op == "mul" else q / t.to(q.dtype)
    out = score_mod_attention(q, k, v, sides, recipe=recipe, scale=scale, enable_gqa=n_rep > 1,
                              safe_softmax=safe_softmax)
    return laid_out(out)


def graph_sdpa(q, k, v, sdpa_kwargs: dict, *, normalizer: str, norm_param):
    """A rewritten ``F.scaled_dot_product_attention`` site with a requested normalizer."""
    from ...kernels.attention import attention

    kw = dict(sdpa_kwargs)
    scale = kw.get("scale")
    if scale is not None and not isinstance(scale, (int, float)):
        # a symbolic scale (1 / sqrt(q.size(-1)) under dynamic shapes) folded into q: the op's scale is a number
        q, kw["scale"] = q * scale, 1.0
    return attention(q, k, v, **kw, normalizer=normalizer, norm_param=norm_param)


__all__ = ["graph_attention", "graph_flex_attention", "graph_sdpa"]
