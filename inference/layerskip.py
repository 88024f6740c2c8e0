"""Proposer for layer-skip self-speculation (Draft & Verify; SWIFT): the target itself drafts,
passing over the checkpoint's skip set, through the decoder's own KV cache
(:class:`~draftlab.inference.decoder.TargetSteps`).

Each draft depth is one forward of one input per row: the step's last token first (the cache
holds everything before it), then the draft above. The layers the draft runs read the target's
keys and values of the committed tokens and write their own for the drafts, which the decoder
drops when ``propose`` returns (the verify forward rewrites those slots with every layer).

- A chain of up to k: greedy drafts are the argmax (point masses); sampled drafts are drawn from
  ``sampling.probs`` of the draft logits and carry them (lossless).
- A dynamic tree (SWIFT's): at each depth the spine's top-1 token (the next forward's input) and
  its runners-up, all children of the spine's node above: 3, 5, 8 or 10 candidates (sampling 1,
  3, 5, 10) as the top-1 probability is above 0.95, 0.8, 0.5 or not, at most the shape's top-k,
  at most its total over the tree, its depth levels. Point masses, verified as any draft tree.

Draft exit (Draft & Verify, ``adaptive_exit``): a row's draft ends after a depth whose probability
(greedy and trees: the top-1 probability; a sampled chain: the drawn token's) is below the row's
threshold gamma. After each verify, with r = accepted depth / drafted depth: ``AR <- 0.5 AR +
0.5 r``; ``gamma' = gamma + 0.01`` if ``AR < 0.9``, else ``gamma - 0.01``, or ``gamma`` when the
draft ran to its full depth; ``gamma <- 0.9 gamma + 0.1 gamma'``. gamma starts at 0.8 (greedy) or
0.5 (sampling), AR at 0, with each generation. A chain shape's ``min_confidence`` stops a row
before the draft at which the product of its top-1 probabilities falls below it, as for the other
chain drafters.

Every row of a batch drafts in the same forwards (:class:`LayerSkipRows`); a row whose draft has
ended rides along until the last one ends.
"""

from __future__ import annotations

import torch

from draftlab.errors import DraftlabError
from draftlab.inference.proposer import PROPOSERS, BatchProposer, DraftsOnDevice, DraftsWithTarget, RowProposers, draft_vocab_size
from draftlab.inference.sampling import Sampling
from draftlab.inference.shapes import Chain, ChainDraft, DraftTree, DynamicTree
from draftlab.inference.spec_loop import DeviceDrafter
from draftlab.models.target import RaggedKVCache

# Draft & Verify's exit (``auto_parameters`` of dilab-zju/self-speculative-decoding)
EXIT_START = {True: 0.8, False: 0.5}  # gamma's start, by greedy
RATE_MOMENTUM = 0.5
RATE_GOAL = 0.9
EXIT_STEP = 0.01
EXIT_MOMENTUM = 0.9


@PROPOSERS.register("layerskip")
class LayerSkipProposer(BatchProposer, DraftsWithTarget, DraftsOnDevice):
    shapes = frozenset({"chain", "dynamic_tree"})
    layers = ()  # reads no hidden state: it runs the target

    def __init__(self, drafter, trained_depth: int | None = None):
        super().__init__(draft_vocab=draft_vocab_size(drafter), trained_depth=trained_depth)
        self.name = drafter.algorithm
        self.skip = frozenset(drafter.skip)
        self.adaptive_exit = drafter.adaptive_exit

    def rows(self, n: int) -> RowProposers:
        """Every row's drafts from the same forwards of the target (:class:`LayerSkipRows`)."""
        return LayerSkipRows(self, n)

    def refuses_on_device(self, shape) -> str | None:
        if self.adaptive_exit:
            return "its draft exit (adaptive_exit) ends each row's draft on its own"
        return super().refuses_on_device(shape)

    def on_device(self, rows: int, room: int, shape) -> "LayerSkipOnDevice":
        return LayerSkipOnDevice(self.skip)


