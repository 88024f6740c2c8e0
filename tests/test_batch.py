"""Batched speculative decoding: the per-row KV cache, greedy outputs equal to plain batched
decoding (chains, trees, every family, rows of different lengths that finish at different
steps), lossless sampling at B > 1, the adaptive draft length and ``draftlab eval --batch-sizes``."""

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
from draftlab.inference import adaptive
from draftlab.inference.adaptive import AdaptiveDraftLength, VerifyCost, attended_context
from draftlab.inference.batch_eval import (Speculation, compare_batches, crossover_orders, evaluate_batches, parse_batch_sizes,
                                          speedup_interval)
from draftlab.inference.decoder import (BatchedSpeculativeDecoder, _cache_slots, generate_plain, generate_plain_batch,
                                        plain_batch_steps, run_lockstep)
from draftlab.inference.ngram import NgramProposer
from draftlab.inference.prompts import EvalPrompt
from draftlab.inference.proposer import PROPOSERS, Block, Chain, ChainDraft, DraftTree, DynamicTree, Proposer
from draftlab.models.drafter import DRAFTERS
from test_decoder import PerturbedProposer
from tiny import assert_follows_target, random_samples

TEXTS = ["The quick brown fox jumps", "Speculative decoding drafts tokens and the target verifies them all at once",
         "a b c a b c a b"]
N_NEW = 24


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def prompts(tiny_llama):
    return [tiny_llama.tokenizer(t)["input_ids"] for t in TEXTS]


@pytest.fixture(scope="module")
def alone(tiny_llama, prompts):
    """Each prompt's plain greedy continuation, decoded alone (batch 1)."""
    return [generate_plain(tiny_llama, p, N_NEW).tokens for p in prompts]


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
    dec = BatchedSpeculativeDecoder(tiny_llama, oracle)
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
    from draftlab.inference.decoder import PromptCache
    from draftlab.models.target import Target

    cache = PromptCache(tiny_llama)
    for _ in range(2):
        assert [r.tokens for r in generate_plain_batch(tiny_llama, prompts, N_NEW, prompt_cache=cache).rows] == alone
    assert (cache.misses, cache.hits) == (3, 3)
    oracle = _oracle(tiny_llama, prompts, alone)
    forks = []
    oracle.batched = lambda n, shape: _record(Proposer.batched(oracle, n, shape), forks)
    dec = BatchedSpeculativeDecoder(tiny_llama, oracle)
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


def _record(rows, sink):
    sink.extend(rows.rows)
    return rows


def test_rows_leave_the_batch_at_their_own_end(tiny_llama, prompts, alone):
    """An eos that only row 1 emits (early) stops that row; the others go on to the length limit."""
    eos = alone[1][5]
    assert eos not in alone[0] + alone[2]
    oracle = _oracle(tiny_llama, prompts, alone)
    res = BatchedSpeculativeDecoder(tiny_llama, oracle).generate(prompts, N_NEW, Chain(3), eos_token_id=eos)
    plain = generate_plain_batch(tiny_llama, prompts, N_NEW, eos_token_id=eos)
    assert [r.tokens for r in res.rows] == [r.tokens for r in plain.rows]
    assert res.rows[1].tokens == alone[1][:6] and res.rows[1].stop_reason == "eos"
    assert [res.rows[b].stop_reason for b in (0, 2)] == ["length", "length"]


@pytest.mark.parametrize("algorithm,shape", [("eagle3", Chain(3)), ("eagle1", DynamicTree(3, 2, 8)), ("medusa", Chain(2)),
                                             ("diffusion", Block(3)), ("ngram", Chain(3)), ("ngram", DynamicTree(3, 2, 8))])
def test_every_family_decodes_batches_losslessly(tiny_llama, prompts, alone, algorithm, shape):
    if algorithm == "ngram":
        proposer = NgramProposer(3, 1)
    else:
        cls = DRAFTERS.get(algorithm, "algorithm")
        torch.manual_seed(0)
        samples = random_samples(tiny_llama, 2)
        proposer = PROPOSERS.get(algorithm, "algorithm")(cls.build(cls.Config(), tiny_llama, samples))
    res = BatchedSpeculativeDecoder(tiny_llama, proposer).generate(prompts, N_NEW, shape)
    assert [r.tokens for r in res.rows] == alone


