#!/usr/bin/env python
"""smxcompile's public ops called eagerly against the torch code each one replaces, timed in turn in one process
(``torch ms / smx ms`` >= 1: the op is at least as fast); CPU, or CUDA when present.

  python benchmarks/bench_eager_ops.py [--quick] [--ops softmax_topk,attention] [--markdown] [--json PATH]
"""

import argparse
import math
import sys
from functools import partial
from typing import Callable

import torch
import torch.ao.quantization.fx._decomposed  # noqa: F401  (registers the quantized_decomposed ops)
import torch.nn.functional as F

import common
import smxcompile

OPS = ("softmax", "log_softmax", "softmax_topk", "attention", "cross_entropy", "linear_cross_entropy",
       "quant_softmax")


def causal_softcap(q, k, v, cap):
    s = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
    s = torch.tanh(s / cap) * cap
    L, S = s.shape[-2:]
    s = s.masked_fill(~torch.ones(L, S, dtype=torch.bool, device=s.device).tril(), float("-inf"))
    return torch.softmax(s, -1) @ v


def topk_smx(x, k, renorm):
    return smxcompile.softmax_topk(x, k, renormalize=renorm).values


def topk_torch(x, k, renorm):
    v = torch.softmax(x, -1).topk(k).values
    return v / v.sum(-1, keepdim=True) if renorm else v


def cases(device: str, quick: bool) -> list[tuple[str, str, Callable, Callable, list[torch.Tensor]]]:
    """(op, label, smx callable, torch callable, inputs) per row; --quick: one or two per op."""
    g = torch.Generator().manual_seed(0)

    def rnd(*shape, dtype=torch.float32, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)

    def pick(shapes: list) -> list:
        return shapes[:1] if quick else shapes

    sm, lsm = partial(torch.softmax, dim=-1), partial(torch.log_softmax, dim=-1)
    out = []
    for shape in pick([(4096, 1024), (64, 32000), (256, 16384), (8, 12, 512, 512)]):
        x, label = rnd(*shape), "x".join(map(str, shape))
        out += [("softmax", label, smxcompile.softmax, sm, [x]),
                ("log_softmax", label, smxcompile.log_softmax, lsm, [x])]
    if not quick:
        m = torch.zeros(1, 1024, device=device).masked_fill_(torch.arange(1024, device=device) >= 896, -math.inf)
        out += [("softmax", "4096x1024 scale+mask", partial(smxcompile.softmax, scale=0.125, mask=m),
                 lambda x: torch.softmax(x * 0.125 + m, -1), [rnd(4096, 1024)]),
                ("softmax", "64x32000 bf16", smxcompile.softmax, sm, [rnd(64, 32000, dtype=torch.bfloat16)])]
    topk = [(64, 131072, 50, False), (16, 32000, 50, False), (4, 262144, 8, False), (8192, 8, 2, False),
            (8192, 8, 2, True), (8192, 64, 2, False), (8192, 64, 2, True), (2048, 256, 8, True)]
    for r, c, k, renorm in [topk[0], topk[6]] if quick else topk:
        out.append(("softmax_topk", f"{r}x{c} k={k}{' renorm' if renorm else ''}",
                    partial(topk_smx, k=k, renorm=renorm), partial(topk_torch, k=k, renorm=renorm), [rnd(r, c)]))
    for B, H, Hkv, L, gqa in pick([(2, 8, 8, 512, False), (1, 8, 8, 2048, False), (1, 8, 2, 1024, True)]):
        out.append(("attention", f"{B}x{H}x{L}x64 causal{' GQA' if gqa else ''}",
                    partial(smxcompile.attention, is_causal=True, enable_gqa=gqa),
                    partial(F.scaled_dot_product_attention, is_causal=True, enable_gqa=gqa),
                    [rnd(B, H, L, 64), rnd(B, Hkv, L, 64), rnd(B, Hkv, L, 64)]))
    if not quick:
        out.append(("attention", "1x8x512x64 causal softcap=50",
                    partial(smxcompile.attention, is_causal=True, softcap=50.0), partial(causal_softcap, cap=50.0),
                    [rnd(1, 8, 512, 64) for _ in range(3)]))
    for n, v in pick([(1024, 32000), (4096, 50257)]):
        x, y = rnd(n, v), torch.randint(0, v, (n,), generator=g).to(device)
        out.append(("cross_entropy", f"{n}x{v}", partial(smxcompile.cross_entropy, target=y),
                    partial(F.cross_entropy, target=y), [x]))
    for n, d, v in pick([(1024, 256, 16384), (1024, 256, 50257), (2048, 512, 32000)]):
        x, w, y = rnd(n, d), rnd(v, d, scale=0.05), torch.randint(0, v, (n,), generator=g).to(device)
        out.append(("linear_cross_entropy", f"N={n} D={d} V={v}", partial(smxcompile.linear_cross_entropy, target=y),
                    lambda x, w, y=y: F.cross_entropy(F.linear(x, w), y), [x, w]))
    qd = torch.ops.quantized_decomposed.quantize_per_tensor
    for shape in pick([(96, 512, 512), (64, 32000)]):
        out.append(("quant_softmax", "x".join(map(str, shape)), partial(smxcompile.quant_softmax, scale=1 / 255),
                    lambda x: qd(torch.softmax(x, -1), 1 / 255, 0, 0, 255, torch.uint8), [rnd(*shape)]))
    return out


