"""The Domino family on the tiny random targets: the correction applies from pure_draft_prefix_len
on, its GRU reads exactly the block's previous tokens (teacher-forced in training, the realised
drafts in decoding), the base-anchored lambda schedule, training lowers the loss, greedy decoding
equals plain decoding (one row, a batch, the device loop, with and without the correction),
sampled drafts carry their conditional distributions and decode as the target samples, the
export loads strictly in SpecForge's DominoDraftModel with the same drafts and logits, round
trips, passes ``export --check``, and bad recipes, checkpoints and imports are one-line errors."""

from __future__ import annotations

import json
import shutil
from collections import Counter

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftlab import checkpoint as ckpt
from draftlab.errors import DraftlabError
from draftlab.export.exporter import export_checkpoint
from draftlab.export.importer import import_checkpoint
from draftlab.inference.decoder import Decoder, SpeculativeDecoder, generate_plain
from draftlab.inference.domino import DominoProposer
from draftlab.inference.proposer import load_proposer
from draftlab.inference.shapes import Block
from draftlab.models.domino import DominoConfig, DominoDrafter, DominoLoss
from tiny import (assert_follows_target, assert_one_line, assert_resumes_bitwise, edit_checkpoint, random_samples, save_checkpoint,
                  spy_drafts)

pytestmark = pytest.mark.usefixtures("one_thread")

LAYERS = [1, 3]  # distinct, ascending, capturable: what serving engines accept
TEXTS = ["The quick brown fox", "Once upon a time, in a land far away, there lived", "1 2 3"]
N_NEW = 12


@pytest.fixture(autouse=True)
def _no_gemm_packing(monkeypatch):
    # the proposers' CPU GEMM packing (and its seconds-long MKL timing probe) is beside the point here
    monkeypatch.setattr("draftlab.inference.diffusion.decoding_copy", lambda m: m)


def _drafter(target, vd=0, prefix=1, block_size=4, perturb=True):
    d = DominoDrafter.build(
        DominoConfig(num_layers=2, block_size=block_size, target_layers=LAYERS, draft_vocab_size=vd, gru_hidden_dim=16, emb_dim=8,
                     pure_draft_prefix_len=prefix),
        target, random_samples(target, n=6, T=40),
    )
    if perturb:  # every weight away from its init (embed_proj.2, o_proj and down_proj start at zero)
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in d.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.3)
    return d.eval()


def _strong(d):
    """``d`` with a correction as strong as its base logits: it changes greedy drafts."""
    with torch.no_grad():
        d.embed_proj[2].weight.mul_(10)
    return d


def _context(target, d, T=30, seed=5):
    ids = random_samples(target, n=1, T=T, seed=seed)[0]["input_ids"][None]
    return ids, target(ids, layers=d.capture_layers, logits=None).hidden


def _batch(target, d, seed=3):
    samples = random_samples(target, n=2, T=24, seed=seed)
    batch = {"input_ids": torch.stack([s["input_ids"] for s in samples]), "loss_mask": torch.stack([s["loss_mask"] for s in samples])}
    batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    hidden = target(batch["input_ids"], layers=d.capture_layers, logits=None).hidden
    batch.update(d.derived_targets(hidden, batch))
    return batch, hidden


# ---------------------------------------------------------------------------- the correction
@pytest.mark.parametrize("prefix", [0, 1, 2])
def test_the_correction_applies_from_the_prefix_length_on(tiny_llama, prefix):
    d = _drafter(tiny_llama, vd=64, prefix=prefix)
    states = torch.randn(2, 3, tiny_llama.hidden_size)
    prev = torch.randint(0, tiny_llama.vocab_size, (2, 3))
    with torch.no_grad():
        base, final = d.readout(states), d.slot_logits(states, prev)
    assert torch.equal(final[:, :prefix], base[:, :prefix])
    for j in range(prefix, 3):
        assert (final[:, j] - base[:, j]).abs().min() > 0, j  # every row and token is corrected


