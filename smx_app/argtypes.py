"""``argparse`` types shared by the ``smx`` commands and the benchmark scripts."""

from __future__ import annotations

import argparse
import math


def nonneg_int(text: str) -> int:
    """An integer >= 0 (``argparse`` type); raises ``ArgumentTypeError`` otherwise."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}")
    return v


def positive_int(text: str) -> int:
    """An integer > 0 (``argparse`` type); raises ``ArgumentTypeError`` otherwise."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer > 0, got {text!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be an integer > 0, got {text!r}")
    return v


def positive_float(text: str) -> float:
    """A finite number > 0 (``argparse`` type); raises ``ArgumentTypeError`` otherwise."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}") from None
    if not (math.isfinite(v) and v > 0):
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}")
    return v
