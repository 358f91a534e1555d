#!/usr/bin/env python
"""Every default decision of the smx backend timed under eager, Inductor and smx (default options), one matrix on
the CPU, and the rows where smx is slower than Inductor beyond the noise. Families: docs/PERFORMANCE.md.

  python benchmarks/bench_defaults.py [--quick] [--families LIST] [--only TEXT] [--json P] [--plot P]
"""

import sys
from typing import Callable

import torch

import matrix
from bench_ce_guard import f_ce
from bench_linear_ce import loss_fn
from bench_quant_softmax import f_qdq
from bench_softmax import f_log_softmax, f_neighbours, f_softmax
from bench_softmax_topk import make_sampler
from matrix import DTYPES, Built, Case

INFER, TRAIN, BOTH = ("infer",), ("train",), ("infer", "train")
#: family, case, dtype, passes, shapes ("*": one of --quick's points)
TABLE = [
    ("softmax", "softmax", "fp32", BOTH, "4096x1024 64x32000* 16x131072"),
    ("softmax", "log_softmax", "fp32", BOTH, "64x32000"),
    ("softmax", "masked", "fp32", BOTH, "4096x1024"),
    ("softmax", "softmax", "bf16", BOTH, "64x32000"),
    ("router", "topk k=2", "fp32", BOTH, "8192x8 8192x64"),
    ("router", "topk+renorm k=2", "fp32", BOTH, "8192x8 8192x64*"),
    ("router", "topk k=8", "fp32", BOTH, "2048x256"),
    ("router", "topk+renorm k=8", "fp32", BOTH, "2048x256"),
    ("router", "topk+renorm k=2", "bf16", BOTH, "8192x64"),
    ("sampler", "topk k=50", "fp32", INFER, "16x32000 16x131072* 4x262144"),
    ("sampler", "topk k=50", "bf16", INFER, "16x32000"),
    ("attention", "causal", "fp32", BOTH, "2x8x128x64 2x8x512x64* 1x8x2048x64"),
    ("attention", "padded", "fp32", BOTH, "2x8x512x64"),
    ("attention", "gqa 8q/2kv", "fp32", BOTH, "2x8x512x64"),
    ("attention", "causal", "bf16", BOTH, "2x8x512x64 1x8x1024x64"),
    ("attention", "causal", "fp16", BOTH, "2x8x512x64"),
    ("score_mod", "silu", "fp32", INFER, "2x8x512x64 1x8x1024x64* 1x8x2048x64"),
    ("score_mod", "gate", "fp32", INFER, "1x8x1024x64"),
    ("score_mod", "silu+pad", "fp32", INFER, "2x8x1024x64"),
    ("linear_ce", "linear+ce", "fp32", BOTH, "1024x256x16384* 1024x256x50257 1024x256x131072"),
    ("linear_ce", "linear+ce", "bf16", BOTH, "128x128x16384"),   # ATen's half-precision matmuls are slow on CPUs
    ("linear_ce", "linear+ce", "fp16", BOTH, "128x128x16384"),   # without native support
    ("linear_ce", "linear+ce", "bf16", TRAIN, "1024x256x16384"),
    ("cross_entropy", "ce", "fp32", BOTH, "1024x32000*"),
    ("cross_entropy", "ce", "bf16", BOTH, "1024x32000"),
    ("quant_softmax", "qdq", "fp32", INFER, "8x12x128x128 64x32000*"),
    ("quant_softmax", "qdq", "bf16", INFER, "64x32000"),
]
CASES = [Case(fam, name, s.rstrip("*"), dtype, passes, quick=s.endswith("*"))
         for fam, name, dtype, passes, shapes in TABLE for s in shapes.split()]
TITLES = {
    "softmax": "softmax: torch.softmax(x, -1) | log_softmax | masked: torch.softmax(x * 0.125 + mask, -1)",
    "router": "router: v, i = torch.topk(torch.softmax(logits, -1), k) [; v = v / v.sum(-1, keepdim=True)]",
    "sampler": "sampler: torch.topk(torch.softmax(logits / 0.7, -1), 50)",
    "attention": "attention: softmax(q @ k^T * D**-0.5, causal masked_fill [+ pad mask]) @ v, B x H x T x D",
    "score_mod": "score_mod: softmax(f(q @ k^T * D**-0.5)) @ v, f pointwise, B x H x T x D",
    "linear_ce": "linear_ce: F.cross_entropy(F.linear(x, w), y), N x D x V",
    "cross_entropy": "cross_entropy: F.cross_entropy(logits, y)",
    "quant_softmax": "quant_softmax: dequantize(quantize(softmax(x, -1), 1/255, 0, 0, 255, uint8))",
}


