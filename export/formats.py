"""The mapping interface between draftlab checkpoints and the layouts serving stacks load.

A :class:`Format` is one (algorithm, layout) pair: a table of tensor-name prefix renames, the
tensors the layout wants that draftlab does not store (``extra_tensors``), a config builder
(``export_config``) and its inverse (``import_meta``). Each mapping module calls
:func:`register` on its formats: by name for ``draftlab import --format`` and by (engine,
algorithm) for ``draftlab export --to``, so a new drafter family's layouts are its own module.

Strictness is the point: the set of tensor names a format produces and accepts is computed
from the drafter itself (its ``export_state_dict``) plus the declared extras, and anything
outside it is an error listing the names — serving loaders that skip unknown keys would
otherwise load random weights without a word.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from draftlab.atomic import write_bytes, write_json
from draftlab.errors import DraftlabError
from draftlab.registry import Registry, discover

IMPORT_FORMATS: Registry["Format"] = Registry("import format")  # `draftlab import --format` name -> format
EXPORTS: dict[tuple[str, str], "Format"] = {}  # (engine, algorithm) -> format


class ExportOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    speculative_tokens: int = Field(3, ge=1, description="drafts per step written into serving configs")
    dtype: Literal["float32", "bfloat16", "float16"] | None = Field(None, description="cast floating tensors; None = as stored")
    verifier: str | None = Field(None, description="verifier name_or_path in the config; default: the target's name")


def register(fmt: "Format") -> "Format":
    """Register a format instance, in the module that defines it."""
    if fmt.name:
        IMPORT_FORMATS.register(fmt.name)(fmt)
    for engine in fmt.engines:
        EXPORTS[(engine, fmt.algorithm)] = fmt
    return fmt


def engines() -> list[str]:
    """Every ``draftlab export --to`` value some registered format serves."""
    discover()
    return sorted({engine for engine, _ in EXPORTS})


def export_format(engine: str, algorithm: str) -> "Format":
    discover()
    fmt = EXPORTS.get((engine, algorithm)) or EXPORTS.get((engine, "*"))
    if fmt is None:
        known = sorted(e for e, a in EXPORTS if a in (algorithm, "*"))
        raise DraftlabError(f"--to {engine}: no export of {algorithm} drafters for {engine} (available: {', '.join(known) or 'none'})")
    return fmt


def import_format(name: str) -> "Format":
    return IMPORT_FORMATS.get(name, "--format")


def rename(name: str, rules) -> str:
    """First matching prefix rule wins; names no rule matches are unchanged."""
    for src, dst in rules:
        if name.startswith(src):
            return dst + name[len(src) :]
    return name


class Format:
    name: str = ""  # `draftlab import --format` name ("" = export only)
    algorithm: str = "*"  # drafter algorithm held ("*" = any)
    engines: tuple[str, ...] = ()  # `draftlab export --to` values served by this format
    renames: tuple[tuple[str, str], ...] = ()  # (draftlab prefix, format prefix)
    title: str = ""  # one line for the model card
    standalone: bool = False  # the layout holds a model that drafts from tokens alone (reads no target hidden state)

    # ---- names ------------------------------------------------------------------
    def to_format(self, name: str) -> str:
        return rename(name, self.renames)

    def from_format(self, name: str) -> str:
        return rename(name, [(b, a) for a, b in self.renames])

    # ---- export -----------------------------------------------------------------
    def check_exportable(self, drafter, target) -> None:
        """Raise DraftlabError when the layout cannot represent this drafter exactly."""

    def extra_tensors(self, drafter, target) -> dict[str, torch.Tensor]:
        """Tensors (format names) the layout wants that draftlab does not store."""
        return {}

    def export_config(self, drafter, target, meta: dict, opts: ExportOptions) -> dict:
        raise NotImplementedError

    def export_state(self, drafter, target) -> dict[str, torch.Tensor]:
        state = {self.to_format(k): v.detach().cpu() for k, v in drafter.export_state_dict().items()}
        extra = self.extra_tensors(drafter, target)
        clash = sorted(set(state) & set(extra))
        if clash:  # a mapping bug, not user input
            raise RuntimeError(f"{self.name}: extra tensors overwrite drafter tensors {clash}")
        return {**state, **{k: v.detach().cpu() for k, v in extra.items()}}

    def save(self, tmp: Path, drafter, target, meta: dict, opts: ExportOptions) -> None:
        """Write the layout's files (weights + config.json) into the staging directory."""
        from safetensors.torch import save

        state = self.export_state(drafter, target)
        if opts.dtype:
            dtype = getattr(torch, opts.dtype)
            state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
        write_bytes(tmp / "model.safetensors", save({k: v.contiguous() for k, v in state.items()}, metadata={"format": "pt"}))
        config = self.export_config(drafter, target, meta, opts)
        config["torch_dtype"] = opts.dtype or str(next(iter(drafter.parameters())).dtype).removeprefix("torch.")
        write_json(tmp / "config.json", config)

    def serving(self, out: str, target_name: str, opts: ExportOptions, config: dict) -> str:
        """Markdown: how to serve the exported directory (``config``: the config it wrote)."""
        return ""

    def notes(self, drafter, config: dict) -> list[str]:
        """Model-card bullets on what this layout does with the drafter (conventions, omissions)."""
        return []

    # ---- served equals trained (export/check.py) ----------------------------------
    # dotted config keys a user may set to anything without changing what is served (a
    # verifier path, say): ``draftlab check`` does not compare them with the checkpoint's
    free_keys: tuple[str, ...] = ()

    def served_config(self, out: Path) -> dict:
        """Every setting an engine reads from the export ``out``, as one dict: its config.json (a
        layout with more such files adds them under their file names)."""
        return read_config(out)

    def expected_config(self, drafter, target, meta: dict, opts: ExportOptions) -> dict:
        """What :meth:`served_config` must hold for this checkpoint and target."""
        return self.export_config(drafter, target, meta, opts)

    def detect(self, config: dict) -> bool:
        """Whether ``config`` (an export's config.json) is this layout: ``draftlab check`` finds
        an existing export's format so, among the formats of the checkpoint's algorithm."""
        return False

    def peer_proposer(self, out: Path, config: dict, drafter, target):
        """A :class:`~draftlab.export.check.PeerProposer` drafting with the peer's own model
        class loaded from the export ``out``, or None where no peer loader exists (the check
        then compares config and tensors only, and says so)."""
        return None

    # ---- import -----------------------------------------------------------------
    def read_tensors(self, src: Path) -> dict[str, torch.Tensor]:
        """Every tensor of the layout's directory ``src``, by the layout's names. Layouts with
        their own file names override this."""
        return read_tensors(src)

    def check_source(self, src: Path, config: dict, target) -> None:
        """Refuse (DraftlabError) what else the directory ``src`` holds that does not fit
        ``target`` (its tokenizer, say). Default: nothing else is read."""

    def import_meta(self, config: dict, tensors: dict[str, torch.Tensor], target) -> dict:
        """The drafter meta (``Drafter.from_meta``) a foreign config describes, validated
        against ``target``. ``tensors`` (already renamed to draftlab names) is edited in place:
        format-only tensors are checked and removed, redundant missing ones derived. Whatever
        is left must then match the drafter's state dict exactly."""
        raise NotImplementedError


