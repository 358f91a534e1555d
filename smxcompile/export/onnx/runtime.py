"""The onnxruntime side of an ONNX export: sessions, feeds, timing, and the check's runs against PyTorch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from ..compare import compare_arrays
from ..inputs import input_leaves
from .result import OnnxExportError


def ort_session(path: Path, threads: int | None = None):
    """An onnxruntime CPU session of ``path`` (all graph optimizations, ``threads`` intra-op threads or the
    default); OnnxExportError naming the IR version and opsets of a file it cannot load."""
    import onnx
    import onnxruntime as ort

    so = ort.SessionOptions()
    if threads is not None:
        so.intra_op_num_threads, so.inter_op_num_threads = threads, 1
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    try:
        return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    except Exception as e:  # noqa: BLE001 - onnxruntime raises several types for the same thing
        proto = onnx.load(str(path), load_external_data=False)
        opsets = ", ".join(f"{o.domain or 'ai.onnx'} {o.version}" for o in proto.opset_import)
        raise OnnxExportError(f"onnxruntime {ort.__version__} cannot load {path.name} (IR version {proto.ir_version}, "
                              f"opsets {opsets}): {str(e).splitlines()[0][:300]}; export with a lower opset= or "
                              "upgrade onnxruntime") from e


def ort_feeds(sess, leaves: list[torch.Tensor], names: list[str]) -> dict:
    """``{session input name: numpy array}`` of ``leaves``, by ``names`` where the file kept them, else in order;
    OnnxExportError when neither fits."""
    ins = [i.name for i in sess.get_inputs()]
    by_name = dict(zip(names, leaves))
    if all(n in by_name for n in ins):
        return {n: by_name[n].detach().cpu().numpy() for n in ins}
    if len(ins) != len(leaves):
        raise OnnxExportError(f"the file has {len(ins)} inputs ({', '.join(ins)}), the call {len(leaves)} tensors")
    return {n: t.detach().cpu().numpy() for n, t in zip(ins, leaves)}


def time_sessions(runs: dict[str, tuple[Any, dict]], rounds: int = 5, seconds: float = 0.2) -> dict[str, float]:
    """``{name: ms per call}`` of ``runs`` (``{name: (session, feeds)}``) timed in turn: the median of ``rounds``
    rounds in alternating order, each about ``seconds`` of calls."""
    import statistics
    import time

    iters: dict[str, int] = {}
    for name, (sess, feed) in runs.items():
        sess.run(None, feed)                                   # warm-up
        t0 = time.perf_counter()
        sess.run(None, feed)
        iters[name] = max(1, int(seconds / max(time.perf_counter() - t0, 1e-6)))
    times: dict[str, list[float]] = {k: [] for k in runs}
    for r in range(rounds):
        for name in (list(runs) if r % 2 == 0 else list(reversed(list(runs)))):
            sess, feed = runs[name]
            t0 = time.perf_counter()
            for _ in range(iters[name]):
                sess.run(None, feed)
            times[name].append((time.perf_counter() - t0) / iters[name] * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


class EagerFailed(OnnxExportError):
    """Eager PyTorch itself fails on a check input (then the narrowed one may be skipped, a given one not)."""


def narrowed_inputs(args: tuple, kwargs: dict, leaves: list, shapes: tuple | None) -> tuple | None:
    """``(args, kwargs)`` with every dynamic dim of ``shapes`` one smaller (prefixes; dims sharing a ``Dim`` stay
    equal), or None when none can shrink (below 2 or the Dim's min)."""
    if shapes is None:
        return None
    sizes: dict[str, int] = {}
    frozen: set[str] = set()
    plan: dict[int, list[tuple[int, str]]] = {}
    for t, spec in zip(leaves, shapes):
        for d, dim in (spec.items() if isinstance(spec, dict) else enumerate(spec or ())):
            name = getattr(dim, "__name__", None)
            if name is None:                          # None / Dim.AUTO / Dim.STATIC: not a declared dynamic dim
                continue
            lo = max(2, int(getattr(dim, "min", 2) or 2))
            if t.shape[d] - 1 < lo:
                frozen.add(name)                      # this dim (and every dim of its name) keeps its size
            sizes[name] = min(sizes.get(name, t.shape[d] - 1), t.shape[d] - 1)
            plan.setdefault(id(t), []).append((d, name))
    if not set(sizes) - frozen:
        return None

    def narrow(x):
        if isinstance(x, torch.Tensor) and id(x) in plan:
            for d, name in plan[id(x)]:
                if name not in frozen:
                    x = x.narrow(d, 0, sizes[name])
        return x

    a, k = pytree.tree_map(narrow, (args, kwargs))
    return tuple(a), dict(k)


class RewrittenCall:
    """The captured, rewritten graph called with a model's ``(args, kwargs)``: the check's reference when the
    options change the model's math."""

    def __init__(self, module: nn.Module, model: nn.Module):
        self.module, self.model = module, model

    def __call__(self, *args, **kwargs):
        return self.module(*input_leaves(self.model, args, kwargs)[0])


def run_and_compare(sess, model: nn.Module, args: tuple, kwargs: dict, rtol: float, atol: float,
                    reference=None) -> float:
    """Largest ``|onnxruntime - reference|`` on one input (``model`` by default), in fp32 (fp64 for fp64), by
    :func:`~smxcompile.export.compare.compare_arrays`.

    Raises:
        EagerFailed: the reference itself fails on the input.
        OnnxExportError: onnxruntime failing, or outputs that differ in number, shape or value.
    """
    leaves, names = input_leaves(model, args, kwargs)
    try:
        with torch.no_grad():
            ref = (reference or model)(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - any failure of the model itself
        raise EagerFailed(f"eager PyTorch fails on the check input of shapes "
                          f"{[tuple(t.shape) for t in leaves]}: {type(e).__name__}: {e}") from e
    try:
        got = sess.run(None, ort_feeds(sess, leaves, names))
    except Exception as e:  # noqa: BLE001 - onnxruntime's run errors name the node
        raise OnnxExportError(f"onnxruntime fails on input shapes {[tuple(t.shape) for t in leaves]}: "
                              f"{str(e).splitlines()[0][:400]}") from e
    ref_leaves = [t for t in pytree.tree_leaves(ref) if isinstance(t, torch.Tensor)]
    if len(ref_leaves) != len(got):
        raise OnnxExportError(f"the ONNX model has {len(got)} outputs, the model returns {len(ref_leaves)} tensors: "
                              "outputs the graph does not compute (an input returned as it is, or the same tensor "
                              "returned twice) are not part of an exported graph, nor objects that are not tensors "
                              "(a transformers model returning its KV cache: pass use_cache=False); return only "
                              "computed tensors")
    worst = 0.0
    for i, (g, r) in enumerate(zip(got, ref_leaves)):
        r = r.detach().cpu()
        r = (r if r.dtype == torch.float64 else r.float()).numpy()      # fp64 outputs compared in fp64
        g = g.astype(r.dtype) if g.dtype != r.dtype else g
        if g.shape != r.shape:
            raise OnnxExportError(f"output {i}: onnxruntime shape {g.shape}, eager {r.shape}")
        d, why = compare_arrays(g, r, rtol, atol, "onnxruntime")
        if why:
            raise OnnxExportError(f"output {i}: onnxruntime {why}")
        worst = max(worst, d)
    return worst


__all__ = ["ort_session", "ort_feeds", "time_sessions", "EagerFailed", "narrowed_inputs", "RewrittenCall", "run_and_compare"]
