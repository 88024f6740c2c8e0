"""The EAGLE proposer inside the real decoder: greedy output equals plain greedy decoding
(chain, EAGLE-2 dynamic tree and EAGLE-1 static tree), sampled trees run, and its committed
drafter state never drifts from a fresh prefill."""

import pytest
import torch

from draftlab.inference.decoder import SpeculativeDecoder, generate_plain
from draftlab.inference.eagle import EagleProposer
from draftlab.inference.proposer import PROPOSERS
from draftlab.inference.shapes import Chain, DynamicTree, StaticTree
from draftlab.inference.tree import validate_tree
from draftlab.models.eagle import Eagle1Config, Eagle1Drafter, Eagle3Config, Eagle3Drafter


def _drafter(algo, target):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    samples = [{"input_ids": torch.randint(0, target.vocab_size, (32,), generator=g), "loss_mask": torch.ones(32, dtype=torch.bool)} for _ in range(4)]
    if algo == "eagle3":
        return Eagle3Drafter.build(Eagle3Config(draft_vocab_size=96), target, samples)
    if algo == "eagle3.1":  # fc_norm and norm_output on, the norms' gains away from 1 so they matter
        d = Eagle3Drafter.build(Eagle3Config(draft_vocab_size=96, fc_norm=True, norm_output=True), target, samples)
        with torch.no_grad():
            for norm in [*d.fc_norm, d.norm]:
                norm.weight.uniform_(0.5, 1.5, generator=g)
        return d
    if algo == "speculators":  # the flags speculators' trainer turns on, the norms' gains away from 1
        cfg = Eagle3Config(draft_vocab_size=96, norm_before_fc=True, norm_before_residual=True, norm_output=True)
        d = Eagle3Drafter.build(cfg, target, samples)
        with torch.no_grad():
            for norm in [d.input_norm, d.layers[0].hidden_norm, d.norm]:
                norm.weight.uniform_(0.5, 1.5, generator=g)
        return d
    return Eagle1Drafter.build(Eagle1Config(), target, samples)


def _started(target):
    """An EAGLE-3 drafter and its proposer, started on a 7-token random prompt."""
    d = _drafter("eagle3", target)
    p = EagleProposer(d)
    prompt = torch.randint(0, target.vocab_size, (7,), generator=torch.Generator().manual_seed(5))
    out = target(prompt[None], layers=p.layers, logits="last")
    p.start(prompt[None], out.hidden, int(out.logits[0, -1].argmax()))
    return d, p


# EAGLE-1's static tree shape, cut down: 3 candidates after the root, 2 below the best, ...
STATIC = StaticTree([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0), (0, 0, 0, 0)])
SHAPES = {"chain": Chain(4), "tree": DynamicTree(depth=4, top_k=3, total_tokens=10), "static_tree": STATIC}


def test_registered_for_both_families():
    assert PROPOSERS.get("eagle1") is PROPOSERS.get("eagle3") is EagleProposer


# the norm variants differ from EAGLE-3 before drafting starts: their chains run always, their trees with -m slow
@pytest.mark.parametrize("algo,method", [pytest.param(a, m, marks=pytest.mark.slow) if a in ("eagle3.1", "speculators") and m != "chain"
                                         else (a, m) for a in ("eagle1", "eagle3", "eagle3.1", "speculators") for m in SHAPES])
def test_eagle_greedy_equals_plain(tiny_llama, algo, method):
    d = _drafter(algo, tiny_llama)
    prompt = torch.randint(0, tiny_llama.vocab_size, (9,), generator=torch.Generator().manual_seed(3))
    plain = generate_plain(tiny_llama, prompt, 40)
    dec = SpeculativeDecoder(tiny_llama, EagleProposer(d))
    spec = dec.generate(prompt, 40, SHAPES[method])
    assert spec.tokens == plain.tokens
    assert sum(spec.num_drafted) > 0


