#!/usr/bin/env python
"""onnxruntime CPU latency of smxcompile's ONNX export against a plain ``torch.onnx.export``, side by side.

For each model, two files of the same weights:

  plain   torch.onnx.export(model, dynamo=True) of the model as written (torch's own translation).
  smx     smxcompile.export_onnx(model): the graph as smxcompile rewrites it (attention fused into
          scaled_dot_product_attention, softmax + top-k as TopK of the logits, quantized softmax as
          QuantizeLinear...), checked against eager before it is written.

Both run in one onnxruntime CPU session each (graph optimizations ORT_ENABLE_ALL, --threads intra-op
threads) on the same inputs; the two are timed in turn for --rounds rounds (order alternating), each
round --iters calls; reported: the median per-call milliseconds over rounds, and smx / plain (below 1 is
faster). Also the node count of each file and the largest |smx - eager| of the check.

Models (small configs, random weights, fp32; --models):

  gpt2        GPT-2 as `smx demo` builds it (4 layers, 256 dims, 4 heads), eager attention, batch 4 x 128
  llama       Llama (4 layers, 256 dims, 8 heads, 4 KV heads: GQA), eager attention, batch 4 x 128
  bert        BERT (4 layers, 256 dims, 4 heads) with a padding mask, batch 4 x 128
  router      an MoE router: softmax over 64 experts then top-2, 4096 tokens
  gpt2-quant  the gpt2 model with smxcompile.quantize_softmax (8-bit attention softmax, corrected)

Run: python benchmarks/bench_onnx.py [--models gpt2,router] [--threads 1] [--rounds 7] [--iters 10]
     [--markdown] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from smxcompile.argtypes import positive_int

MODELS = ("gpt2", "llama", "bert", "router", "gpt2-quant")


def build(name: str):
    """``(model, kwargs)`` of a benchmark model (eval mode, seeded)."""
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    if name in ("gpt2", "gpt2-quant"):
        cfg = transformers.GPT2Config(vocab_size=16384, n_positions=128, n_embd=256, n_layer=4, n_head=4,
                                      bos_token_id=0, eos_token_id=0, use_cache=False)
        cfg._attn_implementation = "eager"
        model = transformers.GPT2LMHeadModel(cfg).eval()
        kwargs = {"input_ids": torch.randint(0, 16384, (4, 128), generator=g)}
        if name == "gpt2-quant":
            import smxcompile

            model = smxcompile.quantize_softmax(model, [kwargs], bits=8, progress=False)
        return model, kwargs
    if name == "llama":
        cfg = transformers.LlamaConfig(vocab_size=16384, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                                       num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256,
                                       use_cache=False)
        cfg._attn_implementation = "eager"
        return (transformers.LlamaForCausalLM(cfg).eval(),
                {"input_ids": torch.randint(0, 16384, (4, 128), generator=g)})
    if name == "bert":
        cfg = transformers.BertConfig(vocab_size=16384, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                                      intermediate_size=1024, max_position_embeddings=256)
        cfg._attn_implementation = "eager"
        mask = torch.ones(4, 128, dtype=torch.long)
        mask[1, 100:] = 0
        return (transformers.BertModel(cfg).eval(),
                {"input_ids": torch.randint(0, 16384, (4, 128), generator=g), "attention_mask": mask})
    if name == "router":
        class Router(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.gate = torch.nn.Linear(256, 64, bias=False)

            def forward(self, hidden):
                w, i = torch.topk(torch.softmax(self.gate(hidden), dim=-1), 2, dim=-1)
                return w / w.sum(-1, keepdim=True), i

        return Router().eval(), {"hidden": torch.randn(4096, 256, generator=g)}
    raise SystemExit(f"unknown model {name!r}; known: {', '.join(MODELS)}")


def plain_export(model, kwargs, path: Path) -> None:
    import torch

    with torch.no_grad():
        torch.onnx.export(model, (), kwargs=kwargs, dynamo=True, verbose=False).save(str(path))


def session(path: Path, threads: int):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def nodes(path: Path) -> int:
    import onnx

    return len(onnx.load(str(path)).graph.node)


def feeds(sess, kwargs) -> dict:
    vals = [v.numpy() for v in kwargs.values()]
    return {i.name: v for i, v in zip(sess.get_inputs(), vals)}


def run(names: list[str], threads: int, rounds: int, iters: int) -> list[dict]:
    import smxcompile

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            model, kwargs = build(name)
            pp, sp = Path(tmp) / f"{name}.plain.onnx", Path(tmp) / f"{name}.smx.onnx"
            row: dict = {"model": name}
            try:
                plain_export(model, kwargs, pp)
            except Exception as e:  # noqa: BLE001 - a model torch cannot export plainly is a row, not a crash
                row["plain_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            out = smxcompile.export_onnx(model, (), sp, kwargs=kwargs)
            row.update(smx_nodes=nodes(sp), max_abs_diff=out.max_abs_diff,
                       rewrites={k: v for k, v in out.report.summary().items()})
            sessions = {"smx": session(sp, threads)}
            if "plain_error" not in row:
                row["plain_nodes"] = nodes(pp)
                sessions["plain"] = session(pp, threads)
            times: dict[str, list[float]] = {k: [] for k in sessions}
            for s in sessions.values():
                s.run(None, feeds(s, kwargs))                 # warm-up
            for r in range(rounds):
                order = list(sessions) if r % 2 == 0 else list(reversed(list(sessions)))
                for k in order:
                    s, f = sessions[k], feeds(sessions[k], kwargs)
                    t0 = time.perf_counter()
                    for _ in range(iters):
                        s.run(None, f)
                    times[k].append((time.perf_counter() - t0) / iters * 1e3)
            for k, ts in times.items():
                row[f"{k}_ms"] = statistics.median(ts)
            if "plain_ms" in row:
                row["ratio"] = row["smx_ms"] / row["plain_ms"]
            rows.append(row)
            print(f"{name}: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                          for k, v in row.items() if k != "model"), file=sys.stderr)
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| model | plain ms | smx ms | smx / plain | nodes plain | nodes smx | rewrites | max abs diff |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        rw = ", ".join(f"{k} {sum(v.values())}" for k, v in r["rewrites"].items()) or "-"
        plain = f"{r['plain_ms']:.2f}" if "plain_ms" in r else f"failed ({r.get('plain_error', '?')[:60]})"
        ratio = f"{r['ratio']:.2f}x" if "ratio" in r else "-"
        lines.append(f"| {r['model']} | {plain} | {r['smx_ms']:.2f} | {ratio} | {r.get('plain_nodes', '-')} | "
                     f"{r['smx_nodes']} | {rw} | {r['max_abs_diff']:.2g} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated (default: {','.join(MODELS)})")
    p.add_argument("--threads", type=positive_int, default=1, help="onnxruntime intra-op threads (default: 1)")
    p.add_argument("--rounds", type=positive_int, default=7, help="timed rounds per file (default: 7)")
    p.add_argument("--iters", type=positive_int, default=10, help="calls per round (default: 10)")
    p.add_argument("--markdown", action="store_true", help="print a markdown table")
    p.add_argument("--json", type=Path, metavar="FILE", help="write the rows, the command and versions as JSON")
    args = p.parse_args(argv)
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    rows = run(names, args.threads, args.rounds, args.iters)
    table = markdown(rows)
    print(table if args.markdown else json.dumps(rows, indent=2, default=str))
    if args.json:
        import onnxruntime
        import torch

        args.json.write_text(json.dumps({"command": " ".join(["python", *sys.argv]), "date": time.strftime("%Y-%m-%d"),
                                         "torch": torch.__version__, "onnxruntime": onnxruntime.__version__,
                                         "threads": args.threads, "cpu_count": os.cpu_count(), "rows": rows},
                                        indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
