"""MTP module <-> the speculators ``mtp`` format (``MTPSpeculatorConfig``, ``MTPDraftModel``).

Checked against speculators 0.9.0 (``models/mtp/{config,core,model_definitions}.py``,
``convert/mtp/converter.py``) and vLLM's ``transformers_utils/configs/speculators/algos.py``
(``update_mtp``) and ``config/speculative.py`` (``hf_config_override``):

* One MTP layer, ``mtp_layers.0``: a decoder layer of the verifier's family plus
  ``hidden_layernorm``, ``token_layernorm``, ``input_proj`` (2H -> H over ``[embedding; hidden]``)
  and ``final_layernorm``, whose output the lm_head reads and the next step is fed: draftlab's
  tensors of the same names, the decoder layer renamed from ``layers.0``. No ``embed_tokens`` or
  ``lm_head``: speculators fills them from the verifier (``load_verifier_weights``) and never saves
  them, and draftlab shares the target's.
* The full vocabulary only: ``MTPDraftModel`` refuses vocabulary reduction, so a drafter trained
  with a frequency-ranked draft vocabulary is refused (retrain with ``drafter.draft_vocab_size=0``);
  the identity ``d2t``/``t2d`` are not written.
* ``transformer_layer_config`` is the verifier's config (speculators writes the verifier's own, its
  ``target_layer_ids`` is ``[num_hidden_layers]``: the last hidden state); ``num_nextn_predict_layers``
  is 1; ``speculators_config.proposal_methods[0].speculative_tokens`` the recursion steps served.
* Families: speculators' MTP layer exists for ``qwen3`` (and ``qwen3_next``, ``qwen3_5`` text, which
  draftlab does not load as targets). vLLM serves a speculators ``mtp`` checkpoint through the MTP
  model its ``hf_config_override`` maps the verifier's architecture to (MiMo, Qwen3-Next, Qwen3.5,
  DeepSeek, GLM and others with a native MTP); no engine has an MTP model for a Llama or Mistral
  target, and those are refused in one line (``--to hf`` writes draftlab's layout for them).

``draftlab check`` / ``export --check`` load the export with speculators' ``MTPDraftModel`` and draft
chains with its MTP layer as decoding runs it (:class:`SpeculatorsMtpPeer`).
"""

from __future__ import annotations

import torch

from draftlab.errors import DraftlabError
from draftlab.export.check import PeerProposer, max_diff
from draftlab.export.eagle3_speculators import SPECULATORS_VERSION
from draftlab.export.formats import (
    ExportOptions,
    SpeculatorsFormat,
    layer_config,
    register,
    shape_from_config,
    speculators_config,
    vocab_maps,
)

# draftlab's target families with an MTP layer in speculators 0.9.0 (model_definitions.mtp_model_classes)
SPECULATORS_FAMILIES = ("qwen3",)
MAPS = ("d2t", "t2d")  # identity for a full vocabulary: speculators' MTP model has none
# the families engines serve an MTP module for: those that ship one (vLLM config/speculative.py MTPModelTypes)
NATIVE_MTP = "DeepSeek-V3, MiMo, GLM-4.5, Qwen3-Next, Qwen3.5"
SERVED = f"vLLM's method mtp and SGLang's NextN serve families that ship an MTP module ({NATIVE_MTP})"


