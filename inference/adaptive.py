"""Adaptive draft length: choose k (0 = a plain step) before every batched step.

A step of B rows drafting k tokens each costs the target's verify forward over B x (k + 1)
inputs plus the drafting, and yields on average E_r(k) = 1 + sum_{j<=k} prod_{i<=j} alpha_i(r)
tokens for row r. The policy picks the k that maximises sum_r E_r(k) / cost(B, k), or, where
the decoder says how many tokens each row has left (a batch that ends with its last row, as the
evaluation's), the batch's tokens left over the expected seconds until its last row ends
(:meth:`AdaptiveDraftLength.batch_steps`):

- ``cost(B, k)``: the verify forward's seconds, measured on this machine at start-up (the
  median of rounds over every k and context) at two contexts and interpolated to the tokens the
  rows' attention reads (:class:`VerifyCost`); times what real steps in B's range (batch sizes
  1, 2, 3-4, 5-8, ...) measured against that: a factor shared by both kinds of step (the least of
  the last 8, within the last 32 steps: ragged rows, the machine's drift) and, for a drafting
  step, its own factor over a plain one (the median ratio of consecutive drafting and plain
  steps, shrunk towards 1: accept kernel, padding, bookkeeping); plus the drafting: proposing
  (seconds per draft position at that batch size, measured while decoding: drafting cost
  differs by family, and by whether it drafts row by row or all rows at once) and, before it,
  the drafter's catch-up on the tokens it has not read (a line in the tokens, fitted to the
  catch-ups measured at that batch size; :meth:`AdaptiveDraftLength.catch_up_seconds`): all of
  the plain steps' tokens for a draft after them, one step's tokens for each draft after that;
- ``alpha_i(r)``: the acceptance observed so far at draft position i in row r's context (what
  its last step's draft did: rejected, partly or wholly accepted), shrunk towards the acceptance
  of all rows, which has a Laplace prior ((accepted + 1) / (reached + 2)). A probe that most rows
  accept can so lead to further drafting steps while the rows' runs last, where the pooled
  acceptance alone would return to plain steps.

Exploration is optimistic: when the k chosen from the estimates would change under the upper
confidence bound of the pooled alpha (mean + ``confidence`` standard errors), the policy drafts
one more position than the estimates say, so an estimate it stopped feeding cannot freeze, and
stops probing once enough rows have been seen that even the optimistic alpha would not pay. A
batch of B rows teaches B observations per step, so probing ends sooner where it costs most.
The bound is the pooled one, every row alike, not each row's context's: a context holds few rows,
so its bound stays wide, and each probe puts rows in contexts again. At batch 4 on the AMD EPYC,
rows whose draft was all accepted had an acceptance of 0.39 after 184 rows, bound 0.46: enough
for a probe whenever two of the four rows had just accepted their draft. Costs are
explored too: while one kind of step (plain or drafting) has been measured fewer than 4 times in
a range and its predicted rate is within one step's timing noise (10 %) of the chosen kind's,
the policy takes it (a draft only where the drafter has at most one step's tokens to read).
Plain decoding keeps a tie: a draft must be predicted to gain more than ``min_gain`` (5 %),
the error of the predicted step seconds seen per batch of prompts. A plain
step that wins by m % stands for the next m steps too (at most ``memory``; :meth:`held`), which
the decoder takes unasked while no row ends: deciding costs more than it changes there.

Why: with more rows the verify forward turns from weight-bound to compute-bound, so a draft
that pays at batch 1 can cost more than it yields at batch 16 (SpecDecodeBench: EAGLE's
speedup falls from 1.73x at batch 1 to 1.21x at batch 128).
"""

from __future__ import annotations

import collections
import functools
import itertools
import operator
import statistics

import torch

from draftlab.inference.decoder import _Clock
from draftlab.models.target import attention_groups


