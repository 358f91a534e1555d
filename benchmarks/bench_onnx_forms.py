#!/usr/bin/env python
"""onnxruntime CPU latency of the ONNX forms smxcompile can write for one site, side by side: softmax + top-k
(``topk``), the renormalized router (``router``) and eager attention (causal and padded, B=4, H=8, E=64), each
exported plainly, for both targets and with each attention_op, timed in turn in onnxruntime (``time_sessions``),
as ratios to the plain export. The measurement behind each target's default forms.

Run: python benchmarks/bench_onnx_forms.py [--cases topk,router,attention] [--seq 128,512] [--threads 1]
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

CASES = ("topk", "router", "attention")


def _modules(case: str, seqs: list[int]):
    """``[(label, module, args, forms)]`` of a case; forms: ``{name: export_onnx kwargs}``."""
    import torch

    g = torch.Generator().manual_seed(0)
    if case in ("topk", "router"):
        renorm = case == "router"

        class TopK(torch.nn.Module):
            def forward(self, x):
                w, i = torch.topk(torch.softmax(x, dim=-1), 2, dim=-1)
                return (w / w.sum(-1, keepdim=True) if renorm else w), i

        forms = {"portable": {"target": "portable"}, "onnxruntime": {}}
        return [(f"{case} {n}x{v}", TopK().eval(), (torch.randn(n, v, generator=g) * 3,), forms)
                for n, v in ((4096, 64), (64, 32000), (8, 128000))]

    class Attn(torch.nn.Module):
        def __init__(self, causal: bool):
            super().__init__()
            self.causal = causal

        def forward(self, q, k, v, mask):
            s = q @ k.transpose(-2, -1) * 0.125
            if self.causal:
                L = q.shape[-2]
                s = s.masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), float("-inf"))
            else:
                s = s + mask
            return torch.softmax(s, dim=-1) @ v

    forms = {"portable": {"target": "portable"}, "onnxruntime": {},
             **{f"attention_op={a}": {"attention_op": a} for a in ("Attention", "MultiHeadAttention", "decompose")}}
    rows = []
    for L in seqs:
        q, k, v = (torch.randn(4, 8, L, 64, generator=g) for _ in range(3))
        mask = torch.zeros(4, 1, 1, L)
        mask[1, ..., L * 3 // 4:] = torch.finfo(torch.float32).min          # one padded sequence
        for causal in (True, False):
            rows.append((f"attention L={L} {'causal' if causal else 'padded'}", Attn(causal).eval(), (q, k, v, mask),
                         forms))
    return rows


def run(cases: list[str], seqs: list[int], threads: int) -> list[dict]:
    import smxcompile
    from smxcompile.export.inputs import input_leaves
    from smxcompile.export.onnx.baseline import plain_export
    from smxcompile.export.onnx.runtime import ort_feeds, ort_session, time_sessions

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for case in cases:
            for label, module, args, forms in _modules(case, seqs):
                row: dict = {"case": label, "ms": {}, "errors": {}}
                files = {}
                plain = Path(tmp) / "plain.onnx"
                plain_export(module, args, {}, plain)
                files["plain"] = plain
                for name, kw in forms.items():
                    path = Path(tmp) / f"{name}.onnx"
                    try:
                        out = smxcompile.export_onnx(module, args, path, rtol=1e-3, atol=1e-5, **kw)
                        files[name] = path
                        row.setdefault("ops", {})[name] = out.op_types
                    except smxcompile.OnnxExportError as e:
                        row["errors"][name] = str(e).splitlines()[0][:200]
                leaves, names = input_leaves(module, args, {})
                runs = {}
                for name, path in files.items():
                    s = ort_session(path, threads)
                    runs[name] = (s, ort_feeds(s, leaves, names))
                row["ms"] = time_sessions(runs)
                row["ratio"] = {k: v / row["ms"]["plain"] for k, v in row["ms"].items()}
                rows.append(row)
                print(label + ": " + ", ".join(f"{k} {v:.3f} ms" for k, v in row["ms"].items()), file=sys.stderr)
    return rows


def markdown(rows: list[dict]) -> str:
    forms = []
    for r in rows:
        forms += [f for f in r["ms"] if f not in forms]
    lines = ["| case | " + " | ".join(forms) + " |", "|---|" + "---|" * len(forms)]
    for r in rows:
        cells = []
        for f in forms:
            if f in r["ms"]:
                cells.append(f"{r['ms'][f]:.3f} ms" + ("" if f == "plain" else f" ({r['ratio'][f]:.2f}x)"))
            else:
                cells.append("n/a" if f not in r["errors"] else "failed")
        lines.append(f"| {r['case']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0],
                                epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated (default: {','.join(CASES)})")
    p.add_argument("--seq", default="128,512", help="attention sequence lengths (default: 128,512)")
    p.add_argument("--threads", type=positive_int, default=1, help="onnxruntime intra-op threads (default: 1)")
    p.add_argument("--markdown", action="store_true", help="print a markdown table")
    p.add_argument("--json", type=Path, metavar="FILE", help="write the rows, the command and versions as JSON")
    args = p.parse_args(argv)
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    bad = [c for c in cases if c not in CASES]
    if bad:
        p.error(f"unknown case(s) {bad}; known: {', '.join(CASES)}")
    try:
        seqs = [int(s) for s in args.seq.split(",") if s.strip()]
    except ValueError:
        p.error(f"--seq must be comma-separated integers, not {args.seq!r}")
    rows = run(cases, seqs, args.threads)
    print(markdown(rows) if args.markdown else json.dumps(rows, indent=2, default=str))
    if args.json:
        import torch

        args.json.write_text(json.dumps({"command": " ".join(["python", *sys.argv]), "date": time.strftime("%Y-%m-%d"),
                                         "torch": torch.__version__, "onnxruntime": common.version("onnxruntime"),
                                         "threads": args.threads, "cpu_count": os.cpu_count(), "rows": rows},
                                        indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
