"""Real ``transformers`` architectures compiled with ``backend="smx"``: report, outputs and gradients.

Each model is built from a tiny config with random weights (nothing is downloaded), eager
attention (``attn_implementation="eager"``, so the attention softmax is a real ``F.softmax`` in
the graph rather than SDPA), every dropout probability 0, 2 layers, hidden size 64, batch 2.

For every architecture (GPT-2, Llama and Mistral with GQA, Qwen2, BERT, ViT):

* ``smxcompile.explain`` lists exactly one ``attention`` site per attention block (T5: three per
  layer), located in the model's own ``modeling_<arch>.py``, each ``rewritten`` to torch's
  ``scaled_dot_product_attention`` with what it absorbed (GPT-2's constant causal mask becomes ``causal``; Llama,
  Mistral and Qwen2 take K/V un-repeated: ``GQA``), and no softmax left over; with the attention
  rewrite off and the softmax forced, every block's softmax is ``rewritten`` to ``smx::softmax``.

For GPT-2, Llama, Mistral, Qwen2, BERT, ViT and T5:

* ``torch.compile(model, backend="smx", options={"cpu": "rewrite"})`` (the tests' 16 tokens are below
  the CPU policy's attention threshold) trains one step (forward + backward,
  train mode) with the loss, the logits and the gradient of every parameter matching eager fp32
  (tolerances below); the backend's own report agrees with ``explain``; Inductor's generated code
  calls torch's fused CPU attention kernel once per block forward and once backward.

For GPT-2, Llama, Mistral and BERT the same again with ``options={"cpu": "rewrite",
"attention": False, "attention_softmax": True}``, which forces every softmax onto ``smx::softmax`` on CPU: the backend report
says ``rewritten`` for every layer, the compiled step really calls the smx op once per layer
forward and once per layer backward, the results match eager, and the same compiled code with a
deliberately broken kernel (additive mask ignored) fails the comparison, which shows the
tolerances catch a wrong softmax.

For GPT-2, Llama, Mistral (causal LM, some labels -100) and BERT (masked LM: labels -100 except at
the masked positions) with a 5000-token vocabulary (at least ``CPU_MIN_VOCAB``, so the default CPU
policy rewrites it), the LM head + loss is cut cross-entropy: the backend report has exactly one
``linear_cross_entropy`` site, ``rewritten``, whose logits are also returned; the compiled training
step runs the fused CPU kernel once and matches eager (loss, logits, every gradient). Mistral's
step passes ``num_items_in_batch`` (transformers' gradient-accumulation normalisation: a sum over
the tokens divided by that count).

For Mixtral (8 experts under ``{"cpu": "rewrite"}``, training with the load-balancing loss; 64 experts
under the default options) and Qwen2-MoE (60 experts, top-4, ``norm_topk_prob`` on and off, default
options), every layer's router (``topk(softmax(logits))``, renormalized or not) is one ``softmax_topk``
site, ``rewritten``, located in the router's ``forward``; no ATen top-k is left in Inductor's code for
it; the logits (and for the training step the losses and every gradient, the routers' included) match
eager. The load-balancing loss's own softmax + top-k (its probabilities are also summed) is ``skipped``.

Tolerances (fp32 against eager fp32): the compiled results differ from eager only by Inductor's
re-association, measured at about 2e-7 relative (``||got - ref|| / ||ref||`` over all outputs, and
over all gradients). Each tensor must satisfy ``max|got - ref| <= ATOL + RTOL * max|ref|`` with
``RTOL = 1e-4`` and ``ATOL = 1e-6``: about 500x that noise. Ignoring the mask moves the gradients by
4e-3 (BERT, padding mask) to 0.7 (Llama, causal mask) relative, well outside it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import re
from typing import Any, Callable

import pytest
import torch

transformers = pytest.importorskip("transformers")

import smxcompile  # noqa: E402
from smxcompile.backends import smx as smx_backend_mod  # noqa: E402

from smxcompile.kernels.cross_entropy import ops as ce_kernels  # noqa: E402
from smxcompile.kernels.softmax import ops as smx_kernels  # noqa: E402

RTOL = 1e-4
ATOL = 1e-6
N_LAYERS = 2
HIDDEN = 64
HEADS = 4
VOCAB = 128
SEQ = 16
BATCH = 2

FORCE = {"cpu": "rewrite", "attention": False, "attention_softmax": True}
# SEQ=16 is far below the CPU policy's attention threshold (CPU_MIN_KEYS): the attention tests force it
ATTN = {"cpu": "rewrite"}


# --------------------------------------------------------------------------- model zoo


@dataclasses.dataclass
class Case:
    name: str
    arch: str                                  # transformers/models/<arch>/modeling_<arch>.py
    model: torch.nn.Module
    inputs: dict[str, torch.Tensor]
    has_mask: bool                             # the attention softmax gets an additive mask
    attention_detail: tuple[str, ...] = ()     # what the attention site's report detail must say
    attention_sites: int = N_LAYERS            # attention blocks (T5: encoder, decoder, cross per layer)

    def outputs(self, out: Any) -> dict[str, torch.Tensor]:
        """The tensors compared between eager and compiled (loss, MoE aux loss, logits / hidden states)."""
        got = {}
        for key in ("loss", "aux_loss", "logits", "last_hidden_state"):
            v = getattr(out, key, None)
            if isinstance(v, torch.Tensor):
                got[key] = v.detach()
        return got


def _token_inputs(padded: bool, vocab: int = VOCAB) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (BATCH, SEQ), generator=g)
    inputs = {"input_ids": ids, "labels": ids.clone()}
    if padded:  # right padding on the second row: a real padding mask on top of the causal one
        am = torch.ones(BATCH, SEQ, dtype=torch.long)
        am[1, SEQ - 5:] = 0
        inputs["attention_mask"] = am
        inputs["labels"][1, SEQ - 5:] = -100
    return inputs


def _gpt2(vocab: int = VOCAB) -> Case:
    cfg = transformers.GPT2Config(
        vocab_size=vocab, n_positions=SEQ * 2, n_embd=HIDDEN, n_layer=N_LAYERS, n_head=HEADS,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
        attn_implementation="eager",
    )
    model = transformers.GPT2LMHeadModel(cfg)
    # "GPT2LMHeadModel" names no loss in transformers' LOSS_MAPPING, so each call logs a
    # warning_once, which is a Dynamo graph break; name the loss it falls back to anyway.
    model.loss_type = "ForCausalLM"
    # no padding: transformers builds the causal mask from aranges only, which the rewrite recognises
    return Case("gpt2", "gpt2", model, _token_inputs(padded=False, vocab=vocab), has_mask=True,
                attention_detail=("causal", "scale=0.25"))


def _llama_like(name: str, config_cls: str, model_cls: str, **extra: Any) -> Callable[[], Case]:
    def make(vocab: int = VOCAB) -> Case:
        cfg = getattr(transformers, config_cls)(
            vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=N_LAYERS,
            num_attention_heads=HEADS, num_key_value_heads=HEADS // 2,   # GQA: 2 kv heads for 4 heads
            max_position_embeddings=SEQ * 4, attention_dropout=0.0, bos_token_id=0, eos_token_id=0,
            pad_token_id=0, attn_implementation="eager", **extra,
        )
        assert cfg.num_key_value_heads < cfg.num_attention_heads
        return Case(name, name, getattr(transformers, model_cls)(cfg), _token_inputs(padded=True, vocab=vocab),
                    has_mask=True, attention_detail=("mask", "scale=0.25", "GQA 2 q heads per kv head"))

    return make


def _bert(vocab: int = VOCAB) -> Case:
    cfg = transformers.BertConfig(
        vocab_size=vocab, hidden_size=HIDDEN, num_hidden_layers=N_LAYERS, num_attention_heads=HEADS,
        intermediate_size=2 * HIDDEN, max_position_embeddings=SEQ * 2, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, attn_implementation="eager",
    )
    return Case("bert", "bert", transformers.BertForMaskedLM(cfg), _token_inputs(padded=True, vocab=vocab),
                has_mask=True, attention_detail=("mask", "scale=0.25"))


def _vit(vocab: int = VOCAB) -> Case:   # (no vocabulary: an image classifier)
    cfg = transformers.ViTConfig(
        image_size=32, patch_size=8, num_channels=3, hidden_size=HIDDEN, num_hidden_layers=N_LAYERS,
        num_attention_heads=HEADS, intermediate_size=2 * HIDDEN, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, num_labels=10, attn_implementation="eager",
    )
    g = torch.Generator().manual_seed(1)
    inputs = {"pixel_values": torch.randn(BATCH, 3, 32, 32, generator=g), "labels": torch.tensor([1, 7])}
    return Case("vit", "vit", transformers.ViTForImageClassification(cfg), inputs, has_mask=False,
                attention_detail=("scale=0.25",))


def _t5(vocab: int = VOCAB) -> Case:
    # unscaled scores plus a learned relative-position bias (an additive mask with a gradient) and the
    # padding / causal masks; encoder self-attention, decoder self-attention and cross-attention per layer
    cfg = transformers.T5Config(
        vocab_size=vocab, d_model=HIDDEN, d_kv=HIDDEN // HEADS, d_ff=2 * HIDDEN, num_layers=N_LAYERS,
        num_decoder_layers=N_LAYERS, num_heads=HEADS, dropout_rate=0.0, attn_implementation="eager",
        decoder_start_token_id=0, pad_token_id=0,
    )
    inputs = _token_inputs(padded=True, vocab=vocab)
    return Case("t5", "t5", transformers.T5ForConditionalGeneration(cfg), inputs, has_mask=True,
                attention_detail=("masks",), attention_sites=3 * N_LAYERS)


FACTORIES: dict[str, Callable[[], Case]] = {
    "gpt2": _gpt2,
    "llama": _llama_like("llama", "LlamaConfig", "LlamaForCausalLM"),
    # sliding window shorter than the sequence: Mistral's banded causal mask really masks
    "mistral": _llama_like("mistral", "MistralConfig", "MistralForCausalLM", sliding_window=8),
    "qwen2": _llama_like("qwen2", "Qwen2Config", "Qwen2ForCausalLM"),
    "bert": _bert,
    "vit": _vit,
    "t5": _t5,
}
COMPILED = ["gpt2", "llama", "mistral", "qwen2", "bert", "vit", "t5"]
FORCED = ["gpt2", "llama", "mistral", "bert"]


def make_case(name: str, vocab: int = VOCAB) -> Case:
    torch.manual_seed(0)
    case = FACTORIES[name](vocab=vocab)
    case.model.train()
    assert case.model.config._attn_implementation == "eager"
    assert not any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in case.model.modules())
    return case


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    # Compile in-process: on 2 cores a pool of compile workers costs more than it saves.
    with torch._inductor.config.patch(compile_threads=1):
        torch._dynamo.reset()
        yield
        torch._dynamo.reset()


# --------------------------------------------------------------------------- helpers


def train_step(case: Case, fn: Callable[..., Any]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor | None]]:
    """One forward + backward of ``fn`` (the model or its compiled version): outputs and parameter grads."""
    case.model.zero_grad(set_to_none=True)
    out = fn(**case.inputs)
    out.loss.backward()
    outs = case.outputs(out)
    grads = {n: None if p.grad is None else p.grad.detach().clone() for n, p in case.model.named_parameters()}
    return outs, grads


def mismatches(got: dict[str, torch.Tensor | None], ref: dict[str, torch.Tensor | None]) -> list[str]:
    """Names of tensors outside ``|got - ref| <= ATOL + RTOL * max|ref|`` (with the error found)."""
    bad = []
    assert got.keys() == ref.keys()
    for k, r in ref.items():
        g = got[k]
        if r is None or g is None:
            if (r is None) != (g is None):
                bad.append(f"{k}: grad is None in only one of eager / compiled")
            continue
        assert g.shape == r.shape and g.dtype == r.dtype, k
        if not torch.isfinite(g).all():
            bad.append(f"{k}: non-finite values")
            continue
        err = (g - r).abs().max().item()
        bound = ATOL + RTOL * r.abs().max().item()
        if err > bound:
            bad.append(f"{k}: max|diff|={err:.3g} > {bound:.3g}")
    return bad


def global_rel_err(got: dict[str, torch.Tensor | None], ref: dict[str, torch.Tensor | None]) -> float:
    """``||got - ref|| / ||ref||`` over all the tensors together (gradients that are zero in exact
    arithmetic, such as the key bias's, do not blow it up as a per-tensor ratio would)."""
    num = den = 0.0
    for k, r in ref.items():
        if r is not None and got[k] is not None:
            num += (got[k].double() - r.double()).square().sum().item()
            den += r.double().square().sum().item()
    return (num / max(den, 1e-300)) ** 0.5


def softmax_sites(report: smxcompile.Report) -> list[smxcompile.Site]:
    return [s for s in report if s.kind in ("softmax", "log_softmax")]


def assert_attention_rewritten(case: Case, report: smxcompile.Report) -> None:
    """One ``attention`` site per attention block, each rewritten (to torch's SDPA, or ``smx::attention`` with a
    soft-cap), located in the model's attention code, saying what it absorbed; no softmax left over."""
    sites = [s for s in report if s.kind == "attention"]
    assert len(sites) == case.attention_sites, f"{case.name}: expected {case.attention_sites} attention sites:\n{report}"
    assert not softmax_sites(report), f"{case.name}: a softmax outside the attention sites:\n{report}"
    pat = re.compile(rf"models[/\\]{case.arch}[/\\]modeling_{case.arch}\.py:\d+$")
    for s in sites:
        op = "smx::attention" if "softcap" in s.detail else "scaled_dot_product_attention"   # softmax: torch's SDPA
        assert s.action == "rewritten" and s.op == op and not s.reason, s
        assert pat.search(s.location), f"{case.name}: site not located in the model's attention code: {s}"
        for want in case.attention_detail:
            assert want in s.detail, (want, s)
    assert len({(s.graph, s.node) for s in sites}) == case.attention_sites


def assert_one_attention_softmax_per_layer(case: Case, report: smxcompile.Report, *, actions: set[str]) -> None:
    sites = softmax_sites(report)
    assert len(sites) == case.attention_sites, f"{case.name}: expected {case.attention_sites} softmax sites, got\n{report}"
    pat = re.compile(rf"models[/\\]{case.arch}[/\\]modeling_{case.arch}\.py:\d+$")
    for s in sites:
        assert s.kind == "softmax", s
        assert pat.search(s.location), f"{case.name}: site not located in the model's attention code: {s}"
        assert s.action in actions, f"{case.name}: {s}\n{report}"
        if s.action == "rewritten":
            assert s.op == "smx::softmax" and not s.reason, s
        else:
            assert s.reason, f"{case.name}: a {s.action} site must say why: {s}"
    # the layers are different nodes of the graph(s), not one site listed twice
    assert len({(s.graph, s.node) for s in sites}) == case.attention_sites


def compile_and_step(case: Case, options: dict | None) -> tuple[Any, smxcompile.Report]:
    """Compile with ``backend="smx"``, run one training step; the step's results and the backend's report."""
    n0 = len(smx_backend_mod.compiled_reports)
    compiled = torch.compile(case.model, backend="smx", options=options)
    result = train_step(case, compiled)
    report = smxcompile.Report()
    for r in smx_backend_mod.compiled_reports[n0:]:
        report.extend(r)
    return (compiled, result), report


@contextlib.contextmanager
def smx_cpu_kernel_spy(drop_mask: bool = False):
    """Count the runtime calls of the smx ops' CPU implementations (forward and backward).

    The compiled code calls ``smx::softmax`` as an opaque kernel whose body looks up
    ``smxcompile.kernels.softmax.ops._forward_impl`` / ``_backward_impl`` at call time, so wrapping
    those sees exactly the calls the compiled step makes, without recompiling. (A
    ``TorchDispatchMode`` does not: Dynamo does not run compiled code under an active mode.)
    With ``drop_mask=True`` the forward ignores its additive mask: a deliberately wrong softmax
    (attention leaks past the causal / padding mask), to check that the tolerances catch it.
    """
    calls = {"forward": 0, "backward": 0}
    fwd, bwd = smx_kernels._forward_impl, smx_kernels._backward_impl

    def f(x, dim, scale, softcap, mask, dtype, return_lse, log):
        calls["forward"] += 1
        return fwd(x, dim, scale, softcap, None if drop_mask else mask, dtype, return_lse, log)

    def b(*a, **k):
        calls["backward"] += 1
        return bwd(*a, **k)

    smx_kernels._forward_impl, smx_kernels._backward_impl = f, b
    try:
        yield calls
    finally:
        smx_kernels._forward_impl, smx_kernels._backward_impl = fwd, bwd


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize("name", list(FACTORIES))
def test_explain_lists_one_attention_per_layer(name):
    case = make_case(name)
    report = smxcompile.explain(case.model, **case.inputs, options=ATTN)
    assert_attention_rewritten(case, report)
    # the report is JSON-ready and printable
    d = report.to_dict()
    assert d["summary"]["attention"] == {"rewritten": case.attention_sites}
    assert "scaled_dot_product_attention" in str(report) or "smx::attention" in str(report)
    # with the attention rewrite off and the softmax forced, every block's softmax becomes smx::softmax
    forced = smxcompile.explain(case.model, **case.inputs, options=FORCE)
    assert_one_attention_softmax_per_layer(case, forced, actions={"rewritten"})
    for s in softmax_sites(forced):
        if case.name != "t5":   # T5 does not scale its scores
            assert "scale=" in s.detail, s   # 1/sqrt(head_dim) is taken into the op
        assert ("mask" in s.detail) == case.has_mask, s


def fused_attention_calls(code: list[str]) -> tuple[int, int]:
    """Calls of torch's fused CPU attention kernel (forward, backward) in Inductor's generated code."""
    src = "\n".join(code)
    fwd = len(re.findall(r"_scaled_dot_product_flash_attention_for_cpu\.default\(", src))
    bwd = len(re.findall(r"_scaled_dot_product_flash_attention_for_cpu_backward\.default\(", src))
    return fwd, bwd


@pytest.mark.slow
@pytest.mark.parametrize("name", COMPILED)
def test_compiled_training_matches_eager(name):
    from torch._inductor.utils import run_and_get_code

    case = make_case(name)
    planned = smxcompile.explain(case.model, **case.inputs, options=ATTN)
    ref_out, ref_grads = train_step(case, case.model)
    ((_, (out, grads)), report), code = run_and_get_code(lambda: compile_and_step(case, ATTN))
    assert_attention_rewritten(case, report)
    assert [(s.kind, s.action) for s in report] == [(s.kind, s.action) for s in planned], (
        f"backend and explain disagree:\n{report}\n{planned}"
    )
    assert not mismatches(out, ref_out), mismatches(out, ref_out)
    assert not mismatches(grads, ref_grads), mismatches(grads, ref_grads)
    assert sum(g is not None for g in grads.values()) > 0
    # the rewrite really reached Inductor: one fused attention kernel per block, forward and backward
    # (T5's position bias needs its gradient, which torch's CPU flash kernel does not give: math path)
    if name != "t5":
        assert fused_attention_calls(code) == (case.attention_sites, case.attention_sites), fused_attention_calls(code)


@pytest.mark.slow
@pytest.mark.parametrize("name", FORCED)
def test_forced_rewrite_matches_eager(name):
    case = make_case(name)
    ref_out, ref_grads = train_step(case, case.model)
    (compiled, (out, grads)), report = compile_and_step(case, FORCE)
    assert_one_attention_softmax_per_layer(case, report, actions={"rewritten"})
    assert not mismatches(out, ref_out), mismatches(out, ref_out)
    assert not mismatches(grads, ref_grads), mismatches(grads, ref_grads)

    # the compiled step really runs smx::softmax, once per layer forward and once per layer backward
    with smx_cpu_kernel_spy() as calls:
        out2, grads2 = train_step(case, compiled)
    assert calls == {"forward": N_LAYERS, "backward": N_LAYERS}, calls
    assert not mismatches(out2, ref_out) and not mismatches(grads2, ref_grads)

    # the tolerance is tight enough to catch a wrong softmax: the same compiled code with a
    # kernel that drops the attention mask fails the comparison
    if case.has_mask:
        with smx_cpu_kernel_spy(drop_mask=True) as calls:
            bad_out, bad_grads = train_step(case, compiled)
        assert calls["forward"] == N_LAYERS
        assert mismatches(bad_out, ref_out), "a softmax that ignores the mask went unnoticed"
        assert mismatches(bad_grads, ref_grads)
        assert global_rel_err(bad_grads, ref_grads) > 10 * RTOL


# --------------------------------------------------------------------------- the LM loss: cut cross-entropy

CE_VOCAB = 5000   # >= CPU_MIN_VOCAB: the default CPU policy rewrites the LM head + loss
MASK_ID = 4       # BERT's [MASK] in these tests (any id < CE_VOCAB)



def make_ce_case(name: str) -> Case:
    case = make_case(name, vocab=CE_VOCAB)
    ids, labels = case.inputs["input_ids"], case.inputs["labels"]
    if name == "bert":
        # masked LM: a few masked positions carry the labels, every other position is ignored
        labels.fill_(-100)
        for b, t in ((0, 1), (0, 6), (0, 11), (1, 3), (1, 8)):
            labels[b, t] = ids[b, t]
            ids[b, t] = MASK_ID
    else:
        labels[0, :3] = -100   # ignored prompt tokens (Llama / Mistral also ignore the padding)
    return case


@contextlib.contextmanager
def fused_ce_spy():
    """Count runtime calls of the fused CPU linear cross-entropy (``fused_forward``: loss and gradients
    in one pass over the logits chunks), which the compiled step reaches through ``smx::linear_ce_loss``."""
    calls = {"fused_forward": 0}
    real = ce_kernels.fused_forward

    def spy(*a, **k):
        calls["fused_forward"] += 1
        return real(*a, **k)

    ce_kernels.fused_forward = spy
    try:
        yield calls
    finally:
        ce_kernels.fused_forward = real


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2", "llama", "mistral", "bert"])
def test_lm_loss_is_cut_cross_entropy(name):
    case = make_ce_case(name)
    n_valid = int((case.inputs["labels"] != -100).sum())
    if name == "mistral":
        # transformers' gradient accumulation: the loss is a sum over the tokens / this count
        case.inputs["num_items_in_batch"] = torch.tensor(n_valid + 3)
    ref_out, ref_grads = train_step(case, case.model)
    with fused_ce_spy() as calls:
        (_, (out, grads)), report = compile_and_step(case, None)
    ce = [s for s in report if s.kind in ("linear_cross_entropy", "cross_entropy")]
    assert [(s.kind, s.action) for s in ce] == [("linear_cross_entropy", "rewritten")], str(report)
    site = ce[0]
    assert site.op == "smx::linear_cross_entropy" and not site.reason
    # the model returns its logits: the op writes them (fp32 here) and the loss reads the same chunks
    assert f"logits {BATCH}x{SEQ}x{CE_VOCAB} float32 are also a graph output" in site.detail, site
    assert ("reduction=sum" if name == "mistral" else "reduction=mean") in site.detail, site
    assert calls == {"fused_forward": 1}, calls   # one training step, one pass over the logits chunks
    assert set(out) == {"loss", "logits"} and out["logits"].shape == (BATCH, SEQ, CE_VOCAB)
    assert not mismatches(out, ref_out), mismatches(out, ref_out)
    assert not mismatches(grads, ref_grads), mismatches(grads, ref_grads)
    assert sum(g is not None for g in grads.values()) > 0
    if name == "mistral":
        # really normalised by num_items_in_batch, not by the number of valid tokens
        logits = ref_out["logits"][:, :-1].reshape(-1, CE_VOCAB)
        labels = case.inputs["labels"][:, 1:].reshape(-1)
        want = torch.nn.functional.cross_entropy(logits, labels, reduction="sum") / (n_valid + 3)
        torch.testing.assert_close(out["loss"], want, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- MoE routers: softmax + top-k
#
# Mixtral's router is ``topk(softmax(logits.float()), k)`` renormalized in place by its sum; Qwen2-MoE's is
# ``topk(softmax(logits, dtype=float), k)``, renormalized only with ``norm_topk_prob``. Each layer's router
# must be one ``softmax_topk`` site, rewritten (on CPU to the op's two-pass decomposition, which Inductor
# compiles into loops: no ATen top-k call is left in the generated code), and the model must match eager.
# Mixtral's load-balancing loss (``output_router_logits``) has a softmax + top-k of its own whose
# probabilities are also summed: a near-miss the pass must leave alone. The default CPU policy keeps 8-expert routers (ATen's top-k of such
# short rows is as fast): they are forced with ``{"cpu": "rewrite"}``; 60- and 64-expert routers are
# rewritten under the default options.

topk_pass = importlib.import_module("smxcompile.passes.softmax_topk")


def _moe_case(name: str, arch: str, config_cls: str, model_cls: str, router_cls: str, **extra: Any) -> Case:
    torch.manual_seed(0)
    cfg = getattr(transformers, config_cls)(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=N_LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=HEADS // 2, max_position_embeddings=SEQ * 4,
        attention_dropout=0.0, bos_token_id=0, eos_token_id=0, pad_token_id=0, attn_implementation="eager",
        **extra,
    )
    model = getattr(transformers, model_cls)(cfg)
    model.train()
    routers = [m for m in model.modules() if type(m).__name__ == router_cls]
    assert len(routers) == N_LAYERS
    for r in routers:   # random router weights (no ties among the logits: eager and ours pick the same experts)
        assert r.weight.std() > 0
    case = Case(name, arch, model, _token_inputs(padded=True), has_mask=True)
    case.router_cls = getattr(importlib.import_module(f"transformers.models.{arch}.modeling_{arch}"), router_cls)
    return case


def _mixtral(experts: int, aux_loss: bool = False) -> Case:
    return _moe_case(f"mixtral-{experts}", "mixtral", "MixtralConfig", "MixtralForCausalLM", "MixtralTopKRouter",
                     num_local_experts=experts, num_experts_per_tok=2, router_jitter_noise=0.0,
                     output_router_logits=aux_loss)


def _qwen2_moe(norm_topk_prob: bool) -> Case:
    # Qwen1.5-MoE-A2.7B's router shape: 60 experts, top-4 (norm_topk_prob False there; True in Qwen3-MoE)
    return _moe_case(f"qwen2_moe-{norm_topk_prob}", "qwen2_moe", "Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                     "Qwen2MoeTopKRouter", num_experts=60, num_experts_per_tok=4, norm_topk_prob=norm_topk_prob,
                     moe_intermediate_size=HIDDEN // 2, shared_expert_intermediate_size=HIDDEN,
                     decoder_sparse_step=1)


def router_sites(case: Case, report: smxcompile.Report) -> tuple[list[smxcompile.Site], list[smxcompile.Site]]:
    """The ``softmax_topk`` sites inside the router's ``forward`` and the other ``softmax_topk`` sites."""
    import inspect

    lines, start = inspect.getsourcelines(case.router_cls.forward)
    pat = re.compile(rf"models[/\\]{case.arch}[/\\]modeling_{case.arch}\.py:(\d+)$")
    inside, other = [], []
    for s in report:
        if s.kind != "softmax_topk":
            continue
        m = pat.search(s.location)
        (inside if m and start <= int(m.group(1)) < start + len(lines) else other).append(s)
    return inside, other


def assert_routers_rewritten(case: Case, report: smxcompile.Report, k: int, renormalized: bool) -> None:
    routers, other = router_sites(case, report)
    assert len(routers) == N_LAYERS, f"{case.name}: expected one router site per layer:\n{report}"
    assert len({(s.graph, s.node) for s in routers}) == N_LAYERS
    for s in routers:
        assert s.action == "rewritten" and not s.reason, s
        assert s.op == "smx softmax_topk (CPU two-pass)", s
        assert s.detail.startswith("topk(softmax)") and f"k={k}" in s.detail, s
        assert ("renormalized" in s.detail) == renormalized, s
    # the router's softmax is taken into the site: no softmax site of its own
    assert not [s for s in softmax_sites(report) if s.location in {r.location for r in routers}], str(report)


def topk_calls(code: list[str]) -> int:
    """ATen top-k calls in Inductor's generated code (a router the rewrite missed would keep one)."""
    return len(re.findall(r"aten\.topk\.default\(", "\n".join(code)))


@pytest.mark.slow
def test_mixtral_routers_rewritten_training():
    """Mixtral, 8 experts, top-2, with the load-balancing loss: both routers rewritten (CPU policy forced),
    a training step matches eager (loss, aux loss, logits, every gradient, the routers' included)."""
    from torch._inductor.utils import run_and_get_code

    case = _mixtral(8, aux_loss=True)
    ref_out, ref_grads = train_step(case, case.model)
    assert "aux_loss" in ref_out
    ((_, (out, grads)), report), code = run_and_get_code(lambda: compile_and_step(case, ATTN))
    assert_routers_rewritten(case, report, k=2, renormalized=True)
    # the load-balancing loss sums the same probabilities it takes the top-k of: not fused
    _, aux = router_sites(case, report)
    assert len(aux) == N_LAYERS, str(report)   # one per layer's logits in load_balancing_loss_func
    assert all(s.action == "skipped" and "also used elsewhere" in s.reason for s in aux), str(report)
    assert topk_calls(code) == len(aux), topk_calls(code)   # only the aux loss's top-k is left
    assert set(out) == {"loss", "aux_loss", "logits"}
    assert not mismatches(out, ref_out), mismatches(out, ref_out)
    assert not mismatches(grads, ref_grads), mismatches(grads, ref_grads)
    for i in range(N_LAYERS):
        g = grads[f"model.layers.{i}.mlp.gate.weight"]
        assert g is not None and g.abs().max() > 0


def compiled_inference(case: Case, options: dict | None) -> tuple[torch.Tensor, torch.Tensor, smxcompile.Report, int]:
    """Eval-mode logits of eager and of ``torch.compile(backend="smx")`` (no grad), the backend's report
    and the number of ATen top-k calls in Inductor's generated code."""
    from torch._inductor.utils import run_and_get_code

    case.model.eval()
    inputs = {k: v for k, v in case.inputs.items() if k != "labels"}
    with torch.no_grad():
        ref = case.model(**inputs).logits
        n0 = len(smx_backend_mod.compiled_reports)
        out, code = run_and_get_code(lambda: torch.compile(case.model, backend="smx", options=options)(**inputs))
    report = smxcompile.Report()
    for r in smx_backend_mod.compiled_reports[n0:]:
        report.extend(r)
    return out.logits, ref, report, topk_calls(code)


@pytest.mark.slow
def test_mixtral_64_experts_default_options():
    """64 experts: the default CPU policy rewrites the routers (same selection path as 8 experts, whose
    backward the training test above checks); the logits match eager."""
    case = _mixtral(64)
    got, ref, report, n_topk = compiled_inference(case, None)
    assert_routers_rewritten(case, report, k=2, renormalized=True)
    assert n_topk == 0, n_topk
    assert not mismatches({"logits": got}, {"logits": ref}), mismatches({"logits": got}, {"logits": ref})


@pytest.mark.slow
@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_qwen2_moe_routers_rewritten(norm_topk_prob):
    """Qwen2-MoE (60 experts, top-4, shared expert), default options: routers rewritten, renormalized
    exactly when ``norm_topk_prob``; the logits match eager."""
    case = _qwen2_moe(norm_topk_prob)
    got, ref, report, n_topk = compiled_inference(case, None)
    assert_routers_rewritten(case, report, k=4, renormalized=norm_topk_prob)
    assert n_topk == 0, n_topk
    assert not mismatches({"logits": got}, {"logits": ref}), mismatches({"logits": got}, {"logits": ref})
