"""Training samples from a recipe's ``data:`` section: load -> split -> (regenerate) -> tokenise.

``build_samples(spec, tokenizer)`` returns a :class:`SampleSet`: tokenised train and held-out
samples (``{"input_ids": LongTensor[T], "loss_mask": BoolTensor[T]}``), the held-out
conversations themselves (for evaluation prompts) and a report of every count on the way.

The held-out split ranks conversations by a keyed hash of ``(seed, content)`` and holds out
the ``heldout`` lowest: deterministic for a seed, independent of the order conversations were
loaded in, and it never looks at indices, so the same conversation always gets the same rank.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from draftlab.data.chat import ChatTemplateError, tokenize_conversation
from draftlab.data.sources import Conversation, conversation_digest, load_conversations, source_kind
from draftlab.errors import DraftlabError

Sample = dict[str, torch.Tensor]  # {"input_ids": LongTensor[T], "loss_mask": BoolTensor[T]}


class DataSpec(BaseModel):
    """The recipe's ``data:`` section."""

    model_config = ConfigDict(extra="forbid")

    source: str = Field("sharegpt", description="'sharegpt', a .json/.jsonl file, or 'hf:<dataset name or dir>'")
    path: str | None = Field(None, description="read the source from this file/dir instead (e.g. another ShareGPT copy)")
    num_conversations: int | None = Field(None, ge=1, description="use at most this many clean conversations (None: all)")
    max_length: int = Field(2048, ge=8, description="truncate tokenised conversations to this many tokens")
    heldout: int = Field(32, ge=0, description="conversations held out for evaluation (taken from the loaded ones)")
    seed: int = 0
    min_loss_tokens: int = Field(1, ge=0, description="skip samples with fewer assistant (loss) tokens")
    hf_split: str = "train"
    hf_column: str | None = Field(None, description="column holding messages/ShareGPT turns (auto: messages|conversations)")
    regenerate: bool = Field(False, description="replace assistant turns with the target's own generations")
    regenerate_max_new_tokens: int = Field(512, ge=1)
    regenerate_temperature: float = Field(0.0, ge=0.0, description="0 = greedy")
    regenerate_batch_size: int = Field(8, ge=1)
    regenerate_max_turns: int | None = Field(
        None, ge=1, description="regenerate at most this many assistant turns; the conversation ends after the last (None: all)")

    @field_validator("source")
    @classmethod
    def _known_source(cls, v: str) -> str:
        try:
            source_kind(v)
        except DraftlabError as e:
            raise ValueError(str(e)) from None
        return v


@dataclass
class SampleSet:
    train: list[Sample]
    heldout: list[Sample]
    heldout_conversations: list[Conversation]
    report: dict = field(default_factory=dict)


def split_heldout(conversations: list[Conversation], heldout: int, seed: int) -> tuple[list[int], list[int]]:
    """``(train_indices, heldout_indices)``, both ascending: the ``heldout`` conversations
    with the lowest ``conversation_digest(conv, salt=seed)`` are held out (ties by index)."""
    if heldout <= 0:
        return list(range(len(conversations))), []
    ranked = sorted(range(len(conversations)), key=lambda i: (conversation_digest(conversations[i], f"split:{seed}"), i))
    held = sorted(ranked[:heldout])
    held_set = set(held)
    return [i for i in range(len(conversations)) if i not in held_set], held


def _tokenize_all(convs: list[Conversation], tokenizer, spec: DataSpec, counts: dict) -> list[Sample]:
    out = []
    for conv in convs:
        try:
            ids, mask = tokenize_conversation(tokenizer, conv, spec.max_length)
        except ChatTemplateError as e:
            counts["template_errors"] += 1
            counts.setdefault("template_error", str(e))
            continue
        n_loss = sum(mask)
        if n_loss < spec.min_loss_tokens:
            counts["too_few_loss_tokens"] += 1
            continue
        if len(ids) == spec.max_length:
            counts["at_max_length"] += 1  # truncated (or exactly max_length long)
        counts["tokens"] += len(ids)
        counts["loss_tokens"] += n_loss
        out.append({"input_ids": torch.tensor(ids, dtype=torch.long), "loss_mask": torch.tensor(mask, dtype=torch.bool)})
    return out


