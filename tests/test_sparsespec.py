"""Sparse self-speculation (``--drafter sparsespec``, SparseSpec's PillarAttn; ``--drafter streaming``,
its sliding-window baseline) on tiny random targets: the target's two seams (recorded attention
scores equal HF's eager attention averaged over the query group and the inputs; a sparse forward
reads exactly the listed keys), the selection (top K - r of the verify's scores plus every token
since, K = max(budget, ceil(fraction * L)), refreshed every ``stride`` draft steps), greedy output
equal to plain decoding, sampled output following the target's distribution (a chi-square that
rejects drafts carrying the wrong q; each q recomputed from its forward), and bad options as
one-line errors."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from draftlab.errors import DraftlabError
from draftlab.inference.decoder import Decoder, SpeculativeDecoder, TargetSteps, generate_plain, generate_plain_batch
from draftlab.inference.graphs import GraphedTarget
from draftlab.inference.proposer import FREE_DRAFTERS
from draftlab.inference.shapes import Chain
from draftlab.inference.sparsespec import SparseRows, SparseSpecProposer, StreamingProposer, key_budget
from draftlab.models.sparse_attention import AttentionRecorder, SparseKeys
from tiny import assert_batch_follows_target, assert_one_line, chi2_pvalue, exact_joint

TEXTS = ["The quick brown fox jumps over the lazy dog", "Speculative decoding drafts tokens and the target verifies them",
         "a b c a b c a b"]
N_NEW = 24

pytestmark = pytest.mark.usefixtures("one_thread")


def _sparse(**kw) -> SparseSpecProposer:
    """A budget far below the tiny prompts' lengths, so drafts are sparse and accepted in part."""
    return SparseSpecProposer(**{"budget": 4, "fraction": 0.0, "stride": 2, **kw})


def _streaming(**kw) -> StreamingProposer:
    return StreamingProposer(**{"budget": 4, "fraction": 0.0, "stride": 2, "sink": 1, **kw})


# ---------------------------------------------------------------------------- the target's seams
def test_recorded_scores_are_eager_attention_averaged_over_group_and_inputs(tiny_llama, tiny_target_dirs, prompts):
    """Two rows of different lengths, recorded in reverse row order: each layer's [KV head, key]
    scores of three new inputs equal HF's eager attention probabilities of the same sequence,
    averaged over the 2 query heads of each KV head and the 3 inputs; one forward only."""
    from transformers import AutoModelForCausalLM

    t = tiny_llama
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_target_dirs["llama"]), attn_implementation="eager").eval()
    rows, new = [prompts[0], prompts[1]], [[5, 9, 11], [7, 3, 2]]
    cache = t.new_cache(2, 64, ragged=True)
    for b, p in enumerate(rows):
        t(torch.tensor([p]), cache=cache.row(b), logits=None)
    cache.lengths = [len(p) for p in rows]
    cache.recorder = AttentionRecorder(t.num_layers, [1, 0])
    recorder = cache.recorder
    t(torch.tensor(new), cache=cache, logits=None)
    assert cache.recorder is None and recorder.complete
    hk, g = t.config.num_key_value_heads, t.config.num_attention_heads // t.config.num_key_value_heads
    for pos, b in enumerate([1, 0]):
        ids = torch.tensor([rows[b] + new[b]])
        with torch.no_grad():
            attn = hf(ids, output_attentions=True).attentions
        S = ids.shape[1]
        for i in range(t.num_layers):
            ref = attn[i][0, :, -3:, :].reshape(hk, g, 3, S).mean((1, 2))
            got = recorder.scores[i][pos]
            torch.testing.assert_close(got[:, :S], ref, atol=1e-5, rtol=1e-4)
            assert not got[:, S:].any()  # slots beyond the row: no input sees them
    before = [s.clone() for s in recorder.scores]
    t(torch.tensor([[1], [1]]), cache=cache, logits=None)  # detached: a later forward records nothing
    assert all(torch.equal(a, b) for a, b in zip(before, recorder.scores))


