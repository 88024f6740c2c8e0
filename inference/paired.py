"""Acceptance of drafters decoded on the same prompts, compared pair by pair.

Pooled α_j and τ (as a report pools them: sums over every verify step of every prompt) with one
standard error from a bootstrap over prompts, and each arm's paired difference from a base arm
(the same resampled prompts for both): a prompt that accepts little does so for every arm, so the
paired interval is far narrower than the two arms' own.
"""

from __future__ import annotations

import math
import random

from draftlab.errors import DraftlabError

BOOTSTRAP = 2000


def pooled(prompts: list[dict], k: int) -> tuple[list[float], float]:
    """(α_1..α_k, τ) pooled over the prompts' verify steps (report ``prompts`` entries)."""
    steps = sum(p["num_steps"] for p in prompts)
    reached = [sum(p["reached"][j] for p in prompts) for j in range(k)]
    alpha, prev = [], steps
    for r in reached:
        alpha.append(r / prev if prev else float("nan"))
        prev = r
    return alpha, 1 + sum(reached) / steps if steps else float("nan")


def bootstrap(reports: dict[str, dict], k: int, base: str, seed: int = 0) -> dict:
    """Per arm (``reports``: name -> an evaluation report): pooled α_j and τ with one s.e. over
    prompts; against ``base``: the paired difference of each and the prompts better/worse in τ."""
    ids = [p["id"] for p in reports[base]["prompts"]]
    by_id = {s: {p["id"]: p for p in r["prompts"]} for s, r in reports.items()}
    for s, r in by_id.items():
        if sorted(r) != sorted(ids):
            raise DraftlabError(f"{s}: its report decoded other prompts than {base}'s")
    rng = random.Random(seed)
    draws = [[rng.randrange(len(ids)) for _ in ids] for _ in range(BOOTSTRAP)]
    out = {}
    for s in reports:
        ps = [by_id[s][i] for i in ids]
        alpha, tau = pooled(ps, k)
        samples = []
        for d in draws:
            a, t = pooled([ps[j] for j in d], k)
            b = pooled([by_id[base][ids[j]] for j in d], k)
            samples.append(([*a, t], [x - y for x, y in zip([*a, t], [*b[0], b[1]])]))
        se = [_sd([v[0][j] for v in samples]) for j in range(k + 1)]
        dse = [_sd([v[1][j] for v in samples]) for j in range(k + 1)]
        ba, bt = pooled([by_id[base][i] for i in ids], k)
        diff = [x - y for x, y in zip([*alpha, tau], [*ba, bt])]
        better = sum(by_id[s][i]["tau"] > by_id[base][i]["tau"] for i in ids)
        worse = sum(by_id[s][i]["tau"] < by_id[base][i]["tau"] for i in ids)
        out[s] = {"alpha": alpha, "tau": tau, "se": se, "diff": diff, "diff_se": dse, "better": better, "worse": worse,
                  "matched": sum(bool(p.get("matched")) for p in ps), "prompts": len(ps)}
    return out


def pm(x: float, se: float) -> str:
    """``x ± se`` to three places ("–" for an α_j no step reached)."""
    return "–" if math.isnan(x) else f"{x:.3f}" + ("" if math.isnan(se) else f" ± {se:.3f}")


def _sd(xs: list[float]) -> float:
    xs = [x for x in xs if not math.isnan(x)]  # an α_j with no step reaching j-1 in a resample
    if len(xs) < 2:
        return float("nan")
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / max(1, len(xs) - 1))
