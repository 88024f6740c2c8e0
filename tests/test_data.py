"""Data stage: sources (ShareGPT streaming, JSONL, HF), chat loss masks, samples, batching, regeneration."""

from __future__ import annotations

import json
import random
import time

import pytest
import torch
from pydantic import ValidationError
from tiny import make_tokenizer

from draftlab.data import regenerate as regen_mod
from draftlab.data import sources
from draftlab.data.chat import ChatTemplateError, mask_from_spans, prompt_ids, tokenize_conversation
from draftlab.data.dataset import DataSpec, batches_by_tokens, build_samples, collate, split_heldout
from draftlab.data.regenerate import regenerate
from draftlab.data.sources import load_conversations, normalize_conversation
from draftlab.errors import DraftlabError

EOT = {"chatml": "<|im_end|>", "llama3": "<|eot_id|>"}

CONV = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hello! How are you?"},
    {"role": "assistant", "content": "  The quick brown fox jumps.  "},
    {"role": "user", "content": "Translate good morning"},
    {"role": "assistant", "content": "def add(a, b):\n    return a + b"},
]


@pytest.fixture(scope="module", params=["chatml", "llama3"])
def tok(request):
    t = make_tokenizer(request.param)
    t.template_name = request.param
    return t


def _rendered_content(tok, content: str) -> str:
    return content.strip() if tok.template_name == "llama3" else content  # the llama3 template trims


def _runs(ids, mask):
    runs, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(i)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return runs


# ------------------------------------------------------------------------------ loss mask
def test_loss_mask_exact_multi_turn(tok):
    ids, mask = tokenize_conversation(tok, CONV, 4096)
    assert len(ids) == len(mask) and set(mask) <= {0, 1}
    eot = EOT[tok.template_name]
    parts = [_rendered_content(tok, m["content"]) + eot for m in CONV if m["role"] == "assistant"]
    # each assistant turn is exactly one masked run: its content and the end-of-turn token
    assert [tok.decode(r) for r in _runs(ids, mask)] == parts
    # the unmasked tokens are exactly the rest of the rendered text: headers, system and user turns
    text = tok.apply_chat_template(CONV, tokenize=False)
    rest = text
    for p in parts:
        assert rest.count(p) == 1
        rest = rest.replace(p, "")
    unmasked = tok.decode([i for i, m in zip(ids, mask) if not m])
    assert unmasked == rest
    for m in CONV:
        if m["role"] == "assistant":
            assert m["content"].strip() not in unmasked
    assert "assistant" in unmasked and "Hello! How are you?" in unmasked  # header and user text stay unmasked


def test_loss_mask_single_turn_starts_after_header(tok):
    conv = [{"role": "user", "content": "user assistant"}, {"role": "assistant", "content": "assistant"}]
    ids, mask = tokenize_conversation(tok, conv, 512)
    # the content equals the header's role name: the mask must still start after the header
    assert [tok.decode(r) for r in _runs(ids, mask)] == ["assistant" + EOT[tok.template_name]]
    assert tok.decode(ids[: mask.index(1)]).endswith("\n")


