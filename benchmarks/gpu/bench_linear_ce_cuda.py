"""Linear + cross-entropy on CUDA (benchmarks/gpu/run.sh): eager, Inductor, smx (default: the site kept), smx-rewrite
(smx's Triton cut CE) and the op in its three backward modes (exact; filter_eps="auto"; precise_grad=True): per
vocabulary the step time (fwd+bwd, median of 5), peak memory above the inputs, loss and dW against eager's."""

import argparse
import time

import torch
import torch.nn.functional as F

import smxcompile


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
    for v in (32000, 128256):
        x = torch.randn(n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = (torch.randn(v, d, device="cuda", dtype=torch.bfloat16) * 0.02).requires_grad_()
        y = torch.randint(0, v, (n,), device="cuda")
        y[::10] = -100

        def eager(x, w, y):
            return F.cross_entropy(F.linear(x, w).float(), y)

        variants = {"eager": eager, "inductor": torch.compile(eager),
                    "smx": torch.compile(eager, backend="smx"),
                    "smx-rewrite": torch.compile(eager, backend="smx", options={"cuda": "rewrite"}),
                    "smx-op": lambda x, w, y: smxcompile.linear_cross_entropy(x, w, y, dtype=torch.float32),
                    "smx-op-filtered": lambda x, w, y: smxcompile.linear_cross_entropy(
                        x, w, y, dtype=torch.float32, filter_eps="auto"),
                    "smx-op-precise": lambda x, w, y: smxcompile.linear_cross_entropy(
                        x, w, y, dtype=torch.float32, precise_grad=True)}
        ref = None
        for name, fn in variants.items():
            for _ in range(2):
                step(fn, x, w, y)
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            ts = []
            for _ in range(5):
                t = time.perf_counter()
                loss = step(fn, x, w, y)
                torch.cuda.synchronize()
                ts.append(time.perf_counter() - t)
            peak = (torch.cuda.max_memory_allocated() - base) / 1e9
            gw = w.grad.float()
            if ref is None:
                ref = (loss.item(), gw)
            dl = abs(loss.item() - ref[0]) / abs(ref[0])
            dw = ((gw - ref[1]).abs().max() / ref[1].abs().max()).item()
            print(f"| {v} | {name} | {sorted(ts)[2] * 1e3:.1f} | {peak:.3f} | {dl:.1e} | {dw:.1e} |")
        print("smx report:", smxcompile.last_report().summary() if smxcompile.last_report() else None)


if __name__ == "__main__":
    main()