class LayerSkipRows(RowProposers):
    """The rows of a batch: each row's last token (its next draft's first input), its last draft
    and its draft exit's state, in the order of the rows still decoding."""

    def __init__(self, proposer: LayerSkipProposer, n: int):
        super().__init__([])
        self.skip, self.adaptive = proposer.skip, proposer.adaptive_exit
        self.sampling = Sampling()
        self.steps = None
        self.last = [0] * n
        self.drafts: list[list[list[int]] | None] = [None] * n  # each row's last draft by depth, until its advance
        self.full: list[bool] = [False] * n  # whether that draft ran to its shape's depth
        self.threshold = [0.0] * n
        self.rate = [0.0] * n

    def configure(self, sampling: Sampling) -> None:
        self.sampling = sampling

    def use_target(self, steps) -> None:
        self.steps = steps

    def start(self, row, prompt_ids, hidden, next_token) -> None:
        self.last[row] = int(next_token)
        self.threshold[row], self.rate[row] = EXIT_START[self.sampling.greedy], 0.0

    def advance(self, accepted, hidden, rows) -> None:
        """Each row's kept tokens: its next first input, and the draft exit's update from the depth
        of its last draft they begin with (a correction never equals a draft it replaces)."""
        for r, a in zip(rows, accepted):
            tokens = a.reshape(-1).tolist()
            self.last[r] = tokens[-1]
            levels = self.drafts[r]
            if levels:
                n = 0  # the accepted depth: a kept token among its level's, on the spine to go deeper
                while n < min(len(levels), len(tokens) - 1) and tokens[n] in levels[n]:
                    n += 1
                    if tokens[n - 1] != levels[n - 1][0]:
                        break
                self._update_exit(r, n / len(levels))
            self.drafts[r] = None

    def _update_exit(self, r: int, accepted: float) -> None:
        self.rate[r] = RATE_MOMENTUM * self.rate[r] + (1 - RATE_MOMENTUM) * accepted
        gamma = self.threshold[r]
        moved = gamma if self.full[r] else gamma + EXIT_STEP if self.rate[r] < RATE_GOAL else gamma - EXIT_STEP
        self.threshold[r] = EXIT_MOMENTUM * gamma + (1 - EXIT_MOMENTUM) * moved

    def select(self, rows: list[int]) -> None:
        for name in ("last", "drafts", "full", "threshold", "rate"):
            setattr(self, name, [getattr(self, name)[r] for r in rows])

    @torch.no_grad()
    def propose(self, shape: Chain | DynamicTree) -> list[ChainDraft | DraftTree]:
        """One forward per draft depth for every row, fed each row's last draft (the spine)."""
        if self.steps is None:
            raise DraftlabError("drafter 'layerskip' drafts with the target through the decoder (DraftsWithTarget.use_target), "
                                "which the proposer wrapping it does not pass on (--lookup-min-match)")
        tree, greedy = isinstance(shape, DynamicTree), self.sampling.greedy
        R, depth = len(self.last), shape.max_depth
        device = self.steps.target.device
        inputs = torch.tensor(self.last, dtype=torch.long, device=device)[:, None]
        ends = [depth] * R  # each row's number of levels
        room = [shape.max_nodes] * R  # tree nodes each row may still add
        confidence = torch.ones(R, device=device)
        levels: list[list[list[int]]] = [[] for _ in range(R)]  # per row and depth: the spine's token first
        probs = []
        for j in range(depth):
            logits = self.steps.forward(inputs, skip=self.skip, logits="last").logits[:, -1].float()
            top1 = (logits.max(-1).values - logits.logsumexp(-1)).exp()
            if not tree and shape.min_confidence > 0:  # stop before the draft at which the product falls below it
                confidence = confidence * top1
                for r in (confidence < shape.min_confidence).nonzero().flatten().tolist():
                    ends[r] = min(ends[r], j)
            if tree:  # SWIFT: the spine's top-1 and its runners-up, more of them where the top-1 is less sure
                wide = [min(swift_width(float(p), greedy), shape.top_k, max(room[r], 1)) for r, p in enumerate(top1.tolist())]
                ranked = logits.topk(max(wide), dim=-1).indices
                tok, p = ranked[:, 0], top1
                for r in range(R):
                    levels[r].append(ranked[r, : wide[r]].tolist())
                    room[r] -= wide[r]
                    if room[r] <= 0:
                        ends[r] = min(ends[r], j + 1)
            elif greedy:
                tok, p = logits.argmax(-1), top1
            else:
                q = self.sampling.probs(logits)
                tok = self.sampling.sample(q)
                p = q.gather(-1, tok[:, None])[:, 0]
                probs.append(q)
            if not tree:
                for r, t in enumerate(tok.tolist()):
                    levels[r].append([t])
            if self.adaptive:  # Draft & Verify: the draft below the threshold is the last
                for r in (p < torch.tensor(self.threshold, device=device)).nonzero().flatten().tolist():
                    ends[r] = min(ends[r], j + 1)
            if all(e <= j + 1 for e in ends):
                break
            inputs = tok[:, None]
        q = torch.stack(probs, 1) if probs else None
        out = []
        for r in range(R):
            self.drafts[r], self.full[r] = levels[r][: ends[r]], ends[r] == depth
            if tree:
                out.append(_tree(self.drafts[r], device))
            else:
                chain = torch.tensor([t for t, in self.drafts[r]], dtype=torch.long, device=device)
                out.append(ChainDraft(chain, None if q is None else q[r, : ends[r]]))
        return out


