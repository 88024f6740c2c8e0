"""``draftlab rollouts``: speculation on an RL run's rollouts.

    draftlab rollouts make-policies --out DIR [--target default] [--tasks add,count,spell,repeat]
                                    [--problems 8] [--epochs 3] [--samples 4] [--steps 2] [--lr 1e-3]
    draftlab rollouts run --policies DIR [--samples 4] [--k 4] [--window 16]
                          [--methods plain,suffix,das-global,das,das-budget] [--report out.json]
                          [--drafter CKPT --methods eagle3-stale,eagle3-kd,eagle3-rkd [--distill-steps 8]
                           [--distill-lr 1e-4] [--batch-sizes 1,4,16] [--drafter-out DIR]]

``make-policies`` writes a drifting policy sequence (RAFT updates of the target on its own
rewarded samples, :mod:`draftlab.train.raft`) and its ``policies.json``; ``run`` samples every
epoch's rollouts from it with and without speculation and reports τ, rewards, log-probabilities
and wall time per epoch and method (:mod:`draftlab.inference.rollouts`), as JSON and Markdown;
the EAGLE-3 methods (``--drafter``) distil their drafter toward each epoch's policy
(:mod:`draftlab.inference.respec`, :mod:`draftlab.train.online_distill`) and add α_1..α_k per epoch.
Every flag, the task names and the policy sequence's tokenizers are checked before a model loads.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from draftlab.errors import DraftlabError


def add_arguments(p: argparse.ArgumentParser) -> None:
    from draftlab.inference.rollout_tasks import TASKS
    from draftlab.inference.rollouts import DEFAULT_METHODS, METHODS

    sub = p.add_subparsers(dest="action", required=True)
    mk = sub.add_parser("make-policies", help="a drifting policy sequence: RAFT updates of the target on its rewarded samples")
    mk.add_argument("--out", required=True, type=Path, help="new directory for the policies and policies.json")
    mk.add_argument("--target", default="default", help="policy 0 (HF dir, hub id, .gguf, 'default')")
    mk.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated tasks ({', '.join(TASKS)})")
    mk.add_argument("--problems", type=int, default=8, help="problems, dealt round-robin over the tasks")
    mk.add_argument("--epochs", type=int, default=3, help="policies in the sequence (policy 0 is the target)")
    mk.add_argument("--samples", type=int, default=4, help="rollouts per problem an update samples")
    mk.add_argument("--keep", type=int, default=2, help="rewarded responses per problem trained on")
    mk.add_argument("--steps", type=int, default=2, help="optimizer steps per update")
    mk.add_argument("--lr", type=float, default=1e-3)
    mk.add_argument("--lora-rank", type=int, default=8)
    mk.add_argument("--max-new-tokens", type=int, default=64)
    mk.add_argument("--seed", type=int, default=0, help="the problems' and the samples' seed")

    rn = sub.add_parser("run", help="the rollout workload over a policy sequence, with and without speculation")
    rn.add_argument("--policies", required=True, type=Path, help="policies.json, or the directory holding it")
    rn.add_argument("--samples", type=int, default=4, help="rollouts per problem per epoch")
    rn.add_argument("--problems", type=int, default=None, help="the first N of the sequence's problems (default: all)")
    rn.add_argument("--k", type=int, default=4, help="drafts per step (the budget's long class)")
    rn.add_argument("--window", type=int, default=16, help="epochs of rollouts a DAS trie keeps (the paper: 16 or 32)")
    rn.add_argument("--methods", default=",".join(DEFAULT_METHODS), help=f"comma-separated ({', '.join(METHODS)}; default "
                    f"{','.join(DEFAULT_METHODS)}); plain always runs")
    rn.add_argument("--max-new-tokens", type=int, default=None, help="default: what make-policies sampled with, else 64")
    rn.add_argument("--min-prob", type=float, default=0.1, help="a draft stops where its count probability falls below this")
    rn.add_argument("--seed", type=int, default=0)
    rn.add_argument("--no-greedy-check", action="store_true", help="skip the per-epoch greedy decodings checked against plain")
    rn.add_argument("--report", type=Path, default=None, help="write the report here (.json) and its Markdown beside it (.md)")
    rn.add_argument("--drafter", default=None, help="eagle3-* methods: an EAGLE-3 checkpoint trained on the sequence's target")
    rn.add_argument("--distill-steps", type=int, default=8, help="eagle3-kd/-rkd: optimizer steps per epoch, each over all its rollouts")
    rn.add_argument("--distill-lr", type=float, default=1e-4)
    rn.add_argument("--distill-ttt-steps", type=int, default=None, help="draft positions distilled (default: the checkpoint's ttt_steps)")
    rn.add_argument("--batch-sizes", default=None,
                    help="eagle3-*: batch sizes the draft-length rule chooses k for (default: 1, samples, problems x samples; 'none': skip)")
    rn.add_argument("--drafter-out", type=Path, default=None, help="keep each epoch's distilled drafters here (default: discarded)")


def run(args) -> int:
    return {"make-policies": _make_policies, "run": _run}[args.action](args)


def _make_policies(args) -> int:
    from draftlab.inference.rollout_tasks import make_problems, parse_tasks
    from draftlab.train.raft import make_policies

    problems = make_problems(parse_tasks(args.tasks), args.problems, args.seed)
    manifest = make_policies(args.target, args.out, problems, args.epochs, samples=args.samples, keep=args.keep,
                             steps=args.steps, lr=args.lr, rank=args.lora_rank, max_new_tokens=args.max_new_tokens, seed=args.seed)
    print(f"wrote {manifest}")
    return 0


def _run(args) -> int:
    from draftlab import atomic
    from draftlab.inference.policies import PolicySequence
    from draftlab.inference.respec import EAGLE_METHODS, OnlineDrafters, OnlineSpec, batch_sizes
    from draftlab.inference.rollouts import WorkloadSpec, parse_methods, run_workload, to_markdown

    policies = PolicySequence.read(args.policies)
    spec = WorkloadSpec(samples=args.samples, k=args.k, window=args.window, methods=parse_methods(args.methods),
                        max_new_tokens=args.max_new_tokens or int(policies.made_by.get("max_new_tokens", 64)),
                        seed=args.seed, min_prob=args.min_prob, greedy_check=not args.no_greedy_check)
    spec.check()
    if args.problems is not None and not 1 <= args.problems <= len(policies.problems):
        raise DraftlabError(f"--problems must be in 1..{len(policies.problems)} (the sequence's problems), got {args.problems}")
    problems = policies.problems[: args.problems] if args.problems else policies.problems
    online_spec = OnlineSpec(args.drafter, args.distill_steps, args.distill_lr, args.distill_ttt_steps,
                             batch_sizes(args.batch_sizes, spec.samples, len(problems)), args.drafter_out)
    online_spec.check(spec.methods, policies.location(0))
    policies.check()
    eagles = any(m in EAGLE_METHODS for m in spec.methods)
    online = OnlineDrafters(online_spec, list(spec.methods), distill=_distiller(online_spec) if eagles else None)
    try:
        rep = run_workload(policies, spec, problems, online=online)
    finally:
        online.close()
    text = to_markdown(rep)
    print(text)
    if args.report is not None:
        atomic.write_text(args.report, json.dumps(rep, indent=2) + "\n")
        atomic.write_text(args.report.with_suffix(".md"), text)
    return 0


def _distiller(spec):
    """The distillation the eagle3-kd/-rkd methods run after each epoch (train/ is above inference/: handed in)."""
    from draftlab.train.online_distill import DistillSpec, distill

    def run(drafter_dir, policy, rollouts, out, weighting):
        return distill(drafter_dir, policy, rollouts, out, DistillSpec(spec.steps, spec.lr, weighting, spec.ttt_steps))

    DistillSpec(spec.steps, spec.lr, "uniform", spec.ttt_steps).check()  # one-line errors before any model loads
    return run
