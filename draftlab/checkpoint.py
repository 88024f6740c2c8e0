"""The draftlab checkpoint format: the one writer and reader of drafter weights and metadata.

Training, resume, evaluation, export and import all read and write drafters through here, so
none of them imports the trainer. A checkpoint is a directory::

    model.safetensors     drafter weights (frozen target-owned tensors excluded)
    draftlab.json         format, algorithm, drafter meta, target identity, recipe, step, metrics, precision
    trainer/              optimizer and scheduler (``train/optimizer_state.py``), RNG per rank,
                          state.json (step, run facts: :func:`read_state`)

written to a temporary sibling and renamed into place (``draftlab.atomic``), so a kill never
leaves half a checkpoint.

:func:`check_drafter` is the one validation of what a checkpoint says about its drafter: the
family's metadata schema (``Drafter.Meta``, checked against the target) and the tensor-valued
metadata among the weights (``Drafter.check_state``: vocabulary maps). The writer applies it
before writing, the reader before building anything, and import and export before writing their
output: a checkpoint it refuses is never written, and one it accepts builds a drafter that decodes.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save

from draftlab.atomic import write_bytes, write_json
from draftlab.errors import DraftlabError

FORMAT = "draftlab-checkpoint/1"
META = "draftlab.json"
WEIGHTS = "model.safetensors"
STATE = "state.json"  # in trainer/: where a resumed run goes on from


def check_drafter(algorithm: str, drafter_meta, target, where, state: dict | None = None, state_where=None):
    """``(family, validated drafter meta)`` for the ``algorithm`` family's ``drafter_meta`` next
    to ``target`` (a ``Target``, ``TargetFacts`` or target identity), checking the tensor-valued
    metadata among the weights ``state`` too when given. Every refusal is one DraftlabError line
    naming ``where`` (``state_where`` for the weights) and the field."""
    from draftlab.models.drafter import DRAFTERS

    family = DRAFTERS.get(algorithm, f"{where}: algorithm")
    meta = family.check_meta(drafter_meta, target, str(where))
    if state is not None:
        family.check_state(meta, state, target, str(state_where or where))
    return family, meta


def save_weights(tmp: Path, state: dict, meta: dict, where=None) -> None:
    """``state``: the drafter's full (gathered) state dict; ``meta`` from :func:`checkpoint_meta`.
    Refused (nothing written) unless :func:`check_drafter` accepts them for the target ``meta``
    names; ``where`` names the checkpoint in that error (default: the staging directory)."""
    where = where or tmp
    check_drafter(meta["algorithm"], meta["drafter"], meta["target"], f"{where}/{META}", state, f"{where}/{WEIGHTS}")
    state = {k: v.detach().contiguous().cpu() for k, v in state.items()}
    write_bytes(tmp / WEIGHTS, save(state, metadata={"format": FORMAT, "algorithm": meta["algorithm"]}))
    write_json(tmp / META, {"format": FORMAT, **meta})


def checkpoint_meta(drafter, target_identity: dict, recipe: dict | None, step: int, metrics: dict | None = None,
                    precision: dict | None = None) -> dict:
    """``precision``: what training resolved ``train.precision`` to (``train.backends.precision``), when trained."""
    return {
        "algorithm": drafter.algorithm,
        "drafter": drafter.meta(),
        "target": target_identity,
        "recipe": recipe,
        "step": step,
        "metrics": metrics or {},
        **({"precision": precision} if precision is not None else {}),
    }


REQUIRED = ("algorithm", "drafter", "target")


def read_json(f: Path) -> dict:
    """A JSON object from ``f``; a missing, unreadable or non-object file is a one-line error."""
    if not f.is_file():
        raise DraftlabError(f"{f}: missing")
    try:
        obj = json.loads(f.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DraftlabError(f"{f}: invalid JSON ({getattr(e, 'msg', e)})") from None
    if not isinstance(obj, dict):
        raise DraftlabError(f"{f}: expected a JSON object, got {type(obj).__name__}")
    return obj


def read_meta(path: str | Path) -> dict:
    path = Path(path)
    f = path / META
    if not f.is_file():
        raise DraftlabError(f"not a draftlab checkpoint (no {META}): {path}")
    meta = read_json(f)
    if meta.get("format") != FORMAT:
        raise DraftlabError(f"{f}: unsupported checkpoint format {meta.get('format')!r} (expected {FORMAT})")
    for key in REQUIRED:
        if not isinstance(meta.get(key), (str if key == "algorithm" else dict)):
            raise DraftlabError(f"{f}: field '{key}' is missing or malformed")
    return meta


def check_target(meta: dict, target, where: str) -> None:
    """Refuse a checkpoint trained for another target (different shape or vocabulary)."""
    want = meta["target"]
    have = target.identity
    keys = ("model_type", "num_hidden_layers", "hidden_size", "vocab_size")
    diff = [k for k in keys if want.get(k) != have.get(k)]
    if diff:
        k = diff[0]
        raise DraftlabError(
            f"{where} was trained for target '{want.get('name')}' ({k}={want.get(k)}), "
            f"not '{have.get('name')}' ({k}={have.get(k)})"
        )


def read_weights(path: Path, device="cpu") -> dict[str, torch.Tensor]:
    """A safetensors file's tensors; a missing, truncated or corrupt file is a one-line error."""
    if not Path(path).is_file():
        raise DraftlabError(f"{path}: missing")
    try:
        return load_file(path, device=str(device))
    except (SafetensorError, OSError, ValueError) as e:
        raise DraftlabError(f"{path}: not a readable safetensors file ({str(e).splitlines()[0]})") from None


