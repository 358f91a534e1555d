"""MLIR export of the rewritten model through torch-mlir (:func:`smxcompile.export_mlir`, in :mod:`.export`).

:mod:`.export` the entry point; :mod:`.result` what it returns (:class:`~.result.MlirExport`) and raises;
:mod:`.lower` the decompositions and torch-mlir's import and lowering; :mod:`.check` the module verified and
run against PyTorch; :mod:`.run` a ``linalg-on-tensors`` module compiled and run on MLIR's JIT.
"""
