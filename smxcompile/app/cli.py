"""The ``smx`` command line: ``smx demo``, ``smx explain``, ``smx swap``, ``smx eval``."""

from __future__ import annotations

import argparse
import importlib
import json
import math
import shlex
import sys
import time
from pathlib import Path
from typing import Any
from .argtypes import nonneg_int, positive_float, positive_int

EPILOG = """\
examples:
  smx demo                          train a small GPT-2 on Python's bundled docs with eager,
                                    inductor and smx; print the rewrite report and a side-by-side table
  smx demo --quick                  the same in seconds, with a tiny model
  smx explain                       the rewrite report of the demo model
  smx explain mypkg.models:build    the report of any model: 'module:factory' where factory()
                                    returns (model, example_args) or (model, args, kwargs)
  smx explain --json ...            the report as JSON
  smx swap --list-variants          the softmax variants smx swap can put in a model
  smx swap smx-demo-out --variant ssmax --calibrate 50 --out ssmax-run
                                    replace the demo model's attention softmax by SSMax, calibrate
                                    its scale on training text, compare held-out perplexity
  smx eval ssmax-run                held-out perplexity of a checkpoint (and, for a swapped one,
                                    attention entropy / sink mass vs the original softmax)
  smx export ssmax-run --out ssmax.onnx
                                    the model as smxcompile rewrites it (swaps, quantized softmax,
                                    fusions) as ONNX, checked in onnxruntime
"""

EXPORT_DESCRIPTION = """Export a causal language model checkpoint to ONNX (or MLIR) as smxcompile rewrites it (smxcompile.export_onnx):
the rewritten graph, not the original one, so the file keeps the fusions, the swapped variants of a
`smx swap` output and the corrected quantized softmax. Batch and sequence length stay dynamic. The
file is checked before this returns: onnx.checker, and onnxruntime against eager PyTorch on random
token ids of two shapes and on the first one a token shorter. Prints the rewrite report, how each smxcompile op was exported and the ONNX
op counts; --compare also exports the checkpoint plainly (torch.onnx.export) and prints the op counts
before/after and both onnxruntime CPU latencies side by side.

Targets: onnxruntime (default; fused attention as the ONNX Attention op or onnxruntime's
com.microsoft MultiHeadAttention, whichever the installed onnxruntime runs fastest and exactly) or
portable (standard ONNX ops only, attention as MatMul / Softmax / MatMul, for other runtimes).

--format mlir writes torch-mlir's torch, linalg-on-tensors or stablehlo dialect instead
(smxcompile.export_mlir), the sequence length dynamic (stablehlo: static shapes), the smx ops in their
reference ATen form."""

EXPORT_EPILOG = """examples:
  smx export smx-demo-out --out demo.onnx
  smx export smx-demo-out --out demo.onnx --compare          op counts and latency vs a plain export
  smx export runs/ssmax --out ssmax.onnx --batch 4 --seq-len 64
  smx export smx-demo-out --out portable.onnx --target portable --opset 18
  smx export smx-demo-out --out plain.onnx --rewrites none   the model as written, through the same checks
  smx export smx-demo-out --format mlir --out demo.mlir      linalg-on-tensors, run on MLIR's JIT as a check
  smx export smx-demo-out --format mlir --output-type torch --keep-ops --out demo.torch.mlir
"""


