"""An HF-shaped LM head (logits returned, loss on logits.float()), fwd+bwd: Inductor vs smx, CPU.

    python benchmarks/bench_hf_head.py      # N=1024 tokens, D=256, V=16384 (the demo's head)
"""
import time

import torch
import torch.nn.functional as F

import smxcompile

torch.manual_seed(0)
N, D, V = 1024, 256, 16384
h = torch.randn(N, D, requires_grad=True)
W = (torch.randn(V, D) * 0.05).requires_grad_()
y = torch.randint(0, V, (N,))


def head(h, W, y):
    logits = F.linear(h, W)
    return F.cross_entropy(logits.float().view(-1, V), y), logits


for name, compiled in [("inductor", torch.compile(head)), ("smx", torch.compile(head, backend="smx"))]:
    times = []
    for _ in range(12):
        h.grad = W.grad = None
        t0 = time.perf_counter()
        loss, _logits = compiled(h, W, y)
        loss.backward()
        times.append(time.perf_counter() - t0)
    print(name, "%.1f ms" % (sorted(times[2:])[5] * 1e3))  # the median of 10 steps after 2 warm-up ones
print(smxcompile.last_report().summary())
