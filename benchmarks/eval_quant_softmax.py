#!/usr/bin/env python
"""Held-out perplexity of a GPT-2 whose attention softmax is quantized, with and without the bias correction.

What is measured
  ``smxcompile.quantize_softmax`` replaces every attention softmax of a model by
  ``dequantize(quantize(softmax(x)))`` (uniform, ``--bits`` bits, step = largest calibration
  probability / (2^bits - 1)). Uniform quantization rounds the many small probabilities of a row
  to zero, so a quantized row sums to less than one: a *bias* ("Softmax Bias Correction for
  Quantized Generative Models", Pandey et al., 2023). The correction is measured offline on
  calibration data and folded into the dequantization parameters. This script measures what that
  does to a real language model:

  * perplexity = exp(mean next-token NLL) over the held-out windows of the checkpoint's training
    corpus (every 20th window, never trained on), the loss computed here from the logits with
    ``torch.nn.functional.cross_entropy`` in fp64 (tokens 1..T-1 of each window predicted from
    the tokens before them);
  * for each bit width (``--bits``, default 8, 6, 4) and each of six settings:
      none             quantized, no correction (the baseline)
      offset/head      correction="offset", granularity="head"     (+ beta per head on unmasked entries; default)
      offset/tensor    correction="offset", granularity="tensor"   (one beta per layer)
      offset/position  correction="offset", granularity="position" (one beta per head and query position)
      scale/head       correction="scale",  granularity="head"     (dequantization scale * gamma per head)
      scale/tensor     correction="scale",  granularity="tensor"
    the perplexity, its change relative to fp32 (%), the KL divergence of the next-token
    distributions from the fp32 model's (nats per token, over the statistics batches: how far the
    quantized model's predictions moved, without perplexity's chance gains), the mean |row sum - 1|
    of the probabilities the attention layers used, and the zero fraction (the share of unmasked
    probabilities quantized to zero: the diagnostic behind the bias).

How
  Checkpoints are those of ``smx demo`` (``<out>/checkpoint``: safetensors + config +
  tokenizer.json, next to ``<out>/results.json``). The corpus, window length and held-out split
  are rebuilt exactly as ``smx demo`` built them (smx_app.demo: load_corpus, make_windows,
  split_windows) with the checkpoint's own tokenizer. Calibration uses ``--calib-batches`` batches
  of ``--batch-size`` *training* windows (a seeded random sample); evaluation uses the held-out
  windows (all of them unless ``--eval-batches`` caps it); the row-sum error and zero fraction are
  collected over the first ``--stats-batches`` of them (collecting costs a forward's worth of fp64
  work per batch; 4 batches are ~65K attention rows). Every quantized model is a fresh
  ``quantize_softmax`` call on the fp32 model (its own calibration), so the figures include the
  calibration noise a user would see.

  Sanity checks (the run stops with exit status 2 when one fails): the loss computed here matches
  transformers' own loss; the number of quantized sites equals the number of attention layers;
  every site saw rows during evaluation; quantized logits differ from fp32 and the quantized
  model with ``.disabled()`` reproduces fp32 exactly; the fp32 model is unchanged at the end.

The goal (printed as a verdict)
  1. with a correction, the 8-bit perplexity is within 1% of fp32 (on every checkpoint);
  2. a correction beats no correction (lower perplexity) at every bit width on every checkpoint;
  and, printed beside them, fidelity: a correction's KL to the fp32 model is below no correction's.
  The verdict names each correction form / granularity that meets each goal and each that does
  not. The exit status is 0 whatever the verdict (1 with --strict when a goal is missed by every
  correction setting).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from smx_app.argtypes import nonneg_int, positive_int

SETTINGS: list[tuple[str, Any, str]] = [
    ("none", False, "tensor"),
    ("offset/head", "offset", "head"),
    ("offset/tensor", "offset", "tensor"),
    ("offset/position", "offset", "position"),
    ("scale/head", "scale", "head"),
    ("scale/tensor", "scale", "tensor"),
]
SETTING_NAMES = [s[0] for s in SETTINGS]
GOAL_8BIT_PCT = 1.0

EPILOG = """\
examples:
  # the figures of docs/PERFORMANCE.md ("Quantized softmax"): two demo checkpoints
  python benchmarks/eval_quant_softmax.py --checkpoint /tmp/ckpt/seed0/checkpoint \\
      --checkpoint /tmp/ckpt/seed1/checkpoint --markdown \\
      --json docs/bench_quant_softmax.json --plot docs/quant_softmax.png
  # from scratch: train the checkpoints first (smx demo --small --backends eager --seed S, ~1-2 min each)
  python benchmarks/eval_quant_softmax.py --checkpoint runs/seed0 --checkpoint runs/seed1 --train-if-missing
  # smoke run (< 1 min): one checkpoint, 2 calibration and 2 evaluation batches, bits 8 and 4
  python benchmarks/eval_quant_softmax.py --checkpoint runs/seed0 --quick

checkpoint directories:
  Either a demo --out directory or its checkpoint/ subdirectory. The window length and corpus are
  read from the demo's results.json (next to checkpoint/); without it they default to
  config.n_positions and the demo's default corpus (override with --seq-len / --corpus).
  --train-if-missing trains a missing one with `smx demo --small --backends eager --seed S --out DIR`,
  S from a 'seed<N>' part of the path, else the checkpoint's position in the list.