def _export_cmd(args: argparse.Namespace) -> int:
    import torch

    import smxcompile
    from smxcompile import tune

    try:
        ck = tune.checkpoint_dir(args.checkpoint)
        try:
            options = json.loads(args.options) if args.options else None
        except json.JSONDecodeError as e:
            raise ValueError(f"--options is not JSON ({e}): e.g. --options '{{\"disable\": [\"attention\"]}}'") from e
        if options is not None:
            smxcompile.SmxOptions.from_mapping(options)
        rewrites = "all" if args.rewrites == "all" else [] if args.rewrites == "none" else \
            [k.strip() for k in args.rewrites.split(",") if k.strip()]
        bad = [k for k in ([] if isinstance(rewrites, str) else rewrites) if k not in smxcompile.REWRITE_KINDS]
        if bad:
            raise ValueError(f"--rewrites: unknown kind(s) {bad}; known: {', '.join(smxcompile.REWRITE_KINDS)}, "
                             "or all / none")
        onnx_only = [f for f, v in (("--target", args.target != "onnxruntime"), ("--opset", args.opset is not None),
                                    ("--attention-op", args.attention_op is not None), ("--compare", args.compare))
                     if v]
        if args.format == "mlir" and onnx_only:
            raise ValueError(f"{', '.join(onnx_only)}: ONNX options; --format mlir takes --output-type / --keep-ops")
        if args.format == "onnx" and (args.output_type or args.keep_ops):
            raise ValueError("--output-type / --keep-ops are MLIR options: add --format mlir")
        model = tune.load_lm(ck, "cpu")
    except (OSError, ValueError, KeyError) as e:
        print(f"smx export: {e}", file=sys.stderr)
        return 2
    model.config.use_cache = False
    vocab = int(model.config.vocab_size)
    n_pos = getattr(model.config, "n_positions", None) or getattr(model.config, "max_position_embeddings", None)
    seq = args.seq_len or min(32, n_pos or 32)
    if seq < 2 or (n_pos and seq > n_pos):
        print(f"smx export: --seq-len must be in 2..{n_pos}", file=sys.stderr)
        return 2
    g = torch.Generator().manual_seed(0)
    batch = max(args.batch, 2)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    if args.format == "mlir":
        return _export_mlir(args, model, ids, vocab, options, rewrites)
    ids2 = torch.randint(0, vocab, (batch + 1, max(2, seq // 2 + 1)), generator=g)
    try:
        out = smxcompile.export_onnx(model, (), args.out, kwargs={"input_ids": ids}, options=options,
                                     dynamic_shapes={"input_ids": {0: "batch", 1: "sequence"}},
                                     check_inputs=[((), {"input_ids": ids2})], target=args.target, opset=args.opset,
                                     attention_op=args.attention_op, rewrites=rewrites, compare=args.compare,
                                     threads=args.threads)
    except smxcompile.OnnxExportError as e:
        print(f"smx export: {e}", file=sys.stderr)
        return 1
    print(out)
    return 0


def _export_mlir(args: argparse.Namespace, model, ids, vocab: int, options, rewrites) -> int:
    """``smx export --format mlir``: the sequence dim dynamic (batch static: torch-mlir's linalg lowering
    miscompiles GPT-2 with both dynamic), checked on a second length; for stablehlo every shape static
    (torch-mlir does not lower the dynamic length's ``aten.cumsum`` to StableHLO)."""
    import torch

    import smxcompile
    from smxcompile.backends.onnx import _export_options

    output_type = args.output_type or "linalg-on-tensors"
    if args.keep_ops and output_type != "torch":
        print("smx export: --keep-ops keeps the smx ops as torch.operator, which only the torch dialect holds: "
              "add --output-type torch", file=sys.stderr)
        return 2
    static = output_type == "stablehlo"
    ids2 = torch.randint(0, vocab, (ids.shape[0], max(2, ids.shape[1] // 2 + 1)), generator=torch.Generator().manual_seed(1))
    try:
        out = smxcompile.export_mlir(model, (), kwargs={"input_ids": ids}, output_type=output_type,
                                     options=_export_options(options, rewrites), decompose=not args.keep_ops,
                                     dynamic_shapes=None if static else {"input_ids": {1: "sequence"}}, path=args.out,
                                     check_inputs=[] if static else [((), {"input_ids": ids2})])
    except ImportError as e:
        print(f"smx export: {e}", file=sys.stderr)
        return 2
    except (smxcompile.MlirExportError, smxcompile.OnnxExportError) as e:
        print(f"smx export: {e}", file=sys.stderr)
        return 1
    print(out.report)
    top = sorted(out.ops.items(), key=lambda kv: -kv[1])[:12]
    print(f"wrote {args.out} ({output_type}{', smx ops kept' if args.keep_ops else ''}): "
          + ", ".join(f"{k} {v}" for k, v in top))
    if static:
        print(f"shapes static: input_ids {tuple(ids.shape)} (--batch, --seq-len; torch-mlir does not lower the "
              "dynamic sequence length's aten.cumsum to stablehlo)")
    if out.checked == "run":
        print(f"run on MLIR's LLVM JIT against eager PyTorch on shapes {tuple(ids.shape)} and {tuple(ids2.shape)}: "
              f"max |diff| {out.max_abs_diff:.3g}")
    else:
        print(f"parsed and verified ({output_type} modules are not run here)")
    return 0


def _explain_cmd(args: argparse.Namespace) -> int:
    import smxcompile

    if args.target:
        if ":" not in args.target:
            print(f"smx explain: expected 'module:factory', got {args.target!r}", file=sys.stderr)
            return 2
        mod_name, fn_name = args.target.split(":", 1)
        if not mod_name or not fn_name:
            print(f"smx explain: expected 'module:factory', got {args.target!r}", file=sys.stderr)
            return 2
        sys.path.insert(0, ".")
        try:
            factory = getattr(importlib.import_module(mod_name), fn_name)
        except (ImportError, AttributeError, ValueError) as e:
            print(f"smx explain: cannot load {args.target!r}: {e}", file=sys.stderr)
            return 2
        if not callable(factory):
            print(f"smx explain: {args.target!r} is not callable (a factory returning (model, args) is needed)",
                  file=sys.stderr)
            return 2
        try:
            built = factory()
        except TypeError as e:
            print(f"smx explain: calling {args.target}() failed: {e} (the factory must take no arguments)",
                  file=sys.stderr)
            return 2
        if not isinstance(built, tuple) or len(built) not in (2, 3):
            print("smx explain: the factory must return (model, args) or (model, args, kwargs)", file=sys.stderr)
            return 2
        model, fargs = built[0], built[1]
        fkwargs = built[2] if len(built) == 3 else {}
        if not isinstance(fargs, (tuple, list)):
            fargs = (fargs,)
    else:
        from smxcompile.demo import demo_model_and_inputs

        model, fargs, fkwargs = demo_model_and_inputs()
    try:
        options = json.loads(args.options) if args.options else None
        smxcompile.SmxOptions.from_mapping(options)
    except json.JSONDecodeError as e:
        print(f"smx explain: --options is not valid JSON ({e}); example: --options '{{\"cpu\": \"rewrite\"}}'",
              file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"smx explain: {e}", file=sys.stderr)
        return 2
    report = smxcompile.explain(model, *fargs, options=options, **fkwargs)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(report)
    return 0


# --------------------------------------------------------------------------- smx swap / smx eval

SWAP_DESCRIPTION = """\
Replace the softmax of a trained causal language model by another normalization
(smxcompile.swap: sparsemax, entmax, softpick, SSMax, softmax1, sigmoid, ...; see
--list-variants), then optionally calibrate the variant's own parameters (--calibrate:
only they train, every weight of the model frozen) and fine-tune every weight
(--finetune). Held-out perplexity is measured before the swap, right after it, after
calibration and after fine-tuning, and printed as a table. The swapped model is saved
with save_pretrained (weights, config with the swap manifest, tokenizer) plus
results.json; `smx eval OUT` and smxcompile.tune.load_lm(OUT) load it back.

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
load it back: smx eval OUT, smxcompile.tune.load_lm(OUT), or
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
    """``tune.lm_data`` with its guesses printed as warnings."""
    import warnings

    from smxcompile import tune

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        data = tune.lm_data(ck, seq_len=args.seq_len, corpus=args.corpus)
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
    from smxcompile.swapping import swapped_sites

    return {k: {n: [float(x) for x in p.detach().reshape(-1)] for n, p in s.params.items()}
            for k, s in swapped_sites(model).items()}


def _open_lm(ck, args: argparse.Namespace, console, device: str):
    """The checkpoint's model and data, and the held-out windows to evaluate: ``(data, model, held)``."""
    from smxcompile import tune

    try:
        data = _load_data(ck, args, console)
        model = tune.load_lm(ck, device)
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
    from smxcompile import tune

    try:
        ck = tune.checkpoint_dir(args.checkpoint)
    except FileNotFoundError as e:
        raise _UsageError(str(e)) from None
    out = Path(args.out)
    if out.resolve() == ck.resolve() or (out / "checkpoint" / "config.json").is_file():
        raise _UsageError(f"--out {out} would overwrite a checkpoint ({ck if out.resolve() == ck.resolve() else out}); "
                          "choose a new folder")
    if out.exists() and not out.is_dir():
        raise _UsageError(f"--out {out} exists and is not a folder")
    if tune.is_swapped(ck):
        raise _UsageError(f"{ck} holds a swapped model already (smx_swap in config.json): swap the original checkpoint")
    device = _device(args.device)
    progress = not args.no_progress

    import torch

    import smxcompile

    data, model, held = _open_lm(ck, args, console, device)
    bs = args.batch_size
    n_train = args.n_train or data.seq_len
    console.rule(f"[bold]smx swap[/]: {variant.name} at the {args.where} softmax of {_escape(str(ck))}")
    console.print(f"data: {data.corpus}, windows of {data.seq_len} tokens: {data.train.shape[0]} train, "
                  f"{held.shape[0]} of {data.heldout.shape[0]} held-out evaluated ({held.shape[0] * (data.seq_len - 1)} "
                  f"tokens); device {device}")
    rows: list[dict[str, Any]] = []

    def measure(stage: str, steps: int | None, note: str = "") -> dict[str, Any]:
        r = tune.perplexity(model, held, batch_size=bs, progress=progress, desc=stage)
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
    losses: dict[str, list[float]] = {}
    calib_note = None
    try:
        if args.calibrate:
            if not tune.variant_parameters(model):
                calib_note = (f"--calibrate {args.calibrate}: not applicable: {variant.name} has no learnable parameter "
                              "(nothing to calibrate); going on")
                console.print(f"[yellow]{_escape(calib_note)}[/]")
            else:
                n = sum(p.numel() for p in tune.variant_parameters(model))
                losses["calibrate"] = tune.train_steps(model, data.train, steps=args.calibrate, batch_size=bs,
                                                       lr=args.calib_lr, which="variant", seed=args.seed,
                                                       progress=progress, desc="calibrate")
                measure("calibrated", args.calibrate, f"{n} variant parameters trained, the model frozen")
        if args.finetune:
            losses["finetune"] = tune.train_steps(model, data.train, steps=args.finetune, batch_size=bs, lr=args.lr,
                                                  which="all", seed=args.seed + 1, progress=progress, desc="fine-tune")
            measure("fine-tuned", args.finetune, "every weight trained")
    except FloatingPointError as e:
        console.print(f"[red]smx swap: {_escape(str(e))}[/]")
        return 1

    from rich.table import Table

    table = Table(title=f"held-out perplexity: {variant.name} in place of softmax ({held.shape[0]} windows, "
                  f"{before['tokens']} tokens)")
    for col, kw in (("stage", {}), ("steps", {"justify": "right"}), ("loss (nats)", {"justify": "right"}),
                    ("perplexity", {"justify": "right"}), ("vs original", {"justify": "right"}), ("", {})):
        table.add_column(col, **kw)
    for r in rows:
        table.add_row(r["stage"], "-" if r["steps"] is None else str(r["steps"]), f"{r['loss']:.4f}",
                      f"{r['ppl']:.3f}", "" if r is before else _fmt_pct(r["ppl"], before["ppl"]), r["note"])
    console.print(table)
    if len(rows) > 2 and tune.variant_parameters(model):
        console.print("final parameters:", markup=False)
        console.print(model.smx_swap.summary(), markup=False)

    # save -----------------------------------------------------------------------
    tune.save_lm(model, out, tokenizer_from=ck)
    final = rows[-1]
    eval_cmd = ["smx", "eval", str(out)]
    if args.batches:
        eval_cmd += ["--batches", str(args.batches), "--batch-size", str(bs)]
    if args.device != "auto":
        eval_cmd += ["--device", args.device]
    command = ["smx", "swap", str(args.checkpoint), "--variant", variant.name, "--where", args.where]
    for k, v in params.items():
        command += ["--param", f"{k}={v:g}"]
    for flag, val in (("--n-train", args.n_train), ("--calibrate", args.calibrate), ("--finetune", args.finetune),
                      ("--lr", args.lr), ("--calib-lr", args.calib_lr), ("--batches", args.batches)):
        if val:
            command += [flag, f"{val:g}" if isinstance(val, float) else str(val)]
    command += ["--batch-size", str(bs), "--seed", str(args.seed), "--seq-len", str(data.seq_len),
                "--corpus", data.corpus, "--out", str(out)] + (["--per-site"] if args.per_site else [])
    results = {
        "command": shlex.join(command),
        "eval_command": shlex.join(eval_cmd),
        "source": str(ck),
        "settings": {"seq_len": data.seq_len, "corpus": data.corpus, "batch_size": bs, "batches": args.batches,
                     "variant": variant.name, "where": args.where, "params": params, "n_train": n_train,
                     "per_head": not args.per_site, "calibrate": args.calibrate, "finetune": args.finetune,
                     "calib_lr": args.calib_lr or tune.CALIBRATE_LR, "lr": args.lr or tune.FINETUNE_LR,
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
        "environment": {"torch": torch.__version__, "smxcompile": smxcompile.__version__, "device": device},
        "total_s": time.perf_counter() - t_start,
    }
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    console.print(f"saved: {_escape(str(out))}/ (save_pretrained: config.json with the swap manifest, model.safetensors; "
                  "tokenizer; results.json)", soft_wrap=True)
    console.print(f"final held-out perplexity ({final['stage']}): {final['ppl']:.3f}")
    console.print(f"evaluate it with:\n  {shlex.join(eval_cmd)}", soft_wrap=True, markup=False)
    return 0


def _eval_cmd(args: argparse.Namespace) -> int:
    return _usage_errors("eval", _eval, args, _console(stderr=args.json))


def _eval(args: argparse.Namespace, console) -> int:
    from smxcompile import tune

    try:
        ck = tune.checkpoint_dir(args.checkpoint)
    except FileNotFoundError as e:
        raise _UsageError(str(e)) from None
    device = _device(args.device)
    progress = not args.no_progress
    data, model, held = _open_lm(ck, args, console, device)
    bs = args.batch_size
    r = tune.perplexity(model, held, batch_size=bs, progress=progress, desc="perplexity")
    doc: dict[str, Any] = {"checkpoint": str(ck), "seq_len": data.seq_len, "corpus": data.corpus,
                           "batch_size": bs, "batches": args.batches, "heldout_windows": int(data.heldout.shape[0]),
                           **r, "swapped": tune.is_swapped(ck)}
    stats = None
    if doc["swapped"]:
        sw = _eval_windows(data, args.stats_batches, bs) if args.stats_batches else held
        stats = {"swapped": tune.attention_stats(model, sw, batch_size=bs, progress=progress),
                 "original": tune.attention_stats(model, sw, batch_size=bs, baseline=True, progress=progress)}
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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="smx",
        description="smxcompile: a torch.compile backend (backend='smx') that finds softmax-shaped "
        "subgraphs and rewrites them into fused kernels; everything else goes to Inductor.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    from smxcompile import demo

    d = sub.add_parser("demo", help="train a small GPT-2 on real text under eager, inductor and smx",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    demo.add_arguments(d)
    d.set_defaults(func=demo.run)

    e = sub.add_parser("explain", help="print the rewrite report of a model",
                       description="Trace a model the way backend='smx' does and list every softmax-shaped "
                       "site: rewritten, kept (left to Inductor on purpose) or skipped, with the reason and "
                       "the source line.", epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    e.add_argument("target", nargs="?", help="'module:factory' returning (model, args[, kwargs]); default: the demo model")
    e.add_argument("--json", action="store_true", help="print the report as JSON")
    e.add_argument("--options", help='backend options as JSON, e.g. \'{"cpu": "rewrite"}\'')
    e.set_defaults(func=_explain_cmd)

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

    x = sub.add_parser("export", help="export a checkpoint to ONNX as smxcompile rewrites it, checked in onnxruntime",
                       description=EXPORT_DESCRIPTION, epilog=EXPORT_EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    x.add_argument("checkpoint", metavar="CHECKPOINT",
                   help="checkpoint folder (config.json + weights) or an `smx demo --out` / `smx swap --out` folder")
    x.add_argument("--format", choices=("onnx", "mlir"), default="onnx",
                   help="onnx (checked in onnxruntime) or mlir (torch-mlir; pip install smxcompile[mlir]) "
                   "(default: onnx)")
    x.add_argument("--out", required=True, type=Path, metavar="FILE", help="the .onnx / .mlir file to write")
    x.add_argument("--output-type", choices=("torch", "linalg-on-tensors", "stablehlo"), default=None,
                   help="--format mlir: the MLIR dialect (default: linalg-on-tensors, run on MLIR's JIT as a check; "
                   "stablehlo is written with static shapes, the --batch x --seq-len example's, since torch-mlir "
                   "does not lower a dynamic sequence length to it)")
    x.add_argument("--keep-ops", action="store_true",
                   help="--format mlir --output-type torch: keep the smx ops as torch.operator for a compiler "
                   "with its own lowering (default: their reference ATen form)")
    x.add_argument("--target", choices=("onnxruntime", "portable"), default="onnxruntime",
                   help="onnxruntime: its fastest exact ops, com.microsoft ones included; portable: standard ONNX "
                   "ops only (default: onnxruntime)")
    x.add_argument("--opset", type=positive_int, default=None, metavar="N",
                   help="ONNX opset, at least 18 (default: the target's; 23 for the Attention op)")
    x.add_argument("--attention-op", choices=("Attention", "MultiHeadAttention", "decompose"), default=None,
                   help="force the form of fused attention (default: the target's choice)")
    x.add_argument("--rewrites", default="all", metavar="KINDS",
                   help="rewrite kinds to apply, comma-separated (attention,softmax_topk,...), all or none (default: all)")
    x.add_argument("--compare", action="store_true",
                   help="also export plainly with torch.onnx.export and print op counts and onnxruntime CPU latency "
                   "side by side")
    x.add_argument("--threads", type=positive_int, default=1, metavar="N",
                   help="onnxruntime intra-op threads of the --compare timing (default: 1)")
    x.add_argument("--batch", type=positive_int, default=2, metavar="B",
                   help="batch of the example input, at least 2 (the dim stays dynamic; 1 is raised to 2; default: 2)")
    x.add_argument("--seq-len", type=positive_int, default=None, metavar="T",
                   help="sequence length of the example input (default: 32, at most the model's)")
    x.add_argument("--options", help='backend options as JSON (default {"cpu": "rewrite"}: every fusion kept)')
    x.set_defaults(func=_export_cmd)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