def test_the_gru_reads_the_tokens_before_each_position_only(tiny_llama):
    """Position j's logits change with prev[..., :j + 1] and with nothing after it."""
    d = _drafter(tiny_llama, vd=64, prefix=0)
    states = torch.randn(1, 3, tiny_llama.hidden_size)
    prev = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        ref = d.slot_logits(states, prev)
        for i in range(3):
            changed = prev.clone()
            changed[0, i] = 11
            out = d.slot_logits(states, changed)
            assert torch.equal(out[:, :i], ref[:, :i]), i
            assert (out[:, i:] - ref[:, i:]).abs().amax(-1).min() > 0, i


def test_training_teacher_forces_the_tokens_accepted_drafts_hold(tiny_llama, monkeypatch):
    """The loss's previous tokens of a block anchored at p are [x_p, the target's greedy tokens
    x*_{p+1}, ...]: what slots 1.. hold once their drafts are accepted."""
    d = _drafter(tiny_llama, vd=64).train()
    batch, hidden = _batch(tiny_llama, d)
    seen = {}
    anchors_of, logits_of = d.sample_anchors, d.slot_logits
    monkeypatch.setattr(d, "sample_anchors", lambda *a: seen.setdefault("anchors", anchors_of(*a)))
    monkeypatch.setattr(d, "slot_logits", lambda s, prev, base=None: (seen.setdefault("prev", prev), logits_of(s, prev, base))[1])
    d.training_loss(batch, hidden, DominoLoss(anchors=4))
    (anchors, real), prev = seen["anchors"], seen["prev"]
    ids, greedy = batch["input_ids"], batch["target_argmax"]
    for b in range(2):
        for a in range(4):
            p = int(anchors[b, a])
            if real[b, a] and p + 3 < ids.shape[1]:
                assert prev[b, a].tolist() == [int(ids[b, p]), int(greedy[b, p]), int(greedy[b, p + 1])], (b, a)


def test_training_blocks_are_the_decoding_blocks(tiny_llama, monkeypatch):
    """Decoding feeds the GRU the verified token and then each realised draft; the logits the loss
    computes for a block at p, teacher-forced with those drafts, are the proposer's, position by position."""
    t = tiny_llama
    d = _drafter(t, vd=64)
    ids, hidden = _context(t, d)
    p = DominoProposer(d)
    fed, step = [], d.gru_step
    monkeypatch.setattr(d, "gru_step", lambda tokens, state: (fed.append(tokens.tolist()), step(tokens, state))[1])
    for anchor in (6, 17):
        fed.clear()
        p.start(ids[0, :anchor], {i: h[:, :anchor] for i, h in hidden.items()}, int(ids[0, anchor]))
        drafts = p.propose(Block(3)).tokens
        assert fed == [[int(ids[0, anchor])], [int(drafts[0])], [int(drafts[1])]]  # nothing else, in this order
        prev = torch.cat([ids[0, anchor : anchor + 1], drafts[:-1]])
        with torch.no_grad():
            states = d.anchored_states(ids, torch.ones_like(ids), hidden, torch.tensor([[anchor]]))[0, 0, 1:]
            ours = d.slot_logits(states, prev)
            gru = [step(prev[:1], None)]  # the decoding path: one GRU step per token, the correction from position 1 on
            for token in prev[1:]:
                gru.append(step(token[None], gru[-1]))
            served = d.readout(p.block_states())
            served[1:] += d.correction(p.block_states()[1:], torch.cat(gru[1:]))
        assert torch.equal(d.to_target_ids(ours.argmax(-1)), drafts)
        torch.testing.assert_close(ours, served, rtol=1e-4, atol=1e-4)
        assert (ours[1:] - d.readout(states)[1:]).abs().max() > 1e-2  # the correction is part of them


# ---------------------------------------------------------------------------- the objective
def test_the_base_anchored_schedule(tiny_llama):
    d = _drafter(tiny_llama)
    cfg = DominoLoss()
    assert d.base_weight(cfg) == 0.0  # outside training: the final logits alone
    lams = []
    for step in range(12):
        d.set_progress(step, 10)
        lams.append(d.base_weight(cfg))
    assert lams == pytest.approx([1.0, 0.8, 0.6, 0.4, 0.2] + [0.0] * 7)
    d.set_progress(3, 10)
    assert d.base_weight(DominoLoss(lambda_start=0.5, lambda_decay=1.0)) == pytest.approx(0.35)


