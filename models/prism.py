"""PRISM: an EAGLE-3 drafter whose draft steps run different modules (MLSys 2026, arXiv 2602.01762;
reference code Akemiiii/prism-mlsys-ae: ``PRISM/LD/large_drafter.py`` and ``PRISM/train/main_LD.py``, and
its EAGLE-3 variant ``Eagle3/traineagle3/large_drafter.py``).

The fused target feature (EAGLE-3's ``fc`` over three target layers, the reference's
``fusion_layer``) feeds M processing modules. A fixed map sends draft step k (the forward over
inputs k drafts deep: step 0 runs the committed tokens and yields draft 1) to module
``step_map[k]``; steps past the map stay on its last entry's module. One module runs per step, so
a step costs what a one-module drafter's does while the parameters grow M-fold. Every module
writes the one draft KV cache (slot i for its i-th layer): a step attends to the K/V the
committed tokens got from module ``step_map[0]`` and its path's earlier steps got from theirs.

A module is, by ``module``: ``fc`` (``PRISM/LD``'s: ``fc`` 2H->H over [embedding; feature], then a
decoder layer whose input is not normed, HASS's first layer) or ``eagle3`` (the EAGLE-3 variant's:
EAGLE-3's fused first layer, whose attention reads [norm(embedding); norm(feature)]): one such
module is an EAGLE-3 drafter, so ``init_from`` takes an eagle3 run's. Training is EAGLE-3's
training-time test (``Eagle3Drafter.unroll``), each step through its module, over the shared
cache as decoding reads it (as the EAGLE-3 variant trains; ``PRISM/LD`` recomputes the context's
K/V with each step's module in training). Only draftlab serves it (no mainline engine has a PRISM
layout): export is draftlab's own (``--to hf``).
"""

from __future__ import annotations

import json
from typing import Literal

import torch
import torch.nn as nn
from pydantic import Field, StrictInt, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from draftlab.errors import DraftlabError
from draftlab.limits import MAX_K
from draftlab.models.drafter import DRAFTERS, Count
from draftlab.models.eagle import Eagle3Config, Eagle3Drafter, Eagle3Loss, Eagle3Meta
from draftlab.models.layers import DecoderLayer, LayerShape

MODULE_KINDS = ("fc", "eagle3")
ModuleKind = Literal[MODULE_KINDS]  # type: ignore[valid-type]


def default_step_map(num_modules: int) -> list[int]:
    """Step k on module k, the steps past M - 1 on the last: for M = 2 the reference's Llama-3-8B
    map {0: 0, 1: 1, 2: 1}."""
    return list(range(num_modules))


def step_map_problem(step_map: list[int], num_modules: int | None) -> str | None:
    """What is wrong with ``step_map`` for ``num_modules`` modules (None: nothing)."""
    if not step_map:
        return "is empty"
    if len(step_map) > MAX_K:
        return f"has {len(step_map)} steps, more than {MAX_K} (the most drafts a step makes)"
    if num_modules is None:  # num_modules itself was refused
        return None
    for k, m in enumerate(step_map):
        if not 0 <= m < num_modules:
            return f"sends step {k} to module {m}, outside 0..{num_modules - 1} (num_modules {num_modules})"
    unused = sorted(set(range(num_modules)) - set(step_map))
    if unused:  # a module no step runs is never trained nor used
        return f"sends no step to module {unused[0]} (each of num_modules {num_modules} runs some step)"
    return None


class PrismConfig(Eagle3Config):
    num_modules: int = Field(2, ge=1, le=MAX_K, description="M: processing modules (the reference's num_step_models)")
    step_map: list[int] | None = Field(
        None, description="entry k: the module of draft step k (step 0 runs the committed tokens and yields draft 1); "
        "steps past the map stay on its last entry's module; default [0, 1, ..., M-1]",
    )
    module: ModuleKind = Field(  # type: ignore[valid-type]
        "fc", description="fc: fc(2H->H) over [embedding; feature] then a decoder layer (PRISM/LD's); "
        "eagle3: EAGLE-3's fused first layer (the EAGLE-3 variant's: one module is an EAGLE-3 drafter)",
    )
    init_from: str | None = Field(
        None, description="checkpoint of a one-module drafter (an eagle3 run for module eagle3, or a prism run with "
        "num_modules 1) whose weights start this one, its module copied into every module; default: random modules",
    )

    @field_validator("step_map")
    @classmethod
    def _map(cls, v, info: ValidationInfo):
        if v is not None and (problem := step_map_problem(v, info.data.get("num_modules"))):
            raise PydanticCustomError("step_map", problem)
        return v

    @model_validator(mode="after")
    def _residual_norm_of_the_fused_layer(self):
        if self.norm_before_residual and self.module != "eagle3":
            raise PydanticCustomError("norm_before_residual", "norm_before_residual is a flag of EAGLE-3's fused layer: "
                                      "it needs drafter.module eagle3")
        return self


