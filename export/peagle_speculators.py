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
* ``norm_output`` is always false (no slot reads another's output state), and so are
  ``norm_before_fc`` and ``norm_before_residual``, which draftlab's P-EAGLE does not implement.

``draftlab check`` / ``export --check`` load the export with speculators' ``PEagleDraftModel``
and draft greedy chains with its own forward (:class:`SpeculatorsPEaglePeer`).
"""

from __future__ import annotations

import contextlib

import torch

from draftlab.errors import DraftlabError
from draftlab.export.check import PeerProposer, max_diff
from draftlab.export.eagle3_speculators import SpeculatorsEagle3
from draftlab.export.formats import ExportOptions, register, speculators_config
from draftlab.models.peagle import EAGLE3_ONLY


class SpeculatorsPEaglePeer(PeerProposer):
    """Drafts with speculators' ``PEagleDraftModel`` built from the export's config.json, weights
    loaded strictly (the verifier's norm/head, unused to draft, and a shared embedding are the
    target's or its own, as speculators fills them), through its own P-EAGLE ``forward``.

    That forward is its training one: it lays out the slots COD sampling draws (anchor, depth)
    and runs them under its P-EAGLE attention. For a draft the layout is pinned to depth 0 at
    every kept position plus depths 1..k-1 anchored at the last one (its mask slots at
    positions N..N+k-2): slot 1 is the depth-0 output at N - 1, slot j >= 2 the mask slot at
    depth j - 1 -- all k drafts from one forward, as vLLM drafts them. draftlab's logits are its
    training forward's (``parallel_forward``) on the same slots."""

    peer = "speculators PEagleDraftModel"

    def __init__(self, out, drafter, target, config_cls, core):
        from draftlab.checkpoint import read_weights

        super().__init__(drafter.capture_layers, drafter)
        cfg = config_cls.from_pretrained(str(out))
        cfg.transformer_layer_config._attn_implementation = "sdpa"  # flex attention has no CPU path here
        m = core.PEagleDraftModel(cfg)
        state = {k: v.float() if v.is_floating_point() else v for k, v in read_weights(out / "model.safetensors").items()}
        if not cfg.embed_requires_grad:  # no embedding of its own: the verifier's
            state.setdefault("embed_tokens.weight", target.embed_tokens.weight.detach().float().cpu())
        for k in ("verifier_norm.weight", "verifier_lm_head.weight"):  # training targets only
            state.setdefault(k, m.state_dict()[k])
        if m.d2t is None:  # a full vocabulary: speculators' model has no maps (and ignores identity ones)
            state.pop("d2t", None), state.pop("t2d", None)
        try:
            m.load_state_dict(state, strict=True)
        except RuntimeError as e:
            raise DraftlabError(f"{out}: speculators' PEagleDraftModel does not load the weights ({str(e).splitlines()[1].strip()})") from None
        self.model, self.core, self.aux = m.float().eval(), core, list(cfg.eagle_aux_hidden_state_layer_ids)
        from speculators.losses import resolve_loss_config

        self.loss = resolve_loss_config("kl_div", "eager")  # its forward computes a loss; the fused one is a GPU kernel

    @contextlib.contextmanager
    def _layout(self, anchor, depth):
        """Pin speculators' COD draw (a module global its forward calls) to ``anchor``/``depth``."""
        core, draw = self.core, self.core.generate_cod_sample_indices
        core.generate_cod_sample_indices = lambda **kw: (anchor, depth)
        try:
            yield
        finally:
            core.generate_cod_sample_indices = draw

    def draft(self, k):
        m, N = self.model, self.ids.numel() - 1
        T = N + k - 1  # the mask slots' positions follow the kept ones; their inputs are the mask's
        anchor = torch.cat([torch.arange(N), torch.full((k - 1,), N - 1)])
        depth = torch.cat([torch.zeros(N, dtype=torch.long), torch.arange(1, k)])
        hidden = self.padded(k - 1)
        H = hidden[self.aux[0]].shape[-1]
        tokens = torch.cat([self.ids[1:], torch.zeros(k - 1, dtype=torch.long)])[None]  # position t pairs f_t with x_{t+1}
        logits = []
        hook = m.lm_head.register_forward_hook(lambda mod, args, o: logits.append(o[0]))
        try:
            with self._layout(anchor, depth):
                m(hidden_states=torch.cat([hidden[i] for i in self.aux], -1), input_ids=tokens, document_ids=torch.zeros_like(tokens),
                  verifier_last_hidden_states=torch.zeros(1, T, H),  # its loss's targets only
                  num_depths=k, loss_config=self.loss)
        finally:
            hook.remove()
        theirs = logits[0][N - 1 :]  # slot 1, then the mask slots in depth order
        d = theirs.argmax(-1)  # draft-vocabulary ids; the engine feeds on target ids, through d2t
        if m.d2t is not None:
            d = d + m.d2t[d]
        ours = peagle_reference(self.drafter, self.ids, self.padded(1), k)
        return d.tolist(), [max_diff(a, b) for a, b in zip(theirs, ours)]


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

    # ---- served equals trained (export/check.py) ------------------------------------
    speculators_type = "peagle"
    peer_adapter = SpeculatorsPEaglePeer
    peer_model = ("speculators.models.peagle.core", None)

    # ---- import -----------------------------------------------------------------
    def import_meta(self, config, tensors, target):
        where = self.where
        self.check_type(config)
        if config.get("norm_output", False) is not False:
            raise DraftlabError(f"{where}: norm_output = {config['norm_output']!r}; draftlab's P-EAGLE feeds no output state back")
        on = [f for f in EAGLE3_ONLY if config.get(f, False)]  # speculators' P-EAGLE has them, draftlab's does not
        if on:
            raise DraftlabError(f"{where}: {', '.join(on)} = true is not implemented by draftlab's P-EAGLE")
        # the EAGLE-3 part (layers, aux ids, vocab maps, fc_norm) reads exactly as an eagle3 config does
        meta = {k: v for k, v in super().import_meta(config, tensors, target).items() if k not in EAGLE3_ONLY}
        try:
            k = config["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
        except (KeyError, IndexError, TypeError):
            raise DraftlabError(f"{where}: speculators_config.proposal_methods[0].speculative_tokens (the parallel depth) is missing") from None
        mask = config.get("mask_token_id")
        if mask is None:
            raise DraftlabError(f"{where}: mask_token_id is missing")
        # a checkpoint with an embedding trained its own; one without shares the verifier's
        return {**meta, "parallel_depth": k, "mask_token_id": mask, "train_embedding": "token_embedding.weight" in tensors}



def peagle_reference(drafter, ids, hidden, k):
    """draftlab's slot logits [k, V_draft] after ``ids`` (N + 1 tokens; ``hidden``: N + 1
    positions, the last a pad): its training forward with every depth anchored at N - 1."""
    N = ids.numel() - 1
    with torch.no_grad():
        out = drafter.parallel_forward(ids[None], hidden, [torch.tensor([N - 1])] * (k - 1))
        return drafter.head(torch.cat([out[0][N - 1 : N], *out[1:]]))


register(SpeculatorsPEagle())
