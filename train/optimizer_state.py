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

Every file also holds the scheduler state. Files are written through :mod:`draftlab.atomic` and
read back with ``weights_only=True``; a file that is missing, refused, corrupt or of another
drafter is a one-line DraftlabError naming it.
"""

from __future__ import annotations

import io
import math
from pathlib import Path

import torch
from accelerate.utils import DistributedType

from draftlab.atomic import write_bytes
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
            save_state(state, Path(trainer_dir) / "optimizer.pt")

    def load(self, trainer_dir: Path, weights: dict, saved: dict) -> None:
        """Every rank calls this with the checkpoint's full ``weights`` and its ``state.json`` (``saved``):
        the weights go into the model (where depends on the layout), then the optimizer and scheduler state.
        ``_load`` (per layout) loads the weights and the optimizer and returns the file it read and the
        scheduler's state."""
        layout = saved.get("optimizer_layout", "torch")  # checkpoints from before DeepSpeed/FSDP support: torch
        world = self.accelerator.num_processes
        if layout != self.layout or (self.same_world and saved["world_size"] != world):
            raise DraftlabError(
                f"{Path(trainer_dir).parent}: optimizer state was saved as '{layout}' by {saved['world_size']} process(es) "
                f"but this run uses '{self.layout}' on {world}; relaunch the same way or use a new output_dir"
            )
        path, scheduler = self._load(Path(trainer_dir), weights)
        _load_scheduler(self.scheduler, scheduler, path)

    def _read(self, trainer_dir: Path) -> tuple[Path, dict]:
        """``optimizer.pt`` of the torch layouts (torch and FSDP: a torch optimizer state dict), checked."""
        path = Path(trainer_dir) / "optimizer.pt"
        state = read_state(path)
        _check_torch_state(state["optimizer"], self.optimizer.param_groups, path)
        return path, state


class Replicated(OptimizerState):
    layout = "torch"

    def _optimizer_state(self) -> dict:
        return self.optimizer.state_dict()

    def _load(self, trainer_dir: Path, weights: dict) -> tuple[Path, dict]:
        self.accelerator.unwrap_model(self.model).load_state_dict(weights)
        path, state = self._read(trainer_dir)
        with _loading(path):
            self.optimizer.load_state_dict(state["optimizer"])
        _check_moments(self.optimizer, path)
        return path, state["scheduler"]


class FSDPFull(OptimizerState):
    layout = "fsdp"
    replicated = False

    def _optimizer_state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(self.model, self.optimizer.optimizer, options=_full_state())

    def _load(self, trainer_dir: Path, weights: dict) -> tuple[Path, dict]:
        """Every rank takes its shards of the full weights and optimizer state."""
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        set_model_state_dict(self.model, weights, options=_full_state())
        path, state = self._read(trainer_dir)
        with _loading(path):
            set_optimizer_state_dict(self.model, self.optimizer.optimizer, state["optimizer"], options=_full_state())
        return path, state["scheduler"]


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
        save_state(state, _zero_state_file(trainer_dir, self.rank))

    def _load(self, trainer_dir: Path, weights: dict) -> tuple[Path, dict]:
        module = self.accelerator.unwrap_model(self.model)
        if self.replicated:  # the replicated parameters the next forward uses; the master copies come from the ZeRO state
            module.load_state_dict(weights)
        else:  # ZeRO-3: partitioned parameters come back from the fp32 master partitions below
            params = {name for name, _ in module.named_parameters()}
            module.load_state_dict({k: v for k, v in weights.items() if k not in params}, strict=False)
        path = _zero_state_file(trainer_dir, self.rank)
        if not path.is_file():
            raise DraftlabError(f"{path}: missing (this checkpoint was not saved by rank {self.rank} of a ZeRO run)")
        saved = read_state(path, _zero_safe_globals())
        # Rigid (non-elastic) ZeRO state: each rank reads only its own entry of the per-rank list.
        per_rank = [None] * self.accelerator.num_processes
        per_rank[self.rank] = saved["optimizer"]
        zero = self.model.optimizer
        # The same bracket DeepSpeed's engine.load_checkpoint puts around this call (ZeRO-3: partition all
        # parameters first, then re-gather the persistent small ones from the restored partitions).
        if hasattr(zero, "checkpoint_event_prologue"):
            zero.checkpoint_event_prologue()
        with _loading(path):
            zero.load_state_dict(per_rank, load_optimizer_states=True, load_from_fp32_weights=True)
        if hasattr(zero, "checkpoint_event_epilogue"):
            zero.checkpoint_event_epilogue()
        return path, saved["scheduler"]


def _zero_state_file(trainer_dir: Path, rank: int) -> Path:
    return Path(trainer_dir) / f"optimizer-rank{rank}.pt"


