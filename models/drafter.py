"""The drafter interface every algorithm implements, and the registry of algorithms by name.

A drafter is an ``nn.Module`` that knows
* which target hidden states it reads (``capture_layers``) and how it turns them into its
  input features (``features``),
* its training objective on a captured batch (``training_loss``; the math lives in ``losses/``),
* one inference step over a KV cache (``draft_step``), used by its proposer in ``inference/``,
* its configuration (a pydantic model) so a checkpoint can rebuild it.

Adding an algorithm (Medusa, diffusion) = a module in ``models/`` with a ``Drafter`` subclass
decorated with ``@register``, its loss in ``losses/``, a proposer, and export mappings.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn as nn
from pydantic import BaseModel

from draftlab.errors import DraftlabError

ALGORITHMS: dict[str, type["Drafter"]] = {}


def register(cls: type["Drafter"]) -> type["Drafter"]:
    ALGORITHMS[cls.algorithm] = cls
    return cls


def get_algorithm(name: str) -> type["Drafter"]:
    import draftlab.models.eagle  # noqa: F401  (registers eagle1/eagle3)

    if name not in ALGORITHMS:
        raise DraftlabError(f"unknown algorithm '{name}' (known: {', '.join(sorted(ALGORITHMS))})")
    return ALGORITHMS[name]


class Drafter(nn.Module):
    algorithm: ClassVar[str]
    Config: ClassVar[type[BaseModel]]  # drafter architecture (recipe section `drafter:`)
    Loss: ClassVar[type[BaseModel]]  # objective knobs (recipe section `loss:`)

    # ---- construction -------------------------------------------------------
    @classmethod
    def build(cls, cfg: BaseModel, target, token_counts: torch.Tensor | None = None) -> "Drafter":
        """A fresh drafter for ``target``; ``token_counts`` (target-vocab frequencies over
        loss-masked tokens) lets drafters with a reduced vocabulary choose it."""
        raise NotImplementedError

    @classmethod
    def from_meta(cls, meta: dict, target) -> "Drafter":
        """Rebuild (without weights) from the ``drafter`` section of a checkpoint's JSON."""
        raise NotImplementedError

    def meta(self) -> dict:
        """Everything ``from_meta`` needs (JSON-serialisable)."""
        raise NotImplementedError

    # ---- data the drafter reads ----------------------------------------------
    @property
    def capture_layers(self) -> list[int]:
        raise NotImplementedError

    def features(self, hidden: dict[int, torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    # ---- training ---------------------------------------------------------------
    def forward(self, batch: dict, hidden: dict[int, torch.Tensor], loss_cfg: BaseModel):
        # DDP/FSDP synchronise through forward(), so training goes through it.
        return self.training_loss(batch, hidden, loss_cfg)

    def training_loss(self, batch: dict, hidden: dict[int, torch.Tensor], loss_cfg: BaseModel):
        """-> (loss scalar, metrics dict of floats/lists). ``batch`` has input_ids, loss_mask,
        attention_mask [B, T] and, when the trainer supplies them, the ``derived_targets``;
        ``hidden`` the captured target states for ``capture_layers``."""
        raise NotImplementedError

    def derived_targets(self, hidden: dict[int, torch.Tensor], batch: dict) -> dict[str, torch.Tensor]:
        """Per-position tensors [B, T, ...] computed from the capture that are the same in every
        epoch (e.g. the target's full-vocab argmax). The trainer adds them to ``batch`` and, with
        ``capture.mode: memory``, caches them beside the hidden states so they are computed once
        per sample. Values at padded positions are unspecified. Default: none."""
        return {}

    # ---- inference ----------------------------------------------------------------
    def draft_step(self, tokens, feats, positions, cache, mask=None):
        """-> (next features [B, n, H], log-probs over the *target* vocab [B, n, V])."""
        raise NotImplementedError

    def new_cache(self):
        raise NotImplementedError

    def proposer(self, min_confidence: float = 0.0):
        """The inference-side view of this drafter (an ``inference.proposer.Proposer``);
        ``min_confidence`` > 0 lets a chain stop early where the drafter is unsure."""
        raise NotImplementedError

    def export_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights in their plain published form: training-only reparametrisations folded
        in (frozen target-owned weights are never part of a drafter)."""
        return {k: v.detach() for k, v in self.state_dict().items()}

    def export_meta(self) -> dict:
        """``meta()`` describing :meth:`export_state_dict`'s form."""
        return self.meta()
