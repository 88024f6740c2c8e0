"""The decoder: speculative decoding (chains, blocks, trees) and plain decoding, in one loop.

Each step reads top to bottom in :meth:`Decoder.steps`: plan the step's draft (``shape``, or a
:class:`~draftlab.inference.draft_length.DraftLength` rule's k; none = a plain step), draft (the
proposer first reads what the target kept since its last draft), one target forward over
``[last token, drafts...]`` of every row, accept (``kernels.accept_chains`` / ``accept_trees``:
the accepted drafts and a correction or bonus token), roll the KV cache back to the kept
tokens, emit. Plain decoding is the same loop without a proposer: every step is a plain step.
The bonus/correction token becomes the next step's last token and is written to the cache by
that step's forward; nothing is ever re-prefilled.

B prompts decode at once, each row with its own length, accepted length and end (one sequence
is the batch of one). A row that stops (eos or its token budget) leaves the batch: its proposer
at once, its cache row once half the rows have left (dropping a row copies the cache).

Greedy rows equal plain *batched* decoding of the same batch. They can differ from the same
prompt decoded alone: a batch changes the shapes of the matrix products, and float rounding
then decides near-ties differently (:mod:`~draftlab.inference.batch_eval` counts such rows).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable

import torch

from draftlab.device import device_ints
from draftlab.errors import DraftlabError
from draftlab.inference.prefill import PromptCache, prefill
from draftlab.inference.proposer import Branching, DraftsOnDevice, Proposer, RowProposers
from draftlab.inference.results import BatchResult, Clock, Emitter, GenerationResult, Stopwatch
from draftlab.inference.sampling import Sampling
from draftlab.inference.shapes import Block, Branch, Chain, ChainDraft, DraftTree, Shape, check_decoding, check_shape
from draftlab.inference.spec_loop import device_steps
from draftlab.inference.tree import ancestor_mask, validate_tree
from draftlab.kernels import accept_chains, accept_trees
from draftlab.models.sparse_attention import AttentionRecorder, SparseKeys


class Decoder:
    """``Decoder(target, proposer).generate([ids, ...], max_new_tokens, shape=Chain(3))``;
    ``Decoder(target)`` decodes plainly.

    ``loop``: "host" runs the stepwise loop below; "device" the whole step on the device
    (:mod:`~draftlab.inference.spec_loop`: plain decoding, and chains of a proposer that
    :class:`~draftlab.inference.proposer.DraftsOnDevice`); "auto" (default) the device loop on
    CUDA where it applies, else the host loop."""

    LOOPS = ("auto", "host", "device")

    def __init__(self, target, proposer: Proposer | None = None, backend: str = "auto", loop: str = "auto"):
        if loop not in self.LOOPS:
            raise DraftlabError(f"loop must be one of {', '.join(self.LOOPS)}, got {loop!r}")
        self.target, self.proposer, self.backend, self.loop = target, proposer, backend, loop
        self.layers = list(proposer.layers) if proposer is not None else []

    def generate(self, prompt_ids, max_new_tokens: int, shape: Shape | None = Chain(3), temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int = 0, eos_token_id=None, draft_length=None,
                 on_step=None, prompt_cache: PromptCache | None = None) -> BatchResult:
        """Decode every prompt of ``prompt_ids`` up to ``max_new_tokens``. ``draft_length``: a
        rule choosing each step's k (chains and blocks); ``on_step(row, tokens)``: called with each
        row's newly emitted tokens (streaming); ``prompt_cache``: prefills to reuse and keep."""
        return run_lockstep([self.steps(prompt_ids, max_new_tokens, shape, temperature, top_k, top_p, seed,
                                        eos_token_id, draft_length, on_step, prompt_cache)])[0]

    @torch.no_grad()
    def steps(self, prompt_ids, max_new_tokens: int, shape: Shape | None = Chain(3), temperature: float = 0.0,
              top_k: int = 0, top_p: float = 1.0, seed: int = 0, eos_token_id=None, draft_length=None,
              on_step=None, prompt_cache: PromptCache | None = None):
        """:meth:`generate` as a generator that yields after each step and returns the
        :class:`BatchResult` (:func:`run_lockstep` steps several decodings in turn)."""
        shape = self._check(shape, draft_length, max_new_tokens, temperature, top_k, top_p)
        if self._on_device(shape, draft_length):
            eos = frozenset([eos_token_id] if isinstance(eos_token_id, int) else eos_token_id or ())
            return (yield from device_steps(self.target, self.proposer, prompt_ids, max_new_tokens, shape,
                                            Sampling(temperature, top_k, top_p), seed, eos, on_step, prompt_cache, self.backend))
        if self.target.device.type == "cuda":
            # (process-wide) cuDNN's attention builds an execution plan for each new shape, and decoding
            # makes new ones every step (a drafter's growing KV cache, each prompt's prefill)
            torch.backends.cuda.enable_cudnn_sdp(False)
        run = _Run(self, prompt_ids, max_new_tokens, shape, temperature, top_k, top_p, seed, eos_token_id,
                   on_step, prompt_cache)
        batch, cache, proposers = run.batch, run.cache, run.proposers
        while batch.rows:
            # plan: this step's shape; None (k = 0) is a plain step, the same as plain decoding's
            step_shape = shape if draft_length is None else _with_k(shape, draft_length(len(batch.rows)))
            drafts = None
            if step_shape is not None:
                # draft: the proposer reads what was kept since its last draft, then proposes
                run.draft(self._catch_up, proposers, batch)
                past = list(cache.lengths)
                drafts = run.draft(proposers.propose, step_shape)
                if cache.lengths != past:
                    cache.crop(past)  # a proposer that drafted with the target (TargetSteps) wrote there
            # verify: one target forward; accept each row's prefix; roll the cache back to it
            if drafts is None:
                v = self._plain_step(batch, cache, run.sampling, run.verify)
            elif isinstance(shape, (Chain, Block)):
                v = self._chain_step(batch, drafts, step_shape, cache, run.sampling, run.verify)
            else:
                v = self._tree_step(batch, drafts, step_shape, cache, run.sampling, run.verify)
            if v.handoff is not None:
                run.draft(v.handoff)
            if drafts is not None and draft_length is not None:
                draft_length.observe(v.drafted, v.accepted)
            run.draft_lengths.append(step_shape.max_depth if step_shape is not None else 0)
            # emit: rows that stop leave the batch (and their proposer)
            going = batch.emit(v)
            if len(going) < len(v.tokens):
                if proposers is not None:
                    proposers.select(going)
                batch.compact(cache)
            yield from run.clock.pause()
        return run.result()

    def _check(self, shape, draft_length, max_new_tokens, temperature, top_k, top_p) -> Shape | None:
        check_decoding(None, max_new_tokens, temperature, top_k, top_p)
        if self.proposer is None:
            return None
        check_shape(shape, self.proposer.shapes, self.proposer.name)
        check_decoding(shape, draft_vocab=self.proposer.draft_vocab or self.target.vocab_size)
        if draft_length is not None and not isinstance(shape, (Chain, Block)):
            raise DraftlabError(f"a draft-length rule applies to chain and block shapes, not {shape.method}")
        return shape

    def _on_device(self, shape, draft_length) -> bool:
        """Whether this decoding runs the device loop (``loop``), or why it cannot."""
        if self.loop == "host" or (self.loop == "auto" and self.target.device.type != "cuda"):
            return False
        why = None
        if self.proposer is not None:
            if not isinstance(self.proposer, DraftsOnDevice):
                why = f"proposer '{self.proposer.name}' does not draft on the device"
            elif getattr(shape, "min_confidence", 0):
                why = "min_confidence cuts each row's draft on its own"
            elif draft_length is not None:
                why = "a draft-length rule changes k between steps"
            else:
                why = self.proposer.refuses_on_device(shape)
        if why is not None and self.loop == "device":
            raise DraftlabError(f"the device loop cannot run this decoding: {why}")
        return why is None

    def _catch_up(self, proposers, batch: _Batch) -> None:
        """Advance each row's proposer by every step it kept since its last draft, as one
        longer accepted run: plain steps in between cost no drafter work."""
        rows = [b for b, kept in enumerate(batch.unread) if kept]
        if not rows:
            return
        device = self.target.device
        tokens = [device_ints([t for v, p in batch.unread[b] for t in v.tokens[p]], device) for b in rows]
        hidden = []
        for b in rows:
            parts = [v.row_hidden(p) for v, p in batch.unread[b]]
            hidden.append({i: torch.cat([x[i] for x in parts], dim=1) for i in parts[0]})
        proposers.advance(tokens, hidden, rows)
        for b in rows:
            batch.unread[b] = []

    def _plain_step(self, batch: _Batch, cache, sampling: Sampling, verify) -> _Verified:
        """One token per row: the forward over each row's last token."""
        device = self.target.device
        last = [0] * cache.batch_size  # idle rows: a dummy token
        for s, r in zip(batch.slots, batch.rows):
            last[s] = batch.last[r]
        ids = device_ints(last, device)[:, None]
        past = list(cache.lengths)
        out = verify(self.target, ids, layers=self.layers, cache=cache, logits="last")
        tokens = verify(next_tokens, _in_row_order(out.logits[:, -1], batch.slots), sampling)
        batch.keep(cache, past, [1] * len(batch.rows))
        zeros = [0] * len(tokens)
        return _Verified([[t] for t in tokens], zeros, zeros, zeros, out.hidden, list(batch.slots), [_FIRST] * len(tokens))

    def _chain_step(self, batch: _Batch, drafts, shape, cache, sampling: Sampling, verify) -> _Verified:
        """The forward over ``[last, d_1..d_k]`` per row (chains padded to the longest); each row
        keeps its last token and its accepted drafts."""
        device = self.target.device
        ids, probs = map(list, zip(*(checked_chain(d, shape, self.target, self.proposer.name) for d in drafts)))
        N = 1 + max(t.numel() for t in ids)
        # each row's [last, d_1..d_k] written by one scatter, whatever the batch size
        cells = [s * N for s in batch.slots] + [s * N + 1 + j for s, t in zip(batch.slots, ids) for j in range(t.numel())]
        inputs = batch.inputs(cache, N, device).view(-1)
        inputs[device_ints(cells, device)] = torch.cat([device_ints([batch.last[r] for r in batch.rows], device), *ids])
        inputs = inputs.view(-1, N)
        positions = mask = None
        branches = [d.branch for d in drafts]
        if any(branches):
            positions = torch.arange(N, device=device).repeat(cache.batch_size, 1)
            mask = torch.ones(N, N, dtype=torch.bool).tril().repeat(cache.batch_size, 1, 1)
            inputs, positions, mask = self._add_branches(batch, branches, inputs, positions, mask)
            mask = mask.to(device)
        past = list(cache.lengths)
        out = verify(self.target, inputs, layers=self.layers, cache=cache, position_ids=positions, attn_mask=mask, logits="all")
        handoff = _branch_handoff(batch, branches, out.logits, N)
        tokens, accepted = verify(accept_chains, ids, _in_row_order(out.logits[:, :N], batch.slots), sampling, probs, self.backend)
        batch.keep(cache, past, [n + 1 for n in accepted])
        drafted = [t.numel() for t in ids]
        return _Verified(tokens, accepted, drafted, drafted, out.hidden, list(batch.slots), [slice(0, n + 1) for n in accepted],
                         handoff)

    def _tree_step(self, batch: _Batch, trees: list[DraftTree], shape, cache, sampling: Sampling, verify) -> _Verified:
        """The forward over ``[last, tree nodes...]`` per row, each node attending to its
        ancestors (trees padded to the largest); each row keeps its root and accepted path."""
        device = self.target.device
        checked = [checked_tree(t, shape, self.target, self.proposer.name) for t in trees]
        N = 1 + max(t.tokens.numel() for t in checked)
        tokens = batch.inputs(cache, N, device)
        parents = torch.full(tokens.shape, -1, dtype=torch.long, device=device)
        depth = torch.zeros_like(tokens)
        mask = torch.eye(N, dtype=torch.bool).repeat(cache.batch_size, 1, 1)  # padding nodes see only themselves
        for b, (s, t) in enumerate(zip(batch.slots, checked)):
            n = t.tokens.numel() + 1
            tokens[s, 0] = batch.last[batch.rows[b]]
            tokens[s, 1:n], parents[s, 1:n], depth[s, 1:n] = t.tokens, t.parents, t.depth
            mask[s, :n, :n] = ancestor_mask(parents[s, :n].cpu())
        branches = [t.branch for t in trees]
        inputs, positions = tokens, depth
        if any(branches):
            inputs, positions, mask = self._add_branches(batch, branches, tokens, depth, mask)
        past = list(cache.lengths)
        out = verify(self.target, inputs, layers=self.layers, cache=cache,
                     position_ids=positions, attn_mask=mask.to(device), logits="all")
        handoff = _branch_handoff(batch, branches, out.logits, N)
        slots = batch.slots
        path, emitted, accepted = verify(accept_trees, tokens[slots], parents[slots], out.logits[slots, :N], sampling, self.backend)
        paths = [path[b, : n + 1] for b, n in enumerate(accepted)]
        batch.keep(cache, past, [0] * len(slots))  # idle rows to 0; active rows to their past, then their path
        cache.keep([past[s] for s in slots], [past[s] + x for s, x in zip(slots, paths)], slots)
        return _Verified(emitted, accepted, [t.tokens.numel() for t in checked], depth[slots].max(1).values.tolist(),
                         out.hidden, list(slots), paths, handoff)

    def _add_branches(self, batch: _Batch, branches, inputs, positions, mask):
        """Append each row's :class:`Branch` after its ``N`` draft inputs (padded to the longest
        branch): ``inputs`` and ``positions`` [rows, N] become [rows, N + E], the CPU ``mask``
        [rows, N, N] becomes [rows, N + E, N + E]. A branch input sees the last token (column 0)
        and what its own mask allows; draft inputs never see the branch; padding sees itself."""
        device = inputs.device
        limit = self.proposer.branch_inputs if isinstance(self.proposer, Branching) else 0
        for b in branches:
            if b is not None:
                checked_branch(b, limit, self.target.vocab_size, self.proposer.name)
        B, N = inputs.shape
        E = max(b.tokens.numel() for b in branches if b is not None)
        inputs = torch.cat([inputs, inputs.new_zeros(B, E)], 1)
        positions = torch.cat([positions, positions.new_ones(B, E)], 1)
        grown = torch.eye(N + E, dtype=torch.bool).repeat(B, 1, 1)
        grown[:, :N, :N] = mask
        for s, b in zip(batch.slots, branches):
            if b is None:
                continue
            e = b.tokens.numel()
            inputs[s, N : N + e] = b.tokens.to(device)
            positions[s, N : N + e] = b.positions.to(device)
            grown[s, N : N + e, 0] = True
            grown[s, N : N + e, N : N + e] = b.mask.cpu()
        return inputs, positions, grown


