"""Callbacks the trainer runs, on every rank, for code outside the loop to act at known points.

``after_step`` callables get ``(trainer)`` once an optimizer step is done (``trainer.step`` counts
it; before its log record and checkpoint). ``after_checkpoint`` callables get ``(trainer,
checkpoint_dir)`` once a checkpoint is published (before its evaluation and pruning). The tests
inject faults through them: ``tests/kill_after_checkpoint.py`` SIGKILLs the process after a chosen
step's checkpoint, ``tests/fault_at_step.py`` signals a chosen rank or makes its loss NaN.
"""

from __future__ import annotations

after_step: list = []
after_checkpoint: list = []
