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
Patel, Nagel, 2023). The correction is measured offline on calibration data and folded into the
dequantization parameters, so it costs nothing at run time. Two forms:

* ``"scale"`` (default): the dequantization scale becomes ``scale * gamma`` with
  ``gamma = E[sum(p)] / E[sum(p_hat)]`` over the calibration rows, so corrected rows sum to one on
  average. Probabilities quantized to zero stay exactly zero: masked (future, padding) positions
  get no mass, and the corrected pair is an ordinary QDQ pair (ONNX ``DequantizeLinear`` with a
  float scale, per head with ``axis=1``).
* ``"offset"`` (the paper's additive form): ``p_hat + beta`` with ``beta = E[p - p_hat]`` per
  non-zero probability. Adding ``beta`` to every entry would give masked positions (a causal
  mask's future tokens) probability mass, so it is added only where ``p > 0``; that needs the
  probabilities at run time and is not a pure QDQ pair (evaluation and comparison only).

Granularity: one correction per site (``"tensor"``) or per attention head (``"head"``: the
probabilities of a 4-D site ``(batch, heads, queries, keys)`` with the softmax over the last dim).
docs/PERFORMANCE.md ("Quantized softmax") records which works better on the demo checkpoints.

How sites are found in the eager model. :func:`smxcompile.explain` names every softmax site by
``(module, index)``: the innermost ``nn.Module`` whose ``forward`` makes the ``softmax`` call and
the position of the call among that forward's softmax calls. ``quantize_softmax`` installs forward
hooks on every submodule (a stack of module names) and a ``TorchFunctionMode`` while the model
runs; each ``F.softmax`` / ``torch.softmax`` / ``Tensor.softmax`` / ``nn.Softmax`` call is named
the same way and, when it is a quantized site, followed by the QDQ pair. Dynamo traces the hooks
and the mode, so ``torch.compile`` sees the QDQ pairs in its graph.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import re
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

import torch.ao.quantization.fx._decomposed  # noqa: F401  (registers torch.ops.quantized_decomposed)

from .report import Site

_SOFTMAX_FNS = (F.softmax, torch.softmax, torch.special.softmax, torch.Tensor.softmax)
_QD = torch.ops.quantized_decomposed
CORRECTIONS = ("scale", "offset")
GRANULARITIES = ("head", "tensor")
ATTR = "smx_softmax_quant"


# --------------------------------------------------------------------------- quantization parameters


def quant_range(bits: int, dtype: torch.dtype) -> tuple[int, int]:
    """``(quant_min, quant_max)`` of a ``bits``-bit code stored in ``dtype`` (uint8: unsigned, int8: signed)."""
    if dtype not in (torch.uint8, torch.int8):
        raise ValueError(f"dtype must be torch.uint8 or torch.int8, got {dtype}")
    if not isinstance(bits, int) or isinstance(bits, bool) or not 2 <= bits <= 8:
        raise ValueError(f"bits must be an int in 2..8, got {bits!r}")
    if dtype == torch.uint8:
        return 0, 2 ** bits - 1
    return -(2 ** (bits - 1)), 2 ** (bits - 1) - 1


@dataclasses.dataclass
class _Stats:
    """Running sums of one site (per head where the site has heads)."""

    rows: torch.Tensor            # rows seen (rows whose probabilities are all finite)
    sum_p: torch.Tensor           # sum of the fp probabilities
    sum_q: torch.Tensor           # sum of the uncorrected dequantized probabilities
    sum_out: torch.Tensor         # sum of what the site returned (corrected when it is)
    abs_err_out: torch.Tensor     # sum over rows of |row sum of the output - 1|
    abs_err_q: torch.Tensor       # ... of the uncorrected dequantized rows
    nonzero: torch.Tensor         # probabilities > 0
    zeroed: torch.Tensor          # probabilities > 0 that quantized to the zero code

    @classmethod
    def zeros(cls, n: int) -> "_Stats":
        z = lambda: torch.zeros(n, dtype=torch.float64)  # noqa: E731
        return cls(*(z() for _ in dataclasses.fields(cls)))

    def add(self, other: "_Stats") -> None:
        for f in dataclasses.fields(self):
            getattr(self, f.name).add_(getattr(other, f.name))


class QuantSite(nn.Module):
    """One quantized softmax site: its quantizer, its correction and its statistics.

    Buffers (they follow ``model.to(device)`` and appear in ``state_dict``): ``scale`` (fp32
    scalar, the quantization step, probability units), ``zero_point`` (int64 scalar),
    ``correction`` (fp32, ``(heads,)`` or ``(1,)``: ``gamma`` for ``"scale"``, ``beta`` for
    ``"offset"``, ones / zeros when uncorrected) and ``dq_scale`` (fp32, ``scale * gamma``: the
    dequantization scales of the QDQ pair).
    """

    def __init__(self, key: str, kind: str, bits: int, dtype: torch.dtype, correction: str | None,
                 granularity: str, ndim: int, dim: int, heads: int):
        super().__init__()
        self.key, self.kind, self.bits, self.qdtype = key, kind, bits, dtype
        self.quant_min, self.quant_max = quant_range(bits, dtype)
        self.method = correction
        self.ndim, self.dim = ndim, dim
        per_head = granularity == "head" and ndim == 4 and dim == 3 and heads > 0
        self.granularity = "head" if per_head else "tensor"
        self.head_axis = 1 if per_head else None
        self.heads = heads if per_head else 1
        self.register_buffer("scale", torch.tensor(1.0 / (self.quant_max - self.quant_min)))
        self.register_buffer("zero_point", torch.tensor(self.quant_min, dtype=torch.int64))
        ident = 0.0 if correction == "offset" else 1.0
        self.register_buffer("correction", torch.full((self.heads,), ident))
        self.register_buffer("dq_scale", self.scale * self.correction)
        self.max_p = 0.0                      # observed during calibration
        self.calibrated = False
        self.stats = _Stats.zeros(self.heads)
        self._refresh()
        self.register_load_state_dict_post_hook(lambda mod, keys: mod._refresh())

    def _refresh(self) -> None:
        """Python copies of the scalar parameters: Dynamo bakes them into the graph as constants
        (reading a buffer with ``float()`` would break the graph)."""
        self._scale_f = float(self.scale)
        self._zp_i = int(self.zero_point)
        self._dq_scale_f = float(self.dq_scale.reshape(-1)[0])

    # -- parameters

    def set_scale_from_max(self) -> None:
        """Quantization step from the largest probability seen (min-max observer; zero_point = quant_min)."""
        top = self.max_p if self.max_p > 0 else 1.0
        self.scale.fill_(top / (self.quant_max - self.quant_min))
        self.zero_point.fill_(self.quant_min)
        self.dq_scale.copy_(self.scale * (self.correction if self.method == "scale" else 1.0))
        self._refresh()

    def set_correction(self, stats: _Stats) -> None:
        """The bias correction from calibration sums (see the module docstring)."""
        if self.method == "scale":
            gamma = torch.where(stats.sum_q > 0, stats.sum_p / stats.sum_q.clamp_min(1e-30), torch.ones_like(stats.sum_p))
            self.correction.copy_(gamma.float())
        elif self.method == "offset":
            beta = torch.where(stats.nonzero > 0, (stats.sum_p - stats.sum_q) / stats.nonzero.clamp_min(1), torch.zeros_like(stats.sum_p))
            self.correction.copy_(beta.float())
        self.dq_scale.copy_(self.scale * (self.correction if self.method == "scale" else 1.0))
        self.calibrated = True
        self._refresh()

    # -- the quantized call

    def _view(self, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.head_axis is None:
            return t.reshape(())
        shape = [1] * y.dim()
        shape[self.head_axis] = -1
        return t.reshape(shape)

    def quantize(self, y: torch.Tensor) -> torch.Tensor:
        """The integer codes of probabilities ``y`` (shape of ``y``, dtype uint8/int8)."""
        yq = y if y.dtype in (torch.float32, torch.float16, torch.bfloat16) else y.float()
        return _QD.quantize_per_tensor(yq, self._scale_f, self._zp_i, self.quant_min, self.quant_max, self.qdtype)

    def dequantize(self, q: torch.Tensor, out_dtype: torch.dtype, corrected: bool = True) -> torch.Tensor:
        """Dequantized probabilities; with ``corrected``, through the corrected scales (``"scale"`` form)."""
        zp = self._zp_i
        if corrected and self.method == "scale" and self.head_axis is not None:
            zps = torch.full((self.heads,), zp, dtype=torch.int64, device=q.device)
            return _QD.dequantize_per_channel(q, self.dq_scale, zps, self.head_axis, self.quant_min, self.quant_max,
                                              self.qdtype, out_dtype=out_dtype)
        s = self._dq_scale_f if corrected and self.method == "scale" else self._scale_f
        return _QD.dequantize_per_tensor(q, s, zp, self.quant_min, self.quant_max, self.qdtype, out_dtype=out_dtype)

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        out_dtype = y.dtype if y.dtype.is_floating_point else torch.float32
        q = self.quantize(y)
        out = self.dequantize(q, out_dtype)
        if self.method == "offset":
            out = out + (self._view(self.correction, y).to(out_dtype) * (y > 0))
        return out

    # -- statistics

    def measure(self, y: torch.Tensor, out: torch.Tensor | None) -> _Stats:
        """Sums over the rows of ``y`` (probabilities) for calibration and for :meth:`SoftmaxQuantizer.stats`."""
        with torch.no_grad():
            y = y.detach().double()
            q = self.quantize(y.float())
            qd = self.dequantize(q, torch.float64, corrected=False)
            dim = self.dim if self.dim < y.dim() else -1
            ok = torch.isfinite(y).all(dim=dim, keepdim=True)          # rows without NaN
            pos = (y > 0) & ok
            rows_p = torch.where(ok, y, 0).sum(dim)
            rows_q = torch.where(ok, qd, 0).sum(dim)
            o = qd if out is None else out.detach().double()
            rows_o = torch.where(ok, o, 0).sum(dim)
            okr = ok.squeeze(dim).double()
            reduce_dims = [d for d in range(okr.dim()) if d != (self.head_axis if self.head_axis is not None else -99)]

            def red(t: torch.Tensor) -> torch.Tensor:
                return t.sum(dim=reduce_dims) if reduce_dims else t.reshape(-1)

            def red_full(t: torch.Tensor) -> torch.Tensor:
                dims = [d for d in range(t.dim()) if d != (self.head_axis if self.head_axis is not None else -99)]
                return t.sum(dim=dims) if dims else t.reshape(-1)

            return _Stats(
                rows=red(okr).reshape(-1),
                sum_p=red(rows_p * okr).reshape(-1),
                sum_q=red(rows_q * okr).reshape(-1),
                sum_out=red(rows_o * okr).reshape(-1),
                abs_err_out=red((rows_o - 1).abs() * okr).reshape(-1),
                abs_err_q=red((rows_q - 1).abs() * okr).reshape(-1),
                nonzero=red_full(pos.double()).reshape(-1),
                zeroed=red_full((pos & (q == self._zp_i)).double()).reshape(-1),
            )

    def extra_repr(self) -> str:
        return (f"key={self.key!r}, kind={self.kind}, bits={self.bits}, dtype={self.qdtype}, "
                f"correction={self.method}, granularity={self.granularity}")


# --------------------------------------------------------------------------- run-time interception


class _Frame:
    __slots__ = ("path", "count")

    def __init__(self, path: str):
        self.path = path
        self.count = 0


class _SoftmaxSites(TorchFunctionMode):
    """Names every softmax call ``module#index`` and hands quantized sites to their :class:`QuantSite`."""

    def __init__(self, quantizer: "SoftmaxQuantizer"):
        super().__init__()
        self.q = quantizer

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _SOFTMAX_FNS:
            return func(*args, **kwargs)
        y = func(*args, **kwargs)
        stack = self.q._stack
        frame = stack[-1] if stack else None
        if frame is None:
            return y
        key = f"{frame.path}#{frame.count}"
        frame.count += 1
        return self.q._on_softmax(key, y, args, kwargs)


def _softmax_dim(args: tuple, kwargs: dict) -> Any:
    if "dim" in kwargs:
        return kwargs["dim"]
    return args[1] if len(args) > 1 else None


class _PushHook:
    """Forward pre-hook: push the module's name (an object, not a closure, so that ``copy.deepcopy``
    of the model binds the copy's hooks to the copy's quantizer)."""

    def __init__(self, quantizer: "SoftmaxQuantizer", name: str):
        self.quantizer, self.name = quantizer, name

    def __call__(self, mod, args):
        q = self.quantizer
        if not q._stack:
            q._mode.__enter__()
        q._stack.append(_Frame(self.name))


class SoftmaxQuantizer(nn.Module):
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
        self.kinds: dict[str, str] = {}
        self.seen: dict[str, dict[str, Any]] = {}
        self.phase = "off"        # discover | observe | measure | quantize | off
        self.enabled = True
        self.collect = False
        self._stack: list[_Frame] = []
        self._handles: list[Any] = []
        self._mode = _SoftmaxSites(self)
        self._depth = 0

    @property
    def sites(self) -> dict[str, QuantSite]:
        return {m.key: m for m in self._sites.values()}

    # -- hooks

    def attach(self, model: nn.Module) -> None:
        for name, mod in model.named_modules():
            if mod is self or name.startswith(ATTR):
                continue
            self._handles.append(mod.register_forward_pre_hook(self._push(name)))
            self._handles.append(mod.register_forward_hook(self._pop, always_call=True))

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _push(self, name: str) -> Callable:
        return _PushHook(self, name)

    def _pop(self, mod, args, out):
        if self._stack:
            self._stack.pop()
            if not self._stack:
                self._mode.__exit__(None, None, None)
        return None

    # -- per call

    def _on_softmax(self, key: str, y: torch.Tensor, args: tuple, kwargs: dict) -> torch.Tensor:
        phase = self.phase
        if phase == "discover":
            if key not in self.seen:
                x = args[0]
                dim = _softmax_dim(args, kwargs)
                nd = y.dim()
                d = dim + nd if isinstance(dim, int) and dim < 0 else dim
                self.seen[key] = {"ndim": nd, "dim": d, "shape": tuple(y.shape), "dtype": y.dtype,
                                  "heads": int(y.shape[1]) if nd == 4 else 0, "input_dtype": getattr(x, "dtype", None)}
            return y
        site = self._sites[_mkey(key)] if _mkey(key) in self._sites else None
        if site is None or not self.enabled:
            return y
        if phase == "observe":
            with torch.no_grad():
                finite = y.detach()[torch.isfinite(y.detach())]
                if finite.numel():
                    site.max_p = max(site.max_p, float(finite.max()))
            return y
        if phase == "measure":
            self._calib[site.key].add(site.measure(y, None))
            return y
        if phase == "quantize":
            if (y.dim() != site.ndim or (site.head_axis is not None and y.shape[site.head_axis] != site.heads)):
                raise RuntimeError(
                    f"smxcompile.quantize_softmax: site {site.key} was calibrated on {site.ndim}-D probabilities"
                    f"{' with ' + str(site.heads) + ' heads' if site.head_axis is not None else ''}, got shape "
                    f"{tuple(y.shape)}; re-run quantize_softmax on inputs of this layout")
            out = site(y)
            if self.collect and not torch.compiler.is_compiling():
                site.stats.add(site.measure(y, out))
            return out
        return y

    # -- user API

    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        """``with model.smx_softmax_quant.disabled():`` runs the fp softmax (the unquantized baseline)."""
        old = self.enabled
        self.enabled = False
        try:
            yield
        finally:
            self.enabled = old

    @contextlib.contextmanager
    def collecting(self) -> Iterator[None]:
        """Accumulate :meth:`stats` (row-sum error, fraction quantized to zero) while the block runs (eager only)."""
        for s in self._sites.values():
            s.stats = _Stats.zeros(s.heads)
        old = self.collect
        self.collect = True
        try:
            yield
        finally:
            self.collect = old

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
                total = _Stats.zeros(1)
            total.add(_Stats(*(getattr(st, f.name).sum().reshape(1) for f in dataclasses.fields(st))))
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


def _summarize(st: _Stats) -> dict[str, float]:
    rows = float(st.rows.sum())
    nz = float(st.nonzero.sum())
    return {
        "rows": rows,
        "mean_rowsum": float(st.sum_out.sum()) / rows if rows else math.nan,
        "mean_abs_rowsum_err": float(st.abs_err_out.sum()) / rows if rows else math.nan,
        "mean_abs_rowsum_err_uncorrected": float(st.abs_err_q.sum()) / rows if rows else math.nan,
        "zero_fraction": float(st.zeroed.sum()) / nz if nz else math.nan,
    }


def _mkey(key: str) -> str:
    """A ModuleDict-safe name for a site key."""
    return re.sub(r"[^0-9A-Za-z_]", "_", key) or "_"


# --------------------------------------------------------------------------- the API


def _call(model: nn.Module, batch: Any) -> Any:
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def _progress(items: list, desc: str, enabled: bool):
    if not enabled:
        return items
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover - tqdm is a dependency
        return items
    return tqdm(items, desc=desc, leave=False)


def _select(where: Any, seen: dict[str, dict], named: dict[str, Site]) -> tuple[list[str], dict[str, str]]:
    """Keys of the runtime sites chosen by ``where``, and reasons for the others."""
    chosen: list[str] = []
    skipped: dict[str, str] = {}
    if isinstance(where, str) and where not in ("attention", "all"):
        raise ValueError(f"where must be 'attention', 'all', a predicate over smxcompile.Site or a list of site keys, got {where!r}")
    keys = None if isinstance(where, str) or callable(where) else set(where)
    if keys is not None:
        unknown = sorted(keys - set(seen))
        if unknown:
            raise ValueError(f"unknown softmax site(s) {unknown}; the model's softmax sites are {sorted(seen)}")
    for key in seen:
        site = named.get(key)
        if where == "all" or (keys is not None and key in keys):
            chosen.append(key)
        elif where == "attention":
            if site is None:
                skipped[key] = "not found in the traced graph (cannot tell whether it is attention)"
            elif site.kind == "attention":
                chosen.append(key)
            else:
                skipped[key] = f"not attention (kind {site.kind})"
        elif callable(where) and not isinstance(where, str):
            probe = site if site is not None else Site(kind="softmax", action="skipped", module=key.rsplit("#", 1)[0],
                                                         index=int(key.rsplit("#", 1)[1]))
            if where(probe):
                chosen.append(key)
            else:
                skipped[key] = "not selected by where"
        else:
            skipped[key] = "not selected by where"
    return chosen, skipped


def quantize_softmax(model: nn.Module, calibration_data: Iterable[Any], *, bits: int = 8, where: Any = "attention",
                     correction: bool | str = True, granularity: str = "head", dtype: torch.dtype = torch.uint8,
                     inplace: bool = False, progress: bool = True) -> nn.Module:
    """Quantize the softmax outputs of ``model`` after calibrating them, with the bias correction.

    Method: "Softmax Bias Correction for Quantized Generative Models" (Pandey et al., 2023); see
    the module docstring of :mod:`smxcompile.quantize` for the two correction forms.

    Args:
        model: an ``nn.Module`` (e.g. a ``transformers`` model built with ``attn_implementation="eager"``:
            the softmax must be a call the model makes, not inside ``F.scaled_dot_product_attention``).
        calibration_data: an iterable of batches, each a tuple of positional arguments, a dict of
            keyword arguments, or a single tensor for ``model(...)``. Read twice (materialized as a list).
        bits: code width, 2..8; codes are stored in ``dtype``.
        where: ``"attention"`` (attention probabilities, found by :func:`smxcompile.explain`),
            ``"all"`` (every softmax call), a predicate ``f(site: smxcompile.Site) -> bool``, or a list
            of site keys (``"transformer.h.0.attn#0"``).
        correction: ``True`` / ``"scale"`` (multiplicative, folded into the dequantization scale),
            ``"offset"`` (additive on non-zero probabilities: evaluation only), ``False`` (the
            uncorrected baseline).
        granularity: ``"head"`` (one correction per attention head where the site has heads) or ``"tensor"``.
        dtype: ``torch.uint8`` (codes ``0..2^bits-1``) or ``torch.int8`` (``-2^(bits-1)..2^(bits-1)-1``).
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
    if isinstance(getattr(model, ATTR, None), SoftmaxQuantizer):
        raise ValueError("model is already quantized by smxcompile.quantize_softmax (see model.smx_softmax_quant)")
    qmin, qmax = quant_range(bits, dtype)
    if correction is True:
        method: str | None = "scale"
    elif correction is False or correction is None:
        method = None
    elif correction in CORRECTIONS:
        method = correction
    else:
        raise ValueError(f"correction must be True, False or one of {CORRECTIONS}, got {correction!r}")
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    batches = list(calibration_data)
    if not batches:
        raise ValueError("calibration_data is empty: quantize_softmax needs at least one batch to calibrate")

    if not inplace:
        model = copy.deepcopy(model)
    was_training = model.training
    model.eval()
    named: dict[str, Site] = {}
    if where == "attention" or (callable(where) and not isinstance(where, str)):
        # what each softmax call is (attention or not), from the traced graph
        from .explain import explain

        b0 = batches[0]
        rep = (explain(model, *b0) if isinstance(b0, (tuple, list))
               else explain(model, **b0) if isinstance(b0, Mapping) else explain(model, b0))
        named = {s.key: s for s in rep if s.index >= 0}
    quantizer = SoftmaxQuantizer()
    quantizer.attach(model)
    try:
        # which softmax calls the model makes, named as at run time
        quantizer.phase = "discover"
        with torch.no_grad():
            _call(model, batches[0])
        if not quantizer.seen:
            raise ValueError("no softmax call found in the model's forward. transformers models: build or load them "
                             "with attn_implementation='eager' (F.scaled_dot_product_attention hides its softmax)")
        chosen, skipped = _select(where, quantizer.seen, named)
        quantizer.skipped = skipped
        if not chosen:
            found = "; ".join(f"{k}: {why}" for k, why in skipped.items())
            raise ValueError(f"quantize_softmax: no softmax site selected by where={where!r}. Sites found: {found}")
        for key in list(chosen):
            if quantizer.seen[key]["dim"] is None:
                chosen.remove(key)
                quantizer.skipped[key] = "softmax without dim= (implicit dim)"
        if not chosen:
            raise ValueError("quantize_softmax: no softmax site with an explicit dim was selected")
        for key in chosen:
            info = quantizer.seen[key]
            kind = named[key].kind if key in named else "softmax"
            quantizer._sites[_mkey(key)] = QuantSite(key, kind, bits, dtype, method, granularity, info["ndim"],
                                                     info["dim"], info["heads"])
        # 3. observe the largest probability -> scale; 4. measure the bias -> correction
        quantizer.phase = "observe"
        with torch.no_grad():
            for b in _progress(batches, "smx calibrate (range)", progress):
                _call(model, b)
        for s in quantizer._sites.values():
            s.set_scale_from_max()
        quantizer._calib = {s.key: _Stats.zeros(s.heads) for s in quantizer._sites.values()}
        quantizer.phase = "measure"
        with torch.no_grad():
            for b in _progress(batches, "smx calibrate (bias)", progress):
                _call(model, b)
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
    model.add_module(ATTR, quantizer)
    return model


def quantized_sites(model: nn.Module) -> dict[str, QuantSite]:
    """``{key: QuantSite}`` of a model returned by :func:`quantize_softmax` (empty for any other model)."""
    q = getattr(model, ATTR, None)
    return q.sites if isinstance(q, SoftmaxQuantizer) else {}


__all__ = ["quantize_softmax", "SoftmaxQuantizer", "QuantSite", "quantized_sites", "quant_range"]
