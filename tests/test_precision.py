"""train.precision: auto (bf16 on CUDA, fp32 on CPU), fp32 or bf16, through Accelerate's own mixed
precision. An explicit bf16 runs on CPU too: every family's loss is finite under Accelerate's bf16
autocast while its master weights and gradients stay fp32; a bf16 run's checkpoint records the
precision, and resuming it in another precision is refused in one line. Start-up and step times are
logged in metrics.jsonl."""

from __future__ import annotations

import json
import math

import pytest
import torch

from draftlab.cli import main as cli_main
from draftlab.data.dataset import collate
from draftlab.data.features import FeatureSource
from draftlab.errors import DraftlabError
from draftlab.models.drafter import DRAFTERS
from draftlab.recipe import load_recipe
from draftlab.train import backends
from test_train import chat_file, write_recipe  # noqa: F401  (chat_file: a fixture)
from tiny import random_samples

pytestmark = pytest.mark.usefixtures("one_thread")

FAMILIES = ["eagle1", "eagle3", "medusa", "medusa2", "diffusion", "draft_lm"]


def _fresh_accelerate() -> None:
    """Accelerate keeps one precision per process; these tests build several in one."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


@pytest.fixture(autouse=True)
def fresh_accelerate():
    _fresh_accelerate()
    yield
    _fresh_accelerate()


def test_auto_is_fp32_on_cpu_and_bf16_is_accelerates_autocast(tmp_path, tiny_target_dirs, chat_file):  # noqa: F811
    path = write_recipe(tmp_path, tiny_target_dirs["llama"], chat_file)
    recipe = load_recipe(path)
    assert recipe.train.precision == "auto"
    # "auto" resolves per machine: the fingerprint leaves it out, resume compares what it resolved to
    assert {load_recipe(path, [f"train.precision={p}"]).fingerprint() for p in ("auto", "fp32", "bf16")} == {recipe.fingerprint()}
    with pytest.raises(DraftlabError, match=r"train\.precision"):
        load_recipe(path, ["train.precision=fp16"])
    accelerator = backends.make_accelerator("auto")
    assert backends.precision(accelerator, recipe.train) == {"train": "fp32", "tf32": False}
    assert accelerator.mixed_precision == "no" and not accelerator.native_amp
    _fresh_accelerate()
    accelerator = backends.make_accelerator("bf16")
    assert accelerator.mixed_precision == "bf16" and accelerator.native_amp


def test_a_deepspeed_config_leaves_the_precision_to_the_recipe():
    """DeepSpeed's own bf16/fp16 mode keeps 16-bit weights in the module; under DeepSpeed, bf16 is the
    trainer's autocast (``backends.prepare``) and the config's mode must stay "auto" (filled in as off)."""
    from draftlab.recipe import TrainSpec

    train = TrainSpec(precision="bf16")
    for key in ("bf16", "fp16"):
        with pytest.raises(DraftlabError, match=f'DeepSpeed config {key}.enabled must be "auto" or false'):
            backends._reconcile_deepspeed_config({key: {"enabled": True}}, train)
    backends._reconcile_deepspeed_config({"bf16": {"enabled": "auto"}, "fp16": {"enabled": False}}, train)


@pytest.mark.parametrize("algorithm", FAMILIES)
def test_every_family_trains_a_step_under_bf16_autocast(algorithm, tiny_llama):
    """One micro-batch through the prepared drafter: its linear layers compute in bf16 (Accelerate's
    autocast is on), the loss is finite and fp32, and the weights and gradients the optimizer steps
    stay fp32."""
    cls = DRAFTERS.get(algorithm)
    samples = random_samples(tiny_llama, n=3, T=20, seed=1)
    samples[1] = {k: v[:13] for k, v in samples[1].items()}  # a padded row
    torch.manual_seed(0)
    drafter = cls.build(cls.Config(), tiny_llama, samples).float()
    accelerator = backends.make_accelerator("bf16")
    trainable = [p for p in drafter.parameters() if p.requires_grad]
    model, opt = accelerator.prepare(drafter, torch.optim.AdamW(trainable, lr=1e-3))
    seen = []
    for m in drafter.modules():
        if isinstance(m, torch.nn.Linear) and m.weight.requires_grad:
            m.register_forward_hook(lambda mod, args, out: seen.append(out.dtype))
    source = FeatureSource(type("Capture", (), {"mode": "online", "offline_dir": None}), tiny_llama, drafter, samples, {})
    indices = [0, 1, 2]
    hidden, batch = source.features(indices, collate([samples[i] for i in indices], pad_id=2))
    loss, _ = model(batch, hidden, cls.Loss())
    accelerator.backward(loss)
    assert torch.bfloat16 in seen and loss.dtype == torch.float32 and torch.isfinite(loss)
    assert all(p.dtype == torch.float32 for p in drafter.parameters())
    grads = [p.grad for p in trainable if p.grad is not None]
    assert grads and all(g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads)
    before = [p.detach().clone() for p in trainable]
    opt.step()
    assert any(not torch.equal(b, p) for b, p in zip(before, trainable)) and all(p.dtype == torch.float32 for p in trainable)


def _train(capsys, *argv) -> tuple[int, str, str]:
    _fresh_accelerate()
    capsys.readouterr()
    rc = cli_main(["train", *map(str, argv)])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_a_bf16_run_on_cpu_records_its_precision_and_resumes_only_in_it(tmp_path, tiny_target_dirs, chat_file, capsys):  # noqa: F811
    from safetensors.torch import load_file

    path = write_recipe(tmp_path, tiny_target_dirs["llama"], chat_file, train={"max_steps": 2, "precision": "bf16"})
    rc, out, err = _train(capsys, path)
    assert rc == 0, err[-2000:]
    assert "precision: bf16 (fp32 master weights), TF32 matmuls off" in out
    run = tmp_path / "run"
    records = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2] and all(math.isfinite(r["loss"]) and r["step_s"] > 0 for r in steps)
    # start-up: process start to the first step (imports, target, data, set-up), with that step only
    assert steps[0]["startup_s"] > 0 and "startup_s" not in steps[1]
    ckpt = run / "checkpoints" / "step-0000002"
    weights = load_file(ckpt / "model.safetensors")
    floats = [w.dtype for w in weights.values() if w.is_floating_point()]
    assert floats and set(floats) == {torch.float32}  # fp32 master weights
    meta = json.loads((ckpt / "draftlab.json").read_text())
    assert meta["precision"] == {"train": "bf16", "tf32": False} and meta["recipe"]["train"]["precision"] == "bf16"
    state_file = ckpt / "trainer" / "state.json"
    assert json.loads(state_file.read_text())["precision"] == "bf16"

    for precision in ("fp32", "auto"):  # auto is fp32 on this CPU
        rc, _, err = _train(capsys, path, f"train.precision={precision}", "train.max_steps=3")
        lines = [l for l in err.strip().splitlines() if "error" in l]
        assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err[-2000:]
        assert str(state_file) in lines[0] and "trained with precision bf16" in lines[0] and "set train.precision=bf16" in lines[0]
    state = json.loads(state_file.read_text())
    state_file.write_text(json.dumps({**state, "precision": "fp16"}))
    rc, _, err = _train(capsys, path, "train.max_steps=3")
    assert rc == 2 and "field 'precision' must be \"fp32\" or \"bf16\", got \"fp16\"" in err, err[-2000:]
    state_file.write_text(json.dumps(state))
    rc, out, err = _train(capsys, path, "train.max_steps=3")
    assert rc == 0 and "resumed from" in out and "step 2" in out, err[-2000:]
    assert json.loads((run / "checkpoints" / "step-0000003" / "draftlab.json").read_text())["precision"]["train"] == "bf16"
