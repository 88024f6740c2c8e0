"""Hydra++ (models/hydra.py, inference/hydra.py) on the tiny random targets.

* Heads start as the target's read-out; the training forward's teacher-forced heads are what the
  proposer drafts (prefix cache included); training lowers every head's loss.
* Greedy decoding equals plain decoding for chains, static trees and dynamic trees, whose nodes
  follow their own paths (a child is its head's top token given its parent); a batch decodes as
  each row alone; the device loop decodes what the host loop does.
* Bad recipe fields, metadata, tree shapes and engine exports are one-line errors; the shared
  trainer trains, reports and resumes a killed run to identical weights.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml

from draftlab import checkpoint as ckpt
from draftlab.errors import DraftlabError
from draftlab.export.exporter import export_checkpoint
from draftlab.inference.decoder import Decoder, SpeculativeDecoder, generate_plain
from draftlab.inference.graphs import GraphedTarget
from draftlab.inference.hydra import HydraProposer, root_inputs
from draftlab.inference.proposer import load_proposer
from draftlab.inference.shapes import Chain, DynamicTree, OptionError, StaticTree
from draftlab.models.hydra import HydraConfig, HydraDrafter, HydraLoss
from tiny import assert_one_line, assert_resumes_bitwise, edit_checkpoint, final_hidden, random_samples, save_checkpoint, write_chat

pytestmark = pytest.mark.usefixtures("one_thread")
REPO = Path(__file__).resolve().parent.parent
TEXTS = ["the quick brown fox", "one two three", "def add(a, b):"]
N_NEW = 20
STATIC = StaticTree([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 0, 0)])
TREE = DynamicTree(depth=4, top_k=2, total_tokens=6)


def _drafter(target, perturb=True, **cfg):
    torch.manual_seed(0)
    cfg = {"num_heads": 4, "num_layers": 2, "draft_vocab_size": 64, **cfg}
    d = HydraDrafter.build(HydraConfig(**cfg), target, random_samples(target, n=4))
    if perturb:  # every weight away from its init, so a swapped or dropped tensor shows
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in d.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return d.eval()


# ---------------------------------------------------------------------------- model
@pytest.mark.parametrize("prefix", [True, False])
def test_heads_start_as_the_target_read_out(tiny_llama, prefix):
    t = tiny_llama
    d = _drafter(t, perturb=False, prefix_attention=prefix, draft_vocab_size=0)
    H = t.hidden_size
    state = d.state_dict()
    assert state["first.2.linear.weight"].shape == state["first.2.res_connection.weight"].shape == (H, 4 * H)
    assert all(f"blocks.{h}.layers.0.weight" in state and f"blocks.{h}.layers.1.weight" not in state for h in range(4))
    assert any(k.startswith("prefix.layer.self_attn.") for k in state) is prefix
    ids = random_samples(t, n=1)[0]["input_ids"][None]
    h = final_hidden(t, ids)
    x = d.teacher_forced(ids, h)
    assert x.shape == (1, ids.shape[1], 5 * H)
    # the prefix layer starts as the identity on its residual stream, then its RMSNorm
    s = F.rms_norm(h, (H,), eps=d.shape.rms_norm_eps) if prefix else h
    want = t.lm_head(s)
    with torch.no_grad():
        for i in range(4):
            torch.testing.assert_close(d.head_logits(x, i), want, rtol=1e-5, atol=1e-5)
    assert d.capture_layers == [t.num_layers] == HydraDrafter.default_capture_layers(t.num_layers)


@pytest.mark.parametrize("prefix", [True, False])
def test_the_training_forward_is_what_the_proposer_drafts(tiny_llama, prefix):
    """Position t of the teacher-forced forward, fed the proposer's own drafts as the data's next
    tokens, gives the proposer's head logits; the prefix state read in two parts (start, then
    advance) is the one read whole."""
    t = tiny_llama
    d = _drafter(t, prefix_attention=prefix)
    p = HydraProposer(d)
    ids = random_samples(t, n=1, T=30, seed=5)[0]["input_ids"]
    hidden = t(ids[None], layers=d.capture_layers, logits=None).hidden
    L = t.num_layers
    for cut, t0 in ((8, 8), (8, 17)):
        p.start(ids[: cut + 1], {L: hidden[L][:, : cut + 1]}, int(ids[cut + 1]))
        if t0 > cut:  # the tokens t0 - cut kept later, with their inputs' hidden states
            p.advance(ids[cut + 2 : t0 + 2], {L: hidden[L][:, cut + 1 : t0 + 1]})
        with torch.no_grad():
            s = d.teacher_forced(ids[None, : t0 + 1], hidden[L][:, : t0 + 1])[0, t0, : t.hidden_size]
        torch.testing.assert_close(p.state, s, rtol=1e-5, atol=1e-5)
        draft = p.propose(Chain(4)).tokens
        seq = torch.cat([ids[: t0 + 2], draft[:3]])[None]  # x_{t0+1} is the root, then the drafts
        with torch.no_grad():
            x = d.teacher_forced(seq, t(seq, layers=[L], logits=None).hidden[L])[0, t0]
            x0 = root_inputs(p.drafter, p.state[None], p.root[None])
            for i in range(4):
                ours = d.head_logits(x, i)
                assert d.to_target_ids(ours.argmax()) == draft[i], (t0, i)
                if i == 0:
                    torch.testing.assert_close(p.drafter.head_logits(x0, 0)[0], ours, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("prefix,targets", [(True, "target"), (False, "data")])
def test_training_lowers_the_loss_of_every_head(tiny_llama, prefix, targets):
    t = tiny_llama
    d = _drafter(t, perturb=False, prefix_attention=prefix).train()
    s = random_samples(t, n=4, T=24, seed=3)
    ids = torch.stack([x["input_ids"] for x in s])
    batch = {"input_ids": ids, "loss_mask": torch.stack([x["loss_mask"] for x in s]), "attention_mask": torch.ones_like(ids)}
    hidden = t(ids, layers=d.capture_layers, logits=None).hidden
    opt = torch.optim.AdamW(d.parameters(), lr=3e-3)
    first = None
    for _ in range(10):
        loss, metrics = d.training_loss(batch, hidden, HydraLoss(targets=targets))
        opt.zero_grad()
        loss.backward()
        opt.step()
        first = first or metrics
    assert all(p.grad is not None for p in d.parameters())
    assert not prefix or d.prefix.layer.self_attn.q_proj.weight.grad.abs().sum() > 0  # the prefix layer trains
    assert len(metrics["acc"]) == len(metrics["top5"]) == 4
    assert all(b < a for a, b in zip(first["loss_heads"], metrics["loss_heads"])), (first, metrics)


# ---------------------------------------------------------------------------- decoding
@pytest.fixture(scope="module")
def fitted(tiny_llama, tmp_path_factory):
    """Heads fitted to the target's greedy continuations of the test prompts (Hydra's
    self-distillation on three sequences), so decoding accepts drafts and every path of the
    verifier, the trees and ``advance`` runs."""
    t = tiny_llama
    d = _drafter(t, perturb=False, draft_vocab_size=0).train()
    seqs = []
    for text in TEXTS:
        prompt = t.tokenizer(text, return_tensors="pt").input_ids[0]
        seqs.append(torch.cat([prompt, torch.tensor(generate_plain(t, prompt, 40).tokens)])[None])
    hidden = [t(ids, layers=d.capture_layers, logits=None).hidden for ids in seqs]
    opt = torch.optim.Adam(d.parameters(), lr=2e-2)
    for _ in range(30):
        for ids, h in zip(seqs, hidden):
            batch = {"input_ids": ids, "loss_mask": torch.ones_like(ids, dtype=torch.bool), "attention_mask": torch.ones_like(ids)}
            loss, metrics = d.training_loss(batch, h, HydraLoss(targets="data"))
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert min(metrics["acc"]) > 0.8
    return save_checkpoint(d.eval(), t, tmp_path_factory.mktemp("hydra") / "ckpt")


def _prompts(t):
    return [t.tokenizer(text)["input_ids"] for text in TEXTS]


@pytest.mark.parametrize("shape", [Chain(4), Chain(6), Chain(4, min_confidence=0.3), STATIC, TREE], ids=str)
def test_greedy_decoding_equals_plain(tiny_llama, fitted, shape):
    t = tiny_llama
    prompt = torch.tensor(_prompts(t)[0])
    spec = SpeculativeDecoder(t, load_proposer(fitted, t, shape)).generate(prompt, N_NEW, shape=shape)
    assert spec.tokens == generate_plain(t, prompt, N_NEW).tokens
    assert max(spec.num_drafted) <= (4 if isinstance(shape, Chain) else shape.max_nodes)
    assert max(spec.accept_lengths) == 4  # the fitted heads' drafts are accepted to the last head


def test_tree_nodes_follow_their_own_paths(tiny_llama, fitted):
    """A static tree's child is its head's top token given the child's own path (Hydra), not a
    per-depth guess shared by every parent (Medusa): two parents get their own children."""
    t = tiny_llama
    p = load_proposer(fitted, t)
    prompt = torch.tensor(_prompts(t)[1])
    out = t(prompt[None], layers=p.layers, logits="last")
    p.start(prompt, out.hidden, int(out.logits[0, -1].argmax()))
    shape = StaticTree([(0,), (1,), (0, 0), (1, 0), (1, 1)])
    tree = p.propose(shape)
    d = p.drafter
    x0 = root_inputs(d, p.state[None], p.root[None])
    with torch.no_grad():
        assert tree.tokens[:2].tolist() == d.to_target_ids(d.head_logits(x0, 0)[0].topk(2).indices).tolist()
        for parent, children in ((0, [2]), (1, [3, 4])):
            x1 = torch.cat([x0, d.embed(tree.tokens[parent : parent + 1])], -1)
            ranked = d.to_target_ids(d.head_logits(x1, 1)[0].topk(len(children)).indices)
            assert tree.tokens[children].tolist() == ranked.tolist(), parent
    assert tree.parents.tolist() == [0, 0, 1, 2, 2]


@pytest.mark.parametrize("shape", [Chain(3), STATIC, TREE], ids=str)
def test_a_batch_decodes_as_each_row_alone(tiny_llama, fitted, shape):
    t = tiny_llama
    prompts = _prompts(t)
    res = Decoder(t, load_proposer(fitted, t)).generate(prompts, N_NEW, shape)
    assert [r.tokens for r in res.rows] == [generate_plain(t, torch.tensor(p), N_NEW).tokens for p in prompts]
    assert all(max(r.accept_lengths) >= 2 for r in res.rows)
    # drafted together, each row's draft is the one it gets alone
    proposer = load_proposer(fitted, t)
    rows, alone = proposer.batched(len(prompts), shape), [proposer.fork() for _ in prompts]
    for r, prompt in enumerate(prompts):
        out = t(torch.tensor(prompt)[None], layers=proposer.layers, logits="last")
        rows.start(r, torch.tensor(prompt), out.hidden, int(out.logits[0, -1].argmax()))
        alone[r].start(torch.tensor(prompt), out.hidden, int(out.logits[0, -1].argmax()))
    for together, single in zip(rows.propose(shape), (p.propose(shape) for p in alone)):
        assert torch.equal(together.tokens, single.tokens)
        assert isinstance(shape, Chain) or torch.equal(together.parents, single.parents)


@pytest.mark.parametrize("shape", [Chain(4), STATIC, TREE], ids=str)
def test_the_device_loop_decodes_what_the_host_loop_does(tiny_llama, fitted, shape):
    """Eager and replayed (one captured function per batch bucket), with rows that stop at eos
    at different steps; the dynamic tree drafted on the device holds the host's nodes."""
    t = tiny_llama
    p = load_proposer(fitted, t)
    prompts = _prompts(t)
    eos = generate_plain(t, torch.tensor(prompts[0]), N_NEW).tokens[3]  # the first row ends first: rows move up
    host = Decoder(t, p, loop="host").generate(prompts, N_NEW, shape, eos_token_id=eos)
    for target in (t, GraphedTarget(t, mode="replay")):
        dev = Decoder(target, p, loop="device").generate(prompts, N_NEW, shape, eos_token_id=eos)
        assert [r.tokens for r in dev.rows] == [r.tokens for r in host.rows]
        assert [r.accept_lengths for r in dev.rows] == [r.accept_lengths for r in host.rows]
    assert len(host.rows[0].tokens) < min(len(r.tokens) for r in host.rows[1:])
    sampled = [Decoder(t, p, loop=loop).generate(prompts, N_NEW, shape, temperature=0.8, seed=3) for loop in ("device", "device")]
    assert [r.tokens for r in sampled[0].rows] == [r.tokens for r in sampled[1].rows]
    assert all(len(r.tokens) == N_NEW for r in sampled[0].rows)


