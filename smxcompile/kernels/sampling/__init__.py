"""``smx::sample``: the sampling step of ``generate(do_sample=True)`` (temperature, top-k, top-p, min-p, softmax,
multinomial) as one op that never writes the vocabulary-wide probabilities.

Modules: :mod:`.api` (the public :func:`sample`), :mod:`.ops` (the custom op), :mod:`.candidates` (the torch
path: the filters on each row's largest logits), :mod:`.triton_kernels` (the CUDA kernel)."""

from .api import check_sampling, sample
from .ops import sample_op

__all__ = ["sample", "sample_op", "check_sampling"]
