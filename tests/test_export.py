"""Export / import of drafter checkpoints, proven by loading them into the peers' own model code.

* speculators 0.9 (the format vLLM loads): ``Eagle3DraftModel`` built from the exported
  config.json, weights loaded strictly, its TTT forward compared with draftlab's unroll.
* SpecForge 0.2 (SGLang's ``LlamaForCausalLMEagle3`` layout): same, through its TTT backbone.
* eagle-llm 1.2.1 (the EAGLE repository's ``Model``): EAGLE-1 layout, forward compared.
* Tensor-name checks in both directions against each loader model's ``state_dict()`` (what
  the loader would skip, what it would leave uninitialised), round trips export -> import,
  refusals (wrong target, unknown/missing tensors, layouts that cannot hold a drafter).

Peers are optional (importorskip); CI installs them (see export/__init__.py).
"""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftlab.cli import main as cli_main
from draftlab.errors import DraftlabError
from draftlab.export.eagle3_speculators import FLAGS as SPECULATORS_FLAGS
from draftlab.export.exporter import export_checkpoint
from draftlab.export.formats import ExportOptions
from draftlab.export.importer import import_checkpoint
from draftlab.losses.eagle import shift_left
from draftlab.models.eagle import Eagle1Config, Eagle1Drafter, Eagle3Config, Eagle3Drafter
from draftlab.models.target import Target
from draftlab import atomic
from draftlab import checkpoint as ckpt

ATOL = 1e-5
STEPS = 3  # TTT steps compared


