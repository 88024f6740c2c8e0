"""Speculative decoder: lossless greedy (token for token), rollback of the KV cache, eos and
length limits, seeded sampling and its distribution, tree utilities and the n-gram proposer."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from draftlab.errors import DraftlabError
from draftlab.inference.decoder import SpeculativeDecoder, generate_plain
from draftlab.inference.ngram import NgramProposer
from draftlab.inference.proposer import Proposer
from draftlab.inference.sampling import process_logits
from draftlab.inference.shapes import Block, Chain, ChainDraft, DraftTree, DynamicTree, StaticTree
from draftlab.inference.tree import ancestor_mask, validate_tree
from tiny import chi2_pvalue, exact_joint

PROMPT = "The quick brown fox jumps over the lazy dog. Speculative decoding drafts tokens"
REF_LEN = 40


pytestmark = pytest.mark.usefixtures("one_thread")


def _prompt_ids(target, text=PROMPT):
    return target.tokenizer(text)["input_ids"]


@pytest.fixture(scope="module")
def ref(tiny_llama):
    """The target's plain greedy continuation of PROMPT."""
    return generate_plain(tiny_llama, _prompt_ids(tiny_llama), REF_LEN).tokens


class OracleProposer(Proposer):
    """Test drafter: the target's own greedy continuation (``ref``) with tokens corrupted at
    random, so acceptance, rejection and rollback all happen. Logs the hidden states it is
    given so the test can check them against a fresh full forward."""

    name = "oracle"
    shapes = frozenset({"chain", "dynamic_tree"})

    def __init__(self, ref, vocab, corrupt=0.3, seed=0, layers=()):
        self.ref, self.vocab, self.corrupt = list(ref), vocab, corrupt
        self.rng = random.Random(seed)
        self.layers = tuple(layers)
        self.hidden_log = []

    def start(self, prompt_ids, hidden, next_token):
        assert next_token == self.ref[0]
        self.pos = 1
        self.hidden_log = [hidden]

    def advance(self, accepted, hidden):
        assert accepted.tolist() == self.ref[self.pos : self.pos + accepted.numel()], "decoder left the greedy path"
        self.pos += accepted.numel()
        self.hidden_log.append(hidden)

    def _wrong(self, tok):
        return (tok + 1 + self.rng.randrange(self.vocab - 1)) % self.vocab  # never == tok

    def propose(self, shape):
        return self._chain(shape.k) if isinstance(shape, (Chain, Block)) else self._tree(shape)

    def _chain(self, k):
        true = self.ref[self.pos : self.pos + k]
        return ChainDraft(torch.tensor([self._wrong(t) if self.rng.random() < self.corrupt else t for t in true], dtype=torch.long))

    def _tree(self, spec):
        """Along the true path, each level gets a wrong first sibling (with a wrong child of its
        own), then the true token -- unless it is 'corrupted' away, which ends the path."""
        tokens, parents, depth = [], [], []

        def add(tok, parent, d):
            tokens.append(tok), parents.append(parent), depth.append(d)
            return len(tokens)

        node = 0
        for d in range(1, spec.depth + 1):
            if self.pos + d - 1 >= len(self.ref) or len(tokens) + 3 > spec.total_tokens:
                break
            true = self.ref[self.pos + d - 1]
            wrong = add(self._wrong(true), node, d)
            if d < spec.depth:
                add(self._wrong(-1), wrong, d + 1)
            if self.rng.random() < self.corrupt:
                break
            node = add(true, node, d)
        t = lambda x: torch.tensor(x, dtype=torch.long)  # noqa: E731
        return DraftTree(t(tokens), t(parents), t(depth))


