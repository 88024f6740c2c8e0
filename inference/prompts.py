"""Evaluation prompt sets, tokenised with the target's chat template (generation prompt added).

* ``spec-bench``: the Spec-Bench questions (``draftlab.presets.spec_bench_path()``), first turn,
  categories kept. Any JSONL path with the same schema works too.
* ``humaneval``: HumanEval's code prompts (gz JSONL, ``"prompt"``), category ``humaneval``.
* ``sharegpt-heldout``: the held-out conversations of the data stage's split, first user turn.
  Asked for more prompts than the split holds, it goes on with conversations past
  ``data.num_conversations`` (never loaded, so never trained on), ranked as the split ranks.
* ``FILE.jsonl``: one record per line, either ``{"messages": [...]}`` (prompt = messages up to
  and including the first user turn) or Spec-Bench form ``{"turns": [...], "category": ...}``;
  an optional ``"category"`` is kept, else the file's stem is the category.

When fewer prompts are asked for than a set holds, they are taken round-robin over categories
so that every category is represented; asking for more than a set holds is an error, never a
smaller set.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from itertools import zip_longest
from pathlib import Path

from draftlab.data.sources import iter_jsonl
from draftlab.errors import DraftlabError

DATA_SETS = ("spec-bench", "sharegpt-heldout", "humaneval")


@dataclass
class EvalPrompt:
    category: str
    prompt_ids: list[int]
    id: str = ""


def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of ``messages`` up to the first assistant turn, with the generation prompt
    (the data stage's template rendering, so training and evaluation see the same text)."""
    from draftlab.data.chat import prompt_ids

    return [int(t) for t in prompt_ids(tokenizer, messages)]


def _first_user_turn(messages, where: str) -> list[dict]:
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages
    ):
        raise DraftlabError(f"{where}: 'messages' must be a list of {{'role', 'content'}} strings")
    for i, m in enumerate(messages):
        if m["role"] == "user":
            return [{"role": m["role"], "content": m["content"]} for m in messages[: i + 1]]
    raise DraftlabError(f"{where}: conversation has no user turn")


