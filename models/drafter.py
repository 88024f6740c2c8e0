"""The drafter contract: what the shared trainer, checkpoint reader and exporter ask of a family.

A drafter family is a ``Drafter`` subclass registered by name (``@DRAFTERS.register()``, under
its ``algorithm``) in its own module, plus what it registers elsewhere in its own files: a
proposer for the decoder (``inference.proposer.PROPOSERS``, same name, which also declares the
decoding shapes the family supports), export and import formats (``export.formats``) and a thin
``train/<family>.py`` entry point. Nothing shared names a family.

A family declares its checkpoint metadata (what ``meta()`` writes and ``from_meta`` reads) as a
schema, ``Meta``: strict types (an integer is an integer, not a bool, a float or a string) and
bounds from the types below, several relative to the target (:class:`TargetFacts`, given to the
validators as pydantic validation context). :meth:`Drafter.check_meta` applies it, and
``draftlab.checkpoint.check_drafter`` applies it, with :meth:`Drafter.check_state` for the
tensor-valued metadata in the weights (vocabulary maps), on every path: build, the checkpoint
writer, load (eval, generate, resume), import and export. A checkpoint that passes builds a
drafter that decodes.

Shapes below: B batch rows, T positions, H the target's hidden size, V the target's vocabulary.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Annotated, Any, Callable, ClassVar

import torch
import torch.nn as nn
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError, core_schema

from draftlab.errors import DraftlabError
from draftlab.models.layers import LayerShape
from draftlab.registry import Registry

DRAFTERS: Registry[type["Drafter"]] = Registry("drafter family", key="algorithm")


# ============================================================================ metadata schemas


@dataclass(frozen=True)
class TargetFacts:
    """The target facts a drafter's metadata is checked against."""

    num_layers: int
    hidden_size: int
    vocab_size: int
    model_type: str = ""

    @classmethod
    def of(cls, target) -> "TargetFacts":
        """From a ``models.target.Target`` (anything with ``num_layers``, ``hidden_size`` and
        ``vocab_size``), a ``TargetFacts``, or a target identity as checkpoints store it."""
        if isinstance(target, TargetFacts):
            return target
        if isinstance(target, dict):
            for k in ("num_hidden_layers", "hidden_size", "vocab_size"):
                if type(target.get(k)) is not int or target[k] < 1:
                    raise DraftlabError(f"target identity: {k} is missing or not a positive integer ({target.get(k)!r})")
            return cls(target["num_hidden_layers"], target["hidden_size"], target["vocab_size"], str(target.get("model_type", "")))
        model_type = getattr(getattr(target, "config", None), "model_type", "")
        return cls(target.num_layers, target.hidden_size, target.vocab_size, model_type)


def _facts(info: ValidationInfo) -> TargetFacts:
    target = (info.context or {}).get("target")
    if not isinstance(target, TargetFacts):  # a programming error: validate through Drafter.check_meta
        raise RuntimeError("drafter metadata validated without the target's facts (use Drafter.check_meta)")
    return target


Bound = int | Callable[[TargetFacts], int]


class _Check:
    """Annotated metadata that validates the (already type-checked) value with the target's facts."""

    def __get_pydantic_core_schema__(self, source, handler):
        return core_schema.with_info_after_validator_function(lambda v, info: self.check(v, _facts(info)), handler(source))

    def check(self, value, facts: TargetFacts):
        raise NotImplementedError


class Range(_Check):
    """An integer in ``lo..hi`` (inclusive); either bound may be a function of the target's facts.
    ``what`` says what the range is, in the error."""

    def __init__(self, lo: Bound, hi: Bound, what: str):
        self.lo, self.hi, self.what = lo, hi, what

    def bounds(self, facts: TargetFacts) -> tuple[int, int]:
        return tuple(b(facts) if callable(b) else b for b in (self.lo, self.hi))

    def check(self, value, facts):
        lo, hi = self.bounds(facts)
        if not lo <= value <= hi:
            raise PydanticCustomError("meta_range", "is outside {lo}..{hi} ({what})", {"lo": lo, "hi": hi, "what": self.what})
        return value


class TargetValue(_Check):
    """Equal to the target's ``fact`` (a :class:`TargetFacts` field); ``what`` names it."""

    def __init__(self, fact: str, what: str):
        self.fact, self.what = fact, what

    def expected(self, facts: TargetFacts):
        return getattr(facts, self.fact)

    def check(self, value, facts):
        want = self.expected(facts)
        if value != want:
            raise PydanticCustomError("meta_target", "is not the target's {what} {want}", {"what": self.what, "want": want})
        return value