class SpeculatorsMtpPeer(PeerProposer):
    """Drafts with speculators' ``MTPDraftModel`` built from the export's config.json, weights
    loaded strictly (embedding and lm_head the target's, as speculators fills them from the
    verifier), through its MTP layer run as decoding runs it: one causal pass over the kept
    positions (the target's last hidden states) and the drafts so far (the layer's own output
    states), the next draft read off the last position. (``MTPDraftModel.forward`` is its training
    pass, FastMTP's recursion; draftlab's test-suite checks that one against draftlab's.)"""

    peer = "speculators MTPDraftModel"

    def __init__(self, out, drafter, target, config_cls, core):
        from draftlab.checkpoint import read_weights

        super().__init__(drafter.capture_layers, drafter)
        cfg = config_cls.from_pretrained(str(out))
        m = core.MTPDraftModel(cfg)
        state = {k: v.float() for k, v in read_weights(out / "model.safetensors").items()}
        state["embed_tokens.weight"] = target.embed_tokens.weight.detach().float().cpu()
        state["lm_head.weight"] = target.lm_head.weight.detach().float().cpu()
        state.setdefault("verifier_lm_head.weight", state["lm_head.weight"])  # deleted once speculators loads a verifier
        try:
            m.load_state_dict(state, strict=True)
        except RuntimeError as e:
            raise DraftlabError(f"{out}: speculators' MTPDraftModel does not load the weights ({str(e).splitlines()[1].strip()})") from None
        self.model, self.L = m.float().eval(), drafter.num_target_layers

    def layer_states(self, feats, tokens):
        """The MTP layer's output states [1, n, H] for previous states ``feats`` and tokens ``tokens``, causal."""
        m, n = self.model, tokens.shape[1]
        pos = torch.arange(n)[None]
        mask = torch.ones(n, n, dtype=torch.bool).tril()[None, None]  # True: may attend (its SDPA attention reads it as is)
        return m.mtp_layers[0](hidden_states=feats, token_embeddings=m.embed_tokens(tokens), attention_mask=mask,
                               position_ids=pos, position_embeddings=m.rotary_emb(feats, pos))

    def draft(self, k):
        feats, tokens = self.hidden[self.L], self.ids[1:][None]  # position t pairs h_t with x_{t+1}
        drafts, diffs = [], []
        for _ in range(k):
            h = self.layer_states(feats, tokens)
            logits = self.model.lm_head(h[:, -1])[0]
            drafts.append(int(logits.argmax()))
            n = tokens.shape[1]  # draftlab's module on the same inputs, for the logits
            ours = self.drafter.stack(self.drafter.embed(tokens), feats, torch.arange(n)[None],
                                      lambda i, attn: lambda q, k_, v: attn.attend(q, k_, v, causal=True))
            diffs.append(max_diff(logits, self.drafter.head(ours[:, -1]).float()[0]))
            feats = torch.cat([feats, h[:, -1:]], dim=1)
            tokens = torch.cat([tokens, tokens.new_tensor([[drafts[-1]]])], dim=1)
        return drafts, diffs


