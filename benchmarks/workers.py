"""The subprocess benchmarks' machinery (bench_linear_ce.py, bench_attention.py): one fresh worker process per
variant, watched for memory and time, its load on the machine measured, retried while other processes disturbed it."""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import threading
import time
from typing import Any, Callable

from common import GB, NOISY, LoadMeter, StepPeak, busy_cpu_s, print_load_at_end, rss_bytes, wait_quiet, write_json


def meminfo(field: str) -> int | None:
    try:
        with open("/proc/meminfo") as f:
            return next((int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":")), None)
    except OSError:
        return None


def mem_available() -> int | None:
    """Bytes available: /proc/meminfo's MemAvailable, or less under a cgroup v2 memory limit."""
    vals = [meminfo("MemAvailable")]
    try:
        limit = open("/sys/fs/cgroup/memory.max").read().strip()
        if limit != "max":
            vals.append(int(limit) - int(open("/sys/fs/cgroup/memory.current").read()))
    except (OSError, ValueError):
        pass
    vals = [v for v in vals if v is not None]
    return min(vals) if vals else None


def mem_limit(gb: float | None) -> int | None:
    """--mem-limit in bytes; by default the memory available at start minus 2 GB."""
    avail = mem_available()
    return int(gb * GB) if gb else (int(avail - 2 * GB) if avail else None)


def say(msg: str) -> None:
    """A worker's progress line (the parent relays the lines that start with @@)."""
    print("@@ " + msg, flush=True)


def run_worker(spec_path: str, body: Callable[[dict, dict], None], keys: tuple[str, ...]) -> int:
    """A worker's life: read its spec, run ``body(spec, out)``, record a raised error (``status`` "error" and the
    traceback; :class:`Unavailable`: "unavailable"), write ``out`` where the parent reads it."""
    with open(spec_path) as f:
        spec = json.load(f)
    out: dict[str, Any] = {k: spec[k] for k in keys}
    out.update(status="error", notes=[])
    try:
        body(spec, out)
    except Unavailable as e:
        out.update(status="unavailable", error=str(e))
    except Exception as e:  # noqa: BLE001 - reported by the parent
        import traceback

        out.update(status="error", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-3000:])
    with open(spec["out"], "w") as f:
        json.dump(out, f, default=str)
    return 0


class Unavailable(RuntimeError):
    """A variant whose package is missing."""


