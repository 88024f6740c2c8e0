"""Resume state is validated, and every write goes through draftlab.atomic: a damaged trainer file,
a full disk or an unwritable directory is a one-line error naming the path (exit code 2, no
traceback), and leaves nothing half-written behind."""

from __future__ import annotations

import errno
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from draftlab import atomic
from draftlab.cli import main as cli_main
from draftlab.errors import DraftlabError
from draftlab.export.exporter import export_checkpoint
from test_checkpoint_io import checkpoint  # noqa: F401  (a fixture: a tiny EAGLE-3 checkpoint)
from test_train import chat_file, run_train, write_recipe  # noqa: F401  (chat_file: a fixture)

STEP = "step-0000002"


# ---------------------------------------------------------------------- helpers
def _train(recipe, capsys) -> tuple[int, str]:
    """``draftlab train RECIPE`` in this process: (exit code, stderr)."""
    capsys.readouterr()
    rc = cli_main(["train", str(recipe)])
    return rc, capsys.readouterr().err


def _one_line(rc: int, err: str, *needles: str) -> str:
    """Exit code 2 and one error line (naming ``needles``), no traceback."""
    lines = [l for l in err.strip().splitlines() if "error" in l]
    assert rc == 2, err[-2000:]
    assert "Traceback" not in err and len(lines) == 1, err[-2000:]
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


