#!/usr/bin/env python
"""The GPU model's cases (benchmarks/gpu_cases.py) timed on a CUDA GPU with their real Triton kernels, and torch's
own path, next to benchmarks/gpu_model.py's predictions (its --json, matched by case, shape and dtype): x pred =
measured / predicted, x torch = torch's time / ours. Columns and method: docs/PERFORMANCE.md ("How the GPU scripts
measure"). Exits 2 without CUDA or with no case, 1 when a case raised.

On a CUDA machine (benchmarks/gpu/run.sh runs a selection):
  python benchmarks/gpu/compare_model.py [--quick] [--families LIST] [--only TEXT ...] [--budget S] [--json PATH]
"""

from __future__ import annotations

import time

T0 = time.monotonic()  # --budget counts from here

import argparse  # noqa: E402
import contextlib  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import common  # noqa: E402

#: measured / predicted above this: the row "misses its roofline"
MISS = 2.0
FLUSH_BYTES = 256 * 1024 * 1024  # what triton.testing.do_bench writes to flush the L2


def key(r: dict) -> tuple:
    return (r["case"], r["shape"], r["dtype"])


def name(r: dict) -> str:
    return " ".join(key(r))


def ratio(a, b):
    return a / b if a is not None and b else None


def compare(model_rows: list[dict], measured_rows: list[dict], miss: float = MISS) -> list[dict]:
    """One row per measured row, in its order, with the model's predictions (the first model row of a key wins),
    the ratios and the flags. Measured rows: case, shape, dtype, and optionally family, kernel, measured_us,
    torch_measured_us, peak_bytes, torch_peak_bytes, reps, torch_reps, error and torch_error (the message)."""
    model: dict[tuple, dict] = {}
    for m in model_rows:
        model.setdefault(key(m), m)
    out = []
    for r in measured_rows:
        m = model.get(key(r)) or {}
        ours, theirs = r.get("measured_us"), r.get("torch_measured_us")
        pred, tpred = m.get("predicted_us"), m.get("torch_predicted_us")
        row = dict(family=r.get("family", m.get("family")), kernel=r.get("kernel", m.get("kernel")),
                   case=r["case"], shape=r["shape"], dtype=r["dtype"],
                   measured_us=ours, predicted_us=pred, measured_over_predicted=ratio(ours, pred),
                   torch_measured_us=theirs, torch_predicted_us=tpred,
                   torch_measured_over_predicted=ratio(theirs, tpred),
                   speedup_vs_torch=ratio(theirs, ours), predicted_speedup_vs_torch=ratio(tpred, pred),
                   **{k: r.get(k) for k in ("peak_bytes", "torch_peak_bytes", "reps", "torch_reps", "error",
                                            "torch_error")}, in_model=bool(m), flags=[])
        flags, speedup, over = row["flags"], row["speedup_vs_torch"], row["measured_over_predicted"]
        if row["error"]:
            flags.append(f"ERR {row['error']}")
        if row["torch_error"]:
            flags.append(f"torch ERR {row['torch_error']}")
        if speedup is not None and speedup < 1:
            flags.append(f"slower than torch ({speedup:.2f}x)")
        if over is not None and over > miss:
            flags.append(f"misses its roofline by {over:.1f}x")
        if not m:
            flags.append("no model row")
        out.append(row)
    return out


COLUMNS = ["case", "shape", "dtype", "ours us", "pred us", "x pred", "torch us", "torch pred", "torch x pred",
           "x torch", "pred x torch", "peak MB", "flags"]


def fmt(v, spec: str, suffix: str = "") -> str:
    return "-" if v is None else format(v, spec) + suffix


def row_cells(r: dict) -> list[str]:
    def mb(v):
        return fmt(None if v is None else v / 2**20, ".0f")

    return [r["case"], r["shape"], r["dtype"], "ERR" if r["error"] else fmt(r["measured_us"], ".1f"),
            fmt(r["predicted_us"], ".1f"), fmt(r["measured_over_predicted"], ".2f"),
            "ERR" if r["torch_error"] else fmt(r["torch_measured_us"], ".1f"), fmt(r["torch_predicted_us"], ".1f"),
            fmt(r["torch_measured_over_predicted"], ".2f"), fmt(r["speedup_vs_torch"], ".2f", "x"),
            fmt(r["predicted_speedup_vs_torch"], ".2f", "x"), f"{mb(r['peak_bytes'])} / {mb(r['torch_peak_bytes'])}",
            "; ".join(f for f in r["flags"] if not f.startswith(("ERR", "torch ERR")))]


