#!/usr/bin/env python
"""Cross-entropy and a guard, three families, each under its own backends:

- cross_entropy: plain ``F.cross_entropy(z, y)`` (z (N, V) fp32, 10% of the targets -100), forward + backward, under
  eager, Inductor, smx and smx-rewrite: the CPU policy of the ``cross_entropy`` kind;
- hf_head: an HF-shaped LM head (logits returned, the loss on logits.float()), forward + backward, under eager,
  Inductor and smx;
- guard: ``softmax(q @ k^T / sqrt(E), dim=-2) @ v``, which Inductor mis-compiles (pytorch#196468: a run with this
  family exits 1), both passes, under eager, Inductor, inductor-pm0 (``pattern_matcher=False``) and smx.

  python benchmarks/bench_ce_guard.py [--families cross_entropy,hf_head,guard] [--rounds 5] [--markdown]
"""

import sys

import torch
import torch.nn.functional as F

import common
import matrix
from common import BACKENDS
from matrix import Built, Case

CASES = [Case("cross_entropy", "ce", s, passes=("train",), quick=s == "16384x1000", backends=BACKENDS)
         for s in ("8192x32000", "4096x128256", "16384x1000")]
CASES += [Case("hf_head", "linear + ce", "1024x256x16384", passes=("train",), quick=True,
               backends=("eager", "inductor", "smx")),
          Case("guard", "softmax(dim=-2)", "4x8x256x64", quick=True,
               backends=("eager", "inductor", "inductor-pm0", "smx"))]
TITLES = {"cross_entropy": "cross_entropy: F.cross_entropy(z, y), N x V",
          "hf_head": "F.cross_entropy(F.linear(h, W).float(), y), logits returned, N x D x V",
          "guard": "softmax(q @ k^T / 8, dim=-2) @ v, B x H x L x E"}


def f_ce(z, y):
    return F.cross_entropy(z, y)


def head(h, W, y):
    logits = F.linear(h, W)
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), y), logits


def block(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5, dim=-2) @ v


def build(c: Case, device: str) -> Built:
    gen = torch.Generator().manual_seed(0)
    if c.family == "cross_entropy":
        n, v = c.dims
        z, y = torch.randn(n, v, generator=gen), torch.randint(0, v, (n,), generator=gen)
        y[::10] = -100
        return Built(f_ce, [z.to(device), y.to(device)])
    if c.family == "hf_head":
        n, d, v = c.dims
        h, w = torch.randn(n, d, generator=gen), torch.randn(v, d, generator=gen) * 0.05
        return Built(head, [h.to(device), w.to(device), torch.randint(0, v, (n,), generator=gen).to(device)], (0, 1))
    qkv = [torch.randn(*c.dims, generator=gen).to(device) for _ in range(3)]
    pm0 = torch.compile(common.fresh(block, "pm0"), dynamic=False, options={"pattern_matcher": False})
    return Built(block, qkv, (0, 1, 2), extra={"inductor-pm0": pm0})


if __name__ == "__main__":
    sys.exit(matrix.main(__doc__, CASES, build, TITLES,
                         backends=("eager", "inductor", "inductor-pm0", "smx", "smx-rewrite")))
