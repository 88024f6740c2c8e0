"""The block diffusion family on the tiny random targets: the training block equals the decoding
block, a drafter trained to high accuracy shows that accuracy as acceptance in the decoder,
lossless decoding (greedy and sampled), the recipe end to end, and one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from draftlab.errors import DraftlabError
from draftlab.inference.decoder import SpeculativeDecoder, generate_plain
from draftlab.inference.diffusion import DiffusionProposer
from draftlab.inference.proposer import load_proposer
from draftlab.inference.shapes import Block, Chain
from draftlab.models.diffusion import DiffusionConfig, DiffusionDrafter, DiffusionLoss
from draftlab.models.target import Target
from tiny import assert_follows_target, assert_one_line, edit_checkpoint, random_samples, save_checkpoint, write_chat


def _drafter(target, vd=0, layers=(1, 3), block=4, perturb=True):
    d = DiffusionDrafter.build(DiffusionConfig(num_layers=2, block_size=block, target_layers=list(layers), draft_vocab_size=vd), target,
                               random_samples(target, n=6, T=40))
    if perturb:  # every weight away from its init (o_proj and down_proj start at zero)
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in d.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return d.eval()


@pytest.mark.parametrize("vd", [0, 64])
def test_training_blocks_are_the_decoding_blocks(tiny_llama, vd):
    """The logits training computes for a block anchored at p equal the proposer's after the
    decoder has verified x_0..x_p: same context, positions, masks and layers."""
    t = tiny_llama
    d = _drafter(t, vd)
    ids = random_samples(t, n=1, T=30, seed=5)[0]["input_ids"][None]
    hidden = t(ids, layers=d.capture_layers, logits=None).hidden
    anchors = torch.tensor([[3, 11, 20, 26]])
    train = d.anchored_logits(ids, torch.ones_like(ids), hidden, anchors)[0]
    p = DiffusionProposer(d)
    for a, anchor in enumerate(anchors[0].tolist()):
        p.start(ids[0, :anchor], {i: h[:, :anchor] for i, h in hidden.items()}, int(ids[0, anchor]))
        torch.testing.assert_close(p.block_logits(), train[a, 1:], rtol=1e-4, atol=1e-4)
    # a decoder step grows the cached context exactly like a longer prefix
    p.start(ids[0, :5], {i: h[:, :5] for i, h in hidden.items()}, int(ids[0, 5]))
    p.advance(ids[0, 6:12], {i: h[:, 5:11] for i, h in hidden.items()})
    torch.testing.assert_close(p.block_logits(), d.anchored_logits(ids, torch.ones_like(ids), hidden, torch.tensor([[11]]))[0, 0, 1:],
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("vd", [0, 64])
def test_decoding_is_lossless(tiny_llama, vd):
    t = tiny_llama
    d = _drafter(t, vd)
    prompt = random_samples(t, n=1, T=12, seed=2)[0]["input_ids"]
    res = SpeculativeDecoder(t, DiffusionProposer(d)).generate(prompt, 40, Block(3))
    assert res.tokens == generate_plain(t, prompt, 40).tokens
    assert max(res.num_drafted) == 3
    with pytest.raises(DraftlabError, match="does not draft chain"):
        SpeculativeDecoder(t, DiffusionProposer(d)).generate(prompt, 4, Chain(3))
    with pytest.raises(DraftlabError, match=r"k=4 exceeds .*block_size - 1 = 3"):
        SpeculativeDecoder(t, DiffusionProposer(d)).generate(prompt, 4, Block(4))


@pytest.fixture(scope="module")
def trained(tiny_llama):
    """A drafter trained on the target's own greedy continuations of 6 prompts until its
    per-position accuracy is high: (drafter, prompts, full rows, its final training metrics)."""
    t = tiny_llama
    torch.manual_seed(0)
    prompts = [random_samples(t, n=1, T=6, seed=s)[0]["input_ids"] for s in range(6)]
    rows = [torch.cat([p, torch.tensor(generate_plain(t, p, 40).tokens)]) for p in prompts]
    ids = torch.stack(rows)
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[:, 6:] = True
    batch = {"input_ids": ids, "loss_mask": mask, "attention_mask": torch.ones_like(ids)}
    d = DiffusionDrafter.build(DiffusionConfig(num_layers=1, block_size=4, target_layers=[1, 3], draft_vocab_size=0), t,
                               [{"input_ids": r, "loss_mask": m} for r, m in zip(rows, mask)])
    hidden = t(ids, layers=d.capture_layers, logits=None).hidden
    batch.update(d.derived_targets(hidden, batch))
    opt = torch.optim.AdamW(d.parameters(), lr=3e-3)
    for _ in range(300):
        loss, _ = d.training_loss(batch, hidden, DiffusionLoss(anchors=40))
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        _, metrics = d.eval().training_loss(batch, hidden, DiffusionLoss(anchors=40))
    return d, prompts, rows, metrics


def test_trained_accuracy_shows_up_as_acceptance(tiny_llama, trained):
    """Decoding the training prompts accepts about as often as training measured, position by
    position. (A mask, position or layer-id mismatch between training and decoding shows as high
    accuracy with low acceptance: the peers' users' 0.99 vs 0.12.)"""
    from draftlab.inference.metrics import AcceptanceStats

    d, prompts, rows, metrics = trained
    assert min(metrics["acc"]) > 0.9, metrics
    stats = AcceptanceStats()
    p = DiffusionProposer(d)
    for prompt, row in zip(prompts, rows):
        res = SpeculativeDecoder(tiny_llama, p).generate(prompt, 40, Block(3))
        assert res.tokens == row[6:].tolist()
        stats.merge(res.stats())
    assert stats.tau > 1 + metrics["accepted"] - 0.3, (metrics, stats.to_dict())
    assert min(stats.alpha) > 0.8, stats.to_dict()


def test_sampled_decoding_keeps_the_target_distribution(tiny_llama, trained):
    """The first three tokens (the prefill's, then one verified block) jointly follow the
    target's top-k=3 distribution when drafts are sampled from the block marginals q_j."""
    from collections import Counter

    d, prompts, _, _ = trained
    prompt = prompts[0].tolist()
    dec = SpeculativeDecoder(tiny_llama, DiffusionProposer(d))
    counts, steps, n = Counter(), Counter(), 600
    for seed in range(n):
        r = dec.generate(prompt, 3, Block(2), temperature=1.0, top_k=3, seed=seed)
        counts[tuple(r.tokens)] += 1
        steps.update(r.accept_lengths[:1])
    assert len(steps) == 3, steps  # the first block had 0, 1 and 2 drafts accepted at times
    assert_follows_target(counts, tiny_llama, prompt, 3, 1.0, 3, n)


# ---------------------------------------------------------------------------- one-line errors
@pytest.mark.parametrize(
    "override,match",
    [("drafter.block_size=1", "drafter.block_size: Input should be greater than or equal to 2"),
     ("drafter.num_layers=0", "drafter.num_layers"), ("drafter.blocks=3", "drafter.blocks: Extra inputs"),
     ("loss.kind=kl", "loss.kind: Input should be 'ce', 'streak', 'ce_streak', 'dpace', 'nla' or 'lk_hybrid'"),
     ("loss.targets=logits", "loss.targets: Input should be 'greedy', 'distribution' or 'data'"), ("loss.anchors=0", "loss.anchors")],
)
def test_bad_recipes_are_one_line_errors(tmp_path, override, match):
    from draftlab.recipe import load_recipe

    path = tmp_path / "r.yaml"
    path.write_text(f"algorithm: diffusion\noutput_dir: {tmp_path / 'run'}\n")
    load_recipe(path)  # the defaults are a valid diffusion recipe
    with pytest.raises(DraftlabError) as e:
        load_recipe(path, [override])
    assert_one_line(e, match)


@pytest.mark.parametrize(
    "cfg,match",
    [(dict(target_layers=[0, 2]), r"drafter\.target_layers\[0\] = 0 is outside 1\.\.3"),
     (dict(target_layers=[3, 1]), "distinct ascending"), (dict(mask_token_id=10**6), r"drafter\.mask_token_id = 1000000 is outside 0\.\.399")],
)
def test_bad_drafter_configs_are_one_line_errors(tiny_llama, cfg, match):
    with pytest.raises(DraftlabError) as e:
        DiffusionDrafter.build(DiffusionConfig(**cfg), tiny_llama, random_samples(tiny_llama, n=2))
    assert_one_line(e, match)


@pytest.mark.parametrize(
    "case,edit,match",
    [
        ("block of one", dict(meta=lambda m: m.update(block_size=1)), r"drafter\.block_size = 1 is outside 2\.\.1024"),
        ("mask outside vocab", dict(meta=lambda m: m.update(mask_token_id=10**6)), r"drafter\.mask_token_id = 1000000 is outside 0\.\.399"),
        ("missing field", dict(meta=lambda m: m.pop("target_layers")), "drafter meta lacks 'target_layers'"),
        ("missing layer", dict(meta=lambda m: m.update(num_layers=3)), r"missing \['layers\.2\."),
        ("wrong shape", dict(weights=lambda s: s.update({"fc.weight": torch.zeros(3, 3)})), r"fc\.weight \(3, 3\)"),
    ],
)
def test_bad_checkpoints_are_one_line_errors(tiny_llama, tmp_path, case, edit, match):
    from draftlab import checkpoint as ckpt

    path = save_checkpoint(_drafter(tiny_llama, perturb=False), tiny_llama, tmp_path / "ckpt")
    edit_checkpoint(path, **edit)
    with pytest.raises(DraftlabError) as e:
        ckpt.load_drafter(path, tiny_llama)
    assert_one_line(e, match)


# ---------------------------------------------------------------------------- the entry point
def test_train_entry_point_trains_and_reports_every_block_position(tmp_path, tiny_target_dirs):
    """train/diffusion.py end to end on the tiny target: memory capture, checkpoints, and the
    after-checkpoint report with alpha_j for every block position beside the training accuracy."""
    repo = Path(__file__).resolve().parent.parent
    recipe = {
        "algorithm": "diffusion", "output_dir": str(tmp_path / "run"), "target": {"model": str(tiny_target_dirs["llama"])},
        "drafter": {"num_layers": 1, "block_size": 4, "target_layers": [1, 3], "draft_vocab_size": 64},
        "loss": {"kind": "streak", "anchors": 8},
        "data": {"source": str(write_chat(tmp_path / "chat.jsonl", 12, assistant_words=20)), "max_length": 96, "heldout": 2},
        "capture": {"mode": "memory"},
        "train": {"max_steps": 4, "batch_tokens": 512, "checkpoint_every": 4, "warmup_steps": 1, "lr": 1e-2},
        "eval": {"num_prompts": 2, "max_new_tokens": 8, "method": "block", "k": 3},
    }
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    res = subprocess.run([sys.executable, "train/diffusion.py", str(tmp_path / "r.yaml")], cwd=repo, capture_output=True, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    report = json.loads((tmp_path / "run" / "eval" / "latest.json").read_text())
    assert report["greedy_match"] == "2/2" and report["step"] == 4 and report["method"] == "block" and report["k"] == 3
    assert len(report["a"]) == 3 and len(report["train_acc"]) == 3
    assert "training accuracy by position" in (tmp_path / "run" / "eval" / "latest.md").read_text()
    proposer = load_proposer(tmp_path / "run" / "checkpoints" / "step-0000004", Target.load(str(tiny_target_dirs["llama"])))
    assert isinstance(proposer, DiffusionProposer) and proposer.drafter.block_size == 4


def test_the_report_warns_when_serving_accepts_far_less_than_training():
    from draftlab.inference.report import markdown, train_serve_gap

    ok = {"alpha": [0.8, 0.6], "train_acc": [0.9, 0.7], "a": [0.8, 0.48], "tau": 2.28}
    bad = {**ok, "alpha": [0.12, 0.5]}
    assert train_serve_gap(ok) is None and train_serve_gap({"alpha": [0.1], "train_acc": [0.2]}) is None
    assert "positions [1]" in train_serve_gap(bad) and "WARNING" in markdown(bad)


def test_an_eval_block_longer_than_the_drafter_drafts_fails_before_training(tmp_path, tiny_target_dirs):
    from draftlab.train.launch import train_from_recipe

    recipe = {
        "algorithm": "diffusion", "output_dir": str(tmp_path / "run"), "target": {"model": str(tiny_target_dirs["llama"])},
        "drafter": {"num_layers": 1, "block_size": 4, "target_layers": [1, 3], "draft_vocab_size": 0},
        "data": {"source": str(write_chat(tmp_path / "chat.jsonl", 6)), "max_length": 64, "heldout": 2},
        "eval": {"num_prompts": 1, "method": "block", "k": 5},
    }
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    with pytest.raises(DraftlabError) as e:
        train_from_recipe(str(tmp_path / "r.yaml"), [])
    assert_one_line(e, r"block: k=5 exceeds what this drafter drafts per block \(block_size - 1 = 3\)")
    assert not (tmp_path / "run" / "checkpoints").exists()
