"""Held-out perplexity of `smx demo` GPT-2 checkpoints whose attention softmax is quantized by
``smxcompile.quantize_softmax``, with and without the bias correction.

What is measured: per checkpoint, bit width and setting (none, offset/head, offset/tensor, offset/position,
scale/head, scale/tensor), the held-out perplexity vs fp32 and vs none (95% paired-bootstrap intervals), KL to fp32,
mean |row sum - 1| and zero fraction; a verdict on the goals (8-bit within 1% of fp32; a correction beats none).
A failed sanity check exits with status 2. Method and results: docs/PERFORMANCE.md.
"""

import argparse
import math
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

import common
from common import SanityError
import smxcompile
from smx_app import lm
from smx_app.argtypes import nonneg_int, positive_int

EPILOG = """\
examples:
  python benchmarks/eval_quant_softmax.py --checkpoint /tmp/ckpt/seed0/checkpoint \\
      --checkpoint /tmp/ckpt/seed1/checkpoint --markdown \\
      --json docs/bench_quant_softmax.json --plot docs/quant_softmax.png        # docs/PERFORMANCE.md's figures

checkpoint: a demo --out folder or its checkpoint/ subfolder. --train-if-missing trains a missing one with `smx demo
--small --backends eager --seed S --out DIR` (--quick: `--quick`), S from a 'seed<N>' in the path, else its position.
"""

#: setting name -> quantize_softmax's (correction, granularity)
SETTINGS = {"none": (False, "tensor"), "offset/head": ("offset", "head"), "offset/tensor": ("offset", "tensor"),
            "offset/position": ("offset", "position"), "scale/head": ("scale", "head"),
            "scale/tensor": ("scale", "tensor")}
HEAD = ["checkpoint", "bits", "setting", "perplexity", "Δ vs fp32 (%) [95% CI]", "Δ vs none (%) [95% CI]",
        "KL to fp32 (nats/token)", "mean abs(row sum − 1)", "zero fraction"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="eval_quant_softmax.py", description=__doc__.split("\n", 3)[3], epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", action="append", type=Path, required=True, metavar="DIR",
                   help="an `smx demo` checkpoint (repeatable; --quick uses the first only)")
    p.add_argument("--bits", type=common.int_list, metavar="LIST", help="bit widths (default: 8,6,4; --quick: 8,4)")
    p.add_argument("--calib-batches", type=positive_int, metavar="N", help="calibration batches (default 8, quick 2)")
    p.add_argument("--eval-batches", type=nonneg_int, metavar="N", help="held-out batches, 0: all (default 0, quick 2)")
    p.add_argument("--stats-batches", type=nonneg_int, default=4, metavar="N",
                   help="held-out batches of the KL and attention statistics, 0 = all (default: 4)")
    p.add_argument("--batch-size", type=positive_int, default=8, metavar="B", help="windows per batch (default: 8)")
    p.add_argument("--quick", action="store_true", help="smoke run: first checkpoint, 2 + 2 batches, bits 8,4")
    p.add_argument("--train-if-missing", action="store_true", help="train a missing checkpoint with `smx demo` first")
    p.add_argument("--markdown", action="store_true", help="print the results as a Markdown table")
    p.add_argument("--json", type=Path, metavar="FILE", help="write every figure and the environment as JSON")
    p.add_argument("--plot", type=Path, metavar="FILE", help="write a plot (matplotlib, PNG)")
    return p


def find_checkpoint(path: Path, index: int, args: argparse.Namespace) -> Path:
    """The checkpoint folder of ``--checkpoint path``, trained first by `smx demo` with --train-if-missing."""
    try:
        return lm.checkpoint_dir(path)
    except FileNotFoundError:
        if not args.train_if_missing:
            raise SystemExit(f"no checkpoint at {path}: pass --train-if-missing to train it with `smx demo`") from None
    out = path.parent if path.name == "checkpoint" else path
    seed = re.search(r"seed(\d+)", str(path))
    cmd = [sys.executable, "-m", "smx_app.cli", "demo", "--quick" if args.quick else "--small", "--backends", "eager",
           "--seed", seed.group(1) if seed else str(index), "--out", str(out)]
    print(f"training missing checkpoint: {shlex.join(cmd)}", flush=True)
    if subprocess.run(cmd).returncode not in (0, 1):  # 1 = a backend disagreed; with eager alone it does not happen
        raise SystemExit(f"`smx demo` failed and left no checkpoint in {out}")
    return lm.checkpoint_dir(out)


def window_nll(model, batches: list) -> Any:
    """Per window, the summed next-token NLL in fp64: a ``(windows,)`` tensor."""
    out = []
    with torch.no_grad():
        for b in batches:
            lg = model(input_ids=b).logits[:, :-1].double()
            nll = F.cross_entropy(lg.reshape(-1, lg.shape[-1]), b[:, 1:].reshape(-1), reduction="none")
            out.append(nll.view(b.shape[0], -1).sum(1))
    return torch.cat(out)


