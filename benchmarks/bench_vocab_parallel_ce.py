#!/usr/bin/env python
"""Vocabulary-parallel LM-head loss, one training step (forward + backward of ``F.cross_entropy(x @ W.T, y)``, W
sharded by vocabulary rows over --world-size processes: gloo on CPU, nccl on CUDA): the bytes each variant's
collectives move, step time, peak memory and the difference from smx's loss and x.grad. Variants: smx
(``smxcompile.linear_cross_entropy(..., process_group=)``), allgather (the naive all-gather of the logits, as
Megatron-LM), loss_parallel (PyTorch's DTensor loss_parallel). Columns: docs/PERFORMANCE.md ("Vocabulary-parallel
cut cross-entropy").

  python benchmarks/bench_vocab_parallel_ce.py [--vocab 50257 --n 2048] [--world-size 4] [--markdown] [--json P]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp

import common
from smx_app.argtypes import positive_int

VARIANTS = ("smx", "allgather", "loss_parallel")


class _GatherVocab(torch.autograd.Function):
    """All-gather the logits' vocabulary shards; backward keeps this rank's columns (the loss is replicated,
    so no reduction), as Megatron-LM's gather_from_tensor_model_parallel_region."""

    @staticmethod
    def forward(ctx, logits, group):
        import torch.distributed as dist

        parts = [torch.empty_like(logits) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, logits.contiguous(), group=group)
        ctx.rank, ctx.width = dist.get_rank(group), logits.shape[1]
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, grad):
        return grad[:, ctx.rank * ctx.width:(ctx.rank + 1) * ctx.width], None


def _step(variant, x, w_local, y, group, mesh, comm):
    """Forward and backward of one variant; returns (loss, number of collectives of the forward)."""
    import torch.nn.functional as F

    import smxcompile

    if variant == "smx":
        loss = smxcompile.linear_cross_entropy(x, w_local, y, process_group=group)
        n_fwd = len(comm.collectives)
        loss.backward()
        return loss, n_fwd
    logits = x @ w_local.t()
    if variant == "allgather":
        loss = F.cross_entropy(_GatherVocab.apply(logits, group), y)
        n_fwd = len(comm.collectives)
        loss.backward()
        return loss, n_fwd
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import loss_parallel

    dlog = DTensor.from_local(logits, mesh, [Shard(1)], run_check=False)
    with loss_parallel():  # the backward must run inside it too
        loss = F.cross_entropy(dlog, y)
        n_fwd = len(comm.collectives)
        loss.backward()
    return loss.full_tensor(), n_fwd


