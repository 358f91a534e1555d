#!/usr/bin/env python
"""Small eager-attention causal LMs (GPT-2, Llama with GQA, gpt-oss with sinks; transformers, random weights) for
one inference or training step under eager, Inductor, smx and SDPA + Inductor, each in a fresh process: step time,
peak memory above the pre-step RSS, and logits, loss and gradients against eager's. Columns: benchmarks/README.md.

  python benchmarks/bench_attention.py [--quick] [--models gpt2,llama] [--seq 1024,4096] [--modes infer,train]
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import common
import workers
from common import GB, MB, NOISY, fmt_num
from workers import say

MODELS = ("gpt2", "llama", "gpt_oss")
MODES = ("infer", "train")
VARIANTS = ("eager", "inductor", "smx", "sdpa")
QUICK_SEQ = [128, 256]
DEFAULT_SEQ = [1024, 4096]
#: parameters whose gradients are compared (those present in the model)
GRAD_PARAMS = {
    "gpt2": ("transformer.h.0.attn.c_attn.weight", "transformer.h.0.attn.c_proj.weight", "transformer.wte.weight"),
    "llama": ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
              "model.layers.0.self_attn.v_proj.weight", "model.embed_tokens.weight"),
    "gpt_oss": ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.sinks",
                "model.layers.1.self_attn.sinks", "model.embed_tokens.weight"),
}


def default_rounds(seq: int, quick: bool) -> int:
    return 1 if quick else (3 if seq <= 2048 else 2)


def build_model(spec: dict, attn: str):
    """The model of ``spec`` with random weights seeded by spec['seed'], attention ``attn``, dropout 0."""
    import torch
    import transformers

    torch.manual_seed(spec["seed"])
    h, heads, layers, vocab = spec["hidden"], spec["heads"], spec["layers"], spec["vocab"]
    common_kw = dict(vocab_size=vocab, bos_token_id=0, eos_token_id=0, attn_implementation=attn)
    decoder_kw = dict(common_kw, hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=spec["kv_heads"], max_position_embeddings=max(spec["seq"], 1024),
                      attention_dropout=0.0, pad_token_id=0)
    if spec["model"] == "gpt2":
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_positions=max(spec["seq"], 1024), n_embd=h, n_layer=layers, n_head=heads, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0, summary_first_dropout=0.0, **common_kw))
        model.loss_type = "ForCausalLM"  # else a warning_once inside forward: a Dynamo graph break before the loss
    elif spec["model"] == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(intermediate_size=2 * h, **decoder_kw))
    elif spec["model"] == "gpt_oss":  # attention sinks; sliding (128) and full layers alternate; 4 experts
        model = transformers.GptOssForCausalLM(transformers.GptOssConfig(
            intermediate_size=h, head_dim=h // heads, num_local_experts=4, num_experts_per_tok=2, sliding_window=128,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **decoder_kw))
    else:
        raise ValueError(spec["model"])
    model.config._attn_implementation = attn
    assert model.config._attn_implementation == attn, model.config._attn_implementation
    bad = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Dropout) and m.p != 0]
    assert not bad, f"dropout not 0 in {bad}"
    return model


def check(spec: dict, out: dict, logits, loss, grads: dict, attn: str) -> tuple[bool, dict]:
    """Logits, loss and gradients against eager's (saved by the eager or reference worker), all finite."""
    import torch

    chk: dict[str, Any] = {}
    ok = all(bool(torch.isfinite(t).all()) for t in [logits] + ([loss] if loss is not None else [])
             + [g for g in grads.values() if g is not None])
    missing = [n for n, g in grads.items() if g is None]
    if missing:
        ok, chk["why"] = False, "no gradient for " + ", ".join(missing)
    elif not ok:
        chk["why"] = "non-finite logits, loss or gradient"
    if spec["variant"] in ("eager", "reference"):
        torch.save({"logits": logits, "loss": loss, "grads": grads, "param_checksum": out["param_checksum"],
                    "by": "eager" if attn == "eager" else "the same model with attn_implementation='sdpa', "
                                                        "not compiled"}, spec["ref"])
        if spec["variant"] == "eager":
            chk.update(logits_rel=0.0, against="itself (reference)", **({"loss_rel": 0.0, "grad_rel": 0.0}
                                                                       if loss is not None else {}))
        return ok, chk
    if not ok:
        return ok, chk
    if not os.path.exists(spec["ref"]):
        return False, dict(chk, why="no reference to compare with")
    ref = torch.load(spec["ref"], mmap=True, weights_only=True)
    chk["against"] = ref["by"]
    if ref["param_checksum"] != out["param_checksum"]:
        ok, chk["why"] = False, "weights differ from the reference's (model init not reproducible?)"
    rel = lambda a, b: float((a - b).abs().max()) / max(float(b.abs().max()), 1e-30)  # noqa: E731
    chk["logits_rel"] = rel(logits, ref["logits"])
    if loss is not None:
        chk["loss_rel"] = abs(float(loss) - float(ref["loss"])) / max(abs(float(ref["loss"])), 1e-30)
        chk["grad_rel_per_param"] = per = {n: rel(g, ref["grads"][n]) for n, g in grads.items()}
        chk["grad_rel"] = max(per.values()) if per else 0.0
    bad = [f"{k} {chk[k]:.1e} > {spec[t]:.0e}" for k, t in
           (("logits_rel", "logits_rtol"), ("loss_rel", "loss_rtol"), ("grad_rel", "grad_rtol"))
           if k in chk and chk[k] > spec[t]]
    if bad and ok:
        ok, chk["why"] = False, "outside tolerance: " + ", ".join(bad)
    return ok, chk


