"""What the benchmark scripts share (``import common``): the environment record, timing, the machine-load meter,
peak memory, the backends and smx's reports, rows, argument parsing, and JSON / table / plot output."""

import argparse
import dataclasses
import importlib
import importlib.metadata
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
import types
from typing import Any, Callable

from smx_app.argtypes import nonneg_int, positive_float, positive_int
from smx_app.demo.memory import PeakMemory

GB, MB = 1e9, 1e6
#: cores' worth of CPU used by other processes above which a timing is called disturbed
NOISY = 0.1
#: the backends the in-process benchmarks time (:func:`compile_for`)
BACKENDS = ("eager", "inductor", "smx", "smx-rewrite")
NO_MATPLOTLIB = "matplotlib is not installed (`pip install -e '.[bench]'`); no plot written"


class SanityError(RuntimeError):
    """An evaluation's check that the measurement is what it claims to be failed (the script exits with status 2)."""


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "?"


def version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def git_state() -> str | None:
    """HEAD of this checkout, and whether smxcompile/ has uncommitted changes."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head, dirty = (subprocess.run(["git", *a], cwd=root, capture_output=True, text=True, timeout=10).stdout.strip()
                       for a in (("rev-parse", "--short", "HEAD"), ("status", "--porcelain", "--", "smxcompile")))
    except (OSError, subprocess.SubprocessError):
        return None
    return (head + (" + uncommitted changes in smxcompile/" if dirty else "")) if head else None


def loadavg() -> list[float] | None:
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except OSError:
        return None


def environment(threads: int | None = None, packages: tuple[str, ...] = (), git: bool = False) -> dict[str, Any]:
    """Python, torch, triton and smxcompile versions, CPU, cores, threads, GPU, the date and the load average
    (plus the versions of ``packages`` and, with ``git``, the checkout's state)."""
    import torch

    env: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                           "triton": version("triton"), "smxcompile": version("smxcompile"), "cpu": cpu_name(),
                           "cores": cores(), "threads": threads or torch.get_num_threads(),
                           "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
                           "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime())}
    env.update({p: version(p) for p in packages})
    if loadavg():
        env["loadavg_at_start"] = loadavg()
    if git:
        env["git"] = git_state()
    return env


def command_line(argv: list[str] | None = None, script: str | None = None) -> str:
    """``python <script> <args>`` of this run (``argv``: the arguments main() was given, else sys.argv's)."""
    script = script or os.path.relpath(sys.argv[0])
    return "python " + " ".join(shlex.quote(a) for a in [script, *(sys.argv[1:] if argv is None else argv)])


def print_header(command: str, env: dict, warning: str = "timings will be noisy") -> None:
    """The command, a warning when the load average says other processes use the CPUs, the environment."""
    print(f"$ {command}", flush=True)
    load = env.get("loadavg_at_start")
    if load and load[0] > 0.5 * env["cores"]:
        print(f"WARNING: load average {load[0]} on {env['cores']} cores: other processes are using the CPUs; "
              f"{warning}", file=sys.stderr)
    print("env: " + ", ".join(f"{k}={v}" for k, v in env.items()), flush=True)


def print_load_at_end(env: dict, note: str = "above the core count means other processes shared the CPUs") -> None:
    env["loadavg_at_end"] = loadavg()
    if env["loadavg_at_end"]:
        print(f"load average at start {env.get('loadavg_at_start')}, at end {env['loadavg_at_end']} "
              f"({env['cores']} cores): {note}")


def devices(choice: str) -> list[str]:
    """``--device auto|cpu|cuda``: auto is the CPU, and CUDA too when present. Exits 2 for cuda without CUDA."""
    import torch

    if choice == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device here", file=sys.stderr)
        raise SystemExit(2)
    return [d for d in ("cpu", "cuda") if choice in ("auto", d) and (d == "cpu" or torch.cuda.is_available())]


def write_json(path: str | None, obj: Any) -> None:
    """Write ``obj`` to ``path`` (no-op without one), atomically: a run cut short keeps the last good file."""
    if not path:
        return
    tmp = f"{path}.tmp"
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, default=str)
    os.replace(tmp, path)


