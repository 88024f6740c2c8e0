"""Speculative decoding (chain, block and tree) and the plain baseline, on the target's KV cache.

Both decoders share the prefill, the sampling rule (:func:`process_logits`) and the stopping
rule, so a speedup compares like with like: one prefill, then per step one target forward
(plain: over the last token; speculative: over ``[last token, drafts...]``). A speculative
step reads top to bottom: draft, one target forward, accept (``kernels.accept_chain`` /
``accept_tree``), roll the cache back to the kept tokens (chain: ``crop``; tree: ``keep`` of the
accepted path's slots). The bonus/correction token becomes the next step's "last token" and is
written to the cache by that next forward. Nothing is ever re-prefilled.

This decoder runs one sequence; :mod:`draftlab.inference.batch` decodes a batch (a cache
with one length per row) and measures speedup by batch size.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from draftlab.errors import DraftlabError
from draftlab.inference.metrics import AcceptanceStats
from draftlab.inference.proposer import Block, Chain, ChainDraft, DraftTree, Proposer, Sampling, Shape, check_shape
from draftlab.inference.tree import accepted_slots, tree_verify_inputs, validate_tree
from draftlab.kernels import accept_chain, accept_tree


@dataclass
class GenerationResult:
    tokens: list[int]  # generated tokens (eos included when it stopped the generation)
    accept_lengths: list[int] = field(default_factory=list)  # per verify step: drafts accepted (tree: depth)
    num_drafted: list[int] = field(default_factory=list)  # per verify step: draft tokens / tree nodes verified
    draft_depths: list[int] = field(default_factory=list)  # per verify step: longest acceptable run offered
    draft_time: float = 0.0  # proposer (start, propose, advance), seconds
    verify_time: float = 0.0  # the decoding loop but the proposer: target forwards, verification, roll-back
    prefill_time: float = 0.0
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
    """perf_counter that waits for queued GPU work, so the split between phases is honest."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __call__(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()


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


def _prefill(target, prompt: torch.Tensor, layers, cache, sampling: Sampling):
    out = target(prompt[None], layers=list(layers), cache=cache, logits="last")
    return sampling.next_token(out.logits[0, -1]), out.hidden


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


# ---------------------------------------------------------------------- plain baseline
@torch.no_grad()
def generate_plain(
    target,
    prompt_ids,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    eos_token_id=None,
) -> GenerationResult:
    """Autoregressive decoding, one token per target forward, on the same cache and forward."""
    _check_sampling(max_new_tokens, temperature, top_k, top_p)
    clock = _Clock(target.device)
    t0 = clock()
    prompt = _as_prompt(prompt_ids, target.device)
    sampling = _sampling(target.device, temperature, top_k, top_p, seed)
    cache = target.new_cache(1, prompt.numel() + max_new_tokens)
    tok, _ = _prefill(target, prompt, (), cache, sampling)
    t1 = clock()
    em = _Emitter(max_new_tokens, _eos_set(eos_token_id))
    done = em.emit([tok])
    while not done:
        out = target(torch.tensor([[tok]], device=target.device), cache=cache, logits="last")
        tok = sampling.next_token(out.logits[0, -1])
        done = em.emit([tok])
    t2 = clock()
    return GenerationResult(
        em.tokens,
        prefill_time=t1 - t0,
        verify_time=t2 - t1,
        total_time=t2 - t0,
        stop_reason=em.stop_reason,
        num_steps=len(em.tokens) - 1,
    )


# ---------------------------------------------------------------------- speculative
class _TimedProposer:
    """The proposer behind a stopwatch: the time of its start, propose and advance adds up in
    ``seconds``, so the decoding loop reads without timers."""

    def __init__(self, proposer: Proposer, clock: _Clock):
        self.proposer, self.clock, self.seconds = proposer, clock, 0.0
        self.name, self.layers = proposer.name, proposer.layers

    def _timed(self, method, *args):
        t0 = self.clock()
        out = method(*args)
        self.seconds += self.clock() - t0
        return out

    def start(self, prompt_ids, hidden, next_token) -> None:
        self._timed(self.proposer.start, prompt_ids, hidden, next_token)

    def propose(self, shape: Shape):
        return self._timed(self.proposer.propose, shape)

    def advance(self, accepted, hidden) -> None:
        self._timed(self.proposer.advance, accepted, hidden)


