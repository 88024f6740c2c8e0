"""Target hidden-state capture: online (inside the training loop) or offline into shards.

Both paths produce the same per-sample structure, so the trainer can use either:
``{"input_ids": Long[T], "loss_mask": Bool[T], "hidden": {layer: Float[T, H]}}``
(plus ``topk_values``/``topk_indices`` [T, k] when top-k target log-probs were asked for).
Layer indices follow :mod:`draftlab.models.target` (``hidden[0]`` = embeddings, ``hidden[L]``
= last layer after the final norm). ``hidden[L]`` is always captured: target logits are
``lm_head(hidden[L])``, recomputed at training time instead of being stored (49k floats a
token for the default target against 576 per layer).

Offline layout (``out_dir``)::

    manifest.json              format, target identity, layers, dtype, data, shard list
    shard-00000.safetensors    whole samples, tokens concatenated:
                               input_ids I32[N], loss_mask BOOL[N], sample_offsets I64[n+1],
                               hidden.<layer> [N, H] (storage dtype),
                               topk_values F32[N, k], topk_indices I32[N, k] (logits="topk")

Shards are a pure function of (samples, shard_tokens) and each shard's batches a pure function
of its samples and batch_tokens, so a run killed midway and resumed writes the same bytes as
one that never stopped. Every file is written to a temp name and renamed; the manifest is
rewritten (atomically) after each shard, and a restart re-verifies the recorded checksums.
"""

from __future__ import annotations

import argparse
import bisect
import functools
import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch.nn.utils.rnn import pad_sequence

from draftlab.errors import DraftlabError
from draftlab.models.target import file_sha256

FORMAT = "draftlab-capture"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
STORAGE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
LAYER_PRESETS = ("eagle1", "eagle3")
ONLINE_LOGITS = ("none", "full", "topk")
OFFLINE_LOGITS = ("none", "topk")
# Padded tokens per forward. On the 2-core benchmark machine 1-2 sequences of 512 tokens are
# fastest (bench/capture.py); larger batches only add memory traffic on CPU.
DEFAULT_BATCH_TOKENS = 1024
DEFAULT_SHARD_BYTES = 256 << 20  # default shard_tokens = this / bytes per token
LM_HEAD_CHUNK_TOKENS = 1024  # top-k: never materialise more than [chunk, V] logits at once

Sample = dict[str, torch.Tensor]


