"""EAGLE-1 <-> the EAGLE repository layout (SafeAILab/EAGLE ``cnets1``/``cnets`` ``Model``),
loaded by SGLang's ``LlamaForCausalLMEagle`` and (without fc bias) vLLM's ``EagleLlamaForCausalLM``.

* Tensors keep draftlab's names: ``fc.weight``/``fc.bias`` (2H -> H), ``layers.{i}.*`` with no
  ``input_layernorm`` on layer 0, plus ``embed_tokens.weight`` copied from the target (EAGLE's
  ``Model`` has the parameter; SGLang and vLLM replace it by the target's at load time). No
  lm_head: every loader uses the target's.
* Config: a Llama config of the drafter's layers with ``num_hidden_layers`` = drafter layers.
  ``architectures`` differs per engine, so there are two exports:
  ``--to sglang`` writes ``LlamaForCausalLMEagle`` (what SGLang instantiates) and keeps fc.bias;
  ``--to vllm`` writes ``LlamaForCausalLM`` (vLLM's EAGLEConfig renames it to
  ``EagleLlamaForCausalLM``) — whose fc has *no bias*, so it is refused unless fc.bias is
  exactly zero (then it is dropped, which is exact).
* No ``bias`` key is written: vLLM's and SGLang's Llama decoder layers read ``config.bias`` as
  "attention has biases" and would expect q/k/v/o biases.
* Weights are ``model.safetensors`` (no pickles). EAGLE's ``EaModel.from_pretrained`` tries
  ``pytorch_model.bin`` first and falls back to ``model.safetensors``; the eagle-llm 1.2.1
  package's ``Model`` hard-codes RoPE base 10000 (fine for Llama-2-era targets only; SGLang and
  vLLM read ``rope_theta``, which ``draftlab check`` gives the eagle-llm peer, and says so).
"""

from __future__ import annotations

from draftlab.errors import DraftlabError
from draftlab.export.check import PeerProposer, max_diff
from draftlab.export.formats import ExportOptions, Format, layer_config, llama_compatible, register, shape_from_config


class EagleLayout(Format):
    algorithm = "eagle1"

    def __init__(self, name: str, engine: str, architecture: str, fc_bias: bool):
        self.name, self.engines, self.architecture, self.fc_bias = name, (engine,), architecture, fc_bias
        self.title = f"EAGLE repository layout (`{architecture}`{'' if fc_bias else ', fc without bias'})"

    def check_exportable(self, drafter, target) -> None:
        engine = self.engines[0]
        llama_compatible(drafter, f"--to {engine}: the EAGLE-1 drafter ({self.architecture})")
        if not self.fc_bias:
            b = drafter.fc.bias.detach().abs().max().item()
            if b != 0.0:
                raise DraftlabError(
                    f"--to {engine}: vLLM's EagleLlamaForCausalLM has an fc without bias and this drafter's fc.bias "
                    f"is non-zero (max |b| = {b:.3g}); export --to sglang (LlamaForCausalLMEagle keeps the bias)"
                )

    def export_state(self, drafter, target):
        state = super().export_state(drafter, target)
        if not self.fc_bias:
            state.pop("fc.bias")  # checked to be exactly zero
        return state

    def extra_tensors(self, drafter, target):
        return {"embed_tokens.weight": target.embed_tokens.weight}

    def export_config(self, drafter, target, meta, opts: ExportOptions) -> dict:
        return layer_config(drafter.shape, len(drafter.layers), drafter.vocab_size, "llama", architectures=[self.architecture])

    def serving(self, out, target_name, opts, config):
        k = opts.speculative_tokens
        if self.engines[0] == "vllm":
            return (
                f"```bash\nvllm serve {target_name} --speculative-config "
                f"'{{\"model\": \"{out}\", \"method\": \"eagle\", \"num_speculative_tokens\": {k}}}'\n```"
            )
        return (
            f"```bash\npython -m sglang.launch_server --model-path {target_name} --speculative-algorithm EAGLE \\\n"
            f"  --speculative-draft-model-path {out} --speculative-num-steps {k} \\\n"
            f"  --speculative-eagle-topk 1 --speculative-num-draft-tokens {k + 1}\n```\n"
            "The EAGLE repository (`EaModel.from_pretrained(base_model_path=..., ea_model_path=...)`) reads the same "
            "directory: it looks for `pytorch_model.bin` first and falls back to `model.safetensors`."
        )

    def notes(self, drafter, config):
        out = [
            "Feature: the target's last hidden state after its final norm (HF `hidden_states[L]`); no lm_head is stored, "
            "the target's is used.",
            "`embed_tokens.weight` is a copy of the target's embedding (EAGLE's `Model` has the parameter).",
            "Weights are `model.safetensors`. EAGLE's own `EaModel.from_pretrained` looks for `pytorch_model.bin` first and "
            "falls back to `model.safetensors`; to produce a `.bin` anyway: "
            "`python -c \"import torch; from safetensors.torch import load_file; "
            "torch.save(load_file('model.safetensors'), 'pytorch_model.bin')\"`.",
        ]
        if not self.fc_bias:
            out.append("fc.bias was exactly zero and is omitted (vLLM's EagleLlamaForCausalLM has no fc bias).")
        return out

    # ---- served equals trained (export/check.py) ------------------------------------
    def detect(self, config):
        return (config.get("architectures") or [None])[0] == self.architecture and "draftlab" not in config  # a draft LM's has it

    def peer_proposer(self, out, config, drafter, target):
        try:
            from eagle.model.cnets import Model
            from eagle.model.configs import EConfig
        except ImportError:
            return None
        return EagleRepoPeer(out, config, drafter, target, Model, EConfig)

    def import_meta(self, config, tensors, target):
        where = "EAGLE config.json"
        shape, cfg = shape_from_config(config, where, target)
        if shape.hidden_size != target.hidden_size:
            raise DraftlabError(f"{where}: hidden_size {shape.hidden_size} does not match the target's {target.hidden_size}")
        if cfg.vocab_size != target.vocab_size:
            raise DraftlabError(f"{where}: vocab_size {cfg.vocab_size} != target vocab {target.vocab_size}")
        if "fc.bias" not in tensors and "fc.weight" in tensors:
            # vLLM's EAGLE layout has no fc bias (= zero); EAGLE's own declares `"bias": false`.
            if config.get("bias", False):
                raise DraftlabError(f"{where}: \"bias\": true but the weights have no fc.bias")
            tensors["fc.bias"] = tensors["fc.weight"].new_zeros(shape.hidden_size)
        return {
            "shape": shape.model_dump(),
            "vocab_size": target.vocab_size,
            "num_layers": cfg.num_hidden_layers,
            "num_target_layers": target.num_layers,
        }


