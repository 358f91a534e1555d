#!/usr/bin/env python
"""One training step of the LM-head loss ``F.cross_entropy(F.linear(x, W), y)`` (fp32, CPU) under eager, Inductor,
PyTorch's chunked op, Apple's CCE, smxcompile's op and the smx backend, each in a fresh process: step time, peak
memory above the inputs, loss and gradients against eager's. Variants, metrics, caveats: benchmarks/README.md.

  python benchmarks/bench_linear_ce.py [--quick] [--vocab 32000,128256] [--variants ...] [--json P] [--plot P]
"""

from __future__ import annotations

import argparse
import importlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import common
import workers
from common import GB, fmt_num
from workers import Unavailable, say

VARIANTS = ("eager", "inductor", "native", "cce", "smx-op", "smx")
#: variants whose step holds the whole N x V logits (at least once)
FULL_LOGITS = ("eager", "inductor", "cce")
IGNORE_INDEX = -100
QUICK = {"tokens": 1024, "dim": 256, "vocab": [8192], "rounds": 1}
DEFAULTS = {"tokens": 8192, "dim": 1024, "vocab": [32000, 128256], "rounds": 2}


def make_inputs(n: int, d: int, v: int, seed: int, ignore_frac: float):
    """x ~ N(0, 1), W ~ N(0, 1/D) (logits of unit variance), y uniform with ``ignore_frac`` set to -100."""
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    w = torch.randn(v, d, generator=g) * d ** -0.5
    y = torch.randint(0, v, (n,), generator=g)
    drop = torch.rand(n, generator=g) < ignore_frac
    drop[0] = False  # at least one valid token
    y[drop] = IGNORE_INDEX
    return x.requires_grad_(True), w.requires_grad_(True), y


def loss_fn(x, w, y):
    import torch.nn.functional as F

    return F.cross_entropy(F.linear(x, w), y, ignore_index=IGNORE_INDEX)


def build_cce(notes: list[str]):
    """Apple's cut-cross-entropy through its only CPU path, impl="torch_compile" (its Triton kernels are tried on a
    tiny input and why they cannot run is noted)."""
    import torch

    try:
        import cut_cross_entropy
        from cut_cross_entropy import linear_cross_entropy as cce_lce
    except Exception as e:  # ImportError, or triton failing to import
        raise Unavailable(f"cut_cross_entropy not importable ({type(e).__name__}: {e}); install it with "
                          "`pip install --no-deps cut-cross-entropy` (--no-deps keeps your torch)") from e
    notes.append(f"cut-cross-entropy {cut_cross_entropy.__version__}, impl='torch_compile' (its CPU path)")
    try:
        e, c = torch.randn(8, 16, requires_grad=True), torch.randn(32, 16, requires_grad=True)
        cce_lce(e, c, torch.randint(0, 32, (8,)), impl="cce").backward()
        notes.append("impl='cce' (Triton) ran on CPU?!")
    except Exception as ex:  # noqa: BLE001
        notes.append(f"impl='cce' (Triton kernels) cannot run on CPU: {type(ex).__name__}: {str(ex)[:120]}")
    return lambda x, w, y: cce_lce(x, w, y, ignore_index=IGNORE_INDEX, impl="torch_compile")


def build_variant(name: str, spec: dict, notes: list[str]):
    """-> callable(x, W, y) -> scalar loss, for variant ``name``."""
    import torch
    import torch.nn.functional as F

    if name == "native":
        opts = torch.nn.LinearCrossEntropyOptions()
        return lambda x, w, y: F.linear_cross_entropy(x, w, y, ignore_index=IGNORE_INDEX, options=opts)
    if name == "cce":
        return build_cce(notes)
    if name == "smx-op":
        import smxcompile

        return lambda x, w, y: smxcompile.linear_cross_entropy(x, w, y, ignore_index=IGNORE_INDEX,
                                                               chunk_bytes=spec.get("chunk_bytes"))
    if name == "inductor":
        return torch.compile(loss_fn)
    if name == "smx":
        importlib.import_module("smxcompile")  # registers backend="smx"
        return torch.compile(loss_fn, backend="smx")
    return loss_fn