def work(spec: dict, out: dict) -> None:
    """A worker: one (model, seq, mode, variant)'s warm-up and timed steps, its memory and its check."""
    import torch

    torch.set_num_threads(spec["threads"])
    variant, mode = spec["variant"], spec["mode"]
    out["vocab"] = spec["vocab"]
    attn = "sdpa" if variant == "sdpa" or (variant == "reference" and spec.get("ref_attn") == "sdpa") else "eager"
    model = build_model(spec, attn)
    model.train(mode == "train")
    out.update(attn_implementation=attn, params=sum(p.numel() for p in model.parameters()),
               param_checksum=float(sum(p.detach().double().sum() for p in model.parameters())),
               malloc_mmap_threshold=os.environ.get("MALLOC_MMAP_THRESHOLD_"), smxcompile_src=common.source_hash())
    ids = torch.randint(0, spec["vocab"], (spec["batch"], spec["seq"]),
                        generator=torch.Generator().manual_seed(spec["seed"] + 1))
    if variant in ("eager", "reference"):
        fn = model
    elif variant == "smx":
        importlib.import_module("smxcompile")  # registers backend="smx"
        fn = torch.compile(model, backend="smx")
    else:
        fn = torch.compile(model)

    def step():
        if mode == "infer":
            with torch.no_grad():
                return fn(input_ids=ids, use_cache=False).logits, None
        model.zero_grad(set_to_none=True)
        o = fn(input_ids=ids, labels=ids, use_cache=False)
        o.loss.backward()
        return o.logits.detach(), o.loss.detach()

    say(f"{variant}: {spec['model']} ({out['params'] / 1e6:.2f} M params, attn_implementation={attn!r}), "
        f"batch {spec['batch']} x seq {spec['seq']}, {mode}; "
        + ("one untimed step ..." if variant == "reference" else "warm-up step (includes compilation) ..."))
    logits, loss = workers.timed_steps(step, 0 if variant == "reference" else spec["rounds"], out,
                                       lambda: model.zero_grad(set_to_none=True),
                                       lambda dt, peak: f"{dt * 1e3:.1f} ms, peak {peak / MB:.1f} MB")
    out["max_rss_bytes"] = common.rss_bytes("VmRSS")
    if variant == "smx":
        out["smx_report"] = rep = common.smx_report_summary()
        say(f"smx report over {rep['graphs']} graph(s): {rep['sites'] or 'no site'}")
    if variant in ("inductor", "sdpa", "smx"):
        from torch._dynamo.utils import counters

        out["inductor_fuse_attention"] = int(counters["inductor"].get("fuse_attention", 0))
    named = dict(model.named_parameters()) if mode == "train" else {}
    grads = {n: named[n].grad for n in GRAD_PARAMS[spec["model"]] if n in named}
    if loss is not None:
        out["loss"] = float(loss)
    ok, out["check"] = check(spec, out, logits, loss, grads, attn)
    out["status"] = "ok" if ok else "FAILED"
    chk = out["check"]
    figs = ", ".join(f"{k} {chk[k]:.1e}" for k in ("logits_rel", "loss_rel", "grad_rel") if k in chk)
    say(f"saved the reference ({'finite' if ok else chk.get('why')})" if variant == "reference" else
        f"check vs {chk.get('against', '-')}: {figs or '-'} -> {out['status']}"
        + (f" ({chk['why']})" if chk.get("why") else ""))


