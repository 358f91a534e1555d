"""smxcompile under ``torch.distributed``: vocabulary-parallel cut cross-entropy and a collective counter.

- :func:`vocab_parallel_linear_cross_entropy` (also reached as ``smxcompile.linear_cross_entropy(...,
  process_group=group)`` or with a DTensor ``weight`` sharded on dim 0): cut cross-entropy with the
  classifier sharded by vocabulary rows; see :mod:`smxcompile.kernels.cross_entropy.vocab_parallel`.
- :class:`CollectiveCounter`: records every c10d collective a block of code issues on this rank, with
  its bytes, to measure communication volume (``benchmarks/bench_vocab_parallel_ce.py``). torch's own
  ``CommDebugMode`` counts collectives but not their bytes.

The ``smx`` backend itself needs nothing from here: ``torch.compile(DDP(model), backend="smx")`` and
``torch.compile`` of an FSDP2 (``fully_shard``) model work as with Inductor (README, "Distributed
training").
"""

from __future__ import annotations

import dataclasses

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .kernels.cross_entropy import VocabShard, vocab_parallel_linear_cross_entropy

__all__ = ["vocab_parallel_linear_cross_entropy", "VocabShard", "CollectiveCounter", "Collective"]

# c10d ops whose first argument is the result and second the rank's contribution; the others
# (allreduce_, broadcast_, ...) work in place on their first argument.
_OUT_IN = {"allgather_", "_allgather_base_", "allgather_into_tensor_coalesced_", "reduce_scatter_",
           "_reduce_scatter_base_", "reduce_scatter_tensor_coalesced_", "alltoall_", "alltoall_base_", "gather_",
           "scatter_"}


try:
    from torch.distributed.tensor import DTensor as _DTensor
except ImportError:  # a torch build without torch.distributed
    _DTensor = None


# functional ops that move no data: waiting on a result, and wrapping a result for autograd
_NOT_COLLECTIVES = {"wait_tensor", "_wrap_tensor_autograd"}


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(y) for y in x)
    return 0


@dataclasses.dataclass
class Collective:
    """One collective on this rank: the c10d op's name, the bytes this rank sent into it (``sent``) and the
    bytes of its result on this rank (``received``; for an all_reduce both are the tensor's size)."""

    op: str
    sent: int
    received: int


class CollectiveCounter(TorchDispatchMode):
    """Context manager recording the collectives issued on this rank: c10d's (``torch.distributed.all_reduce``,
    ``all_gather``, ...) and the functional ones (``_c10d_functional``: DTensor's redistributions).

    Attributes:
        collectives: list of :class:`Collective`, in issue order.

    Example::

        with CollectiveCounter() as comm:
            loss = smxcompile.linear_cross_entropy(h, w_shard, y, process_group=group)
        comm.total("received")   # bytes
    """

    def __init__(self):
        super().__init__()
        self.collectives: list[Collective] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _DTensor is not None and any(issubclass(t, _DTensor) for t in types):
            # a DTensor: let it run first and desugar into the collectives it issues, which then come
            # back through this mode (as torch's CommDebugMode does)
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        if func.namespace == "c10d" and args:
            if name in _OUT_IN and len(args) > 1:
                self.collectives.append(Collective(name, _nbytes(args[1]), _nbytes(args[0])))
            elif name in ("send", "recv_", "recv_any_source_"):  # point to point: one direction only
                n = _nbytes(args[0])
                self.collectives.append(Collective(name, n if name == "send" else 0, 0 if name == "send" else n))
            elif name != "barrier" and not name.startswith("monitored_barrier"):
                n = _nbytes(args[0])
                self.collectives.append(Collective(name, n, n))
        elif func.namespace == "_c10d_functional" and args and name not in _NOT_COLLECTIVES:
            # functional collectives (DTensor, torch.compile): the result is a new tensor
            self.collectives.append(Collective(name, _nbytes(args[0]), _nbytes(out)))
        return out

    def total(self, field: str = "received") -> int:
        """Sum of ``sent`` or ``received`` bytes over the recorded collectives."""
        return sum(getattr(c, field) for c in self.collectives)

    def reset(self) -> None:
        self.collectives.clear()
