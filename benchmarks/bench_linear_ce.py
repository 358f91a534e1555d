#!/usr/bin/env python
"""Linear + cross-entropy training step, side by side: eager, Inductor, PyTorch's chunked op, Apple's CCE, smx.

What is measured: one training step (forward + backward) of the LM-head loss

    loss = F.cross_entropy(F.linear(x, W), y)        # ignore_index=-100, reduction="mean"

with x (N, D) and W (V, D) both requiring grad, y (N,) int64 with a fraction (--ignore-frac) of
the tokens set to -100, fp32, on CPU. The N x V logits are what makes this step expensive in
memory (8192 x 128256 fp32 logits are 4.2 GB); the variants differ in whether they ever exist.

Variants (--variants):

  eager     plain PyTorch, the function above. Materializes the logits, their log-softmax (kept
            for backward) and, in backward, two N x V gradients: about 3 x N x V x 4 bytes.
  inductor  torch.compile(f) (Inductor, the default backend): fuses the softmax / loss math but
            still materializes the N x V logits. The yardstick of every ratio (/ind).
  native    F.linear_cross_entropy(x, W, y, options=torch.nn.LinearCrossEntropyOptions()):
            PyTorch's own chunked op (row chunks; never the whole N x V).
  cce       Apple's cut-cross-entropy package (pip install --no-deps cut-cross-entropy):
            linear_cross_entropy(x, W, y, impl="torch_compile"), its only CPU path. Its real CCE
            kernels (impl="cce") are Triton GPU kernels and cannot run on CPU; the worker tries
            them on a tiny input and records the error. The torch_compile path is torch.compile
            of the full logits over the non-ignored rows only (it drops the ignored rows first,
            so it does (1 - ignore-frac) of the matmul work).
  smx-op    smxcompile.linear_cross_entropy(x, W, y) called directly: cut cross-entropy by row
            chunks of at most --chunk-bytes of logits (default 32 MiB); on CPU the gradients are
            computed in the forward (3 matmuls in all).
  smx       torch.compile(f, backend="smx"): whatever the smx backend does with the pattern. The
            "smx report" column sums the smx reports of every graph compiled in that process
            ({kind: {action: count}}), so it shows whether a rewrite fired; with no rewrite the
            smx backend hands the graph to Inductor and this column should read like inductor.

Metrics, per variant (each variant runs in its own fresh subprocess, one after the other):

  step s        wall time of one step (forward + backward, x.grad and W.grad set to None before),
                median of --rounds steps, after one warm-up step (which includes compilation).
  cpu s         CPU seconds the process used during that step (all threads; median): with T threads
                a step that keeps them busy reads about T x step s.
  warm-up s     that first step: compile + first run.
  peak GB       peak resident memory of the process during one step ABOVE its resident memory
                just before the step (inputs, compiled code and libraries already resident, no
                gradients yet). Includes the gradients x.grad and W.grad the step must produce.
                Linux: /proc/self/status VmHWM after a reset with /proc/self/clear_refs, freed
                heap returned to the OS first with glibc's malloc_trim, glibc's mmap threshold
                fixed at --mmap-threshold (1 MiB) so that RSS follows the live buffers. Max over
                the rounds.
  transient GB  peak GB minus the gradient bytes (N*D + V*D) * 4: the working memory the loss
                needs beyond its unavoidable outputs.
  check         loss and gradients against eager's (same inputs, same seed): |dloss| / |loss|
                <= --loss-rtol and max|dgrad| / max|grad_eager| <= --grad-rtol for x.grad and
                W.grad, both finite and non-zero; otherwise FAILED. The exit status is 1 when a
                variant FAILED, raised an error or was killed (not when skipped or unavailable).

  others        cores' worth of CPU that OTHER processes used while the variant ran (machine-wide
                busy time from /proc/stat minus this benchmark's own). Above ~0.1 the variant shared
                the CPUs and its step time is inflated; rerun it on a quiet machine.

GB = 10^9 bytes. (/ind) = ratio to inductor in the same run (< 1: faster / smaller).

Memory safety: before each variant its footprint is estimated and the variant is skipped with a
message when it would not fit in the memory available (minus a reserve); while it runs, the parent
kills it if its resident memory passes that limit (--mem-limit). --skip-oom-risk skips outright the
variants that materialize the whole N x V logits (eager, inductor, cce) when those are over 1 GB.

Usage:
  python benchmarks/bench_linear_ce.py --quick                    # smoke run, < 1 min
  python benchmarks/bench_linear_ce.py --vocab 32000              # N=8192, D=1024, every variant
  python benchmarks/bench_linear_ce.py --vocab 32000,128256 --json out.json --plot out.png --markdown
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import gc
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from smx_app.demo import rss_bytes  # /proc/self/status fields, in bytes

VARIANTS = ("eager", "inductor", "native", "cce", "smx-op", "smx")
#: variants whose step holds the whole N x V logits (at least once)
FULL_LOGITS = ("eager", "inductor", "cce")
IGNORE_INDEX = -100
GB = 1e9
QUICK = {"tokens": 1024, "dim": 256, "vocab": [8192], "rounds": 1}
DEFAULTS = {"tokens": 8192, "dim": 1024, "vocab": [32000, 128256], "rounds": 2}


# =========================================================================== worker (one variant, own process)


def _malloc_trim() -> bool:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        return True
    except (OSError, AttributeError):
        return False  # not glibc


class StepPeak:
    """Peak RSS of a region above the RSS at entry (Linux: VmHWM reset by clear_refs; else sampled VmRSS)."""

    def __init__(self):
        self.base = 0
        self.peak = 0
        self.method = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._sampled = 0

    def __enter__(self):
        gc.collect()
        trimmed = _malloc_trim()
        self.base = rss_bytes("VmRSS") or 0
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset VmHWM (peak RSS) to the current RSS
            self.method = "VmHWM after clear_refs" + (" + malloc_trim" if trimmed else "")
        except OSError:
            self.method = "VmRSS sampled every 1 ms"
            self._sampled = self.base
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.001):
            self._sampled = max(self._sampled, rss_bytes("VmRSS") or 0)

    def __exit__(self, *exc):
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self.peak = max(0, self._sampled - self.base)
        else:
            self.peak = max(0, (rss_bytes("VmHWM") or 0) - self.base)


def smxcompile_source_hash() -> str | None:
    """Short hash of smxcompile's .py sources as this process finds them (code edited mid-run shows up)."""
    import hashlib
    import importlib.util

    spec = importlib.util.find_spec("smxcompile")
    if spec is None or not spec.origin:
        return None
    root = os.path.dirname(spec.origin)
    h = hashlib.sha1()
    for dirpath, dirnames, files in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                h.update(os.path.relpath(path, root).encode())
                with open(path, "rb") as f:
                    h.update(f.read())
    return h.hexdigest()[:10]


