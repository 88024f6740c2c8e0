"""Hydra and Hydra++ heads (Ankner et al. 2024, arXiv 2402.05109; zankner/Hydra, its
``hydra/model/hydra_heads/prefix_mlp_head.py`` and ``hydra/model/hydra_model.py``).

Medusa heads made sequentially dependent: head i (0-based) at position t predicts x_{t+2+i} from
``[s_t; E(x_{t+1}); ...; E(x_{t+1+i})]``, the state s_t and the target's (frozen, shared) input
embeddings of the tokens before the one it guesses: at decoding time x_{t+1} is the target's own
next token and the rest are the draft's path so far, so a draft is built level by level.

Hydra++ (the reference's ``prefix-mlp`` head with ``grounded_heads``) computes s_t with a
"prefix attention" layer: one decoder layer of the target's shape, then an RMSNorm (an HF
``LlamaModel`` of one layer in the reference), run causally over the target's last hidden states
(after its final norm, ``hidden[L]``) with a KV cache of its own that only ever holds verified
positions. With ``prefix_attention: false`` s_t is the target's state itself (plain Hydra).

Head i is ``num_layers`` blocks then a projection onto the draft vocabulary: the first block reads
the (i+2)H-wide input, ``res_connection(x) + SiLU(linear(x))`` (both Linear((i+2)H -> H)); the
others are Medusa's ``x + SiLU(W x + b)`` (``models.medusa.ResidualBlocks``). The objective is
Medusa's (``losses/medusa.py``): head i imitates the target's distribution at s = t+1+i (Hydra++:
soft CE to it, the target frozen).

Where draftlab differs from the reference, and why:

* every head starts as the target's own read-out: the first block's ``linear`` and the further
  blocks are zero (the reference zeroes their weights but not their biases), ``res_connection``
  passes the state through (the reference starts it at random), and the prefix layer's output
  projections (``o_proj``, ``down_proj``) start at zero (the reference's near-zero N(0, 0.02));
* the further blocks of a head have weights of their own: the reference builds them as one
  ``ResBlock`` object repeated (``[Dropout, ResBlock] * (n - 1)``), so they share one;
* the projections have no bias (the target's lm_head has none; the reference's start at random),
  and cover a reduced draft vocabulary with ``draft_vocab_size`` (``d2t``/``t2d`` as Medusa);
* the reference's dropout (0.2 for Hydra++) is not implemented.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, StrictBool

from draftlab.losses.eagle import shift_left
from draftlab.models.drafter import (
    DRAFTERS,
    MAX_HEADS,
    Count,
    Drafter,
    DrafterDepth,
    DrafterMeta,
    DraftVocabSize,
    ShapeMeta,
    TargetNumLayers,
    TargetVocabSize,
)
from draftlab.models.layers import DecoderLayer, LayerShape, RMSNorm, Rotary
from draftlab.models.medusa import MedusaDrafter, MedusaLoss, ResidualBlocks


class HydraConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    num_heads: int = Field(4, ge=1, description="heads; head i predicts the token i + 2 after the last verified one (Hydra++: 4)")
    num_layers: int = Field(4, ge=1, description="blocks per head: the grounded first block, then x + SiLU(Wx + b) (Hydra++: 4)")
    draft_vocab_size: int = Field(0, ge=0, description="0 = the full target vocabulary; else its N most frequent assistant tokens")
    prefix_attention: bool = Field(True, description="Hydra++'s prefix layer over the target's states; false = plain Hydra")


class HydraMeta(DrafterMeta):
    shape: ShapeMeta  # the prefix layer's (the target's decoder-layer shape)
    vocab_size: TargetVocabSize
    draft_vocab_size: DraftVocabSize
    num_heads: Count(1, MAX_HEADS, "heads a drafter may have")
    num_layers: DrafterDepth  # blocks per head
    prefix_attention: StrictBool
    num_target_layers: TargetNumLayers


class HydraLoss(MedusaLoss):
    decay: float = Field(1.0, gt=0, description="head i's loss is weighted head_weight * decay**i (Hydra sums them unweighted)")


class GroundedBlock(nn.Module):
    """A head's first block on its (i+2)H-wide input: ``res_connection(x) + SiLU(linear(x))``,
    the reference's ``ResBlock(hidden_size, num_condition=i + 1)``."""

    def __init__(self, in_dim: int, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(in_dim, hidden_size)
        self.res_connection = nn.Linear(in_dim, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.res_connection(x) + F.silu(self.linear(x))


class PrefixAttention(nn.Module):
    """Hydra++'s prefix layer: a decoder layer of the target's shape and a final RMSNorm over
    the target's last hidden states; ``attend`` (causal, KV-cached) is the caller's."""

    def __init__(self, shape: LayerShape):
        super().__init__()
        self.layer = DecoderLayer(shape)
        self.norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.rotary = Rotary(shape)

    def forward(self, h: torch.Tensor, positions: torch.Tensor, attend) -> torch.Tensor:
        cos, sin = self.rotary(positions, h)
        return self.norm(self.layer(h, cos, sin, attend))


@DRAFTERS.register()
class HydraDrafter(Drafter):
    algorithm = "hydra"
    Config = HydraConfig
    Loss = HydraLoss
    Meta = HydraMeta
    vocab_maps = ("d2t", "t2d")
    derived_keys = ("prefix.rotary.",)  # RoPE tables are rebuilt from the layer shape
    shares_embedding = True  # the heads read the target's input embeddings of the path

    def __init__(self, shape: LayerShape, vocab_size: int, draft_vocab_size: int, num_heads: int, num_layers: int,
                 prefix_attention: bool):
        super().__init__()
        H = shape.hidden_size
        # plain sizes: a decoding copy (kernels/cpu_gemm.py) swaps the nn.Linear modules out
        self.shape, self.hidden_size, self.vocab_size, self.draft_vocab_size = shape, H, vocab_size, draft_vocab_size
        self.prefix = PrefixAttention(shape) if prefix_attention else None
        self.first = nn.ModuleList([GroundedBlock((i + 2) * H, H) for i in range(num_heads)])
        self.blocks = nn.ModuleList([ResidualBlocks(H, num_layers - 1) for _ in range(num_heads)])
        self.lm_heads = nn.ModuleList([nn.Linear(H, draft_vocab_size, bias=False) for _ in range(num_heads)])
        self.add_vocab_maps(vocab_size, draft_vocab_size)
        self.num_target_layers = None  # set by build/from_meta: hidden[L] is what the prefix reads

    @property
    def num_heads(self) -> int:
        return len(self.first)

    @property
    def num_layers(self) -> int:
        return 1 + len(self.blocks[0].layers)

    # ---- construction -------------------------------------------------------
    @classmethod
    def default_capture_layers(cls, num_target_layers: int) -> list[int]:
        return [num_target_layers]

    @classmethod
    def config_meta(cls, cfg: HydraConfig, target, samples=None) -> dict:
        V = target.vocab_size
        return {
            "shape": LayerShape.from_hf(target.config).model_dump(),
            "vocab_size": V,
            "draft_vocab_size": cfg.draft_vocab_size if 0 < cfg.draft_vocab_size < V else V,
            "num_heads": cfg.num_heads,
            "num_layers": cfg.num_layers,
            "prefix_attention": cfg.prefix_attention,
            "num_target_layers": target.num_layers,
        }

    def init_weights(self, cfg: HydraConfig, target, samples=None) -> None:
        self.fill_vocab_maps(samples)
        H = self.hidden_size
        with torch.no_grad():  # every head starts as the target's own read-out of the state it is given
            rows = self.draft_rows(target.lm_head.weight)
            for first, head in zip(self.first, self.lm_heads):
                nn.init.zeros_(first.linear.weight)
                nn.init.zeros_(first.linear.bias)
                first.res_connection.weight.zero_()[:, :H].copy_(torch.eye(H))
                nn.init.zeros_(first.res_connection.bias)
                head.weight.copy_(rows)
            if self.prefix is not None:  # the prefix layer starts as the identity on its residual stream
                nn.init.zeros_(self.prefix.layer.self_attn.o_proj.weight)
                nn.init.zeros_(self.prefix.layer.mlp.down_proj.weight)

    def meta(self) -> dict:
        return {
            "shape": self.shape.model_dump(),
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "num_heads": self.num_heads,
            "num_layers": self.num_layers,
            "prefix_attention": self.prefix is not None,
            "num_target_layers": self.num_target_layers,
        }

    @classmethod
    def from_meta(cls, meta: dict, target) -> "HydraDrafter":
        m = cls(LayerShape(**meta["shape"]), meta["vocab_size"], meta["draft_vocab_size"], meta["num_heads"], meta["num_layers"],
                meta["prefix_attention"])
        m.num_target_layers = meta["num_target_layers"]
        return m.attach(target)

    # ---- what the heads read --------------------------------------------------------
    @property
    def capture_layers(self) -> list[int]:
        return [self.num_target_layers]

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self._embed(ids).to(self.lm_heads[0].weight.dtype)

    def states(self, final: torch.Tensor, positions: torch.Tensor, attend) -> torch.Tensor:
        """The heads' states s [B, T, H] for the target's final hidden states ``final`` [B, T, H]
        at RoPE ``positions`` [B, T]: the prefix layer's output (``attend(q, k, v)``: causal over
        whatever it has cached), or ``final`` itself without one."""
        final = final.to(self.lm_heads[0].weight.dtype)
        return final if self.prefix is None else self.prefix(final, positions, attend)

    def head_logits(self, x: torch.Tensor, i: int) -> torch.Tensor:
        """Head ``i``'s draft-vocab logits [..., V_draft] for inputs ``x`` [..., >= (i+2)H] that
        start with ``[s; E(x_{t+1}); ...; E(x_{t+1+i})]`` (head i reads those channels)."""
        x = x[..., : (i + 2) * self.hidden_size]
        return self.lm_heads[i](self.blocks[i](self.first[i](x)))

    # Medusa's training targets and per-head loss: the same alignment (head i at t imitates the
    # target at t+1+i), only the heads' inputs differ
    derived_targets = Drafter.next_token_targets
    heads_loss = MedusaDrafter.heads_loss

    # ---- training ----------------------------------------------------------------------
    def teacher_forced(self, ids: torch.Tensor, final: torch.Tensor) -> torch.Tensor:
        """Every position's head inputs [B, T, (N+1)H] for a sequence ``ids`` [B, T] and the
        target's final hidden states of it: ``[s_t; E(x_{t+1}); ...; E(x_{t+N})]``, the data's
        tokens in place of the drafts (head i reads the first (i+2)H channels)."""
        B, T = ids.shape
        positions = torch.arange(T, device=ids.device).expand(B, T)
        s = self.states(final, positions, lambda q, k, v: self.prefix.layer.self_attn.attend(q, k, v, causal=True))
        with torch.no_grad():  # the target's embedding is frozen
            emb = self.embed(ids)
        return torch.cat([s, *(shift_left(emb, j) for j in range(1, self.num_heads + 1))], -1)

    def training_loss(self, batch, hidden, cfg: HydraLoss):
        ids, loss_mask = batch["input_ids"], batch["loss_mask"].bool()
        B, T = ids.shape
        if "target_argmax" not in batch:  # not supplied (cached) by the trainer
            batch = {**batch, **self.derived_targets(hidden, batch)}
        final = hidden[self.num_target_layers]
        x = self.teacher_forced(ids, final)
        # the target at s = t+1+i, computed compactly where loss_mask[s+1], as Medusa's loss does
        need = shift_left(loss_mask, 1, fill=False)
        row = (need.flatten().cumsum(0) - 1).view(B, T)
        greedy = batch["target_argmax"][need]
        probs = self.target_draft_probs(final[need]) if cfg.targets == "target" else None
        labels = self.to_draft_ids(ids) if cfg.targets == "data" else None
        return self.heads_loss(x, loss_mask, row, probs, labels, greedy, cfg)
