"""Chat data sources: ShareGPT JSON, JSONL messages, HF datasets -> clean conversations.

A conversation is a list of ``{"role": "system"|"user"|"assistant", "content": str}`` with an
optional leading system message, then strictly alternating user/assistant turns starting with
a user turn and ending with an assistant turn. Every loader yields only such conversations and
fills a :class:`LoadReport` counting what it skipped (per reason) and what it normalised.

Sources (``load_conversations(source, ...)``):

* ``"sharegpt"`` or a ``.json`` path: a JSON list of ``{"id", "conversations": [{"from",
  "value"}]}`` (records with ``"messages"`` are accepted too). Streamed with
  ``JSONDecoder.raw_decode`` over buffered reads, so the first N conversations cost only the
  bytes they span and a file cut mid-record (the packaged ShareGPT file is) keeps every
  complete record and reports the cut.
* a ``.jsonl`` path: one ``{"messages": [{"role", "content"}, ...]}`` per line (or a ShareGPT
  ``"conversations"`` record). A line that is not JSON is an error naming file and line.
* ``"hf:<name or dir>"``: a HF dataset (``save_to_disk`` directory, data directory or hub
  name); ``column`` holds messages or ShareGPT turns (auto-detected when not given).
"""

from __future__ import annotations

import codecs
import gzip
import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

from draftlab.errors import DraftlabError

Message = dict[str, str]
Conversation = list[Message]

# ShareGPT speaker names seen in the wild -> chat roles. Anything else is a bad row.
ROLE_MAP = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "system": "system",
}
# Conversations longer than this (all contents, in characters) are skipped as over-long:
# about 20k tokens, far beyond any training max_length, and the packaged ShareGPT file's
# 99.9th percentile is 26k characters. Tokenising a 400k-character outlier would only be
# truncated away.
MAX_CONVERSATION_CHARS = 100_000

CHUNK_BYTES = 1 << 20  # streaming read size


@dataclass
class LoadReport:
    """What a loader read, kept, skipped (``bad``: reason -> count) and normalised (``fixed``)."""

    source: str
    path: str
    read: int = 0  # records examined
    kept: int = 0
    bad: Counter = field(default_factory=Counter)
    fixed: Counter = field(default_factory=Counter)  # normalisations applied to kept records
    stopped_at_limit: bool = False  # the limit was reached before the end of the data
    truncated_after: int | None = None  # the file ends mid-record after this many records
    truncated_tail_chars: int = 0  # length of that incomplete last record

    def summary(self) -> str:
        parts = f"{self.source}: kept {self.kept} of {self.read} conversations"
        details = ", ".join(f"{k} {v}" for k, v in sorted(self.bad.items()))
        fixes = ", ".join(f"{k} {v}" for k, v in sorted(self.fixed.items()))
        inner = "; ".join(x for x in (details, fixes) if x)
        if inner:
            parts += f" ({inner})"
        if self.truncated_after is not None:
            parts += (
                f"; file truncated after record {self.truncated_after}"
                f" (incomplete record of {self.truncated_tail_chars} chars dropped)"
            )
        if self.stopped_at_limit:
            parts += "; stopped at the requested limit"
        return parts

    def to_dict(self) -> dict:
        return {
            "source": self.source,
            "path": self.path,
            "read": self.read,
            "kept": self.kept,
            "bad": dict(self.bad),
            "fixed": dict(self.fixed),
            "stopped_at_limit": self.stopped_at_limit,
            "truncated_after": self.truncated_after,
            "summary": self.summary(),
        }


