"""Speculative decoding (chain, block and tree) and the plain baseline, for one sequence or a
batch, on the target's KV cache.

Plain and speculative decoding share the prefill, the sampling rule (:func:`process_logits`),
the stopping rule and the step that emits one token per row, so a speedup compares like with
like: one prefill, then per step one target forward (plain: over the last token; speculative:
over ``[last token, drafts...]``). A speculative step reads top to bottom: draft, one target
forward, accept (``kernels.accept_chains`` / ``accept_trees``), roll the cache back to the kept
tokens (chain: ``crop``; tree: ``keep`` of the accepted path's slots). The bonus/correction
token becomes the next step's "last token" and is written to the cache by that next forward.
Nothing is ever re-prefilled; a :class:`PromptCache` handed to both decoders keeps each prompt's
prefill for its next decoding (evaluations decode every prompt once per configuration).

B sequences decode at once, each with its own prompt length, its own accepted length per step
and its own end; one sequence is the batch of one (:class:`SpeculativeDecoder`,
:func:`generate_plain`). The target's cache holds one length per row
(:class:`~draftlab.models.target.RaggedKVCache`): one forward verifies every row's drafts
(chains padded to the longest, trees padded to the largest), the ragged verify kernels accept
each row's prefix, and each row keeps its own slots. A row that stops (eos or its token budget)
leaves the batch: its proposer at once, its cache row once half the rows have left (each drop
copies the cache), so later steps cost about what the rows still decoding cost.

Drafting goes through :meth:`Proposer.batched`: by default one fork of the proposer per row,
drafting row after row; a family may draft all rows at once (EAGLE's chains:
:class:`~draftlab.inference.eagle.EagleChains`). A step's time is split into draft (proposer),
verify (the target's forward and the verify kernels) and the rest (building inputs, rolling
back, bookkeeping); the proposers' pass over the prompts counts as prefill, as in a serving
engine.

Greedy outputs of a row equal plain *batched* decoding of the same batch. They can differ from
the same prompt decoded alone: a batch changes the shapes of the matrix products, and float
rounding then decides near-ties differently. :mod:`draftlab.inference.batch_eval` counts such
rows instead of hiding them.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from draftlab.errors import DraftlabError
from draftlab.inference.metrics import AcceptanceStats
from draftlab.inference.proposer import (
    Block, Chain, ChainDraft, DraftTree, Proposer, RowProposers, Sampling, Shape, check_shape,
)
from draftlab.inference.tree import ancestor_mask, validate_tree
from draftlab.kernels import accept_chains, accept_trees


@dataclass
class GenerationResult:
    tokens: list[int]  # generated tokens (eos included when it stopped the generation)
    accept_lengths: list[int] = field(default_factory=list)  # per verify step: drafts accepted (tree: depth)
    num_drafted: list[int] = field(default_factory=list)  # per verify step: draft tokens / tree nodes verified
    draft_depths: list[int] = field(default_factory=list)  # per verify step: longest acceptable run offered
    draft_time: float = 0.0  # proposer (propose, advance), seconds
    verify_time: float = 0.0  # the decoding loop but the proposer: target forwards, verification, roll-back
    prefill_time: float = 0.0  # the target's forward over the prompt and the proposer's start
    total_time: float = 0.0
    stop_reason: str = "length"  # "length" or "eos"
    num_steps: int = 0  # target forwards after the prefill

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.total_time if self.total_time > 0 else 0.0

    def stats(self) -> AcceptanceStats:
        s = AcceptanceStats()
        s.add_many(self.accept_lengths, self.num_drafted, self.draft_depths)
        return s


# ---------------------------------------------------------------------- shared pieces
def _as_prompt(prompt_ids, device) -> torch.Tensor:
    ids = torch.as_tensor(prompt_ids, dtype=torch.long).reshape(-1)
    if ids.numel() == 0:
        raise DraftlabError("prompt_ids: the prompt is empty")
    return ids.to(device)


def _eos_set(eos_token_id) -> frozenset[int]:
    if eos_token_id is None:
        return frozenset()
    if isinstance(eos_token_id, int):
        return frozenset([eos_token_id])
    return frozenset(int(e) for e in eos_token_id)


def _check_sampling(max_new_tokens: int, temperature: float, top_k: int, top_p: float) -> None:
    if max_new_tokens < 1:
        raise DraftlabError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if temperature < 0:
        raise DraftlabError(f"temperature must be >= 0, got {temperature}")
    if top_k < 0:
        raise DraftlabError(f"top_k must be >= 0 (0 = off), got {top_k}")
    if not 0.0 < top_p <= 1.0:
        raise DraftlabError(f"top_p must be in (0, 1], got {top_p}")


def _sampling(device, temperature: float, top_k: int, top_p: float, seed: int) -> Sampling:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return Sampling(temperature, top_k, top_p, gen)


class _Clock:
    """perf_counter that waits for queued GPU work, so the split between phases is honest, less
    the time its decoding spent suspended between steps (:func:`run_lockstep`)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.suspended = 0.0

    def __call__(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - self.suspended

    def pause(self):
        """Yield between two steps; the time until resumed is other decodings', not this one's."""
        t = self()
        yield
        self.suspended += self() - t


def run_lockstep(decodings) -> list:
    """Run stepwise decodings (``plain_batch_steps``, ``BatchedSpeculativeDecoder.steps``) one
    step of each in turn until all have finished; their results in the same order. Each one's
    times count only its own steps. Why: decodings compared back to back on this VM differ by
    its slow spells, which outlast a decoding (three runs of the same plain-only steps at batch
    8 read 0.94x, 1.01x and 1.04x plain decoding); in lockstep a spell slows every one of them."""
    results, going = [None] * len(decodings), dict(enumerate(decodings))
    while going:
        for i, steps in list(going.items()):
            try:
                next(steps)
            except StopIteration as done:
                results[i] = done.value
                del going[i]
    return results


class _Emitter:
    """Collects emitted tokens; applies max_new_tokens and eos (truncating within a step) and
    streams what it kept to ``on_step``."""

    def __init__(self, max_new_tokens: int, eos: frozenset[int], on_step=None):
        self.tokens: list[int] = []
        self.max_new_tokens, self.eos, self.on_step = max_new_tokens, eos, on_step
        self.stop_reason: str | None = None

    def emit(self, new: list[int]) -> bool:
        """Append ``new``; True once generation is over."""
        before = len(self.tokens)
        for t in new:
            self.tokens.append(t)
            if t in self.eos:
                self.stop_reason = "eos"
                break
            if len(self.tokens) >= self.max_new_tokens:
                self.stop_reason = "length"
                break
        if self.on_step is not None:
            self.on_step(self.tokens[before:])
        return self.stop_reason is not None


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


@dataclass
class BatchResult:
    """One batch's generation: per-row results and the batch's time split."""

    rows: list[GenerationResult]
    prefill_time: float = 0.0  # the target's forwards over the prompts, and the proposers' start
    draft_time: float = 0.0  # proposers: propose, advance
    verify_time: float = 0.0  # target forwards after the prefill and the verify kernels
    other_time: float = 0.0  # the rest of the decoding loop
    total_time: float = 0.0
    num_steps: int = 0  # batched target forwards after the prefill
    draft_lengths: list[int] = field(default_factory=list)  # per step: the draft length asked (adaptive policy)

    @property
    def num_tokens(self) -> int:
        return sum(len(r.tokens) for r in self.rows)


class _Stopwatch:
    def __init__(self, device):
        self.clock = _Clock(device)
        self.seconds = 0.0

    def __call__(self, fn, *args, **kw):
        t0 = self.clock()
        out = fn(*args, **kw)
        self.seconds += self.clock() - t0
        return out


def _prompts(prompt_ids, device) -> list[torch.Tensor]:
    prompts = [_as_prompt(p, device) for p in prompt_ids]
    if not prompts:
        raise DraftlabError("prompt_ids: the batch is empty")
    return prompts


def _cache_slots(prompts) -> list[int]:
    """The cache row of each prompt: rows in order of prompt length, so that rows of similar
    length are neighbours and attend together (``models.target.attention_groups``)."""
    slots = [0] * len(prompts)
    for s, r in enumerate(sorted(range(len(prompts)), key=lambda r: prompts[r].numel())):
        slots[r] = s
    return slots


def _prefill(target, prompts, slots, layers, cache, sampling: Sampling, verify: _Stopwatch,
             prompt_cache: PromptCache | None = None):
    """Each prompt in its own forward, into its row ``slots[r]`` of ``cache`` (padding a batch
    of a 33- and a 2544-token prompt to one forward would compute the short one's padding), or
    copied from ``prompt_cache`` when it holds that prompt; returns each prompt's first token and
    its hidden states ({layer: [1, T_r, H]})."""
    if prompt_cache is not None and prompt_cache.target is not target:
        raise ValueError("prompt_cache: it holds another target's prefills")
    last, hidden = [], []
    for p, s in zip(prompts, slots):
        n = p.numel()
        done = prompt_cache.get(p, layers) if prompt_cache is not None else None
        if done is None:
            out = verify(target, p[None], layers=list(layers), cache=cache.row(s), logits="last")
            done = Prefilled(cache.k[:, s, :, :n].clone(), cache.v[:, s, :, :n].clone(), out.logits[0, -1], out.hidden)
            if prompt_cache is not None:
                prompt_cache.put(p, done)
        else:
            cache.k[:, s, :, :n] = done.k
            cache.v[:, s, :, :n] = done.v
        cache.lengths[s] = n  # what the row view filled or the copy wrote
        last.append(done.logits)
        hidden.append({i: done.hidden[i] for i in layers})
    return _next_tokens(torch.stack(last), sampling), hidden


@dataclass
class Prefilled:
    """One prompt's prefill: its K/V [L, H_kv, T, D], the logits at its last position and the
    hidden states of the layers asked ({layer: [1, T, H]})."""

    k: torch.Tensor
    v: torch.Tensor
    logits: torch.Tensor
    hidden: dict[int, torch.Tensor]

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, self.logits, *self.hidden.values()))


