"""Reference ATen forms of smxcompile's forward ops, for exporters: ``{torch.ops.smx.<op>: fn}``.

Each function takes the op's schema arguments and returns what the op returns, in plain torch with no Python
branch on tensor values, so ``ExportedProgram.run_decompositions(table)`` can replace every call of the op by
ATen ops (:func:`smxcompile.export_mlir` uses it). They follow the op's torch path without in-place updates,
chunking or blocking; backward ops have no entry. Per op: docs/DESIGN.md, "Reference forms for exporters".
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .attention import NORMALIZERS
from .attention.reference import causal_keep
from .common import acc_dtype
from .cross_entropy.chunked import weights_rows
from .quant_softmax import quant_softmax_decomposed
from .softmax import prologue

__all__ = ["decomposition_table", "softmax_ref", "log_softmax_ref", "softmax_topk_ref", "quant_softmax_ref",
           "attention_ref", "ce_stats_ref", "linear_ce_stats_ref"]


# --------------------------------------------------------------------------- softmax, log_softmax


def _softmax_like(x, dim, scale, softcap, mask, dtype, return_lse, log):
    out_dtype = dtype or x.dtype
    z = prologue(x, scale, softcap, mask)           # fp32 (fp64 for fp64 x) from here on
    y = (torch.log_softmax if log else torch.softmax)(z, dim).to(out_dtype)
    if return_lse:
        lse = torch.logsumexp(z.to(acc_dtype(x)), dim)
    else:
        lse = x.new_zeros((0,), dtype=acc_dtype(x))
    return y, lse


def softmax_ref(x, dim, scale=1.0, softcap=None, mask=None, dtype=None, return_lse=False):
    """``smx::softmax``: ``(softmax(z, dim).to(dtype), logsumexp(z, dim) or empty)``, z the prologue's output."""
    return _softmax_like(x, dim, scale, softcap, mask, dtype, return_lse, log=False)


def log_softmax_ref(x, dim, scale=1.0, softcap=None, mask=None, dtype=None, return_lse=False):
    """``smx::log_softmax``: as :func:`softmax_ref` with ``log_softmax``."""
    return _softmax_like(x, dim, scale, softcap, mask, dtype, return_lse, log=True)


# --------------------------------------------------------------------------- softmax + top-k


def softmax_topk_ref(x, k, dim, scale, renormalize, dtype):
    """``smx::softmax_topk``: ``(values, indices, logd)`` (see the module docstring)."""
    out_dtype = dtype or x.dtype
    acc = acc_dtype(x)
    d = dim % x.dim()
    z = x.to(acc) * scale
    lead = [s for i, s in enumerate(x.shape) if i != d]
    if k == 0 or statically_known_true(x.shape[d] == 0):
        shape = list(x.shape)
        shape[d] = k
        values = x.new_zeros(shape, dtype=out_dtype)
        idx = torch.zeros(shape, dtype=torch.int64, device=x.device)
        logd = x.new_empty((0,), dtype=acc) if renormalize else x.new_zeros(lead, dtype=acc)
        return values, idx, logd
    top, idx = torch.topk(z, k, d)
    m = top.narrow(d, 0, 1)                                # the row max (NaN for a row with NaN)
    if renormalize:
        e = torch.exp(top - m)
        values = (e / e.sum(d, keepdim=True)).to(out_dtype)
        return values, idx, x.new_zeros((0,), dtype=acc)
    den = torch.exp(z - m).sum(d, keepdim=True)
    values = (torch.exp(top - m) / den).to(out_dtype)
    return values, idx, torch.log(den).squeeze(d)


# --------------------------------------------------------------------------- quantized softmax


def quant_softmax_ref(x, dim, logit_scale, scale, zero_point, quant_min, quant_max, dtype, prob_dtype=None):
    """``smx::quant_softmax``: :func:`.quant_softmax.quant_softmax_decomposed` (contiguous)."""
    return quant_softmax_decomposed(x, dim, logit_scale, scale, zero_point, quant_min, quant_max, dtype,
                                    prob_dtype).contiguous()


# --------------------------------------------------------------------------- attention


