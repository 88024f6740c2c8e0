"""Offline capture: the target's hidden states of a sample set, written into resumable shards.

Layout of ``out_dir`` (read back by :class:`draftlab.data.offline_dataset.OfflineDataset`)::

    manifest.json              format, target identity, layers, dtype, data, shard list
    shard-00000.safetensors    whole samples, tokens concatenated:
                               input_ids I32[N], loss_mask BOOL[N], sample_offsets I64[n+1],
                               hidden.<layer> [N, H] (storage dtype)

Shards are a pure function of (samples, shard_tokens) and each shard's batches a pure function
of its samples and batch_tokens, so a run killed midway and resumed writes the same bytes as
one that never stopped. Every file is written atomically (:mod:`draftlab.atomic`, fsynced); the
manifest is rewritten after each shard, and a restart re-verifies the recorded checksums.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from draftlab.atomic import write_bytes, write_json, writable_dir
from draftlab.data.capture import compiled_forward, resolve_layers
from draftlab.errors import DraftlabError
from draftlab.models.target import file_sha256

FORMAT = "draftlab-capture"
FORMAT_VERSION = 2  # 2: no top-k log-prob tensors, no logits/topk manifest fields
MANIFEST = "manifest.json"
STORAGE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# Padded tokens per forward: on CPU larger batches only add memory traffic
# (BENCHMARKS.md, "Hidden-state capture throughput").
DEFAULT_BATCH_TOKENS = 1024
DEFAULT_SHARD_BYTES = 256 << 20  # default shard_tokens = this / bytes per token

Sample = dict[str, torch.Tensor]


def read_manifest(path: Path) -> dict:
    """The capture manifest at ``path`` (a one-line DraftlabError if it is not one)."""
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DraftlabError(f"{path}: not valid JSON ({getattr(e, 'msg', None) or e.reason})") from None
    except OSError as e:
        raise DraftlabError(f"{path}: cannot read ({e.strerror or e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise DraftlabError(f"{path}: not a draftlab capture manifest")
    return manifest


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


def bytes_per_token(num_layers: int, hidden_size: int, storage_dtype: str) -> int:
    """Stored bytes per token: hidden states + input_ids (int32) + loss_mask (bool).
    Per-sample offsets and file headers come on top."""
    itemsize = torch.empty((), dtype=STORAGE_DTYPES[storage_dtype]).element_size()
    return num_layers * hidden_size * itemsize + 4 + 1


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError


# ------------------------------------------------------------------------------ one shard
@torch.inference_mode()
def capture_samples(
    target,
    samples: Sequence[Sample],
    layers: list[int],
    dtype: torch.dtype = torch.bfloat16,
    batch_tokens: int = DEFAULT_BATCH_TOKENS,
    on_tokens: Callable[[int], None] | None = None,
    compile: bool = False,
) -> dict[str, torch.Tensor]:
    """The tensors of one shard, in memory: ``samples`` concatenated in order (see the module
    docstring for names), computed in :func:`plan_batches` batches. ``layers`` are resolved
    indices; ``on_tokens(n)`` after each batch; ``compile`` runs the target through
    :func:`~draftlab.data.capture.compiled_forward`."""
    lengths = [s["input_ids"].numel() for s in samples]
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    N, H = offsets[-1], target.hidden_size
    hidden = {layer: torch.empty(N, H, dtype=dtype) for layer in layers}
    device = target.device
    forward = compiled_forward(target) if compile else target
    for batch in plan_batches(lengths, batch_tokens):
        T = lengths[batch[0]]
        ids = torch.zeros(len(batch), T, dtype=torch.long)
        for r, i in enumerate(batch):
            ids[r, : lengths[i]] = samples[i]["input_ids"]
        out = forward(ids.to(device), layers=layers, logits=None)  # right padding: plain causal forward
        # on CPU the per-sample copy_ below also casts (one pass); from an accelerator, cast
        # there and move each layer once
        states = {layer: h if h.device.type == "cpu" else h.to(dtype).cpu() for layer, h in out.hidden.items()}
        for r, i in enumerate(batch):
            a, b = offsets[i], offsets[i + 1]
            for layer in layers:
                hidden[layer][a:b].copy_(states[layer][r, : b - a])
        if on_tokens is not None:
            on_tokens(sum(lengths[i] for i in batch))
    tensors = {
        "input_ids": torch.cat([s["input_ids"] for s in samples]).to(torch.int32),
        "loss_mask": torch.cat([s["loss_mask"] for s in samples]).to(torch.bool),
        "sample_offsets": torch.tensor(offsets, dtype=torch.int64),
    }
    tensors.update({f"hidden.{layer}": h for layer, h in hidden.items()})
    return tensors


def _shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def _write_shard(path: Path, tensors: dict[str, torch.Tensor]) -> tuple[int, str]:
    """Write the shard durably (a resume trusts it by checksum); returns (bytes, sha256)."""
    from safetensors.torch import save

    # one metadata key only: safetensors writes metadata in hash-map order, which differs run to run
    blob = save(tensors, metadata={"format": f"{FORMAT}/{FORMAT_VERSION}"})
    write_bytes(path, blob, durable=True)
    return len(blob), hashlib.sha256(blob).hexdigest()


# ------------------------------------------------------------------------------ resuming
def _identity_mismatch(old: dict, new: dict) -> str | None:
    for key, label in (
        ("format_version", "format version"),
        ("target", "target"),
        ("layers", "layers"),
        ("storage_dtype", "dtype"),
        ("data", "data spec"),
        ("data_fingerprint", "data (samples differ)"),
        ("shard_tokens", "shard_tokens"),
        ("batch_tokens", "batch_tokens"),
        ("compiled", "compile"),
    ):
        if old.get(key) != new.get(key):
            return f"{label}: {old.get(key)!r} there, {new.get(key)!r} now"
    return None


def _verified_shards(out_dir: Path, old: dict | None, plan: list[tuple[int, int]], verbose: bool) -> dict[int, dict]:
    """Index -> manifest entry of the previous run's shards that are still planned and whose
    file matches its recorded sha256; the others get captured again."""
    done: dict[int, dict] = {}
    for entry in (old or {}).get("shards", []):
        idx = entry.get("index")
        path = out_dir / str(entry.get("file"))
        if (isinstance(idx, int) and idx < len(plan) and tuple(entry["samples"]) == plan[idx]
                and path.is_file() and file_sha256(path) == entry["sha256"]):
            done[idx] = entry
        elif verbose:
            print(f"capture: {entry.get('file')} is missing or fails its checksum; capturing it again")
    return done


def _spec_dict(spec) -> dict | None:
    if spec is None:
        return None
    if hasattr(spec, "model_dump"):
        return spec.model_dump(mode="json")
    return json.loads(json.dumps(spec))  # plain dict: keep only what JSON keeps, as the manifest will


# ------------------------------------------------------------------------------ capture
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


@torch.inference_mode()
def capture_offline(
    target,
    samples: Sequence[Sample],
    out_dir: str | Path,
    layers: str | Sequence[int],
    storage_dtype: str = "bfloat16",
    shard_tokens: int | None = None,
    batch_tokens: int | None = None,
    data_spec=None,
    progress: bool = True,
    on_shard: Callable[[int, dict], None] | None = None,
    compile: bool | None = None,
    verbose: bool | None = None,
) -> CaptureResult:
    """Capture ``samples`` (in order) into ``out_dir``, resuming a previous run there.

    ``layers``: see :func:`~draftlab.data.capture.resolve_layers`. ``shard_tokens``/
    ``batch_tokens``/``compile`` default to the values recorded by the run being resumed, else
    to ~256 MiB shards, :data:`DEFAULT_BATCH_TOKENS` and eager mode (``compile=True``: see
    :func:`~draftlab.data.capture.compiled_forward`). ``data_spec`` (a DataSpec or dict) is
    recorded in the manifest. ``on_shard(index, entry)`` is called after each shard is
    committed. ``progress`` shows a tqdm bar; ``verbose`` (default: ``progress``) prints the
    size estimate and recaptured shards. Raises :class:`DraftlabError` when ``out_dir`` holds a
    different capture."""
    out_dir = Path(out_dir)
    if storage_dtype not in STORAGE_DTYPES:
        raise DraftlabError(f"dtype: expected one of {', '.join(STORAGE_DTYPES)}, got '{storage_dtype}'")
    layer_ids = resolve_layers(layers, target.num_layers)
    lengths = _validate_samples(samples, getattr(target.config, "max_position_embeddings", None))
    bpt = bytes_per_token(len(layer_ids), target.hidden_size, storage_dtype)
    for name, value in (("shard_tokens", shard_tokens), ("batch_tokens", batch_tokens)):
        if value is not None and value < 1:
            raise DraftlabError(f"{name}: must be a positive number of tokens, got {value}")

    verbose = progress if verbose is None else verbose
    manifest_path = out_dir / MANIFEST
    old = None
    if manifest_path.is_file():
        old = read_manifest(manifest_path)
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
    writable_dir(out_dir, "out")  # a full or read-only disk is one line before any capture work
    for stray in out_dir.glob(".*.tmp"):  # left by a kill mid-write; never referenced
        stray.unlink(missing_ok=True)
    done = _verified_shards(out_dir, old, plan, verbose)
    manifest["shards"] = [done[i] for i in sorted(done)]
    write_json(manifest_path, manifest, durable=True)

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
            tensors = capture_samples(target, samples[a:b], layer_ids, dtype, batch_tokens, bar.update, compile)
            name = _shard_name(idx)
            size, digest = _write_shard(out_dir / name, tensors)
            tokens = sum(lengths[a:b])
            entry = {"index": idx, "file": name, "samples": [a, b], "tokens": tokens, "bytes": size, "sha256": digest}
            done[idx] = entry
            captured += tokens
            manifest["shards"] = [done[i] for i in sorted(done)]
            write_json(manifest_path, manifest, durable=True)
            if on_shard is not None:
                on_shard(idx, entry)
    finally:
        bar.close()
    seconds = time.perf_counter() - start
    manifest["complete"] = True
    write_json(manifest_path, manifest, durable=True)
    return CaptureResult(out_dir, manifest, captured, skipped, seconds)
