"""``smx::attention``: scaled dot-product attention with a choice of row normalizer.

For query ``q`` (..., Hq, L, E), key ``k`` (..., Hkv, S, E) and value ``v`` (..., Hkv, S, Ev) the op
computes, per head and query row ``i`` (math in fp32 for half inputs, fp64 for fp64):

    s_ij = (q_i . k_j) * scale
    s_ij = softcap * tanh(s_ij / softcap)                     (if softcap)
    s_ij = s_ij + attn_mask_ij   /   masked where attn_mask_ij is False   (if attn_mask)
    w_i  = normalizer(s_i)          (over the keys of the row; see NORMALIZERS)
    w_i  = w_i * dropout_mask_i / (1 - dropout_p)             (if dropout_p > 0)
    out_i = sum_j w_ij v_j

Masked keys (bool ``False``, float ``-inf``, and ``j > i`` under ``is_causal``) get weight exactly 0
for every normalizer; a row whose keys are all masked gives output 0 and zero gradients, as
``F.scaled_dot_product_attention`` does in torch 2.13.

Methods: FlashAttention — "FlashAttention: Fast and Memory-Efficient Exact Attention with
IO-Awareness" (Dao et al., 2022): tiles of queries against all keys, nothing of size L x S kept,
the backward recomputes the tiles; the streaming normalizers use the online (max, sum) recurrence
of "Online normalizer calculation for softmax" (Milakov & Gimelshein, 2018). Each normalizer's
paper is named in :data:`NORMALIZERS` and in its reference function.

Paths:
- CUDA (and CPU tensors under ``config.force_triton``): the Triton kernels of
  :mod:`smxcompile.kernels.triton_attention` (imported lazily).
- CPU, and fp64 everywhere: plain torch, in blocks of query rows. One block holds the scores of
  at most ``BLOCK_BYTES`` (one query row of one kv-head group when that alone is larger), so
  memory is O(block x S), never O(L x S) for all heads at once; under ``is_causal`` a block reads
  only the keys its rows can see. The backward recomputes each block and applies the normalizer's
  hand-written vector-Jacobian product (``Normalizer.vjp``). Dropout masks come from a
  ``torch.Generator`` seeded with (seed, block index), so the backward regenerates them; they
  depend on the block layout. On this path the op's ``stats`` output is zeros (the backward does
  not use it), and K and V are converted to the accumulation dtype once (a copy for half inputs).
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from . import config
from .cross_entropy import _autocast_off, _autocast_on

__all__ = [
    "attention",
    "attention_reference",
    "NORMALIZERS",
    "Normalizer",
    "AttentionError",
    "BLOCK_BYTES",
]

#: Bytes of one block's scores (fp32, or fp64 for fp64 inputs) on the torch path. The block's
#: working set (scores, weights, and in the backward their recomputed intermediates) is a small
#: multiple of this. Tests set it small to run the block loop.
BLOCK_BYTES = 4 * 2**20

_FLOAT = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_MASK64 = (1 << 64) - 1


class AttentionError(ValueError, RuntimeError):
    """Bad arguments to :func:`attention`.

    A ``ValueError`` (what smxcompile raises for bad values) that is also a ``RuntimeError`` (what
    ``F.scaled_dot_product_attention`` raises for the same mistakes), so either ``except`` works."""


# --------------------------------------------------------------------------------------
# normalizers: exact torch functions on a materialized block of scores
# --------------------------------------------------------------------------------------
#
# Each ``ref(s, keep, n, param) -> w`` takes
#   s      scores (..., L, S), fp32 or fp64; masked entries may hold anything, -inf included
#   keep   bool, broadcastable to s (True = the key may be attended), or None (no mask)
#   n      (L, 1) or (..., L, 1) float: keys the row may see (S, min(i+1, S) under is_causal, or
#          the keys attn_mask leaves it)
#   param  per-head parameter broadcastable to s (e.g. (..., H, 1, 1)), or None for the default
# and returns the weights w (shape of s), exactly 0 where keep is False. Every nonlinearity sees
# finite inputs (or -inf into exp) so the gradients are NaN-free, masked rows included.


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
    """softmax1, "Attention Is Off By One" (Evan Miller, 2023): ``exp(s_i) / (1 + sum_j exp(s_j))``.

    Stable with ``m' = max(m, 0)``: ``exp(s_i - m') / (exp(-m') + sum_j exp(s_j - m'))``."""
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
    """softpick, "Softpick: No Attention Sink, No Massive Activations with Rectified Softmax"
    (Zuhri, Fuadi & Aji, 2025): ``relu(exp(s_i) - 1) / (sum_j |exp(s_j) - 1| + eps)``,
    ``eps = param``, default 1e-6. Masked keys leave the denominator too; rows may sum to < 1 or 0.

    Stable form with ``m' = max(m, 0)``: numerator and denominator times ``exp(-m')``, and
    ``u_j = exp(s_j - m') - exp(-m')`` evaluated without cancellation as
    ``-exp(s_j - m') * expm1(-s_j)`` for ``s_j > 0`` and ``exp(-m') * expm1(s_j)`` otherwise."""
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
    Extrapolation in Large Language Models" (Gao & Spratling, 2025):
    ``softplus(c * s_i) / sum_j softplus(c * s_j)``, ``c = param``, default ``log(max(n, 2))``
    (the paper's length scale is about ``log n``; the clamp keeps ``c > 0`` for one-key rows)."""
    c = _softplus_default(n) if param is None else param
    return _normalize(_keep(F.softplus(_keep(s, keep, 0.0) * c), keep, 0.0))


