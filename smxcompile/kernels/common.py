"""What several ops share outside Triton: float dtypes, the accumulation dtype, and autocast handling."""

from __future__ import annotations

import functools

import torch

#: The floating-point dtypes the ops accept.
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
#: The 16-bit ones (upcast for the math; their products accumulate in fp32).
HALF_DTYPES = (torch.float16, torch.bfloat16)


def acc_dtype(t: torch.Tensor) -> torch.dtype:
    """The ops' math dtype for ``t``: fp64 for fp64 tensors, else fp32 (half inputs are upcast)."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def autocast_on(device: torch.device) -> bool:
    """Whether autocast is enabled for ``device``'s type (CUDA, CPU, XPU)."""
    return device.type in ("cuda", "cpu", "xpu") and torch.is_autocast_enabled(device.type)


def autocast_off(fn):
    """Decorator: run ``fn`` (a torch-path kernel) with autocast disabled.

    A custom op's implementation runs with the caller's autocast state, so without this its
    fp32 matmuls (and a backward called inside an autocast region) would be cast to the
    autocast dtype. The op's inputs were already cast by the public functions."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        dev = next(a.device for a in args if isinstance(a, torch.Tensor))
        if autocast_on(dev):
            with torch.autocast(dev.type, enabled=False):
                return fn(*args, **kwargs)
        return fn(*args, **kwargs)

    return run


def autocast_operands(*ts):
    """Cast ``ts`` as autocast casts ``F.linear``'s operands: the floating tensors to the autocast dtype
    when autocast is on for their device (the first tensor's; None entries pass through).

    As autocast does, fp64 tensors are left alone (they are not "eligible"). Returns the tuple."""
    dev = next((t.device for t in ts if t is not None), torch.device("cpu"))
    if autocast_on(dev):
        dt = torch.get_autocast_dtype(dev.type)
        return tuple(t.to(dt) if (t is not None and t.is_floating_point() and t.dtype != torch.float64) else t
                     for t in ts)
    return ts
