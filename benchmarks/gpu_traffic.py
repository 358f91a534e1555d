"""Count what Triton kernels move and compute, by instrumenting Triton's interpreter
(``triton/runtime/interpreter.py``: ``InterpreterBuilder.create_masked_load`` / ``_store``, ``create_dot``,
``create_atomic_rmw``; ``InterpretedFunction.run``).

Inside :func:`count_traffic` every kernel launch becomes a :class:`Launch`: the bytes of the ``tl.load`` /
``tl.store`` lanes the mask keeps (an address repeated within one instruction counts once; atomics count as a load
and a store), re-reads, ``tl.dot`` FLOPs (2 M N K) and ``bytes_hbm``, DRAM bytes by an L2 model: programs run
``resident`` at a time (:meth:`GPU.resident`), in waves in launch order, at the same pace; an access to a sector
touched before in the launch is an L2 hit when the bytes all resident programs touch in between fit in L2, else DRAM
traffic, as is a first touch (capped at each tensor's size); stores are DRAM traffic, an atomic's sector is written
back once. Across launches (:meth:`Traffic.launch_hbm`) a tensor an earlier launch touched hits L2 for the share of
that launch's footprint L2 still holds. The torch ops a launcher runs around its kernels are launches of their own
(tensor inputs read, outputs written, matmul FLOPs by ``torch.utils.flop_counter``'s formulas, counted, not
computed). Grids of more than ``axis_cap`` programs per axis and kernel loops of more than ``loop_cap`` iterations
are sampled (gpu_sampling.py), each sampled program or iteration weighted by those it stands for: a sampled launch's
outputs are not the kernel's results.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from typing import Iterator

import numpy as np
import torch
import torch.utils._python_dispatch
import torch.utils._pytree
from torch.utils.flop_counter import flop_registry

from gpu_sampling import SampledKernel, SampledRange

#: DRAM access granularity (bytes) used for the distinct-sector bookkeeping.
SECTOR = 32


@dataclasses.dataclass(frozen=True)
class GPU:
    """What the model needs of a GPU. Defaults: an H200 (SXM): 132 SMs, 50 MiB of L2, 4.3 TB/s measured for a
    plain device-to-device copy, 990 TFLOP/s dense bf16 tensor-core peak, ~3 us per kernel launch, and what one
    SM moves to and from L2: 64 bytes per clock at a sustained 1.75 GHz (an assumption until
    benchmarks/gpu/compare_model.py measures it)."""

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
    """One kernel launch's counts (weighted sums over the programs of the grid)."""

    kernel: str
    grid: tuple
    num_warps: int
    programs: int
    resident: int
    programs_run: int = 0
    bytes_loaded: float = 0.0
    bytes_stored: float = 0.0
    bytes_atomic: float = 0.0
    #: loads of sectors the same program had touched before
    bytes_reread: float = 0.0
    #: loads and atomics that the L2 model sends to DRAM although the launch touched the sector before
    bytes_capacity_miss: float = 0.0
    flops: float = 0.0
    #: per tensor argument (keyed by its storage address): weighted bytes of the sectors loaded (or atomically
    #: updated) first in the launch, and the storage's size (the cap of that share of :attr:`bytes_hbm`)
    first_touch: dict = dataclasses.field(default_factory=dict)
    sizes: dict = dataclasses.field(default_factory=dict)
    #: non-atomic store bytes, and atomically updated sectors' write-back (first touch)
    bytes_written_back: float = 0.0
    #: per storage: distinct bytes the launch loaded or stored (what it leaves in L2 for the launches after it)
    touched: dict = dataclasses.field(default_factory=dict)

    @property
    def footprint(self) -> float:
        return float(sum(self.touched.values()))

    @property
    def bytes_hbm(self) -> float:
        """Estimated DRAM bytes (see the module docstring): first touches (at most each tensor's size), capacity
        misses, stores and atomics' write-back."""
        first = sum(min(b, self.sizes[k]) for k, b in self.first_touch.items())
        return first + self.bytes_capacity_miss + self.bytes_written_back


