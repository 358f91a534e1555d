"""Attention sinks read by meaning: the scores extended along the key index by one column of logits that do not
depend on q or k (a learned logit per head: gpt-oss, x-transformers' ``attn_sink``; Xiao et al., 2024,
"Efficient Streaming Language Models with Attention Sinks"), normalized with them, and that column's weights
dropped after the softmax. It is attention over one more key whose value is zero."""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch.fx import Node

from .graph import norm_dim, same_size, tensor_val


def key_concat(n: Any) -> tuple[Node, Node] | None:
    """``torch.cat([a, b], dim=-1)`` of two tensors of the same rank whose last dim is 1 for one of them:
    ``(a, b)``, else None."""
    if not (isinstance(n, Node) and n.op == "call_function" and n.target is torch.cat):
        return None
    bound = dict(zip(("tensors", "dim"), n.args))
    bound.update(n.kwargs)
    ts, out = bound.get("tensors"), tensor_val(n)
    if set(bound) - {"tensors", "dim"} or not isinstance(ts, (list, tuple)) or len(ts) != 2 or out is None:
        return None
    vals = [tensor_val(t) if isinstance(t, Node) else None for t in ts]
    if any(v is None or v.dim() != out.dim() for v in vals) or \
            norm_dim(bound.get("dim", 0), out.dim()) != out.dim() - 1:
        return None
    return tuple(ts) if any(same_size(v.shape[-1], 1) for v in vals) else None


def sink_column(n: Any, scores: Node) -> tuple[Node, bool] | None:
    """``n`` appends one column ``c`` to ``scores`` along the key index (``cat([s, c], -1)`` or ``cat([c, s],
    -1)``): ``(c, True if c comes first)``, else None."""
    pair = key_concat(n)
    if pair is None or scores not in pair or pair[0] is pair[1]:
        return None
    first = pair[1] is scores
    c = pair[0] if first else pair[1]
    return (c, first) if same_size(tensor_val(c).shape[-1], 1) else None


def dropped_column(n: Any) -> tuple[Node, int, int] | None:
    """``x[..., a:b]`` (every other dim whole, step 1) on the last dim: ``(x, a, b)`` with ``b`` negative or None
    as written, else None."""
    if not (isinstance(n, Node) and n.op == "call_function" and n.target is operator.getitem):
        return None
    x, idx = n.args
    xv = tensor_val(x)
    idx = idx if isinstance(idx, tuple) else (idx,)
    if xv is None or not idx or not isinstance(idx[-1], slice) or idx[-1].step not in (None, 1):
        return None
    lead = idx[:-1]
    whole = slice(None, None, None)
    if not (lead == (Ellipsis,) or len(lead) == xv.dim() - 1 and all(s == whole for s in lead)):
        return None
    a, b = idx[-1].start, idx[-1].stop
    if not all(v is None or isinstance(v, int) for v in (a, b)):
        return None
    return x, a or 0, b


def drops_sink(start: int, stop: int | None, cols: int | None, first: bool) -> bool:
    """The slice ``[start:stop]`` of ``cols`` columns (None: symbolic) keeps every column but the sink (first or
    last)."""
    if cols is None:    # the forms that need no width
        return (start, stop) == ((1, None) if first else (0, -1))
    stop = cols if stop is None else stop + cols if stop < 0 else min(stop, cols)
    return (start, stop) == ((1, cols) if first else (0, cols - 1))


__all__ = ["key_concat", "sink_column", "dropped_column", "drops_sink"]
