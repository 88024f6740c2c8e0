"""Capture stage: layer choice, online capture == HF forward (padding-aware), offline shards
(resume after a kill is byte-identical, checksums, refusals), the OfflineDataset round trip and
the trainer's FeatureSource in its three modes."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from draftlab.data.capture import capture_batch, resolve_layers
from draftlab.data.dataset import collate
from draftlab.data.features import FeatureSource
from draftlab.data.offline import capture_offline, plan_batches, plan_shards
from draftlab.data.offline_dataset import OfflineDataset
from draftlab.errors import DraftlabError
from draftlab.models.eagle import Eagle1Config, Eagle1Drafter, Eagle3Config, Eagle3Drafter


def make_samples(vocab: int, n: int = 9, seed: int = 0, lo: int = 3, hi: int = 40) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        t = int(torch.randint(lo, hi, (1,), generator=g))
        out.append({"input_ids": torch.randint(0, vocab, (t,), generator=g), "loss_mask": torch.rand(t, generator=g) > 0.3})
    return out


def files_of(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


# ------------------------------------------------------------------------------ layers
def test_resolve_layers_families_indices_and_validation(monkeypatch):
    from draftlab.models.drafter import DRAFTERS

    assert resolve_layers("eagle1", 30) == [30]
    assert resolve_layers("eagle3", 30) == [2, 15, 27, 30]
    assert resolve_layers("EAGLE3", 32) == [2, 16, 29, 32]
    assert resolve_layers("2,15,27", 30) == [2, 15, 27, 30]
    assert resolve_layers([0, 30, 5, 5], 30) == [0, 5, 30]
    # any registered family names its layers: nothing in capture knows the families
    toy = type("ToyDrafter", (), {"default_capture_layers": classmethod(lambda cls, L: [1, L - 1])})
    monkeypatch.setitem(DRAFTERS._items, "toy", toy)
    assert resolve_layers("toy", 30) == [1, 29, 30]
    with pytest.raises(DraftlabError, match="layers: unknown drafter family 'eagle9'"):
        resolve_layers("eagle9", 30)
    for bad in ("2,x", "", [31], [-1], "40", [True]):
        with pytest.raises(DraftlabError, match="layers"):
            resolve_layers(bad, 30)


def test_plans_are_deterministic_partitions():
    lengths = [5, 40, 7, 7, 100, 3, 12]
    shards = plan_shards(lengths, 20)
    assert shards[0][0] == 0 and shards[-1][1] == len(lengths)
    assert all(a < b for a, b in shards) and all(shards[i][1] == shards[i + 1][0] for i in range(len(shards) - 1))
    for a, b in shards:  # over budget only when a single sample is
        assert sum(lengths[a:b]) <= 20 or b - a == 1
    batches = plan_batches(lengths, 24)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        longest = max(lengths[i] for i in b)
        assert lengths[b[0]] == longest and (len(b) * longest <= 24 or len(b) == 1)
    assert batches == plan_batches(lengths, 24)


# ------------------------------------------------------------------------------ online
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_capture_equals_hf_forward(tiny_target_dirs, family):
    from draftlab.models.target import Target

    target = Target.load(str(tiny_target_dirs[family]))
    L = target.num_layers
    ids = make_samples(target.vocab_size, n=1, lo=20, hi=21)[0]["input_ids"][None]
    got = capture_batch(target, ids, [0, 1, 2, L])
    ref = target.model(ids, output_hidden_states=True)
    assert sorted(got) == [0, 1, 2, L]
    for layer, h in got.items():
        torch.testing.assert_close(h, ref.hidden_states[layer], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_cached_forward_equals_hf_for_every_row_count(tiny_target_dirs, family):
    """Every GEMM path gives HF's logits: a few rows on MKL or on oneDNN-packed fused weights,
    unpadded or padded with zero rows to a faster row count (whichever the machine measured:
    each plan is forced here; qwen2 has q/k/v biases), 4..64 rows packed, more rows MKL; and the
    HF modules' weights are views of the fused ones (one copy)."""
    from draftlab.kernels.cpu_gemm import MKL_CANDIDATE_ROWS, PACKED_MAX_ROWS, PAD_CANDIDATE_ROWS, RowPlan
    from draftlab.models.target import Target

    target = Target.load(str(tiny_target_dirs[family]))
    measured = target._row_plan()  # measured once, packs the weights
    assert measured.mkl <= set(range(1, MKL_CANDIDATE_ROWS + 1))
    assert all(r < n <= PAD_CANDIDATE_ROWS for r, n in measured.pad.items())
    ids = make_samples(target.vocab_size, n=1, lo=120, hi=121)[0]["input_ids"][None]
    ref = target.model(ids).logits
    packed_qkv, packed_rows = target._packed[0]["qkv"], []
    # record the rows of what takes the packed path
    target._packed[0]["qkv"] = lambda x: packed_rows.append(x.numel() // x.shape[-1]) or packed_qkv(x)
    small = range(1, MKL_CANDIDATE_ROWS + 1)
    plans = [  # (plan, rows the packed weights run for 30, 1, 2, 3, 4, PACKED_MAX_ROWS + 5, 10 rows)
        (RowPlan(mkl=frozenset(small)), [30, 4, 10]),
        (RowPlan(), [30, 1, 2, 3, 4, 10]),
        (RowPlan(pad={1: 4, 2: 4, 3: 5}), [30, 4, 4, 5, 4, 10]),
        (RowPlan(mkl=frozenset({3}), pad={1: 3, 2: 3}), [30, 4, 10]),
    ]
    for plan, want in plans:
        target._small_row_plan = plan
        cache, start, packed_rows[:] = target.new_cache(1, 128), 0, []
        for n in (30, 1, 2, 3, 4, PACKED_MAX_ROWS + 5, 10):
            out = target(ids[:, start : start + n], cache=cache, logits="all")
            torch.testing.assert_close(out.logits, ref[:, start : start + n], rtol=1e-5, atol=1e-5)
            start += n
        assert packed_rows == want, plan
    attn = target.model.model.layers[0].self_attn
    fused = target._fused[0]["qkv"]
    assert attn.k_proj.weight.data_ptr() == fused.weight[attn.q_proj.out_features :].data_ptr()
    assert attn.q_proj.weight.untyped_storage().data_ptr() == fused.weight.untyped_storage().data_ptr()


def test_row_plan_pads_to_a_faster_row_count_and_picks_the_faster_path():
    """From measured seconds: each row count on its faster path; one that a larger row count
    beats by more than 5 % runs as that one (the Zen 4's 2 rows, slower than 3 or 4); a pad that
    gains less, or a smaller row count that is faster, changes nothing."""
    from draftlab.kernels.cpu_gemm import RowPlan, plan_from_times

    packed = {1: 24.0, 2: 29.0, 3: 25.0, 4: 20.0, 5: 20.5, 6: 23.0}
    mkl = {1: 20.0, 2: 30.0, 3: 40.0}
    seconds = {("packed", r): t for r, t in packed.items()} | {("mkl", r): t for r, t in mkl.items()}
    plan = plan_from_times(seconds)
    # 1 row: MKL's 20.0 against 4 rows' 20.0, no gain; 2 and 3 rows run as 4; 5 rows is within 5 % of its best
    assert plan == RowPlan(mkl=frozenset({1}), pad={2: 4, 3: 4})
    assert str(plan) == "rows on MKL: 1; rows padded: 2 as 4, 3 as 4"
    x = torch.randn(1, 2, 8)
    calls = []
    out = plan(x, lambda v: calls.append(("mkl", v.shape[0])) or v * 2, lambda v: calls.append(("packed", v.shape[0])) or v * 3)
    assert calls == [("packed", 4)] and out.shape == x.shape and torch.equal(out, x * 3)
    assert plan_from_times({("packed", 1): 10.0, ("packed", 2): 9.6}) == RowPlan()


def test_shared_lm_head_decodes_on_the_targets_packed_weights(tiny_llama):
    """A drafter's shared lm_head (EAGLE-1's head): no-grad products of a few rows take the
    target's packed lm_head, larger ones and any with grad take the plain weight (the packed
    product has no backward); all equal the lm_head, and it is one object per target."""
    from draftlab.kernels.cpu_gemm import PACKED_MAX_ROWS, RowPlan

    target = tiny_llama
    head = target.shared_lm_head
    assert head is target.shared_lm_head and head.weight is target.lm_head.weight
    assert not list(head.parameters())  # held by reference: nothing for a drafter to train or save
    measured = target._row_plan()
    target._small_row_plan = RowPlan()  # force the packed path for 1..3 rows too, unpadded
    packed, rows = target._packed[-1]["lm_head"], []
    target._packed[-1]["lm_head"] = lambda x: rows.append(x.shape[0]) or packed(x)
    try:
        x = torch.randn(PACKED_MAX_ROWS + 1, target.hidden_size)
        with torch.no_grad():
            for n in (1, 2, PACKED_MAX_ROWS + 1):
                torch.testing.assert_close(head(x[:n]), target.lm_head(x[:n]), rtol=1e-5, atol=1e-5)
        assert rows == [1, 2]
        xg = x[:2].clone().requires_grad_(True)
        head(xg).sum().backward()
        torch.testing.assert_close(xg.grad, target.lm_head.weight.sum(0).expand(2, -1))
        assert rows == [1, 2]
    finally:
        target._packed[-1]["lm_head"] = packed
        target._small_row_plan = measured


@pytest.mark.parametrize("side", ["right", "left"])
def test_padded_batch_equals_unpadded_samples(tiny_llama, side):
    target = tiny_llama
    samples = make_samples(target.vocab_size, n=4, seed=1)
    batch = collate(samples, pad_id=2)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    if side == "left":  # move each row's padding to the front
        ids, mask = ids.clone(), mask.clone()
        for r, s in enumerate(samples):
            n = s["input_ids"].numel()
            ids[r] = torch.roll(ids[r], ids.shape[1] - n)
            mask[r] = torch.roll(mask[r], ids.shape[1] - n)
    got = capture_batch(target, ids, "eagle3", mask)
    assert sorted(got) == resolve_layers("eagle3", target.num_layers)
    for r, s in enumerate(samples):
        single = capture_batch(target, s["input_ids"][None], "eagle3")
        real = mask[r].bool()
        for layer, h in got.items():
            torch.testing.assert_close(h[r][real], single[layer][0], rtol=1e-5, atol=1e-5)
    for h in got.values():
        assert torch.isfinite(h).all()


def test_online_outputs_usable_for_training(tiny_llama):
    """Captured states must be ordinary tensors: a drafter's backward pass saves them."""
    ids = make_samples(tiny_llama.vocab_size, n=1)[0]["input_ids"][None]
    h = capture_batch(tiny_llama, ids, "eagle1")[tiny_llama.num_layers]
    w = torch.zeros(h.shape[-1], 3, requires_grad=True)
    (h @ w).sum().backward()
    torch.testing.assert_close(w.grad[:, 0], h[0].sum(0))


# ------------------------------------------------------------------------------ offline
def test_offline_roundtrip_float32_exact(tiny_llama, tmp_path):
    target = tiny_llama
    samples = make_samples(target.vocab_size)
    # batch_tokens=1: every sample runs alone, the same forward as the online single-sample call
    res = capture_offline(target, samples, tmp_path / "c", "eagle3", storage_dtype="float32", shard_tokens=50,
                          batch_tokens=1, progress=False)
    m = res.manifest
    assert m["complete"] and m["num_samples"] == len(samples) and len(m["shards"]) > 2
    assert m["layers"] == resolve_layers("eagle3", target.num_layers) and m["target"] == target.identity
    assert sum(s["tokens"] for s in m["shards"]) == m["num_tokens"] == sum(s["input_ids"].numel() for s in samples)
    ds = OfflineDataset(tmp_path / "c")
    assert len(ds) == len(samples) and ds.lengths() == [s["input_ids"].numel() for s in samples]
    for i, s in enumerate(samples):
        item = ds[i]
        online = capture_batch(target, s["input_ids"][None], "eagle3")
        assert torch.equal(item["input_ids"], s["input_ids"]) and item["input_ids"].dtype == torch.long
        assert torch.equal(item["loss_mask"], s["loss_mask"])
        assert sorted(item["hidden"]) == m["layers"]
        for layer, h in item["hidden"].items():
            assert h.dtype == torch.float32 and torch.equal(h, online[layer][0])


def test_offline_roundtrip_bfloat16_batched(tiny_llama, tmp_path):
    target = tiny_llama
    samples = make_samples(target.vocab_size, n=12, seed=3)
    res = capture_offline(target, samples, tmp_path / "c", "2,3", storage_dtype="bfloat16", shard_tokens=80,
                          batch_tokens=96, progress=False)
    H, L = target.hidden_size, target.num_layers
    assert res.manifest["bytes_per_token"] == 3 * H * 2 + 5
    ds = OfflineDataset(tmp_path / "c")
    for i, s in enumerate(samples):
        online = capture_batch(target, s["input_ids"][None], [2, 3])
        for layer in (2, 3, L):
            ref = online[layer][0]
            # bf16 keeps 8 mantissa bits: relative error <= 2^-8 per element
            torch.testing.assert_close(ds[i]["hidden"][layer], ref, rtol=2**-8, atol=1e-6)


def test_killed_midway_resume_is_byte_identical(tiny_llama, tmp_path):
    target = tiny_llama
    samples = make_samples(target.vocab_size, n=14, seed=5)
    kw = dict(layers="eagle3", storage_dtype="bfloat16", shard_tokens=70, batch_tokens=64, progress=False)
    full = capture_offline(target, samples, tmp_path / "full", **kw)
    assert len(full.manifest["shards"]) >= 4

    class Killed(Exception):
        pass

    def die_after_two(idx, entry):
        if idx == 1:
            raise Killed

    with pytest.raises(Killed):
        capture_offline(target, samples, tmp_path / "part", **kw, on_shard=die_after_two)
    partial = json.loads((tmp_path / "part" / "manifest.json").read_text())
    assert not partial["complete"] and [s["index"] for s in partial["shards"]] == [0, 1]
    (tmp_path / "part" / ".shard-00002.safetensors.tmp").write_bytes(b"half a shard")  # a write cut by the kill
    resumed = capture_offline(target, samples, tmp_path / "part", layers="eagle3", storage_dtype="bfloat16",
                              progress=False)  # shard/batch sizes come from the manifest
    assert resumed.skipped_shards == 2
    assert resumed.captured_tokens == full.manifest["num_tokens"] - sum(s["tokens"] for s in partial["shards"])
    assert files_of(tmp_path / "part") == files_of(tmp_path / "full")
    again = capture_offline(target, samples, tmp_path / "part", **kw)  # complete: nothing to do
    assert again.captured_tokens == 0 and files_of(tmp_path / "part") == files_of(tmp_path / "full")


KILL_SCRIPT = """
import sys, time, torch
sys.path.insert(0, {tests!r})
torch.set_num_threads({threads})
from test_capture import make_samples
from draftlab.data.offline import capture_offline
from draftlab.models.target import Target
target = Target.load({target!r})
samples = make_samples(target.vocab_size, n=14, seed=5)
capture_offline(target, samples, {out!r}, layers="eagle3", storage_dtype="bfloat16", shard_tokens=70,
                batch_tokens=64, progress=False, on_shard=lambda i, e: time.sleep(0.3))
"""


def test_sigkill_midway_resume_is_byte_identical(tiny_llama, tiny_target_dirs, tmp_path):
    target = tiny_llama
    samples = make_samples(target.vocab_size, n=14, seed=5)
    kw = dict(layers="eagle3", storage_dtype="bfloat16", shard_tokens=70, batch_tokens=64, progress=False)
    full = capture_offline(target, samples, tmp_path / "full", **kw)
    out = tmp_path / "killed"
    script = KILL_SCRIPT.format(tests=str(Path(__file__).parent), threads=torch.get_num_threads(),
                                target=str(tiny_target_dirs["llama"]), out=str(out))
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and proc.poll() is None:
            m = out / "manifest.json"
            if m.is_file() and len(json.loads(m.read_text())["shards"]) >= 1:
                break
            time.sleep(0.02)
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    partial = json.loads((out / "manifest.json").read_text())
    assert not partial["complete"] and 1 <= len(partial["shards"]) < len(full.manifest["shards"])
    resumed = capture_offline(target, samples, out, **kw)
    assert resumed.skipped_shards == len(partial["shards"])
    assert files_of(out) == files_of(tmp_path / "full")


@pytest.mark.slow  # torch.compile takes ~40 s here
def test_compiled_capture_resumes_byte_identical(tiny_llama, tmp_path):
    target = tiny_llama
    samples = make_samples(target.vocab_size, n=14, seed=5)
    kw = dict(layers="eagle3", storage_dtype="float32", shard_tokens=70, batch_tokens=64, progress=False)
    full = capture_offline(target, samples, tmp_path / "full", **kw, compile=True)
    assert full.manifest["compiled"] is True

    def stop(idx, entry):
        if idx == 1:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        capture_offline(target, samples, tmp_path / "part", **kw, compile=True, on_shard=stop)
    capture_offline(target, samples, tmp_path / "part", layers="eagle3", storage_dtype="float32", progress=False)
    assert files_of(tmp_path / "part") == files_of(tmp_path / "full")
    eager = capture_offline(target, samples, tmp_path / "eager", **kw)
    for a, b in zip(OfflineDataset(tmp_path / "full"), OfflineDataset(tmp_path / "eager")):
        for layer in a["hidden"]:
            torch.testing.assert_close(a["hidden"][layer], b["hidden"][layer], rtol=1e-4, atol=1e-4)
    assert eager.manifest["compiled"] is False


def test_checksum_mismatch_detected_and_recaptured(tiny_llama, tmp_path):
    target = tiny_llama
    samples = make_samples(target.vocab_size, n=8, seed=2)
    kw = dict(layers="eagle1", storage_dtype="float16", shard_tokens=60, batch_tokens=64, progress=False)
    capture_offline(target, samples, tmp_path / "c", **kw)
    reference = files_of(tmp_path / "c")
    shard = tmp_path / "c" / "shard-00001.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[-3] ^= 0xFF  # flip bits inside the tensor data
    shard.write_bytes(bytes(raw))
    with pytest.raises(DraftlabError, match="shard-00001.safetensors: checksum mismatch"):
        OfflineDataset(tmp_path / "c").verify()
    ds = OfflineDataset(tmp_path / "c")
    ds[0]  # shard 0 is fine
    first_of_bad = json.loads((tmp_path / "c" / "manifest.json").read_text())["shards"][1]["samples"][0]
    with pytest.raises(DraftlabError, match="checksum mismatch"):
        ds[first_of_bad]  # checked when first opened
    res = capture_offline(target, samples, tmp_path / "c", **kw)  # resume recaptures the corrupt shard only
    assert res.skipped_shards == len(res.manifest["shards"]) - 1
    assert files_of(tmp_path / "c") == reference
    OfflineDataset(tmp_path / "c").verify()


def test_resume_refuses_a_different_capture(tiny_llama, tmp_path):
    target = tiny_llama
    samples = make_samples(target.vocab_size, n=6)
    kw = dict(storage_dtype="bfloat16", shard_tokens=50, progress=False)
    capture_offline(target, samples, tmp_path / "c", "eagle3", **kw, data_spec={"source": "x", "max_length": 64})
    with pytest.raises(DraftlabError, match="layers"):
        capture_offline(target, samples, tmp_path / "c", "eagle1", **kw, data_spec={"source": "x", "max_length": 64})
    with pytest.raises(DraftlabError, match="dtype"):
        capture_offline(target, samples, tmp_path / "c", "eagle3", storage_dtype="float32", shard_tokens=50,
                        progress=False, data_spec={"source": "x", "max_length": 64})
    with pytest.raises(DraftlabError, match="data spec"):
        capture_offline(target, samples, tmp_path / "c", "eagle3", **kw, data_spec={"source": "x", "max_length": 32})
    with pytest.raises(DraftlabError, match="samples differ"):
        capture_offline(target, samples[:-1], tmp_path / "c", "eagle3", **kw, data_spec={"source": "x", "max_length": 64})
    with pytest.raises(DraftlabError, match="shard_tokens"):
        capture_offline(target, samples, tmp_path / "c", "eagle3", storage_dtype="bfloat16", shard_tokens=40,
                        progress=False, data_spec={"source": "x", "max_length": 64})
    with pytest.raises(DraftlabError, match="compile"):  # compiled forwards round differently
        capture_offline(target, samples, tmp_path / "c", "eagle3", **kw, data_spec={"source": "x", "max_length": 64},
                        compile=True)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(DraftlabError, match="out"):
        capture_offline(target, samples, tmp_path / "other", "eagle3", **kw)
    with pytest.raises(DraftlabError, match="dtype"):
        capture_offline(target, samples, tmp_path / "new", "eagle3", storage_dtype="int8", progress=False)


def test_incomplete_capture_is_not_readable(tiny_llama, tmp_path):
    samples = make_samples(tiny_llama.vocab_size, n=6)

    def stop(idx, entry):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        capture_offline(tiny_llama, samples, tmp_path / "c", "eagle1", shard_tokens=30, progress=False, on_shard=stop)
    with pytest.raises(DraftlabError, match="incomplete"):
        OfflineDataset(tmp_path / "c")
    with pytest.raises(DraftlabError, match="manifest"):
        OfflineDataset(tmp_path / "nothing")


def test_capture_of_another_format_version_is_not_readable(tiny_llama, tmp_path):
    capture_offline(tiny_llama, make_samples(tiny_llama.vocab_size, n=3), tmp_path / "c", "eagle1", progress=False)
    path = tmp_path / "c" / "manifest.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "format_version": 1}))
    with pytest.raises(DraftlabError, match="capture format version 1, this draftlab reads 2"):
        OfflineDataset(tmp_path / "c")
    path.write_text("[]")
    with pytest.raises(DraftlabError, match="not a draftlab capture manifest"):
        OfflineDataset(tmp_path / "c")


# ------------------------------------------------------------------------------ feature source
def eagle3_drafter(target, samples):
    return Eagle3Drafter.build(Eagle3Config(draft_vocab_size=0), target, samples)


def test_feature_source_modes_agree(tiny_llama, tmp_path):
    """The trainer's three feature modes give one micro-batch the same hidden states and
    derived targets on real tokens; the cached and offline ones are zeros at padding."""
    target = tiny_llama
    samples = make_samples(target.vocab_size, n=6, seed=4)
    drafter = eagle3_drafter(target, samples)
    data = {"source": "x", "max_length": 64}
    # batch_tokens=1: every sample runs alone, so float32 shards hold its unpadded states exactly
    capture_offline(target, samples, tmp_path / "c", drafter.capture_layers, storage_dtype="float32",
                    batch_tokens=1, data_spec={**data, "split": "train"}, progress=False)
    source = {mode: FeatureSource(SimpleNamespace(mode=mode, offline_dir=str(tmp_path / "c")), target, drafter, samples, data)
              for mode in ("online", "memory", "offline")}
    indices = [3, 0, 5]
    batch = collate([samples[i] for i in indices], pad_id=2)
    real = batch["attention_mask"].bool()
    online_hidden, online_batch = source["online"].features(indices, batch)
    assert sorted(online_hidden) == drafter.capture_layers and "target_argmax" in online_batch
    first, _ = source["memory"].features(indices, batch)  # first sight: each sample computed alone
    assert sorted(source["memory"].memory) == sorted(indices)
    offline, _ = source["offline"].features(indices, batch)  # also captured one sample per forward
    assert all(torch.equal(first[layer], offline[layer]) for layer in first)
    for mode in ("memory", "offline"):  # memory: from the cache now
        hidden, out = source[mode].features(indices, batch)
        for key in batch:
            assert torch.equal(out[key], batch[key]), key
        for layer, h in hidden.items():
            assert h.shape == online_hidden[layer].shape and (h[~real] == 0).all()
            torch.testing.assert_close(h[real], online_hidden[layer][real], rtol=1e-5, atol=1e-5)
        assert torch.equal(out["target_argmax"][real], online_batch["target_argmax"][real])
    sub = [5, 3]  # cached samples batch in any composition
    hidden, _ = source["memory"].features(sub, collate([samples[i] for i in sub], pad_id=2))
    assert torch.equal(hidden[2][1, : samples[3]["input_ids"].numel()], first[2][0][real[0]])


def test_feature_source_refuses_a_capture_of_other_data(tiny_llama, tmp_path):
    target = tiny_llama
    samples = make_samples(target.vocab_size, n=4)
    drafter = eagle3_drafter(target, samples)
    data = {"source": "x", "max_length": 64}
    capture_offline(target, samples, tmp_path / "c", "eagle1", data_spec={**data, "split": "train"}, progress=False)
    spec = SimpleNamespace(mode="offline", offline_dir=str(tmp_path / "c"))
    where = re.escape(f"capture.offline_dir {tmp_path / 'c'}: ")
    with pytest.raises(DraftlabError, match=where + "captured from a different data section"):
        FeatureSource(spec, target, drafter, samples, {**data, "max_length": 32})
    with pytest.raises(DraftlabError, match=where + re.escape("lacks hidden-state layers [1, 2]")):
        FeatureSource(spec, target, drafter, samples, data)
    eagle1 = Eagle1Drafter.build(Eagle1Config(), target)  # reads only what was captured
    with pytest.raises(DraftlabError, match=where + "4 captured samples but the data section gives 3"):
        FeatureSource(spec, target, eagle1, samples[:3], data)
    assert len(FeatureSource(spec, target, eagle1, samples, data).offline) == 4


# ------------------------------------------------------------------------------ CLI
def test_cli_capture_end_to_end(tiny_target_dirs, tmp_path, capsys):
    from draftlab.cli import main

    data = tmp_path / "chats.jsonl"
    rows = [
        {"messages": [{"role": "user", "content": f"Hello {i}! Please explain the theory of relativity."},
                      {"role": "assistant", "content": "The quick brown fox jumps over the lazy dog. " * (1 + i % 3)}]}
        for i in range(10)
    ]
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = tmp_path / "cap"
    argv = ["capture", "--target", str(tiny_target_dirs["llama"]), "--data", str(data), "--max-length", "64",
            "--heldout", "2", "--layers", "1,2", "--dtype", "float32", "--out", str(out), "--no-progress"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "8 samples" in text and "tokens/s" in text and "B/token" in text and " B/token ~ " in text  # estimate
    ds = OfflineDataset(out)
    assert len(ds) == 8 and ds.layers == [1, 2, 4]
    assert ds.manifest["data"]["source"] == str(data) and ds.manifest["data"]["split"] == "train"
    assert main(argv) == 0 and "nothing to do" in capsys.readouterr().out
    assert main(argv[:-5] + ["--layers", "9", "--out", str(tmp_path / "x"), "--no-progress"]) == 2
    assert "layers: index 9" in capsys.readouterr().err


def test_loaded_cpu_weights_are_process_memory_not_the_mapped_file(tiny_target_dirs):
    """from_pretrained leaves CPU weights as views of the mapped safetensors file; Target.load
    copies them (decoding from the mapping was measured ~1.4x slower per step)."""
    from transformers import AutoModelForCausalLM

    from draftlab.models.target import Target

    raw = AutoModelForCausalLM.from_pretrained(tiny_target_dirs["llama"], dtype=torch.float32)
    assert not all(p.untyped_storage().resizable() for p in raw.parameters())  # the mapping, as loaded
    t = Target.load(str(tiny_target_dirs["llama"]))
    assert all(p.untyped_storage().resizable() for p in t.model.parameters())
    for (name, a), b in zip(raw.named_parameters(), t.model.parameters()):
        assert torch.equal(a, b), name
    if t.config.tie_word_embeddings:
        assert t.model.lm_head.weight is t.embed_tokens.weight
