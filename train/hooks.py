"""Callbacks the trainer runs, on every rank, for code outside the loop to act at known points.

``after_checkpoint`` callables get ``(trainer, checkpoint_dir)`` once a checkpoint is published
(before its evaluation and pruning). The tests inject faults through it: ``tests/kill_after_checkpoint.py``
installs one that SIGKILLs the process after a chosen step's checkpoint, then runs a training script.
"""

from __future__ import annotations

after_checkpoint: list = []
