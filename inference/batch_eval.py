"""Speedup by batch size: ``draftlab eval --batch-sizes 1,2,4,8,16`` (and ``eval.batch_sizes`` in a
recipe).

For each batch size B the prompts are decoded in consecutive groups of B, plain and
speculative back to back on the same group (the order alternating between groups), with the
batched decoder (:mod:`draftlab.inference.decoder`) for both. Per batch size: plain and
speculative tokens/s (all rows' tokens over the groups' decoding time: the prefill, the same
forward in both, is left out and reported apart), speedup, tau and alpha_j,
the split of the speculative time into prefill, draft, verify and the rest, and two greedy
checks: each row against plain batched decoding of the same group (must match: decoding is
lossless), and plain batched decoding against the same prompt decoded alone (may differ on
float near-ties, and is counted, not hidden).

``adaptive``: the draft length is chosen per step by
:class:`~draftlab.inference.adaptive.AdaptiveDraftLength`, up to the shape's k, with the verify
cost measured once at start-up for these batch sizes; one policy runs through all batch sizes,
in the order given, as in a server whose load changes.
"""

from __future__ import annotations

from draftlab.errors import DraftlabError
from draftlab.inference.adaptive import AdaptiveDraftLength, VerifyCost
from draftlab.inference.decoder import BatchedSpeculativeDecoder, generate_plain_batch
from draftlab.inference.metrics import AcceptanceStats
from draftlab.inference.proposer import Block, Chain


def parse_batch_sizes(text: str, flag: str = "--batch-sizes") -> list[int]:
    """``"1,2,4"`` -> [1, 2, 4] (a one-line error naming ``flag`` otherwise)."""
    try:
        sizes = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise DraftlabError(f"{flag}: expected comma-separated integers >= 1, e.g. 1,2,4,8, got '{text}'") from None
    check_batch_sizes(sizes, flag)
    return sizes


def check_batch_sizes(sizes, field: str) -> None:
    if not sizes or any(not isinstance(b, int) or b < 1 for b in sizes) or len(set(sizes)) != len(sizes):
        raise DraftlabError(f"{field}: expected distinct integers >= 1, e.g. 1,2,4,8, got {sizes}")


