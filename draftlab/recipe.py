"""The recipe: one typed object read from YAML plus dotted command-line overrides.

``draftlab train recipes/x.yaml train.max_steps=20 output_dir=runs/x`` — every override is a
``dotted.key=value`` pair whose value is parsed as YAML (so ``20`` is an int, ``[2,15,27]`` a
list). Unknown keys, wrong types and missing files are one-line errors (DraftlabError).
The ``drafter`` and ``loss`` sections are validated by the algorithm's own config classes.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from draftlab.data.dataset import DataSpec
from draftlab.errors import DraftlabError
from draftlab.inference.decoding_spec import DecodingSpec, check_spec, field_names


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TargetSpec(Strict):
    model: str = Field("default", description="HF directory, hub id, .gguf file, or 'default' (embedded SmolLM2-135M)")
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: str = Field("auto", description="'auto' = the accelerator's device, else e.g. 'cpu', 'cuda:0'")
    trust_remote_code: bool = False


class CaptureSpec(Strict):
    mode: Literal["online", "memory", "offline"] = Field(
        "online",
        description="online: target runs in the loop; memory: online in epoch 1, then reused from RAM; "
        "offline: read shards written by `draftlab capture`",
    )
    offline_dir: str | None = None
    group_tokens: int | None = Field(
        None, ge=1,
        description="memory: padded tokens per target forward of the first capture; the groups are the seed's "
        "epoch-0 batches at this budget, the same in every run, so a resumed run recomputes identical features; "
        "default train.batch_tokens (epoch 0's micro-batches themselves)",
    )

    @field_validator("group_tokens")
    @classmethod
    def _group_tokens_for_memory(cls, value, info: ValidationInfo):
        if value is not None and info.data.get("mode") != "memory":
            raise PydanticCustomError("group_tokens", "applies to capture.mode memory only")
        return value


class TrainSpec(Strict):
    lr: float = Field(3e-4, gt=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="cosine decays to lr * min_lr_ratio")
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = Field(0.0, ge=0)
    warmup_steps: int = Field(20, ge=0)
    max_steps: int | None = Field(None, ge=1, description="optimizer steps; default from epochs")
    epochs: float = Field(1.0, gt=0)
    batch_tokens: int = Field(4096, ge=1, description="tokens per micro-batch per process (padded)")
    grad_accum: int = Field(1, ge=1)
    clip_grad_norm: float = Field(0.5, gt=0)
    checkpoint_every: int = Field(100, ge=1)
    keep_last: int = Field(2, ge=1)
    log_every: int = Field(1, ge=1)
    precision: Literal["auto", "fp32", "bf16"] = Field(
        "auto",
        description="auto: bf16 on CUDA, fp32 on CPU (where bf16 matmuls are far slower); bf16: Accelerate's bf16 "
        "autocast, fp32 master weights, TF32 for the fp32 matmuls left on CUDA; fp32: fp32 throughout, no TF32. "
        "The target (capture) runs in target.dtype whatever this says",
    )
    time_limit_minutes: float | None = Field(
        None, gt=0, description="stop (with a checkpoint) once this launch has trained this long; a relaunch resumes "
        "and trains as long again"
    )
    skip_nonfinite: int = Field(
        0, ge=0, description="optimizer steps with a non-finite loss or gradient norm to skip (logged) before the run "
        "stops at the next one; 0: stop at the first"
    )
    preempt_signals: list[str] = Field(
        ["SIGTERM", "SIGUSR1"], description="signals that preempt the run: finish the step, checkpoint, exit 75 (relaunch resumes)"
    )

    @field_validator("preempt_signals")
    @classmethod
    def _catchable_signals(cls, names):
        import signal

        for name in names:
            if name not in signal.Signals.__members__ or name in ("SIGKILL", "SIGSTOP"):
                raise PydanticCustomError("preempt_signals", "{name} is not a signal a process can catch (e.g. SIGTERM, SIGUSR1)",
                                          {"name": repr(name)})
        return names


class EvalSpec(DecodingSpec):
    """The after-checkpoint report: a decoding spec (the same type ``draftlab eval``'s flags
    build, checked by the same :func:`~draftlab.inference.decoding_spec.check_spec`) and the
    prompts it decodes."""

    enabled: bool = True
    data: str = Field("sharegpt-heldout", description="sharegpt-heldout | spec-bench | humaneval | FILE.jsonl")
    num_prompts: int = Field(8, ge=1)
    max_new_tokens: StrictInt = 64

    @model_validator(mode="after")
    def _checked(self):
        """Checked when the recipe is read, not after training (named as the recipe's fields;
        the recipe's ``seed`` is checked where it is the run's)."""
        try:
            check_spec(self, field_names("eval."))
        except DraftlabError as e:
            raise PydanticCustomError("decoding", "{message}", {"message": str(e)}) from None
        return self


class LoggingSpec(Strict):
    tensorboard: bool = False
    wandb: bool = False
    wandb_mode: Literal["offline", "online"] = "offline"
    wandb_project: str = "draftlab"


class Recipe(Strict):
    algorithm: str
    output_dir: str
    seed: int = 0
    target: TargetSpec = TargetSpec()
    data: DataSpec = DataSpec()
    drafter: dict[str, Any] = Field(default_factory=dict)
    loss: dict[str, Any] = Field(default_factory=dict)
    capture: CaptureSpec = CaptureSpec()
    train: TrainSpec = TrainSpec()
    eval: EvalSpec = EvalSpec()
    logging: LoggingSpec = LoggingSpec()

    def algorithm_configs(self):
        """(algorithm class, validated drafter config, validated loss config)."""
        from draftlab.models.drafter import DRAFTERS

        algo = DRAFTERS.get(self.algorithm, "algorithm")
        cfg, loss = _validate(algo.Config, self.drafter, "drafter"), _validate(algo.Loss, self.loss, "loss")
        algo.check_configs(cfg, loss)  # what the two sections ask of each other
        return algo, cfg, loss

    def fingerprint(self) -> str:
        """Hash of what determines the training trajectory (resume refuses a different one).
        Run-length knobs (max_steps, epochs, time limit, checkpointing, logging, eval, preemption
        signals, skip_nonfinite) and the output dir are excluded so a run can be extended, evaluated
        differently, or relaunched past a non-finite step."""
        d = self.model_dump(mode="json")
        d.pop("output_dir")
        d.pop("eval")
        d.pop("logging")
        for k in ("max_steps", "epochs", "time_limit_minutes", "checkpoint_every", "keep_last", "log_every", "skip_nonfinite",
                  "preempt_signals"):
            d["train"].pop(k)
        d["train"].pop("precision")  # "auto" depends on the machine: resume checks the precision it resolved to
        if d["capture"]["group_tokens"] is None:  # train.batch_tokens, hashed already (and runs from before it keep their hash)
            d["capture"].pop("group_tokens")
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def _format_error(e: ValidationError, prefix: str = "") -> str:
    err = e.errors()[0]
    loc = ".".join(str(p) for p in (prefix, *err["loc"]) if p != "")
    more = f" (+{len(e.errors()) - 1} more)" if len(e.errors()) > 1 else ""
    if err["type"] == "decoding":  # check_spec's message names the field itself (eval.k)
        return f"{err['msg']}{more}"
    return f"{loc or 'recipe'}: {err['msg']}{more}"


def _validate(cls, data: dict, section: str):
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        raise DraftlabError(_format_error(e, section)) from None


def apply_override(raw: dict, item: str) -> None:
    if "=" not in item:
        raise DraftlabError(f"override '{item}' is not of the form dotted.key=value")
    key, value = item.split("=", 1)
    try:
        parsed = yaml.safe_load(value) if value != "" else ""
    except yaml.YAMLError:
        parsed = value
    node = raw
    parts = key.split(".")
    for p in parts[:-1]:
        if not isinstance(node.setdefault(p, {}), dict):
            raise DraftlabError(f"override '{key}': '{p}' is not a section")
        node = node[p]
    node[parts[-1]] = parsed


def load_recipe(path: str | Path, overrides: list[str] = ()) -> Recipe:
    path = Path(path)
    if not path.is_file():
        raise DraftlabError(f"recipe file not found: {path}")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise DraftlabError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(raw, dict):
        raise DraftlabError(f"{path}: a recipe must be a mapping of sections")
    for item in overrides:
        apply_override(raw, item)
    try:
        recipe = Recipe.model_validate(raw)
    except ValidationError as e:
        raise DraftlabError(f"{path}: {_format_error(e)}") from None
    recipe.algorithm_configs()  # validate drafter/loss sections now, not mid-run
    if recipe.capture.mode == "offline" and not recipe.capture.offline_dir:
        raise DraftlabError(f"{path}: capture.offline_dir is required when capture.mode is offline")
    if recipe.capture.offline_dir and not Path(recipe.capture.offline_dir).is_dir():
        raise DraftlabError(f"{path}: capture.offline_dir not found: {recipe.capture.offline_dir}")
    return recipe
