"""Speculative decoding (chain and tree) and the plain baseline, on the target's KV cache.

Both decoders share the prefill, the sampling rule (:func:`process_logits`) and the stopping
rule, so a speedup compares like with like: one prefill, then per step one target forward
(plain: over the last token; speculative: over ``[last token, drafts...]``). After a
speculative step the cache is rolled back to the kept tokens (chain: ``crop``; tree: ``keep``
of the accepted path's slots); the bonus/correction token becomes the next step's "last token"
and is written to the cache by that next forward. Nothing is ever re-prefilled.

Batch size is 1 (``KVCache`` has one length for the whole batch; rows accept different
numbers of drafts).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from draftlab.errors import DraftlabError
from draftlab.inference.metrics import AcceptanceStats
from draftlab.inference.proposer import ChainDraft, DraftTree, Proposer, Sampling, TreeSpec
from draftlab.inference.tree import accepted_slots, tree_verify_inputs, validate_tree
from draftlab.kernels import chain_verify_greedy, chain_verify_sampling, tree_verify_greedy, tree_verify_sampling

METHODS = ("chain", "tree")


@dataclass
class GenerationResult:
    tokens: list[int]  # generated tokens (eos included when it stopped the generation)
    accept_lengths: list[int] = field(default_factory=list)  # per verify step: drafts accepted (tree: depth)
    num_drafted: list[int] = field(default_factory=list)  # per verify step: draft tokens / tree nodes verified
    draft_depths: list[int] = field(default_factory=list)  # per verify step: longest acceptable run offered
    draft_time: float = 0.0  # proposer (start, propose, advance), seconds
    verify_time: float = 0.0  # decode-step target forwards + verification + cache roll-back
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


def _next_token(sampling: Sampling, logits_row: torch.Tensor) -> int:
    """The target's next token from one row of logits: the rule plain decoding uses everywhere."""
    if sampling.greedy:
        return int(logits_row.max(-1).indices)
    return int(sampling.sample(sampling.probs(logits_row)))


