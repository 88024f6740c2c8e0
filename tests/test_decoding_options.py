"""Decoding options are bounded before any work (issue 38): ``draftlab eval`` and ``draftlab
generate`` refuse an out-of-range numeric flag, a malformed static tree or a prompt that is not
UTF-8 text with one line naming the flag and its limits (exit 2, no traceback), before any model
loads where the limit does not depend on the models; the draft shapes refuse bools and
out-of-range fields at construction; and a dynamic tree's growth is bounded by its total."""

from __future__ import annotations

import io
import json
import shutil

import pytest
import torch

# ---------------------------------------------------------------------- helpers


def _prompts(tmp_path, text="The quick brown fox jumps over the lazy dog."):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"category": "chat", "turns": [text]}) + "\n")
    return path


def _eval(tiny_target_dirs, tmp_path, *flags, drafter="ngram"):
    from draftlab.cli import main

    return main(["eval", "--drafter", str(drafter), "--target", str(tiny_target_dirs["llama"]), "--data",
                 str(_prompts(tmp_path)), "--num-prompts", "1", "--max-new-tokens", "4", *flags])


def _generate(tiny_target_dirs, *flags):
    from draftlab.cli import main

    return main(["generate", "--drafter", "ngram", "--target", str(tiny_target_dirs["llama"]), "--max-new-tokens", "4", *flags])


def _refused(rc, capsys, *needles, loaded=False):
    """Exit 2 and one error line holding ``needles``; nothing else on stderr unless a model
    ``loaded`` (transformers' progress lines)."""
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    errors = [line for line in lines if line.startswith("draftlab ")]
    assert rc == 2 and len(errors) == 1 and errors[0] == lines[-1] and "Traceback" not in err, err
    assert loaded or len(lines) == 1, err
    for needle in needles:
        assert needle in errors[0], err
    return errors[0]


@pytest.fixture()
def no_model_loads(monkeypatch):
    """Loading a target fails the test: the error must come first."""
    from draftlab.models.target import Target

    def load(*args, **kwargs):
        raise AssertionError("a model loaded before the options were checked")

    monkeypatch.setattr(Target, "load", load)


@pytest.fixture()
def model_loads(monkeypatch):
    """The targets loaded during the test (the loads go ahead)."""
    from draftlab.models.target import Target

    loads, load = [], Target.load

    def recorded(*args, **kwargs):
        loads.append(args)
        return load(*args, **kwargs)

    monkeypatch.setattr(Target, "load", recorded)
    return loads


def _eagle_checkpoint(target, path, draft_vocab_size=96):
    """An untrained EAGLE-3 drafter for ``target`` (draft vocabulary of 96), as a checkpoint."""
    from draftlab.checkpoint import checkpoint_meta, save_weights
    from draftlab.models.eagle import Eagle3Config, Eagle3Drafter

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    samples = [{"input_ids": torch.randint(0, target.vocab_size, (32,), generator=g), "loss_mask": torch.ones(32, dtype=torch.bool)}
               for _ in range(4)]
    drafter = Eagle3Drafter.build(Eagle3Config(draft_vocab_size=draft_vocab_size), target, samples)
    path.mkdir()
    save_weights(path, drafter.state_dict(), checkpoint_meta(drafter, target.identity, None, 0))
    return path


@pytest.fixture(scope="module")
def eagle_ckpt(tiny_llama, tmp_path_factory):
    return _eagle_checkpoint(tiny_llama, tmp_path_factory.mktemp("eagle") / "ckpt")


