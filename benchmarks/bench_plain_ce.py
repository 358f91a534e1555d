#!/usr/bin/env python
"""Plain cross-entropy on given logits, forward + backward (``F.cross_entropy(z, y)``, z (N, V) fp32, 10% of the
targets -100), under eager, Inductor, smx (default: the site kept for Inductor) and smx-rewrite (the online CE op):
the measurement behind the CPU policy of the ``cross_entropy`` rewrite kind.

  python benchmarks/bench_plain_ce.py [--rounds 5]   # N x V in (8192 x 32000, 4096 x 128256, 16384 x 1000)
"""

import sys

import torch
import torch.nn.functional as F

import matrix
from matrix import Built, Case

CASES = [Case("cross_entropy", "ce", s, passes=("train",), quick=s == "16384x1000")
         for s in ("8192x32000", "4096x128256", "16384x1000")]


def f(z, y):
    return F.cross_entropy(z, y)


def build(c: Case, device: str) -> Built:
    n, v = c.dims
    gen = torch.Generator().manual_seed(0)
    z, y = torch.randn(n, v, generator=gen), torch.randint(0, v, (n,), generator=gen)
    y[::10] = -100
    return Built(f, [z.to(device), y.to(device)])


if __name__ == "__main__":
    sys.exit(matrix.main(__doc__, CASES, build, {"cross_entropy": "cross_entropy: F.cross_entropy(z, y), N x V"}))
