"""The MTP module drafter with FastMTP's recursion (models/mtp.py, losses/mtp.py, inference/mtp.py,
export/mtp_speculators.py).

* The recursion: one module, step k fed step k-1's output state and token x_{t+k}; the step losses
  mixed with FastMTP's normalised beta^(k-1); training lowers every step's loss; the training
  forward's first step is the proposer's first draft.
* Decoding (a module trained on the tiny target's own continuations, so drafts are accepted):
  greedy equals plain for chains and trees, a batch decodes as each row alone, the device loop as
  the host loop.
* Export: speculators' ``mtp`` format loads STRICTLY into speculators' ``MTPDraftModel`` on a tiny
  Qwen3 target and its FastMTP forward gives draftlab's logits at every step; ``draftlab check``
  drafts the same chains with it; import gives the same drafter back. A Llama target (no engine
  serves an MTP module for one) is refused in one line and exported in draftlab's layout.
* The Meta schema and the recipe refuse bad fields in one line; the shared trainer trains,
  reports and resumes a killed run to identical weights.
"""

from __future__ import annotations

import json
import re
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
from draftlab.inference.decoder import Decoder, SpeculativeDecoder, generate_plain
from draftlab.inference.mtp import MtpProposer
from draftlab.inference.proposer import load_proposer
from draftlab.inference.shapes import Chain, DynamicTree, StaticTree
from draftlab.losses.eagle import shift_left
from draftlab.losses.mtp import step_weights
from draftlab.models.mtp import MtpConfig, MtpDrafter, MtpLoss
from tiny import assert_one_line, assert_resumes_bitwise, random_samples, save_checkpoint, write_chat

pytestmark = pytest.mark.usefixtures("one_thread")
REPO = Path(__file__).resolve().parent.parent
ATOL = 1e-5
N_NEW = 16


def _drafter(target, perturb=True, **cfg):
    torch.manual_seed(0)
    d = MtpDrafter.build(MtpConfig(**{"draft_vocab_size": 64, **cfg}), target, random_samples(target, n=4))
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