def test_the_loss_mixes_final_and_base_by_lambda(tiny_llama):
    t = tiny_llama
    d = _drafter(t, vd=64).train()
    batch, hidden = _batch(t, d)
    cfg = DominoLoss(anchors=4)
    grads = {}
    for step, lam in ((0, 1.0), (3, 0.25), (4, 0.0)):
        d.set_progress(step, 8)
        d.zero_grad()
        torch.manual_seed(7)  # the same anchors each time
        loss, m = d.training_loss(batch, hidden, cfg)
        loss.backward()
        assert m["lambda"] == lam and loss.item() == pytest.approx((1 - lam) * m["final_loss"] + lam * m["base_loss"], rel=1e-6)
        assert m["final_loss"] != pytest.approx(m["base_loss"])
        grads[lam] = d.embed_proj[2].weight.grad.abs().max().item()
    assert grads[1.0] == 0.0 and grads[0.25] > 0 and grads[0.0] > 0  # lambda 1 trains the backbone alone


def test_a_few_steps_lower_the_loss(tiny_llama):
    t = tiny_llama
    torch.manual_seed(0)
    d = _drafter(t, vd=64, perturb=False).train()
    batch, hidden = _batch(t, d)
    cfg = DominoLoss(anchors=8)

    def evaluate():
        torch.manual_seed(7)
        with torch.no_grad():
            return d.training_loss(batch, hidden, cfg)[1]

    before = evaluate()
    assert before["final_loss"] == pytest.approx(before["base_loss"])  # the zero output layer: no correction yet
    opt = torch.optim.AdamW(d.parameters(), lr=1e-2)
    for step in range(12):
        d.set_progress(step, 12)
        loss, _ = d.training_loss(batch, hidden, cfg)
        opt.zero_grad()
        loss.backward()
        opt.step()
    d.progress = None
    after = evaluate()
    assert d.embed_proj[2].weight.abs().max() > 0
    assert after["final_loss"] < before["final_loss"] - 0.5 and after["base_loss"] < before["base_loss"], (before, after)
    assert set(before) >= {"acc", "accepted", "base_acc", "base_accepted", "lambda"}


# ---------------------------------------------------------------------------- decoding
@pytest.mark.parametrize("correction", [True, False])
def test_greedy_equals_plain_and_a_batch_decodes_as_each_row(tiny_llama, prompts, alone, correction):
    t = tiny_llama
    d = _drafter(t, vd=64)
    res = SpeculativeDecoder(t, DominoProposer(d, correction=correction)).generate(torch.tensor(prompts[0]), N_NEW, Block(3))
    assert res.tokens == alone[0] and sum(res.num_drafted) > 0
    together = Decoder(t, DominoProposer(d, correction=correction)).generate(prompts, N_NEW, Block(3)).rows
    assert [r.tokens for r in together] == alone
    for row, prompt in zip(together, prompts):  # the same drafts and acceptance as the row decoded alone
        one = Decoder(t, DominoProposer(d, correction=correction)).generate([prompt], N_NEW, Block(3)).rows[0]
        assert row.accept_lengths == one.accept_lengths


def test_the_correction_changes_the_drafts(tiny_llama, prompts):
    d = _strong(_drafter(tiny_llama, vd=64))
    ids = torch.tensor(prompts[1])
    hidden = tiny_llama(ids[None], layers=d.capture_layers, logits=None).hidden
    drafts = []
    for on in (True, False):
        p = DominoProposer(d, correction=on)
        p.start(ids[:-1], {i: h[:, :-1] for i, h in hidden.items()}, int(ids[-1]))
        drafts.append(p.propose(Block(3)).tokens)
    assert drafts[0][0] == drafts[1][0] and not torch.equal(drafts[0], drafts[1])  # the first is the backbone's argmax


