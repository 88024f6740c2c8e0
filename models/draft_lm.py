"""An independent draft model: a small causal LM of the target's own architecture and vocabulary
(Leviathan et al. 2023), distilled from the target (DistillSpec, Zhou et al. 2024).

It drafts on its own, from tokens only: it reads no target hidden state when decoding, so any
engine that serves a "draft model" (vLLM's ``draft_model``, HF's ``assistant_model``) runs it as
it is. ``self.lm`` is a plain HF causal LM built from the target's own config class with fewer
layers (optionally narrower, then randomly initialised): its state-dict keys are ``lm.`` plus
HF's names, and :meth:`DraftLM.hf_config` is the config.json that names its architecture.

Initialised from the target (``init: target``), it starts as the target truncated to
``target_layers`` (evenly spread by default, first and last included): embedding, final norm,
lm_head and those decoder layers copied, the mapping recorded in the checkpoint.

Training reads the target's final, normed hidden state (``capture_layers`` = [L]): the loss
recomputes the target's logits from it through the target's lm_head in chunks, so a captured
position costs H floats instead of V.
"""

from __future__ import annotations

import copy
import math
from typing import Annotated, Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from draftlab.errors import DraftlabError
from draftlab.losses.draft_lm import DraftLMLoss, distill_loss
from draftlab.losses.eagle import shift_left
from draftlab.models.drafter import (
    DRAFTERS,
    Count,
    Drafter,
    DrafterMeta,
    HeadCount,
    LayerRules,
    LayerWidth,
    PositionCount,
    PositiveFloat,
    TargetNumLayers,
    TargetValue,
    TargetVocabSize,
    check_rope,
)

# beyond this a meta is corrupt, not a draft model (the deepest published LLMs have ~126 layers)
MAX_DRAFT_LAYERS = 256

# the config fields that differ between draft and target, by their HF names
WIDTHS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim")


class DraftLMConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    num_layers: int = Field(4, ge=1, description="decoder layers of the draft model")
    target_layers: list[int] | None = Field(
        None, description="init target: the target layer copied into each draft layer; default evenly spread, first and last included"
    )
    hidden_size: int | None = Field(None, ge=1, description="narrower than the target (init random only); default the target's")
    intermediate_size: int | None = Field(None, ge=1)
    num_attention_heads: int | None = Field(None, ge=1)
    num_key_value_heads: int | None = Field(None, ge=1)
    head_dim: int | None = Field(None, ge=2, description="default the target's, or hidden_size / num_attention_heads when either is set")
    init: Literal["target", "random"] = Field("target", description="target: copies of the target's weights; random: HF's initialisation")

    @field_validator("init")
    @classmethod
    def _init_fits(cls, v, info: ValidationInfo):
        if v == "target":
            narrowed = [w for w in WIDTHS if info.data.get(w) is not None]
            if narrowed:
                raise PydanticCustomError(
                    "init", "target copies the target's layers, so {w} must be the target's: use init random for a narrower model",
                    {"w": narrowed[0]},
                )
        elif info.data.get("target_layers") is not None:
            raise PydanticCustomError("init", "random copies no target layer: leave target_layers out")
        return v


DraftDepth = Count(1, MAX_DRAFT_LAYERS, "layers a draft model may have")


class HFConfigMeta(DrafterMeta, LayerRules):
    """The HF config fields that make a draft model of the target's family (others, such as
    token ids, come from the target's config)."""

    model_type: Annotated[StrictStr, TargetValue("model_type", "model type")]
    vocab_size: TargetVocabSize
    hidden_size: LayerWidth
    intermediate_size: LayerWidth
    num_hidden_layers: DraftDepth
    num_attention_heads: HeadCount
    num_key_value_heads: HeadCount
    head_dim: LayerWidth
    hidden_act: StrictStr = "silu"
    rms_norm_eps: PositiveFloat
    max_position_embeddings: PositionCount
    rope_parameters: dict[str, Any]
    tie_word_embeddings: StrictBool
    attention_bias: StrictBool | None = None  # families with the option (Llama, Qwen3); Qwen2 always has q/k/v biases
    mlp_bias: StrictBool | None = None  # Llama

    @field_validator("rope_parameters")
    @classmethod
    def _rope(cls, v):
        return check_rope(v)