def launch(spec: dict, workdir: str, limit: int | None, timeout: float, log: Callable[[str], None], script: str,
           label: str) -> dict:
    """Run ``script --_worker SPEC`` in a fresh process and return its result; relay its @@ lines; kill it when its
    RSS passes ``limit``, the machine runs low on memory, or it runs past ``timeout``. ``other_load``: cores of
    CPU other processes used meanwhile; a ``mmap_threshold`` in the spec fixes glibc's (so RSS follows the
    live buffers)."""
    tag = "".join(c if c.isalnum() or c in "._-" else "-" for c in label)
    spec = dict(spec, out=os.path.join(workdir, f"{tag}.out.json"))
    spec_path = os.path.join(workdir, f"{tag}.spec.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if spec.get("mmap_threshold") and "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        env["MALLOC_MMAP_THRESHOLD_"] = str(spec["mmap_threshold"])
    proc = subprocess.Popen([sys.executable, os.path.abspath(script), "--_worker", spec_path],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    tail: collections.deque[str] = collections.deque(maxlen=40)

    def relay():
        for line in proc.stdout:
            line = line.rstrip("\n")
            log(f"  [{label}] {line[3:]}") if line.startswith("@@ ") else tail.append(line)

    reader = threading.Thread(target=relay, daemon=True)
    reader.start()
    max_rss, killed = 0, None
    with LoadMeter() as load:
        while proc.poll() is None:
            rss, avail = rss_bytes("VmRSS", str(proc.pid)) or 0, meminfo("MemAvailable")
            max_rss = max(max_rss, rss)
            if limit is not None and rss > limit:
                killed = f"killed: its RSS reached {rss / GB:.1f} GB, over the limit {limit / GB:.1f} GB (--mem-limit)"
            elif avail is not None and avail < 0.5 * GB:
                killed = f"killed: the machine ran low on memory ({avail / GB:.2f} GB available; RSS {rss / GB:.1f} GB)"
            elif time.monotonic() - load.t0 > timeout:
                killed = f"killed: ran over --variant-timeout {timeout:.0f} s"
            if killed:
                proc.kill()
                break
            time.sleep(0.05)
        proc.wait()
        reader.join(timeout=5)
    ident = {k: spec[k] for k in ("variant", "vocab", "model", "seq", "mode") if k in spec}
    if killed:
        res = dict(ident, status="killed", error=killed)
    elif os.path.exists(spec["out"]):
        with open(spec["out"]) as f:
            res = json.load(f)
    else:
        res = dict(ident, status="error", error=f"worker exited with status {proc.returncode} and no result")
    if res.get("status") in ("error", "killed") and tail:
        res["log_tail"] = "\n".join(tail)
    res.update(sampled_max_rss_bytes=max_rss, wall_s=time.monotonic() - load.t0, other_load=load.others)
    return res


def least_disturbed(run: Callable[[], dict], retries: int, wait_s: float, log: Callable[[str], None], label: str,
                    others: Callable[[dict], float | None] = lambda r: r.get("other_load")) -> dict:
    """``run()`` (a worker), again up to ``retries`` times while other processes used > NOISY cores meanwhile
    (``wait_s``: wait for a quiet machine first, --wait-quiet); the least disturbed finished try is returned."""
    tries: list[dict] = []
    while True:
        if wait_s:
            wait_quiet(wait_s, log)
        res = run()
        if res.get("status") == "error" and res.get("traceback"):
            log(res["traceback"])
        tries.append(res)
        load = others(res) or 0
        if load <= NOISY or res.get("status") not in ("ok", "FAILED") or len(tries) > retries:
            break
        log(f"[{label}] other processes took {load:.2f} cores: running it again (--retry-noisy)")
    best = min(tries, key=lambda r: (r.get("status") not in ("ok", "FAILED"), others(r) or 0))
    if len(tries) > 1:
        best["discarded_tries"] = [{"status": r.get("status"), "others": others(r), "step_s": r.get("step_s"),
                                    "peak_bytes": r.get("peak_bytes")} for r in tries if r is not best]
    return best


def worker_flags(p: argparse.ArgumentParser, timeout: float) -> None:
    """--mem-limit, --mmap-threshold, --variant-timeout and the hidden --_worker of the subprocess benchmarks."""
    p.add_argument("--mem-limit", type=float, metavar="GB",
                   help="largest RSS a variant's process may reach: variants estimated above it are skipped, one "
                        "that passes it is killed (default: memory available at start minus 2 GB)")
    p.add_argument("--mmap-threshold", type=int, default=2**20, metavar="BYTES",
                   help="glibc MALLOC_MMAP_THRESHOLD_ of the workers (default 1 MiB: RSS follows the live buffers "
                        "and peaks repeat; 0 keeps glibc's dynamic threshold; the environment's wins)")
    p.add_argument("--variant-timeout", type=float, default=timeout, help="seconds before a worker is killed "
                                                                          "(default %(default)s)")
    p.add_argument("--_worker", help=argparse.SUPPRESS)


def finish_run(env: dict, result: dict, json_path: str | None, command: str, t_start: float,
               label: Callable[[dict], str]) -> int:
    """A subprocess benchmark's end: the load average, the JSON, the command, the failed rows; the exit status
    (1 when a row FAILED, raised or was killed)."""
    print_load_at_end(env)
    write_json(json_path, result)
    print(f"\n$ {command}   ({time.monotonic() - t_start:.0f} s)" + (f"\nwrote {json_path}" if json_path else ""))
    bad = [r for r in result["results"] if r.get("status") in ("FAILED", "error", "killed")]
    for r in bad:
        print(f"{r['status']}: {label(r)}: {r.get('check', {}).get('why') or r.get('error')}")
    return 1 if bad else 0


def print_sources(results: list[dict], variants: tuple[str, ...], label: Callable[[dict], str]) -> None:
    """Warn when the workers of ``variants`` ran different smxcompile sources (edited mid-run)."""
    ours = [r for r in results if r.get("variant") in variants]
    srcs = {r.get("smxcompile_src") for r in ours if r.get("smxcompile_src")}
    if len(srcs) > 1:
        print("WARNING: smxcompile's source changed during the run (someone edited it): "
              + "; ".join(f"{label(r)} ran source {r.get('smxcompile_src')}" for r in ours))
    elif srcs:
        print(f"smxcompile source hash (sha1 of its .py files): {srcs.pop()}")




def timed_steps(step: Callable[[], Any], rounds: int, out: dict, reset: Callable[[], None],
                fmt: Callable[[float, int], str]) -> Any:
    """A worker's warm-up step (compilation included), then ``rounds`` steps after ``reset()`` each, recording into
    ``out`` the wall and CPU seconds, the peak RSS above the pre-step RSS (:class:`common.StepPeak`) and
    ``other_load_timed`` (cores other processes used during the timed steps); -> the last step's result."""
    t0 = time.perf_counter()
    res = step()
    out["warmup_s"] = time.perf_counter() - t0
    say(f"warm-up {out['warmup_s']:.1f} s")
    for k in ("step_s", "step_cpu_s", "peak_bytes", "base_rss_bytes"):
        out[k] = []
    busy = own = wall = 0.0
    for r in range(rounds):
        res = None
        reset()
        with StepPeak() as m:
            b0, c0, t0 = busy_cpu_s(), time.process_time(), time.perf_counter()
            res = step()
            t1, c1, b1 = time.perf_counter(), time.process_time(), busy_cpu_s()
        for k, v in (("step_s", t1 - t0), ("step_cpu_s", c1 - c0), ("peak_bytes", m.peak), ("base_rss_bytes", m.base)):
            out[k].append(v)
        out["mem_method"] = m.method
        if b0 is not None and b1 is not None:
            busy, own, wall = busy + (b1 - b0), own + (c1 - c0), wall + (t1 - t0)
        say(f"round {r + 1}/{rounds}: {fmt(t1 - t0, m.peak)} above {m.base / GB:.2f} GB RSS")
    if wall > 0:  # the compile workers of the warm-up are other processes: the timed steps only
        out["other_load_timed"] = max(0.0, busy - own) / wall
    return res
