"""The MTP module's objective (FastMTP, Cai et al. 2025, arXiv 2509.18362; the drafter: models/mtp.py).

One module is applied K times in a row: step k's input state is step k-1's output (the target's
own state at step 1). Alignment is EAGLE's (losses/eagle.py): at step k (1-based) position t reads
token x_{t+k} and imitates the target's next-token distribution at t + k, predicting x_{t+k+1};
it counts where ``loss_mask[t + k + 1]``. The step losses are mixed with FastMTP's normalised
exponential decay (its eq. 2, speculators' ``compute_step_weights``), so the first draft, on which
every later one depends, weighs most.
"""

from __future__ import annotations


def step_weights(decay: float, steps: int) -> list[float]:
    """FastMTP eq. 2: step k of K weighs ``decay**(k-1) / sum_j decay**(j-1)`` (decay in (0, 1])."""
    raw = [decay**k for k in range(steps)]
    total = sum(raw)
    return [w / total for w in raw]