TargetLayer = Count(0, lambda t: t.num_layers - 1, "the target's decoder layers")


class DraftLMMeta(DrafterMeta):
    config: HFConfigMeta
    # how the weights began: copies of the target's layers, HF's random init, or an imported model
    init: Literal["target", "random", "import"]
    num_target_layers: TargetNumLayers
    target_layers: list[TargetLayer] = []  # init target: the target layer copied into each draft layer

    @field_validator("target_layers")
    @classmethod
    def _mapping(cls, v, info: ValidationInfo):
        init, config = info.data.get("init"), info.data.get("config")
        if init is None or config is None:  # already refused
            return v
        if init != "target":
            if v:
                raise PydanticCustomError("meta_list", "is not empty, but init {init} copies no target layer", {"init": init})
            return v
        if len(v) != config.num_hidden_layers:
            raise PydanticCustomError("meta_list", "names {n} target layers for {m} draft layers",
                                      {"n": len(v), "m": config.num_hidden_layers})
        seen = set()
        for i in v:
            if i in seen:
                raise PydanticCustomError("meta_list", "repeats {v}", {"v": i})
            seen.add(i)
        hidden = (info.context or {})["target"].hidden_size
        if config.hidden_size != hidden:
            raise PydanticCustomError("meta_target", "are copies of target layers, but config.hidden_size {h} is not the target's {t}",
                                      {"h": config.hidden_size, "t": hidden})
        return v


def spread_layers(n: int, num_target_layers: int) -> list[int]:
    """``n`` distinct target layers, evenly spread over 0..L-1 with the first and the last
    (``n`` = 1: the first)."""
    L = num_target_layers
    if n == 1:
        return [0]
    # floor(x + 0.5), not round(): banker's rounding could map two neighbours to one layer
    return [math.floor(i * (L - 1) / (n - 1) + 0.5) for i in range(n)]


def config_fields(cfg) -> dict:
    """The meta's ``config`` section from an HF config object (any family draftlab supports)."""
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    rope = getattr(cfg, "rope_parameters", None) or {
        "rope_theta": getattr(cfg, "rope_theta", 10000.0), "rope_type": "default", **(getattr(cfg, "rope_scaling", None) or {}),
    }
    out = {
        "model_type": cfg.model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
        "head_dim": head_dim,
        "hidden_act": getattr(cfg, "hidden_act", "silu"),
        "rms_norm_eps": float(cfg.rms_norm_eps),
        "max_position_embeddings": cfg.max_position_embeddings,
        "rope_parameters": dict(rope),
        "tie_word_embeddings": bool(getattr(cfg, "tie_word_embeddings", False)),
    }
    for name in ("attention_bias", "mlp_bias"):
        if isinstance(getattr(cfg, name, None), bool):
            out[name] = getattr(cfg, name)
    return out


def build_hf_config(fields: dict, target):
    """An HF config of the target's class: the target's own config (token ids, family options)
    with the meta's ``config`` fields in place of its sizes."""
    base = target.config.to_dict()
    for k in ("layer_types", "quantization_config", "auto_map", "_name_or_path"):  # rebuilt for the new depth, or not ours
        base.pop(k, None)
    base.update({k: v for k, v in fields.items() if v is not None})
    return type(target.config).from_dict(base)


