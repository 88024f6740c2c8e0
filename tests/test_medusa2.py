"""The Medusa-2 family on the tiny random llama: heads + LoRA adapters trained jointly, only they in
the checkpoint, the merged target equal to peft's own merge, decoding lossless w.r.t. the merged
target, the greedy divergence of merged vs original, export, kill-and-resume, one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import peft
import pytest
import torch

from draftlab.inference.ngram import NgramProposer
import torch.nn.functional as F
import yaml
from safetensors.torch import load_file

from draftlab import checkpoint as ckpt
from draftlab.errors import DraftlabError
from draftlab.export.medusa2 import export_merged_target
from draftlab.inference.decoder import SpeculativeDecoder, generate_plain
from draftlab.inference.medusa2 import greedy_divergence
from draftlab.inference.proposer import load_proposer
from draftlab.inference.shapes import Chain, StaticTree
from draftlab.models.medusa import MedusaConfig, MedusaDrafter
from draftlab.models.medusa2 import LORA_TARGETS, Medusa2Config, Medusa2Drafter, Medusa2Loss
from tiny import (assert_one_line, assert_resumes_bitwise, edit_checkpoint, final_hidden, padded_batch, random_samples, save_checkpoint,
                  write_chat)

REPO = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------------------- helpers
def _drafter(target, heads=2, vd=0, r=8, alpha=16, lora_scale=0.0, seed=1):
    """A fresh drafter; ``lora_scale`` > 0 draws B ~ N(0, lora_scale^2) (B = 0 is the identity)."""
    cfg = Medusa2Config(num_heads=heads, draft_vocab_size=vd, lora_r=r, lora_alpha=alpha)
    d = Medusa2Drafter.build(cfg, target, random_samples(target))
    if lora_scale:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in d.lora.named_parameters():
                if ".lora_B." in name:
                    p.copy_(torch.randn(p.shape, generator=g) * lora_scale)
    return d.eval()


def _peft_model(target_dir, drafter):
    """peft's own LoRA model of the target (get_peft_model) holding the drafter's adapters."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    cfg = LoraConfig(r=drafter.lora_r, lora_alpha=drafter.lora_alpha, target_modules=drafter.lora_targets, lora_dropout=0.0)
    model = get_peft_model(base, cfg)
    res = set_peft_model_state_dict(model, drafter.peft_state_dict())
    assert not res.unexpected_keys and not [k for k in res.missing_keys if "lora_" in k]
    return model.eval()


def _prompt(target, text="the quick brown fox"):
    return target.tokenizer(text, return_tensors="pt").input_ids[0]


def _merged(path, target):
    """The checkpoint's merged target, as decoding gets it: its proposer's verifier."""
    return load_proposer(path, target).verifier(target)


def _divergence(path, target, prompts, max_new_tokens):
    """The checkpoint's greedy divergence from ``target``, as an evaluation reports it (eos stops)."""
    report = load_proposer(path, target).verifier_report(target, prompts, max_new_tokens, target.tokenizer.eos_token_id)
    return report["divergence_from_original"]


# ---------------------------------------------------------------------------- the drafter
def test_checkpoint_holds_only_heads_and_lora_and_reloads(tiny_llama, tmp_path):
    t = tiny_llama
    d = _drafter(t, heads=2, r=8, lora_scale=0.2)
    state = load_file(save_checkpoint(d, t, tmp_path / "ckpt") / ckpt.WEIGHTS)
    heads = set(MedusaDrafter.build(MedusaConfig(num_heads=2), t).state_dict())
    lora = {f"lora.{i}.{p}.{ab}.weight" for i in range(t.num_layers) for p in LORA_TARGETS for ab in ("lora_A", "lora_B")}
    assert set(state) == heads | lora  # no base weight of the target
    assert state["lora.0.q_proj.lora_A.weight"].shape == (8, 64) and state["lora.0.k_proj.lora_B.weight"].shape == (32, 8)
    assert state["lora.3.down_proj.lora_A.weight"].shape == (8, 128) and state["lora.3.gate_proj.lora_B.weight"].shape == (128, 8)
    # the drafter's parameters are the heads and the adapters: nothing of the target, which stays unwrapped
    target_ptrs = {p.data_ptr() for p in t.model.parameters()}
    assert not any(p.data_ptr() in target_ptrs for p in d.parameters())
    assert sum(p.numel() for p in d.parameters()) == sum(v.numel() for k, v in state.items() if v.is_floating_point())
    assert not any(isinstance(m, peft.tuners.lora.LoraLayer) for m in t.model.modules())
    # a fresh drafter's adapted target is the original (B = 0)
    ids = random_samples(t, n=1)[0]["input_ids"][None]
    fresh = _drafter(t, r=8)
    assert all(not p.any() for k, p in fresh.state_dict().items() if ".lora_B." in k)
    with torch.no_grad():
        torch.testing.assert_close(fresh.adapted_hidden(ids), final_hidden(t, ids), rtol=0, atol=1e-5)
        # reloaded, the adapters its peft layers run are the saved ones
        d2, meta = ckpt.load_drafter(tmp_path / "ckpt", t)
        assert meta["drafter"]["lora_targets"] == list(LORA_TARGETS) and meta["drafter"]["lora_r"] == 8
        assert all(torch.equal(v, d2.state_dict()[k]) for k, v in d.state_dict().items())
        torch.testing.assert_close(d2.adapted_hidden(ids), d.adapted_hidden(ids), rtol=0, atol=0)
        assert (d.adapted_hidden(ids) - final_hidden(t, ids)).abs().max() > 1e-2


