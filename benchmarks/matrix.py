"""The backend matrix of the in-process benchmarks: each case compiled under each backend, checked against eager,
timed; tables, the slow rows, JSON, a heatmap. A script hands :func:`main` its cases, ``build`` and titles."""

import argparse
import dataclasses
import functools
import math
import sys
import textwrap
import time
from typing import Any, Callable

import torch

import common
from common import MB, NOISY, Row, compile_for, err_text, fmt_ms, n_reports, shown, sites_since, time_row

SLOW = 1 / 0.97                  # a time ratio above this (and above the noise) is "below 0.97x Inductor"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TOL = {"fp32": (1e-5, 1e-4), "bf16": (1e-3, 2e-2), "fp16": (1e-3, 2e-2)}   # (atol, rtol of max|eager|)


@dataclasses.dataclass(frozen=True)
class Case:
    family: str
    name: str
    shape: str                # "rows x cols", B x H x T x D, ...
    dtype: str = "fp32"
    passes: tuple[str, ...] = ("infer", "train")
    quick: bool = False       # one of --quick's points
    backends: tuple[str, ...] = ()   # only these of --backends (default: all)

    @property
    def label(self) -> str:
        return f"{self.family} {self.name} {self.shape} {self.dtype}"

    @property
    def dims(self) -> list[int]:
        return [int(t) for t in self.shape.split("x")]


@dataclasses.dataclass
class Built:
    """What a case runs: ``fn(*inputs)``; training differentiates its first output w.r.t. inputs[grad_idx], params."""

    fn: Callable
    inputs: list
    grad_idx: tuple[int, ...] = (0,)
    params: list = dataclasses.field(default_factory=list)
    probs: torch.Tensor | None = None   # eager's probabilities: top-k indices may differ where these tie
    check: Callable | None = None       # (got, ref) -> (error, ok), instead of :func:`check`
    extra: dict[str, Callable] = dataclasses.field(default_factory=dict)   # backends compile_for does not make
    memory: bool = False                # also the peak memory of an inference call (--no-memory skips it)


@dataclasses.dataclass
class MRow(Row):
    family: str = ""
    dtype: str = "fp32"
    reasons: dict[str, str] = dataclasses.field(default_factory=dict)   # smx backends: the sites' reasons
    errors: dict[str, str] = dataclasses.field(default_factory=dict)    # backend -> "Type: message"
    compile_s: dict[str, float] = dataclasses.field(default_factory=dict)   # compile + first call
    peak_mb: dict[str, float] = dataclasses.field(default_factory=dict)

    def spread(self, b: str) -> float | None:
        """IQR / median; with fewer than 4 blocks (median - fastest) / median; None with a single block."""
        med, iqr, mn = self.ms.get(b), self.iqr_ms.get(b, 0.0), self.min_ms.get(b, 0.0)
        if not med or (iqr == 0 and mn == med):
            return None
        return iqr / med if iqr > 0 else (med - mn) / med

    @property
    def noise(self) -> float | None:
        """About how far the smx / inductor ratio moves by chance: half the sum of their spreads."""
        s, i = self.spread("smx"), self.spread("inductor")
        return None if s is None or i is None else 0.5 * (s + i)

    @property
    def slow(self) -> bool:
        """smx slower than inductor beyond the noise (not counted against an inductor whose result was wrong)."""
        r = self.ratio("smx")
        return r is not None and r > SLOW and r * (1 - (self.noise or 0.0)) > 1 and "inductor" not in self.mismatch

    def record(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "pass": self.pass_, **{f"{b}_ms": ms for b, ms in self.ms.items()},
                **{f"{b}_over_inductor": self.ratio(b) for b in self.ms if b != "inductor"}, "noise": self.noise,
                "slow": self.slow, "smx_action": self.action.get("smx", ""), "smx_reason": self.reasons.get("smx", "")}


def as_list(out) -> list:
    return list(out) if isinstance(out, (tuple, list)) else [out]


