"""Batched speculative decoding: the per-row KV cache, greedy outputs equal to plain batched
decoding (chains, trees, every family, rows of different lengths that finish at different
steps), lossless sampling at B > 1, the draft-length rule and ``draftlab eval --batch-sizes``."""

from __future__ import annotations

import json
import random
import time
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from draftlab.cli import main as cli_main
from draftlab.errors import DraftlabError
from draftlab.inference.batch_eval import (Speculation, calibrate, compare_batches, crossover_orders, evaluate_batches,
                                          parse_batch_sizes, speedup_interval)
from draftlab.inference.decoder import Decoder, _cache_slots, generate_plain_batch, run_lockstep
from draftlab.inference.draft_length import DraftLength, step_cost
from draftlab.inference.ngram import NgramProposer
from draftlab.inference.prompts import EvalPrompt
from draftlab.inference.proposer import PROPOSERS, Proposer
from draftlab.inference.shapes import Block, Chain, ChainDraft, DraftTree, DynamicTree
from draftlab.models.drafter import DRAFTERS
from test_decoder import PerturbedProposer
from tiny import assert_batch_follows_target, random_samples

TEXTS = ["The quick brown fox jumps", "Speculative decoding drafts tokens and the target verifies them all at once",
         "a b c a b c a b"]
N_NEW = 24


pytestmark = pytest.mark.usefixtures("one_thread")


class RowOracle(Proposer):
    """Drafts its row's greedy continuation (found by prompt) with tokens corrupted at random,
    so rows accept different numbers of drafts; checks every advance stays on that path and
    logs the hidden states it is given."""

    name = "row-oracle"
    shapes = frozenset({"chain", "block", "dynamic_tree"})

    def __init__(self, refs: dict, vocab: int, corrupt=0.3, seed=0, layers=(2,)):
        self.refs, self.vocab, self.corrupt = refs, vocab, corrupt
        self.rng = random.Random(seed)
        self.layers = tuple(layers)

    def start(self, prompt_ids, hidden, next_token):
        self.prompt = tuple(prompt_ids.tolist())
        self.ref = self.refs[self.prompt]
        assert next_token == self.ref[0]
        self.pos, self.hidden_log = 1, [hidden]

    def advance(self, accepted, hidden):
        assert accepted.tolist() == self.ref[self.pos : self.pos + accepted.numel()], "decoder left the greedy path"
        self.pos += accepted.numel()
        self.hidden_log.append(hidden)

    def _wrong(self, tok):
        return (tok + 1 + self.rng.randrange(self.vocab - 1)) % self.vocab

    def propose(self, shape):
        if isinstance(shape, (Chain, Block)):
            true = self.ref[self.pos : self.pos + shape.k]
            return ChainDraft(torch.tensor([self._wrong(t) if self.rng.random() < self.corrupt else t for t in true],
                                           dtype=torch.long))
        tokens, parents, depth, node = [], [], [], 0
        for d in range(1, shape.depth + 1):  # a wrong first sibling at each level, then the true token
            if self.pos + d - 1 >= len(self.ref) or len(tokens) + 2 > shape.total_tokens:
                break
            true = self.ref[self.pos + d - 1]
            tokens.append(self._wrong(true)), parents.append(node), depth.append(d)
            if self.rng.random() < self.corrupt:
                break
            tokens.append(true), parents.append(node), depth.append(d)
            node = len(tokens)
        t = lambda x: torch.tensor(x, dtype=torch.long)  # noqa: E731
        return DraftTree(t(tokens), t(parents), t(depth))


def _oracle(target, prompts, refs, **kw):
    return RowOracle({tuple(p): r for p, r in zip(prompts, refs)}, target.vocab_size, **kw)


# ---------------------------------------------------------------------- the per-row cache
def test_attention_groups_split_where_it_pays():
    from draftlab.models.target import GROUP_COST_SLOTS, attention_groups

    assert attention_groups([60, 61, 70, 2600]) == [(0, 3, 70), (3, 4, 2600)]
    assert attention_groups([60, 2600, 61]) == [(0, 1, 60), (1, 2, 2600), (2, 3, 61)]
    assert attention_groups([100, 120, 130]) == [(0, 3, 130)]  # a second call costs more than 40 slots
    spans = [5, 900, 40, 41, 3000, 7]
    groups = attention_groups(spans)
    assert [g[:2] for g in groups] == sorted(g[:2] for g in groups) and groups[0][0] == 0 and groups[-1][1] == len(spans)
    cost = sum((hi - lo) * span + GROUP_COST_SLOTS for lo, hi, span in groups)
    assert cost <= len(spans) * max(spans) + GROUP_COST_SLOTS  # never worse than one padded call


