"""What an ONNX export is for: ``export_onnx``'s ``target`` / ``opset`` / ``attention_op`` resolved into an
:class:`OnnxTarget` by probing the installed onnxruntime (one-node models, cached per process).

``"onnxruntime"``: its fastest exact ops, fused attention as the ONNX ``Attention`` op (opset 23) when it has the
kernel, else decomposed at opset 18. ``"portable"``: standard ONNX ops only, attention decomposed, opset 18 or
the one asked for. The choice of forms: docs/PERFORMANCE.md, 'ONNX attention forms'.
"""

from __future__ import annotations

import dataclasses
import functools

#: The forms of attention: the ONNX op (opset >= 23), onnxruntime's contrib op, or MatMul / Softmax / MatMul.
ATTENTION_OPS = ("Attention", "MultiHeadAttention", "decompose")

TARGETS = ("onnxruntime", "portable")

#: torch.onnx's default opset in the torch versions pyproject.toml admits; the floor of every export.
DEFAULT_OPSET = 18

#: The first opset with the ONNX ``Attention`` op.
ATTENTION_OPSET = 23


@dataclasses.dataclass(frozen=True)
class OnnxTarget:
    """A resolved export target: ``name`` (one of :data:`TARGETS`), the ai.onnx ``opset``, the form of
    ``attention`` (one of :data:`ATTENTION_OPS`), whether ``com.microsoft`` ops may appear (``contrib``), and the
    onnxruntime version it was resolved against (``ort_version``, None without one)."""

    name: str
    opset: int
    attention: str
    contrib: bool
    ort_version: str | None = None


class OnnxTargetError(ValueError):
    """A target / opset / attention_op combination that cannot be exported (the message says why)."""


def _ort():
    try:
        import onnxruntime
    except ImportError:
        return None
    return onnxruntime


@functools.lru_cache(maxsize=None)
def ort_loads(op_type: str, opset: int, domain: str = "", n_inputs: int = 1, ir_version: int | None = None) -> bool:
    """Whether the installed onnxruntime's CPU provider loads a one-node model of ``op_type`` (``n_inputs`` fp32
    inputs, 4-D; 3-D for com.microsoft ops) at ``opset``."""
    ort = _ort()
    if ort is None:
        return False
    from onnx import TensorProto, helper

    shape = [1, 2, 4] if domain == "com.microsoft" else [1, 1, 2, 4]
    attrs = {"num_heads": 1} if domain == "com.microsoft" else {}
    inputs = [f"x{i}" for i in range(n_inputs)]
    graph = helper.make_graph([helper.make_node(op_type, inputs, ["y"], domain=domain, **attrs)], "probe",
                              [helper.make_tensor_value_info(i, TensorProto.FLOAT, shape) for i in inputs],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)])
    imports = [helper.make_opsetid("", opset)] + ([helper.make_opsetid(domain, 1)] if domain else [])
    model = helper.make_model(graph, opset_imports=imports)
    model.ir_version = ir_version or (11 if opset >= 23 else 10)
    try:
        ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    except Exception:  # noqa: BLE001 - any load failure means "not supported"
        return False
    return True


def resolve(target: str = "onnxruntime", opset: int | None = None, attention_op: str | None = None) -> OnnxTarget:
    """The :class:`OnnxTarget` of ``export_onnx``'s arguments (``opset`` / ``attention_op`` None: the target's).

    Raises:
        OnnxTargetError: an unknown target / attention_op, an opset below 18, ``Attention`` below opset 23,
            ``MultiHeadAttention`` with ``target="portable"``, or an op the installed onnxruntime does not load.
    """
    if target not in TARGETS:
        raise OnnxTargetError(f"target must be one of {', '.join(map(repr, TARGETS))}, not {target!r}")
    if attention_op is not None and attention_op not in ATTENTION_OPS:
        raise OnnxTargetError(f"attention_op must be one of {', '.join(map(repr, ATTENTION_OPS))} or None, "
                              f"not {attention_op!r}")
    if opset is not None and (isinstance(opset, bool) or not isinstance(opset, int) or opset < DEFAULT_OPSET):
        raise OnnxTargetError(f"opset must be an int >= {DEFAULT_OPSET} (torch.onnx's dynamo exporter), not {opset!r}")
    import onnx

    if opset is not None and opset > onnx.defs.onnx_opset_version():
        raise OnnxTargetError(f"opset {opset} is newer than the installed onnx package knows "
                              f"({onnx.defs.onnx_opset_version()}, onnx {onnx.__version__})")
    ort = _ort()
    version = getattr(ort, "__version__", None)
    if target == "portable":
        if attention_op == "MultiHeadAttention":
            raise OnnxTargetError("attention_op='MultiHeadAttention' is an onnxruntime contrib op (com.microsoft); "
                                  "target='portable' writes standard ONNX ops only")
        chosen = opset or DEFAULT_OPSET
        attention = attention_op or "decompose"
        if attention == "Attention" and chosen < ATTENTION_OPSET:
            raise OnnxTargetError(f"attention_op='Attention' needs opset >= {ATTENTION_OPSET} (asked: {chosen})")
        return OnnxTarget("portable", chosen, attention, contrib=False, ort_version=version)
    if ort is None:
        raise OnnxTargetError("target='onnxruntime' needs onnxruntime installed (pip install smxcompile[onnx]); "
                              "use target='portable' to export for another runtime")
    has_attention = ort_loads("Attention", ATTENTION_OPSET, n_inputs=3)
    if opset is None:
        # the Attention op's opset when onnxruntime has its kernel (attention.py keeps torch's semantics on it)
        opset = ATTENTION_OPSET if has_attention else DEFAULT_OPSET
    elif not ort_loads("Softmax", opset):
        raise OnnxTargetError(f"onnxruntime {version} does not load opset {opset} models; ask for a lower opset")
    if attention_op is None:
        # the fastest exact form measured (docs/PERFORMANCE.md, 'ONNX attention forms'); without it, decomposed
        attention_op = "Attention" if opset >= ATTENTION_OPSET and has_attention else "decompose"
    if attention_op == "Attention" and (opset < ATTENTION_OPSET or not has_attention):
        raise OnnxTargetError(f"attention_op='Attention' needs opset >= {ATTENTION_OPSET} and an onnxruntime with "
                              f"its kernel (opset {opset}, onnxruntime {version})")
    if attention_op == "MultiHeadAttention" and not ort_loads("MultiHeadAttention", opset, "com.microsoft", 3):
        raise OnnxTargetError(f"onnxruntime {version} does not load com.microsoft MultiHeadAttention")
    return OnnxTarget("onnxruntime", opset, attention_op, contrib=True, ort_version=version)


__all__ = ["OnnxTarget", "OnnxTargetError", "resolve", "ort_loads", "ATTENTION_OPS", "TARGETS", "DEFAULT_OPSET",
           "ATTENTION_OPSET"]
