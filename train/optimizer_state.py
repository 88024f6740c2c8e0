"""Optimizer and scheduler state in a checkpoint's ``trainer/`` folder, one layout per back end.

The trainer calls :func:`for_run` once, then ``save`` and ``load`` on what it returns; only this
module knows the layouts (named in ``state.json``'s ``optimizer_layout``):

- ``torch``: ``optimizer.pt``, the state dict of the one optimizer every rank replicates
  (single process, DDP);
- ``fsdp``: ``optimizer.pt``, the full state keyed by parameter name, gathered from the FSDP2
  shards, so it loads into any number of processes;
- ``zero-N``: ``optimizer-rank{r}.pt``, rank r's DeepSpeed ZeRO partition (moments + fp32 master
  weights): only the same stage and world size can resume it. Read back with
  ``torch.load(weights_only=True)``: only the few DeepSpeed classes listed below may be unpickled.

Every file also holds the scheduler state.
"""

from __future__ import annotations

from pathlib import Path

import torch
from accelerate.utils import DistributedType

from draftlab.errors import DraftlabError
from draftlab.train.backends import zero_stage


def for_run(accelerator, model, optimizer, scheduler) -> "OptimizerState":
    """The layout of this run's prepared ``model`` and ``optimizer``."""
    stage = zero_stage(accelerator)
    if stage is not None:
        return ZeroPerRank(accelerator, model, optimizer, scheduler, stage)
    if accelerator.distributed_type == DistributedType.FSDP:
        return FSDPFull(accelerator, model, optimizer, scheduler)
    return Replicated(accelerator, model, optimizer, scheduler)


class OptimizerState:
    """One run's optimizer and scheduler state, into a checkpoint's ``trainer/`` folder and back; the
    subclasses are the layouts."""

    layout = ""
    replicated = True  # every rank holds whole weights (FSDP and ZeRO-3 hold shards)
    same_world = False  # resuming needs the world size that saved

    def __init__(self, accelerator, model, optimizer, scheduler):
        self.accelerator, self.model, self.optimizer, self.scheduler = accelerator, model, optimizer, scheduler

    def save(self, trainer_dir: Path) -> None:
        """Every rank calls this (the gathers are collective); the main process writes ``optimizer.pt``."""
        state = {"optimizer": self._optimizer_state(), "scheduler": self.scheduler.state_dict()}
        if self.accelerator.is_main_process:
            torch.save(state, Path(trainer_dir) / "optimizer.pt")

    def load(self, trainer_dir: Path, weights: dict, saved: dict) -> None:
        """Every rank calls this with the checkpoint's full ``weights`` and its ``state.json`` (``saved``):
        the weights go into the model (where depends on the layout), then the optimizer and scheduler state.
        ``_load`` (per layout) loads the weights and the optimizer and returns the scheduler's state."""
        layout = saved.get("optimizer_layout", "torch")  # checkpoints from before DeepSpeed/FSDP support: torch
        world = self.accelerator.num_processes
        if layout != self.layout or (self.same_world and saved["world_size"] != world):
            raise DraftlabError(
                f"{Path(trainer_dir).parent}: optimizer state was saved as '{layout}' by {saved['world_size']} process(es) "
                f"but this run uses '{self.layout}' on {world}; relaunch the same way or use a new output_dir"
            )
        self.scheduler.load_state_dict(self._load(Path(trainer_dir), weights))

    def _read(self, trainer_dir: Path) -> dict:
        return torch.load(trainer_dir / "optimizer.pt", weights_only=True, map_location="cpu")


class Replicated(OptimizerState):
    layout = "torch"

    def _optimizer_state(self) -> dict:
        return self.optimizer.state_dict()

    def _load(self, trainer_dir: Path, weights: dict) -> dict:
        self.accelerator.unwrap_model(self.model).load_state_dict(weights)
        state = self._read(trainer_dir)
        self.optimizer.load_state_dict(state["optimizer"])
        return state["scheduler"]


class FSDPFull(OptimizerState):
    layout = "fsdp"
    replicated = False

    def _optimizer_state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(self.model, self.optimizer.optimizer, options=_full_state())

    def _load(self, trainer_dir: Path, weights: dict) -> dict:
        """Every rank takes its shards of the full weights and optimizer state."""
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        set_model_state_dict(self.model, weights, options=_full_state())
        state = self._read(trainer_dir)
        set_optimizer_state_dict(self.model, self.optimizer.optimizer, state["optimizer"], options=_full_state())
        return state["scheduler"]


def _full_state():
    """Full (unsharded) tensors on the CPU: the file loads into any number of processes."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True)


class ZeroPerRank(OptimizerState):
    same_world = True

    def __init__(self, accelerator, model, optimizer, scheduler, stage: int):
        super().__init__(accelerator, model, optimizer, scheduler)
        self.layout, self.replicated = f"zero-{stage}", stage < 3
        self.rank = accelerator.process_index

    def save(self, trainer_dir: Path) -> None:
        """Every rank writes its own partition, from DeepSpeed's ZeRO optimizer (``engine.optimizer``)."""
        state = {"optimizer": self.model.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}
        torch.save(state, _zero_state_file(trainer_dir, self.rank))

    def _load(self, trainer_dir: Path, weights: dict) -> dict:
        module = self.accelerator.unwrap_model(self.model)
        if self.replicated:  # the replicated parameters the next forward uses; the master copies come from the ZeRO state
            module.load_state_dict(weights)
        else:  # ZeRO-3: partitioned parameters come back from the fp32 master partitions below
            params = {name for name, _ in module.named_parameters()}
            module.load_state_dict({k: v for k, v in weights.items() if k not in params}, strict=False)
        path = _zero_state_file(trainer_dir, self.rank)
        if not path.is_file():
            raise DraftlabError(f"{path}: missing (this checkpoint was not saved by rank {self.rank} of a ZeRO run)")
        with torch.serialization.safe_globals(_zero_safe_globals()):
            saved = torch.load(path, weights_only=True, map_location="cpu")
        # Rigid (non-elastic) ZeRO state: each rank reads only its own entry of the per-rank list.
        per_rank = [None] * self.accelerator.num_processes
        per_rank[self.rank] = saved["optimizer"]
        zero = self.model.optimizer
        # The same bracket DeepSpeed's engine.load_checkpoint puts around this call (ZeRO-3: partition all
        # parameters first, then re-gather the persistent small ones from the restored partitions).
        if hasattr(zero, "checkpoint_event_prologue"):
            zero.checkpoint_event_prologue()
        zero.load_state_dict(per_rank, load_optimizer_states=True, load_from_fp32_weights=True)
        if hasattr(zero, "checkpoint_event_epilogue"):
            zero.checkpoint_event_epilogue()
        return saved["scheduler"]


def _zero_state_file(trainer_dir: Path, rank: int) -> Path:
    return Path(trainer_dir) / f"optimizer-rank{rank}.pt"


def _zero_safe_globals() -> list:
    """The DeepSpeed classes a ZeRO optimizer state dict holds next to its tensors. Allowing exactly
    these keeps ``torch.load`` in weights_only mode: nothing else can be unpickled."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]
