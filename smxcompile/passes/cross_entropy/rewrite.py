"""The cross-entropy pass: its policy and its rewrite (matching in :mod:`.matcher`, run-time code in
:mod:`.replacement`)."""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch.fx import Graph, Node

from ..patterns.graph import FLOAT_DTYPES, dedupe, dtype_of, is_number, replace_anchor, tensor_val
from ..patterns.writes import mutation_inside
from ..policy import FORCE_HINT, Ladder, cpu_threshold, decide, policy_size
from ..protocol import PassContext, RewritePass
from .matcher import CEMatch, check_escapes, loss_call, walk_to_linear
from .replacement import apply_row_ops, graph_cross_entropy, graph_linear_cross_entropy


def _checks(m: CEMatch, ctx: PassContext) -> str:
    if not isinstance(m.reduction, str) or m.reduction not in ("none", "mean", "sum"):
        return f"reduction {m.reduction!r} is not a constant none/mean/sum"
    if not isinstance(m.ignore_index, int) or isinstance(m.ignore_index, bool):
        return "ignore_index is not a constant int"
    if not is_number(m.label_smoothing):
        return "label_smoothing is not a constant"
    if m.class_weight is not None and not isinstance(m.class_weight, Node):
        return "class weight is not a tensor"
    tv = tensor_val(m.target)
    if tv is None:
        return "target has no recorded value"
    if m.kind == "cross_entropy" and m.linear is None:
        absorbed = list(m.absorbed)
        why = walk_to_linear(m) or check_escapes(m)
        if why:
            # not cut: the plain CE on the same logits (the walk's partial results are dropped)
            m.note = f"not cut: {why}"
            m.linear = m.h = m.weight = m.bias = m.escape = m.compute_dtype = None
            m.weight_t, m.pad_rows = False, False
            m.dead = list(m.loss_nodes)
            m.absorbed = absorbed
            m.scale, m.softcap, m.row_ops = 1.0, None, []
        else:
            m.kind = "linear_cross_entropy"
    if m.kind == "linear_cross_entropy" and m.linear is not None and m.linear is not m.anchor:
        m.dead = dedupe(m.dead)
    lv = tensor_val(m.h if m.kind == "linear_cross_entropy" else m.logits)
    if lv is None:
        return "input has no recorded value"
    m.device = lv.device.type
    if lv.dtype not in FLOAT_DTYPES:
        return f"dtype {lv.dtype} is not floating point"
    if m.kind == "cross_entropy":
        xv = tensor_val(m.logits)
        if xv is None or xv.dim() == 0:
            return "logits have no class dim"
        if xv.dim() > 2 and not m.classes_last:
            return f"logits of rank {xv.dim()} (classes on dim 1): the fused CE would copy them to put the classes last"
    if m.kind == "linear_cross_entropy":
        wv = tensor_val(m.weight)
        hv = tensor_val(m.h)
        if wv is None or hv is None or wv.dtype != hv.dtype and not _autocast_in(m):
            return "input and weight dtypes differ"
    if tv.dtype.is_floating_point and tv.requires_grad:
        return "probability targets that require grad (distillation): not supported"
    # a mutation between the first pattern node and the loss could change what the op reads
    mut = mutation_inside(m.anchor, m.dead)
    if mut is not None:
        return f"in-place op '{mut.name}' runs inside the pattern"
    return ""


def _cpu_keep(m: CEMatch, ctx: PassContext) -> str:
    """Rules ``cross_entropy``, ``linear_cross_entropy_inference``, ``linear_cross_entropy_bf16`` and
    ``linear_cross_entropy_min_vocab`` of ``CPU_RULES``."""
    if m.kind == "cross_entropy":
        return ("CPU: Inductor's fused C++ cross-entropy is faster on given logits (the online CE op "
                f"measured 2.4-3x slower, docs/PERFORMANCE.md; {FORCE_HINT})")
    v = policy_size(tensor_val(m.weight).shape[1 if m.weight_t else 0], fallback=0)
    logits = tensor_val(m.logits)
    if logits is not None and not logits.requires_grad:  # traced without grad mode or without a trainable input
        return (f"CPU: no gradient (evaluation); Inductor's matmul and fused C++ loss were measured faster "
                f"(CPU_RULES['linear_cross_entropy_inference']; {FORCE_HINT})")
    if dtype_of(m.linear) == torch.bfloat16:  # the matmul's dtype (autocast included)
        return (f"CPU: bf16; Inductor's bf16 matmuls and fused loss were measured faster "
                f"(CPU_RULES['linear_cross_entropy_bf16']; {FORCE_HINT})")
    need = cpu_threshold("linear_cross_entropy_min_vocab")
    if v < need:
        return (f"CPU: {v} classes; below {need} cut CE's extra pass over the classifier costs more than the "
                f"logits it saves (CPU_RULES['linear_cross_entropy_min_vocab']; {FORCE_HINT})")
    return ""


