"""DFlash2: the block diffusion (DFlash) drafter of models/diffusion.py plus a local convolution in
every layer and a candidate selector over the slots (Inco/z-lab's DFlash2; reference z-lab/dflash
``dflash/model.py`` ``DFlash2DraftModel``; served by vLLM #52816 and SGLang #35371, export/dflash2.py).

* Grouped dynamic depthwise causal convolution (``GroupedDynamicConv``) around the input and the
  output of each attention and MLP sublayer: ``out[i, c] = sum_t (base[t, c] + delta[i, t, g(c)])
  x[i - t, c]`` over ``conv_kernel_size`` taps, channel c in group ``c // conv_group_size``, both
  deltas (input side and output side) one projection of the sublayer's input, taps zero across
  block boundaries. Identity at initialisation (tap 0 = 1, the rest and the projection 0), so a
  fresh DFlash2 drafter computes what the DFlash backbone does. It lets a slot see the slots
  before it without another forward; the context keys/values are not convolved.
* Candidate selector (``CandidateSelector``): each slot keeps its unary top-K (``selector_top_k``)
  and scores ``S(p -> c) = unary[c] + <A[p] * P h, B[c]>`` (codebooks A, B [V, r] indexed by
  target ids, P [r, H]); the block is walked from the verified anchor, each slot's choice the
  next slot's predecessor (greedy: argmax; sampling: a draw from q over the K candidates, which
  verification gets, inference/dflash2.py).

Training (``training_loss``): the published method has no objective; this is SpecForge #772's and
speculators #1006's: the diffusion family's block loss on the unary logits plus
``loss.selector_loss_alpha`` x the selector's K-way CE over the unary top-K, the gold token
injected where the top-K misses it, the predecessor teacher-forced (losses/dflash2.py). The gold
and the predecessor are what slot k - 1 is trained toward (the target's greedy token; the data's
with ``targets: data``), as for DSpark's Markov head.

Tensor names are the served checkpoint's: ``layers.N.{attention,mlp}_conv.base_kernel`` [2, K,
H] (0: input side, 1: output side), ``layers.N.{attention,mlp}_conv.kernel_projection.weight``
[2 K H / group, H], ``candidate_selector.{predecessor,successor}_codebook`` [V, r] (parameters,
no ``.weight``), ``candidate_selector.hidden_projection.weight`` [r, H].
"""

from __future__ import annotations

from typing import Annotated, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from pydantic import Field, StrictInt, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from draftlab.losses.dflash2 import inject_gold, selector_loss
from draftlab.models.diffusion import DiffusionConfig, DiffusionDrafter, DiffusionLoss, DiffusionMeta
from draftlab.models.drafter import DRAFTERS, MAX_BLOCK_SIZE, WIDTH_FACTOR, Count, Range, _Check
from draftlab.models.layers import LayerShape


class DividesHidden(_Check):
    """A channel group size: divides the target's hidden size (the groups tile the channels)."""

    def check(self, value, facts):
        if facts.hidden_size % value:
            raise PydanticCustomError("meta_range", "does not divide the target's hidden size {h}", {"h": facts.hidden_size})
        return value


class DFlash2Config(DiffusionConfig):
    draft_vocab_size: int = Field(
        0, ge=0, description="0 = the full target vocabulary: what the served selector ranks (a reduced one trains, "
        "but does not export)"
    )
    conv_kernel_size: int = Field(2, ge=1, description="taps of each local convolution (at most block_size)")
    conv_group_size: int = Field(16, ge=1, description="channels sharing one dynamic tap (must divide the hidden size)")
    selector_rank: int = Field(256, ge=1, description="rank r of the selector's codebooks A, B [V, r] and projection P [r, H]")
    selector_top_k: int = Field(16, ge=1, description="K: unary candidates per slot the selector reranks (at most the vocabulary)")

    @field_validator("conv_kernel_size")
    @classmethod
    def _within_block(cls, v, info: ValidationInfo):
        block = info.data.get("block_size")
        if block is not None and v > block:
            raise ValueError(f"must be at most drafter.block_size ({block}): a tap reaches back within one block, got {v}")
        return v


