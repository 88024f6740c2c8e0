"""Checkpoint metadata is checked against the structure it describes, by each family's declared
schema (``Drafter.Meta``), on every path: build, the checkpoint writer, load (eval, generate,
resume), import and export.

The bad cases are generated from the schemas themselves, for every registered family (the toy
family of test_plugin_family.py included): a wrong type for each field (bool, float or string for
an integer, ...), a value outside each bounded field's range (the bounds read from the field's
type, relative to the target), a huge size, another target's fact, a repeated or unordered list,
a missing field, an unknown one. Each corrupted checkpoint is refused on load with one line naming
the file and the field, and export and import of it refuse without leaving files behind.
"""

from __future__ import annotations

import json
import shutil
from typing import Annotated, get_args, get_origin

import pytest
import torch
from pydantic import BaseModel
from safetensors.torch import load_file, save_file

import test_plugin_family  # noqa: F401 - registers the toy family
from draftlab import atomic
from draftlab import checkpoint as ckpt
from draftlab.errors import DraftlabError
from draftlab.export.exporter import export_checkpoint
from draftlab.export.formats import IMPORT_FORMATS, Format
from draftlab.export.importer import import_checkpoint
from draftlab.models.drafter import DRAFTERS, Distinct, Range, TargetFacts, TargetValue
from tiny import random_samples

HUGE = 10**12

# configs whose drafters have every optional part (reduced vocabularies, several fused layers)
CONFIGS = {
    "eagle1": dict(num_layers=1),
    "eagle3": dict(draft_vocab_size=64, normalize_fc_input=False, fc_norm=True, norm_output=True),
    "medusa": dict(num_heads=2, draft_vocab_size=64),
    "medusa2": dict(num_heads=2, draft_vocab_size=64, lora_r=4, lora_targets=["q_proj", "v_proj"]),
    "diffusion": dict(num_layers=1, block_size=4, target_layers=[1, 3], draft_vocab_size=64, normalize_fc_input=False),
    "dspark": dict(num_layers=1, block_size=4, target_layers=[1, 3], draft_vocab_size=64, normalize_fc_input=False, markov_rank=8),
    "dflash2": dict(num_layers=1, block_size=4, target_layers=[1, 3], draft_vocab_size=64, normalize_fc_input=False, selector_rank=8,
                    selector_top_k=4),
    "domino": dict(num_layers=1, block_size=4, target_layers=[1, 3], draft_vocab_size=64, normalize_fc_input=False, gru_hidden_dim=8, emb_dim=8),
    "peagle": dict(num_layers=1, parallel_depth=3, draft_vocab_size=64, normalize_fc_input=False, fc_norm=True),
    "prism": dict(num_modules=2, step_map=[1, 0], module="eagle3", draft_vocab_size=64, normalize_fc_input=False, norm_output=True),
    "mtp": dict(num_layers=1, draft_vocab_size=64),
    "hydra": dict(num_heads=2, num_layers=2, draft_vocab_size=64),
}


# ---------------------------------------------------------------------------- cases from the schemas
def _leaves(model: type[BaseModel], prefix: tuple = ()):
    """(path, base type, markers, required) of every leaf field; a list field gives the list
    itself (its own markers) and its first item (the item type's markers)."""
    for name, f in model.model_fields.items():
        path, ann = prefix + (name,), f.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            yield path, "model", (), f.is_required()
            yield from _leaves(ann, path)
        elif get_origin(ann) is list:
            yield path, list, tuple(f.metadata), f.is_required()
            item = get_args(ann)[0]
            base, markers = (get_args(item)[0], item.__metadata__) if get_origin(item) is Annotated else (item, ())
            yield path + (0,), base, tuple(markers), False
        else:
            yield path, get_origin(ann) or ann, tuple(f.metadata), f.is_required()