def paired_ci(w, w_ref, tokens_per_window: int, n_boot: int = 2000) -> list[float]:
    """95% paired-bootstrap interval over windows of the perplexity change (%) of per-window NLLs ``w`` vs ``w_ref``."""
    d = (w - w_ref).numpy()
    idx = np.random.default_rng(0).integers(0, d.shape[0], size=(n_boot, d.shape[0]))
    rel = np.expm1(d[idx].sum(1) / (d.shape[0] * tokens_per_window)) * 100.0
    return [float(np.percentile(rel, 2.5)), float(np.percentile(rel, 97.5))]


def quantized_row(model, calib: list, ev: list, stats_ev: list, ref: dict, bits: int, name: str) -> tuple[dict, Any]:
    """One ``quantize_softmax`` call on the fp32 model, evaluated and checked: its row and per-window NLL."""
    tag = f"{ref['label']} {bits}-bit {name}"
    corr, gran = SETTINGS[name]
    t0 = time.perf_counter()
    qm = smxcompile.quantize_softmax(model, calib, bits=bits, correction=corr, granularity=gran, progress=False)
    calib_s, qs = time.perf_counter() - t0, qm.smx_softmax_quant
    kinds = {k: s.kind for k, s in qs.sites.items()}
    if len(kinds) != ref["n_layer"] or set(kinds.values()) != {"attention"}:
        raise SanityError(f"{tag}: expected {ref['n_layer']} attention sites (one per layer), quantize_softmax chose "
                          f"{kinds}; skipped: {qs.skipped}")
    ref["sites"] = list(kinds)
    kl, n, diff = 0.0, 0, None
    with torch.no_grad():
        with qs.collecting():  # the row-sum and zero statistics, over the batches of the KL
            for b, r in zip(stats_ev, ref["lp"]):
                logits = qm(input_ids=b).logits
                diff = float((logits - ref["logits0"]).abs().max()) if diff is None else diff
                r = r.double()
                kl += float((r.exp() * (r - logits.double().log_softmax(-1))).sum())
                n += r.shape[0] * r.shape[1]
        with qs.disabled():
            off = float((qm(input_ids=ev[0]).logits - ref["logits0"]).abs().max())
    stats, w = qs.stats(), window_nll(qm, ev)
    ppl = math.exp(float(w.sum()) / ref["tokens"])
    if not diff > 0 or ppl == ref["ppl"]:
        raise SanityError(f"{tag}: quantized logits equal fp32's (max |diff| {diff:g}): nothing was quantized")
    if off > 1e-5:
        raise SanityError(f"{tag}: the quantized model under .disabled() differs from fp32 by {off:g}")
    if not all(stats.get(k, {}).get("rows") for k in kinds):
        raise SanityError(f"{tag}: a site saw no rows during evaluation: {stats}")
    row = {"checkpoint": ref["label"], "bits": bits, "setting": name, "correction": corr or None,
           "granularity": gran if corr else None, "ppl": ppl, "rel_change_pct": 100.0 * (ppl / ref["ppl"] - 1.0),
           "rel_change_ci95_pct": paired_ci(w, ref["w"], ref["tpw"]), "vs_none_pct": None, "vs_none_ci95_pct": None,
           "kl_to_fp32": kl / n, "max_abs_logit_diff_batch0": diff, "calib_s": calib_s,
           **{k: stats["all"][k] for k in ("mean_abs_rowsum_err", "mean_abs_rowsum_err_uncorrected", "zero_fraction")}}
    return row, w


