"""draft_lm export (``--to hf``) and import (``--format hf-lm``), proven with HF transformers' own code.

* The export is a complete HF model directory: ``AutoModelForCausalLM.from_pretrained`` loads it
  with no missing or unexpected weight and computes the drafter's logits; the tokenizer files,
  the generation config and the model card are there.
* HF's assisted generation (``target.generate(..., assistant_model=draft)``) with the export
  gives the target's plain greedy output, and HF's own per-step count of accepted drafts equals
  draftlab's from its Decoder with the draft_lm proposer (the one difference explained below).
* Import: an export comes back as the same checkpoint; any HF causal LM directory with the
  target's vocabulary (the tiny target itself) imports and decodes; bad directories are one-line
  errors with exit code 2 through the CLI.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from draftlab import checkpoint as ckpt
from draftlab.cli import main as cli_main
from draftlab.errors import DraftlabError
from draftlab.export.exporter import export_checkpoint
from draftlab.export.formats import ExportOptions
from draftlab.export.importer import import_checkpoint
from draftlab.inference.decoder import Decoder, generate_plain, single
from draftlab.inference.proposer import load_proposer
from draftlab.inference.shapes import Chain
from draftlab.models.draft_lm import DraftLM, DraftLMConfig
from draftlab.models.target import Target
from tiny import assert_one_line, make_tokenizer, save_checkpoint

K = 3  # drafts per step
N = 24  # new tokens per prompt
PROMPTS = ["The quick brown fox", "def add(a, b):", "Translate to French: good morning", "Hello! How can"]


def _draft(target, num_layers=3, seed=None, scale=0.05):
    """The target truncated to ``num_layers`` of its layers; ``seed``: weights perturbed by
    ``scale`` so that a swapped or dropped tensor shows."""
    d = DraftLM.build(DraftLMConfig(num_layers=num_layers), target)
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in d.parameters():
                p.add_(torch.randn(p.shape, generator=g) * scale)
    return d.eval()


@pytest.fixture(scope="module")
def qwen2(tiny_target_dirs):
    return Target.load(str(tiny_target_dirs["qwen2"]))


@pytest.fixture(scope="module")
def exported(tiny_llama, tmp_path_factory):
    """(checkpoint, export) of a draft of the tiny Llama, K drafts per step: its 4 layers
    slightly perturbed, so that the draft agrees with the target at some steps and not at
    others (a truncated random target agrees almost never)."""
    root = tmp_path_factory.mktemp("draft_lm_export")
    c = save_checkpoint(_draft(tiny_llama, num_layers=4, seed=0, scale=0.005), tiny_llama, root / "ckpt")
    return c, export_checkpoint(c, "hf", root / "hf", tiny_llama, ExportOptions(speculative_tokens=K))


def _ids(tokenizer, text):
    return tokenizer(text, return_tensors="pt").input_ids


# ---------------------------------------------------------------------------- the export loads in HF
@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: tied embeddings
def test_export_is_a_complete_hf_model_directory(family, tiny_llama, qwen2, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    target = tiny_llama if family == "llama" else qwen2
    d = _draft(target, num_layers=2, seed=1)
    c = save_checkpoint(d, target, tmp_path / "ckpt")
    out = export_checkpoint(c, "hf", tmp_path / "hf", target, ExportOptions(speculative_tokens=5))

    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [type(target.model).__name__] and config["model_type"] == family
    assert config["num_hidden_layers"] == 2 and config["vocab_size"] == target.vocab_size
    m, info = AutoModelForCausalLM.from_pretrained(str(out), output_loading_info=True)
    assert type(m) is type(target.model)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    # what the file holds is exactly HF's state dict (a tied lm_head once, under the embedding)
    stored = set(load_file(out / "model.safetensors"))
    want = set(m.state_dict()) - ({"lm_head.weight"} if m.config.tie_word_embeddings else set())
    assert stored == want and m.config.tie_word_embeddings == (family == "qwen2")
    ids = torch.randint(0, target.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(m(ids).logits, d.lm(ids).logits, rtol=0, atol=1e-5)

    assert AutoTokenizer.from_pretrained(str(out)).get_vocab() == target.tokenizer.get_vocab()
    gen = GenerationConfig.from_pretrained(str(out))
    assert (gen.num_assistant_tokens, gen.num_assistant_tokens_schedule, gen.assistant_confidence_threshold) == (5, "constant", 0.0)
    assert gen.eos_token_id == target.model.generation_config.eos_token_id
    assert "_from_model_config" not in json.loads((out / "generation_config.json").read_text())  # HF would rebuild it
    card = (out / "README.md").read_text()
    assert f'"method": "draft_model", "model": "{out}", "num_speculative_tokens": 5' in card
    assert "assistant_model=draft" in card and "standalone causal LM" in card and "hidden states" not in card
    assert not list(tmp_path.glob(".tmp-*"))  # written through a staging directory, renamed into place


# ---------------------------------------------------------------------------- HF assisted generation
class _Counted:
    """HF's own account of an assisted generation: per target forward, the drafts it verified
    and how many it accepted (``update_candidate_strategy`` is called once per target forward
    with ``n_matches``, and the verified logits cover the drafts plus the bonus position)."""

    def __init__(self, monkeypatch):
        from transformers.generation.candidate_generator import AssistedCandidateGenerator

        self.steps: list[tuple[int, int]] = []  # (drafted, accepted)
        original = AssistedCandidateGenerator.update_candidate_strategy

        def update(gen, input_ids, scores, num_matches):
            self.steps.append((scores.shape[1] - 1, int(num_matches)))
            return original(gen, input_ids, scores, num_matches)

        monkeypatch.setattr(AssistedCandidateGenerator, "update_candidate_strategy", update)

    def take(self) -> list[tuple[int, int]]:
        steps, self.steps = self.steps, []
        return steps


def test_hf_assisted_generation_with_the_export_is_greedy_exact_and_counts_what_draftlab_counts(
        exported, tiny_llama, tiny_target_dirs, monkeypatch):
    """HF's assisted generation and draftlab's decoder run the same greedy chain algorithm on
    the same models, so HF's count of accepted drafts is draftlab's, step for step, after two
    bookkeeping differences:

    * alignment: HF verifies its first drafts in the prefill forward (drafted from the prompt),
      draftlab's prefill emits the first token and drafts after it. HF on ``prompt + [t1]`` is
      therefore in draftlab's state at every step: same number of target forwards, same drafts.
    * the last step: HF drafts at most ``max_length - len - 1`` tokens and counts matches after
      cutting at the token budget and eos; draftlab drafts K and counts every accepted draft,
      then emits up to the budget. So the last step's HF count is the emitted tokens minus one,
      and draftlab's is at least that; tau differs by exactly that excess over the step count.
    """
    from transformers import AutoModelForCausalLM

    ckpt_dir, out = exported
    target_hf = AutoModelForCausalLM.from_pretrained(str(tiny_target_dirs["llama"])).eval()
    draft = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    eos = target_hf.generation_config.eos_token_id
    counted = _Counted(monkeypatch)
    proposer = load_proposer(ckpt_dir, tiny_llama, Chain(K))
    seen: set[int] = set()  # accepted counts met before a last step

    def generate(ids, n, **kw):
        with torch.no_grad():
            return target_hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                                      pad_token_id=eos, **kw)[0, ids.shape[1]:].tolist()

    for text in PROMPTS:
        ids = _ids(tiny_llama.tokenizer, text)
        plain = generate(ids, N)
        assert generate(ids, N, assistant_model=draft) == plain  # the peer's own proof: lossless greedy
        assert all(drafted <= K for drafted, _ in counted.take())  # the export's generation config: K per step

        res = single(Decoder(tiny_llama, proposer).generate([ids[0]], N, Chain(K), eos_token_id=eos))
        assert res.tokens == plain
        assert generate_plain(tiny_llama, ids[0], N, eos_token_id=eos).tokens == plain

        # HF from draftlab's state after its prefill
        aligned = torch.cat([ids, torch.tensor([[plain[0]]])], dim=1)
        assert generate(aligned, len(plain) - 1, assistant_model=draft) == plain[1:]
        hf = counted.take()
        ours = res.accept_lengths
        assert len(hf) == len(ours) == res.num_steps  # one target forward per step, after the prefill
        # every step drafts K: HF's assistant stops early only at a drafted eos, which the target then rejects
        assert all(d <= K for d, _ in hf) and all(d == K for d, m in hf[:-1] if m == d)
        assert [m for _, m in hf[:-1]] == ours[:-1]
        last_emitted = len(plain) - 1 - sum(a + 1 for a in ours[:-1])
        assert hf[-1][1] == last_emitted - 1 <= ours[-1]
        tau_hf = (len(plain) - 1) / len(hf)  # HF's tokens per target forward
        assert res.stats().tau == pytest.approx(tau_hf + (ours[-1] - hf[-1][1]) / len(hf), abs=1e-12)
        seen |= set(ours[:-1])
    assert {0, K} <= seen and seen & set(range(1, K))  # counts that could have disagreed: none, some and all accepted


# ---------------------------------------------------------------------------- import
def test_import_round_trip_gives_back_the_checkpoint(tiny_llama, qwen2, tmp_path):
    for target in (tiny_llama, qwen2):
        d = _draft(target, num_layers=2, seed=2)
        name = target.config.model_type
        out = export_checkpoint(save_checkpoint(d, target, tmp_path / f"{name}-ckpt"), "hf", tmp_path / f"{name}-hf", target)
        back = import_checkpoint(out, "hf-lm", tmp_path / f"{name}-back", target)
        d2, meta = ckpt.load_drafter(back, target)
        assert meta["imported_from"]["format"] == "hf-lm"
        assert meta["drafter"] == d.export_meta()  # init and target_layers come back from config.json's draftlab entry
        a, b = d.export_state_dict(), d2.export_state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_import_any_hf_causal_lm_with_the_target_vocabulary_and_decode(tiny_llama, tiny_target_dirs, tmp_path, capsys):
    """The tiny target's own directory is an HF causal LM with its vocabulary: imported as a
    draft model (init "import"), it drafts what the target would say, so every draft is accepted."""
    src, tgt = str(tiny_target_dirs["llama"]), str(tiny_target_dirs["llama"])
    assert cli_main(["import", src, "--format", "hf-lm", "--target", tgt, str(tmp_path / "imp")]) == 0
    meta = ckpt.read_meta(tmp_path / "imp")
    assert meta["algorithm"] == "draft_lm" and meta["drafter"]["init"] == "import" and meta["drafter"]["target_layers"] == []
    ckpt.check_drafter(meta["algorithm"], meta["drafter"], tiny_llama, "imported", load_file(tmp_path / "imp" / ckpt.WEIGHTS))
    proposer = load_proposer(tmp_path / "imp", tiny_llama, Chain(K))
    ids = _ids(tiny_llama.tokenizer, PROMPTS[0])[0]
    res = single(Decoder(tiny_llama, proposer).generate([ids], 16, Chain(K)))
    assert res.tokens == generate_plain(tiny_llama, ids, 16).tokens
    assert res.accept_lengths[:-1] == [K] * (len(res.accept_lengths) - 1)


def _edit_config(path, drop=(), **changes):
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    for k in drop:
        del config[k]
    (path / "config.json").write_text(json.dumps(config))


def _swap_tokens(path):
    """Two tokens of the tokenizer's vocabulary trade ids: same size, other vocabulary."""
    tok = json.loads((path / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = [t for t in vocab if vocab[t] in (100, 101)]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (path / "tokenizer.json").write_text(json.dumps(tok))


def _other_tokenizer(path):
    """The tokenizer a Llama-3-style template gives, trained to another vocabulary size."""
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (path / f).unlink()
    make_tokenizer("llama3", vocab_size=300).save_pretrained(path)


BAD = {
    "vocab size": (lambda p: _edit_config(p, vocab_size=401), r"config\.json: vocab_size 401 is not the target's 400"),
    "tokenizer ids": (_swap_tokens, r"tokenizer's vocabulary differs from the target's in 2 token\(s\)"),
    "tokenizer size": (_other_tokenizer, r"tokenizer's vocabulary differs from the target's .*\(\d+ vs 400 tokens\)"),
    "no tokenizer": (lambda p: [(p / f).unlink() for f in ("tokenizer.json", "tokenizer_config.json")], "no readable tokenizer"),
    "architecture": (lambda p: _edit_config(p, model_type="gpt2", architectures=["GPT2LMHeadModel"]),
                     "model_type 'gpt2' is not a family draftlab's layers run"),
    "head class": (lambda p: _edit_config(p, architectures=["LlamaForSequenceClassification"]),
                   r"architectures \['LlamaForSequenceClassification'\] is not \['LlamaForCausalLM'\]"),
    "other family": (lambda p: _edit_config(p, model_type="qwen2", architectures=["Qwen2ForCausalLM"]),
                     "model_type 'qwen2' is not the target's 'llama'"),
    "remote code": (lambda p: _edit_config(p, auto_map={"AutoModelForCausalLM": "modeling.Model"}), "auto_map names remote code"),
    "activation": (lambda p: _edit_config(p, hidden_act="gelu"), r"drafter\.config\.hidden_act = \"gelu\" is not silu"),
    "corrupt weights": (lambda p: (p / "model.safetensors").write_bytes((p / "model.safetensors").read_bytes()[:64]),
                        "model.safetensors: not a readable safetensors file"),
    "no weights": (lambda p: (p / "model.safetensors").unlink(), "no model.safetensors"),
    "missing tensor": (lambda p: _drop_tensor(p, "model.norm.weight"), r"missing model\.norm\.weight"),
    "config not JSON": (lambda p: (p / "config.json").write_text("{"), r"config\.json: invalid JSON"),
}


def _drop_tensor(path, name):
    from safetensors.torch import save_file

    state = load_file(path / "model.safetensors")
    del state[name]
    save_file(state, path / "model.safetensors")


@pytest.mark.parametrize("case", sorted(BAD))
def test_import_refuses_with_one_line_and_exit_2(case, exported, tiny_llama, tiny_target_dirs, tmp_path, capsys):
    import shutil

    src = shutil.copytree(exported[1], tmp_path / "src")
    damage, match = BAD[case]
    damage(src)
    with pytest.raises(DraftlabError) as e:
        import_checkpoint(src, "hf-lm", tmp_path / "imp", tiny_llama)
    assert_one_line(e, match)
    rc = cli_main(["import", str(src), "--format", "hf-lm", "--target", str(tiny_target_dirs["llama"]), str(tmp_path / "imp")])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error" in line]
    assert rc == 2 and len(errors) == 1 and "Traceback" not in err, err
    assert not (tmp_path / "imp").exists()


def test_import_refuses_a_sliding_window_the_target_does_not_have(qwen2, tmp_path):
    """Qwen2 gives layers from max_window_layers on a sliding window when use_sliding_window is set
    (and layer_types does not say otherwise); draftlab rebuilds the draft model from the target's
    config, which has none, so the import would change the model."""
    out = export_checkpoint(save_checkpoint(_draft(qwen2, num_layers=2), qwen2, tmp_path / "ckpt"), "hf", tmp_path / "hf", qwen2)
    _edit_config(out, use_sliding_window=True, sliding_window=16, max_window_layers=1, drop=["layer_types"])
    with pytest.raises(DraftlabError) as e:
        import_checkpoint(out, "hf-lm", tmp_path / "imp", qwen2)
    assert_one_line(e, "layer_types = .* but a draft model of this target has")
