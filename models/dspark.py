"""DSpark: the block diffusion (DFlash) drafter of models/diffusion.py plus two heads over its
final-normed slot states (the DSpark paper; speculators 0.9.0 ``models/dspark``; served by vLLM
``method: dspark`` and SGLang ``DSPARK``, export/dspark.py).

* Markov head: a low-rank logit bias ``B[prev] = W2 W1[prev]`` indexed by the target-vocabulary
  token before each slot, so slot k's draft conditions on slot k - 1's (the anchor for slot 1).
  The backbone's slots are drafted in parallel and know nothing of each other's choice; the bias
  is a cheap first-order correction, applied left to right while decoding
  (inference/dspark.py). ``gated`` scales W1[prev] by a sigmoid gate of [state; W1[prev]].
* Confidence head: a linear map of [state; W1[prev]] to the logit of the probability that the
  slot's draft is accepted given its prefix was; serving cuts a block where the product of these
  drops below a threshold (adaptive verification, ``Block.min_confidence``).

Training (``training_loss``): the diffusion family's block loss on the biased logits, plus
``loss.confidence_weight`` x BCE of the confidence against acceptance (greedy / data targets:
whether the drafted token is the target's greedy one; distribution targets: sum min(p, q)), plus
``loss.l1_weight`` x L1 between each slot's state and the target's final (normed) hidden state
at the position whose output the slot predicts. The previous token of slot k >= 2 is the token
slot k - 1 is trained toward (teacher forcing: the token it holds when its draft is accepted).

Tensor names are speculators' ``DSparkDraftModel``'s (``markov_head.markov_w1`` [V, r],
``markov_head.markov_w2`` [V_draft, r], ``markov_head.gate_proj``, ``confidence_head.proj``).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn as nn
import torch.nn.functional as F
from pydantic import Field

from draftlab.models.diffusion import DiffusionConfig, DiffusionDrafter, DiffusionLoss, DiffusionMeta
from draftlab.models.drafter import DRAFTERS, Count
from draftlab.models.layers import LayerShape

MARKOV_KINDS = ("vanilla", "gated")


class DSparkConfig(DiffusionConfig):
    markov_rank: int = Field(256, ge=1, description="rank r of the Markov logit bias W2 W1[prev] (W1: [V, r], W2: [V_draft, r])")
    markov_head_type: Literal[MARKOV_KINDS] = Field(  # type: ignore[valid-type]
        "vanilla", description="vanilla: the bias W2 W1[prev]; gated: W1[prev] scaled by a sigmoid gate of [state; W1[prev]]"
    )


class DSparkMeta(DiffusionMeta):
    markov_rank: Count(1, lambda t: t.vocab_size, "at most the target vocabulary")
    markov_head_type: Literal[MARKOV_KINDS]  # type: ignore[valid-type]


class DSparkLoss(DiffusionLoss):
    confidence_weight: float = Field(1.0, ge=0, description="weight of the confidence head's BCE against acceptance")
    l1_weight: float = Field(
        0.1, ge=0, description="weight of the L1 distance (mean over channels) of each slot's state to the target's final hidden state"
    )


class MarkovHead(nn.Module):
    def __init__(self, vocab_size: int, draft_vocab_size: int, rank: int, hidden_size: int, kind: str):
        super().__init__()
        self.kind = kind
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, draft_vocab_size, bias=False)
        self.gate_proj = nn.Linear(hidden_size + rank, rank) if kind == "gated" else None

    def embed(self, prev: torch.Tensor) -> torch.Tensor:
        return self.markov_w1(prev)

    def bias(self, states: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        """Draft-vocab logit bias [..., V_draft] of slot ``states`` [..., H] whose previous
        tokens have the embeddings ``emb`` [..., r]."""
        if self.gate_proj is not None:
            emb = emb * torch.sigmoid(self.gate_proj(torch.cat([states, emb], -1)))
        return self.markov_w2(emb)


class ConfidenceHead(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.proj = nn.Linear(width, 1)

    def forward(self, states: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        """Acceptance logit [...] of each slot."""
        return self.proj(torch.cat([states, emb], -1)).squeeze(-1)


@DRAFTERS.register()
class DSparkDrafter(DiffusionDrafter):
    algorithm = "dspark"
    Config = DSparkConfig
    Loss = DSparkLoss
    Meta = DSparkMeta

    def __init__(self, *args, markov_rank: int, markov_head_type: str = "vanilla", **kwargs):
        super().__init__(*args, **kwargs)
        H = self.shape.hidden_size
        self.markov_head = MarkovHead(self.vocab_size, self.draft_vocab_size, markov_rank, H, markov_head_type)
        self.confidence_head = ConfidenceHead(H + markov_rank)

    # ---- construction -------------------------------------------------------------
    @classmethod
    def config_meta(cls, cfg: DSparkConfig, target, samples=None) -> dict:
        return {**super().config_meta(cfg, target, samples), "markov_rank": cfg.markov_rank, "markov_head_type": cfg.markov_head_type}

    @torch.no_grad()
    def init_weights(self, cfg: DSparkConfig, target, samples=None) -> None:
        super().init_weights(cfg, target, samples)
        # W2 = 0: training starts from the backbone's own drafts (the init_from_target loss);
        # small random W1 rows give W2 its first gradient
        nn.init.normal_(self.markov_head.markov_w1.weight, std=0.01)
        nn.init.zeros_(self.markov_head.markov_w2.weight)

    def meta(self) -> dict:
        return {**super().meta(), "markov_rank": self.markov_head.markov_w1.embedding_dim, "markov_head_type": self.markov_head.kind}

    @classmethod
    def from_meta(cls, meta: dict, target) -> "DSparkDrafter":
        m = cls(
            LayerShape(**meta["shape"]), meta["vocab_size"], meta["draft_vocab_size"], meta["target_layers"], meta["num_layers"],
            meta["block_size"], meta["mask_token_id"], meta["normalize_fc_input"],
            markov_rank=meta["markov_rank"], markov_head_type=meta["markov_head_type"],
        )
        m.num_target_layers = meta["num_target_layers"]
        return m.attach(target)

    # ---- the heads ------------------------------------------------------------------
    def slot_logits(self, states: torch.Tensor, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(draft-vocab logits [..., V_draft], acceptance logits [...]) of slot ``states``
        [..., H] whose previous tokens (target ids) are ``prev`` [...]."""
        emb = self.markov_head.embed(prev)
        return self.readout(states) + self.markov_head.bias(states, emb), self.confidence_head(states, emb)

    # ---- training ------------------------------------------------------------------------
    def training_loss(self, batch, hidden, cfg: DSparkLoss):
        batch, anchors, states, targets = self.training_blocks(batch, hidden, cfg)
        prev = self.held_tokens(batch["input_ids"], anchors, targets, cfg.targets)  # the Markov head reads them teacher-forced
        logits, conf = self.slot_logits(states, prev)
        loss, metrics, (log_accept, hit) = self.block_objective(logits, targets, hidden, cfg)

        B, A, J = prev.shape
        m = targets["counted"].reshape(B * A, J)
        n = m.sum().clamp_min(1)
        accept = log_accept.exp().detach() if cfg.targets == "distribution" else hit.float()
        conf = conf.reshape(B * A, J).float()
        bce = F.binary_cross_entropy_with_logits(conf, accept, reduction="none")
        bce = torch.where(m, bce, 0.0).sum() / n
        final = hidden[self.num_target_layers]
        src = targets["source"].reshape(B, A * J)
        want = final.gather(1, src[..., None].expand(-1, -1, final.shape[-1])).to(states.dtype).view(B * A, J, -1)
        l1 = (states.reshape(B * A, J, -1) - want).abs().mean(-1)
        l1 = torch.where(m, l1, 0.0).sum() / n
        loss = loss + cfg.confidence_weight * bce + cfg.l1_weight * l1
        with torch.no_grad():
            p = torch.sigmoid(conf)
            metrics.update({
                "confidence_bce": bce.item(),
                "l1": l1.item(),
                "confidence_mean": (p[m].mean().item() if m.any() else 0.0),
                "confidence_abs_error": ((p - accept).abs()[m].mean().item() if m.any() else 0.0),
            })
        return loss, metrics
