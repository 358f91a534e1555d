#!/usr/bin/env python
"""smxcompile's public ops called eagerly (softmax, log_softmax, softmax_topk, attention, cross_entropy,
linear_cross_entropy, quant_softmax) against the torch code each one replaces, timed in turn in one process:
``torch ms / smx ms`` of 1.00 or more means the op is at least as fast. CPU, or CUDA when present.

  python benchmarks/bench_eager_ops.py [--quick] [--ops softmax_topk,attention] [--markdown] [--json PATH]
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Callable

import torch
import torch.ao.quantization.fx._decomposed  # noqa: F401  (registers the quantized_decomposed ops)
import torch.nn.functional as F

import common
import smxcompile

OPS = ("softmax", "log_softmax", "softmax_topk", "attention", "cross_entropy", "linear_cross_entropy",
       "quant_softmax")


def _causal_softcap(q, k, v, cap):
    s = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
    s = torch.tanh(s / cap) * cap
    L, S = s.shape[-2:]
    s = s.masked_fill(~torch.ones(L, S, dtype=torch.bool, device=s.device).tril(), float("-inf"))
    return torch.softmax(s, -1) @ v


def cases(device: str, quick: bool) -> list[tuple[str, str, Callable, Callable, list[torch.Tensor]]]:
    """(op, label, smx callable, torch callable, float inputs that get gradients) per row."""
    g = torch.Generator().manual_seed(0)

    def rnd(*shape, dtype=torch.float32, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)

    out = []
    for shape in ([(4096, 1024)] if quick else [(4096, 1024), (64, 32000), (256, 16384), (8, 12, 512, 512)]):
        x = rnd(*shape)
        label = "x".join(map(str, x.shape))
        out.append(("softmax", label, lambda x: smxcompile.softmax(x), lambda x: torch.softmax(x, -1), [x]))
        if not quick:
            out.append(("log_softmax", label, lambda x: smxcompile.log_softmax(x), lambda x: torch.log_softmax(x, -1),
                        [x]))
    if not quick:
        x = rnd(4096, 1024)
        m = torch.zeros(1, 1024, device=device).masked_fill_(torch.arange(1024, device=device) >= 896, -math.inf)
        out.append(("softmax", "4096x1024 scale+mask", lambda x: smxcompile.softmax(x, scale=0.125, mask=m),
                    lambda x: torch.softmax(x * 0.125 + m, -1), [x]))
        xb = rnd(64, 32000, dtype=torch.bfloat16)
        out.append(("softmax", "64x32000 bf16", lambda x: smxcompile.softmax(x), lambda x: torch.softmax(x, -1), [xb]))
    topk_shapes = [(64, 131072, 50, False), (8192, 64, 2, True)] if quick else [
        (64, 131072, 50, False), (16, 32000, 50, False), (4, 262144, 8, False), (8192, 8, 2, False),
        (8192, 8, 2, True), (8192, 64, 2, False), (8192, 64, 2, True), (2048, 256, 8, True)]
    for r, c, k, renorm in topk_shapes:
        x = rnd(r, c)
        if renorm:
            def ours(x, k=k):
                return smxcompile.softmax_topk(x, k, renormalize=True).values

            def ref(x, k=k):
                v = torch.softmax(x, -1).topk(k).values
                return v / v.sum(-1, keepdim=True)
        else:
            def ours(x, k=k):
                return smxcompile.softmax_topk(x, k).values

            def ref(x, k=k):
                return torch.softmax(x, -1).topk(k).values
        out.append(("softmax_topk", f"{r}x{c} k={k}{' renorm' if renorm else ''}", ours, ref, [x]))
    for B, H, Hkv, L, gqa in ([(2, 8, 8, 512, False)] if quick else
                              [(2, 8, 8, 512, False), (1, 8, 8, 2048, False), (1, 8, 2, 1024, True)]):
        q, k_, v = rnd(B, H, L, 64), rnd(B, Hkv, L, 64), rnd(B, Hkv, L, 64)
        out.append(("attention", f"{B}x{H}x{L}x64 causal{' GQA' if gqa else ''}",
                    lambda q, k, v, gqa=gqa: smxcompile.attention(q, k, v, is_causal=True, enable_gqa=gqa),
                    lambda q, k, v, gqa=gqa: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa),
                    [q, k_, v]))
    if not quick:
        q, k_, v = rnd(1, 8, 512, 64), rnd(1, 8, 512, 64), rnd(1, 8, 512, 64)
        out.append(("attention", "1x8x512x64 causal softcap=50",
                    lambda q, k, v: smxcompile.attention(q, k, v, is_causal=True, softcap=50.0),
                    lambda q, k, v: _causal_softcap(q, k, v, 50.0), [q, k_, v]))
    for n, v_ in ([(1024, 32000)] if quick else [(1024, 32000), (4096, 50257)]):
        logits, y = rnd(n, v_), torch.randint(0, v_, (n,), generator=g).to(device)
        out.append(("cross_entropy", f"{n}x{v_}", lambda z, y=y: smxcompile.cross_entropy(z, y),
                    lambda z, y=y: F.cross_entropy(z, y), [logits]))
    for n, d, v_ in ([(1024, 256, 32000)] if quick else [(1024, 256, 16384), (1024, 256, 50257), (2048, 512, 32000)]):
        x, w = rnd(n, d), rnd(v_, d, scale=0.05)
        y = torch.randint(0, v_, (n,), generator=g).to(device)
        out.append(("linear_cross_entropy", f"N={n} D={d} V={v_}",
                    lambda x, w, y=y: smxcompile.linear_cross_entropy(x, w, y),
                    lambda x, w, y=y: F.cross_entropy(F.linear(x, w), y), [x, w]))
    qd = torch.ops.quantized_decomposed.quantize_per_tensor
    for shape in ([(96, 512, 512)] if quick else [(96, 512, 512), (64, 32000)]):
        x = rnd(*shape)
        out.append(("quant_softmax", "x".join(map(str, shape)),
                    lambda x: smxcompile.quant_softmax(x, scale=1 / 255),
                    lambda x: qd(torch.softmax(x, -1), 1 / 255, 0, 0, 255, torch.uint8), [x]))
    return out


def statement(fn: Callable, inputs: list[torch.Tensor], train: bool, device: str) -> Callable[[], object]:
    """A call of ``fn``: under no_grad, or its gradient to the inputs against a fixed random cotangent; synced."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    if not train:
        def run():
            with torch.no_grad():
                fn(*inputs)
            sync()
        return run
    leaves = [t.detach().requires_grad_(True) for t in inputs]
    probe = fn(*leaves)
    cot = torch.randn_like(probe) if probe.dim() else torch.ones_like(probe)

    def run_grad():
        torch.autograd.grad(fn(*leaves), leaves, cot)
        sync()
    return run_grad


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="one or two rows per op, one short round (CI smoke)")
    p.add_argument("--ops", type=common.choice_list(OPS), default=list(OPS), help=f"comma-separated subset of "
                                                                                  f"{','.join(OPS)}")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--rounds", type=int, default=None, help="timing rounds per row (default 3; --quick 1)")
    p.add_argument("--min-run-time", type=float, default=None,
                   help="seconds of blocked_autorange per op per round (default 0.3; --quick 0.1)")
    p.add_argument("--threads", type=int, default=common.cores(), help="torch.set_num_threads")
    p.add_argument("--json", metavar="PATH", help="write every row as JSON")
    p.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    torch.set_num_threads(a.threads)
    rounds, mrt = a.rounds or (1 if a.quick else 3), a.min_run_time or (0.1 if a.quick else 0.3)
    command = common.command_line(argv, "benchmarks/bench_eager_ops.py")
    print(f"$ {command}\ntorch {torch.__version__}, {a.device}, {a.threads} threads", flush=True)
    rows = []
    for op, label, ours, ref, inputs in cases(a.device, a.quick):
        for train in (False, True):
            if op not in a.ops or train and (op == "quant_softmax" or not any(t.is_floating_point() for t in inputs)):
                continue  # quant_softmax: integer codes, no gradient
            stmts = {"torch": statement(ref, inputs, train, a.device), "smx": statement(ours, inputs, train, a.device)}
            t = common.measure_interleaved({k: ("call()", {"call": f}) for k, f in stmts.items()}, a.threads, rounds,
                                           mrt)[0]
            row = {"op": op, "case": label, "pass": "fwd+bwd" if train else "fwd", "torch_ms": t["torch"],
                   "smx_ms": t["smx"], "speed": t["torch"] / t["smx"]}
            rows.append(row)
            print(f"  {op:21s} {label:28s} {row['pass']:7s} torch {t['torch']:9.3f} ms  smx {t['smx']:9.3f} ms  "
                  f"{row['speed']:.2f}x", file=sys.stderr, flush=True)
    head = ["op", "case", "pass", "torch ms", "smx ms", "torch / smx"]
    body = [[r["op"], r["case"], r["pass"], f"{r['torch_ms']:.3f}", f"{r['smx_ms']:.3f}", f"{r['speed']:.2f}"]
            for r in rows]
    if a.markdown:
        print(common.markdown_table(head, body))
    else:
        widths = [max(len(x) for x in col) for col in zip(head, *body)]
        print("\n".join("  ".join(x.ljust(w) for x, w in zip(line, widths)) for line in [head] + body))
    slower = [r for r in rows if r["speed"] < 0.97]
    print(f"\n{len(slower)} of {len(rows)} rows below 0.97x torch" + "".join(
        f"\n  {r['op']} {r['case']} {r['pass']}: {r['speed']:.2f}x" for r in slower))
    common.write_json(a.json, {"command": command, "torch": torch.__version__, "device": a.device,
                               "threads": a.threads, "rows": rows})
    print(f"$ {command}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
