"""The rollout workload (``draftlab rollouts``) and DAS: the tasks and their checkers, seeded
problems, greedy speculative rollouts equal to plain ones, the per-problem window, verified
tokens shared within an epoch, per-problem vs global routing, the cost fit, the length budget,
replay and makespan, one-line errors, a drifting policy made and run end to end, and a
losslessness check with the power to catch a broken verifier.

Tiny random targets only (tests/tiny.py)."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from draftlab.errors import DraftlabError
from draftlab.inference.das import DASProposer, PrefixRouter, RolloutHistory
from draftlab.inference.das_budget import LengthBudget, fit_costs, measure_costs
from draftlab.inference.das_sim import makespan, replay_batch, tau, tau_difference, tau_standard_error
from draftlab.inference.decoder import SpeculativeDecoder, generate_plain
from draftlab.inference.rollout_stats import compare, interval
from draftlab.inference.rollout_tasks import TASKS, make_problems, parse_tasks, reward
from draftlab.inference.shapes import Chain
from draftlab.inference.suffix import SuffixTrie
from tiny import assert_one_line, make_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

TEXTS = ["The quick brown fox jumps", "def add(a, b):\n    return a + b", "a b c a b c a b"]
N_NEW = 24


def _ngrams(trie: SuffixTrie) -> dict:
    """{n-gram: count} of every node of ``trie``."""
    out, stack = {}, [((), trie.root)]
    while stack:
        path, node = stack.pop()
        for tok, child in node.kids.items():
            out[path + (tok,)] = child.count
            stack.append((path + (tok,), child))
    return out


# ---------------------------------------------------------------------- tasks
def test_checkers_verify_answers_and_refuse_others():
    probs = make_problems(list(TASKS), 8, seed=3)
    for p in probs:  # every reference answer verifies, and so does it wrapped in words
        assert reward(p, p.answer) == 1.0 and reward(p, f"Sure! {p.answer}") == 1.0, p
    add = next(p for p in probs if p.task == "add")
    a, b = add.params
    assert reward(add, f"{a} + {b} = {a + b}.") == 1.0 and reward(add, f"{a + b + 1}") == 0.0 and reward(add, "no idea") == 0.0
    count = next(p for p in probs if p.task == "count")
    lo, hi = count.params
    run = list(range(lo, hi + 1))
    assert reward(count, f"The integers from {lo} to {hi} are " + ", ".join(map(str, run))) == 1.0
    assert reward(count, ", ".join(map(str, run[:-1]))) == 0.0  # one short
    assert reward(count, ", ".join(map(str, run + [hi + 1]))) == 0.0  # one too many
    spell = next(p for p in probs if p.task == "spell")
    word = spell.params[0]
    assert reward(spell, " - ".join(word.upper())) == 1.0 and reward(spell, "-".join(word[:-1])) == 0.0
    assert reward(spell, word) == 0.0
    rep = next(p for p in probs if p.task == "repeat")
    w, n = rep.params
    assert reward(rep, " ".join([w.capitalize()] * n)) == 1.0 and reward(rep, " ".join([w] * (n + 1))) == 0.0


def test_seeded_problems_reproduce():
    tasks = parse_tasks("add,count,spell,repeat")
    first = make_problems(tasks, 12, seed=7)
    assert make_problems(tasks, 12, seed=7) == first  # the same script, the same problems
    assert [p.task for p in first[:4]] == tasks and len({p.question for p in first}) == 12
    assert make_problems(tasks, 5, seed=7) == first[:5]  # a problem does not depend on how many follow
    assert make_problems(tasks, 12, seed=8) != first
    lengths = [p.params[1] - p.params[0] + 1 for p in make_problems(["count"], 40, seed=0)]
    assert min(lengths) <= 5 and max(lengths) >= 20  # count's answers run short to long: the long tail


# ---------------------------------------------------------------------- the suffix trie's seam
def test_trie_remove_forgets_a_stream_exactly():
    a, b = [5, 6, 7, 5, 6, 8, 9], [6, 7, 5, 1, 2]
    both, only_b = SuffixTrie(depth=4, max_nodes=10_000), SuffixTrie(depth=4, max_nodes=10_000)
    live = both.insert([], a[:3])
    both.insert(live, a[3:])  # a stream inserted in two calls is removed in one
    both.insert([], b)
    only_b.insert([], b)
    both.remove(a)
    assert _ngrams(both) == _ngrams(only_b) and both.size == only_b.size == len(_ngrams(only_b))
    both.remove(b)
    assert both.size == 0 and not both.root.kids


# ---------------------------------------------------------------------- routing, window, sharing
def test_router_routes_equal_prompts_together():
    r = PrefixRouter()
    p, q = [1, 2, 3], [1, 2, 4]
    assert r.route(p) == r.route(list(p)) != r.route(q)
    assert len({r.route(p), r.route(p[:2]), r.route(p + [9])}) == 3  # a prefix of a prompt is another problem


def test_window_evicts_epochs_older_than_w():
    h, fresh = RolloutHistory(window=2, max_depth=4), RolloutHistory(window=2, max_depth=4)
    prompt = [1, 2, 3]
    by_epoch = {0: [[40, 41, 42, 43]], 1: [[50, 51, 52], [50, 53]], 2: [[60, 61]]}
    for e, responses in by_epoch.items():
        h.begin_epoch(e)
        for r in responses:
            h.open(prompt, r[:1])
            h.close(prompt, r)
        if e == 1:
            assert h.trie(prompt).match([40], 3) is not None  # epoch 0 is still inside the window
    fresh.begin_epoch(1)
    for r in by_epoch[1] + by_epoch[2]:
        fresh.open(prompt, r[:1])
        fresh.close(prompt, r)
    # at epoch 2 (window 2) epoch 0's rollout is gone, n-gram for n-gram; epochs 1 and 2 stay
    assert _ngrams(h.trie(prompt)) == _ngrams(fresh.trie(prompt))
    assert h.trie(prompt).match([40], 3) is None and h.trie(prompt).match([50], 3) is not None
    assert h.recent_lengths(prompt) == [3, 2]  # epoch 1's lengths: the current epoch's are not yet predictions
    h.begin_epoch(4)
    assert h.trie(prompt).size == 0 and h.recent_lengths() == []


def test_verified_tokens_reach_the_next_sample_within_an_epoch():
    """A sample's verified tokens are in its problem's trie before it ends: the problem's next
    sample drafts them; another problem's does only under the global scope."""
    p, q, first, seen = [1, 2, 3, 4], [7, 8, 9], 300, [301, 302, 303]
    for scope, other_sees in (("problem", False), ("global", True)):
        h = RolloutHistory(window=16, scope=scope, max_depth=8)
        h.begin_epoch(0)
        a = DASProposer(h, min_prob=0.0)
        a.start(torch.tensor(p), {}, first)
        a.advance(torch.tensor(seen), {})  # still decoding: not closed
        b = DASProposer(h, min_prob=0.0)
        b.start(torch.tensor(p), {}, first)
        assert b.propose(Chain(3)).tokens.tolist() == seen
        c = DASProposer(h, min_prob=0.0)
        c.start(torch.tensor(q), {}, first)
        assert (c.propose(Chain(3)).tokens.tolist() == seen) is other_sees, scope
        # a frozen drafter reads the history and adds nothing
        before = _ngrams(h.trie(p))
        f = a.frozen()
        f.start(torch.tensor(p), {}, 304)
        f.advance(torch.tensor([305, 306]), {})
        assert _ngrams(h.trie(p)) == before


