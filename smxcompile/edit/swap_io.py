"""Save and load models swapped by :func:`smxcompile.swap`: ``smxcompile.save`` / ``load`` / ``from_pretrained``.

A saved swap is ``model.safetensors`` plus the manifest ``smx_swap.json`` (which variant at which site), from which
:func:`load` rebuilds the swaps on a fresh base model without running it; ``transformers`` models also carry the
manifest in ``config.smx_swap``, so ``save_pretrained`` saves them and :func:`from_pretrained` restores them.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.nn as nn

from .swap import apply_manifest, swapper_of

#: The manifest :func:`save` writes next to the weights (``Swapper.manifest()`` as JSON).
MANIFEST = "smx_swap.json"


def save(model: nn.Module, path: str | Path) -> Path:
    """Write a swapped model to the folder ``path``: ``model.safetensors`` (every parameter and
    persistent buffer, the variants' parameters included; tied weights stored once) and
    ``smx_swap.json`` (the manifest). Returns the folder.

    Raises:
        ValueError: ``model`` was not swapped by :func:`smxcompile.swap`.
    """
    from safetensors.torch import save_model

    swapper = swapper_of(model)
    if swapper is None:
        raise ValueError("save: the model has no swapped site (smxcompile.swap returns a model that has)")
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    save_model(model, str(folder / "model.safetensors"))
    (folder / MANIFEST).write_text(json.dumps(swapper.manifest(), indent=2) + "\n")
    return folder


def read_manifest(path: str | Path) -> dict[str, Any]:
    """The swap manifest of a folder written by :func:`save` (``smx_swap.json``) or by a swapped
    ``transformers`` model's ``save_pretrained`` (``config.json``'s ``smx_swap``).

    Raises:
        FileNotFoundError: neither is there.
    """
    folder = Path(path)
    if (folder / MANIFEST).is_file():
        return json.loads((folder / MANIFEST).read_text())
    cfg = folder / "config.json"
    if cfg.is_file():
        m = json.loads(cfg.read_text()).get("smx_swap")
        if m:
            return m
    raise FileNotFoundError(f"{folder}: no {MANIFEST} and no smx_swap entry in config.json (not a swapped model)")


def _weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / s for s in shards]
    if (folder / "model.safetensors").is_file():
        return [folder / "model.safetensors"]
    raise FileNotFoundError(f"{folder}: no model.safetensors")


def load(model: nn.Module, path: str | Path, *, strict: bool = True) -> nn.Module:
    """Re-apply the swaps saved in ``path`` (by :func:`save` or a swapped model's ``save_pretrained``) to a freshly
    built base ``model``, in place, and load the weights; returns ``model``. ``strict``: every tensor of the swapped
    model must be in the files (tied copies of one that is excepted) and every tensor in the files in the model.

    Raises:
        FileNotFoundError: no manifest / weights in ``path``. ValueError: see :func:`apply_manifest`.
        RuntimeError: missing or unexpected tensors (``strict``), or shape mismatches.
    """
    from safetensors.torch import load_file

    folder = Path(path)
    manifest = read_manifest(folder)
    files = _weight_files(folder)
    apply_manifest(model, manifest)
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    missing, unexpected = model.load_state_dict(state, strict=False)
    if strict:
        own = model.state_dict(keep_vars=True)
        loaded_ids = {id(own[k]) for k in state if k in own}
        missing = [k for k in missing if id(own[k]) not in loaded_ids]
        if missing or unexpected:
            raise RuntimeError(f"smxcompile.load: {folder} does not match the model: missing {missing[:8]}"
                               f"{'...' if len(missing) > 8 else ''}, unexpected {list(unexpected)[:8]}"
                               f"{'...' if len(unexpected) > 8 else ''}")
    return model


def from_pretrained(model_class: Any, path: str | Path, **kwargs: Any) -> nn.Module:
    """Load a swapped ``transformers`` model saved with ``save_pretrained`` (or :func:`save` next to its config):
    ``model_class.from_pretrained(path, attn_implementation="eager", **kwargs)``, then :func:`load`.

    Raises:
        FileNotFoundError: the folder is not a swapped model. See :func:`load`.
    """
    folder = Path(path)
    read_manifest(folder)  # fail before building the model
    kwargs.setdefault("attn_implementation", "eager")
    with quiet_transformers():
        model = model_class.from_pretrained(str(folder), **kwargs)
    return load(model, folder)


@contextlib.contextmanager
def quiet_transformers(*, progress_bars: bool = True) -> Iterator[None]:
    """``transformers`` logs errors only while the block runs (its verbosity restored afterwards), so loading a
    swapped checkpoint does not warn about the variants' parameters; ``progress_bars=False`` also hides its bars."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # pragma: no cover
        yield
        return
    level, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    if not progress_bars:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        if not progress_bars and bars:
            hf_logging.enable_progress_bar()


__all__ = ["save", "load", "from_pretrained", "read_manifest", "quiet_transformers", "MANIFEST"]
