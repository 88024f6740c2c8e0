"""Sparse self-speculation on long generations: SparseSpec's PillarAttn (``--drafter sparsespec``)
against a StreamingLLM-style sliding window (``--drafter streaming``) at the same key budget.

    python -m bench.sparsespec [--prompts 2] [--max-new-tokens 4096] [--k 8] [--budgets 128,32]
                               [--fraction 0.05] [--strides 8,32] [--sink 16] [--drafters sparsespec,streaming]
                               [--baseline]
                               [--threads N] [--quick] [--no-append]

Target: the embedded SmolLM2-135M-Instruct (fp32; 8192 positions). Greedy, eos ignored: every
row generates ``--max-new-tokens``. Prompts: the ``--prompts`` longest of the ShareGPT held-out
split (two summaries of ~1.36k-token articles come first), decoded as one batch per row of the
table through the real decoder (``inference.decoder.Decoder``), chains of ``--k``.

Rows: sparsespec at each budget (K = max(budget, ceil(fraction * L)), L the row's kept length)
and each stride (draft steps between refreshes of the selection; k = stride refreshes at every
verify, as the paper does); streaming (the first ``--sink`` keys and the most recent, K in all)
at each budget and the first stride (``--drafters`` keeps one kind of row). Columns: alpha_j (conditional acceptance at draft depth j),
tau (tokens per verify step), the share of past keys the draft steps read per layer and KV head
against full attention, selections made, and the times of this run (``--baseline``: plain
decoding of the same batch, its tokens/s, and whether greedy output matched); tokens/s leave the
prefill out (each prompt is prefilled once, then reused from a prompt cache).

What it shows and what it does not. A draft step runs the target's every weight, as a plain step
does: what sparse drafting saves is the KV reads of attention, the "keys read" column. On a CPU
at these lengths a forward's time is its weights' (a draft step costs about a plain step), so a
step of k drafts and a verify costs more than the k + 1 plain steps of the most tokens it can
emit: slower than plain decoding at any tau. The speed-up needs a GPU at large batch and long
outputs, where reading the KV cache dominates a step. Times are reported as measured, nothing more.

Output: the table, printed and, unless ``--no-append`` or ``--quick``, written as this benchmark's
section of BENCHMARKS.md (the one it replaces moves to bench/HISTORY.md). ``--quick``: 1 prompt,
48 new tokens, k 4, one budget and stride: a smoke run.
"""

from __future__ import annotations

import argparse
from datetime import datetime, timezone

from bench.machine import LoadWindow, cpu_name, load_note
from bench.runs import main_with_errors

from draftlab.errors import DraftlabError

TITLE = "Sparse self-speculation: SparseSpec against a sliding window"