def time_pair(ours: Callable, ref: Callable, inputs: list, train: bool, threads: int, rounds: int,
              min_run_time: float) -> dict[str, float]:
    """Median ms per call of the torch code and of the op, timed in turn: under no_grad, or the gradient to the
    inputs against a fixed random cotangent."""
    xs, g = [t.detach().requires_grad_(train) for t in inputs], None
    if train:
        out = ref(*xs)
        g = torch.randn_like(out) if out.dim() else torch.ones_like(out)
    stmt = "torch.autograd.grad(f(*xs), xs, g)" if train else "f(*xs)"
    stmts = {k: (stmt, {"f": f, "xs": xs, "g": g, "torch": torch}) for k, f in (("torch", ref), ("smx", ours))}
    with torch.set_grad_enabled(train):
        return common.measure_interleaved(stmts, threads, rounds, min_run_time)[0]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.timing_flags(p, 3, 0.3, "one or two rows per op, one short round (CI smoke)")
    p.add_argument("--ops", type=common.choice_list(OPS), default=list(OPS), help=f"a subset of {','.join(OPS)}")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu",
                   help="where the ops run (default %(default)s)")
    a = p.parse_args(argv)
    common.devices(a.device)  # exits 2 for cuda without CUDA
    torch.set_num_threads(a.threads)
    rounds, mrt = a.rounds or (1 if a.quick else 3), a.min_run_time or (0.05 if a.quick else 0.3)
    command = common.command_line(argv, "benchmarks/bench_eager_ops.py")
    print(f"$ {command}\ntorch {torch.__version__}, {a.device}, {a.threads} threads", flush=True)
    rows = []
    for op, label, ours, ref, inputs in (c for c in cases(a.device, a.quick) if c[0] in a.ops):
        for train in (False,) if op == "quant_softmax" else (False, True):   # quant_softmax: codes, no gradient
            t = time_pair(ours, ref, inputs, train, a.threads, rounds, mrt)
            rows.append({"op": op, "case": label, "pass": "fwd+bwd" if train else "fwd", "torch_ms": t["torch"],
                         "smx_ms": t["smx"], "speed": t["torch"] / t["smx"]})
            print(f"  {op:21s} {label:28s} {rows[-1]['pass']:7s} torch {t['torch']:9.3f} ms  smx {t['smx']:9.3f} ms  "
                  f"{rows[-1]['speed']:.2f}x", file=sys.stderr, flush=True)
    common.print_table(f"public ops called eagerly against the torch code they replace ({a.device}, {a.threads} "
                       "threads)", ["op", "case", "pass", "torch ms", "smx ms", "torch / smx"],
                       [[r["op"], r["case"], r["pass"], f"{r['torch_ms']:.3f}", f"{r['smx_ms']:.3f}",
                         f"{r['speed']:.2f}"] for r in rows], a.markdown)
    slower = [r for r in rows if r["speed"] < 0.97]
    print(f"\n{len(slower)} of {len(rows)} rows below 0.97x torch" + "".join(
        f"\n  {r['op']} {r['case']} {r['pass']}: {r['speed']:.2f}x" for r in slower))
    common.write_json(a.json, {"command": command, "env": common.environment(a.threads), "rows": rows})
    print(f"$ {command}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
