"""Run a ``linalg-on-tensors`` module on the CPU with what the ``torch-mlir`` wheel ships: its passes and MLIR's
``ExecutionEngine`` (LLVM JIT), for :func:`smxcompile.export_mlir`'s check.

:data:`PIPELINE` and the calling convention (results passed to a ``refbackend_consume_func_return_<types>``
callback) are those of torch-mlir's e2e RefBackend, ``projects/pt1/python/torch_mlir_e2e_test/
linalg_on_tensors_backends/refbackend.py``. Design: docs/DESIGN.md, 'MLIR export: the JIT runner'.
"""

from __future__ import annotations

import ctypes
from typing import Sequence

import numpy as np

__all__ = ["PIPELINE", "LinalgModule", "RunError", "check_arguments", "new_context", "run_linalg", "signatures"]

PIPELINE = "builtin.module(" + ",".join([
    "func.func(linalg-generalize-named-ops)",
    "func.func(linalg-fuse-elementwise-ops)",
    "convert-shape-to-std",
    "func.func(refback-generalize-tensor-pad)",
    "func.func(refback-generalize-tensor-concat)",
    "func.func(tm-tensor-bufferize)",
    "one-shot-bufferize{copy-before-write bufferize-function-boundaries "
    "function-boundary-type-conversion=identity-layout-map}",
    "refback-mlprogram-bufferize",
    "buffer-deallocation-pipeline",
    "inline",
    "refback-munge-calling-conventions",
    "func.func(tm-tensor-to-loops)",
    "func.func(refback-munge-memref-copy)",
    "func.func(convert-linalg-to-loops)",
    "func.func(lower-affine)",
    "convert-scf-to-cf",
    "func.func(refback-expand-ops-for-llvm)",
    "func.func(arith-expand)",
    "func.func(convert-math-to-llvm)",
    "convert-math-to-libm",
    "expand-strided-metadata",
    "finalize-memref-to-llvm",
    "lower-affine",
    "convert-bufferization-to-memref",
    "finalize-memref-to-llvm",
    "func.func(convert-arith-to-llvm)",
    "convert-vector-to-llvm",
    "convert-func-to-llvm",
    "convert-cf-to-llvm",
    "convert-complex-to-llvm",
    "reconcile-unrealized-casts",
]) + ")"

#: Element types of the return callbacks' names (``mr<type>``: a memref of it) -> numpy dtype.
_MEMREF_DTYPES = {
    "f16": np.float16, "f32": np.float32, "f64": np.float64,
    "i1": np.bool_, "i8": np.int8, "ui8": np.uint8, "i16": np.int16, "i32": np.int32, "i64": np.int64,
}
#: Input dtypes the descriptors can carry (no bfloat16 in numpy).
INPUT_DTYPES = (np.float16, np.float32, np.float64, np.bool_, np.int8, np.uint8, np.int16, np.int32, np.int64)
#: Element types of a function's tensor arguments -> the numpy dtypes an input may have there (torch-mlir's
#: linalg types are signless: ``i8`` holds int8 and uint8 tensors alike).
_ARG_DTYPES = {
    "f16": (np.float16,), "f32": (np.float32,), "f64": (np.float64,), "i1": (np.bool_,), "i8": (np.int8, np.uint8),
    "ui8": (np.uint8,), "si8": (np.int8,), "i16": (np.int16,), "i32": (np.int32,), "i64": (np.int64,),
}
_RETURN_PREFIX = "refbackend_consume_func_return_"


