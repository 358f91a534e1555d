"""Floating-point casts in front of a fused op: which ones it may take in.

A fused op reads its input once and computes in fp32 (fp64 for fp64 input). A cast in front of it can be
dropped only when it is exact and changes nothing the op computes: an up-cast whose target holds every value
of its source (fp16 -> fp32, bf16 -> fp32). A narrowing cast rounds the values (fp32 -> fp16, and fp16 <->
bf16, whose ranges differ) and an up-cast to fp64 asks for fp64 math: both stay in the graph.
"""

from __future__ import annotations

import torch
from torch.fx import Node

from .graph import FLOAT_DTYPES, cast_dtype, tensor_val


def holds(wide: torch.dtype, narrow: torch.dtype) -> bool:
    """Every value of floating dtype ``narrow`` is exactly representable in ``wide``."""
    w, n = torch.finfo(wide), torch.finfo(narrow)
    return w.eps <= n.eps and w.max >= n.max and w.smallest_normal <= n.smallest_normal


def widening_cast(node: Node) -> tuple[Node, torch.dtype, torch.dtype] | None:
    """``(source node, source dtype, target dtype)`` when ``node`` is an exact floating-point up-cast a fused
    op may absorb (see the module docstring; a no-op cast such as ``.float()`` of fp32 counts), else None."""
    dt = cast_dtype(node)
    if dt is None or dt not in FLOAT_DTYPES:
        return None
    src = tensor_val(node.args[0])
    if src is None or src.dtype not in FLOAT_DTYPES or not holds(dt, src.dtype):
        return None
    if dt == torch.float64 and src.dtype != torch.float64:
        return None   # eager computes in fp64; the op would compute in fp32
    return node.args[0], src.dtype, dt


__all__ = ["holds", "widening_cast"]
