"""Layer-skip self-speculation (Draft & Verify, Zhang et al. 2024; SWIFT, Xia et al. 2025): the
draft is the target itself with some of its decoder layers passed over (the residual stream goes
through them unchanged), so there are no weights at all.

What a checkpoint holds is the skip set, the 0-based decoder layers of the target the draft skips,
whether chains stop by Draft & Verify's adaptive draft exit, and the record of the search that
chose the set (``train/layer_search.py``). The weights file is empty. Drafting reuses the target's
own KV cache in the layers it runs (``inference/layerskip.py``).

Training is that search, not gradient steps (``trains_weights`` is False; the search registers
itself as the ``layerskip`` trainer variant, ``draftlab.train.variants``): the recipe's ``loss``
section holds its objective (:class:`LayerSkipSearch`), ``train.max_steps`` and
``train.time_limit_minutes`` bound it.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from draftlab.errors import DraftlabError
from draftlab.limits import MAX_K
from draftlab.models.drafter import DRAFTERS, Count, Distinct, Drafter, DrafterMeta, TargetNumLayers


class LayerSkipConfig(BaseModel):
    """The recipe's ``drafter:`` section."""

    model_config = ConfigDict(extra="forbid")

    skip: list[int] | None = Field(
        None, description="the target's decoder layers (0-based) the draft skips: where the search starts, or the set itself "
        "with search false; default every other layer (1, 3, ...), the first and last kept")
    search: bool = Field(True, description="search the skip set (false: take `skip` as it is)")
    adaptive_exit: bool = Field(
        True, description="Draft & Verify's draft exit: a chain stops after a draft whose probability is below a threshold "
        "that adapts to the acceptance after each verify (false: always k drafts)")


class LayerSkipSearch(BaseModel):
    """The recipe's ``loss:`` section: the search's objective (SWIFT's proxy, priced by measured
    costs) and its moves. ``train.max_steps`` (candidates) and ``train.time_limit_minutes`` bound it."""

    model_config = ConfigDict(extra="forbid")

    calibration_prompts: int = Field(8, ge=1, description="training conversations whose prompt and the target's own "
                                     "greedy continuation score each candidate")
    calibration_tokens: int = Field(32, ge=2, description="continuation tokens per calibration prompt")
    max_chain: int = Field(8, ge=1, le=MAX_K, description="the chain lengths 1..max_chain the expected speedup is maximised over")
    patience: int = Field(300, ge=1, description="stop after this many candidates without a better one")
    ucb_every: int = Field(4, ge=1, description="every n-th candidate is the best by an upper confidence bound of a "
                           "Bayesian linear model of the proxy, the others random sets or moves from the best")
    kappa: float = Field(2.5, ge=0, description="the UCB's exploration weight (SWIFT's)")
    fractions: list[float] = Field(
        [0.25, 0.375, 0.5, 0.625], min_length=1,
        description="the fixed fractions of layers skipped (a middle block, or spread) the searched set is compared with")

    @field_validator("fractions")
    @classmethod
    def _fractions(cls, v):
        if any(not 0 < f < 1 for f in v):
            raise PydanticCustomError("fractions", "each fraction must be in (0, 1)")
        return v


TargetLayer = Count(0, lambda t: t.num_layers - 1, "the target's decoder layers")


class LayerSkipMeta(DrafterMeta):
    num_target_layers: TargetNumLayers
    skip: Annotated[list[TargetLayer], Distinct()]
    adaptive_exit: StrictBool = True
    search: dict[str, Any] = {}  # how the set was chosen (train/layer_search.py); nothing reads it to decode

    @field_validator("skip")
    @classmethod
    def _keeps_a_layer(cls, v, info: ValidationInfo):
        L = (info.context or {})["target"].num_layers
        if len(v) >= L:
            raise PydanticCustomError("meta_list", "skips every one of the target's {n} layers (the draft must run one)", {"n": L})
        return v


def every_other_layer(num_layers: int) -> list[int]:
    """SWIFT's starting set: the odd layers, the first and the last kept (a 2-layer target: its last)."""
    if num_layers < 2:
        raise DraftlabError(f"layerskip needs a target of 2 or more decoder layers, this one has {num_layers}")
    return list(range(1, num_layers - 1, 2)) or [num_layers - 1]


@DRAFTERS.register()
class LayerSkip(Drafter):
    algorithm = "layerskip"
    Config = LayerSkipConfig
    Loss = LayerSkipSearch
    Meta = LayerSkipMeta
    trains_weights = False

    def __init__(self, skip: list[int], num_target_layers: int, adaptive_exit: bool = True, search: dict | None = None):
        super().__init__()
        self.skip = tuple(sorted(skip))
        self.num_target_layers, self.adaptive_exit = num_target_layers, adaptive_exit
        self.search = dict(search or {})

    @classmethod
    def default_capture_layers(cls, num_target_layers: int) -> list[int]:
        return []

    @property
    def capture_layers(self) -> list[int]:
        return []

    @classmethod
    def config_meta(cls, cfg: LayerSkipConfig, target, samples=None) -> dict:
        skip = cfg.skip if cfg.skip is not None else every_other_layer(target.num_layers)
        return {"num_target_layers": target.num_layers, "skip": skip, "adaptive_exit": cfg.adaptive_exit, "search": {}}

    @classmethod
    def from_meta(cls, meta: dict, target) -> "LayerSkip":
        return cls(meta["skip"], meta["num_target_layers"], meta["adaptive_exit"], meta["search"])

    def meta(self) -> dict:
        return {"num_target_layers": self.num_target_layers, "skip": list(self.skip), "adaptive_exit": self.adaptive_exit,
                "search": self.search}