class Distinct(_Check):
    """A non-empty list of distinct values, in ascending order if ``ascending``."""

    def __init__(self, ascending: bool = False):
        self.ascending = ascending

    def check(self, value, facts):
        if not value:
            raise PydanticCustomError("meta_list", "is empty", {})
        if self.ascending and any(a >= b for a, b in zip(value, value[1:])):
            raise PydanticCustomError("meta_list", "is not in distinct ascending order", {})
        seen = set()
        for v in value:
            if v in seen:
                raise PydanticCustomError("meta_list", "repeats {v}", {"v": v})
            seen.add(v)
        return value


# the bounds a size may reach: beyond them a meta is corrupt, not a drafter (say so in the error)
MAX_HEADS = 64
MAX_BLOCK_SIZE = 1024
MAX_POSITIONS = 1 << 24
WIDTH_FACTOR = 16  # a drafter layer's widths (MLP, attention) are at most this many times the target's hidden size

HiddenStateIndex = Annotated[StrictInt, Range(0, lambda t: t.num_layers, "the target's hidden-state indices")]
DecoderInputIndex = Annotated[StrictInt, Range(1, lambda t: t.num_layers - 1, "inputs of the target's decoder layers")]
TokenId = Annotated[StrictInt, Range(0, lambda t: t.vocab_size - 1, "the target vocabulary")]
DraftVocabSize = Annotated[StrictInt, Range(1, lambda t: t.vocab_size, "at most the target vocabulary")]
DrafterDepth = Annotated[StrictInt, Range(1, lambda t: t.num_layers, "at most the target's layers")]
TargetVocabSize = Annotated[StrictInt, TargetValue("vocab_size", "vocabulary size")]
TargetHiddenSize = Annotated[StrictInt, TargetValue("hidden_size", "hidden size")]
TargetNumLayers = Annotated[StrictInt, TargetValue("num_layers", "number of layers")]
PositiveFloat = Annotated[StrictFloat, Field(gt=0, allow_inf_nan=False)]


def Count(lo: Bound, hi: Bound, what: str):  # noqa: N802 - a type
    """An integer count in ``lo..hi``."""
    return Annotated[StrictInt, Range(lo, hi, what)]


HeadCount = Count(1, lambda t: t.hidden_size, "at most the target's hidden size")
LayerWidth = Count(1, lambda t: WIDTH_FACTOR * t.hidden_size, f"at most {WIDTH_FACTOR} times the target's hidden size")
PositionCount = Count(1, MAX_POSITIONS, "positions a RoPE table covers")


class DrafterMeta(BaseModel):
    """Base of every family's ``Meta``: unknown fields are refused, types are strict."""

    model_config = ConfigDict(extra="forbid", strict=True)


class LayerRules(BaseModel):
    """What a decoder layer's metadata must hold for draftlab's layers to run it, shared by the
    schemas that describe one (:class:`ShapeMeta`, a draft LM's HF config)."""

    @field_validator("hidden_act", check_fields=False)
    @classmethod
    def _silu(cls, v):
        if v != "silu":
            raise PydanticCustomError("meta_choice", "is not silu (the only activation of draftlab's layers)", {})
        return v

    @field_validator("num_key_value_heads", check_fields=False)
    @classmethod
    def _groups(cls, v, info: ValidationInfo):
        heads = info.data.get("num_attention_heads")
        if heads is not None and heads % v:
            raise PydanticCustomError("meta_range", "does not divide num_attention_heads {heads}", {"heads": heads})
        return v

    @field_validator("head_dim", check_fields=False)
    @classmethod
    def _even(cls, v):
        if v % 2:
            raise PydanticCustomError("meta_range", "is odd (RoPE rotates pairs of channels)", {})
        return v