def load_state_exactly(module: torch.nn.Module, state: dict[str, torch.Tensor], where, derived: tuple[str, ...] = ()) -> None:
    """Load ``state`` into ``module``: every key present (except ``derived`` prefixes), none
    unknown, each of the module's shape and kind (float / integer / bool); else a one-line
    error naming ``where`` and the first offending tensors."""
    own = module.state_dict()
    missing = [k for k in own if k not in state and not k.startswith(derived)]
    unexpected = [k for k in state if k not in own]
    if missing or unexpected:
        raise DraftlabError(f"{where}: weights do not match the drafter (missing {missing[:3]}, unexpected {unexpected[:3]})")

    def kind(t):
        return "float" if t.is_floating_point() else "bool" if t.dtype == torch.bool else "integer"

    wrong = [f"{k} {tuple(v.shape)} {v.dtype}, expected {tuple(own[k].shape)} {own[k].dtype}"
             for k, v in state.items() if v.shape != own[k].shape or kind(v) != kind(own[k])]
    if wrong:
        raise DraftlabError(f"{where}: tensor {wrong[0]}" + (f" (+{len(wrong) - 1} more)" if len(wrong) > 1 else ""))
    module.load_state_dict(state, strict=False)


def load_drafter(path: str | Path, target, dtype: torch.dtype | None = None):
    """Rebuild a drafter from a checkpoint for ``target`` (which must match the one it was trained on), in
    ``dtype`` (default: the target's; resume asks for float32 so fp32 master weights survive a bf16 target).
    Evaluation, decoding, resume and export all load through here."""
    from pydantic import ValidationError

    path = Path(path)
    meta = read_meta(path)
    check_target(meta, target, str(path))
    state = read_weights(path / WEIGHTS, target.device)
    family, dmeta = check_drafter(meta["algorithm"], meta["drafter"], target, path / META, state, path / WEIGHTS)
    try:
        drafter = family.from_meta(dmeta, target)
    except (KeyError, TypeError, ValueError, ValidationError) as e:  # what the schema cannot see (a RoPE spec HF refuses)
        raise DraftlabError(f"{path / META}: drafter meta is malformed ({str(e).splitlines()[0]})") from None
    load_state_exactly(drafter, state, path / WEIGHTS, family.derived_keys)
    return drafter.to(dtype or target.dtype).eval(), meta


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    d = Path(run_dir) / "checkpoints"
    if not d.is_dir():
        return []
    return sorted(p for p in d.glob("step-*") if (p / META).is_file())


def step_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step-{step:07d}"


# state.json fields: name -> (accepted types, required); bool is no number here
_STATE_FIELDS = {
    "step": ((int,), True),
    "elapsed_s": ((int, float), True),
    "world_size": ((int,), True),
    "fingerprint": ((str,), True),
    "optimizer_layout": ((str,), False),  # absent in checkpoints from before DeepSpeed/FSDP support: torch
    "best_tau": ((int, float, type(None)), False),
    "precision": ((str,), False),  # absent in checkpoints from before train.precision: not checked
    "skipped_nonfinite": ((int,), False),  # absent in checkpoints from before train.skip_nonfinite: none skipped
}


def read_state(path: Path) -> dict:
    """A checkpoint's ``trainer/state.json``, every field of its type (a one-line error naming the file)."""
    state = read_json(path)
    for name, (types, required) in _STATE_FIELDS.items():
        if name not in state:
            if required:
                raise DraftlabError(f"{path}: field '{name}' is missing (not a draftlab trainer state)")
            continue
        v = state[name]
        if isinstance(v, bool) or not isinstance(v, types) or (isinstance(v, float) and not math.isfinite(v)):
            want = " or ".join("null" if t is type(None) else {"int": "an integer", "float": "a number", "str": "a string"}[t.__name__]
                               for t in types)
            raise DraftlabError(f"{path}: field '{name}' must be {want}, got {json.dumps(v)[:40]}")
    for name in ("step", "elapsed_s", "skipped_nonfinite"):
        if state.get(name, 0) < 0:
            raise DraftlabError(f"{path}: field '{name}' must not be negative, got {state[name]}")
    if state["world_size"] < 1:
        raise DraftlabError(f"{path}: field 'world_size' must be at least 1, got {state['world_size']}")
    if state.get("precision", "fp32") not in ("fp32", "bf16"):
        raise DraftlabError(f"{path}: field 'precision' must be \"fp32\" or \"bf16\", got {json.dumps(state['precision'])[:40]}")
    return state
