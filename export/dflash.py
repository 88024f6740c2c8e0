"""Block diffusion (DFlash) drafters <-> speculators' ``dflash`` format and z-lab's layout.

``--to vllm`` (import ``--format speculators-dflash``): speculators' ``DFlashSpeculatorConfig`` /
``DFlashDraftModel``, which vLLM serves with ``"method": "dflash"``.

* Config: ``speculators_model_type: "dflash"``, ``architectures: ["DFlashDraftModel"]`` (what
  speculators' own ``save_pretrained`` writes; vLLM's ``update_dflash`` sets it anyway), a Qwen3
  ``transformer_layer_config`` of the drafter's layers (``head_dim`` explicit: Qwen3Config
  defaults it to 128; ``layer_types`` one entry per layer), ``block_size``,
  ``aux_hidden_state_layer_ids``, ``mask_token_id``, ``draft_vocab_size``,
  ``target_hidden_size``, ``sample_from_anchor: false`` (slot 0 holds the anchor, slots
  1..gamma-1 draft) and a greedy proposal of ``block_size - 1`` tokens (what vLLM drafts).
* Tensors are draftlab's names unchanged (``layers.*``, ``fc``, ``hidden_norm``, ``norm``). A
  reduced vocabulary adds ``lm_head.weight``, ``d2t``, ``t2d`` (as EAGLE-3). With the full
  vocabulary speculators registers ``d2t``/``t2d`` as ``None`` and refills ``lm_head`` from
  the verifier, so none of the three is written (they would be unexpected keys). The
  embedding, ``verifier_lm_head`` and ``verifier_norm`` come from the verifier
  (``speculators_config.verifier.name_or_path``); ``rotary.*`` is never written.

``--to sglang`` (import ``--format zlab-dflash``): z-lab's layout (reference ``dflash/model.py``
``DFlashDraftModel``), which SGLang's ``--speculative-algorithm DFLASH`` and SpecForge load: a
Qwen3 config plus ``architectures: ["DFlashDraftModel"]``, ``block_size``,
``dflash_config: {target_layer_ids, mask_token_id}``, ``num_target_layers``; tensors
``layers.*``, ``fc``, ``hidden_norm``, ``norm``. There is no lm_head: the target's reads the
drafter out, so a reduced draft vocabulary cannot be written.

Layer ids: speculators' ``aux_hidden_state_layer_ids`` = draftlab's ``target_layers`` (HF
``hidden_states`` indices, the input of decoder layer i) = z-lab ``target_layer_ids`` + 1: the
z-lab reference reads HF ``hidden_states[id + 1]``, SGLang captures the input of layer id + 1,
vLLM's ``update_dflash`` writes ``target_layer_ids = aux - 1``. Serving engines capture each
layer once, in ascending order (vLLM: ``if idx in aux_hidden_state_layers`` in the layer loop),
and only decoder-layer inputs 1..L-1, so exports refuse other target layers.

Checked against: speculators 0.9.0 (``models/dflash/{config,core,model_definitions}.py``,
``model.py`` DraftVocabMixin, ``convert/dflash/converter.py``; the test-suite loads the export
with its ``DFlashDraftModel.from_pretrained`` and compares block logits), SpecForge 0.2.0
``modeling/draft/dflash.py`` (z-lab layout; loaded and compared in the test-suite, its
``extract_context_feature`` reading HF ``hidden_states[id + 1]``). Read, not run (no GPU
builds here): z-lab/dflash ``dflash/model.py`` @1012959 (``_draft_value`` reads
``dflash_config`` first, then the top level; ``layer_types`` indexed per layer), SGLang
``srt/models/dflash.py`` @003b23d + ``srt/speculative/dflash_utils.py`` @00731f0
(``parse_dflash_draft_config``: ``block_size`` / ``num_target_layers`` top level or in
``dflash_config``, ``mask_token_id`` int, ``layer_types`` one per layer, unknown tensors
skipped silently), vLLM ``transformers_utils/configs/speculators/algos.py`` ``update_dflash``
(requires ``mask_token_id`` and ``aux_hidden_state_layer_ids``; revision not pinned). vLLM's own
DFlash weight loader (reduced-vocabulary ``d2t`` handling included) was not read.
"""

