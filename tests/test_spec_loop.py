"""The device loop (inference/spec_loop.py): the whole speculative step as tensor ops over static
buffers, replayed as one captured function per batch bucket. On CPU it runs eagerly and in the
graph "replay" mode; both must decode what the host loop decodes, read the device once per
step, and reuse what they captured."""

import pytest
import torch

from draftlab.errors import DraftlabError
from draftlab.inference.decoder import Decoder, run_lockstep
from draftlab.inference.eagle import EagleProposer
from draftlab.inference.graphs import GraphedTarget
from draftlab.inference.lookahead import LookaheadProposer
from draftlab.inference.oracle import OracleProposer
from draftlab.inference.shapes import Block, Chain, DynamicTree, StaticTree
from draftlab.inference.spec_loop import bucket_rows, kept_loops
from draftlab.inference.diffusion import DiffusionProposer
from draftlab.inference.draft_lm import DraftLMProposer
from draftlab.inference.medusa import MedusaProposer
from draftlab.models.drafter import DRAFTERS
from draftlab.models.diffusion import DiffusionConfig, DiffusionDrafter
from draftlab.models.eagle import Eagle3Config, Eagle3Drafter
from draftlab.models.medusa import MedusaConfig, MedusaDrafter
from tiny import random_samples, spy_drafts

TEXTS = ["The quick brown fox", "Once upon a time, in a land far away, there lived", "1 2 3", "Hello",
         "A longer prompt that goes on for a while so the rows differ in length"]
N_NEW = 24

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def eagle(tiny_llama):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    samples = [{"input_ids": torch.randint(0, tiny_llama.vocab_size, (32,), generator=g),
                "loss_mask": torch.ones(32, dtype=torch.bool)} for _ in range(4)]
    return EagleProposer(Eagle3Drafter.build(Eagle3Config(draft_vocab_size=96), tiny_llama, samples))


def _decode(target, proposer, prompts, shape, loop, **kw):
    return Decoder(target, proposer, loop=loop).generate(prompts, N_NEW, shape, **kw)


@pytest.mark.parametrize("mode,B", [(None, 1), ("replay", 5)])
def test_eagle_chains_equal_the_host_loop(tiny_llama, prompts, eagle, mode, B):
    """Greedy tokens and per-step acceptance equal the host loop's, eager and replayed, with a
    batch that rounds up to a bucket and rows that finish at different steps (eos)."""
    target = tiny_llama if mode is None else GraphedTarget(tiny_llama, mode="replay")
    rows = prompts[:B]
    eos = 7 if B > 1 else None
    host = _decode(tiny_llama, eagle, rows, Chain(3), "host", eos_token_id=eos)
    dev = _decode(target, eagle, rows, Chain(3), "device", eos_token_id=eos)
    assert [r.tokens for r in dev.rows] == [r.tokens for r in host.rows]
    assert [r.accept_lengths for r in dev.rows] == [r.accept_lengths for r in host.rows]
    assert [r.stop_reason for r in dev.rows] == [r.stop_reason for r in host.rows]
    assert sum(sum(r.num_drafted) for r in dev.rows) > 0


def _medusa(target):
    torch.manual_seed(0)
    return MedusaProposer(MedusaDrafter.build(MedusaConfig(num_heads=3, num_layers=1), target, random_samples(target, n=4)))


def _draft_lm(target):
    """All the target's layers, perturbed: drafts accepted in part."""
    cls = DRAFTERS.get("draft_lm", "algorithm")
    torch.manual_seed(0)
    d = cls.build(cls.Config(num_layers=target.num_layers), target, random_samples(target, 2))
    with torch.no_grad():
        for p in d.lm.parameters():
            p.add_(0.3 * torch.randn_like(p) * p.std())
    return DraftLMProposer(d)


def _diffusion(target, dspark=False):
    from draftlab.inference.dspark import DSparkProposer
    from draftlab.models.dspark import DSparkConfig, DSparkDrafter

    fields = dict(num_layers=2, block_size=4, target_layers=[1, 3], draft_vocab_size=64)
    if dspark:
        d = DSparkDrafter.build(DSparkConfig(**fields, markov_rank=8, markov_head_type="gated"), target, random_samples(target, n=6, T=40))
    else:
        d = DiffusionDrafter.build(DiffusionConfig(**fields), target, random_samples(target, n=6, T=40))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # every weight away from its init (o_proj and down_proj start at zero)
        for p in d.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return (DSparkProposer if dspark else DiffusionProposer)(d.eval())


def _dspark(target):
    return _diffusion(target, dspark=True)


def _layerskip(target):
    from draftlab.inference.layerskip import LayerSkipProposer
    from draftlab.models.layerskip import LayerSkip

    return LayerSkipProposer(LayerSkip([2], target.num_layers, False))  # drafts accepted in part