def test_a_sparse_forward_reads_exactly_the_listed_keys(tiny_llama, prompts):
    """One input over a prompt's cache: listing every past slot is the full forward; changing a
    key or value at a slot one KV head does not list leaves the logits bit-equal, at a slot it
    lists changes them."""
    t = tiny_llama
    p = prompts[1]
    n, L, H = len(p), t.num_layers, t.config.num_key_value_heads
    cache = t.new_cache(1, 64, ragged=True)
    t(torch.tensor([p]), cache=cache, logits=None)

    def step(keys):
        out = t(torch.tensor([[7]]), cache=cache, keys=keys, logits="last").logits[0, -1]
        cache.crop([n])
        return out

    full = step(None)
    every = SparseKeys(torch.arange(n).expand(L, 1, H, n).clone(), torch.ones(L, 1, H, n, dtype=torch.bool))
    torch.testing.assert_close(step(every), full, atol=1e-5, rtol=1e-5)
    index = torch.tensor([0, 2, 4, 0]).expand(L, 1, H, 4).clone()
    valid = torch.tensor([True, True, True, False]).expand(L, 1, H, 4).clone()
    index[1, 0, 1, 1] = 3  # layer 1, KV head 1: slots 0, 3, 4; head 0: 0, 2, 4
    keys = SparseKeys(index, valid)
    sparse = step(keys)
    assert not torch.allclose(sparse, full, atol=1e-3)
    for slot, head, listed in [(2, 1, False), (3, 0, False), (1, 0, False), (2, 0, True), (3, 1, True)]:
        for buf in (cache.k, cache.v):
            saved = buf[1, 0, head, slot].clone()
            buf[1, 0, head, slot] += 1.0
            changed = not torch.equal(step(keys), sparse)
            buf[1, 0, head, slot] = saved
            assert changed == listed, (slot, head)


# ---------------------------------------------------------------------------- the selection
def test_the_budget_rule():
    assert key_budget(100, 128, 0.05) == 100  # never more than the keys there are
    assert key_budget(1000, 128, 0.05) == 128 and key_budget(2560, 128, 0.05) == 128
    assert key_budget(2561, 128, 0.05) == 129 and key_budget(4000, 128, 0.05) == 200  # ceil(0.05 L)
    assert key_budget(50, 4, 0.0) == 4 and key_budget(50, 1, 0.5) == 25


@pytest.fixture
def spy(monkeypatch):
    """Each draft forward's (row lengths, keys) and each propose's recorder (or None), in order."""
    calls = {"forwards": [], "recorders": []}
    forward, record, propose = TargetSteps.forward, TargetSteps.record_next_forward, SparseRows.propose

    def spy_forward(self, input_ids, **kw):
        calls["forwards"].append((self.lengths(), kw.get("keys")))
        return forward(self, input_ids, **kw)

    def spy_record(self):
        rec = record(self)
        calls["recorders"][-1] = rec
        return rec

    def spy_propose(self, shape):
        calls["recorders"].append(None)
        return propose(self, shape)

    monkeypatch.setattr(TargetSteps, "forward", spy_forward)
    monkeypatch.setattr(TargetSteps, "record_next_forward", spy_record)
    monkeypatch.setattr(SparseRows, "propose", spy_propose)
    return calls


def _attended(keys: SparseKeys, layer: int, head: int, row: int = 0) -> list[int]:
    return sorted(keys.index[layer, row, head][keys.valid[layer, row, head]].tolist())


@pytest.mark.parametrize("budget,fraction,stride", [(4, 0.0, 4), (3, 0.25, 3)])
def test_drafts_attend_to_the_top_scores_of_the_last_refresh_and_every_token_since(tiny_llama, prompts, spy, budget, fraction,
                                                                                   stride):
    """Chains of 2, stride 3 or 4: the verify after every second draft records scores (the first:
    after the cold start's drafts, which attend to every key); the drafts then attend, per layer
    and KV head, to the top K - r keys before that verify by its scores (K = max(budget,
    ceil(fraction L)), L the kept length, r the verify's kept inputs) and to every slot from the
    verify's first on."""
    t = tiny_llama
    proposer = _sparse(budget=budget, fraction=fraction, stride=stride)
    res = SpeculativeDecoder(t, proposer).generate(prompts[0], 16, Chain(2))
    steps = len(res.accept_lengths)
    assert [r is not None for r in spy["recorders"]] == [s % 2 == 0 for s in range(steps)]
    L, H = t.num_layers, t.config.num_key_value_heads
    first = spy["forwards"][0]
    assert all(_attended(first[1], i, h) == list(range(first[0][0])) for i in range(L) for h in range(H))  # cold start
    checked, chosen = 0, set()
    for s in range(1, steps):  # step s drafts with the selection made after the verify of step s - 1 or s - 2
        refresh = s - 1 if s % 2 == 1 else s - 2
        rec = spy["recorders"][refresh]
        pre = spy["forwards"][2 * refresh][0][0]  # that verify's first slot
        kept = spy["forwards"][2 * refresh + 2][0][0]  # the kept length after it
        n = max(0, min(key_budget(kept, budget, fraction) - (kept - pre), pre))
        for j in range(2):
            lengths, keys = spy["forwards"][2 * s + j]
            for i in range(L):
                for h in range(H):
                    top = sorted(rec.scores[i][0, h, :pre].topk(n).indices.tolist())
                    assert _attended(keys, i, h) == top + list(range(pre, lengths[0]))
                    checked += 1
        chosen.add(tuple(tuple(_attended(keys, i, h)[:n]) for i in range(L) for h in range(H)))
    assert checked == (steps - 1) * 2 * L * H and proposer.refreshes == steps // 2
    assert len(chosen) > 1  # each refresh chose anew


