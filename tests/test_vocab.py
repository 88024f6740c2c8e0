"""EAGLE-3 draft vocabulary: selection, d2t/t2d semantics and the id mappings."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from draftlab.data.vocab import build_draft_vocab
from draftlab.errors import DraftlabError


def _sample(ids, mask):
    return {"input_ids": torch.tensor(ids, dtype=torch.long), "loss_mask": torch.tensor(mask, dtype=torch.bool)}


def _reference(samples, V, N):
    """Independent selection: sort by (-masked count, id), then (-full count, id), then id."""
    masked, full = Counter(), Counter()
    for s in samples:
        for t, m in zip(s["input_ids"].tolist(), s["loss_mask"].tolist()):
            full[t] += 1
            masked[t] += bool(m)
    kept = [t for t in sorted(masked, key=lambda t: (-masked[t], t)) if masked[t] > 0][:N]
    rest = [t for t in sorted(full, key=lambda t: (-full[t], t)) if t not in kept]
    kept += rest[: N - len(kept)]
    kept += [t for t in range(V) if t not in kept][: N - len(kept)]
    return sorted(kept)


def test_counts_only_loss_masked_tokens_and_breaks_ties_by_id():
    # token 9 is the most frequent overall but only in unmasked positions
    samples = [
        _sample([9, 9, 9, 9, 9, 4, 4, 7, 7, 2, 3], [0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1]),
        _sample([9, 9, 6, 4], [0, 0, 1, 1]),
    ]
    d2t, t2d = build_draft_vocab(samples, 12, 3)
    # masked counts: 4 x3, 7 x2, then 2, 3, 6 x1 -> tie broken by the smaller id (2)
    kept = (torch.arange(3) + d2t).tolist()
    assert kept == [2, 4, 7]
    assert t2d.dtype == torch.bool and t2d.shape == (12,) and t2d.sum() == 3
    assert t2d.nonzero().squeeze(1).tolist() == kept
    assert d2t.dtype == torch.long and d2t.tolist() == [2 - 0, 4 - 1, 7 - 2]


def test_fills_when_too_few_distinct_tokens():
    samples = [_sample([3, 3, 3, 9, 9, 5, 7, 5], [0, 0, 0, 0, 0, 1, 1, 1])]
    d2t, t2d = build_draft_vocab(samples, 12, 6)
    # masked: 5, 7; then whole sequences: 3 (x3), 9 (x2); then lowest unused ids: 0, 1
    assert (torch.arange(6) + d2t).tolist() == [0, 1, 3, 5, 7, 9]
    assert t2d.sum() == 6
    d2t, t2d = build_draft_vocab([], 5, 5)  # nothing at all: the first N ids
    assert (torch.arange(5) + d2t).tolist() == [0, 1, 2, 3, 4] and t2d.all()


def test_matches_reference_on_random_data():
    g = torch.Generator().manual_seed(0)
    V = 300
    samples = []
    for _ in range(20):
        n = int(torch.randint(5, 60, (1,), generator=g))
        ids = torch.minimum(torch.distributions.Geometric(0.03).sample((n,)).long(), torch.tensor(V - 1))
        samples.append({"input_ids": ids, "loss_mask": torch.rand(n, generator=g) < 0.6})
    for N in (1, 17, 64, 250, 300):
        d2t, t2d = build_draft_vocab(samples, V, N)
        assert (torch.arange(N) + d2t).tolist() == _reference(samples, V, N)
        assert t2d.sum() == N and d2t.shape == (N,)


def test_d2t_and_t2d_describe_the_same_vocabulary():
    g = torch.Generator().manual_seed(1)
    samples = [_sample(torch.randint(0, 50, (40,), generator=g).tolist(), [1] * 40)]
    N, V = 20, 50
    d2t, t2d = build_draft_vocab(samples, V, N)
    target = torch.arange(N) + d2t  # draft id -> target id, as the drafters map them
    assert target.tolist() == sorted(set(target.tolist())) and t2d[target].all() and int(t2d.sum()) == N
    # the draft id of a target id is its rank among the kept ones (what t2d-masked training uses)
    assert torch.equal(t2d.nonzero().squeeze(1), target)


def test_bad_sizes_and_ids():
    s = [_sample([1, 2], [1, 1])]
    with pytest.raises(DraftlabError, match="draft_vocab_size"):
        build_draft_vocab(s, 10, 11)
    with pytest.raises(DraftlabError, match="draft_vocab_size"):
        build_draft_vocab(s, 10, 0)
    with pytest.raises(DraftlabError, match="outside the target vocab"):
        build_draft_vocab([_sample([1, 12], [1, 1])], 10, 5)
