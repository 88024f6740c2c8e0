"""Proposer for independent draft models (Leviathan et al.): a small causal LM of the target's
architecture and vocabulary that drafts from tokens alone, with its own KV cache.

The draft LM runs as a :class:`~draftlab.models.target.Target` (fused linears, the CPU's
small-row GEMM plan, the ragged KV cache), one cache row per sequence. Per row the cache holds
the committed tokens, and ``pending`` the committed tokens it does not hold yet (at least the
last one, whose next token the draft follows). A step feeds the pending tokens, then drafts:

- a chain: one forward per draft position for every row; greedy drafts are the argmax (point
  masses), sampled ones are drawn from ``sampling.probs`` of the draft logits and carry them;
- a tree (the EAGLE-2 dynamic tree or a static tree of candidate ranks, each node's children
  being its most likely next tokens, as in SpecInfer): one forward per level for every row,
  each node attending to the committed prefix, its ancestors and itself.

The drafts' keys and values stay in the cache until ``advance``: the slots of the drafts the
target kept are moved to follow the committed prefix, the rest are dropped. One code path
serves a single sequence (a batch of one) and a batch (:class:`DraftLMRows`).
"""

from __future__ import annotations

import copy
import math

import torch

from draftlab.inference.proposer import PROPOSERS, BatchProposer, DraftsOnDevice, OwnModel, RowProposers, draft_vocab_size
from draftlab.inference.sampling import Sampling
from draftlab.inference.shapes import Chain, ChainDraft, DraftTree, DynamicTree, StaticTree
from draftlab.inference.spec_loop import DeviceDrafter, grow_dynamic_tree, tree_nodes
from draftlab.models.target import CacheStep, RaggedKVCache, Target

# Cache slots allocated beyond the longest prompt; the cache doubles when a row needs more.
ROOM = 256


@PROPOSERS.register("draft_lm")
class DraftLMProposer(BatchProposer, OwnModel, DraftsOnDevice):
    shapes = frozenset({"chain", "dynamic_tree", "static_tree"})
    layers = ()  # drafts from tokens alone

    def __init__(self, drafter, trained_depth: int | None = None):
        super().__init__(draft_vocab=draft_vocab_size(drafter), trained_depth=trained_depth)
        self.name = drafter.algorithm
        # A copy: Target freezes the model it wraps and fuses its linears in place, and the
        # drafter given may still be training.
        self.lm = Target(copy.deepcopy(drafter.lm), None, {"name": drafter.algorithm})
        self.cache_bytes_per_token = self.lm.kv_bytes_per_token

    def use_graphs(self, wrap) -> None:
        self.lm = wrap(self.lm)

    def rows(self, n: int) -> RowProposers:
        """Every row's drafts from one draft-LM forward per draft position (:class:`DraftLMRows`)."""
        return DraftLMRows(self, n)

    def refuses_on_device(self, shape) -> str | None:
        if isinstance(shape, DynamicTree) and tree_nodes(shape, self.draft_vocab) < shape.total_tokens:
            return f"a tree of depth {shape.max_depth} grows {tree_nodes(shape, self.draft_vocab)} nodes, fewer than tree.total_tokens"
        return None if isinstance(shape, DynamicTree) else super().refuses_on_device(shape)

    def on_device(self, rows: int, room: int, shape) -> "DraftLMOnDevice":
        return DraftLMOnDevice(getattr(self.lm, "target", self.lm), rows, room)


