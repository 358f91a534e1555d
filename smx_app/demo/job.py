"""``smx demo``: the run itself (:func:`run`, :func:`run_demo`): data, model, one training run per
backend, the comparison, the table and the artifacts, printed as it goes."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import json
import os
import platform
import time
from pathlib import Path
from typing import Any, Sequence

from .data import EOT, load_corpus, make_batches, make_windows, split_windows, train_tokenizer
from .model import build_model, count_attention_calls
from .results import check_checkpoint, loss_memory_note, markdown_table, plot_losses, print_table, save_checkpoint, \
    table_rows
from .settings import LATE_WINDOW, Settings, build_parser, reproduce_command, resolve_settings
from .training import BACKEND_VARIANTS, BackendRun, compare, evaluate, train_backend


@dataclasses.dataclass
class DemoResult:
    """Everything one demo run produced (``run`` returns only ``exit_code``)."""

    exit_code: int
    settings: Settings
    runs: list[BackendRun]
    results: dict[str, Any]
    report: Any = None
    eval_batch: Any = None


def _explain(model, batch, console) -> tuple[Any, str | None]:
    try:
        import smxcompile

        explain = smxcompile.explain
    except (ImportError, AttributeError) as e:
        return None, f"smxcompile.explain is not available ({type(e).__name__}: {e})"
    try:
        return explain(model, input_ids=batch, labels=batch), None
    except Exception as e:  # the report is informative; a failure must not hide the training results
        return None, f"smxcompile.explain failed: {type(e).__name__}: {e}"


def run(args: argparse.Namespace) -> int:
    """Run the demo with parsed ``smx demo`` options; returns the exit code (0: all backends agree)."""
    return run_demo(args).exit_code


def run_demo(args: argparse.Namespace, console=None) -> DemoResult:
    """Run the demo and return everything it produced (see :class:`DemoResult`).

    ``args`` is the namespace :func:`add_arguments` defines. Writes
    ``<out>/checkpoint/``, ``<out>/results.json`` and maybe ``<out>/loss.png``.
    """
    from rich.console import Console

    if console is None:
        console = Console()
        if not console.is_terminal:  # logs and CI: do not squeeze the table into 80 columns
            console = Console(width=max(console.width, 120))
    t_start = time.perf_counter()
    try:
        s = resolve_settings(args)
    except ValueError as e:
        console.print(f"[red]smx demo: {e}[/]")
        return DemoResult(2, None, [], {})  # type: ignore[arg-type]

    import torch

    from smxcompile.edit.swap_io import quiet_transformers  # here: smxcompile imports torch (smx --help stays fast)

    with quiet_transformers(progress_bars=False):
        return _run(s, console, t_start, torch)


@dataclasses.dataclass
class _DemoData:
    """The corpus cut into windows: what every backend trains and evaluates on."""

    docs: list[str]
    tokenizer: Any
    windows: Any
    train: Any
    held: Any
    batches: list
    chars: int
    tokenizer_vocab: int


@dataclasses.dataclass
class _ModelInfo:
    """The model every backend starts from: its initial weights and what its forward calls."""

    eos: int
    init_state: dict
    calls: dict[str, int]
    attn_impl: str
    attn_ok: bool
    parameters: int


def _run(s: Settings, console, t_start: float, torch) -> DemoResult:
    device = _resolve_device(s, console, torch)
    if device is None:
        return DemoResult(2, s, [], {})
    command = reproduce_command(s)
    console.rule("[bold]smx demo")
    if s.vocab_size < 16384 and not s.quick:
        console.print(f"[yellow]note: --vocab-size {s.vocab_size} is below 16K; the LM head and loss are "
                      "smaller than a real model's[/]")
    data = _prepare_data(s, console)
    info = _inspect_model(s, data, device, console, torch)
    runs, report, report_note = _train_backends(s, data, info, device, console)

    agreement = compare(runs, s.tolerance, s.strict_steps, s.late_tolerance, s.grad_tolerance)
    for r in runs:
        r.step1_grads = None  # free the memory
    rows = table_rows(runs, agreement)
    console.rule("results")
    strict = min(s.strict_steps, s.steps)
    print_table(console, rows, agreement["reference"], strict)
    note = loss_memory_note(rows, report, s)
    if note:
        console.print(note)

    s.out.mkdir(parents=True, exist_ok=True)
    keep = next((r for r in runs if r.name == "smx" and r.error is None), None) or next(
        (r for r in reversed(runs) if r.error is None), None)
    eval_batch = data.held[: s.batch_size].to(device)
    ckpt = s.out / "checkpoint"
    ckpt_diff = None
    if keep is not None:
        save_checkpoint(keep.model, data.tokenizer, ckpt)
        ckpt_diff = check_checkpoint(keep.model, ckpt, eval_batch, device)
    plotted = plot_losses(runs, s.out / "loss.png")

    total = time.perf_counter() - t_start
    results = _results_json(s, command=command, device=device, data=data, info=info, runs=runs, rows=rows,
                            agreement=agreement, strict=strict, report=report, report_note=report_note)
    results.update({"checkpoint": {"path": str(ckpt) if keep else None, "backend": keep.name if keep else None,
                                   "reload_max_abs_logit_diff": ckpt_diff},
                    "loss_png": plotted, "total_s": total})
    (s.out / "results.json").write_text(json.dumps(results, indent=2, default=str) + "\n")

    passed = agreement["passed"] and info.attn_ok
    _print_verdict(console, s, rows=rows, agreement=agreement, attn_ok=info.attn_ok, passed=passed, strict=strict)
    if keep is not None:
        console.print(f"saved: {ckpt}/ ({keep.name}-trained model, safetensors + config + tokenizer; reloaded with "
                      f"GPT2LMHeadModel.from_pretrained(..., attn_implementation='eager'): max |Δlogits| {ckpt_diff:.1e})")
    console.print(f"saved: {s.out / 'results.json'}" + (f", {s.out / 'loss.png'}" if plotted else
                                                           " (loss.png skipped: matplotlib is not installed)"))
    console.print(f"total {total:.0f}s. Reproduce with:\n  {command}", highlight=False)
    return DemoResult(0 if passed else 1, s, runs, results, report, eval_batch)


def _resolve_device(s: Settings, console, torch) -> str | None:
    """The device to train on, or None (a message printed) for an unusable device or an unknown backend."""
    device = ("cuda" if torch.cuda.is_available() else "cpu") if s.device == "auto" else s.device
    if device == "cuda" and not torch.cuda.is_available():
        console.print("[red]smx demo: --device cuda but CUDA is not available[/]")
        return None
    unknown = [b for b in s.backends if b != "eager" and not _backend_exists(b)]
    if unknown:
        console.print(f"[red]smx demo: unknown backend(s) {unknown}; available: eager, "
                      f"{', '.join(sorted([*torch._dynamo.list_backends(), *BACKEND_VARIANTS]))}[/]")
        return None
    return device


def _prepare_data(s: Settings, console) -> _DemoData:
    """Load the corpus, train the tokenizer, cut and split the windows, draw the batches; print a summary."""
    started = time.perf_counter()
    docs = load_corpus(s.corpus)
    tokenizer = train_tokenizer(docs, s.vocab_size)
    windows = make_windows(tokenizer, docs, s.seq_len)
    train, held = split_windows(windows)
    if len(held) == 0:
        held = train[-s.batch_size:]
    data = _DemoData(docs=docs, tokenizer=tokenizer, windows=windows, train=train, held=held,
                     batches=make_batches(train, s.steps, s.batch_size, s.seed), chars=sum(map(len, docs)),
                     tokenizer_vocab=tokenizer.get_vocab_size())
    console.print(f"data: {s.corpus} ({len(docs)} documents, {data.chars / 1e6:.2f}M chars) -> BPE vocab "
                  f"{data.tokenizer_vocab} -> {windows.numel() / 1e3:.0f}K tokens, {len(train)} train / {len(held)} "
                  f"eval windows of {s.seq_len}; {s.steps} steps x {s.batch_size} windows "
                  f"({time.perf_counter() - started:.1f}s)")
    if data.tokenizer_vocab < s.vocab_size:
        console.print(f"[yellow]note: the corpus ran out of merges at {data.tokenizer_vocab} tokens; the embedding "
                      f"and LM head keep {s.vocab_size} rows (the rest are never targets, as in a model whose "
                      "vocabulary is padded)"
                      + (". Use --corpus topics+docstrings for a fully learned vocabulary." if s.corpus == "topics"
                         else ".") + "[/]")
    return data


def _inspect_model(s: Settings, data: _DemoData, device: str, console, torch) -> _ModelInfo:
    """Build the model once: its initial weights, and a check that its attention is eager (one softmax per layer)."""
    eos = data.tokenizer.token_to_id(EOT)
    base = build_model(s, eos).to(device)
    calls = count_attention_calls(base, data.batches[0][:1].to(device))
    attn_impl = base.config._attn_implementation
    info = _ModelInfo(eos=eos, init_state=copy.deepcopy(base.state_dict()), calls=calls, attn_impl=attn_impl,
                      attn_ok=attn_impl == "eager" and calls["softmax"] == s.layers and calls["sdpa"] == 0,
                      parameters=sum(p.numel() for p in base.parameters()))
    del base
    console.print(f"model: GPT2LMHeadModel, {s.layers} layers, n_embd {s.n_embd}, {s.heads} heads, vocab "
                  f"{s.vocab_size}, {info.parameters / 1e6:.1f}M parameters, dropout 0 (so backends are comparable), "
                  f"attention {attn_impl!r}: {calls['softmax']} softmax calls per forward, "
                  f"{calls['sdpa']} SDPA calls -> {'verified' if info.attn_ok else 'NOT eager attention'}")
    console.print(f"device: {device}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    return info


def _train_backends(s: Settings, data: _DemoData, info: _ModelInfo, device: str,
                    console) -> tuple[list[BackendRun], Any, str | None]:
    """Train a fresh copy of the model under each backend (the smx report printed first): ``(runs, report, note)``."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    runs: list[BackendRun] = []
    report, report_note = None, None
    for name in s.backends:
        model = build_model(s, info.eos).to(device)
        model.load_state_dict(info.init_state)
        if name == "smx":
            console.rule("smx rewrite report")
            report, report_note = _explain(model, data.batches[0].to(device), console)
            if report is not None:
                console.print(str(report), markup=False, highlight=False)
            else:
                console.print(f"[yellow]note: {report_note}[/]")
            model.load_state_dict(info.init_state)  # explain must not have touched the weights; make sure
        console.rule(f"training: backend={name!r}" + (" (no compile)" if name == "eager" else ""))
        with Progress(TextColumn("[bold]{task.description:>9}"), BarColumn(), MofNCompleteColumn(),
                      TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[ms]}"),
                      TimeElapsedColumn(), console=console, transient=False) as progress:
            task = progress.add_task(name, total=s.steps, loss="-", ms="compiling..." if name != "eager" else "")

            def on_step(i: int, loss: float, dt: float) -> None:
                note = f"step 1 (compile) {dt:.1f}s" if i == 0 else f"{dt * 1e3:.0f} ms/step"
                progress.update(task, advance=1, loss=f"{loss:.4f}", ms=note)

            r = train_backend(name, model, data.batches, s, device, on_step)
        if r.error is None:
            r.eval_loss = evaluate(model, data.held, s.batch_size, device)
            console.print(f"{name}: final loss {r.losses[-1]:.4f}, eval loss {r.eval_loss:.4f}, "
                          f"step 1 {r.first_step_s:.1f}s, median step {r.median_step_s * 1e3:.1f} ms"
                          if r.median_step_s else f"{name}: final loss {r.losses[-1]:.4f}")
        else:
            console.print(f"[red]{name}: FAILED: {r.error}[/]")
        runs.append(r)
        gc.collect()
    return runs, report, report_note


