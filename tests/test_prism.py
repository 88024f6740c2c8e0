"""PRISM (models/prism.py, inference/prism.py): one module per draft step, chosen by a step map.

* The map is honoured: each draft step runs its module and only it (training and decoding), the
  committed tokens run step 0's, steps past the map stay on its last entry's.
* Training unrolls what decoding computes (the shared draft cache), lowers every step's loss and
  trains every module; a one-module start copies its module into each.
* Greedy decoding (chain, trees, batch, device loop) equals plain decoding.
* Bad recipe fields and metadata are one-line errors naming the field; the shared trainer trains,
  reports (draft time included) and resumes a killed run to identical weights.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import yaml

from draftlab import checkpoint as ckpt
from draftlab.errors import DraftlabError
from draftlab.inference.decoder import Decoder, SpeculativeDecoder, generate_plain
from draftlab.inference.eagle import EagleProposer
from draftlab.inference.proposer import PROPOSERS, load_proposer
from draftlab.inference.shapes import Chain, DynamicTree, StaticTree
from draftlab.models.eagle import Eagle3Config, Eagle3Drafter
from draftlab.models.prism import PrismConfig, PrismDrafter, PrismLoss
from tiny import assert_one_line, assert_resumes_bitwise, random_samples, save_checkpoint, write_chat

pytestmark = pytest.mark.usefixtures("one_thread")
REPO = Path(__file__).resolve().parent.parent
ATOL = 1e-5
TEXTS = ["the quick brown fox", "one two", "a b c d e f g h"]


def _perturb(module, seed=1, scale=0.1):
    """Weights away from their init, so a swapped, dropped or ignored module shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)


def _drafter(target, perturb=True, **cfg):
    torch.manual_seed(0)
    cfg = {"num_modules": 2, "draft_vocab_size": 64, **cfg}
    d = PrismDrafter.build(PrismConfig(**cfg), target, random_samples(target, n=4))
    if perturb:
        _perturb(d)
    return d.eval()


def _batch(target, n=4, T=24):
    s = random_samples(target, n=n, T=T, seed=3)
    ids, mask = torch.stack([x["input_ids"] for x in s]), torch.stack([x["loss_mask"] for x in s])
    return {"input_ids": ids, "loss_mask": mask, "attention_mask": torch.ones_like(ids)}


def _step_logits(d, target, steps=3, T=16):
    ids = random_samples(target, n=1, T=T, seed=5)[0]["input_ids"][None]
    hidden = target(ids, layers=d.capture_layers, logits=None).hidden
    with torch.no_grad():
        return [d.head(h) for _, h in d.unroll(ids, hidden, steps)]


# ---------------------------------------------------------------------------- the step map
def test_a_module_changes_the_steps_the_map_sends_to_it_and_no_other(tiny_llama):
    d = _drafter(tiny_llama)  # map [0, 1]: step 0 on module 0, steps 1, 2, ... on module 1
    before = _step_logits(d, tiny_llama)
    _perturb(d.step_modules[1], seed=7)
    after = _step_logits(d, tiny_llama)
    assert torch.equal(before[0], after[0])
    assert all((b - a).abs().max() > 1e-3 for b, a in zip(before[1:], after[1:]))
    _perturb(d.step_modules[0], seed=8)  # step 0's feature reaches every later step
    assert all((b - a).abs().max() > 1e-3 for b, a in zip(after, _step_logits(d, tiny_llama)))


