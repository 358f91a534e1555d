"""``smx swap`` (a variant in place of a checkpoint's softmax, calibrated / fine-tuned, perplexity compared)
and ``smx eval`` (held-out perplexity and attention statistics of a checkpoint): their commands and their
parsers, on :mod:`smx_app.lm`."""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from .argtypes import nonneg_int, positive_float, positive_int

SWAP_DESCRIPTION = """\
Replace the softmax of a trained causal language model by another normalization
(smxcompile.swap: sparsemax, entmax, softpick, SSMax, softmax1, sigmoid, ...; see
--list-variants), then optionally calibrate the variant's own parameters (--calibrate:
only they train, every weight of the model frozen) and fine-tune every weight
(--finetune). Held-out perplexity is measured before the swap, right after it, after
calibration and after fine-tuning, and printed as a table. The swapped model is saved
with save_pretrained (weights, config with the swap manifest, tokenizer) plus
results.json; `smx eval OUT` and smx_app.lm.load_lm(OUT) load it back.

CHECKPOINT is a transformers checkpoint folder with tokenizer.json, e.g. the
checkpoint/ folder `smx demo` saves (or the demo's --out folder above it). The text
is rebuilt as the demo built it: the demo's corpus cut into windows of its --seq-len
with the checkpoint's tokenizer (both read from the demo's results.json), every 20th
window held out for evaluation and never trained on."""

SWAP_EPILOG = """\
examples:
  smx swap --list-variants                     the variants: formula, parameters, start values
  smx swap smx-demo-out --variant ssmax --out runs/ssmax
                                               swap and measure (SSMax's s starts at 1/log(n_train))
  smx swap smx-demo-out --variant ssmax --calibrate 50 --out runs/ssmax-cal
                                               then 50 AdamW steps on the s of each head only
  smx swap smx-demo-out --variant softpick --calibrate 50 --finetune 200 --lr 1e-4 --out runs/softpick
                                               softpick has no learnable parameter: calibration
                                               is not applicable (said, then skipped); fine-tuning
                                               trains every weight
  smx swap smx-demo-out --variant temperature --param T=1.5 --out runs/t15
                                               start T at 1.5 (a learnable parameter's start value)
  smx swap smx-demo-out --variant softpick --param eps=1e-4 --out runs/sp
                                               a fixed parameter, used as given
  smx swap smx-demo-out --variant sparsemax --batches 4 --out runs/sparse
                                               a quick look: 4 held-out batches per measurement

outputs (in --out):
  config.json, model.safetensors   model.save_pretrained(OUT); config.json's smx_swap is the
                                   manifest (which variant at which site, parameter shapes)
  tokenizer.json, ...              copied from CHECKPOINT
  results.json                     settings, perplexity per stage, training losses, the swap
load it back: smx eval OUT, smx_app.lm.load_lm(OUT), or
  smxcompile.from_pretrained(transformers.AutoModelForCausalLM, OUT)

notes:
  perplexity = exp(mean next-token NLL in nats) over the held-out windows (all of them
  unless --batches caps it), summed in fp64. Calibration and fine-tuning draw batches of
  training windows in a seeded order (--seed). Exit status: 0 done, 1 training diverged
  (NaN loss), 2 a usage error (missing checkpoint, unknown variant or parameter).
"""

EVAL_DESCRIPTION = """\
Held-out next-token loss (nats) and perplexity of a causal language model checkpoint,
on the held-out windows of the corpus it was trained on (rebuilt as `smx demo` built
them, with the checkpoint's tokenizer and the settings of the results.json next to
it). For a swapped model (written by `smx swap`, or any save_pretrained of a model
swapped by smxcompile.swap), also the swap summary and the attention statistics of the
swapped sites against the same model computed with its original softmax: entropy of
the attention rows (nats), attention-sink mass (mean weight on the first key), row sum
and the share of exactly-zero weights."""

EVAL_EPILOG = """\
examples:
  smx eval smx-demo-out                        the demo's model (the --out folder or its checkpoint/)
  smx eval runs/ssmax                          a model written by `smx swap`
  smx eval runs/ssmax --batches 4 --json       4 held-out batches, the figures as JSON on stdout
  smx eval path/to/ckpt --seq-len 128 --corpus topics
                                               a checkpoint without the demo's results.json

notes:
  `smx swap` prints the exact `smx eval` command that reproduces its final perplexity.
  The attention statistics run over --stats-batches held-out batches (collecting them
  costs about one extra forward of fp64 work per batch). Exit status 2: a usage error.
"""


