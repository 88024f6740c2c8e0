"""Faults while a run trains (issue 50): preemption by a signal, a non-finite step, a second launch
into a live run's folder, a rank that dies without a word, a disk that fills mid-checkpoint.
Each stops the run with one line, leaves only whole checkpoints of finite weights, and a relaunch
of the same command resumes."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from draftlab import atomic
from draftlab import checkpoint as ckpt
from draftlab.cli import main as cli_main
from draftlab.data.features import FeatureSource
from draftlab.errors import DraftlabError
from draftlab.train import hooks, process_identity, run_lock
from draftlab.train.preemption import EXIT_PREEMPTED
from test_resume_and_writes import _full_disk, _leftovers, _one_line, _train
from test_train import REPO, chat_file, write_recipe  # noqa: F401  (chat_file: a fixture)

STEPS = 6  # checkpoints every 2 steps (write_recipe)
MAIN_JOB = {"mode": "memory"}  # the main job's feature source: features kept in RAM after the first epoch's capture


def _launch(recipe, fault: str, step: int, rank: str = "all", launcher=None, timeout=300, overrides=()):
    """``train/eagle.py RECIPE`` with ``tests/fault_at_step.py FAULT STEP RANK`` in its place."""
    cmd = (launcher or [sys.executable]) + [str(REPO / "tests" / "fault_at_step.py"), fault, str(step), rank,
                                            str(REPO / "train" / "eagle.py"), str(recipe), *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=REPO)


def _accelerate(port: int) -> list[str]:
    return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--main_process_port", str(port)]


def _steps(run: Path) -> list[str]:
    return [p.name for p in ckpt.list_checkpoints(run)]


def _all_finite(run: Path) -> None:
    for f in sorted(run.rglob(ckpt.WEIGHTS)):
        for name, t in load_file(f).items():
            assert not t.is_floating_point() or torch.isfinite(t).all(), (f, name)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_target_dirs, chat_file):  # noqa: F811
    """An uninterrupted single-process run of STEPS steps: its final checkpoint and weights."""
    root = tmp_path_factory.mktemp("reference")
    assert cli_main(["train", str(write_recipe(root, tiny_target_dirs["llama"], chat_file, capture=MAIN_JOB))]) == 0
    final = ckpt.step_dir(root / "run", STEPS)
    return {"dir": final, "weights": load_file(final / ckpt.WEIGHTS)}


def _same_weights(run: Path, reference: dict) -> None:
    final, ref = load_file(ckpt.step_dir(run, STEPS) / ckpt.WEIGHTS), reference["weights"]
    assert final.keys() == ref.keys()
    for k in final:
        assert torch.equal(final[k], ref[k]), k


# ---------------------------------------------------------------------- preemption
def test_sigterm_checkpoints_the_step_and_a_relaunch_ends_bitwise(tmp_path, tiny_target_dirs, chat_file, reference, capsys):  # noqa: F811
    """SIGTERM lands after step 2: step 3 is finished and checkpointed (not a periodic checkpoint),
    the process exits 75 with one line; the relaunch resumes at step 3 and ends bitwise equal."""
    recipe = write_recipe(tmp_path, tiny_target_dirs["llama"], chat_file, capture=MAIN_JOB)
    res = _launch(recipe, "SIGTERM", 2)
    assert res.returncode == EXIT_PREEMPTED, res.stderr[-3000:]
    run = tmp_path / "run"
    lines = [l for l in res.stderr.splitlines() if "preempted" in l]
    assert "Traceback" not in res.stderr and lines == [
        f"preempted by SIGTERM at step 3/{STEPS}: checkpoint {ckpt.step_dir(run, 3)} written; relaunch the same command to resume "
        f"(exit status {EXIT_PREEMPTED})"], res.stderr[-3000:]
    assert _steps(run) == ["step-0000002", "step-0000003"] and _leftovers(run) == []
    assert not (run / run_lock.LOCK).exists()
    capsys.readouterr()
    assert cli_main(["train", str(recipe)]) == 0
    assert f"resumed from {ckpt.step_dir(run, 3)}" in capsys.readouterr().out
    _same_weights(run, reference)


@pytest.fixture()
def send_after(monkeypatch):
    """``send_after(step, sig)``: this process gets ``sig`` once ``step`` is done. Until the test
    ends, a handler of the test's own notes the signal should the trainer leave it alone (the
    default action would end the test session)."""
    noted = []
    previous = {sig: signal.signal(sig, lambda signum, frame: noted.append(signum)) for sig in (signal.SIGTERM, signal.SIGUSR2)}

    def send(step, sig):
        monkeypatch.setattr(hooks, "after_step", [lambda trainer: trainer.step == step and os.kill(os.getpid(), sig)])
        return noted

    yield send
    for sig, handler in previous.items():
        signal.signal(sig, handler)


def test_the_preemption_signals_are_configurable(tmp_path, tiny_target_dirs, chat_file, reference, capsys, send_after):  # noqa: F811
    """``train.preempt_signals: [SIGUSR2]``: that signal preempts (exit 75, in one line); SIGTERM is left alone."""
    recipe = write_recipe(tmp_path, tiny_target_dirs["llama"], chat_file, capture=MAIN_JOB, train={"preempt_signals": ["SIGUSR2"]})
    noted = send_after(2, signal.SIGUSR2)
    capsys.readouterr()
    assert cli_main(["train", str(recipe)]) == EXIT_PREEMPTED
    assert noted == [] and f"preempted by SIGUSR2 at step 3/{STEPS}" in capsys.readouterr().err
    noted = send_after(4, signal.SIGTERM)
    assert cli_main(["train", str(recipe)]) == 0
    assert noted == [signal.SIGTERM]  # reached the handler that was there before the run
    _same_weights(tmp_path / "run", reference)


def test_preempt_signals_must_be_catchable(tmp_path, tiny_target_dirs, chat_file, capsys):  # noqa: F811
    recipe = write_recipe(tmp_path, tiny_target_dirs["llama"], chat_file, train={"preempt_signals": ["SIGKILL"]})
    _one_line(*_train(recipe, capsys), "train.preempt_signals", "'SIGKILL' is not a signal a process can catch")


# ---------------------------------------------------------------------- non-finite steps
@pytest.fixture()
def nan_after(monkeypatch):
    """``nan_after(n, ...)``: the target features of the step after step ``n`` are NaN (as tests/fault_at_step.py does)."""
    done = {"step": None}
    real = FeatureSource.features

    def features(self, indices, batch):
        hidden, batch = real(self, indices, batch)
        if done["step"] in done.get("poisoned", ()):
            hidden = {layer: h * float("nan") for layer, h in hidden.items()}
        return hidden, batch

    monkeypatch.setattr(FeatureSource, "features", features)
    monkeypatch.setattr(hooks, "after_step", [lambda trainer: done.update(step=trainer.step)])
    return lambda *steps: done.update(poisoned=steps, step=None)  # None: before a (re)launch's first step


def test_a_nan_loss_stops_before_the_optimizer_step(tmp_path, tiny_target_dirs, chat_file, capsys, nan_after):  # noqa: F811
    recipe = write_recipe(tmp_path, tiny_target_dirs["llama"], chat_file)
    nan_after(3)
    line = _one_line(*_train(recipe, capsys), "step 4: non-finite loss (nan) on process 0, micro-batch of training samples [",
                     "last checkpoint: step-0000002", "train.skip_nonfinite=N")
    assert "gradient norm (nan)" in line
    run = tmp_path / "run"
    assert _steps(run) == ["step-0000002"] and _leftovers(run) == []
    _all_finite(run)
    assert max(r["step"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())) == 3


def test_skip_nonfinite_skips_and_logs_up_to_n_steps(tmp_path, tiny_target_dirs, chat_file, capsys, nan_after):  # noqa: F811
    recipe = write_recipe(tmp_path, tiny_target_dirs["llama"], chat_file, train={"skip_nonfinite": 1})
    nan_after(1, 3)  # steps 2 and 4: one more than allowed
    line = _one_line(*_train(recipe, capsys), "step 4: non-finite loss", "after 1 skipped (train.skip_nonfinite)")
    run = tmp_path / "run"
    records = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "skipped_nonfinite" in r] == [2] and "loss" not in records[1], line
    assert json.loads((ckpt.step_dir(run, 2) / "trainer" / ckpt.STATE).read_text())["skipped_nonfinite"] == 1
    _all_finite(run)
    # the same recipe allowing two: the relaunch replays step 4 from the step-2 checkpoint, skips it, and finishes
    recipe = write_recipe(tmp_path, tiny_target_dirs["llama"], chat_file, train={"skip_nonfinite": 2})
    nan_after(1, 3)
    capsys.readouterr()
    assert cli_main(["train", str(recipe)]) == 0
    assert "step 4: non-finite loss" in capsys.readouterr().out
    assert _steps(run)[-1] == "step-0000006"
    _all_finite(run)


@pytest.mark.distributed
@pytest.mark.slow
def test_skip_nonfinite_is_refused_under_deepspeed(tmp_path, tiny_target_dirs, chat_file):  # noqa: F811
    from test_distributed_backends import accelerate_launch
    from test_train import run_train

    pytest.importorskip("deepspeed")
    recipe = write_recipe(tmp_path, tiny_target_dirs["llama"], chat_file, train={"skip_nonfinite": 1})
    res = run_train([recipe], launcher=accelerate_launch("deepspeed_zero2_cpu.yaml", 29655), timeout=600)
    assert res.returncode != 0 and "train.skip_nonfinite: DeepSpeed steps its optimizer inside backward" in res.stderr


# ---------------------------------------------------------------------- one run per folder
def test_a_second_launch_into_a_live_run_is_refused(tmp_path, tiny_target_dirs, chat_file, capsys, monkeypatch):  # noqa: F811
    """While this process trains (between its first two steps), ``train/eagle.py`` into the same folder."""
    from test_train import run_train

    recipe = write_recipe(tmp_path, tiny_target_dirs["llama"], chat_file)
    second = []
    monkeypatch.setattr(hooks, "after_step", [lambda trainer: trainer.step == 1 and second.append(run_train([recipe]))])
    rc, err = _train(recipe, capsys)
    assert rc == 0, err[-3000:]  # the first run ends normally
    res, run = second[0], tmp_path / "run"
    line = _one_line(res.returncode, res.stderr, f"output_dir {run} is in use by another run",
                     f"pid {os.getpid()} on host {socket.gethostname()}", "wait for it to end or use another output_dir")
    assert line.startswith("train/eagle.py: error:")
    assert _steps(run)[-1] == "step-0000006" and not (run / run_lock.LOCK).exists()


def test_a_lock_left_by_a_killed_run_is_taken_over(tmp_path):
    run = tmp_path / "run"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (run / run_lock.LOCK).parent.mkdir()
    (run / run_lock.LOCK).write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname(), "started": time.time() - 5}))
    with run_lock.held(run) as path:
        assert json.loads(path.read_text())["pid"] == os.getpid()
        with pytest.raises(DraftlabError, match=f"is in use by another run \\(pid {os.getpid()} on host"):
            run_lock.acquire(run)
    assert not (run / run_lock.LOCK).exists()
    # a live process whose pid a killed run's lock names (the pid reused): its start time tells them apart
    (run / run_lock.LOCK).write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": 1.0}))
    run_lock.release(run_lock.acquire(run))


def test_a_lock_from_another_host_says_how_to_remove_it(tmp_path):
    (tmp_path / run_lock.LOCK).write_text(json.dumps({"pid": 1, "host": "elsewhere", "started": 1.0}))
    with pytest.raises(DraftlabError) as e:
        run_lock.acquire(tmp_path)
    assert str(e.value) == (f"output_dir {tmp_path} is in use by another run (pid 1 on host elsewhere); if that run has ended, "
                            f"delete {tmp_path / run_lock.LOCK} and relaunch")


# ---------------------------------------------------------------------- all-or-nothing checkpoints
class _Report:
    """In place of the after-checkpoint evaluation: a report whose tau grows with the step, so each
    checkpoint becomes ``best``."""

    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, checkpoint_dir):
        return {"tau": 1 + int(checkpoint_dir.name.split("-")[-1]) / 10, "alpha": [0.5], "num_prompts": 1}


def test_a_full_disk_mid_checkpoint_keeps_the_last_one_and_best(tmp_path, tiny_target_dirs, tiny_llama, chat_file,  # noqa: F811
                                                                 capsys, monkeypatch):
    """keep_last 1: the step-4 checkpoint fails; step 2 (which only a finished step 4 may prune) and
    ``best`` stay as they were, and the run resumes from them."""
    recipe = write_recipe(tmp_path, tiny_target_dirs["llama"], chat_file, train={"max_steps": 4, "keep_last": 1},
                          eval={"enabled": True})
    monkeypatch.setattr("draftlab.train.evaluation.CheckpointEvaluator", _Report)
    run = tmp_path / "run"
    kept = {}

    def snapshot(trainer):  # after step 3: step 2 is checkpointed and evaluated (best made, its tau in draftlab.json)
        if trainer.step == 3:
            kept.update({p: p.read_bytes() for p in run.joinpath("checkpoints").rglob("*") if p.is_file()})

    monkeypatch.setattr(hooks, "after_step", [snapshot])
    real_write = atomic._write_all
    _full_disk(monkeypatch, lambda p: p.name == ckpt.WEIGHTS and ".staging-0000004" in str(p))
    _one_line(*_train(recipe, capsys), str(ckpt.step_dir(run, 4) / ckpt.WEIGHTS), "No space left on device")
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["best", "step-0000002"] and _leftovers(run) == []
    assert {p: p.read_bytes() for p in run.joinpath("checkpoints").rglob("*") if p.is_file()} == kept
    ckpt.load_drafter(run / "checkpoints" / "best", tiny_llama)
    monkeypatch.setattr(atomic, "_write_all", real_write)
    rc, err = _train(recipe, capsys)
    assert rc == 0, err[-2000:]
    assert _steps(run) == ["step-0000004"]  # keep_last 1: step 2 goes once step 4 is whole
    assert json.loads((run / "checkpoints" / "best" / ckpt.META).read_text())["step"] == 4


def test_a_best_replaced_halfway_is_put_back(tmp_path):
    """Killed between publish's two renames: ``best`` is gone and ``.old-best`` holds it; the next start puts it back."""
    d = tmp_path / "checkpoints"
    atomic.write_text(d / ".old-best" / "model.safetensors", "old")
    atomic.restore_replaced(d / ".old-best")
    assert (d / "best" / "model.safetensors").read_text() == "old" and not (d / ".old-best").exists()
    atomic.write_text(d / ".old-best" / "model.safetensors", "older")  # best was replaced: the old one just goes
    atomic.restore_replaced(d / ".old-best")
    assert (d / "best" / "model.safetensors").read_text() == "old" and not (d / ".old-best").exists()


