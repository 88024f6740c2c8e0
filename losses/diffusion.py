"""Block-diffusion (DFlash-style) drafter objectives as pure functions of per-position tensors.

Block convention: one forward proposes J = block_size - 1 drafts; index j = 0..J-1 of every
[N, J] input stands for block slot j + 1. Lossless verification accepts the longest matching
prefix, so with a_j the probability that slot j is accepted the expected accepted length is

    E[streak] = sum_j prod_{i<=j} a_i.

Inputs: ``log_accept`` = log a_j (-inf where the target token is outside the draft vocabulary),
``ce`` = per-slot cross-entropy l_j (+inf there; non-finite entries are never counted) and
``mask`` (False past the sequence end or on non-assistant tokens). For the streak family a False
entry ends the streak: only the counted prefix before the first False contributes. Every loss
is divided by N_b, the number of blocks with at least one counted position.

    (a) ce:        sum_j w_j l_j,  w_k = exp(-(k-1)/gamma)        (DFlash, arXiv 2602.06036)
    (b) streak:    -E[streak]                                      (SpecDiff-2, arXiv 2511.00606)
    (c) ce_streak: sum_j sg(prod_{i<j} a_i) l_j                    (SpecDiff-2)
    (d) dpace:     sum_j sg(W_j) l_j,  W_j = sum_{k>=j} prod_{i<=k} ((1-alpha) a_i + alpha)
                                                                   (D-PACE, speculators)
    (e) nla, lk_hybrid: sum_j w_j LK_j, (a) with each slot's CE replaced by an LK acceptance
                   loss (losses/acceptance.py; ``kl`` per slot: the CE less the target's entropy)

Why (c) and (d) weight slots this way: dE/dlog a_j = sum_{k>=j} prod_{i<=k} a_i, so a later
slot only gets gradient once the earlier ones are right; (d) is that gradient with a smoothed a
(so late slots still learn early in training) applied to the CE, (c) keeps only its leading term.
Products are taken in log space (cumsum of log a, then exp) so long blocks of small
probabilities underflow cleanly to 0 instead of producing NaN.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from draftlab.losses.acceptance import ETA, KINDS as LK_KINDS, lk_loss

LOSSES = ("ce", "streak", "ce_streak", "dpace", *LK_KINDS)


def _at_least_f32(x: torch.Tensor) -> torch.Tensor:
    # half-precision logits lose too much in log_softmax; float64 (tests) is kept as is
    return x.to(torch.promote_types(x.dtype, torch.float32))


def position_weights(J: int, gamma: float, device=None) -> torch.Tensor:
    """DFlash's per-slot weights w_k = exp(-(k-1)/gamma), k = 1..J: early slots gate the streak."""
    return torch.exp(-torch.arange(J, dtype=torch.float32, device=device) / gamma)


def token_terms(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log q(y), -log q(y)) per slot for draft-vocab ``labels`` [N, J]; -1 (outside the draft
    vocabulary) gives (-inf, +inf). The gather uses a clamped index and the -inf is put in with
    torch.where, so such slots get an exact zero gradient rather than NaN."""
    logq = F.log_softmax(_at_least_f32(logits) / temperature, dim=-1)
    valid = labels >= 0
    picked = logq.gather(-1, labels.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    log_accept = torch.where(valid, picked, torch.full_like(picked, float("-inf")))
    return log_accept, -log_accept


def distribution_terms(
    logits: torch.Tensor, target_probs: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log sum_v min(p_v, q_v), -sum_v p_v log q_v) per slot: the first is the acceptance
    probability of lossless rejection sampling with drafts sampled from q, ``target_probs``
    [N, J, V] the target's distribution renormalised to the draft vocabulary."""
    logq = F.log_softmax(_at_least_f32(logits) / temperature, dim=-1)
    p = target_probs.to(logq.dtype)
    accept = torch.minimum(p, logq.exp()).sum(-1)
    # disjoint supports give a == 0: clamp so log stays finite (and its gradient is exactly 0)
    return accept.clamp_min(1e-30).log(), -(p * logq).sum(-1)


def _num_blocks(counted: torch.Tensor) -> torch.Tensor:
    return counted.any(-1).sum().clamp_min(1)


def _streak_prefix(mask: torch.Tensor) -> torch.Tensor:
    """True up to (excluding) the first uncounted slot of each block."""
    return mask.bool().long().cumprod(-1).bool()


