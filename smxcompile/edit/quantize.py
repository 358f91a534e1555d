"""Post-training quantization of softmax outputs, with an offline bias correction.

``smxcompile.quantize_softmax(model, calibration_data)`` returns a model whose chosen softmaxes (attention
probabilities by default) produce quantized-then-dequantized values through PyTorch 2 export's QDQ ops
(``quantized_decomposed.quantize_per_tensor`` -> ``dequantize_per_tensor`` / ``dequantize_per_channel``), so
eager, Inductor, ``torch.export`` and the ``smx`` backend (which lowers the pair to ``smx::quant_softmax``) see
the same graph. The correction ("Softmax Bias Correction for Quantized Generative Models", Pandey et al., 2023)
restores the mass rounding takes from a row: ``"offset"`` (default) adds ``beta = E[p - p_hat]`` at unmasked
entries, ``"scale"`` multiplies the dequantization scale by ``E[sum p] / E[sum p_hat]``; one value per site, head
or head and query position. Sites are named and intercepted as in :mod:`smxcompile.edit.sites`; docs/DESIGN.md,
"Quantized softmax", gives the method and docs/PERFORMANCE.md the measurements.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any, Iterable, Mapping

import torch
import torch.nn as nn

import torch.ao.quantization.fx._decomposed  # noqa: F401  (registers torch.ops.quantized_decomposed)

from ..kernels.quant_softmax import QUANT_RANGES
from ..report import Site
from .quant_site import QuantSite, QuantStats, quant_range
from .sites import QUANT_ATTR, SWAP_ATTR, SiteInterceptor, call_model, module_key, progress as _progress, select_sites, \
    softmax_dim, traced_sites

_QD = torch.ops.quantized_decomposed
#: The model's own quantizers a softmax may feed (PT2E QDQ, fake quantization, quantized tensors)
_USER_QUANTIZERS = {_QD.quantize_per_tensor: "quantized_decomposed", _QD.quantize_per_tensor.default: "quantized_decomposed",
                    torch.fake_quantize_per_tensor_affine: "fake_quantize", torch.quantize_per_tensor: "quantize_per_tensor"}
_USER_DEQUANTIZERS = (_QD.dequantize_per_tensor, _QD.dequantize_per_tensor.default, torch.Tensor.dequantize,
                      torch.dequantize)
_QTENSOR_RANGE = {torch.quint8: (torch.uint8, *QUANT_RANGES[torch.uint8]),
                  torch.qint8: (torch.int8, *QUANT_RANGES[torch.int8])}
CORRECTIONS = ("scale", "offset")
GRANULARITIES = ("head", "position", "tensor")


# --------------------------------------------------------------------------- run-time interception


class SoftmaxQuantizer(SiteInterceptor):
    """The quantized-softmax state of a model (``model.smx_softmax_quant``).

    Attributes:
        sites: ``{key: QuantSite}`` of the quantized sites (keys as in :attr:`smxcompile.Site.key`,
            e.g. ``transformer.h.0.attn#0``).
        skipped: ``{key: reason}`` for softmax sites found but not quantized.
        enabled: when False the model computes the fp softmax everywhere (the baseline), without
            removing anything.
    """

    def __init__(self):
        super().__init__()
        self._sites = nn.ModuleDict()
        self.skipped: dict[str, str] = {}
        self.seen: dict[str, dict[str, Any]] = {}
        self.phase = "off"        # discover | observe | measure | quantize | off
        self._pending: tuple | None = None    # (key, tensor to watch, y, x, "quantize" | "dequantize")

    @property
    def sites(self) -> dict[str, QuantSite]:
        return {m.key: m for m in self._sites.values()}

    # -- interception (hooks and mode: smxcompile.edit.sites.SiteInterceptor)

    def _on_call(self, key: str, func, args: tuple, kwargs: dict):
        return self._on_softmax(key, func(*args, **kwargs), args, kwargs)

    def _on_other(self, func, args: tuple, kwargs: dict):
        pending = self._pending
        if pending is not None and args and args[0] is pending[1]:
            return self._on_follow(func, args, kwargs)
        return func(*args, **kwargs)

    # -- per call

    def _on_softmax(self, key: str, y: torch.Tensor, args: tuple, kwargs: dict) -> torch.Tensor:
        phase = self.phase
        self._pending = None
        if phase == "discover":
            self._pending = (key, y, y, args[0] if args else kwargs.get("input"), "quantize")
            if key not in self.seen:
                x = args[0]
                dim = softmax_dim(args, kwargs)
                nd = y.dim()
                d = dim + nd if isinstance(dim, int) and dim < 0 else dim
                self.seen[key] = {"ndim": nd, "dim": d, "shape": tuple(y.shape), "dtype": y.dtype,
                                  "heads": int(y.shape[1]) if nd == 4 else 0}
            return y
        site = self._sites[_mkey(key)] if _mkey(key) in self._sites else None
        if site is None or not self.enabled:
            return y
        if site.user is not None:
            # the model quantizes this softmax itself: follow its quantizer and dequantizer
            self._pending = (key, y, y, args[0] if args else kwargs.get("input"), "quantize")
            return y
        if phase == "observe":
            with torch.no_grad():
                finite = y.detach()[torch.isfinite(y.detach())]
                if finite.numel():
                    site.max_p = max(site.max_p, float(finite.max()))
            return y
        x = args[0] if args else kwargs.get("input")
        if phase == "measure":
            self._calib[site.key].add(site.measure(y, None, x))
            return y
        if phase == "quantize":
            if (y.dim() != site.ndim or (site.head_axis is not None and y.shape[site.head_axis] != site.heads)):
                raise RuntimeError(
                    f"smxcompile.quantize_softmax: site {site.key} was calibrated on {site.ndim}-D probabilities"
                    f"{' with ' + str(site.heads) + ' heads' if site.head_axis is not None else ''}, got shape "
                    f"{tuple(y.shape)}; re-run quantize_softmax on inputs of this layout")
            out = site(y, x)
            if self.collect and not torch.compiler.is_compiling():
                site.stats.add(site.measure(y, out, x))
            return out
        return y

    def _on_follow(self, func, args: tuple, kwargs: dict):
        """A call on the tensor a softmax site handed out: the model's own quantizer, then its dequantizer."""
        key, _, y, x, stage = self._pending
        self._pending = None
        out = func(*args, **kwargs)
        if stage == "quantize":
            kind = _USER_QUANTIZERS.get(func)
            if kind is None:
                return out
            if self.phase == "discover" and "user_q" not in self.seen.get(key, {}):
                a = list(args) + [None] * 6
                if kind == "quantize_per_tensor":
                    qd = kwargs.get("dtype", a[3])
                    dtype, lo, hi = _QTENSOR_RANGE.get(qd, (None, None, None))
                else:
                    lo, hi = kwargs.get("quant_min", a[3]), kwargs.get("quant_max", a[4])
                    dtype = kwargs.get("dtype", a[5]) if kind == "quantized_decomposed" else (
                        torch.uint8 if isinstance(lo, int) and lo >= 0 else torch.int8)
                scale, zp = kwargs.get("scale", a[1]), kwargs.get("zero_point", a[2])
                ok = (dtype in (torch.uint8, torch.int8) and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                                  for v in (scale, zp, lo, hi)))
                self.seen[key]["user_q"] = ({"spelling": kind, "scale": float(scale), "zero_point": int(zp),
                                             "quant_min": int(lo), "quant_max": int(hi), "dtype": dtype}
                                            if ok else {"unsupported": f"{kind} with tensor or unusual parameters"})
            if kind == "fake_quantize":
                return self._finish(key, y, x, out)
            self._pending = (key, out, y, x, "dequantize")
            return out
        if func in _USER_DEQUANTIZERS:
            return self._finish(key, y, x, out)
        return out

    def _finish(self, key: str, y: torch.Tensor, x, out: torch.Tensor) -> torch.Tensor:
        """The model dequantized a quantized site's probabilities: measure, or add the correction."""
        site = self._sites[_mkey(key)] if _mkey(key) in self._sites else None
        if site is None or site.user is None or not self.enabled:
            return out
        if self.phase == "measure":
            self._calib[site.key].add(site.measure(y, None, x))
            return out
        if self.phase == "quantize":
            fixed = site.correct(out, y, x)
            if self.collect and not torch.compiler.is_compiling():
                site.stats.add(site.measure(y, fixed, x))
            return fixed
        return out

    # -- user API

    def _reset_stats(self) -> None:
        for s in self._sites.values():
            s.stats = QuantStats.zeros(s.groups)

    def stats(self) -> dict[str, dict[str, float]]:
        """Per site and ``"all"``: ``rows``, ``mean_abs_rowsum_err`` (|row sum - 1| of what the site
        returned, averaged over rows), ``mean_abs_rowsum_err_uncorrected``, ``mean_rowsum``,
        ``zero_fraction`` (probabilities > 0 that quantized to the zero code), collected by
        :meth:`collecting`."""
        out: dict[str, dict[str, float]] = {}
        total = None
        for s in self._sites.values():
            st = s.stats
            out[s.key] = _summarize(st)
            if total is None:
                total = QuantStats.zeros(1)
            total.add(QuantStats(*(getattr(st, f.name).sum().reshape(1) for f in dataclasses.fields(st))))
        if total is not None:
            out["all"] = _summarize(total)
        return out

    def summary(self) -> str:
        """A table: one line per site with its parameters."""
        lines = [f"smxcompile quantized softmax: {len(self._sites)} site(s)"]
        for s in self._sites.values():
            corr = s.correction
            c = "-" if s.method is None else (f"{s.method} {corr.min().item():.5g}..{corr.max().item():.5g}"
                                              if corr.numel() > 1 else f"{s.method} {corr.item():.5g}")
            lines.append(f"  {s.key:40s} {s.kind:12s} {s.bits}-bit {str(s.qdtype).replace('torch.', ''):5s} "
                         f"scale={s.scale.item():.6g} zero_point={int(s.zero_point)} {s.granularity:6s} correction={c}")
        for k, why in self.skipped.items():
            lines.append(f"  {k:40s} skipped: {why}")
        return "\n".join(lines)

    def extra_repr(self) -> str:
        return f"{len(self._sites)} sites, phase={self.phase}, enabled={self.enabled}"