def test_the_sliding_window_keeps_sinks_and_the_most_recent_keys(tiny_llama, prompts, spy):
    """Sparse from the first draft: the first ``sink`` keys and the K - sink - r keys before the
    last refresh's first slot, then every slot since; with ``window`` K = sink + window."""
    t = tiny_llama
    n = len(prompts[1])
    SpeculativeDecoder(t, _streaming(sink=2, budget=6)).generate(prompts[1], 10, Chain(2))
    lengths, keys = spy["forwards"][0]
    assert lengths == [n] and _attended(keys, 0, 0) == [0, 1, n - 4, n - 3, n - 2, n - 1]
    assert all(r is None for r in spy["recorders"])  # no scores needed
    spy["forwards"].clear()
    SpeculativeDecoder(t, _streaming(sink=1, window=2, budget=50)).generate(prompts[1], 10, Chain(2))
    lengths, keys = spy["forwards"][1]
    assert _attended(keys, 3, 1) == [0, n - 2, n - 1, n]


# ---------------------------------------------------------------------------- decoding
@pytest.mark.parametrize("make,budget", [(_sparse, 4), (_streaming, 12)], ids=["sparsespec", "streaming"])
def test_greedy_equals_plain_decoding(tiny_llama, prompts, make, budget):
    """(The sliding window needs a larger budget than PillarAttn to have drafts accepted here.)"""
    t = tiny_llama
    batch = [r.tokens for r in generate_plain_batch(t, prompts, N_NEW).rows]
    proposer = make(budget=budget)
    res = Decoder(t, proposer).generate(prompts, N_NEW, Chain(3))
    assert [r.tokens for r in res.rows] == batch
    accepted, drafted = sum(sum(r.accept_lengths) for r in res.rows), sum(sum(r.num_drafted) for r in res.rows)
    assert 0 < accepted < drafted and proposer.kv_read_fraction < 0.5  # sparse drafts, accepted in part
    for p in prompts:
        assert SpeculativeDecoder(t, proposer).generate(p, N_NEW, Chain(2)).tokens == generate_plain(t, p, N_NEW).tokens
    dense = make(budget=1000)  # every key: the draft is the target itself
    res = Decoder(t, dense).generate(prompts, N_NEW, Chain(3))
    assert [r.tokens for r in res.rows] == batch and dense.kv_read_fraction == 1.0
    assert all(a == d for r in res.rows for a, d in zip(r.accept_lengths[:-1], r.num_drafted[:-1]))


def test_cuda_graph_wrapper_runs_both_seams_eagerly(tiny_llama, prompts):
    """``--cuda-graphs`` wraps the target (replay mode on CPU): the sparse draft forwards and the
    recording verify run eagerly, and the output is plain decoding's."""
    graphed = GraphedTarget(tiny_llama, mode="replay")
    res = Decoder(graphed, _sparse(stride=4)).generate(prompts[:2], 12, Chain(2))
    assert [r.tokens for r in res.rows] == [r.tokens for r in generate_plain_batch(tiny_llama, prompts[:2], 12).rows]
    assert graphed.stats["eager: sparse keys or recorded attention"] > 0 and graphed.stats["replayed"] > 0


