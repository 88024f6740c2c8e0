"""Reading a finished offline capture (the shard format of :mod:`draftlab.data.offline`)."""

from __future__ import annotations

import bisect
from pathlib import Path
from typing import Any

import torch

from draftlab.data.offline import FORMAT_VERSION, MANIFEST, read_manifest
from draftlab.errors import DraftlabError
from draftlab.models.target import file_sha256


class OfflineDataset(torch.utils.data.Dataset):
    """Samples of a finished offline capture, read lazily from the shards.

    ``ds[i]`` -> ``{"input_ids": Long[T], "loss_mask": Bool[T], "hidden": {layer: Float[T, H]}}``,
    hidden cast back to float32: per sample, what :func:`~draftlab.data.capture.capture_batch`
    gives for a batch. Each shard's checksum is verified when it is first opened
    (``check=False`` skips that; :meth:`verify` checks all at once)."""

    def __init__(self, out_dir: str | Path, check: bool = True):
        self.out_dir = Path(out_dir)
        path = self.out_dir / MANIFEST
        if not path.is_file():
            raise DraftlabError(f"{path}: no capture manifest (run draftlab capture --out {self.out_dir})")
        self.manifest = read_manifest(path)
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
        return {
            "input_ids": handle.get_slice("input_ids")[a:b].long(),
            "loss_mask": handle.get_slice("loss_mask")[a:b],
            "hidden": {layer: handle.get_slice(f"hidden.{layer}")[a:b].float() for layer in self.layers},
        }

    def __iter__(self):
        for i in range(len(self)):
            yield self[i]

    def __getstate__(self):  # DataLoader workers: safetensors handles do not pickle; reopen lazily
        state = self.__dict__.copy()
        state["_open"] = {}
        return state
