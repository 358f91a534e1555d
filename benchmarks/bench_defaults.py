#!/usr/bin/env python
"""Every default decision of the smx backend (softmax, routers, samplers, attention, score_mod, linear + CE, CE,
quantized softmax) timed under eager, Inductor and smx with default options, one matrix on the CPU; the rows where
smx is slower than Inductor beyond the noise are listed. Families, columns: benchmarks/README.md.

  python benchmarks/bench_defaults.py [--quick] [--families LIST] [--only TEXT] [--big] [--json P] [--plot P]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import textwrap
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F

import common
from bench_linear_ce import loss_fn
from bench_quant_softmax import f_qdq
from bench_softmax_topk import make_sampler
from common import Row, compile_for, fmt_ms, measure_interleaved, n_reports, sites_since

FAMILIES = ("softmax", "router", "sampler", "attention", "score_mod", "linear_ce", "cross_entropy", "quant_softmax")
SLOW = 1 / 0.97          # a time ratio above this (and above the noise) is "below 0.97x Inductor"
BACKENDS = ["eager", "inductor", "smx"]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TOL = {"fp32": (1e-5, 1e-4), "bf16": (1e-3, 2e-2)}   # (atol, rtol of max|eager|)


@dataclasses.dataclass(frozen=True)
class Case:
    family: str
    name: str
    shape: str                # "rows x cols", or B x H x T x D for attention
    dtype: str = "fp32"
    passes: tuple[str, ...] = ("infer", "train")
    quick: bool = False       # one of --quick's points
    big: bool = False         # only with --big

    @property
    def label(self) -> str:
        return f"{self.family} {self.name} {self.shape} {self.dtype}"


def all_cases() -> list[Case]:
    C = Case
    cs = [C("softmax", "softmax", "4096x1024"), C("softmax", "softmax", "64x32000", quick=True),
          C("softmax", "softmax", "16x131072"), C("softmax", "log_softmax", "64x32000"),
          C("softmax", "masked", "4096x1024"), C("softmax", "softmax", "64x32000", "bf16")]
    for shape, k in (("8192x8", 2), ("8192x64", 2), ("2048x256", 8)):
        for renorm in (False, True):
            cs.append(C("router", f"topk{'+renorm' if renorm else ''} k={k}", shape,
                        quick=renorm and shape == "8192x64"))
    cs.append(C("router", "topk+renorm k=2", "8192x64", "bf16"))
    for shape in ("16x32000", "16x131072", "4x262144"):
        cs.append(C("sampler", "topk k=50", shape, passes=("infer",), quick=shape == "16x131072"))
    cs.append(C("sampler", "topk k=50", "16x32000", "bf16", passes=("infer",)))
    cs += [C("attention", "causal", "2x8x128x64"), C("attention", "causal", "2x8x512x64", quick=True),
           C("attention", "causal", "1x8x2048x64"), C("attention", "causal", "1x8x4096x64", big=True),
           C("attention", "padded", "2x8x512x64"), C("attention", "gqa 8q/2kv", "2x8x512x64"),
           C("attention", "causal", "2x8x512x64", "bf16")]
    cs += [C("score_mod", "silu", "2x8x512x64", passes=("infer",)),
           C("score_mod", "silu", "1x8x1024x64", passes=("infer",), quick=True),
           C("score_mod", "silu", "1x8x2048x64", passes=("infer",)),
           C("score_mod", "gate", "1x8x1024x64", passes=("infer",)),
           C("score_mod", "silu+pad", "2x8x1024x64", passes=("infer",))]
    for v in (16384, 50257, 131072, 262144):
        cs.append(C("linear_ce", "linear+ce", f"1024x256x{v}", quick=v == 16384, big=v == 262144))
    cs.append(C("linear_ce", "linear+ce", "128x128x16384", "bf16"))   # ATen's bf16 matmuls are slow on some CPUs
    cs += [C("cross_entropy", "ce", "1024x32000", quick=True), C("cross_entropy", "ce", "1024x32000", "bf16")]
    cs += [C("quant_softmax", "qdq", "8x12x128x128", passes=("infer",)),
           C("quant_softmax", "qdq", "64x32000", passes=("infer",), quick=True),
           C("quant_softmax", "qdq", "64x32000", "bf16", passes=("infer",))]
    return cs


TITLES = {
    "softmax": "softmax: torch.softmax(x, -1) | log_softmax | masked: torch.softmax(x * 0.125 + mask, -1)",
    "router": "router: v, i = torch.topk(torch.softmax(logits, -1), k) [; v = v / v.sum(-1, keepdim=True)]",
    "sampler": "sampler: torch.topk(torch.softmax(logits / 0.7, -1), 50)",
    "attention": "attention: softmax(q @ k^T * D**-0.5, causal masked_fill [+ pad mask]) @ v, B x H x T x D",
    "score_mod": "score_mod: softmax(f(q @ k^T * D**-0.5)) @ v, f pointwise, B x H x T x D",
    "linear_ce": "linear_ce: F.cross_entropy(F.linear(x, w), y), N x D x V",
    "cross_entropy": "cross_entropy: F.cross_entropy(logits, y)",
    "quant_softmax": "quant_softmax: dequantize(quantize(softmax(x, -1), 1/255, 0, 0, 255, uint8))",
}


def f_softmax(x):
    return torch.softmax(x, -1)


def f_log_softmax(x):
    return torch.log_softmax(x, -1)


def f_masked(x, mask):
    return torch.softmax(x * 0.125 + mask, -1)


def make_router(k: int, renorm: bool) -> Callable:
    def router(logits):
        v, i = torch.topk(torch.softmax(logits, -1), k)
        if renorm:
            v = v / v.sum(-1, keepdim=True)
        return v, i

    return router


def attn_causal(q, k, v):
    T, S = q.size(-2), k.size(-2)
    causal = torch.ones(T, S, dtype=torch.bool, device=q.device).tril()
    s = q @ k.transpose(-2, -1) * q.size(-1) ** -0.5
    s = s.masked_fill(~causal, float("-inf"))
    return torch.softmax(s, -1) @ v


def attn_padded(q, k, v, pad):
    T, S = q.size(-2), k.size(-2)
    causal = torch.ones(T, S, dtype=torch.bool, device=q.device).tril()
    s = q @ k.transpose(-2, -1) * q.size(-1) ** -0.5 + pad
    s = s.masked_fill(~causal, float("-inf"))
    return torch.softmax(s, -1) @ v


def attn_gqa(q, k, v):
    n = q.size(1) // k.size(1)
    k, v = k.repeat_interleave(n, dim=1), v.repeat_interleave(n, dim=1)
    return attn_causal(q, k, v)


def attn_silu(q, k, v, *side):
    s = q @ k.transpose(-2, -1) * q.size(-1) ** -0.5
    return torch.softmax(s * torch.sigmoid(s) + (side[0] if side else 0.0), -1) @ v


def attn_gate(q, k, v, gate):
    s = q @ k.transpose(-2, -1) * q.size(-1) ** -0.5
    return torch.softmax(s * torch.sigmoid(gate), -1) @ v


def f_ce(logits, y):
    return F.cross_entropy(logits, y)


@dataclasses.dataclass
class Built:
    fn: Callable
    inputs: list[torch.Tensor]
    grad_idx: tuple[int, ...]                 # the inputs the train pass differentiates
    probs: Callable | None = None             # top-k: eager's probabilities, to tell ties from wrong indices


def build(c: Case) -> Built:
    gen = torch.Generator().manual_seed(0)
    dt = DTYPES[c.dtype]
    dims = [int(t) for t in c.shape.split("x")]

    rnd = lambda *shape, scale=1.0: (torch.randn(*shape, generator=gen) * scale).to(dt)  # noqa: E731

    if c.family == "softmax":
        x = rnd(*dims, scale=4.0)
        if c.name == "masked":
            mask = torch.zeros(1, dims[1])
            mask[:, dims[1] - dims[1] // 8:] = float("-inf")
            return Built(f_masked, [x, mask.to(dt)], (0,))
        return Built(f_log_softmax if c.name == "log_softmax" else f_softmax, [x], (0,))
    if c.family in ("router", "sampler"):
        x = rnd(*dims, scale=2.0)
        if c.family == "sampler":
            return Built(make_sampler(50), [x], (0,), probs=lambda t: torch.softmax(t / 0.7, -1))
        k = int(c.name.split("k=")[1])
        return Built(make_router(k, "renorm" in c.name), [x], (0,), probs=lambda t: torch.softmax(t, -1))
    if c.family == "attention":
        B, H, T, D = dims
        hkv = 2 if c.name.startswith("gqa") else H
        q, k, v = rnd(B, H, T, D), rnd(B, hkv, T, D), rnd(B, hkv, T, D)
        if c.name == "padded":
            pad = torch.zeros(B, 1, 1, T)
            pad[-1, :, :, T - 64:] = torch.finfo(torch.float32).min   # HF-style additive padding mask
            return Built(attn_padded, [q, k, v, pad.to(dt)], (0, 1, 2))
        return Built(attn_gqa if hkv != H else attn_causal, [q, k, v], (0, 1, 2))
    if c.family == "score_mod":
        B, H, T, D = dims
        q, k, v = rnd(B, H, T, D), rnd(B, H, T, D), rnd(B, H, T, D)
        if c.name == "gate":
            return Built(attn_gate, [q, k, v, rnd(H, T, T)], (0, 1, 2))
        if c.name == "silu+pad":
            pad = torch.zeros(B, 1, 1, T)
            pad[-1, :, :, T - 64:] = torch.finfo(torch.float32).min
            return Built(attn_silu, [q, k, v, pad.to(dt)], (0, 1, 2))
        return Built(attn_silu, [q, k, v], (0, 1, 2))
    if c.family == "linear_ce":
        N, D, V = dims
        x, w = rnd(N, D), rnd(V, D, scale=D ** -0.5)
        return Built(loss_fn, [x, w, torch.randint(0, V, (N,), generator=gen)], (0, 1))
    if c.family == "cross_entropy":
        N, V = dims
        return Built(f_ce, [rnd(N, V, scale=2.0), torch.randint(0, V, (N,), generator=gen)], (0,))
    if c.family == "quant_softmax":
        return Built(f_qdq, [rnd(*dims, scale=4.0)], (0,))
    raise ValueError(c.family)


def as_list(out) -> list[torch.Tensor]:
    return list(out) if isinstance(out, (tuple, list)) else [out]


def first(out):
    return as_list(out)[0]


def compare(got, ref, dtype: str, probs: torch.Tensor | None, rows: torch.Tensor | None = None) -> tuple[float, bool]:
    """(max |got - ref| / max|ref| over the float outputs, all within tolerance); integer outputs are top-k
    indices: equal, or where they differ eager's probabilities at both equal (ties). ``rows``: compare only
    these rows (a bool mask over the first dim)."""
    atol, rtol = TOL[dtype]
    worst, ok = 0.0, True
    for g, r in zip(as_list(got), as_list(ref)):
        if g.shape != r.shape:
            return float("inf"), False
        if rows is not None:
            g, r = g[rows], r[rows]
        if not r.is_floating_point():
            if probs is not None and not torch.equal(g, r):
                ok &= bool(torch.equal(probs.gather(-1, g.long()), probs.gather(-1, r.long())))
            elif probs is None:
                ok &= bool(torch.equal(g, r))
            continue
        g, r = g.detach().float(), r.detach().float()
        err = (g - r).nan_to_num(0.0).abs().max().item() if r.numel() else 0.0
        scale = r.nan_to_num(0.0).abs().max().item() if r.numel() else 0.0
        ok &= err <= atol + rtol * scale and torch.equal(g.isnan(), r.isnan())
        worst = max(worst, err / scale if scale > 0 else err)
    return worst, ok


def describe(sites: list) -> tuple[str, str]:
    """(what smx did, e.g. 'softmax rewritten (smx::softmax)' or 'softmax kept'; the distinct reasons)."""
    acts = {f"{s.kind} {s.action}" + (f" ({s.op})" if s.action == "rewritten" and s.op else ""): None for s in sites}
    return ", ".join(acts) or "no site", " | ".join(dict.fromkeys(s.reason for s in sites if s.reason))


def short_reason(reason: str, n: int = 70) -> str:
    r = reason.split(" | ")[0].split(";")[0].split(" (")[0]
    return r if len(r) <= n else r[: n - 3] + "..."


@dataclasses.dataclass
class DRow(Row):
    family: str = ""
    dtype: str = "fp32"
    smx_action: str = ""
    smx_reason: str = ""
    errors: dict[str, str] = dataclasses.field(default_factory=dict)    # backend -> "Type: message"
    compile_s: dict[str, float] = dataclasses.field(default_factory=dict)

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
        r = self.ratio("smx")
        return r is not None and r > SLOW and r * (1 - (self.noise or 0.0)) > 1

    def record(self) -> dict[str, Any]:
        return {"family": self.family, "case": self.case, "shape": self.shape, "dtype": self.dtype,
                "pass": self.pass_, **{f"{b}_ms": self.ms.get(b) for b in BACKENDS},
                "smx_over_inductor": self.ratio("smx"), "eager_over_inductor": self.ratio("eager"), "noise": self.noise,
                "iqr_ms": self.iqr_ms, "min_ms": self.min_ms, "smx_action": self.smx_action,
                "smx_reason": self.smx_reason, "max_rel_err": self.max_err, "mismatch": self.mismatch,
                "errors": self.errors, "compile_s": self.compile_s, "slow": self.slow}


def err_text(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"


def run_backend(compiled: Callable, xs: list, ps: list, train: bool, g: list):
    """One call: the output under no_grad, or (the forward's outputs, the gradients of its first w.r.t. ``ps``
    against ``g[0]``, a fixed random cotangent drawn at the first call; the scalar losses: 1)."""
    if not train:
        with torch.no_grad():
            return None, compiled(*xs)
    outs = as_list(compiled(*xs))
    if g[0] is None:
        out = outs[0]
        g[0] = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype) \
            if out.dim() else torch.ones((), dtype=out.dtype)
    return [t.detach() for t in outs], torch.autograd.grad(outs[0], ps, g[0])


def check_row(row: DRow, b: str, fwd: dict, results: dict, dtype: str, probs, train: bool) -> None:
    """``b``'s result against eager's; top-k training: where the indices differ (ties, checked on the forward) the
    gradient lands elsewhere, so the gradients are compared on the rows with eager's indices."""
    if train and probs is not None:
        e_f, ok_f = compare(fwd[b], fwd["eager"], dtype, probs)
        same = (fwd[b][1] == fwd["eager"][1]).all(-1) if e_f != float("inf") else None
        e_g, ok_g = compare(results[b], results["eager"], dtype, None, same)
        row.max_err[b], ok = max(e_f, e_g), ok_f and ok_g
    else:
        row.max_err[b], ok = compare(results[b], results["eager"], dtype, None if train else probs)
    if not ok:
        row.mismatch.append(b)