class PromptCache:
    """Prefills of whole prompts by one target, kept for the next decoding of the same prompt
    (a prefix cache at prompt granularity), least recently used out first beyond ``max_bytes``.

    Why: an evaluation decodes every prompt once per configuration and batch size, and the
    prefill is the same forward each time; on the AMD EPYC the prefill of 16 held-out prompts
    (10,600 tokens) took 40 s, against 10 s for decoding 48 tokens of them at batch 16. The
    copy gives the decoder the K/V, first token and hidden states the forward would."""

    def __init__(self, target, max_bytes: int = 2 << 30):
        self.target, self.max_bytes = target, max_bytes
        self._kept: OrderedDict[tuple[int, ...], Prefilled] = OrderedDict()
        self.bytes = self.hits = self.misses = 0

    def get(self, prompt: torch.Tensor, layers) -> Prefilled | None:
        """The prompt's prefill if kept with every layer in ``layers``; None counts a miss."""
        key = tuple(prompt.tolist())
        done = self._kept.get(key)
        if done is None or not set(layers) <= done.hidden.keys():
            self.misses += 1
            return None
        self._kept.move_to_end(key)
        self.hits += 1
        return done

    def put(self, prompt: torch.Tensor, done: Prefilled) -> None:
        key = tuple(prompt.tolist())
        if key in self._kept:
            self.bytes -= self._kept.pop(key).bytes
        if done.bytes > self.max_bytes:
            return
        self._kept[key] = done
        self.bytes += done.bytes
        while self.bytes > self.max_bytes:
            self.bytes -= self._kept.popitem(last=False)[1].bytes


