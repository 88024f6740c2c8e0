"""Served equals trained (``export/check.py``): ``draftlab export ... --check`` and ``draftlab check``.

An untouched export passes and prints alpha_j / tau of draftlab's proposer and of the peer's own
model class side by side; an edited config field (max_position_embeddings, a dropped fc_norm
flag, the aux layers), an edited tensor or a peer that drafts something else fails with one line
naming the field, tensor or draft position. Peers are optional (importorskip), as in
tests/test_export.py. P-EAGLE (speculators ``PEagleDraftModel``, k slots from one forward) and
DSpark (``DSparkDraftModel``, its block drafted left to right through the Markov head) are checked
the same way: equal drafts and per-position logits, edited fields (mask_token_id, markov_rank,
block_size, ...) and a peer computing something else fail in one line.
"""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftlab import atomic
from draftlab import checkpoint as ckpt
from draftlab.cli import main as cli_main
from draftlab.errors import DraftlabError
from draftlab.export.check import LOGIT_ATOL, check_export, first_difference
from draftlab.export.exporter import export_checkpoint
from draftlab.export.formats import ExportOptions
from draftlab.models.eagle import Eagle1Config, Eagle1Drafter, Eagle3Config, Eagle3Drafter

pytestmark = pytest.mark.usefixtures("one_thread")

