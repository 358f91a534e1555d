"""Floating-point casts in front of a fused op: which ones it may take in.

A cast is *exact* when its target holds every value of its source (fp16 -> fp32, bf16 -> fp32, anything ->
fp64); a narrowing cast rounds the values (fp32 -> fp16, and fp16 <-> bf16, whose ranges differ). A fused op
reads its input once and computes in fp32 (fp64 for fp64 input), so it may drop an exact cast whose result it
would compute the same: :func:`widening_cast` (softmax, softmax + top-k, cross-entropy, whose outputs keep the
cast's dtype: an up-cast to fp64 asks for fp64 math and stays). Where the op's output is rounded back to the
input's dtype anyway (attention's output has q's dtype), any exact cast goes: :func:`exact_cast`.
"""

from __future__ import annotations

import torch
from torch.fx import Node

from .graph import FLOAT_DTYPES, cast_dtype, tensor_val


def holds(wide: torch.dtype, narrow: torch.dtype) -> bool:
    """Every value of floating dtype ``narrow`` is exactly representable in ``wide``."""
    w, n = torch.finfo(wide), torch.finfo(narrow)
    return w.eps <= n.eps and w.max >= n.max and w.smallest_normal <= n.smallest_normal


def exact_cast(node: Node) -> tuple[Node, torch.dtype, torch.dtype] | None:
    """``(source node, source dtype, target dtype)`` when ``node`` is a floating-point cast that rounds nothing
    (a no-op cast such as ``.float()`` of fp32 counts), else None."""
    dt = cast_dtype(node)
    if dt is None or dt not in FLOAT_DTYPES:
        return None
    src = tensor_val(node.args[0])
    if src is None or src.dtype not in FLOAT_DTYPES or not holds(dt, src.dtype):
        return None
    return node.args[0], src.dtype, dt


def widening_cast(node: Node) -> tuple[Node, torch.dtype, torch.dtype] | None:
    """:func:`exact_cast`, except an up-cast to fp64 (eager then computes in fp64; the op would in fp32)."""
    c = exact_cast(node)
    if c is None or (c[2] == torch.float64 and c[1] != torch.float64):
        return None
    return c


__all__ = ["holds", "exact_cast", "widening_cast"]