def _in_row_order(t: torch.Tensor, slots: list[int]) -> torch.Tensor:
    """``t``'s cache rows in the order of the rows still decoding (``slots``: each one's cache
    row); the index goes to the device through pinned memory (a list index would wait)."""
    return t if slots == list(range(t.shape[0])) else t[device_ints(slots, t.device)]


def _branch_handoff(batch: _Batch, branches, logits: torch.Tensor, N: int):
    """What hands each branch the target's logits after its inputs (columns ``N..`` of its
    row), run as draft time once the step is verified; None without branches."""
    todo = [(b, logits[s, N : N + b.tokens.numel()]) for s, b in zip(batch.slots, branches) if b is not None]
    if not todo:
        return None
    return lambda: [b.on_logits(x) for b, x in todo]


class TargetSteps:
    """The target and its KV cache between two steps, for a proposer that drafts with the target
    itself (:class:`~draftlab.inference.proposer.DraftsWithTarget`): :meth:`forward` runs the target over one row of inputs
    per sequence still decoding, written after each row's kept tokens and what earlier forwards of
    the same draft wrote. The decoder rolls the cache back once ``propose`` returns, so what a
    draft wrote is overwritten by the verify forward. Rows are the sequences still decoding, in
    the order the proposer's rows are (finished ones leave), so such a proposer drafts every row
    at once (a :class:`~draftlab.inference.proposer.BatchProposer`); a batch of one is one row."""

    def __init__(self, target, cache, batch: _Batch):
        self.target, self._cache, self._batch = target, cache, batch

    @property
    def rows(self) -> int:
        return len(self._batch.slots)

    def lengths(self) -> list[int]:
        """Each row's tokens in the cache (kept and drafted so far): its next input's position."""
        return [self._cache.lengths[s] for s in self._batch.slots]

    def record_next_forward(self) -> AttentionRecorder:
        """Have the next forward over the cache record its attention scores for the rows decoding
        now, in their order (:class:`~draftlab.models.sparse_attention.AttentionRecorder`): set
        when ``propose`` returns, that forward is the step's verify pass."""
        self._cache.recorder = AttentionRecorder(self._cache.k.shape[0], self._batch.slots)
        return self._cache.recorder

    def forward(self, input_ids: torch.Tensor, *, skip=(), position_ids: torch.Tensor | None = None,
                attn_mask: torch.Tensor | None = None, logits: str | None = "all", keys: SparseKeys | None = None):
        """The target over ``input_ids`` [rows, T] (``skip``, ``position_ids`` offsets [rows, T]
        and ``attn_mask`` [rows, T, T] among the new inputs, or over each row's past and new slots,
        ``keys`` [L, rows, H_kv, M] each row's past slots per layer and KV head, as
        :meth:`Target.forward` takes them with a ragged cache); a TargetOutput of the rows."""
        slots, B = self._batch.slots, self._cache.batch_size
        R, T = input_ids.shape
        if R != len(slots):
            raise ValueError(f"TargetSteps.forward: {R} rows of inputs for {len(slots)} sequences decoding")
        device = self.target.device
        ids = torch.zeros(B, T, dtype=torch.long, device=device)
        ids[slots] = input_ids.to(device)
        if position_ids is not None:
            full = torch.arange(T, device=device).repeat(B, 1)
            full[slots] = position_ids.to(device)
            position_ids = full
        if attn_mask is not None:
            full = torch.zeros(B, T, attn_mask.shape[-1], dtype=torch.bool, device=device)
            full[:, :, :T] = torch.eye(T, dtype=torch.bool, device=device)  # idle rows see themselves
            full[slots] = attn_mask.to(device).expand(R, T, -1)
            attn_mask = full
        if keys is not None:  # idle rows list no past slot: they see their own inputs only
            index = keys.index.new_zeros(keys.index.shape[0], B, *keys.index.shape[2:])
            valid = torch.zeros(index.shape, dtype=torch.bool, device=index.device)
            index[:, slots], valid[:, slots] = keys.index, keys.valid
            keys = SparseKeys(index, valid)
        out = self.target.forward(ids, cache=self._cache, position_ids=position_ids, attn_mask=attn_mask,
                                  logits=logits, skip=skip, keys=keys)
        out.logits = out.logits[slots] if out.logits is not None else None
        return out