TEXTS = ["Hello! How can I help you today?", "def add(a, b):\n    return a + b", "Translate to French: good morning"]
N_NEW = 12
K = 3


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A held-out prompt file in the messages form ``draftlab eval --data`` reads."""
    path = tmp_path_factory.mktemp("prompts") / "heldout.jsonl"
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": t}]}) + "\n" for t in TEXTS))
    return str(path)


def _samples(target, n=4, T=24):
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(0, target.vocab_size, (T,), generator=g), "loss_mask": torch.ones(T, dtype=torch.bool)}
            for _ in range(n)]


def _perturb(drafter, seed=1, scale=0.1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return drafter.eval()


def _save(drafter, target, path):
    meta = ckpt.checkpoint_meta(drafter, target.identity, None, 1)
    with atomic.directory(path) as tmp:
        ckpt.save_weights(tmp, drafter.state_dict(), meta)
    return path


def _eagle3(target, **kw):
    cfg = Eagle3Config(num_layers=1, draft_vocab_size=64, aux_layers=[1, 2, 3], **kw)
    return _perturb(Eagle3Drafter.build(cfg, target, _samples(target)))


@pytest.fixture(scope="module")
def eagle31(tiny_llama, tmp_path_factory):
    """An EAGLE-3.1 checkpoint (fc_norm on) and its untouched vLLM (speculators) export."""
    root = tmp_path_factory.mktemp("eagle31")
    torch.manual_seed(0)
    c = _save(_eagle3(tiny_llama, fc_norm=True), tiny_llama, root / "ckpt")
    out = export_checkpoint(c, "vllm", root / "vllm", tiny_llama, ExportOptions(speculative_tokens=K))
    return c, out


@pytest.fixture(scope="module")
def speculators_defaults(tiny_llama, tmp_path_factory):
    """A checkpoint with the flags speculators' trainer turns on (norm_before_fc,
    norm_before_residual, norm_output) and its untouched vLLM (speculators) export."""
    root = tmp_path_factory.mktemp("speculators_defaults")
    torch.manual_seed(0)
    c = _save(_eagle3(tiny_llama, norm_before_fc=True, norm_before_residual=True, norm_output=True), tiny_llama, root / "ckpt")
    return c, export_checkpoint(c, "vllm", root / "vllm", tiny_llama, ExportOptions(speculative_tokens=K))


def _check(out, c, target, data, **kw):
    lines = []
    report = check_export(out, c, target, data=data, num_prompts=len(TEXTS), max_new_tokens=N_NEW, print_fn=lines.append, **kw)
    return report, lines


def _edit_config(out, tmp_path, edit):
    import shutil

    copy = tmp_path / "edited"
    shutil.copytree(out, copy)
    config = json.loads((copy / "config.json").read_text())
    edit(config)
    (copy / "config.json").write_text(json.dumps(config))
    return copy


# ---------------------------------------------------------------------------- speculators (vLLM)
@pytest.mark.parametrize("export", ["eagle31", "speculators_defaults"])
def test_untouched_speculators_export_drafts_what_draftlab_drafts(export, tiny_llama, data, request):
    pytest.importorskip("speculators.models.eagle3")
    c, out = request.getfixturevalue(export)
    report, lines = _check(out, c, tiny_llama, data)
    assert report.peer is not None and report.steps > 0
    assert report.ours.drafts == report.peer.drafts  # every chain, token by token
    assert report.worst_logit_diff is not None and report.worst_logit_diff <= LOGIT_ATOL
    assert report.ours.stats.alpha == report.peer.stats.alpha and report.ours.stats.tau == report.peer.stats.tau
    text = "\n".join(lines)
    assert "alpha_1" in text and "tau" in text and "speculators Eagle3DraftModel" in text and "draftlab" in text


@pytest.mark.parametrize("field,edit,match", [
    ("max_position_embeddings", lambda c: c["transformer_layer_config"].update(max_position_embeddings=64),
     r"config field transformer_layer_config\.max_position_embeddings is 64 in the export, 512 from the checkpoint"),
    ("fc_norm", lambda c: c.pop("fc_norm"), r"config field fc_norm is \(absent\) in the export, true from the checkpoint"),
    ("norm_before_residual", lambda c: c.update(norm_before_residual=True),
     r"config field norm_before_residual is true in the export, false from the checkpoint"),
    ("aux layers", lambda c: c.update(eagle_aux_hidden_state_layer_ids=[1, 2, 2]),
     r"config field eagle_aux_hidden_state_layer_ids\[2\] is 2 in the export, 3 "),
    ("rope_theta", lambda c: c["transformer_layer_config"].update(rope_theta=500000.0), r"rope_theta is 500000\.0 in the export"),
    ("partial_rotary_factor", lambda c: c["transformer_layer_config"].update(partial_rotary_factor=0.5),
     r"partial_rotary_factor is 0\.5 in the export, \(absent\)"),
    ("k", lambda c: c["speculators_config"]["proposal_methods"][0].update(speculative_tokens=5), r"speculative_tokens is 5 in the export, 3"),
])
def test_edited_config_field_fails_with_one_line(field, edit, match, eagle31, tiny_llama, data, tmp_path, capsys):
    c, out = eagle31
    edited = _edit_config(out, tmp_path, edit)
    with pytest.raises(DraftlabError, match=match) as e:
        _check(edited, c, tiny_llama, data)
    assert "\n" not in str(e.value)
    if field == "fc_norm":  # the CLI: exit 2, one error line
        code = cli_main(["check", str(edited), "--drafter", str(c), "--target", tiny_llama.identity["name"], "--data", data,
                         "--num-prompts", "1", "--max-new-tokens", "4", "--num-speculative-tokens", str(K)])
        err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("draftlab check:")]
        assert code == 2 and len(err) == 1 and "config field fc_norm" in err[0]


def test_edited_tensor_is_named(eagle31, tiny_llama, data, tmp_path):
    c, out = eagle31
    edited = _edit_config(out, tmp_path, lambda c: None)
    state = load_file(edited / "model.safetensors")
    state["fc_norm.1.weight"] = state["fc_norm.1.weight"] * 1.01
    save_file(state, edited / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(DraftlabError, match=r"tensor fc_norm\.1\.weight differs from the checkpoint's"):
        _check(edited, c, tiny_llama, data)


# ---------------------------------------------------------------------------- other peers
PEERS = {"sglang": ("specforge.modeling.draft.llama3_eagle", "SpecForge LlamaForCausalLMEagle3"),
         "eagle1-sglang": ("eagle.model.cnets", "EAGLE cnets.Model"), "eagle1-vllm": ("eagle.model.cnets", "EAGLE cnets.Model"),
         "medusa-medusa": ("medusa.model.medusa_model", "medusa-llm MedusaModel"), "draft_lm-hf": ("transformers", "HF AutoModelForCausalLM"),
         "diffusion-vllm": ("speculators.models.dflash", "speculators DFlashDraftModel"),
         "diffusion-sglang": ("specforge.modeling.draft.dflash", "SpecForge DFlashDraftModel")}


def _drafter(engine, target):
    from draftlab.models.draft_lm import DraftLM, DraftLMConfig
    from draftlab.models.medusa import MedusaConfig, MedusaDrafter

    if engine == "sglang":
        return _eagle3(target, fc_norm=True)
    if engine == "medusa-medusa":  # medusa-llm repeats one ResBlock object per head: 1 block
        return _perturb(MedusaDrafter.build(MedusaConfig(num_heads=3, num_layers=1, draft_vocab_size=0), target, _samples(target)))
    if engine.startswith("diffusion"):  # z-lab's layout has the target's lm_head: full vocabulary
        from draftlab.models.diffusion import DiffusionConfig, DiffusionDrafter

        vd = 64 if engine == "diffusion-vllm" else 0
        cfg = DiffusionConfig(num_layers=1, block_size=4, draft_vocab_size=vd, target_layers=[1, 3])
        return _perturb(DiffusionDrafter.build(cfg, target, _samples(target, T=40)))
    if engine == "draft_lm-hf":
        return DraftLM.build(DraftLMConfig(num_layers=1), target).eval()  # initialised from the target: it accepts
    d = _perturb(Eagle1Drafter.build(Eagle1Config(num_layers=1), target), scale=0.05)
    if engine == "eagle1-vllm":
        with torch.no_grad():
            d.fc.bias.zero_()  # vLLM's EAGLE fc has no bias
    return d


@pytest.mark.parametrize("engine", list(PEERS))
def test_export_check_cli_with_each_peer(engine, tiny_llama, data, tmp_path, capsys):
    """``draftlab export ... --check``: the export, then the table of both proposers."""
    module, peer = PEERS[engine]
    pytest.importorskip(module)
    torch.manual_seed(0)
    c = _save(_drafter(engine, tiny_llama), tiny_llama, tmp_path / "ckpt")
    to = engine.rpartition("-")[2]
    code = cli_main(["export", str(c), "--to", to, str(tmp_path / "out"), "--target", tiny_llama.identity["name"], "--check",
                     "--data", data, "--num-prompts", "2", "--max-new-tokens", "8", "--num-speculative-tokens", str(K)])
    text = capsys.readouterr().out
    assert code == 0, text
    assert peer in text and "draftlab" in text and "alpha_1" in text and "drafts equal at all" in text
    if engine == "draft_lm-hf":  # HF's assistant reads its chain length from generation_config.json
        gen = json.loads((tmp_path / "out" / "generation_config.json").read_text())
        (tmp_path / "out" / "generation_config.json").write_text(json.dumps({**gen, "num_assistant_tokens": 20}))
        with pytest.raises(DraftlabError, match=r"generation_config\.json\.num_assistant_tokens is 20 in the export, 3 "):
            _check(tmp_path / "out", c, tiny_llama, data, speculative_tokens=K)
        (tmp_path / "out" / "generation_config.json").write_text(json.dumps(gen))
    # draftlab check on the same directory detects its layout from config.json
    code = cli_main(["check", str(tmp_path / "out"), "--drafter", str(c), "--target", tiny_llama.identity["name"], "--data", data,
                     "--num-prompts", "1", "--max-new-tokens", "4", "--num-speculative-tokens", str(K)])
    assert code == 0 and peer in capsys.readouterr().out


@pytest.fixture(scope="module")
def theta_llama(tmp_path_factory):
    """A tiny Llama with RoPE theta 50000 (Llama-3 uses 500000)."""
    from tiny import make_tokenizer, tiny_config
    from transformers import AutoModelForCausalLM

    from draftlab.models.target import Target

    torch.manual_seed(0)
    tok = make_tokenizer()
    cfg = tiny_config("llama", vocab_size=len(tok))
    cfg.rope_parameters = {"rope_type": "default", "rope_theta": 50000.0}
    path = tmp_path_factory.mktemp("theta_llama")
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return Target.load(str(path))


def test_peer_that_computes_something_else_fails_at_the_first_draft(theta_llama, data, tmp_path, monkeypatch):
    """eagle-llm's cnets.Model hard-codes RoPE theta 10000. The peer stands for SGLang, which reads
    rope_theta from config.json: given the config's theta it drafts as the drafter, and the report
    says eagle-llm itself would not. Left at eagle-llm's 10000 it computes something else, which
    config and tensors cannot show (both are right): the decoding check fails at the first draft."""
    pytest.importorskip("eagle.model.cnets")
    from draftlab.export.eagle1 import EagleRepoPeer

    torch.manual_seed(0)
    c = _save(_perturb(Eagle1Drafter.build(Eagle1Config(num_layers=1), theta_llama), scale=0.05), theta_llama, tmp_path / "ckpt")
    out = export_checkpoint(c, "sglang", tmp_path / "out", theta_llama)
    assert json.loads((out / "config.json").read_text())["rope_theta"] == 50000.0
    report, lines = _check(out, c, theta_llama, data)
    assert report.steps > 0 and report.worst_logit_diff <= 1e-4
    assert "rope_theta 50000" in lines[-1] and "hard-codes 10000" in lines[-1]

    monkeypatch.setattr(EagleRepoPeer, "serve_rope_theta", lambda self, model, config: None)
    with pytest.raises(DraftlabError, match=r"prompt 0, step 0, draft position 0: the peer's logits differ from draftlab's by \S+ "
                                            r"\(tolerance 0\.0001\)"):
        _check(out, c, theta_llama, data)


def test_layout_without_peer_checks_config_and_tensors(tiny_llama, data, tmp_path):
    """vLLM's Medusa layout has no installable peer here: config and tensors are still checked."""
    from draftlab.models.medusa import MedusaConfig, MedusaDrafter

    d = _perturb(MedusaDrafter.build(MedusaConfig(num_heads=2, num_layers=1, draft_vocab_size=48), tiny_llama, _samples(tiny_llama)))
    c = _save(d, tiny_llama, tmp_path / "ckpt")
    out = export_checkpoint(c, "vllm", tmp_path / "out", tiny_llama)
    report, lines = _check(out, c, tiny_llama, data)
    assert report.peer is None and report.tensors == 7 and "not run" in lines[-1]
    state = load_file(out / "model.safetensors")
    state["token_map"] = state["token_map"].flip(0).contiguous()  # a vocabulary map edited: the heads read other tokens
    save_file(state, out / "model.safetensors")
    with pytest.raises(DraftlabError, match=r"tensor token_map differs from the checkpoint's"):
        _check(out, c, tiny_llama, data)