_LADDER = Ladder(checks=_checks, cpu_keep=_cpu_keep)


def _autocast_in(m: CEMatch) -> bool:
    lv = tensor_val(m.linear)
    hv = tensor_val(m.h)
    return lv is not None and hv is not None and lv.dtype != hv.dtype


class CrossEntropyPass(RewritePass):
    """``linear -> ... -> cross_entropy`` -> cut cross-entropy; cross-entropy on given logits -> the online CE op.
    Runs first: it owns the log-softmax of ``nll_loss(log_softmax(x))``."""

    name = "cross_entropy"

    def find(self, graph: Graph, ctx: PassContext, exclude: set) -> list[CEMatch]:
        out = []
        for node in graph.nodes:
            if node in exclude:
                continue
            m = loss_call(node)
            if m is None:
                continue
            m.prefix = ctx.prefix
            decide(m, ctx, _LADDER)
            out.append(m)
        return out

    def touched(self, m: CEMatch) -> set[Node]:
        return set(m.dead)

    def rewrite(self, graph: Graph, m: CEMatch, ctx: PassContext) -> None:
        """Replace the loss call (and the logits chain) by the cut / online cross-entropy."""
        loss_dtype = dtype_of(m.anchor)
        with graph.inserting_before(m.anchor):
            if m.kind == "linear_cross_entropy":
                h = m.h
                kwargs: dict[str, Any] = {}
                if m.compute_dtype is not None:
                    kwargs["compute_dtype"] = m.compute_dtype
                if m.pad_rows:
                    kwargs["row_ops"] = tuple(m.row_ops)
                else:
                    for op, a in m.row_ops:
                        if op == "flatten":
                            h = graph.call_method("flatten", (h, 0, -2))
                        elif op == "reshape":
                            h = graph.call_method("reshape", (h, (*a, -1)))
                        else:
                            h = graph.call_function(operator.getitem, (h, a))
                logits_dtype = dtype_of(m.escape) if m.escape is not None else None
                call = graph.call_function(graph_linear_cross_entropy, (
                    h, m.weight, m.bias, m.target, m.class_weight, int(m.ignore_index), m.reduction,
                    float(m.label_smoothing), float(m.scale), m.softcap, loss_dtype, m.escape is not None,
                    logits_dtype, m.weight_t), kwargs)
                out = graph.call_function(operator.getitem, (call, 0))
                if m.escape is not None:
                    lg = graph.call_function(operator.getitem, (call, 1))
                    for k in ("example_value", "val"):
                        if k in m.escape.meta:
                            lg.meta[k] = m.escape.meta[k]
                    interior = set(m.dead)
                    for u in list(m.escape.users):
                        if u not in interior:
                            u.replace_input_with(m.escape, lg)
            else:
                out = graph.call_function(graph_cross_entropy, (
                    m.logits, m.target, m.class_weight, int(m.ignore_index), m.reduction, float(m.label_smoothing),
                    loss_dtype), {"classes_last": True} if m.classes_last else {})
                call = out
        replace_anchor(graph, m.anchor, call, out, m.dead)

    def check_inputs(self, m: CEMatch) -> list[Node]:
        ns = [m.h, m.weight, m.bias, m.target, m.class_weight] if m.kind == "linear_cross_entropy" else [
            m.logits, m.target, m.class_weight]
        return [n for n in ns if isinstance(n, Node)]

    def run_site(self, match: CEMatch, values: dict[str, Any]):
        """The rewritten site's loss on captured values."""
        def value(arg):
            return values[arg.name] if isinstance(arg, Node) else arg

        loss_dtype = dtype_of(match.anchor)
        if match.kind == "linear_cross_entropy":
            return graph_linear_cross_entropy(
                apply_row_ops(value(match.h), match.row_ops), value(match.weight), value(match.bias),
                target=value(match.target), class_weight=value(match.class_weight),
                ignore_index=int(match.ignore_index), reduction=match.reduction,
                label_smoothing=float(match.label_smoothing), scale=float(match.scale), softcap=match.softcap,
                loss_dtype=loss_dtype, return_logits=False, logits_dtype=None, weight_t=match.weight_t,
                compute_dtype=match.compute_dtype)[0]
        return graph_cross_entropy(value(match.logits), value(match.target), value(match.class_weight),
                                   ignore_index=int(match.ignore_index), reduction=match.reduction,
                                   label_smoothing=float(match.label_smoothing), loss_dtype=loss_dtype,
                                   classes_last=match.classes_last)


__all__ = ["CrossEntropyPass"]