def test_the_device_loop_drafts_what_the_host_loop_drafts(tiny_llama, prompts, monkeypatch):
    from draftlab.inference.graphs import GraphedTarget

    proposer = DominoProposer(_strong(_drafter(tiny_llama, vd=64)))
    assert proposer.refuses_on_device(Block(3)) is None
    drafted = spy_drafts(monkeypatch, proposer)
    host = Decoder(tiny_llama, proposer, loop="host").generate(prompts, N_NEW, Block(3))
    dev = Decoder(tiny_llama, proposer, loop="device").generate(prompts, N_NEW, Block(3))
    assert [r.tokens for r in dev.rows] == [r.tokens for r in host.rows]
    assert [r.accept_lengths for r in dev.rows] == [r.accept_lengths for r in host.rows]
    together = [h for h in drafted["host"] if h.shape[0] == 3]
    assert len(together) >= 3
    for step, (h, x) in enumerate(zip(together, drafted["device"])):
        assert torch.equal(h, x), step
    replayed = Decoder(GraphedTarget(tiny_llama, mode="replay"), proposer, loop="device").generate(prompts, N_NEW, Block(3))
    assert [r.tokens for r in replayed.rows] == [r.tokens for r in host.rows]


def test_sampled_drafts_carry_their_conditional_distributions(tiny_llama):
    """Sampling: q_j is the softmax of position j's logits corrected by the GRU over the drafts before it."""
    from draftlab.inference.sampling import Sampling

    t = tiny_llama
    d = _drafter(t, vd=64)
    ids, hidden = _context(t, d, T=14)
    p = DominoProposer(d)
    p.configure(Sampling(temperature=1.0, generator=torch.Generator().manual_seed(0)))
    p.start(ids[0, :10], {i: h[:, :10] for i, h in hidden.items()}, int(ids[0, 10]))
    draft = p.propose(Block(3))
    prev = torch.cat([ids[0, 10:11], draft.tokens[:-1]])
    with torch.no_grad():
        q = torch.softmax(d.slot_logits(p.block_states(), prev), -1)
    torch.testing.assert_close(draft.probs[:, d.t2d], q, rtol=1e-5, atol=1e-6)
    assert (draft.probs[torch.arange(3), draft.tokens] > 0).all() and draft.probs[:, ~d.t2d].abs().max() == 0


@pytest.fixture(scope="module")
def trained(tiny_llama):
    """A drafter trained (lambda 1 -> 0 over the first half) on the target's own greedy
    continuations of 6 prompts: (drafter, prompts, full rows, its final training metrics)."""
    t = tiny_llama
    torch.manual_seed(0)
    prompts = [random_samples(t, n=1, T=6, seed=s)[0]["input_ids"] for s in range(6)]
    rows = [torch.cat([p, torch.tensor(generate_plain(t, p, 40).tokens)]) for p in prompts]
    ids = torch.stack(rows)
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[:, 6:] = True
    batch = {"input_ids": ids, "loss_mask": mask, "attention_mask": torch.ones_like(ids)}
    d = DominoDrafter.build(DominoConfig(num_layers=1, block_size=4, target_layers=LAYERS, draft_vocab_size=0, gru_hidden_dim=16, emb_dim=8),
                            t, [{"input_ids": r, "loss_mask": m} for r, m in zip(rows, mask)])
    hidden = t(ids, layers=d.capture_layers, logits=None).hidden
    batch.update(d.derived_targets(hidden, batch))
    opt, cfg, steps = torch.optim.AdamW(d.parameters(), lr=3e-3), DominoLoss(anchors=40), 200
    for step in range(steps):
        d.set_progress(step, steps)
        loss, _ = d.training_loss(batch, hidden, cfg)
        opt.zero_grad()
        loss.backward()
        opt.step()
    d.progress = None
    with torch.no_grad():
        _, metrics = d.eval().training_loss(batch, hidden, cfg)
    return d, prompts, rows, metrics


def test_trained_accuracy_shows_up_as_acceptance(tiny_llama, trained):
    """Decoding the training prompts accepts about as often as training measured, the correction
    included (a train/serve mismatch of the GRU's inputs shows as high accuracy, low acceptance)."""
    from draftlab.inference.metrics import AcceptanceStats

    d, prompts, rows, metrics = trained
    assert min(metrics["acc"]) > 0.9 and d.embed_proj[2].weight.abs().max() > 0, metrics
    stats = AcceptanceStats()
    for prompt, row in zip(prompts, rows):
        res = SpeculativeDecoder(tiny_llama, DominoProposer(d)).generate(prompt, 40, Block(3))
        assert res.tokens == row[6:].tolist()
        stats.merge(res.stats())
    assert stats.tau > 1 + metrics["accepted"] - 0.3, (metrics, stats.to_dict())


