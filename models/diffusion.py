"""Block diffusion drafter in DFlash's shape (arXiv 2602.06036; its losses:
losses/diffusion.py).

One drafter forward proposes a whole block. The block is ``[x_p, MASK x (gamma - 1)]`` at
positions p .. p + gamma - 1, where x_p is the last verified token (the anchor) and every
position before p has target features: slot k (1 <= k < gamma) predicts x_{p+k}. Inside the
block attention is bidirectional; every drafter layer also attends to the *context*, the
fused target features ``hidden_norm(fc([h_a1; h_a2; ...]))`` of positions < p, projected by
that layer's own k/v projections (with k_norm and RoPE at their true positions). The decoder
layers are Qwen3's (q/k RMSNorm per head) whatever the target's family, so checkpoints load
where DFlash drafters load (export/dflash.py); parameter names are speculators'
``DFlashDraftModel``'s. The target's embedding embeds the block (so the mask token is a
target-vocabulary id) and, with the full vocabulary, its lm_head reads the drafter out; with
a reduced draft vocabulary (``d2t``/``t2d`` as EAGLE-3) the drafter has its own lm_head,
initialised from the target's rows. Target-owned weights are shared by reference, never saved.

Layer indices are ``models/target.py``'s (= HF ``hidden_states`` indices), which are
speculators' ``aux_hidden_state_layer_ids``; z-lab's ``target_layer_ids`` are one lower.
"""

from __future__ import annotations

from typing import Annotated, Literal

import torch
import torch.nn as nn
from pydantic import BaseModel, ConfigDict, Field, StrictBool

from draftlab.errors import DraftlabError
from draftlab.losses.acceptance import KINDS as LK_KINDS, AcceptanceLossFields, entropy
from draftlab.losses.diffusion import LOSSES, block_loss, distribution_terms, expected_streak, token_terms
from draftlab.losses.eagle import shift_left
from draftlab.models.drafter import (
    DRAFTERS,
    MAX_BLOCK_SIZE,
    Count,
    DecoderInputIndex,
    Distinct,
    Drafter,
    DrafterDepth,
    DrafterMeta,
    DraftVocabSize,
    ShapeMeta,
    TargetNumLayers,
    TargetVocabSize,
    TokenId,
)
from draftlab.models.feature_scale import fill_measured_buffers
from draftlab.models.layers import DecoderLayer, LayerShape, RMSNorm, Rotary, rope


class DiffusionConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    num_layers: int = Field(1, ge=1, description="drafter decoder layers (Qwen3-style)")
    block_size: int = Field(8, ge=2, description="gamma: the anchor plus gamma - 1 masked positions, all drafted in one forward")
    target_layers: list[int] | None = Field(
        None, description="target hidden-state indices fused as context; default DFlash's rule for num_layers (default_target_layers)"
    )
    draft_vocab_size: int = Field(8192, ge=0, description="0 = the full target vocabulary (read out by the target's lm_head)")
    init_from_target: bool = Field(
        True, description="start layer i as a copy of the target's decoder layer L - num_layers + i, the context path as "
        "that layer's own input (init_from_target); false: identity layers, random fc"
    )
    normalize_fc_input: bool = Field(
        True, description="scale each fused input channel by 1/RMS measured on training data (folded into fc.weight on export)"
    )
    mask_token_id: int | None = Field(
        None, description="target-vocabulary id of the mask token; default: the highest id that never occurs in the training data"
    )


class DiffusionMeta(DrafterMeta):
    shape: ShapeMeta
    vocab_size: TargetVocabSize
    draft_vocab_size: DraftVocabSize
    # what serving engines capture (export/formats.py serving_aux_ids), each once, ascending
    target_layers: Annotated[list[DecoderInputIndex], Distinct(ascending=True)]
    num_layers: DrafterDepth
    block_size: Count(2, MAX_BLOCK_SIZE, "the anchor and up to 1023 drafts")
    mask_token_id: TokenId
    num_target_layers: TargetNumLayers
    normalize_fc_input: StrictBool = False


