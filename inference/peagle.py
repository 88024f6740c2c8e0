"""Proposer for P-EAGLE drafters (models/peagle.py): every draft of a step from one drafter forward.

The drafter keeps a KV cache of committed positions (real tokens, real target features). The
tokens kept since the last draft are not run on their own: ``propose`` runs them together with
the K-1 mask slots in one causal forward over ``[kept tokens..., mask x (K-1)]``, keeps the kept
tokens' K/V and crops the mask slots' away. Slot 1 (the last kept token's output) gives draft 1,
mask slot j draft j + 1. No slot reads another's drafted token, so slot j's distribution q_j is
the same whatever was drafted before it: sampled drafts carry q_j and chain verification stays
lossless, as for block drafters. A tree is grown from the slots' top-k at no extra forward: a
node's children are the top-k of the next slot, scored by cumulative log-probability (EAGLE-2's
expansion and reranking, over distributions that do not depend on the parent).
"""

from __future__ import annotations

import torch

from draftlab.inference.eagle import EagleOnDevice
from draftlab.inference.proposer import PROPOSERS, DraftsOnDevice, Proposer, draft_vocab_size
from draftlab.inference.shapes import Block, Chain, ChainDraft, DraftTree, DynamicTree, OptionError
from draftlab.inference.spec_loop import grow_dynamic_tree, tree_layout, tree_nodes
from draftlab.kernels.cpu_gemm import decoding_copy


@PROPOSERS.register("peagle")
class PEagleProposer(Proposer, DraftsOnDevice):
    shapes = frozenset({"chain", "block", "dynamic_tree"})

    def __init__(self, drafter, trained_depth: int | None = None):
        super().__init__(draft_vocab=draft_vocab_size(drafter), trained_depth=trained_depth)
        self.drafter = decoding_copy(drafter.eval())
        self.name = drafter.algorithm
        self.layers = tuple(drafter.capture_layers)
        with torch.no_grad():
            self.mask_feature = self.drafter.mask_feature()  # [1, 1, H], the same for every step

    @classmethod
    def check(cls, shape, drafter) -> None:
        K = drafter.parallel_depth
        if isinstance(shape, (Chain, Block)) and shape.k > K:
            raise OptionError("k", f"must be at most {K}, the drafts this drafter makes per forward (parallel_depth), got {shape.k}",
                              f"{shape.method}: k={shape.k} exceeds the drafts this drafter makes per forward (parallel_depth = {K})")

    # ---- committed state ---------------------------------------------------------
    def start(self, prompt_ids, hidden, next_token):
        self.cache = self.drafter.new_cache()
        self.pos = 0  # positions in the cache
        self.last_logits = None  # slot 1's logits once the pending tokens are in
        prompt_ids = prompt_ids.view(1, -1)
        nxt = torch.tensor([[next_token]], device=prompt_ids.device)
        # position t pairs token x_{t+1} with the target feature f_t
        self.pending = (torch.cat([prompt_ids[:, 1:], nxt], dim=1), self.drafter.features(hidden))

    @torch.no_grad()
    def advance(self, accepted, hidden):
        tokens, feats = accepted.view(1, -1), self.drafter.features(hidden)
        if self.pending is not None:
            tokens, feats = torch.cat([self.pending[0], tokens], 1), torch.cat([self.pending[1], feats], 1)
        self.pending = (tokens, feats)

    @torch.no_grad()
    def slot_logits(self, k: int) -> torch.Tensor:
        """Draft-vocab logits [k, V_draft] of slots 1..k, from one forward over the pending
        tokens and k - 1 mask slots."""
        d = self.drafter
        masks = k - 1
        if self.pending is None and masks == 0:
            return self.last_logits[None]
        dev = self.mask_feature.device
        ids = torch.full((1, masks), d.mask_token_id, dtype=torch.long, device=dev)
        feats = self.mask_feature.expand(1, masks, -1)
        n = 0
        if self.pending is not None:
            n = self.pending[0].shape[1]
            ids, feats = torch.cat([self.pending[0], ids], 1), torch.cat([self.pending[1], feats], 1)
        # mask slot j sits j positions after the last kept token, as in training (anchor t, depth d: t + d)
        positions = torch.arange(self.pos, self.pos + n + masks, device=dev)[None]
        committed = self.cache.length + n
        h, _ = d.draft_step(ids, feats, positions, self.cache, logits=False)
        self.cache.crop(committed)
        self.pos += n
        self.pending = None
        if n:
            self.last_logits = d.head(h[0, n - 1])
        return torch.cat([self.last_logits[None], d.head(h[0, n:])]) if masks else self.last_logits[None]

    # ---- drafts ----------------------------------------------------------------------
    def propose(self, shape):
        if isinstance(shape, DynamicTree):
            return self._tree(shape)
        self.check(shape, self.drafter)
        logits = self.slot_logits(shape.k)
        min_confidence = getattr(shape, "min_confidence", 0.0)
        if min_confidence > 0:  # EAGLE's dynamic length: stop where the product of top-1 probabilities drops below it
            top1 = logits.float().log_softmax(-1).max(-1).values.cumsum(0).exp()
            logits = logits[: int((top1 >= min_confidence).long().cumprod(0).sum())]
        d = self.drafter
        if self.sampling.greedy:
            return ChainDraft(d.to_target_ids(logits.max(-1).indices), None)
        q = self.sampling.probs(logits)  # [k, V_draft]: slot j's marginal, what its token is drawn from
        full = q.new_zeros(q.shape[0], d.vocab_size)
        full[:, d.t2d] = q  # draft ids are the kept target ids in ascending order
        return ChainDraft(d.to_target_ids(self.sampling.sample(q)), full)

    def slot_tree(self, spec: DynamicTree) -> DynamicTree:
        """``spec`` as the slots grow it: at most parallel_depth levels (deeper slots are not
        drafted) and, on the device, exactly as many nodes as the growth scores."""
        depth = min(spec.max_depth, self.drafter.parallel_depth)
        return DynamicTree(depth, spec.top_k, min(spec.total_tokens, tree_nodes(DynamicTree(depth, spec.top_k, spec.total_tokens),
                                                                                self.draft_vocab)))

    @torch.no_grad()
    def _tree(self, spec: DynamicTree) -> DraftTree:
        """EAGLE-2's expansion and reranking (:func:`grow_dynamic_tree`) over the slots' log-probs:
        depth d's children are the top-k of slot d + 1, whatever their parent, so the tree costs
        no forward beyond the slots'."""
        spec = self.slot_tree(spec)
        lp = self.slot_logits(spec.max_depth).float().log_softmax(-1)[None]  # [1, depth, V_draft]
        tokens, parents = grow_dynamic_tree(lp[:, 0], spec, lambda depth, tok, parent: lp[:, depth, None].expand(-1, tok.shape[1], -1))
        depth, _ = tree_layout(torch.nn.functional.pad(parents, (1, 0), value=-1), spec.max_depth)
        return DraftTree(self.drafter.to_target_ids(tokens[0]), parents[0], depth[0, 1:])

    # ---- on the device ---------------------------------------------------------------
    def refuses_on_device(self, shape) -> str | None:
        if isinstance(shape, (Chain, Block)):
            self.check(shape, self.drafter)
            return None
        if isinstance(shape, DynamicTree):
            if self.slot_tree(shape).total_tokens < shape.total_tokens:
                return f"its {self.drafter.parallel_depth} slots grow fewer than tree.total_tokens={shape.total_tokens} nodes"
            return None
        return super().refuses_on_device(shape)

    def on_device(self, rows: int, room: int, shape) -> "PEagleOnDevice":
        return PEagleOnDevice(self, rows, room)