@dataclasses.dataclass
class Traffic:
    """The launches recorded by :func:`count_traffic`, in order."""

    launches: list = dataclasses.field(default_factory=list)
    gpu: GPU = H200

    def launch_hbm(self) -> list[float]:
        """Each launch's DRAM bytes with L2 reuse across launches: of a tensor a launch reads first, the part an
        earlier launch left in L2 is a hit. Launch ``i`` leaves the bytes it touched of the tensor, times the
        share of its footprint still in L2: ``(L2 - the footprints of the launches since) / its footprint``; the
        best of the earlier launches that touched it counts (a small late touch does not hide a large one)."""
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

    @property
    def bytes_loaded(self) -> float:
        return self.total("bytes_loaded")

    @property
    def bytes_stored(self) -> float:
        return self.total("bytes_stored")

    @property
    def flops(self) -> float:
        return self.total("flops")

    @property
    def bytes_hbm(self) -> float:
        """Estimated DRAM bytes, L2 reuse within and across launches included."""
        return float(sum(self.launch_hbm()))

    def by_kernel(self) -> dict:
        """``{kernel name: number of launches}``."""
        out: dict = {}
        for x in self.launches:
            out[x.kernel] = out.get(x.kernel, 0) + 1
        return out


class Regions:
    """The tensor arguments of a launch, and which one an address belongs to."""

    def __init__(self, tensors: list[torch.Tensor]):
        spans: dict[int, int] = {}
        for t in tensors:
            st = t.untyped_storage()
            spans[st.data_ptr()] = max(spans.get(st.data_ptr(), 0), st.nbytes())
        self.starts = np.array(sorted(spans), dtype=np.uint64)
        self.sizes = [spans[int(s)] for s in self.starts]

    @classmethod
    def from_spans(cls, spans: dict[int, int]) -> "Regions":
        """Regions of given ``{start address: size in bytes}`` (a trace's buffers, no tensors behind them)."""
        self = cls.__new__(cls)
        self.starts = np.array(sorted(spans), dtype=np.uint64)
        self.sizes = [spans[int(s)] for s in self.starts]
        return self

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


#: access kinds recorded per sector
_LOAD, _STORE, _ATOMIC = 0, 1, 2


#: sector accesses replayed in one pass of :meth:`Counter.end_launch` (bounds its memory)
_BUCKET_ACCESSES = 1 << 25


class _RecordTable:
    """Per-instruction fields of a launch's records as arrays (one row per instruction)."""

    def __init__(self, records: list[tuple], length: float):
        self.tau = np.array([r[1] * length + r[3] for r in records], dtype=float)
        self.prog = np.array([r[2] for r in records], dtype=np.int64)
        self.weight = np.array([float(r[4]) for r in records], dtype=float)
        self.kind = np.array([r[5] for r in records], dtype=np.int8)
        self.coords = np.array([r[6] for r in records], dtype=np.int64).reshape(-1, 3)
        self.axis_weights = np.array([r[7] for r in records], dtype=float).reshape(-1, 3)