def test_truncation_keeps_prefix(tok):
    full_ids, full_mask = tokenize_conversation(tok, CONV, 4096)
    for n in (5, len(full_ids) // 2, len(full_ids) - 1):
        ids, mask = tokenize_conversation(tok, CONV, n)
        assert len(ids) == n
        assert ids == full_ids[:n] and mask == full_mask[:n]
    assert tokenize_conversation(tok, CONV, 4096) == (full_ids, full_mask)


def test_prompt_ids_end_with_generation_prompt(tok):
    p = prompt_ids(tok, CONV)
    text = tok.decode(p)
    assert text.endswith("assistant\n" if tok.template_name == "chatml" else "assistant<|end_header_id|>\n\n")
    assert "Hello! How are you?" in text and "quick brown" not in text
    ids, _ = tokenize_conversation(tok, CONV, 4096)
    assert ids[: len(p)] == p  # the prompt is a token prefix of the training sample


def test_mask_straddling_tokens():
    # text: "HDR|content|<eot>\n" ; token 1 straddles the header/content boundary,
    # token 3 straddles the content end; both carry content characters -> masked.
    offsets = [(0, 2), (2, 5), (5, 7), (7, 10), (10, 15), (15, 16)]
    ids = [10, 11, 12, 13, 99, 14]
    spans = [(4, 8, 16)]  # content chars 4..8, turn ends at 16
    assert mask_from_spans(ids, offsets, spans, {99}) == [0, 1, 1, 1, 1, 0]
    # a non-special token between the content and the end token stops the end-of-turn run
    assert mask_from_spans([10, 11, 12, 13, 50, 99], [(0, 2), (2, 5), (5, 7), (7, 8), (8, 9), (9, 14)], [(4, 8, 14)], {99}) == [0, 1, 1, 1, 0, 0]


def test_inconsistent_template_raises():
    t = make_tokenizer("chatml")
    t.chat_template = "{{ messages | length }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(ChatTemplateError):
        tokenize_conversation(t, CONV[1:3], 64)


# ------------------------------------------------------------------------------ sources
def _sharegpt_records(n, start=0):
    recs = []
    for i in range(start, start + n):
        recs.append({
            "id": f"r{i}",
            "conversations": [
                {"from": "human", "value": f"question {i} with \"quotes\", é and ☃"},
                {"from": "gpt", "value": f"answer {i} 😀 \\ backslash\nnew line"},
            ],
        })
    return recs


def test_truncated_sharegpt_keeps_complete_records(tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "CHUNK_BYTES", 7)  # many buffer refills, split UTF-8 sequences
    recs = _sharegpt_records(4)
    text = json.dumps(recs, indent=2, ensure_ascii=False)
    ends = []  # character offsets where each record's closing brace ends
    pos = 0
    for r in recs:
        pos = text.index("\n  }", pos) + 4
        ends.append(pos)
    path = tmp_path / "cut.json"
    cuts = set(range(1, len(text), 5)) | {e + d for e in ends for d in range(-3, 4) if 0 < e + d < len(text)}
    for cut in sorted(cuts):
        path.write_bytes(text[:cut].encode("utf-8"))
        convs, rep = load_conversations(str(path))
        complete = sum(e <= cut for e in ends)
        assert len(convs) == complete, cut
        assert rep.truncated_after == complete
        assert [c[1]["content"] for c in convs] == [r["conversations"][1]["value"] for r in recs[:complete]]
    path.write_text(text[: ends[2] + 40], encoding="utf-8")  # mid-record 4
    convs, rep = load_conversations("sharegpt", path=path)
    assert len(convs) == 3 and rep.truncated_after == 3 and rep.truncated_tail_chars > 0
    assert "file truncated after record 3" in rep.summary()
    path.write_text(text, encoding="utf-8")
    convs, rep = load_conversations(str(path))
    assert len(convs) == 4 and rep.truncated_after is None


def test_limit_stops_early_without_reading_on(tmp_path):
    good = json.dumps(_sharegpt_records(3))
    path = tmp_path / "x.json"
    path.write_text(good[:-1] + ", {this is not json at all}]")
    convs, rep = load_conversations(str(path), limit=2)
    assert len(convs) == 2 and rep.stopped_at_limit and "stopped at the requested limit" in rep.summary()
    with pytest.raises(DraftlabError, match=r"x\.json.*line 1"):
        load_conversations(str(path))


def test_messy_roles_and_bad_rows_counted(tmp_path):
    def conv(*turns):
        return {"conversations": [{"from": f, "value": v} for f, v in turns]}

    recs = [
        conv(("system", "sys"), ("human", "q"), ("gpt", "a"), ("user", "q2"), ("chatgpt", "a2"), ("human", "q3"), ("bing", "a3")),
        conv(("Human", "q"), ("bard", "a")),  # case-insensitive
        conv(("gpt", "orphan continuation"), ("human", "q"), ("gpt", "a")),  # leading assistant dropped
        conv(("human", "q"), ("gpt", "a"), ("human", "unanswered")),  # trailing user dropped
        {"conversations": []},  # empty
        conv(("human", "q"), ("human", "q again"), ("gpt", "a")),  # bad role order
        conv(("human", "q"), ("gpt", "a"), ("system", "late system")),  # bad role order
        conv(("human", "q"), ("tool", "x")),  # unknown role
        {"conversations": [{"from": "human", "value": 3}, {"from": "gpt", "value": "a"}]},  # non-string
        conv(("human", "   "), ("gpt", "a")),  # empty message
        conv(("gpt", "only the assistant")),  # no assistant turn left
        conv(("human", "q" * 50), ("gpt", "a" * 60)),  # over-long with max_chars=100
        {"id": "no turns here"},
        [1, 2],
    ]
    path = tmp_path / "messy.json"
    path.write_text(json.dumps(recs))
    convs, rep = load_conversations(str(path), max_chars=100)
    assert [[m["role"] for m in c] for c in convs] == [
        ["system", "user", "assistant", "user", "assistant", "user", "assistant"],
        ["user", "assistant"],
        ["user", "assistant"],
        ["user", "assistant"],
    ]
    assert convs[2][0]["content"] == "q" and convs[3][-1]["content"] == "a"
    assert rep.read == len(recs) and rep.kept == 4
    assert dict(rep.bad) == {
        "empty": 1, "bad role order": 2, "unknown role": 1, "non-string content": 1, "empty message": 1,
        "no assistant turn": 1, "over-long": 1, "no conversation field": 1, "not an object": 1,
    }
    assert dict(rep.fixed) == {"dropped leading assistant turn": 1, "dropped trailing user turn": 1}
    s = rep.summary()
    assert s.startswith("json: kept 4 of 14 conversations (") and "bad role order 2" in s and "empty 1" in s


def test_normalize_conversation_messages_form():
    msgs, reason, fixes = normalize_conversation([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}])
    assert msgs == [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}] and reason is None and not fixes
    assert normalize_conversation([{"role": "assistant", "content": "a"}, {"role": "user", "content": "q"}])[1] == "no assistant turn"
    assert normalize_conversation("nope")[1] == "empty"
    assert normalize_conversation([{"x": 1}])[1] == "malformed turn"


