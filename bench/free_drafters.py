"""Drafting without a second model beside a trained EAGLE-3, per data set, in one run.

    python -m bench.free_drafters [--eagle CKPT] [--layerskip CKPT] [--num-prompts 4]
                                  [--max-new-tokens 64] [--k 3] [--lookahead W,N,G] [--threads N]
                                  [--no-append] [--quick]

Target: the embedded SmolLM2-135M-Instruct (fp32). Greedy. Prompt sets: HumanEval, Spec-Bench's
summarization and RAG categories (the repetitive ones: the answer quotes its prompt), Spec-Bench
round-robin over all categories, and the ShareGPT held-out split; the first ``--num-prompts`` of
each. A Spec-Bench set is skipped, with a note, when its file is not found (``presets.spec_bench_path``).

Rows, each through ``inference.evaluate.evaluate`` (plain decoding and the drafter in lockstep on
every prompt, so each speedup is a paired ratio from this run; tau = 1 + sum_j a_j):
n-gram prompt lookup (chain k), suffix trie (chain k and tree), Jacobi lookahead (tree,
``--lookahead`` W,N,G), layer-skip self-speculation (``--layerskip``: chain k, its adaptive exit),
EAGLE-3 (``--eagle``: chain k). Trees: depth k, top-k 4, 16 nodes; kept small because on a CPU a
verify forward costs about one plain step only up to about ten inputs.

Output: one Markdown table (rows: set x drafter), and, unless ``--no-append`` or ``--quick``,
the "Drafting without a second model" section of BENCHMARKS.md. ``--quick``: 2 prompts x 16
tokens on the first set only, nothing written.
"""

from __future__ import annotations

import argparse
import sys
from datetime import datetime, timezone
from pathlib import Path

from bench.machine import LoadWindow, cpu_name, load_note
from bench.runs import main_with_errors
from bench.sections import append_run

from draftlab.errors import DraftlabError

TITLE = "Drafting without a second model"
# (label, data set, Spec-Bench category or None)
SETS = [
    ("HumanEval", "humaneval", None),
    ("Spec-Bench summarization", "spec-bench", "summarization"),
    ("Spec-Bench RAG", "spec-bench", "rag"),
    ("Spec-Bench (all)", "spec-bench", None),
    ("ShareGPT held-out", "sharegpt-heldout", None),
]


def parse_args(argv):
    p = argparse.ArgumentParser(prog="bench.free_drafters", description=__doc__.splitlines()[0])
    p.add_argument("--eagle", type=Path, help="an EAGLE-3 checkpoint (e.g. runs/smollm2-135m-eagle3/checkpoints/best)")
    p.add_argument("--layerskip", type=Path, help="a layer-skip checkpoint (recipes/smollm2-135m-layerskip.yaml's)")
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--lookahead", default="5,4,5", help="Jacobi lookahead's W,N,G (window, n-gram size, guesses)")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    p.add_argument("--no-append", action="store_true", help="print only; leave BENCHMARKS.md as it is")
    p.add_argument("--quick", action="store_true", help="2 prompts x 16 tokens, first set only, nothing written")
    args = p.parse_args(argv)
    for flag in ("eagle", "layerskip"):
        path = getattr(args, flag)
        if path is not None and not path.is_dir():
            raise DraftlabError(f"--{flag}: no checkpoint directory at {path}")
    if args.num_prompts < 1 or args.max_new_tokens < 1 or not 1 <= args.k <= 64:
        raise DraftlabError("--num-prompts and --max-new-tokens must be >= 1, --k in 1..64")
    try:
        args.lookahead = dict(zip("WNG", (str(int(x)) for x in args.lookahead.split(",")), strict=True))
    except ValueError:
        raise DraftlabError(f"--lookahead: expected W,N,G (three integers), got {args.lookahead!r}") from None
    from draftlab.inference.proposer import FREE_DRAFTERS

    FREE_DRAFTERS.get("lookahead").from_options(args.lookahead)  # W, N, G checked before the target loads
    if args.quick:
        args.num_prompts, args.max_new_tokens = 2, 16
    return args


