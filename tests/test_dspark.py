"""The DSpark family on the tiny random targets: a few training steps lower every term of its loss,
the training block (teacher-forced previous tokens) equals the decoding block (drafted previous
tokens), greedy decoding equals plain decoding with and without the confidence cut, the export
loads strictly in speculators' DSparkDraftModel with the same logits and confidences, round
trips, and bad metadata, recipes and imports are one-line errors."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from draftlab import checkpoint as ckpt
from draftlab.errors import DraftlabError
from draftlab.export.exporter import export_checkpoint
from draftlab.export.importer import import_checkpoint
from draftlab.inference.decoder import Decoder, SpeculativeDecoder, generate_plain
from draftlab.inference.decoding_spec import DecodingSpec, check_spec
from draftlab.inference.dspark import DSparkProposer
from draftlab.inference.proposer import load_proposer
from draftlab.inference.shapes import Block
from draftlab.models.dspark import DSparkConfig, DSparkDrafter, DSparkLoss
from tiny import assert_one_line, assert_resumes_bitwise, edit_checkpoint, random_samples, save_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")

LAYERS = [1, 3]  # distinct, ascending, capturable: what serving engines accept
P = 9  # block anchor of the export comparison


def _drafter(target, vd=0, kind="vanilla", rank=8, perturb=True):
    d = DSparkDrafter.build(
        DSparkConfig(num_layers=2, block_size=4, target_layers=LAYERS, draft_vocab_size=vd, markov_rank=rank, markov_head_type=kind),
        target, random_samples(target, n=6, T=40),
    )
    if perturb:  # every weight away from its init (W2, o_proj and down_proj start at zero)
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in d.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return d.eval()


def _prompt(target, seed=2, T=12):
    return random_samples(target, n=1, T=T, seed=seed)[0]["input_ids"]


# ---------------------------------------------------------------------------- training
def test_a_few_steps_lower_every_term(tiny_llama):
    t = tiny_llama
    torch.manual_seed(0)
    samples = random_samples(t, n=2, T=24, seed=3)
    batch = {"input_ids": torch.stack([s["input_ids"] for s in samples]), "loss_mask": torch.stack([s["loss_mask"] for s in samples])}
    batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    d = _drafter(t, vd=64, perturb=False).train()
    hidden = t(batch["input_ids"], layers=d.capture_layers, logits=None).hidden
    batch.update(d.derived_targets(hidden, batch))
    cfg = DSparkLoss(anchors=8, l1_weight=0.5)

    def evaluate():
        torch.manual_seed(7)  # the same anchors each time
        with torch.no_grad():
            loss, m = d.training_loss(batch, hidden, cfg)
        return loss.item(), m

    before = evaluate()
    opt = torch.optim.AdamW(d.parameters(), lr=1e-2)
    for _ in range(12):
        loss, _ = d.training_loss(batch, hidden, cfg)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert d.markov_head.markov_w2.weight.abs().max() > 0  # the Markov head trained from its zero start
    after = evaluate()
    assert after[0] < before[0] - 0.5, (before, after)
    for term in ("confidence_bce", "l1"):
        assert after[1][term] < before[1][term], (term, before[1], after[1])
    assert set(before[1]) >= {"acc", "accepted", "confidence_mean", "confidence_abs_error"}


@pytest.mark.parametrize("kind", ["vanilla", "gated"])
def test_training_blocks_are_the_decoding_blocks(tiny_llama, kind):
    """Slot logits and confidences the loss computes for a block anchored at p, fed the tokens the
    proposer drafted as previous tokens, equal the proposer's, slot by slot."""
    t = tiny_llama
    d = _drafter(t, vd=64, kind=kind)
    ids = random_samples(t, n=1, T=30, seed=5)[0]["input_ids"][None]
    hidden = t(ids, layers=d.capture_layers, logits=None).hidden
    p = DSparkProposer(d)
    for anchor in (6, 17):
        p.start(ids[0, :anchor], {i: h[:, :anchor] for i, h in hidden.items()}, int(ids[0, anchor]))
        drafts = p.propose(Block(3)).tokens
        states = d.anchored_states(ids, torch.ones_like(ids), hidden, torch.tensor([[anchor]]))[0, 0, 1:]
        prev = torch.cat([ids[0, anchor : anchor + 1], drafts[:-1]])
        with torch.no_grad():
            logits, conf = d.slot_logits(states, prev)
        assert torch.equal(d.to_target_ids(logits.argmax(-1)), drafts)
        torch.testing.assert_close(logits, d.readout(p.block_states()) + d.markov_head.bias(p.block_states(), d.markov_head.embed(prev)),
                                   rtol=1e-4, atol=1e-4)
        assert (logits - d.readout(states)).abs().max() > 1e-2  # the Markov bias is part of them