WRONG_TYPES = {  # base type -> {case: (value, what the error says)}
    int: {"bool": (True, "is not an integer"), "float": (1.5, "is not an integer"), "string": ("7", "is not an integer")},
    bool: {"int": (1, "is not true or false"), "string": ("true", "is not true or false")},
    float: {"string": ("1.0", "is not a number"), "bool": (True, "is not a number")},
    str: {"int": (3, "is not a string")},
    list: {"not a list": (3, "is not a list")},
    dict: {"not an object": ([1], "is not an object")},
    "model": {"not an object": ([1], "is not an object")},
}


def _cases(family) -> list[tuple]:
    """(path, case) pairs of ``family``'s schema."""
    out = [((), "unknown field")]
    for path, base, markers, required in _leaves(family.Meta):
        if required:
            out.append((path, "missing"))
        out += [(path, case) for case in WRONG_TYPES.get(base, {})]
        for m in markers:
            if isinstance(m, Range):
                out += [(path, "above"), (path, "below"), (path, "huge")]
            elif isinstance(m, TargetValue):
                out += [(path, "another target's"), (path, "huge")]
            elif isinstance(m, Distinct):
                out += [(path, "repeated"), (path, "empty")] + ([(path, "unordered")] if m.ascending else [])
    return out


def _field(family, path) -> tuple:
    """The markers of the field at ``path``."""
    return next(markers for p, _, markers, _ in _leaves(family.Meta) if p == path)


def _bad_value(family, path, case, value, facts: TargetFacts):
    """(the value to write at ``path``, what the error says) for ``case``; ``value``: the valid one."""
    for base, cases in WRONG_TYPES.items():
        if case in cases and any(p == path and b == base for p, b, _, _ in _leaves(family.Meta)):
            return cases[case]
    markers = _field(family, path)
    if case in ("above", "below", "huge") and any(isinstance(m, Range) for m in markers):
        lo, hi = next(m for m in markers if isinstance(m, Range)).bounds(facts)
        bad = {"above": hi + 1, "below": lo - 1, "huge": HUGE}[case]
        return bad, f"is outside {lo}..{hi}"
    if case in ("another target's", "huge"):
        want = next(m for m in markers if isinstance(m, TargetValue)).expected(facts)
        if isinstance(want, str):  # a name (model_type): another one
            return want + "-other", f"is not the target's {_what(markers)} {want}"
        return (want + 1 if case != "huge" else HUGE), f"is not the target's {_what(markers)} {want}"
    ascending = next(m for m in markers if isinstance(m, Distinct)).ascending
    if case == "repeated":
        return value + value[:1], "is not in distinct ascending order" if ascending else f"repeats {value[0]}"
    if case == "empty":
        return [], "is empty"
    assert len(value) >= 2, f"{family.algorithm}: give {path} two values in CONFIGS to test the order"
    return value[::-1], "is not in distinct ascending order"


def _what(markers) -> str:
    return next(m for m in markers if isinstance(m, TargetValue)).what


def _at(meta: dict, path: tuple):
    for p in path:
        meta = meta[p]
    return meta


def _set(meta: dict, path: tuple, value) -> None:
    _at(meta, path[:-1])[path[-1]] = value


def _delete(meta: dict, path: tuple) -> None:
    del _at(meta, path[:-1])[path[-1]]


def _show(path: tuple) -> str:
    return "drafter" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path)


CASES = [(name, path, case) for name, family in DRAFTERS.items() for path, case in _cases(family)]


# ---------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def checkpoints(tiny_llama, tmp_path_factory):
    """algorithm -> a checkpoint of a freshly built drafter of that family (built on demand)."""
    root, made = tmp_path_factory.mktemp("meta-schema"), {}

    def get(name: str):
        if name not in made:
            family = DRAFTERS.get(name)
            torch.manual_seed(0)
            d = family.build(family.Config(**CONFIGS.get(name, {})), tiny_llama, random_samples(tiny_llama, n=4))
            path = root / name
            with atomic.directory(path) as tmp:
                ckpt.save_weights(tmp, d.state_dict(), ckpt.checkpoint_meta(d, tiny_llama.identity, None, 1))
            made[name] = path
        return made[name]

    return get