# ---------------------------------------------------------------------- one decoding's state
class _Run:
    """One decoding's set-up (cache, prefill, proposers) and its clocks; ``result()`` at the end."""

    def __init__(self, dec: Decoder, prompt_ids, max_new_tokens, shape, temperature, top_k, top_p, seed,
                 eos_token_id, on_step, prompt_cache):
        target, device = dec.target, dec.target.device
        self.clock = Clock(device)
        self.draft, self.verify = Stopwatch(self.clock), Stopwatch(self.clock)
        self.t0 = self.clock()
        prompts = [torch.as_tensor(p, dtype=torch.long).reshape(-1).to(device) for p in prompt_ids]
        if not prompts or any(p.numel() == 0 for p in prompts):
            raise DraftlabError("prompt_ids: " + ("the batch is empty" if not prompts else "a prompt is empty"))
        gen = torch.Generator(device=device)
        gen.manual_seed(seed)
        self.sampling = Sampling(temperature, top_k, top_p, gen)
        room = max(p.numel() for p in prompts) + max_new_tokens + 1
        if shape is not None:
            room += shape.max_nodes + (dec.proposer.branch_inputs if isinstance(dec.proposer, Branching) else 0)
        self.cache = target.new_cache(len(prompts), room, ragged=True)
        slots = _cache_slots(prompts)
        logits, hidden = prefill(target, prompts, slots, dec.layers, self.cache, self.verify, prompt_cache)
        first = next_tokens(logits, self.sampling)
        eos = frozenset([eos_token_id] if isinstance(eos_token_id, int) else eos_token_id or ())
        self.batch = _Batch(slots, max_new_tokens, eos, on_step, track_unread=dec.proposer is not None)
        going = self.batch.emit(_Verified.first(first))
        self.batch.compact(self.cache)
        self.proposers = None
        if dec.proposer is not None:
            # a batch of one drafts with the proposer itself (its state stays readable after decoding)
            self.proposers = RowProposers([dec.proposer]) if len(prompts) == 1 else dec.proposer.batched(len(going), shape)
            self.proposers.configure(self.sampling)
            self.proposers.use_target(TargetSteps(target, self.cache, self.batch))
            for b, r in enumerate(going):
                self.proposers.start(b, prompts[r], hidden[r], first[r])
        self.t1 = self.clock()  # the drafter's pass over the prompts belongs to the prefill, as in a serving engine
        self.verify.spans.clear()
        self.draft_lengths: list[int] = []

    def result(self) -> BatchResult:
        t2, clock = self.clock(), self.clock
        prefill, draft, verify = clock.seconds(self.t0, self.t1), self.draft.seconds, self.verify.seconds
        decode = clock.seconds(self.t1, t2) - clock.total(clock.suspended)
        b = self.batch
        rows = [GenerationResult(e.tokens, stop_reason=e.stop_reason, num_steps=len(b.stats[r][0]),
                                 **dict(zip(("accept_lengths", "num_drafted", "draft_depths"), b.stats[r])))
                for r, e in enumerate(b.emitters)]
        return BatchResult(rows, prefill_time=prefill, draft_time=draft, verify_time=verify,
                           other_time=decode - draft - verify, total_time=prefill + decode, num_steps=len(self.draft_lengths),
                           draft_lengths=self.draft_lengths)


