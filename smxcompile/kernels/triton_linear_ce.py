"""Fused linear + cross-entropy statistics, forward and backward, in Triton.

The logits ``x = input @ weight.T + bias`` (``N x V``) are computed tile by tile and
reduced on chip; the ``N x V`` matrix never reaches global memory (unless asked for).
Per row ``i`` (classes ``j``), in fp32::

    z_ij = scale * x_ij
    z_ij = softcap * tanh(z_ij / softcap)                  # if softcap is not None
    lse_i          = log sum_j exp(z_ij)
    target_logit_i = z_{i, y_i}
    other_mass_i   = sum_{j != y_i} exp(z_ij - lse_i)        # = 1 - p_target, collapse-safe
    weighted_sum_i = sum_j w_j z_ij                          # optional (label smoothing)

and the backward takes per-row coefficients ``a, b, c`` and forms, tile by tile,

    G_ij = a_i p_ij - b_i [j == y_i] - c_i w_j                (p_ij = exp(z_ij - lse_i))
    G_{i,y_i} = -a_i other_mass_i + (a_i - b_i) - c_i w_{y_i}  (the target entry, collapse-safe)
    Gx = G * dz/dx,  dz/dx = scale * (1 - (z / softcap)^2)  (or scale)

then ``grad_input = Gx @ weight``, ``grad_weight = Gx.T @ input``, ``grad_bias = Gx.sum(0)``
(accumulated in fp32 with atomics). ``G`` is the gradient of
``sum_i a_i lse_i - b_i z_{i,y_i} - c_i weighted_sum_i``; cross-entropy is
``a = b = grad_loss_i``, ``c = 0`` (label smoothing ``eps`` adds ``c = eps / V``-style terms).

Methods:

* "Cut Your Losses in Large-Vocabulary Language Models" (Wijmans, Huval, Hertzberg,
  Koltun, Kr\u00e4henb\u00fchl, 2024): the blockwise matmul whose logit tiles are reduced in
  on-chip memory, the target logit taken from the same tiles, the recomputing backward
  with atomically accumulated weight/input gradients, and optional gradient filtering
  (``filter_eps``: skip tiles whose gradient is negligible; off by default = exact).
* "Online normalizer calculation for softmax" (Milakov & Gimelshein, 2018): the running
  ``(m, d)`` pair across vocabulary blocks. The vocabulary is also split across programs
  (for GPU occupancy when ``N`` is small); the partial ``(m, d)`` states are merged with
  ``m = max(m_s)``, ``d = sum_s d_s exp(m_s - m)`` in a tiny torch reduction afterwards.
  There is no limit on ``V``.
* Softmax collapse (see ``ALGORITHMS.md`` 1.4): when the target dominates, ``1 - p_y``
  rounds to 0 while the other probabilities do not; ``other_mass`` is therefore summed
  over the other classes (``sum_{j != y} exp(z_j - m)``, rescaled like ``d``), and the
  backward uses it for the target entry, so gradients still sum to ~0 per row.

``ce_forward`` / ``ce_backward`` are the same kernels with the logits given as an
``(N, V)`` tensor (any 2-D strides) instead of a matmul.

All pointer offsets are int64 (``N*V``, ``N*D`` and ``V*D`` may exceed ``2**31``).
Special values follow torch: a row with NaN gets NaN ``lse``; a row of all ``-inf`` gets
``lse = -inf``; a ``+inf`` logit gives ``lse = +inf``.

fp32 inputs: ``tl.dot``'s precision follows ``torch.get_float32_matmul_precision()``:
``"highest"`` (torch's default) -> IEEE fp32 FMA (exact fp32, slow), ``"high"`` ->
``tf32x3`` (about fp32 accuracy on tensor cores), ``"medium"`` -> ``tf32``. fp16 / bf16
inputs use the tensor cores with fp32 accumulation.

On a machine without a GPU the kernels run through Triton's interpreter when
``TRITON_INTERPRET=1`` was set before triton was imported; they then accept CPU tensors.
Two interpreter-only constexprs (both False on a GPU) make it compute what the GPU does:
``DOT_F32`` upcasts bf16 ``tl.dot`` operands (the interpreter multiplies their uint16 bit
patterns) and ``FIX_BF16`` rounds fp32 -> bf16 casts to nearest even (it truncates).
"""

from __future__ import annotations

import contextlib
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

__all__ = ["lce_forward", "lce_backward", "ce_forward", "ce_backward"]

# Default block sizes (BLOCK_N, BLOCK_V, BLOCK_D), num_warps, num_stages. Not tuned on a GPU
# yet; sized (compiled for sm_90) to use <= 96 KiB of shared memory in every variant, so
# they also fit sm_80 / sm_86 / sm_89. The fp32 backward keeps two [BLOCK_N, BLOCK_V] fp32
# operands in shared memory (three with tf32x3), hence its smaller tile.
_FWD_BLOCKS_16 = (128, 128, 64)
_FWD_BLOCKS_32 = (128, 128, 32)
_FWD_WARPS, _FWD_STAGES = 8, 3
_BWD_BLOCKS_16 = (128, 128, 32)
_BWD_BLOCKS_32 = (64, 64, 32)
_BWD_WARPS, _BWD_STAGES = 8, 2
# Logits-given paths (no tl.dot: any block sizes).
_CE_BLOCKS = (8, 1024)
_CE_WARPS = 8
#: Backward program order: groups of this many row blocks sweep the vocabulary together.
_GROUP_N = 8

_MATMUL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_INDEX_DTYPES = (torch.int64, torch.int32)

# Where the backward kernel gets z from.
_Z_MATMUL, _Z_RAW, _Z_SAVED = 0, 1, 2