def _next_tokens(logits: torch.Tensor, sampling: Sampling) -> list[int]:
    """The target's next token of each row of ``logits`` [B, V], drawn as plain decoding draws."""
    if sampling.greedy:
        return logits.max(-1).indices.tolist()
    return sampling.sample(sampling.probs(logits)).tolist()


class _Batch:
    """The rows still decoding: their index in the batch, their row of the KV cache, emitter and
    last token.

    A finished row stays in the cache, idle (fed a dummy token whose slots are never kept),
    until half of the cache's rows are idle: dropping a row copies the whole cache (sized by the
    longest prompt: ~2 GB for 16 rows of a 2,544-token prompt, 0.65 s on the AMD EPYC), so
    doing it once per halving instead of once per finished row bounds the copies by log2(B)."""

    def __init__(self, slots: list[int], max_new_tokens: int, eos, on_step=None):
        n = len(slots)
        self.rows = list(range(n))
        self.slots = list(slots)  # cache row of each active row
        self.emitters = [_Emitter(max_new_tokens, eos, on_step and (lambda t, r=r: on_step(r, t))) for r in range(n)]
        self.last: list[int] = [0] * n

    def emit(self, tokens: list[list[int]]) -> list[int]:
        """Emit each active row's tokens; returns the positions (in the active list) of rows
        that go on, and removes the others."""
        going = []
        for pos, (r, new) in enumerate(zip(self.rows, tokens)):
            if not self.emitters[r].emit(new):
                going.append(pos)
                self.last[r] = new[-1]
        self.rows = [self.rows[p] for p in going]
        self.slots = [self.slots[p] for p in going]
        return going

    def remaining(self) -> list[int]:
        """Each active row's tokens left before its budget ends."""
        return [self.emitters[r].max_new_tokens - len(self.emitters[r].tokens) for r in self.rows]

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
        """Set each active row's cache length to its ``past`` plus what it ``kept``, and each
        idle row's to 0."""
        lengths = [0] * cache.batch_size
        for s, n in zip(self.slots, kept):
            lengths[s] = past[s] + n
        cache.crop(lengths)