@pytest.mark.parametrize("prefix", [True, False])
def test_the_device_drafter_drafts_what_the_host_proposer_does(tiny_llama, prefix):
    """After the prompt and after a step that kept 3 of 5 inputs, the device drafter's chain,
    static tree and dynamic tree are the host proposer's (same tokens under the same parents)."""
    t = tiny_llama
    p = HydraProposer(_drafter(t, prefix_attention=prefix))
    ids = random_samples(t, n=1, T=24, seed=9)[0]["input_ids"]
    hidden = t(ids[None], layers=p.layers, logits=None).hidden
    L = t.num_layers
    dev = p.on_device(2, 64, STATIC)
    p.start(ids[:12], {L: hidden[L][:, :12]}, int(ids[12]))
    dev.start(1, ids[:12], {L: hidden[L][:, :12]}, ids[12])
    dev.select(torch.tensor([1, 0]))  # the row moves up to row 0
    for o in (12, 15, 18):  # the step's first input: the root
        assert torch.equal(dev.draft(1, 4)[0], p.propose(Chain(4)).tokens), o
        assert torch.equal(dev.draft_tree(1, STATIC)[0][0], p.propose(STATIC).tokens), o
        tokens, parents = dev.draft_tree(1, TREE)
        tree = p.propose(TREE)
        assert torch.equal(tokens[0], tree.tokens) and torch.equal(parents[0], tree.parents), o
        # inputs x_o..x_{o+4} verified, 3 kept (x_{o+1}..x_{o+3} emitted), the rest written and dropped
        p.advance(ids[o + 1 : o + 4], {L: hidden[L][:, o : o + 3]})
        dev.extend(1, ids[None, o + 1 : o + 6], {L: hidden[L][:, o : o + 5]}, torch.tensor([3]))


