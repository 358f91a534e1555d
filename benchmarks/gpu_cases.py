"""The cases of benchmarks/gpu_model.py and gpu/compare_model.py: each op's Triton launch at a shape, its minimum
bytes (or useful FLOPs) and bound, and torch's own path, traced (gpu_torch_paths.py) and run (on a GPU)."""

from __future__ import annotations

import dataclasses
import unittest.mock
import warnings
from typing import Callable

import torch
import torch.nn.functional as F

import gpu_torch_paths as tp
from gpu_torch_paths import Tracer

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
FA2_BLOCK_M = 128  # FlashAttention-2's query tile (rows): how often it reads K and V
#: cut cross-entropy's FLOPs over torch's (the backward recomputes the logits; precise_grad: G = hi + lo)
LCE_FLOP_BOUND = {"fwd": 1.02, "bwd": 1.52, "precise": 2.52}
#: normalizers torch has no kernel for: fp32 passes over the L x S scores in eager ops, our FLOPs bound, the note
WRITTEN_OUT = {"softpick": (5, 1.15, ""), "sparsemax": (
    12, 13.5, "threshold normalizer: 10 bracketing passes re-read K (inherent: no L x S store)")}


@dataclasses.dataclass
class Case:
    family: str
    kernel: str  # the launcher counted
    name: str
    shape: str
    dtype: str
    make: Callable[[str], dict]  # device -> the inputs
    run: Callable[[dict], object]  # our launcher on the inputs
    bytes_min: float
    torch_what: str  # torch's path on a GPU
    torch_trace: Callable[[Tracer], None]  # its kernels' accesses
    torch_run: Callable[[dict], object] | None = None  # it, on the inputs (timed on a GPU)
    memory_bound: bool = True
    flops_min: float = 0.0  # useful tensor-core FLOPs; 0 for memory-bound ops
    bound: float = 1.0  # the most (loaded + stored) / bytes_min, or flops / flops_min, may be
    note: str = ""
    logits_stored: bool = False  # linear CE: report the bytes the kernels stored
    caps: tuple[int, int] = (0, 0)  # sampling caps (axis, loop) at least this high, for both sides


def one_block(C: int) -> bool:
    """Whether the softmax kernels reduce a row of C columns in one block (one load per element)."""
    return 1 << max(0, (C - 1).bit_length()) <= MAX_FUSED_BLOCK


def short(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "").replace("bfloat16", "bf16").replace("float32", "fp32")


def torch_backward(forward: Callable, names: tuple[str, ...], grad: str | None = None) -> Callable[[dict], object]:
    """``torch_run`` of a backward case: the first call builds ``forward(inputs, *leaves)`` on leaves of the inputs
    ``names``, kept in the inputs; every call runs torch's backward alone through it (the input ``grad`` as dy)."""
    def run(a):
        if "torch_graph" not in a:
            wrt = [a[n].detach().requires_grad_() for n in names]
            a["torch_graph"] = (forward(a, *wrt), wrt, a[grad] if grad else None)
        out, wrt, g = a["torch_graph"]
        return torch.autograd.grad(out, wrt, g, retain_graph=True)
    return run


def softmax_case(R, C, dtype, *, log=False, backward=False) -> Case:
    s, what, n = dtype.itemsize, "log_softmax" if log else "softmax", R * C
    if not backward:
        return Case(
            "softmax", "softmax_forward", f"{what} fwd", f"{R}x{C}", short(dtype),
            make=lambda dev: dict(x=torch.randn(R, C, dtype=dtype, device=dev)),
            run=lambda a: softmax_forward(a["x"], -1, log=log), bytes_min=n * 2 * s, bound=1.0 if one_block(C) else 1.5,
            torch_what=f"ATen {what}: {1 if tp.row_fits(C, s) else 3} read(s) + 1 write",
            torch_trace=lambda t: tp.softmax(t, t.buffer("x", n * s), t.buffer("y", n * s), R, C, s, s, what),
            torch_run=lambda a: (torch.log_softmax if log else torch.softmax)(a["x"], -1))
    backward_data = torch.ops.aten._log_softmax_backward_data if log else torch.ops.aten._softmax_backward_data
    return Case(
        "softmax", "softmax_backward", f"{what} bwd", f"{R}x{C}", short(dtype),
        make=lambda dev: dict(g=torch.randn(R, C, dtype=dtype, device=dev),
                              y=torch.rand(R, C, dtype=dtype, device=dev)),
        run=lambda a: softmax_backward(a["g"], a["y"], -1, log=log), bytes_min=n * 3 * s,
        bound=1.0 if one_block(C) else 5 / 3, torch_what=f"ATen {what} backward",
        torch_trace=lambda t: tp.softmax_backward(
            t, t.buffer("g", n * s), t.buffer("y", n * s), t.buffer("gi", n * s), R, C, s, log),
        torch_run=lambda a: backward_data(a["g"], a["y"], -1, a["y"].dtype))


