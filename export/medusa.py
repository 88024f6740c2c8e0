"""Medusa-1 <-> vLLM's ``MedusaModel`` and FasterDecoding's ``medusa_lm_head`` layout.

draftlab's Medusa tensors: ``blocks.{h}.layers.{l}.weight/.bias`` (residual block l of head h),
``lm_heads.{h}.weight`` [V_draft, H], ``d2t``/``t2d`` (draft vocabulary, as EAGLE-3).

``--to vllm`` (import ``--format medusa-vllm``), checked against vLLM's
``model_executor/models/medusa.py`` and ``transformers_utils/configs/medusa.py``:

* Tensor names are draftlab's (vLLM's ``ResidualBlock`` is ``layers.{l}``, x + SiLU(Wx + b)).
  A reduced draft vocabulary is vLLM's ``token_map`` (the kept target ids, Long[V_draft]) with
  ``truncated_vocab_size``; vLLM scatters each head's logits onto the full vocabulary with it.
* Config keys are all written: vLLM defaults a missing ``hidden_size`` / ``vocab_size`` to 4096 /
  32001, and ``medusa_fc_bias`` to false (it would then build blocks without bias and skip ours
  without a word). vLLM skips unknown tensor names silently, so the written set is checked
  against the set its module creates in the test-suite.
* Import mirrors vLLM's reader: a ``medusa_heads.`` prefix is stripped, keys holding "num" and
  "heads"/"layers" are its ``num_heads``/``num_hidden_layers``, blocks without bias are zero
  biases, ``original_lm_head`` shares ``lm_heads.0``, ``logit_scale`` is folded into the heads,
  full-vocab heads are cut down by ``token_map``, an unsorted ``token_map`` is sorted.

``--to medusa`` (import ``--format medusa``): FasterDecoding's files, also read by
TensorRT-LLM's Medusa converter: ``medusa_lm_head.safetensors`` and, for loaders that only read
that (medusa-llm's ``MedusaModel.from_pretrained``), the same tensors in ``medusa_lm_head.pt``.
Head h is ``Sequential(ResBlock x L, Linear(H, V, bias=False))``: ``{h}.{l}.linear.weight/.bias``
and ``{h}.{L}.weight``. Full-vocabulary heads only.
"""

from __future__ import annotations

import io
import re
from pathlib import Path

import torch

from draftlab.atomic import write_bytes
from draftlab.errors import DraftlabError
from draftlab.export.check import PeerProposer, max_diff
from draftlab.export.formats import ExportOptions, Format, read_torch_tensors, register, vocab_maps
from draftlab.models.medusa import MedusaDrafter

VOCAB_MAPS = ("d2t", "t2d")  # draftlab's form of the draft vocabulary; each layout has its own


# ============================================================================ vLLM