@pytest.mark.parametrize("loop", ["host", "device"])
def test_sampled_decoding_follows_the_target(tiny_llama, trained, loop):
    """Seeded sampled decodings (temperature 1, top-k 3) of 3 tokens with blocks of 2 drafts fit the
    target's exact joint (chi-square, with power against a skewed joint): the host loop drafts
    from the corrected q_j, the device loop greedy point masses."""
    d, prompts, _, _ = trained
    prompt = prompts[0].tolist()
    n, counts, accepted = 400, Counter(), Counter()
    decoder = Decoder(tiny_llama, DominoProposer(d), loop=loop)
    for s in range(n):
        row = decoder.generate([prompt], 3, Block(2), temperature=1.0, top_k=3, seed=s).rows[0]
        counts[tuple(row.tokens)] += 1
        accepted.update(row.accept_lengths[:1])
    assert len(accepted) == 3, accepted  # the first block had 0, 1 and 2 drafts accepted at times
    assert_follows_target(counts, tiny_llama, prompt, 3, 1.0, 3, n)


# ---------------------------------------------------------------------------- one checkpoint, with and without
def test_one_checkpoint_reports_with_and_without_the_correction(tiny_llama, trained, tmp_path):
    """Each report decodes as the proposer with the correction on or off does, greedy output equal
    to plain decoding either way (the trained drafter with its correction scaled up, so the two differ)."""
    from draftlab.inference.decoding_spec import DecodingSpec
    from draftlab.inference.lift import lift
    from draftlab.inference.metrics import AcceptanceStats
    from draftlab.inference.prompts import EvalPrompt

    d, prompts, _, _ = trained
    c = save_checkpoint(d, tiny_llama, tmp_path / "ckpt")
    edit_checkpoint(c, weights=lambda s: s.update({"embed_proj.2.weight": s["embed_proj.2.weight"] * 20}))
    d, _ = ckpt.load_drafter(c, tiny_llama)
    spec = DecodingSpec(method="block", k=3, max_new_tokens=24, baseline=True)
    result = lift(tiny_llama, d, [EvalPrompt(category="chat", prompt_ids=p.tolist(), id=str(i)) for i, p in enumerate(prompts)], spec)
    reports = result["reports"]
    assert result["part"] == "correction" and result["heldout"] is None
    assert all(r["greedy_match"] == f"{len(prompts)}/{len(prompts)}" for r in reports.values())
    for name, on in (("correction", True), ("backbone", False)):
        stats = AcceptanceStats()
        for p in prompts:
            res = SpeculativeDecoder(tiny_llama, DominoProposer(d, correction=on)).generate(
                p, 24, Block(3), eos_token_id=tiny_llama.tokenizer.eos_token_id)
            stats.merge(res.stats())
        assert reports[name]["tau"] == stats.tau and reports[name]["reached"] == list(stats.reached), name
    assert reports["correction"]["reached"] != reports["backbone"]["reached"], reports
    assert result["paired"]["correction"]["diff"][-1] == pytest.approx(reports["correction"]["tau"] - reports["backbone"]["tau"])


