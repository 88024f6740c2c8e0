"""Training metrics: ``metrics.jsonl`` always (main process), TensorBoard and wandb when the recipe's
``logging`` section asks.

Every file written here goes through :mod:`draftlab.atomic`: JSONL records and TensorBoard event
records are appended whole (a record that fails is cut back off), so a full disk or an unwritable
log directory is a one-line DraftlabError naming the file. TensorBoard's ``SummaryWriter`` is not
used: it writes from a background thread, where a full disk is a traceback on that thread and a
half record in the file. wandb writes from its own service process; its directory is proven
writable first (wandb would otherwise fall back to the system's temporary directory without a
word) and any error it raises is one line.
"""

from __future__ import annotations

import io
import itertools
import json
import os
import socket
import time
from pathlib import Path

from draftlab import atomic
from draftlab.errors import DraftlabError

_event_files = itertools.count()  # two event files of one process in one second get distinct names


class TensorBoardEvents:
    """One TensorBoard event file (TFRecord-framed ``Event`` protos) in ``logdir``, read by
    ``tensorboard --logdir``; each record is appended through :func:`draftlab.atomic.append_bytes`."""

    def __init__(self, logdir: Path):
        try:
            from tensorboard.compat.proto import event_pb2, summary_pb2
            from tensorboard.summary.writer.record_writer import RecordWriter
        except ImportError:
            raise DraftlabError("logging.tensorboard needs the tensorboard package (pip install tensorboard)") from None
        self._event, self._summary, self._framer = event_pb2.Event, summary_pb2.Summary, RecordWriter
        name = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}.{next(_event_files)}"
        self.path = Path(logdir) / name
        self._append(self._event(wall_time=time.time(), file_version="brain.Event:2"))

    def scalars(self, values: dict[str, float], step: int) -> None:
        value = [self._summary.Value(tag=k, simple_value=float(v)) for k, v in values.items()]
        self._append(self._event(wall_time=time.time(), step=step, summary=self._summary(value=value)))

    def _append(self, event) -> None:
        buf = io.BytesIO()
        self._framer(buf).write(event.SerializeToString())
        atomic.append_bytes(self.path, buf.getvalue())


class MetricLogger:
    """JSONL always (main process); TensorBoard and wandb (offline by default) when chosen."""

    def __init__(self, run_dir: Path, recipe, enabled: bool):
        self.enabled = enabled
        self.tb = self.wandb = None
        if not enabled:
            return
        self.path = Path(run_dir) / "metrics.jsonl"
        spec = recipe.logging
        if spec.tensorboard:
            self.tb = TensorBoardEvents(Path(run_dir) / "tensorboard")
        if spec.wandb:
            try:
                import wandb
            except ImportError:
                raise DraftlabError("logging.wandb needs the wandb package (pip install wandb)") from None
            atomic.writable_dir(Path(run_dir) / "wandb", "logging.wandb directory")
            self.wandb = _wandb("init", lambda: wandb.init(
                project=spec.wandb_project, mode=spec.wandb_mode, dir=str(run_dir), config=recipe.model_dump(mode="json")))

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        atomic.append_text(self.path, json.dumps(record) + "\n")
        flat = {}
        for k, v in record.items():
            if isinstance(v, list):
                flat.update({f"{k}/{i}": x for i, x in enumerate(v) if isinstance(x, (int, float))})
            elif isinstance(v, (int, float)) and k != "step":
                flat[k] = v
        if self.tb:
            self.tb.scalars(flat, record["step"])
        if self.wandb:
            _wandb("log", lambda: self.wandb.log(flat, step=record["step"]))

    def close(self) -> None:
        if self.wandb:
            _wandb("finish", self.wandb.finish)


def _wandb(what: str, call):
    """wandb is an outside logger: whatever it raises is one line naming it."""
    try:
        return call()
    except Exception as e:  # noqa: BLE001 - wandb's errors have no common base class
        raise DraftlabError(f"logging.wandb: wandb.{what} failed ({atomic.reason(e)})") from None
