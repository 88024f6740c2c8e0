"""The MTP module drafter with FastMTP's recursion (DeepSeek-V3's multi-token prediction module,
arXiv 2412.19437 and its README_WEIGHTS.md; FastMTP, arXiv 2509.18362; the loss: losses/mtp.py).

One module: RMSNorm of the previous hidden state (``hidden_layernorm``, DeepSeek's ``hnorm``) and
of the next token's embedding (``token_layernorm``, ``enorm``), ``input_proj`` (2H -> H,
``eh_proj``) over ``[embedding; hidden]``, one decoder layer of the target's family and a final
RMSNorm whose output the target's lm_head reads. The target's embedding and lm_head are shared
by reference, frozen and never saved. FastMTP fine-tunes this one module and applies it K times:
step k's input state is step k-1's output (the target's last hidden state, draftlab's
``hidden[L]``, at step 1), so inference drafts a chain exactly as EAGLE-1 does: feed the output
state back. The drafter therefore is an ``EagleBase`` (layer stack, KV-cached ``draft_step``) and
EAGLE's proposer drafts its chains and trees.

Training follows speculators' FastMTP trainer (``MTPDraftModel.forward``): every step is a causal
pass over the whole sequence of the previous step's outputs. Decoding differs from it beyond the
first draft: a draft attends to the committed positions' step-1 keys, as SGLang's and vLLM's MTP
decoding (and EAGLE's proposer here) runs it. The draft vocabulary is FastMTP's frequency-ranked
one (FR-Spec): the target's lm_head rows of the ``draft_vocab_size`` most frequent assistant
tokens of the training data, ``d2t``/``t2d`` as EAGLE-3. Layout and tensor names are
speculators 0.9's ``MTPDraftModel`` layer (export/mtp_speculators.py) with the decoder layer as
``layers.0``.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn as nn
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field

from draftlab.limits import MAX_K
from draftlab.losses.acceptance import AcceptanceLossFields
from draftlab.losses.eagle import DISTRIBUTION_KINDS, eagle3_step_loss, shift_left
from draftlab.losses.mtp import step_weights
from draftlab.models.drafter import DRAFTERS, Drafter, DraftVocabSize
from draftlab.models.eagle import KIND_DESCRIPTION, EagleBase, EagleMeta
from draftlab.models.layers import DecoderLayer, LayerShape, RMSNorm


class MtpConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    num_layers: int = Field(1, ge=1, description="decoder layers in the module (DeepSeek-V3's and speculators' have one)")
    draft_vocab_size: int = Field(
        8192, ge=0, description="FastMTP's frequency-ranked draft vocabulary: the target's lm_head rows of the most frequent "
        "assistant tokens; 0 = the full target vocabulary (what speculators' mtp format holds)",
    )


class MtpLoss(AcceptanceLossFields):
    model_config = ConfigDict(extra="forbid")

    kind: Literal[DISTRIBUTION_KINDS] = Field("ce", description=KIND_DESCRIPTION)  # type: ignore[valid-type]
    steps: int = Field(3, ge=1, le=MAX_K, description="K: recursive applications of the module trained (FastMTP: 3)")
    step_decay: float = Field(
        0.6, gt=0, le=1, description="beta in (0, 1]: step k weighs beta**(k-1), normalised over the K steps (FastMTP eq. 2: 0.6)"
    )


class MtpMeta(EagleMeta):
    draft_vocab_size: DraftVocabSize


@DRAFTERS.register()
class MtpDrafter(EagleBase):
    algorithm = "mtp"
    Config = MtpConfig
    Loss = MtpLoss
    Meta = MtpMeta
    vocab_maps = ("d2t", "t2d")

    def __init__(self, shape: LayerShape, vocab_size: int, draft_vocab_size: int, num_layers: int):
        super().__init__(shape, vocab_size, num_layers, DecoderLayer(shape))
        H, eps = shape.hidden_size, shape.rms_norm_eps
        self.hidden_layernorm = RMSNorm(H, eps)
        self.token_layernorm = RMSNorm(H, eps)
        self.input_proj = nn.Linear(2 * H, H, bias=False)
        self.final_layernorm = RMSNorm(H, eps)
        self.draft_vocab_size = draft_vocab_size
        self.num_target_layers = None  # set by from_meta; hidden[L] is the module's first input state
        self.add_vocab_maps(vocab_size, draft_vocab_size)
        self._rows, self._rows_key = None, None  # the target's lm_head rows of the draft vocabulary, cached

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def default_capture_layers(cls, num_target_layers: int) -> list[int]:
        return [num_target_layers]

    @classmethod
    def config_meta(cls, cfg: MtpConfig, target, samples=None) -> dict:
        V = target.vocab_size
        return {
            "shape": LayerShape.from_hf(target.config).model_dump(),
            "vocab_size": V,
            "draft_vocab_size": cfg.draft_vocab_size if 0 < cfg.draft_vocab_size < V else V,
            "num_layers": cfg.num_layers,
            "num_target_layers": target.num_layers,
        }

    def init_weights(self, cfg: MtpConfig, target, samples=None) -> None:
        self.fill_vocab_maps(samples)
        with torch.no_grad():
            # the shared lm_head was trained on states with the target's final-norm gain: start there
            self.final_layernorm.weight.copy_(target.final_norm.weight.float())

    def meta(self) -> dict:
        return {
            "shape": self.shape.model_dump(),
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "num_layers": len(self.layers),
            "num_target_layers": self.num_target_layers,
        }

    @classmethod
    def from_meta(cls, meta: dict, target) -> "MtpDrafter":
        m = cls(LayerShape(**meta["shape"]), meta["vocab_size"], meta["draft_vocab_size"], meta["num_layers"])
        m.num_target_layers = meta["num_target_layers"]
        return m.attach(target)

    @classmethod
    def trained_depth(cls, loss: dict) -> int | None:
        """K, the recursion depth trained (the recipe's, else the default): the module never
        learned to read its own state past it."""
        steps = loss.get("steps", cls.Loss.model_fields["steps"].default)
        return steps if isinstance(steps, int) and not isinstance(steps, bool) and steps >= 1 else None

    # ---- the module ---------------------------------------------------------------------
    @property
    def capture_layers(self) -> list[int]:
        return [self.num_target_layers]

    def features(self, hidden):
        return hidden[self.num_target_layers]

    def stack(self, emb, h, positions, attend_for_layer, depth: int = 0):
        """The module's output state (after ``final_layernorm``: what the lm_head reads and the
        next step is fed, as in speculators' and Qwen3-Next's MTP layers) for embeddings ``emb``
        and previous states ``h``. The same module at every draft ``depth``: FastMTP's sharing."""
        x = self.input_proj(torch.cat([self.token_layernorm(emb), self.hidden_layernorm(h)], dim=-1))
        return self.final_layernorm(super().stack(None, x, positions, attend_for_layer))

    def head(self, h):
        if self.draft_vocab_size == self.vocab_size:
            return self._target_lm_head(h)
        return F.linear(h, self.head_rows(h.dtype))

    def head_rows(self, dtype: torch.dtype) -> torch.Tensor:
        """The target's lm_head rows of the draft vocabulary [V_draft, H], in draft-id order; sliced
        again only when ``t2d`` or the target's weight changed (load, build, a device move)."""
        W = self._target_lm_head.weight
        key = (W.data_ptr(), W._version, self.t2d.data_ptr(), self.t2d._version, dtype)
        if key != self._rows_key:
            self._rows, self._rows_key = W.detach()[self.t2d].to(dtype), key
        return self._rows

    derived_targets = Drafter.next_token_targets

    # ---- training ----------------------------------------------------------------------
    def recurse(self, ids, hidden, steps: int):
        """FastMTP's recursion: yield (step i, output states [B, T, H]) for i < ``steps``. Step i at
        position t reads token x_{t+1+i} and step i-1's output at t (the target's state at i = 0)
        and attends causally to step i's own positions, as speculators' ``MTPDraftModel`` trains.
        Every step sits at positions 0..T-1 (RoPE is relative: decoding's shift by i changes nothing)."""
        B, T = ids.shape
        positions = torch.arange(T, device=ids.device).expand(B, T)

        def causal(i, attn):
            return lambda q, k, v: attn.attend(q, k, v, causal=True)

        h = self.features(hidden)
        for i in range(steps):
            h = self.stack(self.embed(shift_left(ids, 1 + i)), h, positions, causal)
            yield i, h

    def training_loss(self, batch, hidden, cfg: MtpLoss):
        ids, loss_mask = batch["input_ids"], batch["loss_mask"].bool()
        B, T = ids.shape
        K = cfg.steps
        # step i at t imitates the target at s = t+1+i and counts where loss_mask[t+2+i]: the target
        # is computed at the indices s with loss_mask[s+1] only, and its rows gathered per step
        need, target_argmax, in_vocab, p = self.compact_targets(batch, hidden)
        row = F.pad((need.flatten().cumsum(0) - 1).view(B, T), (0, K + 1), value=-1)
        counted_all = F.pad(loss_mask, (0, K + 2))
        weights = step_weights(cfg.step_decay, K)
        loss = p.new_zeros(())
        step_loss, step_acc = [], []
        for i, h in self.recurse(ids, hidden, K):
            counted = counted_all[:, 2 + i : 2 + i + T]
            r = row[:, 1 + i : 1 + i + T][counted]
            logits = self.head(h[counted])
            li = eagle3_step_loss(logits, p[r], in_vocab[r], kind=cfg.kind, eta=cfg.eta)
            loss = loss + weights[i] * li
            with torch.no_grad():  # top-1 agreement, out-of-draft-vocab targets count as misses
                hit = self.to_target_ids(logits.max(-1).indices) == target_argmax[r]
                step_acc.append(hit.float().mean().item() if hit.numel() else 0.0)
            step_loss.append(li.item())
        return loss, {"loss_steps": step_loss, "acc": step_acc}
