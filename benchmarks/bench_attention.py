"""Small eager-attention causal LMs (transformers, random weights), one inference or training step per variant, each in
a fresh process: step time, peak memory, logits, loss and gradients against eager's (benchmarks/README.md).

  python benchmarks/bench_attention.py [--quick] [--models gpt2,llama] [--seq 1024,4096] [--modes infer,train]
"""

import importlib
import sys

from smx_app.argtypes import positive_int

import common
import workers
from common import GB, MB

MODELS = ("gpt2", "llama", "gpt_oss")
MODES = ("infer", "train")
VARIANTS = ("eager", "inductor", "smx", "sdpa")
#: parameters whose gradients are compared (those present in the model)
GRAD_PARAMS = {
    "gpt2": ("transformer.h.0.attn.c_attn.weight", "transformer.h.0.attn.c_proj.weight", "transformer.wte.weight"),
    "llama": ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
              "model.layers.0.self_attn.v_proj.weight", "model.embed_tokens.weight"),
    "gpt_oss": ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.sinks",
                "model.layers.1.self_attn.sinks", "model.embed_tokens.weight"),
}
#: the table's columns: {header: (summary key, scale)}; the plot draws the "(/ind)" ones
METRICS = {"step ms (/ind)": ("step_s", 1e3), "peak MB (/ind)": ("peak_bytes", 1 / MB), "warm-up s": ("warmup_s", 1)}
#: the model's flags: (default, help)
SHAPE = {"batch": (1, "sequences per step"), "layers": (2, "transformer layers"),
         "hidden": (256, "hidden size (llama's MLP is 2x)"), "heads": (4, "attention heads"),
         "vocab": (2048, "vocabulary size"), "kv-heads": (None, "llama's key/value heads (default heads // 2: GQA)")}


def build_model(spec: dict, attn: str):
    """The model of ``spec`` with random weights (seed 0), attention ``attn``, dropout 0."""
    import torch
    import transformers

    torch.manual_seed(0)
    h, heads, layers = spec["hidden"], spec["heads"], spec["layers"]
    common_kw = dict(vocab_size=spec["vocab"], bos_token_id=0, eos_token_id=0, attn_implementation=attn)
    decoder_kw = dict(common_kw, hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=spec["kv_heads"], max_position_embeddings=max(spec["seq"], 1024),
                      attention_dropout=0.0, pad_token_id=0)
    if spec["model"] == "gpt2":
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_positions=max(spec["seq"], 1024), n_embd=h, n_layer=layers, n_head=heads, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0, summary_first_dropout=0.0, **common_kw))
        model.loss_type = "ForCausalLM"  # else a warning_once inside forward: a Dynamo graph break before the loss
    elif spec["model"] == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(intermediate_size=2 * h, **decoder_kw))
    else:  # gpt_oss: attention sinks; sliding (128) and full layers alternate; 4 experts
        model = transformers.GptOssForCausalLM(transformers.GptOssConfig(
            intermediate_size=h, head_dim=h // heads, num_local_experts=4, num_experts_per_tok=2, sliding_window=128,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **decoder_kw))
    model.config._attn_implementation = attn
    bad = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Dropout) and m.p != 0]
    assert not bad, f"dropout not 0 in {bad}"
    return model


def work(spec: dict, out: dict) -> None:
    """A worker: one (model, seq, mode, variant); the untimed reference has eager attention if it fits, else SDPA."""
    import torch

    torch.set_num_threads(spec["threads"])
    variant, mode = spec["variant"], spec["mode"]
    attn = "sdpa" if variant == "sdpa" else "eager"
    if variant == "reference" and estimate_bytes(dict(spec, variant="eager")) > (workers.mem_available() or 0) - GB:
        attn, spec["by"] = "sdpa", "the same model with attn_implementation='sdpa', not compiled"
    model = build_model(spec, attn)
    model.train(mode == "train")
    out["params"] = sum(p.numel() for p in model.parameters())
    ids = torch.randint(0, spec["vocab"], (spec["batch"], spec["seq"]),
                        generator=torch.Generator().manual_seed(1))
    fn = model
    if variant not in ("eager", "reference"):
        importlib.import_module("smxcompile")  # registers backend="smx"
        fn = torch.compile(model, backend="smx" if variant == "smx" else "inductor")

    def step():
        if mode == "infer":
            with torch.no_grad():
                return fn(input_ids=ids, use_cache=False).logits, None
        o = fn(input_ids=ids, labels=ids, use_cache=False)
        o.loss.backward()
        return o.logits.detach(), o.loss.detach()

    rounds = spec["rounds"] or (1 if spec["quick"] else 3 if spec["seq"] <= 2048 else 2)
    logits, loss = workers.timed_steps(step, 0 if variant == "reference" else rounds, out,
                                       lambda: model.zero_grad(set_to_none=True))
    if variant in ("inductor", "sdpa", "smx"):
        from torch._dynamo.utils import counters

        fired = out["inductor_fuse_attention"] = int(counters["inductor"].get("fuse_attention", 0))
        out["note"] = f"Inductor's own SDPA pattern fired {fired}x" if fired else ""
    checksum = torch.tensor(float(sum(p.detach().double().sum() for p in model.parameters())), dtype=torch.float64)
    got, tol = {"params": checksum, "logits": logits}, {"params": 0.0, "logits": spec["logits_rtol"]}
    if mode == "train":
        named = dict(model.named_parameters())
        got.update(loss=loss, grad=[named[n].grad for n in GRAD_PARAMS[spec["model"]] if n in named])
        tol.update(loss=spec["loss_rtol"], grad=spec["grad_rtol"])
    workers.conclude(spec, out, got, tol)