"""


class SanityError(RuntimeError):
    """A check that the measurement is what it claims to be failed."""


# --------------------------------------------------------------------------- options


def _bits_list(text: str) -> list[int]:
    try:
        bits = [int(b) for b in text.split(",") if b.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--bits must be comma-separated integers, got {text!r}") from None
    if not bits or any(not 2 <= b <= 8 for b in bits):
        raise argparse.ArgumentTypeError(f"--bits must list integers in 2..8, got {text!r}")
    return sorted(set(bits), reverse=True)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="eval_quant_softmax.py", description=__doc__.split("\n", 2)[2] if __doc__ else None,
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", action="append", type=Path, metavar="DIR",
                   help="an `smx demo` checkpoint (repeat for several; --quick uses the first only)")
    p.add_argument("--bits", type=_bits_list, default=None, metavar="LIST",
                   help="bit widths, comma-separated (default: 8,6,4; with --quick: 8,4)")
    p.add_argument("--settings", default=",".join(SETTING_NAMES), metavar="LIST",
                   help=f"which settings to run, comma-separated (default: all: {','.join(SETTING_NAMES)})")
    p.add_argument("--calib-batches", type=positive_int, default=None, metavar="N",
                   help="calibration batches of training windows (default: 8; with --quick: 2)")
    p.add_argument("--eval-batches", type=nonneg_int, default=None, metavar="N",
                   help="held-out batches to evaluate, 0 = every held-out window (default: 0; with --quick: 2)")
    p.add_argument("--stats-batches", type=nonneg_int, default=4, metavar="N",
                   help="held-out batches over which the row-sum error and zero fraction are collected, 0 = all "
                        "(collecting costs about one extra forward per batch; perplexity always uses every "
                        "evaluated batch) (default: 4)")
    p.add_argument("--batch-size", type=positive_int, default=8, metavar="B", help="windows per batch (default: 8)")
    p.add_argument("--calib-seed", type=int, default=0, help="seed of the calibration sample (default: 0)")
    p.add_argument("--seq-len", type=positive_int, default=None, metavar="T",
                   help="window length (default: the demo's, from results.json, else config.n_positions)")
    p.add_argument("--corpus", default=None, help="demo corpus name (default: the demo's, from results.json)")
    p.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    p.add_argument("--threads", type=positive_int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: first checkpoint only, 2 calibration + 2 evaluation batches, bits 8,4 "
                        "(explicit options still win)")
    p.add_argument("--markdown", action="store_true", help="print the results as a Markdown table")
    p.add_argument("--json", type=Path, default=None, metavar="FILE", help="write every figure and the environment as JSON")
    p.add_argument("--plot", type=Path, default=None, metavar="FILE", help="write a plot (matplotlib, PNG)")
    p.add_argument("--replot", type=Path, default=None, metavar="JSON",
                   help="only redraw --plot from an earlier --json file (no evaluation)")
    p.add_argument("--train-if-missing", action="store_true",
                   help="train a missing checkpoint with `smx demo --small --backends eager --seed S --out DIR` first")
    p.add_argument("--train-args", default="", metavar="STR",
                   help="extra `smx demo` options for --train-if-missing, one string: --train-args='--quick --steps 20'")
    p.add_argument("--strict", action="store_true", help="exit 1 when a goal is met by no correction setting")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


@dataclasses.dataclass
class Config:
    checkpoints: list[Path]
    bits: list[int]
    settings: list[tuple[str, Any, str]]
    calib_batches: int
    eval_batches: int
    stats_batches: int
    batch_size: int
    calib_seed: int
    seq_len: int | None
    corpus: str | None
    device: str
    quick: bool


def resolve(args: argparse.Namespace) -> Config:
    q = args.quick
    names = [s.strip() for s in args.settings.split(",") if s.strip()]
    unknown = [n for n in names if n not in SETTING_NAMES]
    if unknown or not names:
        raise SystemExit(f"--settings: unknown {unknown}; choose from {SETTING_NAMES}")
    ckpts = list(args.checkpoint)
    if q and len(ckpts) > 1:
        ckpts = ckpts[:1]
    return Config(
        checkpoints=ckpts,
        bits=args.bits or ([8, 4] if q else [8, 6, 4]),
        settings=[s for s in SETTINGS if s[0] in names],
        calib_batches=args.calib_batches or (2 if q else 8),
        eval_batches=args.eval_batches if args.eval_batches is not None else (2 if q else 0),
        stats_batches=args.stats_batches,
        batch_size=args.batch_size,
        calib_seed=args.calib_seed,
        seq_len=args.seq_len,
        corpus=args.corpus,
        device=args.device,
        quick=q,
    )


# --------------------------------------------------------------------------- checkpoints and data


def checkpoint_dir(path: Path) -> Path | None:
    """The folder holding config.json: ``path`` itself or ``path/checkpoint``; None when neither."""
    if (path / "config.json").is_file():
        return path
    if (path / "checkpoint" / "config.json").is_file():
        return path / "checkpoint"
    return None


def label_of(path: Path) -> str:
    p = path.resolve()
    return p.parent.name if p.name == "checkpoint" else p.name


def train_missing(path: Path, index: int, extra: str, console) -> Path:
    """Run ``smx demo --small --backends eager --seed S --out OUT`` so that ``path`` becomes a checkpoint (the
    128-token configuration the figures in docs/PERFORMANCE.md were taken on)."""
    out = path.parent if path.name == "checkpoint" else path
    m = re.search(r"seed(\d+)", str(path))
    seed = int(m.group(1)) if m else index
    extra_args = shlex.split(extra)
    small = [] if "--quick" in extra_args else ["--small"]  # (--quick is its own configuration)
    cmd = [sys.executable, "-m", "smx_app.cli", "demo", *small, "--backends", "eager", "--seed", str(seed),
           "--out", str(out), *extra_args]
    console.print(f"[bold]training missing checkpoint[/]: {shlex.join(cmd)}")
    t0 = time.perf_counter()
    rc = subprocess.run(cmd).returncode
    ck = checkpoint_dir(path)
    if rc not in (0, 1) or ck is None:  # 1 = a backend disagreed; with eager alone it does not happen
        raise SystemExit(f"`smx demo` failed (exit {rc}) and left no checkpoint in {out}")
    console.print(f"trained in {time.perf_counter() - t0:.0f} s: {ck}")
    return ck


def demo_settings(ck: Path) -> dict[str, Any]:
    for cand in (ck.parent / "results.json", ck / "results.json"):
        if cand.is_file():
            try:
                return dict(json.loads(cand.read_text()).get("settings") or {}) | {"_results": str(cand)}
            except (OSError, ValueError):
                pass
    return {}


_CORPUS_CACHE: dict[str, list[str]] = {}


def load_data(ck: Path, cfg: Config, n_positions: int, console) -> dict[str, Any]:
    import torch
    from tokenizers import Tokenizer

    from smx_app import demo

    ds = demo_settings(ck)
    seq_len = cfg.seq_len or ds.get("seq_len")
    corpus = cfg.corpus or ds.get("corpus")
    if seq_len is None or corpus is None:
        console.print(f"[yellow]warning[/]: no results.json next to {ck}: window length "
                      f"{seq_len or n_positions} and corpus {corpus or demo.DEFAULTS['corpus']!r} are guesses "
                      "(--seq-len / --corpus set them)")
    seq_len = int(seq_len or n_positions)
    corpus = str(corpus or demo.DEFAULTS["corpus"])
    if seq_len > n_positions:
        raise SystemExit(f"window length {seq_len} exceeds the model's n_positions {n_positions}")
    tok_file = ck / "tokenizer.json"
    if not tok_file.is_file():
        raise SystemExit(f"{tok_file} not found: the evaluation needs the checkpoint's own tokenizer")
    tok = Tokenizer.from_file(str(tok_file))
    if corpus not in _CORPUS_CACHE:
        _CORPUS_CACHE[corpus] = demo.load_corpus(corpus)
    windows = demo.make_windows(tok, _CORPUS_CACHE[corpus], seq_len)
    train, held = demo.split_windows(windows)
    g = torch.Generator().manual_seed(cfg.calib_seed)
    n_cal = min(cfg.calib_batches * cfg.batch_size, train.shape[0])
    calib = train[torch.randperm(train.shape[0], generator=g)[:n_cal]]
    n_eval = held.shape[0] if cfg.eval_batches == 0 else min(held.shape[0], cfg.eval_batches * cfg.batch_size)
    if n_eval == 0:
        raise SystemExit(f"{ck}: no held-out windows (corpus {corpus!r}, windows of {seq_len})")
    return {"seq_len": seq_len, "corpus": corpus, "demo_settings": {k: v for k, v in ds.items() if not k.startswith("_")},
            "results_json": ds.get("_results"), "calib": calib, "eval": held[:n_eval],
            "n_heldout_total": int(held.shape[0]), "n_train_windows": int(train.shape[0]),
            "vocab": tok.get_vocab_size()}


def batches(t, bs: int) -> list:
    return [t[i:i + bs] for i in range(0, t.shape[0], bs)]


# --------------------------------------------------------------------------- measuring


def nll_sum(logits, ids) -> tuple[float, int]:
    """Summed next-token NLL (fp64) of ``ids`` under ``logits`` and the number of predicted tokens."""
    import torch.nn.functional as F

    lg = logits[:, :-1].double()
    tgt = ids[:, 1:]
    return float(F.cross_entropy(lg.reshape(-1, lg.shape[-1]), tgt.reshape(-1), reduction="sum")), int(tgt.numel())


def window_nll(logits, ids):
    """Per window: the summed next-token NLL (fp64), a ``(batch,)`` tensor."""
    import torch.nn.functional as F

    lg = logits[:, :-1].double()
    tgt = ids[:, 1:]
    return F.cross_entropy(lg.reshape(-1, lg.shape[-1]), tgt.reshape(-1), reduction="none").view(tgt.shape).sum(1)


def paired_ci(w, w_ref, tokens_per_window: int, n_boot: int = 2000, seed: int = 0) -> list[float]:
    """95% paired-bootstrap interval (over the evaluated windows) of the perplexity change of ``w``
    against ``w_ref`` (per-window NLL sums of the same windows), in %."""
    import numpy as np

    d = (w - w_ref).cpu().numpy()
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, d.shape[0], size=(n_boot, d.shape[0]))
    rel = np.expm1(d[idx].sum(1) / (d.shape[0] * tokens_per_window)) * 100.0
    return [float(np.percentile(rel, 2.5)), float(np.percentile(rel, 97.5))]


def evaluate(model, eval_batches: list, device: str, advance=None, collect_batches: int = 0) -> dict[str, Any]:
    """Perplexity of ``model`` over ``eval_batches`` and the logits of the first batch. On a quantized
    model with ``collect_batches``, its statistics (``.collecting()``) are gathered over that many
    leading batches (collecting costs about one extra forward's worth of fp64 work per batch)."""
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
    vals = [s.correction.detach().float().cpu() for s in qs.sites.values()]
    if not vals:
        return {}
    import torch

    allv = torch.cat([v.reshape(-1) for v in vals])
    return {"min": float(allv.min()), "max": float(allv.max()),
            "per_site": {k: [float(x) for x in s.correction.reshape(-1)] for k, s in qs.sites.items()},
            "scale": {k: float(s.scale) for k, s in qs.sites.items()}}


def run_checkpoint(ck: Path, label: str, cfg: Config, console, progress, task) -> dict[str, Any]:
    import torch
    from transformers import GPT2LMHeadModel

    from smxcompile.edit.quantize import quantize_softmax

    model = GPT2LMHeadModel.from_pretrained(ck, attn_implementation="eager").to(cfg.device).eval()
    n_layer, n_head = int(model.config.n_layer), int(model.config.n_head)
    data = load_data(ck, cfg, int(model.config.n_positions), console)
    if data["vocab"] > model.config.vocab_size:
        raise SanityError(f"{ck}: tokenizer vocabulary {data['vocab']} exceeds the model's {model.config.vocab_size}")
    ev = batches(data["eval"], cfg.batch_size)
    n_stats = len(ev) if cfg.stats_batches == 0 else min(len(ev), cfg.stats_batches)
    import inspect

    calib_kw = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    calib = [{"input_ids": b.to(cfg.device), **calib_kw} for b in batches(data["calib"], cfg.batch_size)]
    console.print(f"[bold]{label}[/] ({ck}): {n_layer} layers x {n_head} heads, windows of {data['seq_len']} tokens "
                  f"({data['corpus']}); {data['eval'].shape[0]} of {data['n_heldout_total']} held-out windows "
                  f"({len(ev)} batches; row-sum / zero statistics over the first {n_stats}), "
                  f"{data['calib'].shape[0]} calibration windows ({len(calib)} batches)")

    def adv():
        if progress is not None:
            progress.advance(task["batches"])

    def start(desc: str, total: int):
        if progress is not None:
            progress.reset(task["batches"], total=total, description=desc)

    # fp32 baseline, and the loss checked against transformers' own
    start(f"{label} fp32", len(ev))
    fp = evaluate(model, ev, cfg.device, adv)
    with torch.no_grad():
        b0 = ev[0].to(cfg.device)
        hf_loss = float(model(input_ids=b0, labels=b0).loss)
    s0, k0 = nll_sum(fp["first_logits"].to(cfg.device), b0)
    if not math.isclose(s0 / k0, hf_loss, rel_tol=1e-4):
        raise SanityError(f"{label}: NLL computed here {s0 / k0:.6f} != transformers' loss {hf_loss:.6f} on batch 0")
    fp_logits0 = fp.pop("first_logits")
    fp_w = fp.pop("window_nll")
    tpw = data["seq_len"] - 1
    none_w: dict[int, Any] = {}
    console.print(f"  fp32: perplexity {fp['ppl']:.3f} (NLL {fp['nll']:.5f} over {fp['tokens']} tokens, "
                  f"{fp['eval_s']:.1f} s)")
    if progress is not None:
        progress.advance(task["overall"])

    # fp32 next-token log-probabilities of the statistics batches: the KL of each setting to them
    with torch.no_grad():
        ref_lp = [model(input_ids=b.to(cfg.device)).logits.float().log_softmax(-1).cpu() for b in ev[:n_stats]]

    def kl_to_fp32(qm) -> float:
        """Mean KL(fp32 || quantized) of the next-token distributions over the statistics batches (nats/token)."""
        tot, n = 0.0, 0
        with torch.no_grad():
            for b, r in zip(ev[:n_stats], ref_lp):
                lq = qm(input_ids=b.to(cfg.device)).logits.double().log_softmax(-1).cpu()
                r = r.double()
                tot += float((r.exp() * (r - lq)).sum())
                n += r.shape[0] * r.shape[1]
        return tot / n

    rows: list[dict[str, Any]] = []
    keys: list[str] | None = None
    checked_disabled = False
    for bits in cfg.bits:
        for name, corr, gran in cfg.settings:
            start(f"{label} {bits}-bit {name}: calibrating", len(ev))
            t0 = time.perf_counter()
            qm = quantize_softmax(model, calib, bits=bits, where=keys if keys is not None else "attention",
                                  correction=corr, granularity=gran, progress=False)
            calib_s = time.perf_counter() - t0
            qs = qm.smx_softmax_quant
            if keys is None:
                keys = list(qs.sites)
                kinds = {k: s.kind for k, s in qs.sites.items()}
                if len(keys) != n_layer or any(k != "attention" for k in kinds.values()):
                    raise SanityError(f"{label}: expected {n_layer} attention sites (one per layer), quantize_softmax "
                                      f"chose {kinds}; skipped: {qs.skipped}")
                console.print(f"  sites: {', '.join(keys)}")
            if len(qs.sites) != n_layer:
                raise SanityError(f"{label}: {len(qs.sites)} quantized sites, {n_layer} attention layers")
            if progress is not None:
                progress.update(task["batches"], description=f"{label} {bits}-bit {name}: evaluating")
            q = evaluate(qm, ev, cfg.device, adv, collect_batches=n_stats)
            stats = qs.stats()
            kl = kl_to_fp32(qm)
            ql = q.pop("first_logits")
            qw = q.pop("window_nll")
            if corr is False:
                none_w[bits] = qw
            diff = float((ql - fp_logits0).abs().max())
            if not diff > 0 or q["ppl"] == fp["ppl"]:
                raise SanityError(f"{label} {bits}-bit {name}: quantized logits equal fp32 (max |diff| {diff:g}, "
                                  f"perplexity {q['ppl']} vs {fp['ppl']}): nothing was quantized")
            for k in keys:
                if not stats.get(k, {}).get("rows"):
                    raise SanityError(f"{label} {bits}-bit {name}: site {k} saw no rows during evaluation")
            if corr is False and not math.isclose(stats["all"]["mean_abs_rowsum_err"],
                                                  stats["all"]["mean_abs_rowsum_err_uncorrected"], rel_tol=1e-5):
                raise SanityError(f"{label} {bits}-bit none: corrected and uncorrected row-sum errors differ "
                                  f"without a correction: {stats['all']}")
            if not checked_disabled:
                with torch.no_grad(), qs.disabled():
                    dl = qm(input_ids=ev[0].to(cfg.device)).logits.float().cpu()
                dd = float((dl - fp_logits0).abs().max())
                if dd > 1e-5:
                    raise SanityError(f"{label}: the quantized model with .disabled() differs from fp32 by {dd:g}")
                checked_disabled = True
            a = stats["all"]
            row = {
                "checkpoint": label, "path": str(ck), "bits": bits, "setting": name,
                "correction": corr if corr else None, "granularity": gran if corr else None,
                "ppl": q["ppl"], "nll": q["nll"], "fp32_ppl": fp["ppl"],
                "rel_change_pct": 100.0 * (q["ppl"] / fp["ppl"] - 1.0),
                "rel_change_ci95_pct": paired_ci(qw, fp_w, tpw),
                "vs_none_pct": 100.0 * (math.exp((float(qw.sum()) - float(none_w[bits].sum())) / q["tokens"]) - 1.0)
                if bits in none_w else None,
                "vs_none_ci95_pct": paired_ci(qw, none_w[bits], tpw) if bits in none_w and corr else None,
                "kl_to_fp32": kl,
                "mean_abs_rowsum_err": a["mean_abs_rowsum_err"],
                "mean_abs_rowsum_err_uncorrected": a["mean_abs_rowsum_err_uncorrected"],
                "mean_rowsum": a["mean_rowsum"], "zero_fraction": a["zero_fraction"],
                "max_abs_logit_diff_batch0": diff, "calib_s": calib_s, "eval_s": q["eval_s"],
                "per_site": {k: v for k, v in stats.items() if k != "all"},
                "correction_values": correction_range(qs) if corr else None,
            }
            rows.append(row)
            console.print(f"  {bits}-bit {name:15s} ppl {q['ppl']:10.3f} ({row['rel_change_pct']:+8.3f}%)  KL {kl:.3e}  "
                          f"|rowsum-1| {a['mean_abs_rowsum_err']:.5f} (uncorr. {a['mean_abs_rowsum_err_uncorrected']:.5f})  "
                          f"zero {100 * a['zero_fraction']:5.1f}%   calib {calib_s:.1f} s, eval {q['eval_s']:.1f} s")
            del qm, qs
            if progress is not None:
                progress.advance(task["overall"])

    # the fp32 model must be untouched by quantize_softmax (it works on a deep copy)
    with torch.no_grad():
        again = model(input_ids=ev[0].to(cfg.device)).logits.float().cpu()
    moved = float((again - fp_logits0).abs().max())
    if moved > 1e-6:
        raise SanityError(f"{label}: the fp32 model changed while quantizing copies of it (logits moved by {moved:g})")
    return {
        "label": label, "path": str(ck), "n_layer": n_layer, "n_head": n_head, "n_positions": int(model.config.n_positions),
        "seq_len": data["seq_len"], "corpus": data["corpus"], "demo_settings": data["demo_settings"],
        "results_json": data["results_json"], "eval_windows": int(data["eval"].shape[0]),
        "heldout_windows_total": data["n_heldout_total"], "eval_tokens": fp["tokens"],
        "calib_windows": int(data["calib"].shape[0]), "stats_batches": n_stats, "calibration_forward_kwargs": sorted(calib_kw),
        "sites": keys, "fp32": fp, "hf_loss_batch0": hf_loss, "rows": rows,
    }


# --------------------------------------------------------------------------- verdict and outputs


def verdict(results: list[dict[str, Any]], cfg: Config) -> dict[str, Any]:
    rows = [r for c in results for r in c["rows"]]
    by = {(r["checkpoint"], r["bits"], r["setting"]): r for r in rows}
    labels = [c["label"] for c in results]
    corrected = [s[0] for s in cfg.settings if s[1]]
    out: dict[str, Any] = {}
    # goal 1
    g1: dict[str, Any] = {"goal": f"with a correction, 8-bit perplexity within {GOAL_8BIT_PCT:g}% of fp32 on every checkpoint"}
    if 8 in cfg.bits:
        per = {}
        for name in [s[0] for s in cfg.settings]:
            rel = {lb: by[(lb, 8, name)]["rel_change_pct"] for lb in labels}
            per[name] = {"met": all(abs(v) <= GOAL_8BIT_PCT for v in rel.values()), "rel_change_pct": rel,
                         "rel_change_ci95_pct": {lb: by[(lb, 8, name)].get("rel_change_ci95_pct") for lb in labels}}
        g1["per_setting"] = per
        g1["met_by"] = [n for n in corrected if per[n]["met"]]
        g1["missed_by"] = [n for n in corrected if not per[n]["met"]]
        g1["met"] = bool(g1["met_by"])
        g1["uncorrected_also_within"] = per.get("none", {}).get("met")
    else:
        g1["met"] = None
        g1["note"] = "8 not in --bits: not evaluated"
    out["goal_8bit_within_1pct"] = g1
    # goal 2
    g2: dict[str, Any] = {"goal": "a correction gives lower perplexity than no correction at every bit width, on every checkpoint"}
    if "none" in [s[0] for s in cfg.settings] and corrected:
        per = {}
        for name in corrected:
            fails, margins, cis, clear = [], {}, {}, []
            for lb in labels:
                for bits in cfg.bits:
                    r, n = by[(lb, bits, name)], by[(lb, bits, "none")]
                    margins[f"{lb}/{bits}"] = 100.0 * (r["ppl"] / n["ppl"] - 1.0)
                    cis[f"{lb}/{bits}"] = r.get("vs_none_ci95_pct")
                    if r.get("vs_none_ci95_pct") and r["vs_none_ci95_pct"][1] < 0:
                        clear.append(f"{lb}/{bits}")
                    if not r["ppl"] < n["ppl"]:
                        fails.append({"checkpoint": lb, "bits": bits, "ppl": r["ppl"], "ppl_none": n["ppl"]})
            rs_fails = [f"{lb}/{bits}" for lb in labels for bits in cfg.bits
                        if not by[(lb, bits, name)]["mean_abs_rowsum_err"] < by[(lb, bits, "none")]["mean_abs_rowsum_err"]]
            per[name] = {"met": not fails, "failures": fails, "ppl_change_vs_none_pct": margins,
                         "ppl_change_vs_none_ci95_pct": cis, "better_beyond_ci95_at": clear,
                         "rowsum_err_not_lower_at": rs_fails}
        g2["per_setting"] = per
        g2["met_by"] = [n for n in corrected if per[n]["met"]]
        g2["missed_by"] = [n for n in corrected if not per[n]["met"]]
        g2["met"] = bool(g2["met_by"])
    else:
        g2["met"] = None
        g2["note"] = "needs 'none' and at least one correction setting"
    out["goal_correction_beats_none"] = g2
    # fidelity: the KL of the next-token distributions to the fp32 model (less noisy than perplexity,
    # which a quantized model can also improve by chance)
    g3: dict[str, Any] = {"goal": "a correction gives a lower KL to the fp32 model than no correction at every bit width, "
                                  "on every checkpoint"}
    if "none" in [s[0] for s in cfg.settings] and corrected:
        per = {}
        for name in corrected:
            fails = [f"{lb}/{bits}" for lb in labels for bits in cfg.bits
                     if not by[(lb, bits, name)]["kl_to_fp32"] < by[(lb, bits, "none")]["kl_to_fp32"]]
            ratio = {f"{lb}/{bits}": by[(lb, bits, name)]["kl_to_fp32"] / by[(lb, bits, "none")]["kl_to_fp32"]
                     for lb in labels for bits in cfg.bits}
            per[name] = {"met": not fails, "not_lower_at": fails, "kl_ratio_to_none": ratio}
        g3["per_setting"] = per
        g3["met_by"] = [n for n in corrected if per[n]["met"]]
        g3["missed_by"] = [n for n in corrected if not per[n]["met"]]
        g3["met"] = bool(g3["met_by"])
    else:
        g3["met"] = None
    out["kl_correction_beats_none"] = g3
    # the best setting per bit width (mean relative change over checkpoints)
    best = {}
    for bits in cfg.bits:
        mean = {s[0]: sum(by[(lb, bits, s[0])]["rel_change_pct"] for lb in labels) / len(labels) for s in cfg.settings}
        order = sorted(mean, key=mean.get)
        best[str(bits)] = {"ranking": order, "mean_rel_change_pct": mean}
    out["ranking_by_bits"] = best
    return out


def print_verdict(v: dict[str, Any], console) -> None:
    console.rule("verdict")
    g1 = v["goal_8bit_within_1pct"]
    if g1.get("met") is None:
        console.print(f"goal 1 ({g1['goal']}): {g1.get('note')}")
    else:
        mark = "[green]MET[/]" if g1["met"] else "[red]NOT MET[/]"
        console.print(f"goal 1 ({g1['goal']}): {mark}")
        for name, d in g1["per_setting"].items():
            ci = d["rel_change_ci95_pct"]
            rel = ", ".join(f"{lb} {x:+.3f}%" + (f" [{ci[lb][0]:+.3f}, {ci[lb][1]:+.3f}]" if ci.get(lb) else "")
                            for lb, x in d["rel_change_pct"].items())
            tag = "meets" if d["met"] else "misses"
            console.print(f"  {name:15s} {tag:6s} ({rel})" + ("  [dim](no correction: reference)[/]" if name == "none" else ""))
        if g1.get("uncorrected_also_within"):
            console.print("  note: the uncorrected 8-bit model is within the bound too: this goal does not "
                          "separate the corrections from no correction on these checkpoints")
    g2 = v["goal_correction_beats_none"]
    if g2.get("met") is None:
        console.print(f"goal 2 ({g2['goal']}): {g2.get('note')}")
    else:
        mark = "[green]MET[/]" if g2["met"] else "[red]NOT MET[/]"
        console.print(f"goal 2 ({g2['goal']}): {mark}   [dim](perplexity change vs none per checkpoint/bits, "
                      "[95% paired bootstrap over held-out windows])[/]")
        for name, d in g2["per_setting"].items():
            ci = d["ppl_change_vs_none_ci95_pct"]
            m = ", ".join(f"{k} {x:+.3f}%" + (f" [{ci[k][0]:+.3f}, {ci[k][1]:+.3f}]" if ci.get(k) else "")
                          for k, x in d["ppl_change_vs_none_pct"].items())
            if d["met"]:
                console.print(f"  {name:15s} meets   (perplexity vs none: {m})")
            else:
                f = ", ".join(f"{x['checkpoint']}/{x['bits']}-bit {x['ppl']:.3f} >= {x['ppl_none']:.3f}" for x in d["failures"])
                console.print(f"  {name:15s} misses  at {f}  (perplexity vs none: {m})")
            n_all = len(d["ppl_change_vs_none_pct"])
            console.print(f"  {'':13s} better beyond the 95% paired-bootstrap interval at {len(d['better_beyond_ci95_at'])} "
                          f"of {n_all} checkpoint/bit-width points")
            if d["rowsum_err_not_lower_at"]:
                console.print(f"  {'':13s} mean |row sum - 1| not below none's at {', '.join(d['rowsum_err_not_lower_at'])}")
    g3 = v.get("kl_correction_beats_none", {})
    if g3.get("met") is not None:
        mark = "[green]MET[/]" if g3["met"] else "[red]NOT MET[/]"
        console.print(f"fidelity ({g3['goal']}): {mark}   [dim](KL / KL without correction per checkpoint/bits)[/]")
        for name, d in g3["per_setting"].items():
            r = ", ".join(f"{k} {x:.2f}" for k, x in d["kl_ratio_to_none"].items())
            tag = "meets " if d["met"] else "misses at " + ", ".join(d["not_lower_at"])
            console.print(f"  {name:15s} {tag}  ({r})")
    console.print("best setting per bit width (mean perplexity change vs fp32 over checkpoints):")
    for bits, d in v["ranking_by_bits"].items():
        console.print(f"  {bits}-bit: " + " < ".join(f"{n} ({d['mean_rel_change_pct'][n]:+.3f}%)" for n in d["ranking"]))


def _ci(c: list[float] | None) -> str:
    return f" [{c[0]:+.3f}, {c[1]:+.3f}]" if c else ""


def markdown_table(results: list[dict[str, Any]]) -> str:
    """One row per checkpoint x bits x setting (and the fp32 row of each checkpoint). Brackets: 95%
    paired-bootstrap intervals over the held-out windows."""
    lines = ["| checkpoint | bits | setting | perplexity | Δ vs fp32 (%) [95% CI] | Δ vs none (%) [95% CI] "
             "| KL to fp32 (nats/token) | mean abs(row sum − 1) | zero fraction |",
             "|---|---|---|---|---|---|---|---|---|"]
    for c in results:
        lines.append(f"| {c['label']} | fp32 | - | {c['fp32']['ppl']:.3f} | - | - | - | - | - |")
        for r in c["rows"]:
            vs = "-" if r["setting"] == "none" or r.get("vs_none_pct") is None else \
                f"{r['vs_none_pct']:+.3f}{_ci(r.get('vs_none_ci95_pct'))}"
            lines.append(f"| {r['checkpoint']} | {r['bits']} | {r['setting']} | {r['ppl']:.3f} | "
                         f"{r['rel_change_pct']:+.3f}{_ci(r.get('rel_change_ci95_pct'))} | {vs} | "
                         f"{r['kl_to_fp32']:.2e} | {r['mean_abs_rowsum_err']:.2e} | {100 * r['zero_fraction']:.1f}% |")
    return "\n".join(lines)


def rich_table(results: list[dict[str, Any]]):
    from rich.table import Table

    t = Table(title="quantized attention softmax: held-out perplexity")
    for col in ("checkpoint", "bits", "setting", "perplexity", "Δ vs fp32", "mean |row sum − 1|", "zero fraction"):
        t.add_column(col, justify="right" if col not in ("checkpoint", "setting") else "left")
    for c in results:
        t.add_row(c["label"], "fp32", "-", f"{c['fp32']['ppl']:.3f}", "-", "-", "-")
        for r in c["rows"]:
            t.add_row(r["checkpoint"], str(r["bits"]), r["setting"], f"{r['ppl']:.3f}", f"{r['rel_change_pct']:+.3f}%",
                      f"{r['mean_abs_rowsum_err']:.2e}", f"{100 * r['zero_fraction']:.1f}%")
    return t


def plot(results: list[dict[str, Any]], cfg: Config, path: Path) -> None:
    """Four panels vs bits: perplexity relative to fp32 (fp32 = the line at 0), KL to the fp32 model,
    mean |row sum - 1|, zero fraction. Colour: setting; line style: checkpoint; the settings are nudged apart along x so
    that equal values stay visible."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"none": "tab:gray", "scale/head": "tab:blue", "scale/tensor": "tab:cyan",
              "offset/head": "tab:red", "offset/tensor": "tab:orange", "offset/position": "tab:purple"}
    markers = {"none": "o", "scale/head": "s", "scale/tensor": "D", "offset/head": "^", "offset/tensor": "v",
               "offset/position": "P"}
    nudge = {"none": 0.0, "scale/head": -0.15, "scale/tensor": -0.1, "offset/head": 0.05, "offset/tensor": 0.1,
             "offset/position": 0.15}
    styles = ["-", "--", ":", "-."]
    style_names = ["solid", "dashed", "dotted", "dash-dot"]
    fig, axes = plt.subplots(1, 4, figsize=(22, 5.2))
    bits = sorted(cfg.bits)
    for ci, c in enumerate(results):
        ls = styles[ci % len(styles)]
        by = {(r["bits"], r["setting"]): r for r in c["rows"]}
        if ci == 0:
            axes[0].axhline(0.0, color="black", lw=1.2, label="fp32 = 0 (" + ", ".join(
                f"{x['label']}: {x['fp32']['ppl']:.1f}" for x in results) + ")")
        for name, _, _ in cfg.settings:
            xs = [b + nudge[name] for b in bits]
            kw = dict(ls=ls, marker=markers[name], color=colors[name], ms=5, lw=1.4)
            lab = f"{name} ({c['label']})"
            axes[0].plot(xs, [by[(b, name)]["rel_change_pct"] for b in bits], label=lab, **kw)
            axes[1].plot(xs, [by[(b, name)].get("kl_to_fp32", float("nan")) for b in bits], label=lab, **kw)
            axes[2].plot(xs, [by[(b, name)]["mean_abs_rowsum_err"] for b in bits], label=lab, **kw)
            axes[3].plot(xs, [100 * by[(b, name)]["zero_fraction"] for b in bits], label=lab, **kw)
    axes[0].set_yscale("symlog", linthresh=0.01)
    axes[0].set_title("held-out perplexity vs fp32 (black line: fp32)")
    axes[0].set_ylabel("perplexity change vs fp32, % (symlog: linear within ±0.01%)")
    axes[1].set_yscale("log")
    axes[1].set_title("KL(fp32 || quantized), next-token distributions")
    axes[1].set_ylabel("nats per token")
    axes[2].set_yscale("log")
    axes[2].set_title("mean |row sum − 1| of the attention probabilities")
    axes[3].set_title("unmasked probabilities quantized to zero")
    axes[3].set_ylabel("% of the unmasked entries")
    for ax in axes:
        ax.set_xlabel("bits (settings nudged apart)")
        ax.set_xticks(bits)
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(6, len(labels)), fontsize=7.5, frameon=False)
    fig.suptitle("smxcompile.quantize_softmax, attention softmax of smx-demo GPT-2 checkpoints "
                 + ", ".join(f"{c['label']} ({style_names[i % len(styles)]})" for i, c in enumerate(results))
                 + f": {results[0]['eval_tokens']} held-out tokens each")
    n_rows = -(-len(labels) // min(6, len(labels)))
    fig.tight_layout(rect=(0, 0.035 * n_rows + 0.01, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def replot(json_path: Path, plot_path: Path) -> None:
    """Redraw the plot from an earlier --json file."""
    doc = json.loads(json_path.read_text())
    results = [dict(c, rows=[r for r in doc["results"] if r["checkpoint"] == c["label"]]) for c in doc["checkpoints"]]
    names = [s["name"] for s in doc["config"]["settings"]]
    cfg = Config(checkpoints=[], bits=doc["config"]["bits"], settings=[s for s in SETTINGS if s[0] in names],
                 calib_batches=0, eval_batches=0, stats_batches=0, batch_size=0, calib_seed=0, seq_len=None,
                 corpus=None, device="cpu", quick=False)
    plot(results, cfg, plot_path)


def environment() -> dict[str, Any]:
    import torch

    env = {"python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform(),
           "cpu_count": os.cpu_count(), "threads": torch.get_num_threads()}
    for dist in ("transformers", "tokenizers", "smxcompile"):
        try:
            from importlib.metadata import version

            env[dist] = version(dist)
        except Exception:  # noqa: BLE001
            env[dist] = None
    here = Path(__file__).resolve().parent
    try:
        env["git_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                           cwd=here, timeout=10).stdout.strip() or None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "smxcompile", "benchmarks"],
                               capture_output=True, text=True, cwd=here.parent, timeout=10).stdout.split("\n")
        env["git_dirty"] = sorted(line[3:] for line in dirty if line.strip())
    except (OSError, subprocess.SubprocessError):
        env["git_commit"] = None
    try:
        env["loadavg"] = os.getloadavg()
    except OSError:
        pass
    return env


# --------------------------------------------------------------------------- main


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
    command = "python " + shlex.join([sys.argv[0] if argv is None else "benchmarks/eval_quant_softmax.py",
                                      *(sys.argv[1:] if argv is None else argv)])
    console.print(f"command: {command}")
    if args.quick and len(args.checkpoint) > 1:
        console.print("[yellow]--quick: evaluating the first checkpoint only[/]")
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
    except ImportError:
        raise SystemExit("transformers is required: pip install -e '.[demo]'") from None

    ckpts: list[tuple[Path, str]] = []
    for i, p in enumerate(cfg.checkpoints):
        ck = checkpoint_dir(p)
        if ck is None:
            if not args.train_if_missing:
                raise SystemExit(f"no checkpoint at {p} (neither {p}/config.json nor {p}/checkpoint/config.json); "
                                 "pass --train-if-missing to train it with `smx demo`")
            ck = train_missing(p, i, args.train_args, console)
        ckpts.append((ck, label_of(ck)))
    labels = [lb for _, lb in ckpts]
    if len(set(labels)) != len(labels):
        ckpts = [(ck, f"{lb}#{i}") for i, (ck, lb) in enumerate(ckpts)]

    env = environment()  # before the run: the commit and load average the figures were measured at
    t_start = time.perf_counter()
    results: list[dict[str, Any]] = []
    progress = None
    task: dict[str, Any] = {}
    try:
        if not args.no_progress:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                TimeElapsedColumn(), console=console, transient=True)
            progress.start()
            task["overall"] = progress.add_task("all", total=len(ckpts) * (1 + len(cfg.bits) * len(cfg.settings)))
            task["batches"] = progress.add_task("batches", total=1)
        for ck, lb in ckpts:
            results.append(run_checkpoint(ck, lb, cfg, console, progress, task))
    except SanityError as e:
        if progress is not None:
            progress.stop()
        console.print(f"[bold red]SANITY CHECK FAILED[/]: {e}")
        return 2
    finally:
        if progress is not None:
            progress.stop()
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
        doc = {
            "command": command,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "environment": env | {"loadavg_end": os.getloadavg() if hasattr(os, "getloadavg") else None},
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(cfg).items()
                       if k not in ("checkpoints", "settings")}
            | {"checkpoints": [str(p) for p in cfg.checkpoints],
               "settings": [{"name": n, "correction": c if c else None, "granularity": g if c else None}
                            for n, c, g in cfg.settings]},
            "eval_capped": eval_capped,
            "checkpoints": [{k: v for k, v in c.items() if k != "rows"} for c in results],
            "results": [r for c in results for r in c["rows"]],
            "table_markdown": markdown_table(results),
            "verdict": v,
            "total_s": total_s,
        }
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
    if args.strict and (v["goal_8bit_within_1pct"].get("met") is False or v["goal_correction_beats_none"].get("met") is False):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