def _results_json(s: Settings, *, command: str, device: str, data: _DemoData, info: _ModelInfo,
                  runs: list[BackendRun], rows: list, agreement: dict, strict: int, report: Any,
                  report_note: str | None) -> dict[str, Any]:
    """``results.json`` without the checkpoint, plot and total time entries (the caller adds them)."""
    import torch

    return {
        "command": command,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(s).items()},
        "environment": {
            "python": platform.python_version(), "torch": torch.__version__,
            "transformers": _version("transformers"), "tokenizers": _version("tokenizers"),
            "device": device, "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "inductor_cache_dir": _inductor_cache_dir(),
        },
        "data": {"corpus": s.corpus, "documents": len(data.docs), "chars": data.chars,
                 "tokenizer_vocab": data.tokenizer_vocab, "tokens": int(data.windows.numel()),
                 "train_windows": len(data.train), "eval_windows": len(data.held)},
        "model": {"class": "GPT2LMHeadModel", "parameters": info.parameters, "layers": s.layers, "n_embd": s.n_embd,
                  "heads": s.heads, "vocab_size": s.vocab_size, "dropout": 0.0,
                  "attn_implementation": info.attn_impl, "softmax_calls_per_forward": info.calls["softmax"],
                  "sdpa_calls_per_forward": info.calls["sdpa"], "eager_attention_verified": info.attn_ok},
        "backends": {r.name: {"losses": r.losses, "step_ms": [t * 1e3 for t in r.step_s], "eval_loss": r.eval_loss,
                              "peak_mem_bytes": r.peak_mem_bytes, "mem_method": r.mem_method, "error": r.error}
                     for r in runs},
        "table": rows,
        "table_markdown": markdown_table(rows, agreement["reference"], strict),
        "agreement": agreement,
        "report": report.to_dict() if report is not None else None,
        "report_note": report_note,
    }


