"""Acceptance metrics (a_j, alpha_j, tau), reports, evaluation prompt sets, ``draftlab eval``
and ``draftlab generate`` on a tiny target."""

from __future__ import annotations

import json
import math

import pytest

from draftlab.errors import DraftlabError
from draftlab.inference.metrics import TAU_LABELS, AcceptanceStats, acceptance_stats, tau_prompt_mean, tau_standard_error


pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------------- metrics
def test_hand_computed_chain():
    s = acceptance_stats([0, 1, 3, 2, 3], k=3)
    # L >= 1: 4 of 5, L >= 2: 3 of 5, L >= 3: 2 of 5
    assert s.a == pytest.approx([0.8, 0.6, 0.4])
    assert s.alpha == pytest.approx([0.8, 0.75, 2 / 3])
    assert s.tau == pytest.approx(2.8)
    assert s.tau == pytest.approx(1 + sum([0, 1, 3, 2, 3]) / 5)  # tokens per verify step
    d = s.to_dict()
    assert d["num_steps"] == 5 and d["num_drafted"] == 15 and d["num_accepted"] == 9
    assert d["accepted_per_drafted"] == pytest.approx(9 / 15)
    assert json.loads(json.dumps(d)) == d  # JSON-clean


def test_alpha_undefined_after_zero_acceptance():
    s = acceptance_stats([0, 0, 1], k=4)
    assert s.a == pytest.approx([1 / 3, 0, 0, 0])
    assert s.alpha[:2] == pytest.approx([1 / 3, 0.0])
    assert s.alpha[2:] == [None, None]  # a_{j-1} == 0: undefined, not NaN
    assert not any(isinstance(x, float) and math.isnan(x) for x in s.alpha)
    empty = AcceptanceStats()
    assert empty.tau == 1.0 and empty.a == [] and empty.to_dict()["mean_accepted"] == 0.0


def test_varying_draft_counts_and_tree_depth():
    s = AcceptanceStats()
    s.add(2, 5)  # chain step with 5 drafts
    s.add(0, 0)  # a prompt-lookup miss: nothing offered, still a verify step
    s.add(3, 40, depth=4)  # tree step: 40 nodes, depth 4, accepted depth 3
    assert s.k == 5 and s.num_steps == 3 and s.num_drafted == 45
    assert s.a == pytest.approx([2 / 3, 2 / 3, 1 / 3, 0, 0])
    assert s.tau == pytest.approx(1 + 5 / 3)
    assert s.offered == [2, 2, 2, 2, 1]
    with pytest.raises(ValueError):
        s.add(5, 40, depth=4)  # accepted beyond the offered depth
    with pytest.raises(ValueError):
        s.add(3, 2)


def test_merge_and_roundtrip():
    a = acceptance_stats([1, 2], k=2)
    b = acceptance_stats([0, 4, 4], k=[4, 4, 5])
    merged = AcceptanceStats().merge(a).merge(b)
    direct = AcceptanceStats()
    direct.add_many([1, 2, 0, 4, 4], [2, 2, 4, 4, 5])
    assert merged.to_dict() == direct.to_dict()
    assert AcceptanceStats.from_dict(merged.to_dict()).to_dict() == merged.to_dict()
    assert merged.tau == pytest.approx(1 + 11 / 5)


def test_tau_pooled_and_per_prompt_mean_by_hand():
    """vLLM pools every verify step; SpecForge averages each prompt's own tau. Prompt A: one
    step accepting both drafts (tau 3); prompt B: three steps accepting none (tau 1)."""
    a, b = acceptance_stats([2], k=2), acceptance_stats([0, 0, 0], k=2)
    pooled = AcceptanceStats().merge(a).merge(b)
    assert pooled.tau == pytest.approx(1 + 2 / 4)  # 4 steps, 2 drafts accepted: 1.5
    assert tau_prompt_mean([a, b]) == pytest.approx((3 + 1) / 2)  # 2.0
    assert pooled.alpha == pytest.approx([0.25, 1.0])  # alpha_j stays pooled
    assert tau_prompt_mean([a]) == pytest.approx(a.tau) and tau_prompt_mean([]) is None
    # a third prompt of tau 2 over 2 steps: pooled (2 + 2) / 6 + 1, mean (3 + 1 + 2) / 3
    c = acceptance_stats([1, 1], k=1)
    assert pooled.merge(c).tau == pytest.approx(1 + 4 / 6) and tau_prompt_mean([a, b, c]) == pytest.approx(2.0)


