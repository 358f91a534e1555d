"""Options of the ``smx`` backend: ``torch.compile(model, backend="smx", options={...})``."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Mapping

from .kernels.attention.reference import NORMALIZERS

#: Every rewrite kind smxcompile knows, by name. Each can be switched off with
#: ``options={"disable": ["softmax"]}`` or ``options={"softmax": False}``.
REWRITE_KINDS = ("attention", "quant_softmax", "sample", "softmax_topk", "softmax", "log_softmax", "cross_entropy", "linear_cross_entropy")

#: Normalizers the attention op runs in place of softmax (``options={"attention_normalizer": ...}``): the names of
#: :data:`smxcompile.kernels.attention.NORMALIZERS`, with their formulas and papers.
ATTENTION_NORMALIZERS = tuple(NORMALIZERS)

_DEVICE_POLICIES = ("auto", "rewrite", "keep")


@dataclasses.dataclass(frozen=True)
class SmxOptions:
    """Validated options of the ``smx`` backend.

    Attributes:
        disable: rewrite kinds (names in :data:`REWRITE_KINDS`) that must not fire.
        check: when True, every rewritten site is run on the real example inputs at
            compile time and compared against the original subgraph; sites that
            disagree beyond ``check_rtol``/``check_atol`` are put back (report
            action ``kept``, reason ``check failed``).
        check_rtol, check_atol: tolerances of ``check`` (applied as in
            ``torch.allclose``, computed in fp32; the relative tolerance is never below
            two units in the last place of the coarsest dtype the site's inputs have, e.g.
            0.016 for a bf16 softmax: eager's own result is only that exact).
        cpu: what to do with sites on CPU tensors. ``"auto"`` (default) rewrites
            only where smxcompile's CPU path was measured faster than Inductor's
            own C++ code (see docs/PERFORMANCE.md) and keeps the rest;
            ``"rewrite"`` rewrites every site; ``"keep"`` rewrites none.
        cuda: the same for sites on CUDA tensors: ``"auto"`` (default) keeps the kinds
            measured slower than Inductor on a GPU, or not yet timed against it
            (``smxcompile.passes.policy.CUDA_RULES``: today every kind but attention) and
            rewrites the rest. ``"keep"``, like ``cpu="keep"``, still rewrites the sites whose
            rewrite deletes work or that Inductor would compute otherwise.
        attention_softmax: rewrite the softmax of an attention block (score matmul ->
            softmax -> value matmul) as a standalone ``smx::softmax`` when the
            attention rewrite does not take the block (kind ``attention`` disabled,
            or the site skipped). Off by default: Inductor fuses such softmaxes with
            their neighbours.
        attention_normalizer: the normalizer of every rewritten attention site
            (one of :data:`ATTENTION_NORMALIZERS`); ``"softmax"`` (default) keeps
            the model's math. Anything else changes the model: only when asked.
        attention_norm_param: the normalizer's parameter (sigmoid bias, SSMax scale,
            ...; None: its default, see ``smxcompile.kernels.attention.NORMALIZERS``).
        inductor: extra Inductor config patches passed to ``compile_fx``.

    Raises:
        ValueError: on an unknown option name, an unknown rewrite kind or a bad value.
    """

    disable: frozenset[str] = frozenset()
    check: bool = False
    check_rtol: float = 1e-3
    check_atol: float = 1e-5
    cpu: str = "auto"
    cuda: str = "auto"
    attention_softmax: bool = False
    attention_normalizer: str = "softmax"
    attention_norm_param: float | None = None
    inductor: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def from_mapping(cls, options: Mapping[str, Any] | "SmxOptions" | None) -> "SmxOptions":
        """Build options from the dict given to ``torch.compile(..., options=...)``."""
        if options is None:
            return cls()
        if isinstance(options, SmxOptions):
            # an instance built directly is validated like a dict (the dataclass itself checks nothing)
            d = dataclasses.asdict(options)
            d["disable"] = sorted(options.disable)
            d["inductor"] = dict(options.inductor)
            options = d
        if not isinstance(options, Mapping):
            raise ValueError(f"smx options must be a dict, got {type(options).__name__}")
        known = {f.name for f in dataclasses.fields(cls)} | set(REWRITE_KINDS)
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(
                f"unknown smx option(s) {unknown}; known options: {sorted(known)} "
                f"(rewrite kinds can be switched off with {{'<kind>': False}} or {{'disable': [...]}})"
            )
        raw_disable = options.get("disable", ())
        if isinstance(raw_disable, str) or not all(isinstance(k, str) for k in raw_disable):
            raise ValueError(f"smx option 'disable' must be a list of rewrite kinds, got {raw_disable!r}")
        disable = set(raw_disable)
        for key in ("check", "attention_softmax"):
            if key in options and not isinstance(options[key], bool):
                raise ValueError(f"smx option {key!r} must be True or False, got {options[key]!r}")
        for key in ("check_rtol", "check_atol"):
            if key in options:
                v = options[key]
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                    raise ValueError(f"smx option {key!r} must be a finite number >= 0, got {v!r}")
        for kind in REWRITE_KINDS:
            if kind in options:
                if not isinstance(options[kind], bool):
                    raise ValueError(f"smx option {kind!r} must be True or False, got {options[kind]!r}")
                if not options[kind]:
                    disable.add(kind)
        bad = sorted(disable - set(REWRITE_KINDS))
        if bad:
            raise ValueError(f"unknown rewrite kind(s) {bad} in 'disable'; known kinds: {list(REWRITE_KINDS)}")
        for key in ("cpu", "cuda"):
            v = options.get(key, "auto")
            if not isinstance(v, str) or v not in _DEVICE_POLICIES:
                raise ValueError(f"smx option {key!r} must be one of {_DEVICE_POLICIES}, got {options[key]!r}")
        normalizer = options.get("attention_normalizer", "softmax")
        if not isinstance(normalizer, str) or normalizer not in NORMALIZERS:
            raise ValueError(f"smx option 'attention_normalizer' must be one of {tuple(NORMALIZERS)}, "
                             f"got {normalizer!r}")
        norm_param = options.get("attention_norm_param")
        if norm_param is not None and (isinstance(norm_param, bool) or not isinstance(norm_param, (int, float))
                                       or not math.isfinite(norm_param)):
            raise ValueError(f"smx option 'attention_norm_param' must be a finite number or None, got {norm_param!r}")
        norm_param = None if norm_param is None else float(norm_param)
        if norm_param is not None and not NORMALIZERS[normalizer].takes_param:
            with_param = [name for name, entry in NORMALIZERS.items() if entry.takes_param]
            raise ValueError(f"smx option 'attention_norm_param' is given, but attention_normalizer={normalizer!r} "
                             f"has no parameter ({', '.join(with_param[:-1])} and {with_param[-1]} have one)")
        inductor = options.get("inductor", {}) or {}
        if not isinstance(inductor, Mapping):
            raise ValueError("smx option 'inductor' must be a dict of Inductor config patches")
        return cls(
            disable=frozenset(disable),
            check=bool(options.get("check", False)),
            check_rtol=float(options.get("check_rtol", 1e-3)),
            check_atol=float(options.get("check_atol", 1e-5)),
            cpu=options.get("cpu", "auto"),
            cuda=options.get("cuda", "auto"),
            attention_softmax=bool(options.get("attention_softmax", False)),
            attention_normalizer=normalizer,
            attention_norm_param=norm_param,
            inductor=tuple(sorted(inductor.items())),
        )

    def enabled(self, kind: str) -> bool:
        """Whether rewrite kind ``kind`` may fire."""
        return kind not in self.disable

    def key(self) -> str:
        """A stable string of every option that changes what the passes do (part of the pass uuid)."""
        d = dataclasses.asdict(self)
        d["disable"] = sorted(self.disable)
        d["inductor"] = [list(kv) for kv in self.inductor]
        return json.dumps(d, sort_keys=True, default=repr)