# ---------------------------------------------------------------------- lossless decoding
def test_greedy_speculative_rollouts_equal_plain(tiny_llama, prompts, alone):
    for scope, budget in (("problem", None), ("global", None), ("problem", LengthBudget(k_medium=2, k_long=4))):
        h = RolloutHistory(window=2, scope=scope, max_depth=8)
        for epoch in range(2):
            h.begin_epoch(epoch)
            for prompt, ref in zip(prompts, alone):
                for _ in range(2):
                    res = SpeculativeDecoder(tiny_llama, DASProposer(h, budget=budget, min_prob=0.0)).generate(prompt, N_NEW, Chain(4))
                    assert res.tokens == ref, scope
                    h.close(prompt, res.tokens)
        # the rollouts before it made the drafts: later samples accept most of their continuation
        assert sum(res.accept_lengths) >= N_NEW // 2, (scope, res.accept_lengths)


def test_replay_reproduces_the_decoders_greedy_acceptance(tiny_llama, prompts, alone):
    live, replayed = RolloutHistory(window=4, max_depth=8), RolloutHistory(window=4, max_depth=8)
    for h in (live, replayed):
        h.begin_epoch(0)
    for prompt, ref in zip(prompts, alone):
        for _ in range(2):
            res = SpeculativeDecoder(tiny_llama, DASProposer(live, min_prob=0.0)).generate(prompt, N_NEW, Chain(3))
            live.close(prompt, res.tokens)
            [steps] = replay_batch(lambda: DASProposer(replayed, min_prob=0.0), [(prompt, ref)], 3, replayed)
            real = list(zip(res.num_drafted, res.accept_lengths))
            assert steps[:-1] == real[:-1] and steps[-1][1] <= real[-1][1]  # the last step may accept past the cut
    assert tau([steps]) > 1.5
    # makespan: one forward per step over every unfinished row's inputs
    costs = fit_costs([(1, 1.5), (3, 2.5)])  # c_base 1, c_tok 0.5
    assert math.isclose(makespan([[(0, 0)] * 3, [(0, 0)]], costs), 2.0 + 1.5 + 1.5)
    assert math.isclose(makespan([[(2, 2)], [(0, 0)] * 2], costs), 1 + 0.5 * 4 + 1.5)