def _leftovers(root: Path) -> list[str]:
    """Temporary files and staging directories anywhere below ``root``."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")
                  if p.name.endswith(".tmp") or p.name.startswith((".staging-", ".tmp-", ".old-")))


def _full_disk(monkeypatch, when=lambda path: True):
    """The one low-level write in draftlab.atomic fails as a full disk does, for paths ``when`` accepts."""
    real = atomic._write_all
    hit = []

    def write(fd, data, path):
        if when(Path(path)):
            hit.append(Path(path))
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data, path)

    monkeypatch.setattr(atomic, "_write_all", write)
    return hit


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_target_dirs, chat_file):  # noqa: F811
    """A finished two-step run with its step-2 checkpoint (trained once for the module)."""
    root = tmp_path_factory.mktemp("trained")
    recipe = write_recipe(root, tiny_target_dirs["llama"], chat_file, train={"max_steps": 2})
    assert cli_main(["train", str(recipe)]) == 0
    assert (root / "run" / "checkpoints" / STEP / "trainer" / "state.json").is_file()
    return root / "run"


@pytest.fixture()
def resumable(trained, tmp_path, tiny_target_dirs, chat_file):  # noqa: F811
    """(recipe, trainer dir) of a copy of the trained run, for a test to damage."""
    shutil.copytree(trained, tmp_path / "run")
    recipe = write_recipe(tmp_path, tiny_target_dirs["llama"], chat_file, train={"max_steps": 2})
    return recipe, tmp_path / "run" / "checkpoints" / STEP / "trainer"


# ---------------------------------------------------------------------- resume state
def _edit_json(path: Path, edit) -> None:
    obj = json.loads(path.read_text())
    edit(obj)
    path.write_text(json.dumps(obj))


BAD_STATES = {
    "not JSON": (lambda p: p.write_text("{\"step\": 2, "), "invalid JSON"),
    "not an object": (lambda p: p.write_text("[2]"), "expected a JSON object"),
    "no fingerprint": (lambda p: _edit_json(p, lambda s: s.pop("fingerprint")), "field 'fingerprint' is missing"),
    "step a string": (lambda p: _edit_json(p, lambda s: s.update(step="2")), "field 'step' must be an integer"),
    "step a float": (lambda p: _edit_json(p, lambda s: s.update(step=2.5)), "field 'step' must be an integer"),
    "step negative": (lambda p: _edit_json(p, lambda s: s.update(step=-1)), "field 'step' must not be negative"),
    "step of another checkpoint": (lambda p: _edit_json(p, lambda s: s.update(step=7)), "does not match"),
    "world size a bool": (lambda p: _edit_json(p, lambda s: s.update(world_size=True)), "field 'world_size' must be an integer"),
    "elapsed null": (lambda p: _edit_json(p, lambda s: s.update(elapsed_s=None)), "field 'elapsed_s' must be"),
    "layout a number": (lambda p: _edit_json(p, lambda s: s.update(optimizer_layout=3)), "field 'optimizer_layout'"),
    "best tau a string": (lambda p: _edit_json(p, lambda s: s.update(best_tau="1.5")), "field 'best_tau'"),
}


def test_an_intact_copy_resumes(resumable, capsys):
    recipe, _ = resumable
    rc, err = _train(recipe, capsys)
    assert rc == 0, err[-2000:]


@pytest.mark.parametrize("case", sorted(BAD_STATES))
def test_a_damaged_trainer_state_is_one_line_error(case, resumable, capsys):
    recipe, trainer = resumable
    damage, message = BAD_STATES[case]
    damage(trainer / "state.json")
    _one_line(*_train(recipe, capsys), str(trainer / "state.json"), message)


class _RunsCode:
    """Unpickling this calls a function: what torch.load(weights_only=True) must refuse."""

    def __reduce__(self):
        return (os.getcwd, ())


def test_an_optimizer_file_with_code_is_refused_in_one_line(resumable, capsys):
    recipe, trainer = resumable
    torch.save({"optimizer": _RunsCode(), "scheduler": {}}, trainer / "optimizer.pt")
    line = _one_line(*_train(recipe, capsys), str(trainer / "optimizer.pt"), "weights_only")
    assert "getcwd" in line


BAD_OPTIMIZERS = {
    "garbage": (lambda p: p.write_bytes(b"\x00not a torch file" * 8), "not a readable optimizer state"),
    "truncated": (lambda p: p.write_bytes(p.read_bytes()[:200]), "not a readable optimizer state"),
    "missing": (lambda p: p.unlink(), "missing"),
    "a list": (lambda p: torch.save([1, 2], p), "not an optimizer state"),
    "no scheduler": (lambda p: torch.save({"optimizer": torch.load(p, weights_only=True)["optimizer"]}, p), "not an optimizer state"),
    "moments of another shape": (
        lambda p: torch.save(_mutate(torch.load(p, weights_only=True), lambda s: s["optimizer"]["state"][0].update(
            exp_avg=torch.zeros(3), exp_avg_sq=torch.zeros(3))), p), "of shape (3,)"),
    "another parameter count": (
        lambda p: torch.save(_mutate(torch.load(p, weights_only=True), lambda s: s["optimizer"]["param_groups"][0]["params"].pop()), p),
        "does not fit this drafter"),
    "lr a string": (lambda p: torch.save(_mutate(torch.load(p, weights_only=True), lambda s: s["optimizer"]["param_groups"][0].update(
        lr="fast")), p), "optimizer param_groups[0].lr = 'fast' is not a finite number >= 0"),
    "betas one number": (lambda p: torch.save(_mutate(torch.load(p, weights_only=True), lambda s: s["optimizer"]["param_groups"][0].update(
        betas=0.9)), p), "param_groups[0].betas = 0.9 is not a list of 2 finite numbers >= 0"),
    "eps NaN": (lambda p: torch.save(_mutate(torch.load(p, weights_only=True), lambda s: s["optimizer"]["param_groups"][0].update(
        eps=float("nan"))), p), "param_groups[0].eps = nan is not a finite number"),
    "fused a string": (lambda p: torch.save(_mutate(torch.load(p, weights_only=True), lambda s: s["optimizer"]["param_groups"][0].update(
        fused="yes")), p), "param_groups[0].fused = 'yes' is not true or false"),
    "moments NaN": (lambda p: torch.save(_mutate(torch.load(p, weights_only=True), lambda s: s["optimizer"]["state"][0]["exp_avg"].fill_(
        float("nan"))), p), "optimizer state 'exp_avg' of parameter 0 holds NaN or infinite values"),
    "scheduler step a string": (
        lambda p: torch.save(_mutate(torch.load(p, weights_only=True), lambda s: s["scheduler"].update(last_epoch="2")), p),
        "scheduler field 'last_epoch' must be an integer"),
}


def _mutate(obj, edit):
    edit(obj)
    return obj


@pytest.mark.parametrize("case", sorted(BAD_OPTIMIZERS))
def test_a_damaged_optimizer_file_is_one_line_error(case, resumable, capsys):
    recipe, trainer = resumable
    damage, message = BAD_OPTIMIZERS[case]
    damage(trainer / "optimizer.pt")
    _one_line(*_train(recipe, capsys), str(trainer / "optimizer.pt"), message)


BAD_RNG = {
    "not JSON": (lambda p: p.write_text("{\"torch\": ["), "invalid JSON"),
    "missing": (lambda p: p.unlink(), "missing"),
    "no numpy": (lambda p: _edit_json(p, lambda s: s.pop("numpy")), "not an RNG state"),
    "torch state too short": (lambda p: _edit_json(p, lambda s: s["torch"].pop()), "'torch' is not a valid RNG state"),
    "torch state not bytes": (lambda p: _edit_json(p, lambda s: s["torch"].__setitem__(0, 300)), "'torch' is not a valid"),
    "python state too short": (lambda p: _edit_json(p, lambda s: s["python"][1].pop()), "'python' is not a valid RNG state"),
    "python state a string": (lambda p: _edit_json(p, lambda s: s.update(python="x")), "'python' is not a valid RNG state"),
    "numpy key negative": (lambda p: _edit_json(p, lambda s: s["numpy"][1].__setitem__(0, -1)), "'numpy' is not a valid"),
    "numpy of another generator": (lambda p: _edit_json(p, lambda s: s["numpy"].__setitem__(0, "PCG64")), "'numpy' is not a valid"),
}


@pytest.mark.parametrize("case", sorted(BAD_RNG))
def test_a_damaged_rng_file_is_one_line_error(case, resumable, capsys):
    recipe, trainer = resumable
    damage, message = BAD_RNG[case]
    damage(trainer / "rng-rank0.json")
    _one_line(*_train(recipe, capsys), str(trainer / "rng-rank0.json"), message)


def test_the_launch_script_says_one_line_too(resumable):
    """``accelerate launch train/eagle.py RECIPE`` (here plain python): exit 2, one line."""
    recipe, trainer = resumable
    (trainer / "state.json").write_text("not json")
    res = run_train([recipe])
    line = _one_line(res.returncode, res.stderr, str(trainer / "state.json"), "invalid JSON")
    assert line.startswith("train/eagle.py: error:")


# ---------------------------------------------------------------------- training outputs
def test_training_below_a_regular_file_is_one_line_error(tmp_path, tiny_target_dirs, chat_file, capsys):  # noqa: F811
    blocker = tmp_path / "file"
    blocker.write_text("")
    recipe = write_recipe(tmp_path, tiny_target_dirs["llama"], chat_file, output_dir=str(blocker / "sub"))
    _one_line(*_train(recipe, capsys), str(blocker / "sub"), "output_dir")
    res = run_train([recipe])  # the launch script, before it loads anything
    _one_line(res.returncode, res.stderr, str(blocker / "sub"), "output_dir")


def test_training_into_a_directory_without_write_permission(tmp_path, tiny_target_dirs, chat_file, capsys, monkeypatch):  # noqa: F811
    """chmod 0o500 does not stop root (the tests' user): refuse creating files there the way the OS would."""
    out = tmp_path / "ro"
    out.mkdir()
    real = tempfile.mkstemp

    def mkstemp(*args, dir=None, **kw):
        if dir is not None and Path(dir).resolve().is_relative_to(out.resolve()):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(dir))
        return real(*args, dir=dir, **kw)

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    recipe = write_recipe(tmp_path, tiny_target_dirs["llama"], chat_file, output_dir=str(out))
    _one_line(*_train(recipe, capsys), str(out), "Permission denied")
    assert list(out.iterdir()) == []