def reference_chunked(x, w, y, rows: int):
    """Eager's math by row chunks (when the eager variant itself did not run): loss, dx, dW."""
    import torch
    import torch.nn.functional as F

    n_valid, dx, total = (y != IGNORE_INDEX).sum(), torch.zeros_like(x), torch.zeros((), dtype=x.dtype)
    w.grad = None
    for r0 in range(0, x.shape[0], rows):
        xc = x[r0:r0 + rows].detach().requires_grad_(True)
        lc = F.cross_entropy(F.linear(xc, w), y[r0:r0 + rows], ignore_index=IGNORE_INDEX, reduction="sum") / n_valid
        lc.backward()
        dx[r0:r0 + rows] = xc.grad
        total += lc.detach()
    dw, w.grad = w.grad, None
    return total, dx, dw


def check_against_eager(spec: dict, loss, gx, gw) -> tuple[bool, dict]:
    """Loss and gradients against eager's saved ones (the eager variant saves them)."""
    import torch

    chk: dict[str, Any] = {}
    if gx is None or gw is None:
        return False, {"why": "no gradient for " + " and ".join(k for k, g in (("x", gx), ("W", gw)) if g is None)}
    chk["dx_max"], chk["dw_max"] = float(gx.abs().max()), float(gw.abs().max())
    if not (torch.isfinite(gx).all() and torch.isfinite(gw).all() and chk["dx_max"] > 0 and chk["dw_max"] > 0
            and torch.isfinite(loss)):
        return False, dict(chk, why="gradient not finite or all zero")
    if spec["variant"] == "eager" and spec.get("save_ref"):
        torch.save({"loss": loss, "dx": gx, "dw": gw, "by": "eager"}, spec["ref"])
        return True, dict(chk, loss_rel=0.0, dx_rel=0.0, dw_rel=0.0, dx_abs=0.0, dw_abs=0.0,
                          against="itself (reference)")
    if not os.path.exists(spec["ref"]):
        return False, dict(chk, why="no reference to compare with")
    ref = torch.load(spec["ref"], mmap=True, weights_only=True)
    rl = float(ref["loss"])
    chk.update(against=ref.get("by", "eager"), loss_abs=abs(float(loss) - rl))
    chk["loss_rel"] = chk["loss_abs"] / max(abs(rl), 1e-30)
    for k, g in (("dx", gx), ("dw", gw)):
        chk[f"{k}_abs"] = float((g - ref[k]).abs().max())
        chk[f"{k}_rel"] = chk[f"{k}_abs"] / max(float(ref[k].abs().max()), 1e-30)
    ok = chk["loss_rel"] <= spec["loss_rtol"] and max(chk["dx_rel"], chk["dw_rel"]) <= spec["grad_rtol"]
    if not ok:
        chk["why"] = (f"outside tolerance (loss rel {chk['loss_rel']:.1e} vs {spec['loss_rtol']:.0e}, "
                      f"grad rel {max(chk['dx_rel'], chk['dw_rel']):.1e} vs {spec['grad_rtol']:.0e})")
    return ok, chk