def test_jsonl_messages(tmp_path):
    path = tmp_path / "d.jsonl"
    lines = [json.dumps({"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}) for i in range(3)]
    lines.insert(1, "")  # blank lines are fine
    lines.append(json.dumps({"messages": [{"role": "developer", "content": "x"}]}))
    path.write_text("\n".join(lines) + "\n")
    convs, rep = load_conversations(str(path))
    assert [c[1]["content"] for c in convs] == ["a0", "a1", "a2"]
    assert rep.kept == 3 and dict(rep.bad) == {"unknown role": 1}


def test_iter_jsonl_reads_gzip_and_names_the_bad_line(tmp_path):
    """The one JSONL reader (data sources and prompt files): gzip by name, a byte-order mark
    skipped, line numbers of the file; bad UTF-8 names line and byte, a cut gzip is one line."""
    import gzip

    plain, packed = tmp_path / "a.jsonl", tmp_path / "a.jsonl.gz"
    text = '\ufeff{"x": 1}\n\n{"x": 2}\n'
    plain.write_text(text, encoding="utf-8")
    packed.write_bytes(gzip.compress(text.encode("utf-8")))
    assert list(sources.iter_jsonl(plain)) == list(sources.iter_jsonl(packed)) == [(1, {"x": 1}), (3, {"x": 2})]
    raw = tmp_path / "raw.jsonl"
    raw.write_bytes(b'{"x": 1}\n{"x": "\xff"}\n')
    with pytest.raises(DraftlabError, match=r"raw\.jsonl:2: not valid UTF-8 \(byte 0xff at byte 8\)"):
        list(sources.iter_jsonl(raw))
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(packed.read_bytes()[:-12])
    with pytest.raises(DraftlabError, match=r"cannot read data file .*cut\.jsonl\.gz"):
        list(sources.iter_jsonl(cut))
    with pytest.raises(DraftlabError, match=r"data file not found: .*gone\.jsonl"):
        list(sources.iter_jsonl(tmp_path / "gone.jsonl"))


@pytest.mark.parametrize("kind", ["missing", "not_json", "not_list", "jsonl_broken", "corrupt_middle", "empty"])
def test_bad_files_raise_naming_file(tmp_path, kind):
    if kind == "missing":
        path, match = tmp_path / "nope.json", "nope.json"
    elif kind == "not_json":
        path, match = tmp_path / "bad.json", "bad.json"
        path.write_text("hello, I am not JSON")
    elif kind == "not_list":
        path, match = tmp_path / "obj.json", "obj.json.*JSON list"
        path.write_text('{"conversations": []}')
    elif kind == "jsonl_broken":
        path, match = tmp_path / "broken.jsonl", r"broken\.jsonl:3: not valid JSON"
        ok = json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]})
        path.write_text(f"{ok}\n{ok}\n{{\"messages\": [\n{ok}\n")
    elif kind == "corrupt_middle":
        path, match = tmp_path / "mid.json", r"mid\.json.*line 3"
        path.write_text('[\n{"conversations": []},\n{"conversations": [} ,\n' + json.dumps(_sharegpt_records(50))[1:])
    else:
        path, match = tmp_path / "empty.json", "empty.json.*empty"
        path.write_text("  \n")
    with pytest.raises(DraftlabError, match=match):
        load_conversations(str(path))
    with pytest.raises(DraftlabError, match=match):
        load_conversations("sharegpt", path=path)


