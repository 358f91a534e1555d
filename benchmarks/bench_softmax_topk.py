#!/usr/bin/env python
"""Fused softmax + top-k (routers, samplers, argmax, top-1 routers, entries read from the probabilities, a Mixtral
MoE block) under eager, Inductor, smx and smx-rewrite, CPU and CUDA when present; the vocab rows by peak memory too.

  python benchmarks/bench_softmax_topk.py [--quick] [--families router,vocab,...] [--stat min] [--json PATH]
"""

import logging
import sys
import warnings
from typing import Callable

import torch

import matrix
from matrix import DTYPES, Built, Case

TITLES = {
    "router": "router: v, i = topk(softmax(logits.float(), -1), k); v = v / v.sum(-1, keepdim=True)",
    "vocab": "vocab: topk(softmax(logits / 0.7, -1), k)",
    "argmax": "argmax: argmax(softmax(x, -1), -1)",
    "top1": "top1: p = softmax(x, -1); max(p, -1).values[:, None], argmax(p, -1)",
    "entries": "entries: k=2 NLLB-MoE's top-2 gates (p * one_hot(i)).sum(-1); k=1 softmax(x).gather(-1, x.argmin)",
    "moe": "MixtralSparseMoeBlock (hidden 256, intermediate 512, grouped_mm experts), tokens x experts",
}

CASES = [Case("router", f"k={k}", f"{r}x{c}", quick=(c, k) == (64, 2))
         for r, c in ((8192, 8), (8192, 64), (2048, 128)) for k in (1, 2, 8) if k <= c]
CASES += [Case("vocab", f"k={k}", f"{r}x{c}", passes=("infer",), quick=(c, k) == (131072, 50))
          for r, c in ((16, 32000), (4, 131072), (4, 262144)) for k in (1, 2, 8, 50)]
CASES += [Case("vocab", "k=8", "4x131072", passes=("train",)),
          Case("argmax", "argmax", "4x131072", passes=("infer",), quick=True),
          Case("argmax", "argmax", "8192x64", passes=("infer",))]
CASES += [Case("top1", "k=1", f"8192x{c}", dt) for dt, cols in (("fp32", (8, 64)), ("bf16", (8, 32, 64))) for c in cols]
CASES += [Case("entries", "k=2", s) for s in ("8192x8", "8192x64", "2048x128")]
CASES += [Case("entries", "k=1", s, passes=("infer",)) for s in ("16x32000", "4x131072")]
CASES += [Case("moe", "top-2", "2048x8"), Case("moe", "top-2", "2048x64")]


def make_router(k: int) -> Callable:
    def router(logits):
        v, i = torch.topk(torch.softmax(logits.float(), -1), k, -1)
        v = v / v.sum(-1, keepdim=True)
        return v, i

    return router


def make_sampler(k: int) -> Callable:
    def sampler(logits):
        return torch.topk(torch.softmax(logits / 0.7, -1), k)

    return sampler


def argmax_softmax(x):
    return torch.argmax(torch.softmax(x, -1), -1)


def top1_router(x):
    p = torch.softmax(x, -1)
    return torch.max(p, -1).values[:, None], torch.argmax(p, -1)


def top2_gates(x):
    p = torch.softmax(x, -1)
    i1 = torch.argmax(p, -1)
    m1 = torch.nn.functional.one_hot(i1, x.shape[-1])
    m2 = torch.nn.functional.one_hot(torch.argmax(x.masked_fill(m1.bool(), float("-inf")), -1), x.shape[-1])
    return torch.stack([(p * m1).sum(-1), (p * m2).sum(-1)], -1), i1


def entry_at(x):
    i = x.argmin(-1, keepdim=True)
    return torch.softmax(x, -1).gather(-1, i), i


def build_moe(c: Case, device: str) -> Built:
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    tokens, experts = c.dims
    cfg = MixtralConfig(hidden_size=256, intermediate_size=512, num_local_experts=experts, num_experts_per_tok=2,
                        router_jitter_noise=0.0)
    cfg._experts_implementation = "grouped_mm"  # what PreTrainedModel picks (a bare block would warn, loop)
    torch.manual_seed(0)
    blk = MixtralSparseMoeBlock(cfg).to(device)
    with torch.no_grad():
        for p in blk.parameters():
            p.normal_(0.0, 0.05)

    def block(x):
        return blk(x)

    x = torch.randn(1, tokens, 256, generator=torch.Generator().manual_seed(0)).to(device)
    return Built(block, [x], params=list(blk.parameters()))


def build(c: Case, device: str) -> Built:
    if c.family == "moe":
        return build_moe(c, device)
    x = torch.randn(*c.dims, generator=torch.Generator().manual_seed(0)).to(device, DTYPES[c.dtype])
    k = int(c.name[2:]) if c.name.startswith("k=") else 1
    fn = {"router": make_router(k), "vocab": make_sampler(k), "argmax": argmax_softmax, "top1": top1_router,
          "entries": top2_gates if k == 2 else entry_at}[c.family]
    probs = torch.softmax(x / 0.7 if c.family == "vocab" else x.float(), -1)   # what the indices select
    return Built(fn, [x], probs=probs, memory=c.family == "vocab")


if __name__ == "__main__":
    warnings.filterwarnings("ignore", module="transformers")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch._dynamo.config.recompile_limit = 64   # the moe block's functions are shared by every backend
    sys.exit(matrix.main(__doc__, CASES, build, TITLES))
