"""Train a small GPT-2 on Python's own documentation with ``torch.compile(backend="smx")``.

The short, copyable version of ``smx demo`` (which adds the eager/Inductor
comparison, timing, memory and saving). Runs in about a minute on 2 CPU cores:

    python examples/train_gpt2_pydoc.py
"""

import torch
from pydoc_data.topics import topics
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GPT2Config, GPT2LMHeadModel

import smxcompile

SEQ_LEN, BATCH, STEPS = 128, 8, 20

# 1. Real text and a BPE tokenizer trained on it (this text alone supports about 9K tokens;
#    `smx demo` adds the standard library's docstrings, where the BPE reaches about 27K tokens).
docs = [topics[k] for k in sorted(topics)]
tokenizer = Tokenizer(models.BPE())
tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tokenizer.decoder = decoders.ByteLevel()
tokenizer.train_from_iterator(docs, trainers.BpeTrainer(
    vocab_size=8192, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
eot = tokenizer.token_to_id("<|endoftext|>")
ids = [i for enc in tokenizer.encode_batch(docs) for i in enc.ids + [eot]]
windows = torch.tensor(ids[: len(ids) // SEQ_LEN * SEQ_LEN]).view(-1, SEQ_LEN)

# 2. A small GPT-2 with eager attention (matmul -> softmax -> matmul), so there is a softmax to rewrite.
config = GPT2Config(vocab_size=tokenizer.get_vocab_size(), n_positions=SEQ_LEN, n_embd=256, n_layer=4, n_head=4,
                    bos_token_id=eot, eos_token_id=eot)
config._attn_implementation = "eager"
torch.manual_seed(0)
model = GPT2LMHeadModel(config)
model.loss_type = "ForCausalLM"  # otherwise transformers warns inside forward, which splits the compiled graph

# 3. What will smx do with it?
batch = windows[:BATCH]
print(smxcompile.explain(model, input_ids=batch, labels=batch))

# 4. Compile and train.
compiled = torch.compile(model, backend="smx")
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
g = torch.Generator().manual_seed(0)
for step in range(STEPS):
    batch = windows[torch.randint(len(windows), (BATCH,), generator=g)]
    loss = compiled(input_ids=batch, labels=batch).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    print(f"step {step + 1:3d}  loss {loss.item():.4f}")
