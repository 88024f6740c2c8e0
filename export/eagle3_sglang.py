"""EAGLE-3 <-> SGLang's ``LlamaForCausalLMEagle3`` (``python/sglang/srt/models/llama_eagle3.py``),
the layout SpecForge trains and exports.

* Tensors: the first decoder layer is ``midlayer.*``; ``fc``, ``norm``, ``lm_head``, ``d2t``,
  ``t2d`` keep their names. SGLang turns ``d2t`` into ``hot_token_id = d2t + arange`` and
  ignores ``t2d`` (written anyway: SpecForge's exporter requires it). No ``embed_tokens``:
  SGLang's EAGLE worker replaces the drafter's embedding with the target's.
* SGLang skips unknown tensor names silently, so the set written here is exactly the set its
  model (and SpecForge's) has, minus the shared embedding — checked in the test-suite.
* Only single-layer, Llama-layer drafters are exported: ``midlayer``'s q/k/v have no bias and
  no q/k norm, and SGLang's ``additional_layers`` (BasicDecoderLayer) restart the residual from
  the previous layer's MLP output only, so a deeper draftlab drafter would load but compute
  something else.
* Aux layers are off by one: SGLang captures ``layers_to_capture = [id + 1 for id in
  eagle_aux_hidden_state_layer_ids]`` (the input of decoder layer id+1 = the output of layer
  id), so ``eagle_config.eagle_aux_hidden_state_layer_ids = [i - 1 for i in aux_layers]``;
  draftlab's default ``[2, L//2, L-3]`` becomes SpecForge's ``[1, L//2-1, L-4]``. Without the
  key SGLang captures ``[2, L//2, L-3]`` directly (no shift).
* EAGLE-3.1 (checked against SpecForge 0.2.0's ``LlamaForCausalLMEagle3``): ``fc_norm: true`` and
  ``fc_norm.{0,1,2}.weight`` carry the per-state norms before ``fc`` as draftlab names them.
  SpecForge's ``norm_output`` is another flag under the same name: whether ``lm_head`` reads
  ``norm(h)`` (its default, true; draftlab's head always does), while the next step is always fed
  the un-normed state. So a drafter trained with ``norm_output`` (the normalised state fed on)
  has no SpecForge form and is refused, and the key is not written (a reader of speculators'
  meaning then sees false, which is right for every drafter this exports).
* speculators' ``norm_before_fc`` (one RMSNorm over the concatenated aux states) and
  ``norm_before_residual`` (the first layer's residual is the normed feature) are not in SpecForge
  0.2.0's ``LlamaForCausalLMEagle3`` (``project_hidden_states`` applies only ``fc_norm``; its
  ``midlayer`` keeps ``residual = hidden_states`` before ``hidden_norm``): drafters with either are
  refused, and the import ignores both keys, as that model does.
"""

from __future__ import annotations

import torch

from draftlab.errors import DraftlabError
from draftlab.export.check import PeerProposer, max_diff
from draftlab.models.eagle import Eagle3Drafter
from draftlab.export.formats import (
    ExportOptions,
    Format,
    layer_config,
    llama_compatible,
    register,
    serving_aux_ids,
    shape_from_config,
    vocab_maps,
)