def bench_case(c: Case, args, log: Callable[[str], None]) -> list[DRow]:
    b_ = build(c)
    torch._dynamo.reset()
    compiled = {b: compile_for(b, b_.fn) for b in BACKENDS}
    rows = []
    for pass_ in c.passes:
        train = pass_ == "train"
        row = DRow("cpu", c.shape, c.name, pass_, family=c.family, dtype=c.dtype)
        xs = [t.clone().requires_grad_(True) if train and i in b_.grad_idx else t for i, t in enumerate(b_.inputs)]
        ps = [xs[i] for i in b_.grad_idx]
        probs = b_.probs(b_.inputs[0]) if b_.probs else None
        g, results, fwd = [None], {}, {}
        for b in BACKENDS:
            n0, t0 = n_reports(), time.perf_counter()
            try:
                fwd[b], results[b] = run_backend(compiled[b], xs, ps, train, g)
            except Exception as e:  # a row that raises is reported, the others go on
                row.errors[b] = err_text(e)
            row.compile_s[b] = time.perf_counter() - t0
            if b == "smx":
                row.smx_action, row.smx_reason = describe(sites_since(n0)[0])
            if b != "eager" and b in results and "eager" in results:
                check_row(row, b, fwd, results, c.dtype, probs, train)
        ok_b = [b for b in BACKENDS if b in results]
        if train:
            stmts = {b: ("torch.autograd.grad(first(f(*xs)), ps, g)", {"f": compiled[b], "xs": xs, "ps": ps,
                                                                        "g": g[0], "first": first, "torch": torch})
                     for b in ok_b}
            row.ms, row.iqr_ms, row.min_ms = measure_interleaved(stmts, args.threads, args.rounds, args.min_run_time)
        else:
            with torch.no_grad():
                row.ms, row.iqr_ms, row.min_ms = measure_interleaved(
                    {b: ("f(*xs)", {"f": compiled[b], "xs": xs}) for b in ok_b}, args.threads, args.rounds,
                    args.min_run_time)
        rows.append(row)
        log(f"{c.label} {pass_}: " + ", ".join(f"{b} {fmt_ms(row, b)}" if b in row.ms else f"{b} ERR"
                                               for b in BACKENDS) + f"; smx: {row.smx_action}")
    torch._dynamo.reset()
    return rows