class DraftLMRows(RowProposers):
    """The rows of a batch in one ragged draft-LM cache. Each forward feeds every cache row
    (rows with fewer inputs are padded, their padding slots cropped or never attended to);
    rows that leave are dropped from the cache at once (:meth:`select`)."""

    def __init__(self, proposer: DraftLMProposer, n: int):
        super().__init__([])
        self.lm, self.n = proposer.lm, n
        self.sampling = Sampling()
        self.cache = None
        self.live = list(range(n))  # the cache row of each row still decoding
        # per cache row: committed slots, committed tokens not yet fed, and the slot of each
        # draft fed since the last advance, by its path of tokens from the last committed one
        self.committed = [0] * n
        self.pending: list[list[int]] = [[] for _ in range(n)]
        self.fed: list[dict[tuple[int, ...], int]] = [{} for _ in range(n)]
        self._starts: dict[int, tuple[torch.Tensor, int]] = {}

    def configure(self, sampling: Sampling) -> None:
        self.sampling = sampling

    # ---- committed state ---------------------------------------------------------------
    def start(self, row, prompt_ids, hidden, next_token) -> None:
        self._starts[row] = (prompt_ids.reshape(-1), int(next_token))
        if len(self._starts) == self.n:
            self._prefill([self._starts[r] for r in range(self.n)])
            self._starts = {}

    @torch.no_grad()
    def _prefill(self, rows: list[tuple[torch.Tensor, int]]) -> None:
        """Each prompt through the draft LM alone, into its own cache row (no padding)."""
        self.cache = self.lm.new_cache(self.n, max(p.numel() for p, _ in rows) + ROOM, ragged=True)
        for s, (prompt, nxt) in enumerate(rows):
            self.lm(prompt.to(self.lm.device)[None], cache=self.cache.row(s), logits=None)
            self.cache.lengths[s] = self.committed[s] = prompt.numel()
            self.pending[s] = [nxt]

    def advance(self, accepted, hidden, rows) -> None:
        """Keep the fed drafts on each row's kept path (its kept tokens but the last, which the
        next draft follows); the rest of the kept tokens wait in ``pending``."""
        lengths = list(self.cache.lengths)
        for r, a in zip(rows, accepted):
            s, tokens = self.live[r], a.reshape(-1).tolist()
            slots: list[int] = []
            while len(slots) < len(tokens) - 1 and (slot := self.fed[s].get(tuple(tokens[: len(slots) + 1]))) is not None:
                slots.append(slot)
            c = self.committed[s]
            if slots != list(range(c, c + len(slots))):  # a tree path: move its slots after the prefix
                self.cache.keep([c], [torch.tensor(slots, device=self.lm.device)], [s])
            lengths[s] = self.committed[s] = c + len(slots)
            self.pending[s] += tokens[len(slots):]
            self.fed[s] = {}
        self.cache.crop(lengths)

    def select(self, rows: list[int]) -> None:
        keep = [self.live[r] for r in rows]
        order = sorted(keep)
        self.cache.select(order)
        self.committed, self.pending, self.fed = ([x[s] for s in order] for x in (self.committed, self.pending, self.fed))
        self.live = [order.index(s) for s in keep]

    # ---- forwards ----------------------------------------------------------------------
    def _forward(self, ids: torch.Tensor, **kw):
        """The draft LM over ``ids`` [cache rows, T] with the cache, grown first if a row needs
        more slots than it has."""
        c = self.cache
        need = max(c.lengths) + ids.shape[1]
        if need > c.max_len:
            grown = self.lm.new_cache(c.batch_size, max(need, 2 * c.max_len), ragged=True)
            used = max(c.lengths)
            grown.k[:, :, :, :used], grown.v[:, :, :, :used] = c.k[:, :, :, :used], c.v[:, :, :, :used]
            grown.lengths = list(c.lengths)
            self.cache = c = grown
        return self.lm(ids, cache=c, **kw)

    def _feed_pending(self) -> torch.Tensor:
        """Feed each row's pending tokens (one forward, padded to the most); the logits [cache
        rows, V] of each row's next token. The fed tokens become committed."""
        counts = [len(p) for p in self.pending]
        dev = self.lm.device
        ids = torch.zeros(len(counts), max(counts), dtype=torch.long, device=dev)
        for s, p in enumerate(self.pending):
            ids[s, : len(p)] = torch.tensor(p, device=dev)
        L = self.lm.num_layers
        before = list(self.cache.lengths)
        h = self._forward(ids, layers=[L], logits=None).hidden[L]
        last = h[torch.arange(len(counts), device=dev), torch.tensor(counts, device=dev) - 1]
        self.committed = [n + c for n, c in zip(before, counts)]
        self.cache.crop(list(self.committed))  # the padding slots
        self.pending = [[] for _ in counts]
        return self.lm.shared_lm_head(last)

    # ---- drafts ------------------------------------------------------------------------
    @torch.no_grad()
    def propose(self, shape) -> list[ChainDraft | DraftTree]:
        logits = self._feed_pending()
        if isinstance(shape, Chain):
            return self._chains(logits, shape)
        return self._trees(logits, shape)

    def _chains(self, logits: torch.Tensor, shape: Chain) -> list[ChainDraft]:
        """Every row's chain of ``shape.k``. With ``min_confidence`` each row stops before the
        draft at which the product of the draft's top-1 probabilities drops below it (rows
        that stopped ride along in the batched forwards)."""
        B, k, greedy = logits.shape[0], shape.k, self.sampling.greedy
        stop = [k] * B
        confidence = torch.ones(B, device=logits.device)
        tokens, probs = [], []
        for j in range(k):
            if shape.min_confidence > 0:  # top-1 probability = exp(max logit - logsumexp)
                confidence = confidence * (logits.max(-1).values.float() - logits.float().logsumexp(-1)).exp()
                for s in (confidence < shape.min_confidence).nonzero().flatten().tolist():
                    stop[s] = min(stop[s], j)
                if all(n < k for n in stop):
                    break
            if greedy:
                tok = logits.max(-1).indices
            else:
                q = self.sampling.probs(logits)
                tok = self.sampling.sample(q)
                probs.append(q)
            tokens.append(tok)
            if j + 1 < k:
                slots = list(self.cache.lengths)
                logits = self._forward(tok[:, None], logits="last").logits[:, -1]
                paths = torch.stack(tokens, 1).tolist()
                for s in range(B):
                    self.fed[s][tuple(paths[s])] = slots[s]
        dev = logits.device
        tokens = torch.stack(tokens, 1) if tokens else torch.zeros(B, 0, dtype=torch.long, device=dev)
        probs = torch.stack(probs, 1) if probs else None
        return [ChainDraft(tokens[s, : stop[s]], None if probs is None else probs[s, : stop[s]]) for s in self.live]

    def _trees(self, logits: torch.Tensor, shape: DynamicTree | StaticTree) -> list[DraftTree]:
        """Every row's tree, one level per forward: the level's expanded nodes of every row
        (padded to the widest), each at position prefix + depth - 1, attending to its row's
        committed prefix, its ancestors' slots and its own."""
        grow = _DynamicTreeRow if isinstance(shape, DynamicTree) else _StaticTreeRow
        trees = [grow(shape, lp) for lp in logits.float().log_softmax(-1)]
        dev = logits.device
        depth = 1
        while any(t.frontier for t in trees):
            W = max(len(t.frontier) for t in trees)
            lengths = list(self.cache.lengths)
            span = max(lengths) + W
            ids = torch.zeros(len(trees), W, dtype=torch.long, device=dev)
            offsets = torch.zeros(len(trees), W, dtype=torch.long, device=dev)
            mask = torch.zeros(len(trees), W, span, dtype=torch.bool)
            for s, t in enumerate(trees):
                mask[s, :, : self.committed[s]] = True
                offsets[s] = self.committed[s] + depth - 1 - lengths[s]
                for r, i in enumerate(t.frontier):
                    ids[s, r] = t.tok[i]
                    a = t.parent[i]
                    while a >= 0:
                        mask[s, r, t.slot[a]] = True
                        a = t.parent[a]
                    t.slot[i] = lengths[s] + r
                    self.fed[s][t.path(i)] = lengths[s] + r
                mask[s, torch.arange(W), lengths[s] + torch.arange(W)] = True  # padding sees its own slot
            out = self._forward(ids, position_ids=offsets, attn_mask=mask.to(dev), logits="all").logits
            lp = out.float().log_softmax(-1)
            for s, t in enumerate(trees):
                if t.frontier:
                    t.grow(lp[s, : len(t.frontier)])
            depth += 1
        return [trees[s].draft(dev) for s in self.live]