@dataclass
class _Verified:
    """One step, per active row."""

    tokens: list[list[int]]  # accepted drafts, then the correction or bonus token
    accepted: list[int]  # drafts accepted (tree: the accepted path's depth)
    drafted: list[int]  # draft tokens / tree nodes verified
    depth: list[int]  # longest acceptable run offered
    # the forward's hidden states ({layer: [cache rows, inputs, H]}), each row's cache row and the
    # positions of its kept inputs there: sliced per row only when its drafter reads them
    # (:meth:`row_hidden`), so that plain steps cost what plain decoding's do
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)
    slots: list[int] = field(default_factory=list)
    kept: list = field(default_factory=list)  # slices or index tensors
    handoff: Callable[[], object] | None = None  # hands the drafts' branches their logits

    @classmethod
    def first(cls, tokens: list[int]) -> "_Verified":
        """The prefill's token of each row (no step: nothing to record)."""
        return cls([[t] for t in tokens], [], [], [])

    def row_hidden(self, p: int) -> dict[int, torch.Tensor]:
        """Active row p's hidden states of its kept inputs, {layer: [1, kept, H]}."""
        s, kept = self.slots[p], self.kept[p]
        return {i: h[s : s + 1, kept] for i, h in self.hidden.items()}


_FIRST = slice(0, 1)


