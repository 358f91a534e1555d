#!/usr/bin/env python
"""Every softmax variant swapped into a pretrained GPT-2: held-out perplexity after the swap, after
calibration and after a short fine-tune, next to the softmax model fine-tuned the same way.

What is measured: per variant of ``smxcompile.variants.names()`` (on a fresh copy of the checkpoint), the held-out
perplexity after the swap, calibrated (--calibrate steps on the variant's own parameters) and fine-tuned (--finetune
steps on every weight), each also as a ratio to the "softmax (baseline)" row (the original model fine-tuned the same
way); attention entropy and sink mass after the swap and after the fine-tune, row sum and zero fraction after it. A
NaN / infinite training loss stops that variant ("diverged") and the run goes on (entmax_bisect is the slowest row).
Sanity checks exit with status 2. The study: docs/VARIANTS.md.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # common.py, also when loaded from a file path

import common  # noqa: E402
from smx_app.argtypes import nonneg_int, positive_float, positive_int  # noqa: E402

BASELINE = "softmax (baseline)"

EPILOG = """\
examples:
  python benchmarks/eval_variants.py --checkpoint /tmp/ckpt/seed0/checkpoint --markdown \\
      --json docs/bench_variants.json --plot docs/variants.png        # docs/VARIANTS.md's figures (~13 min)
  python benchmarks/eval_variants.py --checkpoint runs/seed0 --variants ssmax,softpick,sigmoid \\
      --calibrate 100 --finetune 300
  python benchmarks/eval_variants.py --replot docs/bench_variants.json --plot docs/variants.png

