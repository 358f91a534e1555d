"""What every Triton launcher of smxcompile checks before it runs a kernel: is triton importable, and
does the tensor's device match the mode the kernels were decorated in (a GPU, or Triton's CPU
interpreter, chosen by ``TRITON_INTERPRET=1`` at decoration time; see shared/reference/TORCH-FACTS.md)."""

from __future__ import annotations

import os
from typing import Any, Callable

import torch


def interpret_env() -> bool:
    """Whether TRITON_INTERPRET is set now (as triton parses it)."""
    try:
        import triton

        return bool(triton.knobs.runtime.interpret)
    except Exception:  # pragma: no cover - older/newer triton without knobs, or no triton
        return os.environ.get("TRITON_INTERPRET") == "1"


def interpreted(kernel: Any, at_import: bool) -> bool:
    """Whether ``kernel`` was decorated in interpreter mode (``at_import``: TRITON_INTERPRET then)."""
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except Exception:  # pragma: no cover
        return at_import
    return isinstance(kernel, InterpretedFunction)


def check_runtime(t: torch.Tensor, *, what: str, module: str, triton_module: Any, import_error: Any,
                  is_interpreted: Callable[[], bool]) -> None:
    """Raise a RuntimeError that says what to do when the ``what`` kernels (of ``module``) cannot run on ``t``.

    ``is_interpreted`` is called only once triton is known to be there (the kernels exist only then).

    Raises:
        RuntimeError: triton missing; kernels decorated for the interpreter but ``t`` is on CUDA; ``t`` on
            CPU without TRITON_INTERPRET=1, or with it set after the kernels were decorated for a GPU.
    """
    if triton_module is None:
        raise RuntimeError(
            f"smxcompile's Triton {what} kernels need triton, which failed to import "
            f"({import_error!r}); install it with `pip install smxcompile[triton]`"
        )
    if t.is_cuda:
        if is_interpreted():
            raise RuntimeError(
                f"the Triton {what} kernels were loaded in interpreter mode (TRITON_INTERPRET=1) and cannot "
                "run on CUDA tensors; unset TRITON_INTERPRET before importing triton"
            )
        return
    if not interpret_env():
        raise RuntimeError(
            f"the Triton {what} path needs CUDA or TRITON_INTERPRET=1 (Triton's CPU interpreter, set before "
            f"triton is imported); got a tensor on {t.device}"
        )
    if not is_interpreted():
        raise RuntimeError(
            f"TRITON_INTERPRET=1 was set after {module} was imported; the kernels were compiled for a GPU. "
            "Set TRITON_INTERPRET=1 before importing triton"
        )
    if t.device.type != "cpu":
        raise RuntimeError(f"the Triton interpreter runs on CPU tensors, got a tensor on {t.device}")


def next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n <= 1``)."""
    return 1 << max(0, (n - 1).bit_length())


_SM_COUNT: dict = {}


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA ``device`` (cached)."""
    key = device.index if device.index is not None else torch.cuda.current_device()
    if key not in _SM_COUNT:
        _SM_COUNT[key] = torch.cuda.get_device_properties(key).multi_processor_count
    return _SM_COUNT[key]