def _summarize(st: QuantStats) -> dict[str, float]:
    rows = float(st.rows.sum())
    nz = float(st.nonzero.sum())
    return {
        "rows": rows,
        "mean_rowsum": float(st.sum_out.sum()) / rows if rows else math.nan,
        "mean_abs_rowsum_err": float(st.abs_err_out.sum()) / rows if rows else math.nan,
        "mean_abs_rowsum_err_uncorrected": float(st.abs_err_q.sum()) / rows if rows else math.nan,
        "zero_fraction": float(st.zeroed.sum()) / nz if nz else math.nan,
    }


_mkey = module_key


# --------------------------------------------------------------------------- the API


def quantize_softmax(model: nn.Module, calibration_data: Iterable[Any], *, bits: int = 8, where: Any = "attention",
                     correction: bool | str = True, granularity: str = "head", dtype: torch.dtype = torch.uint8,
                     observer: str = "unit", inplace: bool = False, progress: bool = True) -> nn.Module:
    """Quantize the softmax outputs of ``model`` after calibrating them, with the bias correction (Pandey et al.,
    2023; the two forms: the module docstring).

    Args:
        model: an ``nn.Module`` whose softmax is a call it makes (``transformers``: ``attn_implementation="eager"``).
        calibration_data: an iterable of batches (a tuple of positional arguments, a dict of keyword arguments or
            a tensor each); materialized and run three times: the first batch names the sites, all of them set
            the range, all measure the bias.
        bits: code width, 2..8, codes stored in ``dtype`` (``torch.uint8``: ``0..2^bits-1``, ``torch.int8``: signed).
        where: ``"attention"`` (attention probabilities, found by :func:`smxcompile.explain`), ``"output"`` (the
            other softmax calls), ``"all"``, a predicate ``f(site: smxcompile.Site) -> bool``, or a list of keys.
        correction: ``True`` / ``"offset"`` (additive, on unmasked entries), ``"scale"`` (folded into the
            dequantization scale), ``False`` (the uncorrected baseline).
        granularity: ``"head"`` (per attention head where the site has heads), ``"position"`` (per head and query
            position) or ``"tensor"`` (one per site).
        observer: ``"unit"``: step ``1 / (2^bits - 1)``, codes cover [0, 1] and nothing clips; ``"minmax"``: the
            largest calibration probability over the code range (finer, but a larger probability later clips).
        inplace: change ``model`` itself instead of a deep copy. progress: tqdm progress bars.

    Returns:
        The model with ``model.smx_softmax_quant`` (a :class:`SoftmaxQuantizer`); the quantized sites return
        ``dequantize(quantize(softmax(x)))`` in the softmax's dtype and shape. Inference only: no gradient.

    Raises:
        ValueError: empty calibration data, a bad argument, a model already quantized or swapped, or no softmax
            site selected (the message lists the sites found and why each was left out).
        RuntimeError: at run time, a quantized site called with a layout it was not calibrated on.
    """
    method = _check_quantize_args(model, bits=bits, where=where, correction=correction, granularity=granularity,
                                  dtype=dtype, observer=observer)
    if isinstance(calibration_data, (torch.Tensor, Mapping, str)):
        raise ValueError("calibration_data must be an iterable of batches (a list of tuples, dicts or tensors); "
                         f"got a single {type(calibration_data).__name__}: wrap it in a list")
    batches = list(calibration_data)
    if not batches:
        raise ValueError("calibration_data is empty: quantize_softmax needs at least one batch to calibrate")

    if not inplace:
        model = copy.deepcopy(model)
    was_training = model.training
    model.eval()
    named: dict[str, Site] = {}
    split_note = False
    if where in ("attention", "output") or (callable(where) and not isinstance(where, str)):
        # what each softmax call is (attention or not), from the traced graph
        named, split_note = traced_sites(model, batches[0])
    quantizer = SoftmaxQuantizer()
    quantizer.attach(model)
    try:
        # which softmax calls the model makes, named as at run time
        quantizer.phase = "discover"
        with torch.no_grad():
            call_model(model, batches[0])
        if not quantizer.seen:
            raise ValueError("no softmax call found in the model's forward. transformers models: build or load them "
                             "with attn_implementation='eager' (F.scaled_dot_product_attention hides its softmax)")
        chosen = _choose_sites(quantizer, where, named, split_note)
        _add_sites(quantizer, chosen, named, bits=bits, dtype=dtype, method=method, granularity=granularity)
        _calibrate(quantizer, model, batches, observer=observer, progress=progress)
        quantizer.phase = "quantize"
    except BaseException:
        quantizer.detach()
        raise
    finally:
        model.train(was_training)
    model.add_module(QUANT_ATTR, quantizer)
    return model


