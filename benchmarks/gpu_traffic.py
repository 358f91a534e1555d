"""Count what Triton kernels move and compute on a GPU through Triton's instrumented interpreter, their grids and
loops sampled, with an L2 model for the DRAM bytes: inside :func:`count_traffic` every kernel launch, and every
torch op around them, is a :class:`Launch`. Method: docs/PERFORMANCE.md ("GPU model")."""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import inspect
import operator
import sys
from typing import Iterator
from unittest.mock import patch

import numpy as np
import torch
import torch.utils._python_dispatch
import torch.utils._pytree
from torch.utils.flop_counter import flop_registry

SECTOR = 32  # DRAM access granularity (bytes)
LOAD, STORE, ATOMIC = 0, 1, 2
BUCKET_ACCESSES = 1 << 25  # sector accesses replayed in one pass of Counter.end_launch (bounds its memory)


@dataclasses.dataclass(frozen=True)
class GPU:
    """An H200 (SXM); the per-SM bandwidth (64 bytes per clock at 1.75 GHz) is an assumption."""

    name: str = "H200"
    sms: int = 132
    l2_bytes: int = 50 * 2**20
    hbm_bytes_per_s: float = 4.3e12
    flops_per_s: float = 990e12
    launch_us: float = 3.0
    sm_bytes_per_s: float = 64 * 1.75e9

    def resident(self, num_warps: int, programs: int) -> int:
        """Programs running at once: up to 64 warps and 32 programs per SM (registers and shared memory aside)."""
        return max(1, min(programs, self.sms * max(1, min(32, 64 // max(1, num_warps)))))


H200 = GPU()


@dataclasses.dataclass
class Launch:
    """One kernel launch's counts (weighted sums over the sampled programs of the grid)."""

    kernel: str
    grid: tuple
    num_warps: int
    programs: int
    resident: int
    programs_run: int = 0
    bytes_loaded: float = 0.0
    bytes_stored: float = 0.0
    bytes_atomic: float = 0.0
    bytes_reread: float = 0.0  # loads of sectors the same program had touched before
    bytes_capacity_miss: float = 0.0  # re-reads the L2 model sends to DRAM
    flops: float = 0.0
    #: per storage address: bytes first loaded (or atomically updated), the storage's size, distinct bytes touched
    first_touch: dict = dataclasses.field(default_factory=dict)
    sizes: dict = dataclasses.field(default_factory=dict)
    touched: dict = dataclasses.field(default_factory=dict)
    bytes_written_back: float = 0.0  # stores, and the atomically updated sectors once

    @property
    def footprint(self) -> float:
        return float(sum(self.touched.values()))

    @property
    def bytes_hbm(self) -> float:
        """DRAM bytes: first touches (at most each tensor's size), capacity misses, write-backs."""
        first = sum(min(b, self.sizes[k]) for k, b in self.first_touch.items())
        return first + self.bytes_capacity_miss + self.bytes_written_back


def stream_launch(kernel: str, loaded: float, stored: float, first_touch: dict, sizes: dict, touched: dict,
                  flops: float = 0.0) -> Launch:
    """A torch op as one pass over the whole GPU (no grid): its inputs read and outputs written once."""
    return Launch(kernel=kernel, grid=(), num_warps=0, programs=1, resident=1, programs_run=1,
                  bytes_loaded=float(loaded), bytes_stored=float(stored), bytes_written_back=float(stored),
                  flops=flops, first_touch=first_touch, sizes=sizes, touched=touched)


@dataclasses.dataclass
class Traffic:
    """The launches recorded by :func:`count_traffic`, in order."""

    launches: list = dataclasses.field(default_factory=list)
    gpu: GPU = H200

    def launch_hbm(self) -> list[float]:
        """Each launch's DRAM bytes with L2 reuse across launches (docs/PERFORMANCE.md, "Across launches")."""
        touches: dict[int, list[int]] = {}
        ends: list[float] = []
        total, out = 0.0, []
        for j, x in enumerate(self.launches):
            hits = 0.0
            for key, b in x.first_touch.items():
                left = [min(1.0, max(0.0, self.gpu.l2_bytes - (total - ends[i])) / max(self.launches[i].footprint, 1.0))
                        * self.launches[i].touched[key] for i in touches.get(key, ())]
                hits += min(b, x.sizes.get(key, b), max(left, default=0.0))
            out.append(x.bytes_hbm - hits)
            total += x.footprint
            ends.append(total)
            for key in x.touched:
                touches.setdefault(key, []).append(j)
        return out

    def total(self, field: str) -> float:
        return float(sum(getattr(x, field) for x in self.launches))

    bytes_loaded = property(lambda self: self.total("bytes_loaded"))
    bytes_stored = property(lambda self: self.total("bytes_stored"))
    flops = property(lambda self: self.total("flops"))

    @property
    def bytes_hbm(self) -> float:
        return float(sum(self.launch_hbm()))


class Counter:
    """The counts of the launch in progress: each sector access with its program's wave and clock (the bytes the
    program touched before it), replayed by :meth:`end_launch` in GPU order."""

    def __init__(self, gpu: GPU, axis_cap: int, loop_cap: int):
        self.gpu, self.axis_cap, self.loop_cap = gpu, axis_cap, loop_cap
        self.traffic = Traffic(gpu=gpu)
        self.launch: Launch | None = None
        self.starts, self.sizes = np.zeros(0, dtype=np.uint64), []  # the launch's tensors (regions), by address
        self.in_kernel = False
        self.suspended = False  # inside the interpreter's own torch calls (argument copies)
        self.weight = 1  # the program's stratum times the sampled loop iterations' strata
        self.loop_weight = 1  # the loop iterations' strata alone (what one instruction stands for in the clock)
        self.coords, self.axis_weights = (0, 0, 0), (1, 1, 1)
        self.clock, self.program, self.wave = 0.0, -1, 0
        self.lengths: list[float] = []
        self.keys: list[np.ndarray] = []  # per instruction: its distinct sectors,
        self.meta: list[tuple] = []  # and wave, program, clock, weight, kind, grid index (3), strata per axis (3)

    def begin_launch(self, kernel: str, grid: tuple, num_warps: int, spans: dict[int, int]) -> Launch:
        """Open a launch on the tensors ``spans`` ({start address: bytes})."""
        full = tuple(int(g) for g in grid) + (1,) * (3 - len(grid))
        programs = int(np.prod(full))
        self.launch = Launch(kernel=kernel, grid=tuple(grid), num_warps=num_warps, programs=programs,
                             resident=self.gpu.resident(num_warps, programs))
        self.launch.sizes = dict(sorted(spans.items()))
        self.starts, self.sizes = np.array(list(self.launch.sizes), dtype=np.uint64), list(self.launch.sizes.values())
        self.program, self.clock, self.lengths, self.keys, self.meta = -1, 0.0, [], [], []
        self.traffic.launches.append(self.launch)
        return self.launch

    def start_program(self, grid_idx: tuple, grid_dim: tuple, axis_weights: tuple) -> None:
        """A sampled program at ``grid_idx`` standing for ``axis_weights`` programs along each grid axis."""
        if self.program >= 0:
            self.lengths.append(self.clock)
        self.coords, self.axis_weights = tuple(grid_idx), tuple(axis_weights)
        x, y, z = grid_idx
        gx, gy, _ = grid_dim
        self.wave = (x + gx * (y + gy * z)) // self.launch.resident
        self.weight, self.loop_weight = int(np.prod(axis_weights)), 1
        self.program, self.clock = self.program + 1, 0.0
        self.launch.programs_run += 1

    def access(self, ptrs, mask, kind: int) -> None:
        """One load, store or atomic: the lanes the mask keeps, a repeated address once."""
        if self.launch is None:
            return
        addr = np.asarray(ptrs.data).reshape(-1)
        if mask is not None:
            addr = addr[np.broadcast_to(np.asarray(mask.data, dtype=bool), np.shape(ptrs.data)).reshape(-1)]
        addr = np.unique(addr)
        n = self.weight * addr.size * (ptrs.get_element_ty().primitive_bitwidth // 8)
        self.record(self.sectors(addr), kind, n)

    def sectors(self, addr: np.ndarray) -> np.ndarray:
        """Distinct sector keys (``region << 40 | sector``, int64) of ``addr`` (uint64 addresses)."""
        if addr.size == 0:
            return np.zeros(0, dtype=np.int64)
        r = np.searchsorted(self.starts, addr, side="right") - 1
        if (r < 0).any():
            raise RuntimeError("a kernel accessed memory outside its tensor arguments")
        off = (addr - self.starts[r]).astype(np.int64)
        if (off >= np.asarray(self.sizes, dtype=np.int64)[r]).any():
            raise RuntimeError("a kernel accessed memory past the end of a tensor argument")
        return np.unique((r.astype(np.int64) << 40) | (off // SECTOR))

    def record(self, keys: np.ndarray, kind: int, n: float) -> None:
        """One instruction: ``n`` bytes (weighted) loaded, stored or atomically updated (a load and a store), over
        its distinct sectors ``keys`` (``region << 40 | sector``)."""
        lx = self.launch
        if kind != STORE:
            lx.bytes_loaded += n
        if kind != LOAD:
            lx.bytes_stored += n
        if kind == ATOMIC:
            lx.bytes_atomic += n
        elif kind == STORE:
            lx.bytes_written_back += n
        self.keys.append(keys)
        self.meta.append((self.wave, self.program, self.clock, self.weight, kind, *self.coords, *self.axis_weights))
        self.clock += SECTOR * keys.size * self.loop_weight

    def dot(self, a, b) -> None:
        if self.launch is None:
            return
        sa, sb = np.shape(a.data), np.shape(b.data)
        batch = int(np.prod(sa[:-2]))  # 1 for a 2-d product
        self.launch.flops += self.weight * 2.0 * batch * sa[-2] * sa[-1] * sb[-1]

    def end_launch(self) -> None:
        """Replay the launch's accesses in GPU order through the L2 model, in buckets of sectors (memory)."""
        lx = self.launch
        if self.program >= 0:
            self.lengths.append(self.clock)
        if not self.keys:
            return
        length = float(np.mean(self.lengths)) if self.lengths else 0.0
        meta = np.array(self.meta, dtype=float)
        key = np.concatenate(self.keys)
        record = np.repeat(np.arange(len(self.keys), dtype=np.int32), [k.size for k in self.keys])
        self.keys, self.meta = [], []
        first_touch, touched = np.zeros(len(self.starts)), np.zeros(len(self.starts))
        buckets = max(1, -(-key.size // BUCKET_ACCESSES))
        bucket = (key % buckets).astype(np.int32) if buckets > 1 else None
        clock = meta[:, 0] * length + meta[:, 2]
        for b in range(buckets):
            pick = slice(None) if bucket is None else np.flatnonzero(bucket == b)
            self.replay(lx, key[pick], record[pick], meta, clock, first_touch, touched)
        for r, start in enumerate(self.starts):
            lx.first_touch[int(start)] = SECTOR * float(first_touch[r])
            lx.touched[int(start)] = min(SECTOR * float(touched[r]), self.sizes[r])

    def replay(self, lx: Launch, key, record, meta, clock, first_touch, touched) -> None:
        """One bucket of sectors through the L2 model; adds to ``lx`` and the per-region sums."""
        order = np.lexsort((clock[record], key))
        key, record = key[order], record[order]
        del order
        tau, prog, w, kind = clock[record], meta[record, 1], meta[record, 3], meta[record, 4]
        first = np.ones(key.size, dtype=bool)
        first[1:] = key[1:] != key[:-1]
        # a first touch weighs as its sector's least-weighted access (sampled programs sharing the sector)
        starts = np.flatnonzero(first)
        w_first = np.zeros(key.size)
        w_first[starts] = np.minimum.reduceat(w, starts)
        gap = np.zeros(key.size)
        gap[1:] = np.diff(tau)
        del tau
        same = np.zeros(key.size, dtype=bool)
        same[1:] = ~first[1:] & (prog[1:] == prog[:-1])
        del prog
        reads = kind != STORE
        # after another program's access, the skipped programs of the axes the two differ on read it in between
        coords = meta[record, 5:8]
        differ = np.zeros(coords.shape, dtype=bool)
        differ[1:] = coords[1:] != coords[:-1]
        del coords
        gap = gap / np.where(differ, meta[record, 8:11], 1.0).prod(axis=1)
        del differ
        miss = reads & ~first & (gap * lx.resident > self.gpu.l2_bytes)
        lx.bytes_reread += SECTOR * float(w[reads & same].sum())
        lx.bytes_capacity_miss += SECTOR * float(w[miss].sum())
        lx.bytes_written_back += SECTOR * float(w_first[first & (kind == ATOMIC)].sum())
        region = key >> 40
        fresh = first & reads
        first_touch += np.bincount(region[fresh], weights=w_first[fresh], minlength=first_touch.size)
        touched += np.bincount(region[first], weights=w_first[first], minlength=touched.size)


def strata(n: int, cap: int) -> list[tuple[int, int]]:
    """``[(program id, weight)]`` along an axis of ``n`` programs: all when ``n <= cap``, else the first and the last
    alone and the middle of ``cap - 2`` equal strata between."""
    if cap < 3:
        raise ValueError(f"cap must be >= 3, got {cap}")
    if n <= cap:
        return [(i, 1) for i in range(n)]
    m, k = n - 2, cap - 2
    bounds = [1 + (j * m) // k for j in range(k + 1)]
    mid = [((a + b - 1) // 2, b - a) for a, b in zip(bounds, bounds[1:]) if b > a]
    return [(0, 1)] + mid + [(n - 1, 1)]


def grid_strata(dims: tuple, cap: int) -> list[tuple[tuple, tuple]]:
    """``[((x, y, z), (wx, wy, wz))]``: the sampled programs of a 3-d grid (x outermost) and their strata."""
    ax, ay, az = (strata(int(n), cap) for n in dims)
    return [((x, y, z), (wx, wy, wz)) for x, wx in ax for y, wy in ay for z, wz in az]


def loop_strata(r: range, cap: int) -> list[tuple[int, int]]:
    """``[(value, weight)]`` of a kernel loop over ``r``: all when ``len(r) <= cap``, else the first and the last
    alone and, equally weighted, the indices between on one lattice from 0 (so that loops starting apart sample the
    same tiles): multiples of the smallest power of two leaving at most ``cap - 2`` of them."""
    if len(r) <= cap:
        return [(v, 1) for v in r]
    mid = r[1:-1]
    extent = max(r[0], r[-1]) // abs(r.step) + 1
    k = 1
    while -(-(extent - 2) // k) > cap - 2:
        k *= 2
    picked = [v for v in mid if (v // abs(r.step)) % k == 0] or [mid[len(mid) // 2]]
    share, extra = divmod(len(mid), len(picked))
    return [(r[0], 1)] + [(v, share + (i < extra)) for i, v in enumerate(picked)] + [(r[-1], 1)]


def sampled_loop(c, r: range):
    """Iterate ``r`` as :func:`loop_strata` samples it, the counter ``c`` weighting each iteration's accesses."""
    outer_w, outer_lw = c.weight, c.loop_weight
    try:
        for v, w in loop_strata(r, c.loop_cap):
            c.weight, c.loop_weight = outer_w * w, outer_lw * w
            yield v
    finally:
        c.weight, c.loop_weight = outer_w, outer_lw


class SampledKernel:
    """The kernel's function as GridExecutor calls it per program: runs the sampled programs only, weighted."""

    def __init__(self, fn, counter, builder):
        self._fn, self._counter, self._builder = fn, counter, builder
        self._plan: dict | None = None
        self.__signature__ = inspect.signature(fn)
        self.__globals__ = fn.__globals__
        self.__name__ = fn.__name__
        self.__annotations__ = getattr(fn, "__annotations__", {})

    def __call__(self, **kwargs):
        dims, idx = tuple(self._builder.grid_dim), tuple(self._builder.grid_idx)
        if self._plan is None:
            self._plan = dict(grid_strata(dims, self._counter.axis_cap))
        w = self._plan.get(idx)
        if w is None:
            return None
        self._counter.start_program(idx, dims, w)
        self._counter.in_kernel = True
        try:
            return self._fn(**kwargs)
        finally:
            self._counter.in_kernel = False


def sampled_range(counter):
    """``range`` as the kernels' modules see it while counting: inside a kernel, a long loop runs its sample."""
    def sampled(*args):
        r = builtins.range(*(operator.index(a) for a in args))
        if not counter.in_kernel or len(r) <= counter.loop_cap:
            return r
        return sampled_loop(counter, r)

    return sampled


#: torch ops that launch nothing, and ops that write without reading
NO_LAUNCH = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "_local_scalar_dense",
             "lift_fresh", "detach", "alias", "set_", "resize_", "is_nonzero", "_to_copy_cpu_noop"}
WRITE_ONLY = {"zero_", "fill_", "zeros", "zeros_like", "full", "full_like", "ones", "ones_like", "arange",
              "new_zeros", "new_full", "new_ones", "scalar_tensor"}
#: the open count_traffic block (the interpreter's hooks are process-wide: blocks do not nest)
ACTIVE = []


def by_storage(tensors) -> dict[int, float]:
    """``{storage address: the most bytes one of the tensors views of it}``."""
    out: dict[int, float] = {}
    for t in tensors:
        key = t.untyped_storage().data_ptr()
        out[key] = max(out.get(key, 0.0), float(t.nbytes))
    return out


def flop_formula(func):
    """torch.utils.flop_counter's formula of ``func`` (or of its functional variant)."""
    formula = flop_registry.get(func.overloadpacket)
    name = func.overloadpacket.__name__
    if formula is None and name.endswith("_") and hasattr(torch.ops.aten, name[:-1]):
        formula = flop_registry.get(getattr(torch.ops.aten, name[:-1]))
    return formula


def count_flops(formula, args, kwargs, out) -> float:
    """FLOPs by ``formula``, else by its tensor arguments alone, else 2 * numel(out) * K: never an error."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    for call in (lambda: formula(*args, **kwargs, out_val=out), lambda: formula(*tensors, out_val=out)):
        try:
            return float(call())
        except Exception:  # noqa: BLE001 - next form
            pass
    mats = [t for t in tensors if t.dim() >= 2]
    o = out if isinstance(out, torch.Tensor) else None
    return 2.0 * o.numel() * mats[0].shape[-1] if mats and o is not None else 0.0


def shaped_like(func, args, kwargs):
    """What ``func`` would return, uninitialized (shapes from meta tensors; ``out=`` or in-place: the destination)."""
    to_meta = lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t  # noqa: E731
    meta = func(*torch.utils._pytree.tree_map(to_meta, args), **torch.utils._pytree.tree_map(to_meta, kwargs))
    if isinstance(kwargs.get("out"), torch.Tensor):
        return kwargs["out"]
    first = func._schema.arguments[0].alias_info if func._schema.arguments else None
    if first is not None and first.is_write:
        return args[0]
    device = next(t.device for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))
    return torch.utils._pytree.tree_map(
        lambda m: torch.empty_strided(m.shape, m.stride(), dtype=m.dtype, device=device)
        if isinstance(m, torch.Tensor) else m, meta)


class GlueMode(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the torch ops run outside the Triton launches, one :class:`Launch` each (matmuls counted, not run)."""

    def __init__(self, counter: Counter):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        c = self.counter
        busy = c.launch is not None or c.suspended  # inside a launch, or the interpreter's own calls
        formula = flop_formula(func)
        out = shaped_like(func, args, kwargs) if formula is not None and not busy else func(*args, **kwargs)
        name = func.overloadpacket.__name__
        schema = func._schema
        view = any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)
        if busy or view or name in NO_LAUNCH:
            return out
        given = (args, {k: v for k, v in kwargs.items() if k != "out"})  # an out= tensor is written, not read
        ins = [a for a in torch.utils._pytree.tree_leaves(given) if isinstance(a, torch.Tensor)]
        outs = [o for o in torch.utils._pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]
        written = [a for a, arg in zip(args, schema.arguments)
                   if isinstance(a, torch.Tensor) and arg.alias_info is not None and arg.alias_info.is_write]
        if isinstance(kwargs.get("out"), torch.Tensor):
            written.append(kwargs["out"])
        if name in WRITE_ONLY:
            ins = []
        elif name == "copy_":  # overwrites its destination
            ins = [a for a in ins if not any(a is w for w in written)]
        written = written or outs
        flops = count_flops(formula, args, kwargs, out) if formula is not None else 0.0
        reads = by_storage(ins)
        c.traffic.launches.append(stream_launch(
            f"aten.{name}", sum(a.nbytes for a in ins), sum(o.nbytes for o in written), reads,
            {k: int(b) for k, b in reads.items()}, {**reads, **by_storage(written)}, flops))
        return out


#: the interpreter builder's instructions counted, and what each records of its positional arguments
INSTRUCTIONS = {"create_masked_load": lambda c, ptrs, mask, *_: c.access(ptrs, mask, LOAD),
                "create_masked_store": lambda c, ptrs, value, mask, *_: c.access(ptrs, mask, STORE),
                "create_dot": lambda c, a, b, *_: c.dot(a, b),
                "create_atomic_rmw": lambda c, op, ptr, val, mask, *_: c.access(ptr, mask, ATOMIC),
                "create_atomic_cas": lambda c, ptr, *_: c.access(ptr, None, ATOMIC)}


def counted(method, note, counter: Counter):
    """The builder's ``method``, ``note`` recording the instruction into ``counter`` first."""
    def run(self, *args, **kwargs):
        note(counter, *args)
        return method(self, *args, **kwargs)

    return run


def launch_hook(counter: Counter, interp):
    """``InterpretedFunction.run``: each launch a :class:`Launch`, its programs sampled."""
    def run(self, *args, grid, warmup, **kwargs):
        if warmup:
            return None
        spans: dict[int, int] = {}
        for a in list(args) + list(kwargs.values()):
            if not isinstance(a, torch.Tensor):
                a = getattr(a, "base", None)  # a TensorWrapper's tensor
            if isinstance(a, torch.Tensor):
                st = a.untyped_storage()
                spans[st.data_ptr()] = max(spans.get(st.data_ptr(), 0), st.nbytes())
        grid_t = tuple(grid(kwargs) if callable(grid) else grid)
        counter.begin_launch(self.fn.__name__, grid_t, int(kwargs.get("num_warps", 4)), spans)
        counter.suspended = True
        fn = SampledKernel(self.rewrite(), counter, interp.interpreter_builder)
        try:
            out = interp.GridExecutor(fn, self.arg_names, grid, self.pre_run_hooks)(*args, **kwargs)
            counter.end_launch()
            return out
        finally:
            counter.launch, counter.suspended = None, False

    return run


@contextlib.contextmanager
def count_traffic(gpu: GPU = H200, axis_cap: int = 6, loop_cap: int = 8, count_torch: bool = True) -> Iterator[Traffic]:
    """Yield a :class:`Traffic` of every interpreted Triton launch in the block (``TRITON_INTERPRET=1`` set before
    triton decorated the kernels), at most ``axis_cap`` programs per grid axis and ``loop_cap`` iterations per loop
    of smxcompile's kernels (both >= 3), and with ``count_torch`` the torch ops around them."""
    from triton.runtime import interpreter as interp

    for name, cap in (("axis_cap", axis_cap), ("loop_cap", loop_cap)):
        if cap < 3:
            raise ValueError(f"{name} must be >= 3, got {cap}")
    if ACTIVE:
        raise RuntimeError("count_traffic blocks do not nest: close the open one first")
    counter = Counter(gpu, axis_cap, loop_cap)
    with contextlib.ExitStack() as stack:
        for name, note in INSTRUCTIONS.items():
            method = getattr(interp.InterpreterBuilder, name)
            stack.enter_context(patch.object(interp.InterpreterBuilder, name, counted(method, note, counter)))
        stack.enter_context(patch.object(interp.InterpretedFunction, "run", launch_hook(counter, interp)))
        for name, m in list(sys.modules.items()):  # the kernels' loops
            if m is not None and name.startswith("smxcompile.kernels") and getattr(m, "tl", None) is not None:
                stack.enter_context(patch.object(m, "range", sampled_range(counter), create=True))
        if count_torch:
            stack.enter_context(GlueMode(counter))
        stack.enter_context(np.errstate(all="ignore"))  # a sampled launch computes on skipped programs' garbage
        ACTIVE.append(counter)
        stack.callback(ACTIVE.clear)
        yield counter.traffic
