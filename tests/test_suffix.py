"""The suffix-trie drafter (``--drafter suffix``): greedy output equal to plain decoding (chain and
tree, batch 1 and 3), drafts by count from the prompt, the generated tokens and a corpus, the node
bound under pruning, the corpus cache, lossless sampling and one-line errors for bad inputs."""

from __future__ import annotations

import json
import random
from collections import Counter

import pytest
import torch

from draftlab.errors import DraftlabError
from draftlab.inference.decoder import Decoder, SpeculativeDecoder, generate_plain
from draftlab.inference.proposer import FREE_DRAFTERS
from draftlab.inference.shapes import Chain, DynamicTree
from draftlab.inference.suffix import SuffixProposer, SuffixTrie
from draftlab.inference.tree import validate_tree
from tiny import assert_follows_target, assert_one_line, write_chat

TEXTS = ["The quick brown fox jumps", "def add(a, b):\n    return a + b\n\nprint(add(2, 3))", "a b c a b c a b"]
N_NEW = 24


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTLAB_CACHE", str(tmp_path / "cache"))


def _paths(tree) -> set[tuple[int, ...]]:
    out = set()
    for leaf in range(1, tree.tokens.numel() + 1):
        path, node = [], leaf
        while node:
            path.append(int(tree.tokens[node - 1]))
            node = int(tree.parents[node - 1])
        out.add(tuple(reversed(path)))
    return out


def _table(trie) -> dict:
    """The trie as stored: (parent, token, count) columns, breadth first."""
    from safetensors.torch import load

    return {k: v.tolist() for k, v in load(trie.to_bytes("k")).items()}


def _node_count(node) -> int:
    return sum(1 + _node_count(c) for c in node.kids.values())


# ---------------------------------------------------------------------- drafting
def test_proposes_the_most_frequent_continuation_seen_in_the_prompt():
    p = SuffixProposer(max_depth=8, min_prob=0.0)
    # "1 2" is followed by 3 twice, by 4 once (the most recent): counts win, unlike prompt lookup
    p.start(torch.tensor([1, 2, 3, 5, 1, 2, 3, 6, 1, 2, 4, 7, 9]), {}, 1)
    p.advance(torch.tensor([2]), {})
    assert p.propose(Chain(2)).tokens.tolist() == [3, 6]  # after "1 2 3": 5 and 6 once each, 6 more recently
    tree = p.propose(DynamicTree(depth=2, top_k=3, total_tokens=8))
    validate_tree(tree, 20)
    assert _paths(tree) >= {(3, 6), (4, 7)} and tree.tokens[0] == 3  # the best branch first
    assert p.propose(DynamicTree(depth=2, top_k=1, total_tokens=8)).tokens.tolist() == [3, 6]
    # min_prob stops where the count probability falls: 3 has 2/3, then 5 or 6 has 1/2 of that
    strict = SuffixProposer(max_depth=8, min_prob=0.5)
    strict.start(torch.tensor([1, 2, 3, 5, 1, 2, 3, 6, 1, 2, 4, 7, 9, 1]), {}, 2)
    assert strict.propose(Chain(4)).tokens.tolist() == [3]


def test_generated_tokens_are_inserted():
    p = SuffixProposer(max_depth=6)
    p.start(torch.tensor([10, 11, 12]), {}, 13)
    assert p.propose(Chain(3)).tokens.numel() == 0  # nothing repeats yet
    p.advance(torch.tensor([21, 22, 23, 24]), {})
    p.advance(torch.tensor([30, 21]), {})  # the output repeats its own "21"
    assert p.propose(Chain(3)).tokens.tolist() == [22, 23, 24]
    assert p.propose(Chain(3)).tokens.tolist() == [22, 23, 24]  # proposing changes nothing
    # a match leaves room below it for the draft: depth 6, k 3 -> suffixes of at most 3 tokens
    p.advance(torch.tensor([22, 23, 24, 30, 21, 22]), {})
    assert p.propose(Chain(3)).tokens.tolist() == [23, 24, 30]


def test_memory_bound_respected_under_pruning():
    rng = random.Random(0)
    trie, live, phrase = SuffixTrie(depth=4, max_nodes=60), [], [7, 8, 9]
    for i in range(3000):
        live = trie.insert(live, phrase if i % 10 == 0 else [rng.randrange(20, 40)])
        assert trie.size <= 60
    assert trie.size == _node_count(trie.root)
    node = trie.match([7, 8], 3)  # the frequent phrase survives the pruning of rare n-grams
    assert node is not None and max(node.kids.values(), key=lambda c: c.count).count > 100
    assert 9 in node.kids
    # the live suffixes (the n-grams the next token extends) are never pruned
    reachable, stack = set(), [trie.root]
    while stack:
        node = stack.pop()
        reachable.add(id(node))
        stack.extend(node.kids.values())
    assert len(live) == 3 and all(id(n) in reachable for n in live)
    with pytest.raises(DraftlabError, match="max_nodes"):
        SuffixProposer(max_depth=8, max_nodes=63)


