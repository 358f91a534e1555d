"""smxcompile's ops, registered through ``torch.library`` under the ``smx`` namespace, one package per op.

Each op has a CUDA path (Triton kernels), a CPU path (the fastest code measured on CPU), a fake kernel and an
autograd formula, so it works under ``torch.compile`` and ``torch.export``. Shared: :mod:`.common`,
:mod:`.triton_helpers`, :mod:`.config`, :mod:`.decompositions` (docs/DESIGN.md, "Kernels").
"""

from . import attention, cross_entropy, quant_softmax, sampling, softmax, softmax_topk  # noqa: F401 (registers)

__all__ = ["attention", "cross_entropy", "quant_softmax", "sampling", "softmax", "softmax_topk"]
