"""The one way draftlab writes files: into a temporary sibling, then renamed into place.

A kill at any moment leaves either the old file (directory) or the new one, never half of
one, and a leftover temporary is a dot-file that no reader looks at. A write that fails (a full
disk, a directory that cannot be written, a read-only file system, a path below a regular file)
removes its temporary, and any folder it made, and is a one-line :class:`DraftlabError` naming
the path; the file it meant to replace is untouched. Logs are appended (:func:`append_bytes`):
a failed append is cut back off, so they hold whole records only.

Every byte goes through :func:`_write_all` (the tests make it fail as a full disk would).
Library writers that want a path of their own (``safetensors.save_file``, ``fig.savefig``)
should serialise to bytes first (``safetensors.torch.save``, ``io.BytesIO``) and call
:func:`write_bytes`; :func:`write_file` remains for the few that cannot.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterator, Mapping

from draftlab.errors import DraftlabError


def reason(e: BaseException) -> str:
    """``No space left on device``, ``Permission denied``...: one line."""
    text = (getattr(e, "strerror", None) or str(e) or type(e).__name__).strip()
    return text.splitlines()[0] if text else type(e).__name__


def error(path, e: BaseException, doing: str = "cannot write") -> DraftlabError:
    """The one-line error for an OSError ``e`` met while writing ``path``."""
    return DraftlabError(f"{path}: {doing} ({reason(e)})")


def _write_all(fd: int, data, path: Path) -> None:
    """The one low-level write: all of ``data`` to the open ``fd`` (the temporary of ``path``)."""
    view = memoryview(data).cast("B")
    while view:
        n = os.write(fd, view[: 1 << 30])
        view = view[n:]


def _in_the_way(d: Path) -> str:
    """Why directory ``d`` cannot be made when a file sits where it or a folder above it would be."""
    file = next((a for a in (d, *d.parents) if a.exists() and not a.is_dir()), None)
    return f"{file} is a file, not a directory" if file is not None else ""


def _parent(path: Path) -> Path:
    parent = path.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DraftlabError(f"{path}: cannot create its directory ({_in_the_way(parent) or reason(e)})") from None
    return parent


@contextlib.contextmanager
def _no_new_dirs_on_failure(*paths: Path) -> Iterator[None]:
    """A write that fails removes the directories above ``paths`` that it created (when still
    empty): it leaves nothing behind, not even the folders it made."""
    missing = set()
    for path in paths:
        d = Path(path).parent
        while d != d.parent and not d.exists():
            missing.add(d)
            d = d.parent
    try:
        yield
    except BaseException:
        for d in sorted(missing, key=lambda d: -len(d.parts)):  # deepest first; rmdir takes empty ones only
            with contextlib.suppress(OSError):
                d.rmdir()
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# tempfile makes files 0600 and folders 0700 (private while half-written); what it publishes gets the
# modes open() and mkdir() would give, so an export or a checkpoint stays readable by a serving user
_UMASK = _umask()


def _temp(path: Path) -> tuple[int, str]:
    try:
        fd, tmp = tempfile.mkstemp(dir=_parent(path), prefix=f".{path.name}.", suffix=".tmp")
    except OSError as e:
        raise error(path, e, "cannot write here") from None
    os.fchmod(fd, 0o666 & ~_UMASK)
    return fd, tmp


def _remove(tmp) -> None:
    with contextlib.suppress(OSError):
        os.unlink(tmp)


def _fill(fd: int, data, path: Path, durable: bool) -> None:
    """Write ``data`` to ``fd`` and close it (whatever happens)."""
    try:
        _write_all(fd, data, path)
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def _replacing(path: Path) -> Iterator[tuple[int, str]]:
    """A temporary sibling of ``path`` (open fd, name) to fill, which then replaces ``path``; on
    any error it is removed, with any folder made for it, and an OSError is one line."""
    with _no_new_dirs_on_failure(path):
        fd, tmp = _temp(path)
        try:
            yield fd, tmp
            os.replace(tmp, path)
        except BaseException as e:
            _remove(tmp)
            if isinstance(e, OSError):
                raise error(path, e) from None
            raise


def write_file(path, write: Callable[[str], None], durable: bool = False) -> Path:
    """``write(tmp_path)`` fills a temporary sibling of ``path``, which then replaces ``path``.
    ``durable`` fsyncs it first (shards a resumed capture trusts by checksum). Prefer
    :func:`write_bytes`: only it goes through the one low-level write."""
    path = Path(path)
    with _replacing(path) as (fd, tmp):
        os.close(fd)
        write(tmp)
        if durable:
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
    return path


def write_bytes(path, data, durable: bool = False) -> Path:
    """``data`` (bytes or any buffer) into ``path``, atomically."""
    path = Path(path)
    with _replacing(path) as (fd, tmp):
        _fill(fd, data, path, durable)
    return path


def copy_file(src, path, durable: bool = False) -> Path:
    """The bytes of the file ``src`` into ``path``, atomically (mapped, not read into memory)."""
    src = Path(src)
    try:
        with open(src, "rb") as f:
            if os.fstat(f.fileno()).st_size == 0:
                return write_bytes(path, b"", durable)
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
                return write_bytes(path, data, durable)
    except OSError as e:
        raise error(src, e, "cannot read") from None


def write_text(path, text: str, durable: bool = False) -> Path:
    return write_bytes(path, text.encode("utf-8"), durable)


def json_text(obj) -> str:
    return json.dumps(obj, indent=2) + "\n"


def write_json(path, obj, durable: bool = False) -> Path:
    return write_text(path, json_text(obj), durable)  # serialised before any file is touched


def write_files(files: Mapping[Path, bytes], durable: bool = False) -> list[Path]:
    """Several files as one: every temporary is written first, then all are renamed into place.
    A failed write leaves none of them changed (and no temporary behind)."""
    staged: list[tuple[Path, str]] = []
    with _no_new_dirs_on_failure(*files):
        try:
            for path, data in files.items():
                path = Path(path)
                fd, tmp = _temp(path)
                staged.append((path, tmp))
                try:
                    _fill(fd, data, path, durable)
                except OSError as e:
                    raise error(path, e) from None
            for i, (path, tmp) in enumerate(staged):
                try:
                    os.replace(tmp, path)
                except OSError as e:
                    raise error(path, e) from None
                staged[i] = (path, "")
        except BaseException:
            for _, tmp in staged:
                if tmp:
                    _remove(tmp)
            raise
    return [Path(p) for p in files]


def create_new(path, data) -> bool:
    """Create ``path`` holding ``data`` unless it exists: False (and nothing written) when it does.
    The file appears whole (a temporary hard-linked into place; a link never replaces a file, on
    NFS too), so a reader never sees it half-written: what lock files are made with."""
    path = Path(path)
    fd, tmp = _temp(path)
    try:
        _fill(fd, data, path, durable=False)
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    except OSError as e:
        raise error(path, e) from None
    finally:
        _remove(tmp)


def append_text(path, text: str, durable: bool = False) -> Path:
    """Append ``text`` to ``path`` (a log: JSONL records). A failed append is cut back off, so
    the file holds whole records only."""
    return append_bytes(path, text.encode("utf-8"), durable)


def append_bytes(path, data, durable: bool = False) -> Path:
    """Append ``data`` (whole records of a log) to ``path``. A failed append is cut back off, and
    a file (or directory) this call created is removed again: nothing is left of a failed record."""
    path = Path(path)
    existed = path.exists()
    with _no_new_dirs_on_failure(path):
        try:
            _parent(path)
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        except OSError as e:
            raise error(path, e) from None
        try:
            size = os.fstat(fd).st_size
            try:
                _write_all(fd, data, path)
                if durable:
                    os.fsync(fd)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, size)
                if not existed:  # it would hold nothing but the failed record
                    _remove(path)
                raise
        except OSError as e:
            raise error(path, e) from None
        finally:
            os.close(fd)
    return path


def writable_dir(path, label: str = "") -> Path:
    """Create directory ``path`` if needed and prove that files can be made in it (a temporary is
    created and removed), before any work whose results would go there."""
    path = Path(path)
    where = f"{label} {path}" if label else str(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DraftlabError(f"{where}: cannot create this directory ({_in_the_way(path) or reason(e)})") from None
    try:
        fd, tmp = tempfile.mkstemp(dir=path, prefix=".probe-", suffix=".tmp")
    except OSError as e:
        raise DraftlabError(f"{where}: cannot write here ({reason(e)})") from None
    os.close(fd)
    _remove(tmp)
    return path


def make_dir(path) -> Path:
    """``mkdir -p`` with a one-line error."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DraftlabError(f"{path}: cannot create this directory ({_in_the_way(path) or reason(e)})") from None
    return path