class _Batch:
    """The rows still decoding: their index in the batch, cache row, emitter, last token, step
    records and the steps their proposer has not read yet.

    A finished row stays in the cache, idle (fed a dummy token whose slots are never kept),
    until half of the cache's rows are idle: dropping a row copies the whole cache, so doing it
    once per halving instead of once per finished row bounds the copies by log2(B)."""

    def __init__(self, slots: list[int], max_new_tokens: int, eos, on_step=None, track_unread: bool = True):
        n = len(slots)
        self.track_unread = track_unread
        self.rows = list(range(n))
        self.slots = list(slots)  # cache row of each active row
        self.emitters = [Emitter(max_new_tokens, eos, on_step and (lambda t, r=r: on_step(r, t))) for r in range(n)]
        self.last: list[int] = [0] * n
        self.stats = [([], [], []) for _ in range(n)]  # per row: accepted, drafted, depth per step
        self.unread: list[list[tuple[_Verified, int]]] = [[] for _ in range(n)]  # per active row

    def emit(self, v: _Verified) -> list[int]:
        """Record the step and emit each active row's tokens; returns the positions (among the
        active rows) of the rows that go on, and drops the others."""
        going = []
        for p, (r, new) in enumerate(zip(self.rows, v.tokens)):
            if v.accepted:
                for record, x in zip(self.stats[r], (v.accepted[p], v.drafted[p], v.depth[p])):
                    record.append(x)
            if not self.emitters[r].emit(new):
                going.append(p)
                self.last[r] = new[-1]
                if self.track_unread and v.accepted:
                    self.unread[p].append((v, p))
        self.rows = [self.rows[p] for p in going]
        self.slots = [self.slots[p] for p in going]
        self.unread = [self.unread[p] for p in going]
        return going

    def compact(self, cache) -> None:
        """Drop the idle rows from ``cache`` once they are half of it or more; until then an
        idle row's length is 0 (its dummy inputs need no room beyond what the cache has)."""
        if self.slots and len(self.slots) <= cache.batch_size // 2:
            kept = sorted(self.slots)  # in cache order: rows stay laid out by length
            cache.select(kept)
            self.slots = [kept.index(s) for s in self.slots]
        else:
            self.keep(cache, cache.lengths, [0] * len(self.slots))

    def inputs(self, cache, width: int, device) -> torch.Tensor:
        """[cache rows, width] input ids, zeros (idle rows keep them)."""
        return torch.zeros(cache.batch_size, width, dtype=torch.long, device=device)

    def keep(self, cache, past: list[int], kept: list[int]) -> None:
        """Roll back: each active row's cache length to its ``past`` plus what it ``kept``, each
        idle row's to 0."""
        lengths = [0] * cache.batch_size
        for s, n in zip(self.slots, kept):
            lengths[s] = past[s] + n
        cache.crop(lengths)


