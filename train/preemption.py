"""Preemption: a scheduler's signal asks a training run to stop (SLURM, Kubernetes and spot
instances send SIGTERM, or an advance warning such as SIGUSR1, then kill).

The handler only notes the signal. The trainer finishes the step it is in, agrees with the other
ranks at that step's check (a signal to any rank stops every rank there), writes a checkpoint
(no evaluation: the grace period is short) and exits with :data:`EXIT_PREEMPTED` after one line.
A relaunch of the same command resumes and ends bitwise where an uninterrupted run ends."""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator

EXIT_PREEMPTED = 75  # EX_TEMPFAIL (sysexits.h): a temporary failure, to be retried; a requeue rule can match it


class Preemption:
    def __init__(self):
        self.signal: str | None = None  # the first signal received, by name

    def _note(self, signum, frame) -> None:
        if self.signal is None:
            self.signal = signal.Signals(signum).name

    @contextlib.contextmanager
    def installed(self, names: list[str]) -> Iterator["Preemption"]:
        """Note the signals ``names`` (e.g. ``["SIGTERM", "SIGUSR1"]``) for the duration of the block;
        the handlers that were there before come back after it."""
        previous = {}
        if threading.current_thread() is not threading.main_thread():
            names = []  # Python runs signal handlers in the main thread only, and installs them from there only
        try:
            for name in names:
                sig = signal.Signals[name]
                previous[sig] = signal.signal(sig, self._note)
            yield self
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
