"""Speculation under load: speedup by batch size for n-gram lookup, a trained drafter at fixed
draft lengths, and the adaptive draft length (a rule calibrated at start-up).

    python -m bench.batch [RUN_OR_CHECKPOINT] [--batch-sizes 1,2,4,8,16] [--ks 1,2,3]
                          [--num-prompts 16] [--max-new-tokens 48] [--min-groups 3] [--adaptive-groups 0]
                          [--threads N] [--no-append] [--quick]

RUN_OR_CHECKPOINT defaults to runs/smollm2-135m-eagle3 (the README's main job); its target and
held-out ShareGPT split come from the checkpoint's recipe. ``inference.batch_eval.compare_batches``
decodes, at each batch size, the prompts in groups of B, each group plainly and by every
configuration in lockstep, so every speedup is over the same plain decoding of the same groups
(greedy; the prompts again until ``--min-groups`` groups are timed). Configurations: n-gram
prompt lookup (chain of max k), the drafter's chain at each fixed k, and the adaptive draft
length (``inference.draft_length``: k in 0..max k, or fewer where the drafter was trained to
draft fewer). ``--adaptive-groups N``: N more groups per batch size of the adaptive rule against
plain decoding alone, pooled into its row.

Output: a table per batch size and configuration, a speedup grid with 90 % bootstrap intervals
over the groups, the adaptive rule against plain decoding and the best fixed k (paired on the
same groups), its calibrated costs, and a PNG of speedup against batch size. Unless
``--no-append`` or ``--quick``, BENCHMARKS.md's section is rewritten (PNG under bench/figures/).
``--quick``: 4 prompts x 8 tokens, batch sizes 1,2, nothing written.
"""

from __future__ import annotations

import argparse
import sys
from datetime import datetime, timezone
from pathlib import Path

from bench.machine import LoadWindow, cpu_name, load_note
from bench.runs import checkpoint_of, main_with_errors, recipe_of, target_of
from bench.sections import append_run

REPO = Path(__file__).resolve().parent.parent
DEFAULT_RUN = REPO / "runs" / "smollm2-135m-eagle3"


def parse_args(argv):
    from draftlab.inference.batch_eval import parse_batch_sizes

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run", nargs="?", default=str(DEFAULT_RUN), help="training run directory or checkpoint")
    p.add_argument("--batch-sizes", default="1,2,4,8,16")
    p.add_argument("--ks", default="1,2,3", help="fixed draft lengths; the adaptive rule chooses up to the largest (or the drafter's trained depth)")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--min-groups", type=int, default=3,
                   help="time at least this many groups per batch size, decoding the prompts again if needed (default 3)")
    p.add_argument("--adaptive-groups", type=int, default=0,
                   help="then this many more groups per batch size of the adaptive rule against plain decoding alone (default 0)")
    p.add_argument("--no-append", action="store_true", help="print only, do not append to BENCHMARKS.md")
    p.add_argument("--quick", action="store_true", help="smoke run: 4 prompts x 8 tokens, batch sizes 1,2, nothing appended")
    args = p.parse_args(argv)
    if args.quick:
        args.num_prompts, args.max_new_tokens, args.batch_sizes = 4, 8, "1,2"
    args.batch_sizes = parse_batch_sizes(args.batch_sizes)
    args.ks = parse_batch_sizes(args.ks, "--ks")
    if min(args.num_prompts, args.max_new_tokens, args.min_groups) < 1 or (args.threads is not None and args.threads < 1):
        p.error("--num-prompts, --max-new-tokens, --min-groups and --threads must be >= 1")
    if args.adaptive_groups < 0:
        p.error("--adaptive-groups must be >= 0")
    return args


def configurations(ckpt: Path, target, ks: list[int]):
    """(label, proposer, shape, adaptive) in the order measured."""
    from draftlab.inference.batch_eval import Speculation
    from draftlab.inference.ngram import NgramProposer
    from draftlab.inference.proposer import load_proposer
    from draftlab.inference.shapes import Block, Chain

    proposer = load_proposer(ckpt, target)
    row = Block if "block" in proposer.shapes else Chain
    kmax = max(ks)
    out = [(f"ngram k={kmax}", NgramProposer(3, 1), Chain(kmax), False)]
    out += [(f"{proposer.name} k={k}", proposer, row(k), False) for k in sorted(ks)]
    depth = Speculation(proposer, row(kmax), True).depth  # fewer where the drafter was trained for fewer
    out.append((f"{proposer.name} adaptive k<={depth}", proposer, row(kmax), True))
    return out