@pytest.mark.parametrize("algo", ["eagle1", "eagle3"])
def test_static_tree_sampling_runs_and_is_seeded(tiny_llama, algo):
    dec = SpeculativeDecoder(tiny_llama, EagleProposer(_drafter(algo, tiny_llama)))
    prompt = torch.randint(0, tiny_llama.vocab_size, (9,), generator=torch.Generator().manual_seed(3))
    a, b = (dec.generate(prompt, 24, STATIC, temperature=0.8, top_k=20, seed=4) for _ in range(2))
    assert len(a.tokens) == 24 and a.tokens == b.tokens and a.accept_lengths == b.accept_lengths
    assert set(a.num_drafted) == {len(STATIC.choices)} and max(a.draft_depths) == 4


def test_static_tree_nodes_are_the_drafters_ranked_tokens(tiny_llama):
    """Node of rank r = the r-th most likely drafter token given its path: the root's children
    are the top-3 of the committed state, and the deepest chain of rank-0 nodes is the greedy
    chain the proposer drafts."""
    d, p = _started(tiny_llama)
    committed = p.cache.length
    tree = p.propose(STATIC)
    assert p.cache.length == committed  # speculative positions cropped
    validate_tree(tree, tiny_llama.vocab_size)
    assert torch.equal(tree.parents, STATIC.parents) and torch.equal(tree.depth, STATIC.depth)
    assert tree.tokens[:3].tolist() == d.to_target_ids(p.last_logits.topk(3).indices).tolist()
    chain = p.propose(Chain(4)).tokens.tolist()
    rank0 = [STATIC.choices.index((0,) * n) for n in range(1, 5)]  # nodes (0), (0, 0), ...
    assert [int(tree.tokens[i]) for i in rank0] == chain


def test_tree_respects_budget_and_is_closed(tiny_llama):
    _, p = _started(tiny_llama)
    for total in (1, 5, 11):
        tree = p.propose(DynamicTree(depth=4, top_k=3, total_tokens=total))
        n = tree.tokens.numel()
        assert n == total
        # parents precede children, depth = parent's depth + 1
        for i in range(n):
            par = int(tree.parents[i])
            assert par <= i
            assert int(tree.depth[i]) == (1 if par == 0 else int(tree.depth[par - 1]) + 1)


def test_advance_keeps_drafter_state_equal_to_fresh_start(tiny_llama):
    d = _drafter("eagle3", tiny_llama)
    p = EagleProposer(d)
    ids = torch.randint(0, tiny_llama.vocab_size, (20,), generator=torch.Generator().manual_seed(7))
    out = tiny_llama(ids[None], layers=p.layers, logits="all")
    # incremental: start on 12 tokens, advance by 3 and then 5 (hidden rows of the inputs kept)
    p.start(ids[None, :12], {i: h[:, :12] for i, h in out.hidden.items()}, int(ids[12]))
    p.advance(ids[13:16], {i: h[:, 12:15] for i, h in out.hidden.items()})
    p.advance(ids[16:20], {i: h[:, 15:19] for i, h in out.hidden.items()})
    inc = p.last_logits.clone()
    q = EagleProposer(d)
    q.start(ids[None, :19], {i: h[:, :19] for i, h in out.hidden.items()}, int(ids[19]))
    torch.testing.assert_close(inc, q.last_logits, atol=1e-5, rtol=1e-5)


def test_min_confidence_shortens_chains_and_stays_exact(tiny_llama):
    d = _drafter("eagle3", tiny_llama)
    prompt = torch.randint(0, tiny_llama.vocab_size, (9,), generator=torch.Generator().manual_seed(3))
    plain = generate_plain(tiny_llama, prompt, 40)
    drafted = {}
    for c in (0.0, 0.05, 0.999):
        spec = SpeculativeDecoder(tiny_llama, EagleProposer(d)).generate(prompt, 40, Chain(4, min_confidence=c))
        assert spec.tokens == plain.tokens  # a shorter chain never changes the output
        drafted[c] = spec.num_drafted
    assert set(drafted[0.0]) == {4}
    # the untrained drafter is unsure: a high bar leaves most steps undrafted, a low one some
    assert sum(drafted[0.999]) < sum(drafted[0.05]) < sum(drafted[0.0])
    assert min(drafted[0.05]) < 4


