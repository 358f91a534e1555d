"""Small models and checkpoints several test folders build: importable as ``model_builders`` (tests/ is on
``sys.path`` through tests/conftest.py), unlike a conftest, whose module name is shared by every folder's."""

import torch


def build_tiny_lm_checkpoint(out, seq_len: int = 32):
    """A tiny ``smx demo``-style run folder, ``OUT/checkpoint`` + ``OUT/results.json`` (about 3 s on 2 cores):
    a byte-level BPE tokenizer (vocabulary 512) trained on a slice of ``pydoc_data.topics``, a 2-layer
    GPT-2 (n_embd 32, 2 heads) trained 40 steps on windows of ``seq_len`` tokens of the ``topics`` corpus.
    Used by the tests of ``smx swap`` / ``smx eval`` and of benchmarks/eval_variants.py. Returns ``out``."""
    import json

    from smx_app import demo, lm

    docs = demo.load_corpus("topics")
    tok = demo.train_tokenizer(docs[:15], 512)
    s = demo.resolve_settings(demo.build_parser().parse_args(
        ["--quick", "--seq-len", str(seq_len), "--layers", "2", "--n-embd", "32", "--heads", "2", "--vocab-size", "512",
         "--batch-size", "8", "--corpus", "topics"]))
    model = demo.build_model(s, tok.token_to_id(demo.EOT))
    train, _ = demo.split_windows(demo.make_windows(tok, docs, seq_len))
    lm.train_steps(model, train, steps=40, batch_size=8, lr=3e-3, progress=False)
    demo.save_checkpoint(model, tok, out / "checkpoint")
    (out / "results.json").write_text(json.dumps({"settings": {"seq_len": seq_len, "corpus": "topics",
                                                               "batch_size": 8}}))
    return out


def tiny_gpt2(seq_len: int = 16, **config):
    """``(model, input_ids)``: a 2-layer transformers GPT-2 (vocabulary 97, n_embd 32, 4 heads, eager attention,
    no KV cache), seeded, in eval mode, and a (2, seq_len) batch of ids. ``config`` overrides GPT2Config fields.
    The model of the export tests (ONNX, MLIR)."""
    import pytest

    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(**{"vocab_size": 97, "n_positions": 32, "n_embd": 32, "n_layer": 2, "n_head": 4,
                                     "bos_token_id": 0, "eos_token_id": 0, "use_cache": False, **config})
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (2, seq_len), generator=torch.Generator().manual_seed(0))
    return transformers.GPT2LMHeadModel(cfg).eval(), ids
