"""Every reader of a checkpoint or a public drafter, and every writer of an output, answers bad
input with a one-line DraftlabError naming the file and what is wrong, never a traceback."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftlab import atomic
from draftlab import checkpoint as ckpt
from draftlab.cli import main as cli_main
from draftlab.errors import DraftlabError
from draftlab.export.exporter import export_checkpoint
from draftlab.export.importer import import_checkpoint
from draftlab.models.eagle import Eagle3Config, Eagle3Drafter


@pytest.fixture()
def checkpoint(tiny_llama, tmp_path):
    d = Eagle3Drafter.build(Eagle3Config(draft_vocab_size=0, normalize_fc_input=False), tiny_llama, [])
    path = tmp_path / "ckpt"
    with atomic.directory(path) as tmp:
        ckpt.save_weights(tmp, d.state_dict(), ckpt.checkpoint_meta(d, tiny_llama.identity, None, 1))
    return path


def _edit_meta(path, edit):
    meta = json.loads((path / ckpt.META).read_text())
    edit(meta)
    (path / ckpt.META).write_text(json.dumps(meta))


def _edit_weights(path, edit):
    state = load_file(path / ckpt.WEIGHTS)
    edit(state)
    save_file(state, path / ckpt.WEIGHTS)


BAD_CHECKPOINTS = {
    "truncated weights": (lambda p: (p / ckpt.WEIGHTS).write_bytes((p / ckpt.WEIGHTS).read_bytes()[:100]),
                          "model.safetensors: not a readable safetensors file"),
    "garbage weights": (lambda p: (p / ckpt.WEIGHTS).write_bytes(b"\x00" * 64), "not a readable safetensors file"),
    "missing weights": (lambda p: (p / ckpt.WEIGHTS).unlink(), "model.safetensors: missing"),
    "meta not JSON": (lambda p: (p / ckpt.META).write_text("{oops"), "draftlab.json: invalid JSON"),
    "meta without drafter": (lambda p: _edit_meta(p, lambda m: m.pop("drafter")), "field 'drafter' is missing"),
    "drafter meta without a field": (lambda p: _edit_meta(p, lambda m: m["drafter"].pop("aux_layers")),
                                     "drafter meta lacks 'aux_layers'"),
    "unknown family": (lambda p: _edit_meta(p, lambda m: m.update(algorithm="eagle9")), "unknown drafter family 'eagle9'"),
    "wrong shape": (lambda p: _edit_weights(p, lambda s: s.update({"fc.weight": s["fc.weight"][:, :-1].contiguous()})),
                    r"tensor fc\.weight \(64, 127\)"),
    "wrong dtype": (lambda p: _edit_weights(p, lambda s: s.update({"fc.weight": s["fc.weight"].long()})),
                    r"tensor fc\.weight .* torch\.int64, expected .* torch\.float32"),
    "missing tensor": (lambda p: _edit_weights(p, lambda s: s.pop("norm.weight")), r"missing \['norm\.weight'\]"),
}


@pytest.mark.parametrize("case", sorted(BAD_CHECKPOINTS))
def test_a_bad_checkpoint_is_one_line_error(case, checkpoint, tiny_llama, tmp_path, capsys):
    damage, match = BAD_CHECKPOINTS[case]
    damage(checkpoint)
    with pytest.raises(DraftlabError, match=match):
        ckpt.load_drafter(checkpoint, tiny_llama)
    # through the CLI: exit 2, one line naming the checkpoint, no traceback
    rc = cli_main(["export", str(checkpoint), "--to", "hf", str(tmp_path / "out"), "--target", tiny_llama.identity["name"]])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error" in line]
    assert rc == 2 and len(errors) == 1 and "Traceback" not in err and str(checkpoint) in errors[0], err
    assert not (tmp_path / "out").exists()


BAD_PUBLIC = {
    "truncated safetensors": (lambda p: (p / "model.safetensors").write_bytes((p / "model.safetensors").read_bytes()[:50]),
                              "not a readable safetensors file"),
    "config not JSON": (lambda p: (p / "config.json").write_text("nope"), r"config\.json: invalid JSON"),
    "config a list": (lambda p: (p / "config.json").write_text("[1, 2]"), "expected a JSON object"),
    "pickle with code": (lambda p: ((p / "model.safetensors").unlink(), torch.save({"x": object}, p / "pytorch_model.bin")),
                         "pytorch_model.bin: not a plain tensor dict"),
    "sharded index without map": (lambda p: (p / "model.safetensors.index.json").write_text("{}"), "no weight_map"),
    "wrong tensor shape": (lambda p: _edit_public(p, "fc.weight", lambda t: t[:-1].contiguous()),
                           "tensor shapes do not match the config: fc.weight"),
}


def _edit_public(path, name, edit):
    state = load_file(path / "model.safetensors")
    state[name] = edit(state[name])
    save_file(state, path / "model.safetensors")


@pytest.mark.parametrize("case", sorted(BAD_PUBLIC))
def test_a_bad_public_drafter_is_one_line_error(case, checkpoint, tiny_llama, tmp_path):
    public = export_checkpoint(checkpoint, "vllm", tmp_path / "public", tiny_llama)
    damage, match = BAD_PUBLIC[case]
    damage(public)
    with pytest.raises(DraftlabError, match=match):
        import_checkpoint(public, "speculators", tmp_path / "imported", tiny_llama)
    assert not (tmp_path / "imported").exists()


def test_an_output_that_cannot_be_written_is_one_line_error(checkpoint, tiny_llama, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(DraftlabError, match="a-file"):
        export_checkpoint(checkpoint, "vllm", blocker / "out", tiny_llama)
    public = export_checkpoint(checkpoint, "vllm", tmp_path / "public", tiny_llama)
    with pytest.raises(DraftlabError, match="a-file"):
        import_checkpoint(public, "speculators", blocker / "out", tiny_llama)
    with pytest.raises(DraftlabError, match="a-file is a file, not a directory"):
        atomic.write_json(blocker / "report.json", {})
    for write in (lambda: export_checkpoint(checkpoint, "vllm", blocker, tiny_llama, overwrite=True),
                  lambda: import_checkpoint(public, "speculators", blocker, tiny_llama, overwrite=True)):
        with pytest.raises(DraftlabError, match="a-file is a file, not a directory"):  # --overwrite replaces directories only
            write()
    assert blocker.read_text() == "x" and sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "ckpt", "public"]