def say(msg: str) -> None:
    """A progress line for the parent (which relays lines starting with @@)."""
    print("@@ " + msg, flush=True)


def make_inputs(n: int, d: int, v: int, seed: int, ignore_frac: float):
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    w = torch.randn(v, d, generator=g) * d ** -0.5  # logits ~ N(0, 1)
    y = torch.randint(0, v, (n,), generator=g)
    drop = torch.rand(n, generator=g) < ignore_frac
    drop[0] = False  # at least one valid token
    y[drop] = IGNORE_INDEX
    return x.requires_grad_(True), w.requires_grad_(True), y


def loss_fn(x, w, y):
    import torch.nn.functional as F

    return F.cross_entropy(F.linear(x, w), y, ignore_index=IGNORE_INDEX)


def build_variant(name: str, spec: dict, notes: list[str]):
    """-> callable(x, W, y) -> scalar loss, for variant ``name``."""
    import torch
    import torch.nn.functional as F

    if name == "eager":
        return loss_fn
    if name == "inductor":
        return torch.compile(loss_fn)
    if name == "native":
        opts = torch.nn.LinearCrossEntropyOptions()
        return lambda x, w, y: F.linear_cross_entropy(x, w, y, ignore_index=IGNORE_INDEX, options=opts)
    if name == "cce":
        try:
            import cut_cross_entropy
            from cut_cross_entropy import linear_cross_entropy as cce_lce
        except Exception as e:  # ImportError, or triton failing to import
            raise Unavailable(f"cut_cross_entropy not importable ({type(e).__name__}: {e}); install it with "
                              "`pip install --no-deps cut-cross-entropy` (--no-deps keeps your torch)") from e
        notes.append(f"cut-cross-entropy {cut_cross_entropy.__version__}, impl='torch_compile' (its CPU path)")
        # Its real CCE path is Triton (GPU): record why it cannot run here.
        try:
            e = torch.randn(8, 16, requires_grad=True)
            c = torch.randn(32, 16, requires_grad=True)
            cce_lce(e, c, torch.randint(0, 32, (8,)), impl="cce").backward()
            notes.append("impl='cce' (Triton) ran on CPU?!")
        except Exception as ex:  # noqa: BLE001
            notes.append(f"impl='cce' (Triton kernels) cannot run on CPU: {type(ex).__name__}: {str(ex)[:120]}")
        return lambda x, w, y: cce_lce(x, w, y, ignore_index=IGNORE_INDEX, impl="torch_compile")
    if name == "smx-op":
        import smxcompile

        cb = spec.get("chunk_bytes")
        return lambda x, w, y: smxcompile.linear_cross_entropy(x, w, y, ignore_index=IGNORE_INDEX, chunk_bytes=cb)
    if name == "smx":
        import smxcompile  # noqa: F401  (registers backend="smx")

        return torch.compile(loss_fn, backend="smx")
    raise ValueError(name)


class Unavailable(RuntimeError):
    pass


def smx_report_summary() -> dict[str, Any]:
    """Sum of the smx reports of every graph compiled in this process, and the last one's summary."""
    import smxcompile
    from smxcompile.backends.smx import compiled_reports

    total: dict[str, dict[str, int]] = {}
    for r in compiled_reports:
        for kind, acts in r.summary().items():
            for act, k in acts.items():
                total.setdefault(kind, {}).setdefault(act, 0)
                total[kind][act] += k
    last = smxcompile.last_report()
    return {"graphs": len(compiled_reports), "sites": total,
            "last_report": last.summary() if last is not None else None,
            "last_report_text": str(last) if last is not None else None}


def reference_chunked(x, w, y, rows: int):
    """Eager's math by row chunks (used when the eager variant itself did not run): loss, dx, dW."""
    import torch
    import torch.nn.functional as F

    n_valid = (y != IGNORE_INDEX).sum()
    dx = torch.zeros_like(x)
    w.grad = None
    total = torch.zeros((), dtype=x.dtype)
    for r0 in range(0, x.shape[0], rows):
        xc = x[r0:r0 + rows].detach().requires_grad_(True)
        lc = F.cross_entropy(F.linear(xc, w), y[r0:r0 + rows], ignore_index=IGNORE_INDEX, reduction="sum") / n_valid
        lc.backward()
        dx[r0:r0 + rows] = xc.grad
        total += lc.detach()
    dw = w.grad
    w.grad = None
    return total, dx, dw


