"""Every softmax variant swapped into a pretrained GPT-2: held-out perplexity after the swap, after
calibration and after a short fine-tune, next to the softmax model fine-tuned the same way.

What is measured: per variant of ``smxcompile.variants.names()``, the held-out perplexity after the swap,
calibrated and fine-tuned, also as a ratio to the "softmax (baseline)" row (fine-tuned the same way); attention
entropy, sink mass, row sum and zero fraction. A NaN / infinite loss ends that row as "diverged" (entmax_bisect is the
slowest row). A failed sanity check exits with status 2. The study: docs/VARIANTS.md.
"""

import argparse
import copy
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

import common
from common import SanityError
import smxcompile
from smxcompile import variants
from smxcompile.edit.swap import swapped_sites
from smx_app import lm
from smx_app.argtypes import nonneg_int, positive_float, positive_int

BASELINE = "softmax (baseline)"
STATS = ("entropy", "sink_mass", "rowsum", "zero_fraction")
COLUMNS = ["variant", "learnable", "ppl original", "ppl after swap", "ppl calibrated", "ppl fine-tuned",
           "entropy (nats) swap → ft", "sink mass swap → ft", "row sum (ft)", "zeros (ft)", "wall s"]

EPILOG = """\
examples:
  python benchmarks/eval_variants.py --checkpoint /tmp/ckpt/seed0/checkpoint --markdown \\
      --json docs/bench_variants.json --plot docs/variants.png        # docs/VARIANTS.md's figures (~13 min)
  python benchmarks/eval_variants.py --replot docs/bench_variants.json --plot docs/variants.png

checkpoint: an `smx demo --out DIR` folder or its checkpoint/ folder (`smx demo --backends eager --seed 0 --out DIR`).
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="eval_variants.py", description=__doc__.split("\n", 3)[3], epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, metavar="DIR", help="an `smx demo` checkpoint (required)")
    p.add_argument("--variants", type=common.choice_list(tuple(variants.names())), help="a list (default: all)")
    p.add_argument("--calibrate", type=nonneg_int, default=25, help="steps on the variant's parameters (default: 25)")
    p.add_argument("--finetune", type=nonneg_int, default=50, help="steps on every weight (default: 50)")
    p.add_argument("--batch-size", type=positive_int, default=8, metavar="B", help="windows per batch (default: 8)")
    p.add_argument("--eval-batches", type=nonneg_int, default=8, help="held-out batches, 0: all (default: 8)")
    p.add_argument("--stats-batches", type=positive_int, default=2, help="batches of attention statistics (default: 2)")
    p.add_argument("--lr", type=positive_float, default=lm.FINETUNE_LR, help="fine-tune lr (%(default)g)")
    p.add_argument("--calib-lr", type=positive_float, default=lm.CALIBRATE_LR, help="calibration lr (%(default)g)")
    p.add_argument("--seed", type=int, default=0, help="batch order: calibration SEED, fine-tunes SEED+1 (default: 0)")
    p.add_argument("--threads", type=positive_int, default=1, help="torch.set_num_threads (default: 1)")
    p.add_argument("--markdown", action="store_true", help="print the results as a Markdown table")
    p.add_argument("--json", type=Path, metavar="FILE", help="write every figure and the provenance as JSON")
    p.add_argument("--plot", type=Path, metavar="FILE", help="write a plot (matplotlib, PNG)")
    p.add_argument("--replot", type=Path, metavar="JSON", help="only redraw --plot from an earlier --json file")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


def learned(model) -> dict[str, list[float]]:
    """Per parameter name, its values over every site and head (site by site, head by head)."""
    out: dict[str, list[float]] = {}
    for s in swapped_sites(model).values():
        for k, p in s.params.items():
            out.setdefault(k, []).extend(round(float(x), 6) for x in p.detach().reshape(-1))
    return out


def run_row(name: str, base, data, held, stats_w, args: argparse.Namespace, original: dict[str, Any],
            ref_logits) -> dict[str, Any]:
    """One row on its own copy of ``base``: the variant swapped in (the baseline: softmax kept), measured, calibrated
    if it has learnable parameters, fine-tuned, measured again; a NaN / infinite loss ends it as "diverged"."""
    t0, bs, progress, baseline = time.perf_counter(), args.batch_size, not args.no_progress, name == BASELINE

    def swap(m, variant: str):
        return smxcompile.swap(m, variant, example_inputs={"input_ids": held[:1]}, n_train=data.seq_len)

    def stats(m) -> dict[str, float]:  # the baseline's: the original softmax at the same sites (.disabled())
        s = lm.attention_stats(swap(m, "temperature") if baseline else m, stats_w, batch_size=bs, baseline=baseline)
        return {k: float(s[k]) for k in STATS}

    def measure(stage: str) -> None:
        r = lm.perplexity(model, held, batch_size=bs, progress=progress, desc=f"{name}: perplexity ({stage})")
        row.update({f"ppl_{stage}": r["ppl"], f"loss_{stage}": r["loss"]})

    model = copy.deepcopy(base) if baseline else swap(base, name)
    nvp = sum(p.numel() for p in lm.variant_parameters(model))
    learnable = [] if baseline else [k for k, s in variants.get(name).params.items() if s.learnable]
    row: dict[str, Any] = {"variant": name, "learnable": learnable, "n_variant_params": nvp, "status": "ok",
                           "ppl_original": original["ppl"], "loss_original": original["loss"], "ppl_swap": None,
                           "ppl_calibrated": None, "finetune_from": "original" if baseline else "swapped"}
    if not baseline:
        with torch.no_grad(), model.smx_swap.disabled():
            if not torch.equal(model(input_ids=held[:bs]).logits, ref_logits):
                raise SanityError(f"{name}: the swapped model with .disabled() does not reproduce the original logits")
        row.update(sites=len(model.smx_swap.sites), params_start=learned(model))
        measure("swap")
    row["stats_swap"] = stats(model)
    stage = "calibration"
    try:
        if nvp and args.calibrate:
            losses = lm.train_steps(model, data.train, steps=args.calibrate, batch_size=bs, lr=args.calib_lr,
                                    which="variant", seed=args.seed, progress=progress, desc=f"{name}: calibrate")
            measure("calibrated")
            row.update(params_calibrated=learned(model), calibrate_loss_first_last=[losses[0], losses[-1]],
                       finetune_from="calibrated")
        stage = "fine-tune"
        losses = lm.train_steps(model, data.train, steps=args.finetune, batch_size=bs, lr=args.lr, which="all",
                                seed=args.seed + 1, progress=progress, desc=f"{name}: fine-tune")
    except FloatingPointError as e:
        row.update(status="diverged", diverged=f"{stage}: {e}", wall_s=time.perf_counter() - t0)
        return row
    measure("finetuned")
    row.update(stats_finetuned=stats(model), finetune_loss_first_last=[losses[0], losses[-1]] if losses else None,
               wall_s=time.perf_counter() - t0)
    if nvp:
        row["params_finetuned"] = learned(model)
    return row


def add_ratios(rows: list[dict[str, Any]]) -> float | None:
    """Every perplexity also as a ratio to the fine-tuned softmax baseline; returns that baseline."""
    ref = rows[0].get("ppl_finetuned") if rows and rows[0]["variant"] == BASELINE else None
    for r in rows:
        for k in ("original", "swap", "calibrated", "finetuned"):
            v = r.get(f"ppl_{k}")
            r[f"ratio_{k}"] = (v / ref) if (v is not None and ref and math.isfinite(v)) else None
    return ref


def fmt(v: Any, spec: str = ".1f") -> str:
    if v is None:
        return "-"
    return str(v) if isinstance(v, float) and not math.isfinite(v) else format(v, spec)


def table_rows(rows: list[dict[str, Any]]) -> list[list[str]]:
    """The cells of :data:`COLUMNS`; perplexities with (x) = ratio to the fine-tuned softmax baseline."""
    def ppl(r: dict[str, Any], k: str) -> str:
        v, ratio = r.get(f"ppl_{k}"), r.get(f"ratio_{k}")
        return fmt(v) if v is None or ratio is None else f"{fmt(v)} ({ratio:.2f}x)"

    out = []
    for r in rows:
        sw, ft = r.get("stats_swap") or {}, r.get("stats_finetuned") or {}
        zeros = "-" if not ft else f"{100 * ft['zero_fraction']:.1f}%"
        final = f"diverged ({r['diverged'].split(':')[0]})" if r["status"] == "diverged" else ppl(r, "finetuned")
        out.append([r["variant"], ", ".join(r["learnable"]) or "-", fmt(r["ppl_original"]), ppl(r, "swap"),
                    ppl(r, "calibrated"), final, f"{fmt(sw.get('entropy'), '.3f')} → {fmt(ft.get('entropy'), '.3f')}",
                    f"{fmt(sw.get('sink_mass'), '.3f')} → {fmt(ft.get('sink_mass'), '.3f')}",
                    fmt(ft.get("rowsum"), ".3f"), zeros, fmt(r.get("wall_s"), ".0f")])
    return out


def plotted(r: dict[str, Any], stage: str, key: str) -> float:
    """A row's perplexity (``key`` "ppl") or attention statistic after ``stage``; NaN when there is none."""
    v = r.get(f"ppl_{stage}") if key == "ppl" else (r.get(f"stats_{stage}") or {}).get(key)
    return np.nan if v is None or not math.isfinite(v) else v


