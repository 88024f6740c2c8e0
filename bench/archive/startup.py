"""Where a training run's start-up and after-checkpoint report time goes, stage by stage.

    python -m bench.archive.startup RECIPE [dotted.key=value ...]   e.g. train.max_steps=2 train.checkpoint_every=2

Trains RECIPE as ``train/<family>.py`` would, in one process, with the stages timed by wrapping
them: each line gives a stage's own seconds and the process age when it ended (process start =
0, so interpreter start-up and imports count). metrics.jsonl carries the totals of every run
(``startup_s``: process start to the first step; ``step_s``; ``checkpoint_s`` and ``eval_s`` per
report); this script splits them.
"""

from __future__ import annotations

import functools
import sys
import time

import psutil

START = psutil.Process().create_time()
STAGES: list[tuple[str, float, float]] = []  # (stage, its seconds, process age at its end)


def age() -> float:
    return time.time() - START


def timed(owner, name: str, label: str) -> None:
    inner = getattr(owner, name)

    @functools.wraps(inner)
    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            STAGES.append((label, time.perf_counter() - t, age()))

    setattr(owner, name, wrapper)


def main() -> None:
    STAGES.append(("interpreter", 0.0, age()))
    import draftlab.data.dataset as dataset
    import draftlab.data.features as features
    import draftlab.inference.evaluate as evaluate
    import draftlab.inference.proposer as proposer
    import draftlab.inference.report as report
    import draftlab.models.target as target
    from draftlab.models.drafter import DRAFTERS
    from draftlab.recipe import load_recipe
    from draftlab.train import backends, evaluation, launch, trainer

    STAGES.append(("imports", 0.0, age()))
    family = DRAFTERS.get(load_recipe(sys.argv[1], sys.argv[2:]).algorithm, "algorithm")
    for owner, name, label in [
        (backends, "make_accelerator", "accelerator"),
        (target.Target, "load", "target load"),
        (dataset, "build_samples", "data"),
        (family, "build", "drafter build"),
        (evaluation.CheckpointEvaluator, "__init__", "eval prompts"),
        (trainer.Trainer, "__init__", "trainer set-up"),
        (trainer.Trainer, "resume", "resume"),
        (features.FeatureSource, "_remember", "memory capture (per group)"),
        (trainer.Trainer, "save", "checkpoint save"),
        (proposer, "load_proposer", "report: load proposer"),
        (evaluate, "evaluate", "report: decoding"),
        (report, "write_report", "report: write (json, md, png)"),
    ]:
        timed(owner, name, label)
    launch.train_from_recipe(sys.argv[1], sys.argv[2:])
    totals: dict[str, list] = {}
    for label, seconds, at in STAGES:
        n, s, _ = totals.get(label, (0, 0.0, 0.0))
        totals[label] = [n + 1, s + seconds, at]
    print(f"\n{'stage':32s} {'calls':>5s} {'seconds':>8s} {'ended at':>9s}")
    for label, (n, seconds, at) in totals.items():
        print(f"{label:32s} {n:5d} {seconds:8.2f} {at:8.2f}s")


if __name__ == "__main__":
    main()