def test_a_derived_family_does_not_inherit_the_peer():
    """P-EAGLE's layout derives from EAGLE-3's speculators format: its exports must not be loaded
    with EAGLE-3's peer (nor detected as EAGLE-3's) unless it adds its own hooks."""
    from draftlab.export.check import own_hook
    from draftlab.export.eagle3_speculators import SpeculatorsEagle3

    class Derived(SpeculatorsEagle3):
        algorithm = "derived"

    assert own_hook(SpeculatorsEagle3(), "peer_proposer") and own_hook(SpeculatorsEagle3(), "detect")
    assert not own_hook(Derived(), "peer_proposer") and not own_hook(Derived(), "detect")


@pytest.mark.slow
def test_bfloat16_export_is_checked_with_the_weights_it_holds(eagle31, tiny_llama, data, tmp_path):
    """--dtype bfloat16: tensors compared after the cast, draftlab's side drafts with the rounded
    weights the peer loads, so float noise stays float noise."""
    pytest.importorskip("speculators.models.eagle3")
    c, _ = eagle31
    out = export_checkpoint(c, "vllm", tmp_path / "bf16", tiny_llama, ExportOptions(speculative_tokens=K, dtype="bfloat16"))
    report, _ = _check(out, c, tiny_llama, data)
    assert report.steps > 0 and report.worst_logit_diff <= LOGIT_ATOL