# ---------------------------------------------------------------------- numeric flags, before any model loads
@pytest.mark.parametrize(
    "flags, needles",
    [
        (["--k", str(10**9)], ["--k", "1..64", "1000000000"]),
        (["--method", "block", "--k", "0"], ["--k", "1..64"]),
        (["--max-new-tokens", str(10**9)], ["--max-new-tokens", "1..131072"]),
        (["--batch-sizes", "100000"], ["--batch-sizes", "1..1024", "100000"]),
        (["--temperature", "nan"], ["--temperature", "finite", "nan"]),
        (["--temperature", "inf"], ["--temperature", "finite", "inf"]),
        (["--temperature", "-1"], ["--temperature", "0 (greedy) or in [0.0001, 100]"]),
        (["--temperature", "1e-30"], ["--temperature", "0 (greedy) or in [0.0001, 100]"]),
        (["--top-k", "-1"], ["--top-k", ">= 0"]),
        (["--top-p", "nan"], ["--top-p", "finite"]),
        (["--seed", str(2**64)], ["--seed", "9223372036854775807"]),
        (["--method", "tree", "--tree-topk", str(10**6)], ["--tree-topk", "1..1024"]),
        (["--method", "tree", "--tree-total", "5000"], ["--tree-total", "1..1024"]),
        (["--method", "tree", "--tree-depth", str(10**9), "--tree-total", "4"], ["--tree-depth", "1..1024"]),
        (["--method", "static_tree", "--tree-choices", "[[true]]"], ["--tree-choices", "rank true", "0..1023"]),
        (["--method", "static_tree", "--tree-choices", "[[1.5]]"], ["--tree-choices", "rank 1.5", "0..1023"]),
        (["--method", "static_tree", "--tree-choices", "[[0], [100000]]"], ["--tree-choices", "0..1023"]),
        (["--method", "static_tree", "--tree-choices", json.dumps([[0]] * 2000)], ["--tree-choices", "at most 1024 paths"]),
    ],
    ids=["k", "block-k-0", "max-new-tokens", "batch-sizes", "temperature-nan", "temperature-inf", "temperature-negative",
         "temperature-tiny", "top-k", "top-p-nan", "seed", "tree-topk", "tree-total", "tree-depth", "choices-true",
         "choices-float", "choices-rank", "choices-many"],
)
def test_eval_refuses_out_of_range_flags_before_loading(tiny_target_dirs, tmp_path, capsys, no_model_loads, flags, needles):
    _refused(_eval(tiny_target_dirs, tmp_path, *flags), capsys, *needles)


@pytest.mark.parametrize(
    "flags, needles",
    [(["--k", str(10**9)], ["--k", "1..64"]), (["--temperature", "nan"], ["--temperature"]),
     (["--max-new-tokens", str(10**9)], ["--max-new-tokens", "131072"])],
    ids=["k", "temperature", "max-new-tokens"],
)
def test_generate_refuses_out_of_range_flags_before_loading(tiny_target_dirs, capsys, no_model_loads, flags, needles):
    _refused(_generate(tiny_target_dirs, "--prompt", "hello", *flags), capsys, *needles)


@pytest.mark.parametrize("k", ["0", str(10**12)])
def test_export_bounds_the_chain_length_it_writes(k, eagle_ckpt, tiny_target_dirs, tmp_path, capsys, no_model_loads):
    """``draftlab export --num-speculative-tokens`` (written into serving configs), and the recipe's eval.k
    it defaults to, are drafts per step as draftlab decodes them: 1..64."""
    from draftlab.cli import main

    out = tmp_path / "out"
    export = ["export", str(eagle_ckpt), "--to", "vllm", str(out), "--target", str(tiny_target_dirs["llama"])]
    _refused(main(export + ["--num-speculative-tokens", k]), capsys, "--num-speculative-tokens must be in 1..64", k)
    ckpt = tmp_path / "ckpt"
    shutil.copytree(eagle_ckpt, ckpt)
    meta = json.loads((ckpt / "draftlab.json").read_text())
    meta["recipe"] = {"eval": {"k": 10**12}}
    (ckpt / "draftlab.json").write_text(json.dumps(meta))
    export[1] = str(ckpt)
    _refused(main(export), capsys, f"{ckpt}: recipe.eval.k must be in 1..64, got {10**12}")
    assert not out.exists()


# ---------------------------------------------------------------------- limits that need the models
def test_tree_topk_beyond_the_vocabulary(tiny_target_dirs, tiny_llama, eagle_ckpt, tmp_path, capsys):
    # the n-gram drafter's candidates are target tokens: 400 of them in the tiny target
    line = _refused(_eval(tiny_target_dirs, tmp_path, "--method", "tree", "--tree-topk", "1000"), capsys, "--tree-topk", "400",
                    loaded=True)
    assert "1000" in line
    # an EAGLE-3 drafter ranks its candidates over its draft vocabulary of 96 tokens
    _refused(_eval(tiny_target_dirs, tmp_path, "--method", "tree", "--tree-topk", "100", drafter=eagle_ckpt), capsys,
             "--tree-topk", "96", "100", loaded=True)
    _refused(_eval(tiny_target_dirs, tmp_path, "--method", "static_tree", "--tree-choices", "[[0], [96]]", drafter=eagle_ckpt),
             capsys, "--tree-choices", "96", loaded=True)


def test_max_new_tokens_beyond_the_targets_positions(tiny_target_dirs, tmp_path, capsys):
    # the tiny target holds 512 positions
    line = _refused(_eval(tiny_target_dirs, tmp_path, "--max-new-tokens", "2000", "--no-baseline"), capsys, "--max-new-tokens", "512",
                    loaded=True)
    assert "2000" in line


