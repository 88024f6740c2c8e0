"""Medusa-2 (Cai et al. 2024, arXiv 2401.10774: the joint training it calls Medusa-2;
FasterDecoding/Medusa's axolotl fork):
Medusa heads trained jointly with LoRA adapters on the target's decoder.

The heads are Medusa-1's (``MedusaDrafter``: head i at t guesses x_{t+2+i} from the last hidden
state after the final norm), but they read the *adapted* target's hidden state h', and the
heads' loss reaches the adapters too: the backbone learns features the heads can read. The
adapted target's own next-token distribution is kept on the original's by self-distillation,
KL(original || adapted) at the loss positions; the original's distribution is the lm_head of
the frozen ``hidden[L]`` the feature source already captured (the same model with its adapters
disabled, without a second forward). Loss:

    lm_weight * KL  +  sum_i head_weight * decay**i * L_i       (Medusa-2: 1.0 and 0.2 * 0.8**i)

LoRA (peft's ``LoraLayer``, r 32, alpha 16 by default) sits on a *view* of the target's decoder:
a copy of its module tree whose parameters are the target's own tensors (shared, frozen, never
registered here), with peft's adapter layers injected into the copy. The target object itself is
untouched, so its fast fused forward still gives the original's hidden states. The adapters'
A/B linears are registered under the drafter (``lora.{layer}.{proj}.lora_A|lora_B``) and are the
very modules peft's layers call: the checkpoint holds the heads and the LoRA tensors only.

Decoding is lossless with respect to the *merged* target (base weights + B A * alpha / r), the
model Medusa-2 serves: :meth:`Medusa2Drafter.merged_target` builds it as a ``Target``. The
``medusa2`` proposer (``inference/medusa2.py``) verifies with it and reports how far its greedy
outputs moved from the original's; ``export/medusa2.py`` writes it as a Hugging Face model beside
the heads in vLLM's Medusa layout.
"""

from __future__ import annotations

import copy
import re

import torch
import torch.nn as nn
from pydantic import Field, StrictStr, field_validator
from pydantic_core import PydanticCustomError

from draftlab.errors import DraftlabError
from draftlab.losses.eagle import SoftCrossEntropy, shift_left
from draftlab.models.drafter import DRAFTERS, Count, PositiveFloat
from draftlab.models.medusa import MedusaConfig, MedusaDrafter, MedusaLoss, MedusaMeta
from draftlab.models.target import Target

# the projections of a decoder layer of every supported family (models/target.py), in layer order
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTER = "default"  # peft's adapter name
_LAYER_PATH = re.compile(r"layers\.(\d+)\.(self_attn|mlp)\.(\w+)")


def check_lora_targets(targets) -> list[str]:
    """The projections in ``LORA_TARGETS`` order; a ValueError names the first problem."""
    if isinstance(targets, str) or not isinstance(targets, (list, tuple)) or not targets:
        raise ValueError(f"needs a non-empty list of projections from {', '.join(LORA_TARGETS)}")
    unknown = [t for t in targets if t not in LORA_TARGETS]
    if unknown:
        raise ValueError(f"unknown projection {unknown[0]!r} (choose from {', '.join(LORA_TARGETS)})")
    if len(set(targets)) != len(targets):
        raise ValueError(f"lists a projection twice: {list(targets)}")
    return [t for t in LORA_TARGETS if t in targets]


def _validated_targets(targets, error):
    """:func:`check_lora_targets` for a pydantic validator: ``error(problem)`` is what it raises."""
    try:
        return check_lora_targets(targets)
    except ValueError as e:
        raise error(str(e)) from None


class Medusa2Config(MedusaConfig):
    lora_r: int = Field(32, ge=1, description="LoRA rank of every adapted projection")
    lora_alpha: float = Field(16.0, gt=0, description="LoRA scale alpha: the update is B A * alpha / r")
    lora_targets: list[str] = Field(list(LORA_TARGETS), description="decoder-layer projections that get adapters")

    @field_validator("lora_targets")
    @classmethod
    def _known_targets(cls, v):
        return _validated_targets(v, lambda problem: PydanticCustomError("lora_targets", problem))


class Medusa2Meta(MedusaMeta):
    lora_r: Count(1, lambda t: t.hidden_size, "at most the target's hidden size")
    lora_alpha: PositiveFloat
    lora_targets: list[StrictStr]

    @field_validator("lora_targets")
    @classmethod
    def _known_targets(cls, v):
        return _validated_targets(v, lambda problem: PydanticCustomError("meta_choice", "is refused: {problem}", {"problem": problem}))


class Medusa2Loss(MedusaLoss):
    head_weight: float = Field(0.2, gt=0, description="lambda0: head i's loss weighs lambda0 * decay**i next to the LM term")
    lm_weight: float = Field(1.0, ge=0, description="weight of KL(original target || adapted target) at the loss positions")


