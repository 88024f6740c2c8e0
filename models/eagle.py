"""EAGLE-1 and EAGLE-3 feature drafters (EAGLE: Li et al. 2024, arXiv 2401.15077;
EAGLE-3: Li et al. 2025, arXiv 2503.01840; their losses: losses/eagle.py).

Both read target hidden states, take (embedding of x_{t+1}, feature f_t) at position t, run
``num_layers`` decoder layers of the target's family and predict x_{t+2}. The target's
embedding (and, for EAGLE-1, its lm_head) are shared by reference, frozen and never saved
in a drafter checkpoint: a drafter is always used next to its target.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, model_validator
from pydantic_core import PydanticCustomError

from draftlab.losses.acceptance import AcceptanceLossFields
from draftlab.losses.eagle import DISTRIBUTION_KINDS, eagle1_loss, eagle3_step_loss, predicted_mask, shift_left
from draftlab.models.drafter import (
    DRAFTERS,
    Distinct,
    DraftVocabSize,
    Drafter,
    DrafterDepth,
    DrafterMeta,
    HiddenStateIndex,
    ShapeMeta,
    TargetNumLayers,
    TargetVocabSize,
)
from draftlab.models.feature_scale import fill_measured_buffers
from draftlab.models.layers import DecoderLayer, DraftKVCache, LayerShape, RMSNorm, Rotary, ttt_attention


class EagleMeta(DrafterMeta):
    """What both EAGLE drafters' checkpoints describe: decoder layers of the target's shape over
    the target's vocabulary, reading a target of ``num_target_layers`` layers."""

    shape: ShapeMeta
    vocab_size: TargetVocabSize
    num_layers: DrafterDepth
    num_target_layers: TargetNumLayers


class EagleBase(Drafter):
    """What EAGLE-1 and EAGLE-3 share: layer stack, RoPE, cached inference step, target refs."""

    derived_keys = ("rotary.",)  # RoPE tables are rebuilt from the layer shape
    shares_embedding = True

    def __init__(self, shape: LayerShape, vocab_size: int, num_layers: int, first_layer: DecoderLayer):
        super().__init__()
        self.shape = shape
        self.vocab_size = vocab_size
        self.layers = nn.ModuleList([first_layer] + [DecoderLayer(shape) for _ in range(num_layers - 1)])
        self.rotary = Rotary(shape)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self._embed(ids)

    def stack(self, emb, h, positions, attend_for_layer, depth: int = 0):
        """The layers over (embedding, feature) inputs. ``depth``: how many drafted tokens precede
        the inputs on their path (0: committed tokens, read with the target's features; d: the
        inputs after d drafts, the d-th training-time-test step), for a drafter whose weights
        depend on the draft step; the one stack here runs at every depth."""
        cos, sin = self.rotary(positions, h)
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, attend_for_layer(i, layer.self_attn), emb=emb)
        return h

    # ---- inference -------------------------------------------------------------
    def new_cache(self) -> DraftKVCache:
        return DraftKVCache(len(self.layers))

    def draft_step(self, tokens, feats, positions, cache: DraftKVCache, mask=None, logits: bool = True, depth: int = 0):
        """Run new positions through the drafter, appending their K/V to ``cache``.
        mask: bool [B, n, cache.length + n] (tree drafting); default causal over cache + new.
        depth: the draft depth of the inputs (:meth:`stack`).
        Returns (output features [B, n, H], logits over the draft vocab [B, n, V_draft], or None
        with ``logits=False``: a caller that reads one position's applies :meth:`head` to it; over
        a catch-up of n tokens the head costs about what the layer does)."""
        n, past = tokens.shape[1], cache.length
        if mask is None and n > 1:
            mask = torch.ones(n, past + n, dtype=torch.bool, device=tokens.device).tril(past)[None]

        def attend_for_layer(i, attn):
            def attend(q, k, v):
                k, v = cache.append(i, k, v)
                return attn.attend(q, k, v, mask=mask)

            return attend

        h = self.stack(self.embed(tokens), feats, positions, attend_for_layer, depth)
        return h, self.head(h) if logits else None

    def compact_targets(self, batch, hidden):
        """What a loss compares the drafts with (EAGLE-3's and the MTP module's steps), at the
        indices s it reads (``need``: those with loss_mask[s+1]) only: (``need`` [B, T], the target's greedy token [n], whether it is in
        the draft vocabulary [n], the target's draft-vocab probabilities [n, V_draft])."""
        need = shift_left(batch["loss_mask"].bool(), 1, fill=False)
        if "target_argmax" not in batch:  # not supplied (cached) by the trainer
            batch = {**batch, **self.derived_targets(hidden, batch)}
        target_argmax = batch["target_argmax"][need]
        return need, target_argmax, self.t2d[target_argmax], self.target_draft_probs(hidden[self.num_target_layers][need])

    def head(self, h):
        raise NotImplementedError


