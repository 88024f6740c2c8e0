"""EAGLE-3 <-> the speculators format (vllm-project/speculators), which vLLM loads.

Checked against speculators 0.9.0 (``Eagle3SpeculatorConfig``, ``Eagle3DraftModel``) and vLLM's
``transformers_utils/configs/speculators`` + ``model_executor/models/llama_eagle3.py``:

* Tensor names are draftlab's own (``layers.{i}.*``, ``fc``, ``norm``, ``lm_head``, ``d2t``,
  ``t2d``): the rename table is empty. ``embed_tokens.weight`` is not written — vLLM then shares
  the target's embedding, speculators loads it from the verifier (so does draftlab).
* The decoder layers are written as a Llama ``transformer_layer_config``: vLLM builds
  ``Eagle3LlamaForCausalLM`` for every non-VL target, so Mistral-family drafters (same layer)
  map one to one and Qwen2-family drafters map with ``attention_bias: true`` plus an exact-zero
  ``o_proj.bias`` (HF/vLLM Llama put a bias on o_proj too when attention_bias is set).
  Qwen3-family drafters (q/k RMSNorm) are refused: vLLM's Llama layer has no q/k norm.
* speculators' architecture flags are draftlab's fields of the same names and meanings, written
  as the drafter has them: ``norm_before_fc`` (``input_norm.weight``, one RMSNorm over the
  concatenated aux states before ``fc``), ``norm_before_residual`` (the first layer's residual is
  ``hidden_norm`` of the fused feature), EAGLE-3.1's ``fc_norm`` (``fc_norm.{i}.weight``, one
  RMSNorm per aux state before ``fc``) and ``norm_output`` (the state after ``norm`` is both what
  ``lm_head`` reads and what the next draft step is fed); speculators' trainer turns all but
  ``fc_norm`` on by default. Each is written explicitly: vLLM defaults a missing
  ``norm_before_residual`` to ``true``, speculators to ``false``. vLLM reads all four
  (``update_eagle3``; its ``Eagle3LlamaForCausalLM`` builds ``input_norm`` for ``norm_before_fc``
  in releases that have it, older ones have none to load the tensor into).
* Aux layers: speculators' ``eagle_aux_hidden_state_layer_ids`` and vLLM's
  ``aux_hidden_state_layers`` index the *input* of decoder layer i (vLLM appends
  ``hidden_states + residual`` before running layer i) — HF ``hidden_states[i]``, which is
  draftlab's convention, so the ids are copied unshifted; ``[2, L//2, L-3]`` is the default
  on all three sides. (SGLang is off by one: see ``eagle3_sglang.py``.) The exported ids are the
  capture contract; the test-suite checks the drafter math against speculators' own model.
"""

from __future__ import annotations

import torch

from draftlab.errors import DraftlabError
from draftlab.export.check import PeerProposer, max_diff
from draftlab.models.eagle import Eagle3Drafter
from draftlab.export.formats import (
    ExportOptions,
    SpeculatorsFormat,
    layer_config,
    register,
    serving_aux_ids,
    shape_from_config,
    speculators_config,
    take_zero_bias,
    vocab_maps,
)

SPECULATORS_VERSION = "0.9.0"  # the speculators release this layout was checked against
# Architecture flags of speculators' Eagle3 model: the same fields (and meanings) on both sides,
# each false when absent (speculators' config defaults)
FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")