class MetaAsIs(Format):
    """A test import format: a draftlab checkpoint whose config.json is its draftlab.json, read
    as is (what a foreign config could say, without a format's own checks)."""

    name = "test-meta-as-is"

    def __init__(self, algorithm: str):
        self.algorithm = algorithm

    def import_meta(self, config, tensors, target):
        return config["drafter"]


@pytest.fixture()
def as_is_import(monkeypatch):
    """import_checkpoint of a draftlab checkpoint directory through :class:`MetaAsIs`."""

    def run(src, algorithm, out, target):
        shutil.copy(src / ckpt.META, src / "config.json")
        monkeypatch.setitem(IMPORT_FORMATS._items, MetaAsIs.name, MetaAsIs(algorithm))
        return import_checkpoint(src, MetaAsIs.name, out, target)

    return run


def _one_line(excinfo, *needles: str) -> str:
    msg = str(excinfo.value)
    assert "\n" not in msg, msg
    for n in needles:
        assert n in msg, f"{n!r} not in {msg!r}"
    return msg


def _refused_everywhere(path, algorithm, target, tmp_path, as_is_import, *needles) -> None:
    """Load, export and import of the checkpoint at ``path`` are each refused with one line
    holding ``needles``, and export and import leave nothing behind."""
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(DraftlabError) as e:
        ckpt.load_drafter(path, target)
    _one_line(e, str(path), *needles)
    with pytest.raises(DraftlabError) as e:
        export_checkpoint(path, "hf", tmp_path / "exported", target)
    _one_line(e, *needles)
    with pytest.raises(DraftlabError) as e:
        as_is_import(path, algorithm, tmp_path / "imported", target)
    _one_line(e, *needles)
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no output, no staging directory left


# ---------------------------------------------------------------------------- the tests
def test_every_family_declares_a_schema_with_cases():
    for name, family in DRAFTERS.items():
        kinds = {case for n, _, case in CASES if n == name}
        assert "bool" in kinds and "missing" in kinds, (name, kinds)
        assert any(isinstance(m, (Range, TargetValue)) for _, _, ms, _ in _leaves(family.Meta) for m in ms), name


@pytest.mark.parametrize("name", sorted(DRAFTERS.names()))
def test_a_valid_checkpoint_passes_every_path(name, checkpoints, tiny_llama, tmp_path, as_is_import):
    src = tmp_path / "ckpt"
    shutil.copytree(checkpoints(name), src)
    d, meta = ckpt.load_drafter(src, tiny_llama)
    assert DRAFTERS.get(name).check_meta(meta["drafter"], tiny_llama) == DRAFTERS.get(name).check_meta(d.meta(), tiny_llama)
    export_checkpoint(src, "hf", tmp_path / "hf", tiny_llama)
    back = as_is_import(src, name, tmp_path / "imported", tiny_llama)
    d2, _ = ckpt.load_drafter(back, tiny_llama)
    a, b = d.export_state_dict(), d2.export_state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("name,path,case", CASES, ids=[f"{n}-{_show(p)}-{c}" for n, p, c in CASES])
def test_corrupt_metadata_is_refused_on_every_path(name, path, case, checkpoints, tiny_llama, tmp_path, as_is_import):
    family = DRAFTERS.get(name)
    src = tmp_path / "ckpt"
    shutil.copytree(checkpoints(name), src)
    meta = json.loads((src / ckpt.META).read_text())
    drafter = meta["drafter"]
    if case == "unknown field":
        drafter["surprise"] = 1
        needles = ("drafter.surprise is not a field",)
    elif case == "missing":
        _delete(drafter, path)
        needles = (f"drafter meta lacks '{_show(path)[len('drafter.'):]}'",)
    else:
        value, says = _bad_value(family, path, case, _at(drafter, path), TargetFacts.of(tiny_llama))
        _set(drafter, path, value)
        needles = (f"{_show(path)} = {json.dumps(value)} {says}",)
    (src / ckpt.META).write_text(json.dumps(meta))
    _refused_everywhere(src, name, tiny_llama, tmp_path, as_is_import, *needles)


