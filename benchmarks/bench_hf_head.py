"""An HF-shaped LM head (logits returned, loss on logits.float()), fwd+bwd: Inductor vs smx, CPU.

    python benchmarks/bench_hf_head.py      # N=1024 tokens, D=256, V=16384 (the demo's head)
"""
import torch, time, torch.nn.functional as F, smxcompile
torch.manual_seed(0)
N,D,V=1024,256,16384
h=torch.randn(N,D,requires_grad=True); W=(torch.randn(V,D)*0.05).requires_grad_(); y=torch.randint(0,V,(N,))
def f(h,W,y):
    logits=F.linear(h,W)
    return F.cross_entropy(logits.float().view(-1,V), y), logits
for name,c in [("inductor",torch.compile(f)),("smx",torch.compile(f,backend="smx"))]:
    ts=[]
    for i in range(12):
        h.grad=W.grad=None
        t=time.perf_counter(); l,lg=c(h,W,y); l.backward(); ts.append(time.perf_counter()-t)
    print(name, "%.1f ms" % (sorted(ts[2:])[5]*1e3))
print(smxcompile.last_report().summary())