def test_training_loss_matches_peft_position_by_position(tiny_llama, tiny_target_dirs):
    """The LM term is KL(original || peft's adapted model) at the positions whose next token is a
    loss token; head i at t reads peft's adapted h'_t and is distilled to the original at t+1+i."""
    t = tiny_llama
    d = _drafter(t, heads=2, vd=48, lora_scale=0.1)
    rows, batch = padded_batch(t, 16, 11)
    cfg = Medusa2Loss(head_weight=0.5, decay=0.8, lm_weight=1.5)
    with torch.no_grad():
        loss, metrics = d.training_loss(batch, {t.num_layers: final_hidden(t, batch["input_ids"])}, cfg)
        model = _peft_model(tiny_target_dirs["llama"], d)
        kept = d.t2d.nonzero().squeeze(1).tolist()
        kls, terms, hits = [], [[], []], [[], []]
        for b, ids in enumerate(rows):
            adapted = model.base_model.model.model(ids[None]).last_hidden_state[0]
            logq = model(ids[None]).logits[0].log_softmax(-1)
            with model.disable_adapter():
                z0 = model(ids[None]).logits[0]
            p0 = z0.softmax(-1)
            for s in range(len(ids) - 1):
                if batch["loss_mask"][b, s + 1]:
                    kls.append(F.kl_div(logq[s], p0[s], reduction="sum"))
            for i in range(2):
                for pos in range(len(ids) - 2 - i):
                    if batch["loss_mask"][b, pos + 2 + i]:
                        s = pos + 1 + i
                        logh = d.head_logits(adapted[pos], i).log_softmax(-1)
                        terms[i].append(-(z0[s, kept].softmax(-1) * logh).sum())
                        hits[i].append(kept[int(logh.argmax())] == int(z0[s].argmax()))
    kl = torch.stack(kls).mean()
    want = 1.5 * kl + sum(0.5 * 0.8**i * torch.stack(terms[i]).mean() for i in range(2))
    assert metrics["lm_kl"] == pytest.approx(kl.item(), rel=1e-4, abs=1e-6) and kl > 1e-3
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-5)
    assert metrics["acc"] == pytest.approx([sum(h) / len(h) for h in hits])
    assert set(metrics) >= {"loss_heads", "acc", "top5", "lm_kl", "lm_agree"}


def _train(t, lm_weight, steps=15):
    torch.manual_seed(0)
    d = _drafter(t, heads=2, r=8).train()
    _, batch = padded_batch(t, 16, 11)
    hidden = {t.num_layers: final_hidden(t, batch["input_ids"])}
    batch = {**batch, **d.derived_targets(hidden, batch)}
    opt = torch.optim.Adam(d.parameters(), lr=1e-2)
    history = []
    for _ in range(steps):
        loss, metrics = d.training_loss(batch, hidden, Medusa2Loss(lm_weight=lm_weight))
        opt.zero_grad()
        loss.backward()
        opt.step()
        history.append((loss.item(), metrics))
    return d, history


def test_a_few_steps_lower_the_loss_and_keep_the_adapted_target_close(tiny_llama):
    t = tiny_llama
    d, hist = _train(t, lm_weight=1.0)
    losses, kls = [h[0] for h in hist], [h[1]["lm_kl"] for h in hist]
    assert kls[0] < 1e-6  # B = 0: the adapted target starts as the original
    assert losses[-1] < losses[0] - 0.2, losses
    assert hist[-1][1]["loss_heads"][0] < hist[0][1]["loss_heads"][0] - 0.5
    # Adam's first steps move every adapter by about lr; the KL term then pulls the adapted target back
    # (the random target's distributions are near-flat, its greedy token flips easily: the KL is the measure)
    assert kls[-1] < 0.02 and kls[-1] < max(kls) / 5, kls
    assert any(p.abs().max() > 0 for k, p in d.state_dict().items() if ".lora_B." in k)  # the heads' loss moved the adapters
    # without the KL leash the same steps pull the adapted target further from the original
    _, free = _train(t, lm_weight=0.0)
    assert free[-1][1]["lm_kl"] > 10 * kls[-1], (free[-1][1]["lm_kl"], kls[-1])