class PerturbedProposer(Proposer):
    """Test drafter with real draft probabilities: the target's logits plus a fixed random bias,
    processed like the target's (``sampling.probs``), recomputed by full forwards. With
    ``point_mass`` it drafts the argmax and returns no probs."""

    name = "perturbed"
    shapes = frozenset({"chain", "dynamic_tree"})

    def __init__(self, target, scale=1.5, seed=0, point_mass=False):
        g = torch.Generator().manual_seed(seed)
        self.target, self.point_mass = target, point_mass
        self.bias = scale * torch.randn(target.vocab_size, generator=g)

    def start(self, prompt_ids, hidden, next_token):
        self.ctx = prompt_ids.tolist() + [int(next_token)]

    def advance(self, accepted, hidden):
        self.ctx += accepted.tolist()

    def _logits(self, seqs):
        return self.target(torch.tensor(seqs), logits="last").logits[:, -1] + self.bias

    def propose(self, shape):
        return self._chain(shape.k) if isinstance(shape, Chain) else self._tree()

    def _chain(self, k):
        seq, toks, probs = list(self.ctx), [], []
        for _ in range(k):
            logits = self._logits([seq])[0]
            if self.point_mass or self.sampling.greedy:
                tok = int(logits.argmax())
            else:
                q = self.sampling.probs(logits)
                tok = int(self.sampling.sample(q))
                probs.append(q)
            toks.append(tok)
            seq.append(tok)
        return ChainDraft(torch.tensor(toks), torch.stack(probs) if probs else None)

    def _tree(self):
        """Top-2 candidates at the root, top-2 under each: 6 nodes, depth 2 (point masses)."""
        first = self._logits([self.ctx])[0].topk(2).indices.tolist()
        second = self._logits([self.ctx + [t] for t in first]).topk(2, dim=-1).indices.tolist()
        tokens = first + second[0] + second[1]
        return DraftTree(torch.tensor(tokens), torch.tensor([0, 0, 1, 1, 2, 2]), torch.tensor([1, 1, 2, 2, 2, 2]))


def _check_hidden(target, prompt, tokens, proposer):
    """The hidden states handed to the proposer (prefill + every advance) equal a fresh full
    forward over the same tokens: the cache was rolled back / compacted correctly."""
    logged = {i: torch.cat([h[i] for h in proposer.hidden_log], dim=1) for i in proposer.layers}
    n = next(iter(logged.values())).shape[1]
    full = target(torch.tensor([list(prompt) + list(tokens)]), layers=list(proposer.layers), logits=None).hidden
    assert n >= len(prompt) + 1
    for i in proposer.layers:
        torch.testing.assert_close(logged[i], full[i][:, :n], atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------- greedy = plain greedy
@pytest.mark.parametrize("k", [1, 3, 6])
def test_chain_greedy_matches_plain_with_oracle(tiny_llama, ref, k):
    prompt = _prompt_ids(tiny_llama)
    prop = OracleProposer(ref, tiny_llama.vocab_size, corrupt=0.25, seed=k, layers=(2, tiny_llama.num_layers))
    res = SpeculativeDecoder(tiny_llama, prop).generate(prompt, REF_LEN, Chain(k))
    assert res.tokens == ref
    lengths = set(res.accept_lengths)
    assert 0 in lengths and k in lengths, res.accept_lengths  # rejections and full acceptances
    if k >= 3:
        assert lengths - {0, k}, res.accept_lengths  # partial acceptance too
    assert res.num_drafted and max(res.num_drafted) == k
    assert sum(res.accept_lengths) + res.num_steps + 1 >= len(res.tokens)  # tokens per step accounting
    _check_hidden(tiny_llama, prompt, res.tokens, prop)


def test_tree_greedy_matches_plain_with_oracle(tiny_llama, ref):
    prompt = _prompt_ids(tiny_llama)
    prop = OracleProposer(ref, tiny_llama.vocab_size, corrupt=0.3, seed=1, layers=(0, 3, tiny_llama.num_layers))
    res = SpeculativeDecoder(tiny_llama, prop).generate(prompt, REF_LEN, DynamicTree(depth=4, top_k=2, total_tokens=12))
    assert res.tokens == ref
    assert 0 in res.accept_lengths and max(res.accept_lengths) >= 3, res.accept_lengths
    assert len(set(res.accept_lengths)) >= 3, res.accept_lengths
    assert max(res.draft_depths) == 4 and max(res.num_drafted) > 4
    _check_hidden(tiny_llama, prompt, res.tokens, prop)


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "mistral"])
def test_other_families_greedy_lossless(tiny_target_dirs, family):
    from draftlab.models.target import Target

    target = Target.load(str(tiny_target_dirs[family]))
    prompt = _prompt_ids(target)
    ref = generate_plain(target, prompt, 24).tokens
    dec = SpeculativeDecoder(target, OracleProposer(ref, target.vocab_size, corrupt=0.3, seed=2))
    assert dec.generate(prompt, 24, Chain(4)).tokens == ref
    dec = SpeculativeDecoder(target, OracleProposer(ref, target.vocab_size, corrupt=0.3, seed=3))
    assert dec.generate(prompt, 24, DynamicTree(3, 2, 9)).tokens == ref