def test_sampled_drafts_carry_the_distribution_they_were_drawn_from(tiny_llama, prompts, spy, monkeypatch):
    """Each sampled draft's q is the processed distribution of the target's logits over the keys
    its forward was given, recomputed on a fresh cache holding the same tokens (the cold start's
    first step: every key), and the drafted token has mass under it."""
    from draftlab.inference.sampling import process_logits

    t, temperature, top_k = tiny_llama, 0.8, 5
    drafts, propose = [], SparseRows.propose

    def kept(self, shape):
        out = propose(self, shape)
        drafts.append(out[0])
        return out

    monkeypatch.setattr(SparseRows, "propose", kept)
    res = SpeculativeDecoder(t, _sparse(stride=3)).generate(prompts[1], 16, Chain(3), temperature=temperature, top_k=top_k)
    text = prompts[1] + res.tokens
    for s, draft in enumerate(drafts):
        pre = spy["forwards"][3 * s][0][0]
        cache = t.new_cache(1, 64, ragged=True)
        t(torch.tensor([text[:pre]]), cache=cache, logits=None)
        token = text[pre]
        for j in range(3):
            keys = spy["forwards"][3 * s + j][1]
            logits = t(torch.tensor([[token]]), cache=cache, keys=keys, logits="last").logits[0, -1]
            torch.testing.assert_close(draft.probs[j], process_logits(logits, temperature, top_k), atol=1e-5, rtol=1e-4)
            token = int(draft.tokens[j])
            assert draft.probs[j, token] > 0
    assert len(drafts) == len(res.accept_lengths) > 2


def _wrong_q(monkeypatch):
    """Drafts still drawn from q, returned with the mass of q's support turned over (q' ~ 1 - q
    there; with top-k = 2 the two probabilities swapped): a broken verifier input."""
    propose = SparseRows.propose

    def broken(self, shape):
        out = propose(self, shape)
        for d in out:
            if d.probs is not None:
                turned = (d.probs > 0) * (1 - d.probs)
                d.probs = turned / turned.sum(-1, keepdim=True)
        return out

    monkeypatch.setattr(SparseRows, "propose", broken)


def _counts(decoder, prompt, n_new, k, n, temperature, top_k):
    counts, accepted = Counter(), Counter()
    for s in range(n):
        r = decoder.generate(prompt, n_new, Chain(k), temperature=temperature, top_k=top_k, seed=s)
        counts[tuple(r.tokens)] += 1
        accepted.update(r.accept_lengths[1:])
    return counts, accepted


def _marginal(joint, positions) -> Counter:
    out = Counter()
    for tokens, p in joint.items():
        out[tuple(tokens[i] for i in positions)] += p
    return out


def test_sampled_sliding_window_drafts_keep_the_targets_distribution(tiny_llama, prompts):
    """Two rows, drafts sparse from the first step, sampled from their processed distribution and
    returned with it: each row's first three tokens follow the target's top-k=3 distribution."""
    dec = Decoder(tiny_llama, _streaming(budget=14))  # of 16 and 22 keys: every acceptance path taken
    assert_batch_follows_target(dec, tiny_llama, prompts[:2], 1.0, 3, 400)


def test_sampled_sparsespec_keeps_the_targets_distribution_and_the_check_catches_a_wrong_q(tiny_llama, prompts, monkeypatch):
    """Chains of 1, stride 1: the dense cold-start step emits tokens 1-2, sparse steps from the
    verify's scores tokens 3-4. The first five tokens follow the target's top-k=2 joint, and so do
    tokens 3-4 on their own (chi-square; the sparse steps both accepted and rejected); the same
    run with drafts carrying a wrong q is rejected by both."""
    p, n, temperature = prompts[0], 400, 0.5
    joint = exact_joint(tiny_llama, p, 5, temperature, 2)
    late = _marginal(joint, (3, 4))
    counts, accepted = _counts(SpeculativeDecoder(tiny_llama, _sparse(budget=12, stride=1)), p, 5, 1, n, temperature, 2)
    assert set(accepted) == {0, 1}, accepted
    assert chi2_pvalue(counts, joint, n) > 1e-3 and chi2_pvalue(_marginal(counts, (3, 4)), late, n) > 1e-3
    _wrong_q(monkeypatch)
    counts, _ = _counts(SpeculativeDecoder(tiny_llama, _sparse(budget=12, stride=1)), p, 5, 1, n, temperature, 2)
    assert chi2_pvalue(counts, joint, n) < 1e-3 and chi2_pvalue(_marginal(counts, (3, 4)), late, n) < 1e-3


