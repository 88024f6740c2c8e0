"""Proposer for Medusa-2 drafters: Medusa-1's (``inference/medusa.py``: each head's top-1 as a
chain, or each head's top-K in a static tree), run on the drafter's heads alone.

The heads read the verifying target's last kept ``hidden[L]``. A Medusa-2 drafter's heads were
trained on the *adapted* target's states, so its :meth:`verifier` is the merged target (the
original with the checkpoint's adapters merged, ``Medusa2Drafter.merged_target``): drafts are
verified by, and the output is exactly, the merged model's. Its :meth:`verifier_report` puts
:func:`greedy_divergence` in every evaluation report: how far that model moved from the original.
"""

from __future__ import annotations

import torch

from draftlab.errors import DraftlabError
from draftlab.inference.decoder import generate_plain
from draftlab.inference.medusa import MedusaProposer
from draftlab.inference.proposer import PROPOSERS, ChangesVerifier


@PROPOSERS.register("medusa2")
class Medusa2Proposer(MedusaProposer, ChangesVerifier):
    def __init__(self, drafter, trained_depth: int | None = None):
        super().__init__(drafter.medusa_heads(), trained_depth)  # the LoRA adapters play no part in drafting
        self.name = drafter.algorithm
        self._adapted, self._merged = drafter, None

    def verifier(self, target):
        """The original ``target`` with this drafter's adapters merged (built once)."""
        if self._merged is None:
            self._merged = self._adapted.merged_target(target)
        return self._merged

    def verifier_report(self, target, prompts, max_new_tokens: int, eos_token_id=None) -> dict:
        """Decoding is lossless with respect to the merged target, not ``target``: how far the
        merged target's greedy outputs moved from the original's on the same prompts."""
        moved = greedy_divergence(target, self.verifier(target), prompts, max_new_tokens, eos_token_id)
        return {"lossless_with_respect_to": "the merged target (original + this checkpoint's LoRA adapters)",
                "divergence_from_original": moved}


def greedy_divergence(base_target, merged, prompts, max_new_tokens: int = 64, eos_token_id=None) -> dict:
    """How far ``merged``'s greedy continuations moved from ``base_target``'s on ``prompts``
    (``EvalPrompt``s or token-id lists): per prompt, both decode greedily and the first position
    where they differ is found; every token from there on counts as differing (a divergence
    changes everything after it). ``share_prompts_differ``: prompts whose continuation is not
    identical; ``share_tokens_differ``: tokens from the first divergence on, over all tokens
    (per prompt, the longer of the two continuations). ``top1_agreement``: teacher-forced on
    the original's continuation, the share of its tokens that are also ``merged``'s argmax at
    that position (how often the models disagree, without one flip counting everything after it)."""
    per = []
    agree = forced = 0
    for p in prompts:
        ids = getattr(p, "prompt_ids", p)
        a = generate_plain(base_target, ids, max_new_tokens, eos_token_id=eos_token_id).tokens
        b = generate_plain(merged, ids, max_new_tokens, eos_token_id=eos_token_id).tokens
        prefix = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        n = max(len(a), len(b))
        per.append({"first_divergence": None if a == b else prefix, "tokens": n, "tokens_differ": n - prefix})
        with torch.no_grad():
            logits = merged(torch.tensor([list(ids) + a[:-1]], device=merged.device), logits="all").logits[0, len(ids) - 1 :]
        agree += int((logits.argmax(-1).cpu() == torch.tensor(a)).sum())
        forced += len(a)
    if not per:
        raise DraftlabError("greedy_divergence needs at least one prompt")
    differ = sum(r["first_divergence"] is not None for r in per)
    tokens, after = sum(r["tokens"] for r in per), sum(r["tokens_differ"] for r in per)
    return {
        "num_prompts": len(per),
        "max_new_tokens": max_new_tokens,
        "prompts_differ": differ,
        "share_prompts_differ": differ / len(per),
        "tokens": tokens,
        "tokens_differ": after,
        "share_tokens_differ": after / max(tokens, 1),
        "top1_agreement": agree / max(forced, 1),
        "per_prompt": per,
    }