@pytest.mark.parametrize("module", ["fc", "eagle3"])
def test_one_module_runs_per_step_in_decoding(module, tiny_llama):
    """Map [1, 0, 1]: the committed tokens run module 1, draft step 1 module 0, steps 2 and past
    the map module 1; one module per drafter forward, chain and tree."""
    p = EagleProposer(_drafter(tiny_llama, step_map=[1, 0, 1], module=module))
    ran = []
    for m, mod in enumerate(p.drafter.step_modules):
        mod.register_forward_hook(lambda *_, m=m: ran.append(m))
    prompt = torch.tensor(tiny_llama.tokenizer(TEXTS[0])["input_ids"])
    out = tiny_llama(prompt[None], layers=p.layers, logits="last")
    p.start(prompt, out.hidden, int(out.logits[0, -1].argmax()))
    assert ran == [1]
    p.propose(Chain(4))
    assert ran == [1, 0, 1, 1]
    p.propose(DynamicTree(depth=3, top_k=2, total_tokens=6))  # depth d's nodes run draft step d
    assert ran == [1, 0, 1, 1, 0, 1]


@pytest.mark.parametrize("module", ["fc", "eagle3"])
def test_training_unrolls_what_decoding_computes(module, tiny_llama):
    """Training step i at position t = decoding's i-th draft forward after position t, fed the
    true tokens: the committed K/V from step 0's module, each earlier step's from its own."""
    d = _drafter(tiny_llama, num_modules=3, step_map=[2, 0, 1], module=module)
    ids = random_samples(tiny_llama, n=1, T=16, seed=5)[0]["input_ids"][None]
    hidden = tiny_llama(ids, layers=d.capture_layers, logits=None).hidden
    steps = 4
    with torch.no_grad():
        train = [h for _, h in d.unroll(ids, hidden, steps)]
        feats = d.features(hidden)
        for t in (0, 5, 9):
            cache = d.new_cache()
            h, _ = d.draft_step(ids[:, 1 : t + 2], feats[:, : t + 1], torch.arange(t + 1)[None], cache)
            h = h[:, -1:]
            torch.testing.assert_close(h[0, 0], train[0][0, t], atol=ATOL, rtol=ATOL)
            for i in range(1, steps):
                h, _ = d.draft_step(ids[:, t + 1 + i : t + 2 + i], h, torch.tensor([[t + i]]), cache, depth=i)
                torch.testing.assert_close(h[0, 0], train[i][0, t], atol=ATOL, rtol=ATOL)


# ---------------------------------------------------------------------------- training
@pytest.mark.parametrize("module", ["fc", "eagle3"])
def test_training_lowers_every_steps_loss_and_trains_every_module(module, tiny_llama):
    d = _drafter(tiny_llama, perturb=False, module=module).train()
    batch = _batch(tiny_llama)
    hidden = tiny_llama(batch["input_ids"], layers=d.capture_layers, logits=None).hidden
    opt = torch.optim.AdamW([p for p in d.parameters() if p.requires_grad], lr=3e-3)
    first = None
    for _ in range(10):
        loss, metrics = d.training_loss(batch, hidden, PrismLoss(ttt_steps=3))
        opt.zero_grad()
        loss.backward()
        for m in d.step_modules:
            assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in m.parameters())
        opt.step()
        first = first or metrics
    assert len(metrics["loss_steps"]) == 3
    assert all(b < a for a, b in zip(first["loss_steps"], metrics["loss_steps"])), (first, metrics)


def _eagle3(target, **cfg):
    torch.manual_seed(0)
    d = Eagle3Drafter.build(Eagle3Config(draft_vocab_size=64, **cfg), target, random_samples(target, n=4))
    _perturb(d, seed=3)
    return d


def test_a_start_from_an_eagle3_run_copies_its_layer_into_every_module(tiny_llama, tmp_path):
    src = _eagle3(tiny_llama)
    path = save_checkpoint(src, tiny_llama, tmp_path / "eagle3")
    d = _drafter(tiny_llama, perturb=False, module="eagle3", num_modules=3, step_map=[0, 1, 2], init_from=str(path))
    theirs = src.state_dict()
    for key, value in d.state_dict().items():
        want = theirs[re.sub(r"^step_modules\.\d\.", "", key)]
        assert torch.equal(value, want), key
    assert d.step_modules[1].layers[0].self_attn.q_proj.weight.data_ptr() != d.step_modules[2].layers[0].self_attn.q_proj.weight.data_ptr()
    # every module the same: PRISM drafts what the EAGLE-3 drafter does, at every step
    ours, eagle = _step_logits(d, tiny_llama, steps=3), _step_logits(src.eval(), tiny_llama, steps=3)
    assert all((a - b).abs().max() < ATOL for a, b in zip(ours, eagle))