# ---------------------------------------------------------------------- sampling
def test_batched_sampling_preserves_each_rows_distribution(tiny_llama):
    """Two rows with different prompts, drafts with real probabilities: each row's first three
    tokens follow the target's top-k=3 distribution (chi-square), and the test has power."""
    ps = [tiny_llama.tokenizer(t)["input_ids"] for t in TEXTS[:2]]
    temperature, top_k, n = 1.0, 3, 500
    dec = BatchedSpeculativeDecoder(tiny_llama, PerturbedProposer(tiny_llama, scale=1.0, seed=5))
    counts = [Counter(), Counter()]
    accepted = Counter()
    for s in range(n):
        res = dec.generate(ps, 3, Chain(2), temperature=temperature, top_k=top_k, seed=s)
        for b in range(2):
            counts[b][tuple(res.rows[b].tokens)] += 1
            accepted.update(res.rows[b].accept_lengths[:1])
    assert len(accepted) == 3, accepted
    for b, p in enumerate(ps):
        assert_follows_target(counts[b], tiny_llama, p, 3, temperature, top_k, n)


# ---------------------------------------------------------------------- adaptive draft length
def _cost(verify_per_token):
    return VerifyCost({(1, k, 64): 1.0 + verify_per_token * k for k in range(4)})


def test_adaptive_policy_follows_cost_and_acceptance():
    # verifying extra tokens is nearly free and drafts are always accepted: draft the most
    cheap = AdaptiveDraftLength(_cost(0.01), max_k=3)
    cheap.observe(1, 3, [3] * 20, draft_seconds=0.0)
    assert cheap.choose(1) == 3
    # a verified token costs as much as a plain step: no acceptance could pay, so no draft and no probe
    dear = AdaptiveDraftLength(_cost(1.0), max_k=3)
    assert [dear.choose(1) for _ in range(5)] == [0] * 5
    # alpha with a Laplace prior: (accepted + 1) / (reached + 2)
    dear.observe(1, 3, [0] * 20)
    assert dear.alpha()[0] == pytest.approx(1 / 22)
    # drafting cost counts: the same acceptance with dear drafting chooses shorter drafts
    slow = AdaptiveDraftLength(_cost(0.01), max_k=3)
    slow.observe(1, 3, [1] * 20, draft_seconds=3 * 0.5)
    fast = AdaptiveDraftLength(_cost(0.01), max_k=3)
    fast.observe(1, 3, [1] * 20, draft_seconds=3 * 0.001)
    assert slow.choose(1) == 1 < fast.choose(1)
    assert slow.draft_seconds(4, 2) == pytest.approx(1.0)  # measured at B=1, the nearest
    slow.observe(1, 3, [1] * 20, draft_seconds=None)  # a catch-up after plain steps: not a drafting cost
    assert slow.drafting[1] == [1.5, 3]


