"""Flash-style attention, forward and backward, in Triton, with a compile-time normalizer.

Per (batch ``b``, query head ``h``), query row ``i`` and key ``j``, in fp32::

    s_ij = (q_i . k_j) * scale                      # k, v of kv head h // (Hq // Hkv) (GQA)
    s_ij = softcap * tanh(s_ij / softcap)            # if softcap is not None
    s_ij = s_ij + mask_ij                            # float mask (-inf = masked)
    visible_ij = [j <= i if is_causal] and [mask_ij if bool mask] and [mask_ij != -inf if float mask]
    w_i. = normalizer(s_i.) over the visible keys    # masked keys get weight exactly 0
    w_ij = w_ij * keep_ij / (1 - dropout_p)          # dropout: Philox tl.rand(seed, offset)
    out_i = sum_j w_ij v_j

``n_i`` (the number of keys visible by position) is ``S``, or with ``is_causal``
``min(i + 1, S)``; it does not depend on ``attn_mask``. A row without visible keys gets
``out = 0`` and zero gradients. ``norm_param`` (fp32, one value per (batch, head)) replaces
the normalizer's default parameter. Normalizers (``NORM`` constexpr codes):

* ``softmax`` (0): the online ``(m, d, acc)`` recurrence: "Online normalizer calculation for
  softmax" (Milakov & Gimelshein, 2018); "FlashAttention" (Dao et al., 2022).
* ``softmax1`` (1): ``exp(s_j) / (1 + sum exp(s))`` ("off by one", a zero-logit sink): the
  running max starts at 0 and ``d`` starts at ``exp(0 - 0) = 1``.
* ``ssmax`` (2): Scalable-Softmax (2025), ``softmax((p log n_i) s)``, ``p`` = norm_param (1.0).
* ``sigmoid`` (3): FlashSigmoid (2024), ``sigmoid(s + b)``, ``b`` = norm_param (``-log n_i``).
  No row reduction.
* ``relu`` (4): ``relu(s) * c``, ``c`` = norm_param (``1 / n_i``).
* ``softpick`` (5): softpick (2025), ``relu(e^s - 1) / (sum_j |e^s_j - 1| + eps)``, ``eps`` =
  norm_param (1e-6), computed with a running max ``m >= 0``: numerator
  ``relu(e^{s-m} - e^{-m})``, denominator ``sum |e^{s-m} - e^{-m}| + eps e^{-m}``.
* ``softplus`` (6): LSSA, ``softplus(c s_j) / sum softplus(c s)``, ``c`` = norm_param
  (``log max(n_i, 2)``).
* ``sparsemax`` (7): Martins & Astudillo (2016), ``relu(s - tau)``, ``sum = 1``.
* ``entmax15`` (8): 1.5-entmax, Peters et al. (2019), ``relu(s/2 - tau)^2``, ``sum = 1``.

The whole-row normalizers (7, 8) find ``tau`` without holding a score row: one pass over the
K tiles for the row max, ``sparse_iters`` (default 10) bracketing passes on ``tau`` in
``[max - 1, max]``, one finishing pass, then the output pass. A bracketing pass evaluates
``f(t) = sum relu(z - t)`` (entmax15: ``sum relu(z - t)^2``) at the bracket's midpoint ``t``
(bisection) and also tightens the bracket with the closed-form ``tau`` of the set
``{z > t}`` it saw: for sparsemax a lower bound whatever ``t`` (Michelot's step); for
entmax15 an upper bound when ``{z > t}`` contains the support, a lower bound when it is
inside it, plus a Newton step on the convex ``f`` (a lower bound from the left). The
finishing pass computes the closed-form ``tau`` of the support ``{z > lo}``: exact once no
score lies between ``lo`` and the true ``tau`` (in simulations with rows of 256 to 32768
Gaussian scores: after <= 10 passes for sparsemax, <= 7 for entmax15). Backward: sparsemax
``dS = supp (dP - mean_supp dP)``; entmax15 with ``g = sqrt(w)``,
``dS = g (dP - sum(g dP) / sum g)``; these row sums take one pass over the K tiles.

``stats`` (fp32, (B, Hq, L, 2)) hold what the backward needs per row: ``(m, d)`` for
softmax / softmax1 / ssmax (``w = e^{z - m} / d``; ``d = 0`` for a row without visible
keys), ``(m, den)`` for softpick, ``(0, sum softplus)`` for softplus, ``(tau, 0)`` for
sparsemax / entmax15 (``tau`` in units of ``s`` / ``s/2``), zeros for sigmoid / relu.

Backward (recomputing the score tiles): a row pre-pass computes ``delta_i = rowsum(dO * O)``
for the softmax-like normalizers (the sparse ones: their row sums, with a K pass); then one
program per (kv head, key block) loops over the query heads of its group and over the query
blocks, accumulates ``dK``, ``dV`` in registers (GQA needs no atomics for them) and adds
``dQ`` atomically into an fp32 buffer. ``dnorm_param`` is reduced per (batch, head) with
atomics. Per-element gradients w.r.t. ``s``::

    softmax(1)     dS = w (dP - delta)
    ssmax          dZ = w (dP - delta), dS = (p log n) dZ       dp = sum dZ s log n
    sigmoid        dS = dP w (1 - w)                            db = sum dS
    relu           dS = dP c [s > 0]                            dc = sum dP relu(s)
    softpick       dS = e^{s}/Z ([s > 0] dP - sign(s) delta)    deps = -sum_i delta_i / Z_i
    softplus       dX = sigmoid(c s) (dP - delta) / F, dS = c dX  dc = sum dX s
    sparsemax      dS = [s > tau] (dP - mean_supp dP)
    entmax15       dS = g (dP - sum(g dP) / sum g)

(``dP = dO v^T``, times ``keep / (1 - p)`` with dropout; ``delta = sum_j w_j dP_j``.)

Optional (softmax only, forward only, off by default): ``skip_threshold = lambda`` skips a K/V
tile when ``tile_max - running_max < ln(lambda)`` for every row of the query block (BLASST,
skip-softmax sparse attention, ALGORITHMS.md 1.6): an approximation; the backward then uses
the approximate saved normalizer.

All pointer offsets are int64 (``B*H*L*S`` may exceed ``2**31`` for the mask). Block sizes
are constexpr powers of two ``>= 16`` (``tl.dot``); ``L``, ``S``, ``E`` and ``Ev`` are masked,
so ``E`` need not be a power of two. Products run on the tensor cores with fp32 accumulation
(fp32 inputs: ``torch.get_float32_matmul_precision()``); the weights / score gradients enter
the second matmuls rounded to the input dtype (as in FlashAttention).

On a machine without a GPU the kernels run through Triton's interpreter when
``TRITON_INTERPRET=1`` was set before triton was imported (CPU tensors); ``DOT_F32`` and
``FIX_BF16`` are the interpreter-only bf16 workarounds of ``triton_linear_ce``.
"""

from __future__ import annotations

import contextlib
import math
import os

import torch

from smxcompile.kernels import triton_runtime  # absolute: tests also load this file on its own

try:  # triton is optional: smxcompile must import without it.
    import triton
    import triton.language as tl
except Exception as _e:  # pragma: no cover - exercised only without triton
    triton = None
    tl = None
    _TRITON_IMPORT_ERROR: Exception | None = _e
else:
    _TRITON_IMPORT_ERROR = None

__all__ = ["attention_forward", "attention_backward", "dropout_keep_mask", "NORMALIZERS"]

