"""What the kernel tests share (importable: tests/kernels is on sys.path while they run).

TRITON_INTERPRET=1 is set by tests/conftest.py on a machine without CUDA, before any kernel is decorated:
there the kernels run through Triton's interpreter on CPU tensors; on a CUDA machine the same tests run the
compiled kernels.

Fixtures (tests/kernels/conftest.py offers them to every kernel test): :func:`torch_path`, :func:`triton_spy`,
:func:`import_without_triton`.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import textwrap

import pytest
import torch

#: Triton's interpreter is on (TRITON_INTERPRET=1).
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
#: Where the kernel tests put their tensors: CPU under the interpreter, else CUDA.
DEVICE = "cpu" if INTERPRET or not torch.cuda.is_available() else "cuda"
#: ``pytestmark`` of a Triton kernel test module: the marker, and numpy's warnings (the interpreter) about exp
#: overflow / inf - inf in lanes the kernels discard.
TRITON_MARKS = [pytest.mark.triton, pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")]
#: The repository root (what a subprocess needs on its PYTHONPATH).
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def require_triton() -> None:
    """Skip the calling test module (call it at module level) without triton, or with neither CUDA nor the
    interpreter."""
    pytest.importorskip("triton")
    if DEVICE == "cpu" and not INTERPRET:  # pragma: no cover
        pytest.skip("needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)


def compile_for_sm90(script: str, compiled: int, timeout: float = 300) -> None:
    """Run ``script`` (indented text, dedented here), which compiles kernels for sm_90 with ``triton.compile``
    (no GPU needed: the interpreter is lax about types) and prints ``compiled <n>``, in a fresh process without
    TRITON_INTERPRET (kernels decorated for a GPU), the repository first on its path. The script starts with
    ``re``, ``triton`` and ``target`` (a ``GPUTarget`` for sm_90) defined and warnings silenced.

    Skips without triton's nvidia backend; fails unless the script exits 0 and printed ``compiled <compiled>``.
    """
    try:
        from triton.backends import backends
    except Exception:  # pragma: no cover
        pytest.skip("triton without backends")
    if "nvidia" not in backends:  # pragma: no cover
        pytest.skip("triton's nvidia backend is not installed")
    header = ("import re, warnings; warnings.filterwarnings('ignore')\nimport triton\n"
              "from triton.backends.compiler import GPUTarget\ntarget = GPUTarget('cuda', 90, 32)\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", header + textwrap.dedent(script)], env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0 and f"compiled {compiled}" in proc.stdout, proc.stderr[-4000:]


# --------------------------------------------------------------------------- fixtures


@pytest.fixture
def torch_path(monkeypatch):
    """The ops' torch (CPU) path, whatever a test or the environment (SMX_FORCE_TRITON) set."""
    from smxcompile.kernels import config

    monkeypatch.setattr(config, "force_triton", False)
    return config


@pytest.fixture
def triton_spy(monkeypatch):
    """Force the Triton path and count launcher calls: ``triton_spy(module, name, ...)`` wraps each
    ``module.<name>`` and returns ``{name: calls}`` (one dict for every name the test spies on, kept up to date
    as they run); ``triton_spy.args`` lists the ``(name, first argument)`` of every call, in order."""
    from smxcompile.kernels import config

    monkeypatch.setattr(config, "force_triton", True)
    log = []
    counts = {}

    def spy(module, *names):
        for name in names:
            counts[name] = 0
            real = getattr(module, name)

            def counted(*a, _real=real, _name=name, **k):
                counts[_name] += 1
                log.append((_name, a[0] if a else None))
                return _real(*a, **k)

            monkeypatch.setattr(module, name, counted)
        return counts

    spy.args = log
    return spy


@pytest.fixture
def import_without_triton(monkeypatch):
    """``import_without_triton("smxcompile.kernels.x.y", ...)``: import these modules afresh (with
    smxcompile.kernels.triton_helpers) as if triton were not installed, and return the last one. The modules
    imported before are put back afterwards."""

    def load(*names):
        for name in [m for m in sys.modules if m == "triton" or m.startswith("triton.")]:
            monkeypatch.setitem(sys.modules, name, None)
        monkeypatch.setitem(sys.modules, "triton", None)
        mod = None
        for name in ("smxcompile.kernels.triton_helpers", *names):
            if name in sys.modules:
                monkeypatch.delitem(sys.modules, name)
                parent, _, child = name.rpartition(".")
                monkeypatch.setattr(sys.modules[parent], child, getattr(sys.modules[parent], child))
            mod = importlib.import_module(name)
        return mod

    return load


#: Apple CCE's per-element tolerance of its backward test (tests/test_cce_loss_backward.py), by dtype
CCE_TOL = {torch.bfloat16: 1e-2, torch.float16: 1e-3}