def test_tau_standard_error_counts_prompts_not_steps():
    """Prompt A: 1 step, tau 3; prompt B: 3 steps, tau 1. Pooled tau 1.5 = 6 tokens / 4 steps;
    z = emitted - 1.5 * steps = (3 - 1.5, 3 - 4.5) = (1.5, -1.5): var = 2/1 * 4.5 / 4^2."""
    a, b = acceptance_stats([2], k=2), acceptance_stats([0, 0, 0], k=2)
    assert tau_standard_error([a, b]) == pytest.approx((2 * 4.5) ** 0.5 / 4)
    assert tau_standard_error([a]) is None and tau_standard_error([]) is None
    same = [acceptance_stats([1, 0], k=1) for _ in range(5)]  # every prompt alike: no spread
    assert tau_standard_error(same) == pytest.approx(0.0)
    # more prompts of the same two kinds: the error shrinks as 1 / sqrt(prompts)
    many = tau_standard_error([a, b] * 50)
    assert many == pytest.approx((100 / 99 * 50 * 4.5) ** 0.5 / 200) and many < tau_standard_error([a, b]) / 5


# ---------------------------------------------------------------------- reports
def _report(tau=2.0, alpha=(0.8, 0.5, None), label=None):
    cat = {"num_prompts": 1, "tau": tau, "tau_prompt_mean": tau + 0.25, "alpha": list(alpha), "tokens_per_s": 10.0, "baseline_tokens_per_s": 5.0, "speedup": 2.0, "greedy_match": "1/1"}
    return {**cat, "num_prompts": 2, "label": label, "method": "chain", "k": 3, "drafter": "ngram", "data": "x.jsonl",
            "temperature": 0.0, "max_new_tokens": 8, "categories": {"writing": cat, "coding": {**cat, "alpha": [0.9]}}}


def test_write_report_json_markdown_png(tmp_path):
    from draftlab.inference.report import markdown_table, read_json, write_report

    out = tmp_path / "sub" / "eval.json"
    history = [_report(1.5, (0.5, 0.2, 0.1), "step 100"), _report(1.8, (0.6, 0.3, None), "step 200")]
    paths = write_report(_report(label="step 300"), out, history=history)
    assert read_json(paths["json"])["label"] == "step 300"
    md = paths["markdown"].read_text()
    assert "| all | 2 | 2.00 | 2.25 | 0.80 | 0.50 | - |" in md and "| coding |" in md and "| writing |" in md
    assert "| category | prompts | τ pooled over all steps (vLLM) ± 1 s.e. | τ mean of per-prompt τ (SpecForge) | α1 |" in md
    assert "| all | 2 | 1.50 ± 0.25 | - |" in markdown_table({"num_prompts": 2, "tau": 1.5, "tau_se": 0.25, "alpha": [0.5]})
    assert "| all | 2 | 1.50 | - |" in markdown_table({"num_prompts": 2, "tau": 1.5, "alpha": [0.5]})  # an older report
    assert paths["plot"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in out.parent.iterdir()) == ["eval.json", "eval.md", "eval.png"]  # no temp files left
    table = markdown_table(_report())
    assert table.count("\n") == 5  # header, rule, all + 2 categories


def test_write_report_to_unwritable_path_is_one_line_error(tmp_path):
    from draftlab.errors import DraftlabError
    from draftlab.inference.report import plot_alpha, write_report

    blocker = tmp_path / "file"
    blocker.write_text("")
    for write in (lambda p: write_report(_report(), p), lambda p: plot_alpha([_report()], p)):
        with pytest.raises(DraftlabError, match="cannot") as e:
            write(blocker / "sub" / "eval.json")  # a directory below a regular file
        assert str(blocker) in str(e.value) and "\n" not in str(e.value)


# ---------------------------------------------------------------------- prompt sets
def test_spec_bench_prompts_round_robin(tiny_llama, tmp_path, monkeypatch):
    """The `spec-bench` preset reads a file of Spec-Bench's form (here a small one of our own:
    the real questions are not shipped) and takes one prompt per category first."""
    from draftlab.inference.prompts import load_prompts

    categories = ["writing", "roleplay", "math", "coding", "translation", "summarization"]
    rows = [{"question_id": 10 * q + c, "category": cat, "turns": [f"Question {q} about {cat}?", "And then?"]}
            for q in range(3) for c, cat in enumerate(categories)]
    path = tmp_path / "spec_bench_questions.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.setenv("DRAFTLAB_SPEC_BENCH", str(path))
    prompts = load_prompts("spec-bench", tiny_llama.tokenizer, num_prompts=6)
    assert len(prompts) == 6
    assert len({p.category for p in prompts}) == 6  # one per category first
    tok = tiny_llama.tokenizer
    text = tok.decode(prompts[0].prompt_ids)
    assert text.startswith("<|im_start|>user\n") and text.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("env", [None, "missing.jsonl"], ids=["unset", "no-file"])