# ---------------------------------------------------------------------- the cost model and the budget
def test_cost_fit(tiny_llama):
    exact = [(n, 0.002 + 0.0003 * n) for n in (1, 4, 8, 16, 32)]
    fit = fit_costs(exact)
    assert math.isclose(fit.c_base, 0.002, rel_tol=1e-6) and math.isclose(fit.c_tok, 0.0003, rel_tol=1e-6) and fit.mre < 1e-9
    noisy = fit_costs([(n, t * (1.1 if i % 2 else 0.9)) for i, (n, t) in enumerate(exact)])
    assert 0.05 < noisy.mre < 0.15  # ±10 % noise: a fit about that far off
    with pytest.raises(DraftlabError, match="two different token counts"):
        fit_costs([(4, 0.1), (4, 0.2)])
    measured = measure_costs(tiny_llama, shapes=((1, 1), (1, 8), (4, 8)), context=16, repeats=2)
    assert [n for n, _ in measured.points] == [1, 8, 32] and all(t > 0 for _, t in measured.points)
    assert measured.forward(32) > 0 and math.isfinite(measured.mre)


def test_tau_interval_takes_problems_as_units():
    """A problem's samples pool into one unit: equal problems give no spread, however their
    samples differ; unequal ones do; one problem has no interval."""
    a, b = [(4, 0), (4, 4)], [(4, 2), (4, 2)]  # two samples' steps: τ 3 each pooled
    assert tau([a, b]) == 3.0
    assert tau_standard_error([a, b, b, a], [0, 0, 1, 1]) == pytest.approx(0.0)
    assert tau_standard_error([a, a, b, b], [0, 0, 1, 1]) == pytest.approx(0.0)  # each problem's τ is 3
    low = [(4, 0), (4, 0)]
    se = tau_standard_error([low, low, b, b], [0, 0, 1, 1])
    assert se is not None and se > 0.5  # problems at τ 1 and 3
    assert tau_standard_error([low, b], [0, 0]) is None


