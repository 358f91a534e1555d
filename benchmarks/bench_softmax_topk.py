#!/usr/bin/env python
"""Fused softmax + top-k, side by side: eager vs Inductor vs the ``smx`` backend (CPU, and CUDA when present).

The smx backend rewrites ``topk(softmax(x), k)`` (optionally renormalized, ``v / v.sum(-1, keepdim=True)``),
``softmax(topk(x).values)`` and ``argmax(softmax(x))`` without writing the probabilities of the whole row:
on CUDA a Triton kernel (smx::softmax_topk); on CPU a two-pass decomposition that Inductor compiles
(smxcompile/kernels/softmax_topk/decomposed.py: chunk maxima -> top-k over k*128 candidates for long rows,
k rounds of an int64-key max or a compare-exchange network for short ones; then one sum of exp). argmax(softmax(x)) loses its softmax.

Families of cases (--families), all fp32, reduction over the last (contiguous) dim:

  router  MoE router (Mixtral's gate), many tokens x few experts:
              v, i = torch.topk(torch.softmax(logits.float(), -1), k, -1); v = v / v.sum(-1, keepdim=True)
          shapes 8192x8, 8192x64, 2048x128 (tokens x experts), k in {1, 2, 8} (k <= experts);
          inference (fwd) and training (fwd+bwd: gradient of the values to the logits).
  vocab   top-k sampler over a vocabulary, few rows x many columns, not renormalized:
              v, i = torch.topk(torch.softmax(logits / 0.7, -1), k)
          shapes 16x32000, 4x131072, 4x262144, k in {1, 2, 8, 50}, inference; plus training at
          4x131072 k=8.
  argmax  torch.argmax(torch.softmax(x, -1), -1) at 4x131072 and 8192x64, inference (the rewrite deletes
          the softmax).
  top1    Switch Transformers' top-1 router, the row maximum read twice:
              p = torch.softmax(x, -1); torch.max(p, -1).values[:, None], torch.argmax(p, -1)
          at 8192x8 and 8192x64, fp32 and bf16, inference and training (the rewrite: graph_top1).
  entries probabilities read at a few entries per row (the rewrite: graph_softmax_entry):
              k=2: NLLB-MoE's top-2 router, p = softmax(x); i1 = argmax(p); i2 = the argmax of x without i1;
                   the gates (p * one_hot(i)).sum(-1) for both, at 8192x8, 8192x64, 2048x128, fwd and fwd+bwd;
              k=1: p.gather(-1, i) at an index computed from the logits (x.argmin), at 16x32000 and 4x131072.
  moe     the whole transformers MixtralSparseMoeBlock (router + experts, HF's default experts
          implementation "grouped_mm") of a small MixtralConfig: hidden 256, intermediate 512, top-2 of
          8 and of 64 experts, 2048 tokens (1 x 2048 x 256 input), random weights (std 0.05);
          inference (model.eval(), no_grad) and a training step (model.train(), gradient of the output
          to the input and every parameter). The router is a small part of this block: the row says
          whether smx rewrote it and what that does to the block's time, not the router's.

Backends (columns), each compiled with dynamic=False and its own copy of the function's code object:

  eager        the plain PyTorch function: the reference of every check.
  inductor     torch.compile(f) (backend="inductor"): the yardstick of every ratio (/ind).
  smx          torch.compile(f, backend="smx"), default options: on CPU the policy cpu="auto" rewrites
               every site with static shapes (it keeps only symbolic row lengths).
  smx-rewrite  torch.compile(f, backend="smx", options={"cpu": "rewrite", "cuda": "rewrite"}): every site rewritten
               (smx::softmax_topk; Triton on CUDA).

Columns of the tables:

  case         shape (rows x columns; for moe: tokens x experts) and k ("argmax" for argmax).
  pass         fwd: inference, the function called under torch.no_grad().
               fwd+bwd: training, torch.autograd.grad(values, logits, g) with a fixed random g
               (moe: torch.autograd.grad(block(x), [x, *params], g)).
  <b> ms       milliseconds per call, the median over every timed block of
               torch.utils.benchmark.Timer.blocked_autorange (the backends of a row timed in turn for
               --rounds rounds, alternating the order, so that a drifting machine favours none); with
               --stat min the fastest block instead (the least disturbed: use it on a busy machine). The
               JSON has both (ms: median, min_ms) and the inter-quartile range (iqr_ms).
  (0.85x)      that time divided by inductor's for the same row: below 1 is faster than Inductor.
  !            that backend's result differed from eager (checked once, before timing): values /
               gradients off by more than 1e-7 + 1e-4 * max|eager's| (gradients to the logits: plus
               1e-6 * max|g| * max|values|, since the k=1 renormalized router's values are the constant 1,
               its exact gradient 0 and eager's rounding noise), or an index that differs from eager's
               where the probabilities at the two indices differ too (a tie, where eager's probabilities
               at both indices are equal, is not a mismatch; moe: output and gradients).
  others       cores' worth of CPU that OTHER processes used while the row was timed (machine-wide busy
               time from /proc/stat minus this process's own CPU time, over the row's timing wall
               time; compilation excluded). Above 0.1 the row shared the CPUs with other work and its
               times are inflated, the multi-threaded ones most: rerun on a quiet machine
               (--wait-quiet, --retry-noisy). "-" where /proc/stat is not readable.
  smx did      what the smx backend reported for the softmax + top-k site of the graph(s) compiled for
               this row, per smx backend: "rewritten" (the CPU two-pass path, or "softmax deleted" for
               argmax; smx::softmax_topk on CUDA) or "kept: <reason>" (Inductor compiles the original).
               moe: {kind: action x count} summed over every graph of the block, and the graph count.

The vocab table has one more small table: peak memory of one inference call above the memory in use
just before it (inputs and compiled code already resident), MB = 10^6 bytes. CPU: the process's peak
RSS (/proc/self/status VmHWM after a reset with /proc/self/clear_refs, freed heap returned to the OS
first with glibc's malloc_trim; the least of 3 calls). CUDA: torch.cuda.max_memory_allocated. The full
probability tensor (rows x columns x 4 bytes) is what eager and Inductor write and smx does not.

After the tables: the rows where smx (default policy) or smx-rewrite is slower than Inductor (ratio
> 1.05 by the median or by the fastest block; both are printed, a row slower by one only is likely
noise), i.e. the sites the CPU policy must keep, and the command line. The exit status is 1 when a
compiled result disagreed with eager (or a case raised an error).

--plot PATH: a horizontal bar chart of smx / inductor and smx-rewrite / inductor per row (log scale,
1 = Inductor's time; rows marked * shared the CPUs with other processes).

Usage:
  python benchmarks/bench_softmax_topk.py --quick          # smoke run: 3 cases, short timings (~1 min)
  python benchmarks/bench_softmax_topk.py                  # every case (~8-10 min on 2 quiet cores)
  python benchmarks/bench_softmax_topk.py --markdown --json out.json --plot out.png
  python benchmarks/bench_softmax_topk.py --families router,moe --wait-quiet 30 --retry-noisy 1
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import logging
import os
import shlex
import sys
import textwrap
import time
import warnings
from typing import Any, Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# timing, table printing, environment, per-backend compile (bench_softmax.py); the CPU-load meter,
# quiet-wait and memory meter (bench_linear_ce.py)
from bench_softmax import (  # noqa: E402
    BACKENDS,
    Row,
    _cores,
    _fmt_ms,
    _write_json,
    compile_for,
    environment,
    measure_interleaved,
    n_reports,
    print_table,
)
from bench_linear_ce import NOISY, StepPeak, _busy_cpu_s, _children_cpu_s, wait_quiet  # noqa: E402

FAMILIES = ("router", "vocab", "argmax", "top1", "entries", "moe")
MB = 1e6
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
    cases = []
    for rows, cols in ((8192, 8), (8192, 64), (2048, 128)):
        for k in (1, 2, 8):
            if k <= cols:
                cases.append(Case("router", rows, cols, k, ("fwd", "fwd+bwd")))
    for rows, cols in ((16, 32000), (4, 131072), (4, 262144)):
        for k in (1, 2, 8, 50):
            cases.append(Case("vocab", rows, cols, k, ("fwd",)))
    cases.append(Case("vocab", 4, 131072, 8, ("fwd+bwd",)))
    cases.append(Case("argmax", 4, 131072, 1, ("fwd",)))
    cases.append(Case("argmax", 8192, 64, 1, ("fwd",)))
    for dtype, columns in ((torch.float32, (8, 64)), (torch.bfloat16, (8, 32, 64))):
        for cols in columns:
            cases.append(Case("top1", 8192, cols, 1, ("fwd", "fwd+bwd"), dtype))
    for rows, cols in ((8192, 8), (8192, 64), (2048, 128)):
        cases.append(Case("entries", rows, cols, 2, ("fwd", "fwd+bwd")))
    for rows, cols in ((16, 32000), (4, 131072)):
        cases.append(Case("entries", rows, cols, 1, ("fwd",)))
    cases.append(Case("moe", 2048, 8, 2, ("fwd", "fwd+bwd")))
    cases.append(Case("moe", 2048, 64, 2, ("fwd", "fwd+bwd")))
    return cases


QUICK_CASES = [Case("router", 8192, 64, 2, ("fwd", "fwd+bwd")), Case("vocab", 4, 131072, 50, ("fwd",)),
               Case("argmax", 4, 131072, 1, ("fwd",)), Case("moe", 2048, 8, 2, ("fwd", "fwd+bwd"))]
QUICK_FAMILIES = ("router", "vocab", "argmax")   # --quick without --families


# --------------------------------------------------------------------------- the functions measured


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
    if case.family == "router":
        return make_router(case.k)
    if case.family == "vocab":
        return make_sampler(case.k)
    if case.family == "argmax":
        return argmax_softmax
    if case.family == "top1":
        return top1_router
    raise ValueError(case.family)


def eager_probs(case: Case, x: torch.Tensor) -> torch.Tensor:
    """Eager's probabilities (what the indices select), for telling ties from wrong indices."""
    with torch.no_grad():
        return torch.softmax(x / 0.7 if case.family == "vocab" else x.float(), -1)