# ============================================================================ EAGLE-3


class Eagle3Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    num_layers: int = Field(1, ge=1)
    draft_vocab_size: int = Field(8192, ge=0, description="0 = the full target vocabulary")
    aux_layers: list[int] | None = Field(None, description="hidden-state indices to fuse; default [2, L//2, L-3] (default_aux_layers)")
    init_lm_head_from_target: bool = Field(True, description="start lm_head from the target's rows of the draft vocab")
    freeze_lm_head: bool = Field(
        False, description="keep lm_head at the target's rows, untrained (speculators' default; needs init_lm_head_from_target)"
    )
    normalize_fc_input: bool = Field(
        True,
        description="scale each fused input channel by 1/RMS measured on training data (folded into fc.weight on export); "
        "off by default when fc_norm or norm_before_fc is on",
    )
    fc_norm: bool = Field(False, description="EAGLE-3.1: a learned RMSNorm on each fused target hidden state before fc")
    norm_before_fc: bool = Field(
        False, description="one learned RMSNorm over the concatenated fused target hidden states before fc "
        "(speculators' norm_before_fc, on by default in its trainer)",
    )
    norm_output: bool = Field(
        False, description="EAGLE-3.1: the next draft step reads the normalised output state (the one lm_head reads)"
    )
    norm_before_residual: bool = Field(
        False, description="the first layer's residual stream is the normalised fused feature, hidden_norm(h), not h "
        "(speculators' norm_before_residual, on by default in its trainer)",
    )

    @model_validator(mode="after")
    def _frozen_head_from_target(self):
        if self.freeze_lm_head and not self.init_lm_head_from_target:
            raise PydanticCustomError("freeze_lm_head", "freeze_lm_head keeps the target's lm_head rows: it needs init_lm_head_from_target")
        return self

    @model_validator(mode="after")
    def _one_input_normalisation(self):
        # fc_norm and norm_before_fc each normalise fc's input (one is enough), and a fixed scale in
        # front of a norm would not fold into fc on export (the norm divides by the scaled state's RMS)
        learned = [f for f in ("fc_norm", "norm_before_fc") if getattr(self, f)]
        if len(learned) == 2:
            raise PydanticCustomError("fc_norm", "fc_norm and norm_before_fc both normalise fc's input; set one")
        if learned and self.normalize_fc_input:
            if "normalize_fc_input" in self.model_fields_set:
                raise PydanticCustomError(learned[0], f"{learned[0]} and normalize_fc_input both normalise fc's input; set one")
            self.normalize_fc_input = False
        return self


class Eagle3Meta(EagleMeta):
    draft_vocab_size: DraftVocabSize
    aux_layers: Annotated[list[HiddenStateIndex], Distinct()]  # fc's input order: any, each once
    normalize_fc_input: StrictBool = False
    fc_norm: StrictBool = False
    norm_output: StrictBool = False
    norm_before_fc: StrictBool = False  # both absent from checkpoints written before them: off
    norm_before_residual: StrictBool = False


KIND_DESCRIPTION = "ce: soft cross-entropy to the target's distribution; nla | lk_hybrid: the LK acceptance losses"


class Eagle3Loss(AcceptanceLossFields):
    model_config = ConfigDict(extra="forbid")

    kind: Literal[DISTRIBUTION_KINDS] = Field("ce", description=KIND_DESCRIPTION)  # type: ignore[valid-type]
    ttt_steps: int = Field(7, ge=1, description="training-time-test unroll length")
    decay: float = Field(0.8, gt=0, description="step i is weighted decay**i")
    topk_weight: float = Field(0.0, ge=0, description="HASS top-K distillation term weight (0 = off)")
    topk: int = Field(10, ge=1)
    detach_features: bool = Field(
        False, description="HASS harmonized context alignment: later steps see detached drafter features"
    )


