"""bench.trainer_parity: speculators' and SpecForge's own training code on a tiny target, their
checkpoints imported by draftlab and decoded greedy-equal to plain; the bench's one-line errors."""

import json

import pytest
import torch

from bench import trainer_parity as parity

from tests.tiny import tiny_eagle3_recipe

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("parity")
    return root, tiny_eagle3_recipe(root, eval_section={"data": "sharegpt-heldout", "num_prompts": 2, "max_new_tokens": 8})


@pytest.mark.slow  # ~2 min: both peers' own training code on the CPU
@pytest.mark.parametrize("system", ["speculators", "specforge"])
def test_peer_trained_checkpoint_imports_and_decodes_greedy_equal(setup, system):
    pytest.importorskip(parity.PEERS[system][0])
    root, recipe = setup
    out = root / system
    ctx = parity.Context(str(recipe), [], root)
    cap = ctx.capture()
    assert cap["aux"].shape == (ctx.tokens, 3 * ctx.target.hidden_size)
    train = parity.train_speculators if system == "speculators" else parity.train_specforge
    trained = train(ctx, out, cap)
    assert trained["steps"] >= 1 and trained["train_metric"] != "-"
    ckpt = parity.import_arm(ctx, system, trained, out)
    meta = json.loads((out / "imported" / "draftlab.json").read_text())
    assert meta["imported_from"]["format"] == parity.IMPORT_FORMAT[system]
    if system == "speculators":  # its own default architecture, not draftlab's
        assert all(meta["drafter"][f] for f in ("norm_before_fc", "norm_before_residual", "norm_output"))
    args = parity.parse_args(["--num-prompts", "2", "--k", "3", "--max-new-tokens", "8"])
    report = parity.eval_arm(str(recipe), ctx.recipe.target.model, ckpt, out, args)
    assert [p["matched"] for p in report["prompts"]] == [True, True]  # lossless: greedy equals plain
    assert all(p["num_steps"] >= 1 and len(p["reached"]) == 3 for p in report["prompts"])


@pytest.mark.parametrize("argv, message", [
    (["--systems", "speculators"], "draftlab is the arm"),
    (["--systems", "draftlab,medusa"], "unknown ['medusa']"),
    (["--num-prompts", "1"], "--num-prompts"),
])
def test_bad_arguments_are_one_line_errors(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        parity.parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert message in err


def test_missing_peer_package_is_one_line(monkeypatch, capsys):
    from importlib import metadata

    real = metadata.version

    def version(name):
        if name == "specforge":
            raise metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(metadata, "version", version)
    assert parity.main(["--systems", "draftlab,specforge"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("bench.trainer_parity: error: --systems specforge: the specforge package is not installed") and "\n" not in err


def test_peer_checkpoint_of_another_target_is_one_line(setup, tmp_path):
    """A peer checkpoint made for another target (here: hidden size 32, not 64) is refused by the
    import stage with the importer's one-line error."""
    root, recipe = setup
    src = tmp_path / "peer"
    src.mkdir()
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
           "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 1, "vocab_size": 400,
           "draft_vocab_size": 128, "rms_norm_eps": 1e-6, "max_position_embeddings": 512}
    (src / "config.json").write_text(json.dumps(cfg))
    from safetensors.torch import save_file

    save_file({"fc.weight": torch.zeros(32, 96)}, str(src / "model.safetensors"))
    ctx = parity.Context(str(recipe), [], root)
    with pytest.raises(parity.DraftlabError, match="hidden size") as e:
        parity.import_arm(ctx, "specforge", {"checkpoint": str(src)}, tmp_path / "arm")
    assert "\n" not in str(e.value)


def test_out_dir_of_another_recipe_is_one_line(setup, tmp_path, capsys):
    root, recipe = setup
    out = tmp_path / "out"
    out.mkdir()
    (out / "setup.json").write_text(json.dumps({"recipe": "0" * 16, "epochs": 1, "target": {"name": "another"}}))
    assert parity.main(["--out", str(out), "--recipe", str(recipe), "--stage", "train", "--systems", "draftlab"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after the target's loading bar
    assert err.startswith(f"bench.trainer_parity: error: --out {out}: made for another") and "target" in err


def test_ablations_bad_input_is_one_line(tmp_path, capsys):
    from bench import ablations

    assert ablations.main(["--capture", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("bench.ablations: error: --capture") and "\n" not in err
    with pytest.raises(SystemExit):
        ablations.parse_args(["--capture", str(tmp_path), "--arms", "recipe,nope"])
    assert "unknown ['nope']" in capsys.readouterr().err
    assert ablations.parse_args(["--capture", str(tmp_path), "--arms", "ttt3"]).arms == ["recipe", "ttt3"]
