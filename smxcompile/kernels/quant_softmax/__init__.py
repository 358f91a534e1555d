"""``smx::quant_softmax``: softmax quantized in its epilogue, written as uint8 / int8.

It replaces ``quantize_per_tensor(torch.softmax(x, dim), scale, zero_point, quant_min, quant_max, dtype)`` by
one pass that writes the codes, bit for bit (``round`` half to even; NaN probabilities give ``zero_point``),
with no probability tensor stored. Source: "Softmax Bias Correction for Quantized Generative Models" (Pandey,
Fournarakis, Patel, Nagel, 2023); the recurrence of Milakov & Gimelshein (2018). CUDA: a Triton kernel; CPU:
:func:`quant_softmax_decomposed`. No autograd. Formula, special values, ties: docs/DESIGN.md, "Quantized
softmax op: semantics".
"""

from .api import quant_softmax
from .decomposed import QUANT_RANGES, quant_softmax_decomposed, quant_softmax_reference

__all__ = ["quant_softmax", "quant_softmax_decomposed", "quant_softmax_reference", "QUANT_RANGES"]
