"""The registry of normalization variants (swap targets for softmax): each cites its paper.

Each :class:`Variant` maps a score row to weights: ``variant.apply(x, dim=-1, mask=None, **params)`` is a plain
torch reference (autograd runs through it) for floating ``x`` of any shape, computed in fp32 (fp64 for fp64),
returned in ``x``'s dtype and shape. Shared conventions (:meth:`Variant.apply`): a masked entry, or a ``-inf`` one
(an additive mask, as in ``smx::attention``), gets weight exactly 0 and no gradient and leaves the row, its length
``n`` and every denominator; a row with nothing kept gives zeros, never NaN. Parameters are numbers or tensors
with one value per row (e.g. ``(H, 1, 1)`` per head); ``variant.init_params(n_train, shape)`` gives the start
values for a model trained with softmax. Registry: :func:`names`, :func:`get`, :func:`register`,
:func:`unregister`. The variants the attention kernel also runs are built from their entries of
:data:`smxcompile.kernels.attention.NORMALIZERS` (how the two catalogues relate: that registry's module).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Mapping, NamedTuple

import torch

from ..kernels.attention import NORMALIZERS

__all__ = [
    "Variant",
    "ParamSpec",
    "UnknownVariantError",
    "names",
    "get",
    "register",
    "unregister",
]


class UnknownVariantError(KeyError):
    """Raised by :func:`get` / :func:`unregister` for a name not in the registry (a ``KeyError``)."""

    def __str__(self) -> str:  # KeyError would print the message with quotes around it
        return str(self.args[0]) if self.args else ""


class ParamSpec(NamedTuple):
    """One parameter of a variant: ``doc`` (what it is, its default), ``init`` (its pretrained-start rule, in
    words), ``learnable`` (whether :meth:`Variant.init_params` returns it, to become an ``nn.Parameter``)."""

    doc: str
    init: str
    learnable: bool = True


def _no_init(n_train: int | None) -> dict[str, float]:
    return {}


@dataclass(frozen=True)
class Variant:
    """One normalization variant (users register their own with :func:`register`).

    Fields:
        formula: the definition in one line (``x`` the row, ``n`` its number of kept entries). paper: the source.
        params: parameter name -> :class:`ParamSpec`.
        fn: the core, ``fn(x, keep, n, **params) -> w`` with the normalized dim last: ``x`` fp32/fp64 (no
            ``-inf``), ``keep`` bool of ``x``'s shape, ``n`` float ``(..., 1)`` the kept entries per row (>= 1),
            each parameter a tensor broadcastable per row or None (the core's default). :meth:`apply` zeroes
            masked entries of ``w`` afterwards.
        init: ``init(n_train) -> {name: float}``, the pretrained-start values of the learnable parameters;
            raises ``ValueError`` when it needs ``n_train`` and gets None.
    """

    name: str
    formula: str
    paper: str
    params: Mapping[str, ParamSpec]
    fn: Callable[..., torch.Tensor]
    init: Callable[[int | None], Mapping[str, float]] = field(default=_no_init)

    def apply(self, x: torch.Tensor, dim: int = -1, *, mask: torch.Tensor | None = None, **params) -> torch.Tensor:
        """Apply the variant to ``x`` (fp16, bf16, fp32 or fp64, at least 1-d) along ``dim``.

        ``mask``: bool, broadcastable to ``x``, True = keep; masked and ``-inf`` entries give exactly 0 and act as
        if removed from the row; a row with nothing kept gives zeros and zero gradients; a kept NaN or +inf makes
        its row NaN, as softmax does. ``params``: numbers or tensors with size 1 along ``dim``; omitted ones take
        their defaults. Returns ``x``'s shape and dtype (computed in fp32; fp64 for fp64 input).

        Raises:
            TypeError: ``x`` not a floating tensor, ``mask`` not bool, or an unknown parameter name.
            ValueError: a parameter that does not broadcast per row or is out of its domain (e.g.
                entmax_bisect's ``alpha < 1``); a mask that does not broadcast to ``x``.
            IndexError: ``dim`` out of range.
        """
        return _apply(self, x, dim, mask, params)

    def init_params(self, n_train: int | None = None, shape: tuple[int, ...] | torch.Size = ()) -> dict[str, torch.Tensor]:
        """The learnable parameters' start values for a swap on a model pretrained with softmax, as fp32 tensors of
        ``shape`` (e.g. ``(H, 1, 1)``); ``n_train`` (keys per row in training) for the length-dependent variants.

        Raises:
            ValueError: ``n_train`` needed but None, or not a positive integer where it is needed.
        """
        values = self.init(n_train)
        return {k: torch.full(tuple(shape), float(v), dtype=torch.float32) for k, v in values.items()}


# --------------------------------------------------------------------------------------
# the shared wrapper
# --------------------------------------------------------------------------------------

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
#: Parameters that must be > 0 when given as Python numbers (tensors are not checked: that would
#: read their values, a graph break under torch.compile).
_POSITIVE = {"temperature": ("T",)}


def _param(name: str, v, x: torch.Tensor, dim: int, ct: torch.dtype) -> torch.Tensor | None:
    if v is None:
        return None
    if not isinstance(v, torch.Tensor):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise TypeError(f"parameter {name!r} must be a number or a tensor, got {type(v).__name__}")
        return torch.tensor(float(v), dtype=ct, device=x.device)
    if v.dim() > x.dim():
        raise ValueError(f"parameter {name!r} of shape {tuple(v.shape)} has more dims than x {tuple(x.shape)}")
    v = v.reshape((1,) * (x.dim() - v.dim()) + tuple(v.shape))
    try:
        torch.broadcast_shapes(v.shape, x.shape)
    except RuntimeError as e:
        raise ValueError(f"parameter {name!r} of shape {tuple(v.shape)} does not broadcast to x {tuple(x.shape)}") from e
    if v.shape[dim] != 1:
        raise ValueError(f"parameter {name!r} must have size 1 along dim {dim} (one value per row), "
                         f"got shape {tuple(v.shape)}")
    return v.to(device=x.device, dtype=ct).movedim(dim, -1)


def _apply(variant: Variant, x: torch.Tensor, dim: int, mask, params: dict) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.dtype not in _FLOATS:
        raise TypeError(f"{variant.name}: x must be a floating tensor (fp16, bf16, fp32, fp64), got "
                        f"{x.dtype if isinstance(x, torch.Tensor) else type(x).__name__}")
    if x.dim() == 0:
        raise IndexError(f"{variant.name}: x must have at least one dimension")
    dim = dim + x.dim() if dim < 0 else dim
    if not 0 <= dim < x.dim():
        raise IndexError(f"{variant.name}: dim out of range for x of shape {tuple(x.shape)}")
    unknown = sorted(set(params) - set(variant.params))
    if unknown:
        raise TypeError(f"{variant.name}: unknown parameter(s) {', '.join(unknown)}; "
                        f"accepted: {', '.join(variant.params) or 'none'}")
    ct = torch.float64 if x.dtype == torch.float64 else torch.float32
    keep = None
    if mask is not None:
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
            raise TypeError(f"{variant.name}: mask must be a bool tensor (True = keep)")
        try:
            keep = torch.broadcast_to(mask.to(x.device), x.shape).movedim(dim, -1)
        except RuntimeError as e:
            raise ValueError(f"{variant.name}: mask of shape {tuple(mask.shape)} does not broadcast to "
                             f"x of shape {tuple(x.shape)}") from e
    for k in _POSITIVE.get(variant.name, ()):
        v = params.get(k)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and not (math.isfinite(v) and v > 0):
            raise ValueError(f"{variant.name}: parameter {k!r} must be a finite number > 0, got {v!r}")
    ps = {k: _param(k, v, x, dim, ct) for k, v in params.items()}
    if x.shape[dim] == 0:
        return torch.zeros_like(x)
    xs = x.movedim(dim, -1).to(ct)
    # -inf is an additive mask (as in smx::attention and swap): masked, so no core sees it (inf - inf, 0 * inf)
    finite_lo = xs != float("-inf")
    keep = finite_lo if keep is None else keep & finite_lo
    # a kept NaN or +inf makes the row NaN, as in softmax (inf - inf); no core sees them
    bad = keep & (xs.isnan() | (xs == float("inf")))
    xs = torch.where(bad, 0.0, xs)
    n = keep.sum(-1, keepdim=True).to(ct).clamp(min=1.0)
    w = torch.where(keep, variant.fn(xs, keep, n, **ps), 0.0)
    w = w.masked_fill(bad.any(-1, keepdim=True), float("nan"))
    return w.to(x.dtype).movedim(-1, dim)


# --------------------------------------------------------------------------------------
# cores
# --------------------------------------------------------------------------------------


def _k(t: torch.Tensor, keep, fill: float) -> torch.Tensor:
    return t if keep is None else torch.where(keep, t, fill)


def _safe_den(d: torch.Tensor) -> torch.Tensor:
    return torch.where(d == 0, 1.0, d)


_softmax = NORMALIZERS["softmax"].ref


def _wrap(name: str, param_name: str | None = None):
    """The core of normalizer ``name``'s variant: its reference, the attention parameter named ``param_name``."""
    ref = NORMALIZERS[name].ref
    if param_name is None:
        return lambda x, keep, n: ref(x, keep, n, None)
    return lambda x, keep, n, **p: ref(x, keep, n, p.get(param_name))


def _ssmax(x, keep, n, s=None):
    return NORMALIZERS["ssmax"].ref(x, keep, n, s)


def _entmax_at_one(x, keep, n, alpha):
    """alpha-entmax at alpha = 1: softmax ``p``, plus alpha's gradient there (the first-order limit
    ``dp_i/dalpha = p_i (sum_j p_j log^2 p_j - log^2 p_i) / 2``, attached with zero value)."""
    p = _softmax(x, keep, n, None)
    if not alpha.requires_grad:
        return p
    z = _k(x, keep, float("-inf"))
    m = z.detach().amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, 0.0)
    d = torch.exp(z - m).sum(-1, keepdim=True)
    # log p from the scores, finite where p underflows to 0; masked entries 0 (their p is 0)
    lp = _k(_k(x, keep, 0.0) - m - torch.log(_safe_den(d)), keep, 0.0)
    lp2 = lp * lp
    dp = p * ((p * lp2).sum(-1, keepdim=True) - lp2) * 0.5
    return p + (alpha - alpha.detach()) * dp


#: |(alpha - 1) v| below this: log1p(t) / (alpha - 1) by its series (_SERIES_K terms, truncation < 1e-17).
_SERIES_T, _SERIES_K = 0.1, 16


def _log_power(e, v, pos):
    """``phi = log1p(e v) / e`` where ``pos`` (``1 + e v > 0``, ``e > 0``), else 0, so ``exp(phi) = (1 + e v)^(1/e)``;
    by its series for ``|e v| < 0.1``, where the quotient's gradient in ``e`` loses all precision."""
    t = e * v
    small = t.abs() < _SERIES_T
    ts = torch.where(small, t, 0.0)
    ser = torch.zeros_like(ts)
    for k in range(_SERIES_K, 0, -1):
        ser = ser * -ts + 1.0 / k
    tq = torch.where(small | ~pos, 1.0, t)  # the quotient sees t away from 0 and -1 (no inf in its gradient)
    return torch.where(pos, torch.where(small, v * ser, torch.log1p(tq) / e), 0.0)


def _entmax_bisect(x, keep, n, alpha=None, n_iter: int = 64):
    """alpha-entmax by bisection on ``c`` in ``p_i = (1 + e v_i)_+^(1/e)``, ``e = alpha - 1``,
    ``v_i = x_i - max(x) - c``; alpha == 1 is softmax exactly (per row), with alpha's gradient at 1."""
    if alpha is None:
        alpha = torch.tensor(1.5, dtype=x.dtype, device=x.device)
    # reading alpha's values is a graph break under torch.compile: checked and short-cut in eager only
    compiling = torch.compiler.is_compiling()
    if not compiling and (bool((alpha < 1).any()) or bool(torch.isnan(alpha).any())):
        raise ValueError("entmax_bisect: alpha must be >= 1 (1 = softmax, 1.5 = 1.5-entmax, 2 = sparsemax)")
    is_one = alpha == 1
    if not compiling and bool(is_one.all()):
        return _entmax_at_one(x, keep, n, alpha)
    e = torch.where(is_one, 0.5, alpha - 1.0)  # the entmax branch for alpha == 1 rows is discarded below
    m = _k(x, keep, float("-inf")).detach().amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, 0.0)
    # masked entries are replaced before any arithmetic (no NaN gradients) and excluded by pos below
    xm = _k(x, keep, 0.0) - m  # row max at 0

    def mass(c, xm_, e_):
        v = xm_ - c
        pos = (e_ * v > -1.0) & keep
        return torch.exp(_log_power(e_, v, pos)) * pos, pos, v

    with torch.no_grad():
        ed, xd = e.detach(), xm.detach()
        lo = torch.zeros_like(xd[..., :1]) + torch.zeros_like(ed)
        hi = -torch.expm1(-ed * torch.log(n)) / ed  # sum p <= n (1 - e hi)^(1/e) = 1 there
        for _ in range(n_iter):
            mid = (lo + hi) * 0.5
            big = mass(mid, xd, ed)[0].sum(-1, keepdim=True) >= 1.0
            lo = torch.where(big, mid, lo)
            hi = torch.where(big, hi, mid)
        c0 = (lo + hi) * 0.5
    # c's gradient by the implicit function theorem on sum p = 1; the value stays c0
    p, pos, v = mass(c0, xm, e)
    g = p.sum(-1, keepdim=True)
    dg_dc = -torch.where(pos, p / torch.where(pos, 1.0 + ed * v.detach(), 1.0), 0.0).detach().sum(-1, keepdim=True)
    dg_dc = torch.where(dg_dc != 0, dg_dc, -1.0)
    p, _, _ = mass(c0 - (g - g.detach()) / dg_dc, xm, e)
    w = p / _safe_den(p.sum(-1, keepdim=True))
    if compiling or bool(is_one.any()):
        w = torch.where(is_one, _entmax_at_one(x, keep, n, alpha), w)
    return w