# ---------------------------------------------------------------------------- the merged target
def test_merged_target_equals_peft_merge_and_adapted_forward(tiny_llama, tiny_target_dirs, tmp_path):
    t = tiny_llama
    d = _drafter(t, heads=2, lora_scale=0.2)
    ids = random_samples(t, n=1, T=20)[0]["input_ids"][None]
    before = t(ids).logits.clone()
    merged = _merged(save_checkpoint(d, t, tmp_path / "ckpt"), t)
    ours = merged(ids).logits
    model = _peft_model(tiny_target_dirs["llama"], d)
    with torch.no_grad():
        unmerged = model(ids).logits
        adapted = t.lm_head(d.adapted_hidden(ids))
        peft_merged = model.merge_and_unload()
        theirs = peft_merged(ids).logits
    # the same weights as peft's own merge, bit for bit, and the same logits
    assert all(torch.equal(v, merged.model.state_dict()[k]) for k, v in peft_merged.state_dict().items())
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
    # = base + LoRA unmerged (peft's layers, the drafter's view): (W + BA)x vs Wx + B(Ax), rounding apart
    # (fp32 sums in another order: 1.4e-5 was seen once in a full suite run, on 2 of 8000 logits)
    for other in (unmerged, adapted):
        torch.testing.assert_close(ours, other, rtol=1e-5, atol=5e-5)
    assert (ours - before).abs().max() > 1e-2
    assert torch.equal(t(ids).logits, before)  # the original is untouched
    assert merged.identity["num_hidden_layers"] == t.num_layers and "medusa2" in merged.identity["name"]


@pytest.fixture(scope="module")
def fitted_ckpt(tiny_llama, tmp_path_factory):
    """Perturbed adapters (the merged target's greedy output moves) and heads fitted to the merged
    target's greedy continuation of the test prompt, so decoding accepts drafts."""
    t = tiny_llama
    torch.manual_seed(0)
    d = _drafter(t, heads=3, lora_scale=0.3, seed=2).train()
    path = save_checkpoint(d, t, tmp_path_factory.mktemp("medusa2") / "perturbed")
    merged = _merged(path, t)
    ids = torch.cat([_prompt(t), torch.tensor(generate_plain(merged, _prompt(t), 40).tokens)])[None]
    batch = {"input_ids": ids, "loss_mask": torch.ones_like(ids, dtype=torch.bool), "attention_mask": torch.ones_like(ids)}
    hidden = {t.num_layers: final_hidden(t, ids)}
    d.lora.requires_grad_(False)  # the heads learn the merged model; it stays as it is
    opt = torch.optim.Adam([p for p in d.parameters() if p.requires_grad], lr=3e-2)
    for _ in range(40):
        loss, metrics = d.training_loss(batch, hidden, Medusa2Loss(targets="data", head_weight=1.0, lm_weight=0.0))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return save_checkpoint(d.eval(), t, path.parent / "fitted")


@pytest.mark.parametrize("shape", [Chain(3), StaticTree(((0,), (1,), (0, 0), (0, 1), (0, 0, 0)))], ids=["chain", "static-tree"])
def test_speculative_decoding_with_the_merged_target_is_greedy_exact(tiny_llama, fitted_ckpt, shape):
    t = tiny_llama
    proposer = load_proposer(fitted_ckpt, t)
    merged = proposer.verifier(t)
    assert proposer.name == "medusa2" and proposer.verifier(t) is merged  # built once
    plain = generate_plain(merged, _prompt(t), 24)
    spec = SpeculativeDecoder(merged, proposer).generate(_prompt(t), 24, shape=shape)
    assert spec.tokens == plain.tokens and max(spec.accept_lengths) >= 2
    assert plain.tokens != generate_plain(t, _prompt(t), 24).tokens  # lossless w.r.t. the merged model, not the original


