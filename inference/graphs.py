"""Decoding forwards replayed as CUDA graphs.

On a GPU a small target's decode forward is bound by launching its kernels, not by its weights
(BENCHMARKS.md, "Verify kernels on a GPU"): every row count and draft length costs about the
same. A CUDA graph launches a captured forward's kernels as one. A graph replays fixed
addresses and shapes, so the forwards run over a *static* KV cache (every forward attends over
all of the cache's slots, see :class:`~draftlab.models.target.RaggedKVCache`) that this module
keeps across decodings, and each captured shape keeps its own input buffers.

``GraphedTarget(target)`` stands wherever the decoder takes a target: each forward over a
ragged cache settles its layout on the host as before (:meth:`RaggedKVCache.begin`), copies it
into the buffers of the graph captured for its shape (rows, inputs, logits, layers read, layers
skipped), replays the graph and hands back copies of its outputs. A shape seen for the first
time is captured then; shapes past ``max_graphs`` or wider than ``max_inputs`` run eagerly on the
same cache, as do shapes whose capture fails (an op that waits on the host), and
:attr:`GraphedTarget.stats` counts each kind, which the report shows.

A prompt's prefill (:meth:`GraphedTarget.prefill_prompt`) replays a graph of its width rounded up
to a power of two, in a one-row buffer of that width's own, and the caller copies the prompt's
K/V into its row: eagerly, a prefill launches a whole forward's kernels once per prompt, which on
a GPU costs tens of decode steps. Prompts longer than ``max_prefill``, or whose padding would pass
the target's positions, run eagerly.

``mode="replay"`` runs the same code on any device without CUDA: a "replay" runs the captured
function again from its buffers, so tests on CPU prove a replayed step reads nothing but what
was copied in."""

from __future__ import annotations

import weakref
from collections import Counter
from dataclasses import dataclass
from typing import Callable

import torch

from draftlab.errors import DraftlabError
from draftlab.inference.prefill import Prefilled
from draftlab.inference.proposer import OwnModel
from draftlab.device import device_ints
from draftlab.models.target import CACHE_SLOT_MULTIPLE, RaggedKVCache, TargetOutput


@dataclass
class _Graph:
    """A captured forward and its input buffers: the step's inputs, each row's cache length [B, 1],
    and, where the forward takes them, position offsets [B, T] and the attention mask."""

    ids: torch.Tensor
    lengths: torch.Tensor
    offsets: torch.Tensor | None
    mask: torch.Tensor | None
    replay: Callable[[], TargetOutput]


# the narrowest prefill graph: shorter prompts pad to it (a few more positions cost nothing on a GPU)
PREFILL_MIN = 32


@dataclass
class _Prefill:
    """A captured prefill of one width: its inputs [1, width] (the prompt, then padding), the
    prompt's last position [1], its own one-row cache and that cache's lengths (zeros)."""

    ids: torch.Tensor
    last: torch.Tensor
    cache: RaggedKVCache
    lengths: torch.Tensor
    replay: Callable[[], TargetOutput]