class EagleRepoPeer(PeerProposer):
    """Drafts with the EAGLE repository's ``cnets.Model`` (eagle-llm 1.2.1) built from the
    export's config.json, weights loaded strictly, the target's lm_head reading it out. EAGLE-1
    feeds each draft position the model's own output of the position before, so a draft is one
    causal forward over the history with the speculative positions appended."""

    peer = "EAGLE cnets.Model"

    def __init__(self, out, config, drafter, target, model_cls, config_cls):
        from draftlab.checkpoint import read_weights

        super().__init__(drafter.capture_layers, drafter)
        cfg = config_cls.from_pretrained(str(out))
        if config.get("rope_scaling") is None:
            # transformers 5 turns the file's `rope_scaling: null` into its rope_parameters dict, which
            # eagle-llm (written for 4.x) reads as a scaling spec: keep what the file says
            cfg.rope_scaling = None
        state = {k: v.float() for k, v in read_weights(out / "model.safetensors").items()}
        m = model_cls(cfg, bias="fc.bias" in state)
        self.serve_rope_theta(m, config)
        try:
            m.load_state_dict(state, strict=True)
        except RuntimeError as e:
            raise DraftlabError(f"{out}: EAGLE's cnets.Model does not load the weights ({str(e).splitlines()[1].strip()})") from None
        self.model, self.lm_head, self.L = m.float().eval(), target.lm_head, drafter.num_target_layers

    def serve_rope_theta(self, model, config) -> None:
        """eagle-llm's attention builds its RoPE with base 10000 whatever the config says; SGLang's
        and vLLM's EAGLE layers read ``rope_theta`` from config.json. The peer stands for the
        engine, so it gets the config's base (cnets' own RoPE class), and the report says that
        the EAGLE repository's code would draft otherwise for this target."""
        import sys

        theta = float(config.get("rope_theta", 10000.0))
        if theta == 10000.0 or config.get("rope_scaling") is not None:
            return
        rope = sys.modules[type(model).__module__].LlamaRotaryEmbedding
        for layer in model.layers:
            attn = layer.self_attn
            attn.rotary_emb = rope(attn.head_dim, max_position_embeddings=attn.max_position_embeddings, base=theta)
        self.notes.append(f"the peer's RoPE base set to config.json's rope_theta {theta:g}, as SGLang reads it; the EAGLE "
                          "repository's own EaModel (eagle-llm) hard-codes 10000 and drafts otherwise for this target")

    def draft(self, k):
        import torch

        feats, tokens = self.hidden[self.L], self.ids[1:][None]
        drafts, diffs = [], []
        for _ in range(k):
            h = self.model(feats, input_ids=tokens)
            logits = self.lm_head(h[:, -1].to(self.lm_head.weight.dtype)).float()[0]
            drafts.append(int(logits.argmax()))
            n = tokens.shape[1]  # draftlab's layers on the same inputs, for the logits
            ours = self.drafter.stack(self.drafter.embed(tokens), feats, torch.arange(n)[None],
                                      lambda i, attn: lambda q, k_, v: attn.attend(q, k_, v, causal=True))
            diffs.append(max_diff(logits, self.drafter.head(ours[:, -1]).float()[0]))
            feats = torch.cat([feats, h[:, -1:]], dim=1)
            tokens = torch.cat([tokens, tokens.new_tensor([[drafts[-1]]])], dim=1)
        return drafts, diffs


register(EagleLayout("eagle", "sglang", "LlamaForCausalLMEagle", fc_bias=True))
register(EagleLayout("", "vllm", "LlamaForCausalLM", fc_bias=False))