def test_a_start_from_a_one_module_prism_run_copies_module_0(tiny_llama, tmp_path):
    src = _drafter(tiny_llama, num_modules=1)
    path = save_checkpoint(src, tiny_llama, tmp_path / "one")
    d = _drafter(tiny_llama, perturb=False, init_from=str(path))
    theirs = src.state_dict()
    for key, value in d.state_dict().items():
        assert torch.equal(value, theirs[re.sub(r"^step_modules\.\d\.", "step_modules.0.", key)]), key


@pytest.mark.parametrize("source, cfg, says", [
    ("eagle3", dict(), "has module \"eagle3\", this drafter (drafter.module) \"fc\""),
    ("eagle3", dict(module="eagle3", draft_vocab_size=32), "has draft_vocab_size 64, this drafter (drafter.draft_vocab_size) 32"),
    ("prism-2", dict(), "has 2 modules; PRISM starts from a one-module drafter"),
    ("missing", dict(), "drafter.init_from: not a draftlab checkpoint"),
])
def test_a_start_from_what_is_not_its_one_module_drafter_is_refused(source, cfg, says, tiny_llama, tmp_path):
    path = tmp_path / source
    if source == "eagle3":
        save_checkpoint(_eagle3(tiny_llama), tiny_llama, path)
    elif source == "prism-2":
        save_checkpoint(_drafter(tiny_llama), tiny_llama, path)
    with pytest.raises(DraftlabError) as e:
        _drafter(tiny_llama, init_from=str(path), **cfg)
    assert_one_line(e, re.escape(says))


# ---------------------------------------------------------------------------- decoding
STATIC = StaticTree([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])


@pytest.mark.parametrize("shape", [Chain(4), Chain(4, min_confidence=0.05), DynamicTree(4, 3, 10), STATIC], ids=str)
def test_greedy_decoding_equals_plain(shape, tiny_llama, tmp_path):
    proposer = load_proposer(save_checkpoint(_drafter(tiny_llama), tiny_llama, tmp_path / "ckpt"), tiny_llama, shape)
    assert PROPOSERS.get("prism") is EagleProposer and proposer.name == "prism"
    prompt = tiny_llama.tokenizer(TEXTS[0], return_tensors="pt").input_ids[0]
    spec = SpeculativeDecoder(tiny_llama, proposer).generate(prompt, 24, shape=shape)
    assert spec.tokens == generate_plain(tiny_llama, prompt, 24).tokens
    assert sum(spec.num_drafted) > 0 or shape == Chain(4, min_confidence=0.05)


@pytest.mark.parametrize("shape", [Chain(3), DynamicTree(3, 2, 8)], ids=str)
def test_a_batch_decodes_as_each_row_alone(shape, tiny_llama):
    prompts = [tiny_llama.tokenizer(t)["input_ids"] for t in TEXTS]
    res = Decoder(tiny_llama, EagleProposer(_drafter(tiny_llama, step_map=[1, 0]))).generate(prompts, 16, shape)
    assert [r.tokens for r in res.rows] == [generate_plain(tiny_llama, torch.tensor(p), 16).tokens for p in prompts]