def test_adaptive_policy_prices_the_wait_for_a_batchs_last_row():
    """A batch that ends with its last row: drafting spreads the rows apart, and the expected
    largest of B rows' step counts grows with B (Blom's c_B: 0 for one row, 1.05 for 4). With
    alpha 0.33 and a draft step at 1.2x a plain one, k = 1 pays per token (1.33 / 1.2 > 1.05)
    at batch 1 and, counting the wait for the slowest of 4 rows, not at batch 4 (47 / 37.5 / 1.2); without
    ``remaining`` every token counts alike, as rows replaced when they end would."""
    A = AdaptiveDraftLength
    assert A.token_variance(0, [0.5]) == 0.0
    assert A.token_variance(1, [0.33]) == pytest.approx(0.33 * 0.67)  # 1 or 2 tokens
    assert A.token_variance(2, [1.0, 0.5]) == pytest.approx(0.25)  # 2 or 3 tokens
    assert A.batch_steps(0, [([0.3], 47), ([0.9], 40)]) == 47  # plain: the row with most left
    one = A.batch_steps(1, [([0.33], 47)])
    assert one == pytest.approx(47 / 1.33)
    four = A.batch_steps(1, [([0.33], 47)] * 4)
    assert four == pytest.approx(47 / 1.33 + 1.049 * (47 * 0.33 * 0.67 / 1.33 ** 3) ** 0.5, rel=1e-3)  # exact c_4: 1.029
    assert A.batch_steps(1, [([0.33], 47), ([0.1], 47)]) > A.batch_steps(1, [([0.33], 47)] * 2)  # the laggard decides

    policy = AdaptiveDraftLength(VerifyCost({(b, k, 64): 1.0 + 0.2 * k for b in (1, 4) for k in range(2)}), max_k=1,
                                 confidence=0.0)
    policy.observe(1, 1, [1] * 330 + [0] * 670, draft_seconds=0.0)  # alpha 0.33
    for b in (1, 4):
        for _ in range(4):  # both kinds measured: no cost probes
            for k in (0, 1):
                policy.observe(b, k, [0] * b, step_seconds=1.0 + 0.2 * k)
    assert policy.choose(1, remaining=[47]) == 1
    assert policy.choose(4, remaining=[47] * 4) == 0
    assert policy.choose(4) == 1  # rows replaced as they end: 1.33 / 1.2 > 1.05


def test_adaptive_policy_prices_the_drafters_catch_up():
    """Before a draft the drafter reads the tokens kept since its last one: a line through the
    catch-ups measured (0.04 s + 0.01 s a token here). With alpha 0.33 and a draft step at 1.2x a
    plain one, a draft after one step's token pays (1.33 / 1.25 > 1.05); after 30 plain steps'
    tokens it does not (1.33 / 1.54); with the row's 47 tokens left, that catch-up is paid once
    over the 35 steps to come, and each later step's catch-up reads that step's tokens."""
    policy = AdaptiveDraftLength(VerifyCost({(1, k, 64): 1.0 + 0.2 * k for k in range(2)}), max_k=1, confidence=0.0)
    policy.observe(1, 1, [1] * 330 + [0] * 670, draft_seconds=0.0)  # alpha 0.33
    for _ in range(4):  # both kinds measured: no cost probes
        for k in (0, 1):
            policy.observe(1, k, [0], step_seconds=1.0 + 0.2 * k)
    assert policy.catch_up_seconds(1, 5) == 0.0  # none measured yet
    for tokens in (1, 2, 41):
        policy.observe(1, 1, [0], draft_seconds=0.0, catch_up=(0.04 + 0.01 * tokens, tokens))
    assert policy.catch_up_seconds(1, 11) == pytest.approx(0.15) and policy.catch_up_seconds(4, 11) == pytest.approx(0.15)
    assert policy.catch_up_seconds(1, 0) == 0.0
    assert policy.choose(1, pending=[1]) == 1 and policy.choose(1, pending=[30]) == 0
    assert policy.choose(1, remaining=[47], pending=[30]) == 1
    e = 1 + policy.alpha()[0]
    plain, draft = policy.rates(1, ["pooled"], policy.alpha, remaining=[47], pending=30)
    assert draft == pytest.approx(47 / (47 / e * 1.2 + (47 / e - 1) * (0.04 + 0.01 * e) + 0.34))


