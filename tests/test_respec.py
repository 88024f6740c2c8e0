"""ReSpec's drafter that follows a moving policy: online KD of an EAGLE-3 drafter on an epoch's
rollouts (train/online_distill.py) and the eagle3-* methods of the rollout workload
(inference/respec.py): KD lowers the KL to the policy, reward weights act as stated, the
distilled checkpoint decodes losslessly, kd and rkd spend equal compute, a broken verifier is
caught by the sampled statistics, and bad inputs are one-line errors.

Tiny random targets only (tests/tiny.py)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from draftlab.errors import DraftlabError
from draftlab.inference.decoder import SpeculativeDecoder, generate_plain
from draftlab.inference.respec import Rollout
from draftlab.inference.shapes import Chain
from draftlab.train.online_distill import DistillSpec, distill
from tiny import assert_one_line, make_tiny_target_dir, random_samples, save_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")

TEXTS = ["The quick brown fox jumps", "def add(a, b):\n    return a + b", "a b c a b c a b"]
N_NEW = 16
RECIPE = {"loss": {"ttt_steps": 2, "decay": 0.8}}  # what the checkpoint says it was trained with


def _eagle3(target, path, seed: int = 0):
    from draftlab.models.eagle import Eagle3Config, Eagle3Drafter

    torch.manual_seed(seed)
    # the full vocabulary: a draft vocabulary chosen from random tokens would miss most of what the tiny target says
    drafter = Eagle3Drafter.build(Eagle3Config(draft_vocab_size=0), target, random_samples(target))
    return save_checkpoint(drafter, target, path, recipe=RECIPE)


@pytest.fixture(scope="module")
def drafter_dir(tiny_llama, tmp_path_factory):
    """A fresh (untrained) EAGLE-3 checkpoint for the tiny Llama."""
    return _eagle3(tiny_llama, tmp_path_factory.mktemp("respec") / "drafter")


@pytest.fixture(scope="module")
def rollouts(tiny_llama, prompts):
    """Two sampled rollouts per prompt (temperature 1), rewards 1, 0, 1, 0, ..."""
    out = []
    for i, p in enumerate(prompts):
        for s in range(2):
            res = generate_plain(tiny_llama, p, N_NEW, temperature=1.0, seed=10 * i + s)
            out.append(Rollout(p, res.tokens, float(len(out) % 2 == 0)))
    return out


@pytest.fixture(scope="module")
def distilled(tiny_llama, drafter_dir, rollouts, prompts, alone, tmp_path_factory):
    """The drafter after 60 KD steps toward the tiny Llama on its sampled and greedy rollouts:
    its drafts are often the target's greedy tokens."""
    out = tmp_path_factory.mktemp("respec") / "distilled"
    rep = distill(drafter_dir, tiny_llama, rollouts + [Rollout(p, a, 1.0) for p, a in zip(prompts, alone)], out,
                  DistillSpec(steps=60, lr=3e-3))
    return out, rep


def _weights(path) -> dict:
    return load_file(path / "model.safetensors")


def _same(a: dict, b: dict, atol: float = 0.0) -> bool:
    return a.keys() == b.keys() and all(torch.allclose(a[k].float(), b[k].float(), atol=atol, rtol=0) for k in a)


# ---------------------------------------------------------------------- the distillation
def test_kd_lowers_the_kl_to_the_policy_on_its_rollouts(tiny_llama, drafter_dir, rollouts, prompts, alone, distilled):
    from draftlab.train.online_distill import _micro_batches, load, mean_kl

    out, rep = distilled
    assert rep["steps"] == 60 and rep["ttt_steps"] == 2 and rep["rollouts"] == len(rollouts) + len(prompts)
    for before, after in zip(rep["kl_before"], rep["kl_after"]):
        assert after < 0.2 * before, rep  # every distilled draft position moved toward the policy
    # the KL the report states is the written checkpoint's, measured afresh
    drafter, meta = load(out, tiny_llama)
    seen = rollouts + [Rollout(p, a, 1.0) for p, a in zip(prompts, alone)]
    micro = _micro_batches(drafter, tiny_llama, seen, [1.0] * len(seen), 4096)
    assert mean_kl(drafter, micro, 2) == pytest.approx(rep["kl_after"], rel=1e-4)
    fresh, _ = load(drafter_dir, tiny_llama)
    assert mean_kl(fresh, micro, 2) == pytest.approx(rep["kl_before"], rel=1e-4)
    assert meta["step"] == 7 + 60 and meta["metrics"]["online_distill"]["kl_after"] == rep["kl_after"]
    assert meta["recipe"] == RECIPE  # what it was trained with stays: its trained depth still reads


