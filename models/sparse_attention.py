"""Two seams in the target's attention for self-speculation with sparse attention (SparseSpec,
:mod:`draftlab.inference.sparsespec`). Both are off by default and cost one ``is None`` test per
layer when off (:meth:`draftlab.models.target.Target._layer`); both apply to forwards over a
:class:`~draftlab.models.target.RaggedKVCache`, the decoding cache.

- **Recording** (:class:`AttentionRecorder`, set as the cache's ``recorder``): the next forward
  over that cache hands each layer's attention scores to the recorder, per KV head, each key's
  softmax probability averaged over the query heads of the KV head's group and over the
  forward's inputs (:func:`mean_key_attention`). The forward then detaches it: it records one
  forward, the verify pass it was set for (PillarAttn reads its selection off the verify pass).
- **Sparse keys** (:class:`SparseKeys`, ``Target.forward(keys=...)``): each input attends, per
  layer and KV head, only to the past slots listed, plus the forward's own inputs up to itself;
  the listed keys are gathered, so a draft step reads those keys and values only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class SparseKeys:
    """Past cache slots each row's inputs attend to, per layer and KV head. A row may list fewer
    than M slots: ``valid`` marks the ones that count (padding's index is read, never used). The
    slots must lie before the row's inputs: the inputs themselves are always attended (causal)."""

    index: torch.Tensor  # Long[L, B, H_kv, M]
    valid: torch.Tensor  # Bool[L, B, H_kv, M]


def sparse_attention(q, k_cache, v_cache, k_new, v_new, index, valid, scale: float) -> torch.Tensor:
    """One layer's attention of ``q`` [B, h, T, D] over the slots ``index`` [B, h_kv, M] (where
    ``valid``) of ``k_cache``/``v_cache`` [B, h_kv, S, D] and over the inputs' own ``k_new``/``v_new``
    [B, h_kv, T, D], causal among them; [B, h, T, D]."""
    B, h, T, D = q.shape
    hk = k_new.shape[1]
    gather = index[..., None].expand(-1, -1, -1, D)
    k = torch.cat([k_cache.gather(2, gather), k_new], 2)
    v = torch.cat([v_cache.gather(2, gather), v_new], 2)
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    mask = torch.cat([valid[:, :, None, :].expand(B, hk, T, -1), causal.expand(B, hk, T, T)], -1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.repeat_interleave(h // hk, 1), scale=scale, enable_gqa=True)


def mean_key_attention(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Each key's attention probability, averaged over the query heads sharing its KV head and
    over the T inputs: q [B, h, T, D], k [B, h_kv, S, D], mask bool [B, 1, T, S] (True = may
    attend) -> [B, h_kv, S], in float32. A key no input may see scores 0."""
    B, h, T, D = q.shape
    hk, S = k.shape[1], k.shape[2]
    logits = torch.einsum("bkgtd,bksd->bkgts", q.reshape(B, hk, h // hk, T, D).float(), k.float()) * scale
    logits = logits.masked_fill(~mask.reshape(B, 1, 1, T, S), float("-inf"))
    return logits.softmax(-1).mean((2, 3))


class AttentionRecorder:
    """The per-layer scores of one forward over a ragged cache (:func:`mean_key_attention`), kept
    for the cache rows ``rows`` in that order (a decoder's cache holds idle rows too)."""

    def __init__(self, num_layers: int, rows: list[int]):
        self.rows = list(rows)
        self.scores: list[torch.Tensor | None] = [None] * num_layers  # [len(rows), H_kv, span]

    def record(self, i: int, q: torch.Tensor, groups, mask: torch.Tensor, scale: float) -> None:
        """Layer ``i``: ``groups`` as :meth:`RaggedKVCache.update` returns them (first row, end
        row, K over the group's span, V), ``mask`` [B, 1, T, span]; shorter groups pad with 0."""
        B, span = q.shape[0], mask.shape[-1]
        out = q.new_zeros(B, groups[0][2].shape[1], span, dtype=torch.float32)
        for lo, hi, kg, _ in groups:
            n = kg.shape[2]
            out[lo:hi, :, :n] = mean_key_attention(q[lo:hi], kg, mask[lo:hi, ..., :n], scale)
        self.scores[i] = out[self.rows]

    @property
    def complete(self) -> bool:
        return all(s is not None for s in self.scores)

    def select(self, rows: list[int]) -> None:
        """Keep the scores of ``rows`` (positions in ``self.rows``) only: finished rows left."""
        self.rows = [self.rows[r] for r in rows]
        index = torch.tensor(rows, dtype=torch.long)
        self.scores = [None if s is None else s[index.to(s.device)] for s in self.scores]