def test_adaptive_policy_holds_a_plain_step_chosen_by_a_wide_margin():
    """A plain step that beats every draft by m % stands for the next m steps too (at most
    ``memory``): ``held()`` says how many steps the choice covers; a draft, or a plain step
    won narrowly, covers its own step only."""
    policy = AdaptiveDraftLength(VerifyCost({(4, k, 64): 1.0 + 0.6 * k for k in range(2)}), max_k=1, confidence=0.0)
    policy.observe(4, 1, [1] * 330 + [0] * 670, draft_seconds=0.0)  # alpha 0.33
    for _ in range(4):  # both kinds measured: no cost probes
        for k in (0, 1):
            policy.observe(4, k, [0] * 4, step_seconds=1.0 + 0.6 * k)
    assert policy.choose(4, remaining=[40] * 4) == 0
    plain, draft = policy.rates(4, ["pooled"] * 4, policy.alpha, remaining=[40] * 4)
    assert plain / draft > 1 + policy.memory / 100  # 1.6 a step for 1.33 tokens, waiting for the last of 4 rows
    assert policy.held() == 1 + policy.memory
    narrow = AdaptiveDraftLength(VerifyCost({(1, k, 64): 1.0 + 0.3 * k for k in range(2)}), max_k=1, confidence=0.0)
    narrow.observe(1, 1, [1] * 260 + [0] * 740, draft_seconds=0.0)  # alpha 0.26: 1.26 tokens for 1.3
    for _ in range(4):
        for k in (0, 1):
            narrow.observe(1, k, [0], step_seconds=1.0 + 0.3 * k)
    assert narrow.choose(1) == 0
    plain, draft = narrow.rates(1, ["pooled"], narrow.alpha)
    assert narrow.held() == 1 + int(100 * (plain / draft - 1)) < 1 + narrow.memory
    narrow.observe(1, 1, [1] * 3000, draft_seconds=0.0)  # now drafting pays
    assert narrow.choose(1) == 1 and narrow.held() == 1


def test_decoder_takes_the_plain_steps_a_policy_held_without_asking(tiny_llama, prompts, alone):
    """After a choice of 0 covering n steps (``held()``), the decoder takes the next n - 1 steps
    plain without calling ``choose`` or ``observe``, and asks again at once when a row ends."""
    eos = alone[1][5]  # row 1 ends at step 4 (its first token came from the prefill)
    assert eos not in alone[0] + alone[2]

    class Hold:
        def __init__(self):
            self.asked, self.observed = [], 0

        def choose(self, B, previous, lengths, remaining, pending):
            self.asked.append(N_NEW - 1 - max(remaining))  # the step about to run
            return 0

        def held(self):
            return 3

        def observe(self, *args):
            self.observed += 1

    policy = Hold()
    res = BatchedSpeculativeDecoder(tiny_llama, NgramProposer()).generate(prompts, N_NEW, Chain(3), policy=policy,
                                                                          eos_token_id=eos)
    assert [r.tokens for r in res.rows] == [r.tokens for r in generate_plain_batch(tiny_llama, prompts, N_NEW, eos_token_id=eos).rows]
    assert policy.asked == [0, 3, 5, 8, 11, 14, 17, 20] and policy.observed == len(policy.asked)
    assert res.draft_lengths == [0] * res.num_steps == [0] * (N_NEW - 1)


def test_adaptive_policy_drafts_after_accepted_runs():
    """Acceptance comes in runs: rows that accepted their last draft accept the next, rows that
    rejected it do not. Pooled (alpha 0.5) a draft that costs 0.6 of a step does not pay; per
    context it pays for a batch of rows that just accepted, and not otherwise."""
    policy = AdaptiveDraftLength(_cost(0.6), max_k=1)
    after_accept, after_reject = (1, 1), (1, 0)
    for _ in range(100):
        policy.choose(2, [after_accept, after_reject])
        policy.observe(2, 1, [1, 0])
    assert policy.alpha()[0] == pytest.approx(0.5)
    assert policy.alpha("all")[0] > 0.95 and policy.alpha("rejected")[0] < 0.05
    assert policy.choose(2, [after_accept, after_accept]) == 1
    assert policy.choose(2, [after_reject, after_reject]) == 0
    assert policy.choose(2, [after_accept, after_reject]) == 0  # (2 + 1) / 1.6 < 2 / 1
    assert policy.choose(2, [None, None]) == 0  # no draft yet: the pooled 0.5
    assert set(policy.alpha_by_context()) == {"rejected", "all"}