def compare(got: list, ref: list, dtype: str, probs: torch.Tensor | None = None,
            rows: torch.Tensor | None = None) -> tuple[float, bool]:
    """(max |got - ref| / max|ref| over the float tensors, all within TOL); integer tensors are top-k indices:
    equal, or where they differ eager's probabilities at both equal (ties). ``rows``: only these rows."""
    atol, rtol = TOL[dtype]
    worst, ok = 0.0, True
    for g, r in zip(got, ref):
        if g.shape != r.shape:
            return math.inf, False
        if rows is not None:
            g, r = g[rows], r[rows]
        if not r.is_floating_point():
            if probs is None or torch.equal(g, r):
                ok &= bool(torch.equal(g, r))
            else:
                g, r = (g, r) if g.dim() == probs.dim() else (g.unsqueeze(-1), r.unsqueeze(-1))
                ok &= bool(torch.equal(probs.gather(-1, g.long()), probs.gather(-1, r.long())))
            continue
        g, r = g.detach().float(), r.detach().float()
        err = (g - r).nan_to_num(0.0).abs().max().item() if r.numel() else 0.0
        scale = r.nan_to_num(0.0).abs().max().item() if r.numel() else 0.0
        ok &= err <= atol + rtol * scale and torch.equal(g.isnan(), r.isnan())
        worst = max(worst, err / scale if scale > 0 else err)
    return worst, ok


def check(got: tuple, ref: tuple, dtype: str, probs: torch.Tensor | None) -> tuple[float, bool]:
    """The outputs, then the gradients, against eager's. Where top-k indices differ (ties) the gradient lands
    elsewhere, so the gradients are compared on the rows whose indices equal eager's."""
    (outs, grads), (r_outs, r_grads) = got, ref
    err, ok = compare(outs, r_outs, dtype, probs)
    if grads is None or err == math.inf:
        return err, ok
    same = [(g == r).reshape(len(r), -1).all(-1) for g, r in zip(outs, r_outs)
            if probs is not None and not r.is_floating_point()]
    rows = functools.reduce(torch.logical_and, same) if same else None
    g_err, g_ok = compare(list(grads), list(r_grads), dtype, None, rows)
    return max(err, g_err), ok and g_ok


def call(f: Callable, xs: list, ps: list, train: bool, g: list) -> tuple[list, tuple | None]:
    """One call: (the outputs, None) under no_grad, or (the outputs, the gradients of the first w.r.t. ``ps``
    against ``g[0]``: a fixed random cotangent drawn at the first call, 1 for a scalar)."""
    if not train:
        with torch.no_grad():
            return as_list(f(*xs)), None
    outs = as_list(f(*xs))
    if g[0] is None:
        o = outs[0]
        g[0] = torch.randn(o.shape, generator=torch.Generator().manual_seed(1)).to(o.device, o.dtype) \
            if o.dim() else torch.ones_like(o)
    return [t.detach() for t in outs], torch.autograd.grad(outs[0], ps, g[0])


def describe(sites: list) -> tuple[str, str]:
    """(what smx did, e.g. 'softmax rewritten (smx::softmax)' or 'softmax kept'; the distinct reasons)."""
    acts = {f"{s.kind} {s.action}" + (f" ({s.op})" if s.action == "rewritten" and s.op else ""): None for s in sites}
    return ", ".join(acts) or "no site", " | ".join(dict.fromkeys(s.reason for s in sites if s.reason))


