"""``smx demo`` data: real text shipped with Python (``pydoc_data.topics`` and the standard library's
docstrings), a byte-level BPE tokenizer trained on it, fixed windows of tokens, the held-out split and
the seeded batch order. ``smx swap`` / ``smx eval`` rebuild a checkpoint's windows with the same
functions (:func:`smx_app.lm.lm_data`)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

EOT = "<|endoftext|>"
EVAL_EVERY = 20  # every 20th window is held out for evaluation

CORPORA = ("topics", "topics+docstrings")


def load_corpus(corpus: str = "topics+docstrings") -> list[str]:
    """Real English text shipped with Python, as a list of documents (deterministic order).

    ``topics``: the 79 pages of ``pydoc_data.topics`` (the language reference
    pages ``help()`` shows). ``topics+docstrings`` adds every module, class and
    function docstring (longer than 40 characters) of the standard library's
    ``.py`` sources, skipping test suites; when the sources are not installed it
    silently falls back to the topics.
    """
    from pydoc_data.topics import topics

    docs = [topics[k] for k in sorted(topics)]
    if corpus == "topics":
        return docs
    if corpus != "topics+docstrings":
        raise ValueError(f"unknown corpus {corpus!r}; choose from {CORPORA}")
    return docs + _stdlib_docstrings()


def _stdlib_docstrings(min_chars: int = 40) -> list[str]:
    import ast
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "lib2to3"}
    out: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip)
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            try:
                tree = ast.parse(Path(dirpath, name).read_text(encoding="utf-8"))
            except (SyntaxError, UnicodeDecodeError, OSError, ValueError):
                continue
            for node in ast.walk(tree):
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    doc = ast.get_docstring(node)
                    if doc and len(doc) > min_chars:
                        out.append(doc)
    return out


def train_tokenizer(docs: Sequence[str], vocab_size: int):
    """Train a byte-level BPE tokenizer (GPT-2 style, special token ``<|endoftext|>``) on ``docs``.

    Returns a ``tokenizers.Tokenizer``. Its vocabulary is ``vocab_size`` unless the
    text runs out of pairs to merge first (``pydoc_data.topics`` alone stops near 9.2K).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer, length=len(docs))
    return tok


def make_windows(tokenizer, docs: Sequence[str], seq_len: int):
    """Tokenize ``docs`` (joined by ``<|endoftext|>``) into a ``[N, seq_len]`` int64 tensor of windows.

    The model is trained the Hugging Face way, ``model(input_ids=w, labels=w)``:
    it shifts the labels itself, so a window of ``seq_len`` tokens gives
    ``seq_len - 1`` next-token targets. The ragged tail is dropped.
    """
    import torch

    eot = tokenizer.token_to_id(EOT)
    ids: list[int] = []
    for enc in tokenizer.encode_batch(list(docs)):
        ids.extend(enc.ids)
        ids.append(eot)
    n = len(ids) // seq_len
    if n == 0:
        raise ValueError(f"corpus of {len(ids)} tokens is shorter than one window of {seq_len}")
    return torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len)


def split_windows(windows, every: int = EVAL_EVERY):
    """Hold out every ``every``-th window for evaluation: returns ``(train, eval)``."""
    import torch

    idx = torch.arange(windows.shape[0])
    held = idx % every == every - 1
    return windows[~held], windows[held]


def make_batches(train, steps: int, batch_size: int, seed: int) -> list:
    """``steps`` batches of ``batch_size`` windows in a fixed, seeded order (epochs reshuffle)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    order: list[int] = []
    while len(order) < steps * batch_size:
        order.extend(torch.randperm(train.shape[0], generator=g).tolist())
    return [train[order[i * batch_size:(i + 1) * batch_size]] for i in range(steps)]