# ---------------------------------------------------------------------------- decoding
def test_greedy_equals_plain_with_and_without_the_confidence_cut(tiny_llama):
    t = tiny_llama
    d = _drafter(t, vd=64)
    with torch.no_grad():  # every slot predicts acceptance 0.6: cumulative 0.6, 0.36, 0.216
        d.confidence_head.proj.weight.zero_()
        d.confidence_head.proj.bias.fill_(torch.logit(torch.tensor(0.6)).item())
    prompt = _prompt(t)
    plain = generate_plain(t, prompt, 12).tokens
    for min_confidence, drafted in ((0.0, 3), (0.3, 2), (0.7, 0)):
        res = SpeculativeDecoder(t, DSparkProposer(d)).generate(prompt, 12, Block(3, min_confidence))
        assert res.tokens == plain and set(res.num_drafted) == {drafted}, (min_confidence, res.num_drafted)
    # batched rows draft each row's block as one row does
    rows = Decoder(t, DSparkProposer(d)).generate([prompt.tolist(), _prompt(t, seed=4).tolist()], 8, Block(3, 0.3)).rows
    assert rows[0].tokens == plain[:8] and set(rows[0].num_drafted) == {2}


def test_sampled_drafts_carry_their_conditional_distributions(tiny_llama):
    """Sampling: q_j is the softmax of slot j's logits biased by the token drafted at j - 1."""
    from draftlab.inference.sampling import Sampling

    t = tiny_llama
    d = _drafter(t, vd=64)
    ids = _prompt(t, T=14)[None]
    hidden = t(ids, layers=d.capture_layers, logits=None).hidden
    p = DSparkProposer(d)
    p.configure(Sampling(temperature=1.0, generator=torch.Generator().manual_seed(0)))
    p.start(ids[0, :10], {i: h[:, :10] for i, h in hidden.items()}, int(ids[0, 10]))
    draft = p.propose(Block(3))
    states = p.block_states()
    prev = torch.cat([ids[0, 10:11], draft.tokens[:-1]])
    with torch.no_grad():
        q = torch.softmax(d.slot_logits(states, prev)[0], -1)
    torch.testing.assert_close(draft.probs[:, d.t2d], q, rtol=1e-5, atol=1e-6)
    assert (draft.probs[torch.arange(3), draft.tokens] > 0).all() and draft.probs[:, ~d.t2d].abs().max() == 0


def test_the_cut_is_a_decoding_option_of_blocks():
    assert DecodingSpec(method="block", k=7, min_confidence=0.5).shape() == Block(7, 0.5)
    check_spec(DecodingSpec(method="block", k=7, min_confidence=0.5))
    with pytest.raises(DraftlabError) as e:
        check_spec(DecodingSpec(method="block", k=7, min_confidence=1.5), {"min_confidence": "--min-confidence"})
    assert_one_line(e, r"--min-confidence must be in \[0, 1\), got 1.5")