def summary(rows: list[dict], miss: float = MISS) -> list[str]:
    """The lines under the table: what is slower than torch, misses its roofline, raised or lacks a model row, and
    the spread of measured / predicted and of the speedups."""
    out = []
    for title, k, bad, spec in (("SLOWER THAN TORCH (measured)", "speedup_vs_torch", lambda v: v < 1, ".2f"),
                                (f"misses its roofline by more than {miss:g}x (measured / predicted)",
                                 "measured_over_predicted", lambda v: v > miss, ".1f")):
        hits = [f"{name(r)} {r[k]:{spec}}x" for r in rows if r[k] is not None and bad(r[k])]
        if hits:
            out.append(f"{title}: " + "; ".join(hits))
    for r in rows:
        out += [f"{tag}ERR {name(r)}: {r[k]}" for tag, k in (("", "error"), ("torch ", "torch_error")) if r[k]]
    absent = [name(r) for r in rows if not r["in_model"]]
    if absent:
        out.append(f"no model row for {len(absent)} case(s) (predictions '-'): " + "; ".join(absent))
    for what, k, x in (("measured / predicted", "measured_over_predicted", ""),
                       ("measured speedup vs torch", "speedup_vs_torch", "x")):
        v = [r[k] for r in rows if r[k] is not None]
        if v:
            out.append(f"{what} over {len(v)} case(s): median {statistics.median(v):.2f}{x}, min {min(v):.2f}{x}, "
                       f"max {max(v):.2f}{x}")
    return out


def time_us(fn, flush, min_reps: int = 5, max_reps: int = 200, target_ms: float = 100.0) -> tuple[float, int]:
    """(median us, reps) of fn: enough reps for target_ms (min_reps at least, by one rep's time), each after a
    write of the flush buffer (L2 cold), timed by CUDA events around fn alone."""
    import torch

    def reps(n):
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
        torch.cuda.synchronize()
        for start, end in events:
            flush.zero_()
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return [start.elapsed_time(end) for start, end in events]

    n = int(min(max_reps, max(min_reps, target_ms / max(reps(1)[0], 1e-3))))
    return statistics.median(reps(n)) * 1e3, n