class DiffusionLoss(AcceptanceLossFields):
    model_config = ConfigDict(extra="forbid")

    kind: Literal[LOSSES] = Field(  # type: ignore[valid-type]
        "ce", description="ce: DFlash's exp(-(k-1)/gamma)-weighted CE; streak: -E[accepted prefix]; ce_streak; dpace; "
        "nla | lk_hybrid: ce's weights on the LK acceptance losses"
    )
    targets: Literal["greedy", "distribution", "data"] = Field(
        "greedy",
        description="greedy: the target's own greedy tokens (what greedy verification accepts); distribution: its "
        "distribution over the draft vocabulary (acceptance = sum min(p, q)); data: the data's tokens",
    )
    anchors: int = Field(16, ge=1, description="random blocks per sample per step")
    gamma: float = Field(7.0, gt=0, description="decay of the ce loss's position weights exp(-(k-1)/gamma)")
    temperature: float = Field(1.0, gt=0, description="drafter temperature at which the losses see q")
    dpace_alpha: float = Field(0.5, ge=0, le=1, description="D-PACE confidence smoothing")


def dflash_shape(target_config) -> LayerShape:
    """The target's layer sizes in a Qwen3 decoder layer (q/k norm, no q/k/v bias)."""
    return LayerShape.from_hf(target_config).model_copy(update={"model_type": "qwen3", "qk_norm": True, "attention_bias": False})


