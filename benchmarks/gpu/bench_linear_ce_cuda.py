"""Linear + cross-entropy on CUDA (run by benchmarks/gpu/run.sh), per vocabulary and variant (eager, Inductor, smx,
smx-rewrite, the op in its three backward modes): step time (fwd+bwd, median of 5 CUDA-event timed steps after 2),
peak memory above the inputs, loss and dW against eager's."""

import argparse
import functools
import os
import sys

import torch
import torch.nn.functional as F

import smxcompile
from smx_app.demo.memory import PeakMemory

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common  # noqa: E402


def eager(x, w, y):
    return F.cross_entropy(F.linear(x, w).float(), y)


def step(fn, x, w, y):
    x.grad = w.grad = None
    loss = fn(x, w, y)
    loss.backward()
    return loss


def main():
    argparse.ArgumentParser(description=__doc__).parse_args()
    torch.manual_seed(0)
    n, d = 8192, 2048
    print(f"N={n} D={d} bf16 weights+inputs, fp32 loss; torch {torch.__version__} {torch.cuda.get_device_name()}")
    print("| V | variant | ms | peak GB above inputs | rel dloss | rel dW |\n|---|---|---|---|---|---|")
    lce = functools.partial(smxcompile.linear_cross_entropy, dtype=torch.float32)
    variants = {"eager": eager, "inductor": torch.compile(eager), "smx": torch.compile(eager, backend="smx"),
                "smx-rewrite": torch.compile(eager, backend="smx", options={"cuda": "rewrite"}), "smx-op": lce,
                "smx-op-filtered": functools.partial(lce, filter_eps="auto"),
                "smx-op-precise": functools.partial(lce, precise_grad=True)}
    for v in (32000, 128256):
        x = torch.randn(n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = (torch.randn(v, d, device="cuda", dtype=torch.bfloat16) * 0.02).requires_grad_()
        y = torch.randint(0, v, (n,), device="cuda")
        y[::10] = -100
        ref = None
        for name, fn in variants.items():
            for _ in range(2):
                step(fn, x, w, y)
            with PeakMemory("cuda") as mem:
                ms = common.cuda_ms(lambda: step(fn, x, w, y), 5, warmup=0)
            loss, gw = step(fn, x, w, y), w.grad.float()
            ref = ref or (loss.item(), gw)
            dloss, dw = abs(loss.item() - ref[0]) / abs(ref[0]), ((gw - ref[1]).abs().max() / ref[1].abs().max()).item()
            print(f"| {v} | {name} | {ms:.1f} | {mem.peak_bytes / 1e9:.3f} | {dloss:.1e} | {dw:.1e} |")
        print("smx report:", smxcompile.last_report().summary() if smxcompile.last_report() else None)


if __name__ == "__main__":
    main()
