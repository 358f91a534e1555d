"""The Triton kernel of ``smx::sample``: temperature, top-k, top-p, min-p, softmax and the multinomial draw of
``generate(do_sample=True)`` in one kernel that never writes the vocabulary-wide probabilities.

Contract (:func:`sample_triton`): logits ``(B, V)`` fp32 / fp16 / bf16, any strides; uniforms ``(B,)`` in
[0, 1); ``(B, 1)`` int64 tokens, those of :func:`~smxcompile.kernels.sampling.candidates.sample_candidates` for
the same uniforms, up to fp rounding at a filter's or the draw's boundary. A NaN, ``+inf`` or all ``-inf`` row
raises ``NONFINITE_MESSAGE`` as ``torch.multinomial``.

Method: one program per row, no sort of the row. The ``C`` largest entries (``C = k`` under a top-k, else
up to ``MAX_CANDIDATES``) are found by a radix select over the order-preserving int32 image of the fp32 bits
(three histogram passes of 11, 11, 10 bits), written to a scratch row, and filtered in registers (sorted there);
the draw is the first candidate, in vocabulary order, whose cumulative kept weight exceeds ``u * W``: five reads
of the row. Without a top-k, when top-p's mass or min-p's threshold reaches past the candidates (or ties at the
``C``-th value overflow the scratch), the thresholds come from bisections over the row, each step one pass
(FlashInfer's sorting-free thresholds, ``flashinfer/sampling.cuh``); docs/DESIGN.md, "Sampling".

Ties at the top-p boundary or at the ``min_tokens_to_keep``-th value: as many are kept as eager's sort keeps, the
lowest indices (as the torch path). Ties at the ``k``-th value are all kept, as eager.
``s = logits / temperature`` rounds as torch's on the same device (a division on CPU, the interpreter; a
product by the fp32 reciprocal on CUDA, as ATen's scalar division).
"""

from __future__ import annotations

import torch

from ..triton_helpers import cast_like, check_runtime, interpreted, on_device, pow2_block, tl, triton
from .candidates import NONFINITE_MESSAGE

__all__ = ["sample_triton"]

#: Largest block of columns a pass loads at once.
_MAX_BLOCK = 4096
#: Most candidates the kernel filters in registers (a larger top-k, or ties past it, take the row's passes).
MAX_CANDIDATES = 4096

