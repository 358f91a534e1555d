#!/usr/bin/env python
"""Softmax into a uint8 quantizer (fake-quant qdq, the codes alone, quantized attention) under eager, Inductor, smx
(the site kept by default), smx-rewrite (lowered to smx::quant_softmax) and the op called directly; by time and peak
memory, every result checked against eager. CPU, and CUDA when present. Cases, shapes, checks: docs/PERFORMANCE.md
("Quantized softmax on CPU: smx vs Inductor").

  python benchmarks/bench_quant_softmax.py [--quick] [--cases qdq,codes,attention] [--shapes ...] [--backends ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from typing import Any, Callable

import torch
import torch.ao.quantization.fx._decomposed  # noqa: F401  (registers torch.ops.quantized_decomposed)

import common
from common import MB, NOISY, Quiet, Row, compile_for, fmt_ms, n_reports, shown, sites_since, time_row

QD = torch.ops.quantized_decomposed
SCALE, ZP, QMIN, QMAX, QDTYPE = 1.0 / 255, 0, 0, 255, torch.uint8
HEAD_DIM = 64
SM_SCALE = 1.0 / math.sqrt(HEAD_DIM)   # 0.125
SLOWER = 1.05
TIE_FRAC, TIE_MIN = 1e-4, 4            # rounding ties allowed: max(TIE_MIN, TIE_FRAC * elems)
CASES = ("qdq", "codes", "attention")
ALL_BACKENDS = ("eager", "inductor", "smx", "smx-rewrite", "op")
CPU_BACKENDS = ("eager", "inductor", "smx", "smx-rewrite")
#: name -> (dims, wide?, what it stands for); attention shapes are (batch, heads, queries, keys)
SHAPES: dict[str, tuple[tuple[int, ...], bool, str]] = {
    "8x12x128x128": ((8, 12, 128, 128), False, "batch 8 x 12 heads x 128 queries over 128 keys"),
    "4x16x512x512": ((4, 16, 512, 512), False, "batch 4 x 16 heads x 512 queries over 512 keys"),
    "2x16x1024x1024": ((2, 16, 1024, 1024), False, "batch 2 x 16 heads x 1024 queries over 1024 keys"),
    "4x8x1x4096": ((4, 8, 1, 4096), False, "decode: 32 rows of one query over 4096 keys"),
    "64x32000": ((64, 32000), True, "64 rows x a 32000 vocabulary"),
    "8x131072": ((8, 131072), True, "8 rows x a 128K vocabulary"),
}
QUICK = [("qdq", "4x16x512x512"), ("codes", "64x32000"), ("attention", "4x16x512x512")]


def shape_label(name: str) -> str:
    dims = SHAPES[name][0]
    return f"{'x'.join(map(str, dims[:-1]))} x {dims[-1]}"


def f_qdq(x):
    q = QD.quantize_per_tensor(torch.softmax(x, -1), SCALE, ZP, QMIN, QMAX, QDTYPE)
    return QD.dequantize_per_tensor(q, SCALE, ZP, QMIN, QMAX, QDTYPE)


def f_codes(x):
    return QD.quantize_per_tensor(torch.softmax(x, -1), SCALE, ZP, QMIN, QMAX, QDTYPE)


def f_attention(q, k, v):
    s = q @ k.transpose(-2, -1) * SM_SCALE
    p = QD.quantize_per_tensor(torch.softmax(s, -1), SCALE, ZP, QMIN, QMAX, QDTYPE)
    return QD.dequantize_per_tensor(p, SCALE, ZP, QMIN, QMAX, QDTYPE) @ v


def op(x, logit_scale=1.0):
    return torch.ops.smx.quant_softmax(x, -1, logit_scale, SCALE, ZP, QMIN, QMAX, QDTYPE, None)


def op_qdq(x):
    return QD.dequantize_per_tensor(op(x), SCALE, ZP, QMIN, QMAX, QDTYPE)


def op_attention(q, k, v):
    return QD.dequantize_per_tensor(op(q @ k.transpose(-2, -1), SM_SCALE), SCALE, ZP, QMIN, QMAX, QDTYPE) @ v


FUNCS: dict[str, tuple[Callable, Callable]] = {"qdq": (f_qdq, op_qdq), "codes": (f_codes, op),
                                               "attention": (f_attention, op_attention)}


def make_inputs(case: str, shape: str, device: str) -> tuple[torch.Tensor, ...]:
    """q, k, v ~ N(0, 1) (scores of std 1); wide rows 4 N(0, 1), peaked like LM logits (at std 1 every
    32000-wide probability is below half a step: every code would be 0)."""
    dims, wide, _ = SHAPES[shape]
    gen = torch.Generator().manual_seed(0)
    if case == "attention":
        b, h, lq, lk = dims
        qkv = [torch.randn(b, h, n, HEAD_DIM, generator=gen) for n in (lq, lk, lk)]
        return tuple(t.to(device) for t in qkv)
    return ((torch.randn(*dims, generator=gen) * (4.0 if wide else 1.0)).to(device),)


def check(case: str, got: torch.Tensor, ref: torch.Tensor, inputs: tuple, elems: int) -> tuple[bool, int, str]:
    """(ok, differing entries / rows, a note) against eager: codes at most one level off, qdq values at most one
    step, attention rows within fp32 noise, except at rounding ties in at most max(4, 1e-4 x elems) entries."""
    if not isinstance(got, torch.Tensor) or got.shape != ref.shape or got.dtype != ref.dtype:
        return False, -1, f"got {type(got).__name__} {getattr(got, 'dtype', '')} {tuple(getattr(got, 'shape', ()))}, " \
                          f"eager {ref.dtype} {tuple(ref.shape)}"
    lim = max(TIE_MIN, int(TIE_FRAC * elems))
    if case == "codes":
        d = (got.to(torch.int32) - ref.to(torch.int32)).abs()
        n, mx = int((d > 0).sum().item()), int(d.max().item()) if d.numel() else 0
        return mx <= 1 and n <= lim, n, f"max {mx} level(s), {n} codes differ (<= {lim} allowed)"
    if case == "qdq":
        nan_ok = torch.equal(got.isnan(), ref.isnan())
        d = (got.float() - ref.float()).abs().nan_to_num(0.0)
        n, mx = int((d > 1e-7).sum().item()), d.max().item() if d.numel() else 0.0
        return nan_ok and mx <= SCALE + 1e-6 and n <= lim, n, \
            f"max |diff| {mx / SCALE:.3f} step, {n} values differ (<= {lim} allowed)"
    row_err = (got.float() - ref.float()).abs().nan_to_num(float("inf")).amax(-1)
    fp_tol = 1e-5 + 1e-4 * ref.abs().max().item()
    n, mx = int((row_err > fp_tol).sum().item()), row_err.max().item()
    lim_err = fp_tol + 2 * SCALE * inputs[2].abs().max().item()  # a code one level off moves a row <= max|v| / 255
    return mx <= lim_err and n <= lim, n, f"max |diff| {mx:.3g} ({lim_err:.3g} allowed), {n} rows beyond " \
                                          f"{fp_tol:.2g} (<= {lim} allowed)"


@dataclasses.dataclass
class QRow(Row):
    elems: int = 0
    compile_s: dict[str, float] = dataclasses.field(default_factory=dict)   # compile + first call
    peak_mb: dict[str, float] = dataclasses.field(default_factory=dict)
    diffs: dict[str, int] = dataclasses.field(default_factory=dict)        # entries / rows differing from eager
    notes: dict[str, str] = dataclasses.field(default_factory=dict)        # the check's note per backend
    reasons: dict[str, str] = dataclasses.field(default_factory=dict)      # smx site reasons (kept / skipped)

    def record(self) -> dict[str, Any]:
        d = super().record()
        del d["pass"], d["max_err"]
        d["ratio_vs_inductor_min"] = {b: self.ratio(b, self.min_ms) for b in self.min_ms if self.min_ms.get("inductor")}
        return d


def describe(sites: list) -> tuple[str, str]:
    """(actions, reasons) of the quant_softmax sites among ``sites``."""
    qs = [s for s in sites if s.kind == "quant_softmax"]
    if not qs:
        other = sorted({f"{s.kind} {s.action}" for s in sites})
        return "no quant_softmax site" + (f" ({', '.join(other)})" if other else ""), ""
    n = f" x{len(qs)}" if len(qs) > 1 else ""
    return ",".join(sorted({s.action for s in qs})) + n, " | ".join(sorted({s.reason for s in qs if s.reason}))


def bench(device: str, case: str, shape: str, backends: list[str], args, quiet: Quiet, log) -> tuple[QRow, list[str]]:
    """One row; -> (row, errors: smx-rewrite sites that were not rewritten)."""
    inputs = make_inputs(case, shape, device)
    elems = math.prod(SHAPES[shape][0])
    fn, op_fn = FUNCS[case]
    row, errors = QRow(device, shape, case, "fwd", elems=elems), []
    torch._dynamo.reset()
    with torch.no_grad():
        ref = fn(*inputs)
        compiled: dict[str, Callable] = {}
        for b in backends:
            compiled[b] = op_fn if b == "op" else compile_for(b, fn)
            n0, t0 = n_reports(), time.perf_counter()
            got = compiled[b](*inputs)
            if device == "cuda":
                torch.cuda.synchronize()
            row.compile_s[b] = time.perf_counter() - t0
            if b in ("smx", "smx-rewrite"):
                row.action[b], why = describe(sites_since(n0)[0])
                if why:
                    row.reasons[b] = why
                if b == "smx-rewrite" and row.action[b] != "rewritten":
                    errors.append(f"{device} {case} {shape}: {b} did not rewrite the site: {row.action[b]} {why}")
            if b != "eager":
                ok, row.diffs[b], row.notes[b] = check(case, got, ref, inputs, elems)
                row.max_err[b] = float(row.diffs[b])
                if not ok:
                    row.mismatch.append(b)
            del got
        time_row(row, {b: ("f(*a)", {"f": compiled[b], "a": inputs}) for b in backends}, args, quiet, log)
        if args.memory:
            for b in backends:
                row.peak_mb[b] = common.peak_mb(lambda f=compiled[b]: f(*inputs), device)
    torch._dynamo.reset()
    return row, errors


TITLES = {
    "qdq": "qdq: dequantize(quantize(softmax(x, -1), 1/255, 0, 0, 255, uint8)) -> fp32",
    "codes": "codes: quantize(softmax(x, -1), 1/255, 0, 0, 255, uint8) -> uint8",
    "attention": "attention: dequantize(quantize(softmax(q @ k^T * 0.125, -1))) @ v, head dim 64",
}


def table_rows(rows: list[QRow], backends: list[str]) -> tuple[list[str], list[list[str]]]:
    head = ["shape", "elems"] + [f"{b} ms" + ("" if b == "inductor" else " (/ind)") for b in backends]
    out = []
    for r in rows:
        oth = "-" if r.others is None else f"{r.others:.2f}" + (" *" if r.others > NOISY else "")
        out.append([shape_label(r.shape), f"{r.elems / 1e6:.2f}M" if r.elems >= 1e5 else str(r.elems)]
                   + [fmt_ms(r, b) for b in backends]
                   + [oth, "; ".join(f"{b}: {r.action[b]}" for b in ("smx", "smx-rewrite") if b in r.action),
                      ", ".join(f"{b} {n}" for b, n in r.diffs.items() if n) or "-"])
    return head + ["others", "smx did", "diffs"], out


def memory_rows(rows: list[QRow], backends: list[str]) -> tuple[list[str], list[list[str]]]:
    head = ["case", "shape", "fp32 probs MB", "uint8 codes MB"] + [f"{b} MB" for b in backends]
    return head, [[r.case, shape_label(r.shape), f"{r.elems * 4 / MB:.1f}", f"{r.elems / MB:.1f}"]
                  + [f"{r.peak_mb[b]:.1f}" if b in r.peak_mb else "-" for b in backends] for r in rows if r.peak_mb]


def summary(rows: list[QRow], stat: str) -> list[str]:
    """Per device, case and backend (smx-rewrite, op): geometric mean and range of time / inductor's."""
    out = []
    for device in ("cpu", "cuda"):
        for b in ("smx-rewrite", "op"):
            for case in CASES:
                rs = [r for r in rows if r.device == device and r.case == case and r.ratio(b)]
                if not rs:
                    continue
                ratios = [r.ratio(b) for r in rs]
                best, worst = min(rs, key=lambda r: r.ratio(b)), max(rs, key=lambda r: r.ratio(b))
                geo = math.exp(sum(math.log(v) for v in ratios) / len(ratios))
                out.append(f"{device} {case:9s} {b:11s} / inductor ({stat} ms): geomean {geo:.2f}x over "
                           f"{len(rs)} shape(s), {min(ratios):.2f}x ({shape_label(best.shape)}) .. {max(ratios):.2f}x "
                           f"({shape_label(worst.shape)})")
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    common.timing_flags(p, 3, 0.2, "smoke run: " + ", ".join(f"{c} {s}" for c, s in QUICK)
                        + "; one short round each (numbers are rough); --cases / --shapes narrow it further")
    p.add_argument("--cases", type=common.choice_list(CASES), metavar="LIST",
                   help=f"comma-separated subset of {','.join(CASES)} (default: all)")
    p.add_argument("--shapes", nargs="+", choices=list(SHAPES), metavar="SHAPE",
                   help="subset of shapes (default: all; attention runs on the 4-d ones only): "
                        + "; ".join(f"{k} ({v[2]})" for k, v in SHAPES.items()))
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto (default): CPU, and CUDA too when available; or only one of them")
    p.add_argument("--backends", type=common.choice_list(ALL_BACKENDS), metavar="LIST",
                   help=f"comma-separated subset of {','.join(ALL_BACKENDS)} (default: {','.join(CPU_BACKENDS)} on "
                        f"CPU, {','.join(ALL_BACKENDS)} on CUDA). inductor is always added: it is the yardstick")
    p.add_argument("--no-memory", dest="memory", action="store_false",
                   help="skip the peak-memory measurement (3 more calls per backend and row)")
    common.add_noise_flags(p)
    p.add_argument("--stat", choices=("median", "min"), default="median",
                   help="figure the tables, ratios and summary show: the median block (default) or the fastest block "
                        "(less sensitive to other processes' load); the JSON has both")
    return p.parse_args(argv)


