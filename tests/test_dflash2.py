"""DFlash2 (models/dflash2.py, losses/dflash2.py, inference/dflash2.py, inference/lift.py,
export/dflash2.py) on the tiny random targets.

* The convolution is the identity at initialisation (the block is the DFlash backbone's), is its
  formula, and stays inside its block; the selector's scores are S(p -> c) = unary[c] +
  <A[p] * P h, B[c]> and its walk picks the best one slot after slot.
* Training lowers the unary and the selector loss; the training block (side by side with others)
  is the decoding block, and its walk the proposer's drafts.
* Greedy decoding equals plain decoding with the selector on and off (which draft differently),
  a batch decodes as each row alone, the device loop drafts what the host loop does, and sampled
  drafts carry q over the K candidates (the decoding keeps the target's distribution).
* The three acceptances of one drafter; bad fields are one-line errors; the served layout
  round-trips and drafts in speculators' DFlash2DraftModel what draftlab drafts; the shared
  trainer trains, reports and resumes a killed run.
"""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from draftlab import checkpoint as ckpt
from draftlab.errors import DraftlabError
from draftlab.export.exporter import export_checkpoint
from draftlab.export.importer import import_checkpoint
from draftlab.inference.decoder import Decoder, SpeculativeDecoder, generate_plain
from draftlab.inference.dflash2 import DFlash2Proposer
from draftlab.inference.proposer import load_proposer
from draftlab.inference.sampling import Sampling
from draftlab.inference.shapes import Block
from draftlab.losses.dflash2 import inject_gold
from draftlab.models.diffusion import DiffusionDrafter
from draftlab.models.dflash2 import DFlash2Config, DFlash2Drafter, DFlash2Loss, GroupedDynamicConv
from tiny import (assert_follows_target, assert_one_line, assert_resumes_bitwise, edit_checkpoint, random_samples, save_checkpoint,
                  spy_drafts, write_chat)

pytestmark = pytest.mark.usefixtures("one_thread")
REPO = Path(__file__).resolve().parent.parent
LAYERS = [1, 3]  # distinct, ascending, capturable: what serving engines accept
TEXTS = ["the quick brown fox", "one two", "a b c d e f g h"]


def _drafter(target, vd=0, perturb=True, top_k=4, **kw):
    torch.manual_seed(0)
    cfg = DFlash2Config(num_layers=2, block_size=4, target_layers=LAYERS, draft_vocab_size=vd, selector_rank=8, selector_top_k=top_k, **kw)
    d = DFlash2Drafter.build(cfg, target, random_samples(target, n=6, T=40))
    if perturb:  # every weight away from its init; the codebooks so far that the walk leaves the unary top-1
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for name, p in d.named_parameters():
                p.add_(torch.randn(p.shape, generator=g) * (1.0 if "codebook" in name else 0.1))
    return d.eval()


def _batch(target, n=2, T=24):
    s = random_samples(target, n=n, T=T, seed=3)
    ids = torch.stack([x["input_ids"] for x in s])
    return {"input_ids": ids, "loss_mask": torch.stack([x["loss_mask"] for x in s]), "attention_mask": torch.ones_like(ids)}


def _context(d, target, ids, p):
    """draftlab's block inputs at anchor ``p`` of ``ids`` [1, T] (the proposer's, after verifying ids[:p + 1])."""
    hidden = target(ids, layers=d.capture_layers, logits=None).hidden
    G = d.block_size
    kv = d.context_kv(d.context({i: h[:, :p] for i, h in hidden.items()}), torch.arange(p)[None])
    return d.block_ids(ids[:, p]), torch.arange(p, p + G)[None], kv, torch.ones(1, G, p + G, dtype=torch.bool)


@pytest.fixture(scope="module")
def drafter(tiny_llama):
    return _drafter(tiny_llama)