def test_unknown_layout_and_bad_options_are_one_line(eagle31, tiny_llama, data, tmp_path):
    c, out = eagle31
    with pytest.raises(DraftlabError, match=r"--num-speculative-tokens must be in 1\.\.\d+, got 0"):
        _check(out, c, tiny_llama, data, speculative_tokens=0)
    with pytest.raises(DraftlabError, match=r"--num-prompts must be >= 1, got 0"):
        check_export(out, c, tiny_llama, data=data, num_prompts=0, print_fn=lambda _: None)
    edited = _edit_config(out, tmp_path, lambda cfg: cfg.update(speculators_model_type="eagle9"))
    with pytest.raises(DraftlabError, match=r"config\.json is no known layout of eagle3 drafters"):
        _check(edited, c, tiny_llama, data)


def test_first_difference_walks_nested_keys():
    want = {"a": 1, "b": {"c": [1, 2], "d": True}, "free": 1}
    assert first_difference(json.loads(json.dumps(want)), want, set()) is None
    assert first_difference({**want, "b": {"c": [1, 3], "d": True}}, want, set()) == ("b.c[1]", 3, 2)
    assert first_difference({**want, "b": {"c": [1, 2], "d": 1}}, want, set()) == ("b.d", 1, True)  # 1 is not true
    assert first_difference({**want, "free": 2, "extra": 0}, want, {"free"}) == ("extra", 0, "(absent)")