def plot(doc: dict[str, Any], path: Path) -> None:
    """Per variant, bars after swap / calibration / fine-tune: held-out perplexity (log scale), attention entropy and
    sink mass; the softmax baseline, original and fine-tuned, as lines."""
    plt = common.pyplot()
    if plt is None:
        print(common.NO_MATPLOTLIB)
        return
    rows = [r for r in doc["rows"] if r["variant"] != BASELINE]
    base = next((r for r in doc["rows"] if r["variant"] == BASELINE), {})
    x, cfg = np.arange(len(rows)), doc["config"]
    stages = (("swap", "after swap", "tab:gray"), ("calibrated", "calibrated", "tab:orange"),
              ("finetuned", "fine-tuned", "tab:blue"))
    panels = (("ppl", "held-out perplexity (log scale)"), ("entropy", "attention entropy (nats per row)"),
              ("sink_mass", "sink mass (mean weight on the first key)"))
    fig, axes = plt.subplots(3, 1, figsize=(14, 13), sharex=True)
    for ax, (key, title) in zip(axes, panels):
        for i, (stage, label, color) in enumerate(stages):
            ax.bar(x + (i - 1) * 0.27, [plotted(r, stage, key) for r in rows], 0.27, label=label, color=color)
        original = doc["original"]["ppl"] if key == "ppl" else plotted(base, "swap", key)
        tuned = plotted(base, "finetuned", key)
        ax.axhline(original, color="black", ls="--", label=f"softmax, original ({original:.4g})")
        ax.axhline(tuned, color="tab:green", label=f"softmax, fine-tuned the same way ({tuned:.4g})")
        ax.set_yscale("log" if key == "ppl" else "linear")
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8, ncol=3)
    axes[-1].set_xticks(x, [r["variant"] for r in rows], rotation=25, ha="right")
    axes[0].yaxis.set_major_formatter("{x:g}")
    axes[0].yaxis.set_minor_formatter("{x:g}")
    fig.suptitle(f"softmax variants swapped into the smx-demo GPT-2 ({cfg['checkpoint']}): {doc['eval']['tokens']} "
                 f"held-out tokens, {cfg['calibrate']} calibration and {cfg['finetune']} fine-tuning steps")
    print(common.save_figure(fig, path, dpi=110))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.replot:
        if not args.plot:
            parser.error("--replot needs --plot FILE")
        plot(json.loads(args.replot.read_text()), args.plot)
        return 0
    if args.checkpoint is None:
        parser.error("--checkpoint DIR is required")
    names = args.variants or list(variants.names())
    torch.set_num_threads(args.threads)
    command = common.command_line(argv, None if argv is None else "benchmarks/eval_variants.py")
    print(f"command: {command}", flush=True)
    try:
        ck = lm.checkpoint_dir(args.checkpoint)
    except FileNotFoundError as e:
        raise SystemExit(f"{e}\n(train one with: smx demo --backends eager --seed 0 --out DIR)") from None
    data, base, bs = lm.lm_data(ck), lm.load_lm(ck), args.batch_size
    held = data.heldout if args.eval_batches == 0 else data.heldout[:args.eval_batches * bs]
    stats_w = held[:args.stats_batches * bs]
    env = common.environment(packages=("transformers", "tokenizers"), git=True)
    t_start = time.perf_counter()
    original = lm.perplexity(base, held, batch_size=bs, progress=not args.no_progress, desc="original: perplexity")
    with torch.no_grad():
        ref_logits = base(input_ids=held[:bs]).logits
    checksum = [p.detach().clone() for p in base.parameters()]
    print(f"checkpoint {ck}: {data.corpus}, windows of {data.seq_len} tokens, {held.shape[0]} held-out evaluated; "
          f"perplexity {original['ppl']:.3f}", flush=True)
    rows = []
    try:
        for name in [BASELINE, *names]:
            r = run_row(name, base, data, held, stats_w, args, original, ref_logits)
            rows.append(r)
            print(f"ERROR {name}: diverged in {r['diverged']}, going on with the others" if r["status"] == "diverged"
                  else f"{name}: ppl swap {fmt(r['ppl_swap'])}, calibrated {fmt(r['ppl_calibrated'])}, fine-tuned "
                  f"{fmt(r['ppl_finetuned'])} ({r['wall_s']:.0f} s)", flush=True)
        if not all(torch.equal(a, b) for a, b in zip(checksum, base.parameters())):
            raise SanityError("the loaded checkpoint changed during the run (a row trained it instead of a copy)")
    except SanityError as e:
        print(f"SANITY CHECK FAILED: {e}")
        return 2
    total_s = time.perf_counter() - t_start
    ref = add_ratios(rows)
    common.print_table(f"softmax variants in the smx-demo GPT-2: held-out perplexity ({held.shape[0]} windows); "
                       f"(x) = ratio to the fine-tuned softmax baseline {fmt(ref)}", COLUMNS, table_rows(rows),
                       args.markdown, left=("variant", "learnable"))
    diverged = [r["variant"] for r in rows if r["status"] == "diverged"]
    print(f"diverged: {', '.join(diverged) or 'none'}; total {total_s:.0f} s")
    doc = {"command": command, "date": env["date_utc"], "environment": env | {"loadavg_at_end": common.loadavg()},
           "config": {"checkpoint": str(args.checkpoint), "variants": names, "threads": torch.get_num_threads(),
                      **{k: getattr(args, k) for k in ("calibrate", "finetune", "batch_size", "eval_batches",
                                                       "stats_batches", "lr", "calib_lr", "seed")}},
           "data": {"corpus": data.corpus, "seq_len": data.seq_len, "train_windows": int(data.train.shape[0]),
                    "heldout_windows": int(data.heldout.shape[0]), "demo_settings": data.settings},
           "eval": {"windows": int(held.shape[0]), "tokens": original["tokens"], "stats_windows": len(stats_w)},
           "original": {"ppl": original["ppl"], "loss": original["loss"]}, "baseline_ppl_finetuned": ref,
           "rows": rows, "diverged": diverged, "table_markdown": common.markdown_table(COLUMNS, table_rows(rows)),
           "total_s": total_s}
    if args.json:
        common.write_json(args.json, doc)
        print(f"wrote {args.json}")
    if args.plot:
        plot(doc, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