# --------------------------------------------------------------------------- smx reports


def sites_since(n0: int) -> tuple[list, int]:
    """The smx report sites of the graphs compiled since report ``n0``, and how many graphs."""
    from smxcompile.backends.smx import compiled_reports

    return [s for r in compiled_reports[n0:] for s in r], len(compiled_reports) - n0


def _short_op(op: str) -> str:
    if "two-pass" in op:
        return "CPU two-pass"
    return op


def describe_sites(sites: list) -> str:
    """One short line: the action of each distinct site (softmax_topk first), e.g. 'rewritten (CPU two-pass)'."""
    if not sites:
        return "no site"
    seen: dict[str, None] = {}
    for s in sorted(sites, key=lambda s: s.kind != "softmax_topk"):
        txt = s.action
        if s.action == "rewritten" and s.op:
            txt += f" ({_short_op(s.op)})"
        elif s.reason:
            txt += ": " + s.reason.split(";")[0]
        if s.kind != "softmax_topk":
            txt = f"{s.kind} {txt}"
        seen[txt] = None
    return ", ".join(seen)


def count_sites(sites: list, graphs: int) -> str:
    """{kind: action x count} over every graph, e.g. 'softmax_topk rewritten x1 (1 graph)'."""
    c = collections.Counter((s.kind, s.action) for s in sites)
    body = ", ".join(f"{kind} {action} x{n}" for (kind, action), n in sorted(c.items())) or "no site"
    return f"{body} ({graphs} graph{'s' if graphs != 1 else ''})"