# ---------------------------------------------------------------------------- P-EAGLE and DSpark (speculators)
def _peagle(target, **kw):
    from draftlab.models.peagle import PEagleConfig, PEagleDrafter

    cfg = {"num_layers": 1, "parallel_depth": 4, "draft_vocab_size": 64, "fc_norm": True, **kw}
    return _perturb(PEagleDrafter.build(PEagleConfig(**cfg), target, _samples(target)))


def _dspark(target):
    from draftlab.models.dspark import DSparkConfig, DSparkDrafter

    cfg = DSparkConfig(num_layers=1, block_size=4, target_layers=[1, 3], draft_vocab_size=64, markov_rank=8, markov_head_type="gated")
    return _perturb(DSparkDrafter.build(cfg, target, _samples(target, T=40)))


FAMILIES = {"peagle": (_peagle, "speculators.models.peagle", "speculators PEagleDraftModel"),
            "dspark": (_dspark, "speculators.models.dspark", "speculators DSparkDraftModel"),
            # the verifier's embedding and full vocabulary (the export's identity d2t/t2d, which speculators ignores)
            "peagle-shared": (lambda t: _peagle(t, draft_vocab_size=0, train_embedding=False, fc_norm=False), "speculators.models.peagle",
                              "speculators PEagleDraftModel")}


@pytest.fixture(scope="module")
def family_exports(tiny_llama, tmp_path_factory):
    """family -> (checkpoint, its untouched vLLM (speculators) export), built on first use."""
    made = {}

    def get(family):
        if family not in made:
            root = tmp_path_factory.mktemp(family)
            torch.manual_seed(0)
            c = _save(FAMILIES[family][0](tiny_llama), tiny_llama, root / "ckpt")
            made[family] = c, export_checkpoint(c, "vllm", root / "vllm", tiny_llama, ExportOptions(speculative_tokens=K))
        return made[family]

    return get