def test_a_tmpfs_that_fills_during_a_checkpoint(tmp_path, tiny_target_dirs, tiny_llama, chat_file, reference, capsys):  # noqa: F811
    """A real file system that runs out of room while step 4's checkpoint is written: one line, the
    step-2 checkpoint loads, and the run resumes from it once there is room."""
    disk = tmp_path / "disk"
    disk.mkdir()
    # room for the run's logs and one checkpoint (as large as the reference run's), not two
    size = sum(p.stat().st_size for p in reference["dir"].rglob("*") if p.is_file())
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={int(size * 1.5)}", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        recipe = write_recipe(tmp_path, tiny_target_dirs["llama"], chat_file, train={"max_steps": 4, "keep_last": 1},
                              output_dir=str(disk / "run"))
        _one_line(*_train(recipe, capsys), "step-0000004", "No space left on device")
        run = disk / "run"
        assert _steps(run) == ["step-0000002"] and _leftovers(run) == []
        ckpt.load_drafter(ckpt.step_dir(run, 2), tiny_llama)
        subprocess.run(["mount", "-o", f"remount,size={size * 4}", str(disk)], check=True)
        capsys.readouterr()
        assert cli_main(["train", str(recipe)]) == 0
        assert "resumed from" in capsys.readouterr().out
        assert _steps(run) == ["step-0000004"]
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)


