"""BENCHMARKS.md and bench/HISTORY.md: each benchmark's latest run replaces its own section of
BENCHMARKS.md, and the section it replaces moves, verbatim, to the top of the history."""

from __future__ import annotations

import sys

# Where bench scripts write: one section per benchmark in BENCHMARKS.md (the latest run), the
# sections they replace in bench/HISTORY.md (newest first). Module attributes, so tests can point
# them elsewhere.
BENCHMARKS_PATH = None  # None: BENCHMARKS.md at the repo root
HISTORY_PATH = None  # None: bench/HISTORY.md
BENCHMARKS_PREFACE = (
    "# draftlab benchmarks\n\n"
    "The latest measured result of each benchmark: what it measures, the command, the table, the date (UTC) and machine.\n"
    "Earlier runs, verbatim and newest first, are in [bench/HISTORY.md](bench/HISTORY.md).\n"
    "Each `python -m bench.<name>` run rewrites its own section here and moves the one it replaces to the history.\n"
)
HISTORY_PREFACE = (
    "# Benchmark history\n\n"
    "Earlier BENCHMARKS.md sections, verbatim, newest first: bench/sections.py moves a section here when a run replaces it.\n"
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


def append_run(title: str, started, module: str, argv, text: str) -> None:
    """Replace BENCHMARKS.md's section ``## title`` with this run (``started``, UTC): the command
    that ran (``python -m module argv``) and ``text``; the replaced section moves to
    bench/HISTORY.md (:func:`append_benchmarks`)."""
    import shlex

    args = sys.argv[1:] if argv is None else argv
    cmd = f"python -m {module} " + " ".join(shlex.quote(a) for a in args)
    append_benchmarks(f"## {title} ({started:%Y-%m-%d %H:%M} UTC)\n\nCommand: `{cmd.strip()}`\n\n{text}\n")
