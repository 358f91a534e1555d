#!/usr/bin/env python
"""Plain cross-entropy on given logits, fwd+bwd: Inductor vs smx's online CE op (``cpu='rewrite'``); the
measurement behind the CPU policy of the ``cross_entropy`` rewrite kind (the site is kept for Inductor).

    python benchmarks/bench_plain_ce.py [--rounds 5]   # N x V in (8192 x 32000, 4096 x 128256, 16384 x 1000)
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

import common
import smxcompile

SHAPES = [(8192, 32000), (4096, 128256), (16384, 1000)]


def f(z, y):
    return F.cross_entropy(z, y)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="timed steps after one warm-up (median reported)")
    args = ap.parse_args(argv)
    print("$ " + common.command_line(argv))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; loss = F.cross_entropy(z, y), z (N, V) "
          "fp32 requiring grad, 10% of targets -100")
    print("| N | V | inductor ms | smx ms | smx / inductor |\n|---|---|---|---|---|")
    torch.manual_seed(0)
    for n, v in SHAPES:
        z, y = torch.randn(n, v, requires_grad=True), torch.randint(0, v, (n,))
        y[::10] = -100
        res = {}
        for name, opts in (("inductor", None), ("smx", {"cpu": "rewrite"})):
            torch._dynamo.reset()
            c = torch.compile(f) if opts is None else torch.compile(f, backend="smx", options=opts)

            def step():
                z.grad = None
                c(z, y).backward()

            times = sorted(common.time_calls(step, args.rounds))
            res[name] = times[len(times) // 2]
            if opts is not None:
                assert smxcompile.last_report().count(kind="cross_entropy", action="rewritten") == 1
        print(f"| {n} | {v} | {res['inductor'] * 1e3:.0f} | {res['smx'] * 1e3:.0f} | "
              f"{res['smx'] / res['inductor']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
