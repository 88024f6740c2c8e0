"""The one way draftlab writes files: into a temporary sibling, then renamed into place.

A kill at any moment leaves either the old file (directory) or the new one, never half of
one, and a leftover temporary is a dot-file that no reader looks at. A path that cannot be
written is a one-line :class:`DraftlabError` naming it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterator

from draftlab.errors import DraftlabError


def _parent(path: Path) -> Path:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DraftlabError(f"{path}: cannot create its directory ({e.strerror or e})") from None
    return path.parent


def write_file(path, write: Callable[[str], None], durable: bool = False) -> Path:
    """``write(tmp_path)`` fills a temporary sibling of ``path``, which then replaces ``path``.
    ``durable`` fsyncs it first (shards a resumed capture trusts by checksum)."""
    path = Path(path)
    try:
        fd, tmp = tempfile.mkstemp(dir=_parent(path), prefix=f".{path.name}.", suffix=".tmp")
    except OSError as e:
        raise DraftlabError(f"{path}: cannot write here ({e.strerror or e})") from None
    os.close(fd)
    try:
        write(tmp)
        if durable:
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise DraftlabError(f"{path}: cannot write ({e.strerror or e})") from None
        raise
    return path


def write_bytes(path, data: bytes, durable: bool = False) -> Path:
    return write_file(path, lambda tmp: Path(tmp).write_bytes(data), durable)


def write_text(path, text: str) -> Path:
    return write_file(path, lambda tmp: Path(tmp).write_text(text))


def write_json(path, obj, durable: bool = False) -> Path:
    return write_file(path, lambda tmp: Path(tmp).write_text(json.dumps(obj, indent=2) + "\n"), durable)


def staging_dir(final: Path) -> Path:
    """An empty temporary sibling of ``final`` to fill and then :func:`publish`."""
    final = Path(final)
    try:
        return Path(tempfile.mkdtemp(dir=_parent(final), prefix=f".tmp-{final.name}-"))
    except OSError as e:
        raise DraftlabError(f"{final}: cannot write here ({e.strerror or e})") from None


def publish(tmp: Path, final: Path) -> None:
    """Rename a finished staging directory into place (replacing an older one)."""
    final = Path(final)
    if final.exists():
        old = final.with_name(f".old-{final.name}")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)


@contextlib.contextmanager
def directory(final) -> Iterator[Path]:
    """``with directory(out) as tmp: ...`` fills ``tmp``; on success it becomes ``out``, on any
    error it is removed and ``out`` is untouched."""
    final = Path(final)
    tmp = staging_dir(final)
    try:
        yield tmp
        publish(tmp, final)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError):
            raise DraftlabError(f"{final}: cannot write ({e.strerror or e})") from None
        raise
