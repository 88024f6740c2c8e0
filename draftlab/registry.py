"""Name-level entry points over the algorithm registry (``models/drafter.py``)."""

from __future__ import annotations


def load_proposer(checkpoint_dir, target, min_confidence: float = 0.0):
    """A checkpoint directory -> the proposer the speculative decoder drives."""
    from draftlab.train.checkpoint import load_drafter

    drafter, _ = load_drafter(checkpoint_dir, target)
    return drafter.proposer(min_confidence)
