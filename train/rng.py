"""This process's random number generators (Python, NumPy, torch): seeding, and their state as JSON
for a checkpoint (per rank), so a resumed run draws what an uninterrupted one would."""

from __future__ import annotations

import random

import numpy as np
import torch

from draftlab.errors import DraftlabError


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


def set_state(state: dict, where="RNG state") -> None:
    """Restore what :func:`get_state` returned. Each generator's state is first tried on a fresh
    generator of its kind, so a damaged one (``where`` names its file) is a one-line DraftlabError
    and changes nothing."""
    torch_state, py, npy = _checked(state, where)
    torch.set_rng_state(torch_state)
    random.setstate(py)
    np.random.set_state(npy)


def _checked(state, where):
    if not isinstance(state, dict):
        raise DraftlabError(f"{where}: not an RNG state (expected a JSON object, got {type(state).__name__})")
    missing = [k for k in ("torch", "python", "numpy") if k not in state]
    if missing:
        raise DraftlabError(f"{where}: not an RNG state (no {', '.join(repr(k) for k in missing)})")
    field = "torch"
    try:
        t = state["torch"]
        if not isinstance(t, list) or not all(type(x) is int and 0 <= x < 256 for x in t):
            raise ValueError("expected a list of byte values")
        torch_state = torch.tensor(t, dtype=torch.uint8)
        torch.Generator().set_state(torch_state)  # checks the size
        field = "python"
        py = state["python"]
        if not isinstance(py, list) or len(py) != 3 or not isinstance(py[1], list):
            raise ValueError("expected [version, [625 integers], gauss_next]")
        if py[2] is not None and (isinstance(py[2], bool) or not isinstance(py[2], (int, float))):
            raise ValueError("gauss_next must be null or a number")
        py = (py[0], tuple(py[1]), py[2])
        random.Random().setstate(py)
        field = "numpy"
        npy = state["numpy"]
        if not isinstance(npy, list) or len(npy) != 5 or not isinstance(npy[1], list):
            raise ValueError("expected [name, [624 integers], pos, has_gauss, cached_gaussian]")
        if not all(type(x) is int and 0 <= x < 2**32 for x in npy[1]):
            raise ValueError("key values must be 32-bit unsigned integers")
        npy = (npy[0], np.array(npy[1], dtype=np.uint32), npy[2], npy[3], npy[4])
        np.random.RandomState().set_state(npy)
    except (TypeError, ValueError, RuntimeError, OverflowError, IndexError) as e:
        why = (str(e).strip() or type(e).__name__).splitlines()[0][:160]
        raise DraftlabError(f"{where}: '{field}' is not a valid RNG state ({why})") from None
    return torch_state, py, npy
