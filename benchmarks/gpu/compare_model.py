#!/usr/bin/env python
"""The GPU model's cases timed on a CUDA GPU, against benchmarks/gpu_model.py's roofline predictions.

Each case of benchmarks/gpu_cases.py runs its real Triton kernels (one untimed call to compile, one for the peak
memory, then CUDA-event timed reps with a cold L2), and torch's own path where it has one; the figures sit next to
the model's (gpu_model.py --json, matched by case, shape and dtype): x pred = measured / predicted (above 2: "misses
its roofline"), x torch = torch's time / ours (below 1: "slower than torch"). A case that raises is an ERR row;
--budget stops starting cases; --json is rewritten after each. Exits 2 without CUDA or with no case, 1 when a case
raised. Columns and caveats: docs/PERFORMANCE.md ("GPU measurements").

Usage (on a CUDA machine; benchmarks/gpu/run.sh runs a selection):
  python benchmarks/gpu/compare_model.py [--quick] [--families LIST] [--only TEXT ...] [--budget SECONDS]
      [--model PATH] [--json PATH] [--markdown]
"""

from __future__ import annotations

import time

_T0 = time.monotonic()  # --budget counts from here

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MODEL = ROOT / "docs" / "gpu_model.json"
#: measured / predicted above this: the row "misses its roofline"
MISS = 2.0
FLUSH_BYTES = 256 * 1024 * 1024  # what triton.testing.do_bench writes to flush the L2


def _key(r: dict) -> tuple:
    return (r["case"], r["shape"], r["dtype"])


def _ratio(a, b):
    return a / b if a is not None and b else None


def compare(model_rows: list[dict], measured_rows: list[dict], miss: float = MISS) -> list[dict]:
    """One row per measured row, in its order, with the model's predictions (matched by case, shape and dtype; the
    first model row of a key wins), the ratios and the flags.

    measured rows: case, shape, dtype (family, kernel), measured_us and torch_measured_us (None: not timed or no
    torch path), peak_bytes and torch_peak_bytes (optional), error and torch_error (None or the message).
    """
    model: dict[tuple, dict] = {}
    for m in model_rows:
        model.setdefault(_key(m), m)
    out = []
    for r in measured_rows:
        m = model.get(_key(r))
        ours, theirs = r.get("measured_us"), r.get("torch_measured_us")
        pred = m.get("predicted_us") if m else None
        tpred = m.get("torch_predicted_us") if m else None
        row = dict(family=r.get("family", m.get("family") if m else None),
                   kernel=r.get("kernel", m.get("kernel") if m else None),
                   case=r["case"], shape=r["shape"], dtype=r["dtype"],
                   measured_us=ours, predicted_us=pred, measured_over_predicted=_ratio(ours, pred),
                   torch_measured_us=theirs, torch_predicted_us=tpred,
                   torch_measured_over_predicted=_ratio(theirs, tpred),
                   speedup_vs_torch=_ratio(theirs, ours), predicted_speedup_vs_torch=_ratio(tpred, pred),
                   peak_bytes=r.get("peak_bytes"), torch_peak_bytes=r.get("torch_peak_bytes"),
                   reps=r.get("reps"), torch_reps=r.get("torch_reps"),
                   error=r.get("error"), torch_error=r.get("torch_error"), in_model=m is not None, flags=[])
        flags = row["flags"]
        if row["error"]:
            flags.append(f"ERR {row['error']}")
        if row["torch_error"]:
            flags.append(f"torch ERR {row['torch_error']}")
        if row["speedup_vs_torch"] is not None and row["speedup_vs_torch"] < 1:
            flags.append(f"slower than torch ({row['speedup_vs_torch']:.2f}x)")
        if row["measured_over_predicted"] is not None and row["measured_over_predicted"] > miss:
            flags.append(f"misses its roofline by {row['measured_over_predicted']:.1f}x")
        if m is None:
            flags.append("no model row")
        out.append(row)
    return out