# ---------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def rope_llama(tmp_path_factory):
    """A 6-layer tiny Llama with llama3-style RoPE scaling and theta 50000: a dropped or
    misread RoPE field changes the drafter's outputs."""
    from tiny import make_tokenizer, tiny_config
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    tok = make_tokenizer()
    cfg = tiny_config("llama", vocab_size=len(tok), layers=6)
    cfg.rope_parameters = {
        "rope_type": "llama3",
        "rope_theta": 50000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
    path = tmp_path_factory.mktemp("rope_llama")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return Target.load(str(path))


@pytest.fixture(scope="module")
def qwen2_target(tiny_target_dirs):
    return Target.load(str(tiny_target_dirs["qwen2"]))


def _samples(target, n=4, T=24):
    g = torch.Generator().manual_seed(0)
    return [
        {"input_ids": torch.randint(0, target.vocab_size, (T,), generator=g), "loss_mask": torch.ones(T, dtype=torch.bool)}
        for _ in range(n)
    ]


def _perturb(drafter, seed=1):
    """Random weights everywhere: norms away from 1 and biases away from 0, so swapped or
    dropped tensors show in the outputs."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return drafter.eval()


def _eagle3(target, num_layers=1, aux=None, vd=64, **flags):
    aux = aux or [1, target.num_layers // 2, target.num_layers - 1]
    cfg = Eagle3Config(num_layers=num_layers, draft_vocab_size=vd, aux_layers=aux, **flags)
    return _perturb(Eagle3Drafter.build(cfg, target, _samples(target)))


# EAGLE-3.1's flags (fc_norm, norm_output), each alone and together, and what speculators' trainer
# turns on by default (norm_before_fc, norm_before_residual, norm_output)
FLAGS = {"eagle3": {}, "fc_norm": {"fc_norm": True}, "norm_output": {"norm_output": True},
         "eagle3.1": {"fc_norm": True, "norm_output": True},
         "speculators-defaults": {"norm_before_fc": True, "norm_before_residual": True, "norm_output": True}}


def _save(drafter, target, path, metrics=None, recipe=None):
    meta = ckpt.checkpoint_meta(drafter, target.identity, recipe, 42, metrics)
    with atomic.directory(path) as tmp:
        ckpt.save_weights(tmp, drafter.state_dict(), meta)
    return path


def _inputs(target, T=12):
    ids = _samples(target, n=1, T=T)[0]["input_ids"][None]
    return ids


def _ttt_logits(drafter, target, ids, steps=STEPS):
    hidden = target(ids, layers=drafter.capture_layers, logits=None).hidden
    with torch.no_grad():
        return [drafter.head(h) for _, h in drafter.unroll(ids, hidden, steps)], hidden


def _flags(on):
    """Every speculators architecture flag, as ``on`` (a FLAGS entry) sets it."""
    return {f: on.get(f, False) for f in SPECULATORS_FLAGS}


def _close(ours, theirs, T):
    """Compare step i at the positions whose inputs are real tokens in both (t < T-1-i)."""
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        n = T - 1 - i
        diff = (a[:, :n] - b[:, :n]).abs().max().item()
        assert diff <= ATOL, f"TTT step {i}: max |diff| {diff}"


# ---------------------------------------------------------------------------- speculators (vLLM)
def _speculators_model(out, target):
    spec = pytest.importorskip("speculators.models.eagle3")
    from speculators import SpeculatorModelConfig

    # speculators' own config reader: resolves the class from speculators_model_type, validates fields
    cfg = SpeculatorModelConfig.from_pretrained(str(out))
    assert isinstance(cfg, spec.Eagle3SpeculatorConfig)
    # its default flex attention has no CPU path here: eager-mask SDPA instead
    cfg.transformer_layer_config._attn_implementation = "sdpa"
    return spec.Eagle3DraftModel(cfg).eval()


def _speculators_ttt_logits(m, hidden, ids, steps=STEPS):
    """Each TTT step's logits from speculators' own forward (its lm_head's outputs), on draftlab's
    pairing of position t with token x_{t+1} and the aux states its config names."""
    T = ids.shape[1]
    theirs = []
    hook = m.lm_head.register_forward_hook(lambda mod, args, o: theirs.append(o))
    try:
        with torch.no_grad():
            m(
                hidden_states=torch.cat([hidden[i] for i in m.config.eagle_aux_hidden_state_layer_ids], -1),
                input_ids=shift_left(ids, 1),
                document_ids=torch.zeros(1, T, dtype=torch.long),
                position_ids=torch.arange(T)[None],
                ttt_steps=steps,
            )
    finally:
        hook.remove()
    return theirs


@pytest.mark.parametrize("case,flags", [("llama3-rope-2-layers", "eagle3"), ("qwen2-bias", "eagle3"),
                                        *(("llama3-rope-2-layers", f) for f in ("fc_norm", "norm_output", "eagle3.1", "speculators-defaults"))])
def test_speculators_model_loads_export_and_matches(case, flags, rope_llama, qwen2_target, tmp_path):
    target, layers = (rope_llama, 2) if case.startswith("llama3") else (qwen2_target, 1)
    torch.manual_seed(0)
    d = _eagle3(target, num_layers=layers, **FLAGS[flags])
    out = export_checkpoint(_save(d, target, tmp_path / "ckpt"), "vllm", tmp_path / "vllm", target)
    config = json.loads((out / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == d.aux_layers  # same (HF hidden_states) convention
    assert config["speculators_config"]["verifier"]["name_or_path"]
    assert {f: config[f] for f in SPECULATORS_FLAGS} == _flags(FLAGS[flags])  # every flag written, as trained

    m = _speculators_model(out, target)
    assert (m.input_norm is not None, m.layers[0].norm_before_residual, m.fc_norm is not None, m.config.norm_output) == (
        config["norm_before_fc"], config["norm_before_residual"], config["fc_norm"], config["norm_output"])
    exported = load_file(out / "model.safetensors")
    model_keys = set(m.state_dict())
    # nothing exported is skipped; nothing the model has is left unset except what speculators
    # fills from the verifier itself (the shared embedding, the verifier's norm and lm_head)
    assert set(exported) <= model_keys, sorted(set(exported) - model_keys)
    assert model_keys - set(exported) == {"embed_tokens.weight", "verifier_norm.weight", "verifier_lm_head.weight"}
    state = dict(exported)
    state["embed_tokens.weight"] = target.embed_tokens.weight.detach()
    for k in ("verifier_norm.weight", "verifier_lm_head.weight"):
        state[k] = m.state_dict()[k]
    m.load_state_dict(state, strict=True)

    ids = _inputs(target)
    ours, hidden = _ttt_logits(d, target, ids)
    _close(ours, _speculators_ttt_logits(m, hidden, ids), ids.shape[1])


def test_speculators_trained_drafter_with_its_trainer_defaults_imports_and_decodes(tiny_llama, tiny_target_dirs, tmp_path):
    """A drafter as speculators' trainer builds it by default (its TrainConfig: norm_before_fc,
    norm_before_residual and norm_output on), written by its own save_pretrained, imports through
    the CLI; the imported drafter's logits are speculators' model's on the same inputs, and greedy
    speculative decoding with it is plain greedy decoding."""
    spec = pytest.importorskip("speculators.models.eagle3")
    from speculators.train.config.schema import TrainConfig
    from transformers import AutoConfig

    from draftlab.inference.decoder import SpeculativeDecoder, generate_plain
    from draftlab.inference.eagle import EagleProposer
    from draftlab.inference.shapes import Chain

    verifier = str(tiny_target_dirs["llama"])
    # the trainer's own defaults; explicit aux ids: its default [2, L//2, L-3] repeats 2 on a 4-layer target
    args = TrainConfig.from_flat({"verifier_name_or_path": verifier, "target_layer_ids": [1, 2, 3]}).flatten()
    assert {f: args[f] for f in SPECULATORS_FLAGS} == _flags(FLAGS["speculators-defaults"])
    layer_config = AutoConfig.from_pretrained(verifier)  # the trainer's draft layers: the verifier's, num_layers deep
    layer_config.num_hidden_layers = args["num_layers"]
    V, vd = tiny_llama.vocab_size, 64
    kept = torch.randperm(V, generator=torch.Generator().manual_seed(0))[:vd].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[kept] = True
    torch.manual_seed(0)
    m = spec.Eagle3DraftModel.from_training_args(
        layer_config, t2d=t2d, d2t=kept - torch.arange(vd), **{**args, "draft_vocab_size": vd, "draft_attn_impl": "sdpa"})
    with torch.no_grad():  # as if trained: the norms away from 1, so each flag changes the outputs
        for name, p in m.named_parameters():
            if not name.startswith(("embed_tokens.", "verifier_")):
                p.add_(torch.randn_like(p) * 0.1)
    m.eval().save_pretrained(str(tmp_path / "speculators"))

    assert cli_main(["import", str(tmp_path / "speculators"), "--format", "speculators", "--target", tiny_llama.identity["name"],
                     str(tmp_path / "imported")]) == 0
    d, meta = ckpt.load_drafter(tmp_path / "imported", tiny_llama)
    assert {f: meta["drafter"][f] for f in SPECULATORS_FLAGS} == _flags(FLAGS["speculators-defaults"])
    ids = _inputs(tiny_llama)
    ours, hidden = _ttt_logits(d.eval(), tiny_llama, ids)
    _close(ours, _speculators_ttt_logits(m, hidden, ids), ids.shape[1])

    prompt = torch.randint(0, V, (9,), generator=torch.Generator().manual_seed(3))
    spec_out = SpeculativeDecoder(tiny_llama, EagleProposer(d)).generate(prompt, 40, Chain(4))
    assert spec_out.tokens == generate_plain(tiny_llama, prompt, 40).tokens
    assert sum(spec_out.num_drafted) > 0


# ---------------------------------------------------------------------------- SpecForge (SGLang)
@pytest.fixture
def no_dynamo():
    """SpecForge wraps RMSNorm/RoPE in torch.compile; compiling on CPU is slow and beside the
    point. (monkeypatch.setattr would delete the flag from torch's config module on undo.)"""
    with torch._dynamo.config.patch(disable=True):
        yield


@pytest.mark.parametrize("fc_norm", [False, True])
def test_specforge_model_loads_sglang_export_and_matches(fc_norm, rope_llama, tmp_path, no_dynamo):
    sf = pytest.importorskip("specforge.modeling.draft.llama3_eagle")
    from transformers import LlamaConfig

    target = rope_llama
    torch.manual_seed(0)
    d = _eagle3(target, num_layers=1, fc_norm=fc_norm)
    out = export_checkpoint(_save(d, target, tmp_path / "ckpt"), "sglang", tmp_path / "sglang", target)
    config = json.loads((out / "config.json").read_text())
    assert config["fc_norm"] is fc_norm and "norm_output" not in config  # SpecForge's default: lm_head reads norm(h)
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [i - 1 for i in d.aux_layers]  # SGLang: id+1
    L = 32  # a real depth (the tiny target's 4 layers map two defaults to one)
    assert [i - 1 for i in Eagle3Drafter.default_aux_layers(L)] == [1, L // 2 - 1, L - 4]  # = SpecForge's default

    m = sf.LlamaForCausalLMEagle3(LlamaConfig(**config)).eval()
    assert (m.fc_norm is not None) is fc_norm and m.norm_output is True
    exported = load_file(out / "model.safetensors")
    model_keys = set(m.state_dict())
    # SGLang skips unknown names silently: the sets must agree exactly (the embedding is the target's)
    assert set(exported) <= model_keys, sorted(set(exported) - model_keys)
    assert model_keys - set(exported) == {"embed_tokens.weight"}
    m.load_state_dict({**exported, "embed_tokens.weight": target.embed_tokens.weight.detach()}, strict=True)

    ids = _inputs(target)
    T = ids.shape[1]
    ours, hidden = _ttt_logits(d, target, ids)
    theirs = []
    with torch.no_grad():
        h = m.project_hidden_states(torch.cat([hidden[i] for i in d.aux_layers], -1))
        mask = m.prepare_decoder_attention_mask(torch.ones(1, T, dtype=torch.bool), h, 1, T, 0)
        cache, tokens, pos = [[], []], shift_left(ids, 1), torch.arange(T)[None]
        for _ in range(STEPS):
            h = m.backbone(m.embed_input_ids(tokens), h, cache, mask, pos)
            theirs.append(m.compute_logits(h))
            tokens = shift_left(tokens, 1)
    _close(ours, theirs, T)


# ---------------------------------------------------------------------------- EAGLE repo (EAGLE-1)
def _eagle1_forward(drafter, target, ids):
    f = target(ids, layers=drafter.capture_layers, logits=None).hidden[target.num_layers]
    T = ids.shape[1]
    with torch.no_grad():
        h = drafter.stack(
            drafter.embed(shift_left(ids, 1)), f, torch.arange(T)[None], lambda i, attn: lambda q, k, v: attn.attend(q, k, v, causal=True)
        )
    return h, f


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_eagle_repo_model_loads_eagle1_export_and_matches(engine, tiny_llama, tmp_path):
    cnets = pytest.importorskip("eagle.model.cnets")
    from eagle.model.configs import EConfig

    target = tiny_llama  # eagle-llm's Model hard-codes RoPE theta 10000: the tiny default
    torch.manual_seed(0)
    d = _perturb(Eagle1Drafter.build(Eagle1Config(num_layers=2), target))
    if engine == "vllm":
        with torch.no_grad():
            d.fc.bias.zero_()  # vLLM's EAGLE fc has no bias: exportable only when it is zero
    out = export_checkpoint(_save(d, target, tmp_path / "ckpt"), engine, tmp_path / engine, target)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == (["LlamaForCausalLMEagle"] if engine == "sglang" else ["LlamaForCausalLM"])
    assert "bias" not in config  # vLLM/SGLang Llama layers read it as attention bias

    cfg = EConfig.from_pretrained(str(out))
    # transformers 5 rewrites the legacy `rope_scaling: null` into its rope_parameters dict,
    # which eagle-llm 1.2.1 (written for 4.x) reads as a scaling spec: restore what the file says
    assert config["rope_scaling"] is None
    cfg.rope_scaling = None
    m = cnets.Model(cfg, bias=engine == "sglang").eval()
    exported = load_file(out / "model.safetensors")
    assert set(exported) == set(m.state_dict())
    m.load_state_dict(exported, strict=True)
    ids = _inputs(target)
    ours, f = _eagle1_forward(d, target, ids)
    with torch.no_grad():
        theirs = m(f, input_ids=shift_left(ids, 1))
    n = ids.shape[1] - 1
    assert (ours[:, :n] - theirs[:, :n]).abs().max().item() <= ATOL


# ---------------------------------------------------------------------------- round trips
def _outputs(drafter, target, ids):
    if isinstance(drafter, Eagle3Drafter):
        return torch.stack(_ttt_logits(drafter, target, ids)[0])
    return _eagle1_forward(drafter, target, ids)[0]


@pytest.mark.parametrize("engine,fmt,family,flags", [
    ("vllm", "speculators", "llama", "eagle3"), ("vllm", "speculators", "qwen2", "eagle3"), ("sglang", "sglang", "llama", "eagle3"),
    ("sglang", "eagle", "llama", "eagle3"), ("vllm", "speculators", "llama", "eagle3.1"), ("sglang", "sglang", "llama", "fc_norm"),
    ("vllm", "speculators", "llama", "speculators-defaults"),
])
def test_round_trip_export_import_is_identical(engine, fmt, family, flags, tiny_llama, qwen2_target, tmp_path):
    target = tiny_llama if family == "llama" else qwen2_target
    torch.manual_seed(0)
    if fmt == "eagle":
        d = _perturb(Eagle1Drafter.build(Eagle1Config(num_layers=2), target))
    else:
        d = _eagle3(target, num_layers=2 if fmt == "speculators" else 1, aux=[1, 2, 3], **FLAGS[flags])
    out = export_checkpoint(_save(d, target, tmp_path / "ckpt"), engine, tmp_path / "exp", target)
    back = import_checkpoint(out, fmt, tmp_path / "imported", target)
    d2, meta = ckpt.load_drafter(back, target)
    assert meta["imported_from"]["format"] == fmt
    assert meta["drafter"] == d.export_meta()  # aux layers come back unshifted, same vocab, same shape
    a, b = d.export_state_dict(), d2.export_state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ids = _inputs(target)
    # identical up to the fc input scale being folded into fc.weight (float rounding only)
    torch.testing.assert_close(_outputs(d, target, ids), _outputs(d2, target, ids), rtol=0, atol=1e-5)


def test_hf_export_is_a_draftlab_checkpoint(tiny_llama, tmp_path):
    d = _eagle3(tiny_llama)
    out = export_checkpoint(_save(d, tiny_llama, tmp_path / "ckpt"), "hf", tmp_path / "hf", tiny_llama)
    d2, meta = ckpt.load_drafter(out, tiny_llama)
    assert json.loads((out / "config.json").read_text())["draftlab_algorithm"] == "eagle3"
    assert all(torch.equal(v, d2.export_state_dict()[k]) for k, v in d.export_state_dict().items())
    assert not (out / "trainer").exists()


# ---------------------------------------------------------------------------- import strictness
def test_import_lists_unknown_and_missing_tensors(tiny_llama, tmp_path):
    d = _eagle3(tiny_llama)
    out = export_checkpoint(_save(d, tiny_llama, tmp_path / "ckpt"), "sglang", tmp_path / "exp", tiny_llama)
    state = load_file(out / "model.safetensors")
    state["midlayer.self_attn.rotary.weight"] = torch.zeros(3)
    del state["fc.weight"]
    save_file(state, out / "model.safetensors")
    with pytest.raises(DraftlabError, match=r"missing fc\.weight; unknown midlayer\.self_attn\.rotary\.weight"):
        import_checkpoint(out, "sglang", tmp_path / "imported", tiny_llama)
    assert not (tmp_path / "imported").exists()


def test_import_sorts_draft_vocab_and_derives_t2d(tiny_llama, tmp_path):
    """A drafter whose draft ids are not in target-id order (and without t2d, which SGLang
    ignores) is the same drafter: import must permute, not refuse or misalign."""
    d = _eagle3(tiny_llama, vd=32)
    out = export_checkpoint(_save(d, tiny_llama, tmp_path / "ckpt"), "sglang", tmp_path / "exp", tiny_llama)
    state = load_file(out / "model.safetensors")
    perm = torch.randperm(32, generator=torch.Generator().manual_seed(0))
    target_ids = torch.arange(32) + state["d2t"]
    state["lm_head.weight"] = state["lm_head.weight"][perm].contiguous()
    state["d2t"] = target_ids[perm] - torch.arange(32)
    del state["t2d"]
    save_file(state, out / "model.safetensors")
    d2, _ = ckpt.load_drafter(import_checkpoint(out, "sglang", tmp_path / "imported", tiny_llama), tiny_llama)
    assert torch.equal(d2.lm_head.weight, d.lm_head.weight) and torch.equal(d2.d2t, d.d2t) and torch.equal(d2.t2d, d.t2d)


def test_import_reads_pytorch_model_bin_and_sglang_default_aux(tiny_llama, tmp_path):
    """Public EAGLE-1 drafters ship pytorch_model.bin (read tensors-only, weights_only=True);
    an SGLang config without eagle_config means SGLang's default capture [2, L//2, L-3]."""
    d1 = _perturb(Eagle1Drafter.build(Eagle1Config(), tiny_llama))
    out = export_checkpoint(_save(d1, tiny_llama, tmp_path / "c1"), "sglang", tmp_path / "e1", tiny_llama)
    torch.save(load_file(out / "model.safetensors"), out / "pytorch_model.bin")
    (out / "model.safetensors").unlink()
    d1b, _ = ckpt.load_drafter(import_checkpoint(out, "eagle", tmp_path / "i1", tiny_llama), tiny_llama)
    assert all(torch.equal(v, d1b.export_state_dict()[k]) for k, v in d1.export_state_dict().items())

    d3 = _eagle3(tiny_llama, aux=Eagle3Drafter.default_aux_layers(tiny_llama.num_layers))
    out = export_checkpoint(_save(d3, tiny_llama, tmp_path / "c3"), "sglang", tmp_path / "e3", tiny_llama)
    config = json.loads((out / "config.json").read_text())
    del config["eagle_config"]
    (out / "config.json").write_text(json.dumps(config))
    _, meta = ckpt.load_drafter(import_checkpoint(out, "sglang", tmp_path / "i3", tiny_llama), tiny_llama)
    assert meta["drafter"]["aux_layers"] == Eagle3Drafter.default_aux_layers(tiny_llama.num_layers)


def test_import_checks_the_embedding_belongs_to_the_target(tiny_llama, tmp_path):
    d = _perturb(Eagle1Drafter.build(Eagle1Config(), tiny_llama))
    out = export_checkpoint(_save(d, tiny_llama, tmp_path / "ckpt"), "sglang", tmp_path / "exp", tiny_llama)
    state = load_file(out / "model.safetensors")
    state["embed_tokens.weight"] = state["embed_tokens.weight"] + 1.0
    save_file(state, out / "model.safetensors")
    with pytest.raises(DraftlabError, match="differs from the target's embedding"):
        import_checkpoint(out, "eagle", tmp_path / "imported", tiny_llama)


# ---------------------------------------------------------------------------- refusals
def test_export_refuses_another_target_and_cli_exits_2(tiny_llama, tiny_target_dirs, tmp_path, capsys):
    c = _save(_eagle3(tiny_llama), tiny_llama, tmp_path / "ckpt")
    other = str(tiny_target_dirs["qwen2"])
    with pytest.raises(DraftlabError, match="was trained for target"):
        export_checkpoint(c, "vllm", tmp_path / "x", other)
    assert cli_main(["export", str(c), "--to", "vllm", str(tmp_path / "x"), "--target", other]) == 2
    assert "was trained for target" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
    # and the happy path through the CLI, import included
    assert cli_main(["export", str(c), "--to", "vllm", str(tmp_path / "ok"), "--target", tiny_llama.identity["name"]]) == 0
    assert cli_main(["import", str(tmp_path / "ok"), "--format", "speculators", "--target", tiny_llama.identity["name"], str(tmp_path / "back")]) == 0
    assert ckpt.read_meta(tmp_path / "back")["algorithm"] == "eagle3"


@pytest.mark.parametrize(
    "engine,build,match",
    [
        ("sglang", lambda t: _eagle3(t, num_layers=2), "only 1-layer drafters"),
        ("sglang", lambda t: _eagle3(t, aux=[0, 1, 2]), r"captures target hidden states 1\.\.3"),
        ("vllm", lambda t: _eagle3(t, aux=[1, 2, 4]), r"captures target hidden states 1\.\.3"),
        ("vllm", lambda t: _eagle3(t, aux=[1, 3, 2]), "each once and in ascending order"),  # engines feed fc ascending
        ("vllm", lambda t: _perturb(Eagle1Drafter.build(Eagle1Config(), t)), "fc without bias"),
        # SpecForge feeds the next step the un-normed state whatever its norm_output says
        ("sglang", lambda t: _eagle3(t, norm_output=True), "drafter.norm_output feeds the normalised state"),
        # SpecForge has neither of speculators' input norms
        ("sglang", lambda t: _eagle3(t, norm_before_fc=True), "drafter.norm_before_fc normalises the concatenated aux states"),
        ("sglang", lambda t: _eagle3(t, norm_before_residual=True), "drafter.norm_before_residual makes the normalised feature"),
    ],
)
def test_export_refuses_what_the_layout_cannot_hold(engine, build, match, tiny_llama, tmp_path):
    c = _save(build(tiny_llama), tiny_llama, tmp_path / "ckpt")
    with pytest.raises(DraftlabError, match=match):
        export_checkpoint(c, engine, tmp_path / "out", tiny_llama)
    assert not (tmp_path / "out").exists()


def test_export_refuses_qk_norm_layers_for_vllm_and_sglang(tiny_target_dirs, tmp_path):
    qwen3 = Target.load(str(tiny_target_dirs["qwen3"]))
    c = _save(_eagle3(qwen3), qwen3, tmp_path / "ckpt")
    for engine in ("vllm", "sglang"):
        with pytest.raises(DraftlabError, match="q/k RMSNorm"):
            export_checkpoint(c, engine, tmp_path / engine, qwen3)


def test_export_needs_an_empty_output_or_overwrite(tiny_llama, tmp_path):
    c = _save(_eagle3(tiny_llama), tiny_llama, tmp_path / "ckpt")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep.txt").write_text("x")
    with pytest.raises(DraftlabError, match="not empty"):
        export_checkpoint(c, "sglang", tmp_path / "busy", tiny_llama)
    assert (tmp_path / "busy" / "keep.txt").exists()
    export_checkpoint(c, "sglang", tmp_path / "busy", tiny_llama, overwrite=True)
    assert not (tmp_path / "busy" / "keep.txt").exists() and (tmp_path / "busy" / "config.json").exists()


# ---------------------------------------------------------------------------- model card
def test_model_card_reports_only_measured_numbers(tiny_llama, tmp_path):
    d = _eagle3(tiny_llama)
    ev = {"tau": 2.345, "a": [0.8, 0.5], "alpha": [0.8, 0.625], "speedup": 1.7, "num_prompts": 4}
    recipe = {"data": {"source": "sharegpt", "max_samples": 100}, "eval": {"data": "spec-bench", "k": 4}, "seed": 3}
    measured = _save(d, tiny_llama, tmp_path / "m", metrics={"eval": ev}, recipe=recipe)
    unmeasured = _save(d, tiny_llama, tmp_path / "u")
    card = (export_checkpoint(measured, "vllm", tmp_path / "mo", tiny_llama) / "README.md").read_text()
    assert "tau: **2.345**" in card and "0.800, 0.625" in card and "`source=sharegpt`" in card
    assert "num_speculative_tokens\": 4" in card  # the recipe's eval.k is the default chain length
    opts = ExportOptions(speculative_tokens=2, dtype="bfloat16")
    card = (export_checkpoint(unmeasured, "vllm", tmp_path / "uo", tiny_llama, opts) / "README.md").read_text()
    assert "Not measured" in card and "tau:" not in card
    config = json.loads((tmp_path / "uo" / "config.json").read_text())
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 2
    weights = load_file(tmp_path / "uo" / "model.safetensors")
    assert config["torch_dtype"] == "bfloat16" and weights["fc.weight"].dtype == torch.bfloat16 and weights["d2t"].dtype == torch.long
    shutil.rmtree(tmp_path / "mo")
