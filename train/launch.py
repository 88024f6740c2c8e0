"""From a recipe path to a finished run, for every drafter family.

``draftlab train RECIPE [dotted.key=value ...]`` dispatches on the recipe's ``algorithm``; each
family's ``train/<family>.py`` is a thin script for ``accelerate launch`` that calls
:func:`entry_point` with the algorithms it trains."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from draftlab.errors import DraftlabError
from draftlab.process_exit import exit_process


def train_from_recipe(path: str, overrides: list[str], algorithms: tuple[str, ...] = (), prog: str = "draftlab train") -> dict:
    """Train the recipe at ``path``; ``algorithms``, when given, are the only ones accepted;
    ``prog`` starts the error line of a process that stops for another's death.

    The main process holds ``output_dir``'s run lock (``train/run_lock.py``) from before anything is
    loaded to the end; the processes of a multi-process run watch each other (``train/dead_ranks.py``)."""
    from draftlab.atomic import writable_dir
    from draftlab.recipe import load_recipe
    from draftlab.train import run_lock
    from draftlab.train.backends import make_accelerator
    from draftlab.train.dead_ranks import DeadRankWatch
    from draftlab.train.rank_failures import RankFailures

    recipe = load_recipe(path, overrides)
    if algorithms and recipe.algorithm not in algorithms:
        raise DraftlabError(f"{path}: algorithm '{recipe.algorithm}' is not trained by this entry point (use one of {algorithms})")
    # before minutes of loading and data preparation, not at the first checkpoint
    writable_dir(recipe.output_dir, "output_dir")
    algo, drafter_cfg, loss_cfg = recipe.algorithm_configs()
    if not algo.trains_weights:  # nothing to train by gradient steps (a layer-set search): the family's own run
        from draftlab.train.variants import TRAINERS

        with run_lock.held(recipe.output_dir):
            return TRAINERS.get(recipe.algorithm, "algorithm")(recipe)
    if (field := algo.rewrites_batches(loss_cfg)) and recipe.capture.mode != "online":
        raise DraftlabError(f"{field}: the drafter generates its own training sequences, so capture.mode must be online, "
                            f"not {recipe.capture.mode}")

    accelerator = make_accelerator(recipe.train.precision)
    failures = RankFailures(accelerator)
    lock = watch = None
    with failures.caught():
        if accelerator.is_main_process:
            lock = run_lock.acquire(recipe.output_dir)
    failures.raise_if_any()
    try:
        if accelerator.num_processes > 1:
            watch = DeadRankWatch(recipe.output_dir, accelerator.process_index, accelerator.num_processes, prog,
                                  before_exit=lambda: lock and run_lock.release(lock))
            with failures.caught():
                watch.announce()
            failures.raise_if_any()  # also the barrier after which every heartbeat is this run's
            watch.start()
        metrics = _train(path, recipe, accelerator, algo, drafter_cfg, loss_cfg)
    except Exception as e:
        # a collective that failed because a process died: the watch names it and ends this process
        if watch is not None and not isinstance(e, DraftlabError) and watch.explains():
            time.sleep(60)
        raise
    finally:
        if watch is not None:
            watch.stop()
        if lock is not None:
            run_lock.release(lock)
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return metrics


def _train(path, recipe, accelerator, algo, drafter_cfg, loss_cfg) -> dict:
    from draftlab.data.dataset import build_samples
    from draftlab.data.features import FeatureSource
    from draftlab.models.target import Target
    from draftlab.train.evaluation import CheckpointEvaluator
    from draftlab.train.rng import seed_everything
    from draftlab.train.trainer import Trainer

    main = accelerator.is_main_process
    seed_everything(recipe.seed)
    device = str(accelerator.device) if recipe.target.device == "auto" else recipe.target.device
    if device == "cpu" and "OMP_NUM_THREADS" not in os.environ:  # a user's choice, which torch read at start, stands
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // accelerator.num_processes))
    if main:
        print(f"draftlab: {recipe.algorithm} run in {recipe.output_dir} on {accelerator.num_processes} process(es), device {device}", flush=True)
    # The first load of the default target converts its GGUF into a cache: let one process do it.
    with accelerator.main_process_first():
        target = Target.load(recipe.target.model, recipe.target.dtype, device, recipe.target.trust_remote_code)
    samples = build_samples(recipe.data, target.tokenizer, target=target if recipe.data.regenerate else None,
                            regenerate_path=Path(recipe.output_dir) / "regenerated.jsonl")
    if main:
        print(f"data: {json.dumps(samples.report)}", flush=True)
    if not samples.train:
        raise DraftlabError(f"{path}: data: no training samples left after filtering")

    # Drafter weights stay fp32 (master weights) whatever the target's dtype.
    drafter = algo.build(drafter_cfg, target, samples.train).float()
    features = FeatureSource(recipe.capture, target, drafter, samples.train, recipe.data.model_dump(mode="json"),
                             group_tokens=recipe.capture.group_tokens or recipe.train.batch_tokens, seed=recipe.seed)
    evaluator = CheckpointEvaluator(recipe, target, samples, drafter) if recipe.eval.enabled else None
    # Different ranks draw different noise, reproducibly.
    seed_everything(recipe.seed * 1000 + accelerator.process_index + 1)
    trainer = Trainer(recipe, accelerator, target, drafter, loss_cfg, samples.train, features, evaluate=evaluator)
    return trainer.run()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", help="recipe YAML (see recipes/)")
    p.add_argument("overrides", nargs="*", help="dotted.key=value overrides, e.g. train.max_steps=20")


def run(args, algorithms: tuple[str, ...] = (), prog: str = "draftlab train") -> int:
    """0 when the run ends, ``EXIT_PREEMPTED`` when a signal stopped it (relaunch to resume)."""
    from draftlab.train.preemption import EXIT_PREEMPTED

    metrics = train_from_recipe(args.recipe, args.overrides, algorithms, prog)
    return EXIT_PREEMPTED if isinstance(metrics, dict) and metrics.get("preempted_by") else 0


def entry_point(prog: str, algorithms: tuple[str, ...], description: str) -> None:
    """``accelerate launch train/<family>.py RECIPE [overrides]``: train, then leave through
    :func:`exit_process` with 0, 2 after a one-line error, or 75 when preempted (one line too)."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    add_arguments(parser)
    args = parser.parse_args()
    try:
        rc = run(args, algorithms, prog)
    except DraftlabError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        rc = 2
    exit_process(rc)
