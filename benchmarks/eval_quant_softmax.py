#!/usr/bin/env python
"""Held-out perplexity of a GPT-2 whose attention softmax is quantized, with and without the bias correction.

What is measured: ``smxcompile.quantize_softmax`` at each of --bits (8, 6, 4) and each setting: none (no
correction), offset/head (the default), offset/tensor, offset/position, scale/head, scale/tensor; per checkpoint of
``smx demo``, on its held-out windows: the perplexity against fp32's (95% paired-bootstrap intervals), the KL of the
next-token distributions to fp32's, mean |row sum - 1| and the zero fraction of the attention probabilities. Goals
(the verdict): with a correction, 8-bit perplexity within 1% of fp32; a correction beats none at every bit width.
Sanity checks stop the run (exit status 2). The study: docs/PERFORMANCE.md ("Quantized softmax: held-out
perplexity with and without the bias correction").
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import re
import shlex
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # common.py, also when loaded from a file path

import common  # noqa: E402
from eval_quant_report import SETTING_NAMES, SETTINGS, Config, markdown_table, plot, print_verdict, replot  # noqa: E402
from eval_quant_report import rich_table, verdict  # noqa: E402
from smx_app.argtypes import nonneg_int, positive_int  # noqa: E402

EPILOG = """\
examples:
  python benchmarks/eval_quant_softmax.py --checkpoint /tmp/ckpt/seed0/checkpoint \\
      --checkpoint /tmp/ckpt/seed1/checkpoint --markdown \\
      --json docs/bench_quant_softmax.json --plot docs/quant_softmax.png        # docs/PERFORMANCE.md's figures
  python benchmarks/eval_quant_softmax.py --checkpoint runs/seed0 --checkpoint runs/seed1 --train-if-missing
  python benchmarks/eval_quant_softmax.py --checkpoint runs/seed0 --quick       # smoke run (< 1 min)

