"""Drafter models and EAGLE losses: TTT attention pattern, mask shifts, train/inference agreement."""

import pytest
import torch

from draftlab.losses.eagle import eagle3_step_loss, predicted_mask, shift_left
from draftlab.models.eagle import Eagle1Config, Eagle1Drafter, Eagle1Loss, Eagle3Config, Eagle3Drafter, Eagle3Loss
from draftlab.models.layers import ttt_attention, ttt_attention_dense
from draftlab.models.target import Target


def test_ttt_attention_pattern_hand_checked():
    """T=3, step 2: query t sees k0[0..t] and the diagonal keys k1[t], k2[t] only.
    With all-zero queries the weights are uniform over exactly the allowed keys, so the
    output is the mean of the allowed values — checkable by hand."""
    T, D = 3, 2
    q = torch.zeros(1, 1, T, D)
    vals = [torch.tensor([1.0, 2.0, 3.0]), torch.tensor([10.0, 20.0, 30.0]), torch.tensor([100.0, 200.0, 300.0])]
    vs = [v.view(1, 1, T, 1).expand(1, 1, T, D) for v in vals]
    ks = [torch.randn(1, 1, T, D) for _ in vals]
    o = ttt_attention(q, ks, vs, 1.0)[0, 0, :, 0]
    expected = torch.tensor(
        [
            (1 + 10 + 100) / 3,  # t=0: k0[0], k1[0], k2[0]
            (1 + 2 + 20 + 200) / 4,  # t=1: k0[0..1], k1[1], k2[1]
            (1 + 2 + 3 + 30 + 300) / 5,  # t=2: k0[0..2], k1[2], k2[2]
        ]
    )
    torch.testing.assert_close(o, expected)


