#!/usr/bin/env python
"""Eager-attention causal LMs (GPT-2, Llama, gpt-oss from transformers), side by side: eager, Inductor, smx,
SDPA+Inductor.

What is measured: one step of a small causal LM built from a config with random weights (nothing is
downloaded), attn_implementation="eager" (so every layer's attention is the textbook
matmul(q, k^T) -> scale -> causal mask -> softmax -> dropout -> matmul(p, v)), every dropout 0,
use_cache=False, fp32, on CPU, batch --batch of token ids of length seq:

  gpt2   GPT2LMHeadModel: n_embd --hidden (256), --heads (4) heads, --layers (2), vocab --vocab (2048)
  llama  LlamaForCausalLM: hidden --hidden (256), --heads (4) heads, --kv-heads (2: grouped-query
         attention), intermediate 2 x hidden (512), --layers (2), vocab --vocab (2048), untied head
  gpt_oss GptOssForCausalLM: as llama, plus a learned attention sink per head, a 128-key sliding
         window on every other layer, 4 experts (2 per token); no sdpa variant (sinks need eager)

The vocabulary is small on purpose, so that the LM head does not hide the attention. The eager
attention materializes batch x heads x seq x seq scores per layer (O(seq^2) memory and time); a
fused attention kernel (flash attention) keeps O(seq) memory.

Modes (--modes):

  infer     model.eval(), under torch.no_grad(): forward only, the logits.
  train     model.train(), forward with labels = input_ids (the model's causal-LM loss) and
            loss.backward(); the parameter gradients are set to None before each step.

Variants (--variants), each in its own fresh subprocess:

  eager     the model as built, not compiled: the reference of every check.
  inductor  torch.compile(model) (Inductor, the default backend): the yardstick of every ratio (/ind).
  smx       torch.compile(model, backend="smx"): the smx backend rewrites each eager attention block
            into one fused attention call (torch's SDPA flash kernel on CPU; the constant causal
            mask becomes is_causal=True), the rest goes to Inductor. The "smx report" column sums
            the smx reports of every graph compiled in that process ({kind: action counts}, e.g.
            "attention: 2 rewritten") and says how many of the --layers attention blocks were
            rewritten, so a run shows whether the rewrite fired.
  sdpa      the same model built with attn_implementation="sdpa" (transformers calls
            F.scaled_dot_product_attention itself) and compiled with Inductor: a reference for what
            torch's own fused attention gives, not a rewrite.

Metrics, per (model, seq, mode, variant):

  step ms     wall time of one step (forward, or forward + backward), the median of --rounds timed
              steps (default 3 at seq <= 2048, 2 above; 1 with --quick) after one warm-up step.
  warm-up s   that first step: Dynamo + Inductor compilation (Inductor's on-disk cache may make a
              second run's warm-up shorter) + the first run.
  peak MB     peak resident memory of the process during one step ABOVE its resident memory just
              before the step (model, inputs, compiled code and libraries already resident; no
              gradients yet in train mode, so they are included). Same meter as
              bench_linear_ce.py: /proc/self/status VmHWM after a reset with /proc/self/clear_refs,
              freed heap returned first with glibc's malloc_trim, glibc's mmap threshold fixed at
              --mmap-threshold (1 MiB) so RSS follows the live buffers. Max over the rounds.
              MB = 10^6 bytes. Includes the logits (batch x seq x vocab x 4 bytes, 33.6 MB at
              seq 4096 with vocab 2048), which every variant must produce.
  dlogits     max |logits - eager's| / max |eager's logits| (same weights, same token ids).
  dloss       train: |loss - eager's| / |eager's loss|.
  dgrad       train: the worst over a few parameter gradients of max |grad - eager's| / max |eager's|:
              the first layer's attention projections (gpt2: transformer.h.0.attn.c_attn.weight, the
              fused q/k/v projection, and c_proj.weight; llama: model.layers.0.self_attn.q_proj,
              k_proj, v_proj .weight) and the token embedding.
  check       ok when dlogits <= --logits-rtol (1e-4), dloss <= --loss-rtol (1e-4) and
              dgrad <= --grad-rtol (1e-3), everything finite and the weights identical to the
              reference's (a checksum: every process seeds and builds the same model); otherwise
              FAILED. skipped / killed / error with the reason in the last column. The exit status is
              1 when a variant FAILED, raised an error or was killed (not when skipped).
  others      cores' worth of CPU that OTHER processes used during the timed steps (machine-wide
              busy time from /proc/stat minus this worker's own CPU time, over the timed steps'
              wall time; compilation excluded). Above ~0.1 the variant shared the CPUs and its time
              is inflated: rerun on a quiet machine (--wait-quiet, --retry-noisy).
  (/ind)      ratio to inductor at the same (model, seq, mode): below 1 is faster / smaller.

After the tables: smx / inductor and smx / eager step-time ratios per point, and how each
variant's peak memory grows with seq (the exponent k in peak ~ seq^k between the smallest and
largest seq: about 2 for an attention that materializes the scores, about 1 for a fused one).

Reference and memory safety: eager runs first at each (model, seq, mode) and saves its logits,
loss and gradients for the others to compare with. Before each variant the eager attention's
O(seq^2) memory is estimated (batch x heads x seq^2 x 4 bytes, about 3 of them at a time in
inference, about 3 per layer in training, plus the layer's seq^2 mask) for eager and inductor, and
the variant is skipped with "skipped (needs ~X GB ...)" when it would not fit in the memory
available (minus 1 GB) or in --mem-limit; a running worker whose RSS passes the limit is killed.
When eager did not produce a reference (skipped, failed, or not in --variants) an untimed
reference process computes it (with eager attention when that fits, else with
attn_implementation="sdpa", uncompiled).

Usage:
  python benchmarks/bench_attention.py --quick                       # smoke run: seq 128,256, 1 round
  python benchmarks/bench_attention.py                               # gpt2+llama x 1024,4096 x infer,train
  python benchmarks/bench_attention.py --models gpt2 --seq 1024 --modes infer --rounds 1
  python benchmarks/bench_attention.py --json out.json --plot out.png --markdown
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_linear_ce as blc  # noqa: E402  (the memory meter, launcher, quiet-wait and table printing)
from bench_linear_ce import GB, NOISY, StepPeak, _fmt_num, _write_json, say  # noqa: E402

MODELS = ("gpt2", "llama", "gpt_oss")
MODES = ("infer", "train")
VARIANTS = ("eager", "inductor", "smx", "sdpa")
MB = 1e6
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


# =========================================================================== worker (one variant, own process)


def build_model(spec: dict, attn: str):
    """The model of ``spec`` with random weights seeded by spec['seed'], attention ``attn``, dropout 0."""
    import torch
    import transformers

    torch.manual_seed(spec["seed"])
    h, heads, layers, vocab = spec["hidden"], spec["heads"], spec["layers"], spec["vocab"]
    if spec["model"] == "gpt2":
        cfg = transformers.GPT2Config(
            vocab_size=vocab, n_positions=max(spec["seq"], 1024), n_embd=h, n_layer=layers, n_head=heads,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, summary_first_dropout=0.0,
            bos_token_id=0, eos_token_id=0, attn_implementation=attn)
        model = transformers.GPT2LMHeadModel(cfg)
        # transformers cannot infer the loss from the class name; naming it avoids a warning_once inside
        # forward (a Dynamo graph break before the loss)
        model.loss_type = "ForCausalLM"
    elif spec["model"] == "llama":
        cfg = transformers.LlamaConfig(
            vocab_size=vocab, hidden_size=h, intermediate_size=2 * h, num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=spec["kv_heads"],
            max_position_embeddings=max(spec["seq"], 1024), attention_dropout=0.0,
            bos_token_id=0, eos_token_id=0, pad_token_id=0, attn_implementation=attn)
        model = transformers.LlamaForCausalLM(cfg)
    elif spec["model"] == "gpt_oss":       # attention sinks; sliding (128) and full layers alternate; 4 experts
        cfg = transformers.GptOssConfig(
            vocab_size=vocab, hidden_size=h, intermediate_size=h, num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=spec["kv_heads"], head_dim=h // heads,
            num_local_experts=4, num_experts_per_tok=2, sliding_window=128, attention_dropout=0.0,
            max_position_embeddings=max(spec["seq"], 1024), rope_parameters={"rope_type": "default", "rope_theta":
                                                                               10000.0},
            bos_token_id=0, eos_token_id=0, pad_token_id=0, attn_implementation=attn)
        model = transformers.GptOssForCausalLM(cfg)
    else:
        raise ValueError(spec["model"])
    model.config._attn_implementation = attn
    assert model.config._attn_implementation == attn, model.config._attn_implementation
    bad = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Dropout) and m.p != 0]
    assert not bad, f"dropout not 0 in {bad}"
    return model


def run_worker(spec_path: str) -> int:
    import json

    with open(spec_path) as f:
        spec = json.load(f)
    keys = ("model", "seq", "mode", "variant")
    out: dict[str, Any] = {k: spec[k] for k in keys}
    out.update(vocab=spec["vocab"], status="error", notes=[])

    def write():
        with open(spec["out"], "w") as f:
            json.dump(out, f, default=str)

    try:
        import torch

        torch.set_num_threads(spec["threads"])
        variant, mode = spec["variant"], spec["mode"]
        attn = "sdpa" if variant == "sdpa" or (variant == "reference" and spec.get("ref_attn") == "sdpa") else "eager"
        model = build_model(spec, attn)
        model.train(mode == "train")
        out["attn_implementation"] = attn
        out["params"] = sum(p.numel() for p in model.parameters())
        out["param_checksum"] = float(sum(p.detach().double().sum() for p in model.parameters()))
        out["malloc_mmap_threshold"] = os.environ.get("MALLOC_MMAP_THRESHOLD_")
        out["smxcompile_src"] = blc.smxcompile_source_hash()
        g = torch.Generator().manual_seed(spec["seed"] + 1)
        ids = torch.randint(0, spec["vocab"], (spec["batch"], spec["seq"]), generator=g)

        if variant in ("eager", "reference"):
            fn = model
        elif variant in ("inductor", "sdpa"):
            fn = torch.compile(model)
        elif variant == "smx":
            import smxcompile  # noqa: F401  (registers backend="smx")

            fn = torch.compile(model, backend="smx")
        else:
            raise ValueError(variant)

        def step():
            if mode == "infer":
                with torch.no_grad():
                    o = fn(input_ids=ids, use_cache=False)
                return o.logits, None
            model.zero_grad(set_to_none=True)
            o = fn(input_ids=ids, labels=ids, use_cache=False)
            o.loss.backward()
            return o.logits.detach(), o.loss.detach()

        say(f"{variant}: {spec['model']} ({out['params'] / 1e6:.2f} M params, attn_implementation={attn!r}), "
            f"batch {spec['batch']} x seq {spec['seq']}, {mode}; "
            + ("one untimed step ..." if variant == "reference" else "warm-up step (includes compilation) ..."))
        t0 = time.perf_counter()
        logits, loss = step()
        out["warmup_s"] = time.perf_counter() - t0
        say(f"warm-up {out['warmup_s']:.1f} s")
        out["step_s"], out["step_cpu_s"], out["peak_bytes"], out["base_rss_bytes"] = [], [], [], []
        rounds = 0 if variant == "reference" else spec["rounds"]
        busy = own = wall = 0.0
        for r in range(rounds):
            logits = loss = None
            model.zero_grad(set_to_none=True)
            with StepPeak() as m:
                b0, c0, t0 = blc._busy_cpu_s(), time.process_time(), time.perf_counter()
                logits, loss = step()
                t1, c1, b1 = time.perf_counter(), time.process_time(), blc._busy_cpu_s()
            out["step_s"].append(t1 - t0)
            out["step_cpu_s"].append(c1 - c0)
            out["peak_bytes"].append(m.peak)
            out["base_rss_bytes"].append(m.base)
            out["mem_method"] = m.method
            if b0 is not None and b1 is not None:
                busy, own, wall = busy + (b1 - b0), own + (c1 - c0), wall + (t1 - t0)
            say(f"round {r + 1}/{rounds}: {(t1 - t0) * 1e3:.1f} ms, peak {m.peak / MB:.1f} MB above "
                f"{m.base / GB:.2f} GB RSS")
        if wall > 0:
            # CPU of other processes during the timed steps only (not the compilation, whose worker pool
            # processes are not this process)
            out["other_load_timed"] = max(0.0, busy - own) / wall
        out["max_rss_bytes"] = blc.rss_bytes("VmRSS")
        if variant == "smx":
            rep = blc.smx_report_summary()
            out["smx_report"] = rep
            say(f"smx report over {rep['graphs']} graph(s): {rep['sites'] or 'no site'}")
        if variant in ("inductor", "sdpa", "smx"):
            from torch._dynamo.utils import counters

            out["inductor_fuse_attention"] = int(counters["inductor"].get("fuse_attention", 0))

        # ---- correctness against eager
        grads = {}
        if mode == "train":
            named = dict(model.named_parameters())
            grads = {n: named[n].grad for n in GRAD_PARAMS[spec["model"]] if n in named}
        chk: dict[str, Any] = {}
        tensors = [logits] + ([loss] if loss is not None else []) + [gr for gr in grads.values() if gr is not None]
        ok = all(bool(torch.isfinite(t).all()) for t in tensors)
        missing = [n for n, gr in grads.items() if gr is None]
        if missing:
            ok, chk["why"] = False, "no gradient for " + ", ".join(missing)
        elif not ok:
            chk["why"] = "non-finite logits, loss or gradient"
        if loss is not None:
            out["loss"] = float(loss)
        if variant in ("eager", "reference"):
            torch.save({"logits": logits, "loss": loss, "grads": grads, "param_checksum": out["param_checksum"],
                        "by": "eager" if attn == "eager" else "the same model with attn_implementation='sdpa', "
                                                            "not compiled"}, spec["ref"])
            if variant == "eager":
                chk.update(logits_rel=0.0, against="itself (reference)")
                if loss is not None:
                    chk.update(loss_rel=0.0, grad_rel=0.0)
        elif ok and os.path.exists(spec["ref"]):
            ref = torch.load(spec["ref"], mmap=True, weights_only=True)
            chk["against"] = ref["by"]
            if ref["param_checksum"] != out["param_checksum"]:
                ok, chk["why"] = False, "weights differ from the reference's (model init not reproducible?)"
            chk["logits_rel"] = float((logits - ref["logits"]).abs().max()) / max(float(ref["logits"].abs().max()),
                                                                                  1e-30)
            if loss is not None:
                rl = float(ref["loss"])
                chk["loss_rel"] = abs(float(loss) - rl) / max(abs(rl), 1e-30)
                per = {n: float((gr - ref["grads"][n]).abs().max()) / max(float(ref["grads"][n].abs().max()), 1e-30)
                       for n, gr in grads.items()}
                chk["grad_rel_per_param"] = per
                chk["grad_rel"] = max(per.values()) if per else 0.0
            bad = [f"{k} {chk[k]:.1e} > {spec[t]:.0e}" for k, t in
                   (("logits_rel", "logits_rtol"), ("loss_rel", "loss_rtol"), ("grad_rel", "grad_rtol"))
                   if k in chk and chk[k] > spec[t]]
            if bad and ok:
                ok, chk["why"] = False, "outside tolerance: " + ", ".join(bad)
        elif ok:
            ok, chk["why"] = False, "no reference to compare with"
        out["check"] = chk
        out["status"] = "ok" if ok else "FAILED"
        figs = ", ".join(f"{k} {chk[k]:.1e}" for k in ("logits_rel", "loss_rel", "grad_rel") if k in chk)
        if variant == "reference":
            say(f"saved the reference ({'finite' if ok else chk.get('why')})")
        else:
                say(f"check vs {chk.get('against', '-')}: {figs or '-'} -> {out['status']}"
                + (f" ({chk['why']})" if chk.get("why") else ""))
    except Exception as e:  # noqa: BLE001
        import traceback

        out["status"] = "error"
        out["error"] = f"{type(e).__name__}: {e}"
        out["traceback"] = traceback.format_exc()[-3000:]
    write()
    return 0


# =========================================================================== parent


def attn_matrix_bytes(a: argparse.Namespace, seq: int) -> int:
    """One layer's eager attention scores: batch x heads x seq x seq fp32."""
    return a.batch * a.heads * seq * seq * 4