# ---- helpers shared by the mappings ------------------------------------------------------


# PretrainedConfig bookkeeping that says nothing about the layers (to_dict writes it all)
_GENERIC_KEYS = (
    "architectures", "_name_or_path", "transformers_version", "dtype", "torch_dtype", "id2label", "label2id",
    "output_hidden_states", "output_attentions", "return_dict", "chunk_size_feed_forward", "is_encoder_decoder",
    "problem_type",
)


class SpeculatorsFormat(Format):
    """A layout of vLLM's speculators library: an export is this format when its config's
    ``speculators_model_type`` is :attr:`speculators_type`, and ``--check`` drafts with
    speculators' own model class (``peer_model``: its module, and the class there, or None for the
    module itself) inside :attr:`peer_adapter` (a :class:`~draftlab.export.check.PeerProposer`)."""

    speculators_type: str = ""
    peer_model: tuple[str, str | None] = ("", None)
    peer_adapter: type | None = None
    hook_attributes = {"detect": "speculators_type", "peer_proposer": "peer_adapter"}  # what each hook reads (check.own_hook)
    free_keys = ("speculators_config.verifier.name_or_path",)  # --verifier: any path naming the target

    def detect(self, config: dict) -> bool:
        return config.get("speculators_model_type") == self.speculators_type

    @property
    def where(self) -> str:
        """The config an import's errors name."""
        return f"speculators {self.speculators_type} config.json"

    def check_type(self, config: dict) -> None:
        """An import's first check: the config is of this layout."""
        found = config.get("speculators_model_type")
        if found != self.speculators_type:
            raise DraftlabError(f"{self.where}: speculators_model_type is {found!r}, expected {self.speculators_type!r}")

    def peer_proposer(self, out: Path, config: dict, drafter, target):
        import importlib

        module, cls = self.peer_model
        try:
            from speculators import SpeculatorModelConfig

            model = importlib.import_module(module)
        except ImportError:
            return None
        return self.peer_adapter(out, drafter, target, SpeculatorModelConfig, getattr(model, cls) if cls else model)


