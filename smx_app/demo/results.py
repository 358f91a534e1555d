"""``smx demo`` results: the side-by-side table (rich, and markdown for docs/PERFORMANCE.md), the note on
the loss's memory, the checkpoint (saved, then reloaded and checked) and the loss plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .data import EOT
from .training import BackendRun


def table_rows(runs: list[BackendRun], agreement: dict[str, Any]) -> list[dict[str, Any]]:
    """One JSON-ready row per backend: the figures the side-by-side table shows."""
    med = {r.name: r.median_step_s for r in runs if r.error is None}
    rows = []
    for r in runs:
        a = agreement["backends"][r.name]
        m = r.median_step_s
        rows.append({
            "backend": r.name,
            "final_loss": r.losses[-1] if r.losses and r.error is None else None,
            "eval_loss": r.eval_loss,
            "max_abs_diff_vs_ref": a["max_abs_diff"],
            "max_rel_diff_vs_ref": a["max_rel_diff"],
            "strict_max_rel_diff": a["strict_max_rel_diff"],
            "grad_max_rel_err": a["grad_max_rel_err"],
            "late_rel_diff": a["late_rel_diff"],
            "compile_s": r.compile_s if r.error is None else None,
            "first_step_s": r.first_step_s,
            "median_step_ms": m * 1e3 if m else None,
            "min_step_ms": min(r.step_s[1:]) * 1e3 if len(r.step_s) > 1 else None,
            "speedup_vs_eager": med["eager"] / m if m and med.get("eager") else None,
            "speedup_vs_inductor": med["inductor"] / m if m and med.get("inductor") else None,
            "peak_mem_mb": r.peak_mem_bytes / 2**20 if r.peak_mem_bytes is not None else None,
            "agrees": a["agrees"],
            "why": a["why"],
        })
    return rows


def _fmt(v: Any, spec: str, none: str = "-") -> str:
    return none if v is None else format(v, spec)


def print_table(console, rows: list[dict[str, Any]], reference: str | None, strict_steps: int) -> None:
    """Print the side-by-side table of backends with rich."""
    from rich.table import Table

    t = Table(title="smx demo: same model, same batches, per backend", title_justify="left")
    t.caption = (f"loss: last step; eval: held-out loss; max|Δ|: largest |loss - {reference}| over all steps; "
                 "grad: worst relative error of a parameter's gradient at step 1; "
                 f"rel 1-{strict_steps}: largest relative loss difference over the strictly checked steps; "
                 "compile: step 1 minus a steady step; ms/step: median of steps 2..N; "
                 "×eager/×ind: speed relative to eager/inductor (>1 = faster); peak MB: memory increase during steps 2..N. "
                 "Backends compiled later may reuse kernels Inductor already compiled and cached on disk, "
                 "which shortens their compile time.")
    t.caption_justify = "left"
    for col, just in [("backend", "left"), ("loss", "right"), ("eval", "right"), ("max|Δ|", "right"),
                      ("grad", "right"), (f"rel 1-{strict_steps}", "right"), ("compile s", "right"), ("ms/step", "right"),
                      ("×eager", "right"), ("×ind", "right"), ("peak MB", "right"), ("agrees", "center")]:
        t.add_column(col, justify=just, no_wrap=True)
    for r in rows:
        t.add_row(
            r["backend"],
            _fmt(r["final_loss"], ".4f"),
            _fmt(r["eval_loss"], ".4f"),
            _fmt(r["max_abs_diff_vs_ref"], ".1e"),
            _fmt(r["grad_max_rel_err"], ".1e"),
            _fmt(r["strict_max_rel_diff"], ".1e"),
            _fmt(r["compile_s"], ".1f"),
            _fmt(r["median_step_ms"], ".1f"),
            _fmt(r["speedup_vs_eager"], ".2f"),
            _fmt(r["speedup_vs_inductor"], ".2f"),
            _fmt(r["peak_mem_mb"], ".0f"),
            "[green]yes[/]" if r["agrees"] else "[red]NO[/]",
        )
    console.print(t)


def loss_memory_note(rows: list[dict[str, Any]], rep, s) -> str:
    """One line on what smx's cut cross-entropy did to memory (vs inductor), or "" when not measured."""
    by = {r["backend"]: r for r in rows}
    smx = next((by[n] for n in ("smx", "smx-rewrite") if n in by and by[n].get("peak_mem_mb") is not None), None)
    ind = by.get("inductor")
    if smx is None or ind is None or ind.get("peak_mem_mb") is None:
        return ""
    n_ce = rep.count(kind="linear_cross_entropy", action="rewritten") if rep is not None else 0
    tokens = s.batch_size * s.seq_len
    buf_mb = tokens * s.vocab_size * 4 / 2**20
    saved = ind["peak_mem_mb"] - smx["peak_mem_mb"]
    head = (f"loss memory: the logits are {tokens} tokens x {s.vocab_size} classes = {buf_mb:.0f} MB per fp32 buffer; "
            f"{smx['backend']} peaks {abs(saved):.0f} MB {'below' if saved >= 0 else 'above'} inductor "
            f"({smx['peak_mem_mb']:.0f} vs {ind['peak_mem_mb']:.0f} MB)")
    if not n_ce:
        return head + ": no cut cross-entropy rewrite fired, so the loss's buffers are Inductor's."
    return (head + f" with linear -> cross-entropy rewritten to cut CE ({n_ce} site{'s' if n_ce != 1 else ''}). "
            "The logits the model returns stay; their fp32 copy, log-softmax and gradient are gone.")