@pytest.mark.parametrize("shape", [Chain(4), DynamicTree(4, 3, 16)], ids=["chain", "tree"])
def test_ngram_greedy_matches_plain(tiny_llama, shape):
    # A repetitive prompt so prompt lookup finds matches (right or wrong ones).
    prompt = _prompt_ids(tiny_llama, "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n" * 3)
    ref = generate_plain(tiny_llama, prompt, 32).tokens
    res = SpeculativeDecoder(tiny_llama, NgramProposer()).generate(prompt, 32, shape)
    assert res.tokens == ref
    assert sum(res.num_drafted) > 0


def test_perturbed_draft_greedy_matches_plain(tiny_llama, ref):
    prompt = _prompt_ids(tiny_llama)
    res = SpeculativeDecoder(tiny_llama, PerturbedProposer(tiny_llama, scale=0.5)).generate(prompt, 24, Chain(3))
    assert res.tokens == ref[:24]


# ---------------------------------------------------------------------- stopping
SHAPES = [Chain(5), DynamicTree(5, 2, 16)]
SHAPE_IDS = ["chain", "tree"]


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("m", [1, 2, 7, 13])
def test_max_new_tokens_exact(tiny_llama, ref, shape, m):
    prop = OracleProposer(ref, tiny_llama.vocab_size, corrupt=0.0)
    res = SpeculativeDecoder(tiny_llama, prop).generate(_prompt_ids(tiny_llama), m, shape)
    assert res.tokens == ref[:m] and res.stop_reason == "length"
    assert len(generate_plain(tiny_llama, _prompt_ids(tiny_llama), m).tokens) == m


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_eos_stops_inside_an_accepted_step(tiny_llama, ref, shape):
    j = next(i for i in range(6, len(ref)) if ref[i] not in ref[:i])
    eos = ref[j]
    prompt = _prompt_ids(tiny_llama)
    plain = generate_plain(tiny_llama, prompt, REF_LEN, eos_token_id=eos)
    assert plain.tokens == ref[: j + 1] and plain.stop_reason == "eos"
    prop = OracleProposer(ref, tiny_llama.vocab_size, corrupt=0.0)
    res = SpeculativeDecoder(tiny_llama, prop).generate(prompt, REF_LEN, shape, eos_token_id=[999, eos])
    assert res.tokens == ref[: j + 1] and res.stop_reason == "eos"
    # eos was emitted with more accepted tokens behind it in the same step: they were dropped
    assert sum(res.accept_lengths) + len(res.accept_lengths) + 1 > len(res.tokens)


def test_eos_as_first_token(tiny_llama, ref):
    res = SpeculativeDecoder(tiny_llama, NgramProposer()).generate(_prompt_ids(tiny_llama), 10, eos_token_id=ref[0])
    assert res.tokens == [ref[0]] and res.stop_reason == "eos" and res.num_steps == 0


# ---------------------------------------------------------------------- sampling
@pytest.mark.parametrize("shape", [Chain(3), DynamicTree(2, 2, 6)], ids=SHAPE_IDS)
def test_sampling_is_reproducible(tiny_llama, shape):
    prompt = _prompt_ids(tiny_llama)
    dec = SpeculativeDecoder(tiny_llama, PerturbedProposer(tiny_llama))
    kw = dict(shape=shape, temperature=0.9, top_p=0.95)
    a = dec.generate(prompt, 16, seed=7, **kw)
    b = dec.generate(prompt, 16, seed=7, **kw)
    c = dec.generate(prompt, 16, seed=8, **kw)
    assert a.tokens == b.tokens and a.accept_lengths == b.accept_lengths
    assert a.tokens != c.tokens
    assert len(a.tokens) == 16
    p1 = generate_plain(tiny_llama, prompt, 16, temperature=0.9, top_p=0.95, seed=7)
    assert p1.tokens == generate_plain(tiny_llama, prompt, 16, temperature=0.9, top_p=0.95, seed=7).tokens


