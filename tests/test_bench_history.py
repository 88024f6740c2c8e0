"""bench/sections.py writes each benchmark's latest run in place of its BENCHMARKS.md section and moves
the section it replaces to bench/HISTORY.md (newest first); it never appends a second copy."""

import re
from datetime import datetime
from pathlib import Path

import pytest

from bench import sections

REPO = Path(__file__).resolve().parent.parent

PREFACE = "# draftlab benchmarks\n\nThree lines of preface.\nHistory: bench/HISTORY.md.\nScripts rewrite sections.\n"
BATCH_OLD = (
    "## Speedup by batch size\n\n"
    "What: speculative against plain decoding by batch size.\n"
    "Second line of what.\n\n"
    "Latest run: 2026-11-26 07:31 UTC\n\n"
    "Command: `python -m bench.batch --min-groups 8`\n\n"
    "| configuration | B=1 |\n|---|---|\n| eagle3 k=1 | 1.18× |\n"
)
E2E_OLD = (
    "## End-to-end greedy decoding, draftlab vs HF transformers (2026-11-23 01:06 UTC)\n\n"
    "Command: `python -m bench.e2e --k 1`\n\n"
    "| # | decoder | tok/s |\n|---|---|---|\n| 1 | draftlab plain greedy | 15.9 |\n"
)
TREE = (
    "## Medusa static tree from head accuracies\n\n"
    "What: a tree from head accuracies.\n\n"
    "Chosen tree:\n\n```json\n## not a heading, inside code\n[[0],[1],[2]]\n```\n\n"
    "After the code block.\n"
)
HISTORY_HEAD = "# Benchmark history\n\nEarlier sections, verbatim, newest first.\n"
HISTORY_OLDEST = "## Speedup by batch size (2026-11-25 19:17 UTC)\n\nCommand: `python -m bench.batch`\n\n| old | table |\n"


@pytest.fixture
def files(tmp_path, monkeypatch):
    bench, history = tmp_path / "BENCHMARKS.md", tmp_path / "bench" / "HISTORY.md"
    bench.write_text("\n".join([PREFACE, BATCH_OLD, E2E_OLD, TREE]))
    history.parent.mkdir()
    history.write_text("\n".join([HISTORY_HEAD, HISTORY_OLDEST]))
    # raising=True: code without these paths fails here, before it could touch the real files
    monkeypatch.setattr(sections, "BENCHMARKS_PATH", bench)
    monkeypatch.setattr(sections, "HISTORY_PATH", history)
    return bench, history


def headings(text):
    out, fenced = [], False
    for line in text.splitlines():
        fenced ^= line.startswith("```")
        if line.startswith("## ") and not fenced:
            out.append(line)
    return out


def test_a_run_replaces_its_section_and_moves_the_old_one_to_history(files):
    bench, history = files
    sections.append_run("Speedup by batch size", datetime(2026, 11, 27, 9, 5), "bench.batch",
                        ["--min-groups", "8"], "| configuration | B=1 |\n|---|---|\n| draft-length rule | 1.20× |")
    text = bench.read_text()
    assert headings(text) == ["## Speedup by batch size",
                              "## End-to-end greedy decoding, draftlab vs HF transformers (2026-11-23 01:06 UTC)",
                              "## Medusa static tree from head accuracies"]
    assert text == "\n".join([
        PREFACE,
        "## Speedup by batch size\n\n"
        "What: speculative against plain decoding by batch size.\nSecond line of what.\n\n"  # kept across runs
        "Latest run: 2026-11-27 09:05 UTC\n\n"
        "Command: `python -m bench.batch --min-groups 8`\n\n"
        "| configuration | B=1 |\n|---|---|\n| draft-length rule | 1.20× |\n",
        E2E_OLD, TREE])  # the other sections (and the preface) untouched, in their places
    assert "1.18×" not in text and text.count("## Speedup by batch size") == 1
    # the replaced section, verbatim, right below the history's heading, above the older one
    assert history.read_text() == "\n".join([HISTORY_HEAD, BATCH_OLD, HISTORY_OLDEST])


def test_a_dated_section_from_a_script_replaces_the_section_of_its_title(files):
    bench, history = files
    # bench.e2e, capture, recipe_tau and train_throughput pass a whole dated section
    sections.append_benchmarks("\n## End-to-end greedy decoding, draftlab vs HF transformers (2026-11-28 10:00 UTC)\n\n"
                               "Command: `python -m bench.e2e --k 2`\n\nnew e2e table\n")
    text = bench.read_text()
    assert headings(text) == ["## Speedup by batch size",
                              "## End-to-end greedy decoding, draftlab vs HF transformers",
                              "## Medusa static tree from head accuracies"]
    assert ("## End-to-end greedy decoding, draftlab vs HF transformers\n\nLatest run: 2026-11-28 10:00 UTC\n\n"
            "Command: `python -m bench.e2e --k 2`\n\nnew e2e table\n\n## Medusa") in text
    assert text.startswith("\n".join([PREFACE, BATCH_OLD]))
    assert text.endswith(TREE)
    assert history.read_text() == "\n".join([HISTORY_HEAD, E2E_OLD, HISTORY_OLDEST])