# --------------------------------------------------------------------------- checks


def _rel_err(got: torch.Tensor, ref: torch.Tensor, gscale: float = 0.0) -> tuple[float, bool]:
    """(max|got - ref| / max(max|ref|, gscale), within 1e-7 + 1e-4 * max|ref| + 1e-6 * gscale).

    ``gscale`` (gradients to the logits: max|g| * max|values|) is the size the gradient would have
    without cancellation; k=1 renormalized values are constant (1), so their exact gradient is 0 and
    eager's is rounding noise of about 1e-7 * gscale.
    """
    got, ref = got.detach().float(), ref.detach().float()
    err = (got - ref).nan_to_num(0.0).abs().max().item() if got.numel() else 0.0
    scale = ref.nan_to_num(0.0).abs().max().item() if ref.numel() else 0.0
    ok = err <= 1e-7 + 1e-4 * scale + 1e-6 * gscale and torch.equal(got.isnan(), ref.isnan())
    denom = max(scale, gscale)
    return err / denom if denom > 0 else err, ok


def _indices_ok(got: torch.Tensor, ref: torch.Tensor, probs: torch.Tensor) -> tuple[bool, int]:
    """Indices equal, or, where they differ, eager's probabilities at both equal (ties): (ok, #differing)."""
    if got.shape != ref.shape:
        return False, -1
    diff = got != ref
    n = int(diff.sum().item())
    if n == 0:
        return True, 0
    g, r = got, ref
    if g.dim() < probs.dim():
        g, r = g.unsqueeze(-1), r.unsqueeze(-1)
    pg = torch.gather(probs, -1, g.long())
    pr = torch.gather(probs, -1, r.long())
    return bool(torch.equal(pg, pr)), n