def staging_dir(final: Path) -> Path:
    """An empty temporary sibling of ``final`` to fill and then :func:`publish`."""
    final = Path(final)
    try:
        tmp = Path(tempfile.mkdtemp(dir=_parent(final), prefix=f".tmp-{final.name}-"))
    except OSError as e:
        raise error(final, e, "cannot write here") from None
    tmp.chmod(0o777 & ~_UMASK)
    return tmp


def publish(tmp: Path, final: Path) -> None:
    """Rename a finished staging directory into place (replacing an older one, which comes back
    if the rename fails)."""
    final = Path(final)
    if final.exists() and not final.is_dir():
        raise DraftlabError(f"{final}: a file, not a directory (left as it is)")
    try:
        if final.exists():
            old = final.with_name(f".old-{final.name}")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            try:
                os.replace(tmp, final)
            except OSError:
                os.replace(old, final)
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
    except OSError as e:
        raise error(final, e) from None


def restore_replaced(old: Path) -> None:
    """A ``.old-NAME`` left by :func:`publish` (killed between its two renames): put back as NAME
    when NAME is missing, else removed (NAME is its finished replacement)."""
    old = Path(old)
    final = old.with_name(old.name.removeprefix(".old-"))
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
    else:
        try:
            os.replace(old, final)
        except OSError as e:
            raise error(final, e) from None


@contextlib.contextmanager
def directory(final) -> Iterator[Path]:
    """``with directory(out) as tmp: ...`` fills ``tmp``; on success it becomes ``out``, on any
    error it is removed (and any folder made for it) and ``out`` is untouched."""
    final = Path(final)
    with _no_new_dirs_on_failure(final):
        tmp = staging_dir(final)
        try:
            yield tmp
            publish(tmp, final)
        except BaseException as e:
            shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(e, OSError):
                raise error(final, e) from None
            if isinstance(e, DraftlabError):
                raise naming(e, tmp, final) from None
            raise


def naming(e: DraftlabError, tmp: Path, final: Path) -> DraftlabError:
    """``e`` naming ``final`` where it names the staging directory ``tmp``: the user asked for the one
    and never sees the other."""
    return DraftlabError(str(e).replace(str(tmp), str(final)))