class SpeculatorsEagle3Peer(PeerProposer):
    """Drafts with speculators' ``Eagle3DraftModel`` built from the export's config.json, its
    weights loaded strictly (the embedding and the unused verifier norm/head are the target's or
    its own, as speculators fills them from the verifier), through its own TTT ``forward``.

    Its TTT step i at position t reads the token at t + i and attends to the real context plus
    its own earlier steps at t: for position N - 1 (the last kept token) with the drafts so far
    appended to the tokens, that is the chain draftlab drafts. One forward per draft (steps
    0..j), each re-run over the whole history."""

    peer = "speculators Eagle3DraftModel"

    def __init__(self, out, drafter, target, config_cls, model_cls):
        from draftlab.checkpoint import read_weights

        super().__init__(drafter.capture_layers, drafter)
        cfg = config_cls.from_pretrained(str(out))
        cfg.transformer_layer_config._attn_implementation = "sdpa"  # flex attention has no CPU path here
        m = model_cls(cfg)
        state = {k: v.float() if v.is_floating_point() else v for k, v in read_weights(out / "model.safetensors").items()}
        state["embed_tokens.weight"] = target.embed_tokens.weight.detach().float().cpu()
        for k in ("verifier_norm.weight", "verifier_lm_head.weight"):  # unused when drafting
            state.setdefault(k, m.state_dict()[k])
        try:
            m.load_state_dict(state, strict=True)
        except RuntimeError as e:
            raise DraftlabError(f"{out}: speculators' Eagle3DraftModel does not load the weights ({str(e).splitlines()[1].strip()})") from None
        self.model, self.aux = m.float().eval(), list(cfg.eagle_aux_hidden_state_layer_ids)

    def draft(self, k):
        m, N = self.model, self.ids.numel() - 1
        drafts, logits = [], []  # drafts: target ids (the tokens fed on), as the engine maps them with d2t
        hook = m.lm_head.register_forward_hook(lambda mod, args, o: logits.append(o[0, N - 1]))
        try:
            for j in range(k):
                hidden = self.padded(j)
                tokens = torch.cat([self.ids[1:], torch.tensor(drafts, dtype=torch.long)])[None]
                logits.clear()
                steps = m(hidden_states=torch.cat([hidden[i] for i in self.aux], -1), input_ids=tokens,
                          document_ids=torch.zeros_like(tokens), position_ids=torch.arange(N + j)[None], ttt_steps=j + 1)
                d = int(steps[j][0, N - 1])  # a draft-vocabulary id
                drafts.append(d + int(m.d2t[d]) if m.d2t is not None else d)
        finally:
            hook.remove()
        ours = eagle3_reference(self.drafter, self.ids, self.padded(k), drafts, k)
        return drafts, [max_diff(a, b) for a, b in zip(logits, ours)]