class _UsageError(Exception):
    """A bad command line or input: printed as one message, exit status 2."""


def _escape(text: str) -> str:
    """``text`` with rich markup escaped (paths and messages printed through a rich console)."""
    from rich.markup import escape

    return escape(text)


def _console(stderr: bool = False):
    from rich.console import Console

    console = Console(stderr=stderr, highlight=False)
    if not console.is_terminal:  # logs and CI: do not squeeze the tables into 80 columns
        console = Console(stderr=stderr, highlight=False, width=max(console.width, 120))
    return console


def _device(name: str) -> str:
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise _UsageError("--device cuda but CUDA is not available")
    return name


def _param_help(v) -> str:
    if not v.params:
        return "none"
    return "; ".join(f"{k} ({'learnable, start ' + s.init if s.learnable else 'fixed'}: {s.doc})"
                     for k, s in v.params.items())


def _parse_params(variant: str, items: list[str] | None) -> dict[str, float]:
    """``--param k=v`` (repeatable) -> ``{k: float(v)}``, checked against the variant's parameters."""
    from smxcompile import variants

    v = variants.get(variant)
    out: dict[str, float] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise _UsageError(f"--param expects NAME=VALUE, got {item!r}; {variant}'s parameters: {_param_help(v)}")
        if key not in v.params:
            raise _UsageError(f"variant {variant!r} has no parameter {key!r}; its parameters: {_param_help(v)}")
        try:
            number = float(value)
        except ValueError:
            raise _UsageError(f"--param {key}: {value!r} is not a number") from None
        if not math.isfinite(number):
            raise _UsageError(f"--param {key}: must be a finite number, got {value!r}")
        out[key] = number
    return out


def _list_variants(console) -> int:
    from rich.table import Table

    from smxcompile import variants

    table = Table(title="smx swap --variant NAME: the registry (smxcompile.variants)", show_lines=True)
    table.add_column("name", style="bold", no_wrap=True)
    table.add_column("formula (x: a row of scores, n: its unmasked entries)")
    table.add_column("parameters (learnable ones start from the softmax-trained model's rule)")
    for name in variants.names():
        v = variants.get(name)
        ps = "\n".join(f"{k}: {'learnable, start ' + s.init if s.learnable else 'fixed'}; {s.doc}"
                       for k, s in v.params.items()) or "none (calibration does not apply)"
        table.add_row(name, f"{v.formula}\n[dim]{v.paper}[/]", ps)
    console.print(table)
    console.print("Set a parameter with --param NAME=VALUE (repeatable). Learnable parameters are nn.Parameters, one "
                  "per head (--per-site: one per layer); --calibrate trains them alone.")
    return 0


def _load_data(ck: Path, args: argparse.Namespace, console):
    """``lm.lm_data`` with its guesses printed as warnings."""
    import warnings

    from smx_app import lm

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        data = lm.lm_data(ck, seq_len=args.seq_len, corpus=args.corpus)
    for w in caught:
        console.print(f"[yellow]warning:[/] {_escape(str(w.message))}")
    return data


def _check_vocab(model, data, ck: Path) -> None:
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    top = int(max(data.train.max() if data.train.numel() else 0, data.heldout.max()))
    if vocab is not None and top >= vocab:
        raise _UsageError(f"{ck}: token id {top} of the windows is outside the model's vocabulary ({vocab}): "
                          "tokenizer.json does not belong to this model")


def _eval_windows(data, batches: int | None, batch_size: int):
    return data.heldout if not batches else data.heldout[: batches * batch_size]


def _fmt_pct(new: float, ref: float) -> str:
    if not (math.isfinite(new) and math.isfinite(ref)) or ref == 0:
        return "-"
    return f"{100 * (new / ref - 1):+.2f}%"


def _learned(model) -> dict[str, dict[str, list[float]]]:
    from smxcompile.edit.swap import swapped_sites

    return {k: {n: [float(x) for x in p.detach().reshape(-1)] for n, p in s.params.items()}
            for k, s in swapped_sites(model).items()}


