"""The decoder's ``TargetSteps`` seam: a proposer drafting with the target itself over the
decoder's own KV cache. A toy proposer drafts with every layer (so each greedy draft is the
target's own next token): all drafts are accepted, the output equals plain decoding, and the
cache is rolled back after each draft (batch 1, and a batch of 3 prompts of different lengths
whose rows finish at different times)."""

from __future__ import annotations

import pytest
import torch

from draftlab.inference.decoder import Decoder, generate_plain_batch
from draftlab.inference.proposer import BatchProposer, DraftsWithTarget, RowProposers
from draftlab.inference.shapes import Chain, ChainDraft

pytestmark = pytest.mark.usefixtures("one_thread")


class _Rows(RowProposers):
    """Every row drafted at once through ``steps``."""

    def __init__(self):
        super().__init__([])
        self.last: list[int] = []

    def use_target(self, steps) -> None:
        self.steps = steps

    def start(self, row, prompt_ids, hidden, next_token) -> None:
        self.last[row:] = [int(next_token)]

    def advance(self, accepted, hidden, rows) -> None:
        for r, a in zip(rows, accepted):
            self.last[r] = int(a[-1])

    def select(self, rows) -> None:
        self.last = [self.last[r] for r in rows]

    def propose(self, shape: Chain) -> list[ChainDraft]:
        before = self.steps.lengths()
        ids, drafts = torch.tensor(self.last)[:, None], []
        for _ in range(shape.k):
            ids = self.steps.forward(ids, logits="last").logits[:, -1].argmax(-1, keepdim=True)
            drafts.append(ids)
        assert self.steps.lengths() == [n + shape.k for n in before]  # each forward wrote after the last
        return [ChainDraft(t) for t in torch.cat(drafts, 1)]


class _SelfDraft(BatchProposer, DraftsWithTarget):
    name = "self"
    shapes = frozenset({"chain"})

    def rows(self, n):
        return _Rows()


@pytest.mark.parametrize("texts", [["a b c a b c"], ["The quick brown fox", "def add(a, b):", "Hello"]])
def test_self_drafts_are_accepted_and_output_is_plain(tiny_llama, texts):
    prompts = [tiny_llama.tokenizer(t)["input_ids"] for t in texts]
    n_new = 20
    plain = generate_plain_batch(tiny_llama, prompts, n_new)
    res = Decoder(tiny_llama, _SelfDraft()).generate(prompts, n_new, Chain(3))
    assert [r.tokens for r in res.rows] == [r.tokens for r in plain.rows]
    for r in res.rows:  # every draft accepted but where the budget cut the step short
        assert all(a == d for a, d in zip(r.accept_lengths[:-1], r.num_drafted[:-1]))
        assert r.num_steps < n_new // 2
