"""Self-distillation data: replace every assistant turn with the target's own answer.

Each assistant turn is regenerated in order, conditioned on the conversation so far with the
*regenerated* earlier answers (what the target would really have seen), greedy or sampled.
Conversations are processed in fixed batches (left-padded ``target.model.generate``), so a
batch always has the same members and, for sampling, the same seed ``(seed, batch index)``:
a run that is killed and restarted produces exactly the file an uninterrupted run would.

Resumability: finished conversations are appended to ``<out>.partial`` (one JSON record per
line, flushed per batch). On restart the partial file is re-read, a torn last line is
discarded, and batches whose conversations are all done are skipped. Every record carries ``gen``, a digest
of the target identity and generation settings: records made otherwise are not reused, and a
finished file made from other conversations or settings is an error rather than stale data. When every conversation
is done the final JSONL (``{"id", "gen", "messages"}`` per line, input order, loadable as a data
source) is written atomically and the partial file removed.

A turn whose prompt already fills ``max_length`` tokens is not generated (training truncates
there, so it would teach nothing): the conversation ends before that turn's user message and
may be left without any assistant turn, which tokenisation later skips. With ``max_turns`` the
conversation also ends after its last regenerated turn: later turns are the costly ones (each turn
is a sequential round of generation for the rows that still have one).
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path
from typing import Sequence

import torch

from draftlab.atomic import append_text, make_dir, write_text
from draftlab.data.chat import check_template, render
from draftlab.data.sources import Conversation, conversation_digest
from draftlab.errors import DraftlabError


def record_ids(conversations: Sequence[Conversation]) -> list[str]:
    """Ids tie an output record to its input position and content."""
    return [f"{i}-{conversation_digest(c)[:16]}" for i, c in enumerate(conversations)]


def regenerate_cache_path(target, conversations: Sequence[Conversation], **settings) -> Path:
    """Default output path: the draftlab cache, keyed by the conversations and by what else
    decides the output (the target and :func:`regenerate`'s ``settings``)."""
    from draftlab.models.target import cache_root

    key = {"conversations": [conversation_digest(c) for c in conversations], "gen": _settings_digest(target, **settings)}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return cache_root() / "regenerated" / f"{digest}.jsonl"


def _stop_ids(target) -> set[int]:
    ids = set()
    eos = getattr(target.model.generation_config, "eos_token_id", None)
    for x in eos if isinstance(eos, (list, tuple)) else [eos]:
        if x is not None:
            ids.add(int(x))
    if target.tokenizer.eos_token_id is not None:
        ids.add(int(target.tokenizer.eos_token_id))
    if not ids:
        raise DraftlabError("regenerate: the target has no end-of-sequence token (generation_config.eos_token_id)")
    return ids


def _generate(target, prompts: list[list[int]], max_new_tokens: int, temperature: float, seed: int, stop: set[int]) -> list[list[int]]:
    """Left-padded batch generation; returns each prompt's new tokens up to (excluding) the first stop token."""
    from transformers import GenerationConfig

    pad = target.tokenizer.pad_token_id
    pad = min(stop) if pad is None else pad
    T = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), T), pad, dtype=torch.long)
    attn = torch.zeros((len(prompts), T), dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, T - len(p) :] = torch.tensor(p)
        attn[b, T - len(p) :] = 1
    sample = temperature > 0
    cfg = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=sample,
        temperature=temperature if sample else None,
        top_k=None,
        top_p=None,
        eos_token_id=sorted(stop),
        pad_token_id=pad,
    )
    devices = [target.device] if target.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):  # seeded without disturbing the caller's RNG
        torch.manual_seed(seed)
        out = target.model.generate(input_ids=ids.to(target.device), attention_mask=attn.to(target.device), generation_config=cfg)
    results = []
    for row in out[:, T:].tolist():
        cut = next((k for k, t in enumerate(row) if t in stop), len(row))
        results.append(row[:cut])
    return results


