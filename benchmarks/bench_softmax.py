#!/usr/bin/env python
"""Softmax, scaled + masked softmax (neighbours), log-softmax and an MLP with nothing to rewrite, forward and
forward + backward, under eager, Inductor, smx and smx-rewrite; CPU, and CUDA when present.

  python benchmarks/bench_softmax.py [--quick] [--device cpu|cuda] [--shapes ...] [--families LIST] [--json PATH]
"""

import sys

import torch
import torch.nn as nn

import matrix
from matrix import Built, Case

SHAPES = ("4096x1024", "256x16384", "64x32000", "16x131072", "8x262144", "12288x256")
CASES = [Case(f, f, s, quick=s in ("4096x1024", "8x262144"))
         for s in SHAPES for f in ("softmax", "neighbours", "log_softmax")]
CASES.append(Case("mlp", "2 blocks", "1024x256", passes=("train",), quick=True))
TITLES = {"softmax": "softmax: torch.softmax(x, -1)",
          "neighbours": "neighbours: torch.softmax(x * 0.125 + mask, -1), mask (1, cols) -inf on the last eighth",
          "log_softmax": "log_softmax: torch.log_softmax(x, -1)",
          "mlp": "nothing matches, smx must equal inductor: 2 x (LayerNorm, Linear 256->1024, GELU, Linear 1024->256) "
                 "+ LayerNorm, 1024 tokens, the gradient to the parameters"}


def f_softmax(x):
    return torch.softmax(x, -1)


def f_neighbours(x, mask):
    return torch.softmax(x * 0.125 + mask, -1)


def f_log_softmax(x):
    return torch.log_softmax(x, -1)


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.ln, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln(x))))


def build(c: Case, device: str) -> Built:
    n, cols = c.dims
    if c.family == "mlp":
        torch.manual_seed(0)
        model = nn.Sequential(Block(cols), Block(cols), nn.LayerNorm(cols)).to(device)

        def step(x):
            return model(x)

        return Built(step, [torch.randn(n, cols, device=device)], (), params=list(model.parameters()))
    x = torch.randn(n, cols, generator=torch.Generator().manual_seed(0)).to(device)
    if c.family != "neighbours":
        return Built(f_softmax if c.family == "softmax" else f_log_softmax, [x])
    mask = torch.zeros(1, cols)
    mask[:, cols - cols // 8:] = float("-inf")
    return Built(f_neighbours, [x, mask.to(device)])


if __name__ == "__main__":
    sys.exit(matrix.main(__doc__, CASES, build, TITLES, min_run_time=0.3))
