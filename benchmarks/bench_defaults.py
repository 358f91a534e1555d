#!/usr/bin/env python
"""Every default decision of the smx backend (softmax, routers, samplers, attention, score_mod, linear + CE, CE,
quantized softmax) timed under eager, Inductor and smx with default options, one matrix on the CPU; the rows where
smx is slower than Inductor beyond the noise are listed. Families, columns: docs/PERFORMANCE.md ("Never slower").

  python benchmarks/bench_defaults.py [--quick] [--families LIST] [--only TEXT] [--big] [--json P] [--plot P]
"""

import sys
from typing import Callable

import torch
import torch.nn.functional as F

import matrix
from bench_linear_ce import loss_fn
from bench_quant_softmax import f_qdq
from bench_softmax_topk import make_sampler
from matrix import DTYPES, Built, Case


def all_cases() -> list[Case]:
    C = Case
    cs = [C("softmax", "softmax", "4096x1024"), C("softmax", "softmax", "64x32000", quick=True),
          C("softmax", "softmax", "16x131072"), C("softmax", "log_softmax", "64x32000"),
          C("softmax", "masked", "4096x1024"), C("softmax", "softmax", "64x32000", "bf16")]
    for shape, k in (("8192x8", 2), ("8192x64", 2), ("2048x256", 8)):
        for renorm in (False, True):
            cs.append(C("router", f"topk{'+renorm' if renorm else ''} k={k}", shape,
                        quick=renorm and shape == "8192x64"))
    cs.append(C("router", "topk+renorm k=2", "8192x64", "bf16"))
    for shape in ("16x32000", "16x131072", "4x262144"):
        cs.append(C("sampler", "topk k=50", shape, passes=("infer",), quick=shape == "16x131072"))
    cs.append(C("sampler", "topk k=50", "16x32000", "bf16", passes=("infer",)))
    cs += [C("attention", "causal", "2x8x128x64"), C("attention", "causal", "2x8x512x64", quick=True),
           C("attention", "causal", "1x8x2048x64"), C("attention", "causal", "1x8x4096x64", big=True),
           C("attention", "padded", "2x8x512x64"), C("attention", "gqa 8q/2kv", "2x8x512x64"),
           C("attention", "causal", "2x8x512x64", "bf16"), C("attention", "causal", "1x8x1024x64", "bf16"),
           C("attention", "causal", "2x8x512x64", "fp16")]
    cs += [C("score_mod", "silu", "2x8x512x64", passes=("infer",)),
           C("score_mod", "silu", "1x8x1024x64", passes=("infer",), quick=True),
           C("score_mod", "silu", "1x8x2048x64", passes=("infer",)),
           C("score_mod", "gate", "1x8x1024x64", passes=("infer",)),
           C("score_mod", "silu+pad", "2x8x1024x64", passes=("infer",))]
    for v in (16384, 50257, 131072, 262144):
        cs.append(C("linear_ce", "linear+ce", f"1024x256x{v}", quick=v == 16384, big=v == 262144))
    for dtype in ("bf16", "fp16"):   # ATen's half-precision matmuls are slow on CPUs without native support
        cs.append(C("linear_ce", "linear+ce", "128x128x16384", dtype))
    cs.append(C("linear_ce", "linear+ce", "1024x256x16384", "bf16", passes=("train",)))
    cs += [C("cross_entropy", "ce", "1024x32000", quick=True), C("cross_entropy", "ce", "1024x32000", "bf16")]
    cs += [C("quant_softmax", "qdq", "8x12x128x128", passes=("infer",)),
           C("quant_softmax", "qdq", "64x32000", passes=("infer",), quick=True),
           C("quant_softmax", "qdq", "64x32000", "bf16", passes=("infer",))]
    return cs


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


def f_softmax(x):
    return torch.softmax(x, -1)


def f_log_softmax(x):
    return torch.log_softmax(x, -1)


def f_masked(x, mask):
    return torch.softmax(x * 0.125 + mask, -1)


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


def f_ce(logits, y):
    return F.cross_entropy(logits, y)


def build(c: Case, device: str) -> Built:
    gen = torch.Generator().manual_seed(0)
    dt, dims = DTYPES[c.dtype], c.dims

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device, dt)

    def pad_mask(B: int, T: int) -> torch.Tensor:  # HF-style additive padding mask: the last 64 keys of batch B-1
        pad = torch.zeros(B, 1, 1, T)
        pad[-1, :, :, T - 64:] = torch.finfo(torch.float32).min
        return pad.to(device, dt)

    if c.family == "softmax":
        x = rnd(*dims, scale=4.0)
        if c.name == "masked":
            mask = torch.zeros(1, dims[1])
            mask[:, dims[1] - dims[1] // 8:] = float("-inf")
            return Built(f_masked, [x, mask.to(device, dt)])
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
        side = [rnd(H, T, T)] if c.name == "gate" else [pad_mask(B, T)] if "pad" in c.name else []
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
    sys.exit(matrix.main(__doc__, all_cases(), build, TITLES, backends=("eager", "inductor", "smx"), rounds=2,
                         device="cpu", columns={}))