def test_reward_weights_act_as_stated(tiny_llama, drafter_dir, rollouts, tmp_path):
    def run(name, rs, weighting="reward", steps=3):
        return distill(drafter_dir, tiny_llama, rs, tmp_path / name, DistillSpec(steps=steps, lr=1e-3, weighting=weighting))

    source = _weights(drafter_dir)
    zero = run("zero", [Rollout(r.prompt, r.response, 0.0) for r in rollouts])
    assert zero["steps"] == 0 and zero["weight_sum"] == 0 and _same(_weights(tmp_path / "zero"), source)  # no reward, no update
    rkd = run("rkd", rollouts)
    kd = run("kd", rollouts, "uniform")
    assert rkd["steps"] == kd["steps"] == 3 and not _same(_weights(tmp_path / "rkd"), _weights(tmp_path / "kd"), atol=1e-6)
    # the loss is the token-weighted mean: with L_i one rollout's own loss and n_i its response
    # tokens, the first step's loss is sum_i r_i n_i L_i / sum_i r_i n_i (any scale of the rewards)
    rewards = [0.5, 2.0, 0.0, 1.0, 3.0, 0.0]
    own = [run(f"one-{i}", [r], "uniform", steps=1)["losses"][0] for i, r in enumerate(rollouts)]
    for scale in (1.0, 7.0):
        first = run(f"scaled-{scale}", [Rollout(r.prompt, r.response, scale * w) for r, w in zip(rollouts, rewards)], steps=1)["losses"][0]
        n = [len(r.response) for r in rollouts]
        assert first == pytest.approx(sum(w * k * x for w, k, x in zip(rewards, n, own)) / sum(w * k for w, k in zip(rewards, n)), rel=1e-4)
    # a rollout of reward 0 contributes nothing: rkd makes the update kd makes on the rewarded rollouts alone
    run("kd-rewarded", [r for r in rollouts if r.reward > 0], "uniform")
    assert _same(_weights(tmp_path / "kd-rewarded"), _weights(tmp_path / "rkd"), atol=1e-5)
    with pytest.raises(DraftlabError) as e:
        run("negative", [Rollout(rollouts[0].prompt, rollouts[0].response, -1.0)])
    assert_one_line(e, "rewards >= 0; rollout 0 has -1.0")


def test_kd_and_rkd_spend_equal_compute(tiny_llama, drafter_dir, rollouts, tmp_path):
    reps = {w: distill(drafter_dir, tiny_llama, rollouts, tmp_path / w, DistillSpec(steps=2, lr=1e-3, weighting=w, micro_tokens=40))
            for w in ("uniform", "reward")}
    keys = ("steps", "rollouts", "tokens", "policy_forwards", "micro_batches", "drafter_passes")
    assert [reps["uniform"][k] for k in keys] == [reps["reward"][k] for k in keys]
    assert reps["uniform"]["micro_batches"] > 1 and reps["uniform"]["drafter_passes"] == 2 * reps["uniform"]["micro_batches"]
    assert reps["uniform"]["tokens"] == sum(len(r.prompt) + len(r.response) for r in rollouts)


def test_micro_batches_accumulate_to_the_whole_epoch(tiny_llama, drafter_dir, rollouts, tmp_path):
    """One step over micro-batches of a few rollouts makes the update one batch of all of them does."""
    for name, micro in (("one", 100_000), ("many", 40)):
        distill(drafter_dir, tiny_llama, rollouts, tmp_path / name, DistillSpec(steps=2, lr=1e-3, weighting="reward", micro_tokens=micro))
    assert _same(_weights(tmp_path / "one"), _weights(tmp_path / "many"), atol=1e-5)


