"""Simulations over recorded rollouts (labelled so wherever they are reported): replaying a drafter
over them, and a batch's makespan from the fitted forward costs.

Replay. A point-mass draft x̂ is accepted with probability p(x̂) and, when rejected, the token
is drawn from p without x̂; drawing x ~ p and accepting iff x = x̂ gives the same joint law of
(accepted?, next token). So replaying a chain drafter over rollouts sampled plainly from the
same policy (accept the drafts the recorded continuation starts with) gives acceptance
distributed exactly as speculative decoding would get it, without a target forward: a cheap
way to compare drafters (scopes, windows, budgets) on the same rollouts. Under greedy decoding
it reproduces the decoder's accepted lengths step for step (tests/test_rollouts.py), except
a last step that may accept drafts past the end the response was cut at.

Makespan. Rows decoding together take one forward per step over every unfinished row's last
token and drafts: a step costs ``c_base + c_tok * n_tokens`` (:class:`CostModel`), and the
batch is done when its longest row is. Prefill is left out (the same with or without drafts).
"""

from __future__ import annotations

from typing import Callable

import torch

from draftlab.inference.das_budget import CostModel
from draftlab.inference.shapes import Chain


def replay_batch(make_proposer: Callable | None, rows: list[tuple[list[int], list[int]]], k: int, history=None) -> list[list[tuple[int, int]]]:
    """Replay ``rows`` ((prompt, response) token lists) decoding together in lockstep, each row
    drafting chains of up to ``k`` with its own ``make_proposer()`` (None: no drafts). Returns
    each row's (drafted, accepted) per step after its first token. ``history``: the
    :class:`~draftlab.inference.das.RolloutHistory` the proposers learn into, closed per row."""
    proposers = [make_proposer() if make_proposer is not None else None for _ in rows]
    steps: list[list[tuple[int, int]]] = [[] for _ in rows]
    pos = [1] * len(rows)
    for p, (prompt, response) in zip(proposers, rows):
        if p is not None:
            p.start(torch.tensor(prompt), {}, response[0])
    going = [r for r, (_, response) in enumerate(rows) if len(response) > 1]
    if history is not None:
        for prompt, response in rows:
            if len(response) <= 1:
                history.close(prompt, response)
    while going:
        still = []
        for r in going:
            prompt, response = rows[r]
            p, at = proposers[r], pos[r]
            draft = p.propose(Chain(k)).tokens.tolist() if p is not None else []
            m = 0
            while m < len(draft) and at + m < len(response) and draft[m] == response[at + m]:
                m += 1
            kept = response[at : at + m + 1]
            steps[r].append((len(draft), m))
            pos[r] = at + len(kept)
            if pos[r] < len(response):
                still.append(r)
                if p is not None:
                    p.advance(torch.tensor(kept), {})
            elif history is not None:  # done: its last tokens go in now, as a finished rollout's would
                history.close(prompt, response)
        going = still
    return steps


def makespan(traces: list[list[tuple[int, int]]], costs: CostModel) -> float:
    """Seconds for rows with these (drafted, accepted) steps to decode as one batch."""
    total = 0.0
    for i in range(max((len(t) for t in traces), default=0)):
        total += costs.forward(sum(1 + t[i][0] for t in traces if i < len(t)))
    return total


def tau(traces: list[list[tuple[int, int]]]) -> float:
    """Tokens per forward over every step of ``traces`` (1.0 without steps)."""
    steps = [s for t in traces for s in t]
    return 1.0 + sum(a for _, a in steps) / len(steps) if steps else 1.0


def tau_difference(traces: list[list[tuple[int, int]]], base: list[list[tuple[int, int]]], groups: list,
                   draws: int = 2000, seed: int = 0) -> tuple[float, float | None]:
    """:func:`tau` of ``traces`` minus that of ``base`` (the same rollouts replayed by another
    drafter) and one bootstrap standard error resampling ``groups`` (problems) for both at once:
    paired, so what every drafter finds easy or hard on a problem cancels. None with one group."""
    import random

    units: dict = {}
    for a, b, g in zip(traces, base, groups, strict=True):
        u = units.setdefault(g, [0, 0, 0, 0])  # steps and accepted of each
        u[0] += len(a)
        u[1] += sum(n for _, n in a)
        u[2] += len(b)
        u[3] += sum(n for _, n in b)

    def diff(us):
        return sum(u[1] for u in us) / max(1, sum(u[0] for u in us)) - sum(u[3] for u in us) / max(1, sum(u[2] for u in us))

    us = list(units.values())
    if len(us) < 2:
        return diff(us), None
    rng = random.Random(seed)
    samples = [diff([us[rng.randrange(len(us))] for _ in us]) for _ in range(draws)]
    mean = sum(samples) / draws
    return diff(us), (sum((x - mean) ** 2 for x in samples) / (draws - 1)) ** 0.5


def tau_standard_error(traces: list[list[tuple[int, int]]], groups: list) -> float | None:
    """One standard error of :func:`tau` with ``groups`` (a label per trace: its problem) as the
    sampled units: a problem's samples share its trie and its text, so they are not independent
    (:func:`~draftlab.inference.metrics.tau_standard_error`); None with fewer than 2 groups."""
    from draftlab.inference.metrics import acceptance_stats, tau_standard_error as pooled_se

    by_group: dict = {}
    for trace, g in zip(traces, groups, strict=True):
        by_group.setdefault(g, []).extend(trace)
    stats = [acceptance_stats([a for _, a in t], [d for d, _ in t]) for t in by_group.values() if t]
    return pooled_se(stats)
