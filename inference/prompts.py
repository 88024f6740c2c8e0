"""Evaluation prompt sets, tokenised with the target's chat template (generation prompt added).

* ``spec-bench``: the Spec-Bench questions (``draftlab.presets.spec_bench_path()``), first turn,
  categories kept. Any JSONL path with the same schema works too.
* ``humaneval``: HumanEval's code prompts (gz JSONL, ``"prompt"``), category ``humaneval``.
* ``sharegpt-heldout``: the held-out conversations of the data stage's split, first user turn.
* ``FILE.jsonl``: one record per line, either ``{"messages": [...]}`` (prompt = messages up to
  and including the first user turn) or Spec-Bench form ``{"turns": [...], "category": ...}``;
  an optional ``"category"`` is kept, else the file's stem is the category.

When fewer prompts are asked for than a set holds, they are taken round-robin over categories
so that every category is represented.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from itertools import zip_longest
from pathlib import Path

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


def _read_jsonl(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    records = []
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    rec = json.loads(line)
                    if not isinstance(rec, dict):
                        raise DraftlabError(f"{path}:{n}: each line must be a JSON object")
                    records.append(rec)
    except FileNotFoundError as e:
        raise DraftlabError(f"prompt file not found: {path}") from e
    except (json.JSONDecodeError, UnicodeDecodeError, OSError) as e:
        raise DraftlabError(f"{path}: not valid JSONL ({str(e).splitlines()[0]})") from e
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


def _heldout_conversations(data_spec) -> list[tuple[str, str, list[dict]]]:
    """The data stage's held-out split. Loads and splits exactly as ``build_samples`` does but
    skips tokenising the (large) training part, which evaluation never needs; only the prompt
    (up to the first assistant turn) is used, which regeneration leaves unchanged."""
    from draftlab.data.dataset import DataSpec, split_heldout
    from draftlab.data.sources import load_conversations

    spec = data_spec if data_spec is not None else DataSpec()
    convs, _ = load_conversations(spec.source, spec.path, spec.num_conversations, spec.hf_split, spec.hf_column)
    if spec.heldout >= len(convs):
        raise DraftlabError(f"data.heldout ({spec.heldout}) must be smaller than the number of usable conversations ({len(convs)})")
    _, held = split_heldout(convs, spec.heldout, spec.seed)
    if not held:
        raise DraftlabError("data 'sharegpt-heldout': the data split holds no held-out conversations (data.heldout = 0)")
    return [("sharegpt", str(i), _first_user_turn(convs[i], f"held-out conversation {i}")) for i in held]


def load_prompts(data: str, tokenizer, num_prompts: int | None = None, data_spec=None) -> list[EvalPrompt]:
    """Prompts of a named set (``DATA_SETS``) or a JSONL file; ``data_spec`` is the DataSpec whose
    held-out split ``sharegpt-heldout`` uses (default: the data stage's defaults)."""
    if num_prompts is not None and num_prompts < 1:
        raise DraftlabError(f"num_prompts must be >= 1, got {num_prompts}")
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
        convs = _heldout_conversations(data_spec)
    else:
        path = Path(data)
        if not path.name.endswith((".jsonl", ".jsonl.gz")):
            raise DraftlabError(f"data must be one of {', '.join(DATA_SETS)} or a .jsonl file, got '{data}'")
        convs = _conversations_from_records(_read_jsonl(path), path)
    convs = _round_robin(convs, num_prompts, key=lambda c: c[0])
    return [EvalPrompt(cat, chat_prompt_ids(tokenizer, msgs), rid) for cat, rid, msgs in convs]