class ShapeMeta(LayerShape, LayerRules):
    """A drafter's decoder-layer shape (``models.layers.LayerShape``) as metadata: strict, the
    target's hidden size, widths bounded by it, a head layout the attention can run."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model_type: StrictStr
    hidden_size: TargetHiddenSize
    intermediate_size: LayerWidth
    num_attention_heads: HeadCount
    num_key_value_heads: HeadCount
    head_dim: LayerWidth
    rms_norm_eps: PositiveFloat
    hidden_act: StrictStr = "silu"
    attention_bias: StrictBool = False
    qk_norm: StrictBool = False
    max_position_embeddings: PositionCount
    rope: dict[str, Any]

    @field_validator("model_type")
    @classmethod
    def _family(cls, v):
        from draftlab.models.target import SUPPORTED_MODEL_TYPES

        if v not in SUPPORTED_MODEL_TYPES:
            raise PydanticCustomError("meta_choice", "is not a supported layer family ({families})", {"families": ", ".join(SUPPORTED_MODEL_TYPES)})
        return v

    @field_validator("rope")
    @classmethod
    def _finite_rope(cls, v):
        return check_rope(v)


def check_rope(v: dict) -> dict:
    """RoPE settings as metadata: the rotary table is computed from these numbers, and one that is
    not finite (JSON readers take NaN and Infinity) or a theta that is not positive makes every
    position's rotation NaN."""
    for key, x in v.items():
        for n in x if isinstance(x, list) else [x]:
            if isinstance(n, float) and not math.isfinite(n):
                raise PydanticCustomError("meta_range", "has {key} {n}, not a finite number", {"key": key, "n": n})
    theta = v.get("rope_theta", 1.0)
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        raise PydanticCustomError("meta_range", "has rope_theta {theta}, not a positive number", {"theta": _show(theta)})
    return v


# rendering of pydantic's error types as the end of "drafter.<field> = <value> ..."
_TYPE_ERRORS = {
    "int_type": "is not an integer", "int_parsing": "is not an integer", "int_from_float": "is not an integer",
    "bool_type": "is not true or false", "bool_parsing": "is not true or false",
    "float_type": "is not a number", "float_parsing": "is not a number", "finite_number": "is not a finite number",
    "string_type": "is not a string", "list_type": "is not a list",
    "dict_type": "is not an object", "model_type": "is not an object", "model_attributes_type": "is not an object",
}


def _show(value) -> str:
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def meta_error(e: ValidationError, where: str, algorithm: str, prefix: tuple = ()) -> DraftlabError:
    """One line for the first error of a metadata validation: ``<where>: drafter.<field> =
    <value> <what is wrong>`` (``prefix``: the location of what was validated, for a part)."""
    err = e.errors(include_url=False)[0]
    loc = prefix + tuple(err["loc"])
    path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc)
    at = f"{where}: " if where else ""
    kind = err["type"]
    if kind == "missing":
        return DraftlabError(f"{at}drafter meta lacks '{path[1:]}'")
    if kind == "extra_forbidden":
        return DraftlabError(f"{at}drafter{path} is not a field of {algorithm} drafter meta")
    if kind in _TYPE_ERRORS:
        text = _TYPE_ERRORS[kind]
    elif kind.startswith("meta_"):
        text = err["msg"]
    else:  # pydantic's own: "Input should be greater than 0", "Value error, ..."
        msg = err["msg"].removeprefix("Value error, ").removeprefix("Input ")
        text = msg[:1].lower() + msg[1:]
    return DraftlabError(f"{at}drafter{path} = {_show(err['input'])} {text}")


def check_vocab_maps(state: dict, names: tuple[str, str], vocab_size: int, draft_vocab_size, where: str = "") -> None:
    """The draft vocabulary maps of ``state`` (``data/vocab.py``): ``d2t`` [V_draft] offsets
    whose target ids ``i + d2t[i]`` lie in the target vocabulary, strictly ascending (draft ids
    are the kept target ids in order), and ``t2d`` Bool[V] true exactly at those ids. A map
    absent from ``state`` is not checked here (the weights check names missing tensors)."""
    at = f"{where}: " if where else ""
    d2t_name, t2d_name = names
    d2t, t2d = state.get(d2t_name), state.get(t2d_name)
    V = vocab_size
    ids = None
    if d2t is not None:
        if d2t.dim() != 1 or d2t.is_floating_point() or d2t.dtype == torch.bool:
            raise DraftlabError(f"{at}{d2t_name} is a {d2t.dtype} tensor of shape {tuple(d2t.shape)}, not a vector of integer offsets")
        if draft_vocab_size is not None and d2t.numel() != draft_vocab_size:
            raise DraftlabError(f"{at}{d2t_name} has {d2t.numel()} entries, not draft_vocab_size {draft_vocab_size}")
        offsets = d2t.detach().cpu().long()
        ids = torch.arange(offsets.numel()) + offsets
        outside = ((ids < 0) | (ids >= V)).nonzero().flatten()
        if outside.numel():
            i = int(outside[0])
            raise DraftlabError(
                f"{at}{d2t_name}[{i}] = {int(offsets[i])} maps draft id {i} to target id {int(ids[i])}, outside the target vocabulary 0..{V - 1}"
            )
        down = (ids[1:] <= ids[:-1]).nonzero().flatten()
        if down.numel():
            i = int(down[0]) + 1
            raise DraftlabError(
                f"{at}{d2t_name}[{i}] = {int(offsets[i])} maps draft id {i} to target id {int(ids[i])}, not above draft id {i - 1}'s "
                f"{int(ids[i - 1])} (draft ids are the kept target ids in ascending order)"
            )
    if t2d is not None:
        if tuple(t2d.shape) != (V,):
            raise DraftlabError(f"{at}{t2d_name} has shape {tuple(t2d.shape)}, not ({V},) (the target vocabulary)")
        if ids is not None:
            want = torch.zeros(V, dtype=torch.bool)
            want[ids] = True
            diff = (t2d.detach().cpu().bool() != want).nonzero().flatten()
            if diff.numel():
                j = int(diff[0])
                raise DraftlabError(
                    f"{at}{t2d_name}[{j}] = {str(bool(t2d[j])).lower()} disagrees with {d2t_name}: target id {j} is "
                    f"{'' if want[j] else 'not '}in the draft vocabulary"
                )