if triton is not None:

    @triton.jit
    def _key(v):
        """The order-preserving int64 image of fp32 ``v`` (no NaN, no -0.0): its bits, the negative flipped."""
        b = v.to(tl.int32, bitcast=True)
        return tl.where(b >= 0, b, b ^ 0x7FFFFFFF).to(tl.int64)

    @triton.jit
    def _value(key):
        """The fp32 whose :func:`_key` is ``key``."""
        b = key.to(tl.int32)
        return tl.where(b >= 0, b, b ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)

    @triton.jit
    def _scores(base, stride_v, cols, V, temp, SCALE: tl.constexpr, FIX_BF16: tl.constexpr):
        """``s = logits / temperature`` of the columns ``cols`` of a row (``-inf`` past ``V``) and the mask."""
        ok = cols < V
        x = tl.load(base + cols.to(tl.int64) * stride_v, mask=ok, other=float("-inf"))
        s = x.to(tl.float32)
        if SCALE == 1:
            s = tl.math.div_rn(s, temp)  # torch's CPU division: correctly rounded
        if SCALE == 2:
            s = s * temp  # torch's CUDA division by a scalar: times its fp32 reciprocal
        if SCALE != 0:
            s = cast_like(s, base, FIX_BF16).to(tl.float32)  # rounded to the logits' dtype, as eager
        return tl.where(s == 0.0, 0.0, s), ok  # -0.0 -> +0.0: the key order is then the float order

    @triton.jit
    def _row_range(base, stride_v, V, temp, SCALE: tl.constexpr, FIX_BF16: tl.constexpr, BLOCK: tl.constexpr):
        """Pass 1: ``(max, min, bad)`` of ``s`` over the row; ``bad``: a NaN, or a max that is not finite."""
        hi = float("-inf")
        lo = float("inf")
        nans = 0
        for start in range(0, V, BLOCK):
            s, ok = _scores(base, stride_v, start + tl.arange(0, BLOCK), V, temp, SCALE, FIX_BF16)
            nans += tl.sum((ok & (s != s)).to(tl.int32), 0)
            hi = tl.maximum(hi, tl.max(tl.where(ok & (s == s), s, float("-inf")), 0))
            lo = tl.minimum(lo, tl.min(tl.where(ok & (s == s), s, float("inf")), 0))
        bad = (nans > 0) | (tl.abs(hi) == float("inf"))
        return tl.where(bad, 0.0, hi), tl.where(bad, 0.0, lo), bad  # a bad row's searches end at once

    @triton.jit
    def _search(base, stride_v, V, temp, lo, hi, goal, m, floor, inv_z, MASS: tl.constexpr,
                SCALE: tl.constexpr, FIX_BF16: tl.constexpr, BLOCK: tl.constexpr):
        """The largest key ``t`` in [lo, hi] where ``count(s >= t) >= goal`` (not MASS), or where
        ``sum(exp(s - m) for floor <= s < t) * inv_z <= goal`` (MASS); it holds at ``lo``, and ``lo``, ``hi``
        are keys of the row's values. Bisection; after each pass ``lo`` / ``hi`` move to the row's nearest
        values on the side the pivot fell, so the search ends when one value is left in [lo, hi]."""
        while lo < hi:
            t = _value(lo + (hi - lo + 1) // 2)
            if MASS:
                stat = 0.0
            else:
                stat = 0
            above = float("inf")
            below = float("-inf")
            for start in range(0, V, BLOCK):
                s, ok = _scores(base, stride_v, start + tl.arange(0, BLOCK), V, temp, SCALE, FIX_BF16)
                ge = ok & (s >= t)
                if MASS:
                    stat += tl.sum(tl.where(ok & (s >= floor) & (s < t), tl.exp(s - m), 0.0), 0)
                else:
                    stat += tl.sum(ge.to(tl.int32), 0)
                above = tl.minimum(above, tl.min(tl.where(ge, s, float("inf")), 0))
                below = tl.maximum(below, tl.max(tl.where(ok & (s < t), s, float("-inf")), 0))
            if MASS:
                holds = stat * inv_z <= goal
            else:
                holds = stat >= goal
            # the statistic is the same at the nearest value >= t (holds) / the answer is <= the one below t
            lo = tl.where(holds, _key(above), lo)
            hi = tl.where(holds, hi, _key(below))
        return lo

    @triton.jit
    def _mass(base, stride_v, V, temp, m, floor, SCALE: tl.constexpr, FIX_BF16: tl.constexpr,
              BLOCK: tl.constexpr):
        """``sum(exp(s - m) for s >= floor)``: top-p's normalizer."""
        z = 0.0
        for start in range(0, V, BLOCK):
            s, ok = _scores(base, stride_v, start + tl.arange(0, BLOCK), V, temp, SCALE, FIX_BF16)
            z += tl.sum(tl.where(ok & (s >= floor), tl.exp(s - m), 0.0), 0)
        return z

    @triton.jit
    def _tie_counts(base, stride_v, V, temp, m, floor, f_keep, f_p, SCALE: tl.constexpr, FIX_BF16: tl.constexpr,
                    BLOCK: tl.constexpr):
        """``(count(s > f_keep), sum(exp(s - m) for floor <= s < f_p), count(s == f_p))``: how many of the ties
        at each threshold its filter keeps."""
        n_above = 0
        below = 0.0
        n_at = 0
        for start in range(0, V, BLOCK):
            s, ok = _scores(base, stride_v, start + tl.arange(0, BLOCK), V, temp, SCALE, FIX_BF16)
            n_above += tl.sum((ok & (s > f_keep)).to(tl.int32), 0)
            below += tl.sum(tl.where(ok & (s >= floor) & (s < f_p), tl.exp(s - m), 0.0), 0)
            n_at += tl.sum((ok & (s == f_p)).to(tl.int32), 0)
        return n_above, below, n_at

    @triton.jit
    def _weights(base, stride_v, cols, V, temp, m, f_k, f_keep, n_keep, f_p, n_p, carry_keep, carry_p, min_p,
                 SCALE: tl.constexpr, FIX_BF16: tl.constexpr):
        """The kept weights ``exp(s - m)`` (fp64; 0 where filtered) of the columns ``cols``: at or above the
        top-k value, and kept by ``min_tokens_to_keep`` or by both top-p and min-p (:func:`_within`); and the
        carries of the next block (the ties at ``f_keep`` and ``f_p`` seen so far)."""
        s, ok = _scores(base, stride_v, cols, V, temp, SCALE, FIX_BF16)
        e = tl.exp(s - m)
        kept = _within(s, f_keep, n_keep, carry_keep) | (_within(s, f_p, n_p, carry_p) & (e >= min_p))
        keep = ok & (s >= f_k) & kept
        carry_keep += tl.sum((ok & (s == f_keep)).to(tl.int32), 0)
        carry_p += tl.sum((ok & (s == f_p)).to(tl.int32), 0)
        return tl.where(keep, e, 0.0).to(tl.float64), carry_keep, carry_p

    @triton.jit
    def _radix_level(base, stride_v, V, temp, prefix, rem, SHIFT: tl.constexpr, BITS: tl.constexpr,
                     SCALE: tl.constexpr, FIX_BF16: tl.constexpr, BLOCK: tl.constexpr):
        """One digit of a radix select over the unsigned keys ``u = _key(s) + 2**31``: among the entries whose
        bits above ``SHIFT + BITS`` are ``prefix``, the digit ``b`` of the ``rem``-th largest. Returns
        ``(prefix * 2**BITS + b, rem - (count with a larger digit), count with digit b)``."""
        NB: tl.constexpr = 1 << BITS
        hist = tl.zeros([NB], tl.int32)
        for start in range(0, V, BLOCK):
            s, ok = _scores(base, stride_v, start + tl.arange(0, BLOCK), V, temp, SCALE, FIX_BF16)
            u = _key(s) + 2147483648
            digit = ((u >> SHIFT) & (NB - 1)).to(tl.int32)
            hist += tl.histogram(digit, NB, mask=ok & ((u >> (SHIFT + BITS)) == prefix))
        bins = tl.arange(0, NB)
        at_or_above = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist
        b = tl.max(tl.where(at_or_above >= rem, bins, 0), 0)
        at_b = tl.sum(tl.where(bins == b, hist, 0), 0)
        above = tl.sum(tl.where(bins == b, at_or_above, 0), 0) - at_b
        return prefix * NB + b, rem - above, at_b

    @triton.jit
    def _radix_select(base, stride_v, V, temp, k, SCALE: tl.constexpr, FIX_BF16: tl.constexpr,
                      BLOCK: tl.constexpr):
        """``(key of the k-th largest s, count of s >= it)``, 1 <= k <= V: three passes of 11, 11, 10 bits."""
        prefix = tl.zeros([], tl.int64)
        rem = k.to(tl.int64)
        prefix, rem, _ = _radix_level(base, stride_v, V, temp, prefix, rem, 21, 11, SCALE, FIX_BF16, BLOCK)
        prefix, rem, _ = _radix_level(base, stride_v, V, temp, prefix, rem, 10, 11, SCALE, FIX_BF16, BLOCK)
        prefix, rem, at = _radix_level(base, stride_v, V, temp, prefix, rem, 0, 10, SCALE, FIX_BF16, BLOCK)
        return prefix - 2147483648, k - rem + at

    @triton.jit
    def _compact(base, stride_v, V, temp, m, floor, cand_s, cand_i, SCALE: tl.constexpr,
                 FIX_BF16: tl.constexpr, BLOCK: tl.constexpr):
        """Writes the entries ``s >= floor`` (in vocabulary order) to ``cand_s`` / ``cand_i``; returns the mass
        ``sum(exp(s - m))`` and the largest ``s`` of the entries below ``floor``."""
        n = 0
        mass_out = 0.0
        max_out = float("-inf")
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            s, ok = _scores(base, stride_v, cols, V, temp, SCALE, FIX_BF16)
            keep = ok & (s >= floor)
            pos = (n + tl.cumsum(keep.to(tl.int32), 0) - 1).to(tl.int64)  # int64 pointer offsets throughout
            tl.store(cand_s + pos, s, mask=keep)
            tl.store(cand_i + pos, cols, mask=keep)
            n += tl.sum(keep.to(tl.int32), 0)
            out = ok & (s < floor)
            mass_out += tl.sum(tl.where(out, tl.exp(s - m), 0.0), 0)
            max_out = tl.maximum(max_out, tl.max(tl.where(out, s, float("-inf")), 0))
        tl.debug_barrier()  # the candidates are read back by other threads
        return mass_out, max_out

    @triton.jit
    def _within(s, f, n_tied, carry):
        """Kept by a threshold: ``s > f``, or ``s == f`` among the first ``n_tied`` such entries in vocabulary
        order (``carry`` of them in earlier blocks)."""
        tied = s == f
        rank = carry + tl.cumsum(tied.to(tl.int32), 0)
        return (s > f) | (tied & (rank <= n_tied))

    @triton.jit
    def _candidate_draw(base, stride_v, V, temp, m, floor, n, u, cand_s, cand_i, keep_min, one_minus_p, min_p,
                        TOP_K: tl.constexpr, TOP_P: tl.constexpr, SCALE: tl.constexpr,
                        FIX_BF16: tl.constexpr, BLOCK: tl.constexpr, CAP: tl.constexpr):
        """The draw among the ``n <= CAP`` entries ``s >= floor``, the filters run on them in registers (sorted):
        ``(token, 1)``, or ``(-1, 0)`` when an entry below ``floor`` could be kept (no top-k: top-p's mass or
        min-p's threshold reaches past the candidates), the row's passes then decide."""
        mass_out, max_out = _compact(base, stride_v, V, temp, m, floor, cand_s, cand_i, SCALE, FIX_BF16, BLOCK)
        if TOP_K:
            mass_out = 0.0  # the top-k removed the entries below floor: top-p's mass is the candidates'
        idx = tl.arange(0, CAP)
        valid = idx < n
        cs = tl.load(cand_s + idx.to(tl.int64), mask=valid, other=float("-inf"))
        ci = tl.load(cand_i + idx.to(tl.int64), mask=valid, other=0)
        ce = tl.exp(cs - m)
        asc = tl.sort(cs)  # the invalid lanes (-inf, weight 0) first
        # a filter keeps the values above its threshold and the first n of the ties at it (vocabulary order)
        f_keep = tl.max(tl.where(idx == CAP - keep_min, asc, float("-inf")), 0)
        n_keep = tl.sum(((idx >= CAP - keep_min) & (asc == f_keep)).to(tl.int32), 0)
        f_p = floor
        n_p = CAP
        enough = TOP_K | (tl.exp(max_out - m) < min_p)  # min-p removes every entry below floor
        if TOP_P:
            ea = tl.exp(asc - m)
            inv_z = 1.0 / (mass_out + tl.sum(ce, 0))
            below = mass_out + tl.cumsum(ea, 0) - ea  # the mass below each position, as eager's ascending sort
            # the first kept position; none when top-p's threshold lies below floor (all candidates pass it)
            first_kept = tl.max(tl.where(below * inv_z <= one_minus_p, idx, -1), 0)
            f_p = tl.max(tl.where(idx == first_kept, asc, float("-inf")), 0)
            n_p = tl.sum(((idx >= first_kept) & (asc == f_p)).to(tl.int32), 0)
            enough = enough | (mass_out * inv_z <= one_minus_p)
        in_keep = _within(cs, f_keep, n_keep, 0)
        in_p = _within(cs, f_p, n_p, 0)
        keep = valid & (in_keep | (in_p & (ce >= min_p)))
        w = tl.where(keep, ce, 0.0).to(tl.float64)
        cum = tl.cumsum(w, 0)
        target = u.to(tl.float64) * tl.max(cum, 0)
        first = tl.min(tl.where(cum > target, idx, CAP), 0)
        last = tl.max(tl.where(w > 0, idx, -1), 0)
        pick = tl.where(first < CAP, first, last)  # u * W rounded up to W: the last kept entry (as ``draw``)
        tok = tl.sum(tl.where(idx == pick, ci, 0), 0).to(tl.int64)
        return tl.where(enough, tok, -1), enough.to(tl.int32)

    @triton.jit
    def _row_draw(base, stride_v, V, temp, m, t_k, key_m, u, keep_min, one_minus_p, min_p,
                  KEEP_MIN: tl.constexpr, TOP_P: tl.constexpr, SCALE: tl.constexpr, FIX_BF16: tl.constexpr,
                  BLOCK: tl.constexpr):
        """The draw over the whole row, the thresholds found by bisection (each step a pass over the row)."""
        t_keep = key_m  # the largest value: top-p and min-p always keep it
        if KEEP_MIN:
            t_keep = _search(base, stride_v, V, temp, t_k, key_m, keep_min, m, 0.0, 1.0, False, SCALE, FIX_BF16,
                             BLOCK)
        t_p = t_k
        z = 1.0
        if TOP_P:
            floor = _value(t_k)
            z = _mass(base, stride_v, V, temp, m, floor, SCALE, FIX_BF16, BLOCK)
            t_p = _search(base, stride_v, V, temp, t_k, key_m, one_minus_p, m, floor, 1.0 / z, True, SCALE,
                          FIX_BF16, BLOCK)
        f_k, f_keep, f_p = _value(t_k), _value(t_keep), _value(t_p)
        n_keep = keep_min
        n_p = V
        if KEEP_MIN or TOP_P:
            n_above, below, n_at = _tie_counts(base, stride_v, V, temp, m, f_k, f_keep, f_p, SCALE, FIX_BF16,
                                               BLOCK)
            n_keep = keep_min - n_above
            n_p = n_at
        if TOP_P:
            # eager's ascending sort: the j-th tie goes while (below + j * e) / z <= 1 - top_p (in exact arithmetic;
            # at an exact equality eager's own fp32 cumulative sum decides, either way)
            q = tl.exp(f_p - m)
            removed = tl.floor((one_minus_p * z - below) / tl.where(q > 0, q, 1.0))
            n_p = n_at - tl.minimum(tl.maximum(removed, 0.0), n_at.to(tl.float32)).to(tl.int32)
        # the total kept weight, summed as the draw below sums it (so the draw's last cumsum equals it)
        total = tl.zeros([], tl.float64)
        last = -1
        carry_keep = 0
        carry_p = 0
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            w, carry_keep, carry_p = _weights(base, stride_v, cols, V, temp, m, f_k, f_keep, n_keep, f_p, n_p,
                                              carry_keep, carry_p, min_p, SCALE, FIX_BF16)
            total = tl.max(total + tl.cumsum(w, 0), 0)
            last = tl.maximum(last, tl.max(tl.where(w > 0, cols, -1), 0))
        target = u.to(tl.float64) * total
        # the draw: the first column whose cumulative kept weight exceeds u * W, in vocabulary order
        acc = tl.zeros([], tl.float64)
        tok = -1
        start = 0
        carry_keep = 0
        carry_p = 0
        while (tok < 0) & (start < V):
            cols = start + tl.arange(0, BLOCK)
            w, carry_keep, carry_p = _weights(base, stride_v, cols, V, temp, m, f_k, f_keep, n_keep, f_p, n_p,
                                              carry_keep, carry_p, min_p, SCALE, FIX_BF16)
            cum = acc + tl.cumsum(w, 0)
            first = tl.min(tl.where((cols < V) & (cum > target), cols, V), 0)
            tok = tl.where(first < V, first, tok)
            acc = tl.max(cum, 0)
            start += BLOCK
        return tl.where(tok < 0, last, tok).to(tl.int64)  # u * W rounded up to W: the last kept column

    @triton.jit
    def _sample_kernel(x_ptr, u_ptr, out_ptr, cand_s_ptr, cand_i_ptr, V, stride_b, stride_v, temp, top_k, n_cand,
                       keep_min, one_minus_p, min_p, SCALE: tl.constexpr, TOP_K: tl.constexpr,
                       KEEP_MIN: tl.constexpr, TOP_P: tl.constexpr, CAND: tl.constexpr, CAP: tl.constexpr,
                       FIX_BF16: tl.constexpr, BLOCK: tl.constexpr):
        """One row per program: ``out[row]`` = the drawn token, or -1 for a row whose softmax is NaN."""
        row = tl.program_id(0).to(tl.int64)
        base = x_ptr + row * stride_b  # int64: row * stride can exceed 2**31
        u = tl.load(u_ptr + row)
        m, low, bad = _row_range(base, stride_v, V, temp, SCALE, FIX_BF16, BLOCK)
        key_m = _key(m)
        t_k = _key(low)
        tok = tl.zeros([], tl.int64) - 1
        done = tl.zeros([], tl.int32)
        if CAND:
            # the n_cand largest (ties included) to a scratch row; the filters then run in registers
            t_c, n_ge = _radix_select(base, stride_v, V, temp, n_cand, SCALE, FIX_BF16, BLOCK)
            if TOP_K:
                t_k = t_c
            if n_ge <= CAP:
                tok, done = _candidate_draw(base, stride_v, V, temp, m, _value(t_c), n_ge, u,
                                            cand_s_ptr + row * CAP, cand_i_ptr + row * CAP, keep_min,
                                            one_minus_p, min_p, TOP_K, TOP_P, SCALE, FIX_BF16, BLOCK,
                                            CAP)
        elif TOP_K:
            t_k = _search(base, stride_v, V, temp, t_k, key_m, top_k, m, 0.0, 1.0, False, SCALE, FIX_BF16, BLOCK)
        if done == 0:
            tok = _row_draw(base, stride_v, V, temp, m, t_k, key_m, u, keep_min, one_minus_p, min_p, KEEP_MIN,
                            TOP_P, SCALE, FIX_BF16, BLOCK)
        tl.store(out_ptr + row, tl.where(bad, -1, tok))


def _candidates(V: int, k: int, keep_min: int, filtered: bool) -> tuple[int, int]:
    """``(n_cand, CAP)`` of the candidate path: the ``n_cand`` largest entries (ties included, up to ``CAP``)
    hold every kept one under a top-k ``k``; without one, top-p / min-p usually keep fewer than
    ``MAX_CANDIDATES`` (the kernel checks, else it runs the row's passes). ``(0, 0)``: no candidate path."""
    if k:
        cap = max(64, triton.next_power_of_2(2 * k))  # room for ties at the k-th value
        return (k, cap) if cap <= MAX_CANDIDATES else (0, 0)
    if not filtered or keep_min > MAX_CANDIDATES:
        return 0, 0  # nothing filtered: every entry is kept, the row's draw is two passes
    cap = min(MAX_CANDIDATES, triton.next_power_of_2(V))
    return min(cap, V), cap


def _scale(logits: torch.Tensor, temperature: float) -> tuple[int, float]:
    """``(SCALE, temp)``: 0 without a temperature; 1, divide by ``temperature`` (CPU); 2, multiply by its fp32
    reciprocal (CUDA), each as torch computes ``logits / temperature`` on that device."""
    if temperature == 1.0:
        return 0, 1.0
    if logits.is_cuda:
        t32 = torch.tensor(temperature, dtype=torch.float32)
        return 2, float(torch.tensor(1.0, dtype=torch.float32) / t32)
    return 1, float(temperature)


def sample_triton(logits: torch.Tensor, uniform: torch.Tensor, *, temperature: float, top_k: int, top_p: float,
                  min_p: float, min_tokens_to_keep: int, block_size: int | None = None,
                  num_warps: int | None = None) -> torch.Tensor:
    """One token per row of ``logits`` ``(B, V)`` (fp32 / fp16 / bf16, any strides) at the uniforms ``uniform``
    ``(B,)`` in [0, 1): ``(B, 1)`` int64, for each row the first column (in vocabulary order) whose cumulative
    kept weight exceeds ``uniform * (total kept weight)``; the kept weights are ``exp(s - max)`` over the
    entries the filters keep, ``s = logits / temperature`` (in the logits' dtype, then fp32). Options as
    :func:`~smxcompile.kernels.sampling.candidates.filtered_candidates` (``top_k`` 0, ``top_p`` 1.0, ``min_p``
    0.0: off); ``block_size`` (a power of two) and ``num_warps`` override the launch (tests).

    Raises:
        RuntimeError: a row with a NaN, a ``+inf`` or only ``-inf`` (``NONFINITE_MESSAGE``; this waits for the
            kernel), or the Triton runtime cannot run on ``logits``' device.
    """
    check_runtime(logits, "sampling")
    B, V = logits.shape
    out = torch.empty(B, dtype=torch.int64, device=logits.device)
    if B == 0:
        return out.view(0, 1)
    keep_min = min(min_tokens_to_keep, V)
    k = min(max(top_k, keep_min), V) if top_k else 0
    # filters that can remove nothing are off: k = V; min_tokens_to_keep >= V (a top-k with k == keep_min still
    # leaves top-p / min-p its ties at the k-th value to remove)
    top_k_on = 0 < k < V
    cut = keep_min < V
    top_p_on = cut and top_p < 1.0
    min_p_on = cut and min_p > 0.0
    scale, temp = _scale(logits, temperature)
    block = pow2_block("block_size", block_size, _MAX_BLOCK, V, 16)
    u = uniform.to(device=logits.device, dtype=torch.float32).contiguous()
    keep_min_on = keep_min > 1 and (top_p_on or min_p_on)
    n_cand, cap = _candidates(V, k if top_k_on else 0, keep_min, top_p_on or min_p_on)
    cand_s = torch.empty((B, cap) if cap else (1,), dtype=torch.float32, device=logits.device)
    cand_i = torch.empty((B, cap) if cap else (1,), dtype=torch.int32, device=logits.device)
    with on_device(logits):
        _sample_kernel[(B,)](
            logits, u, out, cand_s, cand_i, V, logits.stride(0), logits.stride(1), temp, k, n_cand, keep_min,
            float(torch.tensor(1.0 - top_p, dtype=torch.float32)), float(min_p) if min_p_on else 0.0,
            SCALE=scale, TOP_K=top_k_on, KEEP_MIN=keep_min_on, TOP_P=top_p_on, CAND=cap > 0, CAP=max(cap, 1),
            FIX_BF16=logits.dtype == torch.bfloat16 and interpreted(), BLOCK=block,
            num_warps=num_warps or (8 if block >= 4096 else 4),
        )
    if bool((out < 0).any()):
        raise RuntimeError(NONFINITE_MESSAGE)
    return out.view(B, 1)
