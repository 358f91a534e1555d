"""A softmax / log-softmax call, any spelling: ``F.softmax``, ``torch.softmax``, ``torch.special.softmax``,
``Tensor.softmax`` (``nn.Softmax`` is inlined to one of them by Dynamo), with ``dim=`` and ``dtype=``.

The softmax, softmax + top-k and quantized-softmax passes read a call the same way: its input, its single dim,
its output dtype, and whether ``dtype=`` makes torch round the input first (``pre_cast``).
"""

from __future__ import annotations

import dataclasses

import torch
from torch.fx import Node

from .casts import holds
from .graph import FLOAT_DTYPES, canon, depends_on_random, dtype_name, is_safe_softmax, norm_dim, tensor_val


@dataclasses.dataclass
class SoftmaxCall:
    """One softmax / log-softmax call.

    Attributes:
        kind: ``softmax`` or ``log_softmax``.
        node: the call.
        x: its input.
        dim: the normalized dim (``0 <= dim < x.ndim``); meaningless when ``problem`` is set.
        out_dtype: ``dtype=`` (None: the input's dtype).
        pre_cast: the dtype torch casts the input to first, when that rounds it (fp32 -> fp16, fp16 <-> bf16)
            or asks for fp64 math; a fused op must do the same cast.
        spelling: how the user wrote it (``F.softmax``, ``Tensor.softmax``...).
        absorbed: what the call adds to a site's detail (``dtype=float32``).
        problem: why the call cannot be fused (empty when it can).
    """

    kind: str
    node: Node
    x: Node
    dim: int = -1
    out_dtype: torch.dtype | None = None
    pre_cast: torch.dtype | None = None
    spelling: str = ""
    absorbed: list[str] = dataclasses.field(default_factory=list)
    problem: str = ""


def spelling(node: Node) -> str:
    """``F.softmax``, ``torch.special.softmax``, ``Tensor.softmax``...: how ``node``'s call was written."""
    if node.op == "call_method":
        return f"Tensor.{node.target}"
    mod = getattr(node.target, "__module__", "") or ""
    name = getattr(node.target, "__name__", str(node.target))
    if "functional" in mod:
        return f"F.{name}"
    if name.startswith("special_"):
        return f"torch.special.{name[len('special_'):]}"
    return f"torch.{name}"


def softmax_call(node: Node) -> SoftmaxCall | None:
    """``node`` as a :class:`SoftmaxCall`, or None when it is not a softmax / log-softmax call with a known input."""
    c = canon(node)
    if c is None or c[0] not in ("softmax", "log_softmax"):
        return None
    name, a = c
    x = a.get("input")
    xv = tensor_val(x)
    if xv is None:
        return None
    call = SoftmaxCall(kind=name, node=node, x=x, spelling=spelling(node))
    if is_safe_softmax(node):
        call.problem = "aten._safe_softmax gives 0 on a row of -inf, where the fused op gives NaN as softmax does"
        return call
    dim = norm_dim(a.get("dim"), xv.dim())
    if dim is None:
        call.problem = f"dim={a.get('dim')!r} is not a single int dim (implicit-dim softmax is deprecated)"
        return call
    call.dim = dim
    dtype = a.get("dtype")
    if dtype is not None:
        if not isinstance(dtype, torch.dtype) or dtype not in FLOAT_DTYPES:
            call.problem = f"dtype={dtype!r} unsupported"
            return call
        if dtype != xv.dtype and (dtype == torch.float64 or not xv.dtype.is_floating_point
                                  or not holds(dtype, xv.dtype)):
            # torch casts the input to dtype first: keep that rounding (fp32 -> fp16, fp16 -> bf16,
            # bf16 -> fp16 overflow), and the fp64 math the user asked for (the op computes in fp32
            # unless its input is fp64)
            call.pre_cast = dtype
        call.out_dtype = dtype
        call.absorbed.append(f"dtype={dtype_name(dtype)}")
    return call


def input_problem(x: Node) -> str:
    """Why a softmax of ``x`` cannot be fused whatever its spelling (empty: it can): a non-floating input, or
    one built from random noise (Gumbel-softmax samples, not a deterministic softmax)."""
    xv = tensor_val(x)
    if xv.dtype not in FLOAT_DTYPES:
        return f"input dtype {xv.dtype} is not floating point"
    if depends_on_random(x):
        return "input is built from random noise (Gumbel-softmax): not a deterministic softmax"
    return ""


__all__ = ["SoftmaxCall", "softmax_call", "spelling", "input_problem"]