def test_unknown_source_kind():
    with pytest.raises(DraftlabError, match="data.source"):
        load_conversations("data.csv")
    with pytest.raises(ValidationError):
        DataSpec(source="data.csv")
    with pytest.raises(ValidationError):
        DataSpec(unknown_field=1)


def test_hf_dataset_dir(tmp_path):
    from datasets import Dataset, DatasetDict

    rows = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}], "other": i} for i in range(4)]
    Dataset.from_list(rows).save_to_disk(str(tmp_path / "msgs"))
    convs, rep = load_conversations(f"hf:{tmp_path / 'msgs'}")
    assert [c[1]["content"] for c in convs] == ["a0", "a1", "a2", "a3"] and rep.source == "hf"
    sg = [{"chat": [{"from": "human", "value": "q"}, {"from": "gpt", "value": f"a{i}"}]} for i in range(3)]
    DatasetDict({"train": Dataset.from_list(sg)}).save_to_disk(str(tmp_path / "sg"))
    convs, _ = load_conversations(f"hf:{tmp_path / 'sg'}", hf_column="chat", limit=2)
    assert [c[1]["content"] for c in convs] == ["a0", "a1"]
    with pytest.raises(DraftlabError, match="hf_column"):
        load_conversations(f"hf:{tmp_path / 'sg'}")
    with pytest.raises(DraftlabError, match="no column 'nope'"):
        load_conversations(f"hf:{tmp_path / 'sg'}", hf_column="nope")
    with pytest.raises(DraftlabError, match="split 'test'"):
        load_conversations(f"hf:{tmp_path / 'sg'}", hf_split="test", hf_column="chat")
    with pytest.raises(DraftlabError, match="cannot load HF dataset"):
        load_conversations(f"hf:{tmp_path / 'does-not-exist'}")