def attn_matrix_bytes(a: argparse.Namespace, seq: int) -> int:
    """One layer's eager attention scores: batch x heads x seq x seq fp32."""
    return a.batch * a.heads * seq * seq * 4


def estimate_bytes(variant: str, mode: str, seq: int, a: argparse.Namespace) -> int:
    """Rough peak RSS of a worker: libraries and compiled code, O(seq) activations, and for eager attention its
    O(seq^2) scores (about 3 at a time in inference, 3 per layer in training) and the (batch, 1, seq, seq) mask."""
    linear = a.batch * seq * (a.hidden * 24 * a.layers + a.vocab * 4) * 4 * (3 if mode == "train" else 1)
    s, mask = attn_matrix_bytes(a, seq), a.batch * seq * seq * 4
    quad = ((3 * s * a.layers if mode == "train" else 3 * s) + 2 * mask
            if variant in ("eager", "inductor", "reference-eager") else 0)
    return int(1.5 * GB + linear + quad)


def summarize(res: dict) -> dict:
    s: dict[str, Any] = {}
    if res.get("step_s"):
        s["step_ms"] = statistics.median(res["step_s"]) * 1e3
    if res.get("peak_bytes"):
        s["peak_mb"] = max(res["peak_bytes"]) / MB
    return s


def key(r: dict) -> tuple:
    return (r["model"], r["seq"], r["mode"])


def inductor_of(results: list[dict], r: dict) -> dict:
    return next((summarize(x) for x in results if key(x) == key(r) and x["variant"] == "inductor"
                 and x.get("status") == "ok"), {})


def smx_note(r: dict, layers: int) -> str:
    """How many of the layers' attention blocks smx rewrote, and its report's sums."""
    rep = r.get("smx_report")
    if rep is None:
        return ""
    done = rep["sites"].get("attention", {}).get("rewritten", 0)
    flag = f"attention {done}/{layers} rewritten" + ("" if done >= layers else " (NOT all rewritten)")
    return f"{flag}; report: {common.sites_text(rep)}; {rep['graphs']} graph(s)"


def table(results: list[dict], mode: str, layers: int) -> tuple[list[str], list[list[str]]]:
    train = mode == "train"
    head = ["model", "seq", "variant", "step ms (/ind)", "peak MB (/ind)", "warm-up s", "dlogits"] \
        + (["dloss", "dgrad"] if train else []) + ["check", "others", "smx report / note"]
    rows = []
    for r in (r for r in results if r["mode"] == mode and r["variant"] != "reference"):
        s, ind, st, chk = summarize(r), inductor_of(results, r), r.get("status", "?"), r.get("check", {})

        def rat(k: str) -> str:
            return "-" if k not in s else fmt_num(s[k]) + (f" ({s[k] / ind[k]:.2f}x)" if r["variant"] != "inductor"
                                                           and ind.get(k) else "")

        note = smx_note(r, layers) if r["variant"] == "smx" else ""
        if r["variant"] in ("inductor", "sdpa") and r.get("inductor_fuse_attention"):
            note = f"Inductor's own SDPA pattern fired {r['inductor_fuse_attention']}x"
        if chk.get("against") not in (None, "eager", "itself (reference)"):
            note = (note + f"; checked against {chk['against']}").lstrip("; ")
        if st not in ("ok", "FAILED"):
            note = (r.get("error") or "")[:140]
        elif st == "FAILED":
            note = (note + " " + chk.get("why", "")).strip()
        rel = [f"{chk[k]:.1e}" if k in chk else "-" for k in ("logits_rel",) + (("loss_rel", "grad_rel") if train
                                                                                else ())]
        rows.append([r["model"], str(r["seq"]), r["variant"], rat("step_ms"), rat("peak_mb"),
                     fmt_num(r.get("warmup_s"), 1), *rel, st,
                     f"{r['others']:.2f}" if r.get("others") is not None else "-", note])
    return head, rows


