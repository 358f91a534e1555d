"""onnxruntime CPU latency of smxcompile's ONNX export against a plain ``torch.onnx.export``: each case exported
plainly and in each of its forms, the files timed in turn in onnxruntime (``time_sessions``), with node counts,
rewrites and the check's largest difference. Models (random weights, batch 4 x --seq tokens): the smx and portable
forms, the plain file at the smx file's opset. Sites (topk, topk-router, attention): both targets and, for attention,
each attention_op. Cases, forms and columns: docs/PERFORMANCE.md.

Run: python benchmarks/bench_onnx.py [--models gpt2,router] [--seq 128] [--threads 1] [--rounds 7] [--markdown]
     [--json FILE]
     python benchmarks/bench_onnx.py --models topk,topk-router,attention --seq 128,512 --rounds 5   # the sites
"""

import argparse
import sys
import tempfile
from pathlib import Path

import torch

import common
from smx_app.argtypes import positive_int

MODELS = ("gpt2", "llama", "bert", "vit", "gpt2-loss", "gpt2-quant", "router")
SITES = ("topk", "topk-router", "attention")
#: cases that ignore --seq: measured once
NO_SEQ = ("vit", "router", "topk", "topk-router")
TOL = {"rtol": 1e-3, "atol": 1e-5}
#: per case kind, ``{form: export_onnx kwargs}``
MODEL_FORMS = {"smx": {}, "portable": {"target": "portable"}}
SITE_FORMS = {"portable": {"target": "portable", **TOL}, "onnxruntime": TOL}
ATTENTION_FORMS = {**SITE_FORMS, **{f"attention_op={a}": {"attention_op": a, **TOL}
                                    for a in ("Attention", "MultiHeadAttention", "decompose")}}


class TopK(torch.nn.Module):
    """Top-2 of a softmax, renormalized over the two (a router) or not; ``gate``: a linear layer before it."""

    def __init__(self, renorm: bool, gate: torch.nn.Module | None = None):
        super().__init__()
        self.renorm, self.gate = renorm, torch.nn.Identity() if gate is None else gate

    def forward(self, x):
        w, i = torch.topk(torch.softmax(self.gate(x), dim=-1), 2, dim=-1)
        return (w / w.sum(-1, keepdim=True) if self.renorm else w), i


class Attn(torch.nn.Module):
    """Eager attention, causal or with an additive padding mask."""

    def __init__(self, causal: bool):
        super().__init__()
        self.causal = causal

    def forward(self, q, k, v, mask):
        s, L = q @ k.transpose(-2, -1) * 0.125, q.shape[-2]
        s = s.masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), float("-inf")) if self.causal else s + mask
        return torch.softmax(s, dim=-1) @ v