# ---------------------------------------------------------------------------- normalisation
def normalize_conversation(turns: Any, max_chars: int = MAX_CONVERSATION_CHARS) -> tuple[Conversation | None, str | None, list[str]]:
    """Check and normalise one record's turns (``{"role","content"}`` or ``{"from","value"}``).

    Returns ``(messages, None, fixes)`` for a usable conversation or ``(None, reason, [])``.

    Normalisations (counted, not bad):
    * leading assistant turns are dropped. In ShareGPT V3 (the "split" release) long
      conversations were cut into chunks, so ~36% of records start with the assistant's
      continuation of a chunk we do not have; its prompt is lost, but every later
      user/assistant pair is a genuine exchange, so dropping only the orphan keeps them.
    * a trailing user turn without an answer is dropped (no assistant tokens to learn).
    """
    if not isinstance(turns, list) or not turns:
        return None, "empty", []
    messages: Conversation = []
    for t in turns:
        if not isinstance(t, dict):
            return None, "malformed turn", []
        if "role" in t or "content" in t:
            role, content = t.get("role"), t.get("content")
        elif "from" in t or "value" in t:
            role, content = t.get("from"), t.get("value")
        else:
            return None, "malformed turn", []
        mapped = ROLE_MAP.get(role.strip().lower()) if isinstance(role, str) else None
        if mapped is None:
            return None, "unknown role", []
        if not isinstance(content, str):
            return None, "non-string content", []
        if not content.strip():
            return None, "empty message", []
        messages.append({"role": mapped, "content": content})

    fixes = []
    start = 1 if messages[0]["role"] == "system" else 0
    lead = start
    while lead < len(messages) and messages[lead]["role"] == "assistant":
        lead += 1
    if lead > start:
        messages = messages[:start] + messages[lead:]
        fixes.append("dropped leading assistant turn")
    body = messages[start:]
    for i, m in enumerate(body):
        if m["role"] != ("user" if i % 2 == 0 else "assistant"):
            return None, "bad role order", []
    if body and body[-1]["role"] == "user":
        messages = messages[:-1]
        body = body[:-1]
        fixes.append("dropped trailing user turn")
    if not body:
        return None, "no assistant turn", []
    if sum(len(m["content"]) for m in messages) > max_chars:
        return None, "over-long", []
    return messages, None, fixes


def _record_turns(record: Any, column: str | None) -> Any:
    """The turns list of one record, by explicit column or by the two known layouts."""
    if not isinstance(record, dict):
        return None
    if column is not None:
        return record.get(column)
    if "messages" in record:
        return record["messages"]
    return record.get("conversations")


def _accept(records: Iterable[Any], report: LoadReport, limit: int | None, column: str | None, max_chars: int) -> Iterator[Conversation]:
    """Normalise raw records into conversations, counting into ``report``; stop at ``limit``."""
    if limit is not None and limit <= 0:
        return
    for record in records:
        report.read += 1
        turns = _record_turns(record, column)
        if turns is None:
            report.bad["no conversation field" if isinstance(record, dict) else "not an object"] += 1
            continue
        messages, reason, fixes = normalize_conversation(turns, max_chars)
        if messages is None:
            report.bad[reason] += 1
            continue
        for f in fixes:
            report.fixed[f] += 1
        report.kept += 1
        yield messages
        if limit is not None and report.kept >= limit:
            report.stopped_at_limit = True
            return


# ---------------------------------------------------------------------------- JSON list streaming
def _eof_like(err: json.JSONDecodeError, buf_len: int) -> bool:
    """Did parsing fail because the text ran out (rather than because it is malformed)?
    An unterminated string reports where the string began; every other end-of-input error
    (missing value, delimiter, half an escape or literal) points within a few chars of the end."""
    return err.msg.startswith("Unterminated string") or err.pos >= buf_len - 8


