"""Proposer for Hydra drafters (models/hydra.py): drafts built level by level, each head reading
the tokens on its path.

The state the heads read (Hydra++: the prefix layer's output over the target's verified hidden
states, through a KV cache of its own that holds verified positions only, so nothing is ever
rolled back) is taken once per step from the kept inputs; the root is the target's own next
token. Head i then reads ``[s; E(root); E(draft 1); ...; E(draft i)]``:

- a chain: each head's top-1, the next head reading it (at most ``num_heads`` drafts);
- a static tree (Medusa-style choices): a node of rank r is the r-th best token of head d - 1
  *given its own path* (Hydra's grounded proposal), one head pass per depth over the nodes
  that have children;
- a dynamic tree: EAGLE-2's expansion and reranking (:func:`grow_dynamic_tree`) with head d
  scoring the children of the depth-d frontier, at most ``num_heads`` deep.

Tokens are picked deterministically (top-1 / top-k), so drafts are point masses (``probs=None``):
greedy and sampled verification both stay lossless. The same functions draft on the host and in
the device loop (:class:`HydraOnDevice`), for every row of a batch at once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from draftlab.inference.proposer import PROPOSERS, DraftsOnDevice, Proposer, RowProposers, draft_vocab_size
from draftlab.inference.shapes import Chain, ChainDraft, DraftTree, DynamicTree, OptionError, StaticTree, check_decoding
from draftlab.inference.spec_loop import DeviceDrafter, grow_dynamic_tree, tree_layout, tree_nodes
from draftlab.kernels.cpu_gemm import decoding_copy
from draftlab.models.layers import DraftKVCache
from draftlab.models.target import RaggedKVCache


# ---------------------------------------------------------------------- drafts from the heads' state
def root_inputs(d, states: torch.Tensor, roots: torch.Tensor) -> torch.Tensor:
    """Head 0's inputs [n, 2H]: each row's state [n, H] and its root token's embedding."""
    return torch.cat([states, d.embed(roots)], -1)