def evaluate_batches(target, proposer, prompts, shape, batch_sizes, max_new_tokens: int = 128,
                     temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
                     eos_token_id=None, adaptive: bool = False, backend: str = "auto", progress=None,
                     min_groups: int = 1) -> dict:
    """The ``batches`` section of a report: one entry per batch size, in the order given.
    ``min_groups``: decode the prompts again (same groups) until each batch size has timed at
    least that many groups: large batch sizes have few groups, and one timing is one sample of
    the machine's noise."""
    if not prompts:
        raise DraftlabError("evaluation needs at least one prompt")
    check_batch_sizes(list(batch_sizes), "batch sizes")
    if adaptive and not isinstance(shape, (Chain, Block)):
        raise DraftlabError(f"an adaptive draft length applies to chain and block shapes, not {shape.method}")
    target = proposer.verifier(target)
    decoder = BatchedSpeculativeDecoder(target, proposer, backend=backend)
    opts = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                eos_token_id=eos_token_id)
    ids = [p.prompt_ids for p in prompts]
    greedy = temperature == 0.0
    # warm-up, untimed: allocator, GEMM choice for each row count, drafter copies
    warm = dict(opts, max_new_tokens=min(max_new_tokens, 8))
    for B in batch_sizes:
        generate_plain_batch(target, ids[:B], seed=seed, **warm)
        decoder.generate(ids[:B], shape=shape, seed=seed, **warm)
    cost = VerifyCost.measure(target, batch_sizes, shape.k) if adaptive else None
    # one policy for the whole run: what it learnt of acceptance and drafting cost at one batch
    # size holds at the next (the verify cost it keeps per batch size)
    policy = AdaptiveDraftLength(cost, shape.k) if adaptive else None
    entries = []
    for B in batch_sizes:
        e = _Entry(B)
        starts = list(range(0, len(ids), B))
        starts *= -(-min_groups // len(starts))  # ceil: whole passes over the prompts
        for g, start in enumerate(starts):
            group = ids[start : start + B]
            run_base = lambda: generate_plain_batch(target, group, seed=seed + start, **opts)  # noqa: E731
            run_spec = lambda: decoder.generate(group, shape=shape, seed=seed + start, policy=policy, **opts)  # noqa: E731
            if g % 2 == 0:
                base = run_base()
                spec = run_spec()
            else:
                spec = run_spec()
                base = run_base()
            e.add(spec, base, greedy)
            if progress is not None:
                progress(B, min(g * B + B, len(starts) * B), len(starts) * B)
        if policy is not None:
            e.alpha_estimate = policy.alpha()
        entries.append(e)
    if greedy and max(batch_sizes) > 1:
        # each prompt decoded alone: batch size 1's plain outputs when measured, else decoded now
        alone = next((e.base_outputs[: len(ids)] for e in entries if e.B == 1), None) or \
            [generate_plain_batch(target, [i], seed=seed, **opts).rows[0].tokens for i in ids]
        for e in entries:
            if e.B > 1:  # repeated passes decode the prompts in the same order
                e.alone_same = sum(a == b for a, b in zip(alone * (len(e.base_outputs) // len(ids)), e.base_outputs))
    return {"adaptive": adaptive, "verify_cost_s": cost.to_dict() if cost else None, "entries": [e.to_dict() for e in entries]}


class _Entry:
    def __init__(self, B: int):
        self.B = B
        self.stats = AcceptanceStats()
        self.tokens = self.base_tokens = 0
        self.time = self.base_time = 0.0
        self.split = {"prefill_s": 0.0, "draft_s": 0.0, "verify_s": 0.0, "other_s": 0.0}
        self.base_outputs: list[list[int]] = []
        self.matched = self.compared = 0
        self.asked: list[int] = []
        self.alpha_estimate: list[float] | None = None  # the adaptive policy's, after this batch size
        self.alone_same: int | None = None  # plain batched rows equal to the prompt decoded alone

    def add(self, spec, base, greedy: bool) -> None:
        for r in spec.rows:
            self.stats.merge(r.stats())
        self.tokens += spec.num_tokens
        self.base_tokens += base.num_tokens
        # decode phase only: the prefill is the same forward in both, and a held-out prompt of
        # 2,544 tokens would otherwise outweigh 48 decoded tokens
        self.time += spec.total_time - spec.prefill_time
        self.base_time += base.total_time - base.prefill_time
        for key, t in (("prefill_s", spec.prefill_time), ("draft_s", spec.draft_time),
                       ("verify_s", spec.verify_time), ("other_s", spec.other_time)):
            self.split[key] += t
        self.asked += spec.draft_lengths
        self.base_outputs += [r.tokens for r in base.rows]
        if greedy:
            self.compared += len(spec.rows)
            self.matched += sum(s.tokens == b.tokens for s, b in zip(spec.rows, base.rows))

    def to_dict(self) -> dict:
        tps = self.tokens / self.time if self.time > 0 else 0.0
        base_tps = self.base_tokens / self.base_time if self.base_time > 0 else 0.0
        out = {
            "batch_size": self.B,
            "tokens_per_s": tps,
            "baseline_tokens_per_s": base_tps,
            "speedup": tps / base_tps if base_tps else None,
            **self.stats.to_dict(),
            "new_tokens": self.tokens,
            "decode_time_s": self.time,
            **self.split,
            "greedy_match": f"{self.matched}/{self.compared}" if self.compared else None,
        }
        if self.alone_same is not None:
            out["batched_vs_alone"] = f"{self.alone_same}/{len(self.base_outputs)}"
        if self.alpha_estimate is not None:
            counts = {k: self.asked.count(k) for k in sorted(set(self.asked))}
            out["draft_lengths"] = {str(k): n for k, n in counts.items()}
            out["alpha_estimate"] = self.alpha_estimate
        return out