def estimate_bytes(variant: str, mode: str, seq: int, a: argparse.Namespace) -> int:
    """Rough peak RSS of a worker: libraries and compiled code, O(seq) activations, eager's O(seq^2) scores."""
    overhead = int(1.5 * GB)
    tokens = a.batch * seq
    linear = tokens * (a.hidden * 24 * a.layers + a.vocab * 4) * 4 * (3 if mode == "train" else 1)
    s = attn_matrix_bytes(a, seq)
    mask = a.batch * seq * seq * 4  # the (batch, 1, seq, seq) mask transformers builds for eager attention
    quad = 0
    if variant in ("eager", "inductor", "reference-eager"):
        quad = (3 * s * a.layers if mode == "train" else 3 * s) + 2 * mask
    return int(overhead + linear + quad)


def run_point(spec: dict, label: str, est: int, workdir: str, limit: int | None, args, log) -> dict:
    """Launch one variant's worker (again, up to --retry-noisy times, while other processes shared the CPUs)."""
    tries: list[dict] = []
    script = os.path.abspath(__file__)
    while True:
        if args.wait_quiet:
            blc.wait_quiet(args.wait_quiet, log)
        log(f"[{label}] fresh process (estimated peak RSS {est / GB:.1f} GB)"
            + (f", try {len(tries) + 1}" if tries else ""))
        res = blc.launch(spec, workdir, limit, args.variant_timeout, log, script=script, label=label)
        for k in ("model", "seq", "mode", "variant"):
            res[k] = spec[k]
        res["others"] = res.get("other_load_timed", res.get("other_load"))
        if res.get("status") == "error" and res.get("traceback"):
            log(res["traceback"])
        tries.append(res)
        noisy = (res["others"] or 0) > NOISY
        if not noisy or res.get("status") not in ("ok", "FAILED") or len(tries) > args.retry_noisy:
            break
        log(f"[{label}] other processes took {res['others']:.2f} cores: running it again (--retry-noisy)")
    best = min(tries, key=lambda r: (r.get("status") not in ("ok", "FAILED"), r.get("others") or 0))
    if len(tries) > 1:
        best["discarded_tries"] = [{k: r.get(k) for k in ("status", "others", "step_s", "peak_bytes")}
                                   for r in tries if r is not best]
    return best