def _sorted_keep(s, keep, half: bool):
    """Row-shifted scores for the sort-based maps: (x with masked = -inf, x with masked = 0, sorted x
    with masked = 0, sorted validity). Shifting by the (detached) row max changes nothing exactly."""
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
    """sparsemax, "From Softmax to Sparsemax: A Sparse Model of Attention and Multi-Label
    Classification" (Martins & Astudillo, 2016): ``max(s_i - tau, 0)`` with ``tau`` such that the row
    sums to 1; exact, sort-based (``k = max{k : 1 + k z_(k) > sum_{j<=k} z_(j)}``)."""
    xf, xs, valid = _sorted_keep(s, keep, half=False)
    cs = xs.cumsum(-1)
    k = torch.arange(1, xs.shape[-1] + 1, dtype=xs.dtype, device=xs.device)
    with torch.no_grad():
        support = (valid & (1.0 + k * xs > cs)).sum(-1, keepdim=True).clamp(min=1)
    tau = (cs.gather(-1, support - 1) - 1.0) / support.to(xs.dtype)
    return _keep(torch.clamp(xf - tau, min=0.0), keep, 0.0)


def _entmax15_ref(s, keep, n, param):
    """1.5-entmax, "Sparse Sequence-to-Sequence Models" (Peters, Niculae & Martins, 2019):
    ``[s_i/2 - tau]_+^2`` with ``tau`` such that the row sums to 1; exact, sort-based (their
    Algorithm 2). ``tau`` is differentiated through the closed form on the support, which gives the
    paper's Jacobian."""
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


# Each ``vjp(s, keep, n, param, w, dw) -> (ds, dparam)`` is the hand-written backward of ``ref``:
# given w = ref(s, keep, n, param) and the gradient dw, it returns ds (0 at masked keys) and the
# parameter's gradient before the per-head sum (any shape that broadcasts to s; the caller sums it
# over rows and keys), or None for a normalizer without a parameter. The torch path's backward uses
# them; the tests check them against autograd through ``ref``.


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
    # w_i = relu(u_i) / D, u = exp(s) - 1, D = sum |u| + eps (all scaled by exp(-m') as in the ref):
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

    ``ref(s, keep, n, param) -> w``: the exact torch function on a materialized block of scores
    (s fp32/fp64 (..., L, S); keep bool broadcastable to s or None; n (L, 1) float, the keys the
    row may see by position; param broadcastable per head, e.g. (..., H, 1, 1), or None for the
    default). ``vjp(s, keep, n, param, w, dw) -> (ds, dparam)``: its backward (``dparam`` before
    the sum over rows and keys, None without a parameter). ``takes_param``: whether ``norm_param``
    means anything; ``default_param``: the
    parameter used when ``norm_param`` is None, as a function of n (None when it takes none);
    ``param_doc``: that default in words; ``whole_row``: needs every key of a row at once (no
    streaming form); ``formula``: one line; ``paper``: the source.
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


def _nz(name, ref, vjp, *, default=None, param_doc="", whole_row=False, formula, paper):
    return Normalizer(name, ref, vjp, default is not None, default, param_doc, whole_row, formula, paper)


#: name -> :class:`Normalizer`, for ``attention(..., normalizer=name)``.
NORMALIZERS: dict[str, Normalizer] = {
    nz.name: nz
    for nz in (
        _nz("softmax", _softmax_ref, _softmax_vjp,
            formula="exp(s_i - m) / sum_j exp(s_j - m)",
            paper="Vaswani et al., 'Attention Is All You Need' (2017)"),
        _nz("softmax1", _softmax1_ref, _softmax_vjp,
            formula="exp(s_i) / (1 + sum_j exp(s_j))",
            paper="Miller, 'Attention Is Off By One' (2023)"),
        _nz("sigmoid", _sigmoid_ref, _sigmoid_vjp, default=lambda n: -torch.log(n),
            param_doc="bias b, default -log(n)",
            formula="sigmoid(s_i + b)",
            paper="Ramapuram et al., 'Theory, Analysis, and Best Practices for Sigmoid Self-Attention' (2024)"),
        _nz("relu", _relu_ref, _relu_vjp, default=lambda n: 1.0 / n,
            param_doc="scale c, default 1/n",
            formula="relu(s_i) * c",
            paper="Wortsman et al., 'Replacing softmax with ReLU in Vision Transformers' (2023)"),
        _nz("softpick", _softpick_ref, _softpick_vjp, default=lambda n: torch.full_like(n, 1e-6),
            param_doc="eps, default 1e-6",
            formula="relu(exp(s_i) - 1) / (sum_j |exp(s_j) - 1| + eps)",
            paper="Zuhri, Fuadi & Aji, 'Softpick: No Attention Sink, No Massive Activations with Rectified "
                  "Softmax' (2025)"),
        _nz("ssmax", _ssmax_ref, _ssmax_vjp, default=lambda n: torch.ones_like(n),
            param_doc="p, default 1.0 (learnable per head)",
            formula="softmax((p * log n) * s)",
            paper="Nakanishi, 'Scalable-Softmax Is Superior for Attention' (2025)"),
        _nz("softplus", _softplus_ref, _softplus_vjp, default=_softplus_default,
            param_doc="scale c, default log(max(n, 2))",
            formula="softplus(c * s_i) / sum_j softplus(c * s_j)",
            paper="Gao & Spratling, 'Softplus Attention with Re-weighting Boosts Length Extrapolation in Large "
                  "Language Models' (2025)"),
        _nz("sparsemax", _sparsemax_ref, _sparsemax_vjp, whole_row=True,
            formula="max(s_i - tau, 0), tau such that the row sums to 1",
            paper="Martins & Astudillo, 'From Softmax to Sparsemax: A Sparse Model of Attention and "
                  "Multi-Label Classification' (2016)"),
        _nz("entmax15", _entmax15_ref, _entmax15_vjp, whole_row=True,
            formula="max(s_i / 2 - tau, 0)^2, tau such that the row sums to 1",
            paper="Peters, Niculae & Martins, 'Sparse Sequence-to-Sequence Models' (2019)"),
    )
}