# the last file written, so every other one is already staged; the rest with -m slow
@pytest.mark.parametrize("file", [pytest.param("rng-rank0.json", marks=pytest.mark.slow), pytest.param("optimizer.pt", marks=pytest.mark.slow), "state.json"])
def test_a_full_disk_during_a_checkpoint_leaves_no_half_checkpoint(file, tmp_path, tiny_target_dirs, chat_file, capsys,  # noqa: F811
                                                                   monkeypatch):
    """The step-4 checkpoint fails on a full disk: step 2 stays whole, nothing of step 4 is left."""
    recipe = write_recipe(tmp_path, tiny_target_dirs["llama"], chat_file, train={"max_steps": 4})
    hit = _full_disk(monkeypatch, lambda p: p.name == file and ".staging-0000004" in str(p))
    # named as the checkpoint it was for, not its staging directory
    _one_line(*_train(recipe, capsys), str(tmp_path / "run" / "checkpoints" / "step-0000004" / "trainer" / file), "No space left on device")
    assert hit
    run = tmp_path / "run"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [STEP]
    assert _leftovers(run) == []
    # what is there is whole: the run resumes from step 2 and finishes once the disk has room
    monkeypatch.undo()
    rc, err = _train(recipe, capsys)
    assert rc == 0, err[-2000:]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [STEP, "step-0000004"]