def summarize(res: dict) -> dict:
    s: dict[str, Any] = {}
    if res.get("step_s"):
        s["step_ms"] = statistics.median(res["step_s"]) * 1e3
    if res.get("peak_bytes"):
        s["peak_mb"] = max(res["peak_bytes"]) / MB
    return s


def _key(r: dict) -> tuple:
    return (r["model"], r["seq"], r["mode"])


def _inductor(results: list[dict], r: dict) -> dict:
    return next((summarize(x) for x in results if _key(x) == _key(r) and x["variant"] == "inductor"
                 and x.get("status") == "ok"), {})


def smx_note(r: dict, layers: int) -> str:
    rep = r.get("smx_report")
    if rep is None:
        return ""
    sites = rep["sites"]
    txt = "; ".join(f"{k}: " + ", ".join(f"{n} {a}" for a, n in sorted(acts.items()))
                    for k, acts in sorted(sites.items())) or "no site"
    done = sites.get("attention", {}).get("rewritten", 0)
    want = layers  # one attention block per layer
    flag = f"attention {done}/{want} rewritten" + ("" if done >= want else " (NOT all rewritten)")
    return f"{flag}; report: {txt}; {rep['graphs']} graph(s)"


def table(results: list[dict], mode: str, layers: int) -> tuple[list[str], list[list[str]]]:
    train = mode == "train"
    head = ["model", "seq", "variant", "step ms (/ind)", "peak MB (/ind)", "warm-up s", "dlogits"]
    if train:
        head += ["dloss", "dgrad"]
    head += ["check", "others", "smx report / note"]
    rows = []
    for r in results:
        if r["mode"] != mode or r["variant"] == "reference":
            continue
        s, ind, st = summarize(r), _inductor(results, r), r.get("status", "?")

        def rat(key: str) -> str:
            if key not in s:
                return "-"
            txt = _fmt_num(s[key])
            if r["variant"] != "inductor" and ind.get(key):
                txt += f" ({s[key] / ind[key]:.2f}x)"
            return txt

        chk = r.get("check", {})
        note = smx_note(r, layers) if r["variant"] == "smx" else ""
        if r["variant"] in ("inductor", "sdpa") and r.get("inductor_fuse_attention"):
            note = f"Inductor's own SDPA pattern fired {r['inductor_fuse_attention']}x"
        if chk.get("against") not in (None, "eager", "itself (reference)"):
            note = (note + f"; checked against {chk['against']}").lstrip("; ")
        if st not in ("ok", "FAILED"):
            note = (r.get("error") or "")[:140]
        elif st == "FAILED":
            note = (note + " " + chk.get("why", "")).strip()
        row = [r["model"], str(r["seq"]), r["variant"], rat("step_ms"), rat("peak_mb"),
               _fmt_num(r.get("warmup_s"), 1), f"{chk['logits_rel']:.1e}" if "logits_rel" in chk else "-"]
        if train:
            row += [f"{chk['loss_rel']:.1e}" if "loss_rel" in chk else "-",
                    f"{chk['grad_rel']:.1e}" if "grad_rel" in chk else "-"]
        others = r.get("others")
        row += [st, f"{others:.2f}" if others is not None else "-", note]
        rows.append(row)
    return head, rows