def valid_text(value: str, where: str) -> str:
    """``value`` if it is text that encodes as UTF-8, else a DraftlabError naming ``where``. Bytes
    Python could not decode as UTF-8 (an argument, or a stream read with surrogateescape) arrive
    as lone surrogates, as do JSON escapes of them; a tokenizer fails on those with a traceback."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        ch = ord(value[e.start])
        what = f"byte 0x{ch - 0xDC00:02x}" if 0xDC80 <= ch <= 0xDCFF else f"lone surrogate U+{ch:04X}"
        raise DraftlabError(f"{where}: not valid UTF-8 text ({what} at character {e.start + 1})") from None
    return value


def _read_jsonl(path: Path) -> list[dict]:
    """A prompt file's records, read by the data stage's JSONL reader: a JSON object a line, at
    least one."""
    records = []
    for n, rec in iter_jsonl(path):
        if not isinstance(rec, dict):
            raise DraftlabError(f"{path}:{n}: each line must be a JSON object")
        records.append(rec)
    if not records:
        raise DraftlabError(f"{path}: no prompts in file")
    return records


def _conversations_from_records(records: list[dict], path: Path) -> list[tuple[str, str, list[dict]]]:
    """(category, id, messages) per record of a messages- or Spec-Bench-form JSONL."""
    out = []
    for n, rec in enumerate(records, 1):
        where = f"{path}:{n}"
        category = str(rec.get("category", path.name.split(".")[0]))
        rid = str(rec.get("question_id", rec.get("id", n)))
        if "messages" in rec:
            messages = _first_user_turn(rec["messages"], where)
        elif "turns" in rec:
            turns = rec["turns"]
            if not isinstance(turns, list) or not turns or not isinstance(turns[0], str):
                raise DraftlabError(f"{where}: 'turns' must be a non-empty list of strings")
            messages = [{"role": "user", "content": turns[0]}]
        else:
            raise DraftlabError(f"{where}: record needs 'messages' or 'turns'")
        out.append((category, rid, messages))
    return out


def _round_robin(items: list, num: int | None, key) -> list:
    if num is None or num >= len(items):
        return items
    groups: dict[str, list] = {}
    for it in items:
        groups.setdefault(key(it), []).append(it)
    order = [it for row in zip_longest(*groups.values()) for it in row if it is not None]
    return order[:num]


def _heldout_conversations(data_spec, wanted: int | None = None, option: str = "num_prompts") -> list[tuple[str, str, list[dict]]]:
    """The data stage's held-out split (``wanted`` prompts at least, else a DraftlabError naming
    ``option``). Loads and splits exactly as ``build_samples`` does but skips tokenising the
    (large) training part, which evaluation never needs; only the prompt (up to the first
    assistant turn) is used, which regeneration leaves unchanged.

    When ``wanted`` exceeds the split and ``data.num_conversations`` stopped the load, the rest
    come from the conversations after the loaded ones: training never read them. They are
    ranked by the split's own keyed hash (not taken in file order, where a ShareGPT record is
    often the next chunk of the conversation before it), and a prompt that equals a loaded
    conversation's or an earlier one's is skipped."""
    from draftlab.data.dataset import DataSpec, split_heldout
    from draftlab.data.sources import conversation_digest, iter_conversations, load_conversations

    spec = data_spec if data_spec is not None else DataSpec()
    convs, report = load_conversations(spec.source, spec.path, spec.num_conversations, spec.hf_split, spec.hf_column)
    if spec.heldout >= len(convs):
        raise DraftlabError(f"data.heldout ({spec.heldout}) must be smaller than the number of usable conversations ({len(convs)})")
    _, held = split_heldout(convs, spec.heldout, spec.seed)
    if not held:
        raise DraftlabError("data 'sharegpt-heldout': the data split holds no held-out conversations (data.heldout = 0)")
    out = [("sharegpt", str(i), _first_user_turn(convs[i], f"held-out conversation {i}")) for i in held]
    if wanted is None or wanted <= len(out):
        return out
    unread = []
    if report.stopped_at_limit:
        seen = {json.dumps(_first_user_turn(c, "conversation"), sort_keys=True) for c in convs}
        ranked = []
        stream = iter_conversations(spec.source, spec.path, None, spec.hf_split, spec.hf_column)
        for i, conv in enumerate(stream):
            if i >= len(convs):  # the stream's first len(convs) conversations are the loaded ones
                ranked.append((conversation_digest(conv, f"split:{spec.seed}"), i, _first_user_turn(conv, f"conversation {i}")))
        for _, i, prompt in sorted(ranked):
            key = json.dumps(prompt, sort_keys=True)
            if key not in seen:
                seen.add(key)
                unread.append(("sharegpt", str(i), prompt))
    available = len(out) + len(unread)
    if wanted > available:
        where = (f"{len(out)} held out by data.heldout, {len(unread)} distinct ones past data.num_conversations={spec.num_conversations}"
                 if report.stopped_at_limit else
                 f"data.heldout={spec.heldout}; every other conversation of the source is training data")
        raise DraftlabError(f"{option} {wanted}: sharegpt-heldout has only {available} prompts ({where})")
    more = wanted - len(out)
    print(f"sharegpt-heldout: the split's {len(out)} held-out prompts and {more} more from conversations past "
          f"data.num_conversations ({spec.num_conversations}), which training never reads", file=sys.stderr)
    return out + unread[:more]


def load_prompts(data: str, tokenizer, num_prompts: int | None = None, data_spec=None, option: str = "num_prompts") -> list[EvalPrompt]:
    """Prompts of a named set (``DATA_SETS``) or a JSONL file; ``data_spec`` is the DataSpec whose
    held-out split ``sharegpt-heldout`` uses (default: the data stage's defaults). ``num_prompts``
    more than the set holds is a DraftlabError naming ``option`` (the caller's name for it)."""
    return tokenize_prompts(prompt_conversations(data, num_prompts, data_spec, option), tokenizer)


def tokenize_prompts(convs: list[tuple[str, str, list[dict]]], tokenizer) -> list[EvalPrompt]:
    """:class:`EvalPrompt` per ``(category, id, messages)`` of :func:`prompt_conversations`."""
    return [EvalPrompt(cat, chat_prompt_ids(tokenizer, msgs), rid) for cat, rid, msgs in convs]


def prompt_conversations(data: str, num_prompts: int | None = None, data_spec=None, option: str = "num_prompts") -> list[tuple[str, str, list[dict]]]:
    """:func:`load_prompts` before tokenising (no tokenizer needed, so a bad set or count fails
    before any model loads): ``(category, id, messages)`` per prompt."""
    if num_prompts is not None and num_prompts < 1:
        raise DraftlabError(f"{option} must be >= 1, got {num_prompts}")
    if data == "spec-bench":
        from draftlab.presets import spec_bench_path

        path = spec_bench_path()
        convs = _conversations_from_records(_read_jsonl(path), path)
    elif data == "humaneval":
        from draftlab.presets import humaneval_path

        path = humaneval_path()
        convs = []
        for n, rec in enumerate(_read_jsonl(path), 1):
            if not isinstance(rec.get("prompt"), str):
                raise DraftlabError(f"{path}:{n}: record needs a string 'prompt'")
            convs.append(("humaneval", str(rec.get("task_id", n)), [{"role": "user", "content": rec["prompt"]}]))
    elif data == "sharegpt-heldout":
        convs = _heldout_conversations(data_spec, num_prompts, option)
    else:
        path = Path(data)
        if not path.name.endswith((".jsonl", ".jsonl.gz")):
            raise DraftlabError(f"data must be one of {', '.join(DATA_SETS)} or a .jsonl file, got '{data}'")
        convs = _conversations_from_records(_read_jsonl(path), path)
    if num_prompts is not None and num_prompts > len(convs):
        raise DraftlabError(f"{option} {num_prompts}: {data} holds only {len(convs)} prompts")
    convs = _round_robin(convs, num_prompts, key=lambda c: c[0])
    for _, rid, messages in convs:  # before any model loads: a tokenizer fails on lone surrogates with a traceback
        for m in messages:
            if isinstance(m.get("content"), str):
                valid_text(m["content"], f"{data}: prompt {rid}")
    return convs
