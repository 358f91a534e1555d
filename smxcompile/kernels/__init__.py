"""smxcompile's ops: registered through ``torch.library`` under the ``smx`` namespace.

Each op has a CUDA path (Triton kernels), a CPU path (the fastest code measured on
CPU) and a fake (meta) kernel and autograd formula so it works under
``torch.compile`` and ``torch.export``.
"""

from .softmax import log_softmax, softmax  # noqa: F401  (registers smx::softmax, smx::log_softmax)
from .cross_entropy import CrossEntropyOutput, cross_entropy, linear_cross_entropy  # noqa: F401,E402  (smx::*ce* ops)
from .attention import NORMALIZERS, attention  # noqa: F401,E402  (smx::attention, smx::attention_backward)
from .softmax_topk import softmax_topk  # noqa: F401,E402  (smx::softmax_topk, smx::softmax_topk_backward)
from .quant_softmax import quant_softmax  # noqa: F401,E402  (smx::quant_softmax)