def findings(results: list[dict], seqs: list[int]) -> list[str]:
    """smx vs inductor / eager time ratios per point, and the growth of peak memory with seq."""
    lines = []
    ok = [r for r in results if r.get("status") == "ok" and r["variant"] != "reference" and summarize(r)]
    for mode in MODES:
        for other in ("inductor", "eager"):
            pts = []
            for r in ok:
                if r["variant"] != "smx" or r["mode"] != mode:
                    continue
                o = next((summarize(x) for x in ok if _key(x) == _key(r) and x["variant"] == other), None)
                if o and o.get("step_ms"):
                    pts.append((f"{r['model']}@{r['seq']}", summarize(r)["step_ms"] / o["step_ms"]))
            if pts:
                worst = max(pts, key=lambda p: p[1])
                line = f"{mode}: smx / {other} step time: " + ", ".join(f"{n} {v:.2f}x" for n, v in pts)
                if other == "inductor":  # issue 4: at least 2x faster than Inductor, never slower
                    slow = [f"{n} {v:.2f}x" for n, v in pts if v > 0.5]
                    line += ("; goal <= 0.50x (2x faster) met at every point" if not slow else
                             f"; goal <= 0.50x (2x faster) not met at {', '.join(slow)}")
                else:
                    line += f"; worst {worst[0]} {worst[1]:.2f}x"
                lines.append(line)
    if len(seqs) >= 2:
        lo, hi = min(seqs), max(seqs)
        for mode in MODES:
            parts = []
            for model in MODELS:
                for v in VARIANTS:
                    a = next((summarize(r) for r in ok if (r["model"], r["seq"], r["mode"], r["variant"])
                              == (model, lo, mode, v)), {})
                    b = next((summarize(r) for r in ok if (r["model"], r["seq"], r["mode"], r["variant"])
                              == (model, hi, mode, v)), {})
                    if a.get("peak_mb") and b.get("peak_mb"):
                        k = math.log(b["peak_mb"] / a["peak_mb"]) / math.log(hi / lo)
                        parts.append(f"{model} {v} {k:.2f}")
            if parts:
                lines.append(f"{mode}: peak memory ~ seq^k between seq {lo} and {hi}, k = " + ", ".join(parts))
    return lines