@pytest.fixture(scope="module")
def trained(tiny_llama):
    """A drafter trained on the target's own greedy continuations of 6 prompts until every slot's
    draft is right: (drafter, prompts, full rows as samples)."""
    t = tiny_llama
    torch.manual_seed(0)
    prompts = [random_samples(t, n=1, T=6, seed=s)[0]["input_ids"] for s in range(6)]
    rows = [torch.cat([p, torch.tensor(generate_plain(t, p, 40).tokens)]) for p in prompts]
    ids = torch.stack(rows)
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[:, 6:] = True
    batch = {"input_ids": ids, "loss_mask": mask, "attention_mask": torch.ones_like(ids)}
    samples = [{"input_ids": r, "loss_mask": m} for r, m in zip(rows, mask)]
    d = DFlash2Drafter.build(DFlash2Config(num_layers=1, block_size=4, target_layers=LAYERS, selector_rank=8, selector_top_k=8), t, samples)
    hidden = t(ids, layers=d.capture_layers, logits=None).hidden
    batch.update(d.derived_targets(hidden, batch))
    opt = torch.optim.AdamW(d.parameters(), lr=3e-3)
    for _ in range(80):
        loss, _ = d.training_loss(batch, hidden, DFlash2Loss(anchors=40))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return d.eval(), prompts, samples


# ---------------------------------------------------------------------------- the convolution and the selector
@torch.no_grad()
def test_the_convolutions_start_as_the_identity(tiny_llama):
    d = _drafter(tiny_llama, perturb=False)
    x = torch.randn(2, 8, 64)
    for conv in (d.layers[0].attention_conv, d.layers[1].mlp_conv):
        y, delta = conv.prepare(x)
        assert torch.equal(y, x) and torch.equal(conv.finish(x, delta), x)
    ids = random_samples(tiny_llama, n=1, T=14, seed=4)[0]["input_ids"][None]
    block = _context(d, tiny_llama, ids, 9)
    assert torch.equal(d.block_states(*block), DiffusionDrafter.block_states(d, *block))  # the DFlash backbone, exactly


