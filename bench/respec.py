"""ReSpec on RL rollouts: an EAGLE-3 drafter kept current by online distillation as the policy
moves, against the stale drafter, and whether speculation changes the policy's samples.

    python -m bench.respec --drafter CKPT [--policies DIR] [--problems 4] [--epochs 3]
                             [--samples 4] [--max-new-tokens 48] [--k 3] [--distill-steps 8]
                             [--distill-lr 1e-4] [--batch-sizes 1,4,16] [--report out.json]
                             [--threads N] [--quick] [--no-append]

The drafter: an EAGLE-3 checkpoint trained on the embedded SmolLM2-135M-Instruct, e.g.
``accelerate launch train/eagle.py recipes/smollm2-135m-eagle3.yaml train.max_steps=40
loss.ttt_steps=3 eval.enabled=false output_dir=runs/e3`` (its ``checkpoints/step-0000040``).
Policies: a drifting sequence (``draftlab rollouts make-policies``, RAFT updates of the target);
without ``--policies`` one is made first in a temporary directory (``--problems``, ``--epochs``).

Each epoch samples ``--samples`` rollouts per problem from that epoch's policy at temperature 1,
plainly and with each drafter drafting chains of k (``draftlab rollouts run``'s workload,
:mod:`draftlab.inference.rollouts`), then distils ``eagle3-kd`` (uniform weights) and
``eagle3-rkd`` (reward weights) toward the policy on the epoch's plain rollouts, at equal
compute (:mod:`draftlab.train.online_distill`). Output, printed and, unless ``--no-append`` or
``--quick``, written as this benchmark's section of BENCHMARKS.md:
τ, rewards and log-probabilities per epoch and method with 95 % intervals; the lossless check
against plain decoding (greedy rollouts identical; sampled rollouts' reward and log-probability
within noise: ReSpec's "drafter-induced policy degradation" tested for an exact sampler);
α_1..α_k per epoch and method, the k the draft-length rule picks per batch size from costs
measured on policy 0, and each epoch's distillation (steps, tokens, KL before and after).
``--quick``: 2 problems x 2 samples x 2 epochs x 16 tokens, two distillation steps.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from bench.machine import LoadWindow, cpu_name, load_note
from bench.runs import main_with_errors

from draftlab.errors import DraftlabError

TITLE = "Speculation on RL rollouts: a drafter following the policy (ReSpec)"
METHODS = ("plain", "eagle3-stale", "eagle3-kd", "eagle3-rkd")


def parse_args(argv):
    p = argparse.ArgumentParser(prog="bench.respec", description=__doc__.splitlines()[0])
    p.add_argument("--drafter", required=True, help="an EAGLE-3 checkpoint trained on the policies' target")
    p.add_argument("--policies", type=Path, help="policies.json (or its directory) from draftlab rollouts make-policies")
    p.add_argument("--problems", type=int, default=4, help="problems (made here without --policies; else the first N)")
    p.add_argument("--epochs", type=int, default=3, help="policies made without --policies")
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--k", type=int, default=3, help="drafts per step: the α reported are α_1..α_k")
    p.add_argument("--distill-steps", type=int, default=8)
    p.add_argument("--distill-lr", type=float, default=1e-4)
    p.add_argument("--batch-sizes", default=None, help="the draft-length rule's (default: 1, samples, problems x samples; 'none': skip)")
    p.add_argument("--report", type=Path, help="also write the report here (.json)")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    p.add_argument("--quick", action="store_true", help="2 problems x 2 samples x 2 epochs x 16 tokens, 2 distillation steps")
    p.add_argument("--no-append", action="store_true", help="print the tables; leave BENCHMARKS.md as it is")
    args = p.parse_args(argv)
    if args.quick:
        args.problems, args.samples, args.epochs, args.max_new_tokens, args.distill_steps = 2, 2, 2, 16, 2
    for flag in ("problems", "epochs", "samples", "k"):
        if getattr(args, flag) < 1:
            raise DraftlabError(f"--{flag.replace('_', '-')} must be >= 1")
    if args.max_new_tokens < 2:
        raise DraftlabError("--max-new-tokens must be >= 2")
    return args


def run(argv, args) -> int:
    import torch

    from draftlab.inference.policies import PolicySequence
    from draftlab.inference.respec import OnlineDrafters, OnlineSpec, batch_sizes
    from draftlab.inference.rollout_tasks import make_problems
    from draftlab.inference.rollouts import WorkloadSpec, run_workload, to_markdown
    from draftlab.train.online_distill import DistillSpec, distill

    if args.threads:
        torch.set_num_threads(args.threads)
    started = datetime.now(timezone.utc)
    measured = LoadWindow()
    spec = WorkloadSpec(samples=args.samples, k=args.k, methods=METHODS, max_new_tokens=args.max_new_tokens)
    spec.check()
    # before policies are made for it: the drafter, and whether it fits the target they are made from
    OnlineSpec(args.drafter, args.distill_steps, args.distill_lr).check(METHODS, "default" if args.policies is None else None)
    tmp = tempfile.TemporaryDirectory(prefix="bench-respec-")
    made = None
    if args.policies is None:
        from draftlab.train.raft import make_policies

        t = time.perf_counter()
        problems = make_problems(["count", "add", "spell", "repeat"], args.problems, 0)
        make_policies("default", Path(tmp.name) / "p", problems, args.epochs, samples=args.samples,
                      steps=1 if args.quick else 2, max_new_tokens=args.max_new_tokens)
        args.policies, made = Path(tmp.name) / "p", time.perf_counter() - t
    policies = PolicySequence.read(args.policies)
    problems = policies.problems[: args.problems]
    sizes = batch_sizes(args.batch_sizes, args.samples, len(problems))
    online_spec = OnlineSpec(args.drafter, args.distill_steps, args.distill_lr, None, sizes, Path(tmp.name) / "drafters")
    online_spec.check(METHODS, policies.location(0))
    policies.check()

    def distil(src, policy, rollouts, out, weighting):
        return distill(src, policy, rollouts, out, DistillSpec(args.distill_steps, args.distill_lr, weighting))

    online = OnlineDrafters(online_spec, list(METHODS), distill=distil)
    rep = run_workload(policies, spec, problems, online=online)
    online.close()
    window = measured.close()
    made_note = f" Policies made here by RAFT ({made:.0f} s)." if made is not None else ""
    text = (to_markdown(rep) + f"\n{len(problems)} problems × {args.samples} samples × {len(policies.entries)} epochs, "
            f"≤ {args.max_new_tokens} new tokens, temperature 1, k = {args.k}, fp32, {cpu_name()}, {torch.get_num_threads()} threads; "
            f"drafter {args.drafter}.{made_note} {load_note(window)}\n")
    print(text)
    if not (args.quick or args.no_append):
        from bench.sections import append_run

        append_run(TITLE, started, "bench.respec", argv, text)
    if args.report:
        from draftlab import atomic

        atomic.write_text(args.report, json.dumps(rep, indent=2, default=str) + "\n")
        atomic.write_text(args.report.with_suffix(".md"), text)
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main_with_errors("bench.respec", parse_args, run))