# ---------------------------------------------------------------------------- options and the command line
def test_bad_options_are_one_line_errors():
    cases = [(SparseSpecProposer, {"budget": "0"}, "sparsespec drafter: budget must be an integer in 1..131072, got 0"),
             (SparseSpecProposer, {"stride": "0"}, "sparsespec drafter: stride must be an integer in 1..131072, got 0"),
             (SparseSpecProposer, {"fraction": "1.5"}, r"sparsespec drafter: fraction must be a number in \[0, 1\], got 1.5"),
             (SparseSpecProposer, {"budget": "ten"}, "--drafter-option budget: expected an integer, got 'ten'"),
             (SparseSpecProposer, {"sink": "4"}, "--drafter-option sink: not an option of drafter 'sparsespec'"),
             (StreamingProposer, {"window": "0"}, "streaming drafter: window must be an integer in 1..131072, got 0"),
             (StreamingProposer, {"sink": "-1"}, "streaming drafter: sink must be an integer in 0..131072, got -1"),
             (StreamingProposer, {"stride": "0"}, "streaming drafter: stride must be"),
             (StreamingProposer, {"budget": "0"}, "streaming drafter: budget must be")]
    for cls, options, message in cases:
        with pytest.raises(DraftlabError) as e:
            cls.from_options(options)
        assert_one_line(e, message)
    built = SparseSpecProposer.from_options({"budget": "64", "fraction": "0.1", "stride": "4"})(None)
    assert (built.budget, built.fraction, built.stride) == (64, 0.1, 4)
    built = StreamingProposer.from_options({"sink": "0", "window": "8"})(None)
    assert (built.sink, built.window, built.size(100), built.size(5)) == (0, 8, 8, 5)


def test_cli(tiny_target_dirs, tmp_path, capsys):
    from draftlab.cli import main

    assert FREE_DRAFTERS.get("sparsespec") is SparseSpecProposer and FREE_DRAFTERS.get("streaming") is StreamingProposer
    data = tmp_path / "eval.jsonl"
    data.write_text("".join(json.dumps({"category": "chat", "turns": [t]}) + "\n" for t in TEXTS[:2]))
    out = tmp_path / "rep" / "eval.json"
    for drafter, options in (("sparsespec", ["budget=4", "fraction=0", "stride=3"]), ("streaming", ["budget=4", "sink=1"])):
        argv = ["eval", "--drafter", drafter, "--target", str(tiny_target_dirs["llama"]), "--data", str(data),
                "--max-new-tokens", "8", "--k", "3", "--report", str(out)]
        assert main(argv + [a for o in options for a in ("--drafter-option", o)]) == 0
        rep = json.loads(out.read_text())
        assert rep["greedy_match"] == "2/2" and rep["drafter"] == drafter and 1 <= rep["tau"] <= 4
    capsys.readouterr()
    base = ["eval", "--target", str(tmp_path / "no-target"), "--data", str(data)]  # refused before any model loads
    for extra, message in [(["--drafter", "sparsespec", "--drafter-option", "budget=0"], "budget must be an integer in 1.."),
                           (["--drafter", "sparsespec", "--drafter-option", "stride=0"], "stride must be an integer in 1.."),
                           (["--drafter", "streaming", "--drafter-option", "window=0"], "window must be an integer in 1.."),
                           (["--drafter", "sparsespec", "--method", "tree"], "does not draft")]:
        assert main(base + extra) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err


@pytest.mark.parametrize("argv, message", [
    (["--drafters", "pillar"], "--drafters: expected sparsespec, streaming or both"),
    (["--budgets", "0"], "--budgets: expected integers >= 1"),
    (["--strides", "x"], "--strides: expected comma-separated integers"),
])
def test_the_bench_refuses_bad_flags_in_one_line(argv, message, capsys):
    from bench import sparsespec as bench

    assert bench.main(argv) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


def test_the_bench_runs_the_rows_asked_for():
    from bench import sparsespec as bench

    args = bench.parse_args(["--drafters", "sparsespec", "--budgets", "32", "--strides", "8,16"])
    assert args.drafters == ["sparsespec"] and args.strides == [8, 16]


def test_repeated_share_counts_new_tokens_that_copy_their_context():
    from bench.sparsespec import repeated_share

    assert repeated_share([1, 2, 3], [1, 2, 3, 1, 2], n=2) == 4 / 5  # (3,1) is new; the rest occurred before
    assert repeated_share([5, 6], [7, 8, 9], n=2) == 0.0
    assert repeated_share([], [4, 4, 4, 4], n=2) == 2 / 4  # (4,4) first completes at the second token
