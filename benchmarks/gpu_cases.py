"""The cases of benchmarks/gpu_model.py: each op's Triton launch at a representative shape, its minimum bytes,
and torch's own path on a GPU by formula.

torch's path (what a user had before smxcompile) is traced kernel by kernel (gpu_torch_paths.py) through the same
L2 model as ours, from the ATen, FlashAttention and cuBLAS kernels each case names.
"""

from __future__ import annotations

import dataclasses
import unittest.mock
import warnings
from typing import Callable

import torch

import gpu_torch_paths as tp_
from gpu_torch_paths import Tracer
from gpu_traffic import SECTOR

from smxcompile.kernels.attention.triton_backward import attention_backward
from smxcompile.kernels.attention.triton_forward import attention_forward
from smxcompile.kernels.cross_entropy.triton_backward import ce_backward, lce_backward
from smxcompile.kernels.cross_entropy.triton_forward import ce_forward, lce_forward
from smxcompile.kernels.cross_entropy import triton_backward_gemm as lce_gemm
from smxcompile.kernels.cross_entropy.triton_fused import fused_forward_gemm
from smxcompile.kernels.quant_softmax.triton_kernels import quant_softmax_forward
from smxcompile.kernels.sampling.triton_kernels import sample_triton
from smxcompile.kernels.softmax.triton_kernels import MAX_FUSED_BLOCK, softmax_backward, softmax_forward
from smxcompile.kernels.softmax_topk.triton_kernels import softmax_topk_backward, softmax_topk_forward

FAMILIES = ("softmax", "softmax_topk", "quant_softmax", "attention", "linear_ce", "cross_entropy", "sampling")
#: FlashAttention-2's query tile (rows), which sets how often it reads K and V
FA2_BLOCK_M = 128


@dataclasses.dataclass
class TorchPath:
    """torch's path on a GPU: what it runs, and the trace of its kernels (gpu_torch_paths.Tracer -> None)."""

    what: str
    trace: Callable[[Tracer], None]


@dataclasses.dataclass
class Case:
    family: str
    kernel: str  # the launcher counted
    name: str
    shape: str
    dtype: str
    make: Callable[[str], dict]  # device -> the inputs
    run: Callable[[dict], object]
    bytes_min: float
    torch: TorchPath
    memory_bound: bool = True
    #: useful tensor-core FLOPs (what torch's path computes); 0 for the memory-bound ops
    flops_min: float = 0.0
    #: the most the case may move (memory-bound: (loaded + stored) / bytes_min) or compute (flops / flops_min)
    #: over its minimum; docs/PERFORMANCE.md ("GPU model") says why each is above 1
    bound: float = 1.0
    note: str = ""
    logits_stored: Callable | None = None  # linear CE: bytes the kernels stored, to compare with N x V
    quick: bool = False
    #: sampling caps (axis, loop) at least this high for both sides: kernels whose tiles other programs re-read
    caps: tuple[int, int] = (0, 0)
    #: torch's path on the same inputs (what TorchPath describes), for timing on a GPU
    torch_run: Callable[[dict], object] | None = None


#: FLOPs over the useful ones: causal attention computes its diagonal tiles whole; sparsemax / entmax15 recompute
#: the scores in every bracketing pass (SPARSE_ITERS = 10, plus the max and the finish)
ATTENTION_FLOP_BOUND = {"softmax": 1.15, "softpick": 1.15, "sparsemax": 13.5, "entmax15": 13.5}
#: cut cross-entropy: the forward is the logits matmul; the backward recomputes it (2 N V D) and does the gradient
#: products (4 N V D; 6 N V D against torch's 4); with precise_grad on G = hi + lo (8 N V D: 10 against 4)
LCE_FLOP_BOUND = {False: 1.02, True: 1.52}
LCE_PRECISE_FLOP_BOUND = 2.52


def _one_block(C: int) -> bool:
    """Whether the softmax kernels reduce a row of C columns in one block (one load per element)."""
    return 1 << max(0, (C - 1).bit_length()) <= MAX_FUSED_BLOCK


