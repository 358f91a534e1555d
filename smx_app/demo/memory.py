"""Peak memory of a region of code (``smx demo``'s per-backend figure; the benchmarks use it too)."""

from __future__ import annotations

import ctypes
import gc
import sys
import threading


class PeakMemory:
    """Peak memory increase of a region, in bytes.

    CUDA: ``torch.cuda.max_memory_allocated`` above the allocation at entry.
    CPU (Linux): the peak resident set size above the RSS at entry. Freed heap
    memory is first handed back to the OS (``malloc_trim``) and the kernel's
    high-water mark is reset (``/proc/self/clear_refs``), so the number is what
    the region itself touched. Without ``clear_refs``, a sampling thread reads
    ``VmRSS`` every millisecond; without ``/proc`` (macOS), ``ru_maxrss`` is used
    and the figure is a lower bound.
    """

    def __init__(self, device: str):
        self.device = device
        self.peak_bytes: int | None = None
        self.method = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._sampled = 0

    def __enter__(self) -> "PeakMemory":
        gc.collect()
        if self.device == "cuda":
            import torch

            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self._base = torch.cuda.memory_allocated()
            self.method = "torch.cuda.max_memory_allocated"
            return self
        malloc_trim()
        self._base = rss_bytes("VmRSS")
        if self._base is None:
            import resource

            self._base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
            self.method = "ru_maxrss (lower bound)"
            return self
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset VmHWM to the current RSS
            self.method = "VmHWM after clear_refs"
        except OSError:
            self.method = "VmRSS sampled every 1 ms"
            self._sampled = self._base
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            self._sampled = max(self._sampled, rss_bytes("VmRSS") or 0)

    def __exit__(self, *exc) -> None:
        if self.device == "cuda":
            import torch

            torch.cuda.synchronize()
            self.peak_bytes = torch.cuda.max_memory_allocated() - self._base
        elif self.method.startswith("ru_maxrss"):
            import resource

            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
            self.peak_bytes = max(0, peak - self._base)
        elif self._thread is not None:
            self._stop.set()
            self._thread.join()
            self.peak_bytes = max(0, self._sampled - self._base)
        else:
            self.peak_bytes = max(0, (rss_bytes("VmHWM") or 0) - self._base)


def rss_bytes(field: str, pid: str = "self") -> int | None:
    """The ``field`` line of ``/proc/<pid>/status`` (``"VmRSS"``, ``"VmHWM"``: kB there) in bytes, or None
    without ``/proc`` (not Linux) or without that field. Raises nothing."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def malloc_trim() -> bool:
    """Return freed heap to the OS so peak-memory figures start level; False where it cannot (not glibc)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        return True
    except (OSError, AttributeError):
        return False


__all__ = ["PeakMemory", "rss_bytes", "malloc_trim"]
