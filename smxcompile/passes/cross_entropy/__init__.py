"""Cross-entropy sites: ``linear -> ... -> cross_entropy`` becomes cut cross-entropy, a loss on given logits the
online cross-entropy. :mod:`.matcher` finds them, :mod:`.rewrite` decides and rewrites, :mod:`.replacement`
is what the rewritten graph calls."""

from .matcher import CEMatch
from .replacement import graph_cross_entropy, graph_linear_cross_entropy
from .rewrite import CrossEntropyPass

__all__ = ["CEMatch", "CrossEntropyPass", "graph_cross_entropy", "graph_linear_cross_entropy"]
