"""Cross-entropy without the N x V logits: cut cross-entropy (Wijmans et al., "Cut Your Losses in
Large-Vocabulary Language Models", 2024).

One differentiable statistics op per row (``smx::linear_ce_stats`` of ``input @ weight.T + bias``, ``smx::ce_stats``
of given logits): the log-sum-exp, the target logit, the weighted logit sum and the other classes' mass, reduced
block by block with the online (max, sum) recurrence (Milakov & Gimelshein, 2018). Every loss variant is a few
torch ops on these N-vectors (:func:`.loss.compose_loss`); autograd turns their gradients into the per-row
coefficients of the backward, which recomputes the logits and takes the target entry from the other classes' mass
so that it does not round to zero when the target dominates (Prieto et al., 2025). CUDA: Triton kernels; CPU:
ATen matmuls by row chunks, in fp32 for fp16 / bf16 inputs. See docs/DESIGN.md, "Cross-entropy".

Modules: :mod:`.api` (the public functions), :mod:`.loss` (the loss from the statistics, argument checks),
:mod:`.ops` (the custom ops and autograd), :mod:`.chunked` (the torch path), :mod:`.fused` (the CPU training path),
:mod:`.vocab_parallel` (the classifier sharded by vocabulary rows), :mod:`.triton_common`, :mod:`.triton_forward`,
:mod:`.triton_backward`, :mod:`.triton_backward_gemm` and :mod:`.triton_fused` (CUDA).
"""

from .api import cross_entropy, linear_ce_core, linear_cross_entropy
from .chunked import DEFAULT_CHUNK_BYTES
from .loss import CrossEntropyOutput
from .vocab_parallel import VocabShard, vocab_parallel_linear_cross_entropy

__all__ = ["linear_cross_entropy", "cross_entropy", "CrossEntropyOutput", "DEFAULT_CHUNK_BYTES", "linear_ce_core",
           "vocab_parallel_linear_cross_entropy", "VocabShard"]
