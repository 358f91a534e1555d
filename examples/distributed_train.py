"""Data-parallel training of the ``smx demo`` model with ``torch.compile(backend="smx")``: DDP or FSDP2.

The model and data are ``smx demo --quick``'s: a 2-layer GPT-2 (transformers, eager attention, dropout 0) and
windows of Python's own documentation (``pydoc_data.topics``) cut by a BPE tokenizer trained on that text. The
model is wrapped with DDP or FSDP2 (``fully_shard`` on each transformer block, then on the root), compiled with
``backend="smx"``, and trained with AdamW; every rank takes its own slice of each global batch. It prints every
rank's loss at every step, each rank's rewrite report (one line per compiled graph piece) and the mean loss.

On CPU (gloo; ``--smx-cpu rewrite`` by default, so the report shows rewrites on CPU too)::

    torchrun --nproc-per-node 2 examples/distributed_train.py --mode ddp --steps 3
    torchrun --nproc-per-node 2 examples/distributed_train.py --mode fsdp --steps 3

On GPUs (nccl, one process per GPU, each on cuda:LOCAL_RANK)::

    torchrun --nproc-per-node 8 examples/distributed_train.py --mode fsdp

``python examples/distributed_train.py ...`` without torchrun runs a single process (world size 1).
``--help`` lists every option.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from smx_app import demo
from smx_app.argtypes import positive_float, positive_int

DESCRIPTION = """\
Train the `smx demo --quick` model (GPT-2, 2 layers, n_embd 64, eager attention, dropout 0; BPE tokenizer
trained on Python's pydoc topics) data-parallel under torch.distributed, wrapped with DDP or FSDP2
(fully_shard on each transformer block, then on the root) and compiled with torch.compile(backend="smx").
Each step draws one global batch of --batch-size x world-size windows in the same seeded order on every
rank; rank r trains on rows [r*B, (r+1)*B)."""

EPILOG = """\
launch:
  CPU, 2 processes (gloo):
    torchrun --nproc-per-node 2 examples/distributed_train.py --mode ddp --steps 3
    torchrun --nproc-per-node 2 examples/distributed_train.py --mode fsdp --steps 3
    torchrun --nproc-per-node 2 examples/distributed_train.py --mode ddp --layers 4 --n-embd 128 --bucket-cap-mb 1
      (a model above DDP's 1 MiB first bucket: Dynamo splits the graph into pieces, one report each)
  GPUs, one process per GPU (nccl, rank r on cuda:LOCAL_RANK):
    torchrun --nproc-per-node 8 examples/distributed_train.py --mode fsdp
    torchrun --nproc-per-node 8 examples/distributed_train.py --mode ddp --steps 50
  Without torchrun, `python examples/distributed_train.py` runs one process (world size 1).

output (rank 0 prints; every rank's numbers are gathered to it):
  step   1/3  loss rank0 7.6193  rank1 7.6194  mean 7.6194  (14.09 s)
      one line per step: every rank's loss on its own slice, their mean (the global batch's loss, as
      every window has the same number of tokens) and the step's time (step 1 includes compiling)
  rank0 piece 1 (g1): attention 2 rewritten
      the rewrite report: for every rank, one line per compiled graph piece and its graph tag
      (DDP splits the graph where a gradient bucket fills; FSDP2 compiles one graph before the
      blocks, one shared by all transformer blocks and one after them) with the sites rewritten /
      kept, then rank 0's full smxcompile report (kind, action, op, location, detail)
  final: the last step's mean loss over ranks and the mean over all steps

exit code: 0, or 1 when a loss is not finite.

notes:
  --smx-cpu is the backend's `cpu` option. Its library default is `auto` (on CPU rewrite only where smx
  was measured faster than Inductor, i.e. attention from 512 keys, cut cross-entropy from 4096
  classes: at this size nothing); this example defaults to `rewrite` so the report shows the rewrites
  on CPU. On CUDA tensors the option does not apply."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    q = demo.QUICK
    p = argparse.ArgumentParser(prog="torchrun --nproc-per-node N examples/distributed_train.py",
                                description=DESCRIPTION, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=("ddp", "fsdp"), default="ddp",
                   help="DistributedDataParallel, or FSDP2 (fully_shard per block, then the root) (default: ddp)")
    p.add_argument("--steps", type=positive_int, default=q["steps"], help=f"training steps (default: {q['steps']})")
    p.add_argument("--backend-dist", choices=("gloo", "nccl"), default=None,
                   help="torch.distributed backend: nccl runs rank r on cuda:LOCAL_RANK, gloo on CPU "
                        "(default: nccl when CUDA is available, else gloo)")
    p.add_argument("--compile-backend", choices=("smx", "inductor", "eager"), default="smx",
                   help="torch.compile backend; eager = no compile (default: smx)")
    p.add_argument("--smx-cpu", choices=("rewrite", "auto", "keep"), default="rewrite",
                   help="the smx option `cpu` (see notes) (default: rewrite)")
    p.add_argument("--layers", type=positive_int, default=q["layers"],
                   help=f"transformer layers (default: {q['layers']})")
    p.add_argument("--n-embd", type=positive_int, default=q["n_embd"], help=f"hidden size (default: {q['n_embd']})")
    p.add_argument("--seq-len", type=positive_int, default=q["seq_len"],
                   help=f"tokens per window (default: {q['seq_len']})")
    p.add_argument("--batch-size", type=positive_int, default=q["batch_size"],
                   help=f"windows per rank per step (default: {q['batch_size']})")
    p.add_argument("--bucket-cap-mb", type=positive_float, default=25.0,
                   help="DDP gradient bucket size in MB; Dynamo splits the compiled graph where a bucket "
                        "fills (the first one, at the end of the graph, always at 1 MiB). At least 1: Dynamo "
                        "refuses smaller ones. The default model has 0.95 MB of parameters: one piece; "
                        "--layers 4 --n-embd 128 --bucket-cap-mb 1 gives five (default: 25, DDP's)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the batch order (default: 0)")
    p.add_argument("--lr", type=positive_float, default=q["lr"], help=f"AdamW learning rate (default: {q['lr']:g})")
    args = p.parse_args(argv)
    if args.bucket_cap_mb < 1:
        p.error("--bucket-cap-mb must be at least 1 (Dynamo's DDP optimizer asserts that DDP's 1 MiB first bucket "
                "is not larger than the others)")
    return args


def init_distributed(backend: str) -> tuple[int, int, torch.device]:
    """Join the process group torchrun describes (or a one-process group); returns (rank, world_size, device)."""
    if backend == "nccl" and not torch.cuda.is_available():
        raise SystemExit("distributed_train.py: --backend-dist nccl needs CUDA; use --backend-dist gloo on CPU")
    if backend == "nccl":
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if "RANK" in os.environ:  # launched by torchrun: env:// rendezvous
        dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
    else:
        store = os.path.join(tempfile.mkdtemp(prefix="smx-dist-"), "store")
        print("distributed_train.py: not launched by torchrun, running one process (world size 1)", flush=True)
        dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1)
    return dist.get_rank(), dist.get_world_size(), device


