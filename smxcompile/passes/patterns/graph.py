"""Helpers to read torch-level (Dynamo / pre-grad) FX graphs: one canonical view of the many spellings."""

from __future__ import annotations

import functools
import inspect
import operator
from typing import Any

import torch
import torch.nn.functional as F
from torch.fx import Graph, Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

#: The floating-point dtypes a fused op accepts.
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

_MISSING = object()

# canonical name -> (function targets, method name, positional parameter names)
_SPECS: dict[str, tuple[tuple[Any, ...], str | None, tuple[str, ...]]] = {
    "softmax": ((F.softmax, torch.softmax, torch.special.softmax, torch.ops.aten._safe_softmax,
                 torch.ops.aten._safe_softmax.default), "softmax", ("input", "dim", "_stacklevel", "dtype")),
    "log_softmax": ((F.log_softmax, torch.log_softmax, torch.special.log_softmax), "log_softmax", ("input", "dim", "_stacklevel", "dtype")),
    "exp": ((torch.exp,), "exp", ("input",)),
    "log": ((torch.log,), "log", ("input",)),
    "tanh": ((torch.tanh, F.tanh), "tanh", ("input",)),
    "sub": ((operator.sub, torch.sub, torch.subtract), "sub", ("input", "other")),
    "add": ((operator.add, torch.add), "add", ("input", "other")),
    "mul": ((operator.mul, torch.mul, torch.multiply, torch.ops.aten.mul.Scalar, torch.ops.aten.mul.Tensor),
            "mul", ("input", "other")),
    "div": ((operator.truediv, torch.div, torch.true_divide, torch.divide, torch.ops.aten.div.Scalar,
             torch.ops.aten.div.Tensor), "div", ("input", "other")),
    "sum": ((torch.sum,), "sum", ("input", "dim", "keepdim")),
    "amax": ((torch.amax,), "amax", ("input", "dim", "keepdim")),
    "max": ((torch.max,), "max", ("input", "dim", "keepdim")),
    "logsumexp": ((torch.logsumexp, torch.special.logsumexp), "logsumexp", ("input", "dim", "keepdim")),
    "detach": ((torch.detach,), "detach", ("input",)),
    "topk": ((torch.topk,), "topk", ("input", "k", "dim", "largest", "sorted")),
    "argmax": ((torch.argmax,), "argmax", ("input", "dim", "keepdim")),
    "matmul": ((operator.matmul, torch.matmul, torch.bmm, torch.baddbmm, torch.einsum, torch.mm), "matmul", ("input", "other")),
    "lt": ((operator.lt, torch.lt, torch.less), "lt", ("input", "other")),
    "le": ((operator.le, torch.le, torch.less_equal), "le", ("input", "other")),
    "gt": ((operator.gt, torch.gt, torch.greater), "gt", ("input", "other")),
    "ge": ((operator.ge, torch.ge, torch.greater_equal), "ge", ("input", "other")),
    "masked_fill": ((torch.masked_fill,), "masked_fill", ("input", "mask", "value")),
    "where": ((torch.where,), None, ("condition", "input", "other")),   # (Tensor.where puts self first)
    "sort": ((torch.sort,), "sort", ("input", "dim", "descending")),
    "cumsum": ((torch.cumsum,), "cumsum", ("input", "dim", "dtype")),
    "scatter": ((torch.scatter,), "scatter", ("input", "dim", "index", "src")),
    "multinomial": ((torch.multinomial,), "multinomial", ("input", "num_samples", "replacement")),
}
_METHOD_ALIASES = {"truediv": "div", "true_divide": "div", "subtract": "sub", "multiply": "mul", "bmm": "matmul", "mm": "matmul",
                   "less": "lt", "less_equal": "le", "greater": "gt", "greater_equal": "ge"}
_FN_TO_NAME: dict[Any, str] = {}
for _name, (_fns, _meth, _params) in _SPECS.items():
    for _fn in _fns:
        _FN_TO_NAME.setdefault(_fn, _name)
_METHOD_TO_NAME = {m: n for n, (_f, m, _p) in _SPECS.items() if m}
_METHOD_TO_NAME.update(_METHOD_ALIASES)

# softmax spellings whose third parameter is dtype; aten._safe_softmax (SDPA's math decomposition, the spelling
# of PyTorch's fused-attention patterns 29 / 30) gives 0 on a row of -inf where softmax gives NaN
_SAFE_SOFTMAX = (torch.ops.aten._safe_softmax, torch.ops.aten._safe_softmax.default)
_NO_STACKLEVEL = (torch.softmax, torch.log_softmax, torch.special.softmax, torch.special.log_softmax, *_SAFE_SOFTMAX)