# --------------------------------------------------------------------------- rows


@dataclasses.dataclass
class TopkRow(Row):
    family: str = ""
    k: int = 0
    others: float | None = None        # cores of other processes' CPU during the timing
    tries: list[float | None] = dataclasses.field(default_factory=list)  # others of each timing try (--retry-noisy)
    compile_s: dict[str, float] = dataclasses.field(default_factory=dict)  # compile + first call, per backend
    peak_mb: dict[str, float] = dataclasses.field(default_factory=dict)    # vocab fwd: peak memory per backend
    index_diffs: dict[str, int] = dataclasses.field(default_factory=dict)  # differing indices (ties) per backend
    graphs: dict[str, int] = dataclasses.field(default_factory=dict)       # graphs smx compiled (moe)


class Meter:
    """Cores' worth of CPU used by other processes over a region (machine busy time minus this process's)."""

    def __enter__(self):
        self.t0, self.b0, self.own0 = time.monotonic(), _busy_cpu_s(), _children_cpu_s()
        self.others: float | None = None
        return self

    def __exit__(self, *exc):
        b1, own1, wall = _busy_cpu_s(), _children_cpu_s(), time.monotonic() - self.t0
        if self.b0 is not None and b1 is not None and wall > 0:
            self.others = max(0.0, (b1 - self.b0) - (own1 - self.own0)) / wall


class Quiet:
    """--wait-quiet: before a timing, wait (at most S s each, --wait-budget in all) for other processes to stop."""

    def __init__(self, per_wait: float, budget: float, log: Callable[[str], None]):
        self.per_wait, self.budget_left, self.log = per_wait, budget, log
        self.waited = 0.0

    def __call__(self) -> None:
        if self.per_wait <= 0 or self.budget_left <= 0:
            return
        with Meter() as m:   # a quick look first: blc.wait_quiet always samples 3 s
            time.sleep(0.5)
        if m.others is None or m.others < NOISY:
            return
        t0 = time.monotonic()
        wait_quiet(min(self.per_wait, self.budget_left), self.log)
        dt = time.monotonic() - t0
        self.budget_left -= dt
        self.waited += dt


def time_row(row: TopkRow, stmts: dict, args, quiet: Quiet, log) -> None:
    """Time the row's statements (again, up to --retry-noisy times, while others shared the CPUs)."""
    best = None
    for t in range(args.retry_noisy + 1):
        quiet()
        with Meter() as m:
            res = measure_interleaved(stmts, args.threads, args.rounds, args.min_run_time)
        row.tries.append(m.others)
        if best is None or (m.others or 0) < (best[1] or 0):
            best = (res, m.others)
        if (m.others or 0) <= NOISY or t == args.retry_noisy:
            break
        log(f"    {row.family} {row.shape} k={row.k} {row.pass_}: other processes took {m.others:.2f} cores: "
            "timing it again (--retry-noisy)")
    (row.ms, row.iqr_ms, row.min_ms), row.others = best


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def peak_mb(call: Callable, device: str) -> float:
    """Peak memory of one call above the memory in use just before it (least of 3 calls), MB."""
    out = []
    for _ in range(3):
        if device == "cuda":
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            r = call()
            torch.cuda.synchronize()
            out.append((torch.cuda.max_memory_allocated() - base) / MB)
        else:
            with StepPeak() as p:
                r = call()
            out.append(p.peak / MB)
        del r
    return min(out)


