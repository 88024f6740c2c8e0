"""DSpark drafters <-> speculators' ``dspark`` format (vLLM ``"method": "dspark"``, SGLang ``DSPARK``).

speculators 0.9's ``DSparkSpeculatorConfig`` is its DFlash config plus the heads' fields, and
``DSparkDraftModel`` its DFlash model plus ``markov_head`` and ``confidence_head``; so this is
export/dflash.py's speculators layout (same backbone tensors, same vocabulary rules) with:

* config: ``speculators_model_type: "dspark"``, ``architectures: ["DSparkDraftModel"]``,
  ``speculators_config.algorithm: "dspark"``, ``markov_rank``, ``markov_head_type``
  (vanilla | gated), ``enable_confidence_head: true``, ``confidence_head_with_markov: true``
  (draftlab's confidence head reads [state; W1[prev]]), and ``sample_from_anchor: false``
  written explicitly: DSpark's default is true (slot 0 drafts too), draftlab's block holds the
  anchor in slot 0, so slot k's previous token is the block token k - 1, which is what
  speculators' forward reads when the flag is false;
* tensors: draftlab's names, which are speculators' (``markov_head.markov_w1.weight`` [V, r]
  indexed by target ids, ``markov_head.markov_w2.weight`` [V_draft, r],
  ``markov_head.gate_proj.{weight,bias}`` for gated, ``confidence_head.proj.{weight,bias}``).

Checked against speculators 0.9.0 (``models/dspark/{config,core,model_definitions}.py``): the
test-suite loads the export with ``DSparkDraftModel.from_pretrained`` (no missing, unexpected or
mismatched keys) and compares its biased block logits and confidences with draftlab's. SGLang's
DSPARK loader reads this same speculators config (SGLang's DSpark documentation); its code
was not read or run here, and neither was vLLM's: whether either honours ``sample_from_anchor:
false`` for dspark is unverified (speculators' own forward does).

``draftlab check`` / ``export --check`` draft whole blocks with ``DSparkDraftModel``'s modules,
left to right through its Markov head (:class:`SpeculatorsDSparkPeer`).
"""

from __future__ import annotations

import torch

from draftlab.errors import DraftlabError
from draftlab.export.check import max_diff
from draftlab.export.dflash import SpeculatorsDFlash, SpeculatorsDFlashPeer
from draftlab.export.formats import ExportOptions, register, speculators_config
from draftlab.models.dspark import MARKOV_KINDS


class SpeculatorsDSparkPeer(SpeculatorsDFlashPeer):
    """Drafts with speculators' ``DSparkDraftModel`` (loaded as its DFlash backbone is, strictly,
    the heads from the export): its modules run the block ``[last, MASK...]`` after the context,
    then the slots are drafted left to right, slot j's logits the backbone's plus its
    ``markov_head.block_bias`` of the token drafted at slot j - 1 (the last kept token for slot
    1): the chain of k that verification sees. draftlab's logits are compared on the same
    previous tokens (the peer's drafts)."""

    peer = "speculators DSparkDraftModel"

    def draft(self, k):
        m = self.model
        h = self.block_states(k)
        base = m.lm_head(h)
        prev, drafts, logits = [int(self.ids[-1])], [], []
        for j in range(k):  # one slot at a time: slot j's bias reads the token drafted before it
            p = torch.tensor([[prev[-1]]])
            lj = base[:, j : j + 1] + m.markov_head.block_bias(prev_token_ids=p, hidden_states=h[:, j : j + 1])
            t = int(lj.argmax(-1))
            drafts.append(t + int(m.d2t[t]) if m.use_draft_vocab else t)
            logits.append(lj[0, 0])
            prev.append(drafts[-1])
        # draftlab's block over the same context, biased by the same previous tokens
        states = self.drafter.block_states(*self.our_block())[0, 1 : 1 + k]
        ours, _ = self.drafter.slot_logits(states, torch.tensor(prev[:k]))
        return drafts, [max_diff(a, b) for a, b in zip(logits, ours)]


class SpeculatorsDSpark(SpeculatorsDFlash):
    name = "speculators-dspark"
    algorithm = "dspark"
    engines = ("vllm", "sglang")
    title = "speculators `dspark` format (vLLM `\"method\": \"dspark\"`, SGLang `DSPARK`)"

    def export_config(self, drafter, target, meta, opts: ExportOptions) -> dict:
        heads = drafter.meta()
        return {
            **super().export_config(drafter, target, meta, opts),
            "architectures": ["DSparkDraftModel"],
            "speculators_model_type": "dspark",
            "speculators_config": speculators_config("dspark", drafter.block_size - 1, target, opts),
            "markov_rank": heads["markov_rank"],
            "markov_head_type": heads["markov_head_type"],
            "enable_confidence_head": True,
            "confidence_head_with_markov": True,
        }

    def serving(self, out, target_name, opts, config):
        k = config["block_size"] - 1
        return (
            f"vLLM:\n```bash\nvllm serve {target_name} --speculative-config "
            f"'{{\"model\": \"{out}\", \"method\": \"dspark\", \"num_speculative_tokens\": {k}}}'\n```\n"
            "(add `\"enable_adaptive_verification\": true` to verify shorter blocks by the confidence head).\n\n"
            f"SGLang:\n```bash\npython -m sglang.launch_server --model-path {target_name} --speculative-algorithm DSPARK \\\n"
            f"  --speculative-draft-model-path {out} --speculative-num-draft-tokens {config['block_size']}\n```"
        )

    def notes(self, drafter, config):
        return [
            *super().notes(drafter, config),
            f"Markov head: rank {config['markov_rank']} ({config['markov_head_type']}), `markov_w1` indexed by target-vocabulary "
            "ids of the previous block token; confidence head over [state; W1[prev]].",
            "`sample_from_anchor: false` (DSpark's default is true): slot 0 holds the anchor, slot k's previous token is block "
            "token k - 1. Check that the serving engine's DSpark path reads the flag.",
        ]

    # ---- served equals trained (export/check.py) ------------------------------------
    speculators_type = "dspark"
    peer_adapter = SpeculatorsDSparkPeer
    peer_model = ("speculators.models.dspark", "DSparkDraftModel")

    # ---- import -----------------------------------------------------------------
    def import_meta(self, config, tensors, target):
        where = self.where
        self.check_type(config)
        if config.get("sample_from_anchor", True):  # speculators' dspark default is true
            raise DraftlabError(f"{where}: sample_from_anchor is true (or unset: DSpark's default); draftlab's block holds the anchor in slot 0")
        rank = config.get("markov_rank", 256)
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise DraftlabError(f"{where}: markov_rank must be a positive integer (draftlab's DSpark has a Markov head), got {rank!r}")
        kind = config.get("markov_head_type", "vanilla")
        if kind not in MARKOV_KINDS:
            raise DraftlabError(f"{where}: markov_head_type {kind!r} is not implemented by draftlab (known: {', '.join(MARKOV_KINDS)})")
        for flag in ("enable_confidence_head", "confidence_head_with_markov"):
            if config.get(flag, True) is not True:
                raise DraftlabError(f"{where}: {flag} = {config[flag]!r}; draftlab's DSpark has a confidence head over [state; W1[prev]]")
        # the backbone is speculators' DFlash layout: its checks and meta (sample_from_anchor false included)
        meta = super().import_meta(config, tensors, target)
        return {**meta, "markov_rank": rank, "markov_head_type": kind}



register(SpeculatorsDSpark())
