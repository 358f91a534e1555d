"""The wider zoo of transformers architectures (eager attention): every attention block is rewritten, with and
without a padding ``attention_mask``, and the rewritten graph computes the model's outputs.

Lean on purpose: the graph Dynamo hands the backend is rewritten by :class:`SmxPass` and run as it is (no
Inductor compile), forward only; compiled training of the core architectures is in test_real_models.py.
"""

from __future__ import annotations

import pytest
import torch

from smxcompile.options import SmxOptions
from smxcompile.passes import SmxPass

transformers = pytest.importorskip("transformers")

B, L, VOCAB = 2, 12, 96
SMALL = dict(hidden_size=32, num_attention_heads=4, intermediate_size=64, num_hidden_layers=2, vocab_size=VOCAB,
             attention_dropout=0.0)


def _decoder(config_cls, model_cls, **extra):
    def build():
        cfg = getattr(transformers, config_cls)(**{**SMALL, **extra})
        return getattr(transformers, model_cls)(cfg), "tokens", 2     # one attention block per layer
    return build


def _gpt_neox():
    cfg = transformers.GPTNeoXConfig(hidden_size=32, num_attention_heads=4, intermediate_size=64,
                                     num_hidden_layers=2, vocab_size=VOCAB, attention_dropout=0.0, hidden_dropout=0.0)
    return transformers.GPTNeoXForCausalLM(cfg), "tokens", 2


def _distilbert():
    cfg = transformers.DistilBertConfig(dim=32, n_heads=4, hidden_dim=64, n_layers=2, vocab_size=VOCAB,
                                        dropout=0.0, attention_dropout=0.0)
    return transformers.DistilBertModel(cfg), "tokens", 2


def _roberta():
    cfg = transformers.RobertaConfig(**{k: v for k, v in SMALL.items() if k != "attention_dropout"},
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                     max_position_embeddings=40)
    return transformers.RobertaModel(cfg), "tokens", 2


def _bart():
    cfg = transformers.BartConfig(d_model=32, encoder_attention_heads=4, decoder_attention_heads=4,
                                  encoder_ffn_dim=64, decoder_ffn_dim=64, encoder_layers=1, decoder_layers=1,
                                  vocab_size=VOCAB, dropout=0.0, attention_dropout=0.0, max_position_embeddings=40)
    return transformers.BartModel(cfg), "seq2seq", 3      # one layer each: encoder self, decoder self, cross


def _whisper():
    cfg = transformers.WhisperConfig(d_model=32, encoder_attention_heads=4, decoder_attention_heads=4,
                                     encoder_ffn_dim=64, decoder_ffn_dim=64, encoder_layers=1, decoder_layers=1,
                                     vocab_size=VOCAB, num_mel_bins=8, max_source_positions=8,
                                     max_target_positions=16, dropout=0.0, attention_dropout=0.0, pad_token_id=0,
                                     bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)
    return transformers.WhisperModel(cfg), "audio", 3


def _clip_text():
    cfg = transformers.CLIPTextConfig(hidden_size=32, num_attention_heads=4, intermediate_size=64,
                                      num_hidden_layers=2, vocab_size=VOCAB, max_position_embeddings=40)
    return transformers.CLIPTextModel(cfg), "tokens", 2


ZOO = {
    "gemma2": _decoder("Gemma2Config", "Gemma2ForCausalLM", head_dim=8, num_key_value_heads=2,
                       sliding_window=6, attn_logit_softcapping=50.0, final_logit_softcapping=None),
    "mixtral": _decoder("MixtralConfig", "MixtralForCausalLM", num_key_value_heads=2, num_local_experts=4,
                        num_experts_per_tok=2),
    # attention sinks: a learned logit per head appended to the scores (sliding and full layers alternate)
    "gpt_oss": _decoder("GptOssConfig", "GptOssForCausalLM", head_dim=8, num_key_value_heads=2, num_local_experts=4,
                        num_experts_per_tok=2, sliding_window=6),
    "phi": _decoder("PhiConfig", "PhiForCausalLM", resid_pdrop=0.0, embd_pdrop=0.0),
    "gpt_neox": _gpt_neox,
    "distilbert": _distilbert,
    "roberta": _roberta,
    "bart": _bart,
    "whisper": _whisper,
    "clip_text": _clip_text,
}


def _inputs(kind: str, padded: bool):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB, (B, L), generator=g)
    mask = torch.ones(B, L, dtype=torch.long)
    mask[1, L - 4:] = 0
    if kind == "audio":
        feats = torch.randn(B, 8, 16, generator=g)
        kw = {"input_features": feats, "decoder_input_ids": ids[:, :6]}
        if padded:
            kw["decoder_attention_mask"] = mask[:, :6]
        return kw
    kw = {"input_ids": ids}
    if kind == "seq2seq":
        kw["decoder_input_ids"] = ids[:, :8]
    if padded:
        kw["attention_mask"] = mask
    return kw


def _first_tensor(out):
    if isinstance(out, torch.Tensor):
        return out
    for key in ("logits", "last_hidden_state"):
        v = getattr(out, key, None)
        if isinstance(v, torch.Tensor):
            return v
    raise AssertionError(type(out))


@pytest.mark.parametrize("padded", [False, True], ids=["no_mask", "padding_mask"])
@pytest.mark.parametrize("name", list(ZOO))
def test_every_attention_block_rewritten(name, padded):
    torch.manual_seed(0)
    model, kind, n_sites = ZOO[name]()
    model.config._attn_implementation = "eager"
    for sub in ("encoder", "decoder", "text_config"):
        c = getattr(model.config, sub, None)
        if c is not None and hasattr(c, "_attn_implementation"):
            c._attn_implementation = "eager"
    model.eval()
    kw = _inputs(kind, padded)
    keys = list(kw)

    def fn(*args):
        return _first_tensor(model(**dict(zip(keys, args))))

    captured = []

    def capture(gm, example_inputs):
        captured.append((gm, list(example_inputs)))
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        want = fn(*kw.values())
        torch.compile(fn, backend=capture, fullgraph=True, dynamic=False)(*kw.values())
    assert len(captured) == 1
    gm, inputs = captured[0]
    p = SmxPass(SmxOptions.from_mapping({"cpu": "rewrite"}))
    p(gm.graph)
    gm.recompile()
    att = [s for s in p.report if s.kind == "attention"]
    assert len(att) == n_sites, str(p.report)
    assert all(s.action == "rewritten" for s in att), str(p.report)
    with torch.no_grad():
        got = gm(*inputs)[0]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
