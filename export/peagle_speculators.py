"""P-EAGLE <-> the speculators ``peagle`` format (vLLM auto-detects it from the config).

Checked against speculators 0.9.0 (``PEagleSpeculatorConfig``, ``PEagleDraftModel``): the
EAGLE-3 layout of ``eagle3_speculators.py`` (same tensor names, layer config, aux ids, vocab
maps, EAGLE-3.1 ``fc_norm``) plus

* ``mask_hidden`` [1, 1, n_aux * H]: the fused-feature input of the mask slots, which
  speculators (like draftlab) feeds through ``fc_norm`` and ``fc`` as a real feature; an input
  scale draftlab trains with is folded into ``fc.weight`` and so applies to it too;
* ``mask_token_id`` and ``embed_requires_grad`` in the config; the drafter's own trained
  embedding (draftlab ``token_embedding``) is written as ``embed_tokens.weight``, and a drafter
  sharing the target's frozen one writes none (vLLM and speculators then take the verifier's);
* ``speculators_config``'s ``speculative_tokens``: the slots drafted per forward (speculators
  writes ``num_depths`` there), at most the drafter's ``parallel_depth``;
* ``norm_output`` is always false: no slot reads another's output state.
"""

from __future__ import annotations

from draftlab.errors import DraftlabError
from draftlab.export.eagle3_speculators import SpeculatorsEagle3
from draftlab.export.formats import ExportOptions, register, speculators_config


class SpeculatorsPEagle(SpeculatorsEagle3):
    name = "speculators-peagle"
    algorithm = "peagle"
    engines = ("vllm",)
    renames = (("token_embedding.", "embed_tokens."),)
    title = "speculators `peagle` format (vLLM P-EAGLE, `PEagleSpeculator`)"

    def export_config(self, drafter, target, meta, opts: ExportOptions) -> dict:
        K = drafter.parallel_depth
        if opts.speculative_tokens > K:
            raise DraftlabError(f"--num-speculative-tokens {opts.speculative_tokens} exceeds the drafts this drafter makes per "
                                f"forward (parallel_depth = {K}); pass at most {K}")
        return {
            **super().export_config(drafter, target, meta, opts),
            "architectures": ["PEagleSpeculator"],
            "speculators_model_type": "peagle",
            "speculators_config": speculators_config("peagle", opts.speculative_tokens, target, opts),
            "norm_output": False,
            "mask_token_id": drafter.mask_token_id,
            "embed_requires_grad": drafter.token_embedding is not None,
        }

    def serving(self, out, target_name, opts, config):
        k = config["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
        return (
            f"```bash\nvllm serve {out}\n```\n(vLLM reads the verifier from `speculators_config` and detects P-EAGLE from "
            f"`speculators_model_type: peagle`), or next to the target: `--speculative-config "
            f"'{{\"model\": \"{out}\", \"num_speculative_tokens\": {k}}}'`."
        )

    def notes(self, drafter, config):
        emb = ("`embed_tokens.weight` is the drafter's own trained embedding (`embed_requires_grad: true`)."
               if config["embed_requires_grad"] else "No `embed_tokens.weight`: the drafter uses the verifier's frozen embedding.")
        return [
            f"`eagle_aux_hidden_state_layer_ids = {config['eagle_aux_hidden_state_layer_ids']}`: HF `hidden_states` indices "
            "(the input of decoder layer i), draftlab's `aux_layers` - no shift.",
            f"Parallel drafting: slot 1 is the EAGLE-3 step, slots 2..{drafter.parallel_depth} read `mask_token_id = "
            f"{config['mask_token_id']}` and the learned `mask_hidden`; all from one forward.",
            emb,
            "`norm_before_residual: false` is written explicitly (vLLM defaults a missing key to true).",
        ]

    # ---- import -----------------------------------------------------------------
    def import_meta(self, config, tensors, target):
        where = "speculators peagle config.json"
        if config.get("speculators_model_type") != "peagle":
            raise DraftlabError(f"{where}: speculators_model_type is {config.get('speculators_model_type')!r}, expected 'peagle'")
        if config.get("norm_output", False) is not False:
            raise DraftlabError(f"{where}: norm_output = {config['norm_output']!r}; draftlab's P-EAGLE feeds no output state back")
        # the EAGLE-3 part (layers, aux ids, vocab maps, fc_norm) reads exactly as an eagle3 config does
        meta = super().import_meta({**config, "speculators_model_type": "eagle3"}, tensors, target)
        del meta["norm_output"]
        try:
            k = config["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
        except (KeyError, IndexError, TypeError):
            raise DraftlabError(f"{where}: speculators_config.proposal_methods[0].speculative_tokens (the parallel depth) is missing") from None
        mask = config.get("mask_token_id")
        if mask is None:
            raise DraftlabError(f"{where}: mask_token_id is missing")
        # a checkpoint with an embedding trained its own; one without shares the verifier's
        return {**meta, "parallel_depth": k, "mask_token_id": mask, "train_embedding": "token_embedding.weight" in tensors}


register(SpeculatorsPEagle())
