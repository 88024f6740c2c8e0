"""The draft-LM proposer inside the real decoder: greedy output equals plain decoding (chains,
dynamic and static trees, batch 1 and batch 3 with prompts of different lengths), a draft that
is the target itself is accepted in full, its cache holds what a fresh pass would after
roll-backs, rows drafted together draft what each row drafts alone (also after rows leave),
sampling follows the target's distribution, and the report states the draft's KV cache."""

from __future__ import annotations


import pytest
import torch

from draftlab.inference import draft_lm
from draftlab.inference.decoder import Decoder, SpeculativeDecoder, generate_plain_batch
from draftlab.inference.draft_lm import DraftLMProposer, DraftLMRows
from draftlab.inference.evaluate import evaluate
from draftlab.inference.prompts import EvalPrompt
from draftlab.inference.proposer import PROPOSERS, Proposer, load_proposer
from draftlab.inference.sampling import Sampling, process_logits
from draftlab.inference.shapes import Chain, DynamicTree, StaticTree
from draftlab.inference.report import markdown
from draftlab.models.drafter import DRAFTERS
from draftlab.models.target import Target
from tiny import assert_batch_follows_target, random_samples, save_checkpoint

TEXTS = ["The quick brown fox jumps", "Speculative decoding drafts tokens and the target verifies them all at once",
         "a b c a b c a b"]
N_NEW = 24
STATIC = StaticTree([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0), (0, 0, 0, 0)])
SHAPES = {"chain1": Chain(1), "chain3": Chain(3), "tree": DynamicTree(depth=4, top_k=3, total_tokens=10), "static": STATIC}


pytestmark = pytest.mark.usefixtures("one_thread")


def _drafter(target, layers: int, noise: float = 0.0):
    """A draft LM of ``layers`` of the target's layers (copied from it); ``noise`` perturbs its
    weights so that it drafts the target's tokens often, not always."""
    cls = DRAFTERS.get("draft_lm", "algorithm")
    torch.manual_seed(0)
    d = cls.build(cls.Config(num_layers=layers), target, random_samples(target, 2))
    with torch.no_grad():
        for p in d.lm.parameters():
            p.add_(noise * torch.randn_like(p) * p.std())
    return d


@pytest.fixture(scope="module")
def noisy(tiny_llama):
    """A proposer whose drafts are accepted in part: all the target's layers, perturbed."""
    return DraftLMProposer(_drafter(tiny_llama, tiny_llama.num_layers, noise=0.3))


@pytest.fixture(scope="module")
def exact(tiny_llama):
    """A proposer whose draft LM is the target itself."""
    return DraftLMProposer(_drafter(tiny_llama, tiny_llama.num_layers))


def test_registered_and_leaves_the_drafter_as_it_was(tiny_llama, noisy):
    assert PROPOSERS.get("draft_lm") is DraftLMProposer
    assert noisy.layers == () and noisy.shapes == {"chain", "dynamic_tree", "static_tree"}
    d = _drafter(tiny_llama, 2).train()
    before = {k: v.clone() for k, v in d.state_dict().items()}
    DraftLMProposer(d)  # wraps a copy: the drafter may go on training
    assert d.training and all(p.requires_grad for p in d.lm.parameters())
    k = d.lm.model.layers[0].self_attn.k_proj.weight
    assert k.data_ptr() == k.untyped_storage().data_ptr()  # not made a view of a fused q|k|v
    assert all(torch.equal(v, before[k]) for k, v in d.state_dict().items())


def test_loaded_from_a_checkpoint_decodes_losslessly(tiny_llama, prompts, tmp_path):
    """The path a trained checkpoint takes: saved, loaded beside the target, its proposer built."""
    proposer = load_proposer(save_checkpoint(_drafter(tiny_llama, 2), tiny_llama, tmp_path / "ckpt"), tiny_llama, SHAPES["tree"])
    assert isinstance(proposer, DraftLMProposer)
    for shape in (SHAPES["chain3"], SHAPES["tree"]):
        res = Decoder(tiny_llama, proposer).generate(prompts, N_NEW, shape)
        assert [r.tokens for r in res.rows] == [r.tokens for r in generate_plain_batch(tiny_llama, prompts, N_NEW).rows]


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "mistral"])
def test_other_families_decode_losslessly(tiny_target_dirs, family):
    """q/k/v biases (Qwen2), q/k norms and tied embeddings (Qwen3), Mistral: the draft LM runs as
    a Target of the same family."""
    target = Target.load(str(tiny_target_dirs[family]))
    ps = [target.tokenizer(t)["input_ids"] for t in TEXTS]
    proposer = DraftLMProposer(_drafter(target, target.num_layers, noise=0.3))
    plain = [r.tokens for r in generate_plain_batch(target, ps, N_NEW).rows]
    for shape in (SHAPES["chain3"], SHAPES["tree"]):
        assert [r.tokens for r in Decoder(target, proposer).generate(ps, N_NEW, shape).rows] == plain


