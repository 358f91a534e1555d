"""Swap the softmax of a (pretrained) model for another normalization: ``smxcompile.swap``.

``smxcompile.swap(model, "ssmax")`` returns a model whose attention softmaxes compute a variant of
:mod:`smxcompile.edit.variants` (or one the user registered) instead, its learnable parameters one
``nn.Parameter`` per site and head, started as close to the original as the variant allows. Sites are
named as :func:`smxcompile.explain` names them (``module#index``) and replaced at run time by a
:class:`smxcompile.edit.sites.SiteInterceptor`; the ``smx`` backend reports them as ``swapped``.
At an attention site an input entry at or below :data:`MASKED_BELOW` counts as masked
(:meth:`SwapSite.mask_threshold`). Persistence: :mod:`smxcompile.edit.swap_io`.
"""

from __future__ import annotations

import copy
import logging
import math
from typing import Any, Mapping

import torch
import torch.fx.traceback as fx_traceback
import torch.nn as nn

from . import variants as _variants
from .sites import QUANT_ATTR, SWAP_ATTR, SiteInterceptor, call_model, module_key, select_sites, softmax_dim, \
    softmax_dtype, softmax_input, traced_sites

log = logging.getLogger("smxcompile")

FORMAT = "smxcompile.swap/1"
#: At an attention site, a softmax input entry at or below this counts as masked (an additive mask: -inf,
#: finfo.min, -1e9, -1e4).
MASKED_BELOW = -1000.0
#: Annotation key the swapped ops carry in FX graphs (``node.meta["custom"]``); the passes skip them.
ANNOTATION = "smx_swap"


