"""Speedup by batch size: ``draftlab eval --batch-sizes 1,2,4,8,16`` (and ``eval.batch_sizes`` in a
recipe).

For each batch size B the prompts are decoded in consecutive groups of B, plain and
speculative in lockstep on the same group (one step of each in turn,
:func:`~draftlab.inference.decoder.run_lockstep`, in a crossover order, :func:`crossover_orders`), with the
batched decoder (:mod:`draftlab.inference.decoder`) for both; :func:`compare_batches` measures
several speculative configurations against one plain baseline that way (bench/batch.py). Per
batch size: plain and speculative tokens/s (all rows' tokens over the groups' decoding time: the
prefill, the same forward in both, is left out and reported apart; each prompt's is computed
once and reused, :class:`~draftlab.inference.decoder.PromptCache`, so the prefill seconds
reported are the copy and the drafter's pass over the prompts), speedup with a bootstrap
interval over the groups, tau and alpha_j,
the split of the speculative time into prefill, draft, verify and the rest, and two greedy
checks: each row against plain batched decoding of the same group (must match: decoding is
lossless), and plain batched decoding against the same prompt decoded alone (may differ on
float near-ties, and is counted, not hidden).

``adaptive``: the draft length is chosen per step by
:class:`~draftlab.inference.adaptive.AdaptiveDraftLength`, up to the shape's k or the positions
the drafter was trained to draft, whichever is fewer (:attr:`Speculation.depth`), with the verify
cost measured once at start-up for these batch sizes; one policy runs through all batch sizes,
in the order given, as in a server whose load changes.
"""

from __future__ import annotations

from dataclasses import dataclass

from draftlab.errors import DraftlabError
from draftlab.inference.adaptive import AdaptiveDraftLength, VerifyCost
from draftlab.inference.decoder import (
    BatchedSpeculativeDecoder,
    PromptCache,
    generate_plain_batch,
    plain_batch_steps,
    run_lockstep,
)
from draftlab.inference.metrics import AcceptanceStats
from draftlab.inference.proposer import Block, Chain


def parse_batch_sizes(text: str, flag: str = "--batch-sizes") -> list[int]:
    """``"1,2,4"`` -> [1, 2, 4] (a one-line error naming ``flag`` otherwise)."""
    try:
        sizes = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise DraftlabError(f"{flag}: expected comma-separated integers >= 1, e.g. 1,2,4,8, got '{text}'") from None
    check_batch_sizes(sizes, flag)
    return sizes


def check_batch_sizes(sizes, field: str) -> None:
    if not sizes or any(not isinstance(b, int) or b < 1 for b in sizes) or len(set(sizes)) != len(sizes):
        raise DraftlabError(f"{field}: expected distinct integers >= 1, e.g. 1,2,4,8, got {sizes}")


@dataclass
class Speculation:
    """One speculative configuration to measure against plain decoding: a proposer, the shape
    it drafts and whether the adaptive policy chooses the draft length per step (up to the
    shape's k)."""

    proposer: object
    shape: object
    adaptive: bool = False

    @property
    def depth(self) -> int:
        """The most the adaptive policy drafts: the shape's k, or fewer where the proposer was
        trained to draft fewer chained positions (``Proposer.trained_depth``): at batch 1 on
        the AMD EPYC the policy spent ~60 of its first 100 steps learning that the main job's
        drafter, trained for one, accepts 0.08 at position 2 (each step ~12 % below drafting one)."""
        trained = getattr(self.proposer, "trained_depth", None)
        return min(self.shape.k, trained) if trained else self.shape.k


def evaluate_batches(target, proposer, prompts, shape, batch_sizes, max_new_tokens: int = 128,
                     temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
                     eos_token_id=None, adaptive: bool = False, backend: str = "auto", progress=None,
                     min_groups: int = 1) -> dict:
    """The ``batches`` section of a report: one entry per batch size, in the order given, for
    one proposer decoding with the target it is verified by (:meth:`Proposer.verifier`)."""
    speculations = {"": Speculation(proposer, shape, adaptive)}
    return compare_batches(proposer.verifier(target), speculations, prompts, batch_sizes, max_new_tokens, temperature,
                           top_k, top_p, seed, eos_token_id, backend, progress, min_groups)[""]


