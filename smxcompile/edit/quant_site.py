"""One quantized softmax site of :func:`smxcompile.quantize_softmax`: its quantizer, its bias correction, its statistics.

:class:`QuantSite` keeps the parameters (the quantization step, the zero point, one correction per group)
as buffers and computes ``dequantize(quantize(softmax))`` with the correction, through the standard
quantize / dequantize pair of PyTorch 2 export quantization (``torch.ops.quantized_decomposed``).
:class:`QuantStats` holds the running sums calibration and ``SoftmaxQuantizer.stats()`` are computed from.
The method (the two correction forms, the granularities) is described in :mod:`smxcompile.edit.quantize`,
which finds the sites (:class:`smxcompile.edit.quantize.SoftmaxQuantizer`).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn

import torch.ao.quantization.fx._decomposed  # noqa: F401  (registers torch.ops.quantized_decomposed)

from ..kernels.quant_softmax import QUANT_RANGES

_QD = torch.ops.quantized_decomposed


# --------------------------------------------------------------------------- quantization parameters


def quant_range(bits: int, dtype: torch.dtype) -> tuple[int, int]:
    """``(quant_min, quant_max)`` of a ``bits``-bit code stored in ``dtype`` (uint8: unsigned, int8: signed)."""
    if dtype not in QUANT_RANGES:
        raise ValueError(f"dtype must be torch.uint8 or torch.int8, got {dtype}")
    if not isinstance(bits, int) or isinstance(bits, bool) or not 2 <= bits <= 8:
        raise ValueError(f"bits must be an int in 2..8, got {bits!r}")
    if dtype == torch.uint8:
        return 0, 2 ** bits - 1
    return -(2 ** (bits - 1)), 2 ** (bits - 1) - 1


@dataclasses.dataclass
class QuantStats:
    """Running sums of one site (per head where the site has heads): fp64 CPU tensors of shape ``(groups,)``
    (see :attr:`QuantSite.groups`). ``zeros(n)`` starts them; ``add`` accumulates another's in place."""

    rows: torch.Tensor            # rows seen (rows whose probabilities are all finite)
    sum_p: torch.Tensor           # sum of the fp probabilities
    sum_q: torch.Tensor           # sum of the uncorrected dequantized probabilities
    sum_out: torch.Tensor         # sum of what the site returned (corrected when it is)
    abs_err_out: torch.Tensor     # sum over rows of |row sum of the output - 1|
    abs_err_q: torch.Tensor       # ... of the uncorrected dequantized rows
    nonzero: torch.Tensor         # unmasked entries
    zeroed: torch.Tensor          # unmasked entries that quantized to the zero code

    @classmethod
    def zeros(cls, n: int) -> "QuantStats":
        z = lambda: torch.zeros(n, dtype=torch.float64)  # noqa: E731
        return cls(*(z() for _ in dataclasses.fields(cls)))

    def add(self, other: "QuantStats") -> None:
        for f in dataclasses.fields(self):
            getattr(self, f.name).add_(getattr(other, f.name))