def layer_config(shape, num_layers: int, vocab_size: int, model_type: str = "llama", **overrides) -> dict:
    """The HF config dict of a drafter's decoder layers, written as a ``model_type`` config.

    Both the new (``rope_parameters``) and the legacy (``rope_theta`` / ``rope_scaling``) RoPE
    keys are written: readers on transformers 4.x (and EAGLE's own config class) only know the
    legacy ones and would silently fall back to theta = 10000."""
    cfg = shape.model_copy(update={"model_type": model_type}).hf_config()
    cfg.num_hidden_layers = num_layers
    cfg.vocab_size = vocab_size
    cfg.attention_bias = shape.attention_bias
    cfg.tie_word_embeddings = False
    d = cfg.to_dict()
    rope = dict(shape.rope)
    d["rope_theta"] = rope.get("rope_theta", 10000.0)
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    d["rope_scaling"] = None if scaling.get("rope_type", "default") == "default" else scaling
    if d.get("layer_types"):  # built for one layer: one entry per layer, or readers index past it
        d["layer_types"] = [d["layer_types"][0]] * num_layers
    for k in _GENERIC_KEYS:
        d.pop(k, None)
    d.update(overrides)
    return d


def speculators_config(algorithm: str, tokens: int, target, opts: ExportOptions) -> dict:
    """speculators' ``speculators_config``: one greedy proposal method of ``tokens`` drafts, and
    the verifier (``opts.verifier`` or the target's name), which vLLM and speculators load."""
    return {
        "algorithm": algorithm,
        "default_proposal_method": "greedy",
        "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": tokens, "verifier_accept_k": 1, "accept_tolerance": 0.0}],
        "verifier": {"name_or_path": opts.verifier or target.identity.get("name"), "architectures": list(target.config.architectures or [])},
    }


def shape_from_config(config: dict, where: str, target):
    """A ``LayerShape`` from a foreign HF-style config dict (llama/mistral/qwen2/qwen3). Its
    ``model_type`` is set to the target's family, as for drafters built in draftlab: the layer
    structure itself is carried by the flags (attention_bias, qk_norm), and the RoPE is the
    same whichever family's config computes it."""
    from transformers import AutoConfig

    from draftlab.models.layers import LayerShape
    from draftlab.models.target import SUPPORTED_MODEL_TYPES

    mt = config.get("model_type", "llama")
    if mt not in SUPPORTED_MODEL_TYPES:
        raise DraftlabError(f"{where}: model_type '{mt}' is not a supported decoder-layer family ({', '.join(SUPPORTED_MODEL_TYPES)})")
    kw = {k: v for k, v in config.items() if k not in ("model_type", "architectures", "auto_map")}
    try:
        cfg = AutoConfig.for_model(mt, **kw)
        shape = LayerShape.from_hf(cfg)
    except (TypeError, ValueError, AttributeError) as e:
        raise DraftlabError(f"{where}: cannot read the decoder-layer config ({e})") from None
    if shape.hidden_act != "silu":
        raise DraftlabError(f"{where}: hidden_act '{shape.hidden_act}' is not supported (only silu)")
    return shape.model_copy(update={"model_type": target.config.model_type}), cfg


def llama_compatible(drafter, engine_what: str) -> None:
    """Refuse layers a Llama-only loader would drop (q/k norms) or mis-shape (q/k/v bias)."""
    s = drafter.shape
    if s.qk_norm:
        raise DraftlabError(f"{engine_what} builds Llama decoder layers without q/k RMSNorm; this drafter (target family {s.model_type}) has them")
    if s.attention_bias:
        raise DraftlabError(f"{engine_what} builds Llama decoder layers without q/k/v bias; this drafter (target family {s.model_type}) has them")


def serving_aux_ids(aux: list[int], num_target_layers: int, what: str, field: str = "drafter.aux_layers") -> None:
    """Serving engines capture aux states at decoder-layer inputs 1..L-1 only (index 0, the
    embedding, and L, draftlab's post-final-norm state, have no equivalent there), each once and
    in layer order (vLLM: ``if idx in aux_hidden_state_layers`` inside its layer loop), so the
    features reach ``fc`` ascending whatever order a config lists them in."""
    L = num_target_layers
    if any(not 1 <= i <= L - 1 for i in aux) or list(aux) != sorted(set(aux)):
        raise DraftlabError(
            f"{field} {list(aux)}: {what} captures target hidden states 1..{L - 1} (inputs of decoder layers), "
            "each once and in ascending order; retrain with distinct ascending layers in that range"
        )


def read_config(src: Path) -> dict:
    from draftlab.checkpoint import read_json

    return read_json(src / "config.json")


