"""Timing: the median of repeated calls after a warm-up, within a time budget per case, so a
slow backend (PoCL on two cores) and a fast one (a GPU) both get a stable figure. And a
process's peak memory."""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable


@dataclass(frozen=True)
class Timing:
    seconds: float          # median of the timed calls
    calls: int

    def rate(self, amount: float) -> float:
        return amount / self.seconds if self.seconds > 0 else 0.0


def time_calls(run: Callable[[], object], *, budget_s: float = 1.0, min_calls: int = 3, max_calls: int = 50) -> Timing:
    """Median wall time of `run()` (which must wait for its device): one warm-up call, then
    calls until `budget_s` is spent, at least `min_calls` and at most `max_calls`. A call
    slower than the whole budget several times over (an untuned kernel at a 9B shape) is
    timed once more and reported as it is, rather than holding the run for minutes."""
    t0 = time.perf_counter()
    run()
    if time.perf_counter() - t0 > 5 * budget_s:
        t0 = time.perf_counter()
        run()
        return Timing(time.perf_counter() - t0, 1)
    samples: list[float] = []
    spent = 0.0
    while len(samples) < min_calls or (spent < budget_s and len(samples) < max_calls):
        t0 = time.perf_counter()
        run()
        samples.append(time.perf_counter() - t0)
        spent += samples[-1]
    return Timing(statistics.median(samples), len(samples))


def peak_rss() -> int:
    """This process's peak resident set (VmHWM), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/self/status has no VmHWM line")


def available_memory() -> int:
    """What the kernel says can be allocated without swapping (MemAvailable), in bytes."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no MemAvailable line")
