#!/usr/bin/env python
"""Fused softmax + top-k (MoE routers, vocabulary samplers, argmax, top-1 routers, entries read from the
probabilities, the whole Mixtral MoE block) under eager, Inductor, smx and smx-rewrite, CPU and CUDA when present;
the vocab rows also by peak memory. Cases, columns and checks: docs/PERFORMANCE.md ("Fused softmax + top-k, CPU").

  python benchmarks/bench_softmax_topk.py [--quick] [--families router,vocab,...] [--stat min] [--json PATH]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import logging
import sys
import textwrap
import time
import warnings
from typing import Any, Callable

import torch

import common
from common import BACKENDS, NOISY, MB, Quiet, Row, compile_for, fmt_ms, n_reports, shown, sites_since, time_row

FAMILIES = ("router", "vocab", "argmax", "top1", "entries", "moe")
SLOWER = 1.05  # a ratio above this is called "slower than Inductor"


@dataclasses.dataclass(frozen=True)
class Case:
    family: str
    rows: int
    cols: int           # columns (moe: experts)
    k: int
    passes: tuple[str, ...]
    dtype: torch.dtype = torch.float32

    @property
    def shape(self) -> str:
        suffix = "" if self.dtype is torch.float32 else f" {str(self.dtype).removeprefix('torch.')}"
        return f"{self.rows}x{self.cols}{suffix}"

    @property
    def label(self) -> str:
        return f"{self.family} {self.shape} k={self.k}"


def all_cases() -> list[Case]:
    both = ("fwd", "fwd+bwd")
    cases = [Case("router", r, c, k, both) for r, c in ((8192, 8), (8192, 64), (2048, 128)) for k in (1, 2, 8)
             if k <= c]
    cases += [Case("vocab", r, c, k, ("fwd",)) for r, c in ((16, 32000), (4, 131072), (4, 262144))
              for k in (1, 2, 8, 50)]
    cases += [Case("vocab", 4, 131072, 8, ("fwd+bwd",)), Case("argmax", 4, 131072, 1, ("fwd",)),
              Case("argmax", 8192, 64, 1, ("fwd",))]
    cases += [Case("top1", 8192, c, 1, both, dt) for dt, cols in ((torch.float32, (8, 64)),
                                                                  (torch.bfloat16, (8, 32, 64))) for c in cols]
    cases += [Case("entries", r, c, 2, both) for r, c in ((8192, 8), (8192, 64), (2048, 128))]
    cases += [Case("entries", r, c, 1, ("fwd",)) for r, c in ((16, 32000), (4, 131072))]
    return cases + [Case("moe", 2048, 8, 2, both), Case("moe", 2048, 64, 2, both)]


QUICK_CASES = [Case("router", 8192, 64, 2, ("fwd", "fwd+bwd")), Case("vocab", 4, 131072, 50, ("fwd",)),
               Case("argmax", 4, 131072, 1, ("fwd",)), Case("moe", 2048, 8, 2, ("fwd", "fwd+bwd"))]
QUICK_FAMILIES = ("router", "vocab", "argmax")   # --quick without --families


def make_router(k: int) -> Callable:
    def router(logits):
        v, i = torch.topk(torch.softmax(logits.float(), -1), k, -1)
        v = v / v.sum(-1, keepdim=True)
        return v, i

    return router


def make_sampler(k: int) -> Callable:
    def sampler(logits):
        v, i = torch.topk(torch.softmax(logits / 0.7, -1), k)
        return v, i

    return sampler


def argmax_softmax(x):
    return torch.argmax(torch.softmax(x, -1), -1)


def top1_router(x):
    p = torch.softmax(x, -1)
    return torch.max(p, -1).values[:, None], torch.argmax(p, -1)


def top2_gates(x):
    p = torch.softmax(x, -1)
    i1 = torch.argmax(p, -1)
    m1 = torch.nn.functional.one_hot(i1, x.shape[-1])
    m2 = torch.nn.functional.one_hot(torch.argmax(x.masked_fill(m1.bool(), float("-inf")), -1), x.shape[-1])
    return torch.stack([(p * m1).sum(-1), (p * m2).sum(-1)], -1), i1


def entry_at(x):
    i = x.argmin(-1, keepdim=True)
    return torch.softmax(x, -1).gather(-1, i), i


def make_fn(case: Case) -> Callable:
    if case.family == "entries":
        return top2_gates if case.k == 2 else entry_at
    return {"router": lambda: make_router(case.k), "vocab": lambda: make_sampler(case.k),
            "argmax": lambda: argmax_softmax, "top1": lambda: top1_router}[case.family]()


def describe_sites(sites: list) -> str:
    """The action of each distinct site, softmax_topk first: 'rewritten (CPU two-pass)', 'kept: <reason>'."""
    seen: dict[str, None] = {}
    for s in sorted(sites, key=lambda s: s.kind != "softmax_topk"):
        txt = s.action
        if s.action == "rewritten" and s.op:
            txt += f" ({'CPU two-pass' if 'two-pass' in s.op else s.op})"
        elif s.reason:
            txt += ": " + s.reason.split(";")[0]
        seen[txt if s.kind == "softmax_topk" else f"{s.kind} {txt}"] = None
    return ", ".join(seen) or "no site"


def count_sites(sites: list, graphs: int) -> str:
    """{kind: action x count} over every graph, e.g. 'softmax_topk rewritten x1 (1 graph)'."""
    c = collections.Counter((s.kind, s.action) for s in sites)
    body = ", ".join(f"{kind} {action} x{n}" for (kind, action), n in sorted(c.items())) or "no site"
    return f"{body} ({graphs} graph{'s' if graphs != 1 else ''})"


def rel_err(got: torch.Tensor, ref: torch.Tensor, gscale: float = 0.0) -> tuple[float, bool]:
    """(max|got - ref| / max(max|ref|, gscale), within 1e-7 + 1e-4 max|ref| + 1e-6 gscale). ``gscale`` (gradients
    to the logits: max|g| max|values|) covers the k=1 renormalized router, whose exact gradient is 0."""
    got, ref = got.detach().float(), ref.detach().float()
    err = (got - ref).nan_to_num(0.0).abs().max().item() if got.numel() else 0.0
    scale = ref.nan_to_num(0.0).abs().max().item() if ref.numel() else 0.0
    ok = err <= 1e-7 + 1e-4 * scale + 1e-6 * gscale and torch.equal(got.isnan(), ref.isnan())
    denom = max(scale, gscale)
    return err / denom if denom > 0 else err, ok


def indices_ok(got: torch.Tensor, ref: torch.Tensor, probs: torch.Tensor) -> tuple[bool, int]:
    """Indices equal, or where they differ eager's probabilities at both equal (a tie): (ok, how many differ)."""
    if got.shape != ref.shape:
        return False, -1
    n = int((got != ref).sum().item())
    if n == 0:
        return True, 0
    g, r = (got.unsqueeze(-1), ref.unsqueeze(-1)) if got.dim() < probs.dim() else (got, ref)
    return bool(torch.equal(torch.gather(probs, -1, g.long()), torch.gather(probs, -1, r.long()))), n