def test_shapes_the_heads_cannot_fill_are_refused(tiny_llama, fitted):
    t = tiny_llama
    too_deep = StaticTree([(0,), (0, 0), (0, 0, 0), (0, 0, 0, 0), (0, 0, 0, 0, 0)])
    with pytest.raises(OptionError) as e:
        load_proposer(fitted, t, too_deep)
    assert_one_line(e, "static tree: depth 5 needs 5 Hydra heads, this drafter has 4")
    prompt = _prompts(t)[:1]
    with pytest.raises(DraftlabError) as e:
        Decoder(t, load_proposer(fitted, t), loop="device").generate(prompt, 8, Chain(5))
    assert_one_line(e, "device loop cannot run this decoding: k=5: its 4 Hydra heads draft 4 tokens a step")
    with pytest.raises(DraftlabError) as e:
        Decoder(t, load_proposer(fitted, t), loop="device").generate(prompt, 8, DynamicTree(depth=2, top_k=2, total_tokens=8))
    assert_one_line(e, "its 4 heads grow 6 nodes, fewer than tree.total_tokens=8")


# ---------------------------------------------------------------------------- export, schema, recipe
def test_only_draftlabs_own_layout_exports(tiny_llama, fitted, tmp_path):
    t = tiny_llama
    with pytest.raises(DraftlabError) as e:
        export_checkpoint(fitted, "vllm", tmp_path / "vllm", t)
    assert_one_line(e, r"--to vllm: no export of hydra drafters for vllm \(available: hf\)")
    out = export_checkpoint(fitted, "hf", tmp_path / "hf", t)
    d, meta = ckpt.load_drafter(out, t)
    d0, _ = ckpt.load_drafter(fitted, t)
    assert meta["algorithm"] == "hydra" and json.loads((out / "config.json").read_text())["draftlab_algorithm"] == "hydra"
    a, b = d0.state_dict(), d.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("edit, says", [
    (lambda m: m.update(num_heads=0), "drafter.num_heads = 0 is outside 1..64"),
    (lambda m: m.update(num_layers=-1), "drafter.num_layers = -1 is outside 1..4"),
    (lambda m: m.update(draft_vocab_size=10**6), "drafter.draft_vocab_size = 1000000 is outside 1..400"),
    (lambda m: m.update(prefix_attention="yes"), 'drafter.prefix_attention = "yes" is not true or false'),
    (lambda m: m["shape"].update(hidden_size=32), "drafter.shape.hidden_size = 32 is not the target's hidden size 64"),
    (lambda m: m.pop("num_target_layers"), "drafter meta lacks 'num_target_layers'"),
    (lambda m: m.update(parallel_depth=2), "drafter.parallel_depth is not a field of hydra drafter meta"),
])
def test_bad_metadata_is_refused_in_one_line(tiny_llama, tmp_path, edit, says):
    path = save_checkpoint(_drafter(tiny_llama, perturb=False), tiny_llama, tmp_path / "ckpt")
    edit_checkpoint(path, meta=edit)
    with pytest.raises(DraftlabError) as e:
        ckpt.load_drafter(path, tiny_llama)
    assert_one_line(e, re.escape(says))