def test_tau_difference_is_paired_by_problem():
    """Two drafters on the same rollouts: a drafter one token better on every problem differs by
    exactly 1 with no spread, however unequal the problems are; one problem has no interval."""
    easy, hard = [(4, 3), (4, 3)], [(4, 0), (4, 0)]
    better_easy, better_hard = [(4, 4), (4, 4)], [(4, 1), (4, 1)]
    d, se = tau_difference([better_easy, better_hard], [easy, hard], [0, 1])
    assert d == pytest.approx(1.0) and se == pytest.approx(0.0)
    d, se = tau_difference([better_easy, hard], [easy, hard], [0, 1])  # better on one problem only
    assert d == pytest.approx(0.5) and se > 0.2
    assert tau_difference([easy], [hard], [0])[1] is None


def test_budget_leaves_short_requests_unspeculated(tiny_llama, prompts, alone):
    """Epoch 0's rollouts make prompt 0 short, 1 medium, 2 long; in epoch 1 the short one drafts
    nothing until it outgrows its class, the long one drafts (and has them accepted)."""
    h = RolloutHistory(window=4, max_depth=8)
    h.begin_epoch(0)
    for prompt, ref, n in zip(prompts, alone, (3, 12, 24)):
        h.open(prompt, ref[:1])
        h.close(prompt, ref[:n])
    h.begin_epoch(1)
    budget = LengthBudget(k_medium=2, k_long=4)
    plans = [budget.plan(h, p) for p in prompts]
    assert [p.initial for p in plans] == ["short", "medium", "long"]
    assert plans[0].k(1) == 0 and plans[0].k(12) == 2 and plans[0].k(24) == 4  # it moves up as it outgrows its class
    assert plans[1].k(1) == 2 and plans[2].k(1) == 4
    short = SpeculativeDecoder(tiny_llama, DASProposer(h, budget=budget, learn=False, min_prob=0.0)).generate(prompts[0], 6, Chain(4))
    assert short.tokens == alone[0][:6] and set(short.num_drafted) == {0}
    long = SpeculativeDecoder(tiny_llama, DASProposer(h, budget=budget, learn=False, min_prob=0.0)).generate(prompts[2], 6, Chain(4))
    assert long.tokens == alone[2][:6] and max(long.num_drafted) == 4 and sum(long.accept_lengths) > 0
    # without any history every request is medium
    empty = RolloutHistory(window=4)
    assert budget.plan(empty, prompts[0]).initial == "medium"
    with pytest.raises(DraftlabError, match="k_long"):
        LengthBudget(k_medium=2, k_long=-1)


# ---------------------------------------------------------------------- losslessness has teeth
def _sampled_logprobs(target, prompts, samples, broken, monkeypatch):
    """(plain, das) per-rollout mean token log-probabilities and strata, at temperature 1; with
    ``broken`` the verifier accepts drafts by argmax match (a classic bug: greedy verification of
    sampled decoding), which biases every step that drafts."""
    import draftlab.inference.decoder as decoder
    from draftlab.inference.rollouts import token_logprob
    from draftlab.inference.sampling import Sampling

    if broken:
        real = decoder.accept_chains
        monkeypatch.setattr(decoder, "accept_chains", lambda ids, logits, sampling, probs, backend: real(
            ids, logits, Sampling(0.0, generator=sampling.generator), probs, backend))
    h = RolloutHistory(window=2, max_depth=8)
    h.begin_epoch(0)
    plain, das, strata = [], [], []
    for i, prompt in enumerate(prompts):
        for s in range(samples):
            p = generate_plain(target, prompt, 12, temperature=1.0, seed=1000 * i + s)
            d = SpeculativeDecoder(target, DASProposer(h, min_prob=0.0)).generate(prompt, 12, Chain(3), temperature=1.0, seed=1000 * i + s)
            h.close(prompt, d.tokens)
            plain.append(token_logprob(target, prompt, p.tokens))
            das.append(token_logprob(target, prompt, d.tokens))
            strata.append(i)
    return (plain, strata), (das, strata)


@pytest.mark.parametrize("broken", [False, True], ids=["verifier", "broken-verifier"])
def test_sampled_statistics_catch_a_broken_verifier(tiny_llama, prompts, broken, monkeypatch):
    plain, das = _sampled_logprobs(tiny_llama, prompts[:2], 24, broken, monkeypatch)
    verdict = compare(plain, das)
    assert verdict["consistent"] is (not broken), verdict
    ci = interval(*plain)
    assert ci["lo"] < ci["mean"] < ci["hi"] and ci["n"] == 48


