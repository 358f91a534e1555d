"""Run-time interception of the softmax calls of an eager model, named as :func:`smxcompile.explain` names them.

A site is ``module#index``: the innermost ``nn.Module`` whose ``forward`` makes the call and the call's position
among that forward's softmax calls. :class:`SiteInterceptor` keeps a stack of module names with forward hooks on
every submodule and sees each softmax call through a ``TorchFunctionMode``, without monkey-patching; Dynamo traces
both. The base of :func:`smxcompile.quantize_softmax` and :func:`smxcompile.swap`; the attributes each keeps on the
model (:data:`SWAP_ATTR`, :data:`QUANT_ATTR`) live here so each can refuse a model the other edited.
"""

from __future__ import annotations

import contextlib
import re
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

#: The softmax spellings the interceptor names (``nn.Softmax`` goes through ``F.softmax``).
SOFTMAX_FNS = (F.softmax, torch.softmax, torch.special.softmax, torch.Tensor.softmax)
#: The submodule of a model :func:`smxcompile.swap` edited: ``model.smx_swap``, a
#: :class:`smxcompile.edit.swap.Swapper` (its parameters are saved under ``smx_swap.``).
SWAP_ATTR = "smx_swap"
#: The submodule of a model :func:`smxcompile.quantize_softmax` edited: ``model.smx_softmax_quant``, a
#: :class:`smxcompile.edit.quantize.SoftmaxQuantizer`.
QUANT_ATTR = "smx_softmax_quant"


class _Frame:
    __slots__ = ("path", "count", "compiled")

    def __init__(self, path: str, compiled: bool = False):
        self.path = path
        self.count = 0
        self.compiled = compiled


class _SiteMode(TorchFunctionMode):
    """Names every softmax call ``module#index`` and hands it to its interceptor."""

    def __init__(self, owner: "SiteInterceptor"):
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        owner = self.owner
        if func not in SOFTMAX_FNS:
            stack = owner._stack
            if stack and stack[0].compiled and not torch.compiler.is_compiling():
                return func(*args, **kwargs)
            return owner._on_other(func, args, kwargs)
        stack = owner._stack
        frame = stack[-1] if stack else None
        if frame is None or (stack[0].compiled and not torch.compiler.is_compiling()):
            return func(*args, **kwargs)
        key = f"{frame.path}#{frame.count}"
        frame.count += 1
        return owner._on_call(key, func, args, kwargs)


class _PushHook:
    """Forward pre-hook: push the module's name (an object, not a closure, so that ``copy.deepcopy``
    of the model binds the copy's hooks to the copy's interceptor)."""

    def __init__(self, owner: "SiteInterceptor", name: str):
        # named ``quantizer`` since issue 6, when quantize_softmax was the only interceptor; it is either's
        self.quantizer, self.name = owner, name

    def __call__(self, mod, args):
        q = self.quantizer
        if not q._stack:
            q._mode.__enter__()
            # marked when traced: the compiled graph re-creates it (docs/DESIGN.md, "Variant swaps")
            q._stack.append(_Frame(self.name, compiled=torch.compiler.is_compiling()))
            return
        q._stack.append(_Frame(self.name))