@pytest.mark.parametrize("shape", [Chain(3), DynamicTree(3, 3, 8)], ids=str)
def test_the_device_loop_drafts_what_the_host_loop_does(shape, tiny_llama, monkeypatch):
    """Same tokens and acceptance, and the same drafts at every step while all rows decode (random
    drafts are mostly rejected, so the tokens alone would not tell)."""
    from draftlab.inference.eagle import EagleChains, EagleOnDevice

    proposer = EagleProposer(_drafter(tiny_llama, step_map=[1, 0]))
    prompts = [tiny_llama.tokenizer(t)["input_ids"] for t in TEXTS]
    drafted = {"host": [], "device": []}
    spied = (EagleChains, "propose", EagleOnDevice, "draft") if isinstance(shape, Chain) else (
        EagleProposer, "propose", EagleOnDevice, "draft_tree")
    for where, (cls, name) in zip(drafted, (spied[:2], spied[2:])):
        original = getattr(cls, name)
        monkeypatch.setattr(cls, name, lambda *a, f=original, w=where: drafted[w].append(f(*a)) or drafted[w][-1])
    host = Decoder(tiny_llama, proposer, loop="host").generate(prompts, 16, shape)
    dev = Decoder(tiny_llama, proposer, loop="device").generate(prompts, 16, shape)
    assert [r.tokens for r in dev.rows] == [r.tokens for r in host.rows]
    assert [r.accept_lengths for r in dev.rows] == [r.accept_lengths for r in host.rows]
    if isinstance(shape, Chain):
        together = [torch.stack([c.tokens for c in h]) for h in drafted["host"] if len(h) == 3]
        assert len(together) >= 3 and len(drafted["device"]) >= len(together)
        for step, (h, d) in enumerate(zip(together, drafted["device"])):
            assert torch.equal(h, d[:3]), step
    else:  # the host drafts each row's tree in turn, the device every row's at once: the same paths
        host_trees = [_paths(t.tokens, t.parents) for t in drafted["host"]]
        dev_trees = [_paths(tok[r], par[r]) for tok, par in drafted["device"] for r in range(3)]
        assert len(dev_trees) >= 9 and host_trees[:len(dev_trees)] == dev_trees


def _paths(tokens, parents):
    """A tree as the sorted token paths of its nodes (parents: 0 the root, i + 1 node i)."""
    tok, par = tokens.tolist(), parents.tolist()

    def path(i):
        return (path(par[i] - 1) if par[i] > 0 else ()) + (tok[i],)

    return sorted(path(i) for i in range(len(tok)))


def test_export_is_draftlabs_layout_only(tiny_llama, tmp_path):
    from draftlab.export.exporter import export_checkpoint

    path = save_checkpoint(_drafter(tiny_llama, normalize_fc_input=True), tiny_llama, tmp_path / "ckpt")
    out = export_checkpoint(path, "hf", tmp_path / "hf", tiny_llama)
    back, meta = ckpt.load_drafter(out, tiny_llama)
    assert meta["drafter"]["step_map"] == [0, 1] and meta["drafter"]["normalize_fc_input"] is False  # folded into fc
    assert (_step_logits(back, tiny_llama)[2] - _step_logits(ckpt.load_drafter(path, tiny_llama)[0], tiny_llama)[2]).abs().max() < 1e-4
    for engine in ("vllm", "sglang"):
        with pytest.raises(DraftlabError) as e:
            export_checkpoint(path, engine, tmp_path / engine, tiny_llama)
        assert_one_line(e, f"no export of prism drafters for {engine}")


# ---------------------------------------------------------------------------- schema, recipe, trainer
@pytest.mark.parametrize("field, value, says", [
    ("num_modules", 0, "drafter.num_modules = 0 is outside 1..64"),
    ("step_map", [0, 2], "drafter.step_map = [0, 2] sends step 1 to module 2, outside 0..1 (num_modules 2)"),
    ("step_map", [], "drafter.step_map = [] is empty"),
    ("step_map", [0, 1] * 33, "has 66 steps, more than 64"),
    ("step_map", [1, 1], "drafter.step_map = [1, 1] sends no step to module 0"),
    ("step_map", [0, True], "drafter.step_map[1] = true is not an integer"),
    ("module", "moe", 'drafter.module = "moe" should be'),
    ("norm_before_residual", True, 'drafter.module = "fc" has no fused layer'),
])
def test_meta_schema_rejects_bad_fields(field, value, says, tiny_llama):
    meta = _drafter(tiny_llama, perturb=False).meta()
    meta[field] = value
    with pytest.raises(DraftlabError) as e:
        PrismDrafter.check_meta(meta, tiny_llama, "ckpt")
    assert_one_line(e, re.escape(says))


