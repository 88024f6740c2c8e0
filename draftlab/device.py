"""Host values onto the device without making the host wait."""

from __future__ import annotations

import torch


def device_ints(values: list[int], device: torch.device) -> torch.Tensor:
    """int64 ``values`` on ``device``. On CUDA through pinned memory, asynchronously: a copy from
    pageable memory first waits for every kernel queued before it, which would stall a decode step
    on its own forward."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=torch.long, device=device)
    return torch.tensor(values, dtype=torch.long, pin_memory=True).to(device, non_blocking=True)
