"""The draft_lm family's model and losses on the tiny random targets: construction from the
target's layers or at random, its metadata schema, every divergence (chunked, top-k with the rest
mass), on-policy batches (the draft's own samples), and a short run of the shared trainer whose
checkpoint loads back and resumes exactly after a kill."""

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
from safetensors.torch import load_file

from draftlab import checkpoint as ckpt
from draftlab.errors import DraftlabError
from draftlab.losses.draft_lm import KINDS, DraftLMLoss, bucket_top_k, distill_loss, row_loss
from draftlab.models.draft_lm import DraftLM, DraftLMConfig, spread_layers
from draftlab.models.target import Target
from tiny import assert_one_line, assert_resumes_bitwise, edit_checkpoint, final_hidden, padded_batch, save_checkpoint, write_chat

REPO = Path(__file__).resolve().parent.parent


def _batch(t):
    _, batch = padded_batch(t, 16, 11)
    return batch, {t.num_layers: final_hidden(t, batch["input_ids"])}


# ---------------------------------------------------------------------------- construction
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_built_from_the_target_its_weights_are_the_chosen_layers(tiny_target_dirs, family):
    t = Target.load(str(tiny_target_dirs[family]))
    d = DraftLM.build(DraftLMConfig(num_layers=2, target_layers=[3, 1]), t)
    assert d.meta()["target_layers"] == [3, 1] and d.lm.config.num_hidden_layers == 2
    state = d.state_dict()
    assert all(k.startswith("lm.") for k in state)
    for j, i in enumerate([3, 1]):
        for name, w in t.decoder_layer_state(i).items():
            assert torch.equal(state[f"lm.model.layers.{j}.{name}"], w), name
    assert torch.equal(state["lm.model.embed_tokens.weight"], t.embed_tokens.weight)
    assert torch.equal(state["lm.model.norm.weight"], t.final_norm.weight)
    tied = t.config.tie_word_embeddings
    assert d.tied == tied and ("lm.lm_head.weight" in state) != tied  # a tied head is stored once
    assert torch.equal(d.lm.lm_head.weight, t.lm_head.weight)
    assert d.capture_layers == [t.num_layers] == DraftLM.default_capture_layers(t.num_layers)
    hf = d.hf_config()
    assert hf["architectures"] == [type(t.model).__name__] and hf["model_type"] == family and hf["num_hidden_layers"] == 2


def test_every_target_layer_in_order_is_the_target_itself(tiny_llama):
    t = tiny_llama
    d = DraftLM.build(DraftLMConfig(num_layers=t.num_layers), t)
    assert d.target_layers == list(range(t.num_layers))
    ids = padded_batch(t, 16, 16)[1]["input_ids"]
    torch.testing.assert_close(d.lm(ids).logits, t(ids).logits, rtol=1e-4, atol=1e-4)


def test_default_layers_are_spread_with_the_first_and_last():
    assert spread_layers(4, 30) == [0, 10, 19, 29]
    assert spread_layers(2, 4) == [0, 3] and spread_layers(1, 4) == [0] and spread_layers(4, 4) == [0, 1, 2, 3]
    for L in range(1, 40):
        for n in range(1, L + 1):
            layers = spread_layers(n, L)
            assert len(set(layers)) == n and layers[0] == 0 and (n == 1 or layers[-1] == L - 1)


def test_random_init_narrower_and_checkpoint_round_trip(tiny_target_dirs, tmp_path):
    t = Target.load(str(tiny_target_dirs["qwen2"]))  # tied embeddings
    torch.manual_seed(0)
    d = DraftLM.build(DraftLMConfig(num_layers=3, init="random", hidden_size=32, intermediate_size=48, num_attention_heads=2,
                                    num_key_value_heads=1), t)
    m = d.meta()
    assert m["init"] == "random" and m["target_layers"] == [] and m["config"]["head_dim"] == 16
    assert d.lm.model.embed_tokens.weight.shape == (t.vocab_size, 32) and len(d.lm.model.layers) == 3
    assert d.tied
    path = save_checkpoint(d, t, tmp_path / "ckpt")
    assert "lm.lm_head.weight" not in load_file(path / ckpt.WEIGHTS)
    back, _ = ckpt.load_drafter(path, t)
    assert back.tied and back.meta() == m
    assert all(torch.equal(v, back.state_dict()[k]) for k, v in d.state_dict().items())
    ids = padded_batch(t, 12, 12)[1]["input_ids"]
    torch.testing.assert_close(back.lm(ids).logits, d.lm(ids).logits)


