"""bench.medusa_tree without models: the greedy sparse-tree construction and its one-line errors."""

import itertools
import json
import random

import pytest

from bench import medusa_tree
from draftlab.checkpoint import FORMAT, META
from draftlab.inference.shapes import StaticTree


def test_greedy_tree_adds_the_most_probable_node_whose_parent_is_in():
    acc = [[0.6, 0.2, 0.1], [0.5, 0.3, 0.1]]
    trees = medusa_tree.grow_trees(acc, [1, 2, 4, 6])
    # (0) .6, (0,0) .3, (1) .2, (0,1) .18, then (2) and (1,0) tie at .1: the shallower first
    assert trees == {1: [(0,)], 2: [(0,), (0, 0)], 4: [(0,), (0, 0), (1,), (0, 1)],
                     6: [(0,), (0, 0), (1,), (0, 1), (2,), (1, 0)]}
    assert medusa_tree.expected_tau(acc, trees[4]) == pytest.approx(1 + 0.6 + 0.3 + 0.2 + 0.18)
    assert medusa_tree.short_choices(trees[6]) == "0 1 2 00 01 10"
    assert json.loads(medusa_tree.as_json(trees[2])) == [[0], [0, 0]]


def test_greedy_tree_is_the_best_tree_of_its_size_and_a_valid_static_tree():
    rng = random.Random(0)
    heads, ranks = 3, 4
    acc = [sorted((rng.random() * 0.5 for _ in range(ranks)), reverse=rng.random() < 0.7) for _ in range(heads)]
    nodes = [p for d in range(1, heads + 1) for p in itertools.product(range(ranks), repeat=d)]
    by_prob = sorted((medusa_tree.path_probability(acc, p) for p in nodes), reverse=True)
    trees = medusa_tree.grow_trees(acc, [1, 5, 12, 30, 10_000])
    assert 10_000 not in trees  # more than the 4 + 16 + 64 possible nodes
    for n, tree in trees.items():
        assert len(set(tree)) == n and all(len(p) == 1 or p[:-1] in tree for p in tree) and max(map(len, tree)) <= heads
        StaticTree(tree)  # the decoder accepts it
        # a child never beats its parent, so the top-n nodes are closed under parents: greedy is optimal
        assert medusa_tree.expected_tau(acc, tree) == pytest.approx(1 + sum(by_prob[:n]))
    flat = medusa_tree.grow_trees(acc, [ranks, ranks + 1], max_depth=1)  # depth 1 only: at most `ranks` nodes
    assert list(flat) == [ranks] and sorted(flat[ranks]) == [(r,) for r in range(ranks)]


def test_best_tree_ties_go_to_the_smaller():
    rows = [{"kind": "chain", "nodes": 3, "report": {"speedup": 2.0}},
            {"kind": "tree", "nodes": 8, "report": {"speedup": 1.504}},
            {"kind": "tree", "nodes": 4, "report": {"speedup": 1.497}},
            {"kind": "tree", "nodes": 2, "report": {"speedup": 1.2}}]
    assert medusa_tree.best_tree(rows)["nodes"] == 4


def _ckpt(tmp_path, algorithm):
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / META).write_text(json.dumps({"format": FORMAT, "algorithm": algorithm, "drafter": {}, "target": {}}))
    return d


@pytest.mark.parametrize("what, message", [("missing", "no such run or checkpoint directory"),
                                           ("not-a-checkpoint", "no checkpoint"),
                                           ("eagle3", "not a Medusa one"), ("no-recipe", "carries no recipe")])
def test_one_line_errors(tmp_path, capsys, what, message):
    if what == "missing":
        path = tmp_path / "nope"
    elif what == "not-a-checkpoint":
        path = tmp_path
    else:
        path = _ckpt(tmp_path, "eagle3" if what == "eagle3" else "medusa")
    assert medusa_tree.main([str(path), "--quick"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("bench.medusa_tree: error:") and message in err and "\n" not in err