# ---------------------------------------------------------------------------- export (SpecForge / SGLang)
@pytest.fixture(scope="module")
def made(tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("domino")
    d = _drafter(tiny_llama, vd=0)
    c = save_checkpoint(d, tiny_llama, root / "ckpt")
    return d, c, export_checkpoint(c, "sglang", root / "sglang", tiny_llama)


def test_specforge_loads_the_export_strictly_and_drafts_the_same(made, tiny_llama):
    sf = pytest.importorskip("specforge.modeling.draft.domino")
    from transformers import Qwen3Config

    from specforge.modeling.draft.dflash import extract_context_feature

    d, _, out = made
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DominoDraftModel"] and config["emb_dim"] == 8
    assert config["dflash_config"] == {"target_layer_ids": [i - 1 for i in LAYERS], "mask_token_id": d.mask_token_id,
                                       "projector_type": "domino", "gru_hidden_dim": 16, "emb_dim": 8, "pure_draft_prefix_len": 1,
                                       "shift_label": False}
    cfg = Qwen3Config(**config)
    cfg._attn_implementation = "eager"
    m = sf.DominoDraftModel(cfg).eval()
    exported = load_file(out / "model.safetensors")
    assert set(exported) == set(m.state_dict())  # SGLang's loader wants exactly these: the sets must agree
    assert {"prefix_gru.weight_ih_l0", "prefix_gru.weight_hh_l0", "embed_proj.0.weight", "embed_proj.2.weight"} <= set(exported)
    m.load_state_dict(exported, strict=True)

    ids, hidden = _context(tiny_llama, d, T=14)
    P, G, hf = 9, d.block_size, tiny_llama.model
    block = d.block_ids(ids[:, P])
    proposer = DominoProposer(d)
    proposer.start(ids[0, :P], {i: h[:, :P] for i, h in hidden.items()}, int(ids[0, P]))
    ours = proposer.propose(Block(G - 1)).tokens
    with torch.no_grad():
        hs = hf(ids, output_hidden_states=True).hidden_states
        h = m(position_ids=torch.arange(P + G)[None], noise_embedding=hf.get_input_embeddings()(block),
              target_hidden=extract_context_feature(hs, m.target_layer_ids)[:, :P])
        theirs = m._sample_draft_tokens(hf, h, block)[0]  # SpecForge's own left-to-right rollout
        done = torch.cat([block[0, :1], theirs])
        their_logits = m.apply_logits_head(hf.lm_head(h)[:, None], hidden_states=h[:, None],
                                           prev_token_embeddings=hf.get_input_embeddings()(done)[None, None])[0, 0, 1:]
        our_logits = d.slot_logits(proposer.block_states(), done[:-1])
    assert torch.equal(ours, theirs)
    torch.testing.assert_close(our_logits, their_logits, rtol=1e-5, atol=1e-5)


def test_round_trip_is_bit_exact(made, tiny_llama, tmp_path):
    d, c, out = made
    back = import_checkpoint(out, "specforge-domino", tmp_path / "imported", tiny_llama)
    d2, meta = ckpt.load_drafter(back, tiny_llama)
    assert meta["algorithm"] == "domino" and meta["drafter"] == d.export_meta()
    ref = d.export_state_dict()
    assert ref.keys() == d2.export_state_dict().keys() and all(torch.equal(v, d2.state_dict()[k]) for k, v in ref.items())
    assert load_proposer(back, tiny_llama, Block(3)).name == "domino"


def test_export_check_drafts_with_specforge(made, tiny_llama, tmp_path):
    pytest.importorskip("specforge.modeling.draft.domino")
    from draftlab.export.check import check_export

    _, c, out = made
    data = tmp_path / "heldout.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": t}]}) + "\n" for t in TEXTS))
    lines = []
    report = check_export(out, c, tiny_llama, data=str(data), num_prompts=2, max_new_tokens=N_NEW, print_fn=lines.append)
    assert report.peer is not None and report.steps > 0 and report.worst_logit_diff < 1e-4
    assert report.ours.stats.tau == report.peer.stats.tau and "SpecForge DominoDraftModel" in "\n".join(lines)
    # an edited correction weight is named
    edited = shutil.copytree(out, tmp_path / "edited")
    state = load_file(edited / "model.safetensors")
    state["embed_proj.2.weight"] = state["embed_proj.2.weight"] * 1.01
    save_file(state, edited / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(DraftlabError) as e:
        check_export(edited, c, tiny_llama, data=str(data), num_prompts=1, print_fn=lambda _: None)
    assert_one_line(e, r"tensor embed_proj\.2\.weight differs from the checkpoint's")


def test_a_bfloat16_export_is_checked_with_the_weights_it_holds(made, tiny_llama, tmp_path):
    """SGLang's Domino path takes bf16 weights: the check compares the peer with draftlab's drafter
    rounded in its export form (fc_input_scale folded into fc, then rounded, as the export holds it)."""
    pytest.importorskip("specforge.modeling.draft.domino")
    from draftlab.export.check import check_export
    from draftlab.export.formats import ExportOptions

    d, c, _ = made
    assert d.fc_input_scale is not None  # a fold to round through
    out = export_checkpoint(c, "sglang", tmp_path / "bf16", tiny_llama, ExportOptions(dtype="bfloat16"))
    assert all(v.dtype == torch.bfloat16 for v in load_file(out / "model.safetensors").values())
    data = tmp_path / "heldout.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": TEXTS[0]}]}) + "\n")
    report = check_export(out, c, tiny_llama, data=str(data), num_prompts=1, max_new_tokens=N_NEW, print_fn=lambda _: None)
    assert report.steps > 0 and report.worst_logit_diff < 1e-4