checkpoint: a demo --out directory or its checkpoint/ subdirectory; the window length and corpus come from the
demo's results.json (else config.n_positions and the demo's default corpus, or --seq-len / --corpus).
--train-if-missing trains a missing one with `smx demo --small --backends eager --seed S --out DIR`, S from a
'seed<N>' part of the path, else the checkpoint's position in the list.
"""


class SanityError(RuntimeError):
    """A check that the measurement is what it claims to be failed."""


def bits_list(text: str) -> list[int]:
    try:
        bits = [int(b) for b in text.split(",") if b.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--bits must be comma-separated integers, got {text!r}") from None
    if not bits or any(not 2 <= b <= 8 for b in bits):
        raise argparse.ArgumentTypeError(f"--bits must list integers in 2..8, got {text!r}")
    return sorted(set(bits), reverse=True)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="eval_quant_softmax.py", description=__doc__.split("\n", 2)[2], epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", action="append", type=Path, metavar="DIR",
                   help="an `smx demo` checkpoint (repeat for several; --quick uses the first only)")
    p.add_argument("--bits", type=bits_list, default=None, metavar="LIST",
                   help="bit widths, comma-separated (default: 8,6,4; with --quick: 8,4)")
    p.add_argument("--settings", default=",".join(SETTING_NAMES), metavar="LIST",
                   help=f"which settings to run, comma-separated (default: all: {','.join(SETTING_NAMES)})")
    p.add_argument("--calib-batches", type=positive_int, default=None, metavar="N",
                   help="calibration batches of training windows (default: 8; with --quick: 2)")
    p.add_argument("--eval-batches", type=nonneg_int, default=None, metavar="N",
                   help="held-out batches to evaluate, 0 = every held-out window (default: 0; with --quick: 2)")
    p.add_argument("--stats-batches", type=nonneg_int, default=4, metavar="N",
                   help="held-out batches over which the row-sum error and zero fraction are collected, 0 = all "
                        "(about one extra forward per batch; perplexity uses every evaluated batch) (default: 4)")
    p.add_argument("--batch-size", type=positive_int, default=8, metavar="B", help="windows per batch (default: 8)")
    p.add_argument("--calib-seed", type=int, default=0, help="seed of the calibration sample (default: 0)")
    p.add_argument("--seq-len", type=positive_int, default=None, metavar="T",
                   help="window length (default: the demo's, from results.json, else config.n_positions)")
    p.add_argument("--corpus", default=None, help="demo corpus name (default: the demo's, from results.json)")
    p.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    p.add_argument("--threads", type=positive_int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--quick", action="store_true", help="smoke run: first checkpoint only, 2 calibration + 2 "
                                                        "evaluation batches, bits 8,4 (explicit options still win)")
    p.add_argument("--markdown", action="store_true", help="print the results as a Markdown table")
    p.add_argument("--json", type=Path, metavar="FILE", help="write every figure and the environment as JSON")
    p.add_argument("--plot", type=Path, metavar="FILE", help="write a plot (matplotlib, PNG)")
    p.add_argument("--replot", type=Path, metavar="JSON", help="only redraw --plot from an earlier --json file")
    p.add_argument("--train-if-missing", action="store_true",
                   help="train a missing checkpoint with `smx demo --small --backends eager --seed S --out DIR` first")
    p.add_argument("--train-args", default="", metavar="STR",
                   help="extra `smx demo` options for --train-if-missing, one string: --train-args='--quick --steps 20'")
    p.add_argument("--strict", action="store_true", help="exit 1 when a goal is met by no correction setting")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def resolve(args: argparse.Namespace) -> Config:
    q = args.quick
    names = [s.strip() for s in args.settings.split(",") if s.strip()]
    unknown = [n for n in names if n not in SETTING_NAMES]
    if unknown or not names:
        raise SystemExit(f"--settings: unknown {unknown}; choose from {SETTING_NAMES}")
    return Config(checkpoints=list(args.checkpoint)[:1] if q else list(args.checkpoint),
                  bits=args.bits or ([8, 4] if q else [8, 6, 4]), settings=[s for s in SETTINGS if s[0] in names],
                  calib_batches=args.calib_batches or (2 if q else 8),
                  eval_batches=args.eval_batches if args.eval_batches is not None else (2 if q else 0),
                  stats_batches=args.stats_batches, batch_size=args.batch_size, calib_seed=args.calib_seed,
                  seq_len=args.seq_len, corpus=args.corpus, device=args.device, quick=q)


def checkpoint_dir(path: Path) -> Path | None:
    """The folder holding config.json: ``path`` itself or ``path/checkpoint``; None when neither."""
    return next((p for p in (path, path / "checkpoint") if (p / "config.json").is_file()), None)


def label_of(path: Path) -> str:
    p = path.resolve()
    return p.parent.name if p.name == "checkpoint" else p.name


def train_missing(path: Path, index: int, extra: str, console) -> Path:
    """Run ``smx demo --small --backends eager --seed S --out OUT`` so that ``path`` becomes a checkpoint (the
    128-token configuration of docs/PERFORMANCE.md's figures; ``--quick`` in ``extra``: its own configuration)."""
    out = path.parent if path.name == "checkpoint" else path
    m = re.search(r"seed(\d+)", str(path))
    extra_args = shlex.split(extra)
    cmd = [sys.executable, "-m", "smx_app.cli", "demo", *([] if "--quick" in extra_args else ["--small"]),
           "--backends", "eager", "--seed", str(int(m.group(1)) if m else index), "--out", str(out), *extra_args]
    console.print(f"[bold]training missing checkpoint[/]: {shlex.join(cmd)}")
    t0 = time.perf_counter()
    rc = subprocess.run(cmd).returncode
    ck = checkpoint_dir(path)
    if rc not in (0, 1) or ck is None:  # 1 = a backend disagreed; with eager alone it does not happen
        raise SystemExit(f"`smx demo` failed (exit {rc}) and left no checkpoint in {out}")
    console.print(f"trained in {time.perf_counter() - t0:.0f} s: {ck}")
    return ck


def load_data(ck: Path, cfg: Config, console) -> dict[str, Any]:
    """The demo's windows of the checkpoint (smx_app.lm.lm_data): a seeded calibration sample of training windows,
    the held-out windows evaluated."""
    import torch

    from smx_app import lm

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            data = lm.lm_data(ck, seq_len=cfg.seq_len, corpus=cfg.corpus)
        except (ValueError, FileNotFoundError) as e:
            raise SystemExit(f"{ck}: {e}") from None
    for w in caught:
        console.print(f"[yellow]warning[/]: {w.message}")
    train, held = data.train, data.heldout
    n_cal = min(cfg.calib_batches * cfg.batch_size, train.shape[0])
    calib = train[torch.randperm(train.shape[0], generator=torch.Generator().manual_seed(cfg.calib_seed))[:n_cal]]
    n_eval = held.shape[0] if cfg.eval_batches == 0 else min(held.shape[0], cfg.eval_batches * cfg.batch_size)
    return {"seq_len": data.seq_len, "corpus": data.corpus, "demo_settings": data.settings,
            "results_json": str(data.results) if data.results else None, "calib": calib, "eval": held[:n_eval],
            "n_heldout_total": int(held.shape[0]), "n_train_windows": int(train.shape[0]), "vocab": data.vocab_size}


def batches(t, bs: int) -> list:
    return [t[i:i + bs] for i in range(0, t.shape[0], bs)]


def window_nll(logits, ids):
    """Per window, the summed next-token NLL (fp64): a ``(batch,)`` tensor."""
    import torch.nn.functional as F

    lg, tgt = logits[:, :-1].double(), ids[:, 1:]
    return F.cross_entropy(lg.reshape(-1, lg.shape[-1]), tgt.reshape(-1), reduction="none").view(tgt.shape).sum(1)


def paired_ci(w, w_ref, tokens_per_window: int, n_boot: int = 2000, seed: int = 0) -> list[float]:
    """95% paired-bootstrap interval over the evaluated windows of the perplexity change (%) of ``w`` against
    ``w_ref`` (per-window NLL sums of the same windows)."""
    import numpy as np

    d = (w - w_ref).cpu().numpy()
    idx = np.random.default_rng(seed).integers(0, d.shape[0], size=(n_boot, d.shape[0]))
    rel = np.expm1(d[idx].sum(1) / (d.shape[0] * tokens_per_window)) * 100.0
    return [float(np.percentile(rel, 2.5)), float(np.percentile(rel, 97.5))]


def evaluate(model, eval_batches: list, device: str, advance=None, collect_batches: int = 0) -> dict[str, Any]:
    """Perplexity of ``model`` over ``eval_batches``, the per-window NLL and the first batch's logits; a quantized
    model's statistics (``.collecting()``) over the first ``collect_batches``."""
    import torch

    acc: dict[str, Any] = {"w": [], "n": 0, "first": None}

    def step(b) -> None:
        b = b.to(device)
        logits = model(input_ids=b).logits
        acc["w"].append(window_nll(logits, b).cpu())
        acc["n"] += b[:, 1:].numel()
        if acc["first"] is None:
            acc["first"] = logits.detach().float().cpu()
        if advance:
            advance()

    qs = getattr(model, "smx_softmax_quant", None)
    t0 = time.perf_counter()
    with torch.no_grad():
        rest = eval_batches
        if qs is not None and collect_batches > 0:
            with qs.collecting():
                for b in eval_batches[:collect_batches]:
                    step(b)
            rest = eval_batches[collect_batches:]
        for b in rest:
            step(b)
    w = torch.cat(acc["w"])
    nll = float(w.sum()) / acc["n"]
    return {"nll": nll, "ppl": math.exp(nll), "tokens": acc["n"], "eval_s": time.perf_counter() - t0,
            "first_logits": acc["first"], "window_nll": w}


def correction_range(qs) -> dict[str, Any]:
    import torch

    vals = [s.correction.detach().float().cpu() for s in qs.sites.values()]
    if not vals:
        return {}
    allv = torch.cat([v.reshape(-1) for v in vals])
    return {"min": float(allv.min()), "max": float(allv.max()),
            "per_site": {k: [float(x) for x in s.correction.reshape(-1)] for k, s in qs.sites.items()},
            "scale": {k: float(s.scale) for k, s in qs.sites.items()}}


class Run:
    """One checkpoint's evaluation: the fp32 baseline, then every (bits, setting) on a fresh quantized copy."""

    def __init__(self, ck: Path, label: str, cfg: Config, console, progress, task):
        import torch
        from transformers import GPT2LMHeadModel

        self.ck, self.label, self.cfg, self.console, self.progress, self.task = ck, label, cfg, console, progress, task
        self.model = GPT2LMHeadModel.from_pretrained(ck, attn_implementation="eager").to(cfg.device).eval()
        self.n_layer, self.n_head = int(self.model.config.n_layer), int(self.model.config.n_head)
        self.data = load_data(ck, cfg, console)
        if self.data["vocab"] > self.model.config.vocab_size:
            raise SanityError(f"{ck}: tokenizer vocabulary {self.data['vocab']} exceeds the model's "
                              f"{self.model.config.vocab_size}")
        self.ev = batches(self.data["eval"], cfg.batch_size)
        self.n_stats = len(self.ev) if cfg.stats_batches == 0 else min(len(self.ev), cfg.stats_batches)
        import inspect

        self.calib_kw = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(
            self.model.forward).parameters else {}
        self.calib = [{"input_ids": b.to(cfg.device), **self.calib_kw} for b in batches(self.data["calib"],
                                                                                         cfg.batch_size)]
        self.keys: list[str] | None = None
        self.none_w: dict[int, Any] = {}
        self.checked_disabled = False
        with torch.no_grad():  # fp32 next-token log-probabilities of the statistics batches: the KL's reference
            self.ref_lp = [self.model(input_ids=b.to(cfg.device)).logits.float().log_softmax(-1).cpu()
                           for b in self.ev[:self.n_stats]]

    def bar(self, desc: str, total: int | None = None, overall: bool = False) -> None:
        if self.progress is not None:
            if overall:
                self.progress.advance(self.task["overall"])
            elif total is None:
                self.progress.update(self.task["batches"], description=desc)
            else:
                self.progress.reset(self.task["batches"], total=total, description=desc)

    def advance(self) -> None:
        if self.progress is not None:
            self.progress.advance(self.task["batches"])

    def baseline(self) -> None:
        """fp32's perplexity, its loss checked against transformers' own."""
        import torch

        self.bar(f"{self.label} fp32", len(self.ev))
        fp = evaluate(self.model, self.ev, self.cfg.device, self.advance)
        with torch.no_grad():
            b0 = self.ev[0].to(self.cfg.device)
            self.hf_loss = float(self.model(input_ids=b0, labels=b0).loss)
        s0 = float(window_nll(fp["first_logits"].to(self.cfg.device), b0).sum()) / b0[:, 1:].numel()
        if not math.isclose(s0, self.hf_loss, rel_tol=1e-4):
            raise SanityError(f"{self.label}: NLL computed here {s0:.6f} != transformers' loss {self.hf_loss:.6f} "
                              "on batch 0")
        self.fp_logits0, self.fp_w = fp.pop("first_logits"), fp.pop("window_nll")
        self.fp = fp
        self.console.print(f"  fp32: perplexity {fp['ppl']:.3f} (NLL {fp['nll']:.5f} over {fp['tokens']} tokens, "
                           f"{fp['eval_s']:.1f} s)")
        self.bar("", overall=True)

    def kl_to_fp32(self, qm) -> float:
        """Mean KL(fp32 || quantized) of the next-token distributions over the statistics batches (nats/token)."""
        import torch

        tot, n = 0.0, 0
        with torch.no_grad():
            for b, r in zip(self.ev[:self.n_stats], self.ref_lp):
                lq = qm(input_ids=b.to(self.cfg.device)).logits.double().log_softmax(-1).cpu()
                r = r.double()
                tot += float((r.exp() * (r - lq)).sum())
                n += r.shape[0] * r.shape[1]
        return tot / n

    def sanity(self, name: str, bits: int, qm, qs, q: dict, stats: dict, corr) -> float:
        """Something was quantized, every site saw rows, no correction means equal row-sum errors, .disabled() is
        fp32; -> the largest logit difference from fp32 on batch 0."""
        import torch

        tag = f"{self.label} {bits}-bit {name}"
        if self.keys is None:
            self.keys = list(qs.sites)
            kinds = {k: s.kind for k, s in qs.sites.items()}
            if len(self.keys) != self.n_layer or any(k != "attention" for k in kinds.values()):
                raise SanityError(f"{self.label}: expected {self.n_layer} attention sites (one per layer), "
                                  f"quantize_softmax chose {kinds}; skipped: {qs.skipped}")
            self.console.print(f"  sites: {', '.join(self.keys)}")
        if len(qs.sites) != self.n_layer:
            raise SanityError(f"{self.label}: {len(qs.sites)} quantized sites, {self.n_layer} attention layers")
        diff = float((q["first_logits"] - self.fp_logits0).abs().max())
        if not diff > 0 or q["ppl"] == self.fp["ppl"]:
            raise SanityError(f"{tag}: quantized logits equal fp32 (max |diff| {diff:g}, perplexity {q['ppl']} vs "
                              f"{self.fp['ppl']}): nothing was quantized")
        for k in self.keys:
            if not stats.get(k, {}).get("rows"):
                raise SanityError(f"{tag}: site {k} saw no rows during evaluation")
        a = stats["all"]
        if corr is False and not math.isclose(a["mean_abs_rowsum_err"], a["mean_abs_rowsum_err_uncorrected"],
                                              rel_tol=1e-5):
            raise SanityError(f"{self.label} {bits}-bit none: corrected and uncorrected row-sum errors differ "
                              f"without a correction: {a}")
        if not self.checked_disabled:
            with torch.no_grad(), qs.disabled():
                dd = float((qm(input_ids=self.ev[0].to(self.cfg.device)).logits.float().cpu()
                            - self.fp_logits0).abs().max())
            if dd > 1e-5:
                raise SanityError(f"{self.label}: the quantized model with .disabled() differs from fp32 by {dd:g}")
            self.checked_disabled = True
        return diff

    def setting(self, bits: int, name: str, corr, gran: str) -> dict[str, Any]:
        """One quantized copy: calibrated, evaluated, checked; its row."""
        from smxcompile.edit.quantize import quantize_softmax

        self.bar(f"{self.label} {bits}-bit {name}: calibrating", len(self.ev))
        t0 = time.perf_counter()
        qm = quantize_softmax(self.model, self.calib, bits=bits, where=self.keys if self.keys is not None else
                              "attention", correction=corr, granularity=gran, progress=False)
        calib_s, qs = time.perf_counter() - t0, qm.smx_softmax_quant
        self.bar(f"{self.label} {bits}-bit {name}: evaluating")
        q = evaluate(qm, self.ev, self.cfg.device, self.advance, collect_batches=self.n_stats)
        stats, kl = qs.stats(), self.kl_to_fp32(qm)
        diff = self.sanity(name, bits, qm, qs, q, stats, corr)
        q.pop("first_logits")
        qw, tpw, fp, a = q.pop("window_nll"), self.data["seq_len"] - 1, self.fp, stats["all"]
        if corr is False:
            self.none_w[bits] = qw
        none_w = self.none_w.get(bits)
        row = {"checkpoint": self.label, "path": str(self.ck), "bits": bits, "setting": name,
               "correction": corr if corr else None, "granularity": gran if corr else None,
               "ppl": q["ppl"], "nll": q["nll"], "fp32_ppl": fp["ppl"],
               "rel_change_pct": 100.0 * (q["ppl"] / fp["ppl"] - 1.0),
               "rel_change_ci95_pct": paired_ci(qw, self.fp_w, tpw),
               "vs_none_pct": None if none_w is None else
               100.0 * (math.exp((float(qw.sum()) - float(none_w.sum())) / q["tokens"]) - 1.0),
               "vs_none_ci95_pct": paired_ci(qw, none_w, tpw) if none_w is not None and corr else None,
               "kl_to_fp32": kl, "mean_abs_rowsum_err": a["mean_abs_rowsum_err"],
               "mean_abs_rowsum_err_uncorrected": a["mean_abs_rowsum_err_uncorrected"],
               "mean_rowsum": a["mean_rowsum"], "zero_fraction": a["zero_fraction"],
               "max_abs_logit_diff_batch0": diff, "calib_s": calib_s, "eval_s": q["eval_s"],
               "per_site": {k: v for k, v in stats.items() if k != "all"},
               "correction_values": correction_range(qs) if corr else None}
        self.console.print(
            f"  {bits}-bit {name:15s} ppl {q['ppl']:10.3f} ({row['rel_change_pct']:+8.3f}%)  KL {kl:.3e}  |rowsum-1| "
            f"{a['mean_abs_rowsum_err']:.5f} (uncorr. {a['mean_abs_rowsum_err_uncorrected']:.5f})  zero "
            f"{100 * a['zero_fraction']:5.1f}%   calib {calib_s:.1f} s, eval {q['eval_s']:.1f} s")
        self.bar("", overall=True)
        return row

    def __call__(self) -> dict[str, Any]:
        import torch

        d, cfg = self.data, self.cfg
        self.console.print(
            f"[bold]{self.label}[/] ({self.ck}): {self.n_layer} layers x {self.n_head} heads, windows of "
            f"{d['seq_len']} tokens ({d['corpus']}); {d['eval'].shape[0]} of {d['n_heldout_total']} held-out windows "
            f"({len(self.ev)} batches; row-sum / zero statistics over the first {self.n_stats}), "
            f"{d['calib'].shape[0]} calibration windows ({len(self.calib)} batches)")
        self.baseline()
        rows = [self.setting(bits, *s) for bits in cfg.bits for s in cfg.settings]
        with torch.no_grad():  # quantize_softmax works on a deep copy: the fp32 model must be untouched
            again = self.model(input_ids=self.ev[0].to(cfg.device)).logits.float().cpu()
        moved = float((again - self.fp_logits0).abs().max())
        if moved > 1e-6:
            raise SanityError(f"{self.label}: the fp32 model changed while quantizing copies of it (logits moved "
                              f"by {moved:g})")
        return {"label": self.label, "path": str(self.ck), "n_layer": self.n_layer, "n_head": self.n_head,
                "n_positions": int(self.model.config.n_positions), "seq_len": d["seq_len"], "corpus": d["corpus"],
                "demo_settings": d["demo_settings"], "results_json": d["results_json"],
                "eval_windows": int(d["eval"].shape[0]), "heldout_windows_total": d["n_heldout_total"],
                "eval_tokens": self.fp["tokens"], "calib_windows": int(d["calib"].shape[0]),
                "stats_batches": self.n_stats, "calibration_forward_kwargs": sorted(self.calib_kw),
                "sites": self.keys, "fp32": self.fp, "hf_loss_batch0": self.hf_loss, "rows": rows}


def checkpoints(cfg: Config, args, console) -> list[tuple[Path, str]]:
    """(folder, label) of each --checkpoint, trained first when missing and asked to."""
    out = []
    for i, p in enumerate(cfg.checkpoints):
        ck = checkpoint_dir(p)
        if ck is None:
            if not args.train_if_missing:
                raise SystemExit(f"no checkpoint at {p} (neither {p}/config.json nor {p}/checkpoint/config.json); "
                                 "pass --train-if-missing to train it with `smx demo`")
            ck = train_missing(p, i, args.train_args, console)
        out.append((ck, label_of(ck)))
    if len({lb for _, lb in out}) != len(out):
        out = [(ck, f"{lb}#{i}") for i, (ck, lb) in enumerate(out)]
    return out


def run_all(ckpts: list[tuple[Path, str]], cfg: Config, console, show_progress: bool) -> list[dict[str, Any]]:
    progress, task = None, {}
    try:
        if show_progress:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                TimeElapsedColumn(), console=console, transient=True)
            progress.start()
            task["overall"] = progress.add_task("all", total=len(ckpts) * (1 + len(cfg.bits) * len(cfg.settings)))
            task["batches"] = progress.add_task("batches", total=1)
        return [Run(ck, lb, cfg, console, progress, task)() for ck, lb in ckpts]
    finally:
        if progress is not None:
            progress.stop()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.replot:
        if not args.plot:
            parser.error("--replot needs --plot FILE")
        replot(args.replot, args.plot)
        print(f"wrote {args.plot}")
        return 0
    if not args.checkpoint:
        parser.error("--checkpoint DIR is required")
    cfg = resolve(args)
    from rich.console import Console

    console = Console(soft_wrap=True)
    command = common.command_line(argv, None if argv is None else "benchmarks/eval_quant_softmax.py")
    console.print(f"command: {command}")
    if args.quick and len(args.checkpoint) > 1:
        console.print("[yellow]--quick: evaluating the first checkpoint only[/]")
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        import transformers
    except ImportError:
        raise SystemExit("transformers is required: pip install -e '.[demo]'") from None
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    ckpts = checkpoints(cfg, args, console)
    env = common.environment(packages=("transformers", "tokenizers"), git=True)  # the state measured at
    t_start = time.perf_counter()
    try:
        results = run_all(ckpts, cfg, console, not args.no_progress)
    except SanityError as e:
        console.print(f"[bold red]SANITY CHECK FAILED[/]: {e}")
        return 2
    total_s = time.perf_counter() - t_start
    if args.markdown:
        console.print(markdown_table(results), markup=False, highlight=False)
    else:
        console.print(rich_table(results))
    v = verdict(results, cfg)
    print_verdict(v, console)
    eval_capped = any(c["eval_windows"] < c["heldout_windows_total"] for c in results)
    if eval_capped:
        capped = ", ".join(f"{c['label']}: {c['eval_windows']} of {c['heldout_windows_total']}" for c in results)
        console.print(f"note: evaluation capped at --eval-batches {cfg.eval_batches} ({capped} held-out windows)")
    console.print(f"total {total_s:.0f} s")
    if args.json:
        env["loadavg_at_end"] = common.loadavg()
        config = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("checkpoints", "settings")}
        config.update(checkpoints=[str(p) for p in cfg.checkpoints],
                      settings=[{"name": n, "correction": c if c else None, "granularity": g if c else None}
                                for n, c, g in cfg.settings])
        doc = {"command": command, "environment": env, "config": config, "eval_capped": eval_capped,
               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "checkpoints": [{k: val for k, val in c.items() if k != "rows"} for c in results],
               "results": [r for c in results for r in c["rows"]], "table_markdown": markdown_table(results),
               "verdict": v, "total_s": total_s}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=2, default=str) + "\n")
        console.print(f"wrote {args.json}")
    if args.plot:
        try:
            plot(results, cfg, args.plot)
            console.print(f"wrote {args.plot}")
        except ImportError:
            console.print("[yellow]matplotlib is not installed: no plot (pip install -e '.[bench]')[/]")
    console.print(f"command: {command}")
    goals = (v["goal_8bit_within_1pct"].get("met"), v["goal_correction_beats_none"].get("met"))
    return 1 if args.strict and False in goals else 0


if __name__ == "__main__":
    sys.exit(main())