# ---------------------------------------------------------------------- shared pieces
def _with_k(shape: Chain | Block, k: int) -> Chain | Block | None:
    return None if k == 0 else shape if k == shape.k else dataclasses.replace(shape, k=k)


def next_tokens(logits: torch.Tensor, sampling: Sampling) -> list[int]:
    """The target's next token of each row of ``logits`` [B, V], drawn as plain decoding draws."""
    if sampling.greedy:
        return logits.max(-1).indices.tolist()
    return sampling.sample(sampling.probs(logits)).tolist()


def checked_chain(draft: ChainDraft, shape: Chain | Block, target, name: str):
    """A proposer's chain draft as (tokens, probabilities or None) on the target's device,
    checked against ``shape`` and the vocabulary (``name``: the proposer, for the error)."""
    device, vocab = target.device, target.vocab_size
    drafts = draft.tokens.reshape(-1).to(device=device, dtype=torch.long)
    nd = drafts.numel()
    if nd > shape.k:
        raise ValueError(f"proposer '{name}' drafted {nd} tokens, more than k={shape.k}")
    q = draft.probs
    if q is not None:
        q = q.to(device=device, dtype=torch.float32)
        if q.shape != (nd, vocab):
            raise ValueError(f"proposer '{name}': draft probs {list(q.shape)} != [{nd}, {vocab}]")
    return drafts, q