@pytest.mark.parametrize("vd,prefix,match", [
    (64, 1, r"reduced draft vocabulary \(64 of 400\); train with drafter\.draft_vocab_size=0"),
    (0, 0, r"pure_draft_prefix_len 1 only, this drafter has 0; train with drafter\.pure_draft_prefix_len=1"),
])
def test_exports_sglang_cannot_serve_are_refused(vd, prefix, match, tiny_llama, tmp_path):
    c = save_checkpoint(_drafter(tiny_llama, vd=vd, prefix=prefix), tiny_llama, tmp_path / "ckpt")
    with pytest.raises(DraftlabError) as e:
        export_checkpoint(c, "sglang", tmp_path / "out", tiny_llama)
    assert_one_line(e, match)
    assert not (tmp_path / "out").exists()


def _set(*path, value):
    def edit(config):
        for k in path[:-1]:
            config = config[k]
        config[path[-1]] = value
    return edit


@pytest.mark.parametrize("edit,match", [
    (_set("dflash_config", "shift_label", value=True), r"dflash_config\.shift_label is True; draftlab's block is unshifted"),
    (_set("dflash_config", "projector_type", value="dspark"), r"projector_type is 'dspark', expected 'domino'"),
    (_set("emb_dim", value=9), r"emb_dim 9 differs from dflash_config\.emb_dim 8"),
    (_set("dflash_config", "gru_hidden_dim", value=None), r"missing dflash_config\.gru_hidden_dim"),
    (_set("dflash_config", "gru_hidden_dim", value=12), r"shapes do not match the config: prefix_gru\.weight_ih_l0"),
    (_set("dflash_config", "pure_draft_prefix_len", value=3), r"drafter\.pure_draft_prefix_len = 3 is outside 0\.\.2"),
    (_set("architectures", value=["DFlashDraftModel"]), r"architectures\[0\] is 'DFlashDraftModel', expected 'DominoDraftModel'"),
])
def test_bad_imports_are_one_line_errors(edit, match, made, tiny_llama, tmp_path):
    src = shutil.copytree(made[2], tmp_path / "src")
    config = json.loads((src / "config.json").read_text())
    edit(config)
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(DraftlabError) as e:
        import_checkpoint(src, "specforge-domino", tmp_path / "out", tiny_llama)
    assert_one_line(e, match)
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------- one-line errors
@pytest.mark.parametrize(
    "override,match",
    [("loss.lambda_start=1.5", "loss.lambda_start: Input should be less than or equal to 1"),
     ("loss.lambda_start=-0.1", "loss.lambda_start: Input should be greater than or equal to 0"),
     ("loss.lambda_decay=0", "loss.lambda_decay: Input should be greater than 0"),
     ("loss.lambda_decay=2", "loss.lambda_decay: Input should be less than or equal to 1"),
     ("drafter.gru_hidden_dim=0", "drafter.gru_hidden_dim: Input should be greater than or equal to 1"),
     ("drafter.emb_dim=0", "drafter.emb_dim: Input should be greater than or equal to 1"),
     ("drafter.emb_dim=-4", "drafter.emb_dim: Input should be greater than or equal to 1"),
     ("drafter.pure_draft_prefix_len=-1", "drafter.pure_draft_prefix_len: Input should be greater than or equal to 0"),
     ("drafter.pure_draft_prefix_len=7", r"drafter.pure_draft_prefix_len: must be at most block_size - 2 = 6 \(the block drafts 7\), got 7"),
     ("drafter.gru=4", "drafter.gru: Extra inputs are not permitted")],
)
def test_bad_recipes_are_one_line_errors(tmp_path, override, match):
    from draftlab.recipe import load_recipe

    path = tmp_path / "r.yaml"
    path.write_text(f"algorithm: domino\noutput_dir: {tmp_path / 'run'}\n")
    load_recipe(path)  # the defaults are a valid domino recipe
    with pytest.raises(DraftlabError) as e:
        load_recipe(path, [override])
    assert_one_line(e, match)