def torch_topk(x, k, renormalize):
    v, i = torch.softmax(x, -1).topk(k)
    return (v / v.sum(-1, keepdim=True) if renormalize else v), i


def topk_case(R, C, k, *, renormalize=False, backward=False, dtype=torch.float32, label="") -> Case:
    s = dtype.itemsize
    name = "softmax_topk " + ("bwd" if backward else "fwd") + ("+renorm" if renormalize else "")
    name += f" {label}" if label else ""
    if not backward:
        return Case(
            "softmax_topk", "softmax_topk_forward", name, f"{R}x{C} k={k}", short(dtype),
            make=lambda dev: dict(x=torch.randn(R, C, dtype=dtype, device=dev)),
            run=lambda a: softmax_topk_forward(a["x"], k, renormalize=renormalize),
            bytes_min=R * C * s + R * k * (s + 8) + R * 4, bound=1.1,
            torch_what="ATen softmax, then topk" + (", then v / v.sum()" if renormalize else ""),
            torch_trace=lambda t: tp.softmax_topk(t, R, C, k, s, renormalize),
            torch_run=lambda a: torch_topk(a["x"], k, renormalize))

    def make(dev):
        x = torch.randn(R, C, dtype=dtype, device=dev)
        idx = torch.topk(x, k, dim=-1).indices
        return dict(x=x, g=torch.randn(R, k, dtype=dtype, device=dev), v=torch.rand(R, k, dtype=dtype, device=dev),
                    i=idx, logd=torch.zeros(R, device=dev))

    return Case(
        "softmax_topk", "softmax_topk_backward", name, f"{R}x{C} k={k}", short(dtype), make=make,
        run=lambda a: softmax_topk_backward(a["g"], a["v"], a["i"], a["x"], a["logd"], renormalize=renormalize),
        bytes_min=R * C * s * (1 if renormalize else 2) + R * k * (2 * s + 8) + R * 4, bound=1.1,
        torch_what="zeros + scatter of the k gradients, ATen softmax backward",
        torch_trace=lambda t: tp.softmax_topk_backward(t, R, C, k, s, renormalize),
        torch_run=torch_backward(lambda a, x: torch_topk(x, k, renormalize)[0], ("x",), "g"),
        note="renormalized: a zero fill plus the k entries" if renormalize else "")


def torch_quant(x):
    with warnings.catch_warnings():  # quantize_per_tensor is deprecated, and still what torch has
        warnings.simplefilter("ignore")
        return torch.quantize_per_tensor(torch.softmax(x, -1).float(), 1 / 255, 0, torch.quint8)


def quant_case(R, C, dtype) -> Case:
    s = dtype.itemsize
    return Case(
        "quant_softmax", "quant_softmax_forward", "quant_softmax fwd", f"{R}x{C}", f"{short(dtype)}->u8",
        make=lambda dev: dict(x=torch.randn(R, C, dtype=dtype, device=dev)),
        run=lambda a: quant_softmax_forward(a["x"], -1, scale=1 / 255, zero_point=0, dtype=torch.uint8),
        bytes_min=R * C * (s + 1), bound=1.0 if one_block(C) else 1.5,
        torch_what="ATen softmax, then quantize_per_tensor", torch_trace=lambda t: tp.quant_softmax(t, R, C, s),
        torch_run=lambda a: torch_quant(a["x"]))


