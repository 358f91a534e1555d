"""The gradient kernel of the fused linear + cross-entropy and its launchers: :func:`lce_backward` (w.r.t. input,
weight and bias, in a ``"fused"`` or ``"gemm"`` mode) and :func:`ce_backward` (w.r.t. given logits); the method is
in :mod:`smxcompile.kernels.cross_entropy.triton_common`."""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..common import FLOAT_DTYPES, HALF_DTYPES
from ..triton_helpers import (cdiv, check_runtime, dot_f32, dot_precision, interpreted, launch_opts, on_device,
                              pow2_block, tl, triton)  # triton, tl: None without it
from .loss import resolve_filter_eps
from .triton_common import (CE_BLOCKS, CE_WARPS, check_class_weight, check_linear, check_scalars, check_target,
                            float_tensor, tensor_arg)
from .triton_backward_gemm import chunked_gemm_backward

__all__ = ["MODES", "backward_mode", "lce_backward", "ce_backward", "write_chunk_grad"]

#: The modes of :func:`lce_backward`.
MODES = ("fused", "gemm")

# Default block sizes (BLOCK_N, BLOCK_V, BLOCK_D), num_warps, num_stages (see triton_forward). The fp32
# backward keeps two [BLOCK_N, BLOCK_V] fp32 operands in shared memory (three with tf32x3), hence its
# smaller tile.
_BWD_BLOCKS_16 = (128, 128, 32)
# 16-bit operands reading saved fp32 logits: the hi / lo gradient operands do not fit 96 KiB at 128 x 128
_BWD_BLOCKS_16_SAVED = (128, 64, 32)
_BWD_BLOCKS_32 = (64, 64, 32)
_BWD_WARPS, _BWD_STAGES = 8, 2
#: Backward program order: groups of this many row blocks sweep the vocabulary together.
_GROUP_N = 8

# Where the backward kernel gets z from.
_Z_MATMUL, _Z_RAW, _Z_SAVED = 0, 1, 2