def _ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise DraftlabError(f"{flag}: expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise DraftlabError(f"{flag}: expected integers >= 1, got {text!r}")
    return values


def parse_args(argv):
    p = argparse.ArgumentParser(prog="bench.sparsespec", description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=2, help="the N longest ShareGPT held-out prompts, one batch")
    p.add_argument("--max-new-tokens", type=int, default=4096)
    p.add_argument("--k", type=int, default=8, help="drafts per step (the paper's stride is its draft length, 8)")
    p.add_argument("--budgets", default="128,32", help="K's floors (the paper's 128 first)")
    p.add_argument("--fraction", type=float, default=0.05, help="K's share of the kept length (the paper's 0.05)")
    p.add_argument("--strides", default="8,32", help="draft steps between refreshes")
    p.add_argument("--sink", type=int, default=16, help="streaming: first keys always kept (the reference's 16)")
    p.add_argument("--drafters", default="sparsespec,streaming", help="which rows: sparsespec, streaming or both")
    p.add_argument("--baseline", action="store_true", help="also decode plainly: tokens/s and the greedy match")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    p.add_argument("--quick", action="store_true", help="1 prompt, 48 tokens, k 4, one budget and stride")
    p.add_argument("--no-append", action="store_true", help="print the table; leave BENCHMARKS.md as it is")
    args = p.parse_args(argv)
    if args.quick:
        args.prompts, args.max_new_tokens, args.k, args.budgets, args.strides = 1, 48, 4, "32", "4"
    args.budgets, args.strides = _ints(args.budgets, "--budgets"), _ints(args.strides, "--strides")
    args.drafters = [d.strip() for d in args.drafters.split(",") if d.strip()]
    if not args.drafters or not set(args.drafters) <= {"sparsespec", "streaming"}:
        raise DraftlabError(f"--drafters: expected sparsespec, streaming or both, comma-separated, got {','.join(args.drafters)!r}")
    if args.prompts < 1 or args.max_new_tokens < 1:
        raise DraftlabError("--prompts and --max-new-tokens must be >= 1")
    from draftlab.inference.sparsespec import SparseSpecProposer, StreamingProposer

    for b in args.budgets:  # every option checked before the target loads
        for s in args.strides:
            SparseSpecProposer(b, args.fraction, s)
        StreamingProposer(b, args.fraction, args.strides[0], args.sink)
    return args


def _prompts(target, n: int, max_new_tokens: int) -> list[list[int]]:
    from draftlab.inference.prompts import prompt_conversations, tokenize_prompts

    found = sorted(tokenize_prompts(prompt_conversations("sharegpt-heldout", None), target.tokenizer),
                   key=lambda p: -len(p.prompt_ids))
    if n > len(found):
        raise DraftlabError(f"--prompts {n}: the ShareGPT held-out split holds {len(found)}")
    prompts = [list(p.prompt_ids) for p in found[:n]]
    room = target.config.max_position_embeddings - max(map(len, prompts))
    if max_new_tokens > room:
        raise DraftlabError(f"--max-new-tokens {max_new_tokens}: the longest prompt leaves {room} of the target's positions")
    return prompts


def repeated_share(prompt: list[int], tokens: list[int], n: int = 8) -> float:
    """Share of ``tokens`` whose n-gram (it and the n - 1 before it, prompt included) already
    occurred earlier in the row: how much of a generation copies its own context."""
    seq, seen, hits = list(prompt) + list(tokens), set(), 0
    for i in range(n, len(seq) + 1):
        gram = tuple(seq[i - n:i])
        hits += i > len(prompt) and gram in seen
        seen.add(gram)
    return hits / max(len(tokens), 1)


def _row(name: str, proposer, res, k: int, seconds: float, plain) -> dict:
    from draftlab.inference.metrics import AcceptanceStats, tau_standard_error

    stats = AcceptanceStats()
    for r in res.rows:
        stats.merge(r.stats())
    se = tau_standard_error([r.stats() for r in res.rows])
    alpha = stats.alpha + [None] * (k - len(stats.alpha))
    tokens = res.num_tokens
    return {"name": name, "alpha": alpha[:k], "tau": stats.tau, "tau_se": se, "steps": stats.num_steps,
            "keys": proposer.kv_read_fraction, "refreshes": proposer.refreshes, "tok_s": tokens / seconds,
            "draft_s": res.draft_time / max(res.num_steps, 1), "verify_s": res.verify_time / max(res.num_steps, 1),
            "match": None if plain is None else [r.tokens for r in res.rows] == plain}


def _table(rows: list[dict], k: int, baseline) -> str:
    head = ["drafter"] + [f"α{j}" for j in range(1, k + 1)] + ["τ", "keys read", "selections", "draft s/step",
                                                               "verify s/step", "tok/s"]
    if baseline is not None:
        head.append("= plain")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    fmt = lambda x: "–" if x is None else f"{x:.2f}"  # noqa: E731
    for r in rows:
        cells = [r["name"], *map(fmt, r["alpha"]), f"{r['tau']:.2f}" + ("" if r["tau_se"] is None else f" ± {r['tau_se']:.2f}"), "–" if r["keys"] is None else f"{100 * r['keys']:.1f}%",
                 str(r["refreshes"]), f"{r['draft_s']:.3f}", f"{r['verify_s']:.3f}", f"{r['tok_s']:.2f}"]
        if baseline is not None:
            cells.append("yes" if r["match"] else "NO")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run(argv, args) -> int:
    import torch
    from tqdm import tqdm

    from draftlab.inference.decoder import Decoder, generate_plain_batch
    from draftlab.inference.prefill import PromptCache
    from draftlab.inference.shapes import Chain
    from draftlab.inference.sparsespec import SparseSpecProposer, StreamingProposer
    from draftlab.models.target import Target

    if args.threads:
        torch.set_num_threads(args.threads)
    started = datetime.now(timezone.utc)
    target = Target.load("default", dtype="float32")
    prompts = _prompts(target, args.prompts, args.max_new_tokens)
    lengths = [len(p) for p in prompts]
    print(f"# SparseSpec vs sliding window — SmolLM2-135M-Instruct fp32 on {cpu_name()}, {torch.get_num_threads()} thread(s)")
    print(f"# {len(prompts)} prompt(s) of {lengths} tokens, {args.max_new_tokens} new tokens each (greedy, eos ignored): "
          f"kept lengths {min(lengths)}..{max(lengths) + args.max_new_tokens}; chains of {args.k}; fraction {args.fraction}",
          flush=True)
    cache = PromptCache(target)  # each row of the table prefills the same prompts: once
    measured = LoadWindow()
    plain = repeats = None
    if args.baseline:
        res = generate_plain_batch(target, prompts, args.max_new_tokens, eos_token_id=None, prompt_cache=cache)
        plain = [r.tokens for r in res.rows]
        repeats = ", ".join(f"{100 * repeated_share(p, t):.0f}%" for p, t in zip(prompts, plain))
        print(f"# plain decoding: {res.num_tokens / (res.total_time - res.prefill_time):.2f} tok/s; new tokens whose "
              f"8-gram occurred earlier in the row: {repeats}", flush=True)
    configs = [(f"sparsespec K≥{b} stride {s}", SparseSpecProposer(b, args.fraction, s))
               for b in args.budgets for s in args.strides if "sparsespec" in args.drafters]
    configs += [(f"streaming K≥{b} sink {args.sink}", StreamingProposer(b, args.fraction, args.strides[0], args.sink))
                for b in args.budgets if "streaming" in args.drafters]
    rows = []
    for name, proposer in configs:
        # a row is minutes to an hour on a CPU: its tokens so far, every half minute
        with tqdm(total=len(prompts) * args.max_new_tokens, desc=name, unit="tok", mininterval=30) as bar:
            res = Decoder(target, proposer).generate(prompts, args.max_new_tokens, Chain(args.k), eos_token_id=None,
                                                     prompt_cache=cache, on_step=lambda row, tokens: bar.update(len(tokens)))
        rows.append(_row(name, proposer, res, args.k, res.total_time - res.prefill_time, plain))
        r = rows[-1]
        print(f"# {name}: tau {r['tau']:.2f}, keys read {100 * (r['keys'] or 0):.1f}%, {r['tok_s']:.2f} tok/s", flush=True)
    window = measured.close()
    text = (f"{len(prompts)} prompt(s) of {lengths} tokens (the longest held-out ShareGPT), {args.max_new_tokens} new tokens "
            f"each, greedy, eos ignored; chains of {args.k}; fraction {args.fraction}; SmolLM2-135M-Instruct fp32, {cpu_name()}, "
            f"{torch.get_num_threads()} thread(s).\n\n{_table(rows, args.k, plain)}\n\n"
            f"τ ± one standard error with prompts as the sampled units (two or more prompts). "
            f"keys read: past keys a draft step attended per layer and KV head, over a full-attention step's, pooled "
            f"over rows and draft steps; the first selection of sparsespec comes from the first verify (the drafts before "
            f"it attend to every key)."
            + ("" if repeats is None else f" Plain decoding's new tokens whose 8-gram occurred earlier in their row (a copy "
               f"of the row's own context): {repeats}.")
            + f" {load_note(window)}.\n")
    print()
    print(text)
    if not (args.quick or args.no_append):
        from bench.sections import append_run

        append_run(TITLE, started, "bench.sparsespec", argv, text)
    return 0


def main(argv=None) -> int:
    return main_with_errors("bench.sparsespec", parse_args, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
