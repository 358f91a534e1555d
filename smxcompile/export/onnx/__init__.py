"""ONNX export of the rewritten model: :func:`smxcompile.export_onnx` (:mod:`.export`), its translations
(:mod:`.translate`), target (:mod:`.target`), onnxruntime runs (:mod:`.runtime`, :mod:`.baseline`)."""