def _print_verdict(console, s: Settings, *, rows: list, agreement: dict, attn_ok: bool, passed: bool,
                   strict: int) -> None:
    """Why each disagreeing backend disagrees, then PASS or FAIL."""
    for r in rows:
        if not r["agrees"]:
            console.print(f"[red]{r['backend']}: {r['why']}[/]")
    if not attn_ok:
        console.print("[red]eager attention was not what ran (expected one softmax per layer and no SDPA)[/]")
    ref = agreement["reference"]
    verdict = (f"[bold green]PASS[/]: every backend matches {ref}: step-1 gradients within {s.grad_tolerance:g}, "
               f"losses of steps 1-{strict} within {s.tolerance:g} (relative), "
               f"last-{min(LATE_WINDOW, s.steps)}-step mean and held-out loss within {s.late_tolerance:g}"
               if passed else "[bold red]FAIL[/]: backends disagree (see above)")
    console.print(verdict)


def _backend_exists(name: str) -> bool:
    import torch

    if name in BACKEND_VARIANTS:
        return True

    try:
        torch._dynamo.lookup_backend(name)
        return True
    except Exception:
        return False


def _inductor_cache_dir() -> str | None:
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        return cache_dir()
    except Exception:
        return os.environ.get("TORCHINDUCTOR_CACHE_DIR")


def _version(dist: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(dist)
    except Exception:
        return None


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m smx_app.demo [options]``: the same as ``smx demo``."""
    return run(build_parser().parse_args(argv))