class SpeculatorsEagle3(SpeculatorsFormat):
    name = "speculators"
    algorithm = "eagle3"
    engines = ("vllm",)
    title = "speculators format (vLLM `Eagle3LlamaForCausalLM` via `Eagle3Speculator`)"

    def check_exportable(self, drafter, target) -> None:
        if drafter.shape.qk_norm:
            raise DraftlabError(
                f"--to vllm: vLLM's EAGLE-3 drafter (Eagle3LlamaForCausalLM) has no q/k RMSNorm; "
                f"this drafter (target family {drafter.shape.model_type}) has them"
            )
        serving_aux_ids(drafter.aux_layers, drafter.num_target_layers, "vLLM")

    def extra_tensors(self, drafter, target):
        if not drafter.shape.attention_bias:
            return {}
        H = drafter.shape.hidden_size
        return {f"layers.{i}.self_attn.o_proj.bias": torch.zeros(H) for i in range(len(drafter.layers))}

    def export_config(self, drafter, target, meta, opts: ExportOptions) -> dict:
        s = drafter.shape
        return {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": "eagle3",
            "speculators_version": SPECULATORS_VERSION,
            "speculators_config": speculators_config("eagle3", opts.speculative_tokens, target, opts),
            "transformer_layer_config": layer_config(s, len(drafter.layers), drafter.vocab_size, "llama"),
            "draft_vocab_size": drafter.lm_head.out_features,
            "target_hidden_size": s.hidden_size,
            "eagle_aux_hidden_state_layer_ids": list(drafter.aux_layers),
            "norm_before_residual": drafter.layers[0].norm_before_residual,
            "norm_before_fc": drafter.input_norm is not None,
            "fc_norm": drafter.fc_norm is not None,
            "norm_output": drafter.norm_output,
            "embed_requires_grad": False,
            "tie_word_embeddings": False,
        }

    def serving(self, out, target_name, opts, config):
        return (
            f"```bash\nvllm serve {target_name} --speculative-config "
            f"'{{\"model\": \"{out}\", \"method\": \"eagle3\", \"num_speculative_tokens\": {opts.speculative_tokens}}}'\n```\n"
            f"or `vllm serve {out}` (vLLM reads the verifier from `speculators_config`)."
        )

    def notes(self, drafter, config):
        notes = [
            f"`eagle_aux_hidden_state_layer_ids = {config['eagle_aux_hidden_state_layer_ids']}`: HF `hidden_states` indices "
            "(the input of decoder layer i), the convention of speculators, vLLM and draftlab's `aux_layers` - no shift.",
            "No `embed_tokens.weight`: vLLM shares the target's embedding, as draftlab does.",
            "Architecture flags as trained, each written explicitly (vLLM defaults a missing `norm_before_residual` to true): "
            + ", ".join(f"`{f}: {str(config[f]).lower()}`" for f in FLAGS) + ".",
        ]
        if config["norm_before_fc"]:
            notes.append("`norm_before_fc: true` (`input_norm.weight`): serve with a vLLM whose Eagle3LlamaForCausalLM reads "
                         "norm_before_fc and builds `input_norm`; an older one has no `input_norm` to load that tensor into.")
        if drafter.shape.attention_bias:
            notes.append("Qwen2-style q/k/v biases are kept; `o_proj.bias` is written as zeros (Llama layers with `attention_bias` have one).")
        return notes

    # ---- served equals trained (export/check.py) ------------------------------------
    speculators_type = "eagle3"
    peer_adapter = SpeculatorsEagle3Peer
    peer_model = ("speculators.models.eagle3", "Eagle3DraftModel")

    # ---- import -----------------------------------------------------------------
    def import_meta(self, config, tensors, target):
        where = self.where
        self.check_type(config)
        flags = {f: config.get(f, False) for f in FLAGS}
        bad = [f"{f} = {v!r}" for f, v in flags.items() if type(v) is not bool]
        if bad:
            raise DraftlabError(f"{where}: {', '.join(bad)} must be true or false")
        tl = config.get("transformer_layer_config")
        if not isinstance(tl, dict):
            raise DraftlabError(f"{where}: transformer_layer_config must be a dict")
        shape, cfg = shape_from_config(tl, f"{where} transformer_layer_config", target)
        if shape.hidden_size != target.hidden_size or config.get("target_hidden_size") not in (None, target.hidden_size):
            raise DraftlabError(f"{where}: hidden size {shape.hidden_size} does not match the target's {target.hidden_size}")
        if cfg.vocab_size != target.vocab_size:
            raise DraftlabError(f"{where}: transformer_layer_config.vocab_size {cfg.vocab_size} != target vocab {target.vocab_size}")
        L = target.num_layers
        aux = config.get("eagle_aux_hidden_state_layer_ids") or Eagle3Drafter.default_aux_layers(L)  # speculators' default
        vd = config.get("draft_vocab_size") or target.vocab_size
        Eagle3Drafter.check_fields({"aux_layers": aux, "draft_vocab_size": vd}, target, where)  # before they are used
        bad = [i for i in aux if not 1 <= i <= L - 1]
        if bad:
            raise DraftlabError(f"{where}: eagle_aux_hidden_state_layer_ids {aux} must lie in 1..{L - 1} for this target")
        num_layers = cfg.num_hidden_layers
        if cfg.model_type == "llama" and shape.attention_bias:
            take_zero_bias(tensors, [f"layers.{i}.self_attn.o_proj.bias" for i in range(num_layers)], where)
        vocab_maps(tensors, target.vocab_size, vd, where)
        return {
            "shape": shape.model_dump(),
            "vocab_size": target.vocab_size,
            "draft_vocab_size": vd,
            "aux_layers": list(aux),
            "num_layers": num_layers,
            "num_target_layers": L,
            **flags,
        }



def eagle3_reference(drafter, ids, hidden, drafts, k):
    """draftlab's logits (draft vocabulary) of the chain ``drafts`` (target ids) after ``ids``:
    its TTT unroll with the drafts appended, read at the last kept position."""
    N = ids.numel() - 1
    full = torch.cat([ids, torch.tensor(drafts[: k - 1], dtype=torch.long)])[None]
    with torch.no_grad():
        return [drafter.head(h)[0, N - 1] for _, h in drafter.unroll(full, hidden, k)]


register(SpeculatorsEagle3())
