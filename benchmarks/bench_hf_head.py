#!/usr/bin/env python
"""An HF-shaped LM head (the logits returned, the loss on logits.float()), forward + backward, under eager, Inductor
and smx (default options): N=1024 tokens, D=256, V=16384 (the demo's head).

  python benchmarks/bench_hf_head.py [--rounds 5] [--markdown]
"""

import sys

import torch
import torch.nn.functional as F

import matrix
from matrix import Built, Case


def head(h, W, y):
    logits = F.linear(h, W)
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), y), logits


def build(c: Case, device: str) -> Built:
    n, d, v = c.dims
    gen = torch.Generator().manual_seed(0)
    h, w = torch.randn(n, d, generator=gen), torch.randn(v, d, generator=gen) * 0.05
    return Built(head, [h.to(device), w.to(device), torch.randint(0, v, (n,), generator=gen).to(device)], (0, 1))


if __name__ == "__main__":
    sys.exit(matrix.main(__doc__, [Case("hf_head", "linear + ce", "1024x256x16384", passes=("train",), quick=True)],
                         build, {"hf_head": "F.cross_entropy(F.linear(h, W).float(), y), logits returned, N x D x V"},
                         backends=("eager", "inductor", "smx")))
