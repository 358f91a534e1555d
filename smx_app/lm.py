"""Language-model checkpoints: load / save, evaluation data, perplexity, calibration of variant parameters by
short fine-tuning, attention statistics. What ``smx swap`` / ``smx eval`` (and benchmarks/eval_variants.py) run
on a (swapped) causal language model.

A checkpoint is a folder that ``transformers`` loads (``config.json`` + ``model.safetensors`` +
``tokenizer.json``), e.g. the ``checkpoint/`` folder ``smx demo`` saves, or the folder ``smx swap``
writes (a model swapped by :func:`smxcompile.swap`, saved with ``save_pretrained``).

* :func:`checkpoint_dir` / :func:`load_lm` / :func:`save_lm`: find and load one (a swapped one is
  restored with :func:`smxcompile.from_pretrained`) in eval mode with eager attention; save one.
* :func:`lm_data`: its training and held-out windows, rebuilt as ``smx demo`` built them
  (:func:`smx_app.demo.load_corpus`, ``make_windows``, ``split_windows``: every
  ``demo.EVAL_EVERY``-th window held out) with the checkpoint's own tokenizer and the demo's
  ``results.json`` settings (window length, corpus).
* :func:`perplexity`: held-out next-token loss and perplexity.
* :func:`train_steps`: AdamW steps on all weights, or on the swapped variant's parameters only
  (``which="variant"``: the *calibration* of a variant, the rest of the model frozen).
* :func:`attention_stats`: entropy, attention-sink mass, row sums and zero fraction of the swapped
  sites' weights (or, ``baseline=True``, of the original softmax at the same sites).

Every function takes ``progress=`` (a tqdm bar on stderr). Heavy imports (transformers, tokenizers)
happen inside the functions.
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
    """Load a causal language model from a checkpoint folder, in eval mode, with eager attention.

    Args:
        path: a checkpoint folder or the ``smx demo --out`` folder above it (see :func:`checkpoint_dir`).
        device: where the weights go.

    Returns:
        A ``transformers`` causal LM (fp32 as saved). A swapped model (``smx_swap.json`` or
        ``config.json``'s ``smx_swap``) is restored by ``smxcompile.from_pretrained(AutoModelForCausalLM,
        folder)``: same variants, same learned parameters, ``model.smx_swap`` set; any other by
        ``AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager")``.

    Raises:
        FileNotFoundError: not a checkpoint (:func:`checkpoint_dir`), or no weights.
        smxcompile.variants.UnknownVariantError: a swapped model whose variant is not registered here.
        Errors of ``transformers`` (an unknown architecture, corrupt files) propagate.
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
    """Save a (swapped) ``transformers`` model with ``model.save_pretrained(folder)`` (safetensors; a
    swapped model's ``config.json`` carries the swap manifest) and copy the tokenizer files
    (:data:`TOKENIZER_FILES` that exist) from the checkpoint folder ``tokenizer_from``. Returns ``folder``
    (created if needed); :func:`load_lm` loads it back.

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
    """The ``settings`` of the ``results.json`` that describes a checkpoint, and that file.

    Looks in the checkpoint folder itself (``smx swap`` writes it there), then in its parent (``smx demo``
    writes ``OUT/results.json`` next to ``OUT/checkpoint``). Only a file whose ``settings`` has
    ``seq_len`` counts. Returns ``({}, None)`` when there is none; raises nothing.
    """
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
    """The windows of a checkpoint's corpus, as ``smx demo`` cut them.

    Attributes:
        train: int64 ``[N, T]`` token ids, the training windows (``T = seq_len``).
        heldout: int64 ``[M, T]``, every ``smx_app.demo.EVAL_EVERY``-th window (never trained on).
        seq_len: ``T``. corpus: the demo corpus name (``"topics"`` or ``"topics+docstrings"``).
        tokenizer: the ``tokenizer.json`` used. vocab_size: its vocabulary size.
        settings: the demo's (or ``smx swap``'s) ``results.json`` settings, ``{}`` when there was none.
        results: that ``results.json``, or None. guessed: what had to be guessed (one sentence each;
            also issued as a ``UserWarning``).

    The tensors are shared with a cache (equal calls return the same tensors): do not modify them in place.
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

    Args:
        checkpoint: a checkpoint folder or the ``smx demo --out`` folder above it.
        seq_len: the window length; default: ``settings.seq_len`` of the ``results.json`` next to the
            checkpoint (:func:`demo_settings`), else the model's ``n_positions`` (a guess: warned).
        corpus: a corpus of :func:`smx_app.demo.load_corpus`; default: ``settings.corpus`` of that
            file, else the demo's default corpus (a guess: warned).

    Returns:
        :class:`LMData` (int64 windows on the CPU).

    Raises:
        FileNotFoundError: not a checkpoint, or no ``tokenizer.json`` in it.
        ValueError: an unknown corpus, a window length below 2 or above the model's ``n_positions``, a
            corpus shorter than one window, or no held-out window (fewer than ``EVAL_EVERY`` windows).
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
    """Mean next-token loss and perplexity of a causal LM over ``windows``.

    Each window of ``T`` tokens gives ``T - 1`` predictions (token ``t`` from tokens ``< t``), as
    ``model(input_ids=w, labels=w)`` scores it. The logits are cast to fp64 and the NLL summed in fp64
    over every token of every window, so the result does not depend on ``batch_size`` beyond the
    model's own fp32 rounding (~1e-7 relative). Runs under ``torch.no_grad`` in eval mode (the
    model's training flag is restored), on the model's device.

    Args:
        model: a causal LM called as ``model(input_ids=ids).logits`` -> ``[B, T, V]``.
        windows: int64 ``[M, T]`` token ids (``T >= 2``), e.g. ``lm_data(ck).heldout``; on any device.
        batch_size: windows per forward call.
        progress: a tqdm bar (stderr). desc: its label.

    Returns:
        ``{"loss": mean NLL in nats per token (float), "ppl": exp(loss), "tokens": M * (T - 1),
        "windows": M}``.

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
    """Train ``model`` in place: ``steps`` AdamW steps of the causal-LM loss on batches of ``windows``.

    Each step draws ``batch_size`` windows in the seeded order of :func:`smx_app.demo.make_batches`
    (each epoch reshuffled) and minimizes ``model(input_ids=b, labels=b).loss`` (mean next-token NLL,
    as ``smx demo`` trains), in train mode (restored afterwards), on the model's device.

    Args:
        model: a causal LM (``transformers``), swapped or not.
        windows: int64 ``[N, T]`` training windows (e.g. ``lm_data(ck).train``).
        steps: number of optimizer steps (0: nothing happens, ``[]`` is returned).
        batch_size: windows per step.
        lr: AdamW learning rate; default :data:`CALIBRATE_LR` (1e-2) for ``which="variant"``,
            :data:`FINETUNE_LR` (1e-4) for ``"all"``.
        which: ``"all"``: every parameter that requires grad (the variants' included); ``"variant"``:
            only the swapped variants' learnable parameters (``model.smx_swap``), the rest frozen
            for the run (every ``requires_grad`` flag is restored afterwards): the calibration of a
            variant to a model pretrained with softmax. Weight decay :data:`WEIGHT_DECAY` on the
            model's weights, none on the variants' parameters.
        seed: seed of the batch order.
        progress: a tqdm bar (stderr) showing the loss. desc: its label.

    Returns:
        The loss of each step (floats, before that step's update).

    Raises:
        ValueError: a bad ``which`` / ``steps`` / ``batch_size`` / ``lr`` / ``windows``; ``which="variant"``
            on a model without learnable variant parameters (not swapped, or a parameter-free variant
            such as sparsemax); ``which="all"`` with nothing that requires grad.
        FloatingPointError: the loss became NaN or infinite (the step is reported; the weights are
            those after the previous step's update).
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
    vparams = variant_parameters(model)
    vids = {id(p) for p in vparams}
    flags = [(p, p.requires_grad) for p in model.parameters()]
    if which == "variant":
        if not vparams:
            raise ValueError("which='variant': the model has no learnable variant parameter (it is not swapped, or "
                             "its variant has no learnable parameter, e.g. sparsemax): nothing to calibrate")
        groups = [{"params": vparams, "weight_decay": 0.0}]
    else:
        own = [p for p, f in flags if f and id(p) not in vids]
        var = [p for p in vparams if p.requires_grad]
        if not own and not var:
            raise ValueError("which='all': no parameter of the model requires grad")
        groups = [g for g in ({"params": own, "weight_decay": WEIGHT_DECAY}, {"params": var, "weight_decay": 0.0})
                  if g["params"]]
    if steps == 0:
        return []
    dev = _device(model)
    batches = demo.make_batches(windows, steps, batch_size, seed)
    was = model.training
    losses: list[float] = []
    try:
        if which == "variant":
            for p, _ in flags:
                p.requires_grad_(id(p) in vids)
        opt = torch.optim.AdamW(groups, lr=float(lr))
        model.train()
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=steps, desc=desc or ("calibrate" if which == "variant" else "fine-tune"), leave=False,
                       dynamic_ncols=True)
        try:
            for i, b in enumerate(batches):
                b = b.to(dev, torch.long)
                loss = model(input_ids=b, labels=b).loss
                value = float(loss.detach())
                if not math.isfinite(value):
                    raise FloatingPointError(f"the training loss is {value} at step {i + 1} of {steps} (lr {lr:g}); "
                                             "try a smaller learning rate")
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                losses.append(value)
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{value:.4f}")
        finally:
            if bar is not None:
                bar.close()
    finally:
        for p, f in flags:
            p.requires_grad_(f)
        for g in groups:
            for p in g["params"]:
                p.grad = None
        model.train(was)
    return losses


def attention_stats(model: nn.Module, windows: torch.Tensor, *, batch_size: int = 8, baseline: bool = False,
                    progress: bool = False) -> dict[str, float]:
    """Statistics of the attention weights at a swapped model's sites over ``windows`` (all sites together).

    Runs the model (eager, ``torch.no_grad``, eval mode) inside ``model.smx_swap.collecting()``; with
    ``baseline=True`` also inside ``model.smx_swap.disabled()``: the same sites computed by the model's
    original softmax (same weights), for comparison. Collecting costs about one extra forward's worth of
    fp64 work per batch: pass a few batches' worth of windows.

    Args:
        model: a model swapped by :func:`smxcompile.swap` (or loaded by :func:`load_lm` from a swapped checkpoint).
        windows: int64 ``[M, T]`` token ids. batch_size: windows per forward. progress: a tqdm bar.

    Returns:
        ``{"rows": number of weight rows (float), "entropy": mean entropy in nats of each row's weights
        divided by their sum, "sink_mass": mean weight on the first key, "rowsum": mean row sum (1 for
        softmax), "zero_fraction": share of unmasked weights that are exactly 0}`` (the ``"all"`` entry
        of :meth:`smxcompile.edit.swap.Swapper.stats`).

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
