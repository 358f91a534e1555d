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

* CUDA: a Triton kernel (:mod:`smxcompile.kernels.triton_quant_softmax`): the online ``(max, sum)``
  recurrence over column tiles, then a second sweep that writes ``q`` in its epilogue.
* CPU: :func:`quant_softmax_decomposed` in torch ops -- also what a graph pass emits on CPU, where
  Inductor fuses the softmax and the quantization into one kernel.

No autograd: the output is an integer tensor.
"""

from __future__ import annotations

import math

import torch

from . import config

__all__ = ["quant_softmax", "quant_softmax_decomposed", "quant_softmax_reference", "QUANT_RANGES"]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
#: The integer dtypes the op writes and their full ranges.
QUANT_RANGES = {torch.uint8: (0, 255), torch.int8: (-128, 127)}
_FP32_MAX = 3.4028234663852886e38


def _acc_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _probabilities(x: torch.Tensor, dim: int, logit_scale: float, prob_dtype: torch.dtype | None) -> torch.Tensor:
    """``y`` of the module docstring: softmax in fp32 (fp64), rounded through ``prob_dtype``, as fp32 (fp64)."""
    acc = _acc_dtype(x)
    if prob_dtype is not None and prob_dtype == x.dtype and x.dtype != acc and logit_scale == 1.0:
        # ATen's softmax in x's (half) dtype: bit for bit what the model's graph computed.
        return torch.softmax(x, dim).to(torch.float32)
    z = x if x.dtype == acc else x.to(acc)
    if logit_scale != 1.0:
        z = z * logit_scale
    y = torch.softmax(z, dim)
    if prob_dtype is not None:
        y = y.to(prob_dtype).to(torch.float32)
    return y


def quant_softmax_decomposed(x: torch.Tensor, dim: int, logit_scale: float, scale: float, zero_point: int,
                             quant_min: int, quant_max: int, dtype: torch.dtype,
                             prob_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The op's math in torch ops: its CPU path, and what a graph pass emits on CPU (Inductor fuses the
    softmax and the quantizing epilogue into one kernel).

    Args:
        x: scores, any shape (0-d and empty included), fp16/bf16/fp32/fp64, any strides.
        dim: the normalized dim (negative counts from the end).
        logit_scale: multiplies ``x`` (upcast to fp32 / fp64) first; ``1.0`` skips the multiply.
        scale, zero_point, quant_min, quant_max, dtype: as ``quantize_per_tensor``; ``dtype`` uint8 or int8.
        prob_dtype: round the probabilities to this dtype first (the dtype the model's softmax ran in),
            or None.

    Returns:
        ``q``: ``dtype``, ``x.shape``, the layout torch's elementwise ops give (not necessarily
        contiguous). See the module docstring for the formula, NaN handling and ties.

    Not validated: the public :func:`quant_softmax` checks the arguments.
    """
    y = _probabilities(x, dim, logit_scale, prob_dtype)
    t = y * (1.0 / scale)
    q = torch.clamp(torch.round(t) + zero_point, quant_min, quant_max)
    q = torch.where(torch.isnan(t), zero_point, q)
    return q.to(dtype)