def checked_tree(tree: DraftTree, shape: Shape, target, name: str) -> DraftTree:
    """A proposer's tree on the target's device, validated and within ``shape``'s bounds."""
    tree = DraftTree(*(t.reshape(-1).to(device=target.device, dtype=torch.long) for t in (tree.tokens, tree.parents, tree.depth)))
    validate_tree(tree, target.vocab_size)
    nd = tree.tokens.numel()
    if nd > shape.max_nodes:
        raise ValueError(f"proposer '{name}' drafted {nd} tree nodes, more than the {shape.kind} allows ({shape.max_nodes})")
    if nd and int(tree.depth.max()) > shape.max_depth:
        raise ValueError(f"proposer '{name}' drafted a tree deeper than the {shape.kind} allows ({shape.max_depth})")
    return tree


def checked_branch(branch: Branch, limit: int, vocab: int, name: str) -> None:
    """A proposer's :class:`Branch` within its declared size and the vocabulary."""
    e = branch.tokens.numel()
    if e > limit:
        raise ValueError(f"proposer '{name}' sent a branch of {e} inputs, more than the {limit} it declares")
    if branch.tokens.shape != (e,) or branch.positions.shape != (e,) or branch.mask.shape != (e, e):
        raise ValueError(f"proposer '{name}': a branch needs tokens and positions [E] and a mask [E, E], E = {e}")
    if e and (int(branch.tokens.min()) < 0 or int(branch.tokens.max()) >= vocab or int(branch.positions.min()) < 1):
        raise ValueError(f"proposer '{name}': branch tokens must be in the vocabulary and positions >= 1")


