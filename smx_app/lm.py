"""Causal language-model checkpoints for ``smx swap`` / ``smx eval`` (and benchmarks/eval_variants.py): load and
save (:func:`load_lm`, :func:`save_lm`; a swapped model through :func:`smxcompile.from_pretrained`), the demo's
windows rebuilt with the checkpoint's tokenizer (:func:`lm_data`), :func:`perplexity`, AdamW steps on every weight
or on the variant's parameters alone (:func:`train_steps`) and the swapped sites' :func:`attention_stats`.

A checkpoint is a folder ``transformers`` loads (``config.json``, ``model.safetensors``, ``tokenizer.json``), such
as ``smx demo``'s ``checkpoint/``. Heavy imports (transformers, tokenizers) happen inside the functions.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import shutil
import warnings
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

#: Default AdamW learning rate of ``train_steps(which="variant")`` (a few scalars per head: they move fast).
CALIBRATE_LR = 1e-2
#: Default AdamW learning rate of ``train_steps(which="all")`` (a pretrained model: 10x below the demo's 1e-3).
FINETUNE_LR = 1e-4
#: AdamW weight decay of the model's own weights (the demo's); the variants' parameters get none.
WEIGHT_DECAY = 0.01
#: Tokenizer files copied next to a saved model (those that exist).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt")

__all__ = ["LMData", "checkpoint_dir", "demo_settings", "is_swapped", "load_lm", "save_lm", "lm_data", "perplexity",
           "train_steps", "attention_stats", "variant_parameters", "CALIBRATE_LR", "FINETUNE_LR"]


# --------------------------------------------------------------------------- checkpoints


def checkpoint_dir(path: str | Path) -> Path:
    """The folder holding ``config.json``: ``path`` itself, or ``path/checkpoint`` (an ``smx demo --out`` folder).

    Raises:
        FileNotFoundError: ``path`` does not exist, or neither it nor ``path/checkpoint`` holds a config.json.
    """
    p = Path(path)
    if (p / "config.json").is_file():
        return p
    if (p / "checkpoint" / "config.json").is_file():
        return p / "checkpoint"
    if not p.exists():
        raise FileNotFoundError(f"checkpoint {str(p)!r} does not exist (expected a folder with config.json, "
                                "e.g. the checkpoint/ folder of `smx demo --out DIR`)")
    raise FileNotFoundError(f"{str(p)!r} is not a checkpoint: no config.json in it or in {str(p / 'checkpoint')!r}")


def is_swapped(folder: str | Path) -> bool:
    """Whether the checkpoint folder holds a swapped model (``smx_swap.json``, or ``config.json`` with ``smx_swap``)."""
    from smxcompile.edit.swap_io import read_manifest

    try:
        read_manifest(folder)
    except (FileNotFoundError, ValueError):
        return False
    return True


def load_lm(path: str | Path, device: str | torch.device = "cpu") -> nn.Module:
    """A causal LM from a checkpoint folder (or the ``smx demo --out`` folder above it), in eval mode on ``device``,
    with eager attention; a swapped one through ``smxcompile.from_pretrained(AutoModelForCausalLM, folder)``.

    Raises:
        FileNotFoundError: not a checkpoint (:func:`checkpoint_dir`), or no weights.
        smxcompile.variants.UnknownVariantError: a swapped model whose variant is not registered here.
    """
    from transformers import AutoModelForCausalLM

    from smxcompile.edit.swap_io import from_pretrained, quiet_transformers

    folder = checkpoint_dir(path)
    with quiet_transformers(progress_bars=False):   # no "Loading weights" bar, no warning about the variants' tensors
        if is_swapped(folder):
            model = from_pretrained(AutoModelForCausalLM, folder)
        else:
            model = AutoModelForCausalLM.from_pretrained(str(folder), attn_implementation="eager")
    return model.to(device).eval()


def save_lm(model: nn.Module, folder: str | Path, *, tokenizer_from: str | Path | None = None) -> Path:
    """``model.save_pretrained(folder)`` (a swapped model's ``config.json`` carries the manifest), plus the
    :data:`TOKENIZER_FILES` of the checkpoint folder ``tokenizer_from``; returns ``folder``.

    Raises:
        FileNotFoundError: ``tokenizer_from`` is given but holds no ``tokenizer.json``.
    """
    from smxcompile.edit.swap_io import quiet_transformers

    out = Path(folder)
    src = Path(tokenizer_from) if tokenizer_from is not None else None
    if src is not None and not (src / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{src / 'tokenizer.json'} not found")
    out.mkdir(parents=True, exist_ok=True)
    with quiet_transformers(progress_bars=False):
        model.save_pretrained(out, safe_serialization=True)
    if src is not None and src.resolve() != out.resolve():
        for name in TOKENIZER_FILES:
            if (src / name).is_file():
                shutil.copyfile(src / name, out / name)
    return out


def demo_settings(folder: str | Path) -> tuple[dict[str, Any], Path | None]:
    """The ``settings`` of the ``results.json`` describing a checkpoint (in its folder, as ``smx swap`` writes it, or
    in the parent, as ``smx demo`` does; only one with ``seq_len`` counts), and that file; ``({}, None)`` if none."""
    folder = Path(folder)
    for cand in (folder / "results.json", folder.parent / "results.json"):
        if cand.is_file():
            try:
                settings = json.loads(cand.read_text()).get("settings")
            except (OSError, ValueError, AttributeError):
                continue
            if isinstance(settings, dict) and settings.get("seq_len"):
                return dict(settings), cand
    return {}, None


@dataclasses.dataclass
class LMData:
    """The windows of a checkpoint's corpus, as ``smx demo`` cut them (tensors shared with a cache: do not modify).

    Attributes:
        train: int64 ``[N, T]`` training windows. heldout: int64 ``[M, T]``, every ``demo.EVAL_EVERY``-th window.
        settings: the ``results.json`` settings (``{}`` when none). results: that file, or None.
        guessed: what had to be guessed (also issued as a ``UserWarning``).
    """

    train: torch.Tensor
    heldout: torch.Tensor
    seq_len: int
    corpus: str
    tokenizer: Path
    vocab_size: int
    settings: dict[str, Any] = dataclasses.field(default_factory=dict)
    results: Path | None = None
    guessed: list[str] = dataclasses.field(default_factory=list)


_CORPUS_CACHE: dict[str, list[str]] = {}
_WINDOW_CACHE: dict[tuple[str, str, int], tuple[torch.Tensor, torch.Tensor]] = {}


def _n_positions(folder: Path) -> int | None:
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    for k in ("n_positions", "max_position_embeddings"):
        v = cfg.get(k)
        if isinstance(v, int) and v > 0:
            return v
    return None


def lm_data(checkpoint: str | Path, *, seq_len: int | None = None, corpus: str | None = None) -> LMData:
    """Rebuild a checkpoint's training and held-out windows with its own tokenizer.

    ``seq_len`` and ``corpus`` default to the settings of :func:`demo_settings`, else (a guess, warned) the model's
    ``n_positions`` and the demo's default corpus.

    Raises:
        FileNotFoundError: not a checkpoint, or no ``tokenizer.json`` in it.
        ValueError: an unknown corpus, a window length below 2 or above ``n_positions``, a corpus shorter than one
            window, or no held-out window.
    """
    from tokenizers import Tokenizer

    from . import demo

    folder = checkpoint_dir(checkpoint)
    settings, results = demo_settings(folder)
    n_pos = _n_positions(folder)
    guessed: list[str] = []
    if seq_len is None:
        seq_len = settings.get("seq_len")
        if seq_len is None:
            seq_len = n_pos or demo.DEFAULTS["seq_len"]
            guessed.append(f"no results.json with the demo's settings next to {folder}: window length {seq_len} "
                           "is a guess (the model's n_positions); pass seq_len= / --seq-len")
    if corpus is None:
        corpus = settings.get("corpus")
        if corpus is None:
            corpus = demo.DEFAULTS["corpus"]
            guessed.append(f"no results.json with the demo's settings next to {folder}: corpus {corpus!r} is a "
                           "guess (the demo's default); pass corpus= / --corpus")
    seq_len, corpus = int(seq_len), str(corpus)
    for g in guessed:
        warnings.warn(g, UserWarning, stacklevel=2)
    if corpus not in demo.CORPORA:
        raise ValueError(f"unknown corpus {corpus!r}; choose from {', '.join(demo.CORPORA)}")
    if seq_len < 2:
        raise ValueError(f"window length must be at least 2 (one next-token target), got {seq_len}")
    if n_pos is not None and seq_len > n_pos:
        raise ValueError(f"window length {seq_len} exceeds the model's n_positions {n_pos}")
    tok_file = folder / "tokenizer.json"
    if not tok_file.is_file():
        raise FileNotFoundError(f"{tok_file} not found: the windows are cut with the checkpoint's own tokenizer")
    tok = Tokenizer.from_file(str(tok_file))
    key = (hashlib.sha256(tok_file.read_bytes()).hexdigest(), corpus, seq_len)
    if key not in _WINDOW_CACHE:
        if corpus not in _CORPUS_CACHE:
            _CORPUS_CACHE[corpus] = demo.load_corpus(corpus)
        windows = demo.make_windows(tok, _CORPUS_CACHE[corpus], seq_len)
        train, held = demo.split_windows(windows)
        if held.shape[0] == 0:
            raise ValueError(f"corpus {corpus!r} gives {windows.shape[0]} windows of {seq_len} tokens: fewer than "
                             f"{demo.EVAL_EVERY}, so no held-out window")
        if len(_WINDOW_CACHE) >= 4:
            _WINDOW_CACHE.pop(next(iter(_WINDOW_CACHE)))
        _WINDOW_CACHE[key] = (train, held)
    train, held = _WINDOW_CACHE[key]
    return LMData(train=train, heldout=held, seq_len=seq_len, corpus=corpus, tokenizer=tok_file,
                  vocab_size=tok.get_vocab_size(), settings=settings, results=results, guessed=guessed)


# --------------------------------------------------------------------------- measuring and training


def _check_windows(windows: Any, name: str = "windows") -> torch.Tensor:
    if not isinstance(windows, torch.Tensor) or windows.dim() != 2 or windows.dtype not in (torch.int64, torch.int32):
        got = f"{windows.dtype} {tuple(windows.shape)}" if isinstance(windows, torch.Tensor) else type(windows).__name__
        raise ValueError(f"{name} must be an int64 tensor [windows, tokens], got {got}")
    if windows.shape[0] == 0:
        raise ValueError(f"{name} is empty")
    if windows.shape[1] < 2:
        raise ValueError(f"{name} must have at least 2 tokens per window (one next-token target)")
    return windows


def _check_batch_size(batch_size: int) -> int:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    return batch_size


def _device(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def _bar(items: Sequence[Any] | Iterable[Any], enabled: bool, desc: str, total: int | None = None) -> Iterator[Any]:
    if not enabled:
        return iter(items)
    from tqdm.auto import tqdm

    return iter(tqdm(items, desc=desc, total=total, leave=False, dynamic_ncols=True))


def _batches(windows: torch.Tensor, batch_size: int) -> list[torch.Tensor]:
    return [windows[i:i + batch_size] for i in range(0, windows.shape[0], batch_size)]


def perplexity(model: nn.Module, windows: torch.Tensor, *, batch_size: int = 8, progress: bool = True,
               desc: str = "perplexity") -> dict[str, float]:
    """Mean next-token loss and perplexity of a causal LM over int64 ``windows`` ``[M, T]`` (``T >= 2``).

    Each window gives ``T - 1`` predictions; the NLL is summed in fp64, so the result does not depend on
    ``batch_size`` beyond the model's own rounding. Runs under ``no_grad`` in eval mode (restored afterwards).

    Returns:
        ``{"loss": nats per token, "ppl": exp(loss), "tokens": M * (T - 1), "windows": M}``.

    Raises:
        ValueError: ``windows`` not a non-empty 2-D integer tensor with ``T >= 2``; a bad ``batch_size``.
    """
    windows = _check_windows(windows)
    _check_batch_size(batch_size)
    dev = _device(model)
    total, tokens = 0.0, 0
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            for b in _bar(_batches(windows, batch_size), progress, desc):
                b = b.to(dev, torch.long)
                logits = model(input_ids=b).logits[:, :-1]
                tgt = b[:, 1:]
                nll = F.cross_entropy(logits.double().reshape(-1, logits.shape[-1]), tgt.reshape(-1), reduction="sum")
                total += float(nll)
                tokens += tgt.numel()
    finally:
        model.train(was)
    loss = total / tokens
    return {"loss": loss, "ppl": math.exp(loss) if loss < 700 else math.inf, "tokens": tokens,
            "windows": int(windows.shape[0])}


def variant_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The learnable parameters of the variants swapped into ``model`` (under ``model.smx_swap``;
    ``[]`` for a model that was not swapped or whose variants have none)."""
    from smxcompile.edit.swap import swapper_of

    s = swapper_of(model)
    return list(s.parameters()) if s is not None else []


def train_steps(model: nn.Module, windows: torch.Tensor, *, steps: int, batch_size: int = 8, lr: float | None = None,
                which: str = "all", seed: int = 0, progress: bool = True, desc: str | None = None) -> list[float]:
    """Train ``model`` in place: ``steps`` AdamW steps of ``model(input_ids=b, labels=b).loss`` on batches of
    ``windows`` drawn as :func:`smx_app.demo.make_batches` draws them, in train mode (restored afterwards).

    Args:
        windows: int64 ``[N, T]`` training windows. steps: optimizer steps (0: ``[]``). batch_size: windows per step.
        lr: default :data:`CALIBRATE_LR` for ``which="variant"``, :data:`FINETUNE_LR` for ``"all"``.
        which: ``"all"``: every parameter that requires grad; ``"variant"``: only the swapped variants' learnable
            parameters, the rest frozen for the run (the calibration of a variant). Weight decay
            :data:`WEIGHT_DECAY` on the model's weights, none on the variants' parameters.
        seed: seed of the batch order. progress: a tqdm bar showing the loss. desc: its label.

    Returns:
        The loss of each step (before that step's update).

    Raises:
        ValueError: a bad ``which`` / ``steps`` / ``batch_size`` / ``lr`` / ``windows``; ``which="variant"`` on a
            model without learnable variant parameters; ``which="all"`` with nothing that requires grad.
        FloatingPointError: a NaN or infinite loss (the weights are those after the previous step).
    """
    from . import demo

    if which not in ("all", "variant"):
        raise ValueError(f"which must be 'all' or 'variant', got {which!r}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"steps must be an int >= 0, got {steps!r}")
    _check_batch_size(batch_size)
    windows = _check_windows(windows)
    if lr is None:
        lr = CALIBRATE_LR if which == "variant" else FINETUNE_LR
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not (math.isfinite(lr) and lr > 0):
        raise ValueError(f"lr must be a finite number > 0, got {lr!r}")
    variant_params = variant_parameters(model)
    variant_ids = {id(p) for p in variant_params}
    flags = [(p, p.requires_grad) for p in model.parameters()]
    groups = _param_groups(which, variant_params, [p for p, trainable in flags if trainable and id(p) not in variant_ids])
    if steps == 0:
        return []
    batches = demo.make_batches(windows, steps, batch_size, seed)
    was_training = model.training
    try:
        if which == "variant":
            for p, _ in flags:
                p.requires_grad_(id(p) in variant_ids)
        optimizer = torch.optim.AdamW(groups, lr=float(lr))
        model.train()
        return _optimizer_steps(model, optimizer, batches, lr=float(lr), progress=progress,
                                desc=desc or ("calibrate" if which == "variant" else "fine-tune"))
    finally:
        for p, trainable in flags:
            p.requires_grad_(trainable)
        for group in groups:
            for p in group["params"]:
                p.grad = None
        model.train(was_training)


def _param_groups(which: str, variant_params: list[nn.Parameter], own: list[nn.Parameter]) -> list[dict[str, Any]]:
    """AdamW groups for :func:`train_steps`: the model's own trainable weights with weight decay, the variants' without."""
    if which == "variant":
        if not variant_params:
            raise ValueError("which='variant': the model has no learnable variant parameter (it is not swapped, or "
                             "its variant has no learnable parameter, e.g. sparsemax): nothing to calibrate")
        return [{"params": variant_params, "weight_decay": 0.0}]
    variant_trainable = [p for p in variant_params if p.requires_grad]
    if not own and not variant_trainable:
        raise ValueError("which='all': no parameter of the model requires grad")
    return [g for g in ({"params": own, "weight_decay": WEIGHT_DECAY},
                        {"params": variant_trainable, "weight_decay": 0.0}) if g["params"]]


def _optimizer_steps(model: nn.Module, optimizer, batches: list[torch.Tensor], *, lr: float, progress: bool,
                     desc: str) -> list[float]:
    """One optimizer step per batch on the model's device; the losses, with a tqdm bar when ``progress``."""
    device = _device(model)
    losses: list[float] = []
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(batches), desc=desc, leave=False, dynamic_ncols=True)
    try:
        for i, batch in enumerate(batches):
            batch = batch.to(device, torch.long)
            loss = model(input_ids=batch, labels=batch).loss
            value = float(loss.detach())
            if not math.isfinite(value):
                raise FloatingPointError(f"the training loss is {value} at step {i + 1} of {len(batches)} (lr {lr:g}); "
                                         "try a smaller learning rate")
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(value)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{value:.4f}")
    finally:
        if bar is not None:
            bar.close()
    return losses


def attention_stats(model: nn.Module, windows: torch.Tensor, *, batch_size: int = 8, baseline: bool = False,
                    progress: bool = False) -> dict[str, float]:
    """Statistics of the attention weights at a swapped model's sites over ``windows`` (all sites together): the
    ``"all"`` entry of :meth:`smxcompile.edit.swap.Swapper.stats`, collected eagerly under ``no_grad``; with
    ``baseline=True``, of the model's original softmax at the same sites.

    Raises:
        ValueError: ``model`` is not swapped; bad ``windows`` / ``batch_size``.
        RuntimeError: no swapped site ran (e.g. the model was compiled: collecting is eager only).
    """
    import contextlib

    from smxcompile.edit.swap import swapper_of

    s = swapper_of(model)
    if s is None:
        raise ValueError("attention_stats: the model is not swapped (smxcompile.swap returns a model that is)")
    windows = _check_windows(windows)
    _check_batch_size(batch_size)
    dev = _device(model)
    was = model.training
    model.eval()
    try:
        with torch.no_grad(), (s.disabled() if baseline else contextlib.nullcontext()), s.collecting():
            for b in _bar(_batches(windows, batch_size), progress, "attention stats (original)" if baseline
                          else "attention stats"):
                model(input_ids=b.to(dev, torch.long))
            stats = s.stats()
    finally:
        model.train(was)
    if "all" not in stats:
        raise RuntimeError("attention_stats: no swapped site ran (collecting works on the eager model only)")
    return dict(stats["all"])
