"""Adaptive draft length: choose k (0 = a plain step) before every batched step.

A step of B rows drafting k tokens each costs the target's verify forward over B x (k + 1)
inputs plus the drafting, and yields on average E_r(k) = 1 + sum_{j<=k} prod_{i<=j} alpha_i(r)
tokens for row r. The policy picks the k that maximises sum_r E_r(k) / cost(B, k):

- ``cost(B, k)``: the verify forward's seconds, measured on this machine at start-up at a short
  context (:class:`VerifyCost`); plus what a real step adds to that, kept apart for plain and
  for drafting steps and for batch sizes 1, 2, 3-4, 5-8, ... (the least of the last 8 measured
  minus modelled seconds: the real context, read by every forward whatever k; a drafting step's
  bookkeeping, padding and accept kernel); plus the
  drafting's (seconds per draft position at that batch size, measured while decoding: drafting
  cost differs by family, and by whether it drafts row by row or all rows at once);
- ``alpha_i(r)``: the acceptance observed so far at draft position i in row r's context (what
  its last step's draft did: rejected, partly or wholly accepted), shrunk towards the acceptance
  of all rows, which has a Laplace prior ((accepted + 1) / (reached + 2)). A probe that most rows
  accept can so lead to further drafting steps while the rows' runs last, where the pooled
  acceptance alone would return to plain steps.

Exploration is optimistic: when the k chosen from the estimates would change under the upper
confidence bounds of alpha (mean + ``confidence`` standard errors), the policy drafts one more
position than the estimates say, so an estimate it stopped feeding cannot freeze, and stops
probing once enough rows have been seen that even the optimistic alpha would not pay. A batch of
B rows teaches B observations per step, so probing ends sooner where it costs most. What has
not been measured yet (drafting cost; what a plain or a drafting step adds at this range of
batch sizes) counts as free, so the policy tries it and learns; the least of recent
measurements, not their mean, so that one step slowed by other work on the machine cannot keep
the policy from a kind of step for good.

Why: with more rows the verify forward turns from weight-bound to compute-bound, so a draft
that pays at batch 1 can cost more than it yields at batch 16 (SpecDecodeBench: EAGLE's
speedup falls from 1.73x at batch 1 to 1.21x at batch 128).
"""