def test_adaptive_policy_probes_until_acceptance_is_known():
    """k = 1 pays when alpha_1 > 0.5 (a verified token costs half a step). Acceptance 0.4 seen on
    few rows: the optimistic bound still allows > 0.5, so the policy probes k = 1; on many rows
    it stops probing for good."""
    policy = AdaptiveDraftLength(_cost(0.5), max_k=1)
    for _ in range(4):  # first the plain steps it has not timed (within the 10 % of step noise)
        assert policy.choose(1) == 0
        policy.observe(1, 0, [0], step_seconds=1.0)
    assert policy.choose(1) == 1  # nothing seen yet: probe
    policy.observe(1, 1, [1, 1, 0, 0, 0])
    assert policy.choose(1) == 1
    policy.observe(1, 1, [1] * 200 + [0] * 300)
    assert [policy.choose(1) for _ in range(10)] == [0] * 10


def test_adaptive_policy_probes_on_the_pooled_bound():
    """A context seen on few rows has a wide bound: rows whose drafts were all accepted, then 7
    of 10 accepted again, estimate 0.64 (shrunk towards the pooled 0.5), bound 0.9. Probing on
    it would draft whenever rows had just accepted; the pooled bound, over 1,000 rows, says a
    draft (paying from alpha 0.68 here) cannot pay."""
    policy = AdaptiveDraftLength(_cost(0.6), max_k=1)
    for _ in range(4):  # both kinds of step timed at the model's cost; half of 250 rows accepting
        policy.choose(2)
        policy.observe(2, 1, [1] * 125 + [0] * 125, draft_seconds=0.0, step_seconds=policy.cost(2, 1))
        policy.choose(2)
        policy.observe(2, 0, [0, 0], step_seconds=policy.cost(2, 0))
    for accepted in ([1, 1], [1, 1], [1, 1], [1, 0], [0, 0]):
        policy.choose(2, [(1, 1), (1, 1)])
        policy.observe(2, 1, accepted)
    assert policy.alpha("all")[0] == pytest.approx(0.643, abs=1e-3) and policy.optimistic_alpha("all")[0] > 0.68
    assert policy.optimistic_alpha()[0] < 0.6
    assert policy.choose(2, [(1, 1), (1, 1)]) == 0


def test_adaptive_policy_prices_the_rows_the_forward_runs():
    """Finished rows stay in the cache, idle, until half of it has finished, and the forward runs
    them too: two rows decoding in a cache of eight cost a forward of eight rows. A draft of
    alpha 0.9 costing 0.5 of a row-step pays at batch 2 (1.9 / 1.5 > 1.05), not in a forward of 8
    rows where it costs 2 row-steps."""
    cost = VerifyCost({(b, k, 64): b * (1.0 + (0.5 if b <= 2 else 2.0) * k) for b in (2, 8) for k in range(2)})
    policy = AdaptiveDraftLength(cost, max_k=1, confidence=0.0)
    policy.observe(2, 1, [1] * 90 + [0] * 10, draft_seconds=0.0)
    assert policy.choose(2, [None] * 2, [10, 12]) == 1
    assert policy.choose(2, [None] * 2, [10, 0, 12, 0, 0, 0, 0, 0]) == 0
    policy.observe(2, 0, [0, 0], step_seconds=8.0)  # measured against the model of 8 rows
    assert policy.step_ratios == {8: [(1, False, 1.0)]}


def test_verify_cost_follows_batch_size_and_context():
    cost = VerifyCost({(b, 0, c): b * (1.0 if c == 64 else 2.0) for b in (1, 4) for c in (64, 1024)})
    assert cost(1, 0, 544) == pytest.approx(1.5) and cost(1, 0, 10) == cost(1, 0) == 1.0
    assert cost(1, 0, 1984) == pytest.approx(3.0)  # above the measured contexts: linear, as attention reads
    assert cost(2, 0, 64) == pytest.approx(2.0) and cost(8, 0, 1024) == pytest.approx(16.0)
    # rows attend in groups over the group's longest row: one 1,000-token row beside three short
    # ones costs its own span, not four times it
    assert attended_context([1000, 10, 10, 10]) == pytest.approx((1001 + 3 * 11) / 4 - 1)
    assert attended_context([500, 500]) == 500


