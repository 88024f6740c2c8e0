"""What a decoding hands back (per-row results, the batch's time split) and the pieces every
decoding loop shares to get there: the emitter that applies a row's end (eos, token budget) and
the clock that times phases without making the host wait for the device."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from draftlab.inference.metrics import AcceptanceStats


@dataclass
class GenerationResult:
    tokens: list[int]  # generated tokens (eos included when it stopped the generation)
    accept_lengths: list[int] = field(default_factory=list)  # per step: drafts accepted (tree: depth)
    num_drafted: list[int] = field(default_factory=list)  # per step: draft tokens / tree nodes verified
    draft_depths: list[int] = field(default_factory=list)  # per step: longest acceptable run offered
    draft_time: float = 0.0  # proposer (propose, advance), seconds
    verify_time: float = 0.0  # the decoding loop but the proposer: target forwards, verification, roll-back
    prefill_time: float = 0.0  # the target's forward over the prompt and the proposer's start
    total_time: float = 0.0
    stop_reason: str = "length"  # "length" or "eos"
    num_steps: int = 0  # target forwards after the prefill

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.total_time if self.total_time > 0 else 0.0

    def stats(self) -> AcceptanceStats:
        s = AcceptanceStats()
        s.add_many(self.accept_lengths, self.num_drafted, self.draft_depths)
        return s


@dataclass
class BatchResult:
    """One batch's generation: per-row results and the batch's time split."""

    rows: list[GenerationResult]
    prefill_time: float = 0.0  # the target's forwards over the prompts, and the proposers' start
    draft_time: float = 0.0  # proposers: propose, advance
    verify_time: float = 0.0  # target forwards after the prefill and the verify kernels
    other_time: float = 0.0  # the rest of the decoding loop
    total_time: float = 0.0
    num_steps: int = 0  # batched target forwards after the prefill
    draft_lengths: list[int] = field(default_factory=list)  # per step: the k drafted (0: a plain step)

    @property
    def num_tokens(self) -> int:
        return sum(len(r.tokens) for r in self.rows)


class Emitter:
    """Collects emitted tokens; applies max_new_tokens and eos (truncating within a step) and
    streams what it kept to ``on_step``."""

    def __init__(self, max_new_tokens: int, eos: frozenset[int], on_step=None):
        self.tokens: list[int] = []
        self.max_new_tokens, self.eos, self.on_step = max_new_tokens, eos, on_step
        self.stop_reason: str | None = None

    def emit(self, new: list[int]) -> bool:
        """Append ``new``; True once generation is over."""
        before = len(self.tokens)
        for t in new:
            self.tokens.append(t)
            if t in self.eos:
                self.stop_reason = "eos"
                break
            if len(self.tokens) >= self.max_new_tokens:
                self.stop_reason = "length"
                break
        if self.on_step is not None:
            self.on_step(self.tokens[before:])
        return self.stop_reason is not None


class Clock:
    """Marks on one decoding's timeline and the seconds between them, less the time its decoding
    spent suspended between steps (:func:`run_lockstep`). On CUDA a mark is an event recorded on
    the stream, read once the decoding ends: timing never makes the host wait for the device.
    Elsewhere it is ``perf_counter``."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.suspended: list[tuple] = []  # (mark, mark) spans between steps

    def __call__(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, a, b) -> float:
        """Seconds from mark ``a`` to mark ``b`` (on CUDA: waits for ``b``)."""
        if not self.cuda:
            return b - a
        b.synchronize()
        return a.elapsed_time(b) / 1e3

    def pause(self):
        """Yield between two steps; the time until resumed is other decodings', not this one's."""
        t = self()
        yield
        self.suspended.append((t, self()))

    def total(self, spans) -> float:
        return sum(self.seconds(a, b) for a, b in spans)


class Stopwatch:
    """Times the calls made through it on ``clock``."""

    def __init__(self, clock: Clock):
        self.clock, self.spans = clock, []

    def __call__(self, fn, *args, **kw):
        t0 = self.clock()
        out = fn(*args, **kw)
        self.spans.append((t0, self.clock()))
        return out

    @property
    def seconds(self) -> float:
        return self.clock.total(self.spans)
