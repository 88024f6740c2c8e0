"""bench.data_curve: two tiny points end to end through the CLI (offline capture, training, eval),
a rerun that skips them, --table-only, the slope fit and the one-line errors."""

import json
import math
import shutil
import sys

import pytest
import torch
import yaml

from bench import data_curve as curve
from bench import sections

from tests.tiny import tiny_eagle3_recipe

pytestmark = pytest.mark.usefixtures("one_thread")

TOKENS = "400,800"
CONVERSATIONS = 60


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The tiny eagle3 recipe (memory mode as the main job; no after-checkpoint report: the bench
    evaluates the last checkpoint) with 60 random chats in its source."""
    root = tmp_path_factory.mktemp("curve")
    return root, tiny_eagle3_recipe(root, CONVERSATIONS)


@pytest.fixture
def benchmarks(tmp_path, monkeypatch):
    monkeypatch.setattr(sections, "BENCHMARKS_PATH", tmp_path / "BENCHMARKS.md")
    monkeypatch.setattr(sections, "HISTORY_PATH", tmp_path / "HISTORY.md")
    return tmp_path / "BENCHMARKS.md"


def argv(setup, out, *more):
    root, recipe = setup
    return ["--recipe", str(recipe), "--tokens", TOKENS, "--out", str(out), "--num-prompts", "2", "--k", "2",
            "--max-new-tokens", "8", "--prompts-from", "30", *more]


@pytest.fixture(scope="module")
def ran(setup, tmp_path_factory):
    """The two points, run once for the module (BENCHMARKS.md left alone): the first point's
    capture, training and eval as the subprocesses a user runs, the second's through the same
    ``draftlab`` command lines in this process (half the start-up time)."""
    from draftlab.cli import main as cli_main

    out = tmp_path_factory.mktemp("out")
    commands = []
    real = curve.run_cli

    def run_cli(cmd):
        commands.append(cmd)
        assert cmd[:3] == [sys.executable, "-m", "draftlab.cli"]
        if not any("points/800" in c for c in cmd):
            return real(cmd)
        threads = torch.get_num_threads()
        try:
            return cli_main(cmd[3:])
        finally:
            torch.set_num_threads(threads)  # training sets its own

    with pytest.MonkeyPatch.context() as m:
        m.setattr(curve, "run_cli", run_cli)
        rc = curve.main(argv(setup, out, "--no-append"))
    assert [c[3] for c in commands] == ["capture", "train", "eval"] * 2
    return out, rc


def test_two_points_end_to_end(ran, capsys):
    out, rc = ran
    assert rc == 0
    plan = json.loads((out / "plan.json").read_text())
    prompts = [json.loads(line) for line in (out / "prompts.jsonl").read_text().splitlines()]
    assert len(prompts) == 2 and all(int(p["id"]) >= 30 and p["messages"][-1]["role"] == "user" for p in prompts)
    for tokens in (400, 800):
        d = out / "points" / str(tokens)
        point = json.loads((d / "point.json").read_text())
        assert point["tokens"] == tokens and point["training_tokens"] >= tokens
        assert point["conversations"] == plan[str(tokens)]["conversations"] <= 30
        assert point["capture"]["mode"] == "offline" and point["capture"]["storage_dtype"] == "bfloat16"
        manifest = json.loads((d / "capture" / "manifest.json").read_text())
        assert manifest["complete"] and manifest["storage_dtype"] == "bfloat16"
        assert manifest["num_samples"] == point["training_samples"]
        assert manifest["num_tokens"] == point["training_tokens"]
        assert point["epochs"] == 1 and point["ttt_steps"] == 1 and point["steps"] >= 1
        assert point["training_minutes"] > 0 and not math.isnan(point["training_minutes"])
        assert len(point["alpha"]) == 2 and len(point["se"]) == 3 and point["tau"] >= 1
        assert point["matched"] == point["prompts"] == 2  # lossless: greedy equals plain
        assert point["train_code"] and point["eval_code"] and point["date"]
        report = json.loads((d / "eval-k2.json").read_text())
        assert sorted(p["id"] for p in report["prompts"]) == sorted(p["id"] for p in prompts)  # the same prompts
    small = json.loads((out / "points" / "400" / "point.json").read_text())
    large = json.loads((out / "points" / "800" / "point.json").read_text())
    assert large["conversations"] > small["conversations"]


def test_table_lists_finished_points_with_slope_na(ran, setup, capsys, benchmarks):
    out, _ = ran
    assert curve.main(argv(setup, out, "--table-only")) == 0
    text = capsys.readouterr().out
    rows = [line for line in text.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(rows) == 2
    assert "Slope per doubling of training tokens" in text and "n/a (2 points" in text
    written = benchmarks.read_text()
    assert f"## {curve.TITLE}" in written and "python -m bench.data_curve" in written


def test_a_point_carried_from_an_earlier_table_is_named(ran, setup, tmp_path, capsys):
    out, _ = ran
    copy = tmp_path / "out"
    shutil.copytree(out, copy)
    carried = json.loads((copy / "points" / "400" / "point.json").read_text())
    carried["from_table"] = "BENCHMARKS.md, an earlier run"
    (copy / "points" / "400" / "point.json").write_text(json.dumps(carried))
    assert curve.main(argv(setup, copy, "--table-only", "--no-append")) == 0
    text = capsys.readouterr().out
    assert f"Points at {carried['training_tokens']:,} tokens: carried from BENCHMARKS.md, an earlier run" in text


def test_rerun_skips_finished_points(ran, setup, monkeypatch, capsys):
    out, _ = ran
    stamps = {t: (out / "points" / t / "point.json").stat().st_mtime_ns for t in ("400", "800")}

    def refuse(cmd):
        raise AssertionError(f"a finished point ran {cmd}")

    monkeypatch.setattr(curve, "run_cli", refuse)
    assert curve.main(argv(setup, out, "--no-append")) == 0
    assert curve.main(argv(setup, out, "--no-append", "--only", "400")) == 0
    text = capsys.readouterr().out
    assert "point 400: finished" in text and "point 800: finished" in text
    assert stamps == {t: (out / "points" / t / "point.json").stat().st_mtime_ns for t in ("400", "800")}


def test_table_only_with_nothing_finished_is_one_line(setup, tmp_path, capsys):
    assert curve.main(argv(setup, tmp_path / "empty", "--table-only")) == 1
    err = capsys.readouterr().err.strip()
    assert "no point is finished" in err and "\n" not in err


def test_out_of_another_setting_is_one_line(ran, setup, capsys):
    out, _ = ran
    assert curve.main([*argv(setup, out, "--table-only"), "--num-prompts", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("bench.data_curve: error: --out") and "num_prompts" in err and "\n" not in err


def test_slope_fit():
    b, se = curve.fit_slope([1, 2, 3, 4], [1.0, 1.1, 1.2, 1.3])
    assert b == pytest.approx(0.1) and se == pytest.approx(0.0, abs=1e-9)
    b, se = curve.fit_slope([1, 2, 3], [0.0, 1.0, 1.0])
    assert b == pytest.approx(0.5) and se == pytest.approx(math.sqrt((1 / 6) / 2))
    assert curve.fit_slope([1, 2], [0.0, 1.0]) == (1.0, None)


@pytest.mark.parametrize("more, message", [
    (["--tokens", "800,400"], "--tokens: expected increasing"),
    (["--tokens", "400,abc"], "--tokens: expected comma-separated"),
    (["--tokens", "0,400"], "--tokens: expected increasing"),
    (["--only", "500"], "--only 500: not among --tokens"),
    (["--k", "0"], "--k must be >= 1"),
    (["--num-prompts", "1"], "--num-prompts must be >= 2"),
    (["--bogus"], "unrecognized arguments"),
    (["data.num_conversations=5"], "override data.num_conversations=5: the bench sets"),
    (["--tokens", "400,10000000"], "--tokens 10000000: data.source"),
    (["--prompts-from", "5"], "--prompts-from 5: the largest point"),
    (["--prompts-from", "59"], "--prompts-from 59: data.source"),
])
def test_bad_input_is_one_line(setup, tmp_path, capsys, more, message):
    assert curve.main(argv(setup, tmp_path / "out", "--no-append", *more)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("bench.data_curve: error: ") and message in err and "\n" not in err, err


def test_recipe_of_another_family_is_one_line(setup, tmp_path, capsys):
    root, recipe = setup
    other = yaml.safe_load(recipe.read_text())
    other.update(algorithm="medusa", drafter={}, loss={})
    path = tmp_path / "medusa.yaml"
    path.write_text(yaml.safe_dump(other))
    assert curve.main(["--recipe", str(path), "--out", str(tmp_path / "out"), "--no-append"]) == 2
    err = capsys.readouterr().err.strip()
    assert "algorithm is 'medusa'" in err and "\n" not in err


def test_training_is_relaunched_until_its_last_step(setup, tmp_path, monkeypatch):
    """A launch stopped early (train.time_limit_minutes: exit 0 at an earlier step) is relaunched;
    a preempted one (exit 75) stops the bench with one line."""
    c = curve.Curve(curve.parse_args(argv(setup, tmp_path / "out")))
    entry = {"conversations": 9, "batches_per_epoch": 6}
    step = {"now": 0}
    launches = []

    def fake_run(cmd):
        launches.append(cmd)
        assert cmd[3] == "train" and "data.num_conversations=9" in cmd
        step["now"] = min(6, step["now"] + 4)
        return 0

    monkeypatch.setattr(curve, "run_cli", fake_run)
    monkeypatch.setattr(curve, "last_step", lambda run: step["now"])
    state = curve.run_training(c, 400, entry, tmp_path / "p", [])
    assert len(launches) == 2 and state["complete"] and state["steps"] == 6
    assert [(x["from_step"], x["to_step"]) for x in state["launches"]] == [(0, 4), (4, 6)]
    assert curve.run_training(c, 400, entry, tmp_path / "p", [])["complete"] and len(launches) == 2  # finished: no launch

    step["now"] = 0
    monkeypatch.setattr(curve, "run_cli", lambda cmd: 75)
    with pytest.raises(curve.DraftlabError, match="preempted at step 0/6; rerun") as e:
        curve.run_training(c, 400, entry, tmp_path / "q", [])
    assert "\n" not in str(e.value)
