"""Workers of tests/kernels/test_vocab_parallel_ce.py: each rank runs vocabulary-parallel cut cross-entropy on its
shard.

Problems are rebuilt from seeds on every rank (and in the parent) with tests/kernels/test_cross_entropy.py's
``make_problem`` / ``_options``, so ranks and parent see bit-identical tensors.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import smxcompile
from smxcompile.distributed import CollectiveCounter

import test_cross_entropy as T


def shard_sizes(layout, v: int, world: int) -> list[int]:
    """Rows per rank: "chunk" (torch.chunk's split, as DTensor's Shard(0)), or an explicit list."""
    if layout == "chunk":
        step = -(-v // world)
        return [max(0, min(step, v - r * step)) for r in range(world)]
    assert sum(layout) == v and len(layout) == world, (layout, v, world)
    return list(layout)


def problem(case: dict):
    """The full (unsharded) problem of a case: x, w, b, target, opts (the kwargs of linear_cross_entropy)."""
    v = case.get("v", T.V)
    opts, bias = T._options(case["options"], v=v, n=T.N)
    shape = case.get("shape", (T.N,))
    if "token_weight" in opts and shape != (T.N,):
        opts["token_weight"] = opts["token_weight"].reshape(shape)
    x, w, b, t = T.make_problem(shape=shape, v=v, dtype=case.get("dtype", torch.float32), bias=bias,
                                ignore_index=opts.get("ignore_index", -100), seed=case.get("seed", 1))
    g = torch.Generator().manual_seed(5)
    sizes = shard_sizes(case.get("layout", "chunk"), v, 2)
    mode = case.get("targets", "random")
    if mode in ("rank0", "rank1"):
        lo = 0 if mode == "rank0" else sizes[0]
        hi = sizes[0] if mode == "rank0" else v
        t = torch.where(t == opts.get("ignore_index", -100), t, torch.randint(lo, hi, t.shape, generator=g))
    elif mode == "ignored":
        t = torch.full_like(t, opts.get("ignore_index", -100))
    if case.get("nan_row"):  # row 3 of the input NaN; its target valid (or ignored: torch's gradients are NaN too)
        x = x.clone()
        x.view(-1, x.shape[-1])[3] = float("nan")
        t = t.clone()
        t.view(-1)[3] = opts.get("ignore_index", -100) if case["nan_row"] == "ignored" else 7
    if case.get("masked_vocab"):  # rank 1's whole shard masked out by the bias, row 5 of x zero: -inf logits
        b = b.clone()
        b[sizes[0]:] = float("-inf")
    if case.get("collapse"):  # x one-hot, so grad_weight[y_i, i] is row i's target gradient; p_target rounds to 1
        zc, t = T._collapse_logits(16, v, torch.float32, seed=18)
        x, w, b, opts = torch.eye(16), zc.t().contiguous(), None, {}
    opts["reduction"] = case.get("reduction", "mean")
    if (device := case.get("device", "cpu")) != "cpu":  # the CUDA test: the same problem on the GPU
        x, w, b, t = (None if u is None else u.to(device) for u in (x, w, b, t))
        opts = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in opts.items()}
    return x, w, b, t, opts


def _local_rows(full, sizes, rank):
    if full is None:
        return None
    s0 = sum(sizes[:rank])
    return full[s0:s0 + sizes[rank]]


def objective(out, extra: dict):
    """(loss, what to differentiate, its upstream gradient): the loss with check_linear's upstream, or, when the
    lse is returned, loss + a fixed linear function of the lse (so that the lse's gradient is exercised too)."""
    loss = out[0] if isinstance(out, tuple) else out
    if extra.get("return_lse"):
        obj = loss.sum() + (out.lse * torch.linspace(-1, 1, out.lse.numel()).reshape(out.lse.shape)).sum()
        return loss, obj, torch.ones((), dtype=obj.dtype)
    return loss, loss, T.upstream_for()(loss.detach())


def run_case(rank: int, world: int, case: dict) -> dict:
    x, w, b, t, opts = problem(case)
    sizes = shard_sizes(case.get("layout", "chunk"), w.shape[0], world)
    group = dist.group.WORLD
    xx = x.clone().requires_grad_()
    if case.get("dtensor"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (world,))
        ww = distribute_tensor(w.clone(), mesh, [Shard(0)]).requires_grad_()
        bb = distribute_tensor(b.clone(), mesh, [Shard(0)]).requires_grad_() if b is not None else None
        kw = {}
    else:
        ww = _local_rows(w, sizes, rank).clone().requires_grad_()
        bb = _local_rows(b, sizes, rank).clone().requires_grad_() if b is not None else None
        kw = {"process_group": group}
    extra = case.get("extra", {})
    with CollectiveCounter() as comm:
        out = smxcompile.linear_cross_entropy(xx, ww, t, bias=bb, **opts, **kw, **extra)
        forward = [(c.op, c.sent, c.received) for c in comm.collectives]
        loss, obj, up = objective(out, extra)
        leaves = [u for u in (xx, ww, bb) if u is not None]
        grads = torch.autograd.grad(obj, leaves, up)
    backward = [(c.op, c.sent, c.received) for c in comm.collectives[len(forward):]]
    if extra.get("chunk_bytes"):
        assert len(forward) > 4, forward  # the chunks really ran (a merge per chunk)
    gx, gw = grads[0], grads[1]
    gb = grads[2] if bb is not None else None
    if case.get("dtensor"):
        gw = gw.to_local()
        gb = gb.to_local() if gb is not None else None
    return {"loss": loss.detach(), "lse": out.lse.detach() if extra.get("return_lse") else None, "gx": gx,
            "gw": gw, "gb": gb, "forward": forward, "backward": backward, "sizes": sizes}


def run_cases(rank: int, world: int, cases: dict) -> dict:
    """Every case on this rank: ``{name: run_case(...)}``; an exception is stored as ``{"error": (type, msg)}``."""
    out = {}
    for name, case in cases.items():
        try:
            out[name] = run_case(rank, world, case)
        except Exception as e:  # the parent asserts on it; every rank raises the same (checks are collective)
            out[name] = {"error": (type(e).__name__, str(e))}
    return out


def run_errors(rank: int, world: int) -> dict:
    """Inputs the function must refuse, on every rank alike (no hang: the checks run after a collective)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 4, generator=g)
    w = torch.randn(11, 4, generator=g)
    t = torch.randint(0, 11, (8,), generator=g)
    sizes = shard_sizes("chunk", 11, world)
    wl = _local_rows(w, sizes, rank)
    grp = dist.group.WORLD
    errors = {}

    def attempt(name, fn):
        try:
            fn()
            errors[name] = None
        except Exception as e:
            errors[name] = (type(e).__name__, str(e))

    attempt("targets_differ", lambda: smxcompile.linear_cross_entropy(x, wl, (t + rank) % 11, process_group=grp))
    attempt("inputs_differ", lambda: smxcompile.linear_cross_entropy(x + rank, wl, t, process_group=grp))
    attempt("rows_permuted", lambda: smxcompile.linear_cross_entropy(x.roll(rank, 0), wl, t.roll(rank, 0),
                                                                       process_group=grp))
    attempt("soft_targets", lambda: smxcompile.linear_cross_entropy(x, wl, torch.softmax(torch.randn(8, 11), -1),
                                                                      process_group=grp))
    attempt("out_of_range", lambda: smxcompile.linear_cross_entropy(x, wl, torch.full((8,), 11),
                                                                      process_group=grp))
    attempt("class_weight_shard", lambda: smxcompile.linear_cross_entropy(x, wl, t, class_weight=torch.ones(wl.shape[0]),
                                                                            process_group=grp))
    attempt("reduce_input_grad_false", lambda: _partial_grad(x, wl, t, grp, errors))
    # options / weights that differ between ranks: an error on every rank, not mismatched collectives
    lce = smxcompile.linear_cross_entropy
    xg = x.clone().requires_grad_()
    attempt("reduction_differs", lambda: lce(xg, wl, t, process_group=grp, reduction="sum" if rank else "mean"))
    attempt("chunk_bytes_differs", lambda: lce(xg, wl, t, process_group=grp, chunk_bytes=4096 if rank else None))
    attempt("smoothing_differs", lambda: lce(xg, wl, t, process_group=grp, label_smoothing=0.1 * rank))
    attempt("ignore_index_differs", lambda: lce(xg, wl, t, process_group=grp, ignore_index=-100 - rank))
    attempt("token_weight_differs", lambda: lce(xg, wl, t, process_group=grp, token_weight=torch.rand(8)))
    attempt("class_weight_differs", lambda: lce(xg, wl, t, process_group=grp,
                                                class_weight=torch.ones(11) + rank * torch.arange(11)))

    def grad_on_one_rank():
        with torch.set_grad_enabled(rank == 0):
            return lce(xg, wl, t, process_group=grp)
    attempt("no_grad_on_one_rank", grad_on_one_rank)
    # a bad argument on one rank only (bias of the wrong length): every rank raises, nobody waits
    attempt("bad_bias_on_one_rank", lambda: lce(x, wl, t, process_group=grp,
                                                bias=torch.zeros(wl.shape[0] + rank)))
    # embeddings that differ without changing any row sum, and rows 100 apart swapped
    xs = x.clone()
    if rank:
        xs[:, 0] += 1
        xs[:, 1] -= 1
    attempt("columns_moved", lambda: lce(xs, wl, t, process_group=grp))
    xl = torch.randn(120, 4, generator=torch.Generator().manual_seed(1))
    tl = torch.randint(0, 11, (120,), generator=torch.Generator().manual_seed(2))
    if rank:
        xl[[5, 105]] = xl[[105, 5]]
    attempt("rows_100_apart_swapped", lambda: lce(xl, wl, tl, process_group=grp))

    def double_backward():
        xx = x.clone().requires_grad_()
        loss = lce(xx, wl, t, process_group=grp)
        torch.autograd.grad(loss, xx, create_graph=True)
    attempt("double_backward", double_backward)

    def frozen_input():  # no grad_input wanted: no N x D all_reduce
        ww = wl.clone().requires_grad_()
        with CollectiveCounter() as c:
            lce(x, ww, t, process_group=grp).backward()
        errors["frozen_input_collectives"] = [(k.op, k.received) for k in c.collectives]
    attempt("frozen_input", frozen_input)

    def counter():  # CollectiveCounter itself: functional collectives once each, point to point one way
        import torch.distributed._functional_collectives as funcol

        with CollectiveCounter() as c:
            y = funcol.all_reduce(torch.ones(1000), "sum", grp)
            float(y.sum())
            if rank == 0:
                dist.send(torch.ones(10), 1)
            else:
                dist.recv(torch.empty(10), 0)
            out = [torch.empty(3) for _ in range(world)]
            dist.all_gather(out, torch.ones(3))
        errors["counted"] = [(k.op, k.sent, k.received) for k in c.collectives]
    attempt("counter", counter)
    return errors


def _partial_grad(x, wl, t, grp, errors):
    """reduce_input_grad=False: each rank's grad_input is its partial; their sum is the full gradient."""
    from smxcompile.distributed import vocab_parallel_linear_cross_entropy

    xx = x.clone().requires_grad_()
    loss = vocab_parallel_linear_cross_entropy(xx, wl, t, process_group=grp, reduce_input_grad=False)
    (g,) = torch.autograd.grad(loss, xx)
    part = g.clone()
    dist.all_reduce(g)
    errors["partial"] = part
    errors["full"] = g


class _Head(torch.nn.Module):
    """A replicated projection, then the vocabulary-parallel loss over this rank's classifier rows."""

    def __init__(self, w_local, d):
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(d, d)
        self.w = torch.nn.Parameter(w_local.clone())

    def forward(self, x, y, group):
        return smxcompile.linear_cross_entropy(torch.tanh(self.proj(x)), self.w, y, process_group=group,
                                               label_smoothing=0.1)


def run_compiled(rank: int, world: int) -> dict:
    """The loss inside a module compiled with backend="smx": a graph break (the loss runs eagerly), same numbers."""
    x, w, _, t = T.make_problem(seed=4, bias=False)
    sizes = shard_sizes("chunk", w.shape[0], world)
    head = _Head(_local_rows(w, sizes, rank), w.shape[1])
    compiled = torch.compile(head, backend="smx")
    loss = compiled(x, t, dist.group.WORLD)
    loss.backward()
    return {"loss": loss.detach(), "proj_grad": head.proj.weight.grad, "w_grad": head.w.grad}


def run_triton_cases(rank: int, world: int, cases: dict) -> dict:
    """``run_cases`` with the Triton kernels forced on CPU tensors (through Triton's interpreter)."""
    from smxcompile.kernels import config
    from smxcompile.kernels.cross_entropy import triton_backward, triton_forward

    config.force_triton = True
    calls = {"lce_forward": 0, "lce_backward": 0}
    for module, name in ((triton_forward, "lce_forward"), (triton_backward, "lce_backward")):
        def counted(*a, __f=getattr(module, name), __n=name, **k):
            calls[__n] += 1
            return __f(*a, **k)
        setattr(module, name, counted)
    out = run_cases(rank, world, cases)
    out["__calls__"] = calls
    return out
