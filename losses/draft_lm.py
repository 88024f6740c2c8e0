"""Distillation of an independent draft LM on the target's next-token distribution (DistillSpec).

At every counted position the draft's distribution q (its logits z over the vocabulary) is pulled
towards the target's p, recomputed from the target's captured final hidden state through the
target's lm_head. ``loss.kind`` picks the divergence:

* ``fkl``: KL(p || q), mode covering (soft cross-entropy up to p's entropy);
* ``rkl``: KL(q || p), mode seeking;
* ``jsd``: beta KL(p || m) + (1 - beta) KL(q || m), m = beta p + (1 - beta) q (GKD's JSD[beta]);
* ``tvd``: 1/2 sum |p - q|, whose complement is the acceptance rate of speculative sampling;
* ``nla``, ``lk_hybrid``: the LK acceptance losses (losses/acceptance.py), with ``eta``;
* ``ce``: cross-entropy on the data's next tokens alone (no target distribution).

p and q are both taken at ``temperature``. With ``top_k`` = k > 0 the target's distribution is
its top k tokens plus one bucket holding the rest mass, and the draft's is bucketed the same way
(the same k tokens, the rest summed), so the divergence is over k + 1 outcomes. ``ce_weight`` adds
cross-entropy on the data's tokens (temperature 1) to any divergence.

Memory: a distribution is V floats per position, so the loss runs over positions in chunks of
``chunk``: per chunk the draft's and the target's logits are formed, the loss and its gradient
with respect to the draft's logits are taken (closed forms, checked against autograd of
``row_loss`` by the tests), and that gradient is turned into the gradients of the draft's hidden
states and lm_head weight at once. Nothing
V-wide outlives its chunk, in the forward or the backward pass.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

from draftlab.losses.acceptance import KINDS as LK_KINDS, AcceptanceLossFields, distribution_alpha_kl, lk_and_grad, lk_loss

KINDS = ("fkl", "rkl", "jsd", "tvd", *LK_KINDS, "ce")
# a log-probability standing in for log 0 in the top-k rest bucket when the top k hold all the
# mass (k >= V): finite, so no gradient becomes NaN, and exp() of it is exactly 0
LOG_ZERO = -1e30


class DraftLMLoss(AcceptanceLossFields):
    model_config = ConfigDict(extra="forbid")

    kind: Literal[KINDS] = Field(  # type: ignore[valid-type]
        "fkl", description="fkl | rkl | jsd | tvd | nla | lk_hybrid: divergence from the target's distribution; ce: the data's tokens alone"
    )
    beta: float = Field(0.5, gt=0, lt=1, description="jsd: the target's weight in the mixture m = beta p + (1 - beta) q")
    temperature: float = Field(1.0, gt=0, description="both distributions are softmax(logits / temperature)")
    top_k: int = Field(0, ge=0, description="0: the full distribution; k: the target's top k tokens plus one bucket of the rest mass")
    ce_weight: float = Field(0.0, ge=0, description="adds ce_weight * cross-entropy on the data's tokens to the divergence")
    chunk: int = Field(
        256, ge=1, description="positions whose V-wide logits are held at once: memory ~ a few * chunk * V * 4 bytes"
    )
    on_policy: float = Field(
        0.0, ge=0, le=1, description="share of each micro-batch's sequences whose answer the draft samples itself, scored "
        "by the target (DistillSpec's on-policy data; needs capture.mode online)"
    )

    @field_validator("ce_weight")
    @classmethod
    def _ce_alone(cls, v, info):
        if v and info.data.get("kind") == "ce":
            raise PydanticCustomError("ce_weight", "adds cross-entropy to a divergence; kind ce is cross-entropy alone")
        return v


# ---------------------------------------------------------------------------- divergences
def _xlogy_diff(lp: torch.Tensor, lq: torch.Tensor) -> torch.Tensor:
    """sum_v p_v (log p_v - log q_v) per row, p = exp(lp); a zero p_v contributes 0."""
    p = lp.exp()
    return torch.where(p > 0, p * (lp - lq), 0.0).sum(-1)


def forward_kl(lp: torch.Tensor, lq: torch.Tensor, beta: float = 0.5) -> torch.Tensor:
    return _xlogy_diff(lp, lq)


def reverse_kl(lp: torch.Tensor, lq: torch.Tensor, beta: float = 0.5) -> torch.Tensor:
    return _xlogy_diff(lq, lp)


def jsd(lp: torch.Tensor, lq: torch.Tensor, beta: float = 0.5) -> torch.Tensor:
    lm = torch.logaddexp(lp + math.log(beta), lq + math.log1p(-beta))
    return beta * _xlogy_diff(lp, lm) + (1 - beta) * _xlogy_diff(lq, lm)


def total_variation(lp: torch.Tensor, lq: torch.Tensor, beta: float = 0.5) -> torch.Tensor:
    return 0.5 * (lp.exp() - lq.exp()).abs().sum(-1)


DIVERGENCES = {"fkl": forward_kl, "rkl": reverse_kl, "jsd": jsd, "tvd": total_variation}


def bucket_top_k(lp: torch.Tensor, lq: torch.Tensor, k: int, idx: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probabilities [N, k + 1] of the target's top ``k`` tokens (per row, from ``lp``; or
    ``idx`` [N, k]) and one bucket of everything else, for both distributions
    (log-probabilities [N, V])."""
    k = min(k, lp.shape[-1])
    if idx is None:
        idx = lp.topk(k, dim=-1).indices
    inside = torch.zeros_like(lp, dtype=torch.bool).scatter_(-1, idx, True)

    def bucketed(l):
        # the rest as a logsumexp over the other tokens: exact even when the rest mass is tiny
        rest = l.masked_fill(inside, float("-inf")).logsumexp(-1, keepdim=True)
        return torch.cat([l.gather(-1, idx), rest.clamp_min(LOG_ZERO)], dim=-1)

    return bucketed(lp), bucketed(lq)