class Drafter(nn.Module):
    algorithm: ClassVar[str]  # registry name; the recipe's ``algorithm`` and the checkpoint's
    Config: ClassVar[type[BaseModel]]  # architecture knobs (recipe section ``drafter:``)
    Loss: ClassVar[type[BaseModel]]  # objective knobs (recipe section ``loss:``)
    # The metadata ``meta()`` writes, as a schema (a ``DrafterMeta``): its field types say what
    # each value may be, several relative to the target (``TargetFacts`` in the validation context).
    Meta: ClassVar[type[DrafterMeta]]
    # Names of the draft-vocabulary maps (d2t, t2d) among the weights, checked by ``check_state``.
    vocab_maps: ClassVar[tuple[str, str] | None] = None
    # State-dict key prefixes the checkpoint may lack because construction derives them
    # (RoPE tables, say); any other missing key is an error.
    derived_keys: ClassVar[tuple[str, ...]] = ()

    # whether the family reads the target's frozen embedding besides its lm_head (:meth:`attach`)
    shares_embedding: ClassVar[bool] = False
    # False for a family with no weights to train (a search over the target's own layers): a
    # recipe of it runs the trainer variant registered under its algorithm in train/
    # (draftlab.train.variants.TRAINERS) instead of the shared gradient loop
    trains_weights: ClassVar[bool] = True

    # ---- the draft vocabulary (data/vocab.py) of families whose ``vocab_maps`` are d2t, t2d ----
    def add_vocab_maps(self, vocab_size: int, draft_vocab_size: int) -> None:
        """Register ``d2t`` [V_draft] (draft id i is target id i + d2t[i]) and ``t2d`` Bool[V]
        (the target ids kept), filled at build by :meth:`fill_vocab_maps` or by a checkpoint."""
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(vocab_size, dtype=torch.bool))

    @torch.no_grad()
    def fill_vocab_maps(self, samples: list[dict] | None) -> None:
        """The draft vocabulary of the training ``samples`` (their most frequent target ids)."""
        from draftlab.data.vocab import draft_vocab

        d2t, t2d = draft_vocab(samples, self.t2d.numel(), self.d2t.numel())
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def draft_rows(self, weight: torch.Tensor) -> torch.Tensor:
        """The draft vocabulary's rows of a target-vocabulary ``weight`` [V, ...] (the target's
        lm_head, to start a read-out from), in draft-id order, fp32."""
        return weight[self.t2d.to(weight.device)].float()

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def target_draft_probs(self, final_hidden: torch.Tensor) -> torch.Tensor:
        """The target's probabilities over the draft vocabulary [N, V_draft] for its final hidden
        states [N, H] (a softmax over the kept rows only when the vocabulary is reduced)."""
        reduced = self.d2t.numel() < self.t2d.numel()
        return self._target_lm_head.probs(final_hidden, self.t2d if reduced else None)

    def next_token_targets(self, hidden, batch) -> dict[str, torch.Tensor]:
        """:meth:`derived_targets` of the families that imitate the target's next token from its
        last layer: ``target_argmax`` [B, T], its full-vocab greedy token at every position s whose
        next token counts (``loss_mask[s + 1]``; -1 elsewhere). A full-vocab lm_head pass (6x one
        over an 8,192-token draft vocabulary for SmolLM2), the same every epoch: cached."""
        from draftlab.losses.eagle import shift_left

        need = shift_left(batch["loss_mask"].bool(), 1, fill=False)
        return {"target_argmax": self._target_lm_head.greedy(hidden[self.num_target_layers], need)}

    def to_draft_ids(self, target_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocab ids of target ids; -1 for tokens outside the draft vocabulary (and for -1)."""
        draft = self.t2d.long().cumsum(0) - 1
        safe = target_ids.clamp_min(0)
        return torch.where((target_ids >= 0) & self.t2d[safe], draft[safe], -1)

    def attach(self, target) -> "Drafter":
        """Share the target's frozen lm_head (and embedding, if ``shares_embedding``) by reference,
        not as registered submodules, so they are neither trained, wrapped by DDP/FSDP nor
        checkpointed; move to the target's device."""
        if self.shares_embedding:
            object.__setattr__(self, "_embed", target.embed_tokens)
        object.__setattr__(self, "_target_lm_head", target.shared_lm_head)
        return self.to(device=target.device)

    # ---- metadata ------------------------------------------------------------------------
    @classmethod
    def check_meta(cls, meta, target, where: str = "") -> dict:
        """``meta`` validated by ``Meta`` against ``target`` (a ``Target``, ``TargetFacts`` or
        target identity): the dict ``from_meta`` takes, defaults filled in. Anything else is a
        one-line DraftlabError ``<where>: drafter.<field> = <value> <what is wrong>``."""
        try:
            valid = cls.Meta.model_validate(meta, strict=True, context={"target": TargetFacts.of(target)})
        except ValidationError as e:
            raise meta_error(e, where, cls.algorithm) from None
        return valid.model_dump()

    @classmethod
    def check_fields(cls, values: dict, target, where: str = "") -> dict:
        """Some of ``Meta``'s fields, each by its own type (a reader checks the sizes it loops
        over before the whole meta exists); the same errors as :meth:`check_meta`."""
        from pydantic import TypeAdapter

        context = {"target": TargetFacts.of(target)}
        out = {}
        for name, value in values.items():
            field = cls.Meta.model_fields[name]
            kind = Annotated[(field.annotation, *field.metadata)] if field.metadata else field.annotation
            try:
                out[name] = TypeAdapter(kind).validate_python(value, strict=True, context=context)
            except ValidationError as e:
                raise meta_error(e, where, cls.algorithm, (name,)) from None
        return out

    @classmethod
    def check_state(cls, meta: dict, state: dict[str, torch.Tensor], target, where: str = "") -> None:
        """Range-check the tensor-valued metadata among the weights ``state`` for the validated
        ``meta``: by default the draft-vocabulary maps named by ``vocab_maps``. A family with
        other index tensors overrides this (and calls it)."""
        if cls.vocab_maps:
            check_vocab_maps(state, cls.vocab_maps, TargetFacts.of(target).vocab_size, meta.get("draft_vocab_size"), where)

    # ---- construction ---------------------------------------------------------------
    @classmethod
    def default_capture_layers(cls, num_target_layers: int) -> list[int]:
        """The target hidden-state indices (convention of ``models/target.py``) a drafter of
        this family reads by default: what ``draftlab capture --layers <algorithm>`` stores."""
        raise NotImplementedError

    @classmethod
    def build(cls, cfg: BaseModel, target, samples: list[dict] | None = None) -> "Drafter":
        """A fresh drafter for ``target`` (a ``models.target.Target``), from its validated
        ``Config``. ``samples`` are the training samples (dicts with ``input_ids`` and
        ``loss_mask``, Long/Bool [T]): what a family measures before training (token counts
        for a reduced vocabulary, feature scales). The result shares the target's frozen
        weights by reference, never as registered parameters.

        The default: the meta this config describes (:meth:`config_meta`), checked by
        :meth:`check_meta` before anything is allocated (an error names the recipe field,
        ``drafter.<field>``), then ``from_meta`` and :meth:`init_weights`."""
        meta = cls.check_meta(cls.config_meta(cfg, target, samples), target)
        drafter = cls.from_meta(meta, target)
        drafter.init_weights(cfg, target, samples)
        return drafter

    @classmethod
    def config_meta(cls, cfg: BaseModel, target, samples: list[dict] | None) -> dict:
        """The ``meta()`` of the drafter :meth:`build` makes from ``cfg`` for ``target``."""
        raise NotImplementedError

    def init_weights(self, cfg: BaseModel, target, samples: list[dict] | None) -> None:
        """Initialise a drafter ``from_meta`` just made for a fresh start (copies of the
        target's weights, measured buffers). Default: as constructed."""

    @classmethod
    def from_meta(cls, meta: dict, target) -> "Drafter":
        """Rebuild (weights uninitialised) from ``meta()``'s JSON as :meth:`check_meta` returns
        it, next to ``target``."""
        raise NotImplementedError

    def meta(self) -> dict:
        """JSON-serialisable: everything ``from_meta`` needs to rebuild this drafter; valid for
        ``Meta``."""
        raise NotImplementedError

    @classmethod
    def check_configs(cls, cfg: BaseModel, loss_cfg: BaseModel) -> None:
        """Refuse (a one-line DraftlabError naming the fields) a validated ``Config`` and ``Loss``
        that are each valid but not together (a loss that never trains part of the drafter).
        The recipe calls it when it is read. Default: any pair."""

    @classmethod
    def trained_depth(cls, loss: dict) -> int | None:
        """How many chained draft positions this family's objective trains, given the ``loss``
        section of the recipe a checkpoint was trained with (a dict, possibly empty); None: every
        position it drafts, or no bound known. The adaptive draft length drafts no further
        (``inference/batch_eval.py``). Default: None."""
        return None

    # ---- what it reads from the target ------------------------------------------------
    @property
    def capture_layers(self) -> list[int]:
        """Target hidden-state indices ``training_loss`` and the proposer read (ascending)."""
        raise NotImplementedError

    def derived_targets(self, hidden: dict[int, torch.Tensor], batch: dict) -> dict[str, torch.Tensor]:
        """Per-position tensors [B, T, ...] computed from the capture that are the same in every
        epoch (e.g. the target's full-vocab argmax). ``hidden`` maps each of ``capture_layers``
        to [B, T, H]; ``batch`` holds ``input_ids``, ``loss_mask`` and ``attention_mask``
        [B, T]. The feature source adds them to the batch and, with ``capture.mode: memory``,
        caches them beside the hidden states. Values at padded positions are unspecified.
        Default: none."""
        return {}

    # ---- training ------------------------------------------------------------------------
    @classmethod
    def rewrites_batches(cls, loss_cfg: BaseModel) -> str | None:
        """The recipe field (e.g. ``loss.on_policy``) that makes :meth:`rewrite_batch` replace
        the data's sequences, or None (the default: it never does). Such a run takes the
        target's features online: features kept from the data's tokens would not fit."""
        return None

    def rewrite_batch(self, batch: dict, loss_cfg: BaseModel, seed: int) -> dict:
        """The micro-batch to train on instead of ``batch`` (``input_ids``, ``loss_mask``,
        ``attention_mask`` [B, T], right-padded), before the target's features are taken: e.g.
        sequences the drafter generates itself (on-policy distillation). ``seed`` is fixed by
        the step and micro-batch, so a resumed run trains on what an uninterrupted one would.
        Called only when :meth:`rewrites_batches` names a field."""
        return batch

    def set_progress(self, step: int, total_steps: int) -> None:
        """The trainer's position, before each optimizer step's forwards: ``step`` steps done of
        ``total_steps``. An objective that follows a schedule over training (Domino's
        base-anchored curriculum) reads it here; the step is restored on resume, so such a
        schedule resumes with it. Default: nothing."""

    def forward(self, batch: dict, hidden: dict[int, torch.Tensor], loss_cfg: BaseModel):
        # DDP/FSDP synchronise through forward(), so training goes through it.
        return self.training_loss(batch, hidden, loss_cfg)

    def training_loss(self, batch: dict, hidden: dict[int, torch.Tensor], loss_cfg: BaseModel):
        """-> (loss scalar tensor, metrics). ``batch``: ``input_ids``, ``loss_mask``,
        ``attention_mask`` [B, T] (right-padded) plus the ``derived_targets``; ``hidden``: as
        in ``derived_targets``; ``loss_cfg``: the validated ``Loss``. Metrics are floats or
        lists of floats (per position or head); an ``acc`` list is shown in the progress bar."""
        raise NotImplementedError

    # ---- export --------------------------------------------------------------------------
    def export_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights in their plain published form: training-only reparametrisations folded
        in (frozen target-owned weights are never part of a drafter)."""
        return {k: v.detach() for k, v in self.state_dict().items()}

    def export_meta(self) -> dict:
        """``meta()`` describing :meth:`export_state_dict`'s form."""
        return self.meta()