COLUMNS = ("case", "shape", "dtype", "ours us", "pred us", "x pred", "torch us", "torch pred", "torch x pred",
           "x torch", "pred x torch", "peak MB", "flags")


def _f(v, fmt: str, suffix: str = "") -> str:
    return "-" if v is None else format(v, fmt) + suffix


def _mb(v) -> str:
    return "-" if v is None else f"{v / 2**20:.0f}"


def row_cells(r: dict) -> list[str]:
    ours = "ERR" if r["error"] else _f(r["measured_us"], ".1f")
    theirs = "ERR" if r["torch_error"] else _f(r["torch_measured_us"], ".1f")
    return [r["case"], r["shape"], r["dtype"], ours, _f(r["predicted_us"], ".1f"),
            _f(r["measured_over_predicted"], ".2f"), theirs, _f(r["torch_predicted_us"], ".1f"),
            _f(r["torch_measured_over_predicted"], ".2f"), _f(r["speedup_vs_torch"], ".2f", "x"),
            _f(r["predicted_speedup_vs_torch"], ".2f", "x"), f"{_mb(r['peak_bytes'])} / {_mb(r['torch_peak_bytes'])}",
            "; ".join(f for f in r["flags"] if not f.startswith(("ERR", "torch ERR")))]


def format_table(rows: list[dict], markdown: bool = False) -> str:
    cells = [row_cells(r) for r in rows]
    if markdown:
        lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "|".join("---" for _ in COLUMNS) + "|"]
        return "\n".join(lines + ["| " + " | ".join(c) + " |" for c in cells])
    widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, h in enumerate(COLUMNS)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(COLUMNS, widths)).rstrip()]
    return "\n".join(lines + ["  ".join(v.ljust(w) for v, w in zip(c, widths)).rstrip() for c in cells])


def summary(rows: list[dict], miss: float = MISS) -> list[str]:
    """The lines under the table: what is slower than torch, what misses its roofline, what raised, what the
    model lacks, and the spread of measured / predicted."""
    def name(r):
        return f"{r['case']} {r['shape']} {r['dtype']}"

    out = []
    slower = [r for r in rows if r["speedup_vs_torch"] is not None and r["speedup_vs_torch"] < 1]
    if slower:
        out.append("SLOWER THAN TORCH (measured): "
                   + "; ".join(f"{name(r)} {r['speedup_vs_torch']:.2f}x" for r in slower))
    missed = [r for r in rows if r["measured_over_predicted"] is not None and r["measured_over_predicted"] > miss]
    if missed:
        out.append(f"misses its roofline by more than {miss:g}x (measured / predicted): "
                   + "; ".join(f"{name(r)} {r['measured_over_predicted']:.1f}x" for r in missed))
    for r in rows:
        if r["error"]:
            out.append(f"ERR {name(r)}: {r['error']}")
        if r["torch_error"]:
            out.append(f"torch ERR {name(r)}: {r['torch_error']}")
    absent = [r for r in rows if not r["in_model"]]
    if absent:
        out.append(f"no model row for {len(absent)} case(s) (predictions '-'): " + "; ".join(name(r) for r in absent))
    ratios = [r["measured_over_predicted"] for r in rows if r["measured_over_predicted"] is not None]
    if ratios:
        out.append(f"measured / predicted over {len(ratios)} case(s): median {statistics.median(ratios):.2f}, "
                   f"min {min(ratios):.2f}, max {max(ratios):.2f}")
    wins = [r["speedup_vs_torch"] for r in rows if r["speedup_vs_torch"] is not None]
    if wins:
        out.append(f"measured speedup vs torch over {len(wins)} case(s): median {statistics.median(wins):.2f}x, "
                   f"min {min(wins):.2f}x, max {max(wins):.2f}x")
    return out