# ---------------------------------------------------------------------- several processes
@pytest.mark.distributed
@pytest.mark.slow
def test_a_signal_to_one_rank_stops_every_rank_at_one_step(tmp_path, tiny_target_dirs, chat_file):  # noqa: F811
    recipe = write_recipe(tmp_path, tiny_target_dirs["llama"], chat_file)
    res = _launch(recipe, "SIGTERM", 2, "1", launcher=_accelerate(29660))
    assert res.returncode != 0
    lines = [l for l in res.stderr.splitlines() if l.startswith("preempted")]
    assert lines == [f"preempted by SIGTERM (to process 1) at step 3/{STEPS}: checkpoint {ckpt.step_dir(tmp_path / 'run', 3)} "
                     f"written; relaunch the same command to resume (exit status {EXIT_PREEMPTED})"], res.stderr[-3000:]
    assert "exitcode  : 75" in res.stderr  # both processes (the launcher names the first)
    assert _steps(tmp_path / "run") == ["step-0000002", "step-0000003"]
    res = _launch(recipe, "none", 0, launcher=_accelerate(29661))
    assert res.returncode == 0, res.stderr[-3000:]
    assert "step 3" in next(l for l in res.stdout.splitlines() if l.startswith("resumed from"))


@pytest.mark.distributed
@pytest.mark.slow
def test_a_nan_on_one_rank_stops_every_rank(tmp_path, tiny_target_dirs, chat_file):  # noqa: F811
    recipe = write_recipe(tmp_path, tiny_target_dirs["llama"], chat_file)
    res = _launch(recipe, "nan", 3, "1", launcher=_accelerate(29662))
    errors = re.findall(r"train/eagle\.py: error: ([^\r\n]*)", res.stderr)
    assert res.returncode != 0 and len(errors) == 2, res.stderr[-3000:]
    assert all(e.startswith("step 4: non-finite loss (nan) on process 1, micro-batch") for e in errors), errors
    assert _steps(tmp_path / "run") == ["step-0000002"]
    _all_finite(tmp_path / "run")