class VerifyCost:
    """Seconds of one target forward over B rows x (k + 1) inputs each, against a cache of
    ``context`` tokens per row, measured for the batch sizes, k = 0..max_k and two contexts;
    other batch sizes are interpolated linearly (clamped to the measured range), other contexts
    linearly too (extrapolated above: attention reads every cached token, so its cost grows
    linearly; clamped below). Why the context: at batch 4 on the AMD EPYC a forward of 2 inputs
    per row cost 1.13x one of 1 input at a 256-token context and 1.23x at 1,000 tokens, which
    is the margin a draft of acceptance 0.34 has to pay for."""

    def __init__(self, seconds: dict[tuple[int, int, int], float]):
        self.seconds = dict(seconds)
        self.batch_sizes = sorted({b for b, _, _ in self.seconds})
        self.contexts = sorted({c for _, _, c in self.seconds})

    @classmethod
    @torch.no_grad()
    def measure(cls, target, batch_sizes, max_k: int, contexts=(64, 1024), repeats: int = 9) -> "VerifyCost":
        """Per batch size, ``repeats`` rounds over every (context, k), each forward once a round,
        after one round that warms up (allocations, GEMM choice); the median of the rounds. Why
        rounds and the median: measured one configuration after another, the least of 5 runs
        each, at batch 4 on the AMD EPYC two start-ups priced 2 inputs per row at 1.12x and 1.46x
        one input (64-token context), and the policy drafted every step after the first and no
        step after the second; the machine's slow spells now fall on every configuration alike."""
        clock = _Clock(target.device)
        seconds = {}
        g = torch.Generator().manual_seed(0)
        for B in sorted(set(batch_sizes)):
            cache = target.new_cache(B, max(contexts) + max_k + 1, ragged=True)
            configs = [(context, k) for context in sorted(set(contexts)) for k in range(max_k + 1)]
            ids = {k: torch.randint(0, target.vocab_size, (B, k + 1), generator=g).to(target.device) for k in range(max_k + 1)}
            times = {c: [] for c in configs}
            for _ in range(repeats + 1):
                for context, k in configs:
                    cache.lengths = [context] * B  # the slots' content does not change the cost
                    t0 = clock()
                    target(ids[k], cache=cache, logits="all")
                    times[(context, k)].append(clock() - t0)
            for (context, k), t in times.items():
                seconds[(B, k, context)] = statistics.median(t[1:])
        return cls(seconds)

    def __call__(self, B: int, k: int, context: float | None = None) -> float:
        """``context``: the tokens per row the forward's attention reads (default: the least measured)."""
        cs = self.contexts
        if context is None or context <= cs[0] or len(cs) == 1:
            return self._at(B, k, cs[0])
        hi = next((c for c in cs if c >= context), cs[-1])
        lo = max(c for c in cs if c < hi)
        w = (context - lo) / (hi - lo)
        return (1 - w) * self._at(B, k, lo) + w * self._at(B, k, hi)

    def _at(self, B: int, k: int, context: int) -> float:
        sizes = self.batch_sizes
        if B <= sizes[0]:
            return self.seconds[(sizes[0], k, context)]
        if B >= sizes[-1]:
            return self.seconds[(sizes[-1], k, context)] * B / sizes[-1]
        hi = next(s for s in sizes if s >= B)
        lo = max(s for s in sizes if s <= B)
        if hi == lo:
            return self.seconds[(lo, k, context)]
        w = (B - lo) / (hi - lo)
        return (1 - w) * self.seconds[(lo, k, context)] + w * self.seconds[(hi, k, context)]

    def to_dict(self) -> dict:
        return {f"{b}x{k + 1}@{c}": s for (b, k, c), s in sorted(self.seconds.items())}


def attended_context(lengths: list[int]) -> float:
    """The cached tokens per row a forward reads, on average, over a ragged cache of
    ``lengths``: rows attend in groups over the group's longest row
    (:func:`~draftlab.models.target.attention_groups`), so a short row beside a long one reads
    the long one's span. The same for any number of inputs per row: adding them to every span
    adds the same to every grouping's cost, so the grouping does not change."""
    spans = [n + 1 for n in lengths]
    return sum((hi - lo) * span for lo, hi, span in attention_groups(spans)) / len(spans) - 1


def _nearest(measured: dict[int, object], B: int) -> int:
    """The batch size measured nearest to B (the smaller on a tie)."""
    return min(measured, key=lambda b: (abs(b - B), b))


@functools.cache
def _largest_normal(n: int) -> float:
    """The expected largest of n standard normals (Blom's approximation; 0 for one)."""
    return statistics.NormalDist().inv_cdf((n - 0.375) / (n + 0.25)) if n > 1 else 0.0


