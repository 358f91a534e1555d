"""How benchmarks/gpu_traffic.py samples a launch: programs by strata along each grid axis, kernel loops by a lattice
of tile indices, each sampled program or iteration weighted by the ones it stands for."""

from __future__ import annotations

import builtins
import inspect
import operator


def strata(n: int, cap: int) -> list[tuple[int, int]]:
    """``[(program id, weight)]`` along an axis of ``n`` programs: all of them when ``n <= cap``, else the first
    and the last alone and the middle of ``cap - 2`` equal strata of the ones between."""
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
    """``[(value, weight)]`` of a kernel loop over ``r``: all of it when ``len(r) <= cap``, else the first and the
    last iteration alone and the ones between whose index ``value // |step|`` is a multiple of the smallest power
    of two that leaves at most ``cap - 2`` indices from 0 to the loop's far end, equally weighted: one lattice for
    every start, so that programs whose loops start apart (a causal mask) sample the same tiles."""
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
    """The kernel's Python function as GridExecutor calls it once per program: runs the sampled programs only,
    each with its strata's weight."""

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
        self._counter.start_program(w[0] * w[1] * w[2], idx, dims, w)
        self._counter.in_kernel = True
        try:
            return self._fn(**kwargs)
        finally:
            self._counter.in_kernel = False


class SampledRange:
    """``range`` as the kernels' modules see it while counting: inside a kernel, a loop of more than ``loop_cap``
    iterations runs its sample (:func:`sampled_loop`)."""

    def __init__(self, counter):
        self._counter = counter

    def __call__(self, *args):
        r = builtins.range(*(operator.index(a) for a in args))
        if not self._counter.in_kernel or len(r) <= self._counter.loop_cap:
            return r
        return sampled_loop(self._counter, r)