def test_spec_bench_without_its_file_is_a_one_line_error(tiny_llama, tmp_path, monkeypatch, env):
    """Spec-Bench comes from DRAFTLAB_SPEC_BENCH or --data PATH, never from a guessed folder."""
    from draftlab.inference.prompts import load_prompts

    monkeypatch.chdir(tmp_path)
    if env is None:
        monkeypatch.delenv("DRAFTLAB_SPEC_BENCH", raising=False)
    else:
        monkeypatch.setenv("DRAFTLAB_SPEC_BENCH", str(tmp_path / env))
    with pytest.raises(DraftlabError, match="DRAFTLAB_SPEC_BENCH") as e:
        load_prompts("spec-bench", tiny_llama.tokenizer, num_prompts=2)
    assert "\n" not in str(e.value) and ("--data PATH" in str(e.value)) == (env is None)


def test_humaneval_prompts(tiny_llama):
    from draftlab.inference.prompts import load_prompts

    prompts = load_prompts("humaneval", tiny_llama.tokenizer, num_prompts=2)
    assert [p.category for p in prompts] == ["humaneval", "humaneval"] and prompts[0].id == "HumanEval/0"
    assert "def " in tiny_llama.tokenizer.decode(prompts[0].prompt_ids)


def test_jsonl_prompt_files(tiny_llama, tmp_path):
    from draftlab.inference.prompts import load_prompts

    f = tmp_path / "mine.jsonl"
    rows = [
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
                      {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "again"}]},
        {"question_id": 7, "category": "math", "turns": ["What is 2 + 2?", "And 3 + 3?"]},
    ]
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    prompts = load_prompts(str(f), tiny_llama.tokenizer)
    assert [p.category for p in prompts] == ["mine", "math"] and prompts[1].id == "7"
    first = tiny_llama.tokenizer.decode(prompts[0].prompt_ids)
    assert "Be brief." in first and "Hi there" in first and "Hello!" not in first and "again" not in first
    assert "And 3 + 3" not in tiny_llama.tokenizer.decode(prompts[1].prompt_ids)

    bad = tmp_path / "bad.jsonl"
    for content, match in [("{not json\n", "bad.jsonl"), ('{"text": "x"}\n', "bad.jsonl:1"), ("", "no prompts"),
                           ('{"messages": [{"role": "assistant", "content": "x"}]}\n', "no user turn")]:
        bad.write_text(content)
        with pytest.raises(DraftlabError, match=match):
            load_prompts(str(bad), tiny_llama.tokenizer)
    with pytest.raises(DraftlabError, match="not found"):
        load_prompts(str(tmp_path / "missing.jsonl"), tiny_llama.tokenizer)
    with pytest.raises(DraftlabError, match="data must be"):
        load_prompts("wikitext", tiny_llama.tokenizer)