def _results(batch: _Batch, per_row: dict) -> list[GenerationResult]:
    return [
        GenerationResult(e.tokens, stop_reason=e.stop_reason, **{k: v[r] for k, v in per_row.items()})
        for r, e in enumerate(batch.emitters)
    ]


# ---------------------------------------------------------------------- plain decoding
@torch.no_grad()
def generate_plain_batch(target, prompt_ids, max_new_tokens: int, temperature: float = 0.0, top_k: int = 0,
                         top_p: float = 1.0, seed: int = 0, eos_token_id=None,
                         prompt_cache: PromptCache | None = None) -> BatchResult:
    """Plain autoregressive decoding of a batch: one target forward per step over every row
    still decoding. ``prompt_cache``: prefills to reuse and to keep (:class:`PromptCache`)."""
    return run_lockstep([plain_batch_steps(target, prompt_ids, max_new_tokens, temperature, top_k, top_p, seed,
                                           eos_token_id, prompt_cache)])[0]


@torch.no_grad()
def plain_batch_steps(target, prompt_ids, max_new_tokens: int, temperature: float = 0.0, top_k: int = 0,
                      top_p: float = 1.0, seed: int = 0, eos_token_id=None, prompt_cache: PromptCache | None = None):
    """:func:`generate_plain_batch` a step at a time: a generator that yields after each step
    and returns the :class:`BatchResult` (:func:`run_lockstep`)."""
    _check_sampling(max_new_tokens, temperature, top_k, top_p)
    device = target.device
    clock, verify = _Clock(device), _Stopwatch(device)
    t0 = clock()
    prompts = _prompts(prompt_ids, device)
    sampling = _sampling(device, temperature, top_k, top_p, seed)
    cache = target.new_cache(len(prompts), max(p.numel() for p in prompts) + max_new_tokens, ragged=True)
    slots = _cache_slots(prompts)
    first, _ = _prefill(target, prompts, slots, (), cache, sampling, verify, prompt_cache)
    t1 = clock()
    verify.seconds = 0.0
    batch = _Batch(slots, max_new_tokens, _eos_set(eos_token_id))
    batch.emit([[t] for t in first])
    batch.compact(cache)
    steps = 0
    while batch.rows:
        rows_before = len(batch.rows)
        batch.emit(_plain_step(target, batch, cache, sampling, verify).tokens)
        if len(batch.rows) < rows_before:  # as the speculative loop: only when rows left
            batch.compact(cache)
        steps += 1
        yield from clock.pause()
    t2 = clock()
    return BatchResult(
        _results(batch, {"num_steps": [len(e.tokens) - 1 for e in batch.emitters]}),
        prefill_time=t1 - t0, verify_time=verify.seconds, other_time=t2 - t1 - verify.seconds,
        total_time=t2 - t0, num_steps=steps,
    )


def generate_plain(target, prompt_ids, max_new_tokens: int, temperature: float = 0.0, top_k: int = 0,
                   top_p: float = 1.0, seed: int = 0, eos_token_id=None) -> GenerationResult:
    """Plain autoregressive decoding of one sequence (the batch of one)."""
    return _alone(generate_plain_batch(target, [prompt_ids], max_new_tokens, temperature, top_k, top_p, seed, eos_token_id))


def _alone(res: BatchResult) -> GenerationResult:
    """A batch of one as one sequence's result, with the batch's time split."""
    row = res.rows[0]
    row.prefill_time, row.draft_time, row.total_time = res.prefill_time, res.draft_time, res.total_time
    row.verify_time = res.verify_time + res.other_time
    return row


