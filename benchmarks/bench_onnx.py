#!/usr/bin/env python
"""onnxruntime CPU latency of smxcompile's ONNX export against a plain ``torch.onnx.export``, side by side: for each
small random-weight model (gpt2, llama, bert, vit, gpt2-loss, gpt2-quant, router; batch 4 x --seq tokens), the plain
export at the smx file's opset, ``export_onnx`` for the onnxruntime target and for ``target="portable"``, timed in
turn in onnxruntime (``smxcompile.export.onnx.runtime.time_sessions``), with node counts, rewrites and the check's
largest difference. Models and columns: benchmarks/README.md.

Run: python benchmarks/bench_onnx.py [--models gpt2,router] [--seq 128] [--threads 1] [--rounds 7]
     [--markdown] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import common
from smx_app.argtypes import positive_int

MODELS = ("gpt2", "llama", "bert", "vit", "gpt2-loss", "gpt2-quant", "router")


def build(name: str, seq: int = 128):
    """``(model, kwargs)`` of a benchmark model (eval mode, seeded), batch 4 x ``seq`` tokens."""
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 16384, (4, seq), generator=g)
    if name in ("gpt2", "gpt2-quant", "gpt2-loss"):
        cfg = transformers.GPT2Config(vocab_size=16384, n_positions=max(128, seq), n_embd=256, n_layer=4, n_head=4,
                                      bos_token_id=0, eos_token_id=0, use_cache=False)
        cfg._attn_implementation = "eager"
        model = transformers.GPT2LMHeadModel(cfg).eval()
        kwargs = {"input_ids": ids}
        if name == "gpt2-quant":
            import smxcompile

            model = smxcompile.quantize_softmax(model, [kwargs], bits=8, progress=False)
        if name == "gpt2-loss":
            labels = ids.clone()
            labels[0, : seq // 4] = -100                      # an ignored prompt
            kwargs = {"input_ids": ids, "labels": labels}
        return model, kwargs
    if name == "llama":
        cfg = transformers.LlamaConfig(vocab_size=16384, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                                       num_attention_heads=8, num_key_value_heads=4,
                                       max_position_embeddings=max(256, seq), use_cache=False)
        cfg._attn_implementation = "eager"
        return transformers.LlamaForCausalLM(cfg).eval(), {"input_ids": ids}
    if name == "bert":
        cfg = transformers.BertConfig(vocab_size=16384, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                                      intermediate_size=1024, max_position_embeddings=max(256, seq))
        cfg._attn_implementation = "eager"
        mask = torch.ones(4, seq, dtype=torch.long)
        mask[1, seq * 3 // 4:] = 0
        return transformers.BertModel(cfg).eval(), {"input_ids": ids, "attention_mask": mask}
    if name == "vit":
        cfg = transformers.ViTConfig(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024,
                                     image_size=224, patch_size=16)
        cfg._attn_implementation = "eager"
        return transformers.ViTModel(cfg).eval(), {"pixel_values": torch.randn(4, 3, 224, 224, generator=g)}
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


def run(names: list[str], seq: int, threads: int, rounds: int) -> list[dict]:
    import onnx

    import smxcompile
    from smxcompile.export.inputs import input_leaves
    from smxcompile.export.onnx.baseline import plain_export
    from smxcompile.export.onnx.runtime import ort_feeds, ort_session, time_sessions

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            model, kwargs = build(name, seq)
            row: dict = {"model": name, "seq": seq}
            files: dict[str, Path] = {}
            for form, kw in (("smx", {}), ("portable", {"target": "portable"})):
                path = Path(tmp) / f"{name}.{form}.onnx"
                try:
                    out = smxcompile.export_onnx(model, (), path, kwargs=kwargs, **kw)
                except smxcompile.OnnxExportError as e:
                    row[f"{form}_error"] = str(e).splitlines()[0][:300]
                    continue
                files[form] = path
                row[form] = {"opset": out.opset, "attention": out.target.attention, "nodes": sum(out.op_types.values()),
                             "max_abs_diff": out.max_abs_diff, "exported": out.exported}
                row.setdefault("rewrites", {k: sum(v.values()) for k, v in out.report.summary().items()})
            plain = Path(tmp) / f"{name}.plain.onnx"
            try:
                plain_export(model, (), kwargs, plain, row.get("smx", {}).get("opset"))
                files["plain"] = plain
                row["plain"] = {"nodes": len(onnx.load(str(plain)).graph.node)}
            except Exception as e:  # noqa: BLE001 - a model torch cannot export plainly is a row, not a crash
                row["plain_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            leaves, names_ = input_leaves(model, (), kwargs)
            runs = {}
            for form, path in files.items():
                sess = ort_session(path, threads)
                runs[form] = (sess, ort_feeds(sess, leaves, names_))
            ms = time_sessions(runs, rounds=rounds)
            for form, v in ms.items():
                row[form]["ms"] = v
                if "plain" in ms:
                    row[form]["ratio"] = v / ms["plain"]
            rows.append(row)
            print(f"{name}: " + ", ".join(f"{f} {v:.3f} ms" for f, v in ms.items()), file=sys.stderr)
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| model | tokens | plain ms | smx ms (x plain) | portable ms (x plain) | nodes plain / smx / portable | "
             "rewrites | smx attention as | max abs diff |", "|---|---|---|---|---|---|---|---|---|"]

    def cell(r, form):
        if form not in r:
            return f"failed ({r.get(form + '_error', '?')[:50]})"
        v = r[form]
        return f"{v['ms']:.2f}" + (f" ({v['ratio']:.2f}x)" if "ratio" in v and form != "plain" else "")

    for r in rows:
        rw = ", ".join(f"{k} {v}" for k, v in r.get("rewrites", {}).items()) or "-"
        nodes = " / ".join(str(r[f]["nodes"]) if f in r else "-" for f in ("plain", "smx", "portable"))
        att = r["smx"]["attention"] if "smx" in r and "aten::scaled_dot_product_attention" in r["smx"]["exported"] \
            else "-"
        diff = f"{r['smx']['max_abs_diff']:.2g}" if "smx" in r else "-"
        lines.append(f"| {r['model']} | {'4x' + str(r['seq']) if r['model'] not in ('router', 'vit') else '-'} | "
                     f"{cell(r, 'plain')} | {cell(r, 'smx')} | {cell(r, 'portable')} | {nodes} | {rw} | {att} | {diff} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0],
                                epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated (default: {','.join(MODELS)})")
    p.add_argument("--seq", type=positive_int, default=128, help="tokens per sequence (default: 128)")
    p.add_argument("--threads", type=positive_int, default=1, help="onnxruntime intra-op threads (default: 1)")
    p.add_argument("--rounds", type=positive_int, default=7, help="timed rounds per file (default: 7)")
    p.add_argument("--markdown", action="store_true", help="print a markdown table")
    p.add_argument("--json", type=Path, metavar="FILE", help="write the rows, the command and versions as JSON")
    args = p.parse_args(argv)
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    rows = run(names, args.seq, args.threads, args.rounds)
    table = markdown(rows)
    print(table if args.markdown else json.dumps(rows, indent=2, default=str))
    if args.json:
        import torch

        args.json.write_text(json.dumps({"command": " ".join(["python", *sys.argv]), "date": time.strftime("%Y-%m-%d"),
                                         "torch": torch.__version__, "onnxruntime": common.version("onnxruntime"),
                                         "seq": args.seq, "threads": args.threads, "cpu_count": os.cpu_count(),
                                         "rows": rows},
                                        indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