@pytest.fixture(scope="module")
def trained(tiny_llama):
    """(a module trained 60 steps on the tiny target's own greedy continuations of random prompts,
    those prompts): decoding them, its drafts are accepted, so every verify path is taken."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, tiny_llama.vocab_size, (4,), generator=g) for _ in range(8)]
    ids = torch.stack([torch.tensor(p.tolist() + generate_plain(tiny_llama, p, 44).tokens) for p in prompts])
    samples = [{"input_ids": s, "loss_mask": torch.ones_like(s, dtype=torch.bool)} for s in ids]
    torch.manual_seed(0)
    d = MtpDrafter.build(MtpConfig(draft_vocab_size=96), tiny_llama, samples)
    batch = {"input_ids": ids, "loss_mask": torch.ones_like(ids, dtype=torch.bool), "attention_mask": torch.ones_like(ids)}
    hidden = tiny_llama(ids, layers=d.capture_layers, logits=None).hidden
    opt = torch.optim.AdamW(d.parameters(), lr=1e-2)
    for _ in range(60):
        loss, _ = d.training_loss(batch, hidden, MtpLoss())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return d.eval(), [p.tolist() for p in prompts[:3]]


@pytest.fixture(scope="module")
def tiny_qwen3(tiny_target_dirs):
    from draftlab.models.target import Target

    return Target.load(str(tiny_target_dirs["qwen3"]))


# ---------------------------------------------------------------------------- the recursion
def test_step_weights_are_fastmtps():
    assert step_weights(0.6, 3) == pytest.approx([1 / 1.96, 0.6 / 1.96, 0.36 / 1.96])  # speculators' [0.51, 0.31, 0.18]
    assert step_weights(1.0, 4) == [0.25] * 4 and step_weights(0.5, 1) == [1.0]


def test_the_recursion_feeds_one_module_its_own_output(tiny_llama):
    d = _drafter(tiny_llama)
    ids = _batch(tiny_llama)["input_ids"]
    L = tiny_llama.num_layers
    hidden = tiny_llama(ids, layers=d.capture_layers, logits=None).hidden
    states, tokens = [], []
    hooks = [d.hidden_layernorm.register_forward_hook(lambda m, args, out: states.append(args[0])),
             d.token_layernorm.register_forward_hook(lambda m, args, out: tokens.append(args[0]))]
    with torch.no_grad():
        outs = [h for _, h in d.recurse(ids, hidden, 3)]
    for h in hooks:
        h.remove()
    # step k reads step k-1's output (the target's last hidden state at step 1) and token x_{t+k}
    assert len(states) == 3 and torch.equal(states[0], hidden[L])
    assert all(torch.equal(states[k], outs[k - 1]) for k in (1, 2))
    assert all(torch.equal(tokens[k], d.embed(shift_left(ids, 1 + k))) for k in range(3))
    # one module for every step: one decoder layer, its parameters the only ones, whatever K
    assert len(d.layers) == 1 and not any(p.requires_grad is False for p in d.parameters())
    assert sum(p.numel() for p in d.parameters()) == sum(p.numel() for p in MtpDrafter.from_meta(d.meta(), tiny_llama).parameters())
    # each step is a function of the one before: changing step 1's input state changes step 3
    with torch.no_grad():
        moved = [h for _, h in d.recurse(ids, {L: hidden[L] + 0.5}, 3)]
    assert not torch.allclose(moved[2], outs[2])


def test_the_loss_mixes_the_steps_with_fastmtps_weights(tiny_llama):
    d = _drafter(tiny_llama)
    batch = _batch(tiny_llama)
    hidden = tiny_llama(batch["input_ids"], layers=d.capture_layers, logits=None).hidden
    with torch.no_grad():
        for beta, weights in ((0.6, [1 / 1.96, 0.6 / 1.96, 0.36 / 1.96]), (1.0, [1 / 3] * 3)):
            loss, m = d.training_loss(batch, hidden, MtpLoss(steps=3, step_decay=beta))
            assert float(loss) == pytest.approx(sum(w * s for w, s in zip(weights, m["loss_steps"])), rel=1e-5)
        # the step losses do not depend on K (step k sees the same inputs), nor on beta
        _, m4 = d.training_loss(batch, hidden, MtpLoss(steps=4, step_decay=0.6))
    assert m4["loss_steps"][:3] == pytest.approx(m["loss_steps"], rel=1e-5) and len(m4["acc"]) == 4


@pytest.mark.parametrize("kind", ["ce", "nla", "lk_hybrid"])
def test_training_lowers_the_loss_of_every_step(kind, tiny_llama):
    d = _drafter(tiny_llama, perturb=False).train()
    batch = _batch(tiny_llama)
    hidden = tiny_llama(batch["input_ids"], layers=d.capture_layers, logits=None).hidden
    opt = torch.optim.AdamW(d.parameters(), lr=3e-3)
    first = None
    for _ in range(12):
        loss, metrics = d.training_loss(batch, hidden, MtpLoss(kind=kind))
        opt.zero_grad()
        loss.backward()
        opt.step()
        first = first or metrics
    assert len(metrics["acc"]) == 3 and all(b < a for a, b in zip(first["loss_steps"], metrics["loss_steps"])), (first, metrics)


def test_the_first_step_is_the_proposers_first_draft(tiny_llama):
    d = _drafter(tiny_llama)
    ids = random_samples(tiny_llama, n=1, T=20, seed=5)[0]["input_ids"][None]
    hidden = tiny_llama(ids, layers=d.capture_layers, logits=None).hidden
    with torch.no_grad():
        first = next(d.recurse(ids, hidden, 1))[1]
    p = MtpProposer(d)
    for t in (0, 7, 15):  # after x_0..x_t and the target's next token x_{t+1}
        p.start(ids[0, : t + 1], {i: h[:, : t + 1] for i, h in hidden.items()}, int(ids[0, t + 1]))
        assert (p.last_logits - d.head(first[0, t])).abs().max() < ATOL, t


# ---------------------------------------------------------------------------- decoding
STATIC = StaticTree([(0,), (1,), (0, 0), (0, 1), (0, 0, 0)])


@pytest.mark.parametrize("shape", [Chain(3), Chain(3, min_confidence=0.05), DynamicTree(3, 2, 8), STATIC], ids=str)
def test_greedy_decoding_equals_plain(shape, trained, tiny_llama, tmp_path):
    d, prompts = trained
    proposer = load_proposer(save_checkpoint(d, tiny_llama, tmp_path / "ckpt", recipe={"loss": {"steps": 3}}), tiny_llama, shape)
    assert isinstance(proposer, MtpProposer) and proposer.trained_depth == 3
    spec = SpeculativeDecoder(tiny_llama, proposer).generate(torch.tensor(prompts[0]), N_NEW, shape=shape)
    assert spec.tokens == generate_plain(tiny_llama, torch.tensor(prompts[0]), N_NEW).tokens
    assert sum(spec.accept_lengths) > 0  # drafts were accepted: the accepting paths ran


@pytest.mark.parametrize("shape", [Chain(3), DynamicTree(3, 2, 8)], ids=str)
def test_a_batch_decodes_as_each_row_alone(shape, trained, tiny_llama):
    d, prompts = trained
    res = Decoder(tiny_llama, MtpProposer(d)).generate(prompts, N_NEW, shape)
    assert [r.tokens for r in res.rows] == [generate_plain(tiny_llama, torch.tensor(p), N_NEW).tokens for p in prompts]
    assert sum(sum(r.accept_lengths) for r in res.rows) > 0


@pytest.mark.parametrize("shape", [Chain(3), DynamicTree(3, 2, 8)], ids=str)
def test_the_device_loop_equals_the_host_loop(shape, trained, tiny_llama):
    d, prompts = trained
    proposer = MtpProposer(d)
    host = Decoder(tiny_llama, proposer, loop="host").generate(prompts, N_NEW, shape)
    dev = Decoder(tiny_llama, proposer, loop="device").generate(prompts, N_NEW, shape)
    assert [r.tokens for r in dev.rows] == [r.tokens for r in host.rows]
    assert [r.accept_lengths for r in dev.rows] == [r.accept_lengths for r in host.rows]
    assert sum(sum(r.accept_lengths) for r in host.rows) > 0


# ---------------------------------------------------------------------------- export
def test_speculators_loads_the_export_strictly_and_its_recursion_matches(tiny_qwen3, tmp_path):
    core = pytest.importorskip("speculators.models.mtp.core")
    from speculators import SpeculatorModelConfig

    target = tiny_qwen3
    d = _drafter(target, draft_vocab_size=0)
    out = export_checkpoint(save_checkpoint(d, target, tmp_path / "ckpt"), "vllm", tmp_path / "vllm", target, ExportOptions(speculative_tokens=3))
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "mtp" and config["num_nextn_predict_layers"] == 1
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3

    cfg = SpeculatorModelConfig.from_pretrained(str(out))  # speculators' own reader picks the class
    assert type(cfg).__name__ == "MTPSpeculatorConfig" and cfg.num_speculative_steps == 3
    m = core.MTPDraftModel(cfg).eval()
    exported = load_file(out / "model.safetensors")
    filled = {"embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight"}  # the verifier's, which speculators loads
    assert set(m.state_dict()) - set(exported) == filled and set(exported) <= set(m.state_dict())
    head = target.lm_head.weight.detach()
    m.load_state_dict({**exported, "embed_tokens.weight": target.embed_tokens.weight.detach(), "lm_head.weight": head,
                       "verifier_lm_head.weight": head}, strict=True)

    ids = random_samples(target, n=1, T=24, seed=7)[0]["input_ids"][None]
    hidden = target(ids, layers=d.capture_layers, logits=None).hidden
    with torch.no_grad():
        theirs, _, _ = m(input_ids=ids, hidden_states=hidden[target.num_layers])  # its FastMTP training forward, 3 steps
        ours = [d.head(h) for _, h in d.recurse(ids, hidden, 3)]
    n = theirs[0].shape[1]  # it runs the positions every step can score
    assert len(theirs) == 3 and n == 24 - 3 - 1
    assert max((a[0] - b[0, :n]).abs().max().item() for a, b in zip(theirs, ours)) <= ATOL
    # its own loader (the verifier's embedding and lm_head read from the tiny target's directory) drafts the same
    loaded = core.MTPDraftModel.from_pretrained(str(out)).eval()
    with torch.no_grad():
        again, _, _ = loaded(input_ids=ids, hidden_states=hidden[target.num_layers])
    assert all(torch.equal(a, b) for a, b in zip(again, theirs))

    back = import_checkpoint(out, "speculators-mtp", tmp_path / "back", target)
    d2, _ = ckpt.load_drafter(back, target)
    a, b = d.export_state_dict(), d2.export_state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_draftlab_check_drafts_the_chains_with_speculators_model(tiny_qwen3, tmp_path):
    pytest.importorskip("speculators.models.mtp.core")
    from draftlab.export.check import check_export

    d = _drafter(tiny_qwen3, draft_vocab_size=0)
    c = save_checkpoint(d, tiny_qwen3, tmp_path / "ckpt")
    out = export_checkpoint(c, "vllm", tmp_path / "vllm", tiny_qwen3, ExportOptions(speculative_tokens=3))
    report = check_export(out, c, tiny_qwen3, speculative_tokens=3, data=str(write_chat(tmp_path / "chat.jsonl", 4)), num_prompts=2,
                          max_new_tokens=8, print_fn=lambda _: None)
    assert report.peer is not None and report.steps > 0 and report.worst_logit_diff <= 1e-4


def test_a_target_no_engine_serves_is_refused_and_exported_in_draftlabs_layout(tiny_llama, tiny_qwen3, tmp_path):
    cases = [(tiny_llama, dict(draft_vocab_size=0), r"--to vllm: no engine serves an MTP module for a llama target .*--to hf"),
             (tiny_qwen3, dict(), r"--to vllm: .* draft_vocab_size=64 of 400; retrain with drafter.draft_vocab_size=0"),
             (tiny_qwen3, dict(draft_vocab_size=0, num_layers=2), r"--to vllm: .* num_layers=2; retrain with drafter.num_layers=1")]
    for i, (target, cfg, says) in enumerate(cases):
        c = save_checkpoint(_drafter(target, **cfg), target, tmp_path / f"ckpt{i}")
        with pytest.raises(DraftlabError) as e:
            export_checkpoint(c, "vllm", tmp_path / f"out{i}", target)
        assert_one_line(e, says)
        assert not (tmp_path / f"out{i}").exists()
    d = _drafter(tiny_llama)
    out = export_checkpoint(save_checkpoint(d, tiny_llama, tmp_path / "llama"), "hf", tmp_path / "hf", tiny_llama)
    d2, meta = ckpt.load_drafter(out, tiny_llama)
    assert meta["algorithm"] == "mtp" and all(torch.equal(v, d2.export_state_dict()[k]) for k, v in d.export_state_dict().items())


@pytest.mark.parametrize("edit, says", [
    (lambda c: c.update(speculators_model_type="eagle3"), "speculators_model_type is 'eagle3', expected 'mtp'"),
    (lambda c: c.update(num_nextn_predict_layers=2), "num_nextn_predict_layers = 2"),
    (lambda c: c["transformer_layer_config"].update(num_hidden_layers=3, layer_types=["full_attention"] * 3),
     "num_hidden_layers 3 is not the target's 4"),
    (lambda c: c["transformer_layer_config"].update(vocab_size=500), "transformer_layer_config.vocab_size 500 != target vocab 400"),
])
def test_import_refuses_what_the_drafter_cannot_be(edit, says, tiny_qwen3, tmp_path):
    d = _drafter(tiny_qwen3, perturb=False, draft_vocab_size=0)
    out = export_checkpoint(save_checkpoint(d, tiny_qwen3, tmp_path / "ckpt"), "vllm", tmp_path / "vllm", tiny_qwen3)
    config = json.loads((out / "config.json").read_text())
    edit(config)
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(DraftlabError) as e:
        import_checkpoint(out, "speculators-mtp", tmp_path / "back", tiny_qwen3)
    assert_one_line(e, re.escape(says))
    assert not (tmp_path / "back").exists()


# ---------------------------------------------------------------------------- schema, recipe, trainer
@pytest.mark.parametrize("field, value, says", [
    ("draft_vocab_size", 401, "drafter.draft_vocab_size = 401 is outside 1..400 (at most the target vocabulary)"),
    ("draft_vocab_size", True, "drafter.draft_vocab_size = true is not an integer"),
    ("num_layers", 5, "drafter.num_layers = 5 is outside 1..4 (at most the target's layers)"),
    ("num_target_layers", 3, "drafter.num_target_layers = 3 is not the target's number of layers 4"),
    ("aux_layers", [1], "drafter.aux_layers is not a field of mtp drafter meta"),
])
def test_meta_schema_rejects_bad_fields(field, value, says, tiny_llama):
    meta = _drafter(tiny_llama, perturb=False).meta()
    meta[field] = value
    with pytest.raises(DraftlabError) as e:
        MtpDrafter.check_meta(meta, tiny_llama, "ckpt")
    assert_one_line(e, re.escape(says))


def _recipe(tmp_path: Path, target_dir, name: str, **edits) -> Path:
    recipe = {
        "algorithm": "mtp",
        "output_dir": str(tmp_path / name),
        "target": {"model": str(target_dir)},
        "data": {"source": str(write_chat(tmp_path / "chat.jsonl", 30)), "max_length": 96, "heldout": 4},
        "drafter": {"num_layers": 1, "draft_vocab_size": 64},
        "loss": {"steps": 3, "step_decay": 0.6},
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
    ("loss", {"step_decay": 0}, "loss.step_decay: Input should be greater than 0"),
    ("loss", {"step_decay": -0.5}, "loss.step_decay: Input should be greater than 0"),
    ("loss", {"step_decay": 1.5}, "loss.step_decay: Input should be less than or equal to 1"),
    ("loss", {"steps": 0}, "loss.steps: Input should be greater than or equal to 1"),
    ("loss", {"ttt_steps": 2}, "loss.ttt_steps: Extra inputs are not permitted"),
    ("drafter", {"draft_vocab_size": -1}, "drafter.draft_vocab_size: Input should be greater than or equal to 0"),
    ("drafter", {"num_layers": 0}, "drafter.num_layers: Input should be greater than or equal to 1"),
    ("drafter", {"aux_layers": [1, 2]}, "drafter.aux_layers: Extra inputs are not permitted"),
])
def test_recipe_refuses_bad_fields_in_one_line(section, values, says, tiny_target_dirs, tmp_path):
    from draftlab.recipe import load_recipe

    path = _recipe(tmp_path, tiny_target_dirs["llama"], "bad", **{section: values})
    with pytest.raises(DraftlabError) as e:
        load_recipe(path)
    assert_one_line(e, re.escape(says))
    _, _, loss = load_recipe(_recipe(tmp_path, tiny_target_dirs["llama"], "edge", loss={"step_decay": 1.0})).algorithm_configs()
    assert loss.step_decay == 1.0  # beta = 1: every step weighs the same


def test_the_shipped_recipe_is_a_k3_mtp_run():
    from draftlab.recipe import load_recipe

    r = load_recipe(REPO / "recipes" / "smollm2-135m-mtp.yaml")
    algo, cfg, loss = r.algorithm_configs()
    assert algo is MtpDrafter and r.target.model == "default" and (loss.steps, loss.step_decay) == (3, 0.6)
    assert (r.eval.method, r.eval.k) == ("chain", 3) and cfg.num_layers == 1


@pytest.mark.slow  # the shared trainer's resume is in the default suite (test_train.py); this family's with -m slow
def test_the_shared_trainer_trains_reports_and_resumes_a_killed_run(tiny_target_dirs, tmp_path):
    straight = _recipe(tmp_path, tiny_target_dirs["llama"], "straight")
    killed = _recipe(tmp_path, tiny_target_dirs["llama"], "killed", eval={"enabled": False})
    a = assert_resumes_bitwise("mtp", straight, killed)
    metrics = [json.loads(line) for line in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()]
    losses = [m["loss"] for m in metrics if "loss" in m]
    assert len(losses) == 4 and all(len(m["loss_steps"]) == 3 for m in metrics if "loss_steps" in m)
    report = json.loads((tmp_path / "straight" / "eval" / "latest.json").read_text())
    assert report["greedy_match"] == "2/2" and report["step"] == 4 and len(report["alpha"]) == 3
