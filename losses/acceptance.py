"""Acceptance as the objective: the LK losses (Samarin et al., arXiv 2602.23881), for every
family whose loss compares its draft distribution q with the target's p.

At a position, lossless speculative sampling of a draft from q accepts it with probability

    alpha = sum_v min(p_v, q_v) = 1 - TV(p, q).

* ``nla``: -log alpha. Its gradient is TV's scaled by 1 / alpha, which keeps it usable while
  alpha is small; with a one-hot p it is the cross-entropy.
* ``lk_hybrid``: lambda KL(p || q) + (1 - lambda)(1 - alpha), lambda = exp(-eta alpha) taken
  without gradient: KL's dense gradient while acceptance is low, acceptance itself once high.

A family hands over (log alpha, KL) per position, from two distributions
(:func:`distribution_alpha_kl`) or from a one-hot target, a greedy or data token y, where
alpha = q_y and KL = -log q_y; it masks, weights and averages as its own losses do. With a
reduced draft vocabulary p is the target's distribution renormalised over it, the families'
convention for their other distribution losses. The draft LM's chunked loss needs the gradient
in closed form: :func:`lk_and_grad`, tested against autograd of :func:`lk_loss`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import BaseModel, Field

KINDS = ("nla", "lk_hybrid")
ETA = 3.0  # the paper's best hybrid setting (speculators' default too)
# alpha is floored here before its log, so disjoint supports give a finite loss and a zero
# gradient rather than inf/NaN; nla's gradient is bounded (|d alpha| <= 2 alpha) above it
TINY = 1e-30


class AcceptanceLossFields(BaseModel):
    """The LK losses' own recipe field, shared by every family's ``loss`` section."""

    eta: float = Field(ETA, gt=0, description="lk_hybrid: the KL weight is lambda = exp(-eta * alpha), alpha detached")


def distribution_alpha_kl(logq: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log alpha, KL(p || q)) per row for draft log-probabilities ``logq`` and target
    probabilities ``p`` [..., V] (rows of p sum to 1; zeros allowed)."""
    p = p.to(logq.dtype)
    alpha = torch.minimum(p, logq.exp()).sum(-1)
    kl = torch.xlogy(p, p).sum(-1) - (p * logq).sum(-1)
    return alpha.clamp_min(TINY).log(), kl


def entropy(p: torch.Tensor) -> torch.Tensor:
    """-sum_v p_v log p_v per row: KL(p || q) = CE(p, q) - entropy(p), for a family holding the CE."""
    return -torch.xlogy(p, p).sum(-1)


def lk_loss(kind: str, log_alpha: torch.Tensor, kl: torch.Tensor, eta: float = ETA) -> torch.Tensor:
    """One of ``KINDS`` per position from log alpha and KL(p || q) (any matching shapes)."""
    if kind == "nla":
        return -log_alpha
    if kind == "lk_hybrid":
        alpha = log_alpha.exp()
        lam = torch.exp(-eta * alpha).detach()
        return lam * kl + (1 - lam) * (1 - alpha)
    raise ValueError(f"unknown acceptance loss {kind!r}; expected one of {', '.join(KINDS)}")


def lk_distribution_loss(kind: str, logits: torch.Tensor, target_probs: torch.Tensor, eta: float = ETA) -> torch.Tensor:
    """:func:`lk_loss` per row of draft ``logits`` [..., V] against ``target_probs`` [..., V]."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # half precision loses too much
    return lk_loss(kind, *distribution_alpha_kl(F.log_softmax(logits, -1), target_probs), eta)


def lk_and_grad(kind: str, lp: torch.Tensor, lq: torch.Tensor, eta: float = ETA) -> tuple[torch.Tensor, torch.Tensor]:
    """(:func:`lk_loss` per row [N], its gradient [N, M] with respect to the logits s of
    q = softmax(s)) for log-probabilities ``lp``, ``lq`` [N, M], in closed form. With m_v = [q_v < p_v],
    d alpha / ds = q * (m - sum(q m)); KL's gradient is q - p."""
    q, p = lq.exp(), lp.exp()
    m = (q < p).to(q.dtype)
    alpha = torch.minimum(p, q).sum(-1)
    d_alpha = q * (m - (q * m).sum(-1, keepdim=True))
    if kind == "nla":
        live = alpha > TINY  # below the floor the loss is constant
        inv = torch.where(live, 1 / alpha.clamp_min(TINY), torch.zeros_like(alpha))
        return -alpha.clamp_min(TINY).log(), -d_alpha * inv[:, None]
    if kind == "lk_hybrid":
        kl = torch.where(p > 0, p * (lp - lq), 0.0).sum(-1)
        lam = torch.exp(-eta * alpha)
        return lam * kl + (1 - lam) * (1 - alpha), lam[:, None] * (q - p) - (1 - lam)[:, None] * d_alpha
    raise ValueError(f"unknown acceptance loss {kind!r}; expected one of {', '.join(KINDS)}")
