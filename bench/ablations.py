"""Ablations of the main job's EAGLE-3 recipe: one ingredient of a peer trainer at a time, at equal
tokens, paired per prompt with the recipe as shipped.

    python -m bench.ablations --capture DIR [--out runs/ablate] [--arms NAME,...]
        [--recipe recipes/smollm2-135m-eagle3.yaml] [--num-prompts 32] [--k 3] [--max-new-tokens 64]
        [--no-append] [recipe.key=value ...]

Every arm is ``draftlab train RECIPE`` with the dotted overrides common to all (e.g.
``train.epochs=1``), the arm's own overrides (``ARMS``), and ``capture.mode=offline`` reading
``--capture``: one ``draftlab capture`` of the recipe's data section, so every arm trains on the
same features, tokens and batches. Each arm's last checkpoint is decoded by ``draftlab eval`` on the
same ``--num-prompts`` held-out ShareGPT prompts at chain ``--k``, and the table pairs it with the
``recipe`` arm per prompt (draftlab.inference.paired's bootstrap: pooled α_j and τ, one s.e.).
Stages resume: a finished arm (``OUT/<arm>/trained.json``) or report is not run again.
"""

from __future__ import annotations

import argparse
import sys
from datetime import datetime, timezone
from pathlib import Path

from bench.trainer_parity import eval_arm, stage, table, train_draftlab
from draftlab.inference.paired import bootstrap
from draftlab.errors import DraftlabError

# name -> (overrides, the peer default it stands for)
ARMS = {
    "recipe": ([], "draftlab's recipe as shipped (1 TTT step, lm_head trained, AdamW)"),
    "ttt3": (["loss.ttt_steps=3"], "3 TTT steps, weights 0.8^i (SpecForge's weighting, speculators' count)"),
    "ttt3-equal": (["loss.ttt_steps=3", "loss.decay=1.0"], "3 TTT steps of equal weight (speculators)"),
    "frozen-head": (["drafter.freeze_lm_head=true"], "lm_head copied from the target and frozen (speculators)"),
    "spec-norms": (["drafter.norm_before_fc=true", "drafter.norm_before_residual=true", "drafter.norm_output=true"],
                   "speculators' eagle3 architecture: norm_before_fc, norm_before_residual, norm_output"),
    "batch-8k": (["train.batch_tokens=8192"], "8192-token batches (speculators' packed rows), 4x fewer steps"),
}


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m bench.ablations", description=__doc__.splitlines()[0])
    p.add_argument("--capture", required=True, help="a `draftlab capture` of the recipe's data section (its train split)")
    p.add_argument("--out", default="runs/ablate")
    p.add_argument("--recipe", default="recipes/smollm2-135m-eagle3.yaml")
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {', '.join(ARMS)}")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--no-append", action="store_true", help="print the table; leave BENCHMARKS.md as it is")
    p.add_argument("overrides", nargs="*", help="recipe overrides (dotted.key=value) for every arm")
    args = p.parse_args(argv)
    args.arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    bad = [a for a in args.arms if a not in ARMS]
    if bad:
        p.error(f"--arms: unknown {bad} (choose from {', '.join(ARMS)})")
    if "recipe" not in args.arms:
        args.arms.insert(0, "recipe")  # the arm every other is paired with
    if args.num_prompts < 2 or args.k < 1 or args.max_new_tokens < 1:
        p.error("--num-prompts must be >= 2, --k and --max-new-tokens >= 1")
    return args


def run(argv, args) -> int:
    from draftlab.recipe import load_recipe

    if not (Path(args.capture) / "manifest.json").is_file():
        raise DraftlabError(f"--capture {args.capture}: no capture there (make one with `draftlab capture`)")
    started = datetime.now(timezone.utc)
    out = Path(args.out)
    common = [*args.overrides, "capture.mode=offline", f"capture.offline_dir={args.capture}", "eval.enabled=false"]
    target = load_recipe(args.recipe, common).target.model  # checks the recipe and overrides before any run
    trained, reports = {}, {}
    for arm in args.arms:
        where = out / arm
        trained[arm] = stage(where, "trained", lambda: train_draftlab(args.recipe, common + ARMS[arm][0], where))
        reports[arm] = eval_arm(args.recipe, target, trained[arm]["checkpoint"], where, args)
    stats = bootstrap(reports, args.k, base="recipe")
    text = table(stats, trained, args.k, base="recipe")
    legend = "\n".join(f"- `{a}`: {ARMS[a][1]}" + (f" (`{' '.join(ARMS[a][0])}`)" if ARMS[a][0] else "") for a in args.arms)
    print(text + "\n\n" + legend)
    if not args.no_append:
        from bench.sections import append_run

        append_run("Ablations of the EAGLE-3 recipe at equal tokens", started, "bench.ablations", argv,
                   f"{args.num_prompts} held-out ShareGPT prompts × {args.max_new_tokens} tokens, chain k={args.k}, greedy; "
                   f"every arm from one offline capture; ± one bootstrap s.e. over prompts, paired with `recipe`.\n\n"
                   f"{text}\n\n{legend}\n")
    return 0


def main(argv=None) -> int:
    from bench.runs import main_with_errors

    return main_with_errors("bench.ablations", parse_args, run, argv)


if __name__ == "__main__":
    sys.exit(main())
