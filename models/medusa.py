"""Medusa-1 heads (Cai et al. 2024, arXiv 2401.10774; FasterDecoding/Medusa; the loss:
losses/medusa.py).

N heads read the target's last hidden state h_t (after its final norm, ``hidden[L]``) and head i
(0-based) predicts token x_{t+2+i}: the target's own lm_head already gives x_{t+1}, so one target
forward yields 1 + N tokens to try. Head i is ``num_layers`` residual blocks ``x + SiLU(W x + b)``
(distinct weights per block, zero-initialised, so every head starts as the identity) and a
projection onto the draft vocabulary initialised from the target's lm_head rows: before
training each head predicts what the target predicts for x_{t+1}, a far better start than
random. The target stays frozen (Medusa-1); its lm_head is shared by reference, never saved.

The draft vocabulary is the full target vocabulary or, with ``draft_vocab_size``, the most
frequent assistant tokens of the training data (``d2t``/``t2d`` as EAGLE-3): each head's
projection then costs ``V_draft / V`` of a full one, in training and in decoding.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn as nn
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field

from draftlab.losses.acceptance import AcceptanceLossFields
from draftlab.losses.eagle import DISTRIBUTION_KINDS, predicted_mask, shift_left
from draftlab.losses.medusa import data_loss, distill_loss, head_weights, topk_agreement
from draftlab.models.drafter import (
    DRAFTERS,
    MAX_HEADS,
    Count,
    Drafter,
    DrafterDepth,
    DrafterMeta,
    DraftVocabSize,
    TargetHiddenSize,
    TargetNumLayers,
    TargetVocabSize,
)

TOPK_METRIC = 5  # the `top5` metric: how often the target's token is among a head's 5 best


class MedusaConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    num_heads: int = Field(3, ge=1, description="heads; head i predicts the token i + 2 after the last verified one")
    num_layers: int = Field(1, ge=1, description="residual blocks x + SiLU(Wx + b) per head")
    draft_vocab_size: int = Field(0, ge=0, description="0 = the full target vocabulary; else its N most frequent assistant tokens")


class MedusaMeta(DrafterMeta):
    hidden_size: TargetHiddenSize
    vocab_size: TargetVocabSize
    draft_vocab_size: DraftVocabSize
    num_heads: Count(1, MAX_HEADS, "heads a drafter may have")
    num_layers: DrafterDepth  # residual blocks per head
    num_target_layers: TargetNumLayers


class MedusaLoss(AcceptanceLossFields):
    model_config = ConfigDict(extra="forbid")

    kind: Literal[DISTRIBUTION_KINDS] = Field(  # type: ignore[valid-type]
        "ce", description="ce: cross-entropy to the targets; nla | lk_hybrid: the LK acceptance losses against them"
    )
    head_weight: float = Field(1.0, gt=0, description="lambda: head i's loss is weighted lambda * decay**i")
    decay: float = Field(0.8, gt=0)
    targets: Literal["target", "data"] = Field(
        "target",
        description="target: soft CE to the target's own distribution over the draft vocab (self-distillation); "
        "data: CE to the data's tokens (tokens outside the draft vocab are left out)",
    )


class ResidualBlocks(nn.Module):
    """``x <- x + SiLU(W_l x + b_l)`` for each of ``num_layers`` linears; zero-initialised, so the
    stack starts as the identity. Named ``layers.{l}`` as vLLM's ``ResidualBlock``."""

    def __init__(self, hidden_size: int, num_layers: int):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(hidden_size, hidden_size) for _ in range(num_layers)])
        for layer in self.layers:
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + F.silu(layer(x))
        return x