def _check_quantize_args(model: Any, *, bits: int, where: Any, correction: Any, granularity: str, dtype: torch.dtype,
                         observer: str) -> str | None:
    """The correction method (``"offset"``, ``"scale"`` or None) after checking :func:`quantize_softmax`'s arguments."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be an nn.Module, got {type(model).__name__}")
    if isinstance(getattr(model, QUANT_ATTR, None), SoftmaxQuantizer):
        raise ValueError("model is already quantized by smxcompile.quantize_softmax (see model.smx_softmax_quant)")
    if getattr(model, SWAP_ATTR, None) is not None:
        raise ValueError("quantize_softmax: the model's softmax is swapped (model.smx_swap); quantizing a swapped "
                         "model is not supported")
    quant_range(bits, dtype)   # raises for a bad width or code dtype
    if correction is True:
        method: str | None = "offset"
    elif correction is False or correction is None:
        method = None
    elif correction in CORRECTIONS:
        method = correction
    else:
        raise ValueError(f"correction must be True, False or one of {CORRECTIONS}, got {correction!r}")
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    if observer not in ("unit", "minmax"):
        raise ValueError(f"observer must be 'unit' or 'minmax', got {observer!r}")
    if not (where in ("attention", "output", "all") or callable(where)
            or (isinstance(where, (list, tuple, set, frozenset)) and all(isinstance(k, str) for k in where))):
        raise ValueError(f"where must be 'attention', 'output', 'all', a predicate over smxcompile.Site or a list of site keys, "
                         f"got {where!r}")
    return method


def _choose_sites(quantizer: SoftmaxQuantizer, where: Any, named: dict[str, Site], split_note: bool) -> list[str]:
    """The discovered keys ``where`` selects that have an explicit ``dim`` (the others go to ``quantizer.skipped``);
    ValueError when none is left."""
    chosen, skipped = select_sites(where, quantizer.seen, named, already={
        "quant_softmax": "the model already quantizes it (kind quant_softmax); select it by key or with "
                         "where='all' to calibrate the correction of its own quantizer"})
    quantizer.skipped = skipped
    if not chosen:
        found = "; ".join(f"{k}: {why}" for k, why in skipped.items())
        hint = (" Dynamo split the model at a graph break (print, .item(), output_attentions=True ...), so the "
                "traced graph does not name every site: pass where='all' or a list of these site keys."
                if split_note else "")
        raise ValueError(f"quantize_softmax: no softmax site selected by where={where!r}. Sites found: {found}.{hint}")
    for key in list(chosen):
        if quantizer.seen[key]["dim"] is None:
            chosen.remove(key)
            quantizer.skipped[key] = "softmax without dim= (implicit dim)"
    if not chosen:
        raise ValueError("quantize_softmax: no softmax site with an explicit dim was selected")
    return chosen


def _add_sites(quantizer: SoftmaxQuantizer, chosen: list[str], named: dict[str, Site], *, bits: int,
               dtype: torch.dtype, method: str | None, granularity: str) -> None:
    """A :class:`QuantSite` per chosen key (following the model's own quantizer where it has one); ValueError when
    every chosen site is quantized by the model in a way it cannot follow."""
    for key in chosen:
        info = quantizer.seen[key]
        kind = named[key].kind if key in named else "unclassified"
        user = info.get("user_q")
        if user is not None and "unsupported" in user:
            quantizer.skipped[key] = f"the model quantizes it itself ({user['unsupported']})"
            continue
        site = QuantSite(key, kind, bits, dtype, method, granularity, info["ndim"], info["dim"], info["heads"],
                         positions=info["shape"][-1] if info["ndim"] else 1)
        quantizer._sites[_mkey(key)] = site
        if user is not None:
            site.use_quantizer(user)
    if not quantizer._sites:
        raise ValueError("quantize_softmax: no softmax site left to quantize: "
                         + "; ".join(f"{k}: {why}" for k, why in quantizer.skipped.items()))


def _calibrate(quantizer: SoftmaxQuantizer, model: nn.Module, batches: list, *, observer: str, progress: bool) -> None:
    """Two passes over ``batches``: the largest probability sets each site's step, then the measured bias its
    correction."""
    quantizer.phase = "observe"
    with torch.no_grad():
        for batch in _progress(batches, "smx calibrate (range)", progress):
            call_model(model, batch)
    for site in quantizer._sites.values():
        if site.user is None:              # a model's own quantizer keeps its step
            site.set_scale_from_max(observer)
    quantizer._calib = {site.key: QuantStats.zeros(site.groups) for site in quantizer._sites.values()}
    quantizer.phase = "measure"
    with torch.no_grad():
        for batch in _progress(batches, "smx calibrate (bias)", progress):
            call_model(model, batch)
    empty = [k for k, stats in quantizer._calib.items() if float(stats.rows.sum()) == 0]
    if empty:
        raise ValueError(f"quantize_softmax: site(s) {empty} saw no row of finite probabilities in the calibration "
                         "data (every row NaN or fully masked): there is nothing to calibrate them on")
    for site in quantizer._sites.values():
        site.set_correction(quantizer._calib[site.key])
    del quantizer._calib


def quantized_sites(model: nn.Module) -> dict[str, QuantSite]:
    """``{key: QuantSite}`` of a model returned by :func:`quantize_softmax` (empty for any other model)."""
    q = getattr(model, QUANT_ATTR, None)
    return q.sites if isinstance(q, SoftmaxQuantizer) else {}


__all__ = ["quantize_softmax", "SoftmaxQuantizer", "quantized_sites", "CORRECTIONS", "GRANULARITIES"]