def bench_case(device: str, case: Case, backends: list[str], args, quiet: Quiet, log) -> list[TopkRow]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(case.rows, case.cols, generator=gen).to(device, case.dtype)
    fn = make_fn(case)
    probs = eager_probs(case, x)
    rows: list[TopkRow] = []
    torch._dynamo.reset()
    compiled = {b: compile_for(b, fn) for b in backends}
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
        for b in backends:
            n0 = n_reports()
            t0 = time.perf_counter()
            if train:
                v, i = compiled[b](xg)
                got = (torch.autograd.grad(v, xg, g)[0], i)
            else:
                with torch.no_grad():
                    got = compiled[b](x)
            _sync(device)
            row.compile_s[b] = time.perf_counter() - t0
            if b.startswith("smx"):
                row.action[b] = describe_sites(sites_since(n0)[0])
            if b == "eager":
                continue
            ok = True
            if case.family == "argmax":
                ok, nd = _indices_ok(got, ref, probs)
                row.max_err[b] = 0.0
            else:
                err, ok_v = _rel_err(got[0], ref[0], gscale)
                ok_i, nd = _indices_ok(got[1], ref[1], probs)
                row.max_err[b] = err
                ok = ok_v and ok_i
            if nd:
                row.index_diffs[b] = nd
            if not ok:
                row.mismatch.append(b)
        if train:
            stmts = {b: ("torch.autograd.grad(f(x)[0], x, g)", {"f": compiled[b], "x": xg, "g": g, "torch": torch})
                     for b in backends}
            time_row(row, stmts, args, quiet, log)
        else:
            stmts = {b: ("f(x)", {"f": compiled[b], "x": x}) for b in backends}
            with torch.no_grad():
                time_row(row, stmts, args, quiet, log)
                if case.family == "vocab" and args.memory:
                    for b in backends:
                        row.peak_mb[b] = peak_mb(lambda f=compiled[b]: f(x), device)
        rows.append(row)
    torch._dynamo.reset()
    return rows


# --------------------------------------------------------------------------- the Mixtral MoE block


def build_moe(experts: int, top_k: int, device: str):
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    cfg = MixtralConfig(hidden_size=256, intermediate_size=512, num_local_experts=experts,
                        num_experts_per_tok=top_k, router_jitter_noise=0.0)
    # what PreTrainedModel picks by default (a standalone block would otherwise warn and use the loop)
    cfg._experts_implementation = "grouped_mm"
    torch.manual_seed(0)
    blk = MixtralSparseMoeBlock(cfg)
    with torch.no_grad():
        for p in blk.parameters():
            p.normal_(0.0, 0.05)
    return blk.to(device), cfg._experts_implementation


def bench_moe(device: str, case: Case, backends: list[str], args, quiet: Quiet, log) -> list[TopkRow]:
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

    compiled = {b: compile_for(b, block) for b in backends}
    for pass_ in case.passes:
        train = pass_ == "fwd+bwd"
        blk.train(train)
        row = TopkRow(device, f"{case.rows}tok x {case.cols}exp", f"top-{case.k} ({impl})", pass_,
                      family="moe", k=case.k)
        xg = x.clone().requires_grad_(True)
        if train:
            ref = torch.autograd.grad(blk(xg), [xg, *params], g)
        else:
            with torch.no_grad():
                ref = (blk(x),)
        for b in backends:
            n0 = n_reports()
            t0 = time.perf_counter()
            if train:
                got = torch.autograd.grad(compiled[b](xg), [xg, *params], g)
            else:
                with torch.no_grad():
                    got = (compiled[b](x),)
            _sync(device)
            row.compile_s[b] = time.perf_counter() - t0
            if b.startswith("smx"):
                sites, graphs = sites_since(n0)
                row.action[b] = count_sites(sites, graphs)
                row.graphs[b] = graphs
            if b == "eager":
                continue
            errs = [_rel_err(a, r) for a, r in zip(got, ref)]
            row.max_err[b] = max(e for e, _ in errs)
            if not all(ok for _, ok in errs):
                row.mismatch.append(b)
        if train:
            stmts = {b: ("torch.autograd.grad(f(x), ps, g)", {"f": compiled[b], "x": xg, "ps": [xg, *params],
                                                               "g": g, "torch": torch}) for b in backends}
            time_row(row, stmts, args, quiet, log)
        else:
            stmts = {b: ("f(x)", {"f": compiled[b], "x": x}) for b in backends}
            with torch.no_grad():
                time_row(row, stmts, args, quiet, log)
        rows.append(row)
    torch._dynamo.reset()
    return rows


