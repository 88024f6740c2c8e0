"""Proposer for Medusa drafters: each head's top-1 as a chain, or each head's top-K filled into a
static (Medusa-choices) tree.

Every draft comes from one row, the target's last kept hidden state (head i guesses the token
i + 2 after it, the target's own bonus token being the first): a step is one pass of the heads
over that row, and nothing else is carried between steps. Tokens are picked deterministically
(top-1 / top-K), so drafts are point masses (``probs=None``): greedy and sampled verification
both stay lossless.
"""

from __future__ import annotations

import torch

from draftlab.inference.proposer import PROPOSERS, DraftsOnDevice, Proposer, RowProposers, draft_vocab_size
from draftlab.inference.shapes import Chain, ChainDraft, DraftTree, OptionError, StaticTree, check_decoding
from draftlab.inference.spec_loop import DeviceDrafter
from draftlab.kernels.cpu_gemm import decoding_copy


@PROPOSERS.register("medusa")
class MedusaProposer(Proposer, DraftsOnDevice):
    shapes = frozenset({"chain", "static_tree"})

    def __init__(self, drafter, trained_depth: int | None = None):
        super().__init__(draft_vocab=draft_vocab_size(drafter), trained_depth=trained_depth)
        # A frozen copy whose linears run the 1-row products of decoding on the CPU's faster GEMM
        # (kernels/cpu_gemm.py); the target's lm_head the drafter references is not copied.
        self.drafter = decoding_copy(drafter.eval())
        self.name = drafter.algorithm
        self.layers = tuple(drafter.capture_layers)

    def start(self, prompt_ids, hidden, next_token):
        self._keep(hidden)

    def advance(self, accepted, hidden):
        self._keep(hidden)

    def _keep(self, hidden):
        # the last kept input's state: its target output is the token the drafts follow
        self.last = hidden[self.drafter.num_target_layers][:, -1]  # [1, H]

    def propose(self, shape: Chain | StaticTree) -> ChainDraft | DraftTree:
        return self.draft(self.last, shape)[0]

    def refuses_on_device(self, shape) -> str | None:
        heads = self.drafter.num_heads
        if isinstance(shape, Chain):
            return f"k={shape.k}: its {heads} Medusa heads draft {heads} tokens a step" if shape.k > heads else None
        return None if isinstance(shape, StaticTree) else super().refuses_on_device(shape)

    def on_device(self, rows: int, room: int, shape) -> "MedusaOnDevice":
        if isinstance(shape, StaticTree):
            self.check(shape, self.drafter)
        return MedusaOnDevice(self.drafter, rows)

    def batched(self, n: int, shape) -> RowProposers:
        """Every row's drafts from one pass of each head over all rows' states (:class:`MedusaRows`)."""
        return MedusaRows(self, n)

    @torch.no_grad()
    def draft(self, last: torch.Tensor, shape: Chain | StaticTree) -> list[ChainDraft | DraftTree]:
        """The drafts of rows whose last kept states are ``last`` [n, H]."""
        if isinstance(shape, Chain):
            return self._chains(last, shape.k, shape.min_confidence)
        return self._static_trees(last, shape)

    def _chains(self, last: torch.Tensor, k: int, min_confidence: float) -> list[ChainDraft]:
        """Head i's top-1 for the i-th draft, i < min(k, num_heads). With ``min_confidence``,
        stop before the draft at which the product of the heads' top-1 probabilities falls below
        it (the chain's dynamic length, as for EAGLE)."""
        d = self.drafter
        heads = min(k, d.num_heads)
        if heads == 0:
            return [ChainDraft(torch.zeros(0, dtype=torch.long, device=last.device), None) for _ in range(last.shape[0])]
        logits = torch.stack([d.head_logits(last, i) for i in range(heads)], dim=1)  # [n, heads, V_draft]
        top = logits.max(-1)
        lengths = [heads] * last.shape[0]
        if min_confidence > 0:  # top-1 probability = exp(max logit - logsumexp)
            confidence = (top.values.float() - logits.float().logsumexp(-1)).exp().cumprod(-1)  # [n, heads]
            lengths = (confidence >= min_confidence).cumprod(-1).sum(-1).tolist()
        tokens = d.to_target_ids(top.indices)
        return [ChainDraft(tokens[r, :n], None) for r, n in enumerate(lengths)]

    @classmethod
    def check(cls, shape, drafter) -> None:
        """A static tree no deeper than the heads and no wider than the draft vocabulary."""
        if isinstance(shape, StaticTree) and shape.max_depth > drafter.num_heads:
            D, H = shape.max_depth, drafter.num_heads
            raise OptionError("static_tree", f"paths of depth {D} need {D} Medusa heads: this drafter has {H}",
                              f"static tree: depth {D} needs {D} Medusa heads, this drafter has {H}")
        if isinstance(shape, StaticTree):
            check_decoding(shape, draft_vocab=drafter.draft_vocab_size)

    def _static_trees(self, last: torch.Tensor, shape: StaticTree) -> list[DraftTree]:
        """Depth d of the tree is head d - 1's guess: a node of rank r holds that head's r-th
        most likely token, whatever its parent (Medusa's Cartesian candidates)."""
        d = self.drafter
        self.check(shape, d)
        ranked = torch.stack([d.head_logits(last, i).topk(shape.max_rank).indices for i in range(shape.max_depth)], dim=1)
        return [shape.draft(d.to_target_ids(r)) for r in ranked]  # ranked: [n, depth, rank]


class MedusaRows(RowProposers):
    """The rows of a batch: each keeps its own last state; a step runs each head once over all
    rows (row by row, a batch of B would run B times as many small products)."""

    def __init__(self, proposer: MedusaProposer, n: int):
        super().__init__([proposer.fork() for _ in range(n)])
        self.proposer = proposer

    def propose(self, shape: Chain | StaticTree) -> list[ChainDraft | DraftTree]:
        return self.proposer.draft(torch.cat([p.last for p in self.rows]), shape)


class MedusaOnDevice(DeviceDrafter):
    """Each row's last kept hidden state in a static buffer; a chain is the heads' top-1 over it."""

    def __init__(self, drafter, rows: int):
        p = drafter.lm_heads[0].weight  # (a decoding copy's linears hold no parameters)
        self.drafter = drafter
        self.last = torch.zeros(rows, drafter.hidden_size, dtype=p.dtype, device=p.device)

    def start(self, row, prompt_ids, hidden, next_token) -> None:
        self.last[row] = hidden[self.drafter.num_target_layers][0, -1]

    def draft(self, b: int, k: int) -> torch.Tensor:
        d = self.drafter
        return torch.stack([d.to_target_ids(d.head_logits(self.last[:b], i).max(-1).indices) for i in range(k)], 1)

    def draft_tree(self, b: int, shape: StaticTree):
        """Depth d's nodes hold head d - 1's ranked tokens (Medusa's Cartesian candidates)."""
        d, dev = self.drafter, self.last.device
        ranked = torch.stack([d.head_logits(self.last[:b], i).topk(shape.max_rank).indices for i in range(shape.max_depth)], 1)
        tokens = d.to_target_ids(ranked[:, shape.depth.to(dev) - 1, shape.rank.to(dev)])
        return tokens, shape.parents.to(dev).expand(b, -1)

    def extend(self, b, tokens, hidden, counts) -> None:
        h = hidden[self.drafter.num_target_layers]
        self.last[:b] = h[torch.arange(b, device=h.device), (counts - 1).clamp(min=0)]

    def select(self, index) -> None:
        self.last[: index.numel()] = self.last[index]
