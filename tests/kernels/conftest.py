"""Fixtures of the kernel tests (defined in kernels_testing.py, which also holds the importable helpers):
``torch_path`` (the ops' torch path), ``triton_spy`` (count the Triton launches), ``import_without_triton``."""

from kernels_testing import import_without_triton, torch_path, triton_spy  # noqa: F401  (fixtures)
