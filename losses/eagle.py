"""EAGLE objectives as pure functions of tensors.

Alignment convention (one place, used by both EAGLE-1 and EAGLE-3):
the drafter's input at position t is (token x_{t+1}, feature f_t). At TTT step i its output at
position t imitates the target's next-token distribution at position s = t + 1 + i (which
predicts x_{t+2+i}). A position counts when the *predicted* token x_{t+2+i} is an assistant
token, i.e. ``loss_mask[t + 2 + i]`` — this is the correctly shifted mask (the reference code
is off by one, EAGLE issue #317). Losses are normalised by the mask sum, not ``.mean()``
(EAGLE issue #340).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from draftlab.losses.acceptance import ETA, KINDS as LK_KINDS, lk_distribution_loss

DISTRIBUTION_KINDS = ("ce", *LK_KINDS)  # :func:`distribution_loss`'s kinds, ce the default


def shift_left(x: torch.Tensor, n: int, fill=0) -> torch.Tensor:
    """Position t of the result holds x[:, t + n]; the last n positions are ``fill``."""
    if n == 0:
        return x
    pad = torch.full_like(x[:, :n], fill)
    return torch.cat([x[:, n:], pad], dim=1)


def predicted_mask(loss_mask: torch.Tensor, step: int) -> torch.Tensor:
    """Positions t whose step-``step`` prediction (token x_{t+2+step}) is an assistant token."""
    return shift_left(loss_mask.bool(), 2 + step, fill=False)


def topk_cross_entropy(logits: torch.Tensor, target_probs: torch.Tensor, k: int) -> torch.Tensor:
    """HASS's top-K distillation term: -sum_{v in topK(p)} p_v log q_v per position."""
    p, idx = target_probs.topk(k, dim=-1)
    return -(p * F.log_softmax(logits.float(), dim=-1).gather(-1, idx)).sum(-1)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mask = mask.to(x.dtype)
    return (x * mask).sum() / mask.sum().clamp_min(1.0)


def eagle1_loss(
    pred_feat: torch.Tensor,
    target_feat: torch.Tensor,
    pred_logits: torch.Tensor,
    target_logits: torch.Tensor,
    mask: torch.Tensor,
    feature_weight: float = 1.0,
    ce_weight: float = 0.1,
    kind: str = "ce",
    eta: float = ETA,
) -> tuple[torch.Tensor, dict]:
    """EAGLE-1: SmoothL1 feature regression + ``ce_weight`` times a distribution term against
    the target's: soft CE (``kind`` ce) or an LK acceptance loss (nla, lk_hybrid).

    All tensors are already aligned: position t compares the drafter's prediction with the
    target's feature/logits at t + 1, ``mask`` selects positions that count."""
    l_feat = masked_mean(F.smooth_l1_loss(pred_feat, target_feat, reduction="none").mean(-1), mask)
    l_ce = masked_mean(distribution_loss(pred_logits, F.softmax(target_logits.float(), -1), kind, eta), mask)
    with torch.no_grad():
        acc = masked_mean((pred_logits.max(-1).indices == target_logits.max(-1).indices).float(), mask)
    loss = feature_weight * l_feat + ce_weight * l_ce
    return loss, {"loss_feat": l_feat.item(), "loss_ce": l_ce.item(), "acc": [acc.item()]}


class SoftCrossEntropy(torch.autograd.Function):
    """-sum_v p_v log softmax(z)_v per row, for rows of p that sum to 1.

    One fused pass each way (loss = logsumexp(z) - p.z, grad = softmax(z) - p) instead of the
    ~7 elementwise passes over [N, V] that log_softmax, multiply and sum cost with autograd."""

    @staticmethod
    def forward(ctx, z, p):
        z = z.float()
        lse = torch.logsumexp(z, -1)
        ctx.save_for_backward(z, p, lse)
        return lse - torch.linalg.vecdot(p, z)

    @staticmethod
    def backward(ctx, g):
        z, p, lse = ctx.saved_tensors
        return torch.exp(z - lse.unsqueeze(-1)).sub_(p).mul_(g.unsqueeze(-1)), None


def distribution_loss(logits: torch.Tensor, target_probs: torch.Tensor, kind: str = "ce", eta: float = ETA) -> torch.Tensor:
    """Per row, the draft's ``logits`` against the target's distribution (rows summing to 1):
    soft CE (``kind`` ce, the EAGLE and Medusa default) or an LK acceptance loss
    (:mod:`draftlab.losses.acceptance`: nla, lk_hybrid)."""
    if kind == "ce":
        return SoftCrossEntropy.apply(logits, target_probs)
    return lk_distribution_loss(kind, logits, target_probs, eta)


def eagle3_step_loss(
    logits: torch.Tensor,
    target_probs: torch.Tensor,
    mask: torch.Tensor,
    topk_weight: float = 0.0,
    topk: int = 10,
    kind: str = "ce",
    eta: float = ETA,
) -> torch.Tensor:
    """One TTT step: :func:`distribution_loss` against the target's distribution restricted to
    the draft vocab, plus HASS's optional top-K term, averaged over ``mask`` (any matching
    leading shape)."""
    per_pos = distribution_loss(logits, target_probs, kind, eta)
    if topk_weight:
        per_pos = per_pos + topk_weight * topk_cross_entropy(logits, target_probs, topk)
    return masked_mean(per_pos, mask)