def is_safe_softmax(node: Node) -> bool:
    """``node`` calls ``aten._safe_softmax``: a softmax whose rows of -inf give 0 (not NaN)."""
    return node.op == "call_function" and node.target in _SAFE_SOFTMAX


_CAST_METHODS = {"float": torch.float32, "half": torch.float16, "bfloat16": torch.bfloat16, "double": torch.float64}

# Targets that create random numbers: a softmax fed by them (Gumbel-softmax) is not a deterministic softmax.
_RANDOM_METHODS = {"exponential_", "uniform_", "normal_", "bernoulli_", "random_", "cauchy_", "geometric_", "log_normal_"}
_RANDOM_FNS = {torch.rand, torch.randn, torch.rand_like, torch.randn_like, torch.randint, torch.bernoulli,
               torch.normal, torch.poisson, torch.multinomial, F.gumbel_softmax}
# Not dropout: it masks activations upstream, it does not add sampled noise to the logits.


def canon(node: Node) -> tuple[str, dict[str, Any]] | None:
    """``(name, args)`` for a call node in one of the spellings we understand, else None.

    ``args`` maps the parameter names of :data:`_SPECS` to FX args (Nodes or constants).
    """
    if node.op == "call_function":
        name = _FN_TO_NAME.get(node.target)
        args = node.args
    elif node.op == "call_method":
        name = _METHOD_TO_NAME.get(node.target)
        args = node.args  # args[0] is self
    else:
        return None
    if name is None:
        return None
    params = _SPECS[name][2]
    if node.op == "call_method" and name in ("softmax", "log_softmax"):
        params = ("input", "dim", "dtype")  # Tensor.softmax(dim, dtype=None)
    if node.op == "call_function" and node.target in _NO_STACKLEVEL:
        params = ("input", "dim", "dtype")
    if len(args) > len(params):
        return None
    bound = dict(zip(params, args))
    for k, v in node.kwargs.items():
        if k in bound:
            return None
        bound[k] = v
    if name in ("add", "sub") and bound.get("alpha", 1) != 1:
        return None
    if name == "div" and bound.get("rounding_mode") is not None:
        return None
    if node.op == "call_function" and node.target in (torch.einsum, torch.baddbmm):
        bound = {"input": None}
    extra = set(bound) - set(params) - {"alpha", "rounding_mode", "out", "stable", "generator", "value", "reduce"}
    if extra or bound.get("out") is not None:
        return None
    return name, bound


def cast_dtype(node: Node) -> torch.dtype | None:
    """If ``node`` is a floating-point dtype cast (``.float()``, ``.to(dtype)``, ``.type_as(t)``...), its dtype."""
    if node.op != "call_method":
        return None
    if node.target in _CAST_METHODS and len(node.args) == 1 and not node.kwargs:
        return _CAST_METHODS[node.target]
    if node.target in ("to", "type", "type_as"):
        out = val(node)
        inp = val(node.args[0]) if node.args and isinstance(node.args[0], Node) else None
        if out is None or inp is None or not isinstance(out, torch.Tensor):
            return None
        if out.device != inp.device or not out.dtype.is_floating_point:
            return None
        extra_kw = set(node.kwargs) - {"dtype", "copy", "non_blocking"}
        if extra_kw or node.kwargs.get("copy"):
            return None
        return out.dtype
    return None


def val(node: Any) -> Any:
    """The fake value recorded for a node (``meta['val']`` or Dynamo's ``meta['example_value']``)."""
    if not isinstance(node, Node):
        return None
    return node.meta.get("val", node.meta.get("example_value"))


def tensor_val(node: Any) -> torch.Tensor | None:
    """The recorded fake tensor of ``node``, or None (not a node, no value, not a tensor)."""
    v = val(node)
    return v if isinstance(v, torch.Tensor) else None


def dtype_of(node: Any) -> torch.dtype | None:
    """The dtype of ``node``'s recorded tensor, or None."""
    v = tensor_val(node)
    return v.dtype if v is not None else None


