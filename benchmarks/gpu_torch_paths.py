"""torch's own GPU path for the cases of gpu_cases.py as the access order of its kernels (ATen softmax and topk,
FlashAttention-2, memory-efficient attention, cuBLAS GEMMs, elementwise ops), launch by launch and tile by tile,
through the counter and L2 model of our kernels (gpu_traffic.py). Sources and what each kernel reads and writes:
docs/PERFORMANCE.md ("GPU model").
"""

from __future__ import annotations

import math

import numpy as np

from gpu_sampling import grid_strata, sampled_loop
from gpu_traffic import ATOMIC, GPU, H200, LOAD, SECTOR, STORE, Counter, Traffic, stream_launch

#: default shared memory per block on NVIDIA GPUs (what ATen's softmax sizes its one-read path by)
SMEM_PER_BLOCK = 48 * 1024


class Tracer:
    """Launches of torch's kernels written as access traces, counted into one Traffic by the counter that counts
    our kernels (the same waves, clock, sampling and L2 replay)."""

    def __init__(self, gpu: GPU = H200, axis_cap: int = 6, loop_cap: int = 8):
        self.counter = Counter(gpu, axis_cap, loop_cap)
        self.spans: dict[str, tuple[int, int]] = {}
        self.next = 1 << 32
        self.region: dict[str, int] = {}

    @property
    def traffic(self) -> Traffic:
        return self.counter.traffic

    def buffer(self, name: str, nbytes: float) -> str:
        """A tensor of ``nbytes`` (allocated once per name: later launches reuse it)."""
        if name not in self.spans:
            self.spans[name] = (self.next, int(nbytes))
            self.next += (int(nbytes) // 2**20 + 2) * 2**20
        return name

    def launch(self, kernel: str, grid: tuple, num_warps: int, program) -> None:
        """Run ``program(x, y, z)`` for the sampled programs of ``grid``."""
        self.region = {b: i for i, b in enumerate(sorted(self.spans, key=lambda b: self.spans[b][0]))}
        c = self.counter
        lx = c.begin_launch(kernel, grid, num_warps, dict(self.spans.values()))
        full = tuple(int(g) for g in grid) + (1,) * (3 - len(grid))
        for idx, w in grid_strata(full, c.axis_cap):
            c.start_program(w[0] * w[1] * w[2], idx, full, w)
            program(*idx)
        c.end_launch()
        lx.touched = {k: v for k, v in lx.touched.items() if v > 0}
        lx.first_touch = {k: v for k, v in lx.first_touch.items() if v > 0}
        c.launch, c.regions = None, None

    def tile(self, buf: str, row: int, rows: int, row_bytes: int, kind: int = LOAD) -> None:
        """One instruction over ``rows`` contiguous rows of ``row_bytes`` of ``buf`` from row ``row`` on."""
        offset, n = int(row * row_bytes), int(rows * row_bytes)
        if n <= 0:
            return
        if offset < 0 or offset + n > self.spans[buf][1]:
            raise ValueError(f"a trace read past the end of {buf!r}")
        sectors = np.arange(offset // SECTOR, (offset + n - 1) // SECTOR + 1, dtype=np.int64)
        c = self.counter
        c.count(c.weight * n, kind)
        c.record(np.unique((np.int64(self.region[buf]) << 40) | sectors), kind)

    def steps(self, r: range):
        """The loop over ``r`` (tile indices), sampled as gpu_traffic samples our kernels' loops."""
        return sampled_loop(self.counter, r)

    def mma(self, flops: float) -> None:
        self.counter.launch.flops += self.counter.weight * flops

    def stream(self, kernel: str, reads: dict[str, float], writes: dict[str, float], flops: float = 0.0) -> None:
        """A launch that moves each of ``reads`` / ``writes`` (``{buffer: bytes}``) once."""
        at = {b: self.spans[b][0] for b in (*reads, *writes)}
        first = {at[b]: float(n) for b, n in reads.items()}
        self.traffic.launches.append(stream_launch(
            kernel, sum(reads.values()), sum(writes.values()), first, {at[b]: self.spans[b][1] for b in at},
            {**first, **{at[b]: float(n) for b, n in writes.items()}}, flops))


# ----------------------------------------------------------------------------------------------------- ATen


def row_fits(C: int, s: int) -> bool:
    """Whether ATen's softmax keeps a row of C elements of s bytes in registers or shared memory."""
    return (C <= 1024 and C * s <= 4096) or C * s < SMEM_PER_BLOCK - 256


def row_warps(C: int, s: int) -> int:
    """Warps of ATen's one-block-per-row softmax kernels: ``SoftMax_getBlockSize`` (16-byte loads, <= 1024)."""
    if C <= 1024:
        return 4
    return max(1, min(1024, 1 << max(0, (max(1, C * s // 16) - 1).bit_length())) // 32)


def softmax(t: Tracer, x: str, y: str, R: int, C: int, s: int, s_out: int, name: str = "softmax") -> None:
    """ATen's softmax / log_softmax forward over R rows of C: one read of a row that fits, else three."""
    def program(r, _y, _z):
        for _ in range(1 if row_fits(C, s) else 3):
            t.tile(x, r, 1, C * s)
        t.tile(y, r, 1, C * s_out, STORE)
    t.launch(f"aten.{name}", (R,), row_warps(C, s), program)


def softmax_backward(t: Tracer, g: str, y: str, gi: str, R: int, C: int, s: int, log: bool) -> None:
    """ATen's softmax / log_softmax backward; for softmax ``softmax_backward_cuda_out`` first writes
    ``grad * output``, which the row kernel reads (twice where the row does not fit)."""
    if not log:
        tmp = t.buffer(f"{g}.times_output", R * C * s)
        t.stream("aten.mul", {g: R * C * s, y: R * C * s}, {tmp: R * C * s})
        g = tmp

    def program(r, _y, _z):
        for _ in range(1 if row_fits(C, s) else 2):
            t.tile(g, r, 1, C * s)
        t.tile(y, r, 1, C * s)
        t.tile(gi, r, 1, C * s, STORE)
    t.launch(f"aten.{'log_' if log else ''}softmax_backward", (R,), row_warps(C, s), program)


def topk(t: Tracer, x: str, R: int, C: int, s: int, k: int) -> None:
    """``torch.topk(x, k)`` along rows (sorted values and int64 indices): TensorTopK.cu's multi-block radix select
    (three launches per 8-bit digit, two cub scans by key, a gather) or one block per row."""
    vals, idx = t.buffer(f"{x}.topk_values", R * k * s), t.buffer(f"{x}.topk_indices", R * k * 8)
    multiblock = (R <= 20 and C >= 20000) or (20 < R <= 40 and C >= 10000) or (40 < R <= 80 and C >= 8000) or \
        (80 < R < 200 and C >= 5000) or (200 <= R < 800 and C >= 3000) or (800 <= R <= 4000 and C >= 800) or \
        (R > 4000 and C >= 400)
    if multiblock:
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
        def program(r, _y, _z):
            for _ in range(s + 1):
                t.tile(x, r, 1, C * s)
            t.tile(vals, r, 1, k * s, STORE)
            t.tile(idx, r, 1, k * 8, STORE)
        t.launch("aten.sbtopk", (R,), max(1, min(32, math.ceil(C / 32))), program)
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
    """``c = A @ B`` (M x N, K deep; ``batch`` of them): A and B read once, C written once, 2 M N K FLOPs, as
    gpu_traffic charges the matmuls our launchers run (cuBLAS's tiling is not public)."""
    t.stream(f"cublas.{name}", {a: batch * M * K * s, b: batch * N * K * s}, {c: batch * M * N * s},
             flops=2.0 * batch * M * N * K)


# ------------------------------------------------------------------------------------------------ attention


def sdpa_forward(t: Tracer, B: int, Hq: int, Hkv: int, L: int, S: int, E: int, Ev: int, s: int, causal: bool,
                 padded: bool = False) -> None:
    """FlashAttention-2's forward (128 x 64 tiles, key blocks from the last down); with a (B, 1, 1, S) bool mask
    (non-causal MHA), the memory-efficient kernel on the mask made a float bias (32 x 128 tiles at head dim 128)."""
    q, k, v = t.buffer("q", B * Hq * L * E * s), t.buffer("k", B * Hkv * S * E * s), t.buffer("v", B * Hkv * S * Ev * s)
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
        for ni in t.steps(range(n) if padded else range(n - 1, -1, -1)):
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
    """FlashAttention-2's backward: the ``rowsum(dO * O)`` pre-pass (64 rows, 8 warps) zeroing dQ, key blocks of
    128 over 64-row query tiles from the last down with dQ by fp32 atomics, dQ's cast, dK / dV summed under GQA."""
    q, k, v = t.buffer("q", B * Hq * L * E * s), t.buffer("k", B * Hkv * S * E * s), t.buffer("v", B * Hkv * S * Ev * s)
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
        for mi in t.steps(range(last, first - 1, -1)):
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


def written_out_attention(t: Tracer, B: int, Hq: int, Hkv: int, L: int, S: int, E: int, Ev: int, s: int,
                          passes: int, causal: bool) -> None:
    """A normalizer torch has no kernel for, in eager ops: ``repeat_kv``, ``q @ k^T``, ``.float()``, the causal
    fill, ``passes`` reads of the fp32 scores (a lower bound), ``.to(dtype)``, ``@ v``."""
    q, k, v = t.buffer("q", B * Hq * L * E * s), t.buffer("k", B * Hkv * S * E * s), t.buffer("v", B * Hkv * S * Ev * s)
    n = B * Hq * L * S
    if Hq != Hkv:
        k_rep, v_rep = t.buffer("k_rep", B * Hq * S * E * s), t.buffer("v_rep", B * Hq * S * Ev * s)
        t.stream("aten.repeat_kv", {k: B * Hkv * S * E * s}, {k_rep: B * Hq * S * E * s})
        t.stream("aten.repeat_kv", {v: B * Hkv * S * Ev * s}, {v_rep: B * Hq * S * Ev * s})
        k, v = k_rep, v_rep
    scores, s32, p = t.buffer("scores", n * s), t.buffer("scores_fp32", n * 4), t.buffer("weights", n * s)
    gemm(t, "q_kT", L, S, E, q, k, scores, s, batch=B * Hq)
    t.stream("aten._to_copy", {scores: n * s}, {s32: n * 4})
    if causal:
        t.stream("aten.masked_fill", {s32: n * 4}, {s32: n * 4})
    for _ in range(passes):
        t.stream("aten.normalizer_pass", {s32: n * 4}, {})
    t.stream("aten._to_copy", {s32: n * 4}, {p: n * s})
    gemm(t, "p_v", L, Ev, S, p, v, t.buffer("o", B * Hq * L * Ev * s), s, batch=B * Hq)


# ------------------------------------------------------------------------------------------- cross-entropy


def hf_cross_entropy(t: Tracer, N: int, V: int, s: int, backward: bool) -> None:
    """``F.cross_entropy(logits.float(), y)`` on 16-bit logits; with ``backward`` its backward alone: the N x V
    gradient zeroed and scattered, the log_softmax backward, the cast back."""
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
    """``F.cross_entropy((x @ W^T).float(), y)``: the forward, and its backward through to ``dx = G @ W`` and
    ``dW = G^T @ x``."""
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
    """transformers' warpers, softmax and ``multinomial(probs, 1)`` on ``(B, V)`` fp32 scores as eager runs them:
    each elementwise op one launch; ``torch.sort`` a radix sort of 4 passes over the fp32 keys and int64 values."""
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
    t.stream("aten.aminmax", {probs: n * 4}, {small: 8})
    for op in ("aten.ge", "aten.lt", "aten.bitwise_and", "aten._assert_async"):
        t.stream(op, {small: 8}, {small: 1})
    t.stream("aten.sum", {probs: n * 4}, {small: B * 4})
    for op in ("aten.eq", "aten.any", "aten.bitwise_not", "aten._assert_async"):
        t.stream(op, {small: B * 4}, {small: 1})
    t.stream("aten.exponential_", {}, {q: n * 4})
    t.stream("aten.div", {probs: n * 4, q: n * 4}, {q: n * 4})
    t.stream("aten.argmax", {q: n * 4}, {tokens: B * 8})
