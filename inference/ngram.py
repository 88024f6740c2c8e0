"""Prompt-lookup (n-gram) proposer: the drafter-free baseline.

The draft is whatever followed the most recent earlier occurrence of the last n tokens of
prompt + generated text (longest n first, from ``n_max`` down to ``n_min``). Tokens are chosen
deterministically, so the draft is a point mass (``probs=None``), lossless under sampling too.
The tree variant merges the continuations of several earlier occurrences into a trie.
"""

from __future__ import annotations

import numpy as np
import torch

from draftlab.device import device_ints
from draftlab.inference.proposer import PROPOSERS, Proposer
from draftlab.inference.shapes import Chain, ChainDraft, DraftTree, DynamicTree


@PROPOSERS.register("ngram")
class NgramProposer(Proposer):
    name = "ngram"
    layers = ()
    shapes = frozenset({"chain", "dynamic_tree"})

    def __init__(self, n_max: int = 3, n_min: int = 1, max_tree_matches: int = 64):
        if not 1 <= n_min <= n_max:
            raise ValueError(f"ngram proposer: need 1 <= n_min <= n_max, got n_min={n_min}, n_max={n_max}")
        self.n_max, self.n_min = n_max, n_min
        self.max_tree_matches = max_tree_matches  # bounds the trie-building work per step
        self._buf = np.zeros(0, dtype=np.int64)
        self._len = 0
        self._device = torch.device("cpu")

    # ---------------------------------------------------------------- protocol
    def start(self, prompt_ids: torch.Tensor, hidden: dict, next_token: int) -> None:
        ids = prompt_ids.reshape(-1).tolist() + [int(next_token)]
        self._device = prompt_ids.device
        self._buf = np.zeros(max(64, 2 * len(ids)), dtype=np.int64)
        self._len = 0
        self._append(ids)

    def advance(self, accepted: torch.Tensor, hidden: dict) -> None:
        self._append(accepted.reshape(-1).tolist())

    def propose(self, shape: Chain | DynamicTree) -> ChainDraft | DraftTree:
        return self._chain(shape.k) if isinstance(shape, Chain) else self._tree(shape)

    # ---------------------------------------------------------------- drafting
    def _chain(self, k: int) -> ChainDraft:
        ctx = self.context
        for start, n in self._matches(limit=1):
            cont = ctx[start + n : start + n + k]
            return ChainDraft(device_ints(cont.tolist(), self._device))
        return ChainDraft(torch.zeros(0, dtype=torch.long, device=self._device))

    def _tree(self, spec: DynamicTree) -> DraftTree:
        """The continuations of up to ``max_tree_matches`` earlier occurrences, merged into a
        trie (prefix-shared), bounded by the shape's depth, children per node and total nodes."""
        ctx = self.context
        tokens: list[int] = []
        parents: list[int] = []
        depth: list[int] = [0]  # node 0 = root
        children: list[dict[int, int]] = [{}]  # node -> {token: child node}
        for start, n in self._matches(limit=self.max_tree_matches):
            node = 0
            for tok in ctx[start + n : start + n + spec.max_depth].tolist():
                nxt = children[node].get(tok)
                if nxt is None:
                    if len(tokens) >= spec.total_tokens or len(children[node]) >= spec.top_k:
                        break
                    nxt = len(tokens) + 1
                    tokens.append(tok)
                    parents.append(node)
                    depth.append(depth[node] + 1)
                    children[node][tok] = nxt
                    children.append({})
                node = nxt
            if len(tokens) >= spec.total_tokens:
                break
        as_long = lambda x: device_ints(x, self._device)  # noqa: E731
        return DraftTree(as_long(tokens), as_long(parents), as_long(depth[1:]))

    # ---------------------------------------------------------------- internals
    @property
    def context(self) -> np.ndarray:
        return self._buf[: self._len]

    def _append(self, ids: list[int]) -> None:
        need = self._len + len(ids)
        if need > self._buf.size:
            grown = np.zeros(max(need, 2 * self._buf.size), dtype=np.int64)
            grown[: self._len] = self._buf[: self._len]
            self._buf = grown
        self._buf[self._len : need] = ids
        self._len = need

    def _matches(self, limit: int):
        """Yield (start, n) of earlier occurrences of the last n tokens that have at least one
        following token: longest n first, most recent occurrence first, at most ``limit``."""
        ctx = self.context
        found = 0
        for n in range(min(self.n_max, ctx.size - 1), self.n_min - 1, -1):
            # Windows over ctx[:-1] start at 0..len-1-n, so a following token always exists.
            windows = np.lib.stride_tricks.sliding_window_view(ctx[:-1], n)
            hits = np.flatnonzero((windows == ctx[-n:]).all(axis=1))
            for start in hits[::-1]:
                yield int(start), n
                found += 1
                if found >= limit:
                    return
