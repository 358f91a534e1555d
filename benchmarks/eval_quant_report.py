"""eval_quant_softmax.py's report: the verdict on its goals, the tables and the plot of its results."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

SETTINGS: list[tuple[str, Any, str]] = [
    ("none", False, "tensor"), ("offset/head", "offset", "head"), ("offset/tensor", "offset", "tensor"),
    ("offset/position", "offset", "position"), ("scale/head", "scale", "head"), ("scale/tensor", "scale", "tensor")]
SETTING_NAMES = [s[0] for s in SETTINGS]
GOAL_8BIT_PCT = 1.0


@dataclasses.dataclass
class Config:
    checkpoints: list[Path]
    bits: list[int]
    settings: list[tuple[str, Any, str]]
    calib_batches: int = 0
    eval_batches: int = 0
    stats_batches: int = 0
    batch_size: int = 0
    calib_seed: int = 0
    seq_len: int | None = None
    corpus: str | None = None
    device: str = "cpu"
    quick: bool = False


def verdict(results: list[dict[str, Any]], cfg: Config) -> dict[str, Any]:
    """The goals: 8-bit within 1% of fp32 with a correction; a correction beats none (perplexity; and KL, fidelity);
    the settings ranked per bit width."""
    by = {(r["checkpoint"], r["bits"], r["setting"]): r for c in results for r in c["rows"]}
    labels, names = [c["label"] for c in results], [s[0] for s in cfg.settings]
    corrected = [s[0] for s in cfg.settings if s[1]]
    points = [(lb, b, f"{lb}/{b}") for lb in labels for b in cfg.bits]

    def summed(g: dict, per: dict) -> dict:
        return dict(g, per_setting=per, met_by=[n for n in corrected if per[n]["met"]],
                    missed_by=[n for n in corrected if not per[n]["met"]], met=any(per[n]["met"] for n in corrected))

    g1: dict[str, Any] = {"goal": f"with a correction, 8-bit perplexity within {GOAL_8BIT_PCT:g}% of fp32 on every "
                                  "checkpoint"}
    if 8 in cfg.bits:
        g1 = summed(g1, {n: {"met": all(abs(by[(lb, 8, n)]["rel_change_pct"]) <= GOAL_8BIT_PCT for lb in labels),
                             "rel_change_pct": {lb: by[(lb, 8, n)]["rel_change_pct"] for lb in labels},
                             "rel_change_ci95_pct": {lb: by[(lb, 8, n)].get("rel_change_ci95_pct") for lb in labels}}
                         for n in names})
        g1["uncorrected_also_within"] = g1["per_setting"].get("none", {}).get("met")
    else:
        g1.update(met=None, note="8 not in --bits: not evaluated")
    g2: dict[str, Any] = {"goal": "a correction gives lower perplexity than no correction at every bit width, on "
                                  "every checkpoint"}
    g3: dict[str, Any] = {"goal": "a correction gives a lower KL to the fp32 model than no correction at every bit "
                                  "width, on every checkpoint"}
    if "none" in names and corrected:
        per2, per3 = {}, {}
        for n in corrected:
            pair = {p: (by[(lb, b, n)], by[(lb, b, "none")]) for lb, b, p in points}
            fails = [{"checkpoint": lb, "bits": b, "ppl": pair[p][0]["ppl"], "ppl_none": pair[p][1]["ppl"]}
                     for lb, b, p in points if not pair[p][0]["ppl"] < pair[p][1]["ppl"]]
            per2[n] = {"met": not fails, "failures": fails,
                       "ppl_change_vs_none_pct": {p: 100.0 * (r["ppl"] / o["ppl"] - 1.0) for p, (r, o) in pair.items()},
                       "ppl_change_vs_none_ci95_pct": {p: r.get("vs_none_ci95_pct") for p, (r, o) in pair.items()},
                       "better_beyond_ci95_at": [p for p, (r, o) in pair.items() if r.get("vs_none_ci95_pct")
                                                 and r["vs_none_ci95_pct"][1] < 0],
                       "rowsum_err_not_lower_at": [p for p, (r, o) in pair.items()
                                                   if not r["mean_abs_rowsum_err"] < o["mean_abs_rowsum_err"]]}
            kl_fails = [p for p, (r, o) in pair.items() if not r["kl_to_fp32"] < o["kl_to_fp32"]]
            per3[n] = {"met": not kl_fails, "not_lower_at": kl_fails,
                       "kl_ratio_to_none": {p: r["kl_to_fp32"] / o["kl_to_fp32"] for p, (r, o) in pair.items()}}
        g2, g3 = summed(g2, per2), summed(g3, per3)
    else:
        g2.update(met=None, note="needs 'none' and at least one correction setting")
        g3["met"] = None
    ranking = {}
    for bits in cfg.bits:
        mean = {n: sum(by[(lb, bits, n)]["rel_change_pct"] for lb in labels) / len(labels) for n in names}
        ranking[str(bits)] = {"ranking": sorted(mean, key=mean.get), "mean_rel_change_pct": mean}
    return {"goal_8bit_within_1pct": g1, "goal_correction_beats_none": g2, "kl_correction_beats_none": g3,
            "ranking_by_bits": ranking}


def ci(c: list[float] | None) -> str:
    return f" [{c[0]:+.3f}, {c[1]:+.3f}]" if c else ""


def print_verdict(v: dict[str, Any], console) -> None:
    console.rule("verdict")
    mark = lambda g: "[green]MET[/]" if g["met"] else "[red]NOT MET[/]"  # noqa: E731
    g1, g2, g3 = v["goal_8bit_within_1pct"], v["goal_correction_beats_none"], v.get("kl_correction_beats_none", {})
    console.print(f"goal 1 ({g1['goal']}): " + (g1.get("note") if g1.get("met") is None else mark(g1)))
    for name, d in g1.get("per_setting", {}).items():
        rel = ", ".join(f"{lb} {x:+.3f}%{ci(d['rel_change_ci95_pct'].get(lb))}" for lb, x in d["rel_change_pct"].items())
        console.print(f"  {name:15s} {'meets' if d['met'] else 'misses':6s} ({rel})"
                      + ("  [dim](no correction: reference)[/]" if name == "none" else ""))
    if g1.get("uncorrected_also_within"):
        console.print("  note: the uncorrected 8-bit model is within the bound too: this goal does not separate the "
                      "corrections from no correction on these checkpoints")
    console.print(f"goal 2 ({g2['goal']}): " + (g2.get("note") if g2.get("met") is None else mark(g2)
                                                + "   [dim](perplexity change vs none per checkpoint/bits, [95% paired "
                                                  "bootstrap over held-out windows])[/]"))
    for name, d in g2.get("per_setting", {}).items():
        cis = d["ppl_change_vs_none_ci95_pct"]
        m = ", ".join(f"{k} {x:+.3f}%{ci(cis.get(k))}" for k, x in d["ppl_change_vs_none_pct"].items())
        fails = ", ".join(f"{x['checkpoint']}/{x['bits']}-bit {x['ppl']:.3f} >= {x['ppl_none']:.3f}"
                          for x in d["failures"])
        console.print(f"  {name:15s} " + (f"meets   (perplexity vs none: {m})" if d["met"] else
                                          f"misses  at {fails}  (perplexity vs none: {m})"))
        console.print(f"  {'':13s} better beyond the 95% paired-bootstrap interval at {len(d['better_beyond_ci95_at'])} "
                      f"of {len(d['ppl_change_vs_none_pct'])} checkpoint/bit-width points")
        if d["rowsum_err_not_lower_at"]:
            console.print(f"  {'':13s} mean |row sum - 1| not below none's at {', '.join(d['rowsum_err_not_lower_at'])}")
    if g3.get("met") is not None:
        console.print(f"fidelity ({g3['goal']}): {mark(g3)}   [dim](KL / KL without correction per checkpoint/bits)[/]")
        for name, d in g3["per_setting"].items():
            r = ", ".join(f"{k} {x:.2f}" for k, x in d["kl_ratio_to_none"].items())
            console.print(f"  {name:15s} {'meets ' if d['met'] else 'misses at ' + ', '.join(d['not_lower_at'])}  ({r})")
    console.print("best setting per bit width (mean perplexity change vs fp32 over checkpoints):")
    for bits, d in v["ranking_by_bits"].items():
        console.print(f"  {bits}-bit: " + " < ".join(f"{n} ({d['mean_rel_change_pct'][n]:+.3f}%)" for n in d["ranking"]))


def markdown_table(results: list[dict[str, Any]]) -> str:
    """One row per checkpoint x bits x setting, and the fp32 row of each checkpoint; brackets: 95% paired-bootstrap
    intervals over the held-out windows."""
    lines = ["| checkpoint | bits | setting | perplexity | Δ vs fp32 (%) [95% CI] | Δ vs none (%) [95% CI] "
             "| KL to fp32 (nats/token) | mean abs(row sum − 1) | zero fraction |", "|---|---|---|---|---|---|---|---|---|"]
    for c in results:
        lines.append(f"| {c['label']} | fp32 | - | {c['fp32']['ppl']:.3f} | - | - | - | - | - |")
        for r in c["rows"]:
            vs = "-" if r["setting"] == "none" or r.get("vs_none_pct") is None else \
                f"{r['vs_none_pct']:+.3f}{ci(r.get('vs_none_ci95_pct'))}"
            lines.append(f"| {r['checkpoint']} | {r['bits']} | {r['setting']} | {r['ppl']:.3f} | "
                         f"{r['rel_change_pct']:+.3f}{ci(r.get('rel_change_ci95_pct'))} | {vs} | "
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
    """Four panels against bits: perplexity vs fp32 (fp32 the line at 0), KL to fp32, mean |row sum - 1|, zero
    fraction; colour: setting, line style: checkpoint, settings nudged apart along x so equal values stay visible."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    style = {"none": ("tab:gray", "o", 0.0), "scale/head": ("tab:blue", "s", -0.15),
             "scale/tensor": ("tab:cyan", "D", -0.1), "offset/head": ("tab:red", "^", 0.05),
             "offset/tensor": ("tab:orange", "v", 0.1), "offset/position": ("tab:purple", "P", 0.15)}
    styles, style_names = ["-", "--", ":", "-."], ["solid", "dashed", "dotted", "dash-dot"]
    fig, axes = plt.subplots(1, 4, figsize=(22, 5.2))
    bits = sorted(cfg.bits)
    axes[0].axhline(0.0, color="black", lw=1.2, label="fp32 = 0 (" + ", ".join(
        f"{x['label']}: {x['fp32']['ppl']:.1f}" for x in results) + ")")
    for ci_, c in enumerate(results):
        by = {(r["bits"], r["setting"]): r for r in c["rows"]}
        for name, _, _ in cfg.settings:
            color, marker, nudge = style[name]
            kw = dict(ls=styles[ci_ % len(styles)], marker=marker, color=color, ms=5, lw=1.4, label=f"{name} "
                                                                                                  f"({c['label']})")
            xs = [b + nudge for b in bits]
            for ax, f in zip(axes, (lambda r: r["rel_change_pct"], lambda r: r.get("kl_to_fp32", float("nan")),
                                    lambda r: r["mean_abs_rowsum_err"], lambda r: 100 * r["zero_fraction"])):
                ax.plot(xs, [f(by[(b, name)]) for b in bits], **kw)
    axes[0].set_yscale("symlog", linthresh=0.01)
    axes[1].set_yscale("log")
    axes[2].set_yscale("log")
    for ax, title, ylabel in zip(axes, ("held-out perplexity vs fp32 (black line: fp32)",
                                        "KL(fp32 || quantized), next-token distributions",
                                        "mean |row sum − 1| of the attention probabilities",
                                        "unmasked probabilities quantized to zero"),
                                 ("perplexity change vs fp32, % (symlog: linear within ±0.01%)", "nats per token", None,
                                  "% of the unmasked entries")):
        ax.set_title(title)
        if ylabel:
            ax.set_ylabel(ylabel)
        ax.set_xlabel("bits (settings nudged apart)")
        ax.set_xticks(bits)
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(6, len(labels)), fontsize=7.5, frameon=False)
    fig.suptitle("smxcompile.quantize_softmax, attention softmax of smx-demo GPT-2 checkpoints "
                 + ", ".join(f"{c['label']} ({style_names[i % len(styles)]})" for i, c in enumerate(results))
                 + f": {results[0]['eval_tokens']} held-out tokens each")
    fig.tight_layout(rect=(0, 0.035 * -(-len(labels) // min(6, len(labels))) + 0.01, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def replot(json_path: Path, plot_path: Path) -> None:
    """Redraw the plot from an earlier --json file."""
    doc = json.loads(json_path.read_text())
    results = [dict(c, rows=[r for r in doc["results"] if r["checkpoint"] == c["label"]]) for c in doc["checkpoints"]]
    names = [s["name"] for s in doc["config"]["settings"]]
    plot(results, Config([], doc["config"]["bits"], [s for s in SETTINGS if s[0] in names]), plot_path)
