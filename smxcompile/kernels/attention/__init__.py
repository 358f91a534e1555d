"""``smx::attention``: scaled dot-product attention with a choice of row normalizer.

For query ``q`` (..., Hq, L, E), key ``k`` (..., Hkv, S, E) and value ``v`` (..., Hkv, S, Ev) the op
computes, per head and query row ``i`` (math in fp32 for half inputs, fp64 for fp64):

    s_ij = (q_i . k_j) * scale
    s_ij = softcap * tanh(s_ij / softcap)                     (if softcap)
    s_ij = s_ij + attn_mask_ij   /   masked where attn_mask_ij is False   (if attn_mask)
    w_i  = normalizer(s_i)          (over the keys of the row; see NORMALIZERS)
    w_i  = w_i * dropout_mask_i / (1 - dropout_p)             (if dropout_p > 0)
    out_i = sum_j w_ij v_j

Masked keys (bool ``False``, float ``-inf``, and ``j > i`` under ``is_causal``) get weight exactly 0
for every normalizer; a row whose keys are all masked gives output 0 and zero gradients, as
``F.scaled_dot_product_attention`` does in torch 2.13.

Methods: FlashAttention — "FlashAttention: Fast and Memory-Efficient Exact Attention with
IO-Awareness" (Dao et al., 2022): tiles of queries against all keys, nothing of size L x S kept,
the backward recomputes the tiles; the streaming normalizers use the online (max, sum) recurrence
of "Online normalizer calculation for softmax" (Milakov & Gimelshein, 2018). Each normalizer's
paper is named in :data:`NORMALIZERS` and in its reference function.

Paths:
- CUDA (and CPU tensors under ``config.force_triton``): the Triton kernels of
  :mod:`.triton_forward` / :mod:`.triton_backward` (imported lazily).
- CPU, and fp64 everywhere: plain torch, in blocks of query rows. One block holds the scores of
  at most ``BLOCK_BYTES`` (one query row of one kv-head group when that alone is larger), so
  memory is O(block x S), never O(L x S) for all heads at once; under ``is_causal`` a block reads
  only the keys its rows can see. The backward recomputes each block and applies the normalizer's
  hand-written vector-Jacobian product (``Normalizer.vjp``). Dropout masks come from a
  ``torch.Generator`` seeded with (seed, block index), so the backward regenerates them; they
  depend on the block layout. On this path the op's ``stats`` output is zeros (the backward does
  not use it), and K and V are converted to the accumulation dtype once (a copy for half inputs).

Modules: :mod:`.api` (the public :func:`attention`), :mod:`.ops` (the custom ops and autograd),
:mod:`.reference` (the normalizers and :func:`attention_reference`), :mod:`.torch_path` (the blocked torch
path), :mod:`.flex` (FlexAttention with a score change replayed from data), :mod:`.triton_common`,
:mod:`.triton_forward`, :mod:`.triton_backward` (the CUDA kernels).
"""

from .api import attention
from .ops import AttentionError, attention_op
from .reference import NORMALIZERS, Normalizer, attention_reference
from .torch_path import BLOCK_BYTES

__all__ = ["attention", "attention_reference", "NORMALIZERS", "Normalizer", "AttentionError", "BLOCK_BYTES",
           "attention_op"]
