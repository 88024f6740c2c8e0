"""The layerskip family on tiny random targets: the target's forward with layers skipped, the
proposer inside the real decoder (greedy equals plain decoding for one sequence and a batch of
prompts of different lengths, drafts are the skip model over the target's own cache, sampled
drafts keep the target's distribution, Draft & Verify's draft exit), the skip set's checks as
one-line errors from a checkpoint (`draftlab eval`) and a recipe, and the search end to end."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from draftlab import checkpoint as ckpt
from draftlab.errors import DraftlabError
from draftlab.inference.decoder import Decoder, SpeculativeDecoder, generate_plain, generate_plain_batch
from draftlab.inference.layerskip import LayerSkipProposer, LayerSkipRows, _tree, swift_width
from draftlab.inference.proposer import PROPOSERS, load_proposer
from draftlab.inference.sampling import Sampling, process_logits
from draftlab.inference.shapes import Chain, DynamicTree
from draftlab.models.drafter import DRAFTERS
from draftlab.models.layerskip import LayerSkip, LayerSkipConfig, every_other_layer
from draftlab.models.target import Target
from draftlab.train.layer_search import expected_speedup, fixed_sets, StepCosts
from tiny import assert_batch_follows_target, assert_one_line, edit_checkpoint, make_tiny_target_dir, save_checkpoint, write_chat

REPO = Path(__file__).resolve().parent.parent
TEXTS = ["The quick brown fox jumps", "Speculative decoding drafts tokens and the target verifies them all at once",
         "a b c a b c a b"]
N_NEW = 24
SKIP = [2]  # on the tiny 4-layer llama: drafts accepted in part

pytestmark = pytest.mark.usefixtures("one_thread")


def _proposer(target, skip=SKIP, adaptive_exit=True) -> LayerSkipProposer:
    return LayerSkipProposer(LayerSkip(skip, target.num_layers, adaptive_exit))


# ---------------------------------------------------------------------------- the target's seam
def test_skipping_no_layer_is_the_plain_forward_and_a_skipped_layer_passes_the_residual(tiny_llama, prompts):
    t = tiny_llama
    ids = torch.tensor([prompts[1]])
    L = t.num_layers
    plain = t(ids, layers=list(range(L + 1)))
    none = t(ids, layers=list(range(L + 1)), skip=())
    assert torch.equal(plain.logits, none.logits) and all(torch.equal(plain.hidden[i], none.hidden[i]) for i in plain.hidden)
    skipped = t(ids, layers=list(range(L + 1)), skip=frozenset({1}))
    assert torch.equal(skipped.hidden[1], plain.hidden[1]) and torch.equal(skipped.hidden[2], skipped.hidden[1])
    assert not torch.allclose(skipped.logits, plain.logits, atol=1e-3)
    cache = t.new_cache(1, 64, ragged=True)
    t(ids, cache=cache, skip=frozenset({1}))
    n = ids.shape[1]
    assert cache.lengths == [n] and not cache.k[1, 0, :, :n].any() and cache.k[0, 0, :, :n].abs().sum() > 0


# ---------------------------------------------------------------------------- decoding
@pytest.mark.parametrize("shape", [Chain(4), DynamicTree(depth=4, top_k=4, total_tokens=10)], ids=["chain", "tree"])
def test_registered_and_greedy_equals_plain_decoding(tiny_llama, prompts, shape):
    assert PROPOSERS.get("layerskip") is LayerSkipProposer and DRAFTERS.get("layerskip") is LayerSkip
    batch = [r.tokens for r in generate_plain_batch(tiny_llama, prompts, N_NEW).rows]
    for adaptive in (True, False):
        proposer = _proposer(tiny_llama, adaptive_exit=adaptive)
        for p in prompts:
            alone = SpeculativeDecoder(tiny_llama, proposer).generate(p, N_NEW, shape)
            assert alone.tokens == generate_plain(tiny_llama, p, N_NEW).tokens
        res = Decoder(tiny_llama, proposer).generate(prompts, N_NEW, shape)
        assert [r.tokens for r in res.rows] == batch
        accepted, drafted = sum(sum(r.accept_lengths) for r in res.rows), sum(sum(r.num_drafted) for r in res.rows)
        assert 0 < accepted < drafted  # kept some drafts, rolled back others
        if isinstance(shape, DynamicTree):  # siblings beside the spine
            assert drafted > sum(sum(r.draft_depths) for r in res.rows)


def test_swift_tree_hangs_each_depth_under_the_spine():
    tree = _tree([[5, 6, 7], [8, 9], [4]], "cpu")
    assert tree.tokens.tolist() == [5, 6, 7, 8, 9, 4] and tree.parents.tolist() == [0, 0, 0, 1, 1, 4]
    assert tree.depth.tolist() == [1, 1, 1, 2, 2, 3]
    assert [swift_width(p, True) for p in (0.99, 0.9, 0.6, 0.3)] == [3, 5, 8, 10]
    assert [swift_width(p, False) for p in (0.99, 0.9, 0.6, 0.3)] == [1, 3, 5, 10]


def test_rows_leave_the_batch_at_their_own_end(tiny_llama, prompts):
    alone = [generate_plain(tiny_llama, p, N_NEW).tokens for p in prompts]
    eos = alone[1][5]
    assert eos not in alone[0] + alone[2]
    res = Decoder(tiny_llama, _proposer(tiny_llama)).generate(prompts, N_NEW, Chain(3), eos_token_id=eos)
    plain = generate_plain_batch(tiny_llama, prompts, N_NEW, eos_token_id=eos)
    assert [r.tokens for r in res.rows] == [r.tokens for r in plain.rows] and res.rows[1].stop_reason == "eos"
    sampled = Decoder(tiny_llama, _proposer(tiny_llama)).generate(prompts, 8, DynamicTree(3, 4, 8), temperature=0.8, seed=1)
    assert [len(r.tokens) for r in sampled.rows] == [8, 8, 8]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_drafts_are_the_skip_model_over_the_targets_cache(tiny_llama, prompts, monkeypatch, temperature):
    """The first step's chain: the target with SKIP passed over, after the prompt's full-model keys
    and values, fed its own drafts; greedy drafts are its argmax, sampled ones carry its distribution."""
    t, skip = tiny_llama, frozenset(SKIP)
    drafts = []
    original = LayerSkipRows.propose

    def spy(self, shape):
        out = original(self, shape)
        drafts.append(out[0])
        return out

    monkeypatch.setattr(LayerSkipRows, "propose", spy)
    res = Decoder(t, _proposer(t, adaptive_exit=False)).generate([prompts[0]], 6, Chain(3), temperature=temperature, top_k=5)
    first = drafts[0]
    assert (first.probs is None) == (temperature == 0.0) and first.tokens.numel() == 3
    cache = t.new_cache(1, 64)
    t(torch.tensor([prompts[0]]), cache=cache, logits=None)
    token = res.rows[0].tokens[0]
    for j in range(3):
        logits = t(torch.tensor([[token]]), cache=cache, skip=skip, logits="last").logits[0, -1]
        if temperature == 0.0:
            assert int(first.tokens[j]) == int(logits.argmax())
        else:
            torch.testing.assert_close(first.probs[j], process_logits(logits, temperature, 5), atol=1e-5, rtol=1e-4)
            assert first.probs[j, first.tokens[j]] > 0
        token = int(first.tokens[j])


def test_sampled_drafts_keep_the_targets_distribution(tiny_llama, prompts):
    """Two rows, drafts drawn from the skip model's processed distribution and returned with it:
    each row's first three tokens follow the target's top-k=3 distribution (chi-square, with power)."""
    ps = prompts[:2]
    temperature, top_k, n = 1.0, 3, 400
    dec = Decoder(tiny_llama, _proposer(tiny_llama, [1, 2], adaptive_exit=False))
    assert_batch_follows_target(dec, tiny_llama, ps, temperature, top_k, n)


def test_draft_exit_follows_draft_and_verify(tiny_llama, prompts):
    rows = LayerSkipRows(_proposer(tiny_llama), 2)
    rows.configure(Sampling())
    for r in range(2):
        rows.start(r, torch.tensor(prompts[r]), {}, 5)
    assert rows.threshold == [0.8, 0.8]
    rows.drafts, rows.full = [[[7], [8], [9]], [[7], [8]]], [False, True]
    rows.advance([torch.tensor([7, 3]), torch.tensor([7, 8, 4])], [{}, {}], [0, 1])
    # row 0: 1 of 3 accepted: AR 1/6 < 0.9, so gamma' = 0.81 and gamma = 0.9 * 0.8 + 0.1 * 0.81
    # row 1: its chain ran to k: gamma stays (AR moves: 0.5)
    assert rows.rate == pytest.approx([1 / 6, 0.5]) and rows.threshold == pytest.approx([0.801, 0.8])
    assert rows.last == [3, 4] and rows.drafts == [None, None]
    # a tree: a sibling accepted at depth 2 ends the path there (depth 2 of 3)
    rows.drafts, rows.full = [[[7, 1], [8, 2], [9]], None], [False, False]
    rows.advance([torch.tensor([7, 2, 6])], [{}], [0])
    assert rows.rate[0] == pytest.approx(0.5 / 6 + 0.5 * 2 / 3)
    with_exit = Decoder(tiny_llama, _proposer(tiny_llama, [1, 2])).generate(prompts, N_NEW, Chain(6))
    without = Decoder(tiny_llama, _proposer(tiny_llama, [1, 2], adaptive_exit=False)).generate(prompts, N_NEW, Chain(6))
    assert [r.tokens for r in with_exit.rows] == [r.tokens for r in without.rows]
    assert sum(sum(r.num_drafted) for r in with_exit.rows) < sum(sum(r.num_drafted) for r in without.rows)


# ---------------------------------------------------------------------------- the skip set's checks
BAD_SKIP = {
    "empty": ([], r"drafter\.skip = \[\] is empty"),
    "beyond the layers": ([1, 4], r"drafter\.skip\[1\] = 4 is outside 0\.\.3 \(the target's decoder layers\)"),
    "negative": ([-1], r"drafter\.skip\[0\] = -1 is outside 0\.\.3"),
    "repeated": ([2, 2], r"drafter\.skip = \[2, 2\] repeats 2"),
    "every layer": ([0, 1, 2, 3], r"drafter\.skip = \[0, 1, 2, 3\] skips every one of the target's 4 layers"),
}


@pytest.mark.parametrize("case", sorted(BAD_SKIP))
def test_bad_skip_sets_in_a_checkpoint_are_one_line_errors(tiny_llama, tiny_target_dirs, tmp_path, capsys, case):
    from draftlab.cli import main

    skip, match = BAD_SKIP[case]
    path = save_checkpoint(LayerSkip([1], 4), tiny_llama, tmp_path / "ckpt")
    assert isinstance(load_proposer(path, tiny_llama, Chain(3)), LayerSkipProposer)  # as written, it loads
    edit_checkpoint(path, meta=lambda m: m.update(skip=skip))
    with pytest.raises(DraftlabError) as e:
        ckpt.load_drafter(path, tiny_llama)
    assert_one_line(e, match)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"category": "chat", "turns": ["The quick brown fox"]}) + "\n")
    capsys.readouterr()
    rc = main(["eval", "--drafter", str(path), "--target", str(tiny_target_dirs["llama"]), "--data", str(prompts),
               "--max-new-tokens", "4"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert rc == 2 and err.startswith(f"draftlab eval: error: {path}/draftlab.json: ") and re.search(match, err), err


def _recipe(tmp_path, target_dir, **sections) -> Path:
    data = write_chat(tmp_path / "chat.jsonl", 12, assistant_words=12)
    recipe = {
        "algorithm": "layerskip",
        "output_dir": str(tmp_path / "run"),
        "target": {"model": str(target_dir)},
        "data": {"source": str(data), "max_length": 96, "heldout": 2},
        "loss": {"calibration_prompts": 3, "calibration_tokens": 8, "max_chain": 3, "fractions": [0.25, 0.5]},
        "train": {"max_steps": 10},
        "eval": {"num_prompts": 2, "max_new_tokens": 8, "method": "chain", "k": 3},
        **sections,
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


@pytest.mark.parametrize("case", ["empty", "beyond the layers", "every layer"])
def test_bad_skip_sets_in_a_recipe_are_one_line_errors(tiny_target_dirs, tmp_path, case):
    from draftlab.train.launch import train_from_recipe

    skip, match = BAD_SKIP[case]
    with pytest.raises(DraftlabError) as e:
        train_from_recipe(str(_recipe(tmp_path, tiny_target_dirs["llama"])), [f"drafter.skip={json.dumps(skip)}"])
    assert_one_line(e, match)
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_the_training_script_refuses_a_bad_skip_set_in_one_line(tiny_target_dirs, tmp_path):
    res = subprocess.run([sys.executable, "train/layerskip.py", str(_recipe(tmp_path, tiny_target_dirs["llama"])), "drafter.skip=[4]"],
                         cwd=REPO, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=120)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert res.stderr.strip().splitlines()[-1].startswith("train/layerskip.py: error: drafter.skip[0] = 4 is outside 0..3")


# ---------------------------------------------------------------------------- the search
def test_objective_and_fixed_sets():
    costs = StepCosts([0.010, 0.011, 0.012, 0.013], 0.002, 8)
    assert costs.draft(8) == pytest.approx(1.0) and costs.draft(4) == pytest.approx(0.6) and costs.verify(2) == pytest.approx(1.2)
    speedup, k = expected_speedup(0.9, 4, costs, 3)  # k = 1, 2, 3: 1.9 / 1.7, 2.71 / 2.4, 3.439 / 3.1
    assert k == 2 and speedup == pytest.approx(2.71 / 2.4)
    assert expected_speedup(0.0, 4, costs, 3) == (pytest.approx(1 / 1.7), 1)
    sets = fixed_sets(10, [0.25, 0.5])  # searchable: 1..8
    assert sets == {"middle 0.25": [4, 5], "spread 0.25": [3, 7], "middle 0.5": [3, 4, 5, 6], "spread 0.5": [2, 4, 6, 8]}
    assert every_other_layer(10) == [1, 3, 5, 7] and every_other_layer(4) == [1] and every_other_layer(2) == [1]


def test_the_search_writes_a_checkpoint_that_loads_and_a_report(tmp_path, monkeypatch):
    from draftlab.cli import main

    monkeypatch.setattr(os, "cpu_count", lambda: 1)  # the run takes every core; tiny models run fastest on one
    target_dir = make_tiny_target_dir(tmp_path / "six", layers=6)
    recipe = _recipe(tmp_path, target_dir)
    assert main(["train", str(recipe)]) == 0
    run = tmp_path / "run"
    found = ckpt.list_checkpoints(run)
    assert len(found) == 1
    t = Target.load(str(target_dir))
    proposer = load_proposer(run / "checkpoints" / "best", t, Chain(3))
    meta = ckpt.read_meta(found[0])
    record = meta["drafter"]["search"]
    assert record["candidates"] == 10 and record["stopped"] == "train.max_steps" and meta["step"] == 10
    assert record["improvements"][0]["skip"] == every_other_layer(6) and record["improvements"][-1] == record["best"]
    assert sorted(proposer.skip) == record["best"]["skip"] and set(record["fixed"]) == set(fixed_sets(6, [0.25, 0.5]))
    assert meta["metrics"]["eval"]["tau"] >= 1
    report = json.loads((run / "eval" / "latest.json").read_text())
    assert report["greedy_match"] == "2/2" and report["step"] == 10 and report["drafter"] == "layerskip"
    names = list(report["compared"])
    assert names[:2] == ["searched", "every other layer"] and names[2].startswith("fixed ")
    assert all(c["greedy_match"] == "2/2" and c["tau"] >= 1 for c in report["compared"].values())
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines if "proxy" in x] == list(range(10)) and lines[-1]["eval_tau"] == report["tau"]
    # relaunched with a set as given, no search: its checkpoint replaces the earlier search's
    assert main(["train", str(recipe), "drafter.search=false", "drafter.skip=[2, 3]", "eval.enabled=false"]) == 0
    (only,) = ckpt.list_checkpoints(run)
    meta = ckpt.read_meta(run / "checkpoints" / "best")
    assert ckpt.read_meta(only) == meta
    scored = {(2, 3)} | {tuple(s) for s in fixed_sets(6, [0.25, 0.5]).values()}
    assert meta["drafter"]["skip"] == [2, 3] and meta["drafter"]["search"]["candidates"] == len(scored)
    assert LayerSkipConfig().skip is None


def test_the_search_is_found_as_a_trainer_variant():
    """models/layerskip.py names no training code: `draftlab train` finds the search among the
    trainer variants registered in train/, the way families are found (a fresh process)."""
    code = ("from draftlab.train.variants import TRAINERS; import sys; run = TRAINERS.get('layerskip'); "
            "print(run.__module__, run.__name__, 'draftlab.train.layer_search' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.stdout.split() == ["draftlab.train.layer_search", "run", "True"], out.stderr
    with pytest.raises(DraftlabError, match="algorithm: unknown trainer variant 'eagle3'"):
        from draftlab.train.variants import TRAINERS

        TRAINERS.get("eagle3", "algorithm")
