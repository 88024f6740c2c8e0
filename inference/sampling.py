"""Sampling: the decoding distribution (temperature, top-k, top-p) that plain decoding, the
verifier's target p and every draft q share, and one generation's sampling parameters."""

from __future__ import annotations

from dataclasses import dataclass

import torch


def process_logits(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """The decoding distribution, the single definition shared by plain decoding, the verifier's
    target p and any draft q: softmax(logits / T), then keep the ``top_k`` most likely tokens,
    then the smallest most-likely set whose mass reaches ``top_p`` (the top token always stays),
    renormalised. Float32 probabilities over the last dim. ``temperature`` must be > 0."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    V = probs.shape[-1]
    if 0 < top_k < V:
        kth = probs.topk(top_k, dim=-1).values[..., -1:]
        probs = probs.masked_fill(probs < kth, 0.0)
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # A token is dropped once the mass strictly before it already reaches top_p.
        before = sorted_p.cumsum(-1) - sorted_p
        drop_sorted = before >= top_p * sorted_p.sum(-1, keepdim=True)
        drop_sorted[..., 0] = False
        probs = probs.masked_fill(torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted), 0.0)
    return probs / probs.sum(-1, keepdim=True)


@dataclass
class Sampling:
    """Decoding parameters of one generation. ``temperature == 0`` means greedy."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    generator: torch.Generator | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """Processed distribution over the last dim (one-hot on the argmax when greedy)."""
        if self.greedy:
            return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
        return process_logits(logits, self.temperature, self.top_k, self.top_p)

    def sample(self, probs: torch.Tensor) -> torch.Tensor:
        """One token per row of ``probs`` [..., V] (argmax when greedy), drawn with the generator."""
        if self.greedy:
            return probs.argmax(-1)
        flat = probs.reshape(-1, probs.shape[-1])
        return torch.multinomial(flat, 1, generator=self.generator).view(probs.shape[:-1])