def test_a_full_disk_on_the_metrics_log_keeps_whole_records(tmp_path, tiny_target_dirs, chat_file, capsys, monkeypatch):  # noqa: F811
    recipe = write_recipe(tmp_path, tiny_target_dirs["llama"], chat_file, train={"max_steps": 4})
    calls = []

    def second_record(p):
        if p.name != "metrics.jsonl":
            return False
        calls.append(p)
        return len(calls) == 2

    _full_disk(monkeypatch, second_record)
    _one_line(*_train(recipe, capsys), "metrics.jsonl", "No space left on device")
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines(keepends=True)
    assert len(lines) == 1 and lines[0].endswith("\n") and json.loads(lines[0])["step"] == 1


# ---------------------------------------------------------------------- metric loggers
def _events(run: Path) -> list:
    """Every event of the run's one TensorBoard event file, read by TensorBoard's own loader; the file
    holds whole records only (their framing adds up to its size)."""
    import struct

    from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader

    files = sorted((run / "tensorboard").glob("events.out.tfevents.*"))
    assert len(files) == 1, files
    data, pos, records = files[0].read_bytes(), 0, 0
    while pos < len(data):
        pos += 8 + 4 + struct.unpack("<Q", data[pos : pos + 8])[0] + 4  # length, its crc, the record, its crc
        records += 1
    assert pos == len(data)
    events = list(LegacyEventFileLoader(str(files[0])).Load())
    assert len(events) == records
    return events


def test_tensorboard_events_hold_the_logged_metrics(tmp_path, tiny_target_dirs, chat_file, capsys):  # noqa: F811
    recipe = write_recipe(tmp_path, tiny_target_dirs["llama"], chat_file, train={"max_steps": 2}, logging={"tensorboard": True})
    rc, err = _train(recipe, capsys)
    assert rc == 0, err[-2000:]
    run = tmp_path / "run"
    events = _events(run)
    assert events[0].file_version == "brain.Event:2"
    logged = {e.step: {v.tag: v.simple_value for v in e.summary.value} for e in events[1:]}
    for record in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()):
        assert logged[record["step"]]["loss"] == pytest.approx(record["loss"], rel=1e-6)
        assert logged[record["step"]]["acc/0"] == pytest.approx(record["acc"][0], rel=1e-6)
    assert _leftovers(run) == []