def iter_json_list(path: Path, report: LoadReport) -> Iterator[Any]:
    """Yield the items of a top-level JSON list one at a time, reading ``CHUNK_BYTES`` at a time.

    A file that ends inside an item (or before the closing ``]``) is treated as truncated: the
    complete items are yielded and ``report.truncated_after`` is set. Malformed JSON before the
    end is a :class:`DraftlabError` naming the file and line."""
    decoder = json.JSONDecoder()
    udec = codecs.getincrementaldecoder("utf-8-sig")()
    try:
        f = open(path, "rb")
    except OSError as e:
        raise DraftlabError(f"cannot read data file {path}: {e.strerror}") from e
    with f:
        buf, pos, eof = "", 0, False
        line = 1  # line number of buf[0], for error messages
        count = 0

        def more() -> None:
            nonlocal buf, pos, eof, line
            data = f.read(CHUNK_BYTES)
            try:
                text = udec.decode(data, final=not data)
            except UnicodeDecodeError as e:
                raise DraftlabError(f"data file {path} is not UTF-8 text") from e
            eof = not data
            line += buf.count("\n", 0, pos)
            buf, pos = buf[pos:] + text, 0

        def skip_ws() -> bool:
            """Advance over whitespace, reading as needed; False at end of file."""
            nonlocal pos
            while True:
                n = len(buf)
                while pos < n and buf[pos] in " \t\r\n":
                    pos += 1
                if pos < n:
                    return True
                if eof:
                    return False
                more()

        def fail(what: str, at: int) -> DraftlabError:
            return DraftlabError(f"data file {path} is not a valid JSON list: {what} at line {line + buf.count(chr(10), 0, at)}")

        if not skip_ws():
            raise DraftlabError(f"data file {path} is empty")
        if buf[pos] != "[":
            raise DraftlabError(
                f"data file {path} is not a JSON list of conversations (for one JSON object per line use a .jsonl file)"
            )
        pos += 1
        while True:
            if not skip_ws():
                report.truncated_after, report.truncated_tail_chars = count, 0
                return
            if buf[pos] == "]":
                return
            if count:
                if buf[pos] != ",":
                    raise fail("expected ',' between records", pos)
                pos += 1
                if not skip_ws():
                    report.truncated_after, report.truncated_tail_chars = count, 0
                    return
            while True:
                try:
                    item, end = decoder.raw_decode(buf, pos)
                    break
                except json.JSONDecodeError as e:
                    if not _eof_like(e, len(buf)):
                        raise fail(e.msg, e.pos) from None
                    if eof:
                        report.truncated_after, report.truncated_tail_chars = count, len(buf) - pos
                        return
                    more()
            pos = end
            count += 1
            yield item


def iter_jsonl(path: Path) -> Iterator[tuple[int, Any]]:
    """``(line number, parsed JSON value)`` per non-blank line of a JSONL file, gzip-compressed
    when its name ends in ``.gz``, streamed (a leading byte-order mark is skipped). The one JSONL
    reader: a line that is not UTF-8 (its byte named) or not JSON is an error naming file and line."""
    opener = gzip.open if path.name.endswith(".gz") else open
    try:
        f = opener(path, "rb")
    except FileNotFoundError:
        raise DraftlabError(f"data file not found: {path}") from None
    except OSError as e:
        raise DraftlabError(f"cannot read data file {path}: {e.strerror}") from e
    with f:
        try:
            for lineno, raw in enumerate(f, 1):
                try:
                    text = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
                except UnicodeDecodeError as e:
                    byte = f"byte 0x{raw[e.start]:02x} at byte {e.start + 1}"
                    raise DraftlabError(f"{path}:{lineno}: not valid UTF-8 ({byte})") from None
                if not text.strip():
                    continue
                try:
                    yield lineno, json.loads(text)
                except json.JSONDecodeError as e:
                    raise DraftlabError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
        except (OSError, EOFError) as e:  # a corrupt or truncated gzip stream
            raise DraftlabError(f"cannot read data file {path}: {e}") from None


# ---------------------------------------------------------------------------- HF datasets
def iter_hf_records(name: str, split: str) -> Iterator[Any]:
    """Rows of a HF dataset: a ``save_to_disk`` directory, a data directory or a hub name."""
    try:
        import datasets
    except ImportError as e:  # pragma: no cover - datasets is a dependency
        raise DraftlabError("hf: data sources need the 'datasets' package") from e
    p = Path(name)
    try:
        if p.is_dir() and ((p / "dataset_info.json").is_file() or (p / "dataset_dict.json").is_file()):
            ds = datasets.load_from_disk(str(p))
            if isinstance(ds, datasets.DatasetDict):
                if split not in ds:
                    raise DraftlabError(f"HF dataset {name} has no split '{split}' (has: {', '.join(ds)}); set data.hf_split")
                ds = ds[split]
        else:
            ds = datasets.load_dataset(name, split=split)
    except DraftlabError:
        raise
    except Exception as e:  # datasets raises many types (FileNotFoundError, DatasetNotFoundError, ValueError ...)
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DraftlabError(f"cannot load HF dataset {name} (split {split}): {msg}") from e
    yield from ds