_MULTIMAX = ("r0", "r1", "r2", "r3", "t0", "t1", "t2", "t3")


def _multimax(x, keep, n, **p):
    v = {k: (p.get(k) if p.get(k) is not None else torch.zeros((), dtype=x.dtype, device=x.device)) for k in _MULTIMAX}
    z = _k(x, keep, 0.0)
    sig = (z + v["t0"] * torch.relu(v["r0"] - z) + v["t1"] * torch.relu(z - v["r1"])
           + v["t2"] * torch.relu(v["r2"] - z) ** 2 + v["t3"] * torch.relu(z - v["r3"]) ** 2)
    return _softmax(sig, keep, n, None)


def _sa_softmax(x, keep, n):
    z = _k(x, keep, 0.0)
    lo = _k(x, keep, float("inf")).amin(-1, keepdim=True).clamp(max=0.0)
    hi = _k(x, keep, float("-inf")).amax(-1, keepdim=True).clamp(min=0.0)
    lo = torch.where(torch.isfinite(lo), lo, 0.0)
    hi = torch.where(torch.isfinite(hi), hi, 0.0)
    scale = (z - lo) / _safe_den(hi - lo)
    return scale * _softmax(x, keep, n, None)


def _stablemax(x, keep, n):
    z = _k(x, keep, 0.0)
    s = torch.where(z >= 0, z.clamp(min=0.0) + 1.0, 1.0 / (1.0 - z.clamp(max=0.0)))
    s = _k(s, keep, 0.0)
    return s / _safe_den(s.sum(-1, keepdim=True))


