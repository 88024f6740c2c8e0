"""Domino: the block diffusion (DFlash) drafter of models/diffusion.py plus a causal correction
of its logits (arXiv 2605.29707; SpecForge ``modeling/draft/domino.py``; served by SGLang's
DFLASH path when ``dflash_config.projector_type`` is ``domino``, export/domino.py).

The backbone drafts a whole block in one forward, each slot blind to the tokens drafted before it
in the block. Domino adds, for draft position j (slot j + 1 of the block):

* a GRU (one layer, no bias, input the target's embedding) over the block's tokens before the
  slot, ``[x_p, t_1, ..., t_j]`` (the anchor, then what slots 1..j hold): its state g_j;
* a correction ``Linear(emb_dim -> V_draft)(SiLU(Linear(H + G -> emb_dim)([z_j; g_j])))`` added
  to the backbone's (base) logits of z_j, the slot's final-normed state, at positions
  j >= ``pure_draft_prefix_len``; earlier positions keep the base logits.

Decoding (inference/domino.py) takes the drafts left to right: with the prefix length 1 the
first is the backbone's argmax, the GRU reads [verified token, first draft], and each draft it
corrects is fed back. Training teacher-forces the previous tokens (the tokens an accepted draft
holds, as DSpark's Markov head is trained) and minimises ``(1 - lambda) L(final) + lambda
L(base)`` with lambda falling linearly from ``loss.lambda_start`` to 0 over the first
``loss.lambda_decay`` of training (SpecForge's ``linear_lambda_base``): the backbone learns to
draft alone before the correction takes over. The trainer gives the step (``set_progress``).

Tensor names are SpecForge's / SGLang's: ``prefix_gru.weight_ih_l0`` [3G, H],
``prefix_gru.weight_hh_l0`` [3G, G], ``embed_proj.0.weight`` [emb_dim, H + G],
``embed_proj.2.weight`` [V_draft, emb_dim].
"""

from __future__ import annotations

import torch
import torch.nn as nn
from pydantic import Field, StrictInt, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from draftlab.models.diffusion import DiffusionConfig, DiffusionDrafter, DiffusionLoss, DiffusionMeta
from draftlab.models.drafter import DRAFTERS, LayerWidth
from draftlab.models.layers import LayerShape


class DominoConfig(DiffusionConfig):
    gru_hidden_dim: int = Field(256, ge=1, description="width G of the GRU over the block's previous tokens")
    emb_dim: int = Field(256, ge=1, description="correction width: Linear(H + G -> emb_dim), SiLU, Linear(emb_dim -> V_draft)")
    pure_draft_prefix_len: int = Field(
        1, ge=0, description="draft positions the backbone drafts alone (1: the first draft is its argmax, as SGLang serves); "
        "the correction applies from this position on"
    )

    @field_validator("pure_draft_prefix_len")
    @classmethod
    def _inside_block(cls, v, info: ValidationInfo):
        most = info.data.get("block_size", 2) - 2  # block_size is validated first; the correction must reach a draft
        if v > most:
            raise PydanticCustomError("prefix", "must be at most block_size - 2 = {most} (the block drafts {n}), got {v}",
                                      {"most": most, "n": most + 1, "v": v})
        return v


class DominoMeta(DiffusionMeta):
    gru_hidden_dim: LayerWidth
    emb_dim: LayerWidth
    pure_draft_prefix_len: StrictInt

    @field_validator("pure_draft_prefix_len")
    @classmethod
    def _inside_block(cls, v, info: ValidationInfo):
        most = info.data.get("block_size", 2) - 2
        if not 0 <= v <= most:
            raise PydanticCustomError("meta_range", "is outside 0..{most} (block_size - 2: the correction applies to a draft)",
                                      {"most": most})
        return v


class DominoLoss(DiffusionLoss):
    lambda_start: float = Field(1.0, ge=0, le=1, description="lambda at step 0 of L = (1 - lambda) L(final) + lambda L(base)")
    lambda_decay: float = Field(
        0.5, gt=0, le=1, description="fraction of training over which lambda falls linearly to 0 (SpecForge's lambda_base_decay_ratio)"
    )


