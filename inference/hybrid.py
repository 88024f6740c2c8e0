"""Prompt lookup first, the trained drafter otherwise (chain drafting).

Where the text repeats itself (code, lists, quoted input, a small model's loops) copying what
followed the last earlier occurrence of the current n-gram is often right for several tokens
and costs nothing to draft; elsewhere a trained drafter is far better than lookup. Each step
uses prompt lookup when an n-gram of at least ``min_match`` tokens recurs, the drafter
otherwise. Both are advanced after every step so either can draft the next one. The drafts of
both are point masses or carry their own probabilities, so verification stays lossless.

Build it with :func:`lookup_first`, which keeps the drafter's own model (a draft LM's) visible.
"""

from __future__ import annotations

from draftlab.inference.ngram import NgramProposer
from draftlab.inference.proposer import OwnModel, Proposer
from draftlab.inference.sampling import Sampling
from draftlab.inference.shapes import Chain, ChainDraft


class LookupFirstProposer(Proposer):
    shapes = frozenset({"chain"})

    def __init__(self, drafter: Proposer, min_match: int = 2, n_max: int = 3):
        if not 1 <= min_match <= n_max:
            raise ValueError(f"lookup-first proposer: need 1 <= min_match <= n_max, got {min_match}, {n_max}")
        super().__init__(draft_vocab=drafter.draft_vocab)
        self.drafter = drafter
        self.lookup = NgramProposer(n_max=n_max, n_min=min_match)
        self.name = f"lookup+{drafter.name}"
        self.layers = drafter.layers
        self.lookup_steps = 0  # steps drafted by prompt lookup (the rest: by the drafter)

    def fork(self) -> "LookupFirstProposer":
        twin = super().fork()
        twin.drafter, twin.lookup = self.drafter.fork(), self.lookup.fork()
        return twin

    def configure(self, sampling: Sampling) -> None:
        super().configure(sampling)
        self.drafter.configure(sampling)
        self.lookup.configure(sampling)

    def start(self, prompt_ids, hidden, next_token) -> None:
        self.drafter.start(prompt_ids, hidden, next_token)
        self.lookup.start(prompt_ids, hidden, next_token)

    def propose(self, shape: Chain) -> ChainDraft:
        draft = self.lookup.propose(shape)
        if draft.tokens.numel():
            self.lookup_steps += 1
            return draft
        return self.drafter.propose(shape)

    def advance(self, accepted, hidden) -> None:
        self.drafter.advance(accepted, hidden)
        self.lookup.advance(accepted, hidden)


class LookupFirstOwnModel(LookupFirstProposer, OwnModel):
    """Lookup first before a drafter with a model of its own: that model's cache and graphs."""

    def __init__(self, drafter: Proposer, min_match: int = 2, n_max: int = 3):
        super().__init__(drafter, min_match, n_max)
        self.cache_bytes_per_token = drafter.cache_bytes_per_token

    def use_graphs(self, wrap) -> None:
        self.drafter.use_graphs(wrap)


def lookup_first(drafter: Proposer, min_match: int = 2, n_max: int = 3) -> LookupFirstProposer:
    """Prompt lookup first, ``drafter`` otherwise; an :class:`OwnModel` drafter stays one."""
    cls = LookupFirstOwnModel if isinstance(drafter, OwnModel) else LookupFirstProposer
    return cls(drafter, min_match, n_max)