#: The published polynomial fit of "softmax is not enough" (Velickovic et al., 2024), highest power first.
_ADAPTIVE_POLY = (-0.037, 0.481, -2.3, 4.917, -1.791)


def _adaptive_temperature(x, keep, n):
    p = _softmax(x, keep, n, None)
    h = -(p * torch.log(p.clamp(min=torch.finfo(p.dtype).tiny))).sum(-1, keepdim=True)
    poly = torch.zeros_like(h)
    for c in _ADAPTIVE_POLY:
        poly = poly * h + c
    beta = torch.where(h > 0.5, poly.clamp(min=1.0), torch.ones_like(h))
    return _softmax(_k(x, keep, 0.0) * beta, keep, n, None)


def _temperature(x, keep, n, T=None):
    z = _k(x, keep, 0.0)
    return _softmax(z if T is None else z / T, keep, n, None)


# --------------------------------------------------------------------------------------
# pretrained-start rules
# --------------------------------------------------------------------------------------


def _need_n(name: str, n_train) -> int:
    if n_train is None:
        raise ValueError(f"{name}: init_params needs n_train, the training context length (keys per row)")
    if isinstance(n_train, bool) or not isinstance(n_train, int) or n_train < 1:
        raise ValueError(f"{name}: n_train must be a positive int, got {n_train!r}")
    return n_train


