"""Test-only launcher: ``python tests/full_disk_launch.py PATTERN RANK SCRIPT [ARGS...]`` runs the
training script SCRIPT with ARGS as ``python SCRIPT ARGS...`` would, with draftlab.atomic's one
low-level write failing as a full disk does (ENOSPC) for every path matching the glob PATTERN, on
process RANK only (``all``: on every process). Under ``accelerate launch`` / torchrun it takes the
script's place in every process."""

import errno
import fnmatch
import os
import runpy
import sys

from draftlab import atomic


def main() -> None:
    pattern, rank, script = sys.argv[1], sys.argv[2], os.path.abspath(sys.argv[3])
    real = atomic._write_all

    def write(fd, data, path):
        if rank in ("all", os.environ.get("RANK", "0")) and fnmatch.fnmatch(str(path), pattern):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data, path)

    atomic._write_all = write
    sys.argv = sys.argv[3:]
    sys.path[0] = os.path.dirname(script)  # as when python runs SCRIPT itself
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
