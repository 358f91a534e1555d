"""The rewrite report: every candidate site the passes saw and what they did with it."""

from __future__ import annotations

import dataclasses
import logging
import re
from typing import Any, Iterable, Iterator

log = logging.getLogger("smxcompile")

ACTIONS = ("rewritten", "kept", "skipped", "swapped")


@dataclasses.dataclass
class Site:
    """One candidate subgraph.

    Attributes:
        kind: what was found: ``attention``, ``quant_softmax`` (softmax feeding a quantizer),
            ``softmax_topk``, ``softmax``, ``log_softmax``, ``cross_entropy``, ``linear_cross_entropy``.
        action: ``rewritten`` (replaced by ``op``), ``kept`` (left to Inductor on
            purpose, e.g. because Inductor's own code is as fast) or ``skipped``
            (could not be rewritten safely), or ``swapped`` (the user replaced its softmax with a
            variant through :func:`smxcompile.swap`; ``op`` names the variant, its ops go to Inductor).
        reason: why it was kept or skipped (empty when rewritten).
        location: the user's ``file:line`` (from the FX node's stack trace), or ``?``.
        op: the smxcompile op that replaced it, e.g. ``smx::softmax``.
        detail: what the match absorbed (dim, dtype, scale, mask, softcap, casts...).
        graph: which compiled graph it belongs to (``g0``, ``g1``... in compile order).
        node: the FX node name of the matched softmax.
        module: qualified name of the innermost ``nn.Module`` whose ``forward`` made the call
            (``"transformer.h.0.attn"``; ``""`` for the root module or a plain function).
        index: which softmax call of that module's ``forward`` this is (0, 1, ... in call order),
            or -1 when the site has no ``softmax`` call (hand-written ``exp / sum``, cross-entropy).
            ``(module, index)`` names the site in the eager model: :func:`smxcompile.quantize_softmax`
            uses it to find the call at run time.
    """

    kind: str
    action: str
    reason: str = ""
    location: str = "?"
    op: str = ""
    detail: str = ""
    graph: str = ""
    node: str = ""
    module: str = ""
    index: int = -1

    @property
    def key(self) -> str:
        """``module#index``, e.g. ``transformer.h.0.attn#0``: the site's name in the eager model."""
        return f"{self.module}#{self.index}"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class Report:
    """The list of :class:`Site` s found in a model, printable as a table.

    ``print(report)`` shows a table (its ``site`` column is :attr:`Site.key`, the name
    :func:`smxcompile.quantize_softmax` takes in ``where=[...]``); ``report.to_dict()`` gives JSON-ready data;
    ``len(report)``, iteration and ``report.count(kind=..., action=...)`` help tests.
    """

    def __init__(self, sites: Iterable[Site] = (), notes: Iterable[str] = ()):
        self.sites: list[Site] = list(sites)
        self.notes: list[str] = list(notes)

    def __iter__(self) -> Iterator[Site]:
        return iter(self.sites)

    def __len__(self) -> int:
        return len(self.sites)

    def extend(self, other: "Report") -> None:
        self.sites.extend(other.sites)
        self.notes.extend(other.notes)

    def filter(self, kind: str | None = None, action: str | None = None) -> list[Site]:
        """Sites of the given kind and/or action."""
        return [s for s in self.sites if (kind is None or s.kind == kind) and (action is None or s.action == action)]

    def count(self, kind: str | None = None, action: str | None = None) -> int:
        return len(self.filter(kind, action))

    def summary(self) -> dict[str, dict[str, int]]:
        """``{kind: {action: count}}``."""
        out: dict[str, dict[str, int]] = {}
        for s in self.sites:
            out.setdefault(s.kind, {}).setdefault(s.action, 0)
            out[s.kind][s.action] += 1
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"sites": [s.to_dict() for s in self.sites], "summary": self.summary(), "notes": list(self.notes)}

    def __str__(self) -> str:
        if not self.sites:
            lines = ["smxcompile report: no softmax-shaped sites found"]
            lines += [f"note: {n}" for n in self.notes]
            return "\n".join(lines)
        cols = ["#", "graph", "kind", "action", "op", "site", "location", "detail / reason"]
        rows = []
        for i, s in enumerate(self.sites):
            done = s.action in ("rewritten", "swapped")
            why = s.detail if done else s.reason
            if not done and s.detail:
                why = f"{s.reason} [{s.detail}]"
            site = s.key if s.index >= 0 else (s.module or "-")
            rows.append([str(i), s.graph, s.kind, s.action, s.op or "-", site, _short_location(s.location), why])
        widths = [max(len(c), *(len(r[j]) for r in rows)) for j, c in enumerate(cols)]
        widths[-1] = len(cols[-1])  # last column is free text
        fmt = lambda r: "  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip()  # noqa: E731
        head = "smxcompile report: " + ", ".join(
            f"{kind}: " + ", ".join(f"{n} {a}" for a, n in sorted(acts.items()))
            for kind, acts in sorted(self.summary().items())
        )
        lines = [head, fmt(cols), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    __repr__ = __str__


def _short_location(loc: str) -> str:
    """``/long/path/to/file.py:12`` -> ``to/file.py:12`` for the table."""
    parts = loc.replace("\\", "/").split("/")
    return "/".join(parts[-2:]) if len(parts) > 2 else loc


_FRAME = re.compile(r'File "([^"]+)", line (\d+)')
_OP_FORWARDERS = ("einops", "einx", "opt_einsum")


def user_location(stack_trace: str | None) -> str:
    """The innermost ``file:line`` of an FX node's ``stack_trace`` that is not torch's own code."""
    if not stack_trace:
        return "?"
    frames = _FRAME.findall(stack_trace)
    for path, line in reversed(frames):
        p = path.replace("\\", "/")
        if "/torch/" in p and "/site-packages/torch/" in p:
            continue
        if "/smxcompile/edit/" in p:   # smxcompile's run-time interception (the eager model edits), not the user's call
            continue
        if any(f"/{lib}/" in p for lib in _OP_FORWARDERS):  # einops.einsum and the like call torch for the user
            continue
        return f"{path}:{line}"
    if frames:
        path, line = frames[-1]
        return f"{path}:{line}"
    return "?"