# ---------------------------------------------------------------------- a dynamic tree's growth is bounded by its total
def test_huge_tree_depth_with_a_small_total_stops_at_the_total(tiny_target_dirs, eagle_ckpt, tmp_path, capsys, monkeypatch):
    from draftlab.inference.eagle import EagleProposer

    levels = []
    draft_level = EagleProposer._draft_level

    def counted(self, frontier, tok, parent, slot, feats, depth, committed):
        levels.append(depth)
        assert depth < 4, "a tree of 4 nodes grew a 5th level"
        return draft_level(self, frontier, tok, parent, slot, feats, depth, committed)

    monkeypatch.setattr(EagleProposer, "_draft_level", counted)
    rc = _eval(tiny_target_dirs, tmp_path, "--method", "tree", "--tree-depth", "1000", "--tree-total", "4", drafter=eagle_ckpt)
    assert rc == 0, capsys.readouterr().err
    assert levels and max(levels) <= 3


def _started_eagle(target):
    from draftlab.inference.eagle import EagleProposer
    from draftlab.models.eagle import Eagle3Config, Eagle3Drafter

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    samples = [{"input_ids": torch.randint(0, target.vocab_size, (32,), generator=g), "loss_mask": torch.ones(32, dtype=torch.bool)}
               for _ in range(4)]
    p = EagleProposer(Eagle3Drafter.build(Eagle3Config(draft_vocab_size=96), target, samples))
    prompt = torch.randint(0, target.vocab_size, (7,), generator=torch.Generator().manual_seed(5))
    out = target(prompt[None], layers=p.layers, logits="last")
    p.start(prompt[None], out.hidden, int(out.logits[0, -1].argmax()))
    return p


def _same_tree(a, b):
    return all(torch.equal(x, y) for x, y in ((a.tokens, b.tokens), (a.parents, b.parents), (a.depth, b.depth)))


def test_eagle_dynamic_tree_work_is_bounded_by_the_total(tiny_llama, monkeypatch):
    from draftlab.inference.eagle import EagleProposer
    from draftlab.inference.shapes import DynamicTree

    p = _started_eagle(tiny_llama)
    committed = p.cache.length
    levels = []
    draft_level = EagleProposer._draft_level

    def counted(self, frontier, *args):
        levels.append(len(frontier))
        assert len(levels) < 50, "the tree keeps growing past its total"
        return draft_level(self, frontier, *args)

    monkeypatch.setattr(EagleProposer, "_draft_level", counted)
    deep = p.propose(DynamicTree(depth=1000, top_k=3, total_tokens=4))
    assert len(levels) <= 3 and p.cache.length == committed
    assert _same_tree(deep, p.propose(DynamicTree(depth=4, top_k=3, total_tokens=4)))
    # top-k beyond the draft vocabulary (96) is no torch error, and beyond the total adds nothing
    levels.clear()
    wide = p.propose(DynamicTree(depth=3, top_k=1000, total_tokens=10))
    assert max(levels) <= 10 and wide.tokens.numel() == 10
    assert _same_tree(wide, p.propose(DynamicTree(depth=3, top_k=10, total_tokens=10)))


