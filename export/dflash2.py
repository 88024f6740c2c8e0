"""DFlash2 drafters <-> the served ``DFlash2DraftModel`` layout (vLLM #52816, SGLang #35371, z-lab).

``--to vllm`` and ``--to sglang`` write one layout, the one both engines load (``import --format
zlab-dflash2`` reads it back): z-lab's DFlash config (export/dflash.py's ``ZlabDFlash``) with
``architectures: ["DFlash2DraftModel"]``, which routes a checkpoint to DFlash2 in vLLM (its registry
entry ``DFlash2DraftModel`` -> ``qwen3_dflash2.DFlash2Qwen3ForCausalLM``, ``"method": "dflash"``; a
``DFlashDraftModel`` resolves to plain DFlash there), while SGLang switches the convolutions and the
selector on by the ``dflash_config`` fields below (#35371's description), and:

* ``dflash_config``: ``target_layer_ids`` (draftlab ``target_layers`` - 1), ``mask_token_id``,
  ``block_size``, ``conv_kernel_size``, ``conv_group_size`` (channels per dynamic tap),
  ``selector_rank``, ``selector_top_k``: the keys the reference (``_draft_value``: dflash_config
  first), vLLM's ``DFlash2Qwen3DecoderLayer`` / ``CandidateSelector`` / ``DFlash2Speculator``
  read, as the published ``z-lab/Qwen3.8-27B-DFlash2`` config holds them; ``block_size`` also
  at the top level (the diffusion layout's place) and ``is_causal: false`` (the published config
  says so; the draft attends bidirectionally within the block);
* tensors: the backbone's (``layers.*``, ``fc``, ``hidden_norm``, ``norm``) plus
  ``layers.N.{attention,mlp}_conv.{base_kernel, kernel_projection.weight}`` and
  ``candidate_selector.{predecessor_codebook, successor_codebook, hidden_projection.weight}`` (the
  codebooks are bare parameters: vLLM loads them so; the reference maps them to its embeddings'
  ``.weight``). No embedding or lm_head: the verifier's embed the block and read the slots out.

The full vocabulary only: vLLM's ``compute_candidates`` takes the top-K of the verifier's lm_head
and indexes the codebooks with those ids, and speculators' DFlash2 refuses a reduced one.
vLLM's convolution restarts every ``1 + num_speculative_tokens`` query tokens, so serve with
``num_speculative_tokens = block_size - 1`` (what the model card says).

Checked against: vLLM ``model_executor/models/qwen3_dflash2.py`` and
``v1/worker/gpu/spec_decode/dflash2/speculator.py`` (read, not run: no GPU build here), z-lab/dflash
``dflash/model.py`` (``DFlash2DraftModel``, read), speculators 0.9.0 ``models/dflash2`` (installed:
``draftlab check`` / ``export --check`` drafts with its ``DFlash2DraftModel`` built from this
config, :class:`SpeculatorsDFlash2Peer`). SGLang's DFlash2 model was not in the stored sources
read here; SpecForge #772 states its exports follow SGLang's contract, which is this layout.
"""

from __future__ import annotations

import torch

from draftlab.errors import DraftlabError
from draftlab.export.check import PeerProposer, max_diff
from draftlab.export.dflash import ZLAB_NEUTRAL, SpeculatorsDFlashPeer, ZlabDFlash, _int, _layers, _meta
from draftlab.export.formats import ExportOptions, register, serving_aux_ids, vocab_maps

ARCH = "DFlash2DraftModel"
FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
OWN_KEYS = ("dflash_config", "block_size", "num_target_layers", "is_causal")  # the layout's own: the rest is a Qwen3 config
# knobs of the served model that change its math, with their neutral values (the diffusion layout's, less DFlash2's own)
NEUTRAL = {k: v for k, v in ZLAB_NEUTRAL.items() if k not in ("conv_kernel_size", "selector_rank")}


