#!/usr/bin/env python
"""Softmax, scaled + masked softmax and log-softmax, forward and forward + backward, under eager, Inductor, smx
(default options) and smx-rewrite (every site rewritten); then a LayerNorm MLP (nothing to rewrite) where smx must
equal Inductor. CPU, and CUDA when present. Columns: benchmarks/README.md.

  python benchmarks/bench_softmax.py [--quick] [--device cpu|cuda] [--shapes ...] [--json PATH] [--markdown]
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch
import torch.nn as nn

import common
from common import BACKENDS, Row, compile_for, fmt_ms, measure_interleaved, n_reports

#: name -> (rows, cols, what it stands for)
SHAPES: dict[str, tuple[int, int, str]] = {
    "4096x1024": (4096, 1024, "generic"),
    "256x16384": (256, 16384, "16K rows: the CPU policy's inference threshold"),
    "64x32000": (64, 32000, "vocab rows"),
    "16x131072": (16, 131072, "128K rows: the CPU policy's training threshold"),
    "8x262144": (8, 262144, "vocab rows, 256K"),
    "12288x256": (12 * 4 * 256, 256, "attention 12 heads x 4 seqs x 256 q, 256 k"),
}
QUICK_SHAPES = ["4096x1024", "8x262144"]
CASES = ("softmax", "neighbours", "log_softmax")


def f_softmax(x, mask):
    return torch.softmax(x, -1)


def f_neighbours(x, mask):
    return torch.softmax(x * 0.125 + mask, -1)


def f_log_softmax(x, mask):
    return torch.log_softmax(x, -1)


FUNCS = {"softmax": f_softmax, "neighbours": f_neighbours, "log_softmax": f_log_softmax}


def smx_actions_since(n0: int) -> str:
    acts = sorted({s.action for s in common.sites_since(n0)[0]})
    return ",".join(acts) if acts else "no site"


def check(row: Row, backend: str, got: torch.Tensor, ref: torch.Tensor) -> None:
    """Within 1e-5 + 1e-4 max|eager| of eager's result, NaN where eager has NaN."""
    err = (got.float() - ref.float()).nan_to_num(0.0).abs().max().item()
    row.max_err[backend] = err
    if err > 1e-5 + 1e-4 * ref.float().nan_to_num(0.0).abs().max().item() or not torch.equal(got.isnan(), ref.isnan()):
        row.mismatch.append(backend)


def bench_case(device: str, shape: str, case: str, threads: int, rounds: int, min_run_time: float) -> list[Row]:
    """One shape and case: the forward and the forward + backward rows, every backend checked, then timed."""
    n, cols, _ = SHAPES[shape]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, cols, generator=gen).to(device)
    mask = torch.zeros(1, cols)
    mask[:, cols - cols // 8:] = float("-inf")
    mask = mask.to(device)
    g = torch.randn(n, cols, generator=gen).to(device)
    xg = x.clone().requires_grad_(True)
    fn = FUNCS[case]
    torch._dynamo.reset()
    with torch.no_grad():
        ref_fwd = fn(x, mask)
    ref_bwd = torch.autograd.grad(fn(xg, mask), xg, g)[0]
    fwd, bwd = Row(device, shape, case, "fwd"), Row(device, shape, case, "fwd+bwd")
    compiled = {}
    for b in BACKENDS:
        n0 = n_reports()
        compiled[b] = cf = compile_for(b, fn)
        with torch.no_grad():
            y = cf(x, mask)
        gx = torch.autograd.grad(cf(xg, mask), xg, g)[0]
        if b != "eager":
            check(fwd, b, y, ref_fwd)
            check(bwd, b, gx, ref_bwd)
        if b.startswith("smx"):
            fwd.action[b] = bwd.action[b] = smx_actions_since(n0)
    with torch.no_grad():
        fwd.ms, fwd.iqr_ms, fwd.min_ms = measure_interleaved(
            {b: ("f(x, mask)", {"f": compiled[b], "x": x, "mask": mask}) for b in BACKENDS}, threads, rounds,
            min_run_time)
    bwd.ms, bwd.iqr_ms, bwd.min_ms = measure_interleaved(
        {b: ("torch.autograd.grad(f(x, mask), x, g)", {"f": compiled[b], "x": xg, "mask": mask, "g": g,
                                                        "torch": torch}) for b in BACKENDS},
        threads, rounds, min_run_time)
    torch._dynamo.reset()
    return [fwd, bwd]


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.ln, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln(x))))