class SpeculatorsMtp(SpeculatorsFormat):
    name = "speculators-mtp"
    algorithm = "mtp"
    engines = ("vllm",)
    renames = tuple((f"{n}.", f"mtp_layers.0.{n}.") for n in ("hidden_layernorm", "token_layernorm", "input_proj", "final_layernorm")) + (
        ("layers.0.", "mtp_layers.0."),
    )
    title = "speculators `mtp` format (`MTPDraftModel`, vLLM `method: mtp` for verifiers with an MTP model)"

    def check_exportable(self, drafter, target) -> None:
        family = drafter.shape.model_type
        if family not in SPECULATORS_FAMILIES:
            raise DraftlabError(f"--to vllm: no engine serves an MTP module for a {family} target ({SERVED}; speculators' mtp format "
                                f"has layers for {', '.join(SPECULATORS_FAMILIES)} among draftlab's targets); --to hf writes draftlab's layout")
        if drafter.draft_vocab_size != drafter.vocab_size:
            raise DraftlabError(f"--to vllm: speculators' MTPDraftModel reads the verifier's full vocabulary and this drafter drafts over "
                                f"draft_vocab_size={drafter.draft_vocab_size} of {drafter.vocab_size}; retrain with drafter.draft_vocab_size=0")
        if len(drafter.layers) != 1:
            raise DraftlabError(f"--to vllm: speculators' MTP layer holds one decoder layer and this drafter has num_layers="
                                f"{len(drafter.layers)}; retrain with drafter.num_layers=1")

    def export_state(self, drafter, target):
        state = super().export_state(drafter, target)
        for k in MAPS:  # identity maps of the full vocabulary (checked by check_exportable)
            state.pop(k)
        return state

    def export_config(self, drafter, target, meta, opts: ExportOptions) -> dict:
        s = drafter.shape
        return {
            "architectures": ["MTPDraftModel"],
            "speculators_model_type": "mtp",
            "speculators_version": SPECULATORS_VERSION,
            "speculators_config": speculators_config("mtp", opts.speculative_tokens, target, opts),
            # the verifier's own layer config: its num_hidden_layers names the last hidden state the module reads
            "transformer_layer_config": layer_config(s, drafter.num_target_layers, drafter.vocab_size, s.model_type),
            "num_nextn_predict_layers": 1,
        }

    def serving(self, out, target_name, opts, config):
        k = config["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
        return (
            f"```python\nfrom speculators.models.mtp import MTPDraftModel\nm = MTPDraftModel.from_pretrained(\"{out}\")  "
            f"# embedding and lm_head from the verifier\n```\n"
            f"vLLM loads a speculators `mtp` checkpoint (`--speculative-config '{{\"model\": \"{out}\", \"method\": \"mtp\", "
            f"\"num_speculative_tokens\": {k}}}'`) only for a verifier it maps to an MTP model ({NATIVE_MTP}, ...); "
            f"`{target_name}` is a {config['transformer_layer_config']['model_type']} model: check your vLLM has one for it."
        )

    def notes(self, drafter, config):
        return [
            "The module reads the target's last hidden state after its final norm (HF `hidden_states[L]`), as vLLM feeds an MTP "
            "model the target's output states.",
            "Recursion: `final_layernorm`'s output is both what the lm_head reads and the next step's input state "
            f"(FastMTP; {config['speculators_config']['proposal_methods'][0]['speculative_tokens']} steps per draft).",
            "No `embed_tokens.weight`, `lm_head.weight` or vocabulary maps: the verifier's full vocabulary, shared and frozen.",
        ]

    # ---- served equals trained (export/check.py) ------------------------------------
    speculators_type = "mtp"
    peer_adapter = SpeculatorsMtpPeer
    peer_model = ("speculators.models.mtp.core", None)

    # ---- import -----------------------------------------------------------------
    def import_meta(self, config, tensors, target):
        where = self.where
        self.check_type(config)
        if config.get("num_nextn_predict_layers", 1) != 1:
            raise DraftlabError(f"{where}: num_nextn_predict_layers = {config['num_nextn_predict_layers']!r}; draftlab's MTP drafter is one module")
        tl = config.get("transformer_layer_config")
        if not isinstance(tl, dict):
            raise DraftlabError(f"{where}: transformer_layer_config must be a dict")
        shape, cfg = shape_from_config(tl, f"{where} transformer_layer_config", target)
        if shape.hidden_size != target.hidden_size:
            raise DraftlabError(f"{where}: hidden size {shape.hidden_size} does not match the target's {target.hidden_size}")
        if cfg.vocab_size != target.vocab_size:
            raise DraftlabError(f"{where}: transformer_layer_config.vocab_size {cfg.vocab_size} != target vocab {target.vocab_size}")
        if cfg.num_hidden_layers != target.num_layers:
            raise DraftlabError(f"{where}: transformer_layer_config.num_hidden_layers {cfg.num_hidden_layers} is not the target's "
                                f"{target.num_layers} (it is the verifier's config)")
        head = tensors.pop("lm_head.weight", None)  # speculators never saves it; a converted checkpoint may hold the verifier's
        if head is not None and not torch.equal(head.float(), target.lm_head.weight.detach().float().cpu()):
            raise DraftlabError(f"{where}: lm_head.weight is not the target's lm_head (the MTP module shares the verifier's)")
        vocab_maps(tensors, target.vocab_size, target.vocab_size, where)
        return {
            "shape": shape.model_dump(),
            "vocab_size": target.vocab_size,
            "draft_vocab_size": target.vocab_size,
            "num_layers": 1,
            "num_target_layers": target.num_layers,
        }


register(SpeculatorsMtp())