class ZlabDFlash2(ZlabDFlash):
    name = "zlab-dflash2"
    algorithm = "dflash2"
    engines = ("vllm", "sglang")
    title = "DFlash2 layout (vLLM `DFlash2DraftModel` with `\"method\": \"dflash\"`, SGLang `--speculative-algorithm DFLASH`, z-lab)"

    def check_exportable(self, drafter, target) -> None:
        if drafter.draft_vocab_size < drafter.vocab_size:
            raise DraftlabError(
                f"the served DFlash2 selector ranks the verifier's whole vocabulary and this drafter has a reduced draft "
                f"vocabulary ({drafter.draft_vocab_size} of {drafter.vocab_size}); train with drafter.draft_vocab_size=0"
            )
        serving_aux_ids(drafter.target_layers, drafter.num_target_layers, "the served DFlash2 model", "drafter.target_layers")

    def export_config(self, drafter, target, meta, opts: ExportOptions) -> dict:
        m = drafter.meta()
        config = super().export_config(drafter, target, meta, opts)
        config["architectures"] = [ARCH]
        config["is_causal"] = False
        config["dflash_config"].update({"block_size": drafter.block_size, **{k: m[k] for k in FIELDS}})
        return config

    def serving(self, out, target_name, opts, config):
        k = config["block_size"] - 1
        return (
            f"vLLM:\n```bash\nvllm serve {target_name} --speculative-config "
            f"'{{\"model\": \"{out}\", \"method\": \"dflash\", \"num_speculative_tokens\": {k}}}'\n```\n\n"
            f"SGLang:\n```bash\npython -m sglang.launch_server --model-path {target_name} --speculative-algorithm DFLASH \\\n"
            f"  --speculative-draft-model-path {out} --speculative-num-draft-tokens {config['block_size']}\n```"
        )

    def notes(self, drafter, config):
        dc = config["dflash_config"]
        return [
            *super().notes(drafter, config),
            f"`architectures: [\"{ARCH}\"]` selects DFlash2 in vLLM (under `DFlashDraftModel` it builds plain DFlash layers "
            "and refuses these tensors); SGLang turns the convolutions and the selector on by the `dflash_config` fields.",
            f"Convolutions: {dc['conv_kernel_size']} taps, groups of {dc['conv_group_size']} channels, restarting every block; "
            f"vLLM restarts them every `1 + num_speculative_tokens` tokens: serve with {config['block_size'] - 1}.",
            f"Selector: top-{dc['selector_top_k']} unary candidates per slot, rank-{dc['selector_rank']} codebooks; greedy walks "
            "the best path from the anchor, sampling hands q over the K candidates to verification.",
        ]

    # ---- served equals trained (export/check.py) ------------------------------------
    def detect(self, config):
        return (config.get("architectures") or [None])[0] == ARCH and "dflash_config" in config

    def peer_proposer(self, out, config, drafter, target):
        try:
            from speculators.models import dflash2
        except ImportError:
            return None
        return SpeculatorsDFlash2Peer(out, config, drafter, target, dflash2)

    # ---- import -----------------------------------------------------------------
    def import_meta(self, config, tensors, target):
        where = "DFlash2 config.json"
        arch = (config.get("architectures") or [None])[0]
        if arch != ARCH:
            raise DraftlabError(f"{where}: architectures[0] is {arch!r}, expected {ARCH!r}")
        dc = config.get("dflash_config")
        if not isinstance(dc, dict):
            raise DraftlabError(f"{where}: missing dflash_config (a dict with target_layer_ids, mask_token_id and the DFlash2 fields)")
        off = [k for k, ok in NEUTRAL.items() if dc.get(k, config.get(k, ok[0])) not in ok]
        if config.get("is_causal") or dc.get("causal"):
            off.append("is_causal")
        if off:
            raise DraftlabError(f"{where}: {', '.join(off)} is not implemented by draftlab's DFlash2 drafter")
        sizes = {k: _int(dc.get(k, config.get(k)), where, f"dflash_config.{k}", 1) for k in FIELDS}
        top, block = config.get("block_size"), dc.get("block_size")
        if top is not None and block is not None and top != block:
            raise DraftlabError(f"{where}: block_size {top} and dflash_config.block_size {block} disagree")
        shape, cfg = _layers({k: v for k, v in config.items() if k not in OWN_KEYS}, where, target)
        L, V = target.num_layers, target.vocab_size
        n = dc.get("num_target_layers", config.get("num_target_layers", L))
        if n != L:
            raise DraftlabError(f"{where}: num_target_layers {n!r} != the target's {L} (trained for another target?)")
        block_size = _int(block if block is not None else top, where, "block_size", 2)
        mask = _int(dc.get("mask_token_id"), where, "dflash_config.mask_token_id", 0, V - 1)
        ids = dc.get("target_layer_ids")
        if not isinstance(ids, list) or not all(type(i) is int for i in ids):
            raise DraftlabError(f"{where}: missing dflash_config.target_layer_ids (a list of layer ids)")
        vocab_maps(tensors, V, V, where)
        return {**_meta(shape, cfg, target, V, [i + 1 for i in ids], block_size, mask, where, "dflash_config.target_layer_ids (+1)"),
                **sizes}


