"""``smx::quant_softmax``: softmax quantized in its epilogue, written as uint8 / int8.

The op replaces the spelling ::

    torch.ops.quantized_decomposed.quantize_per_tensor(torch.softmax(x, dim), scale, zero_point,
                                                       quant_min, quant_max, dtype)

by one pass over the output that writes the integer codes directly: no probability tensor of ``x``'s
size is stored. With ``z = x * logit_scale`` it computes, along ``dim``::

    y = softmax(z)                       # fp32 (fp64 for fp64 x); x is upcast first, the multiply
                                         # is skipped when logit_scale == 1
    y = y.to(prob_dtype).float()         # only when prob_dtype is given (the model ran softmax in
                                         # fp16 / bf16 before quantizing)
    t = y * (1.0 / scale)                # in y's dtype: fp32, or fp64 when x is fp64 and prob_dtype is None
    q = clamp(round(t) + zero_point, quant_min, quant_max)          # round: half to even
    q = where(isnan(t), zero_point, q).to(dtype)

which is, bit for bit, ``quantize_per_tensor`` of torch's softmax (torch/ao/quantization/fx/_decomposed.py:
``clamp(round(input * (1.0 / scale)) + zero_point, quant_min, quant_max).to(dtype)`` in fp32, the Python
float ``1.0 / scale`` rounded to fp32 as ATen rounds a scalar operand). On CPU the op calls ATen's own
softmax, so it equals that spelling exactly; when ``prob_dtype == x.dtype`` is fp16 / bf16 and there is no
``logit_scale`` it calls ATen's softmax in ``x.dtype`` (what the model's graph ran; ATen's half kernel
rounds a few entries differently from an fp32 softmax cast to half).

Special values: a probability that is NaN -- every entry of a row that has a NaN or ``+inf`` logit, or
whose logits are all ``-inf`` (torch's softmax gives NaN there) -- gives ``q = zero_point``, i.e. it
dequantizes to 0. torch's own spellings cast NaN to an integer there, which is undefined behaviour in
C++ / CUDA: the value depends on the platform (ATen on an x86 CPU gives 0 for uint8 and int8 alike; with
int8 and ``zero_point = -128`` that dequantizes to ``128 * scale``, about 0.5). ``-inf`` logits (masks)
have probability 0 and give ``zero_point`` like any 0.

Ties: ``round`` is half to even on the rounded product ``t`` everywhere. Different softmax
implementations (ATen's vectorized kernel, Inductor's generated code, the Triton kernel, a GPU's
``exp``) differ in the last bits of ``y``; where ``t`` lies within a few ulps of a ``k + 0.5``
boundary they may therefore give codes one level apart. Nothing else differs.

Dequantize with ``(q.float() - zero_point) * scale``; every entry is then within ``scale / 2`` of the
probability (of ``y`` rounded to ``prob_dtype``) unless it was clamped.

Source: quantized softmax and its bias, "Softmax Bias Correction for Quantized Generative Models"
(Pandey, Fournarakis, Patel, Nagel, 2023): uniform 8-bit (or fewer bits) quantization of the softmax
output, with ``scale = 1 / 255``, ``zero_point = 0`` (uint8) or ``zero_point = -128`` (int8) the common
choice for probabilities in ``[0, 1]``. The recurrence: "Online normalizer calculation for softmax"
(Milakov & Gimelshein, 2018).

* CUDA: a Triton kernel (:mod:`smxcompile.kernels.quant_softmax.triton_kernels`): the online ``(max, sum)``
  recurrence over column tiles, then a second sweep that writes ``q`` in its epilogue.
* CPU: :func:`quant_softmax_decomposed` in torch ops -- also what a graph pass emits on CPU, where
  Inductor fuses the softmax and the quantization into one kernel.

No autograd: the output is an integer tensor.

Modules: :mod:`.api` (the public :func:`quant_softmax`), :mod:`.ops` (the custom op), :mod:`.decomposed`
(the math in torch, the reference, :data:`QUANT_RANGES`), :mod:`.triton_kernels` (the CUDA kernel).
"""

from .api import quant_softmax
from .decomposed import QUANT_RANGES, quant_softmax_decomposed, quant_softmax_reference

__all__ = ["quant_softmax", "quant_softmax_decomposed", "quant_softmax_reference", "QUANT_RANGES"]