def _open_lm(ck, args: argparse.Namespace, console, device: str):
    """The checkpoint's model and data, and the held-out windows to evaluate: ``(data, model, held)``."""
    from smx_app import lm

    try:
        data = _load_data(ck, args, console)
        model = lm.load_lm(ck, device)
    except (OSError, ValueError, KeyError) as e:
        raise _UsageError(str(e)) from None
    _check_vocab(model, data, ck)
    return data, model, _eval_windows(data, args.batches, args.batch_size)


def _usage_errors(name: str, fn, args: argparse.Namespace, console) -> int:
    """``fn(args, console)``; a :class:`_UsageError` becomes one line on stderr and exit status 2."""
    try:
        return fn(args, console)
    except _UsageError as e:
        print(f"smx {name}: {e}", file=sys.stderr)
        return 2


def _swap_cmd(args: argparse.Namespace) -> int:
    return _usage_errors("swap", _swap, args, _console())


def _swap(args: argparse.Namespace, console) -> int:
    if args.list_variants or args.variant == "list":
        return _list_variants(console)
    t_start = time.perf_counter()
    variant, params, ck, out = _swap_inputs(args)
    device = _device(args.device)
    progress = not args.no_progress

    import smxcompile
    from smx_app import lm

    data, model, held = _open_lm(ck, args, console, device)
    batch_size = args.batch_size
    n_train = args.n_train or data.seq_len
    console.rule(f"[bold]smx swap[/]: {variant.name} at the {args.where} softmax of {_escape(str(ck))}")
    console.print(f"data: {data.corpus}, windows of {data.seq_len} tokens: {data.train.shape[0]} train, "
                  f"{held.shape[0]} of {data.heldout.shape[0]} held-out evaluated ({held.shape[0] * (data.seq_len - 1)} "
                  f"tokens); device {device}")
    rows: list[dict[str, Any]] = []

    def measure(stage: str, steps: int | None, note: str = "") -> dict[str, Any]:
        r = lm.perplexity(model, held, batch_size=batch_size, progress=progress, desc=stage)
        row = {"stage": stage, "steps": steps, "note": note, **r}
        rows.append(row)
        console.print(f"{stage}: loss {r['loss']:.4f}, perplexity {r['ppl']:.3f}" + (f" ({note})" if note else ""))
        return row

    try:
        model = smxcompile.swap(model, variant.name, where=args.where, example_inputs={"input_ids": held[:1].to(device)},
                                n_train=n_train, per_head=not args.per_site, inplace=True, **params)
    except (ValueError, TypeError) as e:
        msg = str(e)
        raise _UsageError(msg[len("swap: "):] if msg.startswith("swap: ") else msg) from None
    console.print(model.smx_swap.summary(), markup=False)
    with model.smx_swap.disabled():   # the checkpoint's own softmax at every site: the model as loaded
        before = measure("original", None, "the checkpoint as loaded, its own softmax")
    try:
        measure("swapped", 0, "no training")
    except ValueError as e:  # a parameter out of its domain shows up in the first forward
        raise _UsageError(f"the swapped model does not run: {e}") from None
    try:
        losses, calib_note = _train_stages(args, model, data, variant.name, measure, console, progress=progress)
    except FloatingPointError as e:
        console.print(f"[red]smx swap: {_escape(str(e))}[/]")
        return 1
    _print_perplexity_table(console, model, variant.name, rows, before=before, windows=held.shape[0])

    lm.save_lm(model, out, tokenizer_from=ck)
    final = rows[-1]
    command, eval_cmd = _swap_commands(args, variant.name, params, data, out)
    results = {
        "command": command,
        "eval_command": eval_cmd,
        "source": str(ck),
        "settings": {"seq_len": data.seq_len, "corpus": data.corpus, "batch_size": batch_size, "batches": args.batches,
                     "variant": variant.name, "where": args.where, "params": params, "n_train": n_train,
                     "per_head": not args.per_site, "calibrate": args.calibrate, "finetune": args.finetune,
                     "calib_lr": args.calib_lr or lm.CALIBRATE_LR, "lr": args.lr or lm.FINETUNE_LR,
                     "seed": args.seed, "device": device},
        "source_settings": data.settings,
        "eval": {"windows": int(held.shape[0]), "tokens": before["tokens"], "heldout_windows": int(data.heldout.shape[0])},
        "perplexity": {r["stage"]: {k: r[k] for k in ("loss", "ppl", "tokens", "steps")} for r in rows},
        "final": final["stage"],
        "final_loss": final["loss"],
        "final_ppl": final["ppl"],
        "calibration_note": calib_note,
        "losses": losses,
        "swap": model.smx_swap.manifest(),
        "learned": _learned(model),
        "environment": _environment(device),
        "total_s": time.perf_counter() - t_start,
    }
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    console.print(f"saved: {_escape(str(out))}/ (save_pretrained: config.json with the swap manifest, model.safetensors; "
                  "tokenizer; results.json)", soft_wrap=True)
    console.print(f"final held-out perplexity ({final['stage']}): {final['ppl']:.3f}")
    console.print(f"evaluate it with:\n  {eval_cmd}", soft_wrap=True, markup=False)
    return 0