def test_distilled_checkpoint_decodes_greedy_equal_to_plain(tiny_llama, prompts, alone, distilled):
    from draftlab.inference.proposer import load_proposer

    out, _ = distilled
    proposer = load_proposer(out, tiny_llama, Chain(3))
    accepted = 0
    for p, ref in zip(prompts, alone):
        res = SpeculativeDecoder(tiny_llama, proposer).generate(p, N_NEW, Chain(3))
        assert res.tokens == ref
        accepted += sum(res.accept_lengths)
    assert accepted >= N_NEW  # it drafts what the target says, not only passes through


# ---------------------------------------------------------------------- losslessness has teeth
def _sampled_logprobs(target, proposer, prompts, samples, broken, monkeypatch):
    """(plain, eagle) per-rollout mean token log-probabilities at temperature 1, stratified by
    prompt; ``broken``: the verifier accepts a draft when it is the target's argmax (greedy
    verification of sampled decoding), which skews every step that drafts toward the mode."""
    import draftlab.inference.decoder as decoder
    from draftlab.inference.rollouts import token_logprob
    from draftlab.inference.sampling import Sampling

    if broken:
        real = decoder.accept_chains
        monkeypatch.setattr(decoder, "accept_chains", lambda ids, logits, sampling, probs, backend: real(
            ids, logits, Sampling(0.0, generator=sampling.generator), probs, backend))
    plain, eagle, strata = [], [], []
    for i, prompt in enumerate(prompts):
        for s in range(samples):
            p = generate_plain(target, prompt, 12, temperature=1.0, seed=1000 * i + s)
            e = SpeculativeDecoder(target, proposer).generate(prompt, 12, Chain(3), temperature=1.0, seed=1000 * i + s)
            plain.append(token_logprob(target, prompt, p.tokens))
            eagle.append(token_logprob(target, prompt, e.tokens))
            strata.append(i)
    return (plain, strata), (eagle, strata)


@pytest.mark.parametrize("broken", [False, True], ids=["verifier", "broken-verifier"])
def test_sampled_rollouts_with_the_drafter_follow_the_policy(tiny_llama, prompts, distilled, broken, monkeypatch):
    """ReSpec reports speculation degrading the policy; an exact sampler cannot: the rollouts'
    log-probabilities with the distilled drafter equal plain ones' within noise, and the same
    check fails at once when the verifier is broken."""
    from draftlab.inference.proposer import load_proposer
    from draftlab.inference.rollout_stats import compare

    proposer = load_proposer(distilled[0], tiny_llama, Chain(3))
    plain, eagle = _sampled_logprobs(tiny_llama, proposer, prompts[:2], 24, broken, monkeypatch)
    verdict = compare(plain, eagle)
    assert verdict["consistent"] is (not broken), verdict


