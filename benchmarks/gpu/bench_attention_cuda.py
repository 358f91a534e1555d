"""Attention on CUDA (benchmarks/gpu/run.sh), bf16, causal: forward and forward + backward time (median of CUDA-event
timed rounds), peak memory above the inputs and the output's error against an fp32 materialized reference, for
eager (materialized), inductor, sdpa (FlashAttention-2), smx (the rewrite), the op with other normalizers
(softcap, sigmoid, softpick, sparsemax) and a score_mod (s * sigmoid(s): Inductor, and smx with cuda="rewrite")."""

import argparse
import math
import sys

import torch
import torch.nn.functional as F

import smxcompile


def eager(q, k, v):
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    L = q.shape[-2]
    s = s.masked_fill(torch.ones(L, L, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return torch.softmax(s.float(), -1).to(q.dtype) @ v


def eager_silu(q, k, v):
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    L = q.shape[-2]
    s = (s * torch.sigmoid(s)).masked_fill(torch.ones(L, L, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return torch.softmax(s.float(), -1).to(q.dtype) @ v


def timed(fn, backward, rounds=5):
    times = []
    for i in range(rounds + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn()
        if backward:
            out.backward(torch.ones_like(out))
        end.record()
        torch.cuda.synchronize()
        if i:
            times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2], out


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true", help="one small case")
    quick = p.parse_args().quick
    print(f"torch {torch.__version__} {torch.cuda.get_device_name()}")
    print("| B,H,L,E | variant | fwd ms | fwd+bwd ms | peak MB fwd+bwd | max err vs fp32 |\n|---|---|---|---|---|---|")
    cases = [(4, 16, 1024, 64)] if quick else [(4, 16, 2048, 64), (1, 16, 8192, 128)]
    for B, H, L, E in cases:
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(B, H, L, E, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
        ref = eager(q.float(), k.float(), v.float())
        ref_silu = eager_silu(q.float(), k.float(), v.float())
        variants = {
            "eager": eager, "inductor": torch.compile(eager),
            "sdpa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
            "smx": torch.compile(eager, backend="smx"),
            "smx-softmax+softcap50": lambda q, k, v: smxcompile.attention(q, k, v, is_causal=True, softcap=50.0),
            "smx-sigmoid": lambda q, k, v: smxcompile.attention(q, k, v, is_causal=True, normalizer="sigmoid"),
            "smx-softpick": lambda q, k, v: smxcompile.attention(q, k, v, is_causal=True, normalizer="softpick"),
            "smx-sparsemax": lambda q, k, v: smxcompile.attention(q, k, v, is_causal=True, normalizer="sparsemax"),
            "inductor-silu": torch.compile(eager_silu),
            "smx-silu": torch.compile(eager_silu, backend="smx", options={"cuda": "rewrite"}),
        }
        if L * L * B * H * 4 > 8e9:
            variants.pop("eager")
            variants.pop("inductor")
            variants.pop("inductor-silu")
        for name, fn in variants.items():
            try:
                qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
                fwd_ms, out = timed(lambda: fn(qq.detach(), kk.detach(), vv.detach()), backward=False)
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                step_ms, _ = timed(lambda: fn(qq, kk, vv), backward=True, rounds=3)
                peak = (torch.cuda.max_memory_allocated() - base) / 1e6
                # the other normalizers compute another function: no softmax reference to hold them to
                want = ref_silu if name.endswith("-silu") else ref
                err = (f"{(out.float() - want).abs().max().item():.2e}" if name in ("eager", "inductor", "sdpa", "smx")
                       or name.startswith("smx-softmax") or name.endswith("-silu") else "-")
                print(f"| {B},{H},{L},{E} | {name} | {fwd_ms:.2f} | {step_ms:.2f} | {peak:.0f} | {err} |")
            except Exception as e:  # report and go on: one failing variant must not hide the others
                print(f"| {B},{H},{L},{E} | {name} | error: {type(e).__name__}: {str(e)[:120]} | | | |")
            sys.stdout.flush()


if __name__ == "__main__":
    main()