def _swap_inputs(args: argparse.Namespace):
    """The variant, its ``--param`` values, the checkpoint folder and the output folder, checked:
    ``(variant, params, checkpoint, out)``; a :class:`_UsageError` for anything missing or clashing."""
    if args.variant is None:
        raise _UsageError("--variant NAME is required (smx swap --list-variants shows the names)")
    if args.checkpoint is None:
        raise _UsageError("CHECKPOINT is required (a checkpoint folder, e.g. the --out folder of `smx demo`)")
    if args.out is None:
        raise _UsageError("--out DIR is required (where the swapped model is saved)")
    from smxcompile import variants

    try:
        variant = variants.get(args.variant)
    except variants.UnknownVariantError:
        raise _UsageError(f"unknown variant {args.variant!r}; known: {', '.join(variants.names())} "
                          "(smx swap --list-variants shows their formulas)") from None
    params = _parse_params(variant.name, args.param)
    from smx_app import lm

    try:
        ck = lm.checkpoint_dir(args.checkpoint)
    except FileNotFoundError as e:
        raise _UsageError(str(e)) from None
    out = Path(args.out)
    if out.resolve() == ck.resolve() or (out / "checkpoint" / "config.json").is_file():
        raise _UsageError(f"--out {out} would overwrite a checkpoint ({ck if out.resolve() == ck.resolve() else out}); "
                          "choose a new folder")
    if out.exists() and not out.is_dir():
        raise _UsageError(f"--out {out} exists and is not a folder")
    if lm.is_swapped(ck):
        raise _UsageError(f"{ck} holds a swapped model already (smx_swap in config.json): swap the original checkpoint")
    return variant, params, ck, out


def _train_stages(args: argparse.Namespace, model, data, variant: str, measure, console, *,
                  progress: bool) -> tuple[dict[str, list[float]], str | None]:
    """``--calibrate`` then ``--finetune``, each followed by ``measure``: ``(losses per stage, calibration note)``."""
    from smx_app import lm

    losses: dict[str, list[float]] = {}
    calib_note = None
    if args.calibrate:
        if not lm.variant_parameters(model):
            calib_note = (f"--calibrate {args.calibrate}: not applicable: {variant} has no learnable parameter "
                          "(nothing to calibrate); going on")
            console.print(f"[yellow]{_escape(calib_note)}[/]")
        else:
            n = sum(p.numel() for p in lm.variant_parameters(model))
            losses["calibrate"] = lm.train_steps(model, data.train, steps=args.calibrate, batch_size=args.batch_size,
                                                 lr=args.calib_lr, which="variant", seed=args.seed,
                                                 progress=progress, desc="calibrate")
            measure("calibrated", args.calibrate, f"{n} variant parameters trained, the model frozen")
    if args.finetune:
        losses["finetune"] = lm.train_steps(model, data.train, steps=args.finetune, batch_size=args.batch_size,
                                            lr=args.lr, which="all", seed=args.seed + 1, progress=progress,
                                            desc="fine-tune")
        measure("fine-tuned", args.finetune, "every weight trained")
    return losses, calib_note


def _print_perplexity_table(console, model, variant: str, rows: list[dict[str, Any]], *, before: dict[str, Any],
                            windows: int) -> None:
    """The perplexity of each stage against the original's, then the learned parameters if any trained."""
    from rich.table import Table

    from smx_app import lm

    table = Table(title=f"held-out perplexity: {variant} in place of softmax ({windows} windows, "
                  f"{before['tokens']} tokens)")
    for col, kw in (("stage", {}), ("steps", {"justify": "right"}), ("loss (nats)", {"justify": "right"}),
                    ("perplexity", {"justify": "right"}), ("vs original", {"justify": "right"}), ("", {})):
        table.add_column(col, **kw)
    for r in rows:
        table.add_row(r["stage"], "-" if r["steps"] is None else str(r["steps"]), f"{r['loss']:.4f}",
                      f"{r['ppl']:.3f}", "" if r is before else _fmt_pct(r["ppl"], before["ppl"]), r["note"])
    console.print(table)
    if len(rows) > 2 and lm.variant_parameters(model):
        console.print("final parameters:", markup=False)
        console.print(model.smx_swap.summary(), markup=False)


