"""How Dynamo traces for the ``smx`` backend: logging calls are no-ops inside the traced code, for smx only.

A logging call (``logger.warning_once(...)`` in transformers' ``PreTrainedModel.loss_function`` when
``loss_type`` is unset, which is every stock model) is a Dynamo graph break: the LM head and the loss land in
two graphs, the loss graph sees the logits as an input, and cut cross-entropy has nothing to fuse. Dynamo can
treat logging functions as no-ops (``torch._dynamo.config.ignore_logging_functions``), but that setting is
process-wide and would silence logging for every other backend too.

Dynamo enters a backend's ``backend_ctx_ctor`` around each call of a function compiled with it (tracing
included; ``torch/_dynamo/eval_frame.py``, ``_optimize``), but ``torch.compile`` hands Dynamo its backend
wrapped in ``_TorchCompileWrapper`` then ``WrapBackendDebug``, and the attribute is lost on the way. The shim
below copies it across for the ``smx`` backend only, so the ignore set holds the logging functions exactly
while an smx-compiled function runs and is restored after; every other backend is untouched.
"""

from __future__ import annotations

import functools
import logging
import threading
from typing import Any, Callable

import torch

log = logging.getLogger("smxcompile")

_LOGGER_METHODS = ("debug", "info", "warning", "warn", "error", "critical", "log",
                   # transformers adds these to logging.Logger (transformers/utils/logging.py)
                   "warning_once", "info_once", "warning_advice")

_lock = threading.Lock()
_depth = 0
_added: list[Callable[..., Any]] = []
_ignore: set = set()        # the ignore set the outermost entry added to (cleaned on exit, even if replaced since)
_functions: tuple[int, list[Callable[..., Any]]] = (-1, [])


def logging_functions() -> list[Callable[..., Any]]:
    """The ``logging.Logger`` methods (and transformers' additions to it) an smx trace treats as no-ops."""
    global _functions
    # entered around every call of an smx-compiled function: looked up again only when Logger's methods change
    # (transformers adds its own when it is imported)
    n = len(vars(logging.Logger))
    if _functions[0] != n:
        _functions = (n, [getattr(logging.Logger, name) for name in _LOGGER_METHODS if hasattr(logging.Logger, name)])
    return _functions[1]


class ignore_logging:  # noqa: N801  (used as a context manager, like contextlib's)
    """While active, Dynamo treats logging calls as no-ops (no graph break); re-entrant, restored on exit.

    Only the functions this context added are removed on exit, so a user's own entries in
    ``torch._dynamo.config.ignore_logging_functions`` stay as they were."""

    def __enter__(self) -> None:
        global _depth, _ignore
        with _lock:
            if _depth == 0:
                _ignore = torch._dynamo.config.ignore_logging_functions
                _added[:] = [f for f in logging_functions() if f not in _ignore]
                _ignore.update(_added)
            _depth += 1

    def __exit__(self, *exc: object) -> None:
        global _depth
        with _lock:
            _depth -= 1
            if _depth == 0:
                for f in _added:
                    _ignore.discard(f)
                _added.clear()


def install(backend: Callable[..., Any]) -> bool:
    """Make ``torch.compile(..., backend=<backend>)`` enter ``backend.backend_ctx_ctor`` (Dynamo's own hook)
    around each call of the compiled function. Returns False (and logs why) where this torch lays out its
    wrappers differently: logging then stays a graph break, as with any backend."""
    try:
        from torch._dynamo.repro.after_dynamo import WrapBackendDebug
    except ImportError:
        log.debug("smx: torch._dynamo.repro.after_dynamo.WrapBackendDebug not found; logging stays a graph break")
        return False
    init = WrapBackendDebug.__init__
    if getattr(init, "_smx_forwards_ctx", False):
        return True

    @functools.wraps(init)
    def __init__(self, unconfigured_compiler_fn, compiler_name):
        init(self, unconfigured_compiler_fn, compiler_name)
        inner = getattr(unconfigured_compiler_fn, "compiler_fn", unconfigured_compiler_fn)   # _TorchCompileWrapper
        if inner is backend:
            self.backend_ctx_ctor = backend.backend_ctx_ctor

    __init__._smx_forwards_ctx = True
    WrapBackendDebug.__init__ = __init__
    return True


__all__ = ["ignore_logging", "install", "logging_functions"]
