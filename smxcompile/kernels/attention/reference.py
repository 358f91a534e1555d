"""The definition of ``smx::attention``: the registry of its normalizers (:data:`NORMALIZERS`: each one's exact
torch function on a materialized block of scores, its hand-written backward, its kernel code and its paper) and
:func:`attention_reference`, the whole computation materialized (tests' oracle).

:data:`NORMALIZERS` is the one list of attention normalizers: the option ``attention_normalizer``
(:data:`smxcompile.options.ATTENTION_NORMALIZERS`), the Triton kernels' ``NORM`` codes
(:data:`.triton_common.NORM_CODES`) and the ONNX forms (:mod:`smxcompile.export.onnx.attention_normalizers`)
derive from it. A name is checked against it where it enters (:class:`smxcompile.SmxOptions`,
:func:`smxcompile.attention`, the Triton launchers called directly, the ONNX export's refusals); the layers below
index the registry and trust it.

The swap variants (:mod:`smxcompile.edit.variants`, ``smxcompile.variants``) are a wider catalogue in another
convention (any dim, a bool mask, named parameters, pretrained-start values). Every normalizer but softmax is also
a variant: its name, paper and torch function come from the entry here, its formula too unless the variant writes
it with its own parameter names. The other variants (entmax_bisect, multimax, ...) have no attention kernel.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from ..common import acc_dtype

__all__ = ["NORMALIZERS", "Normalizer", "attention_reference", "visible_keys", "causal_keep"]


# ---- normalizers: exact torch functions on a materialized block of scores (see Normalizer) ----


def _keep(t: torch.Tensor, keep: torch.Tensor | None, fill: float) -> torch.Tensor:
    return t if keep is None else torch.where(keep, t, fill)


def _row_max(z: torch.Tensor) -> torch.Tensor:
    """Detached row max of ``z`` (masked entries -inf); 0 for a row with no finite entry."""
    m = z.detach().amax(-1, keepdim=True)
    return torch.where(torch.isfinite(m), m, 0.0)


def _normalize(e: torch.Tensor) -> torch.Tensor:
    """``e / sum(e)`` over the row; 0 for a row whose sum is 0 (every key masked); NaN propagates."""
    d = e.sum(-1, keepdim=True)
    return e / torch.where(d == 0, 1.0, d)


def _softmax_ref(s, keep, n, param):
    """softmax: ``exp(s_i - m) / sum_j exp(s_j - m)`` (the original attention normalizer)."""
    z = _keep(s, keep, float("-inf"))
    return _normalize(torch.exp(z - _row_max(z)))


def _softmax1_ref(s, keep, n, param):
    """softmax1, "Attention Is Off By One" (Evan Miller, 2023): ``exp(s_i) / (1 + sum_j exp(s_j))``, shifted by
    ``m' = max(m, 0)``."""
    z = _keep(s, keep, float("-inf"))
    m = _row_max(z).clamp(min=0.0)
    e = torch.exp(z - m)
    return e / (torch.exp(-m) + e.sum(-1, keepdim=True))


def _sigmoid_ref(s, keep, n, param):
    """sigmoid attention, "Theory, Analysis, and Best Practices for Sigmoid Self-Attention"
    (Ramapuram et al., 2024; FlashSigmoid): ``sigmoid(s_i + b)``, ``b = param``, default ``-log(n)``."""
    b = -torch.log(n) if param is None else param
    return _keep(torch.sigmoid(_keep(s, keep, 0.0) + b), keep, 0.0)


def _relu_ref(s, keep, n, param):
    """ReLU attention, "Replacing softmax with ReLU in Vision Transformers" (Wortsman et al., 2023):
    ``relu(s_i) * c``, ``c = param``, default ``1/n``."""
    c = 1.0 / n if param is None else param
    return _keep(torch.relu(_keep(s, keep, 0.0)) * c, keep, 0.0)


