"""Sparse self-speculation: SparseSpec's PillarAttn (``--drafter sparsespec``; Zhao et al. 2025,
arXiv 2512.01278, code sspec-project/SparseSpec) and a StreamingLLM-style sliding window at the
same budget (``--drafter streaming``), both training-free.

The target drafts for itself with sparse attention and verifies with full attention. A draft
step is one forward of the target over each row's last token (then its last draft) through the
decoder's own KV cache (:class:`~draftlab.inference.decoder.TargetSteps`, as layer skipping
does): every layer and KV head attends only to the past keys its selection lists plus every
token appended since the selection was made (the kept tokens since, then the drafts), gathered
(:class:`~draftlab.models.sparse_attention.SparseKeys`). What drafts write is rolled back once
``propose`` returns and rewritten by the verify forward.

The selection (the reference's ``PillarCachePtr.get_select_metadata``, ``serve/request/
kv_cache_ptr/pillar.py``): after a verify, L = the row's kept length and K = max(budget,
ceil(fraction * L)) (128 and 0.05 there), at most L. The verified step's r kept inputs (its last
token and accepted drafts) are always attended and count towards K; the other K - r keys, per
layer and KV head, are those with the highest score in the verify pass among the keys before
it, each key's score its attention probability averaged over the query heads of its KV head's
group and over the verify's inputs (recorded in that pass: :class:`~draftlab.models.
sparse_attention.AttentionRecorder`; the reference dumps the same average from its attention
kernel, ``serve/attention/backend.py``).

Refresh: the reference verifies every ``stride`` draft steps (its draft length is the stride, 8)
and refreshes at each verify. Here the chain length k is the shape's: the selection is refreshed
at the first verify after ``stride`` or more draft steps used it (k = stride: every verify),
and the verify passes in between record nothing. Before the first verify the drafts attend to
every key (the reference's cold start).

The sliding window (the reference's ``StreamingCachePtr``): at each refresh the first ``sink``
keys (16) and the most recent ones, K keys in all with the same budget rule (or ``sink +
window`` with ``window`` set), plus what is appended since; it needs no scores, so it is sparse
from the first draft.

Lossless: greedy drafts are the argmax (point masses); sampled drafts are drawn from
``sampling.probs`` of the draft logits and carry them, verified by rejection sampling. Chains
only, always k drafts (``min_confidence`` is not used: every verify pass scores k + 1 inputs).

The device loop (:mod:`~draftlab.inference.spec_loop`) does not run it (no
:class:`~draftlab.inference.proposer.DraftsOnDevice`): K grows with each row's length and the
selection is a per-row top-k of scores that the verify forward would have to write from inside
the fused decode layer (``kernels/decode_layer.py``), which has neither seam; the host loop runs it.
"""

from __future__ import annotations

import math

import torch

from draftlab.device import device_ints
from draftlab.errors import DraftlabError
from draftlab.inference.proposer import FREE_DRAFTERS, BatchProposer, DraftsWithTarget, RowProposers
from draftlab.inference.sampling import Sampling
from draftlab.inference.shapes import Chain, ChainDraft
from draftlab.limits import MAX_NEW_TOKENS
from draftlab.models.sparse_attention import SparseKeys


def key_budget(length: int, budget: int, fraction: float) -> int:
    """K = max(budget, ceil(fraction * length)), at most ``length`` (the reference's token budget)."""
    return min(length, max(budget, math.ceil(fraction * length)))