# --------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _tanh(u):
        """fp32 tanh without libdevice (which the interpreter lacks), ~2 ulp: a Taylor
        polynomial near 0, ``(1 - e) / (1 + e)`` with ``e = exp(-2|u|)`` elsewhere."""
        a = tl.abs(u)
        e = tl.exp(-2.0 * a)
        big = (1.0 - e) / (1.0 + e)
        a2 = a * a
        p = -1382.0 / 155925.0
        p = p * a2 + 62.0 / 2835.0
        p = p * a2 - 17.0 / 315.0
        p = p * a2 + 2.0 / 15.0
        p = p * a2 - 1.0 / 3.0
        small = a + a * a2 * p
        t = tl.where(a < 0.25, small, big)
        return tl.where(u < 0.0, -t, t)

    @triton.jit
    def _safe_max(m):
        """The exp() offset: ``m`` when finite, else 0 (so all -inf / +inf rows give -inf / +inf)."""
        return tl.where(tl.abs(m) == float("inf"), 0.0, m)

    @triton.jit
    def _to(x, ptr, FIX_BF16: tl.constexpr):
        """fp32 ``x`` cast to ``ptr``'s element type, rounding to nearest even. FIX_BF16 (the
        interpreter only, whose fp32 -> bf16 cast truncates) rounds the bits by hand first."""
        ty = ptr.dtype.element_ty
        if FIX_BF16:
            if ty == tl.bfloat16:
                bits = x.to(tl.uint32, bitcast=True)
                bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
                x = bits.to(tl.float32, bitcast=True)
        return x.to(ty)

    @triton.jit
    def _dot(a, b, acc, PREC: tl.constexpr, DOT_F32: tl.constexpr):
        """``acc + a @ b`` with fp32 accumulation. DOT_F32 (interpreter only: its tl.dot
        multiplies bf16 bit patterns as integers) upcasts the operands first, which is exact
        for bf16 products with an fp32 sum, i.e. what the tensor cores compute."""
        if DOT_F32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        return tl.dot(a, b, acc, input_precision=PREC)

    @triton.jit
    def _x_tile(src_ptr, src_s0, src_s1, w_ptr, w_s0, w_s1, bias_ptr, rows, cols, row_ok, col_ok, D,
                FROM_MATMUL: tl.constexpr, HAS_BIAS: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, PREC: tl.constexpr,
                DOT_F32: tl.constexpr):
        """Raw logits ``x`` of a [BLOCK_N, BLOCK_V] tile in fp32 (0 outside the problem).

        FROM_MATMUL: ``input[rows] @ weight[cols].T (+ bias)``, ``src`` being the input (N, D);
        else ``src`` is the (N, V) logits tensor. ``rows``/``cols`` are int64."""
        if FROM_MATMUL:
            acc = tl.zeros([BLOCK_N, BLOCK_V], tl.float32)
            for k in range(0, D, BLOCK_D):
                ks = k + tl.arange(0, BLOCK_D).to(tl.int64)
                k_ok = ks < D
                e = tl.load(src_ptr + (rows[:, None] * src_s0 + ks[None, :] * src_s1),
                            mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                w = tl.load(w_ptr + (cols[:, None] * w_s0 + ks[None, :] * w_s1),
                            mask=col_ok[:, None] & k_ok[None, :], other=0.0)
                acc = _dot(e, tl.trans(w), acc, PREC, DOT_F32)
            if HAS_BIAS:
                bv = tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
                acc = acc + bv[None, :]
        else:
            acc = tl.load(src_ptr + (rows[:, None] * src_s0 + cols[None, :] * src_s1),
                          mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
        return acc

    @triton.jit
    def _transform(x, scale, softcap, HAS_SOFTCAP: tl.constexpr):
        z = x * scale
        if HAS_SOFTCAP:
            z = softcap * _tanh(z / softcap)
        return z

    @triton.jit
    def _fwd_kernel(
        src_ptr, src_s0, src_s1, w_ptr, w_s0, w_s1, bias_ptr,
        tgt_ptr, tgt_s, cw_ptr, cw_s,
        out_ptr, out_s0, out_s1, part_ptr,
        N, V, D, v_per_split, scale, softcap,
        FROM_MATMUL: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_CW: tl.constexpr,
        NEED_WS: tl.constexpr, WRITE_LOGITS: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, PREC: tl.constexpr,
        DOT_F32: tl.constexpr, FIX_BF16: tl.constexpr,
    ):
        """One program: BLOCK_N rows x the vocabulary slice [pid_s * v_per_split, +v_per_split).

        Writes partial states to ``part`` (fp32, [4 or 5, S, N]): running max ``m``, ``d`` and
        ``d_other`` (relative to ``_safe_max(m)``), the target logit if it lies in the slice
        (else 0), and the slice's ``sum_j w_j z_ij``."""
        pid_n = tl.program_id(0)
        pid_s = tl.program_id(1)
        n_split = tl.num_programs(1)
        rows = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
        row_ok = rows < N
        y = tl.load(tgt_ptr + rows * tgt_s, mask=row_ok, other=-1).to(tl.int64)
        m = tl.full([BLOCK_N], float("-inf"), tl.float32)
        d = tl.zeros([BLOCK_N], tl.float32)
        d_other = tl.zeros([BLOCK_N], tl.float32)
        t = tl.zeros([BLOCK_N], tl.float32)
        ws = tl.zeros([BLOCK_N], tl.float32)
        v_begin = pid_s.to(tl.int64) * v_per_split
        v_end = tl.minimum(v_begin + v_per_split, V)
        for start in range(v_begin, v_end, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V).to(tl.int64)
            col_ok = cols < V
            x = _x_tile(src_ptr, src_s0, src_s1, w_ptr, w_s0, w_s1, bias_ptr, rows, cols, row_ok, col_ok, D,
                        FROM_MATMUL, HAS_BIAS, BLOCK_N, BLOCK_V, BLOCK_D, PREC, DOT_F32)
            z = _transform(x, scale, softcap, HAS_SOFTCAP)
            if WRITE_LOGITS:
                tl.store(out_ptr + (rows[:, None] * out_s0 + cols[None, :] * out_s1),
                         _to(z, out_ptr, FIX_BF16), mask=row_ok[:, None] & col_ok[None, :])
            zm = tl.where(col_ok[None, :], z, float("-inf"))
            m_new = tl.maximum(m, tl.max(zm, axis=1))
            ms_new = _safe_max(m_new)
            # min(., 0) guards -inf - (-inf) (an all -inf prefix, d == 0) and +inf (d is +inf anyway).
            alpha = tl.exp(tl.minimum(_safe_max(m) - ms_new, 0.0))
            e = tl.exp(zm - ms_new[:, None])
            is_t = (cols[None, :] == y[:, None]) & col_ok[None, :]
            d = d * alpha + tl.sum(e, axis=1)
            d_other = d_other * alpha + tl.sum(tl.where(is_t, 0.0, e), axis=1)
            t += tl.sum(tl.where(is_t, z, 0.0), axis=1)
            if NEED_WS:
                if HAS_CW:
                    wv = tl.load(cw_ptr + cols * cw_s, mask=col_ok, other=0.0).to(tl.float32)
                    ws += tl.sum(tl.where(col_ok[None, :], wv[None, :] * z, 0.0), axis=1)
                else:
                    ws += tl.sum(tl.where(col_ok[None, :], z, 0.0), axis=1)
            m = m_new
        plane = n_split.to(tl.int64) * N
        base = part_ptr + pid_s.to(tl.int64) * N + rows
        tl.store(base, m, mask=row_ok)
        tl.store(base + plane, d, mask=row_ok)
        tl.store(base + 2 * plane, d_other, mask=row_ok)
        tl.store(base + 3 * plane, t, mask=row_ok)
        if NEED_WS:
            tl.store(base + 4 * plane, ws, mask=row_ok)

    @triton.jit
    def _bwd_kernel(
        src_ptr, src_s0, src_s1,            # (N, V) raw logits (Z_FROM=1) or saved z (Z_FROM=2)
        e_ptr, e_s0, e_s1, w_ptr, w_s0, w_s1, bias_ptr,
        tgt_ptr, tgt_s, cw_ptr, cw_s,
        lse_ptr, lse_s, om_ptr, om_s, a_ptr, a_s, b_ptr, b_s, c_ptr, c_s,
        gl_ptr, gl_s0, gl_s1,
        gi_ptr, gw_ptr, gb_ptr, gx_ptr,     # fp32 (N, D), (V, D), (V,) accumulators; (N, V) output
        N, V, D, ignore_index, scale, softcap, filter_eps,
        Z_FROM: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_CW: tl.constexpr,
        HAS_C: tl.constexpr, HAS_GL: tl.constexpr, FILTER: tl.constexpr,
        NEED_GI: tl.constexpr, NEED_GW: tl.constexpr, NEED_GB: tl.constexpr, WRITE_GX: tl.constexpr,
        GROUP_N: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
        PREC: tl.constexpr, DOT_F32: tl.constexpr, FIX_BF16: tl.constexpr,
    ):
        """One program: one [BLOCK_N, BLOCK_V] tile of G (see the module docstring)."""
        pid = tl.program_id(0)
        nb_n = tl.cdiv(N, BLOCK_N)
        nb_v = tl.cdiv(V, BLOCK_V)
        # Grouped order: GROUP_N row blocks sweep the vocabulary together (L2 reuse of weight
        # tiles, and atomics on grad_input / grad_weight spread over several addresses).
        per_group = GROUP_N * nb_v
        first_n = (pid // per_group) * GROUP_N
        group_size = tl.minimum(nb_n - first_n, GROUP_N)
        pid_n = first_n + (pid % per_group) % group_size
        pid_v = (pid % per_group) // group_size
        rows = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
        cols = pid_v.to(tl.int64) * BLOCK_V + tl.arange(0, BLOCK_V).to(tl.int64)
        row_ok = rows < N
        col_ok = cols < V
        ok = row_ok[:, None] & col_ok[None, :]

        y = tl.load(tgt_ptr + rows * tgt_s, mask=row_ok, other=-1).to(tl.int64)
        lse = tl.load(lse_ptr + rows * lse_s, mask=row_ok, other=0.0).to(tl.float32)
        om = tl.load(om_ptr + rows * om_s, mask=row_ok, other=0.0).to(tl.float32)
        a = tl.load(a_ptr + rows * a_s, mask=row_ok, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + rows * b_s, mask=row_ok, other=0.0).to(tl.float32)

        if Z_FROM == 0:
            x = _x_tile(e_ptr, e_s0, e_s1, w_ptr, w_s0, w_s1, bias_ptr, rows, cols, row_ok, col_ok, D,
                        True, HAS_BIAS, BLOCK_N, BLOCK_V, BLOCK_D, PREC, DOT_F32)
            z = _transform(x, scale, softcap, HAS_SOFTCAP)
        elif Z_FROM == 1:
            x = _x_tile(src_ptr, src_s0, src_s1, w_ptr, w_s0, w_s1, bias_ptr, rows, cols, row_ok, col_ok, D,
                        False, False, BLOCK_N, BLOCK_V, BLOCK_D, PREC, DOT_F32)
            z = _transform(x, scale, softcap, HAS_SOFTCAP)
        else:
            z = tl.load(src_ptr + (rows[:, None] * src_s0 + cols[None, :] * src_s1), mask=ok,
                        other=0.0).to(tl.float32)

        p = tl.exp(z - lse[:, None])
        g = a[:, None] * p
        # the target entry (never for ignored rows): -a * other_mass + (a - b)
        is_t = (cols[None, :] == y[:, None]) & (y != ignore_index)[:, None] & col_ok[None, :]
        g = tl.where(is_t, ((a - b) - a * om)[:, None], g)
        if HAS_C:
            c = tl.load(c_ptr + rows * c_s, mask=row_ok, other=0.0).to(tl.float32)
            if HAS_CW:
                wv = tl.load(cw_ptr + cols * cw_s, mask=col_ok, other=0.0).to(tl.float32)
                g = g - c[:, None] * wv[None, :]
            else:
                g = g - c[:, None]
        if HAS_GL:
            g += tl.load(gl_ptr + (rows[:, None] * gl_s0 + cols[None, :] * gl_s1), mask=ok,
                         other=0.0).to(tl.float32)
        g = tl.where(ok, g, 0.0)
        if HAS_SOFTCAP:
            u = z / softcap
            gx = g * (scale * (1.0 - u * u))
        else:
            gx = g * scale
        gx = tl.where(ok, gx, 0.0)

        if WRITE_GX:
            # ce_backward: the gradient w.r.t. the raw logits, written once in the output dtype
            tl.store(gx_ptr + (rows[:, None] * V + cols[None, :]), _to(gx, gx_ptr, FIX_BF16), mask=ok)
        else:
            keep = True
            if FILTER:
                # Gradient filtering (Wijmans et al., 2024): skip a tile whose |G| is all below
                # filter_eps and that holds no target entry. NaN counts as large.
                n_big = tl.sum(tl.sum(tl.where(tl.abs(g) < filter_eps, 0, 1), axis=1), axis=0)
                n_t = tl.sum(tl.sum(is_t.to(tl.int32), axis=1), axis=0)
                keep = (n_big + n_t) > 0
            if keep:
                if NEED_GB:
                    tl.atomic_add(gb_ptr + cols, tl.sum(gx, axis=0), mask=col_ok, sem="relaxed")
                if NEED_GI or NEED_GW:
                    gxc = _to(gx, e_ptr, FIX_BF16)
                    for k in range(0, D, BLOCK_D):
                        ks = k + tl.arange(0, BLOCK_D).to(tl.int64)
                        k_ok = ks < D
                        if NEED_GI:
                            w = tl.load(w_ptr + (cols[:, None] * w_s0 + ks[None, :] * w_s1),
                                        mask=col_ok[:, None] & k_ok[None, :], other=0.0)
                            gi = _dot(gxc, w, None, PREC, DOT_F32)
                            tl.atomic_add(gi_ptr + (rows[:, None] * D + ks[None, :]), gi,
                                          mask=row_ok[:, None] & k_ok[None, :], sem="relaxed")
                        if NEED_GW:
                            e = tl.load(e_ptr + (rows[:, None] * e_s0 + ks[None, :] * e_s1),
                                        mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                            gw = _dot(tl.trans(gxc), e, None, PREC, DOT_F32)
                            tl.atomic_add(gw_ptr + (cols[:, None] * D + ks[None, :]), gw,
                                          mask=col_ok[:, None] & k_ok[None, :], sem="relaxed")


# --------------------------------------------------------------------------------------
# Launch helpers
# --------------------------------------------------------------------------------------

_INTERPRET_AT_IMPORT = os.environ.get("TRITON_INTERPRET") == "1"


def _interpret_env() -> bool:
    return triton_runtime.interpret_env()


def _interpreted() -> bool:
    """Whether the kernels were decorated in interpreter mode (TRITON_INTERPRET=1 at import)."""
    if triton is None:
        return _INTERPRET_AT_IMPORT   # no kernels were defined
    return triton_runtime.interpreted(_fwd_kernel, _INTERPRET_AT_IMPORT)


def _check_runtime(t: torch.Tensor) -> None:
    triton_runtime.check_runtime(t, what="linear-cross-entropy", module=__name__, triton_module=triton,
                                 import_error=_TRITON_IMPORT_ERROR, is_interpreted=_interpreted)


def _on_device(t: torch.Tensor):
    """Launch on t's GPU (Triton launches on the current device)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


_SM_COUNT: dict = {}


def _sm_count(device: torch.device) -> int:
    key = device.index if device.index is not None else torch.cuda.current_device()
    if key not in _SM_COUNT:
        _SM_COUNT[key] = torch.cuda.get_device_properties(key).multi_processor_count
    return _SM_COUNT[key]


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _dot_precision(dtype: torch.dtype) -> str:
    """tl.dot input precision: native for 16-bit inputs; for fp32, torch's matmul setting."""
    if dtype != torch.float32:
        return "ieee"  # ignored for fp16 / bf16 operands (tensor cores, fp32 accumulation)
    return {"highest": "ieee", "high": "tf32x3", "medium": "tf32"}.get(torch.get_float32_matmul_precision(), "ieee")


def _dot_f32(t: torch.Tensor | None) -> bool:
    """Upcast bf16 tl.dot operands to fp32: only in the interpreter, whose tl.dot mishandles
    bf16 (stored as uint16 bit patterns)."""
    return t is not None and t.dtype == torch.bfloat16 and _interpreted()


def _block(name: str, value: int | None, default: int, extent: int, minimum: int) -> int:
    """A power-of-two block: ``value`` if given (validated), else ``default`` shrunk to the extent."""
    if value is not None:
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum or value & (value - 1):
            raise ValueError(f"{name} must be a power of two >= {minimum}, got {value!r}")
        return value
    return max(minimum, min(default, _next_pow2(max(extent, 1))))


def _launch_opts(num_warps: int | None, num_stages: int | None, warps: int, stages: int | None) -> dict:
    for name, v in (("num_warps", num_warps), ("num_stages", num_stages)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    opts = {"num_warps": num_warps or warps}
    if num_stages or stages:
        opts["num_stages"] = num_stages or stages
    return opts


def _splits(n_row_blocks: int, n_v_blocks: int, device: torch.device, num_splits: int | None) -> int:
    """How many programs share a row block's vocabulary (enough programs for the GPU)."""
    if num_splits is not None:
        if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1:
            raise ValueError(f"num_splits must be a positive int, got {num_splits!r}")
        return max(1, min(num_splits, n_v_blocks))
    if device.type != "cuda":
        return 1  # the interpreter runs programs one by one: fewer is faster
    target = 2 * _sm_count(device)
    return max(1, min(n_v_blocks, _cdiv(target, max(n_row_blocks, 1))))


# --------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------


def _tensor(name: str, t, ndim: int | None = None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    return t


def _float_tensor(name: str, t, shape: tuple, device: torch.device, dtypes=_FLOAT_DTYPES) -> torch.Tensor:
    _tensor(name, t, len(shape))
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must have a dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")
    return t


def _check_target(target, N: int, device: torch.device) -> torch.Tensor:
    _tensor("target", target, 1)
    if target.dtype not in _INDEX_DTYPES:
        raise TypeError(f"target must be int64 or int32, got {target.dtype}")
    if target.shape[0] != N:
        raise ValueError(f"target must have shape ({N},), got {tuple(target.shape)}")
    if target.device != device:
        raise ValueError(f"target is on {target.device}, expected {device}")
    return target


def _check_common(ignore_index, scale, softcap) -> tuple[int, float, float | None]:
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
    if not -(2**63) <= ignore_index < 2**63:
        raise ValueError(f"ignore_index must fit int64, got {ignore_index}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float, got {type(scale).__name__}")
    if softcap is not None:
        if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
            raise TypeError(f"softcap must be a float or None, got {type(softcap).__name__}")
        if not softcap > 0 or softcap == float("inf"):
            raise ValueError(f"softcap must be a finite float > 0 or None, got {softcap}")
        softcap = float(softcap)
    return ignore_index, float(scale), softcap


def _check_linear(input, weight, bias) -> tuple[int, int, int]:
    _tensor("input", input, 2)
    _tensor("weight", weight, 2)
    if input.dtype not in _MATMUL_DTYPES:
        raise TypeError(f"input must be float16, bfloat16 or float32, got {input.dtype}")
    if weight.dtype != input.dtype:
        raise TypeError(f"input ({input.dtype}) and weight ({weight.dtype}) must share a dtype")
    if weight.shape[1] != input.shape[1]:
        raise ValueError(
            f"input {tuple(input.shape)} and weight {tuple(weight.shape)} must share D (input: (N, D), weight: (V, D))"
        )
    if weight.device != input.device:
        raise ValueError(f"weight is on {weight.device} but input is on {input.device}")
    N, D = input.shape
    V = weight.shape[0]
    if bias is not None:
        _float_tensor("bias", bias, (V,), input.device)
    return N, V, D


def _check_class_weight(class_weight, V: int, device: torch.device):
    if class_weight is not None:
        _float_tensor("class_weight", class_weight, (V,), device)
    return class_weight


def _vec(name: str, t, N: int, device: torch.device) -> torch.Tensor:
    return _float_tensor(name, t, (N,), device)


# --------------------------------------------------------------------------------------
# Forward
# --------------------------------------------------------------------------------------


def _forward(src, w, bias, target, *, from_matmul, N, V, D, ignore_index, scale, softcap, class_weight,
             need_weighted_sum, logits_out, blocks, num_splits, opts, prec):
    """Launch the forward kernel and merge the vocabulary splits (see ``_fwd_kernel``)."""
    dev = src.device
    f32 = dict(dtype=torch.float32, device=dev)
    if N == 0 or V == 0:
        lse = torch.full((N,), float("-inf"), **f32)
        ign = target == ignore_index
        tl_ = torch.where(ign, 0.0, float("nan")).to(torch.float32) if N else torch.empty(0, **f32)
        ws = torch.zeros(N, **f32) if need_weighted_sum else None
        return lse, tl_, torch.zeros(N, **f32), ws
    bn, bv, bd = blocks
    nb_n, nb_v = _cdiv(N, bn), _cdiv(V, bv)
    S = _splits(nb_n, nb_v, dev, num_splits)
    v_per_split = _cdiv(nb_v, S) * bv
    S = _cdiv(V, v_per_split)  # no empty split
    part = torch.empty((5 if need_weighted_sum else 4, S, N), **f32)
    cw = class_weight if class_weight is not None else part
    out = logits_out if logits_out is not None else part
    out_s = (logits_out.stride(0), logits_out.stride(1)) if logits_out is not None else (0, 0)
    with _on_device(src):
        _fwd_kernel[(nb_n, S)](
            src, src.stride(0), src.stride(1),
            w, w.stride(0), w.stride(1), bias if bias is not None else part,
            target, target.stride(0), cw, cw.stride(0) if class_weight is not None else 0,
            out, out_s[0], out_s[1], part,
            N, V, D, v_per_split, scale, 1.0 if softcap is None else softcap,
            FROM_MATMUL=from_matmul, HAS_BIAS=bias is not None, HAS_SOFTCAP=softcap is not None,
            HAS_CW=class_weight is not None, NEED_WS=bool(need_weighted_sum), WRITE_LOGITS=logits_out is not None,
            BLOCK_N=bn, BLOCK_V=bv, BLOCK_D=bd, PREC=prec, DOT_F32=_dot_f32(w if from_matmul else None),
            FIX_BF16=_interpreted(), **opts,
        )
    # merge the partial online-softmax states: m = max m_s, d = sum_s d_s exp(m_s - m)
    m_p, d_p, do_p, t_p = part[0], part[1], part[2], part[3]
    M = m_p.amax(0)
    Ms = torch.where(torch.isinf(M), torch.zeros_like(M), M)
    f = torch.exp(m_p - Ms)
    d = (d_p * f).sum(0)
    lse = Ms + torch.log(d)
    other = (do_p * f).sum(0) / d
    tgt = t_p.sum(0)
    ign = target == ignore_index
    bad = ~ign & ((target < 0) | (target >= V))
    zero = torch.zeros((), **f32)
    target_logit = torch.where(ign, zero, torch.where(bad, torch.full((), float("nan"), **f32), tgt))
    other_mass = torch.where(ign, zero, other)
    ws = part[4].sum(0) if need_weighted_sum else None
    return lse, target_logit, other_mass, ws


def lce_forward(input, weight, bias, target, *, ignore_index: int, scale: float = 1.0, softcap: float | None = None,
                class_weight=None, need_weighted_sum: bool = False, logits_out=None,
                block_n: int | None = None, block_v: int | None = None, block_d: int | None = None,
                num_splits: int | None = None, num_warps: int | None = None, num_stages: int | None = None):
    """Per-row cross-entropy statistics of ``z = transform(input @ weight.T + bias)`` without
    materializing the logits (Cut Cross-Entropy, Wijmans et al., 2024; online softmax,
    Milakov & Gimelshein, 2018).

    ``z = scale * x``, then ``softcap * tanh(z / softcap)`` if ``softcap`` is given, in fp32
    (the matmul accumulates in fp32).

    Args:
        input: ``(N, D)`` fp16 / bf16 / fp32, any strides. CUDA, or CPU under ``TRITON_INTERPRET=1``.
        weight: ``(V, D)``, same dtype and device as ``input``, any strides.
        bias: ``(V,)`` any float dtype, or None.
        target: ``(N,)`` int64 or int32 class indices. A row with ``target == ignore_index``
            is ignored; any other target outside ``[0, V)`` is never read out of bounds and
            gives a NaN ``target_logit``.
        ignore_index: the ignored label (any sign).
        scale: multiplies the raw logits first.
        softcap: ``> 0`` to soft-cap the scaled logits, or None.
        class_weight: ``(V,)`` float class weights ``w`` for ``weighted_sum`` (ones if None).
        need_weighted_sum: also return ``sum_j w_j z_ij`` (for label smoothing).
        logits_out: an ``(N, V)`` float tensor (any dtype and strides) to receive ``z``, or None.
        block_n, block_v, block_d: power-of-two block overrides (>= 16: ``tl.dot``).
            Defaults: 128 x 128 x 64 (fp16/bf16) or x 32 (fp32), shrunk to small problems.
        num_splits: programs per row block along the vocabulary (default: enough programs
            for ~2 per SM on a GPU; 1 in the interpreter).
        num_warps, num_stages: launch overrides (defaults 8 and 3).

    Returns:
        ``(lse, target_logit, other_mass, weighted_sum)``, each fp32 ``(N,)``:
        ``lse`` for every row (ignored or not; ``-inf`` when ``V == 0``);
        ``target_logit = z[i, y_i]`` (0 for ignored rows, NaN for an out-of-range target);
        ``other_mass = sum_{j != y_i} softmax(z_i)_j`` (0 for ignored rows; 1 for an
        out-of-range target); ``weighted_sum`` (every row) or None unless ``need_weighted_sum``.

    Raises:
        TypeError: non-tensor arguments, input not fp16/bf16/fp32, input/weight dtypes differ,
            non-integer target (int64/int32 only), non-float bias / class_weight / logits_out.
        ValueError: shape mismatches (input (N, D), weight (V, D), bias/class_weight (V,),
            target (N,), logits_out (N, V)), mixed devices, ``softcap <= 0``, bad block sizes.
        RuntimeError: triton missing, or not CUDA and not ``TRITON_INTERPRET=1``.
    """
    N, V, D = _check_linear(input, weight, bias)
    _check_target(target, N, input.device)
    ignore_index, scale, softcap = _check_common(ignore_index, scale, softcap)
    _check_class_weight(class_weight, V, input.device)
    if logits_out is not None:
        _float_tensor("logits_out", logits_out, (N, V), input.device)
    d16 = input.dtype != torch.float32
    dn, dv, dd = _FWD_BLOCKS_16 if d16 else _FWD_BLOCKS_32
    blocks = (_block("block_n", block_n, dn, N, 16), _block("block_v", block_v, dv, V, 16),
              _block("block_d", block_d, dd, D, 16))
    opts = _launch_opts(num_warps, num_stages, _FWD_WARPS, _FWD_STAGES)
    _check_runtime(input)
    return _forward(input, weight, bias, target, from_matmul=True, N=N, V=V, D=D, ignore_index=ignore_index,
                    scale=scale, softcap=softcap, class_weight=class_weight, need_weighted_sum=need_weighted_sum,
                    logits_out=logits_out, blocks=blocks, num_splits=num_splits, opts=opts,
                    prec=_dot_precision(input.dtype))


def ce_forward(logits, target, *, ignore_index: int, scale=1.0, softcap=None, class_weight=None,
               need_weighted_sum=False, block_n: int | None = None, block_v: int | None = None,
               num_splits: int | None = None, num_warps: int | None = None):
    """:func:`lce_forward`'s statistics with the raw logits ``x`` given as a tensor.

    Args:
        logits: ``(N, V)`` raw logits, fp16 / bf16 / fp32 / fp64 (computed in fp32), any 2-D
            strides (transposed, sliced, expanded): never copied.
        target, ignore_index, scale, softcap, class_weight, need_weighted_sum: as in
            :func:`lce_forward`.
        block_n, block_v: power-of-two block overrides (defaults 8 x 1024, shrunk to the problem).
        num_splits, num_warps: launch overrides.

    Returns:
        ``(lse, target_logit, other_mass, weighted_sum_or_None)``, fp32 ``(N,)`` each, as in
        :func:`lce_forward`.

    Raises:
        TypeError / ValueError / RuntimeError: as in :func:`lce_forward`.
    """
    _tensor("logits", logits, 2)
    if logits.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"logits must be floating-point, got {logits.dtype}")
    N, V = logits.shape
    _check_target(target, N, logits.device)
    ignore_index, scale, softcap = _check_common(ignore_index, scale, softcap)
    _check_class_weight(class_weight, V, logits.device)
    blocks = (_block("block_n", block_n, _CE_BLOCKS[0], N, 1), _block("block_v", block_v, _CE_BLOCKS[1], V, 1), 1)
    opts = _launch_opts(num_warps, None, _CE_WARPS, None)
    _check_runtime(logits)
    return _forward(logits, logits, None, target, from_matmul=False, N=N, V=V, D=0, ignore_index=ignore_index,
                    scale=scale, softcap=softcap, class_weight=class_weight, need_weighted_sum=need_weighted_sum,
                    logits_out=None, blocks=blocks, num_splits=num_splits, opts=opts, prec="ieee")


# --------------------------------------------------------------------------------------
# Backward
# --------------------------------------------------------------------------------------


def _check_backward_vectors(N, device, lse, other_mass, coef_a, coef_b, coef_c):
    _vec("lse", lse, N, device)
    _vec("other_mass", other_mass, N, device)
    _vec("coef_a", coef_a, N, device)
    _vec("coef_b", coef_b, N, device)
    if coef_c is not None:
        _vec("coef_c", coef_c, N, device)


def lce_backward(input, weight, bias, target, lse, other_mass, coef_a, coef_b, coef_c, *, ignore_index: int,
                 scale: float = 1.0, softcap: float | None = None, class_weight=None, logits=None, grad_logits=None,
                 filter_eps: float | None = None, need_input_grad=True, need_weight_grad=True, need_bias_grad=None,
                 input_grad_dtype=None, weight_grad_dtype=None,
                 block_n: int | None = None, block_v: int | None = None, block_d: int | None = None,
                 num_warps: int | None = None, num_stages: int | None = None):
    """Gradients of ``L = sum_i a_i lse_i - b_i z_{i,y_i} - c_i sum_j w_j z_ij`` (plus
    ``sum grad_logits * z``) w.r.t. ``input``, ``weight`` and ``bias``, recomputing the logit
    tiles (Cut Cross-Entropy, Wijmans et al., 2024).

    Per tile: ``G = a p - b onehot(y) - c w`` with the target entry computed collapse-safe as
    ``-a * other_mass + (a - b) - c w_y``; ``G += grad_logits``; ``Gx = G * dz/dx``; then
    ``grad_input += Gx @ weight``, ``grad_weight += Gx.T @ input``, ``grad_bias += Gx.sum(0)``,
    accumulated in fp32 with atomics (``Gx`` enters the matmuls rounded to the input dtype).
    Ignored rows (``target == ignore_index``) have no target entry (``G = a p - c w``; callers
    pass ``a = b = c = 0`` for them). A target outside ``[0, V)`` is never indexed.

    Args:
        input, weight, bias, target, ignore_index, scale, softcap, class_weight: as in
            :func:`lce_forward` (the same values as the forward).
        lse, other_mass: ``(N,)`` float, from :func:`lce_forward`.
        coef_a, coef_b: ``(N,)`` float per-row coefficients ``a``, ``b``; coef_c: ``(N,)`` or None (0).
        logits: the saved ``z`` (``(N, V)``, any float dtype / strides) to read instead of
            recomputing the matmul, or None.
        grad_logits: an extra ``(N, V)`` gradient w.r.t. ``z`` (any float dtype / strides), or None.
        filter_eps: None (exact, default), or a float: a tile whose ``|G|`` entries are all
            ``< filter_eps`` and that holds no target entry is skipped (gradient filtering).
            Filtering is disabled when ``grad_logits`` is given.
        need_input_grad, need_weight_grad, need_bias_grad: which gradients to compute
            (``need_bias_grad`` defaults to ``bias is not None``).
        input_grad_dtype, weight_grad_dtype: result dtypes (defaults: input's / weight's);
            ``grad_bias`` has bias's dtype (weight's when bias is None).
        block_n, block_v, block_d, num_warps, num_stages: launch overrides (defaults
            128 x 128 x 32 for fp16 / bf16, 64 x 64 x 32 for fp32, 8 warps, 2 stages; blocks
            >= 16, powers of two; shrunk to small problems).

    Returns:
        ``(grad_input (N, D) or None, grad_weight (V, D) or None, grad_bias (V,) or None)``.

    Raises:
        TypeError / ValueError / RuntimeError: as in :func:`lce_forward`; also for (N,) vectors,
            ``logits`` / ``grad_logits`` of the wrong shape, a negative ``filter_eps``, or
            non-float gradient dtypes.
    """
    N, V, D = _check_linear(input, weight, bias)
    dev = input.device
    _check_target(target, N, dev)
    ignore_index, scale, softcap = _check_common(ignore_index, scale, softcap)
    _check_class_weight(class_weight, V, dev)
    _check_backward_vectors(N, dev, lse, other_mass, coef_a, coef_b, coef_c)
    if logits is not None:
        _float_tensor("logits", logits, (N, V), dev)
    if grad_logits is not None:
        _float_tensor("grad_logits", grad_logits, (N, V), dev)
    if filter_eps is not None:
        if isinstance(filter_eps, bool) or not isinstance(filter_eps, (int, float)) or not filter_eps >= 0:
            raise ValueError(f"filter_eps must be None or a float >= 0, got {filter_eps!r}")
    if need_bias_grad is None:
        need_bias_grad = bias is not None
    input_grad_dtype = input.dtype if input_grad_dtype is None else input_grad_dtype
    weight_grad_dtype = weight.dtype if weight_grad_dtype is None else weight_grad_dtype
    bias_grad_dtype = bias.dtype if bias is not None else weight.dtype
    for name, dt in (("input_grad_dtype", input_grad_dtype), ("weight_grad_dtype", weight_grad_dtype)):
        if not isinstance(dt, torch.dtype) or not dt.is_floating_point:
            raise TypeError(f"{name} must be a floating-point torch.dtype, got {dt!r}")
    bn, bv, bd = _BWD_BLOCKS_16 if input.dtype != torch.float32 else _BWD_BLOCKS_32
    blocks = (_block("block_n", block_n, bn, N, 16), _block("block_v", block_v, bv, V, 16),
              _block("block_d", block_d, bd, D, 16))
    opts = _launch_opts(num_warps, num_stages, _BWD_WARPS, _BWD_STAGES)
    _check_runtime(input)

    f32 = dict(dtype=torch.float32, device=dev)
    gi = torch.zeros((N, D), **f32) if need_input_grad else None
    gw = torch.zeros((V, D), **f32) if need_weight_grad else None
    gb = torch.zeros((V,), **f32) if need_bias_grad else None
    if N and V and ((D and (need_input_grad or need_weight_grad)) or need_bias_grad):
        _backward_launch(
            src=logits, e=input, w=weight, bias=bias, target=target, class_weight=class_weight, lse=lse,
            om=other_mass, a=coef_a, b=coef_b, c=coef_c, grad_logits=grad_logits, gi=gi, gw=gw, gb=gb,
            gx=None, N=N, V=V, D=D, ignore_index=ignore_index, scale=scale, softcap=softcap,
            filter_eps=filter_eps if grad_logits is None else None,
            z_from=_Z_SAVED if logits is not None else _Z_MATMUL, blocks=blocks, opts=opts,
            prec=_dot_precision(input.dtype),
        )
    return (
        None if gi is None else gi.to(input_grad_dtype),
        None if gw is None else gw.to(weight_grad_dtype),
        None if gb is None else gb.to(bias_grad_dtype),
    )


def _backward_launch(*, src, e, w, bias, target, class_weight, lse, om, a, b, c, grad_logits, gi, gw, gb, gx,
                     N, V, D, ignore_index, scale, softcap, filter_eps, z_from, blocks, opts, prec):
    bn, bv, bd = blocks
    anchor = lse  # any tensor: a placeholder for absent pointer arguments (never dereferenced)
    src_t = src if src is not None else anchor
    src_s = (src.stride(0), src.stride(1)) if src is not None else (0, 0)
    e_t = e if e is not None else src_t
    w_t = w if w is not None else src_t
    e_s = (e.stride(0), e.stride(1)) if e is not None else (0, 0)
    w_s = (w.stride(0), w.stride(1)) if w is not None else (0, 0)
    gl_s = (grad_logits.stride(0), grad_logits.stride(1)) if grad_logits is not None else (0, 0)
    grid = (_cdiv(N, bn) * _cdiv(V, bv),)
    with _on_device(lse):
        _bwd_kernel[grid](
            src_t, src_s[0], src_s[1],
            e_t, e_s[0], e_s[1], w_t, w_s[0], w_s[1], bias if bias is not None else anchor,
            target, target.stride(0),
            class_weight if class_weight is not None else anchor,
            class_weight.stride(0) if class_weight is not None else 0,
            lse, lse.stride(0), om, om.stride(0), a, a.stride(0), b, b.stride(0),
            c if c is not None else anchor, c.stride(0) if c is not None else 0,
            grad_logits if grad_logits is not None else anchor, gl_s[0], gl_s[1],
            gi if gi is not None else anchor, gw if gw is not None else anchor, gb if gb is not None else anchor,
            gx if gx is not None else anchor,
            N, V, D, ignore_index, scale, 1.0 if softcap is None else softcap,
            0.0 if filter_eps is None else float(filter_eps),
            Z_FROM=z_from, HAS_BIAS=bias is not None, HAS_SOFTCAP=softcap is not None,
            HAS_CW=class_weight is not None, HAS_C=c is not None, HAS_GL=grad_logits is not None,
            FILTER=filter_eps is not None, NEED_GI=gi is not None and D > 0, NEED_GW=gw is not None and D > 0,
            NEED_GB=gb is not None, WRITE_GX=gx is not None, GROUP_N=_GROUP_N,
            BLOCK_N=bn, BLOCK_V=bv, BLOCK_D=bd, PREC=prec, DOT_F32=_dot_f32(e),
            FIX_BF16=_interpreted(), **opts,
        )


def ce_backward(logits, target, lse, other_mass, coef_a, coef_b, coef_c, *, ignore_index: int, scale=1.0,
                softcap=None, class_weight=None, out_dtype=None,
                block_n: int | None = None, block_v: int | None = None, num_warps: int | None = None):
    """Gradient w.r.t. the raw logits ``x`` of :func:`ce_forward`'s statistics.

    ``G`` as in :func:`lce_backward` (collapse-safe target entry), times ``dz/dx``; computed
    in fp32 per tile and written once in ``out_dtype`` (no fp32 ``N x V`` temporary).

    Args:
        logits: ``(N, V)`` raw logits (any float dtype, any 2-D strides), as given to :func:`ce_forward`.
        target, lse, other_mass, coef_a, coef_b, coef_c, ignore_index, scale, softcap,
            class_weight: as in :func:`lce_backward`.
        out_dtype: dtype of the result (default ``logits.dtype``).
        block_n, block_v, num_warps: launch overrides (defaults 8 x 1024, 8 warps).

    Returns:
        ``grad_x``: a new contiguous ``(N, V)`` tensor in ``out_dtype``.

    Raises:
        TypeError / ValueError / RuntimeError: as in :func:`ce_forward` / :func:`lce_backward`.
    """
    _tensor("logits", logits, 2)
    if logits.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"logits must be floating-point, got {logits.dtype}")
    N, V = logits.shape
    dev = logits.device
    _check_target(target, N, dev)
    ignore_index, scale, softcap = _check_common(ignore_index, scale, softcap)
    _check_class_weight(class_weight, V, dev)
    _check_backward_vectors(N, dev, lse, other_mass, coef_a, coef_b, coef_c)
    out_dtype = logits.dtype if out_dtype is None else out_dtype
    if not isinstance(out_dtype, torch.dtype) or not out_dtype.is_floating_point:
        raise TypeError(f"out_dtype must be a floating-point torch.dtype, got {out_dtype!r}")
    blocks = (_block("block_n", block_n, _CE_BLOCKS[0], N, 1), _block("block_v", block_v, _CE_BLOCKS[1], V, 1), 1)
    opts = _launch_opts(num_warps, None, _CE_WARPS, None)
    _check_runtime(logits)
    gx = torch.empty((N, V), dtype=out_dtype, device=dev)
    if N and V:
        _backward_launch(
            src=logits, e=None, w=None, bias=None, target=target, class_weight=class_weight, lse=lse,
            om=other_mass, a=coef_a, b=coef_b, c=coef_c, grad_logits=None, gi=None, gw=None, gb=None, gx=gx,
            N=N, V=V, D=0, ignore_index=ignore_index, scale=scale, softcap=softcap, filter_eps=None,
            z_from=_Z_RAW, blocks=blocks, opts=opts, prec="ieee",
        )
    return gx