def test_the_dead_rank_watch_reads_heartbeats(tmp_path, monkeypatch):
    """Process 1 on this host: dead once its process is gone, unless it removed its heartbeat (left
    normally). On another host: dead once its heartbeat has not been touched for STALE_S."""
    from draftlab.train import dead_ranks

    watch = dead_ranks.DeadRankWatch(tmp_path, 0, 2, "draftlab train")
    beat = tmp_path / ".ranks" / "rank-1.json"
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    atomic.write_json(beat, process_identity.me())  # this process: alive
    assert watch.dead() is None
    atomic.write_json(beat, {"pid": gone.pid, "host": socket.gethostname(), "started": time.time()})
    assert watch.dead() == f"process 1 (pid {gone.pid} on host {socket.gethostname()}) died without an error (killed?)"
    beat.unlink()
    assert watch.dead() is None
    clock = [1000.0]
    monkeypatch.setattr(dead_ranks.time, "monotonic", lambda: clock[0])
    atomic.write_json(beat, {"pid": 1, "host": "elsewhere", "started": 1.0})
    assert watch.dead() is None  # first seen now
    clock[0] += dead_ranks.STALE_S - 1
    os.utime(beat, ns=(1, 1))  # touched: alive, and seen to change now
    assert watch.dead() is None
    clock[0] += dead_ranks.STALE_S - 1
    assert watch.dead() is None
    clock[0] += 2
    assert watch.dead() == "process 1 (pid 1 on host elsewhere) died without an error (killed?)"