class DFlash2Meta(DiffusionMeta):
    conv_kernel_size: Count(1, MAX_BLOCK_SIZE, "taps within one block")
    conv_group_size: Annotated[StrictInt, Range(1, lambda t: t.hidden_size, "at most the target's hidden size"), DividesHidden()]
    selector_rank: Count(1, lambda t: WIDTH_FACTOR * t.hidden_size, f"at most {WIDTH_FACTOR} times the target's hidden size")
    selector_top_k: Count(1, lambda t: t.vocab_size, "at most the target vocabulary")

    @field_validator("conv_kernel_size")
    @classmethod
    def _taps_in_block(cls, v, info: ValidationInfo):
        block = info.data.get("block_size")
        if block is not None and v > block:
            raise PydanticCustomError("meta_range", "is more taps than block_size {b}", {"b": block})
        return v

    @field_validator("selector_top_k")
    @classmethod
    def _in_draft_vocab(cls, v, info: ValidationInfo):
        vd = info.data.get("draft_vocab_size")
        if vd is not None and v > vd:
            raise PydanticCustomError("meta_range", "is more candidates than draft_vocab_size {vd}", {"vd": vd})
        return v


class DFlash2Loss(DiffusionLoss):
    selector_loss_alpha: float = Field(
        1.0, ge=0, description="alpha: weight of the selector's K-way CE over the unary top-K (SpecForge #772 / speculators #1006)"
    )


def grouped_dynamic_conv(x: torch.Tensor, delta: torch.Tensor, base: torch.Tensor, block_size: int, group_size: int) -> torch.Tensor:
    """``out[i, c] = sum_t (base[t, c] + delta[i, t, c // group_size]) x[i - t, c]`` for ``x`` [B, Q, H]
    (Q a multiple of ``block_size``: whole blocks side by side), ``delta`` [B, Q, taps, H / group_size],
    ``base`` [taps, H]; a tap reaching before its slot's block adds nothing."""
    B, Q, H = x.shape
    groups = H // group_size
    xg = x.view(B, Q, groups, group_size)
    slot = torch.arange(Q, device=x.device) % block_size
    out = (base[0].view(groups, group_size) + delta[:, :, 0, :, None]) * xg
    for t in range(1, base.shape[0]):
        shifted = F.pad(xg[:, : Q - t], (0, 0, 0, 0, t, 0)) * (slot >= t).view(1, Q, 1, 1).to(x.dtype)
        out = out + (base[t].view(groups, group_size) + delta[:, :, t, :, None]) * shifted
    return out.reshape(B, Q, H)