@DRAFTERS.register()
class DiffusionDrafter(Drafter):
    algorithm = "diffusion"
    Config = DiffusionConfig
    Loss = DiffusionLoss
    Meta = DiffusionMeta
    shares_embedding = True
    vocab_maps = ("d2t", "t2d")
    derived_keys = ("rotary.",)  # RoPE tables are rebuilt from the layer shape

    def __init__(
        self, shape: LayerShape, vocab_size: int, draft_vocab_size: int, target_layers: list[int], num_layers: int,
        block_size: int, mask_token_id: int, normalize_fc_input: bool = False,
    ):
        super().__init__()
        H = shape.hidden_size
        self.shape, self.vocab_size, self.draft_vocab_size = shape, vocab_size, draft_vocab_size
        self.target_layers, self.block_size, self.mask_token_id = list(target_layers), block_size, mask_token_id
        self.layers = nn.ModuleList([DecoderLayer(shape) for _ in range(num_layers)])
        # a fixed per-channel 1/RMS in front of fc (models/feature_scale.py), folded into fc on export
        self.register_buffer("fc_input_scale", torch.ones(len(target_layers) * H) if normalize_fc_input else None)
        self.fc = nn.Linear(len(target_layers) * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, shape.rms_norm_eps)
        self.norm = RMSNorm(H, shape.rms_norm_eps)
        # full vocabulary: the target's lm_head (shared, frozen); reduced: an own, trained one
        self.lm_head = nn.Linear(H, draft_vocab_size, bias=False) if draft_vocab_size < vocab_size else None
        self.add_vocab_maps(vocab_size, draft_vocab_size)
        self.rotary = Rotary(shape)
        self.num_target_layers = None  # set by build/from_meta: hidden[L] gives the training targets

    # ---- construction -------------------------------------------------------------

    @staticmethod
    def default_target_layers(num_target_layers: int, num_layers: int) -> list[int]:
        """DFlash's rule, z-lab ids ``round(1 + i (L - 4) / (n - 1))`` for n drafter layers
        (one layer: ``L // 2``), plus one for this project's (and speculators') indices."""
        L, n = num_target_layers, num_layers
        zlab = [L // 2] if n == 1 else [round(1 + i * (L - 4) / (n - 1)) for i in range(n)]
        return sorted({min(z + 1, L - 1) for z in zlab})  # a shallow target can map two ids to one

    @classmethod
    def default_capture_layers(cls, num_target_layers: int) -> list[int]:
        return sorted(set(cls.default_target_layers(num_target_layers, DiffusionConfig().num_layers)) | {num_target_layers})

    @classmethod
    def config_meta(cls, cfg: DiffusionConfig, target, samples=None) -> dict:
        L, V = target.num_layers, target.vocab_size
        return {
            "shape": dflash_shape(target.config).model_dump(),
            "vocab_size": V,
            "draft_vocab_size": cfg.draft_vocab_size if 0 < cfg.draft_vocab_size < V else V,
            "target_layers": cfg.target_layers or cls.default_target_layers(L, cfg.num_layers),
            "num_layers": cfg.num_layers,
            "block_size": cfg.block_size,
            "mask_token_id": cfg.mask_token_id if cfg.mask_token_id is not None else unused_token(samples, V),
            "num_target_layers": L,
            "normalize_fc_input": cfg.normalize_fc_input,
        }

    @torch.no_grad()
    def init_weights(self, cfg: DiffusionConfig, target, samples=None) -> None:
        fill_measured_buffers(self, target, self.target_layers, samples, cfg.normalize_fc_input)
        if cfg.init_from_target:
            self.init_from_target(target)
        else:  # identity layers (zero output projections): the block's embeddings read out
            for layer in self.layers:
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
        if self.lm_head is not None:  # start as the target's own read-out of the draft vocabulary
            self.lm_head.weight.copy_(self.draft_rows(target.lm_head.weight))

    @torch.no_grad()
    def init_from_target(self, target) -> None:
        """Start as the target's top layers reading their own input. Layer i copies target
        decoder layer L - n + i (attention, MLP, norms), and the context path passes the fused
        feature nearest to that layer's input through unchanged (fc selects it, undoing the
        input scale; hidden_norm takes that layer's input_layernorm gain), so the copied
        attention sees the keys and values it was trained on, and training starts from a lower
        loss (BENCHMARKS.md, "Diffusion drafter: initialisation")."""
        L, n, H = self.num_target_layers, len(self.layers), self.shape.hidden_size
        for i, layer in enumerate(self.layers):
            src = target.decoder_layer_state(L - n + i)
            layer.load_state_dict({k: src[k].float() if k in src and src[k].shape == v.shape else v for k, v in layer.state_dict().items()})
        j = min(range(len(self.target_layers)), key=lambda a: abs(self.target_layers[a] - (L - n)))
        scale = self.fc_input_scale[j * H : (j + 1) * H] if self.fc_input_scale is not None else torch.ones(H)
        self.fc.weight.zero_()
        self.fc.weight[:, j * H : (j + 1) * H] = torch.diag(1.0 / scale.to(self.fc.weight))
        self.hidden_norm.weight.copy_(target.decoder_layer_state(self.target_layers[j])["input_layernorm.weight"].float())

    def meta(self) -> dict:
        return {
            "shape": self.shape.model_dump(),
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "target_layers": self.target_layers,
            "num_layers": len(self.layers),
            "block_size": self.block_size,
            "mask_token_id": self.mask_token_id,
            "num_target_layers": self.num_target_layers,
            "normalize_fc_input": self.fc_input_scale is not None,
        }

    def export_state_dict(self):
        state = super().export_state_dict()
        if self.fc_input_scale is not None:
            state["fc.weight"] = state["fc.weight"] * state.pop("fc_input_scale")[None, :]
        return state

    def export_meta(self) -> dict:
        return {**self.meta(), "normalize_fc_input": False}

    @classmethod
    def from_meta(cls, meta: dict, target) -> "DiffusionDrafter":
        m = cls(
            LayerShape(**meta["shape"]), meta["vocab_size"], meta["draft_vocab_size"], meta["target_layers"], meta["num_layers"],
            meta["block_size"], meta["mask_token_id"], meta["normalize_fc_input"],
        )
        m.num_target_layers = meta["num_target_layers"]
        return m.attach(target)

    # ---- the network ------------------------------------------------------------------
    @property
    def capture_layers(self) -> list[int]:
        return sorted(set(self.target_layers) | {self.num_target_layers})

    def context(self, hidden: dict[int, torch.Tensor]) -> torch.Tensor:
        """Fused target features [B, T, H] of the positions they were captured at."""
        x = torch.cat([hidden[i] for i in self.target_layers], dim=-1).to(self.fc.weight.dtype)
        if self.fc_input_scale is not None:
            x = x * self.fc_input_scale
        return self.hidden_norm(self.fc(x))

    def context_kv(self, ctx: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's keys and values [B, h_kv, T, D] of the context ``ctx`` [B, T, H] at
        ``positions`` [B, T]: they depend on nothing else, so decoding caches them."""
        cos, sin = self.rotary(positions, ctx)
        out = []
        for layer in self.layers:
            a = layer.self_attn
            B, T, _ = ctx.shape
            k = a.k_norm(a.k_proj(ctx).view(B, T, a.num_kv_heads, a.head_dim).transpose(1, 2))
            v = a.v_proj(ctx).view(B, T, a.num_kv_heads, a.head_dim).transpose(1, 2)
            out.append((rope(k, cos, sin), v))
        return out

    def blocks(self, ids: torch.Tensor, positions: torch.Tensor, context_kv, mask: torch.Tensor) -> torch.Tensor:
        """Draft-vocab logits [B, Q, V_draft] of block tokens ``ids`` [B, Q] (anchors and mask
        tokens) at ``positions`` [B, Q]. ``mask`` bool [B, Q, C + Q]: which of the C context
        keys and the Q block keys each query sees (True = attend)."""
        return self.readout(self.block_states(ids, positions, context_kv, mask))

    def block_states(self, ids: torch.Tensor, positions: torch.Tensor, context_kv, mask: torch.Tensor) -> torch.Tensor:
        """The final-normed states [B, Q, H] that :meth:`readout` turns into :meth:`blocks`'
        logits (heads on top of the backbone, DSpark's, read them too)."""
        h = self._embed(ids).to(self.fc.weight.dtype)
        cos, sin = self.rotary(positions, h)
        for layer, (kc, vc) in zip(self.layers, context_kv):
            q, k, v = layer.self_attn.qkv(layer.input_layernorm(h), cos, sin)
            h = h + layer.self_attn.out(layer.self_attn.attend(q, torch.cat([kc, k], 2), torch.cat([vc, v], 2), mask=mask))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.norm(h)

    def readout(self, states: torch.Tensor) -> torch.Tensor:
        """Draft-vocab logits of final-normed states [..., H]."""
        return self.lm_head(states) if self.lm_head is not None else self._target_lm_head(states)

    def block_ids(self, anchors: torch.Tensor) -> torch.Tensor:
        """[..., gamma] block inputs ``[anchor, MASK, ...]`` for anchor tokens [...]."""
        ids = torch.full((*anchors.shape, self.block_size), self.mask_token_id, dtype=torch.long, device=anchors.device)
        ids[..., 0] = anchors
        return ids

    # ---- training ------------------------------------------------------------------------
    def derived_targets(self, hidden, batch):
        """``target_argmax`` [B, T]: the target's full-vocab greedy token at every position s
        whose next token is an assistant token (-1 elsewhere); cached by the trainer."""
        need = shift_left(batch["loss_mask"].bool(), 1, fill=False)
        return {"target_argmax": self._target_lm_head.greedy(hidden[self.num_target_layers], need)}

    def sample_anchors(self, loss_mask: torch.Tensor, attention_mask: torch.Tensor, n: int):
        """``n`` distinct random anchors p per row [B, n] among positions with context (p >= 1)
        whose next token x_{p+1} is an assistant token, and whether each is real (a row with
        fewer such positions gets invalid extras). Global RNG: resumed runs draw the same."""
        B, T = loss_mask.shape
        ok = shift_left(loss_mask.bool() & attention_mask.bool(), 1, fill=False)
        ok[:, 0] = False
        score = torch.rand(B, T, device=loss_mask.device).masked_fill(~ok, -1.0)
        top = score.topk(min(n, T), dim=1)
        return top.indices, top.values >= 0

    def anchored_logits(self, ids, attention_mask, hidden, anchors) -> torch.Tensor:
        """Draft-vocab logits [B, A, gamma, V_draft] of the blocks at ``anchors`` [B, A] of the
        rows ``ids`` [B, T]: block a is ``[x_p, MASK, ...]`` at positions p.., seeing the fused
        features of the row's positions < p and its own gamma slots, exactly what the proposer
        computes after verifying x_0..x_p (tests/test_diffusion.py holds the two to each other)."""
        return self.readout(self.anchored_states(ids, attention_mask, hidden, anchors))

    def anchored_states(self, ids, attention_mask, hidden, anchors) -> torch.Tensor:
        """:meth:`anchored_logits` before the readout: final-normed states [B, A, gamma, H]."""
        B, T = ids.shape
        A, G, dev = anchors.shape[1], self.block_size, ids.device
        pos = anchors[..., None] + torch.arange(G, device=dev)  # [B, A, G]
        ctx_mask = (torch.arange(T, device=dev) < anchors.reshape(B, A, 1, 1)) & attention_mask.bool()[:, None, None, :]
        own = torch.eye(A, dtype=torch.bool, device=dev)[None, :, None, :, None].expand(B, A, G, A, G)
        mask = torch.cat([ctx_mask.expand(B, A, G, T), own.reshape(B, A, G, A * G)], -1).reshape(B, A * G, T + A * G)
        kv = self.context_kv(self.context(hidden), torch.arange(T, device=dev).expand(B, T))
        block = self.block_ids(ids.gather(1, anchors))
        return self.block_states(block.reshape(B, A * G), pos.reshape(B, A * G), kv, mask).view(B, A, G, -1)

    def training_loss(self, batch, hidden, cfg: DiffusionLoss):
        batch, _, states, targets = self.training_blocks(batch, hidden, cfg)
        loss, metrics, _ = self.block_objective(self.readout(states), targets, hidden, cfg)
        return loss, metrics

    def training_blocks(self, batch, hidden, cfg: DiffusionLoss):
        """A step's ``cfg.anchors`` random blocks per row: (the batch with the target's greedy
        tokens, anchors [B, A], the masked slots' states [B, A, J, H], :meth:`block_targets`)."""
        if "target_argmax" not in batch:  # not supplied (cached) by the trainer
            batch = {**batch, **self.derived_targets(hidden, batch)}
        ids, attn = batch["input_ids"], batch["attention_mask"].bool()
        anchors, real = self.sample_anchors(batch["loss_mask"].bool(), attn, cfg.anchors)  # [B, A]
        # contiguous: a strided 4-D input sends the target's lm_head down a batched-matmul path ~5x slower
        states = self.anchored_states(ids, attn, hidden, anchors)[:, :, 1:].contiguous()
        return batch, anchors, states, self.block_targets(batch, anchors, real)

    @staticmethod
    def held_tokens(ids, anchors, targets: dict, kind: str) -> torch.Tensor:
        """[B, A, J] the token before each slot once the block is accepted up to it (teacher
        forcing): the anchor, then the target's greedy tokens (the data's where the target's was
        not taken, or with ``kind`` "data" targets)."""
        held = targets["data"] if kind == "data" else torch.where(targets["greedy"] >= 0, targets["greedy"], targets["data"])
        return torch.cat([ids.gather(1, anchors)[..., None], held[..., :-1]], -1)

    def block_targets(self, batch, anchors, real) -> dict[str, torch.Tensor]:
        """What the masked slots of the blocks at ``anchors`` [B, A] (``real``: not padding)
        learn, each [B, A, J]: slot k predicts x_{p+k}, the target's output at ``source`` s =
        p + k - 1 (``greedy``: its greedy token; ``data``: the data's x_{p+k}); it is ``counted``
        if x_{p+k} is an assistant token of this row and the anchor is real."""
        ids, loss_mask = batch["input_ids"], batch["loss_mask"].bool()
        B, T = ids.shape
        A, J = anchors.shape[1], self.block_size - 1
        pos = anchors[..., None] + torch.arange(1, self.block_size, device=ids.device)  # [B, A, J]
        tgt = pos.clamp_max(T - 1)
        src = tgt - 1
        return {
            "counted": (pos < T) & loss_mask.gather(1, tgt.reshape(B, -1)).view(B, A, J) & real[..., None],
            "source": src,
            "greedy": batch["target_argmax"].gather(1, src.reshape(B, -1)).view(B, A, J),
            "data": ids.gather(1, tgt.reshape(B, -1)).view(B, A, J),
        }

    def block_objective(self, logits, targets: dict, hidden, cfg: DiffusionLoss):
        """(loss, metrics, (log_accept, hit)) of slot logits [B, A, J, V_draft] against
        :meth:`block_targets`; ``log_accept`` and ``hit`` (the drafted token is the target's
        greedy one) are [B * A, J]."""
        B, A, J = targets["counted"].shape
        greedy, src = targets["greedy"], targets["source"].reshape(B, -1)
        if cfg.targets == "distribution":
            final = hidden[self.num_target_layers]
            rows = final.gather(1, src[..., None].expand(-1, -1, final.shape[-1]))
            probs = self._target_lm_head.probs(rows.reshape(-1, rows.shape[-1]), self.t2d if self.lm_head is not None else None)
            probs = probs.view(B * A, J, -1)
            log_accept, ce = distribution_terms(logits.reshape(B * A, J, -1), probs, cfg.temperature)
            kl = ce - entropy(probs) if cfg.kind in LK_KINDS else None
        else:
            labels = greedy if cfg.targets == "greedy" else targets["data"]
            log_accept, ce = token_terms(logits.reshape(B * A, J, -1), self.to_draft_ids(labels).view(B * A, J), cfg.temperature)
            kl = None  # one-hot targets: KL is the CE
        m = targets["counted"].view(B * A, J)
        loss = block_loss(cfg.kind, log_accept, ce, m, gamma=cfg.gamma, alpha=cfg.dpace_alpha, kl=kl, eta=cfg.eta)
        with torch.no_grad():  # per-position agreement with the target's greedy token, and the greedy accepted prefix
            hit = (self.to_target_ids(logits.argmax(-1)) == greedy).view(B * A, J)
            n = m.sum(0).clamp_min(1)
            acc = ((hit & m).sum(0) / n).tolist()
            streak = (hit & m).long().cumprod(-1).sum(-1)[m[:, 0]]
            metrics = {
                "acc": acc,
                "accepted": streak.float().mean().item() if streak.numel() else 0.0,
                "expected_streak": expected_streak(log_accept, m)[m[:, 0]].mean().item() if m[:, 0].any() else 0.0,
            }
        return loss, metrics, (log_accept, hit)


def unused_token(samples, vocab_size: int) -> int:
    """The highest target id that occurs in no training sample: a mask token whose (frozen)
    embedding the drafter never sees as a real input."""
    seen = torch.zeros(vocab_size, dtype=torch.bool)
    for s in samples or []:
        seen[s["input_ids"].reshape(-1).long()] = True
    free = (~seen).nonzero().flatten()
    if not samples or not free.numel():
        raise DraftlabError("drafter.mask_token_id: no unused token id to default to; set it (a target-vocabulary id)")
    return int(free[-1])
