#!/usr/bin/env python
"""Quantized softmax, side by side: eager vs Inductor vs the ``smx`` backend (CPU, and CUDA when present).

A softmax whose output goes straight into a uint8 quantizer (``smxcompile.quantize_softmax`` emits this;
so do PyTorch 2 export quantization flows) is what the smx pass ``quant_softmax`` lowers to
``smx::quant_softmax``: softmax and quantization in one pass that writes the one-byte codes and never
the fp32 probabilities (smxcompile/kernels/quant_softmax/; on CUDA a Triton kernel). On CPU the default
policy (``cpu="auto"``) KEEPS the site, on the claim that Inductor already fuses softmax + quantize (+
dequantize) into one C++ loop and the op is an opaque call there; ``options={"cpu": "rewrite"}`` lowers
it anyway. This benchmark measures that claim, and the op on CUDA.

Cases (--cases), uint8 codes, scale 1/255, zero point 0, range [0, 255], softmax over the last dim:

  qdq        dequantize_per_tensor(quantize_per_tensor(softmax(x, -1), 1/255, 0, 0, 255, uint8), ...)
             (torch.ops.quantized_decomposed): what smxcompile.quantize_softmax puts in a model, i.e.
             fake-quant inference; the output is fp32.
  codes      quantize_per_tensor(softmax(x, -1), ...) alone: the uint8 codes are the output (the
             deployment case: the next op consumes integers).
  attention  dequantize(quantize(softmax(q @ k.transpose(-2, -1) * 0.125, -1))) @ v, head dim 64
             (attention shapes only).

Shapes (--shapes), fp32, x ~ N(0, 1) for attention shapes (q, k, v ~ N(0, 1): scores of std 1) and
x ~ 4 * N(0, 1) for the wide rows (peaked like LM logits; at std 1 every 32000-wide probability is
below half a step and every code would be 0):

  8x12x128x128     batch 8 x 12 heads x 128 queries over 128 keys (BERT-base at 128 tokens)
  4x16x512x512     batch 4 x 16 heads x 512 queries over 512 keys
  2x16x1024x1024   batch 2 x 16 heads x 1024 queries over 1024 keys (134 MB of fp32 probabilities)
  4x8x1x4096       decode: 32 (batch x heads) rows of one query over 4096 cached keys
  64x32000         wide rows: 64 x a 32000 vocabulary (qdq, codes only)
  8x131072         wide rows: 8 x a 128K vocabulary (qdq, codes only)

Backends (columns), each compiled with dynamic=False and its own copy of the function's code object:

  eager        the plain PyTorch function (quantized_decomposed ops: several elementwise passes).
               The reference of every check.
  inductor     torch.compile(f): the yardstick of every ratio (/ind).
  smx          torch.compile(f, backend="smx"), default options: on CPU the site is kept (Inductor
               compiles the original: should read like inductor); kept on CUDA too (cuda="auto").
  smx-rewrite  torch.compile(f, backend="smx", options={"cpu": "rewrite", "cuda": "rewrite"}): the site lowered to the
               opaque smx::quant_softmax call on CPU too (its CPU path: ATen's softmax + torch ops;
               Inductor compiles the rest: the dequantize, the q @ k^T scale, the matmuls); Triton on CUDA.
  op           torch.ops.smx.quant_softmax called directly, no compile (dequantize and matmuls in eager;
               attention passes the 0.125 as the op's logit_scale). Default on CUDA only (--backends
               adds it on CPU).

Columns:

  case, shape  as above; "elems" is the number of probabilities.
  <b> ms       milliseconds per call (no_grad), the median over every timed block of
               torch.utils.benchmark.Timer.blocked_autorange (the backends of a row timed in turn for
               --rounds rounds, alternating the order); with --stat min the fastest block instead (the
               least disturbed: use it on a busy machine). The JSON has both (ms, min_ms) and the IQR.
  (0.85x)      that time divided by inductor's in the same row: below 1 is faster than Inductor.
  !            the backend's result failed the check against eager (done once, before timing):
                 codes:     same dtype and shape; codes differ by at most 1 level, in at most
                            max(4, 1e-4 x elems) entries (rounding ties: a probability a few ulps from a
                            k + 0.5 step boundary can round either way in another softmax implementation);
                 qdq:       every value within one step (1/255 + 1e-6) of eager's, and at most
                            max(4, 1e-4 x elems) values differ at all;
                 attention: every output within 1e-5 + 1e-4 max|eager's| of eager's, except in at most
                            max(4, 1e-4 x elems) rows (a code one level off in a row moves its output by
                            at most 1/255 max|v|), which must be within 2/255 max|v| more.
  others       cores' worth of CPU that OTHER processes used while the row was timed (machine busy time
               from /proc/stat minus this process's). Above 0.1 the row shared the CPUs and its times
               are inflated (marked *): rerun with --wait-quiet / --retry-noisy, or read --stat min.
  smx did      what the smx backend reported for the site (smxcompile.last_report(), every graph
               compiled for the row): "rewritten" (smx::quant_softmax runs) or "kept" / "skipped";
               the reasons are printed once under the tables.
  diffs        entries (codes / qdq) or rows (attention) that differ from eager at all, per backend
               with any ("-": none); all within the check's limits unless the row has a "!".

A last table gives the peak memory of one call above the memory in use before it (inputs and compiled
code resident; --no-memory skips it), MB = 10^6 bytes, next to the size of the fp32 probabilities and of
the uint8 codes. CPU: the process's peak RSS (VmHWM after clear_refs, freed heap returned to the OS first
with malloc_trim; the least of 3 calls). CUDA: torch.cuda.max_memory_allocated.

At the end: per case, the geometric mean and range of smx-rewrite / inductor (the op against Inductor's
fused code: above 1 justifies keeping the site by default, as cpu="auto" and cuda="auto" do) and of
op / inductor on CUDA; the rows where smx (default options) is slower than Inductor by > 5%. The exit
status is 1 when a result failed its check, a case raised, or the smx-rewrite site was not rewritten.

Usage:
  python benchmarks/bench_quant_softmax.py --quick       # 3 rows: qdq and attention at 4x16x512x512, codes
                                                         # at 64x32000; one short round (~1 min on CPU)
  python benchmarks/bench_quant_softmax.py               # every case and shape (~5 min on 2 quiet cores)
  python benchmarks/bench_quant_softmax.py --threads 1 --stat min --retry-noisy 1 --markdown   # busy machine
  python benchmarks/bench_quant_softmax.py --device cuda --quick --json out.json                # GPU smoke run
  python benchmarks/bench_quant_softmax.py --cases codes --shapes 64x32000 8x131072 --backends eager,inductor,smx-rewrite,op
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import shlex
import sys
import time
from typing import Any, Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# timing, tables, environment, per-backend compile (bench_softmax.py); the CPU-load meter, quiet-wait,
# peak memory and smx report helpers (bench_softmax_topk.py, bench_linear_ce.py)
from bench_softmax import Row, _cores, _fmt_ms, _write_json, compile_for, environment, measure_interleaved  # noqa: E402
from bench_softmax import n_reports, print_table  # noqa: E402
from bench_softmax_topk import Meter, Quiet, peak_mb, shown, sites_since  # noqa: E402
from bench_linear_ce import NOISY  # noqa: E402

import torch.ao.quantization.fx._decomposed  # noqa: E402,F401  (registers torch.ops.quantized_decomposed)

QD = torch.ops.quantized_decomposed
SCALE, ZP, QMIN, QMAX, QDTYPE = 1.0 / 255, 0, 0, 255, torch.uint8
HEAD_DIM = 64
SM_SCALE = 1.0 / math.sqrt(HEAD_DIM)   # 0.125
MB = 1e6
SLOWER = 1.05
TIE_FRAC, TIE_MIN = 1e-4, 4            # rounding ties allowed: max(TIE_MIN, TIE_FRAC * elems)

CASES = ("qdq", "codes", "attention")
ALL_BACKENDS = ("eager", "inductor", "smx", "smx-rewrite", "op")
CPU_BACKENDS = ("eager", "inductor", "smx", "smx-rewrite")
CUDA_BACKENDS = ("eager", "inductor", "smx", "smx-rewrite", "op")

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


# --------------------------------------------------------------------------- the functions measured


def f_qdq(x):
    q = QD.quantize_per_tensor(torch.softmax(x, -1), SCALE, ZP, QMIN, QMAX, QDTYPE)
    return QD.dequantize_per_tensor(q, SCALE, ZP, QMIN, QMAX, QDTYPE)


def f_codes(x):
    return QD.quantize_per_tensor(torch.softmax(x, -1), SCALE, ZP, QMIN, QMAX, QDTYPE)


def f_attention(q, k, v):
    s = q @ k.transpose(-2, -1) * SM_SCALE
    p = QD.quantize_per_tensor(torch.softmax(s, -1), SCALE, ZP, QMIN, QMAX, QDTYPE)
    return QD.dequantize_per_tensor(p, SCALE, ZP, QMIN, QMAX, QDTYPE) @ v


def _op(x, logit_scale=1.0):
    return torch.ops.smx.quant_softmax(x, -1, logit_scale, SCALE, ZP, QMIN, QMAX, QDTYPE, None)


def op_qdq(x):
    return QD.dequantize_per_tensor(_op(x), SCALE, ZP, QMIN, QMAX, QDTYPE)


def op_codes(x):
    return _op(x)


def op_attention(q, k, v):
    p = _op(q @ k.transpose(-2, -1), SM_SCALE)
    return QD.dequantize_per_tensor(p, SCALE, ZP, QMIN, QMAX, QDTYPE) @ v


FUNCS: dict[str, tuple[Callable, Callable]] = {"qdq": (f_qdq, op_qdq), "codes": (f_codes, op_codes),
                                               "attention": (f_attention, op_attention)}


def make_inputs(case: str, shape: str, device: str) -> tuple[torch.Tensor, ...]:
    dims, wide, _ = SHAPES[shape]
    gen = torch.Generator().manual_seed(0)
    if case == "attention":
        b, h, lq, lk = dims
        q = torch.randn(b, h, lq, HEAD_DIM, generator=gen)
        k = torch.randn(b, h, lk, HEAD_DIM, generator=gen)
        v = torch.randn(b, h, lk, HEAD_DIM, generator=gen)
        return tuple(t.to(device) for t in (q, k, v))
    x = torch.randn(*dims, generator=gen) * (4.0 if wide else 1.0)
    return (x.to(device),)


# --------------------------------------------------------------------------- checks


def allowed_ties(elems: int) -> int:
    return max(TIE_MIN, int(TIE_FRAC * elems))


def check(case: str, got: torch.Tensor, ref: torch.Tensor, inputs: tuple, elems: int) -> tuple[bool, int, str]:
    """(ok, differing entries / rows, a note) of a backend's result against eager's."""
    if not isinstance(got, torch.Tensor) or got.shape != ref.shape or got.dtype != ref.dtype:
        return False, -1, f"got {type(got).__name__} {getattr(got, 'dtype', '')} {tuple(getattr(got, 'shape', ()))}, " \
                          f"eager {ref.dtype} {tuple(ref.shape)}"
    lim = allowed_ties(elems)
    if case == "codes":
        d = (got.to(torch.int32) - ref.to(torch.int32)).abs()
        n, mx = int((d > 0).sum().item()), int(d.max().item()) if d.numel() else 0
        return mx <= 1 and n <= lim, n, f"max {mx} level(s), {n} codes differ (<= {lim} allowed)"
    if case == "qdq":
        d = (got.float() - ref.float()).abs()
        nan_ok = torch.equal(got.isnan(), ref.isnan())
        d = d.nan_to_num(0.0)
        n, mx = int((d > 1e-7).sum().item()), d.max().item() if d.numel() else 0.0
        return nan_ok and mx <= SCALE + 1e-6 and n <= lim, n, \
            f"max |diff| {mx / SCALE:.3f} step, {n} values differ (<= {lim} allowed)"
    v = inputs[2]
    d = (got.float() - ref.float()).abs().nan_to_num(float("inf"))
    fp_tol = 1e-5 + 1e-4 * ref.abs().max().item()
    row_err = d.amax(-1)
    n = int((row_err > fp_tol).sum().item())
    mx = row_err.max().item()
    lim_err = fp_tol + 2 * SCALE * v.abs().max().item()
    return mx <= lim_err and n <= lim, n, f"max |diff| {mx:.3g} ({lim_err:.3g} allowed), {n} rows beyond " \
                                          f"{fp_tol:.2g} (<= {lim} allowed)"


# --------------------------------------------------------------------------- rows


@dataclasses.dataclass
class QRow(Row):
    elems: int = 0
    others: float | None = None
    tries: list[float | None] = dataclasses.field(default_factory=list)
    compile_s: dict[str, float] = dataclasses.field(default_factory=dict)   # compile + first call
    peak_mb: dict[str, float] = dataclasses.field(default_factory=dict)
    diffs: dict[str, int] = dataclasses.field(default_factory=dict)        # entries / rows differing from eager
    notes: dict[str, str] = dataclasses.field(default_factory=dict)        # the check's note per backend
    reasons: dict[str, str] = dataclasses.field(default_factory=dict)      # smx site reasons (kept / skipped)


def describe(sites: list) -> tuple[str, str]:
    """(actions, reasons) of the quant_softmax sites among ``sites``."""
    qs = [s for s in sites if s.kind == "quant_softmax"]
    if not qs:
        other = sorted({f"{s.kind} {s.action}" for s in sites})
        return "no quant_softmax site" + (f" ({', '.join(other)})" if other else ""), ""
    acts = sorted({s.action for s in qs})
    reasons = sorted({s.reason for s in qs if s.reason})
    n = f" x{len(qs)}" if len(qs) > 1 else ""
    return ",".join(acts) + n, " | ".join(reasons)


def time_row(row: QRow, stmts: dict, args, quiet: Quiet, log) -> None:
    """Time the row's statements (again, up to --retry-noisy times, while others shared the CPUs)."""
    best = None
    for t in range(args.retry_noisy + 1):
        quiet()
        with Meter() as m:
            res = measure_interleaved(stmts, args.threads, args.rounds, args.min_run_time)
        row.tries.append(m.others)
        if best is None or (m.others or 0) < (best[1] or 0):
            best = (res, m.others)
        if (m.others or 0) <= NOISY or t == args.retry_noisy or row.device != "cpu":
            break
        log(f"    {row.case} {row.shape}: other processes took {m.others:.2f} cores: timing it again (--retry-noisy)")
    (row.ms, row.iqr_ms, row.min_ms), row.others = best


