"""``--to hf``: draftlab's own layout for the Hugging Face Hub.

The directory is a draftlab checkpoint (``model.safetensors`` + ``draftlab.json``, written by the
one checkpoint writer, so ``draftlab eval --drafter`` and fine-tuning read it as is) without the
trainer state, plus a ``config.json`` describing the drafter for the Hub and a model card.
"""

from __future__ import annotations

from draftlab.errors import DraftlabError
from draftlab.export.formats import ExportOptions, Format, register


class DraftlabLayout(Format):
    name = ""  # already a draftlab checkpoint: nothing to import
    algorithm = "*"
    engines = ("hf",)
    title = "draftlab checkpoint layout (read by `draftlab eval` / `draftlab import` / training)"

    def export_config(self, drafter, target, meta, opts: ExportOptions) -> dict:
        algo = meta["algorithm"]
        return {
            "architectures": [f"Draftlab{algo.capitalize()}Drafter"],
            "model_type": "draftlab-drafter",
            "draftlab_algorithm": algo,
            "drafter": meta["drafter"],
            "target": meta["target"],
        }

    def save(self, tmp, drafter, target, meta, opts: ExportOptions) -> None:
        from draftlab.atomic import write_json
        from draftlab.checkpoint import save_weights

        if opts.dtype:
            raise DraftlabError("--dtype: --to hf keeps the stored dtype (draftlab casts to the target's dtype on load)")
        save_weights(tmp, drafter.export_state_dict(), {k: v for k, v in meta.items() if k != "format"})
        write_json(tmp / "config.json", self.export_config(drafter, target, meta, opts))

    def detect(self, config):
        return config.get("model_type") == "draftlab-drafter"

    def serving(self, out, target_name, opts, config):
        return f"```bash\ndraftlab eval --drafter {out} --target {target_name}\n```"


register(DraftlabLayout())
