"""The speculative iteration on the device: draft, verify, accept, roll back and extend the
drafter, as tensor ops over static buffers, one captured graph per batch bucket.

:class:`~draftlab.inference.decoder.Decoder` runs its stepwise loop on the host: per-row lists,
shapes that follow the rows, what a CPU wants. On a GPU that host work and the launches of a
small model's kernels cost more than the forwards (BENCHMARKS.md, "GPU decoding"), so a decoding
whose drafter drafts with tensor ops (:class:`~draftlab.inference.proposer.DraftsOnDevice`: chains
and blocks, and the trees a family grows on the device; or none: plain decoding) runs here
instead, on CUDA by default (``Decoder(loop=...)``):

- **State on the device**: each row's target cache length, last token and whether it still
  decodes are tensors; the target's static KV cache and the drafter's
  (:class:`DeviceDrafter`) are written in place at each row's length and rolled back by
  setting lengths.
- **One iteration, static shapes**: the drafter drafts k tokens per row (or a tree of a fixed
  node count: :func:`grow_dynamic_tree` is EAGLE-2's with static shapes), the target verifies
  ``[last, drafts...]`` of every row (a tree under its ancestor mask), acceptance (greedy, or
  rejection sampling with the seeded generator) runs on the device, the accepted tokens advance
  the lengths (a tree's path moved in place first) and extend the drafter at a fixed width. A
  row that finished rides along, masked (its lengths stay).
- **One graph per batch bucket** (1, 2, 4, ...: a batch rounds up to one), captured before the
  prefill, outside any timing, and kept for the next decoding of the same shape; rows move to
  the front and the next smaller bucket takes over once it holds every row still decoding.
  ``mode="replay"`` (``GraphedTarget(mode="replay")``) runs the same captured function again on
  any device: on CPU it proves a step reads nothing but its buffers.
- **One read per step**: the host reads each row's accepted count and tokens once, to emit them
  and to stop rows at eos or their budget.
"""

from __future__ import annotations

import contextlib
import weakref
from abc import ABC, abstractmethod
from collections import Counter

import torch

from draftlab.device import device_ints
from draftlab.inference.prefill import base_model, prefill
from draftlab.inference.results import BatchResult, Clock, Emitter, GenerationResult, Stopwatch
from draftlab.inference.sampling import Sampling
from draftlab.inference.shapes import DynamicTree, StaticTree
from draftlab.kernels import accept_fixed_chains, accept_fixed_trees
from draftlab.models.target import CACHE_SLOT_MULTIPLE, RaggedKVCache

# The slots of a loop's caches are a multiple of this: decodings of prompts of similar lengths
# reuse one loop and its graphs (a graph binds its buffers' shapes).
ROOM_MULTIPLE = 1024


class DeviceDrafter(ABC):
    """A drafter's per-decoding state in static buffers of ``rows`` rows, and its chain drafts as
    tensor ops over them. ``b`` below is the bucket: the leading rows a step runs over."""

    @abstractmethod
    def start(self, row: int, prompt_ids: torch.Tensor, hidden: dict, next_token: torch.Tensor) -> None:
        """After the prefill, eagerly: row ``row`` reads its prompt (``hidden``: the target's
        hidden states of its positions, [1, T, H] per layer) and the target's first token."""

    @abstractmethod
    def draft(self, b: int, k: int) -> torch.Tensor:
        """Long[b, k]: each row's k draft tokens (target ids), from what it has read."""

    def draft_tree(self, b: int, shape) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's tree of exactly ``shape.max_nodes`` nodes: tokens Long[b, N] (target ids)
        and parents Long[b, N] (0: the root, the row's last token; node i's parent precedes it),
        siblings distinct. Families whose proposer accepts tree shapes on the device define it."""
        raise NotImplementedError

    @abstractmethod
    def extend(self, b: int, tokens: torch.Tensor, hidden: dict, counts: torch.Tensor) -> None:
        """Read what the step kept: ``tokens`` Long[b, W] (row r's first ``counts[r]``: the
        accepted drafts then the correction or bonus token), ``hidden`` the target's hidden
        states of the step's inputs ([b, W, H] per layer; input j is the one before token j)."""

    @abstractmethod
    def select(self, index: torch.Tensor) -> None:
        """Move rows ``index`` (Long[n], device) to rows 0..n-1."""

    def bind(self, loop: "SpecLoop") -> None:
        """Called once with the loop that runs it: a drafter that drafts with the target itself
        reads the loop's cache, lengths and last tokens."""


