"""Train an EAGLE-1 or EAGLE-3 drafter from a recipe.

    accelerate launch train/eagle.py recipes/smollm2-135m-eagle3.yaml [dotted.key=value ...]
    draftlab train recipes/smollm2-135m-eagle3.yaml [dotted.key=value ...]

Parse recipe -> load target -> build samples -> build drafter -> Trainer.run(); after each
checkpoint an acceptance evaluation (real speculative decoding on held-out prompts) runs.
Relaunching the same command resumes from the last checkpoint in ``output_dir``.
"""

from __future__ import annotations

import argparse
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", help="recipe YAML (see recipes/)")
    p.add_argument("overrides", nargs="*", help="dotted.key=value overrides, e.g. train.max_steps=20")


def run(args) -> int:
    from draftlab.train.launch import train_from_recipe

    train_from_recipe(args.recipe, args.overrides, algorithms=("eagle1", "eagle3"))
    return 0


def main(argv=None) -> int:
    from draftlab.errors import DraftlabError

    parser = argparse.ArgumentParser(prog="train/eagle.py", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except DraftlabError as e:
        print(f"train/eagle.py: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    from draftlab.train.launch import exit_process

    exit_process(main())
