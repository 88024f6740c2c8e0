"""Speedup by batch size: ``draftlab eval --batch-sizes 1,2,4,8,16`` (and ``eval.batch_sizes`` in a
recipe).

For each batch size B the prompts are decoded in consecutive groups of B, plainly and by each
speculative configuration in lockstep on the same group (one step of each in turn,
:func:`~draftlab.inference.decoder.run_lockstep`, in the orders of :func:`crossover_orders`), so
every speedup is over the same plain decoding under the same machine state. Per batch size:
tokens/s of both (the decode phase: each prompt's prefill is computed once and reused,
:class:`~draftlab.inference.prefill.PromptCache`, and reported apart), speedup with a bootstrap
interval over the groups, tau and alpha_j, where the time went, and two greedy checks: each row
against plain batched decoding of the same group (must match: decoding is lossless), and plain
batched decoding against the prompt decoded alone (may differ on float near-ties; counted).

``adaptive``: each step's draft length comes from a
:class:`~draftlab.inference.draft_length.DraftLength` rule, up to the shape's k or the positions
the drafter was trained to draft, whichever is fewer, calibrated at start-up (:func:`calibrate`);
one rule serves all batch sizes in the order given, as in a server whose load changes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from draftlab.errors import DraftlabError
from draftlab.inference.decoder import Decoder, run_lockstep
from draftlab.inference.draft_length import DraftLength, step_cost
from draftlab.inference.metrics import AcceptanceStats
from draftlab.inference.prefill import PromptCache
from draftlab.inference.proposer import PreparesPrompts, Proposer, verifying_target
from draftlab.inference.shapes import Block, Chain, check_decoding


def parse_batch_sizes(text: str, flag: str = "--batch-sizes") -> list[int]:
    """``"1,2,4"`` -> [1, 2, 4]: distinct integers >= 1 (a one-line error naming ``flag``
    otherwise). How a flag lists sizes; the bounds of batch sizes are ``check_decoding``'s."""
    try:
        sizes = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise DraftlabError(f"{flag}: expected comma-separated integers >= 1, e.g. 1,2,4,8, got '{text}'") from None
    if not sizes or min(sizes) < 1 or len(set(sizes)) != len(sizes):
        raise DraftlabError(f"{flag}: expected distinct integers >= 1, e.g. 1,2,4,8, got {sizes}")
    return sizes


@dataclass
class Speculation:
    """One speculative configuration to measure against plain decoding: a proposer, the shape
    it drafts and whether a :class:`DraftLength` rule chooses each step's k (up to the shape's)."""

    proposer: Proposer
    shape: object
    adaptive: bool = False

    @property
    def depth(self) -> int:
        """The most the rule drafts: the shape's k, or fewer where the proposer was trained to
        draft fewer chained positions (``Proposer.trained_depth``): beyond those it accepts
        little, and calibrating them costs start-up time."""
        trained = self.proposer.trained_depth
        return min(self.shape.k, trained) if trained else self.shape.k


def calibrate(target, spec: Speculation, prompt_ids, batch_sizes, seed: int = 0, rounds: int = 2,
              backend: str = "auto", **opts) -> DraftLength:
    """A :class:`DraftLength` rule for ``spec``: at each batch size B, ``rounds`` groups of B
    prompts decoded plainly and at every fixed k up to ``spec.depth`` in lockstep (orders
    reversed from round to round), and each k's cost per token over plain decoding's taken from
    what the group measured. The acceptance the rule starts from is what these decodings saw."""
    ks = range(1, spec.depth + 1)
    # a decoder of one row drafts with its proposer itself: each decoding in lockstep needs its own
    plain, drafting = Decoder(target), {k: Decoder(target, spec.proposer.fork(), backend) for k in ks}
    shapes = {k: dataclasses.replace(spec.shape, k=k) for k in ks}
    rule = DraftLength({B: [1.0] * (spec.depth + 1) for B in batch_sizes})
    for B in batch_sizes:
        sums = {k: [0, 0.0, AcceptanceStats()] for k in (0, *ks)}  # tokens, decoding seconds, acceptance
        for r in range(rounds):
            start = (r * B) % len(prompt_ids)
            group = prompt_ids[start : start + B]
            order = [0, *ks][:: 1 if r % 2 == 0 else -1]
            done = run_lockstep([plain.steps(group, shape=None, seed=seed, **opts) if k == 0 else
                                 drafting[k].steps(group, shape=shapes[k], seed=seed, **opts) for k in order])
            for k, res in zip(order, done):
                sums[k][0] += res.num_tokens
                sums[k][1] += res.total_time - res.prefill_time
                for row in res.rows:
                    sums[k][2].merge(row.stats())
                    if k:
                        for d, n in zip(row.num_drafted, row.accept_lengths):
                            rule.observe([d], [n])
        (T0, t0, _) = sums[0]
        rule.cost[B] = [1.0] + [step_cost(sums[k][2].tau, sums[k][0], sums[k][1], T0, t0) for k in ks]
    return rule


