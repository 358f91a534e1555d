"""Flash-style attention, forward and backward, in Triton, with a compile-time normalizer: what the kernels
share.

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
skip-softmax sparse attention): an approximation; the backward then uses
the approximate saved normalizer.

All pointer offsets are int64 (``B*H*L*S`` may exceed ``2**31`` for the mask). Block sizes
are constexpr powers of two ``>= 16`` (``tl.dot``); ``L``, ``S``, ``E`` and ``Ev`` are masked,
so ``E`` need not be a power of two. Products run on the tensor cores with fp32 accumulation
(fp32 inputs: ``torch.get_float32_matmul_precision()``); the weights / score gradients enter
the second matmuls rounded to the input dtype (as in FlashAttention).

On a machine without a GPU the kernels run through Triton's interpreter when
``TRITON_INTERPRET=1`` was set before triton was imported (CPU tensors); ``DOT_F32`` and
``FIX_BF16`` are the interpreter-only bf16 workarounds of :mod:`smxcompile.kernels.triton_helpers`.

Modules: :mod:`.triton_common` (this description, the score-tile helpers shared by the kernels, argument
checks and launch configuration), :mod:`.triton_forward` (the forward kernel and the dropout keep-mask),
:mod:`.triton_backward` (the backward kernels).
"""

from __future__ import annotations

import torch

from ..triton_helpers import (dot_f32, dot_precision, launch_opts, next_pow2, pow2_block, tl,
                              triton)  # triton, tl: None without it

__all__ = ["NORM_CODES", "SPARSE_ITERS", "BLOCKS_16", "BLOCKS_32", "PRE_BLOCKS_16", "PRE_BLOCKS_32", "BWD_BLOCKS_16",
           "BWD_BLOCKS_32", "check_args", "launch_config", "tensor4", "stages"]

#: Normalizer name -> the kernels' NORM constexpr.
NORM_CODES = {"softmax": 0, "softmax1": 1, "ssmax": 2, "sigmoid": 3, "relu": 4, "softpick": 5, "softplus": 6,
              "sparsemax": 7, "entmax15": 8}
#: Bracketing passes on tau for sparsemax / entmax15 (each halves the bracket at least).
SPARSE_ITERS = 10

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MASK_NONE, _MASK_BOOL, _MASK_FLOAT = 0, 1, 2


# --------------------------------------------------------------------------------------
# Triton helpers of the kernels: scores of a tile, normalizer parameters, dropout
# --------------------------------------------------------------------------------------