def markdown_table(rows: list[dict[str, Any]], reference: str | None, strict_steps: int) -> str:
    """The same table as GitHub markdown (for docs/PERFORMANCE.md)."""
    head = ["backend", "final loss", "eval loss", f"max abs Δloss vs {reference}",
            "max rel Δgrad, step 1", f"max rel Δloss, steps 1-{strict_steps}", "compile (s)",
            "step (ms, median)", "× eager", "× inductor", "peak mem (MB)", "agrees"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append("| " + " | ".join([
            r["backend"], _fmt(r["final_loss"], ".4f"), _fmt(r["eval_loss"], ".4f"),
            _fmt(r["max_abs_diff_vs_ref"], ".1e"), _fmt(r["grad_max_rel_err"], ".1e"),
            _fmt(r["strict_max_rel_diff"], ".1e"), _fmt(r["compile_s"], ".1f"),
            _fmt(r["median_step_ms"], ".1f"), _fmt(r["speedup_vs_eager"], ".2f"),
            _fmt(r["speedup_vs_inductor"], ".2f"), _fmt(r["peak_mem_mb"], ".0f"),
            "yes" if r["agrees"] else "NO"]) + " |")
    return "\n".join(lines)


# --------------------------------------------------------------------------- artifacts


def save_checkpoint(model, tokenizer, folder: Path) -> None:
    """Save ``model`` (safetensors + config) and the tokenizer (``tokenizer.json`` + HF files) into ``folder``."""
    from transformers import PreTrainedTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=EOT, eos_token=EOT, unk_token=EOT,
                                     model_max_length=model.config.n_positions)
    hf_tok.save_pretrained(folder)


def check_checkpoint(model, folder: Path, batch, device: str) -> float:
    """Reload ``folder`` with ``from_pretrained`` and return max |Δlogits| against ``model`` on ``batch``.

    The attention implementation is not part of ``config.json``; transformers would
    pick SDPA (equal up to ~1e-6), so the reload asks for eager attention, as trained.
    """
    import torch
    from transformers import GPT2LMHeadModel

    loaded = GPT2LMHeadModel.from_pretrained(folder, attn_implementation="eager").to(device).eval()
    model.eval()
    with torch.no_grad():
        diff = (loaded(input_ids=batch).logits - model(input_ids=batch).logits).abs().max().item()
    model.train()
    return diff


def plot_losses(runs: list[BackendRun], path: Path) -> bool:
    """Write a loss-curve plot when matplotlib is importable; returns whether it did."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for r in runs:
        if r.losses:
            ax.plot(range(1, len(r.losses) + 1), r.losses, label=r.name, linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title("smx demo: GPT-2 on pydoc text")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
