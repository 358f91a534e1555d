"""The policy: what happens to a site once it matched, written once for every rewrite kind.

The ladder (:func:`decide`), in order, for a site still marked ``rewritten`` by its matcher:

1. the graph runs a torch.func transform -> ``skipped`` (the smx ops have no functorch rules);
2. the pass's own checks (dtype, interior nodes used elsewhere, in-place ops...) -> ``skipped``;
3. the kind is disabled by the options -> ``kept``;
4. the site's ``check`` failed -> ``kept``;
5. the pass's own reasons to keep a site whatever the device (e.g. already torch's fused SDPA);
6. the device: on CPU, ``cpu="keep"`` keeps, ``cpu="auto"`` keeps where :data:`CPU_RULES` measured
   Inductor's own code as fast, ``cpu="rewrite"`` rewrites; on CUDA the same with ``cuda=`` and
   :data:`CUDA_RULES`; other devices keep;
7. the pass's last checks (those that only matter for a rewrite that would happen).

A pass supplies only what is its own through the hooks of :class:`Ladder`: its checks, its keep reasons, its
CPU rule (a row of :data:`CPU_RULES`, with the benchmark command that set it; figures in docs/PERFORMANCE.md).
A CUDA rule is a row of :data:`CUDA_RULES` for the site's kind (or its ``route``): no pass hook, each kept whole
on CUDA.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from .protocol import Match, PassContext

try:
    from torch.fx.experimental.symbolic_shapes import optimization_hint as _size_hint
except ImportError:  # torch before 2.12 names it size_hint (the GPU machines' images hold torch 2.11)
    from torch.fx.experimental.symbolic_shapes import size_hint as _size_hint


@dataclasses.dataclass(frozen=True)
class DeviceRule:
    """One measured decision of the ``cpu="auto"`` / ``cuda="auto"`` policy.

    Attributes:
        kind: the rewrite kind it governs.
        rule: what it decides.
        threshold: the measured bound (columns, keys, classes), or None for a rule without one.
        benchmark: the command whose figures set it (docs/PERFORMANCE.md records them).
        measured: the figures, in short.
    """

    kind: str
    rule: str
    threshold: int | None
    benchmark: str
    measured: str


#: Every CPU threshold and keep rule, one row each.
CPU_RULES: dict[str, DeviceRule] = {
    "softmax_min_columns_inference": DeviceRule(
        "softmax", "an inference softmax (no gradient) of a plain input is rewritten from this many columns",
        16384, "python benchmarks/bench_softmax.py --rounds 3",
        "ATen's softmax through the op 0.78x Inductor at 256x16384, 0.87x at 64x32000; the op's ~10 us dispatch "
        "cost makes shorter rows as slow or slower"),
    "softmax_min_columns": DeviceRule(
        "softmax, log_softmax", "a training softmax (forward + backward) and a log-softmax are rewritten from this "
        "many columns", 131072, "python benchmarks/bench_softmax.py --rounds 3",
        "0.58-0.88x Inductor at 16x131072 and 8x262144; 1.1-1.2x below (unfused backward)"),
    "softmax_neighbours": DeviceRule(
        "softmax, log_softmax", "a site with absorbed neighbours (scale, mask, soft-cap, casts) or fed by a "
        "pointwise op is kept: Inductor fuses them into its C++ softmax loop", None,
        "python benchmarks/bench_softmax.py --rounds 3", "cpu='rewrite' up to 2.3x Inductor; kept: 1.00x"),
    "attention_min_keys": DeviceRule(
        "attention", "a softmax attention without soft-cap is rewritten from this many keys", 512,
        "python benchmarks/bench_attention.py --models gpt2,llama --seq 128,256,512 --modes train,infer "
        "--variants inductor,smx --rounds 5 --batch 8 --layers 4; python benchmarks/bench_defaults.py",
        "0.99-1.07x Inductor at 128 and 256 keys, 0.90-0.99x at 512 (GPT-2 / Llama blocks); the bare 2x8x512x64 "
        "causal / GQA block 0.68-0.77x, 1x8x2048x64 0.28x / 0.35x (inference / training)"),
    "attention_bf16_min_keys": DeviceRule(
        "attention", "a bf16 softmax attention is rewritten from this many keys", 1024,
        "python benchmarks/bench_defaults.py --families attention --only bf16 --rounds 3",
        "on a CPU with AVX512-BF16: torch's fused kernel 1.25-1.61x Inductor's time at 2x8x512x64 (ATen's bf16 "
        "matmuls are fast there), 0.84x / 0.85x at 1x8x1024x64, 0.34x / 0.27x at 2048 (inference / training); "
        "fp16 0.16x / 0.61x at 512 keys"),
    "attention_score_mod_min_keys": DeviceRule(
        "attention", "an inference attention whose scores go through other pointwise changes of the scores alone "
        "(FlexAttention's score_mod, no side input) is rewritten from this many keys", 1024,
        "python benchmarks/bench_defaults.py --families score_mod",
        "s * sigmoid(s): 1.26x Inductor's time at 2x8x512x64, 0.71x at 1x8x1024x64, 0.83-0.85x at 2048 keys"),
    "attention_score_mod_sides": DeviceRule(
        "attention", "a score_mod that reads side inputs (a gate, a bias, a padding mask) is kept", None,
        "python benchmarks/bench_defaults.py --families score_mod",
        "FlexAttention's CPU template 1.16-1.83x Inductor's time with an (H, L, S) gate at 512-2048 keys, "
        "0.89-1.70x with a padding mask"),
    "cross_entropy": DeviceRule(
        "cross_entropy", "cross-entropy on given logits is kept", None,
        "python benchmarks/bench_ce_guard.py --families cross_entropy",
        "the online CE op 2.5-3.1x Inductor's fused C++ cross-entropy"),
    "linear_cross_entropy_min_vocab": DeviceRule(
        "linear_cross_entropy", "a training linear -> cross-entropy is rewritten from this many classes", 4096,
        "python benchmarks/bench_linear_ce.py; python benchmarks/bench_ce_guard.py --families hf_head; "
        "python benchmarks/bench_defaults.py",
        "training steps 0.82-0.98x Inductor's time at 16384-50257 classes (N=1024-2048, D=256-512), 0.92x at "
        "131072; below 4096 the logits are small and Inductor's fused code is as fast"),
    "linear_cross_entropy_inference": DeviceRule(
        "linear_cross_entropy", "linear -> cross-entropy without a gradient (evaluation) is kept", None,
        "python benchmarks/bench_defaults.py --families linear_ce",
        "the cut-CE op 1.36-1.53x Inductor's time at 16384-50257 classes (N=1024, D=256): without a backward "
        "there is no gradient buffer to save, and Inductor's matmul + fused C++ loss is one pass"),
    "linear_cross_entropy_bf16": DeviceRule(
        "linear_cross_entropy", "a bf16 linear -> cross-entropy is kept", None,
        "python benchmarks/bench_defaults.py --families linear_ce --only bf16 --rounds 3",
        "on a CPU with AVX512-BF16, training steps 1.42-1.63x Inductor's time at 128x128x16384, 1024x256x16384 and "
        "1024x256x50257 (N x D x V): ATen's bf16 matmuls are fast there and cut CE's chunks add passes; fp16 "
        "0.11-0.12x at 128x128x16384 and 1024x256x16384 (rewritten)"),
    "softmax_topk": DeviceRule(
        "softmax_topk", "every static shape is rewritten (to the two-pass decomposition; top-1 reads to max, one "
        "sum of exp and the first maximum); symbolic row lengths are kept", None,
        "python benchmarks/bench_softmax_topk.py --threads 1 --stat min --retry-noisy 1",
        "0.18-0.82x Inductor for 8-128 experts, 0.26-0.48x at 128K-256K vocabulary, 0.68-0.90x for top-1 reads"),
    "softmax_topk_top1_half_max_columns": DeviceRule(
        "softmax_topk", "a top-1 read of fp16 / bf16 probabilities is rewritten below this many columns", 16,
        "python benchmarks/bench_softmax_topk.py --families top1 --rounds 5",
        "bf16 0.66-0.75x Inductor at 8192x8, 0.96-1.32x at 8192x32 and 8192x64 (inference and training); "
        "fp32 0.68-0.90x at 8 and 64"),
    "softmax_topk_entries_min_columns": DeviceRule(
        "softmax_topk", "probabilities read at given entries (a gather, a one-hot product summed) without a gradient "
        "are rewritten from this many columns; with one, always", 128,
        "python benchmarks/bench_softmax_topk.py --families entries --rounds 3",
        "NLLB-MoE's top-2 gates 1.20x Inductor's time at 8192x8 and 1.04x at 8192x64 forward, 1.01x at 2048x128; "
        "0.49-0.76x forward + backward; a gather at 16x32000 / 4x131072 0.99-1.00x"),
    "quant_softmax": DeviceRule(
        "quant_softmax", "softmax -> quantize is kept: Inductor fuses softmax, quantize and dequantize into one "
        "C++ loop", None, "python benchmarks/bench_quant_softmax.py --threads 1 --stat min --retry-noisy 1",
        "cpu='rewrite' 1.5-2.1x Inductor; kept: 1.00-1.03x"),
    "sample": DeviceRule(
        "sample", "the sampling step is rewritten at every measured shape", None,
        "python benchmarks/bench_sampling.py --markdown",
        "transformers' top-k / top-p / min-p chains at B = 1-256, V = 32K-256K: smx 0.02-0.41x Inductor's time "
        "(ATen's multinomial sweeps the whole row; the op draws among a few candidates)"),
}

#: The lowerings ruled apart from their kind (a ``Match.route``), and the kind each belongs to.
ROUTES = {"attention_score_mod": "attention"}

#: What the default (``cuda="auto"``) keeps on CUDA, by rewrite kind: the kinds whose smx path was measured slower
#: than Inductor's own code, side by side on an H200 (torch 2.11, Triton 3.6). A kind without a row is rewritten.
_GPU_RUN = "bash benchmarks/gpu/run.sh:"
CUDA_RULES: dict[str, DeviceRule] = {
    kind: rule for rule in (
        DeviceRule("softmax, log_softmax", "kept, Inductor's generated softmax measured faster", None,
                   _GPU_RUN + " benchmarks/bench_softmax.py --device cuda, benchmarks/gpu/compare_model.py",
                   "smx 2.0-5.0x Inductor's time at 4096x1024 and 64x32000, forward and forward + backward; the "
                   "kernel alone 1.00x (bf16) / 0.68x (fp32) torch's speed at 4096x4096, its backward 0.77x"),
        DeviceRule("softmax_topk", "kept, Inductor's softmax + top-k measured faster (a rewrite that deletes the "
                   "softmax still happens)", None,
                   _GPU_RUN + " benchmarks/bench_softmax_topk.py --device cuda",
                   "routers of 8-64 experts 2.1-2.7x Inductor's time forward, 1.7-2.2x forward + backward; the "
                   "128K-vocabulary sampler kernel 0.59-0.72x torch's speed"),
        DeviceRule("quant_softmax", "kept, Inductor's fused softmax + quantize measured faster", None, _GPU_RUN + " benchmarks/bench_quant_softmax.py --device cuda",
                   "smx 2.3-5.1x Inductor's time (fake-quant, uint8 codes, quantized attention)"),
        DeviceRule("linear_cross_entropy", "kept, Inductor's matmul + fused loss measured faster and as lean", None,
                   _GPU_RUN + " benchmarks/gpu/bench_linear_ce_cuda.py",
                   "training step 2.1-2.2x Inductor's time at N=8192, D=2048, V=32000 / 128256 bf16, peak memory "
                   "1.41 / 2.18 GB against Inductor's 0.52 / 2.10 GB (statistics then a recomputing backward, G "
                   "as hi + lo); the GPU model (benchmarks/gpu_model.py, torch's kernels traced alike) predicts "
                   "the one-pass training step since (G rounded once, 6 N V D FLOPs) at 1.27x torch eager's speed "
                   "at N=8192, D=4096, V=128256 bf16 and 1.40x at N=4096, D=2048, V=32000: kept until a GPU "
                   "times it against Inductor"),
        DeviceRule("attention_score_mod", "kept, FlexAttention with a score_mod not yet timed against Inductor on "
                   "CUDA", None, _GPU_RUN + " benchmarks/gpu/bench_attention_cuda.py (the -silu rows)",
                   "no GPU run yet"),
        DeviceRule("sample", "kept, the Triton sampling kernel not yet timed against Inductor on CUDA", None,
                   _GPU_RUN + " benchmarks/bench_sampling.py --device cuda", "no GPU run yet"),
        DeviceRule("cross_entropy", "kept, not yet timed against Inductor on CUDA", None,
                   _GPU_RUN + " benchmarks/gpu/compare_model.py",
                   "the backward kernel 4.99x eager's speed at 8192x128256 bf16; the forward failed to compile "
                   "there (fixed since); no side-by-side run against Inductor yet"),
    ) for kind in rule.kind.split(", ")
}



def cpu_threshold(name: str) -> int:
    """The threshold of CPU rule ``name`` (a key of :data:`CPU_RULES`)."""
    t = CPU_RULES[name].threshold
    assert t is not None, name
    return t


def policy_size(size, *, fallback: int) -> int:
    """A size to decide a policy row on: an int as is; a symbolic size (``dynamic=True``) by its example's hint,
    without a guard (a speed choice only), or ``fallback`` where it has no hint."""
    return size if isinstance(size, int) else int(_size_hint(size, fallback=fallback))


#: The reasons every pass gives for the same decision.
FUNCTORCH_REASON = "the graph runs a torch.func transform ('{op}'); smx ops have no functorch rules yet"
DISABLED_REASON = "rewrite kind '{kind}' disabled by options"
CHECK_FAILED_REASON = ("check failed: the rewrite disagreed with eager on the example inputs, or they could not be run "
                       "(symbolic shapes after a recompile for a new shape, checkpoint regions; the log says which)")
CPU_KEEP_REASON = "options cpu='keep'"
CUDA_KEEP_REASON = "options cuda='keep'"
DEVICE_REASON = "device '{device}' has no smx kernel"
FORCE_HINT = "options cpu='rewrite' forces it"
CUDA_RULE_REASON = "CUDA: {rule}: {measured} ({benchmark}, docs/PERFORMANCE.md); options cuda='rewrite' forces it"


@dataclasses.dataclass
class Ladder:
    """A pass's part of the policy (every hook optional).

    Attributes:
        kind: the rewrite kind the options enable / disable (default: the match's ``kind``).
        checks: why the site cannot be rewritten safely (``""``: it can); may fill analysis fields of the match.
        keep: a reason to keep the site on any device (``""``: none).
        device_free: the site is rewritten whatever the device and its policy (the rewrite deletes work, or
            Inductor would compute something else): no device rule applies.
        cpu_keep: under ``cpu="auto"``, why a CPU site is kept (``""``: rewrite it); see :data:`CPU_RULES`.
        last_checks: checks that only matter for a rewrite that will happen.
        keep_whole: which keeps claim the site's nodes (later passes leave them alone): any of
            ``"disabled"``, ``"check"``, ``"cpu"`` (a CUDA rule's keep always does).
    """

    kind: str | None = None
    checks: Callable[[Match, PassContext], str] | None = None
    keep: Callable[[Match, PassContext], str] | None = None
    device_free: Callable[[Match], bool] | None = None
    cpu_keep: Callable[[Match, PassContext], str] | None = None
    last_checks: Callable[[Match, PassContext], str] | None = None
    keep_whole: frozenset[str] = frozenset()


def find_sites(graph, ctx: PassContext, exclude: set, match: Callable, ladder: Ladder) -> list:
    """The sites ``match(node)`` finds in ``graph`` (None: no site), outside ``exclude``, each decided by
    ``ladder``: the ``find`` of a pass whose sites do not overlap."""
    out = []
    for node in graph.nodes:
        if node in exclude:
            continue
        m = match(node)
        if m is None or any(n in exclude for n in m.dead):
            continue
        m.prefix = ctx.prefix
        decide(m, ctx, ladder)
        out.append(m)
    return out


def decide(m: Match, ctx: PassContext, ladder: Ladder) -> None:
    """Set ``m.action`` / ``m.reason`` by the ladder of the module docstring (a no-op on a site the matcher
    already skipped)."""
    if m.action != "rewritten":
        return
    if ctx.functorch is not None:
        m.skip(FUNCTORCH_REASON.format(op=ctx.functorch))
        return
    why = ladder.checks(m, ctx) if ladder.checks else ""
    if why:
        m.skip(why)
        return
    kind = ladder.kind or m.kind
    if not ctx.options.enabled(kind):
        m.keep(DISABLED_REASON.format(kind=kind), whole="disabled" in ladder.keep_whole)
        return
    if m.key in ctx.skip:
        m.keep(CHECK_FAILED_REASON, whole="check" in ladder.keep_whole)
        return
    why = ladder.keep(m, ctx) if ladder.keep else ""
    if why:
        m.keep(why)
        return
    if not (ladder.device_free and ladder.device_free(m)):
        whole = "cpu" in ladder.keep_whole
        if m.device == "cpu":
            if ctx.options.cpu == "keep":
                m.keep(CPU_KEEP_REASON, whole=whole)
                return
            why = ladder.cpu_keep(m, ctx) if ladder.cpu_keep and ctx.options.cpu == "auto" else ""
            if why:
                m.keep(why, whole=whole)
                return
        elif m.device == "cuda":
            if ctx.options.cuda == "keep":
                m.keep(CUDA_KEEP_REASON, whole=True)
                return
            rule = CUDA_RULES.get(m.route or kind) if ctx.options.cuda == "auto" else None
            if rule is not None:
                m.keep(CUDA_RULE_REASON.format(rule=rule.rule, measured=rule.measured, benchmark=rule.benchmark),
                       whole=True)
                return
        else:
            m.keep(DEVICE_REASON.format(device=m.device))
            return
    why = ladder.last_checks(m, ctx) if ladder.last_checks else ""
    if why:
        m.skip(why)


__all__ = ["DeviceRule", "CPU_RULES", "CUDA_RULES", "ROUTES", "cpu_threshold", "policy_size", "Ladder", "decide", "FUNCTORCH_REASON", "DISABLED_REASON",
           "CHECK_FAILED_REASON", "CPU_KEEP_REASON", "CUDA_KEEP_REASON", "CUDA_RULE_REASON", "DEVICE_REASON",
           "FORCE_HINT"]
