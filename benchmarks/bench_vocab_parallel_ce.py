"""Vocabulary-parallel LM-head loss: one training step of ``F.cross_entropy(x @ W.T, y)``, W sharded by vocabulary
rows over --world-size processes (gloo on CPU, nccl on CUDA), per variant (docs/PERFORMANCE.md): the bytes its
collectives move, step time, peak memory and the difference from smx's loss and x.grad.

  python benchmarks/bench_vocab_parallel_ce.py [--vocab 50257 --n 2048] [--world-size 4] [--markdown] [--json P]
"""

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import loss_parallel

import common
import smxcompile
from smx_app.argtypes import positive_int
from smx_app.demo import PeakMemory
from smxcompile.distributed import CollectiveCounter

VARIANTS = ("smx", "allgather", "loss_parallel")
#: the table's columns: {header: (row key, scale, format)}
COLUMNS = {"loss fwd MB": ("loss_fwd_bytes", 1e-6, "{:.3f}"), "loss bwd MB": ("loss_bwd_bytes", 1e-6, "{:.3f}"),
           "grad_input MB": ("grad_input_bytes", 1e-6, "{:.3f}"), "collectives": ("collectives", 1, "{}"),
           "step ms": ("step_ms", 1, "{:.1f}"), "peak MB": ("peak_bytes", 1e-6, "{:.1f}"),
           "|dloss|": ("dloss", 1, "{:.1e}"), "|dgrad|": ("dgrad", 1, "{:.1e}")}


class GatherVocab(torch.autograd.Function):
    """All-gather the logits' vocabulary shards; backward keeps this rank's columns, as Megatron-LM does."""

    @staticmethod
    def forward(ctx, logits, group):
        parts = [torch.empty_like(logits) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, logits.contiguous(), group=group)
        ctx.rank, ctx.width = dist.get_rank(group), logits.shape[1]
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, grad):
        return grad[:, ctx.rank * ctx.width:(ctx.rank + 1) * ctx.width], None


def loss_of(variant, x, w_local, y, group, mesh):
    """The forward of one variant: a scalar loss and the context its backward must run in."""
    if variant == "smx":
        return smxcompile.linear_cross_entropy(x, w_local, y, process_group=group), contextlib.nullcontext()
    if variant == "allgather":
        return F.cross_entropy(GatherVocab.apply(x @ w_local.t(), group), y), contextlib.nullcontext()
    logits = DTensor.from_local(x @ w_local.t(), mesh, [Shard(1)], run_check=False)
    with loss_parallel():  # the backward must run inside it too
        return F.cross_entropy(logits, y), loss_parallel()


def measure(variant, x0, w0, y, group, mesh, rounds, cuda) -> dict:
    """``rounds`` steps after a warm-up: median ms, peak memory, the last step's collectives, loss and x.grad."""
    times, peaks = [], []
    for r in range(rounds + 1):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        dist.barrier()
        with CollectiveCounter() as comm, PeakMemory("cuda" if cuda else "cpu") as mem:
            t0 = time.perf_counter()
            loss, ctx = loss_of(variant, x, w, y, group, mesh)
            n_fwd = len(comm.collectives)
            with ctx:
                loss.backward()
            if variant != "smx":
                dist.all_reduce(x.grad, group=group)  # the full gradient of the replicated x
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        peaks.append(mem.peak_bytes or 0)
    gx_bytes = x0.numel() * x0.element_size()
    sizes = [(c.received, c.op == "allreduce_" and c.received == gx_bytes) for c in comm.collectives]
    loss = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
    return {"loss_fwd_bytes": sum(b for b, gx in sizes[:n_fwd] if not gx),
            "loss_bwd_bytes": sum(b for b, gx in sizes[n_fwd:] if not gx),
            "grad_input_bytes": sum(b for b, gx in sizes if gx), "collectives": len(sizes),
            "step_ms": 1e3 * statistics.median(times[1:]), "peak_bytes": max(peaks[1:]), "memory": mem.method,
            "loss": float(loss.detach()), "x_grad": x.grad.detach().cpu()}


def worker(rank, world, folder, args):
    cuda = torch.cuda.is_available()
    device = f"cuda:{rank}" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(rank)
    torch.set_num_threads(1)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{folder}/store", rank=rank,
                            world_size=world)
    mesh, group, results = init_device_mesh("cuda" if cuda else "cpu", (world,)), dist.group.WORLD, []
    for v in args.vocab:
        g = torch.Generator().manual_seed(0)
        x0 = torch.randn(args.n, args.d, generator=g).to(device)
        y = torch.randint(0, v, (args.n,), generator=g).to(device)
        step = -(-v // world)
        w0 = (torch.randn(v, args.d, generator=g) * args.d ** -0.5)[rank * step:(rank + 1) * step].to(device)
        ref = None
        for variant in args.variants:
            if variant != "smx" and v % world:
                results.append({"vocab": v, "variant": variant, "error": "needs V divisible by the world size"})
                continue
            row = dict(vocab=v, variant=variant, n=args.n, d=args.d, world=world,
                       **measure(variant, x0, w0, y, group, mesh, args.rounds, cuda))
            gx = row.pop("x_grad")
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=positive_int, default=2, help="processes (GPUs with nccl when on CUDA)")
    p.add_argument("--n", type=positive_int, default=1024, help="tokens per step (rows of x), default 1024")
    p.add_argument("--d", type=positive_int, default=256, help="hidden size, default 256")
    p.add_argument("--vocab", type=common.int_list, default=[8192, 32768], help="vocabulary sizes, default 8192,32768")
    p.add_argument("--variants", type=lambda s: sorted(common.choice_list(VARIANTS)(s), key=lambda v: v != "smx"),
                   default=list(VARIANTS), help=f"comma-separated, from {','.join(VARIANTS)}")
    p.add_argument("--rounds", type=positive_int, default=3, help="timed steps per variant after one warm-up (median)")
    p.add_argument("--json", help="write the rows to this file")
    p.add_argument("--markdown", action="store_true", help="print a markdown table")
    args = p.parse_args(argv)
    if torch.cuda.is_available() and torch.cuda.device_count() < args.world_size:
        p.error(f"--world-size {args.world_size} needs that many GPUs ({torch.cuda.device_count()} visible)")
    with tempfile.TemporaryDirectory(prefix="smx-bench-") as folder:
        mp.start_processes(worker, args=(args.world_size, folder, args), nprocs=args.world_size, join=True,
                           start_method="spawn")
        rows = torch.load(os.path.join(folder, "results.pt"), weights_only=False)
    dev = "cuda (nccl)" if torch.cuda.is_available() else "cpu (gloo)"
    body = [[str(r["vocab"]), r["variant"], *(f.format(r[k] * x) if k in r else "-" for k, x, f in COLUMNS.values())]
            for r in rows]
    common.print_table(f"vocabulary-parallel LM-head loss, {args.world_size} ranks on {dev}, N={args.n} D={args.d}, "
                       "fp32", ["V", "variant", *COLUMNS], body, args.markdown)
    for r in (r for r in rows if "error" in r):
        print(f"V={r['vocab']} {r['variant']}: {r['error']}")
    cmd = common.command_line(argv, "benchmarks/bench_vocab_parallel_ce.py")
    print(f"\ncommand: {cmd}")
    common.write_json(args.json, {"command": cmd, "device": dev, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
