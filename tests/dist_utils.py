"""Run a function in N spawned processes joined in one gloo process group (the distributed tests).

``run_distributed(fn, world_size, *args)`` spawns ``world_size`` processes; each one joins a gloo
group through a file store (no ports: safe under pytest-xdist), runs ``fn(rank, world_size, *args)``
with one intra-op thread, and the parent returns the per-rank results (anything ``torch.save`` can
write). A child's exception is raised in the parent with the child's traceback; a hang is killed after
``timeout`` seconds. ``fn`` must be a module-level function (spawn pickles it by name).
"""

from __future__ import annotations

import os
import tempfile
import time

import torch
import torch.multiprocessing as mp


def _child(rank: int, world_size: int, folder: str, fn, args) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=world_size)
    try:
        out = fn(rank, world_size, *args)
        torch.save(out, os.path.join(folder, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        # free whatever still holds the group (DDP's reducer, compiled graphs) before destroying it: a
        # reducer that destroys the gloo group later, holding the GIL, can deadlock with a gloo thread
        import gc

        del fn, args
        torch._dynamo.reset()
        gc.collect()
        dist.destroy_process_group()


def run_distributed(fn, world_size: int = 2, *args, timeout: float = 300.0) -> list:
    """``[fn(0, world_size, *args), ..., fn(world_size - 1, world_size, *args)]``, each run in its own process."""
    with tempfile.TemporaryDirectory(prefix="smx-dist-") as folder:
        ctx = mp.start_processes(_child, args=(world_size, folder, fn, args), nprocs=world_size, join=False,
                                 start_method="spawn")
        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"distributed test {fn.__name__} did not finish in {timeout:.0f} s")
        return [torch.load(os.path.join(folder, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]
