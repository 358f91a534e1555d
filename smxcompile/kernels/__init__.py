"""smxcompile's ops: registered through ``torch.library`` under the ``smx`` namespace.

Each op has a CUDA path (Triton kernels), a CPU path (the fastest code measured on
CPU) and a fake (meta) kernel and autograd formula so it works under
``torch.compile`` and ``torch.export``.

One package per op, each exporting its public names: :mod:`.softmax` (``smx::softmax``,
``smx::log_softmax``), :mod:`.cross_entropy` (``smx::*ce*``; the vocabulary-parallel form too),
:mod:`.attention` (``smx::attention``, ``smx::attention_backward``), :mod:`.softmax_topk`
(``smx::softmax_topk``, ``smx::softmax_topk_backward``), :mod:`.quant_softmax` (``smx::quant_softmax``),
:mod:`.sampling` (``smx::sample``).
Shared: :mod:`.common` (dtypes, autocast), :mod:`.triton_helpers` (what every Triton launcher uses),
:mod:`.config` (switches), :mod:`.decompositions` (the ops' reference ATen forms, for exporters).
"""

# Importing the packages registers their ops.
from . import attention, cross_entropy, quant_softmax, sampling, softmax, softmax_topk  # noqa: F401

__all__ = ["attention", "cross_entropy", "quant_softmax", "sampling", "softmax", "softmax_topk"]
