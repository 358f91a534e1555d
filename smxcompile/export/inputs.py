"""The inputs of an export (ONNX and MLIR): one call's flattened tensors and their names, and ``dynamic_shapes``
(torch.export's format keyed by ``forward`` argument names) marked for Dynamo, checked against the ranges it
traced, and re-keyed per flattened tensor for ``torch.export``."""

from __future__ import annotations

import inspect
import math
from typing import Any

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from . import ExportError


def forward_arguments(model: nn.Module, args: tuple, kwargs: dict) -> dict[str, Any]:
    """``model.forward``'s arguments by name for a call, defaults included; TypeError if they do not bind."""
    bound = inspect.signature(model.forward).bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def input_leaves(model: nn.Module, args: tuple, kwargs: dict) -> tuple[list[torch.Tensor], list[str]]:
    """The tensors of ``(args, kwargs)`` in pytree order, each named after its ``forward`` argument, else
    ``input_<i>`` (``<name>_<i>`` the second time a tensor is passed). Raises nothing."""
    leaves = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    try:
        frame = forward_arguments(model, args, kwargs)
    except TypeError:
        frame = {}
    by_id = {id(v): k for k, v in frame.items() if isinstance(v, torch.Tensor)}
    names: list[str] = []
    for i, t in enumerate(leaves):
        name = by_id.get(id(t), f"input_{i}")
        names.append(name if name not in names else f"{name}_{i}")    # the same tensor passed twice
    return leaves, names


def mark_dynamic(model: nn.Module, args: tuple, kwargs: dict, dynamic_shapes: Any,
                 marked: list[tuple[str, torch.Tensor, int, Any]]) -> list[tuple[str, torch.Tensor, int, Any]]:
    """Mark the dims of ``dynamic_shapes`` dynamic for Dynamo, appending ``(name, tensor, dim, spec value)`` of
    each to ``marked`` as it goes (so the caller can unmark them after an error half-way), and return it.

    Raises:
        ExportError: a malformed ``dynamic_shapes``; a name that is not a tensor argument of ``forward``; a dim
            the tensor does not have, or of size 0 or 1 in the example.
        TypeError: ``(args, kwargs)`` do not bind to ``forward``.
    """
    frame = forward_arguments(model, args, kwargs)
    if isinstance(dynamic_shapes, (tuple, list)):
        names = list(frame)[:len(dynamic_shapes)]
        dynamic_shapes = dict(zip(names, dynamic_shapes))
    if not isinstance(dynamic_shapes, dict):
        raise ExportError("dynamic_shapes must be a dict keyed by forward argument names (or a tuple in their "
                          "order), as torch.export takes it")
    for name, spec in dynamic_shapes.items():
        if name not in frame:
            raise ExportError(f"dynamic_shapes names {name!r}, not an argument of {type(model).__name__}.forward "
                              f"({', '.join(frame)})")
        t = frame[name]
        if spec is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise ExportError(f"dynamic_shapes[{name!r}]: the argument is not a tensor")
        dims = (list(spec) if isinstance(spec, dict)
                else [i for i, d in enumerate(spec) if d is not None] if isinstance(spec, (tuple, list)) else None)
        if dims is None:
            raise ExportError(f"dynamic_shapes[{name!r}] must be a dict {{dim: Dim}} or a tuple per dim")
        for d in dims:
            if not isinstance(d, int) or not -t.dim() <= d < t.dim():
                raise ExportError(f"dynamic_shapes[{name!r}]: dim {d!r} does not exist in a {t.dim()}-D input")
            d = d % t.dim()
            if t.shape[d] < 2:
                raise ExportError(f"dynamic_shapes[{name!r}]: dim {d} has size {t.shape[d]} in the example; give "
                                  "an example of size >= 2 there (sizes 0 and 1 are specialized)")
            torch._dynamo.mark_dynamic(t, d)
            marked.append((name, t, d, spec[d] if isinstance(spec, dict) else spec[d]))
    return marked


