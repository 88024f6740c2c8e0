"""Domino drafters <-> SpecForge's / SGLang's Domino layout (``--to sglang``, import ``--format
specforge-domino``).

The z-lab DFlash layout of export/dflash.py (Qwen3 config, ``block_size``, ``num_target_layers``,
``dflash_config.{target_layer_ids, mask_token_id}``; tensors ``layers.*``, ``fc``,
``hidden_norm``, ``norm``; no lm_head: the target's reads the drafter out) plus:

* config: ``architectures: ["DominoDraftModel"]``; in ``dflash_config`` ``projector_type:
  "domino"``, ``gru_hidden_dim``, ``emb_dim``, ``pure_draft_prefix_len`` and ``shift_label:
  false`` (draftlab's block holds the anchor in slot 0 and slot k predicts token p + k, SpecForge's
  unshifted alignment; its public Qwen3-8B config uses the shifted one); ``emb_dim`` also at the
  top level, where SGLang reads it too (and refuses one that differs);
* tensors: draftlab's names, which are SpecForge's and SGLang's: ``prefix_gru.weight_ih_l0``,
  ``prefix_gru.weight_hh_l0``, ``embed_proj.0.weight``, ``embed_proj.2.weight``.

Checked against SpecForge 0.2.0 ``modeling/draft/domino.py`` (installed; the test-suite and
``export --check`` load the export strictly in its ``DominoDraftModel`` and draft with its own
``_sample_draft_tokens``) and its ``configs/qwen3-8b-domino.json``. SGLang was read, not run (no
GPU build here): ``srt/speculative/domino_utils.py`` @04d4c1a (``domino_greedy_rollout``: the
first draft is the base argmax, the GRU reads [verified, first draft], shift_label false reads
slots 1..; CUDA, TP 1 or sharded vocabularies, bf16 weights) and an SGLang Domino unit test as
the code index holds it (``parse_dflash_draft_config`` refuses a ``pure_draft_prefix_len`` other
than 1, a non-bool ``shift_label``, a missing ``gru_hidden_dim`` or ``emb_dim``;
``DFlashDraftModel.load_weights`` requires each of the four tensors above at its shape). The
model file of SGLang PR #36899 itself was not in the index. SGLang's rollout by default takes each
corrected argmax among a 2048-token candidate pool of the base logits (exact when the argmax lies
in it); draftlab's is over the whole vocabulary.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from draftlab.errors import DraftlabError
from draftlab.export.check import PeerProposer, max_diff
from draftlab.export.dflash import ZlabDFlash, _int, specforge_model
from draftlab.export.formats import ExportOptions, register

DOMINO_KEYS = ("projector_type", "gru_hidden_dim", "emb_dim", "pure_draft_prefix_len", "shift_label")
SGLANG_PREFIX_LEN = 1  # the only pure_draft_prefix_len SGLang's rollout serves


class SpecForgeDomino(ZlabDFlash):
    name = "specforge-domino"
    algorithm = "domino"
    engines = ("sglang",)
    title = "SpecForge Domino layout (SGLang `--speculative-algorithm DFLASH`, `projector_type: domino`)"

    def check_exportable(self, drafter, target) -> None:
        if drafter.draft_vocab_size < drafter.vocab_size:
            raise DraftlabError(
                f"--to sglang: the Domino layout reads out (and corrects) the target's whole vocabulary and this drafter has a "
                f"reduced draft vocabulary ({drafter.draft_vocab_size} of {drafter.vocab_size}); train with drafter.draft_vocab_size=0"
            )
        if drafter.pure_draft_prefix_len != SGLANG_PREFIX_LEN:
            raise DraftlabError(
                f"--to sglang: SGLang's Domino rollout serves pure_draft_prefix_len {SGLANG_PREFIX_LEN} only, this drafter has "
                f"{drafter.pure_draft_prefix_len}; train with drafter.pure_draft_prefix_len={SGLANG_PREFIX_LEN}"
            )
        super().check_exportable(drafter, target)

    def export_config(self, drafter, target, meta, opts: ExportOptions) -> dict:
        config = super().export_config(drafter, target, meta, opts)
        m = drafter.meta()
        config["architectures"] = ["DominoDraftModel"]
        config["dflash_config"].update({
            "projector_type": "domino", "gru_hidden_dim": m["gru_hidden_dim"], "emb_dim": m["emb_dim"],
            "pure_draft_prefix_len": m["pure_draft_prefix_len"], "shift_label": False,
        })
        config["emb_dim"] = m["emb_dim"]
        return config

    def serving(self, out, target_name, opts, config):
        return (
            f"```bash\npython -m sglang.launch_server --model-path {target_name} --speculative-algorithm DFLASH \\\n"
            f"  --speculative-draft-model-path {out} --speculative-num-draft-tokens {config['block_size']}\n```\n"
            "(SGLang's Domino path runs on CUDA with bf16 weights: export with `--dtype bfloat16`.)"
        )

    def notes(self, drafter, config):
        dc = config["dflash_config"]
        return [
            *super().notes(drafter, config),
            f"Domino correction: GRU of width {dc['gru_hidden_dim']} over the target's embedding of the block's previous tokens, "
            f"`embed_proj` of width {dc['emb_dim']} added to the base logits from draft position {dc['pure_draft_prefix_len']} on.",
            "`shift_label: false`: slot 0 holds the verified token and slot k drafts token k (SpecForge's public Qwen3-8B "
            "Domino config is shift_label true, another backbone alignment).",
        ]

    # ---- served equals trained (export/check.py) ------------------------------------
    def detect(self, config):
        dc = config.get("dflash_config")
        return isinstance(dc, dict) and dc.get("projector_type") == "domino" and "speculators_model_type" not in config

    def peer_proposer(self, out, config, drafter, target):
        try:
            from specforge.modeling.draft import domino as specforge_domino
        except ImportError:
            return None
        return SpecForgeDominoPeer(out, config, drafter, target, specforge_domino)

    # ---- import -----------------------------------------------------------------
    def import_meta(self, config, tensors, target):
        where = "SpecForge domino config.json"
        arch = (config.get("architectures") or [None])[0]
        if arch != "DominoDraftModel":
            raise DraftlabError(f"{where}: architectures[0] is {arch!r}, expected 'DominoDraftModel'")
        dc = config.get("dflash_config")
        if not isinstance(dc, dict):
            raise DraftlabError(f"{where}: missing dflash_config (a dict)")
        if dc.get("projector_type") != "domino":
            raise DraftlabError(f"{where}: dflash_config.projector_type is {dc.get('projector_type')!r}, expected 'domino'")
        if dc.get("shift_label", False) is not False:
            raise DraftlabError(f"{where}: dflash_config.shift_label is {dc['shift_label']!r}; draftlab's block is unshifted "
                                "(slot 0 holds the verified token, slot k drafts token k)")
        emb = _int(dc.get("emb_dim", config.get("emb_dim")), where, "dflash_config.emb_dim", 1)
        if config.get("emb_dim", emb) != emb:
            raise DraftlabError(f"{where}: emb_dim {config['emb_dim']!r} differs from dflash_config.emb_dim {emb}")
        gru = _int(dc.get("gru_hidden_dim"), where, "dflash_config.gru_hidden_dim", 1)
        prefix = _int(dc.get("pure_draft_prefix_len", 0), where, "dflash_config.pure_draft_prefix_len", 0)
        # the rest is the z-lab DFlash backbone: its checks and meta
        backbone = {k: v for k, v in config.items() if k != "emb_dim"}
        backbone["architectures"] = ["DFlashDraftModel"]
        backbone["dflash_config"] = {k: v for k, v in dc.items() if k not in DOMINO_KEYS}
        meta = super().import_meta(backbone, tensors, target)
        return {**meta, "gru_hidden_dim": gru, "emb_dim": emb, "pure_draft_prefix_len": prefix}


class SpecForgeDominoPeer(PeerProposer):
    """Drafts with SpecForge 0.2.0's ``DominoDraftModel`` built from the export's config.json,
    weights loaded strictly: its ``forward`` over the block ``[last, MASK...]`` embedded with the
    target's embedding (the context read as z-lab reads it, HF ``hidden_states[id + 1]``), then its
    own ``_sample_draft_tokens`` (greedy): the block's positions left to right, each corrected
    by ``apply_logits_head`` over the drafts before it. draftlab's logits are compared on the same
    previous tokens (the peer's drafts)."""

    peer = "SpecForge DominoDraftModel"
    shapes = frozenset({"block"})

    def __init__(self, out, config, drafter, target, module):
        from specforge.modeling.draft.dflash import extract_context_feature

        m = specforge_model(out, config, module.DominoDraftModel)
        super().__init__(sorted({i + 1 for i in m.target_layer_ids} | set(drafter.capture_layers)), drafter)
        self.model, self.extract, self.target = m, extract_context_feature, target
        self.mask, self.G = config["dflash_config"]["mask_token_id"], config["block_size"]
        # what _sample_draft_tokens reads of the target: its lm_head and its embedding
        self.heads = SimpleNamespace(lm_head=lambda h: target.lm_head(h).float(),
                                     model=SimpleNamespace(embed_tokens=lambda i: target.embed_tokens(i).float()))

    def draft(self, k):
        m, t, N, G = self.model, self.target, self.ids.numel() - 1, self.G
        block = torch.full((1, G), self.mask, dtype=torch.long)
        block[0, 0] = self.ids[-1]
        ctx = self.extract(self.hidden, m.target_layer_ids)  # indexed as HF's hidden_states tuple
        h = m(position_ids=torch.arange(N + G)[None], noise_embedding=t.embed_tokens(block).float(), target_hidden=ctx)
        drafts = m._sample_draft_tokens(self.heads, h, block)[0, :k]
        done = torch.cat([block[:, :1], drafts[None]], 1)
        logits = m.apply_logits_head(self.heads.lm_head(h)[:, None, : k + 1], hidden_states=h[:, None, : k + 1],
                                     prev_token_embeddings=self.heads.model.embed_tokens(done)[:, None])[0, 0, 1:]
        d = self.drafter
        kv = d.context_kv(d.context(self.hidden), torch.arange(N)[None])
        states = d.block_states(d.block_ids(self.ids[-1:]), torch.arange(N, N + G)[None], kv, torch.ones(1, G, N + G, dtype=torch.bool))
        ours = d.slot_logits(states[0, 1 : 1 + k], done[0, :k])
        return drafts.tolist(), [max_diff(a, b) for a, b in zip(logits, ours)]


register(SpecForgeDomino())