# --------------------------------------------------------------------------- output

TITLES = {
    "router": "router: v, i = topk(softmax(logits.float(), -1), k); v = v / v.sum(-1, keepdim=True)",
    "vocab": "vocab: topk(softmax(logits / 0.7, -1), k)",
    "argmax": "argmax: argmax(softmax(x, -1), -1)",
    "top1": "top1: p = softmax(x, -1); max(p, -1).values[:, None], argmax(p, -1)",
    "entries": "entries: k=2 NLLB-MoE's top-2 gates (p * one_hot(i)).sum(-1); k=1 softmax(x).gather(-1, x.argmin)",
    "moe": "MixtralSparseMoeBlock (hidden 256, intermediate 512), 2048 tokens",
}


def table_rows(rows: list[TopkRow], backends: list[str]) -> tuple[list[str], list[list[str]]]:
    head = ["case", "pass"] + [f"{b} ms" + ("" if b == "inductor" else " (/ind)") for b in backends]
    head += ["others", "smx did"]
    out = []
    for r in rows:
        acts = [f"{b}: {r.action[b]}" for b in ("smx", "smx-rewrite") if b in r.action]
        if len(acts) == 2 and r.action.get("smx") == r.action.get("smx-rewrite"):
            acts = [f"both: {r.action['smx']}"]
        case = f"{r.shape} {r.case}"
        oth = "-" if r.others is None else f"{r.others:.2f}" + (" *" if r.others > NOISY else "")
        out.append([case, r.pass_] + [_fmt_ms(r, b) for b in backends] + [oth, "; ".join(acts)])
    return head, out


def memory_rows(rows: list[TopkRow], backends: list[str]) -> tuple[list[str], list[list[str]]]:
    head = ["case", "probabilities MB"] + [f"{b} peak MB" for b in backends]
    out = []
    for r in rows:
        if not r.peak_mb:
            continue
        n, c = (int(t) for t in r.shape.split("x"))
        out.append([f"{r.shape} {r.case}", f"{n * c * 4 / MB:.2f}"]
                   + [f"{r.peak_mb[b]:.2f}" if b in r.peak_mb else "-" for b in backends])
    return head, out


def shown(rows: list[TopkRow], stat: str) -> list[TopkRow]:
    """The rows with ``ms`` set to the figure the tables show (--stat)."""
    return [dataclasses.replace(r, ms=dict(r.min_ms)) for r in rows] if stat == "min" else rows


def slower_rows(rows: list[TopkRow]) -> list[str]:
    """Rows where an smx backend is slower than Inductor by the median or by the fastest block."""
    out = []
    for r in rows:
        for b in ("smx", "smx-rewrite"):
            med = r.ratio(b)
            mn = (r.min_ms[b] / r.min_ms["inductor"]) if b in r.min_ms and r.min_ms.get("inductor") else None
            if (med is not None and med > SLOWER) or (mn is not None and mn > SLOWER):
                both = med is not None and mn is not None and med > SLOWER and mn > SLOWER
                noisy = r.others is not None and r.others > NOISY
                out.append(f"{r.device} {r.family} {r.shape} {r.case} {r.pass_}: {b} {med:.2f}x inductor by the "
                           f"median, {mn:.2f}x by the fastest block{'' if both else ' (one of the two only)'}; "
                           f"{r.action.get(b, '?')}" + (f" [noisy: others {r.others:.2f}]" if noisy else ""))
    return out


