"""capture.mode memory captures in groups fixed by the samples alone (the seed's epoch-0 batches at
``capture.group_tokens``): one target forward per group instead of one per sample, features equal to
per-sample capture within a stated tolerance, and bit-identical features whatever order a run (a
resumed one) asks for the samples in, so an interrupted run resumes to the weights of an
uninterrupted one."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from draftlab.cli import main as cli_main
from draftlab.data import features as features_module
from draftlab.data.dataset import batches_by_tokens, collate
from draftlab.data.features import FeatureSource
from draftlab.errors import DraftlabError
from draftlab.models.eagle import Eagle3Config, Eagle3Drafter
from draftlab.models.target import Target
from draftlab.recipe import load_recipe
from draftlab.train import hooks
from test_capture import make_samples
from test_train import chat_file, write_recipe  # noqa: F401  (chat_file: a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")

MEMORY = SimpleNamespace(mode="memory", offline_dir=None)
DATA = {"source": "x", "max_length": 64}
# Batched against per-sample capture on real tokens: max |difference| <= TOL * max |h| per layer, the
# rounding of another batch shape and no more (measured on the tiny target: 5e-7 in fp32, 6e-3 in bf16,
# one bf16 step; small values may differ by a step of the layer's scale, so the bound is on that scale).
TOL = {"float32": 2e-6, "bfloat16": 2**-6}


def _counting_forwards(monkeypatch) -> list[tuple[int, int]]:
    """The shape [B, T] of every target forward the feature source runs."""
    shapes = []
    real = features_module.capture_batch

    def counted(target, input_ids, *a, **k):
        shapes.append(tuple(input_ids.shape))
        return real(target, input_ids, *a, **k)

    monkeypatch.setattr(features_module, "capture_batch", counted)
    return shapes


def _fill(source: FeatureSource, samples, batches) -> None:
    for b in batches:
        source.features(b, collate([samples[i] for i in b], pad_id=2))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_grouped_capture_matches_per_sample_capture(dtype, tiny_llama, tiny_target_dirs, monkeypatch):
    target = tiny_llama if dtype == "float32" else Target.load(str(tiny_target_dirs["llama"]), dtype)
    samples = make_samples(target.vocab_size, n=12, seed=5)
    drafter = Eagle3Drafter.build(Eagle3Config(draft_vocab_size=0), target, samples)
    training = batches_by_tokens(samples, 60, seed=1, epoch=3)  # the trainer's batches, unrelated to the groups
    shapes = _counting_forwards(monkeypatch)
    alone = FeatureSource(MEMORY, target, drafter, samples, DATA, group_tokens=1)
    _fill(alone, samples, training)
    assert sorted(shapes) == sorted((1, s["input_ids"].numel()) for s in samples)  # the old way: a forward per sample
    shapes.clear()
    grouped = FeatureSource(MEMORY, target, drafter, samples, DATA, group_tokens=160, seed=0)
    _fill(grouped, samples, training)
    assert len(shapes) == len(grouped.groups) < len(samples) // 2
    assert sorted(g for group in grouped.groups for g in group) == list(range(len(samples)))
    assert all(b * t <= 160 or b == 1 for b, t in shapes)
    for i in range(len(samples)):
        (h1, d1), (h2, d2) = alone.memory[i], grouped.memory[i]
        for layer in h1:
            assert h2[layer].shape == h1[layer].shape and h2[layer].dtype == getattr(torch, dtype)
            a, b = h1[layer].float(), h2[layer].float()
            assert (a - b).abs().max() <= TOL[dtype] * a.abs().max(), (i, layer)
        if dtype == "float32":  # bf16 rounding may flip a near tie
            assert torch.equal(d1["target_argmax"], d2["target_argmax"])


def test_groups_depend_on_the_samples_alone(tiny_llama):
    """Two sources asked for the samples in different batches and orders (an uninterrupted run and a
    resumed one) capture the same groups in the same shapes: bit-identical features."""
    samples = make_samples(tiny_llama.vocab_size, n=10, seed=2)
    drafter = Eagle3Drafter.build(Eagle3Config(draft_vocab_size=0), tiny_llama, samples)
    sources = [FeatureSource(MEMORY, tiny_llama, drafter, samples, DATA, group_tokens=100, seed=7) for _ in range(2)]
    assert sources[0].groups == sources[1].groups == batches_by_tokens(samples, 100, seed=7, epoch=0)
    _fill(sources[0], samples, batches_by_tokens(samples, 80, seed=0, epoch=0))
    _fill(sources[1], samples, [[i] for i in reversed(range(len(samples)))])
    for i in range(len(samples)):
        (h1, d1), (h2, d2) = sources[0].memory[i], sources[1].memory[i]
        assert all(torch.equal(h1[layer], h2[layer]) for layer in h1) and torch.equal(d1["target_argmax"], d2["target_argmax"])


def test_group_tokens_is_a_memory_mode_field(tmp_path, tiny_target_dirs, chat_file):  # noqa: F811
    path = write_recipe(tmp_path, tiny_target_dirs["llama"], chat_file)
    with pytest.raises(DraftlabError, match=r"capture\.group_tokens: applies to capture\.mode memory only"):
        load_recipe(path, ["capture.group_tokens=512"])
    memory = load_recipe(path, ["capture.mode=memory"])
    # unset is train.batch_tokens: the same groups, so the same run
    assert memory.fingerprint() == load_recipe(path, ["capture.mode=memory", "capture.group_tokens=null"]).fingerprint()
    assert memory.fingerprint() != load_recipe(path, ["capture.mode=memory", "capture.group_tokens=512"]).fingerprint()


class _Interrupted(Exception):
    pass


def test_an_interrupted_memory_run_resumes_to_identical_weights(tmp_path, tiny_target_dirs, chat_file, monkeypatch):  # noqa: F811
    """Memory mode, capture groups (1-2 samples of 110-140 tokens) unlike the micro-batches (2-4): a run
    stopped after the step-4 checkpoint of its first epoch (10 steps) and relaunched refills the cache
    from step 5 and, in epoch 2, the samples of steps 1-4, yet ends with the uninterrupted run's weights."""
    runs = {}
    for name in ("ref", "stopped"):
        (tmp_path / name).mkdir()
        runs[name] = write_recipe(tmp_path / name, tiny_target_dirs["llama"], chat_file, data={"max_length": 256},
                                  capture={"mode": "memory", "group_tokens": 256},
                                  train={"max_steps": 12, "batch_tokens": 512, "checkpoint_every": 4, "keep_last": 1})
    assert cli_main(["train", str(runs["ref"])]) == 0

    def stop(trainer, checkpoint_dir):
        if trainer.step == 4:
            raise _Interrupted

    monkeypatch.setattr(hooks, "after_checkpoint", [stop])
    with pytest.raises(_Interrupted):
        cli_main(["train", str(runs["stopped"])])
    monkeypatch.setattr(hooks, "after_checkpoint", [])
    assert cli_main(["train", str(runs["stopped"])]) == 0
    records = [json.loads(l) for l in (tmp_path / "stopped" / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == list(range(1, 13))
    assert max(r["epoch"] for r in records if "loss" in r) == 1  # the resumed run reached the second epoch
    ckpt = "run/checkpoints/step-0000012/model.safetensors"
    a, b = load_file(tmp_path / "ref" / ckpt), load_file(tmp_path / "stopped" / ckpt)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