class _TreeRow:
    """One row's tree as it grows: nodes ``tok`` / ``parent`` (-1: the root) / ``depth``, the
    nodes to expand at the next level (``frontier``, all of one depth) and each expanded
    node's cache slot."""

    def __init__(self):
        self.tok: list[int] = []
        self.parent: list[int] = []
        self.depth: list[int] = []
        self.frontier: list[int] = []
        self.slot: dict[int, int] = {}

    def path(self, i: int) -> tuple[int, ...]:
        """The tokens from the root's first child down to node ``i``."""
        out = []
        while i >= 0:
            out.append(self.tok[i])
            i = self.parent[i]
        return tuple(reversed(out))

    def grow(self, lp: torch.Tensor) -> None:
        """Add the children of the frontier from its nodes' next-token log-probs [n, V], and
        choose the next frontier."""
        raise NotImplementedError

    def draft(self, device) -> DraftTree:
        raise NotImplementedError


class _DynamicTreeRow(_TreeRow):
    """The EAGLE-2 dynamic tree, as the EAGLE proposer grows it: the root's top-k children,
    then at each depth the k best frontier nodes by cumulative log-prob expanded into their
    top-k children; the ``total_tokens`` best nodes are kept. A candidate below the pool's
    ``total_tokens``-th best score can never be kept, nor its descendants: it is dropped."""

    def __init__(self, shape: DynamicTree, lp: torch.Tensor):
        super().__init__()
        self.total, self.max_depth = shape.total_tokens, shape.max_depth
        self.k = min(shape.top_k, shape.total_tokens, lp.numel())
        score, ids = lp.topk(self.k)
        self.tok, self.parent, self.depth, self.score = ids.tolist(), [-1] * self.k, [1] * self.k, score.tolist()
        self.best = score  # the pool's best scores, at most ``total`` of them
        self.frontier = list(range(self.k)) if self.max_depth > 1 else []

    def grow(self, lp):
        k = self.k
        clp, cid = lp.topk(k, dim=-1)  # [n, k]
        cum = torch.tensor([self.score[i] for i in self.frontier], device=lp.device)[:, None] + clp
        flat = cum.flatten()
        self.best = torch.cat([self.best, flat]).topk(min(self.total, self.best.numel() + flat.numel())).values
        floor = float(self.best[-1]) if self.best.numel() == self.total else -math.inf
        keep = (flat >= floor).tolist()
        d = self.depth[self.frontier[0]] + 1
        pool_of: dict[int, int] = {}  # candidate (row-major in cum) -> its node index
        cid, scores = cid.flatten().tolist(), flat.tolist()
        for c, ok in enumerate(keep):
            if ok:
                pool_of[c] = len(self.tok)
                self.tok.append(cid[c])
                self.parent.append(self.frontier[c // k])
                self.depth.append(d)
                self.score.append(scores[c])
        chosen = [int(b) for b in flat.topk(min(k, flat.numel())).indices if keep[int(b)]]
        self.frontier = [pool_of[b] for b in chosen] if d < self.max_depth else []

    def draft(self, device) -> DraftTree:
        # best-first by cumulative log-prob (ties: shallower first, so a parent always comes
        # before its children); a node joins only after its parent, keeping the tree closed
        kept: set[int] = set()
        for i in sorted(range(len(self.tok)), key=lambda i: (-self.score[i], self.depth[i])):
            if len(kept) == self.total:
                break
            if self.parent[i] < 0 or self.parent[i] in kept:
                kept.add(i)
        order = sorted(kept, key=lambda i: (self.depth[i], -self.score[i]))
        node_of = {i: n + 1 for n, i in enumerate(order)}  # node 0 is the root
        as_long = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731
        return DraftTree(as_long([self.tok[i] for i in order]), as_long([node_of.get(self.parent[i], 0) for i in order]),
                         as_long([self.depth[i] for i in order]))


class _StaticTreeRow(_TreeRow):
    """A static tree: a node of rank r is its parent's r-th most likely next token, so every
    node with children is expanded once."""

    def __init__(self, shape: StaticTree, lp: torch.Tensor):
        super().__init__()
        self.shape = shape
        self.parent = (shape.parents - 1).tolist()  # node i + 1 -> index i; the root is -1
        self.depth, self.rank = shape.depth.tolist(), shape.rank.tolist()
        self.width: dict[int, int] = {}  # node (-1: the root) -> candidates its children need
        for i, p in enumerate(self.parent):
            self.width[p] = max(self.width.get(p, 0), self.rank[i] + 1)
        self.tok = [0] * len(self.parent)
        self._fill(1, lp[None], [-1])

    def _fill(self, d: int, lp: torch.Tensor, parents: list[int]) -> None:
        """Rank the next tokens of ``parents`` (their log-probs ``lp``), fill depth ``d``'s
        tokens and make its nodes with children the frontier."""
        top = lp.topk(max(self.width[p] for p in parents), dim=-1).indices.tolist()
        ranked = dict(zip(parents, top))
        level = [i for i, n in enumerate(self.depth) if n == d]
        for i in level:
            self.tok[i] = ranked[self.parent[i]][self.rank[i]]
        self.frontier = [i for i in level if i in self.width]

    def grow(self, lp):
        self._fill(self.depth[self.frontier[0]] + 1, lp, self.frontier)

    def draft(self, device) -> DraftTree:
        return DraftTree(torch.tensor(self.tok, dtype=torch.long, device=device), self.shape.parents.to(device),
                         self.shape.depth.to(device))


class DraftLMOnDevice(DeviceDrafter):
    """Greedy chains of every row over a static draft-LM cache written at each row's length (the
    device loop's drafter): drafting writes speculative slots past a row's length, the next
    ``extend`` overwrites them with the kept tokens. Drafts are argmax tokens, point masses, also
    when the decoding samples (lossless either way)."""

    def __init__(self, lm: Target, rows: int, room: int):
        self.lm = lm
        self.cache = lm.new_cache(rows, room, static=True)
        self.lengths = torch.zeros(rows, 1, dtype=torch.long, device=lm.device)
        self.logits = torch.zeros(rows, lm.vocab_size, dtype=lm.dtype, device=lm.device)  # each row's next-token logits

    def _hidden(self, b: int, ids, lengths) -> torch.Tensor:
        cache = RaggedKVCache(self.cache.k[:, :b], self.cache.v[:, :b], [], static=True)
        S, L = cache.max_len, self.lm.num_layers
        step = RaggedKVCache.layout(lengths, ids.shape[1], None, None, S, [(0, b, S)])
        return self.lm.forward_step(ids, cache, step, layers=[L], logits=None).hidden[L]

    @torch.no_grad()
    def start(self, row, prompt_ids, hidden, next_token) -> None:
        ids = torch.cat([prompt_ids.reshape(-1), next_token.reshape(1)])[None]
        self.logits[row] = self.lm(ids, cache=self.cache.row(row), logits="last").logits[0, -1]
        self.lengths[row] = ids.shape[1]

    def draft(self, b: int, k: int) -> torch.Tensor:
        tok = self.logits[:b].max(-1).indices
        out = [tok]
        for j in range(1, k):
            h = self._hidden(b, tok[:, None], self.lengths[:b] + j - 1)
            tok = self.lm.shared_lm_head(h[:, -1]).max(-1).indices
            out.append(tok)
        return torch.stack(out, 1)

    def draft_tree(self, b: int, shape: DynamicTree):
        """EAGLE-2's dynamic tree (:func:`grow_dynamic_tree`): one draft-LM forward per depth over
        the frontier, written past the row's length, each node seeing the committed prefix, its
        ancestors' slots and itself."""
        dev, S, L = self.lengths.device, self.cache.max_len, self.lm.num_layers
        cache = RaggedKVCache(self.cache.k[:, :b], self.cache.v[:, :b], [], static=True)
        committed, span, seen = self.lengths[:b], torch.arange(S, device=dev), [None]

        def expand(depth, tok, parent):
            K = tok.shape[1]
            was = torch.zeros(b, K, S, dtype=torch.bool, device=dev) if parent is None else seen[0].gather(1, parent[..., None].expand(-1, -1, S))
            slots = committed + (depth - 1) * K + torch.arange(K, device=dev)
            seen[0] = was | (span == slots[..., None])
            step = CacheStep(committed + depth - 1 + 0 * slots, (span < committed[..., None]) | seen[0], slots, [(0, b, S)])
            h = self.lm.forward_step(tok, cache, step, layers=[L], logits=None).hidden[L]
            return self.lm.shared_lm_head(h).float().log_softmax(-1)

        return grow_dynamic_tree(self.logits[:b].float().log_softmax(-1), shape, expand)

    def extend(self, b, tokens, hidden, counts) -> None:
        h = self._hidden(b, tokens, self.lengths[:b])
        self.logits[:b] = self.lm.shared_lm_head(h[torch.arange(b, device=h.device), (counts - 1).clamp(min=0)])
        self.lengths[:b] += counts[:, None]

    def select(self, index) -> None:
        n = index.numel()
        for buf in (self.cache.k, self.cache.v):
            buf[:, :n] = buf[:, index]
        for t in (self.lengths, self.logits):
            t[:n] = t[index]
