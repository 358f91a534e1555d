"""FX pattern passes: find softmax-shaped subgraphs and rewrite them to smx ops."""

from .framework import SmxPass, analyze, source_hash  # noqa: F401