@pytest.mark.parametrize(
    "edit,match",
    [
        (dict(meta=lambda m: m.update(pure_draft_prefix_len=3)), r"drafter\.pure_draft_prefix_len = 3 is outside 0\.\.2"),
        (dict(meta=lambda m: m.update(pure_draft_prefix_len=True)), r"drafter\.pure_draft_prefix_len = true is not an integer"),
        (dict(meta=lambda m: m.update(gru_hidden_dim=0)), r"drafter\.gru_hidden_dim = 0 is outside 1\.\.1024"),
        (dict(meta=lambda m: m.pop("emb_dim")), "drafter meta lacks 'emb_dim'"),
        (dict(weights=lambda s: s.pop("prefix_gru.weight_hh_l0")), r"prefix_gru\.weight_hh_l0"),
    ],
)
def test_bad_checkpoints_are_one_line_errors(edit, match, made, tiny_llama, tmp_path):
    path = shutil.copytree(made[1], tmp_path / "ckpt")
    edit_checkpoint(path, **edit)
    with pytest.raises(DraftlabError) as e:
        ckpt.load_drafter(path, tiny_llama)
    assert_one_line(e, match)


# ---------------------------------------------------------------------------- the entry point
def _recipe(tmp_path, name, data, target_dir, **train):
    import yaml

    recipe = {
        "algorithm": "domino", "output_dir": str(tmp_path / name), "target": {"model": str(target_dir)},
        "drafter": {"num_layers": 1, "block_size": 4, "target_layers": [1, 3], "draft_vocab_size": 0, "gru_hidden_dim": 16, "emb_dim": 8},
        "loss": {"anchors": 8},
        "data": {"source": data, "max_length": 96, "heldout": 2},
        "capture": {"mode": "memory"},
        "train": {"max_steps": 4, "batch_tokens": 512, "checkpoint_every": 2, "warmup_steps": 1, "lr": 1e-2, **train},
        "eval": {"num_prompts": 2, "max_new_tokens": 8, "method": "block", "k": 3},
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


@pytest.mark.slow
def test_a_killed_run_resumes_to_the_weights_and_schedule_of_an_uninterrupted_one(tmp_path, tiny_target_dirs):
    """train/domino.py on the tiny target reports each checkpoint by real decoding (greedy equals
    plain); killed right after its step-2 checkpoint and relaunched, it ends with the straight
    run's step-4 weights bit for bit and logs the same lambda at every step (1, 0.5, 0, 0): the
    schedule resumed with the step (a schedule restarted at the relaunch would train steps 3-4 at
    lambda 1 and 0.5, other weights)."""
    from tiny import write_chat

    data = str(write_chat(tmp_path / "chat.jsonl", 12, assistant_words=20))
    target = tiny_target_dirs["llama"]
    assert_resumes_bitwise("domino", _recipe(tmp_path, "straight", data, target), _recipe(tmp_path, "killed", data, target),
                           timeout=900)
    report = json.loads((tmp_path / "straight" / "eval" / "latest.json").read_text())
    assert report["greedy_match"] == "2/2" and report["method"] == "block" and report["step"] == 4
    assert json.loads((tmp_path / "straight" / "eval" / "step-0000002.json").read_text())["greedy_match"] == "2/2"

    def lambdas(run):
        records = [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r["lambda"] for r in records if "lambda" in r}

    assert lambdas("straight") == lambdas("killed") == {1: 1.0, 2: 0.5, 3: 0.0, 4: 0.0}