# ---------------------------------------------------------------------- lossless decoding
def _corpus(tmp_path, docs, name="corpus.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(d) + "\n" for d in docs))
    return path


@pytest.mark.parametrize("shape", [Chain(3), DynamicTree(3, 2, 8)], ids=["chain", "tree"])
@pytest.mark.parametrize("with_corpus", [False, True], ids=["local", "corpus"])
def test_greedy_equals_plain_decoding(tiny_llama, prompts, alone, tmp_path, shape, with_corpus):
    corpus = None
    if with_corpus:  # the first half of each reference continuation, so drafts hit and miss
        corpus = _corpus(tmp_path, [{"token_ids": a[: N_NEW // 2]} for a in alone] + [{"text": TEXTS[0]}])
    proposer = SuffixProposer(max_depth=8, min_prob=0.0, corpus=corpus, target=tiny_llama)
    for p, ref in zip(prompts, alone):
        res = SpeculativeDecoder(tiny_llama, proposer).generate(p, N_NEW, shape)
        assert res.tokens == ref
    res = Decoder(tiny_llama, proposer).generate(prompts, N_NEW, shape)
    assert [r.tokens for r in res.rows] == alone
    accepted = sum(sum(r.accept_lengths) for r in res.rows)
    assert accepted >= (N_NEW // 2 if with_corpus else 1), accepted  # drafts were accepted, not only drafted


@pytest.mark.parametrize("shape", [Chain(2), DynamicTree(2, 2, 6)], ids=["chain", "tree"])
def test_sampling_follows_the_target(tiny_llama, tmp_path, shape):
    """Drafts from a corpus of the target's own samples are accepted at times, rejected at times;
    the first three tokens still follow the target's top-k=3 distribution (chi-square)."""
    prompt = tiny_llama.tokenizer(TEXTS[0])["input_ids"]
    temperature, top_k, n = 1.0, 3, 500
    samples = [generate_plain(tiny_llama, prompt, 3, temperature=temperature, top_k=top_k, seed=1000 + s).tokens for s in range(30)]
    corpus = _corpus(tmp_path, [{"token_ids": prompt[-2:] + s} for s in samples])
    dec = SpeculativeDecoder(tiny_llama, SuffixProposer(max_depth=6, min_prob=0.0, corpus=corpus, target=tiny_llama))
    counts, steps = Counter(), Counter()
    for s in range(n):
        r = dec.generate(prompt, 3, shape, temperature=temperature, top_k=top_k, seed=s)
        counts[tuple(r.tokens)] += 1
        steps.update(r.accept_lengths[:1])
    assert len(steps) == 3, steps  # the first step accepted 0, 1 and 2 drafts at times
    assert_follows_target(counts, tiny_llama, prompt, 3, temperature, top_k, n)


# ---------------------------------------------------------------------- the corpus and its cache
def test_corpus_cache_reused_and_rebuilt(tiny_llama, tmp_path):
    path = _corpus(tmp_path, [{"text": "The quick brown fox jumps over the lazy dog."},
                              {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a b c"}]},
                              {"conversations": [{"from": "human", "value": "x"}, {"from": "gpt", "value": "d e f"}]},
                              {"token_ids": [5, 6, 7, 5, 6]}])
    first = SuffixProposer(corpus=path, target=tiny_llama)
    assert not first.corpus_from_cache and first.corpus_cache.is_file()
    again = SuffixProposer(corpus=path, target=tiny_llama)
    assert again.corpus_from_cache and again.corpus_cache == first.corpus_cache
    assert _table(again.corpus) == _table(first.corpus) and again.corpus.size == first.corpus.size > 0
    # every token of the documents (text, assistant turns, token ids) and no other is a unigram
    encode = lambda t: tiny_llama.tokenizer.encode(t, add_special_tokens=False)  # noqa: E731
    docs = [encode("The quick brown fox jumps over the lazy dog."), encode("a b c"), encode("d e f"), [5, 6, 7, 5, 6]]
    assert set(again.corpus.root.kids) == {t for d in docs for t in d}
    assert again.corpus.root.kids[5].count == 2 and again.corpus.root.kids[5].kids[6].kids[7].count == 1
    assert SuffixProposer(max_depth=12, corpus=path, target=tiny_llama).corpus_cache != first.corpus_cache
    # a changed corpus is rebuilt under its own hash
    path.write_text(path.read_text() + json.dumps({"text": "more text"}) + "\n")
    changed = SuffixProposer(corpus=path, target=tiny_llama)
    assert not changed.corpus_from_cache and changed.corpus_cache != first.corpus_cache
    # a damaged cache file is rebuilt, not trusted
    first.corpus_cache.write_bytes(b"not safetensors")
    path.write_text("\n".join(path.read_text().splitlines()[:-1]) + "\n")
    rebuilt = SuffixProposer(corpus=path, target=tiny_llama)
    assert not rebuilt.corpus_from_cache and _table(rebuilt.corpus) == _table(first.corpus)


def test_recipe_corpus_is_its_training_responses(tiny_llama, tmp_path):
    import yaml

    from draftlab.data.dataset import DataSpec, build_samples

    data = {"source": str(write_chat(tmp_path / "chats.jsonl", 12, turns=2)), "heldout": 3}
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"algorithm": "eagle3", "output_dir": str(tmp_path / "run"), "data": data}))
    trie = SuffixProposer(corpus=recipe, target=tiny_llama).corpus
    split = build_samples(DataSpec(**data), tiny_llama.tokenizer)
    loss_tokens = lambda samples: Counter(t for s in samples for t in s["input_ids"][s["loss_mask"]].tolist())  # noqa: E731
    assert {t: n.count for t, n in trie.root.kids.items()} == loss_tokens(split.train)  # the held-out split stays out
    assert sum(loss_tokens(split.heldout).values()) > 0
    assert SuffixProposer(corpus=recipe, target=tiny_llama).corpus_from_cache


def test_bad_corpus_and_options_are_one_line_errors(tiny_llama, tmp_path):
    binary = tmp_path / "weights.bin"
    binary.write_bytes(b"PK\x03\x04\x00\x01binary")
    latin = tmp_path / "latin.txt"
    latin.write_bytes("café".encode("latin-1"))
    bad_ids = _corpus(tmp_path, [{"token_ids": [1, 10**6]}], "ids.jsonl")
    cases = [(tmp_path / "missing.txt", "cannot read"), (tmp_path, "cannot read"), (binary, "not a text file"),
             (latin, "not UTF-8 text"), (_corpus(tmp_path, [[1, 2]], "list.jsonl"), "expected an object"),
             (_corpus(tmp_path, [{"text": ""}], "empty.jsonl"), "holds no text"), (bad_ids, "outside the target's vocabulary")]
    for corpus, message in cases:
        with pytest.raises(DraftlabError) as e:
            SuffixProposer(corpus=corpus, target=tiny_llama)
        assert_one_line(e, message)
    (tmp_path / "broken.jsonl").write_text('{"text": "a"\n')
    for kw, message in [(dict(max_depth=0), "max_depth"), (dict(max_depth=1), "max_depth"), (dict(max_nodes=-1), "max_nodes"),
                        (dict(min_prob=1.5), "min_prob"), (dict(max_depth=True), "max_depth"),
                        (dict(corpus=tmp_path / "broken.jsonl", target=tiny_llama), "broken.jsonl:1: not valid JSON"),
                        (dict(corpus=latin), "needs the target")]:
        with pytest.raises(DraftlabError) as e:
            SuffixProposer(**kw)
        assert_one_line(e, message)


# ---------------------------------------------------------------------- the command line
def test_cli(tiny_target_dirs, tmp_path, capsys):
    from draftlab.cli import main

    assert FREE_DRAFTERS.get("suffix") is SuffixProposer
    data = tmp_path / "eval.jsonl"
    data.write_text("".join(json.dumps({"category": c, "turns": [t]}) + "\n" for c, t in (("code", TEXTS[1]), ("chat", TEXTS[2]))))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXTS[1] * 3)
    out = tmp_path / "rep" / "eval.json"
    argv = ["eval", "--drafter", "suffix", "--target", str(tiny_target_dirs["llama"]), "--data", str(data), "--num-prompts", "2",
            "--max-new-tokens", "8", "--method", "tree", "--tree-depth", "3", "--batch-sizes", "1,2",
            "--drafter-option", f"corpus={corpus}", "--drafter-option", "max_depth=10", "--report", str(out)]
    assert main(argv) == 0
    rep = json.loads(out.read_text())
    assert rep["greedy_match"] == "2/2" and rep["label"] == "suffix"
    assert main(["generate", "--drafter", "suffix", "--target", str(tiny_target_dirs["llama"]), "--max-new-tokens", "6",
                 "--prompt", "a b c a b c a b"]) == 0
    capsys.readouterr()
    # bad values: exit 2, one line, before any model loads (the target path does not exist)
    binary = tmp_path / "x.bin"
    binary.write_bytes(b"\x00\x01\x02")
    base = ["eval", "--drafter", "suffix", "--target", str(tmp_path / "no-target"), "--data", str(data)]
    for extra, message in [(["--drafter-option", f"corpus={binary}"], "not a text file"),
                           (["--drafter-option", f"corpus={tmp_path / 'nope.txt'}"], "cannot read"),
                           (["--drafter-option", "max_depth=0"], "max_depth must be"),
                           (["--drafter-option", "max_nodes=ten"], "max_nodes: expected int"),
                           (["--drafter-option", "depth=3"], "not an option of drafter 'suffix'"),
                           (["--drafter-option", "max_depth"], "expected KEY=VALUE"),
                           (["--method", "static_tree", "--tree-choices", "[[0]]"], "does not draft static_tree"),
                           (["--min-confidence", "0.2"], "not to 'suffix'")]:
        assert main(base + extra) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
    assert main(["eval", "--drafter", "ngram", "--drafter-option", "max_depth=3", "--data", str(data)]) == 2
    assert "--drafter-option applies" in capsys.readouterr().err
    assert main(["eval", "--drafter", "suffx", "--data", str(data)]) == 2
    err = capsys.readouterr().err  # the training-free drafters offered, whatever others are registered
    assert "(or pass one of: ngram, " in err and "suffix" in err, err