def run_case(c: Case, device: str, build: Callable, args, log: Callable) -> list[MRow]:
    """A case's rows, one per pass: each backend called once (a backend that raises is reported, the others go
    on) and checked against eager, then the backends timed in turn."""
    built = build(c, device)
    verify = built.check or functools.partial(check, dtype=c.dtype, probs=built.probs)
    torch._dynamo.reset()
    backends = [b for b in args.backends if not c.backends or b in c.backends]
    fns = {b: built.extra.get(b) or compile_for(b, built.fn) for b in backends}
    rows = []
    for pass_ in c.passes:
        train = pass_ == "train"   # "infer" runs under no_grad
        row = MRow(device, c.shape, c.name, pass_, family=c.family, dtype=c.dtype)
        xs = [t.detach().requires_grad_(True) if train and i in built.grad_idx else t
              for i, t in enumerate(built.inputs)]
        ps = [xs[i] for i in built.grad_idx] + built.params
        g, ref = [None], None
        for b, f in fns.items():
            n0, t0, got = n_reports(), time.perf_counter(), None
            try:
                got = call(f, xs, ps, train, g)
                if device == "cuda":
                    torch.cuda.synchronize()
            except Exception as e:
                row.errors[b] = err_text(e)
            row.compile_s[b] = time.perf_counter() - t0
            if b.startswith("smx"):
                row.action[b], row.reasons[b] = describe(sites_since(n0)[0])
            if b == "eager":
                ref = got
            elif got is not None and ref is not None:
                row.max_err[b], ok = verify(got, ref)
                if not ok:
                    row.mismatch.append(b)
        stmt = "torch.autograd.grad(as_list(f(*xs))[0], ps, g)" if train else "f(*xs)"
        ok_b = [b for b in fns if b not in row.errors]
        with torch.set_grad_enabled(train):
            time_row(row, {b: (stmt, {"f": fns[b], "xs": xs, "ps": ps, "g": g[0], "as_list": as_list, "torch": torch})
                           for b in ok_b}, args, log)
            if built.memory and args.memory and not train:
                row.peak_mb = {b: common.peak_mb(lambda f=fns[b]: f(*xs), device) for b in ok_b}
        rows.append(row)
        log(f"{device} {c.label} {pass_}: " + ", ".join(f"{b} {'ERR' if b in row.errors else fmt_ms(row, b)}"
                                                       for b in fns) + f"; smx: {row.action.get('smx', '-')}")
    torch._dynamo.reset()
    return rows


def pct(v: float | None) -> str:
    return "?" if v is None else f"{100 * v:.0f}%"


def short_reason(reason: str, n: int = 70) -> str:
    r = reason.split(" | ")[0].split(";")[0].split(" (")[0]
    return r if len(r) <= n else r[: n - 3] + "..."


def did(r: MRow) -> str:
    """What the smx backend(s) did: one text when they agree, else 'smx: ...; smx-rewrite: ...'."""
    texts = {b: a + (f": {short_reason(r.reasons[b])}" if r.reasons.get(b) else "") for b, a in r.action.items()}
    same = set(texts.values())
    return "".join(same) if len(same) <= 1 else "; ".join(f"{b}: {t}" for b, t in texts.items())


def others(r: MRow) -> str:
    """Cores other processes used while the row was timed, * above the noisy threshold."""
    return "-" if r.others is None else f"{r.others:.2f}" + (" *" if r.others > NOISY else "")


def table(rows: list[MRow], backends: list[str], columns: dict[str, Callable]) -> tuple[list[str], list[list[str]]]:
    head = ["case", "shape", "dtype", "pass"] + [f"{b} ms" + ("" if b == "inductor" else " (/ind)") for b in backends]
    return head + ["noise", "smx did", "others", *columns], [
        [r.case, r.shape, r.dtype, r.pass_] + ["ERR" if b in r.errors else fmt_ms(r, b) for b in backends]
        + [pct(r.noise), did(r), others(r)] + [f(r) for f in columns.values()] for r in rows]


def memory_table(rows: list[MRow], backends: list[str]) -> tuple[list[str], list[list[str]]]:
    head = ["case", "shape", "fp32 probabilities MB"] + [f"{b} peak MB" for b in backends]
    return head, [[r.case, r.shape, f"{math.prod(int(t) for t in r.shape.split('x')) * 4 / MB:.2f}"]
                  + [f"{r.peak_mb[b]:.2f}" if b in r.peak_mb else "-" for b in backends] for r in rows]


def slow_lines(rows: list[MRow]) -> list[str]:
    return [f"{r.device} {r.family} {r.case} {r.shape} {r.dtype} {r.pass_}: smx {r.ratio('smx'):.2f}x inductor's time "
            f"(fastest blocks {r.ratio('smx', r.min_ms) or float('nan'):.2f}x, noise {pct(r.noise)}); smx did: "
            f"{r.action['smx']}" + (f" -- {r.reasons['smx']}" if r.reasons.get("smx") else "") for r in rows if r.slow]