checkpoint: an `smx demo --out DIR` folder or its checkpoint/ subfolder (train one with `smx demo --backends eager
--seed 0 --out DIR`); the window length and corpus come from the demo's results.json (else --seq-len / --corpus).
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="eval_variants.py", description=__doc__.split("\n", 3)[3] if __doc__ else None,
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, metavar="DIR", help="an `smx demo` checkpoint (required)")
    p.add_argument("--variants", default="all", metavar="LIST",
                   help="comma-separated variant names (default: all of smxcompile.variants.names()); the softmax "
                        "baseline row always runs")
    p.add_argument("--calibrate", type=nonneg_int, default=25, metavar="STEPS",
                   help="calibration steps (the variant's parameters only) for the variants that have learnable "
                        "parameters; 0 = no calibration (default: 25)")
    p.add_argument("--finetune", type=nonneg_int, default=50, metavar="STEPS",
                   help="fine-tuning steps (every weight), the same for every variant and the baseline (default: 50)")
    p.add_argument("--batch-size", type=positive_int, default=8, metavar="B",
                   help="windows per training step and per evaluation batch (default: 8)")
    p.add_argument("--eval-batches", type=nonneg_int, default=8, metavar="N",
                   help="held-out batches for the perplexity, 0 = every held-out window (default: 8)")
    p.add_argument("--stats-batches", type=positive_int, default=2, metavar="N",
                   help="held-out batches for the attention statistics (default: 2)")
    p.add_argument("--lr", type=positive_float, default=None, metavar="LR",
                   help="fine-tuning learning rate (default: smx_app.lm.FINETUNE_LR, 1e-4)")
    p.add_argument("--calib-lr", type=positive_float, default=None, metavar="LR",
                   help="calibration learning rate (default: smx_app.lm.CALIBRATE_LR, 1e-2)")
    p.add_argument("--seed", type=int, default=0,
                   help="batch order: calibration uses SEED, every fine-tune SEED + 1 (default: 0)")
    p.add_argument("--seq-len", type=positive_int, default=None, metavar="T", help="window length (default: the demo's)")
    p.add_argument("--corpus", default=None, help="demo corpus name (default: the demo's)")
    p.add_argument("--threads", type=positive_int, default=1,
                   help="torch.set_num_threads (default: 1: on a shared 2-core machine two threads spin-wait on "
                        "each other whenever another process holds a core, 2-3x slower than one)")
    p.add_argument("--markdown", action="store_true", help="print the results as a Markdown table")
    p.add_argument("--json", type=Path, default=None, metavar="FILE", help="write every figure and the provenance as JSON")
    p.add_argument("--plot", type=Path, default=None, metavar="FILE", help="write a plot (matplotlib, PNG)")
    p.add_argument("--replot", type=Path, default=None, metavar="JSON",
                   help="only redraw --plot from an earlier --json file (no evaluation)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


@dataclasses.dataclass
class Config:
    checkpoint: str
    variants: list[str]
    calibrate: int
    finetune: int
    batch_size: int
    eval_batches: int
    stats_batches: int
    lr: float
    calib_lr: float
    seed: int
    seq_len: int | None
    corpus: str | None
    threads: int


def resolve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Config:
    import torch

    from smxcompile import variants
    from smx_app import lm

    known = variants.names()
    if args.variants.strip() in ("", "all"):
        names = list(known)
    else:
        names = [n.strip() for n in args.variants.split(",") if n.strip()]
        unknown = [n for n in names if n not in known]
        if unknown:
            parser.error(f"--variants: unknown {', '.join(unknown)}; known: {', '.join(known)}")
        names = list(dict.fromkeys(names))
    torch.set_num_threads(args.threads)
    return Config(checkpoint=str(args.checkpoint), variants=names, calibrate=args.calibrate, finetune=args.finetune,
                  batch_size=args.batch_size, eval_batches=args.eval_batches, stats_batches=args.stats_batches,
                  lr=args.lr or lm.FINETUNE_LR, calib_lr=args.calib_lr or lm.CALIBRATE_LR, seed=args.seed,
                  seq_len=args.seq_len, corpus=args.corpus, threads=torch.get_num_threads())


class SanityError(RuntimeError):
    """A check that the measurement is what it claims to be failed."""


def _say(msg: str, progress: bool) -> None:
    if progress:
        from tqdm.auto import tqdm

        tqdm.write(msg)
    else:
        print(msg, flush=True)


def _checksum(model) -> float:
    import torch

    with torch.no_grad():
        return float(sum(p.detach().double().abs().sum() for p in model.parameters()))


def _learned(model) -> dict[str, dict[str, float]]:
    """Per parameter name, over every site and head: mean, min, max and the values (site by site, head by head)."""
    import torch

    from smxcompile.edit.swap import swapped_sites

    vals: dict[str, list[torch.Tensor]] = {}
    for s in swapped_sites(model).values():
        for k, p in s.params.items():
            vals.setdefault(k, []).append(p.detach().reshape(-1))
    out = {}
    for k, vs in vals.items():
        v = torch.cat(vs).double()
        out[k] = {"mean": float(v.mean()), "min": float(v.min()), "max": float(v.max()),
                  "values": [round(float(x), 6) for x in v]}
    return out


def _stats(d: dict[str, float]) -> dict[str, float]:
    return {k: float(d[k]) for k in ("entropy", "sink_mass", "rowsum", "zero_fraction")}


def run_baseline(base, data, held, stats_w, cfg: Config, progress: bool, original: dict[str, Any]) -> dict[str, Any]:
    """The softmax model fine-tuned like every variant; its statistics measured at the same sites."""
    import smxcompile
    from smx_app import lm

    t0 = time.perf_counter()
    timings: dict[str, float] = {}
    ex = {"input_ids": held[:1]}
    # the original softmax's statistics: any swap, run with .disabled() (attention_stats(baseline=True))
    probe = smxcompile.swap(base, "temperature", example_inputs=ex, n_train=data.seq_len)
    st_orig = _stats(lm.attention_stats(probe, stats_w, batch_size=cfg.batch_size, baseline=True))
    del probe
    model = copy.deepcopy(base)
    row: dict[str, Any] = {"variant": BASELINE, "learnable": [], "n_variant_params": 0,
                           "ppl_original": original["ppl"], "loss_original": original["loss"],
                           "ppl_swap": None, "ppl_calibrated": None, "finetune_from": "original",
                           "stats_swap": st_orig, "status": "ok", "timings_s": timings}
    try:
        t = time.perf_counter()
        losses = lm.train_steps(model, data.train, steps=cfg.finetune, batch_size=cfg.batch_size, lr=cfg.lr,
                                  which="all", seed=cfg.seed + 1, progress=progress, desc="softmax: fine-tune")
        timings["finetune"] = time.perf_counter() - t
    except FloatingPointError as e:
        row.update(status="diverged", diverged=f"fine-tune: {e}", wall_s=time.perf_counter() - t0)
        return row
    r = lm.perplexity(model, held, batch_size=cfg.batch_size, progress=progress, desc="softmax: perplexity")
    probe = smxcompile.swap(model, "temperature", example_inputs=ex, n_train=data.seq_len)
    st = _stats(lm.attention_stats(probe, stats_w, batch_size=cfg.batch_size, baseline=True))
    row.update(ppl_finetuned=r["ppl"], loss_finetuned=r["loss"], stats_finetuned=st,
               finetune_loss_first_last=[losses[0], losses[-1]] if losses else None,
               wall_s=time.perf_counter() - t0)
    return row


def run_variant(name: str, base, data, held, stats_w, cfg: Config, progress: bool, original: dict[str, Any],
                ref_logits) -> dict[str, Any]:
    """One variant: swap a copy of ``base``, measure, calibrate (if it has parameters), fine-tune, measure."""
    import torch

    import smxcompile
    from smxcompile import variants
    from smx_app import lm

    t0 = time.perf_counter()
    v = variants.get(name)
    learnable = [k for k, s in v.params.items() if s.learnable]
    model = smxcompile.swap(base, name, example_inputs={"input_ids": held[:1]}, n_train=data.seq_len)
    with torch.no_grad(), model.smx_swap.disabled():
        same = torch.equal(model(input_ids=held[:cfg.batch_size]).logits, ref_logits)
    if not same:
        raise SanityError(f"{name}: the swapped model with .disabled() does not reproduce the original logits")
    nvp = sum(p.numel() for p in lm.variant_parameters(model))
    row: dict[str, Any] = {"variant": name, "learnable": learnable, "n_variant_params": nvp,
                           "sites": len(model.smx_swap.sites), "ppl_original": original["ppl"],
                           "loss_original": original["loss"], "status": "ok", "params_start": _learned(model)}
    timings: dict[str, float] = {}
    row["timings_s"] = timings
    t = time.perf_counter()
    r = lm.perplexity(model, held, batch_size=cfg.batch_size, progress=progress, desc=f"{name}: perplexity (swap)")
    row.update(ppl_swap=r["ppl"], loss_swap=r["loss"])
    timings["perplexity_swap"] = time.perf_counter() - t
    t = time.perf_counter()
    row["stats_swap"] = _stats(lm.attention_stats(model, stats_w, batch_size=cfg.batch_size))
    timings["stats_swap"] = time.perf_counter() - t
    row["ppl_calibrated"] = None
    row["finetune_from"] = "swapped"
    stage = "calibration"
    try:
        if nvp and cfg.calibrate:
            t = time.perf_counter()
            losses = lm.train_steps(model, data.train, steps=cfg.calibrate, batch_size=cfg.batch_size,
                                      lr=cfg.calib_lr, which="variant", seed=cfg.seed, progress=progress,
                                      desc=f"{name}: calibrate")
            timings["calibrate"] = time.perf_counter() - t
            r = lm.perplexity(model, held, batch_size=cfg.batch_size, progress=progress,
                                desc=f"{name}: perplexity (calibrated)")
            row.update(ppl_calibrated=r["ppl"], loss_calibrated=r["loss"], params_calibrated=_learned(model),
                       calibrate_loss_first_last=[losses[0], losses[-1]], finetune_from="calibrated")
        stage = "fine-tune"
        t = time.perf_counter()
        losses = lm.train_steps(model, data.train, steps=cfg.finetune, batch_size=cfg.batch_size, lr=cfg.lr,
                                  which="all", seed=cfg.seed + 1, progress=progress, desc=f"{name}: fine-tune")
        timings["finetune"] = time.perf_counter() - t
    except FloatingPointError as e:
        row.update(status="diverged", diverged=f"{stage}: {e}", wall_s=time.perf_counter() - t0)
        return row
    r = lm.perplexity(model, held, batch_size=cfg.batch_size, progress=progress, desc=f"{name}: perplexity (fine-tuned)")
    row.update(ppl_finetuned=r["ppl"], loss_finetuned=r["loss"],
               stats_finetuned=_stats(lm.attention_stats(model, stats_w, batch_size=cfg.batch_size)),
               finetune_loss_first_last=[losses[0], losses[-1]] if losses else None,
               wall_s=time.perf_counter() - t0)
    if nvp:
        row["params_finetuned"] = _learned(model)
    return row


def add_ratios(rows: list[dict[str, Any]]) -> float | None:
    """Every perplexity also as a ratio to the fine-tuned softmax baseline; returns that baseline."""
    ref = rows[0].get("ppl_finetuned") if rows and rows[0]["variant"] == BASELINE else None
    for r in rows:
        for k in ("original", "swap", "calibrated", "finetuned"):
            v = r.get(f"ppl_{k}")
            r[f"ratio_{k}"] = (v / ref) if (v is not None and ref and math.isfinite(v)) else None
    return ref


def _f(v: Any, spec: str = ".1f") -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return format(v, spec)


def _ppl(r: dict[str, Any], k: str) -> str:
    v = r.get(f"ppl_{k}")
    if v is None:
        return "-"
    ratio = r.get(f"ratio_{k}")
    return f"{_f(v)} ({ratio:.2f}x)" if ratio is not None else _f(v)


def _st(r: dict[str, Any], key: str, spec: str) -> str:
    a = (r.get("stats_swap") or {}).get(key)
    b = (r.get("stats_finetuned") or {}).get(key)
    return f"{_f(a, spec)} → {_f(b, spec)}"


def _ft(r: dict[str, Any]) -> str:
    if r["status"] == "diverged":
        return "diverged (" + r["diverged"].split(":")[0] + ")"
    return _ppl(r, "finetuned")


def table_rows(rows: list[dict[str, Any]]) -> list[list[str]]:
    out = []
    for r in rows:
        ft = r.get("stats_finetuned") or {}
        out.append([r["variant"], ", ".join(r["learnable"]) or "-", _f(r["ppl_original"]), _ppl(r, "swap"),
                    _ppl(r, "calibrated"), _ft(r), _st(r, "entropy", ".3f"), _st(r, "sink_mass", ".3f"),
                    _f(ft.get("rowsum"), ".3f"), _f(None if ft.get("zero_fraction") is None else
                                                    100 * ft["zero_fraction"], ".1f") + ("%" if ft else ""),
                    _f(r.get("wall_s"), ".0f")])
    return out


COLUMNS = ["variant", "learnable", "ppl original", "ppl after swap", "ppl calibrated", "ppl fine-tuned",
           "entropy (nats) swap → ft", "sink mass swap → ft", "row sum (ft)", "zeros (ft)", "wall s"]


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """One row per variant (and the baseline). Perplexities: (x) = ratio to the fine-tuned softmax baseline."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(c.replace("|", "/") for c in cells) + " |" for cells in table_rows(rows)]
    return "\n".join(lines)


def rich_table(rows: list[dict[str, Any]], title: str):
    from rich.table import Table

    t = Table(title=title)
    for c in COLUMNS:
        t.add_column(c, justify="left" if c in ("variant", "learnable") else "right")
    for cells in table_rows(rows):
        t.add_row(*cells)
    return t


def plot(doc: dict[str, Any], path: Path) -> None:
    """Top: grouped bars of held-out perplexity (after swap / calibrated / fine-tuned) per variant, log
    scale, with the original and the fine-tuned softmax as horizontal lines. Bottom: attention entropy
    and sink mass after the swap and after the fine-tune, softmax's own as lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker
    import numpy as np

    rows = [r for r in doc["rows"] if r["variant"] != BASELINE]
    base = next((r for r in doc["rows"] if r["variant"] == BASELINE), None)
    names = [r["variant"] for r in rows]
    x = np.arange(len(rows))
    cfg = doc["config"]
    fig = plt.figure(figsize=(15, 10))
    gs = fig.add_gridspec(2, 2, height_ratios=[1.3, 1.0])
    ax = fig.add_subplot(gs[0, :])
    w = 0.27
    stages = [("swap", "after swap (no training)", "tab:gray"),
              ("calibrated", f"calibrated ({cfg['calibrate']} steps, variant parameters only)", "tab:orange"),
              ("finetuned", f"fine-tuned ({cfg['finetune']} steps, all weights)", "tab:blue")]
    vals_all = []
    for i, (k, label, color) in enumerate(stages):
        ys = [r.get(f"ppl_{k}") for r in rows]
        ys = [y if (y is not None and math.isfinite(y)) else np.nan for y in ys]
        vals_all += [y for y in ys if not np.isnan(y)]
        ax.bar(x + (i - 1) * w, ys, w, label=label, color=color)
    orig = doc["original"]["ppl"]
    ax.axhline(orig, color="black", ls="--", lw=1.2, label=f"original softmax checkpoint ({orig:.1f})")
    if base and base.get("ppl_finetuned"):
        ax.axhline(base["ppl_finetuned"], color="tab:green", lw=1.8,
                   label=f"softmax fine-tuned the same way ({base['ppl_finetuned']:.1f})")
        vals_all.append(base["ppl_finetuned"])
    for i, r in enumerate(rows):
        if r["status"] == "diverged":
            ax.text(x[i] + w, orig, "diverged", rotation=90, ha="center", va="bottom", color="red", fontsize=8)
    ax.set_yscale("log")
    lo, hi = min(vals_all + [orig]), max(vals_all + [orig])
    ax.set_ylim(lo * 0.9, hi * 1.3)
    for i, r in enumerate(rows):
        if r.get("ppl_calibrated") is None and r["status"] == "ok":
            ax.text(x[i], lo * 0.92, "no params", ha="center", va="bottom", rotation=90, fontsize=7.5,
                    color="tab:orange")
    fmt = matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}")
    ax.yaxis.set_major_formatter(fmt)
    ax.yaxis.set_minor_formatter(fmt)
    ax.tick_params(axis="y", which="minor", labelsize=8)
    ax.set_xticks(x)
    ax.set_xticklabels(names, rotation=25, ha="right")
    ax.set_ylabel("held-out perplexity (log scale; lower is better)")
    ax.set_title("held-out perplexity per variant (\"no params\": no learnable parameter, nothing to calibrate)")
    ax.grid(axis="y", which="both", alpha=0.3)
    ax.legend(fontsize=8.5, loc="upper left", ncol=2)
    for j, (key, label) in enumerate((("entropy", "attention entropy (nats per row)"),
                                      ("sink_mass", "sink mass (mean weight on the first key)"))):
        a = fig.add_subplot(gs[1, j])
        sw = [(r.get("stats_swap") or {}).get(key, np.nan) for r in rows]
        fw = [(r.get("stats_finetuned") or {}).get(key, np.nan) for r in rows]
        a.bar(x - 0.2, sw, 0.4, label="after swap", color="tab:gray")
        a.bar(x + 0.2, fw, 0.4, label="after fine-tune", color="tab:blue")
        if base:
            a.axhline(base["stats_swap"][key], color="black", ls="--", lw=1.2,
                      label=f"softmax, original ({base['stats_swap'][key]:.3f})")
            if base.get("stats_finetuned"):
                a.axhline(base["stats_finetuned"][key], color="tab:green", lw=1.5,
                          label=f"softmax, fine-tuned ({base['stats_finetuned'][key]:.3f})")
        top = np.nanmax(sw + fw + ([base["stats_swap"][key]] if base else []))
        a.set_ylim(0, top * 1.35)
        a.set_xticks(x)
        a.set_xticklabels(names, rotation=35, ha="right", fontsize=8.5)
        a.set_title(label)
        a.grid(axis="y", alpha=0.3)
        a.legend(fontsize=7.5, loc="upper left", ncol=2, framealpha=0.9)
    ck = Path(doc["config"]["checkpoint"])
    fig.suptitle(f"softmax variants swapped into the smx-demo GPT-2 ({ck.parent.name if ck.name == 'checkpoint' else ck.name}"
                 f"): {doc['eval']['tokens']} held-out tokens, fine-tune lr {cfg['lr']:g}, calibration lr "
                 f"{cfg['calib_lr']:g}, batch {cfg['batch_size']}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_rows(base, data, held, stats_w, cfg: Config, progress: bool, original: dict[str, Any],
             ref_logits) -> list[dict[str, Any]]:
    """The baseline row, then every variant's; the loaded checkpoint must be unchanged at the end."""
    checksum, rows, outer = _checksum(base), [], None
    if progress:
        from tqdm.auto import tqdm

        outer = tqdm(total=1 + len(cfg.variants), desc="rows", dynamic_ncols=True)
    try:
        for name in [BASELINE, *cfg.variants]:
            if outer is not None:
                outer.set_postfix_str(name)
            if name == BASELINE:
                r = run_baseline(base, data, held, stats_w, cfg, progress, original)
            else:
                r = run_variant(name, base, data, held, stats_w, cfg, progress, original, ref_logits)
            rows.append(r)
            if r["status"] == "diverged":
                _say(f"ERROR {name}: diverged in {r['diverged']} -- recorded as 'diverged', going on with the others",
                     progress)
            else:
                _say(f"{name}: ppl swap {_f(r.get('ppl_swap'))}, calibrated {_f(r.get('ppl_calibrated'))}, "
                     f"fine-tuned {_f(r.get('ppl_finetuned'))} ({r['wall_s']:.0f} s)", progress)
            if outer is not None:
                outer.update(1)
    finally:
        if outer is not None:
            outer.close()
    if abs(_checksum(base) - checksum) > 0:
        raise SanityError("the loaded checkpoint changed during the run (a row trained it instead of a copy)")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.replot:
        if not args.plot:
            parser.error("--replot needs --plot FILE")
        plot(json.loads(args.replot.read_text()), args.plot)
        print(f"wrote {args.plot}")
        return 0
    if args.checkpoint is None:
        parser.error("--checkpoint DIR is required")
    import warnings

    import torch

    try:
        import transformers
    except ImportError:
        raise SystemExit("transformers is required: pip install -e '.[demo]'") from None
    transformers.logging.set_verbosity_error()
    from rich.console import Console

    from smx_app import lm

    cfg = resolve(args, parser)
    console = Console(soft_wrap=True, width=None if sys.stdout.isatty() else 200)
    command = common.command_line(argv, None if argv is None else "benchmarks/eval_variants.py")
    console.print(f"command: {command}", markup=False)
    progress = not args.no_progress
    try:
        ck = lm.checkpoint_dir(args.checkpoint)
    except FileNotFoundError as e:
        raise SystemExit(f"{e}\n(train one with: smx demo --backends eager --seed 0 --out DIR)") from None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        data = lm.lm_data(ck, seq_len=cfg.seq_len, corpus=cfg.corpus)
    for w in caught:
        console.print(f"[yellow]warning:[/] {w.message}", markup=True)
    base = lm.load_lm(ck)
    bs = cfg.batch_size
    held = data.heldout if cfg.eval_batches == 0 else data.heldout[: cfg.eval_batches * bs]
    stats_w = held[: cfg.stats_batches * bs]
    env = common.environment(packages=("transformers", "tokenizers"), git=True)
    console.print(f"checkpoint {ck}: {data.corpus}, windows of {data.seq_len} tokens, {data.train.shape[0]} train, "
                  f"{held.shape[0]} of {data.heldout.shape[0]} held-out evaluated ({held.shape[0] * (data.seq_len - 1)} "
                  f"tokens); {len(cfg.variants)} variants; calibrate {cfg.calibrate} steps (lr {cfg.calib_lr:g}), "
                  f"fine-tune {cfg.finetune} steps (lr {cfg.lr:g}), batch {bs}; {cfg.threads} threads", markup=False)
    t_start = time.perf_counter()
    original = lm.perplexity(base, held, batch_size=bs, progress=progress, desc="original: perplexity")
    with torch.no_grad():
        ref_logits = base(input_ids=held[:bs]).logits
    console.print(f"original checkpoint: held-out perplexity {original['ppl']:.3f}")

    try:
        rows = run_rows(base, data, held, stats_w, cfg, progress, original, ref_logits)
    except SanityError as e:
        console.print(f"[bold red]SANITY CHECK FAILED[/]: {e}")
        return 2
    total_s = time.perf_counter() - t_start
    ref = add_ratios(rows)

    title = (f"softmax variants in the smx-demo GPT-2: held-out perplexity ({held.shape[0]} windows); (x) = ratio "
             f"to the fine-tuned softmax baseline {_f(ref, '.1f')}")
    if args.markdown:
        console.print(markdown_table(rows), markup=False, highlight=False)
    else:
        console.print(rich_table(rows, title))
    diverged = [r["variant"] for r in rows if r["status"] == "diverged"]
    if diverged:
        console.print(f"[red]diverged[/]: {', '.join(diverged)}")
    console.print(f"total {total_s:.0f} s")

    doc = {
        "command": command,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "environment": env | {"loadavg_at_end": common.loadavg()},
        "config": dataclasses.asdict(cfg),
        "data": {"corpus": data.corpus, "seq_len": data.seq_len, "train_windows": int(data.train.shape[0]),
                 "heldout_windows": int(data.heldout.shape[0]), "demo_settings": data.settings},
        "eval": {"windows": int(held.shape[0]), "tokens": original["tokens"], "stats_windows": int(stats_w.shape[0])},
        "original": {"ppl": original["ppl"], "loss": original["loss"]},
        "baseline_ppl_finetuned": ref,
        "rows": rows,
        "diverged": diverged,
        "table_markdown": markdown_table(rows),
        "total_s": total_s,
    }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=2, default=str) + "\n")
        console.print(f"wrote {args.json}")
    if args.plot:
        try:
            plot(doc, args.plot)
            console.print(f"wrote {args.plot}")
        except ImportError:
            console.print("[yellow]matplotlib is not installed: no plot (pip install -e '.[bench]')[/]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