@DRAFTERS.register()
class MedusaDrafter(Drafter):
    algorithm = "medusa"
    Config = MedusaConfig
    Loss = MedusaLoss
    Meta = MedusaMeta
    vocab_maps = ("d2t", "t2d")

    def __init__(self, hidden_size: int, vocab_size: int, draft_vocab_size: int, num_heads: int, num_layers: int):
        super().__init__()
        # plain sizes: a decoding copy (kernels/cpu_gemm.py) swaps the nn.Linear modules out
        self.hidden_size, self.vocab_size, self.draft_vocab_size = hidden_size, vocab_size, draft_vocab_size
        self.blocks = nn.ModuleList([ResidualBlocks(hidden_size, num_layers) for _ in range(num_heads)])
        self.lm_heads = nn.ModuleList([nn.Linear(hidden_size, draft_vocab_size, bias=False) for _ in range(num_heads)])
        self.add_vocab_maps(vocab_size, draft_vocab_size)
        self.num_target_layers = None  # set by build/from_meta: hidden[L] is what the heads read

    @property
    def num_heads(self) -> int:
        return len(self.blocks)

    @property
    def num_layers(self) -> int:
        return len(self.blocks[0].layers)

    # ---- construction -------------------------------------------------------
    @classmethod
    def default_capture_layers(cls, num_target_layers: int) -> list[int]:
        return [num_target_layers]

    @classmethod
    def config_meta(cls, cfg: MedusaConfig, target, samples=None) -> dict:
        V = target.vocab_size
        return {
            "hidden_size": target.hidden_size,
            "vocab_size": V,
            "draft_vocab_size": cfg.draft_vocab_size if 0 < cfg.draft_vocab_size < V else V,
            "num_heads": cfg.num_heads,
            "num_layers": cfg.num_layers,
            "num_target_layers": target.num_layers,
        }

    def init_weights(self, cfg: MedusaConfig, target, samples=None) -> None:
        self.fill_vocab_maps(samples)
        with torch.no_grad():  # every head starts as the target's own read-out of the draft vocab
            rows = self.draft_rows(target.lm_head.weight)
            for head in self.lm_heads:
                head.weight.copy_(rows)

    def meta(self) -> dict:
        return {
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "num_heads": self.num_heads,
            "num_layers": self.num_layers,
            "num_target_layers": self.num_target_layers,
        }

    @classmethod
    def from_meta(cls, meta: dict, target) -> "MedusaDrafter":
        m = cls(meta["hidden_size"], meta["vocab_size"], meta["draft_vocab_size"], meta["num_heads"], meta["num_layers"])
        m.num_target_layers = meta["num_target_layers"]
        return m.attach(target)

    # ---- the heads ------------------------------------------------------------------
    @property
    def capture_layers(self) -> list[int]:
        return [self.num_target_layers]

    def head_logits(self, h: torch.Tensor, i: int) -> torch.Tensor:
        """Head ``i``'s draft-vocab logits [..., V_draft] for final hidden states h [..., H]."""
        return self.lm_heads[i](self.blocks[i](h.to(self.lm_heads[i].weight.dtype)))

    # ---- training targets ---------------------------------------------------------------
    derived_targets = Drafter.next_token_targets

    def training_loss(self, batch, hidden, cfg: MedusaLoss):
        ids, loss_mask = batch["input_ids"], batch["loss_mask"].bool()
        B, T = ids.shape
        if "target_argmax" not in batch:  # not supplied (cached) by the trainer
            batch = {**batch, **self.derived_targets(hidden, batch)}
        final = hidden[self.num_target_layers]
        # Head i at t imitates the target at s = t+1+i. The target is needed only at the s with
        # loss_mask[s+1]: compute it there, compactly, and gather rows per head.
        need = shift_left(loss_mask, 1, fill=False)
        row = (need.flatten().cumsum(0) - 1).view(B, T)
        greedy = batch["target_argmax"][need]
        probs = self.target_draft_probs(final[need]) if cfg.targets == "target" else None
        labels = self.to_draft_ids(ids) if cfg.targets == "data" else None
        return self.heads_loss(final, loss_mask, row, probs, labels, greedy, cfg)

    def heads_loss(self, h, loss_mask, row, probs, labels, greedy, cfg: MedusaLoss):
        """The heads' weighted loss on hidden states ``h`` [B, T, H] and their metrics. Head i at
        t counts where x_{t+2+i} is an assistant token and imitates the target at s = t+1+i,
        whose compact row is ``row`` [B, T]: ``probs[row]`` (distillation) or the data's
        ``labels`` [B, T] (draft ids); ``greedy[row]`` is the target's greedy token there."""
        loss = h.new_zeros((), dtype=torch.float32)
        head_loss, top1, top5 = [], [], []
        for i, w in enumerate(head_weights(self.num_heads, cfg.head_weight, cfg.decay)):
            counted = predicted_mask(loss_mask, i)  # x_{t+2+i} is an assistant token
            r = shift_left(row, 1 + i, fill=-1)[counted]  # the target's row at s = t+1+i
            logits = self.head_logits(h[counted], i)
            if probs is not None:
                li = distill_loss(logits, probs[r], cfg.kind, cfg.eta)
            else:
                li = data_loss(logits, shift_left(labels, 2 + i, fill=-1)[counted], cfg.kind, cfg.eta)
            loss = loss + w * li
            with torch.no_grad():  # agreement with the target's greedy token; outside the draft vocab = miss
                ranked = self.to_target_ids(logits.topk(min(TOPK_METRIC, logits.shape[-1]), dim=-1).indices)
                a1, a5 = topk_agreement(ranked, greedy[r])
            head_loss.append(li.item())
            top1.append(a1)
            top5.append(a5)
        return loss, {"loss_heads": head_loss, "acc": top1, "top5": top5}
