"""What the benchmarks read from a training run: its checkpoint, the recipe it was trained
with, the target that recipe names and the recipe's held-out samples. Every check runs before
a model loads and fails with a one-line DraftlabError, which :func:`main_with_errors` prints."""

from __future__ import annotations

import sys
from pathlib import Path

from draftlab.errors import DraftlabError


def checkpoint_of(path: Path) -> Path:
    """``path`` itself when it is a checkpoint, else a run directory's ``checkpoints/best``
    (else its last ``step-*``)."""
    from draftlab.checkpoint import META, list_checkpoints

    if not path.is_dir():
        raise DraftlabError(f"{path}: no such run or checkpoint directory")
    if (path / META).is_file():
        return path
    best = path / "checkpoints" / "best"
    if (best / META).is_file():
        return best
    found = list_checkpoints(path)
    if not found:
        raise DraftlabError(f"{path}: no checkpoint (checkpoints/best or checkpoints/step-*)")
    return found[-1]


def recipe_of(ckpt: Path, meta: dict):
    """The recipe a checkpoint was trained with (``draftlab.json``'s ``recipe``)."""
    from draftlab.recipe import Recipe

    if not isinstance(meta.get("recipe"), dict):
        raise DraftlabError(f"{ckpt}: the checkpoint carries no recipe (not written by a recipe run)")
    try:
        return Recipe.model_validate(meta["recipe"])
    except Exception as e:  # pydantic ValidationError: its first line is enough
        raise DraftlabError(f"{ckpt}: the checkpoint's recipe does not validate ({str(e).splitlines()[0]})") from None


_TARGETS: dict = {}


def target_of(recipe):
    """The target the recipe names (e.g. 'default'), loaded once per process."""
    import torch

    from draftlab.models.target import Target

    t = recipe.target
    device = t.device if t.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    key = (t.model, t.dtype, device, t.trust_remote_code)
    if key not in _TARGETS:
        _TARGETS[key] = Target.load(t.model, t.dtype, device, t.trust_remote_code)
    return _TARGETS[key]


def heldout_of(recipe, run: Path | None, target, where) -> list:
    """The recipe's held-out samples (with ``data.regenerate``, from the run's own regenerated
    conversations when they are there)."""
    from draftlab.data.dataset import build_samples

    spec = recipe.data
    regen = next((p for p in ([run / "regenerated.jsonl"] if run else []) + [Path(recipe.output_dir) / "regenerated.jsonl"]
                  if p.is_file()), None)
    samples = build_samples(spec, target.tokenizer, target=target if spec.regenerate else None, regenerate_path=regen)
    if not samples.heldout:
        raise DraftlabError(f"{where}: the recipe's data split holds no held-out samples (data.heldout = 0)")
    return samples.heldout


def main_with_errors(module: str, parse_args, run, argv=None) -> int:
    """``run(argv, parse_args(argv))``; a DraftlabError becomes one line on stderr (``module: error:
    ...``, the bench module that ran) and exit 2."""
    from draftlab.errors import DraftlabError

    try:
        return run(argv, parse_args(argv))
    except DraftlabError as e:
        print(f"{module}: error: {e}", file=sys.stderr)
        return 2
