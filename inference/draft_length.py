"""The draft length per step: ``k = argmax_k tokens(k) / cost(B, k)``, k = 0 being a plain step.

``tokens(k) = 1 + sum_{j<=k} prod_{i<=j} alpha_i`` is what a row gains from a step that drafts
k, with alpha_i the acceptance at draft position i seen so far (a Laplace prior before any).
``cost(B, k)`` is what such a step costs per token over a plain step's, at B rows: measured once
at start-up (:func:`calibrate`) by decoding the same prompts plainly and at each fixed k in
lockstep, so it holds all a step costs: the verify forward, the drafting, the accept kernel and
the wait for a batch's last row. Why a rule: with more rows the verify forward turns from
weight-bound to compute-bound, so a draft length that pays at batch 1 loses at batch 16, and
no fixed k is right for every load. BENCHMARKS.md, "Speedup by batch size", has its table.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from draftlab.errors import DraftlabError


@dataclass
class DraftLength:
    """``rule(B) -> k`` before each step of B rows; ``rule.observe(drafted, accepted)`` after
    a step that drafted (per row: draft tokens offered, drafts accepted).

    ``cost``: per calibrated batch size, ``[1.0, c(1), ..., c(max_k)]``, a step drafting k's
    seconds per token over a plain step's, at the tokens per step the calibration saw (see
    :func:`calibrate`); other batch sizes take the nearest calibrated one (the smaller on a tie).
    ``margin``: a draft must be predicted to beat a plain step by this fraction, the noise of a
    calibration; plain decoding keeps a tie."""

    cost: dict[int, list[float]]
    margin: float = 0.03
    reached: list[int] = field(default_factory=list)  # per position j >= 1: rows whose draft offered it
    accepted: list[int] = field(default_factory=list)  # ... and accepted it

    def __post_init__(self):
        if not self.cost or any(len(c) != len(next(iter(self.cost.values()))) or c[0] != 1.0 for c in self.cost.values()):
            raise DraftlabError("draft length: cost needs, per batch size, [1.0, c(1), ..., c(max_k)] of one length")
        self.max_k = len(next(iter(self.cost.values()))) - 1
        self.reached = self.reached or [0] * self.max_k
        self.accepted = self.accepted or [0] * self.max_k

    def alpha(self) -> list[float]:
        """The acceptance at each draft position, given the one before it was accepted."""
        return [(a + 1) / (r + 2) for a, r in zip(self.accepted, self.reached)]

    def tokens(self, k: int) -> float:
        """A row's expected tokens from a step drafting k (the bonus token included)."""
        total = run = 1.0
        for a in self.alpha()[:k]:
            run *= a
            total += run
        return total

    def rate(self, B: int, k: int) -> float:
        """Predicted tokens per second of a step drafting k at B rows, over a plain step's."""
        return self.tokens(k) / self.cost[min(self.cost, key=lambda b: (abs(b - B), b))][k]

    def __call__(self, B: int) -> int:
        rates = [self.rate(B, k) for k in range(self.max_k + 1)]
        best = max(range(self.max_k + 1), key=rates.__getitem__)
        return best if rates[best] > 1 + self.margin else 0

    def observe(self, drafted: list[int], accepted: list[int]) -> None:
        for d, n in zip(drafted, accepted):
            for j in range(min(d, self.max_k)):
                if j > n:
                    break
                self.reached[j] += 1
                self.accepted[j] += j < n

    def to_dict(self) -> dict:
        return {"cost": {str(b): c for b, c in sorted(self.cost.items())}, "alpha": self.alpha(), "margin": self.margin}


def step_cost(tau: float, tokens: int, seconds: float, plain_tokens: int, plain_seconds: float) -> float:
    """A step's cost per token over a plain step's, from one lockstep decoding of the same rows
    plainly and with drafts: its predicted rate ``tau / cost`` then equals the measured speedup."""
    return tau * (plain_tokens / plain_seconds) / (tokens / seconds)