@DRAFTERS.register()
class DominoDrafter(DiffusionDrafter):
    algorithm = "domino"
    Config = DominoConfig
    Loss = DominoLoss
    Meta = DominoMeta

    def __init__(self, *args, gru_hidden_dim: int, emb_dim: int, pure_draft_prefix_len: int, **kwargs):
        super().__init__(*args, **kwargs)
        H = self.shape.hidden_size
        self.pure_draft_prefix_len = pure_draft_prefix_len
        self.prefix_gru = nn.GRU(H, gru_hidden_dim, num_layers=1, batch_first=True, bias=False)
        self.embed_proj = nn.Sequential(
            nn.Linear(H + gru_hidden_dim, emb_dim, bias=False), nn.SiLU(), nn.Linear(emb_dim, self.draft_vocab_size, bias=False)
        )
        self.progress: tuple[int, int] | None = None  # (steps done, total) while training: set_progress

    # ---- construction -------------------------------------------------------------
    @classmethod
    def config_meta(cls, cfg: DominoConfig, target, samples=None) -> dict:
        return {**super().config_meta(cfg, target, samples), "gru_hidden_dim": cfg.gru_hidden_dim, "emb_dim": cfg.emb_dim,
                "pure_draft_prefix_len": cfg.pure_draft_prefix_len}

    @torch.no_grad()
    def init_weights(self, cfg: DominoConfig, target, samples=None) -> None:
        super().init_weights(cfg, target, samples)
        # a zero output layer: training starts from the backbone's own drafts (the GRU keeps torch's init)
        nn.init.zeros_(self.embed_proj[2].weight)

    def meta(self) -> dict:
        return {**super().meta(), "gru_hidden_dim": self.prefix_gru.hidden_size, "emb_dim": self.embed_proj[0].out_features,
                "pure_draft_prefix_len": self.pure_draft_prefix_len}

    @classmethod
    def from_meta(cls, meta: dict, target) -> "DominoDrafter":
        m = cls(
            LayerShape(**meta["shape"]), meta["vocab_size"], meta["draft_vocab_size"], meta["target_layers"], meta["num_layers"],
            meta["block_size"], meta["mask_token_id"], meta["normalize_fc_input"],
            gru_hidden_dim=meta["gru_hidden_dim"], emb_dim=meta["emb_dim"], pure_draft_prefix_len=meta["pure_draft_prefix_len"],
        )
        m.num_target_layers = meta["num_target_layers"]
        return m.attach(target)

    # ---- the correction -------------------------------------------------------------
    def token_embeddings(self, tokens: torch.Tensor) -> torch.Tensor:
        """The target's embedding of target ids [...]: the GRU's input [..., H]."""
        return self._embed(tokens).to(self.fc.weight.dtype)

    def gru_step(self, tokens: torch.Tensor, state: torch.Tensor | None) -> torch.Tensor:
        """The GRU state [n, G] after reading ``tokens`` Long[n] from ``state`` [n, G] (None: the start)."""
        return self.prefix_gru(self.token_embeddings(tokens)[:, None], None if state is None else state[None])[1][0]

    def correction(self, states: torch.Tensor, gru: torch.Tensor) -> torch.Tensor:
        """Draft-vocab logit correction [..., V_draft] of slot states [..., H] whose GRU states are ``gru`` [..., G]."""
        return self.embed_proj(torch.cat([states, gru], -1))

    def slot_logits(self, states: torch.Tensor, prev: torch.Tensor, base: torch.Tensor | None = None) -> torch.Tensor:
        """Final logits [..., J, V_draft] of the block's draft positions, states [..., J, H], whose
        previous tokens are ``prev`` [..., J] (target ids): position j's GRU has read
        ``prev[..., : j + 1]``. Positions before ``pure_draft_prefix_len`` keep the base logits
        (``base``: ``readout(states)`` where the caller has them)."""
        P, J = self.pure_draft_prefix_len, prev.shape[-1]
        base = self.readout(states) if base is None else base
        x = self.token_embeddings(prev.reshape(-1, J))
        gru = self.prefix_gru(x)[0].view(*prev.shape, -1)
        corrected = base[..., P:, :] + self.correction(states[..., P:, :], gru[..., P:, :])
        return torch.cat([base[..., :P, :], corrected], -2)

    # ---- training ------------------------------------------------------------------------
    def set_progress(self, step: int, total_steps: int) -> None:
        self.progress = (step, total_steps)

    def base_weight(self, cfg: DominoLoss) -> float:
        """lambda of the step :meth:`set_progress` gave: ``lambda_start`` falling linearly to 0 over
        the first ``lambda_decay`` of the steps; 0 (the final logits alone) outside training."""
        if self.progress is None:
            return 0.0
        step, total = self.progress
        decay = max(1, int(total * cfg.lambda_decay))
        return max(0.0, min(1.0, cfg.lambda_start * (1.0 - min(step / decay, 1.0))))

    def training_loss(self, batch, hidden, cfg: DominoLoss):
        batch, anchors, states, targets = self.training_blocks(batch, hidden, cfg)
        prev = self.held_tokens(batch["input_ids"], anchors, targets, cfg.targets)  # the GRU reads them teacher-forced
        base = self.readout(states)
        final = self.slot_logits(states, prev, base)
        lam = self.base_weight(cfg)
        final_loss, metrics, _ = self.block_objective(final, targets, hidden, cfg)
        # at lambda 0 the base term has no gradient to give: its value alone, without a backward
        with torch.set_grad_enabled(torch.is_grad_enabled() and lam > 0):
            base_loss, base_metrics, _ = self.block_objective(base, targets, hidden, cfg)
        # every weight is in the final term's graph (DDP), also at lambda 1
        loss = (1.0 - lam) * final_loss + lam * base_loss
        metrics.update({
            "lambda": lam,
            "final_loss": final_loss.item(),
            "base_loss": base_loss.item(),
            "base_acc": base_metrics["acc"],
            "base_accepted": base_metrics["accepted"],
        })
        return loss, metrics