def load_windows(args: argparse.Namespace, s, rank: int, device: torch.device):
    """The demo's training windows and the <|endoftext|> id: built on rank 0, broadcast to the others."""
    payload: list = [None]
    if rank == 0:
        docs = demo.load_corpus(s.corpus)
        tok = demo.train_tokenizer(docs, s.vocab_size)
        train, _ = demo.split_windows(demo.make_windows(tok, docs, s.seq_len))
        payload = [(train, tok.token_to_id(demo.EOT), tok.get_vocab_size())]
    dist.broadcast_object_list(payload, src=0, device=device if device.type == "cuda" else None)
    return payload[0]


def wrap(model, mode: str, device: torch.device, bucket_cap_mb: float):
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(model, device_ids=[device.index] if device.type == "cuda" else None, bucket_cap_mb=bucket_cap_mb)
    from torch.distributed.fsdp import fully_shard

    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    return model


def report_lines(reports) -> list[str]:
    """One line per compiled graph piece: ``piece 1 (g1): attention 1 rewritten, linear_cross_entropy 1 rewritten``."""
    lines = []
    for i, r in enumerate(reports):
        graph = f" ({r.sites[0].graph})" if r.sites else ""  # a piece without sites has no tag to show
        parts = [f"{kind} {n} {action}" for kind, acts in sorted(r.summary().items())
                 for action, n in sorted(acts.items())]
        lines.append(f"piece {i}{graph}: {', '.join(parts) if parts else 'no softmax-shaped sites'}")
    return lines


