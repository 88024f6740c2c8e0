"""Draft shapes end to end: each proposer declares the shapes it drafts and the decoder refuses
others; a block decodes like a chain; the recipe's eval section and ``draftlab eval`` ask for a
dynamic or a static tree (one-line errors for missing or malformed choices); an EAGLE
checkpoint evaluates with a static tree through the registry."""

from __future__ import annotations

import json

import pytest
import torch

from draftlab.errors import DraftlabError
from draftlab.inference.decoder import SpeculativeDecoder, generate_plain
from draftlab.inference.ngram import NgramProposer
from draftlab.inference.proposer import PROPOSERS, Proposer
from draftlab.inference.decoding_spec import DecodingSpec, check_spec
from draftlab.inference.shapes import Block, Chain, ChainDraft, DynamicTree, StaticTree, shape_fields

CHOICES = [[0], [1], [0, 0], [0, 1], [0, 0, 0]]


def _prompt(target):
    return target.tokenizer("The quick brown fox jumps over the lazy dog.")["input_ids"]


class BlockOracle(Proposer):
    """Drafts a block of the target's own greedy continuation with its last token wrong."""

    name = "block-oracle"
    shapes = frozenset({"block"})

    def __init__(self, ref):
        self.ref = ref

    def start(self, prompt_ids, hidden, next_token):
        self.pos = 1

    def advance(self, accepted, hidden):
        self.pos += accepted.numel()

    def propose(self, shape):
        block = self.ref[self.pos : self.pos + shape.k]
        return ChainDraft(torch.tensor(block[:-1] + [(block[-1] + 1) % 50] if block else [], dtype=torch.long))


def test_block_verifies_like_a_chain(tiny_llama):
    prompt = _prompt(tiny_llama)
    ref = generate_plain(tiny_llama, prompt, 20).tokens
    res = SpeculativeDecoder(tiny_llama, BlockOracle(ref)).generate(prompt, 20, Block(4))
    assert res.tokens == ref
    assert set(res.accept_lengths[:-1]) == {3} and max(res.num_drafted) == 4


@pytest.mark.parametrize(
    "proposer, shape",
    [(NgramProposer(), StaticTree(CHOICES)), (NgramProposer(), Block(3)), (BlockOracle([]), Chain(3))],
    ids=["ngram-static-tree", "ngram-block", "block-only-chain"],
)
def test_undeclared_shape_is_refused(tiny_llama, proposer, shape):
    with pytest.raises(DraftlabError, match=f"drafter '{proposer.name}' does not draft {shape.kind} shapes") as e:
        SpeculativeDecoder(tiny_llama, proposer).generate(_prompt(tiny_llama), 4, shape)
    assert "\n" not in str(e.value)


def test_shapes_by_method_name_and_in_reports():
    assert DecodingSpec(method="chain", k=3, min_confidence=0.2).shape() == Chain(3, 0.2)
    assert DecodingSpec(method="block", k=2).shape() == Block(2)
    assert DecodingSpec(method="tree", tree={"depth": 3, "top_k": 2, "total_tokens": 9}).shape() == DynamicTree(3, 2, 9)
    static = DecodingSpec(method="static_tree", static_tree=CHOICES).shape()
    assert static.choices == tuple(map(tuple, CHOICES)) and static.max_nodes == 5 and static.max_depth == 3
    assert shape_fields(Chain(3)) == {"method": "chain", "k": 3, "tree": None}
    assert shape_fields(DynamicTree(3, 2, 9)) == {"method": "tree", "k": None, "tree": {"depth": 3, "top_k": 2, "total_tokens": 9}}
    assert shape_fields(static) == {"method": "static_tree", "k": None, "tree": None, "static_tree": CHOICES}
    with pytest.raises(ValueError, match="method"):  # pydantic's: a method no shape has
        DecodingSpec(method="beam")
    for bad in (dict(method="static_tree"), dict(method="tree", min_confidence=0.5)):
        with pytest.raises(DraftlabError):
            check_spec(DecodingSpec(**bad))
    assert PROPOSERS.get("ngram") is NgramProposer


# ---------------------------------------------------------------------- recipe eval section
def _recipe(tmp_path, eval_section: dict):
    from draftlab.recipe import load_recipe

    f = tmp_path / "r.yaml"
    f.write_text(json.dumps({"algorithm": "eagle3", "output_dir": str(tmp_path / "run"), "eval": eval_section}))
    return load_recipe(f)