def fmt_num(v: float | None, digits: int = 3) -> str:
    if v is None or v == 0:
        return "-" if v is None else "0"
    for bound, fmt in ((100, ".0f"), (10, ".1f"), (10 ** -digits, f".{digits}f")):
        if abs(v) >= bound:
            return format(v, fmt)
    return f"{v:.2g}"


def markdown_table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    return "\n".join(lines + ["| " + " | ".join(str(c).replace("|", "/") for c in r) + " |" for r in rows])


def print_table(title: str, head: list[str], rows: list[list[str]], markdown: bool,
                left: tuple[str, ...] | None = None) -> None:
    """Markdown or a rich table. Columns are right-justified when their header has "ms" (or when not in ``left``,
    if given)."""
    if markdown:
        print(f"\n**{title}**\n\n" + markdown_table(head, rows))
        return
    from rich.console import Console
    from rich.table import Table

    t = Table(title=title)
    for h in head:
        right = h not in left if left is not None else "ms" in h
        t.add_column(h, justify="right" if right else "left", no_wrap=left is None or h in head[:-1])
    for r in rows:
        t.add_row(*r)
    width = 20 + sum(max(len(h), *(len(x[i]) for x in rows)) + 3 for i, h in enumerate(head)) if rows else 0
    Console(width=max(200, width), soft_wrap=True).print(t)


def save_figure(fig, path, dpi: int = 120, rect=None) -> str:
    """Lay out, write (making the folder) and close ``fig``; -> "wrote PATH"."""
    fig.tight_layout(rect=rect)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
    return f"wrote {path}"


def err_text(e: BaseException) -> str:
    """``Type: the message's first line`` (300 characters at most)."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:300]


def pyplot():
    """matplotlib.pyplot on the Agg backend, or None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def measure_interleaved(stmts: dict[str, tuple[str, dict[str, Any]]], threads: int, rounds: int,
                        min_run_time: float) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """Median, inter-quartile range and fastest block (ms per call) of each ``{name: (statement, globals)}``, by
    blocked_autorange, the statements timed in turn for ``rounds`` rounds, the order alternating."""
    import torch.utils.benchmark as tbench

    times: dict[str, list[float]] = {k: [] for k in stmts}
    timers = {k: tbench.Timer(stmt=s, globals=g, num_threads=threads) for k, (s, g) in stmts.items()}
    for r in range(rounds):
        for k in (list(timers) if r % 2 == 0 else list(reversed(timers))):
            times[k].extend(timers[k].blocked_autorange(min_run_time=min_run_time).times)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    iqr = {k: (lambda q: (q[2] - q[0]) * 1e3)(statistics.quantiles(v, n=4)) if len(v) >= 4 else 0.0
           for k, v in times.items()}
    return med, iqr, {k: min(v) * 1e3 for k, v in times.items()}


def cuda_ms(step: Callable[[], Any], rounds: int, warmup: int = 1) -> float:
    """The median ms of ``rounds`` calls of ``step`` after ``warmup`` untimed ones, timed by CUDA events."""
    import torch

    for _ in range(warmup):
        step()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def cpu_seconds() -> tuple[float | None, float]:
    """Non-idle CPU seconds of the whole machine so far (/proc/stat; None where not readable), and of this process
    with its reaped children."""
    import resource

    usage = [resource.getrusage(who) for who in (resource.RUSAGE_CHILDREN, resource.RUSAGE_SELF)]
    own = sum(ru.ru_utime + ru.ru_stime for ru in usage)
    try:
        with open("/proc/stat") as f:
            vals = [int(t) for t in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None, own
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)  # idle + iowait
    return (sum(vals[:8]) - idle) / os.sysconf("SC_CLK_TCK"), own


