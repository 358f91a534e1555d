#!/usr/bin/env python
"""Softmax into a uint8 quantizer (fake-quant qdq, the codes alone, quantized attention) under eager, Inductor, smx,
smx-rewrite and the op called directly, by time and peak memory; CPU, and CUDA when present.

  python benchmarks/bench_quant_softmax.py [--quick] [--families qdq,codes,attention] [--shapes ...] [--backends ...]
"""

import math
import sys

import torch
import torch.ao.quantization.fx._decomposed  # noqa: F401  (registers torch.ops.quantized_decomposed)

import matrix
from common import BACKENDS
from matrix import Built, Case

QD = torch.ops.quantized_decomposed
SCALE = 1.0 / 255
Q = (SCALE, 0, 0, 255, torch.uint8)    # scale, zero point, qmin, qmax, dtype
SM_SCALE = 0.125                       # 1 / sqrt(head dim 64)
TIE_FRAC, TIE_MIN = 1e-4, 4            # rounding ties allowed: max(TIE_MIN, TIE_FRAC * elems)
ATTENTION_SHAPES = ("8x12x128x128", "4x16x512x512", "2x16x1024x1024", "4x8x1x4096")   # batch x heads x q x keys
WIDE = ("64x32000", "8x131072")        # rows x a vocabulary: qdq and codes only
QUICK = (("qdq", "4x16x512x512"), ("codes", "64x32000"), ("attention", "4x16x512x512"))
CASES = [Case(f, f, s, passes=("infer",), quick=(f, s) in QUICK) for f in ("qdq", "codes", "attention")
         for s in ATTENTION_SHAPES + (() if f == "attention" else WIDE)]
TITLES = {"qdq": "qdq: dequantize(quantize(softmax(x, -1), 1/255, 0, 0, 255, uint8)) -> fp32",
          "codes": "codes: quantize(softmax(x, -1), 1/255, 0, 0, 255, uint8) -> uint8",
          "attention": "attention: dequantize(quantize(softmax(q @ k^T * 0.125, -1))) @ v, head dim 64"}


def f_codes(x):
    return QD.quantize_per_tensor(torch.softmax(x, -1), *Q)


def f_qdq(x):
    return QD.dequantize_per_tensor(f_codes(x), *Q)


def f_attention(q, k, v):
    return QD.dequantize_per_tensor(f_codes(q @ k.transpose(-2, -1) * SM_SCALE), *Q) @ v


def op(x, logit_scale=1.0):
    return torch.ops.smx.quant_softmax(x, -1, logit_scale, *Q, None)


def op_qdq(x):
    return QD.dequantize_per_tensor(op(x), *Q)


def op_attention(q, k, v):
    return QD.dequantize_per_tensor(op(q @ k.transpose(-2, -1), SM_SCALE), *Q) @ v


FUNCS = {"qdq": (f_qdq, op_qdq), "codes": (f_codes, op), "attention": (f_attention, op_attention)}


def check(case: str, got: torch.Tensor, ref: torch.Tensor, v_max: float, elems: int) -> tuple[float, bool]:
    """(differing entries / rows, ok): codes one level off, qdq values one step, attention rows within fp32 noise,
    at rounding ties in at most max(4, 1e-4 x elems) entries."""
    if got.shape != ref.shape or got.dtype != ref.dtype:
        return -1, False
    lim = max(TIE_MIN, int(TIE_FRAC * elems))
    if case == "codes":
        d = (got.to(torch.int32) - ref.to(torch.int32)).abs()
        n, mx = int((d > 0).sum().item()), int(d.max().item()) if d.numel() else 0
        return n, mx <= 1 and n <= lim
    if case == "qdq":
        d = (got.float() - ref.float()).abs().nan_to_num(0.0)
        n, mx = int((d > 1e-7).sum().item()), d.max().item() if d.numel() else 0.0
        return n, torch.equal(got.isnan(), ref.isnan()) and mx <= SCALE + 1e-6 and n <= lim
    row_err = (got.float() - ref.float()).abs().nan_to_num(float("inf")).amax(-1)
    fp_tol = 1e-5 + 1e-4 * ref.abs().max().item()
    n = int((row_err > fp_tol).sum().item())
    return n, row_err.max().item() <= fp_tol + 2 * SCALE * v_max and n <= lim   # a code off by one: max|v| / 255


def build(c: Case, device: str) -> Built:
    """q, k, v ~ N(0, 1) (scores of std 1); wide rows 4 N(0, 1), peaked like LM logits (at std 1 every
    32000-wide probability is below half a step: every code would be 0)."""
    gen, dims = torch.Generator().manual_seed(0), c.dims
    if c.family == "attention":
        b, h, lq, lk = dims
        inputs = [torch.randn(b, h, n, 64, generator=gen).to(device) for n in (lq, lk, lk)]
    else:
        inputs = [(torch.randn(*dims, generator=gen) * (4.0 if c.shape in WIDE else 1.0)).to(device)]
    fn, op_fn = FUNCS[c.family]
    v_max, elems = inputs[-1].abs().max().item(), math.prod(dims)
    return Built(fn, inputs, check=lambda got, ref: check(c.family, got[0][0], ref[0][0], v_max, elems),
                 extra={"op": op_fn}, memory=True)


if __name__ == "__main__":
    sys.exit(matrix.main(__doc__, CASES, build, TITLES, backends=(*BACKENDS, "op"), columns={
        "diffs": lambda r: ", ".join(f"{b} {n}" for b, n in r.max_err.items() if n) or "-"}))
