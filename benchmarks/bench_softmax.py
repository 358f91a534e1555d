#!/usr/bin/env python
"""Side-by-side softmax benchmark: eager vs Inductor vs the ``smx`` backend (CPU, and CUDA when present).

For each shape (rows x columns, softmax over the last dim) and each case

  softmax      torch.softmax(x, -1)
  neighbours   torch.softmax(x * 0.125 + mask, -1)      (mask: additive float (1, cols), -inf on the last 1/8)
  log_softmax  torch.log_softmax(x, -1)

it times the forward (inference: x does not require grad) and the forward + backward
(``torch.autograd.grad(f(x), x, g)``) of

  eager        the plain PyTorch function
  inductor     torch.compile(f, backend="inductor")
  smx          torch.compile(f, backend="smx")                              (default options: cpu / cuda "auto")
  smx-rewrite  torch.compile(f, backend="smx", options={"cpu": "rewrite", "cuda": "rewrite"})  (forces smx ops)

and prints milliseconds (median over all timed blocks) with the ratio to inductor (< 1 is faster),
plus what smx did with the site (rewritten / kept). A last section compiles a small MLP with
LayerNorm and no softmax with inductor and with smx: smx must not be slower when nothing matches.

Timing: torch.utils.benchmark.Timer.blocked_autorange with torch.set_num_threads(all cores),
the backends measured in turn, several rounds (interleaving keeps a drifting machine from
favouring whichever backend ran first). Every compiled result is checked against eager before
it is timed; a mismatch is flagged in the table with "!".

Usage:
  python benchmarks/bench_softmax.py                  # full run (CPU, and CUDA if available)
  python benchmarks/bench_softmax.py --quick          # smoke run: 2 shapes, short timings
  python benchmarks/bench_softmax.py --json out.json  # also write every figure as JSON
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shlex
import statistics
import sys
import time
import types
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.utils.benchmark as tbench

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
BACKENDS = ("eager", "inductor", "smx", "smx-rewrite")
PASSES = ("fwd", "fwd+bwd")
SMX_REWRITE = {"cpu": "rewrite", "cuda": "rewrite"}


# --------------------------------------------------------------------------- the functions measured


def f_softmax(x, mask):
    return torch.softmax(x, -1)


def f_neighbours(x, mask):
    return torch.softmax(x * 0.125 + mask, -1)


def f_log_softmax(x, mask):
    return torch.log_softmax(x, -1)


FUNCS: dict[str, Callable] = {"softmax": f_softmax, "neighbours": f_neighbours, "log_softmax": f_log_softmax}


def fresh(fn: Callable, tag: str) -> Callable:
    """A copy of ``fn`` with its own code object.

    Dynamo keeps its compiled entries on the code object; giving each backend its own copy keeps
    one backend's entries from counting against another's recompile limit (or being reused).
    """
    name = f"{fn.__name__}__{tag.replace('-', '_')}"
    code = fn.__code__.replace(co_name=name, co_qualname=name) if sys.version_info >= (3, 11) else \
        fn.__code__.replace(co_name=name)
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)


def compile_for(backend: str, fn: Callable) -> Callable:
    if backend == "eager":
        return fn
    f = fresh(fn, backend)
    if backend == "inductor":
        return torch.compile(f, backend="inductor", dynamic=False)
    if backend == "smx":
        return torch.compile(f, backend="smx", dynamic=False)
    if backend == "smx-rewrite":
        return torch.compile(f, backend="smx", dynamic=False, options=dict(SMX_REWRITE))
    raise ValueError(backend)


# --------------------------------------------------------------------------- timing


@dataclasses.dataclass
class Row:
    device: str
    shape: str
    case: str
    pass_: str
    ms: dict[str, float] = dataclasses.field(default_factory=dict)       # median ms per backend
    iqr_ms: dict[str, float] = dataclasses.field(default_factory=dict)
    min_ms: dict[str, float] = dataclasses.field(default_factory=dict)   # fastest block: least disturbed
    action: dict[str, str] = dataclasses.field(default_factory=dict)     # what smx did, per smx backend
    max_err: dict[str, float] = dataclasses.field(default_factory=dict)  # vs eager, per compiled backend
    mismatch: list[str] = dataclasses.field(default_factory=list)

    def ratio(self, backend: str) -> float | None:
        if backend in self.ms and "inductor" in self.ms and self.ms["inductor"] > 0:
            return self.ms[backend] / self.ms["inductor"]
        return None


def smx_actions_since(n0: int) -> str:
    """What the smx backend did with the sites of the graphs it compiled since report ``n0``."""
    from smxcompile.backends.smx import compiled_reports

    acts = [s.action for r in compiled_reports[n0:] for s in r]
    if not acts:
        return "no site"
    return ",".join(sorted(set(acts)))


def n_reports() -> int:
    from smxcompile.backends.smx import compiled_reports

    return len(compiled_reports)


def measure_interleaved(stmts: dict[str, tuple[str, dict[str, Any]]], threads: int, rounds: int,
                        min_run_time: float) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """Median, IQR and min (ms per call) of each statement, timed in turn for ``rounds`` rounds."""
    times: dict[str, list[float]] = {k: [] for k in stmts}
    timers = {k: tbench.Timer(stmt=s, globals=g, num_threads=threads) for k, (s, g) in stmts.items()}
    for r in range(rounds):
        order = list(timers) if r % 2 == 0 else list(reversed(timers))
        for k in order:
            m = timers[k].blocked_autorange(min_run_time=min_run_time)
            times[k].extend(m.times)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    iqr = {}
    for k, v in times.items():
        if len(v) >= 4:
            q = statistics.quantiles(v, n=4)
            iqr[k] = (q[2] - q[0]) * 1e3
        else:
            iqr[k] = 0.0
    mins = {k: min(v) * 1e3 for k, v in times.items()}
    return med, iqr, mins


def bench_case(device: str, shape_name: str, case: str, backends: list[str], threads: int, rounds: int,
               min_run_time: float) -> list[Row]:
    rows_n, cols, _ = SHAPES[shape_name]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows_n, cols, generator=gen).to(device)
    mask = torch.zeros(1, cols)
    mask[:, cols - cols // 8:] = float("-inf")
    mask = mask.to(device)
    g = torch.randn(rows_n, cols, generator=gen).to(device)
    xg = x.clone().requires_grad_(True)
    fn = FUNCS[case]

    torch._dynamo.reset()
    with torch.no_grad():
        ref_fwd = fn(x, mask)
    ref_bwd = torch.autograd.grad(fn(xg, mask), xg, g)[0]

    fwd_row = Row(device, shape_name, case, "fwd")
    bwd_row = Row(device, shape_name, case, "fwd+bwd")
    compiled: dict[str, Callable] = {}
    for b in backends:
        n0 = n_reports()
        cf = compile_for(b, fn)
        compiled[b] = cf
        with torch.no_grad():
            y = cf(x, mask)
        gx = torch.autograd.grad(cf(xg, mask), xg, g)[0]
        for row, got, ref in ((fwd_row, y, ref_fwd), (bwd_row, gx, ref_bwd)):
            if b == "eager":
                continue
            err = (got.float() - ref.float()).nan_to_num(0.0).abs().max().item()
            row.max_err[b] = err
            tol = 1e-5 + 1e-4 * ref.float().nan_to_num(0.0).abs().max().item()
            if err > tol or not torch.equal(got.isnan(), ref.isnan()):
                row.mismatch.append(b)
        if b.startswith("smx"):
            act = smx_actions_since(n0)
            fwd_row.action[b] = act
            bwd_row.action[b] = act
    fwd_stmts = {b: ("f(x, mask)", {"f": compiled[b], "x": x, "mask": mask}) for b in backends}
    bwd_stmts = {b: ("torch.autograd.grad(f(x, mask), x, g)",
                     {"f": compiled[b], "x": xg, "mask": mask, "g": g, "torch": torch}) for b in backends}
    with torch.no_grad():
        fwd_row.ms, fwd_row.iqr_ms, fwd_row.min_ms = measure_interleaved(fwd_stmts, threads, rounds, min_run_time)
    bwd_row.ms, bwd_row.iqr_ms, bwd_row.min_ms = measure_interleaved(bwd_stmts, threads, rounds, min_run_time)
    torch._dynamo.reset()
    return [fwd_row, bwd_row]


# --------------------------------------------------------------------------- nothing-matches model


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln(x))))


def bench_mlp(device: str, threads: int, rounds: int, min_run_time: float, tokens: int = 1024, d: int = 256) -> dict:
    """A 2-block MLP with LayerNorm (no softmax anywhere): forward + backward, inductor vs smx."""
    torch.manual_seed(0)
    model = nn.Sequential(Block(d), Block(d), nn.LayerNorm(d)).to(device)
    params = list(model.parameters())
    x = torch.randn(tokens, d, device=device)
    g = torch.randn(tokens, d, device=device)

    def step(x):
        return model(x)

    torch._dynamo.reset()
    n0 = n_reports()
    fns = {b: compile_for(b, step) for b in ("inductor", "smx")}
    ref = torch.autograd.grad(model(x), params, g)
    errs = {}
    for b, f in fns.items():
        got = torch.autograd.grad(f(x), params, g)
        errs[b] = max((a - r).abs().max().item() for a, r in zip(got, ref))
    from smxcompile.backends.smx import compiled_reports

    sites = sum(len(r) for r in compiled_reports[n0:])
    graphs = n_reports() - n0
    stmts = {b: ("torch.autograd.grad(f(x), params, g)", {"f": f, "x": x, "params": params, "g": g, "torch": torch})
             for b, f in fns.items()}
    ms, iqr, mins = measure_interleaved(stmts, threads, rounds, min_run_time)
    torch._dynamo.reset()
    return {
        "device": device, "model": f"2 x (LayerNorm, Linear {d}->{4 * d}, GELU, Linear {4 * d}->{d}) + LayerNorm",
        "input": [tokens, d], "pass": "fwd+bwd", "ms": ms, "iqr_ms": iqr, "min_ms": mins,
        "ratio_smx_vs_inductor": ms["smx"] / ms["inductor"],
        "smx_graphs_compiled": graphs, "smx_sites": sites, "max_abs_err_vs_eager": errs,
    }


# --------------------------------------------------------------------------- output


def _fmt_ms(row: Row, b: str) -> str:
    if b not in row.ms:
        return "-"
    flag = " !" if b in row.mismatch else ""
    r = row.ratio(b)
    ms = row.ms[b]
    txt = f"{ms:.3f}" if ms < 10 else f"{ms:.2f}"
    if b == "inductor" or r is None:
        return txt + flag
    return f"{txt} ({r:.2f}x){flag}"


def table_rows(rows: list[Row], backends: list[str]) -> tuple[list[str], list[list[str]]]:
    head = ["device", "shape", "case", "pass"] + [f"{b} ms" + ("" if b == "inductor" else " (/ind)") for b in backends]
    head += ["smx did"]
    out = []
    for r in rows:
        acts = []
        for b in ("smx", "smx-rewrite"):
            if b in r.action:
                acts.append(f"{b}: {r.action[b]}")
        out.append([r.device, r.shape, r.case, r.pass_] + [_fmt_ms(r, b) for b in backends] + ["; ".join(acts)])
    return head, out


def print_table(title: str, head: list[str], rows: list[list[str]], markdown: bool) -> None:
    if markdown:
        print(f"\n**{title}**\n")
        print("| " + " | ".join(head) + " |")
        print("|" + "|".join("---" for _ in head) + "|")
        for r in rows:
            print("| " + " | ".join(r) + " |")
        return
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # plain text
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
        print(f"\n{title}")
        print("  ".join(h.ljust(w) for h, w in zip(head, widths)))
        for r in rows:
            print("  ".join(v.ljust(w) for v, w in zip(r, widths)))
        return
    t = Table(title=title, show_lines=False)
    for i, h in enumerate(head):
        t.add_column(h, justify="right" if "ms" in h else "left", no_wrap=True)
    for r in rows:
        t.add_row(*r)
    Console(width=max(200, 20 + sum(max(len(h), *(len(x[i]) for x in rows)) + 3 for i, h in enumerate(head))),
            soft_wrap=True).print(t)


def environment(threads: int) -> dict[str, Any]:
    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": _cpu_name(),
        "cores": _cores(),
        "threads": threads,
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
    }
    try:
        env["loadavg_at_start"] = [round(v, 2) for v in os.getloadavg()]
    except OSError:
        pass
    try:
        import smxcompile

        env["smxcompile"] = smxcompile.__version__
    except Exception:  # pragma: no cover
        env["smxcompile"] = None
    return env


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--quick", action="store_true",
                   help="smoke run: shapes 4096x1024 and 8x262144 only, one short round each (numbers are rough)")
    p.add_argument("--json", metavar="PATH", help="write every figure (and the environment) to PATH as JSON")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto (default): CPU, and CUDA too when available; or only one of them")
    p.add_argument("--shapes", nargs="+", choices=list(SHAPES), metavar="SHAPE",
                   help="subset of shapes to run (default: all): "
                        + "; ".join(f"{k} ({v[2]})" for k, v in SHAPES.items()))
    p.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES), help="subset of cases (default: all)")
    p.add_argument("--rounds", type=int, help="interleaved timing rounds per measurement (default 3, quick 1)")
    p.add_argument("--min-run-time", type=float,
                   help="seconds of blocked_autorange per backend per round (default 0.3, quick 0.05)")
    p.add_argument("--threads", type=int, default=_cores(), help="torch threads (default: all cores, %(default)s here)")
    p.add_argument("--no-mlp", action="store_true", help="skip the nothing-matches MLP comparison")
    p.add_argument("--markdown", action="store_true", help="print the tables as Markdown (for docs/PERFORMANCE.md)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import smxcompile  # noqa: F401  (registers backend="smx" when not installed)

    rounds = args.rounds or (1 if args.quick else 3)
    min_run_time = args.min_run_time or (0.05 if args.quick else 0.3)
    shapes = args.shapes or (QUICK_SHAPES if args.quick else list(SHAPES))
    devices = []
    if args.device in ("auto", "cpu"):
        devices.append("cpu")
    if args.device in ("auto", "cuda"):
        if torch.cuda.is_available():
            devices.append("cuda")
        elif args.device == "cuda":
            print("--device cuda: no CUDA device here", file=sys.stderr)
            return 2
    torch.set_num_threads(args.threads)
    command = "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0])] + sys.argv[1:])
    env = environment(args.threads)
    print(f"$ {command}")
    if env.get("loadavg_at_start") and env["loadavg_at_start"][0] > 0.5 * env["cores"]:
        print(f"WARNING: load average {env['loadavg_at_start'][0]} on {env['cores']} cores: other processes are "
              "using the CPUs; timings (multi-threaded ones most) will be noisy", file=sys.stderr)
    print("env: " + ", ".join(f"{k}={v}" for k, v in env.items()))
    print(f"timing: torch.utils.benchmark blocked_autorange, {rounds} interleaved round(s) x {min_run_time}s "
          "per backend; median ms; (/ind) = ratio to inductor, < 1 faster", flush=True)

    result: dict[str, Any] = {"command": command, "env": env, "rounds": rounds, "min_run_time": min_run_time,
                              "rows": [], "mlp": []}
    all_rows: list[Row] = []
    t0 = time.perf_counter()
    for device in devices:
        backends = list(BACKENDS)
        for shape in shapes:
            for case in args.cases:
                rows = bench_case(device, shape, case, backends, args.threads, rounds, min_run_time)
                all_rows.extend(rows)
                for r in rows:
                    print(f"  [{time.perf_counter() - t0:6.1f}s] {r.device} {r.shape} {r.case} {r.pass_}: "
                          + ", ".join(f"{b} {_fmt_ms(r, b)}" for b in backends), flush=True)
                result["rows"] = [_row_dict(r) for r in all_rows]
                _write_json(args.json, result)
        if not args.no_mlp:
            # identical code on both sides, so the ratio is pure noise: time it longer than the rows
            mlp = bench_mlp(device, args.threads, max(rounds, 5), max(min_run_time, 0.3))
            result["mlp"].append(mlp)
            _write_json(args.json, result)

    for device in devices:
        backends = list(BACKENDS)
        rows = [r for r in all_rows if r.device == device]
        head, body = table_rows(rows, backends)
        print_table(f"softmax on {device} ({env['cuda'] if device == 'cuda' else env['cpu']}, "
                    f"{args.threads} threads)", head, body, args.markdown)
    if result["mlp"]:
        head = ["device", "model (no softmax)", "pass", "inductor ms", "smx ms", "smx / inductor", "smx graphs / sites"]
        body = [[m["device"], m["model"], m["pass"], f"{m['ms']['inductor']:.3f}", f"{m['ms']['smx']:.3f}",
                 f"{m['ratio_smx_vs_inductor']:.3f}x", f"{m['smx_graphs_compiled']} / {m['smx_sites']}"]
                for m in result["mlp"]]
        print_table("nothing matches: smx must equal inductor", head, body, args.markdown)
    try:
        env["loadavg_at_end"] = [round(v, 2) for v in os.getloadavg()]
        print(f"load average at start {env.get('loadavg_at_start')}, at end {env['loadavg_at_end']} "
              f"({env['cores']} cores): a load above the core count means other processes shared the CPUs")
    except OSError:
        pass
    _write_json(args.json, result)
    bad = [r for r in all_rows if r.mismatch]
    for r in bad:
        print(f"MISMATCH vs eager: {r.device} {r.shape} {r.case} {r.pass_}: {r.mismatch} max|err|={r.max_err}")
    print(f"\n$ {command}   ({time.perf_counter() - t0:.0f} s)")
    if args.json:
        print(f"wrote {args.json}")
    return 1 if bad else 0


def _row_dict(r: Row) -> dict:
    d = dataclasses.asdict(r)
    d["pass"] = d.pop("pass_")
    d["ratio_vs_inductor"] = {b: r.ratio(b) for b in r.ms}
    return d


def _write_json(path: str | None, result: dict) -> None:
    if not path:
        return
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1, default=str)
    os.replace(tmp, path)


if __name__ == "__main__":
    sys.exit(main())