def _size(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def _short(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "").replace("bfloat16", "bf16").replace("float32", "fp32")


# ----------------------------------------------------------------------------------------------- torch formulas


def _visible(L: int, S: int, causal: bool, rows: int) -> list[tuple[int, int]]:
    """(query rows, visible keys) per ``rows``-row query tile (causal: top-left, key j <= query i)."""
    out = []
    for start in range(0, L, rows):
        n = min(rows, L - start)
        out.append((n, min(S, start + n) if causal else S))
    return out


def _pairs(L: int, S: int, causal: bool) -> int:
    """Visible (query, key) pairs of one head."""
    if not causal:
        return L * S
    return sum(min(S, i + 1) for i in range(L))


def fa2_bytes(B, Hq, Hkv, L, S, E, Ev, s, causal, mask_bytes=0, block_m=FA2_BLOCK_M) -> float:
    """FlashAttention-2's forward traffic: Q and O once, the row statistics, K and V (and a per-key mask) once per
    query tile of ``block_m`` rows, for every query head."""
    per_head = L * E * s + L * Ev * s + L * 4
    per_head += sum(keys * ((E + Ev) * s + mask_bytes) for _, keys in _visible(L, S, causal, block_m))
    return B * Hq * per_head


def fa2_backward_bytes(B, Hq, Hkv, L, S, E, Ev, s, causal, block_n=FA2_BLOCK_M) -> float:
    """FlashAttention-2's backward traffic: K, V read and dK, dV written once per kv head; per key tile of
    ``block_n``, the visible Q, dO rows, their statistics and dQ (fp32, read and written by atomics); the
    ``rowsum(dO * O)`` pre-pass and dQ's cast."""
    kv = B * Hkv * S * (E + Ev) * s * 2
    per_head = 0
    for start in range(0, S, block_n):
        rows = L - start if causal else L
        per_head += max(rows, 0) * (E * s + Ev * s + 8 + E * 8)
    pre = L * (2 * Ev * s + 4) + L * E * (4 + s)
    return kv + B * Hq * (per_head + pre)


def attention_flops(B, Hq, L, S, E, Ev, causal, backward=False) -> float:
    pairs = B * Hq * _pairs(L, S, causal)
    return 2.0 * pairs * ((3 * E + 2 * Ev) if backward else (E + Ev))


# ------------------------------------------------------------------------------------------------------ cases


def softmax_case(R, C, dtype, *, log=False, backward=False, quick=False) -> Case:
    s = _size(dtype)
    what = "log_softmax" if log else "softmax"
    if not backward:
        sw = tp_.softmax_sweeps(C, s)
        return Case(
            "softmax", "softmax_forward", f"{what} fwd", f"{R}x{C}", _short(dtype),
            make=lambda dev: dict(x=torch.randn(R, C, dtype=dtype, device=dev)),
            run=lambda a: softmax_forward(a["x"], -1, log=log),
            bytes_min=R * C * 2 * s, bound=1.0 if _one_block(C) else 1.5,
            torch=TorchPath(f"ATen {what}: {sw} read(s) + 1 write", lambda t: tp_.softmax(
                t, t.buffer("x", R * C * s), t.buffer("y", R * C * s), R, C, s, s, what)),
            torch_run=lambda a: (torch.log_softmax if log else torch.softmax)(a["x"], -1), quick=quick)
    return Case(
        "softmax", "softmax_backward", f"{what} bwd", f"{R}x{C}", _short(dtype),
        make=lambda dev: dict(g=torch.randn(R, C, dtype=dtype, device=dev), y=torch.rand(R, C, dtype=dtype, device=dev)),
        run=lambda a: softmax_backward(a["g"], a["y"], -1, log=log),
        bytes_min=R * C * 3 * s, bound=1.0 if _one_block(C) else 5 / 3,
        torch=TorchPath(f"ATen {what} backward", lambda t: tp_.softmax_backward(
            t, t.buffer("g", R * C * s), t.buffer("y", R * C * s), t.buffer("gi", R * C * s), R, C, s, log)),
        torch_run=lambda a: (torch.ops.aten._log_softmax_backward_data if log else
                             torch.ops.aten._softmax_backward_data)(a["g"], a["y"], -1, a["y"].dtype),
        quick=quick)


def torch_backward(build: Callable[[dict], tuple]) -> Callable[[dict], object]:
    """``torch_run`` of a backward case: its first call (untimed on a GPU: compare_model's warm-up) runs torch's
    forward, ``build(inputs) -> (output, tensors that need gradients, grad_output or None)``, and keeps the graph in
    the inputs; every call then runs torch's backward alone through it (``retain_graph``)."""
    def run(a):
        if "torch_graph" not in a:
            a["torch_graph"] = build(a)
        out, wrt, grad = a["torch_graph"]
        return torch.autograd.grad(out, wrt, grad, retain_graph=True)
    return run


def _leaves(a: dict, *names: str) -> list[torch.Tensor]:
    return [a[n].detach().requires_grad_() for n in names]


def topk_case(R, C, k, *, renormalize=False, backward=False, dtype=torch.float32, quick=False, label="") -> Case:
    s = _size(dtype)
    tag = ("+renorm" if renormalize else "") + (f" {label}" if label else "")
    if not backward:
        return Case(
            "softmax_topk", "softmax_topk_forward", f"softmax_topk fwd{tag}", f"{R}x{C} k={k}", _short(dtype),
            make=lambda dev: dict(x=torch.randn(R, C, dtype=dtype, device=dev)),
            run=lambda a: softmax_topk_forward(a["x"], k, renormalize=renormalize),
            bytes_min=R * C * s + R * k * (s + 8) + R * 4, bound=1.1,
            torch=TorchPath("ATen softmax, then topk" + (", then v / v.sum()" if renormalize else ""),
                            lambda t: _topk_trace(t, R, C, k, s, renormalize)),
            torch_run=lambda a: _torch_topk(a["x"], k, renormalize), quick=quick)

    def make(dev):
        x = torch.randn(R, C, dtype=dtype, device=dev)
        idx = torch.topk(x, k, dim=-1).indices
        return dict(x=x, g=torch.randn(R, k, dtype=dtype, device=dev), v=torch.rand(R, k, dtype=dtype, device=dev),
                    i=idx, logd=torch.zeros(R, device=dev))

    return Case(
        "softmax_topk", "softmax_topk_backward", f"softmax_topk bwd{tag}", f"{R}x{C} k={k}", _short(dtype),
        make=make,
        run=lambda a: softmax_topk_backward(a["g"], a["v"], a["i"], a["x"], a["logd"], renormalize=renormalize),
        bytes_min=R * C * s * (1 if renormalize else 2) + R * k * (2 * s + 8) + R * 4, bound=1.1,
        torch=TorchPath("zeros + scatter of the k gradients, ATen softmax backward",
                        lambda t: _topk_backward_trace(t, R, C, k, s, renormalize)),
        torch_run=torch_backward(lambda a: (lambda x: (_torch_topk(x, k, renormalize)[0], (x,), a["g"]))(
            *_leaves(a, "x"))),
        note="renormalized: a zero fill plus the k entries" if renormalize else "", quick=quick)


def _topk_trace(t: Tracer, R, C, k, s, renormalize) -> None:
    x, p = t.buffer("x", R * C * s), t.buffer("p", R * C * s)
    tp_.softmax(t, x, p, R, C, s, s)
    tp_.topk(t, p, R, C, s, k)
    if renormalize:
        vals, total = f"{p}.topk_values", t.buffer("sum", R * s)
        t.stream("aten.sum", {vals: R * k * s}, {total: R * s})
        t.stream("aten.div", {vals: R * k * s, total: R * s}, {t.buffer("renormalized", R * k * s): R * k * s})


def _topk_backward_trace(t: Tracer, R, C, k, s, renormalize) -> None:
    """The k gradients (through the renormalization's division) scattered into zeros, the softmax backward."""
    g, gk = t.buffer("g", R * k * s), t.buffer("grad_values", R * k * s)
    if renormalize:     # d(v / sum v): sum(g * v), then g / sum - that * v / sum^2
        v, total = t.buffer("values", R * k * s), t.buffer("sum", R * s)
        t.stream("aten.mul_sum", {g: R * k * s, v: R * k * s}, {total: R * s})
        t.stream("aten.div_sub", {g: R * k * s, v: R * k * s, total: R * s}, {gk: R * k * s})
        g = gk
    dense, y = t.buffer("grad_probs", R * C * s), t.buffer("p", R * C * s)
    t.stream("aten.zeros", {}, {dense: R * C * s})
    t.stream("aten.scatter", {g: R * k * s, t.buffer("indices", R * k * 8): R * k * 8}, {dense: R * k * SECTOR})
    tp_.softmax_backward(t, dense, y, t.buffer("gx", R * C * s), R, C, s, log=False)


def _torch_topk(x, k, renormalize):
    v, i = torch.softmax(x, -1).topk(k)
    return (v / v.sum(-1, keepdim=True) if renormalize else v), i


def _torch_quant(x):
    with warnings.catch_warnings():  # quantize_per_tensor is deprecated, and still what torch has
        warnings.simplefilter("ignore")
        return torch.quantize_per_tensor(torch.softmax(x, -1).float(), 1 / 255, 0, torch.quint8)


def _quant_trace(t: Tracer, R, C, s) -> None:
    x, p, p32 = t.buffer("x", R * C * s), t.buffer("p", R * C * s), t.buffer("p_fp32", R * C * 4)
    tp_.softmax(t, x, p, R, C, s, s)
    if s != 4:
        t.stream("aten._to_copy", {p: R * C * s}, {p32: R * C * 4})
        p = p32
    t.stream("aten.quantize_per_tensor", {p: R * C * 4}, {t.buffer("q", R * C): R * C})


def quant_case(R, C, dtype, quick=False) -> Case:
    s = _size(dtype)
    return Case(
        "quant_softmax", "quant_softmax_forward", "quant_softmax fwd", f"{R}x{C}", f"{_short(dtype)}->u8",
        make=lambda dev: dict(x=torch.randn(R, C, dtype=dtype, device=dev)),
        run=lambda a: quant_softmax_forward(a["x"], -1, scale=1 / 255, zero_point=0, dtype=torch.uint8),
        bytes_min=R * C * (s + 1), bound=1.0 if _one_block(C) else 1.5,
        torch=TorchPath("ATen softmax, then quantize_per_tensor", lambda t: _quant_trace(t, R, C, s)),
        torch_run=lambda a: _torch_quant(a["x"]),
        quick=quick)


def attention_case(B, Hq, Hkv, L, E, *, causal=True, padded=False, normalizer="softmax", backward=False,
                   dtype=torch.bfloat16, quick=False) -> Case:
    s, S, Ev = _size(dtype), L, E
    tags = [t for t, on in (("causal", causal), ("padded", padded), ("GQA", Hq != Hkv)) if on]
    name = f"attention {normalizer} {'bwd' if backward else 'fwd'} " + "+".join(tags)
    shape = f"{B}x{Hq}/{Hkv}x{L}x{E}" if Hq != Hkv else f"{B}x{Hq}x{L}x{E}"

    def make(dev):
        f = dict(dtype=dtype, device=dev)
        a = dict(q=torch.randn(B, Hq, L, E, **f), k=torch.randn(B, Hkv, S, E, **f), v=torch.randn(B, Hkv, S, Ev, **f),
                 mask=None)
        if padded:  # keys past each sequence's length masked, as a (B, 1, 1, S) bool mask expanded
            lens = torch.tensor([S - (S // 4) * (b % 2) for b in range(B)], device=dev)
            a["mask"] = (torch.arange(S, device=dev)[None, :] < lens[:, None])[:, None, None, :].expand(B, Hq, L, S)
        if backward:
            a["out"] = torch.randn(B, Hq, L, Ev, **f)
            a["stats"] = torch.zeros(B, Hq, L, 2, device=dev)
            a["dout"] = torch.randn(B, Hq, L, Ev, **f)
        return a

    def run(a):
        if backward:
            return attention_backward(a["dout"], a["q"], a["k"], a["v"], a["out"], a["stats"], a["mask"], causal,
                                      E ** -0.5, None, normalizer, None, 0.0, 0)
        return attention_forward(a["q"], a["k"], a["v"], a["mask"], causal, E ** -0.5, None, normalizer, None,
                                 0.0, 0)

    def sdpa(q, k, v, mask):
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=None if mask is None else mask[:, :1, :1], is_causal=causal, enable_gqa=Hq != Hkv)

    def sdpa_graph(a):
        wrt = _leaves(a, "q", "k", "v")
        return sdpa(*wrt, a["mask"]), wrt, a["dout"]

    mask_b = 1 if padded else 0
    if backward:
        bmin = fa2_backward_bytes(B, Hq, Hkv, L, S, E, Ev, s, causal)
        tp = TorchPath("SDPA FlashAttention-2 backward (pre-pass, main, dQ cast)",
                       lambda t: tp_.flash_backward(t, B, Hq, Hkv, L, S, E, Ev, s, causal))
        if normalizer != "softmax":
            raise ValueError("the backward cases are softmax only")
    else:
        bmin = fa2_bytes(B, Hq, Hkv, L, S, E, Ev, s, causal, mask_b)
        if normalizer == "softmax" and padded:
            if causal or Hq != Hkv:
                raise ValueError("the padded case is non-causal MHA")
            tp = TorchPath("SDPA memory-efficient attention + bool->float mask",
                           lambda t: tp_.mem_efficient_forward(t, B, Hq, L, S, E, Ev, s))
        elif normalizer == "softmax":
            tp = TorchPath("SDPA FlashAttention-2", lambda t: tp_.flash_forward(t, B, Hq, Hkv, L, S, E, Ev, s, causal))
        else:
            passes = {"softpick": 5, "ssmax": 3, "softmax1": 4, "sigmoid": 2, "relu": 2, "softplus": 2,
                      "sparsemax": 12, "entmax15": 16}[normalizer]
            tp = TorchPath(f"eager: q @ k^T, mask, {normalizer} ({passes} fp32 passes over L x S), @ v",
                           lambda t: tp_.written_out_attention(t, B, Hq, Hkv, L, S, E, Ev, s, passes, causal))
    return Case("attention", "attention_backward" if backward else "attention_forward", name, shape,
                _short(dtype), make=make, run=run, bytes_min=bmin, torch=tp, memory_bound=False,
                flops_min=attention_flops(B, Hq, L, S, E, Ev, causal, backward),
                bound=ATTENTION_FLOP_BOUND.get(normalizer, ATTENTION_FLOP_BOUND["softmax"]),
                torch_run=None if normalizer != "softmax" else torch_backward(sdpa_graph) if backward else
                lambda a: sdpa(a["q"], a["k"], a["v"], a["mask"]),
                note={"sparsemax": "threshold normalizer: 10 bracketing passes re-read K (inherent: no L x S store)",
                      "entmax15": "threshold normalizer: bracketing passes re-read K"}.get(normalizer, ""),
                quick=quick, caps=(16, 32) if backward and not quick else (0, 0))


def _row_vectors(N: int, dev) -> dict:
    """The backward's per-row inputs (lse, other mass, coefficients a and b) with plausible values."""
    return dict(lse=torch.randn(N, device=dev) + 10.0, om=torch.rand(N, device=dev), ca=torch.rand(N, device=dev),
                cb=torch.rand(N, device=dev))


def _stored(tr) -> float:
    return float(sum(x.bytes_stored for x in tr.launches if not x.kernel.startswith("aten.")))


def linear_ce_case(N, D, V, *, backward=False, dtype=torch.bfloat16, shard_of=1, precise=False, kept=None,
                   quick=False) -> Case:
    """``kept``: the backward filters (``filter_eps="auto"``) with this share of the columns kept in every row
    chunk (an assumption: the flags of a sampled launch are not the kernel's, so the kept columns are set to the
    first ``kept * V``); None: exact (``filter_eps=None``, the worst case of the default: no column filters)."""
    s = _size(dtype)
    Vs = V // shard_of
    label = f" (1 of {shard_of} vocabulary shards)" if shard_of > 1 else ""
    label += ", precise_grad" if precise else ""
    label += f", filtered, {kept:.0%} of columns kept" if kept is not None else ""

    def make(dev):
        hi = Vs if kept is None else max(1, int(kept * Vs))
        a = dict(x=torch.randn(N, D, dtype=dtype, device=dev), w=torch.randn(Vs, D, dtype=dtype, device=dev) * 0.02,
                 y=torch.randint(0, hi, (N,), device=dev))
        if backward:
            a.update(_row_vectors(N, dev))
            a["kept"] = None if kept is None else torch.arange(hi, device=dev)
        return a

    def run(a):
        if backward:
            with unittest.mock.patch.object(lce_gemm, "kept_columns",
                                            lambda flags, V: a["kept"] if flags is not None else None):
                return lce_backward(a["x"], a["w"], None, a["y"], a["lse"], a["om"], a["ca"], a["cb"], None,
                                    ignore_index=-100, precise_grad=precise,
                                    filter_eps=None if kept is None else "auto")
        return lce_forward(a["x"], a["w"], None, a["y"], ignore_index=-100)

    ops = (N * D + Vs * D) * s
    bmin = 2 * ops + N * (8 + 16) if backward else ops + N * (8 + 12)
    tp = TorchPath("zeros + scatter, log_softmax backward, cast, dE = G @ W, dW = G^T @ E" if backward else
                   "logits = x @ W^T, .float(), log_softmax, nll_loss",
                   lambda t: tp_.hf_linear_cross_entropy(t, N, D, Vs, s, backward))
    return Case("linear_ce", "lce_backward" if backward else "lce_forward",
                f"linear CE {'bwd' if backward else 'fwd'}{label}", f"N{N} D{D} V{Vs}", _short(dtype),
                make=make, run=run, bytes_min=bmin, torch=tp, memory_bound=False, logits_stored=_stored,
                flops_min=(4.0 if backward else 2.0) * N * Vs * D,
                bound=LCE_PRECISE_FLOP_BOUND if precise else LCE_FLOP_BOUND[backward],
                note="never stores N x V", quick=quick,
                torch_run=torch_backward(lambda a: (lambda x, w: (
                    torch.nn.functional.cross_entropy((x @ w.T).float(), a["y"]), (x, w), None))(*_leaves(a, "x", "w")))
                if backward else lambda a: torch.nn.functional.cross_entropy((a["x"] @ a["w"].T).float(), a["y"]))


def linear_ce_training_case(N, D, V, *, dtype=torch.bfloat16, quick=False) -> Case:
    """The training step's loss and gradients in one pass over row chunks (``smx::linear_ce_loss`` on CUDA: the
    mean loss with gradients), exact (no column filtered: the worst case of the default), against torch's
    forward + backward."""
    s = _size(dtype)

    def make(dev):
        return dict(x=torch.randn(N, D, dtype=dtype, device=dev),
                    w=torch.randn(V, D, dtype=dtype, device=dev) * 0.02, y=torch.randint(0, V, (N,), device=dev))

    def run(a):
        return fused_forward_gemm(a["x"], a["w"], None, a["y"], None, None, -100, "mean", 0.0, 0.0, 1.0, None)

    def torch_trace(t):
        tp_.hf_linear_cross_entropy(t, N, D, V, s, False)
        tp_.hf_linear_cross_entropy(t, N, D, V, s, True)

    def torch_run(a):
        x, w = _leaves(a, "x", "w")
        loss = torch.nn.functional.cross_entropy((x @ w.T).float(), a["y"])
        return torch.autograd.grad(loss, (x, w))

    ops = (N * D + V * D) * s
    return Case("linear_ce", "lce_fused", "linear CE fwd+bwd, fused", f"N{N} D{D} V{V}", _short(dtype),
                make=make, run=run, bytes_min=2 * ops + N * 8,
                torch=TorchPath("the forward's path, then the backward's", torch_trace), memory_bound=False,
                logits_stored=_stored, flops_min=6.0 * N * V * D, bound=LCE_FLOP_BOUND[False],
                note="never stores N x V", quick=quick, torch_run=torch_run)


def ce_case(N, V, *, backward=False, dtype=torch.bfloat16, quick=False) -> Case:
    s = _size(dtype)
    nv = N * V

    def make(dev):
        a = dict(z=torch.randn(N, V, dtype=dtype, device=dev), y=torch.randint(0, V, (N,), device=dev))
        if backward:
            a.update(_row_vectors(N, dev))
        return a

    def run(a):
        if backward:
            return ce_backward(a["z"], a["y"], a["lse"], a["om"], a["ca"], a["cb"], None, ignore_index=-100)
        return ce_forward(a["z"], a["y"], ignore_index=-100)

    bmin = nv * 2 * s + N * 24 if backward else nv * s + N * 20
    tp = TorchPath("zeros + scatter, log_softmax backward, cast" if backward else ".float(), log_softmax, nll_loss",
                   lambda t: tp_.hf_cross_entropy(t, N, V, s, t.buffer("logits", nv * s), backward))
    return Case("cross_entropy", "ce_backward" if backward else "ce_forward",
                f"cross_entropy {'bwd' if backward else 'fwd'}", f"{N}x{V}", _short(dtype), make=make, run=run,
                bytes_min=bmin, torch=tp, quick=quick, bound=1.05,  # the split partials and merge
                torch_run=torch_backward(lambda a: (lambda z: (
                    torch.nn.functional.cross_entropy(z.float(), a["y"]), (z,), None))(*_leaves(a, "z")))
                if backward else lambda a: torch.nn.functional.cross_entropy(a["z"].float(), a["y"]))


def sample_case(B, V, *, temperature=1.0, top_k=0, top_p=1.0, quick=False) -> Case:
    """generate's sampling step on ``(B, V)`` fp32 logits ``N(0, 4^2)`` (smx::sample's kernel, its inner loops
    counted whole: the pass count depends on the values) against eager's chain."""
    label = ", ".join(x for x in (f"T={temperature:g}" if temperature != 1.0 else "", f"top-k {top_k}" if top_k
                                  else "", f"top-p {top_p:g}" if top_p < 1.0 else "") if x)

    def make(dev):
        g = torch.Generator().manual_seed(0)
        return dict(x=(torch.randn(B, V, generator=g) * 4).to(dev), u=torch.rand(B, generator=g).to(dev))

    def run(a):
        u = torch.rand_like(a["u"])   # the uniforms the rewritten graph draws: one launch, counted
        try:
            return sample_triton(a["x"], u, temperature=temperature, top_k=top_k, top_p=top_p, min_p=0.0,
                                 min_tokens_to_keep=1)
        except RuntimeError:   # a sampled launch leaves the skipped rows' tokens unset: its check fails
            return None

    def torch_run(a):
        s = a["x"] / temperature
        if top_k:
            s = s.masked_fill(s < torch.topk(s, top_k)[0][..., -1, None], -float("inf"))
        if top_p < 1.0:
            sv, si = torch.sort(s)
            rm = sv.softmax(-1).cumsum(-1) <= 1 - top_p
            rm[..., -1:] = 0
            s = s.masked_fill(rm.scatter(1, si, rm), -float("inf"))
        return torch.multinomial(torch.softmax(s, -1), 1)

    return Case("sampling", "sample", f"sample {label}", f"{B}x{V}", "fp32", make=make, run=run,
                bytes_min=B * V * 4, quick=quick, bound=float("inf"),
                torch=TorchPath("warpers, softmax, multinomial", lambda t: tp_.hf_sampling(
                    t, B, V, temperature=temperature, top_k=top_k, top_p=top_p)),
                note="five reads of the row (range, three radix digits, compaction); more when bisection runs",
                caps=(0, 1 << 20), torch_run=torch_run)


def all_cases(quick: bool = False) -> list[Case]:
    """Every case (``quick``: one small case per family)."""
    bf, f32 = torch.bfloat16, torch.float32
    if quick:
        return [softmax_case(1024, 4096, bf, quick=True),
                topk_case(16, 32768, 50, quick=True),
                quant_case(1024, 1024, bf, quick=True),
                attention_case(1, 4, 4, 1024, 64, quick=True),
                linear_ce_case(1024, 512, 8192, quick=True),
                ce_case(512, 8192, quick=True),
                sample_case(8, 32000, top_k=50, quick=True)]
    cases = [softmax_case(R, C, bf) for R, C in ((16384, 1024), (4096, 4096), (1024, 16384), (256, 65536),
                                                  (64, 262144))]
    cases += [softmax_case(4096, 4096, f32), softmax_case(256, 65536, f32), softmax_case(1024, 32768, bf, log=True),
              softmax_case(4096, 4096, bf, backward=True), softmax_case(256, 65536, bf, backward=True)]
    cases += [topk_case(16384, 8, 2, label="router"), topk_case(16384, 64, 8, renormalize=True, label="router"),
              topk_case(16384, 256, 8, renormalize=True, label="router"),
              topk_case(64, 32000, 50, label="sampler"), topk_case(64, 131072, 50, label="sampler"),
              topk_case(64, 131072, 50, dtype=bf, label="sampler"),
              topk_case(16384, 64, 8, renormalize=True, backward=True, label="router"),
              topk_case(64, 131072, 50, backward=True, label="sampler")]
    cases += [quant_case(16384, 1024, bf), quant_case(4096, 4096, f32)]
    cases += [attention_case(2, 16, 16, 1024, 128), attention_case(1, 16, 16, 4096, 128),
              attention_case(1, 16, 16, 8192, 128), attention_case(4, 16, 16, 2048, 128, causal=False, padded=True),
              attention_case(1, 32, 8, 4096, 128), attention_case(1, 16, 16, 4096, 128, normalizer="softpick"),
              attention_case(1, 16, 16, 4096, 128, normalizer="sparsemax"),
              attention_case(1, 16, 16, 4096, 128, backward=True), attention_case(1, 32, 8, 4096, 128, backward=True)]
    for N, D, V in ((4096, 2048, 32000), (8192, 4096, 128256), (16384, 4096, 262144)):
        cases += [linear_ce_case(N, D, V), linear_ce_case(N, D, V, backward=True)]
    cases += [linear_ce_case(8192, 4096, 128256, shard_of=8), linear_ce_case(8192, 4096, 128256, shard_of=8,
                                                                             backward=True),
              linear_ce_case(4096, 2048, 32000, backward=True, precise=True),
              linear_ce_case(8192, 4096, 128256, backward=True, kept=0.25),
              linear_ce_training_case(4096, 2048, 32000), linear_ce_training_case(8192, 4096, 128256)]
    cases += [ce_case(8192, 128256), ce_case(8192, 128256, backward=True)]
    cases += [sample_case(B, 128256, **o) for B in (1, 64) for o in (
        dict(top_k=50), dict(temperature=0.7, top_k=50, top_p=0.9), dict(top_p=0.9))]
    return cases