def evaluate_batches(target, proposer, prompts, shape, batch_sizes, max_new_tokens: int = 128,
                     temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
                     eos_token_id=None, adaptive: bool = False, backend: str = "auto", progress=None,
                     min_groups: int = 1, cuda_graphs: bool = False) -> dict:
    """The ``batches`` section of a report: one entry per batch size, in the order given, for
    one proposer decoding with the target it is verified by (:func:`~draftlab.inference.proposer.verifying_target`);
    ``cuda_graphs``: its forwards and plain decoding's replay captured graphs."""
    from draftlab.inference.graphs import graphed

    speculations = {"": Speculation(proposer, shape, adaptive)}
    target, graphs = graphed(verifying_target(proposer, target), proposer, cuda_graphs)
    if isinstance(proposer, PreparesPrompts):
        proposer.prepare(target, [p.prompt_ids for p in prompts], max_new_tokens, eos_token_id)
    section = compare_batches(target, speculations, prompts, batch_sizes, max_new_tokens, temperature,
                              top_k, top_p, seed, eos_token_id, backend, progress, min_groups)[""]
    return {**section, "cuda_graphs": graphs()} if graphs else section


def compare_batches(target, speculations: dict[str, Speculation], prompts, batch_sizes, max_new_tokens: int = 128,
                    temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
                    eos_token_id=None, backend: str = "auto", progress=None, min_groups: int = 1,
                    adaptive_groups: int = 0) -> dict[str, dict]:
    """A ``batches`` section per speculative configuration (label -> section), all against one
    plain baseline: each group of B prompts decoded plainly and by every configuration in
    lockstep. ``min_groups``: decode the prompts again (same groups) until each batch size has
    timed at least that many groups, since one timing is one sample of the machine's noise.
    ``adaptive_groups``: then, at each batch size, this many more groups decoded plainly and by
    the adaptive configurations alone, pooled into their entries: where a rule decodes about as
    plain decoding does, its verdict against it needs more steps than the grid gives."""
    if not prompts:
        raise DraftlabError("evaluation needs at least one prompt")
    check_decoding(batch_sizes=list(batch_sizes))
    for spec in speculations.values():
        if spec.adaptive and not isinstance(spec.shape, (Chain, Block)):
            raise DraftlabError(f"an adaptive draft length applies to chain and block shapes, not {spec.shape.method}")
    plain = Decoder(target)
    # configurations may share a proposer, and a decoder of one row drafts with it itself: a fork each
    decoders = {label: Decoder(target, s.proposer.fork(), backend=backend) for label, s in speculations.items()}
    # every prompt is decoded once per configuration and batch size: its prefill once
    opts = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                eos_token_id=eos_token_id, prompt_cache=PromptCache(target))
    ids = [p.prompt_ids for p in prompts]
    greedy = temperature == 0.0
    # warm-up, untimed: allocator, GEMM choice for each row count, drafter copies
    warm = dict(opts, max_new_tokens=min(max_new_tokens, 8))
    for B in batch_sizes:
        plain.generate(ids[:B], shape=None, seed=seed, **warm)
        for label, s in speculations.items():
            decoders[label].generate(ids[:B], shape=s.shape, seed=seed, **warm)
    if hasattr(target, "capture_prefills"):  # graphed: every prompt's prefill width, before any timing
        target.capture_prefills([len(i) for i in ids], {tuple(d.layers) for d in (plain, *decoders.values())})
    rules = {label: calibrate(target, s, ids, batch_sizes, seed, backend=backend, **opts) if s.adaptive else None
             for label, s in speculations.items()}
    calibrated = {label: rule.to_dict() for label, rule in rules.items() if rule is not None}
    entries: dict[str, list[_Entry]] = {label: [] for label in speculations}
    plain_outputs: dict[int, list[list[int]]] = {}
    every = [None, *speculations]  # None: plain decoding
    adaptive_only = [None, *(label for label, s in speculations.items() if s.adaptive)]
    for B in batch_sizes:
        run = {label: _Entry(B) for label in speculations}
        plain_outputs[B] = []
        starts = list(range(0, len(ids), B))
        grid = starts * -(-min_groups // len(starts))  # ceil: whole passes over the prompts
        more = [starts[g % len(starts)] for g in range(adaptive_groups)] if len(adaptive_only) > 1 else []
        schedule = [(g, start, every) for g, start in enumerate(grid)] + [(g, start, adaptive_only) for g, start in enumerate(more)]
        rows, done_rows = sum(len(ids[start : start + B]) for _, start, _ in schedule), 0
        for g, start, labels in schedule:
            group = ids[start : start + B]
            orders = crossover_orders(len(labels))
            order = [labels[i] for i in orders[g % len(orders)]]
            done = dict(zip(order, run_lockstep([
                plain.steps(group, shape=None, seed=seed + start, **opts) if label is None else
                decoders[label].steps(group, shape=speculations[label].shape, seed=seed + start,
                                      draft_length=rules[label], **opts)
                for label in order
            ])))
            if labels is every:
                plain_outputs[B] += [r.tokens for r in done[None].rows]
            for label in labels[1:]:
                run[label].add(done[label], done[None], greedy)
            done_rows += len(group)
            if progress is not None:
                progress(B, done_rows, rows)
        for label, e in run.items():
            if rules[label] is not None:
                e.alpha_estimate = rules[label].alpha()
            entries[label].append(e)
    if greedy and max(batch_sizes) > 1:
        # each prompt decoded alone: batch size 1's plain outputs when measured, else decoded now
        alone = plain_outputs[1][: len(ids)] if 1 in plain_outputs else \
            [plain.generate([i], shape=None, seed=seed, **opts).rows[0].tokens for i in ids]
        for B, outputs in plain_outputs.items():
            if B > 1:  # repeated passes decode the prompts in the same order
                same = sum(a == b for a, b in zip(alone * (len(outputs) // len(ids)), outputs))
                for label in speculations:
                    entries[label][batch_sizes.index(B)].alone_same = (same, len(outputs))
    return {
        label: {"adaptive": s.adaptive, "adaptive_max_k": s.depth if s.adaptive else None,
                "draft_length_rule": calibrated.get(label),
                "entries": [e.to_dict() for e in entries[label]]}
        for label, s in speculations.items()
    }


def crossover_orders(n: int) -> list[list[int]]:
    """Orders of n configurations, one per group in turn, balanced for what ran just before
    (a Williams design): over the orders each configuration runs once at every position and right
    after every other configuration equally often (n orders for even n, 2n for odd). Why: a
    decoding can be slowed by the one before it, and merely rotated orders put each
    configuration after the same one every time."""
    first = [0]
    for j in range(1, n):  # 0, 1, n-1, 2, n-2, ...
        first.append((j + 1) // 2 if j % 2 else n - j // 2)
    square = [[(x + i) % n for x in first] for i in range(n)]
    return square if n % 2 == 0 else square + [row[::-1] for row in square]


class _Entry:
    def __init__(self, B: int):
        self.B = B
        self.stats = AcceptanceStats()
        self.split = {"prefill_s": 0.0, "draft_s": 0.0, "verify_s": 0.0, "other_s": 0.0}
        self.matched = self.compared = 0
        self.asked: list[int] = []
        self.alpha_estimate: list[float] | None = None  # the draft-length rule's, after this batch size
        self.alone_same: tuple[int, int] | None = None  # plain batched rows equal to the prompt decoded alone, of rows
        self.groups: list[tuple[int, float, int, float]] = []  # per group: tokens, seconds; plain's

    def add(self, spec, base, greedy: bool) -> None:
        for r in spec.rows:
            self.stats.merge(r.stats())
        # decode phase only: the prefill is the same forward in both, and a held-out prompt of
        # 2,544 tokens would otherwise outweigh 48 decoded tokens
        self.groups.append((spec.num_tokens, spec.total_time - spec.prefill_time,
                            base.num_tokens, base.total_time - base.prefill_time))
        for key, t in (("prefill_s", spec.prefill_time), ("draft_s", spec.draft_time),
                       ("verify_s", spec.verify_time), ("other_s", spec.other_time)):
            self.split[key] += t
        self.asked += spec.draft_lengths
        if greedy:
            self.compared += len(spec.rows)
            self.matched += sum(s.tokens == b.tokens for s, b in zip(spec.rows, base.rows))

    def to_dict(self) -> dict:
        tokens, time, base_tokens, base_time = (sum(g[i] for g in self.groups) for i in range(4))
        tps = tokens / time if time > 0 else 0.0
        base_tps = base_tokens / base_time if base_time > 0 else 0.0
        out = {
            "batch_size": self.B,
            "tokens_per_s": tps,
            "baseline_tokens_per_s": base_tps,
            "speedup": tps / base_tps if base_tps else None,
            "speedup_interval": speedup_interval(self.groups),
            "groups": [list(g) for g in self.groups],
            **self.stats.to_dict(),
            "new_tokens": tokens,
            "decode_time_s": time,
            **self.split,
            "greedy_match": f"{self.matched}/{self.compared}" if self.compared else None,
        }
        if self.alone_same is not None:
            out["batched_vs_alone"] = "{}/{}".format(*self.alone_same)
        if self.alpha_estimate is not None:
            counts = {k: self.asked.count(k) for k in sorted(set(self.asked))}
            out["draft_lengths"] = {str(k): n for k, n in counts.items()}
            out["alpha_estimate"] = self.alpha_estimate
        return out


def speedup_interval(groups, level: float = 0.9, resamples: int = 2000) -> list[float] | None:
    """A ``level`` bootstrap interval of the speedup (tokens over seconds, speculative over
    plain, summed over groups) from per-group (tokens, seconds, plain tokens, plain seconds):
    groups drawn with replacement, so it holds both the prompts' spread and the machine's noise."""
    import numpy as np

    g = np.asarray(groups, dtype=float)
    if len(g) == 0 or (g[:, 1] <= 0).any() or (g[:, 3] <= 0).any():
        return None
    sums = g[np.random.default_rng(0).integers(0, len(g), (resamples, len(g)))].sum(1)
    ratios = (sums[:, 0] / sums[:, 1]) / (sums[:, 2] / sums[:, 3])
    tail = 100 * (1 - level) / 2
    return [float(np.percentile(ratios, tail)), float(np.percentile(ratios, 100 - tail))]
