"""The decoder's :class:`Branch` seam: inputs that ride along a step's verify forward. A toy
proposer attaches a plain continuation (mask lower triangular): the logits handed back equal a
plain target forward over the same text; the drafts verify as they do without the branch (greedy
tokens and acceptance unchanged), in a batch of one and of three with branches of different
lengths and none, for chains and trees; an oversized branch is refused."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from draftlab.inference.decoder import Decoder
from draftlab.inference.ngram import NgramProposer
from draftlab.inference.proposer import Branching, Proposer
from draftlab.inference.shapes import Branch, Chain, DynamicTree

TEXTS = ["The quick brown fox jumps", "a b c a b c a b", "def add(a, b):\n    return a + b\n\nprint(add(2, 3))"]
N_NEW = 20

pytestmark = pytest.mark.usefixtures("one_thread")


class ContinuationBranch(Proposer, Branching):
    """Drafts as ``inner`` does and attaches a continuation of the text: ``lengths[len(prompt)]``
    random tokens (0: no branch) at positions 1.. after the last token, each seeing those before
    it. Records (text so far, branch tokens, logits handed back) per step."""

    name = "continuation-branch"
    shapes = frozenset({"chain", "dynamic_tree"})

    def __init__(self, inner: Proposer, lengths: dict[int, int], vocab: int, declared: int | None = None):
        self.inner, self.lengths, self.vocab = inner, lengths, vocab
        self.branch_inputs = max(lengths.values()) if declared is None else declared

    def fork(self):
        p = copy.copy(self)
        p.inner = self.inner.fork()
        return p

    def start(self, prompt_ids, hidden, next_token):
        self.inner.start(prompt_ids, hidden, next_token)
        self.text = prompt_ids.tolist() + [int(next_token)]
        self.length = self.lengths[prompt_ids.numel()]
        self.rng = random.Random(prompt_ids.numel())
        self.seen = []

    def advance(self, accepted, hidden):
        self.inner.advance(accepted, hidden)
        self.text += accepted.tolist()

    def propose(self, shape):
        draft = self.inner.propose(shape)
        E = self.length
        if E:
            record = {"text": list(self.text), "tokens": [self.rng.randrange(self.vocab) for _ in range(E)]}
            self.seen.append(record)
            draft.branch = Branch(torch.tensor(record["tokens"]), torch.arange(1, E + 1), torch.ones(E, E, dtype=torch.bool).tril(),
                                  lambda logits: record.__setitem__("logits", logits.clone()))
        return draft


def _prompts(target):
    return [target.tokenizer(t)["input_ids"] for t in TEXTS]


def _check_logits(target, records):
    assert records and all("logits" in r for r in records)
    for r in records:
        seq = r["text"] + r["tokens"]
        plain = target(torch.tensor([seq]), logits="all").logits[0, len(r["text"]) :]
        torch.testing.assert_close(r["logits"], plain, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("shape", [Chain(3), DynamicTree(3, 2, 8)], ids=["chain", "tree"])
def test_branch_logits_and_greedy_tokens(tiny_llama, shape):
    prompts = _prompts(tiny_llama)
    lengths = {len(prompts[0]): 5, len(prompts[1]): 0, len(prompts[2]): 2}  # one row without a branch
    assert len(lengths) == 3
    vocab = tiny_llama.vocab_size
    # a batch of one: the proposer itself; a batch of three: one fork per row, branches padded
    for batch in ([prompts[0]], prompts):
        toy = ContinuationBranch(NgramProposer(), lengths, vocab)
        with_branch = Decoder(tiny_llama, toy).generate(batch, N_NEW, shape)
        without = Decoder(tiny_llama, NgramProposer()).generate(batch, N_NEW, shape)
        assert [r.tokens for r in with_branch.rows] == [r.tokens for r in without.rows]
        assert [r.accept_lengths for r in with_branch.rows] == [r.accept_lengths for r in without.rows]
        assert sum(sum(r.accept_lengths) for r in without.rows) > 0  # drafts were accepted, so rows kept more than one token
        if len(batch) == 1:
            _check_logits(tiny_llama, toy.seen)
            assert len(toy.seen) == with_branch.num_steps  # a branch in every step's forward
    # the batch's rows: record through forks made by the decoder
    forks = []
    toy = ContinuationBranch(NgramProposer(), lengths, vocab)
    toy.batched = lambda n, shape: _capture(forks, Proposer.batched(toy, n, shape))
    Decoder(tiny_llama, toy).generate(prompts, N_NEW, shape)
    assert len(forks) == 3 and not forks[1].seen
    for p in (forks[0], forks[2]):
        _check_logits(tiny_llama, p.seen)


def _capture(out, rows):
    out.extend(rows.rows)
    return rows


def test_oversized_branch_refused(tiny_llama):
    prompt = _prompts(tiny_llama)[0]
    toy = ContinuationBranch(NgramProposer(), {len(prompt): 4}, tiny_llama.vocab_size, declared=3)
    with pytest.raises(ValueError, match="branch of 4 inputs, more than the 3"):
        Decoder(tiny_llama, toy).generate([prompt], 4, Chain(2))