class SGLangEagle3(Format):
    name = "sglang"
    algorithm = "eagle3"
    engines = ("sglang",)
    renames = (("layers.0.", "midlayer."),)
    title = "SGLang `LlamaForCausalLMEagle3` (SpecForge layout)"

    def check_exportable(self, drafter, target) -> None:
        llama_compatible(drafter, "--to sglang: SGLang's LlamaForCausalLMEagle3")
        if len(drafter.layers) != 1:
            raise DraftlabError(
                f"--to sglang: drafter has {len(drafter.layers)} layers; SGLang's extra EAGLE-3 layers "
                "(additional_layers) drop the residual between layers, so only 1-layer drafters export exactly"
            )
        serving_aux_ids(drafter.aux_layers, drafter.num_target_layers, "SGLang")
        if drafter.norm_output:
            raise DraftlabError(
                "--to sglang: drafter.norm_output feeds the normalised state to the next draft step; SpecForge's "
                "LlamaForCausalLMEagle3 always feeds the un-normed one (its norm_output only places the norm before lm_head)"
            )
        if drafter.input_norm is not None:
            raise DraftlabError("--to sglang: drafter.norm_before_fc normalises the concatenated aux states before fc; "
                                "SpecForge's LlamaForCausalLMEagle3 has no such norm (input_norm)")
        if drafter.layers[0].norm_before_residual:
            raise DraftlabError("--to sglang: drafter.norm_before_residual makes the normalised feature the residual; "
                                "SpecForge's LlamaForCausalLMEagle3 always keeps the un-normed one")

    def export_config(self, drafter, target, meta, opts: ExportOptions) -> dict:
        s = drafter.shape
        return layer_config(
            s,
            1,
            drafter.vocab_size,
            "llama",
            architectures=["LlamaForCausalLMEagle3"],
            draft_vocab_size=drafter.lm_head.out_features,
            target_hidden_size=s.hidden_size,
            fc_norm=drafter.fc_norm is not None,
            eagle_config={
                "eagle_aux_hidden_state_layer_ids": [i - 1 for i in drafter.aux_layers],
                "use_aux_hidden_state": True,
            },
        )

    def serving(self, out, target_name, opts, config):
        k = opts.speculative_tokens
        return (
            f"```bash\npython -m sglang.launch_server --model-path {target_name} --speculative-algorithm EAGLE3 \\\n"
            f"  --speculative-draft-model-path {out} --speculative-num-steps {k} \\\n"
            f"  --speculative-eagle-topk 1 --speculative-num-draft-tokens {k + 1}\n```"
        )

    def notes(self, drafter, config):
        ids = config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
        return [
            f"`eagle_config.eagle_aux_hidden_state_layer_ids = {ids}` = draftlab `aux_layers` {list(drafter.aux_layers)} minus 1: "
            "SGLang captures the input of layer id+1 (SpecForge's convention).",
            "The first (only) decoder layer is stored as `midlayer.*`; `t2d` is included although SGLang ignores it.",
            "No `embed_tokens.weight`: SGLang's EAGLE worker uses the target's embedding.",
        ] + (["EAGLE-3.1 `fc_norm: true` (`fc_norm.{0,1,2}.weight`): serve with an SGLang whose EAGLE-3 model reads "
              "fc_norm, as SpecForge 0.2.0's does; one that does not skips those tensors silently."] if config["fc_norm"] else [])

    # ---- served equals trained (export/check.py) ------------------------------------
    def detect(self, config):
        return (config.get("architectures") or [None])[0] == "LlamaForCausalLMEagle3"

    def peer_proposer(self, out, config, drafter, target):
        try:
            from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
        except ImportError:
            return None
        return SpecForgeEagle3Peer(out, config, drafter, target, LlamaForCausalLMEagle3)

    def import_meta(self, config, tensors, target):
        where = "SGLang config.json"
        arch = (config.get("architectures") or [None])[0]
        if arch != "LlamaForCausalLMEagle3":
            raise DraftlabError(f"{where}: architectures[0] is {arch!r}, expected 'LlamaForCausalLMEagle3'")
        shape, cfg = shape_from_config(config, where, target)
        if shape.attention_bias or shape.qk_norm:
            raise DraftlabError(f"{where}: SGLang's LlamaForCausalLMEagle3 has no q/k/v bias or q/k norm; this config declares them")
        if cfg.num_hidden_layers != 1:
            raise DraftlabError(f"{where}: num_hidden_layers = {cfg.num_hidden_layers}; only 1-layer drafters have draftlab's semantics")
        if config.get("norm_output", True) is not True:  # SpecForge's default: lm_head reads norm(h)
            raise DraftlabError(f"{where}: norm_output = {config['norm_output']!r} (lm_head reading the un-normed state) is not implemented by draftlab")
        if type(config.get("fc_norm", False)) is not bool:
            raise DraftlabError(f"{where}: fc_norm = {config['fc_norm']!r} must be true or false")
        if cfg.tie_word_embeddings:
            raise DraftlabError(f"{where}: tie_word_embeddings = true (SGLang would use the embedding as lm_head)")
        if shape.hidden_size != target.hidden_size or getattr(cfg, "target_hidden_size", shape.hidden_size) != target.hidden_size:
            raise DraftlabError(f"{where}: hidden size {shape.hidden_size} does not match the target's {target.hidden_size}")
        if cfg.vocab_size != target.vocab_size:
            raise DraftlabError(f"{where}: vocab_size {cfg.vocab_size} != target vocab {target.vocab_size}")
        L = target.num_layers
        ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        if ids is not None and (not isinstance(ids, list) or any(type(i) is not int for i in ids)):
            raise DraftlabError(f"{where}: eagle_config.eagle_aux_hidden_state_layer_ids {ids!r} is not a list of integers")
        aux = [i + 1 for i in ids] if ids is not None else Eagle3Drafter.default_aux_layers(L)  # see module docstring
        bad = [i for i in aux if not 1 <= i <= L - 1]
        if bad:
            raise DraftlabError(f"{where}: eagle_aux_hidden_state_layer_ids {ids} capture outside 1..{L - 1} for this target")
        vd = config.get("draft_vocab_size")
        if vd is None:  # SGLang then serves with the target's own lm_head over the full vocabulary
            vd = target.vocab_size
            if "lm_head.weight" not in tensors:
                tensors["lm_head.weight"] = target.lm_head.weight.detach().cpu().float()
        Eagle3Drafter.check_fields({"aux_layers": aux, "draft_vocab_size": vd}, target, where)  # before they are used
        vocab_maps(tensors, target.vocab_size, vd, where)
        return {
            "shape": shape.model_dump(),
            "vocab_size": target.vocab_size,
            "draft_vocab_size": vd,
            "aux_layers": aux,
            "num_layers": 1,
            "num_target_layers": L,
            "fc_norm": config.get("fc_norm", False),
        }