def _cache_slots(prompts) -> list[int]:
    """The cache row of each prompt: rows in order of prompt length, so that rows of similar
    length are neighbours and attend together (``models.target.attention_groups``)."""
    slots = [0] * len(prompts)
    for s, r in enumerate(sorted(range(len(prompts)), key=lambda r: prompts[r].numel())):
        slots[r] = s
    return slots


def run_lockstep(decodings) -> list:
    """Run stepwise decodings (:meth:`Decoder.steps`) one step of each in turn until all have
    finished; their results in the same order. Each one's times count only its own steps. Why:
    decodings timed back to back differ by the machine's slow spells, which outlast a decoding;
    in lockstep a spell slows every one of them."""
    results, going = [None] * len(decodings), dict(enumerate(decodings))
    while going:
        for i, steps in list(going.items()):
            try:
                next(steps)
            except StopIteration as done:
                results[i] = done.value
                del going[i]
    return results


# ---------------------------------------------------------------------- one sequence, plain decoding
def single(res: BatchResult) -> GenerationResult:
    """A batch of one as one sequence's result, with the batch's time split."""
    row = res.rows[0]
    row.prefill_time, row.draft_time, row.total_time = res.prefill_time, res.draft_time, res.total_time
    row.verify_time = res.verify_time + res.other_time
    return row


class SpeculativeDecoder:
    """``SpeculativeDecoder(target, proposer).generate(prompt_ids, max_new_tokens, shape=Chain(5))``:
    one sequence, the batch of one of :class:`Decoder`."""

    def __init__(self, target, proposer: Proposer, backend: str = "auto"):
        self.batched = Decoder(target, proposer, backend)

    def generate(self, prompt_ids, max_new_tokens: int, shape: Shape = Chain(5), temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int = 0, eos_token_id=None, on_step=None) -> GenerationResult:
        """``on_step(tokens)``: called with each step's newly emitted tokens (streaming)."""
        return single(self.batched.generate(
            [prompt_ids], max_new_tokens, shape, temperature, top_k, top_p, seed, eos_token_id,
            on_step=on_step and (lambda row, tokens: on_step(tokens)),
        ))


def generate_plain_batch(target, prompt_ids, max_new_tokens: int, temperature: float = 0.0, top_k: int = 0,
                         top_p: float = 1.0, seed: int = 0, eos_token_id=None,
                         prompt_cache: PromptCache | None = None) -> BatchResult:
    """Plain decoding of a batch: one target forward per step over every row still decoding."""
    return Decoder(target).generate(prompt_ids, max_new_tokens, None, temperature, top_k, top_p, seed, eos_token_id,
                                    prompt_cache=prompt_cache)


def generate_plain(target, prompt_ids, max_new_tokens: int, temperature: float = 0.0, top_k: int = 0,
                   top_p: float = 1.0, seed: int = 0, eos_token_id=None) -> GenerationResult:
    """Plain decoding of one sequence (the batch of one)."""
    return single(generate_plain_batch(target, [prompt_ids], max_new_tokens, temperature, top_k, top_p, seed, eos_token_id))