def _softpick_ref(s, keep, n, param):
    """softpick, "Softpick: No Attention Sink, No Massive Activations with Rectified Softmax" (Zuhri, Fuadi &
    Aji, 2025): ``relu(exp(s_i) - 1) / (sum_j |exp(s_j) - 1| + eps)``, ``eps = param``, default 1e-6; masked
    keys leave the denominator too. Both terms are scaled by ``exp(-max(m, 0))``, ``exp(s) - 1`` via expm1."""
    eps = 1e-6 if param is None else param
    z = _keep(s, keep, 0.0)
    m = _row_max(_keep(s, keep, float("-inf"))).clamp(min=0.0)
    zp, zn = z.clamp(min=0.0), z.clamp(max=0.0)
    u = torch.where(z > 0, -torch.exp(zp - m) * torch.expm1(-zp), torch.exp(-m) * torch.expm1(zn))
    u = _keep(u, keep, 0.0)
    den = u.abs().sum(-1, keepdim=True) + eps * torch.exp(-m)
    return torch.relu(u) / torch.where(den == 0, 1.0, den)


def _ssmax_ref(s, keep, n, param):
    """Scalable-Softmax, "Scalable-Softmax Is Superior for Attention" (Nakanishi, 2025):
    ``softmax((p * log n) * s)``, ``p = param`` (learnable per head), default 1.0."""
    p = 1.0 if param is None else param
    return _softmax_ref(_ssmax_shifted(s, keep, p) * (p * torch.log(n)), keep, n, None)


def _ssmax_shifted(s, keep, p):
    """``s`` minus its row max (row min where ``p < 0``), masked keys 0: softmax is shift-invariant,
    and scores near ``finfo.min`` (a finite float mask) must not overflow when multiplied by ``p log n``."""
    hi = _row_max(_keep(s, keep, float("-inf")))
    if isinstance(p, (int, float)):
        m = hi if p >= 0 else -_row_max(_keep(-s, keep, float("-inf")))
    else:
        m = torch.where(p >= 0, hi, -_row_max(_keep(-s, keep, float("-inf"))))
    return _keep(s - m, keep, 0.0)


def _softplus_default(n: torch.Tensor) -> torch.Tensor:
    return torch.log(n.clamp(min=2.0))


def _softplus_ref(s, keep, n, param):
    """Length-scaled softplus attention (LSSA), "Softplus Attention with Re-weighting Boosts Length
    Extrapolation in Large Language Models" (Gao & Spratling, 2025): ``softplus(c * s_i) / sum_j softplus(c *
    s_j)``, ``c = param``, default ``log(max(n, 2))`` (> 0 for one-key rows)."""
    c = _softplus_default(n) if param is None else param
    return _normalize(_keep(F.softplus(_keep(s, keep, 0.0) * c), keep, 0.0))


def _sorted_keep(s, keep, half: bool):
    """Scores shifted by the detached row max for the sort-based maps: ``(x with masked = 0, sorted x with
    masked = 0, sorted validity)``."""
    z = _keep(s, keep, float("-inf"))
    if half:
        z = z * 0.5
    m = _row_max(z)
    x = z - m
    xs = torch.sort(x, dim=-1, descending=True).values
    valid = xs > float("-inf")
    xf = _keep(s, keep, 0.0)
    if half:
        xf = xf * 0.5
    return xf - m, torch.where(valid, xs, 0.0), valid


def _sparsemax_ref(s, keep, n, param):
    """sparsemax, "From Softmax to Sparsemax: A Sparse Model of Attention and Multi-Label Classification"
    (Martins & Astudillo, 2016): ``max(s_i - tau, 0)``, the row summing to 1; exact, sort-based. Autograd gives
    the Jacobian on ``{w > 0}`` (as :func:`_sparsemax_vjp`), an entry tied at ``tau`` getting no gradient."""
    xf, xs, valid = _sorted_keep(s, keep, half=False)
    cs = xs.cumsum(-1)
    k = torch.arange(1, xs.shape[-1] + 1, dtype=xs.dtype, device=xs.device)
    with torch.no_grad():
        support = (valid & (1.0 + k * xs > cs)).sum(-1, keepdim=True).clamp(min=1)
        tau0 = (cs.gather(-1, support - 1) - 1.0) / support.to(xs.dtype)
        sup = xf - tau0 > 0
        sup = sup if keep is None else sup & keep    # not where(): onnxruntime has no bool Where
        k_sup = sup.sum(-1, keepdim=True).clamp(min=1).to(xs.dtype)
    # tau's value is tau0, its gradient that of (sum_{w > 0} s - 1) / |{w > 0}|, not of the sort's support
    tau_g = torch.where(sup, xf, 0.0).sum(-1, keepdim=True) / k_sup
    tau = tau0 + (tau_g - tau_g.detach())
    return torch.where(sup, xf - tau, 0.0)