def run(argv, args) -> int:
    import torch

    from draftlab.checkpoint import read_meta
    from draftlab.inference.batch_eval import Speculation, compare_batches
    from draftlab.inference.prompts import load_prompts
    from draftlab.inference.proposer import verifying_target
    from draftlab.inference.report import plot_speedup_by_batch

    if args.threads:
        torch.set_num_threads(args.threads)
    ckpt = checkpoint_of(Path(args.run))
    recipe = recipe_of(ckpt, read_meta(ckpt))
    target = target_of(recipe)
    prompts = load_prompts("sharegpt-heldout", target.tokenizer, args.num_prompts, data_spec=recipe.data)
    started = datetime.now(timezone.utc)
    measured = LoadWindow()
    configs = configurations(ckpt, target, args.ks)
    speculations = {label: Speculation(proposer, shape, adaptive) for label, proposer, shape, adaptive in configs}
    target = verifying_target(configs[-1][1], target)  # the drafter's verifier (Medusa-2: its merged target) for all
    print(f"{', '.join(speculations)}: each group of prompts decoded by each and by plain decoding, in lockstep", flush=True)
    results = compare_batches(
        target, speculations, prompts, args.batch_sizes, max_new_tokens=args.max_new_tokens, seed=recipe.seed,
        eos_token_id=target.tokenizer.eos_token_id, min_groups=args.min_groups, adaptive_groups=args.adaptive_groups,
        progress=lambda B, done, n: print(f"[batch {B}] {done}/{n} prompts", flush=True),
    )
    window = measured.close()

    text = tables(results, args.batch_sizes, args.adaptive_groups)
    print(text)
    if args.no_append or args.quick:
        return 0
    plot = REPO / "bench" / "figures" / f"batch-{started:%Y%m%d-%H%M}.png"
    plot_speedup_by_batch({label: r["entries"] for label, r in results.items()}, plot,
                          f"{ckpt.parent.parent.name}: {len(prompts)} held-out prompts x {args.max_new_tokens} tokens, greedy")
    note = (f"Checkpoint `{ckpt.relative_to(REPO) if ckpt.is_relative_to(REPO) else ckpt}`, {len(prompts)} held-out "
            f"ShareGPT prompts x {args.max_new_tokens} new tokens, greedy, {cpu_name()}, {torch.get_num_threads()} threads; "
            f"the target's small-row GEMMs ({target.row_plan or 'not measured'}); "
            f"{load_note(window)}. PNG: `{plot.relative_to(REPO)}`.")
    append_run("Speedup by batch size", started, "bench.batch", argv, f"{text}\n{note}")
    return 0


