"""Medusa-2 -> vLLM's ``MedusaModel`` layout: the heads only, through Medusa-1's format.

A Medusa-2 checkpoint holds heads and LoRA adapters. vLLM's Medusa proposer loads heads alone and
reads the hidden states of the model it serves, so the adapters belong in that model: serve the
*merged* target (``models.medusa2.export_merged_target`` writes it beside these heads as
``../target``). The heads' tensors, config and reduced-vocabulary ``token_map`` are exactly
Medusa-1's (``export/medusa.py``: ``VllmMedusa``). Export only: importing vLLM Medusa heads gives
a Medusa-1 drafter (``--format medusa-vllm``), there are no adapters to read back.
"""

from __future__ import annotations

from draftlab.export.formats import register
from draftlab.export.medusa import VllmMedusa


class VllmMedusa2(VllmMedusa):
    name = ""  # export only
    algorithm = "medusa2"
    engines = ("vllm",)
    title = "vLLM `MedusaModel` layout (Medusa-2 heads; serve them on the merged target)"

    def export_state(self, drafter, target):
        return super().export_state(drafter.medusa_heads(), target)  # heads, blocks, token_map: no LoRA tensor

    def serving(self, out, target_name, opts, config):
        merged = opts.verifier or "MERGED_TARGET_DIR"
        return (
            super().serving(out, merged, opts, config)
            + "\n\nServe the heads on the Medusa-2 *merged* target (base weights + LoRA), the model they were trained on: "
            f"`models.medusa2.export_merged_target` writes it beside these heads. On the original `{target_name}` vLLM still "
            "returns the original's outputs, with lower acceptance."
        )

    def notes(self, drafter, config):
        return super().notes(drafter, config) + [
            f"Medusa-2: trained jointly with LoRA adapters (r {drafter.lora_r}, alpha {drafter.lora_alpha} on "
            f"{', '.join(drafter.lora_targets)}); the adapters are not in this directory: they are merged into the target to serve."
        ]


register(VllmMedusa2())