def test_missing_weights_are_refused_in_one_line(tiny_llama, tmp_path):
    path = save_checkpoint(_drafter(tiny_llama, perturb=False), tiny_llama, tmp_path / "ckpt")
    edit_checkpoint(path, weights=lambda s: s.pop("prefix.layer.self_attn.q_proj.weight"))
    with pytest.raises(DraftlabError) as e:
        ckpt.load_drafter(path, tiny_llama)
    assert_one_line(e, re.escape("missing ['prefix.layer.self_attn.q_proj.weight']"))


def _recipe(tmp_path: Path, target_dir, name: str, **edits) -> Path:
    recipe = {
        "algorithm": "hydra",
        "output_dir": str(tmp_path / name),
        "target": {"model": str(target_dir)},
        "data": {"source": str(write_chat(tmp_path / "chat.jsonl", 30)), "max_length": 96, "heldout": 4},
        "drafter": {"num_heads": 3, "num_layers": 2, "draft_vocab_size": 64},
        "capture": {"mode": "memory"},
        "train": {"max_steps": 4, "batch_tokens": 384, "checkpoint_every": 2, "warmup_steps": 1, "lr": 3e-3},
        "eval": {"enabled": True, "num_prompts": 2, "max_new_tokens": 12, "method": "chain", "k": 3},
    }
    for section, values in edits.items():
        recipe.setdefault(section, {}).update(values)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