# ---------------------------------------------------------------------- the command line
def _manifest(tmp_path, dirs, problems=2):
    from draftlab.inference.policies import write_manifest

    return write_manifest(tmp_path, [str(d) for d in dirs], make_problems(["count", "add"], problems, 0), {"max_new_tokens": 8})


def _error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("draftlab ")]
    assert "Traceback" not in err and len(lines) == 1 and ": error: " in lines[0], err
    return lines[0]


def test_bad_inputs_are_one_line_errors(tiny_target_dirs, tmp_path, capsys):
    from draftlab.cli import main

    llama = tiny_target_dirs["llama"]
    other = tmp_path / "other-vocab"  # the same model, another tokenizer
    shutil.copytree(llama, other)
    make_tokenizer(vocab_size=300).save_pretrained(other)
    good = _manifest(tmp_path / "good", [llama, llama])
    bad = _manifest(tmp_path / "bad", [llama, other])
    cases = [
        (["make-policies", "--out", str(tmp_path / "p"), "--tasks", "add,sudoku", "--target", str(tmp_path / "none")], "unknown task 'sudoku'"),
        (["run", "--policies", str(bad)], "policy 1 (" + str(other) + "): its tokenizer's vocabulary differs"),
        (["run", "--policies", str(good), "--window", "0"], "--window must be a number of epochs >= 1, got 0"),
        (["run", "--policies", str(good), "--methods", "das,eagle"], "unknown method 'eagle'"),
        (["run", "--policies", str(good), "--problems", "9"], "--problems must be in 1..2"),
        (["run", "--policies", str(tmp_path / "missing")], "cannot read"),
    ]
    for argv, message in cases:
        assert main(["rollouts", *argv]) == 2, argv
        line = _error_line(capsys)
        assert message in line, line
    for kw, message in ((dict(window=0), "window"), (dict(window=2, scope="nearby"), "scope")):
        with pytest.raises(DraftlabError) as e:
            RolloutHistory(**kw)
        assert_one_line(e, message)


def test_make_policies_then_run(tiny_target_dirs, tmp_path, capsys):
    """A drifting sequence made by RAFT updates (LoRA, merged) and the workload over it: a
    report per epoch and method, greedy rollouts equal to plain ones."""
    from safetensors.torch import load_file

    from draftlab.cli import main

    out = tmp_path / "policies"
    assert main(["rollouts", "make-policies", "--target", str(tiny_target_dirs["llama"]), "--out", str(out), "--tasks", "count,add",
                 "--problems", "2", "--epochs", "2", "--samples", "2", "--steps", "2", "--max-new-tokens", "8"]) == 0
    manifest = json.loads((out / "policies.json").read_text())
    assert manifest["policies"][1] == "policy-001" and manifest["made_by"]["epochs"][0]["examples"] >= 2
    base = load_file(tiny_target_dirs["llama"] / "model.safetensors")
    moved = load_file(out / "policy-001" / "model.safetensors")
    assert any(not torch.equal(base[k], moved[k]) for k in base if k in moved)  # the policy drifted
    report = tmp_path / "rep" / "rollouts.json"
    assert main(["rollouts", "run", "--policies", str(out), "--samples", "2", "--k", "3", "--window", "1",
                 "--methods", "das,das-global", "--report", str(report)]) == 0
    rep = json.loads(report.read_text())
    assert [(r["epoch"], r["method"]) for r in rep["rows"]] == [(e, m) for e in (0, 1) for m in ("plain", "das", "das-global")]
    assert all(r["greedy_match"] == "2/2" for r in rep["rows"]) and rep["max_new_tokens"] == 8
    assert set(rep["lossless"]) == {"das", "das-global"} and all(r["reward"]["n"] == 4 for r in rep["rows"])
    assert "| 1 | das |" in report.with_suffix(".md").read_text()
