"""MLIR export of the rewritten model: :func:`smxcompile.export_mlir` (:mod:`.export`), lowered by :mod:`.lower`,
checked by :mod:`.check` on MLIR's JIT (:mod:`.run`)."""