@pytest.mark.parametrize("call_cost", [512, 0], ids=["one-group", "row-by-row"])
def test_ragged_cache_equals_each_row_alone(tiny_target_dirs, call_cost, monkeypatch):
    from draftlab.models import target as target_module
    from draftlab.models.target import Target

    monkeypatch.setattr(target_module, "GROUP_COST_SLOTS", call_cost)  # 0: every row attends in its own call
    target = Target.load(str(tiny_target_dirs["qwen3"]))
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(5, 300, (n,), generator=g) for n in (7, 3, 11)]
    cache = target.new_cache(3, 40, ragged=True)
    ids = torch.zeros(3, 11, dtype=torch.long)
    for b, p in enumerate(rows):
        ids[b, : p.numel()] = p
    out = target(ids, layers=[2], cache=cache, logits="all")
    cache.crop([p.numel() for p in rows])
    new = torch.randint(5, 300, (3, 2), generator=g)
    out2 = target(new, cache=cache, logits="all")
    for b, p in enumerate(rows):
        ref = target(torch.cat([p, new[b]])[None], layers=[2], logits="all")
        n = p.numel()
        torch.testing.assert_close(out.logits[b, :n], ref.logits[0, :n], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(out.hidden[2][b, :n], ref.hidden[2][0, :n], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(out2.logits[b], ref.logits[0, n:], atol=1e-4, rtol=1e-4)
    cache.select([0, 2])  # row 2 moves down to row 1, its used slots only
    assert cache.lengths == [9, 13] and cache.k.shape[1] == 2
    out3 = target(new[[0, 2], :1], cache=cache, logits="all")
    for b, r in enumerate([0, 2]):
        ref = target(torch.cat([rows[r], new[r], new[r, :1]])[None], logits="all")
        torch.testing.assert_close(out3.logits[b, 0], ref.logits[0, -1], atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="ascending"):
        cache.select([1, 0])


# ---------------------------------------------------------------------- greedy
def test_plain_batch_equals_each_prompt_alone(tiny_llama, prompts, alone):
    res = generate_plain_batch(tiny_llama, prompts, N_NEW)
    assert [r.tokens for r in res.rows] == alone
    assert res.num_steps == N_NEW - 1


@pytest.mark.parametrize("shape", [Chain(1), Chain(4), Block(3), DynamicTree(4, 2, 12)], ids=["chain1", "chain4", "block3", "tree"])
def test_batched_greedy_equals_plain(tiny_llama, prompts, alone, shape):
    """Rows of different prompt lengths accept different numbers of drafts at each step; each row
    still equals plain decoding, and the hidden states its proposer was handed equal a fresh
    forward over the same tokens (the per-row roll-back kept the right slots)."""
    oracle = _oracle(tiny_llama, prompts, alone)
    dec = Decoder(tiny_llama, oracle)
    forks = []
    oracle.batched = lambda n, shape: _record(Proposer.batched(oracle, n, shape), forks)
    res = dec.generate(prompts, N_NEW, shape)
    assert [r.tokens for r in res.rows] == alone
    per_row = [r.accept_lengths for r in res.rows]
    assert len({tuple(a) for a in per_row}) > 1, per_row  # rows did accept differently
    assert res.num_steps < N_NEW - 1  # drafts were accepted
    for prop, p, r in zip(forks, prompts, res.rows):
        logged = torch.cat([h[2] for h in prop.hidden_log], dim=1)
        full = tiny_llama(torch.tensor([p + r.tokens]), layers=[2], logits=None).hidden[2]
        torch.testing.assert_close(logged, full[:, : logged.shape[1]], atol=1e-4, rtol=1e-4)


def test_prompt_cache_gives_what_the_prefill_gives(tiny_llama, tiny_target_dirs, prompts, alone):
    """A prompt decoded again reuses its prefill: same tokens, same hidden states handed to the
    proposer; a prefill without the layers a proposer needs is computed again; least recently
    used prefills leave beyond the byte budget; another target's cache is refused."""
    from draftlab.inference.prefill import PromptCache
    from draftlab.models.target import Target

    cache = PromptCache(tiny_llama)
    for _ in range(2):
        assert [r.tokens for r in generate_plain_batch(tiny_llama, prompts, N_NEW, prompt_cache=cache).rows] == alone
    assert (cache.misses, cache.hits) == (3, 3)
    oracle = _oracle(tiny_llama, prompts, alone)
    forks = []
    oracle.batched = lambda n, shape: _record(Proposer.batched(oracle, n, shape), forks)
    dec = Decoder(tiny_llama, oracle)
    for n in range(2):  # plain decoding kept no hidden states: the first call computes them again
        assert [r.tokens for r in dec.generate(prompts, N_NEW, Chain(3), prompt_cache=cache).rows] == alone
        assert (cache.misses, cache.hits) == (6, 3 + 3 * n)
    assert len(forks) == 6
    for prop, p in zip(forks, prompts + prompts):  # both calls handed each proposer the prompt's own hidden states
        full = tiny_llama(torch.tensor([p]), layers=[2], logits=None).hidden[2]
        torch.testing.assert_close(prop.hidden_log[0][2], full, atol=1e-4, rtol=1e-4)
    one = max(e.bytes for e in cache._kept.values())
    small = PromptCache(tiny_llama, max_bytes=one)
    generate_plain_batch(tiny_llama, prompts, 2, prompt_cache=small)
    assert len(small._kept) == 1 and small.bytes <= one
    assert list(small._kept) == [tuple(prompts[-1])]  # the last put stays, the others left
    other = Target.load(str(tiny_target_dirs["qwen3"]))
    with pytest.raises(ValueError, match="another target"):
        generate_plain_batch(other, prompts, 2, prompt_cache=cache)


def test_prompt_cache_of_a_graphed_target_serves_both_loops(tiny_llama, prompts, alone):
    """A batch evaluation makes its prompt cache from the graphed target; the host loop prefills
    through the wrapper, the device loop through the model (on CUDA, plain decoding after a
    drafter's warm-up): both are that model's prefills."""
    from draftlab.inference.graphs import GraphedTarget
    from draftlab.inference.prefill import PromptCache

    graphed = GraphedTarget(tiny_llama, mode="replay")
    cache = PromptCache(graphed)
    for loop in ("host", "device"):
        out = Decoder(graphed, loop=loop).generate(prompts, N_NEW, None, prompt_cache=cache)
        assert [r.tokens for r in out.rows] == alone
    assert (cache.misses, cache.hits) == (3, 3)


def _record(rows, sink):
    sink.extend(rows.rows)
    return rows


def test_rows_leave_the_batch_at_their_own_end(tiny_llama, prompts, alone):
    """An eos that only row 1 emits (early) stops that row; the others go on to the length limit."""
    eos = alone[1][5]
    assert eos not in alone[0] + alone[2]
    oracle = _oracle(tiny_llama, prompts, alone)
    res = Decoder(tiny_llama, oracle).generate(prompts, N_NEW, Chain(3), eos_token_id=eos)
    plain = generate_plain_batch(tiny_llama, prompts, N_NEW, eos_token_id=eos)
    assert [r.tokens for r in res.rows] == [r.tokens for r in plain.rows]
    assert res.rows[1].tokens == alone[1][:6] and res.rows[1].stop_reason == "eos"
    assert [res.rows[b].stop_reason for b in (0, 2)] == ["length", "length"]


@pytest.mark.parametrize("algorithm,shape", [("eagle3", Chain(3)), ("eagle1", DynamicTree(3, 2, 8)), ("medusa", Chain(2)),
                                             ("diffusion", Block(3)), ("draft_lm", Chain(3)), ("draft_lm", DynamicTree(3, 2, 8)),
                                             ("ngram", Chain(3)), ("ngram", DynamicTree(3, 2, 8))])
def test_every_family_decodes_batches_losslessly(tiny_llama, prompts, alone, algorithm, shape):
    if algorithm == "ngram":
        proposer = NgramProposer(3, 1)
    else:
        cls = DRAFTERS.get(algorithm, "algorithm")
        torch.manual_seed(0)
        samples = random_samples(tiny_llama, 2)
        proposer = PROPOSERS.get(algorithm, "algorithm")(cls.build(cls.Config(), tiny_llama, samples))
    res = Decoder(tiny_llama, proposer).generate(prompts, N_NEW, shape)
    assert [r.tokens for r in res.rows] == alone


# ---------------------------------------------------------------------- sampling
def test_batched_sampling_preserves_each_rows_distribution(tiny_llama):
    """Two rows with different prompts, drafts with real probabilities: each row's first three
    tokens follow the target's top-k=3 distribution (chi-square), and the test has power."""
    ps = [tiny_llama.tokenizer(t)["input_ids"] for t in TEXTS[:2]]
    temperature, top_k, n = 1.0, 3, 500
    dec = Decoder(tiny_llama, PerturbedProposer(tiny_llama, scale=1.0, seed=5))
    assert_batch_follows_target(dec, tiny_llama, ps, temperature, top_k, n)


# ---------------------------------------------------------------------- the draft-length rule
def test_draft_length_rule_follows_cost_and_acceptance():
    """k maximises tokens(k) / cost(B, k); a batch size not calibrated takes the nearest; a draft
    must beat a plain step by the margin; acceptance seen moves the choice."""
    rule = DraftLength({1: [1.0, 1.1, 1.2], 16: [1.0, 1.5, 2.0]})
    assert rule.alpha() == [0.5, 0.5] and rule.tokens(2) == pytest.approx(1.75)
    assert rule(1) == 2 and rule(4) == 2  # 1.75 / 1.2 beats 1.5 / 1.1
    assert rule(16) == 0 and rule(9) == 0  # 1.5 / 1.5: a tie keeps plain decoding
    rule.observe([2] * 8, [0] * 8)  # every first draft rejected
    assert rule.alpha() == [0.1, 0.5] and rule(1) == 0
    assert DraftLength({1: [1.0, 1.0]}, margin=0.6)(1) == 0 and DraftLength({1: [1.0, 1.0]}, margin=0.4)(1) == 1
    with pytest.raises(DraftlabError, match="cost"):
        DraftLength({1: [1.1, 1.0]})


def test_draft_length_rule_counts_what_each_position_reached_and_accepted():
    rule = DraftLength({1: [1.0, 1.0, 1.0, 1.0]})
    rule.observe([3, 3, 0, 2], [0, 2, 0, 2])  # rejected at 1; accepted 1-2, rejected at 3; no draft; all of 2
    assert rule.reached == [3, 2, 1] and rule.accepted == [2, 2, 0]


def test_step_cost_reproduces_the_measured_speedup():
    # a draft giving 1.5 tokens a step at 1.2x a plain step's seconds: speedup 1.25, cost 1.2
    cost = step_cost(1.5, tokens=150, seconds=100 * 1.2, plain_tokens=100, plain_seconds=100)
    assert cost == pytest.approx(1.2)
    assert DraftLength({1: [1.0, cost]}, reached=[100], accepted=[50]).rate(1, 1) == pytest.approx(1.5 / 1.2, rel=0.01)


class Script:
    """A draft-length rule that plays ``ks`` then plain steps, and logs what it observed."""

    def __init__(self, ks):
        self.ks, self.asked, self.seen = list(ks), [], []

    def __call__(self, B):
        self.asked.append(B)
        return self.ks[len(self.asked) - 1] if len(self.asked) <= len(self.ks) else 0

    def observe(self, drafted, accepted):
        self.seen.append((drafted, accepted))


def test_plain_steps_of_the_speculative_decoder_are_plain_decoding(tiny_llama, prompts, monkeypatch):
    """k = 0 for every step: the same tokens as plain batched decoding, no draft and no verify kernel."""
    import draftlab.inference.decoder as decoder_module

    monkeypatch.setattr(decoder_module, "accept_chains", lambda *a, **k: pytest.fail("k = 0 ran the verify kernel"))
    plain = generate_plain_batch(tiny_llama, prompts, N_NEW)
    res = Decoder(tiny_llama, NgramProposer()).generate(prompts, N_NEW, Chain(3), draft_length=Script([]))
    assert [r.tokens for r in res.rows] == [r.tokens for r in plain.rows]
    assert res.draft_time == 0.0 and res.num_steps == plain.num_steps and set(res.draft_lengths) == {0}


def test_drafter_reads_every_step_kept_since_its_last_draft(tiny_llama, prompts, alone):
    """Plain steps cost the drafter nothing: before its next draft it reads every token kept since
    the last one (a step's after a drafting step, two steps' after a plain one), in one call."""
    oracle = _oracle(tiny_llama, prompts, alone)
    forks = []
    oracle.batched = lambda n, shape: _record(Proposer.batched(oracle, n, shape), forks)
    rule = Script([1, 1, 0, 1, 1])
    res = Decoder(tiny_llama, oracle).generate(prompts, N_NEW, Chain(3), draft_length=rule)
    assert [r.tokens for r in res.rows] == alone
    assert res.draft_lengths[:6] == [1, 1, 0, 1, 1, 0] and len(rule.seen) == 4
    kept = [[n + 1 for n in row.accept_lengths] for row in res.rows]  # tokens kept per step
    for row, prop in zip(kept, forks):
        read = [h[2].shape[1] for h in prop.hidden_log[1:]]  # after the prompt's
        assert read[:3] == [row[0], row[1] + row[2], row[3]]


def test_adaptive_decoding_stays_lossless(tiny_llama, prompts, alone):
    rule = Script([3, 0, 2, 0, 0, 1, 3])
    res = Decoder(tiny_llama, _oracle(tiny_llama, prompts, alone)).generate(prompts, N_NEW, Chain(3), draft_length=rule)
    assert [r.tokens for r in res.rows] == alone
    assert res.draft_lengths[:7] == rule.ks and len(res.draft_lengths) == res.num_steps == len(rule.asked)
    assert [d for d, _ in rule.seen][0] == [3, 3, 3] and rule.asked[0] == 3
    with pytest.raises(DraftlabError, match="chain and block"):
        Decoder(tiny_llama, NgramProposer()).generate(prompts, 4, DynamicTree(2, 2, 4), draft_length=rule)


def test_calibration_measures_each_k_against_plain_decoding(tiny_llama, prompts, alone, monkeypatch):
    """Per batch size, groups decoded plainly and at every k in lockstep; the rule's cost at k is
    what that decoding measured, and its acceptance starts from what those drafts showed."""
    import draftlab.inference.batch_eval as batch_eval

    seen = []
    real = batch_eval.step_cost
    monkeypatch.setattr(batch_eval, "step_cost", lambda *a: seen.append(a) or real(*a))
    spec = Speculation(_oracle(tiny_llama, prompts, alone), Chain(2), adaptive=True)
    rule = calibrate(tiny_llama, spec, prompts, [1, 3], max_new_tokens=8)
    assert set(rule.cost) == {1, 3} and all(len(c) == 3 and c[0] == 1.0 for c in rule.cost.values())
    # (tau, tokens, seconds, plain tokens, plain seconds): two groups of B prompts x 8 tokens each
    assert [(a[1], a[3]) for a in seen] == [(16, 16), (16, 16), (48, 48), (48, 48)] and all(a[2] > 0 for a in seen)
    assert [rule.cost[B][k] for B in (1, 3) for k in (1, 2)] == pytest.approx([real(*a) for a in seen])
    assert rule.reached[0] > 0 and 0 < rule.accepted[0] < rule.reached[0]  # the oracle corrupts some drafts


def test_adaptive_policy_drafts_no_further_than_the_drafter_was_trained(tiny_llama, prompts, alone, tmp_path):
    """An EAGLE-3 checkpoint trained with ttt_steps = 2 drafts at most 2 under the adaptive policy
    (a third position reads drafter outputs no step trained it to read); fixed shapes are as asked.
    EAGLE-1 (a feature loss trains every position it drafts) and a checkpoint without a recipe: no bound."""
    from draftlab.inference.proposer import load_proposer
    from tiny import save_checkpoint

    torch.manual_seed(0)
    samples = random_samples(tiny_llama, 2)
    built = {a: DRAFTERS.get(a, "algorithm") for a in ("eagle3", "eagle1")}
    built = {a: cls.build(cls.Config(), tiny_llama, samples) for a, cls in built.items()}
    three = load_proposer(save_checkpoint(built["eagle3"], tiny_llama, tmp_path / "e3", recipe={"loss": {"ttt_steps": 2}}),
                          tiny_llama)
    assert three.trained_depth == 2
    assert [Speculation(three, Chain(k), True).depth for k in (1, 3)] == [1, 2]
    assert load_proposer(save_checkpoint(built["eagle3"], tiny_llama, tmp_path / "bare"), tiny_llama).trained_depth is None
    one = load_proposer(save_checkpoint(built["eagle1"], tiny_llama, tmp_path / "e1", recipe={"loss": {}}), tiny_llama)
    assert one.trained_depth is None and Speculation(one, Chain(3), True).depth == 3
    ps = [EvalPrompt("c", p, str(i)) for i, p in enumerate(prompts)]
    rep = evaluate_batches(tiny_llama, three, ps, Chain(3), [1, 3], max_new_tokens=N_NEW, adaptive=True)
    assert rep["adaptive_max_k"] == 2 and len(rep["entries"][0]["alpha_estimate"]) == 2
    assert all(set(e["draft_lengths"]) <= {"0", "1", "2"} for e in rep["entries"])
    assert all(len(c) == 3 for c in rep["draft_length_rule"]["cost"].values())




# ---------------------------------------------------------------------- evaluation and CLI
def test_evaluate_batches_reports_each_batch_size(tiny_llama, prompts, alone):
    ps = [EvalPrompt("c", p, str(i)) for i, p in enumerate(prompts * 2)]
    rep = evaluate_batches(tiny_llama, _oracle(tiny_llama, prompts, alone), ps, Chain(3), [1, 4], max_new_tokens=N_NEW,
                           adaptive=True)
    assert [e["batch_size"] for e in rep["entries"]] == [1, 4]
    for e in rep["entries"]:
        assert e["greedy_match"] == "6/6" and e["new_tokens"] == 6 * N_NEW
        assert e["speedup"] == pytest.approx(e["tokens_per_s"] / e["baseline_tokens_per_s"])
        split = e["draft_s"] + e["verify_s"] + e["other_s"]
        assert split == pytest.approx(e["decode_time_s"], rel=1e-6) and e["prefill_s"] > 0
        assert set(e["draft_lengths"]) <= {"0", "1", "2", "3"} and len(e["alpha_estimate"]) == 3
    assert rep["entries"][1]["batched_vs_alone"] == "6/6"
    assert set(rep["draft_length_rule"]["cost"]) == {"1", "4"}
    # at least 3 timed groups per batch size: batch 4 of 6 prompts (2 groups) decodes them twice
    rep = evaluate_batches(tiny_llama, NgramProposer(), ps, Chain(2), [1, 4], max_new_tokens=4, min_groups=3)
    one, four = rep["entries"]
    assert one["greedy_match"] == "6/6" and four["greedy_match"] == "12/12" and four["batched_vs_alone"] == "12/12"


def test_compare_batches_measures_every_configuration_against_one_plain_decoding(tiny_llama, prompts, alone, monkeypatch):
    """Each group is decoded once by plain decoding and once by each configuration, in lockstep in
    the crossover orders group by group; every configuration's speedup is over that one plain
    decoding. ``adaptive_groups`` more groups then go to plain decoding and the adaptive
    configuration alone, pooled into its entry."""
    import draftlab.inference.batch_eval as batch_eval

    calls = []
    decode = Decoder.steps
    monkeypatch.setattr(Decoder, "steps",
                        lambda self, *a, **k: calls.append(self.proposer.name if self.proposer else "plain") or decode(self, *a, **k))
    ps = [EvalPrompt("c", p, str(i)) for i, p in enumerate(prompts)]
    specs = {"ngram": Speculation(NgramProposer(), Chain(2)),
             "oracle adaptive": Speculation(_oracle(tiny_llama, prompts, alone), Chain(3), adaptive=True)}
    res = compare_batches(tiny_llama, specs, ps, [1, 3], max_new_tokens=N_NEW, min_groups=4, adaptive_groups=2)
    # batch 1: the 3 groups twice, batch 3: the one group 4 times, 3 decodings each; then 2 groups of 2 at each
    timed = calls[-(3 * (6 + 4) + 2 * 2 * 2):]
    names = ["plain", "ngram", "row-oracle"]
    assert [timed[3 * g : 3 * g + 3] for g in range(6)] == [[names[i] for i in o] for o in crossover_orders(3)]
    assert timed[3 * 3 : 3 * 4] == ["row-oracle", "ngram", "plain"]  # not a rotation: plain also runs after ngram
    assert timed[18:22] == ["plain", "row-oracle", "row-oracle", "plain"] == timed[-4:]
    for b, n_groups in ((0, 6), (1, 4)):
        ngram, oracle = res["ngram"]["entries"][b], res["oracle adaptive"]["entries"][b]
        assert len(ngram["groups"]) == n_groups and len(oracle["groups"]) == n_groups + 2
        assert [g[2:] for g in ngram["groups"]] == [g[2:] for g in oracle["groups"][:n_groups]]
        for e, rows in ((ngram, n_groups * (b * 2 + 1)), (oracle, (n_groups + 2) * (b * 2 + 1))):
            lo, hi = e["speedup_interval"]
            assert lo <= e["speedup"] <= hi and e["greedy_match"] == f"{rows}/{rows}"
            assert e["new_tokens"] == rows * N_NEW
    assert res["ngram"]["entries"][1]["batched_vs_alone"] == res["oracle adaptive"]["entries"][1]["batched_vs_alone"] == "12/12"
    assert res["oracle adaptive"]["draft_length_rule"] and res["ngram"]["draft_length_rule"] is None


def test_lockstep_runs_a_step_of_each_in_turn_and_times_each_alone(tiny_llama, prompts, alone):
    """run_lockstep advances each decoding one step in turn (to the end of the longest), returns
    each one's result, and a decoding's times leave out the steps of the others it waited on."""
    log = []

    def stepper(name, n, pause=0.0):
        for i in range(n):
            time.sleep(pause)
            log.append(name)
            yield
        return name

    assert run_lockstep([stepper("a", 3), stepper("b", 1), stepper("c", 2)]) == ["a", "b", "c"]
    assert log == ["a", "b", "c", "a", "c", "a"]
    alone_res = generate_plain_batch(tiny_llama, prompts, N_NEW)
    res, _ = run_lockstep([Decoder(tiny_llama).steps(prompts, N_NEW, None), stepper("slow", N_NEW + 2, pause=0.05)])
    assert [r.tokens for r in res.rows] == alone and res.num_steps == alone_res.num_steps
    # the slow decoding slept 0.05 s after each of plain decoding's N_NEW - 1 steps
    assert res.total_time < 0.05 * (N_NEW - 1) / 2 and res.total_time < 5 * alone_res.total_time + 0.05


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6])
def test_crossover_orders_balance_position_and_predecessor(n):
    orders = crossover_orders(n)
    assert len(orders) == (n if n % 2 == 0 else 2 * n) and all(sorted(o) == list(range(n)) for o in orders)
    positions = Counter((i, x) for o in orders for i, x in enumerate(o))
    follows = Counter(pair for o in orders for pair in zip(o, o[1:]))
    assert len(positions) == n * n and len(set(positions.values())) == 1
    assert len(follows) == n * (n - 1) and len(set(follows.values())) == 1