def _peagle(target):
    from draftlab.inference.peagle import PEagleProposer
    from draftlab.models.peagle import PEagleConfig, PEagleDrafter

    torch.manual_seed(0)
    d = PEagleDrafter.build(PEagleConfig(num_layers=2, parallel_depth=4, draft_vocab_size=64), target, random_samples(target, n=4))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in d.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return PEagleProposer(d.eval())


@pytest.mark.parametrize("family", [_medusa, _draft_lm, _diffusion, _dspark, _layerskip, _peagle])
def test_other_families_equal_the_host_loop(tiny_llama, prompts, family, monkeypatch):
    """Same tokens, acceptance and drafts at every step while all rows decode (the drafts are
    compared too: a drafter whose drafts are all rejected would decode the target's tokens anyway)."""
    proposer = family(tiny_llama)
    shape = Block(3) if family in (_diffusion, _dspark) else Chain(3)
    drafted = spy_drafts(monkeypatch, proposer)
    host = _decode(tiny_llama, proposer, prompts[:3], shape, "host")
    dev = _decode(tiny_llama, proposer, prompts[:3], shape, "device")
    assert [r.tokens for r in dev.rows] == [r.tokens for r in host.rows]
    assert [r.accept_lengths for r in dev.rows] == [r.accept_lengths for r in host.rows]
    together = [h for h in drafted["host"] if h.shape[0] == 3]
    assert len(together) >= 3
    for step, (h, d) in enumerate(zip(together, drafted["device"])):
        assert torch.equal(h, d), step
    replayed = _decode(GraphedTarget(tiny_llama, mode="replay"), proposer, prompts[:3], shape, "device")
    assert [r.tokens for r in replayed.rows] == [r.tokens for r in host.rows]


TREE = DynamicTree(depth=3, top_k=3, total_tokens=8)
STATIC = StaticTree([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])


@pytest.mark.parametrize("family,shape", [("eagle", TREE), ("medusa", STATIC), ("draft_lm", TREE), ("peagle", TREE)])
def test_trees_equal_the_host_loop(tiny_llama, prompts, eagle, family, shape):
    """Trees drafted with tensor ops (EAGLE-2's dynamic tree by EAGLE and a draft LM, Medusa's
    static tree), verified with the tree mask and accepted on the device, the accepted path's
    K/V moved in place: the host loop's tokens and accepted depths, eager and replayed; sampling
    runs."""
    proposer = eagle if family == "eagle" else {"medusa": _medusa, "draft_lm": _draft_lm, "peagle": _peagle}[family](tiny_llama)
    host = _decode(tiny_llama, proposer, prompts[:3], shape, "host")
    for target in (tiny_llama, GraphedTarget(tiny_llama, mode="replay")):
        dev = _decode(target, proposer, prompts[:3], shape, "device")
        assert [r.tokens for r in dev.rows] == [r.tokens for r in host.rows]
        assert [r.accept_lengths for r in dev.rows] == [r.accept_lengths for r in host.rows]
    assert family in ("eagle", "peagle") or sum(sum(r.accept_lengths) for r in host.rows) > 0  # random EAGLEs: trees compared below
    sampled = _decode(tiny_llama, proposer, prompts[:3], shape, "device", temperature=1.0, seed=1)
    assert all(len(r.tokens) == N_NEW for r in sampled.rows)


def test_the_eagle_tree_is_the_host_loops(tiny_llama, prompts, eagle):
    """The dynamic tree drafted on the device holds the host proposer's nodes (same tokens under
    the same parents), after the same start."""
    ids = torch.tensor(prompts[1])
    out = tiny_llama(ids[None], layers=eagle.layers, logits="last")
    first = out.logits[0, -1].argmax()
    eagle.start(ids[None], out.hidden, int(first))
    host = eagle.propose(TREE)
    dev = eagle.on_device(1, 256, TREE)
    dev.start(0, ids, out.hidden, first)
    tokens, parents = dev.draft_tree(1, TREE)

    def paths(tok, par):
        tok, par = tok.tolist(), par.tolist()
        def path(i):
            return (path(par[i] - 1) if par[i] > 0 else ()) + (tok[i],)
        return sorted(path(i) for i in range(len(tok)))

    assert paths(tokens[0], parents[0]) == paths(host.tokens, host.parents)


def test_plain_and_oracle(tiny_llama, prompts):
    """Plain decoding through the device loop equals the host loop's; the oracle's drafts are all
    accepted (tau = k + 1 until the last step)."""
    plain = _decode(tiny_llama, None, prompts, None, "host")
    dev = _decode(tiny_llama, None, prompts, None, "device")
    assert [r.tokens for r in dev.rows] == [r.tokens for r in plain.rows]
    oracle = OracleProposer(tiny_llama, max_new_tokens=N_NEW)
    oracle.prepare(tiny_llama, prompts, N_NEW)
    res = _decode(GraphedTarget(tiny_llama, mode="replay"), oracle, prompts, Chain(4), "device")
    assert [r.tokens for r in res.rows] == [r.tokens for r in plain.rows]
    for r in res.rows:
        assert all(a == 4 for a in r.accept_lengths[:-1]), r.accept_lengths