def test_a_full_disk_on_the_tensorboard_log_keeps_whole_records(tmp_path, tiny_target_dirs, chat_file, capsys,  # noqa: F811
                                                                 monkeypatch):
    recipe = write_recipe(tmp_path, tiny_target_dirs["llama"], chat_file, train={"max_steps": 4}, logging={"tensorboard": True})
    calls = []

    def third_record(p):  # the header, step 1, then step 2 fails
        if not p.name.startswith("events.out.tfevents."):
            return False
        calls.append(p)
        return len(calls) == 3

    _full_disk(monkeypatch, third_record)
    _one_line(*_train(recipe, capsys), "tensorboard/events.out.tfevents.", "No space left on device")
    assert [e.step for e in _events(tmp_path / "run")] == [0, 1]  # whole records only: TensorBoard reads them all


def _fake_wandb(monkeypatch, fails: str = ""):
    """A stand-in ``wandb`` module (the package is optional and not installed for the tests) whose
    ``fails`` call raises as wandb does; the calls it got are recorded."""
    import types

    calls = []

    class Run:
        def log(self, data, step):
            calls.append(("log", step))
            if fails == "log":
                raise RuntimeError("wandb.errors.Error: disk quota exceeded\nmore detail")

        def finish(self):
            calls.append(("finish",))

    def init(**kw):
        calls.append(("init", kw["mode"], kw["dir"]))
        if fails == "init":
            raise ValueError("cannot start the wandb service")
        return Run()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    return calls


@pytest.mark.parametrize("fails", ["", "init", "log"])
def test_wandb_errors_are_one_line(fails, tmp_path, tiny_target_dirs, chat_file, capsys, monkeypatch):  # noqa: F811
    calls = _fake_wandb(monkeypatch, fails)
    recipe = write_recipe(tmp_path, tiny_target_dirs["llama"], chat_file, train={"max_steps": 2}, logging={"wandb": True})
    rc, err = _train(recipe, capsys)
    assert calls[0] == ("init", "offline", str(tmp_path / "run"))
    if not fails:
        assert rc == 0, err[-2000:]
        assert calls[1:] == [("log", 1), ("log", 2), ("finish",)]
    else:
        _one_line(rc, err, f"logging.wandb: wandb.{fails} failed")


@pytest.mark.parametrize("blocked", ["tensorboard", "wandb", "metrics.jsonl"])
def test_an_unwritable_log_is_one_line(blocked, tmp_path, tiny_target_dirs, chat_file, capsys, monkeypatch):  # noqa: F811
    """A log's path taken by a file (tensorboard/, wandb/) or a directory (metrics.jsonl): one line naming it,
    and no checkpoint is written by a run that cannot log."""
    _fake_wandb(monkeypatch)
    run = tmp_path / "run"
    run.mkdir()
    (run / blocked).mkdir() if blocked == "metrics.jsonl" else (run / blocked).write_text("")
    recipe = write_recipe(tmp_path, tiny_target_dirs["llama"], chat_file, train={"max_steps": 2},
                          logging={"tensorboard": True, "wandb": True})
    _one_line(*_train(recipe, capsys), str(run / blocked))
    assert not (run / "checkpoints").exists()


# ---------------------------------------------------------------------- export and import
def _cli(args: list[str], capsys) -> tuple[int, str]:
    capsys.readouterr()
    rc = cli_main([str(a) for a in args])
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("engine,fails", [("vllm", "model.safetensors"), ("vllm", "config.json"), ("vllm", "README.md"),
                                          ("sglang", "model.safetensors"), ("hf", "draftlab.json")])
