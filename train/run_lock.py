"""One run per ``output_dir``: a lock file, ``output_dir/draftlab.lock``, held by the run's main
process from start to exit.

A second launch into a live run's folder is refused at once (one line naming the folder and the
holder); both would otherwise write the same checkpoints and logs. A lock left by a run that was
killed is stale and taken over: its holder (pid, host, start time) no longer runs on this host.
A lock from another host cannot be checked from here, so the error says how to remove it."""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import Iterator

from draftlab import atomic
from draftlab.errors import DraftlabError
from draftlab.train import process_identity

LOCK = "draftlab.lock"


def _holder(path: Path) -> dict | None:
    """The lock's holder, {} for a lock that is not one of ours (unreadable), None when there is none."""
    try:
        obj = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}
    return obj if isinstance(obj, dict) else {}


def acquire(run_dir) -> Path:
    """Take ``run_dir``'s lock for this process (a stale one is replaced), or a one-line
    DraftlabError naming the folder and the live run that holds it."""
    path = Path(run_dir) / LOCK
    me = process_identity.me()
    data = atomic.json_text({**me, "since": time.strftime("%Y-%m-%d %H:%M:%S %Z")}).encode()
    for _ in range(3):  # another launch may take or drop the lock between our looks
        if atomic.create_new(path, data):
            return path
        holder = _holder(path)
        if holder is None:
            continue
        alive = process_identity.running(holder)
        if alive is False:  # the run that left it was killed: take its place
            # (two launches finding the same stale lock at the same instant could both get here; rare enough)
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            continue
        who = process_identity.describe(holder) if holder else "a lock this version cannot read"
        since = f", since {holder['since']}" if holder.get("since") else ""
        if alive is None:
            raise DraftlabError(f"output_dir {run_dir} is in use by another run ({who}{since}); if that run has ended, "
                                f"delete {path} and relaunch")
        raise DraftlabError(f"output_dir {run_dir} is in use by another run ({who}{since}): wait for it to end or use another output_dir")
    raise DraftlabError(f"{path}: cannot take the run lock (it keeps changing hands)")


def release(path: Path) -> None:
    """Remove the lock when this process still holds it."""
    holder = _holder(path)
    if holder and holder.get("pid") == process_identity.me()["pid"] and process_identity.running(holder):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


@contextlib.contextmanager
def held(run_dir, take: bool = True) -> Iterator[Path | None]:
    """``run_dir``'s lock for the duration of the block (``take`` false: on processes that are not the main one)."""
    path = acquire(run_dir) if take else None
    try:
        yield path
    finally:
        if path is not None:
            release(path)