def test_verify_cost_is_measured_in_rounds_over_every_configuration(monkeypatch):
    """A slow spell as long as one configuration's runs (8 forwards at 10x) must not price that
    configuration alone: the forwards go round every k and context, and each configuration keeps
    the median of its rounds. Measured one configuration after another (the least of its runs),
    k = 1 would have cost 10x."""
    clock = SimpleNamespace(t=0.0)

    class Target:
        vocab_size, device, calls = 10, "cpu", 0

        def new_cache(self, B, room, ragged):
            return SimpleNamespace(lengths=[0] * B)

        def __call__(self, ids, cache, logits):
            self.calls += 1
            slow = 10.0 if 7 <= self.calls < 15 else 1.0
            clock.t += ids.numel() * (1 + sum(cache.lengths) / 1000) * slow

    monkeypatch.setattr(adaptive, "_Clock", lambda device: lambda: clock.t)
    cost = VerifyCost.measure(Target(), [1, 2], 3, contexts=(64,), repeats=5)
    assert cost.seconds == pytest.approx({(b, k, 64): b * (k + 1) * (1 + b * 0.064) for b in (1, 2) for k in range(4)})


def test_adaptive_policy_scales_the_model_by_what_steps_measured():
    """Steps that take twice the start-up model, plain and drafting alike (the batch's real
    context, the machine's drift), scale both kinds: a draft of alpha 0.7 still pays (1.7 / 3 >
    1.05 / 2), as it did on the model alone. Drafting steps that take 1.2x more, against the
    model, than the plain steps beside them (bookkeeping) make it stop paying (1.7 / 3.6 < 1.05 / 2)."""
    policy = AdaptiveDraftLength(_cost(0.5), max_k=1, confidence=0.0)
    policy.observe(1, 1, [1] * 70 + [0] * 30, draft_seconds=0.0)
    plain, draft = policy.rates(1, ["pooled"], policy.alpha)
    assert draft > plain  # the model alone: 1.7 / 1.5 > 1.05
    for _ in range(4):
        policy.observe(1, 0, [0], step_seconds=2.0)
        policy.observe(1, 1, [], step_seconds=3.0)
    assert policy.level(1) == pytest.approx(2.0) and policy.drafting_extra(1) == pytest.approx(1.0)
    assert policy.target_seconds(1, 0) == pytest.approx(2.0) and policy.choose(1) == 1
    # the drafting extra is the median over every pair kept and window / 2 pseudo-pairs at 1.0:
    # one pair is two noisy steps
    fresh = AdaptiveDraftLength(_cost(0.5), max_k=1)
    fresh.observe(1, 0, [0], step_seconds=2.0)
    fresh.observe(1, 1, [], step_seconds=2.0 * 1.5 * 0.8)
    assert fresh.drafting_extra(1) == pytest.approx(1.0)
    for _ in range(12):
        policy.observe(1, 0, [0], step_seconds=2.0)
        policy.observe(1, 1, [], step_seconds=3.6)
    assert policy.drafting_extra(1) == pytest.approx(1.2) and policy.level(1) == pytest.approx(2.0)
    assert policy.target_seconds(1, 1) == pytest.approx(3.6) and policy.choose(1) == 0
    policy.observe(1, 0, [0], step_seconds=9.0)  # one step slowed by other work: the least recent counts
    assert policy.target_seconds(1, 0) == pytest.approx(2.0)
    # batch sizes 3-4 share what they measure, apart from 1 and 2; unmeasured: the model as it is
    policy.observe(3, 0, [0] * 3, step_seconds=1.7)
    assert policy.target_seconds(3, 0) == pytest.approx(1.7) and policy.target_seconds(2, 0) == policy.cost(2, 0)
    assert policy.target_seconds(4, 0) == pytest.approx(policy.cost(4, 0) * 1.7 / policy.cost(3, 0))
    # what batch 1 measured is forgotten after ``memory`` steps elsewhere (the batch's context has
    # changed since), but not the drafting extra, which two kinds of step side by side measured
    for _ in range(policy.memory):
        policy.observe(3, 0, [0] * 3, step_seconds=1.7)
    assert policy.level(1) == 1.0 and policy.drafting_extra(1) == pytest.approx(1.2)


