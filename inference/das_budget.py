"""DAS's length-aware speculation budget (arXiv 2511.13841) and the forward-cost model it rests on.

Cost model: a target forward over ``n`` tokens (every row's inputs together) takes
``t = c_base + c_tok * n``. Speculation trades forwards (``c_base`` each) for tokens verified
(``c_tok`` each, rejected drafts included): it pays on requests that run long, which set a
batch's makespan, and not on short ones. :func:`measure_costs` times draftlab's own decoding
forward (``Target.forward`` over a ragged KV cache, as the decoder calls it) and
:func:`fit_costs` fits the line, reporting its mean relative error.

Budget (:class:`LengthBudget`): requests are classed short, medium or long by predicted length.
The thresholds are quantiles of the window's past rollout lengths (all problems); a request
starts in the class most of its problem's past rollouts fall in (medium without any), and moves
up as it outgrows its class while decoding. Short requests draft nothing, medium ones up to
``k_medium`` tokens a step, long ones up to ``k_long``.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from draftlab.errors import DraftlabError
from draftlab.limits import MAX_K

CLASSES = ("short", "medium", "long")


def _quantile(values: list[int], q: float) -> float:
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass
class Plan:
    """One request's budget: its class at the start and the thresholds it moves up by."""

    initial: str
    short_below: float  # a length under this is short
    long_above: float  # a length over this is long
    budgets: dict

    def cls(self, generated: int) -> str:
        """The class after ``generated`` tokens: the initial one, or higher once outgrown."""
        grown = "long" if generated > self.long_above else "medium" if generated >= self.short_below else "short"
        return max(self.initial, grown, key=CLASSES.index)

    def k(self, generated: int) -> int:
        return self.budgets[self.cls(generated)]


@dataclass
class LengthBudget:
    k_medium: int
    k_long: int
    short_quantile: float = 1 / 3
    long_quantile: float = 2 / 3

    def __post_init__(self):
        for name in ("k_medium", "k_long"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_K:
                raise DraftlabError(f"length budget: {name} must be an integer in 0..{MAX_K}, got {v!r}")
        if not 0.0 < self.short_quantile <= self.long_quantile < 1.0:
            raise DraftlabError("length budget: quantiles must satisfy 0 < short <= long < 1")

    def plan(self, history, prompt_ids: list[int]) -> Plan:
        """The plan of a request of ``prompt_ids``, from ``history``'s past rollout lengths
        (:meth:`~draftlab.inference.das.RolloutHistory.recent_lengths`)."""
        every = history.recent_lengths()
        budgets = {"short": 0, "medium": self.k_medium, "long": self.k_long}
        if not every:
            return Plan("medium", 0.0, float("inf"), budgets)
        short_below, long_above = _quantile(every, self.short_quantile), _quantile(every, self.long_quantile)
        own = history.recent_lengths(prompt_ids)
        classes = ["long" if n > long_above else "short" if n < short_below else "medium" for n in own]
        # the majority class of its problem's rollouts; ties go to the longer class (the safer bet on makespan)
        initial = max(CLASSES, key=lambda c: (classes.count(c), CLASSES.index(c))) if classes else "medium"
        return Plan(initial, short_below, long_above, budgets)


# ---------------------------------------------------------------------- the forward-cost model
@dataclass
class CostModel:
    c_base: float  # seconds per forward
    c_tok: float  # seconds per token in a forward
    mre: float  # mean relative error of the fit over its points
    points: list  # (tokens, seconds) measured

    def forward(self, n_tokens: int) -> float:
        return self.c_base + self.c_tok * n_tokens

    def to_dict(self) -> dict:
        return {"c_base_s": self.c_base, "c_tok_s": self.c_tok, "mre": self.mre, "points": [list(p) for p in self.points]}


def fit_costs(points: list[tuple[int, float]]) -> CostModel:
    """Least-squares ``t = c_base + c_tok * n`` over (n tokens, seconds) points."""
    ns = sorted({n for n, _ in points})
    if len(ns) < 2:
        raise DraftlabError("cost fit: needs forwards of at least two different token counts")
    mean_n = statistics.fmean(n for n, _ in points)
    mean_t = statistics.fmean(t for _, t in points)
    var = sum((n - mean_n) ** 2 for n, _ in points)
    c_tok = sum((n - mean_n) * (t - mean_t) for n, t in points) / var
    c_base = mean_t - c_tok * mean_n
    mre = statistics.fmean(abs(c_base + c_tok * n - t) / t for n, t in points)
    return CostModel(c_base, c_tok, mre, list(points))


@torch.no_grad()
def measure_costs(target, shapes=((1, 1), (1, 4), (1, 8), (2, 1), (2, 4), (4, 1), (4, 4), (4, 8), (8, 1), (8, 4)),
                  context: int = 64, repeats: int = 3) -> CostModel:
    """Time the decoder's forward of ``rows x inputs`` for each of ``shapes`` after ``context``
    cached tokens per row (the median of ``repeats``, after a warm-up) and fit the cost line."""
    g = torch.Generator().manual_seed(0)
    points = []
    for rows, inputs in shapes:
        cache = target.new_cache(rows, context + inputs + 1, ragged=True)
        prompt = torch.randint(0, target.vocab_size, (rows, context), generator=g).to(target.device)
        target.forward(prompt, cache=cache, logits=None)
        ids = torch.randint(0, target.vocab_size, (rows, inputs), generator=g).to(target.device)
        times = []
        for _ in range(repeats + 1):
            if target.device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            target.forward(ids, cache=cache, logits="all")
            if target.device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            cache.crop([context] * rows)
        points.append((rows * inputs, statistics.median(times[1:])))
    return fit_costs(points)
