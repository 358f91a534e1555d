#!/usr/bin/env python
"""The sampling step of ``generate(do_sample=True)``, side by side: eager, Inductor, and the smx backend (which
rewrites it into one ``smx::sample``), on CPU (and CUDA when present).

Each case is transformers' own processors (``TemperatureLogitsWarper``, ``TopKLogitsWarper``,
``TopPLogitsWarper``, ``MinPLogitsWarper``) on ``(B, V)`` fp32 logits, then ``softmax`` and
``torch.multinomial(probs, 1)``. The logits are ``N(0, 4^2)``: at V = 128K a top-p of 0.9 keeps ~800 tokens
and a min-p of 0.1 ~14 (flat random logits would keep most of the vocabulary; a trained model's are peaked).

Columns: ms per call (median of ``torch.utils.benchmark``'s blocked_autorange) and the ratio to Inductor's
time for the same row (below 1: faster). ``ok``: every smx token had a positive eager probability.

  python benchmarks/bench_sampling.py                       # the default grid (~10 min on 2 cores)
  python benchmarks/bench_sampling.py --vocab 32000 --batch 1,64 --configs top_k --markdown
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
import torch.utils.benchmark as benchmark
from transformers.generation.logits_process import (LogitsProcessorList, MinPLogitsWarper, TemperatureLogitsWarper,
                                                    TopKLogitsWarper, TopPLogitsWarper)

import smxcompile  # noqa: F401  (registers the smx backend)

CONFIGS = {
    "top_k": lambda: [TopKLogitsWarper(50)],
    "temperature+top_k+top_p": lambda: [TemperatureLogitsWarper(0.7), TopKLogitsWarper(50), TopPLogitsWarper(0.9)],
    "top_p": lambda: [TopPLogitsWarper(0.9)],
    "min_p": lambda: [MinPLogitsWarper(0.1)],
}
BACKENDS = ("eager", "inductor", "smx")


def make_step(config: str):
    procs = LogitsProcessorList(CONFIGS[config]())

    def step(input_ids, logits):
        probs = F.softmax(procs(input_ids, logits), dim=-1)
        return torch.multinomial(probs, num_samples=1)
    return step, procs


def compiled(step, backend: str):
    if backend == "eager":
        return step
    torch._dynamo.reset()
    if backend == "inductor":
        return torch.compile(step, dynamic=False)
    return torch.compile(step, backend="smx", dynamic=False, options={"cpu": "rewrite", "cuda": "rewrite"})


def time_ms(fn, args, min_run_time: float) -> float:
    t = benchmark.Timer("fn(*args)", globals=dict(fn=fn, args=args)).blocked_autorange(min_run_time=min_run_time)
    return t.median * 1e3


def bench_row(config: str, B: int, V: int, device: str, min_run_time: float) -> dict:
    step, procs = make_step(config)
    x = torch.randn(B, V, device=device, generator=torch.Generator(device).manual_seed(0)) * 4
    ids = torch.zeros(B, 1, dtype=torch.long, device=device)
    row = dict(config=config, B=B, V=V, device=device)
    for name in BACKENDS:
        fn = compiled(step, name)
        fn(ids, x)  # compile, warm up
        row[name] = time_ms(fn, (ids, x), min_run_time)
        if name == "smx":
            tokens = fn(ids, x)
            probs = F.softmax(procs(ids, x.clone()), -1)
            row["ok"] = bool((probs.gather(1, tokens) > 0).all())
            row["rewritten"] = [s.action for s in smxcompile.last_report().sites if s.kind == "sample"] == ["rewritten"]
    return row


def markdown(rows: list[dict]) -> str:
    out = ["| config | B x V | eager ms | inductor ms | smx ms | smx / inductor | ok |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['config']} | {r['B']}x{r['V']} | {r['eager']:.3f} ({r['eager'] / r['inductor']:.2f}x) | "
                   f"{r['inductor']:.3f} | {r['smx']:.3f} | {r['smx'] / r['inductor']:.2f}x | "
                   f"{'yes' if r['ok'] and r['rewritten'] else 'NO'} |")
    return "\n".join(out)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", default="32000,128256,256000", help="comma-separated V (default %(default)s)")
    p.add_argument("--batch", default="1,64,256", help="comma-separated B (default %(default)s)")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of: {', '.join(CONFIGS)}")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--min-run-time", type=float, default=0.5, help="seconds per timing (default %(default)s)")
    p.add_argument("--markdown", action="store_true", help="print a markdown table at the end")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    configs = args.configs.split(",")
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        sys.exit(f"unknown configs {unknown}; choose from {list(CONFIGS)}")
    rows = []
    grid = [(c, int(b), int(v)) for c in configs for v in args.vocab.split(",") for b in args.batch.split(",")]
    for i, (c, B, V) in enumerate(grid, 1):
        r = bench_row(c, B, V, args.device, args.min_run_time)
        rows.append(r)
        print(f"[{i}/{len(grid)}] {c} {B}x{V}: eager {r['eager']:.3f} inductor {r['inductor']:.3f} smx {r['smx']:.3f} "
              f"ms ({r['smx'] / r['inductor']:.2f}x inductor){'' if r['ok'] and r['rewritten'] else '  NOT OK'}",
              flush=True)
    if args.markdown:
        print(markdown(rows))
    return 0 if all(r["ok"] and r["rewritten"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
