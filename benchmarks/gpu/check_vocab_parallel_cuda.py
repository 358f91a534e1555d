#!/usr/bin/env python
"""Vocabulary-parallel cut cross-entropy on CUDA: 2 gloo processes on one GPU, every shard on the Triton kernels,
against the unsharded op (docs/PERFORMANCE.md); a line per case, exit status 1 on a mismatch.

  python benchmarks/gpu/check_vocab_parallel_cuda.py [--device cpu]   # cpu: the same checks on the CPU paths
"""

import argparse
import os
import sys
import tempfile

import torch
import torch.multiprocessing as mp

CASES = {
    "mean": dict(reduction="mean"),
    "none+smoothing+class_weight": dict(reduction="none", label_smoothing=0.1, class_weight=True),
    "sum+softcap+z_loss": dict(reduction="sum", softcap=20.0, lse_square_scale=1e-3),
    "mean+scale+bias": dict(reduction="mean", scale=0.7, bias=True),
    "all ignored (sum)": dict(reduction="sum", ignored=True),
    "bf16 mean": dict(reduction="mean", dtype=torch.bfloat16),
}
N, D, V = 300, 64, 1001  # V odd: shards of 501 and 500
OP_ARGS = ("reduction", "label_smoothing", "softcap", "lse_square_scale", "scale")


def problem(opts, device):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, D, generator=g)
    w = torch.randn(V, D, generator=g) * D ** -0.5 * 4
    b = torch.randn(V, generator=g) if opts.get("bias") else None
    t = torch.randint(0, V, (N,), generator=g)
    t[torch.rand(N, generator=g) < 0.2] = -100
    if opts.get("ignored"):
        t[:] = -100
    kw = {k: v for k, v in opts.items() if k in OP_ARGS}
    if opts.get("class_weight"):
        kw["class_weight"] = (torch.rand(V, generator=g) + 0.5).to(device)
    x, w, b = (None if u is None else u.to(device, opts.get("dtype", torch.float32)) for u in (x, w, b))
    return x, w, b, t.to(device), kw


def run(x, w, b, t, kw, **extra):
    """The loss and the gradients of x, W (and b) under a fixed random upstream gradient, on the CPU."""
    import smxcompile

    leaves = [u.clone().requires_grad_() for u in (x, w, b) if u is not None]
    loss = smxcompile.linear_cross_entropy(*leaves[:2], t, bias=leaves[2] if b is not None else None, **kw, **extra)
    g = torch.Generator().manual_seed(1)
    up = torch.randn(loss.shape, generator=g).to(loss.device, loss.dtype) if loss.dim() else torch.ones_like(loss)
    return [loss.detach().cpu()] + [gr.cpu() for gr in torch.autograd.grad(loss, leaves, up)]


def worker(rank, world, folder, device):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=world)
    out, sl = {}, slice(rank * -(-V // world), (rank + 1) * -(-V // world))
    for name, opts in CASES.items():
        x, w, b, t, kw = problem(opts, device)
        out[name] = run(x, w[sl].contiguous(), b[sl].contiguous() if b is not None else None, t, kw,
                        process_group=dist.group.WORLD)
    torch.save(out, os.path.join(folder, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        mp.start_processes(worker, args=(2, folder, args.device), nprocs=2, join=True, start_method="spawn")
        ranks = [torch.load(os.path.join(folder, f"rank{r}.pt")) for r in range(2)]
    bad = 0
    for name, opts in CASES.items():
        ref = run(*problem(opts, args.device))
        # the loss and x's gradient are replicated; W's (and b's) are the ranks' shards, concatenated
        ours = ranks[0][name][:2] + [torch.cat([ranks[0][name][i], ranks[1][name][i]]) for i in range(2, len(ref))]
        eps, errs = torch.finfo(opts.get("dtype", torch.float32)).eps, []
        for o, r in zip(ours, ref):
            fin = ~r.isnan()
            scale = r[fin].abs().max().item() if fin.any() else 0.0
            err = (o[fin].double() - r[fin].double()).abs().max().item() if fin.any() else 0.0
            errs.append(err / scale if scale else err)
            bad += not torch.equal(o.isnan(), r.isnan()) or err > 64 * eps * scale
        print(f"{'ok ' if all(e <= 64 * eps for e in errs) else 'BAD'} {name:32s} rel. err loss/grads: "
              + " ".join(f"{e:.1e}" for e in errs))
    print(f"vocab-parallel on {args.device}: {'all match' if not bad else f'{bad} mismatch(es)'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