class PEagleOnDevice(EagleOnDevice):
    """P-EAGLE's drafts in the device loop: ``extend`` runs the kept tokens (slot 1's logits are
    the last one's), a draft runs the K - 1 mask slots past the row's length in one forward."""

    def __init__(self, proposer: PEagleProposer, rows: int, room: int):
        super().__init__(proposer.drafter, rows, room)
        self.family = proposer

    def _slot_logits(self, b: int, k: int) -> torch.Tensor:
        """Draft-vocab logits [b, k, V_draft] of slots 1..k."""
        d, rows = self.drafter, slice(0, b)
        first = self.last_logits[rows][:, None]
        if k == 1:
            return first
        ids = torch.full((b, k - 1), d.mask_token_id, dtype=torch.long, device=first.device)
        h = self._forward(rows, ids, self.family.mask_feature.expand(b, k - 1, -1), self.lengths[rows])
        return torch.cat([first, d.head(h)], 1)

    def draft(self, b: int, k: int) -> torch.Tensor:
        return self.drafter.to_target_ids(self._slot_logits(b, k).max(-1).indices)

    def draft_tree(self, b: int, shape: DynamicTree):
        spec = self.family.slot_tree(shape)
        lp = self._slot_logits(b, spec.max_depth).float().log_softmax(-1)
        tokens, parents = grow_dynamic_tree(lp[:, 0], spec,
                                            lambda depth, tok, parent: lp[:, depth, None].expand(-1, tok.shape[1], -1))
        return self.drafter.to_target_ids(tokens), parents