class GroupedDynamicConv(nn.Module):
    """The convolutions around one sublayer: ``prepare`` convolves its input and returns the
    output side's deltas, ``finish`` convolves its output with them (both deltas from one
    projection of the input, as the reference and vLLM compute them)."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int, block_size: int):
        super().__init__()
        self.kernel_size, self.group_size, self.block_size = kernel_size, group_size, block_size
        self.base_kernel = nn.Parameter(torch.zeros(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * (hidden_size // group_size), bias=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Identity: tap 0 = 1, the other taps and the dynamic part 0."""
        self.base_kernel.zero_()
        self.base_kernel[:, 0] = 1.0
        self.kernel_projection.weight.zero_()

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        delta = self.kernel_projection(x).view(*x.shape[:-1], 2, self.kernel_size, -1)
        out = grouped_dynamic_conv(x, delta[..., 0, :, :], self.base_kernel[0], self.block_size, self.group_size)
        return out, delta[..., 1, :, :]

    def finish(self, y: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        return grouped_dynamic_conv(y, delta, self.base_kernel[1], self.block_size, self.group_size)


class CandidateSelector(nn.Module):
    """Transition scores over each slot's unary candidates (codebooks indexed by target ids)."""

    def __init__(self, vocab_size: int, hidden_size: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.zeros(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.zeros(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02) -> None:
        """speculators' initialisation (normal, the layer config's initializer_range 0.02): the
        transition terms start near 0, so the walk starts as the unary top-1."""
        for p in (self.predecessor_codebook, self.successor_codebook, self.hidden_projection.weight):
            nn.init.normal_(p, std=std)

    def scores(self, unary: torch.Tensor, states: torch.Tensor, prev: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """``S(p -> c) = unary[c] + <A[p] * P h, B[c]>`` [..., K] for slots of ``states`` [..., H],
        predecessors ``prev`` [...] and ``candidates`` [..., K] (target ids) with unary logits [..., K]."""
        context = self.predecessor_codebook[prev] * self.hidden_projection(states)
        return unary + torch.einsum("...r,...kr->...k", context, self.successor_codebook[candidates])


@DRAFTERS.register()
class DFlash2Drafter(DiffusionDrafter):
    algorithm = "dflash2"
    Config = DFlash2Config
    Loss = DFlash2Loss
    Meta = DFlash2Meta

    def __init__(self, *args, conv_kernel_size: int, conv_group_size: int, selector_rank: int, selector_top_k: int, **kwargs):
        super().__init__(*args, **kwargs)
        H = self.shape.hidden_size
        for layer in self.layers:  # registered on the layers: the served names layers.N.attention_conv.*
            layer.attention_conv = GroupedDynamicConv(H, conv_kernel_size, conv_group_size, self.block_size)
            layer.mlp_conv = GroupedDynamicConv(H, conv_kernel_size, conv_group_size, self.block_size)
        self.candidate_selector = CandidateSelector(self.vocab_size, H, selector_rank, selector_top_k)

    # ---- construction -------------------------------------------------------------
    @classmethod
    def config_meta(cls, cfg: DFlash2Config, target, samples=None) -> dict:
        return {**super().config_meta(cfg, target, samples), "conv_kernel_size": cfg.conv_kernel_size,
                "conv_group_size": cfg.conv_group_size, "selector_rank": cfg.selector_rank, "selector_top_k": cfg.selector_top_k}

    @torch.no_grad()
    def init_weights(self, cfg: DFlash2Config, target, samples=None) -> None:
        super().init_weights(cfg, target, samples)
        for layer in self.layers:
            layer.attention_conv.reset_parameters()
            layer.mlp_conv.reset_parameters()
        self.candidate_selector.reset_parameters()

    def meta(self) -> dict:
        conv, sel = self.layers[0].attention_conv, self.candidate_selector
        return {**super().meta(), "conv_kernel_size": conv.kernel_size, "conv_group_size": conv.group_size,
                "selector_rank": sel.predecessor_codebook.shape[1], "selector_top_k": sel.top_k}

    @classmethod
    def from_meta(cls, meta: dict, target) -> "DFlash2Drafter":
        m = cls(
            LayerShape(**meta["shape"]), meta["vocab_size"], meta["draft_vocab_size"], meta["target_layers"], meta["num_layers"],
            meta["block_size"], meta["mask_token_id"], meta["normalize_fc_input"], conv_kernel_size=meta["conv_kernel_size"],
            conv_group_size=meta["conv_group_size"], selector_rank=meta["selector_rank"], selector_top_k=meta["selector_top_k"],
        )
        m.num_target_layers = meta["num_target_layers"]
        return m.attach(target)

    # ---- the network ------------------------------------------------------------------
    def block_states(self, ids, positions, context_kv, mask):
        """The diffusion backbone's block with each sublayer wrapped by its convolutions: the
        input of attention (the block's own queries, keys and values) and of the MLP, and their
        outputs. ``ids`` [B, Q] hold whole blocks (Q a multiple of block_size)."""
        h = self._embed(ids).to(self.fc.weight.dtype)
        cos, sin = self.rotary(positions, h)
        for layer, (kc, vc) in zip(self.layers, context_kv):
            a = layer.self_attn
            x, delta = layer.attention_conv.prepare(layer.input_layernorm(h))
            q, k, v = a.qkv(x, cos, sin)
            h = h + layer.attention_conv.finish(a.out(a.attend(q, torch.cat([kc, k], 2), torch.cat([vc, v], 2), mask=mask)), delta)
            x, delta = layer.mlp_conv.prepare(layer.post_attention_layernorm(h))
            h = h + layer.mlp_conv.finish(layer.mlp(x), delta)
        return self.norm(h)

    def walk(self, states: torch.Tensor, logits: torch.Tensor, anchor: torch.Tensor,
             choose: Callable[[torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The selector's path through slots ``states`` [..., J, H] with unary draft-vocab ``logits``
        [..., J, V_draft], from the verified ``anchor`` [...] (target ids): slot j's candidates are
        its unary top-K, scored from the token chosen at slot j - 1, ``choose(scores [..., K]) ->
        index [...]`` picks one. Returns (tokens [..., J], candidates [..., J, K]), target ids."""
        sel = self.candidate_selector
        unary, cand = logits.topk(sel.top_k, dim=-1)
        cand = self.to_target_ids(cand)
        prev, tokens = anchor, []
        for j in range(states.shape[-2]):
            index = choose(sel.scores(unary[..., j, :], states[..., j, :], prev, cand[..., j, :]))
            prev = cand[..., j, :].gather(-1, index[..., None]).squeeze(-1)
            tokens.append(prev)
        return torch.stack(tokens, -1), cand

    # ---- training ------------------------------------------------------------------------
    def training_loss(self, batch, hidden, cfg: DFlash2Loss):
        batch, anchors, states, targets = self.training_blocks(batch, hidden, cfg)
        logits = self.readout(states)
        loss, metrics, _ = self.block_objective(logits, targets, hidden, cfg)
        # what is served is the selector's walk: ``acc`` / ``accepted`` are its (reports set them beside
        # the served alpha_j), the unary top-1's move to backbone_*
        metrics["backbone_acc"], metrics["backbone_accepted"] = metrics.pop("acc"), metrics.pop("accepted")
        sel, more = self.selector_objective(states, logits, batch["input_ids"].gather(1, anchors), targets, cfg)
        metrics.update(more)
        return loss + cfg.selector_loss_alpha * sel, metrics

    def selector_objective(self, states, logits, anchor, targets: dict, cfg: DFlash2Loss):
        """(the selector's K-way CE, metrics) of the slots ``states`` [B, A, J, H] with unary
        ``logits`` [B, A, J, V_draft] of blocks at ``anchor`` tokens [B, A] (:meth:`block_targets`'
        ``targets``). Metrics, per slot over counted slots: ``acc`` (the selector's greedy walk from
        the anchor drafts the target's greedy token), ``recall_at_k`` (that token is among the unary
        top-K), ``teacher_forced_selector_acc`` (the selector's pick among them, predecessor
        teacher-forced, is it); ``accepted``: the greedy prefix the walk drafts."""
        B, A, J = targets["counted"].shape
        greedy = targets["greedy"]
        # the token slot k - 1 is trained toward: what it holds once accepted, slot k's predecessor
        gold = targets["data"] if cfg.targets == "data" else torch.where(greedy >= 0, greedy, targets["data"])
        gold_d = self.to_draft_ids(gold)
        counted = targets["counted"] & (gold_d >= 0)
        prev = torch.cat([anchor[..., None], gold[..., :-1]], -1)
        top = logits.topk(self.candidate_selector.top_k, dim=-1).indices
        cand, index, _ = inject_gold(top, gold_d.clamp_min(0))
        scores = self.candidate_selector.scores(logits.gather(-1, cand), states, prev, self.to_target_ids(cand))
        loss = selector_loss(scores.view(B * A, J, -1), index.view(B * A, J), counted.view(B * A, J), cfg.gamma)
        with torch.no_grad():
            m = targets["counted"].view(B * A, J)
            n = m.sum(0).clamp_min(1)
            recall = (self.to_target_ids(top) == greedy[..., None]).any(-1).view(B * A, J)
            strict = self.candidate_selector.scores(logits.gather(-1, top), states, prev, self.to_target_ids(top))  # serving's set
            picked = self.to_target_ids(top.gather(-1, strict.argmax(-1, keepdim=True)).squeeze(-1))
            tf_hit = (picked == greedy).view(B * A, J)
            path, _ = self.walk(states, logits, anchor, lambda s: s.argmax(-1))
            hit = (path == greedy).view(B * A, J) & m
            streak = hit.long().cumprod(-1).sum(-1)[m[:, 0]]
            metrics = {
                "acc": (hit.sum(0) / n).tolist(),
                "accepted": streak.float().mean().item() if streak.numel() else 0.0,
                "selector_loss": loss.item(),
                "recall_at_k": ((recall & m).sum(0) / n).tolist(),
                "teacher_forced_selector_acc": ((tf_hit & m).sum(0) / n).tolist(),
            }
        return loss, metrics
