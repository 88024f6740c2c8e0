"""Proposer for Medusa-2 drafters: Medusa-1's (``inference/medusa.py``: each head's top-1 as a
chain, or each head's top-K in a static tree), run on the drafter's heads alone.

The heads read the verifying target's last kept ``hidden[L]``. A Medusa-2 drafter's heads were
trained on the *adapted* target's states, so its :meth:`verifier` is the merged target (the
original with the checkpoint's adapters merged, ``models.medusa2.merged_hf_model``): drafts are
verified by, and the output is exactly, the merged model's.
"""

from __future__ import annotations

from draftlab.inference.medusa import MedusaProposer
from draftlab.inference.proposer import PROPOSERS


@PROPOSERS.register("medusa2")
class Medusa2Proposer(MedusaProposer):
    def __init__(self, drafter):
        super().__init__(drafter.medusa_heads())  # the LoRA adapters play no part in drafting
        self.name = drafter.algorithm
        self._adapted, self._merged = drafter, None

    def verifier(self, target):
        """The original ``target`` with this drafter's adapters merged (built once)."""
        if self._merged is None:
            from draftlab.models.medusa2 import merge

            self._merged = merge(self._adapted, target)
        return self._merged

    def verifier_report(self, target, prompts, max_new_tokens: int, eos_token_id=None) -> dict:
        """Decoding is lossless with respect to the merged target, not ``target``: how far the
        merged target's greedy outputs moved from the original's on the same prompts."""
        from draftlab.models.medusa2 import greedy_divergence

        moved = greedy_divergence(target, self.verifier(target), prompts, max_new_tokens, eos_token_id)
        return {"lossless_with_respect_to": "the merged target (original + this checkpoint's LoRA adapters)",
                "divergence_from_original": moved}