def test_packaged_sharegpt_first_50():
    t0 = time.perf_counter()
    convs, rep = load_conversations("sharegpt", limit=50)
    elapsed = time.perf_counter() - t0
    assert len(convs) == 50 and rep.stopped_at_limit and rep.read >= 50
    assert elapsed < 2.0
    for c in convs:
        body = c[1:] if c[0]["role"] == "system" else c
        assert [m["role"] for m in body] == ["user", "assistant"] * (len(body) // 2)


# ------------------------------------------------------------------------------ samples
def _jsonl_corpus(path, n, seed=0):
    rng = random.Random(seed)
    words = "the quick brown fox jumps over lazy dog hello how can help you today".split()
    recs = []
    for i in range(n):
        turns = []
        for _ in range(rng.randint(1, 3)):
            turns.append({"role": "user", "content": f"q{i} " + " ".join(rng.choices(words, k=rng.randint(1, 8)))})
            turns.append({"role": "assistant", "content": " ".join(rng.choices(words, k=rng.randint(1, 30)))})
        recs.append({"messages": turns})
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return recs


def test_build_samples_split_deterministic(tmp_path):
    tok = make_tokenizer("chatml")
    recs = _jsonl_corpus(tmp_path / "a.jsonl", 40)
    spec = DataSpec(source=str(tmp_path / "a.jsonl"), heldout=6, seed=3, max_length=64)
    s1, s2 = build_samples(spec, tok), build_samples(spec, tok)
    assert len(s1.heldout_conversations) == 6
    assert s1.heldout_conversations == s2.heldout_conversations
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(s1.train, s2.train))
    # the split does not depend on the order the conversations were loaded in
    shuffled = recs[:]
    random.Random(1).shuffle(shuffled)
    (tmp_path / "b.jsonl").write_text("".join(json.dumps(r) + "\n" for r in shuffled))
    s3 = build_samples(spec.model_copy(update={"source": str(tmp_path / "b.jsonl")}), tok)
    key = lambda cs: sorted(json.dumps(c) for c in cs)  # noqa: E731
    assert key(s3.heldout_conversations) == key(s1.heldout_conversations)
    # a different seed holds out a different set
    s4 = build_samples(spec.model_copy(update={"seed": 4}), tok)
    assert key(s4.heldout_conversations) != key(s1.heldout_conversations)
    # every sample: long ids, bool mask, same length, truncated to max_length, has loss tokens
    r = s1.report
    assert r["train"]["samples"] == len(s1.train) and r["heldout"]["samples"] == len(s1.heldout)
    assert len(s1.train) + len(s1.heldout) + r["train"]["too_few_loss_tokens"] + r["heldout"]["too_few_loss_tokens"] == 40
    for s in s1.train + s1.heldout:
        assert s["input_ids"].dtype == torch.long and s["loss_mask"].dtype == torch.bool
        assert s["input_ids"].shape == s["loss_mask"].shape and s["input_ids"].numel() <= 64
        assert s["loss_mask"].sum() >= 1
    assert "train" in r["summary"]


def test_split_heldout_indices():
    convs = [[{"role": "user", "content": str(i)}, {"role": "assistant", "content": "a"}] for i in range(20)]
    train, held = split_heldout(convs, 5, seed=0)
    assert len(held) == 5 and sorted(train + held) == list(range(20)) and held == sorted(held)
    assert split_heldout(convs, 0, 0) == (list(range(20)), [])


def test_min_loss_tokens_and_limits(tmp_path):
    tok = make_tokenizer("llama3")
    _jsonl_corpus(tmp_path / "a.jsonl", 30)
    spec = DataSpec(source=str(tmp_path / "a.jsonl"), heldout=2, num_conversations=12, min_loss_tokens=15)
    s = build_samples(spec, tok)
    assert s.report["conversations"] == 12
    assert all(x["loss_mask"].sum() >= 15 for x in s.train + s.heldout)
    assert s.report["train"]["too_few_loss_tokens"] + len(s.train) == 10
    with pytest.raises(DraftlabError, match="data.heldout"):
        build_samples(DataSpec(source=str(tmp_path / "a.jsonl"), heldout=12, num_conversations=12), tok)
    with pytest.raises(DraftlabError, match="regenerate"):
        build_samples(DataSpec(source=str(tmp_path / "a.jsonl"), heldout=1, regenerate=True), tok)