if triton is not None:
    from ..triton_helpers import cast_like, dot
    from .triton_common import transform_logits, x_tile

    @triton.jit
    def _bwd_kernel(
        src_ptr, src_s0, src_s1,            # (N, V) raw logits (Z_FROM=1) or saved z (Z_FROM=2)
        e_ptr, e_s0, e_s1, w_ptr, w_s0, w_s1, bias_ptr,
        tgt_ptr, tgt_s, cw_ptr, cw_s,
        lse_ptr, lse_s, om_ptr, om_s, a_ptr, a_s, b_ptr, b_s, c_ptr, c_s,
        gl_ptr, gl_s0, gl_s1,
        gi_ptr, gw_ptr, gb_ptr, gx_ptr,     # fp32 (N, D), (V, D), (V,) accumulators; (N, V) output
        gxl_ptr,                            # (N, V) output: the low part of a split Gx (WRITE_GX and SPLIT_GX)
        act_ptr,                            # (V,) int8 output (WRITE_GX and FILTER): 1 where a column is kept
        N, V, D, ignore_index, scale, softcap, filter_eps,
        Z_FROM: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_CW: tl.constexpr,
        HAS_C: tl.constexpr, HAS_GL: tl.constexpr, FILTER: tl.constexpr,
        NEED_GI: tl.constexpr, NEED_GW: tl.constexpr, NEED_GB: tl.constexpr, WRITE_GX: tl.constexpr,
        SPLIT_GX: tl.constexpr,
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
            x = x_tile(e_ptr, e_s0, e_s1, w_ptr, w_s0, w_s1, bias_ptr, rows, cols, row_ok, col_ok, D,
                       True, HAS_BIAS, BLOCK_N, BLOCK_V, BLOCK_D, PREC, DOT_F32)
            z = transform_logits(x, scale, softcap, HAS_SOFTCAP)
        elif Z_FROM == 1:
            x = x_tile(src_ptr, src_s0, src_s1, w_ptr, w_s0, w_s1, bias_ptr, rows, cols, row_ok, col_ok, D,
                       False, False, BLOCK_N, BLOCK_V, BLOCK_D, PREC, DOT_F32)
            if HAS_BIAS:  # the gemm mode's logits chunk is input @ weight.T, without the bias
                x = x + tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            z = transform_logits(x, scale, softcap, HAS_SOFTCAP)
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
            # ce_backward, lce_backward's gemm mode: the gradient w.r.t. the raw logits, written once in the output
            # dtype (SPLIT_GX: as hi + lo, both in it, as the fused products below use them)
            gxh = cast_like(gx, gx_ptr, FIX_BF16)
            tl.store(gx_ptr + (rows[:, None] * V + cols[None, :]), gxh, mask=ok)
            if SPLIT_GX:
                tl.store(gxl_ptr + (rows[:, None] * V + cols[None, :]),
                         cast_like(gx - gxh.to(tl.float32), gxl_ptr, FIX_BF16), mask=ok)
            if FILTER:
                # gradient filtering by columns (the gemm mode): a column is kept when one of its probabilities
                # is >= filter_eps (NaN counts as large) or it holds a target; every writer writes 1
                big = tl.sum(tl.where((ok & ~(p < filter_eps)) | is_t, 1, 0), axis=0) > 0
                tl.store(act_ptr + cols, tl.full([BLOCK_V], 1, tl.int8), mask=col_ok & big)
        else:
            keep = True
            if FILTER:
                # Gradient filtering (Wijmans et al., 2024): skip a tile whose probabilities (before the
                # rows' coefficients, as CCE) are all below filter_eps and that holds no target entry.
                # NaN counts as large.
                n_big = tl.sum(tl.sum(tl.where(ok & ~(p < filter_eps), 1, 0), axis=1), axis=0)
                n_t = tl.sum(tl.sum(is_t.to(tl.int32), axis=1), axis=0)
                keep = (n_big + n_t) > 0
            if keep:
                if NEED_GB:
                    tl.atomic_add(gb_ptr + cols, tl.sum(gx, axis=0), mask=col_ok, sem="relaxed")
                if NEED_GI or NEED_GW:
                    gxc = cast_like(gx, e_ptr, FIX_BF16)
                    gxl = gxc  # (defined on both branches: the compiler wants it before the loop)
                    if SPLIT_GX:
                        # 16-bit operands: the fp32 tile enters the products as hi + lo, both in the operand
                        # dtype (~16 significant bits instead of 8), so that grad_input / grad_weight are
                        # rounded to the input dtype once, at the end (not G first, as torch's bf16 path)
                        gxl = cast_like(gx - gxc.to(tl.float32), e_ptr, FIX_BF16)
                    for k in range(0, D, BLOCK_D):
                        ks = k + tl.arange(0, BLOCK_D).to(tl.int64)
                        k_ok = ks < D
                        if NEED_GI:
                            w = tl.load(w_ptr + (cols[:, None] * w_s0 + ks[None, :] * w_s1),
                                        mask=col_ok[:, None] & k_ok[None, :], other=0.0)
                            gi = dot(gxc, w, None, PREC, DOT_F32)
                            if SPLIT_GX:
                                gi = dot(gxl, w, gi, PREC, DOT_F32)
                            tl.atomic_add(gi_ptr + (rows[:, None] * D + ks[None, :]), gi,
                                          mask=row_ok[:, None] & k_ok[None, :], sem="relaxed")
                        if NEED_GW:
                            e = tl.load(e_ptr + (rows[:, None] * e_s0 + ks[None, :] * e_s1),
                                        mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                            gw = dot(tl.trans(gxc), e, None, PREC, DOT_F32)
                            if SPLIT_GX:
                                gw = dot(tl.trans(gxl), e, gw, PREC, DOT_F32)
                            tl.atomic_add(gw_ptr + (cols[:, None] * D + ks[None, :]), gw,
                                          mask=col_ok[:, None] & k_ok[None, :], sem="relaxed")


def _check_backward_vectors(N, device, lse, other_mass, coef_a, coef_b, coef_c):
    """Check the (N,) float vectors of the backward on ``device``. Raises TypeError / ValueError."""
    vectors = {"lse": lse, "other_mass": other_mass, "coef_a": coef_a, "coef_b": coef_b}
    if coef_c is not None:
        vectors["coef_c"] = coef_c
    for name, vector in vectors.items():
        float_tensor(name, vector, (N,), device)


def backward_mode(mode: str | None) -> str:
    """The mode :func:`lce_backward` runs: ``mode`` if given, else ``"gemm"`` (both modes filter).

    Raises:
        ValueError: ``mode`` not None, "fused" or "gemm".
    """
    if mode is None:
        return "gemm"
    if mode not in MODES:
        raise ValueError(f"mode must be None, 'fused' or 'gemm', got {mode!r}")
    return mode


class _BackwardArgs(NamedTuple):
    """:func:`lce_backward`'s checked options and launch settings."""

    sizes: tuple                # (N, V, D)
    ignore_index: int
    scale: float
    softcap: float | None
    filter_eps: float | None    # None: exact
    mode: str
    need_bias_grad: bool
    grad_dtypes: tuple          # of grad_input, grad_weight, grad_bias
    blocks: tuple               # the fused kernel's (BLOCK_N, BLOCK_V, BLOCK_D)
    opts: dict                  # the fused kernel's num_warps, num_stages


def lce_backward(input, weight, bias, target, lse, other_mass, coef_a, coef_b, coef_c, *, ignore_index: int,
                 scale: float = 1.0, softcap: float | None = None, class_weight=None, logits=None, grad_logits=None,
                 filter_eps: float | None = None, precise_grad: bool = False,
                 need_input_grad=True, need_weight_grad=True, need_bias_grad=None,
                 input_grad_dtype=None, weight_grad_dtype=None, mode: str | None = None,
                 chunk_bytes: int | None = None,
                 block_n: int | None = None, block_v: int | None = None, block_d: int | None = None,
                 num_warps: int | None = None, num_stages: int | None = None):
    """Gradients of ``L = sum_i a_i lse_i - b_i z_{i,y_i} - c_i sum_j w_j z_ij`` (plus ``sum grad_logits * z``)
    w.r.t. ``input``, ``weight`` and ``bias``, recomputing the logits.

    ``G = a p - b onehot(y) - c w`` with the collapse-safe target entry ``-a * other_mass + (a - b) - c w_y``,
    ``G += grad_logits``, ``Gx = G * dz/dx``; then ``grad_input = Gx @ weight``, ``grad_weight = Gx.T @ input``,
    ``grad_bias = Gx.sum(0)``, in one of two modes. ``"fused"`` (Cut Cross-Entropy, Wijmans et al., 2024): one
    program per ``BLOCK_N x BLOCK_V`` tile adds its products to fp32 gradients with atomics, no ``N x V`` buffer.
    ``"gemm"`` (the default; row chunks as Liger-Kernel's, :func:`~.triton_backward_gemm.chunked_gemm_backward`):
    per chunk ``Gx`` written once by this module's kernel, then cuBLAS products; no atomics. With fp16 / bf16
    operands ``Gx`` is rounded to the operand dtype once, as torch's and CCE's backward do. Ignored rows have no
    target entry (callers pass ``a = b = c = 0`` for them); a target outside ``[0, V)`` is never indexed.
    docs/PERFORMANCE.md ("GPU model") has each mode's bytes and FLOPs at N = 8192, D = 4096, V = 128256.

    Args:
        input, weight, bias, target, ignore_index, scale, softcap, class_weight: as in :func:`lce_forward`.
        lse, other_mass: ``(N,)`` float, from :func:`lce_forward`.
        coef_a, coef_b: ``(N,)`` float coefficients ``a``, ``b``; coef_c: ``(N,)`` or None (0).
        logits: the saved ``z`` (``(N, V)``, any float dtype / strides) to read instead of recomputing, or None.
        grad_logits: an extra ``(N, V)`` gradient w.r.t. ``z`` (any float dtype / strides), or None.
        filter_eps: None (exact, default), ``"auto"`` (CCE's ``finfo(dtype).eps / 32``) or a float: entries whose
            probabilities are all ``< filter_eps`` and that hold no target may leave the products (a tile in the
            fused mode; a column of a row chunk in the gemm mode, when at most
            :data:`~.triton_backward_gemm.COMPACT_KEPT_SHARE` of them are kept). Off with grad_logits or coef_c.
        precise_grad: fp16 / bf16: ``Gx`` enters the products as ``hi + lo`` (~16 significant bits, results
            rounded once) at twice the products' FLOPs.
        need_input_grad, need_weight_grad, need_bias_grad: which gradients to compute (``need_bias_grad``
            defaults to ``bias is not None``).
        input_grad_dtype, weight_grad_dtype: result dtypes (defaults: input's / weight's); ``grad_bias`` has
            bias's dtype (weight's when bias is None).
        mode: ``"fused"``, ``"gemm"`` or None (:func:`backward_mode`: ``"gemm"``, saved ``logits`` included).
        chunk_bytes: gemm mode: bytes of one row chunk's temporaries; None: 1 GiB on CUDA, 32 MiB on CPU
            (:func:`~.triton_backward_gemm.gemm_rows`).
        block_n, block_v, block_d, num_warps, num_stages: launch overrides (powers of two >= 16, shrunk to small
            problems; fused defaults: the ``_BWD_*`` constants). Gemm: ``block_n``, ``block_v``, ``num_warps`` go
            to the gradient kernel (defaults as :func:`ce_backward`), the others are only validated.

    Returns:
        ``(grad_input (N, D) or None, grad_weight (V, D) or None, grad_bias (V,) or None)``.

    Raises:
        TypeError / ValueError / RuntimeError: as in :func:`lce_forward`; also for (N,) vectors, ``logits`` /
            ``grad_logits`` of the wrong shape, a negative ``filter_eps``, non-float gradient dtypes, a bad
            ``mode``, or ``chunk_bytes`` not None / a positive int.
    """
    args = _checked_backward_args(
        input, weight, bias, target, lse, other_mass, coef_a, coef_b, coef_c, ignore_index=ignore_index, scale=scale,
        softcap=softcap, class_weight=class_weight, logits=logits, grad_logits=grad_logits, filter_eps=filter_eps,
        need_bias_grad=need_bias_grad, input_grad_dtype=input_grad_dtype, weight_grad_dtype=weight_grad_dtype,
        mode=mode, chunk_bytes=chunk_bytes, block_n=block_n, block_v=block_v, block_d=block_d, num_warps=num_warps,
        num_stages=num_stages)
    vectors = dict(target=target, lse=lse, om=other_mass, a=coef_a, b=coef_b, c=coef_c)
    if args.mode == "gemm":
        return _gemm_mode(input, weight, bias, args, **vectors, class_weight=class_weight, logits=logits,
                          grad_logits=grad_logits, precise_grad=precise_grad, need_input_grad=need_input_grad,
                          need_weight_grad=need_weight_grad, chunk_bytes=chunk_bytes, block_n=block_n,
                          block_v=block_v, num_warps=num_warps)
    N, V, D = args.sizes
    dev = input.device
    f32 = dict(dtype=torch.float32, device=dev)
    gi = torch.zeros((N, D), **f32) if need_input_grad else None
    gw = torch.zeros((V, D), **f32) if need_weight_grad else None
    gb = torch.zeros((V,), **f32) if args.need_bias_grad else None
    if N and V and ((D and (need_input_grad or need_weight_grad)) or args.need_bias_grad):
        _backward_launch(
            src=logits, e=input, w=weight, bias=bias, **vectors, class_weight=class_weight, grad_logits=grad_logits,
            gi=gi, gw=gw, gb=gb, gx=None, N=N, V=V, D=D, ignore_index=args.ignore_index, scale=args.scale,
            softcap=args.softcap, filter_eps=args.filter_eps, z_from=_Z_SAVED if logits is not None else _Z_MATMUL,
            blocks=args.blocks, opts=args.opts, prec=dot_precision(input.dtype), split=precise_grad,
        )
    return tuple(None if grad is None else grad.to(dtype) for grad, dtype in zip((gi, gw, gb), args.grad_dtypes))


def _checked_backward_args(input, weight, bias, target, lse, other_mass, coef_a, coef_b, coef_c, *, ignore_index,
                           scale, softcap, class_weight, logits, grad_logits, filter_eps, need_bias_grad,
                           input_grad_dtype, weight_grad_dtype, mode, chunk_bytes, block_n, block_v, block_d,
                           num_warps, num_stages) -> _BackwardArgs:
    """Check :func:`lce_backward`'s arguments (raising as it documents) and resolve its defaults."""
    N, V, D = check_linear(input, weight, bias)
    dev = input.device
    check_target(target, N, dev)
    ignore_index, scale, softcap = check_scalars(ignore_index, scale, softcap)
    check_class_weight(class_weight, V, dev)
    _check_backward_vectors(N, dev, lse, other_mass, coef_a, coef_b, coef_c)
    if logits is not None:
        float_tensor("logits", logits, (N, V), dev)
    if grad_logits is not None:
        float_tensor("grad_logits", grad_logits, (N, V), dev)
    filter_eps = resolve_filter_eps(filter_eps, input.dtype)
    if chunk_bytes is not None and (isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int)
                                    or chunk_bytes < 1):
        raise ValueError(f"chunk_bytes must be None or a positive int, got {chunk_bytes!r}")
    mode = backward_mode(mode)
    if grad_logits is not None or coef_c is not None:
        filter_eps = None  # an upstream logits gradient, label smoothing: no entry is negligible
    input_grad_dtype = input.dtype if input_grad_dtype is None else input_grad_dtype
    weight_grad_dtype = weight.dtype if weight_grad_dtype is None else weight_grad_dtype
    for name, dt in (("input_grad_dtype", input_grad_dtype), ("weight_grad_dtype", weight_grad_dtype)):
        if not isinstance(dt, torch.dtype) or not dt.is_floating_point:
            raise TypeError(f"{name} must be a floating-point torch.dtype, got {dt!r}")
    if input.dtype == torch.float32:
        bn, bv, bd = _BWD_BLOCKS_32
    else:
        bn, bv, bd = _BWD_BLOCKS_16 if logits is None else _BWD_BLOCKS_16_SAVED
    blocks = (pow2_block("block_n", block_n, bn, N, 16), pow2_block("block_v", block_v, bv, V, 16),
              pow2_block("block_d", block_d, bd, D, 16))
    opts = launch_opts(num_warps, num_stages, _BWD_WARPS, _BWD_STAGES)
    check_runtime(input, "linear-cross-entropy")
    return _BackwardArgs(
        sizes=(N, V, D), ignore_index=ignore_index, scale=scale, softcap=softcap, filter_eps=filter_eps, mode=mode,
        need_bias_grad=bias is not None if need_bias_grad is None else need_bias_grad,
        grad_dtypes=(input_grad_dtype, weight_grad_dtype, bias.dtype if bias is not None else weight.dtype),
        blocks=blocks, opts=opts)


def _gemm_mode(input, weight, bias, args: _BackwardArgs, *, target, lse, om, a, b, c, class_weight, logits,
               grad_logits, precise_grad, need_input_grad, need_weight_grad, chunk_bytes, block_n, block_v,
               num_warps):
    """:func:`lce_backward`'s ``"gemm"`` mode: :func:`write_chunk_grad` per row chunk of
    :func:`~.triton_backward_gemm.chunked_gemm_backward`."""
    def write_grad(r0, r1, src, hi, lo):
        return write_chunk_grad(
            src, hi, lo, bias=bias if logits is None else None, target=target[r0:r1], class_weight=class_weight,
            lse=lse[r0:r1], om=om[r0:r1], a=a[r0:r1], b=b[r0:r1], c=None if c is None else c[r0:r1],
            grad_logits=None if grad_logits is None else grad_logits[r0:r1], ignore_index=args.ignore_index,
            scale=args.scale, softcap=args.softcap, filter_eps=args.filter_eps, saved=logits is not None,
            block_n=block_n, block_v=block_v, num_warps=num_warps)

    input_grad_dtype, weight_grad_dtype, bias_grad_dtype = args.grad_dtypes
    return chunked_gemm_backward(
        input, weight, logits, write_grad, need_input_grad=need_input_grad, need_weight_grad=need_weight_grad,
        need_bias_grad=args.need_bias_grad, input_grad_dtype=input_grad_dtype, weight_grad_dtype=weight_grad_dtype,
        bias_grad_dtype=bias_grad_dtype, split=precise_grad, chunk_bytes=chunk_bytes,
        filtering=args.filter_eps is not None)


def write_chunk_grad(src, hi, lo, *, bias, target, class_weight, lse, om, a, b, c, grad_logits, ignore_index: int,
                     scale: float, softcap: float | None, filter_eps: float | None, saved: bool,
                     block_n: int | None = None, block_v: int | None = None, num_warps: int | None = None):
    """The gemm mode's step for one row chunk: ``Gx`` (see :func:`lce_backward`) from the chunk's logits ``src``
    (``(n, V)``: raw fp32 ``input @ weight.T``, the bias added here, or the saved transformed ``z`` when
    ``saved``) into ``hi`` (``(n, V)``, contiguous), and ``Gx - hi`` into ``lo`` when it is not None. The other
    arguments are the chunk's rows of :func:`lce_backward`'s. Returns None, or with ``filter_eps`` the ``(V,)``
    int8 flags of the columns kept (:func:`~.triton_backward_gemm.kept_columns`)."""
    rows, V = src.shape
    active = None if filter_eps is None else torch.zeros(V, dtype=torch.int8, device=src.device)
    _backward_launch(
        src=src, e=None, w=None, bias=bias, target=target, class_weight=class_weight, lse=lse, om=om, a=a, b=b,
        c=c, grad_logits=grad_logits, gi=None, gw=None, gb=None, gx=hi, gx_lo=lo, N=rows, V=V, D=0,
        ignore_index=ignore_index, scale=scale, softcap=softcap, filter_eps=filter_eps, active=active,
        z_from=_Z_SAVED if saved else _Z_RAW,
        blocks=(pow2_block("block_n", block_n, CE_BLOCKS[0], rows, 1),
                pow2_block("block_v", block_v, CE_BLOCKS[1], V, 1), 1),
        opts=launch_opts(num_warps, None, CE_WARPS, None), prec="ieee",
    )
    return active


def _backward_launch(*, src, e, w, bias, target, class_weight, lse, om, a, b, c, grad_logits, gi, gw, gb, gx,
                     N, V, D, ignore_index, scale, softcap, filter_eps, z_from, blocks, opts, prec, gx_lo=None,
                     split=False, active=None):
    """Launch ``_bwd_kernel`` on one ``(N, V)`` problem; absent tensors (None) are not read."""
    bn, bv, bd = blocks
    anchor = lse  # any tensor: a placeholder for absent pointer arguments (never dereferenced)
    src_t = src if src is not None else anchor
    src_s = (src.stride(0), src.stride(1)) if src is not None else (0, 0)
    e_t = e if e is not None else src_t
    w_t = w if w is not None else src_t
    e_s = (e.stride(0), e.stride(1)) if e is not None else (0, 0)
    w_s = (w.stride(0), w.stride(1)) if w is not None else (0, 0)
    gl_s = (grad_logits.stride(0), grad_logits.stride(1)) if grad_logits is not None else (0, 0)
    grid = (cdiv(N, bn) * cdiv(V, bv),)
    with on_device(lse):
        _bwd_kernel[grid](
            src_ptr=src_t, src_s0=src_s[0], src_s1=src_s[1],
            e_ptr=e_t, e_s0=e_s[0], e_s1=e_s[1], w_ptr=w_t, w_s0=w_s[0], w_s1=w_s[1],
            bias_ptr=bias if bias is not None else anchor,
            tgt_ptr=target, tgt_s=target.stride(0),
            cw_ptr=class_weight if class_weight is not None else anchor,
            cw_s=class_weight.stride(0) if class_weight is not None else 0,
            lse_ptr=lse, lse_s=lse.stride(0), om_ptr=om, om_s=om.stride(0), a_ptr=a, a_s=a.stride(0), b_ptr=b,
            b_s=b.stride(0), c_ptr=c if c is not None else anchor, c_s=c.stride(0) if c is not None else 0,
            gl_ptr=grad_logits if grad_logits is not None else anchor, gl_s0=gl_s[0], gl_s1=gl_s[1],
            gi_ptr=gi if gi is not None else anchor, gw_ptr=gw if gw is not None else anchor,
            gb_ptr=gb if gb is not None else anchor, gx_ptr=gx if gx is not None else anchor,
            gxl_ptr=gx_lo if gx_lo is not None else anchor, act_ptr=active if active is not None else anchor,
            N=N, V=V, D=D, ignore_index=ignore_index, scale=scale, softcap=1.0 if softcap is None else softcap,
            filter_eps=0.0 if filter_eps is None else float(filter_eps),
            Z_FROM=z_from, HAS_BIAS=bias is not None, HAS_SOFTCAP=softcap is not None,
            HAS_CW=class_weight is not None, HAS_C=c is not None, HAS_GL=grad_logits is not None,
            FILTER=filter_eps is not None, NEED_GI=gi is not None and D > 0, NEED_GW=gw is not None and D > 0,
            NEED_GB=gb is not None, WRITE_GX=gx is not None,
            SPLIT_GX=(gx_lo is not None) if gx is not None else (split and e.dtype in HALF_DTYPES),
            GROUP_N=_GROUP_N,
            BLOCK_N=bn, BLOCK_V=bv, BLOCK_D=bd, PREC=prec, DOT_F32=dot_f32(e.dtype if e is not None else None),
            FIX_BF16=interpreted(), **opts,
        )


def ce_backward(logits, target, lse, other_mass, coef_a, coef_b, coef_c, *, ignore_index: int, scale=1.0,
                softcap=None, class_weight=None, out_dtype=None,
                block_n: int | None = None, block_v: int | None = None, num_warps: int | None = None):
    """Gradient w.r.t. the raw ``(N, V)`` logits (any float dtype and 2-D strides) of :func:`ce_forward`'s
    statistics: ``G`` as in :func:`lce_backward`, times ``dz/dx``, computed in fp32 per tile and written once as a
    new contiguous ``(N, V)`` tensor in ``out_dtype`` (default ``logits.dtype``). The other arguments are
    :func:`lce_backward`'s; block_n, block_v, num_warps: launch overrides (defaults 8 x 1024, 8 warps).

    Raises:
        TypeError / ValueError / RuntimeError: as in :func:`ce_forward` / :func:`lce_backward`.
    """
    tensor_arg("logits", logits, 2)
    if logits.dtype not in FLOAT_DTYPES:
        raise TypeError(f"logits must be floating-point, got {logits.dtype}")
    N, V = logits.shape
    dev = logits.device
    check_target(target, N, dev)
    ignore_index, scale, softcap = check_scalars(ignore_index, scale, softcap)
    check_class_weight(class_weight, V, dev)
    _check_backward_vectors(N, dev, lse, other_mass, coef_a, coef_b, coef_c)
    out_dtype = logits.dtype if out_dtype is None else out_dtype
    if not isinstance(out_dtype, torch.dtype) or not out_dtype.is_floating_point:
        raise TypeError(f"out_dtype must be a floating-point torch.dtype, got {out_dtype!r}")
    blocks = (pow2_block("block_n", block_n, CE_BLOCKS[0], N, 1),
              pow2_block("block_v", block_v, CE_BLOCKS[1], V, 1), 1)
    opts = launch_opts(num_warps, None, CE_WARPS, None)
    check_runtime(logits, "linear-cross-entropy")
    gx = torch.empty((N, V), dtype=out_dtype, device=dev)
    if N and V:
        _backward_launch(
            src=logits, e=None, w=None, bias=None, target=target, class_weight=class_weight, lse=lse,
            om=other_mass, a=coef_a, b=coef_b, c=coef_c, grad_logits=None, gi=None, gw=None, gb=None, gx=gx,
            N=N, V=V, D=0, ignore_index=ignore_index, scale=scale, softcap=softcap, filter_eps=None,
            z_from=_Z_RAW, blocks=blocks, opts=opts, prec="ieee",
        )
    return gx
