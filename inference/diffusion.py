"""Proposer for block diffusion drafters: one drafter forward drafts the whole block.

The block is ``[last token, MASK x (gamma - 1)]`` at the positions right after the verified
tokens whose target features are known (the last token's are not yet: the target sees it in
the next verify forward). Each drafter layer's keys and values of that context depend only on
the target features, so they are cached and grow by the kept inputs after each step, as the
target's own cache does. Draft j is slot j's argmax (greedy) or a sample from its marginal
q_j (sampling; ``probs`` carries q_j, so chain verification stays lossless: q_j does not depend
on the earlier drafts, which a chain verifier allows).
"""

from __future__ import annotations

import torch

from draftlab.errors import DraftlabError
from draftlab.inference.proposer import PROPOSERS, Block, ChainDraft, Proposer
from draftlab.models.cpu_gemm import decoding_copy


@PROPOSERS.register("diffusion")
class DiffusionProposer(Proposer):
    shapes = frozenset({"block"})

    def __init__(self, drafter):
        self.drafter = decoding_copy(drafter.eval())
        self.name = drafter.algorithm
        self.layers = tuple(drafter.capture_layers)

    def start(self, prompt_ids, hidden, next_token):
        self.kv = None
        self.length = 0  # positions whose target features are in the context
        self._extend(hidden)
        self.last = int(next_token)

    def advance(self, accepted, hidden):
        self._extend(hidden)
        self.last = int(accepted[-1])

    @torch.no_grad()
    def _extend(self, hidden):
        d = self.drafter
        ctx = d.context(hidden)
        n = ctx.shape[1]
        positions = torch.arange(self.length, self.length + n, device=ctx.device)[None]
        new = d.context_kv(ctx, positions)
        self.kv = new if self.kv is None else [(torch.cat([k, nk], 2), torch.cat([v, nv], 2)) for (k, v), (nk, nv) in zip(self.kv, new)]
        self.length += n

    @torch.no_grad()
    def block_logits(self) -> torch.Tensor:
        """Draft-vocab logits [gamma - 1, V_draft] of the block's masked slots."""
        d = self.drafter
        G = d.block_size
        dev = self.kv[0][0].device
        ids = d.block_ids(torch.tensor([self.last], device=dev))  # [1, G]
        positions = torch.arange(self.length, self.length + G, device=dev)[None]
        mask = torch.ones(1, G, self.length + G, dtype=torch.bool, device=dev)  # whole context, whole block
        return d.blocks(ids, positions, self.kv, mask)[0, 1:]

    @classmethod
    def check(cls, shape: Block, drafter) -> None:
        if shape.k > drafter.block_size - 1:
            raise DraftlabError(f"block: k={shape.k} exceeds what this drafter drafts per block (block_size - 1 = {drafter.block_size - 1})")

    def propose(self, shape: Block) -> ChainDraft:
        d = self.drafter
        self.check(shape, d)
        logits = self.block_logits()[: shape.k]
        if self.sampling.greedy:
            return ChainDraft(d.to_target_ids(logits.argmax(-1)), None)
        q = self.sampling.probs(logits)  # [k, V_draft]
        draft = self.sampling.sample(q)
        full = q.new_zeros(q.shape[0], d.vocab_size)
        full[:, d.t2d] = q  # draft ids are the kept target ids in ascending order
        return ChainDraft(d.to_target_ids(draft), full)