def run_worker(spec_path: str) -> int:
    with open(spec_path) as f:
        spec = json.load(f)
    out: dict[str, Any] = {"variant": spec["variant"], "vocab": spec["vocab"], "status": "error", "notes": []}

    def write():
        with open(spec["out"], "w") as f:
            json.dump(out, f, default=str)

    try:
        import torch

        torch.set_num_threads(spec["threads"])
        n, d, v = spec["tokens"], spec["dim"], spec["vocab"]
        x, w, y = make_inputs(n, d, v, spec["seed"], spec["ignore_frac"])
        out["inputs_bytes"] = (n * d + v * d) * 4 + n * 8
        out["grads_bytes"] = (n * d + v * d) * 4
        out["valid_tokens"] = int((y != IGNORE_INDEX).sum())
        out["malloc_mmap_threshold"] = os.environ.get("MALLOC_MMAP_THRESHOLD_")
        out["smxcompile_src"] = smxcompile_source_hash()

        if spec["variant"] == "reference":
            rows = max(1, int(256e6 // (v * 4)))
            say(f"reference (eager by chunks of {rows} rows) ...")
            loss, dx, dw = reference_chunked(x, w, y, rows)
            torch.save({"loss": loss, "dx": dx, "dw": dw, "by": "eager by row chunks"}, spec["ref"])
            out.update(status="ok", loss=float(loss))
            write()
            return 0

        fn = build_variant(spec["variant"], spec, out["notes"])
        for note in out["notes"]:
            say(note)

        def step():
            loss = fn(x, w, y)
            loss.backward()
            return loss.detach()

        say("warm-up step (includes compilation) ...")
        t0 = time.perf_counter()
        step()
        out["warmup_s"] = time.perf_counter() - t0
        say(f"warm-up {out['warmup_s']:.1f} s")
        out["step_s"], out["peak_bytes"], out["base_rss_bytes"] = [], [], []
        loss = None
        for r in range(spec["rounds"]):
            x.grad = None
            w.grad = None
            loss = None
            with StepPeak() as m:
                c0 = time.process_time()
                t0 = time.perf_counter()
                loss = step()
                dt = time.perf_counter() - t0
                cpu = time.process_time() - c0
            out["step_s"].append(dt)
            out.setdefault("step_cpu_s", []).append(cpu)
            out["peak_bytes"].append(m.peak)
            out["base_rss_bytes"].append(m.base)
            out["mem_method"] = m.method
            say(f"round {r + 1}/{spec['rounds']}: {dt:.3f} s, peak {m.peak / GB:.3f} GB above {m.base / GB:.2f} GB RSS")
        out["max_rss_bytes"] = rss_bytes("VmRSS")
        if spec["variant"] == "smx":
            rep = smx_report_summary()
            out["smx_report"] = rep
            say(f"smx report over {rep['graphs']} graph(s): {rep['sites'] or 'no site'}; "
                f"last_report(): {rep['last_report']}")

        # ---- correctness against eager
        out["loss"] = float(loss)
        gx, gw = x.grad, w.grad
        chk: dict[str, Any] = {}
        ok = gx is not None and gw is not None
        if ok:
            chk["dx_max"] = float(gx.abs().max())
            chk["dw_max"] = float(gw.abs().max())
            ok = bool(torch.isfinite(gx).all() and torch.isfinite(gw).all() and chk["dx_max"] > 0
                      and chk["dw_max"] > 0 and torch.isfinite(loss))
            if not ok:
                chk["why"] = "gradient not finite or all zero"
        else:
            chk["why"] = "no gradient for " + " and ".join(k for k, g in (("x", gx), ("W", gw)) if g is None)
        if spec["variant"] == "eager" and spec.get("save_ref"):
            torch.save({"loss": loss, "dx": gx, "dw": gw, "by": "eager"}, spec["ref"])
            chk.update(loss_rel=0.0, dx_rel=0.0, dw_rel=0.0, dx_abs=0.0, dw_abs=0.0, against="itself (reference)")
        elif ok and os.path.exists(spec["ref"]):
            ref = torch.load(spec["ref"], mmap=True, weights_only=True)
            rl = float(ref["loss"])
            chk["against"] = ref.get("by", "eager")
            chk["loss_abs"] = abs(float(loss) - rl)
            chk["loss_rel"] = chk["loss_abs"] / max(abs(rl), 1e-30)
            for k, g in (("dx", gx), ("dw", gw)):
                ab = float((g - ref[k]).abs().max())
                chk[f"{k}_abs"] = ab
                chk[f"{k}_rel"] = ab / max(float(ref[k].abs().max()), 1e-30)
            ok = (chk["loss_rel"] <= spec["loss_rtol"] and chk["dx_rel"] <= spec["grad_rtol"]
                  and chk["dw_rel"] <= spec["grad_rtol"])
            if not ok:
                chk["why"] = (f"outside tolerance (loss rel {chk['loss_rel']:.1e} vs {spec['loss_rtol']:.0e}, "
                              f"grad rel {max(chk['dx_rel'], chk['dw_rel']):.1e} vs {spec['grad_rtol']:.0e})")
        elif ok:
            ok = False
            chk["why"] = "no reference to compare with"
        out["check"] = chk
        out["status"] = "ok" if ok else "FAILED"
        if "loss_rel" in chk:
            say(f"check vs {chk.get('against')}: loss rel {chk['loss_rel']:.1e}, dx rel {chk['dx_rel']:.1e}, "
                f"dW rel {chk['dw_rel']:.1e} -> {out['status']}")
        else:
            say(f"check: {out['status']} ({chk.get('why', '')})")
    except Unavailable as e:
        out["status"] = "unavailable"
        out["error"] = str(e)
    except Exception as e:  # noqa: BLE001
        import traceback

        out["status"] = "error"
        out["error"] = f"{type(e).__name__}: {e}"
        out["traceback"] = traceback.format_exc()[-3000:]
    write()
    return 0


# =========================================================================== parent


def _meminfo(field: str) -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _cgroup_free() -> int | None:
    """Bytes left under a cgroup v2 memory limit, if there is one."""
    try:
        lim = open("/sys/fs/cgroup/memory.max").read().strip()
        if lim == "max":
            return None
        return int(lim) - int(open("/sys/fs/cgroup/memory.current").read())
    except (OSError, ValueError):
        return None


def mem_available() -> int | None:
    vals = [v for v in (_meminfo("MemAvailable"), _cgroup_free()) if v is not None]
    return min(vals) if vals else None


def _pid_rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def estimate_bytes(variant: str, n: int, d: int, v: int, chunk_bytes: int | None) -> int:
    """Rough peak RSS of a worker process (overhead + inputs + the step), to skip what cannot fit.

    Step figures (above inputs) calibrated on this benchmark at V=32000 and 128256; generous."""
    logits = n * v * 4
    grads = (n * d + v * d) * 4
    inputs = grads + n * 8
    overhead = int(1.5 * GB)  # python, torch, compiled code
    step = {
        "eager": 3.2 * logits,      # measured 2.85 x logits (+ grads) at V=32000 and V=128256
        "inductor": 1.5 * logits,   # measured 1.0 x logits; room for a different fusion
        "cce": 1.5 * logits,        # measured 0.9 x logits
        "smx": 1.5 * logits,        # Inductor's footprint when the rewrite does not fire
        "native": min(logits, 0.4 * GB + 0.1 * logits),
        "smx-op": 3 * (chunk_bytes or 32 * 2**20) + 0.1 * GB,
        "reference": 3 * 256e6,
    }[variant]
    return int(overhead + inputs + grads + step + grads)  # + the reference gradients loaded for the check


def launch(spec: dict, workdir: str, limit: int | None, timeout: float, log, *, script: str | None = None,
           label: str | None = None) -> dict:
    """Run one worker subprocess; relay its @@ lines; kill it if its RSS passes ``limit``.

    ``script`` is the file run as ``script --_worker SPEC`` (default: this one); ``label`` names the
    worker in relayed lines and in its file names (default ``V=<vocab> <variant>``); other benchmarks
    reuse this with their own worker."""
    spec = dict(spec)
    tag = f"{spec['variant']}-{spec['vocab']}" if label is None else "".join(
        c if c.isalnum() or c in "._-" else "-" for c in label)
    label = f"V={spec['vocab']} {spec['variant']}" if label is None else label
    spec["out"] = os.path.join(workdir, f"{tag}.out.json")
    spec_path = os.path.join(workdir, f"{tag}.spec.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if spec.get("mmap_threshold") and "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        # a fixed threshold: every allocation from that size up is its own mmap, returned to the OS on free
        env["MALLOC_MMAP_THRESHOLD_"] = str(spec["mmap_threshold"])
    proc = subprocess.Popen([sys.executable, os.path.abspath(script or __file__), "--_worker", spec_path],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    tail: collections.deque[str] = collections.deque(maxlen=40)

    def reader():
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip("\n")
            if line.startswith("@@ "):
                log(f"  [{label}] {line[3:]}")
            else:
                tail.append(line)

    th = threading.Thread(target=reader, daemon=True)
    th.start()
    t0 = time.monotonic()
    busy0, ru0 = _busy_cpu_s(), _children_cpu_s()
    max_rss = 0
    killed = None
    while proc.poll() is None:
        rss = _pid_rss(proc.pid)
        max_rss = max(max_rss, rss)
        avail = _meminfo("MemAvailable")
        if limit is not None and rss > limit:
            killed = f"killed: its RSS reached {rss / GB:.1f} GB, over the limit {limit / GB:.1f} GB (--mem-limit)"
        elif avail is not None and avail < 0.5 * GB:
            killed = f"killed: the machine ran low on memory ({avail / GB:.2f} GB available; RSS {rss / GB:.1f} GB)"
        elif time.monotonic() - t0 > timeout:
            killed = f"killed: ran over --variant-timeout {timeout:.0f} s"
        if killed:
            proc.kill()
            break
        time.sleep(0.05)
    proc.wait()
    th.join(timeout=5)
    wall = time.monotonic() - t0
    busy1, ru1 = _busy_cpu_s(), _children_cpu_s()
    others = None
    if busy0 is not None and busy1 is not None and wall > 0:
        others = max(0.0, (busy1 - busy0) - (ru1 - ru0)) / wall
    res: dict[str, Any]
    if killed:
        res = {"variant": spec["variant"], "vocab": spec["vocab"], "status": "killed", "error": killed}
    elif os.path.exists(spec["out"]):
        with open(spec["out"]) as f:
            res = json.load(f)
    else:
        res = {"variant": spec["variant"], "vocab": spec["vocab"], "status": "error",
               "error": f"worker exited with status {proc.returncode} and no result"}
    if res.get("status") in ("error", "killed") and tail:
        res["log_tail"] = "\n".join(tail)
    res["sampled_max_rss_bytes"] = max_rss
    res["wall_s"] = wall
    res["other_load"] = others  # cores' worth of CPU used by other processes while this variant ran
    return res


def _busy_cpu_s() -> float | None:
    """Non-idle CPU seconds of the whole machine so far (/proc/stat)."""
    try:
        with open("/proc/stat") as f:
            vals = [int(t) for t in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)  # idle + iowait
    busy = sum(vals[:8]) - idle  # user nice system idle iowait irq softirq steal (guest is inside user)
    return busy / os.sysconf("SC_CLK_TCK")


def _children_cpu_s() -> float:
    """CPU seconds of this process and of its finished children (the worker, once reaped)."""
    import resource

    total = 0.0
    for who in (resource.RUSAGE_CHILDREN, resource.RUSAGE_SELF):
        ru = resource.getrusage(who)
        total += ru.ru_utime + ru.ru_stime
    return total


NOISY = 0.1  # cores of other processes' CPU above which a variant's time is called inflated


def wait_quiet(max_s: float, log) -> float | None:
    """Wait until other processes use < NOISY cores over a 3 s window, at most ``max_s``; -> their load."""
    t0 = time.monotonic()
    last_msg = t0
    while True:
        b0, own0 = _busy_cpu_s(), _children_cpu_s()
        time.sleep(3)
        b1, own1 = _busy_cpu_s(), _children_cpu_s()
        if b0 is None or b1 is None:
            return None
        others = max(0.0, (b1 - b0) - (own1 - own0)) / 3
        now = time.monotonic()
        if others < NOISY or now - t0 >= max_s:
            if now - t0 > 4:
                log(f"waited {now - t0:.0f} s for a quiet machine; other processes now use {others:.2f} cores")
            return others
        if now - last_msg > 60:
            log(f"waiting for a quiet machine: other processes use {others:.2f} cores "
                f"({now - t0:.0f} s of --wait-quiet {max_s:.0f})")
            last_msg = now


def run_variant(spec: dict, name: str, v: int, est: int, workdir: str, limit: int | None, args, log) -> dict:
    """Launch a variant (again, up to --retry-noisy times, while other processes shared the CPUs)."""
    tries: list[dict] = []
    while True:
        if args.wait_quiet:
            wait_quiet(args.wait_quiet, log)
        log(f"[V={v}] {name}: fresh process (estimated peak RSS {est / GB:.1f} GB)"
            + (f", try {len(tries) + 1}" if tries else ""))
        res = launch(spec, workdir, limit, args.variant_timeout, log)
        s = summarize(res)
        others = res.get("other_load")
        log(f"[V={v}] {name}: {res.get('status')}"
            + (f", step {s['step_s']:.3f} s, peak {s['peak_gb']:.3f} GB, transient "
               f"{s['transient_gb']:.3f} GB" if s else f" ({res.get('error', '')})")
            + (f"; other processes used {others:.2f} cores meanwhile" if others is not None else ""))
        if res.get("status") == "error" and res.get("traceback"):
            log(res["traceback"])
        tries.append(res)
        noisy = (others or 0) > NOISY
        if not noisy or res.get("status") not in ("ok", "FAILED") or len(tries) > args.retry_noisy:
            break
        log(f"[V={v}] {name}: other processes took {others:.2f} cores: running it again (--retry-noisy)")
    best = min(tries, key=lambda r: (r.get("status") not in ("ok", "FAILED"), r.get("other_load") or 0))
    if len(tries) > 1:
        best["discarded_tries"] = [{k: r.get(k) for k in ("status", "other_load", "step_s", "peak_bytes")}
                                   for r in tries if r is not best]
    if (best.get("other_load") or 0) > NOISY:
        log(f"WARNING: V={v} {name} shared the CPUs with other processes ({best['other_load']:.2f} cores): "
            "its time is inflated")
    return best


# --------------------------------------------------------------------------- output


def _fmt_num(v: float | None, digits: int = 3) -> str:
    if v is None:
        return "-"
    if v == 0:
        return "0"
    if abs(v) >= 100:
        return f"{v:.0f}"
    if abs(v) >= 10:
        return f"{v:.1f}"
    return f"{v:.{digits}f}" if abs(v) >= 10 ** -digits else f"{v:.2g}"


def summarize(res: dict) -> dict:
    """Derived figures of one result: median step, peak, transient."""
    s: dict[str, Any] = {}
    if res.get("step_s"):
        s["step_s"] = statistics.median(res["step_s"])
    if res.get("step_cpu_s"):
        s["cpu_s"] = statistics.median(res["step_cpu_s"])
    if res.get("peak_bytes"):
        s["peak_gb"] = max(res["peak_bytes"]) / GB
        s["transient_gb"] = (max(res["peak_bytes"]) - res["grads_bytes"]) / GB
    return s


def table(results: list[dict], vocabs: list[int]) -> tuple[list[str], list[list[str]]]:
    head = ["V", "variant", "step s (/ind)", "cpu s", "warm-up s", "peak GB (/ind)", "transient GB (/ind)",
            "loss", "rel dloss", "rel dx", "rel dW", "check", "others", "smx report / note"]
    rows = []
    for v in vocabs:
        rs = [r for r in results if r["vocab"] == v and r["variant"] != "reference"]
        ind = next((summarize(r) for r in rs if r["variant"] == "inductor" and r.get("status") == "ok"), {})
        for r in rs:
            s = summarize(r)
            st = r.get("status", "?")

            def rat(key: str) -> str:
                if key not in s:
                    return "-"
                txt = _fmt_num(s[key])
                if r["variant"] != "inductor" and ind.get(key):
                    txt += f" ({s[key] / ind[key]:.2f}x)"
                return txt

            chk = r.get("check", {})
            note = ""
            if r["variant"] == "smx" and r.get("smx_report") is not None:
                sites = r["smx_report"]["sites"]
                note = "; ".join(f"{k}: " + ", ".join(f"{n} {a}" for a, n in sorted(acts.items()))
                                 for k, acts in sorted(sites.items())) or "no site"
                note += f" ({r['smx_report']['graphs']} graph(s))"
            elif r["variant"] == "cce" and st == "ok":
                note = "impl=torch_compile (Triton impl: no CPU)"
            if st not in ("ok", "FAILED"):
                note = (r.get("error") or "")[:110]
            elif st == "FAILED":
                note = (note + " " + chk.get("why", "")).strip()
            others = r.get("other_load")
            rows.append([str(v), r["variant"], rat("step_s"), _fmt_num(s.get("cpu_s")), _fmt_num(r.get("warmup_s"), 1),
                         rat("peak_gb"), rat("transient_gb"), f"{r['loss']:.6f}" if "loss" in r else "-",
                         f"{chk['loss_rel']:.1e}" if "loss_rel" in chk else "-",
                         f"{chk['dx_rel']:.1e}" if "dx_rel" in chk else "-",
                         f"{chk['dw_rel']:.1e}" if "dw_rel" in chk else "-", st,
                         f"{others:.2f}" if others is not None else "-", note])
    return head, rows


def print_table(title: str, head: list[str], rows: list[list[str]], markdown: bool) -> None:
    if markdown:
        print(f"\n**{title}**\n")
        print("| " + " | ".join(head) + " |")
        print("|" + "|".join("---" for _ in head) + "|")
        for r in rows:
            print("| " + " | ".join(c.replace("|", "/") for c in r) + " |")
        return
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
        print(f"\n{title}")
        print("  ".join(h.ljust(w) for h, w in zip(head, widths)))
        for r in rows:
            print("  ".join(c.ljust(w) for c, w in zip(r, widths)))
        return
    t = Table(title=title)
    for h in head:
        t.add_column(h, justify="left" if h in ("variant", "check", "smx report / note") else "right",
                     no_wrap=h != "smx report / note")
    for r in rows:
        t.add_row(*r)
    Console(width=220, soft_wrap=True).print(t)


def plot(results: list[dict], vocabs: list[int], variants: list[str], path: str, title: str) -> str | None:
    """Bar chart: step time and memory (gradients + transient) per variant, one group per V."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return ("--plot: matplotlib is not installed; `pip install -e '.[bench]'` (or `pip install matplotlib`) "
                "and run again; no plot written")
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    width = 0.8 / max(1, len(variants))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for vi, v in enumerate(vocabs):
        for ki, name in enumerate(variants):
            r = next((r for r in results if r["vocab"] == v and r["variant"] == name), None)
            xpos = vi + (ki - (len(variants) - 1) / 2) * width
            s = summarize(r) if r else {}
            label = name if vi == 0 else None
            c = colors[ki % len(colors)]
            if "step_s" in s:
                axes[0].bar(xpos, s["step_s"], width, color=c, label=label,
                            hatch="xx" if r.get("status") == "FAILED" else None)
                axes[0].text(xpos, s["step_s"], f"{s['step_s']:.3g}", ha="center", va="bottom", fontsize=7)
            if "peak_gb" in s:
                g = r["grads_bytes"] / GB
                axes[1].bar(xpos, g, width, color=c, alpha=0.35)
                axes[1].bar(xpos, s["transient_gb"], width, bottom=g, color=c,
                            hatch="xx" if r.get("status") == "FAILED" else None)
                axes[1].text(xpos, s["peak_gb"], f"{s['peak_gb']:.3g}", ha="center", va="bottom", fontsize=7)
            if not s:
                why = (r or {}).get("status", "not run")
                for ax in axes:
                    ax.text(xpos, 0, why, rotation=90, ha="center", va="bottom", fontsize=7)
    for ax, yl in zip(axes, ("seconds per step (fwd + bwd), median", "GB above inputs (pale: x.grad + W.grad)")):
        ax.set_xticks(range(len(vocabs)), [f"V={v}" for v in vocabs])
        ax.set_ylabel(yl)
        ax.grid(axis="y", alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8, frameon=False)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=120)
    return None


def environment(threads: int) -> dict[str, Any]:
    from importlib.metadata import PackageNotFoundError, version

    def ver(p: str) -> str | None:
        try:
            return version(p)
        except PackageNotFoundError:
            return None

    env: dict[str, Any] = {"python": platform.python_version(), "torch": ver("torch"), "smxcompile": ver("smxcompile"),
                           "cut-cross-entropy": ver("cut-cross-entropy"), "cpu": _cpu_name(), "cores": _cores(),
                           "threads": threads, "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
                           "mem_total_gb": round((_meminfo("MemTotal") or 0) / GB, 1),
                           "mem_available_gb": round((mem_available() or 0) / GB, 1)}
    try:
        env["loadavg_at_start"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        pass
    env["git"] = _git_state()
    return env


def _git_state() -> str | None:
    """HEAD of the checkout the script is in, and whether smxcompile/ has uncommitted changes."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "smxcompile"], cwd=root, capture_output=True,
                               text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (head + (" + uncommitted changes in smxcompile/" if dirty else "")) if head else None


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def _write_json(path: str | None, obj: dict) -> None:
    if not path:
        return
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, default=str)
    os.replace(tmp, path)


def _int_list(s: str) -> list[int]:
    return [int(t) for t in s.replace(" ", "").split(",") if t]


def _variant_list(s: str) -> list[str]:
    out = [t for t in s.replace(" ", "").split(",") if t]
    bad = [t for t in out if t not in VARIANTS]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown variant(s) {bad}; choose from {','.join(VARIANTS)}")
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=_int_list, help="comma-separated vocabulary sizes V (default 32000,128256)")
    p.add_argument("--tokens", type=int, help="N, tokens per step (default 8192)")
    p.add_argument("--dim", type=int, help="D, hidden size (default 1024)")
    p.add_argument("--variants", type=_variant_list, default=list(VARIANTS),
                   help=f"comma-separated subset of {','.join(VARIANTS)} (default: all; eager always runs first)")
    p.add_argument("--rounds", type=int, help="timed steps per variant after the warm-up; median reported (default 2)")
    p.add_argument("--quick", action="store_true",
                   help=f"smoke run: N={QUICK['tokens']}, D={QUICK['dim']}, V={QUICK['vocab'][0]}, 1 round (< 1 min)")
    p.add_argument("--ignore-frac", type=float, default=0.1,
                   help="fraction of tokens with target -100 (ignore_index) (default %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=_cores(), help="torch threads (default: all cores, %(default)s here)")
    p.add_argument("--chunk-bytes", type=int, help="smx-op's chunk_bytes (default: the op's, 32 MiB)")
    p.add_argument("--loss-rtol", type=float, default=1e-4, help="max |loss - eager| / |eager| (default %(default)s)")
    p.add_argument("--grad-rtol", type=float, default=1e-4,
                   help="max |grad - eager| / max |eager grad|, for x.grad and W.grad (default %(default)s)")
    p.add_argument("--mem-limit", type=float, metavar="GB",
                   help="largest RSS a variant's process may reach: variants estimated above it are skipped, and "
                        "one that passes it is killed (default: memory available at start minus 2 GB)")
    p.add_argument("--skip-oom-risk", action="store_true",
                   help=f"skip the variants that materialize the whole N x V logits ({', '.join(FULL_LOGITS)}) "
                        "whenever those logits exceed 1 GB (the correctness reference is then eager computed by "
                        "row chunks)")
    p.add_argument("--mmap-threshold", type=int, default=2**20, metavar="BYTES",
                   help="glibc MALLOC_MMAP_THRESHOLD_ for the variants' processes (default 1 MiB): allocations "
                        "from that size up get their own mapping, returned to the OS on free, so RSS follows live "
                        "buffers and peaks repeat to the MB; 0 keeps glibc's dynamic threshold (up to 32 MiB, "
                        "freed chunks kept in the heap: peaks of chunked variants then vary by 0.1-0.3 GB). A "
                        "MALLOC_MMAP_THRESHOLD_ already in the environment wins")
    p.add_argument("--variant-timeout", type=float, default=3600, help="seconds before a variant is killed")
    p.add_argument("--wait-quiet", type=float, default=0, metavar="S",
                   help="before each variant, wait up to S seconds until other processes use under 0.1 cores "
                        "(a shared machine); default 0: do not wait")
    p.add_argument("--retry-noisy", type=int, default=0, metavar="K",
                   help="run a variant again, up to K times, when other processes used more than 0.1 cores while "
                        "it ran; the least disturbed run is kept (default 0)")
    p.add_argument("--json", metavar="PATH", help="write every figure, the environment and the command to PATH")
    p.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    p.add_argument("--plot", metavar="PATH", help="write a bar chart (PNG/SVG/PDF by extension; needs matplotlib)")
    p.add_argument("--_worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    base = QUICK if args.quick else DEFAULTS
    for k in ("tokens", "dim", "vocab", "rounds"):
        if getattr(args, k) is None:
            setattr(args, k, base[k])
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args._worker:
        return run_worker(args._worker)

    command = "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0])] + sys.argv[1:])
    env = environment(args.threads)
    print(f"$ {command}", flush=True)
    print("env: " + ", ".join(f"{k}={v}" for k, v in env.items()))
    if env.get("loadavg_at_start") and env["loadavg_at_start"][0] > 0.5 * env["cores"]:
        print(f"WARNING: load average {env['loadavg_at_start'][0]} on {env['cores']} cores: other processes are "
              "using the CPUs (or were, in the last minute); the `others` column says, per variant, whether they "
              "shared the CPUs with it", file=sys.stderr)
    n, d = args.tokens, args.dim
    variants = ["eager"] + [v for v in args.variants if v != "eager"] if "eager" in args.variants else args.variants
    avail0 = mem_available()
    limit = int(args.mem_limit * GB) if args.mem_limit else (int(avail0 - 2 * GB) if avail0 else None)
    print(f"step: loss = F.cross_entropy(F.linear(x, W), y), x ({n}, {d}) and W (V, {d}) requiring grad, fp32, "
          f"{args.ignore_frac:.0%} of targets = -100; V in {args.vocab}; variants {variants}; 1 warm-up + "
          f"{args.rounds} timed step(s) each, one fresh process per variant; memory limit "
          f"{(limit or 0) / GB:.1f} GB", flush=True)

    result: dict[str, Any] = {"command": command, "env": env,
                              "settings": {"tokens": n, "dim": d, "vocab": args.vocab, "variants": variants,
                                           "rounds": args.rounds, "ignore_frac": args.ignore_frac, "seed": args.seed,
                                           "loss_rtol": args.loss_rtol, "grad_rtol": args.grad_rtol,
                                           "chunk_bytes": args.chunk_bytes, "mem_limit_bytes": limit,
                                           "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_")
                                           or (args.mmap_threshold or "glibc default (dynamic)")},
                              "results": []}
    results: list[dict] = result["results"]
    workdir = tempfile.mkdtemp(prefix="bench_linear_ce_")
    t_start = time.monotonic()
    bar = None
    if sys.stderr.isatty():  # a progress bar on a terminal; plain timestamped lines in a log
        try:
            from tqdm import tqdm

            bar = tqdm(total=len(args.vocab) * len(variants), unit="variant", dynamic_ncols=True, file=sys.stderr)
        except ImportError:
            pass

    def log(msg: str) -> None:
        line = f"[{time.monotonic() - t_start:7.1f}s] {msg}"
        if bar is not None:
            bar.write(line)
        else:
            print(line, flush=True)

    base_spec = {"tokens": n, "dim": d, "threads": args.threads, "seed": args.seed, "ignore_frac": args.ignore_frac,
                 "rounds": args.rounds, "chunk_bytes": args.chunk_bytes, "loss_rtol": args.loss_rtol,
                 "grad_rtol": args.grad_rtol, "mmap_threshold": args.mmap_threshold}
    try:
        for v in args.vocab:
            ref_path = os.path.join(workdir, f"ref-{v}.pt")
            logits_gb = n * v * 4 / GB
            for name in variants:
                if bar is not None:
                    bar.set_description(f"V={v} {name}")
                if name != "eager" and not os.path.exists(ref_path):
                    # eager was not run (or failed / was skipped): eager's math by row chunks, untimed
                    log(f"[V={v}] reference: eager by row chunks (no eager result to compare with)")
                    ref = launch(dict(base_spec, variant="reference", vocab=v, ref=ref_path), workdir, limit,
                                 args.variant_timeout, log)
                    if ref.get("status") != "ok":
                        log(f"[V={v}] reference failed: {ref.get('error')}")
                    results.append(ref)
                spec = dict(base_spec, variant=name, vocab=v, ref=ref_path, save_ref=(name == "eager"))
                est = estimate_bytes(name, n, d, v, args.chunk_bytes)
                avail = mem_available()
                skip = None
                if args.skip_oom_risk and name in FULL_LOGITS and logits_gb > 1:
                    skip = f"skipped (--skip-oom-risk): materializes the {logits_gb:.1f} GB N x V logits"
                elif limit is not None and est > limit:
                    skip = f"skipped: estimated {est / GB:.1f} GB RSS > limit {limit / GB:.1f} GB"
                elif avail is not None and est > avail - 1 * GB:
                    skip = f"skipped: estimated {est / GB:.1f} GB RSS > {avail / GB:.1f} GB available now - 1 GB"
                if skip:
                    log(f"[V={v}] {name}: {skip}")
                    res = {"variant": name, "vocab": v, "status": "skipped", "error": skip}
                else:
                    res = run_variant(spec, name, v, est, workdir, limit, args, log)
                res["estimated_rss_bytes"] = est
                res.update({f"summary_{k}": val for k, val in summarize(res).items()})
                results.append(res)
                _write_json(args.json, result)
                if bar is not None:
                    bar.update(1)
    finally:
        if bar is not None:
            bar.close()
        shutil.rmtree(workdir, ignore_errors=True)

    # ratios vs inductor, into the JSON
    for v in args.vocab:
        ind = next((summarize(r) for r in results if r["vocab"] == v and r["variant"] == "inductor"
                    and r.get("status") == "ok"), None)
        for r in results:
            if r["vocab"] == v and ind:
                s = summarize(r)
                r["ratio_vs_inductor"] = {k: s[k] / ind[k] for k in s if ind.get(k)}

    head, rows = table(results, args.vocab)
    title = (f"linear + cross-entropy, fwd+bwd, N={n}, D={d}, fp32, CPU ({env['cpu']}, {args.threads} threads); "
             f"median of {args.rounds} step(s); GB = 1e9 B above inputs; (/ind) = ratio to inductor")
    print_table(title, head, rows, args.markdown)
    notes = sorted({f"{r['variant']}: {nt}" for r in results for nt in r.get("notes", [])})
    for nt in notes:
        print(f"note: {nt}")
    for r in results:
        if r["variant"] == "smx" and r.get("smx_report"):
            print(f"smx report V={r['vocab']}: {r['smx_report']['graphs']} graph(s), sites per kind "
                  f"{r['smx_report']['sites'] or '{}'}; last_report().summary() = {r['smx_report']['last_report']}")
    srcs = {r.get("smxcompile_src") for r in results if r.get("variant") in ("smx", "smx-op") and r.get("smxcompile_src")}
    if len(srcs) > 1:
        print("WARNING: smxcompile's source changed during the run (someone edited it): " + "; ".join(
            f"V={r['vocab']} {r['variant']} ran source {r.get('smxcompile_src')}" for r in results
            if r.get("variant") in ("smx", "smx-op")))
    elif srcs:
        print(f"smxcompile source hash (sha1 of its .py files): {srcs.pop()}")
    mm = next((r.get("mem_method") for r in results if r.get("mem_method")), None)
    if mm:
        mt = result["settings"]["malloc_mmap_threshold"]
        print(f"memory: {mm}, MALLOC_MMAP_THRESHOLD_={mt}; peak = max over rounds of (VmHWM during the step - VmRSS just before it); "
              "transient = peak - (N*D + V*D)*4 gradient bytes")
    if args.plot:
        msg = plot(results, args.vocab, variants, args.plot, f"{command}\n{title}")
        print(msg if msg else f"wrote {args.plot}")
    return finish_run(env, result, results, args.json, command, t_start,
                      lambda r: f"V={r['vocab']} {r['variant']}")


def finish_run(env: dict, result: dict, results: list[dict], json_path: str | None, command: str, t_start: float,
               label) -> int:
    """The end of a benchmark run: load average, the JSON file, the command line, the failed rows; exit status
    (1 when a row FAILED, raised or was killed). ``label(row)`` names a row in the failure lines."""
    try:
        env["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
        print(f"load average at start {env.get('loadavg_at_start')}, at end {env['loadavg_at_end']} "
              f"({env['cores']} cores): above the core count means other processes shared the CPUs")
    except OSError:
        pass
    _write_json(json_path, result)
    print(f"\n$ {command}   ({time.monotonic() - t_start:.0f} s)")
    if json_path:
        print(f"wrote {json_path}")
    bad = [r for r in results if r.get("status") in ("FAILED", "error", "killed")]
    for r in bad:
        print(f"{r['status']}: {label(r)}: {r.get('check', {}).get('why') or r.get('error')}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