def bench(device: str, case: str, shape: str, backends: list[str], args, quiet: Quiet, log) -> tuple[QRow, list[str]]:
    """One row; -> (row, errors: sites that must be rewritten and were not)."""
    inputs = make_inputs(case, shape, device)
    dims = SHAPES[shape][0]
    elems = math.prod(dims)
    fn, op_fn = FUNCS[case]
    row = QRow(device, shape, case, "fwd", elems=elems)
    errors = []
    torch._dynamo.reset()
    with torch.no_grad():
        ref = fn(*inputs)
        compiled: dict[str, Callable] = {}
        for b in backends:
            compiled[b] = op_fn if b == "op" else compile_for(b, fn)
            n0 = n_reports()
            t0 = time.perf_counter()
            got = compiled[b](*inputs)
            if device == "cuda":
                torch.cuda.synchronize()
            row.compile_s[b] = time.perf_counter() - t0
            if b in ("smx", "smx-rewrite"):
                act, why = describe(sites_since(n0)[0])
                row.action[b] = act
                if why:
                    row.reasons[b] = why
                must = b == "smx-rewrite"
                if must and act != "rewritten":
                    errors.append(f"{device} {case} {shape}: {b} did not rewrite the site: {act} {why}")
            if b == "eager":
                continue
            ok, n, note = check(case, got, ref, inputs, elems)
            row.diffs[b], row.notes[b] = n, note
            row.max_err[b] = float(n)
            if not ok:
                row.mismatch.append(b)
            del got
        stmts = {b: ("f(*a)", {"f": compiled[b], "a": inputs}) for b in backends}
        time_row(row, stmts, args, quiet, log)
        if args.memory:
            for b in backends:
                row.peak_mb[b] = peak_mb(lambda f=compiled[b]: f(*inputs), device)
    torch._dynamo.reset()
    return row, errors