def _ssmax_init(n_train):
    n = _need_n("ssmax", n_train)
    if n < 2:
        raise ValueError("ssmax: n_train must be >= 2 (s = 1/log(n_train))")
    return {"s": 1.0 / math.log(n)}


def _const(**values):
    return lambda n_train: dict(values)


# --------------------------------------------------------------------------------------
# the registry
# --------------------------------------------------------------------------------------

def _from_normalizer(name: str, params: Mapping[str, ParamSpec], fn: Callable | None = None,
                     init: Callable = _no_init, *, formula: str | None = None) -> Variant:
    """The variant of attention normalizer ``name``: name, paper and formula (unless given: the variant's own
    parameter names) from :data:`NORMALIZERS`; ``fn`` defaults to its reference without a parameter."""
    entry = NORMALIZERS[name]
    return Variant(entry.name, formula or entry.formula, entry.paper, params, fn or _wrap(name), init)


_BUILTINS: tuple[Variant, ...] = (
    _from_normalizer("sparsemax", {}, formula="max(x_i - tau, 0), tau such that the row sums to 1 (sort-based)"),
    _from_normalizer("entmax15", {}, formula="max(x_i / 2 - tau, 0)^2, tau such that the row sums to 1 (sort-based)"),
    Variant("entmax_bisect",
            "max((alpha - 1) x_i - tau, 0)^(1 / (alpha - 1)), tau by bisection so the row sums to 1; "
            "alpha = 1 is softmax, alpha = 2 sparsemax",
            "Peters, Niculae & Martins, 'Sparse Sequence-to-Sequence Models' (2019); Correia, Niculae & "
            "Martins, 'Adaptively Sparse Transformers' (2019)",
            {"alpha": ParamSpec("alpha >= 1, default 1.5 (1 gives softmax exactly)",
                                "1.5 (alpha = 1 would reproduce softmax but is not sparse)")},
            _entmax_bisect, _const(alpha=1.5)),
    _from_normalizer("softpick",
                     {"eps": ParamSpec("eps in the denominator, default 1e-6", "1e-6, not trained", learnable=False)},
                     _wrap("softpick", "eps")),
    _from_normalizer("ssmax",
                     {"s": ParamSpec("scale s (learnable per layer/head), default 1.0",
                                     "1 / log(n_train), so the swap equals softmax at the training length")},
                     _ssmax, _ssmax_init, formula="softmax((s * log n) * x), n the kept entries of the row"),
    Variant("multimax",
            "softmax(sigma(x)), sigma(x) = x + t0 relu(r0 - x) + t1 relu(x - r1) + t2 relu(r2 - x)^2 "
            "+ t3 relu(x - r3)^2",
            "Zhou et al., 'MultiMax: Sparse and Multi-Modal Attention Learning' (2024)",
            {**{f"r{i}": ParamSpec(f"breakpoint r{i}, default 0", "0") for i in range(4)},
             **{f"t{i}": ParamSpec(f"slope t{i}, default 0", "0 (sigma is the identity: softmax)") for i in range(4)}},
            _multimax, _const(**{k: 0.0 for k in _MULTIMAX})),
    Variant("sa_softmax",
            "((x - min(x_min, 0)) / (max(x_max, 0) - min(x_min, 0))) * softmax(x) (normalized self-adjusting "
            "softmax; 0 for a row whose entries are all 0)",
            "'Self-Adjusting Softmax' (SA-Softmax, 2025), its normalized form; rows are not distributions "
            "(they sum to <= 1)", {}, _sa_softmax),
    _from_normalizer("softmax1", {}),
    _from_normalizer("sigmoid", {"b": ParamSpec("bias b, default -log(n) per row", "-log(n_train)")},
                     _wrap("sigmoid", "b"), lambda n: {"b": -math.log(_need_n("sigmoid", n))},
                     formula="sigmoid(x_i + b)"),
    _from_normalizer("relu", {"c": ParamSpec("scale c, default 1/n per row", "1 / n_train")},
                     _wrap("relu", "c"), lambda n: {"c": 1.0 / _need_n("relu", n)}, formula="relu(x_i) * c"),
    _from_normalizer("softplus", {"c": ParamSpec("scale c, default log(max(n, 2)) per row", "log(max(n_train, 2))")},
                     _wrap("softplus", "c"), lambda n: {"c": math.log(max(_need_n("softplus", n), 2))},
                     formula="softplus(c x_i) / sum_j softplus(c x_j)"),
    Variant("stablemax", "s(x_i) / sum_j s(x_j), s(x) = x + 1 for x >= 0, 1 / (1 - x) for x < 0",
            "Prieto, Barsbey, Mediano & Birdal, 'Grokking at the Edge of Numerical Stability' (2025)",
            {}, _stablemax),
    Variant("adaptive_temperature",
            "softmax(beta x), beta = max(poly(H), 1) if H > 0.5 else 1, H the entropy (nats) of softmax(x), "
            "poly(H) = -0.037 H^4 + 0.481 H^3 - 2.3 H^2 + 4.917 H - 1.791; gradients flow through beta",
            "Velickovic, Perivolaropoulos, Barbero & Pascanu, 'softmax is not enough (for sharp out-of-"
            "distribution)' (2024)", {}, _adaptive_temperature),
    Variant("temperature", "softmax(x / T)", "temperature scaling (e.g. Hinton, Vinyals & Dean, 'Distilling the "
            "Knowledge in a Neural Network', 2015)",
            {"T": ParamSpec("temperature T > 0, default 1", "1 (softmax)")}, _temperature, _const(T=1.0)),
)