class SpeculatorsDFlash2Peer(SpeculatorsDFlashPeer):
    """Drafts with speculators' ``DFlash2DraftModel`` (installed 0.9.0, speculators #1006) built from
    the export's config (its flat fields from the nested ``dflash_config``: ``aux_hidden_state_layer_ids``
    = target_layer_ids + 1, ``sample_from_anchor`` false), the export's tensors loaded strictly
    (the verifier's embedding and lm_head from the target). Its modules run the block after the
    context (its convolutions inside its layers), then its ``candidate_selector`` scores each slot's
    unary top-K from the token picked before it, walked greedily from the last kept token: the
    chain of k verification sees. draftlab's selector scores are compared on the same candidates
    and predecessors (the peer's)."""

    peer = "speculators DFlash2DraftModel"

    def __init__(self, out, config, drafter, target, module):
        from transformers import Qwen3Config

        from draftlab.checkpoint import read_weights

        PeerProposer.__init__(self, drafter.capture_layers, drafter)
        dc = config["dflash_config"]
        layer = Qwen3Config(**{k: v for k, v in config.items() if k not in OWN_KEYS})
        layer._attn_implementation = "eager"  # no flex-attention compile on CPU
        cfg = module.DFlash2SpeculatorConfig(
            transformer_layer_config=layer, draft_vocab_size=config["vocab_size"], block_size=dc["block_size"],
            aux_hidden_state_layer_ids=[i + 1 for i in dc["target_layer_ids"]], mask_token_id=dc["mask_token_id"],
            target_hidden_size=config["hidden_size"], sample_from_anchor=False, **{k: dc[k] for k in FIELDS},
        )
        m = module.DFlash2DraftModel(cfg)
        state = {k: v.float() if v.is_floating_point() else v for k, v in read_weights(out / "model.safetensors").items()}
        own = m.state_dict()
        state["embed_tokens.weight"] = target.embed_tokens.weight.detach().float().cpu()
        state["lm_head.weight"] = target.lm_head.weight.detach().float().cpu()
        for key in ("verifier_lm_head.weight", "verifier_norm.weight"):  # training-only: not used to draft
            state[key] = own[key]
        try:
            m.load_state_dict(state, strict=True)
        except RuntimeError as e:
            why = str(e).splitlines()[1].strip()
            raise DraftlabError(f"{out}: speculators' DFlash2DraftModel does not load the weights ({why})") from None
        self.model, self.aux, self.mask, self.G = m.float().eval(), list(cfg.aux_hidden_state_layer_ids), cfg.mask_token_id, cfg.block_size

    def draft(self, k):
        m, sel = self.model, self.model.candidate_selector
        h = self.block_states(k)[0]  # [k, H]
        unary = m.lm_head(h)
        cand = unary.topk(sel.top_k, dim=-1).indices
        d = self.drafter
        ours_h = d.block_states(*self.our_block())[0, 1 : 1 + k]
        ours_unary = d.readout(ours_h)
        prev, drafts, diffs = int(self.ids[-1]), [], []
        for j in range(k):  # one slot at a time: its scores read the token picked before it
            p = torch.tensor([prev])
            theirs = sel.score_candidates(unary[j : j + 1], h[j : j + 1], p, cand[j : j + 1])[0]
            ours = d.candidate_selector.scores(ours_unary[j].gather(-1, cand[j]), ours_h[j], p[0], cand[j])
            prev = int(cand[j, theirs.argmax()])
            drafts.append(prev)
            diffs.append(max(max_diff(theirs, ours), max_diff(unary[j], ours_unary[j])))
        return drafts, diffs


register(ZlabDFlash2())