class VllmMedusa(Format):
    name = "medusa-vllm"
    algorithm = "medusa"
    engines = ("vllm",)
    title = "vLLM `MedusaModel` layout"

    def from_format(self, name: str) -> str:
        return name.removeprefix("medusa_heads.")  # vLLM strips it as well

    def extra_tensors(self, drafter, target):
        if drafter.draft_vocab_size == drafter.vocab_size:
            return {}
        return {"token_map": torch.arange(drafter.draft_vocab_size, device=drafter.d2t.device) + drafter.d2t}

    def export_state(self, drafter, target):
        state = super().export_state(drafter, target)
        for k in VOCAB_MAPS:  # token_map says it all
            del state[k]
        return state

    def export_config(self, drafter, target, meta, opts: ExportOptions) -> dict:
        return {
            "architectures": ["MedusaModel"],
            "model_type": "medusa",
            "num_heads": drafter.num_heads,
            "num_hidden_layers": drafter.num_layers,
            "hidden_size": target.hidden_size,
            "vocab_size": drafter.vocab_size,
            "truncated_vocab_size": drafter.draft_vocab_size,
            "medusa_fc_bias": True,
        }

    def serving(self, out, target_name, opts, config):
        return (
            f"```bash\nvllm serve {target_name} --speculative-config '{{\"model\": \"{out}\", \"method\": \"medusa\", "
            f"\"num_speculative_tokens\": {config['num_heads']}}}'\n```\n"
            "vLLM's Medusa proposer drafts the top-1 token of each head, a chain of one token per head."
        )

    def notes(self, drafter, config):
        out = [
            f"{config['num_heads']} heads of {config['num_hidden_layers']} residual block(s) each, read the target's last "
            "hidden state after its final norm; `medusa_fc_bias: true` (the blocks have biases).",
            f"Serve with `num_speculative_tokens: {config['num_heads']}`, one draft per head.",
        ]
        if config["truncated_vocab_size"] < config["vocab_size"]:
            out.append(
                f"Reduced draft vocabulary: `truncated_vocab_size = {config['truncated_vocab_size']}`, `token_map` holds the kept target "
                "token ids; vLLM scatters the heads' logits onto the full vocabulary (-inf elsewhere)."
            )
        return out

    # ---- served equals trained (export/check.py) ------------------------------------
    def detect(self, config):
        return config.get("model_type") == "medusa"

    # ---- import -----------------------------------------------------------------
    def import_meta(self, config, tensors, target):
        where = "vLLM Medusa config.json"
        config = dict(config)
        if config.get("model_type") != "medusa":
            raise DraftlabError(f"{where}: model_type is {config.get('model_type')!r}; vLLM runs Medusa only for 'medusa'")
        # vLLM's MedusaConfig.from_pretrained: any key with "num" and "heads"/"layers" is the count
        for k in [k for k in config if "num" in k]:
            if "heads" in k:
                config["num_heads"] = config.pop(k)
            elif "layers" in k:
                config["num_hidden_layers"] = config.pop(k)
        # ... and its defaults for what is absent
        for key, default, want in (("hidden_size", 4096, target.hidden_size), ("vocab_size", 32001, target.vocab_size)):
            got = config.setdefault(key, default)
            if got != want:
                raise DraftlabError(f"{where}: {key} {got}{'' if got != default else ' (vLLM default)'} does not match the target's {want}")
        H, V = config["hidden_size"], config["vocab_size"]
        num_heads, num_layers = config.get("num_heads", 5), config.get("num_hidden_layers", 1)
        vd = config.get("truncated_vocab_size") or V
        if not all(isinstance(v, int) and v >= 1 for v in (num_heads, num_layers, vd)) or vd > V:
            raise DraftlabError(
                f"{where}: num_heads {num_heads!r}, num_hidden_layers {num_layers!r} and truncated_vocab_size {vd!r} must be "
                f"integers >= 1, truncated_vocab_size at most vocab_size {V}"
            )
        # the counts this reader loops over, bounded by the drafter's schema first (num_hidden_layers is its num_layers)
        MedusaDrafter.check_fields({"num_heads": num_heads, "num_layers": num_layers, "draft_vocab_size": vd}, target, where)
        self._lm_heads(config, tensors, num_heads, where)
        self._vocabulary(tensors, num_heads, V, vd, where)
        self._biases(config, tensors, num_heads, num_layers, H, where)
        return {
            "hidden_size": H, "vocab_size": V, "draft_vocab_size": vd, "num_heads": num_heads, "num_layers": num_layers,
            "num_target_layers": target.num_layers,
        }

    @staticmethod
    def _lm_heads(config, tensors, num_heads, where) -> None:
        """``original_lm_head``: every head uses ``lm_heads.0``; ``logit_scale`` multiplies the
        logits, the same as multiplying the heads' weights."""
        names = [f"lm_heads.{h}.weight" for h in range(num_heads)]
        if config.get("original_lm_head", False):
            extra = [n for n in names[1:] if n in tensors]
            if extra:
                raise DraftlabError(f"{where}: original_lm_head is true, so vLLM uses lm_heads.0.weight for every head and ignores {extra[0]}")
            if names[0] in tensors:
                tensors.update({n: tensors[names[0]] for n in names[1:]})
        scale = config.get("logit_scale", 1.0)
        if scale != 1.0:
            tensors.update({n: tensors[n] * scale for n in names if n in tensors})

    @staticmethod
    def _vocabulary(tensors, num_heads, V, vd, where) -> None:
        token_map = tensors.pop("token_map", None)
        if vd == V:  # vLLM ignores a token_map then
            tensors["d2t"], tensors["t2d"] = torch.zeros(V, dtype=torch.long), torch.ones(V, dtype=torch.bool)
            return
        if token_map is None:
            raise DraftlabError(f"{where}: truncated_vocab_size {vd} < vocab_size {V} needs a token_map tensor")
        token_map = token_map.long()
        if token_map.shape != (vd,):
            raise DraftlabError(f"{where}: token_map has shape {tuple(token_map.shape)}, expected ({vd},)")
        if token_map.min() < 0 or token_map.max() >= V:
            raise DraftlabError(f"{where}: token_map holds ids outside the target vocabulary [0, {V})")
        order = token_map.argsort()  # draftlab orders the draft vocabulary by target id
        for h in range(num_heads):
            w = tensors.get(f"lm_heads.{h}.weight")
            if w is not None:  # full-vocab heads are cut down by token_map, as vLLM does
                tensors[f"lm_heads.{h}.weight"] = (w[token_map] if w.shape[0] == V > vd else w)[order]
        tensors["d2t"] = token_map[order] - torch.arange(vd)
        vocab_maps(tensors, V, vd, where)

    @staticmethod
    def _biases(config, tensors, num_heads, num_layers, H, where) -> None:
        names = [f"blocks.{h}.layers.{l}.bias" for h in range(num_heads) for l in range(num_layers)]
        if config.get("medusa_fc_bias", False):
            return  # they must all be there: the importer names any missing one
        present = [n for n in names if n in tensors]
        if present:
            raise DraftlabError(f"{where}: medusa_fc_bias is false, so vLLM builds blocks without bias and ignores {present[0]}")
        tensors.update({n: torch.zeros(H) for n in names})