SHAPED = [n for n, f in DRAFTERS.items() if "shape" in f.Meta.model_fields]
CROSS_FIELD = {  # rules between fields, or on values no type states
    "kv heads": (("shape", "num_key_value_heads"), 3, "= 3 does not divide num_attention_heads 4"),
    "odd head_dim": (("shape", "head_dim"), 15, "= 15 is odd (RoPE rotates pairs of channels)"),
    "layer family": (("shape", "model_type"), "gpt2", '= "gpt2" is not a supported layer family (llama, mistral, qwen2, qwen3)'),
    "activation": (("shape", "hidden_act"), "gelu", '= "gelu" is not silu'),
    "eps": (("shape", "rms_norm_eps"), 0.0, "= 0.0 should be greater than 0"),
}


@pytest.mark.parametrize("case", sorted(CROSS_FIELD))
@pytest.mark.parametrize("name", SHAPED)
def test_layer_shapes_the_attention_cannot_run_are_refused(name, case, checkpoints, tiny_llama, tmp_path, as_is_import):
    path, value, says = CROSS_FIELD[case]
    src = tmp_path / "ckpt"
    shutil.copytree(checkpoints(name), src)
    meta = json.loads((src / ckpt.META).read_text())
    _set(meta["drafter"], path, value)
    (src / ckpt.META).write_text(json.dumps(meta))
    _refused_everywhere(src, name, tiny_llama, tmp_path, as_is_import, f"{_show(path)} {says}")


@pytest.mark.parametrize("rope,says", [
    ({"rope_theta": float("nan")}, "has rope_theta nan, not a finite number"),
    ({"rope_theta": -1.0}, "has rope_theta -1.0, not a positive number"),
    ({"rope_theta": "1e4"}, 'has rope_theta "1e4", not a positive number'),
    ({"factor": float("inf")}, "has factor inf, not a finite number"),
])
@pytest.mark.parametrize("name", SHAPED)
def test_a_rope_that_makes_no_rotation_is_refused(name, rope, says, checkpoints, tiny_llama, tmp_path, as_is_import):
    """JSON readers take NaN and Infinity: a RoPE theta or factor that is not a finite number (or a theta
    that is not positive) would load and decode NaN."""
    src = tmp_path / "ckpt"
    shutil.copytree(checkpoints(name), src)
    meta = json.loads((src / ckpt.META).read_text())
    meta["drafter"]["shape"]["rope"].update(rope)
    (src / ckpt.META).write_text(json.dumps(meta))  # writes NaN / Infinity as bare words
    _refused_everywhere(src, name, tiny_llama, tmp_path, as_is_import, "drafter.shape.rope = ", says)


@pytest.mark.parametrize(
    "value,says",
    [(["qkv"], "unknown projection 'qkv'"), (["q_proj", "q_proj"], "lists a projection twice"), ([], "needs a non-empty list")],
)
def test_lora_targets_are_known_projections(value, says, checkpoints, tiny_llama, tmp_path, as_is_import):
    src = tmp_path / "ckpt"
    shutil.copytree(checkpoints("medusa2"), src)
    meta = json.loads((src / ckpt.META).read_text())
    meta["drafter"]["lora_targets"] = value
    (src / ckpt.META).write_text(json.dumps(meta))
    _refused_everywhere(src, "medusa2", tiny_llama, tmp_path, as_is_import, f"drafter.lora_targets = {json.dumps(value)} ", says)


def _d2t_beyond(s, V):
    s["d2t"][-1] += V


def _d2t_unordered(s, V):
    s["d2t"][1] = s["d2t"][0] - 1  # draft ids 0 and 1 map to the same target id


def _t2d_disagrees(s, V):
    t2d = s["t2d"]
    t2d[int((~t2d).nonzero()[0])] = True


BAD_MAPS = {
    "d2t beyond the vocabulary": (_d2t_beyond, r"d2t[63] = {} maps draft id 63 to target id {}, outside the target vocabulary 0..{}"),
    "d2t not ascending": (_d2t_unordered, "d2t[1] = "),
    "t2d disagrees": (_t2d_disagrees, "t2d["),
    "d2t of floats": (lambda s, V: s.update(d2t=s["d2t"].float()), "d2t is a torch.float32 tensor"),
}
MAPPED = [n for n, f in DRAFTERS.items() if f.vocab_maps]