_REGISTRY: dict[str, Variant] = {v.name: v for v in _BUILTINS}


def names() -> list[str]:
    """Registry names: the built-ins, then user-registered variants in registration order."""
    return list(_REGISTRY)


def get(name: str) -> Variant:
    """The :class:`Variant` registered as ``name``.

    Raises:
        UnknownVariantError (a ``KeyError``): ``name`` is not registered; the message lists the names.
    """
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise UnknownVariantError(f"unknown variant {name!r}; known: {', '.join(_REGISTRY)}") from None


def register(variant: Variant, *, overwrite: bool = False) -> Variant:
    """Add a user's :class:`Variant` (its ``fn`` follows the core convention of :class:`Variant`) and return it.

    Raises:
        TypeError: not a :class:`Variant`, or its ``fn`` / ``init`` not callable.
        ValueError: an empty name, or one already registered without ``overwrite=True``.
    """
    if not isinstance(variant, Variant):
        raise TypeError(f"register expects a smxcompile.variants.Variant, got {type(variant).__name__}")
    if not isinstance(variant.name, str) or not variant.name:
        raise ValueError("a variant needs a non-empty str name")
    if not callable(variant.fn) or not callable(variant.init):
        raise TypeError(f"variant {variant.name!r}: fn and init must be callable")
    if variant.name in _REGISTRY and not overwrite:
        raise ValueError(f"variant {variant.name!r} is already registered; pass overwrite=True to replace it")
    _REGISTRY[variant.name] = variant
    return variant


def unregister(name: str) -> Variant:
    """Remove ``name`` from the registry and return its :class:`Variant` (built-ins included).

    Raises:
        UnknownVariantError (a ``KeyError``): ``name`` is not registered.
    """
    v = get(name)
    del _REGISTRY[name]
    return v