def test_a_full_disk_during_export_is_one_line_and_leaves_nothing(engine, fails, checkpoint, tiny_llama, tmp_path, monkeypatch,  # noqa: F811
                                                                  capsys):
    target = tiny_llama.identity["name"]
    out, kept = tmp_path / "new" / "dir" / "out", tmp_path / "kept"
    assert _cli(["export", checkpoint, "--to", engine, kept, "--target", target], capsys)[0] == 0
    before = {p.name: p.read_bytes() for p in kept.iterdir()}
    hit = _full_disk(monkeypatch, lambda p: p.name == fails)
    # named as the output the user asked for, not its staging directory
    _one_line(*_cli(["export", checkpoint, "--to", engine, out, "--target", target], capsys), str(out / fails), "No space left on device")
    assert hit and not (tmp_path / "new").exists()  # not even the folders made for it
    # over an earlier export (--overwrite): that one stays whole
    _one_line(*_cli(["export", checkpoint, "--to", engine, kept, "--target", target, "--overwrite"], capsys), "No space left on device")
    assert {p.name: p.read_bytes() for p in kept.iterdir()} == before
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("fails", ["model.safetensors", "draftlab.json"])
def test_a_full_disk_during_import_is_one_line_and_leaves_nothing(fails, checkpoint, tiny_llama, tmp_path, monkeypatch, capsys):  # noqa: F811
    target = tiny_llama.identity["name"]
    public = export_checkpoint(checkpoint, "vllm", tmp_path / "public", tiny_llama)
    out = tmp_path / "new" / "imported"
    hit = _full_disk(monkeypatch, lambda p: p.name == fails)
    _one_line(*_cli(["import", public, "--format", "speculators", "--target", target, out], capsys), str(out / fails),
              "No space left on device")
    assert hit and not (tmp_path / "new").exists()
    assert _leftovers(tmp_path) == []
    monkeypatch.undo()
    assert _cli(["import", public, "--format", "speculators", "--target", target, out], capsys)[0] == 0


def _refuse_creating_files_in(monkeypatch, where: Path, code: int = errno.EACCES) -> None:
    """Creating files or folders below ``where`` fails as the OS would refuse it (the tests run as root,
    whom chmod does not stop)."""
    for name in ("mkstemp", "mkdtemp"):
        real = getattr(tempfile, name)

        def refuse(*args, dir=None, _real=real, **kw):
            if dir is not None and Path(dir).resolve().is_relative_to(where.resolve()):
                raise OSError(code, os.strerror(code), str(dir))
            return _real(*args, dir=dir, **kw)

        monkeypatch.setattr(tempfile, name, refuse)


@pytest.mark.parametrize("code", [errno.EACCES, errno.EROFS])
def test_export_and_import_into_an_unwritable_directory_are_one_line(code, checkpoint, tiny_llama, tmp_path, monkeypatch,  # noqa: F811
                                                                     capsys):
    target = tiny_llama.identity["name"]
    public = export_checkpoint(checkpoint, "vllm", tmp_path / "public", tiny_llama)
    ro = tmp_path / "ro"
    ro.mkdir()
    _refuse_creating_files_in(monkeypatch, ro, code)
    _one_line(*_cli(["export", checkpoint, "--to", "vllm", ro / "out", "--target", target], capsys), str(ro / "out"), os.strerror(code))
    _one_line(*_cli(["import", public, "--format", "speculators", "--target", target, ro / "imp"], capsys), str(ro / "imp"),
              os.strerror(code))
    assert list(ro.iterdir()) == []


# ---------------------------------------------------------------------- offline capture
def test_a_full_disk_during_capture_keeps_the_finished_shards(tiny_llama, tmp_path, monkeypatch):
    from draftlab.data.offline import capture_offline
    from test_capture import make_samples

    samples = make_samples(tiny_llama.vocab_size, n=10, seed=2)
    kw = dict(layers="eagle3", storage_dtype="bfloat16", shard_tokens=60, batch_tokens=64, progress=False)
    out = tmp_path / "cap"
    _full_disk(monkeypatch, lambda p: p.name == "shard-00001.safetensors")
    with pytest.raises(DraftlabError) as e:
        capture_offline(tiny_llama, samples, out, **kw)
    msg = str(e.value)
    assert str(out / "shard-00001.safetensors") in msg and "No space left on device" in msg and "\n" not in msg
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "shard-00000.safetensors"]
    manifest = json.loads((out / "manifest.json").read_text())
    assert not manifest["complete"] and [s["file"] for s in manifest["shards"]] == ["shard-00000.safetensors"]
    monkeypatch.undo()
    res = capture_offline(tiny_llama, samples, out, **kw)  # resumes: shard 0 is trusted, the rest captured
    assert res.manifest["complete"] and res.skipped_shards == 1
    assert _leftovers(out) == []


