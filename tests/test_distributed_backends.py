"""DeepSpeed ZeRO-2/3 and FSDP2 for real on CPU: two gloo processes through `accelerate launch` with
the shipped configs, sharded as configured, training the same weights as DDP, resuming exactly; a write that fails on one rank stops every rank at once, with one line each."""

import json
import re
import shutil
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from draftlab import checkpoint as ckpt
from test_train import REPO, chat_file, run_train, write_recipe  # noqa: F401  (chat_file is a fixture)

STEPS = 4  # checkpoints at 2 and 4; the killed run dies right after the step-2 checkpoint
BACKENDS = {
    # name: (Accelerate config, what the run reports, optimizer layout in state.json, weights replicated)
    "zero2": ("deepspeed_zero2_cpu.yaml", "DEEPSPEED ZeRO-2", "zero-2", True),
    "zero3": ("deepspeed_zero3_cpu.yaml", "DEEPSPEED ZeRO-3", "zero-3", False),
    "fsdp": ("fsdp_cpu.yaml", "FSDP", "fsdp", False),
}
REPORT = re.compile(r"^distributed: (.+), world size (\d+), rank 0 owns (\d+)% of the drafter weights$", re.M)
pytestmark = pytest.mark.distributed


def accelerate_launch(config: str, port: int) -> list[str]:
    cfg = REPO / "recipes" / "accelerate" / config
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(cfg), "--main_process_port", str(port)]


def final_weights(run_dir):
    return load_file(ckpt.step_dir(run_dir, STEPS) / ckpt.WEIGHTS)


@pytest.fixture(scope="module")
def ddp_reference(tmp_path_factory, tiny_target_dirs, chat_file):  # noqa: F811
    """The same recipe under two-process DDP: the trajectory every sharded backend must reproduce."""
    root = tmp_path_factory.mktemp("ddp")
    path = write_recipe(root, tiny_target_dirs["llama"], chat_file, train={"max_steps": STEPS})
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29561"]
    res = run_train([path], launcher=launcher)
    assert res.returncode == 0, res.stderr[-3000:]
    assert REPORT.search(res.stdout).groups() == ("MULTI_CPU", "2", "100")
    return root / "run"


# DeepSpeed's first launch JIT-builds an op (~2 min): its two backends run with -m slow, FSDP always
@pytest.mark.parametrize("backend", [pytest.param(b, marks=pytest.mark.slow) if b.startswith("zero") else b for b in BACKENDS])
def test_backend_shards_trains_like_ddp_and_resumes_exactly(tmp_path, tiny_target_dirs, tiny_llama, chat_file, ddp_reference, backend):  # noqa: F811
    config, reported, layout, replicated = BACKENDS[backend]
    port = 29570 + 10 * list(BACKENDS).index(backend)
    ref_dir, killed_dir = tmp_path / "ref", tmp_path / "killed"
    ref_dir.mkdir()
    killed_dir.mkdir()
    recipes = [write_recipe(d, tiny_target_dirs["llama"], chat_file, train={"max_steps": STEPS}) for d in (ref_dir, killed_dir)]

    res = run_train([recipes[0]], launcher=accelerate_launch(config, port))
    assert res.returncode == 0, res.stderr[-3000:]
    # not a silent single-process or DDP run: the backend, two processes, and ZeRO-3 / FSDP own half the weights
    backend_name, world, owned = REPORT.search(res.stdout).groups()
    assert (backend_name, world) == (reported, "2")
    assert (int(owned) == 100) if replicated else (50 <= int(owned) <= 55)
    run = ref_dir / "run"
    state = json.loads((ckpt.step_dir(run, STEPS) / "trainer" / "state.json").read_text())
    assert state["world_size"] == 2 and state["optimizer_layout"] == layout
    if layout.startswith("zero"):
        assert sorted(p.name for p in (ckpt.step_dir(run, STEPS) / "trainer").glob("optimizer-rank*.pt")) == [
            "optimizer-rank0.pt", "optimizer-rank1.pt"]
    records = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == list(range(1, STEPS + 1))
    # the digest check runs only where every rank holds whole weights (a shard digest would differ)
    assert [r["weights_in_sync"] for r in records if "weights_in_sync" in r] == ([True] if replicated else [])

    # The checkpoint holds the gathered (full) weights, which draftlab's loader takes as they are.
    drafter, meta = ckpt.load_drafter(ckpt.step_dir(run, STEPS), tiny_llama)
    weights = final_weights(run)
    assert meta["step"] == STEPS
    for k, v in drafter.state_dict().items():
        if k in weights:
            assert torch.equal(v, weights[k]), k
    # Same data, same math as DDP; only the reduction order differs, hence a tolerance.
    ddp = final_weights(ddp_reference)
    assert weights.keys() == ddp.keys()
    for k in ddp:
        torch.testing.assert_close(weights[k], ddp[k], rtol=0, atol=1e-5, msg=k)

    res = run_train([recipes[1]], launcher=accelerate_launch(config, port + 1), kill_after=2)
    assert res.returncode != 0
    assert [p.name for p in ckpt.list_checkpoints(killed_dir / "run")] == ["step-0000002"]
    res = run_train([recipes[1]], launcher=accelerate_launch(config, port + 2))
    assert res.returncode == 0, res.stderr[-3000:]
    assert "step 2" in next(l for l in res.stdout.splitlines() if l.startswith("resumed from"))
    resumed = final_weights(killed_dir / "run")
    for k in weights:
        assert torch.equal(resumed[k], weights[k]), k


