"""Test set-up: Triton runs through its interpreter on machines without a GPU.

TRITON_INTERPRET must be set before triton decorates any kernel, so it is set here, before
any test module imports smxcompile's Triton kernels. On a CUDA machine the real GPU path is
tested instead.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Keep compile-heavy tests inside the 2-core budget.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

# Tests read the backend's compiled-graph reports (smxcompile.backends.smx.compiled_reports): the submodule is
# imported here, so a test file run alone finds it as the whole suite does.
import smxcompile.backends.smx  # noqa: E402,F401