def prompt_sets(tokenizer, n: int, quick: bool) -> tuple[list, list[str]]:
    """[(label, prompts)] and notes on the sets skipped."""
    from draftlab.inference.prompts import prompt_conversations, tokenize_prompts

    sets, notes = [], []
    for label, data, category in SETS[:1] if quick else SETS:
        try:
            convs = prompt_conversations(data)
        except DraftlabError as e:
            notes.append(f"{label} skipped: {e}")
            continue
        if category is not None:
            convs = [c for c in convs if c[0] == category]
        if data == "spec-bench" and category is None:
            convs = prompt_conversations(data, min(n, len(convs)))  # round-robin over categories
        sets.append((label, tokenize_prompts(convs[:n], tokenizer)))
    return sets, notes


def drafters(target, args) -> list[tuple[str, object, object]]:
    """[(row label, proposer, shape)]; each proposer is built once and reused across sets."""
    from draftlab.inference.ngram import NgramProposer
    from draftlab.inference.proposer import FREE_DRAFTERS, load_proposer
    from draftlab.inference.shapes import Chain, DynamicTree

    chain, tree = Chain(args.k), DynamicTree(depth=args.k, top_k=4, total_tokens=16)
    suffix = FREE_DRAFTERS.get("suffix").from_options({})(target)
    lookahead = FREE_DRAFTERS.get("lookahead").from_options(args.lookahead)(target)
    W, N, G = args.lookahead.values()
    rows = [
        (f"n-gram lookup, chain {args.k}", NgramProposer(3, 1), chain),
        (f"suffix trie, chain {args.k}", suffix, chain),
        ("suffix trie, tree", suffix, tree),
        (f"Jacobi lookahead W={W} N={N} G={G}, tree", lookahead, tree),
    ]
    if args.layerskip is not None:
        rows.append((f"layer skip, chain {args.k}", load_proposer(args.layerskip, target, chain), chain))
    if args.eagle is not None:
        rows.append((f"EAGLE-3, chain {args.k}", load_proposer(args.eagle, target, chain), chain))
    return rows


def run(argv, args) -> int:
    import torch

    from draftlab.inference.evaluate import evaluate
    from draftlab.models.target import Target

    if args.threads:
        torch.set_num_threads(args.threads)
    started = datetime.now(timezone.utc)
    measured = LoadWindow()
    target = Target.load("default")
    eos = target.tokenizer.eos_token_id
    sets, notes = prompt_sets(target.tokenizer, args.num_prompts, args.quick)
    rows = drafters(target, args)
    lines = ["| prompt set | drafter | τ | α1 | speedup | greedy match |", "|---|---|---|---|---|---|"]
    for label, prompts in sets:
        for name, proposer, shape in rows:
            r = evaluate(target, proposer, prompts, shape, args.max_new_tokens, eos_token_id=eos)
            alpha1 = r["alpha"][0] if r["alpha"] else 0.0
            line = f"| {label} | {name} | {r['tau']:.2f} | {alpha1:.2f} | {r['speedup']:.2f}× | {r['greedy_match']} |"
            print(line, flush=True)
            lines.append(line)
    window = measured.close()
    text = "\n".join(lines) + "\n"
    text += (f"\n{args.num_prompts} prompts per set × {args.max_new_tokens} new tokens, greedy, fp32, "
             f"{cpu_name()}, {torch.get_num_threads()} threads. {load_note(window)}\n")
    if notes:
        text += "\n" + "\n".join(f"- {n}" for n in notes) + "\n"
    print(text)
    if not (args.no_append or args.quick):
        append_run(TITLE, started, "bench.free_drafters", argv, text)
    return 0


if __name__ == "__main__":
    sys.exit(main_with_errors("bench.free_drafters", parse_args, run))