def test_speedup_interval_is_a_bootstrap_over_groups():
    same = [(10, 1.0, 10, 2.0)] * 4  # every group 2x: no spread
    assert speedup_interval(same) == pytest.approx([2.0, 2.0])
    mixed = [(10, 1.0, 10, 1.0), (10, 1.0, 10, 3.0)] * 5  # 1x and 3x groups: 2x over the sums, spread around it
    lo, hi = speedup_interval(mixed)
    assert 1.0 < lo < 2.0 < hi < 3.0
    assert speedup_interval([]) is None


def test_eval_cli_batch_sizes(tiny_target_dirs, tmp_path, capsys):
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"category": c, "turns": [t]}) + "\n" for c, t in zip("xyx", TEXTS)))
    report = tmp_path / "r.json"
    base = ["eval", "--drafter", "ngram", "--target", str(tiny_target_dirs["llama"]), "--data", str(data),
            "--max-new-tokens", "12", "--k", "3"]
    assert cli_main(base + ["--batch-sizes", "1,3", "--adaptive", "--report", str(report)]) == 0
    rep = json.loads(report.read_text())
    assert [e["batch_size"] for e in rep["batches"]["entries"]] == [1, 3] and rep["batches"]["adaptive"]
    assert report.with_suffix(".batch.png").is_file()
    assert "| batch | tok/s" in report.with_suffix(".md").read_text()
    for bad, msg in ((["--batch-sizes", "1,x"], "--batch-sizes: expected comma-separated integers"),
                     (["--batch-sizes", "0,2"], "--batch-sizes: expected distinct integers >= 1"),
                     (["--adaptive"], "--adaptive chooses"),
                     (["--batch-sizes", "2", "--method", "tree", "--adaptive"], "--adaptive chooses")):
        capsys.readouterr()
        assert cli_main(base + bad) != 0
        err = capsys.readouterr().err.strip()
        assert msg in err and "\n" not in err and "Traceback" not in err