def chain(d, x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy drafts [n, k] (target ids) and their heads' logits [n, k, V_draft] from head 0's
    inputs ``x`` [n, 2H]: head i reads the drafts before it."""
    tokens, logits = [], []
    for i in range(k):
        lg = d.head_logits(x, i)
        tok = d.to_target_ids(lg.max(-1).indices)
        tokens.append(tok)
        logits.append(lg)
        if i + 1 < k:
            x = torch.cat([x, d.embed(tok)], -1)
    return torch.stack(tokens, 1), torch.stack(logits, 1)


def static_tree(d, x: torch.Tensor, shape: StaticTree) -> torch.Tensor:
    """Each row's node tokens [n, N] (target ids) of a static tree: depth by depth, head d - 1
    ranks the children of every depth-(d-1) node that has some, reading that node's path."""
    parents, depth, rank = shape.parents.tolist(), shape.depth.tolist(), shape.rank.tolist()
    expanded = set(parents)
    inputs = {0: x}  # node (0: the root) -> its children's head input [n, (depth + 2)H]
    tokens = [None] * len(parents)
    for level in range(1, shape.max_depth + 1):
        nodes = [i for i in range(len(parents)) if depth[i] == level]
        ups = sorted({parents[i] for i in nodes})
        logits = d.head_logits(torch.stack([inputs[u] for u in ups], 1), level - 1)  # [n, U, V_draft]
        ranked = d.to_target_ids(logits.topk(max(rank[i] for i in nodes) + 1).indices)
        for i in nodes:
            tokens[i] = ranked[:, ups.index(parents[i]), rank[i]]
            if i + 1 in expanded:
                inputs[i + 1] = torch.cat([inputs[parents[i]], d.embed(tokens[i])], -1)
    return torch.stack(tokens, 1)


def dynamic_tree(d, x: torch.Tensor, spec: DynamicTree) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's tree (tokens [n, N] target ids, parents [n, N]) grown by
    :func:`grow_dynamic_tree`: head ``depth`` scores the children of the depth-``depth``
    frontier from each frontier node's path (``spec`` no deeper than the heads)."""
    state = {"x": None}  # the frontier's head inputs [n, K, (depth + 2)H]

    def expand(depth, tok, parent):
        prev = state["x"]
        if parent is None:
            prev = x[:, None].expand(-1, tok.shape[1], -1)
        else:
            prev = prev.gather(1, parent[..., None].expand(-1, -1, prev.shape[-1]))
        state["x"] = torch.cat([prev, d.embed(d.to_target_ids(tok))], -1)
        return d.head_logits(state["x"], depth).float().log_softmax(-1)

    tokens, parents = grow_dynamic_tree(d.head_logits(x, 0).float().log_softmax(-1), spec, expand)
    return d.to_target_ids(tokens), parents


# ---------------------------------------------------------------------- the proposer
@PROPOSERS.register("hydra")
class HydraProposer(Proposer, DraftsOnDevice):
    shapes = frozenset({"chain", "static_tree", "dynamic_tree"})

    def __init__(self, drafter, trained_depth: int | None = None):
        super().__init__(draft_vocab=draft_vocab_size(drafter), trained_depth=trained_depth)
        # a frozen copy whose linears run decoding's few-row products on the CPU's faster GEMM
        self.drafter = decoding_copy(drafter.eval())
        self.name = drafter.algorithm
        self.layers = tuple(drafter.capture_layers)

    @classmethod
    def check(cls, shape, drafter) -> None:
        """A static tree no deeper than the heads and no wider than the draft vocabulary."""
        if isinstance(shape, StaticTree):
            D, H = shape.max_depth, drafter.num_heads
            if D > H:
                raise OptionError("static_tree", f"paths of depth {D} need {D} Hydra heads: this drafter has {H}",
                                  f"static tree: depth {D} needs {D} Hydra heads, this drafter has {H}")
            check_decoding(shape, draft_vocab=drafter.draft_vocab_size)

    def head_tree(self, spec: DynamicTree) -> DynamicTree:
        """``spec`` as the heads grow it: at most ``num_heads`` levels, and no more nodes than
        the growth scores."""
        depth = min(spec.max_depth, self.drafter.num_heads)
        grown = tree_nodes(DynamicTree(depth, spec.top_k, spec.total_tokens), self.draft_vocab)
        return DynamicTree(depth, spec.top_k, min(spec.total_tokens, grown))

    # ---- the state the heads read ---------------------------------------------------
    def start(self, prompt_ids, hidden, next_token):
        self.cache, self.pos = DraftKVCache(1), 0
        final = hidden[self.drafter.num_target_layers]
        self._read(final, torch.as_tensor(next_token, device=final.device).reshape(()))

    def advance(self, accepted, hidden):
        self._read(hidden[self.drafter.num_target_layers], accepted.reshape(-1)[-1])

    @torch.no_grad()
    def _read(self, final: torch.Tensor, root: torch.Tensor) -> None:
        """The kept inputs' final hidden states [1, n, H] through the prefix layer (appended to
        its cache); the last one's state and the next token are what the drafts follow."""
        d, n = self.drafter, final.shape[1]
        past = self.cache.length
        mask = torch.ones(n, past + n, dtype=torch.bool, device=final.device).tril(past)[None] if n > 1 else None

        def attend(q, k, v):
            k, v = self.cache.append(0, k, v)
            return d.prefix.layer.self_attn.attend(q, k, v, mask=mask)

        positions = torch.arange(self.pos, self.pos + n, device=final.device)[None]
        self.state = d.states(final, positions, attend)[0, -1]
        self.root = root
        self.pos += n

    # ---- drafts ----------------------------------------------------------------------
    def propose(self, shape):
        return self.draft(self.state[None], self.root[None], shape)[0]

    def batched(self, n: int, shape) -> RowProposers:
        """Every row's drafts from one pass of each head over all rows (:class:`HydraRows`)."""
        return HydraRows(self, n)

    @torch.no_grad()
    def draft(self, states: torch.Tensor, roots: torch.Tensor, shape) -> list[ChainDraft | DraftTree]:
        """The drafts of rows whose heads' states are ``states`` [n, H] and roots ``roots`` [n]."""
        d = self.drafter
        x = root_inputs(d, states, roots)
        if isinstance(shape, Chain):
            return self._chains(x, shape.k, shape.min_confidence)
        if isinstance(shape, StaticTree):
            self.check(shape, d)
            dev = x.device
            return [DraftTree(t, shape.parents.to(dev), shape.depth.to(dev)) for t in static_tree(d, x, shape)]
        spec = self.head_tree(shape)
        tokens, parents = dynamic_tree(d, x, spec)
        depth, _ = tree_layout(F.pad(parents, (1, 0), value=-1), spec.max_depth)
        return [DraftTree(t, p, dp[1:]) for t, p, dp in zip(tokens, parents, depth)]

    def _chains(self, x: torch.Tensor, k: int, min_confidence: float) -> list[ChainDraft]:
        """Head i's top-1 for the i-th draft, i < min(k, num_heads). With ``min_confidence``,
        stop before the draft at which the product of the heads' top-1 probabilities falls below
        it (the chain's dynamic length, as for Medusa and EAGLE)."""
        tokens, logits = chain(self.drafter, x, min(k, self.drafter.num_heads))
        lengths = [tokens.shape[1]] * tokens.shape[0]
        if min_confidence > 0:  # top-1 probability = exp(max logit - logsumexp)
            confidence = (logits.float().max(-1).values - logits.float().logsumexp(-1)).exp().cumprod(-1)
            lengths = (confidence >= min_confidence).cumprod(-1).sum(-1).tolist()
        return [ChainDraft(tokens[r, :n], None) for r, n in enumerate(lengths)]

    # ---- on the device ---------------------------------------------------------------
    def refuses_on_device(self, shape) -> str | None:
        heads = self.drafter.num_heads
        if isinstance(shape, Chain):
            return f"k={shape.k}: its {heads} Hydra heads draft {heads} tokens a step" if shape.k > heads else None
        if isinstance(shape, DynamicTree):
            grown = self.head_tree(shape).total_tokens
            if grown < shape.total_tokens:  # a tree of static shape keeps exactly total_tokens nodes
                return f"its {heads} heads grow {grown} nodes, fewer than tree.total_tokens={shape.total_tokens}"
            return None
        return None if isinstance(shape, StaticTree) else super().refuses_on_device(shape)

    def on_device(self, rows: int, room: int, shape) -> "HydraOnDevice":
        self.check(shape, self.drafter)
        return HydraOnDevice(self, rows, room)


class HydraRows(RowProposers):
    """The rows of a batch: each keeps its own prefix cache, state and root; a step runs each
    head once over all rows."""

    def __init__(self, proposer: HydraProposer, n: int):
        super().__init__([proposer.fork() for _ in range(n)])
        self.proposer = proposer

    def propose(self, shape) -> list[ChainDraft | DraftTree]:
        return self.proposer.draft(torch.stack([p.state for p in self.rows]), torch.stack([p.root for p in self.rows]), shape)


class HydraOnDevice(DeviceDrafter):
    """Each row's prefix-layer K/V in a static buffer written at the row's length (it only ever
    holds verified positions), its heads' state and its root token; drafts as on the host."""

    def __init__(self, proposer: HydraProposer, rows: int, room: int):
        d = self.drafter = proposer.drafter
        self.proposer = proposer
        p = d.lm_heads[0].weight  # (a decoding copy's linears hold no parameters)
        if d.prefix is not None:
            size = (1, rows, d.shape.num_key_value_heads, room, d.shape.head_dim)
            self.k, self.v = torch.zeros(size, dtype=p.dtype, device=p.device), torch.zeros(size, dtype=p.dtype, device=p.device)
        self.lengths = torch.zeros(rows, 1, dtype=torch.long, device=p.device)
        self.state = torch.zeros(rows, d.hidden_size, dtype=p.dtype, device=p.device)
        self.root = torch.zeros(rows, dtype=torch.long, device=p.device)

    def _states(self, rows: slice, final: torch.Tensor) -> torch.Tensor:
        """The heads' states [b, T, H] of rows ``rows`` for final hidden states [b, T, H],
        their prefix K/V written at the rows' lengths."""
        d = self.drafter
        if d.prefix is None:
            return d.states(final, None, None)
        S = self.k.shape[3]
        step = RaggedKVCache.layout(self.lengths[rows], final.shape[1], None, None, S, [(0, final.shape[0], S)])
        cache = RaggedKVCache(self.k[:, rows], self.v[:, rows], [], static=True)

        def attend(q, k, v):
            (_, _, ks, vs), = cache.update(0, k, v, step)
            return d.prefix.layer.self_attn.attend(q, ks, vs, mask=step.mask)

        return d.states(final, step.positions, attend)

    @torch.no_grad()
    def start(self, row, prompt_ids, hidden, next_token) -> None:
        rows = slice(row, row + 1)
        final = hidden[self.drafter.num_target_layers]
        self.lengths[rows] = 0
        self.state[row] = self._states(rows, final)[0, -1]
        self.root[row] = next_token
        self.lengths[rows] = final.shape[1]

    def draft(self, b: int, k: int) -> torch.Tensor:
        return chain(self.drafter, root_inputs(self.drafter, self.state[:b], self.root[:b]), k)[0]

    def draft_tree(self, b: int, shape):
        d = self.drafter
        x = root_inputs(d, self.state[:b], self.root[:b])
        if isinstance(shape, StaticTree):
            return static_tree(d, x, shape), shape.parents.to(x.device).expand(b, -1)
        return dynamic_tree(d, x, self.proposer.head_tree(shape))

    def extend(self, b, tokens, hidden, counts) -> None:
        rows = slice(0, b)
        s = self._states(rows, hidden[self.drafter.num_target_layers])
        last, kept = (counts - 1).clamp(min=0), counts > 0  # a finished row (nothing kept) keeps its state
        index = torch.arange(b, device=s.device)
        self.state[rows] = torch.where(kept[:, None], s[index, last], self.state[rows])
        self.root[rows] = torch.where(kept, tokens[index, last], self.root[rows])
        self.lengths[rows] += counts[:, None]

    def select(self, index) -> None:
        n = index.numel()
        if self.drafter.prefix is not None:
            for buf in (self.k, self.v):
                buf[:, :n] = buf[:, index]
        for t in (self.lengths, self.state, self.root):
            t[:n] = t[index]