@dataclass
class _Step:
    """What one speculative step emitted and kept."""

    tokens: list[int]  # accepted drafts, then the correction or bonus token
    accepted: int  # drafts accepted (tree: the accepted path's depth)
    drafted: int  # draft tokens / tree nodes verified
    depth: int  # longest acceptable run offered
    hidden: dict[int, torch.Tensor]  # the target's hidden states of the kept inputs


class SpeculativeDecoder:
    """``SpeculativeDecoder(target, proposer).generate(prompt_ids, max_new_tokens, shape=Chain(5), ...)``."""

    def __init__(self, target, proposer: Proposer, backend: str = "auto"):
        self.target, self.proposer, self.backend = target, proposer, backend

    @torch.no_grad()
    def generate(
        self,
        prompt_ids,
        max_new_tokens: int,
        shape: Shape = Chain(5),
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int = 0,
        eos_token_id=None,
        on_step=None,
    ) -> GenerationResult:
        """Generate up to ``max_new_tokens`` tokens after ``prompt_ids``, drafting ``shape`` each
        step. ``on_step(tokens)``, when given, is called with each batch of newly emitted tokens
        (streaming)."""
        _check_sampling(max_new_tokens, temperature, top_k, top_p)
        check_shape(shape, self.proposer.shapes, self.proposer.name)
        device = self.target.device
        step = self._chain_step if isinstance(shape, (Chain, Block)) else self._tree_step
        clock = _Clock(device)
        t0 = clock()
        prompt = _as_prompt(prompt_ids, device)
        sampling = _sampling(device, temperature, top_k, top_p, seed)
        # Room for the prompt, every emitted token and one step's drafts beyond them.
        cache = self.target.new_cache(1, prompt.numel() + max_new_tokens + shape.max_nodes + 1)
        last, hidden = _prefill(self.target, prompt, self.proposer.layers, cache, sampling)
        t1 = clock()
        res = GenerationResult([], prefill_time=t1 - t0)
        proposer = _TimedProposer(self.proposer, clock)
        em = _Emitter(max_new_tokens, _eos_set(eos_token_id), on_step)
        done = em.emit([last])
        if not done:
            self.proposer.configure(sampling)
            proposer.start(prompt, hidden, last)
        while not done:
            s = step(proposer, last, shape, cache, sampling)
            res.accept_lengths.append(s.accepted)
            res.num_drafted.append(s.drafted)
            res.draft_depths.append(s.depth)
            done = em.emit(s.tokens)
            last = s.tokens[-1]
            if not done:
                proposer.advance(torch.tensor(s.tokens, dtype=torch.long, device=device), s.hidden)
        t2 = clock()
        res.tokens, res.stop_reason, res.num_steps = em.tokens, em.stop_reason, len(res.accept_lengths)
        res.draft_time = proposer.seconds
        res.verify_time = t2 - t1 - proposer.seconds
        res.total_time = t2 - t0
        return res

    # ------------------------------------------------------------------ one chain (or block) step
    def _chain_step(self, proposer, last: int, shape: Chain | Block, cache, sampling: Sampling) -> _Step:
        drafts, draft_probs = checked_chain(proposer.propose(shape), shape, self.target, self.proposer.name)
        past = cache.length
        inputs = torch.cat([drafts.new_tensor([last]), drafts])[None]
        out = self.target(inputs, layers=list(proposer.layers), cache=cache, logits="all")
        tokens, n = accept_chain(drafts, out.logits[0], sampling, draft_probs, self.backend)
        cache.crop(past + n + 1)  # keep the last token and the accepted drafts
        kept = {i: h[:, : n + 1] for i, h in out.hidden.items()}
        return _Step(tokens, n, drafts.numel(), drafts.numel(), kept)


    # ------------------------------------------------------------------ one tree step
    def _tree_step(self, proposer, last: int, shape: Shape, cache, sampling: Sampling) -> _Step:
        tree = checked_tree(proposer.propose(shape), shape, self.target, self.proposer.name)
        past = cache.length
        vi = tree_verify_inputs(last, tree)
        out = self.target(
            vi.tokens[None],
            layers=list(proposer.layers),
            cache=cache,
            position_ids=vi.position_ids(past),
            attn_mask=vi.attn_mask(past),
            logits="all",
        )
        path, tokens, n = accept_tree(vi.tokens, vi.parents, out.logits[0], sampling, self.backend)
        cache.keep(past, accepted_slots(past, path, n))  # keep the root and the accepted path
        kept = {i: h[:, path] for i, h in out.hidden.items()}
        return _Step(tokens, n, tree.tokens.numel(), vi.max_depth, kept)
