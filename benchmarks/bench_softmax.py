#!/usr/bin/env python
"""Softmax, scaled + masked softmax (neighbours) and log-softmax, forward and forward + backward, under eager,
Inductor, smx (default options) and smx-rewrite (every site rewritten); then a LayerNorm MLP with nothing to rewrite,
where smx must equal Inductor. CPU, and CUDA when present. Shapes, columns: benchmarks/README.md.

  python benchmarks/bench_softmax.py [--quick] [--device cpu|cuda] [--shapes ...] [--cases LIST] [--json PATH]
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


def f_softmax(x, mask):
    return torch.softmax(x, -1)


def f_neighbours(x, mask):
    return torch.softmax(x * 0.125 + mask, -1)


def f_log_softmax(x, mask):
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
    mask = torch.zeros(1, cols)
    mask[:, cols - cols // 8:] = float("-inf")
    x = torch.randn(n, cols, generator=torch.Generator().manual_seed(0))
    fn = {"softmax": f_softmax, "neighbours": f_neighbours, "log_softmax": f_log_softmax}[c.family]
    return Built(fn, [x.to(device), mask.to(device)])


if __name__ == "__main__":
    sys.exit(matrix.main(__doc__, CASES, build, TITLES, rounds=3, min_run_time=0.3, family_flag="--cases"))