def test_parse_batch_sizes():
    assert parse_batch_sizes("1,2, 4") == [1, 2, 4]
    with pytest.raises(DraftlabError, match="distinct"):
        parse_batch_sizes("2,2")


def _started_rows(tiny_llama, prompts, alone, algorithm, shape, batched_cls):
    """A random drafter's proposer and two RowProposers for the three prompts, both started: the
    family's own (``batched_cls``, drafting every row at once) and the default one fork per row."""
    from draftlab.inference.sampling import Sampling

    torch.manual_seed(0)
    cls = DRAFTERS.get(algorithm, "algorithm")
    proposer = PROPOSERS.get(algorithm, "algorithm")(cls.build(cls.Config(), tiny_llama, random_samples(tiny_llama, 2)))
    together, by_row = proposer.batched(3, shape), Proposer.batched(proposer, 3, shape)
    assert isinstance(together, batched_cls) and not isinstance(by_row, batched_cls)
    for props in (together, by_row):
        props.configure(Sampling())
        for b, p in enumerate(prompts):
            props.start(b, torch.tensor(p), tiny_llama(torch.tensor([p]), layers=list(proposer.layers)).hidden, alone[b][0])
    return proposer, together, by_row


def _advance_rows(tiny_llama, prompts, alone, layers, kept, *row_proposers):
    """Advance each row by its next ``kept[r]`` greedy tokens, with the target's hidden states."""
    acc, hid = [], []
    for r, n in enumerate(kept):
        seq = prompts[r] + alone[r][: n + 1]
        acc.append(torch.tensor(alone[r][1 : n + 1]))
        out = tiny_llama(torch.tensor([seq]), layers=list(layers))
        hid.append({i: h[:, len(prompts[r]) : len(prompts[r]) + n] for i, h in out.hidden.items()})
    for props in row_proposers:
        props.advance(acc, hid, list(range(len(kept))))