# ============================================================================ FasterDecoding


class FasterDecodingMedusa(Format):
    name = "medusa"
    algorithm = "medusa"
    engines = ("medusa",)
    title = "FasterDecoding Medusa layout (`medusa_lm_head.safetensors` / `.pt`)"
    WEIGHTS, PICKLE = "medusa_lm_head.safetensors", "medusa_lm_head.pt"

    # blocks.{h}.layers.{l}. <-> {h}.{l}.linear. ; the lm_head's index (L) needs the drafter
    def to_format(self, name: str) -> str:
        return re.sub(r"^blocks\.(\d+)\.layers\.(\d+)\.", r"\1.\2.linear.", name)

    def from_format(self, name: str) -> str:
        return re.sub(r"^(\d+)\.(\d+)\.linear\.", r"blocks.\1.layers.\2.", name)

    def check_exportable(self, drafter, target) -> None:
        if drafter.draft_vocab_size < drafter.vocab_size:
            raise DraftlabError(
                f"--to medusa: FasterDecoding's Medusa heads project onto the full vocabulary and this drafter has a reduced one "
                f"({drafter.draft_vocab_size} of {drafter.vocab_size} tokens); export --to vllm (token_map) instead"
            )

    def export_state(self, drafter, target):
        state = super().export_state(drafter, target)
        for k in VOCAB_MAPS:  # full vocabulary only: nothing to map
            del state[k]
        L = drafter.num_layers
        return {re.sub(r"^lm_heads\.(\d+)\.weight$", rf"\1.{L}.weight", k): v for k, v in state.items()}

    def save(self, tmp: Path, drafter, target, meta: dict, opts: ExportOptions) -> None:
        from draftlab.checkpoint import read_weights

        super().save(tmp, drafter, target, meta, opts)
        weights = tmp / self.WEIGHTS
        (tmp / "model.safetensors").rename(weights)
        buf = io.BytesIO()
        torch.save(read_weights(weights), buf)  # a plain tensor dict: loads with weights_only=True
        write_bytes(tmp / self.PICKLE, buf.getvalue())

    def export_config(self, drafter, target, meta, opts: ExportOptions) -> dict:
        return {
            "medusa_num_heads": drafter.num_heads,
            "medusa_num_layers": drafter.num_layers,
            "base_model_name_or_path": opts.verifier or target.identity.get("name"),
        }

    def serving(self, out, target_name, opts, config):
        return (
            "FasterDecoding's `MedusaModel.from_pretrained` (medusa-llm) reads `config.json` and `medusa_lm_head.pt` and loads "
            "the target from `base_model_name_or_path`; TensorRT-LLM's `examples/medusa/convert_checkpoint.py` takes the directory "
            f"as `--medusa_model_dir {out}` beside `--model_dir {target_name}`."
        )

    def notes(self, drafter, config):
        out = [
            f"{config['medusa_num_heads']} heads of {config['medusa_num_layers']} residual block(s) each, read the target's last "
            "hidden state after its final norm. `medusa_lm_head.safetensors` and `medusa_lm_head.pt` hold the same tensors.",
        ]
        if config["medusa_num_layers"] > 1:
            out.append(
                "medusa-llm builds a head as one ResBlock object repeated `medusa_num_layers` times (shared weights), so it "
                "cannot hold this drafter's distinct blocks: loaded there, every block of a head takes the last block's weights."
            )
        return out

    # ---- served equals trained (export/check.py) ------------------------------------
    free_keys = ("base_model_name_or_path",)  # --verifier: any path naming the target

    def detect(self, config):
        return "medusa_num_heads" in config

    def peer_proposer(self, out, config, drafter, target):
        try:
            from medusa.model.medusa_model import MedusaModel
        except ImportError:
            return None
        return MedusaLlmPeer(out, config, drafter, target, MedusaModel)

    # ---- import -----------------------------------------------------------------
    def read_tensors(self, src: Path) -> dict[str, torch.Tensor]:
        """The .safetensors, else the .pt (tensors only: ``weights_only=True``)."""
        from draftlab.checkpoint import read_weights

        if (src / self.WEIGHTS).is_file():
            return read_weights(src / self.WEIGHTS)
        if (src / self.PICKLE).is_file():
            return read_torch_tensors(src / self.PICKLE)
        raise DraftlabError(f"{src}: no {self.WEIGHTS} or {self.PICKLE}")

    def import_meta(self, config, tensors, target):
        where = "FasterDecoding Medusa config.json"
        counts = {k: config.get(k) for k in ("medusa_num_heads", "medusa_num_layers")}
        for k, v in counts.items():
            if not isinstance(v, int) or v < 1:
                raise DraftlabError(f"{where}: {k} must be an integer >= 1, got {v!r}")
        num_heads, L = counts.values()
        # the counts this reader loops over, bounded by the drafter's schema first
        MedusaDrafter.check_fields({"num_heads": num_heads, "num_layers": L}, target, where)
        for h in range(num_heads):  # the projection is module L of head h's Sequential
            w = tensors.pop(f"{h}.{L}.weight", None)
            if w is None:
                raise DraftlabError(f"{where}: missing tensor {h}.{L}.weight (head {h}'s projection after {L} block(s))")
            tensors[f"lm_heads.{h}.weight"] = w
        stray = sorted(k for k in tensors if re.match(r"\d+\.", k))  # FasterDecoding names left over
        if stray:
            raise DraftlabError(f"{where}: tensors {', '.join(stray[:4])} do not fit {num_heads} heads of {L} block(s)")
        V = target.vocab_size
        tensors["d2t"], tensors["t2d"] = torch.zeros(V, dtype=torch.long), torch.ones(V, dtype=torch.bool)
        return {
            "hidden_size": target.hidden_size, "vocab_size": V, "draft_vocab_size": V, "num_heads": num_heads,
            "num_layers": L, "num_target_layers": target.num_layers,
        }