def load_model(path: str | Path) -> tuple[list[dict], dict]:
    """The rows and env of a gpu_model.py --json file (a bare list of rows is accepted too)."""
    data = json.loads(Path(path).read_text())
    if isinstance(data, list):
        return data, {}
    return data.get("rows", []), data.get("env", {})


def _message(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


def _sync():
    import torch
    torch.cuda.synchronize()


def peak_bytes(fn) -> int:
    """Peak allocated memory above what was allocated before, over one call of fn."""
    import torch
    _sync()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    _sync()
    del out
    return torch.cuda.max_memory_allocated() - base


def time_us(fn, flush, *, min_reps: int = 5, max_reps: int = 200, target_ms: float = 100.0) -> tuple[float, int]:
    """(median us, reps) of fn, warm: one rep estimates the time, then enough reps for target_ms (min_reps at
    least); each rep is preceded by a write of the flush buffer (L2 cold) and timed by CUDA events around fn
    alone."""
    import torch
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    _sync()
    flush.zero_()
    start.record()
    fn()
    end.record()
    _sync()
    est = max(start.elapsed_time(end), 1e-3)
    n = int(min(max_reps, max(min_reps, target_ms / est)))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    for s, e in zip(starts, ends):
        flush.zero_()
        s.record()
        fn()
        e.record()
    _sync()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) * 1e3, n


def _one(fn, flush) -> tuple[float | None, int | None, int | None, str | None]:
    """(us, reps, peak bytes, error) of one callable: a first call compiles (not timed), a second reads the peak
    memory, then the timing."""
    try:
        fn()
        peak = peak_bytes(fn)
        us, reps = time_us(fn, flush)
        return us, reps, peak, None
    except Exception as e:  # noqa: BLE001 - reported as ERR, the run goes on
        return None, None, None, _message(e)