def _finite_ce(ce: torch.Tensor, counted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # select before any arithmetic so a dropped +inf gets an exact zero gradient, not inf * 0
    counted = counted & torch.isfinite(ce)
    return torch.where(counted, ce, torch.zeros_like(ce)), counted


def _prefix_products(log_a: torch.Tensor, prefix: torch.Tensor) -> torch.Tensor:
    """prod_{i<=j} a_i via exp(cumsum log a), and 0 after the streak prefix ends."""
    cum = torch.where(prefix, log_a, torch.zeros_like(log_a)).cumsum(-1)
    return torch.where(prefix, cum.exp(), torch.zeros_like(cum))


def weighted_ce_loss(ce: torch.Tensor, mask: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """(a) sum_{n,j} w_j l_nj over counted slots / N_b (DFlash, SpecForge, speculators)."""
    ce, counted = _finite_ce(ce, mask.bool())
    return (weights.to(ce) * ce).sum() / _num_blocks(counted)


def expected_streak(log_accept: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """sum_j prod_{i<=j} a_i per block [N]. Differentiable; detach it when used as a metric."""
    return _prefix_products(log_accept, _streak_prefix(mask)).sum(-1)


def streak_loss(log_accept: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(b) -E[streak] averaged over blocks whose first slot counts."""
    prefix = _streak_prefix(mask)
    return -_prefix_products(log_accept, prefix).sum() / _num_blocks(prefix)


def ce_streak_loss(log_accept: torch.Tensor, ce: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(c) sum_{n,j} sg(prod_{i<j} a_ni) l_nj / N_b over the counted prefix."""
    prefix = _streak_prefix(mask)
    with torch.no_grad():
        incl = _prefix_products(log_accept, prefix)
        # exclusive product: shift right and start at the empty product 1 (no -inf - -inf NaN)
        excl = torch.cat([torch.ones_like(incl[..., :1]), incl[..., :-1]], dim=-1)
    ce, counted = _finite_ce(ce, prefix)
    return (excl.to(ce) * ce).sum() / _num_blocks(counted)


def dpace_weights(log_accept: torch.Tensor, mask: torch.Tensor, alpha: float = 0.5) -> torch.Tensor:
    """W_j = sum_{k>=j} prod_{i<=k} ((1-alpha) a_i + alpha), 0 after the prefix ends (detached)."""
    prefix = _streak_prefix(mask)
    with torch.no_grad():
        smooth = (1 - alpha) * log_accept.exp() + alpha
        prods = _prefix_products(smooth.log(), prefix)
        return prods.flip(-1).cumsum(-1).flip(-1) * prefix


def dpace_loss(
    log_accept: torch.Tensor, ce: torch.Tensor, mask: torch.Tensor, alpha: float = 0.5
) -> torch.Tensor:
    """(d) sum_{n,j} W_nj l_nj / N_b: the CE weighted by the gradient of a smoothed E[streak]."""
    w = dpace_weights(log_accept, mask, alpha)
    ce, counted = _finite_ce(ce, _streak_prefix(mask))
    return (w.to(ce) * ce).sum() / _num_blocks(counted)


def block_loss(
    kind: str,
    log_accept: torch.Tensor,
    ce: torch.Tensor,
    mask: torch.Tensor,
    *,
    gamma: float,
    alpha: float,
    kl: torch.Tensor | None = None,
    eta: float = ETA,
) -> torch.Tensor:
    """One of ``LOSSES``: gamma is (a)'s and (e)'s weight decay, alpha (d)'s smoothing; (e) reads
    KL(p || q) per slot, ``kl`` (the CE itself for one-hot targets, the default), and eta."""
    if kind == "ce":
        return weighted_ce_loss(ce, mask, position_weights(ce.shape[-1], gamma, ce.device))
    if kind in LK_KINDS:
        per_slot = lk_loss(kind, log_accept, ce if kl is None else kl, eta)
        return weighted_ce_loss(per_slot, mask, position_weights(ce.shape[-1], gamma, ce.device))
    if kind == "streak":
        return streak_loss(log_accept, mask)
    if kind == "ce_streak":
        return ce_streak_loss(log_accept, ce, mask)
    if kind == "dpace":
        return dpace_loss(log_accept, ce, mask, alpha)
    raise ValueError(f"unknown block loss {kind!r}; expected one of {', '.join(LOSSES)}")