class AdaptiveDraftLength:
    """The decoding policy of :class:`~draftlab.inference.decoder.BatchedSpeculativeDecoder`:
    ``choose(B, previous, lengths, remaining, pending) -> k`` before a step, ``observe(B, k,
    accepted, draft_seconds, step_seconds, catch_up)`` after it. One policy may serve many
    batches (an evaluation keeps one across batch sizes: acceptance does not depend on the batch
    size, and a server would not forget it either).

    Acceptance is kept per *context*: what the row's last step did (its first draft rejected;
    some drafts accepted; every draft accepted); a row whose last step drafted nothing (a plain
    step, or none yet) counts with the pooled acceptance of all rows. Why: acceptance comes in
    runs (a row copying a list or code accepts draft after draft), so a row that just accepted
    everything is likelier to accept again, and a batch of such rows earns a longer draft. A
    context's alpha is shrunk towards the pooled one by ``prior`` pseudo-observations, so a
    context seen rarely falls back to what all rows show."""

    CONTEXTS = ("rejected", "partial", "all")

    def __init__(self, cost: VerifyCost, max_k: int, confidence: float = 2.0, window: int = 8, memory: int = 32,
                 history: int = 256, prior: float = 4.0, step_noise: float = 0.1, min_gain: float = 0.05):
        self.cost, self.max_k = cost, max_k
        self.confidence, self.window, self.memory, self.history, self.prior = confidence, window, memory, history, prior
        # one step's seconds vary by this fraction from step to step (on the AMD EPYC: +-8 % at
        # batch 4, the same forward repeated)
        self.step_noise = step_noise
        # a draft must be predicted to gain more than this over a plain step: per batch of
        # prompts, predicted step seconds missed the measured by up to 5 % on the AMD EPYC, and
        # near break-even a wrong guess either way costs as much, so plain decoding keeps the tie
        self.min_gain = min_gain
        # context -> index j: rows whose draft reached position j / accepted it ("pooled": every row)
        self.reached = {c: [0] * (max_k + 1) for c in ("pooled", *self.CONTEXTS)}
        self.accepted = {c: [0] * (max_k + 1) for c in ("pooled", *self.CONTEXTS)}
        # batch size -> [seconds, draft positions] of the steps that drafted: per-row proposers
        # cost B times a row's drafting, batched ones (EagleChains) about one row's
        self.drafting: dict[int, list[float]] = {}
        # batch size -> the drafter's catch-ups (tokens read, seconds), the last ``history``
        self.catch_ups: dict[int, list[tuple[int, float]]] = {}
        # batch-size range -> its steps' (step number, drafted?, measured seconds (drafting
        # apart) over the start-up model's), the last ``history``
        self.step_ratios: dict[int, list[tuple[int, bool, float]]] = {}
        # kept up as steps come, not rescanned: per range, the last ``history`` (step number,
        # ratio of the drafting to the plain one) of consecutive steps of the two kinds, the
        # drafting extra they give, and how many steps of each kind were measured (rescanning the
        # history at every step was a fifth of choose's and observe's work at batch 4 on the
        # AMD EPYC: 0.082 ms a step, 0.065 without, timed apart from the target). Neither is
        # forgotten with the steps' history: at batch 4 on the AMD EPYC the policy explored
        # drafting's cost again (3 drafting steps, each a loss) every 256 plain steps.
        self._pairs: dict[int, list[tuple[int, float]]] = {}
        self._extra: dict[int, float] = {}
        self._kinds: dict[int, list[int]] = {}
        self.steps = 0  # steps observed
        self.chosen: list[int] = []
        self._contexts: list[str] = []  # the rows' contexts at the last choose
        # at the last choose: B, the rows the forward runs and the attended context
        self._context: tuple[int, int, float | None] = (0, 0, None)
        # what the recent steps say, per batch-size range, kept until the next observation
        self._memo: dict[int, tuple[float, float, int, int]] = {}
        self._lines: dict[int, tuple[float, float]] = {}  # batch size -> the catch-ups' (intercept, slope)
        self._held = 1  # the plain steps the last choose decided (:meth:`held`)

    def measured(self, drafting: bool, B: int) -> int:
        """Steps of a kind measured in B's range."""
        return self._summary(B)[3 if drafting else 2]

    def _summary(self, B: int) -> tuple[float, float, int, int]:
        """B's range: (drafting extra, level, plain steps measured, drafting steps measured)."""
        r = self._range(B)
        if r not in self._memo:
            extra = self._extra.get(r, 1.0)
            recent = [x / (extra if drafted else 1.0) for step, drafted, x in self.step_ratios.get(r, [])[-self.window:]
                      if step > self.steps - self.memory]
            plain, drafting = self._kinds.get(r, (0, 0))
            self._memo[r] = (extra, min(recent) if recent else 1.0, plain, drafting)
        return self._memo[r]

    def _keep_step(self, r: int, drafted: bool, ratio: float) -> None:
        """Keep a step's ratio to the model in range r, the last ``history``, and what they give."""
        steps = self.step_ratios.setdefault(r, [])
        pairs, kinds = self._pairs.setdefault(r, []), self._kinds.setdefault(r, [0, 0])
        paired = bool(steps) and steps[-1][1] != drafted and steps[-1][0] == self.steps - 1
        if paired:
            pairs.append((self.steps, (ratio / steps[-1][2]) ** (1 if drafted else -1)))
        steps.append((self.steps, drafted, ratio))
        kinds[drafted] += 1
        del steps[: -self.history]
        del pairs[: -self.history]
        if paired:
            # the model's 1.0 counts as window / 2 pairs: one pair is two noisy steps (at batch 4
            # on the AMD EPYC a single pair read 0.91, and with no plain step after it the policy
            # priced drafting 9 % cheaper for the rest of the run)
            self._extra[r] = statistics.median([x for _, x in pairs] + [1.0] * (self.window // 2)) if pairs else 1.0

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
    def _run_tails(k: int, alpha: list[float]) -> list[float]:
        """P(the accepted run reaches j), j = 1..k: the products of alpha up to j."""
        return list(itertools.accumulate(alpha[:k], operator.mul))

    @classmethod
    def expected_tokens(cls, k: int, alpha: list[float]) -> float:
        """A row's tokens from one step drafting k: 1 + the mean accepted run."""
        return 1.0 + sum(cls._run_tails(k, alpha))

    @classmethod
    def token_variance(cls, k: int, alpha: list[float]) -> float:
        """The variance of a row's tokens from one step drafting k (that of the accepted run:
        E[run^2] = sum_j (2j - 1) P(run >= j))."""
        tails = cls._run_tails(k, alpha)
        return sum((2 * j - 1) * p for j, p in enumerate(tails, start=1)) - sum(tails) ** 2

    @classmethod
    def batch_steps(cls, k: int, remaining: list[tuple[list[float], int]]) -> float:
        """The expected steps until the last row ends, drafting k at every step, for rows of
        (acceptance, tokens left): the largest over rows of a row's mean steps plus c_B standard
        deviations (a renewal count's: n var / E^3), c_B the expected largest of B standard
        normals (Blom's approximation; 0 for one row). Why: a batch waits for its slowest row,
        and drafting spreads the rows apart. On the Zen 4 EPYC, fixed k = 1 cut a row's steps
        for 48 tokens to 35 on average (tau 1.33, 1.27x a plain step's cost at batch 4), but
        groups of 4 took 36-42 steps, and batch 4 ran at 0.94x plain decoding."""
        c = _largest_normal(len(remaining))
        worst = 0.0
        for alpha, n in {(tuple(alpha), n) for alpha, n in remaining}:  # rows alike count once
            e = cls.expected_tokens(k, alpha)
            worst = max(worst, n / e + c * (n * cls.token_variance(k, alpha) / e ** 3) ** 0.5)
        return worst

    def catch_up_seconds(self, B: int, tokens: float) -> float:
        """The drafter of B rows reading ``tokens`` (all rows') it has not read: a least-squares
        line (intercept and slope at least 0) through the catch-ups measured at B, else at the
        nearest batch size measured; their mean where they all read as many tokens; 0 for no
        token or before any catch-up. Why a line: the drafter runs one forward over them all, so
        a catch-up has a fixed cost and one per token (at batch 4 on the AMD EPYC, 6.2 ms for 8
        tokens, 13.0 ms for 64)."""
        if tokens <= 0 or not self.catch_ups:
            return 0.0
        b = _nearest(self.catch_ups, B)
        if b not in self._lines:
            xs, ys = zip(*self.catch_ups[b])
            slope = max(statistics.linear_regression(xs, ys).slope, 0.0) if len(set(xs)) > 1 else 0.0
            self._lines[b] = (max(statistics.fmean(ys) - slope * statistics.fmean(xs), 0.0), slope)
        intercept, slope = self._lines[b]
        return intercept + slope * tokens

    def draft_seconds(self, B: int, k: int) -> float:
        """k draft positions at batch size B: the mean cost of a position measured at B, else at
        the nearest batch size measured (0 before any)."""
        if not self.drafting or k == 0:
            return 0.0
        seconds, positions = self.drafting[_nearest(self.drafting, B)]
        return k * seconds / positions

    @staticmethod
    def _range(B: int) -> int:
        """Batch sizes 1, 2, 3-4, 5-8, ... share what they measure (the smallest power of 2 >= B)."""
        return 1 << (B - 1).bit_length()

    def target_seconds(self, B: int, k: int, context: float | None = None) -> float:
        """A step's seconds apart from drafting: the start-up model at the attended ``context``
        (:func:`attended_context`; None: the least measured), times what recent steps in B's
        range measured against it (:meth:`level`), times what a drafting step costs beyond a
        plain one (:meth:`drafting_extra`).

        Why factors, not added seconds: what the model misses (the rows' real attention, the
        machine's drift) grows with the inputs a forward runs, as the forward does. Added
        seconds spread it evenly over both kinds of step, which made a draft look cheaper the
        more the model missed: at batch 4 on the AMD EPYC, 17-25 ms added to modelled plain
        steps of 85-106 ms priced a verify of 2 inputs per row at 1.17-1.20x a plain step, where
        the model says 1.21-1.24x."""
        return self.cost(B, k, context) * self.level(B) * (self.drafting_extra(B) if k else 1.0)

    def drafting_extra(self, B: int) -> float:
        """What a drafting step costs beyond a plain one in B's range, drafting apart (the
        accept kernel, padding, bookkeeping), as a factor on the model: the median ratio of
        consecutive steps of the two kinds, which share the batch's context and the machine's
        speed, with the model's 1.0 counted as ``window / 2`` pairs (1 before a pair)."""
        return self._summary(B)[0]

    def level(self, B: int) -> float:
        """The factor by which the last ``window`` steps in B's range, within the last
        ``memory`` steps, exceeded the model, :meth:`drafting_extra` apart: the batch's real
        context (its rows' lengths differ, so attention runs in several calls; the model was
        measured on even lengths) and the machine's speed drift, alike for both kinds. The
        least of them: one step slowed by other work must not keep the policy from drafting
        (1 before any)."""
        return self._summary(B)[1]

    def predicted_seconds(self, B: int, k: int, context: float | None = None, run: int | None = None) -> float:
        """A step of B rows drafting k each, whose forward runs ``run`` rows (default B)."""
        return self.target_seconds(run or B, k, context) + self.draft_seconds(B, k)

    def rates(self, B: int, rows: list[str], alpha, context: float | None = None, run: int | None = None,
              remaining: list[int] | None = None, pending: int = 0) -> list[float]:
        """Expected tokens per second of each k = 0..max_k for ``rows`` (each row's context,
        acceptance ``alpha(context)``) at the attended ``context``, the forward running ``run``
        rows; with ``remaining`` (each row's tokens left), the rows' tokens left over the seconds
        until the last row ends (:meth:`batch_steps`); plain steps' (k = 0) counted ``min_gain``
        higher. A drafting k pays the drafter's catch-up on the ``pending`` tokens (all rows')
        first, and with ``remaining``, on each later step's tokens too."""
        return self._rates(B, rows, alpha, [self.predicted_seconds(B, k, context, run) for k in range(self.max_k + 1)],
                           remaining, pending)

    def _rates(self, B: int, rows: list[str], alpha, step_seconds: list[float], remaining: list[int] | None,
               pending: int) -> list[float]:
        """:meth:`rates` from each k's predicted step seconds."""
        alphas = {c: alpha(c) for c in set(rows)}
        counts = collections.Counter(rows)
        left = sum(remaining) if remaining else 0
        out = []
        for k, seconds in enumerate(step_seconds):
            step_tokens = sum(n * self.expected_tokens(k, alphas[c]) for c, n in counts.items())
            if remaining:
                tokens = left
                steps = self.batch_steps(k, [(alphas[c], n) for c, n in zip(rows, remaining)])
                seconds *= steps
                if k:
                    seconds += max(steps - 1, 0.0) * self.catch_up_seconds(B, step_tokens)
            else:
                tokens = step_tokens
            if k:
                seconds += self.catch_up_seconds(B, pending)
            out.append(tokens / seconds * (1 + self.min_gain if k == 0 else 1))
        return out

    def choose(self, B: int, previous: list[tuple[int, int] | None] | None = None,
               lengths: list[int] | None = None, remaining: list[int] | None = None,
               pending: list[int] | None = None) -> int:
        """The draft length of the next step of B rows; ``previous``: each row's last step's
        (drafted, accepted), None before its first; ``lengths``: the tokens each row of the KV
        cache holds (None: the least context the start-up model measured). The forward runs
        every row of the cache, so its cost is that of ``len(lengths)`` rows: finished rows stay
        in it, idle, until half of it has finished. ``remaining``: each row's tokens left before
        its budget ends (None: rows are replaced as they end, as in a server, and every token
        counts alike). ``pending``: the tokens each row's drafter has yet to read before it
        drafts (None: none)."""
        run = len(lengths) if lengths else B
        self._contexts = [self.context(p) for p in (previous or [None] * B)]
        self._context = (B, run, attended_context(lengths) if lengths else None)
        unread = sum(pending) if pending else 0
        seconds = [self.predicted_seconds(B, k, self._context[2], run) for k in range(self.max_k + 1)]
        rates = self._rates(B, self._contexts, self.alpha, seconds, remaining, unread)
        k = max(range(self.max_k + 1), key=rates.__getitem__)
        optimistic = rates
        if k < self.max_k:
            optimistic = self._rates(B, ["pooled"] * B, self.optimistic_alpha, seconds, remaining, unread)
            if max(range(self.max_k + 1), key=optimistic.__getitem__) > k:
                k += 1  # probe: the next position might pay
        # the other kind of step (plain or drafting), while it was measured in fewer than
        # window / 2 steps in this range and its rate is within one step's timing noise of the
        # chosen: measure it (a decision near break-even taken on one noisy sample would stand).
        # A draft only where no row's drafter has more than one step's tokens to read: at batch 4
        # on the AMD EPYC such drafts came after 3-10 plain steps, read up to 38 tokens first,
        # and, one drafting step among plain ones, shortened no batch (it waits for its slowest
        # row); a batch's first step reads none.
        rival = max(range(1, self.max_k + 1), key=rates.__getitem__) if k == 0 else 0
        fresh = rival == 0 or not pending or max(pending) <= self.max_k + 1
        if fresh and self.measured(rival > 0, run) < self.window // 2 and rates[rival] >= (1 - self.step_noise) * rates[k]:
            k = rival
        margin = rates[0] / max(rates[1:] + optimistic[1:])
        self._held = 1 + min(int(100 * (margin - 1)), self.memory) if k == 0 and margin > 1 else 1
        self.chosen.append(k)
        return k

    def held(self) -> int:
        """The plain steps the last :meth:`choose` decided at once, that one included: a plain
        step chosen by a margin of m % over every draft (optimistic ones too) stands for the
        next m steps too (at most ``memory``), taken by the decoder without asking again while
        no row ends. Why: while plain steps last a draft only grows dearer (the drafter's
        catch-up grows, and fewer tokens are left to gain on), and deciding costs more than it
        changes there: at batch 8 on the AMD EPYC the adaptive decoder spent 0.11 ms a step more
        than plain decoding outside the forward (the policy 0.074 ms) with choose and observe
        asked at every step, 0.063 ms (the policy 0.015 ms) with the held steps taken unasked."""
        return self._held

    def observe(self, B: int, k: int, accepted: list[int], draft_seconds: float | None = None,
                step_seconds: float | None = None, catch_up: tuple[float, int] | None = None) -> None:
        """After a step of B rows that drafted k: each row's accepted count, the seconds of
        proposing the k positions, the rest of the step's (the target's forward, the accept
        kernel, the bookkeeping) and the drafter's catch-up before it (seconds, tokens read)."""
        if catch_up is not None and catch_up[1] > 0:
            kept = self.catch_ups.setdefault(B, [])
            kept.append((catch_up[1], catch_up[0]))
            del kept[: -self.history]
            self._lines.pop(B, None)
        if step_seconds is not None:
            run, context = self._context[1:] if self._context[0] == B else (B, None)
            self._keep_step(self._range(run), k > 0, step_seconds / self.cost(run, k, context))
        self.steps += 1
        self._memo.clear()
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