# ---------------------------------------------------------------------- the shapes and the one check
def test_shapes_refuse_bools_and_out_of_range_fields():
    from draftlab.errors import DraftlabError
    from draftlab.inference.shapes import Block, Chain, DynamicTree, StaticTree

    for make, needle in [
        (lambda: Chain(True), "chain: k must be an integer in 1..64, got True"),
        (lambda: Chain(65), "1..64"),
        (lambda: Block(10**9), "block: k must be an integer in 1..64"),
        (lambda: Chain(3, min_confidence=float("nan")), "min_confidence"),
        (lambda: DynamicTree(depth=True), "tree: depth must be an integer in 1..1024, got True"),
        (lambda: DynamicTree(top_k=2.0), "tree: top_k must be an integer in 1..1024"),
        (lambda: DynamicTree(total_tokens=1025), "tree: total_tokens must be an integer in 1..1024"),
        (lambda: StaticTree([[True]]), "rank true"),
        (lambda: StaticTree([[0], [0, 1.5]]), "rank 1.5"),
        (lambda: StaticTree([[0], [1024]]), "0..1023"),
        (lambda: StaticTree([[i] for i in range(1025)]), "at most 1024 paths"),
        (lambda: StaticTree("[[0]]"), "list of at most 1024 paths"),
    ]:
        with pytest.raises(DraftlabError, match=needle.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")) as e:
            make()
        assert "\n" not in str(e.value)


def test_check_decoding_bounds_every_option():
    from draftlab.inference.shapes import DynamicTree, OptionError, StaticTree, check_decoding

    check_decoding(DynamicTree(), 128, 0.7, 50, 0.9, [1, 2, 4], 0, draft_vocab=96, max_positions=512, prompt_length=100)
    for kwargs, option in [
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(max_new_tokens=True), "max_new_tokens"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=1e9), "temperature"),
        (dict(top_k=-1), "top_k"),
        (dict(top_k=1.5), "top_k"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=float("inf")), "top_p"),
        (dict(batch_sizes=[1, 1]), "batch_sizes"),
        (dict(batch_sizes=[2048]), "batch_sizes"),
        (dict(batch_sizes=[True]), "batch_sizes"),
        (dict(seed=2**63), "seed"),
        (dict(shape=DynamicTree(top_k=97), draft_vocab=96), "tree.top_k"),
        (dict(shape=StaticTree([[0], [96]]), draft_vocab=96), "static_tree"),
        (dict(max_new_tokens=413, max_positions=512, prompt_length=100), "max_new_tokens"),
    ]:
        with pytest.raises(OptionError) as e:
            check_decoding(**kwargs)
        assert e.value.option == option and "\n" not in str(e.value)
    named = OptionError("k", "must be an integer in 1..64, got 0").renamed({"k": "--k"})
    assert str(named) == "--k must be an integer in 1..64, got 0"


# ---------------------------------------------------------------------- text that is not UTF-8
def test_generate_refuses_a_prompt_that_is_not_utf8(tiny_target_dirs, capsys, no_model_loads):
    not_utf8 = b"caf\xe9 au lait".decode("utf-8", "surrogateescape")  # how argv hands over such bytes
    _refused(_generate(tiny_target_dirs, "--prompt", not_utf8), capsys, "--prompt", "not valid UTF-8", "0xe9")
    _refused(_generate(tiny_target_dirs, "--prompt", "hi", "--system", not_utf8), capsys, "--system", "0xe9")


def test_generate_refuses_stdin_that_is_not_utf8(tiny_target_dirs, capsys, monkeypatch, model_loads):
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"first prompt\n\xff\xfe second\n"), encoding="utf-8"))
    _refused(_generate(tiny_target_dirs), capsys, "stdin line 2", "not valid UTF-8", "0xff")
    # a text stream read with surrogateescape (UTF-8 mode) hands the bytes over as lone surrogates
    monkeypatch.setattr("sys.stdin", io.StringIO("ok\n" + b"bad \xff\n".decode("utf-8", "surrogateescape")))
    _refused(_generate(tiny_target_dirs), capsys, "stdin line 2", "0xff")
    assert not model_loads  # piped stdin is checked whole before any model loads
    # valid UTF-8 bytes decode, Windows line ends included
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO("café\r\n\nthé\n".encode()), encoding="utf-8"))
    assert _generate(tiny_target_dirs) == 0
    assert capsys.readouterr().err.count("tokens (") == 2


def test_eval_refuses_a_prompt_file_that_is_not_text(tiny_target_dirs, tmp_path, capsys, no_model_loads):
    from draftlab.cli import main

    def run(path):
        return main(["eval", "--drafter", "ngram", "--target", str(tiny_target_dirs["llama"]), "--data", str(path)])

    lone = tmp_path / "lone.jsonl"  # valid UTF-8 JSON whose string holds a lone surrogate
    lone.write_text('{"turns": ["hello \\udcff"], "question_id": 7}\n')
    _refused(run(lone), capsys, str(lone), "prompt 7", "0xff")
    raw = tmp_path / "raw.jsonl"  # bytes that are not UTF-8, on its second line
    raw.write_bytes(b'{"turns": ["hello"]}\n{"turns": ["hello \xff"]}\n')
    _refused(run(raw), capsys, f"{raw}:2", "0xff")


@pytest.mark.parametrize("override,needles", [
    ("eval.k=1000000000", ["eval", "k must be an integer in 1..64"]),
    ("eval.temperature=.inf", ["eval", "temperature", "finite"]),
    ("eval.tree.depth=100000", ["eval", "depth must be an integer in 1..1024"]),
    ("eval.max_new_tokens=10000000", ["eval", "max_new_tokens must be an integer in 1..131072"]),
])
def test_a_recipes_eval_section_is_bounded_as_the_flags_are(tmp_path, override, needles):
    """The recipe's eval section goes through the decoder's one check (before training starts)."""
    from draftlab.errors import DraftlabError
    from draftlab.recipe import load_recipe

    with pytest.raises(DraftlabError) as e:
        load_recipe("recipes/smollm2-135m-eagle3.yaml", [override])
    assert all(n in str(e.value) for n in needles) and "\n" not in str(e.value), str(e.value)
    with pytest.raises(DraftlabError, match="static_tree"):  # a bool is not a rank
        load_recipe("recipes/smollm2-135m-eagle3.yaml", ["eval.method=static_tree", "eval.static_tree=[[true]]"])


