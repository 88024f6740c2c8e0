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


# Where bench scripts write: one section per benchmark in BENCHMARKS.md (the latest run), the
# sections they replace in bench/HISTORY.md (newest first). Module attributes, so tests can point
# them elsewhere.
BENCHMARKS_PATH = None  # None: BENCHMARKS.md at the repo root
HISTORY_PATH = None  # None: bench/HISTORY.md
BENCHMARKS_PREFACE = (
    "# draftlab benchmarks\n\n"
    "The latest measured result of each benchmark: what it measures, the command, the table, the date (UTC) and machine.\n"
    "Earlier runs, verbatim and newest first, are in [bench/HISTORY.md](bench/HISTORY.md).\n"
    "Each bench/*.py script rewrites its own section here and moves the one it replaces to the history.\n"
)
HISTORY_PREFACE = (
    "# Benchmark history\n\n"
    "Earlier BENCHMARKS.md sections, verbatim, newest first: bench/peak.py moves a section here when a run replaces it.\n"
)


def _paths(path=None, history=None):
    from pathlib import Path

    root = Path(__file__).resolve().parent
    path = Path(path or BENCHMARKS_PATH or root.parent / "BENCHMARKS.md")
    history = Path(history or HISTORY_PATH or root / "HISTORY.md")
    return path, history


def _sections(text: str):
    """``(head, [section, ...])``: ``head`` is everything before the first ``## `` heading (outside
    fenced code), each section runs from its heading to the next one, trailing blank lines dropped."""
    lines = text.splitlines(keepends=True)
    starts, fenced = [], False
    for i, line in enumerate(lines):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("## "):
            starts.append(i)
    if not starts:
        return text, []
    bounds = starts + [len(lines)]
    sections = ["".join(lines[a:b]).rstrip() + "\n" for a, b in zip(bounds, bounds[1:])]
    return "".join(lines[: starts[0]]), sections


def _has_title(section: str, title: str) -> bool:
    """Whether ``section``'s heading is ``## title``, alone or followed by a parenthesis (a date)."""
    heading = section.split("\n", 1)[0][3:].rstrip()
    return heading == title or heading.startswith(title + " (")


def _what(section: str) -> str:
    """The section's ``What:`` paragraph (hand-written, kept across runs), or ''."""
    for para in section.split("\n\n")[1:]:
        if para.startswith("What:"):
            return para.strip() + "\n\n"
    return ""


def _join(head: str, sections) -> str:
    """``head`` and the sections, one blank line between each."""
    parts = ([head.strip("\n") + "\n"] if head.strip() else []) + list(sections)
    return "\n".join(parts)


def append_benchmarks(text: str, path=None, history=None) -> None:
    """Write one result section (``## title (YYYY-MM-DD HH:MM UTC)`` or ``## title``, then the body)
    into BENCHMARKS.md in place of the section with the same title; the replaced section moves,
    verbatim, to the top of bench/HISTORY.md. A title not in the file is added at its end.

    The new section reads ``## title``, the old section's ``What:`` paragraph if it had one,
    ``Latest run: date UTC`` (from the heading's date), then the body. Both files are written
    atomically, the history first: a kill in between leaves the old section in both, never in neither.
    """
    import re

    from draftlab import atomic

    path, history = _paths(path, history)
    heading, _, body = text.strip("\n").partition("\n")
    m = re.fullmatch(r"## (.*?)(?: \((\d{4}-\d\d-\d\d \d\d:\d\d) UTC\))?\s*", heading)
    if m is None:
        raise ValueError(f"a benchmark section starts with a '## ' heading, got {heading!r}")
    title, date = m.group(1), m.group(2)

    head, sections = _sections(path.read_text()) if path.exists() else (BENCHMARKS_PREFACE, [])
    old = [s for s in sections if _has_title(s, title)]
    what = _what(old[0]) if old else ""
    latest = f"Latest run: {date} UTC\n\n" if date else ""
    body = body.strip("\n")
    new = f"## {title}\n\n{what}{latest}{body}\n"
    if old:
        at = sections.index(old[0])
        sections = [s for s in sections if not _has_title(s, title)]
        sections.insert(at, new)
        hhead, hsections = _sections(history.read_text()) if history.exists() else (HISTORY_PREFACE, [])
        atomic.write_text(history, _join(hhead, old[::-1] + hsections))  # newest first
    else:
        sections.append(new)
    atomic.write_text(path, _join(head, sections))
    print(f"wrote '{title}' to {path}" + (f" (the section it replaces moved to {history})" if old else ""))


def append_run(title: str, started, prog: str, argv, text: str) -> None:
    """Replace BENCHMARKS.md's section ``## title`` with this run (``started``, UTC): the command
    that ran and ``text``; the replaced section moves to bench/HISTORY.md (:func:`append_benchmarks`)."""
    import shlex

    args = sys.argv[1:] if argv is None else argv
    cmd = f"python {prog} " + " ".join(shlex.quote(a) for a in args)
    append_benchmarks(f"## {title} ({started:%Y-%m-%d %H:%M} UTC)\n\nCommand: `{cmd.strip()}`\n\n{text}\n")


def main_with_errors(prog: str, parse_args, run, argv=None) -> int:
    """``run(argv, parse_args(argv))``; a DraftlabError becomes one line on stderr and exit 2."""
    from draftlab.errors import DraftlabError

    try:
        return run(argv, parse_args(argv))
    except DraftlabError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2