def _hf_column(first: Any, column: str | None, name: str) -> str:
    if column is not None:
        if isinstance(first, dict) and column not in first:
            raise DraftlabError(f"HF dataset {name} has no column '{column}' (has: {', '.join(first)}); set data.hf_column")
        return column
    for c in ("messages", "conversations"):
        if isinstance(first, dict) and c in first:
            return c
    cols = ", ".join(first) if isinstance(first, dict) else "?"
    raise DraftlabError(f"HF dataset {name}: set data.hf_column to the column holding the chat turns (has: {cols})")


# ---------------------------------------------------------------------------- entry point
def source_kind(source: str) -> str:
    if source == "sharegpt":
        return "sharegpt"
    if source.startswith("hf:"):
        return "hf"
    if source.endswith(".jsonl"):
        return "jsonl"
    if source.endswith(".json"):
        return "json"
    raise DraftlabError(f"data.source must be 'sharegpt', a .json/.jsonl file or 'hf:<name or dir>', got '{source}'")


def resolve_source(source: str, path: str | Path | None = None) -> tuple[str, str]:
    """``(kind, location)`` of a source: kind is sharegpt | json | jsonl | hf; ``path``
    overrides the location (for ``sharegpt``, the packaged file)."""
    kind = source_kind(source)
    if path is not None:
        return kind, str(path)
    if kind == "hf":
        if not source[3:]:
            raise DraftlabError("data.source 'hf:' needs a dataset name or directory after 'hf:'")
        return kind, source[3:]
    if kind == "sharegpt":
        from draftlab.presets import sharegpt_path

        return kind, str(sharegpt_path())
    return kind, source


def iter_conversations(
    source: str,
    path: str | Path | None = None,
    limit: int | None = None,
    hf_split: str = "train",
    hf_column: str | None = None,
    max_chars: int = MAX_CONVERSATION_CHARS,
    report: LoadReport | None = None,
) -> Iterator[Conversation]:
    """Yield clean conversations from ``source`` (see module doc), counting into ``report``."""
    kind, where = resolve_source(source, path)
    report = report if report is not None else LoadReport(kind, where)
    if kind == "hf":
        rows = iter_hf_records(where, hf_split)
        first = next(rows, None)
        if first is None:
            return
        column = _hf_column(first, hf_column, where)

        def chained():
            yield first
            yield from rows

        yield from _accept(chained(), report, limit, column, max_chars)
        return
    file = Path(where)
    if not file.is_file():
        raise DraftlabError(f"data file not found: {file}")
    records = (r for _, r in iter_jsonl(file)) if file.suffix == ".jsonl" else iter_json_list(file, report)
    yield from _accept(records, report, limit, None, max_chars)


def load_conversations(
    source: str,
    path: str | Path | None = None,
    limit: int | None = None,
    hf_split: str = "train",
    hf_column: str | None = None,
    max_chars: int = MAX_CONVERSATION_CHARS,
) -> tuple[list[Conversation], LoadReport]:
    """All clean conversations of ``source`` (at most ``limit``) and the load report."""
    report = LoadReport(*resolve_source(source, path))
    convs = list(iter_conversations(source, path, limit, hf_split, hf_column, max_chars, report))
    return convs, report


def conversation_digest(messages: Conversation, salt: str = "") -> str:
    """Stable hex digest of a conversation's content (for split assignment and record ids)."""
    blob = json.dumps(messages, ensure_ascii=False, sort_keys=True, separators=(",", ":"))
    return hashlib.blake2b((salt + "\x00" + blob).encode("utf-8"), digest_size=16).hexdigest()
