"""The Medusa-1 family on the tiny random targets: heads, loss, training, lossless decoding
(chain and static tree), exports proven against vLLM's module layout and medusa-llm's own head
classes, and one-line errors for bad recipes, checkpoints and imports."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from safetensors.torch import load_file, save_file

from draftlab import checkpoint as ckpt
from draftlab.errors import DraftlabError
from draftlab.export.exporter import export_checkpoint
from draftlab.export.importer import import_checkpoint
from draftlab.inference.decoder import SpeculativeDecoder, generate_plain
from draftlab.inference.proposer import load_proposer
from draftlab.inference.shapes import Chain, DynamicTree, StaticTree
from draftlab.losses.medusa import data_loss, distill_loss, head_weights, topk_agreement
from draftlab.models.medusa import MedusaConfig, MedusaDrafter, MedusaLoss
from tiny import assert_one_line, edit_checkpoint, final_hidden, padded_batch, random_samples, save_checkpoint


# ---------------------------------------------------------------------------- helpers
def _drafter(target, heads=3, layers=1, vd=0, perturb=True):
    d = MedusaDrafter.build(MedusaConfig(num_heads=heads, num_layers=layers, draft_vocab_size=vd), target, random_samples(target, n=6))
    if perturb:  # every weight away from its init, so swapped or dropped tensors show
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in d.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return d.eval()


def _full_vocab_logits(d, logits):
    """Draft-vocab logits scattered onto the target vocabulary (-inf elsewhere)."""
    full = logits.new_full((*logits.shape[:-1], d.vocab_size), float("-inf"))
    full[..., d.to_target_ids(torch.arange(d.draft_vocab_size))] = logits
    return full


# ---------------------------------------------------------------------------- model
@pytest.mark.parametrize("vd", [0, 48])
def test_heads_shapes_and_zero_init_equal_the_target_lm_head(tiny_llama, vd):
    t = tiny_llama
    d = _drafter(t, heads=3, layers=2, vd=vd, perturb=False)
    V, H = t.vocab_size, t.hidden_size
    n = vd or V
    state = d.state_dict()
    assert set(state) == {f"blocks.{h}.layers.{l}.{p}" for h in range(3) for l in range(2) for p in ("weight", "bias")} | {
        f"lm_heads.{h}.weight" for h in range(3)} | {"d2t", "t2d"}  # no target tensor is part of the drafter
    assert all(state[f"lm_heads.{h}.weight"].shape == (n, H) for h in range(3))
    assert state["blocks.2.layers.1.weight"].shape == (H, H) and d.t2d.sum() == n
    assert d.blocks[0].layers[0] is not d.blocks[0].layers[1]  # distinct weights per block
    assert all(not p.any() for k, p in state.items() if k.startswith("blocks."))
    h = final_hidden(t, random_samples(t, n=1)[0]["input_ids"][None])
    ref = t.lm_head(h)[..., d.t2d]
    for i in range(3):
        torch.testing.assert_close(d.head_logits(h, i), ref, rtol=0, atol=1e-6)
    assert d.capture_layers == [t.num_layers] == MedusaDrafter.default_capture_layers(t.num_layers)
    assert torch.equal(d.to_draft_ids(d.to_target_ids(torch.arange(n))), torch.arange(n))


# ---------------------------------------------------------------------------- loss
def test_loss_functions_on_hand_computed_values():
    assert head_weights(3, 2.0, 0.5) == [2.0, 1.0, 0.5]
    logits = torch.tensor([[0.0, 0.0], [1.0, 0.0]])
    p = torch.tensor([[1.0, 0.0], [0.5, 0.5]])
    ln2, l1 = torch.log(torch.tensor(2.0)), torch.log1p(torch.exp(torch.tensor(-1.0)))
    # rows: -log(1/2); -(0.5 log sigmoid(1) + 0.5 log sigmoid(-1)) = log(1 + e^-1) + 0.5
    torch.testing.assert_close(distill_loss(logits, p), (ln2 + l1 + 0.5) / 2)
    torch.testing.assert_close(data_loss(logits, torch.tensor([1, -1])), ln2)  # -1: outside the draft vocab
    assert data_loss(logits, torch.tensor([-1, -1])).item() == 0.0
    ranked = torch.tensor([[4, 5], [6, 7], [8, 9]])
    assert topk_agreement(ranked, torch.tensor([4, 7, 1])) == pytest.approx((1 / 3, 2 / 3))
    assert topk_agreement(ranked[:0], torch.tensor([], dtype=torch.long)) == (0.0, 0.0)


@pytest.mark.parametrize("targets", ["target", "data"])
def test_training_loss_matches_a_position_by_position_computation(tiny_llama, targets):
    t = tiny_llama
    d = _drafter(t, heads=3, layers=2, vd=48)
    rows, batch = padded_batch(t, 14, 9)
    cfg = MedusaLoss(head_weight=1.5, decay=0.8, targets=targets)
    loss, metrics = d.training_loss(batch, {t.num_layers: final_hidden(t, batch["input_ids"])}, cfg)

    W, kept = t.lm_head.weight, d.t2d.nonzero().squeeze(1).tolist()
    want, acc = torch.zeros(()), []
    for i in range(3):
        terms, hits = [], []
        for b, ids in enumerate(rows):
            f = final_hidden(t, ids[None])[0]
            for pos in range(len(ids) - 2 - i):
                if not batch["loss_mask"][b, pos + 2 + i]:
                    continue
                s = pos + 1 + i  # the target's position predicting the same token x_{pos+2+i}
                logq = d.head_logits(f[pos], i).log_softmax(-1)
                tok = int(ids[pos + 2 + i])
                if targets == "target":
                    terms.append(-((W[kept] @ f[s]).softmax(-1) * logq).sum())
                elif tok in kept:
                    terms.append(-logq[kept.index(tok)])
                hits.append(kept[int(logq.argmax())] == int((W @ f[s]).argmax()))
        want = want + 1.5 * 0.8**i * torch.stack(terms).mean()
        acc.append(sum(hits) / len(hits))
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-5)
    assert metrics["acc"] == pytest.approx(acc) and len(metrics["top5"]) == 3
    assert all(a5 >= a1 for a1, a5 in zip(metrics["acc"], metrics["top5"]))
    # the cached derived target gives the same loss
    cached = {**batch, **d.derived_targets({t.num_layers: final_hidden(t, batch["input_ids"])}, batch)}
    assert d.training_loss(cached, {t.num_layers: final_hidden(t, batch["input_ids"])}, cfg)[0].item() == pytest.approx(loss.item())


def test_a_few_training_steps_lower_the_loss(tiny_llama):
    t = tiny_llama
    torch.manual_seed(0)
    d = _drafter(t, heads=2, layers=1, perturb=False).train()
    _, batch = padded_batch(t, 14, 9)
    hidden = {t.num_layers: final_hidden(t, batch["input_ids"])}
    batch = {**batch, **d.derived_targets(hidden, batch)}
    opt = torch.optim.Adam(d.parameters(), lr=1e-2)
    losses = []
    for _ in range(12):
        loss, _ = d.training_loss(batch, hidden, MedusaLoss())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    # soft CE is bounded below by the target's entropy: steady descent is the claim
    assert all(b < a for a, b in zip(losses, losses[1:])) and losses[-1] < losses[0] - 1.0, losses


# ---------------------------------------------------------------------------- decoding
def _prompt(target):
    return target.tokenizer("the quick brown fox", return_tensors="pt").input_ids[0]


@pytest.fixture(scope="module")
def medusa_ckpt(tiny_llama, tmp_path_factory):
    """Heads fitted to the target's own greedy continuation of the test prompt (Medusa's
    self-distillation on one sequence), so decoding accepts drafts and every path of the
    verifier and of ``advance`` runs."""
    t = tiny_llama
    torch.manual_seed(0)
    d = _drafter(t, heads=3, layers=1, perturb=False).train()
    ids = torch.cat([_prompt(t), torch.tensor(generate_plain(t, _prompt(t), 40).tokens)])[None]
    batch = {"input_ids": ids, "loss_mask": torch.ones_like(ids, dtype=torch.bool), "attention_mask": torch.ones_like(ids)}
    hidden = {t.num_layers: final_hidden(t, ids)}
    opt = torch.optim.Adam(d.parameters(), lr=3e-2)
    for _ in range(40):
        loss, metrics = d.training_loss(batch, hidden, MedusaLoss(targets="data"))
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert min(metrics["acc"]) > 0.8
    return save_checkpoint(d.eval(), t, tmp_path_factory.mktemp("medusa") / "ckpt")


@pytest.mark.parametrize(
    "shape", [Chain(3), Chain(5), Chain(3, min_confidence=0.01), StaticTree(((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)))],
    ids=["chain3", "chain5-more-than-heads", "chain-min-confidence", "static-tree"],
)
def test_greedy_speculative_decoding_equals_plain_greedy(tiny_llama, medusa_ckpt, shape):
    t = tiny_llama
    proposer = load_proposer(medusa_ckpt, t)
    plain = generate_plain(t, _prompt(t), 24)
    spec = SpeculativeDecoder(t, proposer).generate(_prompt(t), 24, shape=shape)
    assert spec.tokens == plain.tokens
    assert max(spec.num_drafted) <= (3 if isinstance(shape, Chain) else len(shape.choices))
    assert max(spec.accept_lengths) == 3  # the fitted heads' drafts are accepted in full


def test_sampled_decoding_runs_and_is_seeded(tiny_llama, medusa_ckpt):
    t = tiny_llama
    dec = SpeculativeDecoder(t, load_proposer(medusa_ckpt, t))
    for shape in (Chain(3), StaticTree(((0,), (1,), (0, 0)))):
        a = dec.generate(_prompt(t), 16, shape=shape, temperature=0.8, seed=5)
        b = dec.generate(_prompt(t), 16, shape=shape, temperature=0.8, seed=5)
        assert len(a.tokens) == 16 and a.tokens == b.tokens


def test_proposer_refuses_trees_its_heads_cannot_fill(tiny_llama, medusa_ckpt):
    dec = SpeculativeDecoder(tiny_llama, load_proposer(medusa_ckpt, tiny_llama))
    with pytest.raises(DraftlabError, match="depth 4 needs 4 Medusa heads, this drafter has 3"):
        dec.generate(_prompt(tiny_llama), 8, shape=StaticTree(((0,), (0, 0), (0, 0, 0), (0, 0, 0, 0))))
    with pytest.raises(DraftlabError, match="does not draft dynamic_tree"):
        dec.generate(_prompt(tiny_llama), 8, shape=DynamicTree())


# ---------------------------------------------------------------------------- exports
def vllm_medusa_parameters(config: dict) -> dict[str, tuple[int, ...]]:
    """The tensors vLLM's ``Medusa`` module (model_executor/models/medusa.py) creates for a
    config and ``load_weights`` reads, with their shapes: ``blocks.{h}`` are ResidualBlocks of
    ``num_hidden_layers`` Linear(H, H, bias=medusa_fc_bias) named ``layers.{l}``; ``lm_heads.{h}``
    ParallelLMHead(truncated_vocab_size, H) (padded to 64 rows in memory, loaded from these
    rows); ``token_map`` is read only when truncated_vocab_size < vocab_size."""
    H, V = config["hidden_size"], config["vocab_size"]
    vd = config.get("truncated_vocab_size") or V
    out: dict[str, tuple[int, ...]] = {}
    for h in range(config["num_heads"]):
        for l in range(config["num_hidden_layers"]):
            out[f"blocks.{h}.layers.{l}.weight"] = (H, H)
            if config.get("medusa_fc_bias", False):
                out[f"blocks.{h}.layers.{l}.bias"] = (H,)
        out[f"lm_heads.{h}.weight"] = (vd, H)
    if vd < V:
        out["token_map"] = (vd,)
    return out


def vllm_medusa_logits(state: dict, config: dict, h: torch.Tensor) -> list[torch.Tensor]:
    """vLLM's Medusa forward + compute_logits: x + SiLU(Wx + b) per block, the head's lm_head,
    then logits scattered onto the full vocabulary through token_map (-inf elsewhere)."""
    out = []
    for head in range(config["num_heads"]):
        x = h
        for l in range(config["num_hidden_layers"]):
            x = x + F.silu(F.linear(x, state[f"blocks.{head}.layers.{l}.weight"], state.get(f"blocks.{head}.layers.{l}.bias")))
        logits = F.linear(x, state[f"lm_heads.{head}.weight"])
        if "token_map" in state:
            full = logits.new_full((*logits.shape[:-1], config["vocab_size"]), float("-inf"))
            full[..., state["token_map"]] = logits
            logits = full
        out.append(logits)
    return out


@pytest.mark.parametrize("vd,layers", [(0, 2), (48, 1)])
def test_vllm_export_is_what_vllms_medusa_module_loads(tiny_llama, tmp_path, vd, layers):
    t = tiny_llama
    d = _drafter(t, heads=3, layers=layers, vd=vd)
    out = export_checkpoint(save_checkpoint(d, t, tmp_path / "ckpt"), "vllm", tmp_path / "vllm", t)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["MedusaModel"] and config["model_type"] == "medusa"
    assert {k: config[k] for k in ("num_heads", "num_hidden_layers", "hidden_size", "vocab_size", "truncated_vocab_size")} == {
        "num_heads": 3, "num_hidden_layers": layers, "hidden_size": t.hidden_size, "vocab_size": t.vocab_size,
        "truncated_vocab_size": vd or t.vocab_size}
    assert config["medusa_fc_bias"] is True
    state = load_file(out / "model.safetensors")
    assert {k: tuple(v.shape) for k, v in state.items()} == vllm_medusa_parameters(config)
    h = final_hidden(t, random_samples(t, n=1)[0]["input_ids"][None])
    with torch.no_grad():
        for i, theirs in enumerate(vllm_medusa_logits(state, config, h)):
            torch.testing.assert_close(theirs, _full_vocab_logits(d, d.head_logits(h, i)), rtol=0, atol=1e-5)
    assert "method\": \"medusa\"" in (out / "README.md").read_text()


def _round_trip(d, t, tmp_path, engine, fmt):
    out = export_checkpoint(save_checkpoint(d, t, tmp_path / "ckpt"), engine, tmp_path / engine, t)
    d2, meta = ckpt.load_drafter(import_checkpoint(out, fmt, tmp_path / f"{fmt}-back", t), t)
    assert meta["imported_from"]["format"] == fmt and meta["drafter"] == d.meta()
    a, b = d.state_dict(), d2.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    return out


@pytest.mark.parametrize("vd", [0, 48])
def test_vllm_round_trip_is_identical(tiny_llama, tmp_path, vd):
    _round_trip(_drafter(tiny_llama, heads=3, layers=2, vd=vd), tiny_llama, tmp_path, "vllm", "medusa-vllm")


def test_fasterdecoding_round_trip_is_identical_from_either_file(tiny_llama, tmp_path):
    t = tiny_llama
    d = _drafter(t, heads=3, layers=2)
    out = _round_trip(d, t, tmp_path, "medusa", "medusa")
    config = json.loads((out / "config.json").read_text())
    assert config["medusa_num_heads"] == 3 and config["medusa_num_layers"] == 2 and config["base_model_name_or_path"]
    st, pt = load_file(out / "medusa_lm_head.safetensors"), torch.load(out / "medusa_lm_head.pt", weights_only=True)
    assert st.keys() == pt.keys() == {f"{h}.{l}.linear.{p}" for h in range(3) for l in range(2) for p in ("weight", "bias")} | {
        f"{h}.2.weight" for h in range(3)}
    assert all(torch.equal(st[k], pt[k]) for k in st)
    (out / "medusa_lm_head.safetensors").unlink()  # loaders that ship only the .pt
    d2, _ = ckpt.load_drafter(import_checkpoint(out, "medusa", tmp_path / "from-pt", t), t)
    assert all(torch.equal(v, d2.state_dict()[k]) for k, v in d.state_dict().items())


def test_medusa_llm_loads_the_export_and_its_heads_match(tiny_llama, tiny_target_dirs, tmp_path):
    mm = pytest.importorskip("medusa.model.medusa_model")
    t = tiny_llama
    d = _drafter(t, heads=3, layers=1)  # medusa-llm repeats one ResBlock object per head: 1 block
    out = export_checkpoint(save_checkpoint(d, t, tmp_path / "ckpt"), "medusa", tmp_path / "medusa", t)
    config = json.loads((out / "config.json").read_text())
    # what MedusaModel.from_pretrained does after loading its base model: build the heads, load the .pt
    model = mm.MedusaModel(t.model, config["medusa_num_heads"], config["medusa_num_layers"], str(tiny_target_dirs["llama"]))
    model.medusa_head.load_state_dict(torch.load(out / "medusa_lm_head.pt", weights_only=True), strict=True)
    ids = random_samples(t, n=1)[0]["input_ids"][None]
    with torch.no_grad():
        theirs = model(ids)  # [heads, B, T, V] from the base model's last hidden state
        ours = torch.stack([d.head_logits(final_hidden(t, ids), i) for i in range(3)])
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-5)


def test_vllm_import_reads_other_writers_conventions(tiny_llama, tmp_path):
    """A ``medusa_heads.`` prefix, FasterDecoding-style count keys, a token_map in frequency
    order and ``logit_scale`` are all read as vLLM reads them: the same drafter comes back."""
    t = tiny_llama
    d = _drafter(t, heads=2, layers=1, vd=48)
    out = export_checkpoint(save_checkpoint(d, t, tmp_path / "ckpt"), "vllm", tmp_path / "vllm", t)
    state, config = load_file(out / "model.safetensors"), json.loads((out / "config.json").read_text())
    perm = torch.randperm(48, generator=torch.Generator().manual_seed(0))
    state["token_map"] = state["token_map"][perm].contiguous()
    for h in range(2):
        state[f"lm_heads.{h}.weight"] = (state[f"lm_heads.{h}.weight"][perm] / 2).contiguous()  # x 2 by logit_scale
    save_file({f"medusa_heads.{k}": v for k, v in state.items()}, out / "model.safetensors")
    config["medusa_num_heads"], config["medusa_num_layers"] = config.pop("num_heads"), config.pop("num_hidden_layers")
    config["logit_scale"] = 2.0
    (out / "config.json").write_text(json.dumps(config))
    d2, _ = ckpt.load_drafter(import_checkpoint(out, "medusa-vllm", tmp_path / "back", t), t)
    assert all(torch.equal(v, d2.state_dict()[k]) for k, v in d.state_dict().items())


def test_vllm_import_original_lm_head_shares_head_zero(tiny_llama, tmp_path):
    t = tiny_llama
    d = _drafter(t, heads=3, layers=1)
    with torch.no_grad():
        for head in d.lm_heads[1:]:
            head.weight.copy_(d.lm_heads[0].weight)
    out = export_checkpoint(save_checkpoint(d, t, tmp_path / "ckpt"), "vllm", tmp_path / "vllm", t)
    state, config = load_file(out / "model.safetensors"), json.loads((out / "config.json").read_text())
    save_file({k: v for k, v in state.items() if not k.startswith(("lm_heads.1.", "lm_heads.2."))}, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps({**config, "original_lm_head": True}))
    d2, _ = ckpt.load_drafter(import_checkpoint(out, "medusa-vllm", tmp_path / "back", t), t)
    assert all(torch.equal(v, d2.state_dict()[k]) for k, v in d.state_dict().items())


# ---------------------------------------------------------------------------- one-line errors
@pytest.mark.parametrize(
    "override,match",
    [("drafter.num_heads=0", "drafter.num_heads: Input should be greater than or equal to 1"),
     ("drafter.num_layers=0", "drafter.num_layers"), ("drafter.heads=3", "drafter.heads: Extra inputs"),
     ("loss.targets=logits", "loss.targets: Input should be 'target' or 'data'"), ("loss.decay=0", "loss.decay")],
)
def test_bad_recipes_are_one_line_errors(tmp_path, override, match):
    from draftlab.recipe import load_recipe

    path = tmp_path / "r.yaml"
    path.write_text(f"algorithm: medusa\noutput_dir: {tmp_path / 'run'}\n")
    load_recipe(path)  # the defaults are a valid Medusa recipe
    with pytest.raises(DraftlabError) as e:
        load_recipe(path, [override])
    assert_one_line(e, match)


@pytest.mark.parametrize(
    "case,edit,match",
    [
        ("no heads", dict(meta=lambda m: m.update(num_heads=0)), r"drafter\.num_heads = 0 is outside 1\.\.64"),
        ("vocab too big", dict(meta=lambda m: m.update(draft_vocab_size=10**6)), r"drafter\.draft_vocab_size = 1000000 is outside 1\.\.400"),
        ("other hidden size", dict(meta=lambda m: m.update(hidden_size=32)), r"drafter\.hidden_size = 32 is not the target's hidden size 64"),
        ("missing field", dict(meta=lambda m: m.pop("num_layers")), "drafter meta lacks 'num_layers'"),
        ("missing head", dict(weights=lambda s: s.pop("lm_heads.2.weight")), r"missing \['lm_heads\.2\.weight'\]"),
        ("extra head", dict(meta=lambda m: m.update(num_heads=4)), r"missing \['blocks\.3\.layers\.0\.weight'"),
        ("wrong shape", dict(weights=lambda s: s.update({"blocks.0.layers.0.bias": torch.zeros(3)})), r"blocks\.0\.layers\.0\.bias \(3,\)"),
    ],
)
def test_bad_checkpoints_are_one_line_errors(tiny_llama, tmp_path, case, edit, match):
    path = save_checkpoint(_drafter(tiny_llama, heads=3, perturb=False), tiny_llama, tmp_path / "ckpt")
    edit_checkpoint(path, **edit)
    with pytest.raises(DraftlabError) as e:
        ckpt.load_drafter(path, tiny_llama)
    assert_one_line(e, match)


def _vllm_export(t, tmp_path, vd=48):
    return export_checkpoint(save_checkpoint(_drafter(t, heads=2, vd=vd), t, tmp_path / "ckpt"), "vllm", tmp_path / "vllm", t)


def _rewrite(out, config=None, tensors=None, weights="model.safetensors"):
    if config:
        c = json.loads((out / "config.json").read_text())
        config(c)
        (out / "config.json").write_text(json.dumps(c))
    if tensors:
        s = load_file(out / weights)
        tensors(s)
        save_file(s, out / weights)


BAD_VLLM = {
    "no hidden_size": (dict(config=lambda c: c.pop("hidden_size")), r"hidden_size 4096 \(vLLM default\) does not match the target's 64"),
    "other vocab": (dict(config=lambda c: c.update(vocab_size=500)), "vocab_size 500 does not match the target's"),
    "not medusa": (dict(config=lambda c: c.update(model_type="eagle")), "model_type is 'eagle'"),
    "zero heads": (dict(config=lambda c: c.update(num_heads=0)), "num_heads 0, .* must be integers >= 1"),
    "no token_map": (dict(tensors=lambda s: s.pop("token_map")), "truncated_vocab_size 48 < vocab_size .* needs a token_map"),
    "token_map repeats": (dict(tensors=lambda s: s.update(token_map=torch.zeros(48, dtype=torch.long))), "distinct target ids"),
    "token_map too large": (dict(tensors=lambda s: s.update(token_map=s["token_map"] + 1000)), r"outside the target vocabulary \[0, 400\)"),
    "biases vLLM would skip": (dict(config=lambda c: c.update(medusa_fc_bias=False)), "medusa_fc_bias is false, so vLLM .* ignores"),
    "unknown tensor": (dict(tensors=lambda s: s.update({"blocks.0.layers.5.weight": torch.zeros(2)})), r"unknown blocks\.0\.layers\.5\.weight"),
    "missing tensor": (dict(tensors=lambda s: s.pop("lm_heads.1.weight")), r"missing lm_heads\.1\.weight"),
}


@pytest.mark.parametrize("case", sorted(BAD_VLLM))
def test_bad_vllm_imports_are_one_line_errors(tiny_llama, tmp_path, case):
    edit, match = BAD_VLLM[case]
    out = _vllm_export(tiny_llama, tmp_path)
    _rewrite(out, **edit)
    with pytest.raises(DraftlabError) as e:
        import_checkpoint(out, "medusa-vllm", tmp_path / "back", tiny_llama)
    assert_one_line(e, match)
    assert not (tmp_path / "back").exists()


def test_fasterdecoding_export_refuses_a_reduced_vocabulary(tiny_llama, tmp_path):
    with pytest.raises(DraftlabError) as e:
        export_checkpoint(save_checkpoint(_drafter(tiny_llama, vd=48), tiny_llama, tmp_path / "ckpt"), "medusa", tmp_path / "out", tiny_llama)
    assert_one_line(e, r"--to medusa: FasterDecoding's Medusa heads project onto the full vocabulary .* export --to vllm")
    assert not (tmp_path / "out").exists()


FD_WEIGHTS = "medusa_lm_head.safetensors"
BAD_FASTERDECODING = {
    "no layer count": (lambda o: _rewrite(o, config=lambda c: c.pop("medusa_num_layers")), "medusa_num_layers must be an integer >= 1, got None"),
    "wrong layer count": (lambda o: _rewrite(o, config=lambda c: c.update(medusa_num_layers=2)), r"missing tensor 0\.2\.weight"),
    "stray head": (lambda o: _rewrite(o, tensors=lambda s: s.update({"3.1.weight": s["0.1.weight"].clone()}), weights=FD_WEIGHTS),
                   r"tensors 3\.1\.weight do not fit 2 heads"),
    "missing bias": (lambda o: _rewrite(o, tensors=lambda s: s.pop("1.0.linear.bias"), weights=FD_WEIGHTS), r"missing 1\.0\.linear\.bias"),
    "no weights": (lambda o: (o / FD_WEIGHTS).unlink(), r"no medusa_lm_head\.safetensors or medusa_lm_head\.pt"),
}


@pytest.mark.parametrize("case", sorted(BAD_FASTERDECODING))
def test_bad_fasterdecoding_imports_are_one_line_errors(tiny_llama, tmp_path, case):
    edit, match = BAD_FASTERDECODING[case]
    t = tiny_llama
    out = export_checkpoint(save_checkpoint(_drafter(t, heads=2), t, tmp_path / "ckpt"), "medusa", tmp_path / "fd", t)
    (out / "medusa_lm_head.pt").unlink()  # the .safetensors is read first: edit that one alone
    edit(out)
    with pytest.raises(DraftlabError) as e:
        import_checkpoint(out, "medusa", tmp_path / "back", t)
    assert_one_line(e, match)


# ---------------------------------------------------------------------------- the entry point
def test_train_entry_point_trains_and_reports_a_static_tree(tmp_path, tiny_target_dirs):
    """train/medusa.py end to end on the tiny target: memory capture (derived targets cached),
    checkpoints, and the after-checkpoint acceptance report decoded with a static tree."""
    repo = Path(__file__).resolve().parent.parent
    words = "the quick brown fox jumps over the lazy dog and the target verifies what the heads draft".split()
    with open(tmp_path / "chat.jsonl", "w") as f:
        for i in range(12):
            reply = " ".join(words[(i + j) % len(words)] for j in range(20))
            f.write(json.dumps({"messages": [{"role": "user", "content": " ".join(words[i:i + 5])},
                                             {"role": "assistant", "content": reply}]}) + "\n")
    recipe = {
        "algorithm": "medusa", "output_dir": str(tmp_path / "run"), "target": {"model": str(tiny_target_dirs["llama"])},
        "drafter": {"num_heads": 2, "draft_vocab_size": 64},
        "data": {"source": str(tmp_path / "chat.jsonl"), "max_length": 96, "heldout": 2},
        "capture": {"mode": "memory"},
        "train": {"max_steps": 4, "batch_tokens": 512, "checkpoint_every": 4, "warmup_steps": 1, "lr": 1e-2},
        "eval": {"num_prompts": 2, "max_new_tokens": 8, "method": "static_tree", "static_tree": [[0], [1], [0, 0]]},
    }
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    res = subprocess.run([sys.executable, "train/medusa.py", str(tmp_path / "r.yaml")], cwd=repo, capture_output=True, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    report = json.loads((tmp_path / "run" / "eval" / "latest.json").read_text())
    assert report["greedy_match"] == "2/2" and report["step"] == 4
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(len(m["acc"]) == len(m["top5"]) == 2 for m in metrics if "acc" in m)