def compare_batches(target, speculations: dict[str, Speculation], prompts, batch_sizes, max_new_tokens: int = 128,
                    temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
                    eos_token_id=None, backend: str = "auto", progress=None, min_groups: int = 1,
                    adaptive_groups: int = 0) -> dict[str, dict]:
    """A ``batches`` section per speculative configuration (label -> section), all against one
    plain baseline: each group of B prompts is decoded by plain decoding and by every
    configuration in lockstep (one step of each in turn), in the orders of :func:`crossover_orders`
    from group to group, so the configurations are compared on the same groups under the same
    machine state, step by step. ``min_groups``: decode the
    prompts again (same groups) until each batch size has timed at least that many groups:
    large batch sizes have few groups, and one timing is one sample of the machine's noise.
    ``adaptive_groups``: then, at each batch size, this many more groups (the prompts' groups in
    turn) decoded by plain decoding and the adaptive configurations alone, in lockstep, and
    pooled into those configurations' entries after the groups every configuration decoded.
    Why: where the policy decodes about as plain decoding does, its verdict against it rests on
    the noise of a forward's time (one forward repeated at batch 16 on the AMD EPYC varied by
    9-11 % from one run to the next), so it needs more steps than the other configurations."""
    if not prompts:
        raise DraftlabError("evaluation needs at least one prompt")
    check_batch_sizes(list(batch_sizes), "batch sizes")
    for spec in speculations.values():
        if spec.adaptive and not isinstance(spec.shape, (Chain, Block)):
            raise DraftlabError(f"an adaptive draft length applies to chain and block shapes, not {spec.shape.method}")
    decoders = {label: BatchedSpeculativeDecoder(target, s.proposer, backend=backend) for label, s in speculations.items()}
    # every prompt is decoded once per configuration and batch size: its prefill once
    opts = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                eos_token_id=eos_token_id, prompt_cache=PromptCache(target))
    ids = [p.prompt_ids for p in prompts]
    greedy = temperature == 0.0
    # warm-up, untimed: allocator, GEMM choice for each row count, drafter copies
    warm = dict(opts, max_new_tokens=min(max_new_tokens, 8))
    for B in batch_sizes:
        generate_plain_batch(target, ids[:B], seed=seed, **warm)
        for label, s in speculations.items():
            decoders[label].generate(ids[:B], shape=s.shape, seed=seed, **warm)
    adaptive = [s for s in speculations.values() if s.adaptive]
    cost = VerifyCost.measure(target, batch_sizes, max(s.depth for s in adaptive)) if adaptive else None
    # one policy per configuration for the whole run: what it learnt of acceptance and drafting
    # cost at one batch size holds at the next (the verify cost it keeps per batch size)
    policies = {label: AdaptiveDraftLength(cost, s.depth) if s.adaptive else None for label, s in speculations.items()}
    entries: dict[str, list[_Entry]] = {label: [] for label in speculations}
    plain_outputs: dict[int, list[list[int]]] = {}
    every = [None, *speculations]  # None: plain decoding
    adaptive_only = [None, *(label for label, s in speculations.items() if s.adaptive)]
    for B in batch_sizes:
        run = {label: _Entry(B) for label in speculations}
        plain_outputs[B] = []
        starts = list(range(0, len(ids), B))
        grid = starts * -(-min_groups // len(starts))  # ceil: whole passes over the prompts
        more = [starts[g % len(starts)] for g in range(adaptive_groups)] if len(adaptive_only) > 1 else []
        schedule = [(g, start, every) for g, start in enumerate(grid)] + [(g, start, adaptive_only) for g, start in enumerate(more)]
        rows, done_rows = sum(len(ids[start : start + B]) for _, start, _ in schedule), 0
        for g, start, labels in schedule:
            group = ids[start : start + B]
            orders = crossover_orders(len(labels))
            order = [labels[i] for i in orders[g % len(orders)]]
            done = dict(zip(order, run_lockstep([
                plain_batch_steps(target, group, seed=seed + start, **opts) if label is None else
                decoders[label].steps(group, shape=speculations[label].shape, seed=seed + start, policy=policies[label], **opts)
                for label in order
            ])))
            if labels is every:
                plain_outputs[B] += [r.tokens for r in done[None].rows]
            for label in labels[1:]:
                run[label].add(done[label], done[None], greedy)
            done_rows += len(group)
            if progress is not None:
                progress(B, done_rows, rows)
        for label, e in run.items():
            if policies[label] is not None:
                e.alpha_estimate = policies[label].alpha()
                e.alpha_by_context = policies[label].alpha_by_context()
            entries[label].append(e)
    if greedy and max(batch_sizes) > 1:
        # each prompt decoded alone: batch size 1's plain outputs when measured, else decoded now
        alone = plain_outputs[1][: len(ids)] if 1 in plain_outputs else \
            [generate_plain_batch(target, [i], seed=seed, **opts).rows[0].tokens for i in ids]
        for B, outputs in plain_outputs.items():
            if B > 1:  # repeated passes decode the prompts in the same order
                same = sum(a == b for a, b in zip(alone * (len(outputs) // len(ids)), outputs))
                for label in speculations:
                    entries[label][batch_sizes.index(B)].alone_same = (same, len(outputs))
    return {
        label: {"adaptive": s.adaptive, "adaptive_max_k": s.depth if s.adaptive else None,
                "verify_cost_s": cost.to_dict() if s.adaptive else None,
                "entries": [e.to_dict() for e in entries[label]]}
        for label, s in speculations.items()
    }


def crossover_orders(n: int) -> list[list[int]]:
    """Orders of n configurations, one per group in turn, balanced for what ran just before
    (a Williams design): over the orders each configuration runs once at every position and right
    after every other configuration equally often (n orders for even n, 2n for odd). Why: a
    decoding can be slowed by the one before it (at batch 16 on the AMD EPYC plain decoding ran
    0.9 % +- 1.1 % slower right after fixed k = 3 than after plain), and with the orders rotated
    the adaptive policy always ran right after k = 3 and plain decoding after the adaptive one."""
    first = [0]
    for j in range(1, n):  # 0, 1, n-1, 2, n-2, ...
        first.append((j + 1) // 2 if j % 2 else n - j // 2)
    square = [[(x + i) % n for x in first] for i in range(n)]
    return square if n % 2 == 0 else square + [row[::-1] for row in square]


class _Entry:
    def __init__(self, B: int):
        self.B = B
        self.stats = AcceptanceStats()
        self.split = {"prefill_s": 0.0, "draft_s": 0.0, "verify_s": 0.0, "other_s": 0.0}
        self.matched = self.compared = 0
        self.asked: list[int] = []
        self.alpha_estimate: list[float] | None = None  # the adaptive policy's, after this batch size
        self.alpha_by_context: dict | None = None  # likewise, per context of the row's last draft
        self.alone_same: tuple[int, int] | None = None  # plain batched rows equal to the prompt decoded alone, of rows
        self.groups: list[tuple[int, float, int, float]] = []  # per group: tokens, seconds; plain's

    def add(self, spec, base, greedy: bool) -> None:
        for r in spec.rows:
            self.stats.merge(r.stats())
        # decode phase only: the prefill is the same forward in both, and a held-out prompt of
        # 2,544 tokens would otherwise outweigh 48 decoded tokens
        self.groups.append((spec.num_tokens, spec.total_time - spec.prefill_time,
                            base.num_tokens, base.total_time - base.prefill_time))
        for key, t in (("prefill_s", spec.prefill_time), ("draft_s", spec.draft_time),
                       ("verify_s", spec.verify_time), ("other_s", spec.other_time)):
            self.split[key] += t
        self.asked += spec.draft_lengths
        if greedy:
            self.compared += len(spec.rows)
            self.matched += sum(s.tokens == b.tokens for s, b in zip(spec.rows, base.rows))

    def to_dict(self) -> dict:
        tokens, time, base_tokens, base_time = (sum(g[i] for g in self.groups) for i in range(4))
        tps = tokens / time if time > 0 else 0.0
        base_tps = base_tokens / base_time if base_time > 0 else 0.0
        out = {
            "batch_size": self.B,
            "tokens_per_s": tps,
            "baseline_tokens_per_s": base_tps,
            "speedup": tps / base_tps if base_tps else None,
            "speedup_interval": speedup_interval(self.groups),
            "groups": [list(g) for g in self.groups],
            **self.stats.to_dict(),
            "new_tokens": tokens,
            "decode_time_s": time,
            **self.split,
            "greedy_match": f"{self.matched}/{self.compared}" if self.compared else None,
        }
        if self.alone_same is not None:
            out["batched_vs_alone"] = "{}/{}".format(*self.alone_same)
        if self.alpha_estimate is not None:
            counts = {k: self.asked.count(k) for k in sorted(set(self.asked))}
            out["draft_lengths"] = {str(k): n for k, n in counts.items()}
            out["alpha_estimate"] = self.alpha_estimate
            out["alpha_by_context"] = self.alpha_by_context
        return out


def speedup_interval(groups, level: float = 0.9, resamples: int = 2000) -> list[float] | None:
    """A ``level`` bootstrap interval of the speedup (tokens over seconds, speculative over
    plain, summed over groups) from per-group (tokens, seconds, plain tokens, plain seconds):
    groups drawn with replacement, so it holds both the prompts' spread and the machine's noise."""
    import numpy as np

    g = np.asarray(groups, dtype=float)
    if len(g) == 0 or (g[:, 1] <= 0).any() or (g[:, 3] <= 0).any():
        return None
    sums = g[np.random.default_rng(0).integers(0, len(g), (resamples, len(g)))].sum(1)
    ratios = (sums[:, 0] / sums[:, 1]) / (sums[:, 2] / sums[:, 3])
    tail = 100 * (1 - level) / 2
    return [float(np.percentile(ratios, tail)), float(np.percentile(ratios, 100 - tail))]