def _zero_safe_globals() -> list:
    """The DeepSpeed classes a ZeRO optimizer state dict holds next to its tensors. Allowing exactly
    these keeps ``torch.load`` in weights_only mode: nothing else can be unpickled."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


# ------------------------------------------------------------------ files
def save_state(state: dict, path: Path) -> None:
    """``torch.save`` of ``state`` into ``path`` through the one atomic write."""
    buf = io.BytesIO()
    torch.save(state, buf)
    with buf.getbuffer() as data:
        write_bytes(path, data)


def _first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0][:200]


def _weights_only_detail(text: str) -> str | None:
    """The line of a ``weights_only`` refusal that says what was refused (torch wraps it in advice)."""
    if not text.startswith("Weights only load failed"):
        return None
    for line in text.splitlines()[1:]:
        line = line.replace("WeightsUnpickler error:", "").strip()
        if line and not line.startswith(("Please file an issue", "Check the documentation", "Re-running")):
            return line[:200]
    return None


def read_state(path: Path, safe_globals: list | tuple = ()) -> dict:
    """An optimizer file: ``{"optimizer": dict, "scheduler": dict}`` read with ``weights_only=True``
    (only tensors, plain containers and ``safe_globals`` unpickle)."""
    path = Path(path)
    if not path.is_file():
        raise DraftlabError(f"{path}: missing (the checkpoint has no optimizer state)")
    try:
        with torch.serialization.safe_globals(list(safe_globals)):
            state = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as e:  # noqa: BLE001 - whatever a damaged or hostile file raises, it is this file's fault
        detail = _weights_only_detail(str(e))
        if detail and "GLOBAL" in detail:
            raise DraftlabError(f"{path}: refused by torch.load(weights_only=True): {detail} (the file holds code to run, "
                                "not only tensors: draftlab never writes one; do not load it)") from None
        raise DraftlabError(f"{path}: not a readable optimizer state ({detail or _first_line(e)})") from None
    if not isinstance(state, dict) or not isinstance(state.get("optimizer"), dict) or not isinstance(state.get("scheduler"), dict):
        got = sorted(map(str, state)) if isinstance(state, dict) else type(state).__name__
        raise DraftlabError(f"{path}: not an optimizer state (expected a dict of 'optimizer' and 'scheduler' state, got {got})")
    return state


class _loading:
    """Errors of an optimizer's ``load_state_dict`` as a one-line DraftlabError naming the file."""

    def __init__(self, path: Path):
        self.path = path

    def __enter__(self):
        return self

    def __exit__(self, kind, e, tb):
        if isinstance(e, (KeyError, TypeError, ValueError, IndexError, RuntimeError, AttributeError)):
            raise DraftlabError(f"{self.path}: optimizer state does not fit this drafter ({_first_line(e)})") from None
        return False


def _check_torch_state(saved: dict, groups: list[dict], path: Path) -> None:
    """What ``load_state_dict`` takes as it is and the next step trips over, or trains on without a
    word: each param group's hyperparameters of the kind this run's optimizer (``groups``) holds,
    numbers finite and not negative; every floating tensor of the per-parameter state finite."""
    saved_groups = saved.get("param_groups")
    if not isinstance(saved_groups, list) or len(saved_groups) != len(groups) or not all(isinstance(g, dict) for g in saved_groups):
        raise DraftlabError(f"{path}: optimizer state does not fit this drafter (expected {len(groups)} param group(s))")
    for i, (group, own) in enumerate(zip(saved_groups, groups)):
        for key, want in own.items():
            if key != "params" and key in group and not _same_kind(group[key], want):
                shown = repr(group[key])[:40]
                raise DraftlabError(f"{path}: optimizer param_groups[{i}].{key} = {shown} is not {_kind(want)}")
    state = saved.get("state")
    for param, moments in (state.items() if isinstance(state, dict) else ()):
        for name, v in (moments.items() if isinstance(moments, dict) else ()):
            if isinstance(v, torch.Tensor) and v.is_floating_point() and not bool(torch.isfinite(v).all()):
                raise DraftlabError(f"{path}: optimizer state '{name}' of parameter {param} holds NaN or infinite values "
                                    "(the run diverged before this checkpoint): resume from an earlier one")


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0


def _same_kind(v, want) -> bool:
    if want is None:  # a flag the optimizer picks itself (foreach)
        return v is None or isinstance(v, bool)
    if isinstance(want, bool):
        return isinstance(v, bool)
    if isinstance(want, (int, float)):
        return _number(v)
    if isinstance(want, (tuple, list)):
        return isinstance(v, (tuple, list)) and len(v) == len(want) and all(_number(x) for x in v)
    return True  # a kind torch added later: its own load checks it


def _kind(want) -> str:
    if isinstance(want, bool) or want is None:
        return "true or false" + (" or null" if want is None else "")
    if isinstance(want, (tuple, list)):
        return f"a list of {len(want)} finite numbers >= 0"
    return "a finite number >= 0"


def _check_moments(optimizer, path: Path) -> None:
    """Every per-parameter tensor of the loaded state (AdamW moments) has its parameter's shape."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            for name, v in optimizer.state.get(p, {}).items():
                if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape != p.shape:
                    raise DraftlabError(f"{path}: optimizer state '{name}' of shape {tuple(v.shape)} for a parameter of shape "
                                        f"{tuple(p.shape)} (saved for another drafter)")
                if name != "step" and not isinstance(v, torch.Tensor):
                    raise DraftlabError(f"{path}: optimizer state '{name}' is a {type(v).__name__}, not a tensor")


def _load_scheduler(scheduler, saved: dict, path: Path) -> None:
    """The learning-rate schedule's position; its fields checked against this run's scheduler."""
    own = scheduler.state_dict()
    missing = [k for k in ("last_epoch", "base_lrs", "lr_lambdas") if k in own and k not in saved]
    if missing:
        raise DraftlabError(f"{path}: scheduler state lacks {missing[:3]}")
    for k in ("last_epoch", "_step_count"):
        v = saved.get(k)
        if k in own and (isinstance(v, bool) or not isinstance(v, int)):
            raise DraftlabError(f"{path}: scheduler field '{k}' must be an integer, got {type(v).__name__}")
    for k in ("base_lrs", "_last_lr"):
        v = saved.get(k)
        if k in own and (not isinstance(v, list) or len(v) != len(own[k])
                         or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v)):
            raise DraftlabError(f"{path}: scheduler field '{k}' must be a list of {len(own[k])} number(s)")
    with _loading(path):
        scheduler.load_state_dict(dict(saved))
