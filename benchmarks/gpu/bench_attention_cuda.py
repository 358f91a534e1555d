"""Attention on CUDA (run by benchmarks/gpu/run.sh), bf16, causal, per case and variant (docs/PERFORMANCE.md):
forward and forward + backward ms (CUDA events), peak memory above the inputs, error against an fp32 reference."""

import argparse
import math
import os
import sys

import torch
import torch.nn.functional as F

import smxcompile
from smx_app.demo.memory import PeakMemory

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common  # noqa: E402

#: the variants whose output is held to the fp32 reference (the other normalizers compute another function)
CHECKED = ("eager", "inductor", "sdpa", "smx", "smx-softmax+softcap50", "inductor-silu", "smx-silu")


def eager(q, k, v, silu=False):
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    s = s * torch.sigmoid(s) if silu else s
    L = q.shape[-2]
    s = s.masked_fill(torch.ones(L, L, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return torch.softmax(s.float(), -1).to(q.dtype) @ v


def eager_silu(q, k, v):
    return eager(q, k, v, silu=True)


def op(**kw):
    return lambda q, k, v: smxcompile.attention(q, k, v, is_causal=True, **kw)


def step(fn, *qkv):
    """Forward and backward from fresh leaves (their gradients count in the peak memory)."""
    leaves = [t.detach().requires_grad_() for t in qkv]
    out = fn(*leaves)
    out.backward(torch.ones_like(out))


def main():
    argparse.ArgumentParser(description=__doc__).parse_args()
    print(f"torch {torch.__version__} {torch.cuda.get_device_name()}")
    print("| B,H,L,E | variant | fwd ms | fwd+bwd ms | peak MB fwd+bwd | max err vs fp32 |\n|---|---|---|---|---|---|")
    for B, H, L, E in [(4, 16, 2048, 64), (1, 16, 8192, 128)]:
        case = f"{B},{H},{L},{E}"
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(B, H, L, E, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
        ref, ref_silu = eager(q.float(), k.float(), v.float()), eager_silu(q.float(), k.float(), v.float())
        variants = {
            "eager": eager, "inductor": torch.compile(eager),
            "sdpa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
            "smx": torch.compile(eager, backend="smx"), "smx-softmax+softcap50": op(softcap=50.0),
            "smx-sigmoid": op(normalizer="sigmoid"), "smx-softpick": op(normalizer="softpick"),
            "smx-sparsemax": op(normalizer="sparsemax"), "inductor-silu": torch.compile(eager_silu),
            "smx-silu": torch.compile(eager_silu, backend="smx", options={"cuda": "rewrite"}),
        }
        for name, fn in variants.items():
            if L * L * B * H * 4 > 8e9 and name in ("eager", "inductor", "inductor-silu"):
                continue
            try:
                fwd_ms = common.cuda_ms(lambda: fn(q, k, v), 5)
                with PeakMemory("cuda") as mem:
                    step_ms = common.cuda_ms(lambda: step(fn, q, k, v), 3)
                want = ref_silu if name.endswith("-silu") else ref
                err = f"{(fn(q, k, v).float() - want).abs().max().item():.2e}" if name in CHECKED else "-"
                print(f"| {case} | {name} | {fwd_ms:.2f} | {step_ms:.2f} | {mem.peak_bytes / 1e6:.0f} | {err} |")
            except Exception as e:  # report and go on: one failing variant must not hide the others
                print(f"| {case} | {name} | error: {common.err_text(e)[:150]} | | | |")
            sys.stdout.flush()


if __name__ == "__main__":
    main()