@pytest.mark.parametrize("kw,needle", [(dict(temperature=float("nan")), "temperature"), (dict(top_k=-1), "top_k"),
                                       (dict(max_new_tokens=10**9), "max_new_tokens")])
def test_the_decoder_applies_the_same_check(tiny_llama, kw, needle):
    from draftlab.errors import DraftlabError
    from draftlab.inference.decoder import Decoder, generate_plain
    from draftlab.inference.ngram import NgramProposer
    from draftlab.inference.shapes import Chain

    args = dict(max_new_tokens=4, **kw) if "max_new_tokens" not in kw else kw
    with pytest.raises(DraftlabError, match=needle):
        generate_plain(tiny_llama, [1, 2, 3], **args)
    with pytest.raises(DraftlabError, match=needle):
        Decoder(tiny_llama, NgramProposer()).generate([[1, 2, 3]], shape=Chain(2), **args)


# ---------------------------------------------------------------------- one spec, one check
@pytest.mark.parametrize("values, flag, field", [
    (dict(method="tree", min_confidence=0.5), "--min-confidence sets a chain's or block's draft length: use --method chain or block",
     "eval.min_confidence sets a chain's or block's draft length: use eval.method chain or block"),
    (dict(static_tree=[[0]]), "--tree-choices applies to --method static_tree", "eval.static_tree applies to eval.method static_tree"),
    (dict(method="static_tree", static_tree=[[1, 0]]), "--tree-choices: static tree: choice [1, 0] has no parent [1]",
     "eval.static_tree: static tree: choice [1, 0] has no parent [1]"),
    (dict(adaptive=True), "--adaptive chooses a chain's or block's draft length per step: it needs --batch-sizes",
     "eval.adaptive chooses a chain's or block's draft length per step: it needs eval.batch_sizes"),
    (dict(batch_sizes=[1, 2], baseline=False), "--batch-sizes measures speedup over plain batched decoding: drop --no-baseline",
     "eval.batch_sizes measures speedup over plain batched decoding: drop eval.baseline false"),
    (dict(batch_sizes=[2, 2]), "--batch-sizes must be distinct integers in 1..1024", "eval.batch_sizes must be distinct integers in 1..1024"),
    (dict(method="tree", k=0), "--k must be an integer in 1..64, got 0", "eval.k must be an integer in 1..64, got 0"),
    (dict(top_p=0.0), "--top-p must be in (0, 1]", "eval.top_p must be in (0, 1]"),
])
def test_flags_and_recipes_share_one_spec_and_one_check(values, flag, field):
    """draftlab eval's flags and a recipe's eval section build one spec type, refused by one
    check, each naming the option as its user wrote it."""
    import re

    from draftlab.cli_decode import FLAGS
    from draftlab.errors import DraftlabError
    from draftlab.inference.decoding_spec import OPTIONS, DecodingSpec, check_spec, field_names
    from draftlab.recipe import EvalSpec

    assert issubclass(EvalSpec, DecodingSpec) and set(OPTIONS) <= set(FLAGS)
    spec = DecodingSpec(**values)
    for names, message in ((FLAGS, flag), (field_names("eval."), field)):
        with pytest.raises(DraftlabError, match=re.escape(message)) as e:
            check_spec(spec, names)
        assert "\n" not in str(e.value)
    with pytest.raises(Exception, match=re.escape(field)):  # a recipe's section, as it is read
        EvalSpec(**values)
    check_spec(DecodingSpec())


def test_cuda_graphs_need_a_cuda_device_whoever_asks():
    from draftlab.cli_decode import FLAGS
    from draftlab.errors import DraftlabError
    from draftlab.inference.decoding_spec import DecodingSpec, check_spec

    spec = DecodingSpec(cuda_graphs=True)
    check_spec(spec, FLAGS, device="cuda:0")
    check_spec(spec, FLAGS)  # the device not known yet: checked once it is
    with pytest.raises(DraftlabError, match="--cuda-graphs: CUDA graphs need the target on a CUDA device, not cpu"):
        check_spec(spec, FLAGS, device="cpu")
