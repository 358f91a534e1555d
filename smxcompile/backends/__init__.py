"""Backends: the ``smx`` torch.compile backend (and, later, ONNX / MLIR export)."""