@pytest.mark.parametrize("fails", ["shard-00000.safetensors", "shard-00001.safetensors", "manifest.json"])
def test_the_capture_cli_says_one_line_on_a_full_disk(fails, tmp_path, tiny_target_dirs, chat_file, monkeypatch, capsys):  # noqa: F811
    out = tmp_path / "cap"
    hit = _full_disk(monkeypatch, lambda p: p.name == fails)
    args = ["capture", "--target", tiny_target_dirs["llama"], "--data", chat_file, "--num-conversations", 8, "--max-length", 64,
            "--heldout", 1, "--layers", "eagle3", "--out", out, "--shard-tokens", 150, "--no-progress"]
    _one_line(*_cli(args, capsys), str(out / fails), "No space left on device")
    assert hit and _leftovers(tmp_path) == []
    monkeypatch.undo()  # what was written is whole: the capture resumes and completes
    assert _cli(args, capsys)[0] == 0
    assert json.loads((out / "manifest.json").read_text())["complete"]


def test_capture_into_an_unwritable_place_is_one_line_error(tiny_llama, tmp_path):
    from draftlab.data.offline import capture_offline
    from test_capture import make_samples

    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(DraftlabError) as e:
        capture_offline(tiny_llama, make_samples(tiny_llama.vocab_size, n=3), blocker / "cap", "eagle3", progress=False)
    assert str(blocker / "cap") in str(e.value) and "\n" not in str(e.value)


# ---------------------------------------------------------------------- eval reports
def _report(tau: float) -> dict:
    return {"label": "r", "drafter": "eagle3", "method": "chain", "k": 2, "alpha": [0.5, 0.4], "tau": tau,
            "num_prompts": 2, "categories": {"a": {"alpha": [0.5, 0.4], "tau": tau, "num_prompts": 2}}}


@pytest.mark.parametrize("fails", [".json", ".png", ".md"])
def test_a_full_disk_during_an_eval_report_leaves_no_partial_report(fails, tmp_path, monkeypatch):
    from draftlab.inference.report import write_report

    fresh, kept = tmp_path / "fresh" / "eval.json", tmp_path / "kept" / "eval.json"
    write_report(_report(1.2), kept)
    before = {p.name: p.read_bytes() for p in kept.parent.iterdir()}
    _full_disk(monkeypatch, lambda p: p.suffix == fails)
    for path in (fresh, kept):
        with pytest.raises(DraftlabError) as e:
            write_report(_report(1.7), path)
        assert "No space left on device" in str(e.value) and "\n" not in str(e.value)
    assert not fresh.parent.exists()  # no report at all, not part of one, nor the folder made for it
    assert {p.name: p.read_bytes() for p in kept.parent.iterdir()} == before  # the earlier report, whole


def test_the_eval_cli_says_one_line_on_a_full_disk(tmp_path, monkeypatch, capsys, tiny_target_dirs):
    """``draftlab eval --report`` (training-free n-gram drafter) on a full disk: exit 2, one line, no files."""
    report = tmp_path / "out" / "r.json"
    _full_disk(monkeypatch, lambda p: report.parent in p.parents)
    data = tmp_path / "p.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "hello there"}]}) + "\n")
    rc = cli_main(["eval", "--drafter", "ngram", "--target", str(tiny_target_dirs["llama"]), "--data", str(data),
                   "--num-prompts", "1", "--max-new-tokens", "4", "--k", "1", "--report", str(report)])
    _one_line(rc, capsys.readouterr().err, "No space left on device")
    assert not report.parent.exists() or list(report.parent.iterdir()) == []