def fa2_bytes(B, Hq, L, S, E, Ev, s, causal, mask_bytes=0) -> float:
    """FlashAttention-2's forward traffic: Q, O and the statistics once, K and V (and a mask) once per query tile."""
    per_head = L * E * s + L * Ev * s + L * 4
    for start in range(0, L, FA2_BLOCK_M):
        keys = min(S, start + min(FA2_BLOCK_M, L - start)) if causal else S
        per_head += keys * ((E + Ev) * s + mask_bytes)
    return B * Hq * per_head


def fa2_backward_bytes(B, Hq, Hkv, L, S, E, Ev, s, causal) -> float:
    """FlashAttention-2's backward traffic: K, V, dK, dV once; per key tile the visible Q, dO, statistics and dQ."""
    kv = B * Hkv * S * (E + Ev) * s * 2
    per_head = 0
    for start in range(0, S, FA2_BLOCK_M):
        per_head += max(L - start if causal else L, 0) * (E * s + Ev * s + 8 + E * 8)
    pre = L * (2 * Ev * s + 4) + L * E * (4 + s)
    return kv + B * Hq * (per_head + pre)


def attention_flops(B, Hq, L, S, E, Ev, causal, backward=False) -> float:
    pairs = B * Hq * (sum(min(S, i + 1) for i in range(L)) if causal else L * S)
    return 2.0 * pairs * ((3 * E + 2 * Ev) if backward else (E + Ev))


def attention_case(B, Hq, Hkv, L, E, *, causal=True, padded=False, normalizer="softmax", backward=False,
                   dtype=torch.bfloat16) -> Case:
    """Softmax against SDPA (forward or backward), the other normalizers' forward against eager ops."""
    s, S, Ev = dtype.itemsize, L, E
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
            a.update(out=torch.randn(B, Hq, L, Ev, **f), stats=torch.zeros(B, Hq, L, 2, device=dev),
                     dout=torch.randn(B, Hq, L, Ev, **f))
        return a

    def run(a):
        qkv, rest = (a["q"], a["k"], a["v"]), (causal, E ** -0.5, None, normalizer, None, 0.0, 0)
        if backward:
            return attention_backward(a["dout"], *qkv, a["out"], a["stats"], a["mask"], *rest)
        return attention_forward(*qkv, a["mask"], *rest)

    def sdpa(a, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=None if a["mask"] is None else a["mask"][:, :1, :1],
                                              is_causal=causal, enable_gqa=Hq != Hkv)

    case = Case("attention", "attention_backward" if backward else "attention_forward", name, shape, short(dtype),
                make=make, run=run, bytes_min=fa2_bytes(B, Hq, L, S, E, Ev, s, causal, 1 if padded else 0),
                torch_what="SDPA FlashAttention-2", torch_trace=lambda t: tp.sdpa_forward(
                    t, B, Hq, Hkv, L, S, E, Ev, s, causal, padded),
                torch_run=lambda a: sdpa(a, a["q"], a["k"], a["v"]), memory_bound=False,
                flops_min=attention_flops(B, Hq, L, S, E, Ev, causal, backward), bound=1.15)  # diagonal tiles whole
    if backward:
        case.bytes_min = fa2_backward_bytes(B, Hq, Hkv, L, S, E, Ev, s, causal)
        case.torch_what = "SDPA FlashAttention-2 backward (pre-pass, main, dQ cast)"
        case.torch_trace = lambda t: tp.flash_backward(t, B, Hq, Hkv, L, S, E, Ev, s, causal)
        case.torch_run = torch_backward(sdpa, ("q", "k", "v"), "dout")
        case.caps = (16, 32)
    elif padded:
        case.torch_what = "SDPA memory-efficient attention + bool->float mask"
    elif normalizer != "softmax":
        passes, case.bound, case.note = WRITTEN_OUT[normalizer]
        case.torch_what = f"eager: q @ k^T, mask, {normalizer} ({passes} fp32 passes over L x S), @ v"
        case.torch_trace = lambda t: tp.written_out_attention(t, B, Hq, L, S, E, Ev, s, passes, causal)
        case.torch_run = None
    return case