from __future__ import annotations

import torch

from draftlab.errors import DraftlabError
from draftlab.export.check import PeerProposer, max_diff
from draftlab.export.formats import (
    ExportOptions,
    Format,
    SpeculatorsFormat,
    layer_config,
    register,
    serving_aux_ids,
    shape_from_config,
    speculators_config,
    vocab_maps,
)

SPECULATORS_VERSION = "0.9.0"  # the speculators release this layout was checked against
VOCAB = ("lm_head.weight", "d2t", "t2d")  # written by the speculators export only for a reduced vocabulary
# z-lab / SGLang dflash_config knobs that change the drafter's math, with their neutral values
ZLAB_NEUTRAL = {
    "input_embedding_scale": (1, 1.0), "output_multiplier": (1, 1.0), "final_logit_softcapping": (None, 0, 0.0),
    "conv_kernel_size": (0,), "selector_rank": (0,), "projector_type": (None,), "attention_sink_bias": (False,),
    "attention_value_scale": (None,),
}


def decoder_config(drafter, **overrides) -> dict:
    """The drafter's layers as a Qwen3 config."""
    return layer_config(drafter.shape, len(drafter.layers), drafter.vocab_size, "qwen3", **overrides)


def _int(value, where: str, field: str, lo: int, hi: int | None = None) -> int:
    if value is None:
        raise DraftlabError(f"{where}: missing {field}")
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
        raise DraftlabError(f"{where}: {field} must be an integer in {lo}..{'' if hi is None else hi}, got {value!r}")
    return value


def _layers(tl: dict, where: str, target):
    """(LayerShape, HF config) of a DFlash decoder config: always Qwen3 DFlash layers (q/k norm)."""
    shape, cfg = shape_from_config({"model_type": "qwen3", **tl}, where, target)
    if getattr(cfg, "attention_bias", False):
        raise DraftlabError(f"{where}: attention_bias = true; draftlab's DFlash layers have no attention biases")
    kinds = set(getattr(cfg, "layer_types", None) or ["full_attention"])
    if kinds != {"full_attention"}:
        raise DraftlabError(f"{where}: layer_types {sorted(kinds)}; draftlab's DFlash layers are all full (bidirectional) attention")
    if shape.hidden_size != target.hidden_size:
        raise DraftlabError(f"{where}: hidden_size {shape.hidden_size} does not match the target's {target.hidden_size}")
    if cfg.vocab_size != target.vocab_size:
        raise DraftlabError(f"{where}: vocab_size {cfg.vocab_size} != target vocab {target.vocab_size}")
    _int(cfg.num_hidden_layers, where, "num_hidden_layers", 1)
    return shape.model_copy(update={"model_type": "qwen3", "qk_norm": True, "attention_bias": False}), cfg


def _meta(shape, cfg, target, vd: int, layers: list, block_size: int, mask: int, where: str, field: str) -> dict:
    L = target.num_layers
    if not isinstance(layers, list) or not layers or any(isinstance(i, bool) or not isinstance(i, int) or not 1 <= i <= L - 1 for i in layers):
        raise DraftlabError(f"{where}: {field} must be a non-empty list of target layers in the capturable range, got {layers!r}")
    return {
        "shape": shape.model_dump(),
        "vocab_size": target.vocab_size,
        "draft_vocab_size": vd,
        "target_layers": layers,
        "num_layers": cfg.num_hidden_layers,
        "block_size": block_size,
        "mask_token_id": mask,
        "num_target_layers": L,
    }


# ============================================================================ speculators (vLLM)