# ---------------------------------------------------------------------- speculative decoding
@dataclass
class _Verified:
    """One batched step, per active row."""

    tokens: list[list[int]]  # accepted drafts, then the correction or bonus token
    accepted: list[int]  # drafts accepted (tree: the accepted path's depth)
    drafted: list[int]  # draft tokens / tree nodes verified
    depth: list[int]  # longest acceptable run offered
    # the forward's hidden states ({layer: [cache rows, inputs, H]}), each row's cache row and the
    # positions of its kept inputs there: sliced per row only when its drafter reads them
    # (:meth:`row_hidden`), since after a plain step it may never (at batch 8 on the AMD EPYC the
    # speculative decoder's plain step spent 0.21 ms more than plain decoding's outside the
    # forward; 0.05-0.10 ms with the slicing deferred and the unread tokens counted as they come)
    hidden: dict[int, torch.Tensor]
    slots: list[int]
    kept: list  # slices or index tensors

    def row_hidden(self, p: int) -> dict[int, torch.Tensor]:
        """Active row p's hidden states of its kept inputs, {layer: [1, kept, H]}."""
        s, kept = self.slots[p], self.kept[p]
        return {i: h[s : s + 1, kept] for i, h in self.hidden.items()}


def _plain_step(target, batch: _Batch, cache, sampling: Sampling, verify: _Stopwatch, layers=()) -> _Verified:
    """One token per active row: plain decoding's step, and the speculative decoder's when it
    drafts nothing (an adaptive policy's k = 0), so that such a step costs what plain decoding's does."""
    ids = batch.inputs(cache, 1, target.device)
    ids[batch.slots, 0] = torch.tensor([batch.last[r] for r in batch.rows], device=target.device)
    past = list(cache.lengths)
    out = verify(target, ids, layers=list(layers), cache=cache, logits="last")
    tokens = verify(_next_tokens, out.logits[batch.slots, -1], sampling)
    batch.keep(cache, past, [1] * len(batch.rows))
    zeros = [0] * len(tokens)
    return _Verified([[t] for t in tokens], zeros, zeros, zeros, out.hidden, list(batch.slots), [_FIRST] * len(tokens))


_FIRST = slice(0, 1)


class SpeculativeDecoder:
    """``SpeculativeDecoder(target, proposer).generate(prompt_ids, max_new_tokens, shape=Chain(5), ...)``:
    one sequence, the batch of one of :class:`BatchedSpeculativeDecoder`."""

    def __init__(self, target, proposer: Proposer, backend: str = "auto"):
        self.batched = BatchedSpeculativeDecoder(target, proposer, backend)

    def generate(self, prompt_ids, max_new_tokens: int, shape: Shape = Chain(5), temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int = 0, eos_token_id=None, on_step=None) -> GenerationResult:
        """Generate up to ``max_new_tokens`` tokens after ``prompt_ids``, drafting ``shape`` each
        step. ``on_step(tokens)``, when given, is called with each batch of newly emitted tokens
        (streaming)."""
        return _alone(self.batched.generate(
            [prompt_ids], max_new_tokens, shape, temperature, top_k, top_p, seed, eos_token_id,
            on_step=on_step and (lambda row, tokens: on_step(tokens)),
        ))


