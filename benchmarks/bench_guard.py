#!/usr/bin/env python
"""What the guard of a recognised-but-kept attention block costs, against switching off Inductor's pattern matcher.

``softmax(q @ k^T / sqrt(E), dim=-2) @ v`` (softmax over the queries) is not attention over the keys, yet Inductor's
``fuse_attention`` makes it SDPA over the last dim (pytorch#196468); smx hands its softmax to Inductor as
``smx::softmax``. Variants, median of --rounds after two warm-up calls: eager (the reference), inductor (its error
shows the mis-compile; not run with --train, where it crashes), inductor-pm0 (``pattern_matcher=False``), smx.

  python benchmarks/bench_guard.py [--batch 4 --heads 8 --seq 256 --dim 64 --rounds 20] [--train]
"""

from __future__ import annotations

import argparse
import importlib
import statistics

import torch

import common


def block(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5, dim=-2) @ v


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default in (("batch", 4), ("heads", 8), ("seq", 256), ("dim", 64), ("rounds", 20)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--train", action="store_true", help="forward + backward (Inductor as is crashes: not run)")
    a = p.parse_args(argv)
    importlib.import_module("smxcompile")  # registers backend="smx"
    g = torch.Generator().manual_seed(0)
    args = [torch.randn(a.batch, a.heads, a.seq, a.dim, generator=g, requires_grad=a.train) for _ in range(3)]
    variants = {"eager": lambda: block, "inductor": lambda: torch.compile(block),
                "inductor-pm0": lambda: torch.compile(block, options={"pattern_matcher": False}),
                "smx": lambda: torch.compile(block, backend="smx")}
    if a.train:
        del variants["inductor"]
    rows, ref = [], None
    for name, make in variants.items():
        torch._dynamo.reset()
        fn, last = make(), []

        def step():
            out = fn(*args)
            if a.train:
                out.sum().backward()
            last[:] = [out.detach()]

        ms = statistics.median(common.time_calls(step, a.rounds, warmup=2)) * 1e3
        ref = last[0] if ref is None else ref
        rows.append((name, ms, ((last[0] - ref).norm() / ref.norm()).item()))
    print(f"block softmax(dim=-2) B={a.batch} H={a.heads} L={a.seq} E={a.dim} "
          f"{'train' if a.train else 'inference'}, {torch.get_num_threads()} threads")
    print(f"{'variant':14s} {'ms':>9s} {'vs eager':>9s} {'rel. error':>11s}")
    for name, ms, err in rows:
        print(f"{name:14s} {ms:9.3f} {rows[0][1] / ms:8.2f}x {err:11.2e}")


if __name__ == "__main__":
    main()