@DRAFTERS.register()
class Medusa2Drafter(MedusaDrafter):
    algorithm = "medusa2"
    Config = Medusa2Config
    Loss = Medusa2Loss
    Meta = Medusa2Meta

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.lora_r, self.lora_alpha, self.lora_targets = None, None, []
        self.lora = nn.ModuleDict()  # filled by ``adapt``: its shapes are the target's

    # ---- construction -------------------------------------------------------
    @classmethod
    def config_meta(cls, cfg: Medusa2Config, target, samples=None) -> dict:
        return {**super().config_meta(cfg, target, samples), "lora_r": cfg.lora_r, "lora_alpha": cfg.lora_alpha, "lora_targets": list(cfg.lora_targets)}

    @classmethod
    def from_meta(cls, meta: dict, target) -> "Medusa2Drafter":
        return super().from_meta(meta, target).adapt(target, meta["lora_r"], meta["lora_alpha"], meta["lora_targets"])

    def meta(self) -> dict:
        return {**super().meta(), "lora_r": self.lora_r, "lora_alpha": self.lora_alpha, "lora_targets": list(self.lora_targets)}

    def adapt(self, target, r: int, alpha: float, targets) -> "Medusa2Drafter":
        """Inject peft LoRA adapters (B = 0: the adapted target starts as the original) into a
        view of ``target``'s decoder and register their A/B linears under ``self.lora``.

        The view is a deep copy of the decoder's module tree in which every parameter and buffer
        is the target's own tensor (deepcopy's memo maps each to itself): it costs module
        objects, not weights, and the target's modules are never wrapped. peft's initialisation
        of A draws from a fork of the global RNG, which is left as it was (loading a checkpoint
        or building a proposer between training steps must not move it)."""
        try:
            from peft import LoraConfig, inject_adapter_in_model
            from peft.tuners.lora import LoraLayer
        except ImportError as e:
            raise DraftlabError(f"drafter family medusa2 needs the peft package (pip install peft): {e}") from None
        targets = check_lora_targets(targets)  # in layer order
        backbone = target.model.model
        shared = {id(t): t for t in (*backbone.parameters(), *backbone.buffers())}
        view = copy.deepcopy(backbone, memo=shared)
        config = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0, bias="none")
        with torch.random.fork_rng(devices=[]):
            inject_adapter_in_model(config, view, adapter_name=ADAPTER)
        lora, layers = nn.ModuleDict(), {}
        for name, module in view.named_modules():
            if not isinstance(module, LoraLayer):
                continue
            m = _LAYER_PATH.fullmatch(name)
            if m is None:  # a supported family has its projections only in its decoder layers
                raise DraftlabError(f"LoRA: unexpected adapted module {name} in the {target.config.model_type} decoder")
            i, proj = m.group(1), m.group(3)
            if i not in lora:
                lora[i] = nn.ModuleDict()
            lora[i][proj] = nn.ModuleDict({"lora_A": module.lora_A[ADAPTER], "lora_B": module.lora_B[ADAPTER]})
            layers[f"{i}.{proj}"] = (name, module)
        missing = len(targets) * target.num_layers - len(layers)
        if missing:
            raise DraftlabError(f"LoRA: lora_targets {targets} matched {len(layers)} of {len(targets) * target.num_layers} projections of the target")
        self.lora = lora.float()  # fp32 master weights, as the heads; peft casts its inputs
        self.lora_r, self.lora_alpha, self.lora_targets = r, alpha, targets
        object.__setattr__(self, "_adapted", view)  # by reference: never registered, saved or wrapped
        object.__setattr__(self, "_lora_layers", layers)  # "{layer}.{proj}" -> (module path, peft layer)
        return self

    # ---- the adapted target -----------------------------------------------------------
    def adapted_hidden(self, input_ids: torch.Tensor) -> torch.Tensor:
        """h' [B, T, H]: the adapted target's last hidden state after its final norm (the
        convention of ``hidden[L]``), with grad into the adapters when grad is enabled. Causal
        attention without a mask, as the feature source's capture: right padding never reaches
        a real token."""
        return self._adapted(input_ids=input_ids, use_cache=False).last_hidden_state

    def lora_scaling(self) -> float:
        return self.lora_alpha / self.lora_r

    def delta_weights(self) -> dict[str, torch.Tensor]:
        """Module path (in the decoder, e.g. ``layers.0.self_attn.q_proj``) -> the adapter's
        weight update B A * alpha / r [out, in], as peft computes it for its own merge."""
        with torch.no_grad():
            return {path: layer.get_delta_weight(ADAPTER) for path, layer in self._lora_layers.values()}

    def peft_state_dict(self) -> dict[str, torch.Tensor]:
        """The adapters under the names of a saved peft adapter for the target's CausalLM
        (``get_peft_model_state_dict``: ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``)."""
        out = {}
        for key, (path, _) in self._lora_layers.items():
            i, proj = key.split(".")
            for ab in ("lora_A", "lora_B"):
                out[f"base_model.model.model.{path}.{ab}.weight"] = self.lora[i][proj][ab].weight.detach()
        return out

    def medusa_heads(self) -> MedusaDrafter:
        """A Medusa-1 drafter sharing this one's heads and draft vocabulary (by reference): what
        Medusa's proposer and vLLM's Medusa layout take. It reads whichever target's ``hidden[L]``
        it is given; these heads were trained on the adapted one's."""
        with torch.device("meta"):  # no storage: every tensor is replaced by this drafter's
            heads = MedusaDrafter(self.hidden_size, self.vocab_size, self.draft_vocab_size, self.num_heads, self.num_layers)
        heads.blocks, heads.lm_heads = self.blocks, self.lm_heads
        heads.d2t, heads.t2d = self.d2t, self.t2d
        heads.num_target_layers = self.num_target_layers
        object.__setattr__(heads, "_target_lm_head", self._target_lm_head)
        return heads.train(self.training)

    # ---- the merged target ------------------------------------------------------------
    def merged_hf_model(self, base_target):
        """A copy of ``base_target``'s HF model with this drafter's adapters merged into its
        weights (W + B A * alpha / r in the base dtype; every other tensor copied as is). Fresh
        tensors: no view of the base target's fused weights, ties (embedding / lm_head) kept."""
        model = copy.deepcopy(base_target.model)  # Parameter deepcopy clones: q/k/v stop being views of one fused tensor
        modules = dict(model.model.named_modules())
        with torch.no_grad():
            for path, delta in self.delta_weights().items():
                w = modules[path].weight
                w.add_(delta.to(device=w.device, dtype=w.dtype))
        return model.eval()

    def merged_target(self, base_target) -> Target:
        """``base_target`` (the original, as this drafter was trained on) with the adapters merged,
        as a ``Target``: the verifier Medusa-2 decodes with. Speculative decoding with it is
        lossless with respect to this merged model, not the original."""
        name = base_target.identity.get("name", "target")
        identity = {**base_target.identity, "name": f"{name}+medusa2-lora", "source": "medusa2 merge"}
        return Target(self.merged_hf_model(base_target), base_target.tokenizer, identity)

    # ---- training ---------------------------------------------------------------------
    def training_loss(self, batch, hidden, cfg: Medusa2Loss):
        ids, loss_mask = batch["input_ids"], batch["loss_mask"].bool()
        B, T = ids.shape
        if "target_argmax" not in batch:  # not supplied (cached) by the trainer
            batch = {**batch, **self.derived_targets(hidden, batch)}
        original = hidden[self.num_target_layers]  # the frozen target's h: adapters disabled
        adapted = self.adapted_hidden(ids)
        # Positions s whose next token is a loss token: the LM term is taken there, and head i at
        # t reads the original's distribution at s = t+1+i (Medusa-1's alignment, losses/medusa.py).
        need = shift_left(loss_mask, 1, fill=False)
        row = (need.flatten().cumsum(0) - 1).view(B, T)
        with torch.no_grad():
            z0 = self._target_lm_head(original[need]).float()  # the original's logits [N, V]
            p0 = z0.softmax(-1)
            entropy = torch.logsumexp(z0, -1) - torch.linalg.vecdot(p0, z0)
        # KL(p0 || q) = CE(p0, q) - H(p0): the CE's fused autograd, the entropy a constant
        lm_logits = self._target_lm_head(adapted[need]) if cfg.lm_weight > 0 else self._target_lm_head(adapted[need].detach())
        kl_rows = SoftCrossEntropy.apply(lm_logits, p0) - entropy
        kl = kl_rows.sum() / max(kl_rows.numel(), 1)
        loss = cfg.lm_weight * kl if cfg.lm_weight > 0 else kl.new_zeros(())
        probs = None
        if cfg.targets == "target":  # the original's distribution over the draft vocab (softmax restricted = renormalised)
            probs = p0 if self.draft_vocab_size == self.vocab_size else p0[:, self.t2d]
            probs = probs / probs.sum(-1, keepdim=True) if self.draft_vocab_size < self.vocab_size else probs
        labels = self.to_draft_ids(ids) if cfg.targets == "data" else None
        greedy = batch["target_argmax"][need]  # the ORIGINAL target's greedy tokens
        heads, metrics = self.heads_loss(adapted, loss_mask, row, probs, labels, greedy, cfg)
        with torch.no_grad():  # how often the adapted target's own greedy token is still the original's
            lm_agree = (lm_logits.argmax(-1) == z0.argmax(-1)).float().mean().item() if lm_logits.numel() else 0.0
        return loss + heads, {**metrics, "lm_kl": kl.item(), "lm_agree": lm_agree}