def pct(v: float | None) -> str:
    return "?" if v is None else f"{100 * v:.0f}%"


def table_rows(rows: list[DRow]) -> tuple[list[str], list[list[str]]]:
    head = ["case", "shape", "dtype", "pass", "eager ms (/ind)", "inductor ms", "smx ms (/ind)", "noise", "smx did"]
    return head, [[r.case, r.shape, r.dtype, r.pass_] + ["ERR" if b in r.errors else fmt_ms(r, b) for b in BACKENDS]
                  + [pct(r.noise), r.smx_action + (f": {short_reason(r.smx_reason)}" if r.smx_reason else "")]
                  for r in rows]


def slow_lines(rows: list[DRow]) -> list[str]:
    return [f"{r.family} {r.case} {r.shape} {r.dtype} {r.pass_}: smx {r.ratio('smx'):.2f}x inductor's time (fastest "
            f"blocks {r.ratio('smx', r.min_ms) or float('nan'):.2f}x, noise {pct(r.noise)})"
            + ("" if "rewritten" in r.smx_action else " [nothing rewritten: Inductor compiled the same graph, so the "
               "gap is noise]") + f"; smx did: {r.smx_action}" + (f" -- {r.smx_reason}" if r.smx_reason else "")
            for r in rows if r.slow]


