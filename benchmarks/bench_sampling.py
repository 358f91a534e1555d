#!/usr/bin/env python
"""The sampling step of ``generate(do_sample=True)`` (transformers' warpers on ``(B, V)`` fp32 logits N(0, 4^2),
softmax, ``torch.multinomial(probs, 1)``) under eager, Inductor and smx (rewritten into one ``smx::sample``): ms per
call (median of blocked_autorange, one thread) and the ratio to Inductor; ``ok``: every smx token had a positive
eager probability. CPU, or CUDA when present.

  python benchmarks/bench_sampling.py [--vocab 32000 --batch 1,64 --configs top_k --markdown]
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
from transformers.generation.logits_process import (LogitsProcessorList, MinPLogitsWarper, TemperatureLogitsWarper,
                                                    TopKLogitsWarper, TopPLogitsWarper)

import common
import smxcompile

CONFIGS = {
    "top_k": lambda: [TopKLogitsWarper(50)],
    "temperature+top_k+top_p": lambda: [TemperatureLogitsWarper(0.7), TopKLogitsWarper(50), TopPLogitsWarper(0.9)],
    "top_p": lambda: [TopPLogitsWarper(0.9)],
    "min_p": lambda: [MinPLogitsWarper(0.1)],
}
BACKENDS = ("eager", "inductor", "smx")


def bench_row(config: str, B: int, V: int, device: str, min_run_time: float) -> dict:
    procs = LogitsProcessorList(CONFIGS[config]())

    def step(input_ids, logits):
        return torch.multinomial(F.softmax(procs(input_ids, logits), dim=-1), num_samples=1)

    x = torch.randn(B, V, device=device, generator=torch.Generator(device).manual_seed(0)) * 4
    ids = torch.zeros(B, 1, dtype=torch.long, device=device)
    row = dict(config=config, B=B, V=V, device=device)
    for name in BACKENDS:
        torch._dynamo.reset()
        fn = step if name == "eager" else torch.compile(step, dynamic=False) if name == "inductor" else \
            torch.compile(step, backend="smx", dynamic=False, options=dict(common.SMX_REWRITE))
        fn(ids, x)  # compile, warm up
        row[name] = common.measure_interleaved({name: ("fn(*args)", dict(fn=fn, args=(ids, x)))}, 1, 1,
                                               min_run_time)[0][name]
        if name == "smx":
            probs = F.softmax(procs(ids, x.clone()), -1)
            row["ok"] = bool((probs.gather(1, fn(ids, x)) > 0).all())
            row["rewritten"] = [s.action for s in smxcompile.last_report().sites if s.kind == "sample"] == ["rewritten"]
    return row


def markdown(rows: list[dict]) -> str:
    return common.markdown_table(
        ["config", "B x V", "eager ms", "inductor ms", "smx ms", "smx / inductor", "ok"],
        [[r["config"], f"{r['B']}x{r['V']}", f"{r['eager']:.3f} ({r['eager'] / r['inductor']:.2f}x)",
          f"{r['inductor']:.3f}", f"{r['smx']:.3f}", f"{r['smx'] / r['inductor']:.2f}x",
          "yes" if r["ok"] and r["rewritten"] else "NO"] for r in rows])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", default="32000,128256,256000", help="comma-separated V (default %(default)s)")
    p.add_argument("--batch", default="1,64,256", help="comma-separated B (default %(default)s)")
    p.add_argument("--configs", type=common.choice_list(tuple(CONFIGS)), default=list(CONFIGS),
                   help=f"comma-separated, of: {', '.join(CONFIGS)}")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--min-run-time", type=float, default=0.5, help="seconds per timing (default %(default)s)")
    p.add_argument("--markdown", action="store_true", help="print a markdown table at the end")
    args = p.parse_args(argv)
    grid = [(c, int(b), int(v)) for c in args.configs for v in args.vocab.split(",") for b in args.batch.split(",")]
    rows = []
    for i, (c, B, V) in enumerate(grid, 1):
        rows.append(r := bench_row(c, B, V, args.device, args.min_run_time))
        print(f"[{i}/{len(grid)}] {c} {B}x{V}: eager {r['eager']:.3f} inductor {r['inductor']:.3f} smx {r['smx']:.3f} "
              f"ms ({r['smx'] / r['inductor']:.2f}x inductor){'' if r['ok'] and r['rewritten'] else '  NOT OK'}",
              flush=True)
    if args.markdown:
        print(markdown(rows))
    return 0 if all(r["ok"] and r["rewritten"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