class SpeculatorsDFlashPeer(PeerProposer):
    """Drafts with speculators' ``DFlashDraftModel`` built from the export's config.json, weights
    loaded strictly; what speculators takes from the verifier (embedding, its lm_head with the
    full vocabulary) is the target's. Its own modules run the block ``[last, MASK...]`` after the
    whole context (``fc`` -> ``hidden_norm`` of the aux states), every slot seeing the context and
    the whole block, as vLLM's DFlash drafts; slot j's argmax is the j-th draft."""

    peer = "speculators DFlashDraftModel"
    shapes = frozenset({"block"})

    def __init__(self, out, drafter, target, config_cls, model_cls):
        from draftlab.checkpoint import read_weights

        super().__init__(drafter.capture_layers, drafter)
        cfg = config_cls.from_pretrained(str(out))
        cfg.transformer_layer_config._attn_implementation = "eager"  # no flex-attention compile on CPU
        m = model_cls(cfg)
        state = {k: v.float() if v.is_floating_point() else v for k, v in read_weights(out / "model.safetensors").items()}
        head = target.lm_head.weight.detach().float().cpu()
        own = m.state_dict()
        state["embed_tokens.weight"] = target.embed_tokens.weight.detach().float().cpu()
        for key in ("verifier_lm_head.weight", "verifier_norm.weight"):  # training-only: not used to draft
            state[key] = own[key]
        if not m.use_draft_vocab:
            state["lm_head.weight"] = head
        try:
            m.load_state_dict(state, strict=True)
        except RuntimeError as e:
            raise DraftlabError(f"{out}: speculators' DFlashDraftModel does not load the weights ({str(e).splitlines()[1].strip()})") from None
        self.model, self.aux, self.mask, self.G = m.float().eval(), list(cfg.aux_hidden_state_layer_ids), cfg.mask_token_id, cfg.block_size

    def block_states(self, k):
        """The peer's block ``[last, MASK...]`` after the context: its final-norm states of slots
        1..k [1, k, H] (slot 0 holds the anchor: ``sample_from_anchor`` false)."""
        m, N, G = self.model, self.ids.numel() - 1, self.G
        block = torch.full((1, G), self.mask, dtype=torch.long)
        block[0, 0] = self.ids[-1]
        ctx = m.hidden_norm(m.fc(torch.cat([self.hidden[i] for i in self.aux], -1)))
        h, pos = m.embed_tokens(block), torch.arange(N + G)[None]  # RoPE over [context positions, block positions]
        pe = m.rotary_emb(h, pos)
        for layer in m.layers:
            h = layer(hidden_states=h, target_hidden=ctx, attention_mask=torch.zeros(1, 1, G, N + G), position_ids=pos,
                      position_embeddings=pe)
        return m.norm(h)[:, 1 : 1 + k]

    def our_block(self):
        """draftlab's block over the same context: its inputs to ``blocks``/``block_states``."""
        d, N, G = self.drafter, self.ids.numel() - 1, self.G
        kv = d.context_kv(d.context(self.hidden), torch.arange(N)[None])
        return d.block_ids(self.ids[-1:]), torch.arange(N, N + G)[None], kv, torch.ones(1, G, N + G, dtype=torch.bool)

    def draft(self, k):
        m = self.model
        logits = m.lm_head(self.block_states(k))[0]
        ours = self.drafter.blocks(*self.our_block())[0, 1 : 1 + k]
        drafts = logits.argmax(-1)
        if m.use_draft_vocab:
            drafts = drafts + m.d2t[drafts]
        return drafts.tolist(), [max_diff(a, b) for a, b in zip(logits, ours)]


