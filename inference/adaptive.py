"""Adaptive draft length: choose k (0 = a plain step) before every batched step.

A step of B rows drafting k tokens each costs the target's verify forward over B x (k + 1)
inputs plus the drafting, and yields on average E(k) = 1 + sum_{j<=k} prod_{i<=j} alpha_i tokens
per row. The policy picks the k that maximises B * E(k) / cost(B, k):

- ``cost(B, k)``: the verify forward's seconds, measured on this machine at start-up
  (:class:`VerifyCost`), plus the drafting's, measured while decoding (seconds per draft
  position at that batch size: drafting cost differs by family, and by whether it drafts row
  by row or all rows at once, so it is only known once a proposer has run);
- ``alpha_i``: the acceptance observed so far at draft position i, with a Laplace prior
  ((accepted + 1) / (reached + 2)), so an unseen position counts as a coin flip.

Why: with more rows the verify forward turns from weight-bound to compute-bound, so a draft
that pays at batch 1 can cost more than it yields at batch 16 (SpecDecodeBench: EAGLE's
speedup falls from 1.73x at batch 1 to 1.21x at batch 128). The policy starts with ``max_k``
for a few steps to learn alpha, and when it has settled below ``max_k`` it still drafts one
more position every ``probe_every`` steps, so that an estimate it no longer feeds cannot freeze.
"""

from __future__ import annotations

import statistics

import torch

from draftlab.inference.decoder import _Clock


class VerifyCost:
    """Seconds of one target forward over B rows x (k + 1) inputs each, against a cache of
    ``context`` tokens per row, for the batch sizes and k = 0..max_k measured; other batch
    sizes are interpolated linearly (clamped to the measured range)."""

    def __init__(self, seconds: dict[tuple[int, int], float]):
        self.seconds = dict(seconds)
        self.batch_sizes = sorted({b for b, _ in self.seconds})

    @classmethod
    @torch.no_grad()
    def measure(cls, target, batch_sizes, max_k: int, context: int = 256, repeats: int = 3) -> "VerifyCost":
        clock = _Clock(target.device)
        seconds = {}
        g = torch.Generator().manual_seed(0)
        for B in sorted(set(batch_sizes)):
            cache = target.new_cache(B, context + max_k + 1, ragged=True)
            for k in range(max_k + 1):
                ids = torch.randint(0, target.vocab_size, (B, k + 1), generator=g).to(target.device)
                times = []
                for _ in range(repeats + 1):  # the first run warms up (allocations, GEMM choice)
                    cache.lengths = [context] * B  # the slots' content does not change the cost
                    t0 = clock()
                    target(ids, cache=cache, logits="all")
                    times.append(clock() - t0)
                seconds[(B, k)] = statistics.median(times[1:])
        return cls(seconds)

    def __call__(self, B: int, k: int) -> float:
        sizes = self.batch_sizes
        if B <= sizes[0]:
            return self.seconds[(sizes[0], k)]
        if B >= sizes[-1]:
            return self.seconds[(sizes[-1], k)] * B / sizes[-1]
        hi = next(s for s in sizes if s >= B)
        lo = max(s for s in sizes if s <= B)
        if hi == lo:
            return self.seconds[(lo, k)]
        w = (B - lo) / (hi - lo)
        return (1 - w) * self.seconds[(lo, k)] + w * self.seconds[(hi, k)]

    def to_dict(self) -> dict:
        return {f"{b}x{k + 1}": s for (b, k), s in sorted(self.seconds.items())}


class AdaptiveDraftLength:
    """The decoding policy of :class:`~draftlab.inference.batch.BatchedSpeculativeDecoder`:
    ``choose(B) -> k`` before a step, ``observe(B, k, accepted, draft_seconds)`` after it."""

    def __init__(self, cost: VerifyCost, max_k: int, warmup_steps: int = 4, probe_every: int = 16):
        self.cost, self.max_k = cost, max_k
        self.warmup_steps, self.probe_every = warmup_steps, probe_every
        self.reached = [0] * (max_k + 1)  # index j: rows whose draft reached position j
        self.accepted = [0] * (max_k + 1)
        # batch size -> [seconds, draft positions] of the steps that drafted: per-row proposers
        # cost B times a row's drafting, batched ones (EagleChains) about one row's
        self.drafting: dict[int, list[float]] = {}
        self.steps = 0
        self.chosen: list[int] = []

    def alpha(self) -> list[float]:
        return [(self.accepted[j] + 1) / (self.reached[j] + 2) for j in range(1, self.max_k + 1)]

    def expected_tokens(self, k: int) -> float:
        e, p = 1.0, 1.0
        for a in self.alpha()[:k]:
            p *= a
            e += p
        return e

    def draft_seconds(self, B: int, k: int) -> float:
        """k draft positions at batch size B: the mean cost of a position measured at B, else at
        the nearest batch size measured."""
        if not self.drafting or k == 0:
            return 0.0
        near = min(self.drafting, key=lambda b: (abs(b - B), b))
        seconds, positions = self.drafting[near]
        return k * seconds / positions

    def step_seconds(self, B: int, k: int) -> float:
        return self.cost(B, k) + self.draft_seconds(B, k)

    def best(self, B: int) -> int:
        return max(range(self.max_k + 1), key=lambda k: B * self.expected_tokens(k) / self.step_seconds(B, k))

    def choose(self, B: int) -> int:
        if self.steps < self.warmup_steps or not self.drafting:
            k = self.max_k
        else:
            k = self.best(B)
            if k < self.max_k and self.steps % self.probe_every == 0:
                k += 1
        self.chosen.append(k)
        return k

    def observe(self, B: int, k: int, accepted: list[int], draft_seconds: float) -> None:
        self.steps += 1
        if k == 0:
            return
        for n in accepted:
            for j in range(1, min(n + 1, k) + 1):
                self.reached[j] += 1
            for j in range(1, n + 1):
                self.accepted[j] += 1
        cost = self.drafting.setdefault(B, [0.0, 0])
        cost[0] += draft_seconds
        cost[1] += k