def test_sampling_is_seeded_and_stays_in_the_vocabulary(tiny_llama, prompts, eagle):
    a = _decode(tiny_llama, eagle, prompts[:3], Chain(2), "device", temperature=1.0, seed=3)
    b = _decode(GraphedTarget(tiny_llama, mode="replay"), eagle, prompts[:3], Chain(2), "device", temperature=1.0, seed=3)
    c = _decode(tiny_llama, eagle, prompts[:3], Chain(2), "device", temperature=1.0, seed=4)
    assert [r.tokens for r in a.rows] == [r.tokens for r in b.rows] != [r.tokens for r in c.rows]
    assert all(len(r.tokens) == N_NEW and 0 <= min(r.tokens) and max(r.tokens) < tiny_llama.vocab_size for r in a.rows)


@pytest.mark.parametrize("B", [1, 16])
def test_a_step_reads_the_device_once(tiny_llama, eagle, B):
    """Each step's host reads: one (the accepted counts and tokens), at batch 1 and 16."""
    from bench.gpu_decode import count_host_reads

    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(3, tiny_llama.vocab_size, (n,), generator=g).tolist() for n in range(4, 4 + B)]
    graphed = GraphedTarget(tiny_llama, mode="replay")
    steps = Decoder(graphed, eagle, loop="device").steps(rows, 12, Chain(2))
    next(steps)  # the prefill and first step: reads at the start are not a step's
    with count_host_reads(tiny_llama.device) as counts:
        next(steps)
        next(steps)
    assert sum(counts.values()) == 2, dict(counts)


def test_loops_are_reused_and_buckets_shrink(tiny_llama, prompts, eagle):
    """A second decoding of the same shape reuses the first's loop (no capture); decodings in
    lockstep hold loops of their own; finished rows move the batch to smaller buckets."""
    graphed = GraphedTarget(tiny_llama, mode="replay")
    kept = kept_loops(tiny_llama)
    kept.clear()
    _decode(graphed, eagle, prompts[:3], Chain(2), "device")
    (loop,) = kept.values()
    assert loop.rows == 4 and loop.stats["captured"] == 3  # buckets 1, 2, 4
    _decode(graphed, eagle, prompts[:3], Chain(2), "device")
    assert list(kept.values()) == [loop] and loop.stats["captured"] == 3
    run_lockstep([Decoder(graphed, eagle, loop="device").steps(prompts[:3], N_NEW, Chain(2)) for _ in range(2)])
    assert list(kept.values()) == [loop]
    # rows of very different budgets: eos stops some early, the rest finish in a smaller bucket
    eos = _decode(tiny_llama, None, prompts, None, "host").rows[0].tokens[2]
    res = _decode(graphed, eagle, prompts, Chain(2), "device", eos_token_id=eos)
    host = _decode(tiny_llama, eagle, prompts, Chain(2), "host", eos_token_id=eos)
    assert [r.tokens for r in res.rows] == [r.tokens for r in host.rows]
    assert sum(r.stop_reason == "eos" for r in res.rows) == 1
    (big,) = [x for x in kept.values() if x.rows == bucket_rows(5) == 8]
    assert big.stats["rows 8"] and big.stats["rows 4"] and big.stats["eager"] == 0


def test_what_the_device_loop_cannot_run_is_a_one_line_error(tiny_llama, prompts, eagle):
    with pytest.raises(DraftlabError, match="device loop cannot run this decoding: a tree of depth 2 and top-k 1 grows 2 nodes"):
        _decode(tiny_llama, eagle, prompts[:1], DynamicTree(depth=2, top_k=1, total_tokens=6), "device")
    with pytest.raises(DraftlabError, match="adaptive_exit"):
        from draftlab.inference.layerskip import LayerSkipProposer
        from draftlab.models.layerskip import LayerSkip

        _decode(tiny_llama, LayerSkipProposer(LayerSkip([1], tiny_llama.num_layers, True)), prompts[:1], Chain(2), "device")
    with pytest.raises(DraftlabError, match="drafts static trees on the host"):
        _decode(tiny_llama, eagle, prompts[:1], STATIC, "device")
    with pytest.raises(DraftlabError, match="does not draft on the device"):
        _decode(tiny_llama, LookaheadProposer(), prompts[:1], Chain(2), "device")
    with pytest.raises(DraftlabError, match="loop must be one of"):
        Decoder(tiny_llama, loop="gpu")