def measure_case(case, flush) -> dict:
    """The measured row of one case (see compare()): per side, a first call compiles (not timed), a second reads
    the peak memory, then the timing; an exception is the side's error."""
    import torch
    rec = dict(family=case.family, kernel=case.kernel, case=case.name, shape=case.shape, dtype=case.dtype)
    t0 = time.monotonic()
    inputs = None
    try:
        inputs = case.make("cuda")
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001
        rec["error"] = "inputs: " + common.err_text(e)
    for prefix, fn in (("", case.run), ("torch_", case.torch_run)):
        if inputs is None or fn is None:
            continue
        try:
            fn(inputs)
            rec[prefix + "peak_bytes"] = round(common.peak_mb(lambda: fn(inputs), "cuda", repeats=1) * common.MB)
            rec[prefix + "measured_us"], rec[prefix + "reps"] = time_us(lambda: fn(inputs), flush)
        except Exception as e:  # noqa: BLE001 - reported as ERR, the run goes on
            rec[prefix + "error"] = common.err_text(e)
    inputs = None  # free the case's tensors before the next one
    gc.collect()
    with contextlib.suppress(Exception):  # a lost context: the next case reports it
        torch.cuda.empty_cache()
    rec["seconds"] = time.monotonic() - t0
    return rec


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the quick cases (one small case per family)")
    p.add_argument("--families", metavar="LIST", help="comma-separated families of gpu_cases.py")
    p.add_argument("--only", metavar="TEXT", action="append", help="cases whose 'name shape dtype' contains TEXT")
    p.add_argument("--budget", type=float, default=150.0, metavar="SECONDS", help="start no case after this")
    p.add_argument("--model", default=str(ROOT / "docs" / "gpu_model.json"), help="gpu_model.py --json output")
    p.add_argument("--json", metavar="PATH", help="write the rows and the environment as JSON (after every case)")
    p.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    args = p.parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("compare_model.py times the Triton kernels on a CUDA GPU and this machine has none "
              f"(torch {torch.__version__}); on a CPU, benchmarks/gpu_model.py counts the same cases "
              "through the interpreter", file=sys.stderr)
        return 2
    if os.environ.pop("TRITON_INTERPRET", "0") not in ("", "0"):
        print("TRITON_INTERPRET dropped: the real kernels run on the GPU", file=sys.stderr)
    from gpu_cases import FAMILIES, all_cases  # imports smxcompile's Triton kernels: after TRITON_INTERPRET

    families = args.families.replace(" ", "").split(",") if args.families else FAMILIES
    if unknown := sorted(set(families) - set(FAMILIES)):
        p.error(f"--families: unknown {unknown}; choose from {','.join(FAMILIES)}")
    cases = [c for c in all_cases(quick=args.quick) if c.family in families
             and (not args.only or any(t in f"{c.name} {c.shape} {c.dtype}" for t in args.only))]
    if not cases:
        print(f"no case selected (families: {','.join(FAMILIES)})", file=sys.stderr)
        return 2
    model = json.loads(Path(args.model).read_text()) if Path(args.model).exists() else {}
    model_rows, model_env = model.get("rows", []), model.get("env", {})
    if not model_rows:
        print(f"no model rows at {args.model}: measured figures only (write them with python "
              f"benchmarks/gpu_model.py {'--quick ' if args.quick else ''}--json {args.model})", file=sys.stderr)
    gpu = torch.cuda.get_device_name()
    env = dict(common.environment(), cuda_version=torch.version.cuda, model=str(args.model),
               model_command=model_env.get("command"), model_gpu=model_env.get("gpu"), budget_s=args.budget,
               miss=MISS, command=common.command_line(argv, "benchmarks/gpu/compare_model.py"))
    print(f"{len(cases)} case(s) on {gpu}; predictions: {args.model} ({len(model_rows)} rows, for an H200: "
          "measured / predicted moves with another GPU's bandwidth and FLOP rate)")
    torch.manual_seed(0)
    flush = torch.empty(FLUSH_BYTES, dtype=torch.int8, device="cuda")
    measured, not_started = [], []
    for i, case in enumerate(cases):
        if i and time.monotonic() - T0 > args.budget:
            not_started = [f"{c.name} {c.shape} {c.dtype}" for c in cases[i:]]
            break
        print(f"[{i + 1}/{len(cases)}] {case.name} {case.shape} {case.dtype} ...", end=" ", flush=True)
        rec = measure_case(case, flush)
        measured.append(rec)
        print(f"{fmt(rec.get('measured_us'), '.1f', ' us')}, torch {fmt(rec.get('torch_measured_us'), '.1f', ' us')} "
              f"({rec['seconds']:.1f} s)", flush=True)
        env["elapsed_s"] = time.monotonic() - T0
        common.write_json(args.json, dict(env=env, rows=compare(model_rows, measured)))
    env.update(not_started=not_started, elapsed_s=time.monotonic() - T0)
    rows = compare(model_rows, measured)
    common.write_json(args.json, dict(env=env, rows=rows))
    common.print_table(f"measured on {gpu}, predicted for an H200", COLUMNS, [row_cells(r) for r in rows],
                       args.markdown, left=("case", "shape", "dtype", "flags"))
    lines = summary(rows)
    if not_started:
        lines.append(f"budget of {args.budget:g} s exceeded: {len(not_started)} case(s) not started: "
                     + "; ".join(not_started))
    print("".join(f"\n{line}" for line in lines))
    print(f"\n{len(rows)} case(s) in {time.monotonic() - T0:.0f} s on {gpu}")
    return 1 if any(r["error"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