@dataclasses.dataclass
class TopkRow(Row):
    family: str = ""
    k: int = 0
    compile_s: dict[str, float] = dataclasses.field(default_factory=dict)  # compile + first call, per backend
    peak_mb: dict[str, float] = dataclasses.field(default_factory=dict)    # vocab fwd: peak memory per backend
    index_diffs: dict[str, int] = dataclasses.field(default_factory=dict)  # differing indices (ties) per backend
    graphs: dict[str, int] = dataclasses.field(default_factory=dict)       # graphs smx compiled (moe)


def run_backends(row: TopkRow, compiled: dict, call: Callable, check: Callable, device: str,
                 describe: Callable[[str, int], str]) -> None:
    """Each backend's first call (its compile time), what smx did, and ``check(backend, result)``."""
    for b, f in compiled.items():
        n0, t0 = n_reports(), time.perf_counter()
        got = call(f)
        if device == "cuda":
            torch.cuda.synchronize()
        row.compile_s[b] = time.perf_counter() - t0
        if b.startswith("smx"):
            row.action[b] = describe(b, n0)
        if b != "eager":
            check(b, got)


def bench_case(device: str, case: Case, args, quiet: Quiet, log) -> list[TopkRow]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(case.rows, case.cols, generator=gen).to(device, case.dtype)
    fn = make_fn(case)
    with torch.no_grad():  # eager's probabilities: what the indices select (ties are not mismatches)
        probs = torch.softmax(x / 0.7 if case.family == "vocab" else x.float(), -1)
    rows: list[TopkRow] = []
    torch._dynamo.reset()
    compiled = {b: compile_for(b, fn) for b in BACKENDS}
    for pass_ in case.passes:
        row = TopkRow(device, case.shape, "argmax" if case.family == "argmax" else f"k={case.k}", pass_,
                      family=case.family, k=case.k)
        train = pass_ == "fwd+bwd"
        xg = x.clone().requires_grad_(True)
        g = torch.randn(case.rows, case.k, generator=gen).to(device, case.dtype)
        gscale = 0.0
        if train:
            ref_v, ref_i = fn(xg)
            ref = (torch.autograd.grad(ref_v, xg, g)[0], ref_i)
            gscale = g.abs().max().item() * ref_v.detach().abs().max().item()
        else:
            with torch.no_grad():
                ref = fn(x)

        def call(f):
            if train:
                v, i = f(xg)
                return torch.autograd.grad(v, xg, g)[0], i
            with torch.no_grad():
                return f(x)

        def check(b, got):
            if case.family == "argmax":
                ok, nd = indices_ok(got, ref, probs)
                row.max_err[b] = 0.0
            else:
                row.max_err[b], ok_v = rel_err(got[0], ref[0], gscale)
                ok_i, nd = indices_ok(got[1], ref[1], probs)
                ok = ok_v and ok_i
            if nd:
                row.index_diffs[b] = nd
            if not ok:
                row.mismatch.append(b)

        run_backends(row, compiled, call, check, device, lambda b, n0: describe_sites(sites_since(n0)[0]))
        if train:
            time_row(row, {b: ("torch.autograd.grad(f(x)[0], x, g)", {"f": compiled[b], "x": xg, "g": g,
                                                                       "torch": torch}) for b in BACKENDS},
                     args, quiet, log)
        else:
            with torch.no_grad():
                time_row(row, {b: ("f(x)", {"f": compiled[b], "x": x}) for b in BACKENDS}, args, quiet, log)
                if case.family == "vocab" and args.memory:
                    for b in BACKENDS:
                        row.peak_mb[b] = common.peak_mb(lambda f=compiled[b]: f(x), device)
        rows.append(row)
    torch._dynamo.reset()
    return rows