def test_resume_refuses_an_optimizer_layout_of_another_backend(tmp_path, tiny_target_dirs, chat_file, ddp_reference):  # noqa: F811
    """A DDP checkpoint's optimizer.pt cannot seed FSDP shards: every rank exits with the one-line error."""
    recipe = write_recipe(tmp_path, tiny_target_dirs["llama"], chat_file, train={"max_steps": STEPS + 2})
    shutil.copytree(ddp_reference, tmp_path / "run")  # same trajectory fingerprint: max_steps is not part of it
    res = run_train([recipe], launcher=accelerate_launch("fsdp_cpu.yaml", 29600))
    assert res.returncode != 0
    assert "error: " in res.stderr and "optimizer state was saved as 'torch' by 2 process(es) but this run uses 'fsdp' on 2" in res.stderr
    assert "[rank0]: Traceback" not in res.stderr and "[rank1]: Traceback" not in res.stderr


@pytest.mark.parametrize("pattern,rank", [
    ("*/.staging-0000002/trainer/state.json", "0"),  # the main process's checkpoint write
    ("*/.staging-0000002/trainer/rng-rank1.json", "1"),  # another rank's own file
    pytest.param("*/run/metrics.jsonl", "0", marks=pytest.mark.slow),  # the main process's log, between two steps' all-reduces
])
def test_a_write_failing_on_one_rank_stops_every_rank_with_one_line(pattern, rank, tmp_path, tiny_target_dirs, chat_file):  # noqa: F811
    """A full disk on one of two DDP processes: both leave at once (not at the process group's timeout),
    each with one error line, exit non-zero, and no checkpoint or staging directory is left."""
    recipe = write_recipe(tmp_path, tiny_target_dirs["llama"], chat_file, train={"max_steps": 2})
    port = 29610 + 2 * int(rank) + pattern.endswith("jsonl")
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                "--main_process_port", str(port), str(REPO / "tests" / "full_disk_launch.py"), pattern, rank]
    t0 = time.monotonic()
    res = run_train([recipe], launcher=launcher, timeout=240)
    assert res.returncode != 0 and time.monotonic() - t0 < 200
    # one line per process (rank 0's progress bar may run into the other's line: they share stderr)
    errors = re.findall(r"train/eagle\.py: error: ([^\r\n]*)", res.stderr)
    name = pattern.rsplit("/", 1)[-1]
    assert len(errors) == 2, res.stderr[-3000:]
    # no process's traceback: only the launcher's own, reporting the exit codes
    assert "[rank0]: Traceback" not in res.stderr and "[rank1]: Traceback" not in res.stderr and res.stderr.count("Traceback") <= 1
    assert all(name in line and "No space left on device" in line for line in errors), errors
    assert sum(f"(on process {rank}; every process stops)" in line for line in errors) == 1, errors
    checkpoints = tmp_path / "run" / "checkpoints"
    assert not checkpoints.exists() or list(checkpoints.iterdir()) == []