class SpeculatorsDFlash(SpeculatorsFormat):
    name = "speculators-dflash"
    algorithm = "diffusion"
    engines = ("vllm",)
    title = "speculators `dflash` format (vLLM `\"method\": \"dflash\"`)"

    def check_exportable(self, drafter, target) -> None:
        serving_aux_ids(drafter.target_layers, drafter.num_target_layers, "--to vllm: vLLM", "drafter.target_layers")

    def export_state(self, drafter, target):
        state = super().export_state(drafter, target)
        if drafter.draft_vocab_size == drafter.vocab_size:  # speculators has no d2t/t2d then, lm_head is the verifier's
            state = {k: v for k, v in state.items() if k not in VOCAB}
        return state

    def export_config(self, drafter, target, meta, opts: ExportOptions) -> dict:
        return {
            "architectures": ["DFlashDraftModel"],
            "speculators_model_type": "dflash",
            "speculators_version": SPECULATORS_VERSION,
            "speculators_config": speculators_config("dflash", drafter.block_size - 1, target, opts),
            "transformer_layer_config": decoder_config(drafter),
            "block_size": drafter.block_size,
            "aux_hidden_state_layer_ids": list(drafter.target_layers),
            "mask_token_id": drafter.mask_token_id,
            "draft_vocab_size": drafter.draft_vocab_size,
            "target_hidden_size": drafter.shape.hidden_size,
            "sample_from_anchor": False,
            "sliding_window_non_causal": False,
            "tie_word_embeddings": False,
        }

    def serving(self, out, target_name, opts, config):
        k = config["block_size"] - 1
        return (
            f"```bash\nvllm serve {target_name} --speculative-config "
            f"'{{\"model\": \"{out}\", \"method\": \"dflash\", \"num_speculative_tokens\": {k}}}'\n```\n"
            f"or `vllm serve {out}` (vLLM reads the verifier from `speculators_config`)."
        )

    def notes(self, drafter, config):
        full = config["draft_vocab_size"] == config["transformer_layer_config"]["vocab_size"]
        return [
            f"`aux_hidden_state_layer_ids = {config['aux_hidden_state_layer_ids']}`: HF `hidden_states` indices (draftlab's "
            "`target_layers`, no shift); vLLM passes `target_layer_ids = aux - 1` to its DFlash model (z-lab's convention).",
            f"Block of {config['block_size']}: the anchor plus {config['block_size'] - 1} drafts per forward "
            f"(`sample_from_anchor: false`, `mask_token_id = {config['mask_token_id']}`); `num_speculative_tokens` is always "
            "`block_size - 1` (`--num-speculative-tokens` is not used).",
            "Full vocabulary: no `lm_head`/`d2t`/`t2d` tensors, the verifier's lm_head reads the drafter out."
            if full else f"Reduced draft vocabulary of {config['draft_vocab_size']} tokens: own `lm_head`, `d2t`/`t2d` as EAGLE-3.",
            "No `embed_tokens.weight`: the block is embedded with the verifier's embedding.",
        ]

    # ---- served equals trained (export/check.py) ------------------------------------
    speculators_type = "dflash"
    peer_adapter = SpeculatorsDFlashPeer
    peer_model = ("speculators.models.dflash", "DFlashDraftModel")

    # ---- import -----------------------------------------------------------------
    def import_meta(self, config, tensors, target):
        where = self.where
        self.check_type(config)
        if config.get("sample_from_anchor", False):
            raise DraftlabError(f"{where}: sample_from_anchor = true is not draftlab's block (slot 0 holds the anchor)")
        tl = config.get("transformer_layer_config")
        if not isinstance(tl, dict):
            raise DraftlabError(f"{where}: missing transformer_layer_config (a dict)")
        shape, cfg = _layers(tl, f"{where} transformer_layer_config", target)
        if config.get("target_hidden_size") not in (None, target.hidden_size):
            raise DraftlabError(f"{where}: target_hidden_size {config['target_hidden_size']} does not match the target's {target.hidden_size}")
        V = target.vocab_size
        block_size = _int(config.get("block_size"), where, "block_size", 2)
        mask = _int(config.get("mask_token_id"), where, "mask_token_id", 0, V - 1)
        vd = _int(config.get("draft_vocab_size"), where, "draft_vocab_size", 1, V)
        layers = config.get("aux_hidden_state_layer_ids")
        if layers is None:
            raise DraftlabError(f"{where}: missing aux_hidden_state_layer_ids")
        vocab_maps(tensors, V, vd, where)
        return _meta(shape, cfg, target, vd, layers, block_size, mask, where, "aux_hidden_state_layer_ids")