def ce_inputs(dev, dtype, x_shape, targets, w_rows=0, backward=False) -> dict:
    """``x`` (and ``w`` of ``w_rows`` rows), ``y`` below ``targets``; for a backward, plausible per-row vectors."""
    N = x_shape[0]
    a = dict(x=torch.randn(*x_shape, dtype=dtype, device=dev))
    if w_rows:
        a["w"] = torch.randn(w_rows, x_shape[-1], dtype=dtype, device=dev) * 0.02
    a["y"] = torch.randint(0, targets, (N,), device=dev)
    if backward:
        a.update(lse=torch.randn(N, device=dev) + 10.0, om=torch.rand(N, device=dev), ca=torch.rand(N, device=dev),
                 cb=torch.rand(N, device=dev))
    return a


def lce_loss(a, x, w):
    return F.cross_entropy((x @ w.T).float(), a["y"])


def linear_ce_case(N, D, V, *, backward=False, dtype=torch.bfloat16, shard_of=1, precise=False, kept=None) -> Case:
    """Cut cross-entropy's forward or backward on one of ``shard_of`` vocabulary shards; ``kept``: the backward
    filters (``filter_eps="auto"``), the first ``kept * V`` columns kept (a sampled launch's flags are not the
    kernel's); None: no column filtered."""
    s, Vs = dtype.itemsize, V // shard_of
    label = f" (1 of {shard_of} vocabulary shards)" if shard_of > 1 else ""
    label += ", precise_grad" if precise else ""
    label += f", filtered, {kept:.0%} of columns kept" if kept is not None else ""
    hi = Vs if kept is None else max(1, int(kept * Vs))

    def make(dev):
        a = ce_inputs(dev, dtype, (N, D), hi, Vs, backward)
        if backward:
            a["kept"] = None if kept is None else torch.arange(hi, device=dev)
        return a

    def run(a):
        if not backward:
            return lce_forward(a["x"], a["w"], None, a["y"], ignore_index=-100)
        columns = lambda flags, V: a["kept"] if flags is not None else None  # noqa: E731
        with unittest.mock.patch.object(lce_gemm, "kept_columns", columns):
            return lce_backward(a["x"], a["w"], None, a["y"], a["lse"], a["om"], a["ca"], a["cb"], None,
                                ignore_index=-100, precise_grad=precise, filter_eps=None if kept is None else "auto")

    ops = (N * D + Vs * D) * s
    return Case("linear_ce", "lce_backward" if backward else "lce_forward",
                f"linear CE {'bwd' if backward else 'fwd'}{label}", f"N{N} D{D} V{Vs}", short(dtype),
                make=make, run=run, bytes_min=2 * ops + N * (8 + 16) if backward else ops + N * (8 + 12),
                torch_what="zeros + scatter, log_softmax backward, cast, dE = G @ W, dW = G^T @ E" if backward else
                "logits = x @ W^T, .float(), log_softmax, nll_loss",
                torch_trace=lambda t: tp.hf_linear_cross_entropy(t, N, D, Vs, s, not backward, backward),
                torch_run=torch_backward(lce_loss, ("x", "w")) if backward else lambda a: lce_loss(a, a["x"], a["w"]),
                memory_bound=False, logits_stored=True, flops_min=(4.0 if backward else 2.0) * N * Vs * D,
                bound=LCE_FLOP_BOUND["precise" if precise else "bwd" if backward else "fwd"], note="never stores N x V")


def linear_ce_training_case(N, D, V, *, dtype=torch.bfloat16) -> Case:
    """The training step's loss and gradients in one pass over row chunks (``smx::linear_ce_loss`` on CUDA)."""
    s = dtype.itemsize

    def torch_run(a):
        x, w = (a[n].detach().requires_grad_() for n in ("x", "w"))
        return torch.autograd.grad(lce_loss(a, x, w), (x, w))

    return dataclasses.replace(
        linear_ce_case(N, D, V, dtype=dtype), kernel="lce_fused", name="linear CE fwd+bwd, fused",
        run=lambda a: fused_forward_gemm(a["x"], a["w"], None, a["y"], None, None, -100, "mean", 0.0, 0.0, 1.0, None),
        bytes_min=2 * (N * D + V * D) * s + N * 8, torch_what="the forward's path, then the backward's",
        torch_trace=lambda t: tp.hf_linear_cross_entropy(t, N, D, V, s, True, True), torch_run=torch_run,
        flops_min=6.0 * N * V * D)


