"""Proposer for DSpark drafters (models/dspark.py): the diffusion proposer's block, drafted left to
right through the Markov head.

One drafter forward gives every masked slot's state (as for the diffusion family); slot j's
logits are then the backbone's plus the Markov bias of the token drafted at slot j - 1 (the
last verified token for the first), so the drafts are taken one after another, each a cheap
rank-r product. Greedy: each slot's argmax; sampling: a sample of q_j, which depends on the
drafts before it, as a chain verifier allows (``probs`` carries it, so verification stays
lossless).

``Block.min_confidence`` > 0 (adaptive verification): the confidence head predicts each slot's
acceptance given its prefix was accepted; the block stops before the slot at which the product
of those predictions drops below the threshold (possibly before the first: a step with no
drafts, the target's own token only). 0 drafts the whole block, which the device loop
(:mod:`~draftlab.inference.spec_loop`) also runs: greedy drafts of every row at once.
"""

from __future__ import annotations

import torch

from draftlab.inference.diffusion import DiffusionProposer
from draftlab.inference.proposer import PROPOSERS
from draftlab.inference.shapes import Block, ChainDraft


@PROPOSERS.register("dspark")
class DSparkProposer(DiffusionProposer):
    @torch.no_grad()
    def draft_block(self, states: torch.Tensor, shape: Block) -> ChainDraft:
        d = self.drafter
        base = d.readout(states)  # [k, V_draft]: one product for every slot
        prev = torch.tensor(self.last, device=states.device)
        tokens, probs, survive = [], [], 1.0
        for j in range(states.shape[0]):
            emb = d.markov_head.embed(prev)
            if shape.min_confidence > 0:
                survive *= torch.sigmoid(d.confidence_head(states[j], emb)).item()
                if survive < shape.min_confidence:
                    break
            logits = base[j] + d.markov_head.bias(states[j], emb)
            if self.sampling.greedy:
                draft = logits.argmax(-1)
            else:
                q = self.sampling.probs(logits[None])[0]
                draft = self.sampling.sample(q[None])[0]
                probs.append(q)
            prev = d.to_target_ids(draft)
            tokens.append(prev)
        dev = states.device
        out = torch.stack(tokens) if tokens else torch.zeros(0, dtype=torch.long, device=dev)
        if self.sampling.greedy:
            return ChainDraft(out, None)
        full = torch.zeros(len(probs), d.vocab_size, device=dev)
        if probs:
            full[:, d.t2d] = torch.stack(probs).to(full.dtype)  # draft ids are the kept target ids in ascending order
        return ChainDraft(out, full)

    def device_block(self, states: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        """:meth:`draft_block`'s greedy drafts for every row at once: slot j's logits biased by
        the Markov head's embedding of the token drafted before it (``last`` [b] for slot 1)."""
        d = self.drafter
        base, prev, out = d.readout(states), last, []
        for j in range(states.shape[1]):
            prev = d.to_target_ids((base[:, j] + d.markov_head.bias(states[:, j], d.markov_head.embed(prev))).argmax(-1))
            out.append(prev)
        return torch.stack(out, 1)