# ---------------------------------------------------------------------- the workload
def _moved(src, dst):
    """A copy of the tiny target with every weight matrix nudged: the next policy."""
    from safetensors.torch import save_file

    shutil.copytree(src, dst)
    state = load_file(dst / "model.safetensors")
    g = torch.Generator().manual_seed(1)
    save_file({k: v + 0.05 * torch.randn(v.shape, generator=g) if v.dim() == 2 else v for k, v in state.items()},
              dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_rollouts_run_distils_between_epochs(tiny_target_dirs, drafter_dir, tmp_path):
    from draftlab.cli import main
    from draftlab.inference.policies import write_manifest
    from draftlab.inference.rollout_tasks import make_problems

    llama = tiny_target_dirs["llama"]
    manifest = write_manifest(tmp_path / "p", [str(llama), str(_moved(llama, tmp_path / "moved"))],
                              make_problems(["count", "add"], 2, 0), {"max_new_tokens": 8})
    report = tmp_path / "rep" / "r.json"
    assert main(["rollouts", "run", "--policies", str(manifest), "--samples", "2", "--k", "2", "--methods",
                 "eagle3-stale,eagle3-kd,eagle3-rkd", "--drafter", str(drafter_dir), "--distill-steps", "2", "--batch-sizes", "1,4",
                 "--drafter-out", str(tmp_path / "drafters"), "--report", str(report)]) == 0
    rep = json.loads(report.read_text())
    methods = ("plain", "eagle3-stale", "eagle3-kd", "eagle3-rkd")
    assert [(r["epoch"], r["method"]) for r in rep["rows"]] == [(e, m) for e in (0, 1) for m in methods]
    assert all(r["greedy_match"] == "2/2" and len(r["alpha"]) == 2 for r in rep["rows"] if r["method"] != "plain")
    assert set(rep["lossless"]) == set(methods[1:])
    r = rep["respec"]
    assert r["equal_compute"] and sorted(r["calibration"]["cost"]) == ["1", "4"]
    by = {(e["epoch"], e["method"]): e for e in r["epochs"]}
    assert by[0, "eagle3-stale"]["distill"] is None and by[0, "eagle3-kd"]["distill"]["steps"] == 2
    assert by[0, "eagle3-kd"]["distill"]["rollouts"] == 4 and by[0, "eagle3-kd"]["distill"]["weighting"] == "uniform"
    assert (1, "eagle3-kd") in by and by[1, "eagle3-kd"]["distill"] is None  # no epoch after the last: nothing to distil for
    assert by[1, "eagle3-kd"]["checkpoint"] == str(tmp_path / "drafters" / "eagle3-kd" / "epoch-001")
    assert by[1, "eagle3-stale"]["checkpoint"] == str(drafter_dir)
    assert set(by[1, "eagle3-kd"]["draft_length"]["k"]) == {"1", "4"}
    assert not _same(_weights(tmp_path / "drafters" / "eagle3-kd" / "epoch-001"), _weights(drafter_dir))
    md = report.with_suffix(".md").read_text()
    assert "| 1 | eagle3-kd |" in md and "α_2" in md and "Equal distillation compute" in md


# ---------------------------------------------------------------------- bad input
def test_bad_inputs_are_one_line_errors(tiny_llama, tiny_target_dirs, drafter_dir, rollouts, tmp_path, capsys):
    from draftlab.cli import main
    from draftlab.inference.policies import write_manifest
    from draftlab.inference.rollout_tasks import make_problems
    from draftlab.models.target import Target

    narrow = Target.load(str(make_tiny_target_dir(tmp_path / "narrow", "llama", hidden=32)))
    other_target = _eagle3(narrow, tmp_path / "other-target")
    other_vocab = shutil.copytree(drafter_dir, tmp_path / "other-vocab")
    meta = json.loads((other_vocab / "draftlab.json").read_text())
    meta["target"]["vocab_size"] = 300
    (other_vocab / "draftlab.json").write_text(json.dumps(meta))
    for where, spec, message in (
        (other_target, DistillSpec(steps=1), "trained for target .*hidden_size=32"),
        (other_vocab, DistillSpec(steps=1), "vocab_size=300"),
        (drafter_dir, DistillSpec(steps=-1), "steps must be an integer >= 0, got -1"),
        (drafter_dir, DistillSpec(steps=1, weighting="loud"), "weighting must be one of uniform, reward"),
    ):
        with pytest.raises(DraftlabError) as e:
            distill(where, tiny_llama, rollouts, tmp_path / "out", spec)
        assert_one_line(e, message)
    assert not (tmp_path / "out").exists()  # nothing written on a refusal

    manifest = write_manifest(tmp_path / "p", [str(tiny_target_dirs["llama"])], make_problems(["add"], 1, 0), {"max_new_tokens": 8})
    run = ["rollouts", "run", "--policies", str(manifest), "--methods", "eagle3-kd"]
    for argv, message in (
        (run, "--methods eagle3-kd: needs --drafter CKPT"),
        (run + ["--drafter", str(other_vocab)], "vocab_size=300"),
        (run + ["--drafter", str(other_target)], "hidden_size=32"),
        (run + ["--drafter", str(drafter_dir), "--distill-steps", "-1"], "--distill-steps must be an integer >= 0, got -1"),
        (run + ["--drafter", str(tmp_path / "nothing")], "not a draftlab checkpoint"),
    ):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.startswith("draftlab ")]
        assert "Traceback" not in err and len(lines) == 1 and message in lines[0], err
