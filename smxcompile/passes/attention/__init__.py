"""Attention sites: every spelling of ``softmax(q @ k^T * scale + mask) @ v`` becomes one fused attention call.
:mod:`.matcher` finds them, :mod:`.rewrite` checks, decides and rewrites, :mod:`.replacement` is what the
rewritten graph calls."""

from .matcher import AttentionMatch
from .replacement import graph_attention, graph_sdpa
from .rewrite import AttentionPass

__all__ = ["AttentionMatch", "AttentionPass", "graph_attention", "graph_sdpa"]