class SwapSite(nn.Module):
    """One swapped softmax site: the variant's name and its parameters.

    Attributes:
        key: the site (``module#index``); kind: what explain called it (``attention``, ``softmax``,
            or ``unclassified`` when chosen by key); variant: registry name.
        params: ``nn.ParameterDict`` of the learnable parameters, fp32, shape ``(heads, 1, 1)`` for a
            4-D ``(batch, heads, queries, keys)`` site over its last dim with ``per_head``, else ``()``.
        fixed: the non-learnable parameters (Python floats).
    """

    def __init__(self, key: str, kind: str, variant: str, ndim: int, dim: int, heads: int, per_head: bool,
                 values: Mapping[str, float], learnable: Mapping[str, bool]):
        super().__init__()
        self.key, self.kind, self.variant = key, kind, variant
        self.ndim, self.dim = ndim, dim
        self.per_head = bool(per_head and kind in ("attention", "unclassified") and ndim == 4 and dim == 3 and heads > 0)
        self.heads = heads if self.per_head else 0
        shape = (heads, 1, 1) if self.per_head else ()
        self.params = nn.ParameterDict({k: nn.Parameter(torch.full(shape, float(v)))
                                        for k, v in values.items() if learnable[k]})
        self.fixed = {k: float(v) for k, v in values.items() if not learnable[k]}

    def forward(self, x: torch.Tensor, dim: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The variant of ``x`` along ``dim`` (``x`` cast to ``dtype`` first, as ``softmax(x, dim, dtype=)`` does)."""
        if dtype is not None:
            x = x.to(dtype)
        d = dim + x.dim() if isinstance(dim, int) and dim < 0 else dim
        if x.dim() != self.ndim or d != self.dim:
            raise RuntimeError(f"smxcompile.swap: site {self.key} was found as a {self.ndim}-D softmax over dim "
                               f"{self.dim}, now called on shape {tuple(x.shape)} over dim {dim}. Sites are named by "
                               "call order: a softmax that runs only sometimes (in training, on one branch) shifts "
                               "the names; swap with where=[keys] chosen for the layout you run")
        if self.per_head and (x.dim() != 4 or x.shape[1] != self.heads):
            raise RuntimeError(f"smxcompile.swap: site {self.key} has per-head parameters for {self.heads} heads "
                               f"(input (batch, heads, queries, keys)), got shape {tuple(x.shape)}")
        keep = ~(x <= self.mask_threshold(x.dtype))      # NaN is kept (and propagates)
        return _variants.get(self.variant).apply(x, dim, mask=keep, **self.fixed, **dict(self.params.items()))

    def mask_threshold(self, dtype: torch.dtype) -> float:
        """Input entries at or below this count as masked: -1000 at attention sites (and at sites chosen by key,
        not classified, of the attention layout ``(batch, heads, queries, keys)`` over the last dim), else
        half ``dtype``'s lowest."""
        if self.kind == "attention" or (self.kind == "unclassified" and self.ndim == 4 and self.dim == 3):
            return MASKED_BELOW
        return torch.finfo(dtype).min / 2 if dtype.is_floating_point else MASKED_BELOW

    def entry(self) -> dict[str, Any]:
        """The manifest entry of this site."""
        return {"key": self.key, "kind": self.kind, "variant": self.variant, "ndim": self.ndim, "dim": self.dim,
                "heads": self.heads, "per_head": self.per_head, "fixed": dict(self.fixed),
                "params": {k: list(p.shape) for k, p in self.params.items()}}

    @classmethod
    def from_entry(cls, e: Mapping[str, Any]) -> "SwapSite":
        learnable = {k: True for k in e["params"]} | {k: False for k in e["fixed"]}
        values = {k: 0.0 for k in e["params"]} | dict(e["fixed"])
        return cls(e["key"], e["kind"], e["variant"], e["ndim"], e["dim"], e["heads"], e["per_head"], values, learnable)

    def extra_repr(self) -> str:
        return f"key={self.key!r}, variant={self.variant}, kind={self.kind}, per_head={self.per_head}"


class Swapper(SiteInterceptor):
    """The swapped sites of a model (``model.smx_swap``).

    Attributes:
        sites: ``{key: SwapSite}``.
        skipped: ``{key: reason}`` of the softmax sites found but not swapped.
        enabled: when False the model computes its original softmax everywhere (the baseline; see
            ``.disabled()``). ``.collecting()`` + ``.stats()``: statistics of the swapped sites.
    """

    def __init__(self):
        super().__init__()
        self._sites = nn.ModuleDict()
        self.skipped: dict[str, str] = {}
        self.seen: dict[str, dict[str, Any]] = {}
        self.phase = "on"          # discover | on
        self._stats: dict[str, dict[str, float]] = {}

    @property
    def sites(self) -> dict[str, SwapSite]:
        return {m.key: m for m in self._sites.values()}

    def add(self, site: SwapSite) -> None:
        self._sites[module_key(site.key)] = site

    def _on_call(self, key: str, func, args: tuple, kwargs: dict):
        if self.phase == "discover":
            y = func(*args, **kwargs)
            if key not in self.seen:
                dim = softmax_dim(args, kwargs)
                nd = y.dim()
                d = dim + nd if isinstance(dim, int) and dim < 0 else dim
                self.seen[key] = {"ndim": nd, "dim": d, "shape": tuple(y.shape), "dtype": y.dtype,
                                  "heads": int(y.shape[1]) if nd == 4 else 0}
            return y
        mk = module_key(key)
        if mk not in self._sites:
            return func(*args, **kwargs)
        site = self._sites[mk]
        x = softmax_input(args, kwargs)
        dim = softmax_dim(args, kwargs)
        if not self.enabled:
            y = func(*args, **kwargs)
            if self.collect and not torch.compiler.is_compiling():
                self._measure(site, x, y, dim)    # the baseline's statistics at the same sites
            return y
        with fx_traceback.annotate({ANNOTATION: key, "smx_variant": site.variant, "smx_kind": site.kind}):
            out = site(x, dim, softmax_dtype(args, kwargs))
        if self.collect and not torch.compiler.is_compiling():
            self._measure(site, x, out, dim)
        return out

    # -- user API

    def _reset_stats(self) -> None:
        self._stats = {}

    def _measure(self, site: SwapSite, x: torch.Tensor, w: torch.Tensor, dim: int) -> None:
        with torch.no_grad():
            wd = w.detach().double().movedim(dim, -1)
            keep = (~(x.detach() <= site.mask_threshold(x.dtype))).movedim(dim, -1)
            total = wd.sum(-1)
            ok = torch.isfinite(total) & keep.any(-1)
            p = wd / torch.where(total > 0, total, 1.0).unsqueeze(-1)
            ent = -(p * torch.log(p.clamp_min(1e-300))).where(p > 0, 0.0).sum(-1)
            s = self._stats.setdefault(site.key, {k: 0.0 for k in ("rows", "entropy", "sink", "rowsum", "zeros", "kept")})
            s["rows"] += float(ok.sum())
            s["entropy"] += float(ent[ok].sum())
            s["sink"] += float(wd[..., 0][ok].sum())
            s["rowsum"] += float(total[ok].sum())
            s["zeros"] += float(((wd == 0) & keep)[ok].sum())
            s["kept"] += float(keep[ok].sum())

    def stats(self) -> dict[str, dict[str, float]]:
        """Per site and ``"all"``, collected by :meth:`collecting`: ``rows``; ``entropy`` (nats, of each
        row's weights divided by their sum, mean over rows); ``sink_mass`` (mean weight on the first key:
        the attention-sink mass; raw weight, not divided by the row sum); ``rowsum`` (mean sum of a row's weights: 1 for softmax, less for
        softpick/softmax1/ReLU ...); ``zero_fraction`` (unmasked entries whose weight is exactly 0)."""
        out: dict[str, dict[str, float]] = {}
        tot = {k: 0.0 for k in ("rows", "entropy", "sink", "rowsum", "zeros", "kept")}
        for key, s in self._stats.items():
            out[key] = _summ(s)
            for k in tot:
                tot[k] += s[k]
        if self._stats:
            out["all"] = _summ(tot)
        return out

    def manifest(self) -> dict[str, Any]:
        """The JSON-ready description of the swaps (what :func:`smxcompile.save` writes to ``smx_swap.json``)."""
        return {"format": FORMAT, "sites": [s.entry() for s in self._sites.values()]}

    def summary(self) -> str:
        """A table: one line per swapped site with its variant and parameters."""
        lines = [f"smxcompile swap: {len(self._sites)} site(s)"]
        for s in self._sites.values():
            ps = ", ".join(f"{k}={_fmt(p)}" for k, p in s.params.items())
            fx = ", ".join(f"{k}={v:g}" for k, v in s.fixed.items())
            scope = "-" if not s.params else "per head" if s.per_head else "per site"
            lines.append(f"  {s.key:40s} {s.kind:12s} {s.variant:20s} {scope:8s} "
                         f"{ps}{'; ' if ps and fx else ''}{fx}")
        for k, why in self.skipped.items():
            lines.append(f"  {k:40s} skipped: {why}")
        return "\n".join(lines)

    def extra_repr(self) -> str:
        return f"{len(self._sites)} sites, enabled={self.enabled}"


def _fmt(p: torch.Tensor) -> str:
    v = p.detach()
    lo, hi = v.min().item(), v.max().item()
    return f"{lo:.4g}" if lo == hi else f"{lo:.4g}..{hi:.4g}"


def _summ(s: Mapping[str, float]) -> dict[str, float]:
    r = s["rows"]
    return {"rows": r, "entropy": s["entropy"] / r if r else math.nan, "sink_mass": s["sink"] / r if r else math.nan,
            "rowsum": s["rowsum"] / r if r else math.nan,
            "zero_fraction": s["zeros"] / s["kept"] if s["kept"] else math.nan}


# --------------------------------------------------------------------------- the API


def _hf_n_train(model: nn.Module) -> int | None:
    cfg = getattr(model, "config", None)
    for name in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        v = getattr(cfg, name, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def _variant(variant: Any) -> _variants.Variant:
    if isinstance(variant, _variants.Variant):
        known = variant.name in _variants.names() and _variants.get(variant.name) is variant
        if not known:
            _variants.register(variant)   # raises ValueError when the name belongs to another variant
        return variant
    if not isinstance(variant, str):
        raise TypeError(f"variant must be a registry name (smxcompile.variants.names()) or a Variant, got "
                        f"{type(variant).__name__}")
    return _variants.get(variant)


def swapper_of(model: nn.Module) -> Swapper | None:
    """The :class:`Swapper` of a model returned by :func:`swap` (``model.smx_swap``), or None for any other
    model. Raises nothing."""
    s = getattr(model, SWAP_ATTR, None)
    return s if isinstance(s, Swapper) else None


def _refuse_quantized(model: nn.Module) -> None:
    if getattr(model, QUANT_ATTR, None) is not None:
        raise ValueError("smxcompile.swap: the model is quantized (model.smx_softmax_quant); swap the unquantized "
                         "model (quantizing a swapped model is not supported)")


def _sync_config(model: nn.Module, swapper: Swapper) -> None:
    """``transformers`` models: keep the manifest in ``config.smx_swap`` (saved by ``save_pretrained``)."""
    cfg = getattr(model, "config", None)
    if cfg is not None and hasattr(cfg, "to_dict"):
        cfg.smx_swap = swapper.manifest()


def swap(model: nn.Module, variant: Any, *, where: Any = "attention", example_inputs: Any = None,
         n_train: int | None = None, per_head: bool = True, inplace: bool = False, **params: Any) -> nn.Module:
    """Replace the softmax of ``model`` at the chosen sites by a normalization variant.

    Args:
        model: an ``nn.Module`` whose forward calls softmax; a ``transformers`` model on SDPA or flash
            attention is switched to ``attn_implementation="eager"`` (the same function, an explicit softmax).
        variant: a name from :func:`smxcompile.variants.names` or a :class:`Variant` (registered if new).
        where: ``"attention"`` (sites :func:`smxcompile.explain` classifies as attention), ``"output"`` (the
            other softmax calls), ``"all"``, a predicate ``f(site: smxcompile.Site) -> bool``, or a list of keys.
        example_inputs: one forward call's inputs (a tuple, a dict or a tensor); default ``model.dummy_inputs``.
        n_train: the training context length for the length-dependent start values (SSMax ``s = 1/log n_train``,
            sigmoid, ReLU, softplus); default: at attention sites the config's ``max_position_embeddings`` /
            ``n_positions``, else the site's row length in the example.
        per_head: one parameter per head at ``(batch, heads, queries, keys)`` sites over keys; False: one per site.
        inplace: change ``model`` itself instead of a deep copy.
        **params: the variant's parameters: a learnable one's start value, or a fixed one's value.

    Returns:
        The model with ``model.smx_swap`` (:class:`Swapper`); the variants' learnable parameters are fp32
        ``nn.Parameter`` s under ``smx_swap.``. Outputs keep their shapes and dtypes. Swapping again adds
        sites elsewhere; a site cannot be swapped twice.

    Raises:
        TypeError: a bad ``variant`` type, an unknown or non-number parameter, a model already compiled.
        UnknownVariantError (KeyError): an unknown variant name.
        ValueError: a parameter outside the variant's domain; no example inputs; a bad ``where`` or ``n_train``;
            no site selected (the message lists the sites found and why each was left out); a site already
            swapped; a quantized model; softmax calls that differ between training and eval mode.
        RuntimeError: at run time, a site called with another layout (number of dims, dim, heads).

    Source: the variants' papers; the pretrained-start rules follow them (SSMax: Nakanishi 2025; MultiMax:
    Zhou et al. 2024).
    """
    v = _check_swap_args(model, variant, where=where, n_train=n_train, params=params)
    _refuse_quantized(model)
    if example_inputs is None:
        example_inputs = getattr(model, "dummy_inputs", None)
        if example_inputs is None:
            raise ValueError("swap needs example_inputs= (one forward call's inputs: a tuple, a dict or a tensor) to "
                             "find the model's softmax sites")
    if not inplace:
        model = copy.deepcopy(model)
    _eager_attention(model)
    swapper = swapper_of(model)
    new = swapper is None
    if new:
        swapper = Swapper()
        swapper.attach(model)
    was_training = model.training
    model.eval()
    try:
        seen, named, split = _discover_sites(model, swapper, where, example_inputs)
        chosen, skipped = _choose_sites(swapper, where, seen, named, split)
        _add_sites(swapper, v, chosen, seen=seen, named=named, n_train=n_train, hf_n_train=_hf_n_train(model),
                   per_head=per_head, params=params)
        swapper.skipped.update({k: why for k, why in skipped.items() if module_key(k) not in swapper._sites})
        for k in chosen:
            swapper.skipped.pop(k, None)
        swapper.seen = {}
    except BaseException:
        swapper.phase = "on"
        if new:
            swapper.detach()
        raise
    finally:
        model.train(was_training)
    if new:
        model.add_module(SWAP_ATTR, swapper)
    _sync_config(model, swapper)
    return model


def _check_swap_args(model: Any, variant: Any, *, where: Any, n_train: Any, params: Mapping[str, Any]) -> _variants.Variant:
    """The :class:`Variant` of ``variant`` after checking :func:`swap`'s arguments (its errors, same messages)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
        raise TypeError("swap: the model is already compiled (torch.compile); swap the model first, then compile "
                        "the swapped model")
    v = _variant(variant)
    unknown = sorted(set(params) - set(v.params))
    if unknown:
        raise TypeError(f"swap: variant {v.name!r} has no parameter(s) {unknown}; its parameters: "
                        f"{list(v.params) or 'none'}")
    for k, val in params.items():
        if isinstance(val, bool) or not isinstance(val, (int, float)) or not math.isfinite(val):
            raise TypeError(f"swap: parameter {k!r} must be a finite number, got {val!r}")
    if not (where in ("attention", "output", "all") or callable(where)
            or (isinstance(where, (list, tuple, set, frozenset)) and all(isinstance(k, str) for k in where))):
        raise ValueError(f"where must be 'attention', 'output', 'all', a predicate over smxcompile.Site or a list of "
                         f"site keys, got {where!r}")
    if n_train is not None and (isinstance(n_train, bool) or not isinstance(n_train, int) or n_train < 1):
        raise ValueError(f"n_train must be a positive int, got {n_train!r}")
    return v


def _discover_sites(model: nn.Module, swapper: Swapper, where: Any, example_inputs: Any) -> tuple[dict, dict, bool]:
    """Run the model once in eval and once in training mode to name its softmax calls: ``(seen, named, split)``.

    ``named``: what :func:`traced_sites` says each site is (empty for a list of keys). Raises ValueError when the
    two modes make different calls (names by call order would not match) or when there is no softmax call."""
    from ..explain import restore_state

    named: dict[str, Any] = {}
    split = False
    if isinstance(where, str) or callable(where):
        named, split = traced_sites(model, example_inputs)     # what each site is (attention or not)
    swapper.phase, swapper.seen = "discover", {}
    with torch.no_grad():
        call_model(model, example_inputs)
    seen = swapper.seen
    # the same names in training mode (a softmax that runs only in training would shift them)
    swapper.seen = {}
    model.train()
    with torch.no_grad(), restore_state(model):
        call_model(model, example_inputs)
    model.eval()
    train_seen, swapper.seen = swapper.seen, seen
    swapper.phase = "on"
    layout = lambda d: {k: (v["ndim"], v["dim"]) for k, v in d.items()}  # noqa: E731
    if layout(train_seen) != layout(seen):
        diff = sorted(set(layout(train_seen).items()) ^ set(layout(seen).items()))
        raise ValueError("swap: the model makes different softmax calls in training and in eval mode "
                         f"({diff[:6]}: (key, (ndim, dim)) seen in only one mode). Sites are named by call "
                         "order, so the names would not match in both modes; this model cannot be swapped "
                         "by name safely")
    if not seen:
        raise ValueError("swap: no softmax call found in the model's forward. transformers models: use "
                         "attn_implementation='eager' (F.scaled_dot_product_attention hides its softmax)")
    return seen, named, split


def _choose_sites(swapper: Swapper, where: Any, seen: dict, named: dict, split: bool) -> tuple[list[str], dict[str, str]]:
    """The keys ``where`` selects among ``seen`` and why each other one is left out; ValueError when none is left
    or a chosen site is already swapped."""
    chosen, skipped = select_sites(where, seen, named)
    for key in list(chosen):
        if seen[key]["dim"] is None:
            chosen.remove(key)
            skipped[key] = "softmax without dim= (implicit dim)"
        elif module_key(key) in swapper._sites:
            raise ValueError(f"swap: site {key} is already swapped (variant "
                             f"{swapper._sites[module_key(key)].variant}); swap a fresh model")
    if not chosen:
        found = "; ".join(f"{k}: {why}" for k, why in skipped.items())
        hint = (" Dynamo split the model at a graph break, so the traced graph does not name every site: pass "
                "where='all' or a list of these site keys." if split else "")
        raise ValueError(f"swap: no softmax site selected by where={where!r}. Sites found: {found}.{hint}")
    return chosen, skipped


def _add_sites(swapper: Swapper, variant: _variants.Variant, chosen: list[str], *, seen: dict, named: dict,
               n_train: int | None, hf_n_train: int | None, per_head: bool, params: Mapping[str, Any]) -> None:
    """A :class:`SwapSite` per chosen key, its learnable parameters started by the variant's rule at the site's
    ``n_train`` unless ``params`` gives them."""
    for key in chosen:
        info = seen[key]
        kind = named[key].kind if key in named else "unclassified"
        n = n_train or (hf_n_train if kind == "attention" and hf_n_train else None) or int(info["shape"][info["dim"]])
        needs_init = any(k not in params for k, spec in variant.params.items() if spec.learnable)
        values = dict(variant.init(n)) if needs_init else {}
        values = {k: float(val) for k, val in values.items() if variant.params[k].learnable}
        values.update({k: float(val) for k, val in params.items()})
        learnable = {k: variant.params[k].learnable for k in values}
        if key == chosen[0]:
            try:   # out-of-domain values (entmax_bisect alpha < 1, temperature T <= 0) fail here, not mid-forward
                variant.apply(torch.zeros(1, 2), -1, **values)
            except (ValueError, TypeError) as e:
                raise ValueError(f"swap: bad parameter value for variant {variant.name!r}: {e}") from None
        swapper.add(SwapSite(key, kind, variant.name, info["ndim"], info["dim"], info["heads"], per_head, values,
                             learnable))


def _eager_attention(model: nn.Module) -> None:
    """A ``transformers`` model on SDPA / flash attention computes the same function with eager attention."""
    cfg = getattr(model, "config", None)
    impl = getattr(cfg, "_attn_implementation", None)
    if impl not in (None, "eager") and hasattr(model, "set_attn_implementation"):
        log.warning("smxcompile.swap: switching the model from attn_implementation=%r to 'eager' (an explicit "
                    "softmax to swap)", impl)
        model.set_attn_implementation("eager")


def swapped_sites(model: nn.Module) -> dict[str, SwapSite]:
    """``{key: SwapSite}`` of a model returned by :func:`swap` (empty for any other model)."""
    s = swapper_of(model)
    return s.sites if s is not None else {}


def apply_manifest(model: nn.Module, manifest: Mapping[str, Any]) -> nn.Module:
    """Re-create the swaps of ``manifest`` (``Swapper.manifest()``) on ``model`` in place, without running
    it; the parameters take placeholder values until weights are loaded.

    Raises:
        ValueError: not a swap manifest, a model already swapped, or a site whose module is not in ``model``.
        UnknownVariantError: a variant that is not registered in this process (register it first).
    """
    if not isinstance(manifest, Mapping) or manifest.get("format") != FORMAT:
        raise ValueError(f"not an smxcompile swap manifest (expected format {FORMAT!r})")
    if swapper_of(model) is not None:
        raise ValueError("the model is already swapped: load into a freshly built base model")
    _refuse_quantized(model)
    modules = dict(model.named_modules())
    swapper = Swapper()
    for e in manifest["sites"]:
        _variants.get(e["variant"])
        module = e["key"].rpartition("#")[0]
        if module not in modules:
            raise ValueError(f"site {e['key']}: the model has no module {module!r} (another architecture?)")
        swapper.add(SwapSite.from_entry(e))
    _eager_attention(model)
    swapper.attach(model)
    model.add_module(SWAP_ATTR, swapper)
    _sync_config(model, swapper)
    return model


__all__ = ["swap", "apply_manifest", "swapped_sites", "swapper_of", "Swapper", "SwapSite", "MASKED_BELOW", "FORMAT"]