def plot(rows: list[TopkRow], path: str, title: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        return "--plot: matplotlib is not installed (pip install matplotlib); no plot written"
    rows = [r for r in rows if "inductor" in r.ms]
    if not rows:
        return "--plot: no rows"
    labels = [f"{r.device} {r.family} {r.shape}{'' if r.family == 'argmax' else ' ' + r.case} {r.pass_}" + (" *" if (r.others or 0) > NOISY else "")
              for r in rows]
    series = [b for b in ("smx", "smx-rewrite") if any(b in r.ms for r in rows)]
    fig, ax = plt.subplots(figsize=(10, 0.28 * len(rows) * len(series) + 1.8))
    h = 0.8 / len(series)
    colors = {"smx": "tab:blue", "smx-rewrite": "tab:orange"}
    for si, b in enumerate(series):
        ys = [i + (si - (len(series) - 1) / 2) * h for i in range(len(rows))]
        vals = [r.ratio(b) or float("nan") for r in rows]
        ax.barh(ys, vals, height=h, color=colors.get(b), label=f"{b} / inductor")
        for y, v in zip(ys, vals):
            if v == v:
                ax.text(v, y, f" {v:.2f}", va="center", fontsize=6)
    ax.axvline(1.0, color="black", lw=0.8)
    ax.set_xscale("log")
    ax.set_yticks(range(len(rows)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("time / Inductor's time (log; < 1: faster than Inductor)")
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.tick_params(axis="x", which="minor", labelsize=6)
    ax.grid(axis="x", alpha=0.3, which="both")
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title(textwrap.fill(title, 140), fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


# --------------------------------------------------------------------------- main


def _family_list(s: str) -> list[str]:
    out = [t for t in s.replace(" ", "").split(",") if t]
    bad = [t for t in out if t not in FAMILIES]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown {bad}; choose from {','.join(FAMILIES)}")
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--quick", action="store_true",
                   help="smoke run: router 8192x64 k=2 (fwd, fwd+bwd), vocab 4x131072 k=50, argmax 4x131072; "
                        "one short round each (numbers are rough)")
    p.add_argument("--families", type=_family_list, metavar="LIST",
                   help=f"comma-separated subset of {','.join(FAMILIES)} (default: all; with --quick: the quick cases "
                        "of these families, router,vocab,argmax by default; --quick --families moe: the 8-expert block)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto (default): CPU, and CUDA too when available; or only one of them")
    p.add_argument("--rounds", type=int, help="interleaved timing rounds per row (default 3, quick 1)")
    p.add_argument("--min-run-time", type=float,
                   help="seconds of blocked_autorange per backend per round (default 0.2, quick 0.05)")
    p.add_argument("--threads", type=int, default=_cores(), help="torch threads (default: all cores, %(default)s here)")
    p.add_argument("--no-memory", dest="memory", action="store_false",
                   help="skip the peak-memory measurement of the vocab rows")
    p.add_argument("--wait-quiet", type=float, default=0, metavar="S",
                   help="before timing each row, wait up to S seconds for other processes to use < "
                        f"{NOISY} cores (default 0: no wait); the total wait is capped by --wait-budget")
    p.add_argument("--wait-budget", type=float, default=120, metavar="T",
                   help="seconds of --wait-quiet waiting in the whole run, at most (default %(default)s)")
    p.add_argument("--retry-noisy", type=int, default=0, metavar="K",
                   help=f"time a row again, up to K more times, while other processes used > {NOISY} cores "
                        "during it; the least disturbed try is kept (default 0)")
    p.add_argument("--stat", choices=("median", "min"), default="median",
                   help="figure the tables, ratios and plot show: the median block (default) or the fastest "
                        "block (less sensitive to other processes' load); the JSON has both")
    p.add_argument("--markdown", action="store_true", help="print the tables as Markdown")
    p.add_argument("--json", metavar="PATH", help="write every figure (and the environment) to PATH as JSON "
                                                  "(rewritten after every case)")
    p.add_argument("--plot", metavar="PATH", help="write a bar chart of smx / inductor per row (PNG; matplotlib)")
    return p.parse_args(argv)


def _row_dict(r: TopkRow) -> dict:
    d = dataclasses.asdict(r)
    d["pass"] = d.pop("pass_")
    d["ratio_vs_inductor"] = {b: r.ratio(b) for b in r.ms}
    return d


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import smxcompile  # noqa: F401  (registers backend="smx" when not installed)

    warnings.filterwarnings("ignore", module="transformers")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    # the moe block's inner functions are shared by every backend's copy of the step: room for all of them
    for name in ("cache_size_limit", "recompile_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 64)
    args.rounds = args.rounds or (1 if args.quick else 3)
    args.min_run_time = args.min_run_time or (0.05 if args.quick else 0.2)
    families = args.families or list(QUICK_FAMILIES if args.quick else FAMILIES)
    cases = [c for c in (QUICK_CASES if args.quick else all_cases()) if c.family in families]
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
              "using the CPUs; the `others` column says which rows they disturbed"
              + ("; --threads 1 is much less sensitive to them (no thread waits for a descheduled peer)"
                 if args.threads > 1 else ""), file=sys.stderr)
    print("env: " + ", ".join(f"{k}={v}" for k, v in env.items()))
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
        backends = list(BACKENDS)
        for case in cases:
            try:
                if case.family == "moe":
                    rows = bench_moe(device, case, backends, args, quiet, log)
                else:
                    rows = bench_case(device, case, backends, args, quiet, log)
            except Exception as e:  # keep the finished rows; say what failed
                log(f"{device} {case.label}: FAILED {type(e).__name__}: {e}")
                result.setdefault("errors", []).append(f"{device} {case.label}: {type(e).__name__}: {e}")
                torch._dynamo.reset()
                continue
            all_rows.extend(rows)
            for r in rows:
                oth = "" if r.others is None else f", others {r.others:.2f}"
                log(f"{r.device} {r.family} {r.shape} {r.case} {r.pass_}: "
                    + ", ".join(f"{b} {_fmt_ms(r, b)}" for b in backends)
                    + f"{oth}; smx: {r.action.get('smx', '-')}")
            result["rows"] = [_row_dict(r) for r in all_rows]
            _write_json(args.json, result)

    for device in devices:
        backends = list(BACKENDS)
        where = env["cuda"] if device == "cuda" else env["cpu"]
        for fam in FAMILIES:
            rows = [r for r in all_rows if r.device == device and r.family == fam]
            if not rows:
                continue
            head, body = table_rows(shown(rows, args.stat), backends)
            print_table(f"{TITLES[fam]} -- {device} ({where}, {args.threads} threads)", head, body, args.markdown)
            if fam == "vocab":
                head, body = memory_rows(rows, backends)
                if body:
                    print_table(f"vocab, fwd: peak memory of one call above the memory in use before it (MB) -- "
                                f"{device}", head, body, args.markdown)
    try:
        env["loadavg_at_end"] = [round(v, 2) for v in os.getloadavg()]
    except OSError:
        pass
    noisy = [r for r in all_rows if r.others is not None and r.others > NOISY]
    print(f"\nload average at start {env.get('loadavg_at_start')}, at end {env.get('loadavg_at_end')} "
          f"({env['cores']} cores); {len(noisy)} of {len(all_rows)} rows were timed while other processes used "
          f"> {NOISY} cores (marked *)" + (f"; waited {quiet.waited:.0f} s for quiet" if quiet.waited else ""))
    slow = slower_rows(all_rows)
    print(f"\nslower than Inductor (ratio > {SLOWER}):" + ("" if slow else " none"))
    for s in slow:
        print("  " + s)
    result["slower_than_inductor"] = slow
    if args.plot:
        msg = plot(shown(all_rows, args.stat), args.plot, f"smx / inductor ({args.stat} ms), fp32 -- {command}")
        print(msg or f"wrote {args.plot}")
    _write_json(args.json, result)
    bad = [r for r in all_rows if r.mismatch]
    for r in bad:
        print(f"MISMATCH vs eager: {r.device} {r.family} {r.shape} {r.case} {r.pass_}: {r.mismatch} "
              f"max rel err={r.max_err} differing indices={r.index_diffs}")
    for e in result.get("errors", []):
        print(f"ERROR: {e}")
    print(f"\n$ {command}   ({time.perf_counter() - t_start:.0f} s)")
    if args.json:
        print(f"wrote {args.json}")
    return 1 if bad or result.get("errors") else 0


if __name__ == "__main__":
    sys.exit(main())