def plot(rows: list[DRow], path: str, title: str) -> str | None:
    """A heatmap: cases x (pass, dtype), colour smx / inductor on a diverging map centred on 1."""
    plt = common.pyplot()
    if plt is None:
        return "--plot: " + common.NO_MATPLOTLIB
    from matplotlib.colors import TwoSlopeNorm

    if not rows:
        return "--plot: no rows"
    cols = [c for c in ("infer fp32", "train fp32", "infer bf16", "train bf16")
            if any(f"{r.pass_} {r.dtype}" == c for r in rows)]
    ylabels = list(dict.fromkeys(f"{r.family}: {r.case} {r.shape}" for r in rows))
    cells = {(ylabels.index(f"{r.family}: {r.case} {r.shape}"), cols.index(f"{r.pass_} {r.dtype}")): r for r in rows}
    logs = [[math.nan] * len(cols) for _ in ylabels]
    for (i, j), r in cells.items():
        if r.ratio("smx"):
            logs[i][j] = math.log2(r.ratio("smx"))
    lim = min(2.0, max([math.log2(1.25)] + [abs(v) for row in logs for v in row if v == v]))
    width = max(6.5, 2.5 + 1.7 * len(cols))
    fig, ax = plt.subplots(figsize=(width, 0.38 * len(ylabels) + 1.8))
    cmap = plt.get_cmap("RdBu_r").copy()
    cmap.set_bad("#dddddd")
    im = ax.imshow(logs, cmap=cmap, norm=TwoSlopeNorm(0.0, -lim, lim), aspect="auto")
    for (i, j), r in cells.items():
        v = r.ratio("smx")
        act = "kept" if " kept" in r.smx_action else ("rewr" if "rewritten" in r.smx_action else r.smx_action[:8])
        txt = "ERR" if r.errors else (f"{v:.2f}" + (" !" if r.mismatch else "") + ("*" if r.slow else "")
                                      + f"\n{act}" if v else "-")
        dark = v is not None and abs(math.log2(v)) > 0.6 * lim
        ax.text(j, i, txt, ha="center", va="center", fontsize=7, color="white" if dark else "black")
    ax.set_xticks(range(len(cols)), cols, fontsize=8)
    ax.xaxis.tick_top()
    ax.set_yticks(range(len(ylabels)), ylabels, fontsize=7)
    ticks = [t for t in (0.25, 0.5, 0.67, 0.8, 1.0, 1.25, 1.5, 2.0, 4.0) if abs(math.log2(t)) <= lim]
    cb = fig.colorbar(im, ax=ax, ticks=[math.log2(t) for t in ticks], fraction=0.05)
    cb.ax.set_yticklabels([f"{t:g}" for t in ticks], fontsize=7)
    cb.set_label("smx time / inductor time (< 1: smx faster)", fontsize=8)
    ax.set_title(textwrap.fill(title, int(width * 11)), fontsize=7, pad=22)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    common.timing_flags(p, 2, 0.2, "CI smoke run: one point per family (fp32), one short round (numbers are rough)")
    p.add_argument("--families", type=common.choice_list(FAMILIES), metavar="LIST",
                   help=f"comma-separated subset of {','.join(FAMILIES)} (default: all)")
    p.add_argument("--only", metavar="TEXT", action="append",
                   help="only the cases whose label 'family case shape dtype' contains TEXT (repeatable: any of "
                        "them), e.g. --only bf16, --only 'router topk k=2', --only 64x32000")
    p.add_argument("--big", action="store_true",
                   help="also attention T=4096 and linear_ce V=262144 (adds ~3 min on 2 cores; not with --quick)")
    p.add_argument("--plot", metavar="PATH", help="write a heatmap of smx / inductor per case and pass (PNG; "
                                                  "needs matplotlib)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.rounds = args.rounds or (1 if args.quick else 2)
    args.min_run_time = args.min_run_time or (0.05 if args.quick else 0.2)
    cases = [c for c in all_cases() if c.family in (args.families or FAMILIES)
             and (c.quick if args.quick else (args.big or not c.big))
             and (not args.only or any(t in c.label for t in args.only))]
    torch.set_num_threads(args.threads)
    command, env = common.command_line(argv), common.environment(args.threads)
    common.print_header(command, env, "timings will be noisy (--threads 1 is less sensitive)")
    print(f"timing: {len(cases)} cases, torch.utils.benchmark blocked_autorange, {args.rounds} interleaved round(s) "
          f"x {args.min_run_time}s per backend; median ms; (/ind) = time / inductor's, < 1 faster", flush=True)
    t_start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"  [{time.perf_counter() - t_start:6.1f}s] {msg}", file=sys.stderr, flush=True)

    result: dict[str, Any] = {"command": command, "env": env, "rounds": args.rounds,
                              "min_run_time": args.min_run_time, "rows": [], "errors": []}
    rows: list[DRow] = []
    for c in cases:
        try:
            rows.extend(bench_case(c, args, log))
        except Exception as e:  # a case that raises outside a backend call (inputs, timing): say so, go on
            log(f"{c.label}: FAILED {err_text(e)}")
            result["errors"].append(f"{c.label}: {err_text(e)}")
            torch._dynamo.reset()
        result["rows"] = [r.record() for r in rows]
        common.write_json(args.json, result)
    for fam in FAMILIES:
        if fr := [r for r in rows if r.family == fam]:
            common.print_table(f"{TITLES[fam]} -- cpu ({env['cpu']}, {args.threads} threads)", *table_rows(fr),
                               args.markdown)
    slow = result["below_0.97x_inductor"] = slow_lines(rows)
    print(f"\nbelow 0.97x Inductor (smx time > {SLOW:.3f}x inductor's and beyond the noise):"
          + ("" if slow else " none") + "".join(f"\n  {s}" for s in slow))
    for r in rows:
        what = f"{r.family} {r.case} {r.shape} {r.dtype} {r.pass_}"
        msgs = ([f"MISMATCH vs eager: {what}: {r.mismatch} max rel err {r.max_err}"] if r.mismatch else []) + \
            [f"ERROR: {what} under {b}: {e}" for b, e in r.errors.items()]
        for msg in msgs:
            print(msg)
        result["errors"] += msgs
    common.print_load_at_end(env, "above the core count, other processes shared the CPUs")
    if args.plot:
        print(plot(rows, args.plot, "smx time / inductor time (median; * below 0.97x Inductor beyond noise, "
                   f"! mismatch, grey: not run; rewr / kept: what smx did) -- {command}") or f"wrote {args.plot}")
    result["wall_s"] = time.perf_counter() - t_start
    common.write_json(args.json, result)
    print(f"\n$ {command}   ({time.perf_counter() - t_start:.0f} s)" + (f"\nwrote {args.json}" if args.json else ""))
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
