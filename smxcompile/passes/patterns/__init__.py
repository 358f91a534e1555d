"""Sub-patterns every pass matches the same way, each in one place.

* :mod:`.graph`: the canonical view of a torch-level FX graph (one name per spelling of an op), fake values,
  shapes compared without guards, mutations, random sources, erasing nodes;
* :mod:`.arith`: a scale (multiply / divide by a constant) and a soft-cap ``c * tanh(x / c)``;
* :mod:`.casts`: floating-point casts a fused op may take in (exact up-casts) and those it must not;
* :mod:`.masks`: additive float masks and boolean ``masked_fill`` / ``where`` masks;
* :mod:`.constants`: compile-time evaluation of constant subgraphs (transformers' causal masks) and the
  causal-mask test.
"""