def plan(args) -> list[tuple[str, str]]:
    """(case, shape) pairs to run; attention on the 4-d shapes only."""
    cases = args.cases or list(CASES)
    if args.quick and not args.shapes:
        return [(c, s) for c, s in QUICK if c in cases]
    return [(c, s) for c in cases for s in args.shapes or list(SHAPES) if not (c == "attention" and SHAPES[s][1])]


def print_tables(rows: list[QRow], devices: list[str], backends_for, env: dict, args) -> None:
    reasons: dict[str, None] = {}
    for device in devices:
        where = env["cuda"] if device == "cuda" else env["cpu"]
        for case in CASES:
            cr = [r for r in rows if r.device == device and r.case == case]
            if cr:
                common.print_table(f"{TITLES[case]} -- {device} ({where}, {args.threads} threads, {args.stat} ms)",
                                   *table_rows(shown(cr, args.stat), backends_for(device)), args.markdown)
            reasons.update({f"{device} {b}: {r.action[b]}: {why}": None for r in cr for b, why in r.reasons.items()})
        head, body = memory_rows([r for r in rows if r.device == device], backends_for(device))
        if body:
            common.print_table(f"peak memory of one call above the memory in use before it (MB) -- {device}", head,
                               body, args.markdown)
    if reasons:
        print("\nsmx's reasons (smxcompile.last_report()):" + "".join(f"\n  {r}" for r in reasons))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.rounds = args.rounds or (1 if args.quick else 3)
    args.min_run_time = args.min_run_time or (0.05 if args.quick else 0.2)
    todo = plan(args)
    if not todo:
        print("nothing to run: attention needs a 4-d (batch x heads x queries x keys) shape", file=sys.stderr)
        return 2
    devices = common.devices(args.device)
    torch.set_num_threads(args.threads)
    command, env = common.command_line(), common.environment(args.threads)
    common.print_header(command, env, "the `others` column says which rows they disturbed")
    print(f"timing: torch.utils.benchmark blocked_autorange, {args.rounds} interleaved round(s) x "
          f"{args.min_run_time}s per backend; tables: {args.stat} ms; (/ind) = ratio to inductor, < 1 faster",
          flush=True)
    t_start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"  [{time.perf_counter() - t_start:6.1f}s] {msg}", flush=True)

    def backends_for(device: str) -> list[str]:
        if args.backends:
            return [b for b in ALL_BACKENDS if b in args.backends or b == "inductor"]
        return list(CPU_BACKENDS if device == "cpu" else ALL_BACKENDS)

    quiet = Quiet(args.wait_quiet, args.wait_budget, log)
    result: dict[str, Any] = {"command": command, "env": env, "rounds": args.rounds, "table_stat": args.stat,
                              "min_run_time": args.min_run_time, "noisy_threshold_cores": NOISY,
                              "quant": {"scale": SCALE, "zero_point": ZP, "quant_min": QMIN, "quant_max": QMAX,
                                        "dtype": str(QDTYPE)}, "rows": []}
    rows: list[QRow] = []
    errors: list[str] = []
    for device in devices:
        backends = backends_for(device)
        for case, shape in todo:
            try:
                row, errs = bench(device, case, shape, backends, args, quiet, log)
            except Exception as e:  # keep the finished rows; say what failed
                log(f"{device} {case} {shape}: FAILED {type(e).__name__}: {e}")
                errors.append(f"{device} {case} {shape}: {type(e).__name__}: {e}")
                torch._dynamo.reset()
                continue
            errors.extend(errs)
            rows.append(row)
            log(f"{device} {case} {shape_label(shape)}: " + ", ".join(f"{b} {fmt_ms(row, b)}" for b in backends)
                + ("" if row.others is None else f", others {row.others:.2f}")
                + f"; smx: {row.action.get('smx', '-')}, smx-rewrite: {row.action.get('smx-rewrite', '-')}"
                + "; compile s: " + ", ".join(f"{b} {s:.1f}" for b, s in row.compile_s.items() if b != "eager"))
            result.update(rows=[r.record() for r in rows], errors=errors)
            common.write_json(args.json, result)
    print_tables(rows, devices, backends_for, env, args)
    env["loadavg_at_end"] = common.loadavg()
    noisy = [r for r in rows if r.others is not None and r.others > NOISY]
    print(f"\nload average at start {env.get('loadavg_at_start')}, at end {env.get('loadavg_at_end')} "
          f"({env['cores']} cores); {len(noisy)} of {len(rows)} rows were timed while other processes used "
          f"> {NOISY} cores (marked *)" + (f"; waited {quiet.waited:.0f} s for quiet" if quiet.waited else ""))
    summ = summary(shown(rows, args.stat), args.stat)
    print("\nsummary (time / inductor's; > 1: slower than Inductor):" + "".join(f"\n  {s}" for s in summ))
    slow = [line for r in rows if (line := common.slower_line(r, "smx", SLOWER,
                                                               f"{r.device} {r.case} {shape_label(r.shape)}"))]
    print(f"\nsmx (default options) slower than Inductor (ratio > {SLOWER}):" + ("" if slow else " none")
          + "".join(f"\n  {s}" for s in slow))
    result.update(summary=summ, slower_than_inductor=slow, errors=errors, rows=[r.record() for r in rows])
    common.write_json(args.json, result)
    bad = [r for r in rows if r.mismatch]
    for r in bad:
        print(f"MISMATCH vs eager: {r.device} {r.case} {shape_label(r.shape)}: "
              + "; ".join(f"{b}: {r.notes[b]}" for b in r.mismatch))
    for e in errors:
        print(f"ERROR: {e}")
    print(f"\n$ {command}   ({time.perf_counter() - t_start:.0f} s)" + (f"\nwrote {args.json}" if args.json else ""))
    return 1 if bad or errors else 0


if __name__ == "__main__":
    sys.exit(main())