# --------------------------------------------------------------------------- output

TITLES = {
    "qdq": "qdq: dequantize(quantize(softmax(x, -1), 1/255, 0, 0, 255, uint8)) -> fp32",
    "codes": "codes: quantize(softmax(x, -1), 1/255, 0, 0, 255, uint8) -> uint8",
    "attention": "attention: dequantize(quantize(softmax(q @ k^T * 0.125, -1))) @ v, head dim 64",
}


def table_rows(rows: list[QRow], backends: list[str]) -> tuple[list[str], list[list[str]]]:
    head = ["shape", "elems"] + [f"{b} ms" + ("" if b == "inductor" else " (/ind)") for b in backends]
    head += ["others", "smx did", "diffs"]
    out = []
    for r in rows:
        acts = [f"{b}: {r.action[b]}" for b in ("smx", "smx-rewrite") if b in r.action]
        oth = "-" if r.others is None else f"{r.others:.2f}" + (" *" if r.others > NOISY else "")
        diffs = ", ".join(f"{b} {n}" for b, n in r.diffs.items() if n) or "-"
        out.append([shape_label(r.shape), f"{r.elems / 1e6:.2f}M" if r.elems >= 1e5 else str(r.elems)]
                   + [_fmt_ms(r, b) for b in backends] + [oth, "; ".join(acts), diffs])
    return head, out