class SpecLoop:
    """The static buffers and graphs of decodings of ``rows`` rows (a bucket), ``room`` slots,
    drafting ``shape`` each step (None: plain decoding), one sampling setting. ``mode``: None
    (eager), "cuda" or "replay"."""

    def __init__(self, target, drafter: DeviceDrafter | None, rows: int, room: int, shape, layers, sampling: Sampling,
                 mode: str | None, backend: str = "auto"):
        self.target, self.drafter, self.rows, self.shape, self.mode, self.backend = target, drafter, rows, shape, mode, backend
        self.tree = isinstance(shape, (DynamicTree, StaticTree))
        self.k = 0 if shape is None else shape.max_depth if self.tree else shape.k  # the most drafts a step accepts
        self.layers = tuple(layers)
        dev = target.device
        self.cache = target.new_cache(rows, room, static=True)
        self.lengths = torch.zeros(rows, 1, dtype=torch.long, device=dev)
        self.last = torch.zeros(rows, dtype=torch.long, device=dev)
        self.active = torch.zeros(rows, dtype=torch.bool, device=dev)
        # per row: drafts accepted, the longest run offered, then the tokens kept
        self.result = torch.zeros(rows, self.k + 3, dtype=torch.long, device=dev)
        self.generator = torch.Generator(device=dev)
        self.sampling = Sampling(sampling.temperature, sampling.top_k, sampling.top_p, self.generator)
        self.buckets = [1 << i for i in range(rows.bit_length())]  # 1, 2, 4, ... rows (a power of two)
        self.busy = False  # a decoding is using it (decodings in lockstep need one each)
        self._graphs: dict[int, object] = {}
        self.stats: Counter = Counter()  # captured, replayed, eager; steps per bucket ("rows 4")
        if drafter is not None:
            drafter.bind(self)
        for b in self.buckets:  # before any prefill: capture's warm-up runs write the buffers
            self._graphs[b] = self._capture(b)
        self.lengths.zero_()

    # ---- one iteration ------------------------------------------------------------------
    def iteration(self, b: int) -> None:
        """Rows 0..b-1: draft, verify, accept, roll back, extend; tensor ops only."""
        k, lengths, last, active = self.k, self.lengths[:b], self.last[:b], self.active[:b]
        cache = RaggedKVCache(self.cache.k[:, :b], self.cache.v[:, :b], [0] * b, static=True)
        S = cache.max_len
        if self.tree:
            tokens, parents = self.drafter.draft_tree(b, self.shape)
            ids = torch.cat([last[:, None], tokens], 1)
            parents = torch.cat([parents.new_full((b, 1), -1), parents], 1)
            depth, seen = tree_layout(parents, k)
            step = RaggedKVCache.layout(lengths, ids.shape[1], depth, seen, S, [(0, b, S)])
            out = self.target.forward_step(ids, cache, step, self.layers, "all")
            path, emitted, n = accept_fixed_trees(ids, parents, out.logits, self.sampling, k, backend=self.backend)
            path = path.clamp(min=0)  # past the accepted path: the root, written where nothing is kept
            _move_slots(cache, lengths + path, lengths + torch.arange(k + 1, device=path.device))
            hidden = {i: h.gather(1, path[..., None].expand(-1, -1, h.shape[-1])) for i, h in out.hidden.items()}
        else:
            drafts = self.drafter.draft(b, k) if k else last.new_zeros(b, 0)
            ids = torch.cat([last[:, None], drafts], 1)
            step = RaggedKVCache.layout(lengths, k + 1, None, None, S, [(0, b, S)])
            out = self.target.forward_step(ids, cache, step, self.layers, "all")
            emitted, n = accept_fixed_chains(drafts, out.logits, self.sampling, backend=self.backend)
            hidden = out.hidden
        kept = torch.where(active, n + 1, 0)
        lengths += kept[:, None]
        if self.drafter is not None:
            self.drafter.extend(b, emitted.clamp(min=0), hidden, kept)
        last.copy_(torch.where(active, emitted.gather(1, n[:, None])[:, 0], last))
        self.result[:b, 0] = n
        self.result[:b, 1] = depth.amax(1) if self.tree else k
        self.result[:b, 2:] = emitted

    def step(self, b: int) -> list[list[int]]:
        """Run one iteration over rows 0..b-1; each row's accepted count and tokens, read once."""
        graph = self._graphs.get(b)
        if graph is None:
            self.iteration(b)
            self.stats["eager"] += 1
        else:
            graph()
            self.stats["replayed"] += 1
        self.stats[f"rows {b}"] += 1
        return self.result[:b].tolist()

    def _capture(self, b: int):
        """Bucket b's step, captured: warmed up twice over the fresh buffers first (lazy library
        set-up happens outside the capture; replay mode runs the same warm-up, so a drafter whose
        buffers a capture could not run over fails on CPU too)."""
        if self.mode is None:
            return None
        self.stats["captured"] += 1
        cuda = self.mode == "cuda"
        side = torch.cuda.Stream() if cuda else None
        if cuda:
            side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side) if cuda else contextlib.nullcontext():
            for _ in range(2):
                self.iteration(b)
                self.lengths.zero_()
        if not cuda:
            return lambda: self.iteration(b)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        if not self.sampling.greedy:
            graph.register_generator_state(self.generator)
        with torch.cuda.graph(graph, pool=getattr(self.target, "_pool", None)):
            self.iteration(b)
        return graph.replay

    # ---- between decodings and steps -----------------------------------------------------
    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def compact(self, going: list[int]) -> None:
        """Move rows ``going`` (ascending) to the front: a smaller bucket then runs them."""
        index = device_ints(going, self.last.device)
        for buf in (self.cache.k, self.cache.v):
            buf[:, : len(going)] = buf[:, index]
        for t in (self.lengths, self.last, self.active):
            t[: len(going)] = t[index]
        if self.drafter is not None:
            self.drafter.select(index)


