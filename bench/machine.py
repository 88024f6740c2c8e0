"""The machine a benchmark ran on: its CPU's name, its fp32 matmul peak (the denominator of every
"% of peak") and how much CPU other processes took while a benchmark ran.

The benchmark machine is shared, so absolute numbers drift while ratios taken back to back
hold: measure the peak in the same run as the throughput it is compared with.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

# (M, K, N): square, then decoder-like projections (hidden 576, MLP 1536, 1024 tokens)
DEFAULT_SHAPES = ((2048, 2048, 2048), (1024, 576, 1536), (1024, 1536, 576))


def measure_fp32_peak(seconds: float = 2.0, shapes=DEFAULT_SHAPES, windows: int = 4) -> float:
    """Best sustained FLOP/s of fp32 ``torch.mm`` over ``shapes``, ~``seconds`` in total,
    split into ``windows`` timed windows per shape (the best window wins: interference from
    other processes only ever slows a window down)."""
    best = 0.0
    window = seconds / (len(shapes) * windows)
    g = torch.Generator().manual_seed(0)
    for m, k, n in shapes:
        a = torch.randn(m, k, generator=g)
        b = torch.randn(k, n, generator=g)
        c = torch.empty(m, n)
        torch.mm(a, b, out=c)  # warm-up: thread pool, MKL buffers
        flops = 2.0 * m * k * n
        for _ in range(windows):
            calls, t0 = 0, time.perf_counter()
            while True:
                torch.mm(a, b, out=c)
                calls += 1
                dt = time.perf_counter() - t0
                if dt >= window:
                    break
            best = max(best, flops * calls / dt)
    return best


def cpu_name() -> str:
    """The CPU model for benchmark headers."""
    import platform

    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def busy_cpu_seconds() -> float:
    """CPU-seconds all processes spent busy since boot (/proc/stat; 0 where unavailable)."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except OSError:
        return 0.0
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


class LoadWindow:
    """The machine's load over a measurement, from when the window is made: :meth:`close` gives
    what :func:`load_note` reads (other processes' CPU-seconds beside this run's)."""

    def __init__(self):
        self.loadavg_start = " ".join(f"{x:.2f}" for x in os.getloadavg())
        self._busy, self._own, self._t0 = busy_cpu_seconds(), own_cpu_seconds(), time.perf_counter()

    def close(self) -> dict:
        return {"busy": busy_cpu_seconds() - self._busy, "own": own_cpu_seconds() - self._own,
                "wall": time.perf_counter() - self._t0, "loadavg_start": self.loadavg_start}


def load_note(window: dict) -> str:
    others = max(0.0, window["busy"] - window["own"])
    cores = os.cpu_count() or 1
    return (
        f"load average {window['loadavg_start']} at start; during the timed steps other processes used "
        f"{others:.0f} CPU-s of {window['wall'] * cores:.0f} available ({100 * others / (window['wall'] * cores):.0f}% "
        f"of {cores} cores), this run {window['own']:.0f} CPU-s"
    )