@DRAFTERS.register()
class DraftLM(Drafter):
    algorithm = "draft_lm"
    Config = DraftLMConfig
    Loss = DraftLMLoss
    Meta = DraftLMMeta
    derived_keys = ("lm.model.rotary_emb.",)  # RoPE tables, rebuilt from the config

    def __init__(self, hf_config, init: str, target_layers: list[int], num_target_layers: int):
        super().__init__()
        from transformers import AutoModelForCausalLM

        self.lm = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32, attn_implementation="sdpa")
        self.init, self.target_layers, self.num_target_layers = init, list(target_layers), num_target_layers
        self._sampler = None  # on-policy sampling's copy of self.lm (sample), made on first use
        # Tied embeddings are one tensor: the checkpoint holds it once, under the embedding's name
        # (safetensors refuses shared storage); loading puts it back under both.
        if self.tied:
            self.register_state_dict_post_hook(_drop_tied_head)
            self.register_load_state_dict_pre_hook(_restore_tied_head)

    @property
    def tied(self) -> bool:
        return self.lm.lm_head.weight is self.lm.model.embed_tokens.weight

    # ---- construction -------------------------------------------------------------
    @classmethod
    def default_capture_layers(cls, num_target_layers: int) -> list[int]:
        return [num_target_layers]

    @classmethod
    def config_meta(cls, cfg: DraftLMConfig, target, samples=None) -> dict:
        L = target.num_layers
        fields = config_fields(target.config)
        widths = {w: getattr(cfg, w) for w in WIDTHS if getattr(cfg, w) is not None}
        if ("hidden_size" in widths or "num_attention_heads" in widths) and "head_dim" not in widths:
            hidden, heads = widths.get("hidden_size", fields["hidden_size"]), widths.get("num_attention_heads", fields["num_attention_heads"])
            widths["head_dim"] = hidden // heads
        fields.update(widths, num_hidden_layers=cfg.num_layers)
        layers = []
        if cfg.init == "target":
            if cfg.num_layers > L:
                raise DraftlabError(
                    f"drafter.num_layers = {cfg.num_layers} is more than the target's {L} layers (init target copies one into each)"
                )
            layers = cfg.target_layers if cfg.target_layers is not None else spread_layers(cfg.num_layers, L)
        return {"config": fields, "init": cfg.init, "num_target_layers": L, "target_layers": layers}

    def init_weights(self, cfg: DraftLMConfig, target, samples=None) -> None:
        if self.init != "target":
            return  # HF's own initialisation, from from_config
        with torch.no_grad():
            model = self.lm.model
            model.embed_tokens.weight.copy_(target.embed_tokens.weight)
            model.norm.load_state_dict(target.final_norm.state_dict())
            if not self.tied:
                self.lm.lm_head.weight.copy_(target.lm_head.weight)
            for j, i in enumerate(self.target_layers):
                model.layers[j].load_state_dict(target.decoder_layer_state(i))

    @classmethod
    def from_meta(cls, meta: dict, target) -> "DraftLM":
        return cls(build_hf_config(meta["config"], target), meta["init"], meta["target_layers"], meta["num_target_layers"]).attach(target)

    def meta(self) -> dict:
        return {
            "config": config_fields(self.lm.config),
            "init": self.init,
            "num_target_layers": self.num_target_layers,
            "target_layers": list(self.target_layers),
        }

    def hf_config(self) -> dict:
        """What an HF ``config.json`` of this draft model holds, naming its architecture."""
        cfg = self.lm.config.to_dict()
        cfg["architectures"] = [type(self.lm).__name__]
        cfg.pop("_name_or_path", None)
        return cfg

    # ---- what it reads from the target --------------------------------------------
    @property
    def capture_layers(self) -> list[int]:
        return [self.num_target_layers]

    # ---- training -------------------------------------------------------------------------
    def training_loss(self, batch, hidden, cfg: DraftLMLoss):
        ids = batch["input_ids"]
        # position t predicts x_{t+1} (the target's logits at t do too); it counts when x_{t+1} is an assistant token
        counted = shift_left(batch["loss_mask"].bool(), 1, fill=False)
        # right padding + causal attention: real tokens never see padding, so no mask is needed
        h = self.lm.model(input_ids=ids, use_cache=False).last_hidden_state
        teacher = hidden[self.num_target_layers][counted]
        loss, metrics = distill_loss(h[counted], self.lm.lm_head.weight, teacher, self._target_lm_head.weight,
                                     shift_left(ids, 1)[counted], cfg)
        return loss, {"acc": [metrics["acc"]], "accept": metrics["accept"]}

    # ---- on-policy data (DistillSpec) -------------------------------------------------------
    @classmethod
    def rewrites_batches(cls, loss_cfg: DraftLMLoss) -> str | None:
        return "loss.on_policy" if loss_cfg.on_policy else None

    @torch.no_grad()
    def rewrite_batch(self, batch: dict, cfg: DraftLMLoss, seed: int) -> dict:
        """Each row with an answer is picked with probability ``cfg.on_policy``; a picked row keeps
        its prompt (the tokens before its first counted token) and gets, in place of its answer,
        a continuation the draft samples (temperature 1) up to the row's own length or an
        end-of-sequence token. The target then scores those tokens as it scores the data's."""
        ids, counted, live = batch["input_ids"], batch["loss_mask"].bool(), batch["attention_mask"].bool()
        gen = torch.Generator(device=ids.device).manual_seed(seed)
        first = counted.int().argmax(1)  # the first answer token (0 when a row has none)
        picked = (torch.rand(ids.shape[0], generator=gen, device=ids.device) < cfg.on_policy) & (first > 0)
        rows = picked.nonzero().flatten().tolist()
        if not rows:
            return batch
        starts = [int(first[b]) for b in rows]
        budgets = [int(live[b].sum()) - s for b, s in zip(rows, starts)]
        answers = self.sample([ids[b, :s] for b, s in zip(rows, starts)], budgets, gen)
        out = {k: v.clone() for k, v in batch.items()}
        for b, s, a in zip(rows, starts, answers):
            n = s + a.numel()
            out["input_ids"][b, s:n], out["input_ids"][b, n:] = a, 0  # padding: seen by nothing (right-padded, causal)
            out["loss_mask"][b], out["attention_mask"][b] = False, 0
            out["loss_mask"][b, s:n], out["attention_mask"][b, :n] = True, 1
        return out

    def sample(self, prompts: list[torch.Tensor], budgets: list[int], gen: torch.Generator) -> list[torch.Tensor]:
        """Continue each prompt by sampling the draft at temperature 1, for its budget of tokens
        or through its first end-of-sequence token. Runs a copy of the draft as a
        :class:`~draftlab.models.target.Target` (fused linears, a ragged KV cache; several times
        faster per token than HF's forward), its weights refreshed from the trained ones."""
        from draftlab.models.target import Target

        if self._sampler is None:
            self._sampler = Target(copy.deepcopy(self.lm), None, {"name": self.algorithm})
        lm = self._sampler
        lm.reload(self.lm.state_dict())
        eos = self.lm.config.eos_token_id
        dev = prompts[0].device
        stops = torch.tensor(eos if isinstance(eos, list) else [] if eos is None else [eos], device=dev)
        cache = lm.new_cache(len(prompts), max(p.numel() for p in prompts) + max(budgets) + 1, ragged=True)
        last = []
        for r, p in enumerate(prompts):  # each prompt alone into its cache row: no padding
            last.append(lm(p[None], cache=cache.row(r), logits="last").logits[0, -1])
            cache.lengths[r] = p.numel()
        logits = torch.stack(last)
        budget = torch.tensor(budgets, device=dev)
        done, tokens = budget <= 0, []
        for _ in range(max(budgets)):
            nxt = torch.multinomial(logits.float().softmax(-1), 1, generator=gen)[:, 0]
            tokens.append(torch.where(done, -1, nxt))
            done = done | torch.isin(nxt, stops) | (len(tokens) >= budget)
            if bool(done.all()):
                break
            logits = lm(nxt[:, None], cache=cache, logits="last").logits[:, -1]
        drawn = torch.stack(tokens, 1)
        return [row[row >= 0] for row in drawn]

def _drop_tied_head(module, state_dict, prefix, local_metadata):
    state_dict.pop(prefix + "lm.lm_head.weight", None)


def _restore_tied_head(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
    embed = state_dict.get(prefix + "lm.model.embed_tokens.weight")
    if embed is not None:
        state_dict.setdefault(prefix + "lm.lm_head.weight", embed)