class LoadMeter:
    """Cores' worth of CPU other processes used over a region (the machine's busy time minus this process's):
    ``others``, None where /proc/stat is not readable."""

    def __enter__(self):
        self.t0, (self.b0, self.own0), self.others = time.monotonic(), cpu_seconds(), None
        return self

    def __exit__(self, *exc):
        (b1, own1), wall = cpu_seconds(), time.monotonic() - self.t0
        if self.b0 is not None and b1 is not None and wall > 0:
            self.others = max(0.0, (b1 - self.b0) - (own1 - self.own0)) / wall


def add_noise_flags(p: argparse.ArgumentParser) -> None:
    """--retry-noisy."""
    p.add_argument("--retry-noisy", type=nonneg_int, default=0, metavar="K",
                   help=f"time again, up to K more times, what other processes disturbed (> {NOISY} cores); the "
                        "least disturbed try is kept (default 0)")


def peak_mb(call: Callable[[], Any], device: str, repeats: int = 3) -> float:
    """Peak memory (``smx demo``'s PeakMemory) of one call above the memory in use before it, MB, the least of
    ``repeats`` calls."""
    out = []
    for _ in range(repeats):
        with PeakMemory(device) as m:
            r = call()
        del r
        out.append(m.peak_bytes / MB)
    return min(out)


def fresh(fn: Callable, tag: str) -> Callable:
    """A copy of ``fn`` with its own code object, so that each copy's Dynamo entries (recompile limit) are apart."""
    name = f"{fn.__name__}__{tag.replace('-', '_')}"
    code = fn.__code__.replace(co_name=name, **({"co_qualname": name} if sys.version_info >= (3, 11) else {}))
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)


def compile_for(backend: str, fn: Callable) -> Callable:
    """``fn`` under one of :data:`BACKENDS` (each compiled backend on its own copy, ``dynamic=False``)."""
    import torch

    if backend == "eager":
        return fn
    importlib.import_module("smxcompile")  # registers backend="smx"
    kw = {"inductor": {}, "smx": {"backend": "smx"},
          "smx-rewrite": {"backend": "smx", "options": {"cpu": "rewrite", "cuda": "rewrite"}}}
    return torch.compile(fresh(fn, backend), dynamic=False, **kw[backend])


def n_reports() -> int:
    """How many graphs smx has compiled in this process."""
    from smxcompile.backends.smx import compiled_reports

    return len(compiled_reports)


def sites_since(n0: int) -> tuple[list, int]:
    """The smx report sites of the graphs compiled since report ``n0``, and how many graphs."""
    from smxcompile.backends.smx import compiled_reports

    return [s for r in compiled_reports[n0:] for s in r], len(compiled_reports) - n0


def smx_report_summary() -> dict[str, Any]:
    """The smx reports of every graph compiled in this process summed: ``sites`` {kind: {action: count}}."""
    sites, graphs = sites_since(0)
    total: dict[str, dict[str, int]] = {}
    for s in sites:
        total.setdefault(s.kind, {})[s.action] = total.get(s.kind, {}).get(s.action, 0) + 1
    return {"graphs": graphs, "sites": total}


def sites_text(rep: dict) -> str:
    """``kind: n action, ...`` of :func:`smx_report_summary`'s sums."""
    return "; ".join(f"{k}: " + ", ".join(f"{n} {a}" for a, n in sorted(acts.items()))
                     for k, acts in sorted(rep["sites"].items())) or "no site"


