"""The machine a benchmark runs on: what it is (CPU, memory, versions, copy bandwidth), what the process holds (RSS),
and whether other work competed for its CPUs while a measurement ran (load).

Timings are only as good as the machine's quiet: on cores shared with other jobs, OpenMP threads wait on each other and
a decode step reads slower, for every cache alike but not by the same factor (docs/benchmarks.md). So every measurement
records how much CPU *other* processes used on this process' CPUs while it ran (from ``/proc/stat``, minus this
process' own CPU time), and rows measured under competition are flagged.
"""

from __future__ import annotations

import contextlib
import gc
import os
import platform
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from hybrid_cache.code_kernel import cpu_features, kernel_status
from hybrid_cache.code_path import fallback_status

__all__ = [
    "Contention",
    "ContentionMeter",
    "RssSampler",
    "busy_machine_warning",
    "current_rss_bytes",
    "machine_info",
    "measure_bandwidth",
    "release_free_memory",
    "sync",
]


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _cpu_flags() -> list[str]:
    """The CPU features that decide the attention paths (x86 `flags` / aarch64 `Features`, or macOS `sysctl`)."""
    wanted = {"avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16", "amx_tile", "fma", "f16c"}
    return sorted((wanted | {"asimd", "asimddp"}) & cpu_features())


def _mem_total_gib() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal"):
                    return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity set; `os.cpu_count()` where affinity is unknown)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def loadavg() -> list[float] | None:
    """The 1, 5 and 15-minute load averages (runnable tasks, machine-wide), or None where unavailable."""
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None


