"""The top-k selection of the softmax + top-k kernels, as ``@triton.jit`` functions: the unique int64 keys
(:func:`encode_keys` / :func:`decode_keys`) and the bitonic top-k network (:func:`topk_keys`,
:func:`merge_keys`). See :mod:`smxcompile.kernels.softmax_topk.triton_kernels` ("Top-k") for the method.
Defined only when triton imports."""

from __future__ import annotations

from ..triton_helpers import tl, triton  # None without triton

__all__ = ["encode_keys", "decode_keys", "topk_keys", "merge_keys"]

if triton is not None:

    @triton.constexpr_function
    def _log2(i):
        r = 0
        while i > 1:
            i >>= 1
            r += 1
        return r

    @triton.jit
    def _indicator(n_dims: tl.constexpr, j: tl.constexpr):
        """0/1 along hypercube axis ``j`` (counted from the innermost), broadcastable."""
        ar = tl.arange(0, 2)
        return tl.reshape(ar, [1] * (n_dims - j - 1) + [2] + [1] * j)

    @triton.jit
    def _compare_and_swap(x, flip, i: tl.constexpr):
        """One bitonic compare-and-swap along the ``i``-th innermost axis of hypercube ``x``.

        The partner of each element along that (size-2) axis is ``sum(pair) - x``: int64
        adds wrap, so this is exact, and unlike tl.sort's xor reduction it runs as one
        vectorized numpy reduction in the interpreter."""
        n_dims: tl.constexpr = _log2(x.numel)
        y = tl.sum(x, n_dims - 1 - i, keep_dims=True) - x
        is_right = _indicator(n_dims, i)
        return tl.where((x > y) != (flip ^ is_right).to(tl.int1), y, x)

    @triton.jit
    def _bitonic_merge(x, stage: tl.constexpr, order: tl.constexpr):
        """order 0 ascending, 1 descending, 2 alternating (as triton.language.standard)."""
        if order == 2:
            flip = _indicator(_log2(x.numel), stage)
        else:
            flip = order
        for i in tl.static_range(stage):
            x = _compare_and_swap(x, flip, stage - 1 - i)
        return x

    @triton.jit
    def topk_keys(x, K: tl.constexpr, DESC: tl.constexpr):
        """The K largest of each row of ``x`` (int64 [ROWS, N], N and K powers of two, K <= N),
        sorted descending (``DESC``) or ascending: [ROWS, K]. Bitonic top-k as in ``tl.topk``."""
        log_n: tl.constexpr = _log2(x.shape[1])
        log_k: tl.constexpr = _log2(K)
        if log_k == 0:
            out = tl.max(x, axis=1, keep_dims=True)
        else:
            n_dims: tl.constexpr = _log2(x.numel)
            h = tl.reshape(x, [2] * n_dims)
            for i in tl.static_range(1, log_k + 1):
                h = _bitonic_merge(h, i, 2 if i < log_n else DESC)
            for i in tl.static_range(log_k + 1, log_n + 1):
                h = tl.max(h, axis=(_log2(h.numel) - 1 - log_k))
                h = _bitonic_merge(h, log_k, 2 if i < log_n else DESC)
            out = tl.reshape(h, [x.shape[0], K])
        return out

    @triton.jit
    def merge_keys(buf, top_asc, K_PAD: tl.constexpr):
        """The K_PAD largest of ``buf`` (sorted descending) and ``top_asc`` (sorted ascending),
        sorted descending. ``max(buf_i, top_asc_i)`` holds the K_PAD largest of the union as a
        bitonic sequence: one bitonic merge (log2 K_PAD compare-and-swap steps) sorts it."""
        c = tl.maximum(buf, top_asc)
        log_k: tl.constexpr = _log2(K_PAD)
        if log_k > 0:
            n_dims: tl.constexpr = _log2(c.numel)
            h = _bitonic_merge(tl.reshape(c, [2] * n_dims), log_k, 1)
            c = tl.reshape(h, c.shape)
        return c

    @triton.jit
    def encode_keys(z, cols):
        """Unique int64 keys ordered like (z, -column): NaN highest, -0.0 == +0.0."""
        b = z.to(tl.int32, bitcast=True)
        b = tl.where(b == -2147483648, 0, b)  # -0.0 ties with +0.0
        b = tl.where(b < 0, b ^ 0x7FFFFFFF, b)  # order-preserving for negative floats
        b = tl.where(z != z, 0x7FFFFFFF, b)  # every NaN: the largest key
        return (b.to(tl.int64) << 32) | (4294967295 - cols)

    @triton.jit
    def decode_keys(key):
        """(z fp32, column int64) of keys made by _encode."""
        hi = (key >> 32).to(tl.int32)
        b = tl.where(hi < 0, hi ^ 0x7FFFFFFF, hi)
        z = b.to(tl.float32, bitcast=True)
        col = 4294967295 - (key & 4294967295)
        return z, col