def test_build_samples_sharegpt_300_fast():
    tok = make_tokenizer("chatml")
    t0 = time.perf_counter()
    s = build_samples(DataSpec(num_conversations=300, max_length=512), tok)
    assert time.perf_counter() - t0 < 10.0
    assert s.report["conversations"] == 300 and len(s.heldout_conversations) == 32
    assert len(s.train) + s.report["train"]["too_few_loss_tokens"] == 300 - 32
    assert len(s.train) > 150  # the rest have prompts longer than max_length


def test_collate_right_pads():
    samples = [
        {"input_ids": torch.tensor([5, 6, 7]), "loss_mask": torch.tensor([False, True, True])},
        {"input_ids": torch.tensor([8]), "loss_mask": torch.tensor([True])},
    ]
    b = collate(samples, pad_id=0)
    assert b["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert b["loss_mask"].tolist() == [[False, True, True], [True, False, False]]
    assert b["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]


def test_batches_by_tokens():
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(3, 200, (300,), generator=g).tolist()
    samples = [{"input_ids": torch.zeros(n, dtype=torch.long), "loss_mask": torch.ones(n, dtype=torch.bool)} for n in lengths]
    samples.append({"input_ids": torch.zeros(900, dtype=torch.long), "loss_mask": torch.ones(900, dtype=torch.bool)})
    b1 = batches_by_tokens(samples, 800, seed=1, epoch=0)
    assert sorted(i for b in b1 for i in b) == list(range(len(samples)))
    assert b1 == batches_by_tokens(samples, 800, seed=1, epoch=0)
    assert b1 != batches_by_tokens(samples, 800, seed=1, epoch=1)
    padded = 0
    for b in b1:
        longest = max(samples[i]["input_ids"].numel() for i in b)
        assert len(b) * longest <= 800 or len(b) == 1
        padded += len(b) * longest
    real = sum(s["input_ids"].numel() for s in samples)
    assert padded < 1.15 * real  # length-grouped: little padding
    assert [i for b in b1 if len(b) == 1 for i in b].count(300) == 1


# ------------------------------------------------------------------------------ regeneration
REGEN_CONVS = [
    [{"role": "user", "content": f"Hello {i}"}, {"role": "assistant", "content": "fine"},
     {"role": "user", "content": "again " * (i + 1)}, {"role": "assistant", "content": "x"}]
    for i in range(5)
]


def test_regenerate_resume_equals_uninterrupted(tiny_llama, tmp_path, monkeypatch):
    kw = dict(max_new_tokens=4, batch_size=2, seed=7, temperature=1.0)
    full = regenerate(tiny_llama, REGEN_CONVS, tmp_path / "a.jsonl", **kw)
    expected = (tmp_path / "a.jsonl").read_bytes()
    assert len(full) == 5 and not (tmp_path / "a.jsonl.partial").exists()
    for orig, new in zip(REGEN_CONVS, full):
        assert [m["role"] for m in new] == [m["role"] for m in orig]
        assert [m["content"] for m in new if m["role"] == "user"] == [m["content"] for m in orig if m["role"] == "user"]
    assert any(m["content"] != "fine" for c in full for m in c if m["role"] == "assistant")

    real = regen_mod._regenerate_batch
    calls = {"n": 0}

    def dying(*a, **k):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt("killed")
        return real(*a, **k)

    monkeypatch.setattr(regen_mod, "_regenerate_batch", dying)
    with pytest.raises(KeyboardInterrupt):
        regenerate(tiny_llama, REGEN_CONVS, tmp_path / "b.jsonl", **kw)
    partial = tmp_path / "b.jsonl.partial"
    assert not (tmp_path / "b.jsonl").exists()
    assert len(partial.read_text().splitlines()) == 4  # two finished batches
    with open(partial, "a") as f:
        f.write('{"id": "4-')  # a torn line, as from a kill mid-write
    monkeypatch.setattr(regen_mod, "_regenerate_batch", real)
    resumed = regenerate(tiny_llama, REGEN_CONVS, tmp_path / "b.jsonl", **kw)
    assert resumed == full
    assert (tmp_path / "b.jsonl").read_bytes() == expected
    assert not partial.exists()

    # a finished file is reused without generating; it loads back as a JSONL data source
    monkeypatch.setattr(regen_mod, "_generate", lambda *a, **k: pytest.fail("should not generate"))
    assert regenerate(tiny_llama, REGEN_CONVS, tmp_path / "b.jsonl", **kw) == full
    assert load_conversations(str(tmp_path / "b.jsonl"))[1].read == 5
    with pytest.raises(DraftlabError, match="other conversations"):
        regenerate(tiny_llama, REGEN_CONVS[:3], tmp_path / "b.jsonl", **kw)
    with pytest.raises(DraftlabError, match="generation settings"):
        regenerate(tiny_llama, REGEN_CONVS, tmp_path / "b.jsonl", **{**kw, "temperature": 0.5})


def test_regenerate_greedy_and_length_cut(tiny_llama, tmp_path):
    a = regenerate(tiny_llama, REGEN_CONVS[:2], tmp_path / "g1.jsonl", max_new_tokens=4, batch_size=2, seed=0)
    b = regenerate(tiny_llama, REGEN_CONVS[:2], tmp_path / "g2.jsonl", max_new_tokens=4, batch_size=1, seed=5)
    assert a == b  # greedy: independent of seed and batching
    # max_length below the second turn's prompt: the conversation ends after the first answer
    first_prompt = len(prompt_ids(tiny_llama.tokenizer, REGEN_CONVS[0]))
    c = regenerate(tiny_llama, REGEN_CONVS[:1], tmp_path / "cut.jsonl", max_new_tokens=4, batch_size=1, max_length=first_prompt + 6)
    assert [m["role"] for m in c[0]] == ["user", "assistant"]
    # max_turns=1: each conversation ends after its first answer, which equals the all-turns run's
    one = regenerate(tiny_llama, REGEN_CONVS[:2], tmp_path / "t1.jsonl", max_new_tokens=4, batch_size=2, max_turns=1)
    assert [[m["role"] for m in x] for x in one] == [["user", "assistant"]] * 2
    assert [x[:2] for x in a] == one and all(len(x) == 4 for x in a)


def test_build_samples_with_regeneration(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTLAB_CACHE", str(tmp_path / "cache"))
    _jsonl_corpus(tmp_path / "a.jsonl", 6)
    spec = DataSpec(source=str(tmp_path / "a.jsonl"), heldout=1, regenerate=True, regenerate_max_new_tokens=3,
                    regenerate_batch_size=3, max_length=128, min_loss_tokens=0)
    s = build_samples(spec, tiny_llama.tokenizer, target=tiny_llama)
    out = s.report["regenerated"]["path"]
    assert out.startswith(str(tmp_path / "cache")) and s.report["regenerated"]["conversations"] == 6
    plain = build_samples(spec.model_copy(update={"regenerate": False}), tiny_llama.tokenizer)
    assert s.heldout_conversations == plain.heldout_conversations  # prompts from the original data
    assert len(s.train) == len(plain.train) == 5
    # assistant tokens are the target's (at most 3 new tokens + end-of-turn per turn), prompts unchanged
    for a, b in zip(s.train, plain.train):
        assert not torch.equal(a["input_ids"], b["input_ids"])
        first = int(b["loss_mask"].nonzero()[0])
        assert torch.equal(a["input_ids"][:first], b["input_ids"][:first])
    again = build_samples(spec, tiny_llama.tokenizer, target=tiny_llama)  # reuses the cached file
    assert all(torch.equal(x["input_ids"], y["input_ids"]) for x, y in zip(s.train, again.train))
