"""How a draftlab command's process ends: :func:`exit_process`, for the console script and the
training entry points alike."""

from __future__ import annotations

import logging
import os
import sys


def exit_process(rc: int) -> None:
    """End the process with ``rc``.

    A process of a multi-process run (torchrun / ``accelerate launch`` set ``WORLD_SIZE``; DeepSpeed)
    leaves with ``os._exit`` once its output is flushed, skipping interpreter finalisation and C++
    static destructors: that teardown races gloo's C++ worker threads and can abort a rank (SIGABRT,
    "terminate called without an active exception", PyTorch issue #190489) after the run is done,
    which makes the launcher fail the job. Nothing is lost: every checkpoint is renamed into place
    and the metric logger closed by then."""
    from accelerate.utils import parse_flag_from_env

    sys.stdout.flush()
    sys.stderr.flush()
    if os.environ.get("WORLD_SIZE", "1") != "1" or parse_flag_from_env("ACCELERATE_USE_DEEPSPEED"):
        logging.shutdown()
        os._exit(rc)
    sys.exit(rc)
