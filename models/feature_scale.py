"""Per-channel scales of concatenated target features, for drafters that fuse several layers
through one linear (EAGLE-3's and DFlash's ``fc``).

Target features carry "massive activations" (SmolLM2's layer-27 state has channels with
|x| ~ 400 next to an RMS of ~20): a fixed per-channel 1/RMS in front of fc keeps them from
dominating the fused feature and Adam's updates. It is linear, so an export folds it into
``fc.weight`` and serving engines see a plain fc.
"""

from __future__ import annotations

import torch

from draftlab.errors import DraftlabError


@torch.no_grad()
def feature_inverse_rms(target, layers: list[int], samples, max_samples: int = 16, max_tokens: int = 512) -> torch.Tensor:
    """1 / per-channel RMS of the concatenated target features over a few training samples."""
    sq, n = None, 0
    for s in (samples or [])[:max_samples]:
        ids = s["input_ids"][:max_tokens].to(target.device)[None]
        hidden = target(ids, layers=layers, logits=None).hidden
        x = torch.cat([hidden[i][0] for i in layers], dim=-1).float()
        sq = x.pow(2).sum(0) if sq is None else sq + x.pow(2).sum(0)
        n += x.shape[0]
    if not n:
        raise DraftlabError("drafter.normalize_fc_input needs training samples to measure feature scales")
    return (sq / n).sqrt().clamp_min(1e-3).reciprocal()


@torch.no_grad()
def fill_measured_buffers(m, target, layers: list[int], samples, normalize: bool) -> None:
    """What a fused-feature drafter (EAGLE-3, diffusion) measures on training data at build:
    ``fc_input_scale`` (the fused features' 1/RMS, when ``normalize``) and the draft vocabulary's
    ``d2t`` / ``t2d`` maps."""
    if normalize:
        m.fc_input_scale.copy_(feature_inverse_rms(target, layers, samples))
    m.fill_vocab_maps(samples)
