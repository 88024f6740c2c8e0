"""The one interface between the speculative decoder and whatever drafts tokens.

The decoder and the verify kernels never know which drafter is behind a proposer: EAGLE-1,
EAGLE-3, n-gram prompt lookup (and later Medusa, diffusion) all implement this.

Protocol, for one sequence (batch size 1; see ``Proposer.supports_batch``):

0. ``configure(sampling)`` before each generation: the decoding parameters (temperature,
   top-k, top-p and the seeded generator). A proposer that returns draft probabilities uses
   ``sampling.probs(logits)`` for them and ``sampling.sample(probs)`` to draw its tokens.
1. ``start(prompt_ids, hidden, next_token)`` after the target's prefill. ``hidden`` holds the
   target's hidden states (indices in ``Proposer.layers``) for every prompt position and
   ``next_token`` is the token the target produced after the prompt. Shapes: ``prompt_ids``
   Long[T]; hidden tensors [1, T, H] as the target returns them.
2. ``propose(k)`` drafts a chain of at most ``k`` tokens following everything seen so far (it may
   return fewer, even none), or ``propose_tree(spec)`` drafts a tree rooted at the last token.
3. The decoder verifies with one target forward over ``[last token, drafts...]`` and calls
   ``advance(accepted, hidden)``: ``accepted`` = accepted draft tokens then the bonus/correction
   token (n + 1 tokens); ``hidden`` = the target's hidden states for the n + 1 *inputs* that
   were verified and kept (the previous last token and the n accepted drafts; for a tree, the
   root and the accepted path's nodes).

Losslessness contract for sampling (temperature > 0): ``ChainDraft.probs[j]`` must be the
distribution ``tokens[j]`` was actually drawn from, processed by ``sampling.probs`` so the draft
q sees the same temperature / top-k / top-p as the target's p. A proposer that picks tokens
deterministically (argmax, top-k tree expansion, prompt lookup) returns ``probs=None``: the
verifier then treats each draft as a point mass, which is lossless for any choice of tokens.
Tree siblings must carry distinct tokens.
"""

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


@dataclass
class ChainDraft:
    tokens: torch.Tensor  # Long[k], target-vocab ids (k may be smaller than asked, even 0)
    probs: torch.Tensor | None = None  # Float[k, V] draft distribution per position (None = point mass)


@dataclass
class TreeSpec:
    """EAGLE-2 dynamic tree shape: ``depth`` expansion steps, ``top_k`` children per node,
    at most ``total_tokens`` draft nodes kept after reranking by cumulative log-prob."""

    depth: int = 5
    top_k: int = 8
    total_tokens: int = 48


@dataclass
class DraftTree:
    # Node numbering: node 0 is the root (the last verified token); draft i is node i + 1.
    # Nodes are ordered so that a parent precedes its children, and siblings carry distinct tokens.
    tokens: torch.Tensor  # Long[N] draft tokens (root excluded), target-vocab ids
    parents: torch.Tensor  # Long[N] parent node index of draft i (0 = the root)
    depth: torch.Tensor  # Long[N] depth of each draft (1 = child of the root)


class Proposer:
    """Base class: a drafter seen from the decoder."""

    name: str = "proposer"
    layers: tuple[int, ...] = ()  # target hidden-state indices needed in start/advance
    supports_tree: bool = False
    supports_batch: bool = False
    sampling: Sampling = Sampling()

    def configure(self, sampling: Sampling) -> None:
        self.sampling = sampling

    def start(self, prompt_ids: torch.Tensor, hidden: dict[int, torch.Tensor], next_token: int) -> None:
        raise NotImplementedError

    def propose(self, k: int) -> ChainDraft:
        raise NotImplementedError

    def propose_tree(self, spec: TreeSpec) -> DraftTree:
        raise NotImplementedError(f"{self.name} does not draft trees")

    def advance(self, accepted: torch.Tensor, hidden: dict[int, torch.Tensor]) -> None:
        raise NotImplementedError