class PrismMeta(Eagle3Meta):
    num_modules: Count(1, MAX_K, "at most one module per draft step")
    step_map: list[StrictInt]
    module: ModuleKind  # type: ignore[valid-type]

    @field_validator("step_map")
    @classmethod
    def _map(cls, v, info: ValidationInfo):
        if problem := step_map_problem(v, info.data.get("num_modules")):
            raise PydanticCustomError("meta_range", problem)
        return v

    @field_validator("module")
    @classmethod
    def _residual_norm_of_the_fused_layer(cls, v, info: ValidationInfo):
        if v != "eagle3" and info.data.get("norm_before_residual"):
            raise PydanticCustomError("meta_choice", "has no fused layer, which norm_before_residual needs (module eagle3)")
        return v


class PrismLoss(Eagle3Loss):
    ttt_steps: int = Field(3, ge=1, description="training-time-test unroll (the reference trains its map's 3 steps)")
    decay: float = Field(1.0, gt=0, description="step i is weighted decay**i (the reference weighs its steps equally)")


class PrismModule(nn.Module):
    """One processing module: what a one-layer drafter runs per draft step."""

    def __init__(self, shape: LayerShape, num_layers: int, kind: str, norm_before_residual: bool = False):
        super().__init__()
        H = shape.hidden_size
        # the reference's stepFCs (bias on: its drafters are built with bias=True)
        self.fc = nn.Linear(2 * H, H, bias=True) if kind == "fc" else None
        first = (DecoderLayer(shape, input_norm=False) if kind == "fc"
                 else DecoderLayer(shape, fuse_embedding=True, norm_before_residual=norm_before_residual))
        self.layers = nn.ModuleList([first] + [DecoderLayer(shape) for _ in range(num_layers - 1)])

    def forward(self, emb, h, cos, sin, attend_for_layer):
        if self.fc is not None:
            h, emb = self.fc(torch.cat([emb, h], dim=-1)), None
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, attend_for_layer(i, layer.self_attn), emb=emb)
        return h


