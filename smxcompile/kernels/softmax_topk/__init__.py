"""``smx::softmax_topk``: the k largest softmax probabilities of each row, without the full probability vector.

For scores ``x`` and ``z = x * scale`` (``scale = 1 / temperature``) the op returns, along ``dim``::

    indices = topk(z, k).indices                       # == topk(softmax(z), k).indices
    values  = exp(z[indices] - lse(z))                 # == topk(softmax(z), k).values     (renormalize=False)
    values  = softmax(z[indices])                      # == topk(softmax(z)).values / sum  (renormalize=True)

using two identities: softmax is monotone, so the top-k of the
probabilities are the top-k of the logits, and ``topk(softmax(x)).values == exp(topk(x).values - lse(x))``;
renormalizing them is the softmax of the k selected logits (``softmax(topk(x).values)``, the form
Mixtral-style MoE routers use), which needs no pass over the rest of the row at all.

Source: "Online normalizer calculation for softmax" (Milakov & Gimelshein, 2018), fused softmax + top-k:
one pass keeps the online ``(max, sum)`` pair and a running top-k; only k probabilities are written.

* CUDA: Triton kernels (:mod:`smxcompile.kernels.softmax_topk.triton_kernels`).
* CPU (and what the ``smx`` backend compiles on CPU, where Inductor generates the loops): two passes over
  the row and no write of its size. Pass 1 takes the maximum of each chunk of ``CHUNK`` columns; the k
  chunks with the largest maxima hold a top-k of the row (a chunk outside them has at least k larger
  elements elsewhere), so the top-k is taken over ``k * CHUNK`` candidates only. Pass 2 sums
  ``exp(z - max)``. Short rows (routers: 32-1024 experts) select with k rounds of a max over unique int64
  keys (value bits, then column), which is exact and avoids ATen's per-row top-k; rows of at most 16
  (8-16 experts) with k bubble passes of compare-exchanges between whole columns, elementwise over the
  rows; ``k == 1`` is a max.

Special values follow ``topk(softmax(x))`` in torch: a row with NaN or ``+inf``, or with every entry
``-inf``, has an all-NaN softmax, so its values are NaN (its indices stay valid, distinct columns);
``-inf`` entries have probability 0 and are picked last.

Ties: where logits are exactly equal, any of them may be picked (torch.topk does not specify the order
either; the Triton kernels and the short-row path pick the lowest column first). Where two different
logits round to the same probability in the output dtype, the larger logit is picked (the exact answer);
torch's ``topk(softmax(x))`` may pick either.

Modules: :mod:`.api` (the public :func:`softmax_topk`), :mod:`.ops` (the custom ops and autograd),
:mod:`.decomposed` (the math in torch: the CPU path and the reference), :mod:`.triton_kernels` and
:mod:`.triton_select` (the CUDA kernels).
"""

from .api import softmax_topk
from .decomposed import softmax_topk_decomposed, softmax_topk_reference
from .ops import softmax_topk_op

__all__ = ["softmax_topk", "softmax_topk_reference", "softmax_topk_decomposed", "softmax_topk_op"]