from __future__ import annotations

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
    def measure(cls, target, batch_sizes, max_k: int, context: int = 256, repeats: int = 5) -> "VerifyCost":
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
                seconds[(B, k)] = min(times[1:])  # noise from other work only adds time
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
    """The decoding policy of :class:`~draftlab.inference.decoder.BatchedSpeculativeDecoder`:
    ``choose(B, previous) -> k`` before a step, ``observe(B, k, accepted, draft_seconds,
    step_seconds)`` after it. One policy may serve many batches (an evaluation keeps one across
    batch sizes: acceptance does not depend on the batch size, and a server would not forget it
    either).

    Acceptance is kept per *context*: what the row's last step did (its first draft rejected;
    some drafts accepted; every draft accepted); a row whose last step drafted nothing (a plain
    step, or none yet) counts with the pooled acceptance of all rows. Why: acceptance comes in
    runs (a row copying a list or code accepts draft after draft), so a row that just accepted
    everything is likelier to accept again, and a batch of such rows earns a longer draft. A
    context's alpha is shrunk towards the pooled one by ``prior`` pseudo-observations, so a
    context seen rarely falls back to what all rows show."""

    CONTEXTS = ("rejected", "partial", "all")

    def __init__(self, cost: VerifyCost, max_k: int, confidence: float = 2.0, window: int = 8, prior: float = 4.0):
        self.cost, self.max_k = cost, max_k
        self.confidence, self.window, self.prior = confidence, window, prior
        # context -> index j: rows whose draft reached position j / accepted it ("pooled": every row)
        self.reached = {c: [0] * (max_k + 1) for c in ("pooled", *self.CONTEXTS)}
        self.accepted = {c: [0] * (max_k + 1) for c in ("pooled", *self.CONTEXTS)}
        # batch size -> [seconds, draft positions] of the steps that drafted: per-row proposers
        # cost B times a row's drafting, batched ones (EagleChains) about one row's
        self.drafting: dict[int, list[float]] = {}
        # (drafting step?, batch-size range) -> the last ``window`` steps' measured seconds
        # (drafting apart) minus the start-up model's
        self.added: dict[tuple[bool, int], list[float]] = {}
        self.chosen: list[int] = []
        self._contexts: list[str] = []  # the rows' contexts at the last choose

    @classmethod
    def context(cls, last: tuple[int, int] | None) -> str:
        """A row's context from its last step's (drafted, accepted); no draft (or no step yet): pooled."""
        if last is None or last[0] == 0:
            return "pooled"
        drafted, accepted = last
        return "rejected" if accepted == 0 else "all" if accepted >= drafted else "partial"

    def alpha(self, context: str = "pooled") -> list[float]:
        """Acceptance at positions 1..max_k: pooled with a Laplace prior ((accepted + 1) /
        (reached + 2)); a context's shrunk towards the pooled one."""
        pooled = [(self.accepted["pooled"][j] + 1) / (self.reached["pooled"][j] + 2) for j in range(1, self.max_k + 1)]
        if context == "pooled":
            return pooled
        acc, reached = self.accepted[context], self.reached[context]
        return [(acc[j] + self.prior * a) / (reached[j] + self.prior) for j, a in enumerate(pooled, start=1)]

    def alpha_by_context(self) -> dict[str, dict]:
        """Each context seen so far: its alpha estimate and the rows whose draft reached position 1."""
        return {c: {"alpha": self.alpha(c), "rows": self.reached[c][1]} for c in self.CONTEXTS if self.reached[c][1]}

    def optimistic_alpha(self, context: str = "pooled") -> list[float]:
        n = self.reached[context]
        extra = 2 if context == "pooled" else self.prior
        return [min(1.0, a + self.confidence * (a * (1 - a) / (n[j] + extra)) ** 0.5)
                for j, a in enumerate(self.alpha(context), start=1)]

    @staticmethod
    def expected_tokens(k: int, alpha: list[float]) -> float:
        e, p = 1.0, 1.0
        for a in alpha[:k]:
            p *= a
            e += p
        return e

    def draft_seconds(self, B: int, k: int) -> float:
        """k draft positions at batch size B: the mean cost of a position measured at B, else at
        the nearest batch size measured (0 before any)."""
        if not self.drafting or k == 0:
            return 0.0
        seconds, positions = self.drafting[min(self.drafting, key=lambda b: (abs(b - B), b))]
        return k * seconds / positions

    @staticmethod
    def _range(B: int) -> int:
        """Batch sizes 1, 2, 3-4, 5-8, ... share what they measure (the smallest power of 2 >= B)."""
        return 1 << (B - 1).bit_length()

    def target_seconds(self, B: int, k: int) -> float:
        """A step's seconds apart from drafting: the start-up model plus the least that recent
        steps of its kind added in B's range (nothing before one was measured)."""
        return self.cost(B, k) + min(self.added.get((k > 0, self._range(B)), [0.0]))

    def predicted_seconds(self, B: int, k: int) -> float:
        return self.target_seconds(B, k) + self.draft_seconds(B, k)

    def best(self, B: int, rows: dict[str, int], alpha) -> int:
        """The k maximising the expected tokens of ``rows`` (context -> rows in it, acceptance
        ``alpha(context)``) per second."""
        alphas = {c: alpha(c) for c in rows}
        return max(range(self.max_k + 1),
                   key=lambda k: sum(n * self.expected_tokens(k, alphas[c]) for c, n in rows.items())
                   / self.predicted_seconds(B, k))

    def choose(self, B: int, previous: list[tuple[int, int] | None] | None = None) -> int:
        """The draft length of the next step of B rows; ``previous``: each row's last step's
        (drafted, accepted), None before its first."""
        self._contexts = [self.context(p) for p in (previous or [None] * B)]
        rows = {c: self._contexts.count(c) for c in set(self._contexts)}
        k = self.best(B, rows, self.alpha)
        if k < self.max_k and self.best(B, rows, self.optimistic_alpha) > k:
            k += 1  # probe: the next position might pay
        self.chosen.append(k)
        return k

    def observe(self, B: int, k: int, accepted: list[int], draft_seconds: float | None = None,
                step_seconds: float | None = None) -> None:
        """After a step of B rows that drafted k: each row's accepted count, the drafting's
        seconds (None: not representative, e.g. a catch-up after plain steps) and the rest of
        the step's (the target's forward, the accept kernel, the bookkeeping)."""
        if step_seconds is not None:
            recent = self.added.setdefault((k > 0, self._range(B)), [])
            recent.append(step_seconds - self.cost(B, k))
            del recent[: -self.window]
        if k == 0:
            return
        contexts = self._contexts if len(self._contexts) == len(accepted) else ["pooled"] * len(accepted)
        for n, c in zip(accepted, contexts):
            for counts, upto in ((self.reached, min(n + 1, k)), (self.accepted, n)):
                for key in {"pooled", c}:
                    for j in range(1, upto + 1):
                        counts[key][j] += 1
        if draft_seconds is not None:
            cost = self.drafting.setdefault(B, [0.0, 0])
            cost[0] += draft_seconds
            cost[1] += k
