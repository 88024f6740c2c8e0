"""The checkpoint a recipe's drafter starts training from, for measuring what training adds.

    python -m bench.untrained RECIPE OUT_DIR [dotted.key=value ...]
    draftlab eval --drafter OUT_DIR --data sharegpt-heldout --recipe RECIPE [dotted.key=value ...]

Builds the recipe's drafter exactly as ``train`` does before its first step (the same seed,
data and ``Drafter.build``: a draft LM initialised from the target is the truncated target) and
writes it as a step-0 checkpoint through the checkpoint writer, so every evaluation tool reads it
as it reads a trained one.
"""

from __future__ import annotations

import sys
from pathlib import Path

from bench.runs import main_with_errors


def parse_args(argv):
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("recipe")
    p.add_argument("out")
    p.add_argument("overrides", nargs="*", metavar="dotted.key=value")
    return p.parse_args(argv)


def run(argv, args) -> int:
    from draftlab import atomic
    from draftlab import checkpoint as ckpt
    from draftlab.data.dataset import build_samples
    from draftlab.models.target import Target
    from draftlab.recipe import load_recipe
    from draftlab.train.rng import seed_everything

    recipe = load_recipe(args.recipe, args.overrides)
    algo, drafter_cfg, _ = recipe.algorithm_configs()
    seed_everything(recipe.seed)
    target = Target.load(recipe.target.model, recipe.target.dtype, "cpu" if recipe.target.device == "auto" else recipe.target.device,
                         recipe.target.trust_remote_code)
    samples = build_samples(recipe.data, target.tokenizer)
    drafter = algo.build(drafter_cfg, target, samples.train).float()
    meta = ckpt.checkpoint_meta(drafter, target.identity, recipe.model_dump(mode="json"), 0)
    with atomic.directory(Path(args.out)) as tmp:
        ckpt.save_weights(tmp, drafter.state_dict(), meta, where=args.out)
    print(f"wrote the untrained {recipe.algorithm} drafter of {args.recipe} to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main_with_errors("bench.untrained", parse_args, run))