class BatchedSpeculativeDecoder:
    """``BatchedSpeculativeDecoder(target, proposer).generate([ids, ...], max_new_tokens, shape=Chain(3))``.

    ``policy`` (chain and block shapes): an object with ``choose(batch_size, previous, lengths,
    remaining, pending) -> k`` (0 = a plain step, the same step as plain decoding's; ``previous``:
    each row's last step's (drafted, accepted), None before its first; ``lengths``: the tokens each
    row holds in the KV cache; ``remaining``: each row's tokens left before ``max_new_tokens``;
    ``pending``: the tokens each row's drafter has yet to read, kept since its last draft) and
    ``observe(batch_size, k, accepted, draft_seconds, step_seconds, catch_up)``, after every step
    it chose (``draft_seconds``: the proposing of k positions, None on a plain step; ``catch_up``: the
    drafter's (seconds, tokens) reading what was pending, None where nothing was; ``step_seconds``:
    the rest of the step); and, optionally, ``held() -> n``: after a choice of 0, the plain steps
    it decided at once, that one included, of which the decoder takes the other n - 1 without
    asking or reporting them, unless a row ends first. Without a policy every step drafts
    ``shape.k``."""

    def __init__(self, target, proposer: Proposer, backend: str = "auto"):
        self.target, self.proposer, self.backend = target, proposer, backend

    def generate(self, prompt_ids, max_new_tokens: int, shape: Shape = Chain(3), temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int = 0, eos_token_id=None, policy=None,
                 on_step=None, prompt_cache: PromptCache | None = None) -> BatchResult:
        """``on_step(row, tokens)``, when given, is called with each row's newly emitted tokens
        (streaming); ``prompt_cache``: prefills to reuse and to keep (:class:`PromptCache`)."""
        return run_lockstep([self.steps(prompt_ids, max_new_tokens, shape, temperature, top_k, top_p, seed,
                                        eos_token_id, policy, on_step, prompt_cache)])[0]

    @torch.no_grad()
    def steps(self, prompt_ids, max_new_tokens: int, shape: Shape = Chain(3), temperature: float = 0.0,
              top_k: int = 0, top_p: float = 1.0, seed: int = 0, eos_token_id=None, policy=None,
              on_step=None, prompt_cache: PromptCache | None = None):
        """:meth:`generate` a step at a time: a generator that yields after each step and returns
        the :class:`BatchResult` (:func:`run_lockstep`)."""
        _check_sampling(max_new_tokens, temperature, top_k, top_p)
        check_shape(shape, self.proposer.shapes, self.proposer.name)
        chain = isinstance(shape, (Chain, Block))
        if policy is not None and not chain:
            raise DraftlabError(f"an adaptive draft length applies to chain and block shapes, not {shape.method}")
        device = self.target.device
        clock = _Clock(device)
        draft, verify = _Stopwatch(device), _Stopwatch(device)
        t0 = clock()
        prompts = _prompts(prompt_ids, device)
        sampling = _sampling(device, temperature, top_k, top_p, seed)
        room = max(p.numel() for p in prompts) + max_new_tokens + shape.max_nodes + 1
        cache = self.target.new_cache(len(prompts), room, ragged=True)
        slots = _cache_slots(prompts)
        first, hidden = _prefill(self.target, prompts, slots, self.proposer.layers, cache, sampling, verify, prompt_cache)
        batch = _Batch(slots, max_new_tokens, _eos_set(eos_token_id), on_step)
        per_row = {name: [[] for _ in prompts] for name in ("accept_lengths", "num_drafted", "draft_depths")}
        going = batch.emit([[t] for t in first])
        batch.compact(cache)
        # a batch of one drafts with the proposer itself (its state stays readable after decoding)
        proposers = RowProposers([self.proposer]) if len(prompts) == 1 else self.proposer.batched(len(going), shape)
        proposers.configure(sampling)
        for b, r in enumerate(going):
            proposers.start(b, prompts[r], hidden[r], first[r])
        # the drafter's pass over the prompts belongs to the prefill, as in a serving engine
        t1 = clock()
        verify.seconds = 0.0
        # What each row kept since its proposer was last advanced (its tokens, the step and its
        # position there) and how many tokens: advancing waits until the next draft, so plain
        # steps (k = 0) cost no drafter work and the catch-up is one call per row.
        pending: list[list[tuple[list[int], _Verified, int]]] = [[] for _ in going]
        unread = [0] * len(going)
        steps, asked = 0, []
        last_step: dict[int, tuple[int, int]] = {}  # row -> its last step's (drafted, accepted)
        held = 0  # plain steps the policy decided at once, still to take
        holds = policy is not None and hasattr(policy, "held")
        while batch.rows:
            step_start, drafted_before = clock(), draft.seconds
            step_shape = shape
            asking = policy is not None and not held
            if held:
                held -= 1
                step_shape = None
                asked.append(0)
            elif policy is not None:
                k = policy.choose(len(batch.rows), [last_step.get(r) for r in batch.rows], list(cache.lengths),
                                  batch.remaining(), unread)
                step_shape = type(shape)(k) if k > 0 else None
                held = policy.held() - 1 if holds and k == 0 else 0
                asked.append(k)
            drafts = caught_up = None
            if step_shape is not None:
                draft(self._flush, proposers, pending)
                # the catch-up apart from proposing: after a run of plain steps it reads every
                # token since the last draft (at batch 4 on the AMD EPYC, 6 ms for 2 tokens a
                # row, 13 ms for 16), and a batch's first step reads none (the prefill did)
                caught_up = (draft.seconds - drafted_before, sum(unread)) if any(unread) else None
                unread = [0] * len(unread)
                drafts = draft(proposers.propose, step_shape)
            if drafts is None:
                v = _plain_step(self.target, batch, cache, sampling, verify, self.proposer.layers)
            else:
                step = self._chain_step if chain else self._tree_step
                v = step(batch, drafts, step_shape, cache, sampling, verify)
            for r, n, d, depth in zip(batch.rows, v.accepted, v.drafted, v.depth):
                per_row["accept_lengths"][r].append(n)
                per_row["num_drafted"][r].append(d)
                per_row["draft_depths"][r].append(depth)
                last_step[r] = (d, n)
            if asking:
                drafting = draft.seconds - drafted_before
                proposing = drafting - caught_up[0] if caught_up else drafting
                policy.observe(len(batch.rows), asked[-1], v.accepted, proposing if step_shape is not None else None,
                               clock() - step_start - drafting, caught_up)
            rows_before = len(batch.rows)
            going = batch.emit(v.tokens)
            steps += 1
            if len(going) < rows_before:
                proposers.select(going)
                batch.compact(cache)
                held = 0
            for p in going:
                pending[p].append((v.tokens[p], v, p))
            pending = [pending[p] for p in going]
            unread = [unread[p] + len(v.tokens[p]) for p in going]
            yield from clock.pause()
        t2 = clock()
        per_row["num_steps"] = [len(a) for a in per_row["accept_lengths"]]
        return BatchResult(
            _results(batch, per_row), prefill_time=t1 - t0, draft_time=draft.seconds, verify_time=verify.seconds,
            other_time=t2 - t1 - draft.seconds - verify.seconds, total_time=t2 - t0, num_steps=steps,
            draft_lengths=asked,
        )

    def _flush(self, proposers, pending) -> None:
        """Advance every row's proposer by what it kept since the last draft (several steps'
        tokens and hidden states concatenated read as one longer accepted run)."""
        rows = [b for b, steps in enumerate(pending) if steps]
        if not rows:
            return
        device = self.target.device
        tokens = [torch.tensor([t for toks, _, _ in pending[b] for t in toks], dtype=torch.long, device=device) for b in rows]
        hidden = []
        for b in rows:
            parts = [v.row_hidden(p) for _, v, p in pending[b]]
            hidden.append({i: torch.cat([x[i] for x in parts], dim=1) for i in parts[0]})
        proposers.advance(tokens, hidden, rows)
        for b in rows:
            pending[b].clear()

    # ------------------------------------------------------------------ chains (and blocks)
    def _chain_step(self, batch, drafts, shape, cache, sampling, verify) -> _Verified:
        device = self.target.device
        ids, probs = map(list, zip(*(checked_chain(d, shape, self.target, self.proposer.name) for d in drafts)))
        inputs = batch.inputs(cache, 1 + max(t.numel() for t in ids), device)
        for b, (s, t) in enumerate(zip(batch.slots, ids)):
            inputs[s, 0] = batch.last[batch.rows[b]]
            inputs[s, 1 : 1 + t.numel()] = t
        past = list(cache.lengths)
        out = verify(self.target, inputs, layers=list(self.proposer.layers), cache=cache, logits="all")
        tokens, accepted = verify(accept_chains, ids, out.logits[batch.slots], sampling, probs, self.backend)
        batch.keep(cache, past, [n + 1 for n in accepted])  # the last token and the accepted drafts
        drafted = [t.numel() for t in ids]
        return _Verified(tokens, accepted, drafted, drafted, out.hidden, list(batch.slots), [slice(0, n + 1) for n in accepted])

    # ------------------------------------------------------------------ trees
    def _tree_step(self, batch, trees: list[DraftTree], shape, cache, sampling, verify) -> _Verified:
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
        past = list(cache.lengths)
        out = verify(self.target, tokens, layers=list(self.proposer.layers), cache=cache,
                     position_ids=depth, attn_mask=mask.to(device), logits="all")
        slots = batch.slots
        path, emitted, accepted = verify(accept_trees, tokens[slots], parents[slots], out.logits[slots], sampling, self.backend)
        paths = [path[b, : n + 1] for b, n in enumerate(accepted)]
        batch.keep(cache, past, [0] * len(slots))  # idle rows to 0; active rows to their past, then their path
        cache.keep([past[s] for s in slots], [past[s] + x for s, x in zip(slots, paths)], slots)  # the root and the accepted path
        return _Verified(emitted, accepted, [t.tokens.numel() for t in checked], depth[slots].max(1).values.tolist(),
                         out.hidden, list(slots), paths)