@DRAFTERS.register()
class Eagle3Drafter(EagleBase):
    algorithm = "eagle3"
    Config = Eagle3Config
    Loss = Eagle3Loss
    Meta = Eagle3Meta
    vocab_maps = ("d2t", "t2d")

    def __init__(
        self, shape: LayerShape, vocab_size: int, draft_vocab_size: int, aux_layers: list[int], num_layers: int,
        normalize_fc_input: bool = False, fc_norm: bool = False, norm_output: bool = False,
        norm_before_fc: bool = False, norm_before_residual: bool = False,
    ):
        super().__init__(shape, vocab_size, num_layers, DecoderLayer(shape, fuse_embedding=True, norm_before_residual=norm_before_residual))
        H = shape.hidden_size
        self.aux_layers = list(aux_layers)
        # a fixed per-channel 1/RMS in front of fc (models/feature_scale.py), folded into fc on export
        self.register_buffer("fc_input_scale", torch.ones(len(aux_layers) * H) if normalize_fc_input else None)
        # speculators' norm_before_fc: one learned RMSNorm over the whole concatenation, named as speculators names it
        self.input_norm = RMSNorm(len(aux_layers) * H, shape.rms_norm_eps) if norm_before_fc else None
        # EAGLE-3.1: one learned RMSNorm per fused state, named as speculators and SpecForge name them
        self.fc_norm = nn.ModuleList([RMSNorm(H, shape.rms_norm_eps) for _ in aux_layers]) if fc_norm else None
        self.norm_output = norm_output
        self.num_target_layers = None  # set by build/from_meta; hidden[L] gives the target logits
        self.fc = nn.Linear(len(aux_layers) * H, H, bias=False)
        self.norm = RMSNorm(H, shape.rms_norm_eps)
        self.lm_head = nn.Linear(H, draft_vocab_size, bias=False)
        self.add_vocab_maps(vocab_size, draft_vocab_size)

    # ---- construction -------------------------------------------------------
    @staticmethod
    def default_aux_layers(num_target_layers: int) -> list[int]:
        """Low, mid and high features: the inputs of decoder layers 2, L//2 and L-3 (the EAGLE
        reference code and speculators; SpecForge's ids are one lower, see export/eagle3_sglang.py),
        ascending and each once, as serving engines capture them (a shallow target maps two to one)."""
        L = num_target_layers
        return sorted({2, L // 2, L - 3})

    @classmethod
    def default_capture_layers(cls, num_target_layers: int) -> list[int]:
        return cls.default_aux_layers(num_target_layers) + [num_target_layers]

    @classmethod
    def config_meta(cls, cfg: Eagle3Config, target, samples=None) -> dict:
        L, V = target.num_layers, target.vocab_size
        return {
            "shape": LayerShape.from_hf(target.config).model_dump(),
            "vocab_size": V,
            "draft_vocab_size": cfg.draft_vocab_size if 0 < cfg.draft_vocab_size < V else V,
            "aux_layers": cfg.aux_layers or cls.default_aux_layers(L),
            "num_layers": cfg.num_layers,
            "num_target_layers": L,
            "normalize_fc_input": cfg.normalize_fc_input,
            "fc_norm": cfg.fc_norm,
            "norm_output": cfg.norm_output,
            "norm_before_fc": cfg.norm_before_fc,
            "norm_before_residual": cfg.norm_before_residual,
        }

    def init_weights(self, cfg: Eagle3Config, target, samples=None) -> None:
        fill_measured_buffers(self, target, self.aux_layers, samples, cfg.normalize_fc_input)
        if cfg.init_lm_head_from_target:
            # Start as the target's own read-out: its final-norm gain and its lm_head rows.
            with torch.no_grad():
                self.lm_head.weight.copy_(self.draft_rows(target.lm_head.weight))
                self.norm.weight.copy_(target.final_norm.weight.float())
        self.lm_head.weight.requires_grad_(not cfg.freeze_lm_head)  # the optimizer takes what requires grad

    def meta(self) -> dict:
        return {
            "shape": self.shape.model_dump(),
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.lm_head.out_features,
            "aux_layers": self.aux_layers,
            "num_layers": len(self.layers),
            "num_target_layers": self.num_target_layers,
            "normalize_fc_input": self.fc_input_scale is not None,
            "fc_norm": self.fc_norm is not None,
            "norm_output": self.norm_output,
            "norm_before_fc": self.input_norm is not None,
            "norm_before_residual": self.layers[0].norm_before_residual,
        }

    def export_state_dict(self):
        state = super().export_state_dict()
        if self.fc_input_scale is not None:
            scale = state.pop("fc_input_scale")
            state["fc.weight"] = state["fc.weight"] * scale[None, :]
        return state

    def export_meta(self) -> dict:
        return {**self.meta(), "normalize_fc_input": False}

    @classmethod
    def trained_depth(cls, loss: dict) -> int | None:
        """The training-time-test unroll, ``ttt_steps``: with no feature loss, a draft past it
        reads drafter outputs that no step trained it to read, so acceptance falls off past it."""
        steps = loss.get("ttt_steps")
        return steps if isinstance(steps, int) and steps >= 1 else None

    @classmethod
    def from_meta(cls, meta: dict, target) -> "Eagle3Drafter":
        m = cls(
            LayerShape(**meta["shape"]), meta["vocab_size"], meta["draft_vocab_size"], meta["aux_layers"], meta["num_layers"],
            meta["normalize_fc_input"], meta["fc_norm"], meta["norm_output"], meta["norm_before_fc"], meta["norm_before_residual"],
        )
        m.num_target_layers = meta["num_target_layers"]
        return m.attach(target)

    # ---- features -----------------------------------------------------------------
    @property
    def capture_layers(self) -> list[int]:
        return sorted(set(self.aux_layers) | {self.num_target_layers})

    def features(self, hidden):
        x = torch.cat([hidden[i] for i in self.aux_layers], dim=-1)
        if self.input_norm is not None:
            x = self.input_norm(x)
        if self.fc_norm is not None:
            x = torch.cat([norm(part) for norm, part in zip(self.fc_norm, x.chunk(len(self.fc_norm), dim=-1))], dim=-1)
        if self.fc_input_scale is not None:
            x = x * self.fc_input_scale
        return self.fc(x)

    def stack(self, emb, h, positions, attend_for_layer, depth: int = 0):
        """The layers' output; with ``norm_output`` already through ``norm``, so the next draft
        step (and the next TTT step) reads the normalised state, as EAGLE-3.1 serves it."""
        h = super().stack(emb, h, positions, attend_for_layer, depth)
        return self.norm(h) if self.norm_output else h

    def head(self, h):
        return self.lm_head(h if self.norm_output else self.norm(h))

    derived_targets = Drafter.next_token_targets

    # ---- training ----------------------------------------------------------------------
    def unroll(self, ids, hidden, steps: int, detach: bool = False):
        """Training-time test: yield (step i, output features [B, T, H]) for i < steps.

        Step i at position t reads the true token x_{t+1+i} and the previous step's output at t
        (the real fused feature at step 0), sits at RoPE position t + i, and attends to the real
        context k0[0..t] plus its own earlier steps at t — what inference sees when the drafter
        proposes its (i+1)-th token after position t."""
        B, T = ids.shape
        positions = torch.arange(T, device=ids.device).expand(B, T)
        ks = [[] for _ in self.layers]
        vs = [[] for _ in self.layers]

        def attend_for_layer(i, attn):
            def attend(q, k, v):
                ks[i].append(k)
                vs[i].append(v)
                if len(ks[i]) == 1:  # step 0: ordinary causal attention over the real context
                    return attn.attend(q, k, v, causal=True)
                return ttt_attention(q, ks[i], vs[i], attn.scale)

            return attend

        h = self.features(hidden)
        tokens = shift_left(ids, 1)  # x_{t+1}
        for i in range(steps):
            feats = h.detach() if (detach and i > 0) else h
            h = self.stack(self.embed(tokens), feats, positions + i, attend_for_layer, depth=i)
            yield i, h
            tokens = shift_left(tokens, 1)

    def training_loss(self, batch, hidden, cfg: Eagle3Loss):
        ids, loss_mask = batch["input_ids"], batch["loss_mask"].bool()
        B, T = ids.shape
        steps = cfg.ttt_steps
        # Step i at position t imitates the target at index s = t+1+i and counts when the token
        # it predicts, x_{t+2+i}, is an assistant token. So the target is needed only at indices
        # s with loss_mask[s+1]: compute it there, compactly, and gather rows per step; the head
        # and the loss run only on the positions each step counts.
        need, target_argmax, in_vocab, p = self.compact_targets(batch, hidden)
        row = F.pad((need.flatten().cumsum(0) - 1).view(B, T), (0, steps + 1), value=-1)
        counted_all = F.pad(loss_mask, (0, steps + 2))
        loss = p.new_zeros(())
        step_loss, step_acc = [], []
        for i, h in self.unroll(ids, hidden, steps, cfg.detach_features):
            counted = counted_all[:, 2 + i : 2 + i + T]
            r = row[:, 1 + i : 1 + i + T][counted]  # target row of every counted position
            logits = self.head(h[counted])
            li = eagle3_step_loss(logits, p[r], in_vocab[r], cfg.topk_weight, cfg.topk, cfg.kind, cfg.eta)
            loss = loss + cfg.decay**i * li
            with torch.no_grad():  # top-1 agreement, out-of-draft-vocab targets count as misses
                hit = self.to_target_ids(logits.max(-1).indices) == target_argmax[r]
                step_acc.append(hit.float().mean().item() if hit.numel() else 0.0)
            step_loss.append(li.item())
        return loss, {"loss_steps": step_loss, "acc": step_acc}


# ============================================================================ EAGLE-1


class Eagle1Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    num_layers: int = Field(1, ge=1)


class Eagle1Loss(AcceptanceLossFields):
    model_config = ConfigDict(extra="forbid")

    kind: Literal[DISTRIBUTION_KINDS] = Field("ce", description=KIND_DESCRIPTION)  # type: ignore[valid-type]
    feature_weight: float = Field(1.0, ge=0, description="SmoothL1 feature regression weight")
    ce_weight: float = Field(0.1, ge=0, description="weight of the distribution term (kind) against the target's")
    feature_noise: float = Field(0.1, ge=0, description="uniform U(-a, a) noise on input features")


@DRAFTERS.register()
class Eagle1Drafter(EagleBase):
    algorithm = "eagle1"
    Config = Eagle1Config
    Loss = Eagle1Loss
    Meta = EagleMeta

    def __init__(self, shape: LayerShape, vocab_size: int, num_layers: int):
        super().__init__(shape, vocab_size, num_layers, DecoderLayer(shape, input_norm=False))
        H = shape.hidden_size
        self.fc = nn.Linear(2 * H, H, bias=True)
        self.num_target_layers = None

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids  # the target's whole vocabulary: no maps

    @classmethod
    def default_capture_layers(cls, num_target_layers: int) -> list[int]:
        return [num_target_layers]

    @classmethod
    def config_meta(cls, cfg: Eagle1Config, target, samples=None) -> dict:
        return {
            "shape": LayerShape.from_hf(target.config).model_dump(),
            "vocab_size": target.vocab_size,
            "num_layers": cfg.num_layers,
            "num_target_layers": target.num_layers,
        }

    def meta(self) -> dict:
        return {
            "shape": self.shape.model_dump(),
            "vocab_size": self.vocab_size,
            "num_layers": len(self.layers),
            "num_target_layers": self.num_target_layers,
        }

    @classmethod
    def from_meta(cls, meta: dict, target) -> "Eagle1Drafter":
        m = cls(LayerShape(**meta["shape"]), meta["vocab_size"], meta["num_layers"])
        m.num_target_layers = meta["num_target_layers"]
        return m.attach(target)

    @property
    def capture_layers(self) -> list[int]:
        return [self.num_target_layers]

    def features(self, hidden):
        return hidden[self.num_target_layers]

    def stack(self, emb, h, positions, attend_for_layer, depth: int = 0):
        # EAGLE-1 fuses before the layer stack: fc([embedding; feature]).
        return super().stack(None, self.fc(torch.cat([emb, h], dim=-1)), positions, attend_for_layer, depth)

    def head(self, h):
        return self._target_lm_head(h)

    def training_loss(self, batch, hidden, cfg: Eagle1Loss):
        ids, loss_mask = batch["input_ids"], batch["loss_mask"].bool()
        B, T = ids.shape
        f = self.features(hidden)
        noisy = f + (torch.rand_like(f) * 2 - 1) * cfg.feature_noise if cfg.feature_noise else f
        positions = torch.arange(T, device=ids.device).expand(B, T)
        pred = self.stack(self.embed(shift_left(ids, 1)), noisy, positions, lambda i, attn: lambda q, k, v: attn.attend(q, k, v, causal=True))
        target_feat = shift_left(f, 1)
        with torch.no_grad():
            target_logits = self._target_lm_head(target_feat)
        return eagle1_loss(
            pred, target_feat, self.head(pred), target_logits, predicted_mask(loss_mask, 0), cfg.feature_weight, cfg.ce_weight,
            cfg.kind, cfg.eta,
        )