class MedusaLlmPeer(PeerProposer):
    """Drafts with medusa-llm's ``MedusaModel`` around the target's HF model, its heads loaded
    strictly from ``medusa_lm_head.pt`` (what its ``from_pretrained`` reads): head i's top-1 at
    the last kept input is the i-th draft, from one forward over the history."""

    peer = "medusa-llm MedusaModel"

    def __init__(self, out, config, drafter, target, model_cls):
        import tempfile

        super().__init__(drafter.capture_layers, drafter)
        with tempfile.TemporaryDirectory() as tok:  # it loads the tokenizer from base_model_name_or_path
            target.tokenizer.save_pretrained(tok)
            m = model_cls(target.model, config["medusa_num_heads"], config["medusa_num_layers"], tok)
        state = {k: v.float() for k, v in read_torch_tensors(out / FasterDecodingMedusa.PICKLE).items()}
        try:
            m.medusa_head.load_state_dict(state, strict=True)
        except RuntimeError as e:
            raise DraftlabError(f"{out}: medusa-llm's MedusaModel does not load the heads ({str(e).splitlines()[1].strip()})") from None
        self.model, self.L = m.eval(), drafter.num_target_layers
        self.model.medusa_head.float()

    def draft(self, k):
        N = self.ids.numel() - 1
        logits = self.model(input_ids=self.ids[None, :N])[:, 0, -1].float()  # [heads, V] at the last kept input
        n = min(k, logits.shape[0])
        last = self.hidden[self.L][:, -1]
        diffs = [max_diff(logits[i], self.drafter.head_logits(last, i)[0].float()) for i in range(n)]
        return logits[:n].argmax(-1).tolist(), diffs


register(VllmMedusa())
register(FasterDecodingMedusa())
