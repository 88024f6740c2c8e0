"""Proposer for EAGLE-1 and EAGLE-3 drafters: chains, the EAGLE-2 dynamic tree and EAGLE-1's
static tree.

The drafter keeps its own KV cache of *committed* positions, built from the target's real
features. Drafting appends speculative positions (fed the drafter's own output features) and
crops them away afterwards; ``advance`` then re-runs the accepted tokens with the target's
real features, as EAGLE does. Both trees are drafted level by level through
:meth:`EagleProposer._draft_level`: one drafter forward per depth over that depth's nodes,
each attending to the committed prefix, its ancestors' speculative positions and itself.
"""

from __future__ import annotations

import math

import torch

from draftlab.inference.proposer import PROPOSERS, DraftsOnDevice, Proposer, RowProposers, draft_vocab_size
from draftlab.inference.shapes import Chain, ChainDraft, DraftTree, DynamicTree, StaticTree, check_decoding
from draftlab.inference.spec_loop import DeviceDrafter, grow_dynamic_tree, tree_nodes
from draftlab.kernels.cpu_gemm import decoding_copy
from draftlab.models.target import CacheStep, RaggedKVCache


@PROPOSERS.register("eagle1", "eagle3")
class EagleProposer(Proposer, DraftsOnDevice):
    shapes = frozenset({"chain", "dynamic_tree", "static_tree"})

    def __init__(self, drafter, trained_depth: int | None = None):
        super().__init__(draft_vocab=draft_vocab_size(drafter), trained_depth=trained_depth)
        # A frozen copy whose linears run the few-row products of decoding on the CPU's faster GEMM
        # (kernels/cpu_gemm.py).
        self.drafter = decoding_copy(drafter.eval())
        self.name = drafter.algorithm
        self.layers = tuple(drafter.capture_layers)

    def batched(self, n: int, shape) -> RowProposers:
        """Chains of every row from one drafter forward per draft position (:class:`EagleChains`);
        trees row by row."""
        return EagleChains(self, n) if isinstance(shape, Chain) else super().batched(n, shape)

    def refuses_on_device(self, shape) -> str | None:
        if not isinstance(shape, DynamicTree):
            return super().refuses_on_device(shape)
        grown = tree_nodes(shape, self.draft_vocab)
        if grown < shape.total_tokens:  # a tree of static shape keeps exactly total_tokens nodes
            return (f"a tree of depth {shape.max_depth} and top-k {min(shape.top_k, shape.total_tokens)} grows {grown} nodes, "
                    f"fewer than tree.total_tokens={shape.total_tokens}")
        return None

    def on_device(self, rows: int, room: int, shape) -> "EagleOnDevice":
        return EagleOnDevice(self.drafter, rows, room)

    def propose(self, shape):
        if isinstance(shape, Chain):
            return self._chain(shape.k, shape.min_confidence)
        if isinstance(shape, DynamicTree):
            return self._dynamic_tree(shape)
        return self._static_tree(shape)

    # ---- committed state ---------------------------------------------------------
    @torch.no_grad()
    def start(self, prompt_ids, hidden, next_token):
        self.cache = self.drafter.new_cache()
        self.pos = 0
        prompt_ids = prompt_ids.view(1, -1)
        nxt = torch.tensor([[next_token]], device=prompt_ids.device)
        # position t pairs token x_{t+1} with the target feature f_t
        self._extend(torch.cat([prompt_ids[:, 1:], nxt], dim=1), hidden)

    @torch.no_grad()
    def advance(self, accepted, hidden):
        self._extend(accepted.view(1, -1), hidden)

    def _extend(self, tokens, hidden):
        n = tokens.shape[1]
        positions = torch.arange(self.pos, self.pos + n, device=tokens.device)[None]
        h, _ = self.drafter.draft_step(tokens, self.drafter.features(hidden), positions, self.cache, logits=False)
        self.pos += n
        self.last_h = h[:, -1:]
        self.last_logits = self.drafter.head(self.last_h)[0, -1]

    # ---- chain -------------------------------------------------------------------------
    @torch.no_grad()
    def _chain(self, k: int, min_confidence: float) -> ChainDraft:
        """Greedy drafts. Dynamic draft length: stop before the draft at which the product of the
        drafter's top-1 probabilities drops below ``min_confidence``. A low-confidence step then
        costs a 1-token target forward instead of a (k+1)-token verify that would likely accept
        nothing, which pays where verifying is much dearer than one token."""
        committed = self.cache.length
        h, logits = self.last_h, self.last_logits
        out = []
        confidence = 1.0
        for j in range(k):
            top = logits.max(-1, keepdim=True)
            if min_confidence > 0:  # top-1 probability = exp(max logit - logsumexp)
                confidence *= float((top.values.float() - logits.float().logsumexp(-1)).exp())
                if confidence < min_confidence:
                    break
            tok = self.drafter.to_target_ids(top.indices)
            out.append(tok)
            if j + 1 < k:
                pos = torch.full((1, 1), self.pos + j, device=tok.device)
                h, lg = self.drafter.draft_step(tok.view(1, 1), h, pos, self.cache, depth=j + 1)
                logits = lg[0, -1]
        self.cache.crop(committed)
        tokens = torch.cat(out) if out else torch.zeros(0, dtype=torch.long, device=logits.device)
        return ChainDraft(tokens, None)  # greedy drafts = point-mass proposals

    # ---- trees, level by level ---------------------------------------------------------
    def _draft_level(self, frontier: list[int], tok: list[int], parent: list[int], slot: dict[int, int], feats,
                     depth: int, committed: int):
        """Run the nodes ``frontier`` (indices into ``tok`` / ``parent``, all at ``depth``; parent
        -1 = the root) through the drafter in one forward, fed ``feats`` [1, n, H] (their parents'
        output features). Node r attends to the committed prefix, its ancestors' slots and itself;
        its own slot is recorded in ``slot``. Returns (output features [1, n, H], draft-vocab
        log-probs of each node's next token [n, V_draft])."""
        n, base = len(frontier), self.cache.length
        dev = self.last_h.device
        mask = torch.zeros(1, n, base + n, dtype=torch.bool, device=dev)
        mask[0, :, :committed] = True
        for r, i in enumerate(frontier):
            a = parent[i]
            while a >= 0:  # ancestors' speculative positions
                mask[0, r, slot[a]] = True
                a = parent[a]
            mask[0, r, base + r] = True
            slot[i] = base + r
        toks = self.drafter.to_target_ids(torch.tensor([[tok[i] for i in frontier]], device=dev))
        pos = torch.full((1, n), self.pos + depth - 1, device=dev)
        h, logits = self.drafter.draft_step(toks, feats, pos, self.cache, mask, depth=depth)
        return h, logits[0].float().log_softmax(-1)

    @torch.no_grad()
    def _dynamic_tree(self, spec: DynamicTree) -> DraftTree:
        """EAGLE-2: top-k at the root; each later depth expands the k best frontier nodes (by
        cumulative log-prob) into k children each; all candidates are pooled and the
        ``total_tokens`` best are kept (their ancestors always score at least as high, so the
        tree stays closed).

        The total bounds the work, and the bounds below keep the kept tree what the unbounded
        growth would keep: a kept node needs its ancestors kept, so no level deeper than the
        total is grown (``spec.max_depth``); with k at least the total every node the best
        ``total_tokens`` hold is among its parent's top ``total_tokens`` children, so k beyond
        the total (or the draft vocabulary) adds nothing; and a candidate below the pool's
        ``total_tokens``-th best score can never be kept, nor can any of its descendants, so it
        is dropped, and growth stops once no frontier node is left."""
        committed = self.cache.length
        dev = self.last_h.device
        total = spec.total_tokens
        lp = self.last_logits.float().log_softmax(-1)
        k = min(spec.top_k, total, lp.numel())
        score, ids = lp.topk(k)
        # pool of candidate nodes (draft vocab ids), parent = pool index or -1 for the root
        tok, parent, depth, scores = ids.tolist(), [-1] * len(ids), [1] * len(ids), score.tolist()
        best = score  # the pool's best scores, at most ``total`` of them
        frontier = list(range(len(ids)))
        feats = self.last_h.expand(1, len(frontier), -1)
        slot: dict[int, int] = {}  # pool index -> drafter cache slot of its expanded position
        for d in range(1, spec.max_depth):
            h, lp = self._draft_level(frontier, tok, parent, slot, feats, d, committed)
            clp, cid = lp.topk(k, dim=-1)  # [n, k]
            cum = torch.tensor([scores[i] for i in frontier], device=dev)[:, None] + clp
            flat = cum.flatten()
            best = torch.cat([best, flat]).topk(min(total, best.numel() + flat.numel())).values
            floor = float(best[-1]) if best.numel() == total else -math.inf
            keep = (flat >= floor).tolist()
            pool_of: dict[int, int] = {}  # candidate (row-major in cum) -> its pool index
            cid, flat_scores = cid.flatten().tolist(), flat.tolist()
            for c, ok in enumerate(keep):
                if ok:
                    pool_of[c] = len(tok)
                    tok.append(cid[c])
                    parent.append(frontier[c // k])
                    depth.append(d + 1)
                    scores.append(flat_scores[c])
            chosen = [int(b) for b in flat.topk(min(k, flat.numel())).indices if keep[int(b)]]
            if not chosen:
                break
            frontier = [pool_of[b] for b in chosen]
            feats = h[:, torch.tensor(chosen, device=dev) // k]
        self.cache.crop(committed)

        # Best-first by cumulative log-prob (ties: shallower first, so a parent always comes
        # before its children); a node joins only after its parent, keeping the tree closed.
        kept: set[int] = set()
        for i in sorted(range(len(tok)), key=lambda i: (-scores[i], depth[i])):
            if len(kept) == spec.total_tokens:
                break
            if parent[i] < 0 or parent[i] in kept:
                kept.add(i)
        order = sorted(kept, key=lambda i: (depth[i], -scores[i]))
        node_of = {i: n + 1 for n, i in enumerate(order)}  # node 0 is the root
        tokens = self.drafter.to_target_ids(torch.tensor([tok[i] for i in order], device=dev))
        parents = torch.tensor([node_of.get(parent[i], 0) for i in order], device=dev)
        depths = torch.tensor([depth[i] for i in order], device=dev)
        return DraftTree(tokens, parents, depths)

    @torch.no_grad()
    def _static_tree(self, shape: StaticTree) -> DraftTree:
        """EAGLE-1's static tree: a node of rank r is its parent's r-th most likely next token,
        so each node with children is expanded once, ranking the drafter's tokens given its
        path; one drafter forward per depth."""
        check_decoding(shape, draft_vocab=self.last_logits.numel())
        committed = self.cache.length
        parent = (shape.parents - 1).tolist()  # node i + 1 -> index i; the root is -1
        depth, rank = shape.depth.tolist(), shape.rank.tolist()
        width: dict[int, int] = {}  # node index (-1 = root) -> candidates its children need
        for i, p in enumerate(parent):
            width[p] = max(width.get(p, 0), rank[i] + 1)
        ranked = {-1: self.last_logits.topk(width[-1]).indices.tolist()}  # node -> its ranked next tokens
        feat = {-1: self.last_h[0, 0]}  # node -> the output feature its children are fed
        tok = [0] * len(parent)
        slot: dict[int, int] = {}
        for d in range(1, shape.max_depth + 1):
            level = [i for i in range(len(parent)) if depth[i] == d]
            for i in level:
                tok[i] = ranked[parent[i]][rank[i]]
            frontier = [i for i in level if i in width]
            if not frontier:
                break
            feats = torch.stack([feat[parent[i]] for i in frontier])[None]
            h, lp = self._draft_level(frontier, tok, parent, slot, feats, d, committed)
            top = lp.topk(max(width[i] for i in frontier), dim=-1).indices.tolist()
            for r, i in enumerate(frontier):
                ranked[i], feat[i] = top[r][: width[i]], h[0, r]
        self.cache.crop(committed)
        dev = self.last_h.device
        tokens = self.drafter.to_target_ids(torch.tensor(tok, device=dev))
        return DraftTree(tokens, shape.parents.to(dev), shape.depth.to(dev))


class EagleChains(RowProposers):
    """The EAGLE chain of every row of a batch, drafted together: one drafter forward per draft
    position for all rows, instead of one per row (a forward is bound by streaming the weights,
    so many rows cost little more than one).

    The rows share one drafter cache whose slots are aligned: an ``advance`` in which rows kept
    different numbers of tokens appends as many slots as the longest, and each row's unused
    slots are masked out for good (``valid``). Positions (RoPE) stay per row. Drafting appends
    the speculative positions and crops them away, as :class:`EagleProposer` does."""

    def __init__(self, proposer: EagleProposer, n: int):
        super().__init__([])
        self.drafter, self.name, self.n = proposer.drafter, proposer.name, n
        self.live = list(range(n))  # the row of the drafter's cache of each row still decoding
        self.cache = self.drafter.new_cache()
        self.pos = [0] * n
        self.valid = None  # Bool[n, cache.length]: slot s holds one of row b's committed positions
        self.last_h = self.last_logits = None  # [n, 1, H], [n, V_draft]: what the next draft follows
        self._starts: dict[int, tuple] = {}

    def configure(self, sampling) -> None:
        self.sampling = sampling

    def start(self, row, prompt_ids, hidden, next_token) -> None:
        nxt = torch.tensor([next_token], device=prompt_ids.device)
        # position t pairs token x_{t+1} with the target feature f_t, as EagleProposer.start
        self._starts[row] = (torch.cat([prompt_ids.reshape(-1)[1:], nxt]), hidden)
        if len(self._starts) == self.n:
            self._start_rows([self._starts[r] for r in range(self.n)])
            self._starts = {}

    @torch.no_grad()
    def _start_rows(self, rows: list[tuple[torch.Tensor, dict]]) -> None:
        """Each prompt through the drafter alone (padding prompts of very different lengths to one
        forward wastes most of it on padding), then laid into the shared cache at slots 0..n_b,
        the rest masked."""
        d = self.drafter
        caches, width = [], max(t.numel() for t, _ in rows)
        for r, (tokens, hidden) in enumerate(rows):
            cache = d.new_cache()
            positions = torch.arange(tokens.numel(), device=tokens.device)[None]
            h, _ = d.draft_step(tokens[None], d.features(hidden), positions, cache, logits=False)
            logits = d.head(h[:, -1])
            if self.last_h is None:
                self.last_h = h.new_zeros(self.n, 1, h.shape[-1])
                self.last_logits = logits.new_zeros(self.n, logits.shape[-1])
            self.last_h[r, 0], self.last_logits[r] = h[0, -1], logits[0]
            self.pos[r] = tokens.numel()
            caches.append(cache)
        for i in range(len(self.cache.k)):
            for name in ("k", "v"):
                first = getattr(caches[0], name)[i]
                layer = first.new_zeros(self.n, first.shape[1], width, first.shape[3])
                for r, c in enumerate(caches):
                    part = getattr(c, name)[i][0]
                    layer[r, :, : part.shape[1]] = part
                getattr(self.cache, name)[i] = layer
        self.valid = torch.arange(width, device=self.last_h.device)[None] < torch.tensor(self.pos, device=self.last_h.device)[:, None]

    def advance(self, accepted, hidden, rows) -> None:
        self._extend([a.reshape(-1) for a in accepted], hidden, [self.live[r] for r in rows])

    @torch.no_grad()
    def _extend(self, tokens: list[torch.Tensor], hidden: list[dict], rows: list[int]) -> None:
        d, n = self.drafter, self.n
        dev = tokens[0].device
        counts = [0] * n
        for r, t in zip(rows, tokens):
            counts[r] = t.numel()
        width = max(counts)
        feats = [d.features(h) for h in hidden]  # [1, n_b, H]
        ids = torch.zeros(n, width, dtype=torch.long, device=dev)
        x = feats[0].new_zeros(n, width, feats[0].shape[-1])
        for r, t, f in zip(rows, tokens, feats):
            ids[r, : t.numel()], x[r, : t.numel()] = t, f[0]
        steps = torch.arange(width, device=dev)
        positions = torch.tensor(self.pos, device=dev)[:, None] + steps
        new_valid = steps[None] < torch.tensor(counts, device=dev)[:, None]  # [n, width]
        past = self.cache.length
        old = self.valid
        causal = torch.ones(width, width, dtype=torch.bool, device=dev).tril()
        # a padding query sees its own slot, so no row of the mask is empty
        mask = torch.cat([old[:, None].expand(n, width, past), (causal & new_valid[:, None]) | torch.eye(width, dtype=torch.bool, device=dev)], 2)
        h, _ = d.draft_step(ids, x, positions, self.cache, mask, logits=False)
        self.valid = torch.cat([old, new_valid], 1)
        index = torch.tensor(rows, device=dev)
        last = h[index, torch.tensor([counts[r] - 1 for r in rows], device=dev)]  # [rows, H]
        self.last_h[index, 0], self.last_logits[index] = last, d.head(last)
        for r in rows:
            self.pos[r] += counts[r]

    @torch.no_grad()
    def propose(self, shape: Chain) -> list[ChainDraft]:
        """Every row's greedy chain; with ``min_confidence`` each row stops on its own (the
        rows that stopped still ride along in the batched forwards)."""
        d, n, k = self.drafter, self.n, shape.k
        committed = self.cache.length
        dev = self.last_h.device
        h, logits = self.last_h, self.last_logits
        drafts, keep = [], torch.full((n,), k, dtype=torch.long)
        confidence = torch.ones(n, device=dev)
        for j in range(k):
            top = logits.max(-1)
            if shape.min_confidence > 0:
                confidence = confidence * (top.values.float() - logits.float().logsumexp(-1)).exp()
                low = (confidence < shape.min_confidence).cpu() & (keep == k)
                keep[low] = j
            tok = d.to_target_ids(top.indices)  # [n]
            drafts.append(tok)
            if j + 1 < k:
                pos = torch.tensor(self.pos, device=dev)[:, None] + j
                mask = torch.cat([self.valid, torch.ones(n, j + 1, dtype=torch.bool, device=dev)], 1)[:, None]
                h, lg = d.draft_step(tok[:, None], h, pos, self.cache, mask, depth=j + 1)
                logits = lg[:, -1]
        self.cache.crop(committed)
        tokens = torch.stack(drafts, 1)  # [n, k]
        return [ChainDraft(tokens[r, : int(keep[r])], None) for r in self.live]

    def select(self, rows: list[int]) -> None:
        """Keep the rows at ``rows``. The rows that left stay in the drafter's cache, drafted
        along and never read, until half of it has left, as in the target's cache: copying the
        whole cache at every row's end costs more than drafting the finished rows along."""
        self.live = [self.live[r] for r in rows]
        if len(self.live) > self.n // 2:
            return
        rows, self.live = self.live, list(range(len(self.live)))
        index = torch.tensor(rows, dtype=torch.long, device=self.last_h.device)
        self.cache.k = [None if k is None else k.index_select(0, index) for k in self.cache.k]
        self.cache.v = [None if v is None else v.index_select(0, index) for v in self.cache.v]
        self.valid = self.valid.index_select(0, index)
        self.last_h, self.last_logits = self.last_h.index_select(0, index), self.last_logits.index_select(0, index)
        self.pos = [self.pos[r] for r in rows]
        self.n = len(rows)


class EagleOnDevice(DeviceDrafter):
    """EAGLE chains of every row over a static drafter cache written at each row's own length
    (the device loop's drafter): drafting writes speculative positions past a row's length and
    the next ``extend`` overwrites them with the kept tokens and the target's features, as
    :class:`EagleChains` does by cropping."""

    def __init__(self, drafter, rows: int, room: int):
        d = self.drafter = drafter
        p = next(d.parameters())
        shape = (len(d.layers), rows, d.shape.num_key_value_heads, room, d.shape.head_dim)
        self.k, self.v = torch.zeros(shape, dtype=p.dtype, device=p.device), torch.zeros(shape, dtype=p.dtype, device=p.device)
        self.lengths = torch.zeros(rows, 1, dtype=torch.long, device=p.device)
        self.last_h = torch.zeros(rows, 1, d.shape.hidden_size, dtype=p.dtype, device=p.device)
        self.last_logits = d.head(self.last_h[:, 0])  # [rows, V_draft]: what each row's next draft follows

    def _forward(self, rows: slice, tokens, feats, lengths, depth: int = 0) -> torch.Tensor:
        """The drafter over ``tokens`` [b, T] of cache rows ``rows``, written at ``lengths`` [b, 1],
        ``depth`` drafts deep (``EagleBase.stack``)."""
        S = self.k.shape[3]
        return self._step(rows, tokens, feats, RaggedKVCache.layout(lengths, tokens.shape[1], None, None, S, [(0, tokens.shape[0], S)]), depth)

    def _step(self, rows: slice, tokens, feats, step: CacheStep, depth: int = 0) -> torch.Tensor:
        """The drafter over ``tokens`` [b, T] of cache rows ``rows`` with the layout ``step``."""
        cache = RaggedKVCache(self.k[:, rows], self.v[:, rows], [], static=True)

        def attend_for_layer(i, attn):
            def attend(q, k, v):
                (_, _, ks, vs), = cache.update(i, k, v, step)
                return attn.attend(q, ks, vs, mask=step.mask)

            return attend

        d = self.drafter
        return d.stack(d.embed(tokens), feats, step.positions, attend_for_layer, depth)

    @torch.no_grad()
    def start(self, row, prompt_ids, hidden, next_token) -> None:
        # position t pairs token x_{t+1} with the target feature f_t, as EagleProposer.start
        tokens = torch.cat([prompt_ids.reshape(-1)[1:], next_token.reshape(1)])[None]
        rows = slice(row, row + 1)
        self.lengths[rows] = 0
        h = self._forward(rows, tokens, self.drafter.features(hidden), self.lengths[rows])
        self.last_h[rows], self.last_logits[rows] = h[:, -1:], self.drafter.head(h[:, -1])
        self.lengths[rows] = tokens.shape[1]

    def draft(self, b: int, k: int) -> torch.Tensor:
        d, rows = self.drafter, slice(0, b)
        h, logits, out = self.last_h[rows], self.last_logits[rows], []
        for j in range(k):
            tok = d.to_target_ids(logits.max(-1).indices)
            out.append(tok)
            if j + 1 < k:
                h = self._forward(rows, tok[:, None], h, self.lengths[rows] + j, depth=j + 1)
                logits = d.head(h[:, -1])
        return torch.stack(out, 1)

    def draft_tree(self, b: int, shape: DynamicTree):
        """EAGLE-2's dynamic tree (:func:`grow_dynamic_tree`): one drafter forward per depth over
        the frontier, written past the row's length, each node seeing the committed prefix, its
        ancestors' slots and itself, fed its parent's output feature."""
        d, rows, dev = self.drafter, slice(0, b), self.k.device
        S, committed, span = self.k.shape[3], self.lengths[rows], torch.arange(self.k.shape[3], device=dev)
        state = {"h": self.last_h[rows], "seen": None}  # the frontier's parents' features and slots

        def expand(depth, tok, parent):
            K = tok.shape[1]
            h, seen = state["h"], state["seen"]
            if parent is None:
                feats, seen = h.expand(b, K, -1), torch.zeros(b, K, S, dtype=torch.bool, device=dev)
            else:
                feats, seen = h.gather(1, parent[..., None].expand(-1, -1, h.shape[-1])), seen.gather(1, parent[..., None].expand(-1, -1, S))
            slots = committed + (depth - 1) * K + torch.arange(K, device=dev)  # [b, K]
            seen = seen | (span == slots[..., None])
            step = CacheStep(committed + depth - 1 + 0 * slots, (span < committed[..., None]) | seen, slots, [(0, b, S)])
            state["h"], state["seen"] = self._step(rows, d.to_target_ids(tok), feats, step, depth), seen
            return d.head(state["h"]).float().log_softmax(-1)

        tokens, parents = grow_dynamic_tree(self.last_logits[rows].float().log_softmax(-1), shape, expand)
        return d.to_target_ids(tokens), parents

    def extend(self, b, tokens, hidden, counts) -> None:
        d, rows = self.drafter, slice(0, b)
        h = self._forward(rows, tokens, d.features(hidden), self.lengths[rows])
        last = h[torch.arange(b, device=h.device), (counts - 1).clamp(min=0)]
        self.last_h[rows, 0] = last
        self.last_logits[rows] = d.head(last)
        self.lengths[rows] += counts[:, None]

    def select(self, index) -> None:
        n = index.numel()
        for buf in (self.k, self.v):
            buf[:, :n] = buf[:, index]
        for t in (self.lengths, self.last_h, self.last_logits):
            t[:n] = t[index]