@pytest.mark.parametrize(
    "shape,point_mass",
    [(Chain(2), False), (Chain(2), True), (DynamicTree(2, 2, 6), True)],
    ids=["chain-draft-probs", "chain-point-mass", "tree-multi-candidate"],
)
def test_sampling_preserves_target_distribution(tiny_llama, shape, point_mass):
    """The first three tokens (t0 from the prefill, t1 and t2 through verification) jointly
    follow the target's top-k=3 distribution: 27 cells, chi-square test."""
    prompt = _prompt_ids(tiny_llama)
    temperature, top_k, n = 1.0, 3, 600
    joint = exact_joint(tiny_llama, prompt, 3, temperature, top_k)
    prop = PerturbedProposer(tiny_llama, scale=1.0, seed=5, point_mass=point_mass)
    dec = SpeculativeDecoder(tiny_llama, prop)
    counts, steps = Counter(), Counter()
    for s in range(n):
        r = dec.generate(prompt, 3, shape, temperature=temperature, top_k=top_k, seed=s)
        counts[tuple(r.tokens)] += 1
        steps.update(r.accept_lengths[:1])
    assert len(steps) == 3, steps  # first verify step accepted 0, 1 and 2 drafts at times
    pv = chi2_pvalue(counts, joint, n)
    # The test has power: the same counts are far from a distribution that differs in t1/t2.
    skewed = exact_joint(tiny_llama, prompt, 3, temperature, 2)
    skewed = {c: 0.7 * joint[c] + 0.3 * skewed.get(c, 0.0) for c in joint}
    assert pv > 1e-3
    assert chi2_pvalue(counts, skewed, n) < 1e-3


# ---------------------------------------------------------------------- tree utilities
def test_ancestor_mask():
    parents = torch.tensor([-1, 0, 0, 1, 1, 3])
    m = ancestor_mask(parents)
    expect = {0: {0}, 1: {0, 1}, 2: {0, 2}, 3: {0, 1, 3}, 4: {0, 1, 4}, 5: {0, 1, 3, 5}}
    for i, anc in expect.items():
        assert set(m[i].nonzero().flatten().tolist()) == anc


def test_validate_tree_rejects_bad_trees():
    ok = DraftTree(torch.tensor([5, 6, 7]), torch.tensor([0, 0, 1]), torch.tensor([1, 1, 2]))
    validate_tree(ok, 10)
    with pytest.raises(ValueError, match="distinct"):
        validate_tree(DraftTree(torch.tensor([5, 5, 7]), torch.tensor([0, 0, 1]), torch.tensor([1, 1, 2])))
    with pytest.raises(ValueError, match="earlier node"):
        validate_tree(DraftTree(torch.tensor([5, 6, 7]), torch.tensor([0, 3, 1]), torch.tensor([1, 1, 2])))
    with pytest.raises(ValueError, match="depth"):
        validate_tree(DraftTree(torch.tensor([5, 6, 7]), torch.tensor([0, 0, 1]), torch.tensor([1, 1, 1])))
    with pytest.raises(ValueError, match="vocabulary"):
        validate_tree(ok, 7)


def test_static_tree_from_choices():
    st = StaticTree([(1,), (0, 0), (0,), (0, 1), (0, 0, 0)])
    assert st.choices == ((0,), (1,), (0, 0), (0, 1), (0, 0, 0))
    assert st.parents.tolist() == [0, 0, 1, 1, 3] and st.depth.tolist() == [1, 1, 2, 2, 3]
    cand = torch.tensor([[10, 11], [20, 21], [30, 31]])
    tree = st.draft(cand)
    assert tree.tokens.tolist() == [10, 11, 20, 21, 30]
    validate_tree(tree, 100)
    with pytest.raises(DraftlabError, match="no parent"):
        StaticTree([(0, 1)])
    for bad in ([], [[]], [[0, -1]], [[0.5]], 3, [["a"]]):
        with pytest.raises(DraftlabError, match="paths of candidate ranks"):
            StaticTree(bad)


def test_static_tree_decodes_losslessly(tiny_llama, ref):
    """A Medusa-style static tree filled with the true token at a non-zero rank."""
    st = StaticTree([(0,), (1,), (1, 0), (1, 1), (1, 1, 0), (1, 1, 1)])

    class StaticOracle(OracleProposer):
        shapes = frozenset({"static_tree"})

        def propose(self, shape):
            rows = []
            for d in range(3):
                true = self.ref[min(self.pos + d, len(self.ref) - 1)]
                rows.append([self._wrong(true), true])
            return st.draft(torch.tensor(rows))

    prop = StaticOracle(ref, tiny_llama.vocab_size)
    res = SpeculativeDecoder(tiny_llama, prop).generate(_prompt_ids(tiny_llama), 20, st)
    assert res.tokens == ref[:20]
    assert set(res.accept_lengths) == {3}


