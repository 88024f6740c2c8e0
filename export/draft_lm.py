"""draft_lm <-> a plain Hugging Face causal LM directory: ``--to hf``, import ``--format hf-lm``.

The draft model is already an HF causal LM (``drafter.lm``), so the layout is HF's own:

* ``model.safetensors``: the drafter's tensors without the ``lm.`` prefix (HF's names); tied
  embeddings are stored once, under the embedding, as ``save_pretrained`` does.
* ``config.json``: the draft model's HF config (``DraftLM.hf_config``: the target's config class
  with the draft's depth and widths, ``architectures`` naming it), plus a ``draftlab`` entry
  recording how it was initialised (``init``, ``target_layers``) so an import gives back the
  same checkpoint. HF keeps unknown config keys as attributes; nothing else reads it.
* The target's tokenizer files: vLLM's ``draft_model`` and HF's ``assistant_model`` both require
  the target's vocabulary, and ``AutoTokenizer.from_pretrained(OUT)`` then works too.
* ``generation_config.json``: the target's, with ``num_assistant_tokens`` = the export's
  speculative tokens, schedule ``constant`` and ``assistant_confidence_threshold`` 0. HF reads
  these from ``assistant_model.generation_config``; its defaults (20 tokens, stop below 0.4
  confidence, re-fitted from an ROC when scikit-learn is installed) would draft another chain.

Import takes any HF causal LM directory with the target's vocabulary: a family draftlab's layers
run (``model_type`` and the causal-LM ``architectures`` of it, no remote code), the target's
family (the draft is rebuilt from the target's config class), ``vocab_size`` and the tokenizer's
vocabulary equal to the target's, and nothing in the config that changes the forward pass
beyond what the drafter meta records (a sliding window the rebuilt model would not have).
"""

from __future__ import annotations

import json
from pathlib import Path

from draftlab.atomic import write_json
from draftlab.errors import DraftlabError
from draftlab.export.check import PeerProposer, max_diff
from draftlab.export.formats import _GENERIC_KEYS, ExportOptions, Format, register

PROVENANCE = "draftlab"  # config.json key: {"algorithm", "init", "target_layers"}
# config keys that do not change an evaluation forward pass (ids of special tokens, training
# knobs, a split of the matmuls, the sliding-window switches whose effect `layer_types` shows);
# everything else a foreign config shares with the rebuilt one must agree
_INERT_KEYS = {*_GENERIC_KEYS, "bos_token_id", "eos_token_id", "pad_token_id", "initializer_range", "attention_dropout",
               "use_cache", "pretraining_tp", "use_sliding_window", "max_window_layers", PROVENANCE}