def build_samples(spec: DataSpec, tokenizer, target=None, regenerate_path=None) -> SampleSet:
    """Load, split and tokenise the data a recipe asks for.

    ``target`` is needed only with ``spec.regenerate``; its generations are cached in
    ``regenerate_path`` (default: the draftlab cache, keyed by target, data and settings)."""
    convs, load_report = load_conversations(spec.source, spec.path, spec.num_conversations, spec.hf_split, spec.hf_column)
    if not convs:
        raise DraftlabError(f"data.source '{spec.source}' has no usable conversations: {load_report.summary()}")
    if spec.heldout >= len(convs):
        raise DraftlabError(
            f"data.heldout ({spec.heldout}) must be smaller than the number of usable conversations ({len(convs)})"
        )
    train_idx, held_idx = split_heldout(convs, spec.heldout, spec.seed)
    original = convs
    report: dict = {"load": load_report.to_dict(), "conversations": len(convs)}
    if spec.regenerate:
        if target is None:
            raise DraftlabError("data.regenerate needs the target model (build_samples(..., target=...))")
        from draftlab.data.regenerate import regenerate, regenerate_cache_path

        settings = dict(max_new_tokens=spec.regenerate_max_new_tokens, batch_size=spec.regenerate_batch_size, seed=spec.seed,
                        temperature=spec.regenerate_temperature, max_length=spec.max_length, max_turns=spec.regenerate_max_turns)
        out = regenerate_path or regenerate_cache_path(target, convs, **settings)
        regen = regenerate(target, convs, out, **settings)
        report["regenerated"] = {"path": str(out), "conversations": len(regen)}
        convs = regen
    train_convs = [convs[i] for i in train_idx]
    held_convs = [convs[i] for i in held_idx]
    # evaluation prompts come from the original held-out conversations: their prompt (up to the
    # first assistant turn) is what regeneration keeps, and it may drop a whole over-long one
    held_prompts = [original[i] for i in held_idx]
    parts = {}
    samples = {}
    for name, group in (("train", train_convs), ("heldout", held_convs)):
        counts = {"conversations": len(group), "samples": 0, "tokens": 0, "loss_tokens": 0, "at_max_length": 0,
                  "too_few_loss_tokens": 0, "template_errors": 0}
        samples[name] = _tokenize_all(group, tokenizer, spec, counts)
        counts["samples"] = len(samples[name])
        parts[name] = counts
    report.update(parts)
    if not samples["train"]:
        why = parts["train"].get("template_error") or f"all have fewer than {spec.min_loss_tokens} loss tokens"
        raise DraftlabError(f"data: no usable training samples ({why})")
    report["summary"] = (
        f"{load_report.summary()}; train {parts['train']['samples']} samples / {parts['train']['loss_tokens']} loss tokens, "
        f"held out {parts['heldout']['samples']}"
    )
    return SampleSet(samples["train"], samples["heldout"], held_prompts, report)


def pad_id(tokenizer) -> int:
    """The id ``collate`` pads with: the tokenizer's pad token, else 0 (right padding: never attended)."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0


def collate(samples: list[Sample], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad a batch: ``input_ids`` (pad_id), ``loss_mask`` (False), ``attention_mask`` (0) [B, T]."""
    if not samples:
        raise ValueError("collate needs at least one sample")
    T = max(s["input_ids"].numel() for s in samples)
    B = len(samples)
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)
    loss_mask = torch.zeros((B, T), dtype=torch.bool)
    attention_mask = torch.zeros((B, T), dtype=torch.long)
    for b, s in enumerate(samples):
        n = s["input_ids"].numel()
        input_ids[b, :n] = s["input_ids"]
        loss_mask[b, :n] = s["loss_mask"]
        attention_mask[b, :n] = 1
    return {"input_ids": input_ids, "loss_mask": loss_mask, "attention_mask": attention_mask}


def batches_by_tokens(samples: list[Sample], max_tokens: int, seed: int, epoch: int, pool: int = 256) -> list[list[int]]:
    """Index batches whose padded size ``len(batch) * longest`` stays within ``max_tokens``.

    The samples are shuffled (by ``seed`` and ``epoch``), cut into pools of ``pool``, sorted by
    length inside each pool and packed greedily, so neighbours have similar lengths and padding
    stays small while batches still differ across epochs; the batch order is then shuffled.
    A sample longer than ``max_tokens`` gets a batch of its own. Every index appears exactly once."""
    if max_tokens < 1:
        raise DraftlabError(f"max_tokens must be positive, got {max_tokens}")
    rng = random.Random(f"batches:{seed}:{epoch}")
    order = list(range(len(samples)))
    rng.shuffle(order)
    lengths = [s["input_ids"].numel() for s in samples]
    batches: list[list[int]] = []
    for p in range(0, len(order), pool):
        chunk = sorted(order[p : p + pool], key=lambda i: lengths[i])
        current: list[int] = []
        longest = 0
        for i in chunk:
            new_longest = max(longest, lengths[i])
            if current and new_longest * (len(current) + 1) > max_tokens:
                batches.append(current)
                current, new_longest = [], lengths[i]
            current.append(i)
            longest = new_longest
        if current:
            batches.append(current)
    rng.shuffle(batches)
    return batches