def _int_option(drafter: str, option: str, value, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= MAX_NEW_TOKENS:
        raise DraftlabError(f"{drafter} drafter: {option} must be an integer in {low}..{MAX_NEW_TOKENS}, got {value!r}")
    return value


class SparseSelfSpec(BatchProposer, DraftsWithTarget):
    """The target drafting over a per-layer, per-KV-head subset of its own cache; subclasses
    say how the subset is chosen (:meth:`choose`) and whether that needs the verify's scores."""

    shapes = frozenset({"chain"})
    layers = ()  # reads no hidden state: it runs the target
    needs_scores = False
    OPTIONS: dict[str, type] = {}

    def __init__(self, budget: int = 128, fraction: float = 0.05, stride: int = 8):
        super().__init__()
        self.budget = _int_option(self.name, "budget", budget, 1)
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0.0 <= fraction <= 1.0:
            raise DraftlabError(f"{self.name} drafter: fraction must be a number in [0, 1], got {fraction!r}")
        self.fraction = float(fraction)
        self.stride = _int_option(self.name, "stride", stride, 1)
        # what the draft forwards read, summed over rows and draft steps (per layer and KV head)
        self.keys_read, self.keys_full, self.refreshes = 0, 0, 0

    @classmethod
    def from_options(cls, options: dict[str, str]):
        kwargs = {}
        for key, value in options.items():
            kind = cls.OPTIONS.get(key)
            if kind is None:
                known = ", ".join(cls.OPTIONS)
                raise DraftlabError(f"--drafter-option {key}: not an option of drafter '{cls.name}' (options: {known})")
            try:
                kwargs[key] = kind(value)
            except ValueError:
                what = "an integer" if kind is int else "a number"
                raise DraftlabError(f"--drafter-option {key}: expected {what}, got {value!r}") from None
        cls(**kwargs)  # every value checked before the target loads
        return lambda target: cls(**kwargs)

    def size(self, length: int) -> int:
        """The keys attended at a refresh of a row of ``length`` kept tokens."""
        return key_budget(length, self.budget, self.fraction)

    def choose(self, scores: torch.Tensor | None, before: int, n: int, layers: int, heads: int, device) -> torch.Tensor:
        """Long[layers, heads, n]: the slots among 0..before-1 each layer and KV head attends to
        (``scores`` [layers, heads, >= before]: the verify pass's, when :attr:`needs_scores`)."""
        raise NotImplementedError

    @property
    def kv_read_fraction(self) -> float | None:
        """Keys the draft forwards read over the keys full-attention forwards would (None: none ran)."""
        return self.keys_read / self.keys_full if self.keys_full else None

    def rows(self, n: int) -> "SparseRows":
        return SparseRows(self, n)


@FREE_DRAFTERS.register("sparsespec")
class SparseSpecProposer(SparseSelfSpec):
    """Options: ``budget`` (K's floor, 128), ``fraction`` (of the kept length, 0.05), ``stride``
    (draft steps between refreshes, 8). PillarAttn: the keys the verify pass attended to most."""

    name = "sparsespec"
    needs_scores = True
    OPTIONS = {"budget": int, "fraction": float, "stride": int}

    def choose(self, scores, before, n, layers, heads, device):
        return scores[..., :before].topk(n, dim=-1).indices.sort(-1).values


@FREE_DRAFTERS.register("streaming")
class StreamingProposer(SparseSelfSpec):
    """Options: ``budget``, ``fraction``, ``stride`` as sparsespec's; ``sink`` (first keys always
    kept, 16), ``window`` (recent keys at a refresh; default: the budget's K less the sinks)."""

    name = "streaming"
    OPTIONS = {"budget": int, "fraction": float, "stride": int, "sink": int, "window": int}

    def __init__(self, budget: int = 128, fraction: float = 0.05, stride: int = 8, sink: int = 16, window: int | None = None):
        super().__init__(budget, fraction, stride)
        self.sink = _int_option(self.name, "sink", sink, 0)
        self.window = None if window is None else _int_option(self.name, "window", window, 1)

    def size(self, length: int) -> int:
        return super().size(length) if self.window is None else min(length, self.sink + self.window)

    def choose(self, scores, before, n, layers, heads, device):
        sinks = min(self.sink, n)
        slots = torch.cat([torch.arange(sinks, device=device), torch.arange(before - (n - sinks), before, device=device)])
        return slots.expand(layers, heads, n)


class SparseRows(RowProposers):
    """The rows of a batch, drafted in the same forwards. Per row: its last token, ``base`` (the
    slots from it on are always attended), ``chosen`` (Long[layers, heads, n], its selection
    before ``base``), the draft steps since its refresh, and the recorder armed for the next
    verify with the cache length the draft began at (that verify's first slot)."""

    def __init__(self, proposer: SparseSelfSpec, n: int):
        super().__init__([])
        self.proposer = proposer
        self.sampling = Sampling()
        self.steps = None
        self.last, self.base, self.since, self.pre = [0] * n, [0] * n, [0] * n, [0] * n
        self.chosen: list[torch.Tensor | None] = [None] * n
        self.pending = None  # the AttentionRecorder of the verify after the last draft, if one was due

    def configure(self, sampling: Sampling) -> None:
        self.sampling = sampling

    def use_target(self, steps) -> None:
        self.steps = steps

    def _shape(self) -> tuple[int, int]:
        config = self.steps.target.config
        return config.num_hidden_layers, config.num_key_value_heads

    def _check_steps(self) -> None:
        if self.steps is None:
            raise DraftlabError(f"drafter '{self.proposer.name}' drafts with the target through the decoder "
                                "(DraftsWithTarget.use_target), which the proposer wrapping it does not pass on")

    def start(self, row, prompt_ids, hidden, next_token) -> None:
        self._check_steps()
        self.last[row] = int(next_token)
        n = int(prompt_ids.numel())  # the prompt's cache length
        if self.proposer.needs_scores:  # cold start: every key until the first verify's scores
            self.base[row], self.since[row] = 0, self.proposer.stride
            self.chosen[row] = torch.zeros(*self._shape(), 0, dtype=torch.long, device=prompt_ids.device)
        else:
            self._refresh(row, None, n, n)

    def _refresh(self, row: int, scores: torch.Tensor | None, length: int, pre: int) -> None:
        """A new selection for ``row`` of ``length`` kept tokens whose slots from ``pre`` on are
        the kept inputs of the verify (and anything kept after it): always attended, counted in K."""
        layers, heads = self._shape()
        n = max(0, min(self.proposer.size(length) - (length - pre), pre))
        device = self.steps.target.device
        self.chosen[row] = self.proposer.choose(scores, pre, n, layers, heads, device)
        self.base[row], self.since[row] = pre, 0
        self.proposer.refreshes += 1

    def advance(self, accepted, hidden, rows) -> None:
        """Each row's kept tokens: its next first input; a due refresh, from the verify's scores."""
        rec, self.pending = self.pending, None
        lengths = self.steps.lengths()
        for r, a in zip(rows, accepted):
            self.last[r] = int(a.reshape(-1)[-1])
            if self.since[r] < self.proposer.stride:
                continue
            if not self.proposer.needs_scores:
                self._refresh(r, None, lengths[r], self.pre[r])
            elif rec is not None and rec.complete:
                self._refresh(r, torch.stack([s[r] for s in rec.scores]), lengths[r], self.pre[r])

    def select(self, rows: list[int]) -> None:
        for name in ("last", "base", "since", "pre", "chosen"):
            setattr(self, name, [getattr(self, name)[r] for r in rows])
        if self.pending is not None:
            self.pending.select(rows)

    def _keys(self, lengths: list[int]) -> SparseKeys:
        """Each row's selection, then its slots from ``base`` up to its next input (padded to the
        longest row: index 0, not valid)."""
        layers, heads = self._shape()
        device = self.steps.target.device
        counts = [c.shape[-1] for c in self.chosen]
        recent = [n - b for n, b in zip(lengths, self.base)]
        M = max(c + r for c, r in zip(counts, recent))
        index = torch.zeros(layers, len(lengths), heads, M, dtype=torch.long, device=device)
        valid = torch.zeros(index.shape, dtype=torch.bool, device=device)
        for r, (c, chosen) in enumerate(zip(counts, self.chosen)):
            index[:, r, :, :c] = chosen
            index[:, r, :, c : c + recent[r]] = torch.arange(self.base[r], lengths[r], device=device)
            valid[:, r, :, : c + recent[r]] = True
        self.proposer.keys_read += sum(c + n for c, n in zip(counts, recent)) * layers * heads
        self.proposer.keys_full += sum(lengths) * layers * heads
        return SparseKeys(index, valid)

    @torch.no_grad()
    def propose(self, shape: Chain) -> list[ChainDraft]:
        """k forwards of every row over its sparse keys; then, where a refresh is due, the next
        forward over the cache (the verify) records its attention scores."""
        self._check_steps()
        device = self.steps.target.device
        self.pre = self.steps.lengths()
        inputs = device_ints(self.last, device)[:, None]
        tokens, probs = [], []
        for j in range(shape.k):
            keys = self._keys([n + j for n in self.pre])
            logits = self.steps.forward(inputs, keys=keys, logits="last").logits[:, -1].float()
            if self.sampling.greedy:
                tok = logits.argmax(-1)
            else:
                q = self.sampling.probs(logits)
                tok = self.sampling.sample(q)
                probs.append(q)
            tokens.append(tok)
            inputs = tok[:, None]
        self.since = [s + shape.k for s in self.since]
        if self.proposer.needs_scores and any(s >= self.proposer.stride for s in self.since):
            self.pending = self.steps.record_next_forward()
        chains = torch.stack(tokens, 1)
        q = torch.stack(probs, 1) if probs else None
        return [ChainDraft(chains[r], None if q is None else q[r]) for r in range(len(self.last))]