def dtype_name(d: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"`` (report details)."""
    return str(d).replace("torch.", "")


def same_size(a: Any, b: Any) -> bool:
    """Sizes (ints or SymInts) known to be equal, without adding a guard (False when unknown)."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    try:
        return bool(statically_known_true(a == b))
    except Exception:
        return False


def same_shape(a: tuple | None, b: tuple | None) -> bool:
    """Two shapes known to be equal, size by size (see :func:`same_size`)."""
    return a is not None and b is not None and len(a) == len(b) and all(same_size(x, y) for x, y in zip(a, b))


def broadcasts_to(small: tuple | None, big: tuple | None) -> bool:
    """``small`` broadcasts to ``big`` without changing it (each size 1 or equal, known without a guard)."""
    if small is None or big is None or len(small) > len(big):
        return False
    return all(same_size(s, 1) or same_size(s, b) for s, b in zip(reversed(small), reversed(big)))


def static_shape(v: torch.Tensor | None) -> tuple[int, ...] | None:
    """The shape as plain ints, or None when any size is symbolic (dynamic shapes) or there is no tensor."""
    if v is None or any(not isinstance(s, int) for s in v.shape):
        return None
    return tuple(v.shape)


def dedupe(nodes) -> list[Node]:
    """The nodes of ``nodes`` in order, each once (non-nodes dropped)."""
    out, seen = [], set()
    for n in nodes:
        if isinstance(n, Node) and n not in seen:
            seen.add(n)
            out.append(n)
    return out


def norm_dim(dim: Any, ndim: int) -> int | None:
    """A single int dim normalized to ``[0, ndim)``; None for anything else (tuples of >1 dims, None, symbols)."""
    if isinstance(dim, (list, tuple)):
        if len(dim) != 1:
            return None
        dim = dim[0]
    if isinstance(dim, bool) or not isinstance(dim, int):
        return None
    nd = max(ndim, 1)
    if not -nd <= dim < nd:
        return None
    return dim % nd


def is_number(x: Any) -> bool:
    """A Python int or float (not a bool)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def single_user(node: Node) -> bool:
    """``node`` is used exactly once."""
    return len(node.users) == 1


def is_random(node: Node) -> bool:
    """``node`` draws random numbers (``rand*``, ``bernoulli``, ``exponential_``, ``gumbel_softmax``...)."""
    if node.op == "call_method" and node.target in _RANDOM_METHODS:
        return True
    return node.op == "call_function" and node.target in _RANDOM_FNS


# Ops that pass noise through unchanged in shape (elementwise, casts, copies): Gumbel noise reaches
# the softmax through these; a matmul, reduction or view chain in between means the noise fed
# some earlier layer (e.g. noise added to a network's input), not the logits of this softmax.
_NOISE_PASSTHROUGH_FNS = {operator.neg, torch.neg, torch.abs, torch.clamp, torch.where, torch.sqrt, torch.rsqrt,
                          torch.reciprocal, torch.sigmoid, torch.log1p, torch.expm1, torch.log2, torch.exp2,
                          torch.masked_fill, torch.clone}
_NOISE_PASSTHROUGH_METHODS = {"neg", "abs", "clamp", "clamp_min", "clamp_max", "sqrt", "rsqrt", "reciprocal",
                              "sigmoid", "log1p", "expm1", "log2", "exp2", "contiguous", "clone", "to", "type",
                              "type_as", "masked_fill", "expand", "expand_as"} | set(_CAST_METHODS)


def _passes_noise(node: Node) -> bool:
    if canon(node) is not None and canon(node)[0] in ("exp", "log", "tanh", "sub", "add", "mul", "div", "detach"):
        return True
    if node.op == "call_method":
        return node.target in _NOISE_PASSTHROUGH_METHODS
    return node.op == "call_function" and node.target in _NOISE_PASSTHROUGH_FNS


def depends_on_random(node: Node, depth: int = 64) -> bool:
    """True if random numbers reach ``node`` through elementwise ops only (Gumbel-softmax noise).

    Walks up from ``node`` through elementwise ops, casts and copies (at most ``depth`` of them),
    so ``-log(-log(rand_like(x) + eps) + eps)`` is caught however long the chain; stops at anything
    else (matmul, reduction...). A tensor filled in place (``g = empty_like(x); g.exponential_()``)
    counts as random too.
    """
    seen: set[Node] = set()
    frontier = [node]
    for _ in range(depth):
        nxt = []
        for n in frontier:
            if not isinstance(n, Node) or n in seen:
                continue
            seen.add(n)
            if is_random(n) or any(u.op == "call_method" and is_random(u) and u.args and u.args[0] is n
                                   for u in n.users):
                return True
            if _passes_noise(n):
                nxt.extend(n.all_input_nodes)
        frontier = nxt
    return False


#: ``operator`` functions that write their first argument (``x += y``, ``x[i] = v``).
INPLACE_OPERATORS = {operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
                      operator.ipow, operator.imod, operator.iand, operator.ior, operator.ixor, operator.imatmul,
                      operator.setitem}


_OPERATOR_NAMES = {operator.truediv: "div", operator.floordiv: "floor_divide"}


def aten_name(node: Node) -> str | None:
    """The ATen op a Dynamo node's call names (``operator.mul``, ``torch.sigmoid``, ``F.gelu``, ``x.__rsub__``,
    ``x.tanh()``: ``mul``, ``sigmoid``, ``gelu``, ``rsub``, ``tanh``), or None."""
    if node.op == "call_method" and isinstance(node.target, str):
        name = node.target.strip("_") if node.target.startswith("__") else node.target
    elif node.op == "call_function":
        name = _OPERATOR_NAMES.get(node.target) or getattr(node.target, "__name__", None)
    else:
        return None
    if name in ("max", "min") and len(node.args) == 2 and isinstance(node.args[1], Node):
        name += "imum"      # the elementwise overload: torch.max(a, b) is torch.maximum(a, b)
    return _METHOD_ALIASES.get(name, name) if name else None


@functools.lru_cache(maxsize=None)
def _pointwise_name(name: str) -> bool:
    packet = getattr(torch.ops.aten, name, None)
    return isinstance(packet, torch._ops.OpOverloadPacket) and any(
        torch.Tag.pointwise in getattr(packet, o).tags for o in packet.overloads())


def pointwise(node: Node) -> bool:
    """The node computes each output entry from the same entry of its (broadcast) inputs: its ATen op carries
    ``torch.Tag.pointwise``. In-place calls are not taken (they write)."""
    name = aten_name(node)
    return bool(name) and not is_mutation(node) and _pointwise_name(name)


def op_label(node: Node) -> str:
    """A short name of what ``node`` calls, for reports: ``add``, ``masked_fill_``, ``aten.mul_.Tensor``."""
    if node.op in ("call_method", "call_module"):
        return str(node.target)
    if isinstance(node.target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(node.target)
    return getattr(node.target, "__name__", None) or str(node.target)


def is_mutation(node: Node) -> bool:
    """Whether ``node`` may write to a tensor in place (``x.add_()``, ``x += y``, ``x[i] = v``, ``out=``,
    ``inplace=True``, an ATen op whose schema writes, batch norm's running statistics...)."""
    if node.op == "call_method":
        name = str(node.target)
        return (name.endswith("_") and not name.endswith("__")) or name in _INPLACE_DUNDERS
    if node.op == "call_module":   # nn.ReLU(inplace=True) and the like
        owner = node.graph.owning_module
        return owner is not None and getattr(owner.get_submodule(node.target), "inplace", False) is True
    if node.op != "call_function":
        return False
    if node.target in INPLACE_OPERATORS or "out" in node.kwargs or inplace_flag(node):
        return True
    if isinstance(node.target, torch._ops.OpOverload):
        return node.target._schema.is_mutable
    if isinstance(node.target, torch._ops.OpOverloadPacket):   # any overload that writes
        return any(getattr(node.target, o)._schema.is_mutable for o in node.target.overloads())
    if node.target in _WRITES_ARGUMENTS and _WRITES_ARGUMENTS[node.target](_bound(node)):
        return True
    if (getattr(node.target, "__module__", "") or "") in ("_operator", "operator"):
        return False   # operator.and_ / or_ / not_ are not in-place despite the trailing underscore
    name = getattr(node.target, "__name__", "")
    return name.endswith("_") and not name.endswith("__")


def inplace_flag(node: Node) -> bool:
    """Whether a call passes a true ``inplace`` (``F.relu(x, True)``, ``F.dropout(..., inplace=1)``)."""
    flag = node.kwargs.get("inplace")
    if flag is None:
        try:
            position = _inplace_position(node.target)
        except TypeError:   # an unhashable target
            return False
        flag = node.args[position] if position is not None and position < len(node.args) else None
    return flag is not None and (isinstance(flag, Node) or bool(flag))


def _bound(node: Node) -> dict:
    """``node``'s arguments by parameter name, for a function with a Python signature."""
    try:
        return dict(inspect.signature(node.target).bind_partial(*node.args, **node.kwargs).arguments)
    except (TypeError, ValueError):
        return dict(node.kwargs)


_INPLACE_DUNDERS = {"__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__", "__ipow__",
                    "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__imatmul__", "__setitem__"}

# functions that write an argument without a trailing underscore or an ``inplace`` flag, and when
_WRITES_ARGUMENTS = {
    F.batch_norm: lambda a: bool(a.get("training", False)) and a.get("running_mean") is not None,
    F.instance_norm: lambda a: bool(a.get("use_input_stats", True)) and a.get("running_mean") is not None,
    F.embedding: lambda a: a.get("max_norm") is not None,
    torch.batch_norm: lambda a: True,
    torch.instance_norm: lambda a: True,
    torch.embedding_renorm_: lambda a: True,
}


@functools.lru_cache(maxsize=None)
def _inplace_position(target) -> int | None:
    try:
        names = list(inspect.signature(target).parameters)
    except (TypeError, ValueError):   # builtins and C functions have no Python signature
        return None
    return names.index("inplace") if "inplace" in names else None


def live_nodes(graph: Graph) -> set[Node]:
    """The nodes whose results reach the graph's output or a side effect (a mutation, a random draw, a module
    call, anything FX calls impure), with their inputs: a user outside this set computes what nobody reads (a copy
    of the scores kept for optional intermediates, say)."""
    roots = [n for n in graph.nodes if n.op == "output" or n.op == "call_module" or is_mutation(n)
             or is_random(n) or n.is_impure()]
    live: set[Node] = set()
    while roots:
        n = roots.pop()
        if n not in live:
            live.add(n)
            roots.extend(n.all_input_nodes)
    return live


def erase_dead_ends(graph: Graph, nodes) -> None:
    """Erase ``nodes`` (results that reach no output, see :func:`live_nodes`) and their users, users first."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    todo, seen = [n for n in nodes if n.graph is graph and not getattr(n, "_erased", False)], set()
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo.extend(n.users)
    for n in sorted(seen, key=order.__getitem__, reverse=True):
        graph.erase_node(n)


def stack_trace(node: Node) -> str | None:
    """The user's stack trace Dynamo recorded on ``node``."""
    return node.meta.get("stack_trace")


def functorch_op(graph: Graph) -> str | None:
    """The torch.func (functorch) transform ``graph`` runs, if any: the smx ops have no functorch rules, so a pass
    rewrites nothing in such a graph. The transform's name (``vmap``, ``grad``, ``jvp``...) when its nesting op
    says it, else the first functorch op's name."""
    first = None
    for n in graph.nodes:
        if n.op == "call_function":
            mod = getattr(n.target, "__module__", "") or ""
            name = getattr(n.target, "__name__", "")
            if name.endswith("_increment_nesting"):   # torch._C._functorch._vmap_increment_nesting...
                return name[1:-len("_increment_nesting")] if name.startswith("_") else name
            if first is None and ("functorch" in mod or name in ("_wrap_for_grad", "_add_batch_dim")):
                first = name or str(n.target)
    return first


def erase_dead(graph, nodes) -> None:
    """Erase the nodes of ``nodes`` that end up unused, users before the nodes they use (any order given)."""
    pending = [n for n in dict.fromkeys(nodes) if not getattr(n, "_erased", False)]
    while pending:
        dead_now = [n for n in pending if not n.users]
        if not dead_now:
            break
        for n in dead_now:
            graph.erase_node(n)
            pending.remove(n)


def replace_anchor(graph, anchor: Node, call: Node, out: Node, dead) -> None:
    """Make ``out`` (the value of the new op ``call``) replace ``anchor``: copy the user's stack trace and
    module info to the new nodes and the recorded value to ``out``, then erase the pattern's dead nodes."""
    for k in ("stack_trace", "nn_module_stack", "source_fn_stack"):
        if k in anchor.meta:
            call.meta[k] = anchor.meta[k]
            out.meta[k] = anchor.meta[k]
    for k in ("example_value", "val"):
        if k in anchor.meta:
            out.meta[k] = anchor.meta[k]
    anchor.replace_all_uses_with(out)
    erase_dead(graph, [anchor, *dead])


def erase_unused_pure(graph: Graph, nodes) -> None:
    """Erase ``nodes`` and their ancestors once nothing uses them (pure ops only: no placeholder, no mutation,
    no random draw)."""
    stack = [n for n in nodes if isinstance(n, Node)]
    while stack:
        n = stack.pop()
        # a node reached twice (an input of two erased nodes) is erased only once
        if getattr(n, "_erased", False) or n.graph is not graph or n.users \
                or n.op not in ("call_function", "call_method") or is_mutation(n) or is_random(n):
            continue
        ins = n.all_input_nodes
        graph.erase_node(n)
        stack.extend(ins)