def swift_width(top1: float, greedy: bool) -> int:
    """SWIFT's candidates at a depth of its tree, by the spine's top-1 probability there."""
    for above, wide in zip((0.95, 0.8, 0.5), (3, 5, 8) if greedy else (1, 3, 5)):
        if top1 > above:
            return wide
    return 10


def _tree(levels: list[list[int]], device) -> DraftTree:
    """The tree of ``levels`` (per depth, its nodes' tokens, the spine's first): every node of a
    depth is a child of the spine's node at the depth above (the root at depth 1)."""
    tokens, parents, depth = [], [], []
    for d, level in enumerate(levels):
        parent = 0 if d == 0 else len(tokens) - len(levels[d - 1]) + 1  # the node id of the spine above
        tokens += level
        parents += [parent] * len(level)
        depth += [d + 1] * len(level)
    as_long = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731
    return DraftTree(as_long(tokens), as_long(parents), as_long(depth))


class LayerSkipOnDevice(DeviceDrafter):
    """Greedy chains drafted by the target itself over the loop's own cache, passing over the
    skip set: depth j writes its layers' K/V at each row's length + j, which the verify forward
    then rewrites with every layer. No state of its own."""

    def __init__(self, skip: frozenset[int]):
        self.skip = skip

    def bind(self, loop) -> None:
        self.loop = loop

    def start(self, row, prompt_ids, hidden, next_token) -> None:
        pass

    def draft(self, b: int, k: int) -> torch.Tensor:
        loop = self.loop
        cache = RaggedKVCache(loop.cache.k[:, :b], loop.cache.v[:, :b], [], static=True)
        S, tok, out = cache.max_len, loop.last[:b], []
        for j in range(k):
            step = RaggedKVCache.layout(loop.lengths[:b] + j, 1, None, None, S, [(0, b, S)])
            logits = loop.target.forward_step(tok[:, None], cache, step, (), "last", self.skip).logits[:, -1]
            tok = logits.max(-1).indices
            out.append(tok)
        return torch.stack(out, 1)

    def extend(self, b, tokens, hidden, counts) -> None:
        pass

    def select(self, index) -> None:
        pass
