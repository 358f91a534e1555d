#!/usr/bin/env python
"""onnxruntime CPU latency of smxcompile's ONNX export against a plain ``torch.onnx.export``, side by side: for each
small random-weight model (gpt2, llama, bert, vit, gpt2-loss, gpt2-quant, router; batch 4 x --seq tokens), the plain
export at the smx file's opset, ``export_onnx`` for the onnxruntime target ("smx") and for ``target="portable"``,
timed in turn in onnxruntime (``smxcompile.export.onnx.runtime.time_sessions``), with node counts, rewrites and the
check's largest difference. Models and columns: docs/PERFORMANCE.md ("How bench_onnx.py and bench_onnx_forms.py
measure"); bench_onnx_forms.py uses :func:`parser`, :func:`measure` and :func:`report`.

Run: python benchmarks/bench_onnx.py [--models gpt2,router] [--seq 128] [--threads 1] [--rounds 7]
     [--markdown] [--json FILE]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import common
from smx_app.argtypes import positive_int

MODELS = ("gpt2", "llama", "bert", "vit", "gpt2-loss", "gpt2-quant", "router")
FORMS = {"smx": {}, "portable": {"target": "portable"}}


def build(name: str, seq: int = 128):
    """``(label, model, kwargs)`` of a benchmark model (eval mode, seeded), batch 4 x ``seq`` tokens."""
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 16384, (4, seq), generator=g)
    label, eager = f"{name} 4x{seq}", {"attn_implementation": "eager"}
    if name.startswith("gpt2"):
        cfg = transformers.GPT2Config(vocab_size=16384, n_positions=max(128, seq), n_embd=256, n_layer=4, n_head=4,
                                      bos_token_id=0, eos_token_id=0, use_cache=False, **eager)
        model, kwargs = transformers.GPT2LMHeadModel(cfg).eval(), {"input_ids": ids}
        if name == "gpt2-quant":
            import smxcompile

            model = smxcompile.quantize_softmax(model, [kwargs], bits=8, progress=False)
        if name == "gpt2-loss":
            labels = ids.clone()
            labels[0, : seq // 4] = -100                      # an ignored prompt
            kwargs = {"input_ids": ids, "labels": labels}
        return label, model, kwargs
    if name == "llama":
        cfg = transformers.LlamaConfig(vocab_size=16384, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                                       num_attention_heads=8, num_key_value_heads=4,
                                       max_position_embeddings=max(256, seq), use_cache=False, **eager)
        return label, transformers.LlamaForCausalLM(cfg).eval(), {"input_ids": ids}
    if name == "bert":
        cfg = transformers.BertConfig(vocab_size=16384, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                                      intermediate_size=1024, max_position_embeddings=max(256, seq), **eager)
        mask = torch.ones(4, seq, dtype=torch.long)
        mask[1, seq * 3 // 4:] = 0
        return label, transformers.BertModel(cfg).eval(), {"input_ids": ids, "attention_mask": mask}
    if name == "vit":
        cfg = transformers.ViTConfig(hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                                     intermediate_size=1024, image_size=224, patch_size=16, **eager)
        pixels = torch.randn(4, 3, 224, 224, generator=g)
        return "vit 4x3x224x224", transformers.ViTModel(cfg).eval(), {"pixel_values": pixels}

    class Router(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = torch.nn.Linear(256, 64, bias=False)

        def forward(self, hidden):
            w, i = torch.topk(torch.softmax(self.gate(hidden), dim=-1), 2, dim=-1)
            return w / w.sum(-1, keepdim=True), i

    return "router 4096x256", Router().eval(), {"hidden": torch.randn(4096, 256, generator=g)}


def measure(label: str, model, args: tuple, kwargs: dict, forms: dict[str, dict], threads: int, rounds: int,
            plain_opset_of: str | None = None) -> dict:
    """Export ``model`` plainly and in each of ``forms`` (``{name: export_onnx kwargs}``), then time the files in
    turn in onnxruntime. ``plain_opset_of``: the form whose opset the plain export uses (default: torch's).
    -> ``{"case", "ms", "ratio" (to plain), "export" (per file: opset, op types, rewrites...), "errors"}``."""
    import onnx

    import smxcompile
    from smxcompile.export.inputs import input_leaves
    from smxcompile.export.onnx.baseline import plain_export
    from smxcompile.export.onnx.result import count_op_types
    from smxcompile.export.onnx.runtime import ort_feeds, ort_session, time_sessions

    row: dict = {"case": label, "ms": {}, "ratio": {}, "export": {}, "errors": {}}
    with tempfile.TemporaryDirectory() as tmp:
        files = {}
        for name, kw in forms.items():
            files[name] = Path(tmp) / f"{len(files)}.onnx"
            try:
                out = smxcompile.export_onnx(model, args, files[name], kwargs=kwargs, **kw)
            except smxcompile.OnnxExportError as e:
                row["errors"][name] = str(e).splitlines()[0][:300]
                del files[name]
                continue
            row["export"][name] = {"opset": out.opset, "attention": out.target.attention, "op_types": out.op_types,
                                   "max_abs_diff": out.max_abs_diff,
                                   "rewrites": {k: sum(v.values()) for k, v in out.report.summary().items()}}
        plain = Path(tmp) / "plain.onnx"
        try:
            plain_export(model, args, kwargs, plain, row["export"].get(plain_opset_of, {}).get("opset"))
            files = {"plain": plain, **files}
            row["export"]["plain"] = {"op_types": count_op_types(onnx.load(str(plain)))}
        except Exception as e:  # noqa: BLE001 - a model torch cannot export plainly is a row, not a crash
            row["errors"]["plain"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        leaves, names = input_leaves(model, args, kwargs)
        runs = {}
        for name, path in files.items():
            sess = ort_session(path, threads)
            runs[name] = (sess, ort_feeds(sess, leaves, names))
        row["ms"] = time_sessions(runs, rounds=rounds)
    if "plain" in row["ms"]:
        row["ratio"] = {k: v / row["ms"]["plain"] for k, v in row["ms"].items()}
    print(f"{label}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in row["ms"].items()), file=sys.stderr, flush=True)
    return row


def cells(r: dict, forms: list[str]) -> list[str]:
    """A row's table cells: ms (x plain) per form, node counts, the first form's rewrites and largest difference."""
    out = [r["case"]]
    for f in forms:
        if f in r["ms"]:
            out.append(f"{r['ms'][f]:.3f}" + (f" ({r['ratio'][f]:.2f}x)" if f != "plain" and f in r["ratio"] else ""))
        else:
            out.append(f"failed ({r['errors'][f][:50]})" if f in r["errors"] else "n/a")
    out.append(" / ".join(str(sum(r["export"][f]["op_types"].values())) if f in r["export"] else "-" for f in forms))
    first = next((e for f, e in r["export"].items() if f != "plain"), None)
    out.append((", ".join(f"{k} {v}" for k, v in first["rewrites"].items()) or "-") if first else "-")
    out.append(f"{first['max_abs_diff']:.2g}" if first else "-")
    return out


def report(rows: list[dict], args: argparse.Namespace, title: str) -> None:
    """The table (markdown or rich) and, with --json, every row, the command and the environment."""
    forms = list(dict.fromkeys(f for r in rows for f in ["plain", *r["export"], *r["errors"]]))
    head = ["case", *(f"{f} ms" + (" (x plain)" if f != "plain" else "") for f in forms), f"nodes {' / '.join(forms)}",
            "rewrites", "max abs diff"]
    common.print_table(title, head, [cells(r, forms) for r in rows], args.markdown, left=("case", "rewrites"))
    if args.json:
        env = common.environment(threads=args.threads, packages=("onnxruntime", "onnx", "onnxscript", "transformers"))
        common.write_json(args.json, {"command": common.command_line(), "environment": env,
                                      "args": {k: v for k, v in vars(args).items() if k not in ("json", "markdown")},
                                      "rows": rows})


def parser(doc: str) -> argparse.ArgumentParser:
    """The options both ONNX scripts take: --threads, --markdown, --json."""
    p = argparse.ArgumentParser(description=doc.split("\n\n", 1)[0], epilog=doc.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=positive_int, default=1, help="onnxruntime intra-op threads (default: 1)")
    p.add_argument("--markdown", action="store_true", help="print a markdown table")
    p.add_argument("--json", metavar="FILE", help="write the rows, the command and the environment as JSON")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--models", type=common.choice_list(MODELS), default=list(MODELS),
                   help=f"comma-separated (default: {','.join(MODELS)})")
    p.add_argument("--seq", type=positive_int, default=128, help="tokens per sequence (default: 128)")
    p.add_argument("--rounds", type=positive_int, default=7, help="timed rounds per file (default: 7)")
    args = p.parse_args(argv)
    rows = []
    for name in args.models:
        label, model, kwargs = build(name, args.seq)
        rows.append(measure(label, model, (), kwargs, FORMS, args.threads, args.rounds, plain_opset_of="smx"))
    report(rows, args, "onnxruntime CPU latency: plain torch.onnx.export vs smxcompile.export_onnx")
    return 0


if __name__ == "__main__":
    sys.exit(main())