def _swap_commands(args: argparse.Namespace, variant: str, params: dict[str, float], data, out: Path) -> tuple[str, str]:
    """The ``smx swap`` command line that reproduces this run and the ``smx eval`` one that measures its output."""
    eval_cmd = ["smx", "eval", str(out)]
    if args.batches:
        eval_cmd += ["--batches", str(args.batches), "--batch-size", str(args.batch_size)]
    if args.device != "auto":
        eval_cmd += ["--device", args.device]
    command = ["smx", "swap", str(args.checkpoint), "--variant", variant, "--where", args.where]
    for k, v in params.items():
        command += ["--param", f"{k}={v:g}"]
    for flag, val in (("--n-train", args.n_train), ("--calibrate", args.calibrate), ("--finetune", args.finetune),
                      ("--lr", args.lr), ("--calib-lr", args.calib_lr), ("--batches", args.batches)):
        if val:
            command += [flag, f"{val:g}" if isinstance(val, float) else str(val)]
    command += ["--batch-size", str(args.batch_size), "--seed", str(args.seed), "--seq-len", str(data.seq_len),
                "--corpus", data.corpus, "--out", str(out)] + (["--per-site"] if args.per_site else [])
    return shlex.join(command), shlex.join(eval_cmd)


def _environment(device: str) -> dict[str, str]:
    """The versions and device recorded in ``results.json``."""
    import torch

    import smxcompile

    return {"torch": torch.__version__, "smxcompile": smxcompile.__version__, "device": device}


def _eval_cmd(args: argparse.Namespace) -> int:
    return _usage_errors("eval", _eval, args, _console(stderr=args.json))


def _eval(args: argparse.Namespace, console) -> int:
    from smx_app import lm

    try:
        ck = lm.checkpoint_dir(args.checkpoint)
    except FileNotFoundError as e:
        raise _UsageError(str(e)) from None
    device = _device(args.device)
    progress = not args.no_progress
    data, model, held = _open_lm(ck, args, console, device)
    bs = args.batch_size
    r = lm.perplexity(model, held, batch_size=bs, progress=progress, desc="perplexity")
    doc: dict[str, Any] = {"checkpoint": str(ck), "seq_len": data.seq_len, "corpus": data.corpus,
                           "batch_size": bs, "batches": args.batches, "heldout_windows": int(data.heldout.shape[0]),
                           **r, "swapped": lm.is_swapped(ck)}
    stats = None
    if doc["swapped"]:
        sw = _eval_windows(data, args.stats_batches, bs) if args.stats_batches else held
        stats = {"swapped": lm.attention_stats(model, sw, batch_size=bs, progress=progress),
                 "original": lm.attention_stats(model, sw, batch_size=bs, baseline=True, progress=progress)}
        doc["swap"] = model.smx_swap.manifest()
        doc["learned"] = _learned(model)
        doc["attention"] = stats
        doc["stats_windows"] = int(sw.shape[0])
    if args.json:
        print(json.dumps(doc, indent=2))
        return 0
    console.rule(f"[bold]smx eval[/]: {_escape(str(ck))}")
    console.print(f"data: {data.corpus}, windows of {data.seq_len} tokens; {r['windows']} of "
                  f"{data.heldout.shape[0]} held-out windows ({r['tokens']} tokens); device {device}")
    console.print(f"held-out loss {r['loss']:.4f} nats/token, perplexity [bold]{r['ppl']:.3f}[/]")
    if stats is not None:
        from rich.table import Table

        console.print(model.smx_swap.summary(), markup=False)
        variants_used = ", ".join(sorted({s.variant for s in model.smx_swap.sites.values()}))
        table = Table(title=f"attention weights at the swapped sites ({doc['stats_windows']} held-out windows, "
                      f"{int(stats['swapped']['rows'])} rows)")
        table.add_column("")
        for col in ("entropy (nats)", "sink mass", "row sum", "zero fraction"):
            table.add_column(col, justify="right")
        for label, s in ((f"{variants_used} (swapped)", stats["swapped"]),
                         ("original softmax (same weights)", stats["original"])):
            table.add_row(label, f"{s['entropy']:.4f}", f"{s['sink_mass']:.4f}", f"{s['rowsum']:.4f}",
                          f"{s['zero_fraction']:.4f}")
        console.print(table)
    return 0