def attention_ref(q, k, v, attn_mask, is_causal, scale, softcap, normalizer, norm_param, dropout_p, seed,
                  skip_threshold=None, n_keys=None):
    """``smx::attention``: ``(out (B, Hq, L, Ev) in q.dtype, stats (B, Hq, L, 2) fp32 zeros)``."""
    if dropout_p > 0:
        raise NotImplementedError("smx::attention with dropout_p > 0 (a training graph) has no reference form; "
                                  "export the model in eval mode")
    if skip_threshold is not None:
        raise NotImplementedError("smx::attention with skip_threshold (BLASST tile skipping) is an approximation "
                                  "of the CUDA kernel only; it has no reference form")
    B, Hq, L, _ = q.shape
    Hkv, S, Ev = v.shape[1], v.shape[2], v.shape[3]
    acc = acc_dtype(q)
    stats = q.new_zeros((B, Hq, L, 2), dtype=torch.float32)
    if statically_known_true(S == 0):
        return q.new_zeros((B, Hq, L, Ev)), stats
    qa, ka, va = q.to(acc), k.to(acc), v.to(acc)
    if Hkv != Hq:
        ka = ka.repeat_interleave(Hq // Hkv, dim=1)
        va = va.repeat_interleave(Hq // Hkv, dim=1)
    s = torch.matmul(qa, ka.transpose(-1, -2)) * scale
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    keep = None
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            keep = attn_mask
        else:
            madd = attn_mask.to(acc)
            s = s + madd
            keep = madd != float("-inf")
    if is_causal:
        tri = causal_keep(0, L, S, q.device)
        keep = tri if keep is None else keep & tri
    if keep is not None:
        keep = keep.expand(B, Hq, L, S)
    if n_keys is not None:
        n = n_keys.to(acc).reshape(B, Hq, L, 1).clamp(min=1.0)
    else:
        # visible_keys' n counted from tensors: a Python float(S) would fix a dynamic S
        visible = causal_keep(0, L, S, q.device) if is_causal else torch.ones(L, S, dtype=torch.bool,
                                                                              device=q.device)
        n = visible.sum(-1, keepdim=True).to(acc)
    param = None if norm_param is None else norm_param.to(acc).reshape(B, Hq, 1, 1)
    w = NORMALIZERS[normalizer].ref(s, keep, n, param)
    out = torch.matmul(w, va).to(q.dtype)
    return out, stats


# --------------------------------------------------------------------------- cross-entropy statistics


def _row_stats(z, target, probs, class_weight, ignore_index, need_ws):
    """``(lse, target_logit, other_mass, weighted_sum or empty)`` of the (N, V) transformed logits ``z``
    (acc dtype), as :mod:`.cross_entropy.chunked` computes them chunk by chunk."""
    n, v = z.shape
    acc = z.dtype
    has_target = probs is None
    empty_v = statically_known_true(v == 0)
    lse = z.new_full((n,), float("-inf")) if empty_v else torch.logsumexp(z, 1)
    if need_ws:
        w = weights_rows(class_weight, probs, 0, n, acc)
        ws = (z * w).sum(1) if w is not None else z.sum(1)
    else:
        ws = z.new_zeros((0,))
    if has_target:
        valid = target != ignore_index
        inrange = (target >= 0) & (target < v)
        idx = torch.where(inrange, target, 0).unsqueeze(1)
        tl = z.new_zeros((n,)) if empty_v else z.gather(1, idx).squeeze(1)
        tl = torch.where(valid, torch.where(inrange, tl, float("nan")), 0.0)
        if empty_v:
            om = z.new_zeros((n,))
        else:
            others = z.scatter(1, idx, float("-inf"))      # the target knocked out
            om = torch.exp(others - lse.unsqueeze(1)).sum(1)
        om = torch.where(valid & inrange, om, 0.0)
    else:
        tl = z.new_zeros((n,))
        om = z.new_zeros((n,))
    return lse, tl, om, ws


def _transformed(x, scale, softcap):
    """``softcap * tanh(scale * x / softcap)`` or ``scale * x`` (out of place)."""
    if softcap is not None:
        return torch.tanh(x * (scale / softcap)) * softcap
    return x * scale if scale != 1.0 else x


def ce_stats_ref(logits, target, probs, class_weight, ignore_index, scale, softcap, need_weighted_sum,
                 chunk_bytes):
    """``smx::ce_stats``: ``(lse, target_logit, other_mass, weighted_sum or empty)``, each (N,) fp32 (fp64)."""
    acc = acc_dtype(logits)
    z = _transformed(logits.to(acc), scale, softcap)
    return _row_stats(z, target, probs, class_weight, ignore_index, need_weighted_sum)


def linear_ce_stats_ref(input, weight, bias, target, probs, class_weight, ignore_index, scale, softcap,
                        need_weighted_sum, return_logits, logits_dtype, chunk_bytes, filter_eps=None,
                        precise_grad=False):
    """``smx::linear_ce_stats``: :func:`ce_stats_ref` of ``input @ weight.T + bias`` (matmul in the input
    dtype, as ``F.linear``), plus the transformed logits in ``logits_dtype`` when ``return_logits``."""
    acc = acc_dtype(input)
    x = torch.nn.functional.linear(input, weight, bias)
    z = _transformed(x.to(acc), scale, softcap)
    if return_logits:
        logits = z.to(logits_dtype or input.dtype)
        if logits.dtype != acc:
            z = logits.to(acc)      # the loss sees the logits the caller sees, as the op does
    else:
        logits = input.new_zeros((0,))
    lse, tl, om, ws = _row_stats(z, target, probs, class_weight, ignore_index, need_weighted_sum)
    return lse, tl, om, ws, logits


# --------------------------------------------------------------------------- the table


def decomposition_table() -> dict[torch._ops.OpOverload, Callable]:
    """``{torch.ops.smx.<op>.default: reference function}`` for every forward op an inference graph holds."""
    smx = torch.ops.smx
    return {
        smx.softmax.default: softmax_ref,
        smx.log_softmax.default: log_softmax_ref,
        smx.softmax_topk.default: softmax_topk_ref,
        smx.quant_softmax.default: quant_softmax_ref,
        smx.attention.default: attention_ref,
        smx.ce_stats.default: ce_stats_ref,
        smx.linear_ce_stats.default: linear_ce_stats_ref,
    }

