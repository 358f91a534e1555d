#!/usr/bin/env python
"""onnxruntime CPU latency of the ONNX forms smxcompile can write for one site, side by side: softmax + top-k
(``topk``), the renormalized router (``router``) and eager attention (causal and padded, B=4, H=8, E=64), each
exported plainly, for both targets and with each attention_op, timed in turn in onnxruntime (``time_sessions``),
as ratios to the plain export. The measurement behind each target's default forms.

Run: python benchmarks/bench_onnx_forms.py [--cases topk,router,attention] [--seq 128,512] [--threads 1]
     [--markdown] [--json FILE]
"""

from __future__ import annotations

import sys

import common
from bench_onnx import measure, parser, report

CASES = ("topk", "router", "attention")
TOL = {"rtol": 1e-3, "atol": 1e-5}
FORMS = {"portable": {"target": "portable", **TOL}, "onnxruntime": TOL}
ATTENTION_FORMS = {**FORMS, **{f"attention_op={a}": {"attention_op": a, **TOL}
                               for a in ("Attention", "MultiHeadAttention", "decompose")}}


def modules(case: str, seqs: list[int]) -> list[tuple]:
    """``[(label, module, args, forms)]`` of a case; forms: ``{name: export_onnx kwargs}``."""
    import torch

    g = torch.Generator().manual_seed(0)
    if case in ("topk", "router"):
        class TopK(torch.nn.Module):
            def forward(self, x):
                w, i = torch.topk(torch.softmax(x, dim=-1), 2, dim=-1)
                return (w / w.sum(-1, keepdim=True) if case == "router" else w), i

        return [(f"{case} {n}x{v}", TopK().eval(), (torch.randn(n, v, generator=g) * 3,), FORMS)
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

    out = []
    for L in seqs:
        q, k, v = (torch.randn(4, 8, L, 64, generator=g) for _ in range(3))
        mask = torch.zeros(4, 1, 1, L)
        mask[1, ..., L * 3 // 4:] = torch.finfo(torch.float32).min          # one padded sequence
        for causal in (True, False):
            out.append((f"attention L={L} {'causal' if causal else 'padded'}", Attn(causal).eval(), (q, k, v, mask),
                        ATTENTION_FORMS))
    return out


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--cases", type=common.choice_list(CASES), default=list(CASES),
                   help=f"comma-separated (default: {','.join(CASES)})")
    p.add_argument("--seq", type=common.int_list, default=[128, 512], help="attention lengths (default: 128,512)")
    args = p.parse_args(argv)
    rows = [measure(label, module, inputs, {}, forms, args.threads, rounds=5)
            for case in args.cases for label, module, inputs, forms in modules(case, args.seq)]
    report(rows, args, "onnxruntime CPU latency of each ONNX form of one site")
    return 0


if __name__ == "__main__":
    sys.exit(main())