@pytest.mark.parametrize("method", list(SHAPES))
def test_greedy_equals_plain_decoding(tiny_llama, noisy, prompts, alone, method):
    shape = SHAPES[method]
    for b, p in enumerate(prompts):
        res = SpeculativeDecoder(tiny_llama, noisy).generate(p, N_NEW, shape)
        assert res.tokens == alone[b]
    res = Decoder(tiny_llama, noisy).generate(prompts, N_NEW, shape)
    assert [r.tokens for r in res.rows] == [r.tokens for r in generate_plain_batch(tiny_llama, prompts, N_NEW).rows]
    accepted, drafted = sum(sum(r.accept_lengths) for r in res.rows), sum(sum(r.num_drafted) for r in res.rows)
    assert 0 < accepted < sum(len(r.accept_lengths) for r in res.rows) * shape.max_depth <= drafted  # kept some, rolled back some


@pytest.mark.parametrize("method", ["chain1", "chain3", "static"])
def test_the_target_as_its_own_draft_is_accepted_in_full(tiny_llama, exact, prompts, method):
    shape = SHAPES[method]
    for batch in ([prompts[1]], prompts):
        res = Decoder(tiny_llama, exact).generate(batch, N_NEW, shape)
        for r in res.rows:
            assert r.accept_lengths and set(r.accept_lengths) == {shape.max_depth}
            assert r.stats().tau == shape.max_depth + 1


@pytest.mark.parametrize("method", ["chain3", "tree"])
def test_cache_holds_what_a_fresh_pass_over_the_committed_tokens_gives(tiny_llama, noisy, prompts, alone, monkeypatch, method):
    """After roll-backs (tree paths moved into place) and the cache's growth beyond its first
    room, each committed slot holds the keys and values a fresh pass over the committed tokens
    gives (a batch of one drafts with the proposer itself, whose state stays readable)."""
    monkeypatch.setattr(draft_lm, "ROOM", 1)
    n_new = 80  # beyond the first allocation of 64 slots
    res = SpeculativeDecoder(tiny_llama, noisy).generate(prompts[1], n_new, SHAPES[method])
    assert res.tokens[:N_NEW] == alone[1]
    rows, lm = noisy.rows_of_one, noisy.lm
    assert rows.cache.max_len > 64
    n = rows.committed[0]
    assert len(prompts[1]) + 40 < n <= len(prompts[1]) + n_new
    fresh = lm.new_cache(1, n)
    lm(torch.tensor([(prompts[1] + res.tokens)[:n]]), cache=fresh, logits=None)
    for got, want in ((rows.cache.k, fresh.k), (rows.cache.v, fresh.v)):
        torch.testing.assert_close(got[:, 0, :, :n], want[:, 0, :, :n], atol=1e-5, rtol=1e-4)


def _advance_rows(alone, pos, kept, *row_proposers):
    """Advance each row by its next ``kept[r]`` greedy tokens (``pos[r]``: the first of them)."""
    accepted = [torch.tensor(alone[r][pos[r] : pos[r] + n]) for r, n in enumerate(kept)]
    for r, n in enumerate(kept):
        pos[r] += n
    for props in row_proposers:
        props.advance(accepted, [{} for _ in kept], list(range(len(kept))))