class SpecForgeEagle3Peer(PeerProposer):
    """Drafts with SpecForge 0.2.0's ``LlamaForCausalLMEagle3`` (the model SGLang's layout comes
    from) built from the export's config.json, weights loaded strictly (the embedding is the
    target's, as SGLang's worker shares it), through its own TTT pieces: ``project_hidden_states``,
    ``backbone`` over its step cache, ``compute_logits``. Step i reads the token i places on; at
    the last kept position that is the draft of step i - 1, so one pass drafts the chain. The aux
    states are the ones SGLang captures: ``eagle_aux_hidden_state_layer_ids`` + 1."""

    peer = "SpecForge LlamaForCausalLMEagle3"

    def __init__(self, out, config, drafter, target, model_cls):
        from transformers import LlamaConfig

        from draftlab.checkpoint import read_weights

        super().__init__(drafter.capture_layers, drafter)
        m = model_cls(LlamaConfig(**config))
        state = {k: v.float() if v.is_floating_point() else v for k, v in read_weights(out / "model.safetensors").items()}
        state["embed_tokens.weight"] = target.embed_tokens.weight.detach().float().cpu()
        try:
            m.load_state_dict(state, strict=True)
        except RuntimeError as e:
            raise DraftlabError(f"{out}: SpecForge's LlamaForCausalLMEagle3 does not load the weights ({str(e).splitlines()[1].strip()})") from None
        self.model = m.float().eval()
        ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        self.aux = [i + 1 for i in ids] if ids is not None else Eagle3Drafter.default_aux_layers(target.num_layers)
        if any(i not in self.layers for i in self.aux):
            raise DraftlabError(f"{out}: eagle_config.eagle_aux_hidden_state_layer_ids {ids} capture target states {self.aux}, "
                                f"not the checkpoint's aux layers {list(drafter.aux_layers)}")

    def draft(self, k):
        from draftlab.export.eagle3_speculators import eagle3_reference

        m, N = self.model, self.ids.numel() - 1
        with torch._dynamo.config.patch(disable=True):  # SpecForge compiles its norm/RoPE; not worth it on a CPU check
            h = m.project_hidden_states(torch.cat([self.hidden[i] for i in self.aux], -1))
            mask = m.prepare_decoder_attention_mask(torch.ones(1, N, dtype=torch.bool), h, 1, N, 0)
            cache, tokens, pos = [[], []], self.ids[1:].clone()[None], torch.arange(N)[None]
            drafts, logits = [], []
            for _ in range(k):
                h = m.backbone(m.embed_input_ids(tokens), h, cache, mask, pos)
                lg = m.compute_logits(h)[0, N - 1]
                d = int(lg.argmax())
                drafts.append(d + int(m.d2t[d]))  # SGLang's hot_token_id = d2t + arange
                logits.append(lg)
                tokens = torch.cat([tokens[:, 1:], tokens.new_tensor([[drafts[-1]]])], dim=1)  # step i + 1 reads x_{t+1+i}
        ours = eagle3_reference(self.drafter, self.ids, self.padded(k), drafts, k)
        return drafts, [max_diff(a, b) for a, b in zip(logits, ours)]


register(SGLangEagle3())
