"""Cross-entropy without the N x V logits: ``smx::linear_ce_stats`` / ``smx::ce_stats`` and their backward.

Method: "Cut Your Losses in Large-Vocabulary Language Models" (Wijmans et al., 2024) —
cut cross-entropy (CCE). For embeddings ``e`` (N x D) and a classifier ``c`` (V x D)

    loss_i = lse_j(z_ij) - z_{i,y_i},   z_ij = e_i . c_j (+ bias_j)

needs only two numbers per row: the log-sum-exp of the row and the target logit. Both
are reduced block by block with the online (max, sum) recurrence ("Online normalizer
calculation for softmax", Milakov & Gimelshein, 2018), so the N x V matrix never exists.
The backward recomputes the logits block by block; the target entry of the gradient is
computed from the mass of the *other* classes (``-sum_{j != y} p_j``) so that it does not
round to zero when the target dominates ("softmax collapse": Prieto et al., "Grokking at the Edge of
Numerical Stability", 2025).

Design: one differentiable *statistics* op per row,

    lse_i = log sum_j exp(z_ij)            target_logit_i = z_{i,y_i}
    weighted_sum_i = sum_j w_ij z_ij       (w = class weight, times soft-target probs)
    other_mass_i = sum_{j != y_i} p_ij     (auxiliary, not differentiable)

where ``z = softcap * tanh(scale * x / softcap)`` (or ``scale * x``) and ``x`` are the raw
logits (``input @ weight.T + bias`` for the linear op, a tensor for the plain op). Every
cross-entropy variant (class weights, ignore_index, label smoothing, soft targets, z-loss,
per-token weights, every reduction, a returned lse with gradient) is a few torch ops on
these N-vectors (:func:`.loss.compose_loss`), and autograd turns their gradients into the per-row
coefficients of the backward:

    G_ij = a_i p_ij - b_i [j == y_i] - c_i w_ij (+ grad of the returned logits)
    a = grad(lse), b = -grad(target_logit), c = -grad(weighted_sum).

CUDA: Triton kernels (:mod:`.triton_common`, :mod:`.triton_forward`, :mod:`.triton_backward`). CPU
(and soft targets on any device): row chunks with ATen matmuls, each chunk's logits living only
in a buffer of at most ``chunk_bytes``; for a scalar loss that needs gradients, the fused path
(:mod:`.fused`) computes them in the forward.

fp16 / bf16: :func:`linear_cross_entropy` keeps the logits in fp32 on every path (CCE's numerics: the Triton
kernels reduce the fp32 accumulator; the torch path gets fp32 operands, upcast once per call), and rounds only
the final gradients to the input dtype. The ops themselves form the logits in their operands' dtype on the
torch path, as ``F.linear`` does: the graph passes, which must match eager, rely on it.

Modules: :mod:`.api` (the public functions), :mod:`.loss` (the loss from the row statistics, argument
checks), :mod:`.ops` (the custom ops and autograd), :mod:`.chunked` (the torch path by row chunks),
:mod:`.fused` (the CPU training path: gradients in the forward), :mod:`.vocab_parallel` (the classifier
sharded by vocabulary rows across a process group), :mod:`.triton_common`, :mod:`.triton_forward`,
:mod:`.triton_backward` (the CUDA kernels), :mod:`.triton_backward_gemm` (the backward's row chunks with cuBLAS
matmuls, its default mode).
"""

from .api import cross_entropy, linear_ce_core, linear_cross_entropy
from .chunked import DEFAULT_CHUNK_BYTES
from .loss import CrossEntropyOutput
from .vocab_parallel import VocabShard, vocab_parallel_linear_cross_entropy

__all__ = ["linear_cross_entropy", "cross_entropy", "CrossEntropyOutput", "DEFAULT_CHUNK_BYTES", "linear_ce_core",
           "vocab_parallel_linear_cross_entropy", "VocabShard"]