def _worker(rank, world, folder, args):
    import torch.distributed as dist

    from smx_app.demo import PeakMemory
    from smxcompile.distributed import CollectiveCounter

    cuda = torch.cuda.is_available()
    device = f"cuda:{rank}" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(rank)
    torch.set_num_threads(args.threads)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{folder}/store", rank=rank,
                            world_size=world)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cuda" if cuda else "cpu", (world,))
    group = dist.group.WORLD
    results = []
    for v in args.vocab:
        g = torch.Generator().manual_seed(0)
        x0 = torch.randn(args.n, args.d, generator=g).to(device)
        y = torch.randint(0, v, (args.n,), generator=g).to(device)
        step = -(-v // world)
        sizes = [max(0, min(step, v - r * step)) for r in range(world)]
        start = sum(sizes[:rank])
        w_full = torch.randn(v, args.d, generator=g) * args.d ** -0.5
        w0 = w_full[start:start + sizes[rank]].to(device)
        del w_full
        ref = None
        for variant in args.variants:
            if variant != "smx" and len(set(sizes)) != 1:
                results.append({"vocab": v, "variant": variant, "error": "needs V divisible by the world size"})
                continue
            times, peaks = [], []
            for r in range(args.rounds + 1):
                x = x0.clone().requires_grad_()
                w = w0.clone().requires_grad_()
                dist.barrier()
                with CollectiveCounter() as comm, PeakMemory("cuda" if cuda else "cpu") as mem:
                    t0 = time.perf_counter()
                    loss, n_fwd = _step(variant, x, w, y, group, mesh, comm)
                    if variant != "smx":
                        dist.all_reduce(x.grad, group=group)  # the full gradient of the replicated x
                    if cuda:
                        torch.cuda.synchronize()
                    dt = time.perf_counter() - t0
                if r:
                    times.append(dt)
                    peaks.append(mem.peak_bytes or 0)
            # grad_input's all_reduce (N x D, the same in every variant) apart from what the loss itself moves
            gx_bytes = x0.numel() * x0.element_size()
            is_gx = [c.op == "allreduce_" and c.received == gx_bytes for c in comm.collectives]
            loss_fwd = sum(c.received for c, g in zip(comm.collectives[:n_fwd], is_gx) if not g)
            loss_bwd = sum(c.received for c, g in zip(comm.collectives[n_fwd:], is_gx[n_fwd:]) if not g)
            row = {"vocab": v, "variant": variant, "n": args.n, "d": args.d, "world": world,
                   "loss_fwd_bytes": loss_fwd, "loss_bwd_bytes": loss_bwd,
                   "grad_input_bytes": sum(c.received for c, g in zip(comm.collectives, is_gx) if g),
                   "collectives": len(comm.collectives),
                   "step_ms": 1e3 * statistics.median(times), "peak_bytes": max(peaks), "memory": mem.method,
                   "loss": float(loss.detach())}
            gx = x.grad.detach().cpu()
            if variant == "smx":
                ref = (row["loss"], gx)
            elif ref is not None:
                row["dloss"] = abs(row["loss"] - ref[0]) / abs(ref[0])
                row["dgrad"] = float((gx - ref[1]).abs().max() / ref[1].abs().max())
            results.append(row)
    if rank == 0:
        torch.save(results, os.path.join(folder, "results.pt"))
    dist.barrier()
    dist.destroy_process_group()


def _table(rows, markdown: bool) -> str:
    head = ["V", "variant", "loss fwd MB", "loss bwd MB", "grad_input MB", "collectives", "step ms", "peak MB",
            "|dloss|", "|dgrad|"]
    lines, notes = [], []
    for r in rows:
        if "error" in r:
            lines.append([str(r["vocab"]), r["variant"]] + ["-"] * 8)
            notes.append(f"V={r['vocab']} {r['variant']}: {r['error']}")
            continue
        lines.append([str(r["vocab"]), r["variant"], f"{r['loss_fwd_bytes'] / 1e6:.3f}",
                      f"{r['loss_bwd_bytes'] / 1e6:.3f}", f"{r['grad_input_bytes'] / 1e6:.3f}",
                      str(r["collectives"]), f"{r['step_ms']:.1f}", f"{r['peak_bytes'] / 1e6:.1f}",
                      f"{r['dloss']:.1e}" if "dloss" in r else "-", f"{r['dgrad']:.1e}" if "dgrad" in r else "-"])
    if markdown:
        out = [common.markdown_table(head, lines)]
        return "\n".join(out + [""] + notes if notes else out)
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(head)]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    return "\n".join([fmt.format(*head)] + [fmt.format(*line) for line in lines] + notes)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=positive_int, default=2,
                   help="processes (GPUs with nccl when CUDA is available)")
    p.add_argument("--n", type=positive_int, default=1024, help="tokens per step (rows of x), default 1024")
    p.add_argument("--d", type=positive_int, default=256, help="hidden size, default 256")
    p.add_argument("--vocab", type=lambda s: [positive_int(v) for v in s.split(",")], default=[8192, 32768],
                   help="comma-separated vocabulary sizes, default 8192,32768")
    p.add_argument("--variants", type=lambda s: s.split(","), default=list(VARIANTS),
                   help=f"comma-separated, from {','.join(VARIANTS)}")
    p.add_argument("--rounds", type=positive_int, default=3, help="timed steps per variant after one warm-up (median)")
    p.add_argument("--threads", type=positive_int, default=1, help="intra-op threads per process on CPU, default 1")
    p.add_argument("--json", help="write the rows to this file")
    p.add_argument("--markdown", action="store_true", help="print a markdown table")
    args = p.parse_args(argv)
    bad = [v for v in args.variants if v not in VARIANTS]
    if bad:
        p.error(f"unknown variant(s) {bad}; choose from {VARIANTS}")
    if "smx" in args.variants:
        args.variants = ["smx"] + [v for v in args.variants if v != "smx"]  # the reference runs first
    if torch.cuda.is_available() and torch.cuda.device_count() < args.world_size:
        p.error(f"--world-size {args.world_size} needs that many GPUs ({torch.cuda.device_count()} visible)")
    with tempfile.TemporaryDirectory(prefix="smx-bench-") as folder:
        mp.start_processes(_worker, args=(args.world_size, folder, args), nprocs=args.world_size, join=True,
                           start_method="spawn")
        rows = torch.load(os.path.join(folder, "results.pt"), weights_only=False)
    dev = "cuda (nccl)" if torch.cuda.is_available() else "cpu (gloo)"
    print(f"# vocabulary-parallel LM-head loss, {args.world_size} ranks on {dev}, N={args.n} D={args.d}, fp32")
    print(_table(rows, args.markdown))
    cmd = "python benchmarks/bench_vocab_parallel_ce.py " + " ".join(sys.argv[1:] if argv is None else argv)
    print(f"\ncommand: {cmd.strip()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": cmd.strip(), "device": dev, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
