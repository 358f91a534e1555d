"""ONNX export of the rewritten model (:func:`smxcompile.export_onnx`, in :mod:`.export`).

:mod:`.export` the entry point; :mod:`.result` what it returns (:class:`~.result.OnnxExport`, its summary) and
raises; :mod:`.target` the runtime / opset / attention form; :mod:`.translate` the translation table, gathered
from :mod:`.softmax`, :mod:`.cross_entropy` and :mod:`.attention` (with :mod:`.attention_normalizers`);
:mod:`.runtime` onnxruntime sessions, timing and the check's runs; :mod:`.baseline` the plain
``torch.onnx.export`` of ``compare=True``.
"""