def _recipe(tmp_path: Path, target_dir, name: str, **edits) -> Path:
    recipe = {
        "algorithm": "prism",
        "output_dir": str(tmp_path / name),
        "target": {"model": str(target_dir)},
        "data": {"source": str(write_chat(tmp_path / "chat.jsonl", 30)), "max_length": 96, "heldout": 4},
        "drafter": {"num_modules": 2, "draft_vocab_size": 64},
        "loss": {"ttt_steps": 3},
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
    ("drafter", {"num_modules": 0}, "drafter.num_modules: "),
    ("drafter", {"step_map": [0, 2]}, "drafter.step_map: sends step 1 to module 2, outside 0..1 (num_modules 2)"),
    ("drafter", {"step_map": []}, "drafter.step_map: is empty"),
    ("drafter", {"step_map": [0] * 65 + [1]}, "drafter.step_map: has 66 steps, more than 64"),
    ("drafter", {"num_modules": 3, "step_map": [0, 1]}, "drafter.step_map: sends no step to module 2"),
    ("drafter", {"module": "moe"}, "drafter.module: "),
    ("drafter", {"norm_before_residual": True}, "norm_before_residual is a flag of EAGLE-3's fused layer: it needs drafter.module eagle3"),
    ("loss", {"ttt_steps": 1}, "loss.ttt_steps = 1 trains no step of module 1 (drafter.step_map [0, 1] first sends step 1 to it)"),
    ("loss", {"decay": 0}, "loss.decay: "),
])
def test_recipe_refuses_bad_fields_in_one_line(section, values, says, tiny_target_dirs, tmp_path):
    from draftlab.recipe import load_recipe

    path = _recipe(tmp_path, tiny_target_dirs["llama"], "bad", **{section: values})
    with pytest.raises(DraftlabError) as e:
        load_recipe(path)
    assert_one_line(e, re.escape(says))


def test_the_recipe_is_read_and_sized_as_its_comments_say():
    from draftlab.recipe import load_recipe

    recipe = load_recipe(REPO / "recipes" / "smollm2-135m-prism.yaml")
    _, cfg, loss = recipe.algorithm_configs()
    assert recipe.algorithm == "prism" and recipe.target.model == "default" and recipe.train.precision != "bf16"
    assert cfg.num_modules == 2 and cfg.step_map == [0, 1, 1] and cfg.init_from is None  # the reference's map, from scratch
    assert loss.ttt_steps == len(cfg.step_map) == recipe.eval.k  # one trained step per entry, each reported
    assert recipe.train.time_limit_minutes <= 20


@pytest.mark.slow  # the shared trainer's resume is in the default suite (test_train.py); this family's with -m slow
def test_the_shared_trainer_trains_reports_and_resumes_a_killed_run(tiny_target_dirs, tmp_path):
    straight = _recipe(tmp_path, tiny_target_dirs["llama"], "straight")
    killed = _recipe(tmp_path, tiny_target_dirs["llama"], "killed", eval={"enabled": False})
    a = assert_resumes_bitwise("prism", straight, killed)
    assert any(k.startswith("step_modules.1.") for k in a)
    report = json.loads((tmp_path / "straight" / "eval" / "latest.json").read_text())
    assert report["greedy_match"] == "2/2" and report["step"] == 4 and len(report["alpha"]) == 3
    assert report["drafter"] == "prism" and report["num_steps"] > 0
    assert 0 < report["draft_time_s"] < report["total_time_s"]  # the draft time per step is measured
