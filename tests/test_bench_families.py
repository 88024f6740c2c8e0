"""bench/families.py and bench/batch.py without models: the runs' own files, tables and one-line errors."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import batch as batch_bench  # noqa: E402
import families  # noqa: E402


def _run(tmp_path, reports=True):
    run = tmp_path / "run"
    (run / "eval").mkdir(parents=True)
    records = [{"step": 1, "loss": 1.0, "elapsed_s": 30.0}, {"step": 2, "loss": 0.9, "elapsed_s": 60.0},
               {"step": 2, "eval_tau": 1.2, "eval_alpha": [0.2]}, {"step": 4, "loss": 0.8, "elapsed_s": 150.0}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if reports:
        for step, a in ((2, 0.2), (4, 0.3)):
            rep = {"step": step, "tau": 1 + a, "alpha": [a], "speedup": 1.0, "greedy_match": "2/2", "method": "chain",
                   "k": 1, "num_prompts": 2, "max_new_tokens": 12, "data": "sharegpt-heldout"}
            (run / "eval" / f"step-{step:07d}.json").write_text(json.dumps(rep))
        (run / "eval" / "latest.json").write_text("{}")
    return run


def test_curve_pairs_reports_with_training_minutes(tmp_path):
    run = _run(tmp_path)
    curve = families.acceptance_curve(run, families.elapsed_by_step(run))
    assert [(p["step"], p["train_min"], p["alpha1"]) for p in curve] == [(2, 1.0, 0.2), (4, 2.5, 0.3)]
    assert "chain k=1" in families.curve_table([{"algorithm": "eagle3", "name": "run", "curve": curve}])


@pytest.mark.parametrize("what, message", [("missing", "no such run directory"), ("no-reports", "no eval/step-"),
                                           ("no-checkpoint", "no checkpoint")])
def test_one_line_errors(tmp_path, capsys, what, message):
    run = tmp_path / "nope" if what == "missing" else _run(tmp_path, reports=what != "no-reports")
    assert families.main([str(run), "--quick"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("bench/families.py: error:") and message in err and "\n" not in err


def test_batch_tables_summarise_adaptive_and_noise():
    def entry(b, speedup, base):
        return {"batch_size": b, "speedup": speedup, "tokens_per_s": speedup * base, "baseline_tokens_per_s": base,
                "tau": 1.3, "decode_time_s": 1.0, "draft_s": 0.1, "verify_s": 0.8, "other_s": 0.1,
                "greedy_match": "4/4", "batched_vs_alone": "4/4"}

    results = {"ngram k=3": {"entries": [entry(1, 1.2, 20.0), entry(4, 0.7, 60.0)]},
               "eagle3 k=1": {"entries": [entry(1, 1.1, 22.0), entry(4, 0.8, 66.0)]},
               "eagle3 k=2": {"entries": [entry(1, 1.15, 21.0), entry(4, 0.6, 63.0)]},
               "eagle3 adaptive k<=2": {"entries": [dict(entry(1, 1.16, 20.0), draft_lengths={"2": 9}), entry(4, 0.99, 60.0)]}}
    text = batch_bench.tables(results, [1, 4])
    assert "| eagle3 adaptive k<=2 | 1.16× | 0.99× |" in text
    assert "below 1.00× at B = 4" in text and "B=1: 1.16× vs best fixed k=2 1.15×; B=4: 0.99× vs best fixed k=1 0.80×" in text
    assert "B=1: 20.0-22.0 tok/s (±5 %); B=4: 60.0-66.0 tok/s (±5 %)" in text
