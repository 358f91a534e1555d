"""Backends: the ``smx`` torch.compile backend (ONNX / MLIR export is :mod:`smxcompile.export`)."""
