#!/usr/bin/env python
"""The sampling step of ``generate(do_sample=True)`` (transformers' warpers on ``(B, V)`` fp32 logits N(0, 4^2),
softmax, ``torch.multinomial(probs, 1)``) under eager, Inductor, smx and smx-rewrite (one ``smx::sample``), one
thread; the check: every drawn token has a positive eager probability. CPU, and CUDA when present.

  python benchmarks/bench_sampling.py [--families top_k,... --shapes 1x32000 64x32000 ... --markdown]
"""

import sys

import torch
import torch.nn.functional as F
from transformers.generation.logits_process import (LogitsProcessorList, MinPLogitsWarper, TemperatureLogitsWarper,
                                                    TopKLogitsWarper, TopPLogitsWarper)

import matrix
from matrix import Built, Case

CONFIGS = {
    "top_k": lambda: [TopKLogitsWarper(50)],
    "temperature+top_k+top_p": lambda: [TemperatureLogitsWarper(0.7), TopKLogitsWarper(50), TopPLogitsWarper(0.9)],
    "top_p": lambda: [TopPLogitsWarper(0.9)],
    "min_p": lambda: [MinPLogitsWarper(0.1)],
}
CASES = [Case(c, "sample", f"{b}x{v}", passes=("infer",), quick=c == "top_k" and v == 32000 and b < 256)
         for c in CONFIGS for v in (32000, 128256, 256000) for b in (1, 64, 256)]
TITLES = {c: f"{c}: multinomial(softmax({c}(logits)), 1), B x V" for c in CONFIGS}


def build(c: Case, device: str) -> Built:
    B, V = c.dims
    procs = LogitsProcessorList(CONFIGS[c.family]())

    def step(input_ids, logits):
        return torch.multinomial(F.softmax(procs(input_ids, logits), dim=-1), num_samples=1)

    x = torch.randn(B, V, generator=torch.Generator().manual_seed(0)).to(device) * 4
    ids = torch.zeros(B, 1, dtype=torch.long, device=device)
    probs = F.softmax(procs(ids, x.clone()), -1)   # every drawn token must have a positive eager probability
    return Built(step, [ids, x], (), check=lambda got, ref: (0.0, bool((probs.gather(1, got[0][0]) > 0).all())))


if __name__ == "__main__":
    sys.exit(matrix.main(__doc__, CASES, build, TITLES, rounds=1, min_run_time=0.5, threads=1))
