"""The drafter contract: what the shared trainer, checkpoint reader and exporter ask of a family.

A drafter family is a ``Drafter`` subclass registered by name (``@DRAFTERS.register()``, under
its ``algorithm``) in its own module, plus what it registers elsewhere in its own files: a
proposer for the decoder (``inference.proposer.PROPOSERS``, same name, which also declares the
decoding shapes the family supports), export and import formats (``export.formats``) and a thin
``train/<family>.py`` entry point. Nothing shared names a family.

Shapes below: B batch rows, T positions, H the target's hidden size, V the target's vocabulary.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn as nn
from pydantic import BaseModel

from draftlab.registry import Registry

DRAFTERS: Registry[type["Drafter"]] = Registry("drafter family", key="algorithm")


class Drafter(nn.Module):
    algorithm: ClassVar[str]  # registry name; the recipe's ``algorithm`` and the checkpoint's
    Config: ClassVar[type[BaseModel]]  # architecture knobs (recipe section ``drafter:``)
    Loss: ClassVar[type[BaseModel]]  # objective knobs (recipe section ``loss:``)
    # State-dict key prefixes the checkpoint may lack because construction derives them
    # (RoPE tables, say); any other missing key is an error.
    derived_keys: ClassVar[tuple[str, ...]] = ()

    # ---- construction ---------------------------------------------------------------
    @classmethod
    def default_capture_layers(cls, num_target_layers: int) -> list[int]:
        """The target hidden-state indices (convention of ``models/target.py``) a drafter of
        this family reads by default: what ``draftlab capture --layers <algorithm>`` stores."""
        raise NotImplementedError

    @classmethod
    def build(cls, cfg: BaseModel, target, samples: list[dict]) -> "Drafter":
        """A fresh drafter for ``target`` (a ``models.target.Target``), from its validated
        ``Config``. ``samples`` are the training samples (dicts with ``input_ids`` and
        ``loss_mask``, Long/Bool [T]): what a family measures before training (token counts
        for a reduced vocabulary, feature scales). The result shares the target's frozen
        weights by reference, never as registered parameters."""
        raise NotImplementedError

    @classmethod
    def from_meta(cls, meta: dict, target) -> "Drafter":
        """Rebuild (weights uninitialised) from ``meta()``'s JSON, next to ``target``."""
        raise NotImplementedError

    def meta(self) -> dict:
        """JSON-serialisable: everything ``from_meta`` needs to rebuild this drafter."""
        raise NotImplementedError

    @classmethod
    def trained_depth(cls, loss: dict) -> int | None:
        """How many chained draft positions this family's objective trains, given the ``loss``
        section of the recipe a checkpoint was trained with (a dict, possibly empty); None: every
        position it drafts, or no bound known. The adaptive draft length drafts no further
        (``inference/batch_eval.py``). Default: None."""
        return None

    # ---- what it reads from the target ------------------------------------------------
    @property
    def capture_layers(self) -> list[int]:
        """Target hidden-state indices ``training_loss`` and the proposer read (ascending)."""
        raise NotImplementedError

    def derived_targets(self, hidden: dict[int, torch.Tensor], batch: dict) -> dict[str, torch.Tensor]:
        """Per-position tensors [B, T, ...] computed from the capture that are the same in every
        epoch (e.g. the target's full-vocab argmax). ``hidden`` maps each of ``capture_layers``
        to [B, T, H]; ``batch`` holds ``input_ids``, ``loss_mask`` and ``attention_mask``
        [B, T]. The feature source adds them to the batch and, with ``capture.mode: memory``,
        caches them beside the hidden states. Values at padded positions are unspecified.
        Default: none."""
        return {}

    # ---- training ------------------------------------------------------------------------
    def forward(self, batch: dict, hidden: dict[int, torch.Tensor], loss_cfg: BaseModel):
        # DDP/FSDP synchronise through forward(), so training goes through it.
        return self.training_loss(batch, hidden, loss_cfg)

    def training_loss(self, batch: dict, hidden: dict[int, torch.Tensor], loss_cfg: BaseModel):
        """-> (loss scalar tensor, metrics). ``batch``: ``input_ids``, ``loss_mask``,
        ``attention_mask`` [B, T] (right-padded) plus the ``derived_targets``; ``hidden``: as
        in ``derived_targets``; ``loss_cfg``: the validated ``Loss``. Metrics are floats or
        lists of floats (per position or head); an ``acc`` list is shown in the progress bar."""
        raise NotImplementedError

    # ---- export --------------------------------------------------------------------------
    def export_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights in their plain published form: training-only reparametrisations folded
        in (frozen target-owned weights are never part of a drafter)."""
        return {k: v.detach() for k, v in self.state_dict().items()}

    def export_meta(self) -> dict:
        """``meta()`` describing :meth:`export_state_dict`'s form."""
        return self.meta()
