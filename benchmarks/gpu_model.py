#!/usr/bin/env python
"""What every Triton kernel of smxcompile moves and computes on a GPU, counted on a CPU through Triton's interpreter
(gpu_traffic.py), next to torch's own path traced through the same L2 model (gpu_torch_paths.py), and the roofline
prediction of both on an H200. Columns, method and figures: docs/PERFORMANCE.md ("GPU model"). Exits 1 when a case
exceeds its bound.

Usage:
  python benchmarks/gpu_model.py [--quick] [--families LIST] [--only TEXT] [--json PATH] [--plot PATH] [--markdown]
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton decorates the kernels

import argparse  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from gpu_cases import FAMILIES, Case, all_cases  # noqa: E402
from gpu_torch_paths import Tracer  # noqa: E402
from gpu_traffic import H200, count_traffic  # noqa: E402

from smxcompile.kernels.triton_helpers import plan_for_sms  # noqa: E402


def launch_us(x, bytes_hbm: float, gpu=H200) -> float:
    """One launch's time (us): the larger of its DRAM and tensor-core time, and of its programs' bytes over the SMs
    they run on (a launch without a grid, a torch op traced as a stream, has no such bound), plus a launch."""
    t = max(bytes_hbm / gpu.hbm_bytes_per_s, x.flops / gpu.flops_per_s) * 1e6 + gpu.launch_us
    if not x.grid:
        return t
    sms = min(x.programs, gpu.sms)
    return max(t, (x.bytes_loaded + x.bytes_stored) / (sms * gpu.sm_bytes_per_s) * 1e6 + gpu.launch_us)


def traffic_us(tr, gpu=H200) -> float:
    """The time of every launch of ``tr`` (one launch does not hide another's), summed."""
    return sum(launch_us(x, h, gpu) for x, h in zip(tr.launches, tr.launch_hbm()))


def measure(case: Case, axis_cap: int = 6, loop_cap: int = 8) -> dict:
    """Count one case and return its record."""
    axis_cap, loop_cap = max(axis_cap, case.caps[0]), max(loop_cap, case.caps[1])
    inputs = case.make("cpu")
    t0 = time.perf_counter()
    with plan_for_sms(H200.sms), count_traffic(H200, axis_cap=axis_cap, loop_cap=loop_cap) as tr:
        case.run(inputs)
    seconds = time.perf_counter() - t0
    del inputs
    loaded, stored, hbm, pred = tr.bytes_loaded, tr.bytes_stored, tr.bytes_hbm, traffic_us(tr)
    tracer = Tracer(H200, axis_cap=axis_cap, loop_cap=loop_cap)
    case.torch_trace(tracer)
    tt = tracer.traffic
    torch_pred = traffic_us(tt)
    exact = Tracer(H200, axis_cap=1 << 30, loop_cap=1 << 30)  # torch's trace unsampled: the sampling error
    case.torch_trace(exact)
    kernels = [x for x in tr.launches if not x.kernel.startswith("aten.")]
    rec = dict(
        family=case.family, kernel=case.kernel, case=case.name, shape=case.shape, dtype=case.dtype,
        bytes_loaded=loaded, bytes_stored=stored, bytes_atomic=tr.total("bytes_atomic"), bytes_hbm=hbm,
        bytes_min=case.bytes_min, ratio=(loaded + stored) / case.bytes_min, hbm_ratio=hbm / case.bytes_min,
        launches=len(tr.launches), flops=tr.flops, flops_min=case.flops_min,
        flops_ratio=tr.flops / case.flops_min if case.flops_min else None,
        bound=case.bound, predicted_us=pred, torch_predicted_us=torch_pred, speedup_vs_torch=torch_pred / pred,
        roofline_frac=((case.bytes_min / H200.hbm_bytes_per_s * 1e6 + H200.launch_us) / pred
                       if case.memory_bound else None),
        torch_path=case.torch_what, torch_bytes=tt.bytes_loaded + tt.bytes_stored, torch_bytes_hbm=tt.bytes_hbm,
        torch_bytes_hbm_exact=exact.traffic.bytes_hbm, caps=[axis_cap, loop_cap],
        torch_flops=tt.flops, torch_launches=len(tt.launches),
        torch_detail=[dict(kernel=x.kernel, bytes_hbm=h, flops=x.flops) for x, h in zip(tt.launches, tt.launch_hbm())],
        logits_bytes_stored=float(sum(x.bytes_stored for x in kernels)) if case.logits_stored else None,
        note=case.note,
        detail=[dict(kernel=x.kernel, grid=list(x.grid), programs=x.programs, programs_run=x.programs_run,
                     bytes_loaded=x.bytes_loaded, bytes_stored=x.bytes_stored, bytes_atomic=x.bytes_atomic,
                     bytes_hbm=h, flops=x.flops) for x, h in zip(tr.launches, tr.launch_hbm())],
        count_seconds=seconds,
    )
    rec["checked"] = rec["ratio"] if case.memory_bound else rec["flops_ratio"]
    rec["within_bound"] = rec["checked"] <= case.bound * 1.001
    return rec


def fmt_bytes(b: float) -> str:
    for unit, f in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if b >= f:
            return f"{b / f:.3g} {unit}"
    return f"{b:.0f} B"


COLUMNS = ["case", "shape", "dtype", "loaded", "stored", "hbm", "min", "ratio", "launches", "TFLOP", "pred us",
           "torch us", "x torch", "roof", "sampling"]


def row_cells(r: dict) -> list[str]:
    return [r["case"], r["shape"], r["dtype"], fmt_bytes(r["bytes_loaded"]), fmt_bytes(r["bytes_stored"]),
            fmt_bytes(r["bytes_hbm"]), fmt_bytes(r["bytes_min"]), f"{r['ratio']:.2f}", str(r["launches"]),
            f"{r['flops'] / 1e12:.3g}" if r["flops"] else "-", f"{r['predicted_us']:.1f}",
            f"{r['torch_predicted_us']:.1f}", f"{r['speedup_vs_torch']:.2f}x",
            f"{r['roofline_frac']:.0%}" if r["roofline_frac"] is not None else "-",
            f"{r['torch_bytes_hbm'] / r['torch_bytes_hbm_exact']:.2f}"]


def plot(rows: list[dict], path: str) -> None:
    """Per case: bytes over the op's minimum, and torch's predicted time over ours (log scales)."""
    plt = common.pyplot()
    if plt is None:
        print(common.NO_MATPLOTLIB, file=sys.stderr)
        return
    y = np.arange(len(rows))
    fig, axes = plt.subplots(1, 2, figsize=(13, 0.32 * len(rows) + 1.6), sharey=True)
    for ax, key, line, label in zip(axes, ("ratio", "speedup_vs_torch"), (1.25, 1.0),
                                    ("(loaded + stored) / the op's minimum", "predicted time: torch's / ours")):
        ax.barh(y, [r[key] for r in rows])
        ax.axvline(line, color="k", lw=0.8)
        ax.set_xscale("log")
        ax.set_xlabel(f"{label} (log)")
    axes[0].set_yticks(y, [f"{r['case']} {r['shape']} {r['dtype']}" for r in rows], fontsize=7)
    axes[0].invert_yaxis()
    print(common.save_figure(fig, path, dpi=110))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="one small case per family (CI smoke, ~25 s)")
    p.add_argument("--families", type=common.choice_list(FAMILIES), metavar="LIST", help=",".join(FAMILIES))
    p.add_argument("--only", metavar="TEXT", action="append", help="cases whose 'name shape dtype' contains TEXT")
    p.add_argument("--json", metavar="PATH", help="write one record per case (and the environment) as JSON")
    p.add_argument("--plot", metavar="PATH", help="write the bytes-ratio and predicted-speedup chart (PNG)")
    p.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    cases = [c for c in all_cases(quick=args.quick) if not args.families or c.family in args.families]
    cases = [c for c in cases if not args.only or any(t in f"{c.name} {c.shape} {c.dtype}" for t in args.only)]
    if not cases:
        print("no case selected", file=sys.stderr)
        return 2
    rows, t0 = [], time.perf_counter()
    for i, case in enumerate(cases, 1):
        print(f"[{i}/{len(cases)}] {case.name} {case.shape} {case.dtype} ...", end=" ", flush=True)
        rows.append(measure(case))
        print(f"{rows[-1]['count_seconds']:.1f} s", flush=True)
    common.print_table(f"GPU model (predictions for an {H200.name})", COLUMNS, [row_cells(r) for r in rows],
                       args.markdown)
    beyond = [r for r in rows if not r["within_bound"]]
    if beyond:
        print("\nBEYOND THE DOCUMENTED BOUND (bytes / min, or FLOPs / useful FLOPs for tl.dot kernels): "
              + "; ".join(f"{r['case']} {r['shape']} {r['dtype']} {r['checked']:.2f} > {r['bound']:.2f}"
                          for r in beyond))
    print(f"\n{len(rows)} case(s) in {time.perf_counter() - t0:.0f} s")
    env = dict(common.environment(), gpu=H200.__dict__, command=common.command_line(argv, "benchmarks/gpu_model.py"))
    common.write_json(args.json, dict(env=env, rows=rows))
    if args.plot:
        plot(rows, args.plot)
    return 1 if beyond else 0


if __name__ == "__main__":
    sys.exit(main())