def quant_softmax_reference(x: torch.Tensor, dim: int, logit_scale: float, scale: float, zero_point: int,
                            quant_min: int, quant_max: int, dtype: torch.dtype,
                            prob_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The spelling the op replaces, literally (tests' oracle)::

        quantize_per_tensor(torch.softmax(x, dim), scale, zero_point, quant_min, quant_max, dtype)

    with ``x`` upcast to fp32 and multiplied by ``logit_scale`` (when not 1) first, and the probabilities
    cast to ``prob_dtype`` (when given; a half ``x`` with ``prob_dtype == x.dtype`` and no ``logit_scale``
    goes to ``torch.softmax`` as it is). fp64 probabilities (``x`` fp64, no ``prob_dtype``), which
    ``quantize_per_tensor`` refuses, are quantized with its formula written out in fp64. NaN
    probabilities give platform-dependent codes here (a NaN cast to an integer).
    """
    qpt = torch.ops.quantized_decomposed.quantize_per_tensor
    if prob_dtype is not None and prob_dtype == x.dtype and x.dtype in (torch.float16, torch.bfloat16) \
            and logit_scale == 1.0:
        return qpt(torch.softmax(x, dim), scale, zero_point, quant_min, quant_max, dtype)
    z = x.to(_acc_dtype(x))
    if logit_scale != 1.0:
        z = z * logit_scale
    y = torch.softmax(z, dim)
    if prob_dtype is not None:
        y = y.to(prob_dtype)
    if y.dtype == torch.float64:
        return torch.clamp(torch.round(y * (1.0 / scale)) + zero_point, quant_min, quant_max).to(dtype)
    return qpt(y, scale, zero_point, quant_min, quant_max, dtype)


def _contiguous_strides(shape) -> tuple:
    """Strides of a new contiguous tensor of ``shape`` (what ``new_empty`` gives)."""
    strides, step = [], 1
    for s in reversed(tuple(shape)):
        strides.append(step)
        step *= max(int(s), 1)
    return tuple(reversed(strides))


def _forward_impl(x, dim, logit_scale, scale, zero_point, quant_min, quant_max, dtype, prob_dtype):
    if config.use_triton(x):
        from .triton_quant_softmax import quant_softmax_forward

        return quant_softmax_forward(x, dim, logit_scale=logit_scale, scale=scale, zero_point=zero_point,
                                     quant_min=quant_min, quant_max=quant_max, dtype=dtype, prob_dtype=prob_dtype)
    with torch.no_grad():
        # quant_softmax_decomposed's math with in-place steps on the one fp32 buffer softmax returns
        # (eager CPU: one probability tensor and the codes, instead of a temporary per step)
        t = _probabilities(x, dim, logit_scale, prob_dtype)
        if t.data_ptr() == x.data_ptr():   # never write into the caller's tensor
            t = t.clone()
        t.mul_(1.0 / scale).round_().add_(zero_point).clamp_(quant_min, quant_max)
        t.nan_to_num_(nan=float(zero_point))
        q = torch.empty(t.shape, dtype=dtype, device=t.device)   # the fake kernel's contiguous layout
        q.copy_(t)
    return q


@torch.library.custom_op("smx::quant_softmax", mutates_args=())
def _quant_softmax_op(x: torch.Tensor, dim: int, logit_scale: float, scale: float, zero_point: int,
                      quant_min: int, quant_max: int, dtype: torch.dtype,
                      prob_dtype: torch.dtype | None = None) -> torch.Tensor:
    return _forward_impl(x, dim, logit_scale, scale, zero_point, quant_min, quant_max, dtype, prob_dtype)


@_quant_softmax_op.register_fake
def _(x, dim, logit_scale, scale, zero_point, quant_min, quant_max, dtype, prob_dtype=None):
    return x.new_empty(x.shape, dtype=dtype)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def quant_softmax(x: torch.Tensor, dim: int = -1, *, scale: float, zero_point: int = 0,
                  dtype: torch.dtype = torch.uint8, bits: int | None = None, quant_min: int | None = None,
                  quant_max: int | None = None, temperature: float = 1.0,
                  prob_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``softmax(x / temperature, dim)`` quantized to ``dtype`` in the same pass, without the fp32 probabilities.

    Equals ``torch.ops.quantized_decomposed.quantize_per_tensor(torch.softmax(x.float() * (1 / temperature),
    dim), scale, zero_point, quant_min, quant_max, dtype)`` bit for bit on CPU (up to one level where the
    scaled probability lies within a few ulps of a ``k + 0.5`` boundary, on the Triton path), except that
    NaN probabilities give ``zero_point`` (see the module docstring).

    Args:
        x: scores (logits), any shape (0-d and empty too), fp16/bf16/fp32/fp64, any strides. The math is
            fp32 (fp64 for fp64 ``x`` without ``prob_dtype``).
        dim: the normalized dim (negative counts from the end).
        scale: quantization step, finite, > 0 (and ``1 / scale`` finite in fp32); ``1 / 255`` (uint8) or
            ``1 / 256`` (int8 with ``zero_point = -128``) cover ``[0, 1]``.
        zero_point: the code of probability 0, in ``[quant_min, quant_max]``.
        dtype: ``torch.uint8`` or ``torch.int8``.
        bits: 2..8: ``quant_min`` / ``quant_max`` (those not given) default to the full ``bits``-bit range,
            ``[0, 2**bits - 1]`` for uint8, ``[-2**(bits-1), 2**(bits-1) - 1]`` for int8. Without ``bits``
            they default to ``dtype``'s full range.
        quant_min, quant_max: the clamp range, inside ``dtype``'s range, ``quant_min < quant_max``.
        temperature: the logits are multiplied by ``1 / temperature`` first; finite, > 0.
        prob_dtype: round the probabilities to this float dtype before quantizing (the dtype a model's
            softmax ran in before it was quantized, e.g. fp16), or None.

    Returns:
        ``q``: a new contiguous ``dtype`` tensor of ``x.shape``. Dequantize with
        ``(q.float() - zero_point) * scale``.

    Raises:
        ValueError: ``dtype`` not uint8 / int8; ``bits`` outside 2..8; a quant range outside ``dtype`` or
            ``quant_min >= quant_max``; ``zero_point`` outside ``[quant_min, quant_max]``; ``scale`` or
            ``temperature`` not finite and > 0; a non-floating ``x`` or ``prob_dtype``; ``dim`` out of range.
        TypeError: ``x`` not a tensor; ``bits``, ``zero_point``, ``quant_min``, ``quant_max`` or ``dim`` not
            an int; ``scale`` or ``temperature`` not a real number.

    Source: "Softmax Bias Correction for Quantized Generative Models" (Pandey, Fournarakis, Patel, Nagel,
    2023) for the quantized softmax; "Online normalizer calculation for softmax" (Milakov & Gimelshein,
    2018) for the recurrence of the Triton kernel.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"quant_softmax needs floating-point scores (fp16/bf16/fp32/fp64), got {x.dtype}")
    if dtype not in QUANT_RANGES:
        raise ValueError(f"dtype must be torch.uint8 or torch.int8, got {dtype}")
    if prob_dtype is not None and prob_dtype not in _FLOAT_DTYPES:
        raise ValueError(f"prob_dtype must be a floating-point dtype or None, got {prob_dtype}")
    if not _is_int(dim):
        raise TypeError(f"dim must be an int, got {dim!r}")
    nd = max(x.dim(), 1)
    if not -nd <= dim < nd:
        raise ValueError(f"dim {dim} out of range for a tensor of {x.dim()} dims (expected in [{-nd}, {nd - 1}])")
    lo, hi = QUANT_RANGES[dtype]
    if bits is not None:
        if not _is_int(bits):
            raise TypeError(f"bits must be an int, got {bits!r}")
        if not 2 <= bits <= 8:
            raise ValueError(f"bits must be in 2..8, got {bits}")
        blo, bhi = (0, 2**bits - 1) if dtype == torch.uint8 else (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
    else:
        blo, bhi = lo, hi
    quant_min = blo if quant_min is None else quant_min
    quant_max = bhi if quant_max is None else quant_max
    for name, v in (("zero_point", zero_point), ("quant_min", quant_min), ("quant_max", quant_max)):
        if not _is_int(v):
            raise TypeError(f"{name} must be an int, got {v!r}")
    if not lo <= quant_min < quant_max <= hi:
        raise ValueError(f"quant range [{quant_min}, {quant_max}] must lie inside {dtype}'s range [{lo}, {hi}] "
                         "with quant_min < quant_max")
    if not quant_min <= zero_point <= quant_max:
        raise ValueError(f"zero_point {zero_point} outside the quant range [{quant_min}, {quant_max}]")
    for name, v in (("scale", scale), ("temperature", temperature)):
        if not _is_real(v):
            raise TypeError(f"{name} must be a real number, got {v!r}")
        if not (math.isfinite(v) and v > 0):
            raise ValueError(f"{name} must be finite and > 0, got {v!r}")
    scale, temperature = float(scale), float(temperature)
    if not 1.0 / scale <= _FP32_MAX:
        raise ValueError(f"scale {scale!r} is too small: 1 / scale overflows float32")
    logit_scale = 1.0 / temperature
    if not logit_scale <= _FP32_MAX:
        raise ValueError(f"temperature {temperature!r} is too small: 1 / temperature overflows float32")
    return _quant_softmax_op(x, dim % nd, logit_scale, scale, int(zero_point), int(quant_min), int(quant_max),
                             dtype, prob_dtype)