class GraphedTarget:
    """A :class:`~draftlab.models.target.Target` whose decoding forwards replay captured graphs;
    every other attribute is the target's."""

    def __init__(self, target, mode: str = "cuda", max_graphs: int = 64, max_inputs: int = 64, min_len: int = 1024,
                 max_prefill: int = 4096):
        if mode not in ("cuda", "replay"):
            raise ValueError(f"GraphedTarget: mode must be 'cuda' or 'replay', not {mode!r}")
        if mode == "cuda" and target.device.type != "cuda":
            raise DraftlabError(f"CUDA graphs need the target on a CUDA device, not {target.device}")
        self.target, self.mode = target, mode
        self.max_graphs, self.max_inputs, self.min_len, self.max_prefill = max_graphs, max_inputs, min_len, max_prefill
        self.stats: Counter = Counter()  # replayed, captured, eager: <why>
        self._buffers: list[tuple[RaggedKVCache, Callable]] = []  # (buffer, its current user's weakref)
        self._graphs: dict[tuple, _Graph] = {}
        self._failed: dict[tuple, str] = {}  # shapes whose capture failed: eager, and why
        self._prefills: dict[tuple, _Prefill] = {}  # (width, layers) -> its graph
        self._pool = torch.cuda.graph_pool_handle() if mode == "cuda" else None
        self.replay_marks: list | None = None  # set to a list: (start, end) CUDA events of each replay go there

    def __getattr__(self, name):
        return getattr(self.target, name)

    def new_cache(self, batch_size: int, max_len: int, ragged: bool = False, static: bool = False):
        """A ragged cache is a static view of one of the buffers kept across decodings: a free
        one that holds enough rows and slots, else a new one (a buffer is in use while the cache
        last made from it is alive: decodings stepped in lockstep each hold one). Others are the
        target's own."""
        if not (ragged or static):
            return self.target.new_cache(batch_size, max_len)
        free = [i for i, (buf, user) in enumerate(self._buffers) if user() is None]
        fits = [i for i in free if batch_size <= self._buffers[i][0].batch_size and max_len <= self._buffers[i][0].max_len]
        if fits:
            i = fits[0]
        else:  # grow a free buffer (its graphs go with it) or add one
            i = free[0] if free else len(self._buffers)
            old = self._buffers[i][0] if free else None
            if old is not None:
                self._graphs = {k: g for k, g in self._graphs.items() if k[0] != old.k.data_ptr()}
                self._failed = {k: w for k, w in self._failed.items() if k[0] != old.k.data_ptr()}
            rows = max(batch_size, old.batch_size if old else 0)
            slots = -(-max(max_len, self.min_len, old.max_len if old else 0) // CACHE_SLOT_MULTIPLE) * CACHE_SLOT_MULTIPLE
            buf = self.target.new_cache(rows, slots, static=True)
            self._buffers[i:i + 1] = [(buf, lambda: None)]
            self.stats["buffers"] += 1
        buf = self._buffers[i][0]
        cache = RaggedKVCache(buf.k[:, :batch_size], buf.v[:, :batch_size], [0] * batch_size, static=True)
        self._buffers[i] = (buf, weakref.ref(cache))
        return cache

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, layers=(), cache=None, position_ids=None, attn_mask=None,
                logits: str | None = "all", skip=(), keys=None) -> TargetOutput:
        if not (isinstance(cache, RaggedKVCache) and cache.static):
            return self.target.forward(input_ids, layers, cache, position_ids, attn_mask, logits, skip, keys)
        B, T = input_ids.shape
        need = cache.check(T, attn_mask)
        if attn_mask is not None and attn_mask.shape[-1] != T:  # over past and new slots: padded to all of them
            attn_mask = torch.nn.functional.pad(attn_mask, (0, cache.max_len - need))
        # the buffer first: a grown buffer's graphs are dropped by it
        key = (cache.k.data_ptr(), cache.k.stride(), B, T, logits, tuple(sorted(layers)), frozenset(skip),
               position_ids is None, None if attn_mask is None else tuple(attn_mask.shape))
        graph, why = self._graphs.get(key), self._failed.get(key)
        if keys is not None or cache.recorder is not None:  # both seams run Python in every layer (models/sparse_attention.py)
            graph, why = None, "sparse keys or recorded attention"
        if graph is None and why is None:
            why = "wider than max_inputs" if T > self.max_inputs else "past max_graphs" if len(self._graphs) >= self.max_graphs else None
            if why is None:
                try:
                    graph = self._graphs[key] = self._capture(input_ids, cache, position_ids, attn_mask, tuple(layers), logits,
                                                              tuple(skip))
                    self.stats["captured"] += 1
                except RuntimeError as e:  # an op that syncs with the host (e.g. a dynamic RoPE's max position)
                    self._failed[key] = why = f"capture failed ({str(e).splitlines()[0][:80]})"
        if graph is None:
            self.stats[f"eager: {why}"] += 1
            step = cache.begin(T, position_ids, attn_mask if attn_mask is None or attn_mask.shape[-1] == T else attn_mask[..., :need])
            out = self.target.forward_step(input_ids, cache, step, layers, logits, skip, keys)
            cache.advance(T)
            return out
        self._fill(graph, input_ids, cache, position_ids, attn_mask)
        if self.replay_marks is not None and self.mode == "cuda":  # the device's share of a step (bench/gpu_decode.py)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = graph.replay()
            end.record()
            self.replay_marks.append((start, end))
        else:
            out = graph.replay()
        self.stats["replayed"] += 1
        cache.advance(T)
        return TargetOutput(None if out.logits is None else out.logits.clone(), {i: h.clone() for i, h in out.hidden.items()})

    __call__ = forward

    @staticmethod
    def _fill(graph: _Graph, input_ids, cache: RaggedKVCache, offsets, mask) -> None:
        """Copy a forward's inputs into the graph's buffers: no host wait (the lengths go through
        pinned memory), the step's layout is computed inside the graph."""
        graph.ids.copy_(input_ids)
        graph.lengths.copy_(device_ints(cache.lengths, cache.k.device)[:, None], non_blocking=True)
        if offsets is not None:
            graph.offsets.copy_(offsets)
        if mask is not None:
            graph.mask.copy_(mask)

    def _capture(self, input_ids, cache: RaggedKVCache, offsets, mask, layers, logits, skip) -> _Graph:
        """Buffers for this shape and the forward captured over them, its layout
        (:meth:`RaggedKVCache.layout`) included. The cache is bound by its tensors (a later
        decoding's view of the same buffer has the same addresses), not by the object, whose rows
        a decoding narrows."""
        dev = input_ids.device
        B, T = input_ids.shape
        graph = _Graph(torch.empty_like(input_ids), torch.empty(B, 1, dtype=torch.long, device=dev),
                       None if offsets is None else torch.empty_like(offsets),
                       None if mask is None else torch.empty(mask.shape, dtype=torch.bool, device=dev), None)
        bound = RaggedKVCache(cache.k, cache.v, list(cache.lengths), static=True)  # not the cache: its decoding ends
        S = cache.max_len
        groups = [(0, B, S)]

        def body() -> TargetOutput:
            step = RaggedKVCache.layout(graph.lengths, T, graph.offsets, graph.mask, S, groups)
            return self.target.forward_step(graph.ids, bound, step, layers, logits, skip)

        self._fill(graph, input_ids, cache, offsets, mask)
        graph.replay = self._captured(body)
        return graph

    def _captured(self, body: Callable[[], TargetOutput]) -> Callable[[], TargetOutput]:
        """``body`` as a replay: captured as a CUDA graph, or run again in replay mode."""
        if self.mode == "replay":
            return body
        # warm-up on a side stream (lazy library set-up happens outside the capture), twice as
        # vLLM's runner does: the same K/V into the same slots the replay then writes again
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                body()
        torch.cuda.current_stream().wait_stream(side)
        cuda_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cuda_graph, pool=self._pool):
            out = body()

        def replay() -> TargetOutput:
            cuda_graph.replay()
            return out  # the graph's own output tensors: callers copy them before the next replay

        # the graph reads the tensors body holds at their addresses: freed, their memory would be
        # reused and the replay would read whatever is there (on an H200: slots out of range)
        replay.body = body
        return replay

    @staticmethod
    def prefill_width(n: int) -> int:
        return max(PREFILL_MIN, 1 << (n - 1).bit_length())

    @torch.no_grad()
    def prefill_prompt(self, prompt: torch.Tensor, layers) -> Prefilled | None:
        """The prefill of one prompt [T] on the device (K/V, last logits, ``layers``' hidden
        states), replayed from its width's graph; None where it runs eagerly (see
        :meth:`_prefill_graph`): the caller then prefills it over its own cache.
        The padding follows the prompt, so causal attention keeps it out of every prompt
        position, and the caller takes the prompt's T slots only."""
        n, layers = prompt.numel(), tuple(sorted(layers))
        graph, why = self._prefill_graph(self.prefill_width(n), layers)
        if graph is None:
            self.stats[f"eager prefill: {why}"] += 1
            return None
        graph.ids[0, :n] = prompt
        graph.last.fill_(n - 1)
        out = graph.replay()
        self.stats["prefills replayed"] += 1
        return Prefilled(graph.cache.k[:, 0, :, :n].clone(), graph.cache.v[:, 0, :, :n].clone(), out.logits[0].clone(),
                         {i: out.hidden[i][:, :n].clone() for i in layers})

    @torch.no_grad()
    def capture_prefills(self, lengths, layer_sets) -> None:
        """Capture the prefill graphs that prompts of these ``lengths`` need for each set of
        layers (before timing: a capture costs a few forwards)."""
        for width in sorted({self.prefill_width(n) for n in lengths}):
            for layers in layer_sets:
                self._prefill_graph(width, tuple(sorted(layers)))

    def _prefill_graph(self, width: int, layers: tuple[int, ...]) -> tuple[_Prefill | None, str | None]:
        """The graph of this width and layers, captured if new; or None and why it runs eagerly."""
        key = (width, layers)
        if width > self.max_prefill:
            return None, "longer than max_prefill"
        if width > getattr(self.target.config, "max_position_embeddings", width):  # a dynamic RoPE would rescale every position
            return None, "padded past the target's positions"
        if ("prefill", *key) in self._failed:
            return None, self._failed[("prefill", *key)]
        if key not in self._prefills:
            try:
                self._prefills[key] = self._capture_prefill(width, layers)
                self.stats["prefill widths captured"] += 1
            except RuntimeError as e:  # as in forward: an op that syncs with the host
                self._failed[("prefill", *key)] = why = f"capture failed ({str(e).splitlines()[0][:80]})"
                return None, why
        return self._prefills[key], None

    def _capture_prefill(self, width: int, layers: tuple[int, ...]) -> _Prefill:
        dev = self.target.device
        cache = self.target.new_cache(1, width, static=True)
        zeros = lambda *shape: torch.zeros(*shape, dtype=torch.long, device=dev)  # noqa: E731
        graph = _Prefill(zeros(1, width), zeros(1), cache, zeros(1, 1), None)
        L, S = self.target.num_layers, cache.max_len

        def body() -> TargetOutput:
            step = RaggedKVCache.layout(graph.lengths, width, None, None, S, [(0, 1, S)])
            out = self.target.forward_step(graph.ids, cache, step, sorted({*layers, L}), logits=None)
            last = out.hidden[L].index_select(1, graph.last)  # the final norm's output at the prompt's end
            return TargetOutput(self.target.shared_lm_head(last)[:, 0], {i: out.hidden[i] for i in layers})

        graph.replay = self._captured(body)
        return graph

    def report(self) -> dict:
        """What ran how, for a decoding report: forwards replayed, shapes captured, forwards run
        eagerly by reason, the cache buffers (rows x slots)."""
        return {"mode": self.mode, **dict(self.stats), "caches": [[b.batch_size, b.max_len] for b, _ in self._buffers]}


def graphed(target, proposer, on: bool):
    """When ``on``: ``target`` and the proposer's own model (a draft LM's) with their decoding
    forwards replayed as CUDA graphs, and a function giving their counts for a report (since
    the proposer's model was first wrapped: wrapping is done once); else (target, None)."""
    if not on:
        return target, None
    wrapped = {"target": GraphedTarget(target)}

    def wrap(model):
        wrapped["drafter"] = model if isinstance(model, GraphedTarget) else GraphedTarget(model)
        return wrapped["drafter"]

    if isinstance(proposer, OwnModel):
        proposer.use_graphs(wrap)
    return wrapped["target"], lambda: {k: g.report() for k, g in wrapped.items()}