@dataclasses.dataclass
class Row:
    """One row of an in-process benchmark: per backend the median, IQR and fastest block (ms), what smx did, the
    error against eager, the backends that disagreed; ``others`` (``tries``): the others' load while timed."""

    device: str
    shape: str
    case: str
    pass_: str
    ms: dict[str, float] = dataclasses.field(default_factory=dict)
    iqr_ms: dict[str, float] = dataclasses.field(default_factory=dict)
    min_ms: dict[str, float] = dataclasses.field(default_factory=dict)
    action: dict[str, str] = dataclasses.field(default_factory=dict)
    max_err: dict[str, float] = dataclasses.field(default_factory=dict)
    mismatch: list[str] = dataclasses.field(default_factory=list)
    others: float | None = None
    tries: list[float | None] = dataclasses.field(default_factory=list)

    def ratio(self, backend: str, ms: dict[str, float] | None = None) -> float | None:
        ms = self.ms if ms is None else ms
        return ms[backend] / ms["inductor"] if backend in ms and ms.get("inductor") else None

    def record(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["pass"] = d.pop("pass_")
        d["ratio_vs_inductor"] = {b: self.ratio(b) for b in self.ms}
        return d


def fmt_ms(row: Row, b: str) -> str:
    """``1.234 (0.85x)``: ms, and the ratio to inductor's (``!`` when the backend disagreed with eager)."""
    if b not in row.ms:
        return "-"
    flag, r, ms = " !" if b in row.mismatch else "", row.ratio(b), row.ms[b]
    txt = f"{ms:.3f}" if ms < 10 else f"{ms:.2f}"
    return txt + flag if b == "inductor" or r is None else f"{txt} ({r:.2f}x){flag}"


def shown(rows: list[Row], stat: str) -> list[Row]:
    """The rows with ``ms`` set to the figure the tables show (--stat median or min)."""
    return [dataclasses.replace(r, ms=dict(r.min_ms)) for r in rows] if stat == "min" else rows


def time_row(row: Row, stmts: dict, args: argparse.Namespace, log: Callable[[str], None]) -> None:
    """Time a row's statements, again up to --retry-noisy times while others shared the CPU; the least disturbed."""
    best = None
    for t in range(args.retry_noisy + 1):
        with LoadMeter() as m:
            res = measure_interleaved(stmts, args.threads, args.rounds, args.min_run_time)
        row.tries.append(m.others)
        if best is None or (m.others or 0) < (best[1] or 0):
            best = (res, m.others)
        if (m.others or 0) <= NOISY or t == args.retry_noisy or row.device != "cpu":
            break
        log(f"    {row.case} {row.shape} {row.pass_}: other processes took {m.others:.2f} cores: timing it again "
            "(--retry-noisy)")
    (row.ms, row.iqr_ms, row.min_ms), row.others = best


def timing_flags(p: argparse.ArgumentParser, rounds: int, min_run_time: float, quick: str) -> None:
    """--quick, --rounds, --min-run-time, --threads, --markdown, --json of the in-process benchmarks."""
    p.add_argument("--quick", action="store_true", help=quick)
    p.add_argument("--rounds", type=positive_int, help=f"interleaved timing rounds per row (default {rounds}, quick 1)")
    p.add_argument("--min-run-time", type=positive_float, help=f"seconds of blocked_autorange per backend per round "
                                                      f"(default {min_run_time}, quick 0.05)")
    p.add_argument("--threads", type=positive_int, default=cores(), help="torch threads (default %(default)s)")
    p.add_argument("--markdown", action="store_true", help="print the tables as Markdown")
    p.add_argument("--json", metavar="PATH", help="write every figure, the environment and the command to PATH as "
                                                  "JSON (rewritten as rows finish)")


def choice_list(choices: tuple[str, ...]) -> Callable[[str], list[str]]:
    """An argparse type: a comma-separated, non-empty subset of ``choices``."""
    def parse(s: str) -> list[str]:
        out = [t for t in s.replace(" ", "").split(",") if t]
        bad = [t for t in out if t not in choices]
        if bad or not out:
            raise argparse.ArgumentTypeError(f"unknown {bad}; choose from {','.join(choices)}")
        return out

    return parse


def int_list(s: str) -> list[int]:
    """An argparse type: a comma-separated, non-empty list of positive integers."""
    out = [positive_int(t) for t in s.replace(" ", "").split(",") if t]
    if not out:
        raise argparse.ArgumentTypeError("expected a comma-separated list of positive integers")
    return out
