"""``smx::attention``: scaled dot-product attention with a choice of row normalizer (:data:`NORMALIZERS`).

q (..., Hq, L, E), k (..., Hkv, S, E), v (..., Hkv, S, Ev): scores ``q k^T * scale``, an optional soft-cap and
mask, ``w = normalizer(s)`` over the keys, dropout, ``out = w v``; fp32 math for half inputs, fp64 for fp64.
Masked keys get weight 0; a row with every key masked gives 0 and zero gradients, as SDPA in torch 2.13.
Method: FlashAttention (Dao et al., 2022) with the online softmax of Milakov & Gimelshein (2018). The CUDA
and CPU paths: docs/DESIGN.md, "Attention op: paths".
"""

from .api import attention
from .ops import AttentionError, attention_op
from .reference import NORMALIZERS, Normalizer, attention_reference
from .torch_path import BLOCK_BYTES

__all__ = ["attention", "attention_reference", "NORMALIZERS", "Normalizer", "AttentionError", "BLOCK_BYTES",
           "attention_op"]