@pytest.mark.parametrize("confident", [False, True])
def test_eagle_chains_drafted_together_equal_row_by_row(tiny_llama, prompts, alone, confident):
    """EAGLE's batched chains (one drafter forward per position for all rows, aligned cache
    slots with per-row masks) draft what each row's own proposer drafts, also after rows kept
    different numbers of tokens; and decode losslessly."""
    from draftlab.inference.eagle import EagleChains

    proposer, together, by_row = _started_rows(tiny_llama, prompts, alone, "eagle3", Chain(4), EagleChains)
    # a threshold between the rows' first top-1 probabilities: some rows draft, others stop at once
    first = together.last_logits.softmax(-1).max(-1).values.sort().values
    min_confidence = float(first[:2].mean()) if confident else 0.0
    shape = Chain(4, min_confidence)
    kept = [1, 3, 2]  # tokens each row keeps at the first step
    for step in range(2):
        a, b = together.propose(shape), by_row.propose(shape)
        assert [d.tokens.tolist() for d in a] == [d.tokens.tolist() for d in b]
        if min_confidence:
            assert len({d.tokens.numel() for d in a}) > 1, [d.tokens for d in a]  # rows stopped on their own
        if step == 0:
            _advance_rows(tiny_llama, prompts, alone, proposer.layers, kept, together, by_row)
    # rows leave: the first leaves its drafter cache row in place, the second halves the cache
    for rows, cache_rows in (([0, 2], 3), ([1], 1)):
        for props in (together, by_row):
            props.select(rows)
        assert together.cache.k[0].shape[0] == cache_rows
        a, b = together.propose(shape), by_row.propose(shape)
        assert len(a) == len(rows) and [d.tokens.tolist() for d in a] == [d.tokens.tolist() for d in b]
    res = Decoder(tiny_llama, proposer).generate(prompts, N_NEW, shape)
    assert [r.tokens for r in res.rows] == alone