def _entmax15_ref(s, keep, n, param):
    """1.5-entmax, "Sparse Sequence-to-Sequence Models" (Peters, Niculae & Martins, 2019): ``[s_i/2 - tau]_+^2``,
    the row summing to 1; exact, sort-based (their Algorithm 2), differentiated through the closed form."""
    xf, xs, valid = _sorted_keep(s, keep, half=True)
    k = torch.arange(1, xs.shape[-1] + 1, dtype=xs.dtype, device=xs.device)
    cs, cs2 = xs.cumsum(-1), (xs * xs).cumsum(-1)
    with torch.no_grad():
        mean, mean_sq = cs / k, cs2 / k
        delta = (1.0 - k * (mean_sq - mean * mean)) / k
        tau_k = mean - torch.sqrt(delta.clamp(min=0.0))
        support = (valid & (tau_k <= xs)).sum(-1, keepdim=True).clamp(min=1)
    kk = support.to(xs.dtype)
    mean = cs.gather(-1, support - 1) / kk
    mean_sq = cs2.gather(-1, support - 1) / kk
    tau = mean - torch.sqrt(((1.0 - kk * (mean_sq - mean * mean)) / kk).clamp(min=0.0))
    y = torch.clamp(xf - tau, min=0.0)
    return _keep(y * y, keep, 0.0)


# ---- their hand-written backwards (see Normalizer; tests check them against autograd through ref) ----


def _softmax_vjp(s, keep, n, param, w, dw):
    return w * (dw - (dw * w).sum(-1, keepdim=True)), None


def _sigmoid_vjp(s, keep, n, param, w, dw):
    ds = dw * w * (1.0 - w)
    return ds, ds


def _relu_vjp(s, keep, n, param, w, dw):
    c = 1.0 / n if param is None else param
    z = _keep(s, keep, 0.0)
    pos = z > 0
    return torch.where(pos, dw * c, 0.0), torch.where(pos, dw * z, 0.0)


def _softpick_vjp(s, keep, n, param, w, dw):
    # ds_j = exp(s_j - m') / D' * ([u_j > 0] dw_j - sign(u_j) sum_i dw_i w_i),  deps = -sum_i dw_i w_i / D
    eps = 1e-6 if param is None else param
    z = _keep(s, keep, 0.0)
    m = _row_max(_keep(s, keep, float("-inf"))).clamp(min=0.0)
    zp, zn = z.clamp(min=0.0), z.clamp(max=0.0)
    u = _keep(torch.where(z > 0, -torch.exp(zp - m) * torch.expm1(-zp), torch.exp(-m) * torch.expm1(zn)), keep, 0.0)
    den = u.abs().sum(-1, keepdim=True) + eps * torch.exp(-m)
    den = torch.where(den == 0, 1.0, den)
    dot = (dw * w).sum(-1, keepdim=True)
    ds = torch.exp(z - m) / den * (torch.where(u > 0, dw, 0.0) - torch.sign(u) * dot)
    return ds, -dot * torch.exp(-m) / den


def _ssmax_vjp(s, keep, n, param, w, dw):
    p = 1.0 if param is None else param
    logn = torch.log(n)
    dz = w * (dw - (dw * w).sum(-1, keepdim=True))
    # the rows of dz sum to 0, so the shift changes nothing in dp but keeps it finite
    return dz * (p * logn), dz * _ssmax_shifted(s, keep, p) * logn