def new_context():
    """A torch-mlir context that parses every form an export writes: the ``torch`` dialect, StableHLO (when the
    wheel has it) and torch-mlir's ``tm_tensor`` (sort, top-k, scatter in ``linalg-on-tensors`` modules), which
    no Python call registers: running a conversion that depends on it on an empty module loads it."""
    from torch_mlir import ir
    from torch_mlir.dialects import torch as torch_d
    from torch_mlir.passmanager import PassManager

    ctx = ir.Context()
    torch_d.register_dialect(ctx)
    try:
        from torch_mlir._mlir_libs import _stablehlo

        _stablehlo.register_dialect(ctx)
    except ImportError:          # a wheel built without StableHLO
        pass
    with ctx:
        try:
            PassManager.parse("builtin.module(func.func(convert-torch-to-tmtensor))").run(
                ir.Module.parse("module {}").operation)
        except Exception:        # a wheel without the pass: tm_tensor ops will not parse
            pass
    return ctx


class RunError(RuntimeError):
    """The module could not be compiled for, or run on, the JIT, or inputs do not fit its signature."""


def signatures(module) -> dict[str, list[tuple[tuple[int | None, ...], str]]]:
    """``{function name: [(shape, element type) per argument]}`` of the module's public functions, ``None``
    for a dynamic dim (``tensor<2x?xi64>`` -> ``((2, None), "i64")``); an argument that is not a ranked
    tensor has shape ``None``."""
    from torch_mlir import ir

    out: dict[str, list] = {}
    for op in module.body.operations:
        if op.operation.name != "func.func" or "sym_visibility" in op.attributes:
            continue
        ftype = ir.FunctionType(ir.TypeAttr(op.attributes["function_type"]).value)
        args = []
        for t in ftype.inputs:
            try:
                rt = ir.RankedTensorType(t)
            except ValueError:
                args.append((None, str(t)))
                continue
            args.append((tuple(None if rt.is_dynamic_dim(i) else int(rt.shape[i]) for i in range(rt.rank)),
                         str(rt.element_type)))
        out[op.attributes["sym_name"].value] = args
    return out


def _fmt(shape: tuple, elt: str) -> str:
    return "tensor<" + "".join(f"{'?' if d is None else d}x" for d in shape) + elt + ">"


def check_arguments(sig: list, arrays: Sequence[np.ndarray], func: str = "main") -> None:
    """Raise :class:`RunError` unless ``arrays`` fit ``sig`` (from :func:`signatures`): the number of
    arguments, each one's rank, static dims and dtype. The compiled code trusts its descriptors: a wrong
    size reaches its bounds assertions (``index must be smaller than dim size``), which abort the process."""
    if len(arrays) != len(sig):
        raise RunError(f"@{func} takes {len(sig)} tensors, {len(arrays)} given")
    for i, (a, (shape, elt)) in enumerate(zip(arrays, sig)):
        if shape is None:
            raise RunError(f"@{func} argument {i} is a {elt}, which this runner does not pass")
        want = _fmt(shape, elt)
        if a.ndim != len(shape) or any(d is not None and d != n for d, n in zip(shape, a.shape)):
            raise RunError(f"@{func} argument {i} is {want}; the input has shape {tuple(a.shape)} (the module's "
                           "static dims are fixed: export with dynamic_shapes for other sizes)")
        if a.dtype.type not in _ARG_DTYPES.get(elt, ()):
            raise RunError(f"@{func} argument {i} is {want}; the input has dtype {a.dtype} (convert it, e.g. "
                           f"int32 ids to int64, or export with an example of that dtype)")