def site_cases(name: str, seq: int) -> list[tuple]:
    """``[(label, module, args, kwargs)]`` of a site: three shapes of topk / topk-router, or causal and padded
    attention (B=4, H=8, E=64) at ``seq``."""
    g = torch.Generator().manual_seed(0)
    if name != "attention":
        return [(f"{name} {n}x{v}", TopK(name == "topk-router").eval(), (torch.randn(n, v, generator=g) * 3,), {})
                for n, v in ((4096, 64), (64, 32000), (8, 128000))]
    q, k, v = (torch.randn(4, 8, seq, 64, generator=g) for _ in range(3))
    mask = torch.zeros(4, 1, 1, seq)
    mask[1, ..., seq * 3 // 4:] = torch.finfo(torch.float32).min          # one padded sequence
    return [(f"attention L={seq} {'causal' if c else 'padded'}", Attn(c).eval(), (q, k, v, mask), {})
            for c in (True, False)]


def model_case(name: str, seq: int) -> tuple:
    """``(label, model, args, kwargs)`` of a benchmark model (eval mode, seeded), batch 4 x ``seq`` tokens."""
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
        return label, model, (), kwargs
    if name == "llama":
        cfg = transformers.LlamaConfig(vocab_size=16384, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                                       num_attention_heads=8, num_key_value_heads=4,
                                       max_position_embeddings=max(256, seq), use_cache=False, **eager)
        return label, transformers.LlamaForCausalLM(cfg).eval(), (), {"input_ids": ids}
    if name == "bert":
        cfg = transformers.BertConfig(vocab_size=16384, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                                      intermediate_size=1024, max_position_embeddings=max(256, seq), **eager)
        mask = torch.ones(4, seq, dtype=torch.long)
        mask[1, seq * 3 // 4:] = 0
        return label, transformers.BertModel(cfg).eval(), (), {"input_ids": ids, "attention_mask": mask}
    if name == "vit":
        cfg = transformers.ViTConfig(hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                                     intermediate_size=1024, image_size=224, patch_size=16, **eager)
        pixels = torch.randn(4, 3, 224, 224, generator=g)
        return "vit 4x3x224x224", transformers.ViTModel(cfg).eval(), (), {"pixel_values": pixels}
    router = TopK(True, torch.nn.Linear(256, 64, bias=False)).eval()
    return "router 4096x256", router, (), {"x": torch.randn(4096, 256, generator=g)}


def measure(label: str, model, args: tuple, kwargs: dict, forms: dict[str, dict], threads: int, rounds: int) -> dict:
    """Export ``model`` plainly (at the smx form's opset where there is one, else torch's) and in each of ``forms``,
    then time the files in turn in onnxruntime.
    -> ``{"case", "export" (per file: opset, op types, rewrites...), "ms", "ratio" (to plain)}``."""
    import onnx

    import smxcompile
    from smxcompile.export.inputs import input_leaves
    from smxcompile.export.onnx.baseline import plain_export
    from smxcompile.export.onnx.result import count_op_types
    from smxcompile.export.onnx.runtime import ort_feeds, ort_session, time_sessions

    row: dict = {"case": label, "export": {}}
    with tempfile.TemporaryDirectory() as tmp:
        files = {name: Path(tmp) / f"{i}.onnx" for i, name in enumerate(["plain", *forms])}
        for name, kw in forms.items():
            out = smxcompile.export_onnx(model, args, files[name], kwargs=kwargs, **kw)
            row["export"][name] = {"opset": out.opset, "attention": out.target.attention, "op_types": out.op_types,
                                   "max_abs_diff": out.max_abs_diff,
                                   "rewrites": {k: sum(v.values()) for k, v in out.report.summary().items()}}
        plain_export(model, args, kwargs, files["plain"], row["export"].get("smx", {}).get("opset"))
        row["export"]["plain"] = {"op_types": count_op_types(onnx.load(str(files["plain"])))}
        leaves, names = input_leaves(model, args, kwargs)
        sessions = {name: ort_session(path, threads) for name, path in files.items()}
        ms = time_sessions({k: (s, ort_feeds(s, leaves, names)) for k, s in sessions.items()}, rounds=rounds)
    row.update(ms=ms, ratio={k: v / ms["plain"] for k, v in ms.items()})
    print(f"{label}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in ms.items()), file=sys.stderr, flush=True)
    return row


def cells(r: dict, forms: list[str]) -> list[str]:
    """A row's table cells: ms (x plain) per form, node counts, the first form's rewrites and largest difference."""
    out = [r["case"]]
    for f in forms:
        if f not in r["ms"]:
            out.append("n/a")
        else:
            out.append(f"{r['ms'][f]:.3f}" + ("" if f == "plain" else f" ({r['ratio'][f]:.2f}x)"))
    out.append(" / ".join(str(sum(r["export"][f]["op_types"].values())) if f in r["export"] else "-" for f in forms))
    first = next(e for f, e in r["export"].items() if f != "plain")
    return out + [", ".join(f"{k} {v}" for k, v in first["rewrites"].items()) or "-", f"{first['max_abs_diff']:.2g}"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", type=common.choice_list(MODELS + SITES), default=list(MODELS),
                   help=f"comma-separated cases of {','.join(MODELS + SITES)} (default: {','.join(MODELS)})")
    p.add_argument("--seq", type=common.int_list, default=[128], help="tokens per sequence, a list (default: 128)")
    p.add_argument("--rounds", type=positive_int, default=7, help="timed rounds per file (default: 7)")
    p.add_argument("--threads", type=positive_int, default=1, help="onnxruntime intra-op threads (default: 1)")
    p.add_argument("--markdown", action="store_true", help="print a markdown table")
    p.add_argument("--json", metavar="FILE", help="write the rows, the command and the environment as JSON")
    args = p.parse_args(argv)
    rows = []
    for name in args.models:
        for seq in args.seq[:1] if name in NO_SEQ else args.seq:
            cases = [model_case(name, seq)] if name in MODELS else site_cases(name, seq)
            forms = MODEL_FORMS if name in MODELS else ATTENTION_FORMS if name == "attention" else SITE_FORMS
            rows += [measure(*case, forms, args.threads, args.rounds) for case in cases]
    forms = list(dict.fromkeys(f for r in rows for f in ["plain", *r["export"]]))
    head = ["case", *(f"{f} ms" + (" (x plain)" if f != "plain" else "") for f in forms), f"nodes {' / '.join(forms)}",
            "rewrites", "max abs diff"]
    common.print_table("onnxruntime CPU latency: plain torch.onnx.export vs smxcompile.export_onnx", head,
                       [cells(r, forms) for r in rows], args.markdown, left=("case", "rewrites"))
    if args.json:
        env = common.environment(threads=args.threads, packages=("onnxruntime", "onnx", "onnxscript", "transformers"))
        common.write_json(args.json, {"command": common.command_line(argv), "environment": env,
                                      "args": {k: v for k, v in vars(args).items() if k not in ("json", "markdown")},
                                      "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
