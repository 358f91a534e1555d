"""Attention with a pointwise change of each score, replayed from data: PyTorch's FlexAttention
(``torch.nn.attention.flex_attention``; Dong et al., 2024) with a ``score_mod`` built from a recipe, the form in
which a compiled graph can hold the change."""

from __future__ import annotations

import importlib

import torch


def score_mod_attention(q, k, v, sides, *, recipe: tuple, scale: float, enable_gqa: bool = False,
                        safe_softmax: bool = False) -> torch.Tensor:
    """``softmax(f(q @ k^T * scale)) @ v`` for q (..., L, E), k, v (..., S, E) with up to 2 leading dims (K and V
    with fewer heads under ``enable_gqa``); ``f`` applies ``recipe`` to each score: per step ``(op, target, args,
    kwargs)`` (``op`` ``"call_method"`` or ``"call_function"``, a function by its import path), an argument
    ``("@path", i)`` standing for the i-th step's value (-1: the score), ``("@side", i)`` for ``sides[i]`` (each
    broadcasting to (..., L, S)) at the score's entry. A row whose every changed score is -inf gives eager's NaN
    (0 with ``safe_softmax``, as ``aten._safe_softmax``), where FlexAttention gives 0."""
    from torch.nn.attention.flex_attention import flex_attention

    # one (B, H) grid for all three (FlexAttention does not broadcast); GQA's K and V keep their kv heads
    lead = tuple(q.shape[:-2]) if enable_gqa else torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    shape = (*lead, q.shape[-2], k.shape[-2])
    q = q.expand(*lead, *q.shape[-2:])
    if not enable_gqa:
        k, v = k.expand(*lead, *k.shape[-2:]), v.expand(*lead, *v.shape[-2:])
    pad = (1,) * (4 - len(shape))
    q, k, v = (t.reshape(*pad, *t.shape) for t in (q, k, v))
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    ev = v.shape[-1]
    if q.device.type == "cpu":
        # Inductor's CPU template (torch 2.13) needs q and k in 4-D buffers of their own, and gives wrong rows for
        # head dims of 16 and below (docs/DESIGN.md, "Attention"): zero columns up to 32 change no score
        width = max(32 - q.shape[-1], 0)
        q, k = (torch.nn.functional.pad(t, (0, width)) if width else t.clone(memory_format=torch.contiguous_format)
                for t in (q, k))
        # in row-major order (a key laid out head dim first came out wrong through the template)
        q, k = (torch.ops.prims.inductor_force_stride_order(t, _row_major(t.shape)) for t in (q, k))
        v = torch.nn.functional.pad(v, (0, max(32 - ev, 0)))
    # each side 4-D, read at index 0 along its broadcast dims, realized: Inductor's CPU template (torch 2.13)
    # builds the score_mod before it realizes computed sides
    sides = [sd.reshape((1,) * (4 - sd.dim()) + tuple(sd.shape)) for sd in sides]
    sides = [torch.ops.prims.inductor_force_stride_order(sd, sd.stride()) for sd in sides]
    spans = [tuple(n > 1 for n in sd.shape) for sd in sides]
    steps = [(op, target if op == "call_method" else _resolve(target), args, kwargs)
             for op, target, args, kwargs in recipe]

    def score_mod(score, b, h, i, j):
        values: list = []

        def take(a):
            if a[0] == "@side":
                return sides[a[1]][tuple(x if wide else 0 for x, wide in zip((b, h, i, j), spans[a[1]]))]
            return score if a[1] == -1 else values[a[1]]

        for op, fn, args, kwargs in steps:
            args, kwargs = _replay(args, take), _replay(kwargs, take)
            values.append(getattr(args[0], fn)(*args[1:], **kwargs) if op == "call_method" else fn(*args, **kwargs))
        return values[-1]

    # V gets a column of ones: its output is each row's sum of weights (1, or 0 on a row of -inf)
    ones = torch.ones((*v.shape[:-1], 1), dtype=v.dtype, device=v.device)
    out = flex_attention(q, k, torch.cat([v, ones], -1), score_mod=score_mod, scale=scale, enable_gqa=enable_gqa)
    out = out[..., :ev].masked_fill(out[..., -1:] < 0.5, 0.0 if safe_softmax else float("nan"))
    return out.reshape(*shape[:-1], out.shape[-1])


def _row_major(shape) -> tuple:
    strides, n = [], 1
    for d in reversed(shape):
        strides.append(n)
        n *= max(int(d), 1)
    return tuple(reversed(strides))


def _replay(a, take):
    if isinstance(a, tuple) and len(a) == 2 and a[0] in ("@path", "@side"):
        return take(a)
    if isinstance(a, (tuple, list)):
        return type(a)(_replay(x, take) for x in a)
    if isinstance(a, dict):
        return {key: _replay(x, take) for key, x in a.items()}
    return a


def _resolve(path: str):
    module, name = path.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)


__all__ = ["score_mod_attention"]
