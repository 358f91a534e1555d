"""Softmax and log-softmax with a fused prologue (scale, soft-cap, additive mask): ``smx::softmax`` and
``smx::log_softmax``.

Modules: :mod:`.api` (the public functions and their argument checks), :mod:`.ops` (the custom ops, their
fake kernels and autograd; the CPU path in ATen), :mod:`.triton_kernels` (the CUDA kernels, imported on
first use).
"""

from .api import log_softmax, softmax
from .ops import prologue

__all__ = ["softmax", "log_softmax", "prologue"]