@DRAFTERS.register()
class PrismDrafter(Eagle3Drafter):
    algorithm = "prism"
    Config = PrismConfig
    Loss = PrismLoss
    Meta = PrismMeta

    def __init__(
        self, shape: LayerShape, vocab_size: int, draft_vocab_size: int, aux_layers: list[int], num_layers: int,
        normalize_fc_input: bool = False, fc_norm: bool = False, norm_output: bool = False, norm_before_fc: bool = False,
        norm_before_residual: bool = False, num_modules: int = 2, step_map: list[int] | None = None, module: str = "fc",
    ):
        super().__init__(shape, vocab_size, draft_vocab_size, aux_layers, 1, normalize_fc_input, fc_norm, norm_output, norm_before_fc)
        del self.layers  # the modules' layers take the one stack's place (see the ``layers`` property)
        self.step_map = list(step_map or default_step_map(num_modules))
        self.module_kind = module  # not ``module``: wrappers (DDP, FSDP) unwrap through that name
        self.step_modules = nn.ModuleList(
            [PrismModule(shape, num_layers, module, norm_before_residual) for _ in range(num_modules)])

    @property
    def layers(self) -> nn.ModuleList:
        """Module 0's layers: the draft cache's layer slots (every module has as many, and module
        m's layer i writes slot i)."""
        return self.step_modules[0].layers

    def module_at(self, depth: int) -> int:
        """The module of draft step ``depth``."""
        return self.step_map[min(depth, len(self.step_map) - 1)]

    def stack(self, emb, h, positions, attend_for_layer, depth: int = 0):
        """Draft step ``depth`` through its module alone."""
        cos, sin = self.rotary(positions, h)
        h = self.step_modules[self.module_at(depth)](emb, h, cos, sin, attend_for_layer)
        return self.norm(h) if self.norm_output else h

    # ---- construction -------------------------------------------------------
    @classmethod
    def config_meta(cls, cfg: PrismConfig, target, samples=None) -> dict:
        step_map = cfg.step_map or default_step_map(cfg.num_modules)
        return {**super().config_meta(cfg, target, samples), "num_modules": cfg.num_modules, "step_map": step_map,
                "module": cfg.module}

    @classmethod
    def check_configs(cls, cfg: PrismConfig, loss_cfg: PrismLoss) -> None:
        step_map = cfg.step_map or default_step_map(cfg.num_modules)
        for m in range(cfg.num_modules):
            first = step_map.index(m)
            if first >= loss_cfg.ttt_steps:
                raise DraftlabError(f"loss.ttt_steps = {loss_cfg.ttt_steps} trains no step of module {m} "
                                    f"(drafter.step_map {step_map} first sends step {first} to it)")

    def meta(self) -> dict:
        return {**super().meta(), "num_modules": len(self.step_modules), "step_map": list(self.step_map), "module": self.module_kind}

    @classmethod
    def from_meta(cls, meta: dict, target) -> "PrismDrafter":
        m = cls(
            LayerShape(**meta["shape"]), meta["vocab_size"], meta["draft_vocab_size"], meta["aux_layers"], meta["num_layers"],
            meta["normalize_fc_input"], meta["fc_norm"], meta["norm_output"], meta["norm_before_fc"], meta["norm_before_residual"],
            meta["num_modules"], meta["step_map"], meta["module"],
        )
        m.num_target_layers = meta["num_target_layers"]
        return m.attach(target)

    def init_weights(self, cfg: PrismConfig, target, samples=None) -> None:
        """EAGLE-3's fresh start with independent random modules, or (``init_from``) every weight
        of a trained one-module drafter, its module copied into each (the reference starts PRISM
        from its one-module drafter so)."""
        if cfg.init_from is None:
            return super().init_weights(cfg, target, samples)
        self.start_from(cfg.init_from, target)
        self.lm_head.weight.requires_grad_(not cfg.freeze_lm_head)

    def start_from(self, path: str, target) -> None:
        """Load the one-module drafter checkpoint at ``path`` (eagle3, or prism with one module) of
        this drafter's every other field, shared weights as they are and its module into every module."""
        from draftlab.checkpoint import load_drafter, load_state_exactly

        where = "drafter.init_from"
        try:
            src, _ = load_drafter(path, target, torch.float32)
        except DraftlabError as e:
            raise DraftlabError(f"{where}: {e}") from None
        if src.algorithm not in ("eagle3", self.algorithm):
            raise DraftlabError(f"{where}: {path} holds a {src.algorithm} drafter, not a one-module eagle3 or prism one")
        theirs = {**src.meta(), "num_modules": 1, "module": "eagle3"} if src.algorithm == "eagle3" else src.meta()
        if theirs["num_modules"] != 1:
            raise DraftlabError(f"{where}: {path} has {theirs['num_modules']} modules; PRISM starts from a one-module drafter")
        mine = self.meta()
        for key in sorted(theirs.keys() - {"num_modules", "step_map"}):
            if theirs[key] != mine[key]:
                a, b = (json.dumps(v)[:60] for v in (theirs[key], mine[key]))
                raise DraftlabError(f"{where}: {path} has {key} {a}, this drafter (drafter.{key}) {b}")
        # the source's module: an EAGLE-3 drafter's layers, a one-module PRISM's module 0
        own, inner = ("layers.", "layers.") if src.algorithm == "eagle3" else ("step_modules.0.", "")
        state = {}
        for key, value in src.state_dict().items():
            if not key.startswith(own):
                state[key] = value
                continue
            for m in range(len(self.step_modules)):
                state[f"step_modules.{m}.{inner}{key[len(own):]}"] = value
        load_state_exactly(self, state, path, self.derived_keys)