def _softplus_vjp(s, keep, n, param, w, dw):
    c = _softplus_default(n) if param is None else param
    z = _keep(s, keep, 0.0)
    e = _keep(F.softplus(z * c), keep, 0.0)
    d = e.sum(-1, keepdim=True)
    de = (dw - (dw * w).sum(-1, keepdim=True)) / torch.where(d == 0, 1.0, d)
    de = _keep(de * torch.sigmoid(z * c), keep, 0.0)
    return de * c, de * z


def _sparsemax_vjp(s, keep, n, param, w, dw):
    sup = w > 0
    k = sup.sum(-1, keepdim=True).clamp(min=1).to(w.dtype)
    mean = torch.where(sup, dw, 0.0).sum(-1, keepdim=True) / k
    return torch.where(sup, dw - mean, 0.0), None


def _entmax15_vjp(s, keep, n, param, w, dw):
    g = torch.sqrt(w)
    gs = g.sum(-1, keepdim=True)
    dx = dw * g
    return dx - g * (dx.sum(-1, keepdim=True) / torch.where(gs == 0, 1.0, gs)), None


class Normalizer(NamedTuple):
    """One attention normalizer (an entry of :data:`NORMALIZERS`).

    ``ref(s, keep, n, param) -> w``: the exact torch function on a block of scores: s fp32/fp64 (..., L, S),
    anything at masked entries; keep bool broadcastable to s, or None; n (..., L, 1) float, the keys the row
    may see; param broadcastable per head, e.g. (..., H, 1, 1), or None for the default. ``w`` is exactly 0
    where keep is False, and NaN-free gradients. ``vjp(s, keep, n, param, w, dw) -> (ds, dparam)``: its
    backward (``dparam`` before the sum over rows and keys; None without a parameter). ``takes_param``,
    ``default_param`` (a function of n), ``param_doc``; ``whole_row``: no streaming form; ``formula``, ``paper``;
    ``code``: the Triton kernels' ``NORM`` constexpr; ``reads_n``: the formula or default parameter uses n.
    """

    name: str
    ref: Callable
    vjp: Callable
    takes_param: bool
    default_param: Callable | None
    param_doc: str
    whole_row: bool
    formula: str
    paper: str
    code: int
    reads_n: bool


def _nz(name, code, ref, vjp, *, default=None, param_doc="", whole_row=False, reads_n=False, formula, paper):
    return Normalizer(name, ref, vjp, default is not None, default, param_doc, whole_row, formula, paper, code,
                      reads_n)


#: name -> :class:`Normalizer`, for ``attention(..., normalizer=name)``; the codes are fixed (the kernels compare
#: against them).
NORMALIZERS: dict[str, Normalizer] = {
    nz.name: nz
    for nz in (
        _nz("softmax", 0, _softmax_ref, _softmax_vjp,
            formula="exp(s_i - m) / sum_j exp(s_j - m)",
            paper="Vaswani et al., 'Attention Is All You Need' (2017)"),
        _nz("softmax1", 1, _softmax1_ref, _softmax_vjp,
            formula="exp(s_i) / (1 + sum_j exp(s_j))",
            paper="Miller, 'Attention Is Off By One' (2023)"),
        _nz("sigmoid", 3, _sigmoid_ref, _sigmoid_vjp, default=lambda n: -torch.log(n), reads_n=True,
            param_doc="bias b, default -log(n)",
            formula="sigmoid(s_i + b)",
            paper="Ramapuram et al., 'Theory, Analysis, and Best Practices for Sigmoid Self-Attention' (2024)"),
        _nz("relu", 4, _relu_ref, _relu_vjp, default=lambda n: 1.0 / n, reads_n=True,
            param_doc="scale c, default 1/n",
            formula="relu(s_i) * c",
            paper="Wortsman et al., 'Replacing softmax with ReLU in Vision Transformers' (2023)"),
        _nz("softpick", 5, _softpick_ref, _softpick_vjp, default=lambda n: torch.full_like(n, 1e-6),
            param_doc="eps, default 1e-6",
            formula="relu(exp(s_i) - 1) / (sum_j |exp(s_j) - 1| + eps)",
            paper="Zuhri, Fuadi & Aji, 'Softpick: No Attention Sink, No Massive Activations with Rectified "
                  "Softmax' (2025)"),
        _nz("ssmax", 2, _ssmax_ref, _ssmax_vjp, default=lambda n: torch.ones_like(n), reads_n=True,
            param_doc="p, default 1.0 (learnable per head)",
            formula="softmax((p * log n) * s)",
            paper="Nakanishi, 'Scalable-Softmax Is Superior for Attention' (2025)"),
        _nz("softplus", 6, _softplus_ref, _softplus_vjp, default=_softplus_default, reads_n=True,
            param_doc="scale c, default log(max(n, 2))",
            formula="softplus(c * s_i) / sum_j softplus(c * s_j)",
            paper="Gao & Spratling, 'Softplus Attention with Re-weighting Boosts Length Extrapolation in Large "
                  "Language Models' (2025)"),
        _nz("sparsemax", 7, _sparsemax_ref, _sparsemax_vjp, whole_row=True,
            formula="max(s_i - tau, 0), tau such that the row sums to 1",
            paper="Martins & Astudillo, 'From Softmax to Sparsemax: A Sparse Model of Attention and "
                  "Multi-Label Classification' (2016)"),
        _nz("entmax15", 8, _entmax15_ref, _entmax15_vjp, whole_row=True,
            formula="max(s_i / 2 - tau, 0)^2, tau such that the row sums to 1",
            paper="Peters, Niculae & Martins, 'Sparse Sequence-to-Sequence Models' (2019)"),
    )
}