def train(args: argparse.Namespace, rank: int, world: int, device: torch.device, backend: str) -> int:
    """Build, wrap, compile and train; print the losses and the reports (rank 0). Returns the exit code."""
    say = print if rank == 0 else (lambda *a, **k: None)
    s = demo.resolve_settings(demo.build_parser().parse_args(  # smx demo --quick, with this run's overrides
        ["--quick", "--layers", str(args.layers), "--n-embd", str(args.n_embd), "--seq-len", str(args.seq_len),
         "--batch-size", str(args.batch_size), "--seed", str(args.seed), "--lr", str(args.lr),
         "--steps", str(args.steps)]))
    t0 = time.perf_counter()
    windows, eot, tok_vocab = load_windows(args, s, rank, device)
    batches = demo.make_batches(windows, s.steps, s.batch_size * world, s.seed)  # same order on every rank
    model = demo.build_model(s, eot).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    model = wrap(model, args.mode, device, args.bucket_cap_mb)
    if args.compile_backend == "smx":
        step_fn = torch.compile(model, backend="smx", options={"cpu": args.smx_cpu})
    elif args.compile_backend == "inductor":
        step_fn = torch.compile(model)
    else:
        step_fn = model
    opt = torch.optim.AdamW(model.parameters(), lr=s.lr, weight_decay=0.01)
    say(f"{args.mode} on {world} rank(s), {backend} on {device.type}: GPT-2 {s.layers} layers, n_embd {s.n_embd}, "
        f"vocab {s.vocab_size} (BPE {tok_vocab}), {n_params / 1e6:.2f}M parameters; {len(windows)} windows of "
        f"{s.seq_len} tokens, {s.batch_size} per rank per step; compile backend {args.compile_backend}"
        + (f" (cpu={args.smx_cpu!r})" if args.compile_backend == "smx" else "")
        + f" ({time.perf_counter() - t0:.1f} s)", flush=True)

    means: list[float] = []
    for i, batch in enumerate(batches):
        t = time.perf_counter()
        mine = batch[rank * s.batch_size:(rank + 1) * s.batch_size].to(device)
        # use_cache=False: no KV cache in training (with one, FSDP2's per-block graphs recompile per block)
        loss = step_fn(input_ids=mine, labels=mine, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        gathered = [torch.zeros((), device=device) for _ in range(world)]
        dist.all_gather(gathered, loss.detach().float())
        losses = [x.item() for x in gathered]
        # Every window has seq_len - 1 targets (no ignored labels): the mean of the ranks' means is the
        # loss of the whole global batch.
        means.append(sum(losses) / world)
        per_rank = "  ".join(f"rank{r} {x:.4f}" for r, x in enumerate(losses))
        say(f"step {i + 1:3d}/{s.steps}  loss {per_rank}  mean {means[-1]:.4f}  "
            f"({time.perf_counter() - t:.2f} s)", flush=True)
        if not all(math.isfinite(x) for x in losses):  # every rank sees the same values: all stop together
            say(f"distributed_train.py: non-finite loss at step {i + 1}", file=sys.stderr, flush=True)
            return 1

    from smxcompile.backends.smx import compiled_reports
    from smxcompile.report import Report

    every = [None] * world
    dist.all_gather_object(every, report_lines(compiled_reports))
    if args.compile_backend == "smx":
        say(f"smx rewrite report ({args.mode}; one line per compiled graph piece):")
        for r, lines in enumerate(every):
            say(f"  rank{r}: {len(lines)} graph piece(s)")
            for line in lines:
                say(f"    rank{r} {line}")
        combined = Report()
        for r in compiled_reports:
            combined.extend(r)
        say(f"rank0 {combined}")
    else:
        say(f"(no smx report: --compile-backend {args.compile_backend} does not run smxcompile's passes)")
    say(f"final loss (mean over {world} ranks): {means[-1]:.4f}; mean over {len(means)} steps: "
        f"{sum(means) / len(means):.4f}", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    backend = args.backend_dist or ("nccl" if torch.cuda.is_available() else "gloo")
    rank, world, device = init_distributed(backend)
    try:
        return train(args, rank, world, device, backend)
    finally:
        # Drop the DDP/FSDP model (and Dynamo's references to it) while the process group is still registered.
        # Otherwise DDP's C++ reducer can hold the group's last reference and destroy it with the GIL held, while a
        # gloo worker thread still finishing the last collective waits for the GIL: the process hangs at exit.
        torch._dynamo.reset()
        gc.collect()
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
