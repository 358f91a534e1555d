#!/usr/bin/env python
"""What the guard of a recognised-but-kept attention block costs: ``softmax(q @ k^T / sqrt(E), dim=-2) @ v``, which
Inductor's ``fuse_attention`` mis-compiles (pytorch#196468: inductor's "!", a mismatch with eager), under eager,
inductor, inductor-pm0 (``pattern_matcher=False``) and smx (its softmax handed to Inductor as ``smx::softmax``).

  python benchmarks/bench_guard.py [--rounds 5] [--markdown]
"""

import sys

import torch

import common
import matrix
from matrix import Built, Case


def block(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5, dim=-2) @ v


def build(c: Case, device: str) -> Built:
    g = torch.Generator().manual_seed(0)
    qkv = [torch.randn(*c.dims, generator=g).to(device) for _ in range(3)]
    pm0 = torch.compile(common.fresh(block, "pm0"), dynamic=False, options={"pattern_matcher": False})
    return Built(block, qkv, (0, 1, 2), extra={"inductor-pm0": pm0})


if __name__ == "__main__":
    sys.exit(matrix.main(__doc__, [Case("guard", "softmax(dim=-2)", "4x8x256x64", quick=True)], build,
                         {"guard": "softmax(q @ k^T / 8, dim=-2) @ v, B x H x L x E"},
                         backends=("eager", "inductor", "inductor-pm0", "smx")))
