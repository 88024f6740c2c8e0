"""What a step the draft-length rule leaves undrafted costs against plain decoding's step.

    python -m bench.plain_step [RUN_OR_CHECKPOINT] [--batch-size 8] [--groups 36] [--num-prompts 16]
                               [--max-new-tokens 48] [--no-append]

Where the rule picks k = 0 at every step (``inference/draft_length.py``), the speculative decoder
runs plain steps, yet it still captures the target's hidden states its drafter will read and keeps
the unread steps for it. This decodes each group of B held-out prompts in lockstep three ways:
plain decoding, the decoder with a rule that never drafts (its plain steps exactly), and the same
without the hidden-state capture, then reports each one's decode-phase speed over plain decoding's
with a 90 % bootstrap interval over the groups, and the split between the target's forward (verify)
and the rest of the loop. Greedy outputs are checked equal to plain decoding's.
"""

from __future__ import annotations

import argparse
import sys
from datetime import datetime, timezone
from pathlib import Path

from bench.machine import cpu_name
from bench.runs import checkpoint_of, main_with_errors, recipe_of, target_of
from bench.sections import append_run

REPO = Path(__file__).resolve().parent.parent


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run", nargs="?", default=str(REPO / "runs" / "smollm2-135m-eagle3"))
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--groups", type=int, default=36)
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--no-append", action="store_true")
    args = p.parse_args(argv)
    if min(args.batch_size, args.groups, args.num_prompts, args.max_new_tokens) < 1:
        p.error("--batch-size, --groups, --num-prompts and --max-new-tokens must be >= 1")
    return args


def run(argv, args) -> int:
    from draftlab.checkpoint import read_meta
    from draftlab.inference.batch_eval import crossover_orders, speedup_interval
    from draftlab.inference.decoder import Decoder, run_lockstep
    from draftlab.inference.draft_length import DraftLength
    from draftlab.inference.prefill import PromptCache
    from draftlab.inference.prompts import load_prompts
    from draftlab.inference.proposer import load_proposer
    from draftlab.inference.shapes import Chain

    class Uncaptured(Decoder):
        """Plain steps without the hidden-state capture (the drafter gets them at the prefill only)."""

        def _plain_step(self, *a):
            kept, self.layers = self.layers, []
            try:
                return super()._plain_step(*a)
            finally:
                self.layers = kept

    ckpt = checkpoint_of(Path(args.run))
    recipe = recipe_of(ckpt, read_meta(ckpt))
    target = target_of(recipe)
    ids = [p.prompt_ids for p in load_prompts("sharegpt-heldout", target.tokenizer, args.num_prompts, data_spec=recipe.data)]
    proposer = load_proposer(ckpt, target)
    B = args.batch_size
    decoders = {"plain decoding": Decoder(target), "rule, no drafting step": Decoder(target, proposer.fork()),
                "same, no hidden-state capture": Uncaptured(target, proposer.fork())}
    labels = list(decoders)
    opts = dict(max_new_tokens=args.max_new_tokens, eos_token_id=target.tokenizer.eos_token_id, prompt_cache=PromptCache(target))

    def steps(label, group, seed):
        if label == labels[0]:
            return decoders[label].steps(group, shape=None, seed=seed, **opts)
        never = DraftLength({B: [1.0, float("inf")]})  # k = 1 costs more than it can gain: every step plain
        return decoders[label].steps(group, shape=Chain(1), seed=seed, draft_length=never, **opts)

    for label in labels:  # warm-up, untimed
        run_lockstep([steps(label, ids[:B], 0)])
    started = datetime.now(timezone.utc)
    orders, starts = crossover_orders(len(labels)), list(range(0, len(ids), B))
    groups = {label: [] for label in labels}  # per group: tokens, decode s, verify s, other s
    for g in range(args.groups):
        start = starts[g % len(starts)]
        order = [labels[i] for i in orders[g % len(orders)]]
        done = dict(zip(order, run_lockstep([steps(label, ids[start : start + B], start) for label in order])))
        for label, r in done.items():
            if [x.tokens for x in r.rows] != [x.tokens for x in done[labels[0]].rows]:
                raise SystemExit(f"{label}: greedy output differs from plain decoding (group {g})")
            groups[label].append((r.num_tokens, r.total_time - r.prefill_time, r.verify_time, r.other_time))
        print(f"{g + 1}/{args.groups} groups", flush=True)

    def ratio(label, i):
        pairs = [(a[0], a[i], b[0], b[i]) for a, b in zip(groups[label], groups[labels[0]])]
        tokens, secs, base_tokens, base_secs = (sum(p[j] for p in pairs) for j in range(4))
        lo, hi = speedup_interval(pairs)
        return f"{tokens / secs / (base_tokens / base_secs):.3f} ({lo:.3f}-{hi:.3f})"

    lines = ["| decoding | decode s | verify s | other s | speed over plain | forward speed over plain |", "|---|---|---|---|---|---|"]
    for label in labels:
        t = [sum(x[i] for x in groups[label]) for i in range(4)]
        rel = ("–", "–") if label == labels[0] else (ratio(label, 1), ratio(label, 2))
        lines.append(f"| {label} | {t[1]:.2f} | {t[2]:.2f} | {t[3]:.3f} | {rel[0]} | {rel[1]} |")
    text = "\n".join(lines) + (
        f"\n\nBatch {B}, {args.groups} groups of held-out ShareGPT prompts x {args.max_new_tokens} new tokens, greedy, "
        f"in lockstep (orders balanced over every {len(orders)} groups); brackets: 90 % bootstrap interval over the groups; "
        f"checkpoint `{ckpt.relative_to(REPO) if ckpt.is_relative_to(REPO) else ckpt}`; {cpu_name()}.\n")
    print(text)
    if not args.no_append:
        append_run("The draft-length rule's plain step", started, "bench.plain_step", argv, text)
    return 0


if __name__ == "__main__":
    sys.exit(main_with_errors("bench.plain_step", parse_args, run))
