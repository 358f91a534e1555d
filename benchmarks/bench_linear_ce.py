"""One training step of ``F.cross_entropy(F.linear(x, W), y)`` (fp32, CPU) per variant (benchmarks/README.md), each
in a fresh process: step time, peak memory above the inputs, loss and gradients against eager's.

  python benchmarks/bench_linear_ce.py [--quick] [--vocab 32000,128256] [--variants ...] [--json P] [--plot P]
"""

import sys

import common
import workers
from common import GB

VARIANTS = ("eager", "inductor", "native", "cce", "smx-op", "smx")
IGNORE_INDEX = -100
IGNORE_FRAC = 0.1  # of the targets, set to IGNORE_INDEX
QUICK = {"tokens": 1024, "dim": 256, "vocab": [8192], "rounds": 1}
DEFAULTS = {"tokens": 8192, "dim": 1024, "vocab": [32000, 128256], "rounds": 2}
#: the table's columns ({header: (summary key, scale)}, {header: check key}); the plot draws the "(/ind)" ones
METRICS = {"step s (/ind)": ("step_s", 1), "cpu s": ("cpu_s", 1), "warm-up s": ("warmup_s", 1),
           "peak GB (/ind)": ("peak_bytes", 1 / GB), "transient GB (/ind)": ("transient_bytes", 1 / GB)}
RELS = {"rel dloss": "loss_rel", "rel dx": "dx_rel", "rel dW": "dw_rel"}


def make_inputs(n: int, d: int, v: int):
    """x ~ N(0, 1), W ~ N(0, 1/D) (logits of unit variance), y uniform with IGNORE_FRAC of them -100."""
    import torch

    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, d, generator=g)
    w = torch.randn(v, d, generator=g) * d ** -0.5
    y = torch.randint(0, v, (n,), generator=g)
    drop = torch.rand(n, generator=g) < IGNORE_FRAC
    drop[0] = False  # at least one valid token
    y[drop] = IGNORE_INDEX
    return x.requires_grad_(True), w.requires_grad_(True), y


def loss_fn(x, w, y):
    import torch.nn.functional as F

    return F.cross_entropy(F.linear(x, w), y, ignore_index=IGNORE_INDEX)


def build_variant(name: str):
    """-> callable(x, W, y) -> scalar loss, for variant ``name``."""
    import torch
    import torch.nn.functional as F

    if name == "native":
        opts = torch.nn.LinearCrossEntropyOptions()
        return lambda x, w, y: F.linear_cross_entropy(x, w, y, ignore_index=IGNORE_INDEX, options=opts)
    if name == "cce":  # Apple's cut-cross-entropy through its CPU path: its Triton kernels need a GPU
        try:
            from cut_cross_entropy import linear_cross_entropy as cce
        except Exception as e:  # ImportError, or triton failing to import
            raise workers.Unavailable(f"cut_cross_entropy not importable ({type(e).__name__}: {e}); `pip install "
                                      "--no-deps cut-cross-entropy` (--no-deps keeps your torch)") from e
        return lambda x, w, y: cce(x, w, y, ignore_index=IGNORE_INDEX, impl="torch_compile")
    if name == "smx-op":
        import smxcompile

        return lambda x, w, y: smxcompile.linear_cross_entropy(x, w, y, ignore_index=IGNORE_INDEX)
    return common.compile_for(name, loss_fn)  # eager: loss_fn itself


def reference_chunked(x, w, y, rows: int):
    """Eager's math by row chunks (when the eager variant itself did not run): loss, dx, dW."""
    import torch
    import torch.nn.functional as F

    n_valid, dx, total = (y != IGNORE_INDEX).sum(), torch.zeros_like(x), torch.zeros((), dtype=x.dtype)
    for r0 in range(0, x.shape[0], rows):
        xc = x[r0:r0 + rows].detach().requires_grad_(True)
        lc = F.cross_entropy(F.linear(xc, w), y[r0:r0 + rows], ignore_index=IGNORE_INDEX, reduction="sum") / n_valid
        lc.backward()
        dx[r0:r0 + rows] = xc.grad
        total += lc.detach()
    return total, dx, w.grad


def work(spec: dict, out: dict) -> None:
    """A worker: one variant's warm-up and timed steps, its memory and its check."""
    import torch

    torch.set_num_threads(spec["threads"])
    n, d, v = spec["tokens"], spec["dim"], spec["vocab"]
    x, w, y = make_inputs(n, d, v)
    out.update(grads_bytes=(n * d + v * d) * 4, valid_tokens=int((y != IGNORE_INDEX).sum()))
    tol = {"loss": spec["loss_rtol"], "dx": spec["grad_rtol"], "dw": spec["grad_rtol"]}
    if spec["variant"] == "reference":
        spec["by"] = "eager by row chunks"
        workers.say("reference: eager by row chunks ...")
        loss, dx, dw = reference_chunked(x, w, y, max(1, int(256e6 // (v * 4))))
        return workers.conclude(spec, out, {"loss": loss, "dx": dx, "dw": dw}, tol)
    fn = build_variant(spec["variant"])

    def step():
        loss = fn(x, w, y)
        loss.backward()
        return loss.detach()

    def reset():
        x.grad = w.grad = None

    loss = workers.timed_steps(step, spec["rounds"], out, reset)
    out["loss"] = float(loss)
    workers.conclude(spec, out, {"loss": loss, "dx": x.grad, "dw": w.grad}, tol)


def estimate_bytes(spec: dict) -> int:
    """Rough peak RSS of a worker (overhead + inputs + gradients + the step + the reference's gradients); the
    step's share calibrated at V=32000 and 128256, generously (docs/PERFORMANCE.md)."""
    n, d, v = spec["tokens"], spec["dim"], spec["vocab"]
    logits, grads = n * v * 4, (n * d + v * d) * 4
    step = {"eager": 3.2 * logits, "inductor": 1.5 * logits, "cce": 1.5 * logits, "smx": 1.5 * logits,
            "native": min(logits, 0.4 * GB + 0.1 * logits), "smx-op": 3 * 2**25 + 0.1 * GB,
            "reference": 3 * 256e6}[spec["variant"]]
    return int(1.5 * GB + grads + n * 8 + grads + step + grads)


def main(argv: list[str] | None = None) -> int:
    p = workers.parser(__doc__, VARIANTS, grad_rtol=1e-4, quick="smoke run: N=1024, D=256, V=8192, 1 round (< 1 min)")
    p.add_argument("--vocab", type=common.int_list, help="comma-separated vocabulary sizes V (default 32000,128256)")
    args = p.parse_args(argv)
    for k, val in (QUICK if args.quick else DEFAULTS).items():
        setattr(args, k, getattr(args, k, None) or val)
    if args._worker:
        return workers.run_worker(args._worker, work)
    n, d, variants = args.tokens, args.dim, args.variants
    settings = {"tokens": n, "dim": d, "vocab": args.vocab, "variants": variants, "ignore_frac": IGNORE_FRAC}
    points = [({"vocab": v}, variants) for v in args.vocab]
    result = workers.run(args, __file__, ("cut-cross-entropy",), settings, points, estimate_bytes)
    title = (f"linear + cross-entropy, fwd+bwd, N={n}, D={d}, fp32, CPU ({result['env']['cpu']}, {args.threads} "
             f"threads); median of {args.rounds} step(s); GB = 1e9 B above inputs; (/ind) = ratio to inductor")
    workers.table(title, result["results"], ("vocab",), METRICS, RELS, args.markdown)
    return workers.finish(result, args, title, "vocab", METRICS, lambda r: r["variant"])


if __name__ == "__main__":
    sys.exit(main())