@pytest.mark.parametrize("case", sorted(BAD_MAPS))
@pytest.mark.parametrize("name", MAPPED)
def test_vocabulary_maps_out_of_range_are_refused(name, case, checkpoints, tiny_llama, tmp_path, as_is_import):
    src = tmp_path / "ckpt"
    shutil.copytree(checkpoints(name), src)
    state = load_file(src / ckpt.WEIGHTS)
    V = tiny_llama.vocab_size
    edit, says = BAD_MAPS[case]
    old = state["d2t"][-1].item()
    edit(state, V)
    save_file(state, src / ckpt.WEIGHTS)
    if case == "d2t beyond the vocabulary":
        says = says.format(old + V, 63 + old + V, V - 1)
    _refused_everywhere(src, name, tiny_llama, tmp_path, as_is_import, says)
    with pytest.raises(DraftlabError) as e:
        ckpt.load_drafter(src, tiny_llama)
    _one_line(e, f"{src / ckpt.WEIGHTS}: {says}")


# ---------------------------------------------------------------------------- build and write
@pytest.mark.parametrize(
    "name,cfg,says",
    [
        ("diffusion", dict(block_size=HUGE), f"drafter.block_size = {HUGE} is outside 2..1024"),
        ("diffusion", dict(target_layers=[1, 1]), "drafter.target_layers = [1, 1] is not in distinct ascending order"),
        ("diffusion", dict(mask_token_id=10**6), "drafter.mask_token_id = 1000000 is outside 0..399 (the target vocabulary)"),
        ("eagle3", dict(aux_layers=[1, 1, 2]), "drafter.aux_layers = [1, 1, 2] repeats 1"),
        ("eagle3", dict(num_layers=HUGE), f"drafter.num_layers = {HUGE} is outside 1..4 (at most the target's layers)"),
        ("medusa", dict(num_heads=HUGE), f"drafter.num_heads = {HUGE} is outside 1..64"),
        ("medusa2", dict(lora_r=HUGE), f"drafter.lora_r = {HUGE} is outside 1..64 (at most the target's hidden size)"),
    ],
)
def test_build_refuses_what_the_schema_refuses_before_allocating(name, cfg, says, tiny_llama):
    family = DRAFTERS.get(name)
    with pytest.raises(DraftlabError) as e:
        family.build(family.Config(**cfg), tiny_llama, random_samples(tiny_llama, n=2))
    assert _one_line(e, says).startswith("drafter.")


def test_the_writer_refuses_a_checkpoint_the_reader_would(checkpoints, tiny_llama, tmp_path):
    d, meta = ckpt.load_drafter(checkpoints("diffusion"), tiny_llama)
    meta["drafter"]["block_size"] = HUGE
    with pytest.raises(DraftlabError) as e:
        with atomic.directory(tmp_path / "out") as tmp:
            ckpt.save_weights(tmp, d.state_dict(), meta)
    _one_line(e, "drafter.block_size = 1000000000000 is outside 2..1024")
    state = {**d.state_dict(), "d2t": d.d2t + tiny_llama.vocab_size}
    with pytest.raises(DraftlabError) as e:
        with atomic.directory(tmp_path / "out") as tmp:
            ckpt.save_weights(tmp, state, ckpt.checkpoint_meta(d, tiny_llama.identity, None, 1))
    _one_line(e, "model.safetensors: d2t[0] = ")
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------- imports of public layouts
def _rewrite_config(out, edit):
    c = json.loads((out / "config.json").read_text())
    edit(c)
    (out / "config.json").write_text(json.dumps(c))


