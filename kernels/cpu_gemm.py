"""Small-row fp32 products on CPU: MKL or oneDNN on pre-packed weights, at the row count this
machine runs fastest.

A decode step multiplies a few rows (1 token, a chain, a tree) by every weight, so it is bound
by streaming the weights, and which library is fastest, and even whether more rows cost more,
differs from CPU to CPU. So 4..PACKED_MAX_ROWS rows take oneDNN on packed weights,
1..MKL_CANDIDATE_ROWS rows whichever path measured faster for the weights at hand, and a row
count that runs slower than a larger one up to PAD_CANDIDATE_ROWS is run as that one, zero rows
appended; all of it measured once per set of weights (:func:`measure_row_plan`). Larger batches
(prefill, capture, training) take MKL, which is as fast there and needs no second copy. The plan
a decoding run used is in its notes (BENCHMARKS.md, "Speedup by batch size").
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from itertools import groupby
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

MKL_CANDIDATE_ROWS, PAD_CANDIDATE_ROWS, PACKED_MAX_ROWS = 3, 8, 64


def packing_available(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and torch.backends.mkldnn.is_available()


class PackedLinear:
    """``F.linear(x, weight, bias)`` on a copy of ``weight`` packed for oneDNN's CPU GEMM."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        self.bias, self.out_features = bias, weight.shape[0]
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 16)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), self.weight, self.bias, "none", [], "")
        return y.view(*x.shape[:-1], self.out_features)


@dataclass(frozen=True)
class RowPlan:
    """How a product of a few rows runs: row counts (as run) that take MKL, the others up to
    PACKED_MAX_ROWS the packed weights; ``pad``: row counts run as more rows (zero rows
    appended, their outputs dropped) because that many measured faster."""

    mkl: frozenset[int] = frozenset()
    pad: dict[int, int] = field(default_factory=dict)

    def __call__(self, x: torch.Tensor, mkl: Callable, packed: Callable) -> torch.Tensor:
        """``mkl(x)`` or ``packed(x)`` by ``x``'s row count (every dimension but the last)."""
        rows = x.numel() // x.shape[-1]
        run = self.pad.get(rows, rows)
        product = mkl if run > PACKED_MAX_ROWS or run in self.mkl else packed
        if run == rows:
            return product(x)
        flat = x.reshape(rows, x.shape[-1])
        y = product(torch.cat([flat, flat.new_zeros(run - rows, flat.shape[1])]))
        return y[:rows].reshape(*x.shape[:-1], y.shape[-1])

    def __str__(self) -> str:
        # consecutive row counts as one span (ON_MKL: "1-64")
        spans = [[r for _, r in g] for _, g in groupby(enumerate(sorted(self.mkl)), lambda p: p[1] - p[0])]
        on_mkl = ", ".join(str(s[0]) if len(s) == 1 else f"{s[0]}-{s[-1]}" for s in spans) or "none"
        padded = ", ".join(f"{r} as {n}" for r, n in sorted(self.pad.items())) or "none"
        return f"rows on MKL: {on_mkl}; rows padded: {padded}"


ON_MKL = RowPlan(mkl=frozenset(range(1, PACKED_MAX_ROWS + 1)))  # where there is nothing to pack


def plan_from_times(seconds: dict[tuple[str, int], float], min_gain: float = 0.05) -> RowPlan:
    """The plan from measured seconds per (path, rows), path "mkl" or "packed": each row count
    on its faster path, and run as a larger measured row count when that is more than
    ``min_gain`` faster (a pad that only matches wastes the work of its zero rows)."""
    rows = sorted({r for _, r in seconds})
    best = {r: min(seconds[side, r] for side in ("mkl", "packed") if (side, r) in seconds) for r in rows}
    mkl = frozenset(r for r in rows if ("mkl", r) in seconds and seconds["mkl", r] < seconds.get(("packed", r), float("inf")))
    pad = {}
    for r in rows:
        n = min((n for n in rows if n >= r), key=best.__getitem__)
        if best[n] < (1 - min_gain) * best[r]:
            pad[r] = n
    return RowPlan(mkl, pad)


@torch.no_grad()
def measure_row_plan(paths: list[tuple[Callable, Callable, int]], reps: int = 3) -> RowPlan:
    """Time MKL for 1..MKL_CANDIDATE_ROWS rows and the packed weights for 1..PAD_CANDIDATE_ROWS
    over all of ``paths`` ((MKL function, packed function, input width) per weight), interleaved,
    best of ``reps`` after one warm-up round (a few seconds for the default target), and
    plan from that (:func:`plan_from_times`)."""
    runs = [("mkl", r) for r in range(1, MKL_CANDIDATE_ROWS + 1)] + [("packed", r) for r in range(1, PAD_CANDIDATE_ROWS + 1)]
    x = {(r, n): torch.randn(r, n) for _, r in runs for n in {n for _, _, n in paths}}
    best = {run: float("inf") for run in runs}
    for rep in range(reps + 1):
        for side, r in runs:
            start = time.perf_counter()
            for fns in paths:
                fns[side == "packed"](x[r, fns[2]])
            if rep:
                best[side, r] = min(best[side, r], time.perf_counter() - start)
    return plan_from_times(best)


class DecodeLinear(nn.Module):
    """A frozen ``nn.Linear`` for decoding: a few rows as ``plan`` says (its packed copy, MKL,
    padded), more rows (a prefill) on MKL."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight, self.bias = linear.weight.detach(), None if linear.bias is None else linear.bias.detach()
        self.packed = PackedLinear(self.weight, self.bias)
        self.plan = RowPlan()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.plan(x, lambda v: F.linear(v, self.weight, self.bias), self.packed)


def decoding_copy(module: nn.Module) -> nn.Module:
    """A frozen copy of ``module`` whose ``nn.Linear`` layers are :class:`DecodeLinear` (CPU fp32;
    elsewhere the module itself). Modules it holds outside its registered children (a drafter's
    references to the target's embedding and lm_head) stay shared, not copied."""
    weights = [m.weight for m in module.modules() if isinstance(m, nn.Linear)]
    if not weights or not all(packing_available(w) for w in weights):
        return module
    shared = {id(v): v for v in vars(module).values() if isinstance(v, nn.Module)}
    module = copy.deepcopy(module, memo=shared).eval().requires_grad_(False)
    swapped = []
    for parent in list(module.modules()):
        for name, child in parent.named_children():
            if isinstance(child, nn.Linear):
                swapped.append(DecodeLinear(child))
                setattr(parent, name, swapped[-1])
    plan = measure_row_plan([(lambda x, m=m: F.linear(x, m.weight, m.bias), m.packed, m.weight.shape[1]) for m in swapped])
    for m in swapped:
        m.plan = plan
    return module