class SiteInterceptor(nn.Module):
    """Base of the modules that act on a model's softmax calls at run time.

    Subclasses implement :meth:`_on_call` (a softmax call of site ``key``: return its result) and may
    override :meth:`_on_other` (any other torch call made while the model runs). The interceptor is
    added to the model as a submodule whose name starts with ``smx_`` (its own modules are not hooked).
    """

    def __init__(self):
        super().__init__()
        self._stack: list[_Frame] = []
        self._handles: list[Any] = []
        self._mode = _SiteMode(self)
        self.enabled = True     # False: every site computes the model's own softmax (the baseline)
        self.collect = False    # True: sites accumulate statistics (eager only)

    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        """``with interceptor.disabled():`` the model computes its own softmax at every site (the
        baseline: unquantized, or not swapped), without removing anything."""
        old = self.enabled
        self.enabled = False
        try:
            yield
        finally:
            self.enabled = old

    @contextlib.contextmanager
    def collecting(self) -> Iterator[None]:
        """Accumulate the sites' statistics (``.stats()``) while the block runs (eager calls only; the
        statistics are reset when the block starts)."""
        self._reset_stats()
        old = self.collect
        self.collect = True
        try:
            yield
        finally:
            self.collect = old

    def _reset_stats(self) -> None:
        """Clear the statistics :meth:`collecting` accumulates (subclasses that keep any override it)."""

    def attach(self, model: nn.Module) -> None:
        """Hook every submodule of ``model`` (except the ``smx_*`` ones)."""
        for name, mod in model.named_modules():
            if mod is self or name.split(".", 1)[0].startswith("smx_"):
                continue
            self._handles.append(mod.register_forward_pre_hook(_PushHook(self, name)))
            self._handles.append(mod.register_forward_hook(self._pop, always_call=True))

    def detach(self) -> None:
        """Remove the hooks (the model computes its own softmax again)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _pop(self, mod, args, out):
        if self._stack:
            self._stack.pop()
            if not self._stack:
                self._mode.__exit__(None, None, None)
        return None

    def _on_call(self, key: str, func: Callable, args: tuple, kwargs: dict) -> Any:
        return func(*args, **kwargs)

    def _on_other(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        return func(*args, **kwargs)


def softmax_dim(args: tuple, kwargs: dict) -> Any:
    """The ``dim`` of a softmax call (None for the deprecated implicit dim)."""
    if "dim" in kwargs:
        return kwargs["dim"]
    return args[1] if len(args) > 1 else None


def softmax_input(args: tuple, kwargs: dict) -> Any:
    """The input tensor of a softmax call."""
    return args[0] if args else kwargs.get("input", kwargs.get("self"))


def softmax_dtype(args: tuple, kwargs: dict) -> torch.dtype | None:
    """The ``dtype=`` of a softmax call (``F.softmax(x, dim, _stacklevel, dtype)`` / ``torch.softmax(x, dim, dtype)``)."""
    if "dtype" in kwargs:
        return kwargs["dtype"]
    for a in args[2:]:
        if isinstance(a, torch.dtype):
            return a
    return None


def module_key(key: str) -> str:
    """A ``ModuleDict``-safe name for a site key (``transformer.h.0.attn#0`` -> ``transformer_h_0_attn_0``)."""
    return re.sub(r"[^0-9A-Za-z_]", "_", key) or "_"


def split_key(key: str) -> tuple[str, int]:
    """``"transformer.h.0.attn#0"`` -> ``("transformer.h.0.attn", 0)``."""
    module, _, index = key.rpartition("#")
    return module, int(index)


__all__ = ["SiteInterceptor", "SOFTMAX_FNS", "SWAP_ATTR", "QUANT_ATTR", "softmax_dim", "softmax_input", "softmax_dtype", "module_key", "split_key"]


# --------------------------------------------------------------------------- choosing sites


def call_model(model: nn.Module, batch: Any) -> Any:
    """``model(**batch)`` for a dict, ``model(*batch)`` for a tuple/list, ``model(batch)`` otherwise."""
    from collections.abc import Mapping

    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def progress(items: list, desc: str, enabled: bool):
    """``items`` wrapped in a tqdm progress bar when ``enabled``."""
    if not enabled:
        return items
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover - tqdm is a dependency
        return items
    return tqdm(items, desc=desc, leave=False)


def traced_sites(model: nn.Module, batch: Any) -> tuple[dict[str, Any], bool]:
    """What :func:`smxcompile.explain` says each softmax call of ``model(batch)`` is: ``({key: Site}, split)``.

    A key seen several times (a module called twice, or a graph break: the resumed graph has no
    module names) is kept when every occurrence is the same kind of site and left out otherwise (not
    guessed); ``split`` is True when the model traced to several graphs.
    """
    from collections.abc import Mapping

    from ..explain import explain

    rep = (explain(model, *batch) if isinstance(batch, (tuple, list))
           else explain(model, **batch) if isinstance(batch, Mapping) else explain(model, batch))
    # an attention row skipped for a softmax another pass reads (its weights changed after it, e.g. the
    # model's own quantizer) names no attention site
    others = {s.key for s in rep if s.kind != "attention"}
    rep = [s for s in rep if not (s.kind == "attention" and s.action == "skipped" and s.key in others)]
    kinds: dict[str, set[str]] = {}
    for site in rep:
        if site.index >= 0:
            kinds.setdefault(site.key, set()).add(site.kind)
    # a key seen several times (a shared module called twice, or a graph break) is kept when every
    # occurrence is the same kind of site
    named = {s.key: s for s in rep if s.index >= 0 and len(kinds[s.key]) == 1}
    return named, len({s.graph for s in rep}) > 1


def select_sites(where: Any, seen: dict[str, Any], named: dict[str, Any],
                 already: dict[str, str] | None = None) -> tuple[list[str], dict[str, str]]:
    """Keys of the run-time sites ``seen`` chosen by ``where``, and the reason for each other one.

    ``where``: ``"attention"`` (sites :func:`smxcompile.explain` classifies as attention),
    ``"output"`` (the other softmax calls: classifier / sampling heads, routers), ``"all"``, a
    predicate over :class:`smxcompile.Site`, or a collection of keys. ``named``: the traced sites
    (:func:`traced_sites`). ``already``: ``{kind: reason}`` for kinds that must not be chosen
    by ``"attention"`` / ``"output"`` (e.g. sites already quantized).

    Raises:
        ValueError: a key in ``where`` that is not a site of the model.
    """
    from ..report import Site

    already = already or {}
    chosen: list[str] = []
    skipped: dict[str, str] = {}
    keys = None if isinstance(where, str) or callable(where) else set(where)
    if keys is not None:
        unknown = sorted(keys - set(seen))
        if unknown:
            raise ValueError(f"unknown softmax site(s) {unknown}; the model's softmax sites are {sorted(seen)}")
    for key in seen:
        site = named.get(key)
        if where == "all" or (keys is not None and key in keys):
            chosen.append(key)
        elif where in ("attention", "output"):
            if site is None:
                skipped[key] = f"not found in the traced graph (cannot tell whether it is {where})"
            elif site.kind in already:
                skipped[key] = already[site.kind]
            elif (site.kind == "attention") == (where == "attention"):
                chosen.append(key)
            else:
                skipped[key] = f"not {where} (kind {site.kind})"
        elif callable(where) and not isinstance(where, str):
            module, index = split_key(key)
            probe = site if site is not None else Site(kind="softmax", action="skipped", module=module, index=index)
            if where(probe):
                chosen.append(key)
            else:
                skipped[key] = "not selected by where"
        else:
            skipped[key] = "not selected by where"
    return chosen, skipped


__all__ += ["call_model", "progress", "traced_sites", "select_sites"]