def visible_keys(l0: int, l1: int, S: int, is_causal: bool, dtype, device) -> torch.Tensor:
    """``n`` for rows ``l0..l1-1``: S, or ``min(i + 1, S)`` under ``is_causal``; shape (rows, 1)."""
    if is_causal:
        return (torch.arange(l0, l1, device=device, dtype=dtype) + 1.0).clamp(max=float(S)).unsqueeze(-1)
    return torch.full((l1 - l0, 1), float(S), dtype=dtype, device=device)


def causal_keep(l0: int, l1: int, S: int, device) -> torch.Tensor:
    """Top-left aligned causal mask for rows ``l0..l1-1``: key j allowed iff ``j <= i``; (rows, S)."""
    return torch.arange(S, device=device).unsqueeze(0) <= torch.arange(l0, l1, device=device).unsqueeze(1)


def attention_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    *,
    softcap: float | None = None,
    normalizer: str = "softmax",
    norm_param: float | torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
    dropout_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """The definition of :func:`attention`, materialized (all (L, S) scores, K and V repeated for GQA), in
    differentiable torch; tests' oracle. Args as :func:`attention`, plus ``dtype`` (the math dtype; default fp32
    for half inputs) and a bool ``dropout_mask`` (True = kept) with its ``dropout_p``. Returns (..., Hq, L, Ev)
    in ``dtype``."""
    acc = dtype or acc_dtype(query)
    q, k, v = query.to(acc), key.to(acc), value.to(acc)
    Hq, Hkv = q.shape[-3], k.shape[-3]
    if Hkv != Hq:
        k = k.repeat_interleave(Hq // Hkv, dim=-3)
        v = v.repeat_interleave(Hq // Hkv, dim=-3)
    L, E, S = q.shape[-2], q.shape[-1], k.shape[-2]
    if scale is None:
        scale = 1.0 / math.sqrt(E) if E else 1.0
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if S == 0:
        return torch.matmul(s, v)
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    keep = None
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            keep = attn_mask
        else:
            s = s + attn_mask.to(acc)
            keep = attn_mask != float("-inf")
    if is_causal:
        keep = causal_keep(0, L, S, q.device)
    if attn_mask is not None:
        n = keep.expand(*s.shape).sum(-1, keepdim=True).to(acc).clamp(min=1.0)
    else:
        n = visible_keys(0, L, S, is_causal, acc, q.device)
    param = norm_param
    if isinstance(param, torch.Tensor):
        param = param.to(acc).unsqueeze(-1).unsqueeze(-1)
    w = NORMALIZERS[normalizer].ref(s, keep, n, param)
    if dropout_mask is not None:
        w = w * dropout_mask.to(acc) / (1.0 - dropout_p)
    return torch.matmul(w, v)
