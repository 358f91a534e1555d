"""torch's own GPU path for the cases of gpu_cases.py, its kernels written as access traces, launch by launch and
tile by tile, through the counter and L2 model of our kernels (gpu_traffic.py). Sources and what each kernel reads
and writes: docs/PERFORMANCE.md ("GPU model")."""

from __future__ import annotations

import math

import numpy as np

from gpu_traffic import (ATOMIC, GPU, H200, LOAD, SECTOR, STORE, Counter, Traffic, grid_strata, sampled_loop,
                         stream_launch)

SMEM_PER_BLOCK = 48 * 1024  # what ATen's softmax sizes its one-read path by
#: ATen's topk should_use_multiblock: (at most this many rows, at least this many columns), rows ascending
MULTIBLOCK = ((20, 20000), (40, 10000), (80, 8000), (199, 5000), (799, 3000), (4000, 800), (float("inf"), 400))


class Tracer:
    """torch's kernels as access traces, counted by the counter of our kernels (same waves, sampling, L2 replay)."""

    def __init__(self, gpu: GPU = H200, axis_cap: int = 6, loop_cap: int = 8):
        self.counter = Counter(gpu, axis_cap, loop_cap)
        self.spans: dict[str, tuple[int, int]] = {}
        self.next = 1 << 32

    @property
    def traffic(self) -> Traffic:
        return self.counter.traffic

    def buffer(self, name: str, nbytes: float) -> str:
        """A tensor of ``nbytes``, allocated once per name, above the last (its region is its rank)."""
        if name not in self.spans:
            self.spans[name] = (self.next, int(nbytes))
            self.next += (int(nbytes) // 2**20 + 2) * 2**20
        return name

    def launch(self, kernel: str, grid: tuple, num_warps: int, program) -> None:
        """Run ``program(x, y, z)`` for the sampled programs of ``grid``."""
        c = self.counter
        c.begin_launch(kernel, grid, num_warps, dict(self.spans.values()))
        full = tuple(int(g) for g in grid) + (1,) * (3 - len(grid))
        for idx, w in grid_strata(full, c.axis_cap):
            c.start_program(idx, full, w)
            program(*idx)
        c.end_launch()
        c.launch = None

    def tile(self, buf: str, row: int, rows: int, row_bytes: int, kind: int = LOAD) -> None:
        """One instruction over ``rows`` contiguous rows of ``row_bytes`` of ``buf`` from row ``row`` on."""
        offset, n = int(row * row_bytes), int(rows * row_bytes)
        if n <= 0:
            return
        if offset < 0 or offset + n > self.spans[buf][1]:
            raise ValueError(f"a trace read past the end of {buf!r}")
        sectors = np.arange(offset // SECTOR, (offset + n - 1) // SECTOR + 1, dtype=np.int64)
        region = np.int64(list(self.spans).index(buf))
        self.counter.record(np.unique((region << 40) | sectors), kind, self.counter.weight * n)

    def rows(self, kernel: str, R: int, num_warps: int, loads: list, stores: list) -> None:
        """One program per row: ``loads`` (``(buffer, row bytes)`` pairs) read in turn, then ``stores`` written."""
        def program(r, _y, _z):
            for kind, tiles in ((LOAD, loads), (STORE, stores)):
                for buf, row_bytes in tiles:
                    self.tile(buf, r, 1, row_bytes, kind)
        self.launch(kernel, (R,), num_warps, program)

    def mma(self, flops: float) -> None:
        self.counter.launch.flops += self.counter.weight * flops

    def stream(self, kernel: str, reads: dict[str, float], writes: dict[str, float], flops: float = 0.0) -> None:
        """A launch that moves each of ``reads`` / ``writes`` (``{buffer: bytes}``) once."""
        at = {b: self.spans[b][0] for b in (*reads, *writes)}
        first = {at[b]: float(n) for b, n in reads.items()}
        self.traffic.launches.append(stream_launch(
            kernel, sum(reads.values()), sum(writes.values()), first, {at[b]: self.spans[b][1] for b in at},
            {**first, **{at[b]: float(n) for b, n in writes.items()}}, flops))


def row_fits(C: int, s: int) -> bool:
    """Whether ATen's softmax keeps a row of C elements of s bytes in registers or shared memory."""
    return (C <= 1024 and C * s <= 4096) or C * s < SMEM_PER_BLOCK - 256


def row_warps(C: int, s: int) -> int:
    """Warps of ATen's one-block-per-row softmax kernels (``SoftMax_getBlockSize``)."""
    if C <= 1024:
        return 4
    return max(1, min(1024, 1 << max(0, (max(1, C * s // 16) - 1).bit_length())) // 32)


def softmax(t: Tracer, x: str, y: str, R: int, C: int, s: int, s_out: int, name: str = "softmax") -> None:
    """ATen's softmax / log_softmax forward over R rows of C: one read of a row that fits, else three."""
    loads = [(x, C * s)] * (1 if row_fits(C, s) else 3)
    t.rows(f"aten.{name}", R, row_warps(C, s), loads, [(y, C * s_out)])


def softmax_backward(t: Tracer, g: str, y: str, gi: str, R: int, C: int, s: int, log: bool) -> None:
    """ATen's softmax / log_softmax backward (softmax's first writes ``grad * output``, which the row kernel reads)."""
    if not log:
        tmp = t.buffer(f"{g}.times_output", R * C * s)
        t.stream("aten.mul", {g: R * C * s, y: R * C * s}, {tmp: R * C * s})
        g = tmp
    loads = [(g, C * s)] * (1 if row_fits(C, s) else 2) + [(y, C * s)]
    t.rows(f"aten.{'log_' if log else ''}softmax_backward", R, row_warps(C, s), loads, [(gi, C * s)])


def topk(t: Tracer, x: str, R: int, C: int, s: int, k: int) -> None:
    """``torch.topk(x, k)`` along rows: TensorTopK.cu's multi-block radix select or one block per row."""
    vals, idx = t.buffer(f"{x}.topk_values", R * k * s), t.buffer(f"{x}.topk_indices", R * k * 8)
    if C >= next(c for rows, c in MULTIBLOCK if R <= rows):
        small = t.buffer(f"{x}.topk_counts", R * 256 * 4)
        for step in ("fill", "memset", "memset"):
            t.stream(f"aten.topk_{step}", {}, {small: R * 8})
        for _ in range(s):
            t.stream("aten.computeBlockDigitCounts", {x: R * C * s}, {small: R * 256 * 2})
            t.stream("aten.computeDigitCumSum", {small: R * 256 * 2}, {small: R * 256 * 4})
            t.stream("aten.computeBlockwiseWithinKCounts", {small: R * 256 * 4}, {small: R * 16})
        t.stream("aten.computeBlockwiseKthCounts", {small: R * 256 * 2}, {small: R * 8})
        for step in ("scan_by_key_init", "scan_by_key") * 2:
            t.stream(f"cub.{step}", {small: R * 8} if step == "scan_by_key" else {}, {small: R * 8})
        t.stream("aten.gatherTopK", {x: R * C * s, small: R * 16}, {vals: R * k * s, idx: R * k * 8})
    else:
        warps = max(1, min(32, math.ceil(C / 32)))
        t.rows("aten.sbtopk", R, warps, [(x, C * s)] * (s + 1), [(vals, k * s), (idx, k * 8)])
    if k > 1:
        t.stream("aten.sortKeyValueInplace", {vals: R * k * s, idx: R * k * 8}, {vals: R * k * s, idx: R * k * 8})


def softmax_topk(t: Tracer, R: int, C: int, k: int, s: int, renormalize: bool) -> None:
    """softmax, then topk (and ``v / v.sum()``)."""
    x, p = t.buffer("x", R * C * s), t.buffer("p", R * C * s)
    softmax(t, x, p, R, C, s, s)
    topk(t, p, R, C, s, k)
    if renormalize:
        vals, total = f"{p}.topk_values", t.buffer("sum", R * s)
        t.stream("aten.sum", {vals: R * k * s}, {total: R * s})
        t.stream("aten.div", {vals: R * k * s, total: R * s}, {t.buffer("renormalized", R * k * s): R * k * s})


def softmax_topk_backward(t: Tracer, R: int, C: int, k: int, s: int, renormalize: bool) -> None:
    """The k gradients (through the renormalization's division) scattered into zeros, the softmax backward."""
    g, gk = t.buffer("g", R * k * s), t.buffer("grad_values", R * k * s)
    if renormalize:  # d(v / sum v): sum(g * v), then g / sum - that * v / sum^2
        v, total = t.buffer("values", R * k * s), t.buffer("sum", R * s)
        t.stream("aten.mul_sum", {g: R * k * s, v: R * k * s}, {total: R * s})
        t.stream("aten.div_sub", {g: R * k * s, v: R * k * s, total: R * s}, {gk: R * k * s})
        g = gk
    dense, y = t.buffer("grad_probs", R * C * s), t.buffer("p", R * C * s)
    t.stream("aten.zeros", {}, {dense: R * C * s})
    t.stream("aten.scatter", {g: R * k * s, t.buffer("indices", R * k * 8): R * k * 8}, {dense: R * k * SECTOR})
    softmax_backward(t, dense, y, t.buffer("gx", R * C * s), R, C, s, log=False)


def quant_softmax(t: Tracer, R: int, C: int, s: int) -> None:
    """softmax, ``.float()`` (16-bit inputs), quantize_per_tensor."""
    x, p, p32 = t.buffer("x", R * C * s), t.buffer("p", R * C * s), t.buffer("p_fp32", R * C * 4)
    softmax(t, x, p, R, C, s, s)
    if s != 4:
        t.stream("aten._to_copy", {p: R * C * s}, {p32: R * C * 4})
        p = p32
    t.stream("aten.quantize_per_tensor", {p: R * C * 4}, {t.buffer("q", R * C): R * C})


def gemm(t: Tracer, name: str, M: int, N: int, K: int, a: str, b: str, c: str, s: int, batch: int = 1) -> None:
    """``c = A @ B`` (M x N, K deep; ``batch`` of them): A and B read once, C written once, 2 M N K FLOPs."""
    t.stream(f"cublas.{name}", {a: batch * M * K * s, b: batch * N * K * s}, {c: batch * M * N * s},
             flops=2.0 * batch * M * N * K)


def qkv(t: Tracer, B: int, Hq: int, Hkv: int, L: int, S: int, E: int, Ev: int, s: int) -> tuple[str, str, str]:
    return t.buffer("q", B * Hq * L * E * s), t.buffer("k", B * Hkv * S * E * s), t.buffer("v", B * Hkv * S * Ev * s)


def sdpa_forward(t: Tracer, B: int, Hq: int, Hkv: int, L: int, S: int, E: int, Ev: int, s: int, causal: bool,
                 padded: bool = False) -> None:
    """FlashAttention-2's forward; with a (B, 1, 1, S) bool mask, the memory-efficient kernel on a float bias."""
    q, k, v = qkv(t, B, Hq, Hkv, L, S, E, Ev, s)
    o, lse = t.buffer("o", B * Hq * L * Ev * s), t.buffer("lse", B * Hq * L * 4)
    BM, BN = (128, 64) if not padded else (64, 64) if E <= 64 else (32, 128)
    if padded:
        mask, bias = t.buffer("mask", B * S), t.buffer("bias", B * S * s)
        t.stream("aten.where", {mask: B * S}, {bias: B * S * s})

    def program(mi, y, z):
        bi, h = (z, y) if padded else (y, z)
        m0, rows = mi * BM, min(BM, L - mi * BM)
        head, kvh = bi * Hq + h, bi * Hkv + h // (Hq // Hkv)
        t.tile(q, head * L + m0, rows, E * s)
        n = math.ceil((min(S, m0 + rows) if causal else S) / BN)
        for ni in sampled_loop(t.counter, range(n) if padded else range(n - 1, -1, -1)):
            keys = min(BN, S - ni * BN)
            t.tile(k, kvh * S + ni * BN, keys, E * s)
            t.tile(v, kvh * S + ni * BN, keys, Ev * s)
            if padded:
                t.tile(bias, bi * S + ni * BN, keys, s)  # one row for every query
            t.mma(2.0 * rows * keys * (E + Ev))
        t.tile(o, head * L + m0, rows, Ev * s, STORE)
        t.tile(lse, head * L + m0, rows, 4, STORE)
    grid = (math.ceil(L / BM), Hq, B) if padded else (math.ceil(L / BM), B, Hq)
    t.launch("fmha_cutlassF" if padded else "flash_fwd_kernel", grid, 4, program)


def flash_backward(t: Tracer, B: int, Hq: int, Hkv: int, L: int, S: int, E: int, Ev: int, s: int,
                   causal: bool) -> None:
    """FlashAttention-2's backward: the ``rowsum(dO * O)`` pre-pass, the main kernel, dQ's cast, dK / dV summed."""
    q, k, v = qkv(t, B, Hq, Hkv, L, S, E, Ev, s)
    o, do = t.buffer("o", B * Hq * L * Ev * s), t.buffer("do", B * Hq * L * Ev * s)
    lse, delta = t.buffer("lse", B * Hq * L * 4), t.buffer("delta", B * Hq * L * 4)
    dq_acc = t.buffer("dq_accum", B * Hq * L * E * 4)
    dq = t.buffer("dq", B * Hq * L * E * s)
    dk, dv = t.buffer("dk_expanded", B * Hq * S * E * s), t.buffer("dv_expanded", B * Hq * S * Ev * s)
    BM, BN = 64, 128

    def pre(mi, bi, h):
        m0, rows = mi * BM, min(BM, L - mi * BM)
        head = bi * Hq + h
        t.tile(o, head * L + m0, rows, Ev * s)
        t.tile(do, head * L + m0, rows, Ev * s)
        t.tile(delta, head * L + m0, rows, 4, STORE)
        t.tile(dq_acc, head * L + m0, rows, E * 4, STORE)
    t.launch("flash_bwd_dot_do_o_kernel", (math.ceil(L / BM), B, Hq), 8, pre)

    def program(ni, bi, h):
        n0, keys = ni * BN, min(BN, S - ni * BN)
        head, kvh = bi * Hq + h, bi * Hkv + h // (Hq // Hkv)
        t.tile(k, kvh * S + n0, keys, E * s)
        t.tile(v, kvh * S + n0, keys, Ev * s)
        first, last = (n0 // BM if causal else 0), math.ceil(L / BM) - 1
        for mi in sampled_loop(t.counter, range(last, first - 1, -1)):
            m0 = mi * BM
            rows = min(BM, L - m0)
            t.tile(q, head * L + m0, rows, E * s)
            t.tile(do, head * L + m0, rows, Ev * s)
            t.tile(lse, head * L + m0, rows, 4)
            t.tile(delta, head * L + m0, rows, 4)
            t.tile(dq_acc, head * L + m0, rows, E * 4, ATOMIC)
            t.mma(2.0 * rows * keys * (3 * E + 2 * Ev))
        t.tile(dk, head * S + n0, keys, E * s, STORE)
        t.tile(dv, head * S + n0, keys, Ev * s, STORE)
    t.launch("flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel", (math.ceil(S / BN), B, Hq), 8, program)
    t.stream("flash_bwd_convert_dq_kernel", {dq_acc: B * Hq * L * E * 4}, {dq: B * Hq * L * E * s})
    if Hq != Hkv:
        dk_kv, dv_kv = t.buffer("dk", B * Hkv * S * E * s), t.buffer("dv", B * Hkv * S * Ev * s)
        t.stream("aten.sum", {dk: B * Hq * S * E * s}, {dk_kv: B * Hkv * S * E * s})
        t.stream("aten.sum", {dv: B * Hq * S * Ev * s}, {dv_kv: B * Hkv * S * Ev * s})


def written_out_attention(t: Tracer, B: int, H: int, L: int, S: int, E: int, Ev: int, s: int, passes: int,
                          causal: bool) -> None:
    """A normalizer torch has no kernel for, in eager ops (MHA): ``passes`` reads of the fp32 scores at least."""
    q, k, v = qkv(t, B, H, H, L, S, E, Ev, s)
    n = B * H * L * S
    scores, s32, p = t.buffer("scores", n * s), t.buffer("scores_fp32", n * 4), t.buffer("weights", n * s)
    gemm(t, "q_kT", L, S, E, q, k, scores, s, batch=B * H)
    t.stream("aten._to_copy", {scores: n * s}, {s32: n * 4})
    if causal:
        t.stream("aten.masked_fill", {s32: n * 4}, {s32: n * 4})
    for _ in range(passes):
        t.stream("aten.normalizer_pass", {s32: n * 4}, {})
    t.stream("aten._to_copy", {s32: n * 4}, {p: n * s})
    gemm(t, "p_v", L, Ev, S, p, v, t.buffer("o", B * H * L * Ev * s), s, batch=B * H)


def hf_cross_entropy(t: Tracer, N: int, V: int, s: int, backward: bool) -> None:
    """``F.cross_entropy(logits.float(), y)`` on 16-bit logits, or with ``backward`` its backward alone."""
    nv = N * V
    logits = t.buffer("logits", nv * s)
    f32, logp, y = t.buffer("logits_fp32", nv * 4), t.buffer("logp", nv * 4), t.buffer("target", N * 8)
    if not backward:
        t.stream("aten._to_copy", {logits: nv * s}, {f32: nv * 4})
        softmax(t, f32, logp, N, V, 4, 4, "log_softmax")
        t.stream("aten.nll_loss_forward", {logp: N * SECTOR, y: N * 8}, {t.buffer("loss", 8): 8})
        return
    g, gi, gl = t.buffer("grad_logp", nv * 4), t.buffer("grad_fp32", nv * 4), t.buffer("grad_logits", nv * s)
    t.stream("aten.zeros", {}, {g: nv * 4})
    t.stream("aten.nll_loss_backward", {y: N * 8}, {g: N * SECTOR})
    softmax_backward(t, g, logp, gi, N, V, 4, log=True)
    t.stream("aten._to_copy", {gi: nv * 4}, {gl: nv * s})


def hf_linear_cross_entropy(t: Tracer, N: int, D: int, V: int, s: int, forward: bool, backward: bool) -> None:
    """``F.cross_entropy((x @ W^T).float(), y)``: the forward, and the backward through to dx and dW."""
    x, w, logits = t.buffer("x", N * D * s), t.buffer("w", V * D * s), t.buffer("logits", N * V * s)
    if forward:
        gemm(t, "logits", N, V, D, x, w, logits, s)
        hf_cross_entropy(t, N, V, s, False)
    if backward:
        hf_cross_entropy(t, N, V, s, True)
        gl = t.buffer("grad_logits", N * V * s)
        gemm(t, "grad_x", N, D, V, gl, w, t.buffer("grad_x", N * D * s), s)
        gemm(t, "grad_w", V, D, N, gl, x, t.buffer("grad_w", V * D * s), s)


def hf_sampling(t: Tracer, B: int, V: int, temperature: float, top_k: int, top_p: float) -> None:
    """transformers' warpers, softmax and ``multinomial(probs, 1)`` on ``(B, V)`` fp32 scores as eager runs them."""
    n = B * V
    cur = t.buffer("scores", n * 4)
    if temperature != 1.0:
        t.stream("aten.div", {cur: n * 4}, {t.buffer("scaled", n * 4): n * 4})
        cur = "scaled"
    if top_k:
        topk(t, cur, B, V, 4, top_k)
        mask, out = t.buffer("mask_k", n), t.buffer("filled_k", n * 4)
        t.stream("aten.lt", {cur: n * 4}, {mask: n})
        t.stream("aten.masked_fill", {cur: n * 4, mask: n}, {out: n * 4})
        cur = out
    if top_p < 1.0:
        keys, vals = t.buffer("sorted", n * 4), t.buffer("sorted_idx", n * 8)
        for i in range(4):
            t.stream("cub.radix_sort_pass", {cur if i == 0 else keys: n * 4, vals: n * 8}, {keys: n * 4, vals: n * 8})
        sp, cs = t.buffer("sorted_p", n * 4), t.buffer("cumsum", n * 4)
        rm, rm2 = t.buffer("remove_sorted", n), t.buffer("remove", n)
        softmax(t, keys, sp, B, V, 4, 4)
        t.stream("aten.cumsum", {sp: n * 4}, {cs: n * 4})
        t.stream("aten.le", {cs: n * 4}, {rm: n})
        t.stream("aten.scatter", {rm: n, vals: n * 8}, {rm2: n})
        out = t.buffer("filled_p", n * 4)
        t.stream("aten.masked_fill", {cur: n * 4, rm2: n}, {out: n * 4})
        cur = out
    probs, tokens = t.buffer("probs", n * 4), t.buffer("tokens", B * 8)
    softmax(t, cur, probs, B, V, 4, 4)
    # multinomial(probs, 1), ATen's one-sample path (Distributions.cpp): aminmax and a row sum, each checked by
    # _assert_async, then argmax(probs / q) with q ~ Exponential(1)
    small, q = t.buffer("multinomial_checks", 64 + B * 4), t.buffer("exponential_noise", n * 4)
    for reduce, size, checks in (("aten.aminmax", 8, ("aten.ge", "aten.lt", "aten.bitwise_and")),
                                 ("aten.sum", B * 4, ("aten.eq", "aten.any", "aten.bitwise_not"))):
        t.stream(reduce, {probs: n * 4}, {small: size})
        for op in (*checks, "aten._assert_async"):
            t.stream(op, {small: size}, {small: 1})
    t.stream("aten.exponential_", {}, {q: n * 4})
    t.stream("aten.div", {probs: n * 4, q: n * 4}, {q: n * 4})
    t.stream("aten.argmax", {q: n * 4}, {tokens: B * 8})