def tree_layout(parents: torch.Tensor, max_depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each node's depth [B, T] and which nodes it sees, itself and its ancestors [B, T, T], of
    trees given by ``parents`` [B, T] (node 0 the root, parent -1; a parent precedes its
    children), by ``max_depth`` steps up the tree."""
    B, T = parents.shape
    cur = torch.arange(T, device=parents.device).expand(B, T)
    seen = torch.zeros(B, T, T, dtype=torch.bool, device=parents.device)
    seen.scatter_(2, cur[..., None], True)
    depth = torch.zeros_like(parents)
    for _ in range(max_depth):
        up = parents.gather(1, cur)
        has = up >= 0
        depth = depth + has
        cur = torch.where(has, up, cur)
        seen.scatter_(2, cur[..., None], True)
    return depth, seen


def grow_dynamic_tree(root: torch.Tensor, shape: DynamicTree, expand) -> tuple[torch.Tensor, torch.Tensor]:
    """EAGLE-2's dynamic tree with static shapes, from the root's log-probs ``root`` [b, V]: the
    root's top-k, then at each depth the k best children (by cumulative log-prob) of the k
    frontier nodes become the next frontier; of every candidate (k + (depth - 1) k^2) the
    ``total_tokens`` best are kept, a parent before its children on ties (it never scores lower).
    ``expand(depth, tokens, parent)`` gives the children's log-probs [b, k, V] of the frontier
    nodes at ``depth`` (``tokens`` [b, k] their draft ids; ``parent`` [b, k] each one's index in
    the frontier before, None at depth 1). Returns draft ids [b, N] and parents [b, N] (0: the
    root; node i's parent precedes it)."""
    b, dev, N = root.shape[0], root.device, shape.total_tokens
    K = min(shape.top_k, N, root.shape[-1])
    score, tok = root.topk(K)  # the root's children: candidates 0..K-1
    scores, tokens, parents = [score], [tok], [torch.full_like(tok, -1)]
    frontier, parent, offset = torch.arange(K, device=dev).expand(b, K), None, K  # frontier: candidate ids
    for depth in range(1, shape.max_depth):
        clp, cid = expand(depth, tok, parent).topk(K, dim=-1)  # [b, K, K]
        flat = (score[..., None] + clp).flatten(1)
        scores.append(flat)
        tokens.append(cid.flatten(1))
        parents.append(frontier.repeat_interleave(K, dim=1))
        score, best = flat.topk(K)
        parent = best // K
        tok, frontier = cid.flatten(1).gather(1, best), offset + best
        offset += K * K
    scores, tokens, parents = (torch.cat(x, 1) for x in (scores, tokens, parents))
    kept = torch.sort(-scores, dim=1, stable=True).indices[:, :N].sort(1).values  # by candidate id: parents first
    node = torch.zeros_like(tokens).scatter_(1, kept, torch.arange(1, N + 1, device=dev).expand(b, N))
    up = parents.gather(1, kept)
    return tokens.gather(1, kept), torch.where(up < 0, 0, node.gather(1, up.clamp(min=0)))


def tree_nodes(shape: DynamicTree, draft_vocab: int | None) -> int:
    """The candidates :func:`grow_dynamic_tree` scores: it keeps ``total_tokens`` of them."""
    k = min(shape.top_k, shape.total_tokens, draft_vocab or shape.top_k)
    return k + (shape.max_depth - 1) * k * k


def _move_slots(cache: RaggedKVCache, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Every layer's K/V of row b at slots ``src[b]`` to slots ``dst[b]`` ([B, n] each; read
    before written)."""
    for buf in (cache.k, cache.v):
        L, B, H, S, D = buf.shape
        index = src[None, :, None, :, None].expand(L, B, H, -1, D)
        buf.scatter_(3, dst[None, :, None, :, None].expand(L, B, H, -1, D), buf.gather(3, index))


def _width(shape) -> int:
    if shape is None:
        return 0
    if isinstance(shape, DynamicTree):
        return shape.max_nodes + shape.max_depth * shape.top_k
    return shape.max_nodes


def bucket_rows(n: int) -> int:
    """The batch bucket of n rows: the next power of two."""
    return 1 << max(n - 1, 0).bit_length()


def kept_loops(target) -> dict:
    """The loops kept across decodings by ``target`` (the unwrapped one that owns the caches):
    (proposer, rows, room, k, sampling, mode, backend) -> loop."""
    return target.__dict__.setdefault("_spec_loops", {})


def _loop_for(target, proposer, rows: int, room: int, shape, layers, sampling: Sampling, mode, backend) -> SpecLoop:
    """A free loop of this shape from an earlier decoding, else a new one (kept unless another
    decoding holds the one of its shape: decodings in lockstep each need their own)."""
    room = -(-room // ROOM_MULTIPLE) * ROOM_MULTIPLE
    key = (id(proposer), rows, room, _shape_key(shape), sampling.temperature, sampling.top_k, sampling.top_p, mode, backend)
    base = base_model(target)
    kept = kept_loops(base)
    loop = kept.get(key)
    if loop is not None and not loop.busy and loop.owner() is proposer:
        return loop
    drafter = proposer.on_device(rows, room, shape) if proposer is not None else None
    loop = SpecLoop(base, drafter, rows, room, shape, layers, sampling, mode, backend)
    loop.owner = weakref.ref(proposer) if proposer is not None else (lambda: None)  # its drafter's state is this proposer's
    if key not in kept or not kept[key].busy:
        kept[key] = loop
    return loop


def _shape_key(shape):
    if isinstance(shape, StaticTree):
        return (shape.kind, shape.choices)
    return None if shape is None else (shape.kind, *vars(shape).values())


def device_steps(target, proposer, prompt_ids, max_new_tokens: int, shape, sampling: Sampling, seed: int, eos,
                 on_step=None, prompt_cache=None, backend: str = "auto"):
    """One decoding drafting ``shape`` each step (None: plain) through a :class:`SpecLoop`, as a
    generator yielding after each step and returning the :class:`BatchResult`, as
    :meth:`Decoder.steps` does. ``target`` may be a ``GraphedTarget``: its mode captures the
    whole step."""
    mode = getattr(target, "mode", None)
    dev = target.device
    prompts = [torch.as_tensor(p, dtype=torch.long).reshape(-1).to(dev) for p in prompt_ids]
    n = len(prompts)
    rows = bucket_rows(n)
    # room for the drafts past a row's end (a tree drafter's speculative levels: depth x top_k)
    room = max(p.numel() for p in prompts) + max_new_tokens + 2 * (_width(shape) + 1)
    layers = tuple(proposer.layers) if proposer is not None else ()
    loop = _loop_for(target, proposer, rows, room, shape, layers, sampling, mode, backend)
    drafted = 0 if shape is None else shape.max_nodes
    loop.busy = True
    try:
        clock = Clock(dev)
        verify = Stopwatch(clock)
        t0 = clock()
        loop.generator.manual_seed(seed)
        # prefill: each prompt into its row (rows in prompt order: the static cache spans every slot)
        view = RaggedKVCache(loop.cache.k, loop.cache.v, [0] * rows, static=True)
        logits, hidden = prefill(target, prompts, list(range(n)), layers, view, Stopwatch(clock), prompt_cache)
        first = loop.sampling.sample(loop.sampling.probs(logits))
        loop.lengths.copy_(device_ints(view.lengths, dev)[:, None])
        loop.last.zero_()
        loop.last[:n] = first
        emitters = [Emitter(max_new_tokens, eos, on_step and (lambda t, r=r: on_step(r, t))) for r in range(n)]
        stats = [([], [], []) for _ in range(n)]
        firsts = first.tolist()
        going = [r for r in range(n) if not emitters[r].emit([firsts[r]])]
        if loop.drafter is not None:
            for r in going:
                loop.drafter.start(r, prompts[r], hidden[r], first[r])
        loop.active.copy_(device_ints([int(r in going) for r in range(rows)], dev).bool())
        t1 = clock()
        slot_rows = list(range(rows))  # the decoding row in each loop row (-1: none)
        for s in range(n, rows):
            slot_rows[s] = -1
        num_steps = 0
        while going:
            b = loop.bucket(max(slot_rows.index(r) for r in going) + 1)
            read = verify(loop.step, b)
            num_steps += 1
            stopped = []
            for s in range(b):
                r = slot_rows[s]
                if r < 0 or r not in going:
                    continue
                acc, offered, tokens = read[s][0], read[s][1], read[s][2:]
                for record, x in zip(stats[r], (acc, drafted, offered)):
                    record.append(x)
                if emitters[r].emit(tokens[: acc + 1]):
                    stopped.append(s)
            if stopped:
                going = [r for r in going if slot_rows.index(r) not in stopped]
                loop.active[device_ints(stopped, dev)] = False
                if going and bucket_rows(len(going)) < b:
                    slots = sorted(slot_rows.index(r) for r in going)
                    loop.compact(slots)
                    slot_rows = [slot_rows[s] for s in slots] + [-1] * (rows - len(slots))
            yield from clock.pause()
        t2 = clock()
        pre, decode = clock.seconds(t0, t1), clock.seconds(t1, t2) - clock.total(clock.suspended)
        results = [GenerationResult(e.tokens, stop_reason=e.stop_reason, num_steps=len(stats[r][0]),
                                    **dict(zip(("accept_lengths", "num_drafted", "draft_depths"), stats[r])))
                   for r, e in enumerate(emitters)]
        # a captured step is one graph: drafting, verifying and extending count as the step's time
        step_time = verify.seconds
        return BatchResult(results, prefill_time=pre, verify_time=step_time,
                           other_time=decode - step_time, total_time=pre + decode, num_steps=num_steps,
                           draft_lengths=[loop.k] * num_steps)
    finally:
        loop.busy = False