#: Normalizer name -> the kernels' NORM constexpr.
NORMALIZERS = {"softmax": 0, "softmax1": 1, "ssmax": 2, "sigmoid": 3, "relu": 4, "softpick": 5, "softplus": 6,
               "sparsemax": 7, "entmax15": 8}
_SOFTMAX_LIKE = (0, 1, 2, 5, 6)  # backward uses delta = rowsum(dO * O)
#: Bracketing passes on tau for sparsemax / entmax15 (each halves the bracket at least).
SPARSE_ITERS = 10

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MASK_NONE, _MASK_BOOL, _MASK_FLOAT = 0, 1, 2


# --------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------

if triton is not None:
    # Shared with the linear-cross-entropy kernels: libdevice-free tanh, the bf16-rounding
    # cast and the dot with the interpreter's bf16 workaround.
    from .triton_linear_ce import _dot, _safe_max, _tanh, _to

    @triton.jit
    def _sigmoid_pair(x):
        """``(sigmoid(x), sigmoid(-x))`` without overflow or cancellation."""
        e = tl.exp(-tl.abs(x))
        r = 1.0 / (1.0 + e)
        pos = x >= 0.0
        return tl.where(pos, r, e * r), tl.where(pos, e * r, r)

    @triton.jit
    def _softplus(x):
        """``log(1 + e^x)`` = ``max(x, 0) + log1p(e^{-|x|})`` with an accurate log1p (Goldberg)."""
        e = tl.exp(-tl.abs(x))
        u = 1.0 + e
        l1p = tl.where(u == 1.0, e, tl.log(u) * (e / (u - 1.0)))
        return tl.maximum(x, 0.0) + l1p

    @triton.jit
    def _keep(seed, bh, L, S, rows, cols, dropout_p):
        """Dropout keep-mask of a [rows, cols] tile: Philox ``tl.rand(seed, ((bh*L + i)*S + j))
        >= p`` (int64 offsets; forward, backward and :func:`dropout_keep_mask` share it)."""
        off = (bh * L + rows)[:, None] * S + cols[None, :]
        return tl.rand(seed, off) >= dropout_p

    @triton.jit
    def _row_coef(rows, row_ok, S, param, n_ptr, n_base, NORM: tl.constexpr, HAS_PARAM: tl.constexpr,
                  IS_CAUSAL: tl.constexpr, HAS_N: tl.constexpr):
        """Per-row ``(coef, log n)``: the normalizer's parameter (ssmax: ``p log n``, sigmoid: ``b``,
        relu / softplus: ``c``, softpick: ``eps``); ``n`` = keys visible by position, or the per-row
        count given in ``n_ptr`` (``HAS_N``: the keys a mask leaves, at least 1)."""
        if HAS_N:
            n = tl.maximum(tl.load(n_ptr + (n_base + rows), mask=row_ok, other=1.0).to(tl.float32), 1.0)
        elif IS_CAUSAL:
            n = tl.minimum(rows + 1, S).to(tl.float32)
        else:
            n = tl.zeros(rows.shape, tl.float32) + S
        lg = tl.log(n)
        if HAS_PARAM:
            par = tl.zeros(rows.shape, tl.float32) + param
        else:
            if NORM == 2:
                par = tl.zeros(rows.shape, tl.float32) + 1.0
            elif NORM == 3:
                par = -lg
            elif NORM == 4:
                par = 1.0 / n
            elif NORM == 5:
                par = tl.zeros(rows.shape, tl.float32) + 1e-6  # softpick's default eps
            else:
                par = tl.log(tl.maximum(n, 2.0))
        if NORM == 2:
            coef = par * lg
        else:
            coef = par
        return coef, lg

    @triton.jit
    def _scores(q, kt, rows, row_ok, cols, col_ok, mask_ptr, mk_base, mk_sl, mk_ss, scale, softcap,
                MASK_KIND: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr, DOT_F32: tl.constexpr):
        """Scores of a [BLOCK_M, BLOCK_N] tile (``kt``: [BLOCK_E, BLOCK_N]) in fp32.

        Returns ``(s, sc, vis)``: ``s`` (mask added), ``sc`` (the soft-capped score before the
        mask, for the tanh derivative) and the visibility."""
        s = _dot(q, kt, tl.zeros([BLOCK_M, BLOCK_N], tl.float32), PREC, DOT_F32) * scale
        if HAS_SOFTCAP:
            s = softcap * _tanh(s / softcap)
        sc = s
        vis = row_ok[:, None] & col_ok[None, :]
        if IS_CAUSAL:
            vis = vis & (cols[None, :] <= rows[:, None])
        if MASK_KIND == 1:
            mv = tl.load(mask_ptr + (mk_base + rows[:, None] * mk_sl + cols[None, :] * mk_ss), mask=vis, other=0)
            vis = vis & (mv != 0)
        elif MASK_KIND == 2:
            mv = tl.load(mask_ptr + (mk_base + rows[:, None] * mk_sl + cols[None, :] * mk_ss), mask=vis,
                         other=0.0).to(tl.float32)
            vis = vis & (mv != float("-inf"))
            s = s + mv
        return s, sc, vis

    @triton.jit
    def _scores_at(start, q, k_ptr, k_base, k_ss, k_se, offs_e, e_ok, rows, row_ok, S,
                   mask_ptr, mk_base, mk_sl, mk_ss, scale, softcap,
                   MASK_KIND: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr, DOT_F32: tl.constexpr):
        """Load the K tile at key ``start`` and score it: ``(s, sc, vis, cols, col_ok)``."""
        cols = start + tl.arange(0, BLOCK_N).to(tl.int64)
        col_ok = cols < S
        kt = tl.load(k_ptr + (k_base + cols[None, :] * k_ss + offs_e[:, None] * k_se),
                     mask=e_ok[:, None] & col_ok[None, :], other=0.0)
        s, sc, vis = _scores(q, kt, rows, row_ok, cols, col_ok, mask_ptr, mk_base, mk_sl, mk_ss, scale, softcap,
                             MASK_KIND, IS_CAUSAL, HAS_SOFTCAP, BLOCK_M, BLOCK_N, PREC, DOT_F32)
        return s, sc, vis, cols, col_ok

    @triton.jit
    def _sparse_sums(t, mxs, hi, q, k_ptr, k_base, k_ss, k_se, offs_e, e_ok, rows, row_ok, S,
                     mask_ptr, mk_base, mk_sl, mk_ss, scale, softcap,
                     NORM: tl.constexpr, MASK_KIND: tl.constexpr, IS_CAUSAL: tl.constexpr,
                     HAS_SOFTCAP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     PREC: tl.constexpr, DOT_F32: tl.constexpr):
        """One pass over the K tiles: over ``A = {y > t}`` (``y = z - max``, ``z = s`` or ``s/2``)
        return ``(|A|, sum_A y, sum_A y^2, sum_A (y - t), sum_A (y - t)^2)``."""
        cnt = tl.zeros([BLOCK_M], tl.float32)
        s1 = tl.zeros([BLOCK_M], tl.float32)
        s2 = tl.zeros([BLOCK_M], tl.float32)
        f1 = tl.zeros([BLOCK_M], tl.float32)
        f2 = tl.zeros([BLOCK_M], tl.float32)
        for start in range(0, hi, BLOCK_N):
            s, sc, vis, cols, col_ok = _scores_at(start, q, k_ptr, k_base, k_ss, k_se, offs_e, e_ok, rows, row_ok,
                                                  S, mask_ptr, mk_base, mk_sl, mk_ss, scale, softcap, MASK_KIND,
                                                  IS_CAUSAL, HAS_SOFTCAP, BLOCK_M, BLOCK_N, PREC, DOT_F32)
            if NORM == 8:
                s = s * 0.5
            y = s - mxs[:, None]
            a = vis & (y > t[:, None])
            ya = tl.where(a, y, 0.0)
            r = tl.where(a, y - t[:, None], 0.0)
            cnt += tl.sum(a.to(tl.float32), axis=1)
            s1 += tl.sum(ya, axis=1)
            s2 += tl.sum(ya * ya, axis=1)
            f1 += tl.sum(r, axis=1)
            f2 += tl.sum(r * r, axis=1)
        return cnt, s1, s2, f1, f2

    @triton.jit
    def _closed_tau(cnt, s1, s2, NORM: tl.constexpr):
        """tau of the support seen (``(ok, tau)``): sparsemax ``(sum y - 1) / k``; entmax15 the
        smaller root of ``sum (y - tau)^2 = 1``: ``mean - sqrt((1 - ss) / k)``."""
        k = tl.maximum(cnt, 1.0)
        mu = s1 / k
        if NORM == 8:
            ss = s2 - s1 * mu
            delta = (1.0 - ss) / k
            ok = (cnt > 0.0) & (delta >= 0.0)
            tau = mu - tl.sqrt(tl.maximum(delta, 0.0))
        else:
            ok = cnt > 0.0
            tau = (s1 - 1.0) / k
        return ok, tau

    @triton.jit
    def _fwd_kernel(
        q_ptr, k_ptr, v_ptr, mask_ptr, par_ptr, n_ptr, o_ptr, st_ptr,
        q_sb, q_sh, q_sl, q_se, k_sb, k_sh, k_ss, k_se, v_sb, v_sh, v_ss, v_se,
        mk_sb, mk_sh, mk_sl, mk_ss, o_sb, o_sh, o_sl, o_se,
        H, G, L, S, E, EV, scale, softcap, seed, dropout_p, log_skip, n_iter,
        NORM: tl.constexpr, HAS_PARAM: tl.constexpr, HAS_N: tl.constexpr, MASK_KIND: tl.constexpr, IS_CAUSAL: tl.constexpr,
        HAS_SOFTCAP: tl.constexpr, DROPOUT: tl.constexpr, SKIP: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_EV: tl.constexpr,
        PREC: tl.constexpr, DOT_F32: tl.constexpr, FIX_BF16: tl.constexpr,
    ):
        """One program: BLOCK_M query rows of one (batch, query head)."""
        bh = tl.program_id(0).to(tl.int64)
        pid_m = tl.program_id(1).to(tl.int64)
        b = bh // H
        h = bh % H
        hk = h // G
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
        row_ok = rows < L
        offs_e = tl.arange(0, BLOCK_E).to(tl.int64)
        e_ok = offs_e < E
        offs_v = tl.arange(0, BLOCK_EV).to(tl.int64)
        v_ok = offs_v < EV
        q = tl.load(q_ptr + (b * q_sb + h * q_sh + rows[:, None] * q_sl + offs_e[None, :] * q_se),
                    mask=row_ok[:, None] & e_ok[None, :], other=0.0)
        k_base = b * k_sb + hk * k_sh
        v_base = b * v_sb + hk * v_sh
        mk_base = b * mk_sb + h * mk_sh
        if HAS_PARAM:
            param = tl.load(par_ptr + bh)
        else:
            param = 0.0
        coef, lg = _row_coef(rows, row_ok, S, param, n_ptr, bh * L, NORM, HAS_PARAM, IS_CAUSAL, HAS_N)
        hi = S
        if IS_CAUSAL:
            hi = tl.minimum(S, (pid_m + 1) * BLOCK_M)
        inv_keep = 1.0 / (1.0 - dropout_p)

        acc = tl.zeros([BLOCK_M, BLOCK_EV], tl.float32)
        st0 = tl.zeros([BLOCK_M], tl.float32)
        st1 = tl.zeros([BLOCK_M], tl.float32)
        if NORM <= 2 or NORM == 5:
            # online (m, d, acc): softmax / ssmax from m = -inf, d = 0; softmax1 from m = 0, d = 1
            # (the sink); softpick from m = 0, d = 0 (d: sum |e^{z-m} - e^{-m}|).
            if NORM == 0 or NORM == 2:
                m = tl.full([BLOCK_M], float("-inf"), tl.float32)
            else:
                m = tl.zeros([BLOCK_M], tl.float32)
            if NORM == 1:
                d = tl.zeros([BLOCK_M], tl.float32) + 1.0
            else:
                d = tl.zeros([BLOCK_M], tl.float32)
            for start in range(0, hi, BLOCK_N):
                s, sc, vis, cols, col_ok = _scores_at(start, q, k_ptr, k_base, k_ss, k_se, offs_e, e_ok, rows,
                                                      row_ok, S, mask_ptr, mk_base, mk_sl, mk_ss, scale, softcap,
                                                      MASK_KIND, IS_CAUSAL, HAS_SOFTCAP, BLOCK_M, BLOCK_N, PREC,
                                                      DOT_F32)
                if NORM == 2:
                    s = s * coef[:, None]
                z = tl.where(vis, s, float("-inf"))
                tmax = tl.max(z, axis=1)
                if SKIP:
                    # BLASST: skip the tile when every row's tile max is ln(lambda) below its running max.
                    live = row_ok & (tmax > float("-inf")) & ((tmax - m) >= log_skip)
                    go = tl.sum(live.to(tl.int32), axis=0) > 0
                else:
                    go = True
                if go:
                    m_new = tl.maximum(m, tmax)
                    ms_new = _safe_max(m_new)
                    # min(., 0) guards -inf - (-inf) (a prefix without visible keys, d == 0)
                    alpha = tl.exp(tl.minimum(_safe_max(m) - ms_new, 0.0))
                    if NORM == 5:
                        a = tl.where(vis, tl.exp(z - ms_new[:, None]) - tl.exp(-ms_new)[:, None], 0.0)
                        p = tl.maximum(a, 0.0)
                        d = d * alpha + tl.sum(tl.abs(a), axis=1)
                    else:
                        p = tl.exp(z - ms_new[:, None])
                        d = d * alpha + tl.sum(p, axis=1)
                    if DROPOUT:
                        p = tl.where(_keep(seed, bh, L, S, rows, cols, dropout_p), p * inv_keep, 0.0)
                    vt = tl.load(v_ptr + (v_base + cols[:, None] * v_ss + offs_v[None, :] * v_se),
                                 mask=col_ok[:, None] & v_ok[None, :], other=0.0)
                    acc = _dot(_to(p, v_ptr, FIX_BF16), vt, acc * alpha[:, None], PREC, DOT_F32)
                    m = m_new
            st0 = _safe_max(m)
            if NORM == 5:
                d = d + coef * tl.exp(-st0)
            st1 = d
            acc = acc * tl.where(d > 0.0, 1.0 / d, 0.0)[:, None]
        elif NORM <= 6:
            # sigmoid / relu (no row reduction), softplus (a plain row sum: no max needed)
            fsum = tl.zeros([BLOCK_M], tl.float32)
            for start in range(0, hi, BLOCK_N):
                s, sc, vis, cols, col_ok = _scores_at(start, q, k_ptr, k_base, k_ss, k_se, offs_e, e_ok, rows,
                                                      row_ok, S, mask_ptr, mk_base, mk_sl, mk_ss, scale, softcap,
                                                      MASK_KIND, IS_CAUSAL, HAS_SOFTCAP, BLOCK_M, BLOCK_N, PREC,
                                                      DOT_F32)
                if NORM == 3:
                    sg, _ = _sigmoid_pair(s + coef[:, None])
                    p = tl.where(vis, sg, 0.0)
                elif NORM == 4:
                    p = tl.where(vis, tl.maximum(s, 0.0) * coef[:, None], 0.0)
                else:
                    p = tl.where(vis, _softplus(s * coef[:, None]), 0.0)
                    fsum += tl.sum(p, axis=1)
                if DROPOUT:
                    p = tl.where(_keep(seed, bh, L, S, rows, cols, dropout_p), p * inv_keep, 0.0)
                vt = tl.load(v_ptr + (v_base + cols[:, None] * v_ss + offs_v[None, :] * v_se),
                             mask=col_ok[:, None] & v_ok[None, :], other=0.0)
                acc = _dot(_to(p, v_ptr, FIX_BF16), vt, acc, PREC, DOT_F32)
            if NORM == 6:
                st1 = fsum
                acc = acc * tl.where(fsum > 0.0, 1.0 / fsum, 0.0)[:, None]
        else:
            # sparsemax / entmax15: the row max, bracketing passes on tau, the exact finish.
            mx = tl.full([BLOCK_M], float("-inf"), tl.float32)
            for start in range(0, hi, BLOCK_N):
                s, sc, vis, cols, col_ok = _scores_at(start, q, k_ptr, k_base, k_ss, k_se, offs_e, e_ok, rows,
                                                      row_ok, S, mask_ptr, mk_base, mk_sl, mk_ss, scale, softcap,
                                                      MASK_KIND, IS_CAUSAL, HAS_SOFTCAP, BLOCK_M, BLOCK_N, PREC,
                                                      DOT_F32)
                if NORM == 8:
                    s = s * 0.5
                mx = tl.maximum(mx, tl.max(tl.where(vis, s, float("-inf")), axis=1))
            mxs = _safe_max(mx)
            lo = tl.zeros([BLOCK_M], tl.float32) - 1.0  # in y = z - max units: tau in [-1, 0]
            up = tl.zeros([BLOCK_M], tl.float32)
            for _it in range(n_iter):
                t = (lo + up) * 0.5
                cnt, s1, s2, f1, f2 = _sparse_sums(t, mxs, hi, q, k_ptr, k_base, k_ss, k_se, offs_e, e_ok, rows,
                                                   row_ok, S, mask_ptr, mk_base, mk_sl, mk_ss, scale, softcap, NORM,
                                                   MASK_KIND, IS_CAUSAL, HAS_SOFTCAP, BLOCK_M, BLOCK_N, PREC, DOT_F32)
                ok, tc = _closed_tau(cnt, s1, s2, NORM)
                if NORM == 8:
                    f = f2
                else:
                    f = f1
                below = f >= 1.0  # t <= tau: {y > t} contains the support
                lo = tl.where(below, tl.maximum(lo, t), lo)
                up = tl.where(below, up, tl.minimum(up, t))
                if NORM == 8:
                    # entmax15: the closed form of a superset of the support is an upper bound, of a
                    # subset a lower one; a Newton step on the convex f from the left a lower one.
                    up = tl.where(below & ok, tl.minimum(up, tc), up)
                    lo = tl.where(~below & ok, tl.maximum(lo, tc), lo)
                    newton = t + (f2 - 1.0) / tl.maximum(2.0 * f1, 1e-30)
                    lo = tl.where(below & (cnt > 0.0), tl.maximum(lo, newton), lo)
                else:
                    # sparsemax: the closed form of any {y > t} is a lower bound (a Newton step when t <= tau)
                    lo = tl.where(ok, tl.maximum(lo, tc), lo)
                lo = tl.minimum(lo, up)
            cnt, s1, s2, f1, f2 = _sparse_sums(lo, mxs, hi, q, k_ptr, k_base, k_ss, k_se, offs_e, e_ok, rows, row_ok,
                                               S, mask_ptr, mk_base, mk_sl, mk_ss, scale, softcap, NORM, MASK_KIND,
                                               IS_CAUSAL, HAS_SOFTCAP, BLOCK_M, BLOCK_N, PREC, DOT_F32)
            ok, tc = _closed_tau(cnt, s1, s2, NORM)
            tau = tl.where(ok, tc, lo)
            for start in range(0, hi, BLOCK_N):
                s, sc, vis, cols, col_ok = _scores_at(start, q, k_ptr, k_base, k_ss, k_se, offs_e, e_ok, rows,
                                                      row_ok, S, mask_ptr, mk_base, mk_sl, mk_ss, scale, softcap,
                                                      MASK_KIND, IS_CAUSAL, HAS_SOFTCAP, BLOCK_M, BLOCK_N, PREC,
                                                      DOT_F32)
                if NORM == 8:
                    s = s * 0.5
                g = tl.where(vis, tl.maximum((s - mxs[:, None]) - tau[:, None], 0.0), 0.0)
                if NORM == 8:
                    p = g * g
                else:
                    p = g
                if DROPOUT:
                    p = tl.where(_keep(seed, bh, L, S, rows, cols, dropout_p), p * inv_keep, 0.0)
                vt = tl.load(v_ptr + (v_base + cols[:, None] * v_ss + offs_v[None, :] * v_se),
                             mask=col_ok[:, None] & v_ok[None, :], other=0.0)
                acc = _dot(_to(p, v_ptr, FIX_BF16), vt, acc, PREC, DOT_F32)
            st0 = tau + mxs

        tl.store(o_ptr + (b * o_sb + h * o_sh + rows[:, None] * o_sl + offs_v[None, :] * o_se),
                 _to(acc, o_ptr, FIX_BF16), mask=row_ok[:, None] & v_ok[None, :])
        so = (bh * L + rows) * 2
        tl.store(st_ptr + so, st0, mask=row_ok)
        tl.store(st_ptr + (so + 1), st1, mask=row_ok)

    @triton.jit
    def _bwd_pre_kernel(
        q_ptr, k_ptr, v_ptr, mask_ptr, par_ptr, o_ptr, do_ptr, st_ptr, delta_ptr, dpar_ptr,
        q_sb, q_sh, q_sl, q_se, k_sb, k_sh, k_ss, k_se, v_sb, v_sh, v_ss, v_se,
        mk_sb, mk_sh, mk_sl, mk_ss, o_sb, o_sh, o_sl, o_se, do_sb, do_sh, do_sl, do_se,
        H, G, L, S, E, EV, scale, softcap, seed, dropout_p,
        NORM: tl.constexpr, HAS_PARAM: tl.constexpr, HAS_N: tl.constexpr, MASK_KIND: tl.constexpr, IS_CAUSAL: tl.constexpr,
        HAS_SOFTCAP: tl.constexpr, DROPOUT: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_EV: tl.constexpr,
        PREC: tl.constexpr, DOT_F32: tl.constexpr,
    ):
        """Per query row: ``delta`` (softmax-like: ``rowsum(dO * O)``; sparsemax:
        ``mean_supp dP``; entmax15: ``sum(g dP) / sum g``) and softpick's ``deps``."""
        bh = tl.program_id(0).to(tl.int64)
        pid_m = tl.program_id(1).to(tl.int64)
        b = bh // H
        h = bh % H
        hk = h // G
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
        row_ok = rows < L
        offs_v = tl.arange(0, BLOCK_EV).to(tl.int64)
        v_ok = offs_v < EV
        rv_ok = row_ok[:, None] & v_ok[None, :]
        do = tl.load(do_ptr + (b * do_sb + h * do_sh + rows[:, None] * do_sl + offs_v[None, :] * do_se),
                     mask=rv_ok, other=0.0)
        if NORM >= 7:
            offs_e = tl.arange(0, BLOCK_E).to(tl.int64)
            e_ok = offs_e < E
            q = tl.load(q_ptr + (b * q_sb + h * q_sh + rows[:, None] * q_sl + offs_e[None, :] * q_se),
                        mask=row_ok[:, None] & e_ok[None, :], other=0.0)
            k_base = b * k_sb + hk * k_sh
            v_base = b * v_sb + hk * v_sh
            mk_base = b * mk_sb + h * mk_sh
            tau = tl.load(st_ptr + (bh * L + rows) * 2, mask=row_ok, other=0.0)
            hi = S
            if IS_CAUSAL:
                hi = tl.minimum(S, (pid_m + 1) * BLOCK_M)
            inv_keep = 1.0 / (1.0 - dropout_p)
            num = tl.zeros([BLOCK_M], tl.float32)
            den = tl.zeros([BLOCK_M], tl.float32)
            for start in range(0, hi, BLOCK_N):
                s, sc, vis, cols, col_ok = _scores_at(start, q, k_ptr, k_base, k_ss, k_se, offs_e, e_ok, rows,
                                                      row_ok, S, mask_ptr, mk_base, mk_sl, mk_ss, scale, softcap,
                                                      MASK_KIND, IS_CAUSAL, HAS_SOFTCAP, BLOCK_M, BLOCK_N, PREC,
                                                      DOT_F32)
                vt = tl.load(v_ptr + (v_base + cols[None, :] * v_ss + offs_v[:, None] * v_se),
                             mask=v_ok[:, None] & col_ok[None, :], other=0.0)
                dp = _dot(do, vt, tl.zeros([BLOCK_M, BLOCK_N], tl.float32), PREC, DOT_F32)
                if DROPOUT:
                    dp = tl.where(_keep(seed, bh, L, S, rows, cols, dropout_p), dp * inv_keep, 0.0)
                if NORM == 8:
                    g = tl.where(vis, tl.maximum(s * 0.5 - tau[:, None], 0.0), 0.0)
                else:
                    g = tl.where(vis & (s > tau[:, None]), 1.0, 0.0)
                num += tl.sum(g * dp, axis=1)
                den += tl.sum(g, axis=1)
            delta = tl.where(den > 0.0, num / tl.maximum(den, 1e-30), 0.0)
        else:
            o = tl.load(o_ptr + (b * o_sb + h * o_sh + rows[:, None] * o_sl + offs_v[None, :] * o_se),
                        mask=rv_ok, other=0.0)
            delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), axis=1)
            if NORM == 5:
                if HAS_PARAM:
                    # deps = -sum_i delta_i / Z_i,  1 / Z = e^{-m} / den
                    so = (bh * L + rows) * 2
                    m = tl.load(st_ptr + so, mask=row_ok, other=0.0)
                    dn = tl.load(st_ptr + (so + 1), mask=row_ok, other=0.0)
                    contrib = tl.where(row_ok & (dn > 0.0), -delta * tl.exp(-m) / tl.where(dn > 0.0, dn, 1.0), 0.0)
                    tl.atomic_add(dpar_ptr + bh, tl.sum(contrib, axis=0), sem="relaxed")
        tl.store(delta_ptr + bh * L + rows, delta, mask=row_ok)

    @triton.jit
    def _bwd_kernel(
        q_ptr, k_ptr, v_ptr, mask_ptr, par_ptr, n_ptr, do_ptr, st_ptr, delta_ptr, dq_ptr, dk_ptr, dv_ptr, dpar_ptr,
        q_sb, q_sh, q_sl, q_se, k_sb, k_sh, k_ss, k_se, v_sb, v_sh, v_ss, v_se,
        mk_sb, mk_sh, mk_sl, mk_ss, do_sb, do_sh, do_sl, do_se,
        H, HKV, G, L, S, E, EV, scale, softcap, seed, dropout_p,
        NORM: tl.constexpr, HAS_PARAM: tl.constexpr, HAS_N: tl.constexpr, MASK_KIND: tl.constexpr, IS_CAUSAL: tl.constexpr,
        HAS_SOFTCAP: tl.constexpr, DROPOUT: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_EV: tl.constexpr,
        PREC: tl.constexpr, DOT_F32: tl.constexpr, FIX_BF16: tl.constexpr,
    ):
        """One program: BLOCK_N keys of one (batch, kv head), over every query head of its group
        and every query block. dK, dV in registers; dQ (fp32, (B, H, L, E)) by atomics."""
        bhk = tl.program_id(0).to(tl.int64)
        pid_n = tl.program_id(1).to(tl.int64)
        b = bhk // HKV
        hk = bhk % HKV
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
        col_ok = cols < S
        offs_e = tl.arange(0, BLOCK_E).to(tl.int64)
        e_ok = offs_e < E
        offs_v = tl.arange(0, BLOCK_EV).to(tl.int64)
        v_ok = offs_v < EV
        kk = tl.load(k_ptr + (b * k_sb + hk * k_sh + cols[:, None] * k_ss + offs_e[None, :] * k_se),
                     mask=col_ok[:, None] & e_ok[None, :], other=0.0)
        vv = tl.load(v_ptr + (b * v_sb + hk * v_sh + cols[:, None] * v_ss + offs_v[None, :] * v_se),
                     mask=col_ok[:, None] & v_ok[None, :], other=0.0)
        kt = tl.trans(kk)
        vt = tl.trans(vv)
        dk = tl.zeros([BLOCK_N, BLOCK_E], tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_EV], tl.float32)
        m_lo = 0
        if IS_CAUSAL:
            m_lo = ((pid_n * BLOCK_N) // BLOCK_M) * BLOCK_M
        inv_keep = 1.0 / (1.0 - dropout_p)
        for g in range(0, G):
            h = hk * G + g
            bh = b * H + h
            mk_base = b * mk_sb + h * mk_sh
            if HAS_PARAM:
                param = tl.load(par_ptr + bh)
            else:
                param = 0.0
            dpar = tl.zeros([BLOCK_M], tl.float32)
            for start_m in range(m_lo, L, BLOCK_M):
                rows = start_m + tl.arange(0, BLOCK_M).to(tl.int64)
                row_ok = rows < L
                q = tl.load(q_ptr + (b * q_sb + h * q_sh + rows[:, None] * q_sl + offs_e[None, :] * q_se),
                            mask=row_ok[:, None] & e_ok[None, :], other=0.0)
                do = tl.load(do_ptr + (b * do_sb + h * do_sh + rows[:, None] * do_sl + offs_v[None, :] * do_se),
                             mask=row_ok[:, None] & v_ok[None, :], other=0.0)
                so = (bh * L + rows) * 2
                st0 = tl.load(st_ptr + so, mask=row_ok, other=0.0)
                st1 = tl.load(st_ptr + (so + 1), mask=row_ok, other=0.0)
                coef, lg = _row_coef(rows, row_ok, S, param, n_ptr, bh * L, NORM, HAS_PARAM, IS_CAUSAL, HAS_N)
                s, sc, vis = _scores(q, kt, rows, row_ok, cols, col_ok, mask_ptr, mk_base, mk_sl, mk_ss, scale,
                                     softcap, MASK_KIND, IS_CAUSAL, HAS_SOFTCAP, BLOCK_M, BLOCK_N, PREC, DOT_F32)
                s = tl.where(vis, s, 0.0)  # finite everywhere below; masked entries are dropped by `vis`
                # the weights w
                if NORM <= 2:
                    z = s
                    if NORM == 2:
                        z = s * coef[:, None]
                    w = tl.exp(z - st0[:, None]) * tl.where(st1 > 0.0, 1.0 / st1, 0.0)[:, None]
                elif NORM == 3:
                    w, w1 = _sigmoid_pair(s + coef[:, None])
                elif NORM == 4:
                    w = tl.maximum(s, 0.0) * coef[:, None]
                elif NORM == 5:
                    invz = tl.where(st1 > 0.0, 1.0 / st1, 0.0)
                    u = tl.exp(s - st0[:, None]) * invz[:, None]  # e^s / Z
                    w = tl.maximum(u - (tl.exp(-st0) * invz)[:, None], 0.0)
                elif NORM == 6:
                    x = s * coef[:, None]
                    invf = tl.where(st1 > 0.0, 1.0 / st1, 0.0)
                    w = _softplus(x) * invf[:, None]
                elif NORM == 7:
                    w = tl.maximum(s - st0[:, None], 0.0)
                else:
                    gg = tl.maximum(s * 0.5 - st0[:, None], 0.0)
                    w = gg * gg
                w = tl.where(vis, w, 0.0)
                if DROPOUT:
                    keep = _keep(seed, bh, L, S, rows, cols, dropout_p)
                    wd = tl.where(keep, w * inv_keep, 0.0)
                else:
                    wd = w
                dv = _dot(tl.trans(_to(wd, v_ptr, FIX_BF16)), do, dv, PREC, DOT_F32)
                dp = _dot(do, vt, tl.zeros([BLOCK_M, BLOCK_N], tl.float32), PREC, DOT_F32)
                if DROPOUT:
                    dp = tl.where(keep, dp * inv_keep, 0.0)
                if NORM == 3 or NORM == 4:
                    if NORM == 3:
                        ds = dp * w * w1
                        dpar_e = ds
                    else:
                        ds = tl.where(s > 0.0, dp * coef[:, None], 0.0)
                        dpar_e = dp * tl.maximum(s, 0.0)
                else:
                    delta = tl.load(delta_ptr + bh * L + rows, mask=row_ok, other=0.0)
                    if NORM <= 2:
                        ds = w * (dp - delta[:, None])
                        if NORM == 2:
                            dpar_e = ds * s * lg[:, None]
                            ds = ds * coef[:, None]
                    elif NORM == 5:
                        sgn = tl.where(s > 0.0, 1.0, tl.where(s < 0.0, -1.0, 0.0))
                        ds = u * (tl.where(s > 0.0, dp, 0.0) - sgn * delta[:, None])
                    elif NORM == 6:
                        sg, _ = _sigmoid_pair(x)
                        dx = sg * (dp - delta[:, None]) * invf[:, None]
                        dpar_e = dx * s
                        ds = dx * coef[:, None]
                    elif NORM == 7:
                        ds = tl.where(s > st0[:, None], dp - delta[:, None], 0.0)
                    else:
                        ds = gg * (dp - delta[:, None])
                ds = tl.where(vis, ds, 0.0)
                if HAS_PARAM:
                    if NORM == 2 or NORM == 3 or NORM == 4 or NORM == 6:
                        dpar += tl.sum(tl.where(vis, dpar_e, 0.0), axis=1)
                if HAS_SOFTCAP:
                    r = sc / softcap
                    ds = ds * (scale * (1.0 - r * r))
                else:
                    ds = ds * scale
                dsc = _to(ds, q_ptr, FIX_BF16)
                dk = _dot(tl.trans(dsc), q, dk, PREC, DOT_F32)
                dq = _dot(dsc, kk, tl.zeros([BLOCK_M, BLOCK_E], tl.float32), PREC, DOT_F32)
                tl.atomic_add(dq_ptr + ((bh * L + rows[:, None]) * E + offs_e[None, :]), dq,
                              mask=row_ok[:, None] & e_ok[None, :], sem="relaxed")
            if HAS_PARAM:
                if NORM == 2 or NORM == 3 or NORM == 4 or NORM == 6:
                    tl.atomic_add(dpar_ptr + bh, tl.sum(dpar, axis=0), sem="relaxed")
        tl.store(dk_ptr + ((bhk * S + cols[:, None]) * E + offs_e[None, :]), _to(dk, dk_ptr, FIX_BF16),
                 mask=col_ok[:, None] & e_ok[None, :])
        tl.store(dv_ptr + ((bhk * S + cols[:, None]) * EV + offs_v[None, :]), _to(dv, dv_ptr, FIX_BF16),
                 mask=col_ok[:, None] & v_ok[None, :])

    @triton.jit
    def _keep_kernel(out_ptr, L, S, seed, dropout_p, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """The dropout keep-mask the attention kernels use, as uint8 (B*H, L, S)."""
        bh = tl.program_id(0).to(tl.int64)
        rows = tl.program_id(1).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
        row_ok = rows < L
        for start in range(0, S, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N).to(tl.int64)
            keep = _keep(seed, bh, L, S, rows, cols, dropout_p)
            tl.store(out_ptr + ((bh * L + rows[:, None]) * S + cols[None, :]), keep.to(tl.uint8),
                     mask=row_ok[:, None] & (cols < S)[None, :])


# --------------------------------------------------------------------------------------
# Launch helpers
# --------------------------------------------------------------------------------------

_INTERPRET_AT_IMPORT = os.environ.get("TRITON_INTERPRET") == "1"

# Default blocks (BLOCK_M, BLOCK_N) by the padded head dim (max of E, Ev), for 16-bit and fp32
# inputs. Not tuned on a GPU yet; sized (compiled for sm_90) to use <= 96 KiB of shared memory
# in every kernel, so they also fit sm_80 / sm_86 / sm_89 -- except fp32 with head dims > 128,
# whose backward needs up to 160 KiB (sm_80 / sm_90 only).
_BLOCKS_16 = {64: (64, 64), 128: (64, 32), 256: (32, 32)}
_BLOCKS_32 = {64: (32, 32), 128: (32, 32), 256: (16, 16)}
_STAGES = 2


def _interpret_env() -> bool:
    return triton_runtime.interpret_env()


def _interpreted() -> bool:
    """Whether the kernels were decorated in interpreter mode (TRITON_INTERPRET=1 at import)."""
    if triton is None:
        return _INTERPRET_AT_IMPORT   # no kernels were defined
    return triton_runtime.interpreted(_fwd_kernel, _INTERPRET_AT_IMPORT)


def _check_runtime(t: torch.Tensor) -> None:
    triton_runtime.check_runtime(t, what="attention", module=__name__, triton_module=triton,
                                 import_error=_TRITON_IMPORT_ERROR, is_interpreted=_interpreted)


def _on_device(t: torch.Tensor):
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _dot_precision(dtype: torch.dtype) -> str:
    if dtype != torch.float32:
        return "ieee"  # ignored for fp16 / bf16 operands
    return {"highest": "ieee", "high": "tf32x3", "medium": "tf32"}.get(torch.get_float32_matmul_precision(), "ieee")


def _block(name: str, value: int | None, default: int, extent: int) -> int:
    if value is not None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 16 or value & (value - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {value!r}")
        return value
    return max(16, min(default, _next_pow2(max(extent, 1))))


def _launch_opts(num_warps, num_stages, block_e: int, dtype: torch.dtype) -> dict:
    for name, v in (("num_warps", num_warps), ("num_stages", num_stages)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    return {"num_warps": num_warps or (4 if block_e <= 64 else 8),
            "num_stages": num_stages or _stages(block_e, dtype == torch.float32)}


def _stages(block_e: int, fp32: bool) -> int:
    """Software-pipelining depth: 2, or 1 for fp32 with head dims > 128 (shared memory)."""
    return 1 if fp32 and block_e > 128 else _STAGES


def _strides4(t: torch.Tensor | None) -> tuple[int, int, int, int]:
    return tuple(t.stride()) if t is not None else (0, 0, 0, 0)


def _tensor4(name: str, t) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a Tensor, got {type(t).__name__}")
    if t.dim() != 4:
        raise ValueError(f"{name} must be 4-D, got shape {tuple(t.shape)}")
    return t


def _check_args(q, k, v, attn_mask, is_causal, scale, softcap, normalizer, norm_param, dropout_p, seed):
    """Validate; return ``(B, Hq, Hkv, L, S, E, Ev, mask, mask_kind, scale, softcap, norm_code)``."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        _tensor4(name, t)
    if q.dtype not in _DTYPES:
        raise TypeError(f"q must be float16, bfloat16 or float32, got {q.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError("q, k, v must be on one device")
    B, Hq, L, E = q.shape
    Bk, Hkv, S, Ek = k.shape
    if Bk != B or Ek != E or tuple(v.shape[:3]) != (B, Hkv, S):
        raise ValueError(f"shape mismatch: q (B, Hq, L, E) {tuple(q.shape)}, k (B, Hkv, S, E) {tuple(k.shape)}, "
                         f"v (B, Hkv, S, Ev) {tuple(v.shape)}")
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"the query heads ({Hq}) must be a multiple of the kv heads ({Hkv})")
    Ev = v.shape[3]
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float, got {type(scale).__name__}")
    if softcap is not None:
        if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
            raise TypeError(f"softcap must be a float or None, got {type(softcap).__name__}")
        if not (0 < softcap < float("inf")):
            raise ValueError(f"softcap must be a finite float > 0 or None, got {softcap}")
        softcap = float(softcap)
    if normalizer not in NORMALIZERS:
        raise ValueError(f"normalizer must be one of {sorted(NORMALIZERS)}, got {normalizer!r}")
    if norm_param is not None:
        if not isinstance(norm_param, torch.Tensor) or norm_param.dtype != torch.float32:
            raise TypeError("norm_param must be None or an fp32 tensor")
        if tuple(norm_param.shape) != (B, Hq) or not norm_param.is_contiguous():
            raise ValueError(f"norm_param must be a contiguous ({B}, {Hq}) tensor, got {tuple(norm_param.shape)}")
        if norm_param.device != q.device:
            raise ValueError("norm_param must be on q's device")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be a float in [0, 1), got {dropout_p!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise ValueError(f"seed must be an int in [0, 2**63), got {seed!r}")
    mask, kind = None, _MASK_NONE
    if attn_mask is not None:
        _tensor4("attn_mask", attn_mask)
        if tuple(attn_mask.shape) != (B, Hq, L, S):
            raise ValueError(f"attn_mask must have shape {(B, Hq, L, S)} (expand it), got {tuple(attn_mask.shape)}")
        if attn_mask.device != q.device:
            raise ValueError("attn_mask must be on q's device")
        if attn_mask.dtype == torch.bool:
            mask, kind = attn_mask.view(torch.uint8), _MASK_BOOL  # same strides, no copy
        elif attn_mask.dtype in (torch.float16, torch.bfloat16, torch.float32):
            mask, kind = attn_mask, _MASK_FLOAT
        else:
            raise TypeError(f"attn_mask must be bool or float16/bfloat16/float32, got {attn_mask.dtype}")
    return B, Hq, Hkv, L, S, E, Ev, mask, kind, float(scale), softcap, NORMALIZERS[normalizer]


def _common(q, k, v, mask, kind, is_causal, scale, softcap, code, norm_param, dropout_p, seed, E, Ev, L, S,
            block_m, block_n, num_warps, num_stages, n_keys=None):
    be, bev = max(16, _next_pow2(E)), max(16, _next_pow2(Ev))
    table = _BLOCKS_32 if q.dtype == torch.float32 else _BLOCKS_16
    dm, dn = table[64 if max(be, bev) <= 64 else 128 if max(be, bev) <= 128 else 256]
    bm, bn = _block("block_m", block_m, dm, L), _block("block_n", block_n, dn, S)
    opts = _launch_opts(num_warps, num_stages, max(be, bev), q.dtype)
    interp = _interpreted()
    cs = dict(NORM=code, HAS_PARAM=norm_param is not None, HAS_N=n_keys is not None, MASK_KIND=kind, IS_CAUSAL=is_causal,
              HAS_SOFTCAP=softcap is not None, DROPOUT=dropout_p > 0.0, BLOCK_M=bm, BLOCK_N=bn, BLOCK_E=be,
              BLOCK_EV=bev, PREC=_dot_precision(q.dtype), DOT_F32=q.dtype == torch.bfloat16 and interp)
    mask_t = mask if mask is not None else q
    if n_keys is not None:
        B, Hq = q.shape[0], q.shape[1]
        if tuple(n_keys.shape) != (B, Hq, L) or n_keys.device != q.device:
            raise ValueError(f"n_keys must be a ({B}, {Hq}, {L}) tensor on q's device, got {tuple(n_keys.shape)}")
        n_keys = n_keys.float().contiguous()
    args = dict(mask_t=mask_t, mk=_strides4(mask), par=norm_param if norm_param is not None else q,
                n=n_keys if n_keys is not None else q,
                softcap=1.0 if softcap is None else softcap, dropout_p=float(dropout_p),
                seed=int(seed))
    return cs, opts, args


def attention_forward(q, k, v, attn_mask, is_causal: bool, scale: float, softcap: float | None, normalizer: str,
                      norm_param: torch.Tensor | None, dropout_p: float, seed: int, *,
                      n_keys: torch.Tensor | None = None,
                      skip_threshold: float | None = None, sparse_iters: int | None = None,
                      block_m: int | None = None, block_n: int | None = None,
                      num_warps: int | None = None, num_stages: int | None = None):
    """Attention ``out = normalizer(transform(q k^T)) v`` in one streaming pass over K/V tiles
    (several for sparsemax / entmax15); see the module docstring for the semantics.

    Args:
        q: ``(B, Hq, L, E)``; k: ``(B, Hkv, S, E)``; v: ``(B, Hkv, S, Ev)``: fp16 / bf16 / fp32,
            one dtype, any strides. ``Hq % Hkv == 0``; query head ``h`` reads kv head
            ``h // (Hq // Hkv)``. CUDA, or CPU under ``TRITON_INTERPRET=1``.
        attn_mask: None, or ``(B, Hq, L, S)`` bool (True = may attend) or float (added to the
            scores; -inf = masked), any strides (expanded views are read through their strides).
        is_causal: key ``j`` visible to query ``i`` iff ``j <= i`` (top-left, like torch SDPA).
        scale: multiplies ``q k^T``. softcap: ``softcap * tanh(s / softcap)`` if given (> 0).
        normalizer: one of :data:`NORMALIZERS`.
        norm_param: None or fp32 contiguous ``(B, Hq)``: the normalizer's parameter (ssmax ``p``,
            sigmoid ``b``, relu / softplus ``c``, softpick ``eps``; ignored by the others).
        dropout_p, seed: dropout on the weights (Philox ``tl.rand(seed, offset)``; off at 0).
        skip_threshold: BLASST ``lambda`` in (0, 1) (softmax only; None = exact, the default).
        sparse_iters: bracketing passes for sparsemax / entmax15 (default :data:`SPARSE_ITERS`).
        block_m, block_n, num_warps, num_stages: launch overrides (blocks: powers of two >= 16).

    Returns:
        ``(out, stats)``: ``out`` ``(B, Hq, L, Ev)`` in q's dtype (contiguous); ``stats`` fp32
        ``(B, Hq, L, 2)``, the per-row numbers :func:`attention_backward` needs.
    """
    B, Hq, Hkv, L, S, E, Ev, mask, kind, scale, softcap, code = _check_args(
        q, k, v, attn_mask, is_causal, scale, softcap, normalizer, norm_param, dropout_p, seed)
    if skip_threshold is not None:
        if code != 0:
            raise ValueError("skip_threshold is supported for the softmax normalizer only")
        if isinstance(skip_threshold, bool) or not isinstance(skip_threshold, (int, float)) or \
                not 0.0 < skip_threshold < 1.0:
            raise ValueError(f"skip_threshold must be None or a float in (0, 1), got {skip_threshold!r}")
    n_iter = SPARSE_ITERS if sparse_iters is None else sparse_iters
    if isinstance(n_iter, bool) or not isinstance(n_iter, int) or n_iter < 0:
        raise ValueError(f"sparse_iters must be an int >= 0, got {sparse_iters!r}")
    cs, opts, a = _common(q, k, v, mask, kind, is_causal, scale, softcap, code, norm_param, dropout_p, seed, E, Ev,
                          L, S, block_m, block_n, num_warps, num_stages, n_keys)
    _check_runtime(q)
    out = torch.empty((B, Hq, L, Ev), dtype=q.dtype, device=q.device)
    stats = torch.zeros((B, Hq, L, 2), dtype=torch.float32, device=q.device)
    if B * Hq * L == 0:
        return out, stats
    if S == 0:
        return out.zero_(), stats
    with _on_device(q):
        _fwd_kernel[(B * Hq, _cdiv(L, cs["BLOCK_M"]))](
            q, k, v, a["mask_t"], a["par"], a["n"], out, stats,
            *q.stride(), *k.stride(), *v.stride(), *a["mk"], *out.stride(),
            Hq, Hq // Hkv, L, S, E, Ev, scale, a["softcap"], a["seed"], a["dropout_p"],
            math.log(skip_threshold) if skip_threshold is not None else 0.0, n_iter,
            SKIP=skip_threshold is not None, FIX_BF16=_interpreted(), **cs, **opts,
        )
    return out, stats


def attention_backward(grad_out, q, k, v, out, stats, attn_mask, is_causal, scale, softcap, normalizer, norm_param,
                       dropout_p, seed, *, n_keys: torch.Tensor | None = None,
                       block_m: int | None = None, block_n: int | None = None,
                       num_warps: int | None = None, num_stages: int | None = None):
    """Gradients of :func:`attention_forward` (same arguments; ``out``, ``stats`` from it),
    recomputing the score tiles.

    Returns:
        ``(dq, dk, dv, dnorm_param)``: ``dq`` like q, ``dk`` / ``dv`` ``(B, Hkv, S, *)`` summed
        over the query heads of each group (dtypes of k / v), ``dnorm_param`` fp32 ``(B, Hq)``
        when ``norm_param`` is given (zeros for normalizers without a parameter), else None.
    """
    B, Hq, Hkv, L, S, E, Ev, mask, kind, scale, softcap, code = _check_args(
        q, k, v, attn_mask, is_causal, scale, softcap, normalizer, norm_param, dropout_p, seed)
    for name, t, shape in (("grad_out", grad_out, (B, Hq, L, Ev)), ("out", out, (B, Hq, L, Ev)),
                           ("stats", stats, (B, Hq, L, 2))):
        _tensor4(name, t)
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
        if t.device != q.device:
            raise ValueError(f"{name} must be on q's device")
    if stats.dtype != torch.float32 or not stats.is_contiguous():
        raise TypeError("stats must be the contiguous fp32 tensor attention_forward returned")
    cs, opts, a = _common(q, k, v, mask, kind, is_causal, scale, softcap, code, norm_param, dropout_p, seed, E, Ev,
                          L, S, block_m, block_n, num_warps, num_stages, n_keys)
    _check_runtime(q)
    dev = q.device
    f32 = dict(dtype=torch.float32, device=dev)
    dq = torch.zeros((B, Hq, L, E), **f32)
    dk = torch.zeros((B, Hkv, S, E), dtype=k.dtype, device=dev)
    dv = torch.zeros((B, Hkv, S, Ev), dtype=v.dtype, device=dev)
    dpar = torch.zeros((B, Hq), **f32) if norm_param is not None else None
    if B * Hq * L * S == 0:
        return dq.to(q.dtype), dk, dv, dpar
    if grad_out.dtype != v.dtype:
        grad_out = grad_out.to(v.dtype)  # tl.dot operands share a dtype
    delta = torch.zeros((B, Hq, L), **f32)
    G = Hq // Hkv
    dpar_t = dpar if dpar is not None else delta
    bm, bn = cs["BLOCK_M"], cs["BLOCK_N"]
    with _on_device(q):
        if code in _SOFTMAX_LIKE or code >= 7:
            _bwd_pre_kernel[(B * Hq, _cdiv(L, bm))](
                q, k, v, a["mask_t"], a["par"], out, grad_out, stats, delta, dpar_t,
                *q.stride(), *k.stride(), *v.stride(), *a["mk"], *out.stride(), *grad_out.stride(),
                Hq, G, L, S, E, Ev, scale, a["softcap"], a["seed"], a["dropout_p"], **cs, **opts,
            )
        _bwd_kernel[(B * Hkv, _cdiv(S, bn))](
            q, k, v, a["mask_t"], a["par"], a["n"], grad_out, stats, delta, dq, dk, dv, dpar_t,
            *q.stride(), *k.stride(), *v.stride(), *a["mk"], *grad_out.stride(),
            Hq, Hkv, G, L, S, E, Ev, scale, a["softcap"], a["seed"], a["dropout_p"],
            FIX_BF16=_interpreted(), **cs, **opts,
        )
    return dq.to(q.dtype), dk, dv, dpar


def dropout_keep_mask(B: int, H: int, L: int, S: int, dropout_p: float, seed: int, device="cpu") -> torch.Tensor:
    """The dropout keep-mask (bool ``(B, H, L, S)``) that the attention kernels draw for these
    arguments (same Philox offsets); a debugging / testing helper."""
    if triton is None or not (torch.device(device).type == "cuda" or _interpret_env()):
        _check_runtime(torch.empty(0, device=device))
    out = torch.zeros((B, H, L, S), dtype=torch.uint8, device=device)
    if B * H * L * S:
        with _on_device(out):
            _keep_kernel[(B * H, _cdiv(L, 16))](out, L, S, int(seed), float(dropout_p), BLOCK_M=16, BLOCK_N=64)
    return out.bool()