def plot(rows: list[MRow], path: str, title: str) -> str:
    """A heatmap: cases x (pass, dtype), colour smx / inductor on a log scale from 0.5 to 2, the ratio in each cell."""
    plt = common.pyplot()
    if plt is None or not rows:
        return "--plot: " + (common.NO_MATPLOTLIB if plt is None else "no rows")
    from matplotlib.colors import LogNorm

    cols = list(dict.fromkeys(f"{r.pass_} {r.dtype}" for r in sorted(rows, key=lambda r: r.dtype != "fp32")))
    names = list(dict.fromkeys(f"{r.device} {r.family}: {r.case} {r.shape}" for r in rows))
    grid = [[math.nan] * len(cols) for _ in names]
    width = max(6.5, 2.5 + 1.7 * len(cols))
    fig, ax = plt.subplots(figsize=(width, 0.38 * len(names) + 1.8))
    for r in rows:
        i, j = names.index(f"{r.device} {r.family}: {r.case} {r.shape}"), cols.index(f"{r.pass_} {r.dtype}")
        v = r.ratio("smx")
        grid[i][j] = v or math.nan
        txt = "-" if v is None else f"{v:.2f}" + (" !" if r.mismatch else "") + ("*" if r.slow else "")
        dark = v is not None and abs(math.log2(v)) > 0.6
        ax.text(j, i, "ERR" if r.errors else txt, ha="center", va="center", fontsize=7, color="w" if dark else "k")
    im = ax.imshow(grid, cmap="RdBu_r", norm=LogNorm(0.5, 2.0), aspect="auto")
    ax.set_xticks(range(len(cols)), cols, fontsize=8)
    ax.xaxis.tick_top()
    ax.set_yticks(range(len(names)), names, fontsize=7)
    cb = fig.colorbar(im, ax=ax, fraction=0.05, ticks=[0.5, 0.67, 0.8, 1, 1.25, 1.5, 2], format="%g")
    cb.minorticks_off()
    cb.set_label("smx / inductor time (< 1: faster)", fontsize=8)
    ax.set_title(textwrap.fill(title, int(14 * width)), fontsize=7, pad=22)
    return common.save_figure(fig, path)