def ce_case(N, V, *, backward=False, dtype=torch.bfloat16) -> Case:
    s = dtype.itemsize

    def run(a):
        if backward:
            return ce_backward(a["x"], a["y"], a["lse"], a["om"], a["ca"], a["cb"], None, ignore_index=-100)
        return ce_forward(a["x"], a["y"], ignore_index=-100)

    def loss(a, z):
        return F.cross_entropy(z.float(), a["y"])

    return Case("cross_entropy", "ce_backward" if backward else "ce_forward",
                f"cross_entropy {'bwd' if backward else 'fwd'}", f"{N}x{V}", short(dtype),
                make=lambda dev: ce_inputs(dev, dtype, (N, V), V, backward=backward), run=run,
                bytes_min=N * V * 2 * s + N * 24 if backward else N * V * s + N * 20,
                torch_what="zeros + scatter, log_softmax backward, cast" if backward else
                ".float(), log_softmax, nll_loss", torch_trace=lambda t: tp.hf_cross_entropy(t, N, V, s, backward),
                torch_run=torch_backward(loss, ("x",)) if backward else lambda a: loss(a, a["x"]),
                bound=1.05)  # the split partials and merge


def sample_case(B, V, *, temperature=1.0, top_k=0, top_p=1.0) -> Case:
    """generate's sampling step on ``(B, V)`` fp32 logits ``N(0, 4^2)`` against eager's warpers."""
    label = ", ".join(x for x in (f"T={temperature:g}" if temperature != 1.0 else "", f"top-k {top_k}" if top_k
                                  else "", f"top-p {top_p:g}" if top_p < 1.0 else "") if x)

    def make(dev):
        g = torch.Generator().manual_seed(0)
        return dict(x=(torch.randn(B, V, generator=g) * 4).to(dev), u=torch.rand(B, generator=g).to(dev))

    def run(a):
        u = torch.rand_like(a["u"])  # the uniforms the rewritten graph draws: one launch, counted
        try:
            return sample_triton(a["x"], u, temperature=temperature, top_k=top_k, top_p=top_p, min_p=0.0,
                                 min_tokens_to_keep=1)
        except RuntimeError:  # a sampled launch leaves the skipped rows' tokens unset: its check fails
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

    return Case("sampling", "sample", f"sample {label}", f"{B}x{V}", "fp32", make=make, run=run, bytes_min=B * V * 4,
                torch_what="warpers, softmax, multinomial",
                torch_trace=lambda t: tp.hf_sampling(t, B, V, temperature, top_k, top_p), torch_run=torch_run,
                bound=float("inf"), caps=(0, 1 << 20),
                note="five reads of the row (range, three radix digits, compaction); more when bisection runs")


def all_cases(quick: bool = False) -> list[Case]:
    """Every case (``quick``: one small case per family)."""
    bf, f32 = torch.bfloat16, torch.float32
    if quick:
        return [softmax_case(1024, 4096, bf), topk_case(16, 32768, 50), quant_case(1024, 1024, bf),
                attention_case(1, 4, 4, 1024, 64), linear_ce_case(1024, 512, 8192), ce_case(512, 8192),
                sample_case(8, 32000, top_k=50)]
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
    cases += [linear_ce_case(8192, 4096, 128256, shard_of=8),
              linear_ce_case(8192, 4096, 128256, shard_of=8, backward=True),
              linear_ce_case(4096, 2048, 32000, backward=True, precise=True),
              linear_ce_case(8192, 4096, 128256, backward=True, kept=0.25),
              linear_ce_training_case(4096, 2048, 32000), linear_ce_training_case(8192, 4096, 128256)]
    cases += [ce_case(8192, 128256), ce_case(8192, 128256, backward=True)]
    cases += [sample_case(B, 128256, **o) for B in (1, 64) for o in (
        dict(top_k=50), dict(temperature=0.7, top_k=50, top_p=0.9), dict(top_p=0.9))]
    return cases