def memory_rows(rows: list[QRow], backends: list[str]) -> tuple[list[str], list[list[str]]]:
    head = ["case", "shape", "fp32 probs MB", "uint8 codes MB"] + [f"{b} MB" for b in backends]
    out = []
    for r in rows:
        if not r.peak_mb:
            continue
        out.append([r.case, shape_label(r.shape), f"{r.elems * 4 / MB:.1f}", f"{r.elems / MB:.1f}"]
                   + [f"{r.peak_mb[b]:.1f}" if b in r.peak_mb else "-" for b in backends])
    return head, out


def _geo(vals: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in vals) / len(vals))


def summary(rows: list[QRow], stat: str) -> list[str]:
    """Per device, case and smx-ish backend: geometric mean and range of time / inductor's."""
    out = []
    for device in ("cpu", "cuda"):
        for b in ("smx-rewrite", "smx", "op"):
            if b == "smx":
                continue   # kept by default on CPU and CUDA: Inductor's code
            for case in CASES:
                rs = [r for r in rows if r.device == device and r.case == case and r.ratio(b)]
                if not rs:
                    continue
                ratios = [r.ratio(b) for r in rs]
                lo, hi = min(ratios), max(ratios)
                worst = max(rs, key=lambda r: r.ratio(b))
                best = min(rs, key=lambda r: r.ratio(b))
                out.append(f"{device} {case:9s} {b:11s} / inductor ({stat} ms): geomean {_geo(ratios):.2f}x over "
                           f"{len(rs)} shape(s), {lo:.2f}x ({shape_label(best.shape)}) .. {hi:.2f}x "
                           f"({shape_label(worst.shape)})")
    return out


