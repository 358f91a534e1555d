"""``smx demo`` model: a randomly initialised GPT-2 with eager attention and no dropout, the demo's model
and batch for ``smx explain``, and the check that eager attention (one softmax per layer) is what runs."""

from __future__ import annotations

from typing import Any

from .data import EOT, load_corpus, make_batches, make_windows, split_windows, train_tokenizer
from .settings import Settings, build_parser, resolve_settings


def build_model(s: Settings, eos_id: int):
    """A randomly initialised ``GPT2LMHeadModel`` (seeded with ``s.seed``) with eager attention and no dropout."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=s.vocab_size,
        n_positions=max(s.seq_len, 128),
        n_embd=s.n_embd,
        n_layer=s.layers,
        n_head=s.heads,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(s.seed)
    model = GPT2LMHeadModel(config)
    model.config._attn_implementation = "eager"
    # loss_type stays unset, as in a user's stock model: the warning_once transformers logs inside forward
    # is a no-op in an smx trace (smxcompile.backends.tracing), so the LM head and the loss share a graph.
    return model


def demo_model_and_inputs(quick: bool = False, seed: int = 0) -> tuple[Any, tuple, dict[str, Any]]:
    """The demo's model (initial weights) and one real training batch, for ``smx explain``.

    Returns ``(model, args, kwargs)`` with ``kwargs = {"input_ids": batch, "labels": batch}``,
    built exactly as ``smx demo`` (or ``smx demo --quick``) builds them.
    """
    parser = build_parser()
    s = resolve_settings(parser.parse_args((["--quick"] if quick else []) + ["--seed", str(seed), "--steps", "1"]))
    docs = load_corpus(s.corpus)
    tokenizer = train_tokenizer(docs, s.vocab_size)
    train, _ = split_windows(make_windows(tokenizer, docs, s.seq_len))
    batch = make_batches(train, 1, s.batch_size, s.seed)[0]
    model = build_model(s, tokenizer.token_to_id(EOT))
    model.train()
    return model, (), {"input_ids": batch, "labels": batch}


def count_attention_calls(model, input_ids) -> dict[str, int]:
    """Run one eager forward and count softmax and scaled-dot-product-attention calls.

    Used to verify that eager attention (``matmul -> softmax -> matmul``, one
    softmax per layer) is what actually runs, not SDPA.
    """
    import torch
    import torch.nn.functional as F
    from torch.overrides import TorchFunctionMode

    softmaxes = {F.softmax, torch.softmax, torch.Tensor.softmax}
    counts = {"softmax": 0, "sdpa": 0}

    class _Count(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func in softmaxes:
                counts["softmax"] += 1
            elif func is F.scaled_dot_product_attention:
                counts["sdpa"] += 1
            return func(*args, **(kwargs or {}))

    with torch.no_grad(), _Count():
        model(input_ids=input_ids)
    return counts
