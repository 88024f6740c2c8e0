"""The layer-skip search: which of the target's decoder layers a self-speculative draft skips
(SWIFT, Xia et al. 2025, with Draft & Verify's known-set probes), and the run a layerskip recipe is.

- Proxy (:class:`Calibration`, SWIFT's): calibration prompts from the recipe's training data are
  prefilled by the full target into a KV cache and continued by the target's own greedy decoding;
  a candidate runs every continuation in ONE parallel forward with its layers skipped, attending
  to the prompts' full-model keys and values. Its score is the share of continuation positions
  whose argmax equals the full model's.
- Costs (:class:`StepCosts`): a draft step over the layers kept and a verify forward of k + 1
  inputs, relative to a plain step, timed on this machine with the decoder's cache.
- Objective (:func:`expected_speedup`): with the score as a per-draft acceptance a, a chain of k
  yields ``(1 - a^(k+1)) / (1 - a)`` tokens for ``k c + v_k`` plain steps; the best k counts.
- Search (:class:`LayerSearch`): from every other layer, it first probes the fixed fractions
  (a middle block or spread layers), then random sets, moves from the best set (add, drop or swap
  layers) and, every ``ucb_every``-th candidate, the best of a pool by an upper confidence bound
  of a Bayesian linear model of the score over the skipped layers. The first and last layers
  are kept, as SWIFT keeps them. A better objective replaces the best set.

:func:`run` is a layerskip recipe: load, calibrate, time, search within ``train.max_steps``
candidates and ``train.time_limit_minutes``, write the checkpoint (skip set and search record,
no weights), then measure real speculative decoding on held-out prompts for the searched set,
every other layer, and the best fixed fraction, into the report under ``output_dir/eval``.
"""

from __future__ import annotations

import math
import os
import random
import shutil
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from draftlab.errors import DraftlabError
from draftlab.train.variants import TRAINERS

# the UCB model's noise variance and prior precision (SWIFT's GP takes alpha 1e-2)
NOISE = 1e-2
PRIOR = 1.0
POOL = 128  # candidates a UCB pick ranks
TIMING_REPEATS = 15


# ---------------------------------------------------------------------- proxy
class Calibration:
    """Prompts prefilled by the full target (one ragged cache row each) and the target's greedy
    continuation of each: :meth:`score` is a candidate's top-1 agreement with the full model."""

    @torch.no_grad()
    def __init__(self, target, prompts: list[list[int]], tokens: int, eos_token_id=None):
        from draftlab.inference.decoder import generate_plain_batch

        self.target, self.prompts = target, prompts
        rows = generate_plain_batch(target, prompts, tokens, eos_token_id=eos_token_id).rows
        T, dev = max(len(r.tokens) for r in rows), target.device
        self.ids = torch.zeros(len(prompts), T, dtype=torch.long, device=dev)
        self.valid = torch.zeros(len(prompts), T, dtype=torch.bool, device=dev)
        for s, r in enumerate(rows):
            self.ids[s, : len(r.tokens)] = torch.tensor(r.tokens, device=dev)
            self.valid[s, : len(r.tokens)] = True
        self.cache = target.new_cache(len(prompts), max(len(p) for p in prompts) + T, ragged=True)
        for s, p in enumerate(prompts):
            target(torch.tensor([p], device=dev), cache=self.cache.row(s), logits=None)
            self.cache.lengths[s] = len(p)
        self.past = list(self.cache.lengths)
        self.positions = int(self.valid.sum())
        self.full = self._argmax(frozenset())

    def _argmax(self, skip: frozenset) -> torch.Tensor:
        logits = self.target(self.ids, cache=self.cache, skip=skip, logits="all").logits
        self.cache.crop(self.past)  # the continuation's slots are rewritten by the next candidate
        return logits.max(-1).indices

    @torch.no_grad()
    def score(self, skip) -> float:
        return float(((self._argmax(frozenset(skip)) == self.full) & self.valid).sum()) / self.positions


