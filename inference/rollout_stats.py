"""Means with intervals for per-rollout statistics (reward, mean token log-probability), and the
check that speculative rollouts follow the policy as plain ones do.

Rollouts are stratified by (epoch, problem): every method samples the same number of each, so a
method's mean is the mean over strata and its standard error comes from the variance *within*
strata (the problems' differences are the same for every method and would only widen the
interval). Two methods are consistent on a statistic when their difference lies within
``Z_MAX`` standard errors of 0 (two-sided p > 0.001 per statistic); a lossless decoder fails
that about once in a thousand statistics, a broken verifier (tests/test_rollouts.py) at once.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict

Z_MAX = 3.29
Z95 = 1.96


def _strata(values: list[float], strata: list) -> dict:
    groups = defaultdict(list)
    for v, s in zip(values, strata, strict=True):
        groups[s].append(v)
    return groups


def mean_se(values: list[float], strata: list) -> tuple[float, float]:
    """The mean of ``values`` and its stratified standard error (strata of one value take the
    mean within-stratum variance of the others; all of one value: the overall variance)."""
    if not values:
        return float("nan"), float("nan")
    groups = _strata(values, strata)
    within = [statistics.variance(g) for g in groups.values() if len(g) > 1]
    fallback = statistics.fmean(within) if within else (statistics.variance(values) if len(values) > 1 else 0.0)
    n = len(values)
    var = sum((len(g) / n) ** 2 * (statistics.variance(g) if len(g) > 1 else fallback) / len(g) for g in groups.values())
    return statistics.fmean(values), math.sqrt(var)


def interval(values: list[float], strata: list) -> dict:
    """{mean, se, lo, hi (95 %), n}."""
    m, se = mean_se(values, strata)
    return {"mean": m, "se": se, "lo": m - Z95 * se, "hi": m + Z95 * se, "n": len(values)}


def compare(a: tuple[list[float], list], b: tuple[list[float], list]) -> dict:
    """``b``'s mean less ``a``'s, a 95 % interval and z; ``consistent`` when |z| <= Z_MAX."""
    ma, sa = mean_se(*a)
    mb, sb = mean_se(*b)
    d, se = mb - ma, math.hypot(sa, sb)
    z = d / se if se > 0 else (0.0 if d == 0 else math.inf)
    return {"diff": d, "lo": d - Z95 * se, "hi": d + Z95 * se, "z": z, "consistent": abs(z) <= Z_MAX}