def test_adaptive_policy_measures_the_other_kind_of_step_near_break_even():
    """A draft of alpha 0.5 with a verified token at 0.45 of a step predicts 1.5 / 1.45 = 1.03x
    a plain step: within the 5 % that plain decoding keeps, and within one step's noise (10 %),
    so the policy decodes plain but first measures drafting steps, window / 2 of them; a draft
    that pays 1.5 / 1.2 = 1.25x is taken."""
    def run(**options):
        policy = AdaptiveDraftLength(_cost(0.45), max_k=1, confidence=0.0, window=8, **options)
        policy.observe(1, 1, [1] * 500 + [0] * 500, draft_seconds=0.0)
        chosen = []
        for _ in range(12):
            chosen.append(policy.choose(1))
            policy.observe(1, chosen[-1], [0] * chosen[-1], step_seconds=policy.cost(1, chosen[-1]))
        return chosen

    half = 8 // 2  # window / 2
    assert run() == [1] * half + [0] * (12 - half)
    assert run(min_gain=0.0) == [0] * half + [1] * (12 - half)  # without it the 3 % gain is drafted
    assert AdaptiveDraftLength(_cost(0.2), max_k=1, confidence=0.0).choose(1, [(1, 0)]) == 1


def test_adaptive_policy_measures_a_draft_where_the_drafter_has_little_to_read():
    """Drafting's cost is measured (near break-even) only where no row's drafter has more than
    one step's tokens to read (max_k + 1), and measured once: not again after its steps leave
    the history."""
    def near_break_even(**options):
        policy = AdaptiveDraftLength(_cost(0.45), max_k=1, confidence=0.0, window=8, **options)
        policy.observe(1, 1, [1] * 500 + [0] * 500, draft_seconds=0.0)  # alpha 0.5: 1.5 / 1.45 a plain step
        return policy

    assert near_break_even().choose(2, pending=[3, 0]) == 0
    assert near_break_even().choose(2, pending=[2, 2]) == near_break_even().choose(2, pending=[0, 0]) == 1
    policy = near_break_even(history=16)
    for k in [1] * 4 + [0] * 32:
        policy.observe(1, k, [0] * k, draft_seconds=0.0 if k else None, step_seconds=policy.cost(1, k))
    assert len(policy.step_ratios[1]) == 16 and policy.measured(True, 1) == 4 and policy.measured(False, 1) == 32
    assert policy.choose(1, pending=[0]) == 0


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
    assert {k for key in rep["verify_cost_s"] for k in [int(key.split("x")[1].split("@")[0])]} == {1, 2, 3}


def test_plain_steps_of_the_speculative_decoder_are_plain_decoding(tiny_llama, prompts, monkeypatch):
    """k = 0 for every step: the same tokens as plain batched decoding, no draft and no verify kernel."""
    import draftlab.inference.decoder as decoder_module

    class Never:
        def choose(self, B, previous, lengths, remaining, pending):
            return 0

        def observe(self, *args):
            pass

    monkeypatch.setattr(decoder_module, "accept_chains", lambda *a, **k: pytest.fail("k = 0 ran the verify kernel"))
    plain = generate_plain_batch(tiny_llama, prompts, N_NEW)
    res = BatchedSpeculativeDecoder(tiny_llama, NgramProposer()).generate(prompts, N_NEW, Chain(3), policy=Never())
    assert [r.tokens for r in res.rows] == [r.tokens for r in plain.rows]
    assert res.draft_time == 0.0 and res.num_steps == plain.num_steps