def test_a_new_title_is_added_and_nothing_moves(files):
    bench, history = files
    before, history_before = bench.read_text(), history.read_text()
    sections.append_run("Speedup by batch", datetime(2026, 11, 27, 9, 5), "bench.other", [], "prefix of a title only")
    sections.append_run("Verify kernels on a GPU", datetime(2026, 11, 27, 10, 0), "bench.kernels", [], "kernels table")
    text = bench.read_text()
    assert text.startswith(before)
    assert text[len(before):] == ("\n## Speedup by batch\n\nLatest run: 2026-11-27 09:05 UTC\n\n"
                                  "Command: `python -m bench.other`\n\nprefix of a title only\n"
                                  "\n## Verify kernels on a GPU\n\nLatest run: 2026-11-27 10:00 UTC\n\n"
                                  "Command: `python -m bench.kernels`\n\nkernels table\n")
    assert history.read_text() == history_before


def test_the_next_run_moves_the_rewritten_section_and_history_stays_newest_first(files):
    bench, history = files
    for hour in (9, 10):
        sections.append_run("Medusa static tree from head accuracies", datetime(2026, 11, 27, hour, 0),
                            "bench.medusa_tree", [], f"run at {hour}")
    text = bench.read_text()
    assert text.count("## Medusa static tree") == 1
    assert text.endswith("## Medusa static tree from head accuracies\n\nWhat: a tree from head accuracies.\n\n"
                         "Latest run: 2026-11-27 10:00 UTC\n\nCommand: `python -m bench.medusa_tree`\n\nrun at 10\n")
    hist = history.read_text()
    assert headings(hist) == ["## Medusa static tree from head accuracies"] * 2 + [
        "## Speedup by batch size (2026-11-25 19:17 UTC)"]
    assert hist.index("run at 9") < hist.index(TREE) < hist.index(HISTORY_OLDEST)  # the code block moved whole


def test_missing_files_are_created(tmp_path, monkeypatch):
    bench, history = tmp_path / "BENCHMARKS.md", tmp_path / "HISTORY.md"
    monkeypatch.setattr(sections, "BENCHMARKS_PATH", bench)
    monkeypatch.setattr(sections, "HISTORY_PATH", history)
    sections.append_run("Hidden-state capture throughput", datetime(2026, 11, 27, 9, 5), "bench.capture", [], "t1")
    assert bench.read_text().startswith(sections.BENCHMARKS_PREFACE)
    assert not history.exists()
    sections.append_run("Hidden-state capture throughput", datetime(2026, 11, 27, 9, 6), "bench.capture", [], "t2")
    assert history.read_text().startswith(sections.HISTORY_PREFACE)
    assert "t1" in history.read_text() and "t1" not in bench.read_text() and "t2" in bench.read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["BENCHMARKS.md", "HISTORY.md"]  # no temporaries left


def test_both_files_are_written_atomically(files, monkeypatch):
    from draftlab import atomic

    bench, history = files
    written, write_text = [], atomic.write_text
    monkeypatch.setattr(atomic, "write_text", lambda path, text: written.append(path) or write_text(path, text))
    sections.append_run("Speedup by batch size", datetime(2026, 11, 27, 9, 5), "bench.batch", [], "new")
    assert written == [history, bench]  # the history first: a kill in between loses no section


def test_every_bench_script_is_indexed_with_its_section():
    """Each script in bench/ (a module with a ``__main__`` block, run as ``python -m bench.<name>``) has
    a row in BENCHMARKS.md's index, linking to its section (what it measures, when it last ran, the
    command) once it has run; finished studies move to bench/archive/ instead."""
    text = (REPO / "BENCHMARKS.md").read_text()
    _, parts = sections._sections(text)
    # GitHub's anchors: lower case, punctuation dropped, spaces as hyphens
    by_anchor = {re.sub(r"[^\w\- ]", "", s.split("\n", 1)[0][3:].strip().lower()).replace(" ", "-"): s for s in parts}
    rows = dict(re.findall(r"^\| `bench\.(\w+)` \| (.+) \|$", text, flags=re.M))
    scripts = sorted(p.stem for p in (REPO / "bench").glob("*.py") if 'if __name__ == "__main__"' in p.read_text())
    assert len(scripts) >= 10 and [s for s in scripts if s not in rows] == []
    links = {s: m.group(1) for s, cell in rows.items() if (m := re.match(r"\[[^\]]+\]\(#([^)]+)\)", cell))}
    assert len(links) >= 10 and {s: a for s, a in links.items() if a not in by_anchor} == {}
    for script, anchor in links.items():
        assert all(f"\n{field}:" in by_anchor[anchor] for field in ("What", "Latest run", "Command")), script