@pytest.mark.parametrize(
    "name,cfg,engine,fmt,edit,says",
    [
        ("diffusion", {}, "vllm", "speculators-dflash", lambda c: c.update(block_size=HUGE), f"drafter.block_size = {HUGE} is outside 2..1024"),
        ("diffusion", dict(draft_vocab_size=0), "sglang", "zlab-dflash", lambda c: c["dflash_config"].update(target_layer_ids=[0, 0]),
         "drafter.target_layers = [1, 1] is not in distinct ascending order"),
        ("diffusion", dict(draft_vocab_size=0), "sglang", "zlab-dflash", lambda c: c["dflash_config"].update(target_layer_ids=[True, 2]),
         "target_layer_ids (a list of layer ids)"),
        ("eagle3", {}, "vllm", "speculators", lambda c: c.update(eagle_aux_hidden_state_layer_ids=[1, 1, 2]), "drafter.aux_layers = [1, 1, 2] repeats 1"),
        ("eagle3", {}, "vllm", "speculators", lambda c: c.update(draft_vocab_size=63.5), "drafter.draft_vocab_size = 63.5 is not an integer"),
        ("eagle3", dict(norm_output=False), "sglang", "sglang", lambda c: c.update(draft_vocab_size="64"),  # SGLang: no norm_output
         "drafter.draft_vocab_size = \"64\" is not an integer"),
        ("medusa", {}, "vllm", "medusa-vllm", lambda c: c.update(num_heads=HUGE), f"drafter.num_heads = {HUGE} is outside 1..64"),
        ("medusa", dict(draft_vocab_size=0), "medusa", "medusa", lambda c: c.update(medusa_num_layers=HUGE),
         f"drafter.num_layers = {HUGE} is outside 1..4"),
    ],
)
def test_imports_refuse_what_loading_would_refuse(name, cfg, engine, fmt, edit, says, tiny_llama, tmp_path):
    family = DRAFTERS.get(name)
    torch.manual_seed(0)
    d = family.build(family.Config(**{**CONFIGS[name], **cfg}), tiny_llama, random_samples(tiny_llama, n=4))
    with atomic.directory(tmp_path / "ckpt") as tmp:
        ckpt.save_weights(tmp, d.state_dict(), ckpt.checkpoint_meta(d, tiny_llama.identity, None, 1))
    out = export_checkpoint(tmp_path / "ckpt", engine, tmp_path / "public", tiny_llama)
    if fmt == "medusa":
        (out / "medusa_lm_head.pt").unlink()
    _rewrite_config(out, edit)
    with pytest.raises(DraftlabError) as e:
        import_checkpoint(out, fmt, tmp_path / "imported", tiny_llama)
    _one_line(e, says)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "public"]


# ---------------------------------------------------------------------------- what loads decodes
EDGES = {  # configs at the edges of what the schemas accept, and the shape to decode with
    "eagle3": (dict(draft_vocab_size=1, aux_layers=[4, 0], num_layers=4, normalize_fc_input=False), "chain"),
    "diffusion": (dict(block_size=2, target_layers=[1, 2, 3], num_layers=4, mask_token_id=399, draft_vocab_size=1,
                       normalize_fc_input=False), "block"),
    "medusa": (dict(num_heads=1, num_layers=4, draft_vocab_size=1), "chain"),
}


@pytest.mark.parametrize("name", sorted(EDGES))
def test_a_checkpoint_at_the_edges_of_its_schema_decodes(name, tiny_llama, tmp_path):
    from draftlab.inference.decoder import SpeculativeDecoder, generate_plain
    from draftlab.inference.proposer import load_proposer
    from draftlab.inference.shapes import Block, Chain

    cfg, kind = EDGES[name]
    family = DRAFTERS.get(name)
    d = family.build(family.Config(**cfg), tiny_llama, random_samples(tiny_llama, n=4))
    with atomic.directory(tmp_path / "ckpt") as tmp:
        ckpt.save_weights(tmp, d.state_dict(), ckpt.checkpoint_meta(d, tiny_llama.identity, None, 1))
    proposer = load_proposer(tmp_path / "ckpt", tiny_llama)
    prompt = tiny_llama.tokenizer("the quick brown fox", return_tensors="pt").input_ids[0]
    shape = Chain(2) if kind == "chain" else Block(1)
    spec = SpeculativeDecoder(tiny_llama, proposer).generate(prompt, 12, shape=shape)
    assert spec.tokens == generate_plain(tiny_llama, prompt, 12).tokens