def row_loss(z: torch.Tensor, zt: torch.Tensor | None, labels: torch.Tensor, cfg: DraftLMLoss) -> torch.Tensor:
    """The loss of each row [N]: draft logits ``z`` [N, V], target logits ``zt`` [N, V] (unused
    by kind ce), the data's next tokens ``labels`` [N]."""
    z = z.float()
    if cfg.kind == "ce":
        return F.cross_entropy(z, labels, reduction="none")
    lq = F.log_softmax(z / cfg.temperature, -1)
    lp = F.log_softmax(zt.float() / cfg.temperature, -1)
    if cfg.top_k:
        lp, lq = bucket_top_k(lp, lq, cfg.top_k)
    if cfg.kind in LK_KINDS:
        loss = lk_loss(cfg.kind, *distribution_alpha_kl(lq, lp.exp()), cfg.eta)
    else:
        loss = DIVERGENCES[cfg.kind](lp, lq, cfg.beta)
    if cfg.ce_weight:
        loss = loss + cfg.ce_weight * F.cross_entropy(z, labels, reduction="none")
    return loss


# ---------------------------------------------------------------------------- closed-form gradients
def divergence_and_grad(kind: str, lp: torch.Tensor, lq: torch.Tensor, beta: float, eta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(divergence per row [N], its gradient [N, M] with respect to the logits s of q = softmax(s))
    for log-probabilities ``lp``, ``lq`` [N, M]: the closed forms of ``DIVERGENCES``' derivatives
    (and the LK losses', from losses/acceptance.py), a few passes over [N, M] instead of
    autograd's dozen. With g = dL/dq the gradient is q * (g - sum(q g)): fkl gives q - p outright."""
    if kind in LK_KINDS:
        return lk_and_grad(kind, lp, lq, eta)
    q = lq.exp()
    if kind == "fkl":
        return _xlogy_diff(lp, lq), q - lp.exp()
    if kind == "rkl":
        loss = _xlogy_diff(lq, lp)
        return loss, q * (lq - lp - loss[:, None])
    if kind == "jsd":
        lm = torch.logaddexp(lp + math.log(beta), lq + math.log1p(-beta))
        loss = beta * _xlogy_diff(lp, lm) + (1 - beta) * _xlogy_diff(lq, lm)
        g = (1 - beta) * (lq - lm)
    else:  # tvd
        d = q - lp.exp()
        loss = 0.5 * d.abs().sum(-1)
        g = 0.5 * d.sign()
    return loss, q * (g - (q * g).sum(-1, keepdim=True))


def row_loss_and_grad(z: torch.Tensor, zt: torch.Tensor, labels: torch.Tensor, cfg: DraftLMLoss):
    """(``row_loss`` [N], its gradient with respect to ``z`` [N, V], metrics' per-row
    (draft argmax == target argmax, 1 - TV(p, q)) [N]) for float draft logits ``z`` and target
    logits ``zt``. Top-k: the bucket-level gradient G (k + 1 outcomes) reaches a token of the
    rest bucket in proportion to its share of that bucket, q_v / q_rest."""
    t = cfg.temperature
    lq = F.log_softmax(z / t, -1)
    lp = F.log_softmax(zt / t, -1)
    q, p = lq.exp(), lp.exp()
    hit = lq.max(-1).indices == lp.max(-1).indices
    accept = 1 - 0.5 * (p - q).abs_().sum(-1)
    del q, p
    if cfg.kind == "ce":
        loss, grad = z.new_zeros(z.shape[0]), None
    elif cfg.top_k:
        k = min(cfg.top_k, z.shape[-1])
        idx = lp.topk(k, dim=-1).indices
        bp, bq = bucket_top_k(lp, lq, k, idx)
        loss, G = divergence_and_grad(cfg.kind, bp, bq, cfg.beta, cfg.eta)
        grad = (lq - bq[:, k:]).exp_().mul_(G[:, k:])  # rest bucket: q_v / q_rest * G_rest
        grad.scatter_(-1, idx, G[:, :k])
        grad.div_(t)
    else:
        loss, grad = divergence_and_grad(cfg.kind, lp, lq, cfg.beta, cfg.eta)
        grad.div_(t)
    del lp, lq
    if cfg.kind == "ce" or cfg.ce_weight:
        w = 1.0 if cfg.kind == "ce" else cfg.ce_weight
        ls = F.log_softmax(z, -1)
        loss = loss + w * -ls.gather(-1, labels[:, None])[:, 0]
        g_ce = ls.exp_().scatter_add_(-1, labels[:, None], -torch.ones_like(ls[:, :1])).mul_(w)
        grad = g_ce if grad is None else grad.add_(g_ce)
    return loss, grad, (hit, accept)


# ---------------------------------------------------------------------------- the chunked loss
class _ChunkedLoss(torch.autograd.Function):
    """Mean ``row_loss`` over N rows of draft hidden states h [N, H] read out by ``weight``
    [V, H], against the target's logits ``teacher @ teacher_weight.T``. The forward pass computes
    the gradients of h and weight chunk by chunk and keeps those (N x H and V x H), never a
    V-wide tensor of all rows."""

    @staticmethod
    def forward(ctx, h, weight, teacher, teacher_weight, labels, cfg: DraftLMLoss, stats: dict):
        N = h.shape[0]
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.zeros_like(h) if want_h else None
        grad_w = torch.zeros_like(weight) if want_w else None
        total = h.new_zeros((), dtype=torch.float32)
        hits = accept = 0.0
        for s in range(0, N, cfg.chunk):
            e = min(N, s + cfg.chunk)
            hc = h[s:e]
            zt = F.linear(teacher[s:e], teacher_weight).float()
            z = F.linear(hc, weight).float()
            loss, gz, (hit, acc) = row_loss_and_grad(z, zt, labels[s:e], cfg)
            del z, zt
            total += loss.sum()
            hits += float(hit.sum())
            accept += float(acc.sum())
            gz = gz.to(h.dtype)
            if want_h:
                grad_h[s:e] = gz @ weight
            if want_w:
                grad_w.addmm_(gz.T, hc)
        n = max(N, 1)
        stats.update(acc=hits / n, accept=accept / n)
        ctx.save_for_backward(grad_h, grad_w)
        ctx.n = n
        return total / n

    @staticmethod
    def backward(ctx, g):
        grad_h, grad_w = ctx.saved_tensors
        scale = g / ctx.n
        return (
            grad_h * scale if grad_h is not None else None,
            grad_w * scale if grad_w is not None else None,
            None, None, None, None, None,
        )


def distill_loss(
    h: torch.Tensor,
    weight: torch.Tensor,
    teacher: torch.Tensor,
    teacher_weight: torch.Tensor,
    labels: torch.Tensor,
    cfg: DraftLMLoss,
) -> tuple[torch.Tensor, dict]:
    """-> (mean loss over the N rows, metrics). ``h`` [N, H]: the draft's final (normed) hidden
    states at the counted positions, ``weight`` [V, H] its lm_head; ``teacher`` [N, H']: the
    target's final hidden states at the same positions, ``teacher_weight`` [V, H'] its lm_head
    (frozen); ``labels`` [N]: the data's next tokens. Metrics: ``acc``, how often the draft's
    argmax is the target's; ``accept``, the mean 1 - TV(p, q), the expected acceptance of
    speculative sampling at ``cfg.temperature``. With no rows the loss is an exact 0."""
    stats: dict = {}
    loss = _ChunkedLoss.apply(h, weight, teacher.to(teacher_weight.dtype), teacher_weight, labels, cfg, stats)
    return loss, stats