def test_sharegpt_heldout_prompts(tiny_llama, tmp_path):
    from draftlab.data.dataset import DataSpec
    from draftlab.inference.prompts import load_prompts

    f = tmp_path / "chats.jsonl"
    f.write_text("".join(
        json.dumps({"messages": [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer {i}"}]}) + "\n"
        for i in range(10)
    ))
    spec = DataSpec(source=str(f), heldout=3, seed=1)
    prompts = load_prompts("sharegpt-heldout", tiny_llama.tokenizer, data_spec=spec)
    assert len(prompts) == 3 and {p.category for p in prompts} == {"sharegpt"}
    from draftlab.data.chat import prompt_ids
    from draftlab.data.dataset import build_samples

    held = build_samples(spec, tiny_llama.tokenizer).heldout_conversations  # the data stage's own split
    assert [p.prompt_ids for p in prompts] == [prompt_ids(tiny_llama.tokenizer, c) for c in held]


# ---------------------------------------------------------------------- evaluate + CLI
def _prompt_file(tmp_path):
    f = tmp_path / "eval.jsonl"
    rows = [
        {"category": "code", "turns": ["def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n" * 2]},
        {"category": "chat", "turns": ["The quick brown fox jumps over the lazy dog."]},
        {"category": "code", "turns": ["print(add(2, 3)) print(add(2, 3))"]},
    ]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return f


def test_evaluate_report(tiny_llama, tmp_path):
    from draftlab.inference.evaluate import evaluate
    from draftlab.inference.ngram import NgramProposer
    from draftlab.inference.prompts import load_prompts
    from draftlab.inference.shapes import Chain, DynamicTree

    prompts = load_prompts(str(_prompt_file(tmp_path)), tiny_llama.tokenizer)
    rep = evaluate(tiny_llama, NgramProposer(), prompts, Chain(3), max_new_tokens=12, data="eval.jsonl")
    for key in ("tau", "a", "alpha", "tokens_per_s", "baseline_tokens_per_s", "speedup", "greedy_match", "draft_time_s",
                "verify_time_s", "method", "k", "num_prompts", "categories"):
        assert key in rep, key
    assert rep["greedy_match"] == "3/3" and rep["num_prompts"] == 3 and rep["method"] == "chain" and rep["k"] == 3
    assert set(rep["categories"]) == {"code", "chat"} and rep["categories"]["code"]["num_prompts"] == 2
    assert rep["categories"]["code"]["greedy_match"] == "2/2"
    assert len(rep["a"]) == 3 and rep["tau"] == pytest.approx(1 + sum(rep["a"]))
    steps = rep["num_steps"]
    assert rep["tau"] == pytest.approx((rep["num_accepted"] + steps) / steps)
    assert rep["speedup"] == pytest.approx(rep["tokens_per_s"] / rep["baseline_tokens_per_s"])
    cats = rep["categories"]
    assert sum(c["num_steps"] for c in cats.values()) == steps
    # SpecForge's tau: the mean of the per-prompt taus, per category too
    assert rep["tau_prompt_mean"] == pytest.approx(sum(p["tau"] for p in rep["prompts"]) / 3)
    code = [p["tau"] for p in rep["prompts"] if p["category"] == "code"]
    assert cats["code"]["tau_prompt_mean"] == pytest.approx(sum(code) / 2)
    assert set(TAU_LABELS) <= set(rep)
    json.dumps(rep)

    tree = evaluate(tiny_llama, NgramProposer(), prompts[:1], DynamicTree(3, 2, 8), max_new_tokens=8,
                    temperature=0.8, baseline=False)
    assert tree["tree"] == {"depth": 3, "top_k": 2, "total_tokens": 8} and tree["k"] is None
    assert tree["greedy_match"] is None and tree["speedup"] is None  # sampling, no baseline


def test_eval_cli(tiny_target_dirs, tmp_path, capsys):
    from draftlab.cli import main

    out = tmp_path / "rep" / "eval.json"
    argv = ["eval", "--drafter", "ngram", "--target", str(tiny_target_dirs["llama"]), "--data", str(_prompt_file(tmp_path)),
            "--method", "chain", "--k", "3", "--num-prompts", "2", "--max-new-tokens", "8", "--report", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "| all |" in printed and "| code |" in printed and "| chat |" in printed
    rep = json.loads(out.read_text())
    assert rep["num_prompts"] == 2 and rep["greedy_match"] == "2/2"
    assert out.with_suffix(".md").is_file() and out.with_suffix(".png").is_file()
    assert main(argv[:2] + [str(tmp_path / "nope")] + argv[3:]) == 2
    assert "no checkpoint directory" in capsys.readouterr().err
    assert main(argv[:-2] + ["--k", "0"]) == 2
    # the decoding options of a trained drafter: one-line errors where they cannot apply
    for bad, message in ((["--min-confidence", "0.2"], "not to 'ngram'"), (["--lookup-min-match", "2"], "not to 'ngram'"),
                         (["--ngram-min", "3", "--ngram-max", "2"], "need 1 <= min <= max")):
        capsys.readouterr()
        assert main(argv + bad) == 2
        assert message in capsys.readouterr().err


def test_generate_cli(tiny_target_dirs, capsys, monkeypatch):
    import io

    from draftlab.cli import main

    base = ["generate", "--drafter", "ngram", "--target", str(tiny_target_dirs["llama"]), "--max-new-tokens", "6"]
    assert main(base + ["--prompt", "Hello there", "--method", "tree", "--tree-depth", "3"]) == 0
    err = capsys.readouterr().err
    assert "6 tokens (length)" in err and "tau" in err and "tok/s" in err
    monkeypatch.setattr("sys.stdin", io.StringIO("first prompt\n\nsecond prompt\n"))
    assert main(base) == 0
    err = capsys.readouterr().err
    assert err.count("tokens (") == 2 and "session tau" in err