def tables(results: dict, batch_sizes: list[int], adaptive_groups: int = 0) -> str:
    from draftlab.inference.batch_eval import crossover_orders, speedup_interval

    head = "| configuration | batch | tok/s | plain tok/s | speedup | τ | draft % | verify % | other % | greedy match | batched = alone | draft lengths (k: steps) |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for label, r in results.items():
        for e in r["entries"]:
            t = e["decode_time_s"] or 1.0
            lengths = " ".join(f"{k}:{n}" for k, n in (e.get("draft_lengths") or {}).items()) or "–"
            lines.append(
                f"| {label} | {e['batch_size']} | {e['tokens_per_s']:.1f} | {e['baseline_tokens_per_s']:.1f} | {e['speedup']:.2f}× "
                f"| {e['tau']:.2f} | {100 * e['draft_s'] / t:.0f} | {100 * e['verify_s'] / t:.0f} | {100 * e['other_s'] / t:.0f} "
                f"| {e['greedy_match']} | {e.get('batched_vs_alone') or '–'} | {lengths} |"
            )
    entry = {label: {e["batch_size"]: e for e in r["entries"]} for label, r in results.items()}
    grid = ["| configuration | " + " | ".join(f"B={b}" for b in batch_sizes) + " |", "|" + "---|" * (len(batch_sizes) + 1)]
    for label, by_b in entry.items():
        grid.append(f"| {label} | " + " | ".join(_speedup(by_b[b]) for b in batch_sizes) + " |")
    fixed = [label for label in entry if " k=" in label and not label.startswith("ngram")]
    adaptive = next((label for label in entry if "adaptive" in label), None)
    summary = ""
    if adaptive and fixed:
        margins = []
        for b in batch_sizes:
            best = max(fixed, key=lambda label: entry[label][b]["speedup"])
            a, f = entry[adaptive][b], entry[best][b]
            # the groups both decoded (the adaptive row's first ones)
            both = [(ta, sa, tf, sf) for (ta, sa, _, _), (tf, sf, _, _) in zip(a["groups"], f["groups"])]
            tokens, seconds, fixed_tokens, fixed_seconds = (sum(g[i] for g in both) for i in range(4))
            lo, hi = speedup_interval(both)
            margins.append(f"B={b}: {a['speedup']:.2f}× vs best fixed {best.split()[-1]} {f['speedup']:.2f}× "
                           f"(adaptive / best fixed {tokens / seconds / (fixed_tokens / fixed_seconds):.3f}, 90 % interval {lo:.3f}-{hi:.3f})")
        by_b = entry[adaptive]
        slower = [b for b in batch_sizes if by_b[b]["speedup"] < 1.0]
        ties = [b for b in slower if _interval(by_b[b])[1] >= 1.0]
        verdict = ("at or above 1.000 at every batch size" if not slower else
                   f"below 1.000 at B = {', '.join(map(str, slower))}"
                   + (f" (the 90 % interval holds 1.000 at B = {', '.join(map(str, ties))})" if ties else ""))
        summary = ("\nAdaptive against plain decoding, to 3 decimals (90 % interval): "
                   + "; ".join(_verdict(b, by_b[b]) for b in batch_sizes) + f": {verdict}."
                   + " Against the best fixed k, on the same groups:\n\n"
                   + "\n".join(f"- {m}" for m in margins) + "\n")
    cycle = len(crossover_orders(len(results) + 1))
    note = ("\nEvery configuration decoded the same groups of prompts, each group by plain decoding and by every "
            "configuration in lockstep, one step of each in turn (orders balanced for what ran just before: each "
            f"configuration stepped right after each other equally often over every {cycle} groups); brackets: 90 % bootstrap interval over the groups.\n")
    if adaptive and results[adaptive].get("draft_length_rule"):
        rule = results[adaptive]["draft_length_rule"]
        note += ("The adaptive rule's calibrated cost per token of a step drafting k over a plain step's (k = 1, 2, ...): "
                 + "; ".join(f"B={b} " + " ".join(f"{c:.3f}" for c in costs[1:]) for b, costs in rule["cost"].items())
                 + f"; a draft must be predicted to gain more than {rule['margin']:.0%}.\n")
    if adaptive and adaptive_groups:
        note += (f"The adaptive rule also decoded {adaptive_groups} more groups at each batch size against plain decoding "
                 "alone (in lockstep, the order alternating), pooled into its row: its tokens/s, plain tok/s, speedup, "
                 "interval and greedy match count them; its margin over the best fixed k is paired on the groups both decoded.\n")
    return "\n".join(lines) + "\n\nSpeedup over plain batched decoding:\n\n" + "\n".join(grid) + "\n" + note + summary


def _verdict(b: int, e: dict) -> str:
    """One batch size's speedup to 3 decimals with its interval, and whether the rule drafted
    there at all (if not, it ran plain decoding's steps, and what separates the two is the
    decoder's own work and the machine's noise)."""
    lo, hi = _interval(e)
    plain_only = {int(k) for k, n in (e.get("draft_lengths") or {}).items() if n} == {0}
    return f"B={b} {e['speedup']:.3f} ({lo:.3f}-{hi:.3f}{', no drafting step' if plain_only else ''})"


def _interval(e: dict) -> tuple[float, float]:
    """An entry's 90 % speedup interval (the point estimate twice where none was computed)."""
    return tuple(e.get("speedup_interval") or (e["speedup"], e["speedup"]))


def _speedup(e: dict) -> str:
    lo, hi = _interval(e)
    return f"{e['speedup']:.2f}× ({lo:.2f}-{hi:.2f})"


def main(argv=None) -> int:
    return main_with_errors("bench.batch", parse_args, run, argv)


if __name__ == "__main__":
    sys.exit(main())
