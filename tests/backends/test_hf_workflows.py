"""Hugging Face workflows through the smx backend, as docs/huggingface.md documents them.

* ``Trainer``: ``TrainingArguments(torch_compile_backend="smx")`` is refused by accelerate's backend enum, so
  the recipe is ``model.compile(backend="smx")`` before ``Trainer(model=model, ...)``: the losses of a few
  steps match eager's, and the report shows the LM head's cut cross-entropy.
* ``generate``: a model compiled with dynamic shapes decodes with a KV cache and left padding and gives
  eager's tokens, with its attention sites rewritten.
"""

from __future__ import annotations

import pytest
import torch

from smxcompile.backends.smx import compiled_reports

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")


def _gpt2(vocab: int, layers: int = 1, **kw):
    cfg = transformers.GPT2Config(vocab_size=vocab, n_positions=64, n_embd=32, n_layer=layers, n_head=4,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
                                  pad_token_id=0, **kw)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)


class _Windows(torch.utils.data.Dataset):
    def __init__(self, vocab: int):
        self.ids = torch.randint(0, vocab, (8, 24), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _train_losses(tmp_path, compiled: bool) -> list[float]:
    model = _gpt2(8192)             # stock: loss_type unset, as users have it
    if compiled:
        model.compile(backend="smx")
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / ("smx" if compiled else "eager")), max_steps=2, per_device_train_batch_size=4,
        logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, learning_rate=1e-3, seed=0,
        dataloader_num_workers=0, disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_Windows(8192))
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def test_trainer_recipe_matches_eager_and_rewrites_the_loss(tmp_path):
    eager = _train_losses(tmp_path, compiled=False)
    torch._dynamo.reset()
    n0 = len(compiled_reports)
    smx = _train_losses(tmp_path, compiled=True)
    assert len(smx) == len(eager) == 2
    torch.testing.assert_close(smx, eager, rtol=1e-5, atol=1e-5)
    sites = [(s.kind, s.action) for r in compiled_reports[n0:] for s in r]
    assert ("linear_cross_entropy", "rewritten") in sites, sites


def test_generate_with_compiled_forward_gives_eager_tokens():
    model = _gpt2(512, attn_implementation="eager").eval()
    ids = torch.randint(1, 512, (2, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0                  # left padding
    ids[1, :3] = 0
    with torch.no_grad():
        want = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    torch._dynamo.reset()
    n0 = len(compiled_reports)
    model.compile(backend="smx", dynamic=True, options={"cpu": "rewrite"})   # short prompts: force the rewrite
    with torch.no_grad():
        got = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    assert torch.equal(got, want), (got.tolist(), want.tolist())
    att = [(s.action, s.reason) for r in compiled_reports[n0:] for s in r if s.kind == "attention"]
    assert att and all(a == "rewritten" for a, _ in att), att