def test_medusa_drafts_all_rows_at_once_as_each_row_alone(tiny_llama, prompts, alone):
    """MedusaRows runs each head once over every row's state: the same chains (with per-row
    min_confidence stops) and static trees as the rows drafting one by one."""
    from draftlab.inference.medusa import MedusaRows
    from draftlab.inference.shapes import StaticTree

    proposer, together, by_row = _started_rows(tiny_llama, prompts, alone, "medusa", Chain(3), MedusaRows)
    tree = StaticTree(((0,), (1,), (0, 0), (1, 0)))
    last = torch.cat([p.last for p in together.rows])
    first = torch.stack([proposer.drafter.head_logits(last, 0).softmax(-1).max(-1).values]).flatten().sort().values
    for shape in (Chain(3), Chain(3, float(first[:2].mean())), tree):
        a, b = together.propose(shape), by_row.propose(shape)
        assert [d.tokens.tolist() for d in a] == [d.tokens.tolist() for d in b]
        if isinstance(shape, Chain) and shape.min_confidence:
            assert len({d.tokens.numel() for d in a}) > 1  # rows stopped on their own
    for shape in (Chain(3), tree):
        res = Decoder(tiny_llama, proposer).generate(prompts, N_NEW, shape)
        assert [r.tokens for r in res.rows] == alone


