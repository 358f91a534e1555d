"""torch's own GPU path for each case of gpu_cases.py, as the access order of its kernels (ATen softmax and topk,
FlashAttention-2, memory-efficient attention, cuBLAS GEMMs, elementwise ops): launch by launch, program by program,
tile by tile, replayed through the same L2 model as our kernels (gpu_traffic.py), FLOPs counted tile by tile as
``tl.dot``'s are. Each trace names its source; what each kernel reads and writes: docs/PERFORMANCE.md ("GPU model").
"""

from __future__ import annotations

import math

import numpy as np

from gpu_sampling import sampled_loop, strata
from gpu_traffic import H200, GPU, SECTOR, Counter, Launch, Regions, Traffic

_KINDS = {"load": 0, "store": 1, "atomic": 2}
#: default shared memory per block on NVIDIA GPUs (what ATen's softmax sizes its one-read path by)
SMEM_PER_BLOCK = 48 * 1024


class Tracer:
    """Launches of torch's kernels, written as access traces, counted into one :class:`gpu_traffic.Traffic` by
    the counter that counts our kernels (the same waves, clock, sampling and L2 replay)."""

    def __init__(self, gpu: GPU = H200, axis_cap: int = 6, loop_cap: int = 8):
        self.counter = Counter(gpu, axis_cap, loop_cap)
        self.gpu = gpu
        self.spans: dict[str, tuple[int, int]] = {}
        self._next = 1 << 32
        self._region: dict[str, int] = {}

    @property
    def traffic(self) -> Traffic:
        return self.counter.traffic

    def buffer(self, name: str, nbytes: float) -> str:
        """A tensor of ``nbytes`` (allocated once per name: later launches reuse it)."""
        if name not in self.spans:
            self.spans[name] = (self._next, int(nbytes))
            self._next += (int(nbytes) // 2**20 + 2) * 2**20
        return name

    def launch(self, kernel: str, grid: tuple, num_warps: int, program) -> None:
        """Run ``program(x, y, z)`` for the sampled programs of ``grid`` (gpu_traffic.strata)."""
        full = tuple(int(g) for g in grid) + (1,) * (3 - len(grid))
        programs = int(np.prod(full))
        lx = Launch(kernel=kernel, grid=tuple(grid), num_warps=num_warps, programs=programs,
                    resident=self.gpu.resident(num_warps, programs))
        names = sorted(self.spans, key=lambda b: self.spans[b][0])
        self._region = {b: i for i, b in enumerate(names)}
        spans = dict(self.spans.values())
        lx.sizes = dict(spans)
        c = self.counter
        c.begin_launch(lx, Regions.from_spans(spans))
        c.traffic.launches.append(lx)
        axes = [strata(n, c.axis_cap) for n in full]
        for x, wx in axes[0]:
            for y, wy in axes[1]:
                for z, wz in axes[2]:
                    c.start_program(wx * wy * wz, (x, y, z), full, (wx, wy, wz))
                    program(x, y, z)
        c.end_launch()
        lx.touched = {k: v for k, v in lx.touched.items() if v > 0}
        lx.first_touch = {k: v for k, v in lx.first_touch.items() if v > 0}
        c.launch, c.regions = None, None

    def tile(self, buf: str, offset: float, row_bytes: float, rows: int = 1, stride: float = 0,
             kind: str = "load") -> None:
        """``rows`` rows of ``row_bytes`` at byte ``offset + r * stride`` of ``buf``, one instruction."""
        start, size = self.spans[buf]
        offset, row_bytes, stride = int(offset), int(row_bytes), int(stride)
        if rows <= 0 or row_bytes <= 0:
            return
        if offset < 0 or offset + (rows - 1) * stride + row_bytes > size:
            raise ValueError(f"a trace read past the end of {buf!r}")
        first = (np.arange(rows, dtype=np.int64) * stride + offset) // SECTOR
        n = (np.arange(rows, dtype=np.int64) * stride + offset + row_bytes - 1) // SECTOR - first + 1
        sectors = np.repeat(first, n) + np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
        c, lx = self.counter, self.counter.launch
        nbytes = c.weight * rows * row_bytes
        if kind != "store":
            lx.bytes_loaded += nbytes
        if kind != "load":
            lx.bytes_stored += nbytes
        if kind == "atomic":
            lx.bytes_atomic += nbytes
        elif kind == "store":
            lx.bytes_written_back += nbytes
        c.record(np.unique((np.int64(self._region[buf]) << 40) | sectors), _KINDS[kind])

    def steps(self, r: range):
        """The loop over ``r`` (tile indices) as a kernel runs it, sampled as gpu_traffic samples our kernels'
        loops (:func:`gpu_sampling.loop_strata`)."""
        return sampled_loop(self.counter, r)

    def mma(self, flops: float) -> None:
        self.counter.launch.flops += self.counter.weight * flops

    def stream(self, kernel: str, reads: dict[str, float], writes: dict[str, float], flops: float = 0.0) -> None:
        """A launch that moves each of ``reads`` / ``writes`` (``{buffer: bytes}``) once."""
        lx = Launch(kernel=kernel, grid=(), num_warps=0, programs=1, resident=1, programs_run=1, flops=flops,
                    bytes_loaded=float(sum(reads.values())), bytes_stored=float(sum(writes.values())),
                    bytes_written_back=float(sum(writes.values())))
        at = {b: self.spans[b][0] for b in (*reads, *writes)}
        lx.first_touch = {at[b]: float(n) for b, n in reads.items()}
        lx.sizes = {at[b]: self.spans[b][1] for b in at}
        lx.touched = {**lx.first_touch, **{at[b]: float(n) for b, n in writes.items()}}
        self.traffic.launches.append(lx)


# ----------------------------------------------------------------------------------------------------- ATen


def softmax_sweeps(C: int, s: int) -> int:
    """Reads of a row by ATen's CUDA softmax forward (rows of C elements of s bytes)."""
    return 1 if (C <= 1024 and C * s <= 4096) or C * s < SMEM_PER_BLOCK - 256 else 3


def _row_warps(C: int, s: int) -> int:
    """Warps of ATen's one-block-per-row softmax kernels: ``SoftMax_getBlockSize`` (16-byte loads, <= 1024)."""
    return max(1, min(1024, 1 << max(0, (max(1, C * s // 16) - 1).bit_length())) // 32)


def softmax(t: Tracer, x: str, y: str, R: int, C: int, s: int, s_out: int, name: str = "softmax") -> None:
    """ATen's softmax / log_softmax forward over R rows of C: ``y`` written (s_out bytes per element)."""
    sweeps = softmax_sweeps(C, s)

    def program(r, _y, _z):
        for _ in range(sweeps):
            t.tile(x, r * C * s, C * s)
        t.tile(y, r * C * s_out, C * s_out, kind="store")
    t.launch(f"aten.{name}", (R,), _row_warps(C, s) if C > 1024 else 4, program)


def softmax_backward(t: Tracer, g: str, y: str, gi: str, R: int, C: int, s: int, log: bool) -> None:
    """ATen's softmax / log_softmax backward: ``gi`` from the gradient ``g`` and the output ``y``. For softmax,
    ``softmax_backward_cuda_out`` (SoftMax.cu) first writes ``tmp = grad * output``, read by the row kernel."""
    if not log:
        tmp = t.buffer(f"{g}.times_output", R * C * s)
        t.stream("aten.mul", {g: R * C * s, y: R * C * s}, {tmp: R * C * s})
        g = tmp
    fits = (C <= 1024 and C * s <= 4096) or C * s < SMEM_PER_BLOCK - 256     # the gradient row cached in smem

    def program(r, _y, _z):
        if not fits:
            t.tile(g, r * C * s, C * s)
        t.tile(g, r * C * s, C * s)
        t.tile(y, r * C * s, C * s)
        t.tile(gi, r * C * s, C * s, kind="store")
    t.launch(f"aten.{'log_' if log else ''}softmax_backward", (R,), _row_warps(C, s) if C > 1024 else 4, program)


def topk(t: Tracer, x: str, R: int, C: int, s: int, k: int) -> None:
    """``torch.topk(x, k)`` along rows (values and int64 indices written, sorted)."""
    vals, idx = t.buffer(f"{x}.topk_values", R * k * s), t.buffer(f"{x}.topk_indices", R * k * 8)
    passes = s            # 8-bit digits
    multiblock = (R <= 20 and C >= 20000) or (20 < R <= 40 and C >= 10000) or (40 < R <= 80 and C >= 8000) or \
        (80 < R < 200 and C >= 5000) or (200 <= R < 800 and C >= 3000) or (800 <= R <= 4000 and C >= 800) or \
        (R > 4000 and C >= 400)
    if multiblock:
        # TensorTopK.cu (mbtopk): three launches per 8-bit digit, then two cub scans by key of two launches each
        small = t.buffer(f"{x}.topk_counts", R * 256 * 4)
        for step in ("fill", "memset", "memset"):
            t.stream(f"aten.topk_{step}", {}, {small: R * 8})
        for _ in range(passes):
            t.stream("aten.computeBlockDigitCounts", {x: R * C * s}, {small: R * 256 * 2})
            t.stream("aten.computeDigitCumSum", {small: R * 256 * 2}, {small: R * 256 * 4})
            t.stream("aten.computeBlockwiseWithinKCounts", {small: R * 256 * 4}, {small: R * 16})
        t.stream("aten.computeBlockwiseKthCounts", {small: R * 256 * 2}, {small: R * 8})
        for step in ("scan_by_key_init", "scan_by_key") * 2:
            t.stream(f"cub.{step}", {small: R * 8} if step == "scan_by_key" else {}, {small: R * 8})
        t.stream("aten.gatherTopK", {x: R * C * s, small: R * 16}, {vals: R * k * s, idx: R * k * 8})
    else:
        def program(r, _y, _z):
            for _ in range(passes + 1):
                t.tile(x, r * C * s, C * s)
            t.tile(vals, r * k * s, k * s, kind="store")
            t.tile(idx, r * k * 8, k * 8, kind="store")
        t.launch("aten.sbtopk", (R,), max(1, min(32, math.ceil(C / 32))), program)
    if k > 1:
        t.stream("aten.sortKeyValueInplace", {vals: R * k * s, idx: R * k * 8}, {vals: R * k * s, idx: R * k * 8})


def gemm(t: Tracer, name: str, M: int, N: int, K: int, a: str, b: str, c: str, s: int, c_bytes: int,
         batch: int = 1) -> None:
    """``c = A @ B`` (M x N, K deep; ``batch`` of them): A and B read once, C written once, 2 M N K FLOPs, as
    gpu_traffic charges the matmuls our launchers run (cuBLAS's tiling is not public)."""
    t.stream(f"cublas.{name}", {a: batch * M * K * s, b: batch * N * K * s}, {c: batch * M * N * c_bytes},
             flops=2.0 * batch * M * N * K)


# ------------------------------------------------------------------------------------------------ attention


def _visible(m0: int, rows: int, S: int, causal: bool) -> int:
    """Keys a query tile starting at row m0 sees (causal: top-left, key j <= query i)."""
    return min(S, m0 + rows) if causal else S


def flash_forward(t: Tracer, B: int, Hq: int, Hkv: int, L: int, S: int, E: int, Ev: int, s: int,
                  causal: bool) -> None:
    q, k, v = t.buffer("q", B * Hq * L * E * s), t.buffer("k", B * Hkv * S * E * s), t.buffer("v", B * Hkv * S * Ev * s)
    o, lse = t.buffer("o", B * Hq * L * Ev * s), t.buffer("lse", B * Hq * L * 4)
    BM, BN = 128, 64

    def program(mi, bi, h):
        m0, rows = mi * BM, min(BM, L - mi * BM)
        head, kvh = bi * Hq + h, bi * Hkv + h // (Hq // Hkv)
        t.tile(q, (head * L + m0) * E * s, rows * E * s)
        n = math.ceil(_visible(m0, rows, S, causal) / BN)
        for ni in t.steps(range(n - 1, -1, -1)):     # flash_fwd_kernel.h walks the key blocks from the last down
            keys = min(BN, S - ni * BN)
            t.tile(k, (kvh * S + ni * BN) * E * s, keys * E * s)
            t.tile(v, (kvh * S + ni * BN) * Ev * s, keys * Ev * s)
            t.mma(2.0 * rows * keys * (E + Ev))
        t.tile(o, (head * L + m0) * Ev * s, rows * Ev * s, kind="store")
        t.tile(lse, (head * L + m0) * 4, rows * 4, kind="store")
    t.launch("flash_fwd_kernel", (math.ceil(L / BM), B, Hq), 4, program)


def mem_efficient_forward(t: Tracer, B: int, H: int, L: int, S: int, E: int, Ev: int, s: int) -> None:
    """xformers' kernel with a (B, 1, 1, S) bool mask, made a float one first."""
    q, k, v = t.buffer("q", B * H * L * E * s), t.buffer("k", B * H * S * E * s), t.buffer("v", B * H * S * Ev * s)
    o, lse = t.buffer("o", B * H * L * Ev * s), t.buffer("lse", B * H * L * 4)
    mask, bias = t.buffer("mask", B * S), t.buffer("bias", B * S * s)
    t.stream("aten.where", {mask: B * S}, {bias: B * S * s})
    BM, BN = (64, 64) if E <= 64 else (32, 128)

    def program(mi, h, bi):
        m0, rows = mi * BM, min(BM, L - mi * BM)
        head = bi * H + h
        t.tile(q, (head * L + m0) * E * s, rows * E * s)
        for ni in t.steps(range(math.ceil(S / BN))):
            keys = min(BN, S - ni * BN)
            t.tile(k, (head * S + ni * BN) * E * s, keys * E * s)
            t.tile(v, (head * S + ni * BN) * Ev * s, keys * Ev * s)
            t.tile(bias, (bi * S + ni * BN) * s, keys * s)       # one row for every query (stride 0)
            t.mma(2.0 * rows * keys * (E + Ev))
        t.tile(o, (head * L + m0) * Ev * s, rows * Ev * s, kind="store")
        t.tile(lse, (head * L + m0) * 4, rows * 4, kind="store")
    t.launch("fmha_cutlassF", (math.ceil(L / BM), H, B), 4, program)


def flash_backward(t: Tracer, B: int, Hq: int, Hkv: int, L: int, S: int, E: int, Ev: int, s: int,
                   causal: bool) -> None:
    q, k, v = t.buffer("q", B * Hq * L * E * s), t.buffer("k", B * Hkv * S * E * s), t.buffer("v", B * Hkv * S * Ev * s)
    o, do, lse = t.buffer("o", B * Hq * L * Ev * s), t.buffer("do", B * Hq * L * Ev * s), t.buffer("lse", B * Hq * L * 4)
    delta, dq_acc = t.buffer("delta", B * Hq * L * 4), t.buffer("dq_accum", B * Hq * L * E * 4)
    dq = t.buffer("dq", B * Hq * L * E * s)
    dk, dv = t.buffer("dk_expanded", B * Hq * S * E * s), t.buffer("dv_expanded", B * Hq * S * Ev * s)
    BM, BN = 64, 128

    def pre(mi, bi, h):     # kBlockM = 64 rows, 8 warps (flash_bwd_launch_template.h)
        m0, rows = mi * BM, min(BM, L - mi * BM)
        head = bi * Hq + h
        t.tile(o, (head * L + m0) * Ev * s, rows * Ev * s)
        t.tile(do, (head * L + m0) * Ev * s, rows * Ev * s)
        t.tile(delta, (head * L + m0) * 4, rows * 4, kind="store")
        t.tile(dq_acc, (head * L + m0) * E * 4, rows * E * 4, kind="store")
    t.launch("flash_bwd_dot_do_o_kernel", (math.ceil(L / BM), B, Hq), 8, pre)

    def program(ni, bi, h):
        n0, keys = ni * BN, min(BN, S - ni * BN)
        head, kvh = bi * Hq + h, bi * Hkv + h // (Hq // Hkv)
        t.tile(k, (kvh * S + n0) * E * s, keys * E * s)
        t.tile(v, (kvh * S + n0) * Ev * s, keys * Ev * s)
        first, last = (n0 // BM if causal else 0), math.ceil(L / BM) - 1
        for mi in t.steps(range(last, first - 1, -1)):     # flash_bwd_kernel.h walks them from the last down
            m0 = mi * BM
            rows = min(BM, L - m0)
            t.tile(q, (head * L + m0) * E * s, rows * E * s)
            t.tile(do, (head * L + m0) * Ev * s, rows * Ev * s)
            t.tile(lse, (head * L + m0) * 4, rows * 4)
            t.tile(delta, (head * L + m0) * 4, rows * 4)
            t.tile(dq_acc, (head * L + m0) * E * 4, rows * E * 4, kind="atomic")
            t.mma(2.0 * rows * keys * (3 * E + 2 * Ev))
        t.tile(dk, (head * S + n0) * E * s, keys * E * s, kind="store")
        t.tile(dv, (head * S + n0) * Ev * s, keys * Ev * s, kind="store")
    t.launch("flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel", (math.ceil(S / BN), B, Hq), 8, program)
    t.stream("flash_bwd_convert_dq_kernel", {dq_acc: B * Hq * L * E * 4}, {dq: B * Hq * L * E * s})
    if Hq != Hkv:     # dK, dV per query head, summed per kv head
        dk_kv, dv_kv = t.buffer("dk", B * Hkv * S * E * s), t.buffer("dv", B * Hkv * S * Ev * s)
        t.stream("aten.sum", {dk: B * Hq * S * E * s}, {dk_kv: B * Hkv * S * E * s})
        t.stream("aten.sum", {dv: B * Hq * S * Ev * s}, {dv_kv: B * Hkv * S * Ev * s})


def written_out_attention(t: Tracer, B: int, Hq: int, Hkv: int, L: int, S: int, E: int, Ev: int, s: int,
                          passes: int, causal: bool) -> None:
    """A normalizer torch has no kernel for, in eager ops: K / V repeated per query head (Hugging Face's
    ``repeat_kv``), ``q @ k^T``, ``.float()``, the causal fill, the normalizer's ``passes`` over the fp32 scores
    (counted as reads only: a lower bound), ``.to(dtype)``, ``@ v``."""
    q, k, v = t.buffer("q", B * Hq * L * E * s), t.buffer("k", B * Hkv * S * E * s), t.buffer("v", B * Hkv * S * Ev * s)
    n = B * Hq * L * S
    if Hq != Hkv:
        k_rep, v_rep = t.buffer("k_rep", B * Hq * S * E * s), t.buffer("v_rep", B * Hq * S * Ev * s)
        t.stream("aten.repeat_kv", {k: B * Hkv * S * E * s}, {k_rep: B * Hq * S * E * s})
        t.stream("aten.repeat_kv", {v: B * Hkv * S * Ev * s}, {v_rep: B * Hq * S * Ev * s})
        k, v = k_rep, v_rep
    scores, s32, p = t.buffer("scores", n * s), t.buffer("scores_fp32", n * 4), t.buffer("weights", n * s)
    gemm(t, "q_kT", L, S, E, q, k, scores, s, s, batch=B * Hq)
    t.stream("aten._to_copy", {scores: n * s}, {s32: n * 4})
    if causal:
        t.stream("aten.masked_fill", {s32: n * 4}, {s32: n * 4})
    for _ in range(passes):
        t.stream("aten.normalizer_pass", {s32: n * 4}, {})
    t.stream("aten._to_copy", {s32: n * 4}, {p: n * s})
    gemm(t, "p_v", L, Ev, S, p, v, t.buffer("o", B * Hq * L * Ev * s), s, s, batch=B * Hq)


# ------------------------------------------------------------------------------------------- cross-entropy


def hf_cross_entropy(t: Tracer, N: int, V: int, s: int, logits: str, backward: bool) -> None:
    """``F.cross_entropy(logits.float(), y)`` (Hugging Face's loss) on given bf16 logits; with ``backward``,
    its backward alone: the N x V gradient zeroed and scattered, the log_softmax backward, the cast back."""
    nv = N * V
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


def hf_linear_cross_entropy(t: Tracer, N: int, D: int, V: int, s: int, backward: bool) -> None:
    """``F.cross_entropy((x @ W^T).float(), y)``; with ``backward`` its backward alone, through to ``dx = G @ W``
    and ``dW = G^T @ x``."""
    x, w, logits = t.buffer("x", N * D * s), t.buffer("w", V * D * s), t.buffer("logits", N * V * s)
    if not backward:
        gemm(t, "logits", N, V, D, x, w, logits, s, s)
    hf_cross_entropy(t, N, V, s, logits, backward)
    if backward:
        gl = t.buffer("grad_logits", N * V * s)
        gemm(t, "grad_x", N, D, V, gl, w, t.buffer("grad_x", N * D * s), s, s)
        gemm(t, "grad_w", V, D, N, gl, x, t.buffer("grad_w", V * D * s), s, s)


def hf_sampling(t: Tracer, B: int, V: int, *, temperature: float, top_k: int, top_p: float) -> None:
    """transformers' warpers, ``softmax`` and ``multinomial(probs, 1)`` on ``(B, V)`` fp32 scores as eager runs
    them: each elementwise op one launch reading its inputs and writing its output; ``torch.sort`` a segmented
    radix sort (cub: 4 passes of 8-bit digits, each reading and writing the fp32 keys and int64 values);
    ATen's one-sample multinomial (:func:`multinomial_one`)."""
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
        for _ in range(4):
            t.stream("cub.radix_sort_pass", {cur if _ == 0 else keys: n * 4, vals: n * 8}, {keys: n * 4, vals: n * 8})
        sp, cs, rm, rm2 = (t.buffer("sorted_p", n * 4), t.buffer("cumsum", n * 4), t.buffer("remove_sorted", n),
                           t.buffer("remove", n))
        softmax(t, keys, sp, B, V, 4, 4)
        t.stream("aten.cumsum", {sp: n * 4}, {cs: n * 4})
        t.stream("aten.le", {cs: n * 4}, {rm: n})
        t.stream("aten.scatter", {rm: n, vals: n * 8}, {rm2: n})
        out = t.buffer("filled_p", n * 4)
        t.stream("aten.masked_fill", {cur: n * 4, rm2: n}, {out: n * 4})
        cur = out
    probs, tokens = t.buffer("probs", n * 4), t.buffer("tokens", B * 8)
    softmax(t, cur, probs, B, V, 4, 4)
    multinomial_one(t, probs, tokens, B, V)


def multinomial_one(t: Tracer, probs: str, tokens: str, B: int, V: int) -> None:
    """``torch.multinomial(probs, 1)`` on ``(B, V)`` fp32: ATen's one-sample path (native/Distributions.cpp,
    ``multinomial_out``; torch 2.13's profiler lists these ops on CPU): ``aminmax`` and a row sum, each checked by
    ``_assert_async``, then ``argmax(probs / q)`` with ``q ~ Exponential(1)`` written at the probabilities' size."""
    n = B * V
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


__all__ = ["Tracer", "softmax_sweeps", "softmax", "softmax_backward", "topk", "gemm", "flash_forward",
           "mem_efficient_forward", "flash_backward", "written_out_attention", "hf_cross_entropy",
           "hf_linear_cross_entropy", "hf_sampling", "multinomial_one"]