# ---------------------------------------------------------------------- costs
@dataclass
class StepCosts:
    """Median seconds of the target's forwards over one row with the decoder's cache: ``step_s[i]``
    for i + 1 inputs with every layer, ``head_s`` for one input with none (embedding, final norm,
    lm_head)."""

    step_s: list[float]
    head_s: float
    num_layers: int

    def draft(self, kept: int) -> float:
        """One draft step over ``kept`` layers, in plain steps."""
        layer = (self.step_s[0] - self.head_s) / self.num_layers
        return (self.head_s + kept * layer) / self.step_s[0]

    def verify(self, k: int) -> float:
        """The verify forward of k drafts (k + 1 inputs), in plain steps."""
        return self.step_s[k] / self.step_s[0]

    def record(self) -> dict:
        ms = lambda s: round(1000 * s, 3)  # noqa: E731
        return {"step_ms": [ms(s) for s in self.step_s], "head_ms": ms(self.head_s),
                "layer_ms": ms((self.step_s[0] - self.head_s) / self.num_layers)}


@torch.no_grad()
def measure_costs(target, context: list[int], max_chain: int, repeats: int = TIMING_REPEATS) -> StepCosts:
    """Time forwards of 1..max_chain + 1 inputs after ``context`` in a one-row ragged cache (as the
    decoder runs them), and one that skips every layer: medians of ``repeats`` rounds that each
    time every kind once (interleaved, so the machine's slow spells slow them alike), after a
    warm-up round."""
    dev = target.device
    cache = target.new_cache(1, len(context) + max_chain + 2, ragged=True)
    target(torch.tensor([context], device=dev), cache=cache, logits=None)
    past = list(cache.lengths)
    ids = torch.tensor([context[-1:] * (max_chain + 1)], device=dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    kinds = [(T, frozenset()) for T in range(1, max_chain + 2)] + [(1, frozenset(range(target.num_layers)))]
    times: list[list[float]] = [[] for _ in kinds]
    for round_ in range(repeats + 1):
        for i, (T, skip) in enumerate(kinds):
            sync()
            t0 = time.perf_counter()
            target(ids[:, :T], cache=cache, skip=skip, logits="last")
            sync()
            if round_:  # the first round packs weights and warms caches
                times[i].append(time.perf_counter() - t0)
            cache.crop(past)
    medians = [statistics.median(t) for t in times]
    return StepCosts(medians[:-1], medians[-1], target.num_layers)


def expected_speedup(score: float, kept: int, costs: StepCosts, max_chain: int) -> tuple[float, int]:
    """(tokens per plain-step time, the chain length k giving it) for a per-draft acceptance
    ``score`` and a draft over ``kept`` layers."""
    a, c = min(max(score, 0.0), 1 - 1e-9), costs.draft(kept)
    return max((((1 - a ** (k + 1)) / (1 - a)) / (k * c + costs.verify(k)), k) for k in range(1, max_chain + 1))


# ---------------------------------------------------------------------- candidate sets
def searchable(num_layers: int) -> list[int]:
    """The layers the search may skip: all but the first and the last (SWIFT), all but the first
    for a 2-layer target."""
    return list(range(1, num_layers - 1)) or [num_layers - 1]


def fixed_sets(num_layers: int, fractions: list[float]) -> dict[str, list[int]]:
    """For each fraction f, round(f n) of the n searchable layers: a block in the middle, and
    spread evenly (every n/m-th)."""
    space = searchable(num_layers)
    n, out = len(space), {}
    for f in fractions:
        m = min(n, max(1, round(f * n)))
        out[f"middle {f:g}"] = space[(n - m) // 2 : (n - m) // 2 + m]
        out[f"spread {f:g}"] = [space[math.floor((i + 0.5) * n / m)] for i in range(m)]
    return out


@dataclass
class Candidate:
    skip: tuple[int, ...]
    score: float
    speedup: float
    k: int
    how: str  # start | fixed | random | local | ucb
    index: int = 0  # its place among the candidates scored

    def record(self) -> dict:
        return {"candidate": self.index, "skip": list(self.skip), "proxy": round(self.score, 4),
                "expected_speedup": round(self.speedup, 4), "k": self.k, "how": self.how}


@dataclass
class LayerSearch:
    """Scores candidates (each set once) and keeps the best by expected speedup."""

    calibration: Calibration
    costs: StepCosts
    num_layers: int
    cfg: object  # LayerSkipSearch
    rng: random.Random
    seen: dict[tuple, Candidate] = field(default_factory=dict)
    best: Candidate | None = None
    improvements: list[Candidate] = field(default_factory=list)

    def __post_init__(self):
        self.space = searchable(self.num_layers)

    def score(self, skip, how: str) -> Candidate:
        key = tuple(sorted(skip))
        if key not in self.seen:
            s = self.calibration.score(key)
            speedup, k = expected_speedup(s, self.num_layers - len(key), self.costs, self.cfg.max_chain)
            self.seen[key] = Candidate(key, s, speedup, k, how, len(self.seen))
            if self.best is None or speedup > self.best.speedup:
                self.best = self.seen[key]
                self.improvements.append(self.best)
        return self.seen[key]

    # ---- proposals
    def _random(self) -> tuple:
        n = len(self.best.skip) + self.rng.randint(-3, 3)
        return tuple(sorted(self.rng.sample(self.space, min(len(self.space), max(1, n)))))

    def _local(self) -> tuple:
        s = set(self.best.skip)
        out_ = [i for i in self.space if i not in s]
        for _ in range(self.rng.choice((1, 1, 2))):
            move = self.rng.choice(["add", "drop", "swap"])
            if move in ("drop", "swap") and len(s) > 1:
                s.discard(self.rng.choice(sorted(s)))
            if move in ("add", "swap") and out_:
                s.add(self.rng.choice(out_))
            out_ = [i for i in self.space if i not in s]
        return tuple(sorted(s))

    def _ucb(self) -> tuple | None:
        """The unseen candidate of a pool (random sets and moves) whose expected speedup at the
        score's upper confidence bound is highest."""
        pool = {c for c in (self._random() if i % 2 else self._local() for i in range(POOL)) if c not in self.seen}
        if not pool:
            return None
        index = {layer: i for i, layer in enumerate(self.space)}

        def features(sets):
            x = torch.zeros(len(sets), len(self.space) + 1, dtype=torch.float64)
            x[:, -1] = 1.0
            for r, s in enumerate(sets):
                x[r, [index[i] for i in s if i in index]] = 1.0
            return x

        seen = list(self.seen.values())
        X, y = features([c.skip for c in seen]), torch.tensor([c.score for c in seen], dtype=torch.float64)
        precision = PRIOR * torch.eye(X.shape[1], dtype=torch.float64) + X.T @ X / NOISE
        cov = torch.linalg.inv(precision)
        w = cov @ X.T @ (y - y.mean()) / NOISE
        cands = sorted(pool)
        Z = features(cands)
        mean = Z @ w + y.mean()
        sd = ((Z @ cov) * Z).sum(-1).clamp_min(0).sqrt()
        upper = (mean + self.cfg.kappa * sd).tolist()
        gains = [expected_speedup(u, self.num_layers - len(c), self.costs, self.cfg.max_chain)[0] for c, u in zip(cands, upper)]
        return cands[max(range(len(cands)), key=gains.__getitem__)]

    def propose(self, i: int) -> tuple[tuple | None, str]:
        """The i-th proposal after the probes, unseen (None: none found, the space is spent)."""
        if i % self.cfg.ucb_every == 0 and len(self.seen) >= 4:
            return self._ucb(), "ucb"
        how = "random" if self.rng.random() < 1 / 3 else "local"
        for _ in range(64):
            c = self._random() if how == "random" else self._local()
            if c not in self.seen:
                return c, how
        return self._ucb(), "ucb"


# ---------------------------------------------------------------------- the run
def calibration_prompts(samples: list[dict], n: int, seed: int) -> list[list[int]]:
    """The prompts (tokens before the first assistant token) of ``n`` training samples, a seeded draw."""
    prompts = []
    for s in samples:
        mask = s["loss_mask"]
        if mask.any():
            first = int(mask.nonzero()[0, 0])
            if first > 0:
                prompts.append(s["input_ids"][:first].tolist())
    if not prompts:
        raise DraftlabError("data: no training sample has a prompt before an assistant turn to calibrate the search on")
    random.Random(seed).shuffle(prompts)
    return prompts[:n]


@TRAINERS.register("layerskip")
def run(recipe) -> dict:
    """A layerskip recipe, from nothing to the checkpoint and its report."""
    from draftlab import atomic
    from draftlab import checkpoint as ckpt
    from draftlab.data.dataset import build_samples
    from draftlab.inference.decoding_spec import check_spec, field_names
    from draftlab.inference.layerskip import LayerSkipProposer
    from draftlab.inference.shapes import check_shape
    from draftlab.inference.prompts import load_prompts
    from draftlab.models.layerskip import every_other_layer
    from draftlab.models.target import Target
    from draftlab.train.metrics_log import MetricLogger

    if os.environ.get("WORLD_SIZE", "1") != "1":
        raise DraftlabError("layerskip: the layer search runs in one process: launch it with --num_processes 1")
    algo, cfg, search_cfg = recipe.algorithm_configs()
    run_dir, e = Path(recipe.output_dir), recipe.eval
    device = recipe.target.device if recipe.target.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if e.enabled:
        check_spec(e, field_names("eval."), seed=recipe.seed, device=device)  # now that the device is known
        check_shape(e.shape(), LayerSkipProposer.shapes, algo.algorithm)
    if device == "cpu":
        torch.set_num_threads(os.cpu_count() or 1)  # one process: every core, as the trainer's launch gives a lone process
    print(f"draftlab: {algo.algorithm} search in {run_dir}, device {device}", flush=True)
    target = Target.load(recipe.target.model, recipe.target.dtype, device, recipe.target.trust_remote_code)
    start = algo.build(cfg, target)  # the skip set checked against the target before any work
    samples = build_samples(recipe.data, target.tokenizer, target=target if recipe.data.regenerate else None,
                            regenerate_path=run_dir / "regenerated.jsonl")
    print(f"data: {samples.report.get('summary')}", flush=True)
    prompts = load_prompts(e.data, target.tokenizer, e.num_prompts, data_spec=recipe.data) if e.enabled else []
    logger = MetricLogger(run_dir, recipe, True)
    t0 = time.perf_counter()

    calib = Calibration(target, calibration_prompts(samples.train, search_cfg.calibration_prompts, recipe.seed),
                        search_cfg.calibration_tokens, target.tokenizer.eos_token_id)
    context = calib.prompts[0] + calib.ids[0][calib.valid[0]].tolist()  # a decoding's context: prompt and reply
    costs = measure_costs(target, context, search_cfg.max_chain)
    L = target.num_layers
    c = costs.record()
    print(f"calibration: {calib.ids.shape[0]} prompts, {calib.positions} positions; plain step {c['step_ms'][0]:.1f} ms, "
          f"of which {c['layer_ms']:.2f} ms per layer and {c['head_ms']:.1f} ms outside the layers; verify of "
          f"{search_cfg.max_chain} drafts {costs.verify(search_cfg.max_chain):.2f} steps", flush=True)
    search = LayerSearch(calib, costs, L, search_cfg, random.Random(recipe.seed))
    chosen = search.score(start.skip, "start")
    _log(logger, search, chosen, t0)
    fixed = []
    for name, s in fixed_sets(L, search_cfg.fractions).items():
        new = tuple(sorted(s)) not in search.seen
        fixed.append((name, search.score(s, "fixed")))
        if new:
            _log(logger, search, fixed[-1][1], t0)
    best_fixed = max(fixed, key=lambda f: f[1].speedup)
    print(f"start: skip {list(chosen.skip)}, proxy {chosen.score:.3f}, expected speedup {chosen.speedup:.3f} at k={chosen.k}; "
          f"best fixed fraction: {best_fixed[0]}, proxy {best_fixed[1].score:.3f}, expected speedup {best_fixed[1].speedup:.3f}",
          flush=True)
    stopped = "no search (drafter.search false)"
    if cfg.search:
        stopped = _search(search, recipe, logger, t0)
        chosen = search.best
    elapsed = time.perf_counter() - t0
    record = {
        "proxy": "top-1 agreement with the full model, teacher-forced over the target's greedy continuations",
        "objective": "expected speedup (1 - a^(k+1)) / ((1 - a)(k c + v_k)), best k in 1..max_chain",
        "calibration": {"prompts": int(calib.ids.shape[0]), "positions": calib.positions},
        "costs": costs.record(),
        "candidates": len(search.seen),
        "seconds": round(elapsed, 1),
        "stopped": stopped,
        "best": chosen.record(),
        "improvements": [c.record() for c in search.improvements],
        "fixed": {name: c.record() for name, c in fixed},
    }
    drafter = algo(list(chosen.skip), L, cfg.adaptive_exit, record)
    step = len(search.seen)
    metrics = {"step": step, "proxy": chosen.score, "expected_speedup": chosen.speedup, "k": chosen.k,
               "skipped": len(chosen.skip), "elapsed_s": elapsed}
    path = ckpt.step_dir(run_dir, step)
    with atomic.directory(path) as tmp:
        ckpt.save_weights(tmp, {}, ckpt.checkpoint_meta(drafter, target.identity, recipe.model_dump(mode="json"), step, metrics))
    for old in ckpt.list_checkpoints(run_dir):  # an earlier search's in this output_dir: this one replaces it
        if old != path:
            shutil.rmtree(old)
    print(f"search: {len(search.seen)} candidates in {elapsed:.0f} s ({stopped}); skip {list(chosen.skip)} "
          f"({len(chosen.skip)} of {L}), proxy {chosen.score:.3f}, expected speedup {chosen.speedup:.2f} at k={chosen.k}; {path}",
          flush=True)
    if e.enabled:
        sets = {"searched": (chosen, path), "every other layer": (search.score(every_other_layer(L), "start"), None),
                f"fixed {best_fixed[0]}": (best_fixed[1], None)}
        report = _measure(recipe, target, prompts, sets, step, cfg.adaptive_exit)
        metrics["eval"] = {k: report[k] for k in ("tau", "a", "alpha", "speedup", "num_prompts") if k in report}
        logger.log({"step": step, "eval_tau": report["tau"], "eval_alpha": report["alpha"], "eval_speedup": report.get("speedup")})
        meta = ckpt.read_meta(path)
        meta["metrics"]["eval"] = metrics["eval"]
        atomic.write_json(path / ckpt.META, meta)
    with atomic.directory(run_dir / "checkpoints" / "best") as tmp:
        for f in sorted(path.rglob("*")):
            if f.is_file():
                atomic.copy_file(f, tmp / f.relative_to(path))
    logger.close()
    return metrics


def _search(search: LayerSearch, recipe, logger, t0: float) -> str:
    """Propose and score candidates until a bound; why it stopped."""
    t, cfg = recipe.train, search.cfg
    limit = t.time_limit_minutes * 60 if t.time_limit_minutes else math.inf
    bar = tqdm(total=t.max_steps, initial=len(search.seen), desc="search layerskip", dynamic_ncols=True)
    since, i = 0, 0
    try:
        while True:
            if t.max_steps is not None and len(search.seen) >= t.max_steps:
                return "train.max_steps"
            if time.perf_counter() - t0 >= limit:
                return "train.time_limit_minutes"
            if since >= cfg.patience:
                return f"{cfg.patience} candidates without a better one"
            i += 1
            skip, how = search.propose(i)
            if skip is None:
                return "every candidate near the best was scored"
            before = search.best
            c = search.score(skip, how)
            since = 0 if search.best is not before else since + 1
            if search.best is not before:
                bar.write(f"candidate {c.index} ({how}): skip {list(c.skip)}, proxy {c.score:.3f}, "
                          f"expected speedup {c.speedup:.3f} at k={c.k}")
            if c.index % t.log_every == 0:
                _log(logger, search, c, t0)
            bar.set_postfix(best=f"{search.best.speedup:.3f}", skipped=len(search.best.skip), proxy=f"{search.best.score:.3f}")
            bar.update(1)
    finally:
        bar.close()


def _log(logger, search: LayerSearch, c: Candidate, t0: float) -> None:
    logger.log({"step": c.index, "proxy": c.score, "expected_speedup": c.speedup, "k": c.k, "skipped": len(c.skip), "how": c.how,
                "best_expected_speedup": search.best.speedup, "elapsed_s": time.perf_counter() - t0})


def _measure(recipe, target, prompts, sets: dict, step: int, adaptive_exit: bool) -> dict:
    """Speculative decoding with each set on the held-out prompts (a set equal to one measured
    before is not decoded again); the searched set's report (written under ``output_dir/eval``,
    the others in its ``compared`` section and its plot). Only the searched set is measured by
    batch size too, when the recipe asks for it."""
    from draftlab.inference.evaluate import acceptance_report
    from draftlab.inference.layerskip import LayerSkipProposer
    from draftlab.inference.proposer import load_proposer
    from draftlab.models.layerskip import LayerSkip
    from draftlab.train.evaluation import report_checkpoint, write_checkpoint_report

    e = recipe.eval
    alone = e.model_copy(update={"batch_sizes": None, "adaptive": False})
    reports = {}
    for name, (cand, ckpt_dir) in sets.items():
        same = next((n for n, (c, _) in sets.items() if n in reports and c.skip == cand.skip), None)
        if same is not None:
            reports[name] = reports[same]
            continue
        print(f"eval: {name}, skip {list(cand.skip)} ({len(prompts)} prompts)", flush=True)
        if ckpt_dir is not None:  # the searched set, as `draftlab eval` loads it
            reports[name] = report_checkpoint(recipe, target, prompts, load_proposer(ckpt_dir, target, e.shape()), ckpt_dir, step)
        else:
            proposer = LayerSkipProposer(LayerSkip(list(cand.skip), target.num_layers, adaptive_exit))
            reports[name] = acceptance_report(target, proposer, prompts, alone, seed=recipe.seed,
                                              eos_token_id=target.tokenizer.eos_token_id, data=e.data, label=name)
    report = reports["searched"]
    measured = ("tau", "a", "alpha", "speedup", "greedy_match", "tokens_per_s", "baseline_tokens_per_s")
    report["compared"] = {
        name: {"skip": list(cand.skip), "proxy": cand.score, "expected_speedup": cand.speedup,
               **{k: reports[name].get(k) for k in measured}}
        for name, (cand, _) in sets.items()
    }
    others = list({id(r): r for r in reports.values() if r is not report}.values())
    write_checkpoint_report(recipe, report, others, note=f"\n{comparison_table(report['compared'])}")
    return report


def comparison_table(compared: dict) -> str:
    """Markdown: one row per skip set measured."""
    k = max((len(c.get("alpha") or []) for c in compared.values()), default=0)
    head = ["set", "skipped", "proxy", "expected", "tau"] + [f"α{j}" for j in range(1, k + 1)] + ["speedup", "greedy match"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    f = lambda x, d=2: "-" if x is None else f"{x:.{d}f}" if isinstance(x, float) else str(x)  # noqa: E731
    for name, c in compared.items():
        alpha = list(c.get("alpha") or []) + [None] * (k - len(c.get("alpha") or []))
        lines.append("| " + " | ".join([name, str(len(c["skip"])), f(c["proxy"], 3), f(c["expected_speedup"]), f(c.get("tau"))]
                                        + [f(a) for a in alpha] + [f(c.get("speedup")), f(c.get("greedy_match"))]) + " |")
    return "\n".join(lines) + "\n"
