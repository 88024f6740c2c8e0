"""Medusa-2 -> vLLM's ``MedusaModel`` layout: the heads only, through Medusa-1's format.

A Medusa-2 checkpoint holds heads and LoRA adapters. vLLM's Medusa proposer loads heads alone and
reads the hidden states of the model it serves, so the adapters belong in that model: serve the
*merged* target (:func:`export_merged_target` writes it beside these heads as ``../target``). The
heads' tensors, config and reduced-vocabulary ``token_map`` are exactly Medusa-1's
(``export/medusa.py``: ``VllmMedusa``). Export only: importing vLLM Medusa heads gives a Medusa-1
drafter (``--format medusa-vllm``), there are no adapters to read back.
"""

from __future__ import annotations

from pathlib import Path

from draftlab import atomic
from draftlab.checkpoint import load_drafter, read_meta
from draftlab.errors import DraftlabError
from draftlab.export.exporter import check_out_dir, default_speculative_tokens, export_checkpoint, load_target
from draftlab.export.formats import ExportOptions, register
from draftlab.export.medusa import VllmMedusa


class VllmMedusa2(VllmMedusa):
    name = ""  # export only
    algorithm = "medusa2"
    engines = ("vllm",)
    title = "vLLM `MedusaModel` layout (Medusa-2 heads; serve them on the merged target)"

    def detect(self, config):
        return super().detect(config)  # Medusa-1's vLLM config: a Medusa-2 checkpoint tells them apart

    def export_state(self, drafter, target):
        return super().export_state(drafter.medusa_heads(), target)  # heads, blocks, token_map: no LoRA tensor

    def serving(self, out, target_name, opts, config):
        merged = opts.verifier or "MERGED_TARGET_DIR"
        return (
            super().serving(out, merged, opts, config)
            + "\n\nServe the heads on the Medusa-2 *merged* target (base weights + LoRA), the model they were trained on: "
            f"`export.medusa2.export_merged_target` writes it beside these heads. On the original `{target_name}` vLLM still "
            "returns the original's outputs, with lower acceptance."
        )

    def notes(self, drafter, config):
        return super().notes(drafter, config) + [
            f"Medusa-2: trained jointly with LoRA adapters (r {drafter.lora_r}, alpha {drafter.lora_alpha} on "
            f"{', '.join(drafter.lora_targets)}); the adapters are not in this directory: they are merged into the target to serve."
        ]


register(VllmMedusa2())


# ============================================================================ the merged target

MERGED_DIR, HEADS_DIR = "target", "medusa"


def export_merged_target(checkpoint_dir, base_target, out_dir, overwrite: bool = False) -> Path:
    """Write, atomically, ``out_dir/target``: the merged model as a Hugging Face model
    (``save_pretrained``, safetensors, with the tokenizer), and ``out_dir/medusa``: the heads in
    vLLM's Medusa layout (:class:`VllmMedusa2`), whose model card serves them on the merged model.
    ``base_target`` is a loaded ``Target`` or a target spec."""
    out = Path(out_dir)
    check_out_dir(out, overwrite)
    base_target = load_target(base_target)
    meta = read_meta(checkpoint_dir)
    if meta["algorithm"] != VllmMedusa2.algorithm:  # only Medusa-2 has adapters to merge
        raise DraftlabError(f"{checkpoint_dir}: a {meta['algorithm']} checkpoint, not {VllmMedusa2.algorithm}")
    drafter, _ = load_drafter(checkpoint_dir, base_target)
    model = drafter.merged_hf_model(base_target)
    with atomic.directory(out) as tmp:
        model.save_pretrained(tmp / MERGED_DIR)
        base_target.tokenizer.save_pretrained(tmp / MERGED_DIR)
        atomic.write_json(tmp / MERGED_DIR / "draftlab_merge.json", {
            "merged_from": str(checkpoint_dir), "base_target": base_target.identity,
            "lora": {"r": drafter.lora_r, "alpha": drafter.lora_alpha, "targets": drafter.lora_targets},
        })
        opts = ExportOptions(speculative_tokens=min(default_speculative_tokens(meta), drafter.num_heads), verifier=str(out / MERGED_DIR))
        heads = export_checkpoint(checkpoint_dir, "vllm", tmp / HEADS_DIR, base_target, opts)
        card = heads / "README.md"  # it names the directory it was written to: the staging one
        atomic.write_text(card, card.read_text().replace(str(tmp), str(out)))
    return out
