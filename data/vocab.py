"""A reduced draft vocabulary (EAGLE-3, Medusa): the N most frequent assistant tokens of the training data.

``d2t[i] = target_id(i) - i`` (offsets, as EAGLE-3 / speculators / SGLang store them) and
``t2d`` is a boolean mask over the target vocabulary. Draft ids are the kept target ids in
ascending order, so ``target_id = draft_id + d2t[draft_id]`` and
``draft_id = cumsum(t2d)[target_id] - 1`` for kept tokens.
"""

from __future__ import annotations

from typing import Iterable

import torch

from draftlab.errors import DraftlabError


def _rank(counts: torch.Tensor, exclude: torch.Tensor) -> torch.Tensor:
    """Ids with a positive count, not excluded, by count descending then id ascending."""
    order = torch.sort(counts, descending=True, stable=True).indices  # stable: equal counts keep id order
    return order[(counts[order] > 0) & ~exclude[order]]


def build_draft_vocab(samples: Iterable[dict], target_vocab_size: int, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d2t: LongTensor[N], t2d: BoolTensor[V])`` for N = ``draft_vocab_size``.

    Keeps the top N token ids by frequency over loss-masked tokens (ties: smaller id). With
    fewer than N distinct masked tokens, fills up with the most frequent remaining ids of the
    whole sequences, then with the lowest unused ids, so exactly N are always kept."""
    V, N = int(target_vocab_size), int(draft_vocab_size)
    if not 1 <= N <= V:
        raise DraftlabError(f"draft_vocab_size must be between 1 and the target vocab size {V}, got {N}")
    masked = torch.zeros(V, dtype=torch.long)
    full = torch.zeros(V, dtype=torch.long)
    for s in samples:
        ids = s["input_ids"].reshape(-1).long()
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= V):
            raise DraftlabError(f"a sample has token ids outside the target vocab [0, {V})")
        full += torch.bincount(ids, minlength=V)
        masked += torch.bincount(ids[s["loss_mask"].reshape(-1).bool()], minlength=V)
    chosen = torch.zeros(V, dtype=torch.bool)
    for counts in (masked, full):
        need = N - int(chosen.sum())
        if need <= 0:
            break
        top = _rank(counts, chosen)[:need]
        chosen[top] = True
    need = N - int(chosen.sum())
    if need > 0:
        chosen[(~chosen).nonzero().squeeze(1)[:need]] = True
    kept = chosen.nonzero().squeeze(1)  # ascending target ids
    d2t = kept - torch.arange(N)
    return d2t, chosen



def draft_vocab(samples, target_vocab_size: int, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A drafter's ``(d2t, t2d)``: :func:`build_draft_vocab` over the training ``samples`` for a
    reduced vocabulary, the identity (zero offsets, every token kept) for the full one."""
    V, N = int(target_vocab_size), int(draft_vocab_size)
    if N >= V:
        return torch.zeros(V, dtype=torch.long), torch.ones(V, dtype=torch.bool)
    if not samples:
        raise DraftlabError("drafter.draft_vocab_size < vocab needs training samples to count tokens")
    return build_draft_vocab(samples, V, N)