# ---------------------------------------------------------------------- the atomic module
def test_atomic_writes_fail_whole(tmp_path, monkeypatch):
    target = tmp_path / "f.bin"
    atomic.write_bytes(target, b"old")
    atomic.append_text(tmp_path / "log.jsonl", "{}\n")
    _full_disk(monkeypatch)
    for write in (lambda: atomic.write_bytes(target, b"new" * 1000), lambda: atomic.write_json(target, {"a": 1}),
                  lambda: atomic.write_text(target, "x", durable=True),
                  lambda: atomic.write_files({target: b"new", tmp_path / "g.bin": b"g"}),
                  lambda: atomic.append_text(tmp_path / "log.jsonl", "{\"b\": 2}\n")):
        with pytest.raises(DraftlabError, match="No space left on device") as e:
            write()
        assert "\n" not in str(e.value)
    assert target.read_bytes() == b"old" and (tmp_path / "log.jsonl").read_text() == "{}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.bin", "log.jsonl"]


@pytest.mark.parametrize("code", [errno.EACCES, errno.EROFS, errno.ENOSPC])
def test_atomic_cannot_create_is_one_line(code, tmp_path, monkeypatch):
    def refuse(*args, **kw):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(tempfile, "mkstemp", refuse)
    monkeypatch.setattr(tempfile, "mkdtemp", refuse)
    for write in (lambda p: atomic.write_bytes(p, b"x"), lambda p: atomic.writable_dir(p),
                  lambda p: atomic.directory(p).__enter__()):
        with pytest.raises(DraftlabError) as e:
            write(tmp_path / "x")
        assert os.strerror(code) in str(e.value) and str(tmp_path / "x") in str(e.value)
    assert [p.name for p in tmp_path.iterdir()] in ([], ["x"])


def test_atomic_directory_never_replaces_a_file(tmp_path):
    out = tmp_path / "out"
    out.write_text("precious")
    with pytest.raises(DraftlabError, match="a file, not a directory"):
        with atomic.directory(out) as tmp:
            atomic.write_bytes(tmp / "a", b"a")
    assert out.read_text() == "precious" and sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    with pytest.raises(DraftlabError, match=f"{out} is a file, not a directory"):
        atomic.write_bytes(out / "sub" / "a", b"a")


def test_atomic_directory_removes_its_staging_on_a_full_disk(tmp_path, monkeypatch):
    out = tmp_path / "out"
    _full_disk(monkeypatch, lambda p: p.name == "b")
    with pytest.raises(DraftlabError, match="No space left on device"):
        with atomic.directory(out) as tmp:
            atomic.write_bytes(tmp / "a", b"a")
            atomic.write_bytes(tmp / "b", b"b")
    assert list(tmp_path.iterdir()) == []


if sys.platform != "linux":  # pragma: no cover
    pytestmark = pytest.mark.skip("Linux file-system semantics")


def test_published_files_and_folders_get_the_usual_modes(tmp_path):
    """Written through a private temporary, a file or folder is published with the modes open() and
    mkdir() would give it under the process's umask (an export must be readable by a serving user)."""
    mask = os.umask(0)
    os.umask(mask)
    atomic.write_bytes(tmp_path / "f.bin", b"x")
    with atomic.directory(tmp_path / "out") as tmp:
        atomic.write_text(tmp / "g.txt", "y")
    assert (tmp_path / "f.bin").stat().st_mode & 0o777 == 0o666 & ~mask
    assert (tmp_path / "out").stat().st_mode & 0o777 == 0o777 & ~mask
    assert (tmp_path / "out" / "g.txt").stat().st_mode & 0o777 == 0o666 & ~mask