def _add_data_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch-size", type=positive_int, default=8, metavar="B", help="windows per batch (default: 8)")
    p.add_argument("--batches", type=nonneg_int, default=0, metavar="N",
                   help="held-out batches to evaluate, 0 = every held-out window (default: 0)")
    p.add_argument("--seq-len", type=positive_int, default=None, metavar="T",
                   help="window length (default: the demo's, from results.json, else the model's n_positions)")
    p.add_argument("--corpus", default=None, help="demo corpus: topics or topics+docstrings (default: the demo's, "
                   "from results.json)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="auto = cuda when available, else cpu (default: auto)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def add_swap_parser(sub) -> None:
    """Add ``smx swap`` to ``sub`` (what the ``smx`` parser's ``add_subparsers()`` returned)."""
    w = sub.add_parser("swap", help="replace a checkpoint's softmax by a variant, calibrate / fine-tune, compare "
                       "perplexity", description=SWAP_DESCRIPTION, epilog=SWAP_EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    w.add_argument("checkpoint", nargs="?", metavar="CHECKPOINT",
                   help="checkpoint folder (config.json + weights + tokenizer.json) or an `smx demo --out` folder")
    w.add_argument("--variant", metavar="NAME", help="the normalization to swap in (required; the names: smx swap --list-variants)")
    w.add_argument("--list-variants", action="store_true", help="print the variants with formulas and parameters")
    w.add_argument("--where", default="attention", choices=("attention", "output", "all"),
                   help="which softmax calls: attention (default), output (the others: a classifier's, a router's), all")
    w.add_argument("--param", action="append", metavar="NAME=VALUE",
                   help="a variant parameter (repeatable): a learnable one's start value, or a fixed one's value")
    w.add_argument("--n-train", type=positive_int, default=None, metavar="N",
                   help="training context length for the length-dependent start values (SSMax s = 1/log N, sigmoid "
                   "b = -log N, ...) (default: the window length)")
    w.add_argument("--per-site", action="store_true", help="one parameter per site instead of one per head")
    w.add_argument("--calibrate", type=nonneg_int, default=0, metavar="STEPS",
                   help="AdamW steps on the variant's learnable parameters only, the model frozen (default: 0)")
    w.add_argument("--finetune", type=nonneg_int, default=0, metavar="STEPS",
                   help="then AdamW steps on every weight (default: 0)")
    w.add_argument("--calib-lr", type=positive_float, default=None, metavar="LR",
                   help="learning rate of --calibrate (default: 1e-2)")
    w.add_argument("--lr", type=positive_float, default=None, metavar="LR",
                   help="learning rate of --finetune (default: 1e-4)")
    w.add_argument("--seed", type=int, default=0, help="seed of the training batch order (default: 0)")
    _add_data_options(w)
    w.add_argument("--out", type=Path, default=None, metavar="DIR", help="where the swapped model is saved (required)")
    w.set_defaults(func=_swap_cmd)


def add_eval_parser(sub) -> None:
    """Add ``smx eval`` to ``sub`` (what the ``smx`` parser's ``add_subparsers()`` returned)."""
    v = sub.add_parser("eval", help="held-out perplexity of a checkpoint (swapped or not)",
                       description=EVAL_DESCRIPTION, epilog=EVAL_EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    v.add_argument("checkpoint", metavar="CHECKPOINT",
                   help="checkpoint folder (config.json + weights + tokenizer.json) or an `smx demo --out` folder")
    _add_data_options(v)
    v.add_argument("--stats-batches", type=nonneg_int, default=2, metavar="N",
                   help="held-out batches for the attention statistics of a swapped model, 0 = every evaluated "
                   "window (default: 2)")
    v.add_argument("--json", action="store_true", help="print the figures as JSON on stdout (messages go to stderr)")
    v.set_defaults(func=_eval_cmd)