@pytest.mark.parametrize("family", list(FAMILIES))
def test_untouched_new_family_export_drafts_what_draftlab_drafts(family, family_exports, tiny_llama, data):
    """Every draft position of every step is compared: tokens equal, peer logits within LOGIT_ATOL."""
    _, module, peer = FAMILIES[family]
    pytest.importorskip(module)
    c, out = family_exports(family)
    report, lines = _check(out, c, tiny_llama, data)
    assert report.peer is not None and report.peer.label == peer and report.steps > 0 and report.k == K
    assert report.ours.drafts == report.peer.drafts
    diffs = [row for prompt in report.peer.logit_diffs for row in prompt]
    assert len(diffs) == report.steps and all(len(row) == K and None not in row for row in diffs)
    assert 0 < report.worst_logit_diff <= LOGIT_ATOL  # float noise, not an identity comparison
    assert report.ours.stats.alpha == report.peer.stats.alpha and report.ours.stats.tau == report.peer.stats.tau
    assert peer in "\n".join(lines) and "drafts equal at all" in lines[-1]


@pytest.mark.parametrize("family", ["peagle", "dspark"])
def test_new_family_export_check_cli(family, tiny_llama, data, tmp_path, capsys):
    """``draftlab export ... --check`` picks the family's peer through the format's hooks."""
    make, module, peer = FAMILIES[family]
    pytest.importorskip(module)
    torch.manual_seed(0)
    c = _save(make(tiny_llama), tiny_llama, tmp_path / "ckpt")
    code = cli_main(["export", str(c), "--to", "vllm", str(tmp_path / "out"), "--target", tiny_llama.identity["name"], "--check",
                     "--data", data, "--num-prompts", "1", "--max-new-tokens", "6", "--num-speculative-tokens", str(K)])
    text = capsys.readouterr().out
    assert code == 0, text
    assert peer in text and "alpha_1" in text and "drafts equal at all" in text


@pytest.mark.parametrize("family,edit,match", [
    ("peagle", lambda c: c.update(mask_token_id=c["mask_token_id"] - 1), r"config field mask_token_id is \d+ in the export, \d+ from the checkpoint"),
    ("peagle", lambda c: c["speculators_config"]["proposal_methods"][0].update(speculative_tokens=4),
     r"config field speculators_config\.proposal_methods\[0\]\.speculative_tokens is 4 in the export, 3 "),
    ("peagle", lambda c: c.update(embed_requires_grad=False), r"config field embed_requires_grad is false in the export, true "),
    ("dspark", lambda c: c.update(markov_rank=16), r"config field markov_rank is 16 in the export, 8 from the checkpoint"),
    ("dspark", lambda c: c.update(block_size=5), r"config field block_size is 5 in the export, 4 from the checkpoint"),
    ("dspark", lambda c: c.update(markov_head_type="vanilla"), r"config field markov_head_type is \"vanilla\" in the export, \"gated\" "),
])
def test_new_family_edited_config_field_fails_with_one_line(family, edit, match, family_exports, tiny_llama, data, tmp_path):
    c, out = family_exports(family)
    edited = _edit_config(out, tmp_path, edit)
    with pytest.raises(DraftlabError, match=match) as e:
        _check(edited, c, tiny_llama, data)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("family,position", [("peagle", 1), ("dspark", 0)])
def test_new_family_peer_that_computes_something_else_fails(family, position, family_exports, tiny_llama, data, monkeypatch):
    """A peer whose loaded model differs where config and tensors cannot show it (P-EAGLE: the mask
    slots' mask_hidden; DSpark: the Markov head) fails at the first draft position it moves."""
    from draftlab.export import dspark, peagle_speculators

    _, module, _ = FAMILIES[family]
    pytest.importorskip(module)
    cls = peagle_speculators.SpeculatorsPEaglePeer if family == "peagle" else dspark.SpeculatorsDSparkPeer
    init = cls.__init__

    def other(self, *args, **kw):
        init(self, *args, **kw)
        g = torch.Generator().manual_seed(3)
        p = self.model.mask_hidden if family == "peagle" else self.model.markov_head.markov_w2.weight
        with torch.no_grad():  # added, not scaled: fc_norm would normalise a scaled mask_hidden away
            p.add_(torch.randn(p.shape, generator=g))

    monkeypatch.setattr(cls, "__init__", other)
    c, out = family_exports(family)
    with pytest.raises(DraftlabError, match=rf"prompt 0, step 0, draft position {position}: the peer's logits differ from draftlab's"):
        _check(out, c, tiny_llama, data)