# ---------------------------------------------------------------------------- export (speculators, strict)
@pytest.fixture(scope="module")
def made(tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("dspark")
    out = {}
    for vd, kind in ((0, "vanilla"), (64, "gated")):
        d = _drafter(tiny_llama, vd, kind)
        c = save_checkpoint(d, tiny_llama, root / f"ckpt{vd}")
        out[vd] = d, c, export_checkpoint(c, "vllm", root / f"vllm{vd}", tiny_llama)
    return out


@pytest.mark.parametrize("vd", [0, 64])
def test_speculators_dspark_loads_the_export_strictly_with_equal_logits(vd, made, tiny_llama):
    spec = pytest.importorskip("speculators.models.dspark")
    from speculators import SpeculatorModelConfig

    d, _, out = made[vd]
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "dspark" and config["speculators_config"]["algorithm"] == "dspark"
    cfg = SpeculatorModelConfig.from_pretrained(str(out))
    assert isinstance(cfg, spec.DSparkSpeculatorConfig) and cfg.sample_from_anchor is False
    assert (cfg.markov_rank, cfg.markov_head_type, cfg.enable_confidence_head) == (8, d.markov_head.kind, True)
    cfg.transformer_layer_config._attn_implementation = "eager"  # no flex-attention compile on CPU
    m, info = spec.DSparkDraftModel.from_pretrained(str(out), config=cfg, output_loading_info=True)
    m.load_verifier_weights()
    m.eval()
    assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"] or info["error_msgs"]), info
    exported, state = load_file(out / "model.safetensors"), m.state_dict()
    from_verifier = {"embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight"} | ({"lm_head.weight"} if vd == 0 else set())
    assert set(state) - set(exported) == from_verifier and set(exported) <= set(state)
    assert all(torch.equal(state[k], v) for k, v in exported.items())

    ids = random_samples(tiny_llama, n=1, T=P + 4, seed=5)[0]["input_ids"][None]
    hidden = tiny_llama(ids, layers=d.capture_layers, logits=None).hidden
    G = d.block_size
    block = ids[:, P : P + G]  # a block of real tokens: each slot's previous token is the one before it
    with torch.no_grad():
        kv = d.context_kv(d.context({i: h[:, :P] for i, h in hidden.items()}), torch.arange(P)[None])
        states = d.block_states(d.block_ids(ids[:, P]), torch.arange(P, P + G)[None], kv, torch.ones(1, G, P + G, dtype=torch.bool))
        prev = torch.cat([block[:, :1], block[:, :-1]], 1)  # speculators' shift for sample_from_anchor false
        ours, our_conf = d.slot_logits(states, prev)
        # speculators' modules step by step, as its forward composes them
        ctx = m.hidden_norm(m.fc(torch.cat([hidden[i][:, :P] for i in cfg.aux_hidden_state_layer_ids], -1)))
        h, pos = m.embed_tokens(d.block_ids(ids[:, P])), torch.arange(P + G)[None]
        pe = m.rotary_emb(h, pos)
        for layer in m.layers:
            h = layer(hidden_states=h, target_hidden=ctx, attention_mask=torch.zeros(1, 1, G, P + G), position_ids=pos, position_embeddings=pe)
        h = m.norm(h)
        emb = m.markov_head.prev_embeddings(prev)
        theirs = m.lm_head(h) + m.markov_head.block_bias(prev_token_ids=prev, hidden_states=h, prev_emb=emb)
        their_conf = m.confidence_head(torch.cat([h, emb], -1))
    torch.testing.assert_close(ours[:, 1:], theirs[:, 1:], rtol=1e-5, atol=1e-5)  # slot 0 (the anchor) drafts nothing
    torch.testing.assert_close(our_conf[:, 1:], their_conf[:, 1:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("vd", [0, 64])
def test_round_trip_is_bit_exact(vd, made, tiny_llama, tmp_path):
    d, c, out = made[vd]
    back = import_checkpoint(out, "speculators-dspark", tmp_path / "imported", tiny_llama)
    d2, meta = ckpt.load_drafter(back, tiny_llama)
    assert meta["algorithm"] == "dspark"
    ref = d.export_state_dict()
    assert all(torch.equal(v, d2.state_dict()[k]) for k, v in ref.items())
    assert load_proposer(back, tiny_llama, Block(3, 0.3)).name == "dspark"


def test_sglang_takes_the_same_layout(made, tiny_llama, tmp_path):
    d, c, out = made[0]
    again = export_checkpoint(c, "sglang", tmp_path / "sglang", tiny_llama)
    assert json.loads((again / "config.json").read_text()) == json.loads((out / "config.json").read_text())
    assert "DSPARK" in (again / "README.md").read_text()


# ---------------------------------------------------------------------------- one-line errors
@pytest.mark.parametrize(
    "edit,match",
    [
        (dict(meta=lambda m: m.update(markov_rank=0)), r"drafter\.markov_rank = 0 is outside 1\.\.400"),
        (dict(meta=lambda m: m.update(markov_rank=True)), r"drafter\.markov_rank = true is not an integer"),
        (dict(meta=lambda m: m.update(markov_head_type="rnn")), r"drafter\.markov_head_type = \"rnn\""),
        (dict(meta=lambda m: m.pop("markov_rank")), "drafter meta lacks 'markov_rank'"),
        (dict(meta=lambda m: m.update(confidence=True)), r"drafter\.confidence is not a field of dspark drafter meta"),
        (dict(weights=lambda s: s.pop("confidence_head.proj.weight")), r"confidence_head\.proj\.weight"),
    ],
)
def test_bad_checkpoints_are_one_line_errors(edit, match, made, tiny_llama, tmp_path):
    import shutil

    path = tmp_path / "ckpt"
    shutil.copytree(made[64][1], path)
    edit_checkpoint(path, **edit)
    with pytest.raises(DraftlabError) as e:
        ckpt.load_drafter(path, tiny_llama)
    assert_one_line(e, match)


@pytest.mark.parametrize(
    "override,match",
    [("drafter.markov_rank=0", "drafter.markov_rank: Input should be greater than or equal to 1"),
     ("drafter.markov_head_type=rnn", "drafter.markov_head_type: Input should be 'vanilla' or 'gated'"),
     ("loss.confidence_weight=-1", "loss.confidence_weight: Input should be greater than or equal to 0"),
     ("loss.l1=0.1", "loss.l1: Extra inputs are not permitted")],
)
def test_bad_recipes_are_one_line_errors(tmp_path, override, match):
    from draftlab.recipe import load_recipe

    path = tmp_path / "r.yaml"
    path.write_text(f"algorithm: dspark\noutput_dir: {tmp_path / 'run'}\n")
    load_recipe(path)  # the defaults are a valid dspark recipe
    with pytest.raises(DraftlabError) as e:
        load_recipe(path, [override])
    assert_one_line(e, match)


@pytest.mark.parametrize(
    "change,match",
    [(dict(sample_from_anchor=True), "sample_from_anchor is true"), (dict(markov_head_type="rnn"), "markov_head_type 'rnn' is not implemented"),
     (dict(markov_rank=0), "markov_rank must be a positive integer"), (dict(enable_confidence_head=False), "enable_confidence_head = False"),
     (dict(speculators_model_type="dflash"), "expected 'dspark'")],
)
def test_bad_imports_are_one_line_errors(change, match, made, tiny_llama, tmp_path):
    import shutil

    src = tmp_path / "src"
    shutil.copytree(made[0][2], src)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(DraftlabError) as e:
        import_checkpoint(src, "speculators-dspark", tmp_path / "out", tiny_llama)
    assert_one_line(e, match)


# ---------------------------------------------------------------------------- the entry point
@pytest.mark.slow
def test_train_entry_point_trains_evaluates_and_exports(tmp_path, tiny_target_dirs):
    """train/dspark.py end to end on the tiny target: memory capture, a checkpoint and its report
    (greedy-exact, every block position), then the checkpoint decodes with the confidence cut."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import yaml

    from draftlab.models.target import Target
    from tiny import write_chat

    repo = Path(__file__).resolve().parent.parent
    recipe = {
        "algorithm": "dspark", "output_dir": str(tmp_path / "run"), "target": {"model": str(tiny_target_dirs["llama"])},
        "drafter": {"num_layers": 1, "block_size": 4, "target_layers": [1, 3], "draft_vocab_size": 64, "markov_rank": 8},
        "loss": {"anchors": 8, "l1_weight": 0.2},
        "data": {"source": str(write_chat(tmp_path / "chat.jsonl", 12, assistant_words=20)), "max_length": 96, "heldout": 2},
        "capture": {"mode": "memory"},
        "train": {"max_steps": 4, "batch_tokens": 512, "checkpoint_every": 4, "warmup_steps": 1, "lr": 1e-2},
        "eval": {"num_prompts": 2, "max_new_tokens": 8, "method": "block", "k": 3, "min_confidence": 0.2},
    }
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    res = subprocess.run([sys.executable, "train/dspark.py", str(tmp_path / "r.yaml")], cwd=repo, capture_output=True, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=1500)
    assert res.returncode == 0, res.stderr[-2000:]
    report = json.loads((tmp_path / "run" / "eval" / "latest.json").read_text())
    assert report["greedy_match"] == "2/2" and report["method"] == "block" and report["min_confidence"] == 0.2
    proposer = load_proposer(tmp_path / "run" / "checkpoints" / "step-0000004", Target.load(str(tiny_target_dirs["llama"])))
    assert isinstance(proposer, DSparkProposer)


@pytest.mark.slow
def test_a_killed_run_resumes_to_the_weights_of_an_uninterrupted_one(tmp_path, tiny_target_dirs):
    """Killed right after its step-2 checkpoint, relaunched with the same command: the step-4
    weights equal a straight run's bit for bit (anchors, Markov head, confidence head and all)."""
    import yaml

    from tiny import write_chat

    data = str(write_chat(tmp_path / "chat.jsonl", 12, assistant_words=20))

    def recipe(name):
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump({
            "algorithm": "dspark", "output_dir": str(tmp_path / name), "target": {"model": str(tiny_target_dirs["llama"])},
            "drafter": {"num_layers": 1, "block_size": 4, "target_layers": [1, 3], "draft_vocab_size": 64, "markov_rank": 8},
            "loss": {"anchors": 8, "l1_weight": 0.2},
            "data": {"source": data, "max_length": 96, "heldout": 2},
            "capture": {"mode": "memory"},
            "train": {"max_steps": 4, "batch_tokens": 512, "checkpoint_every": 2, "warmup_steps": 1, "lr": 1e-2},
            "eval": {"enabled": False},
        }))
        return tmp_path / f"{name}.yaml"

    assert_resumes_bitwise("dspark", recipe("straight"), recipe("killed"))