def test_recipe_eval_shapes(tmp_path):
    assert _recipe(tmp_path, {"method": "chain", "k": 2, "min_confidence": 0.1}).eval.shape() == Chain(2, 0.1)
    assert _recipe(tmp_path, {"method": "tree", "tree": {"depth": 3}}).eval.shape() == DynamicTree(depth=3)
    static = _recipe(tmp_path, {"method": "static_tree", "static_tree": CHOICES}).eval.shape()
    assert isinstance(static, StaticTree) and static.max_nodes == 5


@pytest.mark.parametrize(
    "section, message",
    [
        # the rules of draftlab eval's flags (one check_spec), named as the recipe's fields
        ({"method": "static_tree"}, "eval.method static_tree needs eval.static_tree (paths of candidate ranks"),
        ({"method": "static_tree", "static_tree": [[0, 1]]}, "eval.static_tree: static tree: choice [0, 1] has no parent [0]"),
        ({"method": "tree", "min_confidence": 0.3}, "eval.min_confidence sets a chain's or block's draft length: use eval.method chain or block"),
        ({"method": "chain", "static_tree": [[0]]}, "eval.static_tree applies to eval.method static_tree"),
    ],
)
def test_recipe_eval_errors_are_one_line(tmp_path, section, message):
    with pytest.raises(DraftlabError, match=message.replace("[", r"\[").replace("(", r"\(")) as e:
        _recipe(tmp_path, section)
    assert "\n" not in str(e.value)


# ---------------------------------------------------------------------- draftlab eval
def _eval_argv(tiny_target_dirs, tmp_path, drafter="ngram"):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"category": "chat", "turns": ["The quick brown fox jumps over the lazy dog."]}) + "\n")
    return ["eval", "--drafter", str(drafter), "--target", str(tiny_target_dirs["llama"]), "--data", str(prompts),
            "--max-new-tokens", "8", "--report", str(tmp_path / "rep" / "eval.json")]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--tree-choices", "[[0], [1"], "--tree-choices: invalid JSON"),
        (["--tree-choices", "[[0, 1]]"], "--tree-choices: static tree: choice [0, 1] has no parent [0]"),
        (["--tree-choices", '{"a": 1}'], "--tree-choices: neither a JSON list nor a readable file"),
        (["--tree-choices", "missing.json"], "--tree-choices: neither a JSON list nor a readable file"),
        ([], "--method static_tree needs --tree-choices"),
    ],
)
def test_tree_choices_errors_are_one_line(tiny_target_dirs, tmp_path, capsys, flags, message):
    from draftlab.cli import main

    assert main(_eval_argv(tiny_target_dirs, tmp_path) + ["--method", "static_tree"] + flags) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_tree_choices_only_with_static_tree(tiny_target_dirs, tmp_path, capsys):
    from draftlab.cli import main

    assert main(_eval_argv(tiny_target_dirs, tmp_path) + ["--tree-choices", "[[0]]"]) == 2
    assert "--tree-choices applies to --method static_tree" in capsys.readouterr().err


def _eagle_checkpoint(target, path):
    """An untrained EAGLE-3 drafter for ``target``, written as a draftlab checkpoint."""
    from draftlab.checkpoint import checkpoint_meta, save_weights
    from draftlab.models.eagle import Eagle3Config, Eagle3Drafter

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    samples = [{"input_ids": torch.randint(0, target.vocab_size, (32,), generator=g), "loss_mask": torch.ones(32, dtype=torch.bool)}
               for _ in range(4)]
    drafter = Eagle3Drafter.build(Eagle3Config(draft_vocab_size=96), target, samples)
    path.mkdir()
    save_weights(path, drafter.state_dict(), checkpoint_meta(drafter, target.identity, None, 0))
    return path


def test_eval_static_tree_with_an_eagle_checkpoint(tiny_llama, tiny_target_dirs, tmp_path):
    from draftlab.cli import main
    from draftlab.inference.eagle import EagleProposer
    from draftlab.inference.proposer import load_proposer

    ckpt = _eagle_checkpoint(tiny_llama, tmp_path / "ckpt")
    assert isinstance(load_proposer(ckpt, tiny_llama), EagleProposer)
    choices = tmp_path / "choices.json"
    choices.write_text(json.dumps(CHOICES))
    argv = _eval_argv(tiny_target_dirs, tmp_path, ckpt) + ["--method", "static_tree", "--tree-choices", str(choices)]
    assert main(argv) == 0
    rep = json.loads((tmp_path / "rep" / "eval.json").read_text())
    assert rep["method"] == "static_tree" and rep["static_tree"] == CHOICES and rep["k"] is None and rep["tree"] is None
    assert rep["greedy_match"] == "1/1"
    assert "static tree of 5 nodes" in (tmp_path / "rep" / "eval.md").read_text()
