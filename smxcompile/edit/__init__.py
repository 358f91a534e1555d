"""The eager model edits: change what a model's softmax calls compute, before it is compiled or exported.

* :mod:`.sites`: run-time interception of a model's softmax calls, named ``module#index`` as
  :func:`smxcompile.explain` names them (forward hooks + a ``TorchFunctionMode``); the lower layer of
  the two edits below.
* :mod:`.variants`: the registry of normalization variants (``smxcompile.variants``).
* :mod:`.swap`: :func:`smxcompile.swap`, a variant in place of the softmax; :mod:`.swap_io`:
  ``smxcompile.save`` / ``load`` / ``from_pretrained`` of a swapped model.
* :mod:`.quantize`: :func:`smxcompile.quantize_softmax`, quantized softmax outputs with a bias correction;
  :mod:`.quant_site`: one quantized site.

The compiler (``smxcompile.backends`` / ``passes`` / ``kernels``) never imports this package; it reads the
annotations the edited sites carry in FX graphs.
"""