def test_greedy_divergence_is_zero_for_zero_lora_and_positive_when_perturbed(tiny_llama, fitted_ckpt, tmp_path):
    t = tiny_llama
    prompts = [_prompt(t, s).tolist() for s in ("the quick brown fox", "def add(a, b):", "Hello! How can I help")]
    zero = _divergence(save_checkpoint(_drafter(t), t, tmp_path / "zero"), t, prompts, 16)
    assert zero["prompts_differ"] == 0 and zero["share_tokens_differ"] == 0.0 and zero["tokens"] == sum(r["tokens"] for r in zero["per_prompt"]) > 0
    moved = _divergence(fitted_ckpt.parent / "perturbed", t, prompts, 16)
    assert moved["share_prompts_differ"] > 0 and 0 < moved["share_tokens_differ"] <= 1
    merged = _merged(fitted_ckpt.parent / "perturbed", t)
    for p, row in zip(prompts, moved["per_prompt"]):  # the tokens agree up to the first divergence, not at it
        eos = t.tokenizer.eos_token_id
        a, b = generate_plain(t, p, 16, eos_token_id=eos).tokens, generate_plain(merged, p, 16, eos_token_id=eos).tokens
        j = row["first_divergence"]
        assert (a == b) if j is None else (a[:j] == b[:j] and a[j:j + 1] != b[j:j + 1] and row["tokens_differ"] == max(len(a), len(b)) - j)
    assert moved["tokens_differ"] == sum(r["tokens_differ"] for r in moved["per_prompt"])
    same = greedy_divergence(t, t, prompts[:1], max_new_tokens=8)
    assert same["share_prompts_differ"] == 0 and same["per_prompt"][0]["first_divergence"] is None
    assert same["top1_agreement"] == 1.0 == zero["top1_agreement"] and moved["top1_agreement"] < 1.0


def test_reports_say_what_decoding_is_lossless_against(tiny_llama, fitted_ckpt):
    """A Medusa-2 evaluation states the merged target as the verifier and how far it moved."""
    from draftlab.inference.evaluate import evaluate
    from draftlab.inference.prompts import EvalPrompt
    from draftlab.inference.report import markdown

    t = tiny_llama
    prompts = [EvalPrompt("c", _prompt(t, s).tolist()) for s in ("the quick brown fox", "def add(a, b):")]
    report = evaluate(t, load_proposer(fitted_ckpt.parent / "perturbed", t), prompts, Chain(2), max_new_tokens=12, warmup=False)
    moved = report["verifier_check"]["divergence_from_original"]
    assert moved == greedy_divergence(t, _merged(fitted_ckpt.parent / "perturbed", t), [p.prompt_ids for p in prompts], 12)
    assert "Decoding is lossless with respect to the merged target" in markdown(report)
    assert "verifier_check" not in evaluate(t, NgramProposer(), prompts[:1], Chain(2), max_new_tokens=4, warmup=False)


def test_export_writes_the_merged_model_and_vllm_heads(tiny_llama, fitted_ckpt, tmp_path):
    from draftlab.models.target import Target

    t = tiny_llama
    out = export_merged_target(fitted_ckpt, t, tmp_path / "out")
    ids = random_samples(t, n=1, T=20)[0]["input_ids"][None]
    reloaded = Target.load(str(out / "target"))
    torch.testing.assert_close(reloaded(ids).logits, _merged(fitted_ckpt, t)(ids).logits, rtol=0, atol=1e-5)
    config = json.loads((out / "medusa" / "config.json").read_text())
    assert config["architectures"] == ["MedusaModel"] and config["num_heads"] == 3 and config["medusa_fc_bias"] is True
    state = load_file(out / "medusa" / "model.safetensors")
    d, _ = ckpt.load_drafter(fitted_ckpt, t)
    heads = {k: v for k, v in d.state_dict().items() if not k.startswith(("lora.", "d2t", "t2d"))}
    assert state.keys() == heads.keys() and all(torch.equal(state[k], heads[k]) for k in heads)
    assert f"vllm serve {out / 'target'}" in (out / "medusa" / "README.md").read_text()