@pytest.mark.parametrize("method", list(SHAPES))
def test_rows_drafted_together_draft_what_each_row_drafts_alone(tiny_llama, noisy, prompts, alone, method):
    """One forward per draft position for every row (padded, one ragged cache) drafts what each
    row's own proposer drafts, after rows kept different numbers of tokens and after rows left
    the batch; and the batch decodes losslessly with rows leaving at their own end."""
    shape = SHAPES[method]
    together, by_row = noisy.batched(3, shape), Proposer.batched(noisy, 3, shape)
    assert isinstance(together, DraftLMRows) and not isinstance(by_row, DraftLMRows)
    for props in (together, by_row):
        props.configure(Sampling())
        for b, p in enumerate(prompts):
            props.start(b, torch.tensor(p), {}, alone[b][0])

    def same():
        a, b = together.propose(shape), by_row.propose(shape)
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert x.tokens.tolist() == y.tokens.tolist()
            if not isinstance(shape, Chain):
                assert x.parents.tolist() == y.parents.tolist() and x.depth.tolist() == y.depth.tolist()

    pos = [1, 1, 1]
    same()
    _advance_rows(alone, pos, [1, 4, 2], together, by_row)
    same()
    _advance_rows(alone, pos, [2, 1, 3], together, by_row)
    for props in (together, by_row):
        props.select([0, 2])
    same()
    eos = alone[1][5]  # only row 1 emits it: that row leaves early, the others go on
    assert eos not in alone[0] + alone[2]
    res = Decoder(tiny_llama, noisy).generate(prompts, N_NEW, shape, eos_token_id=eos)
    assert [r.tokens for r in res.rows] == [r.tokens for r in generate_plain_batch(tiny_llama, prompts, N_NEW, eos_token_id=eos).rows]
    assert res.rows[1].stop_reason == "eos" and [res.rows[b].stop_reason for b in (0, 2)] == ["length", "length"]


def test_min_confidence_shortens_chains_and_stays_exact(tiny_llama, noisy, prompts):
    full = Decoder(tiny_llama, noisy).generate(prompts, N_NEW, Chain(4))
    short = Decoder(tiny_llama, noisy).generate(prompts, N_NEW, Chain(4, min_confidence=0.6))
    assert [r.tokens for r in short.rows] == [r.tokens for r in full.rows]
    assert sum(sum(r.num_drafted) for r in short.rows) < sum(sum(r.num_drafted) for r in full.rows)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_drafts_carry_the_distribution_they_were_drawn_from(noisy, prompts, temperature):
    """Greedy: the draft LM's argmax chain, point masses (no probs). Sampling: each draft drawn
    from the processed distribution of the draft LM after the tokens before it, returned with it."""
    p = noisy.fork()
    p.configure(Sampling(temperature, 5, 1.0, torch.Generator().manual_seed(0)))
    p.start(torch.tensor(prompts[0]), {}, 7)
    d = p.propose(Chain(3))
    assert (d.probs is None) == (temperature == 0.0)
    seq = prompts[0] + [7]
    for j in range(3):
        logits = p.lm(torch.tensor([seq]), logits="last").logits[0, -1]
        if temperature == 0.0:
            assert int(d.tokens[j]) == int(logits.argmax())
        else:
            torch.testing.assert_close(d.probs[j], process_logits(logits, temperature, 5), atol=1e-5, rtol=1e-4)
            assert d.probs[j, d.tokens[j]] > 0
        seq.append(int(d.tokens[j]))


def test_sampled_drafts_keep_the_targets_distribution(tiny_llama, noisy, prompts):
    """Two rows, drafts drawn from the draft's processed distribution and returned with it: each
    row's first three tokens follow the target's top-k=3 distribution (chi-square, with power)."""
    ps = prompts[:2]
    temperature, top_k, n = 1.0, 3, 500
    dec = Decoder(tiny_llama, noisy)
    assert_batch_follows_target(dec, tiny_llama, ps, temperature, top_k, n)


def test_report_states_the_draft_kv_cache_beside_the_targets(tiny_llama, prompts):
    proposer = DraftLMProposer(_drafter(tiny_llama, 2))
    per_layer = 2 * tiny_llama.config.num_key_value_heads * tiny_llama.head_dim * 4  # K and V, fp32
    assert tiny_llama.kv_bytes_per_token == tiny_llama.num_layers * per_layer
    assert proposer.cache_bytes_per_token == 2 * per_layer
    report = evaluate(tiny_llama, proposer, [EvalPrompt("c", prompts[0])], Chain(2), max_new_tokens=4, warmup=False)
    assert report["draft_kv_cache"] == {"bytes_per_token": 2 * per_layer, "target_bytes_per_token": 4 * per_layer, "share": 0.5}
    assert f"drafter KV cache: {2 * per_layer:,} bytes per token of context, 50.0 % of the target's {4 * per_layer:,}" in markdown(report)