def slower_rows(rows: list[QRow]) -> list[str]:
    """Rows where smx with its default options is slower than Inductor (median or fastest block)."""
    out = []
    for r in rows:
        med = r.ratio("smx")
        mn = (r.min_ms["smx"] / r.min_ms["inductor"]) if "smx" in r.min_ms and r.min_ms.get("inductor") else None
        if (med is not None and med > SLOWER) or (mn is not None and mn > SLOWER):
            both = med is not None and mn is not None and med > SLOWER and mn > SLOWER
            noisy = r.others is not None and r.others > NOISY
            out.append(f"{r.device} {r.case} {shape_label(r.shape)}: smx {med:.2f}x inductor by the median, "
                       f"{mn:.2f}x by the fastest block{'' if both else ' (one of the two only: likely noise)'}; "
                       f"{r.action.get('smx', '?')}" + (f" [noisy: others {r.others:.2f}]" if noisy else ""))
    return out


# --------------------------------------------------------------------------- main


def _list(choices: tuple[str, ...]) -> Callable[[str], list[str]]:
    def parse(s: str) -> list[str]:
        out = [t for t in s.replace(" ", "").split(",") if t]
        bad = [t for t in out if t not in choices]
        if bad or not out:
            raise argparse.ArgumentTypeError(f"unknown {bad}; choose from {','.join(choices)}")
        return out

    return parse


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--quick", action="store_true",
                   help="smoke run: " + ", ".join(f"{c} {s}" for c, s in QUICK) + "; one short round each "
                        "(numbers are rough); --cases / --shapes narrow it further")
    p.add_argument("--cases", type=_list(CASES), metavar="LIST",
                   help=f"comma-separated subset of {','.join(CASES)} (default: all)")
    p.add_argument("--shapes", nargs="+", choices=list(SHAPES), metavar="SHAPE",
                   help="subset of shapes (default: all; attention runs on the 4-d ones only): "
                        + "; ".join(f"{k} ({v[2]})" for k, v in SHAPES.items()))
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto (default): CPU, and CUDA too when available; or only one of them")
    p.add_argument("--backends", type=_list(ALL_BACKENDS), metavar="LIST",
                   help=f"comma-separated subset of {','.join(ALL_BACKENDS)} (default: {','.join(CPU_BACKENDS)} on "
                        f"CPU, {','.join(CUDA_BACKENDS)} on CUDA). "
                        "inductor is always added: it is the yardstick")
    p.add_argument("--rounds", type=int, help="interleaved timing rounds per row (default 3, quick 1)")
    p.add_argument("--min-run-time", type=float,
                   help="seconds of blocked_autorange per backend per round (default 0.2, quick 0.05)")
    p.add_argument("--threads", type=int, default=_cores(), help="torch threads (default: all cores, %(default)s here)")
    p.add_argument("--no-memory", dest="memory", action="store_false",
                   help="skip the peak-memory measurement (3 more calls per backend and row)")
    p.add_argument("--wait-quiet", type=float, default=0, metavar="S",
                   help=f"before timing each row, wait up to S seconds for other processes to use < {NOISY} cores "
                        "(default 0: no wait); the total wait is capped by --wait-budget")
    p.add_argument("--wait-budget", type=float, default=120, metavar="T",
                   help="seconds of --wait-quiet waiting in the whole run, at most (default %(default)s)")
    p.add_argument("--retry-noisy", type=int, default=0, metavar="K",
                   help=f"time a CPU row again, up to K more times, while other processes used > {NOISY} cores "
                        "during it; the least disturbed try is kept (default 0)")
    p.add_argument("--stat", choices=("median", "min"), default="median",
                   help="figure the tables, ratios and summary show: the median block (default) or the fastest block "
                        "(less sensitive to other processes' load); the JSON has both")
    p.add_argument("--markdown", action="store_true", help="print the tables as Markdown")
    p.add_argument("--json", metavar="PATH", help="write every figure (and the environment) to PATH as JSON "
                                                  "(rewritten after every row)")
    return p.parse_args(argv)


