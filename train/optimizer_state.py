"""Optimizer state of DeepSpeed ZeRO runs, one file per rank inside a checkpoint's ``trainer/``.

``trainer/optimizer-rank{r}.pt`` holds rank r's optimizer partition (moments + fp32 master
weights) and the scheduler state, read back with ``torch.load(weights_only=True)``: only the
few DeepSpeed classes listed below may be unpickled.
"""

from __future__ import annotations

from pathlib import Path

import torch

from draftlab.errors import DraftlabError


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
