"""Small-row fp32 products on CPU: MKL or oneDNN on pre-packed weights, whichever this machine
runs faster.

A decode step multiplies a few rows (1 token, a chain, a tree) by every weight, so it is bound
by streaming the weights, and how fast that goes depends on the library and on the CPU. Over
the default target's weights (30 layers + lm_head, 2 threads), relative to MKL's 1-row GEMM:

| rows | Intel Xeon: MKL / oneDNN-packed | AMD EPYC (AVX2): MKL / oneDNN-packed |
|---|---|---|
| 1 | 1.00 / - | 1.00 / 0.70 |
| 2 | 1.06 / - | 1.77 / 0.81 |
| 3 | 1.15 / - | 2.62 / 0.76 |
| 4 | 1.8 / 1.27 | 1.90 / 0.88 |
| 8 | - / 1.56 | 2.50 / 1.18 |

So 4..PACKED_MAX_ROWS rows always take oneDNN on packed weights, 1..MKL_CANDIDATE_ROWS rows take
whichever :func:`mkl_faster_rows` measured faster for the weights at hand, and larger batches
(prefill, capture, training) take MKL, which is as fast there and needs no second copy.
"""

from __future__ import annotations

import copy
import time
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

MKL_CANDIDATE_ROWS, PACKED_MAX_ROWS = 3, 64


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


@torch.no_grad()
def mkl_faster_rows(paths: list[tuple[Callable, Callable, int]], reps: int = 3) -> frozenset[int]:
    """Row counts in 1..MKL_CANDIDATE_ROWS where MKL beat the packed weights.

    ``paths``: (MKL function, packed function, input width) per weight; both paths run over all
    of them per row count, interleaved, best of ``reps`` after one warm-up round (about a second
    for the default target's 135M weights)."""
    rows = range(1, MKL_CANDIDATE_ROWS + 1)
    x = {(r, n): torch.randn(r, n) for r in rows for n in {n for _, _, n in paths}}
    best = {(side, r): float("inf") for side in (0, 1) for r in rows}
    for rep in range(reps + 1):
        for r in rows:
            for side in (0, 1):  # 0: MKL, 1: packed
                start = time.perf_counter()
                for fns in paths:
                    fns[side](x[r, fns[2]])
                if rep:
                    best[side, r] = min(best[side, r], time.perf_counter() - start)
    return frozenset(r for r in rows if best[0, r] < best[1, r])


def takes_packed(x: torch.Tensor, mkl_rows: Callable[[], frozenset[int]]) -> bool:
    """Whether ``x``'s row count runs on the packed weights: up to PACKED_MAX_ROWS rows, unless
    MKL measured faster for it. ``mkl_rows`` is called only for such small row counts, so a
    caller that packs lazily on that call never packs for a large batch (capture, training)."""
    rows = x.numel() // x.shape[-1]
    return rows <= PACKED_MAX_ROWS and rows not in mkl_rows()


class DecodeLinear(nn.Module):
    """A frozen ``nn.Linear`` for decoding: up to PACKED_MAX_ROWS rows on its packed copy unless
    the row count is in ``mkl_rows``, more rows (a prefill) on MKL."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight, self.bias = linear.weight.detach(), None if linear.bias is None else linear.bias.detach()
        self.packed = PackedLinear(self.weight, self.bias)
        self.mkl_rows: frozenset[int] = frozenset()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if takes_packed(x, lambda: self.mkl_rows):
            return self.packed(x)
        return F.linear(x, self.weight, self.bias)


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
    mkl_rows = mkl_faster_rows([(lambda x, m=m: F.linear(x, m.weight, m.bias), m.packed, m.weight.shape[1]) for m in swapped])
    for m in swapped:
        m.mkl_rows = mkl_rows
    return module