# ============================================================================ z-lab (SGLang)


class ZlabDFlash(Format):
    name = "zlab-dflash"
    algorithm = "diffusion"
    engines = ("sglang",)
    title = "z-lab DFlash layout (SGLang `--speculative-algorithm DFLASH`, SpecForge)"

    def check_exportable(self, drafter, target) -> None:
        if drafter.draft_vocab_size < drafter.vocab_size:
            raise DraftlabError(
                f"--to sglang: the z-lab DFlash layout reads out with the target's lm_head and this drafter has a reduced draft "
                f"vocabulary ({drafter.draft_vocab_size} of {drafter.vocab_size}); export --to vllm, or train with drafter.draft_vocab_size=0"
            )
        serving_aux_ids(drafter.target_layers, drafter.num_target_layers, "--to sglang: SGLang", "drafter.target_layers")

    def export_state(self, drafter, target):
        return {k: v for k, v in super().export_state(drafter, target).items() if k not in VOCAB}

    def export_config(self, drafter, target, meta, opts: ExportOptions) -> dict:
        return decoder_config(
            drafter,
            architectures=["DFlashDraftModel"],
            block_size=drafter.block_size,
            dflash_config={"target_layer_ids": [i - 1 for i in drafter.target_layers], "mask_token_id": drafter.mask_token_id},
            num_target_layers=drafter.num_target_layers,
        )

    def serving(self, out, target_name, opts, config):
        return (
            f"```bash\npython -m sglang.launch_server --model-path {target_name} --speculative-algorithm DFLASH \\\n"
            f"  --speculative-draft-model-path {out} --speculative-num-draft-tokens {config['block_size']}\n```"
        )

    def notes(self, drafter, config):
        ids = config["dflash_config"]["target_layer_ids"]
        return [
            f"`dflash_config.target_layer_ids = {ids}` = draftlab `target_layers` {list(drafter.target_layers)} minus 1: the z-lab "
            "reference reads HF `hidden_states[id + 1]`, SGLang captures the input of layer id + 1.",
            f"`mask_token_id = {config['dflash_config']['mask_token_id']}` is a target-vocabulary id: the block is embedded "
            "with the target's embedding and read out with the target's lm_head (no such tensors here).",
        ]

    # ---- served equals trained (export/check.py) ------------------------------------
    def detect(self, config):
        return "dflash_config" in config and "speculators_model_type" not in config

    def peer_proposer(self, out, config, drafter, target):
        try:
            from specforge.modeling.draft import dflash as specforge_dflash
        except ImportError:
            return None
        return SpecForgeDFlashPeer(out, config, drafter, target, specforge_dflash)

    # ---- import -----------------------------------------------------------------
    def import_meta(self, config, tensors, target):
        where = "z-lab dflash config.json"
        if "speculators_model_type" in config:
            raise DraftlabError(f"{where}: this is a speculators config; import it with --format speculators-dflash")
        arch = (config.get("architectures") or [None])[0]
        if arch != "DFlashDraftModel":
            raise DraftlabError(f"{where}: architectures[0] is {arch!r}, expected 'DFlashDraftModel'")
        dc = config.get("dflash_config")
        if not isinstance(dc, dict):
            raise DraftlabError(f"{where}: missing dflash_config (a dict with target_layer_ids and mask_token_id)")
        off = [k for k, ok in ZLAB_NEUTRAL.items() if dc.get(k, config.get(k, ok[0])) not in ok]
        if off:
            raise DraftlabError(f"{where}: dflash_config {', '.join(off)} is not implemented by draftlab's diffusion drafter")
        shape, cfg = _layers({k: v for k, v in config.items() if k not in ("dflash_config", "block_size", "num_target_layers")}, where, target)
        L, V = target.num_layers, target.vocab_size
        n = dc.get("num_target_layers", config.get("num_target_layers", L))
        if n != L:
            raise DraftlabError(f"{where}: num_target_layers {n!r} != the target's {L} (trained for another target?)")
        block_size = _int(dc.get("block_size", config.get("block_size")), where, "block_size", 2)
        mask = _int(dc.get("mask_token_id"), where, "dflash_config.mask_token_id", 0, V - 1)
        ids = dc.get("target_layer_ids")
        if not isinstance(ids, list) or not all(type(i) is int for i in ids):
            raise DraftlabError(f"{where}: missing dflash_config.target_layer_ids (a list of layer ids)")
        vocab_maps(tensors, V, V, where)
        return _meta(shape, cfg, target, V, [i + 1 for i in ids], block_size, mask, where, "dflash_config.target_layer_ids (+1)")


