"""P-EAGLE (models/peagle.py, losses/peagle.py, inference/peagle.py, export/peagle_speculators.py).

* COD sampling: nested groups of the sizes speculators draws, counted positions only.
* The training forward's slots are what the proposer drafts (same logits), training lowers the
  loss for every loss kind, and greedy decoding (chain, block, tree) equals plain decoding.
* The speculators export loads STRICTLY into speculators 0.9's ``PEagleDraftModel``, whose P-EAGLE
  forward (its COD layout pinned) gives draftlab's logits; import gives the same drafter back.
* The Meta schema and the recipe refuse bad fields in one line; the shared trainer trains,
  reports and resumes a killed run to identical weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from draftlab import checkpoint as ckpt
from draftlab.errors import DraftlabError
from draftlab.export.exporter import export_checkpoint
from draftlab.export.formats import ExportOptions
from draftlab.export.importer import import_checkpoint
from draftlab.inference.decoder import SpeculativeDecoder, generate_plain
from draftlab.inference.peagle import PEagleProposer
from draftlab.inference.proposer import load_proposer
from draftlab.inference.shapes import Block, Chain, DynamicTree, OptionError
from draftlab.losses.eagle import shift_left
from draftlab.losses.peagle import cod_anchors
from draftlab.models.peagle import PEagleConfig, PEagleDrafter, PEagleLoss
from tiny import assert_one_line, assert_resumes_bitwise, random_samples, save_checkpoint, write_chat

pytestmark = pytest.mark.usefixtures("one_thread")
REPO = Path(__file__).resolve().parent.parent
ATOL = 1e-5


def _drafter(target, perturb=True, **cfg):
    torch.manual_seed(0)
    cfg = {"num_layers": 2, "parallel_depth": 4, "draft_vocab_size": 64, **cfg}
    d = PEagleDrafter.build(PEagleConfig(**cfg), target, random_samples(target, n=4))
    if perturb:  # weights away from their init, so a swapped or dropped tensor shows
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in d.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return d.eval()


def _batch(target, n=4, T=24):
    s = random_samples(target, n=n, T=T, seed=3)
    ids, mask = torch.stack([x["input_ids"] for x in s]), torch.stack([x["loss_mask"] for x in s])
    return {"input_ids": ids, "loss_mask": mask, "attention_mask": torch.ones_like(ids)}


# ---------------------------------------------------------------------------- COD sampling
def test_cod_groups_are_nested_counted_and_sized_as_speculators_draws():
    torch.manual_seed(0)
    D, N = 5, 200
    counted = torch.ones(D, N, dtype=torch.bool)
    counted[:, 150:] = False  # an unanswered tail
    counted[2, ::7] = False  # depth 2 not counted at some anchors
    groups = cod_anchors(counted, 0.7, 0.2)
    n = int(counted[0].sum())
    assert [g.numel() for g in groups] == [int((n - d) * max(0.7**d, 0.2)) for d in range(1, D)]
    prev = set(range(N))
    for d, g in enumerate(groups, 1):
        assert torch.equal(g, g.sort().values) and counted[d, g].all() and set(g.tolist()) <= prev
        prev = set(g.tolist())
    # decay 1 keeps every counted nested anchor (at most n - d, as speculators); nothing counted at
    # a depth ends the groups there
    counted[1, :10] = False
    full = cod_anchors(counted, 1.0, 0.0)
    assert full[0].numel() == int(counted[1].sum()) and full[1].numel() == int((counted[1] & counted[2]).sum())
    counted[3] = False
    assert len(cod_anchors(counted, 1.0, 0.0)) == 2


# ---------------------------------------------------------------------------- training = inference
def test_training_forward_gives_the_proposers_slots(tiny_llama):
    d = _drafter(tiny_llama)
    ids = random_samples(tiny_llama, n=1, T=20, seed=5)[0]["input_ids"][None]
    T = ids.shape[1]
    hidden = tiny_llama(ids, layers=d.capture_layers, logits=None).hidden
    with torch.no_grad():
        outs = d.parallel_forward(ids, hidden, [torch.arange(T - j) for j in range(1, 4)])
    p = PEagleProposer(d)
    for t in (0, 7, 15):
        # after prompt x_0..x_t and the target's next token x_{t+1}, slot j drafts from anchor t, depth j-1
        p.start(ids[0, : t + 1], {i: h[:, : t + 1] for i, h in hidden.items()}, int(ids[0, t + 1]))
        ours = p.slot_logits(4)
        ref = torch.stack([d.head(outs[j][t]) for j in range(4)])
        assert (ours - ref).abs().max() < ATOL, t


@pytest.mark.parametrize("kind", ["ce", "nla", "lk_hybrid"])
def test_training_lowers_the_loss_of_every_slot(kind, tiny_llama):
    d = _drafter(tiny_llama, perturb=False).train()
    batch = _batch(tiny_llama)
    hidden = tiny_llama(batch["input_ids"], layers=d.capture_layers, logits=None).hidden
    cfg = PEagleLoss(kind=kind, cod_decay=1.0)  # every slot of every anchor: a fixed objective
    opt = torch.optim.AdamW([p for p in d.parameters() if p.requires_grad], lr=3e-3)
    first = None
    for _ in range(12):
        loss, metrics = d.training_loss(batch, hidden, cfg)
        opt.zero_grad()
        loss.backward()
        assert d.mask_hidden.grad.abs().sum() > 0 and d.token_embedding.weight.grad.abs().sum() > 0
        opt.step()
        first = first or metrics
    assert len(metrics["acc"]) == 4 and metrics["cod_rows"] == [88.0, 84.0, 80.0, 76.0]  # T-2-d counted per row
    assert all(b < a for a, b in zip(first["loss_steps"], metrics["loss_steps"])), (first, metrics)


# ---------------------------------------------------------------------------- decoding
@pytest.mark.parametrize("shape", [Chain(4), Chain(4, min_confidence=0.05), Block(3), DynamicTree(4, 3, 10)], ids=str)
def test_greedy_decoding_equals_plain(shape, tiny_llama, tmp_path):
    proposer = load_proposer(save_checkpoint(_drafter(tiny_llama), tiny_llama, tmp_path / "ckpt"), tiny_llama, shape)
    prompt = tiny_llama.tokenizer("the quick brown fox", return_tensors="pt").input_ids[0]
    plain = generate_plain(tiny_llama, prompt, 24)
    spec = SpeculativeDecoder(tiny_llama, proposer).generate(prompt, 24, shape=shape)
    assert spec.tokens == plain.tokens
    assert sum(spec.num_drafted) > 0 or shape == Chain(4, min_confidence=0.05)


@pytest.mark.parametrize("shape", [Chain(3), DynamicTree(3, 2, 8)], ids=str)
def test_a_batch_decodes_as_each_row_alone(shape, tiny_llama):
    from draftlab.inference.decoder import Decoder

    prompts = [tiny_llama.tokenizer(t)["input_ids"] for t in ("the quick brown fox", "one two", "a b c d e f g h")]
    res = Decoder(tiny_llama, PEagleProposer(_drafter(tiny_llama))).generate(prompts, 16, shape)
    assert [r.tokens for r in res.rows] == [generate_plain(tiny_llama, torch.tensor(p), 16).tokens for p in prompts]


def test_sampled_drafts_carry_their_slot_distributions(tiny_llama):
    from draftlab.inference.sampling import Sampling

    d = _drafter(tiny_llama)
    p = PEagleProposer(d)
    p.configure(Sampling(temperature=1.0, generator=torch.Generator().manual_seed(0)))
    ids = random_samples(tiny_llama, n=1, T=12, seed=5)[0]["input_ids"]
    hidden = tiny_llama(ids[None], layers=d.capture_layers, logits=None).hidden
    p.start(ids[:-1], {i: h[:, :-1] for i, h in hidden.items()}, int(ids[-1]))
    draft = p.propose(Chain(4))
    assert draft.probs.shape == (4, tiny_llama.vocab_size)
    assert torch.allclose(draft.probs.sum(-1), torch.ones(4)) and (draft.probs[torch.arange(4), draft.tokens] > 0).all()


def test_k_beyond_the_parallel_depth_is_refused(tiny_llama, tmp_path):
    path = save_checkpoint(_drafter(tiny_llama, parallel_depth=3), tiny_llama, tmp_path / "ckpt")
    with pytest.raises(OptionError) as e:
        load_proposer(path, tiny_llama, Chain(4))
    assert_one_line(e, r"chain: k=4 exceeds .* \(parallel_depth = 3\)")


# ---------------------------------------------------------------------------- speculators
CASES = {"fc_norm-own-embedding": dict(fc_norm=True), "scaled-input-shared-embedding": dict(train_embedding=False)}


@pytest.mark.parametrize("case", sorted(CASES))
def test_speculators_loads_the_export_strictly_and_matches(case, tiny_llama, tmp_path, monkeypatch):
    core = pytest.importorskip("speculators.models.peagle.core")
    from speculators import SpeculatorModelConfig
    from speculators.losses import resolve_loss_config

    target = tiny_llama
    d = _drafter(target, **CASES[case])
    out = export_checkpoint(save_checkpoint(d, target, tmp_path / "ckpt"), "vllm", tmp_path / "vllm", target, ExportOptions(speculative_tokens=4))
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "peagle" and config["mask_token_id"] == d.mask_token_id
    assert config["embed_requires_grad"] is (d.token_embedding is not None)
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4

    cfg = SpeculatorModelConfig.from_pretrained(str(out))  # speculators' own reader picks the class
    assert isinstance(cfg, core.PEagleSpeculatorConfig)
    cfg.transformer_layer_config._attn_implementation = "sdpa"  # flex attention has no CPU path here
    m = core.PEagleDraftModel(cfg).eval()
    exported = load_file(out / "model.safetensors")
    model_keys = set(m.state_dict())
    # nothing exported is skipped; all the model has comes from the export but the verifier's parts
    assert set(exported) <= model_keys, sorted(set(exported) - model_keys)
    filled = {"verifier_norm.weight", "verifier_lm_head.weight"} | ({"embed_tokens.weight"} if d.token_embedding is None else set())
    assert model_keys - set(exported) == filled
    state = {**exported, **{k: m.state_dict()[k] for k in filled}}
    if d.token_embedding is None:
        state["embed_tokens.weight"] = target.embed_tokens.weight.detach()
    m.load_state_dict(state, strict=True)

    ids = random_samples(target, n=1, T=24, seed=7)[0]["input_ids"][None]
    T = ids.shape[1]
    hidden = target(ids, layers=d.capture_layers, logits=None).hidden
    groups = [torch.tensor([0, 3, 5, 8, 12, 15, 19]), torch.tensor([3, 8, 12, 19]), torch.tensor([8, 19])]
    # speculators' layout of the same slots: depth 0 everywhere, then each depth's anchors
    anchor = torch.cat([torch.arange(T), *groups])
    depth = torch.cat([torch.zeros(T, dtype=torch.long), *[torch.full_like(g, j) for j, g in enumerate(groups, 1)]])
    monkeypatch.setattr(core, "generate_cod_sample_indices", lambda **kw: (anchor, depth))
    theirs = []
    hook = m.lm_head.register_forward_hook(lambda mod, args, o: theirs.append(o))
    with torch.no_grad():
        m(
            hidden_states=torch.cat([hidden[i] for i in config["eagle_aux_hidden_state_layer_ids"]], -1),
            input_ids=shift_left(ids, 1),  # draftlab pairs position t with token x_{t+1}
            document_ids=torch.zeros(1, T, dtype=torch.long),
            verifier_last_hidden_states=hidden[target.num_layers],
            num_depths=4,
            loss_config=resolve_loss_config("kl_div", "eager"),  # the fused one is a GPU kernel
        )
        ours = torch.cat([d.head(h) for h in d.parallel_forward(ids, hidden, groups)])
    hook.remove()
    assert theirs[0].shape == (1, *ours.shape)
    assert (theirs[0][0] - ours).abs().max() <= ATOL

    back = import_checkpoint(out, "speculators-peagle", tmp_path / "back", target)
    d2, meta = ckpt.load_drafter(back, target)
    assert meta["drafter"]["train_embedding"] is (d.token_embedding is not None) and meta["drafter"]["parallel_depth"] == 4
    a, b = d.export_state_dict(), d2.export_state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("edit, says", [
    (lambda c: c.update(speculators_model_type="eagle3"), "speculators_model_type is 'eagle3', expected 'peagle'"),
    (lambda c: c.pop("mask_token_id"), "mask_token_id is missing"),
    (lambda c: c.update(norm_output=True), "norm_output = True"),
    (lambda c: c.update(norm_before_fc=True), "norm_before_fc = true is not implemented by draftlab's P-EAGLE"),
    (lambda c: c.update(mask_token_id=10**6), "drafter.mask_token_id = 1000000 is outside 0..399"),
    (lambda c: c["speculators_config"]["proposal_methods"][0].update(speculative_tokens=1), "drafter.parallel_depth = 1 is outside 2..64"),
])
def test_import_refuses_what_the_drafter_cannot_be(edit, says, tiny_llama, tmp_path):
    d = _drafter(tiny_llama, perturb=False)
    out = export_checkpoint(save_checkpoint(d, tiny_llama, tmp_path / "ckpt"), "vllm", tmp_path / "vllm", tiny_llama, ExportOptions(speculative_tokens=4))
    config = json.loads((out / "config.json").read_text())
    edit(config)
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(DraftlabError) as e:
        import_checkpoint(out, "speculators-peagle", tmp_path / "back", tiny_llama)
    assert_one_line(e, __import__("re").escape(says))
    with pytest.raises(DraftlabError) as e:
        export_checkpoint(tmp_path / "ckpt", "vllm", tmp_path / "more", tiny_llama, ExportOptions(speculative_tokens=5))
    assert_one_line(e, r"--num-speculative-tokens 5 exceeds .* \(parallel_depth = 4\)")


# ---------------------------------------------------------------------------- schema, recipe, trainer
@pytest.mark.parametrize("field, value, says", [
    ("parallel_depth", 1, "drafter.parallel_depth = 1 is outside 2..64"),
    ("parallel_depth", True, "drafter.parallel_depth = true is not an integer"),
    ("mask_token_id", 400, "drafter.mask_token_id = 400 is outside 0..399 (the target vocabulary)"),
    ("train_embedding", "yes", 'drafter.train_embedding = "yes" is not true or false'),
    ("norm_output", False, "drafter.norm_output is not a field of peagle drafter meta"),
])
def test_meta_schema_rejects_bad_fields(field, value, says, tiny_llama):
    meta = _drafter(tiny_llama, perturb=False).meta()
    meta[field] = value
    with pytest.raises(DraftlabError) as e:
        PEagleDrafter.check_meta(meta, tiny_llama, "ckpt")
    assert_one_line(e, __import__("re").escape(says))


def _recipe(tmp_path: Path, target_dir, name: str, **edits) -> Path:
    recipe = {
        "algorithm": "peagle",
        "output_dir": str(tmp_path / name),
        "target": {"model": str(target_dir)},
        "data": {"source": str(write_chat(tmp_path / "chat.jsonl", 30)), "max_length": 96, "heldout": 4},
        "drafter": {"num_layers": 1, "parallel_depth": 3, "draft_vocab_size": 64},
        "capture": {"mode": "memory"},
        "train": {"max_steps": 4, "batch_tokens": 384, "checkpoint_every": 2, "warmup_steps": 1, "lr": 3e-3},
        "eval": {"enabled": True, "num_prompts": 2, "max_new_tokens": 12, "k": 3},
    }
    for section, values in edits.items():
        recipe.setdefault(section, {}).update(values)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


@pytest.mark.parametrize("section, values, says", [
    ("drafter", {"norm_output": True}, "drafter.norm_output"),
    ("drafter", {"norm_before_residual": True}, "drafter.norm_before_residual: norm_before_residual is not implemented"),
    ("drafter", {"parallel_depth": 1}, "drafter.parallel_depth"),
    ("loss", {"cod_decay": 0}, "loss.cod_decay"),
    ("loss", {"ttt_steps": 2}, "loss.ttt_steps"),
])
def test_recipe_refuses_bad_fields_in_one_line(section, values, says, tiny_target_dirs, tmp_path):
    from draftlab.recipe import load_recipe

    path = _recipe(tmp_path, tiny_target_dirs["llama"], "bad", **{section: values})
    with pytest.raises(DraftlabError) as e:
        load_recipe(path).algorithm_configs()
    assert_one_line(e, __import__("re").escape(says))


@pytest.mark.slow
def test_the_shared_trainer_trains_reports_and_resumes_a_killed_run(tiny_target_dirs, tmp_path):
    straight = _recipe(tmp_path, tiny_target_dirs["llama"], "straight")
    killed = _recipe(tmp_path, tiny_target_dirs["llama"], "killed", eval={"enabled": False})
    a = assert_resumes_bitwise("peagle", straight, killed)
    report = json.loads((tmp_path / "straight" / "eval" / "latest.json").read_text())
    assert report["greedy_match"] == "2/2" and report["step"] == 4 and len(report["alpha"]) == 3