def build_moe(experts: int, top_k: int, device: str):
    """transformers' MixtralSparseMoeBlock (hidden 256, intermediate 512), random weights of std 0.05."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    cfg = MixtralConfig(hidden_size=256, intermediate_size=512, num_local_experts=experts,
                        num_experts_per_tok=top_k, router_jitter_noise=0.0)
    cfg._experts_implementation = "grouped_mm"  # what PreTrainedModel picks (a bare block would warn, loop)
    torch.manual_seed(0)
    blk = MixtralSparseMoeBlock(cfg)
    with torch.no_grad():
        for p in blk.parameters():
            p.normal_(0.0, 0.05)
    return blk.to(device), cfg._experts_implementation


def bench_moe(device: str, case: Case, args, quiet: Quiet, log) -> list[TopkRow]:
    try:
        blk, impl = build_moe(case.cols, case.k, device)
    except ImportError as e:
        log(f"  moe: transformers is not installed ({e}); skipped")
        return []
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, case.rows, 256, generator=gen).to(device)
    g = torch.randn(1, case.rows, 256, generator=gen).to(device)
    params = list(blk.parameters())
    rows = []
    torch._dynamo.reset()

    def block(x):
        return blk(x)

    compiled = {b: compile_for(b, block) for b in BACKENDS}
    for pass_ in case.passes:
        train = pass_ == "fwd+bwd"
        blk.train(train)
        row = TopkRow(device, f"{case.rows}tok x {case.cols}exp", f"top-{case.k} ({impl})", pass_, family="moe",
                      k=case.k)
        xg = x.clone().requires_grad_(True)

        def call(f):
            if train:
                return torch.autograd.grad(f(xg), [xg, *params], g)
            with torch.no_grad():
                return (f(x),)

        ref = call(blk)

        def check(b, got):
            errs = [rel_err(a, r) for a, r in zip(got, ref)]
            row.max_err[b] = max(e for e, _ in errs)
            if not all(ok for _, ok in errs):
                row.mismatch.append(b)

        def describe(b, n0):
            sites, row.graphs[b] = sites_since(n0)
            return count_sites(sites, row.graphs[b])

        run_backends(row, compiled, call, check, device, describe)
        if train:
            time_row(row, {b: ("torch.autograd.grad(f(x), ps, g)", {"f": compiled[b], "x": xg, "ps": [xg, *params],
                                                                     "g": g, "torch": torch}) for b in BACKENDS},
                     args, quiet, log)
        else:
            with torch.no_grad():
                time_row(row, {b: ("f(x)", {"f": compiled[b], "x": x}) for b in BACKENDS}, args, quiet, log)
        rows.append(row)
    torch._dynamo.reset()
    return rows


TITLES = {
    "router": "router: v, i = topk(softmax(logits.float(), -1), k); v = v / v.sum(-1, keepdim=True)",
    "vocab": "vocab: topk(softmax(logits / 0.7, -1), k)",
    "argmax": "argmax: argmax(softmax(x, -1), -1)",
    "top1": "top1: p = softmax(x, -1); max(p, -1).values[:, None], argmax(p, -1)",
    "entries": "entries: k=2 NLLB-MoE's top-2 gates (p * one_hot(i)).sum(-1); k=1 softmax(x).gather(-1, x.argmin)",
    "moe": "MixtralSparseMoeBlock (hidden 256, intermediate 512), 2048 tokens",
}


def table_rows(rows: list[TopkRow]) -> tuple[list[str], list[list[str]]]:
    head = ["case", "pass"] + [f"{b} ms" + ("" if b == "inductor" else " (/ind)") for b in BACKENDS]
    out = []
    for r in rows:
        acts = [f"{b}: {r.action[b]}" for b in ("smx", "smx-rewrite") if b in r.action]
        if len(acts) == 2 and r.action.get("smx") == r.action.get("smx-rewrite"):
            acts = [f"both: {r.action['smx']}"]
        oth = "-" if r.others is None else f"{r.others:.2f}" + (" *" if r.others > NOISY else "")
        out.append([f"{r.shape} {r.case}", r.pass_] + [fmt_ms(r, b) for b in BACKENDS] + [oth, "; ".join(acts)])
    return head + ["others", "smx did"], out


def memory_rows(rows: list[TopkRow]) -> tuple[list[str], list[list[str]]]:
    head = ["case", "probabilities MB"] + [f"{b} peak MB" for b in BACKENDS]
    out = []
    for r in (r for r in rows if r.peak_mb):
        n, c = (int(t) for t in r.shape.split("x"))
        out.append([f"{r.shape} {r.case}", f"{n * c * 4 / MB:.2f}"]
                   + [f"{r.peak_mb[b]:.2f}" if b in r.peak_mb else "-" for b in BACKENDS])
    return head, out


def plot(rows: list[TopkRow], path: str, title: str) -> str | None:
    """Horizontal bars of smx / inductor and smx-rewrite / inductor per row, log scale."""
    plt = common.pyplot()
    if plt is None:
        return "--plot: " + common.NO_MATPLOTLIB
    import matplotlib.ticker

    rows = [r for r in rows if "inductor" in r.ms]
    if not rows:
        return "--plot: no rows"
    labels = [f"{r.device} {r.family} {r.shape}{'' if r.family == 'argmax' else ' ' + r.case} {r.pass_}"
              + (" *" if (r.others or 0) > NOISY else "") for r in rows]
    series = [b for b in ("smx", "smx-rewrite") if any(b in r.ms for r in rows)]
    fig, ax = plt.subplots(figsize=(10, 0.28 * len(rows) * len(series) + 1.8))
    h = 0.8 / len(series)
    for si, b in enumerate(series):
        ys = [i + (si - (len(series) - 1) / 2) * h for i in range(len(rows))]
        vals = [r.ratio(b) or float("nan") for r in rows]
        ax.barh(ys, vals, height=h, color={"smx": "tab:blue", "smx-rewrite": "tab:orange"}[b], label=f"{b} / inductor")
        for y, v in zip(ys, vals):
            if v == v:
                ax.text(v, y, f" {v:.2f}", va="center", fontsize=6)
    ax.axvline(1.0, color="black", lw=0.8)
    ax.set_xscale("log")
    ax.set_yticks(range(len(rows)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("time / Inductor's time (log; < 1: faster than Inductor)")
    for axis in (ax.xaxis.set_major_formatter, ax.xaxis.set_minor_formatter):
        axis(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.tick_params(axis="x", which="minor", labelsize=6)
    ax.grid(axis="x", alpha=0.3, which="both")
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title(textwrap.fill(title, 140), fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    common.timing_flags(p, 3, 0.2, "smoke run: router 8192x64 k=2 (fwd, fwd+bwd), vocab 4x131072 k=50, argmax "
                                   "4x131072; one short round each (numbers are rough)")
    p.add_argument("--families", type=common.choice_list(FAMILIES), metavar="LIST",
                   help=f"comma-separated subset of {','.join(FAMILIES)} (default: all; with --quick: the quick "
                        "cases of these families, router,vocab,argmax by default; --quick --families moe: the "
                        "8-expert block)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto (default): CPU, and CUDA too when available; or only one of them")
    p.add_argument("--no-memory", dest="memory", action="store_false",
                   help="skip the peak-memory measurement of the vocab rows")
    common.add_noise_flags(p)
    p.add_argument("--stat", choices=("median", "min"), default="median",
                   help="figure the tables, ratios and plot show: the median block (default) or the fastest "
                        "block (less sensitive to other processes' load); the JSON has both")
    p.add_argument("--plot", metavar="PATH", help="write a bar chart of smx / inductor per row (PNG; matplotlib)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    warnings.filterwarnings("ignore", module="transformers")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    for name in ("cache_size_limit", "recompile_limit"):  # the moe block's functions are shared by every backend
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 64)
    args.rounds = args.rounds or (1 if args.quick else 3)
    args.min_run_time = args.min_run_time or (0.05 if args.quick else 0.2)
    families = args.families or list(QUICK_FAMILIES if args.quick else FAMILIES)
    cases = [c for c in (QUICK_CASES if args.quick else all_cases()) if c.family in families]
    devices = common.devices(args.device)
    torch.set_num_threads(args.threads)
    command, env = common.command_line(), common.environment(args.threads)
    common.print_header(command, env, "the `others` column says which rows they disturbed" + (
        "; --threads 1 is much less sensitive to them" if args.threads > 1 else ""))
    print(f"timing: torch.utils.benchmark blocked_autorange, {args.rounds} interleaved round(s) x "
          f"{args.min_run_time}s per backend; tables: {args.stat} ms; (/ind) = ratio to inductor, < 1 faster",
          flush=True)
    t_start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"  [{time.perf_counter() - t_start:6.1f}s] {msg}", flush=True)

    quiet = Quiet(args.wait_quiet, args.wait_budget, log)
    result: dict[str, Any] = {"command": command, "env": env, "rounds": args.rounds, "table_stat": args.stat,
                              "min_run_time": args.min_run_time, "noisy_threshold_cores": NOISY, "rows": []}
    all_rows: list[TopkRow] = []
    for device in devices:
        for case in cases:
            try:
                rows = (bench_moe if case.family == "moe" else bench_case)(device, case, args, quiet, log)
            except Exception as e:  # keep the finished rows; say what failed
                log(f"{device} {case.label}: FAILED {type(e).__name__}: {e}")
                result.setdefault("errors", []).append(f"{device} {case.label}: {type(e).__name__}: {e}")
                torch._dynamo.reset()
                continue
            all_rows.extend(rows)
            for r in rows:
                log(f"{r.device} {r.family} {r.shape} {r.case} {r.pass_}: " + ", ".join(
                    f"{b} {fmt_ms(r, b)}" for b in BACKENDS) + ("" if r.others is None else f", others {r.others:.2f}")
                    + f"; smx: {r.action.get('smx', '-')}")
            result["rows"] = [r.record() for r in all_rows]
            common.write_json(args.json, result)
    for device in devices:
        where = env["cuda"] if device == "cuda" else env["cpu"]
        for fam in FAMILIES:
            rows = [r for r in all_rows if r.device == device and r.family == fam]
            if rows:
                common.print_table(f"{TITLES[fam]} -- {device} ({where}, {args.threads} threads)",
                                   *table_rows(shown(rows, args.stat)), args.markdown)
            head, body = memory_rows(rows) if fam == "vocab" else (None, None)
            if body:
                common.print_table(f"vocab, fwd: peak memory of one call above the memory in use before it (MB) -- "
                                   f"{device}", head, body, args.markdown)
    env["loadavg_at_end"] = common.loadavg()
    noisy = [r for r in all_rows if r.others is not None and r.others > NOISY]
    print(f"\nload average at start {env.get('loadavg_at_start')}, at end {env.get('loadavg_at_end')} "
          f"({env['cores']} cores); {len(noisy)} of {len(all_rows)} rows were timed while other processes used "
          f"> {NOISY} cores (marked *)" + (f"; waited {quiet.waited:.0f} s for quiet" if quiet.waited else ""))
    slow = [line for r in all_rows for b in ("smx", "smx-rewrite")
            if (line := common.slower_line(r, b, SLOWER, f"{r.device} {r.family} {r.shape} {r.case} {r.pass_}"))]
    print(f"\nslower than Inductor (ratio > {SLOWER}):" + ("" if slow else " none") + "".join(f"\n  {s}" for s in slow))
    result["slower_than_inductor"] = slow
    if args.plot:
        print(plot(shown(all_rows, args.stat), args.plot, f"smx / inductor ({args.stat} ms), fp32 -- {command}")
              or f"wrote {args.plot}")
    common.write_json(args.json, result)
    bad = [r for r in all_rows if r.mismatch]
    for r in bad:
        print(f"MISMATCH vs eager: {r.device} {r.family} {r.shape} {r.case} {r.pass_}: {r.mismatch} "
              f"max rel err={r.max_err} differing indices={r.index_diffs}")
    for e in result.get("errors", []):
        print(f"ERROR: {e}")
    print(f"\n$ {command}   ({time.perf_counter() - t_start:.0f} s)" + (f"\nwrote {args.json}" if args.json else ""))
    return 1 if bad or result.get("errors") else 0


if __name__ == "__main__":
    sys.exit(main())
