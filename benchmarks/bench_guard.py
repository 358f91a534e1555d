#!/usr/bin/env python
"""What the guard of a recognised-but-kept attention block costs, against the other way to keep Inductor right.

The block ``softmax(q @ k^T / sqrt(E), dim=-2) @ v`` (softmax over the queries) is not attention over the keys;
Inductor's ``fuse_attention`` nevertheless turns it into SDPA over the last dim (pytorch#196468: wrong values in
inference, a crash while building guards in training with torch 2.13). smx skips the block and hands its softmax
to Inductor as ``smx::softmax``, which the pattern matcher cannot take. The alternative is to switch Inductor's
pattern matcher off for the whole graph (``torch._inductor.config.pattern_matcher = False``), which also drops
every other pattern rewrite of that graph.

Variants, one process, side by side (median of --rounds after two warm-up calls):

  eager        the function as written (the reference of the error column)
  inductor     torch.compile(fn): Inductor as is (its error shows the mis-compile)
  inductor-pm0 torch.compile(fn, options={"pattern_matcher": False})
  smx          torch.compile(fn, backend="smx"): the guard

Usage: python benchmarks/bench_guard.py [--batch 4 --heads 8 --seq 256 --dim 64 --rounds 20] [--train]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import smxcompile  # noqa: F401  (registers backend="smx")


def block(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5, dim=-2) @ v


def _time(fn, args, rounds: int, train: bool) -> tuple[float, torch.Tensor]:
    def step():
        out = fn(*args)
        if train:
            out.sum().backward()
        return out

    for _ in range(2):
        out = step()
    ts = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        step()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3, out.detach()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--train", action="store_true", help="forward + backward (Inductor as is crashes: not run)")
    a = p.parse_args(argv)
    g = torch.Generator().manual_seed(0)
    args = [torch.randn(a.batch, a.heads, a.seq, a.dim, generator=g, requires_grad=a.train) for _ in range(3)]
    variants = {
        "eager": lambda: block,
        "inductor": lambda: torch.compile(block),
        "inductor-pm0": lambda: torch.compile(block, options={"pattern_matcher": False}),
        "smx": lambda: torch.compile(block, backend="smx"),
    }
    if a.train:
        del variants["inductor"]
    rows, ref = [], None
    for name, make in variants.items():
        torch._dynamo.reset()
        ms, out = _time(make(), args, a.rounds, a.train)
        ref = out if ref is None else ref
        err = ((out - ref).norm() / ref.norm()).item()
        rows.append((name, ms, err))
    base = rows[0][1]
    print(f"block softmax(dim=-2) B={a.batch} H={a.heads} L={a.seq} E={a.dim} "
          f"{'train' if a.train else 'inference'}, {torch.get_num_threads()} threads")
    print(f"{'variant':14s} {'ms':>9s} {'vs eager':>9s} {'rel. error':>11s}")
    for name, ms, err in rows:
        print(f"{name:14s} {ms:9.3f} {base / ms:8.2f}x {err:11.2e}")


if __name__ == "__main__":
    main()