def evaluate_checkpoint(ck: Path, label: str, args: argparse.Namespace) -> dict[str, Any]:
    """The fp32 baseline, then every (bits, setting) on its own quantized copy: the checkpoint's record and rows."""
    model, data, bs = lm.load_lm(ck), lm.lm_data(ck), args.batch_size
    n_cal = min(args.calib_batches * bs, data.train.shape[0])
    order = torch.randperm(data.train.shape[0], generator=torch.Generator().manual_seed(0))
    calib = [{"input_ids": b, "logits_to_keep": 1} for b in data.train[order[:n_cal]].split(bs)]
    held = data.heldout if args.eval_batches == 0 else data.heldout[:args.eval_batches * bs]
    ev = list(held.split(bs))
    stats_ev = ev if args.stats_batches == 0 else ev[:args.stats_batches]
    n_layer = int(model.config.n_layer)
    with torch.no_grad():
        fp_w = window_nll(model, ev)
        hf = float(model(input_ids=ev[0], labels=ev[0]).loss)
        lp = [model(input_ids=b).logits.float().log_softmax(-1) for b in stats_ev]
        logits0 = model(input_ids=ev[0]).logits
    mine = float(fp_w[:ev[0].shape[0]].sum()) / ev[0][:, 1:].numel()
    if not math.isclose(mine, hf, rel_tol=1e-4):
        raise SanityError(f"{label}: NLL computed here {mine:.6f} != transformers' loss {hf:.6f} on batch 0")
    tokens = held.shape[0] * (data.seq_len - 1)
    ref = {"label": label, "n_layer": n_layer, "w": fp_w, "tpw": data.seq_len - 1, "tokens": tokens,
           "ppl": math.exp(float(fp_w.sum()) / tokens), "lp": lp, "logits0": logits0}
    print(f"{label} ({ck}): {data.corpus}, windows of {data.seq_len} tokens, {held.shape[0]} held-out, {n_cal} "
          f"calibration; fp32 perplexity {ref['ppl']:.3f}", flush=True)
    rows, none_w = [], {}
    for bits in args.bits:
        for name in SETTINGS:
            row, w = quantized_row(model, calib, ev, stats_ev, ref, bits, name)
            if name == "none":
                none_w[bits] = w
            else:
                row["vs_none_pct"] = 100.0 * math.expm1((float(w.sum()) - float(none_w[bits].sum())) / tokens)
                row["vs_none_ci95_pct"] = paired_ci(w, none_w[bits], ref["tpw"])
            rows.append(row)
            print(f"  {bits}-bit {name:15s} ppl {row['ppl']:10.3f} ({row['rel_change_pct']:+8.3f}%)  KL "
                  f"{row['kl_to_fp32']:.3e}  zero {100 * row['zero_fraction']:5.1f}%", flush=True)
    with torch.no_grad():  # quantize_softmax works on a copy: the fp32 model must be untouched
        moved = float((model(input_ids=ev[0]).logits - logits0).abs().max())
    if moved > 1e-6:
        raise SanityError(f"{label}: the fp32 model changed while quantizing copies of it (by {moved:g})")
    return {"label": label, "path": str(ck), "n_layer": n_layer, "seq_len": data.seq_len, "corpus": data.corpus,
            "eval_windows": int(held.shape[0]), "heldout_windows_total": int(data.heldout.shape[0]),
            "eval_tokens": tokens, "calib_windows": n_cal, "sites": ref["sites"],
            "fp32": {"ppl": ref["ppl"], "hf_loss_batch0": hf}, "rows": rows}


def verdict(rows: list[dict[str, Any]], bits: list[int]) -> dict[str, Any]:
    """Per goal, the correction settings that meet it at every bit width on every checkpoint and where each setting
    misses it; then the settings ranked per bit width by their mean perplexity change vs fp32. Printed too."""
    by = {(r["checkpoint"], r["bits"], r["setting"]): r for r in rows}
    labels = list(dict.fromkeys(r["checkpoint"] for r in rows))
    corrected = [n for n in SETTINGS if n != "none"]
    goals = [("goal_correction_beats_none", "goal 2: a correction gives lower perplexity than none", bits, corrected,
              lambda r, o: r["ppl"] < o["ppl"]),
             ("kl_correction_beats_none", "fidelity: a correction gives a lower KL to fp32 than none", bits, corrected,
              lambda r, o: r["kl_to_fp32"] < o["kl_to_fp32"])]
    if 8 in bits:
        goals.insert(0, ("goal_8bit_within_1pct", "goal 1: with a correction, 8-bit perplexity within 1% of fp32",
                         [8], list(SETTINGS), lambda r, o: abs(r["rel_change_pct"]) <= 1.0))
    out: dict[str, Any] = {"ranking_by_bits": {}}
    print("\nverdict:")
    for key, text, at_bits, names, ok in goals:
        missed = {n: [f"{lb}/{b}" for lb in labels for b in at_bits if not ok(by[lb, b, n], by[lb, b, "none"])]
                  for n in names}
        met_by = [n for n in names if n != "none" and not missed[n]]
        print(f"{text}: {'MET' if met_by else 'NOT MET'}")
        for n, at in missed.items():
            print(f"  {n:15s} " + (f"misses at {', '.join(at)}" if at else "meets"))
        out[key] = {"goal": text, "met": bool(met_by), "met_by": met_by, "missed_at": missed}
    print("settings per bit width, best first (mean perplexity change vs fp32 over the checkpoints):")
    for b in bits:
        mean = {n: sum(by[lb, b, n]["rel_change_pct"] for lb in labels) / len(labels) for n in SETTINGS}
        ranked = out["ranking_by_bits"][str(b)] = {n: mean[n] for n in sorted(mean, key=mean.get)}
        print(f"  {b}-bit: " + " < ".join(f"{n} ({x:+.3f}%)" for n, x in ranked.items()))
    return out


