"""Proposer for Domino drafters (models/domino.py): the diffusion proposer's block, drafted left to
right through the GRU correction.

One drafter forward gives every masked slot's state (as for the diffusion family) and the base
logits of all of them in one product. Draft j is then taken from the base logits plus, from
``pure_draft_prefix_len`` on, the correction of the GRU state that has read the last verified
token and the drafts before j (one GRU step and a rank-``emb_dim`` product per draft). Greedy:
each position's argmax; sampling: a sample of q_j, which depends on the drafts before it, as a
chain verifier allows (``probs`` carries it, so verification stays lossless). The device loop
(:mod:`~draftlab.inference.spec_loop`) drafts every row's block so, greedily, in tensor ops.

``correction=False`` drafts from the backbone alone (the diffusion proposer's drafts): what the
correction adds to one checkpoint, ``python -m draftlab.inference.lift``.
"""

from __future__ import annotations

import torch

from draftlab.inference.diffusion import DiffusionProposer
from draftlab.inference.proposer import PROPOSERS
from draftlab.inference.shapes import Block, ChainDraft


@PROPOSERS.register("domino")
class DominoProposer(DiffusionProposer):
    part = "correction"  # the keyword that switches it off (inference/lift.py)

    def __init__(self, drafter, trained_depth: int | None = None, correction: bool = True):
        super().__init__(drafter, trained_depth=trained_depth)
        self.correction = correction
        if not correction:
            self.name = f"{drafter.algorithm} (backbone only)"

    @torch.no_grad()
    def draft_block(self, states: torch.Tensor, shape: Block) -> ChainDraft:
        if not self.correction:
            return super().draft_block(states, shape)
        d = self.drafter
        P, dev = d.pure_draft_prefix_len, states.device
        base = d.readout(states)  # [k, V_draft]: one product for every position
        gru = d.gru_step(torch.tensor([self.last], device=dev), None)  # it has read the verified token
        tokens, probs = [], []
        for j in range(states.shape[0]):
            logits = base[j] + d.correction(states[j : j + 1], gru)[0] if j >= P else base[j]
            if self.sampling.greedy:
                draft = logits.argmax(-1)
            else:
                q = self.sampling.probs(logits[None])[0]
                draft = self.sampling.sample(q[None])[0]
                probs.append(q)
            tokens.append(d.to_target_ids(draft))
            if j + 1 < states.shape[0]:  # the next position's GRU has read this draft
                gru = d.gru_step(tokens[-1][None], gru)
        out = torch.stack(tokens)
        if self.sampling.greedy:
            return ChainDraft(out, None)
        full = torch.zeros(len(probs), d.vocab_size, device=dev)
        full[:, d.t2d] = torch.stack(probs).to(full.dtype)  # draft ids are the kept target ids in ascending order
        return ChainDraft(out, full)

    def device_block(self, states: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        """:meth:`draft_block`'s greedy drafts for every row at once (``last`` [b]: each row's
        verified token, the GRU's first input)."""
        if not self.correction:
            return super().device_block(states, last)
        d = self.drafter
        base, gru, out = d.readout(states), d.gru_step(last, None), []
        for j in range(states.shape[1]):
            logits = base[:, j] + d.correction(states[:, j], gru) if j >= d.pure_draft_prefix_len else base[:, j]
            out.append(d.to_target_ids(logits.argmax(-1)))
            if j + 1 < states.shape[1]:
                gru = d.gru_step(out[-1], gru)
        return torch.stack(out, 1)