def read_tensors(src: Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory: model.safetensors, sharded safetensors (index),
    or pytorch_model.bin (read with ``weights_only=True``: tensors only, no code)."""
    from draftlab.checkpoint import read_json, read_weights

    index = src / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise DraftlabError(f"{index}: no weight_map")
        out: dict[str, torch.Tensor] = {}
        for s in sorted(set(weight_map.values())):
            out.update(read_weights(src / s))
        return out
    if (src / "model.safetensors").is_file():
        return read_weights(src / "model.safetensors")
    if (src / "pytorch_model.bin").is_file():
        return read_torch_tensors(src / "pytorch_model.bin")
    raise DraftlabError(f"{src}: no model.safetensors, model.safetensors.index.json or pytorch_model.bin")


def read_torch_tensors(path: Path) -> dict[str, torch.Tensor]:
    """A pickled name -> tensor dict, read with ``torch.load(weights_only=True)``: tensors
    only, no code; anything else (or a truncated file) is a one-line error."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unpickling refusal is a user-file problem
        raise DraftlabError(f"{path}: not a plain tensor dict ({str(e).splitlines()[0]})") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise DraftlabError(f"{path}: not a plain name -> tensor dict")
    return state


def check_embedding(tensors: dict, target, where: str) -> None:
    """A foreign checkpoint may carry the embedding it was trained with; draftlab always uses
    the target's (shared, frozen), so it must be the same matrix up to storage rounding."""
    emb = tensors.pop("embed_tokens.weight", None)
    if emb is None:
        return
    ref = target.embed_tokens.weight.detach().cpu()
    if tuple(emb.shape) != tuple(ref.shape):
        raise DraftlabError(f"{where}: embed_tokens.weight has shape {tuple(emb.shape)}, the target's is {tuple(ref.shape)}")
    diff = (emb.float() - ref.to(emb.dtype).float()).abs().max().item()
    if diff > 1e-2 * max(ref.abs().max().item(), 1e-6):
        raise DraftlabError(f"{where}: embed_tokens.weight differs from the target's embedding (max |diff| {diff:.3g}): trained for another target?")


def vocab_maps(tensors: dict, vocab_size: int, draft_vocab_size: int, where: str, lm_head: str = "lm_head.weight") -> None:
    """Make ``d2t``/``t2d`` present and consistent: a full vocabulary needs neither; ``t2d`` is
    derivable from ``d2t`` (SGLang ignores and some exports omit it). Inconsistent maps are an error."""
    d2t, t2d = tensors.get("d2t"), tensors.get("t2d")
    if d2t is None:
        if draft_vocab_size != vocab_size:
            raise DraftlabError(f"{where}: missing tensor d2t (draft vocab {draft_vocab_size} < target vocab {vocab_size})")
        d2t = torch.zeros(vocab_size, dtype=torch.long)
    d2t = d2t.long()
    if d2t.shape != (draft_vocab_size,):
        raise DraftlabError(f"{where}: d2t has shape {tuple(d2t.shape)}, expected ({draft_vocab_size},)")
    target_ids = torch.arange(draft_vocab_size) + d2t
    if target_ids.min() < 0 or target_ids.max() >= vocab_size or target_ids.unique().numel() != draft_vocab_size:
        raise DraftlabError(f"{where}: d2t does not map the draft vocabulary onto distinct target ids < {vocab_size}")
    derived = torch.zeros(vocab_size, dtype=torch.bool)
    derived[target_ids] = True
    if t2d is not None and not torch.equal(t2d.bool(), derived):
        raise DraftlabError(f"{where}: t2d disagrees with d2t")
    # draftlab orders the draft vocabulary by target id (its training restricts target logits
    # with the t2d mask, i.e. in target-id order). Another order is the same drafter with its
    # lm_head rows permuted: sort both, losslessly.
    order = target_ids.argsort()
    if not torch.equal(order, torch.arange(draft_vocab_size)) and lm_head in tensors:
        tensors[lm_head] = tensors[lm_head][order]
        target_ids = target_ids[order]
        d2t = target_ids - torch.arange(draft_vocab_size)
    tensors["d2t"], tensors["t2d"] = d2t, derived


def take_zero_bias(tensors: dict, names: list[str], where: str) -> None:
    """Remove biases a Llama layer with ``attention_bias`` has and draftlab's layers do not
    (o_proj): accepted only when exactly zero, so nothing the loader computes is dropped."""
    for n in names:
        b = tensors.pop(n, None)
        if b is None:
            raise DraftlabError(f"{where}: missing tensor {n}")
        if b.abs().max().item() != 0.0:
            raise DraftlabError(f"{where}: {n} is non-zero; draftlab's decoder layers have no o_proj bias")
