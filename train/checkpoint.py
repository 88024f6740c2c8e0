"""The one checkpoint writer and reader. Resume, eval, export and import all go through here.

A checkpoint is a directory::

    model.safetensors     drafter weights (frozen target-owned tensors excluded)
    draftlab.json         format, algorithm, drafter meta, target identity, recipe, step, metrics
    trainer/optimizer.pt  optimizer + scheduler state (torch.save; read with weights_only=True);
                          under FSDP the full optimizer state keyed by parameter name
    trainer/optimizer-rank{r}.pt  instead, under DeepSpeed ZeRO: rank r's optimizer partition
                          (moments + fp32 master weights) + scheduler state
    trainer/state.json    step, elapsed time, world size, optimizer layout (torch | fsdp | zero-N)
    trainer/rng-rank{r}.json  RNG states of rank r

written to a temporary sibling and renamed into place, so a kill never leaves half a checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from draftlab.errors import DraftlabError

FORMAT = "draftlab-checkpoint/1"
META = "draftlab.json"
WEIGHTS = "model.safetensors"


def write_json(path: Path, obj) -> None:
    """Atomic JSON write (temp file in the same directory, then rename)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        json.dump(obj, f, indent=2)
    os.replace(tmp, path)


def staging_dir(final: Path) -> Path:
    final.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(dir=final.parent, prefix=f".tmp-{final.name}-"))


def publish(tmp: Path, final: Path) -> None:
    """Rename a finished staging directory into place (replacing an older one)."""
    if final.exists():
        old = final.with_name(f".old-{final.name}")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)


def save_weights(tmp: Path, state: dict, meta: dict) -> None:
    """``state``: the drafter's full (gathered) state dict; ``meta`` from :func:`checkpoint_meta`."""
    state = {k: v.detach().contiguous().cpu() for k, v in state.items()}
    save_file(state, tmp / WEIGHTS, metadata={"format": FORMAT, "algorithm": meta["algorithm"]})
    write_json(tmp / META, {"format": FORMAT, **meta})


def checkpoint_meta(drafter, target_identity: dict, recipe: dict | None, step: int, metrics: dict | None = None) -> dict:
    return {
        "algorithm": drafter.algorithm,
        "drafter": drafter.meta(),
        "target": target_identity,
        "recipe": recipe,
        "step": step,
        "metrics": metrics or {},
    }


def read_meta(path: str | Path) -> dict:
    path = Path(path)
    f = path / META
    if not f.is_file():
        raise DraftlabError(f"not a draftlab checkpoint (no {META}): {path}")
    try:
        meta = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise DraftlabError(f"{f}: invalid JSON ({e.msg})") from None
    if meta.get("format") != FORMAT:
        raise DraftlabError(f"{f}: unsupported checkpoint format {meta.get('format')!r} (expected {FORMAT})")
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


def load_drafter(path: str | Path, target, dtype: torch.dtype | None = None):
    """Rebuild a drafter from a checkpoint for ``target`` (which must match the one it was trained on), in
    ``dtype`` (default: the target's; resume asks for float32 so fp32 master weights survive a bf16 target)."""
    from draftlab.models.drafter import get_algorithm

    path = Path(path)
    meta = read_meta(path)
    check_target(meta, target, str(path))
    drafter = get_algorithm(meta["algorithm"]).from_meta(meta["drafter"], target)
    state = load_file(path / WEIGHTS, device=str(target.device))
    missing, unexpected = drafter.load_state_dict(state, strict=False)
    # The rotary buffers are derived, not stored; anything else missing is an error.
    missing = [k for k in missing if not k.startswith("rotary.")]
    if missing or unexpected:
        raise DraftlabError(f"{path / WEIGHTS}: weights do not match the drafter (missing {missing[:3]}, unexpected {unexpected[:3]})")
    return drafter.to(dtype or target.dtype).eval(), meta


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    d = Path(run_dir) / "checkpoints"
    if not d.is_dir():
        return []
    return sorted(p for p in d.glob("step-*") if (p / META).is_file())


def step_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step-{step:07d}"


# ---------------------------------------------------------------- DeepSpeed ZeRO optimizer state
def _zero_state_file(trainer_dir: Path, rank: int) -> Path:
    return Path(trainer_dir) / f"optimizer-rank{rank}.pt"


def _zero_safe_globals() -> list:
    """The DeepSpeed classes a ZeRO optimizer state dict holds next to its tensors. Allowing exactly
    these keeps ``torch.load`` in weights_only mode: nothing else can be unpickled."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def save_zero_optimizer(trainer_dir: Path, rank: int, zero_optimizer, scheduler) -> None:
    """Every rank calls this with DeepSpeed's ZeRO optimizer (``engine.optimizer``)."""
    torch.save({"optimizer": zero_optimizer.state_dict(), "scheduler": scheduler.state_dict()}, _zero_state_file(trainer_dir, rank))


def load_zero_optimizer(trainer_dir: Path, rank: int, world: int, zero_optimizer, scheduler) -> None:
    """Every rank calls this after the model weights are loaded; same world size and ZeRO stage as saved.
    The fp32 master weights come from the saved partition (for ZeRO-3 they also refill the parameters)."""
    path = _zero_state_file(trainer_dir, rank)
    if not path.is_file():
        raise DraftlabError(f"{path}: missing (this checkpoint was not saved by rank {rank} of a ZeRO run)")
    with torch.serialization.safe_globals(_zero_safe_globals()):
        saved = torch.load(path, weights_only=True, map_location="cpu")
    # Rigid (non-elastic) ZeRO state: each rank reads only its own entry of the per-rank list.
    per_rank = [None] * world
    per_rank[rank] = saved["optimizer"]
    # The same bracket DeepSpeed's engine.load_checkpoint puts around this call (ZeRO-3: partition all
    # parameters first, then re-gather the persistent small ones from the restored partitions).
    if hasattr(zero_optimizer, "checkpoint_event_prologue"):
        zero_optimizer.checkpoint_event_prologue()
    zero_optimizer.load_state_dict(per_rank, load_optimizer_states=True, load_from_fp32_weights=True)
    if hasattr(zero_optimizer, "checkpoint_event_epilogue"):
        zero_optimizer.checkpoint_event_epilogue()
    scheduler.load_state_dict(saved["scheduler"])