def specforge_model(out, config: dict, model_cls):
    """A SpecForge draft model class built from an export's ``config`` (its Qwen3 decoder, eager
    attention) with the export's weights loaded strictly, in fp32; a one-line error if they do not fit."""
    from transformers import Qwen3Config

    from draftlab.checkpoint import read_weights

    cfg = Qwen3Config(**config)
    cfg._attn_implementation = "eager"
    m = model_cls(cfg)
    state = {k: v.float() if v.is_floating_point() else v for k, v in read_weights(out / "model.safetensors").items()}
    try:
        m.load_state_dict(state, strict=True)
    except RuntimeError as e:
        raise DraftlabError(f"{out}: SpecForge's {model_cls.__name__} does not load the weights ({str(e).splitlines()[1].strip()})") from None
    return m.float().eval()


class SpecForgeDFlashPeer(PeerProposer):
    """Drafts with SpecForge 0.2.0's z-lab ``DFlashDraftModel`` (the layout SGLang loads) built from
    the export's config.json, weights loaded strictly: its ``forward`` over the block
    ``[last, MASK...]`` embedded with the target's embedding, the context read as z-lab reads it
    (``extract_context_feature``: HF ``hidden_states[id + 1]``), the target's lm_head reading the
    slots out."""

    peer = "SpecForge DFlashDraftModel"
    shapes = frozenset({"block"})

    def __init__(self, out, config, drafter, target, module):
        m = specforge_model(out, config, module.DFlashDraftModel)
        super().__init__(sorted({i + 1 for i in m.target_layer_ids} | set(drafter.capture_layers)), drafter)
        self.model, self.extract, self.target = m, module.extract_context_feature, target
        self.mask, self.G = config["dflash_config"]["mask_token_id"], config["block_size"]

    def draft(self, k):
        m, t, N, G = self.model, self.target, self.ids.numel() - 1, self.G
        block = torch.full((1, G), self.mask, dtype=torch.long)
        block[0, 0] = self.ids[-1]
        ctx = self.extract(self.hidden, m.target_layer_ids)  # indexed as HF's hidden_states tuple
        h = m(position_ids=torch.arange(N + G)[None], noise_embedding=t.embed_tokens(block).float(), target_hidden=ctx)
        logits = t.lm_head(h).float()[0, 1 : 1 + k]
        d = self.drafter
        kv = d.context_kv(d.context(self.hidden), torch.arange(N)[None])
        ours = d.blocks(d.block_ids(self.ids[-1:]), torch.arange(N, N + G)[None], kv, torch.ones(1, G, N + G, dtype=torch.bool))[0, 1 : 1 + k]
        return logits.argmax(-1).tolist(), [max_diff(a, b) for a, b in zip(logits, ours)]


register(SpeculatorsDFlash())
register(ZlabDFlash())
