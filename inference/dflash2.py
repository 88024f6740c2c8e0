"""Proposer for DFlash2 drafters (models/dflash2.py): the diffusion proposer's block, drafted by the
candidate selector's walk.

One drafter forward gives every slot's state (the diffusion family's block, the convolutions
inside); each slot keeps its unary top-K and the selector walks them from the last verified
token, slot j's scores read the token chosen at slot j - 1. Greedy: each slot's best score.
Sampling: a draw from q_j = the decoding distribution (temperature, top-k, top-p) over the K
scores, which depends on the drafts before it as a chain verifier allows; ``probs`` carries q_j
over the vocabulary (zero off the K candidates), so verification stays lossless.

``selector=False`` decodes the same drafter with each slot's own unary top-1 (or a sample of the
unary distribution): the backbone alone, the diffusion proposer's drafts. The device loop
(:mod:`~draftlab.inference.spec_loop`) walks every row's block at once, greedy.
"""

from __future__ import annotations

import torch

from draftlab.inference.diffusion import DiffusionProposer
from draftlab.inference.proposer import PROPOSERS
from draftlab.inference.shapes import Block, ChainDraft


@PROPOSERS.register("dflash2")
class DFlash2Proposer(DiffusionProposer):
    def __init__(self, drafter, trained_depth: int | None = None, selector: bool = True):
        super().__init__(drafter, trained_depth=trained_depth)
        self.selector = selector
        if not selector:
            self.name = f"{drafter.algorithm} backbone top-1"

    @torch.no_grad()
    def draft_block(self, states: torch.Tensor, shape: Block) -> ChainDraft:
        if not self.selector:
            return super().draft_block(states, shape)
        d, qs = self.drafter, []

        def choose(scores):  # [K]: the walk's pick at one slot
            if self.sampling.greedy:
                return scores.argmax(-1)
            qs.append(self.sampling.probs(scores))
            return self.sampling.sample(qs[-1])

        tokens, cand = d.walk(states, d.readout(states), torch.tensor(self.last, device=states.device), choose)
        if self.sampling.greedy:
            return ChainDraft(tokens, None)
        probs = torch.zeros(tokens.shape[0], d.vocab_size, device=states.device)
        return ChainDraft(tokens, probs.scatter_(1, cand, torch.stack(qs).to(probs.dtype)))

    def device_block(self, states: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        """:meth:`draft_block`'s greedy walk for every row at once (``last`` [b]: each row's anchor)."""
        if not self.selector:
            return super().device_block(states, last)
        d = self.drafter
        return d.walk(states, d.readout(states), last, lambda s: s.argmax(-1))[0]
