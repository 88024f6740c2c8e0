"""Where the trainer's target features come from: one source, three modes (``capture.mode``).

* ``online``: the target runs on every micro-batch.
* ``memory``: online the first time a sample is seen, in a forward over its capture group
  (the seed's epoch-0 batches at ``capture.group_tokens``); its hidden states and the
  drafter's derived targets are then kept in RAM and reused in later epochs.
* ``offline``: hidden states are read from shards written by ``draftlab capture``
  (:mod:`draftlab.data.offline`); the drafter's derived targets are computed from them.

Every mode gives the same tensors for a micro-batch (offline: up to its storage dtype and the
rounding of its own batch shapes), so a recipe switches modes without changing what it trains.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch.nn.utils.rnn import pad_sequence

from draftlab.data.capture import capture_batch
from draftlab.data.dataset import batches_by_tokens, collate, pad_id
from draftlab.errors import DraftlabError

Hidden = dict[int, torch.Tensor]  # layer -> [B, T, H] (or [T, H] for one cached sample)


class FeatureSource:
    """``capture``: the recipe's capture section (``mode``, ``offline_dir``); ``drafter``: the
    unwrapped drafter whose ``capture_layers`` are read and whose ``derived_targets`` are
    added; ``samples``: the training samples the trainer's indices point into; ``data_spec``:
    the recipe's data section as JSON, which an offline capture must have been made from.
    ``group_tokens`` and ``seed`` (memory mode) fix the capture groups: ``batches_by_tokens``
    of epoch 0, a function of the samples alone (1: every sample alone)."""

    def __init__(self, capture, target, drafter, samples: Sequence[dict], data_spec: dict, group_tokens: int = 1, seed: int = 0):
        self.mode = capture.mode
        self.target, self.drafter, self.samples = target, drafter, samples
        self.layers: list[int] = drafter.capture_layers
        self.memory: dict[int, tuple[Hidden, dict[str, torch.Tensor]]] = {}  # sample -> (hidden, derived), unpadded
        self.groups: list[list[int]] = batches_by_tokens(samples, group_tokens, seed, epoch=0) if self.mode == "memory" else []
        self.group_of = {i: g for g, group in enumerate(self.groups) for i in group}
        self.offline = self._open_offline(capture.offline_dir, len(samples), data_spec) if self.mode == "offline" else None

    def _open_offline(self, offline_dir: str, num_samples: int, data_spec: dict):
        """The capture at ``offline_dir``, checked to be of these training samples and to hold
        every layer the drafter reads."""
        from draftlab.data.offline_dataset import OfflineDataset

        offline = OfflineDataset(offline_dir)
        where = f"capture.offline_dir {offline_dir}"
        if offline.manifest.get("data") != {**data_spec, "split": "train"}:
            raise DraftlabError(f"{where}: captured from a different data section than this recipe's")
        if missing := sorted(set(self.layers) - set(offline.layers)):
            raise DraftlabError(f"{where}: lacks hidden-state layers {missing} that this drafter reads")
        if len(offline) != num_samples:
            raise DraftlabError(f"{where}: {len(offline)} captured samples but the data section gives {num_samples}")
        return offline

    def features(self, indices: list[int], batch: dict) -> tuple[Hidden, dict]:
        """-> (hidden states {layer: [B, T, H]}, ``batch`` plus the drafter's derived targets)
        for the samples ``indices``, collated (right-padded) into ``batch``. Per-sample rows
        are zero-padded to the batch's T, the longest sample's length (``collate``)."""
        if self.mode == "memory":
            for i in indices:
                if i not in self.memory:
                    self._remember(self.groups[self.group_of[i]])
            return self._remembered(indices, batch)
        hidden = self._read_offline(indices) if self.mode == "offline" else self._run_target(batch)
        return hidden, {**batch, **self.drafter.derived_targets(hidden, batch)}

    def _run_target(self, batch: dict) -> Hidden:
        # right padding + causal attention: real tokens never see padding, so no mask is needed
        hidden = capture_batch(self.target, batch["input_ids"], self.layers)
        return {layer: hidden[layer] for layer in self.layers}  # capture_batch adds the last layer

    def _read_offline(self, indices: list[int]) -> Hidden:
        items = [self.offline[i]["hidden"] for i in indices]
        return {
            layer: pad_sequence([h[layer] for h in items], batch_first=True).to(device=self.target.device, dtype=self.target.dtype)
            for layer in self.layers
        }

    def _remember(self, group: list[int]) -> None:
        """Capture the samples ``group`` in one forward. A forward's rounding depends on the
        batch's shape, so the groups are fixed by the samples alone, never by the batch a sample
        first met: a resumed run, which refills the cache from other batches, recomputes the
        same groups in the same shapes and gets identical features."""
        batch = {k: v.to(self.target.device) for k, v in collate([self.samples[i] for i in group], pad_id(self.target.tokenizer)).items()}
        hidden = self._run_target(batch)
        derived = self.drafter.derived_targets(hidden, batch)
        for j, i in enumerate(group):
            n = self.samples[i]["input_ids"].numel()
            # copies: a view would keep the whole padded group alive
            self.memory[i] = ({layer: h[j, :n].clone() for layer, h in hidden.items()}, {k: v[j, :n].clone() for k, v in derived.items()})

    def _remembered(self, indices: list[int], batch: dict) -> tuple[Hidden, dict]:
        cached = [self.memory[i] for i in indices]
        hidden = {layer: pad_sequence([h[layer] for h, _ in cached], batch_first=True) for layer in self.layers}
        derived = {k: pad_sequence([d[k] for _, d in cached], batch_first=True) for k in cached[0][1]}
        return hidden, {**batch, **derived}