def work(spec: dict, out: dict) -> None:
    """A worker: one variant's warm-up and timed steps, its memory and its check."""
    import torch

    torch.set_num_threads(spec["threads"])
    n, d, v = spec["tokens"], spec["dim"], spec["vocab"]
    x, w, y = make_inputs(n, d, v, spec["seed"], spec["ignore_frac"])
    out.update(inputs_bytes=(n * d + v * d) * 4 + n * 8, grads_bytes=(n * d + v * d) * 4,
               valid_tokens=int((y != IGNORE_INDEX).sum()),
               malloc_mmap_threshold=os.environ.get("MALLOC_MMAP_THRESHOLD_"), smxcompile_src=common.source_hash())
    if spec["variant"] == "reference":
        rows = max(1, int(256e6 // (v * 4)))
        say(f"reference (eager by chunks of {rows} rows) ...")
        loss, dx, dw = reference_chunked(x, w, y, rows)
        torch.save({"loss": loss, "dx": dx, "dw": dw, "by": "eager by row chunks"}, spec["ref"])
        out.update(status="ok", loss=float(loss))
        return
    fn = build_variant(spec["variant"], spec, out["notes"])
    for note in out["notes"]:
        say(note)

    def step():
        loss = fn(x, w, y)
        loss.backward()
        return loss.detach()

    def reset():
        x.grad = w.grad = None

    say("warm-up step (includes compilation) ...")
    loss = workers.timed_steps(step, spec["rounds"], out, reset,
                               lambda dt, peak: f"{dt:.3f} s, peak {peak / GB:.3f} GB")
    out["max_rss_bytes"] = common.rss_bytes("VmRSS")
    if spec["variant"] == "smx":
        out["smx_report"] = rep = common.smx_report_summary()
        say(f"smx report over {rep['graphs']} graph(s): {rep['sites'] or 'no site'}; "
            f"last_report(): {rep['last_report']}")
    out["loss"] = float(loss)
    ok, out["check"] = check_against_eager(spec, loss, x.grad, w.grad)
    out["status"] = "ok" if ok else "FAILED"
    chk = out["check"]
    say(f"check vs {chk.get('against')}: loss rel {chk['loss_rel']:.1e}, dx rel {chk['dx_rel']:.1e}, dW rel "
        f"{chk['dw_rel']:.1e} -> {out['status']}" if "loss_rel" in chk else f"check: {out['status']} "
        f"({chk.get('why', '')})")


def estimate_bytes(variant: str, n: int, d: int, v: int, chunk_bytes: int | None) -> int:
    """Rough peak RSS of a worker (overhead + inputs + the step + the reference gradients), to skip what cannot
    fit; the step's figures calibrated on this benchmark at V=32000 and 128256, generously."""
    logits, grads = n * v * 4, (n * d + v * d) * 4
    step = {"eager": 3.2 * logits, "inductor": 1.5 * logits, "cce": 1.5 * logits, "smx": 1.5 * logits,
            "native": min(logits, 0.4 * GB + 0.1 * logits), "smx-op": 3 * (chunk_bytes or 32 * 2**20) + 0.1 * GB,
            "reference": 3 * 256e6}[variant]
    return int(1.5 * GB + grads + n * 8 + grads + step + grads)


def summarize(res: dict) -> dict:
    """Median step and CPU time, peak and transient (peak minus the gradients) GB."""
    s: dict[str, Any] = {}
    if res.get("step_s"):
        s["step_s"] = statistics.median(res["step_s"])
    if res.get("step_cpu_s"):
        s["cpu_s"] = statistics.median(res["step_cpu_s"])
    if res.get("peak_bytes"):
        s["peak_gb"] = max(res["peak_bytes"]) / GB
        s["transient_gb"] = (max(res["peak_bytes"]) - res["grads_bytes"]) / GB
    return s


def table(results: list[dict], vocabs: list[int]) -> tuple[list[str], list[list[str]]]:
    head = ["V", "variant", "step s (/ind)", "cpu s", "warm-up s", "peak GB (/ind)", "transient GB (/ind)",
            "loss", "rel dloss", "rel dx", "rel dW", "check", "others", "smx report / note"]
    rows = []
    for v in vocabs:
        rs = [r for r in results if r["vocab"] == v and r["variant"] != "reference"]
        ind = next((summarize(r) for r in rs if r["variant"] == "inductor" and r.get("status") == "ok"), {})
        for r in rs:
            s, st, chk = summarize(r), r.get("status", "?"), r.get("check", {})

            def rat(key: str) -> str:
                if key not in s:
                    return "-"
                return fmt_num(s[key]) + (f" ({s[key] / ind[key]:.2f}x)" if r["variant"] != "inductor"
                                          and ind.get(key) else "")

            note = ""
            if r["variant"] == "smx" and r.get("smx_report") is not None:
                note = common.sites_text(r["smx_report"]) + f" ({r['smx_report']['graphs']} graph(s))"
            elif r["variant"] == "cce" and st == "ok":
                note = "impl=torch_compile (Triton impl: no CPU)"
            if st not in ("ok", "FAILED"):
                note = (r.get("error") or "")[:110]
            elif st == "FAILED":
                note = (note + " " + chk.get("why", "")).strip()
            rel = [f"{chk[k]:.1e}" if k in chk else "-" for k in ("loss_rel", "dx_rel", "dw_rel")]
            rows.append([str(v), r["variant"], rat("step_s"), fmt_num(s.get("cpu_s")), fmt_num(r.get("warmup_s"), 1),
                         rat("peak_gb"), rat("transient_gb"), f"{r['loss']:.6f}" if "loss" in r else "-", *rel, st,
                         f"{r['other_load']:.2f}" if r.get("other_load") is not None else "-", note])
    return head, rows


def plot(results: list[dict], vocabs: list[int], variants: list[str], path: str, title: str) -> str | None:
    """Bars of the step time and of the memory (gradients pale, transient solid) per variant, a group per V."""
    plt = common.pyplot()
    if plt is None:
        return "--plot: " + common.NO_MATPLOTLIB
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    width, colors = 0.8 / max(1, len(variants)), plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for vi, v in enumerate(vocabs):
        for ki, name in enumerate(variants):
            r = next((r for r in results if r["vocab"] == v and r["variant"] == name), None)
            xpos, c = vi + (ki - (len(variants) - 1) / 2) * width, colors[ki % len(colors)]
            s = summarize(r) if r else {}
            hatch = "xx" if r and r.get("status") == "FAILED" else None
            if "step_s" in s:
                axes[0].bar(xpos, s["step_s"], width, color=c, label=name if vi == 0 else None, hatch=hatch)
                axes[0].text(xpos, s["step_s"], f"{s['step_s']:.3g}", ha="center", va="bottom", fontsize=7)
            if "peak_gb" in s:
                g = r["grads_bytes"] / GB
                axes[1].bar(xpos, g, width, color=c, alpha=0.35)
                axes[1].bar(xpos, s["transient_gb"], width, bottom=g, color=c, hatch=hatch)
                axes[1].text(xpos, s["peak_gb"], f"{s['peak_gb']:.3g}", ha="center", va="bottom", fontsize=7)
            if not s:
                for ax in axes:
                    ax.text(xpos, 0, (r or {}).get("status", "not run"), rotation=90, ha="center", va="bottom",
                            fontsize=7)
    for ax, yl in zip(axes, ("seconds per step (fwd + bwd), median", "GB above inputs (pale: x.grad + W.grad)")):
        ax.set_xticks(range(len(vocabs)), [f"V={v}" for v in vocabs])
        ax.set_ylabel(yl)
        ax.grid(axis="y", alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8, frameon=False)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=120)
    return None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=common.int_list, help="comma-separated vocabulary sizes V (default 32000,128256)")
    p.add_argument("--tokens", type=int, help="N, tokens per step (default 8192)")
    p.add_argument("--dim", type=int, help="D, hidden size (default 1024)")
    p.add_argument("--variants", type=common.choice_list(VARIANTS), default=list(VARIANTS),
                   help=f"comma-separated subset of {','.join(VARIANTS)} (default: all; eager always runs first)")
    p.add_argument("--rounds", type=int, help="timed steps per variant after the warm-up; median reported (default 2)")
    p.add_argument("--quick", action="store_true",
                   help=f"smoke run: N={QUICK['tokens']}, D={QUICK['dim']}, V={QUICK['vocab'][0]}, 1 round (< 1 min)")
    p.add_argument("--ignore-frac", type=float, default=0.1,
                   help="fraction of tokens with target -100 (ignore_index) (default %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=common.cores(), help="torch threads (default: all cores, "
                                                                       "%(default)s here)")
    p.add_argument("--chunk-bytes", type=int, help="smx-op's chunk_bytes (default: the op's, 32 MiB)")
    p.add_argument("--loss-rtol", type=float, default=1e-4, help="max |loss - eager| / |eager| (default %(default)s)")
    p.add_argument("--grad-rtol", type=float, default=1e-4,
                   help="max |grad - eager| / max |eager grad|, for x.grad and W.grad (default %(default)s)")
    p.add_argument("--skip-oom-risk", action="store_true",
                   help=f"skip the variants that materialize the whole N x V logits ({', '.join(FULL_LOGITS)}) "
                        "whenever those logits exceed 1 GB (the reference is then eager by row chunks)")
    workers.worker_flags(p, timeout=3600)
    common.add_noise_flags(p, budget=False)
    p.add_argument("--json", metavar="PATH", help="write every figure, the environment and the command to PATH")
    p.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    p.add_argument("--plot", metavar="PATH", help="write a bar chart (PNG/SVG/PDF by extension; needs matplotlib)")
    args = p.parse_args(argv)
    for k, val in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, k) is None:
            setattr(args, k, val)
    return args


