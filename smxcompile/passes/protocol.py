"""The pass protocol: what every rewrite kind provides, so that analysis, rewriting and ``check`` iterate one list.

A rewrite kind is one :class:`RewritePass` in :data:`smxcompile.passes.manager.PASSES`; its sites are
:class:`Match` objects (the matched nodes, the action the policy chose, why). Modelled on Inductor's pattern
matcher (torch/_inductor/pattern_matcher.py) and vLLM's pass manager (vllm/compilation/), over our own matching
of the pre-grad graph.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any

from torch.fx import Graph, Node

from ..options import SmxOptions
from ..report import Site, user_location
from .patterns.graph import stack_trace


@dataclasses.dataclass
class PassContext:
    """What a pass knows about the graph it analyses.

    Attributes:
        skip: keys of sites to keep (their ``check`` failed).
        prefix: the subgraph's name (``"wrap_body_0/"``) in every site key; ``""`` for the top graph.
        export: the graph is captured for an export (ONNX, MLIR): rewritten sites call the smx ops on every
            device, with no eager-only fix-ups.
        functorch: the torch.func transform op the graph runs (grad / vmap), if any: nothing is rewritten.
    """

    options: SmxOptions
    skip: frozenset[str] = frozenset()
    prefix: str = ""
    export: bool = False
    functorch: str | None = None


@dataclasses.dataclass(kw_only=True)
class Match:
    """One candidate site. Subclasses add their pattern's fields and define ``anchor`` (the node the replacement
    takes the place of) and ``dead`` (the pattern's nodes).

    Attributes:
        action: ``rewritten``, ``kept`` (left to Inductor on purpose) or ``skipped`` (not safe to rewrite).
        device: the device type of the site's input (``?`` before the policy ran).
        keep_whole: a kept site whose nodes later passes must leave alone (rewritten sites always claim theirs).
        guarded: a site not rewritten that Inductor is known to mis-compile: :meth:`RewritePass.guard` hands it
            over in a form Inductor cannot mis-compile; its nodes are claimed.
        route: the lowering, for a kind whose lowerings are ruled apart on CUDA (a key of ``CUDA_RULES``).
    """

    action: str = "rewritten"
    reason: str = ""
    device: str = "?"
    prefix: str = ""
    keep_whole: bool = False
    guarded: bool = False
    route: str = ""

    @property
    def key(self) -> str:
        """The site's name across a graph and its subgraphs (``check`` and ``skip`` use it)."""
        return self.prefix + self.anchor.name

    def skip(self, reason: str) -> "Match":
        """Mark the site skipped with ``reason``; returns it."""
        self.action, self.reason = "skipped", reason
        return self

    def keep(self, reason: str, whole: bool = False) -> "Match":
        """Mark the site kept with ``reason`` (``whole``: claim its nodes, see :attr:`keep_whole`); returns it."""
        self.action, self.reason = "kept", reason
        self.keep_whole = self.keep_whole or whole
        return self

    def nodes(self) -> set[Node]:
        """The pattern's nodes (what a rewrite replaces)."""
        return {self.anchor, *self.dead}

    def claims(self) -> bool:
        """Later passes must leave this site's nodes alone."""
        return self.action == "rewritten" or self.keep_whole or self.guarded

    def detail(self) -> str:
        """What the match absorbed (the report's detail column)."""
        return ""

    def op_name(self) -> str:
        """The op the rewritten site calls (the report's op column)."""
        return ""

    def site_node(self) -> Node:
        """The node whose stack trace names the site's location."""
        return self.anchor

    def to_site(self, graph_tag: str) -> Site:
        """The report entry of this site."""
        return Site(kind=self.kind, action=self.action, reason=self.reason,
                    location=user_location(stack_trace(self.site_node())),
                    op=self.op_name() if self.action == "rewritten" else "", detail=self.detail(),
                    graph=graph_tag, node=self.key)


class RewritePass(abc.ABC):
    """One rewrite kind. ``name``: its report kind unless the matches say otherwise; ``repeat``: look again
    after a rewrite (nested sites: ``softmax(softmax(x).float())`` is rewritten inside out, a round per level)."""

    name: str = ""
    repeat: bool = False

    @abc.abstractmethod
    def find(self, graph: Graph, ctx: PassContext, exclude: set) -> list[Match]:
        """Every site of ``graph`` with the action the backend will take; the graph is not changed.
        Nodes in ``exclude`` belong to earlier passes' sites."""

    @abc.abstractmethod
    def rewrite(self, graph: Graph, match: Match, ctx: PassContext) -> None:
        """Replace the ``rewritten`` site ``match`` in ``graph``."""

    def guard(self, graph: Graph, match: Match, ctx: PassContext) -> None:
        """Hand the ``guarded`` (not rewritten) site ``match`` to Inductor in a form it cannot mis-compile."""

    def touched(self, match: Match) -> set[Node]:
        """Nodes a rewrite of ``match`` changes: two sites touching the same node are not rewritten in one round."""
        return match.nodes()

    def check_inputs(self, match: Match) -> list[Node]:
        """The nodes whose values :meth:`run_site` reads (``check``)."""
        return []

    def checkable(self, match: Match) -> bool:
        """Whether ``check`` can compare the rewrite of ``match`` with eager (not when it changes the math on
        purpose, e.g. a requested attention normalizer)."""
        return match.action == "rewritten"

    def run_site(self, match: Match, values: dict[str, Any]) -> Any:
        """The rewritten site's result on captured values (``values[node name]``); ``check`` compares it."""
        raise NotImplementedError(f"{type(self).__name__} cannot run a site on captured values")

    def check_nodes(self, match: Match) -> list[Node]:
        """The nodes whose eager values :meth:`agrees` compares with (default: the anchor)."""
        return [match.anchor]

    def agrees(self, match: Match, ours: Any, values: dict[str, Any], close) -> bool:
        """Whether ``ours`` (from :meth:`run_site`) agrees with eager; ``close(a, b)`` compares two tensors."""
        return close(ours, values[match.anchor.name])


__all__ = ["PassContext", "Match", "RewritePass"]