if triton is not None:
    from ..triton_helpers import dot, tanh

    @triton.jit
    def sigmoid_pair(x):
        """``(sigmoid(x), sigmoid(-x))`` without overflow or cancellation."""
        e = tl.exp(-tl.abs(x))
        r = 1.0 / (1.0 + e)
        pos = x >= 0.0
        return tl.where(pos, r, e * r), tl.where(pos, e * r, r)

    @triton.jit
    def softplus(x):
        """``log(1 + e^x)`` = ``max(x, 0) + log1p(e^{-|x|})`` with an accurate log1p (Goldberg)."""
        e = tl.exp(-tl.abs(x))
        u = 1.0 + e
        l1p = tl.where(u == 1.0, e, tl.log(u) * (e / (u - 1.0)))
        return tl.maximum(x, 0.0) + l1p

    @triton.jit
    def keep_mask(seed, bh, L, S, rows, cols, dropout_p):
        """Dropout keep-mask of a [rows, cols] tile: Philox ``tl.rand(seed, ((bh*L + i)*S + j))
        >= p`` (int64 offsets; forward, backward and :func:`dropout_keep_mask` share it)."""
        off = (bh * L + rows)[:, None] * S + cols[None, :]
        return tl.rand(seed, off) >= dropout_p

    @triton.jit
    def row_coef(rows, row_ok, S, param, n_ptr, n_base, NORM: tl.constexpr, HAS_PARAM: tl.constexpr,
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
    def scores(q, kt, rows, row_ok, cols, col_ok, mask_ptr, mk_base, mk_sl, mk_ss, scale, softcap,
               MASK_KIND: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr, DOT_F32: tl.constexpr):
        """Scores of a [BLOCK_M, BLOCK_N] tile (``kt``: [BLOCK_E, BLOCK_N]) in fp32.

        Returns ``(s, sc, vis)``: ``s`` (mask added), ``sc`` (the soft-capped score before the
        mask, for the tanh derivative) and the visibility."""
        s = dot(q, kt, tl.zeros([BLOCK_M, BLOCK_N], tl.float32), PREC, DOT_F32) * scale
        if HAS_SOFTCAP:
            s = softcap * tanh(s / softcap)
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
    def scores_at(start, q, k_ptr, k_base, k_ss, k_se, offs_e, e_ok, rows, row_ok, S,
                  mask_ptr, mk_base, mk_sl, mk_ss, scale, softcap,
                  MASK_KIND: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr, DOT_F32: tl.constexpr):
        """Load the K tile at key ``start`` and score it: ``(s, sc, vis, cols, col_ok)``."""
        cols = start + tl.arange(0, BLOCK_N).to(tl.int64)
        col_ok = cols < S
        kt = tl.load(k_ptr + (k_base + cols[None, :] * k_ss + offs_e[:, None] * k_se),
                     mask=e_ok[:, None] & col_ok[None, :], other=0.0)
        s, sc, vis = scores(q, kt, rows, row_ok, cols, col_ok, mask_ptr, mk_base, mk_sl, mk_ss, scale, softcap,
                            MASK_KIND, IS_CAUSAL, HAS_SOFTCAP, BLOCK_M, BLOCK_N, PREC, DOT_F32)
        return s, sc, vis, cols, col_ok

    @triton.jit
    def sparse_sums(t, mxs, hi, q, k_ptr, k_base, k_ss, k_se, offs_e, e_ok, rows, row_ok, S,
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
            s, sc, vis, cols, col_ok = scores_at(start, q, k_ptr, k_base, k_ss, k_se, offs_e, e_ok, rows, row_ok,
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
    def closed_tau(cnt, s1, s2, NORM: tl.constexpr):
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


# --------------------------------------------------------------------------------------
# Launch helpers
# --------------------------------------------------------------------------------------

# Default blocks (BLOCK_M, BLOCK_N) by the padded head dim (max of E, Ev), for 16-bit and fp32
# inputs, per kernel: BLOCKS_* for the forward (K and V are read once per BLOCK_M query rows),
# PRE_BLOCKS_* for the backward's row pre-pass (query blocks too; only the sparse normalizers
# sweep K / V there), BWD_BLOCKS_* for the backward's key-block kernel (Q, dO and the dQ atomics
# once per BLOCK_N keys). 8 warps, 4 for fp32 with head dims <= 64. Not tuned on a GPU yet;
# sized by compiling for sm_90a and sm_80 (every normalizer; causal, masked, dropout variants;
# also as Triton specializes a launch on contiguous tensors, which pipelines more and takes more
# shared memory) to use <= 96 KiB of shared memory in every kernel, so they also fit sm_86 /
# sm_89 -- except fp32 with head dims > 128, whose backward needs up to 160 KiB (sm_80 / sm_90
# only) -- and, for the 16-bit head dims 64 / 128, to spill no registers in ptxas on contiguous
# inputs (255 per thread at 8 warps). Larger 16-bit tiles spill or overflow: the forward's
# (128, 64) spills (head dim 128: 112 KiB); the pre-pass at (128, 32), head dim 128, takes up to
# 104 KiB; the backward spills with BLOCK_M >= 32 at BLOCK_N = 64 (head dim 128) or 128 (head
# dim 64), and with BLOCK_N = 128 at head dim 128 (112 KiB). The 16-bit backward at head dim 256
# still spills (up to ~200 bytes; (32, 32) spilled up to 6.5 KB and took 112 KiB on sm_80). fp32
# spills at every size; its backward at head dim 128 takes 16 keys per program because (16, 32)
# and (32, 32) take 112 / 128 KiB with tf32x3 products (``torch.set_float32_matmul_precision("high")``).
BLOCKS_16 = {64: (128, 32), 128: (128, 32), 256: (32, 32)}
BLOCKS_32 = {64: (32, 32), 128: (32, 32), 256: (16, 16)}
PRE_BLOCKS_16 = {64: (128, 32), 128: (128, 16), 256: (32, 32)}
PRE_BLOCKS_32 = BLOCKS_32
BWD_BLOCKS_16 = {64: (16, 128), 128: (16, 64), 256: (16, 32)}
BWD_BLOCKS_32 = {64: (32, 32), 128: (16, 16), 256: (16, 16)}
_TABLES = {"forward": (BLOCKS_16, BLOCKS_32), "pre": (PRE_BLOCKS_16, PRE_BLOCKS_32),
           "backward": (BWD_BLOCKS_16, BWD_BLOCKS_32)}
STAGES = 2


def stages(block_e: int, fp32: bool) -> int:
    """Software-pipelining depth: 2, or 1 for fp32 with head dims > 128 (shared memory)."""
    return 1 if fp32 and block_e > 128 else STAGES


def _strides4(t: torch.Tensor | None) -> tuple[int, int, int, int]:
    return tuple(t.stride()) if t is not None else (0, 0, 0, 0)


def tensor4(name: str, t) -> torch.Tensor:
    """``t``, checked to be a 4-D tensor (``name`` in the messages).

    Raises:
        TypeError: not a tensor. ValueError: not 4-D.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a Tensor, got {type(t).__name__}")
    if t.dim() != 4:
        raise ValueError(f"{name} must be 4-D, got shape {tuple(t.shape)}")
    return t


def check_args(q, k, v, attn_mask, is_causal, scale, softcap, normalizer, norm_param, dropout_p, seed):
    """Validate the launchers' common arguments (see :func:`.triton_forward.attention_forward`); return
    ``(B, Hq, Hkv, L, S, E, Ev, mask, mask_kind, scale, softcap, norm_code)`` (a bool mask viewed as uint8).

    Raises:
        TypeError: non-tensors, q not fp16 / bf16 / fp32, mixed dtypes, non-bool ``is_causal``, a non-float
            ``scale`` / ``softcap``, a non-fp32 ``norm_param``, a mask of another dtype.
        ValueError: shapes or devices that disagree, heads not a multiple, ``softcap <= 0``, an unknown
            normalizer, ``dropout_p`` outside [0, 1), a ``seed`` outside [0, 2**63).
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        tensor4(name, t)
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
    if normalizer not in NORM_CODES:
        raise ValueError(f"normalizer must be one of {sorted(NORM_CODES)}, got {normalizer!r}")
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
        tensor4("attn_mask", attn_mask)
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
    return B, Hq, Hkv, L, S, E, Ev, mask, kind, float(scale), softcap, NORM_CODES[normalizer]


def launch_config(q, k, v, mask, kind, is_causal, scale, softcap, code, norm_param, dropout_p, seed, E, Ev, L, S,
                  block_m, block_n, num_warps, num_stages, n_keys=None, kernel="forward"):
    """The launch of one call, from :func:`check_args`' results: ``(constexprs, launch options, arguments)``
    (blocks by the padded head dim unless overridden, from the ``kernel``'s table: "forward"
    :data:`BLOCKS_16` / :data:`BLOCKS_32`, "pre" :data:`PRE_BLOCKS_16` / ..., "backward"
    :data:`BWD_BLOCKS_16` / ...; warps, stages; the mask / parameter / key-count tensors or q as a placeholder).

    Raises:
        ValueError: a bad block size, ``num_warps`` / ``num_stages``, or ``n_keys`` not (B, Hq, L) on q's device.
    """
    be, bev = max(16, next_pow2(E)), max(16, next_pow2(Ev))
    fp32 = q.dtype == torch.float32
    table = _TABLES[kernel][1 if fp32 else 0]
    dm, dn = table[64 if max(be, bev) <= 64 else 128 if max(be, bev) <= 128 else 256]
    bm, bn = pow2_block("block_m", block_m, dm, L, 16), pow2_block("block_n", block_n, dn, S, 16)
    e_pad = max(be, bev)
    opts = launch_opts(num_warps, num_stages, 4 if fp32 and e_pad <= 64 else 8, stages(e_pad, fp32))
    cs = dict(NORM=code, HAS_PARAM=norm_param is not None, HAS_N=n_keys is not None, MASK_KIND=kind, IS_CAUSAL=is_causal,
              HAS_SOFTCAP=softcap is not None, DROPOUT=dropout_p > 0.0, BLOCK_M=bm, BLOCK_N=bn, BLOCK_E=be,
              BLOCK_EV=bev, PREC=dot_precision(q.dtype), DOT_F32=dot_f32(q.dtype))
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
