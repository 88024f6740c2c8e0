"""A rank that dies without raising (SIGKILL: the OOM killer, a lost node), made every rank's stop.

Errors raised inside draftlab reach every rank through ``rank_failures``; a rank killed outright
says nothing, and the others would wait in their next collective until the process group's
timeout (gloo, and NCCL, wait minutes). So every rank of a multi-process run keeps a heartbeat
file, ``output_dir/.ranks/rank-N.json`` (its pid, host and start time, touched every second), and
a watch thread looks at the others' files: a rank on this host whose process is gone, or one on
another host whose file has not been touched for ``STALE_S``, is dead. The thread then prints one
line naming it and ends this process (the main thread may be blocked inside a collective, where
nothing else can reach it). A rank that ends normally or with an error removes its file first,
so only a death without a word is taken for one. The checkpoints are whole (renamed into place),
so a relaunch resumes from the last."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from draftlab import atomic
from draftlab.train import process_identity

POLL_S = 1.0
STALE_S = 30.0  # a heartbeat on another host that stops this long: a lost node (well inside 60 s)
EXIT_DEAD_RANK = 2


class DeadRankWatch:
    def __init__(self, run_dir, rank: int, world: int, prefix: str, before_exit: Callable[[], None] | None = None):
        """``prefix``: how this program starts its error lines (``draftlab train``);
        ``before_exit``: run on this process before it leaves for a dead rank (e.g. drop the run lock)."""
        self.dir = Path(run_dir) / ".ranks"
        self.rank, self.world, self.prefix, self.before_exit = rank, world, prefix, before_exit
        self.own = self.dir / f"rank-{rank}.json"
        self._stop = threading.Event()
        self._found = threading.Event()  # set once a dead rank is reported (and the process about to end)
        self._reporting = threading.Lock()
        self._seen: dict[int, tuple[int, float]] = {}  # rank -> (file mtime, monotonic time it last changed)
        self._thread: threading.Thread | None = None

    def announce(self) -> None:
        """Write this rank's heartbeat file. Every rank announces, then meets the others in a barrier,
        then :meth:`start`\\ s: no rank reads a file left by an earlier run's process."""
        atomic.write_json(self.own, process_identity.me())

    def start(self) -> None:
        self._thread = threading.Thread(target=self._watch, name="draftlab-dead-ranks", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """This rank is leaving on its own (done, or with an error every rank shares): stop watching
        and remove the heartbeat, so the others do not take the exit for a death."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with contextlib.suppress(OSError):
            self.own.unlink()

    # ------------------------------------------------------------------ watching
    def dead(self) -> str | None:
        """The first other rank that has died, described; None while all run (or left normally)."""
        now = time.monotonic()
        for r in range(self.world):
            if r == self.rank:
                continue
            f = self.dir / f"rank-{r}.json"
            try:
                # opened, then its attributes read from the open file: NFS revalidates cached attributes on open
                with open(f, "rb") as fh:
                    mtime = os.fstat(fh.fileno()).st_mtime_ns
                    who = json.loads(fh.read())
                if not isinstance(who, dict):
                    continue
            except (OSError, ValueError):
                continue  # gone: that rank left normally
            alive = process_identity.running(who)
            if alive is None:  # another host: judged by its heartbeat, by this host's clock alone
                last = self._seen.get(r)
                if last is None or last[0] != mtime:
                    self._seen[r] = (mtime, now)
                    continue
                alive = now - last[1] < STALE_S
            # a rank that leaves normally removes its file before it ends: dead with the file still there is killed
            if not alive and f.exists():
                return f"process {r} ({process_identity.describe(who)}) died without an error (killed?)"
        return None

    def explains(self, timeout: float = 3 * POLL_S) -> bool:
        """Called by the main thread with an error in hand (a collective that failed): when a rank
        has died, report it and end the process (here, or the watch thread within ``timeout``).
        False: the error is a problem of its own."""
        if self._thread is None:
            return False
        # torchrun SIGTERMs the survivors of a death at once: this process is about to say why and leave
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        dead = self.dead()
        if dead:
            self._report(dead)
        return self._found.wait(timeout)

    def _report(self, dead: str) -> None:
        """Say which rank died, in one line (whichever thread comes first), and end this process."""
        with self._reporting:
            if self._found.is_set():
                return
            self._found.set()
        print(f"{self.prefix}: error: {self.message(dead)}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        if self.before_exit is not None:
            with contextlib.suppress(Exception):
                self.before_exit()
        os._exit(EXIT_DEAD_RANK)

    def message(self, dead: str) -> str:
        return f"{dead}: every process stops; relaunch the same command to resume from the last checkpoint"

    def _watch(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                os.utime(self.own)
                dead = self.dead()
            except Exception:  # noqa: BLE001 - a watch that fails must not stop the run it watches
                continue
            if dead and not self._stop.is_set():
                self._report(dead)

