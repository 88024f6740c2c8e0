"""A failure on one rank of a multi-process run, made every rank's failure.

Much of a run happens on some ranks only: the main process writes checkpoints, metrics and
reports, each rank its own RNG file, and each rank reads its own resume state. A rank that fails
there and leaves would strand the others in their next collective (a barrier, the next
step's gradient all-reduce) until the process group's timeout. So that work runs inside
:meth:`RankFailures.caught`, which keeps the error, and every rank then meets in
:meth:`RankFailures.raise_if_any`: when any rank failed, all raise, the failed one its own error
and the others a one-line DraftlabError quoting it, and every process exits with one line.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from draftlab.errors import DraftlabError


def one_line(e: BaseException) -> str:
    """The error as the CLI prints it: a DraftlabError's message, else its type and first line."""
    text = " ".join(str(e).split("\n")).strip()
    return text if isinstance(e, DraftlabError) else f"{type(e).__name__}: {text}" if text else type(e).__name__


class RankFailures:
    def __init__(self, accelerator):
        self.accelerator = accelerator
        self.error: Exception | None = None

    @contextlib.contextmanager
    def caught(self) -> Iterator[None]:
        """Run the block; an error it raises is kept (the first one) for :meth:`raise_if_any`, not raised."""
        try:
            yield
        except Exception as e:  # noqa: BLE001 - re-raised by raise_if_any, on this rank and quoted on the others
            if self.error is None:
                self.error = e

    def raise_if_any(self) -> None:
        """Every rank calls this at the same point: raise when this rank or any other failed."""
        error, self.error = self.error, None
        if self.accelerator.num_processes > 1:
            from accelerate.utils import gather_object

            failed = [(rank, text) for rank, text in enumerate(gather_object([None if error is None else one_line(error)]))
                      if text is not None]
        else:
            failed = []
        if error is not None:
            raise error
        if failed:
            rank, text = failed[0]
            raise DraftlabError(f"{text} (on process {rank}; every process stops)")