def skip_reason(name: str, est: int, logits_gb: float, limit: int | None, args) -> str | None:
    avail = workers.mem_available()
    if args.skip_oom_risk and name in FULL_LOGITS and logits_gb > 1:
        return f"skipped (--skip-oom-risk): materializes the {logits_gb:.1f} GB N x V logits"
    if limit is not None and est > limit:
        return f"skipped: estimated {est / GB:.1f} GB RSS > limit {limit / GB:.1f} GB"
    if avail is not None and est > avail - 1 * GB:
        return f"skipped: estimated {est / GB:.1f} GB RSS > {avail / GB:.1f} GB available now - 1 GB"
    return None


def run_all(args, variants: list[str], limit: int | None, result: dict, log) -> None:
    """Every (V, variant) in a fresh process (a reference first when eager's result is missing); the JSON rewritten
    after each."""
    results, workdir, n, d = result["results"], tempfile.mkdtemp(prefix="bench_linear_ce_"), args.tokens, args.dim
    base = {"tokens": n, "dim": d, "threads": args.threads, "seed": args.seed, "ignore_frac": args.ignore_frac,
            "rounds": args.rounds, "chunk_bytes": args.chunk_bytes, "loss_rtol": args.loss_rtol,
            "grad_rtol": args.grad_rtol, "mmap_threshold": args.mmap_threshold}

    def launch(spec, label):
        return workers.launch(spec, workdir, limit, args.variant_timeout, log, __file__, label)

    try:
        for v in args.vocab:
            ref_path = os.path.join(workdir, f"ref-{v}.pt")
            for name in variants:
                if name != "eager" and not os.path.exists(ref_path):
                    log(f"[V={v}] reference: eager by row chunks (no eager result to compare with)")
                    ref = launch(dict(base, variant="reference", vocab=v, ref=ref_path), f"V={v} reference")
                    if ref.get("status") != "ok":
                        log(f"[V={v}] reference failed: {ref.get('error')}")
                    results.append(ref)
                spec = dict(base, variant=name, vocab=v, ref=ref_path, save_ref=(name == "eager"))
                est = estimate_bytes(name, n, d, v, args.chunk_bytes)
                skip = skip_reason(name, est, n * v * 4 / GB, limit, args)
                if skip:
                    log(f"[V={v}] {name}: {skip}")
                    res = {"variant": name, "vocab": v, "status": "skipped", "error": skip}
                else:
                    def once():
                        log(f"[V={v}] {name}: fresh process (estimated peak RSS {est / GB:.1f} GB)")
                        r = launch(spec, f"V={v} {name}")
                        s = summarize(r)
                        log(f"[V={v}] {name}: {r.get('status')}" + (
                            f", step {s['step_s']:.3f} s, peak {s['peak_gb']:.3f} GB, transient "
                            f"{s['transient_gb']:.3f} GB" if s else f" ({r.get('error', '')})")
                            + (f"; other processes used {r['other_load']:.2f} cores meanwhile"
                               if r.get("other_load") is not None else ""))
                        return r

                    res = workers.least_disturbed(once, args.retry_noisy, args.wait_quiet, log, f"V={v} {name}")
                    if (res.get("other_load") or 0) > common.NOISY:
                        log(f"WARNING: V={v} {name} shared the CPUs with other processes ({res['other_load']:.2f} "
                            "cores): its time is inflated")
                res["estimated_rss_bytes"] = est
                res.update({f"summary_{k}": val for k, val in summarize(res).items()})
                results.append(res)
                common.write_json(args.json, result)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args._worker:
        return workers.run_worker(args._worker, work, ("variant", "vocab"))
    command = common.command_line()
    env = common.environment(args.threads, packages=("cut-cross-entropy",), git=True)
    env.update(mem_total_gb=round((workers.meminfo("MemTotal") or 0) / GB, 1),
               mem_available_gb=round((workers.mem_available() or 0) / GB, 1))
    common.print_header(command, env, "the `others` column says, per variant, whether they shared the CPUs with it")
    n, d = args.tokens, args.dim
    variants = ["eager"] + [v for v in args.variants if v != "eager"] if "eager" in args.variants else args.variants
    limit = workers.mem_limit(args.mem_limit)
    print(f"step: loss = F.cross_entropy(F.linear(x, W), y), x ({n}, {d}) and W (V, {d}) requiring grad, fp32, "
          f"{args.ignore_frac:.0%} of targets = -100; V in {args.vocab}; variants {variants}; 1 warm-up + "
          f"{args.rounds} timed step(s) each, one fresh process per variant; memory limit "
          f"{(limit or 0) / GB:.1f} GB", flush=True)
    mmap = os.environ.get("MALLOC_MMAP_THRESHOLD_") or (args.mmap_threshold or "glibc default (dynamic)")
    result: dict[str, Any] = {"command": command, "env": env, "results": [], "settings": {
        "tokens": n, "dim": d, "vocab": args.vocab, "variants": variants, "rounds": args.rounds,
        "ignore_frac": args.ignore_frac, "seed": args.seed, "loss_rtol": args.loss_rtol, "grad_rtol": args.grad_rtol,
        "chunk_bytes": args.chunk_bytes, "mem_limit_bytes": limit, "malloc_mmap_threshold": mmap}}
    t_start = time.monotonic()
    run_all(args, variants, limit, result, lambda msg: print(f"[{time.monotonic() - t_start:7.1f}s] {msg}", flush=True))
    results = result["results"]
    for v in args.vocab:  # ratios to inductor, into the JSON
        ind = next((summarize(r) for r in results if r["vocab"] == v and r["variant"] == "inductor"
                    and r.get("status") == "ok"), None)
        for r in (r for r in results if r["vocab"] == v and ind):
            r["ratio_vs_inductor"] = {k: val / ind[k] for k, val in summarize(r).items() if ind.get(k)}
    title = (f"linear + cross-entropy, fwd+bwd, N={n}, D={d}, fp32, CPU ({env['cpu']}, {args.threads} threads); "
             f"median of {args.rounds} step(s); GB = 1e9 B above inputs; (/ind) = ratio to inductor")
    common.print_table(title, *table(results, args.vocab), args.markdown, left=("variant", "check",
                                                                               "smx report / note"))
    for nt in sorted({f"{r['variant']}: {nt}" for r in results for nt in r.get("notes", [])}):
        print(f"note: {nt}")
    for r in results:
        if r["variant"] == "smx" and r.get("smx_report"):
            print(f"smx report V={r['vocab']}: {r['smx_report']['graphs']} graph(s), sites per kind "
                  f"{r['smx_report']['sites'] or '{}'}; last_report().summary() = {r['smx_report']['last_report']}")
    workers.print_sources(results, ("smx", "smx-op"), lambda r: f"V={r['vocab']} {r['variant']}")
    mm = next((r.get("mem_method") for r in results if r.get("mem_method")), None)
    if mm:
        print(f"memory: {mm}, MALLOC_MMAP_THRESHOLD_={mmap}; peak = max over rounds of (VmHWM during the step - "
              "VmRSS just before it); transient = peak - (N*D + V*D)*4 gradient bytes")
    if args.plot:
        print(plot(results, args.vocab, variants, args.plot, f"{command}\n{title}") or f"wrote {args.plot}")
    return workers.finish_run(env, result, args.json, command, t_start, lambda r: f"V={r['vocab']} {r['variant']}")


if __name__ == "__main__":
    sys.exit(main())