# ------------------------------------------------------------------------------ layers
def resolve_layers(preset: str | Sequence[int], num_layers: int) -> list[int]:
    """Hidden-state indices to capture, ascending, always including ``num_layers`` (L).

    ``"eagle1"`` -> [L]; ``"eagle3"`` -> [2, L//2, L-3] + [L] (same as
    ``Target.eagle3_layers``); or custom indices as a list or a string ``"2,15,27"``."""
    L = num_layers
    if isinstance(preset, str):
        name = preset.strip().lower()
        if name == "eagle1":
            chosen: list[int] = []
        elif name == "eagle3":
            chosen = [2, L // 2, L - 3]
        else:
            try:
                chosen = [int(p) for p in name.split(",") if p.strip()]
            except ValueError:
                raise DraftlabError(
                    f"layers: expected 'eagle1', 'eagle3' or comma-separated layer indices, got '{preset}'"
                ) from None
            if not chosen:
                raise DraftlabError(f"layers: no layer index in '{preset}'")
    else:
        chosen = list(preset)
        for i in chosen:
            if isinstance(i, bool) or not isinstance(i, int):
                raise DraftlabError(f"layers: indices must be integers, got {i!r}")
    for i in chosen:
        if not 0 <= i <= L:
            raise DraftlabError(f"layers: index {i} is out of range 0..{L} for a {L}-layer target")
    return sorted(set(chosen) | {L})


# ------------------------------------------------------------------------------ online
def _right_padded(mask: torch.Tensor) -> bool:
    """True when every row is ones then zeros (what ``collate`` produces)."""
    return bool((mask[:, 1:] <= mask[:, :-1]).all())


def _forward(forward, input_ids, attention_mask, layers: list[int], full_logits: bool):
    kwargs: dict[str, Any] = {}
    if attention_mask is not None:
        mask = attention_mask.to(device=input_ids.device, dtype=torch.bool)
        # Right padding needs no mask: under causal attention a real token never sees a later
        # pad, and positions 0.. are those of the unpadded sample, so SDPA keeps its fast
        # is_causal kernel. Any other padding gets explicit positions and a key mask.
        if not _right_padded(mask):
            T = input_ids.shape[1]
            eye = torch.eye(T, dtype=torch.bool, device=mask.device)
            attn = torch.ones(T, T, dtype=torch.bool, device=mask.device).tril()[None] & mask[:, None, :]
            # a pad query may see itself: a row with nothing to attend to would give NaN, and
            # NaN values leak into real tokens through 0-weighted attention later on
            kwargs = {"attn_mask": attn | eye, "position_ids": (mask.long().cumsum(-1) - 1).clamp(min=0)}
    return forward(input_ids, layers=layers, logits="all" if full_logits else None, **kwargs)


def _topk_logprobs(target, last_hidden: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of ``log_softmax(lm_head(h))`` over the full vocab, in token chunks."""
    flat = last_hidden.reshape(-1, last_hidden.shape[-1])
    values, indices = [], []
    for s in range(0, flat.shape[0], LM_HEAD_CHUNK_TOKENS):
        logp = torch.log_softmax(target.lm_head(flat[s : s + LM_HEAD_CHUNK_TOKENS]).float(), dim=-1)
        v, i = logp.topk(k, dim=-1)
        values.append(v)
        indices.append(i)
    shape = (*last_hidden.shape[:-1], k)
    return torch.cat(values).view(shape), torch.cat(indices).view(shape)


def _check_logits(logits: str, allowed: tuple[str, ...], topk: int, vocab: int) -> None:
    if logits not in allowed:
        raise DraftlabError(f"logits: expected one of {', '.join(allowed)}, got '{logits}'")
    if logits == "topk" and not 1 <= topk <= vocab:
        raise DraftlabError(f"topk: must be in 1..{vocab} (the target vocab), got {topk}")


@torch.no_grad()
def capture_batch(
    target,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    layers: str | Sequence[int] = "eagle3",
    logits: str = "none",
    topk: int = 20,
    compile: bool = False,
) -> dict:
    """One target forward over a batch [B, T]; no disk.

    Returns ``{"hidden": {layer: Float[B, T, H]}}`` plus ``"logits"`` [B, T, V] for
    ``logits="full"`` or ``"topk_values"`` (log-probs over the full vocab) and
    ``"topk_indices"`` [B, T, k] for ``logits="topk"``. ``layers`` is a preset or indices
    (see :func:`resolve_layers`; L is always included). With ``attention_mask`` (1 = real
    token, any padding side) real tokens get the states of the unpadded sample (equal up to
    the fp32 rounding of a different batch shape); values at padded positions are
    unspecified. ``compile``: see :func:`compiled_forward`. Runs under ``no_grad``, not
    ``inference_mode``: inference tensors could not be saved for the drafter's backward."""
    layer_ids = resolve_layers(layers, target.num_layers)
    _check_logits(logits, ONLINE_LOGITS, topk, target.vocab_size)
    forward = compiled_forward(target) if compile else target
    out = _forward(forward, input_ids, attention_mask, layer_ids, full_logits=logits == "full")
    result: dict[str, Any] = {"hidden": out.hidden}
    if logits == "full":
        result["logits"] = out.logits
    elif logits == "topk":
        result["topk_values"], result["topk_indices"] = _topk_logprobs(target, out.hidden[target.num_layers], topk)
    return result


# ------------------------------------------------------------------------------ planning
def _validate_samples(samples: Sequence[Sample], max_positions: int | None) -> list[int]:
    if len(samples) == 0:
        raise DraftlabError("samples: nothing to capture (empty sample list)")
    lengths = []
    for i, s in enumerate(samples):
        ids, mask = s.get("input_ids"), s.get("loss_mask")
        if not isinstance(ids, torch.Tensor) or not isinstance(mask, torch.Tensor):
            raise DraftlabError(f"samples[{i}]: needs 'input_ids' and 'loss_mask' tensors")
        if ids.dim() != 1 or mask.shape != ids.shape or ids.numel() == 0:
            raise DraftlabError(f"samples[{i}]: input_ids and loss_mask must be non-empty 1-D tensors of one length")
        if max_positions and ids.numel() > max_positions:
            raise DraftlabError(
                f"samples[{i}]: {ids.numel()} tokens exceed the target's max_position_embeddings ({max_positions})"
            )
        lengths.append(ids.numel())
    return lengths


def plan_shards(lengths: Sequence[int], shard_tokens: int) -> list[tuple[int, int]]:
    """Consecutive sample ranges ``[start, end)`` of at most ``shard_tokens`` tokens each
    (a longer sample gets a shard of its own)."""
    shards, start, tokens = [], 0, 0
    for i, n in enumerate(lengths):
        if i > start and tokens + n > shard_tokens:
            shards.append((start, i))
            start, tokens = i, 0
        tokens += n
    shards.append((start, len(lengths)))
    return shards


def plan_batches(lengths: Sequence[int], batch_tokens: int) -> list[list[int]]:
    """Deterministic forward batches over sample indices: longest first (ties by index), each
    batch's padded size ``rows * longest <= batch_tokens``, so rows have similar lengths and
    padding stays small. A sample longer than ``batch_tokens`` runs alone."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    for i in order:
        if batches and lengths[batches[-1][0]] * (len(batches[-1]) + 1) <= batch_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def data_fingerprint(samples: Sequence[Sample]) -> str:
    """sha256 over every sample's tokens and loss mask, in order."""
    h = hashlib.sha256()
    for s in samples:
        ids = s["input_ids"].to(torch.int64).contiguous()
        h.update(ids.numel().to_bytes(8, "little"))
        h.update(ids.numpy().tobytes())
        h.update(s["loss_mask"].to(torch.bool).contiguous().numpy().tobytes())
    return h.hexdigest()


def bytes_per_token(num_layers: int, hidden_size: int, storage_dtype: str, topk: int = 0) -> int:
    """Stored bytes per token: hidden states + input_ids (int32) + loss_mask (bool) + top-k
    (float32 values + int32 indices). Per-sample offsets and file headers come on top."""
    itemsize = torch.empty((), dtype=STORAGE_DTYPES[storage_dtype]).element_size()
    return num_layers * hidden_size * itemsize + 4 + 1 + topk * 8


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError


# ------------------------------------------------------------------------------ offline
@dataclass
class CaptureResult:
    out_dir: Path
    manifest: dict
    captured_tokens: int  # tokens computed by this call (resumed shards excluded)
    skipped_shards: int  # shards found complete and verified
    seconds: float  # wall time spent capturing and writing them

    @property
    def tokens_per_s(self) -> float:
        return self.captured_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def total_bytes(self) -> int:
        return sum(s["bytes"] for s in self.manifest["shards"])


def _shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def _write_json_atomic(path: Path, obj: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _identity_mismatch(old: dict, new: dict) -> str | None:
    for key, label in (
        ("format_version", "format version"),
        ("target", "target"),
        ("layers", "layers"),
        ("storage_dtype", "dtype"),
        ("logits", "logits"),
        ("topk", "topk"),
        ("data", "data spec"),
        ("data_fingerprint", "data (samples differ)"),
        ("shard_tokens", "shard_tokens"),
        ("batch_tokens", "batch_tokens"),
        ("compiled", "compile"),
    ):
        if old.get(key) != new.get(key):
            return f"{label}: {old.get(key)!r} there, {new.get(key)!r} now"
    return None


def _shard_ok(out_dir: Path, entry: dict, planned: tuple[int, int]) -> bool:
    path = out_dir / entry["file"]
    return tuple(entry["samples"]) == planned and path.is_file() and file_sha256(path) == entry["sha256"]


_COMPILED_FORWARD = None  # torch.compile(Target.forward), built on first use


def compiled_forward(target) -> Callable:
    """``target.forward`` through ``torch.compile`` (inductor, dynamic shapes, so one graph
    serves every batch shape; sizes 1 get their own). On CPU it fuses the norms, RoPE and
    activations into a few kernels: fewer passes over memory and far fewer thread-pool
    barriers, which matters most on a busy machine (bench/capture.py). Costs tens of seconds
    of compilation once per process; numerics differ from eager at fp32 rounding level, so a
    capture is resumed with the same setting."""
    global _COMPILED_FORWARD
    if _COMPILED_FORWARD is None:
        from draftlab.models.target import Target

        # the unbound method: holding no target keeps targets collectable
        _COMPILED_FORWARD = torch.compile(Target.forward, dynamic=True)
    return functools.partial(_COMPILED_FORWARD, target)


@torch.inference_mode()
def capture_samples(
    target,
    samples: Sequence[Sample],
    layers: list[int],
    dtype: torch.dtype = torch.bfloat16,
    batch_tokens: int = DEFAULT_BATCH_TOKENS,
    topk: int = 0,
    on_tokens: Callable[[int], None] | None = None,
    compile: bool = False,
) -> dict[str, torch.Tensor]:
    """The tensors of one shard, in memory: ``samples`` concatenated in order (see the module
    docstring for names), computed in :func:`plan_batches` batches. ``layers`` are resolved
    indices; ``topk`` = 0 stores no log-probs; ``on_tokens(n)`` after each batch;
    ``compile`` runs the target through :func:`compiled_forward`."""
    lengths = [s["input_ids"].numel() for s in samples]
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    N, H, L = offsets[-1], target.hidden_size, target.num_layers
    hidden = {layer: torch.empty(N, H, dtype=dtype) for layer in layers}
    if topk:
        topk_values = torch.empty(N, topk, dtype=torch.float32)
        topk_indices = torch.empty(N, topk, dtype=torch.int32)
    device = target.device
    forward = compiled_forward(target) if compile else target
    for batch in plan_batches(lengths, batch_tokens):
        T = lengths[batch[0]]
        ids = torch.zeros(len(batch), T, dtype=torch.long)
        for r, i in enumerate(batch):
            ids[r, : lengths[i]] = samples[i]["input_ids"]
        out = forward(ids.to(device), layers=layers, logits=None)  # right padding: plain causal forward
        if topk:
            values, indices = _topk_logprobs(target, out.hidden[L], topk)
            values, indices = values.cpu(), indices.cpu()
        # on CPU the per-sample copy_ below also casts (one pass); from an accelerator, cast
        # there and move each layer once
        states = {layer: h if h.device.type == "cpu" else h.to(dtype).cpu() for layer, h in out.hidden.items()}
        for r, i in enumerate(batch):
            a, b = offsets[i], offsets[i + 1]
            for layer in layers:
                hidden[layer][a:b].copy_(states[layer][r, : b - a])
            if topk:
                topk_values[a:b].copy_(values[r, : b - a])
                topk_indices[a:b].copy_(indices[r, : b - a])
        if on_tokens is not None:
            on_tokens(sum(lengths[i] for i in batch))
    tensors = {
        "input_ids": torch.cat([s["input_ids"] for s in samples]).to(torch.int32),
        "loss_mask": torch.cat([s["loss_mask"] for s in samples]).to(torch.bool),
        "sample_offsets": torch.tensor(offsets, dtype=torch.int64),
    }
    tensors.update({f"hidden.{layer}": h for layer, h in hidden.items()})
    if topk:
        tensors["topk_values"], tensors["topk_indices"] = topk_values, topk_indices
    return tensors


def _write_shard(out_dir: Path, name: str, tensors: dict[str, torch.Tensor]) -> tuple[int, str]:
    """Write ``name`` via a temp file + rename; returns (bytes, sha256)."""
    from safetensors.torch import save

    # one metadata key only: safetensors writes metadata in hash-map order, which differs run to run
    blob = save(tensors, metadata={"format": f"{FORMAT}/{FORMAT_VERSION}"})
    tmp = out_dir / f".{name}.tmp"
    with open(tmp, "wb") as f:
        f.write(blob)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out_dir / name)
    return len(blob), hashlib.sha256(blob).hexdigest()


def _spec_dict(spec) -> dict | None:
    if spec is None:
        return None
    if hasattr(spec, "model_dump"):
        return spec.model_dump(mode="json")
    return json.loads(json.dumps(spec))  # plain dict: keep only what JSON keeps, as the manifest will


@torch.inference_mode()
def capture_offline(
    target,
    samples: Sequence[Sample],
    out_dir: str | Path,
    layers: str | Sequence[int] = "eagle3",
    storage_dtype: str = "bfloat16",
    shard_tokens: int | None = None,
    logits: str = "none",
    topk: int = 20,
    batch_tokens: int | None = None,
    data_spec=None,
    progress: bool = True,
    on_shard: Callable[[int, dict], None] | None = None,
    compile: bool | None = None,
    verbose: bool | None = None,
) -> CaptureResult:
    """Capture ``samples`` (in order) into ``out_dir``, resuming a previous run there.

    ``shard_tokens``/``batch_tokens``/``compile`` default to the values recorded by the run
    being resumed, else to ~256 MiB shards, :data:`DEFAULT_BATCH_TOKENS` and eager mode
    (``compile=True``: see :func:`compiled_forward`). ``data_spec`` (a DataSpec or
    dict) is recorded in the manifest. ``on_shard(index, entry)`` is called after each shard
    is committed. ``progress`` shows a tqdm bar; ``verbose`` (default: ``progress``) prints the
    size estimate and recaptured shards. Raises :class:`DraftlabError` when ``out_dir`` holds a
    different capture."""
    out_dir = Path(out_dir)
    if storage_dtype not in STORAGE_DTYPES:
        raise DraftlabError(f"dtype: expected one of {', '.join(STORAGE_DTYPES)}, got '{storage_dtype}'")
    _check_logits(logits, OFFLINE_LOGITS, topk, target.vocab_size)
    k = topk if logits == "topk" else 0
    layer_ids = resolve_layers(layers, target.num_layers)
    lengths = _validate_samples(samples, getattr(target.config, "max_position_embeddings", None))
    bpt = bytes_per_token(len(layer_ids), target.hidden_size, storage_dtype, k)
    for name, value in (("shard_tokens", shard_tokens), ("batch_tokens", batch_tokens)):
        if value is not None and value < 1:
            raise DraftlabError(f"{name}: must be a positive number of tokens, got {value}")

    verbose = progress if verbose is None else verbose
    manifest_path = out_dir / MANIFEST
    old = None
    if manifest_path.is_file():
        try:
            old = json.loads(manifest_path.read_text())
        except json.JSONDecodeError as e:
            raise DraftlabError(f"{manifest_path}: not valid JSON ({e.msg})") from None
        if old.get("format") != FORMAT:
            raise DraftlabError(f"{manifest_path}: not a draftlab capture manifest")
        shard_tokens = shard_tokens if shard_tokens is not None else old.get("shard_tokens")
        batch_tokens = batch_tokens if batch_tokens is not None else old.get("batch_tokens")
        compile = compile if compile is not None else old.get("compiled")
    elif out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise DraftlabError(f"out: {out_dir} exists and is not an (empty or draftlab capture) directory")
    shard_tokens = shard_tokens or max(1, DEFAULT_SHARD_BYTES // bpt)
    batch_tokens = batch_tokens or DEFAULT_BATCH_TOKENS
    compile = bool(compile)

    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "target": target.identity,
        "layers": layer_ids,
        "hidden_size": target.hidden_size,
        "storage_dtype": storage_dtype,
        "logits": logits,
        "topk": k or None,
        "data": _spec_dict(data_spec),
        "data_fingerprint": data_fingerprint(samples),
        "num_samples": len(samples),
        "num_tokens": sum(lengths),
        "shard_tokens": shard_tokens,
        "batch_tokens": batch_tokens,
        "compiled": compile,
        "bytes_per_token": bpt,
        "complete": False,
        "shards": [],
    }
    if old is not None:
        why = _identity_mismatch(old, manifest)
        if why:
            raise DraftlabError(f"out: {out_dir} holds a different capture ({why}); use a new --out directory")

    plan = plan_shards(lengths, shard_tokens)
    out_dir.mkdir(parents=True, exist_ok=True)
    for stray in out_dir.glob(".*.tmp"):  # left by a kill mid-write; never referenced
        stray.unlink()
    done: dict[int, dict] = {}
    for entry in (old or {}).get("shards", []):
        idx = entry.get("index")
        if isinstance(idx, int) and idx < len(plan) and _shard_ok(out_dir, entry, plan[idx]):
            done[idx] = entry
        elif verbose:
            print(f"capture: {entry.get('file')} is missing or fails its checksum; capturing it again")
    manifest["shards"] = [done[i] for i in sorted(done)]
    _write_json_atomic(manifest_path, manifest)

    total, skipped = manifest["num_tokens"], len(done)
    done_tokens = sum(e["tokens"] for e in done.values())
    if verbose:
        print(
            f"capture: {len(samples)} samples, {total} tokens x {bpt} B/token ~ {human_bytes(total * bpt)} "
            f"in {len(plan)} shards (layers {layer_ids}, {storage_dtype}{', torch.compile' if compile else ''})"
            + (f"; resuming: {len(done)} shards / {done_tokens} tokens already done" if done else "")
        )
    from tqdm.auto import tqdm

    bar = tqdm(total=total, initial=done_tokens, unit="tok", unit_scale=True, desc="capture", disable=not progress)
    dtype = STORAGE_DTYPES[storage_dtype]
    captured, start = 0, time.perf_counter()
    try:
        for idx, (a, b) in enumerate(plan):
            if idx in done:
                continue
            tensors = capture_samples(target, samples[a:b], layer_ids, dtype, batch_tokens, k, bar.update, compile)
            name = _shard_name(idx)
            size, digest = _write_shard(out_dir, name, tensors)
            tokens = sum(lengths[a:b])
            entry = {"index": idx, "file": name, "samples": [a, b], "tokens": tokens, "bytes": size, "sha256": digest}
            done[idx] = entry
            captured += tokens
            manifest["shards"] = [done[i] for i in sorted(done)]
            _write_json_atomic(manifest_path, manifest)
            if on_shard is not None:
                on_shard(idx, entry)
    finally:
        bar.close()
    seconds = time.perf_counter() - start
    manifest["complete"] = True
    _write_json_atomic(manifest_path, manifest)
    return CaptureResult(out_dir, manifest, captured, skipped, seconds)


# ------------------------------------------------------------------------------ reading
class OfflineDataset(torch.utils.data.Dataset):
    """Samples of a finished offline capture, read lazily from the shards.

    ``ds[i]`` -> ``{"input_ids": Long[T], "loss_mask": Bool[T], "hidden": {layer: Float[T, H]}}``
    (+ ``topk_values`` Float[T, k], ``topk_indices`` Long[T, k]), hidden cast back to float32:
    the per-sample structure of :func:`capture_batch`. Each shard's checksum is verified when
    it is first opened (``check=False`` skips that; :meth:`verify` checks all at once)."""

    def __init__(self, out_dir: str | Path, check: bool = True):
        self.out_dir = Path(out_dir)
        path = self.out_dir / MANIFEST
        if not path.is_file():
            raise DraftlabError(f"{path}: no capture manifest (run draftlab capture --out {self.out_dir})")
        try:
            self.manifest = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise DraftlabError(f"{path}: not valid JSON ({e.msg})") from None
        if self.manifest.get("format") != FORMAT:
            raise DraftlabError(f"{path}: not a draftlab capture manifest")
        if self.manifest.get("format_version") != FORMAT_VERSION:
            raise DraftlabError(
                f"{path}: capture format version {self.manifest.get('format_version')}, this draftlab reads {FORMAT_VERSION}"
            )
        if not self.manifest.get("complete"):
            n = len(self.manifest.get("shards", []))
            raise DraftlabError(
                f"{path}: the capture is incomplete ({n} shards written); rerun draftlab capture with --out {self.out_dir} to finish it"
            )
        self.shards = self.manifest["shards"]
        self.layers: list[int] = self.manifest["layers"]
        self.check = check
        self._starts = [s["samples"][0] for s in self.shards]
        self._open: dict[int, tuple[Any, torch.Tensor]] = {}  # shard index -> (safe_open handle, offsets)
        self._verified: set[int] = set()

    @property
    def target_identity(self) -> dict:
        return self.manifest["target"]

    def __len__(self) -> int:
        return self.manifest["num_samples"]

    def lengths(self) -> list[int]:
        """Token count of every sample (reads only the offsets)."""
        out = []
        for s in range(len(self.shards)):
            off = self._shard(s)[1]
            out += (off[1:] - off[:-1]).tolist()
        return out

    def _check(self, s: int) -> None:
        entry = self.shards[s]
        path = self.out_dir / entry["file"]
        if not path.is_file():
            raise DraftlabError(f"{path}: shard missing; rerun draftlab capture with --out {self.out_dir} to recapture it")
        got = file_sha256(path)
        if got != entry["sha256"]:
            raise DraftlabError(
                f"{path}: checksum mismatch (sha256 {got[:12]}..., manifest says {entry['sha256'][:12]}...); "
                f"the shard is corrupt: rerun draftlab capture with --out {self.out_dir} to recapture it"
            )
        self._verified.add(s)

    def verify(self) -> None:
        """Check every shard against the manifest's sha256 (DraftlabError naming the file)."""
        for s in range(len(self.shards)):
            self._check(s)

    def _shard(self, s: int):
        if s not in self._open:
            from safetensors import safe_open

            if self.check and s not in self._verified:
                self._check(s)
            handle = safe_open(str(self.out_dir / self.shards[s]["file"]), framework="pt")
            self._open[s] = (handle, handle.get_tensor("sample_offsets"))
        return self._open[s]

    def __getitem__(self, i: int) -> dict:
        if not -len(self) <= i < len(self):
            raise IndexError(f"sample {i} out of range ({len(self)} samples)")
        i %= len(self)
        s = bisect.bisect_right(self._starts, i) - 1
        handle, offsets = self._shard(s)
        local = i - self._starts[s]
        a, b = int(offsets[local]), int(offsets[local + 1])
        item = {
            "input_ids": handle.get_slice("input_ids")[a:b].long(),
            "loss_mask": handle.get_slice("loss_mask")[a:b],
            "hidden": {layer: handle.get_slice(f"hidden.{layer}")[a:b].float() for layer in self.layers},
        }
        if self.manifest.get("logits") == "topk":
            item["topk_values"] = handle.get_slice("topk_values")[a:b]
            item["topk_indices"] = handle.get_slice("topk_indices")[a:b].long()
        return item

    def __iter__(self):
        for i in range(len(self)):
            yield self[i]

    def __getstate__(self):  # DataLoader workers: safetensors handles do not pickle; reopen lazily
        state = self.__dict__.copy()
        state["_open"] = {}
        return state


def collate_captured(items: Sequence[dict], pad_id: int) -> dict:
    """Right-pad per-sample capture dicts (from :class:`OfflineDataset`) into the batch shape
    :func:`capture_batch` returns: ``collate``'s ``input_ids``/``loss_mask``/``attention_mask``
    [B, T] plus ``hidden`` {layer: [B, T, H]} (and top-k [B, T, k]), zeros at padding."""
    from draftlab.data.dataset import collate

    batch = collate(items, pad_id)  # T = the longest item, so padding the rows below gives [B, T, ...]
    batch["hidden"] = {layer: pad_sequence([it["hidden"][layer] for it in items], batch_first=True) for layer in items[0]["hidden"]}
    for key in ("topk_values", "topk_indices"):
        if key in items[0]:
            batch[key] = pad_sequence([it[key] for it in items], batch_first=True)
    return batch


# ------------------------------------------------------------------------------ CLI
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="default", help="HF dir, hub id, .gguf file or 'default' (embedded SmolLM2-135M)")
    p.add_argument("--data", default="sharegpt", help="'sharegpt', a .json/.jsonl file or 'hf:<name or dir>'")
    p.add_argument("--data-path", default=None, help="read the source from this file/dir instead")
    p.add_argument("--num-conversations", type=int, default=None, help="use at most this many conversations")
    p.add_argument("--max-length", type=int, default=None, help="truncate samples to this many tokens (data default: 2048)")
    p.add_argument("--heldout", type=int, default=None, help="conversations held out for evaluation (not captured)")
    p.add_argument("--seed", type=int, default=None, help="data split seed")
    p.add_argument("--split", choices=("train", "heldout"), default="train", help="which split to capture")
    p.add_argument("--layers", default="eagle3", help="eagle3 | eagle1 | comma-separated indices, e.g. 2,15,27 (L is always added)")
    p.add_argument("--dtype", default="bfloat16", choices=tuple(STORAGE_DTYPES), help="storage dtype of hidden states")
    p.add_argument("--logits", default="none", choices=OFFLINE_LOGITS, help="also store top-k target log-probs")
    p.add_argument("--topk", type=int, default=20)
    p.add_argument("--out", required=True, help="output directory (an existing capture there is resumed)")
    p.add_argument("--batch-tokens", type=int, default=None, help=f"padded tokens per forward (default {DEFAULT_BATCH_TOKENS})")
    p.add_argument("--shard-tokens", type=int, default=None, help="tokens per shard (default: ~256 MiB shards)")
    p.add_argument("--compile", action="store_true", default=None,
                   help="torch.compile the target (~1 min once; faster forwards, see bench/capture.py)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from draftlab.data.dataset import DataSpec, build_samples
    from draftlab.models.target import Target

    fields = {"source": args.data, "path": args.data_path, "num_conversations": args.num_conversations,
              "max_length": args.max_length, "heldout": args.heldout, "seed": args.seed}
    try:
        spec = DataSpec(**{k: v for k, v in fields.items() if v is not None})
    except ValidationError as e:
        err = e.errors()[0]
        raise DraftlabError(f"data.{'.'.join(map(str, err['loc'])) or 'spec'}: {err['msg']}") from None
    target = Target.load(args.target)
    layers = resolve_layers(args.layers, target.num_layers)  # fail on bad layers before reading data
    t0 = time.perf_counter()
    sample_set = build_samples(spec, target.tokenizer, target=target if spec.regenerate else None)
    samples = sample_set.train if args.split == "train" else sample_set.heldout
    tokens = sum(s["input_ids"].numel() for s in samples)
    print(f"data: {sample_set.report.get('summary', '')} ({time.perf_counter() - t0:.1f} s)")
    print(f"data: capturing the {args.split} split: {len(samples)} samples, {tokens} tokens "
          f"(mean {tokens / max(1, len(samples)):.0f} tokens/sample)")
    if not samples:
        raise DraftlabError(f"split: the {args.split} split is empty")
    result = capture_offline(
        target, samples, args.out, layers=layers, storage_dtype=args.dtype, shard_tokens=args.shard_tokens,
        logits=args.logits, topk=args.topk, batch_tokens=args.batch_tokens,
        data_spec={**spec.model_dump(mode="json"), "split": args.split}, progress=not args.no_progress,
        compile=args.compile, verbose=True,
    )
    m = result.manifest
    total = result.total_bytes
    if result.captured_tokens:
        print(f"capture: {result.captured_tokens} tokens in {result.seconds:.1f} s = {result.tokens_per_s:.0f} tokens/s"
              + (" (including the torch.compile warm-up)" if m["compiled"] else "")
              + (f" (resumed; {result.skipped_shards} shards were already done)" if result.skipped_shards else ""))
    else:
        print(f"capture: nothing to do, all {len(m['shards'])} shards were already complete and verified")
    print(f"capture: {m['num_tokens']} tokens, {len(m['shards'])} shards, {total / m['num_tokens']:.1f} B/token "
          f"on disk ({m['bytes_per_token']} B/token of tensor data), {human_bytes(total)} in {result.out_dir}")
    return 0
