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

from draftlab.inference.proposer import PROPOSERS, DraftsOnDevice, Proposer, RowProposers, draft_vocab_size
from draftlab.inference.shapes import Block, ChainDraft, OptionError
from draftlab.inference.spec_loop import DeviceDrafter
from draftlab.kernels.cpu_gemm import decoding_copy


@PROPOSERS.register("diffusion")
class DiffusionProposer(Proposer, DraftsOnDevice):
    shapes = frozenset({"block"})

    def __init__(self, drafter, trained_depth: int | None = None):
        super().__init__(draft_vocab=draft_vocab_size(drafter), trained_depth=trained_depth)
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
        return self.drafter.readout(self.block_states())

    @torch.no_grad()
    def block_states(self) -> torch.Tensor:
        """Final-normed states [gamma - 1, H] of the block's masked slots."""
        d = self.drafter
        G = d.block_size
        dev = self.kv[0][0].device
        ids = d.block_ids(torch.tensor([self.last], device=dev))  # [1, G]
        positions = torch.arange(self.length, self.length + G, device=dev)[None]
        mask = torch.ones(1, G, self.length + G, dtype=torch.bool, device=dev)  # whole context, whole block
        return d.block_states(ids, positions, self.kv, mask)[0, 1:]

    @classmethod
    def check(cls, shape: Block, drafter) -> None:
        if shape.k > drafter.block_size - 1:
            most = drafter.block_size - 1
            raise OptionError("k", f"must be at most {most}, what this drafter drafts per block (block_size - 1), got {shape.k}",
                              f"block: k={shape.k} exceeds what this drafter drafts per block (block_size - 1 = {most})")

    def propose(self, shape: Block) -> ChainDraft:
        self.check(shape, self.drafter)
        return self.draft_block(self.block_states()[: shape.k], shape)

    def draft_block(self, states: torch.Tensor, shape: Block) -> ChainDraft:
        """The chain drafted from the states [k, H] of a block's first k masked slots (a family
        with heads over the states, DSpark's, drafts differently from the same block)."""
        return self.draft(self.drafter.readout(states))

    def refuses_on_device(self, shape) -> str | None:
        if type(self).draft_block is not DiffusionProposer.draft_block and type(self).device_block is DiffusionProposer.device_block:
            return f"proposer '{self.name}' drafts its blocks on the host only"
        most = self.drafter.block_size - 1
        return f"k={shape.k}: this drafter drafts {most} tokens a block" if shape.k > most else None

    def on_device(self, rows: int, room: int, shape) -> "DiffusionOnDevice":
        return DiffusionOnDevice(self, rows, room)

    def device_block(self, states: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        """Greedy drafts Long[b, k] (target ids) from the states [b, k, H] of every row's block
        (``last`` [b]: each row's last token): :meth:`draft_block` as tensor ops over rows (a
        family drafting otherwise overrides both)."""
        return self.drafter.to_target_ids(self.drafter.readout(states).argmax(-1))

    def batched(self, n: int, shape) -> RowProposers:
        """Every row's block from one drafter forward (:class:`DiffusionRows`)."""
        return DiffusionRows(self, n)

    def draft(self, logits: torch.Tensor) -> ChainDraft:
        """The chain drafted from a block's slot logits [k, V_draft]."""
        d = self.drafter
        if self.sampling.greedy:
            return ChainDraft(d.to_target_ids(logits.argmax(-1)), None)
        q = self.sampling.probs(logits)  # [k, V_draft]
        draft = self.sampling.sample(q)
        full = q.new_zeros(q.shape[0], d.vocab_size)
        full[:, d.t2d] = q  # draft ids are the kept target ids in ascending order
        return ChainDraft(d.to_target_ids(draft), full)


class DiffusionRows(RowProposers):
    """The rows of a batch: each keeps its own context K/V; a step drafts every row's block in
    one drafter forward, the contexts padded to the longest and the padding masked (row by row,
    a batch of B would run B drafter forwards per step)."""

    def __init__(self, proposer: DiffusionProposer, n: int):
        super().__init__([proposer.fork() for _ in range(n)])
        self.proposer = proposer

    @torch.no_grad()
    def propose(self, shape: Block) -> list[ChainDraft]:
        d, rows = self.proposer.drafter, self.rows
        self.proposer.check(shape, d)
        G, dev = d.block_size, rows[0].kv[0][0].device
        lengths = [p.length for p in rows]
        S = max(lengths)
        kv = []
        for layer in range(len(rows[0].kv)):
            k0 = rows[0].kv[layer][0]
            k = k0.new_zeros(len(rows), k0.shape[1], S, k0.shape[3])
            v = torch.zeros_like(k)
            for b, p in enumerate(rows):
                k[b, :, : p.length], v[b, :, : p.length] = p.kv[layer][0][0], p.kv[layer][1][0]
            kv.append((k, v))
        ids = d.block_ids(torch.tensor([p.last for p in rows], device=dev))  # [B, G]
        positions = torch.tensor(lengths, device=dev)[:, None] + torch.arange(G, device=dev)
        span = torch.arange(S + G, device=dev)
        mask = (span < torch.tensor(lengths, device=dev)[:, None]) | (span >= S)  # own context, whole block
        states = d.block_states(ids, positions, kv, mask[:, None].expand(-1, G, -1))[:, 1 : 1 + shape.k]
        return [p.draft_block(states[b], shape) for b, p in enumerate(rows)]


class DiffusionOnDevice(DeviceDrafter):
    """Every row's context K/V in static buffers written at the row's length; a step drafts all
    rows' blocks in one drafter forward over them (the device loop's drafter). Drafts are greedy
    point masses, also when the decoding samples (lossless either way)."""

    def __init__(self, proposer: DiffusionProposer, rows: int, room: int):
        self.drafter = d = proposer.drafter
        self.family = proposer
        p = next(d.parameters())
        a = d.layers[0].self_attn
        shape = (len(d.layers), rows, a.num_kv_heads, room, a.head_dim)
        self.k, self.v = torch.zeros(shape, dtype=p.dtype, device=p.device), torch.zeros(shape, dtype=p.dtype, device=p.device)
        self.lengths = torch.zeros(rows, 1, dtype=torch.long, device=p.device)  # context positions of each row
        self.last = torch.zeros(rows, dtype=torch.long, device=p.device)

    def _write(self, rows: slice, hidden, lengths) -> None:
        d = self.drafter
        ctx = d.context(hidden)
        T = ctx.shape[1]
        positions = lengths + torch.arange(T, device=ctx.device)
        index = positions[:, None, :, None]
        for i, (k, v) in enumerate(d.context_kv(ctx, positions)):
            self.k[i, rows].scatter_(2, index.expand_as(k), k.to(self.k.dtype))
            self.v[i, rows].scatter_(2, index.expand_as(v), v.to(self.v.dtype))

    @torch.no_grad()
    def start(self, row, prompt_ids, hidden, next_token) -> None:
        rows = slice(row, row + 1)
        self.lengths[rows] = 0
        self._write(rows, hidden, self.lengths[rows])
        self.lengths[rows] = prompt_ids.numel()
        self.last[row] = next_token

    def draft(self, b: int, k: int) -> torch.Tensor:
        d, dev = self.drafter, self.k.device
        G, S = d.block_size, self.k.shape[3]
        ids = d.block_ids(self.last[:b])
        positions = self.lengths[:b] + torch.arange(G, device=dev)
        seen = torch.arange(S, device=dev)[None] < self.lengths[:b]  # [b, S]: each row's context
        mask = torch.cat([seen, seen.new_ones(b, G)], 1)[:, None].expand(b, G, S + G)
        kv = [(self.k[i, :b], self.v[i, :b]) for i in range(self.k.shape[0])]
        return self.family.device_block(d.block_states(ids, positions, kv, mask)[:, 1 : k + 1], self.last[:b])

    def extend(self, b, tokens, hidden, counts) -> None:
        self._write(slice(0, b), hidden, self.lengths[:b])
        self.last[:b] = tokens[torch.arange(b, device=tokens.device), (counts - 1).clamp(min=0)]
        self.lengths[:b] += counts[:, None]

    def select(self, index) -> None:
        n = index.numel()
        for buf in (self.k, self.v):
            buf[:, :n] = buf[:, index]
        for t in (self.lengths, self.last):
            t[:n] = t[index]