def test_ttt_attention_matches_explicit_mask_with_gqa():
    torch.manual_seed(0)
    B, h, hk, T, D, steps = 2, 4, 2, 6, 8, 3
    q = torch.randn(B, h, T, D)
    ks = [torch.randn(B, hk, T, D) for _ in range(steps)]
    vs = [torch.randn(B, hk, T, D) for _ in range(steps)]
    K = torch.cat(ks, 2).repeat_interleave(h // hk, 1)
    V = torch.cat(vs, 2).repeat_interleave(h // hk, 1)
    allowed = torch.zeros(T, T * steps, dtype=torch.bool)
    for t in range(T):
        allowed[t, : t + 1] = True
        for j in range(1, steps):
            allowed[t, j * T + t] = True
    ref = ((q @ K.transpose(-1, -2)) * 0.5).masked_fill(~allowed, float("-inf")).softmax(-1) @ V
    torch.testing.assert_close(ttt_attention(q, ks, vs, 0.5), ref)
    torch.testing.assert_close(ttt_attention_dense(q, ks, vs, 0.5), ref)


@pytest.mark.parametrize("steps", [2, 4])
def test_fused_ttt_attention_matches_dense_with_gradients(steps):
    """The flash + log-sum-exp merge (CPU fast path) equals the dense reference, gradients too."""
    torch.manual_seed(1)
    B, h, hk, T, D = 2, 6, 2, 9, 8
    q = torch.randn(B, h, T, D, requires_grad=True)
    ks = [torch.randn(B, hk, T, D, requires_grad=True) for _ in range(steps)]
    vs = [torch.randn(B, hk, T, D, requires_grad=True) for _ in range(steps)]
    g = torch.randn(B, h, T, D)
    grads = []
    for fn in (ttt_attention, ttt_attention_dense):
        out = fn(q, ks, vs, 0.3)
        (out * g).sum().backward()
        grads.append([out.detach()] + [x.grad.clone() for x in (q, *ks, *vs)])
        for x in (q, *ks, *vs):
            x.grad = None
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_mask_shift_hand_checked():
    # tokens:      0  1  2  3  4  5  6
    # loss_mask:   0  0  1  1  1  0  0   (assistant tokens are x2, x3, x4)
    m = torch.tensor([[0, 0, 1, 1, 1, 0, 0]], dtype=torch.bool)
    # step 0 at position t predicts x_{t+2}: counted t = 0, 1, 2
    assert predicted_mask(m, 0).int().tolist() == [[1, 1, 1, 0, 0, 0, 0]]
    # step 2 at position t predicts x_{t+4}: only t = 0 (x4)
    assert predicted_mask(m, 2).int().tolist() == [[1, 0, 0, 0, 0, 0, 0]]
    assert shift_left(torch.arange(5)[None], 2).tolist() == [[2, 3, 4, 0, 0]]


def test_step_loss_normalised_by_mask_sum_not_mean():
    logits = torch.zeros(1, 4, 3)
    p = torch.full((1, 4, 3), 1 / 3)
    mask = torch.tensor([[1, 0, 0, 0]], dtype=torch.bool)
    # uniform q, uniform p: CE = log 3 at the single counted position (a .mean() would give log3/4)
    assert eagle3_step_loss(logits, p, mask).item() == pytest.approx(torch.log(torch.tensor(3.0)).item())


def _samples(target, n=4, T=24):
    g = torch.Generator().manual_seed(0)
    return [
        {"input_ids": torch.randint(0, target.vocab_size, (T,), generator=g), "loss_mask": torch.ones(T, dtype=torch.bool)}
        for _ in range(n)
    ]


# EAGLE-1 reads only the last layer, so its other families add little over EAGLE-3's (-m slow)
@pytest.mark.parametrize("algo,family", [pytest.param(a, f, marks=pytest.mark.slow) if a == "eagle1" and f != "llama" else (a, f)
                                         for a in ("eagle1", "eagle3") for f in ("llama", "qwen2", "qwen3", "mistral")])
def test_drafters_train_on_every_family(tiny_target_dirs, family, algo):
    torch.manual_seed(0)
    target = Target.load(str(tiny_target_dirs[family]))
    samples = _samples(target)
    if algo == "eagle3":
        d = Eagle3Drafter.build(Eagle3Config(num_layers=2, draft_vocab_size=64), target, samples)
        lc = Eagle3Loss(ttt_steps=3)
    else:
        d = Eagle1Drafter.build(Eagle1Config(num_layers=2), target, samples)
        lc = Eagle1Loss()
    ids = torch.stack([s["input_ids"] for s in samples[:2]])
    batch = {"input_ids": ids, "loss_mask": torch.ones_like(ids, dtype=torch.bool)}
    hidden = target(ids, layers=d.capture_layers, logits=None).hidden
    opt = torch.optim.AdamW(d.parameters(), lr=3e-3)
    losses = []
    for _ in range(8):
        loss, metrics = d(batch, hidden, lc)
        assert torch.isfinite(loss)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]  # it learns the batch
    assert len(metrics["acc"]) == (3 if algo == "eagle3" else 1)
    # frozen target weights are shared, not trained or saved
    assert not any("embed" in k for k in d.export_state_dict())
    assert target.embed_tokens.weight.grad is None


EAGLE31 = dict(fc_norm=True, norm_output=True)
SPECULATORS_DEFAULTS = dict(norm_before_fc=True, norm_before_residual=True, norm_output=True)  # its trainer's


@pytest.mark.parametrize("family,flags", [("llama", {}), ("qwen3", {}), ("llama", EAGLE31), ("llama", SPECULATORS_DEFAULTS)])
def test_ttt_unroll_equals_inference_drafting(tiny_target_dirs, family, flags):
    """Step i of training at position t must equal what the cached inference path computes
    when it drafts i tokens after position t (teacher-forced with the true tokens). This pins
    the TTT attention pattern and the RoPE offsets (and, for EAGLE-3.1, which state a step
    hands the next)."""
    torch.manual_seed(0)
    target = Target.load(str(tiny_target_dirs[family]))
    samples = _samples(target, T=12)
    cfg = Eagle3Config(num_layers=2, draft_vocab_size=64, **flags)
    d = Eagle3Drafter.build(cfg, target, samples).eval()
    ids = samples[0]["input_ids"][None]
    hidden = target(ids, layers=d.capture_layers, logits=None).hidden
    steps = 4
    with torch.no_grad():
        train_h = [h for _, h in d.unroll(ids, hidden, steps)]
        feats = d.features(hidden)
        for t in (0, 3, 6):
            cache = d.new_cache()
            h, _ = d.draft_step(ids[:, 1 : t + 2], feats[:, : t + 1], torch.arange(t + 1)[None], cache)
            h = h[:, -1:]
            torch.testing.assert_close(h[0, 0], train_h[0][0, t], atol=1e-5, rtol=1e-5)
            for i in range(1, steps):
                tok = ids[:, t + 1 + i : t + 2 + i]
                h, _ = d.draft_step(tok, h, torch.tensor([[t + i]]), cache)
                torch.testing.assert_close(h[0, 0], train_h[i][0, t], atol=1e-5, rtol=1e-5)


def test_eagle31_flags_config_and_computation(tiny_llama, tmp_path):
    """fc_norm: one RMSNorm per fused state before fc (it replaces the measured fc input scale);
    norm_output: the layers' output goes through ``norm`` once, and that normalised state is
    both what lm_head reads and what the next step is fed. Both default off, and round-trip
    through a checkpoint."""
    from pydantic import ValidationError

    from draftlab import atomic
    from draftlab import checkpoint as ckpt

    assert not Eagle3Config().fc_norm and not Eagle3Config().norm_output and Eagle3Config().normalize_fc_input
    assert Eagle3Config(fc_norm=True).normalize_fc_input is False  # the default gives way
    with pytest.raises(ValidationError, match="fc_norm and normalize_fc_input"):
        Eagle3Config(fc_norm=True, normalize_fc_input=True)

    torch.manual_seed(0)
    samples = _samples(tiny_llama)
    d = Eagle3Drafter.build(Eagle3Config(draft_vocab_size=64, fc_norm=True, norm_output=True), tiny_llama, samples).eval()
    with torch.no_grad():
        for p in d.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    assert d.fc_input_scale is None and len(d.fc_norm) == len(d.aux_layers)
    assert {f"fc_norm.{i}.weight" for i in range(len(d.aux_layers))} <= set(d.export_state_dict())
    ids = samples[0]["input_ids"][None, :10]
    hidden = tiny_llama(ids, layers=d.capture_layers, logits=None).hidden
    H, eps = tiny_llama.hidden_size, d.shape.rms_norm_eps

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    with torch.no_grad():
        fused = torch.cat([rms(hidden[i], n.weight) for n, i in zip(d.fc_norm, d.aux_layers)], -1)
        torch.testing.assert_close(d.features(hidden), fused @ d.fc.weight.T, atol=1e-5, rtol=1e-5)
        steps = [h for _, h in d.unroll(ids, hidden, 2)]
        # each step's output is normalised, and its logits are lm_head of that state, not normed twice
        raw = _stack_before_output_norm(d, ids, d.features(hidden))
        torch.testing.assert_close(steps[0], rms(raw, d.norm.weight), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(d.head(steps[0]), steps[0] @ d.lm_head.weight.T, atol=1e-5, rtol=1e-5)
        # step 1 is fed the normalised step-0 state: off with norm_output, the same weights differ
        d.norm_output = False
        assert not torch.allclose([h for _, h in d.unroll(ids, hidden, 2)][1], steps[1], atol=1e-3)
        d.norm_output = True

    meta = ckpt.checkpoint_meta(d, tiny_llama.identity, None, 1, None)
    assert meta["drafter"]["fc_norm"] is True and meta["drafter"]["norm_output"] is True
    with atomic.directory(tmp_path / "c") as tmp:
        ckpt.save_weights(tmp, d.state_dict(), meta)
    back, _ = ckpt.load_drafter(tmp_path / "c", tiny_llama)
    with torch.no_grad():
        torch.testing.assert_close([h for _, h in back.unroll(ids, hidden, 2)][1], steps[1])


def test_speculators_norm_flags_config_and_computation(tiny_llama, tmp_path):
    """norm_before_fc: one RMSNorm (``input_norm``) over the concatenated fused states before fc,
    which replaces the measured fc input scale and excludes fc_norm; norm_before_residual: the
    first layer's residual stream is ``hidden_norm(h)``. Both default off (so do checkpoints
    written without them) and round-trip through a checkpoint."""
    from draftlab import atomic
    from draftlab import checkpoint as ckpt
    from draftlab.errors import DraftlabError
    from draftlab.recipe import _validate
    from tiny import assert_one_line

    assert not Eagle3Config().norm_before_fc and not Eagle3Config().norm_before_residual
    assert Eagle3Config(norm_before_fc=True).normalize_fc_input is False  # the default gives way
    for clash, says in ((dict(normalize_fc_input=True), "norm_before_fc and normalize_fc_input both normalise fc's input"),
                        (dict(fc_norm=True), "fc_norm and norm_before_fc both normalise fc's input")):
        with pytest.raises(DraftlabError) as e:  # as a recipe's drafter section reports it
            _validate(Eagle3Config, {"norm_before_fc": True, **clash}, "drafter")
        assert_one_line(e, f"^drafter: {says}; set one$")

    torch.manual_seed(0)
    samples = _samples(tiny_llama)
    d = Eagle3Drafter.build(Eagle3Config(draft_vocab_size=64, **SPECULATORS_DEFAULTS), tiny_llama, samples).eval()
    with torch.no_grad():
        for p in d.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    assert d.fc_input_scale is None and d.fc_norm is None and "input_norm.weight" in d.export_state_dict()
    ids = samples[0]["input_ids"][None, :10]
    hidden = tiny_llama(ids, layers=d.capture_layers, logits=None).hidden
    eps = d.shape.rms_norm_eps

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    with torch.no_grad():
        h = d.features(hidden)
        fused = torch.cat([hidden[i] for i in d.aux_layers], -1)
        torch.testing.assert_close(h, rms(fused, d.input_norm.weight) @ d.fc.weight.T, atol=1e-5, rtol=1e-5)
        # the first layer by hand: attention reads [norm(emb); hidden_norm(h)], the residual is hidden_norm(h)
        layer, emb = d.layers[0], d.embed(shift_left(ids, 1))
        cos, sin = d.rotary(torch.arange(ids.shape[1])[None], h)
        causal = lambda q, k, v: layer.self_attn.attend(q, k, v, causal=True)  # noqa: E731
        normed = rms(h, layer.hidden_norm.weight)
        x = torch.cat([rms(emb, layer.input_layernorm.weight), normed], -1)
        r = normed + layer.self_attn.out(causal(*layer.self_attn.qkv(x, cos, sin)))
        torch.testing.assert_close(layer(h, cos, sin, causal, emb=emb), r + layer.mlp(layer.post_attention_layernorm(r)),
                                   atol=1e-5, rtol=1e-5)
        steps = [h for _, h in d.unroll(ids, hidden, 2)]

    meta = ckpt.checkpoint_meta(d, tiny_llama.identity, None, 1, None)
    assert meta["drafter"]["norm_before_fc"] is True and meta["drafter"]["norm_before_residual"] is True
    with atomic.directory(tmp_path / "c") as tmp:
        ckpt.save_weights(tmp, d.state_dict(), meta)
    back, _ = ckpt.load_drafter(tmp_path / "c", tiny_llama)
    with torch.no_grad():
        torch.testing.assert_close([h for _, h in back.unroll(ids, hidden, 2)][1], steps[1])
    older = {k: v for k, v in meta["drafter"].items() if k not in ("norm_before_fc", "norm_before_residual")}
    filled = Eagle3Drafter.check_meta(older, tiny_llama, "old")
    assert filled["norm_before_fc"] is False and filled["norm_before_residual"] is False


def _stack_before_output_norm(d, ids, feats):
    """The layer stack without EAGLE-3.1's output norm: step 0 of the unroll before ``norm``."""
    from draftlab.losses.eagle import shift_left
    from draftlab.models.eagle import EagleBase

    T = ids.shape[1]
    return EagleBase.stack(d, d.embed(shift_left(ids, 1)), feats, torch.arange(T)[None],
                           lambda i, attn: lambda q, k, v: attn.attend(q, k, v, causal=True))


def test_draft_vocab_and_lm_head_init(tiny_llama):
    samples = _samples(tiny_llama)
    d = Eagle3Drafter.build(Eagle3Config(draft_vocab_size=32), tiny_llama, samples)
    assert d.t2d.sum() == 32 and d.lm_head.out_features == 32
    draft_ids = torch.arange(32)
    target_ids = d.to_target_ids(draft_ids)
    assert d.t2d[target_ids].all()
    torch.testing.assert_close(d.lm_head.weight, tiny_llama.lm_head.weight[target_ids])


def test_eagle3_targets_match_full_vocab_definition(tiny_llama):
    """The cached full-vocab argmax and the draft-rows-only distribution equal what the full
    target logits give, and a supplied (cached) argmax gives the same loss as none."""
    samples = _samples(tiny_llama, T=16)
    d = Eagle3Drafter.build(Eagle3Config(draft_vocab_size=32), tiny_llama, samples)
    ids = torch.stack([s["input_ids"] for s in samples[:2]])
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[0, :5] = False  # a "user" prefix: positions whose prediction does not count get -1
    batch = {"input_ids": ids, "loss_mask": mask}
    hidden = tiny_llama(ids, layers=d.capture_layers, logits=None).hidden
    final = hidden[d.num_target_layers]
    full = tiny_llama.lm_head(final).float()
    argmax = d.derived_targets(hidden, batch)["target_argmax"]
    need = torch.cat([mask[:, 1:], torch.zeros_like(mask[:, :1])], 1)
    assert (argmax[~need] == -1).all()
    assert torch.equal(argmax[need], full.argmax(-1)[need])
    torch.testing.assert_close(tiny_llama.shared_lm_head.probs(final.flatten(0, 1), d.t2d), full[..., d.t2d].softmax(-1).flatten(0, 1))
    cfg = Eagle3Loss(ttt_steps=2)
    loss_a, m_a = d(batch, hidden, cfg)
    loss_b, m_b = d({**batch, "target_argmax": argmax}, hidden, cfg)
    assert loss_a.item() == loss_b.item() and m_a["acc"] == m_b["acc"]


def test_bad_aux_layer_is_a_clear_error(tiny_llama):
    from draftlab.errors import DraftlabError

    with pytest.raises(DraftlabError, match="aux_layers"):
        Eagle3Drafter.build(Eagle3Config(aux_layers=[1, 99]), tiny_llama, _samples(tiny_llama))