class LinalgModule:
    """A ``linalg-on-tensors`` module compiled to machine code; ``module.run(*arrays)`` calls a function.

    Args:
        text: the module's MLIR text (a fresh copy is parsed and lowered; ``text`` is untouched).
        opt_level: LLVM optimization level of the JIT (0: a check compiles ~15x faster than at 2, and the
            modules it runs are small).

    Raises:
        RunError: the lowering pipeline or the JIT failed (the message has MLIR's diagnostics).
    """

    def __init__(self, text: str, opt_level: int = 0):
        from torch_mlir import ir
        from torch_mlir.execution_engine import ExecutionEngine
        from torch_mlir.passmanager import PassManager

        self.context = new_context()
        diagnostics: list[str] = []

        def collect(d):
            diagnostics.append(f"{d.location}: {d.message}")
            return True

        handler = self.context.attach_diagnostic_handler(collect)
        try:
            with self.context:
                module = ir.Module.parse(text)
                #: ``{function: [(shape, element type)]}`` before lowering (see :func:`signatures`)
                self.signatures = signatures(module)
                PassManager.parse(PIPELINE).run(module.operation)
        except Exception as e:
            raise RunError("lowering the linalg-on-tensors module to LLVM failed: "
                           + ("; ".join(diagnostics[:3]) or str(e).splitlines()[0])) from e
        finally:
            handler.detach()
        self.module = module
        self.returns: dict[str, list[str]] = {}
        for op in module.body.operations:
            name = op.attributes["sym_name"].value if "sym_name" in op.attributes else ""
            if name.startswith(_RETURN_PREFIX):
                self.returns[name] = name[len(_RETURN_PREFIX):].split("_")
        try:
            self.engine = ExecutionEngine(module, opt_level=opt_level)
        except Exception as e:
            raise RunError(f"the JIT could not compile the module: {e}") from e
        self._result: list | None = None
        self._callbacks = []            # keep the ctypes callbacks alive as long as the engine
        for name, types in self.returns.items():
            self._bind(name, types)

    def _bind(self, name: str, types: list[str]) -> None:
        from torch_mlir.runtime import UnrankedMemRefDescriptor, unranked_memref_to_numpy

        argtypes = []
        for t in types:
            if not t.startswith("mr") or t[2:] not in _MEMREF_DTYPES:
                raise RunError(f"a function returns a value of type {t!r}, which this runner does not read")
            argtypes.append(ctypes.POINTER(UnrankedMemRefDescriptor))
        proto = ctypes.CFUNCTYPE(None, *argtypes)

        def consume(*ptrs):
            self._result = [np.array(unranked_memref_to_numpy(p, _MEMREF_DTYPES[t[2:]]), copy=True)
                            for p, t in zip(ptrs, types)]

        cb = proto(consume)
        self._callbacks.append(cb)
        self.engine.register_runtime(name, cb)

    def run(self, *arrays: np.ndarray, func: str = "main") -> list[np.ndarray]:
        """Call ``func`` on numpy arrays (its tensor arguments, in order); returns its results as arrays.

        The arrays are checked against ``func``'s signature first (count, rank, static dims, dtype). Values
        are not: an index the module's code finds out of range (an id past the vocabulary, a position past
        the position table) fails an assertion in the compiled code, which aborts the process; run the
        model in PyTorch on such inputs first (as :func:`smxcompile.export_mlir`'s check does).

        Raises:
            RunError: no public function ``func``; inputs that do not fit its signature; an input dtype the
                descriptors cannot carry (bfloat16); no result came back.
        """
        from torch_mlir.runtime import get_unranked_memref_descriptor

        if func not in self.signatures:
            raise RunError(f"the module has no public function @{func} (it has "
                           f"{', '.join('@' + f for f in self.signatures) or 'none'})")
        arrays = [np.asarray(a) for a in arrays]
        for a in arrays:
            if a.dtype.type not in INPUT_DTYPES:
                raise RunError(f"input of dtype {a.dtype} cannot be passed to the JIT")
        check_arguments(self.signatures[func], arrays, func)
        ffi = []
        keep = []
        for a in arrays:
            a = np.ascontiguousarray(a)
            keep.append(a)
            ffi.append(ctypes.pointer(ctypes.pointer(get_unranked_memref_descriptor(a))))
        self._result = None
        self.engine.invoke(func, *ffi)
        if self._result is None:
            raise RunError(f"@{func} returned no result")
        out, self._result = self._result, None
        return out


def run_linalg(text: str, arrays: Sequence[np.ndarray], func: str = "main") -> list[np.ndarray]:
    """Compile ``text`` (linalg-on-tensors) and call ``func`` once."""
    return LinalgModule(text).run(*arrays, func=func)