def estimate_bytes(spec: dict) -> int:
    """Rough peak RSS of a worker: libraries and compiled code, O(seq) activations, and for eager attention its
    O(seq^2) scores (about 3 at a time in inference, 3 per layer in training) and the (batch, 1, seq, seq) mask."""
    b, seq, train = spec["batch"], spec["seq"], spec["mode"] == "train"
    linear = b * seq * (spec["hidden"] * 24 * spec["layers"] + spec["vocab"] * 4) * 4 * (3 if train else 1)
    scores = b * spec["heads"] * seq * seq * 4
    quad = (3 * scores * (spec["layers"] if train else 1) + 2 * b * seq * seq * 4
            if spec["variant"] in ("eager", "inductor") else 0)
    return int(1.5 * GB + linear + quad)


def main(argv: list[str] | None = None) -> int:
    p = workers.parser(__doc__, VARIANTS, grad_rtol=1e-3, quick="smoke run: seq 128,256, 1 round")
    p.add_argument("--models", type=common.choice_list(MODELS), default=list(MODELS),
                   help="gpt2,llama,gpt_oss (default all; gpt_oss, with attention sinks, runs no sdpa variant)")
    p.add_argument("--seq", type=common.int_list, help="comma-separated sequence lengths (default 1024,4096)")
    p.add_argument("--modes", type=common.choice_list(MODES), default=list(MODES), help="infer,train (default both)")
    for name, (default, what) in SHAPE.items():
        p.add_argument(f"--{name}", type=positive_int, default=default,
                       help=what if default is None else f"{what} (default %(default)s)")
    p.add_argument("--logits-rtol", type=float, default=1e-4, help="max |logits - eager| / max |eager| (default "
                                                                   "%(default)s)")
    args = p.parse_args(argv)
    args.seq = args.seq or ([128, 256] if args.quick else [1024, 4096])
    args.kv_heads = args.kv_heads or max(1, args.heads // 2)
    if args.hidden % args.heads or args.heads % args.kv_heads:
        p.error("--hidden must be a multiple of --heads, and --heads a multiple of --kv-heads")
    if args._worker:
        return workers.run_worker(args._worker, work)
    shape = (f"batch {args.batch}, hidden {args.hidden}, {args.heads} heads (llama {args.kv_heads} kv), {args.layers} "
             f"layers, vocab {args.vocab}, fp32")
    settings = {k: getattr(args, k) for k in ("models", "seq", "modes", "quick", "batch", "layers", "hidden", "heads",
                                              "kv_heads", "vocab", "logits_rtol", "variants")}
    points = [({"model": m, "mode": mode, "seq": s}, [v for v in args.variants if m != "gpt_oss" or v != "sdpa"])
              for m in args.models for mode in args.modes for s in args.seq]
    result = workers.run(args, __file__, ("transformers",), settings, points, estimate_bytes)
    results, where = result["results"], f"{shape}, CPU ({result['env']['cpu']}, {args.threads} threads)"
    for mode in args.modes:
        what = "forward under no_grad" if mode == "infer" else "forward with labels + loss.backward()"
        rels = {"dlogits": "logits_rel"} | ({"dloss": "loss_rel", "dgrad": "grad_rel"} if mode == "train" else {})
        workers.table(f"{mode}: {what}; {where}; median of the timed steps; MB = 1e6 B above the pre-step RSS; (/ind) "
                      "= ratio to inductor", [r for r in results if r["mode"] == mode], ("model", "seq"), METRICS, rels,
                      args.markdown)
    return workers.finish(result, args, where, "seq", METRICS, lambda r: f"{r['model']} {r['variant']}", by="mode")


if __name__ == "__main__":
    sys.exit(main())