@pytest.mark.parametrize("section, values, says", [
    ("drafter", {"num_heads": 0}, "drafter.num_heads: Input should be greater than or equal to 1"),
    ("drafter", {"num_layers": -2}, "drafter.num_layers: Input should be greater than or equal to 1"),
    ("drafter", {"draft_vocab_size": -5}, "drafter.draft_vocab_size: Input should be greater than or equal to 0"),
    ("drafter", {"prefix_attention": "sometimes"}, "drafter.prefix_attention: Input should be a valid boolean"),
    ("drafter", {"heads": 4}, "drafter.heads: Extra inputs are not permitted"),
    ("loss", {"decay": 0}, "loss.decay: Input should be greater than 0"),
    ("loss", {"targets": "logits"}, "loss.targets: Input should be 'target' or 'data'"),
])
def test_recipe_refuses_bad_fields_in_one_line(section, values, says, tiny_target_dirs, tmp_path):
    from draftlab.recipe import load_recipe

    load_recipe(_recipe(tmp_path, tiny_target_dirs["llama"], "good")).algorithm_configs()  # the base recipe is valid
    path = _recipe(tmp_path, tiny_target_dirs["llama"], "bad", **{section: values})
    with pytest.raises(DraftlabError) as e:
        load_recipe(path).algorithm_configs()
    assert_one_line(e, re.escape(says))


def test_the_recipe_is_valid_and_builds_hydra_plus_plus():
    from draftlab.recipe import load_recipe

    algo, cfg, loss = load_recipe(REPO / "recipes" / "smollm2-135m-hydra.yaml").algorithm_configs()
    assert algo is HydraDrafter and (cfg.num_heads, cfg.num_layers, cfg.prefix_attention) == (4, 4, True)
    assert loss.targets == "target" and loss.kind == "ce"


# ---------------------------------------------------------------------------- the shared trainer
@pytest.mark.slow  # the shared trainer's resume is in the default suite (test_train.py); this family's with -m slow
def test_the_shared_trainer_trains_reports_and_resumes_a_killed_run(tiny_target_dirs, tmp_path):
    straight = _recipe(tmp_path, tiny_target_dirs["llama"], "straight")
    killed = _recipe(tmp_path, tiny_target_dirs["llama"], "killed", eval={"enabled": False})
    a = assert_resumes_bitwise("hydra", straight, killed)
    report = json.loads((tmp_path / "straight" / "eval" / "latest.json").read_text())
    assert report["greedy_match"] == "2/2" and report["step"] == 4 and len(report["alpha"]) == 3
    metrics = [json.loads(line) for line in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()]
    losses = [m["loss"] for m in metrics if "loss" in m]
    assert len(losses) == 4 and losses[-1] < losses[0]