def plot(results: list[dict], modes: list[str], variants: list[str], path: str, title: str) -> str | None:
    """Step time and peak memory vs seq (log-log), one line per variant (colour) and model (line style)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        return ("--plot: matplotlib is not installed; `pip install -e '.[bench]'` (or `pip install matplotlib`) "
                "and run again; no plot written")
    fig, axes = plt.subplots(len(modes), 2, figsize=(12, 4.2 * len(modes)), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = {"gpt2": ("-", "o"), "llama": ("--", "s")}
    for mi, mode in enumerate(modes):
        for vi, v in enumerate(variants):
            for model, (ls, mk) in styles.items():
                pts = sorted((r["seq"], summarize(r)) for r in results if r["mode"] == mode and r["variant"] == v
                             and r["model"] == model and r.get("status") in ("ok", "FAILED") and summarize(r))
                if not pts:
                    continue
                for ci, key in enumerate(("step_ms", "peak_mb")):
                    xs = [p[0] for p in pts if key in p[1]]
                    ys = [p[1][key] for p in pts if key in p[1]]
                    axes[mi][ci].plot(xs, ys, ls, marker=mk, color=colors[vi % len(colors)], label=f"{model} {v}")
        for ci, yl in enumerate(("ms per step, median", "peak MB above the pre-step RSS")):
            ax = axes[mi][ci]
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            seqs = sorted({r["seq"] for r in results if r["mode"] == mode})
            ax.set_xticks(seqs, [str(x) for x in seqs])
            ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
            ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda y, _: f"{y:g}"))
            ax.yaxis.set_minor_formatter(matplotlib.ticker.FuncFormatter(lambda y, _: f"{y:g}"))
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


def _choice_list(choices: tuple[str, ...]):
    def parse(s: str) -> list[str]:
        out = [t for t in s.replace(" ", "").split(",") if t]
        bad = [t for t in out if t not in choices]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {bad}; choose from {','.join(choices)}")
        return out

    return parse


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", type=_choice_list(MODELS), default=list(MODELS),
                   help="gpt2,llama,gpt_oss (default all; gpt_oss, with attention sinks, runs no sdpa variant)")
    p.add_argument("--seq", type=blc._int_list, help=f"comma-separated sequence lengths (default "
                                                     f"{','.join(map(str, DEFAULT_SEQ))})")
    p.add_argument("--modes", type=_choice_list(MODES), default=list(MODES), help="infer,train (default both)")
    p.add_argument("--variants", type=_choice_list(VARIANTS), default=list(VARIANTS),
                   help=f"comma-separated subset of {','.join(VARIANTS)} (default all; eager always runs first)")
    p.add_argument("--rounds", type=int, help="timed steps per variant after the warm-up, median reported "
                                              "(default 3 at seq <= 2048, 2 above; 1 with --quick)")
    p.add_argument("--quick", action="store_true",
                   help=f"smoke run: seq {','.join(map(str, QUICK_SEQ))}, 1 round")
    p.add_argument("--batch", type=int, default=1, help="sequences per step (default %(default)s)")
    p.add_argument("--layers", type=int, default=2, help="transformer layers (default %(default)s)")
    p.add_argument("--hidden", type=int, default=256, help="hidden size (default %(default)s; llama's MLP is 2x)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (default %(default)s)")
    p.add_argument("--kv-heads", type=int, help="llama's key/value heads (default heads // 2: GQA)")
    p.add_argument("--vocab", type=int, default=2048, help="vocabulary size (default %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=blc._cores(),
                   help="torch threads (default: all cores, %(default)s here)")
    p.add_argument("--logits-rtol", type=float, default=1e-4,
                   help="max |logits - eager| / max |eager| (default %(default)s)")
    p.add_argument("--loss-rtol", type=float, default=1e-4, help="max |loss - eager| / |eager| (default %(default)s)")
    p.add_argument("--grad-rtol", type=float, default=1e-3,
                   help="max |grad - eager| / max |eager grad| over the compared parameters (default %(default)s)")
    p.add_argument("--mem-limit", type=float, metavar="GB",
                   help="largest RSS a variant's process may reach: variants estimated above it are skipped, "
                        "one that passes it is killed (default: memory available at start minus 2 GB)")
    p.add_argument("--mmap-threshold", type=int, default=2**20, metavar="BYTES",
                   help="glibc MALLOC_MMAP_THRESHOLD_ for the workers (default 1 MiB, as bench_linear_ce.py; "
                        "0 keeps glibc's dynamic threshold)")
    p.add_argument("--variant-timeout", type=float, default=900, help="seconds before a worker is killed "
                                                                      "(default %(default)s)")
    p.add_argument("--wait-quiet", type=float, default=0, metavar="S",
                   help="before each variant, wait up to S seconds until other processes use under 0.1 cores")
    p.add_argument("--retry-noisy", type=int, default=0, metavar="K",
                   help="run a variant again, up to K times, when other processes used more than 0.1 cores "
                        "during its timed steps; the least disturbed run is kept (default 0)")
    p.add_argument("--json", metavar="PATH", help="write every figure, the environment and the command to PATH "
                                                  "(rewritten after every variant)")
    p.add_argument("--markdown", action="store_true", help="print the tables as Markdown")
    p.add_argument("--plot", metavar="PATH", help="time and peak memory vs seq (PNG/SVG/PDF; needs matplotlib)")
    p.add_argument("--_worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.seq is None:
        args.seq = QUICK_SEQ if args.quick else DEFAULT_SEQ
    if args.kv_heads is None:
        args.kv_heads = max(1, args.heads // 2)
    if args.hidden % args.heads or args.heads % args.kv_heads:
        p.error("--hidden must be a multiple of --heads, and --heads a multiple of --kv-heads")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args._worker:
        return run_worker(args._worker)

    command = "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0])] + sys.argv[1:])
    env = blc.environment(args.threads)
    env.pop("cut-cross-entropy", None)
    try:
        from importlib.metadata import version

        env["transformers"] = version("transformers")
    except Exception:  # noqa: BLE001
        env["transformers"] = None
    print(f"$ {command}", flush=True)
    print("env: " + ", ".join(f"{k}={v}" for k, v in env.items()))
    if env.get("loadavg_at_start") and env["loadavg_at_start"][0] > 0.5 * env["cores"]:
        print(f"WARNING: load average {env['loadavg_at_start'][0]} on {env['cores']} cores: other processes are "
              "using the CPUs (or were, in the last minute); the `others` column says, per variant, whether they "
              "shared the CPUs with its timed steps", file=sys.stderr)
    variants = (["eager"] + [v for v in args.variants if v != "eager"]) if "eager" in args.variants else args.variants
    avail0 = blc.mem_available()
    limit = int(args.mem_limit * GB) if args.mem_limit else (int(avail0 - 2 * GB) if avail0 else None)
    rounds = {s: args.rounds or default_rounds(s, args.quick) for s in args.seq}
    print(f"models {args.models} (hidden {args.hidden}, {args.heads} heads, llama {args.kv_heads} kv heads, "
          f"{args.layers} layers, vocab {args.vocab}, eager attention, dropout 0, fp32), batch {args.batch}, "
          f"seq {args.seq}, modes {args.modes}, variants {variants}; 1 warm-up + {rounds} timed step(s), one "
          f"fresh process each; memory limit {(limit or 0) / GB:.1f} GB", flush=True)

    settings = {k: getattr(args, k) for k in ("models", "seq", "modes", "batch", "layers", "hidden", "heads",
                                              "kv_heads", "vocab", "seed", "threads", "logits_rtol", "loss_rtol",
                                              "grad_rtol")}
    settings.update(variants=variants, rounds=rounds, mem_limit_bytes=limit,
                    malloc_mmap_threshold=os.environ.get("MALLOC_MMAP_THRESHOLD_")
                    or (args.mmap_threshold or "glibc default (dynamic)"))
    result: dict[str, Any] = {"command": command, "env": env, "settings": settings, "results": []}
    results: list[dict] = result["results"]
    workdir = tempfile.mkdtemp(prefix="bench_attention_")
    t_start = time.monotonic()

    def log(msg: str) -> None:
        print(f"[{time.monotonic() - t_start:7.1f}s] {msg}", flush=True)

    base = {"batch": args.batch, "layers": args.layers, "hidden": args.hidden, "heads": args.heads,
            "kv_heads": args.kv_heads, "vocab": args.vocab, "seed": args.seed, "threads": args.threads,
            "logits_rtol": args.logits_rtol, "loss_rtol": args.loss_rtol, "grad_rtol": args.grad_rtol,
            "mmap_threshold": args.mmap_threshold}
    total = len(args.models) * len(args.seq) * len(args.modes) * len(variants)
    done = 0
    try:
        for model in args.models:
            for mode in args.modes:
                for seq in args.seq:
                    point = f"{model} seq={seq} {mode}"
                    ref_path = os.path.join(workdir, f"ref-{model}-{seq}-{mode}.pt")
                    for name in variants:
                        if model == "gpt_oss" and name == "sdpa":     # transformers' SDPA path takes no sinks
                            continue
                        spec = dict(base, model=model, seq=seq, mode=mode, variant=name, rounds=rounds[seq],
                                    ref=ref_path)
                        avail = blc.mem_available()
                        room = min(x for x in (limit, (avail - 1 * GB) if avail else None) if x is not None) \
                            if (limit or avail) else None
                        if name != "eager" and not os.path.exists(ref_path):
                            # eager did not run (or failed / was skipped): an untimed reference process
                            big = estimate_bytes("reference-eager", mode, seq, args)
                            ref_attn = "eager" if room is None or big <= room else "sdpa"
                            log(f"[{point}] reference: eager model, attention {ref_attn!r}, not compiled, untimed")
                            ref = blc.launch(dict(spec, variant="reference", ref_attn=ref_attn), workdir, limit,
                                             args.variant_timeout, log, script=os.path.abspath(__file__),
                                             label=f"{point} reference")
                            ref.update(model=model, seq=seq, mode=mode, variant="reference")
                            if ref.get("status") != "ok":
                                why = ref.get("error") or ref.get("check", {}).get("why")
                                log(f"[{point}] reference failed: {why}")
                            results.append(ref)
                        est = estimate_bytes(name, mode, seq, args)
                        if room is not None and est > room:
                            why = (f"skipped (needs ~{est / GB:.1f} GB: eager attention holds "
                                   f"{attn_matrix_bytes(args, seq) / GB:.2f} GB of scores per layer; "
                                   f"{room / GB:.1f} GB usable)")
                            log(f"[{point}] {name}: {why}")
                            res = {"model": model, "seq": seq, "mode": mode, "variant": name, "status": "skipped",
                                   "error": why}
                        else:
                            res = run_point(spec, f"{point} {name}", est, workdir, limit, args, log)
                        res["estimated_rss_bytes"] = est
                        results.append(res)
                        done += 1
                        s, ind = summarize(res), _inductor(results, res)
                        figs = ""
                        if s:
                            figs = (f", step {s['step_ms']:.1f} ms"
                                    + (f" ({s['step_ms'] / ind['step_ms']:.2f}x ind)" if ind and name != "inductor"
                                       else "")
                                    + f", peak {s['peak_mb']:.1f} MB, warm-up {res.get('warmup_s', 0):.1f} s")
                        oth = res.get("others")
                        log(f"({done}/{total}) {point} {name}: {res.get('status')}{figs}"
                            + (f", others {oth:.2f}" if oth is not None else "")
                            + (f" -- {res.get('error') or res.get('check', {}).get('why')}"
                               if res.get("status") not in ("ok",) else "")
                            + (f" -- {smx_note(res, args.layers)}" if name == "smx" and res.get("smx_report") else ""))
                        if oth is not None and oth > NOISY:
                            log(f"WARNING: {point} {name} shared the CPUs with other processes ({oth:.2f} cores): "
                                "its time is inflated")
                        _write_json(args.json, result)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    for r in results:
        ind = _inductor(results, r)
        s = summarize(r)
        if ind and s:
            r["ratio_vs_inductor"] = {k: s[k] / ind[k] for k in s if ind.get(k)}
        r.update({f"summary_{k}": v for k, v in s.items()})

    for mode in args.modes:
        head, rows = table(results, mode, args.layers)
        what = "forward under no_grad" if mode == "infer" else "forward with labels + loss.backward()"
        rs = sorted(set(rounds.values()))
        title = (f"{mode}: {what}; batch {args.batch}, hidden {args.hidden}, {args.heads} heads "
                 f"(llama {args.kv_heads} kv), {args.layers} layers, vocab {args.vocab}, fp32, CPU ({env['cpu']}, "
                 f"{args.threads} threads); median of {'/'.join(map(str, rs))} step(s); MB = 1e6 B above the "
                 "pre-step RSS; (/ind) = ratio to inductor")
        blc.print_table(title, head, rows, args.markdown)
    print()
    result["findings"] = findings(results, args.seq)
    for line in result["findings"]:
        print(line)
    for r in results:
        if r["variant"] == "smx" and r.get("smx_report", {}).get("last_report_text"):
            print(f"\nsmx last_report() at {r['model']} seq={r['seq']} {r['mode']}:\n"
                  f"{r['smx_report']['last_report_text']}")
            break
    srcs = {r.get("smxcompile_src") for r in results if r.get("variant") == "smx" and r.get("smxcompile_src")}
    if len(srcs) > 1:
        print("WARNING: smxcompile's source changed during the run (someone edited it): " + "; ".join(
            f"{r['model']} {r['seq']} {r['mode']} ran {r.get('smxcompile_src')}" for r in results
            if r.get("variant") == "smx"))
    elif srcs:
        print(f"smxcompile source hash (sha1 of its .py files): {srcs.pop()}")
    mm = next((r.get("mem_method") for r in results if r.get("mem_method")), None)
    if mm:
        print(f"memory: {mm}, MALLOC_MMAP_THRESHOLD_={settings['malloc_mmap_threshold']}; peak = max over rounds "
              "of (VmHWM during the step - VmRSS just before it)")
    if args.plot:
        msg = plot(results, args.modes, variants, args.plot, f"{command}\nbatch {args.batch}, hidden {args.hidden}, "
                   f"{args.heads} heads, {args.layers} layers, vocab {args.vocab}, fp32, CPU ({env['cpu']}, "
                   f"{args.threads} threads)")
        print(msg if msg else f"wrote {args.plot}")
    return blc.finish_run(env, result, results, args.json, command, t_start,
                          lambda r: f"{r['model']} seq={r['seq']} {r['mode']} {r['variant']}")


if __name__ == "__main__":
    sys.exit(main())
