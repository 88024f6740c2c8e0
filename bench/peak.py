"""The machine's fp32 matmul peak (FLOP/s), measured: the denominator of every "% of peak".

Best of several timed windows of large fp32 ``torch.mm`` calls, over a square 2048 GEMM and
the GEMM shapes of a small decoder (M = 1024 tokens, K/N = 576 and 1536). Measure it in the
same run as the throughput it is compared with: the benchmark machine is shared, so absolute
numbers drift while ratios taken back to back hold.

    python bench/peak.py [--seconds 3] [--threads N]
"""

from __future__ import annotations

import argparse
import sys
import time

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


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    peak = measure_fp32_peak(args.seconds)
    print(f"fp32 matmul peak: {peak / 1e9:.1f} GFLOP/s ({torch.get_num_threads()} threads)")


if __name__ == "__main__":
    main()


def cpu_name() -> str:
    """The CPU model for benchmark headers."""
    import platform
    from pathlib import Path

    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def append_benchmarks(text: str, path=None) -> None:
    """Append one result section to BENCHMARKS.md (created with its header if missing)."""
    from pathlib import Path

    path = Path(path) if path else Path(__file__).resolve().parent.parent / "BENCHMARKS.md"
    new = not path.exists()
    with open(path, "a") as f:
        if new:
            f.write("# draftlab benchmarks\n\nMeasured results, appended by the scripts in bench/ (newest last).\n")
        f.write(text)
    print(f"appended to {path}")


def append_run(title: str, started, prog: str, argv, text: str) -> None:
    """Append a section ``## title (started, UTC)`` holding the command that ran and ``text``."""
    import shlex

    args = sys.argv[1:] if argv is None else argv
    cmd = f"python {prog} " + " ".join(shlex.quote(a) for a in args)
    append_benchmarks(f"\n## {title} ({started:%Y-%m-%d %H:%M} UTC)\n\nCommand: `{cmd.strip()}`\n\n{text}\n")


def main_with_errors(prog: str, parse_args, run, argv=None) -> int:
    """``run(argv, parse_args(argv))``; a DraftlabError becomes one line on stderr and exit 2."""
    from draftlab.errors import DraftlabError

    try:
        return run(argv, parse_args(argv))
    except DraftlabError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2