def _row_dict(r: QRow) -> dict:
    d = dataclasses.asdict(r)
    d.pop("pass_")
    d.pop("max_err")
    d["ratio_vs_inductor"] = {b: r.ratio(b) for b in r.ms}
    d["ratio_vs_inductor_min"] = {b: r.min_ms[b] / r.min_ms["inductor"] for b in r.min_ms if r.min_ms.get("inductor")}
    return d


def plan(args) -> list[tuple[str, str]]:
    cases = args.cases or list(CASES)
    if args.quick:
        todo = [(c, s) for c, s in QUICK if c in cases and (not args.shapes or s in args.shapes)]
        if args.shapes:   # --quick --shapes S: the chosen shapes, every chosen case
            todo = [(c, s) for c in cases for s in args.shapes if not (c == "attention" and SHAPES[s][1])]
        return todo
    shapes = args.shapes or list(SHAPES)
    return [(c, s) for c in cases for s in shapes if not (c == "attention" and SHAPES[s][1])]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import smxcompile  # noqa: F401  (registers backend="smx" and torch.ops.smx.quant_softmax)

    args.rounds = args.rounds or (1 if args.quick else 3)
    args.min_run_time = args.min_run_time or (0.05 if args.quick else 0.2)
    todo = plan(args)
    if not todo:
        print("nothing to run: attention needs a 4-d (batch x heads x queries x keys) shape", file=sys.stderr)
        return 2
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
              "using the CPUs; the `others` column says which rows they disturbed", file=sys.stderr)
    print("env: " + ", ".join(f"{k}={v}" for k, v in env.items()))
    print(f"timing: torch.utils.benchmark blocked_autorange, {args.rounds} interleaved round(s) x "
          f"{args.min_run_time}s per backend; tables: {args.stat} ms; (/ind) = ratio to inductor, < 1 faster",
          flush=True)

    t_start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"  [{time.perf_counter() - t_start:6.1f}s] {msg}", flush=True)

    def backends_for(device: str) -> list[str]:
        if args.backends:
            bs = [b for b in ALL_BACKENDS if b in args.backends or b == "inductor"]
            return bs
        return list(CPU_BACKENDS if device == "cpu" else CUDA_BACKENDS)

    quiet = Quiet(args.wait_quiet, args.wait_budget, log)
    result: dict[str, Any] = {"command": command, "env": env, "rounds": args.rounds, "table_stat": args.stat,
                              "min_run_time": args.min_run_time, "noisy_threshold_cores": NOISY,
                              "quant": {"scale": SCALE, "zero_point": ZP, "quant_min": QMIN, "quant_max": QMAX,
                                        "dtype": str(QDTYPE)}, "rows": []}
    all_rows: list[QRow] = []
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
            all_rows.append(row)
            oth = "" if row.others is None else f", others {row.others:.2f}"
            log(f"{device} {case} {shape_label(shape)}: " + ", ".join(f"{b} {_fmt_ms(row, b)}" for b in backends)
                + f"{oth}; smx: {row.action.get('smx', '-')}, smx-rewrite: {row.action.get('smx-rewrite', '-')}"
                + ("; compile s: " + ", ".join(f"{b} {s:.1f}" for b, s in row.compile_s.items() if b != "eager")))
            result["rows"] = [_row_dict(r) for r in all_rows]
            result["errors"] = errors
            _write_json(args.json, result)

    reasons: dict[str, None] = {}
    for device in devices:
        backends = backends_for(device)
        where = env["cuda"] if device == "cuda" else env["cpu"]
        for case in CASES:
            rows = [r for r in all_rows if r.device == device and r.case == case]
            if not rows:
                continue
            head, body = table_rows(shown(rows, args.stat), backends)
            print_table(f"{TITLES[case]} -- {device} ({where}, {args.threads} threads, {args.stat} ms)", head, body,
                        args.markdown)
            for r in rows:
                for b, why in r.reasons.items():
                    reasons[f"{device} {b}: {r.action[b]}: {why}"] = None
        head, body = memory_rows([r for r in all_rows if r.device == device], backends)
        if body:
            print_table(f"peak memory of one call above the memory in use before it (MB) -- {device}", head, body,
                        args.markdown)
    if reasons:
        print("\nsmx's reasons (smxcompile.last_report()):")
        for r in reasons:
            print("  " + r)
    try:
        env["loadavg_at_end"] = [round(v, 2) for v in os.getloadavg()]
    except OSError:
        pass
    noisy = [r for r in all_rows if r.others is not None and r.others > NOISY]
    print(f"\nload average at start {env.get('loadavg_at_start')}, at end {env.get('loadavg_at_end')} "
          f"({env['cores']} cores); {len(noisy)} of {len(all_rows)} rows were timed while other processes used "
          f"> {NOISY} cores (marked *)" + (f"; waited {quiet.waited:.0f} s for quiet" if quiet.waited else ""))
    summ = summary(shown(all_rows, args.stat), args.stat)
    print("\nsummary (time / inductor's; > 1: slower than Inductor):")
    for s in summ:
        print("  " + s)
    slow = slower_rows(all_rows)
    print(f"\nsmx (default options) slower than Inductor (ratio > {SLOWER}):" + ("" if slow else " none"))
    for s in slow:
        print("  " + s)
    result.update(summary=summ, slower_than_inductor=slow, errors=errors)
    result["rows"] = [_row_dict(r) for r in all_rows]
    _write_json(args.json, result)
    bad = [r for r in all_rows if r.mismatch]
    for r in bad:
        print(f"MISMATCH vs eager: {r.device} {r.case} {shape_label(r.shape)}: "
              + "; ".join(f"{b}: {r.notes[b]}" for b in r.mismatch))
    for e in errors:
        print(f"ERROR: {e}")
    print(f"\n$ {command}   ({time.perf_counter() - t_start:.0f} s)")
    if args.json:
        print(f"wrote {args.json}")
    return 1 if bad or errors else 0


if __name__ == "__main__":
    sys.exit(main())
