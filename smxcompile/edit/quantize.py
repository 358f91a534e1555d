"""Post-training quantization of softmax outputs, with an offline bias correction.

``smxcompile.quantize_softmax(model, calibration_data)`` returns a model whose chosen softmaxes
(attention probabilities by default) produce quantized-then-dequantized values: the standard
quantize / dequantize pair of PyTorch 2 export quantization
(``torch.ops.quantized_decomposed.quantize_per_tensor`` -> ``dequantize_per_tensor`` or
``dequantize_per_channel``), so eager PyTorch, Inductor, ``torch.export`` and the ``smx`` backend
(which lowers the pair to ``smx::quant_softmax``) all see the same graph.

Why a correction. Uniform quantization of a softmax output (8-bit: step ``1/255``) rounds the many
tiny probabilities of a long row to zero, so a quantized row sums to less than one: a systematic
*bias*, not noise ("Softmax Bias Correction for Quantized Generative Models", Pandey, Fournarakis,
Patel, Nagel, 2023). The correction is measured offline on calibration data. Two forms:

* ``"offset"`` (default; the paper's additive form): ``p_hat + beta`` with ``beta = E[p - p_hat]``
  per unmasked probability, i.e. the expected quantization error, folded into the dequantization
  offset (clamped at 0: where rounding adds mass on average, subtracting would make the
  probabilities quantized to zero negative). Adding ``beta`` to *every* entry, as a plain float zero point would, gives masked
  positions (a causal mask's future tokens, padding) probability mass, so it is added only where
  the softmax input is not masked (above half its dtype's lowest value: ``-inf`` and ``finfo.min``
  masks are excluded). That costs one elementwise step fused into the dequantization (it reads
  the mask), not a pass of its own.
* ``"scale"``: the dequantization scale becomes ``scale * gamma`` with
  ``gamma = E[sum(p)] / E[sum(p_hat)]``: an ordinary QDQ pair (ONNX ``DequantizeLinear`` with a
  float scale, per head on ``axis=1``) at exactly zero run-time cost, and zero codes (masked
  positions) stay zero. It moves the lost mass onto the large probabilities instead of the small
  ones it came from, and measured worse than no correction at 4 bits (docs/PERFORMANCE.md).

Granularity: one correction per site (``"tensor"``), per attention head (``"head"``, default: the
probabilities of a 4-D site ``(batch, heads, queries, keys)`` with the softmax over the last dim)
or per head and query position (``"position"``: absolute position ``keys - queries + i``, so a
KV-cache decode step uses the entry of its position; positions past the calibrated length use the
last one). docs/PERFORMANCE.md ("Quantized softmax") records how each does on the demo checkpoints.

How sites are found in the eager model. :func:`smxcompile.explain` names every softmax site by
``(module, index)``: the innermost ``nn.Module`` whose ``forward`` makes the ``softmax`` call and
the position of the call among that forward's softmax calls. ``quantize_softmax`` installs forward
hooks on every submodule (a stack of module names) and a ``TorchFunctionMode`` while the model
runs; each ``F.softmax`` / ``torch.softmax`` / ``Tensor.softmax`` / ``nn.Softmax`` call is named
the same way and, when it is a quantized site, followed by the QDQ pair. Dynamo traces the hooks
and the mode, so ``torch.compile`` sees the QDQ pairs in its graph.
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
    """Quantize the softmax outputs of ``model`` after calibrating them, with the bias correction.

    Method: "Softmax Bias Correction for Quantized Generative Models" (Pandey et al., 2023); see
    the module docstring of :mod:`smxcompile.edit.quantize` for the two correction forms.

    Args:
        model: an ``nn.Module`` (e.g. a ``transformers`` model built with ``attn_implementation="eager"``:
            the softmax must be a call the model makes, not inside ``F.scaled_dot_product_attention``).
        calibration_data: an iterable of batches, each a tuple of positional arguments, a dict of
            keyword arguments, or a single tensor for ``model(...)``. Materialized as a list and run
            three times: the first batch to name the sites, all of them for the range, all for the bias.
        bits: code width, 2..8; codes are stored in ``dtype``.
        where: ``"attention"`` (attention probabilities, found by :func:`smxcompile.explain`),
            ``"output"`` (the softmax calls that are not attention),
            ``"all"`` (every softmax call), a predicate ``f(site: smxcompile.Site) -> bool``, or a list
            of site keys (``"transformer.h.0.attn#0"``).
        correction: ``True`` / ``"offset"`` (the paper's additive correction on unmasked entries),
            ``"scale"`` (multiplicative, folded exactly into the dequantization scale), ``False``
            (the uncorrected baseline).
        granularity: ``"head"`` (one correction per attention head where the site has heads),
            ``"position"`` (per head and query position) or ``"tensor"`` (one per site).
        dtype: ``torch.uint8`` (codes ``0..2^bits-1``) or ``torch.int8`` (``-2^(bits-1)..2^(bits-1)-1``).
        observer: the quantization step. ``"unit"`` (default): ``1 / (2^bits - 1)``, the codes cover
            [0, 1] and nothing ever clips. ``"minmax"``: the largest probability seen in calibration
            over the code range: finer steps when no calibration row is peaked, but a larger
            probability at run time (e.g. shorter sequences than calibrated) is clipped to it.
        inplace: change ``model`` itself instead of a deep copy.
        progress: show tqdm progress bars.

    Returns:
        The model (a deep copy unless ``inplace``) with ``model.smx_softmax_quant``, a
        :class:`SoftmaxQuantizer` (``.summary()``, ``.stats()``, ``.disabled()``, ``.sites``).
        Shapes and dtypes of every output are unchanged; the quantized sites return
        ``dequantize(quantize(softmax(x)))`` in the softmax's dtype. Inference only: the QDQ pair has
        no gradient.

    Raises:
        ValueError: empty calibration data, bad ``bits`` / ``dtype`` / ``correction`` /
            ``granularity`` / ``where``, a model already quantized, or no softmax site selected (the
            message lists the sites found and why each was left out).
        RuntimeError: at run time, a quantized site called with a layout it was not calibrated on.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be an nn.Module, got {type(model).__name__}")
    if isinstance(getattr(model, QUANT_ATTR, None), SoftmaxQuantizer):
        raise ValueError("model is already quantized by smxcompile.quantize_softmax (see model.smx_softmax_quant)")
    if getattr(model, SWAP_ATTR, None) is not None:
        raise ValueError("quantize_softmax: the model's softmax is swapped (model.smx_swap); quantizing a swapped "
                         "model is not supported")
    qmin, qmax = quant_range(bits, dtype)
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
        for key in list(chosen):
            info = quantizer.seen[key]
            kind = named[key].kind if key in named else "unclassified"
            user = info.get("user_q")
            if user is not None and "unsupported" in user:
                chosen.remove(key)
                quantizer.skipped[key] = f"the model quantizes it itself ({user['unsupported']})"
                continue
            quantizer._sites[_mkey(key)] = QuantSite(key, kind, bits, dtype, method, granularity, info["ndim"],
                                                     info["dim"], info["heads"], positions=info["shape"][-1] if info["ndim"] else 1)
            if user is not None:
                quantizer._sites[_mkey(key)].use_quantizer(user)
        if not quantizer._sites:
            raise ValueError("quantize_softmax: no softmax site left to quantize: "
                             + "; ".join(f"{k}: {why}" for k, why in quantizer.skipped.items()))
        # 3. observe the largest probability -> scale; 4. measure the bias -> correction
        quantizer.phase = "observe"
        with torch.no_grad():
            for b in _progress(batches, "smx calibrate (range)", progress):
                call_model(model, b)
        for s in quantizer._sites.values():
            if s.user is None:              # a model's own quantizer keeps its step
                s.set_scale_from_max(observer)
        quantizer._calib = {s.key: QuantStats.zeros(s.groups) for s in quantizer._sites.values()}
        quantizer.phase = "measure"
        with torch.no_grad():
            for b in _progress(batches, "smx calibrate (bias)", progress):
                call_model(model, b)
        empty = [k for k, st in quantizer._calib.items() if float(st.rows.sum()) == 0]
        if empty:
            raise ValueError(f"quantize_softmax: site(s) {empty} saw no row of finite probabilities in the calibration "
                             "data (every row NaN or fully masked): there is nothing to calibrate them on")
        for s in quantizer._sites.values():
            s.set_correction(quantizer._calib[s.key])
        del quantizer._calib
        quantizer.phase = "quantize"
    except BaseException:
        quantizer.detach()
        raise
    finally:
        model.train(was_training)
    model.add_module(QUANT_ATTR, quantizer)
    return model


def quantized_sites(model: nn.Module) -> dict[str, QuantSite]:
    """``{key: QuantSite}`` of a model returned by :func:`quantize_softmax` (empty for any other model)."""
    q = getattr(model, QUANT_ATTR, None)
    return q.sites if isinstance(q, SoftmaxQuantizer) else {}


__all__ = ["quantize_softmax", "SoftmaxQuantizer", "quantized_sites", "CORRECTIONS", "GRANULARITIES"]