# ---------------------------------------------------------------------------- the entry point
def _recipe(tmp_path, target_dir, name, eval_enabled):
    data = write_chat(tmp_path / "chat.jsonl", 24)
    recipe = {
        "algorithm": "medusa2", "output_dir": str(tmp_path / name), "target": {"model": str(target_dir)},
        "drafter": {"num_heads": 2, "lora_r": 4, "draft_vocab_size": 64},
        "data": {"source": str(data), "max_length": 96, "heldout": 2},
        "capture": {"mode": "online"},
        "train": {"max_steps": 4, "batch_tokens": 384, "checkpoint_every": 2, "warmup_steps": 1, "lr": 1e-2},
        "eval": {"enabled": eval_enabled, "num_prompts": 2, "max_new_tokens": 8, "k": 2},
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


@pytest.mark.slow  # the shared trainer's resume is in the default suite (test_train.py); this family's with -m slow
def test_train_entry_point_resumes_bitwise_after_a_kill(tmp_path, tiny_target_dirs):
    target_dir = tiny_target_dirs["llama"]
    a = assert_resumes_bitwise("medusa2", _recipe(tmp_path, target_dir, "straight", eval_enabled=True),
                               _recipe(tmp_path, target_dir, "killed", eval_enabled=False), timeout=300)
    assert any(k.startswith("lora.") for k in a) and not any("embed" in k or "self_attn.q_proj.weight" in k for k in a)
    report = json.loads((tmp_path / "straight" / "eval" / "latest.json").read_text())
    assert report["drafter"] == "medusa2" and report["greedy_match"] == "2/2"
    metrics = [json.loads(line) for line in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()]
    assert all(len(m["acc"]) == 2 and m["lm_kl"] >= 0 for m in metrics if "acc" in m)


# ---------------------------------------------------------------------------- one-line errors
@pytest.mark.parametrize(
    "override,match",
    [("drafter.lora_r=0", "drafter.lora_r: Input should be greater than or equal to 1"),
     ("drafter.lora_alpha=0", "drafter.lora_alpha: Input should be greater than 0"),
     ("drafter.lora_targets=[q_proj,qkv]", "drafter.lora_targets: unknown projection 'qkv' \\(choose from q_proj, "),
     ("drafter.lora_targets=[]", "drafter.lora_targets: needs a non-empty list"),
     ("drafter.lora_targets=[v_proj,v_proj]", "drafter.lora_targets: lists a projection twice"),
     ("drafter.lora_dropout=0.1", "drafter.lora_dropout: Extra inputs are not permitted"),
     ("loss.lm_weight=-1", "loss.lm_weight: Input should be greater than or equal to 0"),
     ("loss.head_weight=0", "loss.head_weight: Input should be greater than 0")],
)
def test_bad_recipes_are_one_line_errors(tmp_path, override, match):
    from draftlab.recipe import load_recipe

    path = tmp_path / "r.yaml"
    path.write_text(f"algorithm: medusa2\noutput_dir: {tmp_path / 'run'}\n")
    assert load_recipe(path).algorithm_configs()[2].head_weight == 0.2  # the defaults are a valid Medusa-2 recipe
    with pytest.raises(DraftlabError) as e:
        load_recipe(path, [override])
    assert_one_line(e, match)


@pytest.mark.parametrize(
    "case,edit,match",
    [
        ("rank 0", dict(meta=lambda m: m.update(lora_r=0)), r"drafter\.lora_r = 0 is outside 1\.\.64"),
        ("bad targets", dict(meta=lambda m: m.update(lora_targets=["qkv"])), r"drafter\.lora_targets = \[\"qkv\"\] is refused: unknown projection 'qkv'"),
        ("no alpha", dict(meta=lambda m: m.pop("lora_alpha")), "drafter meta lacks 'lora_alpha'"),
        ("other rank", dict(meta=lambda m: m.update(lora_r=4)), r"tensor lora\.0\.\w+_proj\.lora_A\.weight \(8, \d+\) .*expected \(4, \d+\)"),
        ("fewer targets", dict(meta=lambda m: m.update(lora_targets=["q_proj"])), r"missing \[\], unexpected \['lora\.0\.down_proj\.lora_A\.weight'"),
        ("missing adapter", dict(weights=lambda s: s.pop("lora.3.down_proj.lora_B.weight")), r"missing \['lora\.3\.down_proj\.lora_B\.weight'\]"),
    ],
)
def test_bad_checkpoints_are_one_line_errors(tiny_llama, tmp_path, case, edit, match):
    path = save_checkpoint(_drafter(tiny_llama), tiny_llama, tmp_path / "ckpt")
    edit_checkpoint(path, **edit)
    with pytest.raises(DraftlabError) as e:
        ckpt.load_drafter(path, tiny_llama)
    assert_one_line(e, match)


def test_merging_a_medusa1_checkpoint_is_refused(tiny_llama, tmp_path):
    d = MedusaDrafter.build(MedusaConfig(num_heads=2), tiny_llama)
    with pytest.raises(DraftlabError) as e:
        export_merged_target(save_checkpoint(d, tiny_llama, tmp_path / "m1"), tiny_llama, tmp_path / "out")
    assert_one_line(e, "a medusa checkpoint, not medusa2")
    assert not (tmp_path / "out").exists()
