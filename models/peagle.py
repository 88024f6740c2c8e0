"""P-EAGLE (parallel EAGLE): an EAGLE-3 drafter that drafts K tokens in one forward.

Slot 1 is the ordinary EAGLE-3 step (token x_{t+1}, fused target feature f_t at position t);
slots 2..K sit at positions t+1 .. t+K-1 and read a mask token id in place of the token not
yet drafted and a learned shared ``mask_hidden`` (a fused-feature input, [1, 1, n_aux * H], fed
through the same fc as real features) in place of the missing target state. Each mask slot
attends to the real context up to t and to the mask slots before it, so all K come from one
causal forward over ``[context..., mask x (K-1)]``. The embedding is trained (a copy of the target's, saved with the
drafter) unless ``train_embedding: false``. Training samples the slots by COD
(losses/peagle.py). Layout and tensor names are speculators 0.9's ``PEagleDraftModel``
(export/peagle_speculators.py), with the drafter's own embedding named ``token_embedding``.
"""

from __future__ import annotations

from typing import Annotated, Literal

import torch
import torch.nn as nn
from pydantic import ConfigDict, Field, StrictBool, field_validator
from pydantic_core import PydanticCustomError

from draftlab.limits import MAX_K
from draftlab.losses.acceptance import AcceptanceLossFields
from draftlab.losses.eagle import DISTRIBUTION_KINDS, eagle3_step_loss, shift_left
from draftlab.losses.peagle import cod_anchors
from draftlab.models.drafter import DRAFTERS, Count, Distinct, DraftVocabSize, HiddenStateIndex, TokenId
from draftlab.models.eagle import KIND_DESCRIPTION, Eagle3Config, Eagle3Drafter, EagleMeta
from draftlab.models.layers import LayerShape, ttt_attention


class PEagleConfig(Eagle3Config):
    num_layers: int = Field(4, ge=1, description="decoder layers (the P-EAGLE reference uses 4)")
    parallel_depth: int = Field(4, ge=2, le=MAX_K, description="K: tokens drafted per forward (slot 1 + K-1 mask slots)")
    mask_token_id: int | None = Field(
        None, description="target-vocabulary id fed to slots 2..K; default: the highest id that never occurs in the training data"
    )
    train_embedding: bool = Field(
        True, description="train an own copy of the target's embedding (P-EAGLE's embed_requires_grad); false: share the target's, frozen"
    )

    @field_validator("norm_output")
    @classmethod
    def _no_output_feedback(cls, v):
        if v:  # nothing feeds a slot's output to another slot
            raise PydanticCustomError("norm_output", "P-EAGLE feeds no draft's output state to the next draft; norm_output has no effect")
        return v

    @field_validator("norm_before_fc", "norm_before_residual")
    @classmethod
    def _eagle3_only(cls, v, info):
        if v:  # speculators' P-EAGLE has them; draftlab's does not implement them
            raise PydanticCustomError(info.field_name, f"{info.field_name} is not implemented by draftlab's P-EAGLE")
        return v


class PEagleMeta(EagleMeta):
    draft_vocab_size: DraftVocabSize
    aux_layers: Annotated[list[HiddenStateIndex], Distinct()]
    normalize_fc_input: StrictBool = False
    fc_norm: StrictBool = False
    parallel_depth: Count(2, MAX_K, "tokens drafted per forward")
    mask_token_id: TokenId
    train_embedding: StrictBool


EAGLE3_ONLY = ("norm_output", "norm_before_fc", "norm_before_residual")  # Eagle3Drafter's meta fields P-EAGLE has not


class PEagleLoss(AcceptanceLossFields):
    model_config = ConfigDict(extra="forbid")

    kind: Literal[DISTRIBUTION_KINDS] = Field("ce", description=KIND_DESCRIPTION)  # type: ignore[valid-type]
    cod_decay: float = Field(0.7, gt=0, le=1, description="COD: depth d keeps about cod_decay**d of the counted positions")
    cod_floor: float = Field(0.2, ge=0, le=1, description="COD: ... but at least this share")