def test_min_confidence_is_the_product_of_top1_probabilities(tiny_llama):
    d = _drafter("eagle3", tiny_llama)
    prompt = torch.randint(0, tiny_llama.vocab_size, (9,), generator=torch.Generator().manual_seed(4))
    out = tiny_llama(prompt[None], layers=d.capture_layers, logits="last")
    free = EagleProposer(d)
    free.start(prompt[None], out.hidden, 5)
    # the confidences of the unrestricted chain, recomputed step by step
    conf, h, logits, probs = 1.0, free.last_h, free.last_logits, []
    for j in range(3):
        p = logits.float().softmax(-1).max()
        conf *= float(p)
        probs.append(conf)
        tok = d.to_target_ids(logits.max(-1, keepdim=True).indices)
        with torch.no_grad():
            h, lg = d.draft_step(tok.view(1, 1), h, torch.full((1, 1), free.pos + j), free.cache)
        logits = lg[0, -1]
    bounds = [1.0] + probs + [0.0]
    assert all(a > b for a, b in zip(bounds, bounds[1:])), bounds
    for n in range(4):  # a bar between the n-th and the (n+1)-th product keeps exactly n drafts
        q = EagleProposer(d)
        q.start(prompt[None], out.hidden, 5)
        assert q.propose(Chain(3, min_confidence=(bounds[n] + bounds[n + 1]) / 2)).tokens.numel() == n, (n, probs)


@pytest.mark.parametrize("algo", ["eagle1", "eagle3"])
def test_decoding_copy_computes_what_the_drafter_does(tiny_llama, algo):
    """The proposer decodes with a copy whose linears run small row counts on oneDNN-packed
    weights (or MKL where measured faster, or padded to a faster row count): same draft step for
    every row-count path; the
    drafter itself is untouched and the target's embedding and lm_head stay shared."""
    from draftlab.kernels.cpu_gemm import MKL_CANDIDATE_ROWS, PACKED_MAX_ROWS, DecodeLinear, RowPlan, decoding_copy

    d = _drafter(algo, tiny_llama).eval()
    c = decoding_copy(d)
    assert c is not d and c._embed is d._embed and c._target_lm_head is d._target_lm_head
    assert not any(isinstance(m, DecodeLinear) for m in d.modules())
    swapped = [m for m in c.modules() if isinstance(m, DecodeLinear)]
    assert len(swapped) == sum(isinstance(m, torch.nn.Linear) for m in d.modules()) > 0
    assert swapped[0].plan.mkl <= set(range(1, MKL_CANDIDATE_ROWS + 1))
    g = torch.Generator().manual_seed(2)
    H = tiny_llama.hidden_size
    hidden = {i: torch.randn(1, PACKED_MAX_ROWS + 5, H, generator=g) for i in d.capture_layers}
    ids = torch.randint(0, tiny_llama.vocab_size, (1, PACKED_MAX_ROWS + 5), generator=g)
    for plan in (RowPlan(), RowPlan(mkl=frozenset(range(1, MKL_CANDIDATE_ROWS + 1))), RowPlan(pad={1: 3, 2: 4})):
        for m in swapped:
            m.plan = plan
        with torch.no_grad():
            for n in (PACKED_MAX_ROWS + 5, 1, 2, MKL_CANDIDATE_ROWS + 1):  # prefill on MKL, then small rows
                pos = torch.arange(n)[None]
                want = d.draft_step(ids[:, :n], d.features({i: h[:, :n] for i, h in hidden.items()}), pos, d.new_cache())
                got = c.draft_step(ids[:, :n], c.features({i: h[:, :n] for i, h in hidden.items()}), pos, c.new_cache())
                for w, o in zip(want, got):
                    torch.testing.assert_close(o, w, rtol=1e-5, atol=1e-5)