@pytest.mark.distributed
def test_a_killed_rank_stops_the_other_within_a_minute(tmp_path, tiny_target_dirs, tiny_llama, chat_file):  # noqa: F811
    """SIGKILL of process 1 after step 3: process 0 leaves with one line naming it, well before any
    collective timeout, and leaves the step-2 checkpoint whole to resume from (as after any kill)."""
    recipe = write_recipe(tmp_path, tiny_target_dirs["llama"], chat_file)
    res = _launch(recipe, "SIGKILL", 3, "1", launcher=_accelerate(29664), timeout=240)
    killed_at = float(re.search(r"fault_at_step: SIGKILL at ([\d.]+)", res.stderr).group(1))
    assert res.returncode != 0 and time.time() - killed_at < 60, res.stderr[-3000:]
    errors = re.findall(r"train/eagle\.py: error: ([^\r\n]*)", res.stderr)
    assert len(errors) == 1 and re.match(r"process 1 \(pid \d+ on host .+\) died without an error \(killed\?\): every process "
                                         r"stops; relaunch the same command to resume from the last checkpoint$", errors[0]), res.stderr[-3000:]
    assert "[rank0]: Traceback" not in res.stderr
    run = tmp_path / "run"
    assert _steps(run) == ["step-0000002"] and _leftovers(run) == []
    ckpt.load_drafter(ckpt.step_dir(run, 2), tiny_llama)
    assert not (run / run_lock.LOCK).exists()  # process 0 gave the lock back before it left