def test_diffusion_drafts_all_rows_in_one_forward_as_each_row_alone(tiny_llama, prompts, alone):
    """DiffusionRows pads the rows' contexts into one drafter forward: the same blocks as the rows
    drafting one by one, also after rows kept different counts."""
    from draftlab.inference.diffusion import DiffusionRows

    shape = Block(3)
    proposer, together, by_row = _started_rows(tiny_llama, prompts, alone, "diffusion", shape, DiffusionRows)
    for step in range(2):
        a, b = together.propose(shape), by_row.propose(shape)
        assert [d.tokens.tolist() for d in a] == [d.tokens.tolist() for d in b]
        if step == 0:
            _advance_rows(tiny_llama, prompts, alone, proposer.layers, [1, 3, 2], together, by_row)
    res = Decoder(tiny_llama, proposer).generate(prompts, N_NEW, shape)
    assert [r.tokens for r in res.rows] == alone


def test_reports_draw_alpha1_bars_and_speedup_by_batch(tmp_path, monkeypatch):
    """One draft position: alpha_1 per category as bars; a batches section: its own PNG, both
    linked from the Markdown."""
    from draftlab.inference import report as rp

    drawn = []
    bars = rp._alpha1_bars
    monkeypatch.setattr(rp, "_alpha1_bars", lambda ax, r: drawn.append(r["label"]) or bars(ax, r))
    entries = [{"batch_size": b, "speedup": s, "tokens_per_s": 1.0, "baseline_tokens_per_s": 1.0, "tau": 1.3, "draft_s": 0.0,
                "verify_s": 0.0, "other_s": 0.0, "prefill_s": 0.0} for b, s in ((1, 1.1), (4, 0.9))]
    one = {"label": "k1", "alpha": [0.4], "tau": 1.4, "categories": {"code": {"alpha": [0.5]}, "chat": {"alpha": [0.3]}},
           "batches": {"adaptive": False, "entries": entries}}
    paths = rp.write_report(one, tmp_path / "one.json")
    assert drawn == ["k1"] and paths["batch_plot"].is_file()
    assert "![acceptance](one.png) ![speedup by batch size](one.batch.png)" in paths["markdown"].read_text()
    rp.write_report({"label": "k3", "alpha": [0.4, 0.3, 0.2], "tau": 1.6, "categories": one["categories"]}, tmp_path / "three.json")
    assert drawn == ["k1"]  # three positions: curves, not bars