def test_decoder_reports_the_drafters_catch_up_apart_from_proposing(tiny_llama, prompts):
    """What each row's drafter has not read is passed to ``choose``: nothing at a batch's first
    step (the drafter read the prompts in the prefill), a step's tokens after a drafting step,
    two steps' after a plain one. A drafting step reports its proposing and, where there was
    something to read, the catch-up's (seconds, tokens) apart; a plain step neither."""
    class Script:
        ks, pending, seen = [1, 1, 0, 1, 1], [], []

        def choose(self, B, previous, lengths, remaining, pending):
            self.pending.append(pending)
            return self.ks[len(self.seen)] if len(self.seen) < len(self.ks) else 0

        def observe(self, B, k, accepted, draft_seconds, step_seconds, catch_up):
            self.seen.append((k, accepted, draft_seconds, catch_up))

    policy = Script()
    BatchedSpeculativeDecoder(tiny_llama, NgramProposer()).generate(prompts, N_NEW, Chain(3), policy=policy)
    (_, first, *_), (_, second, *_) = policy.seen[:2]
    assert policy.pending[:4] == [[0] * len(prompts), [1 + n for n in first], [1 + n for n in second],
                                  [2 + n for n in second]]
    assert [(s[2] is None, s[3] is None) for s in policy.seen[:5]] == [(False, True), (False, False), (True, True),
                                                                       (False, False), (False, False)]
    assert [s[3][1] for s in policy.seen[1:5:2]] == [sum(policy.pending[1]), sum(policy.pending[3])]


def test_adaptive_decoding_stays_lossless(tiny_llama, prompts, alone):
    policy = AdaptiveDraftLength(VerifyCost.measure(tiny_llama, [1, 3], 3, contexts=(8, 16), repeats=1), 3)
    res = BatchedSpeculativeDecoder(tiny_llama, _oracle(tiny_llama, prompts, alone)).generate(
        prompts, N_NEW, Chain(3), policy=policy)
    assert [r.tokens for r in res.rows] == alone
    assert [k for k in res.draft_lengths if k] == [k for k in policy.chosen if k] and set(res.draft_lengths) <= {0, 1, 2, 3}
    assert len(res.draft_lengths) == res.num_steps >= len(policy.chosen)
    with pytest.raises(DraftlabError, match="chain and block"):
        BatchedSpeculativeDecoder(tiny_llama, NgramProposer()).generate(prompts, 4, DynamicTree(2, 2, 4), policy=policy)


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
    assert set(rep["verify_cost_s"]) == {f"{b}x{k}@{c}" for b in (1, 4) for k in range(1, 5) for c in (64, 1024)}
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
    plain = batch_eval.plain_batch_steps
    monkeypatch.setattr(batch_eval, "plain_batch_steps", lambda *a, **k: calls.append("plain") or plain(*a, **k))
    decode = BatchedSpeculativeDecoder.steps
    monkeypatch.setattr(BatchedSpeculativeDecoder, "steps",
                        lambda self, *a, **k: calls.append(self.proposer.name) or decode(self, *a, **k))
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
    assert res["oracle adaptive"]["verify_cost_s"] and res["ngram"]["verify_cost_s"] is None
    assert "alpha_by_context" in res["oracle adaptive"]["entries"][0]


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
    res, _ = run_lockstep([plain_batch_steps(tiny_llama, prompts, N_NEW), stepper("slow", N_NEW + 2, pause=0.05)])
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
    from draftlab.inference.proposer import Sampling

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
    res = BatchedSpeculativeDecoder(tiny_llama, proposer).generate(prompts, N_NEW, shape)
    assert [r.tokens for r in res.rows] == alone


def test_medusa_drafts_all_rows_at_once_as_each_row_alone(tiny_llama, prompts, alone):
    """MedusaRows runs each head once over every row's state: the same chains (with per-row
    min_confidence stops) and static trees as the rows drafting one by one."""
    from draftlab.inference.medusa import MedusaRows
    from draftlab.inference.proposer import StaticTree

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
        res = BatchedSpeculativeDecoder(tiny_llama, proposer).generate(prompts, N_NEW, shape)
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
    res = BatchedSpeculativeDecoder(tiny_llama, proposer).generate(prompts, N_NEW, shape)
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
        res = BatchedSpeculativeDecoder(tiny_llama, _oracle(tiny_llama, four, refs)).generate(four, N_NEW, shape, eos_token_id=eos)
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

    res = BatchedSpeculativeDecoder(tiny_llama, LongestFirst(refs, tiny_llama.vocab_size)).generate(long, 7, Chain(4))
    assert res.rows[0].num_steps == 2 and res.rows[1].num_steps == 6
    assert [r.tokens for r in res.rows] == [refs[tuple(p)][:7] for p in long]