def findings(results: list[dict], seqs: list[int]) -> list[str]:
    """smx / inductor and smx / eager step time per point (issue 4's goal: 2x faster than Inductor), and the
    exponent k of peak memory ~ seq^k (about 2 for materialized scores, 1 for a fused attention)."""
    lines = []
    ok = [r for r in results if r.get("status") == "ok" and r["variant"] != "reference" and summarize(r)]
    for mode in MODES:
        for other in ("inductor", "eager"):
            pts = [(f"{r['model']}@{r['seq']}", summarize(r)["step_ms"] / o["step_ms"]) for r in ok
                   if r["variant"] == "smx" and r["mode"] == mode
                   for o in [next((summarize(x) for x in ok if key(x) == key(r) and x["variant"] == other), None)]
                   if o and o.get("step_ms")]
            if not pts:
                continue
            line = f"{mode}: smx / {other} step time: " + ", ".join(f"{n} {v:.2f}x" for n, v in pts)
            if other == "inductor":
                slow = [f"{n} {v:.2f}x" for n, v in pts if v > 0.5]
                line += ("; goal <= 0.50x (2x faster) met at every point" if not slow else
                         f"; goal <= 0.50x (2x faster) not met at {', '.join(slow)}")
            else:
                worst = max(pts, key=lambda p: p[1])
                line += f"; worst {worst[0]} {worst[1]:.2f}x"
            lines.append(line)
    if len(seqs) < 2:
        return lines
    lo, hi = min(seqs), max(seqs)
    at = {(r["model"], r["seq"], r["mode"], r["variant"]): summarize(r) for r in reversed(ok)}
    for mode in MODES:
        parts = [f"{m} {v} {math.log(b['peak_mb'] / a['peak_mb']) / math.log(hi / lo):.2f}" for m in MODELS
                 for v in VARIANTS for a, b in [(at.get((m, lo, mode, v), {}), at.get((m, hi, mode, v), {}))]
                 if a.get("peak_mb") and b.get("peak_mb")]
        if parts:
            lines.append(f"{mode}: peak memory ~ seq^k between seq {lo} and {hi}, k = " + ", ".join(parts))
    return lines