@torch.no_grad()
def test_the_convolution_is_its_formula_and_stays_in_its_block():
    torch.manual_seed(0)
    H, taps, group, G = 8, 3, 4, 4
    conv = GroupedDynamicConv(H, taps, group, G)
    conv.base_kernel.normal_()
    conv.kernel_projection.weight.normal_()
    x = torch.randn(1, 2 * G, H)  # two blocks side by side
    y, delta = conv.prepare(x)
    dyn = conv.kernel_projection(x).view(1, 2 * G, 2, taps, H // group)
    want = torch.zeros_like(x)
    for i in range(2 * G):
        for c in range(H):
            for t in range(taps):
                if i % G >= t:
                    want[0, i, c] += (conv.base_kernel[0, t, c] + dyn[0, i, 0, t, c // group]) * x[0, i - t, c]
    torch.testing.assert_close(y, want)
    torch.testing.assert_close(delta, dyn[:, :, 1])

    def out(z):
        a, dz = conv.prepare(z)
        return conv.finish(a, dz)

    base = out(x)
    last = x.clone()
    last[0, G - 1] += 1.0  # block 0's last slot: nothing of block 1 moves
    moved = out(last)
    assert torch.equal(moved[0, G:], base[0, G:]) and not torch.allclose(moved[0, G - 1], base[0, G - 1])
    first = x.clone()
    first[0, G] += 1.0  # block 1's first slot: block 0 stays, the next slot of block 1 moves
    moved = out(first)
    assert torch.equal(moved[0, :G], base[0, :G]) and not torch.allclose(moved[0, G + 1], base[0, G + 1])


@torch.no_grad()
def test_blocks_side_by_side_are_the_blocks_alone(tiny_llama, drafter):
    """Training puts blocks one after another on one axis: each equals the decoding block at its
    anchor, and moving the first block's anchor changes nothing of the second."""
    d = drafter
    ids = random_samples(tiny_llama, n=1, T=30, seed=5)[0]["input_ids"][None]
    hidden = tiny_llama(ids, layers=d.capture_layers, logits=None).hidden
    attn = torch.ones_like(ids)
    both = d.anchored_states(ids, attn, hidden, torch.tensor([[6, 17]]))[0]
    for a, p in enumerate((6, 17)):
        torch.testing.assert_close(both[a], d.block_states(*_context(d, tiny_llama, ids, p))[0], rtol=1e-5, atol=1e-5)
    other = d.anchored_states(ids, attn, hidden, torch.tensor([[11, 17]]))[0]
    assert (other[0] - both[0]).abs().max() > 1e-2
    torch.testing.assert_close(other[1], both[1], rtol=0, atol=1e-6)


@torch.no_grad()
def test_the_selector_scores_and_walk(tiny_llama, drafter):
    d = drafter
    sel, K = d.candidate_selector, d.candidate_selector.top_k
    g = torch.Generator().manual_seed(2)
    states, prev = torch.randn(3, 64, generator=g), torch.tensor([5, 17, 300])
    cand, unary = torch.randint(0, 400, (3, K), generator=g), torch.randn(3, K, generator=g)
    ph = states @ sel.hidden_projection.weight.T
    want = torch.tensor([[unary[j, k] + (sel.predecessor_codebook[prev[j]] * ph[j] * sel.successor_codebook[cand[j, k]]).sum()
                          for k in range(K)] for j in range(3)])
    torch.testing.assert_close(sel.scores(unary, states, prev, cand), want)

    logits = d.readout(states)
    path, cands = d.walk(states, logits, torch.tensor(7), lambda s: s.argmax(-1))
    before, unary_top = 7, []
    for j in range(3):
        u, c = logits[j].topk(K)
        before = int(c[sel.scores(u, states[j], torch.tensor(before), c).argmax()])
        assert path[j] == before and torch.equal(cands[j], c)
        unary_top.append(int(c[0]))
    assert path.tolist() != unary_top  # the transitions moved the walk off the unary top-1


def test_the_gold_token_is_injected_where_the_top_k_misses_it():
    cand = torch.tensor([[3, 1, 4, 7], [3, 1, 4, 7]])
    got, index, held = inject_gold(cand, torch.tensor([4, 9]))
    assert got.tolist() == [[3, 1, 4, 7], [3, 1, 4, 9]] and index.tolist() == [2, 3] and held.tolist() == [True, False]


# ---------------------------------------------------------------------------- training
def test_training_lowers_both_losses(tiny_llama):
    t = tiny_llama
    d = _drafter(t, perturb=False).train()
    batch = _batch(t)
    hidden = t(batch["input_ids"], layers=d.capture_layers, logits=None).hidden
    batch.update(d.derived_targets(hidden, batch))
    cfg = DFlash2Loss(anchors=8, selector_loss_alpha=0.5)

    def evaluate():
        torch.manual_seed(7)  # the same anchors each time
        with torch.no_grad():
            loss, m = d.training_loss(batch, hidden, cfg)
        return loss.item() - cfg.selector_loss_alpha * m["selector_loss"], m["selector_loss"], m

    unary, selector, m = evaluate()
    assert set(m) >= {"acc", "accepted", "backbone_acc", "backbone_accepted", "recall_at_k", "teacher_forced_selector_acc"}
    assert len(m["recall_at_k"]) == len(m["acc"]) == 3
    codebook = d.candidate_selector.successor_codebook.detach().clone()
    opt = torch.optim.AdamW(d.parameters(), lr=1e-2)
    for _ in range(10):
        loss, _ = d.training_loss(batch, hidden, cfg)
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = evaluate()
    assert after[0] < unary - 0.5 and after[1] < selector - 0.5, ((unary, selector), after[:2])
    assert not torch.equal(d.candidate_selector.successor_codebook, codebook)
    assert d.layers[0].attention_conv.kernel_projection.weight.abs().max() > 0  # the convolutions trained from the identity


# ---------------------------------------------------------------------------- decoding
@pytest.mark.parametrize("selector", [True, False])
def test_greedy_decoding_equals_plain(selector, tiny_llama, drafter, tmp_path):
    t = tiny_llama
    proposer = (load_proposer(save_checkpoint(drafter, t, tmp_path / "ckpt"), t, Block(3)) if selector
                else DFlash2Proposer(drafter, selector=False))
    assert isinstance(proposer, DFlash2Proposer) and proposer.selector is selector
    prompt = random_samples(t, n=1, T=12, seed=2)[0]["input_ids"]
    res = SpeculativeDecoder(t, proposer).generate(prompt, 24, Block(3))
    assert res.tokens == generate_plain(t, prompt, 24).tokens and set(res.num_drafted) == {3}


@torch.no_grad()
def test_the_selector_drafts_otherwise_than_the_backbone(tiny_llama, drafter):
    ids = random_samples(tiny_llama, n=1, T=12, seed=2)[0]["input_ids"]
    hidden = tiny_llama(ids[None], layers=drafter.capture_layers, logits=None).hidden
    drafts = []
    for selector in (True, False):
        p = DFlash2Proposer(drafter, selector=selector)
        p.start(ids[:-1], {i: h[:, :-1] for i, h in hidden.items()}, int(ids[-1]))
        drafts.append(p.propose(Block(3)).tokens)
    states = p.block_states()
    assert torch.equal(drafts[1], drafter.readout(states).argmax(-1))
    assert torch.equal(drafts[0], drafter.walk(states, drafter.readout(states), ids[-1], lambda s: s.argmax(-1))[0])
    assert not torch.equal(drafts[0], drafts[1])


def test_a_batch_decodes_as_each_row_alone(tiny_llama, drafter):
    prompts = [tiny_llama.tokenizer(x)["input_ids"] for x in TEXTS]
    rows = Decoder(tiny_llama, DFlash2Proposer(drafter)).generate(prompts, 16, Block(3)).rows
    for p, row in zip(prompts, rows):
        alone = SpeculativeDecoder(tiny_llama, DFlash2Proposer(drafter)).generate(torch.tensor(p), 16, Block(3))
        assert row.tokens == alone.tokens and row.accept_lengths == alone.accept_lengths


def test_the_device_loop_drafts_what_the_host_loop_drafts(tiny_llama, drafter, monkeypatch):
    """Same tokens, acceptance and drafts at every step while all rows decode, eager and replayed;
    sampled decoding runs there too."""
    from draftlab.inference.graphs import GraphedTarget

    proposer, prompts = DFlash2Proposer(drafter), [tiny_llama.tokenizer(x)["input_ids"] for x in TEXTS]
    drafted = spy_drafts(monkeypatch, proposer)
    host = Decoder(tiny_llama, proposer, loop="host").generate(prompts, 16, Block(3))
    dev = Decoder(tiny_llama, proposer, loop="device").generate(prompts, 16, Block(3))
    assert [r.tokens for r in dev.rows] == [r.tokens for r in host.rows]
    assert [r.accept_lengths for r in dev.rows] == [r.accept_lengths for r in host.rows]
    together = [h for h in drafted["host"] if h.shape[0] == 3]
    assert len(together) >= 3 and all(torch.equal(h, d) for h, d in zip(together, drafted["device"]))
    replayed = Decoder(GraphedTarget(tiny_llama, mode="replay"), proposer, loop="device").generate(prompts, 16, Block(3))
    assert [r.tokens for r in replayed.rows] == [r.tokens for r in host.rows]
    # sampling on the device: the greedy walk's drafts verified as point masses (lossless whatever the drafts)
    before = len(drafted["device"])
    sampled = Decoder(tiny_llama, proposer, loop="device").generate(prompts, 16, Block(3), temperature=1.0, seed=1)
    assert all(len(r.tokens) == 16 for r in sampled.rows) and len(drafted["device"]) > before


@torch.no_grad()
def test_sampled_drafts_hand_q_over_the_k_candidates(tiny_llama, drafter):
    """q_j is the decoding distribution (temperature, top-p) of slot j's scores from the token drafted
    at j - 1, spread over its K candidates and zero elsewhere."""
    d = drafter
    ids = random_samples(tiny_llama, n=1, T=14, seed=5)[0]["input_ids"]
    hidden = tiny_llama(ids[None], layers=d.capture_layers, logits=None).hidden
    p = DFlash2Proposer(d)
    sampling = Sampling(temperature=0.7, top_p=0.9, generator=torch.Generator().manual_seed(0))
    p.configure(sampling)
    p.start(ids[:10], {i: h[:, :10] for i, h in hidden.items()}, int(ids[10]))
    draft = p.propose(Block(3))
    states = p.block_states()
    unary, cand = d.readout(states).topk(d.candidate_selector.top_k, dim=-1)
    prev = torch.cat([ids[10:11], draft.tokens[:-1]])
    q = sampling.probs(d.candidate_selector.scores(unary, states, prev, cand))
    torch.testing.assert_close(draft.probs.gather(1, cand), q)
    assert torch.allclose(draft.probs.sum(-1), torch.ones(3)) and (draft.probs.gather(1, draft.tokens[:, None]) > 0).all()
    off = torch.ones_like(draft.probs, dtype=torch.bool).scatter_(1, cand, False)
    assert draft.probs[off].abs().max() == 0


def test_sampled_decoding_keeps_the_target_distribution(tiny_llama, trained):
    """The first three tokens (the prefill's, then one verified block) jointly follow the target's
    top-k=3 distribution with drafts sampled along the selector's walk; the block had 0, 1 and 2
    drafts accepted at times (every verify path taken)."""
    t = tiny_llama
    d, prompts, _ = trained
    prompt = prompts[0].tolist()
    dec = SpeculativeDecoder(t, DFlash2Proposer(d))
    counts, steps, n = Counter(), Counter(), 600
    for seed in range(n):
        r = dec.generate(prompt, 3, Block(2), temperature=1.0, top_k=3, seed=seed)
        counts[tuple(r.tokens)] += 1
        steps.update(r.accept_lengths[:1])
    assert len(steps) == 3, steps
    assert_follows_target(counts, t, prompt, 3, 1.0, 3, n)


# ---------------------------------------------------------------------------- three acceptances
def test_three_acceptances_of_one_drafter(tiny_llama, drafter, trained):
    from draftlab.inference.decoding_spec import DecodingSpec
    from draftlab.inference.dflash2 import heldout_slots
    from draftlab.inference.lift import lift, table
    from draftlab.inference.prompts import EvalPrompt

    t = tiny_llama
    samples = random_samples(t, n=2, T=20, seed=8)
    slots = heldout_slots(drafter, t, samples)
    assert slots["blocks"] == 2 * 18 and slots["top_k"] == 4  # anchors 1..18 of each sample
    assert all(b <= r for b, r in zip(slots["backbone"]["acc"], slots["recall_at_k"]))  # the top-1 is among the top-K
    every = heldout_slots(_drafter(t, top_k=400), t, samples)  # K = the vocabulary: the target's token is always there
    assert every["recall_at_k"] == [1.0, 1.0, 1.0]
    d, prompts, rows = trained  # its own training rows: every slot's draft right, both ways
    prompts = [EvalPrompt("test", p.tolist(), str(i)) for i, p in enumerate(prompts[:2])]
    result = lift(t, d, prompts, DecodingSpec(method="block", k=3, max_new_tokens=12), rows[:2])
    reports = result["reports"]
    assert result["part"] == "selector" and reports["selector"]["drafter"] == "dflash2"
    assert reports["backbone"]["drafter"] == "dflash2 backbone top-1"
    assert reports["selector"]["greedy_match"] == reports["backbone"]["greedy_match"] == "2/2"
    assert reports["selector"]["tau"] > 2.5 and reports["backbone"]["tau"] > 2.5
    assert result["paired"]["selector"]["tau"] == pytest.approx(reports["selector"]["tau"])  # pooled as the report pools
    assert result["heldout"]["recall_at_k"] == result["heldout"]["selector"]["acc"] == [1.0, 1.0, 1.0]
    assert "recall@8" in table(result) and "| selector |" in table(result)


def test_the_lift_command(drafter, tiny_llama, tiny_target_dirs, tmp_path, capsys):
    """``python -m draftlab.inference.lift CKPT --recipe R [overrides]``: target, held-out split and
    eval spec from the recipe; a checkpoint of a family without a part is one line and exit 2."""
    from draftlab.inference.lift import main
    from draftlab.models.diffusion import DiffusionConfig

    c = save_checkpoint(drafter, tiny_llama, tmp_path / "ckpt")
    recipe = _recipe(tmp_path, tiny_target_dirs["llama"], write_chat(tmp_path / "chat.jsonl", 8, assistant_words=12), "run")
    assert main([str(c), "--recipe", str(recipe), "eval.max_new_tokens=6", "--report", str(tmp_path / "lift.json")]) == 0
    out = capsys.readouterr().out
    assert "| backbone |" in out and "| selector |" in out and "recall@4 per slot" in out and "2 prompts" in out
    assert set(json.loads((tmp_path / "lift.json").read_text())) == {"part", "reports", "paired", "heldout"}
    other = save_checkpoint(DiffusionDrafter.build(DiffusionConfig(num_layers=1, block_size=4, target_layers=LAYERS, draft_vocab_size=0),
                                                   tiny_llama, random_samples(tiny_llama, n=2)), tiny_llama, tmp_path / "diffusion")
    assert main([str(other), "--recipe", str(recipe)]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]  # after the target's loading bar
    assert last.startswith("python -m draftlab.inference.lift: error: a diffusion drafter has no part to switch off")
    assert "dflash2 (selector), domino (correction)" in last


# ---------------------------------------------------------------------------- one-line errors
@pytest.mark.parametrize("override,match", [
    ("drafter.selector_top_k=0", "drafter.selector_top_k: Input should be greater than or equal to 1"),
    ("drafter.selector_rank=0", "drafter.selector_rank: Input should be greater than or equal to 1"),
    ("drafter.conv_kernel_size=0", "drafter.conv_kernel_size: Input should be greater than or equal to 1"),
    ("drafter.conv_kernel_size=9", r"drafter.conv_kernel_size: Value error, must be at most drafter.block_size \(8\)"),
    ("drafter.conv_group_size=0", "drafter.conv_group_size: Input should be greater than or equal to 1"),
    ("loss.selector_loss_alpha=-0.5", "loss.selector_loss_alpha: Input should be greater than or equal to 0"),
])
def test_bad_recipe_fields_are_one_line_errors(tmp_path, override, match):
    from draftlab.recipe import load_recipe

    path = tmp_path / "r.yaml"
    path.write_text(f"algorithm: dflash2\noutput_dir: {tmp_path / 'run'}\n")
    load_recipe(path)  # the defaults are a valid dflash2 recipe
    with pytest.raises(DraftlabError) as e:
        load_recipe(path, [override])
    assert_one_line(e, match)


@pytest.mark.parametrize("fields,match", [
    (dict(selector_top_k=401), r"drafter\.selector_top_k = 401 is outside 1\.\.400 \(at most the target vocabulary\)"),
    (dict(selector_top_k=65, draft_vocab_size=64), r"drafter\.selector_top_k = 65 is more candidates than draft_vocab_size 64"),
    (dict(conv_group_size=24), r"drafter\.conv_group_size = 24 does not divide the target's hidden size 64"),
])
def test_fields_the_target_bounds_are_refused_before_the_drafter_is_built(tiny_llama, fields, match):
    cfg = {"num_layers": 1, "block_size": 4, "target_layers": LAYERS, "selector_rank": 8, **fields}
    with pytest.raises(DraftlabError) as e:
        DFlash2Drafter.build(DFlash2Config(**cfg), tiny_llama, random_samples(tiny_llama, n=2))
    assert_one_line(e, match)


@pytest.mark.parametrize("edit,match", [
    (dict(meta=lambda m: m.update(conv_kernel_size=5)), r"drafter\.conv_kernel_size = 5 is more taps than block_size 4"),
    (dict(meta=lambda m: m.update(selector_rank=True)), r"drafter\.selector_rank = true is not an integer"),
    (dict(meta=lambda m: m.pop("selector_top_k")), "drafter meta lacks 'selector_top_k'"),
    (dict(weights=lambda s: s.pop("layers.1.mlp_conv.base_kernel")), r"layers\.1\.mlp_conv\.base_kernel"),
])
def test_bad_checkpoints_are_one_line_errors(edit, match, drafter, tiny_llama, tmp_path):
    path = save_checkpoint(drafter, tiny_llama, tmp_path / "ckpt")
    edit_checkpoint(path, **edit)
    with pytest.raises(DraftlabError) as e:
        ckpt.load_drafter(path, tiny_llama)
    assert_one_line(e, match)


# ---------------------------------------------------------------------------- the served layout
@pytest.fixture(scope="module")
def made(tiny_llama, drafter, tmp_path_factory):
    root = tmp_path_factory.mktemp("dflash2")
    c = save_checkpoint(drafter, tiny_llama, root / "ckpt")
    return c, export_checkpoint(c, "vllm", root / "vllm", tiny_llama)


def test_the_export_is_the_served_layout_and_round_trips(made, drafter, tiny_llama, tmp_path):
    c, out = made
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"] and config["is_causal"] is False
    assert config["dflash_config"] == {"target_layer_ids": [0, 2], "mask_token_id": drafter.mask_token_id, "block_size": 4,
                                       "conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 4}
    names = set(load_file(out / "model.safetensors"))
    assert {"candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook",
            "candidate_selector.hidden_projection.weight", "layers.1.mlp_conv.base_kernel",
            "layers.0.attention_conv.kernel_projection.weight"} <= names
    assert not names & {"d2t", "t2d", "lm_head.weight", "embed_tokens.weight"}
    back = import_checkpoint(out, "zlab-dflash2", tmp_path / "imported", tiny_llama)
    d2, meta = ckpt.load_drafter(back, tiny_llama)
    assert meta["algorithm"] == "dflash2" and d2.meta() == drafter.meta() | {"normalize_fc_input": False}
    assert all(torch.equal(v, d2.state_dict()[k]) for k, v in drafter.export_state_dict().items())
    again = export_checkpoint(c, "sglang", tmp_path / "sglang", tiny_llama)
    assert json.loads((again / "config.json").read_text()) == config and "DFLASH" in (again / "README.md").read_text()


def test_a_reduced_vocabulary_is_not_exported(tiny_llama, tmp_path):
    c = save_checkpoint(_drafter(tiny_llama, vd=64), tiny_llama, tmp_path / "ckpt")
    with pytest.raises(DraftlabError) as e:
        export_checkpoint(c, "vllm", tmp_path / "out", tiny_llama)
    assert_one_line(e, r"reduced draft vocabulary \(64 of 400\); train with drafter.draft_vocab_size=0")


@pytest.mark.parametrize("change,fmt,match", [
    (dict(architectures=["DFlashDraftModel"]), "zlab-dflash2", "architectures\\[0\\] is 'DFlashDraftModel', expected 'DFlash2DraftModel'"),
    (dict(output_multiplier=2.0), "zlab-dflash2", "output_multiplier is not implemented by draftlab's DFlash2 drafter"),
    (dict(is_causal=True), "zlab-dflash2", "is_causal is not implemented"),
    (dict(block_size=8), "zlab-dflash2", "block_size 8 and dflash_config.block_size 4 disagree"),
    ({}, "zlab-dflash", "architectures\\[0\\] is 'DFlash2DraftModel', expected 'DFlashDraftModel'"),
    # relabelled as DFlash: the diffusion import still sees the convolutions and the selector
    (dict(architectures=["DFlashDraftModel"]), "zlab-dflash",
     "dflash_config conv_kernel_size, selector_rank is not implemented by draftlab's diffusion drafter"),
])
def test_bad_imports_are_one_line_errors(change, fmt, match, made, tiny_llama, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(made[1], src)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(DraftlabError) as e:
        import_checkpoint(src, fmt, tmp_path / "out", tiny_llama)
    assert_one_line(e, match)


def _check(out, c, target, tmp_path):
    from draftlab.export.check import check_export

    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": x}]}) + "\n" for x in TEXTS))
    lines = []
    return check_export(out, c, target, data=str(data), num_prompts=3, max_new_tokens=12, print_fn=lines.append), lines


def test_speculators_dflash2_drafts_what_draftlab_drafts(made, tiny_llama, tmp_path):
    """``--check``: config fields and tensors equal, then speculators' DFlash2DraftModel (its own
    convolutions and selector) built from the export drafts every block position draftlab drafts."""
    pytest.importorskip("speculators.models.dflash2")
    c, out = made
    report, lines = _check(out, c, tiny_llama, tmp_path)
    assert report.peer is not None and report.peer.label == "speculators DFlash2DraftModel" and report.steps > 0 and report.k == 3
    assert report.ours.drafts == report.peer.drafts and 0 < report.worst_logit_diff <= 1e-4
    assert "drafts equal at all" in lines[-1]


@pytest.mark.parametrize("edit,match", [
    (lambda c: c["dflash_config"].update(selector_top_k=5), r"config field dflash_config\.selector_top_k is 5 in the export, 4 from"),
    (lambda c: c.update(architectures=["DFlashDraftModel"]), "config.json is no known layout of dflash2 drafters"),
])
def test_an_edited_export_fails_the_check_in_one_line(edit, match, made, tiny_llama, tmp_path):
    c, out = made
    edited = tmp_path / "edited"
    shutil.copytree(out, edited)
    config = json.loads((edited / "config.json").read_text())
    edit(config)
    (edited / "config.json").write_text(json.dumps(config))
    with pytest.raises(DraftlabError) as e:
        _check(edited, c, tiny_llama, tmp_path)
    assert_one_line(e, match)


def test_a_peer_whose_selector_differs_fails_the_check(made, tiny_llama, tmp_path, monkeypatch):
    """A codebook the config and tensor checks cannot see moved inside the peer: the first draft
    position's scores differ."""
    pytest.importorskip("speculators.models.dflash2")
    from draftlab.export.dflash2 import SpeculatorsDFlash2Peer

    init = SpeculatorsDFlash2Peer.__init__

    def other(self, *args, **kw):
        init(self, *args, **kw)
        with torch.no_grad():
            self.model.candidate_selector.successor_codebook.add_(1.0)

    monkeypatch.setattr(SpeculatorsDFlash2Peer, "__init__", other)
    with pytest.raises(DraftlabError, match=r"prompt 0, step 0, draft position 0: the peer's logits differ from draftlab's"):
        _check(made[1], made[0], tiny_llama, tmp_path)


# ---------------------------------------------------------------------------- the trainer
def _recipe(tmp_path: Path, target_dir, data: Path, name: str, **edits) -> Path:
    recipe = {
        "algorithm": "dflash2", "output_dir": str(tmp_path / name), "target": {"model": str(target_dir)},
        "drafter": {"num_layers": 1, "block_size": 4, "target_layers": LAYERS, "selector_rank": 8, "selector_top_k": 4},
        "loss": {"anchors": 8},
        "data": {"source": str(data), "max_length": 96, "heldout": 2},
        "capture": {"mode": "memory"},
        "train": {"max_steps": 4, "batch_tokens": 512, "checkpoint_every": 2, "warmup_steps": 1, "lr": 1e-2},
        "eval": {"num_prompts": 2, "max_new_tokens": 8, "method": "block", "k": 3},
        **edits,
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


@pytest.mark.slow
def test_the_shared_trainer_trains_reports_and_resumes_a_killed_run(tiny_target_dirs, tmp_path):
    """Reports after each checkpoint decode the block greedily to plain decoding's tokens; killed
    right after its step-2 checkpoint and relaunched, a run's step-4 weights equal a straight run's
    bit for bit (anchors, convolutions, selector and all)."""
    data = write_chat(tmp_path / "chat.jsonl", 12, assistant_words=20)
    straight = _recipe(tmp_path, tiny_target_dirs["llama"], data, "straight")
    killed = _recipe(tmp_path, tiny_target_dirs["llama"], data, "killed", eval={"enabled": False})
    a = assert_resumes_bitwise("dflash2", straight, killed)
    assert any("candidate_selector" in k for k in a) and any("attention_conv" in k for k in a)
    for step in (2, 4):
        report = json.loads((tmp_path / "straight" / "eval" / f"step-{step:07d}.json").read_text())
        assert report["greedy_match"] == "2/2" and report["step"] == step and len(report["alpha"]) == 3
    meta = ckpt.read_meta(ckpt.step_dir(tmp_path / "straight", 4))
    assert {"acc", "backbone_acc", "recall_at_k", "teacher_forced_selector_acc"} <= set(meta["metrics"])