@pytest.mark.parametrize(
    "section,match",
    [
        (dict(drafter=dict(init="target", hidden_size=32)), "drafter.init: .*hidden_size must be the target's"),
        (dict(drafter=dict(init="random", target_layers=[0])), "drafter.init: .*leave target_layers out"),
        (dict(drafter=dict(num_layers=0)), "drafter.num_layers"),
        (dict(loss=dict(kind="ce", ce_weight=0.5)), "loss.ce_weight: .*kind ce is cross-entropy alone"),
        (dict(loss=dict(kind="jsd", beta=1.0)), "loss.beta: Input should be less than 1"),
        (dict(loss=dict(top_k=-1)), "loss.top_k"),
        (dict(loss=dict(temperature=0)), "loss.temperature"),
    ],
)
def test_bad_recipe_sections_are_one_line_errors(tmp_path, section, match):
    from draftlab.recipe import load_recipe

    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({"algorithm": "draft_lm", "output_dir": str(tmp_path / "run"), **section}))
    with pytest.raises(DraftlabError) as e:
        load_recipe(path)
    assert_one_line(e, match)


def test_build_refuses_more_layers_than_the_target(tiny_llama):
    with pytest.raises(DraftlabError) as e:
        DraftLM.build(DraftLMConfig(num_layers=5), tiny_llama)
    assert_one_line(e, r"drafter\.num_layers = 5 is more than the target's 4 layers")
    with pytest.raises(DraftlabError) as e:
        DraftLM.build(DraftLMConfig(num_layers=2, target_layers=[1, 4]), tiny_llama)
    assert_one_line(e, r"drafter\.target_layers\[1\] = 4 is outside 0\.\.3")


# ---------------------------------------------------------------------------- metadata schema
BAD_META = {
    "vocab mismatch": (lambda m: m["config"].update(vocab_size=500), r"drafter\.config\.vocab_size = 500 is not the target's vocabulary size 400"),
    "layer beyond the target": (lambda m: m.update(target_layers=[0, 4]), r"drafter\.target_layers\[1\] = 4 is outside 0\.\.3"),
    "bool where int": (lambda m: m["config"].update(num_hidden_layers=True), r"drafter\.config\.num_hidden_layers = true is not an integer"),
    "float where int": (lambda m: m["config"].update(intermediate_size=128.0),
                        r"drafter\.config\.intermediate_size = 128\.0 is not an integer"),
    "other family": (lambda m: m["config"].update(model_type="qwen2"),
                     r"drafter\.config\.model_type = \"qwen2\" is not the target's model type llama"),
    "layer repeated": (lambda m: m.update(target_layers=[2, 2]), r"drafter\.target_layers = \[2, 2\] repeats 2"),
    "mapping too short": (lambda m: m.update(target_layers=[0]), r"drafter\.target_layers = \[0\] names 1 target layers for 2 draft layers"),
    "random with a mapping": (lambda m: m.update(init="random"), r"drafter\.target_layers = \[0, 3\] is not empty, but init random"),
    "unknown init": (lambda m: m.update(init="copy"), r"drafter\.init = \"copy\""),
    "kv heads": (lambda m: m["config"].update(num_key_value_heads=3), r"num_key_value_heads = 3 does not divide num_attention_heads 4"),
    "missing field": (lambda m: m["config"].pop("rms_norm_eps"), "drafter meta lacks 'config.rms_norm_eps'"),
    "unknown field": (lambda m: m.update(shape=1), "drafter.shape is not a field of draft_lm drafter meta"),
    "nan rope theta": (lambda m: m["config"]["rope_parameters"].update(rope_theta=float("nan")),
                       r"drafter\.config\.rope_parameters = .* has rope_theta nan, not a finite number"),
}


