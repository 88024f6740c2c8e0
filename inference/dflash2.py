"""Proposer for DFlash2 drafters (models/dflash2.py): the diffusion proposer's block, drafted by the
candidate selector's walk.

One drafter forward gives every slot's state (the diffusion family's block, the convolutions
inside); each slot keeps its unary top-K and the selector walks them from the last verified
token, slot j's scores read the token chosen at slot j - 1. Greedy: each slot's best score.
Sampling: a draw from q_j = the decoding distribution (temperature, top-k, top-p) over the K
scores, which depends on the drafts before it as a chain verifier allows; ``probs`` carries q_j
over the vocabulary (zero off the K candidates), so verification stays lossless.

``selector=False`` decodes the same drafter with each slot's own unary top-1 (or a sample of the
unary distribution): the backbone alone, the diffusion proposer's drafts; what the selector adds
to one checkpoint: ``python -m draftlab.inference.lift`` (with :func:`heldout_slots`: recall@K,
the rate the selector is bounded by). The device loop (:mod:`~draftlab.inference.spec_loop`)
walks every row's block at once, greedy.
"""

from __future__ import annotations

import torch

from draftlab.inference.diffusion import DiffusionProposer
from draftlab.inference.proposer import PROPOSERS
from draftlab.inference.shapes import Block, ChainDraft


@PROPOSERS.register("dflash2")
class DFlash2Proposer(DiffusionProposer):
    part = "selector"  # the keyword that switches it off (inference/lift.py)

    def __init__(self, drafter, trained_depth: int | None = None, selector: bool = True):
        super().__init__(drafter, trained_depth=trained_depth)
        self.selector = selector
        if not selector:
            self.name = f"{drafter.algorithm} backbone top-1"

    @staticmethod
    def heldout_rates(drafter, target, samples) -> dict:
        """Per-slot rates of both drafts on held-out samples, recall@K beside them: :func:`heldout_slots`."""
        return heldout_slots(drafter, target, samples)

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


@torch.no_grad()
def heldout_slots(drafter, target, samples, chunk: int = 64) -> dict:
    """Per-slot rates over held-out ``samples`` (dicts with ``input_ids`` and ``loss_mask``), at
    every anchor whose next token is an assistant token, ``chunk`` blocks per forward:
    ``recall_at_k`` (the target's greedy token among the unary top-K); per draft, ``backbone``
    (the unary top-1) and ``selector`` (the selector's greedy walk from the anchor): ``acc`` per
    slot (the draft is that token) and ``accepted`` (the mean greedy-accepted prefix per block);
    ``blocks``: how many blocks were read."""
    d = drafter.eval()
    J, K = d.block_size - 1, d.candidate_selector.top_k
    hits = {k: torch.zeros(J) for k in ("recall_at_k", "backbone_acc", "selector_acc")}
    counts, streaks, blocks = torch.zeros(J), {"backbone_accepted": 0.0, "selector_accepted": 0.0}, 0
    for s in samples:
        ids = s["input_ids"].long().view(1, -1).to(target.device)
        batch = {"input_ids": ids, "loss_mask": s["loss_mask"].bool().view(1, -1).to(ids.device),
                 "attention_mask": torch.ones_like(ids)}
        hidden = target(ids, layers=d.capture_layers, logits=None).hidden
        batch.update(d.derived_targets(hidden, batch))
        with torch.random.fork_rng(devices=[]):  # every valid anchor, in an order that moves no caller's RNG
            anchors, real = d.sample_anchors(batch["loss_mask"], batch["attention_mask"], ids.shape[1])
        anchors, real = anchors[:, real[0]], real[:, real[0]]
        for a in range(0, anchors.shape[1], chunk):
            at, ok = anchors[:, a : a + chunk], real[:, a : a + chunk]
            states = d.anchored_states(ids, batch["attention_mask"], hidden, at)[0, :, 1:].contiguous()  # [A, J, H]
            logits = d.readout(states)
            t = d.block_targets(batch, at, ok)
            m, greedy = t["counted"][0], t["greedy"][0]
            top = d.to_target_ids(logits.topk(K, dim=-1).indices)
            path, _ = d.walk(states, logits, ids[0, at[0]], lambda x: x.argmax(-1))
            got = {"recall_at_k": (top == greedy[..., None]).any(-1), "backbone_acc": d.to_target_ids(logits.argmax(-1)) == greedy,
                   "selector_acc": path == greedy}
            for k, v in got.items():
                hits[k] += (v & m).sum(0).float()
            counts += m.sum(0).float()
            first = m[:, 0]
            blocks += int(first.sum())
            for k, v in (("backbone_accepted", got["backbone_acc"]), ("selector_accepted", got["selector_acc"])):
                streaks[k] += float((v & m).long().cumprod(-1).sum(-1)[first].sum())
    n, b = counts.clamp_min(1), max(blocks, 1)
    return {"recall_at_k": (hits["recall_at_k"] / n).tolist(),
            **{k: {"acc": (hits[f"{k}_acc"] / n).tolist(), "accepted": streaks[f"{k}_accepted"] / b} for k in ("backbone", "selector")},
            "top_k": K, "blocks": blocks}