def parse_args(doc: str, argv, cases: list[Case], backends: tuple[str, ...], rounds: int, min_run_time: float,
               device: str, threads: int | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.timing_flags(p, rounds, min_run_time, "smoke run: the quick cases, one short round (numbers are rough)")
    if threads:
        p.set_defaults(threads=threads)
    families, shapes = list(dict.fromkeys(c.family for c in cases)), list(dict.fromkeys(c.shape for c in cases))
    p.add_argument("--families", type=common.choice_list(tuple(families)), metavar="LIST",
                   help=f"comma-separated subset of {','.join(families)} (default: all)")
    p.add_argument("--shapes", nargs="+", choices=shapes, metavar="SHAPE", help=f"only these of {' '.join(shapes)}")
    p.add_argument("--only", metavar="TEXT", action="append",
                   help="only the cases whose label 'family case shape dtype' contains TEXT (repeatable: any of them)")
    p.add_argument("--backends", type=common.choice_list(backends), default=list(backends), metavar="LIST",
                   help=f"comma-separated subset of {','.join(backends)} (eager and inductor are always timed)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default=device,
                   help="auto: CPU, and CUDA too when available (default %(default)s)")
    p.add_argument("--no-memory", dest="memory", action="store_false", help="skip the peak-memory measurement")
    common.add_noise_flags(p)
    p.add_argument("--stat", choices=("median", "min"), default="median", help="the tables' figure: the median "
                   "block, or the fastest (less sensitive to other processes' load); the JSON has both")
    p.add_argument("--plot", metavar="PATH", help="write a heatmap of smx / inductor per case and pass (PNG)")
    args = p.parse_args(argv)
    args.backends = [b for b in backends if b in args.backends or b in ("eager", "inductor")]
    args.rounds = args.rounds or (1 if args.quick else rounds)
    args.min_run_time = args.min_run_time or (0.05 if args.quick else min_run_time)
    return args


def main(doc: str, cases: list[Case], build: Callable, titles: dict[str, str], argv: list[str] | None = None, *,
         backends: tuple[str, ...] = common.BACKENDS, rounds: int = 3, min_run_time: float = 0.2,
         device: str = "auto", threads: int | None = None, columns: dict[str, Callable] | None = None) -> int:
    """Run the selected cases on the selected devices, print the tables and lists; the exit status is 1 when a
    result disagreed with eager or something raised. ``columns``: more table columns."""
    args = parse_args(doc, argv, cases, backends, rounds, min_run_time, device, threads)
    cases = [c for c in cases if (not args.families or c.family in args.families)
             and (not args.shapes or c.shape in args.shapes) and (c.quick or not args.quick)
             and (not args.only or any(t in c.label for t in args.only))]
    if not cases:
        print("no case selected" + (" (--quick keeps only the quick cases)" if args.quick else ""), file=sys.stderr)
        return 2
    devices = common.devices(args.device)
    torch.set_num_threads(args.threads)
    command, env = common.command_line(argv), common.environment(args.threads)
    common.print_header(command, env, "timings will be noisy (--threads 1 is less sensitive)")
    print(f"timing: {len(cases)} cases, torch.utils.benchmark blocked_autorange, {args.rounds} interleaved round(s) "
          f"x {args.min_run_time}s per backend; {args.stat} ms; (/ind) = time / inductor's, < 1 faster", flush=True)
    t_start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"  [{time.perf_counter() - t_start:6.1f}s] {msg}", file=sys.stderr, flush=True)

    result: dict[str, Any] = {"command": command, "env": env, "rounds": args.rounds, "min_run_time": args.min_run_time,
                              "table_stat": args.stat, "rows": [], "errors": []}
    rows: list[MRow] = []
    for dev in devices:
        for c in cases:
            try:
                rows.extend(run_case(c, dev, build, args, log))
            except Exception as e:  # a case that raises outside a backend call (inputs, timing): say so, go on
                log(f"{dev} {c.label}: FAILED {err_text(e)}")
                result["errors"].append(f"FAILED: {dev} {c.label}: {err_text(e)}")
                torch._dynamo.reset()
            result["rows"] = [r.record() for r in rows]
            common.write_json(args.json, result)
    for dev in devices:
        where, stat = env["cuda"] if dev == "cuda" else env["cpu"], ", fastest blocks" if args.stat == "min" else ""
        for fam in dict.fromkeys(c.family for c in cases):
            if fr := [r for r in rows if r.device == dev and r.family == fam]:
                ran = [b for b in args.backends if any(b in r.compile_s for r in fr)]
                common.print_table(f"{titles[fam]} -- {dev} ({where}, {args.threads} threads{stat})",
                                   *table(shown(fr, args.stat), ran, columns or {}), args.markdown)
        if mem := [r for r in rows if r.device == dev and r.peak_mb]:
            common.print_table(f"peak memory of one call above the memory in use before it (MB) -- {dev}",
                               *memory_table(mem, args.backends), args.markdown)
    slow = result["below_0.97x_inductor"] = slow_lines(rows)
    print(f"\nbelow 0.97x Inductor (smx time > {SLOW:.3f}x inductor's and beyond the noise where known):"
          + ("" if slow else " none") + "".join(f"\n  {s}" for s in slow) + "".join(f"\n{e}" for e in result["errors"]))
    for r in rows:
        at = f"{r.device} {r.family} {r.case} {r.shape} {r.dtype} {r.pass_}"
        msgs = [f"MISMATCH vs eager: {at}: {r.mismatch} max rel err {r.max_err}"] if r.mismatch else []
        msgs += [f"ERROR: {at} under {b}: {e}" for b, e in r.errors.items()]
        print("".join(f"{m}\n" for m in msgs), end="")
        result["errors"] += msgs
    noisy = sum(1 for r in rows if (r.others or 0) > NOISY)
    common.print_load_at_end(env, f"a load above the core count means other processes shared the CPUs; {noisy} of "
                                  f"{len(rows)} rows were timed while they used > {NOISY} cores")
    if args.plot:
        print(plot(shown(rows, args.stat), args.plot, f"smx time / inductor time ({args.stat}; * below 0.97x "
                   f"Inductor beyond noise, ! mismatch, blank: not run) -- {command}"))
    result["wall_s"] = time.perf_counter() - t_start
    common.write_json(args.json, result)
    print(f"\n$ {command}   ({time.perf_counter() - t_start:.0f} s)" + (f"\nwrote {args.json}" if args.json else ""))
    return 1 if result["errors"] else 0