def plot(results: list[dict], modes: list[str], variants: list[str], path: str, title: str) -> str | None:
    """Step time and peak memory vs seq (log-log), a line per variant (colour) and model (line style)."""
    plt = common.pyplot()
    if plt is None:
        return "--plot: " + common.NO_MATPLOTLIB
    import matplotlib.ticker

    fig, axes = plt.subplots(len(modes), 2, figsize=(12, 4.2 * len(modes)), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for mi, mode in enumerate(modes):
        for vi, v in enumerate(variants):
            for model, (ls, mk) in {"gpt2": ("-", "o"), "llama": ("--", "s")}.items():
                pts = sorted((r["seq"], summarize(r)) for r in results if r["mode"] == mode and r["variant"] == v
                             and r["model"] == model and r.get("status") in ("ok", "FAILED") and summarize(r))
                for ci, k in enumerate(("step_ms", "peak_mb")):
                    xs, ys = [p[0] for p in pts if k in p[1]], [p[1][k] for p in pts if k in p[1]]
                    if pts:
                        axes[mi][ci].plot(xs, ys, ls, marker=mk, color=colors[vi % len(colors)], label=f"{model} {v}")
        seqs = sorted({r["seq"] for r in results if r["mode"] == mode})
        for ci, yl in enumerate(("ms per step, median", "peak MB above the pre-step RSS")):
            ax = axes[mi][ci]
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xticks(seqs, [str(x) for x in seqs])
            ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
            for axis in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):
                axis(matplotlib.ticker.FuncFormatter(lambda y, _: f"{y:g}"))
            ax.set_xlabel("sequence length")
            ax.set_ylabel(yl)
            ax.set_title(f"{mode}: {'step time' if ci == 0 else 'peak memory'}", fontsize=9)
            ax.grid(alpha=0.3, which="both")
    handles, labels = axes[0][0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 8), fontsize=8, frameon=False)
    fig.suptitle(title, fontsize=8)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=120)
    return None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", type=common.choice_list(MODELS), default=list(MODELS),
                   help="gpt2,llama,gpt_oss (default all; gpt_oss, with attention sinks, runs no sdpa variant)")
    p.add_argument("--seq", type=common.int_list, help=f"comma-separated sequence lengths (default "
                                                       f"{','.join(map(str, DEFAULT_SEQ))})")
    p.add_argument("--modes", type=common.choice_list(MODES), default=list(MODES), help="infer,train (default both)")
    p.add_argument("--variants", type=common.choice_list(VARIANTS), default=list(VARIANTS),
                   help=f"comma-separated subset of {','.join(VARIANTS)} (default all; eager always runs first)")
    p.add_argument("--rounds", type=int, help="timed steps per variant after the warm-up, median reported "
                                              "(default 3 at seq <= 2048, 2 above; 1 with --quick)")
    p.add_argument("--quick", action="store_true", help=f"smoke run: seq {','.join(map(str, QUICK_SEQ))}, 1 round")
    for name, default, what in (("batch", 1, "sequences per step"), ("layers", 2, "transformer layers"),
                                ("hidden", 256, "hidden size (llama's MLP is 2x)"), ("heads", 4, "attention heads"),
                                ("vocab", 2048, "vocabulary size")):
        p.add_argument(f"--{name}", type=int, default=default, help=f"{what} (default %(default)s)")
    p.add_argument("--kv-heads", type=int, help="llama's key/value heads (default heads // 2: GQA)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=common.cores(), help="torch threads (default: all cores, "
                                                                       "%(default)s here)")
    p.add_argument("--logits-rtol", type=float, default=1e-4, help="max |logits - eager| / max |eager| (default "
                                                                   "%(default)s)")
    p.add_argument("--loss-rtol", type=float, default=1e-4, help="max |loss - eager| / |eager| (default %(default)s)")
    p.add_argument("--grad-rtol", type=float, default=1e-3,
                   help="max |grad - eager| / max |eager grad| over the compared parameters (default %(default)s)")
    workers.worker_flags(p, timeout=900)
    common.add_noise_flags(p, budget=False)
    p.add_argument("--json", metavar="PATH", help="write every figure, the environment and the command to PATH "
                                                  "(rewritten after every variant)")
    p.add_argument("--markdown", action="store_true", help="print the tables as Markdown")
    p.add_argument("--plot", metavar="PATH", help="time and peak memory vs seq (PNG/SVG/PDF; needs matplotlib)")
    args = p.parse_args(argv)
    args.seq = args.seq or (QUICK_SEQ if args.quick else DEFAULT_SEQ)
    args.kv_heads = args.kv_heads or max(1, args.heads // 2)
    if args.hidden % args.heads or args.heads % args.kv_heads:
        p.error("--hidden must be a multiple of --heads, and --heads a multiple of --kv-heads")
    return args


def run_variant(spec: dict, point: str, name: str, workdir: str, limit: int | None, args, results: list[dict],
                log) -> dict:
    """One variant at one point: an untimed reference first when eager's result is missing; skipped when its
    estimated memory does not fit; else its worker (again while other processes disturbed it)."""
    def launch(s: dict, label: str) -> dict:
        return workers.launch(s, workdir, limit, args.variant_timeout, log, __file__, label)

    avail = workers.mem_available()
    room = min(x for x in (limit, (avail - 1 * GB) if avail else None) if x is not None) if (limit or avail) else None
    if name != "eager" and not os.path.exists(spec["ref"]):
        big = estimate_bytes("reference-eager", spec["mode"], spec["seq"], args)
        ref_attn = "eager" if room is None or big <= room else "sdpa"
        log(f"[{point}] reference: eager model, attention {ref_attn!r}, not compiled, untimed")
        ref = launch(dict(spec, variant="reference", ref_attn=ref_attn), f"{point} reference")
        ref.update({k: spec[k] for k in ("model", "seq", "mode")}, variant="reference")
        if ref.get("status") != "ok":
            log(f"[{point}] reference failed: {ref.get('error') or ref.get('check', {}).get('why')}")
        results.append(ref)
    est = estimate_bytes(name, spec["mode"], spec["seq"], args)
    if room is not None and est > room:
        scores = attn_matrix_bytes(args, spec["seq"]) / GB
        why = (f"skipped (needs ~{est / GB:.1f} GB: eager attention holds {scores:.2f} GB of scores per layer; "
               f"{room / GB:.1f} GB usable)")
        log(f"[{point}] {name}: {why}")
        return dict({k: spec[k] for k in ("model", "seq", "mode", "variant")}, status="skipped", error=why,
                    estimated_rss_bytes=est)

    def once() -> dict:
        log(f"[{point} {name}] fresh process (estimated peak RSS {est / GB:.1f} GB)")
        r = launch(spec, f"{point} {name}")
        r.update({k: spec[k] for k in ("model", "seq", "mode", "variant")})
        r["others"] = r.get("other_load_timed", r.get("other_load"))
        return r

    res = workers.least_disturbed(once, args.retry_noisy, args.wait_quiet, log, f"{point} {name}",
                                  others=lambda r: r.get("others"))
    res["estimated_rss_bytes"] = est
    return res


def log_result(res: dict, results: list[dict], done: str, point: str, layers: int, log) -> None:
    s, ind, name = summarize(res), inductor_of(results, res), res["variant"]
    figs = "" if not s else (f", step {s['step_ms']:.1f} ms" + (f" ({s['step_ms'] / ind['step_ms']:.2f}x ind)"
                                                                if ind and name != "inductor" else "")
                             + f", peak {s['peak_mb']:.1f} MB, warm-up {res.get('warmup_s', 0):.1f} s")
    oth = res.get("others")
    log(f"({done}) {point} {name}: {res.get('status')}{figs}" + (f", others {oth:.2f}" if oth is not None else "")
        + (f" -- {res.get('error') or res.get('check', {}).get('why')}" if res.get("status") != "ok" else "")
        + (f" -- {smx_note(res, layers)}" if name == "smx" and res.get("smx_report") else ""))
    if oth is not None and oth > NOISY:
        log(f"WARNING: {point} {name} shared the CPUs with other processes ({oth:.2f} cores): its time is inflated")


def run_all(args, variants: list[str], rounds: dict, limit: int | None, result: dict, log) -> None:
    """Every (model, mode, seq, variant) point in order, the JSON rewritten after each."""
    results, workdir = result["results"], tempfile.mkdtemp(prefix="bench_attention_")
    base = {k: getattr(args, k) for k in ("batch", "layers", "hidden", "heads", "kv_heads", "vocab", "seed",
                                          "threads", "logits_rtol", "loss_rtol", "grad_rtol", "mmap_threshold")}
    total, done = len(args.models) * len(args.seq) * len(args.modes) * len(variants), 0
    try:
        for model in args.models:
            for mode in args.modes:
                for seq in args.seq:
                    point = f"{model} seq={seq} {mode}"
                    for name in variants:
                        if model == "gpt_oss" and name == "sdpa":  # transformers' SDPA path takes no sinks
                            continue
                        spec = dict(base, model=model, seq=seq, mode=mode, variant=name, rounds=rounds[seq],
                                    ref=os.path.join(workdir, f"ref-{model}-{seq}-{mode}.pt"))
                        res = run_variant(spec, point, name, workdir, limit, args, results, log)
                        results.append(res)
                        done += 1
                        log_result(res, results, f"{done}/{total}", point, args.layers, log)
                        common.write_json(args.json, result)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args._worker:
        return workers.run_worker(args._worker, work, ("model", "seq", "mode", "variant"))
    command = common.command_line()
    env = common.environment(args.threads, packages=("transformers",), git=True)
    env.update(mem_total_gb=round((workers.meminfo("MemTotal") or 0) / GB, 1),
               mem_available_gb=round((workers.mem_available() or 0) / GB, 1))
    common.print_header(command, env, "the `others` column says, per variant, whether they shared the CPUs with its "
                                      "timed steps")
    variants = (["eager"] + [v for v in args.variants if v != "eager"]) if "eager" in args.variants else args.variants
    limit = workers.mem_limit(args.mem_limit)
    rounds = {s: args.rounds or default_rounds(s, args.quick) for s in args.seq}
    print(f"models {args.models} (hidden {args.hidden}, {args.heads} heads, llama {args.kv_heads} kv heads, "
          f"{args.layers} layers, vocab {args.vocab}, eager attention, dropout 0, fp32), batch {args.batch}, "
          f"seq {args.seq}, modes {args.modes}, variants {variants}; 1 warm-up + {rounds} timed step(s), one "
          f"fresh process each; memory limit {(limit or 0) / GB:.1f} GB", flush=True)
    settings = {k: getattr(args, k) for k in ("models", "seq", "modes", "batch", "layers", "hidden", "heads",
                                              "kv_heads", "vocab", "seed", "threads", "logits_rtol", "loss_rtol",
                                              "grad_rtol")}
    settings.update(variants=variants, rounds=rounds, mem_limit_bytes=limit, malloc_mmap_threshold=os.environ.get(
        "MALLOC_MMAP_THRESHOLD_") or (args.mmap_threshold or "glibc default (dynamic)"))
    result: dict[str, Any] = {"command": command, "env": env, "settings": settings, "results": []}
    t_start = time.monotonic()
    run_all(args, variants, rounds, limit, result, lambda m: print(f"[{time.monotonic() - t_start:7.1f}s] {m}",
                                                                   flush=True))
    results = result["results"]
    for r in results:
        ind, s = inductor_of(results, r), summarize(r)
        if ind and s:
            r["ratio_vs_inductor"] = {k: s[k] / ind[k] for k in s if ind.get(k)}
        r.update({f"summary_{k}": v for k, v in s.items()})
    shape = (f"batch {args.batch}, hidden {args.hidden}, {args.heads} heads (llama {args.kv_heads} kv), {args.layers} "
             f"layers, vocab {args.vocab}, fp32, CPU ({env['cpu']}, {args.threads} threads)")
    for mode in args.modes:
        what = "forward under no_grad" if mode == "infer" else "forward with labels + loss.backward()"
        common.print_table(f"{mode}: {what}; {shape}; median of {'/'.join(map(str, sorted(set(rounds.values()))))} "
                           "step(s); MB = 1e6 B above the pre-step RSS; (/ind) = ratio to inductor",
                           *table(results, mode, args.layers), args.markdown,
                           left=("variant", "check", "smx report / note"))
    result["findings"] = findings(results, args.seq)
    print("\n".join(["", *result["findings"]]))
    last = next((r for r in results if r["variant"] == "smx" and r.get("smx_report", {}).get("last_report_text")), None)
    if last:
        print(f"\nsmx last_report() at {last['model']} seq={last['seq']} {last['mode']}:\n"
              f"{last['smx_report']['last_report_text']}")
    workers.print_sources(results, ("smx",), lambda r: f"{r['model']} {r['seq']} {r['mode']}")
    mm = next((r.get("mem_method") for r in results if r.get("mem_method")), None)
    if mm:
        print(f"memory: {mm}, MALLOC_MMAP_THRESHOLD_={settings['malloc_mmap_threshold']}; peak = max over rounds "
              "of (VmHWM during the step - VmRSS just before it)")
    if args.plot:
        print(plot(results, args.modes, variants, args.plot, f"{command}\n{shape}") or f"wrote {args.plot}")
    return workers.finish_run(env, result, args.json, command, t_start,
                              lambda r: f"{r['model']} seq={r['seq']} {r['mode']} {r['variant']}")


if __name__ == "__main__":
    sys.exit(main())