def range_bound(v) -> int | None:
    """A sympy range bound as an int, None when infinite; TypeError / ValueError for any other value."""
    from torch.utils._sympy.numbers import int_oo

    if v in (int_oo, -int_oo) or str(v) in ("oo", "-oo", "int_oo", "-int_oo"):
        return None
    return int(v)


def check_ranges(marked: list, ranges: dict) -> None:
    """Refuse a dynamic dim whose traced range (``ranges``: ``{(id(tensor), dim): (lo, hi or None)}``) is
    narrower than the declared ``Dim`` range: the graph would be wrong outside it. ``marked``: from
    :func:`mark_dynamic`. Raises ExportError naming the input, the dim and the ``Dim`` to declare."""
    for name, t, d, spec in marked:
        lo, hi = ranges.get((id(t), d), (2, None))
        lo = 2 if lo is None else lo
        umin = getattr(spec, "min", None) if not isinstance(spec, str) else None
        umax = getattr(spec, "max", None) if not isinstance(spec, str) else None
        # sizes 0 and 1 are never traced (Dynamo specializes them): a declared min below 2 means "from 2"
        umin = 2 if umin is None else max(2, int(umin))
        try:
            umax = None if umax is None or not math.isfinite(float(umax)) or float(umax) >= 2 ** 62 else int(umax)
        except (TypeError, ValueError, OverflowError):
            umax = None
        if lo > umin or (hi is not None and (umax is None or umax > hi)):
            rng = f"[{lo}, {hi if hi is not None else 'inf'}]"
            raise ExportError(
                f"input {name!r}, dim {d}: the model's code only holds for sizes in {rng} (a Python branch on the "
                "size, or a limit such as learned position embeddings); the exported graph would be wrong or fail "
                f"outside it. Declare the range: dynamic_shapes={{{name!r}: {{{d}: torch.export.Dim({name + '_' + str(d)!r}, "
                f"min={lo}{'' if hi is None else f', max={hi}'})}}}}, or keep the dim static")


def named_dims(model: nn.Module, args: tuple, kwargs: dict, dynamic_shapes: Any) -> dict[str, Any]:
    """``dynamic_shapes`` keyed by ``forward`` argument name, each dim name a ``Dim`` (one per name); TypeError
    if ``(args, kwargs)`` do not bind."""
    from torch.export import Dim

    frame = forward_arguments(model, args, kwargs)
    if isinstance(dynamic_shapes, (tuple, list)):
        dynamic_shapes = dict(zip(list(frame), dynamic_shapes))
    dims: dict[str, Any] = {}
    conv = lambda v: dims.setdefault(v, Dim(v)) if isinstance(v, str) else v  # noqa: E731
    return {k: (None if v is None else {d: conv(x) for d, x in v.items()} if isinstance(v, dict)
                else tuple(conv(x) for x in v))
            for k, v in dynamic_shapes.items()}


def leaf_shapes(model: nn.Module, args: tuple, kwargs: dict, dynamic_shapes: Any) -> tuple | None:
    """``dynamic_shapes`` per tensor of :func:`input_leaves`, for torch.export (``Dim.AUTO`` for a None dim), or
    None; TypeError if ``(args, kwargs)`` do not bind."""
    if dynamic_shapes is None:
        return None
    from torch.export import Dim

    frame = forward_arguments(model, args, kwargs)
    by_id = {id(frame[k]): v for k, v in named_dims(model, args, kwargs, dynamic_shapes).items()
             if isinstance(frame.get(k), torch.Tensor)}
    leaves, _ = input_leaves(model, args, kwargs)

    def per_leaf(t):
        spec = by_id.get(id(t))
        if spec is None or not isinstance(spec, dict):
            return spec
        return {d: Dim.AUTO if v is None else v for d, v in spec.items()}

    return tuple(per_leaf(t) for t in leaves)


__all__ = ["forward_arguments", "input_leaves", "mark_dynamic", "range_bound", "check_ranges", "named_dims", "leaf_shapes"]