@DRAFTERS.register()
class PEagleDrafter(Eagle3Drafter):
    algorithm = "peagle"
    Config = PEagleConfig
    Loss = PEagleLoss
    Meta = PEagleMeta

    def __init__(
        self, shape: LayerShape, vocab_size: int, draft_vocab_size: int, aux_layers: list[int], num_layers: int,
        normalize_fc_input: bool, fc_norm: bool, parallel_depth: int, mask_token_id: int, train_embedding: bool,
    ):
        super().__init__(shape, vocab_size, draft_vocab_size, aux_layers, num_layers, normalize_fc_input, fc_norm, False)
        H = shape.hidden_size
        self.parallel_depth, self.mask_token_id = parallel_depth, mask_token_id
        # speculators' shape and name: one fused-feature input shared by every mask slot
        self.mask_hidden = nn.Parameter(torch.zeros(1, 1, len(aux_layers) * H))
        self.token_embedding = nn.Embedding(vocab_size, H) if train_embedding else None

    # ---- construction ---------------------------------------------------------------
    @classmethod
    def config_meta(cls, cfg: PEagleConfig, target, samples=None) -> dict:
        from draftlab.models.diffusion import unused_token

        meta = {k: v for k, v in super().config_meta(cfg, target, samples).items() if k not in EAGLE3_ONLY}
        mask = cfg.mask_token_id if cfg.mask_token_id is not None else unused_token(samples, target.vocab_size)
        return {**meta, "parallel_depth": cfg.parallel_depth, "mask_token_id": mask, "train_embedding": cfg.train_embedding}

    def init_weights(self, cfg: PEagleConfig, target, samples=None) -> None:
        super().init_weights(cfg, target, samples)
        with torch.no_grad():
            if self.token_embedding is not None:
                self.token_embedding.weight.copy_(target.embed_tokens.weight.float())
            # a random fused input of a real feature's scale: unit RMS per channel once scaled
            self.mask_hidden.normal_()
            if self.fc_input_scale is not None:
                self.mask_hidden.div_(self.fc_input_scale)

    def meta(self) -> dict:
        meta = {k: v for k, v in super().meta().items() if k not in EAGLE3_ONLY}
        return {**meta, "parallel_depth": self.parallel_depth, "mask_token_id": self.mask_token_id,
                "train_embedding": self.token_embedding is not None}

    def export_meta(self) -> dict:
        return {**self.meta(), "normalize_fc_input": False}

    @classmethod
    def from_meta(cls, meta: dict, target) -> "PEagleDrafter":
        m = cls(
            LayerShape(**meta["shape"]), meta["vocab_size"], meta["draft_vocab_size"], meta["aux_layers"], meta["num_layers"],
            meta["normalize_fc_input"], meta["fc_norm"], meta["parallel_depth"], meta["mask_token_id"], meta["train_embedding"],
        )
        m.num_target_layers = meta["num_target_layers"]
        return m.attach(target)

    @classmethod
    def trained_depth(cls, loss: dict) -> int | None:
        return None  # every slot is trained; the proposer drafts at most parallel_depth (meta)

    # ---- inputs ------------------------------------------------------------------------
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.token_embedding(ids) if self.token_embedding is not None else self._embed(ids)

    def mask_feature(self) -> torch.Tensor:
        """The fused feature [1, 1, H] of every mask slot: ``mask_hidden`` split into its aux
        states and fused as real ones are (fc_norm, input scale, fc), as speculators does."""
        parts = self.mask_hidden.chunk(len(self.aux_layers), dim=-1)
        return self.features(dict(zip(self.aux_layers, parts)))

    # ---- one forward over every slot ------------------------------------------------------
    def parallel_forward(self, ids, hidden, groups: list[torch.Tensor]) -> list[torch.Tensor]:
        """Output states of slot 1 at every position ([B*T, H], depth 0) and of the mask slot at
        depth d for the anchors ``groups[d-1]`` ([N_d, H]; flat indices b*T + t, ascending, each
        group inside the previous one). Depth d at anchor t sits at position t + d and attends to
        depth 0 at positions <= t and to its own slots at depths 1..d: the attention of EAGLE-3's
        training-time test (``ttt_attention``), run on the sampled rows only."""
        B, T = ids.shape
        ks = [[] for _ in self.layers]
        vs = [[] for _ in self.layers]
        rows = {"idx": None}  # the flat anchors of the depth being run; None: depth 0, every position

        def dense(x):  # [1, h, N, D] at the anchors -> [B, h, T, D], zero elsewhere
            idx = rows["idx"]
            flat = x.new_zeros(B * T, x.shape[1], x.shape[3]).index_copy(0, idx, x[0].transpose(0, 1))
            return flat.view(B, T, x.shape[1], x.shape[3]).transpose(1, 2).contiguous()

        def attend_for_layer(i, attn):
            def attend(q, k, v):
                idx = rows["idx"]
                if idx is None:
                    ks[i].append(k)
                    vs[i].append(v)
                    return attn.attend(q, k, v, causal=True)
                ks[i].append(dense(k))
                vs[i].append(dense(v))
                o = ttt_attention(dense(q), ks[i], vs[i], attn.scale)
                return o.transpose(1, 2).reshape(B * T, o.shape[1], o.shape[3])[idx].transpose(0, 1)[None]

            return attend

        positions = torch.arange(T, device=ids.device).expand(B, T)
        out = [self.stack(self.embed(shift_left(ids, 1)), self.features(hidden), positions, attend_for_layer).flatten(0, 1)]
        emb = self.embed(torch.full((1, 1), self.mask_token_id, device=ids.device))
        feat = self.mask_feature()
        for d, idx in enumerate(groups, 1):
            rows["idx"] = idx
            n = idx.numel()
            h = self.stack(emb.expand(1, n, -1), feat.expand(1, n, -1), (idx % T + d)[None], attend_for_layer)
            out.append(h[0])
        return out

    # ---- training ----------------------------------------------------------------------
    def training_loss(self, batch, hidden, cfg: PEagleLoss):
        ids, loss_mask = batch["input_ids"], batch["loss_mask"].bool()
        B, T = ids.shape
        K = self.parallel_depth
        # depth d at anchor t imitates the target at s = t+1+d and counts when loss_mask[t+2+d]:
        # the target is computed at the indices s with loss_mask[s+1] only, rows gathered per depth
        need, target_argmax, in_vocab, p = self.compact_targets(batch, hidden)
        row = torch.full((B, T + K + 1), -1, dtype=torch.long, device=ids.device)
        row[:, :T][need] = torch.arange(target_argmax.numel(), device=ids.device)
        padded = nn.functional.pad(loss_mask, (0, K + 2))
        counted = torch.stack([padded[:, 2 + d : 2 + d + T] for d in range(K)]).view(K, B * T)
        groups = cod_anchors(counted, cfg.cod_decay, cfg.cod_floor)
        outs = self.parallel_forward(ids, hidden, groups)
        anchors = [counted[0].nonzero().flatten(), *groups]

        loss, total = p.new_zeros(()), 0
        step_loss, step_acc, step_rows = [], [], []
        for d, (a, h) in enumerate(zip(anchors, outs)):
            r = row[a // T, a % T + 1 + d]
            logits = self.head(h[a] if d == 0 else h)
            li = eagle3_step_loss(logits, p[r], in_vocab[r], kind=cfg.kind, eta=cfg.eta)
            m = int(in_vocab[r].sum())
            loss, total = loss + li * m, total + m  # pooled over every sampled slot, as speculators
            with torch.no_grad():  # top-1 agreement, out-of-draft-vocab targets count as misses
                hit = self.to_target_ids(logits.max(-1).indices) == target_argmax[r]
            step_acc.append(hit.float().mean().item() if hit.numel() else 0.0)
            step_loss.append(li.item())
            step_rows.append(float(a.numel()))
        for per_depth in (step_loss, step_acc, step_rows):  # depths COD left empty in this batch
            per_depth += [0.0] * (K - len(anchors))
        return loss / max(total, 1), {"loss_steps": step_loss, "acc": step_acc, "cod_rows": step_rows}