# ---------------------------------------------------------------------- n-gram proposer
def test_ngram_chain_most_recent_longest_match():
    p = NgramProposer(n_max=3, n_min=1)
    p.start(torch.tensor([1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2]), {}, 3)  # context ends "2 3"
    assert p.propose(Chain(3)).tokens.tolist() == [7, 8, 5]  # most recent "2 3" is followed by 7 8 5
    p.advance(torch.tensor([7, 4]), {})  # ... "3 7 4": "3 7 4" and "7 4" unseen, "4" unseen
    assert p.propose(Chain(3)).tokens.numel() == 0
    p.advance(torch.tensor([8]), {})  # ... "4 8": only "8" matches (at index 8), followed by 5 2 3
    assert p.propose(Chain(2)).tokens.tolist() == [5, 2]


def test_ngram_tree_merges_continuations():
    p = NgramProposer(n_max=2, n_min=1)
    p.start(torch.tensor([4, 1, 5, 6, 4, 1, 7, 8, 4, 1, 5, 9, 0]), {}, 4)  # ends "0 4"
    # no earlier "0 4"; "4" occurs at 8, 4, 0 -> continuations "1 5 9", "1 7 8", "1 5 6"
    tree = p.propose(DynamicTree(depth=3, top_k=4, total_tokens=10))
    validate_tree(tree, 20)
    paths = set()
    for leaf in range(1, tree.tokens.numel() + 1):
        path, node = [], leaf
        while node:
            path.append(int(tree.tokens[node - 1]))
            node = int(tree.parents[node - 1])
        paths.add(tuple(reversed(path)))
    assert {(1, 5, 9), (1, 7, 8), (1, 5, 6)} <= paths
    assert tree.tokens.numel() == 6  # shared prefixes merged: 1, 5, 9, 7, 8, 6
    small = p.propose(DynamicTree(depth=3, top_k=1, total_tokens=10))
    assert small.tokens.tolist() == [1, 5, 9]


def test_bad_arguments(tiny_llama):
    dec = SpeculativeDecoder(tiny_llama, NgramProposer())
    prompt = _prompt_ids(tiny_llama)
    for kw in (dict(shape="beam"), dict(temperature=-1.0), dict(top_p=0.0), dict(top_k=-1)):
        with pytest.raises(DraftlabError):
            dec.generate(prompt, 4, **kw)
    for make in (lambda: Chain(0), lambda: Chain(3, min_confidence=1.0), lambda: Block(0), lambda: DynamicTree(0, 2, 4)):
        with pytest.raises(DraftlabError):
            make()
    with pytest.raises(DraftlabError, match="max_new_tokens"):
        generate_plain(tiny_llama, prompt, 0)

    class Greedy(OracleProposer):
        def propose(self, shape):
            return ChainDraft(torch.tensor(self.ref[self.pos : self.pos + shape.k + 1]))

    ref = generate_plain(tiny_llama, prompt, 8).tokens
    with pytest.raises(ValueError, match="more than k"):
        SpeculativeDecoder(tiny_llama, Greedy(ref, tiny_llama.vocab_size)).generate(prompt, 8, Chain(2))


def test_process_logits_top_k_top_p():
    logits = torch.log(torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]))
    torch.testing.assert_close(process_logits(logits, 1.0), torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]))
    torch.testing.assert_close(process_logits(logits, 1.0, top_k=2), torch.tensor([5 / 7, 2 / 7, 0, 0, 0]))
    # top_p=0.8: 0.5 + 0.2 = 0.7 < 0.8, so 0.15 is needed too
    torch.testing.assert_close(process_logits(logits, 1.0, top_p=0.8), torch.tensor([0.5, 0.2, 0.15, 0, 0]) / 0.85)
    torch.testing.assert_close(process_logits(logits, 1.0, top_p=0.65), torch.tensor([0.5, 0.2, 0, 0, 0]) / 0.7)
    # top-p applies to the top-k-renormalised distribution
    torch.testing.assert_close(process_logits(logits, 1.0, top_k=3, top_p=0.6), torch.tensor([0.5, 0.2, 0, 0, 0]) / 0.7)
    sharp = process_logits(logits, 0.5)
    torch.testing.assert_close(sharp, torch.tensor([0.25, 0.04, 0.0225, 0.01, 0.0025]) / 0.325)
