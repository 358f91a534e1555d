"""FX pattern passes: find softmax-shaped subgraphs in the torch-level (pre-grad) graph and rewrite them to smx ops.

* :mod:`.manager`: the one ordered list of passes (:data:`PASSES`), :func:`analyze`, :class:`SmxPass`
  (Inductor's ``pre_grad_custom_pass``);
* :mod:`.check`: the ``check`` option, over the same list;
* :mod:`.protocol`: what a rewrite kind provides; :mod:`.policy`: the decision ladder and the CPU rules table;
* :mod:`.patterns`: the sub-patterns every pass matches the same way;
* one module or package per rewrite kind: :mod:`.cross_entropy`, :mod:`.quant_softmax`, :mod:`.attention`,
  :mod:`.softmax_topk`, :mod:`.softmax`.
"""

from .manager import PASSES, SmxPass, analyze, source_hash  # noqa: F401

__all__ = ["PASSES", "SmxPass", "analyze", "source_hash"]
