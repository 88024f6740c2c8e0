"""Medusa-1 objective as pure functions of tensors.

Alignment convention: head i (0-based) at position t predicts token x_{t+2+i}; the target's own
logits at position s = t + 1 + i predict that same token (its lm_head is the "head -1" that
predicts x_{t+1}). Position t counts for head i when x_{t+2+i} is an assistant token,
``loss_mask[t + 2 + i]`` — the EAGLE convention of ``losses.eagle.predicted_mask``. Losses are
means over the counted positions of each head, weighted ``head_weight * decay**i`` and summed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from draftlab.losses.acceptance import ETA, lk_loss
from draftlab.losses.eagle import distribution_loss


def head_weights(num_heads: int, head_weight: float, decay: float) -> list[float]:
    """lambda * decay**i per head: later heads predict further ahead and are less often reached
    by an accepted chain, so they weigh less (Medusa-2's 0.8**i)."""
    return [head_weight * decay**i for i in range(num_heads)]


def _mean(per_row: torch.Tensor) -> torch.Tensor:
    # a head with no counted row (short or unmasked sequences) contributes an exact zero
    return per_row.sum() / max(per_row.numel(), 1)


def distill_loss(logits: torch.Tensor, target_probs: torch.Tensor, kind: str = "ce", eta: float = ETA) -> torch.Tensor:
    """Self-distillation: the mean over rows [n, V_draft] of soft CE -sum_v p_v log softmax(logits)_v
    (``kind`` ce) or an LK acceptance loss (nla, lk_hybrid), ``target_probs`` the target's
    distribution at the same predicted token (rows sum to 1)."""
    return _mean(distribution_loss(logits, target_probs, kind, eta))


def data_loss(logits: torch.Tensor, labels: torch.Tensor, kind: str = "ce", eta: float = ETA) -> torch.Tensor:
    """Mean CE against the data's tokens given as draft-vocab ids ``labels`` [n] (``kind`` ce), or
    an LK loss against them as one-hot targets (alpha = q_y, KL = CE: nla is then the CE); -1
    marks a token outside the draft vocabulary, which no head can predict and is left out."""
    keep = labels >= 0
    ce = F.cross_entropy(logits[keep].float(), labels[keep], reduction="none")
    return _mean(ce if kind == "ce" else lk_loss(kind, -ce, ce, eta))


def topk_agreement(ranked: torch.Tensor, reference: torch.Tensor) -> tuple[float, float]:
    """(top-1, top-k) agreement rates: ``ranked`` [n, k] holds each row's k best target-vocab
    ids, best first; a row hits when ``reference`` [n] (the target's greedy token) is among
    them. With no rows both are 0."""
    if not reference.numel():
        return 0.0, 0.0
    hit = ranked == reference[:, None]
    return hit[:, 0].float().mean().item(), hit.any(-1).float().mean().item()
