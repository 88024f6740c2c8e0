"""The RL rollout workload (``draftlab rollouts run``): the problems of a policy sequence
(:mod:`~draftlab.inference.policies`), ``samples`` rollouts each per epoch at temperature 1, epoch
e sampled from policy e, with and without speculation, rewarded by the tasks' checkers
(:mod:`~draftlab.inference.rollout_tasks`).

Methods (``plain`` always runs: it is the baseline every other is held to):

* ``plain``: no speculation;
* ``suffix``: ``--drafter suffix``, each rollout drafting from its own prompt and output only;
* ``das-global``: one suffix trie over every problem's rollouts of the last ``window`` epochs;
* ``das``: DAS, one such trie per problem (:mod:`~draftlab.inference.das`);
* ``das-budget``: DAS with the length-aware budget (:mod:`~draftlab.inference.das_budget`):
  short requests do not speculate, medium ones draft up to k/2, long ones up to k;
* ``eagle3-stale``, ``eagle3-kd``, ``eagle3-rkd``: an EAGLE-3 drafter (``--drafter``) as given,
  or distilled toward each epoch's policy on its rollouts before the next epoch, by online KD or
  reward-weighted KD (ReSpec, :mod:`~draftlab.inference.respec`).

Rollouts run one at a time, each problem's samples in turn, every method on the same (epoch,
problem, sample) one after the other, so that the machine's slow spells fall on every method
alike. Lossless by construction, and checked: each epoch decodes every problem greedily with
every method (tokens must equal plain decoding's), and the sampled rollouts' reward and mean
token log-probability (under the policy, temperature 1) are compared with plain ones'
(:mod:`~draftlab.inference.rollout_stats`).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

import torch

from draftlab.errors import DraftlabError
from draftlab.inference.metrics import AcceptanceStats
from draftlab.inference.respec import EAGLE_METHODS, Rollout
from draftlab.inference.respec import to_markdown as respec_markdown
from draftlab.inference.rollout_stats import Z_MAX, compare, interval
from draftlab.inference.rollout_tasks import reward
from draftlab.limits import MAX_K

FORMAT = "draftlab-rollouts/1"
METHODS = ("plain", "suffix", "das-global", "das", "das-budget", *EAGLE_METHODS)
DEFAULT_METHODS = tuple(m for m in METHODS if m not in EAGLE_METHODS)  # what needs no drafter checkpoint
TEMPERATURE = 1.0


@dataclass
class WorkloadSpec:
    samples: int = 4
    k: int = 4
    window: int = 16
    methods: tuple = DEFAULT_METHODS
    max_new_tokens: int = 64
    seed: int = 0
    min_prob: float = 0.1
    greedy_check: bool = True
    max_depth: int = 24

    def check(self) -> None:
        """One-line errors for options out of range, before anything loads."""
        def whole(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        if not whole(self.window) or self.window < 1:
            raise DraftlabError(f"--window must be a number of epochs >= 1, got {self.window!r}")
        if not whole(self.k) or not 1 <= self.k <= MAX_K:
            raise DraftlabError(f"--k must be in 1..{MAX_K}, got {self.k!r}")
        if not whole(self.samples) or self.samples < 1:
            raise DraftlabError(f"--samples must be >= 1, got {self.samples!r}")
        if not whole(self.max_new_tokens) or self.max_new_tokens < 2:
            raise DraftlabError(f"--max-new-tokens must be >= 2, got {self.max_new_tokens!r}")
        if not 0.0 <= self.min_prob <= 1.0:
            raise DraftlabError(f"--min-prob must be in [0, 1], got {self.min_prob!r}")
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown:
            raise DraftlabError(f"--methods: unknown method {unknown[0]!r} (methods: {', '.join(METHODS)})")


def parse_methods(spec: str) -> tuple:
    """The methods named (comma-separated), ``plain`` first whether named or not."""
    names = [s.strip() for s in spec.split(",") if s.strip()]
    return ("plain", *dict.fromkeys(n for n in names if n != "plain"))


def make_proposers(spec: WorkloadSpec) -> dict:
    """Method -> its proposer (None: plain decoding), each built once for the whole run: a DAS
    method's history lives across epochs. The EAGLE-3 methods' are built per epoch
    (:class:`~draftlab.inference.respec.OnlineDrafters`), next to that epoch's policy."""
    from draftlab.inference.das import DASProposer, RolloutHistory
    from draftlab.inference.das_budget import LengthBudget
    from draftlab.inference.suffix import SuffixProposer

    def das(scope, budget=None):
        return DASProposer(RolloutHistory(spec.window, scope, max_depth=spec.max_depth), budget=budget, min_prob=spec.min_prob)

    build = {
        "plain": lambda: None,
        "suffix": lambda: SuffixProposer(max_depth=spec.max_depth, min_prob=spec.min_prob),
        "das-global": lambda: das("global"),
        "das": lambda: das("problem"),
        "das-budget": lambda: das("problem", LengthBudget(k_medium=max(1, spec.k // 2), k_long=spec.k)),
    }
    return {m: build[m]() for m in spec.methods if m not in EAGLE_METHODS}


def prompt_of(tokenizer, problem) -> list[int]:
    from draftlab.inference.prompts import chat_prompt_ids

    return chat_prompt_ids(tokenizer, [{"role": "user", "content": problem.question}])


def decode(target, proposer, prompt: list[int], spec: WorkloadSpec, temperature: float, seed: int):
    """One rollout: plain decoding without a proposer, else chains of ``spec.k``."""
    from draftlab.inference.decoder import SpeculativeDecoder, generate_plain
    from draftlab.inference.shapes import Chain

    eos = target.tokenizer.eos_token_id
    if proposer is None:
        return generate_plain(target, prompt, spec.max_new_tokens, temperature=temperature, seed=seed, eos_token_id=eos)
    return SpeculativeDecoder(target, proposer).generate(prompt, spec.max_new_tokens, Chain(spec.k), temperature=temperature,
                                                         seed=seed, eos_token_id=eos)


@torch.no_grad()
def token_logprob(target, prompt: list[int], response: list[int]) -> float:
    """Mean log-probability of ``response``'s tokens under ``target`` at temperature 1 (what an
    RL trainer recomputes as the old policy's log-probabilities)."""
    ids = torch.tensor([prompt + response], device=target.device)
    logits = target(ids, logits="all").logits[0, len(prompt) - 1 : -1].float()
    logp = torch.log_softmax(logits / TEMPERATURE, dim=-1)
    return float(logp.gather(-1, ids[0, len(prompt) :, None]).mean())


@dataclass
class _Cell:
    """One (epoch, method)'s rollouts."""

    stats: AcceptanceStats = field(default_factory=AcceptanceStats)
    rewards: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    strata: list = field(default_factory=list)
    responses: list = field(default_factory=list)  # (prompt, tokens): what the epoch's distillation reads
    tokens: int = 0
    seconds: float = 0.0
    greedy: list = field(default_factory=list)  # per problem: equal to plain greedy decoding


def _seed(spec: WorkloadSpec, epoch: int, problem: int, sample: int) -> int:
    return (spec.seed * 1_000_003 + epoch * 10_007 + problem * 101 + sample) % (2**31)


def run_workload(policies, spec: WorkloadSpec, problems=None, log=None, online=None) -> dict:
    """Every epoch of ``policies`` (a :class:`~draftlab.inference.policies.PolicySequence`) over
    ``problems`` (default: the sequence's own); the report as a dict (:func:`to_markdown`).
    ``online``: the EAGLE-3 methods' :class:`~draftlab.inference.respec.OnlineDrafters`, needed
    when ``spec.methods`` names one."""
    spec.check()
    problems = list(problems if problems is not None else policies.problems)
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    if online is None and any(m in EAGLE_METHODS for m in spec.methods):
        raise DraftlabError("the eagle3-* methods need their drafters (OnlineDrafters)")
    built = make_proposers(spec)
    t_start = time.perf_counter()
    cells: dict[tuple[int, str], _Cell] = {}
    for epoch in range(len(policies.entries)):
        target = policies.load(epoch)
        prompts = [prompt_of(target.tokenizer, p) for p in problems]
        # untimed: a new target's first decoding steps measure its small-row plan, which would bill the first method
        decode(target, None, prompts[0], WorkloadSpec(max_new_tokens=2), 0.0, 0)
        eagles = online.proposers(target, spec.k) if online is not None else {}
        proposers = {m: built[m] if m in built else eagles[m] for m in spec.methods}
        if online is not None and online.methods and online.calibration is None and online.spec.batch_sizes:
            # the rollout engine's batches: the epoch's prompts, each ``samples`` times
            online.calibrate(target, eagles[online.methods[0]], [p for p in prompts for _ in range(spec.samples)], spec.k,
                             spec.max_new_tokens, target.tokenizer.eos_token_id, spec.seed, log)
        rules = {m: online.rule() for m in eagles}
        for p in proposers.values():
            if getattr(p, "history", None) is not None:
                p.history.begin_epoch(epoch)
        for m in spec.methods:
            cells[epoch, m] = _Cell()
        for pi, (problem, prompt) in enumerate(zip(problems, prompts)):
            for s in range(spec.samples):
                seed = _seed(spec, epoch, pi, s)
                for m, proposer in proposers.items():
                    res = decode(target, proposer, prompt, spec, TEMPERATURE, seed)
                    if getattr(proposer, "learn", False):
                        proposer.history.close(prompt, res.tokens)
                    cell = cells[epoch, m]
                    cell.stats.add_many(res.accept_lengths, res.num_drafted)
                    if rules.get(m) is not None:
                        for d, n in zip(res.num_drafted, res.accept_lengths):
                            rules[m].observe([d], [n])
                    cell.rewards.append(reward(problem, target.tokenizer.decode(res.tokens, skip_special_tokens=True)))
                    cell.logprobs.append(token_logprob(target, prompt, res.tokens))
                    cell.strata.append((epoch, problem.id))
                    cell.responses.append((prompt, res.tokens))
                    cell.tokens += len(res.tokens)
                    cell.seconds += res.total_time
            if spec.greedy_check:
                ref = decode(target, None, prompt, spec, 0.0, 0).tokens
                for m, proposer in proposers.items():
                    frozen = proposer.frozen() if hasattr(proposer, "frozen") else proposer
                    same = m == "plain" or decode(target, frozen, prompt, spec, 0.0, 0).tokens == ref
                    cells[epoch, m].greedy.append(same)
        log(f"epoch {epoch} ({policies.entries[epoch]}): " + ", ".join(
            f"{m} τ {cells[epoch, m].stats.tau:.2f} reward {sum(cells[epoch, m].rewards) / len(cells[epoch, m].rewards):.2f}"
            for m in spec.methods))
        for m in eagles:
            online.record(epoch, m, rules[m])
        if eagles and epoch + 1 < len(policies.entries):
            plain = cells[epoch, "plain"]
            online.after_epoch(epoch, target, [Rollout(p, r, w) for (p, r), w in zip(plain.responses, plain.rewards)], log)
        del target, eagles, proposers
    return _report(policies, spec, problems, cells, time.perf_counter() - t_start, online)


def _report(policies, spec: WorkloadSpec, problems, cells: dict, wall: float, online=None) -> dict:
    epochs = sorted({e for e, _ in cells})
    rows = []
    for e in epochs:
        plain = cells[e, "plain"]
        for m in spec.methods:
            c = cells[e, m]
            rows.append({
                "epoch": e, "policy": policies.entries[e], "method": m, "tau": c.stats.tau,
                "accepted_per_drafted": c.stats.num_accepted / c.stats.num_drafted if c.stats.num_drafted else 0.0,
                "alpha": c.stats.alpha[: spec.k],
                "reward": interval(c.rewards, c.strata), "logprob": interval(c.logprobs, c.strata),
                "tokens": c.tokens, "wall_s": c.seconds, "speedup": plain.seconds / c.seconds if c.seconds > 0 else None,
                "greedy_match": f"{sum(c.greedy)}/{len(c.greedy)}" if spec.greedy_check else None,
            })
    lossless = {}
    for m in spec.methods[1:]:
        def pooled(method, key):
            vals = [v for e in epochs for v in getattr(cells[e, method], key)]
            return vals, [s for e in epochs for s in cells[e, method].strata]

        r = compare(pooled("plain", "rewards"), pooled(m, "rewards"))
        lp = compare(pooled("plain", "logprobs"), pooled(m, "logprobs"))
        greedy = [g for e in epochs for g in cells[e, m].greedy]
        lossless[m] = {"reward_diff": r, "logprob_diff": lp, "greedy_match": f"{sum(greedy)}/{len(greedy)}",
                       "consistent": r["consistent"] and lp["consistent"] and all(greedy)}
    return {
        "format": FORMAT, "policies": str(policies.path), "policy_entries": list(policies.entries),
        "problems": [p.id for p in problems], "samples": spec.samples, "k": spec.k, "window": spec.window,
        "max_new_tokens": spec.max_new_tokens, "temperature": TEMPERATURE, "min_prob": spec.min_prob,
        "methods": list(spec.methods), "z_max": Z_MAX, "rows": rows, "lossless": lossless, "wall_s": wall,
        **({"respec": online.report()} if online is not None and online.methods else {}),
    }


def to_markdown(rep: dict) -> str:
    def ci(x):
        return f"{x['mean']:.3f} [{x['lo']:.3f}, {x['hi']:.3f}]"

    lines = [f"Rollouts: {len(rep['problems'])} problems × {rep['samples']} samples × {len(rep['policy_entries'])} epochs, "
             f"temperature {rep['temperature']:g}, k = {rep['k']}, window = {rep['window']} epochs, "
             f"≤ {rep['max_new_tokens']} new tokens.", "",
             "| epoch | method | τ | reward [95 % CI] | mean token log-prob [95 % CI] | tokens | wall s | speedup | greedy = plain |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rep["rows"]:
        speedup = f"{r['speedup']:.2f}×" if r["speedup"] else "–"
        lines.append(f"| {r['epoch']} | {r['method']} | {r['tau']:.2f} | {ci(r['reward'])} | {ci(r['logprob'])} | {r['tokens']} | "
                     f"{r['wall_s']:.1f} | {speedup} | {r['greedy_match'] or '–'} |")
    lines += ["", f"Lossless against plain (all epochs; consistent: |z| ≤ {rep['z_max']} on both, greedy identical):", "",
              "| method | reward diff [95 % CI] | log-prob diff [95 % CI] | greedy = plain | consistent |", "|---|---|---|---|---|"]
    for m, v in rep["lossless"].items():
        d = lambda x: f"{x['diff']:+.3f} [{x['lo']:+.3f}, {x['hi']:+.3f}] (z {x['z']:+.2f})"  # noqa: E731
        lines.append(f"| {m} | {d(v['reward_diff'])} | {d(v['logprob_diff'])} | {v['greedy_match']} | {'yes' if v['consistent'] else 'NO'} |")
    if "respec" in rep:
        lines += ["", respec_markdown(rep)]
    return "\n".join(lines) + "\n"