def ci(c: list[float] | None) -> str:
    return f" [{c[0]:+.3f}, {c[1]:+.3f}]" if c else ""


def table_rows(results: list[dict[str, Any]]) -> list[list[str]]:
    """The fp32 row of each checkpoint, then one row per bits x setting (brackets: 95% paired-bootstrap intervals)."""
    out = []
    for c in results:
        out.append([c["label"], "fp32", "-", f"{c['fp32']['ppl']:.3f}"] + ["-"] * 5)
        for r in c["rows"]:
            vs = "-" if r["vs_none_pct"] is None else f"{r['vs_none_pct']:+.3f}{ci(r['vs_none_ci95_pct'])}"
            out.append([r["checkpoint"], str(r["bits"]), r["setting"], f"{r['ppl']:.3f}",
                        f"{r['rel_change_pct']:+.3f}{ci(r['rel_change_ci95_pct'])}", vs, f"{r['kl_to_fp32']:.2e}",
                        f"{r['mean_abs_rowsum_err']:.2e}", f"{100 * r['zero_fraction']:.1f}%"])
    return out


def plot(results: list[dict[str, Any]], bits: list[int], path: Path) -> None:
    """Four panels against bits: perplexity change vs fp32, KL to fp32, mean |row sum - 1|, zero fraction; colour:
    setting, line style: checkpoint."""
    plt = common.pyplot()
    if plt is None:
        print(common.NO_MATPLOTLIB)
        return
    panels = (("rel_change_pct", "held-out perplexity vs fp32 (%, symlog)", "symlog"),
              ("kl_to_fp32", "KL(fp32 || quantized), nats per token", "log"),
              ("mean_abs_rowsum_err", "mean |row sum − 1| of the attention probabilities", "log"),
              ("zero_fraction", "fraction of unmasked probabilities quantized to zero", "linear"))
    fig, axes = plt.subplots(1, 4, figsize=(22, 5.5))
    xs = sorted(bits)
    for ax, (key, title, scale) in zip(axes, panels):
        for i, c in enumerate(results):
            by = {(r["bits"], r["setting"]): r[key] for r in c["rows"]}
            for j, name in enumerate(SETTINGS):
                ax.plot(xs, [by[b, name] for b in xs], marker="o", ms=4, ls=("-", "--", ":", "-.")[i % 4],
                        color=f"C{j}", label=f"{name} ({c['label']})")
        ax.set_yscale(scale, **({"linthresh": 0.01} if scale == "symlog" else {}))
        ax.set(title=title, xlabel="bits", xticks=xs)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"smxcompile.quantize_softmax on smx-demo GPT-2 checkpoints: {results[0]['eval_tokens']} held-out "
                 "tokens each")
    print(common.save_figure(fig, path))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    q = args.quick
    args.bits = args.bits or ([8, 4] if q else [8, 6, 4])
    args.calib_batches = args.calib_batches or (2 if q else 8)
    args.eval_batches = (2 if q else 0) if args.eval_batches is None else args.eval_batches
    command = common.command_line(argv, None if argv is None else "benchmarks/eval_quant_softmax.py")
    print(f"command: {command}", flush=True)
    ckpts = [find_checkpoint(p, i, args) for i, p in enumerate(args.checkpoint[:1] if q else args.checkpoint)]
    labels = [ck.resolve().parent.name if ck.name == "checkpoint" else ck.resolve().name for ck in ckpts]
    if len(set(labels)) < len(labels):
        labels = [f"{lb}#{i}" for i, lb in enumerate(labels)]
    env = common.environment(packages=("transformers", "tokenizers"), git=True)
    t0 = time.perf_counter()
    try:
        results = [evaluate_checkpoint(ck, lb, args) for ck, lb in zip(ckpts, labels)]
    except SanityError as e:
        print(f"SANITY CHECK FAILED: {e}")
        return 2
    total_s = time.perf_counter() - t0
    rows = [r for c in results for r in c["rows"]]
    common.print_table("quantized attention softmax: held-out perplexity", HEAD, table_rows(results), args.markdown,
                       left=("checkpoint", "setting"))
    v = verdict(rows, args.bits)
    print(f"total {total_s:.0f} s")
    if args.json:
        env["loadavg_at_end"] = common.loadavg()
        config = {k: val for k, val in vars(args).items() if k not in ("json", "plot", "markdown")}
        common.write_json(args.json, {
            "command": command, "date": env["date_utc"], "environment": env, "config": config,
            "checkpoints": [{k: val for k, val in c.items() if k != "rows"} for c in results], "results": rows,
            "table_markdown": common.markdown_table(HEAD, table_rows(results)), "verdict": v, "total_s": total_s})
        print(f"wrote {args.json}")
    if args.plot:
        plot(results, args.bits, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