def _regenerate_batch(target, convs: list[Conversation], max_new_tokens: int, temperature: float, seed: int,
                      max_length: int, stop: set[int], max_turns: int | None = None) -> list[Conversation]:
    tok = target.tokenizer
    new: list[Conversation] = [[] for _ in convs]
    pos = [0] * len(convs)  # next input message to copy
    active = list(range(len(convs)))
    turn = 0
    while active and (max_turns is None or turn < max_turns):
        prompts, members = [], []
        for c in active:
            msgs = convs[c]
            while pos[c] < len(msgs) and msgs[pos[c]]["role"] != "assistant":
                pos[c] += 1
            if pos[c] >= len(msgs):
                continue  # no more assistant turns
            context = new[c] + [dict(m) for m in msgs[len(new[c]) : pos[c]]]
            p = tok(render(tok, context, add_generation_prompt=True), add_special_tokens=False)["input_ids"]
            if len(p) >= max_length:
                continue  # nothing of this turn would survive truncation: the conversation ends here
            prompts.append(p)
            members.append((c, context, max_length - len(p)))
        if not prompts:
            break
        outs = _generate(target, prompts, max_new_tokens, temperature, seed * 1000003 + turn, stop)
        active = []
        for (c, context, room), toks in zip(members, outs):
            text = tok.decode(toks[:room], skip_special_tokens=True)
            new[c] = context + [{"role": "assistant", "content": text}]
            pos[c] += 1
            active.append(c)
        turn += 1
    return new


def _read_records(path: Path, wanted: set[str], gen: str) -> tuple[dict[str, Conversation], list[str]]:
    """Complete, parseable records of ``path`` with a wanted id made with settings ``gen`` (and
    their lines); a torn line or a record of other conversations or settings is dropped."""
    done: dict[str, Conversation] = {}
    lines: list[str] = []
    with open(path, encoding="utf-8", errors="replace") as f:  # reading; a damaged line is dropped below
        for line in f:
            if not line.endswith("\n"):
                break  # torn write from a killed run
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(rec, dict) and rec.get("id") in wanted and rec.get("gen") == gen and rec["id"] not in done:
                done[rec["id"]] = rec["messages"]
                lines.append(line)
    return done, lines


def _atomic_write(path: Path, lines: list[str]) -> None:
    write_text(path, "".join(lines), durable=True)


def _line(rid: str, messages: Conversation, gen: str) -> str:
    return json.dumps({"id": rid, "gen": gen, "messages": messages}, ensure_ascii=False) + "\n"


def _settings_digest(target, **settings) -> str:
    """Short digest of everything besides the input that decides the output."""
    blob = json.dumps({"target": target.identity, **settings}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def regenerate(target, conversations: Sequence[Conversation], out_path, max_new_tokens: int = 512, batch_size: int = 8,
               seed: int = 0, temperature: float = 0.0, max_length: int | None = None,
               max_turns: int | None = None) -> list[Conversation]:
    """Regenerate the assistant turns of ``conversations`` with ``target`` into ``out_path``
    (JSONL); resumable (see module doc). Returns the regenerated conversations in input order."""
    check_template(target.tokenizer)
    if max_new_tokens < 1 or batch_size < 1 or (max_turns is not None and max_turns < 1):
        raise DraftlabError("regenerate: max_new_tokens, batch_size and max_turns must be positive")
    out = Path(out_path)
    max_length = max_length or int(getattr(target.config, "max_position_embeddings", 4096))
    ids = record_ids(conversations)
    wanted = set(ids)
    gen = _settings_digest(target, max_new_tokens=max_new_tokens, batch_size=batch_size, seed=seed,
                           temperature=temperature, max_length=max_length, max_turns=max_turns)
    if out.is_file():
        try:
            records = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines() if line.strip()]
            found = [(r["id"], r["gen"]) for r in records]
        except (json.JSONDecodeError, UnicodeDecodeError, TypeError, KeyError):
            found = None
        if found != [(i, gen) for i in ids]:
            raise DraftlabError(
                f"{out} exists but was made from other conversations or generation settings; remove it or choose another path"
            )
        return [r["messages"] for r in records]
    make_dir(out.parent)
    partial = out.with_name(out.name + ".partial")
    done: dict[str, Conversation] = {}
    if partial.is_file():
        done, lines = _read_records(partial, wanted, gen)
        _atomic_write(partial, lines)  # drop a torn tail before appending to it
    stop = _stop_ids(target)
    # a per-run salt would break resume equality; derive batch seeds from the seed only
    base = random.Random(f"regenerate:{seed}").getrandbits(31)
    for b in range(0, len(ids), batch_size):
        batch_ids = ids[b : b + batch_size]
        if all(i in done for i in batch_ids):
            continue
        new = _regenerate_batch(target, list(conversations[b : b + batch_size]), max_new_tokens, temperature,
                                base + b // batch_size, max_length, stop, max_turns)
        lines = []
        for rid, conv in zip(batch_ids, new):
            if rid not in done:
                done[rid] = conv
                lines.append(_line(rid, conv, gen))
        append_text(partial, "".join(lines), durable=True)  # a failed append is cut back off: whole records only
    _atomic_write(out, [_line(i, done[i], gen) for i in ids])
    partial.unlink()
    return [done[i] for i in ids]
