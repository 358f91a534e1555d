"""Workers of tests/backends/test_distributed_backend.py: the smx backend under DDP and FSDP2 (``fully_shard``).

Each ``*_worker(rank, world_size, spec)`` runs in a process spawned by :func:`tests.dist_utils.run_distributed`
(already in a gloo group, one intra-op thread) and returns plain tensors, floats and dicts. :func:`single_process`
is the reference: the same model, the same steps, the whole global batch, no process group.

The model is a transformers GPT-2 with eager attention and dropout 0; the data are random ids with every label
present (no -100), so each rank's mean loss is over the same number of tokens and the mean of the ranks' means is
the global batch's mean loss -- DDP and FSDP2 average gradients over ranks, which then equals the gradient of the
single-process loss on the whole batch.
"""

from __future__ import annotations

import gc
import time
from typing import Any

import torch

#: The test model: 2 layers of n_embd 128 make ~1.6 MB of fp32 parameters, so DDP with ``bucket_cap_mb=1`` (the
#: smallest Dynamo accepts: its DDPOptimizer asserts that the first bucket, 1 MiB, is not larger than the others)
#: has at least two buckets and Dynamo splits the forward graph into more than one piece. SGD, not AdamW: Adam's
#: first steps move every weight by about lr whatever its gradient's size, so a gradient that is rounding noise
#: would move its weight by up to lr in a direction set by that noise; SGD moves it by lr * gradient, so rounding
#: differences stay rounding-sized. lr 0.5 makes every parameter tensor move >= 150x the test's bound in 3 steps.
SPEC: dict[str, Any] = dict(
    vocab_size=128, n_positions=32, n_embd=128, n_layer=2, n_head=4,
    steps=3, global_batch=4, seq_len=16, lr=0.5, seed=0, bucket_cap_mb=1,
    backend="smx", options={"cpu": "rewrite"},
)


def build_model(spec: dict[str, Any]):
    """The seeded GPT-2 of ``spec`` (eager attention, dropout 0, no KV cache), in train mode."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=spec["vocab_size"], n_positions=spec["n_positions"], n_embd=spec["n_embd"],
                     n_layer=spec["n_layer"], n_head=spec["n_head"], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     bos_token_id=0, eos_token_id=0, use_cache=False)
    cfg._attn_implementation = "eager"
    torch.manual_seed(spec["seed"])
    model = GPT2LMHeadModel(cfg)
    model.config._attn_implementation = "eager"
    model.loss_type = "ForCausalLM"  # no warning_once inside forward (a graph break)
    return model.train()


def global_batches(spec: dict[str, Any]) -> list[torch.Tensor]:
    """``steps`` global batches of ``[global_batch, seq_len]`` random ids (seeded: the same on every rank)."""
    g = torch.Generator().manual_seed(spec["seed"] + 1)
    return [torch.randint(0, spec["vocab_size"], (spec["global_batch"], spec["seq_len"]), generator=g)
            for _ in range(spec["steps"])]


def _compile(model, spec: dict[str, Any]):
    if spec["backend"] == "eager":
        return model
    return torch.compile(model, backend=spec["backend"], options=spec.get("options"))


def _reports() -> list[dict[str, Any]]:
    from smxcompile.backends.smx import compiled_reports

    return [r.to_dict() for r in compiled_reports]


def _dynamo_counters() -> dict[str, dict[str, int]]:
    from torch._dynamo.utils import counters

    return {k: dict(v) for k, v in counters.items() if k in ("stats", "graph_break")}


def single_process(spec: dict[str, Any]) -> dict[str, Any]:
    """The reference: ``spec['steps']`` SGD steps of the whole model on the whole global batches, one process."""
    torch._dynamo.reset()
    model = build_model(spec)
    step = _compile(model, spec)
    opt = torch.optim.SGD(model.parameters(), lr=spec["lr"])
    losses = []
    for batch in global_batches(spec):
        loss = step(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _local(batch: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    per = batch.shape[0] // world_size
    return batch[rank * per:(rank + 1) * per]


def _train_distributed(model, params_of, rank: int, world_size: int, spec: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    step = _compile(model, spec)
    opt = torch.optim.SGD(model.parameters(), lr=spec["lr"])
    local_losses, global_losses, step_s = [], [], []
    for batch in global_batches(spec):
        t0 = time.perf_counter()
        mine = _local(batch, rank, world_size)
        loss = step(input_ids=mine, labels=mine).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        value = loss.detach().clone()
        local_losses.append(value.item())
        dist.all_reduce(value)  # equal token counts per rank: the mean of rank means is the global mean
        global_losses.append(value.item() / world_size)
        step_s.append(time.perf_counter() - t0)
    out = {"rank": rank, "local_losses": local_losses, "losses": global_losses, "params": params_of(model),
           "reports": _reports(), "counters": _dynamo_counters(), "step_s": step_s}
    # Free the wrapped model (and Dynamo's references to it) while the process group is alive: DDP's C++ reducer
    # holding the group's last reference can otherwise destroy it later with the GIL held, while a gloo thread
    # finishing a collective waits for the GIL (a hang at exit; see examples/distributed_train.py).
    del step, opt, model
    torch._dynamo.reset()
    gc.collect()
    return out


def ddp_worker(rank: int, world_size: int, spec: dict[str, Any]) -> dict[str, Any]:
    """DDP(model, bucket_cap_mb=spec['bucket_cap_mb']) compiled with ``spec['backend']``, SGD on this rank's half."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch._dynamo.reset()
    model = build_model(spec)
    ddp = DDP(model, bucket_cap_mb=spec["bucket_cap_mb"])
    return _train_distributed(ddp, lambda m: {n: p.detach().clone() for n, p in m.module.named_parameters()},
                              rank, world_size, spec)


def fsdp_worker(rank: int, world_size: int, spec: dict[str, Any]) -> dict[str, Any]:
    """FSDP2: ``fully_shard`` on each transformer block, then on the root; compiled with ``spec['backend']``."""
    from torch.distributed.fsdp import fully_shard

    torch._dynamo.reset()
    model = build_model(spec)
    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)

    def full_params(m):
        return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                for n, p in m.named_parameters()}

    return _train_distributed(model, full_params, rank, world_size, spec)
