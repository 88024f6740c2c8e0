"""bench/families.py without models: the runs' own files and its one-line errors."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
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
