"""Speculation on RL rollouts: DAS's per-problem suffix tries against one global trie, window
sizes, and the length-aware budget's effect on a batch's makespan.

    python -m bench.rollouts [--policies DIR] [--problems 6] [--epochs 3] [--samples 4]
                             [--max-new-tokens 48] [--k 4] [--windows 1,2,16] [--threads N] [--quick]

Policies: a drifting sequence (``draftlab rollouts make-policies``'s RAFT updates of the embedded
SmolLM2-135M-Instruct, fp32); without ``--policies`` one is made first in a temporary directory
(``--problems``, ``--epochs``). Each epoch samples ``--samples`` rollouts per problem from that
epoch's policy at temperature 1 with plain decoding (each problem's samples as one batch).

Then, as simulations over those rollouts (``inference.das_sim``; replay is exact in
distribution for point-mass chains), all of an epoch's rollouts decoding together in lockstep,
each drafter keeping its own history across epochs:

* τ per epoch, ± one standard error with problems as the units: per-request suffix trie (no
  history), DAS per-problem tries with each window of ``--windows`` epochs, and one global trie
  with the largest window; then paired by problem: each DAS row against the per-request trie,
  and per-problem against global tries at the largest window;
* makespan per epoch: the decoder's forward cost fitted as ``c_base + c_tok * n_tokens``
  (``inference.das_budget.measure_costs``, its MRE printed) and the batch's simulated makespan
  without speculation, with every row drafting up to k, and with DAS's budget (short rows 0,
  medium k/2, long k), per-problem tries with the largest window.

Output: Markdown tables, printed, and, unless ``--no-append`` or ``--quick``, this benchmark's
section of BENCHMARKS.md rewritten (the one it replaces moves to bench/HISTORY.md). ``--quick``:
2 problems x 2 samples x 2 epochs x 16 tokens, policies made with one step.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

from bench.machine import LoadWindow, cpu_name, load_note
from bench.runs import main_with_errors

from draftlab.errors import DraftlabError

TITLE = "Speculation on RL rollouts: DAS"


def parse_args(argv):
    p = argparse.ArgumentParser(prog="bench.rollouts", description=__doc__.splitlines()[0])
    p.add_argument("--policies", type=Path, help="policies.json (or its directory) from draftlab rollouts make-policies")
    p.add_argument("--problems", type=int, default=6, help="problems (made here without --policies; else the first N)")
    p.add_argument("--epochs", type=int, default=3, help="policies made without --policies")
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--windows", default="1,2,16", help="DAS windows in epochs (the paper: 16 or 32)")
    p.add_argument("--min-prob", type=float, default=0.1)
    p.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    p.add_argument("--quick", action="store_true", help="2 problems x 2 samples x 2 epochs x 16 tokens")
    p.add_argument("--no-append", action="store_true", help="print the tables; leave BENCHMARKS.md as it is")
    args = p.parse_args(argv)
    try:
        args.windows = sorted({int(w) for w in args.windows.split(",")})
    except ValueError:
        raise DraftlabError(f"--windows: expected comma-separated integers, got {args.windows!r}") from None
    if min(args.windows) < 1:
        raise DraftlabError(f"--windows: each window must be >= 1 epoch, got {min(args.windows)}")
    if args.quick:
        args.problems, args.samples, args.epochs, args.max_new_tokens = 2, 2, 2, 16
    for flag in ("problems", "epochs", "samples", "k"):
        if getattr(args, flag) < 1:
            raise DraftlabError(f"--{flag.replace('_', '-')} must be >= 1")
    if args.max_new_tokens < 2:
        raise DraftlabError("--max-new-tokens must be >= 2")
    return args


def _pm(x: float, se: float | None) -> str:
    return f"{x:.2f}" if se is None else f"{x:.2f} ± {se:.2f}"


def _signed(x: float, se: float | None) -> str:
    return f"{x:+.2f}" if se is None else f"{x:+.2f} ± {se:.2f}"


def sample_epoch(target, prompts, samples: int, max_new_tokens: int, epoch: int) -> list[tuple[list[int], list[int]]]:
    """[(prompt, response)] of ``samples`` plain rollouts per prompt at temperature 1."""
    from draftlab.inference.decoder import generate_plain_batch

    rows = []
    for i, prompt in enumerate(prompts):
        res = generate_plain_batch(target, [prompt] * samples, max_new_tokens, temperature=1.0, seed=epoch * 1009 + i,
                                   eos_token_id=target.tokenizer.eos_token_id)
        rows += [(prompt, r.tokens) for r in res.rows]
    return rows


def run(argv, args) -> int:
    import torch

    from draftlab.inference.das import DASProposer, RolloutHistory
    from draftlab.inference.das_budget import LengthBudget, measure_costs
    from draftlab.inference.das_sim import makespan, replay_batch, tau, tau_difference, tau_standard_error
    from draftlab.inference.policies import PolicySequence
    from draftlab.inference.rollout_tasks import make_problems, reward
    from draftlab.inference.rollouts import prompt_of
    from draftlab.inference.suffix import SuffixProposer

    if args.threads:
        torch.set_num_threads(args.threads)
    started = datetime.now(timezone.utc)
    measured = LoadWindow()
    tmp = None
    if args.policies is None:
        from draftlab.train.raft import make_policies

        tmp = tempfile.TemporaryDirectory(prefix="bench-rollouts-")
        problems = make_problems(["count", "add", "spell", "repeat"], args.problems, 0)
        make_policies("default", Path(tmp.name) / "p", problems, args.epochs, samples=args.samples,
                      steps=1 if args.quick else 2, max_new_tokens=args.max_new_tokens)
        args.policies = Path(tmp.name) / "p"
    policies = PolicySequence.read(args.policies)
    policies.check()
    problems = policies.problems[: args.problems]
    k, widest = args.k, max(args.windows)

    def das(window, scope="problem", budget=None):
        h = RolloutHistory(window, scope)
        return h, (lambda: DASProposer(h, budget=budget, min_prob=args.min_prob))

    # each drafter's history lives across the epochs; the budget's and the uniform-k rows share nothing
    configs = {"suffix (per request)": (None, lambda: SuffixProposer(min_prob=args.min_prob))}
    configs.update({f"DAS per-problem W={w}": das(w) for w in args.windows})
    configs[f"DAS global W={widest}"] = das(widest, "global")
    budgeted = das(widest, budget=LengthBudget(k_medium=max(1, k // 2), k_long=k))

    tau_lines = ["| epoch | policy | mean reward | mean length | " + " | ".join(configs) + " |",
                 "|---|---|---|---|" + "---|" * len(configs)]
    base_name, local, pooled = "suffix (per request)", f"DAS per-problem W={widest}", f"DAS global W={widest}"
    pairs = [(n, base_name) for n in configs if n != base_name] + [(local, pooled)]
    diff_lines = ["| epoch | " + " | ".join(f"{a} − {b}" for a, b in pairs) + " |", "|---|" + "---|" * len(pairs)]
    span_lines = ["| epoch | rows | no speculation (s) | uniform k (s) | DAS budget (s) | budget / uniform | budget / none |",
                  "|---|---|---|---|---|---|---|"]
    costs = None
    for epoch in range(len(policies.entries)):
        target = policies.load(epoch)
        if costs is None:
            costs = measure_costs(target)  # the cost of a forward depends on shapes, not weights
        prompts = [prompt_of(target.tokenizer, p) for p in problems]
        rows = sample_epoch(target, prompts, args.samples, args.max_new_tokens, epoch)
        rewards = [reward(problems[i // args.samples], target.tokenizer.decode(r, skip_special_tokens=True))
                   for i, (_, r) in enumerate(rows)]
        traces = {}
        for name, (history, make) in configs.items():
            if history is not None:
                history.begin_epoch(epoch)
            traces[name] = replay_batch(make, rows, k, history)
        budgeted[0].begin_epoch(epoch)
        with_budget = replay_batch(budgeted[1], rows, k, budgeted[0])
        mean_len = sum(len(r) for _, r in rows) / len(rows)
        problem_of = [i // args.samples for i in range(len(rows))]  # the interval's units: a problem's samples share its trie
        tau_lines.append(f"| {epoch} | {policies.entries[epoch]} | {sum(rewards) / len(rewards):.2f} | {mean_len:.1f} | "
                         + " | ".join(_pm(tau(t), tau_standard_error(t, problem_of)) for t in traces.values()) + " |")
        diff_lines.append(f"| {epoch} | " + " | ".join(
            _signed(*tau_difference(traces[a], traces[b], problem_of)) for a, b in pairs) + " |")
        none = makespan([[(0, 0)] * (len(r) - 1) for _, r in rows], costs)
        uniform = makespan(traces[f"DAS per-problem W={widest}"], costs)
        budget = makespan(with_budget, costs)
        span_lines.append(f"| {epoch} | {len(rows)} | {none:.3f} | {uniform:.3f} | {budget:.3f} | {budget / uniform:.3f} | "
                          f"{budget / none:.3f} |")
        print(tau_lines[-1], file=sys.stderr, flush=True)
        del target
    window = measured.close()
    text = (f"τ per epoch ± one standard error with problems as the sampled units (simulation: each drafter replayed over "
            f"the epoch's plain rollouts, all decoding together; chains of k = {k}, min_prob {args.min_prob}):\n\n"
            + "\n".join(tau_lines) + "\n\n"
            f"The same τ paired: differences on the same rollouts, ± one bootstrap standard error resampling problems for "
            f"both drafters at once:\n\n" + "\n".join(diff_lines) + "\n\n"
            f"Forward cost fitted on draftlab's decoder: c_base = {costs.c_base * 1e3:.2f} ms, c_tok = {costs.c_tok * 1e3:.3f} ms/token "
            f"(MRE {100 * costs.mre:.1f} % over {len(costs.points)} shapes).\n\n"
            f"Makespan of each epoch's batch (simulation fed by the fitted costs; DAS per-problem W={widest}; budget: short 0, "
            f"medium {max(1, k // 2)}, long {k}):\n\n" + "\n".join(span_lines) + "\n\n"
            f"{len(problems)} problems × {args.samples} samples × {len(policies.entries)} epochs, ≤ {args.max_new_tokens} new tokens, "
            f"temperature 1, fp32, {cpu_name()}, {torch.get_num_threads()} threads. {load_note(window)}\n")
    print(text)
    if not (args.quick or args.no_append):
        from bench.sections import append_run

        append_run(TITLE, started, "bench.rollouts", argv, text)
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main_with_errors("bench.rollouts", parse_args, run))
