"""This process's random number generators (Python, NumPy, torch): seeding, and their state as JSON
for a checkpoint (per rank), so a resumed run draws what an uninterrupted one would."""

from __future__ import annotations

import random

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def get_state() -> dict:
    py, npy = random.getstate(), np.random.get_state()
    return {
        "torch": torch.get_rng_state().tolist(),
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [npy[0], npy[1].tolist(), npy[2], npy[3], npy[4]],
    }


def set_state(state: dict) -> None:
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    py, npy = state["python"], state["numpy"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    np.random.set_state((npy[0], np.array(npy[1], dtype=np.uint32), npy[2], npy[3], npy[4]))