def make_router(k: int, renorm: bool) -> Callable:
    def router(logits):
        v, i = torch.topk(torch.softmax(logits, -1), k)
        if renorm:
            v = v / v.sum(-1, keepdim=True)
        return v, i

    return router


def attn_causal(q, k, v, *pad):
    T, S = q.size(-2), k.size(-2)
    causal = torch.ones(T, S, dtype=torch.bool, device=q.device).tril()
    s = q @ k.transpose(-2, -1) * q.size(-1) ** -0.5
    if pad:  # an additive [B, 1, 1, T] padding mask
        s = s + pad[0]
    s = s.masked_fill(~causal, float("-inf"))
    return torch.softmax(s, -1) @ v


def attn_gqa(q, k, v):
    n = q.size(1) // k.size(1)
    k, v = k.repeat_interleave(n, dim=1), v.repeat_interleave(n, dim=1)
    return attn_causal(q, k, v)


def attn_silu(q, k, v, *side):
    s = q @ k.transpose(-2, -1) * q.size(-1) ** -0.5
    return torch.softmax(s * torch.sigmoid(s) + (side[0] if side else 0.0), -1) @ v


def attn_gate(q, k, v, gate):
    s = q @ k.transpose(-2, -1) * q.size(-1) ** -0.5
    return torch.softmax(s * torch.sigmoid(gate), -1) @ v


ATTENTION = {"padded": attn_causal, "silu": attn_silu, "silu+pad": attn_silu, "gate": attn_gate}


def build(c: Case, device: str) -> Built:
    gen = torch.Generator().manual_seed(0)
    dt, dims = DTYPES[c.dtype], c.dims

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device, dt)

    if c.family == "softmax":
        x = rnd(*dims, scale=4.0)
        if c.name == "masked":
            mask = torch.zeros(1, dims[1])
            mask[:, dims[1] - dims[1] // 8:] = float("-inf")
            return Built(f_neighbours, [x, mask.to(device, dt)])
        return Built(f_log_softmax if c.name == "log_softmax" else f_softmax, [x])
    if c.family == "sampler":
        x = rnd(*dims, scale=2.0)
        return Built(make_sampler(50), [x], probs=torch.softmax(x / 0.7, -1))
    if c.family == "router":
        x, k = rnd(*dims, scale=2.0), int(c.name.split("k=")[1])
        return Built(make_router(k, "renorm" in c.name), [x], probs=torch.softmax(x, -1))
    if c.family in ("attention", "score_mod"):
        B, H, T, D = dims
        hkv = 2 if c.name.startswith("gqa") else H
        q, k, v = rnd(B, H, T, D), rnd(B, hkv, T, D), rnd(B, hkv, T, D)
        pad = torch.zeros(B, 1, 1, T)   # an HF-style additive padding mask: the last 64 keys of batch B-1
        pad[-1, :, :, T - 64:] = torch.finfo(torch.float32).min
        side = [rnd(H, T, T)] if c.name == "gate" else [pad.to(device, dt)] if "pad" in c.name else []
        return Built(ATTENTION.get(c.name, attn_gqa if hkv != H else attn_causal), [q, k, v, *side], (0, 1, 2))
    if c.family == "linear_ce":
        N, D, V = dims
        x, w = rnd(N, D), rnd(V, D, scale=D ** -0.5)
        return Built(loss_fn, [x, w, torch.randint(0, V, (N,), generator=gen).to(device)], (0, 1))
    if c.family == "cross_entropy":
        N, V = dims
        return Built(f_ce, [rnd(N, V, scale=2.0), torch.randint(0, V, (N,), generator=gen).to(device)])
    if c.family == "quant_softmax":
        return Built(f_qdq, [rnd(*dims, scale=4.0)])
    raise ValueError(c.family)


if __name__ == "__main__":
    sys.exit(matrix.main(__doc__, CASES, build, TITLES, backends=("eager", "inductor", "smx"), rounds=2, device="cpu"))