@pytest.mark.parametrize("shape", [None, Chain(3), DynamicTree(3, 2, 8)], ids=["plain", "chain", "tree"])
def test_finished_rows_idle_then_compacted(tiny_llama, prompts, alone, shape, monkeypatch):
    """Rows 1 and 3 stop at an early eos: they idle in the cache, which is compacted once half of
    its rows are idle (one copy, not one per finished row); the rows still decoding are unchanged."""
    from draftlab.models.target import RaggedKVCache

    eos = alone[1][5]
    four, refs = prompts + [prompts[1]], alone + [alone[1]]
    selects = []
    select = RaggedKVCache.select
    monkeypatch.setattr(RaggedKVCache, "select", lambda self, rows: selects.append(list(rows)) or select(self, rows))
    if shape is None:
        res = generate_plain_batch(tiny_llama, four, N_NEW, eos_token_id=eos)
    else:
        res = Decoder(tiny_llama, _oracle(tiny_llama, four, refs)).generate(four, N_NEW, shape, eos_token_id=eos)
    assert [r.tokens for r in res.rows] == [alone[0], alone[1][:6], alone[2], alone[1][:6]]
    slots = _cache_slots([torch.tensor(p) for p in four])
    assert selects[0] == sorted([slots[0], slots[2]]) and len(selects) <= 2  # then possibly one more: at most log2(4) copies


def test_a_row_finishing_mid_step_leaves_room(tiny_llama, prompts, alone):
    """A row that ends at its token budget inside an accepted run has more in its cache than it
    emitted; idling it must not overflow the cache (it did once: 2557 slots needed, 2556 held)."""
    long = [prompts[1], prompts[0], prompts[2], prompts[0]]
    refs = {tuple(p): r for p, r in zip(prompts, alone)}

    class LongestFirst(RowOracle):  # the longest prompt's row accepts everything, the others nothing
        def start(self, prompt_ids, hidden, next_token):
            super().start(prompt_ids, hidden, next_token)
            self.corrupt = 0.0 if len(self.prompt) == len(prompts[1]) else 1.0

    res = Decoder(tiny_llama, LongestFirst(refs, tiny_llama.vocab_size)).generate(long, 7, Chain(4))
    assert res.rows[0].num_steps == 2 and res.rows[1].num_steps == 6
    assert [r.tokens for r in res.rows] == [refs[tuple(p)][:7] for p in long]