class QuantSite(nn.Module):
    """One quantized softmax site: its quantizer, its correction and its statistics.

    Buffers (they follow ``model.to(device)`` and appear in ``state_dict``): ``scale`` (fp64
    scalar, the quantization step, probability units), ``zero_point`` (int64 scalar),
    ``correction`` (fp32, one per group: ``(heads,)``, ``(heads * positions,)`` or ``(1,)``;
    ``beta`` for ``"offset"``, ``gamma`` for ``"scale"``, zeros / ones when uncorrected) and
    ``dq_scale`` (fp32, ``scale * gamma``: the dequantization scales of the QDQ pair).
    """

    def __init__(self, key: str, kind: str, bits: int, dtype: torch.dtype, correction: str | None,
                 granularity: str, ndim: int, dim: int, heads: int, positions: int = 0):
        super().__init__()
        self.key, self.kind, self.bits, self.qdtype = key, kind, bits, dtype
        self.quant_min, self.quant_max = quant_range(bits, dtype)
        self.method = correction
        self.ndim, self.dim = ndim, dim
        has_heads = ndim == 4 and dim == 3 and heads > 0
        self.granularity = granularity if has_heads else "tensor"
        self.head_axis = 1 if self.granularity in ("head", "position") else None
        self.heads = heads if self.head_axis is not None else 1
        self.positions = max(int(positions), 1) if self.granularity == "position" else 1
        groups = self.heads * self.positions
        # fp64: the step is used as the Python float a quantizer takes (a model's own 1/15 stays 1/15)
        self.register_buffer("scale", torch.tensor(1.0 / (self.quant_max - self.quant_min), dtype=torch.float64))
        self.register_buffer("zero_point", torch.tensor(self.quant_min, dtype=torch.int64))
        ident = 1.0 if correction == "scale" else 0.0
        self.register_buffer("correction", torch.full((groups,), ident))
        self.register_buffer("dq_scale", (self.scale * self.correction).float())
        self.user: dict | None = None         # the model's own quantizer, when the softmax feeds one
        self.max_p = 0.0                      # observed during calibration
        self.calibrated = False
        self.stats = QuantStats.zeros(groups)
        self._refresh()
        self.register_buffer("quant_range", torch.tensor([self.quant_min, self.quant_max]))
        self.register_load_state_dict_post_hook(QuantSite._after_load)

    @staticmethod
    def _after_load(mod: "QuantSite", keys) -> None:
        """After ``load_state_dict``: refuse parameters of another code range, refresh the Python copies."""
        lo, hi = (int(v) for v in mod.quant_range)
        if (lo, hi) != (mod.quant_min, mod.quant_max):
            raise RuntimeError(f"smxcompile.quantize_softmax: the state_dict of site {mod.key} was saved for codes "
                               f"[{lo}, {hi}], this model quantizes to [{mod.quant_min}, {mod.quant_max}] "
                               f"({mod.bits}-bit {mod.qdtype}); quantize with the same bits and dtype before loading")
        mod._refresh()

    @property
    def groups(self) -> int:
        return self.heads * self.positions

    def _refresh(self) -> None:
        """Python copies of the scalar parameters: Dynamo bakes them into the graph as constants
        (reading a buffer with ``float()`` would break the graph)."""
        self._scale_f = float(self.scale)
        self._zp_i = int(self.zero_point)
        self._dq_scale_f = float(self.dq_scale.reshape(-1)[0])

    # -- parameters

    def set_scale_from_max(self, observer: str = "unit") -> None:
        """Quantization step: ``1 / (quant_max - quant_min)`` (``"unit"``: codes cover [0, 1]) or the largest
        probability seen in calibration over the code range (``"minmax"``); zero_point = quant_min."""
        top = self.max_p if observer == "minmax" and self.max_p > 0 else 1.0
        self.scale.fill_(top / (self.quant_max - self.quant_min))
        self.zero_point.fill_(self.quant_min)
        self.dq_scale.copy_(self.scale * (self.correction if self.method == "scale" else 1.0))
        self._refresh()

    def set_correction(self, stats: QuantStats) -> None:
        """The bias correction from calibration sums (see the module docstring of :mod:`smxcompile.edit.quantize`).
        Groups without data (positions never reached in calibration) take the nearest earlier position's value."""
        if self.method == "scale":
            seen = stats.sum_q > 0
            val = torch.where(seen, stats.sum_p / stats.sum_q.clamp_min(1e-30), torch.ones_like(stats.sum_p))
        elif self.method == "offset":
            seen = stats.nonzero > 0
            val = torch.where(seen, (stats.sum_p - stats.sum_q) / stats.nonzero.clamp_min(1), torch.zeros_like(stats.sum_p))
            # a group whose rounding adds mass on average (beta < 0) is left as it is: subtracting would
            # make the probabilities quantized to zero negative (measured no worse: docs/PERFORMANCE.md)
            val = val.clamp_min(0)
        else:
            seen, val = None, None
        if val is not None:
            if self.positions > 1:
                val, seen = val.view(self.heads, self.positions).clone(), seen.view(self.heads, self.positions)
                for i in range(1, self.positions):
                    val[:, i] = torch.where(seen[:, i], val[:, i], val[:, i - 1])
                val = val.reshape(-1)
            self.correction.copy_(val.float())
        self.dq_scale.copy_(self.scale * (self.correction if self.method == "scale" else 1.0))
        self.calibrated = True
        self._refresh()

    def use_quantizer(self, user: dict) -> None:
        """Take the model's own quantizer (the softmax already feeds one): its step, zero point and range."""
        self.user = dict(user)
        self.quant_min, self.quant_max, self.qdtype = user["quant_min"], user["quant_max"], user["dtype"]
        self.bits = max(1, (self.quant_max - self.quant_min).bit_length())
        self.quant_range.copy_(torch.tensor([self.quant_min, self.quant_max]))
        self.scale.fill_(user["scale"])
        self.zero_point.fill_(user["zero_point"])
        self.dq_scale.copy_(self.scale * (self.correction if self.method == "scale" else 1.0))
        self._refresh()

    def correct(self, out: torch.Tensor, y: torch.Tensor, x: torch.Tensor | None) -> torch.Tensor:
        """The correction applied to dequantized probabilities ``out`` (the model's own dequantization)."""
        if self.method == "offset":
            return out + self._view(self.correction, y).to(out.dtype) * unmasked(x if x is not None else y, y, self.dim)
        if self.method == "scale":
            return out * self._view(self.correction, y).to(out.dtype)
        return out

    # -- the quantized call

    def _positions_of(self, y: torch.Tensor) -> torch.Tensor:
        """Absolute query position of each row of a ``(batch, heads, queries, keys)`` site: ``keys -
        queries + i`` (the queries are the last ones of the sequence, as with a KV cache), clamped
        to the calibrated range."""
        nq, nk = y.shape[2], y.shape[3]
        return torch.arange(nk - nq, nk, device=y.device).clamp(0, self.positions - 1)

    def _view(self, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The per-group vector ``t`` shaped to broadcast against ``y``."""
        if self.head_axis is None:
            return t.reshape(())
        if self.positions > 1:
            return t.view(self.heads, self.positions)[:, self._positions_of(y)].reshape(1, self.heads, -1, 1)
        shape = [1] * y.dim()
        shape[self.head_axis] = -1
        return t.reshape(shape)

    def _group_ids(self, y: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Group of every row of ``y`` (``rows``: a tensor of ``y``'s shape without the softmax dim)."""
        if self.head_axis is None:
            return torch.zeros(rows.shape, dtype=torch.int64, device=rows.device)
        h = torch.arange(self.heads, device=rows.device).view(1, -1, 1)
        if self.positions == 1:
            return h.expand(rows.shape)
        return (h * self.positions + self._positions_of(y).view(1, 1, -1)).expand(rows.shape)

    def quantize(self, y: torch.Tensor) -> torch.Tensor:
        """The integer codes of probabilities ``y`` (shape of ``y``, dtype uint8/int8)."""
        # fp32 first, as quantize_per_tensor does itself in eager (Inductor's lowering of it wants fp32)
        yq = y if y.dtype == torch.float32 else y.float()
        return _QD.quantize_per_tensor(yq, self._scale_f, self._zp_i, self.quant_min, self.quant_max, self.qdtype)

    def dequantize(self, q: torch.Tensor, out_dtype: torch.dtype, corrected: bool = True) -> torch.Tensor:
        """Dequantized probabilities; with ``corrected``, through the corrected scales (``"scale"`` form)."""
        zp = self._zp_i
        if corrected and self.method == "scale" and self.head_axis is not None:
            if self.positions > 1:
                deq = _QD.dequantize_per_tensor(q, self._scale_f, zp, self.quant_min, self.quant_max, self.qdtype,
                                                out_dtype=torch.float32)
                return (deq * self._view(self.correction, q)).to(out_dtype)
            zps = torch.full((self.heads,), zp, dtype=torch.int64, device=q.device)
            return _QD.dequantize_per_channel(q, self.dq_scale, zps, self.head_axis, self.quant_min, self.quant_max,
                                              self.qdtype, out_dtype=out_dtype)
        s = self._dq_scale_f if corrected and self.method == "scale" else self._scale_f
        return _QD.dequantize_per_tensor(q, s, zp, self.quant_min, self.quant_max, self.qdtype, out_dtype=out_dtype)

    def forward(self, y: torch.Tensor, x: torch.Tensor | None = None) -> torch.Tensor:
        """``dequantize(quantize(y))`` with the correction; ``x``: the softmax's input (its mask, for ``"offset"``)."""
        out_dtype = y.dtype if y.dtype.is_floating_point else torch.float32
        q = self.quantize(y)
        out = self.dequantize(q, out_dtype)
        if self.method == "offset":
            out = out + self._view(self.correction, y).to(out_dtype) * unmasked(x if x is not None else y, y, self.dim)
        return out

    # -- statistics

    def measure(self, y: torch.Tensor, out: torch.Tensor | None, x: torch.Tensor | None = None) -> QuantStats:
        """Sums over the rows of ``y`` (probabilities), per group, for calibration and
        :meth:`smxcompile.edit.quantize.SoftmaxQuantizer.stats`. ``x``: the softmax's input; its masked entries are not counted as probabilities."""
        with torch.no_grad():
            valid = unmasked(x if x is not None else y, y, self.dim if self.dim < y.dim() else -1)
            y = y.detach().double()
            q = self.quantize(y.float())
            qd = self.dequantize(q, torch.float64, corrected=False)
            dim = self.dim if self.dim < y.dim() else -1
            ok = torch.isfinite(y).all(dim=dim, keepdim=True)          # rows without NaN
            pos = valid & ok
            o = qd if out is None else out.detach().double()
            okr = ok.squeeze(dim).double()
            rows_p = torch.where(ok, y, 0).sum(dim)
            rows_q = torch.where(ok, qd, 0).sum(dim)
            rows_o = torch.where(ok, o, 0).sum(dim)
            g = self._group_ids(y, okr).reshape(-1)

            def red(t: torch.Tensor) -> torch.Tensor:
                return torch.zeros(self.groups, dtype=torch.float64, device=t.device).index_add_(0, g, t.reshape(-1)).cpu()

            return QuantStats(
                rows=red(okr), sum_p=red(rows_p * okr), sum_q=red(rows_q * okr), sum_out=red(rows_o * okr),
                abs_err_out=red((rows_o - 1).abs() * okr), abs_err_q=red((rows_q - 1).abs() * okr),
                nonzero=red(pos.double().sum(dim)), zeroed=red((pos & (q == self._zp_i)).double().sum(dim)),
            )

    def extra_repr(self) -> str:
        return (f"key={self.key!r}, kind={self.kind}, bits={self.bits}, dtype={self.qdtype}, "
                f"correction={self.method}, granularity={self.granularity}")


#: An entry whose logit is more than this many nats below its row's largest counts as masked:
#: its probability is below ``exp(-80) = 1.8e-35`` of the row's largest (every mask in use --
#: ``-inf``, ``finfo.min``, ``-1e9``, ``-1e4`` added to a score -- is far below; ALiBi's distant
#: keys too, whose probability is 0 anyway).
MASK_NATS = 80.0


def unmasked(x: torch.Tensor, y: torch.Tensor, dim: int) -> torch.Tensor:
    """Entries of softmax input ``x`` (softmax over ``dim``) that are not masked: within
    :data:`MASK_NATS` of the row's largest logit. Shaped like ``y``; rows that are all ``-inf`` or
    NaN have none."""
    if not (isinstance(x, torch.Tensor) and x.dtype.is_floating_point and x.shape == y.shape):
        return y > 0
    xf = x.float() if x.dtype != torch.float64 else x
    return (xf - xf.amax(dim, keepdim=True)) > -MASK_NATS


__all__ = ["QuantSite", "QuantStats", "quant_range", "unmasked", "MASK_NATS"]