def machine_info() -> dict[str, Any]:
    """nproc, CPU model and flags, memory, torch threads and library versions."""
    import transformers

    return {
        "nproc": os.cpu_count(),
        "affinity_cpus": usable_cpus(),
        "cpu_model": _cpu_model(),
        "cpu_flags": _cpu_flags(),
        "mem_total_gib": _mem_total_gib(),
        "torch_threads": torch.get_num_threads(),
        "loadavg_at_start": loadavg(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        # Which path attention on the int8 / int4 codes takes here: the native kernel and its instruction set
        # (HYBRID_CACHE_CODE_KERNEL_ISA), or why not, and what runs where it cannot (HYBRID_CACHE_CODE_FALLBACK).
        "code_kernel": f"{kernel_status()}; {fallback_status()}",
    }


def sync(device: torch.device | str) -> None:
    """Wait for queued kernels (CUDA); a no-op on CPU."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def measure_bandwidth(nbytes: int = 2**30, repeats: int = 5, device: torch.device | str = "cpu") -> dict[str, float]:
    """Memory copy bandwidth on `device`: best of `repeats` ``dst.copy_(src)`` of `nbytes` (read + written bytes / time).

    Returns:
        ``{"bytes": nbytes, "best_s": ..., "gbps": (2 * nbytes) / best_s / 1e9}`` (GB/s, 10^9 bytes).
    """
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    src.fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in
    sync(device)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - start)
    del src, dst
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    return {"bytes": nbytes, "best_s": best, "gbps": 2 * nbytes / best / 1e9}


def current_rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


def release_free_memory() -> None:
    """Collect garbage and give the C allocator's free pages back to the system (glibc `malloc_trim`; elsewhere only
    the collection), so that an RSS measured next grows with what is really allocated, not into pages kept free."""
    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class RssSampler:
    """Samples the RSS every `interval` seconds in a thread; `.peak` is the highest value seen."""

    def __init__(self, interval: float = 0.005) -> None:
        self.interval = interval
        self.peak = current_rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, current_rss_bytes())
            self._stop.wait(self.interval)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, current_rss_bytes())


# --------------------------------------------------------------------------------------------------------------------
# Load: did other work compete for our CPUs?
# --------------------------------------------------------------------------------------------------------------------
def _busy_seconds(cpus: set[int] | None) -> float | None:
    """CPU seconds spent busy (not idle, not waiting for I/O) since boot on `cpus` (all CPUs when None), from
    ``/proc/stat``; None where it cannot be read (not Linux)."""
    try:
        with open("/proc/stat") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    ticks = 0
    found = False
    for line in lines:
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or name == "cpu":
            continue
        if cpus is not None and int(name[3:]) not in cpus:
            continue
        # user nice system idle iowait irq softirq steal [guest guest_nice]: guest time is already counted in user.
        fields = [int(x) for x in rest.split()]
        ticks += sum(fields[:3]) + sum(fields[5:8])
        found = True
    return ticks / os.sysconf("SC_CLK_TCK") if found else None


@dataclass
class Contention:
    """CPU time other processes used on this process' CPUs during one or more measured intervals.

    Attributes:
        wall_s: total wall time of the intervals.
        other_cpu_s: CPU seconds used by other processes on our CPUs during them (None: not measurable here).
        loadavg_max: highest 1-minute load average seen at the start or end of an interval.
    """

    wall_s: float = 0.0
    other_cpu_s: float | None = 0.0
    loadavg_max: float | None = None

    @property
    def other_cores(self) -> float | None:
        """Average number of our CPUs kept busy by other processes."""
        if self.other_cpu_s is None or self.wall_s <= 0:
            return None
        return self.other_cpu_s / self.wall_s

    def add(self, other: Contention) -> None:
        self.wall_s += other.wall_s
        self.other_cpu_s = (
            None if (self.other_cpu_s is None or other.other_cpu_s is None) else (self.other_cpu_s + other.other_cpu_s)
        )
        loads = [x for x in (self.loadavg_max, other.loadavg_max) if x is not None]
        self.loadavg_max = max(loads) if loads else None


class ContentionMeter:
    """Measures whether other processes competed for the CPUs a benchmark uses.

    ``with meter.track(contention): ...`` adds the interval's wall time, the CPU time other processes spent on this
    process' CPUs (busy time from ``/proc/stat`` minus this process' own CPU time) and the load average to
    `contention`. :meth:`competing` says whether that exceeded the CPUs the benchmark leaves free (``cpus - threads``)
    by more than `tolerance` cores on average. Where ``/proc/stat`` is missing, the 1-minute load average (which
    includes this process' own threads) stands in: competing when it exceeds the CPUs.

    Args:
        threads: CPU threads the measured work uses (torch's intra-op threads).
        tolerance: average cores of other work tolerated (daemons, this process' own helper threads' noise).
    """

    def __init__(self, threads: int | None = None, tolerance: float = 0.25) -> None:
        self.cpus = usable_cpus()
        self.threads = min(threads or torch.get_num_threads(), self.cpus)
        self.tolerance = tolerance
        self._cpu_set = set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None

    @property
    def spare_cpus(self) -> int:
        """CPUs the benchmark leaves free for other work."""
        return self.cpus - self.threads

    def sample(self) -> tuple[float, float, float | None]:
        """(wall clock, this process' CPU seconds, busy CPU seconds of our CPUs)."""
        return time.perf_counter(), time.process_time(), _busy_seconds(self._cpu_set)

    def between(self, start: tuple[float, float, float | None], end: tuple[float, float, float | None]) -> Contention:
        wall = end[0] - start[0]
        if start[2] is None or end[2] is None:
            other = None
        else:
            # Tick granularity (10 ms) can make a short interval's difference slightly negative.
            other = max(0.0, (end[2] - start[2]) - (end[1] - start[1]))
        load = loadavg()
        return Contention(wall_s=wall, other_cpu_s=other, loadavg_max=load[0] if load else None)

    @contextlib.contextmanager
    def track(self, into: Contention) -> Iterator[None]:
        load = loadavg()
        start = self.sample()
        try:
            yield
        finally:
            interval = self.between(start, self.sample())
            if load is not None:
                interval.loadavg_max = max(load[0], interval.loadavg_max or 0.0)
            into.add(interval)

    def competing(self, contention: Contention) -> bool:
        """Whether other work used more of our CPUs than the benchmark leaves free (+ tolerance)."""
        cores = contention.other_cores
        if cores is not None:
            return cores > self.spare_cpus + self.tolerance
        return contention.loadavg_max is not None and contention.loadavg_max > self.cpus + self.tolerance

    def probe(self, seconds: float = 1.0) -> Contention:
        """Measure other processes' CPU use over `seconds` while this process sleeps (before a benchmark starts)."""
        contention = Contention()
        with self.track(contention):
            time.sleep(seconds)
        return contention


def busy_machine_warning(meter: ContentionMeter, contention: Contention) -> str | None:
    """A warning naming the load and what to do, when other work competes for the benchmark's CPUs; else None."""
    if not meter.competing(contention):
        return None
    cores = contention.other_cores
    load = loadavg()
    used = (
        f"other processes are keeping {cores:.1f} of the {meter.cpus} CPUs busy"
        if cores is not None
        else (f"the load average is {load[0]:.1f} on {meter.cpus} CPUs" if load else "the machine is busy")
    )
    free = max(1, meter.spare_cpus + meter.threads - round(cores or 0.0))
    advice = (
        f"Re-run on a quiet machine (nothing else running), or pass --threads {free} so that this benchmark's "
        "threads do not queue behind the other work"
        if free < meter.threads
        else "Re-run on a quiet machine (nothing else running)"
    )
    return (
        f"WARNING: {used} (load average {load}) while this benchmark runs {meter.threads} torch thread(s) on them: "
        "its timings would measure that competition, not the caches (on a busy machine a plain run has read "
        f"ring/dynamic 2.5x where a quiet one reads 0.2-1.0x). {advice}. Rows measured while other work competed "
        "for the CPUs are marked '!' in the table and \"competing_load\": true in the JSON."
    )