def causal_lm_class(model_type: str) -> str | None:
    """HF's causal-LM class name for ``model_type`` (what ``architectures`` names)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)


class HfCausalLM(Format):
    name = "hf-lm"
    algorithm = "draft_lm"
    engines = ("hf",)
    renames = (("lm.", ""),)
    title = "Hugging Face causal LM directory (`AutoModelForCausalLM`; HF `assistant_model`, vLLM `draft_model`)"
    standalone = True

    # ---- export -----------------------------------------------------------------
    def export_config(self, drafter, target, meta, opts: ExportOptions) -> dict:
        config = drafter.hf_config()
        config["dtype"] = opts.dtype or str(next(iter(drafter.parameters())).dtype).removeprefix("torch.")
        config[PROVENANCE] = {"algorithm": self.algorithm, "init": drafter.init, "target_layers": list(drafter.target_layers)}
        return config

    def save(self, tmp: Path, drafter, target, meta: dict, opts: ExportOptions) -> None:
        super().save(tmp, drafter, target, meta, opts)
        if target.tokenizer is None:
            raise DraftlabError("--to hf: the target has no tokenizer to ship beside the draft model")
        target.tokenizer.save_pretrained(tmp)  # into the staging directory: published with the rest or not at all
        write_json(tmp / "generation_config.json", self.generation_config(target, opts.speculative_tokens))

    @staticmethod
    def generation_config(target, k: int) -> dict:
        """The target's generation config, drafting a fixed chain of ``k`` as an assistant."""
        from transformers import GenerationConfig

        gen = getattr(target.model, "generation_config", None) or GenerationConfig.from_model_config(target.config)
        out = gen.to_diff_dict()
        out.pop("_from_model_config", None)  # edited: HF must not regenerate it from config.json
        out.update(num_assistant_tokens=k, num_assistant_tokens_schedule="constant", assistant_confidence_threshold=0.0)
        return out

    def serving(self, out, target_name, opts, config):
        target_name = opts.verifier or target_name
        k = opts.speculative_tokens
        spec = json.dumps({"method": "draft_model", "model": out, "num_speculative_tokens": k})
        return (
            "vLLM (the draft model runs beside the target with its own KV cache):\n\n"
            f"```bash\nvllm serve {target_name} --speculative-config '{spec}'\n```\n\n"
            f"```python\nfrom vllm import LLM\nllm = LLM(model=\"{target_name}\", speculative_config={spec})\n```\n\n"
            "HF transformers assisted generation (greedy output equals the target's plain greedy output):\n\n"
            "```python\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n"
            f"target = AutoModelForCausalLM.from_pretrained(\"{target_name}\")\n"
            f"draft = AutoModelForCausalLM.from_pretrained(\"{out}\")\n"
            f"tok = AutoTokenizer.from_pretrained(\"{out}\")  # the target's tokenizer\n"
            "inputs = tok.apply_chat_template([{\"role\": \"user\", \"content\": \"Hello\"}], add_generation_prompt=True, "
            "return_tensors=\"pt\", return_dict=True)\n"
            "out = target.generate(**inputs, assistant_model=draft, do_sample=False, max_new_tokens=128)\n```\n\n"
            f"`generation_config.json` makes HF draft exactly {k} tokens per step (`num_assistant_tokens`); "
            "change it there or on `draft.generation_config`."
        )

    def notes(self, drafter, config):
        out = [
            f"`{config['architectures'][0]}` with {config['num_hidden_layers']} layers, hidden {config['hidden_size']}; "
            "tensor names are HF's (draftlab's `lm.` prefix removed).",
        ]
        if drafter.init == "target":
            out.append(f"Initialised from the target's layers {drafter.target_layers} (draft layer i = target layer "
                       "target_layers[i]), embedding, final norm and lm_head; recorded under `draftlab` in config.json.")
        if config.get("tie_word_embeddings"):
            out.append("Tied embeddings: `lm_head.weight` is not stored (HF ties it to `model.embed_tokens.weight`).")
        out.append("`generation_config.json`: `num_assistant_tokens_schedule: constant` and "
                   "`assistant_confidence_threshold: 0`, so HF drafts a fixed chain (its defaults adapt the length).")
        return out

    # ---- served equals trained (export/check.py) ------------------------------------
    GENERATION = "generation_config.json"  # HF's assistant reads its chain length there
    free_keys = (f"{GENERATION}.transformers_version",)

    def served_config(self, out):
        from draftlab.checkpoint import read_json

        return {**super().served_config(out), self.GENERATION: read_json(out / self.GENERATION)}

    def expected_config(self, drafter, target, meta, opts):
        return {**self.export_config(drafter, target, meta, opts), self.GENERATION: self.generation_config(target, opts.speculative_tokens)}

    def detect(self, config):
        return config.get("model_type") != "draftlab-drafter" and bool(config.get("architectures"))

    def peer_proposer(self, out, config, drafter, target):
        return HfAssistantPeer(out, drafter)

    # ---- import -----------------------------------------------------------------
    def check_source(self, src: Path, config: dict, target) -> None:
        """The directory's tokenizer must have the target's vocabulary: same tokens, same ids."""
        from transformers import AutoTokenizer

        if target.tokenizer is None:
            raise DraftlabError(f"{src}: the target has no tokenizer to check the draft model's against")
        try:
            tok = AutoTokenizer.from_pretrained(str(src), trust_remote_code=False)
        except Exception as e:  # noqa: BLE001 - whatever the tokenizer files hold, it is a user-file problem
            raise DraftlabError(f"{src}: no readable tokenizer ({(str(e).strip().splitlines() or [type(e).__name__])[0]}); "
                                "the draft model's vocabulary must be checked against the target's") from None
        theirs, ours = tok.get_vocab(), target.tokenizer.get_vocab()
        if theirs == ours:
            return
        wrong = sorted((t for t in theirs.keys() | ours.keys() if theirs.get(t) != ours.get(t)), key=lambda t: (ours.get(t, 1 << 62), t))
        t = wrong[0]

        def at(vocab):
            return f"id {vocab[t]}" if t in vocab else "absent"

        raise DraftlabError(f"{src}: the tokenizer's vocabulary differs from the target's in {len(wrong)} token(s) "
                            f"({len(theirs)} vs {len(ours)} tokens); first: {t!r} is {at(theirs)} here, {at(ours)} in the target")

    def import_meta(self, config, tensors, target):
        from draftlab.models.draft_lm import build_hf_config, config_fields

        where = "HF causal LM config.json"
        hf = self._hf_config(config, target, where)
        fields = config_fields(hf)
        self._check_forward_config(hf, build_hf_config(fields, target), where)
        if fields["tie_word_embeddings"]:
            self._tied_head(tensors, where)
        init, layers = "import", []
        prov = config.get(PROVENANCE)
        if isinstance(prov, dict) and prov.get("algorithm") == self.algorithm:
            init, layers = prov.get("init"), prov.get("target_layers")  # a draftlab export: its checkpoint comes back
        return {"config": fields, "init": init, "num_target_layers": target.num_layers, "target_layers": layers}

    def _hf_config(self, config: dict, target, where: str):
        from transformers import AutoConfig

        from draftlab.models.target import SUPPORTED_MODEL_TYPES

        mt = config.get("model_type")
        if mt not in SUPPORTED_MODEL_TYPES:
            raise DraftlabError(f"{where}: model_type {mt!r} is not a family draftlab's layers run ({', '.join(SUPPORTED_MODEL_TYPES)})")
        if mt != target.config.model_type:
            raise DraftlabError(f"{where}: model_type {mt!r} is not the target's {target.config.model_type!r} "
                                "(a draft model is rebuilt from the target's config class)")
        want = causal_lm_class(mt)
        archs = config.get("architectures")
        if archs is not None and archs != [want]:
            raise DraftlabError(f"{where}: architectures {archs} is not [{want!r}], the causal LM of model_type {mt!r}")
        if config.get("auto_map"):
            raise DraftlabError(f"{where}: auto_map names remote code; draftlab loads no code from a model directory")
        if config.get("vocab_size") != target.vocab_size:
            raise DraftlabError(f"{where}: vocab_size {config.get('vocab_size')!r} is not the target's {target.vocab_size}")
        kw = {k: v for k, v in config.items() if k not in ("model_type", "architectures", PROVENANCE)}
        try:
            return AutoConfig.for_model(mt, **kw)
        except (TypeError, ValueError, AttributeError, KeyError) as e:
            raise DraftlabError(f"{where}: not a readable {mt} config ({str(e).splitlines()[0]})") from None

    @staticmethod
    def _check_forward_config(source, rebuilt, where: str) -> None:
        """draftlab rebuilds the draft model from the target's config with the meta's fields; any
        other setting of the source config that would change the forward pass (a sliding window)
        must already be the target's, or the imported drafter would not be the model HF loads."""
        a, b = source.to_dict(), rebuilt.to_dict()
        if "sliding_attention" not in [*(a.get("layer_types") or []), *(b.get("layer_types") or [])] and "layer_types" in a:
            a.pop("sliding_window", None)  # families with layer_types apply the window only to sliding layers
        for k in sorted(a.keys() & b.keys() - _INERT_KEYS):
            if a[k] != b[k]:
                raise DraftlabError(f"{where}: {k} = {json.dumps(a[k])[:60]}, but a draft model of this target has "
                                    f"{json.dumps(b[k])[:60]} (only the sizes and RoPE may differ from the target's config)")

    @staticmethod
    def _tied_head(tensors: dict, where: str) -> None:
        """Tied embeddings: a stored lm_head must be the embedding (HF would tie over it)."""
        head, embed = tensors.get("lm.lm_head.weight"), tensors.get("lm.model.embed_tokens.weight")
        if head is None or embed is None:
            return
        if head.shape != embed.shape or not bool((head == embed).all()):
            raise DraftlabError(f"{where}: tie_word_embeddings is true but lm_head.weight differs from model.embed_tokens.weight")
        del tensors["lm.lm_head.weight"]  # the drafter's checkpoint stores it once, under the embedding


class HfAssistantPeer(PeerProposer):
    """Drafts with what HF's ``assistant_model`` loads: ``AutoModelForCausalLM.from_pretrained``
    of the export, greedy, one forward over the whole history per draft."""

    peer = "HF AutoModelForCausalLM"

    def __init__(self, out, drafter):
        import torch
        from transformers import AutoModelForCausalLM

        super().__init__((), drafter)
        self.model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()

    def draft(self, k):
        import torch

        ids, drafts, diffs = self.ids[None], [], []
        for _ in range(k):
            logits = self.model(ids).logits[0, -1].float()
            diffs.append(max_diff(logits, self.drafter.lm(ids).logits[0, -1].float()))
            drafts.append(int(logits.argmax()))
            ids = torch.cat([ids, ids.new_tensor([[drafts[-1]]])], dim=1)
        return drafts, diffs


register(HfCausalLM())
