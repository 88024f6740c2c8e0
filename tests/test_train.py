"""Recipe schema, CLI errors, kill-and-resume determinism, DDP with two processes, end to end."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from draftlab.errors import DraftlabError
from draftlab.recipe import load_recipe

REPO = Path(__file__).resolve().parent.parent
WORDS = "the quick brown fox jumps over lazy dog speculative decoding drafts tokens target verifies them hello".split()


@pytest.fixture(scope="module")
def chat_file(tmp_path_factory):
    import random

    rng = random.Random(0)
    path = tmp_path_factory.mktemp("data") / "chat.jsonl"
    with open(path, "w") as f:
        for _ in range(40):
            msgs = []
            for _ in range(2):
                msgs.append({"role": "user", "content": " ".join(rng.choices(WORDS, k=6))})
                msgs.append({"role": "assistant", "content": " ".join(rng.choices(WORDS, k=14))})
            f.write(json.dumps({"messages": msgs}) + "\n")
    return path


def write_recipe(tmp_path, target_dir, chat_file, algorithm="eagle3", **sections):
    recipe = {
        "algorithm": algorithm,
        "output_dir": str(tmp_path / "run"),
        "target": {"model": str(target_dir)},
        "data": {"source": str(chat_file), "max_length": 96, "heldout": 4},
        "drafter": {"draft_vocab_size": 64} if algorithm == "eagle3" else {},
        "loss": {"ttt_steps": 3} if algorithm == "eagle3" else {},
        "train": {"max_steps": 6, "batch_tokens": 384, "checkpoint_every": 2, "warmup_steps": 2, "lr": 1e-3},
        "eval": {"enabled": False},
    }
    for k, v in sections.items():
        recipe[k] = {**recipe.get(k, {}), **v} if isinstance(v, dict) else v
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def run_train(args, env=None, launcher=None, timeout=300, kill_after=None):
    """``train/eagle.py ARGS`` under ``launcher``; ``kill_after=N``: every process SIGKILLs itself
    right after the step-N checkpoint (tests/kill_after_checkpoint.py installs the trainer hook)."""
    killer = [str(REPO / "tests" / "kill_after_checkpoint.py"), str(kill_after)] if kill_after else []
    cmd = (launcher or [sys.executable]) + killer + [str(REPO / "train" / "eagle.py"), *map(str, args)]
    e = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(cmd, capture_output=True, text=True, env=e, timeout=timeout, cwd=REPO)


# ---------------------------------------------------------------- schema and errors
def test_every_shipped_recipe_validates():
    recipes = sorted((REPO / "recipes").glob("*.yaml"))
    assert len(recipes) >= 4
    for r in recipes:
        load_recipe(r)  # GPU recipes validate too, even though they cannot run here


@pytest.mark.parametrize(
    "mutate, message",
    [
        ({"train": {"lr": "fast"}}, "train.lr"),
        ({"train": {"bogus": 1}}, "train.bogus"),
        ({"drafter": {"draft_vocab": 3}}, "drafter.draft_vocab"),
        ({"loss": {"ttt_steps": 0}}, "loss.ttt_steps"),
        ({"algorithm": "eagle9"}, "algorithm: unknown drafter family"),
        ({"eval": {"batch_sizes": [4, 4]}}, "eval.batch_sizes"),
        ({"eval": {"baseline": False, "batch_sizes": [1, 4]}}, "eval.batch_sizes"),
        ({"eval": {"adaptive": True}}, "eval.adaptive"),
        ({"drafter": {"freeze_lm_head": True, "init_lm_head_from_target": False}}, "drafter: freeze_lm_head"),
    ],
)
def test_bad_recipe_is_one_line_error(tmp_path, tiny_target_dirs, chat_file, mutate, message):
    path = write_recipe(tmp_path, tiny_target_dirs["llama"], chat_file, **mutate)
    with pytest.raises(DraftlabError, match=message.replace(".", r"\.")):
        load_recipe(path)


def test_cli_errors_exit_2_without_traceback(tmp_path, tiny_target_dirs, chat_file):
    path = write_recipe(tmp_path, tiny_target_dirs["llama"], chat_file)
    for args, needle in [
        ([tmp_path / "missing.yaml"], "recipe file not found"),
        ([path, "train.max_steps=zero"], "train.max_steps"),
        ([path, "nonsense"], "dotted.key=value"),
        ([path, "data.source=/nope/x.jsonl"], "/nope/x.jsonl"),
    ]:
        res = run_train(args)
        assert res.returncode == 2, res.stderr
        err_lines = [l for l in res.stderr.strip().splitlines() if "error" in l]
        assert needle in err_lines[-1] and "Traceback" not in res.stderr


def test_dotted_overrides(tmp_path, tiny_target_dirs, chat_file):
    path = write_recipe(tmp_path, tiny_target_dirs["llama"], chat_file)
    r = load_recipe(path, ["train.max_steps=20", "output_dir=runs/x", "drafter.aux_layers=[1,2,3]"])
    assert r.train.max_steps == 20 and r.output_dir == "runs/x" and r.drafter["aux_layers"] == [1, 2, 3]


def test_frozen_lm_head_stays_the_targets_rows(tmp_path, tiny_target_dirs, chat_file):
    """drafter.freeze_lm_head: the trained drafter's lm_head is still the target's draft-vocab rows,
    and everything else trained."""
    from draftlab.models.target import Target

    path = write_recipe(tmp_path, tiny_target_dirs["llama"], chat_file, drafter={"freeze_lm_head": True})
    res = run_train([path, "train.max_steps=3"])
    assert res.returncode == 0, res.stderr[-2000:]
    w = load_file(str(tmp_path / "run" / "checkpoints" / "step-0000003" / "model.safetensors"))
    target = Target.load(str(tiny_target_dirs["llama"]))
    assert torch.equal(w["lm_head.weight"], target.lm_head.weight[w["t2d"]].float())
    assert not torch.equal(w["norm.weight"], target.final_norm.weight.float())  # the rest trained


@pytest.mark.slow  # ~1 min: regeneration, training and a k=3 report
def test_gpu_recipe_runs_on_cpu_with_small_overrides(tmp_path, tiny_target_dirs, chat_file):
    """recipes/smollm2-135m-eagle3-gpu.yaml end to end on the CPU, shrunk by overrides only:
    regeneration, 3 TTT steps, and its k=3 report with greedy output equal to plain decoding."""
    out = tmp_path / "run"
    res = run_train([REPO / "recipes" / "smollm2-135m-eagle3-gpu.yaml", f"output_dir={out}",
                     f"target.model={tiny_target_dirs['llama']}", f"data.source={chat_file}", "data.num_conversations=12",
                     "data.heldout=2", "data.max_length=96", "data.regenerate_max_new_tokens=8", "data.regenerate_batch_size=4",
                     "drafter.draft_vocab_size=64", "train.batch_tokens=384", "train.epochs=1", "train.warmup_steps=1",
                     "eval.num_prompts=2", "eval.max_new_tokens=8"], timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    assert (out / "regenerated.jsonl").is_file()
    report = json.loads((out / "eval" / "latest.json").read_text())
    assert report["k"] == 3 and report["greedy_match"] == "2/2" and len(report["alpha"]) == 3


# ---------------------------------------------------------------- resume after SIGKILL
# accumulation over 2 micro-batches resumes the most state; the others are the same path (-m slow)
@pytest.mark.parametrize("algorithm,grad_accum", [pytest.param("eagle1", 1, marks=pytest.mark.slow),
                                                  pytest.param("eagle3", 1, marks=pytest.mark.slow), ("eagle3", 2)])
def test_killed_run_resumes_to_identical_weights(tmp_path, tiny_target_dirs, chat_file, algorithm, grad_accum):
    ref_dir, killed_dir = tmp_path / "ref", tmp_path / "killed"
    ref_dir.mkdir()
    killed_dir.mkdir()
    train = {"grad_accum": grad_accum}
    ref = write_recipe(ref_dir, tiny_target_dirs["llama"], chat_file, algorithm, train=train)
    killed = write_recipe(killed_dir, tiny_target_dirs["llama"], chat_file, algorithm, train=train)
    res = run_train([ref])
    assert res.returncode == 0, res.stderr[-2000:]
    steps = [r for r in map(json.loads, (ref_dir / "run" / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 7))
    # a micro-batch holds at most batch_tokens (384) tokens: more per step means accumulation
    per_step = sum(r["tokens"] for r in steps) / len(steps)
    assert (per_step > 384) == (grad_accum > 1), per_step
    res = run_train([killed], kill_after=4)
    assert res.returncode == -9  # SIGKILL right after the step-4 checkpoint
    assert not (killed_dir / "run" / "checkpoints" / "step-0000006").exists()
    res = run_train([killed])
    assert res.returncode == 0, res.stderr[-2000:]
    assert "resumed from" in res.stdout and "step 4" in res.stdout
    a = load_file(ref_dir / "run" / "checkpoints" / "step-0000006" / "model.safetensors")
    b = load_file(killed_dir / "run" / "checkpoints" / "step-0000006" / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        assert (a[k] == b[k]).all(), k
    # keep_last=2: older checkpoints were pruned
    kept = sorted(p.name for p in (killed_dir / "run" / "checkpoints").glob("step-*"))
    assert kept == ["step-0000004", "step-0000006"]


def test_time_limit_stops_with_a_checkpoint_and_a_relaunch_completes(tmp_path, tiny_target_dirs, chat_file):
    """Out of time before the last step: checkpoint, ask for a relaunch. Out of time on the last
    step: the run is complete and says so, with no relaunch to ask for."""
    path = write_recipe(tmp_path, tiny_target_dirs["llama"], chat_file, train={"max_steps": 2, "time_limit_minutes": 1e-6})
    res = run_train([path])
    assert res.returncode == 0, res.stderr[-2000:]
    assert "stopped at step 1/2" in res.stdout and "relaunch the same command to continue" in res.stdout
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step-*")) == ["step-0000001"]
    res = run_train([path])  # resumes past the limit already: step 2 runs, then time is up on the last step
    assert res.returncode == 0, res.stderr[-2000:]
    assert "resumed from" in res.stdout and "training complete: step 2/2" in res.stdout
    assert "relaunch" not in res.stdout and "stopped at step" not in res.stdout
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step-*")) == ["step-0000001", "step-0000002"]


def test_time_limit_is_per_launch(tmp_path, tiny_target_dirs, chat_file):
    """A relaunch after a stop trains for the limit again: time trained by earlier launches (here
    written as an hour into the checkpoint) does not stop it after one step."""
    path = write_recipe(tmp_path, tiny_target_dirs["llama"], chat_file, train={"max_steps": 3})
    res = run_train([path, "train.max_steps=3", "train.time_limit_minutes=1e-6"])
    assert "stopped at step 1/3" in res.stdout, res.stdout[-2000:]
    state = tmp_path / "run" / "checkpoints" / "step-0000001" / "trainer" / "state.json"
    state.write_text(json.dumps({**json.loads(state.read_text()), "elapsed_s": 3600.0}))
    res = run_train([path, "train.time_limit_minutes=30"])
    assert res.returncode == 0 and "training complete: step 3/3" in res.stdout, res.stdout[-2000:]


# ---------------------------------------------------------------- DDP, two gloo processes
@pytest.mark.distributed
def test_ddp_two_processes_keep_weights_in_sync(tmp_path, tiny_target_dirs, chat_file):
    path = write_recipe(tmp_path, tiny_target_dirs["llama"], chat_file, train={"max_steps": 4})
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29533"]
    res = run_train([path], launcher=launcher)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "on 2 process(es)" in res.stdout  # a silent single-process run would say 1
    records = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["weights_in_sync"] for r in records if "weights_in_sync" in r] == [True]
    assert max(r["step"] for r in records) == 4


# ---------------------------------------------------------------- end to end with evaluation
def test_train_then_evaluate_end_to_end(tmp_path, tiny_target_dirs, chat_file):
    path = write_recipe(
        tmp_path, tiny_target_dirs["llama"], chat_file,
        train={"max_steps": 4, "checkpoint_every": 2},
        eval={"enabled": True, "num_prompts": 2, "max_new_tokens": 12, "k": 3, "batch_sizes": [1, 2]},
    )
    res = run_train([path])
    assert res.returncode == 0, res.stderr[-3000:]
    run = tmp_path / "run"
    report = json.loads((run / "eval" / "latest.json").read_text())
    assert report["step"] == 4 and len(report["alpha"]) == 3
    assert report["greedy_match"] == "2/2"  # speculative greedy output == plain greedy output
    assert [(e["batch_size"], e["greedy_match"]) for e in report["batches"]["entries"]] == [(1, "2/2"), (2, "2/2")]
    assert (run / "eval" / "latest.batch.png").is_file()
    assert (run / "eval" / "latest.png").is_file() and (run / "eval" / "latest.md").is_file()
    meta = json.loads((run / "checkpoints" / "step-0000004" / "draftlab.json").read_text())
    assert meta["metrics"]["eval"]["tau"] == report["tau"]
    assert (run / "checkpoints" / "best" / "model.safetensors").is_file()
    # the trained checkpoint under the dynamic decoding options, through the CLI
    ev = [sys.executable, "-m", "draftlab.cli", "eval", "--drafter", str(run / "checkpoints" / "best"), "--target",
          str(tiny_target_dirs["llama"]), "--data", "sharegpt-heldout", "--recipe", str(path), "--num-prompts", "2",
          "--max-new-tokens", "12", "--k", "3", "--min-confidence", "0.01", "--lookup-min-match", "2", "--report", str(tmp_path / "dyn.json")]
    res = subprocess.run(ev, capture_output=True, text=True, cwd=REPO, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    dyn = json.loads((tmp_path / "dyn.json").read_text())
    assert dyn["drafter"] == "lookup+eagle3" and dyn["greedy_match"] == "2/2"
    res = subprocess.run(ev + ["--method", "tree"], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert res.returncode == 2 and "use --method chain" in res.stderr and "Traceback" not in res.stderr


# ---------------------------------------------------------------- offline capture feeds training
def test_offline_capture_trains_like_online(tmp_path, tiny_target_dirs, chat_file):
    """fp32 shards written by `draftlab capture` give the same weights as online capture."""
    target = tiny_target_dirs["llama"]
    cap = tmp_path / "cap"
    res = subprocess.run(
        [sys.executable, "-m", "draftlab.cli", "capture", "--target", str(target), "--data", str(chat_file),
         "--max-length", "96", "--heldout", "4", "--seed", "0", "--layers", "eagle3", "--dtype", "float32", "--out", str(cap)],
        capture_output=True, text=True, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    online_dir, offline_dir = tmp_path / "online", tmp_path / "offline"
    online_dir.mkdir()
    offline_dir.mkdir()
    runs = [
        write_recipe(online_dir, target, chat_file, train={"max_steps": 3}),
        write_recipe(offline_dir, target, chat_file, train={"max_steps": 3}, capture={"mode": "offline", "offline_dir": str(cap)}),
    ]
    for r in runs:
        res = run_train([r])
        assert res.returncode == 0, res.stderr[-2000:]
    a = load_file(online_dir / "run" / "checkpoints" / "step-0000003" / "model.safetensors")
    b = load_file(offline_dir / "run" / "checkpoints" / "step-0000003" / "model.safetensors")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6)


def test_memory_capture_trains_like_online(tmp_path, tiny_target_dirs, chat_file):
    """capture.mode memory (hidden states and the target's argmax cached in epoch 1, reused in
    epoch 2) gives the weights of a run whose target runs every step."""
    target = tiny_target_dirs["llama"]
    dirs = {mode: tmp_path / mode for mode in ("online", "memory")}
    for mode, d in dirs.items():
        d.mkdir()
        r = write_recipe(d, target, chat_file, train={"max_steps": None, "epochs": 2, "checkpoint_every": 100}, capture={"mode": mode})
        res = run_train([r])
        assert res.returncode == 0, res.stderr[-2000:]
    ckpts = [sorted((d / "run" / "checkpoints").glob("step-*"))[-1] for d in dirs.values()]
    assert ckpts[0].name == ckpts[1].name and int(ckpts[0].name.split("-")[1]) >= 4  # two epochs of steps
    a, b = (load_file(c / "model.safetensors") for c in ckpts)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-5)