def measure_case(case, flush) -> dict:
    """The measured row of one case (see compare() for the fields)."""
    import torch
    rec = dict(family=case.family, kernel=case.kernel, case=case.name, shape=case.shape, dtype=case.dtype,
               measured_us=None, torch_measured_us=None, peak_bytes=None, torch_peak_bytes=None, reps=None,
               torch_reps=None, error=None, torch_error=None)
    t0 = time.monotonic()
    inputs = None
    try:
        inputs = case.make("cuda")
        _sync()
    except Exception as e:  # noqa: BLE001
        rec["error"] = "inputs: " + _message(e)
    if inputs is not None:
        rec["measured_us"], rec["reps"], rec["peak_bytes"], rec["error"] = _one(lambda: case.run(inputs), flush)
        if case.torch_run is not None:
            (rec["torch_measured_us"], rec["torch_reps"], rec["torch_peak_bytes"],
             rec["torch_error"]) = _one(lambda: case.torch_run(inputs), flush)
    inputs = None  # free the case's tensors before the next one
    gc.collect()
    try:
        torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001 - a lost context; the next case reports it
        pass
    rec["seconds"] = time.monotonic() - t0
    return rec


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the quick cases (one small case per family)")
    p.add_argument("--families", metavar="LIST",
                   help="comma-separated, of: softmax, softmax_topk, quant_softmax, attention, linear_ce, cross_entropy")
    p.add_argument("--only", metavar="TEXT", action="append",
                   help="cases whose name or shape contains TEXT (repeatable: any of them)")
    p.add_argument("--budget", type=float, default=150.0, metavar="SECONDS",
                   help="start no new case after this many seconds since the start (default %(default)g)")
    p.add_argument("--model", default=str(DEFAULT_MODEL), metavar="PATH",
                   help="gpu_model.py --json output with the predictions (default docs/gpu_model.json)")
    p.add_argument("--json", metavar="PATH", help="write the rows and the environment as JSON (after every case)")
    p.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("compare_model.py times the Triton kernels on a CUDA GPU and this machine has none "
              f"(torch {torch.__version__}); on a CPU, benchmarks/gpu_model.py counts the same cases "
              "through the interpreter", file=sys.stderr)
        return 2
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("TRITON_INTERPRET dropped: the real kernels run on the GPU", file=sys.stderr)
        os.environ.pop("TRITON_INTERPRET")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import triton  # noqa: F401
    from gpu_cases import FAMILIES, all_cases  # imports smxcompile's Triton kernels: after TRITON_INTERPRET

    cases = all_cases(quick=args.quick)
    if args.families:
        families = [f.strip() for f in args.families.split(",") if f.strip()]
        bad = [f for f in families if f not in FAMILIES]
        if bad:
            print(f"unknown famil{'ies' if len(bad) > 1 else 'y'} {', '.join(bad)}; choose from {','.join(FAMILIES)}",
                  file=sys.stderr)
            return 2
        cases = [c for c in cases if c.family in families]
    if args.only:
        cases = [c for c in cases if any(t in c.name or t in c.shape for t in args.only)]
    if not cases:
        print("no case selected", file=sys.stderr)
        return 2

    model_rows, model_env = [], {}
    if Path(args.model).exists():
        model_rows, model_env = load_model(args.model)
    else:
        print(f"no model JSON at {args.model}: measured figures only (write it with python benchmarks/gpu_model.py "
              f"{'--quick ' if args.quick else ''}--json {args.model})", file=sys.stderr)
    gpu = torch.cuda.get_device_name()
    model_gpu = model_env["gpu"].get("name", "H200") if isinstance(model_env.get("gpu"), dict) else "H200"
    env = dict(gpu=gpu, torch=torch.__version__, triton=triton.__version__, cuda=torch.version.cuda,
               python=platform.python_version(), model=str(args.model), model_command=model_env.get("command"),
               model_gpu=model_env.get("gpu"), budget_s=args.budget, miss=MISS,
               command=" ".join(["python", "benchmarks/gpu/compare_model.py",
                                 *(argv if argv is not None else sys.argv[1:])]))
    print(f"{len(cases)} case(s) on {gpu} (torch {torch.__version__}, triton {triton.__version__}); "
          f"predictions: {args.model} ({len(model_rows)} rows)")
    if "H200" not in gpu:
        print(f"note: the model predicts an {model_gpu}; expect measured / predicted to move with this GPU's "
              "bandwidth and FLOP rate")

    torch.manual_seed(0)
    flush = torch.empty(FLUSH_BYTES, dtype=torch.int8, device="cuda")
    measured, not_started = [], []

    def write_json():
        if args.json:
            env.update(not_started=[f"{c.name} {c.shape} {c.dtype}" for c in not_started],
                       elapsed_s=time.monotonic() - _T0)
            Path(args.json).write_text(json.dumps(dict(env=env, rows=compare(model_rows, measured)), indent=1))

    for i, case in enumerate(cases):
        if i and time.monotonic() - _T0 > args.budget:
            not_started = cases[i:]
            break
        print(f"[{i + 1}/{len(cases)}] {case.name} {case.shape} {case.dtype} ...", end=" ", flush=True)
        rec = measure_case(case, flush)
        measured.append(rec)
        done = ("ERR" if rec["error"] else f"{rec['measured_us']:.1f} us") + (
            "" if case.torch_run is None else
            ", torch " + ("ERR" if rec["torch_error"] else f"{rec['torch_measured_us']:.1f} us"))
        print(f"{done} ({rec['seconds']:.1f} s)", flush=True)
        write_json()
    write_json()

    rows = compare(model_rows, measured)
    print()
    print(format_table(rows, args.markdown))
    lines = summary(rows)
    if not_started:
        lines.append(f"budget of {args.budget:g} s exceeded: {len(not_started)} case(s) not started: "
                     + "; ".join(f"{c.name} {c.shape} {c.dtype}" for c in not_started))
    if lines:
        print("\n" + "\n".join(lines))
    print(f"\n{len(rows)} case(s) in {time.monotonic() - _T0:.0f} s on {gpu}")
    return 1 if any(r["error"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