def bench_mlp(device: str, threads: int, rounds: int, min_run_time: float, tokens: int = 1024, d: int = 256) -> dict:
    """A 2-block MLP with LayerNorm (no softmax anywhere): forward + backward, inductor vs smx."""
    torch.manual_seed(0)
    model = nn.Sequential(Block(d), Block(d), nn.LayerNorm(d)).to(device)
    params = list(model.parameters())
    x, g = torch.randn(tokens, d, device=device), torch.randn(tokens, d, device=device)

    def step(x):
        return model(x)

    torch._dynamo.reset()
    n0 = n_reports()
    fns = {b: compile_for(b, step) for b in ("inductor", "smx")}
    ref = torch.autograd.grad(model(x), params, g)
    errs = {b: max((a - r).abs().max().item() for a, r in zip(torch.autograd.grad(f(x), params, g), ref))
            for b, f in fns.items()}
    sites, graphs = common.sites_since(n0)
    stmts = {b: ("torch.autograd.grad(f(x), params, g)", {"f": f, "x": x, "params": params, "g": g, "torch": torch})
             for b, f in fns.items()}
    ms, iqr, mins = measure_interleaved(stmts, threads, rounds, min_run_time)
    torch._dynamo.reset()
    return {"device": device, "model": f"2 x (LayerNorm, Linear {d}->{4 * d}, GELU, Linear {4 * d}->{d}) + LayerNorm",
            "input": [tokens, d], "pass": "fwd+bwd", "ms": ms, "iqr_ms": iqr, "min_ms": mins,
            "ratio_smx_vs_inductor": ms["smx"] / ms["inductor"], "smx_graphs_compiled": graphs,
            "smx_sites": len(sites), "max_abs_err_vs_eager": errs}


def table_rows(rows: list[Row]) -> tuple[list[str], list[list[str]]]:
    head = ["device", "shape", "case", "pass"] + [f"{b} ms" + ("" if b == "inductor" else " (/ind)")
                                                  for b in BACKENDS] + ["smx did"]
    return head, [[r.device, r.shape, r.case, r.pass_] + [fmt_ms(r, b) for b in BACKENDS]
                  + ["; ".join(f"{b}: {r.action[b]}" for b in ("smx", "smx-rewrite") if b in r.action)] for r in rows]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    common.timing_flags(p, 3, 0.3, "smoke run: shapes 4096x1024 and 8x262144 only, one short round each (numbers "
                                   "are rough)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto (default): CPU, and CUDA too when available; or only one of them")
    p.add_argument("--shapes", nargs="+", choices=list(SHAPES), metavar="SHAPE",
                   help="subset of shapes to run (default: all): "
                        + "; ".join(f"{k} ({v[2]})" for k, v in SHAPES.items()))
    p.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES), help="subset of cases (default: all)")
    p.add_argument("--no-mlp", action="store_true", help="skip the nothing-matches MLP comparison")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rounds, min_run_time = args.rounds or (1 if args.quick else 3), args.min_run_time or (0.05 if args.quick else 0.3)
    shapes = args.shapes or (QUICK_SHAPES if args.quick else list(SHAPES))
    devices = common.devices(args.device)
    torch.set_num_threads(args.threads)
    command, env = common.command_line(), common.environment(args.threads)
    common.print_header(command, env, "timings (multi-threaded ones most) will be noisy")
    print(f"timing: torch.utils.benchmark blocked_autorange, {rounds} interleaved round(s) x {min_run_time}s "
          "per backend; median ms; (/ind) = ratio to inductor, < 1 faster", flush=True)
    result: dict[str, Any] = {"command": command, "env": env, "rounds": rounds, "min_run_time": min_run_time,
                              "rows": [], "mlp": []}
    rows: list[Row] = []
    t0 = time.perf_counter()
    for device in devices:
        for shape in shapes:
            for case in args.cases:
                for r in bench_case(device, shape, case, args.threads, rounds, min_run_time):
                    rows.append(r)
                    print(f"  [{time.perf_counter() - t0:6.1f}s] {r.device} {r.shape} {r.case} {r.pass_}: "
                          + ", ".join(f"{b} {fmt_ms(r, b)}" for b in BACKENDS), flush=True)
                result["rows"] = [r.record() for r in rows]
                common.write_json(args.json, result)
        if not args.no_mlp:  # identical code on both sides, the ratio is noise: timed longer than the rows
            result["mlp"].append(bench_mlp(device, args.threads, max(rounds, 5), max(min_run_time, 0.3)))
            common.write_json(args.json, result)
    for device in devices:
        head, body = table_rows([r for r in rows if r.device == device])
        common.print_table(f"softmax on {device} ({env['cuda'] if device == 'cuda' else env['cpu']}, {args.threads} "
                           "threads)", head, body, args.markdown)
    if result["mlp"]:
        head = ["device", "model (no softmax)", "pass", "inductor ms", "smx ms", "smx / inductor", "smx graphs / sites"]
        body = [[m["device"], m["model"], m["pass"], f"{m['ms']['inductor']:.3f}", f"{m['ms']['smx']:.3f}",
                 f"{m['ratio_smx_vs_inductor']:.3f}x", f"{m['smx_graphs_compiled']} / {m['smx_sites']}"]
                for m in result["mlp"]]
        common.print_table("nothing matches: smx must equal inductor", head, body, args.markdown)
    common.print_load_at_end(env, "a load above the core count means other processes shared the CPUs")
    common.write_json(args.json, result)
    bad = [r for r in rows if r.mismatch]
    for r in bad:
        print(f"MISMATCH vs eager: {r.device} {r.shape} {r.case} {r.pass_}: {r.mismatch} max|err|={r.max_err}")
    print(f"\n$ {command}   ({time.perf_counter() - t0:.0f} s)" + (f"\nwrote {args.json}" if args.json else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