class _Clock:
    """perf_counter that waits for queued GPU work, so the split between phases is honest."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __call__(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()


class _Emitter:
    """Collects emitted tokens; applies max_new_tokens and eos (truncating within a step)."""

    def __init__(self, max_new_tokens: int, eos: frozenset[int]):
        self.tokens: list[int] = []
        self.max_new_tokens, self.eos = max_new_tokens, eos
        self.stop_reason: str | None = None

    def emit(self, new: list[int]) -> bool:
        """Append ``new``; True once generation is over."""
        for t in new:
            self.tokens.append(t)
            if t in self.eos:
                self.stop_reason = "eos"
                return True
            if len(self.tokens) >= self.max_new_tokens:
                self.stop_reason = "length"
                return True
        return False


def _prefill(target, prompt: torch.Tensor, layers, cache, sampling: Sampling):
    out = target(prompt[None], layers=list(layers), cache=cache, logits="last")
    return _next_token(sampling, out.logits[0, -1]), out.hidden


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
        tok = _next_token(sampling, out.logits[0, -1])
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
class SpeculativeDecoder:
    """``SpeculativeDecoder(target, proposer).generate(prompt_ids, max_new_tokens, ...)``."""

    def __init__(self, target, proposer: Proposer, backend: str = "auto"):
        self.target, self.proposer, self.backend = target, proposer, backend

    @torch.no_grad()
    def generate(
        self,
        prompt_ids,
        max_new_tokens: int,
        method: str = "chain",
        k: int = 5,
        tree: TreeSpec | None = None,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int = 0,
        eos_token_id=None,
        on_step=None,
    ) -> GenerationResult:
        """Generate up to ``max_new_tokens`` tokens after ``prompt_ids``. ``on_step(tokens)``, when
        given, is called with each batch of newly emitted tokens (streaming)."""
        _check_sampling(max_new_tokens, temperature, top_k, top_p)
        tree = tree or TreeSpec()
        if method not in METHODS:
            raise DraftlabError(f"method must be one of {', '.join(METHODS)}, got '{method}'")
        if method == "chain" and k < 1:
            raise DraftlabError(f"k must be >= 1, got {k}")
        if method == "tree":
            if not self.proposer.supports_tree:
                raise DraftlabError(f"drafter '{self.proposer.name}' does not support method 'tree'")
            if min(tree.depth, tree.top_k, tree.total_tokens) < 1:
                raise DraftlabError(f"tree depth, top_k and total_tokens must be >= 1, got {tree}")
        target, proposer = self.target, self.proposer
        device = target.device
        clock = _Clock(device)
        t0 = clock()
        prompt = _as_prompt(prompt_ids, device)
        sampling = _sampling(device, temperature, top_k, top_p, seed)
        max_draft = k if method == "chain" else tree.total_tokens
        # Room for the prompt, every emitted token and one step's drafts beyond them.
        cache = target.new_cache(1, prompt.numel() + max_new_tokens + max_draft + 1)
        last, hidden = _prefill(target, prompt, proposer.layers, cache, sampling)
        t1 = clock()
        res = GenerationResult([], prefill_time=t1 - t0)
        em = _Emitter(max_new_tokens, _eos_set(eos_token_id))
        done = em.emit([last])
        if on_step is not None:
            on_step([last])
        if not done:
            proposer.configure(sampling)
            proposer.start(prompt, hidden, last)
            res.draft_time += clock() - t1
        while not done:
            ta = clock()
            if method == "chain":
                draft = proposer.propose(k)
                tb = clock()
                emitted, kept_hidden, n, drafted, depth = self._chain_step(last, draft, k, cache, sampling)
            else:
                dtree = proposer.propose_tree(tree)
                tb = clock()
                emitted, kept_hidden, n, drafted, depth = self._tree_step(last, dtree, tree, cache, sampling)
            tc = clock()
            res.draft_time += tb - ta
            res.verify_time += tc - tb
            res.accept_lengths.append(n)
            res.num_drafted.append(drafted)
            res.draft_depths.append(depth)
            before = len(em.tokens)
            done = em.emit(emitted)
            last = emitted[-1]
            if on_step is not None:
                on_step(em.tokens[before:])
            if not done:
                td = clock()
                proposer.advance(torch.tensor(emitted, dtype=torch.long, device=device), kept_hidden)
                res.draft_time += clock() - td
        res.tokens, res.stop_reason, res.num_steps = em.tokens, em.stop_reason, len(res.accept_lengths)
        res.total_time = clock() - t0
        return res

    # ------------------------------------------------------------------ one chain step
    def _chain_step(self, last: int, draft: ChainDraft, k: int, cache, sampling: Sampling):
        target, device = self.target, self.target.device
        drafts = draft.tokens.reshape(-1).to(device=device, dtype=torch.long)
        nd = drafts.numel()
        if nd > k:
            raise ValueError(f"proposer '{self.proposer.name}' drafted {nd} tokens, more than k={k}")
        past = cache.length
        inputs = torch.cat([torch.tensor([last], dtype=torch.long, device=device), drafts])[None]
        out = target(inputs, layers=list(self.proposer.layers), cache=cache, logits="all")
        logits = out.logits[0]  # [nd + 1, V]: row j = target after input j
        if nd == 0:  # nothing to verify: a plain decoding step
            emitted, n = [_next_token(sampling, logits[0])], 0
        else:
            cu = torch.tensor([0, nd], dtype=torch.long, device=device)
            if sampling.greedy:
                toks, num = chain_verify_greedy(drafts, cu, logits.max(-1).indices, backend=self.backend)
            else:
                q = draft.probs
                if q is not None:
                    q = q.to(device=device, dtype=torch.float32)
                    if q.shape != (nd, logits.shape[-1]):
                        raise ValueError(f"proposer '{self.proposer.name}': draft probs {list(q.shape)} != [{nd}, {logits.shape[-1]}]")
                gen = sampling.generator
                uniforms = torch.rand(nd, dtype=torch.float64, device=device, generator=gen)
                noise = torch.empty(nd + 1, logits.shape[-1], device=device).exponential_(generator=gen)
                toks, num = chain_verify_sampling(drafts, cu, sampling.probs(logits), q, uniforms, noise, backend=self.backend)
            n = int(num[0])
            emitted = toks[0, : n + 1].tolist()
        cache.crop(past + n + 1)  # keep the last token and the accepted drafts
        kept = {i: h[:, : n + 1] for i, h in out.hidden.items()}
        return emitted, kept, n, nd, nd

    # ------------------------------------------------------------------ one tree step
    def _tree_step(self, last: int, dtree, spec: TreeSpec, cache, sampling: Sampling):
        target, device = self.target, self.target.device
        V = target.vocab_size
        dtree = DraftTree(*(t.reshape(-1).to(device=device, dtype=torch.long) for t in (dtree.tokens, dtree.parents, dtree.depth)))
        validate_tree(dtree, V)
        nd = dtree.tokens.numel()
        if nd > spec.total_tokens:
            raise ValueError(f"proposer '{self.proposer.name}' drafted {nd} tree nodes, more than total_tokens={spec.total_tokens}")
        if nd and int(dtree.depth.max()) > spec.depth:
            raise ValueError(f"proposer '{self.proposer.name}' drafted a tree deeper than depth={spec.depth}")
        past = cache.length
        vi = tree_verify_inputs(last, dtree)
        out = target(
            vi.tokens[None],
            layers=list(self.proposer.layers),
            cache=cache,
            position_ids=vi.position_ids(past),
            attn_mask=vi.attn_mask(past),
            logits="all",
        )
        logits = out.logits  # [1, nd + 1, V]: row n = target after node n
        if nd == 0:
            path = torch.zeros(1, dtype=torch.long, device=device)
            emitted, n = [_next_token(sampling, logits[0, 0])], 0
        else:
            if sampling.greedy:
                path, toks, num = tree_verify_greedy(vi.tokens[None], vi.parents[None], logits.max(-1).indices, backend=self.backend)
            else:
                gen = sampling.generator
                uniforms = torch.rand(1, nd + 1, dtype=torch.float64, device=device, generator=gen)
                noise = torch.empty(1, nd + 1, V, device=device).exponential_(generator=gen)
                path, toks, num = tree_verify_sampling(
                    vi.tokens[None], vi.parents[None], sampling.probs(logits), uniforms, noise, backend=self.backend
                )
            n = int(num[0])
            path = path[0]
            emitted = toks[0, : n + 1].tolist()
        cache.keep(past, accepted_slots(past, path, n))
        kept = {i: h[:, path[: n + 1]] for i, h in out.hidden.items()}
        return emitted, kept, n, nd, vi.max_depth
