"""``smx::softmax_topk``: the k largest softmax probabilities of each row, without the full probability vector.

With ``z = x * scale``: ``indices = topk(z, k).indices`` (softmax is monotone) and ``values = exp(z[indices] -
lse(z))``, or with ``renormalize`` ``softmax(z[indices])``, as ``topk(softmax(z), k)`` (divided by its sum).
Source: "Online normalizer calculation for softmax" (Milakov & Gimelshein, 2018), fused softmax + top-k.
CUDA: Triton kernels; CPU: two passes in torch ops (:mod:`.decomposed`). Special values, ties and the CPU
selection forms: docs/DESIGN.md, "Softmax + top-k" and "Softmax + top-k op: semantics".
"""

from .api import softmax_topk
from .decomposed import softmax_topk_decomposed, softmax_topk_reference
from .ops import softmax_topk_op

__all__ = ["softmax_topk", "softmax_topk_reference", "softmax_topk_decomposed", "softmax_topk_op"]