def _acc_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _visible_keys(l0: int, l1: int, S: int, is_causal: bool, dtype, device) -> torch.Tensor:
    """``n`` for rows ``l0..l1-1``: S, or ``min(i + 1, S)`` under ``is_causal``; shape (rows, 1)."""
    if is_causal:
        return (torch.arange(l0, l1, device=device, dtype=dtype) + 1.0).clamp(max=float(S)).unsqueeze(-1)
    return torch.full((l1 - l0, 1), float(S), dtype=dtype, device=device)


def _causal_keep(l0: int, l1: int, S: int, device) -> torch.Tensor:
    """Top-left aligned causal mask for rows ``l0..l1-1``: key j allowed iff ``j <= i``; (rows, S)."""
    return torch.arange(S, device=device).unsqueeze(0) <= torch.arange(l0, l1, device=device).unsqueeze(1)


# --------------------------------------------------------------------------------------
# torch path: blocks of query rows
# --------------------------------------------------------------------------------------


def _plan_blocks(pairs: int, group: int, L: int, S: int, itemsize: int, budget: int | None = None):
    """Split the work into blocks ``(p0, p1, l0, l1)``: kv pairs ``p0:p1`` (a pair is one batch
    entry's kv head, with its ``group`` query heads) and query rows ``l0:l1``.

    A block's scores are ``(p1 - p0) * group * (l1 - l0) * S`` entries of ``itemsize`` bytes, at
    most ``budget`` (default :data:`BLOCK_BYTES`) unless one row of one pair alone is larger. Either
    one pair is split into row ranges, or whole pairs are grouped."""
    budget = BLOCK_BYTES if budget is None else budget
    row_bytes = max(1, group * max(S, 1) * itemsize)
    rows = max(1, budget // row_bytes)
    if rows >= L:
        rows = max(L, 1)
        per = max(1, min(pairs, budget // (row_bytes * max(L, 1))))
    else:
        per = 1
    return [(p0, min(p0 + per, pairs), l0, min(l0 + rows, L))
            for p0 in range(0, pairs, per) for l0 in range(0, L, rows)]


def _mix_seed(seed: int, index: int) -> int:
    """A generator seed for block ``index`` of a run seeded ``seed`` (splitmix64 finalizer)."""
    x = (seed + (index + 1) * 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) & ((1 << 63) - 1)


class _Problem:
    """The torch path's view of one call: 4-D contiguous q, k, v regrouped by kv head."""

    def __init__(self, q, k, v, attn_mask, is_causal, scale, softcap, normalizer, norm_param, dropout_p, seed,
                 n_keys=None):
        self.B, self.Hq, self.L, self.E = q.shape
        self.Hkv, self.S = k.shape[1], k.shape[2]
        self.Ev = v.shape[3]
        self.g = self.Hq // self.Hkv if self.Hkv else 1
        self.P = self.B * self.Hkv
        self.acc = _acc_dtype(q)
        self.device = q.device
        self.q5 = q.contiguous().view(self.P, self.g, self.L, self.E)
        self.k3 = k.reshape(self.P, self.S, self.E).to(self.acc)
        self.v3 = v.reshape(self.P, self.S, self.Ev).to(self.acc)
        self.mask = attn_mask
        self.mask4 = None
        if attn_mask is not None:
            m5 = attn_mask.expand(self.B, self.Hq, self.L, self.S).unflatten(1, (self.Hkv, self.g))
            self.mask5 = m5
            try:
                self.mask4 = m5.view(self.P, self.g, self.L, self.S)
            except RuntimeError:
                self.mask4 = None  # indexed per block
        self.param = None if norm_param is None else norm_param.reshape(self.P, self.g).to(self.acc)
        self.is_causal, self.scale, self.softcap = is_causal, scale, softcap
        self.spec = NORMALIZERS[normalizer]
        self.dropout_p, self.seed = dropout_p, seed
        # per-row key counts (B, Hq, L) regrouped like q, or None (n by position)
        self.n5 = None if n_keys is None else n_keys.to(self.acc).reshape(self.P, self.g, self.L, 1)
        itemsize = torch.finfo(self.acc).bits // 8
        self.blocks = _plan_blocks(self.P, self.g, self.L, self.S, itemsize)

    def keys(self, l1: int) -> int:
        """Keys a block of rows ending at ``l1`` needs: all, or under ``is_causal`` the first ``l1``
        (the others are masked for every row of the block, so they have weight 0)."""
        return min(self.S, l1) if self.is_causal else self.S

    def mask_block(self, p0, p1, l0, l1, se):
        if self.mask4 is not None:
            return self.mask4[p0:p1, :, l0:l1, :se]
        p = torch.arange(p0, p1, device=self.device)
        return self.mask5[p // self.Hkv, p % self.Hkv, :, l0:l1, :se]

    def consts(self, index, p0, p1, l0, l1, se):
        """The block's non-differentiable inputs (over its first ``se`` keys): keep, additive mask,
        n, dropout multiplier."""
        keep = madd = None
        if self.mask is not None:
            m = self.mask_block(p0, p1, l0, l1, se)
            if m.dtype == torch.bool:
                keep = m
            else:
                madd = m.to(self.acc)
                keep = madd != float("-inf")
        if self.is_causal:
            c = _causal_keep(l0, l1, se, self.device)
            keep = c if keep is None else keep & c
        if self.n5 is not None:
            n = self.n5[p0:p1, :, l0:l1].clamp(min=1.0)
        else:
            n = _visible_keys(l0, l1, self.S, self.is_causal, self.acc, self.device)
        drop = None
        if self.dropout_p > 0:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(_mix_seed(self.seed, index))
            u = torch.rand((p1 - p0, self.g, l1 - l0, se), generator=gen, dtype=self.acc, device=self.device)
            drop = (u >= self.dropout_p).to(self.acc) * (1.0 / (1.0 - self.dropout_p))
        return keep, madd, n, drop

    def block(self, index, p0, p1, l0, l1):
        """One block's forward pieces over its ``se = keys(l1)`` keys: (q block (P, g, Lb, E),
        k (P, se, E), v (P, se, Ev), param (P, g, 1, 1) or None, scores s (P, g, Lb, se) after
        soft-capping and the mask, tanh of the soft-cap or None, weights w before dropout, keep, n,
        dropout multiplier or None)."""
        se = self.keys(l1)
        keep, madd, n, drop = self.consts(index, p0, p1, l0, l1, se)
        qb = self.q5[p0:p1, :, l0:l1].to(self.acc)
        kb, vb = self.k3[p0:p1, :se], self.v3[p0:p1, :se]
        P, g, Lb, E = qb.shape
        pb = None if self.param is None else self.param[p0:p1].view(P, g, 1, 1)
        s = torch.matmul(qb.reshape(P, g * Lb, E), kb.transpose(1, 2)).view(P, g, Lb, se)
        s.mul_(self.scale)
        t = None
        if self.softcap is not None:
            t = torch.tanh(s.div_(self.softcap))
            s = t * self.softcap
        if madd is not None:
            s.add_(madd)
        w = self.spec.ref(s, keep, n, pb)
        return qb, kb, vb, pb, s, t, w, keep, n, drop


@_autocast_off
def _torch_forward(q, k, v, attn_mask, is_causal, scale, softcap, normalizer, norm_param, dropout_p, seed,
                   n_keys=None):
    B, Hq, L, _ = q.shape
    S, Ev = k.shape[2], v.shape[3]
    out = torch.empty((B, Hq, L, Ev), dtype=q.dtype, device=q.device)
    if out.numel() == 0:
        return out
    if S == 0:
        return out.zero_()
    pr = _Problem(q, k, v, attn_mask, is_causal, scale, softcap, normalizer, norm_param, dropout_p, seed, n_keys)
    out5 = out.view(pr.P, pr.g, L, Ev)
    for index, (p0, p1, l0, l1) in enumerate(pr.blocks):
        qb, kb, vb, pb, s, t, w, keep, n, drop = pr.block(index, p0, p1, l0, l1)
        if drop is not None:
            w = w * drop
        P, g, Lb, _ = qb.shape
        out5[p0:p1, :, l0:l1] = torch.matmul(w.view(P, g * Lb, -1), vb).view(P, g, Lb, Ev)
    return out


@_autocast_off
def _torch_backward(grad_out, q, k, v, attn_mask, is_causal, scale, softcap, normalizer, norm_param, dropout_p,
                    seed, n_keys=None):
    """Recompute each block's scores and weights, then (FlashAttention's backward, per block)
    dv += w'^T dO, dw = (dO v^T) * dropout, ds = normalizer.vjp(dw), through the soft-cap and the
    scale, dq = ds k, dk += ds^T q."""
    acc = _acc_dtype(q)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc, device=v.device)
    dp = None if norm_param is None else torch.zeros(norm_param.shape, dtype=norm_param.dtype, device=q.device)
    B, Hq, L = q.shape[:3]
    S, Ev = k.shape[2], v.shape[3]
    if B * Hq * L and S and Ev:  # otherwise every gradient is 0 (E = 0 still has a dv)
        pr = _Problem(q, k, v, attn_mask, is_causal, scale, softcap, normalizer, norm_param, dropout_p, seed,
                      n_keys)
        g5 = grad_out.reshape(pr.P, pr.g, L, Ev)
        dq5, dk3 = dq.view(pr.P, pr.g, L, pr.E), dk.view(pr.P, S, pr.E)
        dv3 = dv.view(pr.P, S, Ev)
        dp2 = None if dp is None else dp.view(pr.P, pr.g)
        for index, (p0, p1, l0, l1) in enumerate(pr.blocks):
            qb, kb, vb, pb, s, t, w, keep, n, drop = pr.block(index, p0, p1, l0, l1)
            P, g, Lb, E = qb.shape
            se = kb.shape[1]
            go = g5[p0:p1, :, l0:l1].to(acc).reshape(P, g * Lb, Ev)
            wd = w if drop is None else w * drop
            dv3[p0:p1, :se] += torch.matmul(wd.view(P, g * Lb, se).transpose(1, 2), go)
            dw = torch.matmul(go, vb.transpose(1, 2)).view(P, g, Lb, se)
            if drop is not None:
                dw = dw * drop
            ds, dpe = pr.spec.vjp(s, keep, n, pb, w, dw)
            if t is not None:
                ds = ds * (1.0 - t * t)
            ds = (ds * scale).view(P, g * Lb, se)
            dq5[p0:p1, :, l0:l1] = torch.matmul(ds, kb).view(P, g, Lb, E)
            dk3[p0:p1, :se] += torch.matmul(ds.transpose(1, 2), qb.reshape(P, g * Lb, E))
            if dp2 is not None:
                dp2[p0:p1] += dpe.sum((-2, -1)).to(dp2.dtype)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dp


# --------------------------------------------------------------------------------------
# ops
# --------------------------------------------------------------------------------------


def _stats_like(q: torch.Tensor) -> torch.Tensor:
    B, Hq, L, _ = q.shape
    return torch.zeros((B, Hq, L, 2), dtype=torch.float32, device=q.device)


@torch.library.custom_op("smx::attention", mutates_args=())
def _attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    scale: float,
    softcap: float | None,
    normalizer: str,
    norm_param: torch.Tensor | None,
    dropout_p: float,
    seed: torch.Tensor | None,
    skip_threshold: float | None = None,
    n_keys: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B, Hq, L, E), k (B, Hkv, S, E), v (B, Hkv, S, Ev), attn_mask None or broadcastable to
    (B, Hq, L, S) (bool or float), norm_param None or (B, Hq) in the accumulation dtype, seed None or an
    int64 0-d tensor (the dropout seed: a tensor, so a compiled graph draws a fresh one every call).
    Returns out (B, Hq, L, Ev) in q.dtype, contiguous, and stats (B, Hq, L, 2) fp32 (zeros on the torch path)."""
    seed = _seed_int(seed)
    if config.use_triton(q) and q.numel() and k.shape[2]:
        from .triton_attention import attention_forward

        mask = None if attn_mask is None else attn_mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        out, stats = attention_forward(q.contiguous(), k.contiguous(), v.contiguous(), mask, is_causal, scale,
                                       softcap, normalizer,
                                       None if norm_param is None else norm_param.float().contiguous(),
                                       dropout_p, seed, skip_threshold=skip_threshold, n_keys=n_keys)
        return out.contiguous(), stats.contiguous()
    if skip_threshold is not None:
        raise AttentionError("skip_threshold (BLASST tile skipping) runs in the CUDA Triton kernel only; "
                             "this call is on the CPU / fp64 path")
    out = _torch_forward(q, k, v, attn_mask, is_causal, scale, softcap, normalizer, norm_param, dropout_p, seed,
                         n_keys)
    return out, _stats_like(q)


@_attention_op.register_fake
def _(q, k, v, attn_mask, is_causal, scale, softcap, normalizer, norm_param, dropout_p, seed, skip_threshold=None,
      n_keys=None):
    B, Hq, L, _ = q.shape
    out = q.new_empty((B, Hq, L, v.shape[3]))
    return out, q.new_empty((B, Hq, L, 2), dtype=torch.float32)


@torch.library.custom_op("smx::attention_backward", mutates_args=())
def _attention_backward_op(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    stats: torch.Tensor,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    scale: float,
    softcap: float | None,
    normalizer: str,
    norm_param: torch.Tensor | None,
    dropout_p: float,
    seed: torch.Tensor | None,
    n_keys: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of ``smx::attention``: dq, dk, dv (dtypes and shapes of q, k, v, contiguous) and
    dnorm_param (shape and dtype of norm_param; an empty fp32 tensor when norm_param is None)."""
    seed = _seed_int(seed)
    if config.use_triton(q) and q.numel() and k.shape[2]:
        from .triton_attention import attention_backward

        mask = None if attn_mask is None else attn_mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        dq, dk, dv, dp = attention_backward(grad_out.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(),
                                            out, stats, mask, is_causal, scale, softcap, normalizer,
                                            None if norm_param is None else norm_param.float().contiguous(),
                                            dropout_p, seed, n_keys=n_keys)
    else:
        dq, dk, dv, dp = _torch_backward(grad_out, q, k, v, attn_mask, is_causal, scale, softcap, normalizer,
                                         norm_param, dropout_p, seed, n_keys)
    if norm_param is None:
        dp = q.new_empty(0, dtype=torch.float32)
    elif dp is None:
        dp = torch.zeros_like(norm_param, memory_format=torch.contiguous_format)
    else:
        dp = dp.to(norm_param.dtype).reshape(norm_param.shape).contiguous()
    return (dq.to(q.dtype).contiguous(), dk.to(k.dtype).contiguous(), dv.to(v.dtype).contiguous(), dp)


@_attention_backward_op.register_fake
def _(grad_out, q, k, v, out, stats, attn_mask, is_causal, scale, softcap, normalizer, norm_param, dropout_p, seed,
      n_keys=None):
    dp = q.new_empty(0, dtype=torch.float32) if norm_param is None else norm_param.new_empty(norm_param.shape)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dp


def _setup_context(ctx, inputs, output):
    q, k, v, attn_mask, is_causal, scale, softcap, normalizer, norm_param, dropout_p, seed, _skip, n_keys = inputs
    out, stats = output
    ctx.mark_non_differentiable(stats)
    ctx.args = (is_causal, scale, softcap, normalizer, dropout_p)
    ctx.save_for_backward(q, k, v, out, stats, attn_mask, norm_param, seed, n_keys)


def _backward(ctx, grad_out, _grad_stats):
    q, k, v, out, stats, attn_mask, norm_param, seed, n_keys = ctx.saved_tensors
    is_causal, scale, softcap, normalizer, dropout_p = ctx.args
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    dq, dk, dv, dp = _attention_backward_op(grad_out, q, k, v, out, stats, attn_mask, is_causal, scale, softcap,
                                            normalizer, norm_param, dropout_p, seed, n_keys)
    need = ctx.needs_input_grad
    return (dq if need[0] else None, dk if need[1] else None, dv if need[2] else None, None, None, None, None, None,
            dp if (norm_param is not None and need[8]) else None, None, None, None, None)


_attention_op.register_autograd(_backward, setup_context=_setup_context)


# --------------------------------------------------------------------------------------
# public function
# --------------------------------------------------------------------------------------


def _is_real(x) -> bool:
    return not isinstance(x, bool) and isinstance(x, (int, float)) and math.isfinite(x)


def _check(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, softcap, normalizer, norm_param):
    """Validate :func:`attention`'s arguments; returns the broadcast batch shape."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a Tensor, got {type(t).__name__}")
    if query.dim() < 3 or key.dim() < 3 or value.dim() < 3:
        raise AttentionError(
            "query, key and value must have at least 3 dims (..., heads, length, head_dim), got "
            f"query.dim() = {query.dim()}, key.dim() = {key.dim()}, value.dim() = {value.dim()}")
    if not (query.dtype == key.dtype == value.dtype):
        raise AttentionError(f"query, key and value must have the same dtype, got query.dtype: {query.dtype}, "
                             f"key.dtype: {key.dtype}, value.dtype: {value.dtype}")
    if query.dtype not in _FLOAT:
        raise AttentionError(f"query, key and value must be fp16, bf16, fp32 or fp64, got {query.dtype}")
    if not (query.device == key.device == value.device):
        raise AttentionError(f"query, key and value must be on one device, got {query.device}, {key.device}, "
                             f"{value.device}")
    (Hq, L, E), (Hkv, S, Ek), (Hv, Sv, _) = query.shape[-3:], key.shape[-3:], value.shape[-3:]
    if Ek != E:
        raise AttentionError(f"key's last dim ({Ek}) must equal query's ({E})")
    if (Hv, Sv) != (Hkv, S):
        raise AttentionError(f"value (..., {Hv}, {Sv}, Ev) must have key's heads and length (..., {Hkv}, {S}, E)")
    if not isinstance(enable_gqa, bool):
        raise TypeError(f"enable_gqa must be a bool, got {enable_gqa!r}")
    if enable_gqa:
        if (Hkv == 0 and Hq != 0) or (Hkv and Hq % Hkv):
            raise AttentionError(f"enable_gqa: the number of query heads ({Hq}) must be a multiple of the "
                                 f"number of key/value heads ({Hkv})")
    elif Hq != Hkv:
        raise AttentionError(f"query has {Hq} heads and key/value {Hkv}; pass enable_gqa=True for grouped-query "
                             "attention")
    try:
        batch = torch.broadcast_shapes(query.shape[:-3], key.shape[:-3], value.shape[:-3])
    except RuntimeError as e:
        raise AttentionError(f"the batch dims of query {tuple(query.shape[:-3])}, key {tuple(key.shape[:-3])} and "
                             f"value {tuple(value.shape[:-3])} do not broadcast") from e
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {is_causal!r}")
    if attn_mask is not None:
        if not isinstance(attn_mask, torch.Tensor):
            raise TypeError(f"attn_mask must be a Tensor or None, got {type(attn_mask).__name__}")
        if attn_mask.dtype not in (torch.bool, torch.float32, query.dtype):
            raise AttentionError(f"attn_mask must be bool, float32 or query's dtype ({query.dtype}), got "
                                 f"{attn_mask.dtype}")
        if attn_mask.device != query.device:
            raise AttentionError(f"attn_mask is on {attn_mask.device}, query on {query.device}")
        full = (*batch, Hq, L, S)
        try:
            shape = torch.broadcast_shapes(attn_mask.shape, full)
        except RuntimeError as e:
            raise AttentionError(f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to the scores "
                                 f"{full}") from e
        if tuple(shape) != full:
            raise AttentionError(f"attn_mask of shape {tuple(attn_mask.shape)} would broadcast the scores {full} "
                                 "to a larger shape")
    if not _is_real(dropout_p) or not 0.0 <= dropout_p < 1.0:
        raise AttentionError(f"dropout_p must be a number in [0, 1), got {dropout_p!r}")
    if scale is not None and not _is_real(scale):
        raise AttentionError(f"scale must be a finite real number or None, got {scale!r}")
    if softcap is not None and (not _is_real(softcap) or softcap <= 0):
        raise AttentionError(f"softcap must be a positive number or None, got {softcap!r}")
    if not isinstance(normalizer, str) or normalizer not in NORMALIZERS:
        raise AttentionError(f"unknown normalizer {normalizer!r}; known: {', '.join(NORMALIZERS)}")
    if norm_param is not None:
        if not NORMALIZERS[normalizer].takes_param:
            raise AttentionError(f"normalizer {normalizer!r} takes no norm_param; these do: "
                                 f"{', '.join(n for n, z in NORMALIZERS.items() if z.takes_param)}")
        if isinstance(norm_param, torch.Tensor):
            if not norm_param.is_floating_point():
                raise AttentionError(f"norm_param must be a floating-point tensor, got {norm_param.dtype}")
            if norm_param.device != query.device:
                raise AttentionError(f"norm_param is on {norm_param.device}, query on {query.device}")
            heads = (*batch, Hq)
            try:
                shape = torch.broadcast_shapes(norm_param.shape, heads)
            except RuntimeError:
                shape = None
            if shape is None or tuple(shape) != heads:
                raise AttentionError(f"norm_param of shape {tuple(norm_param.shape)} must broadcast to "
                                     f"(batch..., heads) = {heads} (one value per query head)")
        elif not _is_real(norm_param):
            raise AttentionError(f"norm_param must be None, a finite number or a tensor, got {norm_param!r}")
    return tuple(batch)


def _flat(t: torch.Tensor, batch: tuple, B: int) -> torch.Tensor:
    """(*t_batch, H, N, D) -> (B, H, N, D) contiguous (a copy only if needed)."""
    return t.expand(*batch, *t.shape[-3:]).reshape(B, *t.shape[-3:]).contiguous()


def _flat_mask(mask: torch.Tensor, batch: tuple, B: int, Hq: int, L: int, S: int) -> torch.Tensor:
    """The mask as a (B, Hq, L, S) view; its head/row/key broadcasting stays stride 0, only the batch
    dims are copied when they cannot be merged in place."""
    nd = len(batch) + 3
    m = mask.reshape((1,) * (nd - mask.dim()) + tuple(mask.shape))
    tail = tuple(m.shape[-3:])
    m = m.expand(*batch, *tail)
    try:
        m = m.view(B, *tail)
    except RuntimeError:
        m = m.contiguous().view(B, *tail)
    return m.expand(B, Hq, L, S)


#: Normalizers whose formula or default parameter uses n, the number of keys a row may see.
_N_DEPENDENT = frozenset({"ssmax", "sigmoid", "relu", "softplus"})


def _draw_seed() -> torch.Tensor:
    """A dropout seed from torch's default generator (``torch.manual_seed`` makes runs reproducible), as an
    int64 0-d CPU tensor: under ``torch.compile`` it stays a random op of the graph (a fresh seed every
    call) instead of a constant baked in at trace time."""
    return torch.randint(0, 2**62, (), dtype=torch.int64)


def _seed_int(seed: torch.Tensor | None) -> int:
    return 0 if seed is None else int(seed.item())


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    softcap: float | None = None,
    normalizer: str = "softmax",
    norm_param: float | torch.Tensor | None = None,
    skip_threshold: float | None = None,
) -> torch.Tensor:
    """Scaled dot-product attention with soft-capping and a choice of normalizer.

    The first eight arguments are those of ``F.scaled_dot_product_attention`` (same order, names
    and meaning). Per query row ``i``: ``s = (q_i @ k^T) * scale``; ``s = softcap * tanh(s / softcap)``
    if ``softcap``; then the mask; ``w = normalizer(s)`` over the keys; dropout on ``w``;
    ``out_i = w @ v``. Math in fp32 for fp16/bf16 inputs, fp64 for fp64.

    Args:
        query: (..., Hq, L, E); fp16, bf16, fp32 or fp64; any strides.
        key: (..., Hkv, S, E), query's dtype and device.
        value: (..., Hkv, S, Ev), query's dtype and device. The batch dims ``...`` of the three
            broadcast against each other (as in SDPA; a broadcast key/value is copied).
        attn_mask: None, bool (True = may attend) or float (added to the scores; ``-inf`` masks),
            float32 or query's dtype, broadcastable to (..., Hq, L, S). Masked keys get weight exactly
            0 under every normalizer. Only ``-inf`` masks: a finite value such as ``finfo.min`` is a
            (very negative) score, which matters for softpick (it joins the denominator). No gradient
            flows to a float mask (an error is raised if it requires grad, except on the SDPA route).
        dropout_p: dropout probability on the weights, in [0, 1); applied whenever > 0 (pass 0.0 in
            eval, as with SDPA); kept weights are scaled by ``1/(1 - dropout_p)``.
        is_causal: top-left aligned causal mask (key j allowed iff ``j <= i``), as SDPA; together
            with ``attn_mask`` both apply (as SDPA in torch 2.13).
        scale: multiplies the scores; default ``1/sqrt(E)`` (1.0 when E = 0).
        enable_gqa: grouped-query attention: Hq a multiple of Hkv; query head h uses kv head
            ``h // (Hq // Hkv)`` (SDPA's repeat_interleave semantics; K and V are never repeated).
        softcap: soft-capping ``c * tanh(s / c)`` (Gemma 2) before the mask, or None; > 0.
        normalizer: a name in :data:`NORMALIZERS`: ``softmax``, ``softmax1`` (Miller 2023),
            ``sigmoid`` (Ramapuram et al. 2024), ``relu`` (Wortsman et al. 2023), ``softpick``
            (Zuhri et al. 2025), ``ssmax`` (Nakanishi 2025), ``softplus`` (Gao & Spratling 2025),
            ``sparsemax`` (Martins & Astudillo 2016), ``entmax15`` (Peters et al. 2019).
        norm_param: the normalizer's parameter (sigmoid's bias, relu's scale, softpick's eps,
            ssmax's p, softplus's scale): None for its default (see ``NORMALIZERS[name].param_doc``),
            a number, or a tensor broadcastable to (..., Hq) — one value per head — that receives a
            gradient when it requires one. ``n`` (ssmax's ``log n``, and the defaults of sigmoid,
            relu and softplus) is the number of keys the row may see: S, or ``min(i + 1, S)`` under
            ``is_causal``, or with ``attn_mask`` the keys it leaves (bool True / float not ``-inf``),
            at least 1 — so a causal or padding mask gives the same ``n`` as a tensor as it does
            through ``is_causal``.
        skip_threshold: BLASST skip-softmax sparse attention (ALGORITHMS.md 1.6): a lambda in (0, 1);
            the CUDA kernel skips a K/V tile when ``tile_max - running_max < ln(lambda)`` for every row
            of its query block — an approximation (weights below lambda of the running max are
            dropped), training-free. None (default): exact. Softmax only, forward only (gradients
            are those of exact attention), CUDA Triton kernel only (an error elsewhere).

    Returns:
        (..., Hq, L, Ev) in query's dtype. A row with every key masked, or S = 0, gives 0 (zero
        gradients).

    Raises:
        TypeError: query/key/value/attn_mask not tensors; non-bool ``is_causal``/``enable_gqa``.
        AttentionError (a ValueError and a RuntimeError): rank < 3; dtype or device mismatch;
            non-float dtype; mismatched E, S or heads; Hq != Hkv without ``enable_gqa`` or Hq not a
            multiple of Hkv with it; batch dims that do not broadcast; attn_mask of
            a wrong dtype or shape; dropout_p outside [0, 1); non-finite scale; softcap <= 0;
            an unknown normalizer (the message lists the names); norm_param for a normalizer without
            one, or of a shape that does not broadcast to (..., Hq); a float attn_mask requiring
            grad off the SDPA route.

    Routing: ``normalizer="softmax"`` without ``softcap`` calls ``F.scaled_dot_product_attention``
    (torch's fused kernels, identical semantics). Everything else runs ``torch.ops.smx.attention``:
    Triton kernels on CUDA (FlashAttention-style tiling, Dao et al. 2022, with the online softmax of
    Milakov & Gimelshein 2018), blocks of query rows in torch on CPU and for fp64. Dropout masks on
    that route come from a seed drawn from torch's default generator (``torch.manual_seed`` makes
    them reproducible) and depend on the block layout, so they differ between CPU and CUDA.
    Under CPU/CUDA autocast, fp32 query/key/value are cast to the autocast dtype, as SDPA is.
    """
    batch = _check(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, softcap, normalizer,
                   norm_param)
    if skip_threshold is not None:
        if normalizer != "softmax":
            raise AttentionError(f"skip_threshold is defined for the softmax normalizer only, got {normalizer!r}")
        if isinstance(skip_threshold, bool) or not isinstance(skip_threshold, (int, float)) \
                or not 0.0 < skip_threshold < 1.0:
            raise AttentionError(f"skip_threshold must be None or a number in (0, 1), got {skip_threshold!r}")
        if not config.use_triton(query):
            raise AttentionError("skip_threshold (BLASST tile skipping) runs in the CUDA Triton kernel only")
    elif normalizer == "softmax" and softcap is None:
        # (SDPA itself combines attn_mask with is_causal)
        return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                              is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    if attn_mask is not None and is_causal:
        # both, as SDPA allows: the causal triangle (top-left) folded into the mask
        L_, S_ = query.shape[-2], key.shape[-2]
        tri = torch.ones(L_, S_, dtype=torch.bool, device=query.device).tril()
        attn_mask = attn_mask & tri if attn_mask.dtype == torch.bool else attn_mask.masked_fill(~tri, float("-inf"))
        is_causal = False
    if (attn_mask is not None and attn_mask.requires_grad and attn_mask.is_floating_point()
            and torch.is_grad_enabled()):
        raise AttentionError(f"attn_mask requires grad, but normalizer={normalizer!r} (or softcap) gives the "
                             "mask no gradient; detach it")
    if _autocast_on(query.device) and query.dtype == torch.float32:
        dt = torch.get_autocast_dtype(query.device.type)
        query, key, value = query.to(dt), key.to(dt), value.to(dt)
    Hq, L, E = query.shape[-3:]
    Hkv, S, Ev = value.shape[-3:]
    B = math.prod(batch)
    acc = _acc_dtype(query)
    if scale is None:
        scale = 1.0 / math.sqrt(E) if E else 1.0
    q, k, v = _flat(query, batch, B), _flat(key, batch, B), _flat(value, batch, B)
    mask = None if attn_mask is None else _flat_mask(attn_mask, batch, B, Hq, L, S)
    param = None
    if isinstance(norm_param, torch.Tensor):
        param = norm_param.to(acc).expand(*batch, Hq).reshape(B, Hq).contiguous()
    elif norm_param is not None:
        param = torch.full((B, Hq), float(norm_param), dtype=acc, device=query.device)
    seed = _draw_seed() if dropout_p > 0 else None
    n_keys = None
    if mask is not None and normalizer in _N_DEPENDENT:
        # n = the keys the mask leaves each row (not its position): the same n whether a causal or
        # padding mask arrives as a tensor or as is_causal
        keep = mask if mask.dtype == torch.bool else mask != float("-inf")
        n_keys = keep.sum(-1, dtype=torch.float32)
        if keep.shape[-1] == 1 and S != 1:
            n_keys = n_keys * S
        n_keys = n_keys.expand(B, Hq, L).contiguous()
    out, _ = _attention_op(q, k, v, mask, is_causal, float(scale), None if softcap is None else float(softcap),
                           normalizer, param, float(dropout_p), seed,
                           None if skip_threshold is None else float(skip_threshold), n_keys)
    return out.view(*batch, Hq, L, Ev)


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
    """The definition of :func:`attention`, materialized: all (L, S) scores at once, K and V
    repeated for GQA (Hq // Hkv inferred), plain torch, differentiable. For tests.

    Args: as :func:`attention` (GQA implied by the head counts), plus ``dtype`` — the math dtype
    (default fp32 for half inputs, else the input's) — and ``dropout_mask`` (bool, broadcastable to
    the (..., Hq, L, S) weights; True = kept) with its ``dropout_p``.

    Returns: (..., Hq, L, Ev) in ``dtype`` (not rounded to the input dtype).
    """
    acc = dtype or _acc_dtype(query)
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
        keep = _causal_keep(0, L, S, q.device)
    if attn_mask is not None:
        n = keep.expand(*s.shape).sum(-1, keepdim=True).to(acc).clamp(min=1.0)
    else:
        n = _visible_keys(0, L, S, is_causal, acc, q.device)
    param = norm_param
    if isinstance(param, torch.Tensor):
        param = param.to(acc).unsqueeze(-1).unsqueeze(-1)
    w = NORMALIZERS[normalizer].ref(s, keep, n, param)
    if dropout_mask is not None:
        w = w * dropout_mask.to(acc) / (1.0 - dropout_p)
    return torch.matmul(w, v)
