"""P-EAGLE's training sample: COD ("conditional drop") sampling of the parallel groups
(P-EAGLE, as speculators 0.9 ``models/peagle/data.py`` trains it; the drafter: models/peagle.py).

Alignment is EAGLE-3's (losses/eagle.py): the drafter's depth-0 input at position t is
(x_{t+1}, f_t) and depth d at anchor t imitates the target at index t + 1 + d, counting when
``loss_mask[t + 2 + d]``. Depth 0 runs over every position (it is also the context of the
others); depth d >= 1 runs only on a random subset of anchors, nested in depth d - 1's (a slot
attends to its own earlier slots, so those must exist) and counted at depth d, of about
``max(decay**d, floor)`` times the counted depth-0 positions. The loss is pooled over every
sampled slot, so deeper slots weigh what COD keeps of them.
"""

from __future__ import annotations

import torch


def cod_anchors(counted: torch.Tensor, decay: float, floor: float) -> list[torch.Tensor]:
    """Anchors of depths 1..D-1 for ``counted`` Bool[D, N] (row d: anchor a's depth-d prediction
    counts; anchors flattened over the batch). Returns one ascending Long[N_d] per depth, each a
    subset of the previous depth's, stopping at the first empty one. Draws from torch's global
    RNG, which the trainer checkpoints, so a resumed run samples what an uninterrupted one does."""
    n = int(counted[0].sum())
    out: list[torch.Tensor] = []
    kept = None
    for d in range(1, counted.shape[0]):
        size = int(max(0, n - d) * max(decay**d, floor))
        cand = counted[d] if kept is None else kept & counted[d]
        idx = cand.nonzero().flatten()
        if idx.numel() > size:
            idx = idx[torch.randperm(idx.numel(), device=idx.device)[:size]].sort().values
        if idx.numel() == 0:
            break
        out.append(idx)
        kept = torch.zeros_like(cand)
        kept[idx] = True
    return out
