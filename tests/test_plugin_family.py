"""A drafter family defined entirely in this file, plugged into draftlab with no other change.

"toy_bigram" predicts the target's token after next from a table of logits indexed by the last
token plus a linear map of the target's last hidden state. It registers a drafter (its
checkpoint metadata declared as a schema, ``ToyMeta``, which every load, import and export
checks), a proposer and an export/import format here; the shared trainer (resume after SIGKILL included), the
checkpoint reader, the speculative decoder and the exporter/importer then treat it like any
other family. Run as a script, this file is the family's ``accelerate launch`` entry point.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
import yaml
from pydantic import BaseModel, ConfigDict, Field

from draftlab.export.formats import ExportOptions, Format, register
from draftlab.inference.proposer import PROPOSERS, Proposer, draft_vocab_size
from draftlab.inference.shapes import ChainDraft
from draftlab.models.drafter import DRAFTERS, Drafter, DrafterMeta, PositiveFloat, TargetHiddenSize, TargetNumLayers, TargetVocabSize
from tiny import write_chat

ALGORITHM = "toy_bigram"


class ToyConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    feature_scale: float = Field(1.0, gt=0)


class ToyLoss(BaseModel):
    model_config = ConfigDict(extra="forbid")

    label_smoothing: float = Field(0.0, ge=0, lt=1)


class ToyMeta(DrafterMeta):
    vocab_size: TargetVocabSize
    hidden_size: TargetHiddenSize
    num_target_layers: TargetNumLayers
    feature_scale: PositiveFloat


@DRAFTERS.register()
class ToyBigramDrafter(Drafter):
    algorithm = ALGORITHM
    Config = ToyConfig
    Loss = ToyLoss
    Meta = ToyMeta

    def __init__(self, vocab_size: int, hidden_size: int, num_target_layers: int, feature_scale: float):
        super().__init__()
        self.table = nn.Embedding(vocab_size, vocab_size)  # logits of x_{t+2} given x_{t+1}
        self.proj = nn.Linear(hidden_size, vocab_size, bias=False)  # ... plus a map of f_t
        nn.init.zeros_(self.table.weight)
        nn.init.zeros_(self.proj.weight)
        self.num_target_layers, self.feature_scale = num_target_layers, feature_scale

    def attach(self, target) -> "ToyBigramDrafter":
        object.__setattr__(self, "_lm_head", target.lm_head)  # shared, never registered
        return self.to(target.device)

    @classmethod
    def default_capture_layers(cls, num_target_layers):
        return [num_target_layers]

    @classmethod
    def config_meta(cls, cfg: ToyConfig, target, samples):  # Drafter.build checks it, then calls from_meta
        return {"vocab_size": target.vocab_size, "hidden_size": target.hidden_size, "num_target_layers": target.num_layers,
                "feature_scale": cfg.feature_scale}

    @classmethod
    def from_meta(cls, meta, target):
        return cls(meta["vocab_size"], meta["hidden_size"], meta["num_target_layers"], meta["feature_scale"]).attach(target)

    def meta(self):
        return {"vocab_size": self.table.num_embeddings, "hidden_size": self.proj.in_features,
                "num_target_layers": self.num_target_layers, "feature_scale": self.feature_scale}

    @property
    def capture_layers(self):
        return [self.num_target_layers]

    def logits(self, next_tokens, features):
        return self.table(next_tokens) + self.proj(features * self.feature_scale)

    @torch.no_grad()
    def derived_targets(self, hidden, batch):
        # the target's greedy token after each position: what greedy verification accepts
        return {"target_next": self._lm_head(hidden[self.num_target_layers]).argmax(-1)}

    def training_loss(self, batch, hidden, cfg: ToyLoss):
        ids, mask = batch["input_ids"], batch["loss_mask"].bool()
        f = hidden[self.num_target_layers][:, :-2]
        # position t: x_{t+1} and f_t predict the target's choice after x_{t+1}
        logits = self.logits(ids[:, 1:-1], f)
        labels = batch["target_next"][:, 1:-1]
        counted = mask[:, 2:]
        loss = F.cross_entropy(logits[counted], labels[counted], label_smoothing=cfg.label_smoothing)
        acc = (logits[counted].argmax(-1) == labels[counted]).float().mean().item()
        return loss, {"acc": [acc]}


@PROPOSERS.register(ALGORITHM)
class ToyBigramProposer(Proposer):
    shapes = frozenset({"chain"})

    def __init__(self, drafter: ToyBigramDrafter, trained_depth: int | None = None):
        super().__init__(draft_vocab=draft_vocab_size(drafter), trained_depth=trained_depth)
        self.drafter = drafter.eval()
        self.name = ALGORITHM
        self.layers = tuple(drafter.capture_layers)

    def start(self, prompt_ids, hidden, next_token):
        self.feature = hidden[self.drafter.num_target_layers][0, -1]
        self.last = int(next_token)

    @torch.no_grad()
    def propose(self, shape):
        tokens, last, feature = [], self.last, self.feature
        for _ in range(shape.k):  # later drafts have no target feature yet: the table alone
            logits = self.drafter.logits(torch.tensor(last, device=feature.device), feature)
            last = int(logits.argmax())
            tokens.append(last)
            feature = torch.zeros_like(feature)
        return ChainDraft(torch.tensor(tokens, dtype=torch.long))

    def advance(self, accepted, hidden):
        self.feature = hidden[self.drafter.num_target_layers][0, -1]
        self.last = int(accepted[-1])


class ToyLayout(Format):
    name = "toy"
    algorithm = ALGORITHM
    engines = ("toy-engine",)
    renames = (("table.", "bigram."),)
    title = "toy bigram layout"

    def export_config(self, drafter, target, meta, opts: ExportOptions):
        return {"architectures": ["ToyBigram"], **drafter.meta()}

    def import_meta(self, config, tensors, target):
        return {k: config[k] for k in ("vocab_size", "hidden_size", "num_target_layers", "feature_scale")}


register(ToyLayout())

# ------------------------------------------------------------------------------------ tests
REPO = Path(__file__).resolve().parent.parent
def _recipe(tmp_path: Path, target_dir, name: str) -> Path:
    data = write_chat(tmp_path / "chat.jsonl", 30)
    recipe = {
        "algorithm": ALGORITHM,
        "output_dir": str(tmp_path / name),
        "target": {"model": str(target_dir)},
        "data": {"source": str(data), "max_length": 96, "heldout": 4},
        "capture": {"mode": "memory"},
        "train": {"max_steps": 8, "batch_tokens": 384, "checkpoint_every": 4, "warmup_steps": 1, "lr": 3e-2},
        "eval": {"enabled": True, "num_prompts": 2, "max_new_tokens": 12, "k": 1},
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def _train(recipe: Path, kill_after=None):
    """This file as the training script; ``kill_after=N``: SIGKILLed right after the step-N checkpoint."""
    killer = [str(REPO / "tests" / "kill_after_checkpoint.py"), str(kill_after)] if kill_after else []
    e = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, *killer, __file__, str(recipe)], capture_output=True, text=True, env=e, timeout=300, cwd=REPO)


def test_a_family_defined_in_one_file_trains_resumes_decodes_and_exports(tmp_path, tiny_target_dirs, tiny_llama):
    from safetensors.torch import load_file

    from draftlab import checkpoint as ckpt
    from draftlab.data.dataset import build_samples, collate
    from draftlab.export.exporter import export_checkpoint
    from draftlab.export.importer import import_checkpoint
    from draftlab.inference.decoder import SpeculativeDecoder, generate_plain
    from draftlab.inference.proposer import load_proposer
    from draftlab.inference.shapes import Chain
    from draftlab.recipe import load_recipe

    target_dir = tiny_target_dirs["llama"]
    straight = _recipe(tmp_path, target_dir, "straight")
    killed = _recipe(tmp_path, target_dir, "killed")
    res = _train(straight)
    assert res.returncode == 0, res.stderr[-2000:]
    res = _train(killed, kill_after=4)
    assert res.returncode != 0 and ckpt.list_checkpoints(tmp_path / "killed")[-1].name == "step-0000004"
    res = _train(killed)
    assert res.returncode == 0 and "resumed from" in res.stdout, res.stderr[-2000:]
    final = [ckpt.step_dir(tmp_path / run, 8) / ckpt.WEIGHTS for run in ("straight", "killed")]
    a, b = (load_file(f) for f in final)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    # the after-checkpoint report decoded with it, greedy-exact
    report = json.loads((tmp_path / "straight" / "eval" / "latest.json").read_text())
    assert report["greedy_match"] == "2/2" and report["step"] == 8

    # it learned: on the same batch its loss is below that of a fresh (uniform) drafter
    ckpt_dir = ckpt.step_dir(tmp_path / "straight", 8)
    trained, _ = ckpt.load_drafter(ckpt_dir, tiny_llama)
    fresh = ToyBigramDrafter.build(ToyConfig(), tiny_llama, [])
    samples = build_samples(load_recipe(straight).data, tiny_llama.tokenizer).train[:8]
    batch = collate(samples, tiny_llama.tokenizer.pad_token_id)
    hidden = tiny_llama(batch["input_ids"], layers=trained.capture_layers, logits=None).hidden
    batch = {**batch, **trained.derived_targets(hidden, batch)}
    with torch.no_grad():
        losses = [d.training_loss(batch, hidden, ToyLoss())[0].item() for d in (fresh, trained)]
    assert losses[1] < losses[0] - 0.5, losses

    # chain decoding through the registry: its drafts are verified, greedy output equals plain greedy
    proposer = load_proposer(ckpt_dir, tiny_llama)
    prompt = tiny_llama.tokenizer("the quick brown fox", return_tensors="pt").input_ids[0]
    plain = generate_plain(tiny_llama, prompt, 20)
    spec = SpeculativeDecoder(tiny_llama, proposer).generate(prompt, 20, shape=Chain(2))
    assert spec.tokens == plain.tokens and sum(spec.num_drafted) > 0

    # export through the format this file registers, and back
    out = export_checkpoint(ckpt_dir, "toy-engine", tmp_path / "exported", tiny_llama)
    assert "bigram.weight" in load_file(out / "model.safetensors")
    back = import_checkpoint(out, "toy", tmp_path / "imported", tiny_llama)
    d1, _ = ckpt.load_drafter(ckpt_dir, tiny_llama)
    d2, meta = ckpt.load_drafter(back, tiny_llama)
    assert meta["algorithm"] == ALGORITHM
    assert all(torch.equal(v, d2.state_dict()[k]) for k, v in d1.state_dict().items())


if __name__ == "__main__":
    from draftlab.train.launch import entry_point

    entry_point(__file__, (ALGORITHM,), __doc__.splitlines()[0])
