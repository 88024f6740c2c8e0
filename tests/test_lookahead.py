"""Jacobi lookahead decoding (``--drafter lookahead``): the window's mask and positions (each
lookahead input's logits equal a plain forward over the run of text it sees), its update and the
n-gram pool, greedy output equal to plain decoding (chain and tree, batch 1 and 3), lossless
sampling, drafts accepted on a repetitive continuation, and one-line errors for bad options."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from draftlab.errors import DraftlabError
from draftlab.inference.decoder import Decoder, SpeculativeDecoder, generate_plain
from draftlab.inference.lookahead import LookaheadProposer, NgramPool, branch_size, window_layout
from draftlab.inference.proposer import FREE_DRAFTERS
from draftlab.inference.sampling import process_logits
from draftlab.inference.shapes import Chain, DynamicTree
from draftlab.inference.tree import validate_tree
from tiny import assert_follows_target, assert_one_line

TEXTS = ["The quick brown fox jumps", "a b c a b c a b", "def add(a, b):\n    return a + b\n\nprint(add(2, 3))"]
N_NEW = 24

pytestmark = pytest.mark.usefixtures("one_thread")


class Recording(LookaheadProposer):
    """Records, per step, the text so far, the branch and the logits handed back."""

    def start(self, prompt_ids, hidden, next_token):
        super().start(prompt_ids, hidden, next_token)
        self.text, self.seen = prompt_ids.tolist() + [int(next_token)], []

    def advance(self, accepted, hidden):
        super().advance(accepted, hidden)
        self.text += accepted.tolist()

    def propose(self, shape):
        draft = super().propose(shape)
        b = draft.branch
        record = {"text": list(self.text), "tokens": b.tokens.tolist(), "positions": b.positions.tolist(), "mask": b.mask,
                  "levels": [list(level) for level in self.levels], "pool": {k: list(v) for k, v in self.pool.grams.items()}}
        self.seen.append(record)
        inner = b.on_logits

        def on_logits(logits):
            record["logits"] = logits.clone()
            inner(logits)

        b.on_logits = on_logits
        return draft


# ---------------------------------------------------------------------- the window
def test_layout_is_the_papers_mask():
    # W = 2 columns, 3 levels: level 0 holds column 1 (column 0 is the last token)
    positions, mask = window_layout(3, 2)
    cells = [(0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    assert positions.tolist() == [lv + c for lv, c in cells]
    expected = [[1, 0, 0, 0, 0],  # (0,1): level 0 up to column 1
                [0, 1, 0, 0, 0],  # (1,0): level 0 up to column 0 (the last token only), itself
                [1, 0, 1, 0, 0],  # (1,1): (0,1), itself
                [0, 1, 0, 1, 0],  # (2,0): (1,0), itself
                [1, 0, 1, 0, 1]]  # (2,1): (0,1), (1,1), itself
    assert mask.int().tolist() == expected
    assert branch_size(2, 4) == 5 and branch_size(7, 5) == 4 * 7 - 1 and branch_size(1, 16) == 8 * 8 - 1  # the warm-up's wider window


def test_pool_is_lru_bounded_by_g():
    pool = NgramPool(2)
    pool.add_run([1, 2, 3, 1, 4, 5, 1, 2, 3], 3)
    assert pool.get(1) == [(2, 3), (4, 5)]  # the most recent first; (2, 3) seen again
    pool.add(1, (6, 7))
    assert pool.get(1) == [(6, 7), (2, 3)]  # (4, 5), least recent, out
    assert pool.get(9) == []


def test_branch_logits_equal_a_plain_forward(tiny_llama, prompts):
    """Every lookahead input's logits, in the verify forward, equal the target's over the
    prompt, the kept text and the run of window tokens the input sees (ordered by position);
    the window warms up in N-2 steps to W columns, then moves one level per step."""
    W, N = 3, 4
    p = Recording(W=W, N=N, G=3)
    res = SpeculativeDecoder(tiny_llama, p).generate(prompts[1], 12, DynamicTree(3, 3, 9))
    assert len(p.seen) == res.num_steps and all("logits" in r for r in p.seen)
    widths = [[len(level) for level in r["levels"]] for r in p.seen]
    assert widths[:3] == [[W + N - 3], [W + N - 4, W + N - 3], [W - 1, W, W]]  # level 0 from column 1
    assert all(w == [W - 1, W, W] for w in widths[2:])
    for before, after in zip(p.seen[2:], p.seen[3:]):  # full window: the new level on top, the oldest out
        assert after["levels"][1] == before["levels"][2] and after["levels"][0] == before["levels"][1][1:]
        assert after["levels"][2] == before["logits"][-W:].argmax(-1).tolist()
    checked = 0
    for r in p.seen:
        mask, tokens, positions = r["mask"], r["tokens"], r["positions"]
        for i in range(len(tokens)):
            seen = sorted((positions[j], tokens[j]) for j in range(len(tokens)) if mask[i, j])
            assert [pos for pos, _ in seen] == list(range(1, positions[i] + 1))  # a contiguous run ending at i
            seq = r["text"] + [tok for _, tok in seen]
            plain = tiny_llama(torch.tensor([seq]), logits="last").logits[0, -1]
            torch.testing.assert_close(r["logits"][i], plain, atol=1e-4, rtol=1e-4)
            checked += 1
    assert checked >= 30


def test_full_window_ngrams_enter_the_pool(tiny_llama, prompts):
    W, N = 3, 3
    p = Recording(W=W, N=N, G=W)
    SpeculativeDecoder(tiny_llama, p).generate(prompts[0], 6, Chain(2))
    assert not p.seen[1]["pool"]  # the warm-up step adds no n-gram
    r = p.seen[1]  # the first step with a full window (N - 2 = 1 warm-up step)
    new = r["logits"][-W:].argmax(-1).tolist()
    keys = [r["text"][-1]] + r["levels"][0]  # column 0's key is the last token
    grams = {(keys[c], (r["levels"][1][c], new[c])) for c in range(W)}
    assert grams == {(k, g) for k, v in p.seen[2]["pool"].items() for g in v}


# ---------------------------------------------------------------------- lossless decoding
@pytest.mark.parametrize("shape", [Chain(3), DynamicTree(3, 2, 8)], ids=["chain", "tree"])
@pytest.mark.parametrize("options", [dict(W=4, N=3, G=4), dict(W=3, N=2, G=2, pool_from_prompt=True)], ids=["N3", "N2-pool"])
def test_greedy_equals_plain_decoding(tiny_llama, prompts, alone, shape, options):
    proposer = LookaheadProposer(**options)
    for p, ref in zip(prompts, alone):
        res = SpeculativeDecoder(tiny_llama, proposer).generate(p, N_NEW, shape)
        assert res.tokens == ref
    res = Decoder(tiny_llama, proposer).generate(prompts, N_NEW, shape)  # one fork per row, branches padded
    assert [r.tokens for r in res.rows] == alone
    assert sum(sum(r.accept_lengths) for r in res.rows) >= 1  # drafts accepted, not only drafted


def test_tree_merges_the_pool_within_the_shape():
    p = LookaheadProposer(W=2, N=4, G=4, pool_from_prompt=True)
    p.start(torch.tensor([5, 1, 2, 3, 5, 1, 2, 4, 5, 6, 7, 8, 9, 5]), {}, 1)
    # the key is the last token, 1: its n-grams (2, 3, 5) then (2, 4, 5), merged most recent first
    tree = p.propose(DynamicTree(depth=3, top_k=4, total_tokens=16))
    assert (tree.tokens.tolist(), tree.parents.tolist()) == ([2, 4, 5, 3, 5], [0, 1, 2, 1, 4])
    p.advance(torch.tensor([9, 5]), {})  # the kept text's n-grams join: pool[5] ends with (1, 9, 5)
    tree = p.propose(DynamicTree(depth=3, top_k=4, total_tokens=16))
    validate_tree(tree, 20)
    assert tree.tokens.tolist() == [1, 9, 5, 6, 7, 8, 2, 4, 3]  # (1,9,5), (6,7,8), (1,2,4), (1,2,3)
    assert tree.parents.tolist() == [0, 1, 2, 0, 4, 5, 1, 7, 7]
    assert p.propose(DynamicTree(depth=2, top_k=1, total_tokens=16)).tokens.tolist() == [1, 9]
    assert p.propose(DynamicTree(depth=3, top_k=4, total_tokens=4)).tokens.tolist() == [1, 9, 5, 6]
    assert p.propose(Chain(2)).tokens.tolist() == [1, 9]  # the most recent n-gram, cut to k
    unseeded = LookaheadProposer(W=2, N=4, G=4)
    unseeded.start(torch.tensor([5, 1, 2, 3, 5, 1, 2, 4, 5, 6, 7, 8, 9, 5]), {}, 1)
    unseeded.advance(torch.tensor([9, 5]), {})
    assert unseeded.propose(Chain(2)).tokens.numel() == 0 and not unseeded.pool.grams  # only the window feeds it


def test_repetitive_continuation_accepts_drafts(tiny_llama):
    """The window alone (no pool seeding) finds the n-grams of a repetitive continuation."""
    prompt = tiny_llama.tokenizer("dog dog dog dog dog dog")["input_ids"]
    ref = generate_plain(tiny_llama, prompt, 40).tokens
    assert len(set(ref[-20:])) <= 3, ref  # the tiny target's continuation loops (else this test shows nothing)
    for shape in (Chain(4), DynamicTree(4, 4, 16)):
        res = SpeculativeDecoder(tiny_llama, LookaheadProposer(W=4, N=3, G=4)).generate(prompt, 40, shape)
        assert res.tokens == ref
        tau = len(res.tokens) / res.num_steps
        assert tau > 1.8, tau


@pytest.mark.parametrize("shape", [Chain(2), DynamicTree(2, 2, 6)], ids=["chain", "tree"])
def test_sampling_follows_the_target(tiny_llama, shape):
    """With the pool seeded by the target's own likely continuations, drafts are accepted at
    times and rejected at times; the first three tokens still follow the target's top-k = 3
    distribution (chi-square)."""
    prompt = tiny_llama.tokenizer(TEXTS[0])["input_ids"]
    temperature, top_k, n = 1.0, 3, 500

    def top(seq, m):
        probs = process_logits(tiny_llama(torch.tensor([seq]), logits="last").logits[0, -1], temperature, top_k)
        return probs.topk(m).indices.tolist()

    guesses = {x: [(y, top(prompt + [x, y], 1)[0]) for y in top(prompt + [x], 2)[::-1]] for x in top(prompt, 3)}

    class Seeded(LookaheadProposer):
        def start(self, prompt_ids, hidden, next_token):
            super().start(prompt_ids, hidden, next_token)
            for gram in guesses[int(next_token)]:
                self.pool.add(int(next_token), gram)

    dec = SpeculativeDecoder(tiny_llama, Seeded(W=3, N=3, G=2))
    counts, steps = Counter(), Counter()
    for s in range(n):
        r = dec.generate(prompt, 3, shape, temperature=temperature, top_k=top_k, seed=s)
        counts[tuple(r.tokens)] += 1
        steps.update(r.accept_lengths[:1])
    assert len(steps) == 3, steps  # the first step accepted 0, 1 and 2 drafts at times
    assert_follows_target(counts, tiny_llama, prompt, 3, temperature, top_k, n)


# ---------------------------------------------------------------------- options and the command line
def test_bad_options_are_one_line_errors():
    for kw, message in [(dict(W=0), "W \\(window\\) must be an integer in 1..64, got 0"), (dict(W=65), "W \\(window\\)"),
                        (dict(N=1), "N \\(n-gram size\\) must be an integer in 2..16"), (dict(N=17), "N \\(n-gram"),
                        (dict(G=0), "G \\(n-grams verified per step\\) must be"), (dict(G=65), "G \\(n-grams"),
                        (dict(W=True), "W \\(window\\)"), (dict(pool_from_prompt=1), "pool_from_prompt must be true or false")]:
        with pytest.raises(DraftlabError) as e:
            LookaheadProposer(**kw)
        assert_one_line(e, message)
    build = LookaheadProposer.from_options({"W": "5", "N": "4", "G": "3", "pool_from_prompt": "true"})
    p = build(None)
    assert (p.W, p.N, p.G, p.pool_from_prompt, p.branch_inputs) == (5, 4, 3, True, branch_size(5, 4))


def test_cli(tiny_target_dirs, tmp_path, capsys):
    from draftlab.cli import main

    assert FREE_DRAFTERS.get("lookahead") is LookaheadProposer
    data = tmp_path / "eval.jsonl"
    data.write_text("".join(json.dumps({"category": c, "turns": [t]}) + "\n" for c, t in (("code", TEXTS[2]), ("chat", TEXTS[1]))))
    out = tmp_path / "rep" / "eval.json"
    argv = ["eval", "--drafter", "lookahead", "--target", str(tiny_target_dirs["llama"]), "--data", str(data), "--num-prompts", "2",
            "--max-new-tokens", "8", "--method", "tree", "--tree-depth", "3", "--batch-sizes", "1,2",
            "--drafter-option", "W=3", "--drafter-option", "N=3", "--drafter-option", "pool_from_prompt=yes", "--report", str(out)]
    assert main(argv) == 0
    rep = json.loads(out.read_text())
    assert rep["greedy_match"] == "2/2" and rep["label"] == "lookahead"
    capsys.readouterr()
    # bad values: exit 2, one line, before any model loads (the target path does not exist)
    base = ["eval", "--drafter", "lookahead", "--target", str(tmp_path / "no-target"), "--data", str(data)]
    for extra, message in [(["--drafter-option", "W=0"], "W (window) must be an integer in 1..64, got 0"),
                           (["--drafter-option", "N=1"], "N (n-gram size) must be"),
                           (["--drafter-option", "G=0"], "G (n-grams verified per step) must be"),
                           (["--drafter-option", "W=1000"], "W (window) must be"),
                           (["--drafter-option", "N=five"], "N: expected an integer"),
                           (["--drafter-option", "pool_from_prompt=maybe"], "pool_from_prompt: expected true or false"),
                           (["--drafter-option", "window=3"], "not an option of drafter 'lookahead'"),
                           (["--method", "block"], "does not draft block")]:
        assert main(base + extra) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
