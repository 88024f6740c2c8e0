"""Who a process is (pid, host, start time) and whether it still runs: what the run lock and the
dead-rank watch record about a process and check about another."""

from __future__ import annotations

import os
import socket

import psutil  # an Accelerate dependency


def me() -> dict:
    """This process: ``{"pid", "host", "started"}`` (start time in seconds since the epoch)."""
    return {"pid": os.getpid(), "host": socket.gethostname(), "started": psutil.Process().create_time()}


def running(who: dict) -> bool | None:
    """Whether the process ``who`` (from :func:`me`) still runs: None when it ran on another host
    (no way to look from here). A zombie (dead, not yet reaped by its parent) and a process that
    has since reused the pid (another start time) count as gone."""
    if who.get("host") != socket.gethostname():
        return None
    try:
        p = psutil.Process(int(who["pid"]))
        # the start time is read from /proc in clock ticks: a second apart is another process
        return p.status() != psutil.STATUS_ZOMBIE and abs(p.create_time() - float(who["started"])) < 1.0
    except psutil.AccessDenied:  # another user's process: it runs
        return True
    except (psutil.NoSuchProcess, KeyError, TypeError, ValueError):
        return False


def describe(who: dict) -> str:
    return f"pid {who.get('pid')} on host {who.get('host')}"
