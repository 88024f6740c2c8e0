"""DFlash2's candidate-selector objective as pure functions (models/dflash2.py trains with them).

The DFlash2 paper publishes no training objective. This is the one SpecForge #772
(``training.dflash2_selector_loss_alpha``) and speculators #1006 (``models/dflash2/metrics.py``,
``selector_loss_alpha``) train with: the DFlash block loss on the unary logits, plus alpha x a
K-way cross-entropy of the selector over each slot's unary top-K, the gold token injected at
rank K when the top-K misses it, the slot's predecessor teacher-forced, weighted per slot as the
DFlash CE is (``exp(-(k-1)/gamma)``, divided by the number of blocks).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from draftlab.losses.diffusion import position_weights, weighted_ce_loss


def inject_gold(candidates: torch.Tensor, gold: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(training candidates, the gold's index among them, whether the top-K held it) for unary
    top-K ``candidates`` [..., K] and ``gold`` ids [...]: a gold the top-K lacks replaces its
    weakest (last) candidate, so every slot has a K-way label and the set stays K wide."""
    K = candidates.shape[-1]
    match = candidates == gold[..., None]
    held = match.any(-1)
    index = torch.where(held, match.long().argmax(-1), torch.full_like(gold, K - 1))
    last = torch.where(held, candidates[..., -1], gold)
    return torch.cat([candidates[..., :-1], last[..., None]], -1), index, held


def selector_loss(scores: torch.Tensor, index: torch.Tensor, counted: torch.Tensor, gamma: float) -> torch.Tensor:
    """The K-way CE of selector ``scores`` [N, J, K] against the gold's ``index`` [N, J] over
    ``counted`` [N, J] slots, weighted per slot as DFlash's CE (losses/diffusion.py (a))."""
    N, J, K = scores.shape
    ce = F.cross_entropy(scores.reshape(-1, K).float(), index.reshape(-1), reduction="none").view(N, J)
    return weighted_ce_loss(ce, counted, position_weights(J, gamma, scores.device))