class Counter:
    """The counts of the launch in progress. Programs run one after another in the interpreter; each sector access
    is recorded with the program's wave (its linear id, ``x`` fastest as CUDA orders blocks, over ``resident``)
    and clock (the bytes, distinct sectors per instruction times the sampled loop strata, the program touched
    before it), and :meth:`end_launch` replays them in GPU order: wave, then clock, the programs of a wave side by
    side at the same pace."""

    def __init__(self, gpu: GPU, axis_cap: int, loop_cap: int):
        self.gpu = gpu
        self.axis_cap = axis_cap
        self.loop_cap = loop_cap
        self.traffic = Traffic(gpu=gpu)
        self.launch: Launch | None = None
        self.regions: Regions | None = None
        self.in_kernel = False
        self.weight = 1  # the program's stratum times the sampled loop iterations' strata
        self.coords, self.axis_weights = (0, 0, 0), (1, 1, 1)  # the sampled program's grid index, strata per axis
        self.loop_weight = 1  # the loop iterations' strata alone (what one instruction stands for in the clock)
        self.clock = 0.0
        self.program = -1
        self.wave = 0
        self.lengths: list[float] = []
        self.records: list[tuple] = []
        self.suspended = False  # inside the interpreter's own torch calls (argument copies)

    def begin_launch(self, launch: Launch, regions: Regions) -> None:
        self.launch, self.regions = launch, regions
        self.program, self.clock, self.lengths, self.records = -1, 0.0, [], []

    def start_program(self, weight: int, grid_idx: tuple, grid_dim: tuple, axis_weights: tuple = (1, 1, 1)) -> None:
        """A sampled program at ``grid_idx`` standing for ``axis_weights`` programs along each grid axis."""
        if self.program >= 0:
            self.lengths.append(self.clock)
        self.coords, self.axis_weights = tuple(grid_idx), tuple(axis_weights)
        x, y, z = grid_idx
        gx, gy, _ = grid_dim
        self.wave = (x + gx * (y + gy * z)) // self.launch.resident
        self.weight, self.loop_weight = weight, 1
        self.program, self.clock = self.program + 1, 0.0
        self.launch.programs_run += 1

    def _lanes(self, ptrs, mask) -> np.ndarray:
        addr = np.asarray(ptrs.data).reshape(-1)
        if mask is not None:
            keep = np.broadcast_to(np.asarray(mask.data, dtype=bool), np.shape(ptrs.data)).reshape(-1)
            addr = addr[keep]
        return np.unique(addr)

    def access(self, ptrs, mask, kind: int) -> None:
        if self.launch is None:
            return
        lx, w = self.launch, self.weight
        addr = self._lanes(ptrs, mask)
        nbytes = w * addr.size * (ptrs.get_element_ty().primitive_bitwidth // 8)
        if kind != _STORE:
            lx.bytes_loaded += nbytes
        if kind != _LOAD:
            lx.bytes_stored += nbytes
        if kind == _ATOMIC:
            lx.bytes_atomic += nbytes
        elif kind == _STORE:
            lx.bytes_written_back += nbytes
        self.record(self.regions.sectors(addr), kind)

    def record(self, keys: np.ndarray, kind: int) -> None:
        """One instruction's distinct sectors (``region << 40 | sector``) for the L2 replay."""
        self.records.append((keys, self.wave, self.program, self.clock, self.weight, kind, self.coords,
                             self.axis_weights))
        self.clock += SECTOR * keys.size * self.loop_weight

    def end_launch(self) -> None:
        """Replay the launch's accesses in GPU order through the L2 model (see the module docstring)."""
        lx = self.launch
        if self.program >= 0:
            self.lengths.append(self.clock)
        if not self.records:
            return
        length = float(np.mean(self.lengths)) if self.lengths else 0.0
        records, self.records = self.records, []
        per_record = _RecordTable(records, length)
        key = np.concatenate([r[0] for r in records])
        record = np.repeat(np.arange(len(records), dtype=np.int32), [r[0].size for r in records])
        del records
        regions = len(self.regions.starts)
        first_touch, touched = np.zeros(regions), np.zeros(regions)
        # the replay is per sector: buckets of sectors bound the memory of one pass (~150 bytes per access)
        buckets = max(1, -(-key.size // _BUCKET_ACCESSES))
        bucket = (key % buckets).astype(np.int32) if buckets > 1 else None
        for b in range(buckets):
            pick = slice(None) if bucket is None else np.flatnonzero(bucket == b)
            self._replay(lx, key[pick], record[pick], per_record, first_touch, touched)
        for r, start in enumerate(self.regions.starts):
            lx.first_touch[int(start)] = SECTOR * float(first_touch[r])
            lx.touched[int(start)] = min(SECTOR * float(touched[r]), self.regions.sizes[r])

    def _replay(self, lx: Launch, key, record, table: "_RecordTable", first_touch, touched) -> None:
        """One bucket of sectors through the L2 model; adds to ``lx`` and the per-region sums."""
        order = np.lexsort((table.tau[record], key))
        key, record = key[order], record[order]
        del order
        tau, prog, w, kind = table.tau[record], table.prog[record], table.weight[record], table.kind[record]
        first = np.ones(key.size, dtype=bool)
        first[1:] = key[1:] != key[:-1]
        # a first touch stands for as many distinct sectors as the least-weighted access of its sector: a sector
        # that sampled programs share stands for the skipped programs' accesses to that same sector
        starts = np.flatnonzero(first)
        w_first = np.zeros(key.size)
        w_first[starts] = np.minimum.reduceat(w, starts)
        gap = np.zeros(key.size)
        gap[1:] = np.diff(tau)
        del tau
        same = np.zeros(key.size, dtype=bool)
        same[1:] = ~first[1:] & (prog[1:] == prog[:-1])
        del prog
        reads = kind != _STORE
        # after another program's access, the skipped programs of the sampled one's strata along the axes the two
        # differ on (those that share the sector) read it in between too
        coords = table.coords[record]
        differ = np.zeros(coords.shape, dtype=bool)
        differ[1:] = coords[1:] != coords[:-1]
        del coords
        gap = gap / np.where(differ, table.axis_weights[record], 1.0).prod(axis=1)
        del differ
        miss = reads & ~first & (gap * lx.resident > self.gpu.l2_bytes)
        lx.bytes_reread += SECTOR * float(w[reads & same].sum())
        lx.bytes_capacity_miss += SECTOR * float(w[miss].sum())
        lx.bytes_written_back += SECTOR * float(w_first[first & (kind == _ATOMIC)].sum())
        region = key >> 40
        fresh = first & reads
        first_touch += np.bincount(region[fresh], weights=w_first[fresh], minlength=first_touch.size)
        touched += np.bincount(region[first], weights=w_first[first], minlength=touched.size)

    def dot(self, a, b) -> None:
        if self.launch is None:
            return
        sa, sb = np.shape(a.data), np.shape(b.data)
        batch = int(np.prod(sa[:-2])) if len(sa) > 2 else 1
        self.launch.flops += self.weight * 2.0 * batch * sa[-2] * sa[-1] * sb[-1]


_NO_LAUNCH = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "_local_scalar_dense",
              "lift_fresh", "detach", "alias", "set_", "resize_", "is_nonzero", "_to_copy_cpu_noop"}
_WRITE_ONLY = {"zero_", "fill_", "zeros", "zeros_like", "full", "full_like", "ones", "ones_like", "arange",
               "new_zeros", "new_full", "new_ones", "scalar_tensor"}


#: in-place ops that write their destination without reading it
_DEST_NOT_READ = {"copy_"}
#: whether a count_traffic block is open (the interpreter's hooks are process-wide: blocks do not nest)
_ACTIVE = []


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _by_storage(tensors) -> dict[int, float]:
    """``{storage address: the most bytes one of the tensors views of it}``."""
    out: dict[int, float] = {}
    for t in tensors:
        key = t.untyped_storage().data_ptr()
        out[key] = max(out.get(key, 0.0), float(_nbytes(t)))
    return out


def _flop_formula(func):
    """torch.utils.flop_counter's FLOP formula of ``func`` (an in-place variant uses its functional one)."""
    formula = flop_registry.get(func.overloadpacket)
    name = func.overloadpacket.__name__
    if formula is None and name.endswith("_") and hasattr(torch.ops.aten, name[:-1]):
        formula = flop_registry.get(getattr(torch.ops.aten, name[:-1]))
    return formula


def _flops(formula, args, kwargs, out) -> float:
    """FLOPs by ``formula``; an overload the formula does not take (``addmm.dtype_out``'s ``out_dtype``) is
    counted from its tensor arguments. A counting error must never reach the launcher (it could take another
    path), so what still fails counts 2 * prod(out) * K from the first matrix operand."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    for call in (lambda: formula(*args, **kwargs, out_val=out), lambda: formula(*tensors, out_val=out)):
        try:
            return float(call())
        except Exception:  # noqa: BLE001 - next form
            pass
    mats = [t for t in tensors if t.dim() >= 2]
    o = out if isinstance(out, torch.Tensor) else None
    return 2.0 * o.numel() * mats[0].shape[-1] if mats and o is not None else 0.0


def _shaped_like(func, args, kwargs):
    """What ``func`` would return, uninitialized: its output shapes from a run on meta tensors (an ``out=``
    argument is returned itself)."""
    to_meta = lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t  # noqa: E731
    meta = func(*torch.utils._pytree.tree_map(to_meta, args), **torch.utils._pytree.tree_map(to_meta, kwargs))
    if isinstance(kwargs.get("out"), torch.Tensor):
        return kwargs["out"]
    if func._schema.arguments and func._schema.arguments[0].alias_info is not None \
            and func._schema.arguments[0].alias_info.is_write:  # in place
        return args[0]
    device = next(t.device for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))
    return torch.utils._pytree.tree_map(
        lambda m: torch.empty_strided(m.shape, m.stride(), dtype=m.dtype, device=device)
        if isinstance(m, torch.Tensor) else m, meta)


class _GlueMode(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the torch ops run outside the Triton launches while counting, one :class:`Launch` each."""

    def __init__(self, counter: Counter):
        super().__init__()
        self._counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        c = self._counter
        formula = _flop_formula(func)
        if formula is not None and c.launch is None and not c.suspended:
            out = _shaped_like(func, args, kwargs)  # a matmul's numbers are not needed to count it
        else:
            out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        schema = func._schema
        view = any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)
        if c.launch is not None or c.suspended or view or name in _NO_LAUNCH:
            return out
        given = (args, {k: v for k, v in kwargs.items() if k != "out"})  # an out= tensor is written, not read
        ins = [a for a in torch.utils._pytree.tree_leaves(given) if isinstance(a, torch.Tensor)]
        outs = [o for o in torch.utils._pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]
        written = [a for a, arg in zip(args, schema.arguments)
                   if isinstance(a, torch.Tensor) and arg.alias_info is not None and arg.alias_info.is_write]
        if isinstance(kwargs.get("out"), torch.Tensor):
            written.append(kwargs["out"])
        if name in _DEST_NOT_READ:  # copy_ overwrites its destination
            ins = [a for a in ins if not any(a is w for w in written)]
        read = 0 if name in _WRITE_ONLY else sum(_nbytes(a) for a in ins)
        wrote = sum(_nbytes(o) for o in (written or outs))
        flops = 0.0
        if formula is not None:  # matmuls: torch's own FLOP formulas (torch.utils.flop_counter)
            flops = _flops(formula, args, kwargs, out)
        g = Launch(kernel=f"aten.{name}", grid=(), num_warps=0, programs=1, resident=1, programs_run=1,
                   bytes_loaded=float(read), bytes_stored=float(wrote), bytes_written_back=float(wrote), flops=flops)
        reads = _by_storage([] if name in _WRITE_ONLY else ins)
        g.first_touch, g.sizes = reads, {k: int(b) for k, b in reads.items()}
        g.touched = {**reads, **_by_storage(written or outs)}
        c.traffic.launches.append(g)
        return out


def _tensors(args, kwargs) -> list[torch.Tensor]:
    out = []
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif hasattr(a, "base") and isinstance(getattr(a, "base"), torch.Tensor):  # TensorWrapper
            out.append(a.base)
    return out


def _builder_hooks(counter: Counter, saved: dict) -> dict:
    """The interpreter builder's memory and dot instructions, recording into ``counter`` before running ``saved``."""
    def masked_load(self, ptrs, mask, other, cache_policy, is_volatile):
        counter.access(ptrs, mask, _LOAD)
        return saved["create_masked_load"](self, ptrs, mask, other, cache_policy, is_volatile)

    def masked_store(self, ptrs, value, mask, cache_policy):
        counter.access(ptrs, mask, _STORE)
        return saved["create_masked_store"](self, ptrs, value, mask, cache_policy)

    def dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        counter.dot(a, b)
        return saved["create_dot"](self, a, b, d, input_precision, max_num_imprecise_acc)

    def atomic_rmw(self, rmw_op, ptr, val, mask, sem, scope):
        counter.access(ptr, mask, _ATOMIC)
        return saved["create_atomic_rmw"](self, rmw_op, ptr, val, mask, sem, scope)

    def atomic_cas(self, ptr, cmp, val, sem, scope):
        counter.access(ptr, None, _ATOMIC)
        return saved["create_atomic_cas"](self, ptr, cmp, val, sem, scope)

    return {"create_masked_load": masked_load, "create_masked_store": masked_store, "create_dot": dot,
            "create_atomic_rmw": atomic_rmw, "create_atomic_cas": atomic_cas}


def _launch_hook(counter: Counter, gpu: GPU, interp):
    """``InterpretedFunction.run``: each launch a :class:`Launch`, its programs sampled (:class:`SampledKernel`)."""
    def run(self, *args, grid, warmup, **kwargs):
        if warmup:
            return None
        grid_t = tuple(grid(kwargs) if callable(grid) else grid)
        full = grid_t + (1,) * (3 - len(grid_t))
        warps, programs = int(kwargs.get("num_warps", 4)), int(np.prod(full))
        launch = Launch(kernel=self.fn.__name__, grid=grid_t, num_warps=warps, programs=programs,
                        resident=gpu.resident(warps, programs))
        regions = Regions(_tensors(args, kwargs))
        launch.sizes = {int(r): size for r, size in zip(regions.starts, regions.sizes)}
        counter.begin_launch(launch, regions)
        counter.traffic.launches.append(launch)
        counter.suspended = True
        fn = SampledKernel(self.rewrite(), counter, interp.interpreter_builder)
        try:
            out = interp.GridExecutor(fn, self.arg_names, grid, self.pre_run_hooks)(*args, **kwargs)
            counter.end_launch()
            return out
        finally:
            counter.launch, counter.regions, counter.suspended = None, None, False

    return run


@contextlib.contextmanager
def count_traffic(gpu: GPU = H200, axis_cap: int = 6, loop_cap: int = 8,
                  modules: tuple[str, ...] = ("smxcompile.kernels",), count_torch: bool = True) -> Iterator[Traffic]:
    """Record every interpreted Triton launch inside the block (needs ``TRITON_INTERPRET=1`` set before triton
    decorated the kernels).

    Args:
        gpu: the GPU whose L2 and occupancy decide which re-reads are misses (:attr:`Launch.bytes_capacity_miss`).
        axis_cap: programs run per grid axis at most (>= 3; see the module docstring); a large value runs every
            program.
        loop_cap: iterations run per ``for ... in range(...)`` loop of a kernel at most (>= 3, sampled like the
            grid); a large value runs every iteration.
        modules: the packages whose kernels' loops are sampled (their modules that import triton.language).
        count_torch: also record the torch ops run around the kernels (see the module docstring).

    Yields:
        a :class:`Traffic` filled as kernels launch.

    Raises:
        RuntimeError: triton's interpreter is not importable; a kernel touched memory outside its tensor
            arguments; another ``count_traffic`` block is open.
    """
    try:
        from triton.runtime import interpreter as interp
    except Exception as e:  # pragma: no cover - no triton
        raise RuntimeError(f"counting needs triton's interpreter: {e!r}") from e
    for name, cap in (("axis_cap", axis_cap), ("loop_cap", loop_cap)):
        if cap < 3:
            raise ValueError(f"{name} must be >= 3, got {cap}")
    if _ACTIVE:
        raise RuntimeError("count_traffic blocks do not nest: close the open one first")
    counter = Counter(gpu, axis_cap, loop_cap)
    sampled_range = SampledRange(counter)
    kernel_modules = [m for name, m in list(sys.modules.items())
                      if m is not None and name.startswith(modules) and getattr(m, "tl", None) is not None]
    shadowed = {m: m.__dict__["range"] for m in kernel_modules if "range" in m.__dict__}
    builder_cls = interp.InterpreterBuilder
    saved = {name: getattr(builder_cls, name) for name in
             ("create_masked_load", "create_masked_store", "create_dot", "create_atomic_rmw", "create_atomic_cas")}
    saved_run = interp.InterpretedFunction.run

    for name, f in _builder_hooks(counter, saved).items():
        setattr(builder_cls, name, f)
    interp.InterpretedFunction.run = _launch_hook(counter, gpu, interp)
    for m in kernel_modules:
        m.range = sampled_range
    glue = _GlueMode(counter) if count_torch else contextlib.nullcontext()
    _ACTIVE.append(counter)
    try:
        with glue, np.errstate(all="ignore"):  # a sampled launch computes on skipped programs' garbage
            yield counter.traffic
    finally:
        _ACTIVE.clear()
        for m in kernel_modules:
            if m in shadowed:
                m.range = shadowed[m]
            else:
                del m.range
        for name, f in saved.items():
            setattr(builder_cls, name, f)
        interp.InterpretedFunction.run = saved_run