@pytest.mark.parametrize("case", sorted(BAD_META))
def test_bad_meta_is_a_one_line_error_on_load(tiny_llama, tmp_path, case):
    edit, match = BAD_META[case]
    path = save_checkpoint(DraftLM.build(DraftLMConfig(num_layers=2), tiny_llama), tiny_llama, tmp_path / "ckpt")
    ckpt.load_drafter(path, tiny_llama)  # the unedited checkpoint loads
    edit_checkpoint(path, meta=edit)
    with pytest.raises(DraftlabError) as e:
        ckpt.load_drafter(path, tiny_llama)
    assert_one_line(e, match)


def test_missing_or_misshapen_weights_are_one_line_errors(tiny_llama, tmp_path):
    path = save_checkpoint(DraftLM.build(DraftLMConfig(num_layers=2), tiny_llama), tiny_llama, tmp_path / "ckpt")
    edit_checkpoint(path, weights=lambda s: s.pop("lm.model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(DraftlabError) as e:
        ckpt.load_drafter(path, tiny_llama)
    assert_one_line(e, r"missing \['lm\.model\.layers\.1\.mlp\.up_proj\.weight'\]")


# ---------------------------------------------------------------------------- losses
def _reference(z, zt, labels, cfg):
    """The per-row loss written out in probabilities over the whole vocabulary (top-k: buckets by hand)."""
    p, q = F.softmax(zt / cfg.temperature, -1), F.softmax(z / cfg.temperature, -1)
    if cfg.top_k:
        idx = zt.topk(cfg.top_k, -1).indices
        p = torch.cat([p.gather(-1, idx), 1 - p.gather(-1, idx).sum(-1, keepdim=True)], -1)
        q = torch.cat([q.gather(-1, idx), 1 - q.gather(-1, idx).sum(-1, keepdim=True)], -1)
    ce = -F.log_softmax(z, -1).gather(-1, labels[:, None])[:, 0]
    if cfg.kind == "ce":
        return ce
    m = cfg.beta * p + (1 - cfg.beta) * q
    fkl, alpha = (p * (p / q).log()).sum(-1), torch.minimum(p, q).sum(-1)
    lam = torch.exp(-cfg.eta * alpha)
    div = {
        "fkl": fkl,
        "rkl": (q * (q / p).log()).sum(-1),
        "jsd": cfg.beta * (p * (p / m).log()).sum(-1) + (1 - cfg.beta) * (q * (q / m).log()).sum(-1),
        "tvd": 0.5 * (p - q).abs().sum(-1),
        "nla": -alpha.log(),
        "lk_hybrid": lam * fkl + (1 - lam) * (1 - alpha),
    }[cfg.kind]
    return div + cfg.ce_weight * ce


@pytest.mark.parametrize(
    "cfg",
    [DraftLMLoss(kind=k) for k in KINDS]
    + [DraftLMLoss(kind="jsd", beta=0.2, temperature=2.0), DraftLMLoss(kind="rkl", top_k=5, ce_weight=0.3),
       DraftLMLoss(kind="fkl", top_k=3, temperature=0.5), DraftLMLoss(kind="tvd", top_k=4),
       DraftLMLoss(kind="lk_hybrid", eta=0.7, top_k=5, ce_weight=0.2), DraftLMLoss(kind="nla", temperature=2.0, top_k=3)],
    ids=lambda c: f"{c.kind}-t{c.temperature}-k{c.top_k}-b{c.beta}-ce{c.ce_weight}-e{c.eta}",
)
def test_row_loss_matches_the_definition_in_probabilities(cfg):
    g = torch.Generator().manual_seed(0)
    z, zt = torch.randn(6, 30, generator=g, dtype=torch.float64) * 2, torch.randn(6, 30, generator=g, dtype=torch.float64) * 2
    labels = torch.randint(0, 30, (6,), generator=g)
    torch.testing.assert_close(row_loss(z, zt, labels, cfg).double(), _reference(z.float().double(), zt.float().double(), labels, cfg),
                               rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", ["fkl", "rkl", "jsd", "tvd", "nla", "lk_hybrid"])
def test_top_k_with_the_rest_mass_is_the_full_loss_at_k_equal_v(kind):
    g = torch.Generator().manual_seed(1)
    V = 40
    z0, zt = torch.randn(8, V, generator=g) * 3, torch.randn(8, V, generator=g) * 3
    labels = torch.randint(0, V, (8,), generator=g)
    out = []
    for k in (0, V, V + 7):
        z = z0.clone().requires_grad_()
        loss = row_loss(z, zt, labels, DraftLMLoss(kind=kind, top_k=k)).sum()
        loss.backward()
        out.append((loss.detach(), z.grad))
    for loss, grad in out[1:]:
        assert torch.isfinite(grad).all()
        torch.testing.assert_close(loss, out[0][0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(grad, out[0][1], rtol=1e-4, atol=1e-5)
    # k < V is a different, smaller divergence (data processing: merging outcomes loses information)
    small = row_loss(z0, zt, labels, DraftLMLoss(kind=kind, top_k=3))
    assert (small <= row_loss(z0, zt, labels, DraftLMLoss(kind=kind)) + 1e-6).all() and not torch.allclose(small.sum(), out[0][0])


def test_bucket_keeps_the_rest_mass():
    g = torch.Generator().manual_seed(2)
    lp, lq = F.log_softmax(torch.randn(5, 20, generator=g), -1), F.log_softmax(torch.randn(5, 20, generator=g), -1)
    bp, bq = bucket_top_k(lp, lq, 4)
    assert bp.shape == (5, 5)
    torch.testing.assert_close(bp.exp().sum(-1), torch.ones(5))
    torch.testing.assert_close(bq.exp().sum(-1), torch.ones(5))
    torch.testing.assert_close(bp[:, :4], lp.topk(4, -1).values)


CHUNKED = [DraftLMLoss(kind=k, chunk=3) for k in KINDS] + [
    DraftLMLoss(kind=k, top_k=6, temperature=t, ce_weight=0.5, chunk=5)
    for k in ("fkl", "rkl", "jsd", "tvd", "nla", "lk_hybrid") for t in (1.0, 0.7)
] + [DraftLMLoss(kind="jsd", beta=0.1, temperature=1.5, chunk=4), DraftLMLoss(kind="rkl", top_k=30, chunk=11),
     DraftLMLoss(kind="lk_hybrid", eta=10.0, chunk=4)]


@pytest.mark.parametrize("cfg", CHUNKED, ids=lambda c: f"{c.kind}-t{c.temperature}-k{c.top_k}-b{c.beta}-ce{c.ce_weight}-c{c.chunk}-e{c.eta}")
def test_chunked_closed_form_loss_and_gradients_equal_autograd_of_the_definition(cfg):
    g = torch.Generator().manual_seed(3)
    N, H, V = 11, 8, 30
    h0, w0 = torch.randn(N, H, generator=g), torch.randn(V, H, generator=g)
    teacher, tw = torch.randn(N, H, generator=g), torch.randn(V, H, generator=g)
    labels = torch.randint(0, V, (N,), generator=g)
    h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
    loss, stats = distill_loss(h, w, teacher, tw, labels, cfg)
    (2 * loss).backward()
    h_ref, w_ref = h0.clone().requires_grad_(), w0.clone().requires_grad_()
    ref = row_loss(h_ref @ w_ref.T, teacher @ tw.T, labels, cfg).mean()
    (2 * ref).backward()
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(h.grad, h_ref.grad)
    torch.testing.assert_close(w.grad, w_ref.grad)
    p, q = F.softmax(teacher @ tw.T / cfg.temperature, -1), F.softmax(h0 @ w0.T / cfg.temperature, -1)  # at the loss's temperature
    assert stats["accept"] == pytest.approx(float((1 - 0.5 * (p - q).abs().sum(-1)).mean()), rel=1e-5)
    assert stats["acc"] == pytest.approx(float(((h0 @ w0.T).argmax(-1) == (teacher @ tw.T).argmax(-1)).float().mean()))
    # no rows: an exact zero with zero gradients
    empty, _ = distill_loss(h[:0], w, teacher[:0], tw, labels[:0], cfg)
    assert empty.item() == 0.0


@pytest.mark.parametrize(
    "cfg",
    [DraftLMLoss(kind=k) for k in KINDS] + [DraftLMLoss(kind="fkl", top_k=8, temperature=2.0, ce_weight=0.2, chunk=7)],
    ids=list(KINDS) + ["fkl-topk"],
)
def test_each_loss_is_finite_and_its_gradient_lowers_it(tiny_llama, cfg):
    t = tiny_llama
    torch.manual_seed(0)
    d = DraftLM.build(DraftLMConfig(num_layers=2), t).train()
    batch, hidden = _batch(t)
    opt = torch.optim.Adam(d.parameters(), lr=3e-3)
    losses = []
    for _ in range(6):
        loss, metrics = d.training_loss(batch, hidden, cfg)
        assert torch.isfinite(loss) and 0 <= metrics["acc"][0] <= 1 and 0 <= metrics["accept"] <= 1
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] * 0.9, losses
    # the drafter trains copies: no parameter of it is a target tensor, which stays as it was
    target_ptrs = {p.data_ptr() for p in t.model.parameters()}
    assert not any(p.data_ptr() in target_ptrs for p in d.parameters())


def test_loss_counts_the_positions_whose_next_token_is_an_assistant_token(tiny_llama):
    t = tiny_llama
    d = DraftLM.build(DraftLMConfig(num_layers=2), t).eval()
    batch, hidden = _batch(t)
    cfg = DraftLMLoss(kind="fkl")
    with torch.no_grad():
        loss, _ = d.training_loss(batch, hidden, cfg)
        z = d.lm(batch["input_ids"]).logits
        zt = t.lm_head(hidden[t.num_layers])
    rows = [(b, s) for b in range(2) for s in range(batch["input_ids"].shape[1] - 1) if batch["loss_mask"][b, s + 1]]
    want = torch.stack([(F.softmax(zt[b, s], -1) * (F.log_softmax(zt[b, s], -1) - F.log_softmax(z[b, s], -1))).sum() for b, s in rows])
    torch.testing.assert_close(loss, want.mean(), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------- on-policy data
def _prompted_batch(t):
    """Three right-padded rows: prompts of 3, 6 and 4 tokens, answers of 13, 5 and 0 tokens."""
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, t.vocab_size, (3, 16), generator=g)
    mask, attn = torch.zeros(3, 16, dtype=torch.bool), torch.zeros(3, 16, dtype=torch.long)
    for b, (prompt, n) in enumerate([(3, 16), (6, 11), (4, 4)]):
        mask[b, prompt:n], attn[b, :n] = True, 1
        ids[b, n:] = 0
    return {"input_ids": ids, "loss_mask": mask, "attention_mask": attn}


def test_on_policy_rows_are_the_drafts_own_samples(tiny_llama):
    """loss.on_policy 1: each row with an answer keeps its prompt and gets, as its answer, the
    draft's own samples: the same tokens as sampling each row with full, uncached forwards and the
    same random draws; the answer is what counts, no row grows, the seed decides the samples."""
    t = tiny_llama
    torch.manual_seed(0)
    d = DraftLM.build(DraftLMConfig(num_layers=2), t)
    d.lm.config.eos_token_id = None  # a tiny random model: every answer runs to its budget
    batch, cfg = _prompted_batch(t), DraftLMLoss(on_policy=1.0)
    assert DraftLM.rewrites_batches(cfg) == "loss.on_policy" and DraftLM.rewrites_batches(DraftLMLoss()) is None
    out = d.rewrite_batch(batch, cfg, seed=11)
    assert torch.equal(d.rewrite_batch(batch, cfg, seed=11)["input_ids"], out["input_ids"])
    assert not torch.equal(d.rewrite_batch(batch, cfg, seed=12)["input_ids"], out["input_ids"])
    # the reference: one full forward per row and step, one multinomial over the rows per step
    g = torch.Generator().manual_seed(11)
    torch.rand(3, generator=g)
    seqs, budgets = [batch["input_ids"][0, :3], batch["input_ids"][1, :6]], [13, 5]
    for step in range(13):
        with torch.no_grad():
            logits = torch.stack([d.lm(input_ids=s[None]).logits[0, -1] for s in seqs])
        nxt = torch.multinomial(logits.float().softmax(-1), 1, generator=g)[:, 0]
        seqs = [torch.cat([s, n[None]]) if step < b else s for s, n, b in zip(seqs, nxt, budgets)]
    for b, (s, n) in enumerate([(3, 16), (6, 11)]):
        assert torch.equal(out["input_ids"][b, :n], seqs[b])
        assert out["loss_mask"][b].nonzero().flatten().tolist() == list(range(s, n))
        assert out["attention_mask"][b].sum() == n
    for k in batch:  # the row without an answer is left as it was
        assert torch.equal(out[k][2], batch[k][2])


def test_on_policy_answers_stop_at_eos(tiny_llama):
    t = tiny_llama
    torch.manual_seed(0)
    d = DraftLM.build(DraftLMConfig(num_layers=2), t)
    d.lm.config.eos_token_id = None
    free = d.rewrite_batch(_prompted_batch(t), DraftLMLoss(on_policy=1.0), seed=11)
    eos = int(free["input_ids"][0, 5])  # the row's third sampled token
    d.lm.config.eos_token_id = eos
    out = d.rewrite_batch(_prompted_batch(t), DraftLMLoss(on_policy=1.0), seed=11)
    first = free["input_ids"][0, 3:].tolist().index(eos) + 3
    assert out["attention_mask"][0].sum() == first + 1 and out["loss_mask"][0, first] and not out["loss_mask"][0, first + 1:].any()


def test_on_policy_needs_online_capture(tmp_path, tiny_target_dirs):
    res = _train(_recipe(tmp_path, tiny_target_dirs["llama"], on_policy=0.5), "capture.mode=memory")
    assert res.returncode != 0 and "Traceback" not in res.stderr
    line = res.stderr.strip().splitlines()[-1]
    assert "loss.on_policy" in line and "capture.mode must be online, not memory" in line, res.stderr


# ---------------------------------------------------------------------------- the entry point
def _recipe(tmp_path, target_dir, name="run", **loss):
    data = write_chat(tmp_path / "chat.jsonl", 24, assistant_words=20)
    recipe = {
        "algorithm": "draft_lm",
        "output_dir": str(tmp_path / name),
        "target": {"model": str(target_dir)},
        "data": {"source": str(data), "max_length": 96, "heldout": 2},
        "drafter": {"num_layers": 2},
        "loss": {"kind": "fkl", **loss},
        "capture": {"mode": "online"},
        "train": {"max_steps": 4, "batch_tokens": 384, "checkpoint_every": 4, "warmup_steps": 1, "lr": 3e-3},
        "eval": {"num_prompts": 2, "max_new_tokens": 8, "method": "chain", "k": 2},
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def _train(*args, kill_after=None):
    killer = ["tests/kill_after_checkpoint.py", str(kill_after)] if kill_after else []
    return subprocess.run([sys.executable, *killer, "train/draft_lm.py", *map(str, args)], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)


def test_train_entry_point_writes_a_checkpoint_that_loads_back_and_reports(tmp_path, tiny_target_dirs):
    """train/draft_lm.py end to end on a tiny target: online capture, checkpoints, the
    after-checkpoint acceptance report (greedy, so speculative output equals plain)."""
    target_dir = tiny_target_dirs["qwen2"]  # tied embeddings: stored once, trained as one tensor
    res = _train(_recipe(tmp_path, target_dir, top_k=16, ce_weight=0.1))
    assert res.returncode == 0, res.stderr[-2000:]
    t = Target.load(str(target_dir))
    final = ckpt.step_dir(tmp_path / "run", 4)
    d, meta = ckpt.load_drafter(final, t)
    assert meta["algorithm"] == "draft_lm" and meta["drafter"]["target_layers"] == [0, 3] and d.tied
    fresh = DraftLM.build(DraftLMConfig(num_layers=2), t)
    moved = [k for k, v in fresh.state_dict().items() if not torch.equal(v, d.state_dict()[k])]
    assert "lm.model.embed_tokens.weight" in moved and len(moved) > 10
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [m for m in metrics if "loss" in m]
    assert [m["step"] for m in train] == [1, 2, 3, 4] and all(len(m["acc"]) == 1 and 0 <= m["accept"] <= 1 for m in train)
    report = json.loads((tmp_path / "run" / "eval" / "latest.json").read_text())
    assert report["greedy_match"] == "2/2" and report["step"] == 4


def test_unknown_loss_kind_is_a_one_line_error(tmp_path, tiny_target_dirs):
    res = _train(_recipe(tmp_path, tiny_target_dirs["llama"]), "loss.kind=nope")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    line = res.stderr.strip().splitlines()[-1]
    assert "loss.kind" in line and "'fkl'" in line, res.stderr


@pytest.mark.slow  # the shared trainer's resume is in the default suite (test_train.py); this family's with -m slow
def test_a_killed_run_resumes_to_the_same_weights(tmp_path, tiny_target_dirs):
    """Tied embeddings (stored once) and the optimizer state come back exactly after a SIGKILL,
    with half of the sequences the draft's own samples (on-policy), drawn again alike."""
    target_dir = tiny_target_dirs["qwen2"]
    runs = {name: _recipe(tmp_path, target_dir, name, kind="jsd", on_policy=0.5) for name in ("straight", "killed")}
    for name in runs:
        edit = yaml.safe_load(runs[name].read_text())
        edit["train"]["checkpoint_every"], edit["eval"] = 2, {"enabled": False}
        runs[name].write_text(yaml.safe_dump(edit))
    a = assert_resumes_bitwise("draft_lm", runs["straight"], runs["killed"], timeout=300)
    assert "lm.lm_head.weight" not in a


@pytest.mark.distributed
def test_fsdp_shards_the_draft_lms_own_layers_and_refuses_on_policy(tmp_path, tiny_target_dirs):
    """The shipped FSDP2 config names draftlab's DecoderLayer; a draft LM's layers are HF's
    (LlamaDecoderLayer): it trains sharded over two gloo processes all the same. On-policy
    sampling, which needs whole weights on each rank, is a one-line error there."""
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(REPO / "recipes/accelerate/fsdp_cpu.yaml"),
              "--main_process_port", "29650", "train/draft_lm.py", str(_recipe(tmp_path, tiny_target_dirs["llama"]))]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run([*launch, "eval.enabled=false"], cwd=REPO, capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "distributed: FSDP, world size 2, rank 0 owns 50% of the drafter weights" in res.stdout
    assert ckpt.list_checkpoints(tmp_path / "run")[-1].name == "step-0000004"
    res = subprocess.run([*launch, "output_dir=" + str(tmp_path / "op"), "loss.on_policy=0.5"], cwd=REPO, capture_output=True,
                         text=True, env=env, timeout=300)
    assert res.returncode != 0 and "[rank0]: Traceback" not in res.stderr
    assert "error: loss.on_policy: the drafter generates with its whole weights, which FSDP and ZeRO-3 shard" in res.stderr
